"""Numerical checks shared by the test suite and the benchmarks."""

from __future__ import annotations

import functools

import jax
import numpy as np

# Relative L2 error allowed against the fp32 jnp reference (DESIGN.md).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def rel_l2(out, ref) -> float:
    """Relative L2 error in float64; any NaN or Inf in `out` gives inf (never passes)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def on_cpu(fn):
    """`fn` with its positional array arguments moved to the CPU and run there.

    For references in GPU tests: eager fp32 HIGHEST-precision einsums on a GPU make XLA
    compile and autotune a GEMM per new shape (one small flash_attention test took 16 s on
    an H100 and the file looked hung). On the CPU they compile quickly and stay exact fp32.
    """
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            return fn(*jax.device_put(args, cpu), **kwargs)
    return wrapped
