"""Profile-driven kernel selection with a persistent cache (DeepFusionKernel's scheduler).

An op that has several implementations (variants, tilings) asks :func:`pick` which one to
use for a *key* (the op's shape bucket, dtype and GPU name). The first time a key is
seen, every candidate is measured on the current GPU and the fastest is remembered, in
memory and in a JSON file, so later processes start with the answer.

When it runs, and why it cannot break ``jax.jit``: ops call :func:`pick` from their
Python wrapper, i.e. while a computation is being *traced* (shapes and dtypes are static
then; values are not needed). Measuring never happens inside the traced computation:
:func:`run_outside_trace` runs the measurement in a helper thread, whose JAX trace state
is fresh (trace state is thread-local), on fresh random inputs of the traced shapes; it
compiles and times each candidate eagerly, and returns a plain string. The traced
computation then simply uses the winner, a static parameter. So the first trace of a new
shape costs the measurement (about a second per candidate); every later trace, in this
process or another, reads the cache. To pay that cost ahead of time (deployment warm-up),
call the op's own ``tune``/autotune helper, e.g. :func:`jax_cluster.ops.swiglu.autotune`.

Environment:
  JAX_CLUSTER_TUNING=0         no measuring and no cache: every op uses its fixed heuristic
                               (deterministic choice, e.g. for CI or reproducible runs)
  JAX_CLUSTER_TUNING_CACHE=P   the cache file (default: $XDG_CACHE_HOME/jax_cluster/
                               tuning.json, else ~/.cache/jax_cluster/tuning.json)

A candidate is a string (a path that takes no launch choices, e.g. "xla") or an op's
frozen config dataclass; in the file it is JSON: the string, or ``{"type": <class name>,
<field>: <value>, ...}``. Keys have one format, made by :func:`make_key`:
``"v<op version> <device name> <name><value> ..."`` under the op's name.

The file holds ``{"version": 2, "entries": {"<op>|<key>": {"winner": <JSON choice>,
"times_us": {...}, "date": ...}}}``. A corrupt file, a file of another version, or an entry
whose winner is not among the op's current candidates (stale: the op changed) is ignored
with a warning and replaced on the next write; nothing here raises because of the cache.
On CPU there is nothing to tune: ops do not call :func:`pick` there.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Mapping, Sequence

ENV_ENABLE = "JAX_CLUSTER_TUNING"
ENV_CACHE = "JAX_CLUSTER_TUNING_CACHE"
CACHE_VERSION = 2

# INFO: one line when a shape starts being measured (it can take tens of seconds, inside
# the first jit trace) and one with the times. flax_models.generate turns it on.
log = logging.getLogger(__name__)

__all__ = [
    "CACHE_VERSION",
    "cache_path",
    "clear_memory_cache",
    "context_bucket",
    "device_name",
    "enabled",
    "lookup",
    "make_key",
    "pick",
    "record",
    "run_outside_trace",
    "steady_seconds",
    "time_call",
    "time_carried",
]


def enabled() -> bool:
    """False when JAX_CLUSTER_TUNING is 0/false/off/no: ops then use their heuristic."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_path() -> Path:
    explicit = os.environ.get(ENV_CACHE)
    if explicit:
        return Path(explicit).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jax_cluster" / "tuning.json"


def device_name() -> str:
    """The default device as it names itself (e.g. 'NVIDIA H100 80GB HBM3')."""
    import jax

    d = jax.devices()[0]
    return str(getattr(d, "device_kind", d.platform))


# ----------------------------------------------------------------------------- the cache
_lock = threading.RLock()
_memory: dict[str, dict] = {}  # path -> {"entries": {...}}, loaded once per path


def clear_memory_cache() -> None:
    """Forgets what was read from disk (the file is re-read on next use)."""
    with _lock:
        _memory.clear()


def _read_file(path: Path, quiet: bool = False) -> dict:
    """Entries of the cache file; {} (with a warning) when it is unreadable or stale."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        if not quiet:
            warnings.warn(f"jax_cluster.tuning: ignoring unreadable cache file {path} ({exc}); "
                          "it will be rewritten", stacklevel=4)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(
            data.get("entries"), dict):
        if not quiet:
            warnings.warn(f"jax_cluster.tuning: ignoring cache file {path}: not a version "
                          f"{CACHE_VERSION} tuning cache; it will be rewritten", stacklevel=4)
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict) and "winner" in v}


def _entries(path: Path) -> dict:
    key = str(path)
    if key not in _memory:
        _memory[key] = _read_file(path)
    return _memory[key]


def _full_key(op: str, key: str) -> str:
    return f"{op}|{key}"


def make_key(version: int, **fields) -> str:
    """The one key format: ``"v<version> <device> <name><value> ..."`` in the given order
    (e.g. ``make_key(3, m=16, d=4096, dtype="float16")`` -> ``"v3 NVIDIA H100 ... m16
    d4096 dtypefloat16"``). Bump `version` when an op's kernels or candidates change."""
    words = " ".join(f"{k}{v}" for k, v in fields.items())
    return f"v{version} {device_name()} {words}".strip()


def context_bucket(max_seq: int, steps_per_octave: int = 8) -> int:
    """The cache capacity one tuned pick stands for: `max_seq` rounded up to one of
    `steps_per_octave` even steps between two powers of two (4096 -> 4096, 4224 -> 4608).
    Picks between attention kernels turn on the context (the fused kernels lead where the
    weights dominate, the split ones where the cache does), so the bucket stays within
    1 / steps_per_octave of the capacity (the next power of two would time a 4224-slot
    cache at 8192 slots: the pick for twice its context)."""
    max_seq = max(1, int(max_seq))
    step = max(1, (1 << (max_seq.bit_length() - 1)) // steps_per_octave)
    return -(-max_seq // step) * step


def encode(choice):
    """A candidate as JSON: a string as is; a config dataclass as {"type": name, **fields}."""
    if isinstance(choice, str):
        return choice
    if dataclasses.is_dataclass(choice) and not isinstance(choice, type):
        return {"type": type(choice).__name__, **dataclasses.asdict(choice)}
    raise TypeError(f"jax_cluster.tuning: a candidate must be a str or a config dataclass, got {choice!r}")


def _encoded_key(choice) -> str:
    return json.dumps(encode(choice), sort_keys=True)


def _describe(choice) -> str:
    return choice if isinstance(choice, str) else str(choice)


def lookup(op: str, key: str, candidates: Sequence | None = None):
    """The cached winner for (op, key), or None. A winner not among `candidates` is stale:
    ignored with a warning."""
    with _lock:
        entry = _entries(cache_path()).get(_full_key(op, key))
    if entry is None:
        return None
    winner = entry.get("winner")
    if candidates is None:
        return winner
    by_json = {_encoded_key(c): c for c in candidates}
    try:
        found = by_json.get(json.dumps(winner, sort_keys=True))
    except TypeError:
        found = None
    if found is None:
        warnings.warn(f"jax_cluster.tuning: ignoring stale cache entry {_full_key(op, key)!r} "
                      f"(winner {winner!r} is not a current candidate); re-measuring",
                      stacklevel=3)
    return found


def record(op: str, key: str, winner, times_s: Mapping | None = None) -> None:
    """Stores a winner in memory and in the cache file (atomic replace; entries written by
    other processes meanwhile are kept). A file that cannot be written only warns."""
    entry = {"winner": encode(winner), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if times_s:
        entry["times_us"] = {_describe(k): (round(v * 1e6, 3) if math.isfinite(v) else None)
                             for k, v in times_s.items()}
    path = cache_path()
    with _lock:
        entries = _entries(path)
        entries[_full_key(op, key)] = entry
        on_disk = _read_file(path, quiet=True)
        merged = {**on_disk, **entries}
        _memory[str(path)] = merged
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tuning.", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as fh:
                json.dump({"version": CACHE_VERSION, "entries": merged}, fh, indent=1,
                          sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            warnings.warn(f"jax_cluster.tuning: could not write the cache file {path} ({exc}); "
                          "the choice is kept for this process only", stacklevel=3)


# ----------------------------------------------------------------------------- measuring
def run_outside_trace(fn: Callable[[], object]):
    """Runs fn() in a fresh thread, outside any jit/vmap/shard_map trace of the caller, and
    returns its result (exceptions propagate). JAX's trace state is thread-local, so JAX
    code in fn executes eagerly even when the caller is being traced."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="jax_cluster-tuning", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


# Calls run back to back in each timing trial (see steady_seconds).
BACK_TO_BACK_CALLS = 8


def steady_seconds(call: Callable[[], object], *, warmup: int = 2, trials: int = 5,
                   calls: int = BACK_TO_BACK_CALLS) -> float:
    """Seconds that one more call() adds to a run of back-to-back calls: what a call costs
    in a loop of them. Each trial times one call to completion and then `calls` calls
    issued back to back (JAX dispatches asynchronously: the host enqueues the next call
    while the device runs this one). The difference of the two medians over calls - 1
    leaves out the fixed dispatch and synchronisation latency that a single timed call
    includes (tens to hundreds of µs before the first kernel starts, and most of the spread
    between identical runs; docs/performance.md); medians taken apart, so one
    slow single call cannot make a trial look fast. Where the difference is not positive
    (calls so short that latency is all there is) it is the back-to-back time per call."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(call())
    single, batch = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        t1 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        single.append(t1 - t0)
        batch.append(time.perf_counter() - t1)
    one, many = sorted(single)[trials // 2], sorted(batch)[trials // 2]
    extra = (many - one) / (calls - 1)
    return extra if extra > 0 else many / calls


def time_call(fn: Callable, *args, warmup: int = 2, trials: int = 5) -> float:
    """Seconds per fn(*args) in a loop of calls (steady_seconds); fn: a jitted function
    doing many steps of work."""
    return steady_seconds(lambda: fn(*args), warmup=warmup, trials=trials)


def time_carried(fn: Callable, state, *, warmup: int = 2, trials: int = 5) -> float:
    """Seconds per state = fn(state) in a loop of calls (steady_seconds), fn jitted with its
    state donated: a loop that updates buffers in place (a KV cache) is timed without the
    copy of them that a non-donated input would cost on every call."""
    holder = [state]

    def call():
        holder[0] = fn(holder[0])
        return holder[0]

    return steady_seconds(call, warmup=warmup, trials=trials)


# Candidates timed within this factor of the fastest are timed again (see pick).
CONFIRM_WITHIN = 1.2


def pick(op: str, key: str, candidates: Sequence, measure: Callable[[object], float], *,
         heuristic, verbose: bool = False):
    """The candidate to use for (op, key).

    * JAX_CLUSTER_TUNING=0, or a single candidate: `heuristic` (resp. that candidate);
    * a valid cached winner: that;
    * otherwise measure(candidate) -> seconds for each candidate, run outside any trace
      (see run_outside_trace); a candidate whose measurement raises counts as infinitely
      slow (warned). Candidates within CONFIRM_WITHIN of the fastest are measured once more
      and keep their faster time (a timing is only ever disturbed upwards: on H100 single
      measurements of the same program were seen 10-16% slow, enough to flip a pick). The
      fastest is cached and returned; if none could be measured, the heuristic is returned
      and nothing is cached.
    """
    candidates = list(dict.fromkeys(candidates))
    if len(candidates) == 1:
        return candidates[0]
    if not enabled():
        return heuristic
    cached = lookup(op, key, candidates)
    if cached is not None:
        return cached

    log.info("tuning %s for %s: measuring %d candidates (once; cached in %s)", op, key, len(candidates),
             cache_path())
    t_start = time.perf_counter()

    def measure_one(c):
        try:
            return float(measure(c))
        except Exception as exc:  # noqa: BLE001 - a failing candidate just loses
            warnings.warn(f"jax_cluster.tuning: {op} candidate {c!r} failed for {key} "
                          f"({type(exc).__name__}: {exc})", stacklevel=2)
            return math.inf

    def measure_all():
        times = {c: measure_one(c) for c in candidates}
        best = min(times.values())
        if math.isfinite(best):
            for c in [c for c, t in times.items() if t <= best * CONFIRM_WITHIN]:
                times[c] = min(times[c], measure_one(c))
        return times

    times = run_outside_trace(measure_all)
    finite = {c: t for c, t in times.items() if math.isfinite(t)}
    if not finite:
        warnings.warn(f"jax_cluster.tuning: no {op} candidate could be measured for {key}; "
                      f"using the heuristic {heuristic!r}", stacklevel=2)
        return heuristic
    winner = min(finite, key=finite.get)
    summary = (f"{op} {key}: " + ", ".join(f"{_describe(c)}={t * 1e6:.1f}us" for c, t in times.items())
               + f" -> {_describe(winner)} (tuned in {time.perf_counter() - t_start:.1f} s)")
    log.info("tuned %s", summary)
    if verbose:
        print(f"jax_cluster.tuning: {summary}")
    record(op, key, winner, times)
    return winner
