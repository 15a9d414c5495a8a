"""One-sided transfers for the sequence-parallel schedules: the NVSHMEM backend.

``backend="nvshmem"`` (``sp_attention(..., backend="nvshmem")``) executes the same schedule
description as the XLA backend, with every :class:`~.description.Shift` (the ring's K/V
passes, Torus' Pull Q / Pull KV / Push O) done as a one-sided put-with-signal into the
peer's symmetric arena, issued on a side stream while the step's local attention runs, and
completed by a device-side signal wait with a timeout. All-to-alls stay XLA collectives.

It needs one process per GPU (``python -m jax_cluster.parallel.launch -n 2 -- ...``), a GPU
backend, more than one process and the optional extension ``_jax_cluster_nvshmem`` (built
when the ``nvidia-nvshmem-cu13`` wheel is installed at build time). Anywhere else the XLA
backend runs instead, with one warning saying why.

Bootstrap (:func:`init`, collective: every process calls it at the same point; the first
``backend="nvshmem"`` call does it for you):

1. the plan's fingerprint (schedule, layout, shape, dtype, arena size, steps) goes through
   the launcher's rendezvous store; processes that disagree raise :class:`PlanMismatchError`
   naming the differing fields and ranks;
2. rank 0's NVSHMEM unique id goes through the same store (the others wait at most
   ``timeout_s``: :class:`PeerTimeoutError` names the rank that did not arrive);
3. every process initialises NVSHMEM from the id and allocates the symmetric arena ONCE,
   sized from the plan (:func:`arena_layout`); a later plan needing more raises
   :class:`ArenaTooSmallError` unless :func:`grow` (collective) was called; NVSHMEM is
   finalised at exit.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .description import AttnShape, Schedule, Shift

TIMEOUT_ENV = "JAX_CLUSTER_NVSHMEM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
ALIGN = 512  # bytes: every arena region starts on this boundary
_KEY_PREFIX = "jax_cluster/nvshmem"


def default_timeout_s() -> float:
    """Bound on every wait for a peer (key-value store, device signal waits):
    ``$JAX_CLUSTER_NVSHMEM_TIMEOUT_S`` or 60 s."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


class PlanMismatchError(RuntimeError):
    """Processes called :func:`init` with different plans."""


class PeerTimeoutError(TimeoutError):
    """A peer did not arrive within the timeout."""


class ArenaTooSmallError(RuntimeError):
    """A schedule needs more symmetric memory than the arena allocated at :func:`init`."""


# ------------------------------------------------------------------ rendezvous store
class _Store:
    """The launcher's rendezvous directory as a write-once key-value store (one host).

    jax.distributed's own key-value store is not public API; the values exchanged here (plan
    fingerprints, NVSHMEM's unique id) are tiny and the processes share a host, so a file per
    key, written atomically (a temporary file renamed into place), is enough. Reads poll with
    a bound: a key that never appears is a :class:`PeerTimeoutError`, never a hang."""

    def __init__(self, root: str):
        self.root = root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "%"))

    def set(self, key: str, value: str) -> None:
        tmp = f"{self._path(key)}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(value)
        os.replace(tmp, self._path(key))

    def get(self, key: str, timeout_s: float, who: str) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(self._path(key)) as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(f"{who} did not arrive within {timeout_s:g} s (key {key!r}); "
                                           f"raise ${TIMEOUT_ENV} if it is only slow") from None
                time.sleep(0.01)


def _require_store() -> _Store:
    from .launch import ENV_RENDEZVOUS  # noqa: PLC0415

    root = os.environ.get(ENV_RENDEZVOUS)
    if not root or not os.path.isdir(root):
        raise RuntimeError("no rendezvous directory: start the processes with "
                           "`python -m jax_cluster.parallel.launch -n N -- ...` (one host) and call "
                           "jax_cluster.parallel.launch.init_distributed() first")
    return _Store(root)


def allgather_str(tag: str, value: str, *, timeout_s: float | None = None) -> list[str]:
    """Every process's ``value`` for ``tag``, in rank order, through the launcher's rendezvous store.

    Collective. ``tag`` must be new for each exchange (the store keeps keys).
    Raises :class:`PeerTimeoutError` naming the first rank that did not publish in time."""
    import jax

    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    rank, world = jax.process_index(), jax.process_count()
    if world == 1:
        return [value]
    store = _require_store()
    store.set(f"{_KEY_PREFIX}/{tag}/{rank}", value)
    return [value if r == rank else store.get(f"{_KEY_PREFIX}/{tag}/{r}", timeout_s,
                                              f"rank {r} (of {world}, waiting on rank {rank}, {tag})")
            for r in range(world)]


def broadcast_bytes(tag: str, value: bytes | None, *, root: int = 0, timeout_s: float | None = None) -> bytes:
    """``root``'s ``value`` on every process (the others pass None)."""
    import jax

    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    rank = jax.process_index()
    if jax.process_count() == 1:
        return value
    store = _require_store()
    key = f"{_KEY_PREFIX}/{tag}/root"
    if rank == root:
        store.set(key, value.hex())
        return value
    return bytes.fromhex(store.get(key, timeout_s, f"rank {root} (the root of {tag}, waited for by rank {rank})"))


_generation = [0]


def _next_tag(what: str) -> str:
    """Tags numbered per process: collective calls happen in the same order everywhere."""
    _generation[0] += 1
    return f"{what}/{_generation[0]}"


# ---------------------------------------------------------------------------- arena
SIGNAL_BLOCK = 4096  # bytes at the start of the arena: the barrier's signal and the slots'


@dataclass(frozen=True)
class ArenaLayout:
    """Where each slot written by a one-sided transfer lives in the symmetric arena.

    The signals sit in a fixed block at the start of the arena, the same for every plan:
    index 0 is the end-of-call barrier's, ``signals[slot]`` (from 1) the slot's. Every wait
    consumes what it waited for, so a call leaves its signals at zero and the next plan,
    whatever its layout, starts from clean signals; a plan-dependent place would let one
    plan's data bytes read as another's signals. ``regions[slot] = (offset, nbytes)`` follow
    the block. Every slot is written once per call, so regions never overlap."""

    regions: dict = field(hash=False)
    signals: dict = field(hash=False)
    total_bytes: int
    signal_offset: int = 0
    barrier_signal: int = 0


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def arena_layout(schedule: Schedule, itemsize: int | None = None) -> ArenaLayout:
    """The arena a schedule needs: the signal block, then one region per destination slot of
    every Shift."""
    itemsize = schedule.shape.itemsize if itemsize is None else itemsize
    regions, signals, off = {}, {}, SIGNAL_BLOCK
    for _, _, op in schedule.ops():
        if isinstance(op, Shift) and op.shift % schedule.layout.size(op.axis):
            for d in op.dst:
                nbytes = int(np.prod(schedule.slots[d])) * itemsize
                regions[d] = (off, nbytes)
                signals[d] = len(signals) + 1
                off += _align(nbytes)
    if len(signals) + 1 > SIGNAL_BLOCK // 8:
        raise ValueError(f"the schedule shifts {len(signals)} slots; the arena's signal block holds "
                         f"{SIGNAL_BLOCK // 8 - 1}")
    return ArenaLayout(regions, signals, off)


# ----------------------------------------------------------------------- fingerprint
def plan_fingerprint(plan, shape: AttnShape, dtype, arena_bytes: int) -> dict:
    """The fields every process must agree on (str values, compared field by field)."""
    sched = plan.build(shape)
    lay = plan.layout
    steps = hashlib.sha256(repr(sched.steps).encode()).hexdigest()[:16]
    return {
        "schedule": plan.schedule,
        "machines x gpus": f"{lay.machines}x{lay.gpus_per_machine}",
        "mesh": ",".join(f"{a}={s}" for a, s in zip(lay.axis_names, lay.axis_sizes)),
        "shape": f"B={shape.batch} L={shape.seq_len} H={shape.heads} Dh={shape.head_dim}",
        "dtype": np.dtype(dtype).name,
        "arena_bytes": str(int(arena_bytes)),
        "steps": steps,
    }


def check_plans_agree(fingerprint: dict, *, timeout_s: float | None = None) -> None:
    """Raise :class:`PlanMismatchError` when another process's fingerprint differs."""
    import jax

    if jax.process_count() == 1:
        return
    all_fp = [json.loads(s) for s in allgather_str(_next_tag("plan"), json.dumps(fingerprint, sort_keys=True),
                                                  timeout_s=timeout_s)]
    diffs = []
    for key in sorted(set().union(*all_fp)):
        vals = [fp.get(key) for fp in all_fp]
        if len(set(vals)) > 1:
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(vals)))
    if diffs:
        raise PlanMismatchError("the processes planned different sequence-parallel attention "
                                "(every process must call with the same plan, shape and dtype): "
                                + "; ".join(diffs))


# ---------------------------------------------------------------------- availability
@dataclass(frozen=True)
class Status:
    available: bool
    reason: str = ""  # why not, when not available
    arena_bytes: int = 0

    def __str__(self) -> str:
        return "available" if self.available else f"not available: {self.reason}"


def _extension():
    try:
        return importlib.import_module("jax_cluster._jax_cluster_nvshmem"), None
    except ImportError as exc:
        return None, exc


def availability() -> Status:
    """Whether the NVSHMEM backend can run in this process, and if not, why."""
    import jax

    mod, err = _extension()
    if mod is None:
        return Status(False, "jax_cluster was built without its NVSHMEM module (install the "
                             "nvidia-nvshmem-cu13 wheel and rebuild with CUDA; docs/nvshmem.md)"
                             f" [{err}]")
    if jax.default_backend() != "gpu":
        return Status(False, f"jax's backend is {jax.default_backend()!r}, not a GPU")
    if jax.process_count() < 2:
        return Status(False, "a single process: start one process per GPU with "
                             "`python -m jax_cluster.parallel.launch -n N -- ...`")
    if jax.local_device_count() != 1:
        return Status(False, f"this process drives {jax.local_device_count()} GPUs; the NVSHMEM "
                             f"backend needs one process per GPU (CUDA_VISIBLE_DEVICES=<rank>)")
    return Status(True)


# --------------------------------------------------------------------------- context
@dataclass
class _Context:
    module: object
    rank: int
    world: int
    arena_bytes: int


_ctx: list = [None]
_agreed: set = set()  # fingerprints already checked against the other processes


def _finalize() -> None:
    ctx = _ctx[0]
    if ctx is not None:
        _ctx[0] = None
        if ctx.module.last_fault() is None:  # after a fault a peer may be gone: finalize would wait
            ctx.module.finalize()


def init(plan, shape: AttnShape, dtype, *, timeout_s: float | None = None,
         arena_bytes: int | None = None) -> Status:
    """Collective bootstrap of the NVSHMEM backend for ``plan`` at ``shape`` / ``dtype``.

    Checks that every process has the same plan (always, once jax.distributed is up), then,
    where the backend is available, initialises NVSHMEM (once per process) and its arena
    (``arena_bytes`` or what the schedule needs). Returns the :class:`Status`; the backend
    not being available is not an error here."""
    import jax

    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    sched = plan.build(shape)
    need = max(arena_layout(sched, np.dtype(dtype).itemsize).total_bytes, int(arena_bytes or 0))
    fp = plan_fingerprint(plan, shape, dtype, need)
    key = json.dumps(fp, sort_keys=True)
    if key not in _agreed:  # every process has the same history of calls (SPMD)
        check_plans_agree(fp, timeout_s=timeout_s)
        _agreed.add(key)
    st = availability()
    if not st.available:
        return st
    ranks = [d.process_index for d in plan.topology.devices]
    if ranks != list(range(jax.process_count())):
        return Status(False, f"the plan's device g must belong to process g (one GPU each); "
                             f"its devices belong to processes {ranks}")
    ctx = _ctx[0]
    if ctx is not None:
        if ctx.arena_bytes < need:
            raise ArenaTooSmallError(
                f"this plan needs a symmetric arena of {need} bytes; {ctx.arena_bytes} were "
                f"allocated at the first init. Call jax_cluster.parallel.nvshmem.grow({need}) on "
                f"every process (collective) before it, or init the largest plan first")
        return Status(True, arena_bytes=ctx.arena_bytes)
    mod = _extension()[0]
    rank, world = jax.process_index(), jax.process_count()
    # NVSHMEM reads its symmetric heap size once, at init: room for this arena and for a grow
    # of half as much again, unless the user chose the size.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, need + need // 2 + (64 << 20))))
    uid = broadcast_bytes(_next_tag("uniqueid"), mod.unique_id() if rank == 0 else None, timeout_s=timeout_s)
    mod.init(rank, world, uid, need, float(timeout_s))
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _ctx[0] = _Context(mod, rank, world, need)
    atexit.register(_finalize)  # after jax.distributed's own: atexit runs this one first
    return Status(True, arena_bytes=need)


def grow(nbytes: int) -> int:
    """Collective: reallocate the arena to at least ``nbytes`` (every process, same point,
    no NVSHMEM call in flight). Returns the new size."""
    ctx = _ctx[0]
    if ctx is None:
        raise RuntimeError("nvshmem.grow before nvshmem.init")
    if nbytes > ctx.arena_bytes:
        ctx.module.resize_arena(int(nbytes))
        ctx.arena_bytes = int(nbytes)
    return ctx.arena_bytes


def last_fault() -> str | None:
    """What a device-side wait that timed out recorded (peer, slot), or None."""
    ctx = _ctx[0]
    return None if ctx is None else ctx.module.last_fault()


# -------------------------------------------------------------------------- execution
_FALLBACK_KEY = "parallel.nvshmem.fallback"


def execute(schedule: Schedule, plan, q, k, v, *, kernel=None, scale=None):
    """``backend="nvshmem"``: the one-sided executor where available, else the XLA backend
    with one warning saying why."""
    from .. import _ffi
    from . import xla_backend

    st = init(plan, schedule.shape, q.dtype)
    if not st.available:
        _ffi.warn_once(_FALLBACK_KEY, f"sp_attention(backend='nvshmem'): NVSHMEM {st}; running the "
                                      f"XLA backend instead", stacklevel=4)
        return xla_backend.execute(schedule, plan.mesh, q, k, v, kernel=kernel, scale=scale)
    from . import nvshmem_backend

    return nvshmem_backend.execute(schedule, plan.mesh, q, k, v, kernel=kernel, scale=scale,
                                   arena=arena_layout(schedule, np.dtype(q.dtype).itemsize))
