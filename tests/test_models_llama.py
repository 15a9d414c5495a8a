"""Llama conformance against transformers (CPU, fp32): prefill + 16 cached decode steps + greedy."""

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
