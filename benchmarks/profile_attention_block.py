"""Runs attention_decode kernel configurations a few times each, for Nsight Compute.

The benchmark says how fast each configuration is; this says why: run it under ncu and
compare DRAM throughput, bytes moved (duplicated reads of K/V columns and cache when a
GQA group is split over clusters) and warp stall reasons between configurations.

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --kernel-name "regex:attention_decode_(split_head_)?kernel" --launch-skip 3 --launch-count 99 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_attention_decode.py llama3-8b:1:4096:n4:h1 llama3-8b:1:4096:n16

Each argument is model:batch:context:config, config as the tuner writes it ("4", "n4:h1",
"tma:4" for the TMA pipeline)
or "sh:n4" for dataflow="split_head". Each configuration runs 4 times (3 warm-ups: pass
--launch-skip 3 and count 4 launches per configuration, combine kernels excluded by the regex).
Without XLA_PYTHON_CLIENT_PREALLOCATE=false ncu backs up XLA's whole memory pool before every
replay pass (the kernel writes the caches in place): minutes per kernel instead of seconds.

What it found (session 4, H100): at one block per SM only 7 clusters of 16 were resident
(Occupancy: Max Active Clusters), so Llama-3-8B's 8 KV heads ran in two waves; the kernel is
now built for two blocks per SM wherever its registers allow it.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import jax_cluster as jc
from jax_cluster.ops import attention_decode as ad_op
from attention_decode import MODELS
from common import random_normal


def run(spec: str) -> None:
    model, batch, ctx, config = spec.split(":", 3)
    batch, ctx = int(batch), int(ctx)
    d, hq, hkv, dh = MODELS[model]
    extra = {}
    if config.startswith("sh:"):
        extra, config = {"dataflow": "split_head"}, config[3:]
    choice = ad_op.parse_choice(config if ":" in config else int(config.lstrip("n")))
    n, h, pipeline = choice
    ks = jax.random.split(jax.random.key(0), 5)
    dtype = jax.numpy.float16
    x = random_normal(ks[0], (batch, d), dtype)
    w_qkv = random_normal(ks[1], (d, (hq + 2 * hkv) * dh), dtype, d ** -0.5)
    w_o = random_normal(ks[2], (hq * dh, d), dtype, (hq * dh) ** -0.5)
    kc = random_normal(ks[3], (batch, hkv, ctx, dh), dtype)
    vc = random_normal(ks[4], (batch, hkv, ctx, dh), dtype)
    lengths = jax.numpy.full((batch,), ctx - 1, jax.numpy.int32)
    inv_freq = jax.numpy.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jax.numpy.float32)
    step = jax.jit(lambda x, kc, vc: jc.attention_decode(
        x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq, num_kv_heads=hkv, norm="rms",
        norm_weight=jax.numpy.ones((d,), dtype), residual=True, cluster_size=n,
        heads_per_cluster=h, impl="kernel", pipeline=None if extra else pipeline, **extra))
    for _ in range(4):
        jax.block_until_ready(step(x, kc, vc))
    print(f"{spec}: 4 launches", flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        run(arg)
