"""moe_decode (DeepSeek-V2's MoE at decode) vs the jnp reference: the router against
flax_models' route() (same ids and weights), reference vs an independent float64
computation, every impl on CPU (the C++ handler for "cuda", float32 too), jit, vmap,
invalid ids, every validation error; on a GPU the CUDA kernels for float16 / bfloat16,
N in {1, 3, 16, 64} (and more rows than a pass holds), every routing method (V2's greedy and
group-limited, V3's noaux_tc), shared experts and residual, every column tile, V2-Lite,
DeepSeek-V2 and V3 router shapes, bitwise determinism."""

import dataclasses
import json
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import _ffi, reference
from jax_cluster.ops import moe_decode as md
from jax_cluster.ops.moe_decode import MoeDecodeConfig
from jax_cluster.testing import TOLERANCE, on_cpu, rel_l2

DTYPES = ["float16", "bfloat16"]
GREEDY = dict(topk_method="greedy")
GROUPED = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)
NOAUX = dict(topk_method="noaux_tc", n_group=4, topk_group=2)  # + score_bias [E]: _routing
METHODS = [GREEDY, GROUPED, NOAUX]
METHOD_IDS = ["greedy", "group_limited", "noaux_tc"]


def _routing(method: dict, e: int, seed: int = 0) -> dict:
    """method's routing arguments for E experts: noaux_tc gets a random correction bias large
    enough to change the choice the scores alone would make."""
    if method.get("topk_method") != "noaux_tc":
        return dict(method)
    return dict(method, score_bias=jnp.asarray(np.random.default_rng(seed).standard_normal(e) * 0.5, jnp.float32))


@pytest.fixture(autouse=True)
def _tuning_cache(monkeypatch, tmp_path):
    """Tests never write the user's tuning cache, and "auto" runs the default tiling without
    measuring unless a test turns the tuner on (every auto call on a GPU would tune)."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    jc.tuning.clear_memory_cache()
    yield
    jc.tuning.clear_memory_cache()


def _arr(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _inputs(rng, n, h, i, e, dtype, *, shared=None, residual=False):
    """x, router, w_gate, w_up, w_down and the optional shared experts ([H, Is]) / residual."""
    args = dict(x=_arr(rng, (n, h), dtype), router=_arr(rng, (h, e), dtype, h ** -0.5),
                w_gate=_arr(rng, (e, h, i), dtype, h ** -0.5), w_up=_arr(rng, (e, h, i), dtype, h ** -0.5),
                w_down=_arr(rng, (e, i, h), dtype, i ** -0.5))
    extra = {}
    if shared:
        extra["shared"] = dict(w_gate=_arr(rng, (h, shared), dtype, h ** -0.5),
                               w_up=_arr(rng, (h, shared), dtype, h ** -0.5),
                               w_down=_arr(rng, (shared, h), dtype, shared ** -0.5))
    if residual:
        extra["residual"] = _arr(rng, (n, h), dtype)
    return args, extra


def _tol(dtype) -> float:
    return TOLERANCE[jnp.dtype(dtype).name]


def _check(out, ref, dtype, factor=1.0):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    err = rel_l2(out, ref)
    assert err <= factor * _tol(dtype), err
    return err


def _run(kwargs, args, extra, device=None):
    """jc.moe_decode under jit (arrays committed to `device`)."""
    if device is not None:
        args, extra = jax.device_put((args, extra), device)
    names = list(args)
    fn = jax.jit(lambda a, ex: jc.moe_decode(**dict(zip(names, a)), **ex, **kwargs))
    return np.asarray(fn(list(args.values()), extra))


# ---------------------------------------------------------------- the router
@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("norm", [False, True])
def test_router_matches_flax_models(rng, method, norm):
    """The op's router (reference.moe_route) and flax_models' route() give the same ids and
    weights on random inputs (both run the same jnp ops)."""
    from flax_models.moe import route

    for dtype, (n, h, e, k) in (("float32", (7, 64, 8, 3)), ("bfloat16", (33, 96, 16, 4)), ("float16", (1, 64, 64, 6))):
        x, router = _arr(rng, (n, h), dtype), _arr(rng, (h, e), dtype, h ** -0.5)
        kw = dict(top_k=k, norm_topk_prob=norm, routed_scaling_factor=1.5)
        routing = _routing(method, e)
        groups = {key: v for key, v in routing.items() if key != "topk_method"}
        w_flax, ids_flax = jax.jit(lambda x, r: route(x, r, method=method["topk_method"], **groups, **kw))(x, router)
        w_op, ids_op = jax.jit(lambda x, r: reference.moe_route(x, r, **routing, **kw))(x, router)
        np.testing.assert_array_equal(np.asarray(ids_op), np.asarray(ids_flax))
        np.testing.assert_array_equal(np.asarray(w_op), np.asarray(w_flax))
        assert ids_op.dtype == jnp.int32 and w_op.dtype == jnp.float32
        if method is not GREEDY:  # every chosen expert lies in one of the topk_group kept groups
            assert (np.asarray([len(set(r)) for r in np.asarray(ids_op) // (e // 4)]) <= 2).all()


# ---------------------------------------------------------------- the reference itself
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64_math(rng, dtype):
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    args, extra = _inputs(rng, 4, 64, 32, 8, dtype, residual=True)
    weights, ids = reference.moe_route(args["x"], args["router"], top_k=3)
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    x, ids_np, w_np = f64(args["x"]), np.asarray(ids), f64(weights)
    y = f64(extra["residual"]).copy()
    for n in range(4):
        for s in range(3):
            e = ids_np[n, s]
            g, u = x[n] @ f64(args["w_gate"][e]), x[n] @ f64(args["w_up"][e])
            h = (g / (1 + np.exp(-g)) * u).astype(np_dtype).astype(np.float64)
            y[n] += w_np[n, s] * (h @ f64(args["w_down"][e]))
    out = reference.moe_experts(args["x"], weights, ids, args["w_gate"], args["w_up"], args["w_down"],
                                extra["residual"])
    assert rel_l2(np.asarray(out), y.astype(np_dtype).astype(np.float64)) < 2e-3


# ---------------------------------------------------------------- CPU: every impl
def _cpu():
    return jax.devices("cpu")[0]


@pytest.mark.parametrize("dtype", ["float32"] + DTYPES)
@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
def test_cpu_impls_agree(rng, dtype, method):
    """reference vs xla vs the custom call (CPU handler) vs auto, with and without shared
    experts and residual, k = 2 and 3, N = 1 and 16."""
    for n, k, shared, residual in ((1, 2, None, False), (16, 3, 64, True)):
        args, extra = _inputs(rng, n, 64, 32, 8, dtype, shared=shared, residual=residual)
        kw = dict(top_k=k, norm_topk_prob=n == 16, routed_scaling_factor=1.0 if n == 16 else 2.0, **method)
        extra = dict(extra, **{key: v for key, v in _routing(method, 8, n).items() if key == "score_bias"})
        ref = _run(dict(impl="reference", **kw), args, extra, _cpu())
        factor = 1.0 if dtype != "float32" else 2.0
        impls = ("xla", "cuda") + (("auto",) if dtype != "float32" and n > 1 else ())
        for impl in impls:
            _check(_run(dict(impl=impl, **kw), args, extra, _cpu()), ref, dtype, factor)


@pytest.mark.parametrize("shared", [8, 48, 200, 36, 328], ids=str)
def test_cpu_shared_widths(rng, shared):
    """Shared experts of any width in the call (chunks of I = 32: one narrower, one
    wider than I, several with a narrower last, 11); a width that is not a multiple of 8 runs
    through swiglu outside the call (impl "auto": swiglu's kernels need multiples of 64)."""
    args, extra = _inputs(rng, 3, 64, 32, 8, "bfloat16", shared=shared, residual=True)
    kw = dict(top_k=2, **GREEDY)
    impl = "cuda" if shared % 8 == 0 else "auto"
    ref = _run(dict(impl="reference", **kw), args, extra, _cpu())
    _check(_run(dict(impl=impl, **kw), args, extra, _cpu()), ref, "bfloat16")
    names = list(args)
    hlo = jax.jit(lambda a, ex: jc.moe_decode(**dict(zip(names, a)), **ex, **kw, impl=impl)).lower(
        list(args.values()), extra).as_text()
    assert hlo.count("jax_cluster_moe_decode") == 1
    assert ("jax_cluster_swiglu" in hlo or "dot" in hlo) if shared % 8 else "jax_cluster_swiglu" not in hlo


NORM_EPS = 1e-6


def _route_both(x, router, device, norm=None, **route):
    """(weights, ids) of the router custom call and of XLA's reference, under jit on `device`.
    With a norm weight the call normalises x and the reference routes the call's h (their h
    are compared by _check_normed); then also returns (the call's h, the jnp norm's h)."""
    kw = dict(top_k=2, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
              routed_scaling_factor=1.0)
    kw.update(_routing(route, router.shape[1]))
    x, router, norm = jax.device_put((x, router, norm), device)
    if "score_bias" in kw:
        kw["score_bias"] = jax.device_put(kw["score_bias"], device)
    *ours, h = jax.jit(lambda x, r, g: md._route(x, r, kw, "cuda", g, NORM_EPS))(x, router, norm)
    ref = jax.jit(lambda x, r: reference.moe_route(x, r, **kw))(h, router)
    both = [np.asarray(a) for a in ours], [np.asarray(a) for a in ref]
    if norm is None:
        return both
    return (*both, (np.asarray(h), _rms_norm_np(x, norm, NORM_EPS)))


def _rms_norm_np(x, weight, eps):
    """RMSNorm with each rounding jnp writes (numpy: no fusion keeps excess precision)."""
    dt = np.asarray(x).dtype
    xf = np.asarray(x, np.float32)
    rstd = np.float32(1) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    return (np.asarray(weight, np.float32) * (xf * rstd).astype(dt).astype(np.float32)).astype(dt)


def _check_normed(h, ref, dtype):
    """The router's h = RMSNorm(x) against jnp's: its sum of squares is summed in another order,
    so its 1 / rms may differ in the last bits: a 16-bit element then rounds the other way,
    rarely (one ulp), a float32 one moves by an ulp or two."""
    h32, ref32 = np.asarray(h, np.float32), np.asarray(ref, np.float32)
    if jnp.dtype(dtype).itemsize == 2:
        ulps = 2 * np.abs(ref32) * 2.0 ** -jnp.finfo(jnp.dtype(dtype)).nmant  # 2 to 4 ulps
        assert np.all(np.abs(h32 - ref32) <= ulps), np.max(np.abs(h32 - ref32) / ulps)
        assert np.mean(h32 == ref32) > 0.98
    else:
        np.testing.assert_allclose(h32, ref32, rtol=1e-6, atol=1e-30)


ROUTES = [dict(top_k=2), dict(top_k=6, routed_scaling_factor=2.5), dict(top_k=3, norm_topk_prob=True),
          dict(top_k=3, topk_method="group_limited_greedy", n_group=4, topk_group=2),
          dict(top_k=6, topk_method="group_limited_greedy", n_group=8, topk_group=3, norm_topk_prob=True),
          dict(top_k=3, topk_method="noaux_tc", n_group=4, topk_group=2),
          dict(top_k=8, topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
               routed_scaling_factor=2.5)]


@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_cpu_router_custom_call(rng, route):
    """The router's custom call (CPU handler) picks XLA's experts and weights: N = 1, 5, 70
    (past the kernel's 64 rows: the handler takes any), router float32 and bfloat16."""
    for n, dtype, rdtype in ((1, "bfloat16", "float32"), (5, "float16", "bfloat16"), (70, "float32", "float32")):
        x, router = _arr(rng, (n, 64), dtype), _arr(rng, (64, 32), rdtype, 64 ** -0.5)
        (w, i), (rw, ri) = _route_both(x, router, _cpu(), **route)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)
    args, _ = _inputs(rng, 3, 64, 32, 8, "bfloat16")
    names = list(args)
    hlo = jax.jit(lambda a: jc.moe_decode(**dict(zip(names, a)), top_k=2, impl="cuda")).lower(
        list(args.values())).as_text()
    assert hlo.count("jax_cluster_moe_route") == 1


@pytest.mark.parametrize("route", ROUTES[::3], ids=str)
def test_cpu_router_norm(rng, route):
    """With a norm weight the router's custom call (CPU handler) returns h = RMSNorm(x) as jnp
    rounds it, and routes h: N = 1, 5, 70; x float16 / bfloat16 / float32; H 64 and 200."""
    for n, h, dtype in ((1, 64, "bfloat16"), (5, 200, "float16"), (70, 64, "float32")):
        x, router = _arr(rng, (n, h), dtype, 3.0), _arr(rng, (h, 32), "float32", h ** -0.5)
        norm = _arr(rng, (h,), dtype, 0.5) + 1
        (w, i), (rw, ri), (hn, href) = _route_both(x, router, _cpu(), norm, **route)
        _check_normed(hn, href, dtype)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_allclose(w, rw, rtol=1e-5, atol=1e-7)


def test_router_plan_norm_limit():
    """The kernels read the rows for the norm as 16-byte vectors: with a norm, H off that grid
    is a CUDA limit (the call routes in XLA on a GPU), not an error; without one it is none."""
    plan = jc._extension.plans().moe_route
    assert "H must be a multiple of 8" in plan(1, 100, 8, 2, "bfloat16", "float32", False, 1, 1, False, True)["cuda_error"]
    for h, has_norm in ((100, False), (104, True)):
        got = plan(1, h, 8, 2, "bfloat16", "float32", False, 1, 1, False, has_norm)
        assert got["cuda_error"] == "" and got["error"] == "", (h, has_norm, got)


@pytest.mark.parametrize("impl", ["reference", "xla", "cuda"])
def test_moe_decode_norm(rng, impl):
    """moe_decode(x, norm=g) is moe_decode(RMSNorm(x)) for every impl, to a tolerance (the
    custom call's h may differ by an ulp in rare elements; inside one jit XLA may keep h in
    float32, its excess precision); a norm the op cannot take is a ValueError naming it."""
    args, extra = _inputs(rng, 3, 64, 32, 8, "bfloat16", shared=64, residual=True)
    g = _arr(rng, (64,), "bfloat16", 0.5) + 1
    kw = dict(top_k=2, **GROUPED)
    out = _run(dict(impl=impl, norm=g, norm_eps=1e-5, **kw), args, extra)
    ref = _run(dict(impl=impl, **kw), dict(args, x=md._rms_norm(args["x"], g, 1e-5)), extra)
    _check(out, ref, "bfloat16")
    for bad, why in ((g[:8], r"norm must be a float array \[H\] = \(64,\)"),
                     (jnp.ones((64,), jnp.int32), "norm must be a float array")):
        with pytest.raises(ValueError, match=why):
            jc.moe_decode(**args, **kw, norm=bad, impl=impl)
    with pytest.raises(ValueError, match="norm_eps must be a finite number"):
        jc.moe_decode(**args, **kw, norm=g, norm_eps=float("nan"), impl=impl)


def test_router_vmap(rng):
    """vmap over x (one call over every instance's rows), and over x and V3's score_bias
    together (a call per instance)."""
    x, router = _arr(rng, (3, 5, 64), "bfloat16"), _arr(rng, (64, 16), "bfloat16", 0.125)
    kw = dict(top_k=3, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=True,
              routed_scaling_factor=1.0)
    w, i, _ = jax.vmap(lambda v: md._route(v, router, kw, "cuda"))(x)
    biases = _arr(rng, (3, 16), "float32", 0.5)
    noaux = dict(kw, topk_method="noaux_tc", n_group=4, topk_group=2)
    w3, i3, _ = jax.vmap(lambda v, b: md._route(v, router, dict(noaux, score_bias=b), "cuda"))(x, biases)
    hlo = jax.jit(jax.vmap(lambda v: md._route(v, router, kw, "cuda"))).lower(x).as_text()
    assert hlo.count("jax_cluster_moe_route") == 1
    for b in range(3):
        for (ow, oi), route in (((w, i), kw), ((w3, i3), dict(noaux, score_bias=biases[b]))):
            rw, ri = reference.moe_route(x[b], router, **route)
            np.testing.assert_array_equal(np.asarray(oi[b]), np.asarray(ri))
            np.testing.assert_allclose(np.asarray(ow[b]), np.asarray(rw), rtol=1e-5, atol=1e-7)
    # with a norm: folded into one call (a shared norm weight), or a call per instance (mapped)
    g = _arr(rng, (3, 64), "bfloat16", 0.5) + 1
    for fn, one in ((lambda v, gb: md._route(v, router, kw, "cuda", g[0]), True),
                    (lambda v, gb: md._route(v, router, kw, "cuda", gb), False)):
        wn, i_n, hn = jax.vmap(fn)(x, g)
        assert jax.jit(jax.vmap(fn)).lower(x, g).as_text().count("jax_cluster_moe_route") == 1
        for b in range(3):
            gb = g[0] if one else g[b]
            ow, oi, oh = md._route(x[b], router, kw, "cuda", gb)
            np.testing.assert_array_equal(np.asarray(hn[b]), np.asarray(oh))
            np.testing.assert_array_equal(np.asarray(i_n[b]), np.asarray(oi))
            np.testing.assert_allclose(np.asarray(wn[b]), np.asarray(ow), rtol=1e-6, atol=1e-8)


def test_cpu_handler_matches_reference_closely(rng):
    """The CPU handler computes the reference's math (fp32, h rounded): nearly every
    element bitwise equal, and eager calls equal jitted ones."""
    args, extra = _inputs(rng, 8, 64, 32, 8, "bfloat16", residual=True)
    kw = dict(top_k=3, **GROUPED)
    out = jc.moe_decode(**args, **extra, **kw, impl="cuda")
    ref = jc.moe_decode(**args, **extra, **kw, impl="reference")
    assert np.mean(np.asarray(out) == np.asarray(ref)) > 0.9
    np.testing.assert_array_equal(np.asarray(out), _run(dict(impl="cuda", **kw), args, extra))


def test_impl_values(rng):
    """"xla" runs no custom call; "cuda" and "auto" (float16 / bfloat16) run one, the shared
    experts in it; "reference" is the reference."""
    args, extra = _inputs(rng, 5, 64, 32, 8, "float16", shared=64, residual=True)
    names = list(args)
    for impl, calls, swiglu_calls in (("xla", 0, 0), ("cuda", 1, 0), ("auto", 1, 0), ("reference", 0, 0)):
        fn = jax.jit(lambda a, ex, impl=impl: jc.moe_decode(**dict(zip(names, a)), **ex, top_k=2, impl=impl))
        hlo = fn.lower(list(args.values()), extra).as_text()
        assert hlo.count("jax_cluster_moe_decode") == calls, impl
        assert hlo.count("jax_cluster_swiglu") == swiglu_calls, impl
    np.testing.assert_array_equal(np.asarray(jc.moe_decode(**args, **extra, top_k=2, impl="reference")),
                                  np.asarray(reference.moe_decode(**args, **extra, top_k=2)))


def test_shared_experts_swiglu_refuses_under_cuda(rng):
    """impl="cuda" with shared experts the call cannot take (Is = 36, not a multiple of 8)
    that swiglu has no kernel for either: an error naming moe_decode, why swiglu runs them,
    and swiglu's reason, before anything runs."""
    args, extra = _inputs(rng, 3, 64, 32, 8, "bfloat16", shared=36, residual=True)
    with pytest.raises(ValueError, match=r"moe_decode: the shared experts run through jax_cluster\.swiglu here "
                                         r".*swiglu: impl='cuda' has no kernel for D=64, F=36"):
        jax.eval_shape(lambda a, ex: jc.moe_decode(**a, **ex, top_k=2, impl="cuda"), args, extra)


def test_shared_and_residual_composition(rng):
    """y = swiglu(x, shared, residual = routed (+ residual)): the composition flax_models'
    MoE writes."""
    args, extra = _inputs(rng, 3, 64, 32, 8, "bfloat16", shared=64, residual=True)
    weights, ids = reference.moe_route(args["x"], args["router"], top_k=2)
    routed = reference.moe_experts(args["x"], weights, ids, args["w_gate"], args["w_up"], args["w_down"],
                                   extra["residual"])
    s = extra["shared"]
    expect = reference.swiglu(args["x"], s["w_gate"], s["w_up"], s["w_down"], routed)
    np.testing.assert_array_equal(np.asarray(reference.moe_decode(**args, **extra, top_k=2)), np.asarray(expect))
    for impl in ("cuda", "xla"):
        _check(jc.moe_decode(**args, **extra, top_k=2, impl=impl), expect, "bfloat16")


def test_float32_auto_falls_back_with_one_warning(rng):
    _ffi._warned.clear()
    args, _ = _inputs(rng, 3, 64, 32, 8, "float32")
    with pytest.warns(UserWarning, match=r"no kernel for this call \(dtype float32.*running impl='xla'"):
        out = jc.moe_decode(**args, top_k=2)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jc.moe_decode(**args, top_k=2, impl="xla")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.moe_decode(**args, top_k=2)  # once only


def test_unsupported_shape_falls_back(rng):
    _ffi._warned.clear()
    args, _ = _inputs(rng, 3, 60, 32, 8, "float16")  # H not a multiple of 8
    with pytest.warns(UserWarning, match=r"H \(60\) and I \(32\) must be positive multiples of 8\); running impl='xla'"):
        out = jc.moe_decode(**args, top_k=2)
    _check(out, jc.moe_decode(**args, top_k=2, impl="reference"), "float16")
    with pytest.raises(ValueError, match=r"impl='cuda' cannot run this call: H \(60\) and I \(32\)"):
        jc.moe_decode(**args, top_k=2, impl="cuda")


def test_empty_batch(rng):
    args, extra = _inputs(rng, 0, 64, 32, 8, "float16", shared=64, residual=True)
    for impl in ("auto", "cuda", "xla", "reference"):
        assert jc.moe_decode(**args, **extra, top_k=2, impl=impl).shape == (0, 64)


def test_vmap(rng):
    """vmap over x (and residual) folds the mapped axis into the rows (one custom call);
    mapped expert weights run one call per element."""
    args, extra = _inputs(rng, 4, 64, 32, 8, "bfloat16", shared=64)
    xs, res = _arr(rng, (3, 4, 64), "bfloat16"), _arr(rng, (3, 4, 64), "bfloat16")
    rest = {k: v for k, v in args.items() if k != "x"}
    fn = jax.vmap(lambda x, r: jc.moe_decode(x, **rest, **extra, top_k=3, residual=r, impl="cuda", **GROUPED))
    out = jax.jit(fn)(xs, res)
    hlo = jax.jit(fn).lower(xs, res).as_text()
    assert hlo.count("jax_cluster_moe_decode") == 1
    for b in range(3):
        ref = jc.moe_decode(xs[b], **rest, **extra, top_k=3, residual=res[b], impl="reference", **GROUPED)
        _check(out[b], ref, "bfloat16")
    # mapped axis not first
    out = jax.vmap(lambda x: jc.moe_decode(x, **rest, top_k=2, impl="cuda"), in_axes=1)(jnp.moveaxis(xs, 0, 1))
    for b in range(3):
        _check(out[b], jc.moe_decode(xs[b], **rest, top_k=2, impl="reference"), "bfloat16")
    # expert weights mapped: sequential calls
    wgs = jnp.stack([args["w_gate"], -args["w_gate"]])
    others = {k: v for k, v in args.items() if k != "w_gate"}
    out = jax.vmap(lambda w: jc.moe_decode(w_gate=w, **others, top_k=2, impl="cuda"))(wgs)
    for b in range(2):
        _check(out[b], jc.moe_decode(w_gate=wgs[b], **others, top_k=2, impl="reference"), "bfloat16")


# ---------------------------------------------------------------- moe_experts and ids
def test_moe_experts_given_routing(rng):
    """Caller-made routing: duplicate ids in a row and one expert chosen by every row (more
    pairs than a kernel pass holds) are summed like any other pair."""
    args, extra = _inputs(rng, 20, 64, 32, 8, "float16", residual=True)
    ids = jnp.asarray(np.stack([np.full(20, 3), rng.integers(0, 8, 20), np.full(20, 3)], 1), jnp.int32)
    weights = jnp.asarray(rng.random((20, 3)), jnp.float32)
    w = (args["w_gate"], args["w_up"], args["w_down"])
    ref = reference.moe_experts(args["x"], weights, ids, *w, extra["residual"])
    for impl in ("cuda", "xla", "auto"):
        _check(jc.ops.moe_decode.moe_experts(args["x"], weights, ids, *w, extra["residual"], impl=impl), ref, "float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_experts_with_shared_experts(rng, dtype):
    """moe_experts(shared=...) is moe_decode for the same routing: the shared experts in the
    call (the CPU handler, float32 too; widths 64 and 40), every impl against moe_decode's
    reference, and bitwise equal to moe_decode under "cuda"."""
    for width in (64, 40):
        args, extra = _inputs(rng, 3, 64, 32, 8, dtype, shared=width, residual=True)
        kw = dict(top_k=2, **GROUPED)
        # the router's custom call, as moe_decode(impl="cuda") routes (bitwise comparable below)
        weights, ids, _ = md._route(args["x"], args["router"], dict(top_k=2, norm_topk_prob=False,
                                                                    routed_scaling_factor=1.0, **GROUPED), "cuda")
        w = (args["w_gate"], args["w_up"], args["w_down"])
        ref = jc.moe_decode(**args, **extra, **kw, impl="reference")
        for impl in ("reference", "xla", "cuda"):
            out = jc.moe_experts(args["x"], weights, ids, *w, extra["residual"], shared=extra["shared"], impl=impl)
            _check(out, ref, dtype)
        fused = jc.moe_decode(**args, **extra, **kw, impl="cuda")
        out = jc.moe_experts(args["x"], weights, ids, *w, extra["residual"], shared=extra["shared"], impl="cuda")
        np.testing.assert_array_equal(np.asarray(out), np.asarray(fused))


def test_invalid_ids(rng):
    """Concrete ids outside [0, E) are rejected before anything runs; traced ones give an
    all-NaN row in every impl (the other rows are computed normally)."""
    args, _ = _inputs(rng, 4, 64, 32, 8, "float16")
    w = (args["w_gate"], args["w_up"], args["w_down"])
    weights = jnp.full((4, 2), 0.5, jnp.float32)
    for bad in (8, -1):
        ids = jnp.asarray([[0, 1], [2, bad], [3, 4], [5, 6]], jnp.int32)
        with pytest.raises(ValueError, match=r"ids must be in \[0, E=8\); got min"):
            md.moe_experts(args["x"], weights, ids, *w)
        good = jnp.asarray([[0, 1], [2, 7], [3, 4], [5, 6]], jnp.int32)
        ref = np.asarray(reference.moe_experts(args["x"], weights, good, *w))
        for impl in ("cuda", "xla", "reference"):
            out = np.asarray(jax.jit(lambda i, impl=impl: md.moe_experts(args["x"], weights, i, *w, impl=impl))(ids))
            assert np.isnan(out[1]).all(), impl
            rows = [0, 2, 3]
            _check(out[rows], ref[rows], "float16")


# ---------------------------------------------------------------- validation
def _bad_call(change: dict):
    rng = np.random.default_rng(0)
    args, extra = _inputs(rng, 3, 64, 32, 8, "float16", shared=64, residual=True)
    kw = dict(args, **extra, top_k=2)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change, error, message", [
    (dict(x=jnp.ones((3, 4, 64), jnp.float16)), ValueError, "x must be [N, H], got shape (3, 4, 64)"),
    (dict(x=jnp.ones((3, 64), jnp.int32)), ValueError, "x dtype must be float16, bfloat16 or float32, got int32"),
    (dict(router=jnp.ones((64, 7))), ValueError, "router must be [H, E] = (64, 8), got shape (64, 7)"),
    (dict(router=jnp.ones((64, 8), jnp.int32)), ValueError, "router must be a float array, got int32"),
    (dict(w_gate=jnp.ones((8, 32, 32), jnp.float16)), ValueError, "w_gate must be [E, H, I] with H = x.shape[1] = 64"),
    (dict(w_gate=jnp.ones((64, 32), jnp.float16)), ValueError, "w_gate must be [E, H, I]"),
    (dict(w_up=jnp.ones((8, 64, 16), jnp.float16)), ValueError, "w_up has shape (8, 64, 16), expected (8, 64, 32)"),
    (dict(w_down=jnp.ones((8, 64, 32), jnp.float16)), ValueError, "w_down has shape (8, 64, 32), expected (8, 32, 64)"),
    (dict(w_down=jnp.ones((8, 32, 64), jnp.bfloat16)), ValueError, "w_down has dtype bfloat16, expected float16"),
    (dict(residual=jnp.ones((2, 64), jnp.float16)), ValueError, "residual has shape (2, 64), expected (3, 64)"),
    (dict(top_k=0), ValueError, "top_k must be in 1..8, got 0"),
    (dict(top_k=9), ValueError, "top_k must be in 1..8, got 9"),
    (dict(top_k=2.0), TypeError, "top_k must be an int, got 2.0"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(topk_method="sigmoid"), ValueError,
     "topk_method must be one of ('greedy', 'group_limited_greedy', 'noaux_tc'), got 'sigmoid'"),
    (dict(topk_method="noaux_tc"), ValueError, "topk_method='noaux_tc' needs n_group and topk_group"),
    (dict(topk_method="noaux_tc", n_group=8, topk_group=2), ValueError,
     "noaux_tc scores a group by its two best experts: E / n_group (8 / 8) must be at least 2"),
    (dict(score_bias=jnp.zeros(8)), ValueError, "topk_method 'greedy' takes none"),
    (dict(topk_method="noaux_tc", n_group=2, topk_group=1, score_bias=jnp.zeros(7)), ValueError,
     "score_bias must be a float array [E] = (8,), got float32 (7,)"),
    (dict(topk_method="noaux_tc", n_group=2, topk_group=1, score_bias=jnp.zeros(8, jnp.int32)), ValueError,
     "score_bias must be a float array [E] = (8,), got int32 (8,)"),
    (dict(topk_method="group_limited_greedy"), ValueError, "needs n_group and topk_group"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), ValueError,
     "n_group (3) must divide the number of experts E (8)"),
    (dict(topk_method="group_limited_greedy", n_group=0, topk_group=1), ValueError, "n_group must be in 1..8, got 0"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), ValueError, "topk_group must be in 1..4, got 5"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=0), ValueError, "topk_group must be in 1..4, got 0"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, top_k=3), ValueError,
     "top_k (3) must be at most topk_group * E / n_group (2)"),
    (dict(norm_topk_prob="yes"), TypeError, "norm_topk_prob must be a bool"),
    (dict(routed_scaling_factor="2"), TypeError, "routed_scaling_factor must be a real number"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor must be finite"),
    (dict(shared=dict(w_gate=1)), ValueError, "shared must be None or a dict with keys 'w_gate', 'w_up', 'w_down'"),
    (dict(shared=(1, 2, 3)), ValueError, "shared must be None or a dict"),
    (dict(shared=dict(w_gate=jnp.ones((32, 64), jnp.float16), w_up=0, w_down=0)), ValueError,
     "shared['w_gate'] must be [H, Is] with H = 64"),
    (dict(shared=dict(w_gate=jnp.ones((64, 64), jnp.float16), w_up=jnp.ones((64, 32), jnp.float16),
                      w_down=jnp.ones((64, 64), jnp.float16))), ValueError,
     "shared['w_up'] has shape (64, 32), expected (64, 64)"),
    (dict(shared=dict(w_gate=jnp.ones((64, 64), jnp.float16), w_up=jnp.ones((64, 64), jnp.float16),
                      w_down=jnp.ones((64, 64), jnp.float32))), ValueError,
     "shared['w_down'] has dtype float32, expected float16"),
    (dict(impl="fast"), ValueError, "impl must be one of"),
    (dict(config="wide"), TypeError, "config must be a MoeDecodeConfig or None"),
    (dict(impl="xla", config=MoeDecodeConfig()), ValueError, "a config applies to impl='auto' or 'cuda', not 'xla'"),
])
def test_bad_arguments(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        jc.moe_decode(**_bad_call(change))


def test_bad_routing_arguments_of_moe_experts(rng):
    args, _ = _inputs(rng, 3, 64, 32, 8, "float16")
    w = (args["w_gate"], args["w_up"], args["w_down"])
    ids, weights = jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2), jnp.float32)
    cases = [((weights, ids.astype(jnp.int64) if jax.config.jax_enable_x64 else ids.astype(jnp.int16)),
              "ids must be int32 [N=3, k]"),
             ((weights, jnp.zeros((2, 2), jnp.int32)), "ids must be int32 [N=3, k]"),
             ((weights, jnp.zeros((3, 9), jnp.int32)), "ids must have 1..E=8 slots per row, got 9"),
             ((weights.astype(jnp.float16), ids), "weights has dtype float16, expected float32"),
             ((jnp.ones((3, 3), jnp.float32), ids), "weights has shape (3, 3), expected (3, 2)")]
    for (wt, i), message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            md.moe_experts(args["x"], wt, i, *w)


@pytest.mark.parametrize("fields, error, message", [
    (dict(cols_up=48), ValueError, "cols_up must be one of (32, 64, 128), got 48"),
    (dict(cols_down=256), ValueError, "cols_down must be one of (32, 64, 128), got 256"),
    (dict(cols_up=64.0), TypeError, "cols_up must be an int or None"),
    (dict(cols_down=True), TypeError, "cols_down must be an int or None"),
    (dict(pdl=1), TypeError, "pdl must be a bool"),
])
def test_config_validation(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MoeDecodeConfig(**fields)


def test_config_frozen_and_every_knob_runs(rng):
    cfg = MoeDecodeConfig(cols_up=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cols_up = 64
    assert {cfg: 1}[MoeDecodeConfig(cols_up=32)] == 1
    args, extra = _inputs(rng, 5, 64, 32, 8, "bfloat16", residual=True)
    ref = jc.moe_decode(**args, **extra, top_k=3, impl="reference")
    for c in (MoeDecodeConfig(cols_up=32, cols_down=128), MoeDecodeConfig(cols_up=128, pdl=False)):
        _check(jc.moe_decode(**args, **extra, top_k=3, impl="cuda", config=c), ref, "bfloat16")


def test_launch_plan():
    """The C++ plan: defaults, workspace (h in x's dtype, then fp32 expert outputs), limits."""
    plan = md.launch_plan(None, 16, 2048, 1408, 64, 6, "bfloat16")
    assert plan["error"] == "" and plan["cuda_error"] == ""
    assert (plan["cols_up"], plan["cols_down"]) == (128, 128)  # 16 rows: 64 grid rows of 11 / 16 tiles
    assert plan["workspace_bytes"] == 16 * 6 * 1408 * 2 + 16 * 6 * 2048 * 4
    # batch 1 (6 experts + 2 shared chunks): 11 x 8 and 16 x 8 blocks of 128 columns leave SMs idle
    plan = md.launch_plan(None, 1, 2048, 1408, 64, 6, "bfloat16", shared_width=2816)
    assert (plan["cols_up"], plan["cols_down"]) == (64, 64)
    # batch 4 (24 grid rows): 11 x 24 blocks of 128 fill the GPU
    assert md.launch_plan(None, 4, 2048, 1408, 64, 6, "bfloat16")["cols_up"] == 128
    assert "must be positive multiples of 8" in md.launch_plan(None, 1, 2044, 1408, 64, 6, "float16")["error"]
    assert "k (slots per row) must be in 1..E" in md.launch_plan(None, 1, 64, 64, 4, 6, "float16")["error"]
    assert "E must be in 1..65535" in md.launch_plan(None, 1, 64, 64, 70000, 6, "float16")["error"]
    assert "float16 or bfloat16" in md.launch_plan(None, 1, 64, 64, 8, 2, "float32")["cuda_error"]
    assert md.launch_plan(None, 1, 64, 64, 8, 2, "float32")["error"] == ""
    assert md.launch_plan(MoeDecodeConfig(cols_up=128, cols_down=32), 1, 64, 64, 8, 2, "float16")["cols_up"] == 128


# ---------------------------------------------------------------- tuning
def test_tuner_candidates_key_and_measure():
    """The tilings, XLA's gather and the grouped ragged_dot are measured; the key buckets N to
    powers of two; the measurement runs every candidate (the kernels through the CPU handler)
    on a random routing."""
    cands = md.candidates()
    assert cands[-2:] == ["xla", "ragged_dot"] and len(cands) == 6
    assert all(isinstance(c, MoeDecodeConfig) for c in cands[:-2])
    assert md.candidates(grouped=False) == cands[:-1]
    # ragged_dot reads every expert: timed only where the rows can choose them all
    assert md._grouped_is_a_candidate(3, 2, 8) and not md._grouped_is_a_candidate(1, 6, 64)
    assert md.tuning_key(3, 64, 32, 8, 2, 0, jnp.bfloat16) == md.tuning_key(4, 64, 32, 8, 2, 0, jnp.bfloat16)
    assert md.tuning_key(5, 64, 32, 8, 2, 0, jnp.bfloat16) != md.tuning_key(4, 64, 32, 8, 2, 0, jnp.bfloat16)
    assert md.tuning_key(1, 64, 32, 8, 2, 64, jnp.bfloat16).startswith(f"v{md.KERNEL_VERSION} ")
    for choice in (cands[0], "xla", "ragged_dot"):
        assert 0 < md.measure(choice, n=2, h=64, i=32, e=8, k=2, i_s=64, dtype=jnp.bfloat16, calls=2) < 1
    assert md.autotune(1, 64, 32, 8, 2, jnp.bfloat16) == MoeDecodeConfig()  # on CPU: nothing to tune


def test_tuner_picks_caches_and_runs_the_winner(rng, tmp_path, monkeypatch):
    """With (fake) GPU timings, impl="auto" runs the fastest candidate, stores it under the op's
    key and a fresh process reads it back without measuring; "xla" as the winner runs the
    gather formulation (the winner's result checked through the CPU handler)."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "1")
    monkeypatch.setattr(md, "on_gpu", lambda: True)
    measured = []
    fast = MoeDecodeConfig(cols_up=128, cols_down=64)
    monkeypatch.setattr(md, "measure", lambda c, **shape: measured.append(c) or (1e-4 if c == fast else 2e-4))
    args, extra = _inputs(rng, 3, 64, 32, 8, "bfloat16", shared=64, residual=True)
    kw = dict(top_k=2)
    ref = _run(dict(impl="reference", **kw), args, extra, _cpu())
    _check(_run(dict(impl="auto", **kw), args, extra, _cpu()), ref, "bfloat16")
    assert set(measured) == set(md.candidates())
    key = md.tuning_key(3, 64, 32, 8, 2, 64, jnp.bfloat16)
    entry = json.loads((tmp_path / "tuning.json").read_text())["entries"]["moe_decode|" + key]
    assert entry["winner"] == jc.tuning.encode(fast)
    jc.tuning.clear_memory_cache()  # a new process: reads the file, measures nothing
    measured.clear()
    assert md.autotune(4, 64, 32, 8, 2, jnp.bfloat16, shared_width=64) == fast and not measured
    monkeypatch.setattr(md, "measure", lambda c, **shape: 1e-5 if c == "xla" else 1e-4)
    names = list(args)
    hlo = jax.jit(lambda a: jc.moe_decode(**dict(zip(names, a)), top_k=2)).lower(list(args.values())).as_text()
    assert "jax_cluster_moe_decode" not in hlo  # 3 rows, no shared experts: a new key, xla won
    assert md.autotune(3, 64, 32, 8, 2, jnp.bfloat16) == "xla"


def test_tuner_can_pick_the_grouped_ragged_dot_form(rng, tmp_path, monkeypatch):
    """Where jax.lax.ragged_dot measures fastest, impl="auto" runs that formulation: no custom
    call for the experts, the result the reference's (shared experts and residual added)."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "1")
    monkeypatch.setattr(md, "on_gpu", lambda: True)
    monkeypatch.setattr(md, "measure", lambda c, **shape: 1e-5 if c == "ragged_dot" else 1e-4)
    ran = []
    for name, form in list(md._XLA_FORMS.items()):
        monkeypatch.setitem(md._XLA_FORMS, name, lambda *a, name=name, form=form: ran.append(name) or form(*a))
    args, extra = _inputs(rng, 24, 64, 32, 8, "bfloat16", shared=64, residual=True)
    kw = dict(top_k=3)
    names = list(args)
    hlo = jax.jit(lambda a, ex: jc.moe_decode(**dict(zip(names, a)), **ex, **kw)).lower(
        list(args.values()), extra).as_text()
    assert "jax_cluster_moe_decode" not in hlo and ran == ["ragged_dot"]
    assert md.autotune(24, 64, 32, 8, 3, jnp.bfloat16) == "ragged_dot"
    ref = _run(dict(impl="reference", **kw), args, extra, _cpu())
    _check(_run(dict(impl="auto", **kw), args, extra, _cpu()), ref, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_form_matches_the_gather_form(rng, dtype):
    """The ragged_dot formulation against the reference and the gather form: duplicate ids in
    a row, an expert chosen by every row, an expert nobody chose, a residual; traced ids
    outside [0, E) give an all-NaN row, the others computed normally; no rows at all."""
    args, extra = _inputs(rng, 20, 64, 32, 8, dtype, residual=True)
    ids = jnp.asarray(np.stack([np.full(20, 3), rng.integers(0, 7, 20), np.full(20, 3)], 1), jnp.int32)
    weights = jnp.asarray(rng.random((20, 3)), jnp.float32)
    w = (args["w_gate"], args["w_up"], args["w_down"])
    ref = np.asarray(reference.moe_experts(args["x"], weights, ids, *w, extra["residual"]))
    grouped = np.asarray(jax.jit(md._grouped_experts)(args["x"], weights, ids, *w, extra["residual"]))
    _check(grouped, ref, dtype)
    _check(grouped, np.asarray(md._xla_experts(args["x"], weights, ids, *w, extra["residual"])), dtype)
    bad = ids.at[5, 1].set(8).at[9, 0].set(-1)
    out = np.asarray(jax.jit(md._grouped_experts)(args["x"], weights, bad, *w, None))
    assert np.isnan(out[5]).all() and np.isnan(out[9]).all()
    rows = [r for r in range(20) if r not in (5, 9)]
    _check(out[rows], np.asarray(reference.moe_experts(args["x"], weights, ids, *w))[rows], dtype)
    assert md._grouped_experts(args["x"][:0], weights[:0], ids[:0], *w, None).shape == (0, 64)


def test_ffi_validation_errors():
    """The C++ decoder rejects malformed calls (the last line of defence behind the wrapper)."""
    x = jnp.ones((2, 64), jnp.float16)
    wg, wd = jnp.ones((8, 64, 32), jnp.float16), jnp.ones((8, 32, 64), jnp.float16)
    weights, ids = jnp.ones((2, 2), jnp.float32), jnp.zeros((2, 2), jnp.int32)
    empty = jnp.zeros((0,), jnp.float16)
    good = dict(cols_up=64, cols_down=64, pdl=True, has_residual=False)
    cases = [(dict(cols_up=48), "cols_up must be 32, 64 or 128, got 48"),
             (dict(cols_down=0), "cols_down must be 32, 64 or 128, got 0"),
             (dict(has_residual=True), "residual must be [N, H] of x's dtype")]
    for change, message in cases:
        with pytest.raises(Exception, match=re.escape(message)):
            jax.jit(lambda *a: md._PRIM.bind(*a, **{**good, **change})[0])(
                x, weights, ids, wg, wg, wd, empty, empty, empty, empty).block_until_ready()
    with pytest.raises(Exception, match=re.escape("ids must be int32 [N, k]")):
        jax.jit(lambda *a: md._PRIM.bind(*a, **good)[0])(
            x, weights, ids.astype(jnp.float32), wg, wg, wd, empty, empty, empty, empty).block_until_ready()
    with pytest.raises(Exception, match=re.escape("k (slots per row) must be in 1..E")):
        w9, i9 = jnp.ones((2, 9), jnp.float32), jnp.zeros((2, 9), jnp.int32)
        jax.jit(lambda *a: md._PRIM.bind(*a, **good)[0])(
            x, w9, i9, wg, wg, wd, empty, empty, empty, empty).block_until_ready()
    sg, sd = jnp.ones((64, 40), jnp.float16), jnp.ones((40, 64), jnp.float16)
    for shared, message in (((empty, sg, sd), "given together or not at all"),
                            ((sg, sg[:, :32], sd), "s_up must have s_gate's shape [H, Is]"),
                            ((sg, sg, sd[:, :32]), "s_down must be [Is, H]"),
                            ((sg[:, :36], sg[:, :36], sd[:36]), "must be a multiple of 8")):
        with pytest.raises(Exception, match=re.escape(message)):
            jax.jit(lambda *a: md._PRIM.bind(*a, **good)[0])(
                x, weights, ids, wg, wg, wd, *shared, empty).block_until_ready()


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


def _ref_experts(args, extra, weights, ids):
    """The reference (on the CPU) of the routed experts for given routing, then the shared
    experts: what moe_decode computes."""
    def fn(x, wg, wu, wd, weights, ids, shared, residual):
        y = reference.moe_experts(x, weights, ids, wg, wu, wd, residual)
        if shared is not None:
            y = reference.swiglu(x, shared["w_gate"], shared["w_up"], shared["w_down"], y)
        return y

    return np.asarray(on_cpu(fn)(args["x"], args["w_gate"], args["w_up"], args["w_down"], weights, ids,
                                 extra.get("shared"), extra.get("residual")))


def _route_on_gpu(args, kw):
    route = {k: v for k, v in kw.items() if k in ("top_k", "topk_method", "n_group", "topk_group",
                                                  "norm_topk_prob", "routed_scaling_factor", "score_bias")}
    return jax.jit(lambda x, r: reference.moe_route(x, r, **route))(*jax.device_put((args["x"], args["router"]), _gpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("shared, residual", [(None, False), (128, True), (None, True), (128, False)], ids=str)
def test_gpu_vs_reference(rng, dtype, method, shared, residual):
    """The CUDA kernels against the reference: N in {1, 3, 16, 64}, I not a multiple of the
    column tiles (192), E = 16, k = 4 (group-limited, noaux_tc: 4 groups, 2 kept)."""
    for n in (1, 3, 16, 64):
        args, extra = _inputs(rng, n, 256, 192, 16, dtype, shared=shared, residual=residual)
        kw = dict(top_k=4, norm_topk_prob=n % 2 == 1, routed_scaling_factor=1.0 if n % 2 else 16.0,
                  **_routing(method, 16, n))
        weights, ids = _route_on_gpu(args, kw)
        ref = _ref_experts(args, extra, weights, ids)
        _check(_run(dict(impl="cuda", **kw), args, extra, _gpu()), ref, dtype)
        _check(_run(dict(impl="auto", **kw), args, extra, _gpu()), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [dict(cols_up=32, cols_down=32), dict(cols_up=64, cols_down=128),
                                    dict(cols_up=128, cols_down=64), dict(cols_up=128, cols_down=128),
                                    dict(pdl=False)], ids=str)
def test_gpu_configs_and_awkward_shapes(rng, dtype, config):
    """Every column tile on H, I multiples of 8 only (tile remainders of 8 columns), one
    expert (k = E = 1), more rows than a pass holds (N = 9, 70: several passes per expert),
    shared experts in the call (up to 8 rows) narrower than I, wider with a narrower last
    chunk, or several chunks (10: more than the combine loads at once), past 8 rows where
    swiglu's kernels cannot take H (136: the call keeps them), duplicate ids through
    moe_experts."""
    cfg = MoeDecodeConfig(**config)
    for n, h, i, e, k, shared in ((1, 136, 72, 4, 2, 200), (9, 264, 200, 1, 1, None), (5, 264, 200, 1, 1, 8),
                                  (70, 136, 72, 4, 3, None), (8, 136, 72, 4, 3, 144), (3, 64, 8, 6, 6, 40),
                                  (2, 64, 8, 6, 2, 80), (13, 136, 72, 4, 3, 200)):
        args, extra = _inputs(rng, n, h, i, e, dtype, shared=shared, residual=n % 2 == 1)
        kw = dict(top_k=k)
        weights, ids = _route_on_gpu(args, kw)
        ref = _ref_experts(args, extra, weights, ids)
        _check(_run(dict(impl="cuda", config=cfg, **kw), args, extra, _gpu()), ref, dtype)
    args, extra = _inputs(rng, 20, 136, 72, 4, dtype, residual=True)
    ids = jnp.asarray(np.stack([np.full(20, 3), rng.integers(0, 4, 20), np.full(20, 3)], 1), jnp.int32)
    weights = jnp.asarray(rng.random((20, 3)), jnp.float32)
    w = (args["w_gate"], args["w_up"], args["w_down"])
    out = jax.jit(lambda *a: md.moe_experts(*a, impl="cuda", config=cfg))(
        *jax.device_put((args["x"], weights, ids, *w, extra["residual"]), _gpu()))
    _check(out, _ref_experts(args, extra, weights, ids), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_deepseek_shapes(dtype):
    """DeepSeek-V2-Lite (H 2048, I 1408, E 64, k 6, 2 shared experts: Is 2816, greedy) at
    N = 1, 16, 64 and DeepSeek-V2 (H 5120, I 1536, E 160, k 6, group-limited 8 / 3) at N = 1,
    16, and DeepSeek-V3's router (H 7168, E 256, k 8, noaux_tc 8 / 4, normalised) over narrow
    experts (I 256) at N = 1, 8. Weights made on the GPU; the reference runs there too, under jit."""
    key = jax.random.key(0)
    v3 = _routing(dict(topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True), 256)
    for (h, i, e, k, shared, method, ns) in ((2048, 1408, 64, 6, 2816, GREEDY, (1, 16, 64)),
                                             (5120, 1536, 160, 6, None, dict(topk_method="group_limited_greedy",
                                                                            n_group=8, topk_group=3), (1, 16)),
                                             (7168, 256, 256, 8, 256, v3, (1, 8))):
        with jax.default_device(_gpu()):
            ks = jax.random.split(key, 9)
            f = lambda kk, shape, scale: (jax.random.normal(kk, shape, jnp.float32) * scale).astype(dtype)  # noqa: E731
            args = dict(router=f(ks[1], (h, e), h ** -0.5), w_gate=f(ks[2], (e, h, i), h ** -0.5),
                        w_up=f(ks[3], (e, h, i), h ** -0.5), w_down=f(ks[4], (e, i, h), i ** -0.5))
            extra = {}
            if shared:
                extra["shared"] = dict(w_gate=f(ks[5], (h, shared), h ** -0.5), w_up=f(ks[6], (h, shared), h ** -0.5),
                                       w_down=f(ks[7], (shared, h), shared ** -0.5))
            kw = dict(top_k=k, routed_scaling_factor=1.0 if shared else 16.0, **method)
            for n in ns:
                x = f(jax.random.fold_in(ks[0], n), (n, h), 1.0)
                ex = dict(extra, residual=f(ks[8], (n, h), 1.0)[:n])
                ref = jax.jit(lambda x, a, ex: reference.moe_decode(x, **a, **ex, **kw))(x, args, ex)
                out = jax.jit(lambda x, a, ex: jc.moe_decode(x, **a, **ex, **kw, impl="cuda"))(x, args, ex)
                _check(out, ref, dtype)
            del args, extra


@pytest.mark.gpu
@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_gpu_router_kernel(rng, route):
    """The router kernels pick XLA's experts and weights: N = 1, 3, 8 (their most rows; more
    route in XLA), E = 64 (V2-Lite), 160 (V2, H 5120: many K chunks), 256 (V3, H 7168) and 512
    (the most, at 8 rows: the largest shared memory), router bfloat16, float16 and float32,
    read as 16-byte vectors and (E 20 in bfloat16: rows off the 16-byte grid) one element at
    a time; with and without the norm in them (H 200: a K chunk off the 16-byte row loads'
    grid)."""
    for n, h, e, dtype, rdtype in ((1, 2048, 64, "bfloat16", "bfloat16"), (8, 2048, 64, "float16", "float32"),
                                   (8, 5120, 160, "bfloat16", "bfloat16"), (3, 64, 8, "bfloat16", "float32"),
                                   (1, 7168, 256, "bfloat16", "float32"), (5, 7168, 256, "bfloat16", "bfloat16"),
                                   (8, 1024, 512, "bfloat16", "float32"), (2, 200, 24, "float16", "float16"),
                                   (16, 256, 16, "bfloat16", "bfloat16"), (3, 200, 20, "bfloat16", "bfloat16"),
                                   (5, 136, 12, "float16", "float32")):
        groups = route.get("n_group", 1)
        if route["top_k"] > e or e % groups or route["top_k"] > route.get("topk_group", 1) * e // groups:
            continue  # not a routing of this E
        x, router = _arr(rng, (n, h), dtype), _arr(rng, (h, e), rdtype, h ** -0.5)
        (w, i), (rw, ri) = _route_both(x, router, _gpu(), **route)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_allclose(w, rw, rtol=3e-5, atol=1e-7)  # logits summed in another order (H up to 5120)
        # with the norm in the kernels: h as jnp rounds it, and routed (x scaled: the norm undoes it)
        norm = _arr(rng, (h,), dtype, 0.5) + 1
        (w, i), (rw, ri), (hn, href) = _route_both(x * 3, router, _gpu(), norm, **route)
        _check_normed(hn, href, dtype)
        np.testing.assert_array_equal(i, ri)
        np.testing.assert_allclose(w, rw, rtol=3e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 16, 64])
def test_gpu_deterministic(rng, dtype, n):
    """Bitwise equal outputs over 5 calls (no float atomics; fixed summation orders)."""
    args, extra = _inputs(rng, n, 1024, 704, 32, dtype, shared=512, residual=True)
    args, extra = jax.device_put((args, extra), _gpu())
    names = list(args)
    fn = jax.jit(lambda a, ex: jc.moe_decode(**dict(zip(names, a)), **ex, top_k=6, impl="cuda", **GROUPED))
    first = np.asarray(fn(list(args.values()), extra))
    for _ in range(4):
        np.testing.assert_array_equal(np.asarray(fn(list(args.values()), extra)), first)


@pytest.mark.gpu
def test_gpu_auto_tunes_once_and_caches(rng, tmp_path, monkeypatch):
    """On the GPU "auto" measures every candidate once for a new shape (while tracing), runs
    the winner and caches it; a fresh process reads the file and measures nothing."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "1")
    args, extra = _inputs(rng, 2, 512, 256, 16, "bfloat16", shared=256, residual=True)
    kw = dict(top_k=4, **_routing(NOAUX, 16))
    weights, ids = _route_on_gpu(args, kw)
    _check(_run(dict(impl="auto", **kw), args, extra, _gpu()), _ref_experts(args, extra, weights, ids), "bfloat16")
    key = "moe_decode|" + md.tuning_key(2, 512, 256, 16, 4, 256, jnp.bfloat16)
    entry = json.loads((tmp_path / "tuning.json").read_text())["entries"][key]
    assert entry["winner"] in [jc.tuning.encode(c) for c in md.candidates()]
    # every candidate measured (not ragged_dot: 2 rows x 4 slots cannot choose all 16 experts)
    assert len(entry["times_us"]) == len(md.candidates(grouped=False))
    calls = []
    monkeypatch.setattr(md, "measure", lambda *a, **k: calls.append(a) or 1.0)
    jc.tuning.clear_memory_cache()
    assert jc.tuning.encode(md.autotune(2, 512, 256, 16, 4, jnp.bfloat16, shared_width=256)) == entry["winner"]
    assert not calls


@pytest.mark.gpu
def test_gpu_invalid_ids_give_nan_rows(rng):
    args, extra = _inputs(rng, 4, 128, 64, 8, "bfloat16", residual=True)
    w = (args["w_gate"], args["w_up"], args["w_down"])
    weights = jnp.full((4, 2), 0.5, jnp.float32)
    ids = jnp.asarray([[0, 1], [2, 8], [3, -4], [5, 6]], jnp.int32)
    fn = jax.jit(lambda *a: md.moe_experts(*a, impl="cuda"))
    out = np.asarray(fn(*jax.device_put((args["x"], weights, ids, *w, extra["residual"]), _gpu())))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    ref = _ref_experts(args, extra, weights, ids)
    _check(out[[0, 3]], ref[[0, 3]], "bfloat16")


@pytest.mark.gpu
def test_gpu_vmap_and_chained_layers(rng):
    """vmap folds into one call; two layers chained inside one jit (the second's input is
    the first's output: PDL edges between calls)."""
    args, extra = _inputs(rng, 4, 256, 192, 16, "float16", shared=128)
    xs = _arr(rng, (3, 4, 256), "float16")
    rest = {k: v for k, v in args.items() if k != "x"}
    fn = jax.jit(jax.vmap(lambda x: jc.moe_decode(x, **rest, **extra, top_k=4, impl="cuda")))
    out = np.asarray(fn(jax.device_put(xs, _gpu())))
    for b in range(3):
        weights, ids = _route_on_gpu(dict(args, x=xs[b]), dict(top_k=4))
        _check(out[b], _ref_experts(dict(args, x=xs[b]), extra, weights, ids), "float16")
    two = jax.jit(lambda x: jc.moe_decode(jc.moe_decode(x, **rest, top_k=4, residual=x, impl="cuda"), **rest,
                                          top_k=4, impl="cuda"))
    y = np.asarray(two(jax.device_put(args["x"], _gpu())))
    ref = jc.moe_decode(jc.moe_decode(args["x"], **rest, top_k=4, residual=args["x"], impl="reference"), **rest,
                        top_k=4, impl="reference")
    _check(y, ref, "float16", factor=2.0)


@pytest.mark.gpu
def test_gpu_grouped_form_and_its_timing(rng):
    """The ragged_dot candidate on the GPU: its output against the reference (an expert
    nobody chose, duplicates), and the tuner's measurement of it (all E experts held)."""
    args, extra = _inputs(rng, 8, 256, 128, 16, "bfloat16", residual=True)
    ids = jnp.asarray(np.stack([rng.integers(0, 15, 8), np.full(8, 3)], 1), jnp.int32)
    weights = jnp.asarray(rng.random((8, 2)), jnp.float32)
    w = [jax.device_put(args[k], _gpu()) for k in ("w_gate", "w_up", "w_down")]
    x, res = jax.device_put((args["x"], extra["residual"]), _gpu())
    out = jax.jit(md._grouped_experts)(x, jax.device_put(weights, _gpu()), jax.device_put(ids, _gpu()), *w, res)
    ref = reference.moe_experts(args["x"], weights, ids, args["w_gate"], args["w_up"], args["w_down"],
                                extra["residual"])
    _check(np.asarray(out), np.asarray(ref), "bfloat16")
    assert md._grouped_is_a_candidate(8, 2, 16)
    assert 0 < md.measure("ragged_dot", n=8, h=256, i=128, e=16, k=2, i_s=128, dtype=jnp.bfloat16, calls=2) < 1
