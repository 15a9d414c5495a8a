"""The schedules on real GPUs (2 of them, as 2 machines x 1 GPU) against single-device attention,
with the fused flash_attention op (the default local kernel), its XLA formulation and, where it passes
its self-check, the cuDNN kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cluster import parallel as sp
from jax_cluster.parallel import gpu_kernels

pytestmark = pytest.mark.gpu


def _gpus():
    return [d for d in jax.devices() if d.platform == "gpu"]


@pytest.mark.parametrize("kernel", ["flash_attention", "xla", "cudnn"])
@pytest.mark.parametrize("name", sp.SCHEDULES)
def test_schedules_on_two_gpus(name, kernel, rng):
    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    if kernel == "cudnn":
        kname, kern = gpu_kernels.select_kernel(kernel)
        if kname != kernel:
            pytest.skip(f"{kernel} kernel unavailable here")
    else:
        kern = sp.get_kernel(kernel)
    b, l, h, d = 2, 4096, 24, 128
    q, k, v = (jnp.asarray(rng.standard_normal((b, l, h, d)), jnp.bfloat16) for _ in range(3))
    plan = sp.plan(name, heads=h, devices=gpus[:2], num_machines=2)
    q, k, v = (jax.device_put(x, plan.sharding()) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: sp.sp_attention(q, k, v, plan, kernel=kern))(q, k, v)
    ref = sp.reference_attention(*(jax.device_put(x, gpus[0]) for x in (q, k, v)))
    err = float(jnp.linalg.norm(jax.device_put(out, gpus[0]).astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    assert np.isfinite(err) and err < 1e-2
