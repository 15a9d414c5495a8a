"""How N machines x M GPUs are factored into the mesh axes the schedules use (pure Python).

Devices are numbered machine-major: global rank g = n * M + m (machine n, local GPU m), and
device g holds sequence block g (tokens [g L/P, (g+1) L/P)) of every input and of the output.

Four mesh axes, each a factor of P = N * M:

* ``uo`` Ulysses across machines (the Torus axis of StreamFusion, size T),
* ``ui`` Ulysses within a machine,
* ``ro`` Ring across machines (the outer loop of a two-level ring),
* ``ri`` Ring within a machine.

The Ulysses degree is P_u = |uo| |ui|, the Ring degree P_r = |ro| |ri|. The order of the axes
fixes which groups are contiguous (hence inside a machine):

* ``ring-inner`` (uo, ui, ro, ri): ring innermost -- topology-aware (tas, torus), ulysses, ring;
* ``ulysses-inner`` (ro, ri, uo, ui): Ulysses innermost -- USP.

The rank is the row-major index over the axes in that order, so the same sequence sharding
(``PartitionSpec(None, axis_names)``) serves every schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

RING_INNER = ("uo", "ui", "ro", "ri")
ULYSSES_INNER = ("ro", "ri", "uo", "ui")
ULYSSES_AXES = ("uo", "ui")
RING_AXES = ("ro", "ri")


@dataclass(frozen=True)
class Layout:
    """Factorisation of N machines x M GPUs into the axes ``uo, ui, ro, ri`` (in mesh order)."""

    machines: int
    gpus_per_machine: int
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @property
    def num_devices(self) -> int:
        return self.machines * self.gpus_per_machine

    def size(self, axis: str) -> int:
        return self.axis_sizes[self.axis_names.index(axis)]

    @property
    def ulysses_degree(self) -> int:
        return self.size("uo") * self.size("ui")

    @property
    def ring_degree(self) -> int:
        return self.size("ro") * self.size("ri")

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.axis_sizes))

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in reversed(list(zip(self.axis_names, self.axis_sizes))):
            out[name] = rank % size
            rank //= size
        return out

    def rank(self, coords: dict[str, int]) -> int:
        r = 0
        for name, size in zip(self.axis_names, self.axis_sizes):
            r = r * size + coords[name] % size
        return r

    def machine(self, rank: int) -> int:
        return rank // self.gpus_per_machine

    def shifted(self, rank: int, axis: str, shift: int) -> int:
        """The rank ``shift`` places further along ``axis`` (cyclic)."""
        c = self.coords(rank)
        c[axis] = (c[axis] + shift) % self.size(axis)
        return self.rank(c)

    def group(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """Ranks of ``rank``'s group over ``axes``, ordered row-major over ``axes``."""
        c = self.coords(rank)
        members = [dict(c)]
        for axis in axes:
            members = [dict(m, **{axis: i}) for m in members for i in range(self.size(axis))]
        return [self.rank(m) for m in members]

    def group_index(self, rank: int, axes: tuple[str, ...]) -> int:
        c = self.coords(rank)
        i = 0
        for axis in axes:
            i = i * self.size(axis) + c[axis]
        return i

    def link(self, src: int, dst: int) -> str:
        return "intra" if self.machine(src) == self.machine(dst) else "inter"


def _split(degree: int, per_machine: int, name: str) -> tuple[int, int]:
    """(across, within) factors of a group of ``degree`` that must align with machines."""
    if degree <= per_machine:
        if per_machine % degree:
            raise ValueError(
                f"{name} degree {degree} must divide the GPUs per machine M={per_machine} "
                f"(or be a multiple of it) so that its groups align with machines"
            )
        return 1, degree
    if degree % per_machine:
        raise ValueError(
            f"{name} degree {degree} must be a multiple of the GPUs per machine M={per_machine} "
            f"(or divide it) so that its groups align with machines"
        )
    return degree // per_machine, per_machine


def make_layout(order: str, machines: int, gpus_per_machine: int, ulysses: int, ring: int) -> Layout:
    """Layout for ``order`` in {"ring-inner", "ulysses-inner"}; raises ValueError on a misfit."""
    n, m = machines, gpus_per_machine
    if n < 1 or m < 1:
        raise ValueError(f"need at least one machine and one GPU per machine, got N={n}, M={m}")
    if ulysses < 1 or ring < 1 or ulysses * ring != n * m:
        raise ValueError(
            f"Ulysses degree P_u={ulysses} times Ring degree P_r={ring} must equal the number of "
            f"devices N*M={n}*{m}={n * m}"
        )
    if order == "ring-inner":
        ro, ri = _split(ring, m, "Ring")
        if ro == 1:  # ring inside a machine; Ulysses fills the machine, then spans machines
            ui = m // ri
            sizes = {"uo": ulysses // ui, "ui": ui, "ro": 1, "ri": ri}
        else:  # ring spans ro machines; every Ulysses peer is on another machine
            sizes = {"uo": ulysses, "ui": 1, "ro": ro, "ri": ri}
        names = RING_INNER
    elif order == "ulysses-inner":
        uo, ui = _split(ulysses, m, "Ulysses")
        if uo == 1:  # Ulysses inside a machine; the ring fills the machine, then spans machines
            ri = m // ui
            sizes = {"ro": ring // ri, "ri": ri, "uo": 1, "ui": ui}
        else:  # Ulysses spans uo machines; every ring peer is on another machine group
            sizes = {"ro": ring, "ri": 1, "uo": uo, "ui": ui}
        names = ULYSSES_INNER
    else:
        raise ValueError(f"unknown layout order {order!r}")
    layout = Layout(n, m, names, tuple(sizes[a] for a in names))
    assert math.prod(layout.axis_sizes) == n * m
    return layout
