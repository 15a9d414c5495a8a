"""Sequence-parallel attention on 2 GPUs as 2 processes: the NVSHMEM backend against the XLA one.

Per shape (Flux 24 heads x 128, CogVideoX 48 x 64; bf16, batch 1) and length: the whole
sequence on one GPU, then ring and torus with ``backend="xla"`` and ``backend="nvshmem"``
(and ulysses, XLA only, as the all-to-all reference), each as a layer loop inside one jit.
Every nvshmem row also says whether two runs were bitwise equal and whether the result is
bitwise equal to the XLA backend's (it should be: the same kernels on the same chunks).

    python benchmarks/sp_attention_nvshmem.py [--lengths 16384,65536] [--shapes flux,cogvideox] [--trace]

starts itself as 2 processes (one GPU each, jax_cluster.parallel.launch); rank 0 writes
results/sp_attention_nvshmem.{md,json} after every case. It ends with a bare transfer sweep
(``--sweep-mb``): ppermute, NVSHMEM put + wait + barrier, and a local copy of each size.

    python benchmarks/sp_attention_nvshmem.py --predict results/sp_attention_nvshmem_h100.json

(CPU) fits the simulator to such a table: each backend's link to its transfer sweep, the
arena copy-out to the local copies, the kernel model to the one-GPU rows; then predicts ring
and torus per backend, first on the measured 2 x 1 (against the measurements), then on 4
and 8 machines x 8 GPUs (results/sp_attention_nvshmem_predicted.{md,json}).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"flux": (24, 128), "cogvideox": (48, 64)}
# nvshmem: arrivals read in place; nvshmem-copy: every arrival copied out of the arena first
BACKENDS = ("xla", "nvshmem", "nvshmem-copy")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--shapes", default="flux,cogvideox", help=f"of {sorted(SHAPES)}")
    ap.add_argument("--schedules", default="ring,torus,ulysses")
    ap.add_argument("--kernel", default="flash_attention", choices=["flash_attention", "xla"])
    ap.add_argument("--copy-out", action="store_true",
                    help="also rows 'nvshmem-copy': every arrival copied out of the arena (no in-place reads)")
    ap.add_argument("--part", default=None, help="merge into the table as this part (common.write_results)")
    ap.add_argument("--trace", action="store_true",
                    help="after each ring / torus row, every GPU stream's activity in one call (common.print_streams)")
    ap.add_argument("--timeout", type=float, default=560.0, help="seconds before the launcher kills both ranks")
    ap.add_argument("--sweep-mb", default="16,64,256",
                    help="bare transfers after the layers: MB each GPU sends per round, by ppermute and by put ('': none)")
    ap.add_argument("--predict", default=None, metavar="JSON",
                    help="no devices: fit the simulator to this measured table and predict (see above)")
    ap.add_argument("--predict-machines", default="4,8", help="with --predict: machines of 8 GPUs")
    return ap.parse_args(argv)


def _launch_self(args) -> int:
    from jax_cluster.parallel import launch  # noqa: PLC0415

    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONPATH": str(ROOT / "benchmarks")}
    res = launch.launch([sys.executable, *sys.argv], 2, timeout=args.timeout, gpus=True, env=env)
    return res.returncode


def _set_overlap_flags():
    spec = importlib.util.spec_from_file_location("_sp_flags", ROOT / "jax_cluster" / "parallel" / "flags.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.set_overlap_flags(True)


def main(args) -> None:
    _set_overlap_flags()
    from jax_cluster.parallel.launch import init_distributed  # noqa: PLC0415

    rank, _ = init_distributed(timeout_s=120)
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    import common  # noqa: PLC0415
    from jax_cluster import parallel as sp  # noqa: PLC0415
    from jax_cluster.parallel import nvshmem, nvshmem_backend as nb  # noqa: PLC0415

    dtype = jnp.bfloat16
    lengths = [int(x) for x in args.lengths.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    schedules = [s for s in args.schedules.split(",") if s]
    kernel = sp.get_kernel(args.kernel)
    local = jax.local_devices()[0]
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    # The arena is allocated once: size it for the largest plan first (every rank, same order).
    big = max(((s, l, n) for s in shapes for l in lengths for n in schedules if n != "ulysses"),
              key=lambda t: nvshmem.arena_layout(sp.plan(t[2], heads=SHAPES[t[0]][0], devices=jax.devices())
                                                 .build(sp.AttnShape(1, t[1], *SHAPES[t[0]], 2))).total_bytes)
    st = nvshmem.init(sp.plan(big[2], heads=SHAPES[big[0]][0], devices=jax.devices()),
                      sp.AttnShape(1, big[1], *SHAPES[big[0]], 2), dtype)
    say(f"nvshmem: {st} (arena {st.arena_bytes / 2**20:.0f} MiB, sized for {big})")
    if not st.available:
        raise SystemExit(f"the NVSHMEM backend is not available here: {st.reason}")

    def qkv(seed, length, heads, hd, sharding):
        def part(a):
            return jax.make_array_from_callback(
                (1, length, heads, hd), sharding,
                lambda i: jnp.asarray(a[i], dtype))
        x = np.random.default_rng(seed).standard_normal((3, 1, length, heads, hd), dtype=np.float32)
        return tuple(part(a) for a in x)

    def layer_loop(fn, iters):
        return jax.jit(lambda q, k, v: jax.lax.fori_loop(0, iters, lambda i, x: fn(x, k, v), q))

    def gathered(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    rows = []
    for shape_name in shapes:
        heads, hd = SHAPES[shape_name]
        for length in lengths:
            iters = max(2, min(20, int(20 * (16384 / length) ** 2)))
            # one GPU, the whole sequence, the same local kernel (every rank on its own GPU)
            q1, k1, v1 = (jax.device_put(jnp.asarray(np.random.default_rng(s).standard_normal(
                (1, length, heads, hd), dtype=np.float32), dtype), local) for s in range(3))
            one = layer_loop(lambda x, k, v: sp.attention(x, k, v, kernel=kernel), iters)
            one_us = common.time_fn(one, q1, k1, v1, warmup=1, trials=3) / iters * 1e6
            del q1, k1, v1
            say(f"{shape_name} l{length}: one GPU {one_us:.1f} us")
            xla_out = {}
            for name in schedules:
                plan = sp.plan(name, heads=heads, devices=jax.devices())
                q, k, v = qkv(length, length, heads, hd, plan.sharding())
                backends = ("xla", "nvshmem") + (("nvshmem-copy",) if args.copy_out else ())
                for backend in (("xla",) if name == "ulysses" else backends):
                    case = f"{shape_name} b1 l{length} bf16 {name} {backend}"
                    # nvshmem-copy: the NVSHMEM backend copying every arrival out (traced with the knob set)
                    os.environ[nb.COPY_OUT_ENV] = "1" if backend == "nvshmem-copy" else "0"
                    backend = backend.removesuffix("-copy")
                    f = jax.jit(lambda q, k, v, p=plan, b=backend: sp.sp_attention(q, k, v, p, kernel=kernel,
                                                                                    backend=b))
                    t0 = time.perf_counter()
                    out1 = gathered(f(q, k, v))
                    compile_s = time.perf_counter() - t0
                    out2 = gathered(f(q, k, v))
                    run = layer_loop(lambda x, k, v, p=plan, b=backend: sp.sp_attention(x, k, v, p, kernel=kernel,
                                                                                         backend=b), iters)
                    us = common.time_fn(run, q, k, v, warmup=1, trials=3) / iters * 1e6
                    row = {"case": case, "schedule": name, "backend": case.rsplit(" ", 1)[1], "seq_len": length,
                           "us": us, "one_gpu_us": one_us, "speedup_vs_one_gpu": one_us / us,
                           "bitwise_repeat": bool(np.array_equal(out1, out2)), "compile_s": round(compile_s, 1)}
                    os.environ[nb.COPY_OUT_ENV] = "0"
                    if backend == "xla":
                        xla_out[name] = (out1, us)
                    else:
                        ref, ref_us = xla_out[name]
                        row["equal_to_xla"] = bool(np.array_equal(out1, ref))
                        row["max_abs_diff_to_xla"] = float(np.abs(out1.astype(np.float32) - ref.astype(np.float32)).max())
                        row["vs_xla_backend"] = ref_us / us
                    rows.append(row)
                    say(f"  {case:44s} {us:10.1f} us  x{one_us / us:.3f} of one GPU  "
                        f"repeat-equal={row['bitwise_repeat']} {row.get('equal_to_xla', '')}")
                    if args.trace and name != "ulysses":  # each rank prints its own GPU's streams
                        common.print_streams(case, lambda f=f: f(q, k, v))  # f: compiled with its knob
                    if rank == 0:
                        common.write_results("sp_attention_nvshmem", rows, columns=COLUMNS, notes=NOTES, part=args.part)
                del q, k, v
    # last: a failure here (a device wait that traps loses the CUDA context) costs no layer row
    for r in transfer_sweep(st.arena_bytes, [int(x) for x in args.sweep_mb.split(",") if x]):
        rows.append(r)
        say(f"  {r['case']:44s} {r.get('us', float('nan')):10.1f} us  {r.get('gbytes_per_s', 0):6.1f} GB/s "
            f"{r.get('error', '')}")
        if rank == 0:
            common.write_results("sp_attention_nvshmem", rows, columns=COLUMNS, notes=NOTES, part=args.part)


def transfer_sweep(arena_bytes, sizes_mb, iters=10):
    """Each GPU sends n MB to the other, `iters` rounds inside one jit, with nothing beside the
    transfers: XLA's ppermute against put + wait + barrier through the NVSHMEM arena. The link
    the simulator needs (layer times hide the transfers under the attention)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: PLC0415

    import common  # noqa: PLC0415
    from jax_cluster.parallel import nvshmem, nvshmem_backend as nb  # noqa: PLC0415

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = []
    for mb in sizes_mb:
        nbytes = mb << 20
        try:  # collective: every rank sweeps the same sizes in the same order
            arena_bytes = nvshmem.grow(nvshmem.SIGNAL_BLOCK + nbytes)
        except Exception as e:  # noqa: BLE001 - e.g. the symmetric heap is too small
            rows.append({"case": f"transfer {mb}MB nvshmem", "backend": "nvshmem", "error": str(e)[:200]})
            continue
        arena = nvshmem.ArenaLayout({"x": (nvshmem.SIGNAL_BLOCK, nbytes)}, {"x": 1}, nvshmem.SIGNAL_BLOCK + nbytes)
        # bf16: nbytes / 2 elements = nbytes bytes on each of the 2 devices
        x = jax.make_array_from_callback((nbytes,), NamedSharding(mesh, P("x")),
                                         lambda i: np.ones((nbytes // 2,), jnp.bfloat16))

        def by_put(y):  # put, wait, copy out of the arena, barrier
            arrived = nb._wait(nb._put(y, region="x", arena=arena, peers=[1, 0]), y, region="x", arena=arena)
            return nb._barrier(nb._read(nb.ArenaSlot(arrived, "x", y.shape, y.dtype), arena=arena), arena=arena)

        steps = (("ppermute", lambda y: jax.lax.ppermute(y, "x", [(0, 1), (1, 0)])), ("nvshmem", by_put),
                 ("copy", jnp.flip))  # copy: what the arena's copy-out costs locally
        for how, step in steps:
            body = lambda y, step=step: jax.lax.fori_loop(0, iters, lambda i, z: step(z), y)  # noqa: E731
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
            try:
                t = common.time_fn(f, x, warmup=1, trials=3) / iters
            except Exception as e:  # noqa: BLE001 - a sweep that fails must not cost the layer rows
                rows.append({"case": f"transfer {mb}MB {how}", "backend": how, "error": str(e)[:200]})
                continue
            rows.append({"case": f"transfer {mb}MB {how}", "schedule": "transfer", "backend": how, "seq_len": 0,
                         "us": t * 1e6, "gbytes_per_s": nbytes / t / 1e9})
    return rows


def predict(table: Path, machines) -> tuple[list[dict], dict]:
    """The simulator fitted to a measured table (see the module docstring)."""
    import json  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from jax_cluster import parallel as sp  # noqa: PLC0415

    rows = json.loads(table.read_text())["rows"]
    sweep = {}
    for r in rows:
        if r.get("schedule") == "transfer" and "us" in r:
            mb = int(r["case"].split()[1].removesuffix("MB"))
            sweep.setdefault(r["backend"], []).append((mb << 20, r["us"] * 1e-6))
    missing = {"ppermute", "nvshmem", "copy"} - set(sweep)
    if missing:
        raise SystemExit(f"{table}: no transfer sweep rows for {sorted(missing)} (run the benchmark with --sweep-mb)")
    xla_lat, xla_bw = sp.fit_link(sweep["ppermute"])
    copy_lat, copy_bw = sp.fit_link(sweep["copy"])
    nv_lat, nv_slope_bw = sp.fit_link(sweep["nvshmem"])
    # a put + wait + barrier round = the put's link + the copy-out: the put's own bandwidth is
    # what is left of the round's slope after the copy's
    put_s_per_byte = 1.0 / nv_slope_bw - 1.0 / copy_bw
    put_bw = 1.0 / put_s_per_byte if put_s_per_byte > 0 else float("inf")
    put_lat = max(0.0, nv_lat - copy_lat)

    def models_for(machines_over_nvlink: bool):
        """(links, {backend: transport}): the 2 x 1 plan measured here crosses NVLink between
        its 'machines'; N x 8 crosses the simulator's default NIC (the same for both backends)."""
        if machines_over_nvlink:
            links = sp.Links(intra_bw=xla_bw, inter_bw=xla_bw, intra_latency=xla_lat, inter_latency=xla_lat)
            put = sp.Links(intra_bw=put_bw, inter_bw=put_bw, intra_latency=put_lat, inter_latency=put_lat)
        else:
            links = sp.Links(intra_bw=xla_bw, intra_latency=xla_lat)
            put = sp.Links(intra_bw=put_bw, intra_latency=put_lat)
        copy = sp.Transport(copy_bw=copy_bw, per_slot_s=copy_lat, shift_links=put)
        return links, {"xla": sp.Transport(), "nvshmem": dataclasses.replace(copy, in_place=True),
                       "nvshmem-copy": copy}
    fit = {"xla_link": (xla_lat, xla_bw), "copy": (copy_lat, copy_bw), "nvshmem_put": (nv_lat - copy_lat, put_bw)}

    one_gpu = {}  # (heads, head_dim) -> [(flops, s)]
    measured = {}
    for r in rows:
        if r.get("schedule") in ("ring", "torus") and r.get("one_gpu_us"):
            heads, hd = SHAPES[r["case"].split()[0]]
            one_gpu.setdefault((heads, hd), set()).add((4.0 * r["seq_len"] ** 2 * heads * hd, r["one_gpu_us"] * 1e-6))
            measured[(r["case"].split()[0], r["seq_len"], r["schedule"], r["backend"])] = r["us"]
    # throughput from the largest one-GPU run per head_dim, the simulator's default launch
    # cost: a fitted intercept over two or three lengths extrapolates badly to the small
    # chunks of 64 GPUs
    models = {hd: sp.KernelModel(tflops=max(v)[0] / max(v)[1] / 1e12) for (_, hd), v in one_gpu.items()}
    kernel = lambda b, lq, lk, h, d, s: models[d].time(b, lq, lk, h, d, s)  # noqa: E731

    out = []
    for shape, (heads, hd) in SHAPES.items():
        if hd not in models:
            continue
        lengths = sorted({l for (s, l, _, _) in measured if s == shape})
        for n, m in [(2, 1)] + [(k, 8) for k in machines]:
            links, transports = models_for(m == 1)
            for length in lengths:
                for backend in BACKENDS:
                    res = sp.simulate(n, m, length, heads, hd, "bf16", kernel=kernel, schedules=("ring", "torus"),
                                      links=links, transport=transports[backend])
                    for name, r in res.items():
                        row = {"case": f"{shape} l{length} {n}x{m} {name} {backend}", "machines": n,
                               "gpus_per_machine": m, "seq_len": length, "schedule": name, "backend": backend}
                        if isinstance(r, str):
                            row["error"] = r
                        else:
                            row.update(predicted_us=r.latency_s * 1e6, exposed_comm_us=r.exposed_comm_s * 1e6)
                            got = measured.get((shape, length, name, backend)) if (n, m) == (2, 1) else None
                            if got:
                                row.update(measured_us=got, predicted_over_measured=r.latency_s * 1e6 / got)
                        out.append(row)
    for row in out:  # each nvshmem row against the same schedule on the XLA backend
        if row["backend"] != "xla" and "predicted_us" in row:
            twin = next(r for r in out if r["case"] == row["case"].removesuffix(row["backend"]) + "xla")
            row["nvshmem_over_xla_time"] = row["predicted_us"] / twin["predicted_us"]
    print("fits: " + ", ".join(f"{k} {lat * 1e6:.1f} us + bytes / {bw / 1e9:.0f} GB/s" for k, (lat, bw) in fit.items()))
    return out, fit


PRED_COLUMNS = ["case", "predicted_us", "measured_us", "predicted_over_measured", "exposed_comm_us",
                "nvshmem_over_xla_time"]

COLUMNS = ["case", "us", "gbytes_per_s", "one_gpu_us", "speedup_vs_one_gpu", "vs_xla_backend", "bitwise_repeat", "equal_to_xla",
           "max_abs_diff_to_xla"]
NOTES = ("2 GPUs of one host as 2 processes (jax_cluster.parallel.launch), one GPU each, plan = 2 machines x 1 GPU "
         "(the link between the 'machines' is the GPUs' NVLink). us: one layer's attention inside a loop of layers in "
         "one jit (XLA's overlap flags on); one_gpu_us: the whole sequence on one GPU with the same local kernel "
         "(ideal speedup 2). vs_xla_backend: the same schedule with backend='xla' over its time. bitwise_repeat: two "
         "calls gave the same bits; equal_to_xla: bitwise equal to the XLA backend's result. nvshmem: arrived K/V "
         "(and Torus' pulled Q) read in place from the arena; nvshmem-copy: every arrival copied out first "
         "($JAX_CLUSTER_NVSHMEM_COPY_OUT=1, the transport before in-place reads).")


if __name__ == "__main__":
    ARGS = _args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if ARGS.predict:
        import common  # noqa: PLC0415

        pred, fits = predict(Path(ARGS.predict), [int(x) for x in ARGS.predict_machines.split(",") if x])
        for r in pred:
            print(f"  {r['case']:40s} {r.get('predicted_us', float('nan')):10.1f} us  {r.get('measured_us', '')}")
        common.write_results("sp_attention_nvshmem_predicted", pred, columns=PRED_COLUMNS, notes=(
            f"Simulator (jax_cluster.parallel.simulator) fitted to {Path(ARGS.predict).name}, no devices: links "
            + "; ".join(f"{k} {lat * 1e6:.1f} us + bytes / {bw / 1e9:.0f} GB/s" for k, (lat, bw) in fits.items())
            + " (the NVSHMEM backend's copy-out of every received slot runs on the compute stream; its all-to-alls "
            "stay XLA collectives on the XLA link; on 2 x 1 the link between the machines is that NVLink); kernel model: the throughput of the largest one-GPU run per "
            "head_dim + 10 us per launch. Between machines (4 and 8 x 8 GPUs) both backends "
            "get the simulator's default NIC, 400 Gb/s per machine, which was not measured here: those rows "
            "show what the transport (copy-out, barrier) costs on top of the same link."))
        sys.exit(0)
    if "JAX_CLUSTER_RANK" not in os.environ:
        sys.exit(_launch_self(ARGS))
    main(ARGS)
