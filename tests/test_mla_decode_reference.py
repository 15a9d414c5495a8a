"""reference.mla_decode (DeepSeek-V2's absorbed-MLA decode step, fp32): against flax_models'
mla_decode_xla (the contract), 16-bit inputs within docs/numerics.md's tolerances, the paged
latent cache against the contiguous one, and invalid lengths / block tables under jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_models import mla
from flax_models.ops import mla_decode_xla
from flax_models.presets import PRESETS, random_model
from jax_cluster import reference
from jax_cluster.testing import TOLERANCE, rel_l2

DIMS = dict(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
HIDDEN, S_MAX = 64, 16
E = DIMS["kv_lora_rank"] + DIMS["qk_rope_head_dim"]


def make_weights(rng, *, q_lora=None, bias=False, hidden=HIDDEN, dtype=jnp.float32, num_heads, kv_lora_rank,
                 qk_nope_head_dim, qk_rope_head_dim, v_head_dim):
    def f(*shape, scale=None, offset=0.0):
        scale = shape[0] ** -0.5 if scale is None else scale
        return jnp.asarray(rng.standard_normal(shape) * scale + offset, dtype)

    r, dq = kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim
    w = dict(norm=f(hidden, scale=0.2, offset=1.0), kv_a=f(hidden, r + qk_rope_head_dim),
             kv_a_norm=f(r, scale=0.2, offset=1.0), kv_b=f(r, num_heads * (qk_nope_head_dim + v_head_dim)),
             o=f(num_heads * v_head_dim, hidden))
    if q_lora is None:
        w["q"] = f(hidden, num_heads * dq)
    else:
        w.update(q_a=f(hidden, q_lora), q_a_norm=f(q_lora, scale=0.2, offset=1.0), q_b=f(q_lora, num_heads * dq))
    if bias:
        w.update(kv_a_bias=f(r + qk_rope_head_dim, scale=0.1), o_bias=f(hidden, scale=0.1))
        if q_lora is not None:
            w["q_a_bias"] = f(q_lora, scale=0.1)
    return w


def make_inputs(rng, *, lengths, dtype=jnp.float32, **wkw):
    lengths = jnp.asarray(lengths, jnp.int32)
    batch = lengths.shape[0]
    dr = DIMS["qk_rope_head_dim"]
    args = dict(x=jnp.asarray(rng.standard_normal((batch, HIDDEN)), dtype),
                weights=make_weights(rng, dtype=dtype, **DIMS, **wkw),
                latent_cache=jnp.asarray(rng.standard_normal((batch, S_MAX, E)), dtype),
                lengths=lengths,
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, dr, 2) / dr), jnp.float32))
    kw = dict(**DIMS, scale=(DIMS["qk_nope_head_dim"] + dr) ** -0.5 * 1.3, eps=1e-5, latent_eps=1e-6)
    return args, kw


def run_xla(args, kw, residual):
    a = dict(args, w=args["weights"], latent_cache=args["latent_cache"][:, None])
    del a["weights"]
    y, cache = jax.jit(functools.partial(mla_decode_xla, residual=residual, **kw))(**a)
    return y, cache[:, 0]


def run_ref(args, kw, residual=False, block_table=None):
    fn = jax.jit(functools.partial(reference.mla_decode, residual=residual, **kw))
    return fn(**args, block_table=block_table)


AWKWARD = (0, 7, S_MAX - 1)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("q_lora,bias", [(None, False), (24, False), (24, True), (None, True)])
def test_float32_matches_mla_decode_xla(rng, q_lora, bias, residual):
    args, kw = make_inputs(rng, lengths=AWKWARD, q_lora=q_lora, bias=bias)
    y, cache = run_ref(args, kw, residual)
    xy, xcache = run_xla(args, kw, residual)
    assert y.dtype == jnp.float32 and cache.dtype == jnp.float32
    assert rel_l2(y, xy) <= TOLERANCE["float32"], rel_l2(y, xy)
    np.testing.assert_allclose(cache, xcache, rtol=1e-5, atol=1e-5)
    # only slot lengths[b] of each row changed
    changed = np.any(np.asarray(cache) != np.asarray(args["latent_cache"]), axis=-1)
    expect = np.arange(S_MAX)[None, :] == np.asarray(AWKWARD)[:, None]
    np.testing.assert_array_equal(changed, expect)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("q_lora,residual", [(None, True), (24, False)])
def test_16bit_inputs_within_tolerance(rng, dtype, residual, q_lora):
    """The 16-bit reference and XLA's 16-bit path against the fp32 reference on the same inputs."""
    args, kw = make_inputs(rng, lengths=AWKWARD, dtype=dtype, q_lora=q_lora, bias=True)
    y, cache = run_ref(args, kw, residual)
    assert y.dtype == jnp.dtype(dtype) and cache.dtype == jnp.dtype(dtype)
    args32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.dtype(dtype) else a, args)
    ry, rcache = run_ref(args32, kw, residual)
    xy, xcache = run_xla(args, kw, residual)
    tol = TOLERANCE[dtype]
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    assert rel_l2(xy, ry) <= tol, rel_l2(xy, ry)
    assert rel_l2(cache, rcache) <= tol and rel_l2(xcache, rcache) <= tol


def to_pages(rng, cache, page, *, capacity_blocks=None, spare=3):
    """A contiguous cache [B, S, E] scattered into a shuffled pool (unowned pages NaN)."""
    cache = np.asarray(cache)
    b, s, e = cache.shape
    nblk = s // page
    cap = nblk if capacity_blocks is None else capacity_blocks
    pool_pages = b * cap + spare
    perm = rng.permutation(pool_pages)
    table = perm[: b * cap].reshape(b, cap).astype(np.int32)
    pool = np.full((pool_pages, page, e), np.nan, cache.dtype)
    for i in range(b):
        for j in range(nblk):
            pool[table[i, j]] = cache[i, j * page:(j + 1) * page]
    return jnp.asarray(pool), jnp.asarray(table)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_paged_equals_contiguous(rng, page):
    args, kw = make_inputs(rng, lengths=AWKWARD, q_lora=24, bias=True)
    y, cache = run_ref(args, kw, residual=True)
    pool, table = to_pages(rng, args["latent_cache"], page)
    py, new_pool = run_ref(dict(args, latent_cache=pool), kw, residual=True, block_table=table)
    np.testing.assert_allclose(py, y, rtol=1e-6, atol=1e-6)
    expect = np.array(pool)
    for b, length in enumerate(AWKWARD):
        expect[table[b, length // page], length % page] = cache[b, length]
    np.testing.assert_array_equal(new_pool, expect)  # NaN-equal: spare pages untouched


def test_paged_capacity_beyond_s_max_and_unused_entries(rng):
    """A table longer than what the rows use: entries past a row's last block may be anything."""
    page, lengths = 4, (2, 9, 15)
    args, kw = make_inputs(rng, lengths=lengths)
    y, _ = run_ref(args, kw)
    pool, table = to_pages(rng, args["latent_cache"], page, capacity_blocks=6)
    table = np.array(table)
    table[0, 1:] = -1
    table[1, 3:] = 10 ** 6
    py, _ = run_ref(dict(args, latent_cache=pool), kw, block_table=jnp.asarray(table))
    np.testing.assert_allclose(py, y, rtol=1e-6, atol=1e-6)


def test_invalid_lengths_contiguous(rng):
    bad = (-1, 5, S_MAX, 2 ** 30)
    args, kw = make_inputs(rng, lengths=bad)
    y, cache = run_ref(args, kw, residual=True)
    good_y, good_cache = run_ref(dict(args, lengths=jnp.asarray([0, 5, 3, 1], jnp.int32)), kw, residual=True)
    y, cache, old = np.asarray(y), np.asarray(cache), np.asarray(args["latent_cache"])
    for b in (0, 2, 3):
        assert np.all(np.isnan(y[b]))
        np.testing.assert_array_equal(cache[b], old[b])
    np.testing.assert_array_equal(y[1], np.asarray(good_y)[1])
    np.testing.assert_array_equal(cache[1], np.asarray(good_cache)[1])


def test_invalid_lengths_and_block_tables_paged(rng):
    page = 4
    args, kw = make_inputs(rng, lengths=(0, 0, 0, 0, 0))
    pool, table = to_pages(rng, args["latent_cache"], page)  # capacity 16 = S_MAX
    table = np.array(table)
    table[3, 2] = -1  # used by length 9
    table[4, 1] = pool.shape[0]  # used by length 6: a page outside the pool
    lengths = jnp.asarray([-3, 5, S_MAX, 9, 6], jnp.int32)
    py, new_pool = run_ref(dict(args, latent_cache=pool, lengths=lengths), kw, block_table=jnp.asarray(table))
    py = np.asarray(py)
    assert np.all(np.isnan(py[[0, 2, 3, 4]]))
    cy, ccache = run_ref(dict(args, lengths=lengths), kw)
    np.testing.assert_allclose(py[1], np.asarray(cy)[1], rtol=1e-6, atol=1e-6)
    expect = np.array(pool)
    expect[table[1, 5 // page], 5 % page] = ccache[1, 5]
    np.testing.assert_array_equal(new_pool, expect)  # only row 1's slot written


def test_tiny_deepseek_layer_matches_model_decode(rng):
    """The tiny-deepseek preset's MLA weights and kwargs, as DeepseekV2._decode_layers passes them."""
    cfg = PRESETS["tiny-deepseek"]
    model = random_model(cfg, std=0.15)
    assert model.rope_factor() == 1.0  # mscale == mscale_all_dim: the whole YaRN temperature is in scale
    layer = model.layers[0]
    w = layer.attn.weights(layer.input_norm.weight[...])
    kw = dict(num_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, scale=mla.softmax_scale(cfg),
              eps=cfg.rms_norm_eps, latent_eps=mla.LATENT_NORM_EPS)
    lengths = jnp.asarray([0, 11, 31], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, cfg.hidden_size)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((3, 32, cfg.kv_lora_rank + cfg.qk_rope_head_dim)), jnp.float32)
    y, cache = reference.mla_decode(x, w, lat, lengths, model.inv_freq(), residual=True, **kw)
    xy, xcache = mla_decode_xla(x, w, lat[:, None], lengths, model.inv_freq(), rope_factor=model.rope_factor(),
                                residual=True, **kw)
    assert rel_l2(y, xy) <= TOLERANCE["float32"], rel_l2(y, xy)
    np.testing.assert_allclose(cache, xcache[:, 0], rtol=1e-5, atol=1e-5)
