// moe_decode's launch plan for Python (jax_cluster._extension.plans().moe_decode*): the
// defaults of the launch fields, the checks both FFI handlers apply (moe_decode_check,
// moe_decode_cuda_check) and the workspace size, computed here once.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/plan_util.h"
#include "ops/moe_decode/params.h"
#include "ops/moe_decode/route.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_cluster {
namespace {

nb::dict plan(int64_t n, int64_t h, int64_t i, int64_t e, int64_t k, const std::string& dtype,
              int64_t cols_up, int64_t cols_down, int64_t i_s) {
  MoeDecodeParams p{};
  const bool known_dtype = dtype_from_name(dtype, &p.dtype);
  p.n = n;
  p.h = h;
  p.i = i;
  p.e = e;
  p.k = k;
  p.i_s = i_s;
  // 0: the default; other values reach the check as given (out of int range: -1)
  const auto knob = [&](int64_t v, int64_t extent) {
    return v == 0 ? moe_decode_default_cols(extent, n, k, e, i_s, i) : v > 0 && v <= 1024 ? static_cast<int>(v) : -1;
  };
  p.cols_up = knob(cols_up, i);
  p.cols_down = knob(cols_down, h);
  nb::dict out;
  std::string error = known_dtype ? moe_decode_check(p) : "dtype must be float32, float16 or bfloat16, got " + dtype;
  out["error"] = error;
  out["cuda_error"] = known_dtype ? moe_decode_cuda_check(p) : error;
  out["cols_up"] = int64_t{p.cols_up};
  out["cols_down"] = int64_t{p.cols_down};
  out["workspace_bytes"] = error.empty() ? moe_decode_workspace_bytes(n, k, h, i, i_s, p.dtype) : int64_t{0};
  return out;
}

int64_t workspace_bytes(int64_t n, int64_t k, int64_t h, int64_t i, const std::string& dtype, int64_t i_s) {
  DType t;
  if (!dtype_from_name(dtype, &t) || n < 0 || k < 0 || h < 0 || i < 1 || i_s < 0) return 0;
  return moe_decode_workspace_bytes(n, k, h, i, i_s, t);
}

nb::dict route_plan(int64_t n, int64_t h, int64_t e, int64_t k, const std::string& dtype,
                    const std::string& router_dtype, bool group_limited, int64_t n_group, int64_t topk_group,
                    bool noaux_tc, bool has_norm) {
  MoeRouteParams p{};
  static const char given = 0;  // the checks ask only whether a norm is given
  p.norm = has_norm ? &given : nullptr;
  const bool known = dtype_from_name(dtype, &p.dtype) && dtype_from_name(router_dtype, &p.router_dtype);
  p.n = n;
  p.h = h;
  p.e = e;
  p.k = k;
  p.group_limited = group_limited;
  p.noaux_tc = noaux_tc;
  p.n_group = n_group;
  p.topk_group = topk_group;
  nb::dict out;
  const std::string error = known ? moe_route_check(p) : "dtypes must be float32, float16 or bfloat16";
  out["error"] = error;
  out["cuda_error"] = known ? moe_route_cuda_check(p) : error;
  out["workspace_bytes"] = error.empty() ? moe_route_workspace_bytes(n, h, e, p.router_dtype) : int64_t{0};
  return out;
}

}  // namespace
}  // namespace jax_cluster

void bind_moe_decode_plan(nb::module_& m) {
  using namespace jax_cluster;
  m.attr("MOE_DECODE_ALIGN") = kMoeDecodeAlign;
  m.attr("MOE_DECODE_MAX_EXPERTS") = kMoeDecodeMaxExperts;
  m.def("moe_decode", &plan, "n"_a, "h"_a, "i"_a, "e"_a, "k"_a, "dtype"_a, "cols_up"_a = 0,
        "cols_down"_a = 0, "i_s"_a = 0,
        "moe_decode's checks for one call: 'error' (why neither handler takes it, '' if both "
        "do), 'cuda_error' (why the CUDA kernels cannot run it), the resolved column tiles "
        "(0: the default) and the workspace bytes (i_s: the shared experts' width, 0: none)");
  m.def("moe_route", &route_plan, "n"_a, "h"_a, "e"_a, "k"_a, "dtype"_a, "router_dtype"_a, "group_limited"_a,
        "n_group"_a, "topk_group"_a, "noaux_tc"_a = false, "has_norm"_a = false,
        "moe_route's checks for one call: 'error', 'cuda_error' and the workspace bytes");
  m.def("moe_decode_workspace_bytes", &workspace_bytes, "n"_a, "k"_a, "h"_a, "i"_a, "dtype"_a, "i_s"_a = 0,
        "Workspace bytes of a call of N rows, k slots, hidden H, expert intermediate I, shared "
        "experts of width i_s (0: none).");
}
