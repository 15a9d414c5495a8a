"""An optional GPU local-attention kernel for the ``kernel=`` hook beside the default op
``jax_cluster.flash_attention``: cuDNN, a peer for the benchmarks.

``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", return_residual=True)``
(the log-sum-exp comes back as the residual), one call over the concatenated KV chunks,
then the stable merge of the state. The public API returns the log-sum-exp in the input
dtype: bfloat16's 8-bit mantissa would put errors of up to 0.03 into it at the magnitudes
of long sequences (and as much into the merge weights), so bfloat16 inputs run in float16
(exact for values within float16's range) and the log-sum-exp keeps about 3 decimal
digits. :func:`select_kernel` checks the kernel against the XLA path on the device before
using it and falls back to ``"xla"`` where cuDNN is unavailable.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import local_attention as la


def cudnn_attend(q, kv_chunks, state=None, *, scale=None):
    """Hook-compatible kernel on jax's cuDNN attention (fp16/bf16, head_dim <= 128)."""
    b, lq, h, d = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if state is None:
        state = la.empty_state(b, lq, h, d)
    chunks = [(k, v) for k, v in kv_chunks if k.shape[1]]
    if not chunks or lq == 0:
        return state
    k = jnp.concatenate([c[0] for c in chunks], 1) if len(chunks) > 1 else chunks[0][0]
    v = jnp.concatenate([c[1] for c in chunks], 1) if len(chunks) > 1 else chunks[0][1]
    if q.dtype == jnp.bfloat16:  # the residual (lse) comes back in the input dtype
        q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    o, lse = jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn",
                                          return_residual=True)
    lse = jnp.transpose(lse.astype(jnp.float32), (0, 2, 1))  # [B, T, N] -> [B, N, T]
    return la.merge(state, la.State(o.astype(jnp.float32), lse))


def _check(kernel, dtype=jnp.bfloat16, d=128) -> bool:
    key = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (1, 256, 4, d), jnp.float32).astype(dtype) for x in key)
    ref = la.reference_attention(q, k, v)
    try:
        st = jax.jit(lambda q, k, v: kernel(q, [(k[:, :100], v[:, :100]), (k[:, 100:], v[:, 100:])], None,
                                            scale=1 / math.sqrt(d)))(q, k, v)
        ref_lse = jax.nn.logsumexp(jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32),
                                              k.astype(jnp.float32)) / math.sqrt(d), -1)
        err = float(jnp.linalg.norm(st.o - ref) / jnp.linalg.norm(ref))
        lse_err = float(jnp.max(jnp.abs(st.lse - ref_lse)))
        return bool(np.isfinite(err) and err < 2e-2 and lse_err < 5e-2)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def select_kernel(prefer: str = "cudnn") -> tuple[str, object]:
    """(name, kernel): the cuDNN kernel where it passes its check on this device (registered
    as ``"cudnn"``), else the XLA path ``("xla", attend)``."""
    if prefer == "cudnn" and jax.devices()[0].platform == "gpu" and _check(cudnn_attend):
        la.register_kernel("cudnn", cudnn_attend)
        return "cudnn", cudnn_attend
    return "xla", la.attend
