// flash_attention's limits for Python (jax_cluster._extension.plans()): which shapes have a
// CUDA kernel and how many chunks one launch takes, defined once in params.h.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "ops/flash_attention/params.h"

namespace nb = nanobind;

void bind_flash_attention_plan(nb::module_& m) {
  using namespace jax_cluster;
  m.def("flash_attention_max_chunks", [] { return std::make_pair(kFlashMaxQChunks, kFlashMaxKVChunks); },
        "(query chunks, KV chunks) one launch takes.");
  m.def(
      "flash_attention_cuda_supports",
      [](int64_t head_dim, const std::string& dtype) {
        DType t;
        if (!dtype_from_name(dtype, &t)) throw std::invalid_argument("unknown dtype " + dtype);
        return flash_attention_cuda_supports(head_dim, t);
      },
      nb::arg("head_dim"), nb::arg("dtype"), "Whether a CUDA kernel covers this head dim and dtype.");
}
