"""stream_read: read a buffer once at full speed; the memory-bandwidth probe.

The roofline of every memory-bound op here is bytes / the bandwidth a kernel can actually
stream at. XLA's own reductions read well below that on Hopper (an H100 copy or reduction
through XLA measured ~2.6 TB/s where a plain 16-byte streaming kernel reads ~3 TB/s), so
rooflines measured with them flatter every kernel. This op is that plain streaming
kernel (cpp/kernels/stream_read.cu); benchmarks time it inside one jit.
"""

from __future__ import annotations

import numpy as np
from jax.core import ShapedArray

from jax_cluster._ffi import ffi_primitive


def _abstract(x, *, chunks):
    return (ShapedArray((chunks,), np.uint32),)


_PRIM = ffi_primitive("stream_read", abstract_eval=_abstract)


def stream_read(x, chunks: int = 1024):
    """uint32 [chunks]: the XOR of the 32-bit words of each of `chunks` equal contiguous
    pieces of x's bytes (x.nbytes must be a multiple of 16 * chunks)."""
    nbytes = x.size * x.dtype.itemsize
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"stream_read: chunks must be a positive int, got {chunks!r}")
    if nbytes % (16 * chunks):
        raise ValueError(f"stream_read: x has {nbytes} bytes, which is not a multiple of "
                         f"16 * chunks = {16 * chunks}")
    (out,) = _PRIM.bind(x, chunks=chunks)
    return out
