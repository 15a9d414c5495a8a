"""moe_decode: DeepSeek-V2's and V3's mixture-of-experts layer at decode, one fused routed-experts op.

    weights, ids = route(x)                      V2: softmax(x @ router) in fp32, top-k (greedy or
                                                 group-limited greedy), V2's scaling; V3 (noaux_tc):
                                                 sigmoid scores, the choice biased per expert
    routed = sum_s weights[:, s] * SwiGLU_{ids[:, s]}(x)  (+ residual)     [N, H] in x.dtype
    y      = swiglu(x, shared experts, residual=routed)  (without shared experts: routed)

x [N, H] (normalised hidden states, or with `norm` the pre-norm ones: the router's kernels
then normalise them), router [H, E], w_gate / w_up [E, H, I], w_down
[E, I, H]. The router (:func:`jax_cluster.reference.moe_route` is its contract) runs as
the custom call jax_cluster_moe_route under "cuda" / "auto" where it takes the call (two
kernels on a GPU: up to 8 rows and 512 experts; the C++ handler on CPU), else in XLA.
`impl` decides the experts:

  "cuda"       the custom call jax_cluster_moe_decode: on a GPU three kernels (gate/up GEMV,
               down GEMV, combine; cpp/ops/moe_decode/params.h) that read ONLY the chosen
               experts' weights, each chosen expert once per call however many rows chose
               it, and up to 8 rows the shared experts in the same kernels (as Is / I
               pseudo-experts every row chooses); on CPU the C++ handler (same math, also
               float32; shared experts at any N). Otherwise, and for a shared width that is
               not a multiple of 8, the shared experts run through jax_cluster.swiglu.
  "auto"       "cuda" where the kernels take the shape and dtype (float16 / bfloat16, H and
               I multiples of 8), else "xla" with a one-time warning. On a GPU without a
               config, the tuner (jax_cluster.tuning) measures the column tilings, the
               "xla" path and the grouped jax.lax.ragged_dot formulation once per shape
               bucket and GPU and runs the fastest (autotune()).
  "xla"        the gather formulation a JAX user writes (flax_models' experts_gather): the
               chosen experts' weights gathered per (row, slot), XLA's einsums in x.dtype.
  "reference"  jax_cluster.reference.moe_decode (fp32).

:func:`moe_experts` is the routed part alone, for callers that route themselves (weights
float32 [N, k], ids int32 [N, k]); ids known at trace time must lie in [0, E) (a
ValueError otherwise); traced ids outside it give all-NaN output rows.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference, tuning
from jax_cluster._ffi import (check_array, check_call, check_eps, ffi_primitive, fold_batch_axis,
                              on_gpu, warn_once)
from jax_cluster._sharding import row_partitioned
from jax_cluster.ops.swiglu import supported as swiglu_supported, swiglu

__all__ = ["MoeDecodeConfig", "TOPK_METHODS", "autotune", "candidates", "launch_plan", "measure", "moe_decode",
           "moe_experts", "tuning_key"]

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Bump when the kernels change enough that cached tuning results should be measured again.
KERNEL_VERSION = 2
COLS = (32, 64, 128)
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MoeDecodeConfig:
    """How the routed experts run on the GPU (impl "auto" or "cuda"). None: the default.

    cols_up    columns of I per gate/up block: 32, 64 or 128. Narrower tiles give more
               blocks per chosen expert (the GPU fills at batch 1), wider ones longer
               contiguous weight-row segments. Default: 128 where the grid still has a block
               per SM of an H100 (132 blocks), else 64.
    cols_down  columns of H per down block: 32, 64 or 128; the same default.
    pdl        the down and combine kernels launch programmatically (PDL) behind the
               previous kernel.
    """

    cols_up: int | None = None
    cols_down: int | None = None
    pdl: bool = True

    def __post_init__(self):
        for name in ("cols_up", "cols_down"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MoeDecodeConfig: {name} must be an int or None, got {value!r}")
            if value not in COLS:
                raise ValueError(f"MoeDecodeConfig: {name} must be one of {COLS}, got {value}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"MoeDecodeConfig: pdl must be a bool, got {self.pdl!r}")


# ----------------------------------------------------------------------------- launch plan
def _plans():
    return _extension.plans()


@functools.lru_cache(maxsize=None)
def _plan(n: int, h: int, i: int, e: int, k: int, dtype: str, cols_up: int, cols_down: int, i_s: int) -> dict:
    return dict(_plans().moe_decode(n, h, i, e, k, dtype, cols_up, cols_down, i_s))


def launch_plan(config: MoeDecodeConfig | None, n: int, h: int, i: int, e: int, k: int, dtype,
                shared_width: int = 0) -> dict:
    """The C++ plan of one call (cpp/ops/moe_decode/plan.cc): 'error' (why no handler takes
    it, '' if they do), 'cuda_error' (why the CUDA kernels cannot), the resolved column
    tiles and the workspace bytes. shared_width: the shared experts' Is run in the call (0:
    none)."""
    config = config or MoeDecodeConfig()
    return _plan(n, h, i, e, k, jnp.dtype(dtype).name, config.cols_up or 0, config.cols_down or 0, shared_width)


# The most rows whose shared experts run in the GPU call (params.h kMoeDecodeMaxPassRows): every
# shared chunk is then one pass of the kernels. Past it a chunk streams its weights once per
# 8 rows, and jax_cluster.swiglu, which reads them once, is faster (docs/moe_decode.md).
_SHARED_IN_CALL_ROWS = 8

# ----------------------------------------------------------------------------- primitive
def _abstract(x, weights, ids, w_gate, w_up, w_down, s_gate, s_up, s_down, residual, *, cols_up, cols_down, pdl,
              has_residual):
    del weights, w_up, w_down, s_up, s_down, residual, cols_up, cols_down, pdl, has_residual
    n, h = x.shape
    k = ids.shape[1]
    i_s = s_gate.shape[1] if s_gate.ndim == 2 else 0
    ws = _plans().moe_decode_workspace_bytes(n, k, h, w_gate.shape[2], jnp.dtype(x.dtype).name, i_s)
    return ShapedArray((n, h), x.dtype), ShapedArray((ws,), np.uint8)


def _batching(args, dims, **params):
    """vmap: the mapped axis folds into the rows (one call over B * N rows) when the expert
    weights (routed and shared) are the same for every instance; mapped weights run the
    calls one after another."""
    x, weights, ids = args[:3]
    weights_and_shared, residual = args[3:9], args[9]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if all(d is None for d in dims[3:9]):
        rows = [fold_batch_axis(a, d, size) for a, d in zip(args[:3], dims[:3])]
        b, n = rows[0].shape[:2]
        flat = lambda a: a.reshape((b * n,) + a.shape[2:])  # noqa: E731
        res = flat(fold_batch_axis(residual, dims[9], size)) if params["has_residual"] else residual
        out, ws = _PRIM.bind(*(flat(a) for a in rows), *weights_and_shared, res, **params)
        return (out.reshape(b, n, -1), ws), (0, None)
    moved = [fold_batch_axis(a, d, size) if d is not None else a for a, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)[0]

    return (jax.lax.map(one, jnp.arange(size)), jnp.zeros((0,), np.uint8)), (0, None)


_PRIM = ffi_primitive("moe_decode", abstract_eval=_abstract, batching_rule=_batching)


def _route_abstract(x, router, score_bias, norm, *, top_k, group_limited, noaux_tc, n_group, topk_group,
                    norm_topk_prob, routed_scaling_factor, norm_eps):
    del score_bias, norm_topk_prob, routed_scaling_factor, norm_eps
    n, h = x.shape
    has_norm = norm.shape[0] > 0
    ws = _plans().moe_route(n, h, router.shape[1], top_k, jnp.dtype(x.dtype).name, jnp.dtype(router.dtype).name,
                            group_limited, n_group, topk_group, noaux_tc, has_norm)["workspace_bytes"]
    return (ShapedArray((n, top_k), jnp.float32), ShapedArray((n, top_k), jnp.int32),
            ShapedArray((n, h) if has_norm else (0,), x.dtype), ShapedArray((ws,), np.uint8))


def _route_batching(args, dims, **params):
    """vmap: one call over all instances' rows (a shared router, bias and norm), or one call
    per instance."""
    x, router, bias, norm = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    has_norm = norm.shape[-1] > 0
    if all(d is None for d in dims[1:]):
        xs = fold_batch_axis(x, dims[0], size)
        b, n = xs.shape[:2]
        if _route_plan(b * n, xs.shape[2], router.shape[1], params, xs.dtype, router.dtype, has_norm)["usable"]:
            w, i, h, ws = _ROUTE.bind(xs.reshape(b * n, -1), router, bias, norm, **params)
            return (w.reshape(b, n, -1), i.reshape(b, n, -1), h.reshape(b, n, -1) if has_norm else h, ws), \
                (0, 0, 0 if has_norm else None, None)
    moved = [fold_batch_axis(a, d, size) if d is not None else a for a, d in zip(args, dims)]

    def one(j):
        return tuple(_ROUTE.bind(*[a[j] if d is not None else a for a, d in zip(moved, dims)], **params)[:3])

    w, i, h = jax.lax.map(one, jnp.arange(size))
    return (w, i, h, jnp.zeros((0,), np.uint8)), (0, 0, 0, None)


_ROUTE = ffi_primitive("moe_route", abstract_eval=_route_abstract, batching_rule=_route_batching)


def _route_plan(n, h, e, params, dtype, router_dtype, has_norm=False) -> dict:
    """The C++ plan of a router call, and whether the custom call runs it here (the CPU
    handler takes any call its checks pass; the kernel 16-bit x, <= 8 rows, <= 512 experts,
    with a norm H % 8 == 0)."""
    plan = dict(_plans().moe_route(n, h, e, params["top_k"], jnp.dtype(dtype).name, jnp.dtype(router_dtype).name,
                                   params["group_limited"], params["n_group"], params["topk_group"],
                                   params["noaux_tc"], has_norm))
    plan["usable"] = not plan["error"] and not (on_gpu() and plan["cuda_error"])
    return plan


def _rms_norm(x, weight, eps):
    """RMSNorm as jnp writes it (flax_models' rms_norm): float32 statistics, the normalised x
    rounded to x.dtype, then times the weight in x.dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def _route(x, router, route: dict, impl: str, norm=None, norm_eps: float = 1e-6):
    """(weights, ids, h) of the router, h = RMSNorm(x) with a norm weight (else x): the custom
    call under "cuda" / "auto" where it takes the call (the norm in its kernels), else XLA
    (jax_cluster.reference.moe_route on the jnp norm)."""
    noaux = route["topk_method"] == "noaux_tc"
    grouped = noaux or route["topk_method"] == "group_limited_greedy"
    params = dict(top_k=route["top_k"], group_limited=grouped, noaux_tc=noaux,
                  n_group=int(route["n_group"] or 1) if grouped else 1,
                  topk_group=int(route["topk_group"] or 1) if grouped else 1, norm_topk_prob=route["norm_topk_prob"],
                  routed_scaling_factor=np.float32(route["routed_scaling_factor"]), norm_eps=np.float32(norm_eps))
    n, h = x.shape
    wide = jnp.dtype(x.dtype) == jnp.dtype(jnp.float32)  # "auto" keeps float32 on XLA, as for the experts
    if (impl == "cuda" or (impl == "auto" and not wide)) and \
            _route_plan(n, h, router.shape[1], params, x.dtype, router.dtype, norm is not None)["usable"]:
        bias = route.get("score_bias")
        if noaux:
            bias = jnp.zeros((router.shape[1],), jnp.float32) if bias is None else bias.astype(jnp.float32)
        else:
            bias = jnp.zeros((0,), jnp.float32)
        w_norm = jnp.zeros((0,), x.dtype) if norm is None else norm.astype(x.dtype)
        bind = functools.partial(_ROUTE.bind, **params)
        weights, ids, normed = row_partitioned(lambda *ops: bind(*ops)[:3], (True, False, False, False),
                                               (True, True, norm is not None))(x, router, bias, w_norm)
        return weights, ids, x if norm is None else normed
    if norm is not None:
        x = _rms_norm(x, norm, norm_eps)
    return (*reference.moe_route(x, router, **route), x)


# ----------------------------------------------------------------------------- the paths
def _silu(v):
    vf = v.astype(jnp.float32)
    return vf * jax.nn.sigmoid(vf)


def _xla_experts(x, weights, ids, w_gate, w_up, w_down, residual):
    """The gather formulation (flax_models' experts_gather): each (row, slot) pair's expert
    weights gathered, XLA's einsums in x.dtype with fp32 accumulation, 16-bit results."""
    f32 = jnp.float32
    e = w_gate.shape[0]
    valid = jnp.all((ids >= 0) & (ids < e), axis=-1)
    safe = jnp.clip(ids, 0, e - 1)
    g = jnp.einsum("nh,nkhi->nki", x, w_gate[safe], preferred_element_type=f32).astype(x.dtype)
    u = jnp.einsum("nh,nkhi->nki", x, w_up[safe], preferred_element_type=f32).astype(x.dtype)
    h = (_silu(g) * u.astype(f32)).astype(x.dtype)
    y_e = jnp.einsum("nki,nkih->nkh", h, w_down[safe], preferred_element_type=f32).astype(x.dtype)
    y = jnp.einsum("nkh,nk->nh", y_e.astype(f32), weights.astype(f32))
    if residual is not None:
        y = y + residual.astype(f32)
    return jnp.where(valid[:, None], y, jnp.nan).astype(x.dtype)


def _grouped_experts(x, weights, ids, w_gate, w_up, w_down, residual):
    """The grouped formulation (flax_models' experts_grouped, its prefill path): the (row,
    slot) pairs sorted by expert, jax.lax.ragged_dot over the E groups (each chosen expert's
    weights read once), the results scattered back; the gather form's rounding points."""
    f32 = jnp.float32
    n, k = ids.shape
    e = w_gate.shape[0]
    if n == 0:
        return jnp.zeros((0, x.shape[1]), x.dtype)
    valid = jnp.all((ids >= 0) & (ids < e), axis=-1)
    flat = jnp.clip(ids, 0, e - 1).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    g = jax.lax.ragged_dot(xs, w_gate, sizes, preferred_element_type=f32).astype(x.dtype)
    u = jax.lax.ragged_dot(xs, w_up, sizes, preferred_element_type=f32).astype(x.dtype)
    h = (_silu(g) * u.astype(f32)).astype(x.dtype)
    ys = jax.lax.ragged_dot(h, w_down, sizes, preferred_element_type=f32).astype(x.dtype)
    y_e = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)
    y = jnp.einsum("nkh,nk->nh", y_e.astype(f32), weights.astype(f32))
    if residual is not None:
        y = y + residual.astype(f32)
    return jnp.where(valid[:, None], y, jnp.nan).astype(x.dtype)


# What the tuner can pick besides a kernel config: the formulations a JAX user writes.
_XLA_FORMS = {"xla": _xla_experts, "ragged_dot": _grouped_experts}


def _custom_call(x, weights, ids, w_gate, w_up, w_down, shared, residual, plan: dict, pdl: bool):
    has_res = residual is not None
    none = jnp.zeros((0,), x.dtype)
    s = [none] * 3 if shared is None else [shared[key] for key in ("w_gate", "w_up", "w_down")]
    bind = functools.partial(_PRIM.bind, cols_up=int(plan["cols_up"]), cols_down=int(plan["cols_down"]), pdl=pdl,
                             has_residual=has_res)
    rows = (True, True, True) + (False,) * 6 + (has_res,)
    out, = row_partitioned(lambda *ops: bind(*ops)[:1], rows, (True,))(
        x, weights, ids, w_gate, w_up, w_down, *s, residual if has_res else none)
    return out


def _routed(op, x, weights, ids, w_gate, w_up, w_down, residual, impl, config, shared=None):
    """The routed experts (+ residual) by impl (validated arguments), and whether the
    shared experts (None, or swiglu's weights) ran in the same call: then y includes them."""
    if impl == "reference":
        return reference.moe_experts(x, weights, ids, w_gate, w_up, w_down, residual), False
    n, h = x.shape
    e, _, i = w_gate.shape
    k = ids.shape[1]
    if impl in ("auto", "cuda"):
        plan = None
        # the shared experts in the call where it takes them (Is % 8 == 0); on a GPU up to
        # _SHARED_IN_CALL_ROWS rows (the CPU handler: any), and past them where swiglu's
        # kernels cannot take their shape (the call streams them once per 8 rows, but runs)
        if shared is not None and (n <= _SHARED_IN_CALL_ROWS or not on_gpu() or
                                   not swiglu_supported(h, shared["w_gate"].shape[1], x.dtype)):
            plan = launch_plan(config, max(n, 1), h, i, e, k, x.dtype, shared["w_gate"].shape[1])
            if plan["error"]:
                plan, shared = None, None
        else:
            shared = None
        plan = plan or launch_plan(config, max(n, 1), h, i, e, k, x.dtype)
        why_not = plan["error"] or (plan["cuda_error"] if on_gpu() else "")
        if impl == "auto" and jnp.dtype(x.dtype) == jnp.dtype(jnp.float32):
            why_not = why_not or "dtype float32 (the kernels take float16 or bfloat16)"
        if not why_not and impl == "auto" and config is None and on_gpu():
            i_s = shared["w_gate"].shape[1] if shared is not None else 0
            config = _pick(n, h, i, e, k, i_s, x.dtype)
            if config in _XLA_FORMS:
                return _XLA_FORMS[config](x, weights, ids, w_gate, w_up, w_down, residual), False
            plan = launch_plan(config, max(n, 1), h, i, e, k, x.dtype, i_s)
        if why_not:
            if impl == "cuda":
                raise ValueError(f"{op}: impl='cuda' cannot run this call: {why_not}")
            warn_once((op, h, i, e, k, jnp.dtype(x.dtype).name), f"{op}: no kernel for this call ({why_not}); "
                      "running impl='xla'")
            impl = "xla"
    if impl == "xla":
        return _xla_experts(x, weights, ids, w_gate, w_up, w_down, residual), False
    if n == 0:
        return jnp.zeros((0, h), x.dtype), False
    pdl = (config or MoeDecodeConfig()).pdl
    return _custom_call(x, weights, ids, w_gate, w_up, w_down, shared, residual, plan, pdl), shared is not None


# ----------------------------------------------------------------------------- tuning
def candidates(grouped: bool = True) -> list:
    """What the tuner measures for one shape: the tensor-core kernels at 64 and 128 columns
    for each GEMV (the 32-column CUDA-core form lost everywhere it was measured), and the
    formulations a JAX user writes on XLA, so that "auto" is never slower than them: the
    gather ("xla") and, with `grouped`, the grouped jax.lax.ragged_dot ("ragged_dot")."""
    forms = list(_XLA_FORMS) if grouped else ["xla"]
    return [MoeDecodeConfig(cols_up=u, cols_down=d) for u in (64, 128) for d in (64, 128)] + forms


def _grouped_is_a_candidate(n: int, k: int, e: int) -> bool:
    """ragged_dot reads every expert's weights (measured: 22x the kernels' time at DeepSeek-V3's
    batch 1), so it is timed only where the rows' N k pairs can choose every expert: the timing
    inputs hold min(E, N k) experts, and fewer would time it on less than it reads."""
    return _n_bucket(n) * k >= e


def _n_bucket(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def tuning_key(n: int, h: int, i: int, e: int, k: int, i_s: int, dtype) -> str:
    """n rows (bucketed to a power of two), hidden h, expert width i, e experts, k slots,
    i_s the shared width run in the call (0: none), dtype."""
    return tuning.make_key(KERNEL_VERSION, n=_n_bucket(n), h=h, i=i, e=e, k=k, shared=i_s,
                           dtype=jnp.dtype(dtype).name)


def _timing_inputs(n, h, i, e, k, i_s, dtype, *, seed=0, l2_bytes=64 << 20):
    """Random rows, a random routing (each row k distinct experts of min(E, n k): the kernels
    read only chosen experts, so E past that only costs memory; V3's 256 experts would be
    22 GB; all E where ragged_dot, which reads every expert, is timed) and enough copies of
    the expert weights that rotating over them defeats the L2."""
    dtype = jnp.dtype(dtype)
    experts = e if _grouped_is_a_candidate(n, k, e) else min(e, max(k, n * k))
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.random((n, k)) + 0.5, jnp.float32)
    call_bytes = (3 * h * i * experts + 3 * h * i_s) * dtype.itemsize
    copies = max(1, min(8, -(-2 * l2_bytes // call_bytes)))
    keys = iter(jax.random.split(jax.random.key(seed), 6 * copies + 1))

    def normal(shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in ** -0.5).astype(dtype)

    layers = []
    for _ in range(copies):
        w = dict(w_gate=normal((experts, h, i), h), w_up=normal((experts, h, i), h),
                 w_down=normal((experts, i, h), i))
        w["shared"] = dict(w_gate=normal((h, i_s), h), w_up=normal((h, i_s), h),
                           w_down=normal((i_s, h), i_s)) if i_s else None
        layers.append(w)
    return normal((n, h), 1), weights, ids, tuple(layers)


def measure(choice, *, n: int, h: int, i: int, e: int, k: int, i_s: int, dtype, calls: int = 16) -> float:
    """Seconds per call of `choice` (a MoeDecodeConfig, or "xla" / "ragged_dot": that
    formulation and the shared experts on XLA's dots) on the default device: `calls` calls
    chained inside one jit (each output is the next call's rows; the routing is fixed, so
    the values do not change what is read), rotating over the weight copies. An optimization barrier on the
    routing before each call: with the same ids and weights XLA would otherwise gather the
    chosen experts once for every call (a model's layers each gather their own)."""
    x, weights, ids, layers = _timing_inputs(n, h, i, e, k, i_s, dtype)

    def one(x, wt, ix, w):
        if isinstance(choice, str):
            y = _XLA_FORMS[choice](x, wt, ix, w["w_gate"], w["w_up"], w["w_down"], None)
            return _shared_after("moe_experts", x, w["shared"], False, y, "xla")
        return moe_experts(x, wt, ix, w["w_gate"], w["w_up"], w["w_down"], shared=w["shared"], impl="cuda",
                           config=choice)

    def run(x, weights, ids, layers):
        for c in range(calls):
            x, wt, ix = jax.lax.optimization_barrier((x, weights, ids))
            x = one(x, wt, ix, layers[c % len(layers)])
        return x

    return tuning.time_call(jax.jit(run), x, weights, ids, layers) / calls


def _pick(n: int, h: int, i: int, e: int, k: int, i_s: int, dtype):
    return tuning.pick("moe_decode", tuning_key(n, h, i, e, k, i_s, dtype),
                       candidates(_grouped_is_a_candidate(n, k, e)),
                       functools.partial(measure, n=n, h=h, i=i, e=e, k=k, i_s=i_s, dtype=jnp.dtype(dtype)),
                       heuristic=MoeDecodeConfig())


def autotune(n: int, h: int, i: int, e: int, k: int, dtype, *, shared_width: int = 0):
    """Runs the tuner now for one shape (e.g. at deployment warm-up) and returns what
    impl="auto" will run for it on this GPU: a MoeDecodeConfig, "xla" or "ragged_dot".
    shared_width: the shared experts' Is when they run in the call (up to 8 rows), else 0."""
    if not on_gpu():
        return MoeDecodeConfig()  # nothing to tune: the CPU handler computes the same math
    return _pick(n, h, i, e, k, shared_width, jnp.dtype(dtype))


# ----------------------------------------------------------------------------- validation
def _check_experts(op: str, x, w_gate, w_up, w_down, residual) -> tuple[int, int, int, int]:
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{op}: x must be [N, H], got shape {tuple(getattr(x, 'shape', ()))}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"{op}: x dtype must be float16, bfloat16 or float32, got {jnp.dtype(x.dtype).name}")
    n, h = x.shape
    if h < 1:
        raise ValueError(f"{op}: x must have H >= 1 columns, got shape {tuple(x.shape)}")
    if getattr(w_gate, "ndim", None) != 3 or w_gate.shape[1] != h:
        raise ValueError(f"{op}: w_gate must be [E, H, I] with H = x.shape[1] = {h}, got shape "
                         f"{tuple(getattr(w_gate, 'shape', ()))}")
    e, _, i = w_gate.shape
    if e < 1 or i < 1:
        raise ValueError(f"{op}: w_gate must have E >= 1 experts and I >= 1 columns, got shape {tuple(w_gate.shape)}")
    check_array(op, "w_gate", w_gate, (e, h, i), x.dtype)
    check_array(op, "w_up", w_up, (e, h, i), x.dtype)
    check_array(op, "w_down", w_down, (e, i, h), x.dtype)
    check_array(op, "residual", residual, (n, h), x.dtype)
    return n, h, i, e


def _check_int(op: str, name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{op}: {name} must be in {lo}..{hi}, got {value}" if hi is not None
                         else f"{op}: {name} must be >= {lo}, got {value}")


def _check_routing(op: str, e: int, top_k, topk_method, n_group, topk_group, norm_topk_prob,
                   routed_scaling_factor, score_bias) -> None:
    _check_int(op, "top_k", top_k, 1, e)
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"{op}: topk_method must be one of {TOPK_METHODS}, got {topk_method!r}")
    if topk_method != "greedy":
        if n_group is None or topk_group is None:
            raise ValueError(f"{op}: topk_method={topk_method!r} needs n_group and topk_group")
        _check_int(op, "n_group", n_group, 1, e)
        if e % n_group:
            raise ValueError(f"{op}: n_group ({n_group}) must divide the number of experts E ({e})")
        if topk_method == "noaux_tc" and e // n_group < 2:
            raise ValueError(f"{op}: noaux_tc scores a group by its two best experts: E / n_group "
                             f"({e} / {n_group}) must be at least 2")
        _check_int(op, "topk_group", topk_group, 1, n_group)
        if top_k > topk_group * (e // n_group):
            raise ValueError(f"{op}: top_k ({top_k}) must be at most topk_group * E / n_group "
                             f"({topk_group * (e // n_group)}), the experts the kept groups hold")
    if not isinstance(norm_topk_prob, (bool, np.bool_)):
        raise TypeError(f"{op}: norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, numbers.Real):
        raise TypeError(f"{op}: routed_scaling_factor must be a real number, got {routed_scaling_factor!r}")
    if not np.isfinite(routed_scaling_factor):
        raise ValueError(f"{op}: routed_scaling_factor must be finite, got {routed_scaling_factor}")
    if score_bias is None:
        return
    if topk_method != "noaux_tc":
        raise ValueError(f"{op}: score_bias is DeepSeek-V3's correction of the noaux_tc choice; "
                         f"topk_method {topk_method!r} takes none")
    if tuple(getattr(score_bias, "shape", ())) != (e,) or not jnp.issubdtype(score_bias.dtype, jnp.floating):
        raise ValueError(f"{op}: score_bias must be a float array [E] = ({e},), got "
                         f"{getattr(getattr(score_bias, 'dtype', None), 'name', type(score_bias).__name__)} "
                         f"{tuple(getattr(score_bias, 'shape', ()))}")


def _check_norm(op: str, norm, eps, h: int) -> None:
    if norm is None:
        return
    if tuple(getattr(norm, "shape", ())) != (h,) or not jnp.issubdtype(norm.dtype, jnp.floating):
        raise ValueError(f"{op}: norm must be a float array [H] = ({h},), got "
                         f"{getattr(getattr(norm, 'dtype', None), 'name', type(norm).__name__)} "
                         f"{tuple(getattr(norm, 'shape', ()))}")
    check_eps(op, "norm_eps", eps)


def _check_shared(op: str, shared, h: int, dtype) -> None:
    if shared is None:
        return
    if not isinstance(shared, dict) or set(shared) != {"w_gate", "w_up", "w_down"}:
        keys = sorted(shared) if isinstance(shared, dict) else type(shared).__name__
        raise ValueError(f"{op}: shared must be None or a dict with keys 'w_gate', 'w_up', 'w_down', got {keys}")
    wg = shared["w_gate"]
    if getattr(wg, "ndim", None) != 2 or wg.shape[0] != h or wg.shape[1] < 1:
        raise ValueError(f"{op}: shared['w_gate'] must be [H, Is] with H = {h}, got shape "
                         f"{tuple(getattr(wg, 'shape', ()))}")
    i_s = wg.shape[1]
    check_array(op, "shared['w_gate']", wg, (h, i_s), dtype)
    check_array(op, "shared['w_up']", shared["w_up"], (h, i_s), dtype)
    check_array(op, "shared['w_down']", shared["w_down"], (i_s, h), dtype)


# ----------------------------------------------------------------------------- public
def moe_experts(x, weights, ids, w_gate, w_up, w_down, residual=None, *, shared: dict | None = None,
                impl: str = "auto", config: MoeDecodeConfig | None = None):
    """The routed experts alone: y[n] = sum_s weights[n, s] * SwiGLU_{ids[n, s]}(x[n])
    (+ residual), [N, H] in x.dtype; then the shared experts, as moe_decode adds them.

    weights float32 [N, k], ids int32 [N, k] (a router's output; k <= E): for callers that
    route themselves (a router moe_decode does not have, or routing shared by layers). ids known
    at trace time outside [0, E) raise a ValueError; traced ones there give an all-NaN row
    (every impl). shared / impl / config: as moe_decode.
    """
    op = "moe_experts"
    check_call(op, impl, config, MoeDecodeConfig)
    n, h, i, e = _check_experts(op, x, w_gate, w_up, w_down, residual)
    _check_shared(op, shared, h, x.dtype)
    if getattr(ids, "ndim", None) != 2 or ids.shape[0] != n or jnp.dtype(ids.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"{op}: ids must be int32 [N={n}, k], got {jnp.dtype(ids.dtype).name} {tuple(ids.shape)}")
    k = ids.shape[1]
    if not 1 <= k <= e:
        raise ValueError(f"{op}: ids must have 1..E={e} slots per row, got {k}")
    check_array(op, "weights", weights, (n, k), jnp.float32)
    if not isinstance(ids, jax.core.Tracer):
        vals = np.asarray(ids)
        if vals.size and (vals.min() < 0 or vals.max() >= e):
            raise ValueError(f"{op}: ids must be in [0, E={e}); got min {vals.min()}, max {vals.max()}")
    y, shared_done = _routed(op, x, weights, ids, w_gate, w_up, w_down, residual, impl, config, shared)
    return _shared_after(op, x, shared, shared_done, y, impl)


def _shared_after(op: str, x, shared, shared_done: bool, y, impl: str):
    """y + the shared experts through jax_cluster.swiglu when the call did not run them."""
    if shared is None or shared_done:
        return y
    try:
        return swiglu(x, shared["w_gate"], shared["w_up"], shared["w_down"], y, impl=impl)
    except ValueError as e:  # name the op the caller called, and why swiglu runs
        raise ValueError(f"{op}: the shared experts run through jax_cluster.swiglu here (past "
                         f"{_SHARED_IN_CALL_ROWS} rows on a GPU, or a width Is that is not a multiple of 8), "
                         f"which refuses them: {e}") from e


def moe_decode(x, router, w_gate, w_up, w_down, *, top_k: int, topk_method: str = "greedy", n_group=None,
               topk_group=None, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
               score_bias=None, shared: dict | None = None, residual=None, norm=None, norm_eps: float = 1e-6,
               impl: str = "auto", config: MoeDecodeConfig | None = None):
    """DeepSeek-V2's (and V3's) MoE layer for N rows (see the module docstring): y [N, H] in x.dtype.

    x [N, H] float16 / bfloat16 (float32: "xla", "reference" or the CPU handler); router
    [H, E] (any float dtype; fp32 math); w_gate / w_up [E, H, I], w_down [E, I, H] in
    x.dtype. Routing as DeepSeek-V2: top_k experts per row, topk_method "greedy" or
    "group_limited_greedy" (n_group groups of E / n_group experts, the topk_group best
    groups kept), norm_topk_prob (renormalise the top_k weights to sum 1, when top_k > 1)
    else routed_scaling_factor. Or as DeepSeek-V3, topk_method "noaux_tc": sigmoid scores,
    the experts chosen by score + score_bias [E] (None: zeros) within the topk_group groups
    whose two best biased scores sum highest, the weights the unbiased scores (renormalised
    when norm_topk_prob) times routed_scaling_factor; the same router kernel runs it.
    shared: None or dict(w_gate [H, Is], w_up [H, Is], w_down [Is, H]), the always-on
    shared experts (one SwiGLU: in the custom call's kernels under impl "cuda" / "auto" up
    to 8 rows on a GPU, else by jax_cluster.swiglu with the same impl). residual: None or
    [N, H], added to the routed sum before the shared experts' output. norm: None (x is
    already normalised), or the weight [H] of the RMSNorm ahead of the layer: x is then the
    pre-norm hidden state and the router and the experts see norm * (x * rsqrt(mean(x^2) +
    norm_eps)), rounded as jnp rounds (the normalised x to x.dtype, then its product with the
    weight); on the router's custom call the norm runs in its kernels, not as XLA kernels of
    its own. config: a MoeDecodeConfig (impl "auto" or "cuda")."""
    op = "moe_decode"
    check_call(op, impl, config, MoeDecodeConfig)
    n, h, i, e = _check_experts(op, x, w_gate, w_up, w_down, residual)
    if getattr(router, "ndim", None) != 2 or tuple(router.shape) != (h, e):
        raise ValueError(f"{op}: router must be [H, E] = ({h}, {e}), got shape {tuple(getattr(router, 'shape', ()))}")
    if not jnp.issubdtype(router.dtype, jnp.floating):
        raise ValueError(f"{op}: router must be a float array, got {jnp.dtype(router.dtype).name}")
    _check_routing(op, e, top_k, topk_method, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                   score_bias)
    _check_shared(op, shared, h, x.dtype)
    _check_norm(op, norm, norm_eps, h)
    if n == 0:
        return jnp.zeros((0, h), x.dtype)
    route = dict(top_k=int(top_k), topk_method=topk_method, n_group=n_group, topk_group=topk_group,
                 norm_topk_prob=bool(norm_topk_prob), routed_scaling_factor=float(routed_scaling_factor),
                 score_bias=score_bias)
    if impl == "reference":
        if norm is not None:
            x = _rms_norm(x, norm, norm_eps)
        return reference.moe_decode(x, router, w_gate, w_up, w_down, **route, shared=shared, residual=residual)
    weights, ids, x = _route(x, router, route, impl, norm, norm_eps)
    y, shared_done = _routed(op, x, weights, ids, w_gate, w_up, w_down, residual, impl, config, shared)
    return _shared_after(op, x, shared, shared_done, y, impl)
