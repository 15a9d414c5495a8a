"""Local (single-device) attention over several KV chunks, folded into a running state.

This is the jnp path of the multi-chunk kernel of StreamFusion (Appendix C, Algorithm 2):
one call takes a query block and any number of key/value chunks and merges their
contribution into an incoming state. The schedules in this package call it through a
pluggable ``kernel`` so that a fused CUDA op (``jax_cluster.flash_attention``) can take its
place with the same signature.

State convention (normalized output + log-sum-exp)
-------------------------------------------------
``State(o, lse)`` where, for the KV tokens seen so far,

* ``o``   float32 ``[B, Lq, H, Dh]`` = softmax-weighted average of V (already normalized),
* ``lse`` float32 ``[B, H, Lq]``     = log( sum_j exp(s_ij) ), s = scale * q.k (natural log).

The empty state (no KV seen) is ``o = 0, lse = -inf``; ``finalize`` of an empty row gives 0.
With Eq. (1) of the paper, ``lse = m + log(l)`` and ``o = O`` (the divided output), so
the (O, l, m) triplet and this pair carry the same information. Two states over disjoint KV
sets merge as

    lse = logaddexp(lse_a, lse_b)
    o   = sigmoid(lse_a - lse_b) * o_a + sigmoid(lse_b - lse_a) * o_b

which never overflows (the weights are in [0, 1]) and handles empty states.

Kernel hook
-----------
A kernel is any callable with the signature of :func:`attend`::

    kernel(q, kv_chunks, state, *, scale) -> State

    q          [B, Lq, H, Dh], fp16/bf16/fp32
    kv_chunks  sequence of (k, v), each [B, Lk_i, H, Dh] (same dtype as q; Lk_i may be 0)
    state      State(o fp32 [B, Lq, H, Dh], lse fp32 [B, H, Lq]) or None (= empty)
    scale      float, the softmax scale (1/sqrt(Dh) by default in callers)
    returns    the merged State (fp32)

Non-causal, no masking. Register alternatives with :func:`register_kernel`. A kernel whose
attribute ``takes_query_chunks`` is true also accepts a list of query chunks and a list of
states (one per chunk) and returns a list of states: the schedules then hand it several query
chunks in one call instead of concatenating them.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp


class State(NamedTuple):
    """Running attention state of one query block: normalized ``o`` and ``lse`` (fp32)."""

    o: jax.Array  # [B, Lq, H, Dh] float32, normalized
    lse: jax.Array  # [B, H, Lq] float32, natural log; -inf = no KV seen


Kernel = Callable[..., State]

# Blocking of the jnp path: bounded memory for long sequences (scores are [B, H, bq, bk]).
Q_BLOCK = 2048
KV_BLOCK = 2048


def empty_state(batch: int, q_len: int, heads: int, head_dim: int) -> State:
    """The state of a query block that has seen no keys: o = 0, lse = -inf."""
    return State(
        jnp.zeros((batch, q_len, heads, head_dim), jnp.float32),
        jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32),
    )


def merge(a: State, b: State) -> State:
    """Merge two states computed over disjoint KV sets (log-sum-exp / sigmoid form)."""
    lse = jnp.logaddexp(a.lse, b.lse)  # -inf when both are empty
    both_empty = jnp.isneginf(a.lse) & jnp.isneginf(b.lse)
    diff = jnp.where(both_empty, 0.0, a.lse - b.lse)  # avoid (-inf) - (-inf)
    wa = jax.nn.sigmoid(diff)
    wb = jax.nn.sigmoid(-diff)
    # [B, H, Lq] -> [B, Lq, H, 1]
    wa = jnp.transpose(wa, (0, 2, 1))[..., None]
    wb = jnp.transpose(wb, (0, 2, 1))[..., None]
    return State(wa * a.o + wb * b.o, lse)


def finalize(state: State, dtype=None) -> jax.Array:
    """The attention output of a state, ``[B, Lq, H, Dh]`` in ``dtype`` (0 where nothing was seen)."""
    o = jnp.where(jnp.isneginf(state.lse).transpose(0, 2, 1)[..., None], 0.0, state.o)
    return o if dtype is None else o.astype(dtype)


def _block_state(q, k, v, scale) -> State:
    """State of one query block against one KV block (Lk > 0), fp32 accumulation."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    o = o / jnp.transpose(l, (0, 2, 1))[..., None]
    return State(o, m + jnp.log(l))


def _split_main(n: int, block: int) -> tuple[int, int]:
    """Number of full blocks and the length of the remainder."""
    return n // block, n % block


def _kv_fold(q, k, v, state: State, scale, kv_block: int) -> State:
    """Fold one KV chunk into ``state``, scanning over KV blocks of ``kv_block`` tokens."""
    lk = k.shape[1]
    if lk <= kv_block:
        return merge(state, _block_state(q, k, v, scale))
    nb, rem = _split_main(lk, kv_block)
    main = nb * kv_block
    if nb > 0:
        kb = k[:, :main].reshape(k.shape[0], nb, kv_block, *k.shape[2:]).swapaxes(0, 1)
        vb = v[:, :main].reshape(v.shape[0], nb, kv_block, *v.shape[2:]).swapaxes(0, 1)

        def body(st, kv):
            return merge(st, _block_state(q, kv[0], kv[1], scale)), None

        state, _ = jax.lax.scan(body, state, (kb, vb))
    if rem:
        state = merge(state, _block_state(q, k[:, main:], v[:, main:], scale))
    return state


def _attend_qblock(q, kv_chunks, state: State, scale, kv_block) -> State:
    for k, v in kv_chunks:
        if k.shape[1] == 0:
            continue
        state = _kv_fold(q, k, v, state, scale, kv_block)
    return state


def attend(
    q: jax.Array,
    kv_chunks: Sequence[tuple[jax.Array, jax.Array]],
    state: State | None = None,
    *,
    scale: float | None = None,
    q_block: int = Q_BLOCK,
    kv_block: int = KV_BLOCK,
) -> State:
    """Fold the attention of ``q`` over every ``(k, v)`` chunk into ``state`` (jnp path).

    Non-causal. Empty chunks (``Lk == 0``) are skipped; ``state=None`` means the empty state.
    Long inputs are processed in ``q_block`` x ``kv_block`` tiles so the scores never exceed
    ``B * H * q_block * kv_block`` floats. Returns the merged fp32 :class:`State`.
    """
    b, lq, h, d = q.shape
    for i, (k, v) in enumerate(kv_chunks):
        if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h, d):
            raise ValueError(
                f"kv_chunks[{i}]: k {k.shape} and v {v.shape} must both be [B={b}, Lk, H={h}, Dh={d}]"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if state is None:
        state = empty_state(b, lq, h, d)
    if state.o.shape != (b, lq, h, d) or state.lse.shape != (b, h, lq):
        raise ValueError(
            f"state: o {state.o.shape} / lse {state.lse.shape} must be "
            f"[{b}, {lq}, {h}, {d}] / [{b}, {h}, {lq}]"
        )
    state = State(state.o.astype(jnp.float32), state.lse.astype(jnp.float32))
    if lq == 0 or not any(k.shape[1] for k, _ in kv_chunks):
        return state
    nb, rem = _split_main(lq, q_block)
    if lq <= q_block:
        return _attend_qblock(q, kv_chunks, state, scale, kv_block)
    main = nb * q_block

    def qblocks(x, axis):  # [.., main, ..] -> [nb, .., q_block, ..]
        x = jax.lax.slice_in_dim(x, 0, main, axis=axis)
        shp = x.shape[:axis] + (nb, q_block) + x.shape[axis + 1 :]
        return jnp.moveaxis(x.reshape(shp), axis, 0)

    def one(args):
        qq, oo, ll = args
        st = _attend_qblock(qq, kv_chunks, State(oo, ll), scale, kv_block)
        return st.o, st.lse

    ob, lb = jax.lax.map(one, (qblocks(q, 1), qblocks(state.o, 1), qblocks(state.lse, 2)))
    o = jnp.moveaxis(ob, 0, 1).reshape(b, main, h, d)
    lse = jnp.moveaxis(lb, 0, 2).reshape(b, h, main)
    if rem:
        tail = _attend_qblock(
            q[:, main:], kv_chunks, State(state.o[:, main:], state.lse[..., main:]), scale, kv_block
        )
        o = jnp.concatenate([o, tail.o], axis=1)
        lse = jnp.concatenate([lse, tail.lse], axis=2)
    return State(o, lse)


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


_KERNELS: dict[str, Kernel] = {"jnp": attend}


def register_kernel(name: str, fn: Kernel) -> None:
    """Make ``fn`` (signature of :func:`attend`) selectable as ``kernel=name``."""
    _KERNELS[name] = fn


def get_kernel(kernel: str | Kernel | None) -> Kernel:
    """Resolve a kernel given by name, callable, or None: the fused op
    ``jax_cluster.flash_attention`` where it is registered (it registers itself on import),
    else the jnp path."""
    if kernel is None:
        return _KERNELS.get("flash_attention", attend)
    if callable(kernel):
        return kernel
    try:
        return _KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown attention kernel {kernel!r}; registered: {sorted(_KERNELS)}") from None
