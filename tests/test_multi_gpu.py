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
