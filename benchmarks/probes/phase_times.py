"""Where the time of one attention_decode kernel goes, per phase and per block.

The register-pipeline kernel, built with benchmarks/probes/phase_times.patch applied, prints
one line per block at its end: %globaltimer at kernel entry, after the norm (and the cluster
start-up barrier), after the QKV GEMV, after the gather, after attention, after the softmax
combine, after the W_o GEMV; and %smid. This script runs configurations (three single
launches, then a 6-step fori_loop twice) and summarises the last launch of each: median /
min / max per phase, the span, blocks that started late, SMs that ran two blocks.

    git apply benchmarks/probes/phase_times.patch   # then build a wheel; never commit the build
    python3 -P benchmarks/probes/phase_times.py llama2-7b:4096:4 llama3-8b:4096:8:2 > pt.log
    python3 benchmarks/probes/phase_times.py --summary pt.log

(Launch gaps inside the loop are the printf flushes, not the op's.) Session 11 (H100) found
the norm phase at 14.6 us of a 90 us Llama-2-7B b1 launch, from loads the compiler could not
overlap; benchmarks/results/logs/session11/README.md has the numbers.
"""

from __future__ import annotations

import collections
import os
import sys

import numpy as np

PHASES = ["norm+wait", "qkv gemv", "gather", "rope+attn", "combine", "W_o gemv"]


def run(spec: str) -> None:
    import jax
    import jax.numpy as jnp

    import jax_cluster as jc
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from attention_decode import MODELS
    from common import random_normal

    model, ctx, n, *h = spec.split(":")
    ctx, n, h = int(ctx), int(n), int(h[0]) if h else None
    d, hq, hkv, dh = MODELS[model]
    ks = jax.random.split(jax.random.key(0), 5)
    dt = jnp.float16
    x = random_normal(ks[0], (1, d), dt)
    w_qkv = random_normal(ks[1], (d, (hq + 2 * hkv) * dh), dt, d ** -0.5)
    w_o = random_normal(ks[2], (hq * dh, d), dt, (hq * dh) ** -0.5)
    kc, vc = (random_normal(k, (1, hkv, ctx, dh), dt) for k in ks[3:])
    lengths = jnp.full((1,), ctx - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)

    def step(x, kc, vc):
        return jc.attention_decode(x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq,
                                   num_kv_heads=hkv, norm="rms", norm_weight=jnp.ones((d,), dt),
                                   residual=True, cluster_size=n, heads_per_cluster=h,
                                   impl="kernel", pipeline="registers")

    def mark(tag):
        sys.stdout.flush()
        os.write(1, f"{tag} {spec}\n".encode())  # after the device printf buffer was flushed

    single = jax.jit(lambda x, kc, vc: step(x, kc, vc)[0])
    for i in range(3):
        single(x, kc, vc).block_until_ready()
        mark(f"LAUNCH{i}")
    loop = jax.jit(lambda x, kc, vc: jax.lax.fori_loop(0, 6, lambda i, s: step(*s), (x, kc, vc))[0])
    for i in range(2):
        loop(x, kc, vc).block_until_ready()
        mark(f"LOOP{i}")


def summary(path: str) -> None:
    groups, cur = [], []
    for line in open(path).read().splitlines():
        if line.startswith("PT "):
            cur.append([int(v) for v in line.split()[1:]])
        elif line.startswith(("LAUNCH", "LOOP")):
            groups.append((line, cur))
            cur = []
    for tag, rows in groups:
        if not rows or not tag.startswith(("LAUNCH2", "LOOP1")):
            continue
        a = np.array(rows, dtype=np.int64)  # block, rank, smid, 7 timestamps
        blocks = len(set(a[:, 0]))
        if tag.startswith("LOOP"):
            a = a[-blocks:]  # the loop's last launch
        t = a[:, 3:] - a[:, 3].min()
        late = (t[:, 0] > 2000).sum()
        print(f"{tag}: {blocks} blocks on {len(set(a[:, 2]))} SMs, span {t[:, 6].max() / 1e3:.1f} us, "
              f"{late} blocks started > 2 us late")
        d = np.diff(t, axis=1) / 1e3
        for i, name in enumerate(PHASES):
            print(f"   {name:10s} median {np.median(d[:, i]):6.1f}  min {d[:, i].min():6.1f}  "
                  f"max {d[:, i].max():6.1f} us")
        doubled = sorted(int(s) for s, c in collections.Counter(a[:, 2]).items() if c > 1)
        print(f"   SMs running two blocks: {doubled}")


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        summary(sys.argv[2])
    else:
        for spec in sys.argv[1:]:
            run(spec)
