"""Decode-time blocks, each in plain jnp ("xla") or on a jax_cluster op ("fused").

Every block the models run at decode time goes through one function here, so a fused op replaces a
whole block at once:

=====================  ==========================================================================
:func:`attention_block`  norm -> QKV -> RoPE -> cache write -> attention -> out-proj (+ residual):
                         ``jax_cluster.attention_block``; over a sliding window's rolling cache
                         (:func:`rolling_window_attention_block`), ``jax_cluster.decode_attention``
:func:`swiglu_mlp`       ``(silu(x Wg) * (x Wu)) Wd`` (+ residual): ``jax_cluster.swiglu``
:func:`gelu_mlp`         GPT-NeoX's MLP: no fused op of its own (XLA)
:func:`decoder_layer`    a whole decode layer: ``jax_cluster.decoder_layer`` (component "layer",
                         :func:`whole_layer_impl` says when a model runs it)
:func:`mla_decode`       DeepSeek's MLA decode step: ``jax_cluster.mla_decode``
:func:`moe`              DeepSeek-V2's MoE layer: router -> routed SwiGLU experts (+ residual) ->
                         shared experts: ``jax_cluster.moe_decode`` (its shared experts in the
                         same kernels); prefill-sized calls under "auto" stay on XLA
=====================  ==========================================================================

Model-level ``impl`` (a string, or a dict per component ``{"attention": ..., "mlp": ...}``):

* ``"xla"``: the plain jnp formulation below.
* ``"fused"``: the jax_cluster op with ``impl="cuda"``: its CUDA kernel on a GPU, its C++ CPU
  handler on CPU. A block the op cannot run (no such op, a dtype or shape it does not cover) is
  an error at trace time, naming the block and the reason.
* ``"auto"``: on a GPU, for float16 / bfloat16, the jax_cluster op with ``impl="auto"`` (its tuner
  picks a CUDA configuration or XLA's own ops per shape; a shape without a kernel runs XLA with
  a one-time warning); everywhere else the plain jnp formulation. On CPU "auto" therefore runs no
  jax_cluster op: the C++ CPU handlers exist to test the FFI path, not to be fast.

Components: "attention", "mlp" and "layer" (a whole decode layer as one op). Plain "fused"
therefore runs whole layers on the one-launch kernel; "attention=fused,mlp=fused" runs the
per-op kernels (faster on the shapes measured so far: docs/decoder_layer.md).

:func:`record_routes` collects, while a decode step is traced, which path each block took and
why (the command line prints it). jax_cluster is imported lazily, on first use, never when
flax_models is imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from . import attention as attn
from .layers import dense, gelu, layer_norm, rms_norm, silu
from .moe import experts_xla, route
from .rope import apply_rope, cos_sin

IMPLS = ("auto", "xla", "fused")
COMPONENTS = ("attention", "mlp", "layer")
# The dtypes of the CUDA kernels (every jax_cluster kernel is 16-bit in, fp32 accumulation).
KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


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


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


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


# ----------------------------------------------------------------------------- routes
@dataclasses.dataclass(frozen=True)
class Route:
    """How one block ran: ``runs`` is "xla" or "jax_cluster"; ``why`` says how or why not."""

    block: str
    runs: str
    why: str

    def __str__(self) -> str:
        return f"{self.block}: {self.runs} ({self.why})"


_routes: contextvars.ContextVar[list | None] = contextvars.ContextVar("flax_models_routes", default=None)


@contextlib.contextmanager
def record_routes():
    """Collects a :class:`Route` per distinct (block, path, reason) traced inside the block."""
    routes: list[Route] = []
    token = _routes.set(routes)
    try:
        yield routes
    finally:
        _routes.reset(token)


def _note(block: str, runs: str, why: str) -> None:
    routes = _routes.get()
    if routes is not None and Route(block, runs, why) not in routes:
        routes.append(Route(block, runs, why))


def _choose(impl: str, block: str, op_name: str | None, dtype, unsupported: str = ""):
    """(op, op_impl) to run ``block`` on a jax_cluster op, or None for the jnp formulation.

    unsupported: why this model's call cannot use the op at all (e.g. "MLP biases")."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        _note(block, "xla", "impl=xla")
        return None
    mod, err = _load_jax_cluster()
    op = getattr(mod, op_name, None) if (mod is not None and op_name) else None

    def missing() -> str:
        if op_name is None:
            return "no fused op for this block"
        if mod is None:
            return f"jax_cluster is not available ({err})"
        return "" if op is not None else f"jax_cluster has no op {op_name!r}"

    if impl == "fused":
        why_not = unsupported or missing()
        if why_not:
            raise RuntimeError(f"impl='fused' for {block}: {why_not} (a per-component impl such as "
                               "attention=fused,mlp=xla fuses the other blocks)")
        if on_gpu() and not mod.cuda_module_built():
            raise RuntimeError(f"impl='fused' for {block}: jax_cluster was built without its CUDA kernels "
                               "(reinstall with nvcc on PATH, JAX_CLUSTER_CUDA=ON)")
        return op, "cuda"
    why_not = unsupported or ("" if on_gpu() else "no GPU: impl=auto runs XLA on CPU")
    if not why_not and jnp.dtype(dtype) not in KERNEL_DTYPES:
        why_not = f"{jnp.dtype(dtype).name} has no CUDA kernel"
    why_not = why_not or missing()
    if not why_not and not mod.cuda_module_built():
        why_not = "jax_cluster was built without its CUDA kernels"
    if why_not:
        _note(block, "xla", why_not)
        return None
    return op, "auto"


def _run(block: str, op_name: str, op, op_impl: str, *args, _inner: dict | None = None,
         _auto_why: str = "impl=auto: the tuner's pick per shape, a CUDA kernel configuration or XLA", **kw):
    """Calls the jax_cluster op; notes the route (an op's own fallback warning included).

    _inner: {op name: block} for ops the op calls itself (e.g. moe_decode's swiglu for the shared
    experts): their fallback warnings are noted as that block's route."""
    if op_impl == "cuda":
        try:
            out = op(*args, impl="cuda", **kw)
        except ValueError as e:
            raise ValueError(f"impl='fused' for {block}: jax_cluster.{op_name} does not cover this call: {e}") from e
        _note(block, "jax_cluster", "CUDA kernel" if on_gpu() else "C++ CPU handler, no GPU")
        return out
    if _routes.get() is None:
        return op(*args, impl=op_impl, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = op(*args, impl=op_impl, **kw)
    fell_back = [w for w in caught if str(w.message).startswith(op_name)]
    inner = {name: [w for w in caught if str(w.message).startswith(name)] for name in (_inner or {})}
    noted = fell_back + [w for ws in inner.values() for w in ws]
    for w in caught:
        if w not in noted:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if fell_back:
        _note(block, "xla", f"jax_cluster fell back: {fell_back[0].message}")
    else:
        _note(block, "jax_cluster", _auto_why)
    for name, ws in inner.items():
        if ws:
            _note(_inner[name], "xla", f"jax_cluster fell back: {ws[0].message}")
    return out


def _norm(x, norm, weight, bias, eps):
    if norm is None:
        return x
    if norm == "rms":
        return rms_norm(x, weight, eps)
    if norm == "layer":
        return layer_norm(x, weight, bias, eps)
    raise ValueError(f"norm must be 'rms', 'layer' or None, got {norm!r}")


def _add_residual(y, residual):
    if residual is None:
        return y
    return (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(residual.dtype)


# ----------------------------------------------------------------------------- attention block
def sliding_window_unsupported(window: int | None, capacity: int) -> str:
    """Why no fused op runs a sliding window over a cache of `capacity` slots ("" where none
    applies): the kernels attend to every cached token, which is the window's result only
    while the cache holds no more tokens than the window."""
    if window is None or capacity <= window:
        return ""
    return f"a sliding window of {window} tokens over a cache of {capacity} slots"


def _qkv_rotated(x, w_qkv, lengths, inv_freq, *, norm_weight, norm_bias, norm, eps, qkv_bias, head_dim,
                 rotary_dim, rope_layout, num_q_heads, num_kv_heads, rope_factor):
    """norm -> QKV -> RoPE at positions lengths[b]: q [B, Hq, D], k and v [B, Hkv, D]."""
    b, d = x.shape[0], head_dim
    h = _norm(x, norm, norm_weight, norm_bias, eps)
    qkv = dense(h, w_qkv, qkv_bias)
    q = qkv[:, : num_q_heads * d].reshape(b, num_q_heads, d)
    k = qkv[:, num_q_heads * d : (num_q_heads + num_kv_heads) * d].reshape(b, num_kv_heads, d)
    v = qkv[:, (num_q_heads + num_kv_heads) * d :].reshape(b, num_kv_heads, d)
    cos, sin = cos_sin(lengths, jnp.asarray(inv_freq)[: rotary_dim // 2], rope_factor)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return apply_rope(q, cos, sin, rope_layout), apply_rope(k, cos, sin, rope_layout), v


def _out_projection(x, o, w_o, o_bias, residual):
    y = dense(o.reshape(x.shape[0], -1), w_o, o_bias)
    return _add_residual(y, x) if residual else y


def attention_block_xla(
    x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, norm_weight=None, norm_bias=None,
    norm="rms", eps=1e-6, qkv_bias=None, o_bias=None, residual=False, rotary_dim, rope_layout="half",
    num_q_heads, num_kv_heads, scale, rope_factor=1.0, window=None,
):
    """Plain-jnp decode attention block; the semantics the fused op must reproduce.

    x [B, hidden] (the residual stream), w_qkv [hidden, (Hq + 2 Hkv) D] with columns
    [Q heads | K heads | V heads], w_o [Hq D, hidden], caches [B, Hkv, S_max, D], lengths [B].
    The new token is written at slot lengths[b], rotated to position lengths[b], and attends to slots
    0..lengths[b] (with a sliding window, the last `window` of them). Returns (y [B, hidden],
    k_cache, v_cache); y includes x when residual=True.
    """
    q, k, v = _qkv_rotated(x, w_qkv, lengths, inv_freq, norm_weight=norm_weight, norm_bias=norm_bias, norm=norm,
                           eps=eps, qkv_bias=qkv_bias, head_dim=k_cache.shape[-1], rotary_dim=rotary_dim,
                           rope_layout=rope_layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           rope_factor=rope_factor)
    k_cache = attn.write_at(k_cache, k, lengths)
    v_cache = attn.write_at(v_cache, v, lengths)
    o = attn.decode_attention_core(q, k_cache, v_cache, lengths, scale, window)
    return _out_projection(x, o, w_o, o_bias, residual), k_cache, v_cache


def rolling_window_attention_block(
    x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, impl="auto", norm_weight=None, norm_bias=None,
    norm="rms", eps=1e-6, qkv_bias=None, o_bias=None, residual=False, rotary_dim, rope_layout="half",
    num_q_heads, num_kv_heads, scale, rope_factor=1.0,
):
    """The decode attention block of a sliding-window layer whose caches are the window's
    rolling buffer of W slots (KVCache.rolling): the new token, rotated to position
    lengths[b], goes to slot lengths[b] % W and attends to slots 0..min(lengths[b], W - 1),
    which hold exactly the window's tokens. Arguments as :func:`attention_block_xla`.

    The fused ops write slot lengths[b] at RoPE position lengths[b], so here XLA projects,
    rotates and writes, and the attention over the buffer is ``jax_cluster.decode_attention``
    (q rounded to the cache dtype after scaling, as its split-K form takes it) or jnp."""
    b, slots, d = x.shape[0], k_cache.shape[2], k_cache.shape[-1]
    q, k, v = _qkv_rotated(x, w_qkv, lengths, inv_freq, norm_weight=norm_weight, norm_bias=norm_bias, norm=norm,
                           eps=eps, qkv_bias=qkv_bias, head_dim=d, rotary_dim=rotary_dim, rope_layout=rope_layout,
                           num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, rope_factor=rope_factor)
    k_cache = attn.write_at(k_cache, k, lengths % slots)
    v_cache = attn.write_at(v_cache, v, lengths % slots)
    last = jnp.minimum(lengths, slots - 1).astype(jnp.int32)  # the buffer's last filled slot
    chosen = _choose(impl, "attention_block", "decode_attention", x.dtype)
    if chosen is None:
        o = attn.decode_attention_core(q, k_cache, v_cache, last, scale)
    else:
        op, op_impl = chosen
        qg = (q.astype(jnp.float32) * scale).astype(k_cache.dtype).reshape(b, num_kv_heads, -1, d)
        o = _run("attention_block", "decode_attention", op, op_impl, qg, k_cache, v_cache, last,
                 _auto_why="a sliding window's rolling cache: XLA's projections around "
                           "jax_cluster.decode_attention").reshape(b, num_q_heads, d).astype(x.dtype)
    return _out_projection(x, o, w_o, o_bias, residual), k_cache, v_cache


def attention_block(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, impl="auto", rope_factor=1.0,
                    window=None, **kw):
    """The whole decode attention block; see :func:`attention_block_xla` for the arguments. A
    sliding window shorter than the cache has no fused op (sliding_window_unsupported)."""
    op_name = "attention_block"
    why = sliding_window_unsupported(window, k_cache.shape[2])
    if not why and rope_factor != 1.0:
        why = "RoPE attention factor != 1 (YaRN)"
    chosen = _choose(impl, op_name, op_name, x.dtype, unsupported=why)
    if chosen is None:
        return attention_block_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, rope_factor=rope_factor,
                                   window=window, **kw)
    op, op_impl = chosen
    return _run(op_name, op_name, op, op_impl, x, w_qkv, w_o, k_cache, v_cache, lengths,
                jnp.asarray(inv_freq, jnp.float32), **kw)


# ----------------------------------------------------------------------------- MLPs
def swiglu_mlp_xla(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None):
    """down(silu(x @ w_gate) * (x @ w_up)) (+ residual); intermediates rounded to x.dtype."""
    g = silu(dense(x, w_gate, b_gate))
    u = dense(x, w_up, b_up)
    return _add_residual(dense(g * u, w_down, b_down), residual)


def swiglu_mlp(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None, impl="auto"):
    has_bias = any(t is not None for t in (b_gate, b_up, b_down))
    chosen = _choose(impl, "swiglu", "swiglu", x.dtype, unsupported="MLP biases" if has_bias else "")
    if chosen is None:
        return swiglu_mlp_xla(x, w_gate, w_up, w_down, residual, b_gate=b_gate, b_up=b_up, b_down=b_down)
    op, op_impl = chosen
    return _run("swiglu", "swiglu", op, op_impl, x, w_gate, w_up, w_down, residual=residual)


def gelu_mlp(x, w_in, b_in, w_out, b_out, residual=None, *, approximate=False, impl="auto"):
    """fc_out(gelu(fc_in(x))) (+ residual). No fused op exists for it: impl="fused" is an error."""
    _choose(impl, "gelu_mlp", None, x.dtype,
            unsupported="no fused GELU MLP op")
    return _add_residual(dense(gelu(dense(x, w_in, b_in), approximate), w_out, b_out), residual)


def whole_layer_impl(impl, *, mlp_has_fused_op: bool) -> str | None:
    """How a decode layer runs as one :func:`decoder_layer` call: "fused", "auto", or None (the
    model's per-component blocks).

    * component "layer" = "fused" (so plain impl="fused"): ``jax_cluster.decoder_layer`` with
      impl="cuda", the one-launch layer kernel on a GPU, its C++ handler on CPU;
    * every component "auto" (plain impl="auto"): ``jax_cluster.decoder_layer`` with impl="auto"
      where it can run (a GPU, 16-bit): the one-launch kernel or the per-op kernels, as its tuner
      measured faster for the shape;
    * attention and MLP "fused" where the MLP has no fused op of its own (GPT-NeoX's GELU): the
      whole-layer op is the only fused form, so "fused";
    * anything else (a component "xla", "layer=xla"): per-component blocks."""
    layer, a, m = (component_impl(impl, c) for c in ("layer", "attention", "mlp"))
    if layer == "fused":
        if "xla" in (a, m):
            raise ValueError(f"impl: layer=fused runs the whole layer on jax_cluster.decoder_layer, which "
                             f"contradicts attention={a}, mlp={m}")
        return "fused"
    if layer == "xla":
        return None
    if a == m == "fused" and not mlp_has_fused_op:
        return "fused"
    return "auto" if a == m == "auto" else None


def decoder_layer(x, w, k_cache, v_cache, lengths, inv_freq, *, impl="fused", rope_factor=1.0, unsupported="",
                  **kw):
    """A whole decode layer on ``jax_cluster.decoder_layer`` (see :func:`whole_layer_impl`).

    impl "fused": its one-launch kernel on a GPU (its C++ handler on CPU), an error naming the
    reason where that kernel does not cover the call (e.g. more than 8 rows). impl "auto": the
    op's own choice on a GPU for 16-bit models; returns None where the op cannot run at all (CPU,
    other dtypes, ``unsupported``), and the model runs its per-component blocks instead."""
    why = unsupported or ("" if rope_factor == 1.0 else "RoPE attention factor != 1 (YaRN)")
    args = (x, w, k_cache, v_cache, lengths, jnp.asarray(inv_freq, jnp.float32))
    if impl == "auto":
        op = fused_op("decoder_layer")
        if (why or not on_gpu() or jnp.dtype(x.dtype) not in KERNEL_DTYPES or op is None
                or not _load_jax_cluster()[0].cuda_module_built()):
            return None
        return _run("decoder_layer", "decoder_layer", op, "auto", *args, **kw,
                    _inner={"attention_block": "attention_block", "swiglu": "swiglu"},
                    _auto_why="impl=auto: jax_cluster.decoder_layer, the one-launch kernel or the per-op kernels "
                             "as its tuner measured faster per shape")
    op, op_impl = _choose(impl, "decoder_layer", "decoder_layer", x.dtype, unsupported=why)
    try:
        return _run("decoder_layer", "decoder_layer", op, op_impl, *args, **kw)
    except ValueError as e:
        raise ValueError(f"{e} (impl='attention=fused,mlp=fused' runs the per-op kernels instead)") from e


def note_unfused(block: str, why: str) -> None:
    """Records a block that has no fused form at all (e.g. the MoE's routed experts)."""
    _note(block, "xla", why)


# ----------------------------------------------------------------------------- MLA (DeepSeek-V2)
def _write_latent(latent_cache, new, lengths, block_table):
    """(the cache with new [B, E] at slot lengths[b] of each row, the rows [B, S, E] it holds)."""
    if block_table is None:
        latent_cache = attn.write_at(latent_cache, new[:, None, :], lengths)
        return latent_cache, latent_cache[:, 0]
    page = latent_cache.shape[1]
    rows = jnp.arange(new.shape[0])
    latent_cache = latent_cache.at[block_table[rows, lengths // page], lengths % page].set(
        new.astype(latent_cache.dtype), mode="drop")
    return latent_cache, latent_cache[block_table].reshape(new.shape[0], -1, latent_cache.shape[-1])


def mla_decode_xla(x, w, latent_cache, lengths, inv_freq, *, num_heads, kv_lora_rank, qk_nope_head_dim,
                   qk_rope_head_dim, v_head_dim, scale, eps, latent_eps=1e-6, rope_factor=1.0, residual=False,
                   block_table=None):
    """DeepSeek MLA decode step with weight absorption over a latent cache.

    x [B, hidden]; latent_cache [B, 1, S_max, kv_lora_rank + qk_rope_head_dim] holds, per token, the
    normalised compressed KV c (kv_lora_rank) followed by the rotated shared rope key; with
    block_table [B, max_blocks] it is a page pool [num_pages, page_size, E] instead (slot t of row
    b: page block_table[b, t // page_size], offset t % page_size). ``w`` holds
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
    latent_cache, lat = _write_latent(latent_cache, jnp.concatenate([c, k_rope], -1), lengths, block_table)

    w_kvb = w["kv_b"].reshape(r, hq, dn + dv)
    w_uk, w_uv = w_kvb[..., :dn], w_kvb[..., dn:]
    q_lat = jnp.einsum("bhd,rhd->bhr", q_nope, w_uk.astype(q.dtype), preferred_element_type=jnp.float32)
    q_full = jnp.concatenate([q_lat.astype(q.dtype), q_rope], -1)  # [B, H, r + dr]
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


def mla_decode(x, w, latent_cache, lengths, inv_freq, *, impl="auto", rope_factor=1.0, block_table=None, **kw):
    """MLA decode block on ``jax_cluster.mla_decode`` (same arguments; its contract is
    :func:`mla_decode_xla`). The model's latent cache [B, 1, S, E] is the op's [B, S, E]; a page
    pool is the op's as it is."""
    chosen = _choose(impl, "mla_decode", "mla_decode", x.dtype)
    if chosen is None:
        return mla_decode_xla(x, w, latent_cache, lengths, inv_freq, rope_factor=rope_factor,
                              block_table=block_table, **kw)
    op, op_impl = chosen
    paged = block_table is not None
    y, latent = _run("mla_decode", "mla_decode", op, op_impl, x, w, latent_cache if paged else latent_cache[:, 0],
                     lengths, jnp.asarray(inv_freq, jnp.float32), rope_factor=rope_factor, block_table=block_table,
                     **kw)
    return y, latent if paged else latent[:, None]


# ----------------------------------------------------------------------------- MoE (DeepSeek-V2)
# The most rows "auto" sends to jax_cluster.moe_decode (the decode batches it was measured ahead
# of ragged_dot and the gather at, docs/moe_decode.md); more rows (prefill) run the jnp
# formulation: grouped ragged_dot.
MOE_DECODE_MAX_ROWS = 64
_SHARED_KEYS = ("w_gate", "w_up", "w_down")


def moe_xla(x, router, w_gate, w_up, w_down, *, shared=None, residual=None, shared_impl="xla", norm=None,
            norm_eps=1e-6, top_k, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
            routed_scaling_factor=1.0, score_bias=None):
    """DeepSeek-V2's MoE layer in jnp: route (:func:`flax_models.moe.route`), the routed experts
    (gathered for decode, grouped ragged_dot for prefill: :func:`flax_models.moe.experts_xla`)
    rounded to x.dtype, + residual, then the shared experts (one SwiGLU, the dict of
    :meth:`SwiGLU.weights`) through :func:`swiglu_mlp` with ``shared_impl`` and the sum so far as
    its residual. x [N, H] (with ``norm``, the RMSNorm weight [H], x is the pre-norm hidden
    state and the layer sees :func:`rms_norm` of it); router [H, E]; w_gate / w_up [E, H, I];
    w_down [E, I, H]."""
    if norm is not None:
        x = rms_norm(x, norm, norm_eps)

    weights, ids = route(x, router, top_k=top_k, method=topk_method, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                         score_bias=score_bias)
    y = _add_residual(experts_xla(x, weights, ids, w_gate, w_up, w_down), residual)
    if shared is not None:
        y = swiglu_mlp(x, residual=y, impl=shared_impl, **shared)
    return y


def moe(x, router, w_gate, w_up, w_down, *, shared=None, residual=None, impl="auto", shared_impl=None, norm=None,
        norm_eps=1e-6, **routing):
    """DeepSeek-V2's MoE layer (the block "moe"); arguments and contract as :func:`moe_xla`.

    On ``jax_cluster.moe_decode`` (impl "fused" for any N; "auto" on a GPU for 16-bit x and at
    most :data:`MOE_DECODE_MAX_ROWS` rows): the op routes (the same router), runs the routed
    and the shared experts in its custom call and adds the residual. Rounding differs from
    :func:`moe_xla` only in that the op keeps the routed sum in fp32 until the residual is added
    (one rounding, not two). A shared width that is not a multiple of 8 runs through
    ``jax_cluster.swiglu`` after the call; under "fused" a call the op or that swiglu cannot take
    is an error naming why (swiglu's kernels need multiples of 64 and 16-bit dtypes).

    shared_impl: None runs the shared experts with the routed ones (inside the op when it runs);
    an impl runs them afterwards as their own swiglu block (:func:`swiglu_mlp`) with that impl.

    DeepSeek-V3's router (topk_method noaux_tc, with ``score_bias``) runs in the op's router
    kernel as V2's do.
    """
    n = x.shape[0]
    too_many = impl == "auto" and n > MOE_DECODE_MAX_ROWS
    has_bias = shared is not None and any(shared.get(k) is not None for k in ("b_gate", "b_up", "b_down"))
    unsupported = "shared-expert biases" if has_bias and shared_impl is None else ""
    if not unsupported and too_many:
        unsupported = f"{n} rows > {MOE_DECODE_MAX_ROWS}: the jnp formulation (gather or grouped ragged_dot)"
    chosen = _choose(impl, "moe", "moe_decode", x.dtype, unsupported=unsupported)
    if chosen is None:
        return moe_xla(x, router, w_gate, w_up, w_down, shared=shared, residual=residual,
                       shared_impl=impl if shared_impl is None else shared_impl, norm=norm, norm_eps=norm_eps,
                       **routing)
    op, op_impl = chosen
    if norm is not None and shared is not None and shared_impl is not None:
        x, norm = rms_norm(x, norm, norm_eps), None  # the shared experts after the op need the normed x
    inside = None if (shared is None or shared_impl is not None) else {k: shared[k] for k in _SHARED_KEYS}
    try:
        y = _run("moe", "moe_decode", op, op_impl, x, router, w_gate, w_up, w_down, shared=inside, residual=residual,
                 norm=norm, norm_eps=norm_eps, _inner={"swiglu": "moe shared experts"},
                 _auto_why="impl=auto: the routed-experts kernel where its checks pass, else XLA", **routing)
    except ValueError as e:
        if "jax_cluster.swiglu" not in str(e.__cause__ or ""):
            raise
        raise ValueError(f"impl='fused' for moe: {e.__cause__}") from e  # names the op, swiglu and why
    if shared is not None and shared_impl is not None:
        y = swiglu_mlp(x, residual=y, impl=shared_impl, **shared)
    return y
