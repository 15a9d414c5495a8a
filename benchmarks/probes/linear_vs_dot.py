"""Probe: jax_cluster.linear against XLA's dot on attention_block's projection shapes, as
pairs a -> [M, N] -> [M, K] (a QKV-like then an output-like projection), 10 pairs per
jitted call, chained, with PDL on and off; then (--trace) a kernel timeline of each
(benchmarks/common.py). docs/attention_block.md has what it found.
    python benchmarks/probes/linear_vs_dot.py [--trace]
"""

import sys

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster import tuning

sys.path.insert(0, "benchmarks")
from common import print_timeline  # noqa: E402

PAIRS = 10


def run(kind, m, k, n, pdl=True):
    ks = jax.random.split(jax.random.key(0), 3)
    w1 = (jax.random.normal(ks[0], (k, n)) * k ** -0.5).astype(jnp.float16)
    w2 = (jax.random.normal(ks[1], (n, k)) * n ** -0.5).astype(jnp.float16)
    a = jax.random.normal(ks[2], (m, k)).astype(jnp.float16)

    def proj(x, w):
        if kind == "linear":
            return jc.linear(x, w, impl="cuda", config=jc.LinearConfig(pdl=pdl))
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    @jax.jit
    def f(a, w1, w2):
        for _ in range(PAIRS):
            a = proj(proj(a, w1), w2)
        return a

    return lambda: f(a, w1, w2)


def main():
    for m in (1, 16):
        for k, n in ((4096, 6144), (4096, 12288), (4096, 4096)):
            res = {}
            for kind in ("xla", "linear", "linear_nopdl"):
                call = run(kind.split("_")[0], m, k, n, pdl=kind != "linear_nopdl")
                res[kind] = tuning.steady_seconds(call) / PAIRS * 1e6
            mb = 2 * 2 * k * n / 1e6
            print(f"M {m:3d} K {k} N {n:5d} ({mb:.0f} MB/pair): " +
                  "  ".join(f"{kd} {v:6.1f} us ({mb / v:.2f} TB/s)" for kd, v in res.items()), flush=True)
    if "--trace" in sys.argv:
        for kind in ("xla", "linear"):
            print_timeline(f"{kind} M16 4096x6144", run(kind, 16, 4096, 6144), PAIRS)


if __name__ == "__main__":
    main()
