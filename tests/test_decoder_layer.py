"""decoder_layer: reference.decoder_layer (one decode step of a whole Llama or GPT-NeoX layer,
fp32) against the layer flax_models runs block by block (ops.attention_block_xla, then the
MLP), on the tiny presets' own weights and on random ones (GQA, partial rotary, biases,
parallel and sequential residual, exact and tanh GeLU), invalid rows under jit; then
jax_cluster.decoder_layer's per-op path ("auto", "xla") against the reference and the errors
it raises before anything runs."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models import ops
from flax_models.layers import layer_norm, rms_norm
from flax_models.presets import PRESETS, random_model
from jax_cluster import attention_block, decoder_layer, reference
from jax_cluster.testing import TOLERANCE, rel_l2

S_MAX = 24


def layer_weights(model, family):
    """The dict reference.decoder_layer takes, from layer 0 of a flax_models model."""
    layer = model.layers[0]
    w = dict(norm=layer.input_norm.weight[...], qkv=layer.qkv.kernel[...], qkv_bias=layer.qkv.bias_value(),
             o=layer.o.kernel[...], o_bias=layer.o.bias_value(), post_norm=layer.post_norm.weight[...])
    if family == "gpt_neox":
        w.update(norm_bias=layer.input_norm.bias[...], post_norm_bias=layer.post_norm.bias[...])
        w.update(layer.mlp.weights())
    else:
        w.update({k: v for k, v in layer.mlp.weights().items() if k.startswith("w_")})
    return w


def blockwise(x, w, kc, vc, lengths, inv_freq, *, family, num_q_heads, num_kv_heads, eps, rotary_dim,
              parallel_residual=False, gelu_approximate=False, rope_layout="half"):
    """The layer as flax_models' decode step runs it: attention block, then the MLP block."""
    norm = "rms" if family == "llama" else "layer"
    h, kc, vc = ops.attention_block_xla(
        x, w["qkv"], w["o"], kc, vc, lengths, inv_freq, norm_weight=w["norm"], norm_bias=w.get("norm_bias"),
        norm=norm, eps=eps, qkv_bias=w.get("qkv_bias"), o_bias=w.get("o_bias"), residual=True,
        rotary_dim=rotary_dim, rope_layout=rope_layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        scale=(kc.shape[-1]) ** -0.5)
    if family == "llama":
        y = ops.swiglu_mlp_xla(rms_norm(h, w["post_norm"], eps), w["w_gate"], w["w_up"], w["w_down"], residual=h)
    else:
        src = x if parallel_residual else h
        y = ops.gelu_mlp(layer_norm(src, w["post_norm"], w["post_norm_bias"], eps), w["w_in"], w.get("b_in"),
                         w["w_out"], w.get("b_out"), residual=h, approximate=gelu_approximate, impl="xla")
    return y, kc, vc


def caches(rng, batch, hkv, dh, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal((batch, hkv, S_MAX, dh)), dtype) for _ in range(2))


@pytest.mark.parametrize("preset,family", [("tiny-llama", "llama"), ("tiny-pythia", "gpt_neox")])
def test_preset_layer_matches_blockwise_decode(rng, preset, family):
    cfg = PRESETS[preset]
    model = random_model(cfg, jnp.float32, std=0.1)
    w = layer_weights(model, family)
    hkv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    kw = dict(family=family, num_q_heads=cfg.num_heads, num_kv_heads=hkv,
              eps=getattr(cfg, "rms_norm_eps", getattr(cfg, "layer_norm_eps", 1e-5)),
              rotary_dim=getattr(cfg, "rotary_dim", cfg.head_dim))
    if family == "gpt_neox":
        kw.update(parallel_residual=cfg.use_parallel_residual, gelu_approximate=cfg.hidden_act != "gelu")
    lengths = jnp.asarray([0, 9, S_MAX - 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
    kc, vc = caches(rng, 3, hkv, cfg.head_dim)
    y, k2, v2 = jax.jit(functools.partial(reference.decoder_layer, **kw))(x, w, kc, vc, lengths, model.inv_freq())
    by, bk, bv = jax.jit(functools.partial(blockwise, **kw))(x, w, kc, vc, lengths, model.inv_freq())
    assert rel_l2(y, by) <= TOLERANCE["float32"], rel_l2(y, by)
    np.testing.assert_allclose(k2, bk, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v2, bv, rtol=1e-5, atol=1e-5)


def random_weights(rng, family, d, hq, hkv, dh, f, bias):
    def m(*shape, scale=None):
        return jnp.asarray(rng.standard_normal(shape) * (shape[0] ** -0.5 if scale is None else scale), jnp.float32)

    w = dict(norm=m(d, scale=0.2) + 1, qkv=m(d, (hq + 2 * hkv) * dh), o=m(hq * dh, d), post_norm=m(d, scale=0.2) + 1)
    if bias:
        w.update(qkv_bias=m((hq + 2 * hkv) * dh, scale=0.1), o_bias=m(d, scale=0.1))
    if family == "llama":
        w.update(w_gate=m(d, f), w_up=m(d, f), w_down=m(f, d))
    else:
        w.update(norm_bias=m(d, scale=0.1), post_norm_bias=m(d, scale=0.1), w_in=m(d, f), w_out=m(f, d),
                 b_in=m(f, scale=0.1) if bias else None, b_out=m(d, scale=0.1) if bias else None)
    return w


@pytest.mark.parametrize("family,hq,hkv,dh,rotary,parallel,approx,layout", [
    ("llama", 8, 2, 16, 16, False, False, "half"),
    ("llama", 6, 6, 8, 8, False, False, "interleaved"),
    ("gpt_neox", 4, 4, 16, 4, True, False, "half"),
    ("gpt_neox", 4, 4, 16, 16, False, True, "half"),
    ("gpt_neox", 2, 2, 32, 8, True, True, "interleaved"),
])
@pytest.mark.parametrize("bias", [False, True])
def test_random_layers_match_blockwise_decode(rng, family, hq, hkv, dh, rotary, parallel, approx, layout, bias):
    d, f = 48, 80
    w = random_weights(rng, family, d, hq, hkv, dh, f, bias)
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rotary, rope_layout=layout)
    if family == "gpt_neox":
        kw.update(parallel_residual=parallel, gelu_approximate=approx)
    lengths = jnp.asarray([S_MAX - 1, 0, 5], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, d)), jnp.float32)
    kc, vc = caches(rng, 3, hkv, dh)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rotary, 2) / rotary), jnp.float32)
    y, _, _ = reference.decoder_layer(x, w, kc, vc, lengths, inv_freq, **kw)
    by, _, _ = blockwise(x, w, kc, vc, lengths, inv_freq, **kw)
    assert rel_l2(y, by) <= TOLERANCE["float32"], rel_l2(y, by)


def test_16bit_input_stays_fp32_inside(rng):
    """16-bit x, weights and caches: the math stays fp32 (only y and the new cache entries are
    rounded), so y is within the bf16 tolerance of the fp32 run on the same rounded inputs."""
    w = random_weights(rng, "llama", 64, 4, 2, 16, 96, True)
    kw = dict(family="llama", num_q_heads=4, num_kv_heads=2, eps=1e-5)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    kc, vc = caches(rng, 2, 2, 16)
    lengths = jnp.asarray([3, 20], jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, 16, 2) / 16), jnp.float32)
    w16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
    y16, _, _ = reference.decoder_layer(x.astype(jnp.bfloat16), w16, kc.astype(jnp.bfloat16),
                                        vc.astype(jnp.bfloat16), lengths, inv_freq, **kw)
    y32, _, _ = reference.decoder_layer(x.astype(jnp.bfloat16).astype(jnp.float32),
                                        jax.tree.map(lambda a: a.astype(jnp.float32), w16),
                                        kc.astype(jnp.bfloat16).astype(jnp.float32),
                                        vc.astype(jnp.bfloat16).astype(jnp.float32), lengths, inv_freq, **kw)
    assert y16.dtype == jnp.bfloat16
    assert rel_l2(y16, y32) <= TOLERANCE["bfloat16"], rel_l2(y16, y32)


def test_invalid_rows_are_nan_and_write_nothing(rng):
    w = random_weights(rng, "gpt_neox", 32, 2, 2, 16, 64, True)
    kw = dict(family="gpt_neox", num_q_heads=2, num_kv_heads=2, eps=1e-5, rotary_dim=4, parallel_residual=True)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    kc, vc = caches(rng, 3, 2, 16)
    lengths = jnp.asarray([-1, 4, S_MAX], jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, 4, 2) / 4), jnp.float32)
    y, k2, v2 = jax.jit(functools.partial(reference.decoder_layer, **kw))(x, w, kc, vc, lengths, inv_freq)
    y = np.asarray(y)
    assert np.all(np.isnan(y[[0, 2]])) and not np.any(np.isnan(y[1]))
    np.testing.assert_array_equal(np.asarray(k2)[[0, 2]], np.asarray(kc)[[0, 2]])


def test_unknown_family():
    with pytest.raises(ValueError, match="family must be"):
        reference.decoder_layer(jnp.zeros((1, 8)), {}, None, None, None, None, family="mamba", num_q_heads=1,
                                num_kv_heads=1, eps=1e-5)


# ----------------------------------------------------------------------------- the op
def case(rng, family, dtype, *, hq=4, hkv=2, dh=16, d=64, f=128, rotary=16, bias=True):
    w = jax.tree.map(lambda a: a.astype(dtype), random_weights(rng, family, d, hq, hkv, dh, f, bias))
    kc, vc = caches(rng, 3, hkv, dh, dtype)
    args = dict(x=jnp.asarray(rng.standard_normal((3, d)), dtype), weights=w, k_cache=kc, v_cache=vc,
                lengths=jnp.asarray([0, 11, S_MAX - 1], jnp.int32),
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, rotary, 2) / rotary), jnp.float32))
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rotary)
    return args, kw


@pytest.mark.filterwarnings("ignore:.*no kernel for dtype float32")
@pytest.mark.parametrize("impl", ["xla", "auto"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,extra", [("llama", {}), ("gpt_neox", dict(parallel_residual=True)),
                                          ("gpt_neox", dict(parallel_residual=False, gelu_approximate=True))])
def test_per_op_path_matches_reference(rng, impl, dtype, family, extra):
    args, kw = case(rng, family, jnp.dtype(dtype), hkv=4 if family == "gpt_neox" else 2,
                    rotary=4 if family == "gpt_neox" else 16)
    y, kc, vc = jax.jit(functools.partial(decoder_layer, impl=impl, **kw, **extra))(**args)
    ry, rk, rv = jax.jit(functools.partial(decoder_layer, impl="reference", **kw, **extra))(**args)
    assert y.dtype == jnp.dtype(dtype)
    assert rel_l2(y, ry) <= TOLERANCE[dtype], rel_l2(y, ry)
    assert rel_l2(kc, rk) <= TOLERANCE[dtype] and rel_l2(vc, rv) <= TOLERANCE[dtype]


def test_errors_before_anything_runs(rng):
    args, kw = case(rng, "llama", jnp.float32)
    with pytest.raises(ValueError, match="family must be"):
        decoder_layer(**args, **dict(kw, family="mamba"))
    with pytest.raises(ValueError, match="missing \\['w_up'\\]"):
        decoder_layer(**dict(args, weights={k: v for k, v in args["weights"].items() if k != "w_up"}), **kw)
    with pytest.raises(ValueError, match="unknown \\['w_in'\\]"):
        decoder_layer(**dict(args, weights=dict(args["weights"], w_in=args["weights"]["w_gate"])), **kw)
    with pytest.raises(ValueError, match="lengths must be in"):
        decoder_layer(**dict(args, lengths=jnp.asarray([0, 1, S_MAX], jnp.int32)), **kw)
    with pytest.raises(ValueError, match="w_down'\\] has shape"):
        decoder_layer(**dict(args, weights=dict(args["weights"], w_down=args["weights"]["w_gate"])), **kw)
    with pytest.raises(ValueError, match="weights\\['qkv'\\] has shape"):
        decoder_layer(**dict(args, weights=dict(args["weights"], qkv=args["weights"]["o"])), **kw)
    with pytest.raises(ValueError, match="rotary_dim"):
        decoder_layer(**args, **dict(kw, rotary_dim=7))
    with pytest.raises(ValueError, match="impl must be"):
        decoder_layer(**args, **kw, impl="fast")
    for impl in ("auto", "cuda", "xla"):  # every path names the argument under decoder_layer's name
        with pytest.raises(ValueError, match="decoder_layer: weights\\['o'\\] has dtype bfloat16; every weight"):
            decoder_layer(**dict(args, weights=dict(args["weights"], o=args["weights"]["o"].astype(jnp.bfloat16))),
                          **kw, impl=impl)
        with pytest.raises(ValueError, match="decoder_layer: v_cache has dtype float16"):
            decoder_layer(**dict(args, v_cache=args["v_cache"].astype(jnp.float16)), **kw, impl=impl)
    with pytest.raises(ValueError, match="decoder_layer: x must be float16, bfloat16 or float32, got int32"):
        decoder_layer(**dict(args, x=args["x"].astype(jnp.int32)), **kw)
    for eps in (-1e-5, float("nan"), "1e-5"):  # a negative eps makes the norm NaN on small rows
        with pytest.raises(ValueError, match="decoder_layer: eps must be a finite number >= 0"):
            decoder_layer(**args, **dict(kw, eps=eps))
        w = args["weights"]
        with pytest.raises(ValueError, match="attention_block: eps must be a finite number >= 0"):
            attention_block(args["x"], w["qkv"], w["o"], args["k_cache"], args["v_cache"], args["lengths"],
                            args["inv_freq"], num_q_heads=kw["num_q_heads"], num_kv_heads=kw["num_kv_heads"],
                            norm_weight=w["norm"], eps=eps)
    neox, nkw = case(rng, "gpt_neox", jnp.float32, hkv=4, rotary=4)
    with pytest.raises(ValueError, match="missing \\['norm_bias'\\]"):
        decoder_layer(**dict(neox, weights={k: v for k, v in neox["weights"].items() if k != "norm_bias"}), **nkw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family,extra", [("llama", {}), ("gpt_neox", dict(parallel_residual=True)),
                                          ("gpt_neox", dict(gelu_approximate=True, rope_layout="interleaved"))])
def test_cpu_handler_matches_reference(rng, dtype, family, extra):
    """impl="cuda" on CPU: the custom call's C++ handler (the one-launch kernel's contract)."""
    if jax.default_backend() == "gpu":
        pytest.skip("the CPU handler")
    args, kw = case(rng, family, jnp.dtype(dtype), hkv=4 if family == "gpt_neox" else 2,
                    rotary=8 if family == "gpt_neox" else 16, bias=family == "gpt_neox")
    y, kc, vc = jax.jit(functools.partial(decoder_layer, impl="cuda", **kw, **extra))(**args)
    ry, rk, rv = jax.jit(functools.partial(decoder_layer, impl="reference", **kw, **extra))(**args)
    assert rel_l2(y, ry) <= TOLERANCE[dtype], rel_l2(y, ry)
    np.testing.assert_array_equal(np.asarray(kc, np.float32) != np.asarray(args["k_cache"], np.float32),
                                  np.asarray(rk, np.float32) != np.asarray(args["k_cache"], np.float32))
    assert rel_l2(vc, rv) <= TOLERANCE[dtype]


def test_cpu_handler_invalid_rows_and_vmap(rng):
    if jax.default_backend() == "gpu":
        pytest.skip("the CPU handler")
    args, kw = case(rng, "llama", jnp.float32)
    bad = dict(args, lengths=jnp.asarray([-1, 3, S_MAX], jnp.int32))
    y, kc, _ = jax.jit(functools.partial(decoder_layer, impl="cuda", **kw))(**bad)
    assert np.all(np.isnan(np.asarray(y)[[0, 2]])) and not np.any(np.isnan(np.asarray(y)[1]))
    np.testing.assert_array_equal(np.asarray(kc)[[0, 2]], np.asarray(args["k_cache"])[[0, 2]])
    two = [case(rng, "llama", jnp.float32)[0] for _ in range(2)]
    w = two[0]["weights"]
    stack = lambda k: jnp.stack([t[k] for t in two])  # noqa: E731
    fn = functools.partial(decoder_layer, impl="cuda", **kw)
    ys, _, _ = jax.vmap(lambda x, k, v, n: fn(x, w, k, v, n, two[0]["inv_freq"]))(
        stack("x"), stack("k_cache"), stack("v_cache"), stack("lengths"))
    for i, t in enumerate(two):
        ry, _, _ = decoder_layer(**dict(t, weights=w), impl="reference", **kw)
        assert rel_l2(ys[i], ry) <= TOLERANCE["float32"]


@pytest.mark.filterwarnings("ignore:.*no kernel for dtype float32")
@pytest.mark.parametrize("impl", ["cuda", "xla", "auto"])
@pytest.mark.parametrize("family,extra", [("llama", {}), ("gpt_neox", dict(parallel_residual=True))])
def test_rolling_buffer_matches_reference(rng, impl, family, extra):
    """rolling=True (a sliding window's rolling buffer of S_MAX slots): rows short of the buffer,
    just past it and wrapped several times; the new k, v go to slot lengths % S_MAX only, and
    the C++ handler ("cuda" on CPU) and the per-op path ("xla", "auto") match the reference.
    Short of the buffer it is the plain step; a negative length is an error when known."""
    if impl == "cuda" and jax.default_backend() == "gpu":
        pytest.skip("the CPU handler")
    args, kw = case(rng, family, jnp.float32, hkv=4 if family == "gpt_neox" else 2,
                    rotary=8 if family == "gpt_neox" else 16, bias=family == "gpt_neox")
    lengths = [5, S_MAX + 1, 3 * S_MAX + 7]
    args = dict(args, lengths=jnp.asarray(lengths, jnp.int32))
    y, kc, vc = jax.jit(functools.partial(decoder_layer, impl=impl, rolling=True, **kw, **extra))(**args)
    ry, rk, rv = jax.jit(functools.partial(decoder_layer, impl="reference", rolling=True, **kw, **extra))(**args)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_l2(y, ry) <= TOLERANCE["float32"], rel_l2(y, ry)
    changed = np.asarray(kc != args["k_cache"]).any(axis=(1, 3))
    assert [list(np.flatnonzero(c)) for c in changed] == [[n % S_MAX] for n in lengths]
    assert rel_l2(kc, rk) <= TOLERANCE["float32"] and rel_l2(vc, rv) <= TOLERANCE["float32"]
    short = dict(args, lengths=jnp.asarray([0, 9, S_MAX - 1], jnp.int32))
    for got, want in zip(decoder_layer(**short, impl="reference", rolling=True, **kw, **extra),
                         decoder_layer(**short, impl="reference", **kw, **extra)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        decoder_layer(**dict(args, lengths=jnp.asarray([-1, 0, 0], jnp.int32)), rolling=True, **kw, **extra)


# ----------------------------------------------------------------------------- auto's choice of path
@pytest.fixture
def fake_gpu_tuner(monkeypatch, tmp_path):
    """decoder_layer's auto path as on a GPU, with a fresh tuning cache and a stand-in for the
    timings: returns (the times measure() reports per path, the paths it was asked for). The
    chosen one-launch path then runs the custom call's CPU handler."""
    from jax_cluster import tuning
    from jax_cluster.ops import decoder_layer as mod

    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path / "tuning.json"))
    monkeypatch.delenv(tuning.ENV_ENABLE, raising=False)
    tuning.clear_memory_cache()
    monkeypatch.setattr(mod, "on_gpu", lambda: True)
    times, asked = {}, []

    def measure(path, **shape):
        asked.append((path, shape["batch"], shape["family"], shape["max_seq"]))
        return times[path]

    monkeypatch.setattr(mod, "measure", measure)
    yield times, asked
    tuning.clear_memory_cache()


def kernel_case(rng, family, batch=3, s_max=S_MAX):
    """A bfloat16 layer the one-launch kernel covers (head_dim 64)."""
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), random_weights(rng, family, 128, 4, 2, 64, 256, True))
    args = dict(x=jnp.asarray(rng.standard_normal((batch, 128)), jnp.bfloat16), weights=w,
                k_cache=jnp.asarray(rng.standard_normal((batch, 2, s_max, 64)), jnp.bfloat16),
                v_cache=jnp.asarray(rng.standard_normal((batch, 2, s_max, 64)), jnp.bfloat16),
                lengths=jnp.asarray(np.arange(batch) * 5 % s_max, jnp.int32),
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, 64, 2) / 64), jnp.float32))
    return args, dict(family=family, num_q_heads=4, num_kv_heads=2, eps=1e-5)


def lowered(args, **kw):
    return jax.jit(functools.partial(decoder_layer, **kw)).lower(**args).as_text()


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_auto_runs_the_path_the_tuner_measured_faster(rng, fake_gpu_tuner, family):
    times, asked = fake_gpu_tuner
    args, kw = kernel_case(rng, family)
    times.update(per_op=2e-6, one_launch=1e-6)
    assert "jax_cluster_decoder_layer" in lowered(args, impl="auto", **kw)
    assert sorted({a[0] for a in asked}) == ["one_launch", "per_op"] and all(a[1] == 3 for a in asked)
    y, _, _ = jax.jit(functools.partial(decoder_layer, impl="auto", **kw))(**args)
    ry, _, _ = decoder_layer(**args, impl="reference", **kw)
    assert rel_l2(y, ry) <= TOLERANCE["bfloat16"]
    n = len(asked)
    times.update(per_op=1e-6, one_launch=2e-6)  # the cached pick stands: nothing is measured again
    assert "jax_cluster_decoder_layer" in lowered(args, impl="auto", **kw) and len(asked) == n
    other, _ = kernel_case(rng, family, batch=2)  # another shape is measured for itself
    assert "jax_cluster_decoder_layer" not in lowered(other, impl="auto", **kw) and len(asked) > n


@pytest.mark.filterwarnings("ignore:.*no kernel for dtype")
def test_auto_over_a_rolling_buffer_runs_the_kernel_where_it_covers(rng, fake_gpu_tuner):
    """rolling=True under impl="auto" on a GPU: the one-launch kernel wherever it covers the
    shapes, without asking the tuner (it times plain caches); else, without a warning, XLA's
    projections around decode_attention_append."""
    times, asked = fake_gpu_tuner
    args, kw = kernel_case(rng, "llama")
    args = dict(args, lengths=jnp.asarray([3, S_MAX, 5 * S_MAX + 2], jnp.int32))
    assert "jax_cluster_decoder_layer" in lowered(args, impl="auto", rolling=True, **kw) and not asked
    wide, _ = kernel_case(rng, "llama", batch=9)  # more rows than the kernel takes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = lowered(wide, impl="auto", rolling=True, **kw)
    assert "jax_cluster_decoder_layer" not in text and "jax_cluster_decode_attention_append" in text and not asked


def test_auto_times_every_capacity_of_a_bucket_alike(rng, fake_gpu_tuner):
    """Caches in one context bucket share a pick, timed at the bucket's capacity whichever
    comes first (as attention_block's tuner times); a length XLA pads (not a multiple of 32)
    is keyed apart and timed 16 slots short of the bucket."""
    from jax_cluster import tuning
    times, asked = fake_gpu_tuner
    times.update(per_op=2e-6, one_launch=1e-6)
    _, kw = kernel_case(rng, "llama")
    measured = []
    for s_max in (1000, 1024, 1008, 1152, 1088):
        n = len(asked)
        lowered(kernel_case(rng, "llama", s_max=s_max)[0], impl="auto", **kw)
        measured.append(sorted({a[3] for a in asked[n:]}))
    assert tuning.context_bucket(1000) == tuning.context_bucket(1008) == 1024
    assert measured == [[1008], [1024], [], [1152], []]


@pytest.mark.filterwarnings("ignore:.*no kernel for dtype float32")
def test_auto_without_a_choice_to_make(rng, fake_gpu_tuner, monkeypatch):
    """one_launch=True / False fix the path; layers the kernel does not cover and tuning turned
    off run the per-op path; none of them measures anything."""
    times, asked = fake_gpu_tuner
    times.update(per_op=2e-6, one_launch=1e-6)
    args, kw = kernel_case(rng, "llama")
    assert "jax_cluster_decoder_layer" not in lowered(args, impl="auto", one_launch=False, **kw)
    assert "jax_cluster_decoder_layer" in lowered(args, impl="auto", one_launch=True, **kw)
    big, _ = kernel_case(rng, "llama", batch=9)  # more rows than the kernel takes
    assert "jax_cluster_decoder_layer" not in lowered(big, impl="auto", **kw)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, args)  # 16-bit only
    assert "jax_cluster_decoder_layer" not in lowered(f32, impl="auto", **kw)
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    assert "jax_cluster_decoder_layer" not in lowered(args, impl="auto", **kw)
    assert asked == []


# ----------------------------------------------------------------------------- the kernel's plan
def test_kernel_refuses_inputs_its_chunks_cannot_stage():
    """A GEMV input longer than K chunks x staging buffer over the staged rows (a 405B-class MLP
    at batch 5-8) is named before any launch, not planned into chunks past the partials."""
    from jax_cluster import _extension

    wide = dict(_extension.plans().decoder_layer(8, 16384, 128, 16, 128, 4096, 53248, 0, False, "bfloat16"))
    assert wide["error"] == "" and "53248" in wide["cuda_error"] and "staged rows" in wide["cuda_error"]
    one_row = dict(_extension.plans().decoder_layer(1, 16384, 128, 16, 128, 4096, 53248, 0, False, "bfloat16"))
    assert one_row["cuda_error"] == ""


@pytest.mark.parametrize("shape", [
    # d, f, hq, hkv, dh, mlp (0 SwiGLU, 1 GeLU), parallel
    (4096, 11008, 32, 32, 128, 0, False),   # llama-2-7b
    (2048, 8192, 32, 8, 64, 0, False),      # llama-3.2-1b
    (2560, 10240, 32, 32, 80, 1, True),     # pythia-2.8b
    (4096, 16384, 32, 32, 128, 1, False),   # pythia-6.9b, sequential
    (2048, 8192, 8, 8, 256, 1, True),       # pythia-1b: head_dim 256
    (320, 520, 16, 2, 80, 0, False),        # widths off every tile
    (200, 456, 4, 4, 96, 1, True),
])
@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_kernel_plan_stays_inside_its_workspace(shape, batch):
    """The one-launch kernel writes exactly the regions its plan names; for every grid those fit
    the workspace the op declares from the shapes alone (a partials region too small once let
    one GEMV's partials run into the activations)."""
    from jax_cluster import _extension

    d, f, hq, hkv, dh, mlp, parallel = shape
    for s_max in (17, 4100):
        base = dict(_extension.plans().decoder_layer(batch, d, hq, hkv, dh, s_max, f, mlp, parallel, "bfloat16"))
        assert base["error"] == "" and base["cuda_error"] == ""
        for grid in (1, 66, 132, 264, 1024):
            lay = dict(_extension.plans().decoder_layer(batch, d, hq, hkv, dh, s_max, f, mlp, parallel,
                                                        "bfloat16", grid=grid)["layout"])
            names = ["counters", "partials", "qkv", "attn_partial", "attn", "h", "h_stats", "act", "timeline",
                     "floats"]
            offs = [lay[n] for n in names]
            assert offs == sorted(offs) and lay["floats"] == base["workspace_floats"]
            size = {n: offs[i + 1] - offs[i] for i, n in enumerate(names[:-1])}
            assert lay["counter_words"] <= size["counters"]
            used = []
            items = batch * hkv
            counters = [(lay["splits_done_off"], lay["splits_done_off"] + items),
                        (lay["merged_off"], lay["merged_off"] + items)]
            assert lay["merged_off"] + items <= lay["counter_words"]
            for i, g in enumerate(lay["gemvs"]):
                if g["n"] == 0:
                    continue  # the parallel residual has no separate MLP down
                virt = 2 * g["n"] if g["paired"] else g["n"]
                assert g["tiles"] * g["tile_cols"] >= virt and g["tile_cols"] == 256
                assert 1 <= g["chunks"] <= lay["max_chunks"]
                assert (g["chunks"] - 1) * g["chunk_rows"] < g["k"] <= g["chunks"] * g["chunk_rows"]
                # the kernel stages its NB >= batch rows: batch 3 stages 4, batch 5 stages 8
                assert lay["staged_rows"] * g["chunk_rows"] <= lay["stage_floats"] and g["chunk_rows"] % 32 == 0
                counters.append((g["tile_counter_off"], g["tile_counter_off"] + g["tiles"]))
                counters.append((g["tile_ready_off"], g["tile_ready_off"] + g["tiles"]))
                end = g["partial_off"] + g["chunks"] * batch * g["tiles"] * g["tile_cols"]
                assert end <= size["partials"], (i, grid)
                used.append((g["partial_off"], end))
            # phases overlap in time (no grid barriers): every GEMV's partials and every
            # counter range of its own
            for spans in (used, counters):
                spans.sort()
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
            assert 1 <= lay["splits"] <= lay["max_splits"]
            group = hq // hkv
            assert size["attn_partial"] >= batch * hkv * (lay["splits"] * group * (dh + 2) + 2 * dh)
            assert size["qkv"] >= batch * (hq + 2 * hkv) * dh and size["attn"] >= batch * hq * dh
            assert size["h_stats"] >= lay["gemvs"][2]["tiles"] * batch * 2 and size["act"] >= batch * f
            assert size["timeline"] * 4 >= 8 * (1 + 1024 * base["timeline_marks"])


def _most_per_block(gemvs, grid):
    """The most weight (plus 64 KB per unit) any block streams when the GEMVs' units are handed
    out block-strided in one sequence, chunk-major (the kernel's each_unit)."""
    loads = np.zeros(grid)
    at = 0
    for g in gemvs:
        for chunk in range(g["chunks"]):
            rows = min(g["chunk_rows"], g["k"] - chunk * g["chunk_rows"])
            for _ in range(g["tiles"]):
                loads[at % grid] += rows * g["tile_cols"] * 2 + 65536
                at += 1
    return loads.max()


@pytest.mark.parametrize("shape", [
    # d, f, hq, dh: GPT-NeoX with the parallel residual
    (4096, 16384, 32, 128),   # pythia-6.9b
    (2560, 10240, 32, 80),    # pythia-2.8b
    (2048, 8192, 8, 256),     # pythia-1b
    (1024, 4096, 16, 64),     # pythia-410m
])
@pytest.mark.parametrize("batch", [1, 8])
def test_parallel_up_front_plan_balances_the_blocks(shape, batch):
    """The parallel residual's first phase hands out QKV's units and then MLP up's in one
    block-strided sequence: the plan's chunk counts leave no block more to stream than any
    other choice of up to 16 chunks each would."""
    from jax_cluster import _extension

    d, f, hq, dh = shape
    grid = 264
    lay = dict(_extension.plans().decoder_layer(batch, d, hq, hq, dh, 4096, f, 1, True, "float16",
                                                grid=grid)["layout"])
    qkv, up = lay["gemvs"][0], lay["gemvs"][1]
    staged = lay["staged_rows"]
    best = float("inf")
    for c1 in range(1, 17):
        for c2 in range(1, 17):
            pair = []
            for g, c in ((qkv, c1), (up, c2)):
                rows = -(-(-(-g["k"] // c)) // 32) * 32
                pair.append(dict(g, chunk_rows=rows, chunks=-(-g["k"] // rows)))
            if all(staged * p["chunk_rows"] <= lay["stage_floats"] for p in pair):
                best = min(best, _most_per_block(pair, grid))
    assert _most_per_block([qkv, up], grid) <= best
