"""Planner: machines from devices, P_u = gcd(N M, H), overrides, and clear errors."""
from dataclasses import dataclass

import jax
import pytest

from jax_cluster import parallel as sp


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def test_machines_from_process_index():
    devs = [FakeDevice(i, i // 4) for i in (5, 1, 0, 7, 2, 4, 3, 6)]
    topo = sp.find_topology(devs)
    assert (topo.machines, topo.gpus_per_machine) == (2, 4)
    assert [d.id for d in topo.devices] == list(range(8))  # machine-major, by id


def test_uneven_machines_rejected():
    devs = [FakeDevice(i, 0 if i < 3 else 1) for i in range(8)]
    with pytest.raises(ValueError, match="different numbers of devices"):
        sp.find_topology(devs)


def test_fake_cpu_devices_are_one_machine_unless_overridden():
    assert sp.find_topology().machines == 1
    topo = sp.find_topology(num_machines=2)
    assert (topo.machines, topo.gpus_per_machine) == (2, 4)
    with pytest.raises(ValueError, match="num_machines=3 must divide"):
        sp.find_topology(num_machines=3)


@pytest.mark.parametrize("heads,n,pu,pr", [(24, 2, 8, 1), (12, 2, 4, 2), (30, 4, 2, 4), (7, 1, 1, 8)])
def test_gcd_rule(heads, n, pu, pr):
    p = sp.plan("tas", heads=heads, num_machines=n)
    assert (p.ulysses_degree, p.ring_degree) == (pu, pr)
    assert p.mesh.shape == p.layout.shape
    assert p.mesh.devices.size == len(jax.devices())


def test_overrides_and_layouts():
    p = sp.plan("usp", heads=24, num_machines=2, ring_degree=4)
    assert (p.ulysses_degree, p.ring_degree) == (2, 4)
    assert p.layout.shape == {"ro": 2, "ri": 2, "uo": 1, "ui": 2}  # Ulysses within a machine
    p = sp.plan("tas", heads=24, num_machines=2, ulysses_degree=4)
    assert p.layout.shape == {"uo": 2, "ui": 2, "ro": 1, "ri": 2}  # Ring within a machine
    assert sp.plan("ring", num_machines=4).layout.shape == {"uo": 1, "ui": 1, "ro": 4, "ri": 2}


def test_errors_name_the_constraint():
    with pytest.raises(ValueError, match=r"heads H=30 must be divisible by the Ulysses degree P_u=8"):
        sp.plan("ulysses", heads=30)
    with pytest.raises(ValueError, match="pass heads="):
        sp.plan("torus")
    with pytest.raises(ValueError, match=r"P_u=3 must divide the number of devices P=8"):
        sp.plan("tas", heads=24, ulysses_degree=3)
    with pytest.raises(ValueError, match=r"Torus needs N \| P_u"):
        sp.plan("torus", heads=8, num_machines=4, ulysses_degree=2)  # ring would span machines
    with pytest.raises(ValueError, match="unknown schedule"):
        sp.plan("zigzag", heads=8)
    p = sp.plan("usp", heads=8, num_machines=2)
    with pytest.raises(ValueError, match=r"sequence length L=30 must be divisible by the number of devices P=N\*M=8"):
        p.check((1, 30, 8, 16))
    with pytest.raises(ValueError, match=r"heads H=12 must be divisible by the Ulysses degree P_u=8"):
        p.check((1, 32, 12, 16))
    with pytest.raises(ValueError, match="one shape"):
        p.check((1, 32, 8, 16), (1, 64, 8, 16))


def test_layout_alignment_errors():
    with pytest.raises(ValueError, match="Ring degree 4 must divide the GPUs per machine M=6"):
        sp.make_layout("ring-inner", 2, 6, 3, 4)
    with pytest.raises(ValueError, match=r"must equal the number of devices"):
        sp.make_layout("ulysses-inner", 2, 4, 2, 2)


def test_layout_coordinates_roundtrip():
    lay = sp.make_layout("ring-inner", 4, 8, 8, 4)
    assert lay.shape == {"uo": 4, "ui": 2, "ro": 1, "ri": 4}
    for r in range(32):
        assert lay.rank(lay.coords(r)) == r
    assert lay.group(5, ("uo", "ui")) == [1, 5, 9, 13, 17, 21, 25, 29]
    assert lay.shifted(5, "uo", 1) == 13 and lay.link(5, 13) == "inter" and lay.link(5, 6) == "intra"
