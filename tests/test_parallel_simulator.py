"""Simulator: StreamFusion Appendix D volumes, Lemma D.1, counts from the descriptions, timing model."""
from fractions import Fraction as F

import pytest

from jax_cluster import parallel as sp

SHAPE = sp.AttnShape(batch=1, seq_len=1 << 12, heads=64, head_dim=8, itemsize=2)


def _shape(n, m, pu):
    return sp.AttnShape(batch=1, seq_len=16 * n * m, heads=2 * pu, head_dim=8, itemsize=2)


def _aligned(n, m, pu):
    pr = n * m // pu
    ok = lambda d: (d <= m and m % d == 0) or (d > m and d % m == 0)  # noqa: E731
    return (n * m) % pu == 0 and ok(pu) and ok(pr)


def test_appendix_d_equations_as_printed():
    # Eq. 4: P_r >= N -> 2 (N-1);  Eq. 6: P_u >= N -> 4 (N-1)/N   (units of BLHD/N)
    assert sp.paper_v_usp(4, 8, 8) == 6 and sp.paper_v_usp(2, 8, 2) == 2
    assert sp.paper_v_sfu(4, 8, 8) == 3 and sp.paper_v_sfu(3, 8, 24) == F(8, 3)
    # Eq. 5 (P_r <= N) and Eq. 7 (P_u <= N), N=8, M=2, P_u=4 (P_r=4)
    assert sp.paper_v_usp(8, 2, 4) == 2 * 3 * 2 + 4 * F(1, 2)  # 2(P_r-1) N/P_r + 4 (a-1)/a
    assert sp.paper_v_sfu(8, 2, 4) == 2 * 1 + 4 * F(3, 4) * 2  # 2(N/P_u-1) + 4 (P_u-1)/P_u N/P_u
    # the simplified forms printed beside Eq. 5 and Eq. 7
    for n, m, pu in [(8, 2, 4), (16, 4, 8), (12, 3, 6)]:
        pr = F(n * m, pu)
        assert sp.paper_v_usp(n, m, pu) == 2 * n + 4 - (2 * n / pr + 4 / (n / pr))
        assert sp.paper_v_sfu(n, m, pu) == (6 - F(4, pu)) * F(n, pu) - 2
    # both cases agree at their boundary P_r = N (Eq. 5's bound) and P_u = N (Eq. 7's bound)
    for n in range(2, 12):
        assert sp.paper_v_usp(n, n, n) == 2 * (n - 1)
        assert sp.paper_v_sfu(n, 2, n) == 4 * F(n - 1, n)


def test_lemma_d1_over_a_grid():
    count = 0
    for n in range(2, 33):
        for m in range(2, n + 1):
            for pu in range(m, n + 1):
                diff = sp.paper_v_usp(n, m, pu) - sp.paper_v_sfu(n, m, pu)
                assert diff == sp.lemma_f(n, m, pu)  # V_diff = f(P_u)
                assert diff >= 0, (n, m, pu)
                count += 1
            assert sp.lemma_f(n, m, m) == F(2 * n * (m - 1) * (m - 2), m * m)  # Eq. 10
            assert sp.lemma_f(n, m, n) == 2 * n + F(4, n) - (F(2 * n, m) + F(4 * m, n))  # Eq. 11
    assert count > 5000


def test_counted_volumes_equal_appendix_d_where_it_describes_the_schedules():
    checked = 0
    for n in range(1, 9):
        for m in (1, 2, 4, 8):
            for pu in range(1, n * m + 1):
                if not _aligned(n, m, pu):
                    continue
                shape = _shape(n, m, pu)
                usp = sp.counted_inter_volume(sp.schedule_for("usp", n, m, shape, pu))
                tas = sp.counted_inter_volume(sp.schedule_for("tas", n, m, shape, pu))
                assert usp == sp.physical_v_usp(n, m, pu)
                assert tas == sp.physical_v_sfu(n, m, pu)
                if pu <= m or pu == n * m:  # one layer of Ulysses/Ring across machines
                    assert usp == sp.paper_v_usp(n, m, pu), (n, m, pu)
                if n * m // pu <= m or pu == 1:
                    assert tas == sp.paper_v_sfu(n, m, pu), (n, m, pu)
                    if n * m // pu <= m:
                        torus = sp.schedule_for("torus", n, m, shape, pu)
                        assert sp.counted_inter_volume(torus) == sp.paper_v_sfu(n, m, pu)
                checked += 1
    assert checked > 50


def test_mixed_regime_differs_from_eq5_eq7_but_lemma_holds():
    # N=4, M=2, P_u=4, P_r=2: USP's ring crosses machines with KV of H/P_u heads, not all H
    assert sp.counted_inter_volume(sp.schedule_for("usp", 4, 2, SHAPE, 4)) == 4
    assert sp.paper_v_usp(4, 2, 4) == 6
    for n in range(2, 33):
        for m in range(2, n + 1):
            for pu in range(m, n + 1):
                if _aligned(n, m, pu):
                    assert sp.physical_v_usp(n, m, pu) >= sp.physical_v_sfu(n, m, pu)


def test_per_gpu_and_ring_volumes():
    # ring over N machines x M GPUs: each GPU sends its KV (2 BLHD/P) across machines N-1 times
    n, m = 4, 8
    ring = sp.schedule_for("ring", n, m, SHAPE)
    assert sp.counted_inter_volume(ring, per="gpu") == F(2 * (n - 1), m)
    assert sp.counted_inter_volume(ring) == 2 * (n - 1)


def test_simulator_overlap_and_limits():
    common = dict(seq_len=32768, heads=24, head_dim=128)
    free = sp.Links(intra_bw=1e18, inter_bw=1e18, intra_latency=0.0, inter_latency=0.0)
    fast = sp.simulate(4, 8, **common, links=free, kernel=sp.KernelModel(400, 0.0))
    for name, r in fast.items():
        if isinstance(r, str):
            assert name == "ulysses"  # 24 heads on 32 GPUs
            continue
        assert r.latency_s == pytest.approx(r.compute_s, rel=1e-6)  # free links: compute only
    total_flops = 4 * 32768**2 * 24 * 128
    assert fast["tas"].compute_s == pytest.approx(total_flops / 32 / 400e12)
    ov = sp.simulate(4, 8, **common)
    no = sp.simulate(4, 8, **common, overlap=False)
    for name in ("ring", "usp", "tas", "torus"):
        assert ov[name].latency_s <= no[name].latency_s * (1 + 1e-9)
        assert ov[name].latency_s >= ov[name].compute_s
    # Torus hides part of tas's all-to-all; tas beats usp's ring across 4 machines
    assert ov["torus"].latency_s < ov["tas"].latency_s < ov["usp"].latency_s
    assert ov["tas"].inter_bytes < ov["usp"].inter_bytes


def test_kernel_model_fit_and_callable():
    km = sp.KernelModel.fit([(1e12, 10e-6 + 1e12 / 500e12), (4e12, 10e-6 + 4e12 / 500e12)])
    assert km.tflops == pytest.approx(500) and km.launch_s == pytest.approx(10e-6)
    r = sp.simulate(2, 2, 4096, 8, 64, kernel=lambda b, lq, lk, h, d, s: 1e-3, schedules=("ring",))
    assert r["ring"].compute_s == pytest.approx(4e-3)  # P_r = 4 ring steps of 1 ms
    assert "divisible" in sp.simulate(2, 2, 4095, 8, 64, schedules=("tas",))["tas"]


def test_fit_link_recovers_latency_and_bandwidth():
    samples = [(mb << 20, 30e-6 + (mb << 20) / 300e9) for mb in (16, 64, 256)]
    lat, bw = sp.fit_link(samples)
    assert lat == pytest.approx(30e-6) and bw == pytest.approx(300e9)
    # a negative intercept is clipped: the fit goes through the origin
    lat, bw = sp.fit_link([(1e6, 1e-6), (4e6, 5e-6)])
    assert lat == 0.0 and bw > 0
    with pytest.raises(ValueError, match="two sizes"):
        sp.fit_link([(1e6, 1e-5)])


def test_transport_copy_out_runs_on_the_compute_stream():
    shape = sp.AttnShape(batch=1, seq_len=8192, heads=8, head_dim=64, itemsize=2)
    km = sp.KernelModel(400, 0.0)
    links = sp.Links(intra_bw=1e18, inter_bw=1e18, intra_latency=0.0, inter_latency=0.0)
    for name in ("ring", "torus"):
        sched = sp.schedule_for(name, 2, 1, shape)
        base = sp.simulate_schedule(sched, km, links)
        assert sp.simulate_schedule(sched, km, links, transport=sp.Transport()).latency_s == base.latency_s
        copy = sp.Transport(copy_bw=1e9, per_slot_s=5e-6, per_call_s=7e-6)
        slow = sp.simulate_schedule(sched, km, links, transport=copy)
        # free links: every received slot's copy-out and the barrier are on the critical path
        received = [t for t in sched.transfers() if t.dst == 0]
        want = sum(t.bytes / 1e9 + 5e-6 for t in received) + 7e-6
        assert slow.latency_s == pytest.approx(base.latency_s + want, rel=1e-6), name


def test_transport_in_place_pays_only_the_waits_of_what_the_attention_reads():
    shape = sp.AttnShape(batch=1, seq_len=8192, heads=8, head_dim=64, itemsize=2)
    km = sp.KernelModel(400, 0.0)
    links = sp.Links(intra_bw=1e18, inter_bw=1e18, intra_latency=0.0, inter_latency=0.0)
    base = sp.simulate_schedule(sp.schedule_for("ring", 2, 1, shape), km, links)
    ring = sp.simulate_schedule(sp.schedule_for("ring", 2, 1, shape), km, links,
                                transport=sp.Transport(copy_bw=1e9, in_place=True, per_slot_s=5e-6))
    assert ring.latency_s == pytest.approx(base.latency_s + 2 * 5e-6, rel=1e-6)  # k and v: their waits
    # torus: the pushed O is joined into the output, a read no kernel does in place: copied
    sched = sp.schedule_for("torus", 2, 1, shape)
    base = sp.simulate_schedule(sched, km, links)
    torus = sp.simulate_schedule(sched, km, links, transport=sp.Transport(copy_bw=1e9, in_place=True))
    pushed = sum(t.bytes for t in sched.transfers() if t.dst == 0 and t.slot.startswith("or"))
    assert pushed > 0 and torus.latency_s == pytest.approx(base.latency_s + pushed / 1e9, rel=1e-6)


def test_nvshmem_benchmark_fits_the_committed_sweep():
    """sp_attention_nvshmem.py --predict on the committed H200 table: every predicted row is
    there, the 2 x 1 rows carry their measurements, the NVSHMEM transport costs time on 2 x 1."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_nvshmem_bench", root / "benchmarks" / "sp_attention_nvshmem.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows, fits = bench.predict(root / "benchmarks" / "results" / "sp_attention_nvshmem_h200.json", [4, 8])
    assert set(fits) == {"xla_link", "copy", "nvshmem_put"} and all(bw > 0 for _, bw in fits.values())
    cases = {r["case"]: r for r in rows}
    for grid in ("2x1", "4x8", "8x8"):
        for backend in ("xla", "nvshmem"):
            assert "predicted_us" in cases[f"cogvideox l16384 {grid} torus {backend}"]
    two = {r["case"]: r for r in rows if r["machines"] == 2 and r["backend"] != "xla"}
    copied = [r for r in two.values() if r["backend"] == "nvshmem-copy"]
    assert copied and all(r["nvshmem_over_xla_time"] > 1.0 for r in copied)  # the copy-out costs time
    for r in copied:  # reading in place saves it
        assert two[r["case"].removesuffix("-copy")]["predicted_us"] < r["predicted_us"]
    assert any(r.get("measured_us", 0) > 0 for r in two.values())
