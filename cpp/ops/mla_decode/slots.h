// Where slot t of row b lives in mla_decode's latent cache, and whether a row may run:
// shared by the CPU handler and the CUDA kernels (host and device).
#pragma once

#include <cstdint>

#include "ops/mla_decode/params.h"

namespace jax_cluster {

// Whether `page` is a page of the pool.
JAX_CLUSTER_HOST_DEVICE inline bool mla_decode_page_valid(const MlaDecodeParams& p, int32_t page) {
  return page >= 0 && page < p.num_pages;
}

// The token offset (in units of E features) of slot t of row b: contiguous b * S_max + t,
// paged block_table[b, t / page] * page + t % page. A page outside the pool reads as page 0,
// so that the kernels may issue a row's loads before its validity vote (an invalid row only
// gets NaN, whatever they read); a valid row never meets one.
JAX_CLUSTER_HOST_DEVICE inline int64_t mla_decode_slot_offset(const MlaDecodeParams& p, int64_t b,
                                                              int64_t t) {
  if (!p.paged) return b * p.capacity + t;
  const int32_t page = p.block_table[b * p.max_blocks + t / p.page_size];
  return static_cast<int64_t>(mla_decode_page_valid(p, page) ? page : 0) * p.page_size +
         t % p.page_size;
}

// Whether block `i` of row b names a page of the pool.
JAX_CLUSTER_HOST_DEVICE inline bool mla_decode_block_valid(const MlaDecodeParams& p, int64_t b, int64_t i) {
  return mla_decode_page_valid(p, p.block_table[b * p.max_blocks + i]);
}

// lengths[b] in [0, capacity) and, paged, every used block (0..length / page) in the pool.
JAX_CLUSTER_HOST_DEVICE inline bool mla_decode_row_valid(const MlaDecodeParams& p, int64_t b, int32_t length) {
  if (length < 0 || length >= p.capacity) return false;
  if (!p.paged) return true;
  for (int64_t i = 0; i <= length / p.page_size; ++i) {
    if (!mla_decode_block_valid(p, b, i)) return false;
  }
  return true;
}

}  // namespace jax_cluster
