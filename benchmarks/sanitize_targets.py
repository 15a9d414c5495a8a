"""Small runs of every CUDA kernel, for compute-sanitizer memcheck / racecheck.

benchmarks/gpu_check.sh runs this under both tools; shapes are small so the
sanitizers finish quickly, but cover every cluster size and both dtype widths. Each
result is checked: the collectives bitwise against the CPU handler (same order of
operations), the other ops against the jnp reference.

    python3 benchmarks/sanitize_targets.py [--quick] [--only=collectives,attention_block,moe_decode,moe_route,mla_decode,...]
        [--head-dims=64,128] [--pipelines=registers,tma] [--dataflows=split_token,split_head]
        [--variants=gemv,tma] [--flash-kernel=mma|wgmma]
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc


def _same_on_cpu(fn, x):
    gpu = np.asarray(jax.jit(fn)(x))
    cpu = np.asarray(jax.jit(fn)(jax.device_put(x, jax.devices("cpu")[0])))
    assert (gpu == cpu).all(), fn


def _rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def collectives(dtypes):
    key = jax.random.key(1)
    for dtype in dtypes:
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 16):  # 3, 5, 6, 7: the direct schedule
            x = (jax.random.normal(key, (2, n, 333), jnp.float32) / n).astype(dtype)
            for exchange in ("dsmem", "global"):
                config = jc.ClusterCollectiveConfig(exchange=exchange, repeat=3)
                _same_on_cpu(lambda x: jc.cluster_reduce(x, "sum", all_blocks=True, impl="cuda", config=config), x)
                _same_on_cpu(lambda x: jc.cluster_gather(x, all_blocks=True, impl="cuda", config=config), x)
    print("collectives ok")


def attention_block(head_dims=None, pipelines=None, dataflows=None):
    """Every head dim and cluster size on small GQA / MHA / MQA shapes (ragged lengths), both
    dataflows and both SplitToken pipelines, vs the reference."""
    rng = np.random.default_rng(0)
    pipelines = pipelines or ("registers", "tma")
    dataflows = dataflows or ("split_token", "split_head")
    for dh, (hq, hkv) in ((64, (8, 2)), (80, (4, 4)), (96, (12, 1)), (128, (4, 2))):
        if head_dims is not None and dh not in head_dims:
            continue
        for n in (1, 2, 3, 4, 6, 8, 16):
            print("attention_block dh", dh, "cluster", n, flush=True)  # which one, if it dies
            f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)  # noqa: E731
            args = dict(x=f(3, 256), w_qkv=f(256, (hq + 2 * hkv) * dh, sc=1 / 16),
                        w_o=f(hq * dh, 256, sc=0.05), k_cache=f(3, hkv, 50, dh), v_cache=f(3, hkv, 50, dh),
                        lengths=jnp.asarray([0, 49, 17], jnp.int32),
                        inv_freq=jnp.asarray(1e4 ** (-np.arange(0, dh, 2) / dh), jnp.float32))
            kw = dict(num_q_heads=hq, num_kv_heads=hkv, norm="rms", norm_weight=f(256))
            ref = jc.reference.attention_block(**args, **kw)[0]
            # fewer heads per cluster on the GQA shapes: several clusters per KV head
            heads = 2 if hq // hkv >= 4 and n == 4 else None
            configs = []
            if "split_token" in dataflows:
                configs += [jc.AttentionBlockConfig(cluster_size=n, heads_per_cluster=heads, pipeline=p)
                            for p in pipelines]
            if "split_head" in dataflows and dh % (8 * n) == 0 and n & (n - 1) == 0:  # powers of two
                configs.append(jc.AttentionBlockConfig(cluster_size=n, heads_per_cluster=heads,
                                                       dataflow="split_head"))
            for config in configs:
                y = jc.attention_block(**args, **kw, impl="cuda", config=config)[0]
                err = _rel_err(y, ref)
                assert err < 1e-2, (dh, config, err)
    print("attention_block ok")


def decode_attention(dtypes):
    """decode_attention and decode_attention_append on both kernels (tensor cores for G >= 2,
    CUDA cores for MHA; at head_dim 256 the lean tensor-core form), every head dim, one split
    (no merge kernel) and several, ragged lengths, vs the jnp reference."""
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
        for dh, hkv, g in ((64, 2, 8), (80, 2, 3), (96, 1, 4), (128, 2, 1), (256, 2, 1), (256, 1, 8)):
            kc, vc = f(3, hkv, 300, dh), f(3, hkv, 300, dh)
            lengths = jnp.asarray([0, 299, 117], jnp.int32)
            q = f(3, hkv, g, dh, sc=dh ** -0.5)
            qkv = jnp.asarray(rng.standard_normal((3, (hkv * g + 2 * hkv) * dh)), jnp.float32)
            inv_freq = jnp.asarray(1e4 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
            for splits in (1, 5):
                print("decode_attention", jnp.dtype(dtype).name, dh, hkv, g, splits, flush=True)
                config = jc.DecodeAttentionConfig(splits=splits)
                out = jc.decode_attention(q, kc, vc, lengths, impl="cuda", config=config)
                err = _rel_err(out, jc.reference.decode_attention(q, kc, vc, lengths))
                assert err < 1e-2, ("decode_attention", dh, g, splits, err)
                kw = dict(num_q_heads=hkv * g, scale=dh ** -0.5)
                got = jc.decode_attention_append(qkv, kc, vc, lengths, inv_freq, **kw, impl="cuda",
                                                 config=config)
                ref = jc.reference.decode_attention_append(qkv, kc, vc, lengths, inv_freq, **kw)
                for a, r in zip(got, ref):
                    err = _rel_err(a, r)
                    assert err < 1e-2, ("decode_attention_append", dh, g, splits, err)
    print("decode_attention ok")


def _swiglu_configs():
    """Every swiglu kernel path: gemv (K split or not, PDL off), fused (cluster sizes,
    exchange group widths, one and several clusters), tma (tiles split over blocks, more
    blocks than units, row tiles, PDL off)."""
    c = jc.SwigluConfig
    return [c(variant="gemv"), c(variant="gemv", k_splits_up=1, k_splits_down=1),
            c(variant="gemv", k_splits_up=5, k_splits_down=3), c(variant="gemv", pdl=False),
            c(variant="fused", cluster_size=1, clusters=1), c(variant="fused", cluster_size=2, f_group=1),
            c(variant="fused", cluster_size=4, f_group=2, clusters=3), c(variant="fused", cluster_size=16, f_group=2),
            c(), c(blocks=7), c(row_tiles=1, blocks=300, pdl=False), c(row_tiles=4, blocks=5)]


def swiglu(dtypes, shapes=((320, 512), (1024, 192)), variants=None):
    """Every swiglu configuration of _swiglu_configs on small shapes, with and without the
    down GEMM (the up stage alone), M = 1 and 33 (the gemv kernels run 16-row chunks; the
    tma kernels two row groups), residual; vs the jnp reference."""
    rng = np.random.default_rng(0)
    configs = [c for c in _swiglu_configs() if variants is None or c.variant in variants]
    for dtype in dtypes:
        for d, f in shapes:
            f_ = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
            wg, wu, wd = f_(d, f, sc=d ** -0.5), f_(d, f, sc=d ** -0.5), f_(f, d, sc=f ** -0.5)
            for m in (1, 33):
                x, res = f_(m, d), f_(m, d)
                for config in configs:
                    print("swiglu", config, jnp.dtype(dtype).name, d, f, m, flush=True)  # which one, if it dies
                    for down in (True, False):
                        if not down and config.variant == "fused":
                            continue
                        args = (x, wg, wu, wd, res) if down else (x, wg, wu)
                        y = jax.jit(lambda *a: jc.swiglu(*a, impl="cuda", config=config))(*args)
                        err = _rel_err(y, jc.reference.swiglu(*args))
                        assert err < 1e-2, (config, d, f, m, down, err)
    print("swiglu ok")


def linear(dtypes):
    """The linear projection on the cluster grid (N = 1344: 6 tiles in clusters of 8, the
    last one partial) and the stream-K grid (7 blocks: whole and split tiles, summed through
    the workspace; M = 70: two row groups), residual, fp32 output, vs the jnp reference."""
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
        for k, n in ((320, 192), (512, 1344)):
            w = f(k, n, sc=k ** -0.5)
            for m in (1, 33, 70):
                a, res = f(m, k), f(m, n)
                for blocks in (None, 7):
                    print("linear", jnp.dtype(dtype).name, k, n, m, blocks, flush=True)
                    config = jc.LinearConfig(max_blocks=blocks)
                    for r, out in ((res, None), (None, jnp.float32)):
                        y = jax.jit(lambda a, w, r: jc.linear(a, w, r, out_dtype=out, impl="cuda",
                                                              config=config))(a, w, r)
                        err = _rel_err(y, jc.reference.linear(a, w, r, out))
                        assert err < 1e-2, (k, n, m, blocks, err)
    print("linear ok")


def flash_attention(dtypes=(jnp.float16, jnp.bfloat16), kernel=None):
    """Both head dims, ragged / empty query and KV chunks (tile remainders), incoming states,
    state and finalized outputs, vs the jnp reference. kernel: "mma", "wgmma" or None (the
    op's default)."""
    rng = np.random.default_rng(0)
    config = jc.FlashAttentionConfig(kernel=kernel) if kernel else None
    for dtype in dtypes:
        for dh in (64, 128):
            f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
            qs = [f(2, n, 2, dh) for n in (130, 0, 7)]
            kvs = [(f(2, n, 2, dh), f(2, n, 2, dh)) for n in (65, 0, 3)]
            states = [jc.reference.flash_attention([qs[0]], [(f(2, 9, 2, dh), f(2, 9, 2, dh))])[0], None, None]
            for finalize in (False, True):
                out = jc.flash_attention(qs, kvs, states, finalize=finalize, impl="cuda", config=config)
                ref = jc.reference.flash_attention(qs, kvs, states, finalize=finalize)
                for a, r in zip(out, ref):
                    a, r = (a, r) if finalize else (a[0], r[0])
                    if a.size:
                        err = _rel_err(a, r)
                        assert err < 1e-2, (dtype, dh, finalize, err)
    print("flash_attention ok")


def moe_decode(dtypes):
    """The MoE decode kernels: one pass per expert (N = 1, 3) and several (N = 70 rows over
    4 experts), every column tile, tile remainders (I = 72, H = 136), duplicate ids, an
    invalid id (a NaN row, nothing read or written for it), PDL off, shared experts in
    chunks; vs the jnp reference."""
    from jax_cluster.ops.moe_decode import moe_experts

    rng = np.random.default_rng(0)
    for dtype in dtypes:
        f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
        h, i, e = 136, 72, 4
        wg, wu, wd = f(e, h, i, sc=h ** -0.5), f(e, h, i, sc=h ** -0.5), f(e, i, h, sc=i ** -0.5)
        for n in (1, 3, 70):
            x, res = f(n, h), f(n, h)
            ids = jnp.asarray(rng.integers(0, e, (n, 3)), jnp.int32).at[0, 1].set(e)  # row 0 invalid
            weights = jnp.asarray(rng.random((n, 3)), jnp.float32)
            ref = np.asarray(jc.reference.moe_experts(x, weights, ids, wg, wu, wd, res))
            for cols in (32, 64, 128):
                config = jc.MoeDecodeConfig(cols_up=cols, cols_down={32: 128, 64: 64, 128: 32}[cols],
                                            pdl=cols != 32)
                print("moe_decode", jnp.dtype(dtype).name, n, config, flush=True)
                y = np.asarray(jax.jit(lambda *a: moe_experts(*a, impl="cuda", config=config))(
                    x, weights, ids, wg, wu, wd, res))
                assert np.isnan(y[0]).all(), (n, config)
                if n > 1:
                    err = _rel_err(y[1:], ref[1:])
                    assert err < 1e-2, (n, config, err)
        # the whole layer: router, the shared experts as 3 chunks of I (72, 72, 56) in the kernels
        router = f(h, e, sc=h ** -0.5)
        shared = dict(w_gate=f(h, 200, sc=h ** -0.5), w_up=f(h, 200, sc=h ** -0.5), w_down=f(200, h, sc=200 ** -0.5))
        # (the shared experts run in the call up to 8 rows; past that they leave it for swiglu)
        for n in (1, 8):
            x = f(n, h)
            print("moe_decode shared", jnp.dtype(dtype).name, n, flush=True)
            ref = np.asarray(jc.reference.moe_decode(x, router, wg, wu, wd, top_k=2, shared=shared, residual=x))
            y = np.asarray(jax.jit(lambda x, *w: jc.moe_decode(x, *w, top_k=2, shared=shared, residual=x, impl="cuda"))(
                x, router, wg, wu, wd))
            err = _rel_err(y, ref)
            assert err < 1e-2, (n, err)
    print("moe_decode ok")


def moe_route(dtypes):
    """The router kernels: DeepSeek-V3's shapes (H 7168, E 256: 64 K chunks) and V2-Lite's
    (H 2048, E 64, float32 router); V3's noaux_tc and
    V2's greedy, 1 and 8 rows, with and without the RMSNorm in them, vs the jnp reference.
    Its own target: in one process after moe_decode's cases, compute-sanitizer (2025.3.1,
    H200) crashed or hung, while each part alone is clean under memcheck (racecheck:
    benchmarks/probes/moe_route_kernel.cu)."""
    from jax_cluster.ops import moe_decode as moe_decode_ops

    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for h, e, rdtype in ((7168, 256, dtype), (2048, 64, jnp.float32)):
            x = jnp.asarray(rng.standard_normal((8, h)), dtype)
            router = jnp.asarray(rng.standard_normal((h, e)) * h ** -0.5, rdtype)
            bias = jnp.asarray(rng.standard_normal(e) * 0.5, jnp.float32)
            norm_w = jnp.asarray(1 + rng.standard_normal(h) * 0.5, dtype)
            for route in (dict(top_k=8, topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                               routed_scaling_factor=2.5, score_bias=bias),
                          dict(top_k=6, topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
                               routed_scaling_factor=1.0)):
                for n, norm in ((1, None), (8, None), (8, norm_w)):
                    print("moe_route", h, e, route["topk_method"], jnp.dtype(dtype).name, n,
                          "norm" if norm is not None else "", flush=True)
                    w, ids, hn = jax.jit(lambda x, r, g, route=route: moe_decode_ops._route(x, r, route, "cuda", g))(
                        x[:n], router, norm)
                    if norm is not None:
                        assert _rel_err(hn, moe_decode_ops._rms_norm(x[:n], norm, 1e-6)) < 1e-2, (h, n)
                    rw, rids = jc.reference.moe_route(hn, router, **route)
                    assert (np.asarray(ids) == np.asarray(rids)).all(), (h, route["topk_method"], n)
                    assert _rel_err(w, rw) < 1e-4, (h, route["topk_method"], n)
    print("moe_route ok")


def mla_decode(dtypes):
    """The whole mla_decode step on its kernels (mla_project, the split and merge kernels,
    mla_output) through JAX: V2-Lite's attention widths (16 heads, r 512, dr 64) on a narrow
    hidden size, batch 1 and 3, one and several token splits, contiguous and paged (64-token
    pages, shuffled); vs the fp32 reference."""
    rng = np.random.default_rng(0)
    heads, rank, nope, rope, v, hidden = 16, 512, 128, 64, 128, 256
    for dtype in dtypes:
        f = lambda *s, sc=None, off=0.0: jnp.asarray(  # noqa: E731
            rng.standard_normal(s) * (s[0] ** -0.5 if sc is None else sc) + off, dtype)
        w = dict(norm=f(hidden, sc=0.2, off=1.0), q=f(hidden, heads * (nope + rope)), kv_a=f(hidden, rank + rope),
                 kv_a_norm=f(rank, sc=0.2, off=1.0), kv_b=f(rank, heads * (nope + v)), o=f(heads * v, hidden))
        inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rope, 2) / rope), jnp.float32)
        kw = dict(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
                  scale=(nope + rope) ** -0.5, eps=1e-6, residual=True)
        for batch, s_max, splits in ((1, 320, 1), (1, 320, 4), (3, 200, 3)):
            x, cache = f(batch, hidden, sc=1.0), f(batch, s_max, rank + rope, sc=1.0)
            lengths = jnp.asarray(rng.integers(s_max // 2, s_max, batch), jnp.int32)
            ref_y, ref_c = jc.mla_decode(x, w, cache, lengths, inv_freq, impl="reference", **kw)
            config = jc.MlaDecodeConfig(splits=splits, projections="kernels")
            for paged in (False, True):
                if paged:  # 64-token pages, the pool shuffled
                    blocks = -(-s_max // 64)
                    table = jnp.asarray(rng.permutation(batch * blocks).reshape(batch, blocks), jnp.int32)
                    padded = jnp.pad(cache, ((0, 0), (0, blocks * 64 - s_max), (0, 0)))
                    pool = jnp.zeros((batch * blocks, 64, rank + rope), dtype).at[table.reshape(-1)].set(
                        padded.reshape(batch * blocks, 64, rank + rope))
                    args, extra = (x, w, pool, lengths, inv_freq), dict(block_table=table)
                else:
                    args, extra = (x, w, cache, lengths, inv_freq), {}
                print("mla_decode", jnp.dtype(dtype).name, batch, s_max, splits, "paged" if paged else "", flush=True)
                y, c = jax.jit(functools.partial(jc.mla_decode, impl="cuda", config=config, **kw, **extra))(*args)
                err = _rel_err(y, ref_y)
                assert err < 2e-2, (batch, splits, paged, err)
                if not paged:  # the step's latent token written at lengths[b], nothing else touched
                    assert _rel_err(c, ref_c) < 2e-2, (batch, splits)
    print("mla_decode ok")


def decoder_layer(dtypes):
    """The one-launch layer kernel: Llama (GQA 4, SwiGLU in paired tiles) and GPT-NeoX (MHA,
    parallel and sequential residual, biases, partial rotary; head_dim 256), batch 1 and 3, one
    and several token splits (48 and 600 cache slots), widths off the 64-column tiles; vs the
    fp32 reference."""
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        f = lambda *s, sc=None: jnp.asarray(rng.standard_normal(s) * (s[0] ** -0.5 if sc is None else sc), dtype)  # noqa: E731
        for family, extra, dh in (("llama", {}, 64), ("gpt_neox", dict(parallel_residual=True), 80),
                                  ("gpt_neox", dict(parallel_residual=False), 80), ("llama", {}, 256)):
            hq, hkv, d, ff = (8, 2, 200, 328) if family == "llama" else (4, 4, 240, 456)
            cols = (hq + 2 * hkv) * dh
            w = dict(norm=f(d, sc=0.1) + 1, qkv=f(d, cols), o=f(hq * dh, d), post_norm=f(d, sc=0.1) + 1)
            if family == "llama":
                w.update(w_gate=f(d, ff), w_up=f(d, ff), w_down=f(ff, d))
            else:
                w.update(norm_bias=f(d, sc=0.1), post_norm_bias=f(d, sc=0.1), qkv_bias=f(cols, sc=0.1),
                         o_bias=f(d, sc=0.1), w_in=f(d, ff), b_in=f(ff, sc=0.1), w_out=f(ff, d), b_out=f(d, sc=0.1))
            rot = dh if family == "llama" else 20
            inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rot, 2) / rot), jnp.float32)
            for batch, s_max in ((1, 48), (3, 600)):
                x = f(batch, d, sc=1.0)
                kc, vc = f(batch, hkv, s_max, dh, sc=1.0), f(batch, hkv, s_max, dh, sc=1.0)
                lengths = jnp.asarray(rng.integers(0, s_max, batch), jnp.int32)
                kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rot, **extra)
                print("decoder_layer", jnp.dtype(dtype).name, family, extra, dh, batch, s_max, flush=True)
                y = jax.jit(functools.partial(jc.decoder_layer, impl="cuda", **kw))(x, w, kc, vc, lengths, inv_freq)[0]
                ref = jc.decoder_layer(x, w, kc, vc, lengths, inv_freq, impl="reference", **kw)[0]
                err = _rel_err(y, ref)
                assert err < 1e-2, (family, dh, batch, s_max, err)
    print("decoder_layer ok")


def _option(name, default=None):
    """--name=a,b -> ["a", "b"] (default when absent)."""
    value = next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), None)
    return default if value is None else value.split(",")


if __name__ == "__main__":
    quick = "--quick" in sys.argv  # racecheck is slow: one dtype of each width
    only = _option("only")
    wanted = lambda name: only is None or name in only  # noqa: E731
    if wanted("collectives"):
        collectives((jnp.float32, jnp.bfloat16) if quick else (jnp.float32, jnp.float16, jnp.bfloat16))
    if wanted("attention_block"):  # --head-dims=64,128: a subset (a shorter run under the tools)
        dims = _option("head-dims")
        attention_block(None if dims is None else [int(v) for v in dims], _option("pipelines"),
                        _option("dataflows"))
    if wanted("decode_attention"):
        decode_attention((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("swiglu"):  # --variants=gemv,tma: those variants' configurations only
        if quick:
            swiglu((jnp.bfloat16,), shapes=((320, 512),), variants=_option("variants"))
        else:
            swiglu((jnp.float16, jnp.bfloat16), variants=_option("variants"))
    if wanted("linear"):
        linear((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("moe_decode"):
        moe_decode((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("moe_route"):
        moe_route((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("mla_decode"):
        mla_decode((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("decoder_layer"):
        decoder_layer((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16))
    if wanted("flash_attention"):  # --flash-kernel=mma|wgmma: one of its CUDA kernels
        kernel = _option("flash-kernel", [None])[0]
        flash_attention((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16), kernel)
