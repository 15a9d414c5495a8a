"""The multi-chunk local attention (the XLA formulation, attend) and its (o, lse) merge."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster.parallel import local_attention as la


def _qkv(rng, b=2, lq=12, lk=20, h=3, d=16, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((b, lq, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, lk, h, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, lk, h, d)), dtype)
    return q, k, v


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_chunks_and_incoming_state_equal_one_pass(rng):
    q, k, v = _qkv(rng)
    ref = la.reference_attention(q, k, v)
    # split the KV into uneven chunks, including an empty one, over two calls
    cuts = [0, 3, 3, 11, 20]
    chunks = [(k[:, a:b], v[:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    st = la.attend(q, chunks[:2])
    st = la.attend(q, chunks[2:], st)
    assert _rel(la.finalize(st), ref) < 1e-6
    # lse is the log-sum-exp of the scaled scores
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    np.testing.assert_allclose(st.lse, jax.nn.logsumexp(s, axis=-1), rtol=1e-5, atol=1e-5)


def test_blocked_path_matches(rng):
    q, k, v = _qkv(rng, lq=37, lk=45)
    ref = la.reference_attention(q, k, v)
    st = la.attend(q, [(k, v)], q_block=8, kv_block=16)  # remainders on both axes
    assert _rel(la.finalize(st), ref) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_low_precision_inputs_fp32_state(rng, dtype, tol):
    q, k, v = _qkv(rng, dtype=dtype)
    st = la.attend(q, [(k[:, :7], v[:, :7]), (k[:, 7:], v[:, 7:])])
    assert st.o.dtype == jnp.float32 and st.lse.dtype == jnp.float32
    out = la.finalize(st, dtype)
    assert out.dtype == dtype
    assert _rel(out, la.reference_attention(q, k, v)) < tol


def test_empty_state_and_empty_chunks():
    st = la.empty_state(1, 4, 2, 8)
    q = jnp.ones((1, 4, 2, 8))
    same = la.attend(q, [(jnp.zeros((1, 0, 2, 8)), jnp.zeros((1, 0, 2, 8)))], st)
    assert np.all(np.isneginf(same.lse))
    out = la.finalize(la.merge(st, st))
    assert np.all(out == 0)  # no NaN from (-inf) - (-inf)
    assert np.all(np.isneginf(la.merge(st, st).lse))


def test_merge_is_stable_for_huge_logits(rng):
    q, k, v = _qkv(rng, lq=4, lk=8)
    q = q * 300.0  # scores of order 1e3: exp overflows without the max/lse shift
    a = la.attend(q, [(k[:, :4], v[:, :4])])
    b = la.attend(q, [(k[:, 4:], v[:, 4:])])
    ref = la.reference_attention(q, k, v)
    assert _rel(la.finalize(la.merge(a, b)), ref) < 1e-5
    assert _rel(la.finalize(la.merge(b, a)), ref) < 1e-5


def test_kernel_hook_registry(rng):
    calls = []

    def my_kernel(q, kv_chunks, state, *, scale):
        calls.append(len(kv_chunks))
        return la.attend(q, kv_chunks, state, scale=scale)

    la.register_kernel("test-hook", my_kernel)
    q, k, v = _qkv(rng)
    out = la.attention(q, k, v, kernel="test-hook")
    assert calls == [1]
    assert _rel(out, la.reference_attention(q, k, v)) < 1e-6
    with pytest.raises(ValueError, match="unknown attention kernel"):
        la.get_kernel("nope")


def test_bad_shapes_rejected():
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"kv_chunks\[0\]"):
        la.attend(q, [(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4)))])
    with pytest.raises(ValueError, match="state"):
        la.attend(q, [(q, q)], la.empty_state(1, 5, 2, 8))
