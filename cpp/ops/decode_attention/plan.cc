// decode_attention's checks and workspace for Python (jax_cluster._extension.plans()): the
// functions the FFI handlers call (params.h), so Python needs no copy of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/decode_attention/params.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

nb::dict plan(int64_t batch, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t max_seq,
              const std::string& dtype, int64_t splits, bool append, int64_t rotary_dim) {
  DecodeAttentionParams p{};
  const bool known_dtype = dtype_from_name(dtype, &p.dtype);
  p.batch = batch;
  p.num_kv_heads = num_kv_heads;
  p.group = group;
  p.head_dim = head_dim;
  p.max_seq = max_seq;
  p.splits = splits;
  static const float kNotRead = 0.f;  // marks append mode; never dereferenced here
  p.qkv = append ? &kNotRead : nullptr;
  p.rotary_dim = rotary_dim;
  nb::dict out;
  out["error"] = decode_attention_check(p);
  out["cuda_error"] =
      known_dtype ? decode_attention_cuda_check(p) : std::string("dtype must be float32, float16 or bfloat16");
  out["workspace_floats"] = decode_attention_workspace_floats(p);
  out["tensor_cores"] = decode_attention_uses_tensor_cores(p);
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_decode_attention_plan(nb::module_& m) {
  m.def("decode_attention_constants", [] {
    nb::dict out;
    out["max_group"] = jax_cluster::kDecodeAttentionMaxGroup;
    out["max_splits"] = jax_cluster::kDecodeAttentionMaxSplits;
    return out;
  });
  m.def("decode_attention", &jax_cluster::plan, "batch"_a, "num_kv_heads"_a, "group"_a, "head_dim"_a,
        "max_seq"_a, "dtype"_a, "splits"_a, "append"_a = false, "rotary_dim"_a = 0,
        "decode_attention's checks for one call: 'error' (sizes out of range, '' if valid), "
        "'cuda_error' (why the CUDA kernels cannot run it), the workspace");
}
