// common.cuh: device helpers and launchers shared by every loss kernel.
//
// Everything here serves a memory-bound loss: 16-byte vector access, fp32 math (fp64
// for float64 inputs), reductions without float atomics, and 64-bit indexing.
//
// Scalar reductions are deterministic to the bit: every block writes one partial sum,
// then the kernel's last block adds the partials in a fixed order (see Finish). The grid
// size depends only on the problem size and the GPU, so the same inputs give the same
// bits run after run.
//
// Includes stay within c10/ATen headers that ship with torch: the CUDA toolkit on
// some machines has no cuBLAS/cuSPARSE headers, which ATen/cuda/CUDAContext.h needs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "ops.h"

namespace fused_losses {

// Reduction codes; losses.py holds the same table (REDUCTION_CODES).
enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2, kBatchMean = 3 };

// Loss sums accumulate in double: a per-thread fp32 running sum over millions of
// terms would lose digits that torch's tree reduction keeps, and one double add per
// 16-byte pack costs nothing next to the memory traffic.
using sum_t = double;

constexpr int kMaxThreads = 512;

// ---------------------------------------------------------------------------------
// Math in the accumulation type (float for half/bfloat16/float, double for double).
// load_inline defines __CUDA_NO_HALF_OPERATORS__, so half values are converted first.

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
// exp and log of values that came from, or go to, a 2-byte dtype (half, bfloat16): the
// hardware's approximations (about 2^-21 relative error) are invisible at 2^-11 output
// precision and several times cheaper. Wider dtypes get the correctly rounded ones.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x by the hardware, results below 2^-126 flushed to 0. exp2f compiles to the same
// instruction plus three more per call that scale subnormal results (a compare, two
// predicated multiplies): a third of a softmax's instructions per logit on the 2-byte
// cross-entropy paths, which were bound by instruction issue (notes, v16 and v20).
// A flushed term is below 2^-126 of the largest one in its sum or gradient: float16
// cannot hold it, and bfloat16 only as a subnormal 2^-126 below its row's scale.
__device__ __forceinline__ float exp2_flush_subnormal(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ at::opmath_type<T> exp_for(at::opmath_type<T> x) {
  if constexpr (sizeof(T) == 2) {
    return exp2_flush_subnormal(x * kLog2e);
  } else {
    return exp_acc(x);
  }
}

// exp(x - m) for a softmax over T: with 2-byte T, 2^(x log2e - m log2e), one fused
// multiply-add per value once m log2e is known (the subtraction and the multiply
// were two). The rounding of m log2e shifts every term of a row alike, by at most
// |m| 2^-24 in the exponent, the size of the rounding of lse = max + log(sum) itself.
template <typename T>
__device__ __forceinline__ at::opmath_type<T> exp_minus(at::opmath_type<T> x, at::opmath_type<T> m) {
  if constexpr (sizeof(T) == 2) {
    return exp2_flush_subnormal(fmaf(x, kLog2e, -(m * kLog2e)));
  } else {
    return exp_acc(x - m);
  }
}

template <typename T>
__device__ __forceinline__ at::opmath_type<T> log_for(at::opmath_type<T> x) {
  if constexpr (sizeof(T) == 2) {
    return __logf(x);
  } else {
    return log_acc(x);
  }
}

// The larger of two values; NaN loses (as fmaxf), so a NaN must reach results another way.
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }

template <typename acc_t>
__device__ __forceinline__ acc_t infinity() {
  return std::numeric_limits<acc_t>::infinity();
}

template <typename acc_t>
__device__ __forceinline__ acc_t quiet_nan() {
  return std::numeric_limits<acc_t>::quiet_NaN();
}

// ---------------------------------------------------------------------------------
// Vector access: VEC elements moved as one aligned load/store (16 bytes when VEC is
// 16 / sizeof(T); VEC == 1 is the fallback for misaligned or odd-sized data).

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T val[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* ptr) {
  return *reinterpret_cast<const Pack<T, VEC>*>(ptr);
}

// A 16-byte load of read-only data that asks L2 to fetch the whole 256-byte block around
// it (sm_80 and later; a plain load elsewhere). Where few bytes are in flight per block,
// L2 then runs ahead of the loads: cross-entropy rows streamed by blocks (notes, v33).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack_l2_block(const T* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(Pack<T, VEC>) == 16) {
    uint4 v;
    asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr));
    return *reinterpret_cast<const Pack<T, VEC>*>(&v);
  }
#endif
  return load_pack<T, VEC>(ptr);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T, VEC>& pack) {
  *reinterpret_cast<Pack<T, VEC>*>(ptr) = pack;
}

// A store marked evict-first (st.global.cs): for output that nothing here reads again.
template <typename T, int VEC>
__device__ __forceinline__ void store_pack_streaming(T* ptr, const Pack<T, VEC>& pack) {
  if constexpr (sizeof(pack) == 16) {
    __stcs(reinterpret_cast<int4*>(ptr), *reinterpret_cast<const int4*>(&pack));
  } else {
    store_pack<T, VEC>(ptr, pack);
  }
}

// Elements per 16-byte vector of T.
template <typename T>
constexpr int vec16() {
  return 16 / sizeof(T);
}

// Host and device: launchers and kernels find a pointer's offset the same way.
__host__ __device__ inline uintptr_t offset_from_16_bytes(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16;
}

inline bool is_aligned16(const void* ptr) {
  return offset_from_16_bytes(ptr) == 0;
}

// A contiguous tensor of `like`'s shape and dtype whose data starts `offset` bytes past a
// 16-byte boundary (a multiple of the element size): a few elements more are allocated
// (the allocator's blocks start aligned) and viewed from there.
inline at::Tensor empty_at_offset(const at::Tensor& like, uintptr_t offset) {
  if (offset == 0) return at::empty(like.sizes(), like.options());
  const int64_t element = like.element_size();
  return at::empty({like.numel() + 16 / element}, like.options())
      .narrow(0, static_cast<int64_t>(offset) / element, like.numel())
      .view(like.sizes());
}

// `tensor` (contiguous) itself when it starts `offset` bytes past a 16-byte boundary,
// else a copy that does.
inline at::Tensor at_offset(const at::Tensor& tensor, uintptr_t offset) {
  if (offset_from_16_bytes(tensor.data_ptr()) == offset) return tensor;
  return empty_at_offset(tensor, offset).copy_(tensor);
}

// ---------------------------------------------------------------------------------
// Reductions. block_allreduce gives every thread the result; blockDim.x must be a
// multiple of 32 and at most 1024 (one scratch slot per warp).

__device__ __forceinline__ float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ double shfl_xor(double v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ long long shfl_xor(long long v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

template <typename T>
struct SumOp {
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return max_acc(a, b); }
};

template <typename T, typename Combine>
__device__ __forceinline__ T warp_allreduce(T value, Combine combine) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) value = combine(value, shfl_xor(value, mask));
  return value;
}

// `scratch` is shared memory for 32 values. Ends with a barrier, so the same scratch
// can be used again right away.
template <typename T, typename Combine>
__device__ __forceinline__ T block_allreduce(T value, Combine combine, T identity, T* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  value = warp_allreduce(value, combine);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < num_warps ? scratch[lane] : identity;
  value = warp_allreduce(value, combine);
  __syncthreads();
  return value;
}

template <typename T>
__device__ __forceinline__ T block_sum(T value, T* scratch) {
  return block_allreduce(value, SumOp<T>(), T(0), scratch);
}

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
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
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
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, dynamic_smem));
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
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    const size_t budget =
        std::max<int64_t>(0, int64_t(per_block) - int64_t(attributes.sharedSizeBytes)) / 16 * 16;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(budget)));
    return budget;
  });
}

// ---------------------------------------------------------------------------------
// sm_90 (CUDA 12 or later): the copy engine, clusters and dependent launches.
// cp.async.bulk moves a block of global memory into shared memory with no register per
// byte, and completes an mbarrier that the readers wait on: a block can have a whole row
// in flight. A cluster of blocks on neighbouring multiprocessors can write each other's
// shared memory and wait at one barrier. Elsewhere (sm_80, or a CUDA 11.8 build)
// sm90_supported is false, the launchers do not use kernels that need these, and the
// helpers trap if called.

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
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
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

// Whether `stream` is being captured into a CUDA graph.
inline bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
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
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&count, kernel, &launch.config));
    return int64_t(count);
  });
#else
  return 0;
#endif
}

// Launches kernel<<<blocks, threads, dynamic_smem, stream>>>(args...) on the current
// device, in clusters of `cluster_blocks` blocks (blocks a multiple of it) when that is
// more than 1. On sm_90 a dependent launch (wait_for_previous_kernel), except on a stream
// being captured into a CUDA graph: graphs take dependent launches only from CUDA 12.3 on.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), int64_t blocks, int threads, size_t dynamic_smem,
                   int cluster_blocks, cudaStream_t stream, Args&&... args) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
  const bool dependent = sm90_supported(c10::cuda::current_device()) && !is_capturing(stream);
  if (dependent || cluster_blocks > 1) {
    const LaunchConfig launch(blocks, cluster_blocks, threads, dynamic_smem, stream, dependent);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...));
    return;
  }
#else
  TORCH_CHECK(cluster_blocks == 1, "internal error: a cluster launch in a build without clusters (CUDA < 12)");
#endif
  kernel<<<blocks, threads, dynamic_smem, stream>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Thread 0 initializes, then every thread of the block passes a __syncthreads() before
// the barrier is used.
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
#if FUSED_LOSSES_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
  __trap();
#endif
}

// This block's barrier: one arrival, which expects `bytes` more to land (st.async, or
// the copy engine's bulk copy).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
#if FUSED_LOSSES_SM90
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned; 0 is allowed) from
// global `src` to shared `dst` and arrives on `barrier` (initialized for one arrival),
// whose phase completes when the bytes have landed. Before it, the caller has ordered
// the block's earlier reads of `dst` (a __syncthreads()).
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* barrier) {
#if FUSED_LOSSES_SM90
  // The copy engine writes through the async proxy: order the generic proxy's reads first.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbarrier_arrive_expect_tx(barrier, bytes);
  if (bytes > 0) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     shared_address(dst)),
                 "l"(src), "r"(bytes), "r"(shared_address(barrier))
                 : "memory");
  }
#else
  __trap();
#endif
}

// Where a bulk copy lands in shared memory: at the same offset from a 128-byte boundary
// as its source in global memory. Into a destination 16-byte but not 128-byte aligned,
// the copy engine took 13% longer to bring rows of 16 KB (notes, v29). A stage of shared
// memory has kBulkCopyAlign bytes of slack for it, and the stages start at a boundary.
constexpr int kBulkCopyAlign = 128;

template <int kAlign>
__device__ __forceinline__ unsigned char* align_shared(unsigned char* p) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return p + (kAlign - address % kAlign) % kAlign;
}

// A stage's bytes for `bytes` of a copy: the slack, rounded up to a boundary.
__host__ __device__ constexpr size_t bulk_stage_bytes(size_t bytes) {
  return (bytes + 2 * kBulkCopyAlign - 1) / kBulkCopyAlign * kBulkCopyAlign;
}

template <typename T, int VEC>
__host__ __device__ constexpr int64_t bulk_stage_packs(int64_t packs) {
  return static_cast<int64_t>(bulk_stage_bytes(packs * sizeof(T) * VEC) / (sizeof(T) * VEC));
}

// Packs into its stage that a copy from `src` (16-byte aligned) starts.
template <typename T, int VEC>
__device__ __forceinline__ int64_t bulk_copy_offset(const T* src) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) % kBulkCopyAlign) / (sizeof(T) * VEC);
}

// Waits until the barrier's phase of parity `phase` (0 for its first, then 1, 0, ...)
// has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t phase) {
#if FUSED_LOSSES_SM90
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred complete;\n mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        " selp.u32 %0, 1, 0, complete;\n}"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(phase)
        : "memory");
  }
#else
  __trap();
#endif
}

// This block's place in its cluster, and the cluster's size (0 of 1 when launched
// without one).
struct ClusterPlace {
  int rank, blocks;
};

__device__ __forceinline__ ClusterPlace cluster_place() {
#if FUSED_LOSSES_SM90
  uint32_t rank, blocks;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\nmov.u32 %1, %%cluster_nctarank;" : "=r"(rank), "=r"(blocks));
  return {static_cast<int>(rank), static_cast<int>(blocks)};
#else
  return {0, 1};
#endif
}

// Writes `value` to the variable `*ptr` in the shared memory of the cluster's block
// `rank`, and the bytes, once they land, complete that much of the transaction of that
// block's `barrier` (the same variable there). No fence: unlike a release, it does not
// wait for this thread's earlier stores to global memory.
template <typename V>
__device__ __forceinline__ void store_to_cluster_block(V* ptr, const V& value, uint64_t* barrier, int rank) {
  static_assert(sizeof(V) % 8 == 0 && alignof(V) >= 8, "sent in 8-byte pieces");
#if FUSED_LOSSES_SM90
  uint32_t remote, remote_barrier;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(shared_address(ptr)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_barrier) : "r"(shared_address(barrier)), "r"(rank));
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&value);
#pragma unroll
  for (int i = 0; i < int(sizeof(V) / 4); i += 2) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                     remote + 4 * i),
                 "r"(words[i]), "r"(words[i + 1]), "r"(remote_barrier)
                 : "memory");
  }
#else
  __trap();
#endif
}

// Every thread of every block of the cluster: what each wrote before (to any block's
// shared memory) is visible to all after.
__device__ __forceinline__ void cluster_sync() {
#if FUSED_LOSSES_SM90
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// ---------------------------------------------------------------------------------
// Exact sums of floats, for sums whose order is not fixed: where rows are claimed from a
// counter, which block adds which row changes from run to run, and a float sum would
// change its last bits with it. A finite float is m * 2^(p - 149) with an integer
// m < 2^24 and p in [0, 253]; it is added as that integer, in 32-bit digits, each limb
// an int64 collecting the digits of its place (room for 2^31 additions). Integer sums
// are the same in any order, so the total and the double made from it are too.

constexpr int kExactLimbs = 9;                // 9 x 32 bits hold p + 24 bits and the carries
constexpr int kExactWords = kExactLimbs + 1;  // the limbs, then the specials' bits
constexpr unsigned long long kExactNaN = 1, kExactPlusInf = 2, kExactMinusInf = 4;

// Every lane of a warp adds its value where `has` (the whole warp calls it) into sum
// (kExactWords words in shared memory, which other warps may add to as well): the lanes'
// digits are added place by place across the warp first (32 digits < 2^37: no overflow),
// then lane 0 adds each place the warp touched, one atomic each. Losses of one size share
// one or two places, so a warp's 32 values cost a few shuffles and atomics, where one
// atomic per digit (warps contending for the same two places) cost 10 us a call at the
// end of a 32768-row kernel (notes, v28).
__device__ __forceinline__ void warp_exact_add(unsigned long long* sum, float value, bool has) {
  const uint32_t bits = __float_as_uint(value);
  const uint32_t biased_exponent = (bits >> 23) & 0xffu;
  const bool negative = bits >> 31;
  const bool special = has && biased_exponent == 0xffu;
  const unsigned special_bits = !special ? 0u : (bits & 0x7fffffu) != 0 ? kExactNaN : negative ? kExactMinusInf : kExactPlusInf;
  uint64_t m = bits & 0x7fffffu;
  if (biased_exponent != 0) m |= 0x800000u;  // normal: the implicit leading 1
  const bool counted = has && !special && m != 0;
  const int p = biased_exponent == 0 ? 0 : static_cast<int>(biased_exponent) - 1;
  const uint64_t shifted = m << (p % 32);
  const unsigned place = p / 32;
  const long long sign = negative ? -1 : 1;
  const long long low = sign * static_cast<long long>(shifted & 0xffffffffu);
  const long long high = sign * static_cast<long long>(shifted >> 32);
  const unsigned lowest = __reduce_min_sync(0xffffffffu, counted ? place : kExactLimbs);
  const unsigned highest = __reduce_max_sync(0xffffffffu, counted ? place + 1 : 0);
  const unsigned specials = __reduce_or_sync(0xffffffffu, special_bits);
  const bool lane0 = threadIdx.x % 32 == 0;
  if (lane0 && specials != 0) atomicOr(&sum[kExactLimbs], static_cast<unsigned long long>(specials));
  for (unsigned limb = lowest; limb <= highest; ++limb) {
    long long digits = !counted ? 0 : place == limb ? low : place + 1 == limb ? high : 0;
    digits = warp_allreduce(digits, SumOp<long long>());
    if (lane0 && digits != 0) atomicAdd(&sum[limb], static_cast<unsigned long long>(digits));
  }
}

// The sum as a double (its digits added from the top down), from its limbs (as int64)
// and specials: NaN where a float sum gives one (a NaN, or +inf and -inf), else +-inf.
__device__ inline double exact_total(const long long* limbs, unsigned long long specials) {
  if ((specials & kExactNaN) || (specials & (kExactPlusInf | kExactMinusInf)) == (kExactPlusInf | kExactMinusInf)) {
    return __longlong_as_double(0x7ff8000000000000ll);
  }
  if (specials & kExactPlusInf) return __longlong_as_double(0x7ff0000000000000ll);
  if (specials & kExactMinusInf) return __longlong_as_double(0xfff0000000000000ll);
  // Carries make every limb below the top a digit in [0, 2^32); the top keeps the sign.
  // A negative total is negated and carried again, so the digits add up without cancelling.
  long long digits[kExactLimbs];
  long long sign = 1;
  for (int pass = 0; pass < 2; ++pass) {
    long long carry = 0;
#pragma unroll
    for (int i = 0; i < kExactLimbs; ++i) {
      const long long v = sign * limbs[i] + carry;
      carry = i + 1 < kExactLimbs ? v >> 32 : 0;
      digits[i] = v - carry * (1ll << 32);
    }
    if (digits[kExactLimbs - 1] >= 0) break;
    sign = -1;
  }
  double total = 0;
#pragma unroll
  for (int i = kExactLimbs - 1; i >= 0; --i) total += ldexp(static_cast<double>(digits[i]), 32 * i - 149);
  return static_cast<double>(sign) * total;
}

// ---------------------------------------------------------------------------------
// Stage two of every scalar reduction: one block adds the per-block partials in a
// fixed order and writes the loss. `partials` holds `num_terms` rows of `num_partials`
// block sums; the loss is scale * sum over terms of (term's sum / term's divisor).
// A divisor is 1, or, when `divisors` is given (cross-entropy 'mean': the number or the
// weight of the non-ignored targets, known only on the device), the sum of its row of
// `num_divisors` block sums.
//
// That block is the loss kernel's own block that finishes last (finish_if_last_block):
// one launch per call rather than two, which saves launch-bound calls a few microseconds
// of host time and large ones the GPU's gap between two kernels plus a kernel's start.
// It knows it is last from a per-stream ticket (finish_ticket). Where there is none (a
// stream being captured into a CUDA graph), finish_sum_kernel runs after the loss kernel.
// Either way the sum's order depends only on the grid and block sizes: same bits each run.

constexpr int kMaxTerms = 2;  // cross-entropy's ce and z-loss
constexpr int kFinishThreads = 512;

struct Finish {
  sum_t* partials = nullptr;  // (num_terms, num_partials); nullptr: no scalar loss
  int64_t num_partials = 0;
  int num_terms = 1;
  double scale = 1.0;
  const sum_t* divisors = nullptr;  // (num_terms, num_divisors), or nullptr
  int64_t num_divisors = 0;
  void* loss = nullptr;  // 0-dim, of loss_type
  c10::ScalarType loss_type = c10::ScalarType::Float;
  unsigned int* ticket = nullptr;  // the loss kernel's finished blocks; nullptr: finish_sum_kernel
  // Beside the ticket: exact sums (kMaxTerms x kExactWords) that a kernel's blocks add into
  // (finish_partials<true>); zero between launches.
  unsigned long long* exact_sums = nullptr;
};

template <typename out_t>
__device__ __forceinline__ void store_as(void* out, double value) {
  *static_cast<out_t*>(out) = static_cast<out_t>(value);
}

// Partials are read through L2 (ld.global.cg): other blocks of the same launch wrote them.
// kExact: the blocks added exact sums (warp_exact_add) into finish.exact_sums instead of
// writing partials; an instantiation of its own, so the others keep their registers.
template <bool kExact = false>
__device__ __noinline__ void finish_partials(Finish finish, sum_t* scratch) {
  // Every load of every term and divisor goes out before any is added: one trip to memory
  // rather than one per term and divisor (cross-entropy's 'mean' made four: 4.4-5.3 us
  // on an H100, against 1.7 us for one term).
  sum_t totals[kMaxTerms] = {}, divisor_sums[kMaxTerms] = {};
  const int64_t count = finish.num_partials > finish.num_divisors ? finish.num_partials : finish.num_divisors;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
#pragma unroll
    for (int term = 0; term < kMaxTerms; ++term) {
      if (!kExact && term < finish.num_terms && i < finish.num_partials) {
        totals[term] += __ldcg(finish.partials + term * finish.num_partials + i);
      }
      if (term < finish.num_terms && i < finish.num_divisors) {
        divisor_sums[term] += __ldcg(finish.divisors + term * finish.num_divisors + i);
      }
    }
  }
  if constexpr (kExact) {
    // One set of words for the whole launch (blocks that each wrote theirs cost a 2-3 us
    // longer finish: notes, v30): read them, and zero them for the stream's next launch.
    if (threadIdx.x == 0) {
      for (int term = 0; term < finish.num_terms; ++term) {
        unsigned long long* sum = finish.exact_sums + term * kExactWords;
        long long words[kExactWords];
#pragma unroll
        for (int w = 0; w < kExactWords; ++w) words[w] = static_cast<long long>(__ldcg(sum + w));
#pragma unroll
        for (int w = 0; w < kExactWords; ++w) sum[w] = 0;
        totals[term] = exact_total(words, static_cast<unsigned long long>(words[kExactLimbs]));
      }
    }
  }
  double result = 0;
#pragma unroll
  for (int term = 0; term < kMaxTerms; ++term) {
    if (term < finish.num_terms) {
      const sum_t total = block_sum(totals[term], scratch);
      result += finish.divisors != nullptr ? total / block_sum(divisor_sums[term], scratch) : total;
    }
  }
  if (threadIdx.x != 0) return;
  result *= finish.scale;
  switch (finish.loss_type) {
    case c10::ScalarType::Double: store_as<double>(finish.loss, result); break;
    case c10::ScalarType::Half: store_as<at::Half>(finish.loss, result); break;
    case c10::ScalarType::BFloat16: store_as<at::BFloat16>(finish.loss, result); break;
    default: store_as<float>(finish.loss, result); break;
  }
}

__global__ void finish_sum_kernel(Finish finish) {
  __shared__ sum_t scratch[32];
  wait_for_previous_kernel();
  finish_partials(finish, scratch);
}

// Thread 0 takes the block's ticket: whether the block is the launch's last. One
// acquire-release atomic at GPU scope. Release: the writes before it (this thread's, and
// other threads' before a __syncthreads that precedes it) are visible to whoever takes a
// later ticket. Acquire: the last block's reads after it see every block's writes.
// CUDA's threadFenceReduction pattern (a sequentially consistent fence before a relaxed
// atomicAdd, another after it in the last block) ended an MSE forward 0.3-0.5 us later on an
// H100; a release atomic with an acquire fence in the last block, 0.3 us later (notes, v32).
__device__ __forceinline__ bool take_ticket_is_last(unsigned int* ticket) {
  unsigned int taken;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(taken) : "l"(ticket) : "memory");
  return taken == gridDim.x - 1;
}

// The end of a loss kernel, after thread 0 wrote the block's partials (and divisors), or
// other threads wrote them before a __syncthreads: the last block to get here adds everyone's.
template <bool kExact = false>
__device__ __forceinline__ void finish_if_last_block(const Finish& finish, sum_t* scratch) {
  if (finish.ticket == nullptr) return;
  __shared__ bool last;
  if (threadIdx.x == 0) last = take_ticket_is_last(finish.ticket);
  __syncthreads();
  if (!last) return;
  finish_partials<kExact>(finish, scratch);
  if (threadIdx.x == 0) {  // ready for the stream's next launch
    finish.ticket[0] = 0;
    finish.ticket[1] = 0;
  }
}

// The ticket of `stream`: two counters, then exact sums (Finish::exact_sums), zeroed once,
// that each launch's last block sets back to 0: ticket[0] counts the launch's finished
// blocks, ticket[1] is the next row of a kernel whose warps claim rows (cross-entropy's
// claimed rows). One per stream and device, since launches on one stream never overlap
// and on two they may. Kept for the life of the process (168 bytes per stream: torch's
// streams come from a fixed pool).
// nullptr while the stream is being captured into a CUDA graph: a graph may be replayed
// on another stream, beside launches on this one. nullptr for cudaStreamPerThread too:
// one handle that names another stream in each host thread.
inline unsigned int* finish_ticket(int device, cudaStream_t stream) {
  if (stream == cudaStreamPerThread || is_capturing(stream)) return nullptr;
  static Remembered<std::pair<int, cudaStream_t>, unsigned int*> tickets;
  return tickets.get({device, stream}, [&] {
    // A tensor never destroyed: its memory stays ours, and no destructor runs after the
    // allocator's at exit. Zeroed on `stream`, so the first launch there sees 0.
    auto* ticket = new at::Tensor(
        at::zeros({1 + kMaxTerms * kExactWords}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kLong)));
    return static_cast<unsigned int*>(ticket->data_ptr());
  });
}

// What a loss kernel launched on `stream` needs to finish the scalar `loss` (0-dim) itself.
inline Finish make_finish(sum_t* partials, int num_terms, int64_t num_partials, double scale,
                          const sum_t* divisors, int64_t num_divisors, const at::Tensor& loss, cudaStream_t stream) {
  TORCH_CHECK(num_terms >= 1 && num_terms <= kMaxTerms, "make_finish: internal error: ", num_terms, " terms");
  Finish finish;
  finish.partials = partials;
  finish.num_partials = num_partials;
  finish.num_terms = num_terms;
  finish.scale = scale;
  finish.divisors = divisors;
  finish.num_divisors = num_divisors;
  finish.loss = loss.data_ptr();
  finish.loss_type = loss.scalar_type();
  finish.ticket = finish_ticket(loss.get_device(), stream);
  if (finish.ticket != nullptr) finish.exact_sums = reinterpret_cast<unsigned long long*>(finish.ticket) + 1;
  return finish;
}

// After the loss kernel: the finish it could not do itself (no ticket), in a launch of its own.
inline void finish_without_ticket(const Finish& finish, cudaStream_t stream) {
  if (finish.partials == nullptr || finish.ticket != nullptr) return;
  launch_kernel(finish_sum_kernel, 1, kFinishThreads, 0, 1, stream, finish);
}

// ---------------------------------------------------------------------------------
// Backward of a scalar loss whose gradient the forward already wrote: multiply it by
// grad_output in place. grad_output is read on the device (no host sync), and when it
// is exactly 1, the usual loss.backward(), every block returns without touching memory.

template <typename T, int VEC>
__global__ void scale_by_grad_output_kernel(T* grad, int64_t n, const T* grad_output) {
  using acc_t = at::opmath_type<T>;
  wait_for_previous_kernel();
  const acc_t scale = static_cast<acc_t>(*grad_output);
  if (scale == acc_t(1)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_packs = n / VEC;
  for (int64_t p = first; p < num_packs; p += stride) {
    Pack<T, VEC> pack = load_pack<T, VEC>(grad + p * VEC);
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.val[k] = static_cast<T>(static_cast<acc_t>(pack.val[k]) * scale);
    store_pack<T, VEC>(grad + p * VEC, pack);
  }
  for (int64_t i = num_packs * VEC + first; i < n; i += stride) {
    grad[i] = static_cast<T>(static_cast<acc_t>(grad[i]) * scale);
  }
}

// In place: grad *= grad_output (a 0-dim tensor of grad's dtype on grad's device). Not
// inline: the bindings call it from another translation unit (ops.h); each build
// compiles this header once.
void scale_by_grad_output_(at::Tensor grad, const at::Tensor& grad_output) {
  TORCH_CHECK(grad.is_cuda() && grad.is_contiguous(), "grad must be a contiguous CUDA tensor");
  TORCH_CHECK(grad_output.numel() == 1 && grad_output.scalar_type() == grad.scalar_type() &&
                  grad_output.device() == grad.device(),
              "grad_output must be one element of grad's dtype on grad's device");
  if (grad.numel() == 0) return;
  c10::cuda::CUDAGuard guard(grad.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "scale_by_grad_output", [&] {
    constexpr int VEC = vec16<scalar_t>();
    const bool vector_ok = is_aligned16(grad.data_ptr());
    auto kernel = vector_ok ? scale_by_grad_output_kernel<scalar_t, VEC> : scale_by_grad_output_kernel<scalar_t, 1>;
    const int64_t grid = grid_for(kernel, vector_ok ? grad.numel() / VEC + 1 : grad.numel(), threads, grad.get_device());
    launch_kernel(kernel, grid, threads, 0, 1, stream, grad.data_ptr<scalar_t>(), grad.numel(),
                  grad_output.data_ptr<scalar_t>());
  });
}

// ---------------------------------------------------------------------------------
// Pointwise losses (MSE, KL): loss = reduce(f(input, target)) over n elements.
//
// One kernel serves every pass, chosen by which pointers are set (each in an
// instantiation of its own where that was faster: PointwisePass):
//   forward, reduction 'none':   loss_out (per element)
//   forward, scalar reduction:   partials (+ grad_input / grad_target when grad is
//                                needed: written here, scaled by grad_scale, so backward
//                                never reads the inputs again)
//   backward, reduction 'none':  grad_output (per element) + grad_input / grad_target
// `Op` computes, in acc_t, what `need` asks of one element of storage type T (the rest
// is left alone, so a no-grad forward spends no time on derivatives):
//   op.template compute<T>(input, target, need, &loss, &d_input, &d_target).
// An Op with kFastPath also has a cheaper formula for ordinary values, which says whether
// it held (bool op.template fast<T>(same arguments)): a pack is computed by it, and again
// by compute() when any of its elements was not ordinary. One branch per pack rather than
// one per element keeps the common case free of the special cases' instructions.

struct Needs {
  bool loss;
  bool d_input;
  bool d_target;
};

struct PointwiseArgs {
  int64_t n;
  double grad_scale;  // multiplies every gradient (1/n for 'mean', 1/batch for 'batchmean')
};

template <typename T>
struct PointwisePointers {
  const T* __restrict__ input;
  const T* __restrict__ target;
  const T* __restrict__ grad_output;  // per element, or nullptr: scale by grad_scale
  T* __restrict__ loss_out;           // per element, or nullptr
  T* __restrict__ grad_input;         // or nullptr
  T* __restrict__ grad_target;        // or nullptr
};

// How a thread walks its packs, set by each Op: batches of Op::batch<T>() packs, every load
// of a batch issued before its math (4 x 16 B x 2-3 inputs per thread covers memory
// latency). With Op::kPrefetch, the next batch's loads go out before this batch's math
// too, at the cost of registers for two batches: for math heavy enough to leave memory
// idle while it runs (KL's log and division).

template <typename T, int VEC>
struct PointwiseInputs {
  Pack<T, VEC> input, target, grad_output;
};

template <int VEC, bool kSumOnly, typename T>
__device__ __forceinline__ PointwiseInputs<T, VEC> load_pointwise(const PointwisePointers<T>& ptr, int64_t offset) {
  PointwiseInputs<T, VEC> v;
  v.input = load_pack<T, VEC>(ptr.input + offset);
  v.target = load_pack<T, VEC>(ptr.target + offset);
  if (!kSumOnly && ptr.grad_output != nullptr) v.grad_output = load_pack<T, VEC>(ptr.grad_output + offset);
  return v;
}

// The VEC elements at `offset`: computes and stores what is asked; returns their loss sum.
template <int VEC, bool kSumOnly, typename T, typename Op>
__device__ __forceinline__ at::opmath_type<T> pointwise_pack(const PointwisePointers<T>& ptr, int64_t offset,
                                                             const PointwiseInputs<T, VEC>& v,
                                                             at::opmath_type<T> grad_scale, bool need_loss,
                                                             const Op& op) {
  using acc_t = at::opmath_type<T>;
  const Needs need{need_loss, !kSumOnly && ptr.grad_input != nullptr, !kSumOnly && ptr.grad_target != nullptr};
  Pack<T, VEC> loss_pack, d_input_pack, d_target_pack;
  acc_t pack_sum = 0;
  // With a fast path, pairs of elements share a branch: a whole pack's values held before
  // the branch cost KL occupancy (77 registers instead of 59 for float16; 16384^2
  // forward 1.10x the floor against 1.07x by pairs, 1.12x by fours).
  constexpr int kGroup = Op::kFastPath && VEC > 2 ? 2 : VEC;
#pragma unroll
  for (int first = 0; first < VEC; first += kGroup) {
    acc_t loss[kGroup], d_input[kGroup], d_target[kGroup];
    bool done = false;
    if constexpr (Op::kFastPath) {
      done = true;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const bool held = op.template fast<T>(static_cast<acc_t>(v.input.val[first + k]),
                                              static_cast<acc_t>(v.target.val[first + k]), need, loss[k],
                                              d_input[k], d_target[k]);
        done = done && held;
      }
    }
    if (!done) {
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        loss[k] = d_input[k] = d_target[k] = 0;  // what `need` does not ask for is not set
        op.template compute<T>(static_cast<acc_t>(v.input.val[first + k]), static_cast<acc_t>(v.target.val[first + k]),
                               need, loss[k], d_input[k], d_target[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      pack_sum += loss[k];
      if constexpr (kSumOnly) continue;
      const acc_t scale = ptr.grad_output != nullptr ? static_cast<acc_t>(v.grad_output.val[first + k]) : grad_scale;
      loss_pack.val[first + k] = static_cast<T>(loss[k]);
      d_input_pack.val[first + k] = static_cast<T>(d_input[k] * scale);
      d_target_pack.val[first + k] = static_cast<T>(d_target[k] * scale);
    }
  }
  if constexpr (kSumOnly) return pack_sum;
  if (ptr.loss_out != nullptr) store_pack<T, VEC>(ptr.loss_out + offset, loss_pack);
  if (ptr.grad_input != nullptr) store_pack<T, VEC>(ptr.grad_input + offset, d_input_pack);
  if (ptr.grad_target != nullptr) store_pack<T, VEC>(ptr.grad_target + offset, d_target_pack);
  return pack_sum;
}

// The passes of pointwise_loss_kernel, each an instantiation of its own so that what one
// never touches takes none of its registers (they go to blocks per multiprocessor, and so
// to bytes in flight):
//   kSumOnly: a scalar loss without grad, the sum and nothing stored (16384^2 KL fp16
//     forward 1.07x -> 0.99x the floor, 8192^2 MSE bf16 1.07x -> 1.02x);
//   kScalarGrad: a scalar loss and its gradients, the training step's forward: no
//     grad_output read, no per-element loss stored. For an Op with kOwnScalarGradPass
//     (the Ops say what it gained them); the others run this pass as kPerElement;
//   kPerElement: reduction 'none', its forward (loss_out) and backward (grad_output).
enum class PointwisePass { kSumOnly, kScalarGrad, kPerElement };

// `finish.partials` (one per block) is set for scalar reductions, nullptr otherwise. At
// least two blocks per multiprocessor: a batch of 2-byte packs must fit in 128 registers.
template <typename T, int VEC, typename Op, PointwisePass kPass>
__global__ void __launch_bounds__(256, 2) pointwise_loss_kernel(PointwisePointers<T> pointers, PointwiseArgs args,
                                                             Op op, Finish finish) {
  using acc_t = at::opmath_type<T>;
  constexpr bool kSumOnly = kPass == PointwisePass::kSumOnly;
  __shared__ sum_t scratch[32];
  // Null where the pass never uses them, as constants: their loads and stores compile out.
  PointwisePointers<T> ptr = pointers;
  if constexpr (kPass != PointwisePass::kPerElement) {
    ptr.grad_output = nullptr;
    ptr.loss_out = nullptr;
  }
  wait_for_previous_kernel();
  const acc_t grad_scale = static_cast<acc_t>(args.grad_scale);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t num_packs = args.n / VEC;
  const bool need_loss = finish.partials != nullptr || ptr.loss_out != nullptr;
  constexpr int batch = Op::template batch<T>();
  sum_t thread_sum = 0;
  // The packs of a thread's batch lie batch_gap apart. The sum-only forward reads a
  // block's batch as one run of batch x blockDim packs (the grid strides over such runs):
  // MSE 32768^2 fp32 forward 2.776 -> 2.745 ms. The passes that write keep a batch's packs
  // a grid apart (that way the 8192^2 bf16 training kernel is 0.1406 ms, against 0.1423).
  const int64_t batch_gap = kSumOnly ? blockDim.x : stride;
  PointwiseInputs<T, VEC> loaded[batch];
  auto load_batch = [&](int64_t first_pack) {
#pragma unroll
    for (int u = 0; u < batch; ++u) {
      if (first_pack + u * batch_gap < num_packs) {
        loaded[u] = load_pointwise<VEC, kSumOnly>(ptr, (first_pack + u * batch_gap) * VEC);
      }
    }
  };
  int64_t p = int64_t(blockIdx.x) * (kSumOnly ? batch * blockDim.x : blockDim.x) + threadIdx.x;
  if constexpr (Op::kPrefetch) load_batch(p);
  for (; p < num_packs; p += batch * stride) {
    if constexpr (!Op::kPrefetch) load_batch(p);
    PointwiseInputs<T, VEC> v[batch];
#pragma unroll
    for (int u = 0; u < batch; ++u) v[u] = loaded[u];
    if constexpr (Op::kPrefetch) load_batch(p + batch * stride);
#pragma unroll
    for (int u = 0; u < batch; ++u) {
      if (p + u * batch_gap < num_packs) {
        thread_sum += pointwise_pack<VEC, kSumOnly>(ptr, (p + u * batch_gap) * VEC, v[u], grad_scale, need_loss, op);
      }
    }
  }
  // The last n % VEC elements: the same code, one element at a time.
  for (int64_t i = num_packs * VEC + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < args.n; i += stride) {
    thread_sum += pointwise_pack<1, kSumOnly>(ptr, i, load_pointwise<1, kSumOnly>(ptr, i), grad_scale, need_loss, op);
  }
  if (finish.partials != nullptr) {
    const sum_t block_total = block_sum(thread_sum, scratch);
    if (threadIdx.x == 0) finish.partials[blockIdx.x] = block_total;
    finish_if_last_block(finish, scratch);
  }
}

// Launches pointwise_loss_kernel with 16-byte packs when every pointer allows it (and its
// kSumOnly form when only a scalar loss is asked for). With `scalar_loss` (0-dim), the
// elements' sum times args.grad_scale is written there.
template <typename T, typename Op>
void launch_pointwise_loss(const PointwisePointers<T>& ptr, PointwiseArgs args, const Op& op,
                           const at::Tensor* scalar_loss, int device) {
  constexpr int VEC = vec16<T>();
  const int threads = 256;
  const bool vector_ok = is_aligned16(ptr.input) && is_aligned16(ptr.target) &&
                         is_aligned16(ptr.grad_output) && is_aligned16(ptr.loss_out) &&
                         is_aligned16(ptr.grad_input) && is_aligned16(ptr.grad_target);
  const bool scalar_only = scalar_loss != nullptr && ptr.grad_output == nullptr && ptr.loss_out == nullptr;
  const bool sum_only = scalar_only && ptr.grad_input == nullptr && ptr.grad_target == nullptr;
  auto run = [&](auto kernel, int64_t items) {
    const int64_t grid = grid_for(kernel, items, threads, device);
    auto stream = c10::cuda::getCurrentCUDAStream();
    at::Tensor partials;
    Finish finish;
    if (scalar_loss != nullptr) {
      partials = at::empty({grid}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kDouble));
      finish = make_finish(partials.data_ptr<sum_t>(), 1, grid, args.grad_scale, nullptr, 0, *scalar_loss, stream);
    }
    launch_kernel(kernel, grid, threads, 0, 1, stream, ptr, args, op, finish);
    finish_without_ticket(finish, stream);
  };
  if (vector_ok && sum_only) {
    run(pointwise_loss_kernel<T, VEC, Op, PointwisePass::kSumOnly>, args.n / VEC + 1);
  } else if (vector_ok && scalar_only) {
    constexpr PointwisePass kPass = Op::kOwnScalarGradPass ? PointwisePass::kScalarGrad : PointwisePass::kPerElement;
    run(pointwise_loss_kernel<T, VEC, Op, kPass>, args.n / VEC + 1);
  } else if (vector_ok) {
    run(pointwise_loss_kernel<T, VEC, Op, PointwisePass::kPerElement>, args.n / VEC + 1);
  } else {
    run(pointwise_loss_kernel<T, 1, Op, PointwisePass::kPerElement>, args.n);
  }
}

// `other` (named `other_name` in messages) must match input in device, dtype and shape.
// losses.py checks all of this with friendlier messages first; this guards direct calls.
inline void check_matches_input(const at::Tensor& input, const char* other_name, const at::Tensor& other) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor");
  TORCH_CHECK(other.device() == input.device(), other_name, " must be on the same device as input");
  TORCH_CHECK(other.scalar_type() == input.scalar_type(), other_name, " must have the dtype of input");
  TORCH_CHECK(other.sizes() == input.sizes(), other_name, " must have the shape of input");
}

// An output that is not written is an undefined tensor, which Python receives as None:
// no allocation for it (launch-bound calls feel each one).
template <typename T>
T* data_or_null(const at::Tensor& tensor) {
  return tensor.defined() ? static_cast<T*>(tensor.data_ptr()) : nullptr;
}

// The tensor the loss is written to. A scalar reduction's is 0-dim, in the input's dtype or
// in float32 when float_loss (what torch's autocast gives for these losses; losses.py asks
// for it there); reduction 'none' gives one value per element or row, `unreduced_shape`.
inline at::Tensor loss_tensor(const at::Tensor& input, int64_t reduction, bool float_loss,
                              at::IntArrayRef unreduced_shape) {
  if (reduction == kNone) {
    TORCH_CHECK(!float_loss, "float_loss is for scalar reductions");
    return at::empty(unreduced_shape, input.options());
  }
  return at::empty({}, input.options().dtype(float_loss ? at::kFloat : input.scalar_type()));
}

// Forward of a pointwise loss. Returns (loss, grad_input, grad_target); a gradient not
// asked for is undefined (None in Python). `scale` is the reduction's factor (1/n for 'mean').
// For reduction 'none' no gradient is computed here (it needs grad_output): see
// pointwise_loss_backward.
template <typename Op>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pointwise_loss_forward(
    const at::Tensor& input_arg, const at::Tensor& target_arg, Op op, int64_t reduction, double scale,
    bool float_loss, bool want_grad_input, bool want_grad_target) {
  check_matches_input(input_arg, "target", target_arg);
  const bool scalar_loss = reduction != kNone;
  c10::cuda::CUDAGuard guard(input_arg.device());
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  at::Tensor loss = loss_tensor(input, reduction, float_loss, input.sizes());
  at::Tensor grad_input = scalar_loss && want_grad_input ? at::empty_like(input) : at::Tensor();
  at::Tensor grad_target = scalar_loss && want_grad_target ? at::empty_like(input) : at::Tensor();
  if (input.numel() == 0) return {loss, grad_input, grad_target};  // losses.py sends empty tensors to torch
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss", [&] {
    const PointwisePointers<scalar_t> ptr{input.data_ptr<scalar_t>(), target.data_ptr<scalar_t>(), nullptr,
                                          scalar_loss ? nullptr : loss.data_ptr<scalar_t>(),
                                          data_or_null<scalar_t>(grad_input), data_or_null<scalar_t>(grad_target)};
    launch_pointwise_loss(ptr, PointwiseArgs{input.numel(), scale}, op, scalar_loss ? &loss : nullptr,
                          input.get_device());
  });
  return {loss, grad_input, grad_target};
}

// Backward of reduction 'none': grad = d loss_i / d input_i * grad_output_i.
// Returns (grad_input, grad_target), undefined where not asked for.
template <typename Op>
std::tuple<at::Tensor, at::Tensor> pointwise_loss_backward(
    const at::Tensor& input_arg, const at::Tensor& target_arg, const at::Tensor& grad_output_arg, Op op,
    bool want_grad_input, bool want_grad_target) {
  check_matches_input(input_arg, "target", target_arg);
  check_matches_input(input_arg, "grad_output", grad_output_arg);
  c10::cuda::CUDAGuard guard(input_arg.device());
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const at::Tensor grad_output = grad_output_arg.contiguous();
  at::Tensor grad_input = want_grad_input ? at::empty_like(input) : at::Tensor();
  at::Tensor grad_target = want_grad_target ? at::empty_like(input) : at::Tensor();
  if (input.numel() == 0) return {grad_input, grad_target};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "pointwise_loss", [&] {
    const PointwisePointers<scalar_t> ptr{input.data_ptr<scalar_t>(), target.data_ptr<scalar_t>(),
                                          grad_output.data_ptr<scalar_t>(), nullptr,
                                          data_or_null<scalar_t>(grad_input), data_or_null<scalar_t>(grad_target)};
    launch_pointwise_loss(ptr, PointwiseArgs{input.numel(), 1.0}, op, nullptr, input.get_device());
  });
  return {grad_input, grad_target};
}

}  // namespace fused_losses
