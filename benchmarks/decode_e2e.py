"""End-to-end decode: time per output token of whole models (random weights) with flax_models.

Llama-2-7B, Llama-3-8B, Mistral-7B, Llama-3.2-1B, Pythia-1B/2.8B/6.9B and DeepSeek-V2-Lite shapes,
batch 1 and 16, contexts 1K/4K/16K (tokens already in the KV cache), impl="xla" (plain jnp) vs the
jax_cluster ops that exist for the model (attention_block or mla_decode; swiglu, moe_decode: "fused") and,
for Llama and GPT-NeoX, whole layers on jax_cluster.decoder_layer's one-launch kernel ("one_launch";
skipped, with the kernel's reason, where it does not cover the batch; a sliding window's
rolling cache included, docs/models.md). Each measurement runs `steps` decode steps inside ONE jit (lax.fori_loop, greedy sampling
in the loop, KV cache donated), timed per call in a loop of back-to-back calls
(jax_cluster.tuning.steady_seconds), so dispatch is excluded. The cache is filled with random
values.

Roofline: floor = (weight bytes + KV bytes read per step) / HBM bandwidth, the bandwidth
measured in the same run (best of an elementwise pass and a read-only reduction); roofline_fraction = floor / measured time.
For DeepSeek-V2 the weights a step reads are the dense ones plus the ACTIVE routed experts
(top-k per MoE layer at batch 1; at batch B the expected distinct experts E (1 - (1 - k/E)^B)
under uniform routing), and the KV bytes are the latent cache's; a sliding window reads at most
its window's tokens per layer.
Cases that do not fit in device memory are listed as skipped. With --data-parallel N the
batch's rows (tokens, cache) are sharded over N devices and the weights replicated
(docs/sharding.md); a device's floor is then (weight bytes + its rows' KV bytes) / bandwidth.

    python benchmarks/decode_e2e.py [--quick] [--dtype fp16|bf16] [--models llama2-7b,llama3-8b]
        [--combos B:CTX,...] [--part NAME]     # one slice of the grid, merged into the table
        [--trace]                              # and each fused case's kernels per token and per layer
        [--page-size N]                        # DeepSeek: the latent cache in pages of N tokens
        [--data-parallel N]                    # the rows over N devices (weights on each)
    python benchmarks/decode_e2e.py --smoke --out-dir /tmp/x     # tiny models, runs on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

try:
    import flax_models  # noqa: F401
except ImportError:  # running from a source checkout: the repo root, after installed packages
    sys.path.append(str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
from jax_cluster.tuning import steady_seconds  # noqa: E402
from flax_models import ops  # noqa: E402
from flax_models.engine import Engine, cache_slots  # noqa: E402
from flax_models.loading import parse_dtype  # noqa: E402
from flax_models.presets import PRESETS, random_model  # noqa: E402

MODELS = {"llama2-7b": "llama-2-7b", "llama3-8b": "llama-3-8b", "llama3.2-1b": "llama-3.2-1b",
          "mistral-7b": "mistral-7b", "pythia-1b": "pythia-1b",
          "pythia-2.8b": "pythia-2.8b", "pythia-6.9b": "pythia-6.9b", "deepseek-v2-lite": "deepseek-v2-lite"}
SMOKE_MODELS = {"tiny-llama": "tiny-llama", "tiny-mistral": "tiny-mistral", "tiny-pythia": "tiny-pythia",
                "tiny-deepseek": "tiny-deepseek"}


def fused_impl(cfg=None):
    """Per-component impl on every jax_cluster op that exists for this model, or None when
    there is none: on a GPU each op's impl="auto" (its tuner's pick per shape among our
    kernel configurations and XLA's ops), on CPU "fused" (the ops' C++ handlers: a check of
    the path, not a timing). Only SwiGLU MLPs (Llama, DeepSeek) have a fused MLP op."""
    swiglu_mlp = cfg is None or getattr(cfg, "architecture", "llama") != "gpt_neox"
    mla = cfg is not None and hasattr(cfg, "kv_lora_rank")  # DeepSeek-V2: MLA and MoE
    on = "auto" if ops.on_gpu() else "fused"
    attention_op, mlp_ops = ("mla_decode", ("moe_decode", "swiglu")) if mla else ("attention_block", ("swiglu",))
    comp = {"attention": on if ops.fused_available(attention_op) else "xla",
            "mlp": on if swiglu_mlp and all(ops.fused_available(o) for o in mlp_ops) else "xla"}
    return {**comp, "layer": "xla"} if on in comp.values() else None  # per-op blocks; whole layers: one_launch


def layer_windows(cfg) -> list:
    """Each layer's sliding window, or None where it attends to every token (non-Llama: None)."""
    window = getattr(cfg, "layer_window", lambda i: None)
    return [window(i) for i in range(cfg.num_layers)]


def one_launch_impl(cfg):
    """Whole layers on jax_cluster.decoder_layer's one-launch kernel (Llama and GPT-NeoX; a sliding
    window's rolling cache included), or None."""
    if getattr(cfg, "architecture", None) not in ("llama", "gpt_neox") or not ops.fused_available("decoder_layer"):
        return None
    return {"layer": "fused"}


def param_bytes(model) -> int:
    from flax import nnx  # noqa: PLC0415

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def kv_bytes_per_step(cfg, batch, ctx, itemsize) -> int:
    if hasattr(cfg, "kv_lora_rank"):  # MLA: one latent row per token and layer
        return cfg.num_layers * batch * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
    tokens = sum(ctx if w is None else min(ctx, w) for w in layer_windows(cfg))  # a window: its last tokens
    return 2 * batch * cfg.num_kv_heads * tokens * cfg.head_dim * itemsize


def weight_bytes_per_step(cfg, wbytes, batch, itemsize) -> int:
    """The weight bytes one decode step reads: all of them, except for MoE layers' routed
    experts, of which only the chosen ones (expected distinct experts over the batch)."""
    if not getattr(cfg, "n_routed_experts", 0):
        return wbytes
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    active = e * (1 - (1 - k / e) ** batch)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    return int(wbytes - moe_layers * (e - active) * per_expert)


def random_cache(model, batch, max_len, ctx, seed=0, page_size=None):
    """A cache of random values with ctx tokens in every row; with page_size, MLA's latent
    cache in pages of a shuffled pool (the rows' pages scattered over it)."""
    if page_size is None:
        cache = model.init_cache(batch, max_len)
    else:
        blocks = -(-max_len // page_size)
        table = np.random.default_rng(seed).permutation(batch * blocks).reshape(batch, blocks).astype(np.int32)
        cache = model.init_cache(batch, max_len, page_size=page_size, block_table=table)
    key = jax.random.key(seed)
    fill = jax.jit(lambda k, a: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype), donate_argnums=(1,))
    lengths = jnp.full((batch,), ctx, jnp.int32)
    if hasattr(cache, "latent"):  # DeepSeek-V2's latent cache
        latent = tuple(fill(jax.random.fold_in(key, i), a) for i, a in enumerate(cache.latent))
        return dataclasses.replace(cache, latent=latent, lengths=lengths)
    k = tuple(fill(jax.random.fold_in(key, 2 * i), a) for i, a in enumerate(cache.k))
    v = tuple(fill(jax.random.fold_in(key, 2 * i + 1), a) for i, a in enumerate(cache.v))
    return dataclasses.replace(cache, k=k, v=v, lengths=lengths)


def time_decode(model, impl, batch, ctx, steps, trials, trace=None, page_size=None, mesh=None):
    """Seconds per decode step (one token for every row) at context ctx; with trace (a
    label), also prints the kernel timeline of two calls (common.print_timeline: time per
    kernel per step, the gaps between kernels); with a mesh, the rows sharded over its axis
    "data" and the weights replicated."""
    engine = Engine(model, impl=impl)
    loop = engine.loop(steps)

    def run(state, tok, cache, key):
        cache = dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, ctx))  # same slots every call
        return loop(state, tok, cache, key)

    run = jax.jit(run, donate_argnums=(2,))
    # slots for ctx + steps, rounded as the engine allocates them (XLA pads a cache whose
    # length is not a multiple of 32: a copy of it every step)
    cache = random_cache(model, batch, cache_slots(ctx + steps), ctx, page_size=page_size)
    state = [jnp.arange(batch, dtype=jnp.int32) % model.config.vocab_size, cache, jax.random.key(1)]
    del cache
    weights = engine.state
    if mesh is not None:
        rows, whole = (NamedSharding(mesh, spec) for spec in (P("data"), P()))
        state = [jax.device_put(state[0], rows), jax.device_put(state[1], rows), jax.device_put(state[2], whole)]
        weights = jax.device_put(weights, whole)

    def call():  # each call continues from the last one's tokens, cache and key
        state[:] = run(weights, *state)
        return state[0]

    # per call in a loop of back-to-back calls: one call's host dispatch latency left out
    seconds = steady_seconds(call, warmup=1, trials=trials)
    if trace:
        common.print_timeline(trace, call, calls=steps, first=0, top=24)
    del state[:]
    return seconds / steps


def device_memory_bytes() -> int | None:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001 - CPU has no memory_stats
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="b1 ctx4096 and b16 ctx1024 only")
    p.add_argument("--smoke", action="store_true", help="tiny models, tiny contexts (CPU)")
    p.add_argument("--dtype", default="fp16", help="fp16, bf16 or a comma list")
    p.add_argument("--models", default=None, help="comma list of " + ", ".join(MODELS))
    p.add_argument("--steps", type=int, default=None, help="decode steps inside one jit (default 16; smoke 2)")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--combos", default=None, help="batch:context pairs, e.g. 16:4096,1:16384 (default: the grid)")
    p.add_argument("--trace", action="store_true", help="also print each fused and one_launch case's "
                   "kernel timeline (CUPTI through jax.profiler): time per kernel per token, gaps, "
                   "and what each kernel of a layer adds to it")
    p.add_argument("--page-size", type=int, default=None, help="DeepSeek models: the latent cache in pages "
                   "of this many tokens, shuffled over the pool (other models are left out)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="the batch's rows over N devices, the weights replicated on each (case suffix dpN)")
    p.add_argument("--part", default=None, help="this run is one slice of the grid: its rows are merged "
                   "into the table (a case measured again replaces its row)")
    args = p.parse_args(argv)
    if args.out_dir:
        common.RESULTS_DIR = Path(args.out_dir)

    if args.smoke:
        batches, contexts = [1, 2], [64]
        models = {m: SMOKE_MODELS[m] for m in args.models.split(",")} if args.models else SMOKE_MODELS
        steps, trials, name = args.steps or 2, args.trials or 1, "decode_e2e_smoke"
        dtypes = args.dtype.split(",")  # fp16: the dtype the fused ops (their CPU handlers too) take
    else:
        models = {m: MODELS[m] for m in (args.models.split(",") if args.models else MODELS)}
        batches, contexts = [1, 16], [1024, 4096, 16384]
        steps, trials, name = args.steps or 16, args.trials or 5, "decode_e2e"
        dtypes = args.dtype.split(",")
    combos = [(b, c) for b in batches for c in contexts]
    if args.quick and not args.smoke:
        combos = [(1, 4096), (16, 1024)]
    if args.combos:
        combos = [tuple(map(int, c.split(":"))) for c in args.combos.split(",")]

    dp = args.data_parallel
    if not 1 <= dp <= len(jax.devices()):
        p.error(f"--data-parallel {dp}: between 1 and the {len(jax.devices())} devices here")
    if dp > 1 and args.page_size:
        p.error("--data-parallel with --page-size: a page pool is shared by the rows, it is not split")
    mesh = (jax.make_mesh((dp,), ("data",), devices=jax.devices()[:dp], axis_types=(AxisType.Auto,))
            if dp > 1 else None)
    bw = common.measure_bandwidth(0.0625 if args.smoke else 2.0)
    mem = device_memory_bytes()
    fused = fused_impl()
    print(f"device {common.device_name()}, bandwidth {bw / 1e9:.0f} GB/s, fused ops: {fused or 'none'}")
    rows = []
    save = _saver(name, steps, trials, bw, fused, args.part)
    for tag, preset in models.items():
        cfg = PRESETS[preset]
        if args.page_size and not hasattr(cfg, "kv_lora_rank"):
            print(f"{tag}: left out (--page-size: a paged cache is MLA's)")
            continue
        for dt in dtypes:
            dtype = parse_dtype(dt)
            t0 = time.perf_counter()
            model = random_model(cfg, dtype, seed=0)
            wbytes = param_bytes(model)
            print(f"{tag} {dt}: {wbytes / 1e9:.2f} GB of weights, made in {time.perf_counter() - t0:.1f} s")
            for batch, ctx in combos:
                kv = kv_bytes_per_step(cfg, batch, ctx, jnp.dtype(dtype).itemsize)
                base = (f"{tag} b{batch} ctx{ctx} {dt}" + (f" paged{args.page_size}" if args.page_size else "")
                        + (f" dp{dp}" if dp > 1 else ""))
                if batch % dp:
                    rows.append({"case": f"{base} xla", "skipped": f"{batch} rows do not split over {dp} devices"})
                    print(rows[-1])
                    continue
                kv //= dp  # a device reads its own rows' cache
                need = wbytes + kv * (ctx + steps) / ctx
                if mem is not None and need > 0.92 * mem:
                    rows.append({"case": f"{base} xla", "skipped": f"needs {need / 1e9:.0f} GB > device memory"})
                    print(rows[-1])
                    continue
                read = weight_bytes_per_step(cfg, wbytes, batch // dp, jnp.dtype(dtype).itemsize)  # per device
                floor_s = (read + kv) / bw
                fused = fused_impl(cfg)
                layer = one_launch_impl(cfg)
                variants = ([("xla", "xla")] + ([("fused", fused)] if fused else [])
                            + ([("one_launch", layer)] if layer else []))
                xla_s = None
                for vname, impl in variants:
                    try:
                        s = time_decode(model, impl, batch, ctx, steps, trials,
                                        trace=f"{base} {vname}" if args.trace and vname != "xla" else None,
                                        page_size=args.page_size, mesh=mesh)
                    except ValueError as exc:  # the one-launch kernel's coverage (e.g. rows), named
                        if vname != "one_launch":
                            raise
                        rows.append({"case": f"{base} {vname}", "skipped": str(exc)[:200]})
                        print(rows[-1])
                        save(rows)
                        continue
                    except jax.errors.JaxRuntimeError as exc:  # the estimate above is a floor
                        if "RESOURCE_EXHAUSTED" not in str(exc):
                            raise
                        rows.append({"case": f"{base} {vname}", "skipped": "out of device memory"})
                        print(rows[-1])
                        save(rows)
                        break
                    xla_s = s if vname == "xla" else xla_s
                    row = {"case": f"{base} {vname}", "ours_us": s * 1e6, "xla_us": xla_s * 1e6,
                           "speedup_vs_xla": xla_s / s, "roofline_fraction": floor_s / s, "bytes": read + kv,
                           "weight_bytes": wbytes, "kv_bytes": kv, "tokens_per_s": batch / s,
                           "impl": impl if isinstance(impl, str) else ",".join(f"{k}={v}" for k, v in impl.items())}
                    rows.append(row)
                    print(f"{row['case']:38s} {row['ours_us']:10.1f} us/token  x{row['speedup_vs_xla']:.2f} vs xla  "
                          f"{100 * row['roofline_fraction']:5.1f}% of roofline")
                    save(rows)  # after every case: a run cut short still leaves its numbers
            del model
    return save(rows)


COLUMNS = ["case", "ours_us", "xla_us", "speedup_vs_xla", "roofline_fraction", "bytes", "tokens_per_s", "skipped"]


def _saver(name, steps, trials, bw, fused, part=None):
    def save(rows):
        notes = (f"Per output token (one decode step of the whole batch), {steps} steps inside one jit, median "
                 f"of {trials}. Roofline floor = (weight bytes read + KV bytes at ctx) / {bw / 1e9:.0f} GB/s "
                 f"measured. fused = {fused or 'no fused op available'} (the ops' tuners may pick XLA's own "
                 "ops per shape where they measure faster than the kernels).")
        common.write_results(name, rows, notes=notes, extra={"bandwidth_bytes_per_s": bw},
                             columns=COLUMNS, part=part)
        return 0
    return save


if __name__ == "__main__":
    sys.exit(main())
