"""Conformance against transformers (CPU, fp32) on model configs drawn at random: a fixed seed
per case, so a failure names its config and reruns it. The hand-written configs of
test_models_{llama,gpt_neox,deepseek_v2}.py pin the edges on purpose; these cover what nobody
picked (head dims like 20 or 40, GQA ratios 3 and 5, odd vocabularies, partial rotary,
every RoPE scaling, sliding windows shorter than the sequence, routing variants), each
decoded on XLA's ops and on jax_cluster's C++ CPU handlers (impl="fused")."""

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax_models import mla, ops  # noqa: E402
from flax_models.testing import compare_logits, hf_roundtrip  # noqa: E402

TOL = 1e-4


def _rope(r: random.Random, scalings) -> dict:
    kind = r.choice(scalings)
    theta = r.choice([10000.0, 500000.0])
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": r.choice([2.0, 4.0])}
    if kind == "llama3":
        return {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": r.choice([16, 64])}
    if kind == "yarn":
        return {"rope_type": "yarn", "rope_theta": theta, "factor": r.choice([2.0, 4.0]),
                "original_max_position_embeddings": 64}
    return {"rope_type": "default", "rope_theta": theta}


def llama_family(seed: int):
    r = random.Random(seed)
    kv, group = r.choice([1, 2, 3]), r.choice([1, 2, 3, 5])
    family = r.choice(["llama", "mistral", "qwen2"])
    kw = dict(vocab_size=r.choice([67, 96, 130]), num_hidden_layers=r.choice([1, 2]), initializer_range=0.2,
              max_position_embeddings=256, hidden_size=kv * group * r.choice([8, 16]),
              intermediate_size=r.choice([40, 64, 88]), num_attention_heads=kv * group, num_key_value_heads=kv,
              head_dim=r.choice([8, 16, 24, 40, 64, 80]), tie_word_embeddings=r.random() < 0.3,
              rms_norm_eps=r.choice([1e-6, 1e-5]))
    if family == "qwen2":
        kw["rope_parameters"] = {"rope_type": r.choice(["default", "yarn"]), "rope_theta": 1e6, "factor": 4.0,
                                 "original_max_position_embeddings": 64}
        # a window shorter than the 16-token sequences from layer max_window_layers on: rolling caches
        return transformers.Qwen2Config(**kw, use_sliding_window=r.random() < 0.5, sliding_window=r.choice([5, 12]),
                                        max_window_layers=r.choice([0, 1]))
    kw["rope_parameters"] = _rope(r, ["default", "linear", "llama3", "yarn"])
    if family == "mistral":
        return transformers.MistralConfig(**kw, sliding_window=r.choice([None, 5, 12]))
    return transformers.LlamaConfig(**kw, attention_bias=r.random() < 0.3)


def gpt_neox(seed: int):
    r = random.Random(seed)
    heads, head_dim = r.choice([1, 2, 3, 4]), r.choice([8, 16, 20, 32, 80])
    return transformers.GPTNeoXConfig(
        vocab_size=r.choice([67, 96]), num_hidden_layers=r.choice([1, 2]), initializer_range=0.2,
        max_position_embeddings=256, hidden_size=heads * head_dim, intermediate_size=r.choice([32, 72, 128]),
        num_attention_heads=heads, rotary_pct=r.choice([0.25, 0.5, 1.0]), use_parallel_residual=r.random() < 0.5,
        tie_word_embeddings=r.random() < 0.3, attention_bias=r.random() < 0.8,
        hidden_act=r.choice(["gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"]),
        layer_norm_eps=r.choice([1e-5, 1e-6]), rotary_emb_base=r.choice([10000, 500]))


def deepseek(seed: int):
    """V2 (greedy or group-limited softmax routing) or V3 (noaux_tc). V2's norm_topk_prob stays
    off: transformers' DeepseekV2 ignores it where DeepSeek's code (and ours) renormalise."""
    r = random.Random(seed)
    v3 = r.random() < 0.4
    experts = r.choice([8, 16])
    groups = r.choice([2, 4])
    heads = r.choice([1, 2, 3, 4])
    kw = dict(vocab_size=96, initializer_range=0.2, max_position_embeddings=256, hidden_size=heads * 16,
              intermediate_size=r.choice([48, 64]), moe_intermediate_size=r.choice([16, 24, 32]),
              num_hidden_layers=r.choice([2, 3]), num_attention_heads=heads, num_key_value_heads=heads,
              kv_lora_rank=r.choice([8, 16, 32]), q_lora_rank=r.choice([None, 12, 24]),
              qk_nope_head_dim=r.choice([8, 16]), qk_rope_head_dim=r.choice([4, 8]), v_head_dim=r.choice([8, 12, 16]),
              n_routed_experts=experts, num_experts_per_tok=r.choice([1, 2, 3]), n_shared_experts=r.choice([1, 2]),
              first_k_dense_replace=r.choice([0, 1]), routed_scaling_factor=r.choice([1.0, 2.5]),
              tie_word_embeddings=r.random() < 0.2)
    if r.random() < 0.5:
        kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32, "mscale": r.choice([0.707, 1.0]),
                                 "mscale_all_dim": r.choice([0.707, 1.0])}
    if v3 or r.random() < 0.5:  # the kept groups must hold top_k experts
        kw.update(n_group=groups, topk_group=r.choice(range(1, groups + 1)))
        kw["num_experts_per_tok"] = min(kw["num_experts_per_tok"], kw["topk_group"] * experts // groups)
    if v3:
        return transformers.DeepseekV3Config(**kw, norm_topk_prob=r.random() < 0.5)
    if "n_group" in kw:
        kw["topk_method"] = "group_limited_greedy"
    return transformers.DeepseekV2Config(**kw, norm_topk_prob=False)


FAMILIES = {"llama": (llama_family, "fused"), "gpt_neox": (gpt_neox, "fused"),
            "deepseek": (deepseek, "attention=fused,mlp=fused")}
CASES = [(family, seed) for family in FAMILIES for seed in range(6)]


@pytest.mark.parametrize("impl", ["xla", "fused"])
@pytest.mark.parametrize("family,seed", CASES, ids=[f"{f}-{s}" for f, s in CASES])
def test_random_config_matches_transformers(family, seed, impl, tmp_path, monkeypatch):
    make, fused_impl = FAMILIES[family]
    cfg = make(1000 * seed + len(family))
    if impl == "fused":
        if not ops.fused_available("decoder_layer"):
            pytest.skip("jax_cluster not available")
        impl = fused_impl
        # jax_cluster.swiglu has no float32 path: DeepSeek's dense and shared SwiGLUs stay on XLA
        swiglu_mlp = ops.swiglu_mlp
        monkeypatch.setattr(ops, "swiglu_mlp", lambda *a, impl, **k: swiglu_mlp(*a, impl="xla", **k))
    hf, model = hf_roundtrip(cfg, tmp_path, impl=impl, seed=seed)
    if family == "deepseek":  # transformers before the YaRN mscale fix: give it the reference scale
        plain = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        if abs(hf.model.layers[0].self_attn.scaling - plain) < 1e-12:
            for layer in hf.model.layers:
                layer.self_attn.scaling = mla.softmax_scale(model.config)
    with ops.record_routes() as routes:
        err = compare_logits(hf, model, prompt_lengths=(3, 10), decode_steps=6, seed=seed)
    assert err["prefill"] <= TOL and err["decode"] <= TOL, (err, cfg.to_diff_dict())
    if impl != "xla":
        assert any("jax_cluster" in str(r) for r in routes), routes
