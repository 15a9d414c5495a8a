"""mla_decode: one decode step of DeepSeek-V2's multi-head latent attention, absorbed.

    h       = RMSNorm(x)
    q       = h W_q  (or RMSNorm(h W_q_a + b) W_q_b: q LoRA)     per head [q_nope | q_rope]
    c, k_r  = RMSNorm((h W_kv_a + b)[:r]), (h W_kv_a + b)[r:]     the new latent token
    q_rope, k_r rotated (interleaved RoPE at lengths[b], cos/sin times rope_factor)
    [c | k_r] written to the latent cache at slot lengths[b]
    s_h(t)  = scale * ((q_nope_h W_uk_h^T) . c_t + q_rope_h . k_r_t)     t = 0..lengths[b]
    y       = concat_h(softmax(s_h) . c  W_uv_h) W_o (+ o_bias) (+ x when residual)

W_uk and W_uv are the per-head halves of W_kv_b [r, H (dn + dv)]: keys and values are never
expanded, and a step reads the latent cache once for all heads (r + dr = 576 features per
token for V2 and V2-Lite, against 2 H (dn + dr) expanded). The cache is contiguous
[B, S_max, r + dr] or paged: a page pool [num_pages, page_size, r + dr] with a block table
[B, max_blocks] (slot t of row b lives in page block_table[b, t // page_size]). A row whose
lengths[b] is outside [0, capacity), or whose used blocks name a page outside the pool, gets
NaN and writes nothing; with concrete arguments that is a ValueError before anything runs.

`impl` has the meaning of every op (docs/architecture.md): "cuda" runs the latent-attention
custom call (cache write, paged or contiguous reads, split-K over tokens with a fixed-order
merge: cpp/ops/mla_decode) between the projection custom calls mla_project and mla_output
(cluster GEMVs, at 1 row by default and up to 8 on request; cpp/ops/mla_decode/projections.h),
or between XLA's dots (fp32 accumulation) for more rows; on CPU the custom calls' C++ handlers. "xla" is the
absorbed formulation in jnp a JAX user writes (the page pool gathered into rows),
"reference" the fp32 jnp reference, "auto" the CUDA kernels on a GPU where they take the
shape, else "xla" (one warning).
MlaDecodeConfig(splits=..., projections=...) fixes the token splits and the projections' form.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import batching

from jax_cluster import _extension, reference
from jax_cluster._ffi import (check_array, check_call, check_eps, ffi_primitive, fold_batch_axis,
                              num_sms, on_gpu, warn_once)
from jax_cluster._sharding import row_partitioned

__all__ = ["MlaDecodeConfig", "default_splits", "mla_decode"]

MIN_SPLIT_TOKENS = 64   # two pipeline stages
SPLIT_TOKENS = 256      # the shortest default split once the grid holds a block per SM
# The most rows projections=None sends to the projection kernels: one. Timed side by side in
# the layer benchmark they beat XLA's dots at 1 row and lose from 2 (docs/mla_decode.md).
DEFAULT_PROJECTION_ROWS = 1
MAX_DEFAULT_SPLITS = 128
_REQUIRED = ("norm", "kv_a", "kv_a_norm", "kv_b", "o")
_OPTIONAL = ("q", "q_a", "q_a_norm", "q_b", "q_a_bias", "kv_a_bias", "o_bias")


@functools.cache
def _constants() -> dict:
    return dict(_extension.plans().mla_decode_constants())


PROJECTIONS = ("kernels", "xla")


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """How mla_decode runs on the GPU (impl="auto" or "cuda").

    splits       token splits per (row, 16-head tile), 1..256; None: default_splits.
    projections  "kernels": the projections around the attention as two cluster kernels
                 (up to 8 rows; cpp/ops/mla_decode/projections.h); "xla": XLA's dots; None:
                 the kernels up to DEFAULT_PROJECTION_ROWS rows where they take the call,
                 else XLA's dots.
    """

    splits: int | None = None
    projections: str | None = None

    def __post_init__(self):
        if self.projections is not None and self.projections not in PROJECTIONS:
            raise ValueError(f"MlaDecodeConfig: projections must be one of {PROJECTIONS} or None, got "
                             f"{self.projections!r}")
        if self.splits is None:
            return
        if isinstance(self.splits, bool) or not isinstance(self.splits, (int, np.integer)):
            raise TypeError(f"MlaDecodeConfig: splits must be an int or None, got {self.splits!r}")
        if not 1 <= self.splits <= _constants()["max_splits"]:
            raise ValueError(f"MlaDecodeConfig: splits must be in 1..{_constants()['max_splits']}, got {self.splits}")


def default_splits(batch: int, num_heads: int, capacity: int, num_sms: int = 132) -> int:
    """Two blocks per SM in all (the split kernel keeps two resident) as long as every split
    holds SPLIT_TOKENS of the capacity; where that leaves under one block per SM, one block
    per SM with splits of at least MIN_SPLIT_TOKENS. At most MAX_DEFAULT_SPLITS, and no
    split without tokens (the kernel cuts a row into splits of whole 32-token stages). Each
    block reads its heads' fp32 q (36 KB for 16 heads) from L2 and leaves a state that the
    merge reads: past one block per SM, short splits cost more than they spread (the
    H200 sweep behind this rule is in docs/mla_decode.md)."""
    c = _constants()
    ceil_div = lambda a, b: -(-a // b)  # noqa: E731
    tiles = ceil_div(num_heads, c["head_tile"])
    one_per_sm = max(1, round(num_sms / (batch * tiles)))
    two_per_sm = max(1, round(2 * num_sms / (batch * tiles)))
    short = min(one_per_sm, ceil_div(capacity, MIN_SPLIT_TOKENS))
    splits = min(two_per_sm, max(short, ceil_div(capacity, SPLIT_TOKENS)), MAX_DEFAULT_SPLITS, c["max_splits"])
    per = ceil_div(ceil_div(capacity, splits), c["tile_tokens"]) * c["tile_tokens"]  # tokens of a split
    return int(ceil_div(capacity, per))


# ----------------------------------------------------------------------------- the custom call
def _plan(batch, num_heads, rank, rope_dim, capacity, dtype, splits, paged) -> dict:
    return dict(_extension.plans().mla_decode(batch, num_heads, rank, rope_dim, capacity,
                                              jnp.dtype(dtype).name, splits, paged))


def _abstract(q, new_latent, cache, block_table, lengths, *, splits, rank, paged, scale):
    b, h, e = q.shape
    capacity = block_table.shape[1] * cache.shape[1] if paged else cache.shape[1]
    ws = _plan(b, h, rank, e - rank, capacity, cache.dtype, splits, paged)["workspace_floats"]
    return (ShapedArray((b, h, rank), cache.dtype), ShapedArray(cache.shape, cache.dtype),
            ShapedArray((max(int(ws), 1),), np.float32))


def _batching(args, dims, **params):
    """vmap: the mapped axis folds into the rows; a mapped page pool folds into one pool whose
    block tables are offset per instance (entries outside a pool stay outside)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q, new, cache, table, lengths = (fold_batch_axis(a, d, size) for a, d in zip(args, dims))
    n, b = q.shape[:2]
    flat = lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])  # noqa: E731
    if params["paged"]:
        pages = cache.shape[1]
        inside = (table >= 0) & (table < pages)
        table = jnp.where(inside, table + (jnp.arange(n, dtype=jnp.int32) * pages)[:, None, None], -1)
    else:
        table = table[0]
    out, cache2, ws = _PRIM.bind(flat(q), flat(new), flat(cache), flat(table) if params["paged"] else table,
                                 flat(lengths), **params)
    ws = jnp.broadcast_to(ws, (n,) + ws.shape)  # scratch: one per instance in name only
    return (out.reshape((n, b) + out.shape[1:]), cache2.reshape(cache.shape), ws), (0, 0, 0)


_PRIM = ffi_primitive("mla_decode", abstract_eval=_abstract, batching_rule=_batching,
                      operand_output_aliases={2: 1})


# ----------------------------------------------------------------------------- the projection kernels
def _project_abstract(x, norm, q_src, w_q, kv_a, kv_a_bias, kv_a_norm, kv_b, lengths, inv_freq, *, num_heads,
                      nope, rope, rank, v_dim, capacity, eps, latent_eps, rope_factor):
    b, e = x.shape[0], rank + rope
    return (ShapedArray((b, num_heads, e), np.float32), ShapedArray((b, e), np.float32),
            ShapedArray((max(1, b * e),), np.float32),  # projections.h: mla_project_workspace_floats
            ShapedArray((_constants()["counter_words"],), np.uint32))


def _output_abstract(o_lat, kv_b, w_o, o_bias, residual, counters, *, nope, v_dim):
    b, h, _ = o_lat.shape
    hidden = w_o.shape[1]
    return (ShapedArray((b, hidden), o_lat.dtype), ShapedArray((h * b * hidden,), np.float32),
            ShapedArray(counters.shape, counters.dtype))


def _sequential_batching(prim, scratch: tuple[bool, ...]):
    """vmap by mapping the instances one after another (any operand may be mapped; folding
    them into rows would pass the kernels' row limit). Scratch results come back unbatched."""
    def rule(args, dims, **params):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        moved = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]

        def one(i):
            outs = prim.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)
            return [o for o, s in zip(outs, scratch) if not s]

        kept = iter(jax.lax.map(one, jnp.arange(size)))
        single = [jax.ShapeDtypeStruct(a.shape[1:] if d is not None else a.shape, a.dtype)
                  for a, d in zip(moved, dims)]
        shapes = jax.eval_shape(lambda *xs: prim.bind(*xs, **params), *single)
        outs = [jnp.zeros(t.shape, t.dtype) if s else next(kept) for s, t in zip(scratch, shapes)]
        return outs, [None if s else 0 for s in scratch]
    return rule


# mla_project returns both kernels' arrival counters, zeroed at its launch, and mla_output
# counts in them (operand 5 aliased to its result 2): no memset in the stream between the
# attention kernels and mla_output (projections.h). Under vmap each instance gets zeros.
_PROJECT = ffi_primitive("mla_project", abstract_eval=_project_abstract)
batching.primitive_batchers[_PROJECT] = _sequential_batching(_PROJECT, (False, False, True, True))
_OUTPUT = ffi_primitive("mla_output", abstract_eval=_output_abstract, operand_output_aliases={5: 2})
batching.primitive_batchers[_OUTPUT] = _sequential_batching(_OUTPUT, (False, True, True))


def _project_kernel(x, w, d, lengths, inv_freq, capacity, eps, latent_eps, rope_factor):
    """q_full [B, H, r + dr] (q_nope absorbed, q_rope rotated), the new latent token (fp32)
    and the counters for _output_kernel, from mla_project; with q LoRA its first branch (q_a,
    norm) runs as XLA's dots first."""
    empty = jnp.zeros((0,), x.dtype)
    if w.get("q") is not None:
        q_src, w_q = empty, w["q"]
    else:
        h = _rms_norm(x, w["norm"], eps)
        q_src, w_q = _rms_norm(_dense(h, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], latent_eps), w["q_b"]
    bias = w.get("kv_a_bias")
    q_full, new, _, counters = _PROJECT.bind(
        x, w["norm"], q_src, w_q, w["kv_a"], empty if bias is None else bias, w["kv_a_norm"], w["kv_b"], lengths,
        inv_freq, num_heads=d.heads, nope=d.nope, rope=d.rope, rank=d.rank, v_dim=d.v, capacity=int(capacity),
        eps=np.float32(eps), latent_eps=np.float32(latent_eps), rope_factor=np.float32(rope_factor))
    return q_full, new, counters


def _output_kernel(o_lat, w, d, residual, counters):
    """y [B, hidden] = concat_h(o_lat W_uv_h) W_o (+ o_bias) (+ residual) from mla_output;
    counters: _project_kernel's."""
    empty = jnp.zeros((0,), o_lat.dtype)
    bias = w.get("o_bias")
    y, _, _ = _OUTPUT.bind(o_lat, w["kv_b"], w["o"], empty if bias is None else bias,
                           empty if residual is None else residual, counters, nope=d.nope, v_dim=d.v)
    return y


# ----------------------------------------------------------------------------- jnp pieces
def _dense(x, w, b=None):
    y = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


def _rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    return w.astype(x.dtype) * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def _rope_interleaved(v, cos, sin):
    a, b = v[..., 0::2].astype(jnp.float32), v[..., 1::2].astype(jnp.float32)
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(v.shape).astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class _Dims:
    heads: int
    rank: int
    nope: int
    rope: int
    v: int


def _project(x, w, d: _Dims, pos, inv_freq, rope_factor, eps, latent_eps):
    """XLA's projections in x.dtype: q_nope [B, H, dn], rotated q_rope [B, H, dr] and the new
    latent token [c | rotated k_rope] [B, r + dr]."""
    h = _rms_norm(x, w["norm"], eps)
    if w.get("q") is not None:
        q = _dense(h, w["q"])
    else:
        q = _dense(_rms_norm(_dense(h, w["q_a"], w.get("q_a_bias")), w["q_a_norm"], latent_eps), w["q_b"])
    q = q.reshape(x.shape[0], d.heads, d.nope + d.rope)
    kv = _dense(h, w["kv_a"], w.get("kv_a_bias"))
    angle = pos.astype(jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angle) * rope_factor, jnp.sin(angle) * rope_factor
    q_rope = _rope_interleaved(q[..., d.nope:], cos[:, None], sin[:, None])
    new = jnp.concatenate([_rms_norm(kv[:, :d.rank], w["kv_a_norm"], latent_eps),
                           _rope_interleaved(kv[:, d.rank:], cos, sin)], -1)
    return q[..., :d.nope], q_rope, new


def _attend_kernel(q_full, new, cache, lengths, block_table, d: _Dims, splits, scale):
    table = block_table if block_table is not None else jnp.zeros((0,), jnp.int32)
    o_lat, cache, _ = _PRIM.bind(q_full, new, cache, table, lengths, splits=int(splits), rank=d.rank,
                                 paged=block_table is not None, scale=np.float32(scale))
    return o_lat, cache


def _row_validity(lengths, block_table, capacity, num_pages):
    valid = (lengths >= 0) & (lengths < capacity)
    if block_table is not None:
        page = capacity // block_table.shape[1]
        used = jnp.arange(block_table.shape[1])[None, :] <= jnp.where(valid, lengths, 0)[:, None] // page
        valid &= jnp.all(~used | ((block_table >= 0) & (block_table < num_pages)), axis=1)
    return valid


def _attend_xla(q_nope, q_rope, new, w_kvb, cache, lengths, block_table, d: _Dims, scale, valid):
    """The absorbed attention as jnp writes it: cache write (a scatter that drops invalid
    rows), the pages gathered into rows, einsums in the input dtype."""
    b = q_nope.shape[0]
    if block_table is None:
        capacity = cache.shape[1]
        slot = jnp.where(valid, lengths, capacity)
        cache = cache.at[jnp.arange(b), slot].set(new.astype(cache.dtype), mode="drop")
        lat = cache
    else:
        pages, page, _ = cache.shape
        capacity = block_table.shape[1] * page
        pos = jnp.where(valid, lengths, 0)
        page_id = jnp.where(valid, jnp.take_along_axis(block_table, (pos // page)[:, None], 1)[:, 0], pages)
        cache = cache.at[page_id, pos % page].set(new.astype(cache.dtype), mode="drop")
        lat = cache[jnp.clip(block_table, 0, pages - 1)].reshape(b, capacity, -1)
    dt = q_nope.dtype
    seen = jnp.arange(capacity)[None, :] <= lengths[:, None]
    lat = jnp.where(seen[..., None], lat, 0)  # slots past the token (stale or unowned pages) never reach p . c
    q_lat = jnp.einsum("bhd,rhd->bhr", q_nope, w_kvb[..., :d.nope].astype(dt), preferred_element_type=jnp.float32)
    q_full = jnp.concatenate([q_lat.astype(dt), q_rope], -1)
    s = jnp.einsum("bhe,bse->bhs", q_full, lat.astype(dt), preferred_element_type=jnp.float32) * scale
    s = jnp.where(seen[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    o_lat = jnp.einsum("bhs,bsr->bhr", p, lat[..., :d.rank].astype(dt), preferred_element_type=jnp.float32)
    return jnp.where(valid[:, None, None], o_lat, jnp.nan).astype(dt), cache


# ----------------------------------------------------------------------------- checks
def _check(op, x, weights, cache, lengths, inv_freq, block_table, d: _Dims):
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{op}: x must be a float [B, hidden] array, got {x.dtype} {tuple(x.shape)}")
    b, hidden = x.shape
    for name, value in (("num_heads", d.heads), ("kv_lora_rank", d.rank), ("qk_nope_head_dim", d.nope),
                        ("v_head_dim", d.v)):
        if value < 1:
            raise ValueError(f"{op}: {name} must be >= 1, got {value}")
    if d.rope < 0 or d.rope % 2:
        raise ValueError(f"{op}: qk_rope_head_dim must be even and >= 0, got {d.rope}")
    unknown = set(weights) - set(_REQUIRED) - set(_OPTIONAL)
    missing = [k for k in _REQUIRED if weights.get(k) is None]
    has_q, has_lora = weights.get("q") is not None, weights.get("q_a") is not None
    if unknown or missing:
        raise ValueError(f"{op}: weights: unknown {sorted(unknown)}, missing {missing} (required {_REQUIRED}, "
                         f"optional {_OPTIONAL})")
    if has_q == has_lora:
        raise ValueError(f"{op}: weights need either 'q' (no q LoRA) or 'q_a', 'q_a_norm' and 'q_b', not "
                         f"{'both' if has_q else 'neither'}")
    e, qk = d.rank + d.rope, d.heads * (d.nope + d.rope)
    shapes = dict(norm=(hidden,), kv_a=(hidden, e), kv_a_norm=(d.rank,), kv_a_bias=(e,),
                  kv_b=(d.rank, d.heads * (d.nope + d.v)), o=(d.heads * d.v, hidden), o_bias=(hidden,), q=(hidden, qk))
    if has_lora:
        if weights.get("q_a").ndim != 2:
            raise ValueError(f"{op}: q_a must be [hidden, q_lora_rank], got {tuple(weights['q_a'].shape)}")
        ql = weights["q_a"].shape[1]
        shapes.update(q_a=(hidden, ql), q_a_norm=(ql,), q_a_bias=(ql,), q_b=(ql, qk))
        if weights.get("q_a_norm") is None or weights.get("q_b") is None:
            raise ValueError(f"{op}: q LoRA needs q_a, q_a_norm and q_b")
    for name, shape in shapes.items():
        check_array(op, f"weights[{name!r}]", weights.get(name), shape, x.dtype)
    if block_table is None:
        if cache.ndim != 3 or cache.shape[0] != b or cache.shape[2] != e:
            raise ValueError(f"{op}: latent_cache must be [B={b}, S_max, r + dr={e}], got {tuple(cache.shape)}")
        capacity, pages = cache.shape[1], 0
    else:
        if cache.ndim != 3 or cache.shape[2] != e:
            raise ValueError(f"{op}: a paged latent_cache must be [num_pages, page_size, r + dr={e}], "
                             f"got {tuple(cache.shape)}")
        if block_table.ndim != 2 or block_table.shape[0] != b or block_table.dtype != jnp.int32:
            raise ValueError(f"{op}: block_table must be int32 [B={b}, max_blocks], got "
                             f"{jnp.dtype(block_table.dtype).name} {tuple(block_table.shape)}")
        pages, capacity = cache.shape[0], block_table.shape[1] * cache.shape[1]
    if cache.dtype != x.dtype:
        raise ValueError(f"{op}: latent_cache must have x's dtype {x.dtype}, got {cache.dtype}")
    check_array(op, "lengths", lengths, (b,), jnp.int32)
    check_array(op, "inv_freq", inv_freq, (d.rope // 2,), jnp.float32)
    concrete = not isinstance(lengths, jax.core.Tracer) and (
        block_table is None or not isinstance(block_table, jax.core.Tracer))
    if concrete and b:
        lens = np.asarray(lengths)
        if lens.min() < 0 or lens.max() >= capacity:
            raise ValueError(f"{op}: lengths must be in [0, capacity={capacity}); got min {lens.min()}, "
                             f"max {lens.max()}")
        if block_table is not None:
            table, page = np.asarray(block_table), cache.shape[1]
            for row, length in enumerate(lens):
                used = table[row, :length // page + 1]
                bad = used[(used < 0) | (used >= pages)]
                if bad.size:
                    raise ValueError(f"{op}: block_table row {row} uses page {bad[0]}, outside the pool of "
                                     f"{pages} pages")
    return capacity, pages


def _use_projection_kernels(op, config, x, weights, d: _Dims) -> bool:
    """Whether the attention kernel's call runs its projections on mla_project / mla_output."""
    choice = config.projections if config is not None else None
    if choice == "xla":
        return False
    q_in = weights["q_a"].shape[1] if weights.get("q_a") is not None else x.shape[1]
    check = dict(_extension.plans().mla_projections(jnp.dtype(x.dtype).name, x.shape[0], x.shape[1], q_in, d.nope,
                                                    d.rope, d.rank, d.v))
    why_not = check["error"] or (check["cuda_error"] if on_gpu() else "")
    if not why_not and x.shape[0] > _constants()["projection_max_rows"]:
        why_not = f"at most {_constants()['projection_max_rows']} rows, got {x.shape[0]}"
    if why_not and choice == "kernels":
        raise ValueError(f"{op}: projections='kernels': {why_not}")
    return not why_not and (choice == "kernels" or x.shape[0] <= DEFAULT_PROJECTION_ROWS)


def _use_kernel(op, impl, config, x, d: _Dims, capacity, paged):
    """The token splits to launch with, or None for the jnp formulation (impl and config
    already checked: check_call)."""
    if impl in ("xla", "reference"):
        return None
    b = x.shape[0]
    splits = config.splits if config is not None and config.splits is not None else \
        default_splits(b, d.heads, capacity, num_sms())
    plan = _plan(b, d.heads, d.rank, d.rope, capacity, x.dtype, splits, paged)
    why_not = plan["error"] or (plan["cuda_error"] if on_gpu() or impl == "auto" else "")
    if why_not:
        if impl == "cuda":
            raise ValueError(f"{op}: {why_not}")
        if on_gpu():
            warn_once((op, d.rank, d.rope, jnp.dtype(x.dtype).name), f"{op}: {why_not}; using XLA's ops (impl='xla')")
        return None
    if impl == "auto" and not on_gpu():
        return None
    return splits


# ----------------------------------------------------------------------------- the op
def mla_decode(x, weights, latent_cache, lengths, inv_freq, *, num_heads: int, kv_lora_rank: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float, eps: float,
               latent_eps: float = 1e-6, rope_factor: float = 1.0, residual: bool = False, block_table=None,
               impl: str = "auto", config: MlaDecodeConfig | None = None):
    """(y [B, hidden] in x.dtype, latent_cache): see the module docstring.

    weights: norm (the input RMSNorm), q [hidden, H (dn + dr)] or q_a [hidden, q_lora_rank],
    q_a_norm, q_b [q_lora_rank, H (dn + dr)]; kv_a [hidden, r + dr], kv_a_norm [r], kv_b
    [r, H (dn + dv)], o [H dv, hidden]; optional q_a_bias, kv_a_bias, o_bias; all of x's
    dtype. lengths int32 [B]: the tokens cached before this step. inv_freq float32 [dr / 2]
    (YaRN's frequencies); rope_factor scales cos and sin (YaRN's attention factor); scale
    multiplies the scores (YaRN's mscale folded in). Donate latent_cache: it is updated in
    place. On a GPU the kernels take float16 / bfloat16, kv_lora_rank <= 512 and
    qk_rope_head_dim <= 64 (both multiples of 8); the CPU handler any shape and float32.
    """
    op = "mla_decode"
    d = _Dims(int(num_heads), int(kv_lora_rank), int(qk_nope_head_dim), int(qk_rope_head_dim), int(v_head_dim))
    check_call(op, impl, config, MlaDecodeConfig)
    if not isinstance(weights, Mapping):
        raise TypeError(f"{op}: weights must be a mapping of names to arrays, got {type(weights).__name__}")
    weights = dict(weights)
    capacity, pages = _check(op, x, weights, latent_cache, lengths, inv_freq, block_table, d)
    check_eps(op, "eps", eps)
    check_eps(op, "latent_eps", latent_eps)
    if x.shape[0] == 0:  # no rows: nothing to launch, the cache unchanged
        return jnp.zeros(x.shape, x.dtype), latent_cache
    splits = _use_kernel(op, impl, config, x, d, capacity, block_table is not None)
    kw = dict(num_heads=d.heads, kv_lora_rank=d.rank, qk_nope_head_dim=d.nope, qk_rope_head_dim=d.rope,
              v_head_dim=d.v, scale=scale, eps=eps, latent_eps=latent_eps, residual=residual,
              block_table=block_table)
    if impl == "reference":
        return reference.mla_decode(x, weights, latent_cache, lengths, inv_freq, rope_factor=rope_factor, **kw)
    if splits is not None:
        path = functools.partial(_kernel_path, d=d, config=config, capacity=capacity, eps=eps,
                                 latent_eps=latent_eps, rope_factor=rope_factor, scale=scale, residual=residual)
        if block_table is None:  # rows own their cache rows: each device runs its own (a page pool is shared)
            return row_partitioned(path, (True, False, True, True, False), (True, True))(
                x, weights, latent_cache, lengths, inv_freq)
        return path(x, weights, latent_cache, lengths, inv_freq, block_table)
    valid = _row_validity(lengths, block_table, capacity, pages)
    q_nope, q_rope, new = _project(x, weights, d, jnp.where(valid, lengths, 0), inv_freq, rope_factor, eps,
                                   latent_eps)
    w_kvb = _kv_b_heads(weights, d)
    o_lat, latent_cache = _attend_xla(q_nope, q_rope, new, w_kvb, latent_cache, lengths, block_table, d, scale,
                                      valid)
    return _out_xla(o_lat, x, weights, w_kvb, d, residual), latent_cache


def _kv_b_heads(weights, d: _Dims):
    return weights["kv_b"].reshape(d.rank, d.heads, d.nope + d.v)


def _out_xla(o_lat, x, weights, w_kvb, d: _Dims, residual):
    """y from o_lat on XLA's dots: through W_uv per head, W_o (+ bias) (+ residual)."""
    o = jnp.einsum("bhr,rhd->bhd", o_lat, w_kvb[..., d.nope:].astype(o_lat.dtype), preferred_element_type=jnp.float32)
    y = _dense(o.astype(x.dtype).reshape(x.shape[0], d.heads * d.v), weights["o"], weights.get("o_bias"))
    if residual:
        y = (y.astype(jnp.float32) + x.astype(jnp.float32)).astype(x.dtype)
    return y


def _kernel_path(x, weights, cache, lengths, inv_freq, block_table=None, *, d: _Dims, config, capacity, eps,
                 latent_eps, rope_factor, scale, residual):
    """(y, cache) through the attention kernel, the projections on their kernels or XLA's dots.
    The splits and the projections' form follow x's rows: on a mesh, each device's own."""
    splits = config.splits if config is not None and config.splits is not None else \
        default_splits(x.shape[0], d.heads, capacity, num_sms())
    if _use_projection_kernels("mla_decode", config, x, weights, d):
        q_full, new, counters = _project_kernel(x, weights, d, lengths, inv_freq, capacity, eps, latent_eps,
                                                rope_factor)
        o_lat, cache = _attend_kernel(q_full, new, cache, lengths, block_table, d, splits, scale)
        return _output_kernel(o_lat, weights, d, x if residual else None, counters), cache
    # The kernel gives an invalid row NaN and writes nothing, so that row's RoPE position
    # is moot: no scan of the block table in XLA ahead of it.
    q_nope, q_rope, new = _project(x, weights, d, lengths, inv_freq, rope_factor, eps, latent_eps)
    w_kvb = _kv_b_heads(weights, d)
    q_lat = jnp.einsum("bhd,rhd->bhr", q_nope, w_kvb[..., :d.nope], preferred_element_type=jnp.float32)
    q_full = jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], -1)
    o_lat, cache = _attend_kernel(q_full, new.astype(jnp.float32), cache, lengths, block_table, d, splits, scale)
    return _out_xla(o_lat, x, weights, w_kvb, d, residual), cache
