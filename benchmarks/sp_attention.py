"""Sequence-parallel attention (StreamFusion) per layer: measured on 2 GPUs, and predicted.

1. On 2 GPUs (treated as 2 machines x 1 GPU, so Torus has T = 2 and the "inter-machine" link is
   the GPUs' NVLink): each schedule's per-layer time for Flux attention (24 heads x 128, bf16,
   batch 1) at L = 16K, 32K, 64K, with XLA's overlap flags; the same runs without overlap
   (async collectives off, in a child process) for ring / ulysses / torus at one length; the
   simulator's prediction for every run, from the single-GPU kernel times and the p2p bandwidth
   measured in the same run.
2. The simulator's predictions for N = 2, 4, 8 machines x 8 GPUs with 400 Gb/s per machine
   between machines (StreamFusion's p4de setup) and 450 GB/s per GPU within.

Modes:
    python benchmarks/sp_attention.py                  # needs >= 2 GPUs; writes results/sp_attention.*
    python benchmarks/sp_attention.py --simulate-only  # CPU: predictions only (sp_attention_simulated.*)
    python benchmarks/sp_attention.py --fake-devices   # CPU smoke test: 8 fake devices, tiny shapes
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 24, 128
SCHEDULES = ("ulysses", "ring", "usp", "tas", "torus")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate-only", action="store_true", help="predictions only, no devices needed")
    ap.add_argument("--fake-devices", action="store_true", help="CPU smoke run on 8 fake devices, tiny shapes")
    ap.add_argument("--lengths", default="8192,16384,32768,65536",
                    help="8K is there to make overlap visible: at 32K+ two GPUs are compute-bound")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--kernel", default="flash_attention", choices=["flash_attention", "cudnn", "xla"],
                    help="local attention kernel: jax_cluster.flash_attention (default), jax's cuDNN, or "
                         "the op's XLA formulation")
    ap.add_argument("--no-overlap-lengths", default="8192,32768", help="lengths of the no-overlap runs ('': none)")
    ap.add_argument("--machines", default="2,4,8", help="machines for the predictions (x --gpus)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--predict-lengths", default="16384,32768,65536,131072")
    ap.add_argument("--inter-gbps", type=float, default=400.0, help="Gb/s per machine between machines")
    ap.add_argument("--intra-gbs", type=float, default=450.0, help="GB/s per GPU within a machine")
    ap.add_argument("--tflops", type=float, default=None, help="kernel model for --simulate-only")
    ap.add_argument("--launch-us", type=float, default=10.0)
    ap.add_argument("--no-overlap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _set_flags(args):
    """XLA flags before jax starts a backend (loads flags.py standalone: no package import)."""
    if args.fake_devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=8"
        return
    if args.simulate_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        return
    spec = importlib.util.spec_from_file_location("_sp_flags", ROOT / "jax_cluster" / "parallel" / "flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.set_overlap_flags(not args.no_overlap)


ARGS = _args()
_set_flags(ARGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from jax_cluster import parallel as sp  # noqa: E402
from jax_cluster.parallel import gpu_kernels  # noqa: E402


def _case(length, dtype, name, machines=None, gpus=None):
    n = f" n{machines}x{gpus}" if machines else ""
    return f"flux b1 l{length}{n} {dtype} {name}"


def _layer_loop(fn, iters):
    @jax.jit
    def run(q, k, v):
        return jax.lax.fori_loop(0, iters, lambda i, x: fn(x, k, v), q)
    return run


def _time(fn, *args, warmup=1, trials=3):
    return common.time_fn(fn, *args, warmup=warmup, trials=trials)


def random_qkv(seed, lq, lk, heads, dtype, where):
    """q [1, lq, heads, HEAD_DIM] and k, v [1, lk, ...] of the given seed, placed on `where`
    (a device or a sharding)."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = common.random_normal(kq, (1, lq, heads, HEAD_DIM), dtype)
    k, v = (common.random_normal(x, (1, lk, heads, HEAD_DIM), dtype) for x in (kk, kv))
    return tuple(jax.device_put(x, where) for x in (q, k, v))


def calibrate_kernel(kernel, dtype, lengths, device):
    """Single-GPU times of the local kernel at the shapes the schedules launch -> KernelModel."""
    samples, table = [], []
    shapes = sorted({(l // 2, l // 2, HEADS // 2) for l in lengths} | {(l, l, HEADS // 2) for l in lengths[:1]}
                    | {(l // 2, l // 2, HEADS) for l in lengths[:1]} | {(1024, 1024, 12), (2048, 2048, 12)})
    for lq, lk, h in shapes:
        q, k, v = random_qkv(lq + lk + h, lq, lk, h, dtype, device)
        iters = max(2, min(1000, int(4e13 / (4 * lq * lk * h * HEAD_DIM))))
        step = lambda x, k, v: sp.finalize(kernel(x, [(k, v)], None, scale=HEAD_DIM ** -0.5), dtype)  # noqa: E731
        t = _time(_layer_loop(step, iters), q, k, v) / iters
        flops = 4 * lq * lk * h * HEAD_DIM
        samples.append((flops, t))
        table.append({"q_len": lq, "kv_len": lk, "heads": h, "us": t * 1e6, "tflops": flops / t / 1e12})
    return sp.KernelModel.fit(samples), table


def measure_p2p_bandwidth(devices, nbytes=256 << 20, iters=10):
    """Bytes/s of a ppermute between the 2 devices (each sends nbytes to the other)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(devices[:2]), ("x",))
    n = nbytes // 2
    x = jax.device_put(jnp.ones((2 * n,), jnp.bfloat16), NamedSharding(mesh, P("x")))

    def body(x):
        return jax.lax.fori_loop(0, iters, lambda i, y: jax.lax.ppermute(y, "x", [(0, 1), (1, 0)]), x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    t = _time(f, x) / iters
    return nbytes / t, t


def _same_program(a, b):
    return a.steps == b.steps and [a.layout.size(x) for x in "uo ui ro ri".split()] == \
        [b.layout.size(x) for x in "uo ui ro ri".split()]


def measure_schedules(devices, lengths, schedules, kernel, dtype, iters_for, machines=2):
    rows = []
    for length in lengths:
        built = {}
        for name in schedules:
            plan = sp.plan(name, heads=HEADS, devices=devices, num_machines=machines)
            shape = sp.AttnShape(1, length, HEADS, HEAD_DIM, np.dtype(dtype).itemsize)
            sched = plan.build(shape)
            twin = next((o for o, (s, _) in built.items() if _same_program(s, sched)), None)
            row = {"case": _case(length, common.dtype_tag(dtype), name), "schedule": name, "seq_len": length,
                   "ulysses_degree": plan.ulysses_degree, "ring_degree": plan.ring_degree,
                   "layout": dict(plan.layout.shape)}
            if twin is not None:  # identical program on this mesh: reuse the timing
                row.update({k: v for k, v in built[twin][1].items() if k in ("ours_us",)})
                row["same_program_as"] = twin
            else:
                q, k, v = random_qkv(length, length, length, HEADS, dtype, plan.sharding())
                iters = iters_for(length)
                run = _layer_loop(lambda x, k, v, p=plan: sp.sp_attention(x, k, v, p, kernel=kernel), iters)
                t0 = time.perf_counter()
                jax.block_until_ready(run(q, k, v))
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                row["ours_us"] = _time(run, q, k, v) / iters * 1e6
                # correctness spot check of one layer against the single-device kernel
                out = jax.jit(lambda q, k, v, p=plan: sp.sp_attention(q, k, v, p, kernel=kernel))(q, k, v)
                ref = sp.attention(q[:, :2048], k, v, kernel=kernel) if length > 2048 else None
                if ref is not None:
                    row["check_rel_err"] = float(jnp.linalg.norm((out[:, :2048] - ref).astype(jnp.float32))
                                                 / jnp.linalg.norm(ref.astype(jnp.float32)))
            built[name] = (sched, row)
            rows.append(row)
            print(f"  {row['case']:40s} {row.get('ours_us', float('nan')):10.1f} us", flush=True)
    return rows


def no_overlap_child(args, lengths, schedules):
    """Re-run some schedules in a child process whose XLA flags disable async collectives."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        launcher = os.environ.get("SP_BENCH_LAUNCHER", __file__)  # a wrapper may set up imports
        cmd = [sys.executable, launcher, "--no-overlap", "--child-out", str(out), "--lengths",
               ",".join(map(str, lengths)), "--schedules", ",".join(schedules), "--kernel", args.kernel]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        if proc.returncode or not out.exists():
            print("no-overlap child failed:\n" + proc.stdout[-2000:] + proc.stderr[-3000:], flush=True)
            return {}
        return {r["case"]: r.get("ours_us") for r in json.loads(out.read_text())}


def local_kernel(name):
    """(name, hook kernel) of --kernel; cuDNN only where it passes its check on this device."""
    if name == "cudnn":
        return gpu_kernels.select_kernel("cudnn")
    return name, sp.get_kernel(name)


def measure_one_gpu(device, lengths, kernel, dtype, iters_for):
    """The whole sequence on ONE GPU with the same local kernel: what 2 GPUs should halve."""
    times = {}
    for length in lengths:
        q, k, v = random_qkv(length, length, length, HEADS, dtype, device)
        iters = iters_for(length)
        run = _layer_loop(lambda x, k, v: sp.attention(x, k, v, kernel=kernel), iters)
        times[length] = _time(run, q, k, v) / iters * 1e6
        print(f"  one GPU l{length}: {times[length]:.1f} us", flush=True)
    return times


def _iters_for(length):
    return max(2, min(20, int(20 * (16384 / length) ** 2)))


def predictions(km, args, intra_bw, inter_bw, dtype_tag="bf16"):
    rows = []
    for n in [int(x) for x in args.machines.split(",")]:
        for length in [int(x) for x in args.predict_lengths.split(",")]:
            res = sp.simulate(n, args.gpus, length, HEADS, HEAD_DIM, dtype_tag, kernel=km,
                              links=sp.Links(intra_bw=intra_bw, inter_bw=inter_bw))
            usp = res.get("usp")
            for name, r in res.items():
                row = {"case": _case(length, dtype_tag, name, n, args.gpus), "kind": "predicted",
                       "schedule": name, "machines": n, "gpus_per_machine": args.gpus, "seq_len": length}
                if isinstance(r, str):
                    row["error"] = r
                else:
                    row.update(predicted_us=r.latency_s * 1e6, compute_us=r.compute_s * 1e6,
                               exposed_comm_us=r.exposed_comm_s * 1e6, bytes=r.inter_bytes,
                               ulysses_degree=r.ulysses_degree, ring_degree=r.ring_degree)
                    if not isinstance(usp, str):
                        row["speedup_vs_usp"] = usp.latency_s / r.latency_s
                rows.append(row)
    return rows


def main(args):
    lengths = [int(x) for x in args.lengths.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    dtype = jnp.bfloat16
    if args.child_out:  # no-overlap child: measure and hand the rows back
        devices = jax.devices()[:2]
        name, kernel = local_kernel(args.kernel)
        rows = measure_schedules(devices, lengths, schedules, kernel, dtype, _iters_for)
        Path(args.child_out).write_text(json.dumps(rows))
        return
    intra_bw, inter_bw = args.intra_gbs * 1e9, args.inter_gbps * sp.GBPS
    if args.simulate_only:
        km = sp.KernelModel(tflops=args.tflops or 400.0, launch_s=args.launch_us * 1e-6)
        rows = predictions(km, args, intra_bw, inter_bw)
        _print(rows)
        common.write_results("sp_attention_simulated", rows, columns=PRED_COLUMNS, notes=(
            f"Simulator only (no measurement): kernel model {km.tflops:.0f} TFLOP/s + {km.launch_s * 1e6:.0f} us "
            f"per launch, {args.intra_gbs:.0f} GB/s per GPU within a machine, {args.inter_gbps:.0f} Gb/s per machine "
            "between machines (shared by its GPUs)."))
        return
    if args.fake_devices:
        devices = jax.devices()
        common.RESULTS_DIR = Path(tempfile.mkdtemp(prefix="sp_attention_smoke_"))
        lengths = [int(x) for x in (args.lengths if args.lengths != _args([]).lengths else "256,512").split(",")]
        kname, kernel = "xla", sp.attend
        rows = measure_schedules(devices, lengths, schedules, kernel, jnp.float32, lambda l: 2)
        km = sp.KernelModel()
        args.machines, args.predict_lengths = "2", "4096"
        rows += predictions(km, args, intra_bw, inter_bw)
        _print(rows)
        path = common.write_results("sp_attention", rows, columns=MEAS_COLUMNS + ["predicted_us"],
                                    notes="smoke run on fake CPU devices")
        print(f"smoke results (not committed): {path}")
        return
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        sys.exit("needs 2 GPUs (use --simulate-only or --fake-devices)")
    devices = gpus[:2]
    kname, kernel = local_kernel(args.kernel)
    print(f"kernel: {kname}", flush=True)
    km, ktable = calibrate_kernel(kernel, dtype, lengths, devices[0])
    print(f"kernel model: {km.tflops:.0f} TFLOP/s + {km.launch_s * 1e6:.1f} us/launch", flush=True)
    p2p_bw, _ = measure_p2p_bandwidth(devices)
    print(f"p2p: {p2p_bw / 1e9:.0f} GB/s per direction", flush=True)
    one_gpu = measure_one_gpu(devices[0], lengths, kernel, dtype, _iters_for)
    rows = measure_schedules(devices, lengths, schedules, kernel, dtype, _iters_for)
    nov = {}
    if args.no_overlap_lengths:
        nov = no_overlap_child(args, [int(x) for x in args.no_overlap_lengths.split(",")],
                               [s for s in ("ulysses", "ring", "torus") if s in schedules])
    links2 = sp.Links(intra_bw=p2p_bw, inter_bw=p2p_bw, intra_latency=10e-6, inter_latency=10e-6, nic_per_gpu=True)
    by_len = {}
    for row in rows:
        shape = sp.AttnShape(1, row["seq_len"], HEADS, HEAD_DIM, 2)
        sched = sp.schedule_for(row["schedule"], 2, 1, shape)
        pred = sp.simulate_schedule(sched, km, links2)
        row["predicted_us"] = pred.latency_s * 1e6
        row["prediction_ratio"] = row["predicted_us"] / row["ours_us"]
        row["bytes"] = pred.inter_bytes
        row["one_gpu_us"] = one_gpu[row["seq_len"]]
        row["speedup_vs_one_gpu"] = row["one_gpu_us"] / row["ours_us"]
        if row["case"] in nov and nov[row["case"]]:
            row["no_overlap_us"] = nov[row["case"]]
            row["overlap_speedup"] = nov[row["case"]] / row["ours_us"]
            row["predicted_no_overlap_us"] = sp.simulate_schedule(sched, km, links2, overlap=False).latency_s * 1e6
        by_len.setdefault(row["seq_len"], {})[row["schedule"]] = row
    for group in by_len.values():
        if "usp" in group:
            for row in group.values():
                row["speedup_vs_usp"] = group["usp"]["ours_us"] / row["ours_us"]
    rows += predictions(km, args, intra_bw, inter_bw)
    _print(rows)
    notes = (f"Measured on 2 GPUs as 2 machines x 1 GPU (Torus T=2; the 'inter-machine' link is the GPUs' "
             f"NVLink, {p2p_bw / 1e9:.0f} GB/s per direction measured by ppermute). Local kernel: {kname}; "
             f"kernel model fitted to single-GPU runs: {km.tflops:.0f} TFLOP/s + {km.launch_s * 1e6:.1f} us per "
             f"launch. one_gpu_us: the whole sequence on one GPU with the same kernel (ideal "
             f"speedup_vs_one_gpu: 2). On 2 GPUs ulysses, usp and tas are the same program (P_u = 2, P_r = 1). "
             f"Rows 'predicted': "
             f"simulator only, N machines x {args.gpus} GPUs, {args.inter_gbps:.0f} Gb/s per machine between "
             f"machines, {args.intra_gbs:.0f} GB/s per GPU within; not measured.")
    common.write_results("sp_attention", rows, columns=MEAS_COLUMNS + EXTRA_COLUMNS, notes=notes, extra={
        "kernel": kname, "kernel_model": {"tflops": km.tflops, "launch_us": km.launch_s * 1e6},
        "kernel_calibration": ktable, "p2p_gbytes_per_s": p2p_bw / 1e9,
        "xla_flags": os.environ.get("XLA_FLAGS", "")})


MEAS_COLUMNS = ["case", "ours_us", "no_overlap_us", "overlap_speedup", "speedup_vs_usp", "one_gpu_us",
                "speedup_vs_one_gpu", "predicted_us", "prediction_ratio"]
PRED_COLUMNS = ["case", "predicted_us", "compute_us", "exposed_comm_us", "speedup_vs_usp", "bytes", "error"]
EXTRA_COLUMNS = ["predicted_no_overlap_us", "compute_us", "exposed_comm_us", "bytes", "check_rel_err", "error"]


def _print(rows):
    for r in rows:
        vals = " ".join(f"{k}={r[k]:.1f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                        for k in ("ours_us", "no_overlap_us", "predicted_us", "speedup_vs_usp") if k in r)
        print(f"{r['case']:44s} {vals} {r.get('error', '')}")


if __name__ == "__main__":
    main(ARGS)
