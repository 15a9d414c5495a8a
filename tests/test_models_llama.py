"""Llama conformance against transformers (CPU, fp32): prefill + 16 cached decode steps + greedy."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax_models.testing import compare_greedy, compare_logits, hf_roundtrip  # noqa: E402

TOL = 1e-4
BASE = dict(vocab_size=96, num_hidden_layers=2, initializer_range=0.2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CONFIGS = {
    "gqa2-hd64-untied": dict(hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64),
    "mha-hd80-tied-llama3": dict(hidden_size=160, intermediate_size=96, num_attention_heads=2, num_key_value_heads=2,
                                 head_dim=80, tie_word_embeddings=True, rope_parameters=LLAMA3),
    "gqa4-hd16-bias": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=16, attention_bias=True, mlp_bias=True,
                           rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}),
    "mqa-hd80-llama3": dict(hidden_size=96, intermediate_size=64, num_attention_heads=3, num_key_value_heads=1,
                            head_dim=80, rope_parameters=LLAMA3, rms_norm_eps=1e-5),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_matches_transformers(name, tmp_path):
    cfg = transformers.LlamaConfig(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path)
    assert model.config.tie_word_embeddings == bool(CONFIGS[name].get("tie_word_embeddings", False))
    err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=16)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err
    ours, theirs = compare_greedy(hf, model)
    assert ours == theirs


@pytest.mark.parametrize("name", ["gqa2-hd64-untied", "mha-hd80-tied-llama3", "mqa-hd80-llama3"])
def test_llama_fused_layers_on_cpu_match_transformers(name, tmp_path):
    """Decode through jax_cluster.decoder_layer's C++ CPU handler (impl fused: whole layers)."""
    from flax_models import ops  # noqa: PLC0415

    if not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster.decoder_layer not available")
    cfg = transformers.LlamaConfig(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path, impl="fused")
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["decode"] <= TOL, err
    assert [str(r) for r in routes] == ["decoder_layer: jax_cluster (C++ CPU handler, no GPU)"]


def test_llama_fused_with_mlp_biases_names_them(tmp_path):
    from flax_models import ops  # noqa: PLC0415

    if not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster.decoder_layer not available")
    cfg = transformers.LlamaConfig(**BASE, **CONFIGS["gqa4-hd16-bias"])
    hf, model = hf_roundtrip(cfg, tmp_path, impl="fused")
    with pytest.raises(RuntimeError, match="impl='fused' for decoder_layer: MLP biases"):
        compare_logits(hf, model, prompt_lengths=(5,), decode_steps=1)


# Mistral and Qwen2 load into the Llama model (flax_models.config): Qwen2's q, k, v biases (no
# o_proj bias); sliding windows, here 8 tokens against sequences of up to 28: attention beyond the
# window, on every layer (Mistral) or from max_window_layers on (Qwen2).
FAMILY = {
    "qwen2-gqa2-tied": (transformers.Qwen2Config, dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                       num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-gqa4-hd32": (transformers.MistralConfig, dict(hidden_size=128, intermediate_size=160, num_attention_heads=8,
                                                           num_key_value_heads=2, head_dim=32, sliding_window=None)),
    "mistral-window8": (transformers.MistralConfig, dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                         num_key_value_heads=4, sliding_window=8)),
    "qwen2-window8-layer1": (transformers.Qwen2Config, dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                            num_key_value_heads=2, use_sliding_window=True,
                                                            sliding_window=8, max_window_layers=1)),
}


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_llama_family_matches_transformers(name, tmp_path):
    config_class, kw = FAMILY[name]
    hf, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path)
    c = model.config
    assert (c.attention_bias, c.o_bias) == ((True, False) if name.startswith("qwen2") else (False, False))
    assert c.max_position_embeddings == BASE["max_position_embeddings"]
    assert [c.layer_window(i) for i in range(2)] == {"mistral-window8": [8, 8], "qwen2-window8-layer1": [None, 8]}.get(
        name, [None, None])
    err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=16)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err


def test_sliding_window_cache_is_a_rolling_buffer(tmp_path):
    """A windowed layer keeps its window's slots only (position t at slot t % window); the rest
    keep max_len; the cache still bounds positions by max_len."""
    config_class, kw = FAMILY["qwen2-window8-layer1"]
    _, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path)
    cache = model.init_cache(2, 100)
    assert [k.shape[2] for k in cache.k] == [100, 8] and [v.shape[2] for v in cache.v] == [100, 8]
    assert cache.max_len == 100 and [cache.rolling(i) for i in range(2)] == [False, True]
    short = model.init_cache(2, 6)  # never past the window: the plain layout
    assert [k.shape[2] for k in short.k] == [6, 6] and not short.rolling(1)


@pytest.mark.parametrize("name", ["mistral-window8", "qwen2-window8-layer1"])
@pytest.mark.parametrize("impl", ["attention=fused,mlp=xla", "fused"])
def test_sliding_window_fused_matches_transformers(name, impl, tmp_path):
    """Past the window: prompts of 5 and 12 tokens (longer than the window of 8) and 16 steps
    over the rolling buffers. Per component, the windowed layers' attention runs
    jax_cluster.decode_attention's C++ handler (the fused attention block writes slot
    lengths[b]: it cannot); as whole layers, jax_cluster.decoder_layer's (rolling=True)."""
    from flax_models import ops  # noqa: PLC0415

    if not ops.fused_available("decode_attention") or not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster's decode ops not available")
    config_class, kw = FAMILY[name]
    hf, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path, impl=impl)
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=16)
    assert err["prefill"] <= TOL and err["decode"] <= TOL, err
    want = (["attention_block: jax_cluster (C++ CPU handler, no GPU)", "swiglu: xla (impl=xla)"] if impl != "fused"
            else ["decoder_layer: jax_cluster (C++ CPU handler, no GPU)"])
    assert sorted(str(r) for r in routes) == want


def test_sliding_window_over_a_full_cache_has_no_fused_op(tmp_path):
    """A cache built without its windows (every layer max_len slots) still decodes right on XLA,
    masking the window; the fused blocks, which attend to every cached slot, refuse it."""
    import jax.numpy as jnp  # noqa: PLC0415

    from flax_models import ops  # noqa: PLC0415
    from flax_models.cache import KVCache  # noqa: PLC0415

    config_class, kw = FAMILY["mistral-window8"]
    _, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path)
    c = model.config
    make = dict(num_layers=c.num_layers, batch=2, num_kv_heads=c.num_kv_heads, max_len=40, head_dim=c.head_dim,
                dtype=model.dtype)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, (2, 12)), jnp.int32)
    lengths = jnp.asarray([12, 7], jnp.int32)  # past the window, and short of it
    steps = jnp.asarray(rng.integers(0, c.vocab_size, (24, 2)), jnp.int32)  # three windows on
    runs = {}
    for name, cache in (("rolling", model.init_cache(2, 40)), ("full", KVCache.create(**make))):
        logits, cache = model.prefill(tokens, lengths, cache)
        out = [logits]
        for tok in steps:
            logits, cache = model.decode(tok, cache, impl="xla")
            out.append(logits)
        runs[name] = np.stack(out)
    np.testing.assert_allclose(runs["rolling"], runs["full"], rtol=1e-5, atol=1e-5)
    if ops.fused_available("decoder_layer"):
        with pytest.raises(RuntimeError, match="a sliding window of 8 tokens over a cache of 40 slots"):
            model.decode(tokens[:, 0], KVCache.create(**make), impl="fused")


def test_qwen2_fused_layers_on_cpu_match_transformers(tmp_path):
    """Qwen2's q, k, v biases through jax_cluster.decoder_layer's C++ CPU handler."""
    from flax_models import ops  # noqa: PLC0415

    if not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster.decoder_layer not available")
    config_class, kw = FAMILY["qwen2-gqa2-tied"]
    hf, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path, impl="fused")
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["decode"] <= TOL, err
    assert [str(r) for r in routes] == ["decoder_layer: jax_cluster (C++ CPU handler, no GPU)"]


def test_sliding_window_config_rules():
    """Which layers attend through a window, read as transformers reads the config."""
    from flax_models.config import LlamaConfig  # noqa: PLC0415

    base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
                max_position_embeddings=4096)

    def windows(**kw):
        c = LlamaConfig.from_hf(dict(base, **kw))
        assert c.max_position_embeddings == 4096  # a window never caps the context
        return [c.layer_window(i) for i in range(4)]

    assert windows(model_type="mistral", sliding_window=1024) == [1024] * 4
    assert windows(model_type="mistral", sliding_window=None) == [None] * 4
    qwen = dict(model_type="qwen2", sliding_window=1024)
    assert windows(**qwen, use_sliding_window=False) == [None] * 4
    assert windows(**qwen, use_sliding_window=True) == [None] * 4  # max_window_layers defaults to 28
    assert windows(**qwen, use_sliding_window=True, max_window_layers=2) == [None, None, 1024, 1024]
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert windows(**qwen, use_sliding_window=True, layer_types=types) == [None, 1024, None, 1024]
    assert windows(**qwen, use_sliding_window=True, layer_types=["full_attention"] * 4) == [None] * 4
    assert LlamaConfig.from_hf(dict(base, model_type="llama", attention_bias=True)).o_bias
    assert not LlamaConfig.from_hf(dict(base, **qwen, attention_bias=True)).o_bias  # Qwen2's o_proj has none


# YaRN's attention factor (cos and sin times 0.1 ln(factor) + 1, as in Qwen2.5's long-context
# configs): the Llama model carries it in the softmax scale, so every decode block runs fused.
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("impl", ["xla", "fused", "attention=fused,mlp=xla"])
@pytest.mark.parametrize("config_class", [transformers.LlamaConfig, transformers.Qwen2Config])
def test_yarn_attention_factor_matches_transformers(config_class, impl, tmp_path):
    from flax_models import ops  # noqa: PLC0415
    from flax_models.rope import attention_factor  # noqa: PLC0415

    if impl != "xla" and not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster not available")
    kw = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rope_parameters=YARN)
    hf, model = hf_roundtrip(config_class(**BASE, **kw), tmp_path, impl=impl)
    assert attention_factor(model.config.rope, 16) == pytest.approx(0.1 * np.log(4.0) + 1)
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err
    fused_block = {"fused": "decoder_layer", "attention=fused,mlp=xla": "attention_block"}.get(impl)
    if fused_block:
        assert f"{fused_block}: jax_cluster (C++ CPU handler, no GPU)" in [str(r) for r in routes], routes
