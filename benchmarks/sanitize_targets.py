"""Small runs of every CUDA kernel, for compute-sanitizer memcheck / racecheck.

benchmarks/gpu_check.sh runs this under both tools; shapes are small so the
sanitizers finish quickly, but cover every cluster size and both dtypes widths.
Results are compared bitwise with the CPU handler (same order of operations).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc


def _same_on_cpu(fn, x):
    gpu = np.asarray(jax.jit(fn)(x))
    cpu = np.asarray(jax.jit(fn)(jax.device_put(x, jax.devices("cpu")[0])))
    assert (gpu == cpu).all(), fn


def collectives(dtypes):
    key = jax.random.key(1)
    for dtype in dtypes:
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 16):  # 3, 5, 6, 7: the direct schedule
            x = (jax.random.normal(key, (2, n, 333), jnp.float32) / n).astype(dtype)
            for impl in ("dsmem", "global"):
                _same_on_cpu(lambda x: jc.cluster_reduce(x, "sum", impl=impl, all_blocks=True, repeat=3), x)
                _same_on_cpu(lambda x: jc.cluster_gather(x, impl=impl, all_blocks=True, repeat=3), x)
    print("collectives ok")


def attention_decode(head_dims=None, pipelines=None):
    """Every head dim and cluster size on a small GQA shape, both dataflows, vs the reference."""
    rng = np.random.default_rng(0)
    for dh, (hq, hkv) in ((64, (8, 2)), (80, (4, 4)), (96, (12, 1)), (128, (4, 2))):
        if head_dims is not None and dh not in head_dims:
            continue
        for n in (1, 2, 3, 4, 6, 8, 16):
            print("attention_decode dh", dh, "cluster", n, flush=True)  # which one, if it dies
            f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)  # noqa: E731
            args = dict(x=f(3, 256), w_qkv=f(256, (hq + 2 * hkv) * dh, sc=1 / 16),
                        w_o=f(hq * dh, 256, sc=0.05), k_cache=f(3, hkv, 50, dh), v_cache=f(3, hkv, 50, dh),
                        lengths=jnp.asarray([0, 49, 17], jnp.int32),
                        inv_freq=jnp.asarray(1e4 ** (-np.arange(0, dh, 2) / dh), jnp.float32))
            kw = dict(num_q_heads=hq, num_kv_heads=hkv, norm="rms", norm_weight=f(256))
            # fewer heads per cluster on the GQA shapes: several clusters per KV head
            ref = jc.reference.attention_decode(**args, **kw)[0]
            # "tiled": the batch-tiled kernel, 2 rows per cluster (batch 3: a partial tile)
            pipes = pipelines or ("registers", "tma", "tiled")
            runs = [("split_token", p, 1) for p in pipes if p != "tiled"]
            if "tiled" in pipes and n & (n - 1) == 0:  # batch tiles: power-of-two clusters
                runs.append(("split_token", "registers", 2))
            if dh % (8 * n) == 0 and n & (n - 1) == 0:  # SplitHead: powers of two
                runs.append(("split_head", None, 1))
            for dataflow, pipeline, rows in runs:
                y = jc.attention_decode(**args, **kw, cluster_size=n, impl="kernel", dataflow=dataflow,
                                        pipeline=pipeline, rows_per_cluster=rows,
                                        heads_per_cluster=2 if hq // hkv >= 4 and n == 4 else None)[0]
                err = np.linalg.norm(np.asarray(y, np.float32) - np.asarray(ref, np.float32)) / np.linalg.norm(np.asarray(ref, np.float32))
                assert err < 1e-2, (dh, n, dataflow, pipeline, rows, err)
    print("attention_decode ok")


def swiglu(dtypes, shapes=((320, 512), (1024, 192)), variants=None):
    """Every swiglu kernel path on small shapes: split (cluster sizes 1..16, 64-column
    down tail), up stage alone, fused (cluster sizes, exchange group widths, one and
    several clusters, several passes), stream-K (tiles split over blocks, more blocks than
    units, several row groups; mma.sync and wgmma consumers), gemv (K split or not; M = 33 runs 16-row chunks on tensor cores, 8-row chunks on
    CUDA cores), residual;
    vs the jnp reference."""
    rng = np.random.default_rng(0)
    specs = ["split:nu=1:nd=1", "split:nu=4:nd=16", "split_row:nu=2:nd=2", "fused:n=1:c=1",
             "fused:n=2:g=1", "fused:n=4:g=2:c=3", "fused:n=16:g=2", "fused_row:n=8:g=3",
             "stream:c=7", "stream:rt=1:c=300", "gemv", "gemv:ku=1:kd=1", "gemv:ku=5:kd=3", "gemv:p=0",
             "gemv:mma=0", "gemv:mma=0:ku=5:kd=3",
             "tma", "tma:c=7", "tma:rt=1:c=300:p=0", "tma:rt=4:c=5", "tma:wg=1", "tma:wg=1:c=5:p=0"]
    if variants is not None:  # e.g. ["gemv"]: only specs of these variants
        specs = [s for s in specs if s.split(":")[0] in variants]
    for dtype in dtypes:
        for d, f in shapes:
            f_ = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
            wg, wu, wd = f_(d, f, sc=d ** -0.5), f_(d, f, sc=d ** -0.5), f_(f, d, sc=f ** -0.5)
            for m in (1, 33):
                x, res = f_(m, d), f_(m, d)
                for spec in specs:
                    print("swiglu", spec, jnp.dtype(dtype).name, d, f, m, flush=True)  # which one, if it dies
                    for down in (True, False):
                        if not down and spec.startswith("fused"):
                            continue
                        args = (x, wg, wu, wd, res) if down else (x, wg, wu)
                        y = jax.jit(lambda *a: jc.swiglu(*a, variant=spec))(*args)
                        ref = jc.reference.swiglu(*args)
                        err = np.linalg.norm(np.asarray(y, np.float32) - np.asarray(ref, np.float32)) / np.linalg.norm(np.asarray(ref, np.float32))
                        assert err < 1e-2, (spec, d, f, m, down, err)
    print("swiglu ok")


def linear(dtypes, splitk=True):
    """The linear projection on the cluster grid (N = 1344: 6 tiles in clusters of 8, the
    last one partial) and the stream-K grid (7 blocks: whole and split tiles, summed through
    the workspace; M = 70: two row groups), residual, fp32 output; then (splitk)
    attention_decode's splitk step with its projections on it, vs the jnp reference.
    racecheck runs without the splitk step: its attention kernel under the tool inside JAX
    hit the tool's "failed to handle a hardware exception" (session 24), as
    attention_decode's kernels do (benchmarks/gpu_check.sh)."""
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        f = lambda *s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
        for k, n in ((320, 192), (512, 1344)):
            w = f(k, n, sc=k ** -0.5)
            for m in (1, 33, 70):
                a, res = f(m, k), f(m, n)
                for blocks in (None, 7):
                    print("linear", jnp.dtype(dtype).name, k, n, m, blocks, flush=True)
                    for r, out in ((res, None), (None, jnp.float32)):
                        y = jax.jit(lambda a, w, r: jc.linear(a, w, r, out_dtype=out, max_blocks=blocks))(a, w, r)
                        ref = jc.reference.linear(a, w, r, out)
                        err = np.linalg.norm(np.asarray(y, np.float32) - np.asarray(ref, np.float32)) / np.linalg.norm(np.asarray(ref, np.float32))
                        assert err < 1e-2, (k, n, m, blocks, err)
        if not splitk:
            continue
        from jax_cluster.ops.attention_decode_xla import attention_decode_splitk
        hq, hkv, dh = 8, 2, 64
        args = dict(x=f(3, 512), w_qkv=f(512, (hq + 2 * hkv) * dh, sc=1 / 22), w_o=f(hq * dh, 512, sc=0.05),
                    k_cache=f(3, hkv, 50, dh), v_cache=f(3, hkv, 50, dh), lengths=jnp.asarray([0, 49, 17], jnp.int32),
                    inv_freq=jnp.asarray(1e4 ** (-np.arange(0, dh, 2) / dh), jnp.float32))
        kw = dict(num_q_heads=hq, num_kv_heads=hkv, norm="rms", norm_weight=f(512))
        extra = dict(norm_bias=None, eps=1e-6, qkv_bias=None, o_bias=None, residual=True,
                     rotary_dim=dh, rope_layout="half", scale=dh ** -0.5)
        y = attention_decode_splitk(**args, **kw, **extra, projections="linear")[0]
        ref = jc.reference.attention_decode(**args, **kw, residual=True)[0]
        err = np.linalg.norm(np.asarray(y, np.float32) - np.asarray(ref, np.float32)) / np.linalg.norm(np.asarray(ref, np.float32))
        assert err < 1e-2, ("splitk", err)
    print("linear ok")


def flash_attention(dtypes=(jnp.float16, jnp.bfloat16), cuda_kernel="auto"):
    """Both head dims, ragged / empty query and KV chunks (tile remainders), incoming states,
    state and finalized outputs, vs the jnp reference."""
    rng = np.random.default_rng(0)
    for dtype in dtypes:
        for dh in (64, 128):
            f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
            qs = [f(2, n, 2, dh) for n in (130, 0, 7)]
            kvs = [(f(2, n, 2, dh), f(2, n, 2, dh)) for n in (65, 0, 3)]
            states = [jc.reference.flash_attention([qs[0]], [(f(2, 9, 2, dh), f(2, 9, 2, dh))])[0], None, None]
            for finalize in (False, True):
                out = jc.flash_attention(qs, kvs, states, finalize=finalize, impl="kernel",
                                         cuda_kernel=cuda_kernel)
                ref = jc.reference.flash_attention(qs, kvs, states, finalize=finalize)
                for a, r in zip(out, ref):
                    a, r = (a, r) if finalize else (a[0], r[0])
                    if a.size:
                        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
                        err = np.linalg.norm(a - r) / np.linalg.norm(r)
                        assert err < 1e-2, (dtype, dh, finalize, err)
    print("flash_attention ok")


if __name__ == "__main__":
    quick = "--quick" in sys.argv  # racecheck is slow: one dtype of each width
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
    wanted = lambda name: only is None or name in only  # noqa: E731
    # --variants=gemv,stream: swiglu's specs of these variants only
    variants = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--variants=")), None)
    if wanted("collectives"):
        collectives((jnp.float32, jnp.bfloat16) if quick else (jnp.float32, jnp.float16, jnp.bfloat16))
    if wanted("attention_decode"):  # --head-dims=64,128: a subset (racecheck died on the whole)
        dims = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--head-dims=")), None)
        pipes = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--pipelines=")), None)
        attention_decode(None if dims is None else [int(v) for v in dims.split(",")], pipes)
    if wanted("swiglu"):
        if quick:
            swiglu((jnp.bfloat16,), shapes=((320, 512),), variants=variants)
        else:
            swiglu((jnp.float16, jnp.bfloat16), variants=variants)
    if wanted("linear"):
        linear((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16), splitk=not quick)
    if wanted("flash_attention"):  # --flash-kernel=mma|wgmma|...: one of its CUDA kernels
        kern = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--flash-kernel=")), "auto")
        flash_attention((jnp.bfloat16,) if quick else (jnp.float16, jnp.bfloat16), kern)
