"""Shared decoder-model machinery: embedding/head, prefill over right-padded prompts, decode steps.

Padding: prompts are RIGHT-padded. Token t of row b sits at cache slot t and RoPE position t, which
is exactly the cache convention (slot == position == lengths[b] for the next token), so no
per-row position offsets exist anywhere, the causal mask alone is a correct prefill mask (a real
query never sees a later pad), and the fused decode kernels only need ``lengths``. K/V written for
pad slots are ignored (beyond lengths[b]) and overwritten by the following decode steps.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from . import attention as attn
from .layers import Embed, Linear, dense
from .rope import apply_rope, attention_factor, cos_sin, inv_frequencies


class CausalLM(nnx.Module):
    """Subclasses define ``self.embed``, ``self.lm_head`` (None when tied), ``self.layers`` and
    ``_final_norm``, ``_prefill_layer``, ``_decode_layer``, ``init_cache``."""

    config = None
    impl = "auto"

    def _init_head(self, cfg, dtype, rngs):
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed.embedding.get_value().dtype

    def logits(self, h):
        """float32 logits."""
        if self.lm_head is None:
            return self.embed.attend(h)
        return jnp.matmul(h, self.lm_head.kernel[...].astype(h.dtype), preferred_element_type=jnp.float32)

    # rope helpers ------------------------------------------------------------
    def _rope_dim(self) -> int:
        raise NotImplementedError

    def inv_freq(self):
        return inv_frequencies(self.config.rope, self._rope_dim())

    def rope_factor(self) -> float:
        return attention_factor(self.config.rope, self._rope_dim())

    # public API ----------------------------------------------------------------
    def prefill(self, tokens, lengths, cache, *, all_logits: bool = False):
        """tokens [B, T] right-padded, lengths [B] (1 <= lengths <= T <= cache.max_len), an empty cache.

        Returns (logits, cache): logits [B, V] of each row's last real token, or [B, T, V] with
        all_logits; cache.lengths = lengths.
        """
        b, t = tokens.shape
        if t > cache.max_len:
            raise ValueError(f"prompt length {t} exceeds the cache length {cache.max_len}")
        x = self.embed(tokens)
        cos, sin = cos_sin(jnp.arange(t), self.inv_freq(), self.rope_factor())
        lengths = jnp.asarray(lengths, jnp.int32)
        # the layers read cache.lengths: a rolling buffer keeps each row's last real tokens
        x, cache = self._prefill_layers(x, cos, sin, dataclasses.replace(cache, lengths=lengths))
        x = self._final_norm(x)
        if not all_logits:
            x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return self.logits(x), dataclasses.replace(cache, lengths=lengths)

    def decode(self, tokens, cache, *, impl=None):
        """One step: tokens [B] at positions cache.lengths. Returns (logits [B, V] float32, cache)."""
        impl = self.impl if impl is None else impl
        x = self.embed(tokens)
        x, cache = self._decode_layers(x, cache, impl)
        cache = dataclasses.replace(cache, lengths=cache.lengths + 1)
        return self.logits(self._final_norm(x)), cache

    def __call__(self, tokens):
        """Full-sequence logits [B, T, V] (no padding) — a convenience for tests."""
        b, t = tokens.shape
        cache = self.init_cache(b, t)
        logits, _ = self.prefill(tokens, jnp.full((b,), t, jnp.int32), cache, all_logits=True)
        return logits


def mha_prefill(h, w_qkv, b_qkv, w_o, b_o, k_cache, v_cache, cos, sin, *, num_q_heads, num_kv_heads,
                head_dim, scale, layout="half", window=None, lengths=None):
    """Prefill attention block on normalised input h [B, T, hidden]; writes slots 0..T-1 of the caches
    (a rolling buffer shorter than T: each row's last tokens, attention.write_prompt, which needs
    lengths [B]). Returns (attention output projected [B, T, hidden], k_cache, v_cache)."""
    b, t, _ = h.shape
    hq, hkv, d = num_q_heads, num_kv_heads, head_dim
    qkv = dense(h, w_qkv, b_qkv)
    q = qkv[..., : hq * d].reshape(b, t, hq, d)
    k = qkv[..., hq * d : (hq + hkv) * d].reshape(b, t, hkv, d)
    v = qkv[..., (hq + hkv) * d :].reshape(b, t, hkv, d)
    q = apply_rope(q, cos[:, None, :], sin[:, None, :], layout)
    k = apply_rope(k, cos[:, None, :], sin[:, None, :], layout)
    k_cache = attn.write_prompt(k_cache, k, lengths)
    v_cache = attn.write_prompt(v_cache, v, lengths)
    o = attn.causal_attention(q, k, v, scale, window)
    return dense(o.reshape(b, t, hq * d), w_o, b_o), k_cache, v_cache
