"""attention_block vs the peers a JAX user has, in one run on one GPU.

Peers: (a) plain jnp under jax.jit (the same math, native dtype, fp32 accumulation);
(b) Pallas' decode_attention (gqa) between XLA's matmuls. Ours: every configuration the
tuner weighs (the fused kernel's cluster sizes, heads per cluster and pipelines; split_k),
ClusterFusion's SplitHead dataflow, and what impl="auto" runs. Each step is timed inside
one jit (decode steps written out one after another, each step's y the next step's x,
caches carried in place). Roofline = (weights + KV cache bytes) / bandwidth measured in
the same run.

    python benchmarks/attention_block.py [--quick] [--models ...] [--batches 1,16] [--part NAME]
    python benchmarks/attention_block.py --cluster-sweep      # ClusterFusion Fig. 11
    python benchmarks/attention_block.py --trace llama3-8b:1:4096:n8:h2   # kernel timeline
"""

from __future__ import annotations

import argparse
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from jax_cluster.ops import attention_block as ab_op  # the module: its tuner
from common import dtype_tag, measure_bandwidth, print_timeline, random_normal, time_fn, write_results

MODELS = {  # hidden, q heads, kv heads, head dim
    "llama2-7b": (4096, 32, 32, 128),
    "llama3-8b": (4096, 32, 8, 128),
    # more public decoders' shapes (--models all): head dims 64/80/96/128/256, GQA groups 1-8
    "llama3.2-1b": (2048, 32, 8, 64),
    "llama3.2-3b": (3072, 24, 8, 128),
    "qwen2.5-1.5b": (1536, 12, 2, 128),
    "qwen2.5-7b": (3584, 28, 4, 128),
    "phi3-mini": (3072, 32, 32, 96),
    "pythia-2.8b": (2560, 32, 32, 80),
    "pythia-1b": (2048, 8, 8, 256),
    "gemma-2b": (2048, 8, 1, 256),
    "llama2-13b": (5120, 40, 40, 128),
    "mistral-nemo-12b": (5120, 32, 8, 128),
}
CORE_MODELS = ("llama2-7b", "llama3-8b")  # the default grid
STEPS = 20


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


def ours_step(x, w_qkv, w_o, nw, kc, vc, lengths, inv_freq, hq, hkv, dh, impl="cuda", config=None):
    return jc.attention_block(x, w_qkv, w_o, kc, vc, lengths, inv_freq, num_q_heads=hq,
                              num_kv_heads=hkv, norm="rms", norm_weight=nw, residual=True,
                              impl=impl, config=config)


def steps_call(step, state, consts):
    """A call running STEPS decode steps in one jit, written out one after another (a
    lax.fori_loop's counter and carried-x copy add a few us to every step, more to custom
    calls than to XLA's fusions: docs/performance.md), the caches carried and donated (each
    call continues from the last one's state); the weights are jit arguments (as constants
    captured by the trace they would be baked into every program: seconds of compile per
    configuration)."""

    def run_steps(s, c):
        for _ in range(STEPS):
            x, kc, vc = s
            s = step(x, c["w_qkv"], c["w_o"], c["nw"], kc, vc, c["lengths"], c["inv_freq"])
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


def parse_config(spec: str) -> jc.AttentionBlockConfig:
    """A command-line name of a configuration -> the config: "n4" (fused, cluster 4),
    "n8:h2" (at most 2 query heads per cluster), "tma:n4" (the TMA pipeline),
    "split_head:n2", "split_k" (optionally "split_k:s16": 16 token splits), "pallas"."""
    if spec in ("split_k", "pallas"):
        return jc.AttentionBlockConfig(kernel=spec)
    fields = spec.split(":")
    if fields[0] == "split_k":
        return jc.AttentionBlockConfig(kernel="split_k", splits=int(fields[1][1:]))
    kw = {}
    if fields[0] in ("tma", "split_head"):
        kw = {"pipeline": "tma"} if fields[0] == "tma" else {"dataflow": "split_head"}
        fields = fields[1:]
    for f in fields:
        kw[{"n": "cluster_size", "h": "heads_per_cluster"}[f[0]]] = int(f[1:])
    return jc.AttentionBlockConfig(**kw)


def config_name(config) -> str:
    """parse_config's inverse."""
    if config == "xla" or config.kernel == "pallas":
        return "xla" if config == "xla" else "pallas"
    if config.kernel == "split_k":
        return "split_k" + (f":s{config.splits}" if config.splits else "")
    prefix = "tma:" if config.pipeline == "tma" else "split_head:" if config.dataflow == "split_head" else ""
    return prefix + f"n{config.cluster_size or '(default)'}" + (f":h{config.heads_per_cluster}" if config.heads_per_cluster else "")


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
    """The step function of a peer ('jnp', 'pallas'), 'auto', 'xla' (our impl='xla') or a
    configuration name (parse_config)."""
    if choice in ("jnp", "pallas"):
        step = {"jnp": plain_jnp_step, "pallas": pallas_step}[choice]
        return lambda *a: step(*a, *shape)
    if choice in ("auto", "xla"):
        return lambda *a: ours_step(*a, *shape, impl=choice)
    config = parse_config(choice)
    return lambda *a: ours_step(*a, *shape, config=config)


def trace(spec, dtype=jnp.float16):
    """Kernel timeline of STEPS steps: spec = 'model:batch:context:choice'."""
    model, batch, ctx, choice = spec.split(":", 3)
    consts, fresh, _, shape = make_case(model, dtype, int(batch), int(ctx), jax.random.key(0))
    print_timeline(spec, steps_call(step_for(choice, shape), fresh(), consts), STEPS)


def fused_runs(config, batch, hidden, hq, hkv, dh, dtype) -> bool:
    """Whether the fused kernel takes the shape in this configuration (D % 64 != 0 runs split_k
    only; the TMA pipeline stops at head_dim 128)."""
    plan = ab_op.launch_plan(config, batch=batch, hidden=hidden, head_dim=dh, num_q_heads=hq,
                             num_kv_heads=hkv, rotary_dim=dh, dtype=dtype)
    return not (plan["error"] or plan["cuda_error"])


def family(config) -> str:
    """The table row a configuration competes in."""
    if config.kernel != "fused":
        return config.kernel
    return "split_head" if config.dataflow == "split_head" else "tma" if config.pipeline == "tma" else "fused"


def main(argv=None):
    global RESULT_NAME
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fp16, contexts 4096 and (batch 1) 16384")
    parser.add_argument("--models", default=",".join(CORE_MODELS),
                        help="comma list of " + ", ".join(MODELS) + ", or 'all'")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--part", default=None, help="this run is one slice of the grid: its rows are merged "
                        "into the table (a case measured again replaces its row)")
    parser.add_argument("--results-name", default=RESULT_NAME,
                        help="the table to write (e.g. attention_block_h200 for another GPU's table)")
    parser.add_argument("--configs", default=None,
                        help="comma list of configurations to time (parse_config: n4, n8:h2, tma:n4, "
                             "split_head:n2, split_k); default: every one the tuner weighs, and SplitHead")
    parser.add_argument("--skip-split-head", action="store_true", help="leave out ClusterFusion's SplitHead")
    parser.add_argument("--skip-auto", action="store_true",
                        help="leave out the auto row (its tuning measures every candidate)")
    parser.add_argument("--cluster-sweep", action="store_true",
                        help="only the cluster-size sweep (ClusterFusion Fig. 11): MHA, 32/64/128 heads")
    parser.add_argument("--trace", default=None,
                        help="no benchmark: the kernel timeline of each comma-listed spec "
                             "'model:batch:context:choice' (choice: jnp, pallas, auto, xla or a configuration)")
    args = parser.parse_args(argv)
    # the tuner's measured times of every candidate go to the log beside the rows
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jax_cluster.tuning").setLevel(logging.INFO)
    if args.trace:
        for spec in args.trace.split(","):
            trace(spec)
        return None
    if args.cluster_sweep:
        return cluster_sweep(part=args.part)
    RESULT_NAME = args.results_name
    bw = measure_bandwidth()
    print(f"measured bandwidth {bw / 1e12:.2f} TB/s on {jax.devices()[0].device_kind}")
    dtypes = [jnp.float16] if args.quick else [jnp.dtype(t) for t in args.dtypes.split(",")]
    rows = []
    key = jax.random.key(0)
    sms = getattr(jax.devices()[0], "core_count", 132)
    for model in (MODELS if args.models == "all" else args.models.split(",")):
        d, hq, hkv, dh = MODELS[model]
        for dtype in dtypes:
            for batch in map(int, args.batches.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    if args.quick and (ctx == 1024 or (batch > 1 and ctx == 16384)):
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
                    if args.configs is None:
                        configs = [c for c in ab_op.candidates(batch=batch, num_q_heads=hq, num_kv_heads=hkv,
                                                               head_dim=dh, max_seq=ctx, sms=sms)
                                   if c != "xla" and c.kernel != "pallas"  # the peers, timed above
                                   and (c.kernel != "fused" or fused_runs(c, batch, d, hq, hkv, dh, dtype))]
                        if not args.skip_split_head:
                            configs += [jc.AttentionBlockConfig(cluster_size=n, dataflow="split_head")
                                        for n in (2, 4, 8) if dh % (8 * n) == 0
                                        and fused_runs(jc.AttentionBlockConfig(cluster_size=n), batch, d, hq,
                                                       hkv, dh, dtype)]
                    else:
                        configs = [parse_config(c) for c in args.configs.split(",")]
                    sweep = {}
                    for config in configs:
                        try:
                            sweep[config] = time_steps(lambda *a, c=config: ours_step(*a, *shape, config=c),
                                                       fresh(), consts)
                        except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                            print(f"  {config_name(config)} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    best = {}
                    for config, us in sweep.items():
                        fam = family(config)
                        if fam not in best or us < sweep[best[fam]]:
                            best[fam] = config
                    variants = [(fam, sweep[c], config_name(c)) for fam, c in best.items()]
                    pick = None
                    if not args.skip_auto:  # what a user gets: the tuner's pick
                        variants.append(("auto", time_steps(step_for("auto", shape), fresh(), consts), None))
                        pick = config_name(ab_op.autotune(batch, d, hq, hkv, ctx, dh, dtype))
                    case = f"{model} b{batch} ctx{ctx} {dtype_tag(dtype)}"
                    for variant, ours, best_config in variants:
                        row = {"case": f"{case} {variant}", "ours_us": ours, "jnp_us": t["jnp"],
                               "pallas_us": t["pallas"], "bytes": nbytes,
                               "roofline_fraction": floor_us / ours,
                               "speedup_vs_jnp": t["jnp"] / ours if t["jnp"] else None,
                               "speedup_vs_pallas": t["pallas"] / ours if t["pallas"] else None,
                               "best_config": best_config, "pick": pick if variant == "auto" else None}
                        if variant == "fused":
                            row.update({f"{config_name(c)}_us": v for c, v in sweep.items() if family(c) == "fused"})
                        rows.append(row)
                        print(f"  {row['case']:36s} {ours:7.1f} us ({row['roofline_fraction']:.0%} roofline)"
                              f"  jnp {t['jnp'] or float('nan'):7.1f}  pallas {t['pallas'] or float('nan'):7.1f}"
                              f"  {best_config or 'pick ' + str(pick)}")
                    save(rows, bw, args.part)  # after every case: a cut-off run keeps what it measured


def cluster_sweep(heads=(32, 64, 128), contexts=(4096, 16384), sizes=(1, 2, 3, 4, 5, 6, 7, 8, 16), dh=128,
                  part=None):
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
                    config = jc.AttentionBlockConfig(cluster_size=n)
                    times[n] = time_steps(lambda *a, c=config: ours_step(*a, h, h, dh, config=c), fresh(), consts)
                except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                    print(f"  h{h} ctx{ctx} cluster {n} failed: {type(exc).__name__}: {str(exc)[:200]}")
            best = min(times, key=times.get)
            rows.append({"case": f"mha-h{h} b1 ctx{ctx} fp16", "best_config": best, "ours_us": times[best],
                         "roofline_fraction": nbytes / bw * 1e6 / times[best], "bytes": nbytes,
                         **{f"n{n}_us": t for n, t in times.items()}})
            print(f"  {rows[-1]['case']:24s} best n{best} " + ", ".join(f"{n}={t:.0f}" for n, t in times.items()))
            write_results("attention_block_cluster_sweep", rows,
                          columns=["case", "best_config", "ours_us", "roofline_fraction"] +
                          [f"n{n}_us" for n in sizes],
                          notes=(f"Fused kernel (dataflow split_token), batch 1, per decode step inside one jit "
                                 f"({STEPS} steps written out); hidden = heads x {dh}; nK_us = cluster size K. Roofline "
                                 f"from {bw / 1e12:.2f} TB/s measured in the same run."),
                          extra={"bandwidth_bytes_per_s": bw}, part=part)


RESULT_NAME = "attention_block"
COLUMNS = ["case", "ours_us", "jnp_us", "pallas_us", "speedup_vs_jnp", "speedup_vs_pallas", "roofline_fraction",
           "pick", "best_config", "n1_us", "n2_us", "n4_us", "n8_us", "n16_us"]
EXPLAIN = ("Times are per call in a loop of back-to-back calls (jax_cluster.tuning.steady_seconds). "
           "fused = the fused kernel (pipeline registers) at its best configuration among those the tuner "
           "weighs (best_config: nK = cluster size K, nK:hH = at most H query heads per cluster; nK_us = "
           "cluster size K with the default heads per cluster); tma = the same kernel with pipeline='tma' "
           "(a producer warp streams every byte through a TMA/mbarrier ring); split_head = "
           "dataflow='split_head' (ClusterFusion's SplitHead: blocks split the head dimension); split_k = "
           "kernel='split_k' (our split-K decode attention, which also applies RoPE and writes the new k, v, "
           "between XLA's projections); auto = what impl='auto' runs: the tuner's pick among these, "
           "Pallas' decode attention between XLA's ops ('pallas') and XLA's own ops ('xla') (pick).")


def save(rows, bw, part=None):
    write_results(RESULT_NAME, rows, columns=COLUMNS, part=part,
                  notes=(f"Per decode step inside one jit ({STEPS} steps written out, each step's y the next "
                         f"step's x). Roofline from {bw / 1e12:.2f} TB/s measured in the same run. " + EXPLAIN),
                  extra={"bandwidth_bytes_per_s": bw})


if __name__ == "__main__":
    main()
