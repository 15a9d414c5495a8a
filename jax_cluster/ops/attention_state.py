"""The running attention state that flash_attention folds KV chunks into, and its algebra.

``State(o, lse)`` of a query block, for the keys seen so far:

* ``o``   float32 ``[B, Lq, H, Dh]``: the softmax-weighted mean of V (already normalized);
* ``lse`` float32 ``[B, H, Lq]``: ``log(sum_j exp(s_j))`` of the scaled scores (natural log).

The empty state (no key seen) is ``lse = -inf`` (its ``o`` is ignored; :func:`empty_state`
makes ``o = 0``). With the (O, l, m) triplet of FlashAttention, ``lse = m + log(l)`` and
``o = O / l``: the same information. Two states over disjoint key sets merge as

    lse = logaddexp(lse_a, lse_b)
    o   = sigmoid(lse_a - lse_b) * o_a + sigmoid(lse_b - lse_a) * o_b

which never overflows (the weights are in [0, 1]) and handles empty states.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class State(NamedTuple):
    """Running attention state of one query block: normalized ``o`` and ``lse`` (fp32)."""

    o: jax.Array  # [B, Lq, H, Dh] float32, normalized
    lse: jax.Array  # [B, H, Lq] float32, natural log; -inf = no key seen


def empty_state(batch: int, q_len: int, heads: int, head_dim: int) -> State:
    """The state of a query block that has seen no keys: o = 0, lse = -inf."""
    return State(
        jnp.zeros((batch, q_len, heads, head_dim), jnp.float32),
        jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32),
    )


def merge(a: State, b: State) -> State:
    """Merge two states computed over disjoint key sets (log-sum-exp / sigmoid form)."""
    lse = jnp.logaddexp(a.lse, b.lse)  # -inf when both are empty
    both_empty = jnp.isneginf(a.lse) & jnp.isneginf(b.lse)
    diff = jnp.where(both_empty, 0.0, a.lse - b.lse)  # avoid (-inf) - (-inf)
    # [B, H, Lq] -> [B, Lq, H, 1]
    wa = jnp.transpose(jax.nn.sigmoid(diff), (0, 2, 1))[..., None]
    wb = jnp.transpose(jax.nn.sigmoid(-diff), (0, 2, 1))[..., None]
    return State(wa * a.o + wb * b.o, lse)


def finalize(state: State, dtype=None) -> jax.Array:
    """The attention output of a state, ``[B, Lq, H, Dh]`` in ``dtype`` (0 where nothing was seen)."""
    o = jnp.where(jnp.isneginf(state.lse).transpose(0, 2, 1)[..., None], 0.0, state.o)
    return o if dtype is None else o.astype(dtype)


def concat(states: Sequence[State | None], q_lens: Sequence[int], heads: int, head_dim: int,
           batch: int) -> State:
    """The states of consecutive query chunks as one state along L (None = empty)."""
    full = [st if st is not None else empty_state(batch, n, heads, head_dim)
            for st, n in zip(states, q_lens)]
    return State(jnp.concatenate([s.o for s in full], 1), jnp.concatenate([s.lse for s in full], 2))


def split(state: State, q_lens: Sequence[int]) -> list[State]:
    """Inverse of :func:`concat`: one state per query chunk of the given lengths."""
    cuts = np.cumsum([0] + list(q_lens))
    return [State(state.o[:, a:c], state.lse[:, :, a:c]) for a, c in zip(cuts[:-1], cuts[1:])]
