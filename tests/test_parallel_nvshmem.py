"""The NVSHMEM backend's CPU-testable parts: the local launcher, the bootstrap through
the launcher's rendezvous store (plans that agree or differ, peers that never arrive), the
arena sizing, the executor's structure, and the fallback to the XLA backend with one warning.
The GPU run (2 processes, one GPU each) is in docs/nvshmem.md."""
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import _ffi
from jax_cluster import parallel as sp
from jax_cluster.parallel import launch as ln
from jax_cluster.parallel import nvshmem, nvshmem_backend
from jax_cluster.parallel.description import Shift

# Children: CPU only, one device per process, the installed package (-P: not the source tree).
CHILD_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "CUDA_VISIBLE_DEVICES": ""}


def _run(code, n=2, timeout=60, **kw):
    return ln.launch([sys.executable, "-P", "-c", textwrap.dedent(code)], n, timeout=timeout, gpus=False,
                     env=CHILD_ENV, stream=None, **kw)


# ------------------------------------------------------------------------ launcher
def test_launch_ranks_and_prefixed_output(capsys):
    res = ln.launch([sys.executable, "-P", "-c", "import os; print('hello', os.environ['JAX_CLUSTER_RANK'], "
                                           "os.environ['JAX_CLUSTER_WORLD'], os.environ['JAX_CLUSTER_COORDINATOR'])"],
                    2, timeout=30, gpus=False, stream=sys.stdout)
    assert res.returncode == 0 and res.returncodes == [0, 0]
    coords = set()
    for r in range(2):
        word, rank, world, coord = res.text(r).split()
        assert (word, rank, world) == ("hello", str(r), "2")
        coords.add(coord)
    assert len(coords) == 1 and coords.pop().startswith("127.0.0.1:")
    out = capsys.readouterr().out
    assert "[rank 0] hello 0 2" in out and "[rank 1] hello 1 2" in out


def test_launch_first_failure_stops_the_others():
    t = time.monotonic()
    res = _run("""
        import os, sys, time
        if os.environ['JAX_CLUSTER_RANK'] == '1':
            sys.exit(3)
        time.sleep(60)
    """, timeout=60)
    assert res.returncode == 3 and res.failed_rank == 1 and not res.timed_out
    assert time.monotonic() - t < 20


def test_launch_timeout_kills_everything():
    t = time.monotonic()
    res = _run("import time; time.sleep(60)", timeout=1.0)
    assert res.timed_out and res.returncode == ln.TIMEOUT_EXIT_CODE
    assert time.monotonic() - t < 15


def test_launch_cli_propagates_exit_code():
    code = "import os, sys; print('r', os.environ['JAX_CLUSTER_RANK']); sys.exit(int(os.environ['JAX_CLUSTER_RANK']) * 5)"
    p = subprocess.run([sys.executable, "-P", "-m", "jax_cluster.parallel.launch", "-n", "2", "--gpus", "no",
                        "--timeout", "30", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 5, p.stdout + p.stderr
    assert "[rank 1] r 1" in p.stdout


def test_launch_refuses_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(ln, "count_gpus", lambda: 1)
    with pytest.raises(ValueError, match="2 processes need 2 GPUs"):
        ln.launch(["true"], 2, gpus=True, stream=None)


def test_child_env_one_gpu_each_and_no_multicast(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    e = ln.child_env(1, 2, "127.0.0.1:1", gpus=True)
    assert e["CUDA_VISIBLE_DEVICES"] == "1" and e["NVSHMEM_DISABLE_NVLS"] == "1" and e["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert ln.child_env(1, 2, "127.0.0.1:1", gpus=True)["CUDA_VISIBLE_DEVICES"] == "6"


# ----------------------------------------------------------------- bootstrap (2 processes)
_BOOT = """
    import sys
    from jax_cluster.parallel.launch import init_distributed
    rank, world = init_distributed(timeout_s=30)
    import jax, numpy as np
    from jax_cluster import parallel as sp
    from jax_cluster.parallel import nvshmem
    assert jax.process_count() == world == 2, jax.process_count()
    plan = sp.plan("ring", devices=jax.devices())
    L = 64 if (sys.argv[1] == "agree" or rank == 0) else 128
    dtype = np.float16 if (sys.argv[1] == "agree" or rank == 0) else np.float32
    try:
        st = nvshmem.init(plan, sp.AttnShape(1, L, 4, 16, np.dtype(dtype).itemsize), dtype, timeout_s=20)
        print("STATUS", st)
    except nvshmem.PlanMismatchError as e:
        print("MISMATCH", e)
    if sys.argv[1] == "agree":
        print("GATHER", nvshmem.allgather_str("t", f"v{rank}", timeout_s=20))
        # a peer that never arrives: rank 0 waits for rank 1 in an exchange rank 1 skips,
        # rank 1 waits for rank 0's unique id, which rank 0 never publishes
        try:
            if rank == 0:
                nvshmem.allgather_str("lonely", "x", timeout_s=1)
            else:
                nvshmem.broadcast_bytes("uid", None, timeout_s=1)
        except nvshmem.PeerTimeoutError as e:
            print("TIMEOUT", e)
"""


def test_bootstrap_plans_agree_and_missing_peers_time_out():
    res = ln.launch([sys.executable, "-P", "-c", textwrap.dedent(_BOOT), "agree"], 2, timeout=90, gpus=False,
                    env=CHILD_ENV, stream=None)
    out = [res.text(r) for r in range(2)]
    assert res.returncode == 0, out
    for r in range(2):
        assert "STATUS not available: " in out[r], out[r]
        assert "GATHER ['v0', 'v1']" in out[r], out[r]
    assert "TIMEOUT rank 1 (of 2, waiting on rank 0" in out[0], out[0]
    assert "TIMEOUT rank 0 (the root of uid" in out[1], out[1]


def test_bootstrap_plans_that_differ_are_named():
    res = ln.launch([sys.executable, "-P", "-c", textwrap.dedent(_BOOT), "differ"], 2, timeout=90, gpus=False,
                    env=CHILD_ENV, stream=None)
    out = [res.text(r) for r in range(2)]
    assert res.returncode == 0, out
    for r in range(2):
        line = next(x for x in out[r].splitlines() if x.startswith("MISMATCH"))
        assert "shape: rank 0=B=1 L=64 H=4 Dh=16, rank 1=B=1 L=128" in line, line
        assert "dtype: rank 0=float16, rank 1=float32" in line, line
        assert "arena_bytes" in line and "schedule:" not in line, line


def test_single_process_helpers_need_no_store():
    assert ln.init_distributed() == (0, 1)
    assert nvshmem.allgather_str("solo", "a") == ["a"]
    assert nvshmem.broadcast_bytes("solo", b"\x01") == b"\x01"


# ------------------------------------------------------------------------------ arena
@pytest.mark.parametrize("name,machines,dims", [("ring", 1, {}), ("ring", 2, {}), ("torus", 2, {"heads": 8}),
                                                ("usp", 2, {"heads": 8})])
def test_arena_holds_every_shifted_slot_once(name, machines, dims):
    shape = sp.AttnShape(2, 64, 8, 16, 2)
    sched = sp.schedule_for(name, machines, 4 // machines, shape)
    lay = nvshmem.arena_layout(sched)
    dsts = [d for _, _, op in sched.ops() if isinstance(op, Shift) and op.shift % sched.layout.size(op.axis)
            for d in op.dst]
    assert sorted(lay.regions) == sorted(dsts) and len(set(dsts)) == len(dsts)
    spans = sorted(lay.regions.values())
    for (o1, n1), (o2, _) in zip(spans, spans[1:]):
        assert o1 + n1 <= o2 and o1 % nvshmem.ALIGN == 0
    assert all(n == sched.slot_bytes(d) for d, (_, n) in lay.regions.items())
    # the signals: a fixed block before every region, the barrier's first, one per slot
    assert lay.signal_offset == 0 and lay.barrier_signal == 0
    assert sorted(lay.signals.values()) == list(range(1, len(dsts) + 1))
    assert nvshmem.SIGNAL_BLOCK >= 8 * (len(dsts) + 1) and lay.total_bytes >= nvshmem.SIGNAL_BLOCK
    if spans:
        assert spans[0][0] >= nvshmem.SIGNAL_BLOCK and lay.total_bytes >= spans[-1][0] + spans[-1][1]
    if name == "ring":  # P - 1 passes of k and v
        assert len(dsts) == 2 * (sched.layout.num_devices - 1)


# --------------------------------------------------------------- executor (structure)
@pytest.mark.parametrize("name", ["ring", "torus"])
def test_executor_puts_waits_and_one_barrier(name):
    p = sp.plan(name, heads=8, num_machines=2, devices=jax.devices()[:4])
    q = jnp.zeros((1, 64, 8, 16), jnp.bfloat16)
    sched = p.build(sp.AttnShape(1, 64, 8, 16, 2))
    arena = nvshmem.arena_layout(sched)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: nvshmem_backend.execute(sched, p.mesh, q, k, v, arena=arena,
                                                                       kernel="xla"))(q, q, q))
    assert jaxpr.count(nvshmem_backend.PUT) == jaxpr.count(nvshmem_backend.WAIT) == len(arena.regions) > 0
    assert jaxpr.count(nvshmem_backend.BARRIER) == 1
    # kernel="xla" cannot read the arena: every arrival is copied out before it is read
    assert jaxpr.count(nvshmem_backend.READ) == len(arena.regions) and nvshmem_backend.ATTEND not in jaxpr
    assert "ppermute" not in jaxpr
    # each Shift's puts are tied (optimization_barrier) to what the rest of its step reads, so
    # XLA cannot run the step's attention first; the waits come at the step's end
    shifts = [op for _, _, op in sched.ops() if isinstance(op, Shift) and op.shift % sched.layout.size(op.axis)]
    assert jaxpr.count("optimization_barrier") >= len(shifts) > 0
    first_put = jaxpr.index(nvshmem_backend.PUT)
    assert first_put < jaxpr.index("optimization_barrier", first_put) < jaxpr.index(nvshmem_backend.WAIT)


class _EmulatedPuts(nvshmem_backend.PutTransport):
    """The transport with its device primitives emulated on CPU: a put is a ppermute into a
    dict standing for the arena, a wait a token, a read the dict's value, the in-place
    attention the op on the dict's values, the barrier nothing. Counts what ran."""

    def __init__(self, arena):
        super().__init__(arena, copy_out=False)
        self.regions, self.count = {}, {"put": 0, "forward": 0, "read": 0, "in_place": 0}

    def shift(self, schedule, op, env):
        self.axes = tuple(schedule.layout.axis_names)
        super().shift(schedule, op, env)

    def _put(self, x, region, peers):
        self.count["forward" if isinstance(x, nvshmem_backend.ArenaSlot) else "put"] += 1
        src = self.regions[x.region] if isinstance(x, nvshmem_backend.ArenaSlot) else x
        self.regions[region] = jax.lax.ppermute(src, self.axes, list(enumerate(peers)))
        return jnp.zeros((1,), jnp.uint32)

    def _wait(self, token, keep, region):
        return token

    def _read(self, slot):
        self.count["read"] += 1
        return self.regions[slot.region]

    def _attention(self, qs, kvs, states, scale):
        self.count["in_place"] += 1
        val = lambda x: self.regions[x.region] if isinstance(x, nvshmem_backend.ArenaSlot) else x  # noqa: E731
        return sp.flash_attention_kernel([val(q) for q in qs], [(val(k), val(v)) for k, v in kvs], states,
                                         scale=scale)

    def _barrier(self, out):
        return out


@pytest.mark.parametrize("name,machines,devices,reads,forwards", [
    ("ring", 1, 2, 0, 0), ("ring", 1, 4, 0, 4), ("ring", 2, 4, 0, 2), ("torus", 2, 2, 1, 0), ("torus", 2, 4, 1, 0)])
def test_arrived_slots_are_read_in_place(rng, name, machines, devices, reads, forwards):
    """The transport's dataflow on CPU (device primitives emulated): arrived K/V (and Torus'
    pulled Q) go to the attention in place, the ring forwards arrived K/V from the arena, only
    what no kernel reads in place (Torus' pushed O, joined into the output) is copied out;
    the result is bitwise the XLA backend's with the same kernel."""
    p = sp.plan(name, heads=8, num_machines=machines, devices=jax.devices()[:devices])
    shape = (1, 16 * devices, 8, 64)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), p.sharding())
               for _ in range(3))
    sched = p.build(sp.AttnShape(*shape, 2))
    tr = _EmulatedPuts(nvshmem.arena_layout(sched))
    got = jax.jit(lambda q, k, v: nvshmem_backend.execute(sched, p.mesh, q, k, v, arena=tr.arena, transport=tr,
                                                          kernel="flash_attention").astype(jnp.float32))(q, k, v)
    want = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, kernel="flash_attention").astype(jnp.float32))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert tr.count["read"] == reads and tr.count["forward"] == forwards, tr.count
    assert tr.count["in_place"] > 0 and tr.count["put"] + tr.count["forward"] == len(tr.arena.regions)


def test_copy_out_knob_reads_every_arrival(monkeypatch):
    monkeypatch.setenv(nvshmem_backend.COPY_OUT_ENV, "1")
    assert nvshmem_backend.PutTransport(None).copy_out
    monkeypatch.delenv(nvshmem_backend.COPY_OUT_ENV)
    assert not nvshmem_backend.PutTransport(None).copy_out


# -------------------------------------------------------------------------- fallback
@pytest.mark.parametrize("name", ["ring", "torus"])
def test_fallback_equals_xla_backend_with_one_warning(rng, name):
    p = sp.plan(name, heads=8, num_machines=2, devices=jax.devices()[:4])
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((1, 32, 8, 16)), jnp.float32), p.sharding())
               for _ in range(3))
    st = nvshmem.availability()
    assert not st.available and st.reason
    def run(backend):  # two traces under jit
        return [np.asarray(jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, kernel="xla", backend=backend))(q, k, v))
                for _ in range(2)]

    want = run("xla")
    _ffi._warned.discard(nvshmem._FALLBACK_KEY)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = run("nvshmem")
    msgs = [str(x.message) for x in w if "nvshmem" in str(x.message).lower()]
    assert len(msgs) == 1, msgs
    assert "not available" in msgs[0] and "XLA backend" in msgs[0]
    for g, wt in zip(got, want):
        np.testing.assert_array_equal(g, wt)


def test_unknown_backend_is_an_error():
    p = sp.plan("ring", num_machines=2)
    q = jnp.zeros((1, 64, 8, 16), jnp.float32)
    with pytest.raises(ValueError, match="unknown backend"):
        sp.sp_attention(q, q, q, p, backend="mpi")


# ------------------------------------------------------------- 2 GPUs, one process each
_GPU_CHILD = """
    import sys, warnings
    from jax_cluster.parallel.launch import init_distributed
    rank, world = init_distributed(timeout_s=60)
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax_cluster import parallel as sp
    from jax_cluster.parallel import nvshmem
    name, mode = sys.argv[1], sys.argv[2]
    p = sp.plan(name, heads=8, devices=jax.devices())
    shape = (1, 1024, 8, 128)
    x = np.random.default_rng(0).standard_normal((3,) + shape).astype(np.float32)
    q, k, v = (jax.make_array_from_callback(shape, p.sharding(), lambda i, a=a: jnp.asarray(a[i], jnp.bfloat16))
               for a in x)
    if mode in ("killed", "stalled") and rank == 1:  # joins NVSHMEM, then never puts: rank 0
        import os, time                                # must end in a bounded time, not hang
        nvshmem.init(p, sp.AttnShape(*shape, 2), jnp.bfloat16)
        if mode == "stalled":  # compiles (XLA's compile waits for every process: it shares its
            # autotuning), stays alive (heartbeats go on), and only its transfers never come
            jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, backend="nvshmem")).lower(q, k, v).compile()
            time.sleep(120)
        os._exit(0)
    if mode == "arena":  # an arena sized for a smaller plan: a clear error, then grow() fixes it
        nvshmem.init(p, sp.AttnShape(1, 256, 8, 128, 2), jnp.bfloat16)
        try:
            jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, backend="nvshmem"))(q, k, v)
            raise SystemExit("no ArenaTooSmallError")
        except nvshmem.ArenaTooSmallError as e:
            print("ARENA", e, flush=True)
        nvshmem.grow(nvshmem.arena_layout(p.build(sp.AttnShape(*shape, 2))).total_bytes)
    if mode == "copy":  # every arrival copied out of the arena instead of read in place
        import os
        from jax_cluster.parallel import nvshmem_backend
        os.environ[nvshmem_backend.COPY_OUT_ENV] = "1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning here is a failure
        f = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, backend="nvshmem"))
        try:  # wait for the local shard first: a gather would wait on the peer's host
            o = multihost_utils.process_allgather(jax.block_until_ready(f(q, k, v)), tiled=True)
        except Exception as e:
            print("FAULT", nvshmem.last_fault(), "|", type(e).__name__, str(e)[:300], flush=True)
            import os
            os._exit(7)  # the CUDA context is gone and a peer is dead: no collective shutdown
    o_xla = multihost_utils.process_allgather(jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p))(q, k, v), tiled=True)
    ref = np.asarray(sp.reference_attention(*(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32) for a in x)))
    err = float(np.abs(np.asarray(o, np.float32) - ref).max() / np.abs(ref).max())
    same = bool(np.array_equal(np.asarray(o), np.asarray(o_xla)))
    print("RESULT", name, err, same)
    assert err < 2e-2, err
    assert same, "the NVSHMEM backend differs from the XLA backend (the same kernel on the same chunks)"
"""


def _skip_without_two_gpus():
    """Every test below launches two GPU processes (the launcher refuses more ranks than GPUs)."""
    if ln.count_gpus() < 2 or not nvshmem._extension()[0]:
        pytest.skip("needs 2 GPUs and the NVSHMEM module")


@pytest.mark.gpu
@pytest.mark.parametrize("name,mode", [("ring", "ok"), ("torus", "ok"), ("torus", "copy")])
def test_two_gpus_nvshmem_equals_single_device_attention(name, mode):
    """Against the reference, and bitwise against the XLA backend, with arrivals read in
    place (ok) or copied out (copy)."""
    _skip_without_two_gpus()
    res = ln.launch([sys.executable, "-P", "-c", textwrap.dedent(_GPU_CHILD), name, mode], 2, timeout=300, gpus=True,
                    env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false", nvshmem.TIMEOUT_ENV: "30"})
    out = [res.text(r) for r in range(2)]
    assert res.returncode == 0, out
    assert all(f"RESULT {name}" in o for o in out), out


@pytest.mark.gpu
def test_two_gpus_arena_too_small_is_an_error_until_grown():
    _skip_without_two_gpus()
    res = ln.launch([sys.executable, "-P", "-c", textwrap.dedent(_GPU_CHILD), "ring", "arena"], 2, timeout=300,
                    gpus=True, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false", nvshmem.TIMEOUT_ENV: "30"})
    out = [res.text(r) for r in range(2)]
    assert res.returncode == 0, out
    assert all("ARENA" in o and "grow" in o and "RESULT ring" in o for o in out), out


def _fault_run(mode):
    _skip_without_two_gpus()
    t = time.monotonic()
    res = ln.launch([sys.executable, "-P", "-c", textwrap.dedent(_GPU_CHILD), "ring", mode], 2, timeout=240, gpus=True,
                    env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false", nvshmem.TIMEOUT_ENV: "5"})
    out = [res.text(r) for r in range(2)]
    assert not res.timed_out, out
    return res, time.monotonic() - t, out


@pytest.mark.gpu
def test_two_gpus_stalled_peer_fails_within_the_timeout():
    """The peer lives but never puts: the device wait gives up after the timeout (5 s) with
    the fault record naming the slot."""
    res, seconds, out = _fault_run("stalled")
    assert res.returncode == 7 and seconds < 100, out
    assert "FAULT" in out[0] and "never arrived" in out[0], out[0]


@pytest.mark.gpu
def test_two_gpus_killed_peer_ends_the_job():
    """The peer dies after init: either the device wait's timeout (exit 7 with the fault
    record) or jax.distributed's heartbeat check (which aborts the survivor) ends rank 0,
    whichever comes first, never a hang."""
    res, seconds, out = _fault_run("killed")
    assert seconds < 200, out
    assert (res.returncode == 7 and "FAULT" in out[0]) or "unhealthy" in out[0], out
