"""attention_block without the fused kernel: XLA's projections around three attentions.

attention_block_xla      XLA's ops throughout, in the input dtype with fp32 accumulation
                         (no fp32 copies of weights or caches, unlike the reference);
attention_block_pallas   the attention by Pallas' split-K decode kernel
                         (jax.experimental.pallas.ops.gpu.decode_attention);
attention_block_split_k  RoPE, cache write and attention in our split-K kernels
                         (jax_cluster.decode_attention_append).

The tuner weighs them against the fused kernel's configurations, so impl="auto" is never
slower than plain XLA where the fused kernel loses (docs/attention_block.md). Same
contract as the kernel: the caches change only at slot lengths[b]; rows with lengths
outside [0, S_max) give NaN and write nothing.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from jax_cluster.reference import _norm_f32, _rope


def _write_slot(cache, new, pos, valid):
    """cache [B, H, S, D] with new [B, H, D] at slot pos[b] where valid[b]: one scatter
    (in place when donated) whose invalid rows point past S_max and are dropped."""
    batch, heads = new.shape[:2]
    slot = jnp.where(valid, pos, cache.shape[2])[:, None]
    return cache.at[jnp.arange(batch)[:, None], jnp.arange(heads)[None, :], slot].set(
        new.astype(cache.dtype), mode="drop")


def _attend_einsum(qg, k_cache, v_cache, pos):
    """o [B, Hkv, G, Dh] (fp32; _decode_step casts it to the input dtype) of the pre-scaled
    queries qg [B, Hkv, G, Dh] over cache slots 0..pos[b]: XLA's einsums and softmax."""
    f32 = jnp.float32
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k_cache, preferred_element_type=f32)
    s = jnp.where(jnp.arange(k_cache.shape[2]) <= pos[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(qg.dtype)
    return jnp.einsum("bhgs,bhsd->bhgd", p, v_cache, preferred_element_type=f32)


# Pallas' decode kernel splits S_max into this many equal parts of whole key blocks (its
# defaults, as the benchmark's Pallas peer runs it).
PALLAS_K_SPLITS, PALLAS_BLOCK_K = 16, 128


@functools.cache
def _pallas_decode_attention():
    """Pallas' decode attention module, or None where this JAX has none. jax 0.11 deprecates
    it with Pallas' Triton backend (a DeprecationWarning at import, silenced here); once it
    is gone the tuner stops weighing "pallas" and impl="pallas" raises."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import decode_attention
    except ImportError:
        return None
    return decode_attention


def pallas_supported(head_dim: int, max_seq: int) -> bool:
    """Whether Pallas' decode kernel is there and takes these shapes: S_max in 16 equal
    splits of >= 16 tokens, each split whole key blocks of min(128, split) tokens, and
    head_dim and that block a power of two (Triton's block shapes: 1152 slots, splits of 72,
    fail to lower)."""
    split = max_seq // PALLAS_K_SPLITS
    block = min(PALLAS_BLOCK_K, split)
    return (head_dim in (16, 32, 64, 128, 256) and max_seq % PALLAS_K_SPLITS == 0 and split >= 16
            and split % block == 0 and block & (block - 1) == 0 and _pallas_decode_attention() is not None)


def _attend_pallas(qg, k_cache, v_cache, pos, interpret=False):
    """_attend_einsum's result, in the queries' dtype (no fp32 round trip before W_o), from
    Pallas' GQA decode kernel (kv_seq_len = pos + 1). The kernel takes the caches
    [B, S, Hkv, Dh] and swaps them back to [B, Hkv, S, Dh] itself: the two transposes
    cancel in XLA, no copy of the cache is made."""
    b, hkv, group, dh = qg.shape
    o = _pallas_decode_attention().gqa(
        qg.reshape(b, hkv * group, dh), jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2),
        kv_seq_len=pos + 1, sm_scale=1.0, k_splits=PALLAS_K_SPLITS, block_k=PALLAS_BLOCK_K,
        interpret=interpret)
    return o.reshape(b, hkv, group, dh)


def _decode_step(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, num_q_heads,
                 num_kv_heads, norm, norm_weight, norm_bias, eps, qkv_bias, o_bias, residual,
                 rotary_dim, rope_layout, scale, attend):
    f32, dt = jnp.float32, x.dtype
    batch = x.shape[0]
    _, hkv, max_seq, dh = k_cache.shape
    hq, group = num_q_heads, num_q_heads // num_kv_heads
    h = x if norm is None else _norm_f32(x, norm, norm_weight, norm_bias, eps).astype(x.dtype)
    qkv = jnp.dot(h, w_qkv, preferred_element_type=f32)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias.astype(f32)
    valid = (lengths >= 0) & (lengths < max_seq)
    pos = jnp.where(valid, lengths, 0)
    q = _rope(qkv[:, : hq * dh].reshape(batch, hq, dh), pos[:, None], inv_freq, rotary_dim, rope_layout)
    k = _rope(qkv[:, hq * dh:(hq + hkv) * dh].reshape(batch, hkv, dh), pos[:, None], inv_freq,
              rotary_dim, rope_layout)
    v = qkv[:, (hq + hkv) * dh:].reshape(batch, hkv, dh)
    k_cache = _write_slot(k_cache, k, pos, valid)
    v_cache = _write_slot(v_cache, v, pos, valid)
    qg = (q * scale).astype(dt).reshape(batch, hkv, group, dh)
    o = attend(qg, k_cache, v_cache, pos)
    y = jnp.dot(o.reshape(batch, hq * dh).astype(dt), w_o, preferred_element_type=f32)
    if o_bias is not None:
        y = y + o_bias.astype(f32)
    if residual:
        y = y + x.astype(f32)
    y = jnp.where(valid[:, None], y, jnp.nan)
    return y.astype(dt), k_cache, v_cache


def attention_block_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs):
    """The decode step with XLA's ops throughout (keyword arguments: attention_block's)."""
    return _decode_step(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, attend=_attend_einsum,
                        **kwargs)


def attention_block_pallas(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *,
                            interpret=False, **kwargs):
    """The decode step with Pallas' decode kernel for the attention and XLA's ops around it.
    A GPU op (interpret=True runs Pallas' interpreter, for tests on CPU); the shapes must
    pass pallas_supported."""
    if _pallas_decode_attention() is None:
        raise ValueError("attention_block: kernel='pallas' needs Pallas' decode attention "
                         "(jax.experimental.pallas.ops.gpu.decode_attention), which this JAX lacks")
    if not pallas_supported(k_cache.shape[3], k_cache.shape[2]):
        raise ValueError(f"attention_block: kernel='pallas' needs a power-of-two head_dim and S_max "
                         f"in {PALLAS_K_SPLITS} equal splits that are whole {PALLAS_BLOCK_K}-token "
                         f"blocks or one power-of-two block of 16-64 tokens (pallas_supported); got "
                         f"head_dim {k_cache.shape[3]}, S_max {k_cache.shape[2]}")
    attend = functools.partial(_attend_pallas, interpret=interpret)
    return _decode_step(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, attend=attend, **kwargs)


def attention_block_split_k(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, num_q_heads,
                             num_kv_heads, norm, norm_weight, norm_bias, eps, qkv_bias, o_bias,
                             residual, rotary_dim, rope_layout, scale, splits=None, rolling=False,
                             impl="cuda"):
    """The decode step with our split-K kernels for the RoPE, the cache write and the
    attention (decode_attention_append) between XLA's two projections: for batches where
    one fused cluster per row would re-read the weights per row. (Running the projections
    on jax_cluster.linear instead lost to XLA's dots at every measured shape:
    docs/attention_block.md.) Rows with lengths outside [0, S_max) get NaN from the
    attention kernel (it propagates through W_o) and write nothing. rolling and impl go to
    decode_attention_append (decoder_layer's per-op step over a rolling buffer)."""
    from jax_cluster.ops.decode_attention import DecodeAttentionConfig, decode_attention_append
    del num_kv_heads
    f32, dt = jnp.float32, x.dtype
    h = x if norm is None else _norm_f32(x, norm, norm_weight, norm_bias, eps).astype(dt)
    qkv = jnp.dot(h, w_qkv, preferred_element_type=f32)
    if qkv_bias is not None:
        qkv = qkv + qkv_bias.astype(f32)
    o, k_cache, v_cache = decode_attention_append(
        qkv, k_cache, v_cache, lengths, inv_freq, num_q_heads=num_q_heads, scale=scale,
        rotary_dim=rotary_dim, rope_layout=rope_layout, rolling=rolling, impl=impl,
        config=None if splits is None else DecodeAttentionConfig(splits=splits))
    y = jnp.dot(o.reshape(x.shape[0], -1), w_o, preferred_element_type=f32)
    if o_bias is not None:
        y = y + o_bias.astype(f32)
    if residual:
        y = y + x.astype(f32)
    return y.astype(dt), k_cache, v_cache
