"""Llama-2 / Llama-3 decoder (GQA, Llama-3 RoPE scaling, RMSNorm, SwiGLU, tied or untied head);
Mistral and Qwen2 (q, k, v biases, sliding windows) checkpoints load into it (flax_models.config).

Q, K and V projections are stored fused, one [hidden, (Hq + 2 Hkv) D] kernel with columns
[Q heads | K heads | V heads], the layout jax_cluster.attention_block takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from flax import nnx

from . import ops
from .base import CausalLM, mha_prefill
from .cache import KVCache
from .config import LlamaConfig
from .layers import Linear, RMSNorm, SwiGLU, rms_norm
from .rope import attention_factor


class LlamaLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.qkv = Linear(cfg.hidden_size, (hq + 2 * hkv) * d, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o = Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)


class Llama(CausalLM):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, impl="auto", rngs: nnx.Rngs):
        self.config = cfg
        self.impl = ops.normalize_impl(impl)
        self._init_head(cfg, dtype, rngs)
        self.layers = nnx.List([LlamaLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def _rope_dim(self):
        return self.config.head_dim

    def rope_factor(self) -> float:
        """1: YaRN's cos/sin factor is folded into the softmax scale instead (_attn_kw)."""
        return 1.0

    def _attn_kw(self):
        # RoPE is linear and rotates every feature of q and k here, so YaRN's factor on cos and
        # sin multiplies each score by factor^2 and nothing else: carried by the scale, the
        # decode blocks need no factor of their own (and the cache holds k without it).
        c = self.config
        factor = attention_factor(c.rope, c.head_dim)
        return dict(num_q_heads=c.num_heads, num_kv_heads=c.num_kv_heads, scale=c.head_dim ** -0.5 * factor * factor)

    def _final_norm(self, x):
        return self.norm(x)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        c = self.config
        return KVCache.create(num_layers=c.num_layers, batch=batch, num_kv_heads=c.num_kv_heads,
                              max_len=max_len, head_dim=c.head_dim, dtype=dtype or self.dtype,
                              windows=[c.layer_window(i) for i in range(c.num_layers)])

    def _prefill_layers(self, x, cos, sin, cache: KVCache):
        c = self.config
        ks, vs = [], []
        for i, (layer, kc, vc) in enumerate(zip(self.layers, cache.k, cache.v)):
            y, kc, vc = mha_prefill(layer.input_norm(x), layer.qkv.kernel[...], layer.qkv.bias_value(),
                                    layer.o.kernel[...], layer.o.bias_value(), kc, vc, cos, sin,
                                    head_dim=c.head_dim, window=c.layer_window(i), lengths=cache.lengths,
                                    **self._attn_kw())
            x = x + y
            x = ops.swiglu_mlp_xla(layer.post_norm(x), residual=x, **layer.mlp.weights())
            ks.append(kc)
            vs.append(vc)
        return x, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))

    @staticmethod
    def _layer_weights(layer) -> dict:
        """The dict jax_cluster.decoder_layer takes."""
        mlp = layer.mlp.weights()
        return dict(norm=layer.input_norm.weight[...], qkv=layer.qkv.kernel[...], qkv_bias=layer.qkv.bias_value(),
                    o=layer.o.kernel[...], o_bias=layer.o.bias_value(), post_norm=layer.post_norm.weight[...],
                    **{k: mlp[k] for k in ("w_gate", "w_up", "w_down")})

    def _decode_layers(self, x, cache: KVCache, impl):
        c = self.config
        inv_freq = self.inv_freq()
        a_impl, m_impl = ops.component_impl(impl, "attention"), ops.component_impl(impl, "mlp")
        whole = ops.whole_layer_impl(impl, mlp_has_fused_op=True)
        ks, vs = [], []
        for i, (layer, kc, vc) in enumerate(zip(self.layers, cache.k, cache.v)):
            window = c.layer_window(i)
            rolling = cache.rolling(i)  # the window's rolling buffer: slot = position % window
            why = ops.sliding_window_unsupported(window, kc.shape[2]) or ("MLP biases" if c.mlp_bias else "")
            out = None if whole is None else ops.decoder_layer(
                x, self._layer_weights(layer), kc, vc, cache.lengths, inv_freq, impl=whole, family="llama",
                eps=c.rms_norm_eps, rotary_dim=c.head_dim, rope_layout="half", rolling=rolling, unsupported=why,
                **self._attn_kw())
            if out is not None:
                x, kc, vc = out
            else:
                block = ops.rolling_window_attention_block if rolling else functools.partial(
                    ops.attention_block, window=window)
                x, kc, vc = block(
                    x, layer.qkv.kernel[...], layer.o.kernel[...], kc, vc, cache.lengths, inv_freq,
                    norm_weight=layer.input_norm.weight[...], norm="rms", eps=c.rms_norm_eps,
                    qkv_bias=layer.qkv.bias_value(), o_bias=layer.o.bias_value(), residual=True,
                    rotary_dim=c.head_dim, rope_layout="half", impl=a_impl, **self._attn_kw(),
                )
                h = rms_norm(x, layer.post_norm.weight[...], c.rms_norm_eps)
                x = ops.swiglu_mlp(h, residual=x, impl=m_impl, **layer.mlp.weights())
            ks.append(kc)
            vs.append(vc)
        return x, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))
