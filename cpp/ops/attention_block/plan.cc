// attention_block's launch plan and constants for Python (jax_cluster._extension.plans()):
// the same functions the FFI handlers and the launcher call (plan.h), so Python validates a
// configuration, sizes the workspace and decides on a fallback without a copy of them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/attention_block/plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

nb::dict constants() {
  nb::dict norm, rope, dataflow, pipeline;
  norm["none"] = static_cast<int>(NormKind::kNone);
  norm["rms"] = static_cast<int>(NormKind::kRms);
  norm["layer"] = static_cast<int>(NormKind::kLayer);
  rope["half"] = static_cast<int>(RopeLayout::kHalf);
  rope["interleaved"] = static_cast<int>(RopeLayout::kInterleaved);
  dataflow["split_token"] = static_cast<int>(AttnDataflow::kSplitToken);
  dataflow["split_head"] = static_cast<int>(AttnDataflow::kSplitHead);
  pipeline["registers"] = static_cast<int>(AttnPipeline::kRegisters);
  pipeline["tma"] = static_cast<int>(AttnPipeline::kTma);
  nb::list sizes, pow2, head_dims;
  for (int n = 1; n <= kMaxClusterSize; ++n) {
    if (is_valid_cluster_size(n)) sizes.append(n);
    if (is_pow2_cluster_size(n)) pow2.append(n);
  }
  for (int d : kAttnCudaHeadDims) head_dims.append(d);
  nb::dict out;
  out["norm"] = norm;
  out["rope_layout"] = rope;
  out["dataflow"] = dataflow;
  out["pipeline"] = pipeline;
  out["cluster_sizes"] = nb::tuple(sizes);
  out["pow2_cluster_sizes"] = nb::tuple(pow2);
  out["cuda_head_dims"] = nb::tuple(head_dims);
  out["max_heads_per_cluster"] = kAttnMaxHeadsPerCluster;
  return out;
}

nb::dict plan(int64_t batch, int64_t hidden, int64_t head_dim, int64_t num_q_heads, int64_t num_kv_heads,
              int64_t rotary_dim, const std::string& dtype, int64_t cluster_size,
              int64_t max_heads_per_cluster, int64_t dataflow, int64_t pipeline) {
  AttentionBlockParams p{};
  p.batch = batch;
  p.hidden = hidden;
  p.head_dim = head_dim;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.rotary_dim = rotary_dim;
  p.cluster_size = static_cast<int>(cluster_size);
  p.max_heads_per_cluster = static_cast<int>(max_heads_per_cluster);
  p.dataflow = static_cast<AttnDataflow>(dataflow);
  p.pipeline = static_cast<AttnPipeline>(pipeline);
  std::string error = dtype_from_name(dtype, &p.dtype) ? attention_block_check(p) : "dtype must be float32, float16 or bfloat16";
  nb::dict out;
  out["error"] = error;
  if (!error.empty()) return out;
  out["cuda_error"] = attention_block_cuda_check(p);
  const AttentionBlockPlan plan = attention_block_plan(p);
  out["heads_per_cluster"] = plan.heads_per_cluster;
  out["head_chunks"] = plan.head_chunks;
  out["clusters"] = plan.clusters;
  out["threads"] = plan.threads;
  out["stages"] = plan.stages;
  out["shared_bytes"] = plan.shared_bytes;
  out["workspace_bytes"] = plan.workspace_bytes;
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_attention_block_plan(nb::module_& m) {
  m.def("attention_block_constants", &jax_cluster::constants,
        "attention_block's enum values (FFI attributes) and limits");
  m.def("attention_block", &jax_cluster::plan, "batch"_a, "hidden"_a, "head_dim"_a, "num_q_heads"_a,
        "num_kv_heads"_a, "rotary_dim"_a, "dtype"_a, "cluster_size"_a, "max_heads_per_cluster"_a,
        "dataflow"_a, "pipeline"_a,
        "The launch plan of one attention_block configuration: 'error' (why the step or the "
        "configuration is invalid, '' if valid), then 'cuda_error' (why the CUDA kernels cannot "
        "run it), grid, shared memory and workspace");
}
