"""Shared benchmark plumbing: timing inside one jit, HBM bandwidth, results files.

Results follow DESIGN.md: benchmarks/results/<name>.json (device, versions,
date, command, rows) plus a Markdown table beside it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cluster.tuning import time_call

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def versions() -> dict:
    import jaxlib

    info = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()}
    try:
        backend = jax.extend.backend.get_backend()
        info["platform_version"] = backend.platform_version
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def time_fn(fn: Callable, *args, warmup: int = 2, trials: int = 7) -> float:
    """Seconds per fn(*args) in a loop of back-to-back calls (tuning.steady_seconds: the
    fixed dispatch latency of one synchronised call left out); fn should be jitted and do
    many steps of work."""
    return time_call(fn, *args, warmup=warmup, trials=trials)


def loop(step: Callable, iters: int) -> Callable:
    """jit(x -> step applied `iters` times): per-iteration time without dispatch."""

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, iters, lambda i, x: step(x), x)

    return run


def measure_bandwidth(gib: float = 1.0) -> float:
    """Device memory bandwidth (bytes/s) a streaming kernel reaches: the best of an XLA
    elementwise pass (read + write), an XLA reduction, and, where the CUDA module is built,
    jax_cluster's stream_read probe (16-byte loads, many in flight: the access pattern of
    weight streaming). XLA's passes alone read ~15% below what a kernel can stream on an
    H100, which flattered every roofline fraction measured with them."""
    n = int(gib * 2**30) // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = 2 * n * 4 * 10 / time_fn(loop(lambda x: x * 1.0001 + 1.0, 10), x)
    # the scale depends on the carry, so XLA cannot hoist the sum out of the loop
    reduce = lambda c: (c[0], c[1] + jnp.sum(c[0] * (1.0 + c[1][0] * 1e-30), axis=0))  # noqa: E731
    carry = (x.reshape(-1, 4096), jnp.zeros((4096,), jnp.float32))
    read = n * 4 * 10 / time_fn(loop(reduce, 10), carry)
    best = max(copy, read)
    print(f"bandwidth: elementwise {copy / 1e12:.3f}, reduction {read / 1e12:.3f} TB/s", flush=True)
    if jax.default_backend() == "gpu":
        from jax_cluster.ops.stream_read import stream_read

        chunks = 4 * 132  # several blocks per SM: no partial last wave matters
        buf = x[: n // (4 * chunks) * 4 * chunks]

        @jax.jit
        def reads(buf):  # buf is not returned: returning it made every call copy it
            acc = jnp.zeros((chunks,), jnp.uint32)
            # written out, not a fori_loop: no loop kernels between the reads (1% on H100,
            # session 18); the barrier ties buf to the step: no hoisting, no copy
            for _ in range(10):
                b, acc = jax.lax.optimization_barrier((buf, acc))
                acc = acc ^ stream_read(b, chunks)
            return acc

        streamed = buf.size * 4 * 10 / time_fn(reads, buf)
        print(f"bandwidth: stream_read {streamed / 1e12:.3f} TB/s", flush=True)
        best = max(best, streamed)
    return best


def print_timeline(label: str, run: Callable, calls: int, first: int = 12, repeat: int = 2,
                   top: int = 8) -> None:
    """Kernel timeline of `repeat` back-to-back run() (each one jitted call doing `calls`
    steps), from CUPTI through jax.profiler: per-kernel time per step, idle gaps between
    kernels on the busiest GPU stream, the steady step period (median spacing of a kernel
    that runs once per step; the largest spacing shows the gap between calls) and the first
    `first` kernels; the `top` kernels by time per step. run is called once before the traced
    calls (compilation, tuning)."""
    import glob
    import tempfile
    from collections import defaultdict

    from jax.profiler import ProfileData

    jax.block_until_ready(run())
    out = tempfile.mkdtemp()
    with jax.profiler.trace(out):
        outs = [run() for _ in range(repeat)]
        jax.block_until_ready(outs[-1])
    data = ProfileData.from_file(glob.glob(out + "/**/*.xplane.pb", recursive=True)[0])
    lines = [ln for pl in data.planes if pl.name.startswith("/device:GPU")
             for ln in pl.lines if "Stream" in ln.name]
    line = max(lines, key=lambda ln: len(list(ln.events)))
    evs = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events), key=lambda t: t[0])
    steps = calls * repeat
    per, starts = defaultdict(float), defaultdict(list)
    gaps = sum(max(0.0, s1 - (s0 + d0)) for (s0, d0, _), (s1, _, _) in zip(evs, evs[1:]))
    for s0, dur, name in evs:
        per[name[:70]] += dur
        starts[name[:70]].append(s0)
    span = evs[-1][0] + evs[-1][1] - evs[0][0]
    print(f"trace {label}: {len(evs)} kernels on {line.name}, span {span / steps / 1e3:.1f} us "
          f"per step, gaps {gaps / steps / 1e3:.1f} us per step", flush=True)
    once = [n for n in per if len(starts[n]) == steps]
    if once:
        marker = max(once, key=per.get)
        spacing = np.diff(starts[marker]) / 1e3
        print(f"    steady period {np.median(spacing):.1f} us per step (spacing of {marker[:40]}; "
              f"largest {spacing.max():.1f} us)", flush=True)
    for name, dur in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {dur / steps / 1e3:8.1f} us/step  {name}", flush=True)
    for s0, dur, name in evs[:first]:
        print(f"    t={(s0 - evs[0][0]) / 1e3:8.1f} dur={dur / 1e3:7.1f}  {name[:60]}", flush=True)


def write_results(name: str, rows: Sequence[dict], *, columns: Sequence[str], notes: str = "",
                  extra: dict | None = None) -> Path:
    (RESULTS_DIR / name).parent.mkdir(parents=True, exist_ok=True)  # name may be parts/<part>
    payload = {
        "device": device_name(),
        "versions": versions(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "notes": notes,
        **(extra or {}),
        "rows": list(rows),
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"# {name}", "", f"{payload['device']}, jax {payload['versions']['jax']}, {payload['date']}",
             "", f"`{payload['command']}`", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    (RESULTS_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")
    return path


def merge_results(name: str, parts: Sequence[str], *, columns: Sequence[str], notes: str = "") -> Path:
    """One table from a grid measured in parts (results/parts/<part>.json, written by runs
    with a part name): one GPU session is too short for some grids. A case measured again
    in a later part replaces the earlier row; each part keeps the bandwidth of its own run."""
    rows, runs = {}, []
    for part in parts:
        data = json.loads((RESULTS_DIR / "parts" / f"{part}.json").read_text())
        rows.update({row["case"]: row for row in data["rows"]})
        bw = data.get("bandwidth_bytes_per_s")
        runs.append(f"`{data['command']}` ({data['device']}, {data['date']}"
                    + (f", {bw / 1e9:.0f} GB/s" if bw else "") + ")")
    same = {k: data[k] for k in ("device", "versions", "date")}  # the GPU runs', not this machine's
    return write_results(name, list(rows.values()), columns=columns, extra={**same, "parts": list(parts)},
                         notes=f"Joined from runs in parts (roofline per part from its own bandwidth): "
                               + "; ".join(runs) + ". " + notes)


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def random_normal(key, shape, dtype, scale: float = 1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def dtype_tag(dtype) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[np.dtype(dtype).name]
