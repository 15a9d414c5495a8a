"""Sequence-parallel attention schedules, each described once as data.

A :class:`Schedule` is an SPMD program over named local buffers ("slots"): every device runs
the same list of :class:`Step` s, each a tuple of ops. The ops are

* :class:`AllToAll` -- Ulysses re-layout over a group of mesh axes (sequence gathered and heads
  scattered, or back);
* :class:`Shift`    -- send slots to the device ``shift`` places further along one mesh axis
  (a ``ppermute``; the ring step and the Torus stage transfer);
* :class:`SplitHeads` / :class:`JoinHeads` -- local split of the heads into blocks, optionally
  relative to the device's coordinate on an axis (block j = head block (coord + j) mod n);
* :class:`Attend`   -- attention of one or more query slots over one or more KV slot pairs,
  folded into the running (o, lse) state of each query slot (the multi-chunk kernel);
* :class:`Finalize` -- the normalized output of query slots' states.

Transfers issued in a step overlap the attention of the same step; data dependencies follow
from slot names (every slot is written once). Three consumers read the same description: the
XLA backend (``xla_backend``) executes the ops with ``all_to_all`` / ``ppermute``; the simulator
and the volume counter expand them into concrete per-device :class:`Transfer` s (source,
destination, bytes, intra/inter link) and :class:`Work` items (:meth:`Schedule.transfers`,
:meth:`Schedule.work`, :meth:`Schedule.device_steps`); a one-sided NVSHMEM backend can map
slots to a symmetric arena.

Schedules (StreamFusion §2.2, §4.2, §4.3):

* ``ulysses`` all-to-all over all devices (P_u = P);
* ``ring``    KV passed around all devices (P_r = P), two-level when it spans machines;
* ``usp``     Ulysses innermost (within a machine), Ring across (the baseline);
* ``tas``     topology-aware: Ring innermost (within a machine), Ulysses across;
* ``torus``   tas with the across-machine all-to-all broken into T-1 stages:
  Pull Q -> Pull KV -> Push O (Algorithm 1), each transfer overlapping attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from .layout import RING_AXES, ULYSSES_AXES, Layout, make_layout

SCHEDULES = ("ulysses", "ring", "usp", "tas", "torus")
LAYOUT_ORDER = {"ulysses": "ring-inner", "ring": "ring-inner", "usp": "ulysses-inner",
                "tas": "ring-inner", "torus": "ring-inner"}


# ----------------------------------------------------------------------------- ops
@dataclass(frozen=True)
class AllToAll:
    """Ulysses re-layout over the group ``axes``. gather="seq": [B,L,H,D] -> [B,L*G,H/G,D]
    (member j receives head block j of every member, concatenated in member order);
    gather="heads": the inverse."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    axes: tuple[str, ...]
    gather: str  # "seq" or "heads"


@dataclass(frozen=True)
class Shift:
    """Send each ``src`` slot to the device ``shift`` places further along ``axis`` (cyclic);
    what arrives from ``-shift`` places is stored as ``dst``."""

    src: tuple[str, ...]
    dst: tuple[str, ...]
    axis: str
    shift: int


@dataclass(frozen=True)
class SplitHeads:
    """Split the heads of ``src`` into ``len(dst)`` blocks; with ``axis``, dst[j] is head block
    (coord(axis) + j) mod n, otherwise block j."""

    src: str
    dst: tuple[str, ...]
    axis: str | None = None


@dataclass(frozen=True)
class JoinHeads:
    """Inverse of :class:`SplitHeads`: concatenate head blocks (relative to ``axis``)."""

    src: tuple[str, ...]
    dst: str
    axis: str | None = None


@dataclass(frozen=True)
class Attend:
    """Attention of the query slots ``q`` over the KV pairs ``kv``, folded into each query
    slot's running state (one launch of the multi-chunk kernel)."""

    q: tuple[str, ...]
    kv: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Finalize:
    """``dst[i]`` = normalized attention output of query slot ``src[i]`` (input dtype)."""

    src: tuple[str, ...]
    dst: tuple[str, ...]


Op = Union[AllToAll, Shift, SplitHeads, JoinHeads, Attend, Finalize]
COMM_OPS = (AllToAll, Shift)


@dataclass(frozen=True)
class Step:
    label: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class AttnShape:
    """Global attention shape: q, k, v are [batch, seq_len, heads, head_dim] of ``itemsize`` bytes."""

    batch: int
    seq_len: int
    heads: int
    head_dim: int
    itemsize: int = 2


# -------------------------------------------------------------- concrete expansion
@dataclass(frozen=True)
class Transfer:
    """One point-to-point copy implied by a communication op, on one device pair."""

    step: int
    op: int  # index of the op within the step
    src: int  # global rank
    dst: int
    slot: str  # source slot
    bytes: int
    link: str  # "intra" or "inter"


@dataclass(frozen=True)
class Work:
    """One kernel launch on one device."""

    step: int
    op: int
    device: int
    q: tuple[str, ...]
    kv: tuple[tuple[str, str], ...]
    q_len: int  # total query rows
    kv_len: int  # total keys
    heads: int
    flops: int  # 4 * B * q_len * kv_len * heads * head_dim


@dataclass(frozen=True)
class Schedule:
    name: str
    layout: Layout
    shape: AttnShape
    steps: tuple[Step, ...]
    slots: dict = field(hash=False, compare=False)  # slot -> local [B, L, H, D]
    inputs: tuple[str, ...] = ("q", "k", "v")
    output: str = "o"

    def ops(self):
        for s, step in enumerate(self.steps):
            for i, op in enumerate(step.ops):
                yield s, i, op

    def slot_bytes(self, slot: str) -> int:
        return int(math.prod(self.slots[slot])) * self.shape.itemsize

    def transfers(self) -> list[Transfer]:
        """Every point-to-point transfer of the schedule, for every device."""
        out = []
        lay = self.layout
        for s, i, op in self.ops():
            if isinstance(op, Shift):
                for rank in range(lay.num_devices):
                    dst = lay.shifted(rank, op.axis, op.shift)
                    if dst == rank:
                        continue
                    for slot in op.src:
                        out.append(Transfer(s, i, rank, dst, slot, self.slot_bytes(slot), lay.link(rank, dst)))
            elif isinstance(op, AllToAll):
                for rank in range(lay.num_devices):
                    group = lay.group(rank, op.axes)
                    for slot in op.src:
                        part = self.slot_bytes(slot) // len(group)
                        for dst in group:
                            if dst != rank:
                                out.append(Transfer(s, i, rank, dst, slot, part, lay.link(rank, dst)))
        return out

    def work(self) -> list[Work]:
        """Every attention kernel launch of the schedule, for every device."""
        out = []
        b, _, _, d = self.slots["q"]
        for s, i, op in self.ops():
            if isinstance(op, Attend) and op.kv:
                lq = sum(self.slots[q][1] for q in op.q)
                lk = sum(self.slots[k][1] for k, _ in op.kv)
                h = self.slots[op.q[0]][2]
                for rank in range(self.layout.num_devices):
                    out.append(Work(s, i, rank, op.q, op.kv, lq, lk, h, 4 * b * lq * lk * h * d))
        return out

    def device_steps(self, rank: int) -> list[dict]:
        """The steps as seen by one device: its sends, receives and kernel launches."""
        tr = self.transfers()
        wk = self.work()
        rows = []
        for s, step in enumerate(self.steps):
            rows.append({
                "step": s,
                "label": step.label,
                "send": [t for t in tr if t.step == s and t.src == rank],
                "recv": [t for t in tr if t.step == s and t.dst == rank],
                "work": [w for w in wk if w.step == s and w.device == rank],
            })
        return rows

    def describe(self, rank: int = 0) -> str:
        """Human-readable per-device listing."""
        lines = [f"{self.name} on {self.layout.machines}x{self.layout.gpus_per_machine} "
                 f"{self.layout.shape}, device {rank}:"]
        for row in self.device_steps(rank):
            parts = [f"  [{row['step']}] {row['label']}:"]
            for t in row["send"]:
                parts.append(f"send {t.slot}->{t.dst} {t.bytes}B {t.link};")
            for w in row["work"]:
                parts.append(f"attend {list(w.q)} x {[k for k, _ in w.kv]};")
            lines.append(" ".join(parts))
        return "\n".join(lines)


# ------------------------------------------------------------------ shape rules
def _infer_slots(layout: Layout, shape: AttnShape, steps) -> dict:
    local = (shape.batch, shape.seq_len // layout.num_devices, shape.heads, shape.head_dim)
    slots = {"q": local, "k": local, "v": local}
    for step in steps:
        for op in step.ops:
            if isinstance(op, AllToAll):
                g = math.prod(layout.size(a) for a in op.axes)
                for s, d in zip(op.src, op.dst):
                    b, l, h, dd = slots[s]
                    slots[d] = (b, l * g, h // g, dd) if op.gather == "seq" else (b, l // g, h * g, dd)
            elif isinstance(op, Shift):
                for s, d in zip(op.src, op.dst):
                    slots[d] = slots[s]
            elif isinstance(op, SplitHeads):
                b, l, h, dd = slots[op.src]
                for d in op.dst:
                    slots[d] = (b, l, h // len(op.dst), dd)
            elif isinstance(op, JoinHeads):
                b, l, h, dd = slots[op.src[0]]
                slots[op.dst] = (b, l, h * len(op.src), dd)
            elif isinstance(op, Finalize):
                for s, d in zip(op.src, op.dst):
                    slots[d] = slots[s]
            elif isinstance(op, Attend):
                for name in op.q + tuple(x for kv in op.kv for x in kv):
                    if name not in slots:
                        raise AssertionError(f"slot {name} read before it is written")
    return slots


# -------------------------------------------------------------------- builders
class _Names:
    def __init__(self):
        self.n = 0

    def __call__(self, base: str) -> str:
        self.n += 1
        return f"{base}#{self.n}"


def _ring(layout: Layout, qs, kvs, label: str, new, first_ops=()) -> list[Step]:
    """Ring attention of query slots ``qs`` over the KV pairs ``kvs`` spread over the ring axes.

    Two-level: the outer loop shifts along ``ro`` (across machines) once per outer step,
    concurrently with a full inner ring along ``ri``. ``first_ops`` join the first step."""
    b, c = layout.size("ro"), layout.size("ri")
    steps = []
    outer = list(kvs)
    for o in range(b):
        ops = list(first_ops) if o == 0 else []
        nxt_outer = None
        if o < b - 1:
            nxt_outer = [(new(k), new(v)) for k, v in outer]
            ops.append(Shift(_flat(outer), _flat(nxt_outer), "ro", 1))
        cur = outer
        for i in range(c):
            if i:
                ops = []
            nxt = None
            if i < c - 1:
                nxt = [(new(k), new(v)) for k, v in cur]
                ops.append(Shift(_flat(cur), _flat(nxt), "ri", 1))
            ops.append(Attend(tuple(qs), tuple(cur)))
            n = b * c
            steps.append(Step(f"{label} ring {o * c + i + 1}/{n}" if n > 1 else label, tuple(ops)))
            cur = nxt
        outer = nxt_outer
    return steps


def _flat(kvs) -> tuple[str, ...]:
    return tuple(x for kv in kvs for x in kv)


def _ulysses_ring(layout: Layout, new) -> list[Step]:
    """Ulysses all-to-all over (uo, ui), Ring over (ro, ri), all-to-all back (ulysses, ring,
    usp, tas: the layout's axis order decides which part lies within a machine)."""
    steps = []
    q, k, v = "q", "k", "v"
    if layout.ulysses_degree > 1:
        q, k, v = "qh", "kh", "vh"
        steps.append(Step("all-to-all q k v", (AllToAll(("q", "k", "v"), (q, k, v), ULYSSES_AXES, "seq"),)))
    steps += _ring(layout, (q,), [(k, v)], "attention", new)
    if layout.ulysses_degree > 1:
        steps.append(Step("all-to-all o", (Finalize((q,), ("oh",)),
                                           AllToAll(("oh",), ("o",), ULYSSES_AXES, "heads"))))
    else:
        steps.append(Step("finalize", (Finalize((q,), ("o",)),)))
    return steps


def _torus(layout: Layout, new) -> list[Step]:
    """Torus Attention (StreamFusion §4.3, Algorithm 1) over the across-machine Ulysses axis
    ``uo`` (size T), with intra-machine Ulysses over ``ui`` and Ring over (ro, ri).

    Device t (its ``uo`` coordinate) owns head block t. Slab l = the sequence blocks held by
    torus member l (after the intra-machine all-to-all). Slot ``x@j`` = slab t, head block t+j;
    ``qr{j}``, ``kr{j}``, ``vr{j}`` = slab t-j, head block t (pulled from member t-j)."""
    T, U = layout.size("uo"), layout.size("ui")
    steps = []
    q, k, v = "q", "k", "v"
    if U > 1:
        q, k, v = "qi", "ki", "vi"
        steps.append(Step("intra all-to-all q k v", (AllToAll(("q", "k", "v"), (q, k, v), ("ui",), "seq"),)))
    blocks = {x: tuple(f"{x}@{j}" for j in range(T)) for x in "qkv"}
    if T > 1:
        steps.append(Step("head blocks", tuple(SplitHeads(s, blocks[x], "uo") for s, x in ((q, "q"), (k, "k"), (v, "v")))))
    else:
        blocks = {"q": (q,), "k": (k,), "v": (v,)}
    kv0 = (blocks["k"][0], blocks["v"][0])
    # Pull Q: stage s computes Q_{t-s+1, t} x KV_{t, t} while pulling the next Q (last: KV_{t-1}).
    for s in range(1, T + 1):
        sends = []
        if s < T:
            sends.append(Shift((blocks["q"][s],), (f"qr{s}",), "uo", s))
        elif T > 1:
            sends.append(Shift((blocks["k"][1], blocks["v"][1]), ("kr1", "vr1"), "uo", 1))
        qcur = blocks["q"][0] if s == 1 else f"qr{s - 1}"
        steps += _ring(layout, (qcur,), [kv0], f"pull q {s}/{T}", new, sends)
    # Pull KV: stage s computes Q_{:\t, t} x KV_{t-s, t} while pulling KV_{t-s-1, t}.
    qrest = tuple(f"qr{j}" for j in range(1, T))
    for s in range(1, T):
        sends = []
        if s < T - 1:
            sends.append(Shift((blocks["k"][s + 1], blocks["v"][s + 1]), (f"kr{s + 1}", f"vr{s + 1}"), "uo", s + 1))
        steps += _ring(layout, qrest, [(f"kr{s}", f"vr{s}")], f"pull kv {s}/{T - 1}", new, sends)
    # Push O: send the finished O_{t-j, t} home while computing Q_{t,t} x KV_{:\t, t}.
    if T > 1:
        fin = Finalize(qrest, tuple(f"or{j}" for j in range(1, T)))
        sends = [fin] + [Shift((f"or{j}",), (f"ob{j}",), "uo", -j) for j in range(1, T)]
        kvs = [(f"kr{j}", f"vr{j}") for j in range(1, T)]
        steps += _ring(layout, (blocks["q"][0],), kvs, "push o", new, sends)
        tail = [Finalize((blocks["q"][0],), ("ob0",)),
                JoinHeads(tuple(f"ob{j}" for j in range(T)), "oi" if U > 1 else "o", "uo")]
    else:
        tail = [Finalize((blocks["q"][0],), ("oi" if U > 1 else "o",))]
    if U > 1:
        tail.append(AllToAll(("oi",), ("o",), ("ui",), "heads"))
    steps.append(Step("output", tuple(tail)))
    return steps


def build_schedule(name: str, layout: Layout, shape: AttnShape) -> Schedule:
    """The schedule ``name`` on ``layout`` for a global attention ``shape``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    new = _Names()
    steps = _torus(layout, new) if name == "torus" else _ulysses_ring(layout, new)
    steps = tuple(steps)
    return Schedule(name, layout, shape, steps, _infer_slots(layout, shape, steps))


def schedule_for(name: str, machines: int, gpus_per_machine: int, shape: AttnShape,
                 ulysses: int | None = None, ring: int | None = None) -> Schedule:
    """Schedule ``name`` for N x M GPUs without any jax devices (simulator, volume counts).

    Default degrees: ulysses P_u = P; ring P_r = P; others P_u = gcd(P, H) (§4.2)."""
    p = machines * gpus_per_machine
    pu, pr = default_degrees(name, p, shape.heads, ulysses, ring)
    layout = make_layout(LAYOUT_ORDER[name], machines, gpus_per_machine, pu, pr)
    return build_schedule(name, layout, shape)


def default_degrees(name: str, num_devices: int, heads: int, ulysses=None, ring=None) -> tuple[int, int]:
    p = num_devices
    if name == "ulysses":
        if ulysses not in (None, p) or ring not in (None, 1):
            raise ValueError(f"ulysses uses P_u = P = {p} and P_r = 1")
        return p, 1
    if name == "ring":
        if ring not in (None, p) or ulysses not in (None, 1):
            raise ValueError(f"ring uses P_r = P = {p} and P_u = 1")
        return 1, p
    if ulysses is None and ring is None:
        ulysses = math.gcd(p, heads)
    if ulysses is None:
        if p % ring:
            raise ValueError(f"Ring degree P_r={ring} must divide the number of devices P={p}")
        ulysses = p // ring
    if ring is None:
        if p % ulysses:
            raise ValueError(f"Ulysses degree P_u={ulysses} must divide the number of devices P={p}")
        ring = p // ulysses
    return ulysses, ring

