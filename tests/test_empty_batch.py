"""A batch of no rows: every decode op returns its empty output and leaves the caches as
they were, under every impl, without launching anything (a grid of no blocks is a CUDA
launch error). Runs on the default device: the kernels' paths on a GPU, the C++ handlers
on CPU (mla_decode's case is in test_mla_decode.py). Weights passed as something
other than a mapping are a TypeError naming it."""

import jax
import jax.numpy as jnp
import pytest

import jax_cluster as jc

IMPLS = ["auto", "cuda", "xla", "reference"]


@pytest.fixture(autouse=True, params=["default", pytest.param("gpu", marks=pytest.mark.gpu)])
def _device(request):
    """Every test twice: on the default device, and as a `gpu` test (run by `-m gpu`) on the GPU."""
    if request.param == "gpu":
        with jax.default_device(jax.devices("gpu")[0]):
            yield
    else:
        yield
B, D, HQ, HKV, DH, S, F = 0, 128, 4, 2, 64, 64, 256


def _arr(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape) * 0.1, dtype)


def _layer(rng):
    w = dict(norm=_arr(rng, (D,)), qkv=_arr(rng, (D, (HQ + 2 * HKV) * DH)), o=_arr(rng, (HQ * DH, D)),
             post_norm=_arr(rng, (D,)), w_gate=_arr(rng, (D, F)), w_up=_arr(rng, (D, F)), w_down=_arr(rng, (F, D)))
    caches = _arr(rng, (B, HKV, S, DH)), _arr(rng, (B, HKV, S, DH))
    return w, caches, jnp.zeros((B,), jnp.int32), jnp.ones((DH // 2,), jnp.float32)


def _same(out, expected):
    assert out.shape == expected.shape and out.dtype == expected.dtype, (out.shape, out.dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_ops_with_no_rows(rng, impl):
    w, (k, v), lengths, inv_freq = _layer(rng)
    x = _arr(rng, (B, D))
    y, k2, v2 = jc.attention_block(x, w["qkv"], w["o"], k, v, lengths, inv_freq, num_q_heads=HQ,
                                   num_kv_heads=HKV, norm_weight=w["norm"], residual=True, impl=impl)
    _same(y, x)
    _same(k2, k)
    _same(v2, v)
    q = _arr(rng, (B, HKV, HQ // HKV, DH))
    _same(jc.decode_attention(q, k, v, lengths, impl=impl), q)
    qkv = jnp.zeros((B, (HQ + 2 * HKV) * DH), jnp.float32)
    out, k2, _ = jc.decode_attention_append(qkv, k, v, lengths, inv_freq, num_q_heads=HQ, scale=DH ** -0.5,
                                            impl=impl)
    _same(out, q)
    _same(k2, k)


@pytest.mark.parametrize("impl", IMPLS)
def test_decoder_layer_with_no_rows(rng, impl):
    w, (k, v), lengths, inv_freq = _layer(rng)
    x = _arr(rng, (B, D))
    y, k2, _ = jc.decoder_layer(x, w, k, v, lengths, inv_freq, family="llama", num_q_heads=HQ, num_kv_heads=HKV,
                                eps=1e-5, impl=impl)
    _same(y, x)
    _same(k2, k)
    with pytest.raises(TypeError, match="decoder_layer: weights must be a mapping of names to arrays, got list"):
        jc.decoder_layer(x, list(w.values()), k, v, lengths, inv_freq, family="llama", num_q_heads=HQ,
                         num_kv_heads=HKV, eps=1e-5, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_moe_with_no_rows(rng, impl):
    x = _arr(rng, (0, 64))
    experts = _arr(rng, (8, 64, 32)), _arr(rng, (8, 64, 32)), _arr(rng, (8, 32, 64))
    _same(jc.moe_decode(x, _arr(rng, (64, 8)), *experts, top_k=2, impl=impl), x)


def test_no_rows_still_checks_impl_and_config(rng):
    """The early return for no rows comes after the checks of impl and config."""
    w, (k, v), lengths, inv_freq = _layer(rng)
    q = _arr(rng, (B, HKV, HQ // HKV, DH))
    with pytest.raises(ValueError, match="impl"):
        jc.decode_attention(q, k, v, lengths, impl="fast")
    with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
        jc.decode_attention(q, k, v, lengths, impl="xla", config=jc.DecodeAttentionConfig(splits=2))
    with pytest.raises(ValueError, match="impl"):
        jc.decoder_layer(_arr(rng, (B, D)), w, k, v, lengths, inv_freq, family="llama", num_q_heads=HQ,
                         num_kv_heads=HKV, eps=1e-5, impl="fast")
    with pytest.raises(ValueError, match="rope_layout"):
        jc.decoder_layer(_arr(rng, (B, D)), w, k, v, lengths, inv_freq, family="llama", num_q_heads=HQ,
                         num_kv_heads=HKV, eps=1e-5, rope_layout="neox")
