"""flash_attention's CUDA kernels side by side, in one run: the wgmma kernel and the mma.sync
kernel, with cuDNN as the peer.

1. check: each kernel on ragged chunks (tile remainders, several KV chunks, an incoming
   state) against a float64 numpy reference, twice (bitwise equal: no race), NaN-free;
2. time: TFLOP/s on DiT shapes (batch 1, Lq = Lk = L), one chunk and 4 Q x 4 KV chunks,
   ratio to cuDNN and relative error against it.
Prints a table last. The development loop of the Hopper kernel: one device call checks and
times every kernel.

Run: python benchmarks/flash_attention_kernels.py [--lengths 16384] [--models flux,cogvideox]
     [--dtypes bfloat16] [--kernels wgmma,mma] [--no-check]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from jax_cluster.ops.attention_state import State
from common import dtype_tag, loop, random_normal, time_fn
from flash_attention import MODELS, attention_flops, cudnn, rel_err, split

KERNELS = ("wgmma", "mma")


def reference(qs, kvs, state, scale):
    """float64 numpy: per query chunk (o, lse) over every key, merged with `state`."""
    k = np.concatenate([np.asarray(k, np.float64) for k, _ in kvs], 1)
    v = np.concatenate([np.asarray(v, np.float64) for _, v in kvs], 1)
    out = []
    for i, q in enumerate(qs):
        s = np.einsum("blhd,bmhd->bhlm", np.asarray(q, np.float64), k) * scale
        if i == 0 and state is not None:  # the incoming state of chunk 0 as one more "key"
            o0, lse0 = (np.asarray(x, np.float64) for x in state)
            s = np.concatenate([s, lse0[..., None]], -1)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(-1, keepdims=True)
        o = np.einsum("bhlm,bmhd->blhd", p[..., : k.shape[1]] / l, v)
        if i == 0 and state is not None:
            o = o + np.transpose(p[..., -1:] / l, (0, 2, 1, 3)) * o0
        out.append((o, (np.log(l) + m)[..., 0]))
    return out


def check(kernels, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for dh in (64, 128):
        for dtype in (jnp.bfloat16, jnp.float16):
            b, h = 2, 3
            f = lambda n: jnp.asarray(rng.standard_normal((b, n, h, dh)), dtype)  # noqa: E731
            qs = [f(n) for n in (1, 129, 0, 300)]
            kvs = [(f(n), f(n)) for n in (257, 0, 1, 700, 128)]
            st_o = jnp.asarray(rng.standard_normal((b, 1, h, dh)), jnp.float32)
            st_lse = jnp.asarray(rng.standard_normal((b, h, 1)) + 3.0, jnp.float32)
            scale = 1 / math.sqrt(dh)
            ref = reference(qs, kvs, (st_o, st_lse), scale)
            for kern in kernels:
                fn = jax.jit(lambda q, kv, st, kern=kern: jc.flash_attention(  # noqa: E731
                    q, kv, [State(*st), None, None, None], impl="cuda",
                    config=jc.FlashAttentionConfig(kernel=kern)))
                try:
                    out = jax.tree.map(np.asarray, fn(qs, kvs, (st_o, st_lse)))
                    again = jax.tree.map(np.asarray, fn(qs, kvs, (st_o, st_lse)))
                    same = all(np.array_equal(x, y, equal_nan=True)
                               for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(again)))
                    o_err = max(np.linalg.norm(o.astype(np.float64) - ro) / max(np.linalg.norm(ro), 1e-30)
                                for (o, _), (ro, _) in zip(out, ref) if o.size)
                    lse_err = max(np.abs(lse - rl).max() for (_, lse), (_, rl) in zip(out, ref) if lse.size)
                    nan = any(np.isnan(x).any() for x in jax.tree.leaves(out))
                    ok = same and not nan and o_err < (1e-2 if dtype == jnp.bfloat16 else 2e-3) and lse_err < 2e-2
                    rows.append((f"dh{dh} {dtype_tag(dtype)} {kern}", o_err, lse_err, same, nan, ok))
                except Exception as exc:  # noqa: BLE001
                    rows.append((f"dh{dh} {dtype_tag(dtype)} {kern}", None, None, None, None, False))
                    print(f"  {kern} dh{dh} failed: {type(exc).__name__}: {str(exc)[:300]}")
    print("check (ragged chunks + state vs float64):")
    for name, oe, le, same, nan, ok in rows:
        print(f"  {name:28s} o_err {oe if oe is None else f'{oe:.2e}'}  lse_err "
              f"{le if le is None else f'{le:.2e}'}  repeatable {same}  nan {nan}  {'OK' if ok else 'FAIL'}")
    return all(r[-1] for r in rows)


def time_case(model, length, dtype, kernels, key):
    heads, d = MODELS[model]
    kq, kk, kv = jax.random.split(key, 3)
    shape = (1, length, heads, d)
    q, k, v = (random_normal(x, shape, dtype) for x in (kq, kk, kv))
    flops = attention_flops(1, length, length, heads, d)
    calls = max(1, min(16, int(2e12 // flops)))
    res = {}

    def per_call(fn, x):
        try:
            return time_fn(loop(fn, calls), x) / calls
        except Exception as exc:  # noqa: BLE001
            print(f"    failed: {type(exc).__name__}: {str(exc)[:300]}")
            return None

    ref = jax.jit(cudnn)(q, k, v)
    for kern in kernels:
        one = lambda x, kern=kern: jc.flash_attention(x, [(k, v)], finalize=True, impl="cuda",  # noqa: E731
                                                      config=jc.FlashAttentionConfig(kernel=kern))
        t = per_call(one, q)
        err = rel_err(jax.jit(one)(q), ref) if t else None
        res[kern] = (t, err)
    qs, kvs = split(q, 4), list(zip(split(k, 4), split(v, 4)))
    chunked = lambda xs: jc.flash_attention(xs, kvs, finalize=True, impl="cuda",  # noqa: E731
                                            config=jc.FlashAttentionConfig(kernel=kernels[0]))
    res[kernels[0] + " 4x4"] = (per_call(chunked, qs), None)
    res["cudnn"] = (per_call(lambda x: cudnn(x, k, v), q), 0.0)
    return flops, res


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="16384", help="comma list; empty: check only")
    parser.add_argument("--models", default="flux,cogvideox")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    print(f"device {jax.devices()[0].device_kind}")
    ok = True if args.no_check else check(kernels)
    table = []
    key = jax.random.key(0)
    for model in args.models.split(","):
        for dtype in (jnp.dtype(t) for t in args.dtypes.split(",")):
            for length in (int(x) for x in args.lengths.split(",") if x):
                key, sub = jax.random.split(key)
                flops, res = time_case(model, length, dtype, kernels, sub)
                base = res["cudnn"][0]
                for name, (t, err) in res.items():
                    tf = flops / t / 1e12 if t else None
                    table.append((f"{model} l{length} {dtype_tag(dtype)}", name, t, tf,
                                  base / t if t and base else None, err))
    print(f"{'case':24s} {'kernel':22s} {'us':>9s} {'TFLOP/s':>8s} {'x cudnn':>8s} {'err':>9s}")
    for case, name, t, tf, ratio, err in table:
        fmt = lambda x, f: format(x, f) if x is not None else "n/a"  # noqa: E731
        print(f"{case:24s} {name:22s} {fmt(t and t * 1e6, '9.0f'):>9s} {fmt(tf, '8.0f'):>8s} "
              f"{fmt(ratio, '8.3f'):>8s} {fmt(err, '9.2e'):>9s}")
    print("CHECK", "OK" if ok else "FAILED")


if __name__ == "__main__":
    main()
