"""DeepSeek models over a paged latent cache (flax_models.PagedLatentCache): the same logits as
over contiguous rows, on XLA's ops and on jax_cluster.mla_decode's CPU handler, with pages out
of order, a pool larger than the batch needs, and rows sharing their prompt's first pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_models import DeepseekV2, Llama, PagedLatentCache, ops
from flax_models.engine import generate, pad_prompts
from flax_models.presets import PRESETS

PAGE = 8
MAX_LEN = 32  # a whole number of pages: both layouts attend over the same slot count


def _model(name="tiny-deepseek", dtype=jnp.float32):
    return DeepseekV2(PRESETS[name], dtype=dtype, rngs=nnx.Rngs(0))


def _run(model, prompts, steps, impl, **cache_kw):
    """Logits of the prefill and of `steps` teacher-forced decode steps, [steps + 1, B, V]."""
    tokens, lengths = pad_prompts([p[: n] for p, n in prompts], multiple=1)
    graphdef, state = nnx.split(model)
    impl = ops.normalize_impl(impl)
    prefill = jax.jit(lambda st, t, n, c: nnx.merge(graphdef, st).prefill(t, n, c))
    step = jax.jit(lambda st, t, c: nnx.merge(graphdef, st).decode(t, c, impl=impl))
    cache = model.init_cache(len(prompts), MAX_LEN, **cache_kw)
    logits, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(lengths), cache)
    out = [np.asarray(logits)]
    for j in range(steps):
        tok = jnp.asarray([p[n + j] for p, n in prompts], jnp.int32)
        logits, cache = step(state, tok, cache)
        out.append(np.asarray(logits))
    return np.stack(out), cache


def _same(got, want):
    """Bitwise on CPU; on a GPU, where XLA may fuse the page gather into its dots, within fp32
    rounding and with the same greedy tokens."""
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (got.argmax(-1) == want.argmax(-1)).all()


def _prompts(lengths, steps, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, n + steps).tolist(), n) for n in lengths]


def _shuffled_table(batch, blocks, pool, seed=1):
    """Every row's blocks on distinct pages of a pool of `pool` pages, in random order."""
    pages = np.random.default_rng(seed).permutation(pool)[: batch * blocks]
    return pages.reshape(batch, blocks).astype(np.int32)


@pytest.mark.parametrize("impl", ["xla", "attention=fused,mlp=xla"])
@pytest.mark.parametrize("name", ["tiny-deepseek", "tiny-deepseek-v3"])
def test_paged_cache_decodes_as_contiguous_rows(name, impl):
    model = _model(name, jnp.float32 if impl == "xla" else jnp.bfloat16)  # the GPU kernel takes 16-bit
    prompts = _prompts((5, 11, 2), steps=12, vocab=model.config.vocab_size)
    want, _ = _run(model, prompts, 12, impl)
    blocks = MAX_LEN // PAGE
    table = _shuffled_table(3, blocks, pool=3 * blocks + 5)
    got, cache = _run(model, prompts, 12, impl, page_size=PAGE, block_table=table, num_pages=3 * blocks + 5)
    assert isinstance(cache, PagedLatentCache)
    assert cache.latent[0].shape == (3 * blocks + 5, PAGE, 40)
    _same(got, want)


def test_rows_share_their_common_prefix_pages():
    """Two prompts with the same first 16 tokens on the same two pages of the pool: each row's
    logits are those of its own contiguous row, and the pool holds 2 pages fewer."""
    model = _model(dtype=jnp.bfloat16)
    vocab, steps = model.config.vocab_size, 8
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, vocab, 2 * PAGE).tolist()
    prompts = [(prefix + rng.integers(0, vocab, 3 + steps).tolist(), 2 * PAGE + 3),
               (prefix + rng.integers(0, vocab, 6 + steps).tolist(), 2 * PAGE + 6)]
    want, _ = _run(model, prompts, steps, "attention=fused,mlp=xla")
    table = np.asarray([[0, 1, 2, 3], [0, 1, 4, 5]], np.int32)
    got, cache = _run(model, prompts, steps, "attention=fused,mlp=xla", page_size=PAGE, block_table=table)
    assert cache.latent[0].shape[0] == 6
    _same(got, want)


def test_generate_on_a_paged_cache():
    model = _model()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    want = generate(model, prompts, 10).tokens
    assert generate(model, prompts, 10, page_size=4).tokens == want
    assert generate(model, prompts, 10, page_size=64).tokens == want  # one page per row


def test_paged_cache_errors():
    model = _model()
    with pytest.raises(ValueError, match="outside the pool of 4"):
        model.init_cache(2, MAX_LEN, page_size=PAGE, block_table=np.arange(8).reshape(2, 4), num_pages=4)
    with pytest.raises(ValueError, match=r"block_table must be \[batch=3"):
        model.init_cache(3, MAX_LEN, page_size=PAGE, block_table=np.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        model.init_cache(2, MAX_LEN, page_size=0)
    with pytest.raises(ValueError, match="give page_size too"):
        model.init_cache(2, MAX_LEN, num_pages=8)
    with pytest.raises(ValueError, match="MLA's"):
        generate(Llama(PRESETS["tiny-llama"], dtype=jnp.float32, rngs=nnx.Rngs(0)), [[1, 2]], 2, page_size=8)
