"""Runs attention_block's fused kernel configurations a few times each, for Nsight Compute.

The benchmark says how fast each configuration is; this says why: run it under ncu and
compare DRAM throughput, bytes moved (duplicated reads of K/V columns and cache when a
GQA group is split over clusters), occupancy (Max Active Clusters) and warp stall reasons
between configurations.

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --kernel-name "regex:attention_block_(split_head_|tma_)?kernel" --launch-skip 3 --launch-count 99 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_attention_block.py llama3-8b:1:4096:n4:h1 llama3-8b:1:4096:n16

Each argument is model:batch:context:configuration, the configuration by name as
benchmarks/attention_block.py parses it ("n4" cluster size 4, "n4:h1" at most one query
head per cluster, "tma:n4" the TMA pipeline, "split_head:n2" the SplitHead dataflow). Each
configuration runs 4 times (3 warm-ups: pass --launch-skip 3 and count 4 launches per
configuration; the regex leaves out the combine kernel). Without
XLA_PYTHON_CLIENT_PREALLOCATE=false ncu backs up XLA's whole memory pool before every replay
pass (the kernel writes the caches in place): minutes per kernel instead of seconds.
docs/attention_block.md has the configurations and what bounds them.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from attention_block import MODELS, parse_config
from common import random_normal


def run(spec: str) -> None:
    model, batch, ctx, name = spec.split(":", 3)
    batch, ctx = int(batch), int(ctx)
    config = parse_config(name)
    d, hq, hkv, dh = MODELS[model]
    ks = jax.random.split(jax.random.key(0), 5)
    dtype = jnp.float16
    x = random_normal(ks[0], (batch, d), dtype)
    w_qkv = random_normal(ks[1], (d, (hq + 2 * hkv) * dh), dtype, d ** -0.5)
    w_o = random_normal(ks[2], (hq * dh, d), dtype, (hq * dh) ** -0.5)
    kc = random_normal(ks[3], (batch, hkv, ctx, dh), dtype)
    vc = random_normal(ks[4], (batch, hkv, ctx, dh), dtype)
    lengths = jnp.full((batch,), ctx - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
    step = jax.jit(lambda x, kc, vc: jc.attention_block(
        x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq, num_kv_heads=hkv, norm="rms",
        norm_weight=jnp.ones((d,), dtype), residual=True, impl="cuda", config=config))
    for _ in range(4):
        jax.block_until_ready(step(x, kc, vc))
    print(f"{spec}: 4 launches", flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        run(arg)
