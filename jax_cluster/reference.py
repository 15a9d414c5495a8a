"""jnp references for every op, written from the math with fp32 accumulation."""

from __future__ import annotations

import jax.numpy as jnp


def cluster_reduce(x, op: str = "sum", *, all_blocks: bool = False, repeat: int = 1):
    """[groups, N, size] -> [groups, size] (or every block's copy)."""
    n = x.shape[1]
    xf = x.astype(jnp.float32)
    if op == "sum":
        out = xf.sum(axis=1) * float(n) ** (repeat - 1)
    else:
        out = xf.max(axis=1)
    out = out.astype(x.dtype)
    return jnp.broadcast_to(out[:, None], x.shape) if all_blocks else out


def cluster_gather(x, *, all_blocks: bool = False, repeat: int = 1):
    """[groups, N, size] -> [groups, N * size]; call c of `repeat` gathers x + c."""
    groups, n, size = x.shape
    out = (x.astype(jnp.float32) + (repeat - 1)).astype(x.dtype) if repeat > 1 else x
    out = out.reshape(groups, n * size)
    return jnp.broadcast_to(out[:, None], (groups, n, n * size)) if all_blocks else out
