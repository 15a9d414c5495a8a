"""swiglu vs the jnp reference: CPU handler always (every variant's configuration passes
through the same C++ validation), CUDA kernels on a GPU (every variant, dtype, M in
{1, 3, 8, 16, 33, 64, 128}, non-square (D, F), F not a multiple of 128, D not a multiple
of the 128-column down tile, cluster sizes, determinism), tensor parallelism on 8 fake
CPU devices, errors and fallbacks."""

import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import reference
from jax_cluster.ops import swiglu as sw
from jax_cluster.testing import TOLERANCE, on_cpu, rel_l2

DTYPES = ["float16", "bfloat16"]
MS = [1, 3, 8, 16, 33, 64, 128]
VARIANTS = ["split", "split_row", "fused", "fused_row", "stream", "gemv", "gemv:mma=0", "tma", "tma:wg=1",
            "xla", "tma+xla", "gemv:mma=0+xla"]
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


def _run(device, variant, x, wg, wu, wd, res):
    args = [jax.device_put(a, device) if a is not None else None for a in (x, wg, wu, wd, res)]
    fn = jax.jit(lambda x, wg, wu, wd, res: jc.swiglu(x, wg, wu, wd, res, variant=variant))
    return np.asarray(fn(*args))


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
@pytest.mark.parametrize("variant", ["auto"] + VARIANTS)
def test_cpu(rng, dtype, variant):
    for d, f in SHAPES:
        for m in (1, 16, 33):
            inputs = _inputs(rng, m, d, f, dtype, residual=m != 16)
            _check(_run(_cpu(), variant, *inputs), *inputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_all_m_and_up_only(rng, dtype):
    for m in MS:
        inputs = _inputs(rng, m, 128, 320, dtype)
        _check(_run(_cpu(), "auto", *inputs), *inputs)
        up = _inputs(rng, m, 128, 320, dtype, down=False)
        _check(_run(_cpu(), "split", *up), *up)


def test_cpu_handler_close_to_reference_bitwise_mostly(rng):
    """Same math, different summation order: nearly every element identical."""
    inputs = _inputs(rng, 8, 256, 512, "float16")
    out = _run(_cpu(), "split", *inputs)
    ref = np.asarray(reference.swiglu(*inputs))
    assert np.mean(out == ref) > 0.9


@pytest.mark.parametrize(
    "spec", ["split:nu=1:nd=1", "split:nu=16:nd=16:rt=4", "split:rt=2", "fused:n=1:c=1",
             "fused:n=2:g=1", "fused:n=16:g=3:rt=4", "fused:c=2", "fused:g=64", "fused_row:n=4",
             "stream:rt=1", "stream:rt=4:c=7", "stream:c=1", "stream:c=2000", "gemv:ku=1:kd=1",
             "gemv:ku=3:kd=5", "gemv:ku=4", "tma:rt=1", "tma:rt=4:c=7", "tma:c=2000:p=0",
             "tma:wg=1", "tma:wg=1:rt=4:c=7:p=0"])
def test_cpu_knobs_pass_validation(rng, spec):
    """Every knob combination yields a configuration the C++ decoder accepts."""
    for d, f in ((1024, 1024), (256, 192)):
        inputs = _inputs(rng, 33, d, f, "bfloat16")
        _check(_run(_cpu(), spec, *inputs), *inputs)


def test_configs_valid_for_many_shapes():
    """make_config never produces a configuration the kernels reject (mirrors the C++ checks)."""
    for d in (64, 128, 192, 1024, 4096, 8192, 16384):
        for f in (64, 192, 1344, 7168, 11008, 14336, 28672):
            for m in (1, 2, 5, 16, 17, 33, 64, 65, 300):
                for spec in ("split", "split_row", "fused", "fused_row", "fused:n=16", "fused:n=4",
                             "stream", "gemv", "gemv:mma=0", "tma", "tma:rt=1", "tma:wg=1"):
                    for down in (True, False):
                        cfg = sw.make_config(spec, m, d, f, down, 132)
                        if cfg is None:
                            continue
                        assert cfg.cluster_up in sw.CLUSTER_SIZES and cfg.cluster_up <= d // 64
                        assert cfg.row_tiles in (1, 2, 4)
                        if cfg.variant == 3:
                            mma = cfg.gemv_mma
                            row_bytes = sw.gemv_x_row_bytes(min(m, sw.gemv_max_rows(mma)), mma)
                            checks = ((d, cfg.k_splits_up), (f, cfg.k_splits_down)) if down else ((d, cfg.k_splits_up),)
                            for k, splits in checks:
                                assert 1 <= splits <= k // 16
                                assert sw.gemv_chunk(k, splits) * row_bytes <= sw._GEMV_X_BYTES
                            assert cfg.pdl == 1
                        elif cfg.variant == 4:
                            assert cfg.num_clusters == 132 and cfg.pdl == 1
                            rt = {"tma:rt=1": 1, "tma:wg=1": 4}.get(spec, sw._default_row_tiles(min(m, 64)))
                            assert cfg.row_tiles == rt and cfg.wgmma == (spec == "tma:wg=1")
                        elif cfg.variant == 2:
                            assert cfg.num_clusters == (2 if sw.tile_smem(cfg.row_tiles)[1] <= sw._BUDGET2 else 1) * 132
                            assert sw.tile_smem(cfg.row_tiles)[0] >= 2
                        elif cfg.variant == 1:
                            assert 1 <= cfg.num_clusters <= f // 64
                            assert sw.fused_smem(cfg.row_tiles, cfg.f_group, cfg.cluster_up, d)[0] >= 2
                        else:
                            assert cfg.cluster_down in sw.CLUSTER_SIZES and cfg.cluster_down <= f // 64
                            assert sw.tile_smem(cfg.row_tiles)[0] >= 2


def test_fused_cluster_count_balances_tiles():
    cfg = sw.make_config("fused", 1, 4096, 11008, True, 132)  # 172 F tiles
    tiles = 11008 // 64
    per = -(-tiles // cfg.num_clusters)
    assert per * cfg.num_clusters - tiles < per  # no cluster idle
    assert cfg.num_clusters <= 2 * 132 // cfg.cluster_up


def test_leading_dims_and_empty(rng):
    x, wg, wu, wd, res = _inputs(rng, 0, 128, 192, "float16", lead=(2, 3))
    out = jc.swiglu(x, wg, wu, wd, res)
    assert out.shape == (2, 3, 128)
    _check(np.asarray(out), x, wg, wu, wd, res)
    assert jc.swiglu(x, wg, wu).shape == (2, 3, 192)
    empty = jnp.zeros((0, 128), jnp.float16)
    assert jc.swiglu(empty, wg, wu, wd).shape == (0, 128)


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


def test_fused_large_m_chunks(rng):
    """The fused variant runs M > 64 in 64-row chunks (bounded workspace)."""
    inputs = _inputs(rng, 150, 128, 192, "float16")
    _check(_run(_cpu(), "fused", *inputs), *inputs)
    hlo = jax.jit(lambda *a: jc.swiglu(*a, variant="fused")).lower(*inputs).as_text()
    assert hlo.count("jax_cluster_swiglu") == 3


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
    with pytest.raises(ValueError, match=message):
        jc.swiglu(arr(args["x"]), arr(args["wg"]), arr(args["wu"]), arr(args.get("wd")), arr(args.get("res")))


def test_bad_dtypes_and_variants():
    x, w = jnp.ones((2, 64), jnp.float16), jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="w_up has dtype bfloat16, expected float16"):
        jc.swiglu(x, w, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="w_down has dtype float32, expected float16"):
        jc.swiglu(x, w, w, w.astype(jnp.float32))
    with pytest.raises(ValueError, match="x dtype must be float16 or bfloat16"):
        jc.swiglu(x.astype(jnp.int32), w.astype(jnp.int32), w.astype(jnp.int32))
    for bad, message in [("fast", "variant must be one of"), ("fused:n=3", "cluster sizes are"),
                         ("fused:z=1", "bad knob"), ("split:rt=8", "row tiles are 1, 2 or 4"),
                         ("auto:n=2", "takes no knobs"), ("fused:g=0", "must be >= 1"), ("stream:c=0", "c= in 1..65535"),
                         ("gemv:ku=0", "K chunks must be >= 1"), ("tma:p=2", "p= is 0 or 1"), ("gemv:mma=2", "mma= is 0 or 1"),
                         ("tma:wg=2", "wg= is 0 or 1"), ("gemv:wg=1", "a knob of 'tma' only"),
                         ("tma:wg=1:rt=2", "rt= must be 4"), ("xla+xla", "must be one of our up variants"),
                         ("auto+xla", "must be one of our up variants"), ("tma+cublas", "variant must be one of"),
                         ("tma:p=3+xla", "p= is 0 or 1"),
                         (3, "must be a string")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            jc.swiglu(x, w, w, w, variant=bad)


def test_unsupported_shapes_fall_back_with_one_warning(rng):
    sw._warned.clear()
    x, wg, wu, wd, res = _inputs(rng, 3, 96, 160, "bfloat16")  # not multiples of 64
    with pytest.warns(UserWarning, match="using the jnp reference"):
        out = jc.swiglu(x, wg, wu, wd, res)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference.swiglu(x, wg, wu, wd, res)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.swiglu(x, wg, wu, wd, res)  # warned once only
    x32, wg32, wu32, wd32, _ = _inputs(rng, 3, 64, 64, "float32")
    with pytest.warns(UserWarning, match="dtype=float32"):
        jc.swiglu(x32, wg32, wu32, wd32)


def test_cpu_auto_uses_heuristic_without_measuring(rng, tmp_path):
    if jax.default_backend() != "cpu":
        pytest.skip("CPU backend only")
    inputs = _inputs(rng, 4, 128, 192, "float16")
    jc.swiglu(*inputs)
    assert not (tmp_path / "tuning.json").exists()
    for m in (1, 4, 16, 64):
        assert sw.resolve_variant("auto", m, 128, 192, jnp.float16, True) == "tma"


def test_scheduler_candidates():
    """XLA's dots always; our up stage before XLA's down dot only where there is a down GEMM;
    the gemv kernels only at their row limits."""
    for m in (1, 8, 16, 64):
        full, up = sw.candidates(m, True), sw.candidates(m, False)
        assert full[-1] == "xla" and "tma+xla" in full and "tma+xla" not in up
        assert ("gemv" in full) == (m <= sw.GEMV_MMA_MAX_ROWS)
        assert ("gemv:mma=0" in full) == (m <= sw.GEMV_MAX_ROWS)


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
    good = dict(variant=1, order=0, cluster_up=2, cluster_down=1, row_tiles=1, f_group=1,
                num_clusters=1, k_splits_up=1, k_splits_down=1, pdl=0, gemv_mma=0,
                wgmma=0, has_down=True, has_residual=False)
    bad_attrs = [({"row_tiles": 3}, "row_tiles must be 1, 2 or 4"),
                 ({"cluster_up": 4}, "cluster_up must be 1, 2, 4, 8 or 16 and at most D / 64"),
                 ({"num_clusters": 3}, "num_clusters must be in 1..F/64"),
                 ({"variant": 5}, "variant must be 0"),
                 ({"variant": 4, "num_clusters": 0}, "num_clusters (the tma kernels' blocks) must be in 1..65535"),
                 ({"variant": 4, "pdl": 2}, "pdl must be 0 or 1"),
                 ({"variant": 3, "k_splits_up": 0}, "k_splits_up must be in 1..K/16"),
                 ({"variant": 3, "k_splits_down": 9}, "k_splits_down must be in 1..K/16"),
                 ({"variant": 3, "gemv_mma": 2}, "gemv_mma must be 0 or 1"),
                 ({"variant": 4, "wgmma": 2}, "wgmma must be 0 or 1"),
                 ({"variant": 4, "num_clusters": 7, "wgmma": 1}, "wgmma is a knob of the tma variant with row_tiles 4"),
                 ({"variant": 0, "row_tiles": 4, "wgmma": 1}, "wgmma is a knob of the tma variant with row_tiles 4"),
                 ({"variant": 2, "num_clusters": 0}, "num_clusters (the stream kernels' blocks) must be in 1..65535")]
    for change, message in bad_attrs:
        with pytest.raises(Exception, match=re.escape(message)):
            jax.jit(lambda x, w: sw._PRIM.bind(x, w, w, w, empty, **{**good, **change})[0])(x, w).block_until_ready()


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


def test_tensor_parallel_errors(rng):
    mesh = _mesh((8,), ("tp",))
    x, wg, wu, wd, _ = _inputs(rng, 2, 128, 100, "float16")
    with pytest.raises(ValueError, match="F \\(100\\) must be divisible"):
        jc.swiglu_tp(x, wg, wu, wd, mesh=mesh)
    with pytest.raises(ValueError, match="w_down is required"):
        jc.swiglu_tp(x, wg, wu, None, mesh=mesh)


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_variants(rng, variant, dtype):
    for d, f in SHAPES:
        for m in MS:
            inputs = _inputs(rng, m, d, f, dtype, residual=m % 2 == 1)
            _check(_run(_gpu(), variant, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_up_only(rng, dtype):
    for d, f in SHAPES:
        for m in MS:
            for variant in ("split", "split_row", "stream", "gemv", "gemv:mma=0", "tma", "tma:wg=1", "tma+xla"):
                inputs = _inputs(rng, m, d, f, dtype, down=False)
                _check(_run(_gpu(), variant, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec", ["split:nu=1:nd=1", "split:nu=2:nd=4", "split:nu=16:nd=16", "split:rt=1",
             "split:rt=2", "split:rt=4", "split_row:nu=8", "fused:n=1", "fused:n=2", "fused:n=4",
             "fused:n=16", "fused:n=16:g=1", "fused:g=3", "fused:g=4:rt=4", "fused:c=1",
             "fused:c=2", "fused:n=8:c=5:g=2", "fused_row:n=16", "stream:c=1", "stream:c=7",
             "stream:c=1000", "stream:rt=1", "stream:rt=2:c=33", "gemv:ku=1:kd=1", "gemv:ku=7:kd=3",
             "gemv:ku=64:kd=64", "gemv:p=0", "gemv:ku=7:kd=37",
             "gemv:mma=0:ku=7:kd=3", "gemv:mma=0:ku=64:kd=64", "gemv:mma=0:p=0", "tma:c=1", "tma:c=7", "tma:c=1000", "tma:c=3000", "tma:rt=1",
             "tma:rt=2:c=33", "tma:rt=4", "tma:p=0", "tma:p=0:c=5", "tma:wg=1:c=1", "tma:wg=1:c=7",
             "tma:wg=1:c=1000", "tma:wg=1:c=3000", "tma:wg=1:p=0", "tma:wg=1:p=0:c=5"])
def test_gpu_knobs(rng, spec):
    for d, f in ((1024, 1344), (320, 704)):
        for m in (1, 16, 33, 64):
            inputs = _inputs(rng, m, d, f, "bfloat16")
            _check(_run(_gpu(), spec, *inputs), *inputs)


@pytest.mark.gpu
def test_gpu_llama_shapes(rng):
    for d, f in ((4096, 11008), (8192, 7168)):
        for m in (1, 16, 64):
            for variant in ("split", "fused", "stream", "gemv", "gemv:mma=0", "tma", "tma:wg=1"):
                inputs = _inputs(rng, m, d, f, "float16")
                _check(_run(_gpu(), variant, *inputs), *inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["tma", "tma:p=0", "tma:wg=1", "split", "gemv", "gemv:p=0",
                                  "gemv:mma=0"])
def test_gpu_chained_calls(rng, spec):
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
            x = jc.swiglu(x, wg, wu, wd, x, variant=spec)
            outs.append(x)
        return outs

    outs = jax.jit(run)(jax.device_put(x, _gpu()), jax.device_put(layers, _gpu()))
    prev = x
    for (wg, wu, wd), out in zip(layers, outs):
        out = np.asarray(out)
        _check(out, prev, wg, wu, wd, prev)
        prev = jnp.asarray(out)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_deterministic(rng, variant):
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 16, 1024, 2816, "bfloat16")]
    fn = jax.jit(lambda *a: jc.swiglu(*a, variant=variant))
    first = np.asarray(fn(*inputs))
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(fn(*inputs)), first)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["tma", "tma:rt=2", "tma:wg=1", "tma:c=7"])
def test_gpu_tma_split_tile_sums(rng, spec):
    """The tma kernels' split tiles summed by every block ending in them, after a wait on
    the tile's counter (session 20): at M = 64 a down tile spans ~8 blocks, an up tile 2-3;
    with 7 blocks one block holds many whole tiles and one split tile mid-range. Correct,
    and bitwise equal over repeated calls."""
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 64, 4096, 11008, "float16")]
    fn = jax.jit(lambda *a: jc.swiglu(*a, variant=spec))
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
    import json

    entry = json.loads(path.read_text())["entries"][key]
    assert entry["winner"] in sw.candidates(3, True)
    calls = []
    monkeypatch.setattr(sw, "measure", lambda *a, **k: calls.append(a) or 1.0)
    jc.tuning.clear_memory_cache()  # a new process: reads the file, measures nothing
    assert sw.autotune(3, 512, 1024, jnp.float16) == entry["winner"] and not calls


@pytest.mark.gpu
def test_gpu_tuning_disabled_uses_heuristic(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    assert sw.resolve_variant("auto", 4, 512, 1024, jnp.float16, True) == "tma"
    assert sw.resolve_variant("auto", 17, 512, 1024, jnp.float16, True) == "tma"
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.gpu
def test_gpu_variants_agree(rng):
    """Every variant computes the same y (up to fp32 summation order)."""
    inputs = [jax.device_put(a, _gpu()) for a in _inputs(rng, 8, 1024, 1344, "float16")]
    outs = [np.asarray(jax.jit(lambda *a, v=v: jc.swiglu(*a, variant=v))(*inputs)) for v in VARIANTS]
    for o in outs[1:]:
        assert rel_l2(o, outs[0]) < 2e-3
