// decoder_layer's checks and workspace for Python (jax_cluster._extension.plans()): the
// functions the FFI handlers call, so Python needs no copy of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/decoder_layer/params.h"
#include "ops/decoder_layer/plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

nb::dict plan(int64_t batch, int64_t hidden, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
              int64_t max_seq, int64_t inter, int64_t mlp, bool parallel_residual, const std::string& dtype) {
  DecoderLayerParams p{};
  const bool known_dtype = dtype_from_name(dtype, &p.dtype);
  p.batch = batch;
  p.hidden = hidden;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.max_seq = max_seq;
  p.inter = inter;
  p.rotary_dim = 0;
  p.norm = NormKind::kRms;
  p.mlp = static_cast<MlpKind>(mlp);
  p.parallel_residual = parallel_residual;
  const std::string error = decoder_layer_check(p);
  nb::dict out;
  out["error"] = error;
  out["cuda_error"] = known_dtype ? decoder_layer_cuda_check(p) : std::string("dtype must be float16 or bfloat16");
  out["workspace_floats"] = error.empty() ? decoder_layer_workspace_floats(p) : int64_t{0};
  out["timeline_offset"] = error.empty() ? plan_decoder_layer(p, 1).timeline : int64_t{0};
  out["timeline_marks"] = kLayerTimelineMarks;
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_decoder_layer_plan(nb::module_& m) {
  m.def("decoder_layer", &jax_cluster::plan, "batch"_a, "hidden"_a, "num_q_heads"_a, "num_kv_heads"_a,
        "head_dim"_a, "max_seq"_a, "inter"_a, "mlp"_a, "parallel_residual"_a, "dtype"_a,
        "decoder_layer's checks for one call: 'error' (sizes out of range, '' if valid), 'cuda_error' (why "
        "the one-launch kernel cannot run it: auto then runs the per-op path), the workspace");
}
