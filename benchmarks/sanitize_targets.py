"""Small runs of every CUDA kernel, for compute-sanitizer memcheck / racecheck.

benchmarks/gpu_check.sh runs this under both tools; shapes are small so the
sanitizers finish quickly, but cover every cluster size and both dtypes widths.
Results are compared bitwise with the CPU handler (same order of operations).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc


def _same_on_cpu(fn, x):
    gpu = np.asarray(jax.jit(fn)(x))
    cpu = np.asarray(jax.jit(fn)(jax.device_put(x, jax.devices("cpu")[0])))
    assert (gpu == cpu).all(), fn


def collectives(dtypes):
    key = jax.random.key(1)
    for dtype in dtypes:
        for n in (1, 2, 4, 8, 16):
            x = (jax.random.normal(key, (2, n, 333), jnp.float32) / n).astype(dtype)
            for impl in ("dsmem", "global"):
                _same_on_cpu(lambda x: jc.cluster_reduce(x, "sum", impl=impl, all_blocks=True, repeat=3), x)
                _same_on_cpu(lambda x: jc.cluster_gather(x, impl=impl, all_blocks=True, repeat=3), x)
    print("collectives ok")


if __name__ == "__main__":
    quick = "--quick" in sys.argv  # racecheck is slow: one dtype of each width
    collectives((jnp.float32, jnp.bfloat16) if quick else (jnp.float32, jnp.float16, jnp.bfloat16))
