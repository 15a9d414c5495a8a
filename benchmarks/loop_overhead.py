"""Does the timing chain itself cost time? Per-call seconds measured several ways inside one
jit, for swiglu specs 'model:M:configuration' (configuration by name, as benchmarks/swiglu.py
parses it, or 'xla') and attention_block specs 'attn:model:batch:context:choice' (choice as
benchmarks/attention_block.py takes it: 'auto', 'xla', 'jnp', 'pallas' or a configuration
name such as 'n8:h2'):
  swiglu: fori (lax.fori_loop, each output added into x: one XLA kernel per call), unrolled
          (the same calls and adds written out) and direct (unrolled, y is the next x: the
          benchmarks' chain);
  attention_block: fori (lax.fori_loop of steps) and unrolled (the benchmark's chain).
Also the streaming-read probe (benchmarks/probes/stream_read.cu) both ways. Prints one line
per case. docs/performance.md has what it found.
--trace: the kernel timeline of a spec's chain (swiglu: fori and direct; attention: both);
--sweep: only the swiglu benchmarks' chain, one line per spec (for choosing knobs, e.g.
llama3-8b:1:gemv:k_splits_up=7:k_splits_down=41).

    python3 benchmarks/loop_overhead.py llama3-8b:1:gemv llama3-8b:1:xla attn:llama2-7b:1:4096:auto
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jax_cluster import tuning
from jax_cluster.ops import swiglu as sw
from common import print_timeline, stream_read_probe
from swiglu import SHAPES, describe, ours, parse_config

CALLS = 24


def unrolled(fn, inputs):
    """The timing loop's calls and x updates written out (no XLA while loop)."""
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
    """'model:M:configuration' -> (configuration name, M, D, F)."""
    model, m, name = spec.split(":", 2)
    return (name, int(m), *SHAPES[model])


def sweep_case(spec: str) -> None:
    name, m, d, f = parse_spec(spec)
    choice = parse_config(name)
    t = sw.measure(choice, m=m, d=d, f=f, dtype="float16")
    print(f"{spec:36s} {t * 1e6:7.1f} us  {3 * d * f * 2 / t / 1e12:.2f} TB/s  {describe(choice, m, d, f)}",
          flush=True)


def swiglu_case(spec: str) -> None:
    name, m, d, f = parse_spec(spec)
    inputs = sw.timing_inputs(m, d, f, "float16", has_residual=True)
    fn = ours(name)
    t = {}
    for chain in ("fori", "direct"):
        run, calls = sw.timing_loop(fn, inputs, calls=CALLS, chain=chain)
        t[chain] = tuning.time_call(run, *inputs) / calls
    t["unrolled"] = tuning.time_call(unrolled(fn, inputs), *inputs) / CALLS
    wbytes = 3 * d * f * 2
    print(f"{spec:28s} fori {t['fori'] * 1e6:7.1f} us  unrolled {t['unrolled'] * 1e6:7.1f} us  "
          f"direct {t['direct'] * 1e6:7.1f} us  ({wbytes / t['direct'] / 1e12:.2f} TB/s direct)",
          flush=True)


def attention_call(spec: str, chain: str):
    """(call, steps): the attention benchmark's steps for 'attn:model:batch:ctx:choice',
    written out (chain 'unrolled', the benchmark's steps_call) or in a lax.fori_loop."""
    import attention_block as bench

    _, model, batch, ctx, choice = spec.split(":", 4)
    consts, fresh, _, shape = bench.make_case(model, jnp.float16, int(batch), int(ctx), jax.random.key(0))
    step = bench.step_for(choice, shape)
    if chain == "unrolled":
        return bench.steps_call(step, fresh(), consts), bench.STEPS

    def run_steps(state, c):
        def body(_, s):
            x, kc, vc = s
            return step(x, c["w_qkv"], c["w_o"], c["nw"], kc, vc, c["lengths"], c["inv_freq"])
        return jax.lax.fori_loop(0, bench.STEPS, body, state)

    run = jax.jit(run_steps, donate_argnums=0)
    holder = [fresh()]

    def call():
        holder[0] = run(holder[0], consts)
        return holder[0]

    return call, bench.STEPS


def attention_case(spec: str) -> None:
    t = {}
    for chain in ("fori", "unrolled"):
        call, steps = attention_call(spec, chain)
        t[chain] = tuning.steady_seconds(call) / steps
    print(f"{spec:36s} fori {t['fori'] * 1e6:7.1f} us  unrolled {t['unrolled'] * 1e6:7.1f} us  "
          f"(fori - unrolled {(t['fori'] - t['unrolled']) * 1e6:5.1f} us per step)", flush=True)


def stream_read_case() -> None:
    stream_read, why = stream_read_probe()
    if stream_read is None:
        print(f"stream_read: not run ({why})", flush=True)
        return
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
    """Kernel timelines of a spec's chains (common.print_timeline)."""
    if spec.startswith("attn:"):
        for chain in ("fori", "unrolled"):
            call, steps = attention_call(spec, chain)
            print_timeline(f"{spec} {chain}", call, steps)
        return
    name, m, d, f = parse_spec(spec)
    inputs = sw.timing_inputs(m, d, f, "float16", has_residual=True)
    for chain in ("fori", "direct"):
        run, calls = sw.timing_loop(ours(name), inputs, calls=CALLS, chain=chain)
        print_timeline(f"{spec} {chain}", lambda: run(*inputs), calls)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] in ("--trace", "--sweep"):
        for spec in args[1:]:
            (trace_case if args[0] == "--trace" else sweep_case)(spec)
    else:
        stream_read_case()
        for spec in args:
            (attention_case if spec.startswith("attn:") else swiglu_case)(spec)
