"""attention_block vs the jnp reference: the CPU handler (impl="cuda" on CPU) and XLA's
ops always, the CUDA kernels on a GPU; AttentionBlockConfig validation, the impl values,
the tuner's candidates and keys."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import _ffi, reference
from jax_cluster.ops import attention_block as ab
from jax_cluster.testing import TOLERANCE, rel_l2

Config = jc.AttentionBlockConfig
CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


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
    fn = jax.jit(lambda a: jc.attention_block(**a, **kw, **extra))
    return fn(args)


def check(args, kw, device, **extra):
    y, k, v = run(args, kw, device, **extra)
    ry, rk, rv = reference.attention_block(**args, **kw)
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


def _config_id(config):
    """A test id: the fields a config sets (those that differ from the default)."""
    if config is None:
        return "none"
    default = Config()
    return ",".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                    if getattr(config, f.name) != getattr(default, f.name)) or "default"


def _ids(extra):
    """A test id of keyword arguments (impl=..., config=...)."""
    return "-".join(_config_id(x) if k == "config" else f"{k}={x}" for k, x in extra.items())


def _custom_calls(args, kw, **extra):
    """The jax_cluster FFI targets in the lowered step."""
    text = jax.jit(lambda a: jc.attention_block(**a, **kw, **extra)).lower(args).as_text()
    return set(re.findall(r"jax_cluster_[a-z_]+", text))


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


CUDA_CONFIGS = [  # every kernel, dataflow and pipeline; cluster sizes of both kinds
    None, Config(cluster_size=1), Config(cluster_size=3), Config(cluster_size=16, pipeline="tma"),
    Config(cluster_size=2, heads_per_cluster=1), Config(cluster_size=7, heads_per_cluster=2, pipeline="tma"),
    Config(cluster_size=2, dataflow="split_head"), Config(dataflow="split_head"),
    Config(kernel="split_k"), Config(kernel="split_k", splits=3),
]


@pytest.mark.parametrize("config", CUDA_CONFIGS, ids=_config_id)
def test_cuda_impl_on_cpu_runs_the_handler_of_every_config(rng, config):
    """impl="cuda" on CPU: the fused configs lower to the attention_block custom call (its
    C++ handler), kernel="split_k" to decode_attention_append's between XLA's projections;
    every one is the reference step (the first and last slot, caches only at lengths[b])."""
    args, kw = make_inputs(rng, batch=3, hidden=128, hq=8, hkv=2, dh=16, max_seq=17, dtype="float32",
                           lengths=[0, 16, 9], norm="layer", bias=True, rotary_dim=8)
    kw.update(residual=True, rope_layout="interleaved")
    want = ({"jax_cluster_decode_attention_append"} if config is not None and config.kernel == "split_k"
            else {"jax_cluster_attention_block"})
    assert _custom_calls(args, kw, impl="cuda", config=config) == want
    check(args, kw, jax.devices("cpu")[0], impl="cuda", config=config)


def test_impl_values(rng):
    """"xla" runs no custom call; "reference" is reference.attention_block; "auto" on CPU is
    the heuristic fused config (nothing is tuned: the tuner is never asked)."""
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32",
                           lengths=[0, 8])
    assert _custom_calls(args, kw, impl="xla") == set()
    assert _custom_calls(args, kw, impl="reference") == set()
    for got, want in zip(jc.attention_block(**args, **kw, impl="reference"),
                         reference.attention_block(**args, **kw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert ab.heuristic() == Config()
    assert _custom_calls(args, kw, impl="auto") == {"jax_cluster_attention_block"}


def test_auto_on_cpu_does_not_tune(rng, monkeypatch):
    from jax_cluster import tuning

    def measured(*_, **__):
        raise AssertionError("the tuner was asked on CPU")

    monkeypatch.setattr(tuning, "pick", measured)
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0])
    assert ab.autotune(2, 64, 4, 2, 9, 16, jnp.float32) == ab.heuristic()


@pytest.mark.parametrize("extra", [
    dict(impl="xla"), dict(impl="reference"), dict(impl="cuda"),
    dict(impl="cuda", config=Config(kernel="split_k")),
], ids=_ids)
def test_invalid_length_writes_nothing(rng, extra):
    """Traced lengths outside [0, S_max) (not caught before tracing): that row is NaN and its
    caches are untouched, in every implementation."""
    args, kw = make_inputs(rng, batch=3, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32",
                           lengths=[2, 0, 0])
    lengths = jnp.asarray([2, 5, -1], jnp.int32)  # rows 1, 2 out of range: traced, so not caught early
    y, k, v = jax.jit(lambda a, ln: jc.attention_block(**{**a, "lengths": ln}, **kw, **extra))(args, lengths)
    assert np.isnan(np.asarray(y[1:])).all() and np.isfinite(np.asarray(y[0])).all()
    np.testing.assert_array_equal(np.asarray(k[1:]), np.asarray(args["k_cache"][1:]))
    np.testing.assert_array_equal(np.asarray(v[1:]), np.asarray(args["v_cache"][1:]))
    ry, _, _ = reference.attention_block(**args, **kw)
    assert rel_l2(y[0], ry[0]) <= 1e-5


PALLAS_CASES = [  # batch, hidden, hq, hkv, dh, max_seq, lengths, bias, rotary
    (3, 128, 8, 2, 32, 256, [0, 255, 131], True, 16),
    (1, 64, 2, 2, 16, 4096, [3000], False, None),
    (2, 64, 4, 1, 64, 512, [17, 400], False, 32),
]


@pytest.mark.parametrize("case", PALLAS_CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_path_in_interpreter(rng, case, dtype):
    """The kernel="pallas" step (Pallas' decode attention between XLA's ops), run by Pallas'
    interpreter on CPU: the same step as the reference; the caches change only at lengths[b]."""
    from jax_cluster.ops.attention_block_unfused import attention_block_pallas
    batch, hidden, hq, hkv, dh, max_seq, lengths, bias, rot = case
    args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=max_seq,
                           dtype=dtype, lengths=lengths, bias=bias, rotary_dim=rot)
    kw.update(residual=True, rope_layout="half", norm_bias=None, eps=1e-6, scale=dh ** -0.5,
              qkv_bias=kw.get("qkv_bias"), o_bias=kw.get("o_bias"))
    y, k, v = jax.jit(lambda a: attention_block_pallas(**a, **kw, interpret=True))(args)
    ry, rk, rv = reference.attention_block(**args, **kw)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    assert rel_l2(y, ry) <= tol, rel_l2(y, ry)
    np.testing.assert_array_equal(_except_new(k, args), _except_new(args["k_cache"], args))
    np.testing.assert_array_equal(_except_new(v, args), _except_new(args["v_cache"], args))
    assert rel_l2(k, rk) <= tol and rel_l2(v, rv) <= tol


def test_pallas_supported_shapes_and_errors(rng):
    from jax_cluster.ops.attention_block_unfused import attention_block_pallas, pallas_supported
    assert pallas_supported(128, 4096) and pallas_supported(64, 256) and pallas_supported(128, 1024)
    assert not pallas_supported(80, 4096)     # Triton blocks: a power-of-two head_dim
    assert not pallas_supported(128, 5000)    # not 16 equal splits
    assert not pallas_supported(128, 128)     # splits of 8 tokens (< 16)
    assert not pallas_supported(128, 16 * 200)  # splits of 200: not whole 128-token blocks
    assert not pallas_supported(128, 1152)    # splits of 72: one block, not a power of two
    assert pallas_supported(128, 16 * 384) and pallas_supported(64, 16 * 32)
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    if jax.default_backend() != "gpu":
        for impl in ("cuda", "auto"):  # a config runs as given under both
            with pytest.raises(ValueError, match="kernel='pallas' runs Pallas' GPU kernel"):
                jc.attention_block(**args, **kw, impl=impl, config=Config(kernel="pallas"))
    kw.update(norm_bias=None, eps=1e-6, scale=0.25, qkv_bias=None, o_bias=None, residual=False,
              rope_layout="half")
    with pytest.raises(ValueError, match="needs a power-of-two head_dim and S_max"):
        attention_block_pallas(**args, **kw)


def test_first_and_last_token_cpu(rng):
    args, kw = make_inputs(rng, batch=3, hidden=64, hq=4, hkv=2, dh=16, max_seq=7,
                           dtype="float32", lengths=[0, 6, 3])
    check(args, kw, jax.devices("cpu")[0])


def test_vmap_folds_batch(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=6, dtype="float32")
    stacked = {k: (jnp.stack([v, v]) if k in ("x", "k_cache", "v_cache", "lengths") else v)
               for k, v in args.items()}
    f = lambda x, kc, vc, ln: jc.attention_block(  # noqa: E731
        x, args["w_qkv"], args["w_o"], kc, vc, ln, args["inv_freq"], **kw)
    batched = (stacked["x"], stacked["k_cache"], stacked["v_cache"], stacked["lengths"])
    y, k, v = jax.vmap(f)(*batched)
    ry, _, _ = reference.attention_block(**args, **kw)
    assert y.shape == (2, 2, 64) and k.shape == (2,) + args["k_cache"].shape
    assert rel_l2(y[1], ry) < 1e-5
    # folded: one call over 4 rows, not a loop of calls
    jaxpr = str(jax.make_jaxpr(jax.vmap(f))(*batched))
    assert jaxpr.count("jax_cluster_attention_block") == 1 and "while" not in jaxpr


def test_vmap_over_weights_maps_sequentially(rng):
    """vmap over the weights too (two layers' steps at once): not foldable into the batch,
    so the batching rule maps the op over them; each slice is the reference step."""
    layers = [make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=6, dtype="float32",
                          lengths=[5, 1]) for _ in range(2)]
    (args0, kw), (args1, _) = layers
    stacked = {k: jnp.stack([args0[k], args1[k]]) for k in ("x", "w_qkv", "w_o", "k_cache", "v_cache")}
    f = lambda x, wq, wo, kc, vc: jc.attention_block(  # noqa: E731
        x, wq, wo, kc, vc, args0["lengths"], args0["inv_freq"], **kw)
    y, k, v = jax.jit(jax.vmap(f))(*stacked.values())
    for i, args in enumerate((args0, args1)):
        ry, rk, rv = reference.attention_block(**{**args, "lengths": args0["lengths"],
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
        (dict(heads_per_cluster=9), "heads_per_cluster must be in 1..8"),
        (dict(num_kv_heads=1, num_q_heads=4), "k_cache has shape"),
        (dict(impl="kernel"), "impl must be one of"),
        (dict(scale=float("inf")), "scale must be finite"),
    ],
)
def test_bad_arguments(rng, change, message):
    """Argument errors (AttentionBlockConfig fields: from the config, before any call)."""
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    config = {k: v for k, v in change.items() if k in CONFIG_FIELDS}
    kw.update({k: v for k, v in change.items() if k not in CONFIG_FIELDS})
    with pytest.raises(ValueError, match=message):
        jc.attention_block(**args, **kw, **({"config": Config(**config)} if config else {}))


def test_bad_shapes_and_lengths(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    with pytest.raises(ValueError, match="w_o has shape"):
        jc.attention_block(**{**args, "w_o": args["w_o"][:-1]}, **kw)
    with pytest.raises(ValueError, match="lengths must be in"):
        jc.attention_block(**{**args, "lengths": jnp.asarray([1, 5], jnp.int32)}, **kw)
    with pytest.raises(ValueError, match="lengths must be in"):
        jc.attention_block(**{**args, "lengths": jnp.asarray([-1, 0], jnp.int32)}, **kw)
    with pytest.raises(ValueError, match="lengths has dtype"):
        jc.attention_block(**{**args, "lengths": jnp.asarray([1, 2], jnp.float32)}, **kw)
    with pytest.raises(ValueError, match="dtype"):
        jc.attention_block(**{**args, "k_cache": args["k_cache"].astype(jnp.float16)}, **kw)
    with pytest.raises(ValueError, match="needs norm_weight"):
        jc.attention_block(**args, **{**kw, "norm_weight": None})
    with pytest.raises(ValueError, match="needs norm_bias"):
        jc.attention_block(**args, **{**kw, "norm": "layer"})


# ---------------------------------------------------------------- AttentionBlockConfig
@pytest.mark.parametrize("fields, error, message", [
    (dict(kernel="splitk"), ValueError, "kernel must be one of ('fused', 'split_k', 'pallas')"),
    (dict(dataflow="split_tokens"), ValueError, "dataflow must be one of"),
    (dict(pipeline="cp.async"), ValueError, "pipeline must be one of"),
    (dict(kernel="split_k", cluster_size=4), ValueError, "knobs of kernel='fused', not 'split_k'"),
    (dict(kernel="pallas", heads_per_cluster=2), ValueError, "knobs of kernel='fused', not 'pallas'"),
    (dict(kernel="split_k", pipeline="tma"), ValueError, "knobs of kernel='fused'"),
    (dict(kernel="pallas", dataflow="split_head"), ValueError, "knobs of kernel='fused'"),
    (dict(splits=4), ValueError, "splits is a knob of kernel='split_k', not 'fused'"),
    (dict(kernel="pallas", splits=4), ValueError, "splits is a knob of kernel='split_k'"),
    (dict(dataflow="split_head", pipeline="tma"), ValueError, "pipeline='tma' is a split_token pipeline"),
    (dict(dataflow="split_head", cluster_size=6), ValueError, "not a power of two"),
    (dict(cluster_size=0), ValueError, "cluster_size must be one of"),
    (dict(cluster_size=32), ValueError, "cluster_size must be one of"),
    (dict(heads_per_cluster=0), ValueError, "heads_per_cluster must be in 1..8"),
    (dict(cluster_size=2.0), TypeError, "cluster_size must be an int or None"),
    (dict(cluster_size=True), TypeError, "cluster_size must be an int or None"),
    (dict(heads_per_cluster="2"), TypeError, "heads_per_cluster must be an int or None"),
    (dict(kernel="split_k", splits=4.0), TypeError, "splits must be an int or None"),
])
def test_config_validation(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        Config(**fields)


def test_config_values():
    """What validates: every cluster size with split_token, the powers of two with split_head,
    numpy ints; configs are frozen and hashable (tuner candidates, jit closures)."""
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 16):
        Config(cluster_size=n, pipeline="tma")
        Config(cluster_size=n, heads_per_cluster=8)
    for n in (1, 2, 4, 8, 16):
        Config(cluster_size=n, dataflow="split_head")
    Config(cluster_size=np.int32(4), heads_per_cluster=np.int64(2))
    Config(kernel="split_k", splits=1024)
    Config(kernel="pallas")
    assert Config() == Config(kernel="fused", cluster_size=None, heads_per_cluster=None,
                              dataflow="split_token", pipeline="registers", splits=None)
    assert len({Config(), Config(), Config(cluster_size=2)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().cluster_size = 2


def test_config_belongs_to_auto_or_cuda(rng):
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=4, hkv=2, dh=16, max_seq=5, dtype="float32")
    for impl in ("xla", "reference"):
        with pytest.raises(ValueError, match="a config applies to impl='auto' or 'cuda'"):
            jc.attention_block(**args, **kw, impl=impl, config=Config())
    for bad in ({"cluster_size": 2}, 4, "n8:h2", jc.DecodeAttentionConfig()):
        with pytest.raises(TypeError, match="config must be an? AttentionBlockConfig or None"):
            jc.attention_block(**args, **kw, impl="cuda", config=bad)


def test_launch_plan_limits():
    """The plan says why the CUDA kernels cannot run a configuration (shared memory, the TMA
    ring, head dim / dtype); the CPU handler runs any valid step, so those are GPU errors."""
    shape = dict(batch=1, head_dim=128, num_q_heads=8, num_kv_heads=8, rotary_dim=128)
    plan = ab.launch_plan(Config(cluster_size=4), hidden=4096, dtype=jnp.float16, **shape)
    assert plan["error"] == plan["cuda_error"] == "" and plan["shared_bytes"] > 0
    plan = ab.launch_plan(Config(cluster_size=1), hidden=65536, dtype=jnp.float16, **shape)
    assert plan["error"] == "" and "bytes of shared memory per block" in plan["cuda_error"]
    plan = ab.launch_plan(Config(cluster_size=1, pipeline="tma"), hidden=32768, dtype=jnp.float16, **shape)
    assert "ring of two stages" in plan["cuda_error"]
    plan = ab.launch_plan(Config(), hidden=4096, dtype=jnp.float32, **shape)
    assert "no CUDA kernel" in plan["cuda_error"]
    plan = ab.launch_plan(Config(cluster_size=4, dataflow="split_head"), hidden=64, dtype=jnp.float16,
                          **{**shape, "head_dim": 16, "rotary_dim": 16})
    assert "divisible by 8 * cluster_size" in plan["error"]
    # cluster_size None: the heuristic's size (the smallest power of two covering 132 SMs)
    assert ab._resolved(Config(), 4, 8, 4, 128).cluster_size == ab.default_cluster_size(4, 8, 4) == 8
    assert ab._resolved(Config(heads_per_cluster=1), 4, 8, 4, 128).cluster_size == 2
    assert ab._resolved(Config(dataflow="split_head"), 1, 8, 4, 16).cluster_size == 2
    assert ab._resolved(Config(dataflow="split_head"), 1, 8, 4, 96).cluster_size == 4


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_cpu_any_heads_per_cluster(rng, heads):
    """The knob changes only the GPU launch; the CPU handler computes the same step."""
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=6, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0], config=Config(heads_per_cluster=heads, cluster_size=2))


def test_split_head_dataflow_arguments(rng):
    """The dataflow changes only the GPU kernel; its constraint is checked before any launch."""
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=4, hkv=2, dh=16, max_seq=9, dtype="float32")
    check(args, kw, jax.devices("cpu")[0], config=Config(dataflow="split_head", cluster_size=2))
    check(args, kw, jax.devices("cpu")[0], config=Config(dataflow="split_head"))  # picks cluster 2 (16 = 8 * 2)
    assert ab._resolved(Config(dataflow="split_head"), 2, 2, 2, 16).cluster_size == 2
    with pytest.raises(ValueError, match="divisible by 8 \\* cluster_size"):
        jc.attention_block(**args, **kw, config=Config(dataflow="split_head", cluster_size=4))
    with pytest.raises(ValueError, match="divisible by 8 \\* cluster_size"):
        jc.attention_block(**args, **kw, impl="cuda", config=Config(dataflow="split_head", cluster_size=4))
    with pytest.raises(ValueError, match="dataflow must be one of"):
        jc.attention_block(**args, **kw, config=Config(dataflow="split_tokens"))


def test_pipeline_arguments(rng):
    args, kw = make_inputs(rng, batch=1, hidden=64, hq=2, hkv=2, dh=16, max_seq=9, dtype="float32")
    with pytest.raises(ValueError, match="pipeline must be one of"):
        jc.attention_block(**args, **kw, config=Config(pipeline="cp.async"))
    with pytest.raises(ValueError, match="split_token pipeline"):
        jc.attention_block(**args, **kw, config=Config(pipeline="tma", dataflow="split_head"))
    # the CPU handler ignores the pipeline (a GPU launch choice): the same step
    check(args, kw, jax.devices("cpu")[0], config=Config(pipeline="tma"))


def test_invalid_length_inside_jit_gives_nan_row(rng):
    args, kw = make_inputs(rng, batch=2, hidden=64, hq=2, hkv=2, dh=16, max_seq=5,
                           dtype="float32", lengths=[2, 9])
    y, k, _ = jax.jit(lambda a: jc.attention_block(**a, **kw))(args)
    assert np.isnan(np.asarray(y[1])).all() and np.isfinite(np.asarray(y[0])).all()
    np.testing.assert_array_equal(k[1], args["k_cache"][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_k_step_cpu(rng, dtype):
    """kernel="split_k": the step with decode_attention_append between XLA's ops (on CPU its
    handler) is the same step as the reference, caches included."""
    args, kw = make_inputs(rng, batch=3, hidden=128, hq=8, hkv=2, dh=16, max_seq=17,
                           dtype=dtype, norm="layer", bias=True, rotary_dim=8)
    check(args, kw, jax.devices("cpu")[0], impl="cuda", config=Config(kernel="split_k"))


# ---------------------------------------------------------------- the tuner
def _fused(candidates):
    return [c for c in candidates if c != "xla" and c.kernel == "fused"]


def test_tuner_candidates_and_choices():
    c = ab.candidates
    C = Config
    # MHA: nothing to spread; each pipeline
    # (one cluster: 7 is the one-wave size that is not a power of two)
    mha = c(batch=1, num_q_heads=1, num_kv_heads=1, head_dim=128, max_seq=4096)
    assert mha == ([C(cluster_size=n) for n in (1, 2, 4, 8, 16)] + [C(cluster_size=7)]
                   + [C(cluster_size=n, pipeline="tma") for n in (2, 4, 8, 7)]
                   + [C(kernel="split_k")] + [C(kernel="pallas")] * ab.pallas_supported(128, 4096) + ["xla"])
    assert all(isinstance(x, C) for x in mha[:-1]) and mha[-1] == "xla"
    gqa = c(batch=1, num_q_heads=4, num_kv_heads=1, head_dim=128, max_seq=4096)
    assert {C(cluster_size=8, heads_per_cluster=2), C(cluster_size=4, heads_per_cluster=1),
            C(cluster_size=8, heads_per_cluster=2, pipeline="tma"), C(cluster_size=4, pipeline="tma")} <= set(gqa)
    assert C(cluster_size=8, heads_per_cluster=4) not in gqa
    assert C(cluster_size=2, heads_per_cluster=1, pipeline="tma") not in gqa
    # 32 clusters (Llama-2-7B b1; Llama-3-8B b1 at one query head per cluster) fit an H100
    # in one wave at cluster size 3, not 4; 16 clusters at 7
    assert {C(cluster_size=3), C(cluster_size=3, pipeline="tma")} <= set(
        c(batch=1, num_q_heads=32, num_kv_heads=32, head_dim=128, max_seq=4096))
    assert {C(cluster_size=3, heads_per_cluster=1), C(cluster_size=7, heads_per_cluster=2),
            C(cluster_size=3, heads_per_cluster=1, pipeline="tma"),
            C(cluster_size=7, heads_per_cluster=2, pipeline="tma")} <= set(
        c(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, max_seq=4096))
    big = c(batch=16, num_q_heads=32, num_kv_heads=32, head_dim=128, max_seq=4096)  # 512 clusters
    assert not [x for x in _fused(big) if x.cluster_size & (x.cluster_size - 1)]
    # split_k up to the decode kernels' group of 8; pallas where Pallas takes the shape
    assert C(kernel="split_k") not in c(batch=1, num_q_heads=16, num_kv_heads=1, head_dim=128, max_seq=4096)
    assert C(kernel="split_k") in c(batch=1, num_q_heads=8, num_kv_heads=1, head_dim=128, max_seq=4096)
    assert C(kernel="pallas") not in c(batch=1, num_q_heads=8, num_kv_heads=1, head_dim=80, max_seq=4096)
    # every candidate is a valid config with its cluster size set, no duplicates
    for shape in (dict(batch=1, num_q_heads=32, num_kv_heads=8), dict(batch=64, num_q_heads=12, num_kv_heads=1)):
        cands = c(**shape, head_dim=128, max_seq=4096)
        assert len(cands) == len(set(cands)) and cands[-1] == "xla"
        assert all(x.cluster_size is not None for x in _fused(cands))
    assert ab._heads_per_cluster(12, 4) == 4 and ab._heads_per_cluster(6, 4) == 3


def test_tuner_keys_cache_alignment_and_pallas(monkeypatch):
    """The tuning key buckets the context to a power of two; a cache length XLA would pad (not
    a multiple of 32) and one Pallas does not take are keys of their own, and kernel="pallas"
    is a candidate only where Pallas takes the shape."""
    from jax_cluster import tuning
    seen = {}

    def fake_pick(op, key, candidates, measure, heuristic):
        assert op == "attention_block" and heuristic == ab.heuristic() and "xla" in candidates
        seen[key.split(" ", 2)[2]] = candidates
        return candidates[0]

    monkeypatch.setattr(tuning, "pick", fake_pick)
    monkeypatch.setattr(ab, "on_gpu", lambda: True)  # the tuner runs on a GPU only
    for max_seq in (4096, 4112, 4160):
        assert ab.autotune(2, 512, 8, 2, max_seq, 128, jnp.float16) in seen[
            ab.tuning_key(2, 512, 8, 2, max_seq, 128, jnp.float16).split(" ", 2)[2]]
    # (a JAX without Pallas' decode module takes nothing: every key is "pallas0")
    pallas = int(ab.pallas_supported(128, 4096))
    assert set(seen) == {f"b2 d512 hq8 hkv2 dh128 ctx4096 dtypefloat16 pallas{pallas} unaligned0",
                         "b2 d512 hq8 hkv2 dh128 ctx4608 dtypefloat16 pallas0 unaligned1",
                         "b2 d512 hq8 hkv2 dh128 ctx4608 dtypefloat16 pallas0 unaligned0"}
    assert [(Config(kernel="pallas") in c) for k, c in sorted(seen.items())] == [bool(pallas), False, False]
    assert ab.tuning_key(2, 512, 8, 2, 4096, 128, jnp.float16).startswith(f"v{ab.KERNEL_VERSION} ")
    # the GPU's launch limits filter the fused candidates: hidden 32768 leaves no TMA ring
    seen.clear()
    ab.autotune(1, 32768, 8, 8, 4096, 128, jnp.float16)
    ((_, cands),) = seen.items()
    assert not [c for c in _fused(cands) if c.pipeline == "tma"] and _fused(cands)


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


GPU_SHAPES = [  # hidden, hq, hkv, dh
    (512, 4, 4, 128),    # MHA
    (512, 8, 2, 64),     # GQA 4
    (640, 8, 1, 80),     # MQA 8, head_dim 80
    (768, 16, 2, 96),    # GQA 8, head_dim 96
    (512, 12, 1, 64),    # group 12 -> 2 clusters of 6 heads
    (512, 4, 4, 256),    # MHA, head_dim 256 (Pythia-1B's heads)
    (512, 8, 1, 256),    # MQA 8, head_dim 256 (Gemma-2B's)
]


def _shape_id(shape):
    return "d{}-h{}x{}-dh{}".format(*shape)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8, 16])  # 3, 6: collectives without a butterfly
def test_gpu_vs_reference(rng, dtype, shape, n, pipeline):
    hidden, hq, hkv, dh = shape
    for batch, max_seq, lengths in ((1, 40, [0]), (3, 300, [1, 299, 157]), (16, 77, None)):
        args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh,
                               max_seq=max_seq, dtype=dtype, lengths=lengths,
                               bias=batch == 3, norm="layer" if batch == 3 else "rms",
                               rotary_dim=dh // 2 if batch == 16 else None)
        kw["residual"] = batch != 1
        config = Config(cluster_size=n, pipeline=pipeline)
        plan = ab.launch_plan(config, batch=batch, hidden=hidden, head_dim=dh, num_q_heads=hq,
                              num_kv_heads=hkv, rotary_dim=kw["rotary_dim"], dtype=dtype)
        if plan["cuda_error"]:  # the TMA ring at head_dim 256: a W_qkv box is larger than a stage
            assert (pipeline, dh) == ("tma", 256), plan["cuda_error"]
            with pytest.raises(ValueError, match="pipeline tma: head_dim 256"):
                run(args, kw, _gpu(), impl="cuda", config=config)
            continue
        check(args, kw, _gpu(), impl="cuda", config=config)


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
        check(args, kw, _gpu(), impl="cuda",
              config=Config(cluster_size=n, heads_per_cluster=heads, pipeline=pipeline))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=_shape_id)
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
        check(args, kw, _gpu(), impl="cuda", config=Config(cluster_size=n, dataflow="split_head"))


@pytest.mark.gpu
def test_gpu_split_head_deterministic_and_agrees(rng):
    args, kw = make_inputs(rng, batch=2, hidden=1024, hq=16, hkv=4, dh=128, max_seq=3000,
                           dtype="float16", lengths=[2999, 1500])
    args = jax.device_put(args, _gpu())
    split_head = Config(cluster_size=4, dataflow="split_head")
    f = jax.jit(lambda a: jc.attention_block(**a, **kw, config=split_head)[0])
    first = np.asarray(f(args))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(f(args)), first)
    token = np.asarray(jax.jit(lambda a: jc.attention_block(**a, **kw, config=Config(cluster_size=4))[0])(args))
    assert rel_l2(first, token) <= TOLERANCE["float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_xla_impl_and_auto(rng, dtype, tmp_path, monkeypatch):
    """impl="xla" on the GPU, and impl="auto" with a fresh tuning cache (its candidates are
    the fused configs, split_k and "xla"; whichever wins must compute the same step)."""
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
    """kernel="pallas" (a tuner candidate): Pallas' decode kernel between XLA's ops computes
    the same step, GQA and MHA, first and last slot."""
    batch, hidden, hq, hkv, dh, max_seq, lengths = shape
    args, kw = make_inputs(rng, batch=batch, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=max_seq,
                           dtype=dtype, lengths=lengths, bias=batch == 3)
    kw["residual"] = True
    check(args, kw, _gpu(), impl="cuda", config=Config(kernel="pallas"))


@pytest.mark.gpu
def test_gpu_auto_pallas_pick_and_nopallas_key(rng, tmp_path, monkeypatch):
    """A cached kernel="pallas" pick runs Pallas' path. An S_max Pallas does not take (4160:
    16 splits of 260 tokens) has a tuning key of its own whose candidates leave "pallas" out
    (a "pallas" entry there is stale: ignored with a warning, re-measured). Every path
    computes the step."""
    from jax_cluster import tuning
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    tuning.clear_memory_cache()
    pallas = Config(kernel="pallas")
    for max_seq in (512, 4160):
        tuning.record("attention_block", ab.tuning_key(2, 512, 8, 2, max_seq, 128, jnp.float16), pallas)
    assert "pallas0" in ab.tuning_key(2, 512, 8, 2, 4160, 128, jnp.float16)
    for max_seq in (512, 4160):
        args, kw = make_inputs(rng, batch=2, hidden=512, hq=8, hkv=2, dh=128, max_seq=max_seq,
                               dtype="float16", lengths=[max_seq - 1, 7])
        if max_seq == 512:
            assert ab.autotune(2, 512, 8, 2, max_seq, 128, jnp.float16) == pallas
        else:
            with pytest.warns(UserWarning, match="stale cache entry"):
                assert ab.autotune(2, 512, 8, 2, max_seq, 128, jnp.float16) != pallas
        check(args, kw, _gpu(), impl="auto")
    tuning.clear_memory_cache()


@pytest.mark.gpu
def test_gpu_unsupported_head_dim_falls_back_to_xla(rng):
    _ffi._warned.clear()
    args, kw = make_inputs(rng, batch=2, hidden=256, hq=4, hkv=2, dh=32, max_seq=20, dtype="float16")
    with pytest.warns(UserWarning, match="using XLA's ops"):
        check(args, kw, _gpu())
    with pytest.raises(ValueError, match="no CUDA kernel for head_dim=32"):
        run(args, kw, _gpu(), impl="cuda")
    with pytest.raises(ValueError, match="no CUDA kernel for head_dim=32"):
        run(args, kw, _gpu(), impl="cuda", config=Config(cluster_size=2))


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
def test_gpu_long_context_and_interleaved(rng, pipeline):
    args, kw = make_inputs(rng, batch=2, hidden=4096, hq=32, hkv=8, dh=128, max_seq=5000,
                           dtype="bfloat16", lengths=[4999, 3001])
    kw["rope_layout"] = "interleaved"
    check(args, kw, _gpu(), impl="cuda", config=Config(pipeline=pipeline))


DETERMINISM_CONFIGS = [dict(config=Config(cluster_size=n)) for n in (1, 2, 3, 4, 8, 16)] + [
    dict(config=Config(cluster_size=4, pipeline="tma")), dict(config=Config(cluster_size=8, heads_per_cluster=2)),
    dict(config=Config(cluster_size=4, dataflow="split_head")),
    dict(config=Config(cluster_size=16, dataflow="split_head")),
    dict(impl="cuda", config=Config(kernel="split_k")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", DETERMINISM_CONFIGS, ids=_ids)
def test_gpu_deterministic(rng, config):
    """Output and caches bitwise equal over 20 runs, for every dataflow, pipeline and
    combine path (cluster reductions, fixed-order combine kernels, no atomics)."""
    args, kw = make_inputs(rng, batch=4, hidden=1024, hq=16, hkv=4, dh=128, max_seq=2048,
                           dtype="float16")
    args = jax.device_put(args, _gpu())
    f = jax.jit(lambda a: jc.attention_block(**a, **kw, **config))
    first = [np.asarray(t) for t in f(args)]
    for _ in range(20):
        for got, want in zip(f(args), first):
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.gpu
def test_gpu_donated_caches_update_in_place(rng):
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=4, hkv=4, dh=128, max_seq=64,
                           dtype="float16", lengths=[5, 6])
    args = jax.device_put(args, _gpu())
    step = jax.jit(lambda x, kc, vc, ln: jc.attention_block(
        x, args["w_qkv"], args["w_o"], kc, vc, ln, args["inv_freq"], **kw), donate_argnums=(1, 2))
    kc, vc = args["k_cache"] + 0, args["v_cache"] + 0
    ln = args["lengths"]
    for _ in range(3):  # a few steps, feeding caches back
        _, kc, vc = step(args["x"], kc, vc, ln)
        ln = ln + 1
    assert np.isfinite(np.asarray(kc.astype(jnp.float32))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    Config(cluster_size=3), Config(cluster_size=4), Config(cluster_size=8, heads_per_cluster=1),
    Config(cluster_size=4, pipeline="tma"), Config(cluster_size=4, dataflow="split_head"),
], ids=lambda c: _config_id(c))
def test_gpu_back_to_back_steps_equal_synchronised_steps(rng, config):
    """Decode steps in one jit, each step's output the next one's input: the kernels run
    back to back, and with programmatic launches (PDL) a step's main kernel starts while the
    previous step's combine kernel may still read the partials workspace. Outputs and
    caches must be bitwise those of the same steps run one call at a time, synchronised."""
    args, kw = make_inputs(rng, batch=3, hidden=1024, hq=16, hkv=4, dh=128, max_seq=600,
                           dtype="float16", lengths=[100, 350, 7])
    kw["residual"] = True
    args = jax.device_put(args, _gpu())

    def step(x, kc, vc, ln, w_qkv, w_o, inv_freq, norm_weight):
        y, kc, vc = jc.attention_block(x, w_qkv, w_o, kc, vc, ln, inv_freq, impl="cuda", config=config,
                                       **{**kw, "norm_weight": norm_weight})
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
    check(args, kw, _gpu(), impl="cuda",
          config=Config(cluster_size=n, heads_per_cluster=heads, pipeline=pipeline))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", [Config(cluster_size=4), Config(cluster_size=2, heads_per_cluster=2),
                                    Config(cluster_size=8, heads_per_cluster=1, pipeline="tma"),
                                    Config(kernel="split_k")], ids=_config_id)
def test_gpu_model_sized_batches(rng, dtype, config):
    """Llama-3-8B's attention shape (hidden 4096, 32/8 heads) at batch 16 and 11 with long,
    different lengths; heads_per_cluster < group: several head chunks per KV head (only
    chunk 0 writes the cache)."""
    for batch in (16, 11):
        lengths = rng.integers(0, 1100, size=batch)
        lengths[0], lengths[-1] = 1099, 0
        args, kw = make_inputs(rng, batch=batch, hidden=4096, hq=32, hkv=8, dh=128, max_seq=1100,
                               dtype=dtype, lengths=lengths)
        kw["residual"] = True
        check(args, kw, _gpu(), impl="cuda", config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["registers", "tma"])
@pytest.mark.parametrize("dh", [64, 80, 96, 128, 256])
def test_gpu_kernel_length_out_of_range_gives_nan_row(rng, dh, pipeline):
    """A traced length >= S_max reaches the kernel: that row's output is NaN, its caches
    untouched, the other row exact."""
    if (dh, pipeline) == (256, "tma"):
        pytest.skip("the TMA pipeline does not take head_dim 256")
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=4, hkv=2, dh=dh, max_seq=64,
                           dtype="float16", lengths=[5, 64])
    y, k, v = run(args, kw, _gpu(), impl="cuda", config=Config(cluster_size=2, pipeline=pipeline))
    ry, _, _ = reference.attention_block(**{**args, "lengths": jnp.asarray([5, 0], jnp.int32)}, **kw)
    assert np.isnan(np.asarray(y[1].astype(jnp.float32))).all()
    assert rel_l2(y[0], ry[0]) <= TOLERANCE["float16"]
    np.testing.assert_array_equal(np.asarray(k[1]), np.asarray(args["k_cache"][1]))
    np.testing.assert_array_equal(np.asarray(v[1]), np.asarray(args["v_cache"][1]))


@pytest.mark.gpu
def test_gpu_auto_at_batch_16_weighs_split_k(rng, tmp_path, monkeypatch):
    """impl="auto" at batch 16 weighs kernel="split_k" and "xla" besides the fused configs
    (every candidate is timed); whichever wins computes the step."""
    import json
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    args, kw = make_inputs(rng, batch=16, hidden=512, hq=8, hkv=2, dh=128, max_seq=300,
                           dtype="float16")
    check(args, kw, _gpu(), impl="auto")
    (entry,) = json.loads((tmp_path / "tuning.json").read_text())["entries"].values()
    assert str(Config(kernel="split_k")) in entry["times_us"] and "xla" in entry["times_us"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 512, 8, 2, 128, 512), (16, 512, 4, 4, 64, 300),
                                   (2, 640, 8, 1, 80, 129)])
def test_gpu_split_k_kernel(rng, dtype, shape):
    """kernel="split_k" (a tuner candidate): our split-K decode attention between XLA's ops."""
    b, hidden, hq, hkv, dh, s = shape
    lengths = rng.integers(0, s, size=b)
    lengths[0] = s - 1
    args, kw = make_inputs(rng, batch=b, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=s,
                           dtype=dtype, lengths=lengths)
    check(args, kw, _gpu(), impl="cuda", config=Config(kernel="split_k"))
    check(args, kw, _gpu(), impl="cuda", config=Config(kernel="split_k", splits=3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 200, 4, 4, 256, 1000, "layer", True, 64),   # Pythia-1B's heads
                                   (2, 352, 8, 1, 256, 517, "rms", False, None),   # MQA 8 (Gemma-2B's)
                                   (2, 96, 2, 2, 64, 130, "rms", True, None)],
                         ids=["hidden-200-dh256", "hidden-352-mqa-dh256", "hidden-96"])
def test_gpu_shapes_past_the_fused_kernel_run_split_k(rng, dtype, shape, tmp_path, monkeypatch):
    """Shapes the fused kernel does not take (hidden % 64 != 0) and decode_attention's kernels
    do: impl="cuda" without a config runs split_k, "auto" weighs it against XLA's ops without
    a fallback warning; both compute the step."""
    import json
    import warnings
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    _ffi._warned.clear()
    b, hidden, hq, hkv, dh, s, norm, bias, rotary = shape
    lengths = rng.integers(0, s, size=b)
    lengths[0] = s - 1
    args, kw = make_inputs(rng, batch=b, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=s, dtype=dtype,
                           lengths=lengths, norm=norm, bias=bias, rotary_dim=rotary)
    kw["residual"] = True
    hlo = jax.jit(lambda a: jc.attention_block(**a, **kw, impl="cuda")).lower(args).as_text()
    assert "jax_cluster_decode_attention_append" in hlo and "jax_cluster_attention_block" not in hlo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(args, kw, _gpu(), impl="cuda")
        check(args, kw, _gpu(), impl="auto")
    (entry,) = json.loads((tmp_path / "tuning.json").read_text())["entries"].values()
    assert set(entry["times_us"]) <= {str(Config(kernel="split_k")), str(Config(kernel="pallas")), "xla"}


# ---------------------------------------------------------------- GPU: the size limits
LIMIT_CONFIGS = [dict(impl="cuda", config=Config(cluster_size=4)),
                 dict(impl="cuda", config=Config(cluster_size=8, pipeline="tma")),
                 dict(impl="cuda", config=Config(cluster_size=2, dataflow="split_head")),
                 dict(impl="cuda", config=Config(kernel="split_k"))]


@pytest.fixture(scope="module")
def cache_of_128k_slots():
    """Two rows of a 131072-slot bf16 cache (the issue's largest S_max; 64-bit offsets
    past 2^31 bytes per cache), made once for the module: the new token in the last
    slot, past the middle, and a row's first token."""
    rng = np.random.default_rng(128)
    return make_inputs(rng, batch=3, hidden=512, hq=8, hkv=2, dh=128, max_seq=131072,
                       dtype="bfloat16", lengths=[131071, 70001, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("config", LIMIT_CONFIGS, ids=_ids)
def test_gpu_cache_of_128k_slots(cache_of_128k_slots, config):
    args, kw = cache_of_128k_slots
    check(args, kw, _gpu(), **config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", LIMIT_CONFIGS + [dict(impl="auto")], ids=_ids)
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
def test_gpu_explicit_config_skips_the_tuner(rng, tmp_path, monkeypatch):
    """A config overrides the tuner (impl="auto" measures nothing); with
    JAX_CLUSTER_TUNING=0 the tuner returns the heuristic without measuring or caching."""
    from jax_cluster import tuning
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    args, kw = make_inputs(rng, batch=2, hidden=512, hq=8, hkv=2, dh=128, max_seq=200,
                           dtype="float16", lengths=[199, 3])

    def measured(*_, **__):
        raise AssertionError("the tuner measured candidates")

    monkeypatch.setattr(tuning, "pick", measured)
    check(args, kw, _gpu(), config=Config(cluster_size=4))
    check(args, kw, _gpu(), impl="cuda")  # impl="cuda" without a config: the heuristic, untuned
    monkeypatch.undo()
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    sms = _gpu().core_count
    assert ab.autotune(2, 512, 8, 2, 200, 128, jnp.float16) == ab.heuristic() == Config()
    assert ab._resolved(ab.heuristic(), 2, 2, 4, 128).cluster_size == ab.default_cluster_size(2, 2, 4, sms)
    check(args, kw, _gpu())
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(96, 2, 2, 48, "float16"), (512, 4, 2, 128, "float32")],
                         ids=["head_dim-48", "float32"])
def test_gpu_fallback_warns_once(rng, shape):
    """A shape or dtype the kernel does not take runs XLA's ops, with one warning per
    shape: the second call is silent."""
    import warnings
    _ffi._warned.clear()
    hidden, hq, hkv, dh, dtype = shape
    args, kw = make_inputs(rng, batch=2, hidden=hidden, hq=hq, hkv=hkv, dh=dh, max_seq=20, dtype=dtype)
    # float32: XLA's GPU dots run TF32 at JAX's default precision (~4e-4 here)
    tol = 2e-3 if dtype == "float32" else TOLERANCE[dtype]
    ry, _, _ = reference.attention_block(**args, **kw)
    with pytest.warns(UserWarning, match="using XLA's ops"):
        assert rel_l2(run(args, kw, _gpu())[0], ry) <= tol
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rel_l2(run(args, kw, _gpu())[0], ry) <= tol
