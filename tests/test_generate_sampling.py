"""Sampling and batched generation (no torch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models.engine import generate, pad_prompts
from flax_models.presets import PRESETS, random_model
from flax_models.sampling import SamplingParams, filter_logits, sample


def test_greedy_is_argmax_and_top_k1_is_greedy():
    logits = jax.random.normal(jax.random.key(0), (4, 50))
    g = sample(logits, jax.random.key(1), SamplingParams())
    np.testing.assert_array_equal(g, jnp.argmax(logits, -1))
    for seed in range(3):
        np.testing.assert_array_equal(sample(logits, jax.random.key(seed), SamplingParams(1.0, top_k=1)), g)
        np.testing.assert_array_equal(sample(logits, jax.random.key(seed), SamplingParams(1.0, top_p=1e-6)), g)


def test_top_k_and_top_p_restrict_the_support():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    f = filter_logits(logits, SamplingParams(1.0, top_k=2))
    assert np.isfinite(np.asarray(f)).tolist() == [[True, True, False, False, False]]
    f = filter_logits(logits, SamplingParams(1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8 <= 0.85
    assert np.isfinite(np.asarray(f)).tolist() == [[True, True, True, False, False]]
    f = filter_logits(logits, SamplingParams(1.0, top_p=0.7))  # 0.5 + 0.2 reaches 0.7 exactly
    assert np.isfinite(np.asarray(f)).sum() in (2, 3)
    keys = jax.random.split(jax.random.key(3), 2000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, SamplingParams(1.0, top_k=3)))(keys))[:, 0]
    assert set(draws.tolist()) <= {0, 1, 2}
    freq = np.bincount(draws, minlength=3)[:3] / len(draws)
    np.testing.assert_allclose(freq, np.array([0.5, 0.2, 0.15]) / 0.85, atol=0.04)


def test_temperature_sharpens():
    logits = jnp.array([[2.0, 1.0, 0.0]])
    keys = jax.random.split(jax.random.key(4), 1000)
    cold = np.asarray(jax.vmap(lambda k: sample(logits, k, SamplingParams(0.1)))(keys))
    hot = np.asarray(jax.vmap(lambda k: sample(logits, k, SamplingParams(5.0)))(keys))
    assert (cold == 0).mean() > 0.99 and (hot == 0).mean() < 0.6


def test_invalid_sampling_parameters():
    for kw in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_pad_prompts_right_pads():
    toks, lens = pad_prompts([[1, 2, 3], [4]], multiple=4)
    assert toks.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]] and lens.tolist() == [3, 1]
    with pytest.raises(ValueError):
        pad_prompts([[1], []])


@pytest.fixture(scope="module")
def tiny_llama():
    return random_model(PRESETS["tiny-llama"], std=0.1)


def test_batched_generation_equals_one_by_one(tiny_llama):
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [42]]
    batched = generate(tiny_llama, prompts, 12)
    for p, row in zip(prompts, batched.tokens):
        assert generate(tiny_llama, [p], 12).tokens[0] == row
    assert batched.decode_steps == 11 and batched.prefill_s > 0 and batched.tokens_per_s > 0


def test_sampling_is_reproducible_with_a_seed(tiny_llama):
    sp = SamplingParams(1.0, top_k=20, top_p=0.95)
    a = generate(tiny_llama, [[1, 2, 3]] * 2, 10, sampling=sp, seed=7).tokens
    b = generate(tiny_llama, [[1, 2, 3]] * 2, 10, sampling=sp, seed=7).tokens
    c = generate(tiny_llama, [[1, 2, 3]] * 2, 10, sampling=sp, seed=8).tokens
    assert a == b and a != c
    assert a[0] != a[1]  # rows draw independently


def test_generation_stops_at_eos(tiny_llama):
    ref = generate(tiny_llama, [[3, 4]], 20).tokens[0]
    eos = ref[4]
    cut = generate(tiny_llama, [[3, 4]], 20, eos_token_ids=(eos,)).tokens[0]
    assert cut == ref[: ref.index(eos) + 1]
