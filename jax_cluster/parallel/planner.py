"""Planner: from devices and heads to a schedule, its degrees and a jax Mesh (StreamFusion §4.2).

N machines x M GPUs are found from the devices (``topology``); for H heads the Ulysses degree
is P_u = gcd(N M, H) and the Ring degree P_r = N M / P_u unless given explicitly. Every
constraint a schedule puts on a shape is checked here, with a ValueError naming it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from .layout import Layout, make_layout
from .description import AttnShape, Schedule
from .schedules import LAYOUT_ORDER, SCHEDULES, build_schedule, check_layout, default_degrees
from .topology import Topology, find_topology


# "nvshmem": one-sided puts where NVSHMEM runs (one process per GPU), else "xla" with a warning.
BACKENDS = ("xla", "nvshmem")


@dataclass(frozen=True)
class Plan:
    """A schedule bound to devices: degrees, mesh layout and the jax Mesh."""

    schedule: str
    topology: Topology
    layout: Layout
    mesh: Any  # jax.sharding.Mesh with axes layout.axis_names

    @property
    def ulysses_degree(self) -> int:
        return self.layout.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.layout.ring_degree

    @property
    def seq_axes(self) -> tuple[str, ...]:
        """Mesh axes the sequence dimension is sharded over (device g holds block g)."""
        return tuple(self.layout.axis_names)

    def sharding(self, ndim: int = 4, seq_dim: int = 1):
        """NamedSharding splitting dimension ``seq_dim`` of an ``ndim`` array over all devices."""
        from jax.sharding import NamedSharding, PartitionSpec

        spec = [None] * ndim
        spec[seq_dim] = self.seq_axes
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def check(self, q_shape, k_shape=None, v_shape=None) -> None:
        """Raise ValueError if this plan cannot serve q/k/v of these shapes."""
        check_shape(self.schedule, self.layout, q_shape, k_shape, v_shape)

    def build(self, shape: AttnShape) -> Schedule:
        return _cached_schedule(self.schedule, self.layout, shape)

    def __call__(self, q, k, v, *, kernel=None, scale=None, backend: str = "xla"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        self.check(q.shape, k.shape, v.shape)
        b, l, h, d = q.shape
        sched = self.build(AttnShape(b, l, h, d, np.dtype(q.dtype).itemsize))
        if backend == "nvshmem":
            from . import nvshmem

            return nvshmem.execute(sched, self, q, k, v, kernel=kernel, scale=scale)
        from .xla_backend import execute

        return execute(sched, self.mesh, q, k, v, kernel=kernel, scale=scale)

    def __repr__(self) -> str:
        return (f"Plan({self.schedule}, N={self.layout.machines} x M={self.layout.gpus_per_machine}, "
                f"P_u={self.ulysses_degree}, P_r={self.ring_degree}, mesh={self.layout.shape})")


@functools.lru_cache(maxsize=256)
def _cached_schedule(name: str, layout: Layout, shape: AttnShape) -> Schedule:
    return build_schedule(name, layout, shape)


def check_shape(schedule: str, layout: Layout, q_shape, k_shape=None, v_shape=None) -> None:
    """The constraints of ``schedule`` on ``layout`` for q [B, L, H, Dh] (and k, v)."""
    if len(q_shape) != 4:
        raise ValueError(f"q must be [B, L, H, Dh], got shape {tuple(q_shape)}")
    for name, s in (("k", k_shape), ("v", v_shape)):
        if s is not None and tuple(s) != tuple(q_shape):
            raise ValueError(f"{name} has shape {tuple(s)}; sequence-parallel self-attention needs "
                             f"q, k and v of one shape {tuple(q_shape)}")
    _, l, h, _ = q_shape
    p = layout.num_devices
    if l % p:
        raise ValueError(f"{schedule}: sequence length L={l} must be divisible by the number of "
                         f"devices P=N*M={p} (each device holds L/P tokens)")
    pu = layout.ulysses_degree
    if h % pu:
        raise ValueError(f"{schedule}: heads H={h} must be divisible by the Ulysses degree P_u={pu} "
                         f"(the all-to-all scatters heads; P_u = gcd(N*M, H) serves any H)")


def plan(
    schedule: str = "torus",
    *,
    heads: int | None = None,
    devices: Sequence[Any] | None = None,
    num_machines: int | None = None,
    machine_of: Callable[[Any], Hashable] | None = None,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
) -> Plan:
    """Plan ``schedule`` (one of ulysses, ring, usp, tas, torus) on ``devices``.

    ``heads`` sets P_u = gcd(N M, heads) (needed for usp/tas/torus unless a degree is given);
    ``ulysses_degree`` / ``ring_degree`` override it. ``num_machines`` / ``machine_of`` override
    machine discovery (one machine per process by default)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    topo = find_topology(devices, num_machines=num_machines, machine_of=machine_of)
    p = topo.num_devices
    if schedule in ("usp", "tas", "torus") and heads is None and ulysses_degree is None and ring_degree is None:
        raise ValueError(f"{schedule}: pass heads= (P_u = gcd(N*M, H)) or ulysses_degree=/ring_degree=")
    pu, pr = default_degrees(schedule, p, heads or 1, ulysses_degree, ring_degree)
    if heads is not None and heads % pu:
        raise ValueError(f"{schedule}: heads H={heads} must be divisible by the Ulysses degree P_u={pu}")
    layout = make_layout(LAYOUT_ORDER[schedule], topo.machines, topo.gpus_per_machine, pu, pr)
    check_layout(schedule, layout)
    from jax.sharding import Mesh

    mesh = Mesh(np.array(topo.devices, dtype=object).reshape(layout.axis_sizes), layout.axis_names)
    return Plan(schedule, topo, layout, mesh)


def sp_attention(q, k, v, plan: Plan, *, kernel=None, scale=None, backend: str = "xla"):
    """Sequence-parallel attention of global ``[B, L, H, Dh]`` arrays under ``plan``.

    ``kernel``: the local attention kernel (a name, a callable with the hook signature, or
    None = ``jax_cluster.flash_attention``); see :mod:`.local_attention`. ``backend``:
    ``"xla"`` (collectives) or ``"nvshmem"`` (one-sided puts, :mod:`.nvshmem`; the XLA
    backend with one warning where NVSHMEM cannot run)."""
    return plan(q, k, v, kernel=kernel, scale=scale, backend=backend)
