"""Unit tests of the model building blocks (no torch needed): RoPE, ops dispatch, MoE, cache
consistency of every architecture (prefill + decode == full forward), dtypes."""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models import attention, moe, ops, rope
from flax_models.config import RopeConfig
from flax_models.engine import decode_routes
from flax_models.presets import PRESETS, random_model


def test_import_does_not_import_jax_cluster():
    code = "import sys, flax_models, flax_models.generate; print('jax_cluster' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- rope
def test_rope_layouts_are_permutations_of_each_other():
    x = jax.random.normal(jax.random.key(0), (3, 2, 16))
    inv = rope.inv_frequencies(RopeConfig(), 16)
    cos, sin = rope.cos_sin(jnp.arange(3), inv)
    cos, sin = cos[:, None], sin[:, None]
    perm = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])  # pairs -> halves
    inter = rope.apply_rope(x, cos, sin, "interleaved")
    half = rope.apply_rope(x[..., perm], cos, sin, "half")
    np.testing.assert_allclose(inter[..., perm], half, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(inter, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_partial_rotary_passes_the_rest_through():
    x = jax.random.normal(jax.random.key(1), (4, 2, 20))
    cos, sin = rope.cos_sin(jnp.arange(4) + 7, rope.inv_frequencies(RopeConfig(), 8))
    y = rope.apply_rope(x, cos[:, None], sin[:, None], "half")
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
    assert not np.allclose(y[..., :8], x[..., :8])


def test_rope_position_zero_is_identity_and_relative():
    q = jax.random.normal(jax.random.key(2), (16,))
    k = jax.random.normal(jax.random.key(3), (16,))
    inv = rope.inv_frequencies(RopeConfig(theta=500.0), 16)

    def rot(v, p):
        c, s = rope.cos_sin(jnp.asarray(p), inv)
        return rope.apply_rope(v, c, s, "half")

    np.testing.assert_allclose(rot(q, 0), q, rtol=1e-6)
    # <R(m) q, R(n) k> depends on m - n only
    np.testing.assert_allclose(jnp.dot(rot(q, 9), rot(k, 4)), jnp.dot(rot(q, 5), rot(k, 0)), rtol=1e-4)


def test_inverse_frequencies_of_each_scaling():
    base = rope.inv_frequencies(RopeConfig(theta=10000.0), 64)
    np.testing.assert_allclose(base, 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    lin = rope.inv_frequencies(RopeConfig(rope_type="linear", factor=4.0), 64)
    np.testing.assert_allclose(lin, base / 4, rtol=1e-6)
    l3 = rope.inv_frequencies(RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=64), 64)
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(l3[wavelen < 64 / 4], base[wavelen < 64 / 4], rtol=1e-6)  # high freq kept
    np.testing.assert_allclose(l3[wavelen > 64], base[wavelen > 64] / 8, rtol=1e-6)  # low freq / factor
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all(l3[mid] <= base[mid]) and np.all(l3[mid] >= base[mid] / 8)
    y = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707)
    yi = rope.inv_frequencies(y, 64)
    assert yi[0] == pytest.approx(base[0]) and yi[-1] == pytest.approx(base[-1] / 4)
    assert rope.attention_factor(y, 64) == pytest.approx(1.0)
    y2 = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    assert rope.attention_factor(y2, 64) == pytest.approx(0.1 * np.log(4.0) + 1)


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="longrope"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


# ----------------------------------------------------------------------------- caches: prefill + decode == full
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-deepseek", "tiny-deepseek-v3"])
def test_cached_decode_matches_full_forward(name):
    model = random_model(PRESETS[name], std=0.1)
    toks = jax.random.randint(jax.random.key(0), (2, 14), 0, model.config.vocab_size)
    full = np.asarray(jax.jit(lambda t: model(t))(toks))
    cache = model.init_cache(2, 16)
    logits, cache = jax.jit(lambda t, c: model.prefill(t, jnp.array([6, 6]), c, all_logits=True))(toks[:, :6], cache)
    np.testing.assert_allclose(logits, full[:, :6], rtol=2e-5, atol=2e-5)
    step = jax.jit(lambda tok, c: model.decode(tok, c, impl="xla"), donate_argnums=(1,))
    for t in range(6, 14):
        logits, cache = step(toks[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], rtol=2e-5, atol=2e-5)
    assert cache.lengths.tolist() == [14, 14]


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 5e-2), (jnp.float16, 1e-2)])
def test_low_precision_models_run_close_to_fp32(dtype, tol):
    m32 = random_model(PRESETS["tiny-llama"], jnp.float32, std=0.1)
    mlo = random_model(PRESETS["tiny-llama"], dtype, std=0.1)
    assert mlo.layers[0].qkv.kernel[...].dtype == dtype
    toks = jnp.arange(10)[None] % 512
    ref = np.asarray(jax.jit(lambda t: m32(t))(toks))
    got = np.asarray(jax.jit(lambda t: mlo(t))(toks))
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol


# ----------------------------------------------------------------------------- ops dispatch
def _attn_args(b=2, hq=4, hkv=2, d=8, hidden=16, s=12):
    ks = jax.random.split(jax.random.key(5), 6)
    x = jax.random.normal(ks[0], (b, hidden))
    w_qkv = 0.2 * jax.random.normal(ks[1], (hidden, (hq + 2 * hkv) * d))
    w_o = 0.2 * jax.random.normal(ks[2], (hq * d, hidden))
    kc = jax.random.normal(ks[3], (b, hkv, s, d))
    vc = jax.random.normal(ks[4], (b, hkv, s, d))
    lengths = jnp.array([3, 7], jnp.int32)
    inv = rope.inv_frequencies(RopeConfig(), d)
    kw = dict(norm_weight=jnp.ones(hidden), norm="rms", eps=1e-6, residual=True, rotary_dim=d, rope_layout="half",
              num_q_heads=hq, num_kv_heads=hkv, scale=d ** -0.5)
    return (x, w_qkv, w_o, kc, vc, lengths, inv), kw


def test_fused_raises_clearly_when_jax_cluster_is_missing(monkeypatch):
    monkeypatch.setattr(ops, "_load_jax_cluster", lambda: (None, "ImportError: no module named jax_cluster"))
    args, kw = _attn_args()
    with pytest.raises(RuntimeError, match="attention_block"):
        ops.attention_block(*args, impl="fused", **kw)
    y, kc, vc = jax.jit(lambda *a: ops.attention_block(*a, impl="auto", **kw))(*args)  # falls back
    y2, _, _ = jax.jit(lambda *a: ops.attention_block_xla(*a, **kw))(*args)
    np.testing.assert_array_equal(y, y2)
    with pytest.raises(RuntimeError, match="GELU"):
        ops.gelu_mlp(args[0], jnp.ones((16, 4)), None, jnp.ones((4, 16)), None, impl="fused")
    with pytest.raises(ValueError, match="impl"):
        ops.attention_block(*args, impl="cuda", **kw)


class FakeJaxCluster:
    """The two ops' documented signatures, computing with the jnp formulations."""

    calls: list = []
    warn: str | None = None

    @staticmethod
    def cuda_module_built():
        return True

    @classmethod
    def attention_block(cls, x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, impl, config=None, **kw):
        cls.calls.append(sorted([*kw, "impl"]))
        cls.calls.append(impl)
        if cls.warn:
            warnings.warn(cls.warn)
        return ops.attention_block_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kw)

    @classmethod
    def swiglu(cls, x, w_gate, w_up, w_down=None, residual=None, *, impl, config=None):
        cls.calls.append("swiglu")
        return ops.swiglu_mlp_xla(x, w_gate, w_up, w_down, residual)

    @classmethod
    def decoder_layer(cls, x, w, k_cache, v_cache, lengths, inv_freq, *, impl, family, eps, rotary_dim,
                      rope_layout, num_q_heads, num_kv_heads, scale, rolling):
        """Llama only: the per-op blocks, as jax_cluster.decoder_layer's impl="auto" runs them
        (plain caches: the models here have no sliding window)."""
        assert not rolling
        cls.calls.append(("decoder_layer", impl))
        h, k_cache, v_cache = cls.attention_block(
            x, w["qkv"], w["o"], k_cache, v_cache, lengths, inv_freq, impl=impl, norm_weight=w["norm"], norm="rms",
            eps=eps, qkv_bias=w["qkv_bias"], o_bias=w["o_bias"], residual=True, rotary_dim=rotary_dim,
            rope_layout=rope_layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, scale=scale)
        y = cls.swiglu(ops.rms_norm(h, w["post_norm"], eps), w["w_gate"], w["w_up"], w["w_down"], h, impl=impl)
        return y, k_cache, v_cache


@pytest.fixture
def fake_jax_cluster(monkeypatch):
    FakeJaxCluster.calls = []
    FakeJaxCluster.warn = None
    monkeypatch.setattr(ops, "_load_jax_cluster", lambda: (FakeJaxCluster, None))
    return FakeJaxCluster


def test_fused_calls_the_jax_cluster_op_with_the_documented_signature(fake_jax_cluster):
    calls = fake_jax_cluster.calls
    args, kw = _attn_args()
    jax.eval_shape(lambda *a: ops.attention_block(*a, impl="fused", **kw), *args)
    assert calls[:2] == [sorted([*kw, "impl"]), "cuda"]
    model = random_model(PRESETS["tiny-llama"])
    cache = model.init_cache(1, 8)
    _, cache = jax.jit(lambda c: model.prefill(jnp.array([[1, 2, 3]]), jnp.array([3]), c))(cache)
    ref, _ = jax.jit(lambda c: model.decode(jnp.array([4]), c, impl="xla"))(cache)
    calls.clear()
    got, _ = jax.jit(lambda c: model.decode(jnp.array([4]), c, impl={"attention": "fused", "mlp": "fused"}))(cache)
    assert calls.count("swiglu") == model.config.num_layers and len(calls) == 3 * model.config.num_layers
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    calls.clear()  # plain "fused": whole layers on decoder_layer's kernel
    got, _ = jax.jit(lambda c: model.decode(jnp.array([4]), c, impl="fused"))(cache)
    assert calls.count(("decoder_layer", "cuda")) == model.config.num_layers
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    calls.clear()
    jax.eval_shape(lambda c: model.decode(jnp.array([4]), c, impl="auto"), cache)  # CPU: auto stays on xla
    assert calls == []


def test_decode_routes_say_how_each_block_runs(fake_jax_cluster, monkeypatch):
    model = random_model(PRESETS["tiny-llama"], jnp.bfloat16)
    routes = [str(r) for r in decode_routes(model, 2, 32, "auto")]
    assert routes == ["attention_block: xla (no GPU: impl=auto runs XLA on CPU)",
                      "swiglu: xla (no GPU: impl=auto runs XLA on CPU)"]
    routes = [str(r) for r in decode_routes(model, 2, 32, "attention=fused,mlp=fused")]
    assert routes == ["attention_block: jax_cluster (C++ CPU handler, no GPU)",
                      "swiglu: jax_cluster (C++ CPU handler, no GPU)"]
    routes = [str(r) for r in decode_routes(model, 2, 32, "fused")]
    assert routes == ["decoder_layer: jax_cluster (C++ CPU handler, no GPU)"]
    monkeypatch.setattr(ops, "on_gpu", lambda: True)
    fake_jax_cluster.calls.clear()
    routes = [str(r) for r in decode_routes(model, 2, 32, "auto")]  # whole layers, the op's own choice
    assert ("decoder_layer", "auto") in fake_jax_cluster.calls
    assert routes == ["decoder_layer: jax_cluster (impl=auto: jax_cluster.decoder_layer, the one-launch kernel or "
                      "the per-op kernels as its tuner measured faster per shape)"]
    routes = [str(r) for r in decode_routes(model, 2, 32, "attention=auto,mlp=auto,layer=xla")]
    assert routes[0].startswith("attention_block: jax_cluster (impl=auto: the tuner's pick")
    fake_jax_cluster.warn = "attention_block: no CUDA kernel for head_dim=16; using XLA's ops"
    routes = [str(r) for r in decode_routes(model, 2, 32, "auto")]
    assert routes[-1] == ("attention_block: xla (jax_cluster fell back: attention_block: no CUDA kernel for "
                          "head_dim=16; using XLA's ops)")
    routes = [str(r) for r in decode_routes(random_model(PRESETS["tiny-pythia"], jnp.float16), 1, 32,
                                            {"attention": "xla"})]
    assert routes == ["attention_block: xla (impl=xla)", "gelu_mlp: xla (no fused GELU MLP op)"]


def test_fused_rejects_what_the_op_does_not_cover(fake_jax_cluster, monkeypatch):
    def no_fp32(*a, **k):
        raise ValueError("swiglu: float32 has no kernel")

    monkeypatch.setattr(fake_jax_cluster, "swiglu", staticmethod(no_fp32))
    model = random_model(PRESETS["tiny-llama"], jnp.float32)
    with pytest.raises(ValueError, match="impl='fused' for swiglu: jax_cluster.swiglu does not cover this "
                                         "call: swiglu: float32 has no kernel"):
        decode_routes(model, 1, 16, "attention=fused,mlp=fused")


def test_whole_layer_impl_per_component():
    w = lambda impl, f=True: ops.whole_layer_impl(ops.normalize_impl(impl), mlp_has_fused_op=f)  # noqa: E731
    assert w("fused") == "fused" and w("auto") == "auto" and w("xla") is None
    assert w("layer=fused") == "fused" and w("layer=xla") is None
    assert w("attention=fused,mlp=fused") is None  # the per-op kernels
    assert w("attention=fused,mlp=fused", f=False) == "fused"  # GPT-NeoX: the layer is the GELU MLP's only fused form
    assert w("attention=fused,mlp=xla") is None and w("attention=auto,mlp=xla") is None
    with pytest.raises(ValueError, match="layer=fused .* contradicts"):
        w("layer=fused,mlp=xla")


def test_real_fused_ops_on_cpu_if_built():
    op = ops.fused_op("attention_block")
    if op is None:
        pytest.skip("jax_cluster.attention_block not available")
    model = random_model(PRESETS["tiny-llama"], jnp.float32, std=0.1)
    cache = model.init_cache(2, 16)
    _, cache = model.prefill(jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]]), jnp.array([4, 2]), cache)
    ref, _ = model.decode(jnp.array([7, 8]), cache, impl="xla")
    got, _ = model.decode(jnp.array([7, 8]), cache, impl={"attention": "fused", "mlp": "xla"})
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- MoE
def _moe_inputs(n, h=16, e=8, i=12):
    ks = jax.random.split(jax.random.key(9), 5)
    return (jax.random.normal(ks[0], (n, h)), jax.random.normal(ks[1], (h, e)),
            0.3 * jax.random.normal(ks[2], (e, h, i)), 0.3 * jax.random.normal(ks[3], (e, h, i)),
            0.3 * jax.random.normal(ks[4], (e, i, h)))


def test_moe_gather_and_grouped_paths_agree():
    x, router, wg, wu, wd = _moe_inputs(10)
    w, ids = jax.jit(lambda x, r: moe.route(x, r, top_k=3))(x, router)
    a = jax.jit(moe.experts_gather)(x, w, ids, wg, wu, wd)
    b = jax.jit(moe.experts_grouped)(x, w, ids, wg, wu, wd)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # against a dense loop over tokens
    xn, wn, idn = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(ids)
    wgn, wun, wdn = (np.asarray(t, np.float64) for t in (wg, wu, wd))
    ref = np.zeros_like(xn)
    for n in range(10):
        for j in range(3):
            e = idn[n, j]
            g = xn[n] @ wgn[e]
            ref[n] += wn[n, j] * (((g / (1 + np.exp(-g))) * (xn[n] @ wun[e])) @ wdn[e])
    np.testing.assert_allclose(a, ref, rtol=1e-4, atol=1e-4)


def test_group_limited_routing_and_normalisation():
    x, router, *_ = _moe_inputs(32)
    w, ids = moe.route(x, router, top_k=2, method="group_limited_greedy", n_group=4, topk_group=1)
    assert np.all(ids[:, 0] // 2 == ids[:, 1] // 2)  # both experts from the single kept group
    scores = jax.nn.softmax(x @ router, axis=-1)
    best_group = jnp.argmax(scores.reshape(32, 4, 2).max(-1), axis=-1)
    assert np.all(ids[:, 0] // 2 == best_group)
    wn, _ = moe.route(x, router, top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(wn.sum(-1), 1.0, rtol=1e-6)
    ws, _ = moe.route(x, router, top_k=2, routed_scaling_factor=3.0)
    w1, _ = moe.route(x, router, top_k=2)
    np.testing.assert_allclose(ws, 3.0 * w1, rtol=1e-6)


def _moe_block_inputs(n, dtype, *, h=64, e=8, i=32, i_shared=64):
    ks = jax.random.split(jax.random.key(3), 9)
    f = lambda k, *s: (0.3 * jax.random.normal(k, s)).astype(dtype)  # noqa: E731
    shared = dict(w_gate=f(ks[5], h, i_shared), w_up=f(ks[6], h, i_shared), w_down=f(ks[7], i_shared, h),
                  b_gate=None, b_up=None, b_down=None)
    return ((jax.random.normal(ks[0], (n, h)).astype(dtype), jax.random.normal(ks[1], (h, e)).astype(dtype),
             f(ks[2], e, h, i), f(ks[3], e, h, i), f(ks[4], e, i, h)),
            dict(shared=shared, residual=jax.random.normal(ks[8], (n, h)).astype(dtype)))


ROUTINGS = {"greedy": dict(top_k=3, routed_scaling_factor=2.5),
            "group-limited": dict(top_k=2, topk_method="group_limited_greedy", n_group=4, topk_group=2),
            "normalised": dict(top_k=3, norm_topk_prob=True)}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("n", [1, 5, 40])
def test_moe_block_fused_matches_xla_on_cpu(n, routing):
    """ops.moe through jax_cluster.moe_decode's C++ CPU handler against its jnp formulation: fp32
    (routed experts fused, shared experts on XLA: jax_cluster.swiglu has no float32 path) and
    bf16 (everything fused, the shared experts inside the op). n=40 takes the grouped jnp path."""
    if not ops.fused_available("moe_decode"):
        pytest.skip("jax_cluster.moe_decode not available")
    kw = ROUTINGS[routing]
    args, extra = _moe_block_inputs(n, jnp.float32)
    ref = jax.jit(lambda *a: ops.moe(*a, impl="xla", **extra, **kw))(*args)
    with ops.record_routes() as routes:
        got = jax.jit(lambda *a: ops.moe(*a, impl="fused", shared_impl="xla", **extra, **kw))(*args)
    # the op's router sums the logits in its own order: weights differ from XLA's in the last bits
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert [str(r) for r in routes] == ["moe: jax_cluster (C++ CPU handler, no GPU)", "swiglu: xla (impl=xla)"]

    args, extra = _moe_block_inputs(n, jnp.bfloat16)
    ref32 = np.asarray(ops.moe(*(a.astype(jnp.float32) for a in args), impl="xla", **kw,
                               shared={k: None if v is None else v.astype(jnp.float32)
                                       for k, v in extra["shared"].items()},
                               residual=extra["residual"].astype(jnp.float32)))
    xla = np.asarray(jax.jit(lambda *a: ops.moe(*a, impl="xla", **extra, **kw))(*args), np.float32)
    with ops.record_routes() as routes:
        got = np.asarray(jax.jit(lambda *a: ops.moe(*a, impl="fused", **extra, **kw))(*args), np.float32)
    assert [str(r) for r in routes] == ["moe: jax_cluster (C++ CPU handler, no GPU)"]
    rel = lambda a: np.linalg.norm(a - ref32) / np.linalg.norm(ref32)  # noqa: E731
    assert rel(got) <= 1.25 * rel(xla) + 2e-3, (rel(got), rel(xla))
    np.testing.assert_allclose(got, xla, rtol=0.05, atol=0.25)


def test_moe_block_routes_and_errors(monkeypatch):
    args, extra = _moe_block_inputs(3, jnp.float32)
    kw = dict(top_k=2)
    with ops.record_routes() as routes:
        jax.eval_shape(lambda *a: ops.moe(*a, impl="auto", **extra, **kw), *args)
        jax.eval_shape(lambda *a: ops.moe(*a, impl="xla", **extra, **kw), *args)
    assert [str(r) for r in routes] == ["moe: xla (no GPU: impl=auto runs XLA on CPU)",
                                        "swiglu: xla (no GPU: impl=auto runs XLA on CPU)",
                                        "moe: xla (impl=xla)", "swiglu: xla (impl=xla)"]
    if not ops.fused_available("moe_decode"):
        pytest.skip("jax_cluster.moe_decode not available")
    # the op's call runs shared experts of any width that is a multiple of 8, float32 on CPU too
    with ops.record_routes() as routes:
        jax.eval_shape(lambda *a: ops.moe(*a, impl="fused", **extra, **kw), *args)
    assert [str(r) for r in routes] == ["moe: jax_cluster (C++ CPU handler, no GPU)"]
    # other widths go to jax_cluster.swiglu, whose kernels need multiples of 64
    args16, extra16 = _moe_block_inputs(3, jnp.bfloat16, i_shared=36)
    with pytest.raises(ValueError, match=r"impl='fused' for moe: moe_decode: the shared experts run through "
                                         r"jax_cluster\.swiglu .* D=64, F=36 \(the kernels need multiples of 64\)"):
        jax.eval_shape(lambda *a: ops.moe(*a, impl="fused", **extra16, **kw), *args16)
    with pytest.raises(RuntimeError, match="impl='fused' for moe: shared-expert biases"):
        ops.moe(*args16, impl="fused", shared=dict(extra16["shared"], b_up=jnp.zeros(32, jnp.bfloat16)), **kw)
    # "auto" on a GPU: decode sizes go to the op, prefill sizes stay on the grouped jnp path
    monkeypatch.setattr(ops, "on_gpu", lambda: True)
    mid, mid_extra = _moe_block_inputs(16, jnp.bfloat16)
    with ops.record_routes() as routes:
        jax.eval_shape(lambda *a: ops.moe(*a, impl="auto", **mid_extra, **kw), *mid)
    assert "rows >" not in str(routes[0]), routes[0]  # 16 rows are a decode batch for the op
    big, big_extra = _moe_block_inputs(ops.MOE_DECODE_MAX_ROWS + 1, jnp.bfloat16)
    with ops.record_routes() as routes:
        jax.eval_shape(lambda *a: ops.moe(*a, impl="auto", **big_extra, **kw), *big)
    n = ops.MOE_DECODE_MAX_ROWS
    assert str(routes[0]) == f"moe: xla ({n + 1} rows > {n}: the jnp formulation (gather or grouped ragged_dot))"


def test_moe_block_notes_a_shared_expert_fallback(fake_jax_cluster, monkeypatch):
    """impl=auto on a GPU: moe_decode runs, its swiglu falls back for the shared experts: both noted."""
    def moe_decode(x, router, w_gate, w_up, w_down, *, shared, residual, impl, **routing):
        warnings.warn("swiglu: no kernel for D=64, F=32 (the kernels need multiples of 64); running impl='xla'")
        fake_jax_cluster.calls.append(("moe_decode", impl, sorted(shared)))
        y = ops.moe_xla(x, router, w_gate, w_up, w_down, residual=residual, **routing)
        return ops.swiglu_mlp_xla(x, residual=y, **shared)

    monkeypatch.setattr(fake_jax_cluster, "moe_decode", staticmethod(moe_decode), raising=False)
    monkeypatch.setattr(ops, "on_gpu", lambda: True)
    args, extra = _moe_block_inputs(2, jnp.bfloat16, i_shared=32)
    with ops.record_routes() as routes:
        jax.eval_shape(lambda *a: ops.moe(*a, impl="auto", **extra, top_k=2), *args)
    assert fake_jax_cluster.calls == [("moe_decode", "auto", ["w_down", "w_gate", "w_up"])]
    assert [str(r) for r in routes] == [
        "moe: jax_cluster (impl=auto: the routed-experts kernel where its checks pass, else XLA)",
        "moe shared experts: xla (jax_cluster fell back: swiglu: no kernel for D=64, F=32 (the kernels need "
        "multiples of 64); running impl='xla')"]


def test_llama_3_2_1b_preset_is_the_hugging_face_config():
    """The 1B preset (tied embeddings, llama3 RoPE scaling) parses from Hugging Face's config of
    those shapes to the same config, and has Llama-3.2-1B's 1.24 B parameters (counted on the
    abstract model: no weights are made)."""
    transformers = pytest.importorskip("transformers")
    from flax import nnx

    from flax_models.config import LlamaConfig
    from flax_models.presets import abstract_model

    hf = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, eos_token_id=128001)
    assert LlamaConfig.from_hf(hf.to_dict()) == PRESETS["llama-3.2-1b"]
    _, state = nnx.split(abstract_model(PRESETS["llama-3.2-1b"], jnp.bfloat16, "auto"))
    assert sum(v.get_value().size for _, v in nnx.to_flat_state(state)) == 1_235_814_400


@pytest.mark.parametrize("t,hq,hkv", [(300, 6, 2), (129, 4, 4), (64, 3, 1)])
def test_long_prompt_attention_in_query_blocks_equals_one_block(monkeypatch, t, hq, hkv):
    """Queries in blocks (a length no block divides, GQA, MQA, a value width of its own) give
    what one block gives."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, hq, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, t, hkv, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, t, hkv, 24)), jnp.float32)
    whole = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, 0.25))(q, k, v)
    monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", 2 * hq * 20 * t * 4)
    assert attention.query_block(2, hq, t) == 16
    blocked = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, 0.25))(q, k, v)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,window", [(300, 37), (129, 100), (64, 8)])
def test_long_prompt_sliding_window_in_query_blocks_reads_the_window_only(monkeypatch, t, window):
    """With a sliding window each block of queries scores only the keys its windows reach
    (block + window - 1 of them, clipped at either end of the prompt), and gives what one
    block over every key gives."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, t, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, t, 2, 24)), jnp.float32)
    attend = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, 0.25, window))
    whole = attend(q, k, v)
    monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", 2 * 4 * 16 * min(t, 16 + window - 1) * 4)
    assert attention.query_block(2, 4, t, window) == 16
    blocked = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, 0.25, window))
    np.testing.assert_allclose(blocked(q, k, v), whole, rtol=1e-5, atol=1e-5)
    span = min(t, 16 + window - 1)
    assert f"f32[2,2,2,16,{span}]" in str(jax.make_jaxpr(blocked)(q, k, v))  # the scores of one block


def test_long_prompt_attention_memory_is_bounded():
    """A 16K-token prompt with 32 query heads: one layer's attention compiles to under 1.5 GB
    of temporaries (its [T, T] fp32 scores alone would be 34 GB)."""
    t = 16384
    q = jax.ShapeDtypeStruct((1, t, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16)
    compiled = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, 0.1)).lower(q, kv, kv).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5e9


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-deepseek"])
def test_prefill_in_query_blocks_matches_one_block(monkeypatch, name):
    """A whole model's prefill with its attention in 16-query blocks (MLA's too) gives the
    logits of the one-block prefill."""
    model = random_model(PRESETS[name], std=0.1)
    toks = jax.random.randint(jax.random.key(1), (2, 40), 0, model.config.vocab_size)

    def prefill():
        cache = model.init_cache(2, 48)
        return jax.jit(lambda t, c: model.prefill(t, jnp.array([40, 33]), c, all_logits=True))(toks, cache)[0]

    whole = np.asarray(prefill())
    monkeypatch.setattr(attention, "PREFILL_SCORE_BYTES", 1)  # every block at the minimum
    np.testing.assert_allclose(np.asarray(prefill()), whole, rtol=2e-5, atol=2e-5)
