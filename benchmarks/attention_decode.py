"""attention_decode vs the peers a JAX user has, in one run on one GPU.

Peers: (a) plain jnp under jax.jit (the same math, native dtype, fp32
accumulation); (b) Pallas' decode_attention (gqa) + XLA matmuls. Each step is
timed inside one jit (decode steps written out one after another, caches carried
in place; --chain fori: the lax.fori_loop of earlier sessions).
Roofline = (weights + KV cache bytes) / bandwidth measured in the same run.
Run: python benchmarks/attention_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from jax_cluster.ops import attention_decode as ad_op  # the module: its tuner
from common import (RESULTS_DIR, dtype_tag, measure_bandwidth, merge_results, print_timeline, random_normal, time_fn,
                    write_results)

MODELS = {  # hidden, q heads, kv heads, head dim
    "llama2-7b": (4096, 32, 32, 128),
    "llama3-8b": (4096, 32, 8, 128),
}
STEPS = 20
CHAIN = "unrolled"  # steps_call: "unrolled" or "fori" (--chain)
CHAIN_NOTE = ("parts up to session 17 ran them in a lax.fori_loop, whose loop counter and carried-x "
              "copy added 2.3-4.5 us to every step (more to the custom calls, ours and Pallas', than "
              "to jnp's); parts s18_* write the steps out, each step's y the next step's x")


def rope(v, pos, inv_freq):
    half = inv_freq.shape[0]
    ang = pos.astype(jnp.float32)[:, None, None] * inv_freq
    c, s = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = v[..., :half], v[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def qkv_proj(x, w, nw, hq, hkv, dh, lengths, inv_freq):
    xf = x.astype(jnp.float32)
    h = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype) * nw
    qkv = jnp.dot(h, w, preferred_element_type=jnp.float32)
    b = x.shape[0]
    q = rope(qkv[:, : hq * dh].reshape(b, hq, dh), lengths, inv_freq)
    k = rope(qkv[:, hq * dh : (hq + hkv) * dh].reshape(b, hkv, dh), lengths, inv_freq)
    v = qkv[:, (hq + hkv) * dh :].reshape(b, hkv, dh)
    return q, k.astype(x.dtype), v.astype(x.dtype)


def write_cache(cache, new, lengths):
    return jax.vmap(lambda c, n, l: jax.lax.dynamic_update_slice(c, n[:, None], (0, l, 0)))(cache, new, lengths)


def plain_jnp_step(x, w_qkv, w_o, nw, kc, vc, lengths, inv_freq, hq, hkv, dh):
    q, k, v = qkv_proj(x, w_qkv, nw, hq, hkv, dh, lengths, inv_freq)
    kc, vc = write_cache(kc, k, lengths), write_cache(vc, v, lengths)
    b, g = x.shape[0], hq // hkv
    qg = q.reshape(b, hkv, g, dh).astype(x.dtype)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, kc, preferred_element_type=jnp.float32) / math.sqrt(dh)
    s = jnp.where(jnp.arange(kc.shape[2]) <= lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, -1).astype(x.dtype)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, vc, preferred_element_type=jnp.float32)
    y = jnp.dot(o.reshape(b, -1).astype(x.dtype), w_o, preferred_element_type=jnp.float32)
    return (y + x.astype(jnp.float32)).astype(x.dtype), kc, vc


def pallas_step(x, w_qkv, w_o, nw, kc, vc, lengths, inv_freq, hq, hkv, dh):
    from jax.experimental.pallas.ops.gpu import decode_attention

    q, k, v = qkv_proj(x, w_qkv, nw, hq, hkv, dh, lengths, inv_freq)
    kc, vc = write_cache(kc, k, lengths), write_cache(vc, v, lengths)
    o = decode_attention.gqa(q.astype(x.dtype), jnp.swapaxes(kc, 1, 2), jnp.swapaxes(vc, 1, 2),
                             kv_seq_len=lengths + 1)
    y = jnp.dot(o.reshape(x.shape[0], -1), w_o, preferred_element_type=jnp.float32)
    return (y + x.astype(jnp.float32)).astype(x.dtype), kc, vc


def ours_step(x, w_qkv, w_o, nw, kc, vc, lengths, inv_freq, hq, hkv, dh, cluster_size=None,
              heads_per_cluster=None, impl="kernel", dataflow="split_token", pipeline=None,
              rows_per_cluster=None):
    return jc.attention_decode(x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq,
                               num_kv_heads=hkv, norm="rms", norm_weight=nw, residual=True,
                               cluster_size=cluster_size, heads_per_cluster=heads_per_cluster,
                               impl=impl, dataflow=dataflow, pipeline=pipeline,
                               rows_per_cluster=rows_per_cluster)


def splitk_linear_step(x, w_qkv, w_o, nw, kc, vc, lengths, inv_freq, hq, hkv, dh):
    """impl='splitk' with jax_cluster.ops.linear for the projections (session 24's A/B)."""
    from jax_cluster.ops.attention_decode_xla import attention_decode_splitk
    return attention_decode_splitk(
        x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq, num_kv_heads=hkv, norm="rms",
        norm_weight=nw, norm_bias=None, eps=1e-6, qkv_bias=None, o_bias=None, residual=True,
        rotary_dim=dh, rope_layout="half", scale=dh ** -0.5, projections="linear")


def steps_call(step, state, consts, chain=None):
    """A call running STEPS decode steps in one jit, the caches carried and donated (each
    call continues from the last one's state); the weights are jit arguments (as constants
    captured by the trace they would be baked into every program: seconds of compile per
    configuration). chain (default CHAIN) "unrolled": the steps written out one after another, each step's
    y the next step's x; "fori": a lax.fori_loop, whose every iteration also runs the
    loop's own counter add and a copy of the carried x: 4.2-4.4 us per step for our
    kernel, 3.9-4.5 for Pallas, 2.3-2.6 for jnp (whose last fusion XLA can write into the
    loop's buffer), none of it part of a step (H100, logs/session18)."""
    chain = chain or CHAIN  # fixed now, not when the call is first traced

    def run_steps(s, c):
        def body(i, s):
            x, kc, vc = s
            return step(x, c["w_qkv"], c["w_o"], c["nw"], kc, vc, c["lengths"], c["inv_freq"])

        if chain == "fori":
            return jax.lax.fori_loop(0, STEPS, body, s)
        for i in range(STEPS):
            s = body(i, s)
        return s

    run = jax.jit(run_steps, donate_argnums=0)
    holder = [state]

    def call():
        holder[0] = run(holder[0], consts)
        return holder[0]

    return call


def time_steps(step, state, consts):
    """Microseconds per decode step (steps_call)."""
    return time_fn(steps_call(step, state, consts)) / STEPS * 1e6


def make_case(model, dtype, batch, ctx, key):
    """(consts, fresh, nbytes, shape) of one benchmark case: the weights and lengths as jit
    arguments, fresh() -> a new (x, k_cache, v_cache), the bytes a step must read."""
    d, hq, hkv, dh = MODELS[model]
    ks = jax.random.split(key, 6)
    cols = (hq + 2 * hkv) * dh
    consts = {
        "w_qkv": random_normal(ks[0], (d, cols), dtype, d ** -0.5),
        "w_o": random_normal(ks[1], (hq * dh, d), dtype, (hq * dh) ** -0.5),
        "nw": jnp.ones((d,), dtype),
        "lengths": jnp.full((batch,), ctx - 1, jnp.int32),
        "inv_freq": jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32),
    }
    fresh = lambda: (random_normal(ks[2], (batch, d), dtype),  # noqa: E731
                     random_normal(ks[3], (batch, hkv, ctx, dh), dtype),
                     random_normal(ks[4], (batch, hkv, ctx, dh), dtype))
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = (d * cols + hq * dh * d) * itemsize + 2 * batch * hkv * ctx * dh * itemsize
    return consts, fresh, nbytes, (hq, hkv, dh)


def step_for(choice, shape):
    """The step function of a peer ('jnp', 'pallas'), 'auto', an impl of ours ('impl=xla',
    'impl=pallas'), or a tuner choice ('3', 'n8:h2')."""
    if choice in ("jnp", "pallas", "splitk_linear"):
        step = {"jnp": plain_jnp_step, "pallas": pallas_step, "splitk_linear": splitk_linear_step}[choice]
        return lambda *a: step(*a, *shape)
    if choice in ("auto", "splitk") or str(choice).startswith("impl="):
        impl = choice.removeprefix("impl=")
        return lambda *a: ours_step(*a, *shape, impl=impl)
    n, h, pipe, r = ad_op.parse_choice(int(choice) if str(choice).isdigit() else choice)
    return lambda *a: ours_step(*a, *shape, cluster_size=n, heads_per_cluster=h, pipeline=pipe,
                                rows_per_cluster=r)


def trace(spec, dtype=jnp.float16):
    """Kernel timeline of STEPS steps: spec = 'model:batch:context:choice'."""
    model, batch, ctx, choice = spec.split(":", 3)
    consts, fresh, _, shape = make_case(model, dtype, int(batch), int(ctx), jax.random.key(0))
    print_timeline(spec, steps_call(step_for(choice, shape), fresh(), consts), STEPS)


def main(argv=None):
    global CHAIN
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS))
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--part", "--name", default=None, help="write results/parts/PART (a grid run in parts)")
    parser.add_argument("--merge", default=None, help="no run: join these parts into results/attention_decode")
    parser.add_argument("--skip-split-head", action="store_true",
                        help="leave out the SplitHead rows (measured in earlier sessions; saves device time)")
    parser.add_argument("--configs", default=None,
                        help="comma list of kernel configurations to sweep (tuner choices, e.g. "
                             "'1,2,n4:r4,n8:r8'); default: every one the tuner weighs for the shape")
    parser.add_argument("--splitk-linear", action="store_true",
                        help="also time impl='splitk' with jax_cluster.ops.linear's projections")
    parser.add_argument("--skip-auto", action="store_true",
                        help="leave out the auto row (its tuning measures every candidate)")
    parser.add_argument("--cluster-sweep", action="store_true",
                        help="only the cluster-size sweep (ClusterFusion Fig. 11): MHA, 32/64/128 heads")
    parser.add_argument("--chain", default=CHAIN, choices=("unrolled", "fori"),
                        help="how the timed steps follow each other inside the jit (steps_call)")
    parser.add_argument("--split-head-report", default=None, metavar="PART",
                        help="no run: SplitToken against SplitHead, from one part measured with both "
                             "(results/attention_decode_split_head)")
    parser.add_argument("--trace", default=None,
                        help="no benchmark: the kernel timeline of each comma-listed spec "
                             "'model:batch:context:choice' (choice: jnp, pallas, auto, impl=xla, impl=pallas or a "
                             "tuner choice)")
    args = parser.parse_args(argv)
    CHAIN = args.chain
    # the tuner's measured times of every candidate go to the log beside the rows
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jax_cluster.tuning").setLevel(logging.INFO)
    if args.trace:
        for spec in args.trace.split(","):
            trace(spec)
        return None
    if args.cluster_sweep:
        return cluster_sweep()
    if args.split_head_report:
        return split_head_report(args.split_head_report)
    global RESULT_NAME
    RESULT_NAME = f"parts/{args.part}" if args.part else "attention_decode"
    if args.merge:
        return merge_results("attention_decode", args.merge.split(","), columns=COLUMNS,
                             notes=f"Per decode step inside one jit ({STEPS} steps; {CHAIN_NOTE}). " + EXPLAIN)
    bw = measure_bandwidth()
    print(f"measured bandwidth {bw / 1e12:.2f} TB/s on {jax.devices()[0].device_kind}")
    dtypes = [jnp.float16] if args.quick else [jnp.dtype(t) for t in args.dtypes.split(",")]
    rows = []
    key = jax.random.key(0)
    for model in args.models.split(","):
        d, hq, hkv, dh = MODELS[model]
        for dtype in dtypes:
            for batch in map(int, args.batches.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    if args.quick and (ctx == 1024 or (batch == 16 and ctx == 16384)):
                        continue
                    consts, fresh, nbytes, shape = make_case(model, dtype, batch, ctx, key)
                    floor_us = nbytes / bw * 1e6
                    t = {}
                    for name in ("jnp", "pallas"):
                        try:
                            t[name] = time_steps(step_for(name, shape), fresh(), consts)
                        except Exception as exc:  # noqa: BLE001 - a peer may not run here
                            print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
                            t[name] = None
                    # every kernel configuration the tuner weighs: cluster sizes, and for GQA
                    # "n8:h2" = cluster 8, at most 2 query heads per cluster
                    # (and "tma:..." = the same with the TMA pipeline)
                    # (and "n4:r8" = cluster 4, the batch-tiled kernel with tiles of 8 rows)
                    sweep = {}
                    sms = getattr(jax.devices()[0], "core_count", 132)
                    choices = (ad_op._tuner_candidates(hq // hkv, batch, hkv, d, dh, sms)
                               if args.configs is None else
                               [int(c) if c.isdigit() else c for c in args.configs.split(",")])
                    for choice in choices:
                        if choice in ("xla", "pallas"):  # the peers, timed above
                            continue
                        sweep[choice] = time_steps(step_for(choice, shape), fresh(), consts)
                    splitk = sweep.pop("splitk", None)  # XLA's projections around our split-K attention
                    # the same with jax_cluster.ops.linear's projections (--splitk-linear)
                    splitk_linear = (time_steps(step_for("splitk_linear", shape), fresh(), consts)
                                     if splitk is not None and args.splitk_linear else None)
                    tiled = {c: v for c, v in sweep.items() if ad_op.parse_choice(c)[3] > 1}
                    tma = {c: v for c, v in sweep.items() if str(c).startswith("tma:")}
                    registers = {c: v for c, v in sweep.items() if c not in tiled and c not in tma}
                    best_n = min(registers, key=registers.get) if registers else None
                    best_tma = min(tma, key=tma.get) if tma else None
                    best_tiled = min(tiled, key=tiled.get) if tiled else None
                    # ClusterFusion's SplitHead alternative (their Fig. 20: slower than SplitToken)
                    split_head = {}
                    for n in () if args.skip_split_head else (2, 4, 8):
                        if dh % (8 * n) == 0:
                            f = lambda *a, n=n: ours_step(*a, *shape, cluster_size=n,  # noqa: E731
                                                          dataflow="split_head")
                            split_head[f"split_head:n{n}"] = time_steps(f, fresh(), consts)
                    best_sh = min(split_head, key=split_head.get) if split_head else None
                    # what a user gets: the tuner's pick among the cluster sizes and XLA's ops
                    if not args.skip_auto:
                        t["auto"] = time_steps(step_for("auto", shape), fresh(), consts)
                        pick = ad_op.autotune(batch, d, hq, hkv, ctx, dh, dtype)
                    case = f"{model} b{batch} ctx{ctx} {dtype_tag(dtype)}"
                    variants = [(name, sweep[best]) for name, best in
                                (("kernel", best_n), ("tma", best_tma), ("tiled", best_tiled)) if best]
                    if best_sh:
                        variants.append(("split_head", split_head[best_sh]))
                    if splitk is not None:
                        variants.append(("splitk", splitk))
                    if splitk_linear is not None:
                        variants.append(("splitk_linear", splitk_linear))
                    if not args.skip_auto:
                        variants.append(("auto", t["auto"]))
                    for variant, ours in variants:
                        row = {"case": f"{case} {variant}", "ours_us": ours, "jnp_us": t["jnp"],
                               "pallas_us": t["pallas"], "bytes": nbytes,
                               "roofline_fraction": floor_us / ours,
                               "speedup_vs_jnp": t["jnp"] / ours if t["jnp"] else None,
                               "speedup_vs_pallas": t["pallas"] / ours if t["pallas"] else None}
                        if variant == "split_head":
                            row["best_config"] = best_sh
                        elif variant == "tma":
                            row["best_config"] = best_tma
                        elif variant == "tiled":
                            row.update(best_config=best_tiled, **{f"{c}_us": v for c, v in tiled.items()})
                        elif variant == "kernel":
                            row.update(best_config=best_n, **{f"n{n}_us": v for n, v in sweep.items()
                                                              if isinstance(n, int)})
                        elif variant == "auto":
                            row["pick"] = pick
                        rows.append(row)
                        print(f"  {row['case']:36s} {ours:7.1f} us ({row['roofline_fraction']:.0%} roofline)"
                              f"  jnp {t['jnp'] or float('nan'):7.1f}  pallas {t['pallas'] or float('nan'):7.1f}"
                              + (f"  sweep {', '.join(f'{n}={v:.0f}' for n, v in sweep.items())}"
                                 if variant in ("kernel", "tma", "tiled")
                                 else f"  {', '.join(f'{n}={v:.0f}' for n, v in split_head.items())}"
                                 if variant == "split_head" else f"  pick {pick}" if variant == "auto" else ""))
                    save(rows, bw)  # after every case: a cut-off run keeps what it measured


def cluster_sweep(heads=(32, 64, 128), contexts=(4096, 16384), sizes=(1, 2, 3, 4, 5, 6, 7, 8, 16), dh=128):
    """The fused kernel at every cluster size for MHA blocks of 32, 64 and 128 heads (hidden =
    heads x 128), batch 1, fp16: which cluster size wins as the head count grows (the paper
    found 4 for 32/64 heads, 2 for 128)."""
    bw = measure_bandwidth()
    print(f"measured bandwidth {bw / 1e12:.2f} TB/s on {jax.devices()[0].device_kind}")
    dtype, rows = jnp.float16, []
    ks = jax.random.split(jax.random.key(0), 5)
    for h in heads:
        d = h * dh
        consts = {"w_qkv": random_normal(ks[0], (d, 3 * d), dtype, d ** -0.5),
                  "w_o": random_normal(ks[1], (d, d), dtype, d ** -0.5), "nw": jnp.ones((d,), dtype),
                  "inv_freq": jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)}
        for ctx in contexts:
            consts["lengths"] = jnp.full((1,), ctx - 1, jnp.int32)
            fresh = lambda: (random_normal(ks[2], (1, d), dtype),  # noqa: E731
                             random_normal(ks[3], (1, h, ctx, dh), dtype),
                             random_normal(ks[4], (1, h, ctx, dh), dtype))
            nbytes = (4 * d * d + 2 * h * ctx * dh) * 2
            times = {}
            for n in sizes:
                try:
                    times[n] = time_steps(lambda *a, n=n: ours_step(*a, h, h, dh, cluster_size=n), fresh(), consts)
                except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                    print(f"  h{h} ctx{ctx} cluster {n} failed: {type(exc).__name__}: {str(exc)[:200]}")
            best = min(times, key=times.get)
            rows.append({"case": f"mha-h{h} b1 ctx{ctx} fp16", "best_config": best, "ours_us": times[best],
                         "roofline_fraction": nbytes / bw * 1e6 / times[best], "bytes": nbytes,
                         **{f"n{n}_us": t for n, t in times.items()}})
            print(f"  {rows[-1]['case']:24s} best n{best} " + ", ".join(f"{n}={t:.0f}" for n, t in times.items()))
            write_results("attention_decode_cluster_sweep", rows,
                          columns=["case", "best_config", "ours_us", "roofline_fraction"] +
                          [f"n{n}_us" for n in sizes],
                          notes=(f"Fused kernel (dataflow split_token), batch 1, per decode step inside one jit "
                                 f"({STEPS} steps, {CHAIN}); hidden = heads x {dh}; nK_us = cluster size K. Roofline "
                                 f"from {bw / 1e12:.2f} TB/s measured in the same run."),
                          extra={"bandwidth_bytes_per_s": bw, "chain": CHAIN})


RESULT_NAME = "attention_decode"
COLUMNS = ["case", "ours_us", "jnp_us", "pallas_us", "speedup_vs_jnp", "speedup_vs_pallas", "roofline_fraction",
           "pick", "best_config", "n1_us", "n2_us", "n4_us", "n8_us", "n16_us"]
# the batch-tiled configurations' own columns ("n4:r8_us", ...) stay in the JSON rows
EXPLAIN = ("Times are per call in a loop of back-to-back calls (jax_cluster.tuning.steady_seconds; parts from "
           "session 12 on, named s12_* and later): earlier parts timed one synchronised call, which added 60-250 us "
           "of host dispatch latency per timed call of 20-24 steps. "
           "kernel = the fused kernel (register pipeline) at its best configuration among those the tuner "
           "weighs (best_config: a cluster size, or 'nK:hH' = cluster size K with at most H query heads per "
           "cluster; nK_us = cluster size K with the default heads per cluster); tma = the same kernel with "
           "pipeline='tma' (a producer warp streams every byte through a TMA/mbarrier ring) at its best "
           "configuration ('tma:...'); tiled = the batch-tiled register kernel "
           "(rows_per_cluster R > 1: one cluster per KV head and tile of R batch rows, weights read once "
           "per tile) at its best configuration ('nK:rR' = cluster size K, tiles of R rows); "
           "split_head = dataflow='split_head' (blocks split the head dimension) at its best cluster size; "
           "splitk = impl='splitk': our split-K decode attention kernels, which "
           "also apply RoPE and write the new k, v (decode_attention_append; from session 21, parts s21_*), "
           "between XLA's projections; splitk_linear = the same step with jax_cluster.ops.linear's "
           "projections (session 24, parts s24_*: --splitk-linear); "
           "auto = what impl='auto' runs: the tuner's pick among all of these, XLA's ops ('xla') and "
           "Pallas' decode attention between XLA's ops ('pallas', from session 19; parts s19_auto_*) (pick).")


def split_head_report(part):
    """ClusterFusion's Fig. 20 on our kernels: per case, the best SplitToken configuration
    ("kernel" rows) against the best SplitHead one, both measured in the same run."""
    data = json.loads((RESULTS_DIR / "parts" / f"{part}.json").read_text())
    by_case = {}
    for row in data["rows"]:
        case, variant = row["case"].rsplit(" ", 1)
        by_case.setdefault(case, {})[variant] = row
    rows = []
    for case, v in by_case.items():
        if "kernel" in v and "split_head" in v:
            token, head = v["kernel"], v["split_head"]
            rows.append({"case": case, "ours_us": token["ours_us"], "split_head_us": head["ours_us"],
                         "speedup_vs_split_head": head["ours_us"] / token["ours_us"],
                         "split_token_config": token["best_config"], "split_head_config": head["best_config"],
                         "roofline_fraction": token["roofline_fraction"],
                         "split_head_roofline_fraction": head["roofline_fraction"],
                         "jnp_us": token["jnp_us"], "pallas_us": token["pallas_us"], "bytes": token["bytes"]})
    return write_results("attention_decode_split_head", rows,
                         columns=["case", "ours_us", "split_head_us", "speedup_vs_split_head", "split_token_config",
                                  "split_head_config", "roofline_fraction", "split_head_roofline_fraction",
                                  "jnp_us", "pallas_us"],
                         extra={k: data[k] for k in ("device", "versions", "date")} | {"part": part},
                         notes=(f"From part {part} (`{data['command']}`): ours = the fused kernel's SplitToken "
                                "dataflow (blocks split the KV tokens) at its best configuration among those "
                                "measured; split_head = dataflow='split_head' (blocks split the head dimension, "
                                "ClusterFusion App. B.2) at its best cluster size; both per decode step in the "
                                "same run, with the jnp and Pallas peers of that run. " + EXPLAIN))


def save(rows, bw):
    write_results(RESULT_NAME, rows, columns=COLUMNS,
                  notes=(f"Per decode step inside one jit ({STEPS} steps, {CHAIN}: {CHAIN_NOTE}). Roofline from "
                         f"{bw / 1e12:.2f} TB/s measured in the same run (best of an XLA elementwise pass, "
                         "an XLA reduction and jax_cluster's stream_read kernel). " + EXPLAIN),
                  extra={"bandwidth_bytes_per_s": bw, "chain": CHAIN})


if __name__ == "__main__":
    main()
