"""Built-in model presets (no download): tiny CPU models and the real architectures' shapes, all with
random weights generated directly in the target dtype on the default device."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import DeepseekV2Config, GPTNeoXConfig, LlamaConfig, RopeConfig, config_from_hf
from .loading import abstract_model, fill, from_pretrained, parse_dtype, read_config

PRESETS = {
    # tiny models: run anywhere in seconds
    "tiny-llama": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0)),
    # Mistral's sliding window (16 tokens): generations past it decode over rolling caches
    "tiny-mistral": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0), sliding_window=16,
                                sliding_layers=(True, True)),
    "tiny-pythia": GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4,
                                 rotary_dim=4, rope=RopeConfig(theta=10000.0)),
    "tiny-deepseek": DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_layers=2, num_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                        mscale=0.707, mscale_all_dim=0.707)),
    # DeepSeek-V3's layer in miniature: q LoRA, the sigmoid router with its correction bias (noaux_tc)
    "tiny-deepseek-v3": DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_layers=2, num_heads=4,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
        topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                        mscale=1.0, mscale_all_dim=1.0)),
    # real shapes, random weights
    "llama-2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                              num_heads=32, num_kv_heads=32, head_dim=128, rope=RopeConfig(theta=10000.0),
                              rms_norm_eps=1e-5, eos_token_ids=(2,)),
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=500000.0),
                              rms_norm_eps=1e-5, max_position_embeddings=8192, eos_token_ids=(128001,)),
    # Mistral-7B-v0.1: every layer attends to its last 4096 tokens (a rolling cache of 4096 slots)
    "mistral-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, rope=RopeConfig(theta=10000.0),
                              rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=4096,
                              sliding_layers=(True,) * 32, eos_token_ids=(2,)),
    # tied embeddings, llama3 RoPE scaling: a model small enough that op boundaries dominate a step
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64,
                                rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=8192),
                                rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
                                eos_token_ids=(128001,)),
    "pythia-1b": GPTNeoXConfig(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_layers=16,
                               num_heads=8, rotary_dim=64, rope=RopeConfig(theta=10000.0), eos_token_ids=(0,)),
    "pythia-2.8b": GPTNeoXConfig(vocab_size=50304, hidden_size=2560, intermediate_size=10240, num_layers=32,
                                 num_heads=32, rotary_dim=20, rope=RopeConfig(theta=10000.0), eos_token_ids=(0,)),
    "pythia-6.9b": GPTNeoXConfig(vocab_size=50432, hidden_size=4096, intermediate_size=16384, num_layers=32,
                                 num_heads=32, rotary_dim=32, rope=RopeConfig(theta=10000.0), eos_token_ids=(0,)),
    "deepseek-v2-lite": DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_layers=27,
        num_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                        mscale=0.707, mscale_all_dim=0.707),
        max_position_embeddings=163840, eos_token_ids=(100001,)),
}
PRESETS["llama2-7b"], PRESETS["llama3-8b"] = PRESETS["llama-2-7b"], PRESETS["llama-3-8b"]


def preset_config(name: str):
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}") from None


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal_direct(key, shape, dtype, std):
    return jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype)


def random_model(cfg, dtype=jnp.float32, *, seed: int = 0, impl="auto", std: float = 0.02):
    """cfg's model with N(0, std) weights, norm scales 1 and biases 0, made leaf by leaf in dtype
    (no float32 copy of a large model ever exists)."""
    abstract = abstract_model(cfg, dtype, impl)
    _, state = nnx.split(abstract)
    key = jax.random.key(seed)
    values = {}
    for i, (path, var) in enumerate(nnx.to_flat_state(state)):
        sds = var.get_value()
        name = path[-1]
        if name == "weight":
            values[path] = jnp.ones(sds.shape, sds.dtype)
        elif name == "bias":
            values[path] = jnp.zeros(sds.shape, sds.dtype)
        else:
            if sds.size < (1 << 20):  # small: numpy on the host, no compilation per shape
                w = np.random.default_rng((seed, i)).standard_normal(sds.shape, np.float32) * std
                values[path] = jnp.asarray(w).astype(sds.dtype)
            else:
                gen = _normal if sds.size < (1 << 24) else _normal_direct
                values[path] = gen(jax.random.fold_in(key, i), tuple(sds.shape), jnp.dtype(sds.dtype), std)
    return fill(abstract, values)


def resolve_model(name_or_path: str):
    """A preset name or a Hugging Face checkpoint directory -> (config, directory or None).

    Reads config.json only (no weights); a ValueError says what is wrong with the name."""
    name = str(name_or_path)
    if name in PRESETS:
        return PRESETS[name], None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{name!r} is a directory without config.json: not a Hugging Face checkpoint")
        return config_from_hf(read_config(path)), path
    if os.path.exists(path):
        raise ValueError(f"{name!r} is a file; a checkpoint is a directory (config.json + *.safetensors)")
    if os.sep in name or "/" in name or name.startswith((".", "~")):
        raise ValueError(f"checkpoint directory {name!r} does not exist")
    raise ValueError(f"{name!r} is neither a preset nor an existing checkpoint directory; "
                     f"presets: {', '.join(sorted(PRESETS))}")


def load_model(name_or_path, dtype=None, *, impl="auto", seed: int = 0):
    """A preset name or a Hugging Face directory -> (model, tokenizer or None)."""
    cfg, path = resolve_model(name_or_path)
    if path is not None:
        return from_pretrained(path, dtype, impl=impl, return_tokenizer=True)
    return random_model(cfg, parse_dtype(dtype), seed=seed, impl=impl), None
