"""Runs swiglu variants a few times each, for Nsight Compute (the benchmark says how fast,
this says why: DRAM throughput, occupancy, stall reasons).

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --kernel-name regex:swiglu --launch-skip 6 --launch-count 4 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_swiglu.py llama2-7b:1:split llama2-7b:1:stream

Each argument is model:M:variant (variant with knobs allowed, e.g. "split:nu=8").
"""

from __future__ import annotations

import sys

import jax

import jax_cluster as jc
from jax_cluster.ops import swiglu as sw
from swiglu import SHAPES


def run(spec: str) -> None:
    model, m, variant = spec.split(":", 2)
    d, f = SHAPES[model]
    x, weights, res = sw.timing_inputs(int(m), d, f, "float16", has_residual=True)
    wg, wu, wd = weights[0]
    fn = jax.jit(lambda *a: jc.swiglu(*a, variant=variant))
    for _ in range(4):
        fn(x, wg, wu, wd, res).block_until_ready()


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        run(spec)
