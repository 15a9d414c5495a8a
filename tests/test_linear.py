"""linear (y = a @ w (+ residual) on the tma GEMM engine) vs the jnp reference: CPU handler
always, the CUDA kernel on a GPU (dtypes, M from 1 to past one 64-row group, N below,
at and past one 256-column tile, the cluster grid and the stream-K grid with split tiles,
fp32 output, determinism); LinearConfig validation, the impl values, errors, fallback and
vmap."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import _ffi, reference
from jax_cluster.ops.linear import LinearConfig, linear, workspace_bytes
from jax_cluster.testing import rel_l2

DTYPES = ["float16", "bfloat16"]


def _inputs(rng, m, k, n, dtype, lead=None):
    lead = (m,) if lead is None else lead
    a = jnp.asarray(rng.standard_normal(lead + (k,)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    r = jnp.asarray(rng.standard_normal(lead + (n,)), dtype)
    return a, w, r


def _check(y, a, w, r, out_dtype=None):
    ref = reference.linear(a, w, r, out_dtype)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = 1e-5 if y.dtype == jnp.float32 else 4e-3 if y.dtype == jnp.bfloat16 else 6e-4
    assert rel_l2(np.asarray(y, np.float32), np.asarray(ref, np.float32)) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_cpu_matches_reference(rng, dtype, out_dtype):
    cpu = jax.devices("cpu")[0]
    for m, k, n in [(1, 64, 64), (3, 128, 320), (17, 192, 256)]:
        a, w, r = (jax.device_put(x, cpu) for x in _inputs(rng, m, k, n, dtype))
        for res in (None, r):
            y = jax.jit(lambda a, w, res: linear(a, w, res, out_dtype=out_dtype))(a, w, res)
            _check(y, a, w, res, out_dtype)


def test_leading_axes_and_vmap(rng):
    a, w, r = _inputs(rng, None, 128, 192, "bfloat16", lead=(2, 3))
    _check(linear(a, w, r), a, w, r)
    y = jax.vmap(lambda a, r: linear(a, w, r))(a, r)  # w unmapped: folded into M
    _check(y, a, w, r)
    ws = jnp.stack([w, 2 * w])
    y = jax.vmap(lambda a, w: linear(a, w))(a, ws)  # w mapped: one call per element
    for i in range(2):
        _check(y[i], a[i], ws[i], None)


def test_errors():
    a = jnp.zeros((3, 64), jnp.float16)
    w = jnp.zeros((64, 128), jnp.float16)
    with pytest.raises(ValueError, match="last dimension"):
        linear(a, jnp.zeros((128, 64), jnp.float16))
    with pytest.raises(ValueError, match="w must have a's dtype"):
        linear(a, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="residual must be"):
        linear(a, w, jnp.zeros((3, 64), jnp.float16))
    with pytest.raises(ValueError, match="residual must have a's dtype"):
        linear(a, w, jnp.zeros((3, 128), jnp.float32))
    with pytest.raises(ValueError, match="out_dtype"):
        linear(a, w, out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="max_blocks"):
        linear(a, w, config=LinearConfig(max_blocks=0))
    with pytest.raises(ValueError, match="impl must be one of"):
        linear(a, w, impl="kernel")
    with pytest.raises(TypeError, match="config must be a LinearConfig or None"):
        linear(a, w, config={"pdl": False})
    for impl in ("xla", "reference"):
        with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
            linear(a, w, impl=impl, config=LinearConfig())


@pytest.mark.parametrize("fields, error, message", [
    (dict(max_blocks=0), ValueError, "max_blocks must be in 1..65535"),
    (dict(max_blocks=65536), ValueError, "max_blocks must be in 1..65535"),
    (dict(max_blocks=7.0), TypeError, "max_blocks must be an int or None"),
    (dict(max_blocks=True), TypeError, "max_blocks must be an int or None"),
    (dict(pdl=1), TypeError, "pdl must be a bool"),
])
def test_config_validation(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        LinearConfig(**fields)
    assert LinearConfig() == LinearConfig(pdl=True, max_blocks=None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_impl_values(rng, dtype):
    """"reference" is the jnp reference; "xla" runs no custom call; "cuda" and "auto" run
    the custom call (the C++ handler on CPU), with any LinearConfig."""
    a, w, r = _inputs(rng, 5, 128, 192, dtype)
    np.testing.assert_array_equal(np.asarray(linear(a, w, r, impl="reference")),
                                  np.asarray(reference.linear(a, w, r)))
    for impl, calls in (("xla", 0), ("cuda", 1), ("auto", 1)):
        fn = jax.jit(lambda a, w, r, i=impl: linear(a, w, r, impl=i))
        assert fn.lower(a, w, r).as_text().count("jax_cluster_linear") == calls, impl
        _check(fn(a, w, r), a, w, r)
    for config in (LinearConfig(pdl=False), LinearConfig(max_blocks=7)):
        _check(jax.jit(lambda a, w, r, c=config: linear(a, w, r, impl="cuda", config=c))(a, w, r), a, w, r)


def test_unsupported_shape_falls_back_with_one_warning(rng):
    _ffi._warned.clear()
    a, w, r = _inputs(rng, 2, 96, 80, "float16")  # K, N not multiples of 64
    with pytest.warns(UserWarning, match="no kernel for K=96, N=80"):
        y = linear(a, w, r)
    _check(y, a, w, r)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(linear(a, w, r, impl="xla")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear(a, w, r)
    with pytest.raises(ValueError, match="impl='cuda' needs K and N multiples of 64"):
        linear(a, w, r, impl="cuda")


def test_workspace_bytes():
    # M = 16, N = 4096: 16 tiles of one row group; 132 + 15 segments of 16 x 256 fp32
    assert workspace_bytes(16, 4096, 132) == 64 + 147 * 16 * 256 * 4
    # M = 65: row groups of 64 rows (row_tiles 4), 2 groups
    assert workspace_bytes(65, 512, 132) == 16 + (132 + 3) * 64 * 256 * 4


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


GPU_SHAPES = [  # K, N: N below one tile, a partial last tile, Llama's QKV (cluster grid)
    (320, 192), (512, 1344), (4096, 6144)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", GPU_SHAPES)
def test_gpu_matches_reference(rng, dtype, k, n):
    for m in (1, 3, 16, 33, 64, 100):
        a, w, r = (jax.device_put(x, _gpu()) for x in _inputs(rng, m, k, n, dtype))
        for res, out_dtype in ((r, None), (None, "float32")):
            y = jax.jit(lambda a, w, res: linear(a, w, res, out_dtype=out_dtype))(a, w, res)
            _check(y, a, w, res, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("max_blocks", [7, 40, None])
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_grids_agree_and_are_deterministic(rng, max_blocks, pdl):
    """Clusters over DSMEM (N = 4096: 16 tiles, the default grid) and the stream-K grid with
    split tiles summed through the workspace (7 or 40 blocks): the same y, bitwise equal
    over repeated calls."""
    a, w, r = (jax.device_put(x, _gpu()) for x in _inputs(rng, 16, 4096, 4096, "bfloat16"))
    config = LinearConfig(pdl=pdl, max_blocks=max_blocks)
    fn = jax.jit(lambda a, w, r: linear(a, w, r, config=config))
    first = np.asarray(fn(a, w, r))
    _check(first, a, w, r)
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(fn(a, w, r)), first)


@pytest.mark.gpu
def test_gpu_chained_projections(rng):
    """Back-to-back calls (each one's output the next one's input), as a decode step's QKV
    and output projections run around its attention with programmatic launches."""
    a, w1, _ = _inputs(rng, 16, 4096, 6144, "float16")
    w2 = jnp.asarray(rng.standard_normal((6144, 4096)) / np.sqrt(6144), "float16")
    a, w1, w2 = (jax.device_put(x, _gpu()) for x in (a, w1, w2))
    y = jax.jit(lambda a: linear(linear(a, w1), w2, a))(a)
    ref = reference.linear(reference.linear(a, w1), w2, a)
    assert rel_l2(np.asarray(y, np.float32), np.asarray(ref, np.float32)) < 2e-3
