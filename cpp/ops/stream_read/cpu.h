#pragma once

#include "ops/stream_read/params.h"

namespace jax_cluster::cpu {

void stream_read(const StreamReadParams& p);

}  // namespace jax_cluster::cpu
