"""mla_decode (absorbed MLA over a latent cache) vs jnp, DeepSeek-V2-Lite shapes, one GPU run.

Rows per case (batch, context): ours = jax_cluster.mla_decode(impl="cuda") on a contiguous
latent cache and on a paged one (64-token pages, shuffled pool), and where its projections
run on the projection kernels by default, with them on XLA's dots instead (ours_xla_proj), and where
they run on XLA's dots but the kernels take the rows (up to 8), on the kernels (ours_kernel_proj); jnp_absorbed = the absorbed
formulation as flax_models writes it (flax_models.ops.mla_decode_xla); jnp_expanded = the
non-absorbed form that caches expanded keys and values per head ([B, H, S, dn + dr] and
[B, H, S, dv]: about 28x the latent cache's bytes). A call runs STEPS decode steps of LAYERS
layers, each with its own weights and cache (so weights do not stay in L2 as one layer's
would), written out in one jit with the state donated. floor = the bytes a step must read
(weights + latent cache + x, y) / the HBM bandwidth measured in the same run.
Run: python benchmarks/mla_decode.py [--quick] [--cases b1:4096 ...] [--dtype bf16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from flax_models.ops import mla_decode_xla
from jax_cluster.ops.mla_decode import DEFAULT_PROJECTION_ROWS, _constants
from common import dtype_tag, measure_bandwidth, time_donated, write_results

V2_LITE = dict(hidden=2048, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
CASES = ("b1:4096", "b1:32768", "b4:4096", "b8:4096", "b16:4096", "b64:4096")
STEPS, LAYERS, PAGE = 4, 4, 64
COLUMNS = ["case", "ours_us", "ours_paged_us", "ours_xla_proj_us", "ours_kernel_proj_us", "jnp_absorbed_us", "jnp_expanded_us", "floor_us", "ours_floor_fraction",
           "paged_floor_fraction", "speedup_vs_absorbed", "speedup_vs_expanded", "paged_vs_contiguous"]


def weights(key, dtype):
    d = V2_LITE
    h, nh, r, dn, dr, dv = (d[k] for k in ("hidden", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                                           "qk_rope_head_dim", "v_head_dim"))
    ks = jax.random.split(key, 4)
    f = lambda k, *s: (jax.random.normal(k, s, jnp.float32) * s[0] ** -0.5).astype(dtype)  # noqa: E731
    return dict(norm=jnp.ones((h,), dtype), q=f(ks[0], h, nh * (dn + dr)), kv_a=f(ks[1], h, r + dr),
                kv_a_norm=jnp.ones((r,), dtype), kv_b=f(ks[2], r, nh * (dn + dv)), o=f(ks[3], nh * dv, h))


def kwargs():
    d = V2_LITE
    return dict(num_heads=d["num_heads"], kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
                qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
                scale=(d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5, eps=1e-6, residual=True)


def expanded_step(x, w, kc, vc, lengths, inv_freq, *, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                  v_head_dim, scale, eps, residual):
    """Non-absorbed MLA decode: the new token's keys/values expanded per head and cached."""
    from flax_models.layers import dense, rms_norm
    from flax_models.rope import apply_rope, cos_sin
    from flax_models import attention as attn

    b = x.shape[0]
    nh, r, dn, dr, dv = num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    h = rms_norm(x, w["norm"], eps)
    q = dense(h, w["q"]).reshape(b, nh, dn + dr)
    kv = dense(h, w["kv_a"])
    c = rms_norm(kv[:, :r], w["kv_a_norm"], 1e-6)
    cos, sin = cos_sin(lengths, inv_freq)
    q_rope = apply_rope(q[..., dn:], cos[:, None], sin[:, None], "interleaved")
    k_rope = apply_rope(kv[:, None, r:], cos[:, None], sin[:, None], "interleaved")
    kvb = dense(c, w["kv_b"]).reshape(b, nh, dn + dv)
    k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope, (b, nh, dr))], -1)
    kc = attn.write_at(kc, k, lengths)
    vc = attn.write_at(vc, kvb[..., dn:], lengths)
    qf = jnp.concatenate([q[..., :dn], q_rope], -1)
    o = attn.decode_attention_core(qf, kc, vc, lengths, scale)
    y = dense(o.reshape(b, nh * dv), w["o"]) + x
    return y.astype(x.dtype), kc, vc


def timed(step, state, ws, lengths, inv_freq):
    """Microseconds per layer step: STEPS x LAYERS calls written out in one jit, state donated."""

    def run(s, ws):
        x, caches = s
        for _ in range(STEPS):
            new = []
            for w, c in zip(ws, caches):
                x, c = step(x, w, c, lengths, inv_freq)
                new.append(c)
            caches = tuple(new)
        return x, caches

    return time_donated(run, state, ws) / (STEPS * LAYERS) * 1e6


def bench_case(batch, ctx, dtype, bandwidth, rng):
    d, kw = V2_LITE, kwargs()
    e = d["kv_lora_rank"] + d["qk_rope_head_dim"]
    key = jax.random.key(0)
    ws = tuple(weights(k, dtype) for k in jax.random.split(key, LAYERS))
    lengths = jnp.full((batch,), ctx - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, d["qk_rope_head_dim"], 2) / d["qk_rope_head_dim"]), jnp.float32)
    x0 = rng.standard_normal((batch, d["hidden"]))
    fresh_x = lambda: jnp.asarray(x0, dtype)  # noqa: E731  (each timed state is donated)
    lat = lambda: tuple(jnp.asarray(rng.standard_normal((batch, ctx, e)) * 0.5, dtype) for _ in range(LAYERS))  # noqa: E731
    out = {}

    def ours(x, w, c, n, f):
        return jc.mla_decode(x, w, c, n, f, impl="cuda", **kw)

    out["ours_us"] = timed(ours, (fresh_x(), lat()), ws, lengths, inv_freq)
    pages_per_row = -(-ctx // PAGE)
    perm = rng.permutation(batch * pages_per_row).astype(np.int32)
    table = jnp.asarray(perm.reshape(batch, pages_per_row))
    pools = tuple(c.reshape(batch * pages_per_row, PAGE, e)[jnp.argsort(jnp.asarray(perm))] for c in lat())

    def ours_paged(x, w, c, n, f):
        return jc.mla_decode(x, w, c, n, f, impl="cuda", block_table=table, **kw)

    out["ours_paged_us"] = timed(ours_paged, (fresh_x(), pools), ws, lengths, inv_freq)
    if batch <= DEFAULT_PROJECTION_ROWS:  # the projection kernels run by default: the same call on XLA's dots

        def ours_xla_proj(x, w, c, n, f):
            return jc.mla_decode(x, w, c, n, f, impl="cuda", config=jc.MlaDecodeConfig(projections="xla"), **kw)

        out["ours_xla_proj_us"] = timed(ours_xla_proj, (fresh_x(), lat()), ws, lengths, inv_freq)
    elif batch <= _constants()["projection_max_rows"]:  # XLA's dots by default: the same call on the kernels

        def ours_kernel_proj(x, w, c, n, f):
            return jc.mla_decode(x, w, c, n, f, impl="cuda", config=jc.MlaDecodeConfig(projections="kernels"), **kw)

        out["ours_kernel_proj_us"] = timed(ours_kernel_proj, (fresh_x(), lat()), ws, lengths, inv_freq)

    def absorbed(x, w, c, n, f):
        return mla_decode_xla(x, w, c, n, f, **kw)

    out["jnp_absorbed_us"] = timed(absorbed, (fresh_x(), tuple(c[:, None] for c in lat())), ws, lengths, inv_freq)
    if batch * ctx <= 16 * 4096:  # the expanded caches of b64 x 4096 are 2.7 GB per layer
        nh = d["num_heads"]
        kv = tuple((jnp.zeros((batch, nh, ctx, d["qk_nope_head_dim"] + d["qk_rope_head_dim"]), dtype),
                    jnp.zeros((batch, nh, ctx, d["v_head_dim"]), dtype)) for _ in range(LAYERS))

        def expanded(x, w, c, n, f):
            y, kc, vc = expanded_step(x, w, c[0], c[1], n, f, **kw)
            return y, (kc, vc)

        out["jnp_expanded_us"] = timed(expanded, (fresh_x(), kv), ws, lengths, inv_freq)
    w_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in ws[0].values())
    nbytes = w_bytes + batch * ctx * e * 2 + 2 * batch * d["hidden"] * 2
    floor = nbytes / bandwidth * 1e6
    row = {"case": f"v2-lite_b{batch}_ctx{ctx}_{dtype_tag(dtype)}", **{k: round(v, 2) for k, v in out.items()},
           "floor_us": round(floor, 2), "ours_floor_fraction": round(floor / out["ours_us"], 3),
           "paged_floor_fraction": round(floor / out["ours_paged_us"], 3),
           "speedup_vs_absorbed": round(out["jnp_absorbed_us"] / out["ours_us"], 3),
           "paged_vs_contiguous": round(out["ours_us"] / out["ours_paged_us"], 3)}
    if "jnp_expanded_us" in out:
        row["speedup_vs_expanded"] = round(out["jnp_expanded_us"] / out["ours_us"], 3)
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--quick", action="store_true", help="b1:4096 only")
    ap.add_argument("--part", default=None)
    a = ap.parse_args()
    dtype = jnp.bfloat16 if a.dtype == "bf16" else jnp.float16
    cases = ["b1:4096"] if a.quick else a.cases
    bandwidth = measure_bandwidth()
    rng = np.random.default_rng(0)
    rows = []
    for i, case in enumerate(cases):
        b, ctx = case.split(":")
        print(f"[{i + 1}/{len(cases)}] {case}", flush=True)
        rows.append(bench_case(int(b[1:]), int(ctx), dtype, bandwidth, rng))
    write_results("mla_decode", rows, columns=COLUMNS, part=a.part,
                  notes="us per layer step (STEPS x LAYERS written out in one jit, state donated); "
                        "floor = (weights + latent cache + x, y) bytes / measured HBM bandwidth; "
                        "ours = jax_cluster.mla_decode impl=cuda (at 1 row the projection kernels "
                        "mla_project / mla_output around the latent-attention kernels, else XLA's dots); "
                        "ours_xla_proj / ours_kernel_proj = the same with MlaDecodeConfig(projections='xla' / "
                        "'kernels'); paged = 64-token "
                        "pages in a shuffled pool.")


if __name__ == "__main__":
    main()
