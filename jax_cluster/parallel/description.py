"""The data model of a sequence-parallel attention schedule (read by every backend).

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
from slot names (every slot is written once). Consumers: the XLA backend (``xla_backend``)
executes the ops with ``all_to_all`` / ``ppermute``; the simulator and the volume counter
expand them into concrete per-device :class:`Transfer` s (source, destination, bytes,
intra/inter link) and :class:`Work` items (:meth:`Schedule.transfers`, :meth:`Schedule.work`,
:meth:`Schedule.device_steps`); a one-sided NVSHMEM backend can map slots to a symmetric arena.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

from .layout import Layout

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
def infer_slots(layout: Layout, shape: AttnShape, steps) -> dict:
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
