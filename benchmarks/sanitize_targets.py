"""Small runs of every CUDA kernel, for compute-sanitizer memcheck / racecheck.

benchmarks/gpu_check.sh runs this under both tools; shapes are small so the
sanitizers finish quickly, but cover every cluster size and dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from jax_cluster import reference


def collectives():
    key = jax.random.key(1)
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        for n in (1, 2, 4, 8, 16):
            x = jax.random.normal(key, (2, n, 333), jnp.float32).astype(dtype)
            for impl in ("dsmem", "global"):
                out = jc.cluster_reduce(x, "sum", impl=impl, all_blocks=True, repeat=3)
                ref = reference.cluster_reduce(x, "sum", all_blocks=True, repeat=3)
                assert np.allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=5e-2, atol=5e-1)
                out = jc.cluster_gather(x, impl=impl, all_blocks=True, repeat=3)
                assert (np.asarray(out) == np.asarray(reference.cluster_gather(x, all_blocks=True, repeat=3))).all()
    print("collectives ok")


if __name__ == "__main__":
    collectives()
