// Launch helpers shared by every kernel family: cluster launches through
// cudaLaunchKernelEx (the only way to get clusters of 16, and the only launch
// whose configuration errors are reported synchronously), with the one-time
// function attributes (large dynamic shared memory, non-portable clusters).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

namespace jax_cluster {

#define JAX_CLUSTER_CUDA_RETURN_IF_ERROR(expr) \
  do {                                          \
    cudaError_t _err = (expr);                  \
    if (_err != cudaSuccess) return _err;       \
  } while (0)

// Sets a kernel's attributes once per device (not per call: the decode path must do no
// host work beyond the launch). Function attributes belong to a device's context: one
// process driving several GPUs (a jax mesh) must set them on each, or the second GPU's
// launch fails for lack of its large shared-memory opt-in (seen on 2x H200: the other
// GPU then waited forever in the next collective).
inline cudaError_t configure_kernel_once(const void* kernel) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;  // (device, kernel)
  int device = 0, optin = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  if (done.count({device, kernel})) return cudaSuccess;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attrs;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attrs, kernel));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      optin - static_cast<int>(attrs.sharedSizeBytes)));
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  done.insert({device, kernel});
  return cudaSuccess;
}

// How many blocks of `kernel` (threads, dynamic shared memory smem) the current device holds
// at once: the largest grid whose blocks may wait on each other (a persistent kernel whose
// blocks spin on other blocks' counters). Queried once per (device, kernel).
inline cudaError_t resident_blocks(const void* kernel, int threads, size_t smem, int* blocks) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> known;
  int device = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find({device, kernel});
  if (it == known.end()) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(configure_kernel_once(kernel));
    int per_sm = 0, sms = 0;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    it = known.emplace(std::make_pair(device, kernel), per_sm * sms).first;
  }
  *blocks = it->second;
  return *blocks > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
}

// cudaLaunchKernelEx's configuration (also what occupancy queries take).
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                        cudaLaunchAttribute* attrs, unsigned num_attrs) {
  // gridDim, blockDim, dynamicSmemBytes, stream, attrs, numAttrs: the fields in their order.
  return cudaLaunchConfig_t{grid, block, smem, stream, attrs, num_attrs};
}

// One launch through cudaLaunchKernelEx with the given launch attributes (after the
// kernel's one-time configuration); its return code and the last error checked.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, cudaLaunchAttribute* attrs, unsigned num_attrs,
                      Args&&... args) {
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(configure_kernel_once(reinterpret_cast<const void*>(kernel)));
  cudaLaunchConfig_t config = launch_config(grid, block, smem, stream, attrs, num_attrs);
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(
      cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  return cudaGetLastError();
}

// Clusters of cluster_size blocks along x.
inline cudaLaunchAttribute cluster_attribute(int cluster_size) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_size;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// How many clusters of `cluster_size` blocks of `kernel` the current device runs at once
// (its GPCs hold whole clusters only: 16 clusters of 8 do not fit an H100's 132 SMs).
// Queried once per (device, kernel, cluster size).
inline cudaError_t resident_clusters(const void* kernel, int threads, size_t smem,
                                     int cluster_size, int* clusters) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int>, int> known;
  int device = 0;
  JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find({device, kernel, cluster_size});
  if (it == known.end()) {
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(configure_kernel_once(kernel));
    cudaLaunchAttribute attr = cluster_attribute(cluster_size);
    const cudaLaunchConfig_t config =
        launch_config(dim3(cluster_size), dim3(threads), smem, nullptr, &attr, 1);
    int n = 0;
    JAX_CLUSTER_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&n, kernel, &config));
    it = known.emplace(std::make_tuple(device, kernel, cluster_size), n).first;
  }
  *clusters = it->second;
  return cudaSuccess;
}

// grid.x must be a multiple of cluster_size; blocks b..b+N-1 form a cluster.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_cluster(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                           int cluster_size, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr = cluster_attribute(cluster_size);
  return launch_ex(kernel, grid, block, smem, stream, &attr, 1, std::forward<Args>(args)...);
}

// JAX_CLUSTER_PDL=0 turns programmatic launches off for the process (read once): for
// tools that do not follow them (compute-sanitizer's racecheck crashed on an H100 as soon
// as attention_block's kernels were launched programmatically).
inline bool programmatic_launches_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("JAX_CLUSTER_PDL");
    return env == nullptr || env[0] != '0';
  }();
  return enabled;
}

// launch_cluster, launched programmatically (PDL; see launch_programmatic).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_cluster_programmatic(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                        size_t smem, int cluster_size, cudaStream_t stream,
                                        Args&&... args) {
  cudaLaunchAttribute attrs[2] = {cluster_attribute(cluster_size), {}};
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  return launch_ex(kernel, grid, block, smem, stream, attrs,
                   programmatic_launches_enabled() ? 2u : 1u, std::forward<Args>(args)...);
}

// A plain (cluster-less) launch through cudaLaunchKernelEx. programmatic: programmatic
// dependent launch (PDL): the kernel may be scheduled while the previous kernel of the
// stream still runs (once that one's blocks called ptx::griddep_launch_dependents() or
// exited) and must call ptx::griddep_wait() before it touches that kernel's results.
// Captured into CUDA graphs as a programmatic edge.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                                bool programmatic, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return launch_ex(kernel, grid, block, smem, stream, &attr,
                   programmatic && programmatic_launches_enabled() ? 1u : 0u,
                   std::forward<Args>(args)...);
}

}  // namespace jax_cluster
