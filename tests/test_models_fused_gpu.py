"""flax_models on the GPU with the fused kernels, on small models whose shapes the kernels
take but no preset has (Qwen2.5-style GQA 7, Qwen2.5's YaRN, Mistral's sliding window over a
rolling cache, head_dim 80 with partial rotary, head_dim 256, DeepSeek-V2 with q LoRA and
group-limited routing): prefill, then decode steps with impl="fused" against the same steps
on XLA's ops, from the same caches, in bfloat16. Every block must say it ran on jax_cluster (no silent fallback)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import ops
from flax_models.config import DeepseekV2Config, GPTNeoXConfig, LlamaConfig, RopeConfig
from flax_models.presets import random_model
from jax_cluster.testing import rel_l2

pytestmark = pytest.mark.gpu

ROPE = RopeConfig(theta=10000.0)
MODELS = {
    # Qwen2.5-0.5B's attention in miniature: 7 query heads on 1 KV head, q/k/v biases
    "qwen2-gqa7": LlamaConfig(vocab_size=256, hidden_size=448, intermediate_size=576, num_layers=2, num_heads=7,
                              num_kv_heads=1, head_dim=64, rope=ROPE, attention_bias=True, o_proj_bias=False,
                              tie_word_embeddings=True),
    # Qwen2.5's long-context YaRN (the cos/sin factor, carried by the softmax scale)
    "qwen2-gqa4-yarn": LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=768, num_layers=2, num_heads=8,
                                   num_kv_heads=2, head_dim=64, attention_bias=True, o_proj_bias=False,
                                   rope=RopeConfig(theta=1e6, rope_type="yarn", factor=4.0,
                                                   original_max_position_embeddings=32)),
    # Mistral's sliding window past its end (window 8 < the 11-token prompt): layer 0's cache is
    # the window's rolling buffer (jax_cluster.decode_attention), layer 1 attends to every token
    "mistral-window8-rolling": LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_layers=2,
                                           num_heads=8, num_kv_heads=2, head_dim=64, rope=ROPE, sliding_window=8,
                                           sliding_layers=(True, False)),
    "llama-gqa3-hd128": LlamaConfig(vocab_size=256, hidden_size=384, intermediate_size=1000, num_layers=2,
                                    num_heads=6, num_kv_heads=2, head_dim=128, rope=ROPE),
    "pythia-hd80": GPTNeoXConfig(vocab_size=256, hidden_size=320, intermediate_size=1280, num_layers=2, num_heads=4,
                                 rotary_dim=20, rope=ROPE),
    "pythia-hd64-sequential": GPTNeoXConfig(vocab_size=256, hidden_size=256, intermediate_size=1024, num_layers=2,
                                            num_heads=4, rotary_dim=16, rope=ROPE, use_parallel_residual=False),
    # Pythia-1B's heads (head_dim 256, a quarter rotary) and Gemma-2B's (MQA 8 at head_dim 256)
    "pythia-hd256": GPTNeoXConfig(vocab_size=256, hidden_size=512, intermediate_size=2048, num_layers=2, num_heads=2,
                                  rotary_dim=64, rope=ROPE),
    "llama-mqa8-hd256": LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_layers=2,
                                    num_heads=8, num_kv_heads=1, head_dim=256, rope=ROPE),
    "deepseek-v2-qlora-grouped": DeepseekV2Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_layers=2, num_heads=4,
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                        mscale=0.707, mscale_all_dim=0.707)),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_decode_matches_xla(name, batch):
    model = random_model(MODELS[name], jnp.bfloat16, seed=batch, impl="fused", std=0.05)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(batch)
    prompt, steps = 11, 6
    tokens = jnp.asarray(rng.integers(0, 256, (batch, prompt)), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, prompt + 1, batch), jnp.int32)
    cache = model.init_cache(batch, 128)
    _, cache = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c))(state, tokens, lengths, cache)

    def step(impl):
        return jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c, impl=impl))

    fused, xla = step("fused"), step("xla")
    for j in range(steps):
        tok = jnp.asarray(rng.integers(0, 256, batch), jnp.int32)
        with ops.record_routes() as routes:  # traced on the first step
            got, next_cache = fused(state, tok, cache)
        if j == 0:
            assert routes and all(r.runs == "jax_cluster" for r in routes), [str(r) for r in routes]
        want, _ = xla(state, tok, cache)
        err = rel_l2(got.astype(jnp.float32), want.astype(jnp.float32))
        assert err <= 3e-2, f"{name} b{batch} step {j}: logits rel_l2 {err:.3g}"
        cache = next_cache


@pytest.mark.parametrize("page_size", [16, 64])
def test_fused_decode_on_a_paged_latent_cache(page_size):
    """The DeepSeek model above over a paged latent cache (a shuffled pool, pages of 16 or 64
    tokens): the same logits, bit for bit, as over contiguous rows, on the fused kernels."""
    batch, prompt, steps, max_len = 3, 11, 6, 128
    model = random_model(MODELS["deepseek-v2-qlora-grouped"], jnp.bfloat16, seed=5, impl="fused", std=0.05)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, 256, (batch, prompt)), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, prompt + 1, batch), jnp.int32)
    blocks = max_len // page_size
    table = rng.permutation(batch * blocks + 3)[: batch * blocks].reshape(batch, blocks).astype(np.int32)
    prefill = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c))
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c, impl="fused"))
    caches = [model.init_cache(batch, max_len),
              model.init_cache(batch, max_len, page_size=page_size, block_table=table, num_pages=batch * blocks + 3)]
    caches = [prefill(state, tokens, lengths, c)[1] for c in caches]
    for j in range(steps):
        tok = jnp.asarray(rng.integers(0, 256, batch), jnp.int32)
        outs = [step(state, tok, c) for c in caches]
        caches = [c for _, c in outs]
        np.testing.assert_array_equal(np.asarray(outs[1][0]), np.asarray(outs[0][0]), err_msg=f"step {j}")
