"""Does the timing loop itself cost time? Per-call seconds of swiglu variants measured two
ways inside one jit: the benchmarks' fori_loop (jax_cluster.ops.swiglu.timing_loop) and the
same chain of calls unrolled in Python (no XLA while loop: no per-iteration predicate
round trip). Also the streaming-read probe both ways. Prints one line per case.
--trace: the kernel timeline of the timing loop instead; --sweep: only the benchmarks'
timing loop, one line per spec (for choosing knobs, e.g. llama3-8b:1:gemv:ku=7:kd=41).

    python3 benchmarks/loop_overhead.py llama3-8b:1:gemv llama3-8b:1:xla
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster import tuning
from jax_cluster.ops import swiglu as sw
from common import print_timeline
from swiglu import SHAPES

CALLS = 24


def unrolled(fn, inputs):
    x0, weights, _ = inputs
    dtype = x0.dtype

    @jax.jit
    def run(x, weights, res):
        for i in range(CALLS):
            wg, wu, wd = weights[i % len(weights)]
            y = fn(x, wg, wu, wd, res)
            x = (x.astype(jnp.float32) + 1e-3 * y.astype(jnp.float32)).astype(dtype)
        return x

    return run


def parse_spec(spec: str) -> tuple[str, int, int, int]:
    """'model:M:variant[:knobs]' -> (variant, M, D, F)."""
    model, m, variant = spec.split(":", 2)
    return (variant, int(m), *SHAPES[model])


def sweep_case(spec: str) -> None:
    variant, m, d, f = parse_spec(spec)
    t = sw.measure(variant, m=m, d=d, f=f, dtype="float16")
    cfg = sw.make_config(variant, m, d, f, True, 132) if variant != "xla" else None
    print(f"{spec:36s} {t * 1e6:7.1f} us  {3 * d * f * 2 / t / 1e12:.2f} TB/s  "
          f"{cfg.describe() if cfg else ''}", flush=True)


def swiglu_case(spec: str) -> None:
    variant, m, d, f = parse_spec(spec)
    inputs = sw.timing_inputs(m, d, f, "float16")
    fn = lambda x, wg, wu, wd, res: jc.swiglu(x, wg, wu, wd, res, variant=variant)  # noqa: E731
    loop, calls = sw.timing_loop(fn, inputs, calls=CALLS)
    t_loop = tuning.time_call(loop, *inputs) / calls
    t_flat = tuning.time_call(unrolled(fn, inputs), *inputs) / CALLS
    wbytes = 3 * d * f * 2
    print(f"{spec:28s} fori {t_loop * 1e6:7.1f} us  unrolled {t_flat * 1e6:7.1f} us  "
          f"({wbytes / t_flat / 1e12:.2f} TB/s unrolled)", flush=True)


def stream_read_case() -> None:
    from jax_cluster.ops.stream_read import stream_read

    n = 2**28  # 1 GiB of fp32
    chunks = 4 * 132
    buf = jnp.arange(n // (4 * chunks) * 4 * chunks, dtype=jnp.float32)  # 16 * chunks | bytes

    @jax.jit
    def fori(buf):
        def body(_, acc):
            b, acc = jax.lax.optimization_barrier((buf, acc))
            return acc ^ stream_read(b, chunks)
        return jax.lax.fori_loop(0, 10, body, jnp.zeros((chunks,), jnp.uint32))

    @jax.jit
    def flat(buf):
        acc = jnp.zeros((chunks,), jnp.uint32)
        for _ in range(10):
            b, acc = jax.lax.optimization_barrier((buf, acc))
            acc = acc ^ stream_read(b, chunks)
        return acc

    for name, fn in (("fori", fori), ("unrolled", flat)):
        t = tuning.time_call(fn, buf) / 10
        print(f"stream_read {name:9s} {buf.size * 4 / t / 1e12:.3f} TB/s ({t * 1e6:.0f} us per GiB)",
              flush=True)


def trace_case(spec: str) -> None:
    """Kernel timeline of the fori timing loop (common.print_timeline)."""
    variant, m, d, f = parse_spec(spec)
    inputs = sw.timing_inputs(m, d, f, "float16")
    fn = lambda x, wg, wu, wd, res: jc.swiglu(x, wg, wu, wd, res, variant=variant)  # noqa: E731
    loop, calls = sw.timing_loop(fn, inputs, calls=CALLS)
    print_timeline(spec, lambda: loop(*inputs), calls)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] in ("--trace", "--sweep"):
        for spec in args[1:]:
            (trace_case if args[0] == "--trace" else sweep_case)(spec)
    else:
        stream_read_case()
        for spec in args:
            swiglu_case(spec)
