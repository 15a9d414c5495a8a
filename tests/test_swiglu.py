"""swiglu vs the jnp reference: CPU handler always (every config passes through the same
C++ plan and validation), CUDA kernels on a GPU (every variant, dtype, M in
{1, 3, 8, 16, 33, 64, 128}, non-square (D, F), F not a multiple of 128, D not a multiple
of the 256-column down tile, cluster sizes, determinism), tensor parallelism on 8 fake
CPU devices, SwigluConfig validation, the impl values, the tuner's JSON round trip,
errors and fallbacks."""

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
from jax_cluster import _ffi, reference, tuning
from jax_cluster.ops import swiglu as sw
from jax_cluster.ops.swiglu import SwigluConfig
from jax_cluster.testing import TOLERANCE, on_cpu, rel_l2

DTYPES = ["float16", "bfloat16"]
MS = [1, 3, 8, 16, 33, 64, 128]
# (name, swiglu keyword arguments): every implementation and variant
CHOICES = [
    ("tma", dict(impl="cuda", config=SwigluConfig())),
    ("tma_down_xla", dict(impl="cuda", config=SwigluConfig(down="xla"))),
    ("gemv", dict(impl="cuda", config=SwigluConfig(variant="gemv"))),
    ("gemv_down_xla", dict(impl="cuda", config=SwigluConfig(variant="gemv", down="xla"))),
    ("fused", dict(impl="cuda", config=SwigluConfig(variant="fused"))),
    ("fused_rt1", dict(impl="cuda", config=SwigluConfig(variant="fused", row_tiles=1))),
    ("xla", dict(impl="xla")),
    ("reference", dict(impl="reference")),
]
CHOICE_IDS = [name for name, _ in CHOICES]
CHOICE_KW = [kw for _, kw in CHOICES]
# non-square, F = 21 * 64 (not a multiple of 128), D = 320 (down tile of 64 valid columns)
SHAPES = [(256, 512), (320, 1344), (512, 192)]


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch, tmp_path):
    """Tests never write the user's tuning cache."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    jc.tuning.clear_memory_cache()
    yield
    jc.tuning.clear_memory_cache()


def _inputs(rng, m, d, f, dtype, *, residual=True, down=True, lead=None):
    lead = (m,) if lead is None else lead
    x = jnp.asarray(rng.standard_normal(lead + (d,)), dtype)
    wg = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
    wu = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), dtype)
    wd = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), dtype) if down else None
    res = jnp.asarray(rng.standard_normal(lead + (d,)), dtype) if residual and down else None
    return x, wg, wu, wd, res


def _run(device, kwargs, x, wg, wu, wd, res):
    args = [jax.device_put(a, device) if a is not None else None for a in (x, wg, wu, wd, res)]
    fn = jax.jit(lambda x, wg, wu, wd, res: jc.swiglu(x, wg, wu, wd, res, **kwargs))
    return np.asarray(fn(*args))


def _cuda(**config):
    return dict(impl="cuda", config=SwigluConfig(**config))


# eager on a GPU the fp32 reference compiles and autotunes a GEMM per shape (minutes)
_reference_on_cpu = on_cpu(reference.swiglu)


def _check(out, x, wg, wu, wd, res):
    ref = np.asarray(_reference_on_cpu(x, wg, wu, wd, res))
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = rel_l2(out, ref)
    assert err <= TOLERANCE[jnp.dtype(x.dtype).name], err
    return err


def _cpu():
    return jax.devices("cpu")[0]


# ---------------------------------------------------------------- the reference itself
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_float64_math(rng, dtype):
    """The jnp reference against an independent float64 numpy computation of the same
    definition (A2 rounded to the activation dtype, one rounding of y)."""
    np_dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    x, wg, wu, wd, res = _inputs(rng, 5, 128, 192, dtype)
    f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    g, u = f64(x) @ f64(wg), f64(x) @ f64(wu)
    a2 = (g / (1 + np.exp(-g)) * u).astype(np_dtype)
    y = (f64(a2) @ f64(wd) + f64(res)).astype(np_dtype)
    assert rel_l2(np.asarray(reference.swiglu(x, wg, wu)), a2.astype(np.float64)) < 1e-3
    assert rel_l2(np.asarray(reference.swiglu(x, wg, wu, wd, res)), y.astype(np.float64)) < 2e-3


# ---------------------------------------------------------------- CPU handler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", [dict(impl="auto")] + CHOICE_KW, ids=["auto"] + CHOICE_IDS)
def test_cpu(rng, dtype, kwargs):
    for d, f in SHAPES:
        for m in (1, 16, 33):
            inputs = _inputs(rng, m, d, f, dtype, residual=m != 16)
            _check(_run(_cpu(), kwargs, *inputs), *inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_all_m_and_up_only(rng, dtype):
    for m in MS:
        inputs = _inputs(rng, m, 128, 320, dtype)
        _check(_run(_cpu(), dict(impl="auto"), *inputs), *inputs)
        up = _inputs(rng, m, 128, 320, dtype, down=False)
        _check(_run(_cpu(), _cuda(), *up), *up)
        _check(_run(_cpu(), _cuda(variant="gemv"), *up), *up)


def test_cpu_handler_close_to_reference_bitwise_mostly(rng):
    """Same math, different summation order: nearly every element identical."""
    inputs = _inputs(rng, 8, 256, 512, "float16")
    out = _run(_cpu(), _cuda(), *inputs)
    ref = np.asarray(reference.swiglu(*inputs))
    assert np.mean(out == ref) > 0.9


@pytest.mark.parametrize(
    "config", [dict(variant="fused", cluster_size=1, clusters=1),
               dict(variant="fused", cluster_size=2, f_group=1),
               dict(variant="fused", cluster_size=16, f_group=3, row_tiles=4),
               dict(variant="fused", clusters=2), dict(variant="fused", f_group=64),
               dict(variant="fused", cluster_size=4, row_tiles=1),
               dict(variant="gemv", k_splits_up=1, k_splits_down=1),
               dict(variant="gemv", k_splits_up=3, k_splits_down=5), dict(variant="gemv", k_splits_up=4),
               dict(row_tiles=1), dict(row_tiles=4, blocks=7), dict(blocks=2000, pdl=False)],
    ids=str)
def test_cpu_knobs_pass_validation(rng, config):
    """Every knob combination yields a launch the C++ decoder accepts."""
    for d, f in ((1024, 1024), (256, 192)):
        inputs = _inputs(rng, 33, d, f, "bfloat16")
        _check(_run(_cpu(), _cuda(**config), *inputs), *inputs)


def test_configs_valid_for_many_shapes():
    """The launch plan of every config is accepted by the kernels' checks for any shape (the
    fused kernel may not fit shared memory: then a ValueError says so), and its defaults
    are what the kernels were measured with."""
    configs = [SwigluConfig(), SwigluConfig(row_tiles=1), SwigluConfig(variant="gemv"),
               SwigluConfig(variant="fused"), SwigluConfig(variant="fused", cluster_size=16),
               SwigluConfig(variant="fused", cluster_size=4), SwigluConfig(variant="fused", row_tiles=1)]
    for d in (64, 128, 192, 1024, 4096, 8192, 16384):
        for f in (64, 192, 1344, 7168, 11008, 14336, 28672):
            for m in (1, 2, 5, 16, 17, 33, 64, 65, 300):
                for cfg in configs:
                    rows = min(m, sw._max_rows(cfg.variant) or m)
                    for down in (True, False):
                        if cfg.variant == "fused" and not down:
                            continue
                        try:
                            plan = sw.launch_plan(cfg, rows, d, f, "float16", has_down=down)
                        except ValueError as exc:
                            assert cfg.variant == "fused" and "shared memory" in str(exc), (cfg, d, f, m, exc)
                            continue
                        assert plan["workspace_bytes"] >= 0
                        if cfg.variant == "gemv":
                            row_bytes = (8 if rows <= 8 else 16) * 2
                            checks = [(d, plan["k_splits_up"])] + ([(f, plan["k_splits_down"])] if down else [])
                            for k, splits in checks:
                                assert 1 <= splits <= k // 16
                                assert -(-(-(-k // splits)) // 16) * 16 * row_bytes <= 64 * 1024
                            assert plan["pdl"]
                        elif cfg.variant == "tma":
                            assert plan["blocks"] == 132 and plan["pdl"]
                            default = 1 if min(m, 64) <= 16 else 2 if min(m, 64) <= 32 else 4
                            assert plan["row_tiles"] == (cfg.row_tiles or default)
                        else:
                            assert 1 <= plan["clusters"] <= f // 64
                            assert plan["cluster_size"] in sw.CLUSTER_SIZES
                            assert plan["cluster_size"] <= d // 64
                            assert plan["row_tiles"] in (1, 2, 4) and not plan["pdl"]


def test_fused_cluster_count_balances_tiles():
    plan = sw.launch_plan(SwigluConfig(variant="fused"), 1, 4096, 11008, "float16")  # 172 F tiles
    tiles = 11008 // 64
    per = -(-tiles // plan["clusters"])
    assert per * plan["clusters"] - tiles < per  # no cluster idle
    assert plan["clusters"] <= 2 * 132 // plan["cluster_size"]


def test_leading_dims_and_empty(rng):
    x, wg, wu, wd, res = _inputs(rng, 0, 128, 192, "float16", lead=(2, 3))
    out = jc.swiglu(x, wg, wu, wd, res)
    assert out.shape == (2, 3, 128)
    _check(np.asarray(out), x, wg, wu, wd, res)
    assert jc.swiglu(x, wg, wu).shape == (2, 3, 192)
    empty = jnp.zeros((0, 128), jnp.float16)
    assert jc.swiglu(empty, wg, wu, wd).shape == (0, 128)
    assert jc.swiglu(empty, wg, wu, wd, impl="xla").shape == (0, 128)


def test_vmap(rng):
    x, wg, wu, wd, res = _inputs(rng, 4, 128, 192, "bfloat16", lead=(3, 4))
    out = jax.vmap(lambda x, r: jc.swiglu(x, wg, wu, wd, r))(x, res)  # folded into M
    _check(np.asarray(out), x, wg, wu, wd, res)
    wgs = jnp.stack([wg, -wg])  # weights mapped: sequential map
    out = jax.vmap(lambda w: jc.swiglu(x[0], w, wu, wd))(wgs)
    for i in range(2):
        _check(np.asarray(out[i]), x[0], wgs[i], wu, wd, None)
    out = jax.vmap(lambda x: jc.swiglu(x, wg, wu), in_axes=1)(x)  # mapped axis not first
    assert out.shape == (4, 3, 192)
    _check(np.asarray(out), jnp.moveaxis(x, 1, 0), wg, wu, None, None)
    # gemv within its row limit per call: the batch is mapped, not folded past 16 rows
    x8 = jnp.concatenate([x] * 2, axis=1)  # [3, 8, 128]: 24 rows folded
    res8 = jnp.concatenate([res] * 2, axis=1)
    out = jax.vmap(lambda x, r: jc.swiglu(x, wg, wu, wd, r, **_cuda(variant="gemv")))(x8, res8)
    _check(np.asarray(out), x8, wg, wu, wd, res8)


def test_large_m_chunks(rng):
    """The fused variant runs M > 64 in 64-row chunks (bounded workspace), gemv M > 16 in
    16-row chunks."""
    inputs = _inputs(rng, 150, 128, 192, "float16")
    for config, calls in ((SwigluConfig(variant="fused"), 3), (SwigluConfig(variant="gemv"), 10)):
        _check(_run(_cpu(), dict(impl="cuda", config=config), *inputs), *inputs)
        hlo = jax.jit(lambda *a, c=config: jc.swiglu(*a, impl="cuda", config=c)).lower(*inputs).as_text()
        assert hlo.count("jax_cluster_swiglu") == calls


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(x=(4, 128), wg=(128, 192), wu=(128, 256)), r"w_up has shape \(128, 256\), expected \(128, 192\)"),
        (dict(x=(4, 128), wg=(64, 192), wu=(64, 192)), r"w_gate must be \[D, F\] with D = x.shape\[-1\] = 128"),
        (dict(x=(4, 128), wg=(128, 192), wu=(128, 192), wd=(128, 192)), r"w_down has shape \(128, 192\), expected \(192, 128\)"),
        (dict(x=(4, 128), wg=(128, 192), wu=(128, 192), wd=(192, 128), res=(3, 128)), r"residual has shape \(3, 128\), expected \(4, 128\)"),
        (dict(x=(4, 128), wg=(128, 192), wu=(128, 192), res=(4, 128)), "residual needs w_down"),
        (dict(x=(4, 128), wg=(128,), wu=(128, 192)), r"w_gate must be \[D, F\]"),
    ],
)
def test_bad_shapes(args, message):
    arr = lambda s: None if s is None else jnp.ones(s, jnp.float16)  # noqa: E731
    for impl in ("auto", "cuda", "xla", "reference"):
        with pytest.raises(ValueError, match=message):
            jc.swiglu(arr(args["x"]), arr(args["wg"]), arr(args["wu"]), arr(args.get("wd")),
                      arr(args.get("res")), impl=impl)


def test_bad_dtypes_impls_and_configs():
    x, w = jnp.ones((2, 64), jnp.float16), jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="w_up has dtype bfloat16, expected float16"):
        jc.swiglu(x, w, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="w_down has dtype float32, expected float16"):
        jc.swiglu(x, w, w, w.astype(jnp.float32))
    with pytest.raises(ValueError, match="x dtype must be float16 or bfloat16"):
        jc.swiglu(x.astype(jnp.int32), w.astype(jnp.int32), w.astype(jnp.int32))
    with pytest.raises(ValueError, match="impl must be one of"):
        jc.swiglu(x, w, w, w, impl="fast")
    with pytest.raises(TypeError, match="config must be a SwigluConfig or None"):
        jc.swiglu(x, w, w, w, config="tma")
    for impl in ("xla", "reference"):
        with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
            jc.swiglu(x, w, w, w, impl=impl, config=SwigluConfig())
    with pytest.raises(ValueError, match="the fused variant needs w_down"):
        jc.swiglu(x, w, w, impl="cuda", config=SwigluConfig(variant="fused"))


@pytest.mark.parametrize("fields, error, message", [
    (dict(variant="fast"), ValueError, "variant must be one of ('tma', 'gemv', 'fused')"),
    (dict(variant="xla"), ValueError, "variant must be one of"),
    (dict(down="cublas"), ValueError, "down must be one of ('kernel', 'xla')"),
    (dict(variant="fused", cluster_size=3), ValueError, "cluster_size must be one of (1, 2, 4, 8, 16)"),
    (dict(row_tiles=8), ValueError, "row_tiles must be one of (1, 2, 4)"),
    (dict(variant="fused", f_group=0), ValueError, "f_group must be in 1..64"),
    (dict(variant="fused", clusters=0), ValueError, "clusters must be in 1..65535"),
    (dict(blocks=0), ValueError, "blocks must be in 1..65535"),
    (dict(blocks=70000), ValueError, "blocks must be in 1..65535"),
    (dict(variant="gemv", k_splits_up=0), ValueError, "k_splits_up must be >= 1"),
    (dict(variant="gemv", k_splits_down=0), ValueError, "k_splits_down must be >= 1"),
    (dict(variant="gemv", blocks=4), ValueError, "blocks is a knob of variant 'tma', not 'gemv'"),
    (dict(variant="gemv", row_tiles=1), ValueError, "row_tiles is a knob of variant 'tma' or 'fused'"),
    (dict(cluster_size=2), ValueError, "cluster_size is a knob of variant 'fused', not 'tma'"),
    (dict(k_splits_up=2), ValueError, "k_splits_up is a knob of variant 'gemv'"),
    (dict(variant="fused", pdl=False), ValueError, "pdl is a knob of 'tma' and 'gemv'"),
    (dict(variant="fused", down="xla"), ValueError, "down must be 'kernel'"),
    (dict(pdl=2), TypeError, "pdl must be a bool"),
    (dict(row_tiles=True), TypeError, "row_tiles must be an int or None"),
    (dict(blocks=7.0), TypeError, "blocks must be an int or None"),
])
def test_config_validation(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        SwigluConfig(**fields)


def test_config_is_frozen_and_hashable():
    cfg = SwigluConfig(variant="gemv", k_splits_up=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.variant = "tma"
    assert {cfg: 1}[SwigluConfig(variant="gemv", k_splits_up=3)] == 1
    assert SwigluConfig() != SwigluConfig(down="xla")


def test_impl_values(rng):
    """"reference" is the jnp reference; "xla" runs no custom call; "cuda" and "auto" (on a
    supported shape) run the custom call (the C++ handler on CPU)."""
    inputs = _inputs(rng, 5, 128, 192, "bfloat16")
    np.testing.assert_array_equal(np.asarray(jc.swiglu(*inputs, impl="reference")),
                                  np.asarray(reference.swiglu(*inputs)))
    for impl, calls in (("xla", 0), ("cuda", 1), ("auto", 1)):
        hlo = jax.jit(lambda *a, i=impl: jc.swiglu(*a, impl=i)).lower(*inputs).as_text()
        assert hlo.count("jax_cluster_swiglu") == calls, impl
        _check(np.asarray(jax.jit(lambda *a, i=impl: jc.swiglu(*a, impl=i))(*inputs)), *inputs)
    # down="xla": our up stage, then XLA's dot
    hlo = jax.jit(lambda *a: jc.swiglu(*a, **_cuda(down="xla"))).lower(*inputs).as_text()
    assert hlo.count("jax_cluster_swiglu") == 1 and "dot" in hlo


def test_unsupported_shapes_fall_back_with_one_warning(rng):
    _ffi._warned.clear()
    x, wg, wu, wd, res = _inputs(rng, 3, 96, 160, "bfloat16")  # not multiples of 64
    with pytest.warns(UserWarning, match="running impl='xla'"):
        out = jc.swiglu(x, wg, wu, wd, res)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jc.swiglu(x, wg, wu, wd, res, impl="xla")))
    _check(np.asarray(out), x, wg, wu, wd, res)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.swiglu(x, wg, wu, wd, res)  # warned once only
    with pytest.raises(ValueError, match=r"no kernel for D=96, F=160 \(the kernels need multiples of 64\)"):
        jc.swiglu(x, wg, wu, wd, res, impl="cuda")
    x32, wg32, wu32, wd32, _ = _inputs(rng, 3, 64, 64, "float32")
    with pytest.warns(UserWarning, match=r"no kernel for dtype float32 \(the kernels take float16"):
        jc.swiglu(x32, wg32, wu32, wd32)
    with pytest.raises(ValueError, match="no kernel for dtype float32"):
        jc.swiglu(x32, wg32, wu32, wd32, impl="cuda")


def test_cpu_auto_uses_heuristic_without_measuring(rng, tmp_path):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU backend only")
    inputs = _inputs(rng, 4, 128, 192, "float16")
    jc.swiglu(*inputs)
    assert not (tmp_path / "tuning.json").exists()
    for m in (1, 4, 16, 64):
        assert sw.autotune(m, 128, 192, jnp.float16) == SwigluConfig()


def test_scheduler_candidates():
    """XLA's dots always; our up stage before XLA's down dot only where there is a down GEMM;
    the gemv kernels only at their row limit."""
    for m in (1, 8, 16, 17, 64):
        full, up = sw.candidates(m, True), sw.candidates(m, False)
        assert full[-1] == "xla" and up[-1] == "xla"
        assert SwigluConfig(down="xla") in full and SwigluConfig(down="xla") not in up
        assert (SwigluConfig(variant="gemv") in full) == (m <= 16)
        assert full[0] == SwigluConfig() == sw.heuristic(m, True)
        assert all(isinstance(c, SwigluConfig) for c in full[:-1])


def test_tuner_json_round_trip(rng, tmp_path, monkeypatch):
    """The tuner's winner (a SwigluConfig) is stored as JSON under the op's key and read back
    as an equal SwigluConfig by a fresh process, without measuring (CPU, fake timings)."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "1")
    monkeypatch.setattr(sw, "on_gpu", lambda: True)
    measured = []

    def fake_measure(choice, **shape):
        measured.append(choice)
        return 1e-4 if choice == SwigluConfig(variant="gemv") else 2e-4

    monkeypatch.setattr(sw, "measure", fake_measure)
    assert sw.autotune(3, 512, 1024, jnp.float16) == SwigluConfig(variant="gemv")
    assert set(measured) >= set(sw.candidates(3, True))
    entry = json.loads((tmp_path / "tuning.json").read_text())["entries"][
        "swiglu|" + sw.tuning_key(3, 512, 1024, jnp.float16, True)]
    assert entry["winner"] == {"type": "SwigluConfig", **{
        "variant": "gemv", "down": "kernel", "row_tiles": None, "blocks": None, "pdl": True,
        "k_splits_up": None, "k_splits_down": None, "cluster_size": None, "f_group": None,
        "clusters": None}}
    assert sw.tuning_key(3, 512, 1024, jnp.float16, True).startswith(f"v{sw.KERNEL_VERSION} ")
    jc.tuning.clear_memory_cache()  # a new process: reads the file, measures nothing
    measured.clear()
    assert sw.autotune(4, 512, 1024, jnp.float16) == SwigluConfig(variant="gemv")  # same bucket
    assert not measured
    # the winner runs: the pick is used under jit, the tuned config through the CPU handler
    inputs = _inputs(rng, 3, 512, 1024, "float16")
    _check(np.asarray(jax.jit(lambda *a: jc.swiglu(*a))(*inputs)), *inputs)
    assert not measured
    # "xla" as the winner round-trips as a string
    monkeypatch.setattr(sw, "measure", lambda choice, **shape: 1e-5 if choice == "xla" else 1e-4)
    assert sw.autotune(64, 512, 1024, jnp.float16) == "xla"
    jc.tuning.clear_memory_cache()
    assert tuning.lookup("swiglu", sw.tuning_key(64, 512, 1024, jnp.float16, True),
                         sw.candidates(64, True)) == "xla"


def test_timing_loop_chains():
    """The scheduler's timing chain: "direct" feeds each output in as the next x (no
    harness kernel between calls), "fori" adds it into x inside a fori_loop; both run
    every call in order over the weight copies."""
    x, weights, res = sw.timing_inputs(2, 64, 128, "float32", has_residual=True, l2_bytes=1 << 17)
    assert len(weights) > 1
    fn = lambda x, wg, wu, wd, r: reference.swiglu(x, wg, wu, wd, r)  # noqa: E731
    run, calls = sw.timing_loop(fn, (x, weights, res), calls=4, chain="direct")
    expect = x
    for i in range(calls):
        expect = fn(expect, *weights[i % len(weights)], res)
    np.testing.assert_allclose(run(x, weights, res), expect, rtol=1e-5, atol=1e-6)
    run, calls = sw.timing_loop(fn, (x, weights, res), calls=4, chain="fori")
    expect = x
    for i in range(calls):
        expect = expect + 1e-3 * fn(expect, *weights[i % len(weights)], res)
    np.testing.assert_allclose(run(x, weights, res), expect, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="chain"):
        sw.timing_loop(fn, (x, weights, res), chain="while")


def test_ffi_validation_errors():
    """The C++ decoder rejects malformed calls (last line of defence behind the wrapper)."""
    x, w = jnp.ones((2, 128), jnp.float16), jnp.ones((128, 128), jnp.float16)
    empty = jnp.zeros((0,), jnp.float16)
    good = dict(variant=2, row_tiles=1, blocks=1, clusters=1, cluster_size=2, f_group=1,
                k_splits_up=1, k_splits_down=1, pdl=False, has_down=True, has_residual=False)
    bad_attrs = [({"row_tiles": 3}, "row_tiles must be 1, 2 or 4"),
                 ({"cluster_size": 4}, "cluster_size must be 1, 2, 4, 8 or 16 and at most D / 64"),
                 ({"clusters": 3}, "clusters must be in 1..F/64"),
                 ({"f_group": 0}, "f_group must be in 1..64"),
                 ({"variant": 5}, "variant must be 0 (tma), 1 (gemv) or 2 (fused)"),
                 ({"variant": 0, "blocks": 0}, "blocks (of the tma kernels) must be in 1..65535"),
                 ({"variant": 0, "row_tiles": 8}, "row_tiles must be 1, 2 or 4"),
                 ({"variant": 1, "k_splits_up": 0}, "k_splits_up must be in 1..D/16"),
                 ({"variant": 1, "k_splits_down": 9}, "k_splits_down must be in 1..F/16")]
    for change, message in bad_attrs:
        with pytest.raises(Exception, match=re.escape(message)):
            jax.jit(lambda x, w: sw._PRIM.bind(x, w, w, w, empty, **{**good, **change})[0])(x, w).block_until_ready()
    with pytest.raises(Exception, match="the fused variant needs w_down"):
        jax.jit(lambda x, w: sw._PRIM.bind(x, w, w, empty, empty, **{**good, "has_down": False})[0])(
            x, w).block_until_ready()
    with pytest.raises(Exception, match="the gemv variant takes at most 16 rows"):
        x17 = jnp.ones((17, 128), jnp.float16)
        jax.jit(lambda x, w: sw._PRIM.bind(x, w, w, w, empty, **{**good, "variant": 1})[0])(
            x17, w).block_until_ready()


# ---------------------------------------------------------------- tensor parallelism
def _mesh(shape, names):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


@pytest.mark.parametrize("shape, names, axis", [((8,), ("tp",), "tp"), ((2, 4), ("dp", "tp"), "tp")])
def test_tensor_parallel_matches_unsharded(rng, shape, names, axis):
    if len(jax.devices("cpu")) < 8:
        pytest.skip("needs 8 (fake) CPU devices")
    mesh = _mesh(shape, names)
    size = mesh.shape[axis]
    x, wg, wu, wd, res = _inputs(rng, 5, 128, 64 * size * 2, "bfloat16")
    from jax.sharding import NamedSharding, PartitionSpec as P

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, P()), put(wg, P(None, axis)), put(wu, P(None, axis)), put(wd, P(axis, None)),
            put(res, P()))
    fn = jax.jit(lambda x, wg, wu, wd, r: jc.swiglu_tp(x, wg, wu, wd, r, mesh=mesh, axis=axis))
    out = np.asarray(fn(*args))
    single = np.asarray(jax.jit(jc.swiglu)(x, wg, wu, wd, res))
    # the psum adds `size` bf16-rounded partials: a few bf16 ulps from the unsharded op
    assert rel_l2(out, single) <= TOLERANCE["bfloat16"]
    _check(out, x, wg, wu, wd, res)
    hlo = fn.lower(*args).compile().as_text()
    assert len(re.findall(r"\ball-reduce(-start)?\(", hlo)) == 1, hlo
    assert "all-gather" not in hlo
    assert hlo.count("jax_cluster_swiglu") >= 1
    # fp32 psum: closer to the unsharded result
    fn32 = jax.jit(lambda *a: jc.swiglu_tp(*a, mesh=mesh, axis=axis, psum_dtype=jnp.float32))
    assert rel_l2(np.asarray(fn32(*args)), single) <= rel_l2(out, single) + 1e-3
    # impl and config reach every shard
    fn_cfg = jax.jit(lambda *a: jc.swiglu_tp(*a, mesh=mesh, axis=axis, impl="cuda",
                                             config=SwigluConfig(variant="gemv")))
    _check(np.asarray(fn_cfg(*args)), x, wg, wu, wd, res)
    fn_xla = jax.jit(lambda *a: jc.swiglu_tp(*a, mesh=mesh, axis=axis, impl="xla"))
    assert "jax_cluster_swiglu" not in fn_xla.lower(*args).as_text()


def test_tensor_parallel_errors(rng):
    mesh = _mesh((8,), ("tp",))
    x, wg, wu, wd, _ = _inputs(rng, 2, 128, 100, "float16")
    with pytest.raises(ValueError, match="F \\(100\\) must be divisible"):
        jc.swiglu_tp(x, wg, wu, wd, mesh=mesh)
    with pytest.raises(ValueError, match="w_down is required"):
        jc.swiglu_tp(x, wg, wu, None, mesh=mesh)
    with pytest.raises(ValueError, match="impl must be one of"):
        jc.swiglu_tp(x, wg, wu, wd, mesh=mesh, impl="kernel")


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", CHOICE_KW, ids=CHOICE_IDS)
def test_gpu_variants(rng, kwargs, dtype):
    for d, f in SHAPES:
        for m in MS:
            inputs = _inputs(rng, m, d, f, dtype, residual=m % 2 == 1)
            _check(_run(_gpu(), kwargs, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_up_only(rng, dtype):
    for d, f in SHAPES:
        for m in MS:
            for kwargs in (_cuda(), _cuda(variant="gemv"), _cuda(down="xla"), dict(impl="xla")):
                inputs = _inputs(rng, m, d, f, dtype, down=False)
                _check(_run(_gpu(), kwargs, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config", [dict(variant="fused", cluster_size=1), dict(variant="fused", cluster_size=2),
               dict(variant="fused", cluster_size=4), dict(variant="fused", cluster_size=16),
               dict(variant="fused", cluster_size=16, f_group=1), dict(variant="fused", f_group=3),
               dict(variant="fused", f_group=4, row_tiles=4), dict(variant="fused", clusters=1),
               dict(variant="fused", clusters=2), dict(variant="fused", cluster_size=8, clusters=5, f_group=2),
               dict(variant="fused", cluster_size=16, row_tiles=1),
               dict(variant="gemv", k_splits_up=1, k_splits_down=1),
               dict(variant="gemv", k_splits_up=7, k_splits_down=3),
               dict(variant="gemv", k_splits_up=64, k_splits_down=64), dict(variant="gemv", pdl=False),
               dict(variant="gemv", k_splits_up=7, k_splits_down=37),
               dict(blocks=1), dict(blocks=7), dict(blocks=1000), dict(blocks=3000), dict(row_tiles=1),
               dict(row_tiles=2, blocks=33), dict(row_tiles=4), dict(pdl=False), dict(pdl=False, blocks=5)],
    ids=str)
def test_gpu_knobs(rng, config):
    for d, f in ((1024, 1344), (320, 704)):
        for m in (1, 16, 33, 64):
            inputs = _inputs(rng, m, d, f, "bfloat16")
            _check(_run(_gpu(), _cuda(**config), *inputs), *inputs)


@pytest.mark.gpu
def test_gpu_llama_shapes(rng):
    for d, f in ((4096, 11008), (8192, 7168)):
        for m in (1, 16, 64):
            for kwargs in (_cuda(variant="fused"), _cuda(variant="gemv"), _cuda()):
                inputs = _inputs(rng, m, d, f, "float16")
                _check(_run(_gpu(), kwargs, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(), dict(pdl=False), dict(down="xla"), dict(variant="gemv"),
                                    dict(variant="gemv", pdl=False), dict(variant="fused")], ids=str)
def test_gpu_chained_calls(rng, config):
    """Calls feeding each other inside one jit, as in a decoder stack (command buffers,
    the programmatic launch of each call's down kernel right after its up kernel, one
    call's kernels right after the previous call's): each layer against the reference on
    the input the kernels gave it."""
    d, f, m = 512, 1344, 5
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float16)
    layers = [_inputs(rng, m, d, f, "float16")[1:4] for _ in range(4)]

    def run(x, layers):
        outs = []
        for wg, wu, wd in layers:
            x = jc.swiglu(x, wg, wu, wd, x, **_cuda(**config))
            outs.append(x)
        return outs

    outs = jax.jit(run)(jax.device_put(x, _gpu()), jax.device_put(layers, _gpu()))
    prev = x
    for (wg, wu, wd), out in zip(layers, outs):
        out = np.asarray(out)
        _check(out, prev, wg, wu, wd, prev)
        prev = jnp.asarray(out)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", CHOICE_KW, ids=CHOICE_IDS)
def test_gpu_deterministic(rng, kwargs):
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 16, 1024, 2816, "bfloat16")]
    fn = jax.jit(lambda *a: jc.swiglu(*a, **kwargs))
    first = np.asarray(fn(*inputs))
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(fn(*inputs)), first)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(), dict(row_tiles=2), dict(blocks=7)], ids=str)
def test_gpu_tma_split_tile_sums(rng, config):
    """The tma kernels' split tiles summed by every block ending in them, after a wait on
    the tile's counter: at M = 64 a down tile spans ~8 blocks, an up tile 2-3; with 7
    blocks one block holds many whole tiles and one split tile mid-range. Correct, and
    bitwise equal over repeated calls."""
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 64, 4096, 11008, "float16")]
    fn = jax.jit(lambda *a: jc.swiglu(*a, **_cuda(**config)))
    first = np.asarray(fn(*inputs))
    _check(first, *inputs)
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(fn(*inputs)), first)


@pytest.mark.gpu
def test_gpu_auto_tunes_once_and_caches(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "1")
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 3, 512, 1024, "float16")]
    out = np.asarray(jax.jit(lambda *a: jc.swiglu(*a))(*inputs))  # tunes while tracing
    _check(out, *inputs)
    path = tmp_path / "tuning.json"
    assert path.exists()
    key = "swiglu|" + sw.tuning_key(3, 512, 1024, jnp.float16, True)
    entry = json.loads(path.read_text())["entries"][key]
    assert entry["winner"] in [tuning.encode(c) for c in sw.candidates(3, True)]
    calls = []
    monkeypatch.setattr(sw, "measure", lambda *a, **k: calls.append(a) or 1.0)
    jc.tuning.clear_memory_cache()  # a new process: reads the file, measures nothing
    assert tuning.encode(sw.autotune(3, 512, 1024, jnp.float16)) == entry["winner"] and not calls


@pytest.mark.gpu
def test_gpu_tuning_disabled_uses_heuristic(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    assert sw.autotune(4, 512, 1024, jnp.float16) == SwigluConfig()
    assert sw.autotune(17, 512, 1024, jnp.float16) == SwigluConfig()
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.gpu
def test_gpu_variants_agree(rng):
    """Every variant computes the same y (up to fp32 summation order)."""
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 8, 1024, 1344, "float16")]
    outs = [np.asarray(jax.jit(lambda *a, kw=kw: jc.swiglu(*a, **kw))(*inputs)) for kw in CHOICE_KW]
    for o in outs[1:]:
        assert rel_l2(o, outs[0]) < 2e-3
