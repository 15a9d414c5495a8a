"""from_pretrained on checkpoints written without torch (flax_models.testing.fake_checkpoint):
layout mapping, sharding, dtypes, tokenizer, and errors that name the tensor."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from flax_models import CheckpointError, from_pretrained
from flax_models.hf_maps import neox_qkv_bias, neox_qkv_weight
from flax_models.testing import fake_checkpoint

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32, hidden_size=16,
             intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
NEOX = dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", vocab_size=32, hidden_size=16,
            intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, rotary_pct=0.25,
            rotary_emb_base=10000, use_parallel_residual=True, layer_norm_eps=1e-5)
DEEPSEEK = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=32, hidden_size=16,
                intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "mscale": 0.707, "mscale_all_dim": 0.707},
                max_position_embeddings=256)


@pytest.mark.parametrize("cfg", [LLAMA, NEOX, DEEPSEEK], ids=["llama", "neox", "deepseek"])
def test_loads_each_architecture(cfg, tmp_path):
    fake_checkpoint(cfg, tmp_path)
    model = from_pretrained(tmp_path, dtype="bf16")
    assert model.config.architecture == {"LlamaForCausalLM": "llama", "GPTNeoXForCausalLM": "gpt_neox",
                                         "DeepseekV2ForCausalLM": "deepseek_v2"}[cfg["architectures"][0]]
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(model(jnp.arange(5)[None] % 32), np.float32)).all()


def test_llama_weights_are_transposed_and_fused(tmp_path):
    fake_checkpoint(LLAMA, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    m = from_pretrained(tmp_path, dtype="fp32")
    qkv = np.asarray(m.layers[1].qkv.kernel[...])
    p = "model.layers.1.self_attn."
    np.testing.assert_array_equal(qkv, np.concatenate([t[p + "q_proj.weight"].T, t[p + "k_proj.weight"].T,
                                                       t[p + "v_proj.weight"].T], axis=1))
    np.testing.assert_array_equal(m.layers[0].mlp.down.kernel[...], t["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(m.lm_head.kernel[...], t["lm_head.weight"].T)


def test_neox_per_head_interleaved_qkv_is_rearranged():
    heads, d, hidden = 3, 4, 12
    # row r of HF's weight belongs to head r // (3d), part (r // d) % 3 (q, k, v), dim r % d
    w = np.arange(3 * heads * d)[:, None] * 100 + np.arange(hidden)[None, :]
    ours = np.asarray(neox_qkv_weight(jnp.asarray(w), heads))
    for part in range(3):
        for h in range(heads):
            for j in range(d):
                col = part * heads * d + h * d + j
                np.testing.assert_array_equal(ours[:, col], w[h * 3 * d + part * d + j])
    b = np.arange(3 * heads * d)
    ob = np.asarray(neox_qkv_bias(jnp.asarray(b), heads))
    assert ob[heads * d + d] == b[1 * 3 * d + d]  # K of head 1, dim 0


def test_sharded_checkpoint_with_index(tmp_path):
    single = tmp_path / "single"
    fake_checkpoint(DEEPSEEK, single)
    tensors = load_file(str(single / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(DEEPSEEK))
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = from_pretrained(single, dtype="fp32")
    b = from_pretrained(sharded, dtype="fp32")
    toks = jnp.arange(6)[None]
    np.testing.assert_array_equal(a(toks), b(toks))
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        from_pretrained(sharded)


def test_stacked_expert_tensors_of_transformers_5(tmp_path):
    per = tmp_path / "per"
    fake_checkpoint(DEEPSEEK, per)
    t = load_file(str(per / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    gate = np.stack([t.pop(f"{p}{e}.gate_proj.weight") for e in range(4)])
    up = np.stack([t.pop(f"{p}{e}.up_proj.weight") for e in range(4)])
    down = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(4)])
    t[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
    t[p + "down_proj"] = down
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text(json.dumps(DEEPSEEK))
    save_file(t, str(stacked / "model.safetensors"))
    a, b = from_pretrained(per, dtype="fp32"), from_pretrained(stacked, dtype="fp32")
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(getattr(a.layers[1].moe, name)[...], getattr(b.layers[1].moe, name)[...])


def test_tied_embeddings_and_ignored_buffers(tmp_path):
    cfg = dict(LLAMA, tie_word_embeddings=True)
    fake_checkpoint(cfg, tmp_path, add={"model.layers.0.self_attn.rotary_emb.inv_freq": (2,),
                                        "lm_head.weight": (32, 16)})
    m = from_pretrained(tmp_path)
    assert m.lm_head is None


def test_unknown_architecture(tmp_path):
    fake_checkpoint(LLAMA, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, architectures=["MambaForCausalLM"],
                                                          model_type="mamba")))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    fake_checkpoint(NEOX, tmp_path, drop=["gpt_neox.layers.0.mlp.dense_4h_to_h.bias"])
    with pytest.raises(CheckpointError, match=r"missing tensor 'gpt_neox\.layers\.0\.mlp\.dense_4h_to_h\.bias'"):
        from_pretrained(tmp_path)


def test_missing_expert_is_named(tmp_path):
    fake_checkpoint(DEEPSEEK, tmp_path, drop=["model.layers.1.mlp.experts.3.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        from_pretrained(tmp_path)


def test_extra_tensor_is_named(tmp_path):
    fake_checkpoint(LLAMA, tmp_path, add={"model.layers.0.self_attn.q_norm.weight": (4,)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        from_pretrained(tmp_path)


def test_shape_mismatch_is_named(tmp_path):
    fake_checkpoint(LLAMA, tmp_path, reshape={"model.layers.1.self_attn.k_proj.weight": (16, 16)})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(16, 16\), "
                                              r"expected \(8, 16\)"):
        from_pretrained(tmp_path)


def test_missing_config_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(tmp_path)


def test_tokenizer_is_loaded_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    fake_checkpoint(LLAMA, tmp_path)
    model, tok = from_pretrained(tmp_path, return_tokenizer=True)
    assert tok is None
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world"] + [f"w{i}" for i in range(29)])}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    model, tok = from_pretrained(tmp_path, return_tokenizer=True)
    assert tok.encode("hello world").ids == [1, 2]
