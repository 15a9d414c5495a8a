"""Predicts the per-layer latency of each schedule from link bandwidths and a kernel model.

The simulator replays a schedule's description (the same one the XLA backend executes) as
an event timeline, device by device:

* every device has one compute stream; an :class:`~.schedules.Attend` starts when the stream
  is free and its query, KV and state slots are ready, and takes ``KernelModel.time``;
* the transfers of one communication op share the channels they cross: each channel carries
  its share back to back at full bandwidth from when the op's data is ready and the channel is
  free (+ one latency), and a transfer lands when both of its channels are done. Channels:
  each GPU's intra-machine send and receive ports; each machine's NIC, send and receive,
  shared by its GPUs (``inter_bw`` is per machine; ``nic_per_gpu=True`` when every GPU has its
  own NIC of that speed);
* data dependencies come from slot names, so a transfer overlaps whatever attention does not
  need its result. With ``overlap=False`` communication and compute share one stream per
  device (blocking collectives);
* a :class:`Transport` adds what a backend does around a ``Shift`` besides the link: the
  NVSHMEM backend copies each received slot out of its arena on the receiver's compute
  stream before the slot's first use, and ends the call with a barrier.

:func:`fit_link` fits a link's latency and bandwidth to a bare transfer sweep.

Local re-layouts (head splits, concatenations, finalization) are taken as free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .description import AllToAll, Attend, AttnShape, Finalize, JoinHeads, Schedule, Shift, SplitHeads
from .schedules import SCHEDULES, schedule_for

GBPS = 1e9 / 8  # bytes/s in one Gb/s
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class KernelModel:
    """Time of one attention launch: ``launch_s + flops / (tflops * 1e12)``, or ``fn``.

    ``fn(batch, q_len, kv_len, heads, head_dim, itemsize) -> seconds`` replaces the linear
    model when given (e.g. an interpolation of measured kernel times)."""

    tflops: float = 400.0
    launch_s: float = 10e-6
    fn: Callable | None = None

    def time(self, batch: int, q_len: int, kv_len: int, heads: int, head_dim: int, itemsize: int = 2) -> float:
        if self.fn is not None:
            return float(self.fn(batch, q_len, kv_len, heads, head_dim, itemsize))
        flops = 4.0 * batch * q_len * kv_len * heads * head_dim
        return self.launch_s + flops / (self.tflops * 1e12)

    @classmethod
    def fit(cls, samples) -> "KernelModel":
        """Least-squares fit of ``seconds = launch_s + flops / throughput`` to measured
        ``(flops, seconds)`` pairs of single-GPU kernel runs (launch_s clipped at 0)."""
        a = np.array([[1.0, f] for f, _ in samples])
        t = np.array([s for _, s in samples])
        if len(samples) == 1:
            return cls(tflops=samples[0][0] / samples[0][1] / 1e12, launch_s=0.0)
        (c0, c1), *_ = np.linalg.lstsq(a, t, rcond=None)
        if c0 < 0:  # refit through the origin
            c0, c1 = 0.0, float(np.dot(a[:, 1], t) / np.dot(a[:, 1], a[:, 1]))
        return cls(tflops=1.0 / c1 / 1e12, launch_s=float(c0))


@dataclass(frozen=True)
class Links:
    """Bandwidths in bytes/s (per direction) and per-message latencies in seconds."""

    intra_bw: float = 450e9  # per GPU (NVLink 4 through NVSwitch: 900 GB/s both ways)
    inter_bw: float = 400 * GBPS  # per machine (shared by its GPUs) unless nic_per_gpu
    intra_latency: float = 5e-6
    inter_latency: float = 20e-6
    nic_per_gpu: bool = False


@dataclass(frozen=True)
class Transport:
    """What a backend adds around each ``Shift`` besides the link (the XLA backend: nothing).

    ``copy_bw``: bytes/s of copying a received slot out of a staging buffer on the receiver's
    compute stream, before the slot's first use (None: the transfer lands in place);
    ``in_place``: the attention and a forwarding Shift read a staged slot where it is (only
    its ``per_slot_s`` is paid); other reads still copy it out;
    ``per_slot_s``: a fixed cost per received slot on that stream (the signal wait and the
    copy's launch); ``per_call_s``: added once at the end (the NVSHMEM backend's barrier);
    ``shift_links``: the links a ``Shift`` travels (the puts'), where they differ from the
    collectives' (the all-to-alls stay XLA collectives)."""

    copy_bw: float | None = None
    in_place: bool = False
    per_slot_s: float = 0.0
    per_call_s: float = 0.0
    shift_links: Links | None = None


def fit_link(samples) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes / bandwidth`` over measured ``(bytes,
    seconds)`` pairs of bare transfers (one size at least twice the other); returns
    ``(latency_s, bytes_per_s)``, the latency clipped at 0 (then refitted through the origin)."""
    a = np.array([[1.0, float(b)] for b, _ in samples])
    t = np.array([float(s) for _, s in samples])
    if len(samples) < 2 or a[:, 1].max() < 2 * a[:, 1].min():
        raise ValueError("fit_link needs transfers of at least two sizes, the largest at least twice the smallest")
    (c0, c1), *_ = np.linalg.lstsq(a, t, rcond=None)
    if c0 < 0:
        c0, c1 = 0.0, float(np.dot(a[:, 1], t) / np.dot(a[:, 1], a[:, 1]))
    if c1 <= 0:
        raise ValueError(f"fit_link: times do not grow with bytes ({samples})")
    return float(c0), 1.0 / float(c1)


@dataclass
class SimResult:
    schedule: str
    latency_s: float
    compute_s: float  # busiest device's kernel time
    inter_bytes: int  # most bytes any machine sends across machines
    intra_bytes: int  # most bytes any GPU sends within its machine
    launches: int  # kernel launches per device
    ulysses_degree: int
    ring_degree: int
    layout: dict = field(default_factory=dict)

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.latency_s - self.compute_s)


def _link_channels(lay, links: Links, src: int, dst: int):
    if lay.machine(src) == lay.machine(dst):
        return ("intra_out", src), ("intra_in", dst), links.intra_bw, links.intra_latency
    if links.nic_per_gpu:
        return ("nic_out", src), ("nic_in", dst), links.inter_bw, links.inter_latency
    return ("nic_out", lay.machine(src)), ("nic_in", lay.machine(dst)), links.inter_bw, links.inter_latency


def simulate_schedule(schedule: Schedule, kernel: KernelModel | None = None, links: Links | None = None,
                      overlap: bool = True, transport: Transport | None = None) -> SimResult:
    """Replay ``schedule`` and return its predicted latency (see module docstring)."""
    kernel = kernel or KernelModel()
    links = links or Links()
    transport = transport or Transport()
    lay = schedule.layout
    sh = schedule.shape
    p = lay.num_devices
    ready = [{"q": 0.0, "k": 0.0, "v": 0.0} for _ in range(p)]
    state = [dict() for _ in range(p)]
    stream = [0.0] * p  # compute stream (and, without overlap, the only stream)
    busy = [0.0] * p
    chan: dict = {}
    launches = 0
    staged = [dict() for _ in range(p)]  # slot -> bytes still to copy out (Transport.copy_bw)

    def settle(r, names, in_place=False):
        """Copies device r's staged slots among ``names`` out on its compute stream (read in
        place: only their waits)."""
        for n in names:
            if n in staged[r]:
                start = max(stream[r], ready[r][n])
                nbytes = staged[r].pop(n)
                stream[r] = start + transport.per_slot_s + (0 if in_place else nbytes / transport.copy_bw)
                busy[r] += stream[r] - start
                ready[r][n] = stream[r]

    def communicate(items, one_sided=False):
        """items: (src, dst, src_slot, dst_slot, nbytes) of one op, all issued together.
        Each channel carries its share of the op back to back at full bandwidth (bandwidth
        is shared among concurrent transfers); a transfer lands when both its channels are done."""
        lk = transport.shift_links if one_sided and transport.shift_links else links
        for src, _, slot, _, _ in items:  # a staged source is copied out (or waited for) before it is sent on
            settle(src, [slot], in_place=transport.in_place)
        loads: dict = {}
        for src, dst, slot, _, nbytes in items:
            if src == dst:
                continue
            out_c, in_c, bw, lat = _link_channels(lay, lk, src, dst)
            t0 = ready[src][slot]
            if not overlap:
                t0 = max(t0, stream[src], stream[dst])
            for c in (out_c, in_c):
                load = loads.setdefault(c, [0.0, 0.0, bw, lat])
                load[0] = max(load[0], t0)
                load[1] += nbytes
        ends = {}
        for c, (t0, nbytes, bw, lat) in loads.items():
            ends[c] = max(t0, chan.get(c, 0.0)) + lat + nbytes / bw
            chan[c] = ends[c]
        arrivals = [dict() for _ in range(p)]
        for src, dst, slot, dslot, nbytes in items:
            if src == dst:
                t = ready[src][slot]
            else:
                if one_sided and transport.copy_bw:
                    staged[dst][dslot] = staged[dst].get(dslot, 0) + nbytes
                out_c, in_c, _, _ = _link_channels(lay, lk, src, dst)
                t = max(ends[out_c], ends[in_c])
                if not overlap:
                    stream[src] = max(stream[src], t)
            arrivals[dst][dslot] = max(arrivals[dst].get(dslot, 0.0), t)
        for r in range(p):
            ready[r].update(arrivals[r])
            if not overlap:
                stream[r] = max([stream[r]] + list(arrivals[r].values()))

    for _, _, op in schedule.ops():
        if isinstance(op, AllToAll):
            items = []
            for s, d in zip(op.src, op.dst):
                part = schedule.slot_bytes(s) // math.prod(lay.size(a) for a in op.axes)
                for src in range(p):
                    items += [(src, dst, s, d, part) for dst in lay.group(src, op.axes)]
            communicate(items)
        elif isinstance(op, Shift):
            communicate([(src, lay.shifted(src, op.axis, op.shift), s, d, schedule.slot_bytes(s))
                         for s, d in zip(op.src, op.dst) for src in range(p)], one_sided=True)
        elif isinstance(op, SplitHeads):
            for r in range(p):
                settle(r, [op.src])
                for d in op.dst:
                    ready[r][d] = ready[r][op.src]
        elif isinstance(op, JoinHeads):
            for r in range(p):
                settle(r, op.src)
                ready[r][op.dst] = max(ready[r][s] for s in op.src)
        elif isinstance(op, Finalize):
            for r in range(p):
                settle(r, op.src)
                for s, d in zip(op.src, op.dst):
                    ready[r][d] = max(ready[r][s], state[r].get(s, 0.0))
        elif isinstance(op, Attend) and op.kv:
            lq = sum(schedule.slots[q][1] for q in op.q)
            lk = sum(schedule.slots[k][1] for k, _ in op.kv)
            h = schedule.slots[op.q[0]][2]
            dt = kernel.time(sh.batch, lq, lk, h, sh.head_dim, sh.itemsize)
            launches += 1
            names = list(op.q) + [x for kv in op.kv for x in kv]
            for r in range(p):
                settle(r, names, in_place=transport.in_place)
                start = max([stream[r]] + [ready[r][n] for n in names] + [state[r].get(q, 0.0) for q in op.q])
                stream[r] = start + dt
                busy[r] += dt
                for q in op.q:
                    state[r][q] = stream[r]
    for r in range(p):
        settle(r, [schedule.output])
    latency = max(ready[r][schedule.output] for r in range(p)) + transport.per_call_s
    inter, intra = {}, {}
    for t in schedule.transfers():
        if t.link == "inter":
            inter[lay.machine(t.src)] = inter.get(lay.machine(t.src), 0) + t.bytes
        else:
            intra[t.src] = intra.get(t.src, 0) + t.bytes
    return SimResult(schedule.name, latency, max(busy), max(inter.values(), default=0),
                     max(intra.values(), default=0), launches, lay.ulysses_degree, lay.ring_degree,
                     dict(lay.shape))


def _kernel_model(kernel) -> KernelModel:
    if kernel is None:
        return KernelModel()
    if isinstance(kernel, KernelModel):
        return kernel
    if callable(kernel):
        return KernelModel(fn=kernel)
    return KernelModel(tflops=float(kernel))


def simulate(machines: int, gpus_per_machine: int, seq_len: int, heads: int, head_dim: int,
             dtype: str = "bf16", *, batch: int = 1, intra_bw: float = 450e9,
             inter_bw: float = 400 * GBPS, kernel=None, schedules=SCHEDULES, overlap: bool = True,
             ulysses_degree: int | None = None, ring_degree: int | None = None,
             links: Links | None = None, transport: Transport | None = None) -> dict:
    """Predicted per-layer attention latency of each schedule on N machines x M GPUs.

    ``kernel``: a :class:`KernelModel`, a TFLOP/s figure, or a callable
    ``(batch, q_len, kv_len, heads, head_dim, itemsize) -> seconds`` (calibrate it from
    measured single-GPU kernel times, e.g. with :meth:`KernelModel.fit`). Bandwidths in bytes/s:
    ``intra_bw`` per GPU, ``inter_bw`` per machine. Returns ``{schedule: SimResult}``; a schedule
    that cannot serve the shape maps to the ValueError message (a str)."""
    itemsize = DTYPE_BYTES[dtype] if isinstance(dtype, str) else np.dtype(dtype).itemsize
    shape = AttnShape(batch, seq_len, heads, head_dim, itemsize)
    km = _kernel_model(kernel)
    links = links or Links(intra_bw=intra_bw, inter_bw=inter_bw)
    out = {}
    p = machines * gpus_per_machine
    for name in schedules:
        try:
            if seq_len % p:
                raise ValueError(f"{name}: sequence length L={seq_len} must be divisible by P={p}")
            pu = ulysses_degree if name not in ("ulysses", "ring") else None
            pr = ring_degree if name not in ("ulysses", "ring") else None
            sched = schedule_for(name, machines, gpus_per_machine, shape, pu, pr)
            if heads % sched.layout.ulysses_degree:
                raise ValueError(f"{name}: heads H={heads} must be divisible by the Ulysses degree "
                                 f"P_u={sched.layout.ulysses_degree}")
            out[name] = simulate_schedule(sched, km, links, overlap, transport)
        except ValueError as e:
            out[name] = str(e)
    return out


__all__ = ["KernelModel", "Links", "SimResult", "Transport", "fit_link", "simulate", "simulate_schedule",
           "GBPS"]
