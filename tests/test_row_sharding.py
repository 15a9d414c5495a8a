"""The decode ops on a device mesh: rows (the batch) sharded over a mesh axis under jit run on
each device's own rows. The compiled program gathers nothing (no collective at all: the
weights are replicated, the caches stay where their rows are), the results keep the rows'
sharding and equal the one-device call bit for bit (or each device's rows run alone, where
an op picks its path by its row count). CPU devices (conftest asks for 8), the ops' C++
handlers (impl="cuda"); Explicit and Auto mesh axes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_cluster as jc
from flax_models.presets import PRESETS, random_model

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _mesh(devices: int, axis_type):
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices")
    return jax.make_mesh((devices,), ("data",), axis_types=(axis_type,))


def _place(mesh, args, rows):
    """Row arguments sharded on dimension 0 over 'data', the rest (weights, dicts) replicated."""
    def put(a, is_row):
        spec = P("data") if is_row else P()
        return jax.tree.map(lambda v: jax.device_put(v, NamedSharding(mesh, spec)), a)
    return tuple(put(a, r) for a, r in zip(args, rows))


def per_device(fn, args, rows, devices):
    """fn on each device's rows alone, the results concatenated: what a partitioned call computes
    where the op picks its path by its row count."""
    n = jax.tree.leaves(args[rows.index(True)])[0].shape[0] // devices
    parts = [jax.jit(fn)(*[jax.tree.map(lambda a: a[i * n:(i + 1) * n], a) if r else a for a, r in zip(args, rows)])
             for i in range(devices)]
    return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def check_partitioned(fn, args, rows, *, devices=2, axis_type=AxisType.Explicit, collectives_allowed=False,
                      want=None):
    want = jax.jit(fn)(*args) if want is None else want
    mesh = _mesh(devices, axis_type)
    placed = _place(mesh, args, rows)
    compiled = jax.jit(fn).lower(*placed).compile()
    text = compiled.as_text()
    if not collectives_allowed:
        assert not [c for c in COLLECTIVES if c in text], [c for c in COLLECTIVES if c in text]
    got = compiled(*placed)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        if not collectives_allowed:
            assert g.sharding.spec[0] == "data", g.sharding
    return got


def _f(rng, *shape, dtype=jnp.float32, scale=0.5):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


# ----------------------------------------------------------------------------- decoder_layer
def _layer_case(rng, family, batch, s_max=24):
    cfg = PRESETS["tiny-llama" if family == "llama" else "tiny-pythia"]
    model = random_model(cfg, jnp.float32, std=0.1)
    w = model._layer_weights(model.layers[0])  # what the model passes to decoder_layer
    hkv = getattr(cfg, "num_kv_heads", cfg.num_heads)
    kc, vc = (_f(rng, batch, hkv, s_max, cfg.head_dim) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, s_max, batch), jnp.int32)
    x = _f(rng, batch, cfg.hidden_size)
    kw = dict(family=family, num_q_heads=cfg.num_heads, num_kv_heads=hkv, eps=1e-5,
              rotary_dim=getattr(cfg, "rotary_dim", None), parallel_residual=family == "gpt_neox", impl="cuda")
    fn = lambda x, w, kc, vc, lengths: jc.decoder_layer(x, w, kc, vc, lengths, model.inv_freq(), **kw)  # noqa: E731
    return fn, (x, w, kc, vc, lengths), (True, False, True, True, True)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_decoder_layer_rows_partitioned(rng, family, axis_type):
    fn, args, rows = _layer_case(rng, family, batch=4)
    check_partitioned(fn, args, rows, axis_type=axis_type)


def test_decoder_layer_rows_over_four_devices_and_vmap(rng):
    fn, args, rows = _layer_case(rng, "llama", batch=8)
    check_partitioned(fn, args, rows, devices=4)
    # vmap over instances still folds them into the rows (one device)
    stacked = [jnp.stack([a, a]) if r else a for a, r in zip(args, rows)]
    y, kc, vc = jax.jit(jax.vmap(fn, in_axes=tuple(0 if r else None for r in rows)))(*stacked)
    want = jax.jit(fn)(*args)
    np.testing.assert_array_equal(np.asarray(y[1]), np.asarray(want[0]))


# ----------------------------------------------------------------------------- attention
def _attention_inputs(rng, batch=4, hq=4, hkv=2, dh=16, s_max=20, d=64):
    kc, vc = (_f(rng, batch, hkv, s_max, dh) for _ in range(2))
    lengths = jnp.asarray(rng.integers(0, s_max, batch), jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
    return kc, vc, lengths, inv_freq


@pytest.mark.parametrize("axis_type,config", [(AxisType.Explicit, None), (AxisType.Auto, None),
                                              (AxisType.Auto, jc.AttentionBlockConfig(kernel="split_k"))],
                         ids=["explicit", "auto", "split_k"])
def test_attention_block_rows_partitioned(rng, axis_type, config):
    kc, vc, lengths, inv_freq = _attention_inputs(rng)
    d, hq, hkv, dh = 64, 4, 2, 16
    w = dict(w_qkv=_f(rng, d, (hq + 2 * hkv) * dh, scale=0.1), w_o=_f(rng, hq * dh, d, scale=0.1),
             norm_weight=1.0 + _f(rng, d, scale=0.1))

    def fn(x, w, kc, vc, lengths):
        return jc.attention_block(x, w["w_qkv"], w["w_o"], kc, vc, lengths, inv_freq, num_q_heads=hq,
                                  num_kv_heads=hkv, norm_weight=w["norm_weight"], residual=True, impl="cuda",
                                  config=config)

    check_partitioned(fn, (_f(rng, 4, d), w, kc, vc, lengths), (True, False, True, True, True), axis_type=axis_type)


def test_decode_attention_rows_partitioned(rng):
    kc, vc, lengths, inv_freq = _attention_inputs(rng)
    q = _f(rng, 4, 2, 2, 16)
    check_partitioned(lambda q, kc, vc, n: jc.decode_attention(q, kc, vc, n, impl="cuda"), (q, kc, vc, lengths),
                      (True,) * 4)
    qkv = _f(rng, 4, (4 + 2 * 2) * 16)
    append = functools.partial(jc.decode_attention_append, inv_freq=inv_freq, num_q_heads=4, scale=0.25, impl="cuda")
    check_partitioned(lambda qkv, kc, vc, n: append(qkv, kc, vc, n), (qkv, kc, vc, lengths), (True,) * 4)


# ----------------------------------------------------------------------------- DeepSeek
def _mla_case(rng, batch=4, hidden=64, heads=4, rank=32, nope=16, rope=8, v=16, s_max=24):
    w = dict(norm=1.0 + _f(rng, hidden, scale=0.1), q=_f(rng, hidden, heads * (nope + rope), scale=0.1),
             kv_a=_f(rng, hidden, rank + rope, scale=0.1), kv_a_norm=1.0 + _f(rng, rank, scale=0.1),
             kv_b=_f(rng, rank, heads * (nope + v), scale=0.2), o=_f(rng, heads * v, hidden, scale=0.1))
    kw = dict(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
              scale=(nope + rope) ** -0.5, eps=1e-5, residual=True, impl="cuda")
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rope, 2) / rope), jnp.float32)
    lengths = jnp.asarray(rng.integers(0, s_max, batch), jnp.int32)
    return w, kw, inv_freq, _f(rng, batch, hidden), _f(rng, batch, s_max, rank + rope), lengths


@pytest.mark.parametrize("batch", [1 * 2, 4 * 2], ids=["projection-kernels", "projections-on-dots"])
def test_mla_decode_rows_partitioned(rng, batch):
    """The projections' form follows each device's rows: two rows over two devices take the
    projection kernels (one row each, where the whole batch would take XLA's dots); eight,
    XLA's dots around the attention kernel on either."""
    w, kw, inv_freq, x, cache, lengths = _mla_case(rng, batch=batch)
    fn = lambda x, w, cache, n: jc.mla_decode(x, w, cache, n, inv_freq, **kw)  # noqa: E731
    args, rows = (x, w, cache, lengths), (True, False, True, True)
    check_partitioned(fn, args, rows, want=per_device(fn, args, rows, 2))


def test_mla_decode_paged_on_a_mesh_is_correct(rng):
    """A page pool is shared by the rows: the op runs whole (its operands gathered), correctly."""
    w, kw, inv_freq, x, cache, lengths = _mla_case(rng)
    pool = cache.reshape(4 * 3, 8, cache.shape[-1])
    table = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)[::-1]
    fn = lambda x, w, pool, n, table: jc.mla_decode(x, w, pool, n, inv_freq, block_table=table, **kw)  # noqa: E731
    check_partitioned(fn, (x, w, pool, lengths, table), (True, False, False, True, True), collectives_allowed=True)


def test_moe_decode_rows_partitioned(rng):
    n, h, e, i = 4, 64, 8, 32
    experts = dict(router=_f(rng, h, e), w_gate=_f(rng, e, h, i, scale=0.1), w_up=_f(rng, e, h, i, scale=0.1),
                   w_down=_f(rng, e, i, h, scale=0.1), norm=1.0 + _f(rng, h, scale=0.1),
                   shared=dict(w_gate=_f(rng, h, 2 * i, scale=0.1), w_up=_f(rng, h, 2 * i, scale=0.1),
                               w_down=_f(rng, 2 * i, h, scale=0.1)))

    def fn(x, w):
        return jc.moe_decode(x, w["router"], w["w_gate"], w["w_up"], w["w_down"], top_k=2, shared=w["shared"],
                             residual=x, norm=w["norm"], impl="cuda")

    check_partitioned(fn, (_f(rng, n, h), experts), (True, False))


def test_swiglu_and_linear_rows_partitioned(rng):
    m, d, f = 4, 64, 128
    x = _f(rng, m, d, dtype=jnp.bfloat16)
    w = dict(g=_f(rng, d, f, dtype=jnp.bfloat16, scale=0.1), u=_f(rng, d, f, dtype=jnp.bfloat16, scale=0.1),
             d=_f(rng, f, d, dtype=jnp.bfloat16, scale=0.1))
    check_partitioned(lambda x, w: jc.swiglu(x, w["g"], w["u"], w["d"], residual=x, impl="cuda"), (x, w),
                      (True, False))
    check_partitioned(lambda x, w: jc.linear(x, w["u"], impl="cuda"), (x, w), (True, False))


# ----------------------------------------------------------------------------- a model's step
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-pythia", "tiny-deepseek"])
def test_fused_decode_step_on_a_batch_sharded_cache(rng, preset, axis_type):
    """flax_models' decode step (impl fused: the ops' handlers) with the tokens and the cache
    sharded over the batch (Auto axes, as jit's in_shardings give, or Explicit ones: the ops
    then run under shard_map): no collective touches the cache, and the logits and the cache
    equal those of each device's rows run alone."""
    from flax import nnx  # noqa: PLC0415

    model = random_model(PRESETS[preset], jnp.bfloat16, std=0.1)
    batch = 4
    cache = model.init_cache(batch, 32)
    cache = jax.tree.map(lambda a: _f(rng, *a.shape, dtype=a.dtype) if a.dtype != jnp.int32 else a, cache)
    cache.lengths = jnp.asarray([3, 0, 7, 12], jnp.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state).decode(tokens, cache, impl="fused")

    tokens = jnp.asarray(rng.integers(0, PRESETS[preset].vocab_size, batch), jnp.int32)
    # each device's half alone (XLA's own dots may sum differently at another row count)
    want = per_device(lambda t, c: step(state, t, c), (tokens, cache), (True, True), 2)
    mesh = _mesh(2, axis_type)
    rows = NamedSharding(mesh, P("data"))
    tokens, cache = jax.device_put(tokens, rows), jax.tree.map(lambda a: jax.device_put(a, rows), cache)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    text = step.lower(state, tokens, cache).compile().as_text()
    assert "all-gather" not in text
    got = step(state, tokens, cache)
    assert all(a.sharding.spec[0] == "data" for a in jax.tree.leaves(got))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("preset,axis_type", [("tiny-llama", AxisType.Auto), ("tiny-deepseek", AxisType.Auto),
                                               ("tiny-llama", AxisType.Explicit)])
def test_generate_data_parallel(rng, preset, axis_type):
    """generate(mesh=): the rows over two devices give each half's tokens as generated alone
    (a mesh of Explicit axes too: generate places the rows on its devices as Auto axes)."""
    from flax_models.engine import generate  # noqa: PLC0415

    model = random_model(PRESETS[preset], jnp.bfloat16, std=0.1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 9, 5, 12)]
    mesh = _mesh(2, axis_type)
    got = generate(model, prompts, 6, impl="fused", mesh=mesh).tokens
    want = generate(model, prompts[:2], 6, impl="fused").tokens + generate(model, prompts[2:], 6, impl="fused").tokens
    assert got == want


def test_generate_data_parallel_errors(rng):
    from flax_models.engine import generate  # noqa: PLC0415

    model = random_model(PRESETS["tiny-deepseek"], jnp.bfloat16, std=0.1)
    mesh = _mesh(2, AxisType.Auto)
    with pytest.raises(ValueError, match="does not split evenly"):
        generate(model, [[1, 2], [3], [4]], 2, mesh=mesh)
    with pytest.raises(ValueError, match="mesh has no axis 'rows'"):
        generate(model, [[1, 2], [3]], 2, mesh=mesh, data_axis="rows")
    with pytest.raises(ValueError, match="a paged latent cache"):
        generate(model, [[1, 2], [3]], 2, mesh=mesh, page_size=16)


def test_export_of_a_partitioned_program(rng, monkeypatch):
    """On Explicit axes (shard_map) jax.export takes the partitioned program. On Auto axes the
    partitioner's callback cannot be serialized: export refuses it, and with
    JAX_CLUSTER_ROW_PARTITIONING=0 (the operands then gathered) takes it."""
    from jax import export  # noqa: PLC0415

    kc, vc, lengths, _ = _attention_inputs(rng)
    q = _f(rng, 4, 2, 2, 16)
    checks = [export.DisabledSafetyCheck.custom_call("jax_cluster_decode_attention")]
    explicit = NamedSharding(_mesh(2, AxisType.Explicit), P("data"))
    on_explicit = [jax.device_put(a, explicit) for a in (q, kc, vc, lengths)]
    fn = jax.jit(lambda *a: jc.decode_attention(*a, impl="cuda"))
    exported = export.export(fn, disabled_checks=checks)(*on_explicit)
    np.testing.assert_array_equal(np.asarray(exported.call(*on_explicit)), np.asarray(fn(q, kc, vc, lengths)))

    mesh = _mesh(2, AxisType.Auto)
    rows = NamedSharding(mesh, P("data"))
    args = [jax.device_put(a, rows) for a in (q, kc, vc, lengths)]
    def step():  # a fresh function per trace: the variable is read when the op is traced
        return jax.jit(lambda *a: jc.decode_attention(*a, impl="cuda"), in_shardings=(rows,) * 4, out_shardings=rows)

    with pytest.raises(NotImplementedError):
        export.export(step(), disabled_checks=checks)(*args)
    want = step()(*args)
    monkeypatch.setenv("JAX_CLUSTER_ROW_PARTITIONING", "0")
    exported = export.export(step(), disabled_checks=checks)(*args)
    np.testing.assert_array_equal(np.asarray(exported.call(*args)), np.asarray(want))
