"""GPT-NeoX / Pythia decoder: LayerNorm, fused QKV with biases, partial rotary ("half" layout on the
first rotary_dim features of each head), GELU MLP, parallel residual x + attn(ln1(x)) + mlp(ln2(x))
or the sequential form. The checkpoint's per-head interleaved QKV is rearranged at load time into
[Q heads | K heads | V heads] columns (see loading.py).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from . import ops
from .base import CausalLM, mha_prefill
from .cache import KVCache
from .config import GPTNeoXConfig
from .layers import GeluMLP, LayerNorm, Linear, layer_norm


class GPTNeoXLayer(nnx.Module):
    def __init__(self, cfg: GPTNeoXConfig, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_norm = LayerNorm(h, cfg.layer_norm_eps, dtype=dtype)
        self.qkv = Linear(h, 3 * h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.o = Linear(h, h, bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.post_norm = LayerNorm(h, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = GeluMLP(h, cfg.intermediate_size, approximate=cfg.hidden_act != "gelu", dtype=dtype, rngs=rngs)


class GPTNeoX(CausalLM):
    def __init__(self, cfg: GPTNeoXConfig, *, dtype=jnp.float32, impl="auto", rngs: nnx.Rngs):
        self.config = cfg
        self.impl = ops.normalize_impl(impl)
        self._init_head(cfg, dtype, rngs)
        self.layers = nnx.List([GPTNeoXLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)

    def _rope_dim(self):
        return self.config.rotary_dim

    def _final_norm(self, x):
        return self.final_norm(x)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        c = self.config
        return KVCache.create(num_layers=c.num_layers, batch=batch, num_kv_heads=c.num_heads,
                              max_len=max_len, head_dim=c.head_dim, dtype=dtype or self.dtype)

    @staticmethod
    def _layer_weights(layer) -> dict:
        """The dict jax_cluster.decoder_layer takes."""
        return dict(norm=layer.input_norm.weight[...], norm_bias=layer.input_norm.bias[...],
                    qkv=layer.qkv.kernel[...], qkv_bias=layer.qkv.bias_value(), o=layer.o.kernel[...],
                    o_bias=layer.o.bias_value(), post_norm=layer.post_norm.weight[...],
                    post_norm_bias=layer.post_norm.bias[...], **layer.mlp.weights())

    def _mlp(self, layer, x, residual, impl):
        h = layer_norm(x, layer.post_norm.weight[...], layer.post_norm.bias[...], self.config.layer_norm_eps)
        return ops.gelu_mlp(h, residual=residual, approximate=layer.mlp.approximate, impl=impl, **layer.mlp.weights())

    def _prefill_layers(self, x, cos, sin, cache: KVCache):
        c = self.config
        ks, vs = [], []
        for layer, kc, vc in zip(self.layers, cache.k, cache.v):
            a, kc, vc = mha_prefill(layer.input_norm(x), layer.qkv.kernel[...], layer.qkv.bias_value(),
                                    layer.o.kernel[...], layer.o.bias_value(), kc, vc, cos, sin,
                                    num_q_heads=c.num_heads, num_kv_heads=c.num_heads, head_dim=c.head_dim,
                                    scale=c.head_dim ** -0.5)
            h = x + a
            x = self._mlp(layer, x if c.use_parallel_residual else h, h, "xla")
            ks.append(kc)
            vs.append(vc)
        return x, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))

    def _decode_layers(self, x, cache: KVCache, impl):
        c = self.config
        inv_freq = self.inv_freq()
        a_impl, m_impl = ops.component_impl(impl, "attention"), ops.component_impl(impl, "mlp")
        whole = ops.whole_layer_impl(impl, mlp_has_fused_op=False)
        ks, vs = [], []
        for layer, kc, vc in zip(self.layers, cache.k, cache.v):
            out = None if whole is None else ops.decoder_layer(
                x, self._layer_weights(layer), kc, vc, cache.lengths, inv_freq, impl=whole, family="gpt_neox",
                num_q_heads=c.num_heads, num_kv_heads=c.num_heads, eps=c.layer_norm_eps,
                rotary_dim=c.rotary_dim, rope_layout="half", scale=c.head_dim ** -0.5,
                parallel_residual=c.use_parallel_residual, gelu_approximate=layer.mlp.approximate,
                rope_factor=self.rope_factor())
            if out is not None:
                x, kc, vc = out
            else:
                h, kc, vc = ops.attention_block(
                    x, layer.qkv.kernel[...], layer.o.kernel[...], kc, vc, cache.lengths, inv_freq,
                    norm_weight=layer.input_norm.weight[...], norm_bias=layer.input_norm.bias[...], norm="layer",
                    eps=c.layer_norm_eps, qkv_bias=layer.qkv.bias_value(), o_bias=layer.o.bias_value(),
                    residual=True, rotary_dim=c.rotary_dim, rope_layout="half", rope_factor=self.rope_factor(),
                    num_q_heads=c.num_heads, num_kv_heads=c.num_heads, scale=c.head_dim ** -0.5, impl=a_impl,
                )
                x = self._mlp(layer, x if c.use_parallel_residual else h, h, m_impl)
            ks.append(kc)
            vs.append(vc)
        return x, dataclasses.replace(cache, k=tuple(ks), v=tuple(vs))
