"""decoder_layer: one decode step of a whole Llama or GPT-NeoX decoder layer in one call.

    family "llama":    h = x + Attn(RMSNorm(x));  y = h + SwiGLU(RMSNorm(h))
    family "gpt_neox": a = Attn(LayerNorm(x));    y = x + a + MLP(LayerNorm'(x))  (parallel)
                                                  y = h + MLP(LayerNorm'(h)), h = x + a

Attn is attention_block's norm -> QKV (+ bias) -> RoPE (first rotary_dim features, "half" or
"interleaved") -> cache write at lengths[b] -> attention over 0..lengths[b] -> out-proj
(+ bias) (rolling=True: over a sliding window's rolling buffer, the write at lengths[b] % S_max
and the attention over the filled slots); MLP is SwiGLU (llama) or GeLU(h W_in + b_in) W_out + b_out (gpt_neox, exact erf or
tanh). The fp32 contract is jax_cluster.reference.decoder_layer.

`impl` has the meaning of every op (docs/architecture.md): "cuda" is the custom call
jax_cluster_decoder_layer, on a GPU the one-launch layer kernel (cpp/ops/decoder_layer:
ClusterFusion++'s whole-layer dataflow in one persistent grid, docs/decoder_layer.md), on CPU
its C++ handler (the reference's math and rounding points); it covers 16-bit dtypes, at most
8 rows, head_dim 64/80/96/128/256, at most 8 query heads per KV head and widths that are
multiples of 8. "auto" runs whichever of the two GPU paths the tuner measured faster for
the shape and GPU (jax_cluster.tuning: once, cached): the one-launch kernel or the per-op
kernels (attention_block, then swiglu; GeLU MLPs on XLA's dots), the per-op path wherever
the kernel does not cover the shapes. one_launch=True or False fixes that choice (True: a
warning says why where the kernel cannot run the call). "xla" runs the per-op blocks in plain
jnp, "reference" the fp32 reference.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference, tuning
from jax_cluster._ffi import check_array, check_eps, check_impl, ffi_primitive, fold_batch_axis, on_gpu, warn_once
from jax_cluster._sharding import row_partitioned
from jax_cluster.ops.attention_block import ROPE_LAYOUTS, attention_block, timed_context
from jax_cluster.ops.attention_block_unfused import attention_block_split_k
from jax_cluster.ops.decode_attention import check_lengths
from jax_cluster.ops.swiglu import swiglu

__all__ = ["autotune", "decoder_layer"]

# Bump when a kernel change can reverse which path is faster: cached picks of older versions
# are measured again.
KERNEL_VERSION = 1
PATHS = ("per_op", "one_launch")  # what the tuner chooses between under impl="auto"

FAMILIES = ("llama", "gpt_neox")
_MLP_KEYS = {"llama": ("w_gate", "w_up", "w_down"), "gpt_neox": ("w_in", "b_in", "w_out", "b_out")}
_ATTN_KEYS = ("norm", "norm_bias", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "post_norm_bias")


# The custom call's operands after x, in cpp/ops/decoder_layer/ffi.h's order (absent: empty).
_OPERANDS = ("norm", "norm_bias", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "post_norm_bias")
_MLP_OPERANDS = {"llama": ("w_gate", "w_up", "w_down", None, None), "gpt_neox": ("w_in", None, "w_out", "b_in", "b_out")}
_MLP_KIND = {("llama", False): 0, ("gpt_neox", False): 1, ("gpt_neox", True): 2}


def _plan(x, k_cache, w1, *, num_q_heads, num_kv_heads, mlp, parallel_residual) -> dict:
    b, d = x.shape
    return dict(_extension.plans().decoder_layer(b, d, num_q_heads, num_kv_heads, k_cache.shape[3], k_cache.shape[2],
                                                 w1.shape[-1], mlp, parallel_residual, jnp.dtype(x.dtype).name))


def _kernel_error(shape: dict) -> str:
    """Why the one-launch kernel cannot run a layer of `shape` (tuning's shape dict; '' if it can)."""
    mlp = _MLP_KIND[(shape["family"], shape["gelu_approximate"])]
    plan = _extension.plans().decoder_layer(shape["batch"], shape["hidden"], shape["num_q_heads"],
                                            shape["num_kv_heads"], shape["head_dim"], shape["max_seq"],
                                            shape["inter"], mlp, shape["parallel_residual"], shape["dtype"].name)
    return plan["error"] or plan["cuda_error"]


def _abstract(x, *rest, num_q_heads, num_kv_heads, mlp, parallel_residual, **_):
    k_cache, v_cache, w1 = rest[13], rest[14], rest[8]
    ws = _plan(x, k_cache, w1, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, mlp=mlp,
               parallel_residual=parallel_residual)["workspace_floats"]
    return (ShapedArray(x.shape, x.dtype), ShapedArray(k_cache.shape, k_cache.dtype),
            ShapedArray(v_cache.shape, v_cache.dtype), ShapedArray((max(int(ws), 1),), np.float32))


def _batching(args, dims, **params):
    """vmap: the mapped axis folds into the rows (weights and inv_freq are shared)."""
    if any(d is not None for i, d in enumerate(dims) if i not in (0, 14, 15, 16)):
        raise NotImplementedError("decoder_layer: vmap over the weights or inv_freq is not supported")
    size = next(args[i].shape[d] for i, d in enumerate(dims) if d is not None)
    x, kc, vc, lengths = (fold_batch_axis(args[i], dims[i], size) for i in (0, 14, 15, 16))
    n, b = x.shape[:2]
    flat = lambda a: a.reshape((n * b,) + a.shape[2:])  # noqa: E731
    ops = list(args)
    ops[0], ops[14], ops[15], ops[16] = flat(x), flat(kc), flat(vc), flat(lengths)
    y, k2, v2, ws = _PRIM.bind(*ops, **params)
    ws = jnp.broadcast_to(ws, (n,) + ws.shape)  # scratch: one per instance in name only
    return (y.reshape(x.shape), k2.reshape(kc.shape), v2.reshape(vc.shape), ws), (0, 0, 0, 0)


_PRIM = ffi_primitive("decoder_layer", abstract_eval=_abstract, batching_rule=_batching,
                      operand_output_aliases={14: 1, 15: 2})


def _custom_call(x, w, k_cache, v_cache, lengths, inv_freq, *, family, num_q_heads, num_kv_heads, eps,
                 rotary_dim, rope_layout, scale, parallel_residual, gelu_approximate, rolling=False,
                 return_workspace=False):
    empty = jnp.zeros((0,), x.dtype)
    weights = [w.get(k) for k in _OPERANDS] + [None if k is None else w.get(k) for k in _MLP_OPERANDS[family]]
    operands = [empty if a is None else a for a in weights]  # every one of x's dtype (_check)
    dh = k_cache.shape[-1]
    bind = functools.partial(
        _PRIM.bind, num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads),
        rotary_dim=int(dh if rotary_dim is None else rotary_dim), rope_layout={"half": 0, "interleaved": 1}[rope_layout],
        norm=1 if family == "llama" else 2, mlp=_MLP_KIND[(family, bool(gelu_approximate) and family == "gpt_neox")],
        parallel_residual=bool(parallel_residual and family == "gpt_neox"), rolling=bool(rolling), eps=np.float32(eps),
        scale=np.float32(dh ** -0.5 if scale is None else scale))
    args = (x, *operands, k_cache, v_cache, lengths, inv_freq)
    if return_workspace:  # the per-phase timeline (benchmarks): one device
        return bind(*args)
    rows = (True,) + (False,) * len(operands) + (True, True, True, False)
    return row_partitioned(lambda *a: bind(*a)[:3], rows, (True, True, True))(*args)


def _one_launch_error(family, x, w, k_cache, num_q_heads, num_kv_heads, parallel_residual, gelu_approximate):
    """Why the one-launch kernel cannot run this call ('' if it can)."""
    return _kernel_error(_shape(x, w, k_cache, family=family, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                parallel_residual=parallel_residual, gelu_approximate=gelu_approximate))


def _norm(x, kind, weight, bias, eps):
    """RMSNorm / LayerNorm as flax_models computes them: fp32 statistics, result in x.dtype."""
    xf = x.astype(jnp.float32)
    if kind == "rms":
        return weight.astype(x.dtype) * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _dense(x, w, b=None):
    y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32))


def _check(op, family, x, w, k_cache, v_cache, lengths, inv_freq, num_q_heads, num_kv_heads, rotary_dim, rolling):
    if family not in FAMILIES:
        raise ValueError(f"{op}: family must be one of {FAMILIES}, got {family!r}")
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [B, D], got {tuple(x.shape)}")
    allowed = set(_ATTN_KEYS) | set(_MLP_KEYS[family])
    required = {"norm", "qkv", "o", "post_norm", *(k for k in _MLP_KEYS[family] if k.startswith("w_"))}
    if family == "gpt_neox":
        required |= {"norm_bias", "post_norm_bias"}
    unknown = set(w) - allowed
    missing = sorted(k for k in required if w.get(k) is None)
    if unknown or missing:
        raise ValueError(f"{op}: weights for family {family!r}: unknown {sorted(unknown)}, missing {missing}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"{op}: x must be float16, bfloat16 or float32, got {jnp.dtype(x.dtype).name}")
    for name, a in [("k_cache", k_cache), ("v_cache", v_cache)] + [(f"weights[{k!r}]", v) for k, v in w.items()]:
        if a is not None and jnp.dtype(a.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"{op}: {name} has dtype {jnp.dtype(a.dtype).name}; every weight and cache must "
                             f"have x's dtype {jnp.dtype(x.dtype).name}")
    b, d = x.shape
    if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[1] != num_kv_heads:
        raise ValueError(f"{op}: caches must be [B={b}, Hkv={num_kv_heads}, S_max, Dh], got {tuple(k_cache.shape)}")
    if num_q_heads < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{op}: v_cache {v_cache.dtype} {tuple(v_cache.shape)} must match k_cache "
                         f"{k_cache.dtype} {tuple(k_cache.shape)}")
    dh = k_cache.shape[3]
    rot = dh if rotary_dim is None else rotary_dim
    if rot % 2 or not 0 <= rot <= dh:
        raise ValueError(f"{op}: rotary_dim ({rot}) must be even and at most head_dim ({dh})")
    check_array(op, "inv_freq", inv_freq, (rot // 2,), jnp.float32)
    cols = (num_q_heads + 2 * num_kv_heads) * dh
    check_array(op, "weights['qkv']", w["qkv"], (d, cols))
    check_array(op, "weights['qkv_bias']", w.get("qkv_bias"), (cols,))
    check_array(op, "weights['o']", w["o"], (num_q_heads * dh, d))
    for name in ("norm", "norm_bias", "post_norm", "post_norm_bias", "o_bias"):
        check_array(op, f"weights[{name!r}]", w.get(name), (d,))
    check_array(op, "lengths", lengths, (b,), jnp.int32)
    ff = w["w_gate"].shape[-1] if family == "llama" else w["w_in"].shape[-1]
    shapes = {"w_gate": (d, ff), "w_up": (d, ff), "w_down": (ff, d), "w_in": (d, ff), "b_in": (ff,),
              "w_out": (ff, d), "b_out": (d,)}
    for name in _MLP_KEYS[family]:
        check_array(op, f"weights[{name!r}]", w.get(name), shapes[name])
    check_lengths(op, lengths, b, k_cache.shape[2], rolling)  # the rest of the shapes: attention_block's checks


def decoder_layer(x, weights, k_cache, v_cache, lengths, inv_freq, *, family: str, num_q_heads: int,
                  num_kv_heads: int, eps: float, rotary_dim: int | None = None, rope_layout: str = "half",
                  scale: float | None = None, parallel_residual: bool = False, gelu_approximate: bool = False,
                  rolling: bool = False, impl: str = "auto", one_launch: bool | None = None):
    """(y [B, D], k_cache, v_cache): one decode step of a whole layer (see the module docstring).

    weights: norm, qkv [D, (Hq + 2 Hkv) Dh] (columns [Q heads | K heads | V heads]), o
    [Hq Dh, D], post_norm, and w_gate, w_up [D, F], w_down [F, D] (llama) or w_in [D, F],
    w_out [F, D] (gpt_neox); optional qkv_bias, o_bias, b_in, b_out; norm_bias and
    post_norm_bias for gpt_neox's LayerNorms. Caches [B, Hkv, S_max, Dh] (donate them);
    lengths int32 [B] (tokens already cached); inv_freq float32 [rotary_dim / 2].
    rolling: the caches are a sliding window's rolling buffer of S_max slots (position t in
    slot t % S_max, so once full they hold exactly the window; any lengths[b] >= 0 is valid).
    Under impl="auto" such a step runs the one-launch kernel wherever it covers the shapes
    (the tuner times plain caches), else XLA's projections around decode_attention_append.
    one_launch: under impl="auto" on a GPU, None (default) runs the path the tuner measured
    faster for this shape (the per-op kernels where the one-launch kernel does not cover it),
    True the one-launch kernel where it covers the shapes, False the per-op kernels.
    """
    op = "decoder_layer"
    check_impl(op, impl)
    if not isinstance(weights, Mapping):
        raise TypeError(f"{op}: weights must be a mapping of names to arrays, got {type(weights).__name__}")
    w = dict(weights)
    _check(op, family, x, w, k_cache, v_cache, lengths, inv_freq, num_q_heads, num_kv_heads, rotary_dim, rolling)
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"{op}: rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    check_eps(op, "eps", eps)
    if x.shape[0] == 0:  # no rows: nothing to launch, the caches unchanged
        return jnp.zeros(x.shape, x.dtype), k_cache, v_cache
    kw = dict(family=family, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps, rotary_dim=rotary_dim,
              rope_layout=rope_layout, scale=scale, parallel_residual=parallel_residual,
              gelu_approximate=gelu_approximate, rolling=bool(rolling))
    if impl == "reference":
        return reference.decoder_layer(x, w, k_cache, v_cache, lengths, inv_freq, **kw)
    gpu = on_gpu()
    if impl == "auto" and gpu and one_launch is None:
        one_launch = (not _one_launch_error(family, x, w, k_cache, num_q_heads, num_kv_heads, parallel_residual,
                                            gelu_approximate) if rolling
                      else _pick(x, w, k_cache, **kw) == "one_launch")
    if impl == "cuda" or (impl == "auto" and gpu and one_launch):
        why = _one_launch_error(family, x, w, k_cache, num_q_heads, num_kv_heads, parallel_residual,
                                gelu_approximate) if gpu else ""
        if not why:
            return _custom_call(x, w, k_cache, v_cache, lengths, inv_freq, **kw)
        if impl == "cuda":
            raise ValueError(f"{op}: the one-launch layer kernel cannot run this call: {why}")
        warn_once((op, why), f"{op}: the one-launch layer kernel cannot run this call ({why}); impl='auto' runs "
                  "the per-op kernels", stacklevel=3)
    norm = "rms" if family == "llama" else "layer"
    # over a rolling buffer: XLA's projections around decode_attention_append (its kernels, or
    # XLA's ops under impl="xla")
    block = functools.partial(attention_block_split_k, rolling=True) if rolling else attention_block
    h, k_cache, v_cache = block(
        x, w["qkv"], w["o"], k_cache, v_cache, lengths, inv_freq, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, norm=norm, norm_weight=w["norm"], norm_bias=w.get("norm_bias"), eps=eps,
        qkv_bias=w.get("qkv_bias"), o_bias=w.get("o_bias"), residual=True, rotary_dim=rotary_dim,
        rope_layout=rope_layout, scale=k_cache.shape[-1] ** -0.5 if scale is None else scale, impl=impl)
    src = x if (family == "gpt_neox" and parallel_residual) else h
    hn = _norm(src, norm, w["post_norm"], w.get("post_norm_bias"), eps)
    if family == "llama":
        return swiglu(hn, w["w_gate"], w["w_up"], w["w_down"], residual=h, impl=impl), k_cache, v_cache
    a = jax.nn.gelu(_dense(hn, w["w_in"], w.get("b_in")).astype(jnp.float32), approximate=gelu_approximate)
    m = _dense(a.astype(x.dtype), w["w_out"], w.get("b_out"))
    return (h.astype(jnp.float32) + m.astype(jnp.float32)).astype(x.dtype), k_cache, v_cache


# ----------------------------------------------------------------------------- tuning
def tuning_key(*, batch, hidden, num_q_heads, num_kv_heads, head_dim, max_seq, inter, family, parallel_residual,
               gelu_approximate, dtype) -> str:
    return tuning.make_key(KERNEL_VERSION, b=batch, d=hidden, hq=num_q_heads, hkv=num_kv_heads, dh=head_dim,
                           ctx=tuning.context_bucket(max_seq), unaligned=int(timed_context(max_seq)[1]), f=inter,
                           family=family, parallel=int(bool(parallel_residual)), tanh=int(bool(gelu_approximate)),
                           dtype=jnp.dtype(dtype).name)


def measure(path, *, batch, hidden, num_q_heads, num_kv_heads, head_dim, max_seq, inter, family, parallel_residual,
            gelu_approximate, dtype, steps: int = 8) -> float:
    """Seconds per decode step of `path` ("per_op" or "one_launch") on the default device:
    `steps` steps written out in one jitted program, fresh random weights (with every bias
    the family has), caches of max_seq slots carried and donated, every row at its last slot
    (as attention_block's tuner times them)."""
    hq, hkv, dh, d, f = num_q_heads, num_kv_heads, head_dim, hidden, inter
    keys = iter(jax.random.split(jax.random.key(0), 16))
    rand = lambda *s, sc=1.0: jax.random.normal(next(keys), s, dtype) * jnp.asarray(sc, dtype)  # noqa: E731
    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    w = dict(norm=ones(d), qkv=rand(d, (hq + 2 * hkv) * dh, sc=d ** -0.5), o=rand(hq * dh, d, sc=0.02),
             post_norm=ones(d))
    if family == "llama":
        w.update(w_gate=rand(d, f, sc=d ** -0.5), w_up=rand(d, f, sc=d ** -0.5), w_down=rand(f, d, sc=0.02))
    else:
        w.update(norm_bias=rand(d, sc=0.02), qkv_bias=rand((hq + 2 * hkv) * dh, sc=0.02), o_bias=rand(d, sc=0.02),
                 post_norm_bias=rand(d, sc=0.02), w_in=rand(d, f, sc=d ** -0.5), b_in=rand(f, sc=0.02),
                 w_out=rand(f, d, sc=0.02), b_out=rand(d, sc=0.02))
    kc, vc = rand(batch, hkv, max_seq, dh), rand(batch, hkv, max_seq, dh)
    lengths = jnp.full((batch,), max_seq - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, parallel_residual=parallel_residual,
              gelu_approximate=gelu_approximate)
    run = dict(impl="cuda") if path == "one_launch" else dict(impl="auto", one_launch=False)

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(state, w):
        for _ in range(steps):
            state = decoder_layer(state[0], w, state[1], state[2], lengths, inv_freq, **kw, **run)
        return state

    return tuning.time_carried(lambda state: loop(state, w), (rand(batch, d), kc, vc)) / steps


def _shape(x, w, k_cache, *, family, num_q_heads, num_kv_heads, parallel_residual, gelu_approximate, **_) -> dict:
    w1 = w["w_gate"] if family == "llama" else w["w_in"]
    return dict(batch=x.shape[0], hidden=x.shape[1], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=k_cache.shape[3], max_seq=k_cache.shape[2], inter=w1.shape[-1], family=family,
                parallel_residual=bool(parallel_residual and family == "gpt_neox"),
                gelu_approximate=bool(gelu_approximate and family == "gpt_neox"), dtype=jnp.dtype(x.dtype))


def _pick_for(shape: dict) -> str:
    """The path impl="auto" runs on a GPU: the per-op kernels where the one-launch kernel
    cannot run the layer, else the tuner's pick between the two."""
    if _kernel_error(shape):
        return "per_op"
    timed = dict(shape, max_seq=timed_context(shape["max_seq"])[0])  # every capacity of the key times alike
    return tuning.pick("decoder_layer", tuning_key(**shape), list(PATHS), functools.partial(measure, **timed),
                       heuristic="per_op")


def _pick(x, w, k_cache, **kw) -> str:
    if k_cache.dtype != x.dtype:
        return "per_op"  # the kernel takes caches of x's dtype
    return _pick_for(_shape(x, w, k_cache, **kw))


def autotune(*, batch: int, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
             inter: int, family: str, dtype, parallel_residual: bool = False, gelu_approximate: bool = False) -> str:
    """Runs the tuner now for one layer shape (e.g. at deployment warm-up); returns the path
    impl="auto" will run for it on this GPU: "per_op" or "one_launch"."""
    if not on_gpu():
        return "per_op"
    return _pick_for(dict(batch=batch, hidden=hidden, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, max_seq=max_seq, inter=inter, family=family, dtype=jnp.dtype(dtype),
                          parallel_residual=bool(parallel_residual and family == "gpt_neox"),
                          gelu_approximate=bool(gelu_approximate and family == "gpt_neox")))
