// What the launch-plan bindings (cpp/ops/<op>/plan.cc) share: Python passes dtypes by their
// numpy names.
#pragma once

#include <string>

#include "jax_cluster/types.h"

namespace jax_cluster {

// "float32" / "float16" / "bfloat16" -> *dtype; false (dtype untouched) for another name.
inline bool dtype_from_name(const std::string& name, DType* dtype) {
  if (name == "float32") *dtype = DType::kF32;
  else if (name == "float16") *dtype = DType::kF16;
  else if (name == "bfloat16") *dtype = DType::kBF16;
  else return false;
  return true;
}

}  // namespace jax_cluster
