"""Which devices share a machine: N machines x M GPUs from a list of jax devices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence


@dataclass(frozen=True)
class Topology:
    """Devices grouped by machine, machine-major: ``devices[n * M + m]`` is GPU m of machine n."""

    machines: int
    gpus_per_machine: int
    devices: tuple[Any, ...]

    @property
    def num_devices(self) -> int:
        return self.machines * self.gpus_per_machine


def default_machine_key(device) -> Hashable:
    """A device's machine: its process (``process_index``), assuming one process per machine.

    With one process per GPU, pass ``machine_of`` (e.g. a hostname table) or ``num_machines``."""
    return getattr(device, "process_index", 0)


def find_topology(
    devices: Sequence[Any] | None = None,
    *,
    num_machines: int | None = None,
    machine_of: Callable[[Any], Hashable] | None = None,
) -> Topology:
    """Group ``devices`` (default ``jax.devices()``) into N machines x M GPUs.

    ``num_machines`` overrides discovery by splitting the devices, ordered by machine and id,
    into that many equal consecutive groups (e.g. ``num_machines=2`` makes 8 fake CPU devices
    a 2 x 4 cluster). ``machine_of`` maps a device to its machine key."""
    if devices is None:
        import jax

        devices = jax.devices()
    devices = list(devices)
    if not devices:
        raise ValueError("no devices")
    key = machine_of or default_machine_key
    groups: dict[Hashable, list] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    ordered_keys = sorted(groups, key=lambda k: (str(type(k)), k))
    ordered = [d for k in ordered_keys for d in sorted(groups[k], key=lambda d: getattr(d, "id", 0))]
    if num_machines is not None:
        if num_machines < 1 or len(ordered) % num_machines:
            raise ValueError(
                f"num_machines={num_machines} must divide the number of devices {len(ordered)}"
            )
        return Topology(num_machines, len(ordered) // num_machines, tuple(ordered))
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(
            f"machines have different numbers of devices {sorted(len(g) for g in groups.values())}; "
            f"pass devices= with equal groups or num_machines="
        )
    return Topology(len(groups), sizes.pop(), tuple(ordered))
