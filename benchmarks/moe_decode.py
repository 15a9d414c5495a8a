"""moe_decode (DeepSeek's MoE layer at decode) vs jnp, DeepSeek-V2-Lite, V2 and V3 shapes.

Rows per case (model, batch): ours = jax_cluster.moe_decode(impl="cuda") (the router call, the
custom call with the routed and the shared experts, the default tiling); auto = impl="auto" (the
tuner's pick for the shape on this GPU, auto_pick: a tiling or "xla"); gather = flax_models'
decode formulation (flax_models.moe.route + experts_gather: the chosen experts' weights gathered
per (row, slot)); ragged = its prefill formulation (route + experts_grouped: pairs sorted by
expert, jax.lax.ragged_dot). Both jnp peers add the residual and run the shared experts as
flax_models does (ops.swiglu_mlp_xla). Every row computes the whole layer: router, routed
experts, residual, shared experts.

A call runs STEPS steps of LAYERS layers, each layer with its own router and expert weights (so
the weights do not stay in L2), written out in one jit, every layer on the same random batch x
(see timed: chained random layers blow up and collapse the routing), the outputs summed into a
donated accumulator. floor = the bytes a layer must read (the distinct experts its router picks
for x, times their w_gate, w_up, w_down + the shared experts + the router + x, residual and y)
/ the HBM bandwidth measured in the same run; active_experts = those distinct experts, the mean
over the layers.

V3's router (noaux_tc) gets a random correction bias per layer (score_bias).

Run: python benchmarks/moe_decode.py [--models v2-lite v2 v3] [--batches 1 4 16 64] [--dtype bf16]
     python benchmarks/moe_decode.py --tiny      (CPU smoke check of the script: tiny shapes, the
                                                  ops' C++ CPU handlers; writes moe_decode_tiny.*)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from flax_models.moe import experts_gather, experts_grouped, route
from flax_models.ops import _add_residual, swiglu_mlp_xla
from common import dtype_tag, measure_bandwidth, time_donated, write_results

# hidden, routed-expert width, experts, top-k, shared experts (one SwiGLU of width shared * inter),
# routing, layers per call (DeepSeek-V2's layer is 7.5 GB of bf16 expert weights, V3's 22.5 GB: one fits)
MODELS = {
    "v2-lite": dict(hidden=2048, inter=1408, experts=64, top_k=6, shared=2, layers=2,
                    routing=dict(topk_method="greedy", routed_scaling_factor=1.0)),
    "v2": dict(hidden=5120, inter=1536, experts=160, top_k=6, shared=2, layers=1,
               routing=dict(topk_method="group_limited_greedy", n_group=8, topk_group=3,
                            routed_scaling_factor=16.0)),
    "v3": dict(hidden=7168, inter=2048, experts=256, top_k=8, shared=1, layers=1,
               routing=dict(topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                            routed_scaling_factor=2.5)),
    # --tiny: the script's smoke check on CPU (shared width 64: jax_cluster.swiglu takes it)
    "tiny": dict(hidden=64, inter=32, experts=8, top_k=2, shared=2, layers=2,
                 routing=dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.0)),
}
BATCHES = (1, 4, 16, 64)
STEPS = 4
COLUMNS = ["case", "ours_us", "auto_us", "auto_pick", "gather_us", "ragged_us", "floor_us", "floor_fraction",
           "speedup_vs_gather", "speedup_vs_ragged", "active_experts"]


def layer_weights(key, m, dtype):
    """One layer: router [H, E] (normal / sqrt(H): softmax logits of unit scale, several experts
    compete), experts and shared experts normal / sqrt(fan-in)."""
    h, i, e, i_s = m["hidden"], m["inter"], m["experts"], m["inter"] * m["shared"]
    ks = jax.random.split(key, 7)

    def f(k, *s):  # one matrix at a time: the fp32 temporary of V2's experts is 5 GB
        return jax.jit(lambda k: (jax.random.normal(k, s, jnp.float32) * s[-2] ** -0.5).astype(dtype))(k)

    w = dict(router=f(ks[0], h, e), w_gate=f(ks[1], e, h, i), w_up=f(ks[2], e, h, i), w_down=f(ks[3], e, i, h),
             shared=dict(w_gate=f(ks[4], h, i_s), w_up=f(ks[5], h, i_s), w_down=f(ks[6], i_s, h)))
    if m["routing"]["topk_method"] == "noaux_tc":  # V3's correction bias, float32 as trained
        w["score_bias"] = jax.random.normal(jax.random.fold_in(key, 7), (e,), jnp.float32) * 0.1
    return w


def routing_kw(m):
    return dict(top_k=m["top_k"], **m["routing"])


def ours_layer(m, impl="cuda"):
    kw = routing_kw(m)

    def step(x, w):
        return jc.moe_decode(x, w["router"], w["w_gate"], w["w_up"], w["w_down"], shared=w["shared"], residual=x,
                             score_bias=w.get("score_bias"), impl=impl, **kw)

    return step


def jnp_layer(m, experts):
    """flax_models' formulation with the routed experts by `experts` (gather or grouped)."""
    kw = routing_kw(m)
    method = kw.pop("topk_method")

    def step(x, w):
        weights, ids = route(x, w["router"], method=method, score_bias=w.get("score_bias"), **kw)
        y = _add_residual(experts(x, weights, ids, w["w_gate"], w["w_up"], w["w_down"]), x)
        return swiglu_mlp_xla(x, residual=y, **w["shared"])

    return step


def timed(step, x, ws):
    """Microseconds per layer: STEPS x LAYERS layers written out in one jit, every one on the
    same input x, their outputs summed into a donated accumulator.

    Not chained: random layers fed their own outputs blow up within a few layers (inf, then
    NaN), and every row then routes to the same experts, so a chained run times a batch that
    reads one expert set. An optimization barrier on (x, accumulator) before each layer keeps
    XLA from merging the repeated layers; the routing is exactly the counted one."""

    def run(acc, x, ws):
        for _ in range(STEPS):
            for w in ws:
                xi, acc = jax.lax.optimization_barrier((x, acc))
                acc = acc + step(xi, w).astype(jnp.float32)
        return acc

    return time_donated(run, jnp.zeros(x.shape, jnp.float32), x, ws) / (STEPS * len(ws)) * 1e6


def bench_case(name, batch, dtype, bandwidth, rng):
    m = MODELS[name]
    h, i, e, i_s = m["hidden"], m["inter"], m["experts"], m["inter"] * m["shared"]
    ws = tuple(layer_weights(k, m, dtype) for k in jax.random.split(jax.random.key(0), m["layers"]))
    x = jnp.asarray(rng.standard_normal((batch, h)), dtype)
    kw = routing_kw(m)
    method = kw.pop("topk_method")
    active = [len(np.unique(np.asarray(route(x, w["router"], method=method, score_bias=w.get("score_bias"), **kw)[1])))
              for w in ws]
    expected = float(np.mean(active))  # every timed layer routes this x
    layers = {"ours": ours_layer(m), "auto": ours_layer(m, "auto"), "gather": jnp_layer(m, experts_gather),
              "ragged": jnp_layer(m, experts_grouped)}
    ys = {k: np.asarray(jax.jit(f)(x, ws[0]), np.float32) for k, f in layers.items()}
    for k in ("gather", "ragged"):  # the same layer; rounding points differ (bf16: ~1e-2)
        err = np.linalg.norm(ys["ours"] - ys[k]) / np.linalg.norm(ys[k])
        if not err <= 0.05:
            raise AssertionError(f"{name} batch {batch}: ours differs from {k} by {err:.3g} (relative norm)")
    out = {f"{k}_us": timed(f, x, ws) for k, f in layers.items()}
    in_call = i_s if batch <= 8 else 0  # the shared experts run in the call up to 8 rows
    pick = jc.ops.moe_decode.autotune(batch, h, i, e, m["top_k"], dtype, shared_width=in_call)
    item = jnp.dtype(dtype).itemsize
    nbytes = (expected * 3 * h * i + 3 * h * i_s + h * e + 3 * batch * h) * item
    floor = nbytes / bandwidth * 1e6
    row = {"case": f"{name}_b{batch}_{dtype_tag(dtype)}", **{k: round(v, 2) for k, v in out.items()},
           "auto_pick": pick if isinstance(pick, str) else f"up{pick.cols_up or 'rule'}/down{pick.cols_down or 'rule'}",
           "floor_us": round(floor, 2), "floor_fraction": round(floor / out["ours_us"], 3),
           "speedup_vs_gather": round(out["gather_us"] / out["ours_us"], 3),
           "speedup_vs_ragged": round(out["ragged_us"] / out["ours_us"], 3),
           "active_experts": round(float(np.mean(active)), 2)}
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["v2-lite", "v2"], choices=sorted(MODELS))
    ap.add_argument("--batches", nargs="*", type=int, default=list(BATCHES))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--tiny", action="store_true", help="smoke check: tiny shapes, batches 1 and 4, on any backend")
    ap.add_argument("--part", default=None)
    a = ap.parse_args()
    dtype = jnp.bfloat16 if a.dtype == "bf16" else jnp.float16
    models, batches = (["tiny"], [1, 4]) if a.tiny else (a.models, a.batches)
    bandwidth = measure_bandwidth(1 / 16 if a.tiny else 1.0)
    rng = np.random.default_rng(0)
    rows = []
    cases = [(mname, b) for mname in models for b in batches]
    for n, (mname, b) in enumerate(cases):
        print(f"[{n + 1}/{len(cases)}] {mname} batch {b}", flush=True)
        rows.append(bench_case(mname, b, dtype, bandwidth, rng))
    write_results("moe_decode_tiny" if a.tiny else "moe_decode", rows, columns=COLUMNS, part=a.part,
                  notes="us per MoE layer (router + routed experts + residual + shared experts; STEPS x LAYERS "
                        "layers with their own weights written out in one jit, each on the same x (not chained: "
                        "chained random layers blow up and collapse the routing), so the routing is the counted "
                        "one); floor = (active experts' + shared experts' + router weights + x, "
                        "residual, y) bytes / measured HBM bandwidth; active_experts = distinct experts the "
                        "batch routes to per layer; ours = jax_cluster.moe_decode impl=cuda (default tiling); auto = "
                        "impl=auto (the tuner's pick for the shape, auto_pick); gather / ragged = "
                        "flax_models' experts_gather / experts_grouped with its router and XLA shared experts.")


if __name__ == "__main__":
    main()
