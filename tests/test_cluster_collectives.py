"""cluster_reduce / cluster_gather vs the jnp reference (CPU handler always,
CUDA handler on a GPU): every cluster size, dtype, op and exchange."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import _ffi, reference
from jax_cluster.testing import TOLERANCE, rel_l2

DTYPES = ["float32", "float16", "bfloat16"]
SIZES = [1, 7, 37, 256, 1000]  # not multiples of the 256 threads or of a 16-byte vector
# Powers of two run the butterfly; 3, 5, 6 and 7 the direct schedule.
CLUSTER_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 16]


def _inputs(rng, groups, n, size, dtype, repeat=1):
    # repeat=k sums k times (x N each): scale so fp16 cannot overflow.
    scale = float(n) ** -(repeat - 1)
    return jnp.asarray(rng.standard_normal((groups, n, size)) * scale, dtype=dtype)


def _on(device, fn, x):
    return np.asarray(jax.jit(fn)(jax.device_put(x, device)))


def _config(exchange, repeat):
    return jc.ClusterCollectiveConfig(exchange=exchange, repeat=repeat)


def _check_reduce(x, op, exchange, repeat, device):
    config = _config(exchange, repeat)

    def run(x):
        return jc.cluster_reduce(x, op, all_blocks=True, impl="cuda", config=config)

    out = _on(device, run, x)
    ref = reference.cluster_reduce(x, op, all_blocks=True, repeat=repeat)
    assert out.shape == ref.shape and out.dtype == x.dtype
    # The butterfly rounds to the storage dtype after each of its log2(N) rounds, every
    # call (the direct schedule of other sizes once): independent roundings add in quadrature.
    roundings = repeat * max(1, int(np.log2(x.shape[1])))
    # A rounding error scales with the partial sums, which the sum of |x| bounds: measure
    # against that, not against a sum that may cancel to near zero (a fresh seed found one).
    scale = ref if op == "max" else reference.cluster_reduce(jnp.abs(x), op, all_blocks=True, repeat=repeat)
    err = rel_l2(out, ref) * np.linalg.norm(np.asarray(ref, np.float64)) / max(
        np.linalg.norm(np.asarray(scale, np.float64)), 1e-30)
    assert err <= TOLERANCE[jnp.dtype(x.dtype).name] * np.sqrt(roundings)
    # Every block of the cluster ends with the full, bitwise-identical result.
    copies = out.astype(np.float32)
    assert (copies == copies[:, :1]).all()
    single = _on(device, lambda x: jc.cluster_reduce(x, op, impl="cuda", config=config), x)
    np.testing.assert_array_equal(single, out[:, 0])
    if device.platform != "cpu":  # the CPU handler replays the kernel's order of operations
        np.testing.assert_array_equal(out, _on(jax.devices("cpu")[0], run, x))


def _check_gather(x, exchange, repeat, device):
    config = _config(exchange, repeat)
    out = _on(device, lambda x: jc.cluster_gather(x, all_blocks=True, impl="cuda", config=config), x)
    ref = reference.cluster_gather(x, all_blocks=True, repeat=repeat)
    np.testing.assert_array_equal(out, np.asarray(ref))  # a copy is exact
    single = _on(device, lambda x: jc.cluster_gather(x, impl="cuda", config=config), x)
    np.testing.assert_array_equal(single, np.asarray(ref[:, 0]))


@pytest.mark.parametrize("n", CLUSTER_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_cpu(rng, n, dtype, op):
    for size in (1, 37, 1000):
        _check_reduce(_inputs(rng, 3, n, size, dtype), op, "dsmem", 1, jax.devices("cpu")[0])
    for exchange in ("dsmem", "global"):
        _check_reduce(_inputs(rng, 2, n, 37, dtype, 3), op, exchange, 3, jax.devices("cpu")[0])


@pytest.mark.parametrize("n", CLUSTER_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_cpu(rng, n, dtype):
    for size, repeat in ((1, 1), (37, 1), (1000, 3)):
        _check_gather(_inputs(rng, 3, n, size, dtype), "dsmem", repeat, jax.devices("cpu")[0])


def test_vmap(rng):
    x = _inputs(rng, 5, 4, 33, "float32")
    xs = jnp.stack([x, 2 * x, -x])
    out = jax.vmap(lambda x: jc.cluster_reduce(x, "sum"))(xs)
    np.testing.assert_allclose(out, reference.cluster_reduce(xs.reshape(15, 4, 33)).reshape(3, 5, 33), rtol=1e-6, atol=1e-6)
    g = jax.vmap(jc.cluster_gather, in_axes=1)(jnp.stack([x, x + 1], axis=1))
    assert g.shape == (2, 5, 4 * 33)
    np.testing.assert_array_equal(g[1], reference.cluster_gather(x + 1))


@pytest.mark.parametrize(
    "shape, kwargs, message",
    [
        ((2, 9, 8), {"impl": "cuda"}, "cluster_size must be one of"),
        ((2, 32, 8), {"impl": "cuda"}, "cluster_size must be one of"),
        ((2, 4, 8), {"config": {"cluster_size": 8}}, "must equal config.cluster_size"),
        ((4, 8), {}, "must be \\[groups, cluster_size, size\\]"),
        ((1, 2, 40000), {"impl": "cuda"}, "limit is 231424 bytes"),
        ((1, 4, 8), {"impl": "nvlink"}, "impl must be one of"),
        ((1, 4, 8), {"config": {"exchange": "nvlink"}}, "exchange must be one of"),
        ((1, 4, 8), {"config": {"repeat": 0}}, "repeat must be a positive int"),
        ((1, 4, 8), {"config": {"cluster_size": 9}}, "cluster_size must be one of"),
    ],
)
def test_bad_inputs(shape, kwargs, message):
    x = jnp.ones(shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        if "config" in kwargs:
            kwargs = {**kwargs, "config": jc.ClusterCollectiveConfig(**kwargs["config"])}
        jc.cluster_reduce(x, **kwargs)
    with pytest.raises(TypeError, match="config must be a ClusterCollectiveConfig"):
        jc.cluster_gather(jnp.ones((1, 4, 8)), config="global")


def test_uncovered_shapes_run_xla_under_auto_with_one_warning(rng):
    """impl="auto" runs XLA (one warning) where the kernels do not cover the call; "xla" and
    "reference" agree with the custom call where they do."""
    _ffi._warned.clear()
    x = _inputs(rng, 2, 9, 8, "float32")
    with pytest.warns(UserWarning, match="cluster_size must be one of"):
        out = jc.cluster_reduce(x)
    np.testing.assert_allclose(out, reference.cluster_reduce(x), rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jc.cluster_reduce(x)  # warned once only
    y = _inputs(rng, 3, 4, 37, "float16", 2)
    config = jc.ClusterCollectiveConfig(repeat=2)
    for impl in ("xla", "reference"):
        np.testing.assert_allclose(
            np.asarray(jc.cluster_reduce(y, "sum", impl=impl, config=config), np.float32),
            np.asarray(jc.cluster_reduce(y, "sum", impl="cuda", config=config), np.float32),
            rtol=2e-2, atol=2e-2)
        np.testing.assert_array_equal(jc.cluster_gather(y, impl=impl, all_blocks=True, config=config),
                                      jc.cluster_gather(y, impl="cuda", all_blocks=True, config=config))


def test_bad_dtype_and_op():
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        jc.cluster_gather(jnp.ones((1, 2, 8), jnp.int32))
    with pytest.raises(ValueError, match="op must be 'sum' or 'max'"):
        jc.cluster_reduce(jnp.ones((1, 2, 8)), op="min")


def test_shared_memory_limit_per_kind():
    # gather holds N segments + a staging copy: 16 x 16 KiB fp32 does not fit
    with pytest.raises(ValueError, match="shared memory"):
        jc.cluster_gather(jnp.ones((1, 16, 4096), jnp.float32), impl="cuda")
    jc.cluster_reduce(jnp.ones((1, 16, 4096), jnp.float32), impl="cuda")  # 5 x 16 KiB fits


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["dsmem", "global"])
@pytest.mark.parametrize("n", CLUSTER_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_gpu(rng, exchange, n, dtype):
    for op in ("sum", "max"):
        for size in SIZES:
            _check_reduce(_inputs(rng, 3, n, size, dtype), op, exchange, 1, _gpu())
        # repeated calls in one kernel exercise buffer reuse across calls
        _check_reduce(_inputs(rng, 5, n, 1000, dtype, 4), op, exchange, 4, _gpu())


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["dsmem", "global"])
@pytest.mark.parametrize("n", CLUSTER_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_gpu(rng, exchange, n, dtype):
    for size in SIZES:
        _check_gather(_inputs(rng, 3, n, size, dtype), exchange, 1, _gpu())
    _check_gather(_inputs(rng, 5, n, 1000, dtype), exchange, 5, _gpu())


@pytest.mark.gpu
def test_large_slices_and_many_clusters(rng):
    """64 KiB per block (Table 1's largest case) and more clusters than SMs."""
    x = _inputs(rng, 300, 4, 16384, "float32")
    _check_reduce(x, "sum", "dsmem", 1, _gpu())
    _check_gather(_inputs(rng, 2, 4, 8192, "float16"), "dsmem", 2, _gpu())


@pytest.mark.gpu
def test_deterministic(rng):
    x = jax.device_put(_inputs(rng, 64, 8, 4000, "float32"), _gpu())
    f = jax.jit(lambda x: jc.cluster_reduce(x, "sum"))
    first = np.asarray(f(x))
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(f(x)), first)

