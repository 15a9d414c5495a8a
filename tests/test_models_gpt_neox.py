"""GPT-NeoX / Pythia conformance against transformers (CPU, fp32)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax_models.testing import compare_greedy, compare_logits, hf_roundtrip  # noqa: E402

TOL = 1e-4
BASE = dict(vocab_size=96, num_hidden_layers=2, initializer_range=0.2, max_position_embeddings=256)

CONFIGS = {
    "parallel-rot0.25-hd64": dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, rotary_pct=0.25),
    "sequential-rot0.25-hd80": dict(hidden_size=160, intermediate_size=128, num_attention_heads=2, rotary_pct=0.25,
                                    use_parallel_residual=False),
    "parallel-rot1-tied-gelu_new": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, rotary_pct=1.0,
                                        tie_word_embeddings=True, hidden_act="gelu_new"),
    "sequential-rot0.5-nobias": dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, rotary_pct=0.5,
                                     use_parallel_residual=False, attention_bias=False, rotary_emb_base=500.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpt_neox_matches_transformers(name, tmp_path):
    cfg = transformers.GPTNeoXConfig(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path)
    assert model.config.rotary_dim == int(model.config.head_dim * CONFIGS[name]["rotary_pct"])
    err = compare_logits(hf, model, prompt_lengths=(6, 13), decode_steps=16)
    assert err["prefill"] <= TOL, err
    assert err["decode"] <= TOL, err
    ours, theirs = compare_greedy(hf, model)
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpt_neox_fused_layers_on_cpu_match_transformers(name, tmp_path):
    """Decode through jax_cluster.decoder_layer's C++ CPU handler (impl fused: whole layers)."""
    from flax_models import ops  # noqa: PLC0415

    if not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster.decoder_layer not available")
    cfg = transformers.GPTNeoXConfig(**BASE, **CONFIGS[name])
    hf, model = hf_roundtrip(cfg, tmp_path, impl="fused")
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(5, 12), decode_steps=8)
    assert err["decode"] <= TOL, err
    assert "decoder_layer: jax_cluster (C++ CPU handler, no GPU)" in [str(r) for r in routes]
