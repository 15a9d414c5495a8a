"""DeepSeek-V2 multi-head latent attention (MLA): parameters, softmax scale and the prefill path.

Per token: c = RMSNorm(x W_kv_a[:, :r]) (r = kv_lora_rank) and a shared rope key
k_rope = RoPE(x W_kv_a[:, r:]) are cached (the latent, [B, 1, S, r + d_rope]). Per head,
k = [c W_uk | k_rope], v = c W_uv with W_kv_b = [W_uk | W_uv]; queries come from x W_q or, with
q LoRA, RMSNorm(x W_q_a) W_q_b, split into nope and rope parts. RoPE is "interleaved" (pairs).
Prefill expands keys and values (plain attention); decode absorbs W_uk into the query and W_uv into
the output (ops.mla_decode) and reads only the latent cache.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from . import attention as attn
from .config import DeepseekV2Config
from .layers import Linear, RMSNorm, dense, rms_norm
from .rope import apply_rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # the q_a / kv_a RMSNorms use the default epsilon, not rms_norm_eps


def softmax_scale(cfg: DeepseekV2Config) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN scaling.

    From YaRN (Peng et al. 2023, sqrt(1/t) = 0.1 ln(s) + 1) as DeepSeek-V2 applies it: the
    attention logits are multiplied by the square of that temperature factor, computed with
    mscale_all_dim, while the cos/sin ratio mscale/mscale_all_dim (rope.attention_factor) is
    separate. With mscale == mscale_all_dim (DeepSeek-V2's config) the whole temperature lives here.
    """
    scale = cfg.qk_head_dim ** -0.5
    r = cfg.rope
    if r.rope_type != "default" and r.mscale_all_dim:
        m = yarn_mscale(r.factor, r.mscale_all_dim)
        scale = scale * m * m
    return scale


class MLA(nnx.Module):
    def __init__(self, cfg: DeepseekV2Config, *, dtype, rngs: nnx.Rngs):
        h, nh = cfg.hidden_size, cfg.num_heads
        bias = cfg.attention_bias
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q = Linear(h, nh * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = Linear(h, cfg.q_lora_rank, bias=bias, dtype=dtype, rngs=rngs)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b = Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias, dtype=dtype, rngs=rngs)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b = Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype, rngs=rngs)
        self.o = Linear(nh * cfg.v_head_dim, h, bias=bias, dtype=dtype, rngs=rngs)

    def weights(self, norm_weight) -> dict:
        """The dict ops.mla_decode takes."""
        w = dict(norm=norm_weight, kv_a=self.kv_a.kernel[...], kv_a_bias=self.kv_a.bias_value(),
                 kv_a_norm=self.kv_a_norm.weight[...], kv_b=self.kv_b.kernel[...], o=self.o.kernel[...],
                 o_bias=self.o.bias_value())
        if self.q is not None:
            w["q"] = self.q.kernel[...]
        else:
            w.update(q_a=self.q_a.kernel[...], q_a_bias=self.q_a.bias_value(), q_a_norm=self.q_a_norm.weight[...],
                     q_b=self.q_b.kernel[...])
        return w

    def prefill(self, h, cos, sin):
        """h [B, T, hidden] normalised input; cos/sin [T, d_rope / 2] (already scaled). Returns
        (attention output [B, T, hidden], the tokens' latents [B, T, r + d_rope] for the cache)."""
        c = self.cfg
        b, t, _ = h.shape
        nh, r, dn, dr, dv = c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        if self.q is not None:
            q = self.q(h)
        else:
            q = self.q_b(rms_norm(self.q_a(h), self.q_a_norm.weight[...], LATENT_NORM_EPS))
        q = q.reshape(b, t, nh, dn + dr)
        kv = self.kv_a(h)
        lat_c = rms_norm(kv[..., :r], self.kv_a_norm.weight[...], LATENT_NORM_EPS)
        k_rope = apply_rope(kv[..., r:], cos, sin, "interleaved")  # [B, T, dr]
        q_rope = apply_rope(q[..., dn:], cos[:, None, :], sin[:, None, :], "interleaved")
        kvb = dense(lat_c, self.kv_b.kernel[...]).reshape(b, t, nh, dn + dv)
        k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope[:, :, None, :], (b, t, nh, dr))], -1)
        q = jnp.concatenate([q[..., :dn], q_rope], -1)
        o = attn.causal_attention(q, k, kvb[..., dn:], softmax_scale(c))
        return self.o(o.reshape(b, t, nh * dv)), jnp.concatenate([lat_c, k_rope], -1)
