"""jax_cluster.mla_decode: every impl against the fp32 reference (contiguous and paged latent
caches, q LoRA and biases, YaRN's rope factor), invalid rows under jit, the errors raised
before anything runs, jit / vmap, the projection kernels against XLA's dots; on a GPU the
CUDA kernels on DeepSeek-V2 and V2-Lite shapes, several splits, 64-token pages, and bitwise
determinism."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster
from jax_cluster import MlaDecodeConfig, mla_decode
from jax_cluster.testing import TOLERANCE, rel_l2


def make_case(rng, *, batch=3, hidden=64, heads=4, rank=32, nope=16, rope=8, v=16, s_max=40, q_lora=None,
              bias=False, dtype=jnp.float32, lengths=None):
    def f(*shape, scale=None, offset=0.0):
        scale = shape[0] ** -0.5 if scale is None else scale
        return jnp.asarray(rng.standard_normal(shape) * scale + offset, dtype)

    w = dict(norm=f(hidden, scale=0.2, offset=1.0), kv_a=f(hidden, rank + rope), kv_a_norm=f(rank, scale=0.2, offset=1.0),
             kv_b=f(rank, heads * (nope + v)), o=f(heads * v, hidden))
    if q_lora is None:
        w["q"] = f(hidden, heads * (nope + rope))
    else:
        w.update(q_a=f(hidden, q_lora), q_a_norm=f(q_lora, scale=0.2, offset=1.0), q_b=f(q_lora, heads * (nope + rope)))
    if bias:
        w.update(kv_a_bias=f(rank + rope, scale=0.1), o_bias=f(hidden, scale=0.1))
        if q_lora is not None:
            w["q_a_bias"] = f(q_lora, scale=0.1)
    if lengths is None:
        lengths = rng.integers(0, s_max, batch)
    lengths = jnp.asarray(lengths, jnp.int32)
    args = dict(x=f(lengths.shape[0], hidden, scale=1.0), weights=w,
                latent_cache=f(lengths.shape[0], s_max, rank + rope, scale=1.0), lengths=lengths,
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, rope, 2) / rope), jnp.float32))
    kw = dict(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
              scale=1.3 * (nope + rope) ** -0.5, eps=1e-5, latent_eps=1e-6)
    return args, kw


def to_pages(rng, cache, page, *, extra_blocks=0, spare=3):
    """[B, S, E] scattered into a shuffled page pool (unowned pages NaN) and its block table."""
    cache = np.asarray(cache)
    b, s, e = cache.shape
    nblk = -(-s // page)
    cap = nblk + extra_blocks
    perm = rng.permutation(b * cap + spare)
    table = perm[: b * cap].reshape(b, cap).astype(np.int32)
    pool = np.full((b * cap + spare, page, e), np.nan, cache.dtype)
    padded = np.concatenate([cache, np.zeros((b, nblk * page - s, e), cache.dtype)], 1)
    for i in range(b):
        for j in range(nblk):
            pool[table[i, j]] = padded[i, j * page:(j + 1) * page]
    return jnp.asarray(pool), jnp.asarray(table)


def run(args, kw, impl, device=None, **extra):
    fn = jax.jit(functools.partial(mla_decode, impl=impl, **kw, **extra))
    if device is not None:
        args = jax.device_put(args, device)
    return fn(**args)


def check_close(got, want, dtype):
    y, cache = got
    ry, rcache = want
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert y.dtype == jnp.dtype(dtype)
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    assert rel_l2(cache, rcache) <= tol, rel_l2(cache, rcache)


# ----------------------------------------------------------------------------- CPU (and any backend)
@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("q_lora,bias,residual", [(None, False, True), (24, True, False)])
def test_impls_match_reference(rng, impl, dtype, q_lora, bias, residual):
    args, kw = make_case(rng, q_lora=q_lora, bias=bias, dtype=dtype, lengths=(0, 17, 39))
    check_close(run(args, kw, impl, residual=residual), run(args, kw, "reference", residual=residual), dtype)


@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_paged_equals_contiguous(rng, impl, page):
    args, kw = make_case(rng, lengths=(3, 39, 20))
    y, cache = run(args, kw, impl, residual=True)
    pool, table = to_pages(rng, args["latent_cache"], page, extra_blocks=1)
    py, new_pool = run(dict(args, latent_cache=pool), kw, impl, residual=True, block_table=table)
    np.testing.assert_allclose(py, y, rtol=1e-5, atol=1e-5)
    expect = np.array(pool)
    for b, length in enumerate((3, 39, 20)):
        expect[table[b, length // page], length % page] = cache[b, length]
    np.testing.assert_array_equal(new_pool, expect)  # NaN-equal: no other page touched


def test_cuda_splits_agree(rng):
    """The C++ handler with one split and several (the kernels' split arithmetic)."""
    args, kw = make_case(rng, lengths=(0, 39, 12))
    one = run(args, kw, "cuda", config=MlaDecodeConfig(splits=1))
    for splits in (2, 7, 256):
        many = run(args, kw, "cuda", config=MlaDecodeConfig(splits=splits))
        np.testing.assert_allclose(many[0], one[0], rtol=1e-6, atol=1e-6)


def test_default_splits():
    """Two blocks per SM while splits hold 256 tokens, else one per SM down to 64-token splits;
    no split without tokens (the H200 sweep in docs/mla_decode.md)."""
    from jax_cluster.ops.mla_decode import default_splits as splits
    assert splits(1, 16, 4096) == 64 and splits(1, 16, 32768) == 128  # one block per SM, capped
    assert splits(4, 16, 4096) == 32 and splits(8, 16, 4096) == 16  # one per SM, 128- and 256-token splits
    assert splits(16, 16, 4096) == 16 and splits(64, 16, 4096) == 4  # two per SM, 256 tokens and more
    assert splits(4, 16, 32768) == 64  # two per SM: 66 asked, 64 splits of 512 tokens hold them
    assert splits(1, 128, 4096) == 16 and splits(4, 128, 4096) == 8  # V2's 8 head tiles
    assert splits(1, 16, 40) == 1 and splits(64, 128, 100_000) == 1


def test_rope_factor_matches_reference(rng):
    args, kw = make_case(rng)
    for impl in ("xla", "cuda"):
        check_close(run(args, kw, impl, rope_factor=0.7), run(args, kw, "reference", rope_factor=0.7), "float32")


@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_invalid_rows_under_jit_are_nan_and_write_nothing(rng, impl):
    args, kw = make_case(rng, batch=4, lengths=(0, 0, 0, 0))
    lengths = jnp.asarray([-1, 5, 40, 9], jnp.int32)
    y, cache = run(dict(args, lengths=lengths), kw, impl, residual=True)
    y, cache, old = np.asarray(y), np.asarray(cache), np.asarray(args["latent_cache"])
    assert np.all(np.isnan(y[[0, 2]])) and not np.any(np.isnan(y[[1, 3]]))
    np.testing.assert_array_equal(cache[[0, 2]], old[[0, 2]])
    # paged: a used block outside the pool
    pool, table = to_pages(rng, args["latent_cache"], 4)
    table = np.array(table)
    table[3, 2] = pool.shape[0]  # used by length 9
    py, new_pool = run(dict(args, latent_cache=pool, lengths=jnp.asarray([2, 5, 6, 9], jnp.int32)), kw, impl,
                       block_table=jnp.asarray(table))
    assert np.all(np.isnan(np.asarray(py)[3])) and not np.any(np.isnan(np.asarray(py)[:3]))
    changed = np.any(np.asarray(new_pool) != np.asarray(pool), axis=(1, 2)) & ~np.isnan(np.asarray(pool)).all((1, 2))
    assert changed.sum() == 3  # rows 0-2 wrote their slots, row 3 nothing


def test_errors_before_anything_runs(rng):
    args, kw = make_case(rng)

    def call(**over):
        a = {**args, **{k: v for k, v in over.items() if k in args}}
        k = {**kw, **{k: v for k, v in over.items() if k not in args}}
        return mla_decode(**a, **k)

    with pytest.raises(ValueError, match="lengths must be in"):
        call(lengths=jnp.asarray([0, 40, 1], jnp.int32))
    with pytest.raises(ValueError, match="lengths has shape"):
        call(lengths=jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="weights\\['kv_b'\\] has shape"):
        call(weights=dict(args["weights"], kv_b=jnp.zeros((32, 7))))
    with pytest.raises(ValueError, match="either 'q'"):
        call(weights={k: v for k, v in args["weights"].items() if k != "q"})
    with pytest.raises(ValueError, match="unknown \\['w_q'\\]"):
        call(weights=dict(args["weights"], w_q=1))
    with pytest.raises(ValueError, match="latent_cache must be"):
        call(latent_cache=args["latent_cache"][:, :, :-1])
    with pytest.raises(ValueError, match="inv_freq has shape"):
        call(inv_freq=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        call(qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="impl must be"):
        call(impl="triton")
    with pytest.raises(ValueError, match="config applies"):
        call(impl="xla", config=MlaDecodeConfig(splits=2))
    with pytest.raises(ValueError, match="splits must be in"):
        MlaDecodeConfig(splits=0)
    pool, table = to_pages(rng, args["latent_cache"], 8)
    bad = np.array(table)
    bad[1, 0] = -5
    with pytest.raises(ValueError, match="block_table row 1 uses page -5"):
        call(latent_cache=pool, block_table=jnp.asarray(bad))
    with pytest.raises(ValueError, match="block_table must be int32"):
        call(latent_cache=pool, block_table=table.astype(jnp.float32))


def test_vmap_folds_into_rows(rng):
    cases = [make_case(rng, lengths=(3, 30, 11)) for _ in range(2)]
    args = jax.tree.map(lambda *a: jnp.stack(a), *(c[0] for c in cases))
    kw = cases[0][1]
    weights = cases[0][0]["weights"]
    fn = functools.partial(mla_decode, impl="cuda", residual=True, **kw)
    y, cache = jax.vmap(lambda x, c, n: fn(x, weights, c, n, args["inv_freq"][0]))(
        args["x"], args["latent_cache"], args["lengths"])
    for i, (a, _) in enumerate(cases):
        ry, rcache = run(dict(a, weights=weights), kw, "reference", residual=True)
        check_close((y[i], cache[i]), (ry, rcache), "float32")


def test_vmap_paged_keeps_pools_apart(rng):
    a, kw = make_case(rng, lengths=(3, 30, 11))
    pools, tables = zip(*(to_pages(rng, a["latent_cache"], 8) for _ in range(2)))
    pools, tables = jnp.stack(pools), jnp.stack(tables)
    tables = tables.at[1, 0, 0].set(-1)  # instance 1, row 0: its first block is invalid
    fn = functools.partial(mla_decode, impl="cuda", **kw)
    y, _ = jax.jit(jax.vmap(lambda c, t: fn(a["x"], a["weights"], c, a["lengths"], a["inv_freq"], block_table=t)))(
        pools, tables)
    ry, _ = run(a, kw, "reference")
    np.testing.assert_allclose(y[0], ry, rtol=1e-5, atol=1e-5)
    assert np.all(np.isnan(np.asarray(y[1, 0]))) and np.allclose(y[1, 1:], ry[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora,bias,residual", [(None, False, True), (24, True, False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_projection_kernels_match_xla_dots(rng, q_lora, bias, residual, dtype):
    """mla_project / mla_output's handlers against the same call on XLA's dots: the same
    roundings, so only the summation order differs."""
    args, kw = make_case(rng, q_lora=q_lora, bias=bias, dtype=dtype, lengths=(0, 17, 39))
    got = run(args, kw, "cuda", residual=residual, config=MlaDecodeConfig(projections="kernels"))
    want = run(args, kw, "cuda", residual=residual, config=MlaDecodeConfig(projections="xla"))
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32), rtol=tol, atol=tol)


def test_projection_kernels_only_where_they_take_the_call(rng):
    def lowered(args, kw, **extra):
        return jax.jit(functools.partial(mla_decode, impl="cuda", **kw, **extra)).lower(**args).as_text()

    args, kw = make_case(rng, batch=1)
    text = lowered(args, kw)
    assert "jax_cluster_mla_project" in text and "jax_cluster_mla_output" in text
    assert "jax_cluster_mla_project" not in lowered(args, kw, config=MlaDecodeConfig(projections="xla"))
    two, kw = make_case(rng, batch=2)  # past the default's one row
    assert "jax_cluster_mla_project" not in lowered(two, kw)
    eight, kw = make_case(rng, batch=8)  # the kernels on request
    assert "jax_cluster_mla_project" not in lowered(eight, kw)
    assert "jax_cluster_mla_project" in lowered(eight, kw, config=MlaDecodeConfig(projections="kernels"))
    big, kw = make_case(rng, batch=9)
    assert "jax_cluster_mla_project" not in lowered(big, kw)
    with pytest.raises(ValueError, match="projections='kernels': at most 8 rows"):
        lowered(big, kw, config=MlaDecodeConfig(projections="kernels"))
    with pytest.raises(ValueError, match="projections must be one of"):
        MlaDecodeConfig(projections="fused")


def test_projection_kernels_under_vmap(rng):
    a, kw = make_case(rng, lengths=(3, 30, 11))
    xs = jnp.stack([a["x"], a["x"][::-1]])
    fn = functools.partial(mla_decode, impl="cuda", residual=True, config=MlaDecodeConfig(projections="kernels"), **kw)
    y, cache = jax.jit(jax.vmap(lambda x: fn(x, a["weights"], a["latent_cache"], a["lengths"], a["inv_freq"])))(xs)
    for i in range(2):
        check_close((y[i], cache[i]), run(dict(a, x=xs[i]), kw, "reference", residual=True), "float32")


def test_auto_on_cpu_runs_xla(rng):
    args, kw = make_case(rng, dtype=jnp.float16)
    if jax_cluster.cuda_module_built() and jax.default_backend() == "gpu":
        pytest.skip("CPU behaviour")
    y, _ = run(args, kw, "auto")
    xy, _ = run(args, kw, "xla")
    np.testing.assert_array_equal(y, xy)


# ----------------------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


V2_LITE = dict(hidden=2048, heads=16, rank=512, nope=128, rope=64, v=128)
V2 = dict(hidden=5120, heads=128, rank=512, nope=128, rope=64, v=128, q_lora=1536)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape,lengths,s_max", [
    (V2_LITE, (0, 1000, 2046), 2047),
    (V2, (5, 333), 400),
    (dict(hidden=64, heads=4, rank=32, nope=16, rope=8, v=16), (0, 31, 32, 95), 100),
    (dict(hidden=96, heads=20, rank=136, nope=24, rope=24, v=8, q_lora=40), (7, 64, 129), 130),
])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_gpu_vs_reference(rng, dtype, shape, lengths, s_max, splits):
    args, kw = make_case(rng, dtype=dtype, lengths=lengths, s_max=s_max, bias=True, **shape)
    config = None if splits is None else MlaDecodeConfig(splits=splits)
    got = run(args, kw, "cuda", _gpu(), residual=True, config=config)
    want = run(jax.device_put(args, jax.devices("cpu")[0]), kw, "reference", residual=True)
    check_close(jax.device_get(got), want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [64, 16])
def test_gpu_paged_equals_contiguous_bitwise(rng, page):
    args, kw = make_case(rng, dtype=jnp.bfloat16, lengths=(0, 700, 1023, 64), s_max=1024, **V2_LITE)
    y, cache = run(args, kw, "cuda", _gpu())
    pool, table = to_pages(rng, args["latent_cache"], page, extra_blocks=2)
    py, new_pool = run(dict(args, latent_cache=pool), kw, "cuda", _gpu(), block_table=table)
    np.testing.assert_array_equal(np.asarray(py), np.asarray(y))  # same splits, same tiles: same bits


@pytest.mark.gpu
def test_gpu_bitwise_deterministic(rng):
    args, kw = make_case(rng, dtype=jnp.float16, lengths=(4095, 17, 2000), s_max=4096, **V2_LITE)
    args = jax.device_put(args, _gpu())
    fn = jax.jit(functools.partial(mla_decode, impl="cuda", **kw))
    first = np.asarray(fn(**args)[0])
    for _ in range(9):
        np.testing.assert_array_equal(np.asarray(fn(**args)[0]), first)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_invalid_rows_nan(rng, splits):
    args, kw = make_case(rng, dtype=jnp.float16, lengths=(0, 0, 0), s_max=300, **V2_LITE)
    lengths = jnp.asarray([-2, 299, 300], jnp.int32)
    y, cache = run(dict(args, lengths=lengths), kw, "cuda", _gpu(), config=MlaDecodeConfig(splits=splits))
    y, cache = np.asarray(y), np.asarray(cache)
    assert np.all(np.isnan(y[[0, 2]])) and not np.any(np.isnan(y[1]))
    np.testing.assert_array_equal(cache[[0, 2]], np.asarray(args["latent_cache"])[[0, 2]])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_invalid_pages_nan(rng, splits):
    """A row one of whose used blocks names a page outside the pool (past it, or negative) is
    NaN and writes nothing, whether the bad block is read by the split that writes the new
    token or by another one; the other rows are as with a valid table, bit for bit."""
    args, kw = make_case(rng, dtype=jnp.float16, lengths=(0, 0, 0), s_max=300, **V2_LITE)
    pool, table = to_pages(rng, args["latent_cache"], 64)
    bad = np.array(table)
    bad[0, 0] = pool.shape[0]  # row 0 (length 290): its first block, far from its new token
    bad[2, 3] = -1  # row 2 (length 250): the block its new token goes to
    lengths = jnp.asarray([290, 200, 250], jnp.int32)
    cfg = MlaDecodeConfig(splits=splits)
    args = dict(args, latent_cache=pool, lengths=lengths)
    want, _ = run(args, kw, "cuda", _gpu(), block_table=table, config=cfg)
    y, new_pool = run(args, kw, "cuda", _gpu(), block_table=jnp.asarray(bad), config=cfg)
    y, new_pool, pool = np.asarray(y), np.asarray(new_pool), np.asarray(pool)
    assert np.all(np.isnan(y[[0, 2]]))
    np.testing.assert_array_equal(y[1], np.asarray(want)[1])
    changed = [i for i in range(pool.shape[0]) if not np.array_equal(new_pool[i], pool[i], equal_nan=True)]
    assert changed == [int(table[1, 200 // 64])]  # row 1's slot only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape,lengths", [
    (V2_LITE, (4000,)),
    (V2_LITE, (0, 5, 100, 1000, 2000, 3000, 4000, 4095)),
    (V2, (5, 333, 1000)),
    (dict(hidden=96, heads=20, rank=136, nope=24, rope=24, v=8, q_lora=40), (7, 64)),
])
def test_gpu_projection_kernels_match_xla_dots(rng, dtype, shape, lengths):
    args, kw = make_case(rng, dtype=dtype, lengths=lengths, s_max=4096, bias=True, **shape)
    args = jax.device_put(args, _gpu())
    got = run(args, kw, "cuda", residual=True, config=MlaDecodeConfig(projections="kernels"))
    want = run(args, kw, "cuda", residual=True, config=MlaDecodeConfig(projections="xla"))
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert rel_l2(got[0], want[0]) <= tol, rel_l2(got[0], want[0])
    assert rel_l2(got[1], want[1]) <= tol, rel_l2(got[1], want[1])
    kernels = MlaDecodeConfig(projections="kernels")
    text = jax.jit(functools.partial(mla_decode, impl="cuda", config=kernels, **kw)).lower(**args).as_text()
    assert "jax_cluster_mla_project" in text


@pytest.mark.gpu
def test_gpu_projection_kernels_bitwise_deterministic(rng):
    args, kw = make_case(rng, dtype=jnp.bfloat16, lengths=(4095,), s_max=4096, **V2_LITE)
    args = jax.device_put(args, _gpu())
    fn = jax.jit(functools.partial(mla_decode, impl="cuda", residual=True,
                                   config=MlaDecodeConfig(projections="kernels"), **kw))
    first = [np.asarray(a) for a in fn(**args)]
    for _ in range(19):
        for a, b in zip(fn(**args), first):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.gpu
def test_gpu_auto_runs_the_kernel(rng):
    args, kw = make_case(rng, dtype=jnp.bfloat16, lengths=(10, 200), s_max=256, **V2_LITE)
    text = jax.jit(functools.partial(mla_decode, impl="auto", **kw)).lower(**jax.device_put(args, _gpu())).as_text()
    assert "jax_cluster_mla_decode" in text


@pytest.mark.parametrize("impl", ["auto", "cuda", "xla", "reference"])
def test_no_rows_and_weights_not_a_mapping(rng, impl):
    """A batch of no rows returns an empty y and the cache as it was, launching nothing (a grid
    of no blocks is a launch error), after the checks of weights and impl; weights that are
    not a mapping are a TypeError."""
    args, kw = make_case(rng, lengths=np.zeros((0,), np.int32), dtype=jnp.bfloat16)
    y, cache = mla_decode(**args, **kw, impl=impl)
    assert y.shape == args["x"].shape and y.dtype == args["x"].dtype
    np.testing.assert_array_equal(np.asarray(cache, np.float32), np.asarray(args["latent_cache"], np.float32))
    with pytest.raises(TypeError, match="mla_decode: weights must be a mapping of names to arrays, got tuple"):
        mla_decode(**dict(args, weights=tuple(args["weights"].values())), **kw, impl=impl)
    with pytest.raises(ValueError, match="impl"):  # checked before the early return
        mla_decode(**args, **kw, impl=impl + "_")
    for name in ("eps", "latent_eps"):
        with pytest.raises(ValueError, match=f"mla_decode: {name} must be a finite number >= 0"):
            mla_decode(**args, **dict(kw, **{name: -1e-6}), impl=impl)
