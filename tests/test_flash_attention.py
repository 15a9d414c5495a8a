"""flash_attention vs the jnp reference: CPU handler always, CUDA kernel on a GPU.

Every query chunk attends to every KV chunk and folds into its incoming (o, lse) state."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import parallel as sp
from jax_cluster import reference
from jax_cluster.ops import flash_attention as fa
from jax_cluster import _ffi
from jax_cluster.ops import attention_state as la
from jax_cluster.parallel import local_attention as sp_la
from jax_cluster.testing import TOLERANCE, on_cpu, rel_l2

ref_flash = on_cpu(reference.flash_attention)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _arr(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def make_chunks(rng, q_lens, kv_lens, *, batch=2, heads=3, dh=16, dtype="float32", state_lens=None,
                q_scale=1.0):
    """Query chunks, KV chunks and (where state_lens[i] is not None) an incoming state of chunk
    i built by the reference over its own random KV of that length (0: an all-empty state)."""
    qs = [_arr(rng, (batch, n, heads, dh), dtype, q_scale) for n in q_lens]
    kvs = [(_arr(rng, (batch, n, heads, dh), dtype), _arr(rng, (batch, n, heads, dh), dtype))
           for n in kv_lens]
    states = None
    if state_lens is not None:
        states = []
        for q, n in zip(qs, state_lens):
            if n is None:
                states.append(None)
                continue
            kv = [(_arr(rng, (batch, n, heads, dh), dtype), _arr(rng, (batch, n, heads, dh), dtype))]
            states.append(la.State(*ref_flash([q], kv)[0]))
    return qs, kvs, states


def check_state(out, ref, dtype, lse_atol=None):
    """o within the dtype's relative L2 tolerance; lse -inf exactly where the reference has
    it, elsewhere close; never NaN."""
    tol = TOLERANCE[jnp.dtype(dtype).name]
    o, lse = np.asarray(out[0], np.float64), np.asarray(out[1], np.float64)
    ro, rlse = np.asarray(ref[0], np.float64), np.asarray(ref[1], np.float64)
    assert o.shape == ro.shape and lse.shape == rlse.shape
    assert out[0].dtype == jnp.float32 and out[1].dtype == jnp.float32
    if o.size:
        assert rel_l2(o, ro) <= tol if np.linalg.norm(ro) > 0 else np.all(o == 0), rel_l2(o, ro)
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    atol = lse_atol if lse_atol is not None else (1e-5 if tol < 1e-4 else 2e-3)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=0, atol=atol + 1e-6 * np.abs(rlse[fin]).max(initial=0))


def check_all(outs, refs, dtype, **kw):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        check_state(out, ref, dtype, **kw)


def run(qs, kvs, states=None, device=None, **kw):
    """The op under jit on `device` (default: the first CPU device)."""
    device = device or jax.devices("cpu")[0]
    qs, kvs, states = jax.device_put((qs, kvs, states), device)
    return jax.jit(lambda q, kv, st: jc.flash_attention(q, kv, st, **kw))(qs, kvs, states)


# ---------------------------------------------------------------- CPU handler
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dh", [16, 40, 64, 128])
def test_cpu_one_chunk_matches_reference(rng, dtype, dh):
    qs, kvs, _ = make_chunks(rng, [13], [29], dh=dh, dtype=dtype)
    out = run(qs, kvs)
    check_all(out, ref_flash(qs, kvs), dtype)
    # and the independent dense attention of jax_cluster.parallel
    fin = run(qs, kvs, finalize=True)[0]
    assert fin.dtype == jnp.dtype(dtype)
    assert rel_l2(fin, sp.reference_attention(qs[0], *kvs[0])) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_chunks_of_different_lengths_and_empty_chunks(rng, dtype):
    """Lengths that are not multiples of the kernel tiles (128 queries, 64 keys), empty query
    and key chunks, states on some chunks (one all-empty), batch 2."""
    qs, kvs, states = make_chunks(rng, [5, 0, 130, 1, 64], [0, 67, 3, 0, 64, 1], dtype=dtype,
                                  state_lens=[9, None, 70, 0, None])
    out = run(qs, kvs, states)
    check_all(out, ref_flash(qs, kvs, states), dtype)
    assert out[1].o.shape == (2, 0, 3, 16) and out[1].lse.shape == (2, 3, 0)


def test_cpu_merge_of_many_partial_states_equals_one_shot(rng):
    """Folding the KV in many calls (uneven pieces, some empty, several per call) gives the
    one-shot attention; so does merging states computed separately."""
    qs, _, _ = make_chunks(rng, [37, 11], [])
    k = _arr(rng, (2, 200, 3, 16), jnp.float32)
    v = _arr(rng, (2, 200, 3, 16), jnp.float32)
    cuts = [0, 1, 1, 30, 64, 65, 127, 128, 128, 199, 200]
    pieces = [(k[:, a:b], v[:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    states = None
    for i in range(0, len(pieces), 3):  # three pieces per call
        states = run(qs, pieces[i:i + 3], states)
    one_shot = run(qs, [(k, v)])
    check_all(states, one_shot, "float32")
    for q, st in zip(qs, states):
        assert rel_l2(la.finalize(st), sp.reference_attention(q, k, v)) < 1e-5
    # merging independently computed states (la.merge) agrees as well
    parts = [run(qs[:1], [p])[0] for p in pieces]
    merged = parts[0]
    for p in parts[1:]:
        merged = la.merge(merged, p)
    check_state(merged, one_shot[0], "float32")


def test_cpu_no_keys_passes_state_through(rng):
    qs, kvs, states = make_chunks(rng, [6, 4], [0, 0], state_lens=[5, None])
    out = run(qs, kvs, states)
    np.testing.assert_allclose(out[0].o, states[0].o, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out[0].lse, states[0].lse, rtol=1e-6)
    assert np.all(out[1].o == 0) and np.all(np.isneginf(out[1].lse))
    fin = run(qs, [], states, finalize=True)  # no kv chunks at all
    assert np.all(np.asarray(fin[1]) == 0)
    assert rel_l2(fin[0], la.finalize(states[0])) < 1e-6


def test_cpu_empty_rows_of_a_state_are_ignored(rng):
    """lse = -inf marks a row with nothing seen; its o (here NaN) must not leak."""
    qs, kvs, states = make_chunks(rng, [8], [12], state_lens=[5])
    o, lse = states[0]
    lse = lse.at[:, 1, 2:5].set(-jnp.inf)
    o = o.at[:, 2:5, 1].set(jnp.nan)
    out = run(qs, kvs, [la.State(o, lse)])
    ref = ref_flash(qs, kvs, [la.State(jnp.nan_to_num(o), lse)])
    check_all(out, ref, "float32")


def test_cpu_huge_logits_stable(rng):
    qs, kvs, states = make_chunks(rng, [9], [5, 7], q_scale=300.0, state_lens=[4])
    out = run(qs, kvs, states)
    check_all(out, ref_flash(qs, kvs, states), "float32", lse_atol=1e-3)


def test_cpu_finalize_and_custom_scale(rng):
    qs, kvs, states = make_chunks(rng, [10, 3], [7, 9], dtype="bfloat16", state_lens=[None, 6])
    fin = run(qs, kvs, states, scale=0.3, finalize=True)
    ref = ref_flash(qs, kvs, states, scale=0.3, finalize=True)
    for a, r in zip(fin, ref):
        assert a.dtype == jnp.bfloat16 and rel_l2(a, r) <= 1e-2
    st = run(qs, kvs, states, scale=0.3)
    check_all(st, ref_flash(qs, kvs, states, scale=0.3), "bfloat16")


def test_single_array_api_and_impls_agree(rng):
    (q,), kvs, (st,) = make_chunks(rng, [21], [8, 0, 15], state_lens=[3])
    out = jc.flash_attention(q, kvs, st)
    assert isinstance(out, la.State)
    for impl in ("cuda", "xla", "reference"):
        check_state(jc.flash_attention(q, kvs, st, impl=impl), out, "float32")
    assert jc.flash_attention(q, kvs, st, finalize=True).shape == q.shape


def test_more_chunks_than_one_launch_takes(rng):
    q_lens = [int(n) for n in rng.integers(0, 4, size=fa.MAX_Q_CHUNKS + 3)]
    kv_lens = [int(n) for n in rng.integers(0, 3, size=fa.MAX_KV_CHUNKS + 5)]
    qs, kvs, _ = make_chunks(rng, q_lens, kv_lens, batch=1, heads=2, dh=8)
    states = [None] * len(qs)
    states[1] = la.State(*ref_flash([qs[1]], [kvs[0]])[0])
    out = run(qs, kvs, states)
    check_all(out, ref_flash(qs, kvs, states), "float32")
    fin = run(qs, kvs, states, finalize=True)
    for a, r in zip(fin, ref_flash(qs, kvs, states, finalize=True)):
        assert a.shape == r.shape and (a.size == 0 or rel_l2(a, r) < 1e-5)


def test_vmap_folds_into_the_batch(rng):
    qs, kvs, states = make_chunks(rng, [7, 5], [6, 9], batch=2, state_lens=[3, None])
    factors = jnp.asarray([1.0, 0.5, -1.0])
    stack = lambda x: factors.reshape((3,) + (1,) * x.ndim) * x  # noqa: E731
    vq = [stack(q) for q in qs]
    vk = [stack(k) for k, _ in kvs]  # v is not mapped: broadcast by the rule
    vst = la.State(stack(states[0].o), stack(states[0].lse))

    def f(qs_, ks_, st_):
        return jc.flash_attention(qs_, [(k, v) for k, (_, v) in zip(ks_, kvs)], [st_, None])

    out = jax.vmap(f)(vq, vk, vst)
    for i, c in enumerate((1.0, 0.5, -1.0)):
        ref = ref_flash([q * c for q in qs], [(k * c, v) for k, v in kvs],
                                        [la.State(states[0].o * c, states[0].lse * c), None])
        check_all([la.State(o.o[i], o.lse[i]) for o in out], ref, "float32")


def test_parallel_kernel_hook(rng):
    """Registered in jax_cluster.parallel as "flash_attention" (and the default); the hook's
    signature."""
    assert sp.get_kernel("flash_attention") is sp_la.flash_attention_kernel
    assert sp.get_kernel(None) is sp_la.flash_attention_kernel
    (q,), (kv,), _ = make_chunks(rng, [19], [23])
    out = sp.attention(q, *kv, kernel="flash_attention")
    assert rel_l2(out, sp.reference_attention(q, *kv)) < 1e-5
    st = sp.get_kernel("flash_attention")(q, [kv, kv], None, scale=0.25)
    check_state(st, fa.attend(q, [kv, kv], None, scale=0.25), "float32")


@pytest.mark.parametrize("name,machines,pu", [("torus", 2, 4), ("ring", 1, None), ("usp", 2, 2)])
def test_schedules_on_fake_devices_with_the_op(name, machines, pu):
    """The schedules of jax_cluster.parallel on 8 fake CPU devices with this op as the local
    kernel (Torus hands it several query chunks per call, as a list: one launch)."""
    ks = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(x, (1, 64, 8, 16), jnp.float32) for x in ks)
    p = sp.plan(name, heads=8, num_machines=machines, ulysses_degree=pu)
    out = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, kernel="flash_attention"),
                  compiler_options=FAST)(q, k, v)
    np.testing.assert_allclose(np.asarray(out), sp.reference_attention(q, k, v), rtol=2e-5, atol=2e-5)


def _bad_cases():
    f32, f16 = jnp.float32, jnp.float16
    q = jnp.ones((2, 4, 3, 8), f32)
    kv = (jnp.ones((2, 5, 3, 8), f32), jnp.ones((2, 5, 3, 8), f32))
    st = la.empty_state(2, 4, 3, 8)
    return [
        (lambda: jc.flash_attention(jnp.ones((4, 3, 8)), [kv]), "q must be [B, Lq, H, Dh]"),
        (lambda: jc.flash_attention([], [kv]), "non-empty sequence"),
        (lambda: jc.flash_attention(q.astype(jnp.int32), [kv]), "dtype must be float16"),
        (lambda: jc.flash_attention([q, q.astype(f16)], [kv]), r"q[1] has dtype float16"),
        (lambda: jc.flash_attention([q, jnp.ones((2, 4, 2, 8))], [kv]), r"q[1] has shape (2, 4, 2, 8)"),
        (lambda: jc.flash_attention(q, [(kv[0][..., :4], kv[1])]), r"kv_chunks[0] k has shape (2, 5, 3, 4)"),
        (lambda: jc.flash_attention(q, [kv, (kv[0], kv[1][:1])]), r"kv_chunks[1] v has shape (1, 5, 3, 8)"),
        (lambda: jc.flash_attention(q, [(kv[0], kv[1][:, :3])]), r"kv_chunks[0]: k has 5 keys but v has 3"),
        (lambda: jc.flash_attention(q, [(kv[0].astype(f16), kv[1])]), r"kv_chunks[0] k has dtype float16"),
        (lambda: jc.flash_attention(q, [kv[0]]), r"kv_chunks[0] must be a pair"),
        (lambda: jc.flash_attention(q, [kv], la.State(st.o[:, :3], st.lse)), r"state.o has shape (2, 3, 3, 8)"),
        (lambda: jc.flash_attention(q, [kv], la.State(st.o, st.lse[..., :2])), r"state.lse has shape (2, 3, 2)"),
        (lambda: jc.flash_attention([q, q], [kv], [st]), "state has 1 entries for 2 query chunks"),
        (lambda: jc.flash_attention([q], [kv], [st.o]), r"state[0] must be State(o, lse)"),
        (lambda: jc.flash_attention(q, [kv], la.State(st.o.astype(jnp.int32), st.lse)), "state.o must be floating"),
        (lambda: jc.flash_attention(q, [kv], scale=float("nan")), "scale must be a finite"),
        (lambda: jc.flash_attention(q, [kv], scale=jnp.float32(0.5) * jnp.ones(())), "scale must be a finite"),
        (lambda: jc.flash_attention(q, [kv], impl="fast"), "impl must be one of"),
        (lambda: jc.flash_attention(q, [kv], config=jc.FlashAttentionConfig(kernel="fast")),
         "kernel must be one of"),
        (lambda: jc.flash_attention(q, [kv], config="mma"), "config must be a FlashAttentionConfig"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_rejected_with_a_clear_message(case):
    fn, message = _bad_cases()[case]
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        fn()


def test_ffi_validation_errors():
    """The C++ decoder rejects malformed calls (last line of defence behind the wrapper)."""
    q = jnp.ones((1, 4, 2, 8), jnp.float16)
    k = jnp.ones((1, 5, 2, 8), jnp.float16)
    good = dict(num_q=1, num_kv=1, state_mask=0, scale=np.float32(0.3), finalize=False, kernel=0)
    cases = [
        ((q, k, k), {"num_q": 33}, "num_q must be in 1..32"),
        ((q, k, k), {"num_kv": 33}, "num_kv must be in 0..32"),
        ((q, k, k), {"state_mask": 2}, "state_mask has bits beyond num_q"),
        ((q, k, k), {"state_mask": 1}, "expected 5 operands"),
        ((q, k, k[..., :4]), {}, "v[0] must be [B=1, L, H=2, Dh=8]"),
        ((q, k, k[:, :3]), {}, "k[0] and v[0] lengths differ"),
        ((q, k, k.astype(jnp.bfloat16)), {}, "v[0] must be"),
        ((q, k, k, q, jnp.zeros((1, 2, 4), jnp.float32)), {"state_mask": 1}, "state o[0] must be float32"),
        ((q, k, k, q.astype(jnp.float32), jnp.zeros((1, 2, 3), jnp.float32)), {"state_mask": 1},
         "state lse[0] must be float32 [B, H, Lq]"),
        ((q, k, k), {"scale": np.float32(np.inf)}, "scale must be finite"),
        ((q, k, k), {"kernel": 3}, "kernel must be in 0..2"),
    ]
    for operands, change, message in cases:
        with pytest.raises(Exception, match=re.escape(message)):
            jax.jit(lambda *a: fa._PRIM.bind(*a, **{**good, **change})[0])(*operands).block_until_ready()


# ---------------------------------------------------------------- GPU
def _gpu():
    return jax.devices("gpu")[0]


GPU_CASES = [  # q chunk lengths, kv chunk lengths, incoming state lengths (None: none)
    ([1], [1], None),
    ([128], [64], None),                             # exact tiles
    ([17, 0, 300], [0, 64, 129, 5], [4, None, 70]),  # ragged, empty chunks, states
    ([257, 127], [63, 65, 1], [None, 0]),            # an all-empty state
    ([64, 64, 64, 64], [100, 100, 100, 100], None),  # 4 Q x 4 KV
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dh", [64, 128])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_vs_reference(rng, dtype, dh, case):
    q_lens, kv_lens, state_lens = GPU_CASES[case]
    qs, kvs, states = make_chunks(rng, q_lens, kv_lens, batch=2, heads=3, dh=dh, dtype=dtype,
                                  state_lens=state_lens)
    out = run(qs, kvs, states, _gpu(), impl="cuda")
    check_all(out, ref_flash(qs, kvs, states), dtype)
    fin = run(qs, kvs, states, _gpu(), impl="cuda", finalize=True)
    for a, r in zip(fin, ref_flash(qs, kvs, states, finalize=True)):
        assert a.dtype == jnp.dtype(dtype) and a.shape == r.shape
        assert a.size == 0 or rel_l2(a, r) <= TOLERANCE[dtype], rel_l2(a, r)


@pytest.mark.gpu
@pytest.mark.parametrize("model,heads,dh,length", [("flux", 24, 128, 4608), ("cogvideox", 30, 64, 4776)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_dit_shapes(rng, model, heads, dh, length, dtype):
    """Flux (24 x 128) and CogVideoX (30 x 64) at a moderate length, one chunk and the
    4 Q x 4 KV chunked call (uneven split) against the reference."""
    del model
    (q,), (kv,), _ = make_chunks(rng, [length], [length], batch=1, heads=heads, dh=dh, dtype=dtype)
    ref = ref_flash([q], [kv])
    check_all(run([q], [kv], None, _gpu(), impl="cuda"), ref, dtype)
    cuts = [0, 1000, 2304, 3333, length]
    qs = [q[:, a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    kvs = [(kv[0][:, a:b], kv[1][:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    out = run(qs, kvs, None, _gpu(), impl="cuda")
    o = jnp.concatenate([s.o for s in out], 1)
    lse = jnp.concatenate([s.lse for s in out], 2)
    check_state((o, lse), ref[0], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_merge_of_many_partial_states(rng, dtype):
    qs, _, _ = make_chunks(rng, [200, 77], [], dh=128, dtype=dtype)
    k, v = _arr(rng, (2, 1000, 3, 128), dtype), _arr(rng, (2, 1000, 3, 128), dtype)
    cuts = [0, 1, 64, 65, 300, 300, 511, 777, 1000]
    pieces = [(k[:, a:b], v[:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    states = None
    for i in range(0, len(pieces), 2):
        states = run(qs, pieces[i:i + 2], states, _gpu(), impl="cuda")
    check_all(states, ref_flash(qs, [(k, v)]), dtype)


@pytest.mark.gpu
def test_gpu_matches_cpu_handler(rng):
    qs, kvs, states = make_chunks(rng, [130, 7], [65, 0, 200], dh=64, dtype="bfloat16",
                                  state_lens=[33, None])
    gpu = run(qs, kvs, states, _gpu(), impl="cuda")
    cpu = run(qs, kvs, states)
    check_all(gpu, cpu, "bfloat16")


@pytest.mark.gpu
def test_gpu_empty_rows_huge_logits_and_no_keys(rng):
    qs, kvs, states = make_chunks(rng, [150], [70, 3], dh=128, dtype="float16", q_scale=30.0,
                                  state_lens=[40])
    o, lse = states[0]
    lse = lse.at[:, 0, 5:9].set(-jnp.inf)
    o = o.at[:, 5:9, 0].set(jnp.nan)
    st = [la.State(o, lse)]
    out = run(qs, kvs, st, _gpu(), impl="cuda")
    ref = ref_flash(qs, kvs, [la.State(jnp.nan_to_num(o), lse)])
    check_all(out, ref, "float16", lse_atol=2e-2)
    same = run(qs, [(k[:, :0], v[:, :0]) for k, v in kvs], st, _gpu(), impl="cuda")
    np.testing.assert_array_equal(np.isneginf(same[0].lse), np.isneginf(lse))
    fin = np.isfinite(np.asarray(lse))
    np.testing.assert_allclose(np.asarray(same[0].lse)[fin], np.asarray(lse)[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_deterministic(rng):
    qs, kvs, states = make_chunks(rng, [300, 41], [129, 200], dh=128, dtype="bfloat16",
                                  state_lens=[10, None])
    args = jax.device_put((qs, kvs, states), _gpu())
    f = jax.jit(lambda q, kv, st: jc.flash_attention(q, kv, st, impl="cuda"))
    first = jax.tree.map(np.asarray, f(*args))
    for _ in range(10):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, f(*args)), first)


@pytest.mark.gpu
def test_gpu_vmap(rng):
    qs, kvs, _ = make_chunks(rng, [70], [90], dh=64, dtype="float16")
    vq = jnp.stack([qs[0], -qs[0]])
    out = jax.jit(jax.vmap(lambda q: jc.flash_attention(q, kvs, impl="cuda")))(jax.device_put(vq, _gpu()))
    for i in range(2):
        ref = ref_flash([vq[i]], kvs)[0]
        check_state(la.State(out.o[i], out.lse[i]), ref, "float16")


@pytest.mark.gpu
def test_gpu_unsupported_falls_back_with_one_warning(rng):
    _ffi._warned.clear()
    qs, kvs, states = make_chunks(rng, [33], [40], dh=96, dtype="bfloat16", state_lens=[5])
    with pytest.warns(UserWarning, match="no CUDA kernel for head_dim=96"):
        out = run(qs, kvs, states, _gpu())
    check_all(out, ref_flash(qs, kvs, states), "bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(qs, kvs, states, _gpu())  # warned once only
    with pytest.raises(ValueError, match="no CUDA kernel"):
        run(qs, kvs, states, _gpu(), impl="cuda")
    q32, kv32, _ = make_chunks(rng, [9], [9], dh=64, dtype="float32")
    with pytest.warns(UserWarning, match="dtype=float32"):
        run(q32, kv32, None, _gpu())


@pytest.mark.gpu
def test_gpu_hook_single_device_and_two_gpu_torus(rng):
    (q,), (kv,), _ = make_chunks(rng, [1000], [1000], batch=1, heads=8, dh=128, dtype="bfloat16")
    q, k, v = jax.device_put((q, *kv), _gpu())
    out = jax.jit(lambda q, k, v: sp.attention(q, k, v, kernel="flash_attention"))(q, k, v)
    assert rel_l2(out, sp.reference_attention(q, k, v)) < 1e-2
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        return
    p = sp.plan("torus", heads=8, devices=gpus[:2], num_machines=2)
    qs, ks, vs = (jax.device_put(x, p.sharding()) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, p, kernel="flash_attention"))(qs, ks, vs)
    assert rel_l2(jax.device_put(out, gpus[0]), sp.reference_attention(q, k, v)) < 1e-2


# ---------------------------------------------------------------- GPU: the two CUDA kernels
@pytest.mark.gpu
@pytest.mark.parametrize("cuda_kernel", ["wgmma", "mma"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dh", [64, 128])
def test_gpu_each_kernel_vs_reference(rng, cuda_kernel, dtype, dh):
    """Every CUDA kernel on ragged chunks (tile remainders of both the 128-row query tiles and
    the 128-key tiles, empty chunks, a KV sequence of several tiles and ring passes, states)."""
    qs, kvs, states = make_chunks(rng, [1, 129, 0, 300], [257, 0, 1, 700, 128], batch=2, heads=3,
                                  dh=dh, dtype=dtype, state_lens=[None, 9, None, 0])
    config = jc.FlashAttentionConfig(kernel=cuda_kernel)
    out = run(qs, kvs, states, _gpu(), impl="cuda", config=config)
    check_all(out, ref_flash(qs, kvs, states), dtype)
    fin = run(qs, kvs, states, _gpu(), impl="cuda", config=config, finalize=True)
    for a, r in zip(fin, ref_flash(qs, kvs, states, finalize=True)):
        assert a.dtype == jnp.dtype(dtype) and a.shape == r.shape
        assert a.size == 0 or rel_l2(a, r) <= TOLERANCE[dtype], rel_l2(a, r)


def check_many_chunks(rng, nq, nkv, dh, device, **kw):
    """nq query x nkv KV chunks (ragged, some empty, random states on every third query chunk,
    some of their rows empty) against ONE reference call on the concatenated problem (a
    reference per chunk would take minutes)."""
    b, h = 1, 2
    q_lens = [int(n) for n in rng.integers(0, 150, size=nq)]
    kv_lens = [int(n) for n in rng.integers(0, 150, size=nkv)]
    q_lens[0], kv_lens[-1] = 0, 0
    qs, kvs, _ = make_chunks(rng, q_lens, kv_lens, batch=b, heads=h, dh=dh, dtype="bfloat16")
    states, full = [], []
    for i, n in enumerate(q_lens):
        st = la.empty_state(b, n, h, dh)
        if i % 3 == 0:
            lse = _arr(rng, (b, h, n), "float32") + 2.0
            lse = lse.at[:, 0, : n // 4].set(-jnp.inf)
            st = la.State(_arr(rng, (b, n, h, dh), "float32"), lse)
            states.append(st)
        else:
            states.append(None)
        full.append(st)
    cat = lambda xs, axis=1: jnp.concatenate(list(xs), axis)  # noqa: E731
    ref = ref_flash([cat(qs)], [(cat(k for k, _ in kvs), cat(v for _, v in kvs))],
                    [la.State(cat(s.o for s in full), cat((s.lse for s in full), 2))])[0]
    out = run(qs, kvs, states, device, impl="cuda", **kw)
    check_state((cat(s.o for s in out), cat((s.lse for s in out), 2)), ref, "bfloat16")


def test_cpu_many_chunks_against_one_concatenated_reference(rng):
    check_many_chunks(rng, 5, 4, 16, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dh", [64, 128])
def test_gpu_chunk_limit_of_one_launch(rng, dh):
    """32 query x 32 KV chunks: every chunk's tensor maps in one parameter struct (one launch
    of the wgmma kernel); past that the wrapper concatenates (35 x 37 chunks)."""
    wgmma = jc.FlashAttentionConfig(kernel="wgmma")
    check_many_chunks(rng, fa.MAX_Q_CHUNKS, fa.MAX_KV_CHUNKS, dh, _gpu(), config=wgmma)
    check_many_chunks(rng, fa.MAX_Q_CHUNKS + 3, fa.MAX_KV_CHUNKS + 5, dh, _gpu(), config=wgmma)


@pytest.mark.gpu
def test_gpu_kernels_agree_and_negative_scale(rng):
    """The wgmma and mma.sync kernels compute the same function; a negative scale (which the
    wgmma kernel does not serve) runs the mma.sync kernel under auto, and is refused by the
    wgmma one with a clear message."""
    qs, kvs, states = make_chunks(rng, [200, 33], [150, 77], dh=128, dtype="float16",
                                  state_lens=[12, None])
    a = run(qs, kvs, states, _gpu(), impl="cuda", config=jc.FlashAttentionConfig(kernel="wgmma"))
    b = run(qs, kvs, states, _gpu(), impl="cuda", config=jc.FlashAttentionConfig(kernel="mma"))
    check_all(a, b, "float16")
    neg = run(qs, kvs, states, _gpu(), impl="cuda", scale=-0.1)
    check_all(neg, ref_flash(qs, kvs, states, scale=-0.1), "float16")
    with pytest.raises(Exception, match="wgmma kernel does not serve"):
        jax.block_until_ready(run(qs, kvs, states, _gpu(), impl="cuda", scale=-0.1,
                                  config=jc.FlashAttentionConfig(kernel="wgmma")))
