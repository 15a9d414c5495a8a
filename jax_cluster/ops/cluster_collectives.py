"""cluster_reduce / cluster_gather: the thread-block-cluster collectives as ops.

`x` is [groups, N, size]: one thread-block cluster of N blocks per group, block b holding
x[g, b] in shared memory. The ops exist to test and measure the collectives that the fused
kernels use internally (cpp/include/jax_cluster/cluster_collectives.cuh: ClusterFusion's
ClusterReduce and ClusterGather over distributed shared memory).

impl (the contract of every op, jax_cluster._ffi):
  "auto"       the custom call where the kernels cover the call (N in 1..8 or 16, a block's
               slice within shared memory; on CPU the C++ handler, which replays the
               kernels' order of operations bit for bit); otherwise "xla" with a one-time
               warning
  "cuda"       the custom call; a shape the kernels do not cover is an error
  "xla"        XLA's reduction / reshape in the input dtype
  "reference"  jax_cluster.reference.cluster_reduce / cluster_gather (fp32 math)

:class:`ClusterCollectiveConfig` picks the exchange: over distributed shared memory (the
collectives, default) or through global memory and a cluster barrier (the off-chip
baseline the paper compares against).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference
from jax_cluster._ffi import check_config, check_impl, ffi_primitive, fold_batch_axis, warn_once

__all__ = ["ClusterCollectiveConfig", "cluster_gather", "cluster_reduce"]

_PLAN = _extension.plans()
SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
CLUSTER_SIZES = tuple(n for n in range(1, 17) if _PLAN.cluster_size_valid(n))
# Dynamic shared memory a block may use: sm_90's 227 KiB opt-in limit, less 1 KiB kept
# for barriers and static shared memory (cpp/ops/cluster_collectives/params.h).
SHARED_MEMORY_LIMIT_BYTES = _PLAN.CLUSTER_COLLECTIVE_SMEM_LIMIT

EXCHANGES = ("dsmem", "global")
_OPS = {"sum": 0, "max": 1}  # ReduceOp (cpp/include/jax_cluster/types.h)


@dataclasses.dataclass(frozen=True)
class ClusterCollectiveConfig:
    """How the CUDA kernel runs the collective.

    exchange      "dsmem": over distributed shared memory (the collectives of the fused
                  kernels); "global": each block publishes its slice in global memory, one
                  cluster barrier, every block reads all N slices (the off-chip baseline)
    cluster_size  None: x.shape[1]; an int must equal it (a check of the caller's layout)
    repeat        benchmarking knob: the collective runs `repeat` times in place inside one
                  kernel, so a benchmark can separate its cost from the launch and the loads
                  of x. The result is the repeat-fold collective (every impl computes it):
                  reduce sum * N**(repeat-1) (max unchanged); gather of x + repeat - 1
    """

    exchange: str = "dsmem"
    cluster_size: int | None = None
    repeat: int = 1

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise ValueError(f"ClusterCollectiveConfig: exchange must be one of {EXCHANGES}, "
                             f"got {self.exchange!r}")
        if self.cluster_size is not None and self.cluster_size not in CLUSTER_SIZES:
            raise ValueError(f"ClusterCollectiveConfig: cluster_size must be one of {CLUSTER_SIZES} "
                             f"or None, got {self.cluster_size!r}")
        if not isinstance(self.repeat, int) or isinstance(self.repeat, bool) or self.repeat < 1:
            raise ValueError(f"ClusterCollectiveConfig: repeat must be a positive int, got {self.repeat!r}")


_DEFAULT = ClusterCollectiveConfig()


def shared_memory_bytes(kind: str, dtype, cluster_size: int, size: int, exchange: str = "dsmem") -> int:
    """Shared memory one block of the kernel needs (the C++ formula)."""
    return _PLAN.cluster_collective_smem_bytes(kind == "gather", jnp.dtype(dtype).name, cluster_size,
                                               size, exchange)


def _validate(kind: str, x, impl: str, config) -> tuple[ClusterCollectiveConfig, str | None]:
    """The config to run and, when the kernels do not cover the call, why (None: covered)."""
    name = f"cluster_{kind}"
    check_impl(name, impl)
    check_config(name, config, ClusterCollectiveConfig)
    config = config or _DEFAULT
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"{name}: x must be [groups, cluster_size, size], got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        raise ValueError(f"{name}: x dtype must be float32, float16 or bfloat16, got {x.dtype}")
    if config.cluster_size is not None and x.shape[1] != config.cluster_size:
        raise ValueError(f"{name}: x.shape[1] ({x.shape[1]}) must equal config.cluster_size "
                         f"({config.cluster_size}): one row per block")
    if x.shape[0] < 1 or x.shape[2] < 1:
        raise ValueError(f"{name}: x must have at least one group and one element, got {x.shape}")
    n = x.shape[1]
    if n not in CLUSTER_SIZES:
        return config, f"{name}: cluster_size must be one of {CLUSTER_SIZES}, got {n} (x.shape[1])"
    need = shared_memory_bytes(kind, x.dtype, n, x.shape[2], config.exchange)
    if need > SHARED_MEMORY_LIMIT_BYTES:
        return config, (
            f"{name}: a block's slice of {x.shape[2]} x {jnp.dtype(x.dtype).name} needs {need} bytes "
            f"of shared memory with cluster_size={n}, exchange={config.exchange!r}; the limit is "
            f"{SHARED_MEMORY_LIMIT_BYTES} bytes per block (227 KiB on sm_90, less 1 KiB reserved)")
    return config, None


def _abstract(kind):
    def abstract_eval(x, *, op, exchange, repeat, all_blocks):
        del op, repeat
        groups, n, size = x.shape
        per_copy = (n * size,) if kind == "gather" else (size,)
        out_shape = (groups, n) + per_copy if all_blocks else (groups,) + per_copy
        workspace = _PLAN.cluster_collective_workspace_bytes(jnp.dtype(x.dtype).name, groups, n, size,
                                                             EXCHANGES[exchange])
        return ShapedArray(out_shape, x.dtype), ShapedArray((workspace,), np.uint8)

    return abstract_eval


def _batching(kind):
    def rule(args, dims, **params):
        (x,), (axis,) = args, dims
        x = fold_batch_axis(x, axis, x.shape[axis] if axis is not None else 1)
        batch, groups = x.shape[0], x.shape[1]
        out, workspace = _PRIMS[kind].bind(x.reshape((batch * groups,) + x.shape[2:]), **params)
        out = out.reshape((batch, groups) + out.shape[1:])
        return (out, workspace.reshape(batch, -1)), (0, 0)

    return rule


_PRIMS = {
    kind: ffi_primitive(f"cluster_{kind}", abstract_eval=_abstract(kind), batching_rule=_batching(kind))
    for kind in ("reduce", "gather")
}


def _xla_reduce(x, op, all_blocks, repeat):
    n = x.shape[1]
    out = jnp.sum(x, axis=1) if op == "sum" else jnp.max(x, axis=1)
    if op == "sum" and repeat > 1:  # every further call sums N equal copies
        out = out * jnp.asarray(float(n) ** (repeat - 1), x.dtype)
    return jnp.broadcast_to(out[:, None], x.shape) if all_blocks else out


def _xla_gather(x, all_blocks, repeat):
    groups, n, size = x.shape
    out = (x + jnp.asarray(repeat - 1, x.dtype)) if repeat > 1 else x
    out = out.reshape(groups, n * size)
    return jnp.broadcast_to(out[:, None], (groups, n, n * size)) if all_blocks else out


def _run(kind, x, op, all_blocks, impl, config):
    config, uncovered = _validate(kind, x, impl, config)
    repeat = config.repeat
    if impl in ("auto", "cuda") and uncovered is not None:
        if impl == "cuda":
            raise ValueError(uncovered)
        warn_once((f"cluster_{kind}", uncovered), uncovered + "; using impl='xla'", stacklevel=4)
        impl = "xla"
    if impl == "reference":
        if kind == "reduce":
            return reference.cluster_reduce(x, op, all_blocks=all_blocks, repeat=repeat)
        return reference.cluster_gather(x, all_blocks=all_blocks, repeat=repeat)
    if impl == "xla":
        if kind == "reduce":
            return _xla_reduce(x, op, all_blocks, repeat)
        return _xla_gather(x, all_blocks, repeat)
    out, _ = _PRIMS[kind].bind(x, op=_OPS[op], exchange=EXCHANGES.index(config.exchange),
                               repeat=repeat, all_blocks=bool(all_blocks))
    return out


def cluster_reduce(
    x: jax.Array,
    op: str = "sum",
    *,
    all_blocks: bool = False,
    impl: str = "auto",
    config: ClusterCollectiveConfig | None = None,
) -> jax.Array:
    """All-reduce within each cluster: [groups, N, size] -> [groups, size].

    op: "sum" or "max". all_blocks=True returns every block's copy, [groups, N, size]: all
    copies are bitwise equal. impl: see the module docstring; config:
    :class:`ClusterCollectiveConfig` (None: the DSMEM exchange, once).
    """
    if op not in _OPS:
        raise ValueError(f"cluster_reduce: op must be 'sum' or 'max', got {op!r}")
    return _run("reduce", x, op, all_blocks, impl, config)


def cluster_gather(
    x: jax.Array,
    *,
    all_blocks: bool = False,
    impl: str = "auto",
    config: ClusterCollectiveConfig | None = None,
) -> jax.Array:
    """All-gather within each cluster: [groups, N, size] -> [groups, N * size].

    Segment j of the result is block j's row. all_blocks=True returns every block's copy,
    [groups, N, N * size]. impl, config: as in :func:`cluster_reduce`.
    """
    return _run("gather", x, "sum", all_blocks, impl, config)
