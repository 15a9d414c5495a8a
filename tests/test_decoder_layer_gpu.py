"""decoder_layer's one-launch CUDA kernel against the fp32 reference: Llama (RMSNorm, SwiGLU,
GQA 1/4/8) and GPT-NeoX (LayerNorm, biases, partial rotary, parallel and sequential residual,
exact and tanh GeLU), head_dim 64/80/96/128/256, batch 1/3/8, float16 and bfloat16, widths that
are not multiples of the 64-column tiles, lengths at both ends of the cache and invalid rows;
bitwise reproducibility over 20 runs; auto's choice between the kernel and the per-op path."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import decoder_layer
from jax_cluster.testing import TOLERANCE, rel_l2

pytestmark = pytest.mark.gpu


def make_case(seed, family, dtype, *, batch, d, f, hq, hkv, dh, s_max, rotary=None, bias=False):
    rng = np.random.default_rng(seed)

    def m(*shape, scale=None):
        a = rng.standard_normal(shape) * (shape[0] ** -0.5 if scale is None else scale)
        return jnp.asarray(a, jnp.float32).astype(dtype)

    cols = (hq + 2 * hkv) * dh
    w = dict(norm=m(d, scale=0.2) + 1, qkv=m(d, cols), o=m(hq * dh, d), post_norm=m(d, scale=0.2) + 1)
    if bias:
        w.update(qkv_bias=m(cols, scale=0.1), o_bias=m(d, scale=0.1))
    if family == "llama":
        w.update(w_gate=m(d, f), w_up=m(d, f), w_down=m(f, d))
    else:
        w.update(norm_bias=m(d, scale=0.1), post_norm_bias=m(d, scale=0.1), w_in=m(d, f), w_out=m(f, d))
        if bias:
            w.update(b_in=m(f, scale=0.1), b_out=m(d, scale=0.1))
    rot = dh if rotary is None else rotary
    lengths = rng.integers(0, s_max, batch).astype(np.int32)
    lengths[0] = s_max - 1
    if batch > 1:
        lengths[1] = 0
    args = dict(x=m(batch, d, scale=1.0), weights=w,
                k_cache=m(batch, hkv, s_max, dh, scale=1.0), v_cache=m(batch, hkv, s_max, dh, scale=1.0),
                lengths=jnp.asarray(lengths), inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, rot, 2) / rot), jnp.float32))
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rot)
    return args, kw


def run(impl, args, kw, **extra):
    return jax.jit(functools.partial(decoder_layer, impl=impl, **kw, **extra))(**args)


def check_against_reference(args, kw, dtype, **extra):
    y, kc, vc = run("cuda", args, kw, **extra)
    ry, rk, rv = run("reference", args, kw, **extra)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert y.dtype == args["x"].dtype
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    assert rel_l2(kc, rk) <= tol and rel_l2(vc, rv) <= tol
    return y, kc, vc


CONFIGS = [  # family, d, f, hq, hkv, dh, rotary, bias, extra
    ("llama", 256, 688, 8, 2, 64, None, False, {}),                                 # GQA 4
    ("llama", 512, 1376, 4, 4, 128, None, False, dict(rope_layout="interleaved")),  # MHA
    ("llama", 320, 520, 16, 2, 80, None, True, {}),                                 # GQA 8, biases
    ("gpt_neox", 384, 1536, 4, 4, 96, 24, True, dict(parallel_residual=True)),
    ("gpt_neox", 320, 1280, 4, 4, 80, 20, True, dict(parallel_residual=False, gelu_approximate=True)),
    ("gpt_neox", 256, 1024, 2, 2, 128, 32, False, dict(parallel_residual=True, gelu_approximate=True)),
    ("gpt_neox", 512, 2048, 2, 2, 256, 64, True, dict(parallel_residual=True)),     # Pythia-1B's heads
    ("llama", 512, 1024, 8, 1, 256, None, False, {}),                               # MQA 8 (Gemma-2B's heads)
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-d{c[1]}-h{c[3]}x{c[4]}-dh{c[5]}")
def test_kernel_matches_reference(dtype, batch, config):
    family, d, f, hq, hkv, dh, rotary, bias, extra = config
    args, kw = make_case(batch * 7 + dh, family, dtype, batch=batch, d=d, f=f, hq=hq, hkv=hkv, dh=dh, s_max=300,
                         rotary=rotary, bias=bias)
    check_against_reference(args, kw, dtype, **extra)


@pytest.mark.parametrize("s_max", [17, 4100])
def test_long_and_short_caches(s_max):
    """Many token splits (4100 slots) and one (17): the same results as the reference."""
    args, kw = make_case(s_max, "llama", jnp.bfloat16, batch=2, d=512, f=1024, hq=8, hkv=2, dh=128, s_max=s_max)
    check_against_reference(args, kw, jnp.bfloat16)


def test_large_model_width():
    """Llama-3.2-1B's widths (hidden 2048, MLP 8192, 32 x 8 heads of 64), two layers' worth."""
    args, kw = make_case(5, "llama", jnp.bfloat16, batch=1, d=2048, f=8192, hq=32, hkv=8, dh=64, s_max=1024)
    check_against_reference(args, kw, jnp.bfloat16)


def test_bitwise_reproducible():
    args, kw = make_case(11, "gpt_neox", jnp.bfloat16, batch=3, d=512, f=2048, hq=4, hkv=4, dh=128, s_max=2000,
                         rotary=32, bias=True)
    first = [np.asarray(a) for a in run("cuda", args, kw, parallel_residual=True)]
    for _ in range(19):
        again = run("cuda", args, kw, parallel_residual=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3]], ids=lambda c: f"{c[0]}-h{c[3]}x{c[4]}")
@pytest.mark.parametrize("s_max", [64, 1300])
def test_rolling_buffer(config, s_max):
    """rolling=True: rows short of the buffer, at its last slot, one past it and wrapped many
    times (the skipped slot at the start, the middle and the end of a split); the kernel's
    step against the reference, its new k, v at slot lengths % S_max only, and the same bits
    as the plain step where the buffer is not yet full."""
    family, d, f, hq, hkv, dh, rotary, bias, extra = config
    args, kw = make_case(s_max, family, jnp.bfloat16, batch=5, d=d, f=f, hq=hq, hkv=hkv, dh=dh, s_max=s_max,
                         rotary=rotary, bias=bias)
    lengths = [7, s_max - 1, s_max, 5 * s_max + s_max // 2, 9 * s_max + s_max - 2]
    rolled = dict(args, lengths=jnp.asarray(lengths, jnp.int32))
    y, kc, _ = check_against_reference(rolled, kw, jnp.bfloat16, rolling=True, **extra)
    changed = np.asarray(kc != rolled["k_cache"]).any(axis=(1, 3))
    assert [list(np.flatnonzero(c)) for c in changed] == [[n % s_max] for n in lengths]
    short = dict(args, lengths=jnp.asarray([7, s_max - 1, 0, 3, 1], jnp.int32))
    for a, b in zip(run("cuda", short, kw, rolling=True, **extra), run("cuda", short, kw, **extra)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_invalid_rows_are_nan_and_write_nothing():
    args, kw = make_case(3, "llama", jnp.bfloat16, batch=3, d=256, f=512, hq=4, hkv=2, dh=64, s_max=64)
    bad = dict(args, lengths=jnp.asarray([-1, 7, 64], jnp.int32))
    y, kc, _ = jax.jit(functools.partial(decoder_layer, impl="cuda", **kw))(**bad)
    y = np.asarray(y, np.float32)
    assert np.all(np.isnan(y[[0, 2]])) and not np.any(np.isnan(y[1]))
    np.testing.assert_array_equal(np.asarray(kc)[[0, 2]], np.asarray(args["k_cache"])[[0, 2]])


def test_vmap_folds_into_rows():
    args, kw = make_case(4, "llama", jnp.bfloat16, batch=2, d=256, f=512, hq=4, hkv=2, dh=64, s_max=64)
    other, _ = make_case(5, "llama", jnp.bfloat16, batch=2, d=256, f=512, hq=4, hkv=2, dh=64, s_max=64)
    stack = lambda k: jnp.stack([args[k], other[k]])  # noqa: E731
    fn = functools.partial(decoder_layer, impl="cuda", **kw)
    ys, _, _ = jax.jit(jax.vmap(lambda x, k, v, n: fn(x, args["weights"], k, v, n, args["inv_freq"])))(
        stack("x"), stack("k_cache"), stack("v_cache"), stack("lengths"))
    for i, t in enumerate((args, other)):
        ry, _, _ = run("reference", dict(t, weights=args["weights"]), kw)
        assert rel_l2(ys[i], ry) <= TOLERANCE["bfloat16"]


def test_auto_runs_the_kernel_where_asked_and_covered():
    """one_launch=True / False under auto (None: the tuner's pick, tests/test_decoder_layer.py)."""
    args, kw = make_case(6, "llama", jnp.bfloat16, batch=2, d=256, f=512, hq=4, hkv=2, dh=64, s_max=64)
    lower = lambda a, **o: jax.jit(functools.partial(decoder_layer, **kw, **o)).lower(**a).as_text()  # noqa: E731
    assert "jax_cluster_decoder_layer" not in lower(args, impl="auto", one_launch=False)
    assert "jax_cluster_decoder_layer" in lower(args, impl="auto", one_launch=True)
    big, _ = make_case(6, "llama", jnp.bfloat16, batch=9, d=256, f=512, hq=4, hkv=2, dh=64, s_max=64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hlo = lower(big, impl="auto", one_launch=True)
    assert "jax_cluster_decoder_layer" not in hlo
    assert any("batch 9" in str(w.message) for w in seen)
    with pytest.raises(ValueError, match="batch 9"):
        decoder_layer(**big, **kw, impl="cuda")
