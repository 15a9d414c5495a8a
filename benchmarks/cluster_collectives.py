"""ClusterFusion Table 1 on our GPU: ClusterReduce / ClusterGather latency,
on-chip (DSMEM) vs off-chip (global memory), plus a cluster-size sweep (Fig. 5).

Per-collective time is measured inside ONE kernel: the op runs the collective
ClusterCollectiveConfig.repeat times; time(repeat=R) - time(repeat=1), divided by R-1,
cancels launch, loading x and writing the result. Data size is per cluster
(N blocks x slice). Run: python benchmarks/cluster_collectives.py [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_cluster as jc
from jax_cluster.ops.cluster_collectives import SHARED_MEMORY_LIMIT_BYTES, shared_memory_bytes
from common import dtype_tag, loop, random_normal, time_fn, write_results

PAPER_SPEEDUP = {  # ClusterFusion Table 1, H100, cluster size 4
    ("reduce", 32): 1.18, ("reduce", 64): 1.36, ("reduce", 128): 2.01, ("reduce", 256): 2.44,
    ("gather", 32): 1.60, ("gather", 64): 1.52, ("gather", 128): 1.44, ("gather", 256): 1.59,
}
REPEAT = 33
ITERS = 200


def _op(kind, exchange, repeat):
    config = jc.ClusterCollectiveConfig(exchange=exchange, repeat=repeat)
    if kind == "reduce":
        def step(x):
            out = jc.cluster_reduce(x, "max", impl="cuda", config=config)
            return x.at[:, 0, :1].set(out[:, :1])  # a dependency between iterations
    else:
        def step(x):
            out = jc.cluster_gather(x, impl="cuda", config=config)
            return x.at[:, 0, :1].set(out[:, :1])
    return loop(step, ITERS)


def measure(kind, exchange, x):
    """(per-kernel µs with repeat=1, per-collective µs)."""
    t1 = time_fn(_op(kind, exchange, 1), x) / ITERS
    tr = time_fn(_op(kind, exchange, REPEAT), x) / ITERS
    return t1 * 1e6, (tr - t1) / (REPEAT - 1) * 1e6


def dsmem_bytes(kind, n, slice_bytes):
    """Bytes one cluster moves through DSMEM per collective."""
    rounds = n.bit_length() - 1
    return n * rounds * slice_bytes if kind == "reduce" else n * (n - 1) * slice_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    key = jax.random.key(0)
    rows = []
    sms = getattr(jax.devices()[0], "core_count", 132)

    print(f"Table 1 (cluster 4, {args.dtype}), per collective inside one kernel, one cluster")
    for kind in ("reduce", "gather"):
        for kb in (32, 64, 128, 256):
            n = 4
            size = kb * 1024 // (n * dtype.itemsize)
            need = shared_memory_bytes(kind, dtype, n, size, "dsmem")
            if need > SHARED_MEMORY_LIMIT_BYTES:  # gather 256 KB: the result alone is > 227 KB
                rows.append({"case": f"{kind} {kb}kb n{n} {dtype_tag(dtype)}",
                             "paper_speedup": PAPER_SPEEDUP[(kind, kb)], "bytes": kb * 1024,
                             "note": f"not run: a block would hold {need} B, above {SHARED_MEMORY_LIMIT_BYTES} B"})
                print(f"  {rows[-1]['case']:24s} {rows[-1]['note']}")
                continue
            x = random_normal(key, (1, n, size), dtype)
            k_dsmem, c_dsmem = measure(kind, "dsmem", x)
            k_glob, c_glob = measure(kind, "global", x)
            row = {
                "case": f"{kind} {kb}kb n{n} {dtype_tag(dtype)}",
                "ours_us": c_dsmem, "global_us": c_glob, "speedup_vs_global": c_glob / c_dsmem,
                "paper_speedup": PAPER_SPEEDUP[(kind, kb)],
                "kernel_us": k_dsmem, "global_kernel_us": k_glob,
                "kernel_speedup_vs_global": k_glob / k_dsmem, "bytes": kb * 1024,
            }
            rows.append(row)
            print(f"  {row['case']:24s} dsmem {c_dsmem:7.2f} us  global {c_glob:7.2f} us  "
                  f"x{row['speedup_vs_global']:.2f} (paper x{row['paper_speedup']})   "
                  f"whole kernel {k_dsmem:.2f} / {k_glob:.2f} us")

    print("Cluster-size sweep: 16 KiB per block; latency of one cluster, bandwidth with the chip full")
    sizes = (2, 4, 8) if args.quick else (2, 4, 8, 16)
    for kind in ("reduce", "gather"):
        for n in sizes:
            slice_bytes = 16 * 1024 if kind == "reduce" else 64 * 1024 // n
            size = slice_bytes // dtype.itemsize
            one = random_normal(key, (1, n, size), dtype)
            _, lat = measure(kind, "dsmem", one)
            _, lat_g = measure(kind, "global", one)
            full = random_normal(key, (max(1, sms // n), n, size), dtype)
            _, t_full = measure(kind, "dsmem", full)
            moved = dsmem_bytes(kind, n, slice_bytes) * full.shape[0]
            row = {
                "case": f"{kind} {n * slice_bytes // 1024}kb n{n} {dtype_tag(dtype)} sweep",
                "ours_us": lat, "global_us": lat_g, "speedup_vs_global": lat_g / lat,
                "full_chip_us": t_full, "dsmem_gbps": moved / (t_full * 1e-6) / 1e9,
                "clusters": full.shape[0], "bytes": n * slice_bytes,
            }
            rows.append(row)
            print(f"  {row['case']:30s} latency {lat:7.2f} us (global {lat_g:7.2f})  "
                  f"{row['clusters']} clusters: {t_full:7.2f} us, {row['dsmem_gbps']:.0f} GB/s DSMEM")

    write_results(
        "cluster_collectives", rows,
        columns=["case", "ours_us", "global_us", "speedup_vs_global", "paper_speedup", "kernel_us",
                 "global_kernel_us", "full_chip_us", "dsmem_gbps", "note"],
        notes=("ours_us/global_us: one collective inside one kernel (repeat differential), "
               "max op for reduce. kernel_us: whole kernel with one collective (launch, load, "
               "store) inside a jit loop. Sweep: 16 KiB per block for reduce, 64 KiB per cluster "
               "for gather; dsmem_gbps with one cluster per SM group."),
    )


if __name__ == "__main__":
    main()
