"""Optional GPU local-attention kernels for the ``kernel=`` hook beside the default fused op
``jax_cluster.flash_attention``: peers for the benchmarks.

``cudnn``: jax's cuDNN flash attention (``return_residual=True`` gives the log-sum-exp), one
call over the concatenated KV chunks, then the stable merge of :mod:`.local_attention`. It uses
a private jax module, so :func:`select_kernel` checks it against the jnp path on the device
before using it and falls back to ``"jnp"``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import local_attention as la


def cudnn_attend(q, kv_chunks, state=None, *, scale=None, lse_layout: str = "bnt"):
    """Hook-compatible kernel on jax's cuDNN attention (fp16/bf16, head_dim <= 128)."""
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

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
    o, lse = cudnn_dpa(q, k, v, scale=scale, qkv_layout="BTNH", return_residual=True)
    lse = lse.astype(jnp.float32)
    if lse_layout == "btn":
        lse = jnp.transpose(lse, (0, 2, 1))
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
    """(name, kernel) of the fastest hook kernel that passes a check on this device."""
    if prefer == "cudnn" and jax.devices()[0].platform == "gpu":
        for layout in ("bnt", "btn"):
            def kern(q, kv, st, *, scale=None, _layout=layout):
                return cudnn_attend(q, kv, st, scale=scale, lse_layout=_layout)
            if _check(kern):
                la.register_kernel("cudnn", kern)
                return "cudnn", kern
    return "jnp", la.attend
