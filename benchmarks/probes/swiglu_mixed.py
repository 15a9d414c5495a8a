"""Probe: does pairing one implementation's up stage with another's down GEMM beat both at
small M? At M <= 8 (Llama-2-7B, 70b-tp4 on H100) XLA's dots and our best kernel are within
a few % of each other. Times, per MLP call (fp16, residual fused, calls chained directly
inside one jit as benchmarks/swiglu.py does):
  pure forms   xla, tma, gemv (M <= 16)
  mixed forms  "<up>+xla": our up stage (A2 in HBM) then XLA's down dot
               (SwigluConfig(down="xla"), a tuner candidate since this probe found it);
               "xla+linear": XLA's up (dots + fused SiLU*mul) then jc.linear's down GEMM
    python benchmarks/probes/swiglu_mixed.py [--models llama2-7b,70b-tp4] [--ms 1,4,8,16]
"""

import argparse
import sys

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster.ops import swiglu as sw

sys.path.insert(0, "benchmarks")
from common import time_fn  # noqa: E402
from swiglu import SHAPES, gemv_fits, ours  # noqa: E402


def form(name):
    """fn(x, wg, wu, wd, res) for one pure or mixed form."""
    if name == "xla+linear":
        return lambda x, wg, wu, wd, res: jc.linear(jc.swiglu(x, wg, wu, None, impl="xla"), wd,
                                                    residual=res, impl="cuda")
    return ours(name)


def forms(m):
    gemv = ["gemv"] if gemv_fits(m) else []
    return ["xla", "tma"] + gemv + ["tma+xla"] + [g + "+xla" for g in gemv] + ["xla+linear"]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="llama2-7b,70b-tp4,llama3-8b")
    parser.add_argument("--ms", default="1,2,4,8,16")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    print(f"{jax.devices()[0].device_kind}, {dtype.name}, us per MLP call (ratio = xla / form)")
    for model in args.models.split(","):
        d, f = SHAPES[model]
        for m in map(int, args.ms.split(",")):
            inputs = sw.timing_inputs(m, d, f, dtype, has_residual=True)
            times = {}
            for name in forms(m):
                run, calls = sw.timing_loop(form(name), inputs, chain="direct")
                times[name] = time_fn(run, *inputs) / calls * 1e6
            base = times["xla"]
            print(f"{model:10s} m{m:<3d}" + "  ".join(f"{k} {t:6.1f} ({base / t:.3f})"
                                                     for k, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
