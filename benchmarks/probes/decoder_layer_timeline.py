"""Where one launch of the one-launch decoder layer spends its time: the per-phase timeline
every launch leaves in its workspace (globaltimer stamps of each block at each phase
boundary, cpp/ops/decoder_layer/plan.h), for one layer of a benchmark model.

    python benchmarks/probes/decoder_layer_timeline.py [--model llama-2-7b] [--batch 1] [--ctx 4096]

Prints, per boundary, when the first / median / last block passed it (us from the first
block's start), and the HBM bytes of each GEMV phase over its span.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from decoder_layer import MODELS, layer_weights  # noqa: E402

from jax_cluster import _extension  # noqa: E402
from jax_cluster.ops import decoder_layer as op  # noqa: E402

MARKS = ["start", "up front done", "attention done", "merge done", "o-proj done (parallel: end)",
         "MLP up done", "end"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    family, d, hq, hkv, dh, f, rot = MODELS[a.model]
    dtype = jnp.float16
    w = layer_weights(jax.random.key(0), family, d, hq, hkv, dh, f, dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((a.batch, d)), dtype)
    kc, vc = (jnp.asarray(rng.standard_normal((a.batch, hkv, a.ctx, dh)) * 0.5, dtype) for _ in range(2))
    lengths = jnp.full((a.batch,), a.ctx - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rot, 2) / rot), jnp.float32)
    parallel = family == "gpt_neox"
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rot, rope_layout="half",
              scale=None, parallel_residual=parallel, gelu_approximate=False)
    fn = jax.jit(lambda x, kc, vc: op._custom_call(x, w, kc, vc, lengths, inv_freq, return_workspace=True, **kw))
    for _ in range(5):
        _, _, _, ws = fn(x, kc, vc)
    ws = np.asarray(ws)
    plan = _extension.plans().decoder_layer(a.batch, d, hq, hkv, dh, a.ctx, f, 1 if parallel else 0, parallel,
                                            "float16")
    off, n_marks = plan["timeline_offset"], plan["timeline_marks"]
    tl = ws[off:].view(np.uint64)
    grid = int(tl[0])
    stamps = tl[1:1 + grid * n_marks].reshape(grid, n_marks).astype(np.int64)
    t0 = stamps[:, 0].min()  # marks left by an earlier launch are older than this one's start
    used = [i for i in range(len(MARKS)) if np.all(stamps[:, i] >= t0) and (not parallel or i <= 4)]
    print(f"{a.model} b{a.batch} ctx{a.ctx}: {grid} blocks, {jax.devices()[0].device_kind}")
    print(f"{'boundary':32s} {'first':>8s} {'median':>8s} {'last':>8s}  (us)")
    for i in used:
        col = (stamps[:, i] - t0) / 1e3
        print(f"{MARKS[i]:32s} {col.min():8.1f} {np.median(col):8.1f} {col.max():8.1f}")


if __name__ == "__main__":
    main()
