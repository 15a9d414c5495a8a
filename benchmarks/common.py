"""Shared benchmark plumbing: timing inside one jit, HBM bandwidth, results tables.

Every benchmark writes one current table: benchmarks/results/<name>.json (device, versions,
date, command, notes, rows; one row per case) and <name>.md beside it. A grid too long for
one GPU run is measured in slices, each run passing `part=` to write_results: its rows are
merged into the same table (a case measured again replaces its row) and the table lists
the runs it came from. Nothing but merged tables is kept under results/.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cluster.tuning import time_call

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Scratch space of the benchmarks (compiled probes); `build/` is ignored by git.
BUILD_DIR = Path(__file__).resolve().parent / "build"
PROBE_SOURCE = Path(__file__).resolve().parent / "probes" / "stream_read.cu"
PROBE_TARGET = "benchmarks_stream_read"

# What the last measure_bandwidth() call measured (write_results records it in the table).
LAST_BANDWIDTH: dict = {}


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


def time_donated(run: Callable, state, *consts) -> float:
    """Seconds per call of jit(run)(state, *consts) with the state donated, each call continuing
    from the last one's state (caches updated in place, as a decode loop runs)."""
    fn = jax.jit(run, donate_argnums=0)
    holder = [state]

    def call():
        holder[0] = fn(holder[0], *consts)
        return holder[0]

    return time_fn(call)


def loop(step: Callable, iters: int) -> Callable:
    """jit(x -> step applied `iters` times): per-iteration time without dispatch."""

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, iters, lambda i, x: step(x), x)

    return run


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for cand in (shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _build_probe(nvcc: str) -> Path:
    """benchmarks/probes/stream_read.cu as a shared library, compiled once per source and
    jaxlib (the XLA FFI headers) and cached in BUILD_DIR."""
    import jaxlib

    include = jax.ffi.include_dir()
    tag = hashlib.sha256(PROBE_SOURCE.read_bytes() + f"{jaxlib.__version__} {include}".encode()).hexdigest()[:12]
    lib = BUILD_DIR / f"stream_read-{tag}.so"
    if lib.exists():
        return lib
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           "-gencode=arch=compute_90a,code=sm_90a", "-isystem", include, str(PROBE_SOURCE), "-o", str(tmp)]
    print("bandwidth: compiling " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed ({proc.returncode}): {proc.stderr[-2000:]}")
    tmp.replace(lib)  # atomic: a concurrent run sees the whole library or none
    return lib


def _probe_call(x, chunks: int):
    return jax.ffi.ffi_call(PROBE_TARGET, jax.ShapeDtypeStruct((chunks,), jnp.uint32))(
        x, chunks=np.int64(chunks))


@functools.cache
def stream_read_probe() -> tuple[Callable | None, str]:
    """(stream_read, "") with stream_read(x, chunks) -> uint32 [chunks], the XOR of the
    32-bit words of each of `chunks` equal contiguous pieces of x (x.nbytes a multiple of
    16 * chunks), run by the probe kernel; or (None, why it is not available here). The
    probe is compiled on first use (nvcc, sm_90a) and checked against numpy before any
    timing trusts it."""
    if jax.default_backend() != "gpu":
        return None, f"no GPU (backend {jax.default_backend()})"
    nvcc = _nvcc()
    if nvcc is None:
        return None, "no nvcc on PATH or in CUDA_HOME"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build_probe(nvcc)))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return None, f"the probe did not build or load: {exc}"
    jax.ffi.register_ffi_target(PROBE_TARGET, jax.ffi.pycapsule(lib.stream_read), platform="CUDA")
    rng = np.random.default_rng(0)
    for chunks in (1, 3, 64):
        words = rng.integers(0, 2**32, size=(chunks * 4 * 5,), dtype=np.uint64).astype(np.uint32)
        got = np.asarray(jax.jit(_probe_call, static_argnums=1)(jnp.asarray(words.view(np.float32)), chunks))
        expect = np.bitwise_xor.reduce(words.reshape(chunks, -1), axis=1)
        if not np.array_equal(got, expect):
            raise RuntimeError(f"stream_read probe: wrong XOR for {chunks} chunks: {got[:4]} != {expect[:4]}")
    return _probe_call, ""


def measure_bandwidth(gib: float = 1.0) -> float:
    """Device memory bandwidth (bytes/s) a streaming kernel reaches over a `gib` GiB buffer:
    the best of an XLA elementwise pass (read + write), an XLA reduction and, on a GPU with
    nvcc, the stream_read probe (benchmarks/probes/stream_read.cu: 16-byte loads, many in
    flight, the access pattern of weight streaming). XLA's passes alone read below what a
    kernel can stream on an H100, which would flatter every roofline fraction. Prints and
    records (LAST_BANDWIDTH, then the results table) which method gave the number."""
    n = int(gib * 2**30) // 4 // 4096 * 4096  # whole rows of the reduction
    x = jnp.arange(n, dtype=jnp.float32)
    measured = {"elementwise": 2 * n * 4 * 10 / time_fn(loop(lambda x: x * 1.0001 + 1.0, 10), x)}
    # the scale depends on the carry, so XLA cannot hoist the sum out of the loop
    reduce = lambda c: (c[0], c[1] + jnp.sum(c[0] * (1.0 + c[1][0] * 1e-30), axis=0))  # noqa: E731
    carry = (x.reshape(-1, 4096), jnp.zeros((4096,), jnp.float32))
    measured["reduction"] = n * 4 * 10 / time_fn(loop(reduce, 10), carry)
    probe, why = stream_read_probe()
    if probe is not None:
        chunks = 4 * 132  # several blocks per SM: no partial last wave matters
        buf = x[: n // (4 * chunks) * 4 * chunks]

        @jax.jit
        def reads(buf):  # buf is not returned: returning it made every call copy it
            acc = jnp.zeros((chunks,), jnp.uint32)
            # written out, not a fori_loop: no loop kernels between the reads; the barrier
            # ties buf to the step: no hoisting, no copy
            for _ in range(10):
                b, acc = jax.lax.optimization_barrier((buf, acc))
                acc = acc ^ probe(b, chunks)
            return acc

        measured["stream_read"] = buf.size * 4 * 10 / time_fn(reads, buf)
    method = max(measured, key=measured.get)
    LAST_BANDWIDTH.clear()
    LAST_BANDWIDTH.update({"bytes_per_s": measured[method], "method": method, "buffer_gib": gib,
                           "measured_bytes_per_s": measured, **({"probe_missing": why} if why else {})})
    print("bandwidth: " + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in measured.items())
          + f" TB/s; roofline uses {method}" + (f" (stream_read probe not used: {why})" if why else ""),
          flush=True)
    return measured[method]


def _profile(run: Callable, repeat: int = 1):
    """jax.profiler's ProfileData of `repeat` back-to-back run() (run called once before,
    untraced: compilation, tuning), or None where the trace wrote nothing."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    jax.block_until_ready(run())
    out = tempfile.mkdtemp()
    with jax.profiler.trace(out):
        outs = [run() for _ in range(repeat)]
        jax.block_until_ready(outs[-1])
    files = glob.glob(out + "/**/*.xplane.pb", recursive=True)
    return ProfileData.from_file(files[0]) if files else None


def _gpu_stream_lines(data) -> list[tuple[str, object]]:
    """(device, line) of every GPU stream line in a ProfileData (none for None or a CPU)."""
    if data is None:
        return []
    return [(pl.name.removeprefix("/device:"), ln) for pl in data.planes if pl.name.startswith("/device:GPU")
            for ln in pl.lines if "Stream" in ln.name]


def print_timeline(label: str, run: Callable, calls: int, first: int = 12, repeat: int = 2,
                   top: int = 8) -> None:
    """Kernel timeline of `repeat` back-to-back run() (each one jitted call doing `calls`
    steps), from CUPTI through jax.profiler: per-kernel time per step, idle gaps between
    kernels on the busiest GPU stream, the steady step period (median spacing of a kernel
    that runs once per step; the largest spacing shows the gap between calls) and the first
    `first` kernels; the `top` kernels by time per step. run is called once before the traced
    calls (compilation, tuning)."""
    from collections import defaultdict

    lines = [ln for _, ln in _gpu_stream_lines(_profile(run, repeat))]
    if not lines:
        print(f"trace {label}: no GPU activity in the trace", flush=True)
        return
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
    print_layer_spans(label, evs)


def layer_spans(events: Sequence[tuple[int, int, str]]) -> dict | None:
    """The repeating kernel sequence of one stream (a model's layers) and where its time goes.

    events: (start_ns, duration_ns, name) in start order. The stream is cut before every
    launch of one kernel, and the most common sequence of names among the pieces is the
    layer. The cut: among the kernels whose layer repeats at least half as often as the
    most repeated one (a kernel launched once per step repeats less: its piece is a whole
    step), the one whose layer covers the most launches (a kernel launched twice per layer
    cuts it in halves of two kinds, each covering half); the first launched wins a tie.
    Each kernel's span is how far it moved the stream's end past everything before it
    (programmatically launched kernels overlap their predecessors: only the part past them
    counts; idle time before a kernel counts to it), so a layer's spans add up to its
    period. Returns dict(names, span_us, dur_us,
    period_us: medians over the pieces of that sequence; layers, pieces: their count and
    the count of all pieces), or None with fewer than two pieces of one sequence."""
    names = [e[2] for e in events]
    first = {}
    for i, n in enumerate(names):
        first.setdefault(n, i)

    def cut_at(marker):  # (launches covered, -first launch, pieces, layer, its count)
        cuts = [i for i, n in enumerate(names) if n == marker] + [len(events)]
        pieces = list(zip(cuts, cuts[1:]))
        layer, seen = Counter(tuple(names[a:b]) for a, b in pieces).most_common(1)[0]
        return seen * len(layer), -first[marker], pieces, layer, seen

    cuts = [cut_at(n) for n, c in Counter(names).items() if c >= 2]
    most = max((c[4] for c in cuts), default=0)
    if most < 2:
        return None
    _, _, pieces, layer, _ = max((c for c in cuts if 2 * c[4] >= most), key=lambda c: c[:2])
    ends = np.maximum.accumulate([s + d for s, d, _ in events])
    spans, durs = [], []
    for a, b in pieces:
        if tuple(names[a:b]) != layer:
            continue
        before = [ends[a - 1] if a else events[a][0]] + list(ends[a:b - 1])  # the stream's end before each
        spans.append([max(0, int(e) - int(p)) for e, p in zip(ends[a:b], before)])
        durs.append([events[i][1] for i in range(a, b)])
    spans, durs = np.array(spans) / 1e3, np.array(durs) / 1e3
    return {"names": list(layer), "span_us": np.median(spans, 0), "dur_us": np.median(durs, 0),
            "period_us": float(np.median(spans.sum(1))), "layers": len(spans), "pieces": len(pieces)}


def print_layer_spans(label: str, events: Sequence[tuple[int, int, str]]) -> None:
    """layer_spans as a table: per kernel of the repeating sequence its median span (how far
    it moved the stream's end) and duration."""
    spans = layer_spans(events)
    if spans is None:
        return
    print(f"spans {label}: {spans['layers']} of {spans['pieces']} pieces repeat {len(spans['names'])} kernels, "
          f"median period {spans['period_us']:.1f} us; per kernel: span (past the kernels before it), duration",
          flush=True)
    for name, span, dur in zip(spans["names"], spans["span_us"], spans["dur_us"]):
        print(f"    {span:7.1f} {dur:7.1f}  {name[:70]}", flush=True)


def stream_events(data) -> list[tuple[str, int, int, str]]:
    """(stream, start_ns, duration_ns, name) of every GPU activity in a ProfileData (kernels
    and memcpys, every stream of every local GPU), in start order; [] for None or a CPU."""
    events = [(f"{dev} {ln.name}", e.start_ns, e.duration_ns, e.name)
              for dev, ln in _gpu_stream_lines(data) for e in ln.events]
    return sorted(events, key=lambda t: t[1])


def print_stream_events(label: str, events, first: int = 60) -> None:
    """Per stream the count and busy time, then the first `first` activities of all streams
    in start order with their offsets, so that overlap between streams (a copy beside a
    kernel) shows."""
    if not events:
        print(f"streams {label}: no GPU activity in the trace", flush=True)
        return
    t0, end = events[0][1], max(s + d for _, s, d, _ in events)
    print(f"streams {label}: {len(events)} activities over {(end - t0) / 1e3:.1f} us", flush=True)
    for stream in sorted({e[0] for e in events}):
        mine = [e for e in events if e[0] == stream]
        print(f"    {stream}: {len(mine)}, busy {sum(d for _, _, d, _ in mine) / 1e3:.1f} us", flush=True)
    for stream, start, dur, name in events[:first]:
        print(f"    t={(start - t0) / 1e3:9.1f} dur={dur / 1e3:8.1f}  {stream[-18:]:18s} {name[:60]}", flush=True)


def print_streams(label: str, run: Callable, first: int = 60) -> None:
    """Every GPU stream's activity in one traced run() (print_stream_events)."""
    print_stream_events(label, stream_events(_profile(run)), first)


def write_results(name: str, rows: Sequence[dict], *, columns: Sequence[str], notes: str = "",
                  extra: dict | None = None, part: str | None = None) -> Path:
    """Writes results/<name>.json and <name>.md: this run's device, versions, date, command,
    notes, `extra` fields and rows (each a dict with a unique "case").

    part: this run measured one slice of a grid (a name for it). Its rows are merged into the
    table already there: a case measured again replaces its row in place, new cases are
    appended, and the table's "runs" lists every run that contributed (part, command,
    device, date, bandwidth). Without part the table is replaced."""
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": device_name(),
        "versions": versions(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "notes": notes,
        **({"bandwidth": dict(LAST_BANDWIDTH)} if LAST_BANDWIDTH else {}),
        **(extra or {}),
    }
    rows = list(rows)
    if part is not None:
        run = {"part": part, **{k: payload[k] for k in ("command", "device", "date")}}
        bw = payload.pop("bandwidth", None)  # per run: each slice has its own
        if bw:
            run.update(bandwidth_bytes_per_s=bw["bytes_per_s"], bandwidth_method=bw["method"])
        runs, merged = [run], {row["case"]: row for row in rows}
        if path.exists():
            old = json.loads(path.read_text())
            runs = [r for r in old.get("runs", [_as_run(old)]) if r.get("part") != part] + [run]
            merged = {row["case"]: row for row in old["rows"]}
            merged.update({row["case"]: row for row in rows})
        payload["runs"] = runs
        payload["parts"] = [r["part"] for r in runs if r.get("part")]
        rows = list(merged.values())
    payload["rows"] = rows
    path.write_text(json.dumps(payload, indent=2) + "\n")
    path.with_suffix(".md").write_text(_markdown(name, payload, columns))
    return path


def _as_run(table: dict) -> dict:
    """A table written without part, as one entry of a merged table's runs."""
    run = {"part": None, **{k: table.get(k) for k in ("command", "device", "date")}}
    measured = table.get("bandwidth") or {}
    bw = measured.get("bytes_per_s") or table.get("bandwidth_bytes_per_s")
    if bw:
        run["bandwidth_bytes_per_s"] = bw
    if measured.get("method"):
        run["bandwidth_method"] = measured["method"]
    return run


def _describe_run(run: dict) -> str:
    bw = run.get("bandwidth_bytes_per_s")
    how = f" ({run['bandwidth_method']})" if run.get("bandwidth_method") else ""
    return (f"`{run['command']}` ({run['device']}, {run['date']}" + (f", {bw / 1e9:.0f} GB/s{how}" if bw else "")
            + ")")


def _markdown(name: str, payload: dict, columns: Sequence[str]) -> str:
    lines = [f"# {name}", "", f"{payload['device']}, jax {payload['versions']['jax']}, {payload['date']}", ""]
    if "runs" in payload:
        lines += ["Joined from runs in parts (roofline per part from its own bandwidth): "
                  + "; ".join(_describe_run(r) for r in payload["runs"]) + ".", ""]
    else:
        lines += [f"`{payload['command']}`", ""]
    bw = payload.get("bandwidth")
    if bw and "runs" not in payload:
        lines += [f"Bandwidth for the roofline: {bw['bytes_per_s'] / 1e9:.0f} GB/s ({bw['method']}, "
                  + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in bw["measured_bytes_per_s"].items())
                  + " GB/s measured in this run)", ""]
    if payload.get("notes"):
        lines += [payload["notes"], ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in payload["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


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
