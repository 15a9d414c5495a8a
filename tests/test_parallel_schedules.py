"""Every schedule on every factorisation of 8 fake CPU devices against single-device attention,
and the structure of the descriptions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import parallel as sp

# Cheap CPU compiles: these tests check numbers, not speed.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MACHINES = (1, 2, 4, 8)  # 1x8, 2x4, 4x2, 8x1


def _cases():
    out = []
    for n in MACHINES:
        out += [(n, "ulysses", None), (n, "ring", None)]
        out += [(n, s, pu) for s in ("usp", "tas") for pu in (2, 4)]  # pu 1 / 8 = ring / ulysses
        m = 8 // n
        out += [(n, "torus", pu) for pu in (2, 4, 8) if n > 1 and 8 // pu <= m]  # T = n > 1
    out.append((1, "torus", 4))  # one machine: Torus degenerates to tas
    return out


def _inputs(b=1, l=32, h=8, d=8, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(x, (b, l, h, d), dtype) for x in ks)


def _run(p, q, k, v):
    return jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p), compiler_options=FAST)(q, k, v)


@pytest.mark.parametrize("n,name,pu", _cases(), ids=lambda x: str(x))
def test_schedule_matches_single_device(n, name, pu):
    q, k, v = _inputs()
    p = sp.plan(name, heads=8, num_machines=n, ulysses_degree=pu)
    assert p.layout.machines == n and p.layout.gpus_per_machine == 8 // n
    out = _run(p, q, k, v)
    ref = sp.reference_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    # output sharded along the sequence like the inputs
    assert out.sharding.is_equivalent_to(p.sharding(), 4)


@pytest.mark.parametrize("name", ["torus", "usp"])
def test_bf16_batch2_gcd_heads(name):
    """H=12 on 8 devices: P_u = gcd(8, 12) = 4, P_r = 2; bf16, batch 2, inputs pre-sharded."""
    q, k, v = _inputs(b=2, l=64, h=12, d=16, dtype=jnp.bfloat16, seed=1)
    p = sp.plan(name, heads=12, num_machines=2)
    assert (p.ulysses_degree, p.ring_degree) == (4, 2)
    q, k, v = (jax.device_put(x, p.sharding()) for x in (q, k, v))
    out = _run(p, q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = sp.reference_attention(q, k, v)
    err = np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref)
    assert err < 1e-2


def test_custom_kernel_hook_is_used():
    calls = []

    def kernel(q, kv_chunks, state, *, scale):
        calls.append((q.shape, len(kv_chunks)))
        return sp.attend(q, kv_chunks, state, scale=scale)

    q, k, v = _inputs()
    p = sp.plan("torus", heads=8, num_machines=2, ulysses_degree=4)
    out = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, kernel=kernel), compiler_options=FAST)(q, k, v)
    np.testing.assert_allclose(np.asarray(out), sp.reference_attention(q, k, v), rtol=2e-5, atol=2e-5)
    assert len(calls) == len(sp.schedule_for("torus", 2, 4, sp.AttnShape(1, 32, 8, 8, 4), 4).work()) // 8


SHAPE = sp.AttnShape(batch=2, seq_len=256, heads=8, head_dim=16, itemsize=2)


def _layouts():
    for n in MACHINES:
        for name in sp.SCHEDULES:
            for pu in ((None,) if name in ("ulysses", "ring") else (1, 2, 4, 8)):
                try:
                    yield sp.schedule_for(name, n, 8 // n, SHAPE, pu)
                except ValueError:
                    assert name == "torus"


def test_descriptions_cover_all_attention_work_evenly():
    """Each device's launches add up to its share 4 B L^2 H D / P of the attention FLOPs."""
    b, l, h, d = SHAPE.batch, SHAPE.seq_len, SHAPE.heads, SHAPE.head_dim
    for sched in _layouts():
        per_dev = {}
        for w in sched.work():
            per_dev[w.device] = per_dev.get(w.device, 0) + w.flops
        assert set(per_dev) == set(range(8)), sched.name
        assert set(per_dev.values()) == {4 * b * l * l * h * d // 8}, (sched.name, sched.layout)
        assert sched.slots["o"] == sched.slots["q"]


def test_torus_overlaps_every_inter_machine_transfer():
    """In Torus every across-machine transfer shares its step with attention (Alg. 1); in tas
    the across-machine all-to-all steps have none."""
    shape = sp.AttnShape(1, 512, 24, 64, 2)
    for n, m in ((2, 4), (4, 2), (3, 2)):
        torus = sp.schedule_for("torus", n, m, shape)
        tas = sp.schedule_for("tas", n, m, shape)
        steps_with_work = {w.step for w in torus.work()}
        inter_steps = {t.step for t in torus.transfers() if t.link == "inter"}
        assert inter_steps and inter_steps <= steps_with_work
        tas_inter = {t.step for t in tas.transfers() if t.link == "inter"}
        assert tas_inter and not tas_inter & {w.step for w in tas.work()}
        # same inter-machine bytes as the plain all-to-all
        assert sp.counted_inter_volume(torus) == sp.counted_inter_volume(tas)
        # N-1 Pull Q transfers, N-1 Pull KV transfers (k and v), N-1 Push O transfers per device
        sends = [t for t in torus.transfers() if t.link == "inter" and t.src == 0]
        assert len(sends) == 4 * (n - 1)


def test_torus_stage_order_matches_algorithm_1():
    sched = sp.schedule_for("torus", 3, 1, sp.AttnShape(1, 48, 3, 8, 2))
    labels = [s.label for s in sched.steps]
    assert labels == ["head blocks", "pull q 1/3", "pull q 2/3", "pull q 3/3", "pull kv 1/2",
                      "pull kv 2/2", "push o", "output"]
    text = sched.describe(0)
    assert "send q@1->1" in text and "send q@2->2" in text  # Q_{t,t+k} to GPU t+k
    assert "send or1->2" in text and "send or2->1" in text  # O_{t-j,t} home to t-j
