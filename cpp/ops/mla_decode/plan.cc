// mla_decode's checks and workspace for Python (jax_cluster._extension.plans()): the
// functions the FFI handlers call (params.h), so Python needs no copy of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/mla_decode/params.h"
#include "ops/mla_decode/projections.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

nb::dict plan(int64_t batch, int64_t num_heads, int64_t rank, int64_t rope_dim, int64_t capacity,
              const std::string& dtype, int64_t splits, bool paged) {
  MlaDecodeParams p{};
  const bool known_dtype = dtype_from_name(dtype, &p.dtype);
  p.batch = batch;
  p.num_heads = num_heads;
  p.rank = rank;
  p.rope_dim = rope_dim;
  p.capacity = capacity;
  p.splits = splits;
  p.paged = paged;
  p.page_size = p.max_blocks = p.num_pages = 1;  // only their presence is checked here
  nb::dict out;
  out["error"] = mla_decode_check(p);
  out["cuda_error"] = known_dtype ? mla_decode_cuda_check(p) : std::string("dtype must be float32, float16 or bfloat16");
  out["workspace_floats"] = mla_decode_workspace_floats(p);
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_mla_decode_plan(nb::module_& m) {
  m.def("mla_decode_constants", [] {
    nb::dict out;
    out["max_splits"] = jax_cluster::kMlaDecodeMaxSplits;
    out["head_tile"] = jax_cluster::kMlaDecodeHeadTile;
    out["tile_tokens"] = jax_cluster::kMlaDecodeTileTokens;
    out["cluster_blocks"] = jax_cluster::kMlaClusterBlocks;
    out["projection_max_rows"] = jax_cluster::kMlaProjectMaxRows;
    out["counter_words"] = jax_cluster::kMlaCounterWords;
    return out;
  });
  m.def(
      "mla_projections",
      [](const std::string& dtype, int64_t batch, int64_t hidden, int64_t q_in, int64_t nope, int64_t rope,
         int64_t rank, int64_t v_dim) {
        jax_cluster::DType t{};
        nb::dict out;
        const bool known = jax_cluster::dtype_from_name(dtype, &t);
        out["error"] = jax_cluster::mla_projections_check(t, batch, hidden, q_in, nope, rope, rank, v_dim, false);
        out["cuda_error"] = known ? jax_cluster::mla_projections_check(t, batch, hidden, q_in, nope, rope, rank, v_dim, true)
                                  : std::string("dtype must be float32, float16 or bfloat16");
        return out;
      },
      "dtype"_a, "batch"_a, "hidden"_a, "q_in"_a, "nope"_a, "rope"_a, "rank"_a, "v_dim"_a,
      "mla_decode's projection kernels' checks: 'error' (every platform), 'cuda_error' (the GPU kernels)");
  m.def("mla_decode", &jax_cluster::plan, "batch"_a, "num_heads"_a, "rank"_a, "rope_dim"_a, "capacity"_a,
        "dtype"_a, "splits"_a, "paged"_a,
        "mla_decode's checks for one call: 'error' (sizes out of range, '' if valid), 'cuda_error' "
        "(why the CUDA kernels cannot run it), the workspace");
}
