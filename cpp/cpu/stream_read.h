#pragma once

#include "kernels/stream_read.h"

namespace jax_cluster::cpu {

void stream_read(const StreamReadParams& p);

}  // namespace jax_cluster::cpu
