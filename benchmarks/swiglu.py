"""swiglu (DeepFusionKernel) vs plain jnp, each configuration and the tuner's pick, one GPU run.

Shapes: Llama-3.1-70B TP=4 shard (D 8192, F 7168), Llama-2-7B (4096, 11008), Llama-3-8B
(4096, 14336); M = 1, 2, 4, 8, 16, 32, 64; fp16 and bf16; residual fused (y = x + MLP(x)).
Each measurement is many calls inside one jit, each feeding the next, rotating over
weight copies when the weights would fit in L2. Peer: plain jnp under jax.jit
(silu(x @ w_gate) * (x @ w_up) @ w_down + x). Roofline = bytes (weights + x + residual + y)
/ HBM bandwidth measured in the same run. `auto` is the tuner's pick, measured in this
run (a fresh tuning cache unless --keep-cache).
Configurations by name (parse_config): tma, gemv, fused; "+xla" = our up stage, then XLA's
down dot (SwigluConfig(down="xla")); knobs as ":field=value" (e.g. gemv:k_splits_up=7).
Run: python benchmarks/swiglu.py [--quick] [--keep-cache] [--models ...] [--ms ...]
     [--dtypes ...] [--variants ...] [--part NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster import tuning
from jax_cluster.ops import swiglu as sw
from common import RESULTS_DIR, dtype_tag, measure_bandwidth, time_fn, write_results

SHAPES = {"70b-tp4": (8192, 7168), "llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336),
          # more public decoders' (D, F) (--models all)
          "llama3.2-1b": (2048, 8192), "llama3.2-3b": (3072, 8192), "qwen2.5-1.5b": (1536, 8960),
          "qwen2.5-7b": (3584, 18944), "phi3-mini": (3072, 8192), "llama2-13b": (5120, 13824),
          "mistral-nemo-12b": (5120, 14336)}
CORE_SHAPES = ("70b-tp4", "llama2-7b", "llama3-8b")  # the default grid
MS = (1, 2, 4, 8, 16, 32, 64)
VARIANTS = ("tma", "tma+xla", "gemv", "gemv+xla", "fused")
COLUMNS = ["case", "ours_us", "jnp_us", "speedup_vs_jnp", "roofline_fraction", "pick", "auto_vs_best",
           "config"]
EXPLAIN = ("Times are per call in a loop of back-to-back calls (jax_cluster.tuning.steady_seconds), the "
           "calls chained directly (written out, y is the next x: only the op's kernels run). "
           "bytes = weights + x + residual + y. jnp = plain jnp under jax.jit. auto = the tuner's "
           "pick (`pick`), tuned in the same run; auto_vs_best = its time / the best of the named "
           "configurations and jnp (the tuner also weighs XLA's dots, `xla`).")
GOALS = "goals: M<=16 >= 92% of roofline, M=64 >= 85%, never slower than jnp, auto within 3% of the best variant"


def parse_config(spec: str):
    """A configuration's name -> "xla" or a SwigluConfig: "tma", "gemv", "fused", with
    "+xla" for XLA's down dot after our up stage, and knobs as ":field=value"
    (e.g. "gemv:k_splits_up=7:k_splits_down=41", "tma:pdl=0")."""
    if spec == "xla":
        return "xla"
    head, *knobs = spec.split(":")
    variant, plus, down = head.partition("+")
    if plus and down != "xla":
        raise ValueError(f"{spec!r}: only '+xla' may follow the variant")
    kw = {"variant": variant, **({"down": "xla"} if plus else {})}
    for knob in knobs:
        field, value = knob.split("=", 1)
        kw[field] = bool(int(value)) if field == "pdl" else int(value)
    return jc.SwigluConfig(**kw)


def config_name(choice) -> str:
    """parse_config's inverse."""
    if choice == "xla":
        return "xla"
    default = jc.SwigluConfig()
    knobs = [f"{f.name}={int(getattr(choice, f.name))}" for f in dataclasses.fields(choice)
             if f.name not in ("variant", "down") and getattr(choice, f.name) != getattr(default, f.name)]
    return ":".join([choice.variant + ("+xla" if choice.down == "xla" else "")] + knobs)


def gemv_fits(m: int) -> bool:
    """Whether the gemv kernels take M rows in one call (above, they run in row chunks,
    re-reading the weights; the tuner does not weigh them there)."""
    return any(c != "xla" and c.variant == "gemv" for c in sw.candidates(m, True))


def describe(choice, m, d, f) -> str:
    """The launch a choice runs with for M rows on this GPU (cpp/ops/swiglu/plan.cc)."""
    if choice == "xla":
        return "XLA dots"
    p = sw.launch_plan(choice, m, d, f, jnp.float16, has_down=choice.down == "kernel")
    text = {"tma": f"tma rt{p['row_tiles']} c{p['blocks']} pdl{int(p['pdl'])}",
            "gemv": f"gemv ku{p['k_splits_up']} kd{p['k_splits_down']} pdl{int(p['pdl'])}",
            "fused": f"fused n{p['cluster_size']} g{p['f_group']} rt{p['row_tiles']} c{p['clusters']}"}
    return text[choice.variant] + ("; XLA's down dot" if choice.down == "xla" else "")


def goal_misses(rows) -> list[str]:
    """The goals each case misses, from its rows ("<model> m<M> <dtype> <variant>"): the
    scheduler's pick (`auto`) against the roofline and jnp, our best kernel against jnp."""
    cases: dict[str, dict] = {}
    for row in rows:
        base, variant = row["case"].rsplit(" ", 1)
        cases.setdefault(base, {})[variant] = row
    misses = []
    for base, by_variant in cases.items():
        auto = by_variant.get("auto")
        if auto is None or "ours_us" not in auto:
            continue
        m = int(base.split()[1][1:])
        goal = 0.92 if m <= 16 else 0.85 if m == 64 else None
        if goal and auto["roofline_fraction"] < goal:
            misses.append(f"{base}: {auto['roofline_fraction']:.1%} < {goal:.0%} of roofline")
        if auto["speedup_vs_jnp"] < 1:
            misses.append(f"{base}: slower than jnp ({auto['speedup_vs_jnp']:.2f}x)")
        kernels = [r["ours_us"] for v, r in by_variant.items() if v != "auto" and "ours_us" in r]
        if kernels and min(kernels) > auto["jnp_us"]:
            misses.append(f"{base}: our best kernel is {auto['jnp_us'] / min(kernels):.2f}x jnp")
        if auto["auto_vs_best"] > 1.03:
            misses.append(f"{base}: auto {auto['auto_vs_best']:.3f} of the best variant")
    return misses


def plain_jnp(x, w_gate, w_up, w_down, residual):
    y = (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down
    return y + residual if residual is not None else y


CHAIN = "direct"  # sw.timing_loop's chain (--chain)


def time_us(fn, inputs) -> float:
    run, calls = sw.timing_loop(fn, inputs, chain=CHAIN)
    return time_fn(run, *inputs) / calls * 1e6


def ours(spec):
    """fn(x, wg, wu, wd, res) running a configuration by name, or "auto"."""
    kwargs = dict(impl="auto") if spec == "auto" else (
        dict(impl="xla") if spec == "xla" else dict(impl="cuda", config=parse_config(spec)))
    return lambda x, wg, wu, wd, res: jc.swiglu(x, wg, wu, wd, res, **kwargs)


def main(argv=None):
    global CHAIN
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a subset (< 2 minutes)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="use the user's tuning cache instead of tuning afresh in this run")
    parser.add_argument("--models", default=",".join(CORE_SHAPES),
                        help="comma list of " + ", ".join(SHAPES) + ", or 'all'")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="our configurations to time, by name (parse_config), besides auto")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="roofline bandwidth in bytes/s (e.g. from the streaming-read probe "
                             "benchmarks/micro/gemv_locality.cu) instead of measure_bandwidth()")
    parser.add_argument("--no-auto", action="store_true",
                        help="time the named configurations and jnp only (no tuner pick: quicker)")
    parser.add_argument("--chain", default=CHAIN, choices=("direct", "fori"),
                        help="how the timed calls follow each other inside the jit (timing_loop)")
    parser.add_argument("--part", default=None,
                        help="this run is one slice of the grid: its rows are merged into results/swiglu")
    args = parser.parse_args(argv)
    CHAIN = args.chain
    # the tuner's measured times of every candidate go to the log beside the rows
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jax_cluster.tuning").setLevel(logging.INFO)
    if not args.keep_cache:
        os.environ[tuning.ENV_CACHE] = os.path.join(tempfile.mkdtemp(), "tuning.json")
    os.environ.setdefault(tuning.ENV_ENABLE, "1")
    bw = args.bandwidth or measure_bandwidth()
    dev = jax.devices()[0]
    print(f"measured bandwidth {bw / 1e12:.2f} TB/s on {dev.device_kind}")
    names = ("70b-tp4", "llama2-7b") if args.quick else SHAPES if args.models == "all" else args.models.split(",")
    shapes = {k: SHAPES[k] for k in names}
    ms = (1, 16, 64) if args.quick else tuple(map(int, args.ms.split(",")))
    dtypes = (jnp.float16,) if args.quick else tuple(jnp.dtype(t) for t in args.dtypes.split(","))
    variants = tuple(args.variants.split(","))
    for v in variants:
        parse_config(v)  # a typo fails here, not after an hour of measuring
    rows = []
    for model, (d, f) in shapes.items():
        for dtype in dtypes:
            for m in ms:
                item = jnp.dtype(dtype).itemsize
                nbytes = (3 * d * f + 3 * m * d) * item  # weights, x, residual, y
                floor_us = nbytes / bw * 1e6
                inputs = sw.timing_inputs(m, d, f, dtype, has_residual=True)
                base = f"{model} m{m} {dtype_tag(dtype)}"
                t_jnp = time_us(plain_jnp, inputs)
                times = {}
                for v in variants:
                    if v.startswith("gemv") and not gemv_fits(m):
                        continue  # it would run in row chunks, re-reading the weights
                    try:
                        times[v] = time_us(ours(v), inputs)
                    except Exception as exc:  # noqa: BLE001 - report, keep going
                        print(f"  {base} {v} failed: {type(exc).__name__}: {str(exc)[:200]}")
                        times[v] = None
                pick = None
                if not args.no_auto:
                    pick = sw.autotune(m, d, f, dtype)  # the tuner (tunes now if needed)
                    # "auto" resolved to a configuration timed above is the same program: reuse
                    times["auto"] = times.get(config_name(pick)) or time_us(ours("auto"), inputs)
                # the tuner also weighs XLA's dots ("xla" ~ the jnp peer): best of both
                best = min([t for v, t in times.items() if v != "auto" and t] + [t_jnp])
                for v, t in times.items():
                    if t is None:
                        rows.append({"case": f"{base} {v}", "note": "failed"})
                        continue
                    choice = pick if v == "auto" else parse_config(v)
                    row = {"case": f"{base} {v}", "ours_us": t, "jnp_us": t_jnp,
                           "speedup_vs_jnp": t_jnp / t, "roofline_fraction": floor_us / t,
                           "bytes": nbytes, "config": describe(choice, m, d, f)}
                    if v == "auto":
                        row["pick"] = config_name(pick)
                        row["auto_vs_best"] = t / best
                    rows.append(row)
                line = (f"  {base:24s} jnp {t_jnp:7.1f} us ({floor_us / t_jnp:4.0%})  " +
                        "  ".join(f"{v} {t:7.1f}" for v, t in times.items() if t))
                if pick is not None:
                    auto = rows[-1]
                    line += (f"  -> auto={config_name(pick)} {auto['roofline_fraction']:.0%} roofline, "
                             f"{auto['speedup_vs_jnp']:.2f}x jnp, {auto['auto_vs_best']:.3f} of best")
                print(line)
                save(rows, bw, args)  # after every point: a cut-off run keeps what it measured
    misses = goal_misses(rows)
    print(GOALS)
    print("goals missed:" if misses else "all goals met", *misses, sep="\n  ")


def save(rows, bw, args):
    table = RESULTS_DIR / "swiglu.json"
    merged = {r["case"]: r for r in json.loads(table.read_text())["rows"]} if args.part and table.exists() else {}
    merged.update({r["case"]: r for r in rows})
    misses = goal_misses(list(merged.values()))  # over the whole table this run merges into
    source = ("given (--bandwidth)" if args.bandwidth else
              "best of an elementwise pass, a read-only reduction and the stream_read probe, same run")
    notes = (f"Bandwidth {bw / 1e12:.2f} TB/s ({source}). {EXPLAIN} {GOALS}. Goals missed: "
             f"{'; '.join(misses) if misses else 'none'}.")
    write_results("swiglu", rows, notes=notes, part=args.part,
                  extra={"bandwidth_bytes_per_s": bw, "chain": CHAIN}, columns=COLUMNS)


if __name__ == "__main__":
    main()
