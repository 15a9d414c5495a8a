"""Pallas' GQA decode attention alone, per (k_splits, block_k): does the tuner's "pallas"
candidate leave speed on the table with the kernel's defaults (16 splits, 128-token blocks)?
20 calls written out inside one jit, timed back to back (tuning.steady_seconds).

    python3 benchmarks/micro/pallas_decode_splits.py [batch:hkv:group:ctx ...]
"""

from __future__ import annotations

import itertools
import sys
import warnings

import jax
import jax.numpy as jnp

from jax_cluster import tuning

warnings.simplefilter("ignore", DeprecationWarning)
from jax.experimental.pallas.ops.gpu import decode_attention  # noqa: E402

CALLS = 20


def time_case(batch, hkv, group, ctx, k_splits, block_k, dtype=jnp.float16, dh=128):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, hkv * group, dh), dtype)
    kc = jax.random.normal(keys[1], (batch, ctx, hkv, dh), dtype)
    vc = jax.random.normal(keys[2], (batch, ctx, hkv, dh), dtype)
    lens = jnp.full((batch,), ctx, jnp.int32)

    @jax.jit
    def run(q, kc, vc):
        for _ in range(CALLS):  # each output feeds the next query: the calls stay in order
            q = decode_attention.gqa(q, kc, vc, kv_seq_len=lens, k_splits=k_splits,
                                     block_k=block_k).astype(dtype)
        return q

    return tuning.steady_seconds(lambda: run(q, kc, vc)) / CALLS


def main(specs):
    for spec in specs or ["1:8:4:16384", "1:8:4:4096", "1:32:1:16384", "16:8:4:4096"]:
        batch, hkv, group, ctx = map(int, spec.split(":"))
        kv_bytes = 2 * batch * hkv * ctx * 128 * 2
        rows = []
        for k_splits, block_k in itertools.product((8, 16, 32, 64), (64, 128, 256)):
            if ctx % k_splits or (ctx // k_splits) % min(block_k, ctx // k_splits):
                continue
            try:
                s = time_case(batch, hkv, group, ctx, k_splits, block_k)
            except Exception as exc:  # noqa: BLE001 - a configuration Triton rejects
                print(f"  {spec} k{k_splits} b{block_k}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append((s, k_splits, block_k))
            print(f"  {spec} k{k_splits:<3d} b{block_k:<4d} {s * 1e6:7.1f} us  {kv_bytes / s / 1e12:5.2f} TB/s",
                  flush=True)
        if not rows:
            continue
        best = min(rows)
        default = next(r for r in rows if r[1:] == (16, 128))
        print(f"{spec}: best k{best[1]} b{best[2]} {best[0] * 1e6:.1f} us, default {default[0] * 1e6:.1f} us "
              f"({default[0] / best[0]:.2f}x)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
