"""attention_decode vs the jnp reference: CPU handler always, CUDA kernel on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import reference
from jax_cluster.testing import TOLERANCE, rel_l2


def make_inputs(rng, *, batch, hidden, hq, hkv, dh, max_seq, dtype, lengths=None,
                norm="rms", bias=False, rotary_dim=None, fill=None):
    rotary_dim = dh if rotary_dim is None else rotary_dim
    cols = (hq + 2 * hkv) * dh
    f = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)  # noqa: E731
    if lengths is None:
        lengths = rng.integers(0, max_seq, size=batch)
    lengths = jnp.asarray(lengths, jnp.int32)
    args = dict(
        x=f(batch, hidden),
        w_qkv=f(hidden, cols, scale=hidden ** -0.5),
        w_o=f(hq * dh, hidden, scale=(hq * dh) ** -0.5),
        k_cache=f(batch, hkv, max_seq, dh),
        v_cache=f(batch, hkv, max_seq, dh),
        lengths=lengths,
        inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim), jnp.float32),
    )
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, norm=norm, rotary_dim=rotary_dim)
    if norm is not None:
        kw["norm_weight"] = f(hidden, scale=0.2) + jnp.asarray(1.0, dtype)
    if norm == "layer":
        kw["norm_bias"] = f(hidden, scale=0.1)
    if bias:
        kw["qkv_bias"] = f(cols, scale=0.1)
        kw["o_bias"] = f(hidden, scale=0.1)
    return args, kw


def run(args, kw, device, **extra):
    args = jax.device_put(args, device)
    fn = jax.jit(lambda a: jc.attention_decode(**a, **kw, **extra))
    return fn(args)


def check(args, kw, device, **extra):
    y, k, v = run(args, kw, device, **extra)
    ry, rk, rv = reference.attention_decode(**args, **kw)
    tol = TOLERANCE[jnp.dtype(args["x"].dtype).name]
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    # Only index lengths[b] of each row changed, and it holds the new k / v.
    np.testing.assert_array_equal(_except_new(k, args), _except_new(args["k_cache"], args))
    np.testing.assert_array_equal(_except_new(v, args), _except_new(args["v_cache"], args))
    assert rel_l2(k, rk) <= tol and rel_l2(v, rv) <= tol
    return y


def _except_new(cache, args):
    cache = np.asarray(cache.astype(jnp.float32)).copy()
    for b, n in enumerate(np.asarray(args["lengths"])):
        cache[b, :, n] = 0
    return cache


CPU_CASES = [  # batch, hidden, hq, hkv, dh, max_seq, norm, bias, rotary
    (1, 64, 2, 2, 16, 9, "rms", False, None),
    (3, 128, 8, 2, 16, 17, "layer", True, 8),
    (2, 64, 4, 1, 32, 5, None, False, 16),
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_cpu_handler_and_xla_impl(rng, case, dtype, layout, impl):
    """The CPU handler (impl="auto" on CPU) and impl="xla" (the tuner's other candidate, and
    the fallback) compute the same step as the reference."""
    batch, hidden, hq, hkv, dh, max_seq, norm, bias, rot = case
    args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh,
                           max_seq=max_seq, dtype=dtype, norm=norm, bias=bias, rotary_dim=rot)
    kw.update(rope_layout=layout, residual=True)
    check(args, kw, jax.devices("cpu")[0], impl=impl)


@pytest.mark.parametrize("impl", ["xla", "splitk"])
def test_unfused_impl_invalid_length_writes_nothing(rng, impl):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32",
                           lengths=[2, 0])
    lengths = jnp.asarray([2, 5], jnp.int32)  # row 1 out of range: traced, so not caught early
    y, k, v = jax.jit(lambda a, ln: jc.attention_decode(**{**a, "lengths": ln}, **kw, impl=impl))(args, lengths)
    assert np.isnan(np.asarray(y[1])).all() and np.isfinite(np.asarray(y[0])).all()
    np.testing.assert_array_equal(np.asarray(k[1]), np.asarray(args["k_cache"][1]))
    np.testing.assert_array_equal(np.asarray(v[1]), np.asarray(args["v_cache"][1]))


PALLAS_CASES = [  # batch, hidden, hq, hkv, dh, max_seq, lengths, bias, rotary
    (3, 128, 8, 2, 32, 256, [0, 255, 131], True, 16),
    (1, 64, 2, 2, 16, 4096, [3000], False, None),
    (2, 64, 4, 1, 64, 512, [17, 400], False, 32),
]


@pytest.mark.parametrize("case", PALLAS_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_path_in_interpreter(rng, case, dtype):
    """The impl="pallas" step (Pallas' decode attention between XLA's ops), run by Pallas'
    interpreter on CPU: the same step as the reference; the caches change only at lengths[b]."""
    from jax_cluster.ops.attention_decode_xla import attention_decode_pallas
    batch, hidden, hq, hkv, dh, max_seq, lengths, bias, rot = case
    args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=max_seq,
                           dtype=dtype, lengths=lengths, bias=bias, rotary_dim=rot)
    kw.update(residual=True, rope_layout="half", norm_bias=None, eps=1e-6, scale=dh ** -0.5,
              qkv_bias=kw.get("qkv_bias"), o_bias=kw.get("o_bias"))
    y, k, v = jax.jit(lambda a: attention_decode_pallas(**a, **kw, interpret=True))(args)
    ry, rk, rv = reference.attention_decode(**args, **kw)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    np.testing.assert_array_equal(_except_new(k, args), _except_new(args["k_cache"], args))
    np.testing.assert_array_equal(_except_new(v, args), _except_new(args["v_cache"], args))
    assert rel_l2(k, rk) <= tol and rel_l2(v, rv) <= tol


def test_pallas_supported_shapes_and_errors(rng):
    from jax_cluster.ops.attention_decode_xla import pallas_supported
    assert pallas_supported(128, 4096) and pallas_supported(64, 256) and pallas_supported(128, 1024)
    assert not pallas_supported(80, 4096)     # Triton blocks: a power-of-two head_dim
    assert not pallas_supported(128, 5000)    # not 16 equal splits
    assert not pallas_supported(128, 128)     # splits of 8 tokens (< 16)
    assert not pallas_supported(128, 16 * 200)  # splits of 200: not whole 128-token blocks
    assert not pallas_supported(128, 1152)    # splits of 72: one block, not a power of two
    assert pallas_supported(128, 16 * 384) and pallas_supported(64, 16 * 32)
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="impl='pallas' runs Pallas' GPU kernel"):
            jc.attention_decode(**args, **kw, impl="pallas")
    from jax_cluster.ops.attention_decode_xla import attention_decode_pallas
    kw.update(norm_bias=None, eps=1e-6, scale=0.25, qkv_bias=None, o_bias=None, residual=False,
              rope_layout="half")
    with pytest.raises(ValueError, match="needs a power-of-two head_dim and S_max"):
        attention_decode_pallas(**args, **kw)


def test_first_and_last_token_cpu(rng):
    args, kw = make_inputs(rng, batch=3, hidden=64, hq=4, hkv=2, dh=16, max_seq=7,
                           dtype="float32", lengths=[0, 6, 3])
    check(args, kw, jax.devices("cpu")[0])


def test_vmap_folds_batch(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=6, dtype="float32")
    stacked = {k: (jnp.stack([v, v]) if k in ("x", "k_cache", "v_cache", "lengths") else v)
               for k, v in args.items()}
    f = lambda x, kc, vc, ln: jc.attention_decode(  # noqa: E731
        x, args["w_qkv"], args["w_o"], kc, vc, ln, args["inv_freq"], **kw)
    y, k, v = jax.vmap(f)(stacked["x"], stacked["k_cache"], stacked["v_cache"], stacked["lengths"])
    ry, _, _ = reference.attention_decode(**args, **kw)
    assert y.shape == (2, 2, 64) and k.shape == (2,) + args["k_cache"].shape
    assert rel_l2(y[1], ry) < 1e-5


def test_vmap_over_weights_maps_sequentially(rng):
    """vmap over the weights too (two layers' steps at once): not foldable into the batch,
    so the batching rule maps the op over them; each slice is the reference step."""
    layers = [make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=6, dtype="float32",
                          lengths=[5, 1]) for _ in range(2)]
    (args0, kw), (args1, _) = layers
    stacked = {k: jnp.stack([args0[k], args1[k]]) for k in ("x", "w_qkv", "w_o", "k_cache", "v_cache")}
    f = lambda x, wq, wo, kc, vc: jc.attention_decode(  # noqa: E731
        x, wq, wo, kc, vc, args0["lengths"], args0["inv_freq"], **kw)
    y, k, v = jax.jit(jax.vmap(f))(*stacked.values())
    for i, args in enumerate((args0, args1)):
        ry, rk, rv = reference.attention_decode(**{**args, "lengths": args0["lengths"],
                                                  "inv_freq": args0["inv_freq"]}, **kw)
        assert rel_l2(y[i], ry) < 1e-5 and rel_l2(k[i], rk) < 1e-6 and rel_l2(v[i], rv) < 1e-6


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_q_heads=6, num_kv_heads=4), "must be a multiple of num_kv_heads"),
        (dict(rotary_dim=15), "rotary_dim"),
        (dict(norm="batch"), "norm must be one of"),
        (dict(rope_layout="spiral"), "rope_layout"),
        (dict(cluster_size=9), "cluster_size must be one of"),
        (dict(cluster_size=3, dataflow="split_head"), "not a power of two"),
        (dict(cluster_size=6, rows_per_cluster=2), "not a power of two"),
        (dict(heads_per_cluster=9), "heads_per_cluster must be in 1..8"),
        (dict(num_kv_heads=1, num_q_heads=4), "k_cache has shape"),
    ],
)
def test_bad_arguments(rng, change, message):
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    kw.update(change)
    with pytest.raises(ValueError, match=message):
        jc.attention_decode(**args, **kw)


def test_bad_shapes_and_lengths(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    with pytest.raises(ValueError, match="w_o has shape"):
        jc.attention_decode(**{**args, "w_o": args["w_o"][:-1]}, **kw)
    with pytest.raises(ValueError, match="lengths must be in"):
        jc.attention_decode(**{**args, "lengths": jnp.asarray([1, 5], jnp.int32)}, **kw)
    with pytest.raises(ValueError, match="dtype"):
        jc.attention_decode(**{**args, "k_cache": args["k_cache"].astype(jnp.float16)}, **kw)
    with pytest.raises(ValueError, match="needs norm_weight"):
        jc.attention_decode(**args, **{**kw, "norm_weight": None})


def test_tuner_candidates_and_choices():
    from jax_cluster.ops import attention_decode as ad
    # MHA: nothing to spread; each pipeline
    # (one cluster: 7 is the one-wave size that is not a power of two)
    assert ad._tuner_candidates(1) == (1, 2, 4, 8, 16, "xla", "pallas", "splitk", 7, "tma:2", "tma:4",
                                       "tma:8", "tma:7")
    gqa = ad._tuner_candidates(4)
    assert {"n8:h2", "n4:h1", "tma:n8:h2", "tma:4"} <= set(gqa) and "n8:h4" not in gqa
    # 32 clusters (Llama-2-7B b1; Llama-3-8B b1 at one query head per cluster) fit an H100
    # in one wave at cluster size 3, not 4; 16 clusters at 7
    assert {3, "tma:3"} <= set(ad._tuner_candidates(1, 1, 32))
    assert {"n3:h1", "n7:h2", "tma:n3:h1", "tma:n7:h2"} <= set(ad._tuner_candidates(4, 1, 8))
    assert not [c for c in ad._tuner_candidates(1, 16, 32) if not isinstance(ad.parse_choice(c), str)
                and ad.parse_choice(c)[0] & (ad.parse_choice(c)[0] - 1)]  # 512 clusters: none
    assert ad.parse_choice("n3:h1") == (3, 1, "registers", 1) and ad.parse_choice("tma:3") == (3, None, "tma", 1)
    assert ad.parse_choice("n8:h2") == (8, 2, "registers", 1) and ad.parse_choice(4) == (4, None, "registers", 1)
    assert ad.parse_choice("tma:n4:h1") == (4, 1, "tma", 1) and ad.parse_choice("tma:8") == (8, None, "tma", 1)
    assert ad.parse_choice("n4:r8") == (4, None, "registers", 8)
    assert ad.parse_choice("n8:h2:r4") == (8, 2, "registers", 4)
    assert ad.parse_choice("xla") == "xla" and ad.parse_choice("pallas") == "pallas"
    assert ad.parse_choice("splitk") == "splitk" and "splitk" not in ad._tuner_candidates(16)
    assert ad._heads_per_cluster(12, 4) == 4 and ad._heads_per_cluster(6, 4) == 3


def test_tuner_keys_cache_alignment_and_pallas(monkeypatch):
    """The tuning key buckets the context to a power of two; a cache length XLA would pad (not
    a multiple of 32) and one Pallas does not take are keys of their own, and "pallas" is a
    candidate only where Pallas takes the shape."""
    from jax_cluster import tuning
    from jax_cluster.ops import attention_decode as ad
    seen = {}

    def fake_pick(op, key, candidates, measure, heuristic):
        seen[key.split(" ", 2)[2]] = candidates
        return candidates[0]

    monkeypatch.setattr(tuning, "pick", fake_pick)
    for max_seq in (4096, 4112, 4160):
        ad._choose_cluster_size(True, 2, 512, 8, 2, max_seq, 128, jnp.float16)
    # (a JAX without Pallas' decode module takes nothing: every key is "nopallas")
    aligned = "ctx4096 float16" + ("" if ad.pallas_supported(128, 4096) else " nopallas")
    assert set(seen) == {f"b2 d512 hq8 hkv2 dh128 {aligned}",
                         "b2 d512 hq8 hkv2 dh128 ctx8192 float16 nopallas unaligned",
                         "b2 d512 hq8 hkv2 dh128 ctx8192 float16 nopallas"}
    assert [("pallas" in c) for k, c in sorted(seen.items())] == [ad.pallas_supported(128, 4096), False, False]


def test_tuner_batch_tiled_candidates():
    """batch > 1 adds the batch-tiled kernel: per tile size, the cluster sizes whose grid
    holds 0.5-2 blocks per SM (shared memory permitting); batch 1 adds nothing."""
    from jax_cluster.ops import attention_decode as ad
    assert ad._tuner_candidates(4, 1, 8, 4096, 128) == ad._tuner_candidates(4, 1, 8)
    llama3 = ad._tuner_candidates(4, 16, 8, 4096, 128)  # 8 KV heads: 16 / R tiles each
    tiled = [c for c in llama3 if ":r" in str(c)]
    assert {"n4:r4", "n8:r8", "n16:r16", "n2:r2"} <= set(tiled) and "n1:r2" not in tiled
    for c in tiled:
        n, _, pipeline, rows = ad.parse_choice(c)
        blocks = 16 // rows * 8 * n
        assert pipeline == "registers" and 66 <= blocks <= 264, c
    llama2 = ad._tuner_candidates(1, 16, 32, 4096, 128)
    assert {"n1:r4", "n4:r16", "n2:r8"} <= set(llama2)
    # a batch of 3 needs tiles up to 4 rows, not 8 or 16
    small = [c for c in ad._tuner_candidates(2, 3, 2, 512, 64) if ":r" in str(c)]
    assert small and all(ad.parse_choice(c)[3] in (2, 4) for c in small)
    # shared memory: 16 rows of a hidden 8192 do not fit a block; 4 do
    assert not [c for c in ad._tuner_candidates(1, 16, 64, 8192, 128) if str(c).endswith(":r16")]
    assert [c for c in ad._tuner_candidates(1, 16, 64, 8192, 128) if str(c).endswith(":r4")]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rows_per_cluster=3), "rows_per_cluster must be one of"),
        (dict(rows_per_cluster=0), "rows_per_cluster must be one of"),
        (dict(rows_per_cluster=32), "rows_per_cluster must be one of"),
        (dict(rows_per_cluster=2, dataflow="split_head", cluster_size=2), "needs dataflow='split_token'"),
        (dict(rows_per_cluster=4, pipeline="tma"), "needs pipeline='registers'"),
    ],
)
def test_bad_rows_per_cluster(rng, change, message):
    args, kw = make_inputs(rng, batch=3, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32")
    with pytest.raises(ValueError, match=message):
        jc.attention_decode(**args, **kw, **change)


def test_rows_per_cluster_shared_memory_limit(rng, monkeypatch):
    """A tile whose rows do not fit a block's shared memory is rejected before tracing (the
    Python mirror of TiledLayout), and by the FFI layer itself (the C++ layout) when the
    Python check is bypassed: both agree on the boundary."""
    from jax_cluster.ops import attention_decode as ad
    args, kw = make_inputs(rng, batch=2, hidden=8192, hq=2, hkv=2, dh=16, max_seq=5, dtype="float32")
    with pytest.raises(ValueError, match="rows_per_cluster=8 needs .* bytes of shared memory"):
        jc.attention_decode(**args, **kw, rows_per_cluster=8, cluster_size=2)
    check(args, kw, jax.devices("cpu")[0], rows_per_cluster=4, cluster_size=2)  # fits
    monkeypatch.setattr(ad, "_check_tiled_fits", lambda *a: None)
    for rows in (4, 8, 16):  # 8192 x R x 4 bytes (2 at R = 16) against 230,400
        fits = ad._tiled_shared_bytes(8192, rows, 1, 16, 2) <= ad.SHARED_BYTES_PER_BLOCK
        assert fits == (rows == 4)
        if fits:
            run(args, kw, jax.devices("cpu")[0], rows_per_cluster=rows, cluster_size=2)
        else:
            with pytest.raises(Exception, match="bytes of shared memory per block"):
                run(args, kw, jax.devices("cpu")[0], rows_per_cluster=rows, cluster_size=2)


@pytest.mark.parametrize("rows", [2, 4, 16])
def test_cpu_rows_per_cluster_same_step(rng, rows):
    """rows_per_cluster changes only the GPU launch; the CPU handler computes the same step
    (a batch that is not a multiple of the tile)."""
    args, kw = make_inputs(rng, batch=5, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0], rows_per_cluster=rows, cluster_size=2)


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_cpu_any_heads_per_cluster(rng, heads):
    """The knob changes only the GPU launch; the CPU handler computes the same step."""
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=6, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0], heads_per_cluster=heads, cluster_size=2)


def test_split_head_dataflow_arguments(rng):
    """The dataflow changes only the GPU kernel; its constraint is checked before any launch."""
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0], dataflow="split_head", cluster_size=2)
    check(args, kw, jax.devices("cpu")[0], dataflow="split_head")  # picks cluster 2 (16 = 8 * 2)
    with pytest.raises(ValueError, match="divisible by 8 \\* cluster_size"):
        jc.attention_decode(**args, **kw, dataflow="split_head", cluster_size=4)
    with pytest.raises(ValueError, match="dataflow must be one of"):
        jc.attention_decode(**args, **kw, dataflow="split_tokens")


def test_pipeline_arguments(rng):
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=2, hkv=2, dh=16, max_seq=9, dtype="float32")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        jc.attention_decode(**args, **kw, pipeline="cp.async")
    with pytest.raises(ValueError, match="SplitToken pipeline"):
        jc.attention_decode(**args, **kw, pipeline="tma", dataflow="split_head")
    # the CPU handler ignores the pipeline (a GPU launch choice): the same step
    check(args, kw, jax.devices("cpu")[0], pipeline="tma")


def test_invalid_length_inside_jit_gives_nan_row(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=2, hkv=2, dh=16, max_seq=5,
                           dtype="float32", lengths=[2, 9])
    y, k, _ = jax.jit(lambda a: jc.attention_decode(**a, **kw))(args)
    assert np.isnan(np.asarray(y[1])).all() and np.isfinite(np.asarray(y[0])).all()
    np.testing.assert_array_equal(k[1], args["k_cache"][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splitk_step_cpu(rng, dtype):
    """attention_decode(impl="splitk"): the step with decode_attention between XLA's ops
    (on CPU its handler) is the same step as the reference, caches included."""
    args, kw = make_inputs(rng, batch=3, hidden=128, hq=8, hkv=2, dh=16, max_seq=17,
                                dtype=dtype, norm="layer", bias=True, rotary_dim=8)
    check(args, kw, jax.devices("cpu")[0], impl="splitk")


def _splitk_with_linear(monkeypatch):
    """impl="splitk" with its projections on jax_cluster.ops.linear (projections="linear")."""
    import functools

    from jax_cluster.ops import attention_decode as ad_mod
    from jax_cluster.ops.attention_decode_xla import attention_decode_splitk
    monkeypatch.setattr(ad_mod, "attention_decode_splitk",
                        functools.partial(attention_decode_splitk, projections="linear"))


@pytest.mark.parametrize("residual", [True, False])
def test_splitk_linear_projections_cpu(rng, monkeypatch, residual):
    """projections="linear" (the linear op's CPU handler; the residual fused into the
    output projection, or an o_bias added after it): the same step as the reference."""
    _splitk_with_linear(monkeypatch)
    args, kw = make_inputs(rng, batch=3, hidden=128, hq=8, hkv=2, dh=16, max_seq=17,
                           dtype="bfloat16", norm="rms", bias=not residual, rotary_dim=16)
    kw.update(residual=residual)
    check(args, kw, jax.devices("cpu")[0], impl="splitk")


def test_splitk_projections_must_be_known(rng):
    from jax_cluster.ops.attention_decode_xla import attention_decode_splitk
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=2, hkv=2, dh=16, max_seq=5, dtype="bfloat16")
    with pytest.raises(ValueError, match="projections"):
        attention_decode_splitk(**{k: args[k] for k in ("x", "w_qkv", "w_o", "k_cache", "v_cache",
                                                         "lengths", "inv_freq")},
                                num_q_heads=2, num_kv_heads=2, norm=None, norm_weight=None,
                                norm_bias=None, eps=1e-6, qkv_bias=None, o_bias=None, residual=False,
                                rotary_dim=16, rope_layout="half", scale=0.25, projections="cublas")


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


GPU_SHAPES = [  # hidden, hq, hkv, dh
    (512, 4, 4, 128),    # MHA
    (512, 8, 2, 64),     # GQA 4
    (640, 8, 1, 80),     # MQA 8, head_dim 80
    (768, 16, 2, 96),    # GQA 8, head_dim 96
    (512, 12, 1, 64),    # group 12 -> 2 clusters of 6 heads
]


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 16])  # 3, 6: collectives without a butterfly
def test_gpu_vs_reference(rng, dtype, shape, n, pipeline):
    hidden, hq, hkv, dh = shape
    for batch, max_seq, lengths in ((1, 40, [0]), (3, 300, [1, 299, 157]), (16, 77, None)):
        args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh,
                               max_seq=max_seq, dtype=dtype, lengths=lengths,
                               bias=batch == 3, norm="layer" if batch == 3 else "rms",
                               rotary_dim=dh // 2 if batch == 16 else None)
        kw["residual"] = batch != 1
        check(args, kw, _gpu(), cluster_size=n, impl="kernel", pipeline=pipeline)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 8])
def test_gpu_fewer_heads_per_cluster(rng, dtype, heads, n, pipeline):
    """A GQA group spread over several clusters (each re-computes its KV head's K/V; the
    first writes the cache): group 6 in chunks of 1, 2 or 3 heads."""
    for batch, max_seq, lengths in ((1, 40, [0]), (3, 300, [1, 299, 157])):
        args, kw = make_inputs(rng, batch=batch, hidden=512, hq=12, hkv=2, dh=128,
                               max_seq=max_seq, dtype=dtype, lengths=lengths, bias=batch == 3)
        kw["residual"] = True
        check(args, kw, _gpu(), cluster_size=n, heads_per_cluster=heads, impl="kernel",
              pipeline=pipeline)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_gpu_split_head_dataflow(rng, dtype, shape, n):
    """SplitHead on every cluster size its head dim allows; contexts over several score
    chunks (1024 / heads-rounded-up-to-a-power-of-2 tokens each), the new token in any chunk."""
    hidden, hq, hkv, dh = shape
    if dh % (8 * n):
        pytest.skip(f"split_head needs head_dim % (8 * {n}) == 0")
    for batch, max_seq, lengths in ((1, 40, [0]), (3, 2100, [1, 2099, 1024]), (2, 600, [255, 511])):
        args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh,
                               max_seq=max_seq, dtype=dtype, lengths=lengths, bias=batch == 3,
                               rotary_dim=dh // 2 if batch == 2 else None)
        kw["residual"] = batch != 1
        check(args, kw, _gpu(), cluster_size=n, impl="kernel", dataflow="split_head")


@pytest.mark.gpu
def test_gpu_split_head_deterministic_and_agrees(rng):
    args, kw = make_inputs(rng, batch=2, hidden=1024, hq=16, hkv=4, dh=128, max_seq=3000,
                           dtype="float16", lengths=[2999, 1500])
    args = jax.device_put(args, _gpu())
    f = jax.jit(lambda a: jc.attention_decode(**a, **kw, cluster_size=4, dataflow="split_head")[0])
    first = np.asarray(f(args))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(args)), first)
    token = np.asarray(jax.jit(lambda a: jc.attention_decode(**a, **kw, cluster_size=4)[0])(args))
    assert rel_l2(first, token) <= TOLERANCE["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_xla_impl_and_auto(rng, dtype, tmp_path, monkeypatch):
    """impl="xla" on the GPU, and impl="auto" with a fresh tuning cache (its candidates are
    the cluster sizes and "xla"; whichever wins must compute the same step)."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    args, kw = make_inputs(rng, batch=3, hidden=512, hq=8, hkv=2, dh=128, max_seq=300,
                           dtype=dtype, lengths=[0, 299, 157], bias=True, rotary_dim=64)
    kw["residual"] = True
    check(args, kw, _gpu(), impl="xla")
    check(args, kw, _gpu(), impl="auto")
    assert (tmp_path / "tuning.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 512, 8, 2, 128, 512, [0, 511, 157]),
                                   (2, 1024, 16, 16, 64, 4096, [4095, 1000]),
                                   (1, 4096, 32, 8, 128, 16384, [16000])])
def test_gpu_pallas_impl(rng, dtype, shape):
    """impl="pallas" (a tuner candidate): Pallas' decode kernel between XLA's ops computes
    the same step, GQA and MHA, first and last slot."""
    batch, hidden, hq, hkv, dh, max_seq, lengths = shape
    args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=max_seq,
                           dtype=dtype, lengths=lengths, bias=batch == 3)
    kw["residual"] = True
    check(args, kw, _gpu(), impl="pallas")


@pytest.mark.gpu
def test_gpu_auto_pallas_pick_and_nopallas_key(rng, tmp_path, monkeypatch):
    """A cached "pallas" pick runs Pallas' path. An S_max Pallas does not take (4160: 16
    splits of 260 tokens) has a tuning key of its own whose candidates leave "pallas" out
    (a "pallas" entry there is stale: ignored with a warning, re-measured). Every path
    computes the step."""
    from jax_cluster import tuning
    from jax_cluster.ops import attention_decode as ad
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    key = f"v{ad.KERNEL_VERSION} {tuning.device_name()} b2 d512 hq8 hkv2 dh128 ctx{{}} float16"
    tuning.record("attention_decode", key.format(512), "pallas")
    tuning.record("attention_decode", key.format(8192) + " nopallas", "pallas")
    for max_seq in (512, 4160):
        args, kw = make_inputs(rng, batch=2, hidden=512, hq=8, hkv=2, dh=128, max_seq=max_seq,
                               dtype="float16", lengths=[max_seq - 1, 7])
        if max_seq == 512:
            assert ad.autotune(2, 512, 8, 2, max_seq, 128, jnp.float16) == "pallas"
        else:
            with pytest.warns(UserWarning, match="stale cache entry"):
                assert ad.autotune(2, 512, 8, 2, max_seq, 128, jnp.float16) != "pallas"
        check(args, kw, _gpu(), impl="auto")


@pytest.mark.gpu
def test_gpu_unsupported_head_dim_falls_back_to_xla(rng):
    args, kw = make_inputs(rng, batch=2, hidden=256, hq=4, hkv=2, dh=32, max_seq=20, dtype="float16")
    with pytest.warns(UserWarning, match="using XLA's ops"):
        check(args, kw, _gpu())
    with pytest.raises(ValueError, match="no CUDA kernel for head_dim=32"):
        run(args, kw, _gpu(), impl="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
def test_gpu_long_context_and_interleaved(rng, pipeline):
    args, kw = make_inputs(rng, batch=2, hidden=4096, hq=32, hkv=8, dh=128, max_seq=5000,
                           dtype="bfloat16", lengths=[4999, 3001])
    kw["rope_layout"] = "interleaved"
    check(args, kw, _gpu(), impl="kernel", pipeline=pipeline)


DETERMINISM_CONFIGS = [dict(cluster_size=n) for n in (1, 2, 3, 4, 8, 16)] + [
    dict(cluster_size=4, pipeline="tma"), dict(cluster_size=8, heads_per_cluster=2),
    dict(cluster_size=4, dataflow="split_head"), dict(cluster_size=16, dataflow="split_head"),
    dict(cluster_size=4, rows_per_cluster=4), dict(impl="splitk"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", DETERMINISM_CONFIGS,
                         ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_gpu_deterministic(rng, config):
    """Output and caches bitwise equal over 20 runs, for every dataflow, pipeline and
    combine path (cluster reductions, fixed-order combine kernels, no atomics)."""
    args, kw = make_inputs(rng, batch=4, hidden=1024, hq=16, hkv=4, dh=128, max_seq=2048,
                           dtype="float16")
    args = jax.device_put(args, _gpu())
    f = jax.jit(lambda a: jc.attention_decode(**a, **kw, **config))
    first = [np.asarray(t) for t in f(args)]
    for _ in range(20):
        for got, want in zip(f(args), first):
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.gpu
def test_gpu_donated_caches_update_in_place(rng):
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=4, hkv=4, dh=128, max_seq=64,
                           dtype="float16", lengths=[5, 6])
    args = jax.device_put(args, _gpu())
    step = jax.jit(lambda x, kc, vc, ln: jc.attention_decode(
        x, args["w_qkv"], args["w_o"], kc, vc, ln, args["inv_freq"], **kw), donate_argnums=(1, 2))
    kc, vc = args["k_cache"] + 0, args["v_cache"] + 0
    ln = args["lengths"]
    for _ in range(3):  # a few steps, feeding caches back
        _, kc, vc = step(args["x"], kc, vc, ln)
        ln = ln + 1
    assert np.isfinite(np.asarray(kc.astype(jnp.float32))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [
    dict(cluster_size=3), dict(cluster_size=4), dict(cluster_size=8, heads_per_cluster=1),
    dict(cluster_size=4, pipeline="tma"), dict(cluster_size=4, dataflow="split_head"),
    dict(cluster_size=2, rows_per_cluster=2),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_gpu_back_to_back_steps_equal_synchronised_steps(rng, variant):
    """Decode steps in one jit, each step's output the next one's input: the kernels run
    back to back, and with programmatic launches (PDL) a step's main kernel starts while the
    previous step's combine kernel may still read the partials workspace. Outputs and
    caches must be bitwise those of the same steps run one call at a time, synchronised."""
    args, kw = make_inputs(rng, batch=3, hidden=1024, hq=16, hkv=4, dh=128, max_seq=600,
                           dtype="float16", lengths=[100, 350, 7])
    kw["residual"] = True
    args = jax.device_put(args, _gpu())

    def step(x, kc, vc, ln, w_qkv, w_o, inv_freq, norm_weight):
        y, kc, vc = jc.attention_decode(x, w_qkv, w_o, kc, vc, ln, inv_freq, impl="kernel",
                                        **{**kw, "norm_weight": norm_weight}, **variant)
        return y, kc, vc, ln + 1

    consts = (args["w_qkv"], args["w_o"], args["inv_freq"], kw["norm_weight"])
    steps = 8

    @jax.jit
    def back_to_back(x, kc, vc, ln, *consts):
        ys = []
        for _ in range(steps):
            x, kc, vc, ln = step(x, kc, vc, ln, *consts)
            ys.append(x)
        return jnp.stack(ys), kc, vc

    one = jax.jit(step)
    state = (args["x"], args["k_cache"], args["v_cache"], args["lengths"])
    ys = []
    for _ in range(steps):
        state = jax.block_until_ready(one(*state, *consts))
        ys.append(state[0])
    want = (np.asarray(jnp.stack(ys)), np.asarray(state[1]), np.asarray(state[2]))
    for _ in range(3):
        got = back_to_back(args["x"], args["k_cache"], args["v_cache"], args["lengths"], *consts)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", [(1, None), (2, None), (4, None), (8, None), (16, None), (4, 1), (8, 2),
                                    (3, 1), (5, None), (7, 2)])
def test_gpu_model_sized_gqa_every_cluster(rng, dtype, config, pipeline):
    """Llama-3-8B's attention shape (hidden 4096, 32/8 heads): the streamed kernel's ring
    wraps hundreds of times per block, phases hand over mid-ring; lengths that are not
    multiples of any stage (a KV stage holds 32 tokens at head dim 128), row 2 the first token."""
    n, heads = config
    args, kw = make_inputs(rng, batch=3, hidden=4096, hq=32, hkv=8, dh=128, max_seq=1100,
                           dtype=dtype, lengths=[1099, 517, 0])
    check(args, kw, _gpu(), cluster_size=n, heads_per_cluster=heads, impl="kernel",
          pipeline=pipeline)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dh", [64, 80, 96, 128])
def test_gpu_kernel_length_out_of_range_gives_nan_row(rng, dh, pipeline):
    """A traced length >= S_max reaches the kernel: that row's output is NaN, its caches
    untouched, the other row exact."""
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=4, hkv=2, dh=dh, max_seq=64,
                           dtype="float16", lengths=[5, 64])
    y, k, v = run(args, kw, _gpu(), cluster_size=2, impl="kernel", pipeline=pipeline)
    ry, _, _ = reference.attention_decode(**{**args, "lengths": jnp.asarray([5, 0], jnp.int32)}, **kw)
    assert np.isnan(np.asarray(y[1].astype(jnp.float32))).all()
    assert rel_l2(y[0], ry[0]) <= TOLERANCE["float16"]
    np.testing.assert_array_equal(np.asarray(k[1]), np.asarray(args["k_cache"][1]))
    np.testing.assert_array_equal(np.asarray(v[1]), np.asarray(args["v_cache"][1]))


# ---------------------------------------------------------------- GPU: batch-tiled kernel
TILED_SHAPES = [  # hidden, hq, hkv, dh: MHA, GQA 4, GQA 8 (head dim 96), MQA 8 (head dim 80)
    (512, 4, 4, 128),
    (512, 8, 2, 64),
    (768, 16, 2, 96),
    (640, 8, 1, 80),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", TILED_SHAPES)
@pytest.mark.parametrize("rows", [2, 4, 8, 16])
def test_gpu_batch_tiled_vs_reference(rng, dtype, shape, rows):
    """The batch-tiled kernel (rows_per_cluster > 1): batches of 3, 16 and 5 (a last partial
    tile for every R but 2 at 16), lengths 0, odd, different per row; cluster sizes 1, 4, 16
    (a block's share of the tile's tokens then spans several rows, or a row several blocks);
    caches: only index lengths[b] changes."""
    from jax_cluster.ops import attention_decode as ad
    hidden, hq, hkv, dh = shape
    cases = ((1, 3, 300, [0, 7, 299]), (4, 16, 77, None), (16, 5, 300, [1, 0, 130, 299, 64]))
    for n, batch, max_seq, lengths in cases:
        args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh,
                               max_seq=max_seq, dtype=dtype, lengths=lengths,
                               bias=batch == 3, norm="layer" if batch == 3 else "rms",
                               rotary_dim=dh // 2 if batch == 16 else None)
        kw["residual"] = batch != 3
        hpc = ad._heads_per_cluster(hq // hkv)
        if ad._tiled_shared_bytes(hidden, rows, hpc, dh, n) > ad.SHARED_BYTES_PER_BLOCK:
            # (16 rows, 8 heads of 96 at cluster size 1: one block would hold the whole q|k|v)
            with pytest.raises(ValueError, match="bytes of shared memory"):
                run(args, kw, _gpu(), cluster_size=n, rows_per_cluster=rows, impl="kernel")
            continue
        check(args, kw, _gpu(), cluster_size=n, rows_per_cluster=rows, impl="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", [(4, 4, None), (8, 8, None), (16, 16, None), (2, 8, 2), (8, 2, 1)])
def test_gpu_batch_tiled_model_sized(rng, dtype, config):
    """Llama-3-8B's attention shape (hidden 4096, 32/8 heads) at batch 16 and 11 with long,
    different lengths; heads_per_cluster < group: several head chunks per KV head (only
    chunk 0 writes the cache)."""
    n, rows, heads = config
    for batch in (16, 11):
        lengths = rng.integers(0, 1100, size=batch)
        lengths[0], lengths[-1] = 1099, 0
        args, kw = make_inputs(rng, batch=batch, hidden=4096, hq=32, hkv=8, dh=128, max_seq=1100,
                               dtype=dtype, lengths=lengths)
        kw["residual"] = True
        check(args, kw, _gpu(), cluster_size=n, rows_per_cluster=rows, heads_per_cluster=heads,
              impl="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 16])
def test_gpu_batch_tiled_mha_model_sized(rng, rows):
    """Llama-2-7B's attention shape (MHA, 32 heads) at batch 16."""
    args, kw = make_inputs(rng, batch=16, hidden=4096, hq=32, hkv=32, dh=128, max_seq=700,
                           dtype="float16")
    kw["residual"] = True
    check(args, kw, _gpu(), cluster_size=4, rows_per_cluster=rows, impl="kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 8, 16])
def test_gpu_batch_tiled_deterministic_and_agrees(rng, rows):
    """Bitwise the same over repeated runs (fixed-order combines, no atomics), and close to
    the one-row-per-cluster kernel."""
    args, kw = make_inputs(rng, batch=13, hidden=1024, hq=16, hkv=4, dh=128, max_seq=2048,
                           dtype="float16")
    args = jax.device_put(args, _gpu())
    f = jax.jit(lambda a: jc.attention_decode(**a, **kw, cluster_size=4, rows_per_cluster=rows)[0])
    first = np.asarray(f(args))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(args)), first)
    one = np.asarray(jax.jit(lambda a: jc.attention_decode(**a, **kw, cluster_size=4,
                                                           rows_per_cluster=1)[0])(args))
    assert rel_l2(first, one) <= TOLERANCE["float16"]


@pytest.mark.gpu
def test_gpu_batch_tiled_length_out_of_range_gives_nan_row(rng):
    """A traced length >= S_max in a tile: that row's output is NaN and its caches untouched;
    the tile's other rows are exact."""
    args, kw = make_inputs(rng, batch=3, hidden=512, hq=8, hkv=2, dh=128, max_seq=64,
                           dtype="float16", lengths=[5, 64, 63])
    y, k, v = run(args, kw, _gpu(), cluster_size=2, rows_per_cluster=4, impl="kernel")
    ry, _, _ = reference.attention_decode(**{**args, "lengths": jnp.asarray([5, 0, 63], jnp.int32)}, **kw)
    assert np.isnan(np.asarray(y[1].astype(jnp.float32))).all()
    for b in (0, 2):
        assert rel_l2(y[b], ry[b]) <= TOLERANCE["float16"]
    np.testing.assert_array_equal(np.asarray(k[1]), np.asarray(args["k_cache"][1]))
    np.testing.assert_array_equal(np.asarray(v[1]), np.asarray(args["v_cache"][1]))


@pytest.mark.gpu
def test_gpu_auto_with_batch_tiled_candidates(rng, tmp_path, monkeypatch):
    """impl="auto" at batch 16 weighs the tiled choices too; whichever wins computes the step."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    args, kw = make_inputs(rng, batch=16, hidden=512, hq=8, hkv=2, dh=128, max_seq=300,
                           dtype="float16")
    check(args, kw, _gpu(), impl="auto")
    import json
    (entry,) = json.loads((tmp_path / "tuning.json").read_text())["entries"].values()
    assert any(":r" in c for c in entry["times_us"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 512, 8, 2, 128, 512), (16, 512, 4, 4, 64, 300),
                                   (2, 640, 8, 1, 80, 129)])
def test_gpu_splitk_impl(rng, dtype, shape):
    """impl="splitk" (a tuner candidate): our split-K decode attention between XLA's ops."""
    b, hidden, hq, hkv, dh, s = shape
    lengths = rng.integers(0, s, size=b)
    lengths[0] = s - 1
    args, kw = make_inputs(rng, batch=b, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=s,
                                dtype=dtype, lengths=lengths)
    check(args, kw, _gpu(), impl="splitk")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_splitk_linear_projections(rng, monkeypatch, dtype):
    """impl="splitk" with projections="linear": the linear kernel's fp32 QKV output feeds
    the append kernel, its residual-fused output projection ends the step."""
    _splitk_with_linear(monkeypatch)
    lengths = rng.integers(0, 300, size=16)
    args, kw = make_inputs(rng, batch=16, hidden=512, hq=8, hkv=2, dh=128, max_seq=300,
                           dtype=dtype, lengths=lengths)
    check(args, kw, _gpu(), impl="splitk")


# ---------------------------------------------------------------- GPU: the size limits
LIMIT_CONFIGS = [dict(cluster_size=4, impl="kernel"), dict(cluster_size=8, pipeline="tma", impl="kernel"),
                 dict(cluster_size=2, dataflow="split_head", impl="kernel"),
                 dict(cluster_size=2, rows_per_cluster=4, impl="kernel"), dict(impl="splitk")]
_limit_ids = lambda v: "-".join(f"{k}={x}" for k, x in v.items())  # noqa: E731


@pytest.fixture(scope="module")
def cache_of_128k_slots():
    """Two rows of a 131072-slot bf16 cache (the issue's largest S_max; 64-bit offsets
    past 2^31 bytes per cache), made once for the module: the new token in the last
    slot, past the middle, and a row's first token."""
    rng = np.random.default_rng(128)
    return make_inputs(rng, batch=3, hidden=512, hq=8, hkv=2, dh=128, max_seq=131072,
                       dtype="bfloat16", lengths=[131071, 70001, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("config", LIMIT_CONFIGS, ids=_limit_ids)
def test_gpu_cache_of_128k_slots(cache_of_128k_slots, config):
    args, kw = cache_of_128k_slots
    check(args, kw, _gpu(), **config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", LIMIT_CONFIGS + [dict(impl="auto")], ids=_limit_ids)
def test_gpu_batch_64(rng, config, tmp_path, monkeypatch):
    """Batch 64 (the issue's largest), lengths different per row, first and last slot."""
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    lengths = rng.integers(0, 333, size=64)
    lengths[0], lengths[-1] = 0, 332
    args, kw = make_inputs(rng, batch=64, hidden=512, hq=8, hkv=2, dh=64, max_seq=333,
                           dtype="float16", lengths=lengths, bias=True)
    kw["residual"] = True
    check(args, kw, _gpu(), **config)


@pytest.mark.gpu
def test_gpu_explicit_cluster_size_skips_the_tuner(rng, tmp_path, monkeypatch):
    """cluster_size= overrides the tuner (impl="auto" measures nothing); with
    JAX_CLUSTER_TUNING=0 the tuner returns the heuristic without measuring or caching."""
    from jax_cluster import tuning
    from jax_cluster.ops import attention_decode as ad
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=8, hkv=2, dh=128, max_seq=200,
                           dtype="float16", lengths=[199, 3])

    def measured(*_, **__):
        raise AssertionError("the tuner measured candidates")

    monkeypatch.setattr(tuning, "pick", measured)
    check(args, kw, _gpu(), cluster_size=4)
    monkeypatch.undo()
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    sms = _gpu().core_count
    assert ad.autotune(2, 512, 8, 2, 200, 128, jnp.float16) == ad.default_cluster_size(2, 2, 4, sms)
    check(args, kw, _gpu())
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(96, 4, 2, 64, "float16"), (512, 4, 2, 128, "float32")],
                         ids=["hidden-96", "float32"])
def test_gpu_fallback_warns_once(rng, shape):
    """A shape or dtype the kernel does not take runs XLA's ops, with one warning per
    shape: the second call is silent."""
    import warnings
    hidden, hq, hkv, dh, dtype = shape
    args, kw = make_inputs(rng, batch=2, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=20, dtype=dtype)
    # float32: XLA's GPU dots run TF32 at JAX's default precision (~4e-4 here)
    tol = 2e-3 if dtype == "float32" else TOLERANCE[dtype]
    ry, _, _ = reference.attention_decode(**args, **kw)
    with pytest.warns(UserWarning, match="using XLA's ops"):
        assert rel_l2(run(args, kw, _gpu())[0], ry) <= tol
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rel_l2(run(args, kw, _gpu())[0], ry) <= tol
