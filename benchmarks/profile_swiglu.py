"""Runs swiglu configurations a few times each, for Nsight Compute (the benchmark says how
fast, this says why: DRAM throughput, occupancy, stall reasons).

    XLA_PYTHON_CLIENT_PREALLOCATE=false \\
    ncu --kernel-name regex:swiglu --launch-skip 6 --launch-count 4 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/profile_swiglu.py llama2-7b:1:gemv llama2-7b:64:tma

Each argument is model:M:configuration, the configuration by name as benchmarks/swiglu.py
parses it ("tma", "gemv", "fused", "tma+xla", knobs as ":field=value", e.g.
"gemv:k_splits_up=8"). Each runs 4 times.
"""

from __future__ import annotations

import sys

import jax

from jax_cluster.ops import swiglu as sw
from swiglu import SHAPES, ours


def run(spec: str) -> None:
    model, m, name = spec.split(":", 2)
    d, f = SHAPES[model]
    x, weights, res = sw.timing_inputs(int(m), d, f, "float16", has_residual=True)
    wg, wu, wd = weights[0]
    fn = jax.jit(ours(name))
    for _ in range(4):
        fn(x, wg, wu, wd, res).block_until_ready()
    print(f"{spec}: 4 calls", flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        run(spec)
