"""Dispatch between plain-jnp ("xla") and jax_cluster fused ("fused") implementations.

Every decode-time block the models run goes through one function here, so a fused kernel replaces a
whole block (norm -> QKV -> RoPE -> cache write -> attention -> output projection (+ residual)) at once:

* :func:`decode_attention`  -> ``jax_cluster.attention_decode``
* :func:`swiglu_mlp`        -> ``jax_cluster.swiglu``
* :func:`gelu_mlp`          -> no fused op yet (GPT-NeoX's MLP will come with ``decoder_layer``)
* :func:`mla_decode`        -> ``jax_cluster.mla_decode`` (when it exists)

``impl``: "xla" = plain jnp; "fused" = the jax_cluster op, a RuntimeError naming the op when it is
missing; "auto" = fused on a GPU backend for fp16/bf16 when the op exists (unsupported shapes are
the op's business: it falls back to its reference with a warning), else xla. jax_cluster is imported
lazily, on first use, never at import time of flax_models.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import attention as attn
from .layers import dense, gelu, layer_norm, rms_norm, silu
from .rope import apply_rope, cos_sin

IMPLS = ("auto", "xla", "fused")
COMPONENTS = ("attention", "mlp")


@functools.lru_cache(maxsize=1)
def _load_jax_cluster():
    try:
        import jax_cluster  # noqa: PLC0415  (lazy on purpose)
    except Exception as e:  # ImportError, or the C++ extension failing to load
        return None, f"{type(e).__name__}: {e}"
    return jax_cluster, None


def fused_op(name: str):
    """The jax_cluster op ``name`` or None."""
    mod, _ = _load_jax_cluster()
    return None if mod is None else getattr(mod, name, None)


def fused_available(name: str) -> bool:
    return fused_op(name) is not None


def normalize_impl(impl):
    """A hashable impl: a string, or a sorted tuple of (component, impl) pairs (from a dict or from
    "attention=fused,mlp=xla"). None stays None (= the model's own)."""
    if impl is None:
        return None
    if isinstance(impl, str) and "=" in impl:
        impl = dict(part.split("=", 1) for part in impl.split(",") if part)
    if isinstance(impl, str):
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        return impl
    pairs = tuple(sorted(dict(impl).items()))
    for comp, value in pairs:
        if comp not in COMPONENTS or value not in IMPLS:
            raise ValueError(f"impl entries are component=impl with component in {COMPONENTS} and impl in {IMPLS}, "
                             f"got {comp}={value}")
    return pairs


def component_impl(impl, component: str) -> str:
    """impl may be one string for every component or a dict {component: impl} (missing -> "auto")."""
    if isinstance(impl, str):
        value = impl
    else:
        value = dict(impl).get(component, "auto")
    if value not in IMPLS:
        raise ValueError(f"impl for {component!r} must be one of {IMPLS}, got {value!r}")
    return value


def resolve(impl: str, op_name: str | None, dtype, *, fused_ok: bool = True, why_not: str = "") -> str:
    """Turns "auto"/"xla"/"fused" into "xla" or "fused" for one call of op ``op_name``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    op = fused_op(op_name) if op_name else None
    if impl == "fused":
        if op_name is None:
            raise RuntimeError(f"impl='fused': {why_not or 'there is no fused op for this block yet'}")
        if op is None:
            _, err = _load_jax_cluster()
            reason = err or f"jax_cluster has no op {op_name!r} yet"
            raise RuntimeError(f"impl='fused' needs jax_cluster.{op_name}, which is not available ({reason})")
        if not fused_ok:
            raise RuntimeError(f"impl='fused': jax_cluster.{op_name} does not support this call ({why_not})")
        return "fused"
    # auto
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    if on_gpu and op is not None and fused_ok and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16):
        return "fused"
    return "xla"


def _norm(x, norm, weight, bias, eps):
    if norm is None:
        return x
    if norm == "rms":
        return rms_norm(x, weight, eps)
    if norm == "layer":
        return layer_norm(x, weight, bias, eps)
    raise ValueError(f"norm must be 'rms', 'layer' or None, got {norm!r}")


# ----------------------------------------------------------------------------- attention block
def decode_attention_xla(
    x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, norm_weight=None, norm_bias=None,
    norm="rms", eps=1e-6, qkv_bias=None, o_bias=None, residual=False, rotary_dim, rope_layout="half",
    num_q_heads, num_kv_heads, scale, rope_factor=1.0,
):
    """Plain-jnp decode attention block; the semantics the fused op must reproduce.

    x [B, hidden] (the residual stream), w_qkv [hidden, (Hq + 2 Hkv) D] with columns
    [Q heads | K heads | V heads], w_o [Hq D, hidden], caches [B, Hkv, S_max, D], lengths [B].
    The new token is written at slot lengths[b], rotated to position lengths[b], and attends to slots
    0..lengths[b]. Returns (y [B, hidden], k_cache, v_cache); y includes x when residual=True.
    """
    b = x.shape[0]
    d = k_cache.shape[-1]
    h = _norm(x, norm, norm_weight, norm_bias, eps)
    qkv = dense(h, w_qkv, qkv_bias)
    q = qkv[:, : num_q_heads * d].reshape(b, num_q_heads, d)
    k = qkv[:, num_q_heads * d : (num_q_heads + num_kv_heads) * d].reshape(b, num_kv_heads, d)
    v = qkv[:, (num_q_heads + num_kv_heads) * d :].reshape(b, num_kv_heads, d)
    cos, sin = cos_sin(lengths, jnp.asarray(inv_freq)[: rotary_dim // 2], rope_factor)
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = apply_rope(q, cos, sin, rope_layout)
    k = apply_rope(k, cos, sin, rope_layout)
    k_cache = attn.write_at(k_cache, k, lengths)
    v_cache = attn.write_at(v_cache, v, lengths)
    o = attn.decode_attention_core(q, k_cache, v_cache, lengths, scale)
    y = dense(o.reshape(b, num_q_heads * d), w_o, o_bias)
    if residual:
        y = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
    return y, k_cache, v_cache


def decode_attention(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, impl="auto", rope_factor=1.0, **kw):
    """Whole decode attention block; see :func:`decode_attention_xla` for the arguments."""
    fused_ok = rope_factor == 1.0
    which = resolve(impl, "attention_decode", x.dtype, fused_ok=fused_ok, why_not="rope attention factor != 1")
    if which == "fused":
        op = fused_op("attention_decode")
        return op(x, w_qkv, w_o, k_cache, v_cache, lengths, jnp.asarray(inv_freq, jnp.float32), **kw)
    return decode_attention_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, rope_factor=rope_factor, **kw)


# ----------------------------------------------------------------------------- MLPs
def _add_residual(y, residual):
    if residual is None:
        return y
    return (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(residual.dtype)


def swiglu_mlp_xla(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None):
    """down(silu(x @ w_gate) * (x @ w_up)) (+ residual); intermediates rounded to x.dtype."""
    g = silu(dense(x, w_gate, b_gate))
    u = dense(x, w_up, b_up)
    return _add_residual(dense(g * u, w_down, b_down), residual)


def swiglu_mlp(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, impl="auto"):
    has_bias = any(t is not None for t in (b_gate, b_up, b_down))
    which = resolve(impl, "swiglu", x.dtype, fused_ok=not has_bias, why_not="MLP biases")
    if which == "fused":
        return fused_op("swiglu")(x, w_gate, w_up, w_down, residual=residual)
    return swiglu_mlp_xla(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down)


def gelu_mlp(x, w_in, b_in, w_out, b_out, residual=None, *, approximate=False, impl="auto"):
    """fc_out(gelu(fc_in(x))) (+ residual). No fused op exists for it yet."""
    resolve(impl, None, x.dtype, why_not="no fused GELU MLP op yet (it will come with decoder_layer); "
            "use impl={'attention': 'fused', 'mlp': 'xla'}")
    return _add_residual(dense(gelu(dense(x, w_in, b_in), approximate), w_out, b_out), residual)


# ----------------------------------------------------------------------------- MLA (DeepSeek-V2)
def mla_decode_xla(x, w, latent_cache, lengths, inv_freq, *, num_heads, kv_lora_rank, qk_nope_head_dim,
                   qk_rope_head_dim, v_head_dim, scale, eps, latent_eps=1e-6, rope_factor=1.0, residual=False):
    """DeepSeek MLA decode step with weight absorption over a latent cache.

    x [B, hidden]; latent_cache [B, 1, S_max, kv_lora_rank + qk_rope_head_dim] holds, per token, the
    normalised compressed KV c (kv_lora_rank) followed by the rotated shared rope key. ``w`` holds
    norm (input RMSNorm weight), q (or q_a, q_a_norm, q_b), kv_a, kv_a_norm, kv_b, o and optional
    q_a_bias / kv_a_bias / o_bias. With W_kv_b = [W_uk | W_uv] per head:
    score_h(s) = (q_nope_h W_uk_h^T) . c_s + q_rope_h . k_rope_s and out_h = (sum_s p_h(s) c_s) W_uv_h,
    so keys and values are never expanded. Returns (y [B, hidden], latent_cache).
    """
    b = x.shape[0]
    hq, r, dn, dr, dv = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    h = rms_norm(x, w["norm"], eps)
    if w.get("q") is not None:
        q = dense(h, w["q"])
    else:
        q = dense(rms_norm(dense(h, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], latent_eps), w["q_b"])
    q = q.reshape(b, hq, dn + dr)
    q_nope, q_rope = q[..., :dn], q[..., dn:]
    kv = dense(h, w["kv_a"], w.get("kv_a_bias"))
    c = rms_norm(kv[:, :r], w["kv_a_norm"], latent_eps)
    k_rope = kv[:, r:]
    cos, sin = cos_sin(lengths, inv_freq, rope_factor)
    q_rope = apply_rope(q_rope, cos[:, None, :], sin[:, None, :], "interleaved")
    k_rope = apply_rope(k_rope, cos, sin, "interleaved")
    latent_cache = attn.write_at(latent_cache, jnp.concatenate([c, k_rope], -1)[:, None, :], lengths)

    w_kvb = w["kv_b"].reshape(r, hq, dn + dv)
    w_uk, w_uv = w_kvb[..., :dn], w_kvb[..., dn:]
    q_lat = jnp.einsum("bhd,rhd->bhr", q_nope, w_uk.astype(q.dtype), preferred_element_type=jnp.float32)
    q_full = jnp.concatenate([q_lat.astype(q.dtype), q_rope], -1)  # [B, H, r + dr]
    lat = latent_cache[:, 0]  # [B, S, r + dr]
    s = jnp.einsum("bhe,bse->bhs", q_full, lat.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(lat.shape[1])[None, :] <= lengths[:, None]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    o_lat = jnp.einsum("bhs,bsr->bhr", p, lat[..., :r].astype(x.dtype), preferred_element_type=jnp.float32)
    o = jnp.einsum("bhr,rhd->bhd", o_lat.astype(x.dtype), w_uv.astype(x.dtype), preferred_element_type=jnp.float32)
    y = dense(o.astype(x.dtype).reshape(b, hq * dv), w["o"], w.get("o_bias"))
    if residual:
        y = _add_residual(y, x)
    return y, latent_cache


def mla_decode(x, w, latent_cache, lengths, inv_freq, *, impl="auto", rope_factor=1.0, **kw):
    """MLA decode block. Fused: ``jax_cluster.mla_decode(x, weights_dict, latent_cache, lengths,
    inv_freq, **same keywords)`` once that op lands; its contract is :func:`mla_decode_xla`."""
    which = resolve(impl, "mla_decode", x.dtype, fused_ok=rope_factor == 1.0, why_not="rope attention factor != 1")
    if which == "fused":
        return fused_op("mla_decode")(x, w, latent_cache, lengths, jnp.asarray(inv_freq, jnp.float32), **kw)
    return mla_decode_xla(x, w, latent_cache, lengths, inv_freq, rope_factor=rope_factor, **kw)
