"""flash_attention vs the attention a JAX user has, in one run on one GPU (DiT shapes).

Peers: jax.nn.dot_product_attention with implementation="cudnn" (where jax finds cuDNN's
flash attention) and implementation="xla" (plain XLA; only where its materialised scores
fit in memory); Pallas' attention kernels that ship with jax: `pallas` (the Triton-lowered
`ops.gpu.attention.mha`) and `pallas_mgpu` (the Mosaic GPU Hopper kernel
`ops.gpu.attention_mgpu`, best of block_kv 128 / 64, fp16 only; it has no scale argument,
which does not change its work). Shapes: Flux (24 heads x 128) and CogVideoX (30 heads x 64), batch 1,
non-causal, Lq = Lk = L for L = 4K .. 64K, fp16 / bf16.

Per case: ours (one chunk, finalize=True, output in the input dtype: the wgmma kernel),
ours_mma (the same call on the older mma.sync kernel, FlashAttentionConfig(kernel="mma")), ours on the same work
split into 4 query x 4 KV chunks in ONE call (the Torus / Ring shape of the work), ours as a
ring step (incoming fp32 state, fp32 state out), the peers; TFLOP/s = 4 B H L^2 Dh / time.
roofline_fraction = our TFLOP/s / the TFLOP/s of a large bf16 matmul measured in the same run
(attention at these lengths is compute-bound; its bytes are negligible). Each call is timed
inside one jit (a fori_loop of calls feeding the output back as the next query), several
calls per loop at short lengths. Ours is checked against cuDNN (relative L2) in every case.

Run: python benchmarks/flash_attention.py [--quick] [--lengths 4096,8192] [--models flux]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster.ops.attention_state import State
from common import dtype_tag, loop, random_normal, time_fn, write_results

MODELS = {"flux": (24, 128), "cogvideox": (30, 64)}  # heads, head dim
LENGTHS = (4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (4096, 16384)
XLA_MAX_SCORE_BYTES = 16 * 2**30  # skip the XLA peer beyond this much fp32 score memory
TARGET_FLOPS_PER_LOOP = 4e12  # calls per jit loop: about this much work (1 .. MAX_CALLS calls)
MAX_CALLS = 64


def attention_flops(b, lq, lk, h, d) -> float:
    return 4.0 * b * h * lq * lk * d


def measure_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """bf16 GEMM throughput of this device in this run (the compute 'roofline')."""
    ka, kb = jax.random.split(jax.random.key(7))
    x = random_normal(ka, (n, n), jnp.bfloat16)
    w = random_normal(kb, (n, n), jnp.bfloat16, 1 / math.sqrt(n))
    step = loop(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), iters)
    return 2.0 * n**3 * iters / time_fn(step, x) / 1e12


def ours(q, k, v):
    return jc.flash_attention(q, [(k, v)], finalize=True, impl="cuda")


def ours_mma(q, k, v):
    return jc.flash_attention(q, [(k, v)], finalize=True, impl="cuda",
                              config=jc.FlashAttentionConfig(kernel="mma"))


def ours_chunked(qs, kvs):
    return jc.flash_attention(qs, kvs, finalize=True, impl="cuda")


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def pallas(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention

    return attention.mha(q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]))


def pallas_mgpu(q, k, v, block_kv):
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2)
    return attention_mgpu.attention(q, k, v, config)


def split(x, parts, axis=1):
    """Uneven cut into `parts` pieces (lengths not multiples of the kernel tiles)."""
    n = x.shape[axis]
    cuts = [0] + [int(n * (i + 0.37) / parts) for i in range(1, parts)] + [n]
    return [jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in zip(cuts[:-1], cuts[1:])]


def time_per_call(fn, x, calls, *operands):
    """Seconds per call of x -> fn(x, *operands) (same structure as x), `calls` chained calls
    in one jit. The operands are arguments of the jit, not constants captured by a closure:
    baked into the program, 400 MB of K and V at L = 64K made every compile take ~20 s."""

    @jax.jit
    def run(x, *ops):
        return jax.lax.fori_loop(0, calls, lambda i, x: fn(x, *ops), x)

    return time_fn(run, x, *operands) / calls


def rel_err(a, b) -> float:
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run_case(model, heads, d, length, dtype, key, max_calls=MAX_CALLS):
    kq, kk, kv = jax.random.split(key, 3)
    shape = (1, length, heads, d)
    q, k, v = (random_normal(x, shape, dtype) for x in (kq, kk, kv))
    flops = attention_flops(1, length, length, heads, d)
    calls = max(1, min(max_calls, int(TARGET_FLOPS_PER_LOOP // flops)))
    t = {}

    def attempt(name, fn):
        try:
            t[name] = fn()
            print(f"    {name:12s} {t[name] * 1e6:10.0f} us", flush=True)  # progress of long cases
        except Exception as exc:  # noqa: BLE001 - a peer may not run here
            print(f"    {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            t[name] = None

    attempt("ours", lambda: time_per_call(ours, q, calls, k, v))
    attempt("ours_mma", lambda: time_per_call(ours_mma, q, calls, k, v))
    qs, kvs = split(q, 4), list(zip(split(k, 4), split(v, 4)))
    attempt("ours_4x4", lambda: time_per_call(ours_chunked, qs, calls, kvs))

    def ring_step(s, q, k, v):  # fp32 state in and out (a Ring / Torus step)
        st = jc.flash_attention(q, [(k, v)], State(*s), impl="cuda")
        return (st.o, st.lse)

    st0 = (jnp.zeros(shape, jnp.float32), jnp.full((1, heads, length), -jnp.inf, jnp.float32))
    attempt("ours_state", lambda: time_per_call(ring_step, st0, calls, q, k, v))
    attempt("cudnn", lambda: time_per_call(cudnn, q, calls, k, v))
    attempt("pallas", lambda: time_per_call(pallas, q, calls, k, v))
    mgpu = []
    # the Mosaic kernel writes fp16 only (bf16 fails); the larger tile may not fit at head dim 128
    for block_kv in (128, 64) if dtype == jnp.float16 else ():
        attempt("pallas_mgpu", lambda: time_per_call(
            lambda x, k, v: pallas_mgpu(x, k, v, block_kv), q, calls, k, v))
        if t["pallas_mgpu"] is not None:
            mgpu.append(t["pallas_mgpu"])
    t["pallas_mgpu"] = min(mgpu) if mgpu else None
    if heads * length * length * 4 <= XLA_MAX_SCORE_BYTES:
        attempt("xla", lambda: time_per_call(xla, q, calls, k, v))
    else:
        t["xla"] = None

    err_cudnn = err_chunked = None
    try:
        out = jax.jit(ours)(q, k, v)
        err_chunked = rel_err(jnp.concatenate(jax.jit(ours_chunked)(qs, kvs), 1), out)
        if t["cudnn"] is not None:
            err_cudnn = rel_err(out, jax.jit(cudnn)(q, k, v))
    except Exception as exc:  # noqa: BLE001
        print(f"    check failed: {type(exc).__name__}: {str(exc)[:200]}")

    us = {n: (x * 1e6 if x is not None else None) for n, x in t.items()}
    tf = lambda x: flops / x / 1e12 if x else None  # noqa: E731
    row = {
        "case": f"{model} b1 l{length} {dtype_tag(dtype)}",
        "ours_us": us["ours"],
        "ours_mma_us": us["ours_mma"],
        "ours_4x4_us": us["ours_4x4"],
        "ours_state_us": us["ours_state"],
        "cudnn_us": us["cudnn"],
        "xla_us": us["xla"],
        "pallas_us": us["pallas"],
        "pallas_mgpu_us": us["pallas_mgpu"],
        "speedup_vs_pallas": t["pallas"] / t["ours"] if t["pallas"] and t["ours"] else None,
        "speedup_vs_pallas_mgpu": t["pallas_mgpu"] / t["ours"] if t["pallas_mgpu"] and t["ours"] else None,
        "speedup_vs_cudnn": t["cudnn"] / t["ours"] if t["cudnn"] and t["ours"] else None,
        "speedup_vs_ours_mma": t["ours_mma"] / t["ours"] if t["ours_mma"] and t["ours"] else None,
        "speedup_vs_xla": t["xla"] / t["ours"] if t["xla"] and t["ours"] else None,
        "chunked_overhead": t["ours_4x4"] / t["ours"] if t["ours_4x4"] and t["ours"] else None,
        "tflops": tf(t["ours"]),
        "cudnn_tflops": tf(t["cudnn"]),
        "flops": flops,
        "rel_err_vs_cudnn": err_cudnn,
        "rel_err_4x4_vs_one": err_chunked,
    }
    return row


COLUMNS = ["case", "ours_us", "ours_mma_us", "ours_4x4_us", "ours_state_us", "cudnn_us", "xla_us", "pallas_us",
           "pallas_mgpu_us", "speedup_vs_cudnn", "speedup_vs_ours_mma", "speedup_vs_xla", "speedup_vs_pallas",
           "speedup_vs_pallas_mgpu", "chunked_overhead", "tflops", "cudnn_tflops", "roofline_fraction",
           "rel_err_vs_cudnn"]
NOTES = ("Non-causal attention, batch 1, Lq = Lk = L. ours: one chunk, finalize=True (the wgmma kernel); "
         "ours_mma: the same on the mma.sync kernel; ours_4x4: the same "
         "work as 4 query x 4 KV chunks (uneven) in one call; ours_state: fp32 state in and out (a ring "
         "step). TFLOP/s = 4 B H L^2 Dh / time. xla only where its fp32 scores fit in 16 GiB.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bf16, L = 4K and 16K")
    parser.add_argument("--lengths", type=str, default=None, help="comma-separated L values")
    parser.add_argument("--models", type=str, default=",".join(MODELS))
    parser.add_argument("--dtypes", type=str, default=None, help="comma list (default bfloat16,float16)")
    parser.add_argument("--part", default=None, help="this run is one slice of the grid: its rows are merged "
                        "into the table (a case measured again replaces its row)")
    parser.add_argument("--max-calls", type=int, default=MAX_CALLS, help="calls per timed jit loop (at most)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("warning: no GPU; the CPU handler is plain loops (use tiny --lengths)")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        QUICK_LENGTHS if args.quick else LENGTHS)
    dtypes = [jnp.dtype(t) for t in args.dtypes.split(",")] if args.dtypes else (
        [jnp.bfloat16] if args.quick else [jnp.bfloat16, jnp.float16])
    peak = measure_matmul_tflops() if jax.default_backend() == "gpu" else None
    print(f"device {jax.devices()[0].device_kind}; bf16 matmul {peak or float('nan'):.0f} TFLOP/s")
    rows = []
    key = jax.random.key(0)
    for model in args.models.split(","):
        heads, d = MODELS[model]
        for dtype in dtypes:
            for length in lengths:
                key, sub = jax.random.split(key)
                row = run_case(model, heads, d, length, dtype, sub, args.max_calls)
                row["roofline_fraction"] = row["tflops"] / peak if peak and row["tflops"] else None
                rows.append(row)
                f = lambda x, fmt="7.0f": format(x, fmt) if x is not None else "    n/a"  # noqa: E731
                print(f"  {row['case']:28s} ours {f(row['ours_us'])} us ({f(row['tflops'], '4.0f')} TF)"
                      f"  mma {f(row['ours_mma_us'])}"
                      f"  4x4 {f(row['ours_4x4_us'])}  state {f(row['ours_state_us'])}"
                      f"  cudnn {f(row['cudnn_us'])} ({f(row['cudnn_tflops'], '4.0f')} TF)  xla {f(row['xla_us'])}"
                      f"  pallas {f(row['pallas_us'])}  mgpu {f(row['pallas_mgpu_us'])}"
                      f"  err {row['rel_err_vs_cudnn']}")
                write_results(  # after every case: a partial run still leaves its numbers
                    "flash_attention", rows, part=args.part,
                    columns=COLUMNS,
                    notes=NOTES + f" roofline_fraction = ours / bf16 matmul TFLOP/s measured in this run ({peak or 0:.0f}).",
                    extra={"matmul_tflops": peak})


if __name__ == "__main__":
    main()
