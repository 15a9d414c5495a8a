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
    """Median wall time (seconds) of fn(*args) to completion; fn should be jitted
    and do many iterations of work so host overhead is negligible."""
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
    if jax.default_backend() == "gpu":
        from jax_cluster.ops.stream_read import stream_read

        chunks = 4 * 132  # several blocks per SM: no partial last wave matters
        buf = x[: n // (4 * chunks) * 4 * chunks]

        @jax.jit
        def reads(buf):  # buf is not returned: returning it made every call copy it
            def body(_, acc):  # the barrier ties buf to the step: no hoisting, no copy
                b, acc = jax.lax.optimization_barrier((buf, acc))
                return acc ^ stream_read(b, chunks)

            return jax.lax.fori_loop(0, 10, body, jnp.zeros((chunks,), jnp.uint32))

        best = max(best, buf.size * 4 * 10 / time_fn(reads, buf))
    return best


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
