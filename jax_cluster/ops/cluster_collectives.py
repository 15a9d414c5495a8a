"""cluster_reduce / cluster_gather: the DSMEM collectives exposed as ops.

`x` is [groups, N, size]: one thread-block cluster of N blocks per group,
block b holding x[g, b] in shared memory. These ops exist to test and measure
the collectives that the fused kernels use internally
(cpp/include/jax_cluster/cluster_collectives.cuh).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster._ffi import ffi_primitive, fold_batch_axis

SUPPORTED_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
CLUSTER_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16)
# Dynamic shared memory a block may use: sm_90's 227 KiB opt-in limit, less
# 1 KiB kept for barriers and static shared memory.
SHARED_MEMORY_LIMIT_BYTES = 232448 - 1024

_OPS = {"sum": 0, "max": 1}
_IMPLS = {"dsmem": 0, "global": 1}


def _slice_bytes(dtype, size: int) -> int:
    return -(-size * jnp.dtype(dtype).itemsize // 16) * 16


def exchange_slots(cluster_size: int) -> int:
    """Receive slots per block (mirrors cluster_exchange_slots in jax_cluster/types.h): one
    per butterfly round for a power of two, else one per peer (the direct schedule)."""
    if cluster_size & (cluster_size - 1):
        return cluster_size - 1
    return cluster_size.bit_length() - 1


def shared_memory_bytes(kind: str, dtype, cluster_size: int, size: int, impl: str) -> int:
    """Shared memory per block (mirrors cpp/kernels/cluster_collectives.h)."""
    slice_bytes = _slice_bytes(dtype, size)
    if kind == "gather":
        return slice_bytes * (cluster_size + 1)
    return slice_bytes * (1 + exchange_slots(cluster_size)) if impl == "dsmem" else slice_bytes


def _workspace_bytes(dtype, groups: int, cluster_size: int, size: int, impl: str) -> int:
    return 2 * groups * cluster_size * _slice_bytes(dtype, size) if impl == "global" else 0


def _validate(kind: str, x, cluster_size, impl: str, repeat: int) -> int:
    name = f"cluster_{kind}"
    if impl not in _IMPLS:
        raise ValueError(f"{name}: impl must be one of {sorted(_IMPLS)}, got {impl!r}")
    if x.ndim != 3:
        raise ValueError(f"{name}: x must be [groups, cluster_size, size], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        raise ValueError(f"{name}: x dtype must be float32, float16 or bfloat16, got {x.dtype}")
    n = x.shape[1] if cluster_size is None else cluster_size
    if n not in CLUSTER_SIZES:
        raise ValueError(f"{name}: cluster_size must be one of {CLUSTER_SIZES}, got {n}")
    if x.shape[1] != n:
        raise ValueError(
            f"{name}: x.shape[1] ({x.shape[1]}) must equal cluster_size ({n}): one row per block"
        )
    if x.shape[0] < 1 or x.shape[2] < 1:
        raise ValueError(f"{name}: x must have at least one group and one element, got {x.shape}")
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"{name}: repeat must be a positive int, got {repeat!r}")
    need = shared_memory_bytes(kind, x.dtype, n, x.shape[2], impl)
    if need > SHARED_MEMORY_LIMIT_BYTES:
        raise ValueError(
            f"{name}: a block's slice of {x.shape[2]} x {jnp.dtype(x.dtype).name} needs {need} bytes "
            f"of shared memory with cluster_size={n}, impl={impl!r}; the limit is "
            f"{SHARED_MEMORY_LIMIT_BYTES} bytes per block (227 KiB on sm_90, less 1 KiB reserved)"
        )
    return n


def _abstract(kind):
    def abstract_eval(x, *, op, exchange, repeat, all_blocks):
        groups, n, size = x.shape
        per_copy = (n * size,) if kind == "gather" else (size,)
        out_shape = (groups, n) + per_copy if all_blocks else (groups,) + per_copy
        impl_name = "global" if exchange == _IMPLS["global"] else "dsmem"
        workspace = _workspace_bytes(x.dtype, groups, n, size, impl_name)
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


def cluster_reduce(
    x: jax.Array,
    op: str = "sum",
    cluster_size: int | None = None,
    impl: str = "dsmem",
    *,
    all_blocks: bool = False,
    repeat: int = 1,
) -> jax.Array:
    """All-reduce within each cluster: [groups, N, size] -> [groups, size].

    op: "sum" or "max". impl: "dsmem" (on-chip, distributed shared memory) or
    "global" (the off-chip baseline). all_blocks=True returns every block's copy,
    [groups, N, size]: all copies are bitwise equal. repeat=k runs the collective
    k times in place inside one kernel (benchmarking; the result is the k-fold
    reduction, e.g. sum * N**(k-1)).
    """
    if op not in _OPS:
        raise ValueError(f"cluster_reduce: op must be 'sum' or 'max', got {op!r}")
    _validate("reduce", x, cluster_size, impl, repeat)
    out, _ = _PRIMS["reduce"].bind(
        x, op=_OPS[op], exchange=_IMPLS[impl], repeat=repeat, all_blocks=bool(all_blocks)
    )
    return out


def cluster_gather(
    x: jax.Array,
    cluster_size: int | None = None,
    impl: str = "dsmem",
    *,
    all_blocks: bool = False,
    repeat: int = 1,
) -> jax.Array:
    """All-gather within each cluster: [groups, N, size] -> [groups, N * size].

    Segment j of the result is block j's row. all_blocks=True returns every
    block's copy, [groups, N, N * size]. repeat=k gathers k times in one kernel,
    call c gathering x + c (so the result is x + k - 1: stale data would show).
    """
    _validate("gather", x, cluster_size, impl, repeat)
    out, _ = _PRIMS["gather"].bind(
        x, op=0, exchange=_IMPLS[impl], repeat=repeat, all_blocks=bool(all_blocks)
    )
    return out
