"""The fused ops on shapes drawn at random (a fixed seed per case, so a failure names its
shape and reruns it): widths that are only multiples of 8 (64 where the kernels say so:
attention_block's hidden, swiglu's D and F), any GQA ratio the kernels take, odd batches,
caches of any length, paged latent caches, every routing method, every dtype, and for
attention_block a random one of the configurations the tuner weighs. Each case runs
impl="cuda" on the GPU against the fp32 reference. The hand-picked shapes of each op's own
tests cover the edges on purpose; these cover what nobody picked."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import reference
from jax_cluster.ops import moe_decode as md
from jax_cluster.testing import TOLERANCE, rel_l2

pytestmark = pytest.mark.gpu

DTYPES = (jnp.float16, jnp.bfloat16)


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_CLUSTER_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setenv("JAX_CLUSTER_TUNING", "0")
    jc.tuning.clear_memory_cache()
    yield
    jc.tuning.clear_memory_cache()


def _arrays(rng, dtype):
    def f(*shape, scale=None, offset=0.0):
        scale = shape[0] ** -0.5 if scale is None else scale
        return jnp.asarray(rng.standard_normal(shape) * scale + offset, jnp.float32).astype(dtype)
    return f


def _multiple(rng, lo, hi, step=8):
    return step * int(rng.integers(lo // step, hi // step + 1))


def _lengths(rng, batch, s_max):
    lengths = rng.integers(0, s_max, batch)
    lengths[rng.integers(batch)] = s_max - 1  # one row at the cache's end
    return jnp.asarray(lengths, jnp.int32)


def _close(got, want, dtype, what, shape):
    err = rel_l2(got, want)
    assert err <= TOLERANCE[jnp.dtype(dtype).name], f"{what}: rel_l2 {err:.3g} on {shape}"


# ----------------------------------------------------------------------------- decoder_layer
def _decoder_layer_case(seed):
    rng = np.random.default_rng(seed)
    family = ("llama", "gpt_neox")[seed % 2]
    dh = int(rng.choice([64, 80, 96, 128]))
    hkv = int(rng.integers(1, 5))
    group = int(rng.integers(1, 9)) if family == "llama" else 1
    shape = dict(family=family, dtype=DTYPES[seed // 2 % 2], batch=int(rng.integers(1, 9)), d=_multiple(rng, 64, 640),
                 f=_multiple(rng, 64, 1800), hq=hkv * group, hkv=hkv, dh=dh, s_max=int(rng.integers(1, 1500)),
                 rotary=dh if family == "llama" else 2 * int(rng.integers(1, dh // 2 + 1)),
                 bias=bool(rng.integers(2)), rope_layout=str(rng.choice(["half", "interleaved"])))
    if family == "gpt_neox":
        shape.update(parallel_residual=bool(rng.integers(2)), gelu_approximate=bool(rng.integers(2)))
    return rng, shape


@pytest.mark.parametrize("seed", range(16))
def test_decoder_layer(seed):
    rng, s = _decoder_layer_case(seed)
    f = _arrays(rng, s["dtype"])
    d, hq, hkv, dh, cols = s["d"], s["hq"], s["hkv"], s["dh"], (s["hq"] + 2 * s["hkv"]) * s["dh"]
    w = dict(norm=f(d, scale=0.2, offset=1.0), qkv=f(d, cols), o=f(hq * dh, d), post_norm=f(d, scale=0.2, offset=1.0))
    if s["bias"]:
        w.update(qkv_bias=f(cols, scale=0.1), o_bias=f(d, scale=0.1))
    if s["family"] == "llama":
        w.update(w_gate=f(d, s["f"]), w_up=f(d, s["f"]), w_down=f(s["f"], d))
    else:
        w.update(norm_bias=f(d, scale=0.1), post_norm_bias=f(d, scale=0.1), w_in=f(d, s["f"]), w_out=f(s["f"], d))
        if s["bias"]:
            w.update(b_in=f(s["f"], scale=0.1), b_out=f(d, scale=0.1))
    args = dict(x=f(s["batch"], d, scale=1.0), weights=w, k_cache=f(s["batch"], hkv, s["s_max"], dh, scale=1.0),
                v_cache=f(s["batch"], hkv, s["s_max"], dh, scale=1.0), lengths=_lengths(rng, s["batch"], s["s_max"]),
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, s["rotary"], 2) / s["rotary"]), jnp.float32))
    kw = dict(family=s["family"], num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=s["rotary"],
              rope_layout=s["rope_layout"], parallel_residual=s.get("parallel_residual", False),
              gelu_approximate=s.get("gelu_approximate", False))
    got = jax.jit(functools.partial(jc.decoder_layer, impl="cuda", **kw))(**args)
    want = jax.jit(functools.partial(jc.decoder_layer, impl="reference", **kw))(**args)
    for name, g, r in zip(("y", "k_cache", "v_cache"), got, want):
        _close(g, r, s["dtype"], f"decoder_layer {name}", s)


# ----------------------------------------------------------------------------- attention_block
@pytest.mark.parametrize("seed", range(16))
def test_attention_block(seed):
    rng = np.random.default_rng(1000 + seed)
    dh = int(rng.choice([64, 80, 96, 128]))
    hkv = int(rng.integers(1, 5))
    s = dict(dtype=DTYPES[seed % 2], batch=int(rng.integers(1, 7)), d=_multiple(rng, 64, 640, 64),
             hq=hkv * int(rng.integers(1, 9)), hkv=hkv, dh=dh, s_max=int(rng.integers(1, 1500)),
             norm=str(rng.choice(["rms", "layer"])), bias=bool(rng.integers(2)),
             rotary=2 * int(rng.integers(1, dh // 2 + 1)), rope_layout=str(rng.choice(["half", "interleaved"])),
             residual=bool(rng.integers(2)))
    configs = [c for c in jc.ops.attention_block.candidates(batch=s["batch"], num_q_heads=s["hq"], num_kv_heads=hkv,
                                                             head_dim=dh, max_seq=s["s_max"])
               if c != "xla" and c.kernel != "pallas"]
    config = configs[int(rng.integers(len(configs)))]
    s["config"] = config
    f = _arrays(rng, s["dtype"])
    d, hq, cols = s["d"], s["hq"], (s["hq"] + 2 * hkv) * dh
    args = dict(x=f(s["batch"], d, scale=1.0), w_qkv=f(d, cols), w_o=f(hq * dh, d),
                k_cache=f(s["batch"], hkv, s["s_max"], dh, scale=1.0),
                v_cache=f(s["batch"], hkv, s["s_max"], dh, scale=1.0),
                lengths=_lengths(rng, s["batch"], s["s_max"]),
                inv_freq=jnp.asarray(10000.0 ** (-np.arange(0, s["rotary"], 2) / s["rotary"]), jnp.float32))
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, norm=s["norm"], norm_weight=f(d, scale=0.2, offset=1.0),
              rotary_dim=s["rotary"], rope_layout=s["rope_layout"], residual=s["residual"])
    if s["norm"] == "layer":
        kw["norm_bias"] = f(d, scale=0.1)
    if s["bias"]:
        kw.update(qkv_bias=f(cols, scale=0.1), o_bias=f(d, scale=0.1))
    if config.kernel == "fused":
        plan = jc.ops.attention_block.launch_plan(config, batch=s["batch"], hidden=d, head_dim=dh, num_q_heads=hq,
                                                  num_kv_heads=hkv, rotary_dim=s["rotary"], dtype=s["dtype"])
        if plan["error"] or plan["cuda_error"]:
            pytest.skip(f"the tuner would not run {config} here: {plan['error'] or plan['cuda_error']}")
    got = jax.jit(functools.partial(jc.attention_block, impl="cuda", config=config, **kw))(**args)
    want = reference.attention_block(**args, **kw)
    for name, g, r in zip(("y", "k_cache", "v_cache"), got, want):
        _close(g, r, s["dtype"], f"attention_block {name}", s)


# ----------------------------------------------------------------------------- mla_decode
@pytest.mark.parametrize("seed", range(12))
def test_mla_decode(seed):
    rng = np.random.default_rng(2000 + seed)
    s = dict(dtype=DTYPES[seed % 2], batch=int(rng.integers(1, 10)), hidden=_multiple(rng, 64, 512),
             heads=int(rng.integers(1, 41)), rank=_multiple(rng, 8, 512), rope=_multiple(rng, 8, 64),
             nope=_multiple(rng, 8, 128), v=_multiple(rng, 8, 128), s_max=int(rng.integers(1, 1200)),
             q_lora=None if rng.integers(2) else _multiple(rng, 16, 384), bias=bool(rng.integers(2)),
             residual=bool(rng.integers(2)), page=int(rng.choice([0, 1, 16, 64])),
             projections=str(rng.choice(["kernels", "xla"])) if seed % 3 else None)
    if s["projections"] == "kernels":
        s["batch"] = int(rng.choice([1, 2, 4, 8]))
    f = _arrays(rng, s["dtype"])
    h, heads, r, dr = s["hidden"], s["heads"], s["rank"], s["rope"]
    w = dict(norm=f(h, scale=0.2, offset=1.0), kv_a=f(h, r + dr), kv_a_norm=f(r, scale=0.2, offset=1.0),
             kv_b=f(r, heads * (s["nope"] + s["v"])), o=f(heads * s["v"], h))
    if s["q_lora"] is None:
        w["q"] = f(h, heads * (s["nope"] + dr))
    else:
        w.update(q_a=f(h, s["q_lora"]), q_a_norm=f(s["q_lora"], scale=0.2, offset=1.0),
                 q_b=f(s["q_lora"], heads * (s["nope"] + dr)))
    if s["bias"]:
        w.update(kv_a_bias=f(r + dr, scale=0.1), o_bias=f(h, scale=0.1))
    lengths = _lengths(rng, s["batch"], s["s_max"])
    cache = f(s["batch"], s["s_max"], r + dr, scale=1.0)
    kw = dict(num_heads=heads, kv_lora_rank=r, qk_nope_head_dim=s["nope"], qk_rope_head_dim=dr, v_head_dim=s["v"],
              scale=(s["nope"] + dr) ** -0.5, eps=1e-5, latent_eps=1e-6, rope_factor=float(rng.uniform(0.8, 1.3)),
              residual=s["residual"])
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dr, 2) / dr), jnp.float32)
    x = f(s["batch"], h, scale=1.0)
    reference_step = jax.jit(functools.partial(jc.mla_decode, impl="reference", **kw))
    want_y, want_cache = reference_step(x, w, cache, lengths, inv_freq)
    config = jc.MlaDecodeConfig(projections=s["projections"]) if s["projections"] else None
    step = jax.jit(functools.partial(jc.mla_decode, impl="cuda", config=config, **kw))
    if s["page"]:
        page = s["page"]
        blocks = -(-s["s_max"] // page)
        table = rng.permutation(s["batch"] * blocks + 2)[: s["batch"] * blocks].reshape(s["batch"], blocks)
        pool = np.zeros((s["batch"] * blocks + 2, page, r + dr), np.float32)
        padded = np.zeros((s["batch"], blocks * page, r + dr), np.float32)
        padded[:, : s["s_max"]] = np.asarray(cache, np.float32)
        for b in range(s["batch"]):
            for j in range(blocks):
                pool[table[b, j]] = padded[b, j * page:(j + 1) * page]
        y, got_pool = step(x, w, jnp.asarray(pool, s["dtype"]), lengths, inv_freq,
                           block_table=jnp.asarray(table, jnp.int32))
        got = np.asarray(got_pool, np.float32)[table].reshape(s["batch"], blocks * page, r + dr)[:, : s["s_max"]]
    else:
        y, got = step(x, w, cache, lengths, inv_freq)
    _close(y, want_y, s["dtype"], "mla_decode y", s)
    _close(jnp.asarray(got, jnp.float32), want_cache.astype(jnp.float32), s["dtype"], "mla_decode cache", s)


# ----------------------------------------------------------------------------- moe_decode
@pytest.mark.parametrize("seed", range(12))
def test_moe_decode(seed):
    rng = np.random.default_rng(3000 + seed)
    n_group = int(rng.choice([1, 2, 4]))
    e = n_group * int(rng.integers(1, 17))
    method = str(rng.choice(["greedy", "group_limited_greedy", "noaux_tc"])) if n_group > 1 else "greedy"
    topk_group = int(rng.integers(1, n_group + 1))
    kept = topk_group * (e // n_group) if method != "greedy" else e
    s = dict(dtype=DTYPES[seed % 2], n=int(rng.choice([1, 2, 3, 5, 8, 13, 64])), h=_multiple(rng, 64, 768),
             i=_multiple(rng, 8, 512), e=e, top_k=int(rng.integers(1, min(8, kept) + 1)), method=method,
             n_group=n_group, topk_group=topk_group, shared=_multiple(rng, 8, 768) if rng.integers(2) else None,
             residual=bool(rng.integers(2)), norm=bool(rng.integers(2)), norm_topk_prob=bool(rng.integers(2)))
    f = _arrays(rng, s["dtype"])
    h, i = s["h"], s["i"]
    args = dict(x=f(s["n"], h, scale=1.0), router=f(h, e), w_gate=f(e, h, i), w_up=f(e, h, i), w_down=f(e, i, h))
    kw = dict(top_k=s["top_k"], topk_method=method, norm_topk_prob=s["norm_topk_prob"],
              routed_scaling_factor=float(rng.uniform(1.0, 3.0)))
    if method != "greedy":
        kw.update(n_group=n_group, topk_group=topk_group)
    if method == "noaux_tc":
        kw["score_bias"] = jnp.asarray(rng.standard_normal(e) * 0.5, jnp.float32)
    if s["shared"]:
        kw["shared"] = dict(w_gate=f(h, s["shared"]), w_up=f(h, s["shared"]), w_down=f(s["shared"], h))
    if s["residual"]:
        kw["residual"] = f(s["n"], h, scale=1.0)
    if s["norm"]:
        kw["norm"] = f(h, scale=0.2, offset=1.0)
    got = jax.jit(lambda a: jc.moe_decode(**a, **kw, impl="cuda"))(args)
    want = jax.jit(lambda a: jc.moe_decode(**a, **kw, impl="reference"))(args)
    if rel_l2(got, want) > TOLERANCE[jnp.dtype(s["dtype"]).name]:
        # The kernels' router sums its logits in its own order, so where two scores are
        # within a few ulps it may pick the other expert: then check the experts on the
        # kernels' own routing (and normed x).
        route = dict(top_k=kw["top_k"], topk_method=method, n_group=kw.get("n_group"), topk_group=kw.get("topk_group"),
                     norm_topk_prob=kw["norm_topk_prob"], routed_scaling_factor=kw["routed_scaling_factor"],
                     score_bias=kw.get("score_bias"))
        weights, ids, x = jax.jit(lambda x, r, n: md._route(x, r, route, "cuda", n))(args["x"], args["router"],
                                                                                     kw.get("norm"))
        experts = dict(shared=kw.get("shared"), residual=kw.get("residual"))
        w = (args["w_gate"], args["w_up"], args["w_down"])
        ref_routed = reference.moe_experts(x, weights, ids, *w, experts["residual"])
        if experts["shared"] is not None:
            sh = experts["shared"]
            ref_routed = reference.swiglu(x, sh["w_gate"], sh["w_up"], sh["w_down"], ref_routed)
        _close(got, ref_routed, s["dtype"], "moe_decode (on the kernels' routing)", s)


# ----------------------------------------------------------------------------- swiglu
@pytest.mark.parametrize("seed", range(8))
def test_swiglu(seed):
    rng = np.random.default_rng(4000 + seed)
    s = dict(dtype=DTYPES[seed % 2], m=int(rng.integers(1, 80)), d=_multiple(rng, 64, 1024, 64),
             f=_multiple(rng, 64, 2048, 64),
             variant=str(rng.choice(["tma", "gemv"])), residual=bool(rng.integers(2)))
    f = _arrays(rng, s["dtype"])
    x, wg, wu, wd = f(s["m"], s["d"], scale=1.0), f(s["d"], s["f"]), f(s["d"], s["f"]), f(s["f"], s["d"])
    res = f(s["m"], s["d"], scale=1.0) if s["residual"] else None
    config = jc.SwigluConfig(variant=s["variant"])
    got = jax.jit(lambda *a: jc.swiglu(*a, impl="cuda", config=config))(x, wg, wu, wd, res)
    want = reference.swiglu(x, wg, wu, wd, res)
    _close(got, want, s["dtype"], "swiglu", s)


# ----------------------------------------------------------------------------- decode_attention
@pytest.mark.parametrize("seed", range(8))
def test_decode_attention(seed):
    rng = np.random.default_rng(5000 + seed)
    s = dict(dtype=DTYPES[seed % 2], batch=int(rng.integers(1, 20)), hkv=int(rng.integers(1, 9)),
             group=int(rng.integers(1, 9)), dh=int(rng.choice([64, 80, 96, 128])), s_max=int(rng.integers(1, 5000)),
             splits=None if seed % 3 else int(rng.integers(1, 70)))
    f = _arrays(rng, s["dtype"])
    b, hkv, g, dh, n = s["batch"], s["hkv"], s["group"], s["dh"], s["s_max"]
    q, k, v = f(b, hkv, g, dh, scale=dh ** -0.5), f(b, hkv, n, dh, scale=1.0), f(b, hkv, n, dh, scale=1.0)
    lengths = _lengths(rng, b, n)
    config = None if s["splits"] is None else jc.DecodeAttentionConfig(splits=s["splits"])
    got = jax.jit(lambda *a: jc.decode_attention(*a, impl="cuda", config=config))(q, k, v, lengths)
    _close(got, reference.decode_attention(q, k, v, lengths), s["dtype"], "decode_attention", s)
