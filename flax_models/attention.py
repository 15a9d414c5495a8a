"""Attention math in plain jnp: causal prefill attention, decode attention over a KV cache, and the
cache writes. float32 scores and softmax; probabilities rounded to the value dtype before P @ V
(as Hugging Face's eager attention does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# The fp32 scores of one block of queries against every key stay under this many bytes: a
# long prompt's [T, T] scores per head would not fit (Llama-3-8B at T = 16K: 34 GB per layer).
PREFILL_SCORE_BYTES = 256 << 20
MIN_QUERY_BLOCK = 16


def query_block(batch: int, q_heads: int, t: int, window: int | None = None) -> int:
    """Queries per block of causal_attention: all t when their scores fit PREFILL_SCORE_BYTES,
    else the largest power of two (at least MIN_QUERY_BLOCK) whose scores do. With a sliding
    window a block's queries see at most block + window - 1 keys, and only those are scored."""

    def score_bytes(block: int) -> int:
        keys = t if window is None else min(t, block + window - 1)
        return batch * q_heads * block * keys * 4

    if score_bytes(t) <= PREFILL_SCORE_BYTES:
        return t
    block = MIN_QUERY_BLOCK
    while 2 * block < t and score_bytes(2 * block) <= PREFILL_SCORE_BYTES:
        block *= 2
    return block


def causal_attention(q, k, v, scale: float, window: int | None = None):
    """q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] -> [B, T, Hq, Dv] (causal, GQA; with
    a sliding window, query t sees keys t - window < s <= t).

    With right-padded prompts no padding mask is needed: a real query at t < length only sees keys
    at s <= t, which are real too; outputs at padded positions are never used. Long prompts run
    in blocks of queries (query_block), one after another: the same math per query, with the
    scores' memory bounded. A block attends to every key, or with a sliding window to the
    keys its queries' windows reach (a long prompt's work then grows with T x window, not T^2).
    """
    b, t, hq, _ = q.shape
    block = query_block(b, hq, t, window)
    if block >= t:
        return _attend_causal(q, k, v, scale, 0, 0, window)
    n = -(-t // block)
    span = t if window is None else min(t, block + window - 1)  # the keys one block reads
    qb = jnp.pad(q, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))  # padded queries: outputs dropped
    qb = jnp.moveaxis(qb.reshape(b, n, block, *q.shape[2:]), 1, 0)

    def one(a):
        queries, first = a
        start = jnp.clip(first - (span - block), 0, t - span)  # keys [start, start + span)
        keys = jax.lax.dynamic_slice_in_dim(k, start, span, axis=1)
        values = jax.lax.dynamic_slice_in_dim(v, start, span, axis=1)
        return _attend_causal(queries, keys, values, scale, first, start, window)

    out = jax.lax.map(one, (qb, jnp.arange(n) * block))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, hq, v.shape[-1])[:, :t]


def _attend_causal(q, k, v, scale: float, first, key_first, window):
    """Queries q [B, C, Hq, D] at positions first.. first + C - 1 against keys [B, L, Hkv, D] at
    positions key_first.. key_first + L - 1."""
    b, c, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, c, hkv, hq // hkv, d)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
    pos = first + jnp.arange(c)[:, None]
    key_pos = key_first + jnp.arange(t)[None, :]
    mask = key_pos <= pos
    if window is not None:
        mask &= key_pos > pos - window
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgts,bshd->bthgd", p, v, preferred_element_type=jnp.float32)
    return o.reshape(b, c, hq, v.shape[-1]).astype(q.dtype)


def decode_attention_core(q, k_cache, v_cache, lengths, scale: float, window: int | None = None):
    """One new query per sequence against the cache, the new token already written.

    q [B, Hq, D], caches [B, Hkv, S, D|Dv], lengths [B] (tokens before the new one): attends to
    slots 0..lengths[b] inclusive (with a sliding window, only the last `window` of them).
    Returns [B, Hq, Dv] in q.dtype.
    """
    b, hq, d = q.shape
    hkv, s_max = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(s_max)[None, :] <= lengths[:, None]
    if window is not None:
        valid &= jnp.arange(s_max)[None, :] > lengths[:, None] - window
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, v_cache, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, v_cache.shape[-1]).astype(q.dtype)


def write_prefix(cache, new):
    """cache [B, H, S, D] <- new [B, T, H, D] at slots 0..T-1."""
    new = jnp.swapaxes(new, 1, 2).astype(cache.dtype)
    return jax.lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))


def write_prompt(cache, new, lengths):
    """cache [B, H, S, D] <- a prompt's new [B, T, H, D] (right-padded; lengths [B] real tokens
    per row): at slots 0..T-1 where they fit, else (a rolling buffer of S < T slots) each row's
    last S real tokens, position t at slot t % S. Slots past a shorter row's tokens get padding
    there, which no step reads before it writes them."""
    s, t = cache.shape[2], new.shape[1]
    if t <= s:
        return write_prefix(cache, new)
    slot = jnp.arange(s)[None, :]
    last = jnp.asarray(lengths, jnp.int32)[:, None] - 1
    src = jnp.minimum(slot + s * jnp.maximum(0, (last - slot) // s), t - 1)  # [B, S]: the newest t = slot mod S
    kept = jnp.take_along_axis(new, src[:, :, None, None], axis=1)
    return jnp.swapaxes(kept, 1, 2).astype(cache.dtype)


def write_at(cache, new, lengths):
    """cache [B, H, S, D] <- new [B, H, D] at slot lengths[b] of each row (in place when donated)."""

    def one(c, n, pos):
        return jax.lax.dynamic_update_slice(c, n[:, None, :].astype(c.dtype), (0, pos, 0))

    return jax.vmap(one)(cache, new, lengths.astype(jnp.int32))
