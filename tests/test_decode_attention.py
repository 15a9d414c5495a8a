"""decode_attention and decode_attention_append (split-K decode attention) vs the jnp
reference: the CPU handler (impl="cuda" on CPU), XLA's einsums and the reference always,
the CUDA kernels on a GPU. attention_block's kernel="split_k" step: test_attention_block.py."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import _ffi, reference
from jax_cluster.ops.decode_attention import (DecodeAttentionConfig, decode_attention, decode_attention_append,
                                              default_splits)
from jax_cluster.testing import TOLERANCE, rel_l2

IMPLS = ["auto", "cuda", "xla", "reference"]


def make(rng, batch, hkv, group, dh, max_seq, dtype, lengths=None):
    f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    if lengths is None:
        lengths = rng.integers(0, max_seq, size=batch)
    return (f(batch, hkv, group, dh, sc=dh ** -0.5), f(batch, hkv, max_seq, dh),
            f(batch, hkv, max_seq, dh), jnp.asarray(lengths, jnp.int32))


def _config(splits):
    return None if splits is None else DecodeAttentionConfig(splits=splits)


def check(q, k, v, lengths, device=None, splits=None, impl="auto"):
    if device is not None:
        q, k, v, lengths = jax.device_put((q, k, v, lengths), device)
    out = jax.jit(lambda *a: decode_attention(*a, impl=impl, config=_config(splits)))(q, k, v, lengths)
    ref = reference.decode_attention(q, k, v, lengths)
    assert out.dtype == q.dtype and out.shape == q.shape
    valid = np.asarray((lengths >= 0) & (lengths < k.shape[2]))
    assert np.isnan(np.asarray(out[~valid], np.float32)).all()
    tol = TOLERANCE[jnp.dtype(q.dtype).name]
    assert rel_l2(out[valid], ref[valid]) <= tol, rel_l2(out[valid], ref[valid])
    return out


def _custom_calls(fn, *args):
    return set(re.findall(r"jax_cluster_[a-z_]+", jax.jit(fn).lower(*args).as_text()))


CPU_CASES = [  # batch, hkv, group, dh, max_seq, lengths
    (1, 1, 1, 16, 9, [8]),
    (3, 2, 3, 24, 37, [0, 36, 17]),
    (2, 4, 1, 8, 5, [4, 0]),
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 4, 50])  # 50: more splits than tokens (empty ones)
def test_cpu_handler(rng, case, dtype, splits):
    b, hkv, g, dh, s, lengths = case
    check(*make(rng, b, hkv, g, dh, s, dtype, lengths), splits=splits)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_out_of_range_rows_are_nan(rng, impl):
    q, k, v, _ = make(rng, 3, 2, 2, 16, 11, "float32")
    check(q, k, v, jnp.asarray([-1, 4, 11], jnp.int32), splits=3 if impl in ("auto", "cuda") else None,
          impl=impl)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_impls_agree(rng, dtype):
    """"cuda" (the CPU handler here), "auto", "xla" (XLA's einsums in the input dtype) and
    "reference" compute the same attention; the first and last slot; "xla" and "reference"
    lower to no custom call."""
    q, k, v, lengths = make(rng, 3, 2, 4, 32, 23, dtype, [0, 22, 9])
    outs = {impl: check(q, k, v, lengths, impl=impl) for impl in IMPLS}
    tol = TOLERANCE[dtype]
    assert rel_l2(outs["cuda"], outs["xla"]) <= tol and rel_l2(outs["auto"], outs["cuda"]) <= tol
    np.testing.assert_array_equal(np.asarray(outs["reference"]),
                                  np.asarray(reference.decode_attention(q, k, v, lengths)))
    for impl, want in (("auto", {"jax_cluster_decode_attention"}), ("cuda", {"jax_cluster_decode_attention"}),
                       ("xla", set()), ("reference", set())):
        assert _custom_calls(lambda *a, i=impl: decode_attention(*a, impl=i), q, k, v, lengths) == want, impl


def test_vmap_folds_into_rows(rng):
    q, k, v, lengths = make(rng, 2, 2, 2, 16, 13, "float32")
    qs = jnp.stack([q, q * 0.5, -q])
    f = lambda a: decode_attention(a, k, v, lengths, config=DecodeAttentionConfig(splits=2))  # noqa: E731
    out = jax.vmap(f)(qs)
    for i in range(3):
        np.testing.assert_allclose(out[i], reference.decode_attention(qs[i], k, v, lengths),
                                   rtol=1e-5, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.vmap(f))(qs))  # one call over 6 rows, not a loop of calls
    assert jaxpr.count("jax_cluster_decode_attention") == 1 and "while" not in jaxpr


def test_default_splits():
    assert default_splits(16, 8, 4096) == 1  # 128 (row, KV head) pairs: about one block per SM
    assert default_splits(1, 8, 4096) == 16 and default_splits(1, 32, 4096) == 4
    assert default_splits(1, 8, 1024) == 4  # no split under 256 tokens of S_max
    assert default_splits(1, 1, 100) == 1


@pytest.mark.parametrize("change, message, impl", [
    (lambda a: (a[0][..., :-1], *a[1:]), "does not match q", "auto"),
    (lambda a: (a[0], a[1], a[2][:, :, :-1], a[3]), "must match k_cache", "auto"),
    (lambda a: (a[0], a[1].astype(jnp.float16), *a[2:]), "share a dtype", "auto"),
    (lambda a: (*a[:3], a[3].astype(jnp.float32)), "lengths must be int32", "auto"),
    (lambda a: (*a[:3], a[3][:1]), "lengths must be int32", "auto"),
    (lambda a: (jnp.zeros((2, 2, 9, 16), jnp.float32), *a[1:]), "at most 8 query heads", "cuda"),
    (lambda a: (a[0][0], *a[1:]), "q must be", "auto"),
    (lambda a: a, "impl must be one of", "kernel"),
])
def test_bad_arguments(rng, change, message, impl):
    args = make(rng, 2, 2, 2, 16, 13, "float32")
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(args), impl=impl)


@pytest.mark.parametrize("splits, error, message", [
    (0, ValueError, "splits must be in 1..1024"),
    (1025, ValueError, "splits must be in 1..1024"),
    (2.0, TypeError, "splits must be an int or None"),
    (True, TypeError, "splits must be an int or None"),
])
def test_bad_splits(rng, splits, error, message):
    with pytest.raises(error, match=message):
        decode_attention(*make(rng, 2, 2, 2, 16, 13, "float32"), config=DecodeAttentionConfig(splits=splits))


def test_config_belongs_to_auto_or_cuda(rng):
    args = make(rng, 2, 2, 2, 16, 13, "float32")
    qkv, k, v, lengths, inv = make_append(rng, 2, 2, 2, 16, 9, "float32", [1, 2])
    config = DecodeAttentionConfig(splits=2)
    assert DecodeAttentionConfig() == DecodeAttentionConfig(splits=None)
    DecodeAttentionConfig(splits=np.int32(7))
    for impl in ("xla", "reference"):
        with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
            decode_attention(*args, impl=impl, config=config)
        with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
            decode_attention_append(qkv, k, v, lengths, inv, num_q_heads=4, scale=0.25, impl=impl,
                                    config=config)
    for bad in (2, {"splits": 2}, jc.AttentionBlockConfig(kernel="split_k", splits=2)):
        with pytest.raises(TypeError, match="config must be a DecodeAttentionConfig or None"):
            decode_attention(*args, impl="cuda", config=bad)
        with pytest.raises(TypeError, match="config must be a DecodeAttentionConfig or None"):
            decode_attention_append(qkv, k, v, lengths, inv, num_q_heads=4, scale=0.25, config=bad)


def test_group_over_8_falls_back_under_auto_and_raises_under_cuda(rng):
    """The kernels take G <= 8 query heads per KV head: "auto" runs XLA's einsums (one
    warning), "cuda" is an error; both ops."""
    _ffi._warned.clear()
    q, k, v, lengths = make(rng, 2, 1, 16, 16, 13, "float32", [0, 12])
    with pytest.warns(UserWarning, match="at most 8 query heads per KV head, got 16; using XLA's ops"):
        out = check(q, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(check(q, k, v, lengths, impl="xla")))
    assert _custom_calls(lambda *a: decode_attention(*a), q, k, v, lengths) == set()
    with pytest.raises(ValueError, match="at most 8 query heads per KV head, got 16"):
        decode_attention(q, k, v, lengths, impl="cuda")
    args = make_append(rng, 2, 1, 16, 16, 13, "float32", [0, 12])
    with pytest.warns(UserWarning, match="at most 8 query heads per KV head, got 16; using XLA's ops"):
        check_append(args, group=16)
    assert _custom_calls(lambda *a: decode_attention_append(*a, num_q_heads=16, scale=0.25), *args) == set()
    with pytest.raises(ValueError, match="at most 8 query heads per KV head, got 16"):
        decode_attention_append(*args, num_q_heads=16, scale=0.25, impl="cuda")
    with warnings.catch_warnings():  # once per shape
        warnings.simplefilter("error")
        decode_attention(q, k, v, lengths)


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
    (2, 8, 1, 256, 2050),   # head_dim 256, MHA (Pythia-1B)
    (3, 1, 8, 256, 777),    # head_dim 256, MQA 8 (Gemma-2B): the lean tensor-core form, merge threads looping
    (1, 4, 2, 256, 4096),   # head_dim 256, GQA 2 (Gemma-2-2B)
]


def _case_id(case):
    return "b{}-kv{}-g{}-dh{}-s{}".format(*case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
@pytest.mark.parametrize("splits", [None, 1, 7, 64])
def test_gpu_vs_reference(rng, dtype, case, splits):
    b, hkv, g, dh, s = case
    lengths = rng.integers(0, s, size=b)
    lengths[0], lengths[-1] = s - 1, 0  # the last slot; the first token only
    check(*make(rng, b, hkv, g, dh, s, dtype, lengths), device=_gpu(), splits=splits, impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_xla_and_auto(rng, dtype):
    """impl="xla" (XLA's einsums) and "auto" (the kernels here) on the GPU."""
    q, k, v, lengths = make(rng, 3, 8, 4, 128, 1000, dtype, [999, 0, 500])
    for impl in ("xla", "auto"):
        check(q, k, v, lengths, device=_gpu(), impl=impl)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])  # CUDA-core and tensor-core split kernels
@pytest.mark.parametrize("splits", [None, 1])  # 1: the output written without a merge kernel
@pytest.mark.parametrize("dh", [128, 256])
def test_gpu_out_of_range_rows_are_nan(rng, group, splits, dh):
    q, k, v, _ = make(rng, 3, 2, group, dh, 300, "float16")
    check(q, k, v, jnp.asarray([-1, 299, 300], jnp.int32), device=_gpu(), splits=splits, impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 16])
@pytest.mark.parametrize("group, dh", [(4, 128), (8, 256), (1, 256)])
def test_gpu_deterministic(rng, splits, group, dh):
    q, k, v, lengths = jax.device_put(make(rng, 3, 8 // group, group, dh, 2048, "bfloat16"), _gpu())
    f = jax.jit(lambda *a: decode_attention(*a, impl="cuda", config=DecodeAttentionConfig(splits=splits)))
    first = np.asarray(f(q, k, v, lengths))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, lengths)), first)


@pytest.mark.gpu
def test_gpu_unsupported_head_dim_raises(rng):
    """No kernel for head_dim 48: "cuda" raises, "auto" runs XLA's einsums with a warning."""
    _ffi._warned.clear()
    args = jax.device_put(make(rng, 1, 1, 1, 48, 16, "float16"), _gpu())
    with pytest.raises(ValueError, match="no CUDA kernel"):
        decode_attention(*args, impl="cuda")
    with pytest.warns(UserWarning, match="no CUDA kernel for head_dim=48.*using XLA's ops"):
        check(*args)


# ---------------------------------------------------------------- append mode
def make_append(rng, batch, hkv, group, dh, max_seq, dtype, lengths, rotary_dim=None):
    rotary_dim = dh if rotary_dim is None else rotary_dim
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    qkv = jnp.asarray(rng.standard_normal((batch, (group + 2) * hkv * dh)), jnp.float32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim), jnp.float32)
    return (qkv, f(batch, hkv, max_seq, dh), f(batch, hkv, max_seq, dh), jnp.asarray(lengths, jnp.int32),
            inv_freq)


def append_reference(qkv, k_cache, v_cache, lengths, inv_freq, *, num_q_heads, scale, rotary_dim,
                     rope_layout):
    """RoPE, the cache write (a scatter) and the attention from the jnp pieces of reference.py."""
    b, hkv, max_seq, dh = k_cache.shape
    g = num_q_heads // hkv
    valid = (lengths >= 0) & (lengths < max_seq)
    p = jnp.where(valid, lengths, 0)
    q = reference._rope(qkv[:, :num_q_heads * dh].reshape(b, num_q_heads, dh), p[:, None], inv_freq,
                        rotary_dim, rope_layout)
    k = reference._rope(qkv[:, num_q_heads * dh:(num_q_heads + hkv) * dh].reshape(b, hkv, dh), p[:, None],
                        inv_freq, rotary_dim, rope_layout)
    v = qkv[:, (num_q_heads + hkv) * dh:].reshape(b, hkv, dh)
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(valid, lengths, max_seq)[:, None]
    k_cache = k_cache.at[rows, jnp.arange(hkv)[None], slot].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, jnp.arange(hkv)[None], slot].set(v.astype(v_cache.dtype), mode="drop")
    out = reference.decode_attention((q * scale).reshape(b, hkv, g, dh), k_cache, v_cache, lengths)
    return out.astype(k_cache.dtype), k_cache, v_cache


def check_append(args, device=None, layout="half", rotary_dim=None, splits=None, group=None, impl="auto"):
    qkv, k, v, lengths, inv_freq = args
    dh = k.shape[3]
    kw = dict(num_q_heads=group * k.shape[1], scale=dh ** -0.5, rotary_dim=rotary_dim or dh,
              rope_layout=layout)
    if device is not None:
        args = jax.device_put(args, device)
    out, k2, v2 = jax.jit(lambda *a: decode_attention_append(*a, **kw, impl=impl, config=_config(splits)))(*args)
    ro, rk, rv = append_reference(qkv, k, v, lengths, inv_freq, **kw)
    assert out.dtype == k.dtype and out.shape == (k.shape[0], k.shape[1], group, dh)
    tol = TOLERANCE[jnp.dtype(k.dtype).name]
    valid = np.asarray((lengths >= 0) & (lengths < k.shape[2]))
    assert np.isnan(np.asarray(out[~valid], np.float32)).all()
    assert rel_l2(out[valid], ro[valid]) <= tol, rel_l2(out[valid], ro[valid])
    # the caches: only slot lengths[b] of valid rows changed, to the new (RoPE'd) k and v
    for new, ref, old in ((k2, rk, k), (v2, rv, v)):
        changed = np.asarray(new != old).any(axis=(1, 3))
        assert not changed[~valid].any()
        for b in np.flatnonzero(valid):
            assert set(np.flatnonzero(changed[b])) <= {int(lengths[b])}
        assert rel_l2(new, ref) <= tol
    return out, k2, v2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout, rotary", [("half", None), ("interleaved", 8)])
@pytest.mark.parametrize("splits", [1, 3, 40])
def test_append_cpu(rng, dtype, layout, rotary, splits):
    args = make_append(rng, 3, 2, 3, 16, 29, dtype, [0, 28, 11], rotary)
    check_append(args, layout=layout, rotary_dim=rotary, splits=splits, group=3)


@pytest.mark.parametrize("impl", IMPLS)
def test_append_cpu_out_of_range_rows(rng, impl):
    """Traced lengths outside [0, S_max): NaN rows, those rows' caches untouched."""
    check_append(make_append(rng, 3, 2, 2, 16, 9, "float32", [-1, 3, 9]),
                 splits=2 if impl in ("auto", "cuda") else None, group=2, impl=impl)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("layout, rotary", [("half", None), ("interleaved", 8)])
def test_append_impls_agree(rng, dtype, layout, rotary):
    """"cuda" (the CPU handler), "auto", "xla" and "reference" (reference.decode_attention_append)
    compute the same step, caches included; the first and last slot."""
    args = make_append(rng, 3, 2, 4, 16, 21, dtype, [0, 20, 7], rotary)
    outs = {impl: check_append(args, layout=layout, rotary_dim=rotary, group=4, impl=impl) for impl in IMPLS}
    tol = TOLERANCE[dtype]
    for impl in ("auto", "xla"):
        for got, want in zip(outs[impl], outs["cuda"]):
            assert rel_l2(got, want) <= tol, impl
    kw = dict(num_q_heads=8, scale=0.25, rotary_dim=rotary, rope_layout=layout)
    for got, want in zip(decode_attention_append(*args, **kw, impl="reference"),
                         reference.decode_attention_append(*args, **kw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for impl, want in (("cuda", {"jax_cluster_decode_attention_append"}), ("xla", set()), ("reference", set())):
        calls = _custom_calls(lambda *a, i=impl: decode_attention_append(*a, **kw, impl=i), *args)
        assert calls == want, impl


def test_append_vmap_folds_into_rows(rng):
    qkv, k, v, lengths, inv = make_append(rng, 2, 2, 2, 16, 9, "float32", [8, 0])
    kw = dict(num_q_heads=4, scale=0.25)
    qkvs, ks, vs = jnp.stack([qkv, -qkv]), jnp.stack([k, v]), jnp.stack([v, k])
    f = lambda a, kc, vc: decode_attention_append(a, kc, vc, lengths, inv, **kw)  # noqa: E731
    out, k2, v2 = jax.vmap(f)(qkvs, ks, vs)
    for i in range(2):
        for got, want in zip((out[i], k2[i], v2[i]), reference.decode_attention_append(
                qkvs[i], ks[i], vs[i], lengths, inv, **kw)):
            assert rel_l2(got, want) <= 1e-5
    jaxpr = str(jax.make_jaxpr(jax.vmap(f))(qkvs, ks, vs))
    assert jaxpr.count("jax_cluster_decode_attention_append") == 1 and "while" not in jaxpr


# ---------------------------------------------------------------- rolling buffers
def windowed_history(rng, lengths, window, steps, hkv, group, dh, dtype):
    """A decode run over a sliding window two ways: the new tokens' qkv per step, the rolling
    buffers (window slots, position t in slot t % window) holding the window before the first
    step, and what each step must give: the attention of q (RoPE'd at its position) over the
    last `window` positions of the whole history, read from a plain cache of every position."""
    b = len(lengths)
    total = int(max(lengths)) + steps
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    hist_k, hist_v = f(b, hkv, total, dh), f(b, hkv, total, dh)
    slots = np.zeros((b, window), np.int64)  # the position each rolling slot holds before step 0
    for r, n in enumerate(lengths):
        for t in range(max(0, n - window), n):
            slots[r, t % window] = t
    rows = np.arange(b)[:, None]
    roll_k = hist_k[rows, :, slots].transpose(0, 2, 1, 3)
    roll_v = hist_v[rows, :, slots].transpose(0, 2, 1, 3)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
    qkvs = [jnp.asarray(rng.standard_normal((b, (group + 2) * hkv * dh)), jnp.float32) for _ in range(steps)]
    hq, scale, expected = group * hkv, dh ** -0.5, []
    for i, qkv in enumerate(qkvs):
        pos = jnp.asarray(lengths, jnp.int32) + i
        q = reference._rope(qkv[:, :hq * dh].reshape(b, hq, dh), pos[:, None], inv_freq, dh, "half")
        k = reference._rope(qkv[:, hq * dh:(hq + hkv) * dh].reshape(b, hkv, dh), pos[:, None], inv_freq, dh, "half")
        v = qkv[:, (hq + hkv) * dh:].reshape(b, hkv, dh)
        hist_k = hist_k.at[np.arange(b), :, pos].set(k.astype(dtype))
        hist_v = hist_v.at[np.arange(b), :, pos].set(v.astype(dtype))
        first = np.maximum(np.asarray(pos) - window + 1, 0)
        n = np.asarray(pos) - first + 1
        idx = np.minimum(first[:, None] + np.arange(window)[None, :], total - 1)  # padded past n
        win_k, win_v = hist_k[rows, :, idx].transpose(0, 2, 1, 3), hist_v[rows, :, idx].transpose(0, 2, 1, 3)
        qg = (q * scale).reshape(b, hkv, group, dh)
        expected.append(reference.decode_attention(qg, win_k, win_v, jnp.asarray(n - 1, jnp.int32)))
    return qkvs, roll_k, roll_v, inv_freq, expected


@pytest.mark.parametrize("impl, splits", [("cuda", 1), ("cuda", 3), ("xla", None), ("reference", None)])
@pytest.mark.parametrize("group", [1, 3])
def test_append_rolling_attends_the_window_of_the_history(rng, impl, splits, group):
    """rolling=True over a window of 5 slots: rows that start empty, short of the window and
    past it, carried 9 steps (the buffer wraps); each step equals the window of the plain
    history, and the buffers end holding the last 5 positions."""
    window, lengths = 5, [0, 3, 11]
    qkvs, kc, vc, inv_freq, expected = windowed_history(rng, lengths, window, 9, 2, group, 16, "float32")
    step = jax.jit(lambda qkv, kc, vc, lengths: decode_attention_append(
        qkv, kc, vc, lengths, inv_freq, num_q_heads=2 * group, scale=0.25, rolling=True, impl=impl,
        config=_config(splits)))
    for i, (qkv, want) in enumerate(zip(qkvs, expected)):
        out, kc, vc = step(qkv, kc, vc, jnp.asarray(lengths, jnp.int32) + i)
        assert rel_l2(out, want) <= TOLERANCE["float32"], (i, rel_l2(out, want))


def test_append_rolling_rows_and_errors(rng):
    """Over a rolling buffer any length >= 0 is a position (no S_max bound); a negative one is
    an error when known, a NaN row that writes nothing when traced."""
    qkv, k, v, _, inv = make_append(rng, 2, 2, 2, 16, 4, "float32", [0, 0])
    kw = dict(num_q_heads=4, scale=0.25, rolling=True)
    out, k2, _ = decode_attention_append(qkv, k, v, jnp.asarray([100, 7], jnp.int32), inv, **kw, impl="cuda")
    assert np.isfinite(np.asarray(out)).all()
    changed = np.asarray(k2 != k).any(axis=(1, 3))
    assert [list(np.flatnonzero(c)) for c in changed] == [[0], [3]]  # slots 100 % 4 and 7 % 4
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        decode_attention_append(qkv, k, v, jnp.asarray([-1, 2], jnp.int32), inv, **kw)
    for impl in ("cuda", "xla", "reference"):
        f = jax.jit(lambda lengths, i=impl: decode_attention_append(qkv, k, v, lengths, inv, **kw, impl=i))
        out, k2, v2 = f(jnp.asarray([-1, 9], jnp.int32))
        assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all(), impl
        assert (np.asarray(k2[0]) == np.asarray(k[0])).all() and (np.asarray(v2[0]) == np.asarray(v[0])).all(), impl


def test_append_bad_arguments(rng):
    qkv, k, v, lengths, inv = make_append(rng, 2, 2, 2, 16, 9, "float32", [1, 2])
    kw = dict(num_q_heads=4, scale=0.25)
    with pytest.raises(ValueError, match="qkv must be float32"):
        decode_attention_append(qkv[:, :-1], k, v, lengths, inv, **kw)
    with pytest.raises(ValueError, match="qkv must be float32"):
        decode_attention_append(qkv.astype(jnp.bfloat16), k, v, lengths, inv, **kw)
    with pytest.raises(ValueError, match="multiple of"):
        decode_attention_append(qkv, k, v, lengths, inv, num_q_heads=3, scale=0.25)
    with pytest.raises(ValueError, match="inv_freq float32"):
        decode_attention_append(qkv, k, v, lengths, inv[:-1], **kw)
    with pytest.raises(ValueError, match="caches must be"):
        decode_attention_append(qkv, k, v.astype(jnp.float16), lengths, inv, **kw)
    with pytest.raises(ValueError, match="rope_layout"):
        decode_attention_append(qkv, k, v, lengths, inv, **kw, rope_layout="full")
    with pytest.raises(ValueError, match="lengths must be int32"):
        decode_attention_append(qkv, k, v, lengths.astype(jnp.int16), inv, **kw)
    with pytest.raises(ValueError, match="impl must be one of"):
        decode_attention_append(qkv, k, v, lengths, inv, **kw, impl="splitk")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_gpu_append_vs_reference(rng, dtype, case, splits):
    b, hkv, g, dh, s = case
    lengths = rng.integers(0, s, size=b)
    lengths[0], lengths[-1] = s - 1, 0
    check_append(make_append(rng, b, hkv, g, dh, s, dtype, lengths), device=_gpu(), splits=splits, group=g,
                 impl="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group, dh", [(1, 128), (4, 64), (8, 128)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_gpu_append_rolling_attends_the_window_of_the_history(rng, dtype, group, dh, splits):
    """The CUDA kernels (CUDA-core MHA, tensor-core GQA) over a rolling buffer of 300 slots,
    carried 4 steps from rows empty, short of the window, at its edge and wrapped: each step
    the window of the plain history."""
    window, lengths = 300, [0, 150, 298, 1234]
    qkvs, kc, vc, inv_freq, expected = windowed_history(rng, lengths, window, 4, 2, group, dh, dtype)
    kc, vc = jax.device_put((kc, vc), _gpu())
    step = jax.jit(lambda qkv, kc, vc, lengths: decode_attention_append(
        qkv, kc, vc, lengths, inv_freq, num_q_heads=2 * group, scale=dh ** -0.5, rolling=True, impl="cuda",
        config=_config(splits)))
    for i, (qkv, want) in enumerate(zip(qkvs, expected)):
        out, kc, vc = step(jax.device_put(qkv, _gpu()), kc, vc, jnp.asarray(lengths, jnp.int32) + i)
        assert rel_l2(out, want) <= TOLERANCE[dtype], (i, rel_l2(out, want))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dh", [128, 256])
def test_gpu_append_out_of_range_and_deterministic(rng, group, dh):
    for splits in (None, 1):  # caches untouched in out-of-range rows, merged or not
        args = make_append(rng, 3, 2, group, dh, 300, "bfloat16", [-1, 299, 300], rotary_dim=64)
        check_append(args, device=_gpu(), group=group, layout="interleaved", rotary_dim=64,
                     splits=splits, impl="cuda")
    args = jax.device_put(make_append(rng, 3, 8, 4, 128, 2048, "bfloat16", [2047, 5, 1000]), _gpu())
    f = jax.jit(lambda *a: decode_attention_append(*a, num_q_heads=32, scale=0.1, impl="cuda",
                                                   config=DecodeAttentionConfig(splits=16))[0])
    first = np.asarray(f(*args))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(*args)), first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_append_xla_and_auto(rng, dtype):
    args = make_append(rng, 3, 8, 4, 128, 1000, dtype, [999, 0, 500])
    for impl in ("xla", "auto"):
        check_append(args, device=_gpu(), group=4, impl=impl)


@pytest.mark.parametrize("bad", [-1, 9])
def test_concrete_out_of_range_lengths_are_an_error(rng, bad):
    """Lengths known at trace time are checked before anything runs (traced ones give NaN
    rows: test_append_cpu_out_of_range_rows)."""
    qkv, k, v, _, inv = make_append(rng, 2, 2, 2, 16, 9, "float32", [0, 3])
    lengths = jnp.asarray([3, bad], jnp.int32)
    with pytest.raises(ValueError, match=r"lengths must be in \[0, S_max=9\)"):
        decode_attention(qkv[:, :2 * 2 * 16].reshape(2, 2, 2, 16), k, v, lengths)
    with pytest.raises(ValueError, match=r"lengths must be in \[0, S_max=9\)"):
        decode_attention_append(qkv, k, v, lengths, inv, num_q_heads=4, scale=0.25)
