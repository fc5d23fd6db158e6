// sm90.cuh: sm_90's device primitives: the copy engine's bulk copies, mbarriers, and the
// shared memory of a cluster of blocks.
//
// cp.async.bulk moves a block of global memory into shared memory with no register per
// byte, and completes an mbarrier that the readers wait on: a block can have a whole row
// in flight. A cluster of blocks on neighbouring multiprocessors can write each other's
// shared memory and wait at one barrier. Elsewhere (sm_80, or a CUDA 11.8 build)
// sm90_supported is false, the launchers do not use kernels that need these, and the
// helpers trap if called.
#pragma once

#include <cstdint>

#include "launch.cuh"

namespace fused_losses {

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

}  // namespace fused_losses
