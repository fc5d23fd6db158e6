// launch.cuh: host launch helpers: what the GPU and a compiled kernel hold (asked once,
// remembered), grid sizes, dependent and cluster launches (sm_90).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "device.cuh"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Launch geometry.

// Values computed once per key and remembered: launch geometry asks the driver about the
// GPU and a compiled kernel, whose answers never change (each query costs about a
// microsecond). The lock makes it safe when several host threads launch at once.
template <typename Key, typename Value>
class Remembered {
 public:
  template <typename Compute>
  Value get(const Key& key, Compute compute) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = values_.find(key);
    if (found != values_.end()) return found->second;
    return values_[key] = compute();
  }

 private:
  std::mutex mutex_;
  std::map<Key, Value> values_;
};

inline int multiprocessor_count(int device) {
  static Remembered<int, int> counts;
  return counts.get(device, [&] {
    int count = 0;
    cuda_check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    return count;
  });
}

// Blocks of `kernel` with `threads` threads and `dynamic_smem` bytes of dynamic shared
// memory that one multiprocessor of `device` (the current device) holds at once (its
// registers and shared memory decide). Per device: GPUs of different architectures in one
// machine hold different numbers.
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, int device, size_t dynamic_smem) {
  static Remembered<std::tuple<const void*, int, int, size_t>, int> blocks_per_sm;
  return blocks_per_sm.get({reinterpret_cast<const void*>(kernel), threads, device, dynamic_smem}, [&] {
    int blocks = 0;
    cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, dynamic_smem),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return std::max(blocks, 1);
  });
}

// A grid-stride launch of `kernel` over `work_items` items with `threads` per block: as
// many blocks as the GPU holds at once (one wave, no ragged tail), no more than the work
// needs.
template <typename Kernel>
int64_t grid_for(Kernel kernel, int64_t work_items, int threads, int device, size_t dynamic_smem = 0) {
  const int64_t resident =
      int64_t(multiprocessor_count(device)) * resident_blocks_per_sm(kernel, threads, device, dynamic_smem);
  const int64_t needed = (work_items + threads - 1) / threads;
  return std::max<int64_t>(1, std::min(resident, needed));
}

// The most dynamic shared memory one block of `kernel` can have on `device` (what is left
// of the multiprocessor's beside the kernel's static shared memory), a multiple of 16
// bytes; the kernel is allowed to take that much (beyond 48 KB it must ask). Once per
// kernel and device.
template <typename Kernel>
size_t max_dynamic_smem(Kernel kernel, int device) {
  static Remembered<std::pair<const void*, int>, size_t> budgets;
  return budgets.get({reinterpret_cast<const void*>(kernel), device}, [&] {
    int per_block = 0;
    cuda_check(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute");
    cudaFuncAttributes attributes;
    cuda_check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
    const size_t budget =
        std::max<int64_t>(0, int64_t(per_block) - int64_t(attributes.sharedSizeBytes)) / 16 * 16;
    cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(budget)),
               "cudaFuncSetAttribute");
    return budget;
  });
}

// ---------------------------------------------------------------------------------
// sm_90 (CUDA 12 or later): clusters and dependent launches (sm90.cuh: the copy engine
// and the cluster's shared memory). Elsewhere (sm_80, or a CUDA 11.8 build)
// sm90_supported is false, and the launchers do not use kernels that need them.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDACC_VER_MAJOR__) && __CUDACC_VER_MAJOR__ >= 12
#define FUSED_LOSSES_SM90 1
#else
#define FUSED_LOSSES_SM90 0
#endif

// Host side: whether this build can use sm_90's features on `device`.
inline bool sm90_supported(int device) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  static Remembered<int, bool> supported;
  return supported.get(device, [&] {
    int major = 0;
    cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    return major >= 9;
  });
#else
  return false;
#endif
}

// Every kernel here begins with this, before its first access to global memory. On sm_90
// launch_kernel lets a kernel's blocks start while the kernel before it in the stream
// finishes (a dependent launch), which hides the launch's 1.5-2 us behind the previous
// kernel's last blocks (notes, v25); this waits until that kernel has completed and its
// writes are visible. Elsewhere, and for a normal launch, it returns at once.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if FUSED_LOSSES_SM90
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The kernel launched next in the stream, where a dependent launch, may start now rather than as
// this kernel's blocks end (its own wait_for_previous_kernel still waits for this kernel to complete).
__device__ __forceinline__ void start_next_kernel() {
#if FUSED_LOSSES_SM90
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `stream` is being captured into a CUDA graph.
inline bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
// A launch of `blocks` blocks in clusters of `cluster_blocks` (blocks a multiple of it)
// when that is more than 1, and a dependent launch when `dependent`. `config` points into
// `attributes`: not copyable.
struct LaunchConfig {
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attributes[2] = {};

  LaunchConfig(int64_t blocks, int cluster_blocks, int threads, size_t dynamic_smem, cudaStream_t stream,
               bool dependent) {
    config.gridDim = dim3(static_cast<unsigned>(blocks));
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = dynamic_smem;
    config.stream = stream;
    config.attrs = attributes;
    if (cluster_blocks > 1) {
      attributes[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
      attributes[config.numAttrs++].val.clusterDim = {static_cast<unsigned>(cluster_blocks), 1, 1};
    }
    if (dependent) {
      attributes[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attributes[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};
#endif

// Clusters of `cluster_blocks` blocks of `kernel` that `device` holds at once (0: none).
template <typename Kernel>
int64_t resident_clusters_of(Kernel kernel, int cluster_blocks, int threads, int device, size_t dynamic_smem) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  static Remembered<std::tuple<const void*, int, int, int, size_t>, int64_t> clusters;
  return clusters.get({reinterpret_cast<const void*>(kernel), cluster_blocks, threads, device, dynamic_smem}, [&] {
    const LaunchConfig launch(cluster_blocks, cluster_blocks, threads, dynamic_smem, nullptr, false);
    int count = 0;
    cuda_check(cudaOccupancyMaxActiveClusters(&count, kernel, &launch.config), "cudaOccupancyMaxActiveClusters");
    return int64_t(count);
  });
#else
  return 0;
#endif
}

// Launches kernel<<<blocks, threads, dynamic_smem, stream>>>(args...) on `device` (the
// current one), in clusters of `cluster_blocks` blocks (blocks a multiple of it) when that is
// more than 1. On sm_90 a dependent launch (wait_for_previous_kernel), except on a stream
// being captured into a CUDA graph: graphs take dependent launches only from CUDA 12.3 on.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), int64_t blocks, int threads, size_t dynamic_smem,
                   int cluster_blocks, int device, cudaStream_t stream, Args&&... args) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  const bool dependent = sm90_supported(device) && !is_capturing(stream);
  if (dependent || cluster_blocks > 1) {
    const LaunchConfig launch(blocks, cluster_blocks, threads, dynamic_smem, stream, dependent);
    cuda_check(cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...), "a kernel launch");
    return;
  }
#else
  check(cluster_blocks == 1, "internal error: a cluster launch in a build without clusters (CUDA < 12)");
#endif
  kernel<<<blocks, threads, dynamic_smem, stream>>>(std::forward<Args>(args)...);
  cuda_check(cudaGetLastError(), "a kernel launch");
}

}  // namespace fused_losses
