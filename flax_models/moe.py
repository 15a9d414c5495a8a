"""DeepSeek-V2 mixture of experts: softmax router, top-k (greedy or group-limited greedy), routed
SwiGLU experts and always-on shared experts; DeepSeek-V3's sigmoid router (noaux_tc) too.

Two ways to run the routed experts in jnp, same result (:func:`experts_xla` picks): for few
(token, expert) pairs (decode) gather the chosen experts' weights, reading only those; for many
(prefill) sort the pairs by expert and use ``jax.lax.ragged_dot`` (grouped matmul). The whole
layer is the block :func:`flax_models.ops.moe` (over :meth:`MoE.weights`), which runs it on
``jax_cluster.moe_decode`` under impl "fused" (and "auto" on a GPU at decode sizes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import DeepseekV2Config
from .layers import SwiGLU, _param, silu


def route(x, router, *, top_k, method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
          routed_scaling_factor=1.0, score_bias=None):
    """x [N, H], router [H, E] -> (weights [N, k] float32, expert ids [N, k] int32).

    greedy / group_limited_greedy (DeepSeek-V2): scores = softmax(x @ router) in float32;
    group_limited_greedy first keeps the topk_group groups (of E / n_group experts) with the highest
    best score. Weights are renormalised to sum 1 when norm_topk_prob (and k > 1), otherwise scaled
    by routed_scaling_factor.

    noaux_tc (DeepSeek-V3): scores = sigmoid(x @ router); the experts are chosen by scores +
    score_bias [E] (the load-balancing correction), within the topk_group groups whose two best
    biased scores sum highest; the weights are the chosen experts' unbiased scores, renormalised
    when norm_topk_prob, then scaled by routed_scaling_factor.
    """
    logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if method == "noaux_tc":
        return _route_noaux_tc(logits, score_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    scores = jax.nn.softmax(logits, axis=-1)
    n, e = scores.shape
    if method == "group_limited_greedy":
        group_best = scores.reshape(n, n_group, e // n_group).max(axis=-1)
        _, groups = jax.lax.top_k(group_best, topk_group)
        keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
        scores = jnp.where(jnp.repeat(keep, e // n_group, axis=1), scores, 0.0)
    elif method != "greedy":
        raise ValueError(f"unknown topk_method {method!r}")
    weights, ids = jax.lax.top_k(scores, top_k)
    if top_k > 1 and norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids.astype(jnp.int32)


def _route_noaux_tc(logits, score_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor):
    scores = jax.nn.sigmoid(logits)
    n, e = scores.shape
    choice = scores + (0.0 if score_bias is None else score_bias.astype(jnp.float32))
    group_best2 = jax.lax.top_k(choice.reshape(n, n_group, e // n_group), 2)[0].sum(axis=-1)
    _, groups = jax.lax.top_k(group_best2, topk_group)
    keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)


def experts_gather(x, weights, ids, w_gate, w_up, w_down):
    """Routed experts by gathering the chosen experts' weights: [N, H]."""
    f32 = jnp.float32
    g = jnp.einsum("nh,nkhi->nki", x, w_gate[ids].astype(x.dtype), preferred_element_type=f32).astype(x.dtype)
    u = jnp.einsum("nh,nkhi->nki", x, w_up[ids].astype(x.dtype), preferred_element_type=f32).astype(x.dtype)
    y = jnp.einsum("nki,nkih->nkh", silu(g) * u, w_down[ids].astype(x.dtype), preferred_element_type=f32)
    y = y.astype(x.dtype).astype(f32)
    return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


def experts_grouped(x, weights, ids, w_gate, w_up, w_down):
    """Routed experts as grouped matmuls over (token, expert) pairs sorted by expert: [N, H]."""
    n, k = ids.shape
    e = w_gate.shape[0]
    f32 = jnp.float32
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, w_gate.astype(x.dtype), sizes, preferred_element_type=f32).astype(x.dtype)
    u = jax.lax.ragged_dot(xs, w_up.astype(x.dtype), sizes, preferred_element_type=f32).astype(x.dtype)
    ys = jax.lax.ragged_dot(silu(g) * u, w_down.astype(x.dtype), sizes, preferred_element_type=f32)
    y = jnp.zeros_like(ys).at[order].set(ys.astype(x.dtype).astype(f32)).reshape(n, k, -1)
    return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


def experts_xla(x, weights, ids, w_gate, w_up, w_down):
    """The routed experts in jnp: gathered when there are at most E (token, expert) pairs (decode),
    else grouped (prefill)."""
    run = experts_gather if ids.size <= w_gate.shape[0] else experts_grouped
    return run(x, weights, ids, w_gate, w_up, w_down)


class MoE(nnx.Module):
    def __init__(self, cfg: DeepseekV2Config, *, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        # the router and V3's correction bias stay float32 whatever the model's dtype (as
        # transformers keeps them): near-tied experts are chosen by their last bits
        self.router = _param(rngs, (h, e), jnp.float32)
        self.w_gate = _param(rngs, (e, h, i), dtype)
        self.w_up = _param(rngs, (e, h, i), dtype)
        self.w_down = _param(rngs, (e, i, h), dtype)
        self.shared = SwiGLU(h, i * cfg.n_shared_experts, dtype=dtype, rngs=rngs) if cfg.n_shared_experts else None
        self.score_bias = _param(rngs, (e,), jnp.float32) if cfg.topk_method == "noaux_tc" else None

    def weights(self) -> dict:
        """The arguments of the block :func:`flax_models.ops.moe` this layer holds: router,
        experts, shared experts and its routing configuration."""
        c = self.cfg
        return dict(router=self.router[...], w_gate=self.w_gate[...], w_up=self.w_up[...], w_down=self.w_down[...],
                    shared=None if self.shared is None else self.shared.weights(),
                    top_k=c.num_experts_per_tok, topk_method=c.topk_method, n_group=c.n_group,
                    topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                    routed_scaling_factor=c.routed_scaling_factor,
                    **({} if self.score_bias is None else {"score_bias": self.score_bias[...]}))
