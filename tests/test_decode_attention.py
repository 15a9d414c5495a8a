"""decode_attention (split-K decode attention) vs the jnp reference: CPU handler always,
CUDA kernels on a GPU. attention_decode's impl="splitk" step: test_attention_decode.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import reference
from jax_cluster.ops.decode_attention import decode_attention, decode_attention_append, default_splits
from jax_cluster.testing import TOLERANCE, rel_l2


def make(rng, batch, hkv, group, dh, max_seq, dtype, pos=None):
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    if pos is None:
        pos = rng.integers(0, max_seq, size=batch)
    return (f(batch, hkv, group, dh, sc=dh ** -0.5), f(batch, hkv, max_seq, dh),
            f(batch, hkv, max_seq, dh), jnp.asarray(pos, jnp.int32))


def check(q, k, v, pos, device=None, **kw):
    if device is not None:
        q, k, v, pos = jax.device_put((q, k, v, pos), device)
    out = jax.jit(lambda *a: decode_attention(*a, **kw))(q, k, v, pos)
    ref = reference.decode_attention(q, k, v, pos)
    valid = np.asarray((pos >= 0) & (pos < k.shape[2]))
    assert np.isnan(np.asarray(out[~valid], np.float32)).all()
    tol = TOLERANCE[jnp.dtype(q.dtype).name]
    assert rel_l2(out[valid], ref[valid]) <= tol, rel_l2(out[valid], ref[valid])
    return out


CPU_CASES = [  # batch, hkv, group, dh, max_seq, pos
    (1, 1, 1, 16, 9, [8]),
    (3, 2, 3, 24, 37, [0, 36, 17]),
    (2, 4, 1, 8, 5, [4, 0]),
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 4, 50])  # 50: more splits than tokens (empty ones)
def test_cpu_handler(rng, case, dtype, splits):
    b, hkv, g, dh, s, pos = case
    check(*make(rng, b, hkv, g, dh, s, dtype, pos), splits=splits)


def test_cpu_out_of_range_rows_are_nan(rng):
    q, k, v, _ = make(rng, 3, 2, 2, 16, 11, "float32")
    check(q, k, v, jnp.asarray([-1, 4, 11], jnp.int32), splits=3)


def test_vmap_folds_into_rows(rng):
    q, k, v, pos = make(rng, 2, 2, 2, 16, 13, "float32")
    qs = jnp.stack([q, q * 0.5, -q])
    out = jax.vmap(lambda a: decode_attention(a, k, v, pos, splits=2))(qs)
    for i in range(3):
        np.testing.assert_allclose(out[i], reference.decode_attention(qs[i], k, v, pos), rtol=1e-5, atol=1e-6)


def test_default_splits():
    assert default_splits(16, 8, 4096) == 1  # 128 (row, KV head) pairs: about one block per SM
    assert default_splits(1, 8, 4096) == 16 and default_splits(1, 32, 4096) == 4
    assert default_splits(1, 8, 1024) == 4  # no split under 256 tokens of S_max
    assert default_splits(1, 1, 100) == 1


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0][..., :-1], *a[1:]), "does not match q"),
    (lambda a: (a[0], a[1], a[2][:, :, :-1], a[3]), "must match k_cache"),
    (lambda a: (a[0], a[1].astype(jnp.float16), *a[2:]), "share a dtype"),
    (lambda a: (*a[:3], a[3].astype(jnp.float32)), "pos must be int32"),
    (lambda a: (*a[:3], a[3][:1]), "pos must be int32"),
    (lambda a: (jnp.zeros((2, 2, 9, 16), jnp.float32), *a[1:]), "at most 8 query heads"),
    (lambda a: (a[0][0], *a[1:]), "q must be"),
])
def test_bad_arguments(rng, change, message):
    args = make(rng, 2, 2, 2, 16, 13, "float32")
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(args))


@pytest.mark.parametrize("splits", [0, 1025, 2.0])
def test_bad_splits(rng, splits):
    with pytest.raises(ValueError, match="splits must be"):
        decode_attention(*make(rng, 2, 2, 2, 16, 13, "float32"), splits=splits)


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


GPU_CASES = [  # batch, hkv, group, dh, max_seq
    (1, 8, 4, 128, 4096),   # Llama-3-8B b1
    (3, 4, 1, 128, 1000),   # MHA, S_max no multiple of any tile
    (16, 2, 8, 64, 700),    # GQA 8
    (3, 1, 8, 80, 333),     # MQA, head_dim 80
    (2, 2, 3, 96, 515),     # group 3, head_dim 96
    (3, 2, 2, 128, 9),      # a short cache
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("splits", [None, 1, 7, 64])
def test_gpu_vs_reference(rng, dtype, case, splits):
    b, hkv, g, dh, s = case
    pos = rng.integers(0, s, size=b)
    pos[0], pos[-1] = s - 1, 0  # the last slot; the first token only
    check(*make(rng, b, hkv, g, dh, s, dtype, pos), device=_gpu(), splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])  # CUDA-core and tensor-core split kernels
@pytest.mark.parametrize("splits", [None, 1])  # 1: the output written without a merge kernel
def test_gpu_out_of_range_rows_are_nan(rng, group, splits):
    q, k, v, _ = make(rng, 3, 2, group, 128, 300, "float16")
    check(q, k, v, jnp.asarray([-1, 299, 300], jnp.int32), device=_gpu(), splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 16])
def test_gpu_deterministic(rng, splits):
    q, k, v, pos = jax.device_put(make(rng, 3, 8, 4, 128, 2048, "bfloat16"), _gpu())
    f = jax.jit(lambda *a: decode_attention(*a, splits=splits))
    first = np.asarray(f(q, k, v, pos))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, pos)), first)


@pytest.mark.gpu
def test_gpu_unsupported_head_dim_raises(rng):
    with pytest.raises(ValueError, match="no CUDA kernel"):
        decode_attention(*jax.device_put(make(rng, 1, 1, 1, 48, 16, "float16"), _gpu()))


# ---------------------------------------------------------------- append mode
def make_append(rng, batch, hkv, group, dh, max_seq, dtype, pos, rotary_dim=None):
    rotary_dim = dh if rotary_dim is None else rotary_dim
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    qkv = jnp.asarray(rng.standard_normal((batch, (group + 2) * hkv * dh)), jnp.float32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim), jnp.float32)
    return qkv, f(batch, hkv, max_seq, dh), f(batch, hkv, max_seq, dh), jnp.asarray(pos, jnp.int32), inv_freq


def append_reference(qkv, k_cache, v_cache, pos, inv_freq, *, num_q_heads, scale, rotary_dim, rope_layout):
    """RoPE, the cache write and the attention from the jnp pieces of reference.py."""
    b, hkv, max_seq, dh = k_cache.shape
    g = num_q_heads // hkv
    valid = (pos >= 0) & (pos < max_seq)
    p = jnp.where(valid, pos, 0)
    q = reference._rope(qkv[:, :num_q_heads * dh].reshape(b, num_q_heads, dh), p[:, None], inv_freq,
                        rotary_dim, rope_layout)
    k = reference._rope(qkv[:, num_q_heads * dh:(num_q_heads + hkv) * dh].reshape(b, hkv, dh), p[:, None],
                        inv_freq, rotary_dim, rope_layout)
    v = qkv[:, (num_q_heads + hkv) * dh:].reshape(b, hkv, dh)
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(valid, pos, max_seq)[:, None]
    k_cache = k_cache.at[rows, jnp.arange(hkv)[None], slot].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, jnp.arange(hkv)[None], slot].set(v.astype(v_cache.dtype), mode="drop")
    out = reference.decode_attention((q * scale).reshape(b, hkv, g, dh), k_cache, v_cache, pos)
    return out.astype(k_cache.dtype), k_cache, v_cache


def check_append(args, device=None, layout="half", rotary_dim=None, splits=None, group=None):
    qkv, k, v, pos, inv_freq = args
    dh = k.shape[3]
    kw = dict(num_q_heads=group * k.shape[1], scale=dh ** -0.5, rotary_dim=rotary_dim or dh,
              rope_layout=layout)
    if device is not None:
        args = jax.device_put(args, device)
    out, k2, v2 = jax.jit(lambda *a: decode_attention_append(*a, **kw, splits=splits))(*args)
    ro, rk, rv = append_reference(qkv, k, v, pos, inv_freq, **kw)
    tol = TOLERANCE[jnp.dtype(k.dtype).name]
    valid = np.asarray((pos >= 0) & (pos < k.shape[2]))
    assert np.isnan(np.asarray(out[~valid], np.float32)).all()
    assert rel_l2(out[valid], ro[valid]) <= tol, rel_l2(out[valid], ro[valid])
    # the caches: only slot pos[b] of valid rows changed, to the new (RoPE'd) k and v
    for new, ref, old in ((k2, rk, k), (v2, rv, v)):
        changed = np.asarray(new != old).any(axis=(1, 3))
        assert not changed[~valid].any()
        for b in np.flatnonzero(valid):
            assert set(np.flatnonzero(changed[b])) <= {int(pos[b])}
        assert rel_l2(new, ref) <= tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout, rotary", [("half", None), ("interleaved", 8)])
@pytest.mark.parametrize("splits", [1, 3, 40])
def test_append_cpu(rng, dtype, layout, rotary, splits):
    args = make_append(rng, 3, 2, 3, 16, 29, dtype, [0, 28, 11], rotary)
    check_append(args, layout=layout, rotary_dim=rotary, splits=splits, group=3)


def test_append_cpu_out_of_range_rows(rng):
    check_append(make_append(rng, 3, 2, 2, 16, 9, "float32", [-1, 3, 9]), splits=2, group=2)


def test_append_bad_arguments(rng):
    qkv, k, v, pos, inv = make_append(rng, 2, 2, 2, 16, 9, "float32", [1, 2])
    kw = dict(num_q_heads=4, scale=0.25)
    with pytest.raises(ValueError, match="qkv must be float32"):
        decode_attention_append(qkv[:, :-1], k, v, pos, inv, **kw)
    with pytest.raises(ValueError, match="multiple of"):
        decode_attention_append(qkv, k, v, pos, inv, num_q_heads=3, scale=0.25)
    with pytest.raises(ValueError, match="inv_freq float32"):
        decode_attention_append(qkv, k, v, pos, inv[:-1], **kw)
    with pytest.raises(ValueError, match="caches must be"):
        decode_attention_append(qkv, k, v.astype(jnp.float16), pos, inv, **kw)
    with pytest.raises(ValueError, match="rope_layout"):
        decode_attention_append(qkv, k, v, pos, inv, **kw, rope_layout="full")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_append_vs_reference(rng, dtype, case, splits):
    b, hkv, g, dh, s = case
    pos = rng.integers(0, s, size=b)
    pos[0], pos[-1] = s - 1, 0
    check_append(make_append(rng, b, hkv, g, dh, s, dtype, pos), device=_gpu(), splits=splits, group=g)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_append_out_of_range_and_deterministic(rng, group):
    for splits in (None, 1):  # caches untouched in out-of-range rows, merged or not
        args = make_append(rng, 3, 2, group, 128, 300, "bfloat16", [-1, 299, 300], rotary_dim=64)
        check_append(args, device=_gpu(), group=group, layout="interleaved", rotary_dim=64,
                     splits=splits)
    args = jax.device_put(make_append(rng, 3, 8, 4, 128, 2048, "bfloat16", [2047, 5, 1000]), _gpu())
    f = jax.jit(lambda *a: decode_attention_append(*a, num_q_heads=32, scale=0.1, splits=16)[0])
    first = np.asarray(f(*args))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(*args)), first)
