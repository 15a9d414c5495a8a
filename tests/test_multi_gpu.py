"""Every fused op on each GPU of a process that drives two (a jax mesh does): a kernel's
one-time launch setup is per device, so the second GPU must compute the same bits as the
first, and a sharded program that calls the ops on both must not stall in its collectives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cluster as jc
from jax_cluster import parallel as sp

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpus():
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if len(devices) < 2:
        pytest.skip("needs 2 GPUs")
    return devices[:2]


def _same_on_both(fn, args, gpus):
    outs = [jax.device_get(jax.jit(fn)(*jax.device_put(args, g))) for g in gpus]
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _normal(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("cuda_kernel", ["wgmma", "mma"])
def test_flash_attention_on_each_gpu(rng, gpus, cuda_kernel):
    q, k, v = (_normal(rng, (1, 300, 4, 128)) for _ in range(3))
    config = jc.FlashAttentionConfig(kernel=cuda_kernel)
    _same_on_both(lambda q, k, v: jc.flash_attention(q, [(k, v)], finalize=True, impl="cuda",
                                                     config=config), (q, k, v), gpus)


@pytest.mark.parametrize("config", [
    jc.AttentionBlockConfig(cluster_size=4), jc.AttentionBlockConfig(cluster_size=4, pipeline="tma"),
    jc.AttentionBlockConfig(kernel="split_k"),
], ids=["registers", "tma", "split_k"])
def test_attention_block_on_each_gpu(rng, gpus, config):
    b, d, hq, hkv, dh, s = 2, 512, 8, 2, 128, 64
    args = (_normal(rng, (b, d)), _normal(rng, (d, (hq + 2 * hkv) * dh), scale=d ** -0.5),
            _normal(rng, (hq * dh, d), scale=(hq * dh) ** -0.5), _normal(rng, (b, hkv, s, dh)),
            _normal(rng, (b, hkv, s, dh)), jnp.asarray([5, 40], jnp.int32),
            jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32))
    _same_on_both(lambda *a: jc.attention_block(*a, num_q_heads=hq, num_kv_heads=hkv, norm=None,
                                                impl="cuda", config=config),
                  args, gpus)


def test_decode_attention_on_each_gpu(rng, gpus):
    q, k, v = _normal(rng, (2, 8, 4, 128)), _normal(rng, (2, 8, 300, 128)), _normal(rng, (2, 8, 300, 128))
    lengths = jnp.asarray([299, 17], jnp.int32)
    config = jc.DecodeAttentionConfig(splits=4)
    _same_on_both(lambda *a: jc.decode_attention(*a, impl="cuda", config=config), (q, k, v, lengths), gpus)


@pytest.mark.parametrize("variant", ["tma", "gemv", "fused"])
def test_swiglu_on_each_gpu(rng, gpus, variant):
    d, f = 512, 1024
    args = (_normal(rng, (3, d)), _normal(rng, (d, f), scale=d ** -0.5),
            _normal(rng, (d, f), scale=d ** -0.5), _normal(rng, (f, d), scale=f ** -0.5))
    config = jc.SwigluConfig(variant=variant)
    _same_on_both(lambda *a: jc.swiglu(*a, impl="cuda", config=config), args, gpus)


def test_sharded_flash_attention_schedule(rng, gpus):
    """The op inside a shard_map over both GPUs (the Ring schedule: ppermute between calls)."""
    q, k, v = (_normal(rng, (1, 1024, 4, 64)) for _ in range(3))
    plan = sp.plan("ring", heads=4, devices=gpus, num_machines=1)
    out = jax.jit(lambda *a: sp.sp_attention(*a, plan))(*(jax.device_put(x, plan.sharding())
                                                          for x in (q, k, v)))
    ref = sp.reference_attention(q, k, v)
    err = float(jnp.linalg.norm(jax.device_get(out).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2, err


def test_decode_ops_partition_their_rows_over_both_gpus(rng, gpus):
    """Batch-sharded decode ops on two GPUs (jax_cluster._sharding): the one-launch layer and
    the MoE kernels each run their own GPU's rows, with no collective, and give the bits of
    each half run on one GPU."""
    from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = Mesh(np.asarray(gpus), ("data",), axis_types=(AxisType.Auto,))
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    b, d, hq, hkv, dh, s, f = 4, 1024, 8, 2, 128, 256, 2048
    w = dict(norm=1.0 + _normal(rng, (d,), scale=0.1), qkv=_normal(rng, (d, (hq + 2 * hkv) * dh), scale=d ** -0.5),
             o=_normal(rng, (hq * dh, d), scale=(hq * dh) ** -0.5), post_norm=1.0 + _normal(rng, (d,), scale=0.1),
             w_gate=_normal(rng, (d, f), scale=d ** -0.5), w_up=_normal(rng, (d, f), scale=d ** -0.5),
             w_down=_normal(rng, (f, d), scale=f ** -0.5))
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, dh, 2) / dh), jnp.float32)
    layer = lambda x, w, kc, vc, n: jc.decoder_layer(x, w, kc, vc, n, inv_freq, family="llama",  # noqa: E731
                                                     num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, impl="cuda")
    args = (_normal(rng, (b, d)), w, _normal(rng, (b, hkv, s, dh)), _normal(rng, (b, hkv, s, dh)),
            jnp.asarray([3, 100, 255, 17], jnp.int32))
    is_row = (True, False, True, True, True)

    e, i = 16, 256
    moe = lambda x, r, g, u, dn: jc.moe_decode(x, r, g, u, dn, top_k=2, residual=x, impl="cuda")  # noqa: E731
    moe_args = (_normal(rng, (b, d)), _normal(rng, (d, e), jnp.float32), _normal(rng, (e, d, i), scale=d ** -0.5),
                _normal(rng, (e, d, i), scale=d ** -0.5), _normal(rng, (e, i, d), scale=i ** -0.5))

    for fn, a, flags in ((layer, args, is_row), (moe, moe_args, (True,) + (False,) * 4)):
        halves = [jax.jit(fn)(*[jax.tree.map(lambda v: jax.device_put(v[h * 2:h * 2 + 2], gpus[0]), x) if r
                                else jax.device_put(x, gpus[0]) for x, r in zip(a, flags)]) for h in range(2)]
        want = jax.tree.map(lambda *p: np.concatenate([np.asarray(q) for q in p]), *halves)
        placed = [jax.device_put(x, rows if r else whole) for x, r in zip(a, flags)]
        compiled = jax.jit(fn).lower(*placed).compile()
        assert "all-gather" not in compiled.as_text()
        for g, w_ in zip(jax.tree.leaves(compiled(*placed)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), w_)
