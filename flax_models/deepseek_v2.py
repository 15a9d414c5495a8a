"""DeepSeek-V2 / V2-Lite decoder: MLA attention (mla.py) and MoE feed-forward (moe.py) after
first_k_dense_replace dense SwiGLU layers, RMSNorm, YaRN RoPE (interleaved)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from . import ops
from .base import CausalLM
from .cache import LatentCache, PagedLatentCache
from .config import DeepseekV2Config
from .layers import RMSNorm, SwiGLU, rms_norm
from .mla import LATENT_NORM_EPS, MLA, softmax_scale
from .moe import MoE


class DeepseekV2Layer(nnx.Module):
    def __init__(self, cfg: DeepseekV2Config, index: int, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = MLA(cfg, dtype=dtype, rngs=rngs)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(index):
            self.moe, self.mlp = MoE(cfg, dtype=dtype, rngs=rngs), None
        else:
            self.moe, self.mlp = None, SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def feed_forward(self, x, eps, impl):
        if self.moe is not None:  # the MoE op normalises x itself (in its router's kernels when fused)
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            y = ops.moe(x2, residual=x2, norm=self.post_norm.weight[...], norm_eps=eps, impl=impl, **self.moe.weights())
            return y.reshape(shape)
        h = rms_norm(x, self.post_norm.weight[...], eps)
        return ops.swiglu_mlp(h, residual=x, impl=impl, **self.mlp.weights())


class DeepseekV2(CausalLM):
    def __init__(self, cfg: DeepseekV2Config, *, dtype=jnp.float32, impl="auto", rngs: nnx.Rngs):
        self.config = cfg
        self.impl = ops.normalize_impl(impl)
        self._init_head(cfg, dtype, rngs)
        self.layers = nnx.List([DeepseekV2Layer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def _rope_dim(self):
        return self.config.qk_rope_head_dim

    def _final_norm(self, x):
        return self.norm(x)

    def init_cache(self, batch: int, max_len: int, dtype=None, *, page_size: int | None = None,
                   block_table=None, num_pages: int | None = None) -> LatentCache | PagedLatentCache:
        """Contiguous rows of max_len slots, or with page_size a PagedLatentCache (block_table
        and num_pages as PagedLatentCache.create takes them)."""
        c = self.config
        kw = dict(num_layers=c.num_layers, batch=batch, max_len=max_len,
                  latent_dim=c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype or self.dtype)
        if page_size is None:
            if block_table is not None or num_pages is not None:
                raise ValueError("block_table and num_pages describe a paged cache: give page_size too")
            return LatentCache.create(**kw)
        return PagedLatentCache.create(**kw, page_size=page_size, block_table=block_table, num_pages=num_pages)

    def _prefill_layers(self, x, cos, sin, cache):
        eps = self.config.rms_norm_eps
        lats = []
        for layer, lat in zip(self.layers, cache.latent):
            a, new = layer.attn.prefill(layer.input_norm(x), cos, sin)
            x = layer.feed_forward(x + a, eps, "xla")
            lats.append(cache.write_prompt(lat, new))
        return x, dataclasses.replace(cache, latent=tuple(lats))

    def _decode_layers(self, x, cache, impl):
        c = self.config
        inv_freq = self.inv_freq()
        a_impl, m_impl = ops.component_impl(impl, "attention"), ops.component_impl(impl, "mlp")
        kw = dict(num_heads=c.num_heads, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                  qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, scale=softmax_scale(c),
                  eps=c.rms_norm_eps, latent_eps=LATENT_NORM_EPS, residual=True)
        lats = []
        for layer, lat in zip(self.layers, cache.latent):
            x, lat = ops.mla_decode(x, layer.attn.weights(layer.input_norm.weight[...]), lat, cache.lengths,
                                    inv_freq, rope_factor=self.rope_factor(), block_table=cache.block_table,
                                    impl=a_impl, **kw)
            x = layer.feed_forward(x, c.rms_norm_eps, m_impl)
            lats.append(lat)
        return x, dataclasses.replace(cache, latent=tuple(lats))
