"""Local (single-device) attention for the schedules: the kernel hook and its registry.

The schedules fold each step's KV chunks into a running state through a pluggable
``kernel``. The state (:class:`State`, :func:`merge`, :func:`finalize`, :func:`empty_state`)
and the XLA formulation (:func:`attend`) belong to the op ``jax_cluster.flash_attention``
(jax_cluster/ops/attention_state.py, jax_cluster/ops/flash_attention.py); this module
re-exports them for the package.

Kernel hook
-----------
A kernel is any callable with the signature of :func:`attend`::

    kernel(q, kv_chunks, state, *, scale) -> State

    q          [B, Lq, H, Dh], fp16/bf16/fp32
    kv_chunks  sequence of (k, v), each [B, Lk_i, H, Dh] (same dtype as q; Lk_i may be 0)
    state      State(o fp32 [B, Lq, H, Dh], lse fp32 [B, H, Lq]) or None (= empty)
    scale      float, the softmax scale (1/sqrt(Dh) by default in callers)
    returns    the merged State (fp32)

Non-causal, no masking. Registered names: ``"flash_attention"`` (the op, the default),
``"xla"`` (:func:`attend`) and whatever :func:`register_kernel` adds (``"cudnn"``, see
:mod:`.gpu_kernels`). A kernel whose attribute ``takes_query_chunks`` is true also accepts a
list of query chunks and a list of states (one per chunk) and returns a list of states: the
schedules then hand it several query chunks in one call instead of concatenating them.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jax_cluster.ops.attention_state import State, concat, empty_state, finalize, merge, split
from jax_cluster.ops.flash_attention import attend, flash_attention

__all__ = ["Kernel", "State", "attend", "attention", "concat", "empty_state", "finalize",
           "flash_attention_kernel", "get_kernel", "merge", "reference_attention",
           "register_kernel", "split"]

Kernel = Callable[..., State]


def flash_attention_kernel(q, kv_chunks, state=None, *, scale=None):
    """The op as the hook: ``flash_attention(q, kv_chunks, state, scale=scale)`` (lists of
    query chunks and states go in one launch)."""
    return flash_attention(q, kv_chunks, state, scale=scale)


flash_attention_kernel.takes_query_chunks = True


def attention(q, k, v, *, scale=None, kernel: Kernel | None = None) -> jax.Array:
    """Plain single-device attention ``softmax(q k^T * scale) v`` via a kernel; output in q.dtype."""
    kernel = get_kernel(kernel)
    return finalize(kernel(q, [(k, v)], None, scale=scale), q.dtype)


def reference_attention(q, k, v, *, scale=None) -> jax.Array:
    """Dense fp32 reference (materializes all scores); output fp32 [B, Lq, H, Dh]."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


_KERNELS: dict[str, Kernel] = {"flash_attention": flash_attention_kernel, "xla": attend}


def register_kernel(name: str, fn: Kernel) -> None:
    """Make ``fn`` (signature of :func:`attend`) selectable as ``kernel=name``."""
    _KERNELS[name] = fn


def get_kernel(kernel: str | Kernel | None) -> Kernel:
    """Resolve a kernel given by name, callable, or None (the op ``jax_cluster.flash_attention``)."""
    if kernel is None:
        return flash_attention_kernel
    if callable(kernel):
        return kernel
    try:
        return _KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown attention kernel {kernel!r}; registered: {sorted(_KERNELS)}") from None
