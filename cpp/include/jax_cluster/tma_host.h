// Host side of the bulk tensor copies: CUtensorMap encoding through the driver entry point
// the CUDA runtime hands out (no link against the driver library). Pure host work, no
// device access: encoding per call is command-buffer safe (the map is a kernel argument).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <mutex>

#include "jax_cluster/types.h"

namespace jax_cluster {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
  });
  return fn;
}

// A tiled map over a row-major tensor of `rank` dims (dims[0] innermost, contiguous;
// strides_bytes[i] = bytes between consecutive indices of dim i + 1, multiples of 16),
// boxes of box[i] elements per dim. Returns cudaErrorInvalidValue when the driver refuses
// (unaligned base or strides, box too large) so the launcher reports it. promotion: the
// granularity at which L2 fetches the box's rows; wider than a box row fetches bytes that
// only a later (or another block's) box may use: 128B for narrow boxes of streamed data.
inline cudaError_t encode_tensor_map(
    CUtensorMap* map, DType dtype, const void* base, int rank, const uint64_t* dims,
    const uint64_t* strides_bytes, const uint32_t* box,
    CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE,
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUtensorMapDataType type = dtype == DType::kF32   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r =
      encode(map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims,
             strides_bytes, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
             promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The common case: a 2-D row-major matrix [rows, cols] (cols contiguous), boxes of
// [box_rows, box_cols].
inline cudaError_t encode_matrix_map(
    CUtensorMap* map, DType dtype, const void* base, int64_t rows, int64_t cols,
    uint32_t box_rows, uint32_t box_cols, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE,
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(cols) * dtype_size(dtype)};
  const uint32_t boxes[2] = {box_cols, box_rows};
  return encode_tensor_map(map, dtype, base, 2, dims, strides, boxes, swizzle, promotion);
}

}  // namespace jax_cluster
