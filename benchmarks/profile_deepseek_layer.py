"""Runs DeepSeek-V2-Lite's MLA and MoE layers on the ops a few times each, for Nsight Compute:
which kernels one layer launches and what each costs (the benchmarks say how fast the layer
is; this says where its time goes).

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --clock-control none --cache-control none --print-summary per-kernel \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 benchmarks/profile_deepseek_layer.py moe:1 mla:1:4096 mla:16:4096

Each argument is moe:BATCH or mla:BATCH:CONTEXT (bf16, V2-Lite shapes, the shapes and
weights of benchmarks/moe_decode.py and benchmarks/mla_decode.py); each layer runs 3 times
to warm up and compile, then 4 times. Without --clock-control none Nsight Compute locks the
base clock, and without --cache-control none it flushes L2 before every kernel: both make
small, latency-bound kernels look slower than they run. Under the profiler kernels still run
one at a time (no programmatic overlap), so the sum of their times exceeds the layer's time
in the benchmark.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
import mla_decode as mla_bench
import moe_decode as moe_bench


def layer(spec: str):
    """(a jitted layer, its arguments) for one argument of the command line."""
    kind, *sizes = spec.split(":")
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    if kind == "moe":
        (batch,) = (int(s) for s in sizes)
        m = moe_bench.MODELS["v2-lite"]
        w = moe_bench.layer_weights(jax.random.key(0), m, dtype)
        x = jnp.asarray(rng.standard_normal((batch, m["hidden"])), dtype)
        return jax.jit(moe_bench.ours_layer(m)), (x, w)
    if kind == "mla":
        batch, ctx = (int(s) for s in sizes)
        d, kw = mla_bench.V2_LITE, mla_bench.kwargs()
        w = mla_bench.weights(jax.random.key(0), dtype)
        lengths = jnp.full((batch,), ctx - 1, jnp.int32)
        rope = d["qk_rope_head_dim"]
        inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rope, 2) / rope), jnp.float32)
        cache = jnp.asarray(rng.standard_normal((batch, ctx, d["kv_lora_rank"] + rope)) * 0.5, dtype)
        x = jnp.asarray(rng.standard_normal((batch, d["hidden"])), dtype)
        fn = jax.jit(lambda x, w, c: jc.mla_decode(x, w, c, lengths, inv_freq, impl="cuda", **kw)[0])
        return fn, (x, w, cache)
    raise SystemExit(f"unknown layer {spec!r}: moe:BATCH or mla:BATCH:CONTEXT")


def run(spec: str) -> None:
    fn, args = layer(spec)
    for _ in range(7):
        jax.block_until_ready(fn(*args))
    print(f"{spec}: 7 calls (3 to warm up)", flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        run(spec)
