"""Decode caches: per layer k and v [B, H_kv, S_max, head_dim], lengths[b] = tokens already
cached; the next token goes to slot lengths[b] at RoPE position lengths[b]. A layer with a
sliding window shorter than S_max keeps only the window, as a rolling buffer: position t in
slot t % window (KVCache.rolling). MLA keeps one latent per token instead: [B, 1, S_max,
kv_lora_rank + rope_dim] (one shared "KV head"), or the same rows in pages of a pool shared by
the batch (PagedLatentCache).

Caches are pytrees (jax.tree_util.register_dataclass), passed to jitted steps with donation so the
updates happen in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import attention as attn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per layer k, v [B, H_kv, slots, D]: slots = max_len, or a sliding window's `window` slots
    where that is fewer (a rolling buffer: a token at position t sits in slot t % window, and the
    slots hold exactly the window's tokens once it is full; Mistral's rolling cache)."""

    k: tuple  # per layer [B, H_kv, slots, D]
    v: tuple  # per layer [B, H_kv, slots, Dv]
    lengths: jax.Array  # [B] int32
    # Static: the tokens a row may hold (positions 0..max_len-1), and each layer's window.
    max_len: int = dataclasses.field(default=0, metadata=dict(static=True))
    windows: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @classmethod
    def create(cls, *, num_layers, batch, num_kv_heads, max_len, head_dim, dtype, v_head_dim=None, windows=()):
        """windows: per layer its sliding window or None (default: none)."""
        windows = tuple(windows) or (None,) * num_layers
        if len(windows) != num_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must hold a positive window or None per layer ({num_layers}), got {windows}")
        slots = [max_len if w is None else min(w, max_len) for w in windows]
        k = tuple(jnp.zeros((batch, num_kv_heads, n, head_dim), dtype) for n in slots)
        v = tuple(jnp.zeros((batch, num_kv_heads, n, v_head_dim or head_dim), dtype) for n in slots)
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32), max_len=max_len, windows=windows)

    def __post_init__(self):
        if not self.max_len and self.k and hasattr(self.k[0], "shape"):  # built without create()
            self.max_len = self.k[0].shape[2]

    def rolling(self, layer: int) -> bool:
        """Whether the layer's slots are its window's rolling buffer (slot = position % window).
        A window of max_len slots or more never wraps, and both layouts agree."""
        w = self.windows[layer] if layer < len(self.windows) else None
        return w is not None and self.k[layer].shape[2] == w

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentCache:
    latent: tuple  # per layer [B, 1, S_max, kv_lora_rank + rope_dim]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, *, num_layers, batch, max_len, latent_dim, dtype):
        latent = tuple(jnp.zeros((batch, 1, max_len, latent_dim), dtype) for _ in range(num_layers))
        return cls(latent=latent, lengths=jnp.zeros((batch,), jnp.int32))

    block_table = None  # contiguous rows

    @staticmethod
    def write_prompt(layer, new):
        """A layer's cache with new [B, T, E] at slots 0..T-1."""
        return attn.write_prefix(layer, new[:, :, None, :])

    @property
    def max_len(self) -> int:
        return self.latent[0].shape[2]

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.latent)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLatentCache:
    """MLA's latent cache in pages, as serving systems hold it: per layer a pool
    [num_pages, page_size, E] shared by the batch, and a block table [B, max_blocks]: slot t of
    row b is offset t % page_size of page block_table[b, t // page_size]. Rows may share the
    pages a common prompt prefix fills whole (both rows write the same values there); any
    other slot two rows share would be written by both. Decode steps write
    slot lengths[b] of each row and read slots 0..lengths[b]; jax_cluster.mla_decode takes the
    pool and the table as they are (docs/mla_decode.md)."""

    latent: tuple  # per layer [num_pages, page_size, E]
    block_table: jax.Array  # [B, max_blocks] int32
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, *, num_layers, batch, max_len, latent_dim, dtype, page_size, block_table=None, num_pages=None):
        """A pool of num_pages pages (default: every row's own max_len slots) per layer and a
        block table (default: row b's blocks are pages b * max_blocks ..., in order)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        blocks = -(-max_len // page_size)
        if block_table is None:
            block_table = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
        table = np.asarray(block_table)  # concrete: a cache is built outside jit
        if table.ndim != 2 or table.shape[0] != batch or table.shape[1] < 1:
            raise ValueError(f"block_table must be [batch={batch}, max_blocks >= 1], got {table.shape}")
        if num_pages is None:
            num_pages = int(table.max()) + 1
        if table.min() < 0 or table.max() >= num_pages:
            raise ValueError(f"block_table names pages outside the pool of {num_pages}: "
                             f"{int(table.min())}..{int(table.max())}")
        latent = tuple(jnp.zeros((num_pages, page_size, latent_dim), dtype) for _ in range(num_layers))
        return cls(latent=latent, block_table=jnp.asarray(table, jnp.int32), lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.latent)

    def write_prompt(self, layer, new):
        """A layer's pool with new [B, T, E] at slots 0..T-1 of each row."""
        t = new.shape[1]
        pos = jnp.arange(t)
        pages = self.block_table[:, pos // self.page_size]  # [B, T]
        return layer.at[pages, pos % self.page_size].set(new.astype(layer.dtype), mode="drop")
