"""The five schedules, built once as data (:mod:`.description`) for a layout and a shape.

* ``ulysses`` all-to-all over all devices (P_u = P);
* ``ring``    KV passed around all devices (P_r = P), two-level when it spans machines;
* ``usp``     Ulysses innermost (within a machine), Ring across (the baseline);
* ``tas``     topology-aware: Ring innermost (within a machine), Ulysses across;
* ``torus``   tas with the across-machine all-to-all broken into T-1 stages:
  Pull Q -> Pull KV -> Push O (StreamFusion §4.3, Algorithm 1), each transfer overlapping
  attention on the chunks already present.
"""
from __future__ import annotations

import math

from .description import (AllToAll, Attend, AttnShape, Finalize, JoinHeads, Schedule, Shift, SplitHeads,
                          Step, infer_slots)
from .layout import ULYSSES_AXES, Layout, make_layout

SCHEDULES = ("ulysses", "ring", "usp", "tas", "torus")
LAYOUT_ORDER = {"ulysses": "ring-inner", "ring": "ring-inner", "usp": "ulysses-inner",
                "tas": "ring-inner", "torus": "ring-inner"}


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


def check_layout(name: str, layout: Layout) -> None:
    """Raise ValueError if schedule ``name`` cannot run on ``layout``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if name == "torus" and layout.size("uo") > 1 and layout.size("ro") > 1:
        raise ValueError(
            f"torus: Ring degree P_r={layout.ring_degree} exceeds the GPUs per machine "
            f"M={layout.gpus_per_machine}, so every Torus stage would repeat a ring across machines; "
            f"Torus needs N | P_u (P_r <= M), as in StreamFusion §4.3 -- use tas or a larger P_u")


def build_schedule(name: str, layout: Layout, shape: AttnShape) -> Schedule:
    """The schedule ``name`` on ``layout`` for a global attention ``shape``."""
    check_layout(name, layout)
    new = _Names()
    steps = _torus(layout, new) if name == "torus" else _ulysses_ring(layout, new)
    steps = tuple(steps)
    return Schedule(name, layout, shape, steps, infer_slots(layout, shape, steps))


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

