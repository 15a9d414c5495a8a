"""XLA flags that let a schedule's transfers overlap its attention on GPU.

The XLA backend only *allows* overlap: a step's ``ppermute`` / ``all_to_all`` does not depend
on the attention launched in the same step. Whether they run concurrently is decided by XLA:

* collectives are asynchronous on GPU by default (a ``*-start`` / ``*-done`` pair); the flag
  ``--xla_gpu_disable_async_collectives=ALLTOALL,COLLECTIVEPERMUTE`` turns that off (used to
  measure the no-overlap baseline);
* the latency-hiding scheduler (``--xla_gpu_enable_latency_hiding_scheduler=true``) moves the
  ``start`` early and the ``done`` late so that independent kernels run in between;
* ``--xla_gpu_enable_highest_priority_async_stream=true`` gives the collectives' stream
  priority so the transfer is not starved by the attention kernels;
* ``--xla_gpu_experimental_parallel_collective_overlap_limit=2`` lets a Torus stage's
  transfer and the ring's transfer be in flight at the same time.

XLA reads XLA_FLAGS once, when the first GPU backend starts: call :func:`set_overlap_flags`
before the first jax computation (or export the flags); later changes take effect only in a
new process (public JAX cannot tell whether a backend has started, so this is not checked).
An unknown flag aborts XLA; these names exist in jaxlib 0.10 / 0.11.
"""
from __future__ import annotations

import os

OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)

NO_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=false",
    "--xla_gpu_disable_async_collectives=ALLTOALL,COLLECTIVEPERMUTE",
)


def overlap_flags(enable: bool = True) -> tuple[str, ...]:
    """The XLA_FLAGS entries that turn communication/computation overlap on (or off)."""
    return OVERLAP_FLAGS if enable else NO_OVERLAP_FLAGS


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def set_overlap_flags(enable: bool = True, environ=None) -> str:
    """Add the overlap flags to ``XLA_FLAGS`` (replacing earlier values of the same flags);
    returns the new value. Must run before jax starts its GPU backend. This module imports
    nothing of jax, so a script can load it before jax (benchmarks/sp_attention.py does)."""
    env = os.environ if environ is None else environ
    wanted = overlap_flags(enable)
    names = {_flag_name(f) for f in OVERLAP_FLAGS + NO_OVERLAP_FLAGS}
    kept = [f for f in env.get("XLA_FLAGS", "").split() if _flag_name(f) not in names]
    env["XLA_FLAGS"] = " ".join(kept + list(wanted))
    return env["XLA_FLAGS"]
