"""swiglu: DeepFusionKernel's fused SwiGLU MLP, its scheduler, and its tensor-parallel form.

    A2 = silu(x @ w_gate) * (x @ w_up)          [M, F]  (rounded to x.dtype)
    y  = A2 @ w_down (+ residual)               [M, D]

x [..., D]; w_gate, w_up [D, F]; w_down [F, D] or None (then A2 is returned, the fused
"up" stage alone). fp16 / bf16 with fp32 accumulation; D and F multiples of 64 (other
shapes, and float32, run the jnp reference with a one-time warning).

Variants (``variant=``), all deterministic (kernels/swiglu.h has the details):
  "split"      two kernels: gate+up GEMMs sharing every x tile, SiLU*mul in registers,
               one write of A2; then the down GEMM with the residual fused. Column-major
               tile order (a weight tile's row groups side by side: weights read once).
  "split_row"  the same with row-major tile order (16-row tiles, all weight tiles of one
               row group before the next: x reuse, for large M).
  "fused"      ONE persistent cluster kernel: A2 never leaves the chip. Each cluster owns a
               range of F, its blocks split D, gate/up partials are reduce-scattered and A2
               all-gathered over DSMEM, each block multiplies A2 by its columns of w_down,
               and clusters' partial outputs are summed in cluster order by the last one.
               Column-major: as many rows per pass as shared memory holds (weights once).
  "fused_row"  the fused kernel with one 16-row tile per pass (row-major).
  "stream"     the split form's two GEMMs as persistent stream-K kernels: one block per
               resident slot (no partial last wave), each streaming an equal share of the
               flat (tile, K block) sequence without draining its copy pipeline between
               tiles; partial tiles meet in a workspace and the last block to arrive sums
               them in block order (deterministic) and applies SiLU*mul / the residual.
  "gemv"       M <= 16 (larger M runs in 16-row chunks): both GEMMs streaming the weights
               from HBM straight into registers (no shared-memory staging, 12 16-byte loads
               in flight per thread), byte-permuted into mma.sync fragments of the
               transposed weights with x as the other operand (tensor cores: 4 mma per 8
               rows of x per 16 weight rows, so M is nearly free); each block owns 128 columns (gate and up) and one K chunk,
               as many chunks as keep every block resident (one wave); chunks are summed in
               order by the tile's last block (deterministic); the down kernel starts
               programmatically (PDL) and loads its first weights while the up kernel
               drains. "gemv:mma=0" = the CUDA-core form (M <= 8: M FMAs per weight).
  "tma"        the split form's two GEMMs as persistent stream-K kernels fed by the bulk
               tensor copy engine: one block per SM, one producer warp streaming 64 x 64
               weight boxes (and the x / A2 box) into a 2-stage ring in shared memory,
               eight consumer warps on mma.sync; equal shares of the (tile, K block) units
               per block (the up grid: whole tiles or exact fractions of one per block
               when its tiles fit). A tile split between blocks is summed in block order
               (deterministic) by the blocks whose ranges end in it, each a share, once the
               tile's integer counter says all partials are in (blocks wait on each other:
               the grid never exceeds what the GPU holds, and two tma calls must not run
               at once on one GPU from different streams; XLA runs a device's computations
               on one compute stream). The down kernel starts programmatically (PDL): its
               first weight tiles load, and the next few are pulled into L2, while the up
               kernel drains. With one row group and few down tiles (D / 256 <= SMs / 5:
               D = 4096), the down GEMM runs in clusters of 5-8 blocks per tile that sum
               their partials over DSMEM instead. Any M (row groups of 16 rt rows; weights
               re-read per group above 64 rows). H100 (benchmarks/results/swiglu.md, parts
               s23_*, s23b_*): 1.03-1.16x plain jnp at M = 64 (86-93% of roofline),
               1.05-1.11x at M = 32, 1.01-1.09x at M = 16 (92-99%), 0.96-1.03x below. "tma:wg=1": the consumers are
               two warpgroups on wgmma (64-row tiles, both operands read from the stage);
               slower than mma.sync (session 20, M = 64: ~1.07x its time), so not a
               scheduler candidate.
  "tma+xla"    our up stage (variant "tma"; any up-capable variant before "+xla") writes A2,
               then XLA's dot does the down GEMM with the residual: at small M the pair
               beat both pure forms at some points (H100, session 26,
               benchmarks/probes/swiglu_mixed.py: Llama-2-7B M = 8 96.0 us against 97.9
               for "xla" and 98.5 for "tma"; 70b-tp4 M = 16 124.3 / 129.2 / 126.8), so the
               scheduler weighs it. Without w_down it is the up variant alone.
  "xla"        no kernel: XLA's own dots (16-bit in and out, fp32 accumulation) and fused
               elementwise. A candidate of the scheduler, so "auto" is never slower than
               plain XLA where our kernels lose (H100, benchmarks/results/swiglu.md: at
               most points with M <= 8, by 0-4%).
  "auto"       the scheduler: on a GPU, the fastest candidate for (M bucket, D, F, dtype,
               GPU), measured once and cached on disk (jax_cluster.tuning); with
               JAX_CLUSTER_TUNING=0, the heuristic ("tma": our fastest kernel on H100 at
               every measured M). On CPU the CPU handler computes the same math whatever
               the variant.
Experts may append knobs: "fused:n=16:g=2:rt=1:c=29" (cluster size, F tiles per exchange,
16-row tiles per block, clusters), "split:nu=4:nd=16:rt=2" (cluster sizes of the up and
down kernels), "stream:rt=1:c=132" (16-row tiles per block, blocks of the grid),
"gemv:ku=8:kd=21:p=0:mma=0" (K chunks of the up and down GEMMs, programmatic launch of the
down kernel off, CUDA cores), "tma:rt=1:c=132:p=0:wg=0" (16-row tiles per block, blocks, programmatic launch of
the down kernel off, wgmma consumers off).

Tensor parallelism (DeepFusionKernel App. A.1): :func:`swiglu_tp` shards w_gate / w_up by
columns and w_down by rows over a mesh axis; each device runs the op on its shard and a
single psum combines the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import reference, tuning
from jax_cluster._ffi import ffi_primitive

VARIANTS = ("auto", "split", "split_row", "fused", "fused_row", "stream", "gemv", "tma", "xla")
XLA_DOWN = "+xla"  # suffix: our up stage, then XLA's down dot (see "tma+xla" above)


def split_xla_down(spec: str) -> tuple[str, bool]:
    """(the spec of our kernels, whether XLA's dot does the down GEMM): "tma+xla" -> ("tma", True)."""
    if spec.endswith(XLA_DOWN):
        return spec[:-len(XLA_DOWN)], True
    return spec, False
ALIGN = 64
FUSED_MAX_ROWS = 64  # the fused op handles larger M in chunks of this many rows
CLUSTER_SIZES = (1, 2, 4, 8, 16)
_KNOBS = {"n", "nu", "nd", "rt", "g", "c", "ku", "kd", "p", "mma", "wg"}
# the gemv kernels' M on CUDA cores / tensor cores; larger M runs in chunks of this many rows
GEMV_MAX_ROWS = 8
GEMV_MMA_MAX_ROWS = 16
_GEMV_COLS = 128
_GEMV_X_BYTES = 64 * 1024

# Mirrors cpp/kernels/swiglu.h (shared-memory plan and workspace).
_STAGE_B = 64 * 128 * 2
_MAX_STAGES = 8
_BUDGET2 = 112 * 1024
_BUDGET1 = 220 * 1024
_COUNTER_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Config:
    """One concrete launch configuration (the FFI attributes)."""

    variant: int  # 0 split, 1 fused, 2 stream, 3 gemv, 4 tma
    order: int  # 0 col, 1 row
    cluster_up: int
    cluster_down: int
    row_tiles: int
    f_group: int
    num_clusters: int  # fused: clusters; stream, tma: blocks (clusters of one)
    k_splits_up: int = 1  # gemv: K chunks of each GEMM
    k_splits_down: int = 1
    pdl: int = 0  # tma, gemv: the down kernel starts programmatically (PDL)
    gemv_mma: int = 0  # gemv: tensor cores (mma.sync) instead of CUDA-core FMAs
    wgmma: int = 0  # tma: warpgroup MMA (wgmma) consumers, 64-row tiles

    def attrs(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if self.variant == 4:
            return (f"tma rt{self.row_tiles} c{self.num_clusters} pdl{self.pdl}"
                    f"{' wgmma' if self.wgmma else ''}")
        if self.variant == 3:
            return (f"gemv ku{self.k_splits_up} kd{self.k_splits_down} pdl{self.pdl}"
                    f"{' mma' if self.gemv_mma else ''}")
        if self.variant == 2:
            return f"stream rt{self.row_tiles} c{self.num_clusters}"
        if self.variant == 1:
            return (f"fused n{self.cluster_up} g{self.f_group} rt{self.row_tiles} "
                    f"c{self.num_clusters}")
        return (f"split nu{self.cluster_up} nd{self.cluster_down} rt{self.row_tiles} "
                f"{'row' if self.order else 'col'}")

    def effective(self, m: int) -> "Config":
        """The same configuration with knobs that cannot change the launch normalised
        (tile order with one row group, or in the fused kernel): equal means same kernels."""
        if self.variant in (1, 2, 3, 4) or _ceil_div(m, 16 * self.row_tiles) == 1:
            return dataclasses.replace(self, order=0)
        return self


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (max(1, v) - 1).bit_length())


def _smem_plan(fixed: int, stage: int) -> tuple[int, int]:
    """(stages, bytes) of one block; (0, 0) when it does not fit."""
    budget = _BUDGET2 if (_BUDGET2 - fixed) // stage >= 3 else _BUDGET1
    stages = min(_MAX_STAGES, (budget - fixed) // stage)
    return (0, 0) if stages < 2 else (stages, fixed + stages * stage)


def _stage_bytes(rows: int) -> int:
    return _STAGE_B + rows * 128


def tile_smem(row_tiles: int) -> tuple[int, int]:
    rows = 16 * row_tiles
    return _smem_plan(rows * 128 * 4, _stage_bytes(rows))


def fused_smem(row_tiles: int, f_group: int, cluster: int, d: int) -> tuple[int, int]:
    rows, group = 16 * row_tiles, 64 * f_group
    cols = _ceil_div(d // 64, cluster) * 64
    fixed = 2 * rows * 2 * group * 4 + rows * group * 2 + rows * cols * 4
    return _smem_plan(fixed, _stage_bytes(rows))


def _align16(v: int) -> int:
    return _ceil_div(v, 16) * 16


def stream_workspace_bytes(cfg: Config, m: int, d: int, f: int, itemsize: int,
                           has_down: bool) -> int:
    """[A2 | one counter per work tile of each GEMM | partial slots] (swiglu_stream_layout)."""
    rows = 16 * cfg.row_tiles
    groups = _ceil_div(m, rows)
    tiles_up = f // 64 * groups
    tiles_down = _ceil_div(d, 128) * groups if has_down else 0
    a2 = _align16(m * f * itemsize) if has_down else 0
    counters = _align16(4 * (tiles_up + tiles_down))
    segments = cfg.num_clusters + max(tiles_up, tiles_down) - 1
    return a2 + counters + segments * min(m, rows) * 128 * 4


def tma_workspace_bytes(cfg: Config, m: int, d: int, f: int, itemsize: int,
                        has_down: bool) -> int:
    """[A2 | one counter per work tile of each GEMM | partial slots] (swiglu_tma_layout:
    128-column up tiles, 256-column down tiles, slots of 256 fp32 columns)."""
    rows = 16 * cfg.row_tiles
    groups = _ceil_div(m, rows)
    tiles_up = _ceil_div(f, 128) * groups
    tiles_down = _ceil_div(d, 256) * groups if has_down else 0
    a2 = _align16(m * f * itemsize) if has_down else 0
    counters = _align16(4 * (tiles_up + tiles_down))
    segments = cfg.num_clusters + max(tiles_up, tiles_down) - 1
    return a2 + counters + segments * min(m, rows) * 256 * 4


def gemv_max_rows(mma: bool) -> int:
    return GEMV_MMA_MAX_ROWS if mma else GEMV_MAX_ROWS


def gemv_x_row_bytes(m: int, mma: bool) -> int:
    """Shared-memory bytes of one K row of x (swiglu_gemv_x_row_bytes): rows padded to a
    power of two in fp32 (CUDA cores) or to 8 / 16 in 16 bits (tensor cores)."""
    if mma:
        return (8 if m <= 8 else 16) * 2
    return (1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8) * 4


def gemv_chunk(k: int, splits: int) -> int:
    """K rows per chunk (a multiple of 16) when K is split `splits` ways."""
    return _ceil_div(_ceil_div(k, splits), 16) * 16


def gemv_workspace_bytes(cfg: Config, m: int, d: int, f: int, itemsize: int,
                         has_down: bool) -> int:
    """[A2 | one counter per column tile of each GEMM | fp32 partials] (swiglu_gemv_layout)."""
    tiles_up = _ceil_div(f, _GEMV_COLS)
    tiles_down = _ceil_div(d, _GEMV_COLS) if has_down else 0
    a2 = _align16(m * f * itemsize) if has_down else 0
    counters = _align16(4 * (tiles_up + tiles_down))
    up = tiles_up * cfg.k_splits_up * 2 if cfg.k_splits_up > 1 else 0
    down = tiles_down * cfg.k_splits_down if has_down and cfg.k_splits_down > 1 else 0
    return a2 + counters + max(up, down) * m * _GEMV_COLS * 4


def gemv_blocks_per_sm(m: int, mma: bool) -> int:
    """Resident gemv blocks per SM (the kernels' __launch_bounds__): 3 on CUDA cores at
    M <= 2, else 2 (registers)."""
    return 3 if not mma and m <= 2 else 2


def _gemv_splits(k: int, tiles: int, row_bytes: int, slots: int, want: int | None = None) -> int:
    """K chunks: `want`, or as many as keep all blocks resident at once (`slots` = resident
    blocks on the GPU: one wave, no tail; a second partial wave measured ~15% slower on
    H100); raised until a chunk's x fits shared memory, at most K / 16."""
    s = want if want is not None else max(1, slots // tiles)
    while gemv_chunk(k, s) * row_bytes > _GEMV_X_BYTES:
        s += 1
    return max(1, min(s, k // 16))


def workspace_bytes(cfg: Config, m: int, d: int, f: int, itemsize: int, has_down: bool) -> int:
    if cfg.variant == 3:
        return gemv_workspace_bytes(cfg, m, d, f, itemsize, has_down)
    if cfg.variant == 4:
        return tma_workspace_bytes(cfg, m, d, f, itemsize, has_down)
    if cfg.variant == 2:
        return stream_workspace_bytes(cfg, m, d, f, itemsize, has_down)
    if not has_down:
        return 0
    if cfg.variant == 0:
        return m * f * itemsize
    return _COUNTER_BYTES + (cfg.num_clusters * m * d * 4 if cfg.num_clusters > 1 else 0)


# ----------------------------------------------------------------------------- configs
def parse_variant(spec: str) -> tuple[str, dict]:
    """'fused:n=16:g=2' -> ('fused', {'n': 16, 'g': 2}); ValueError naming what is wrong."""
    if not isinstance(spec, str):
        raise ValueError(f"swiglu: variant must be a string, got {spec!r}")
    up, xla_down = split_xla_down(spec)
    if xla_down:
        if up.split(":")[0] in ("auto", "xla"):
            raise ValueError(f"swiglu: {spec!r}: the stage before '{XLA_DOWN}' must be one of our "
                             f"up variants {VARIANTS[1:-1]}, got {up!r}")
        return parse_variant(up)
    name, *knobs = spec.split(":")
    if name not in VARIANTS:
        raise ValueError(f"swiglu: variant must be one of {VARIANTS} (optionally with knobs, "
                         f"e.g. 'fused:n=16'), got {spec!r}")
    if name in ("auto", "xla") and knobs:
        raise ValueError(f"swiglu: variant {name!r} takes no knobs, got {spec!r}")
    out = {}
    for knob in knobs:
        key, _, value = knob.partition("=")
        if key not in _KNOBS or not value.isdigit():
            raise ValueError(f"swiglu: bad knob {knob!r} in variant {spec!r}; knobs are "
                             f"n=, nu=, nd= (cluster sizes), rt= (16-row tiles), g= (F tiles per "
                             "exchange), c= (clusters; for 'stream' and 'tma' blocks), ku=, kd= (gemv K "
                             "chunks), p= (tma, gemv: programmatic launch of the down kernel, 0 or 1), "
                             "mma= (gemv: tensor cores, 0 or 1), wg= (tma: wgmma consumers, 0 or 1), "
                             "each an integer")
        out[key] = int(value)
    for key in ("n", "nu", "nd"):
        if key in out and out[key] not in CLUSTER_SIZES:
            raise ValueError(f"swiglu: {key}={out[key]} in {spec!r}: cluster sizes are {CLUSTER_SIZES}")
    for key in ("ku", "kd"):
        if key in out and out[key] < 1:
            raise ValueError(f"swiglu: {key}={out[key]} in {spec!r}: K chunks must be >= 1")
    for key in ("p", "mma", "wg"):
        if key in out and out[key] not in (0, 1):
            raise ValueError(f"swiglu: {key}={out[key]} in {spec!r}: {key}= is 0 or 1")
    if "rt" in out and out["rt"] not in (1, 2, 4):
        raise ValueError(f"swiglu: rt={out['rt']} in {spec!r}: row tiles are 1, 2 or 4")
    if "wg" in out and name != "tma":
        raise ValueError(f"swiglu: wg= in {spec!r} is a knob of 'tma' only")
    if out.get("wg") and out.get("rt", 4) != 4:
        raise ValueError(f"swiglu: wg=1 in {spec!r} runs 64-row tiles: rt= must be 4 (or left out)")
    if out.get("g", 1) < 1 or not 1 <= out.get("c", 1) <= 65535:
        raise ValueError(f"swiglu: g= must be >= 1 and c= in 1..65535 in {spec!r}")
    return name, out


def _default_row_tiles(rows: int) -> int:
    return 1 if rows <= 16 else 2 if rows <= 32 else 4


def _pick_clusters(tiles: int, max_clusters: int) -> int:
    """Fewest clusters that keep the most-loaded cluster's F-tile count minimal."""
    c = max(1, min(max_clusters, tiles))
    per = _ceil_div(tiles, c)
    return _ceil_div(tiles, per)


def make_config(spec: str, m: int, d: int, f: int, has_down: bool, num_sms: int) -> Config | None:
    """The concrete configuration of a variant for one shape; None when the fused kernel
    cannot hold this shape in shared memory (then use split)."""
    name, kn = parse_variant(spec)
    dblk, fblk = d // 64, f // 64
    row = name.endswith("_row")
    if name.startswith("fused") and has_down:
        rows = min(m, FUSED_MAX_ROWS)
        n = min(kn.get("n", 8), _pow2_floor(dblk))
        g = max(1, min(kn.get("g", 2), fblk))
        rt = 1 if row else kn.get("rt", _default_row_tiles(rows))
        while fused_smem(rt, g, n, d)[0] == 0 and (rt > 1 or g > 1):
            if rt > 1 and "rt" not in kn:
                rt //= 2
            elif g > 1:
                g -= 1
            else:
                break
        stages, smem = fused_smem(rt, g, n, d)
        if stages == 0:
            return None
        per_sm = 2 if smem <= _BUDGET2 else 1
        max_c = max(1, per_sm * num_sms // n)
        c = min(kn["c"], fblk) if "c" in kn else _pick_clusters(fblk, max_c)
        return Config(1, 1 if row else 0, n, 1, rt, g, c)
    if name == "gemv":
        mma = kn.get("mma", 1)
        rows = min(m, gemv_max_rows(mma))
        row_bytes = gemv_x_row_bytes(rows, mma)
        slots = gemv_blocks_per_sm(rows, mma) * num_sms
        ku = _gemv_splits(d, _ceil_div(f, _GEMV_COLS), row_bytes, slots, kn.get("ku"))
        kd = (_gemv_splits(f, _ceil_div(d, _GEMV_COLS), row_bytes, slots, kn.get("kd"))
              if has_down else 1)
        return Config(3, 0, 1, 1, 1, 1, 1, ku, kd, pdl=kn.get("p", 1), gemv_mma=mma)
    rt = 1 if row else kn.get("rt", _default_row_tiles(min(m, 64)))
    if name == "tma":  # one block per SM
        wg = kn.get("wg", 0)
        return Config(4, 0, 1, 1, 4 if wg else rt, 1, kn.get("c", num_sms), pdl=kn.get("p", 1),
                      wgmma=wg)
    if name == "stream":  # one block per resident slot: 2 per SM when the stages fit
        per_sm = 2 if tile_smem(rt)[1] <= _BUDGET2 else 1
        return Config(2, 0, 1, 1, rt, 1, kn.get("c", per_sm * num_sms))
    groups = _ceil_div(m, 16 * rt)
    target = 4 * num_sms  # blocks: a few waves of two blocks per SM
    nu = kn.get("nu", kn.get("n", _pow2_ceil(_ceil_div(target, fblk * groups))))
    nd = kn.get("nd", kn.get("n", _pow2_ceil(_ceil_div(target, _ceil_div(d, 128) * groups))))
    nu = min(nu, 16, _pow2_floor(dblk))
    nd = min(nd, 16, _pow2_floor(fblk))
    return Config(0, 1 if row else 0, nu, nd, rt, 1, 1)


def heuristic_variant(m: int, has_down: bool) -> str:
    """The fixed choice when tuning is off (JAX_CLUSTER_TUNING=0) or on CPU: our fastest
    kernel on H100 (benchmarks/results/swiglu.md, parts s20c_*): "tma" at every M. It is
    0.96-1.07x XLA's dots, 0.99-1.08x "gemv" (which is 0.5% ahead only at Llama-2-7B
    M = 1); split, stream and fused are slower. With tuning on, the scheduler measures the
    candidates against XLA's dots."""
    del m, has_down
    return "tma"


def candidates(m: int, has_down: bool) -> list[str]:
    """What the scheduler measures for one shape (XLA's dots included: never slower; with
    the down GEMM also "tma+xla", our up stage before XLA's down dot).
    Measured on H100 (benchmarks/results/swiglu.md): "stream" was 5-15% slower than
    "split" and "fused" 2.5-10x at every shape, and neither ever beat XLA, so they are not
    measured (each candidate costs a compilation and a timing at the first trace)."""
    gemv = (["gemv"] if m <= GEMV_MMA_MAX_ROWS else []) + (["gemv:mma=0"] if m <= GEMV_MAX_ROWS else [])
    if not has_down:
        return ["tma"] + gemv + ["split", "xla"]
    out = ["tma"] + gemv + ["split"]
    if m > 16:
        out += ["split_row"]
    return out + ["tma" + XLA_DOWN, "xla"]


def _m_bucket(m: int) -> int:
    return _pow2_ceil(m)


KERNEL_VERSION = 13  # bump when the kernels (or how they are timed) change: cached choices are re-measured


def tuning_key(m: int, d: int, f: int, dtype, has_down: bool) -> str:
    return (f"v{KERNEL_VERSION}|m{_m_bucket(m)}|d{d}|f{f}|{jnp.dtype(dtype).name}|"
            f"{'mlp' if has_down else 'up'}|{tuning.device_name()}")


# ----------------------------------------------------------------------------- primitive
def _abstract(x, w_gate, w_up, w_down, residual, *, variant, order, cluster_up, cluster_down,
              row_tiles, f_group, num_clusters, k_splits_up, k_splits_down, pdl, gemv_mma,
              wgmma, has_down, has_residual):
    m, d = x.shape
    f = w_gate.shape[1]
    cfg = Config(variant, order, cluster_up, cluster_down, row_tiles, f_group, num_clusters,
                 k_splits_up, k_splits_down, pdl, gemv_mma, wgmma)
    ws = workspace_bytes(cfg, m, d, f, jnp.dtype(x.dtype).itemsize, has_down)
    out_cols = d if has_down else f
    return ShapedArray((m, out_cols), x.dtype), ShapedArray((ws,), np.uint8)


def _batching(args, dims, **params):
    """vmap: fold the mapped axis into M when only x / residual are mapped; otherwise map
    over the batch sequentially."""
    x, w_gate, w_up, w_down, residual = args
    bx, bg, bu, bd, br = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if bg is None and bu is None and bd is None:
        def fold(a, d):
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
            return a.reshape((size * a.shape[1],) + a.shape[2:])

        res = fold(residual, br) if params["has_residual"] else residual
        out, ws = _PRIM.bind(fold(x, bx), w_gate, w_up, w_down, res, **params)
        return (out.reshape((size, out.shape[0] // size) + out.shape[1:]), ws), (0, None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)[0]

    out = jax.lax.map(one, jnp.arange(size))
    return (out, jnp.zeros((0,), np.uint8)), (0, None)


_PRIM = ffi_primitive("swiglu", abstract_eval=_abstract, batching_rule=_batching)

_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 132) or 132) if _on_gpu() else 132


def _bind(x2, w_gate, w_up, w_down, residual2, cfg: Config):
    has_down, has_res = w_down is not None, residual2 is not None
    empty = jnp.zeros((0,), x2.dtype)
    out, _ = _PRIM.bind(x2, w_gate, w_up, w_down if has_down else empty,
                        residual2 if has_res else empty, has_down=has_down,
                        has_residual=has_res, **cfg.attrs())
    return out


def _xla_swiglu(x2, w_gate, w_up, w_down, residual2):
    """What a JAX user writes: XLA's dots in the input dtype (fp32 accumulation inside, a
    16-bit result, as the jnp peer: an fp32-result form measured 1.15x its time on H100 at
    Llama-2-7B M=1), SiLU*mul in fp32."""
    g, u = x2 @ w_gate, x2 @ w_up
    a2 = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x2.dtype)
    return a2 if w_down is None else _xla_down(a2, w_down, residual2)


def _xla_down(a2, w_down, residual2):
    y = a2 @ w_down
    if residual2 is not None:
        y = (y.astype(jnp.float32) + residual2.astype(jnp.float32)).astype(a2.dtype)
    return y


def _apply(x2, w_gate, w_up, w_down, residual2, spec: str):
    if spec == "xla":
        return _xla_swiglu(x2, w_gate, w_up, w_down, residual2)
    up, xla_down = split_xla_down(spec)
    if xla_down:
        a2 = _apply(x2, w_gate, w_up, None, None, up)
        return a2 if w_down is None else _xla_down(a2, w_down, residual2)
    m, d = x2.shape
    f = w_gate.shape[1]
    has_down = w_down is not None
    sms = _num_sms()
    cfg = make_config(spec, m, d, f, has_down, sms)
    if cfg is None:
        _warn_once(("smem", spec, d, f), f"swiglu: variant {spec!r} does not fit D={d} in shared "
                   "memory; using 'split'")
        cfg = make_config("split", m, d, f, has_down, sms)
    chunk_rows = {1: FUSED_MAX_ROWS, 3: gemv_max_rows(cfg.gemv_mma)}.get(cfg.variant)
    if chunk_rows and m > chunk_rows:  # fused: bounded workspace; gemv: its row limit
        outs = []
        for r0 in range(0, m, chunk_rows):
            r1 = min(m, r0 + chunk_rows)
            res = None if residual2 is None else residual2[r0:r1]
            outs.append(_apply(x2[r0:r1], w_gate, w_up, w_down, res, spec))
        return jnp.concatenate(outs, axis=0)
    return _bind(x2, w_gate, w_up, w_down, residual2, cfg)


def _check(name, array, shape, dtype):
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"swiglu: {name} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    if jnp.dtype(array.dtype) != jnp.dtype(dtype):
        raise ValueError(f"swiglu: {name} has dtype {jnp.dtype(array.dtype).name}, expected "
                         f"{jnp.dtype(dtype).name} (x's dtype)")


def _validate(x, w_gate, w_up, w_down, residual, variant):
    parse_variant(variant)
    if x.ndim < 1:
        raise ValueError("swiglu: x must be [..., D], got a scalar")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16),
                                  jnp.dtype(jnp.float32)):
        raise ValueError(f"swiglu: x dtype must be float16 or bfloat16 (float32 runs the "
                         f"reference), got {jnp.dtype(x.dtype).name}")
    d = x.shape[-1]
    if w_gate.ndim != 2 or w_gate.shape[0] != d:
        raise ValueError(f"swiglu: w_gate must be [D, F] with D = x.shape[-1] = {d}, got shape "
                         f"{tuple(w_gate.shape)}")
    f = w_gate.shape[1]
    _check("w_gate", w_gate, (d, f), x.dtype)
    _check("w_up", w_up, (d, f), x.dtype)
    if w_down is not None:
        _check("w_down", w_down, (f, d), x.dtype)
    if residual is not None:
        if w_down is None:
            raise ValueError("swiglu: residual needs w_down (the up stage alone returns [..., F])")
        _check("residual", residual, x.shape, x.dtype)
    if d < 1 or f < 1:
        raise ValueError(f"swiglu: D and F must be positive, got D={d}, F={f}")
    return d, f


def resolve_variant(variant: str, m: int, d: int, f: int, dtype, has_down: bool) -> str:
    """The variant spec the op will run: `variant` itself unless it is "auto"."""
    if variant != "auto":
        return variant
    heuristic = heuristic_variant(m, has_down)
    if not _on_gpu():
        return heuristic  # nothing to tune: the CPU handler ignores the variant
    return tuning.pick("swiglu", tuning_key(m, d, f, dtype, has_down), candidates(m, has_down),
                       functools.partial(measure, m=m, d=d, f=f, dtype=dtype, has_down=has_down),
                       heuristic=heuristic)


def swiglu(x, w_gate, w_up, w_down=None, residual=None, *, variant: str = "auto"):
    """Fused SwiGLU MLP: (silu(x @ w_gate) * (x @ w_up)) @ w_down (+ residual).

    x [..., D]; w_gate, w_up [D, F]; w_down [F, D] or None (returns A2 [..., F]);
    residual [..., D] or None (added in fp32 before the single rounding of y).
    variant: see the module docstring ("auto", "split", "split_row", "fused", "fused_row",
    "stream", "gemv", "tma", "xla", optionally with knobs; "<up variant>+xla": our up stage,
    XLA's down dot).
    """
    d, f = _validate(x, w_gate, w_up, w_down, residual, variant)
    lead = tuple(x.shape[:-1])
    m = math.prod(lead)
    has_down = w_down is not None
    out_cols = d if has_down else f
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32) or d % ALIGN or f % ALIGN:
        _warn_once(("shape", d, f, jnp.dtype(x.dtype).name),
                   f"swiglu: no kernel for D={d}, F={f}, dtype={jnp.dtype(x.dtype).name} (needs "
                   "D and F multiples of 64, float16 or bfloat16); using the jnp reference")
        return reference.swiglu(x, w_gate, w_up, w_down, residual)
    if m == 0:
        return jnp.zeros(lead + (out_cols,), x.dtype)
    spec = resolve_variant(variant, m, d, f, x.dtype, has_down)
    x2 = x.reshape(m, d)
    res2 = None if residual is None else residual.reshape(m, d)
    return _apply(x2, w_gate, w_up, w_down, res2, spec).reshape(lead + (out_cols,))


# ----------------------------------------------------------------------------- measuring
def timing_inputs(m: int, d: int, f: int, dtype, *, has_down: bool = True,
                  has_residual: bool = False, seed: int = 0, l2_bytes: int = 64 << 20):
    """Fresh random inputs (x, weight copies, residual) for timing: N(0, 1) activations,
    weights scaled by 1/sqrt(fan-in), enough copies of the weights that rotating over them
    defeats the L2 cache."""
    dtype = jnp.dtype(dtype)
    wbytes = (3 if has_down else 2) * d * f * dtype.itemsize
    copies = max(1, min(8, _ceil_div(2 * l2_bytes, wbytes)))
    keys = jax.random.split(jax.random.key(seed), 3 * copies + 2)

    def normal(k, shape, scale):
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)

    x = normal(keys[0], (m, d), 1.0)
    res = normal(keys[1], (m, d), 1.0) if has_residual else None
    weights = tuple(
        (normal(keys[2 + 3 * c], (d, f), d ** -0.5), normal(keys[3 + 3 * c], (d, f), d ** -0.5),
         normal(keys[4 + 3 * c], (f, d), f ** -0.5) if has_down else None)
        for c in range(copies))
    return x, weights, res


def timing_loop(fn, inputs, *, calls: int = 24, chain: str = "fori"):
    """(jitted run(x, weights, res), calls per run): `fn(x, w_gate, w_up, w_down, residual)`
    called many times inside one jit, each call feeding the next (none is dead code),
    rotating over the weight copies of `inputs` (from timing_inputs).

    chain="fori": a lax.fori_loop over rounds of the copies, each call's output added
    into x (x + 1e-3 y: one small XLA kernel per call); chain="direct": the calls unrolled,
    each output y [M, D] IS the next call's x (no kernel but the op's own: what a chain of
    layers costs; up-only calls, whose output is not [M, D], keep the add)."""
    if chain not in ("fori", "direct"):
        raise ValueError(f"chain must be 'fori' or 'direct', got {chain!r}")
    x0, weights, _ = inputs
    reps = max(1, _ceil_div(calls, len(weights)))
    dtype = x0.dtype

    def one_round(x, weights, res):
        for wg, wu, wd in weights:
            y = fn(x, wg, wu, wd, res)
            if chain == "direct" and wd is not None:
                x = y
            else:
                feed = y if wd is not None else y[:, :1]
                x = (x.astype(jnp.float32) + 1e-3 * feed.astype(jnp.float32)).astype(dtype)
        return x

    def run(x, weights, res):
        if chain == "direct":
            for _ in range(reps):
                x = one_round(x, weights, res)
            return x
        return jax.lax.fori_loop(0, reps, lambda _, x: one_round(x, weights, res), x)

    return jax.jit(run), reps * len(weights)


def measure(spec: str, *, m: int, d: int, f: int, dtype, has_down: bool = True) -> float:
    """Seconds per call of variant `spec` on the default device (fresh random inputs)."""
    inputs = timing_inputs(m, d, f, dtype, has_down=has_down)
    # timed as the benchmark reports: calls chained directly, no harness kernel between them
    run, calls = timing_loop(lambda x, wg, wu, wd, res: swiglu(x, wg, wu, wd, res, variant=spec),
                             inputs, chain="direct")
    return tuning.time_call(run, *inputs) / calls


def autotune(m: int, d: int, f: int, dtype, *, has_down: bool = True) -> str:
    """Runs the scheduler now for one shape (e.g. at deployment warm-up); returns the
    variant that `variant="auto"` will use for it."""
    return resolve_variant("auto", m, d, f, dtype, has_down)


# ----------------------------------------------------------------------------- tensor parallel
def swiglu_tp(x, w_gate, w_up, w_down, residual=None, *, mesh, axis: str = "tp",
              variant: str = "auto", psum_dtype=None):
    """Tensor-parallel SwiGLU MLP (DeepFusionKernel App. A.1) over mesh axis `axis`.

    w_gate / w_up are split by columns and w_down by rows (P(None, axis) and P(axis, None));
    x is replicated. Each device runs the op on its F-shard (the gate/up/SiLU/down chain
    stays local) and ONE psum over `axis` combines the partial outputs (in x.dtype, or
    `psum_dtype`); the residual is added after it. F / axis size should be a multiple of
    64 for the kernels.
    """
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    if w_down is None:
        raise ValueError("swiglu_tp: w_down is required (the up stage alone needs no collective)")
    size = mesh.shape[axis]
    f = w_gate.shape[-1]
    if f % size:
        raise ValueError(f"swiglu_tp: F ({f}) must be divisible by the size of mesh axis "
                         f"{axis!r} ({size})")
    _validate(x, w_gate, w_up, w_down, residual, variant)
    out_dtype = jnp.dtype(psum_dtype) if psum_dtype is not None else jnp.dtype(x.dtype)

    def local(x, wg, wu, wd):
        y = swiglu(x, wg, wu, wd, variant=variant)
        return jax.lax.psum(y.astype(out_dtype), axis)

    spec_x = P(*([None] * x.ndim))
    y = jax.shard_map(local, mesh=mesh, in_specs=(spec_x, P(None, axis), P(None, axis), P(axis, None)),
                      out_specs=spec_x, check_vma=False)(x, w_gate, w_up, w_down)
    if residual is not None:
        y = y.astype(jnp.float32) + residual.astype(jnp.float32)
    return y.astype(x.dtype)
