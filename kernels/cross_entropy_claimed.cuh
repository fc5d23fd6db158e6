// cross_entropy_claimed.cuh: sm_90's claimed rows: the sum-only forward of many rows,
// each warp claiming its next row from the stream's counter, summed exactly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <cstdint>
#include <type_traits>

#include "cross_entropy_row.cuh"
#include "device.cuh"
#include "finish.cuh"
#include "launch.cuh"
#include "sm90.cuh"

namespace fused_losses {

// sm_90: the sum-only forward of many rows that a warp's stage of shared memory holds
// (class-index targets without label smoothing; where a warp per row would stream them).
// Each warp has the copy engine bring its row into its own stage and takes its next row
// from a counter (the stream's, beside the finish ticket): rows go to the warps that are
// ready, and every warp keeps a whole row in flight until the rows run out. Warps that
// streamed fixed rows through registers ended 5-8 us apart (notes, v25), and the reads
// thinned out at the end of each call. Which block adds which row changes from run to run,
// so the sums are exact (warp_exact_add), the blocks' added into the stream's exact sums:
// the same bits every run. Faster than a warp per row from 16 rows a warp; with fewer,
// the first rows and the last cost the same however many come between (notes, v30).
constexpr int kClaimedRowsWarps = 8;
constexpr int64_t kClaimedRowsPerWarp = 16;  // at least, for every resident warp
constexpr size_t kClaimedRowsBytes = 128 * 1024;  // rows in flight a multiprocessor
// A warp's stage: its row with the slack to land it as in memory, from a 1024-byte
// boundary (0.5 us faster than from 128 at 32768x4096 fp32: notes, v30).
constexpr size_t kClaimedStageAlign = 1024;
__host__ __device__ constexpr size_t claimed_stage_bytes(size_t row_bytes) {
  return (bulk_stage_bytes(row_bytes) + kClaimedStageAlign - 1) / kClaimedStageAlign * kClaimedStageAlign;
}

template <typename T, typename index_t, int VEC, bool kEdges>
__global__ void __launch_bounds__(32 * kClaimedRowsWarps) cross_entropy_claimed_rows_kernel(CrossEntropyParams<T> params) {
  using acc_t = at::opmath_type<T>;
  using exp_sum_t = exp_sum_type<T>;
  static_assert(std::is_same<acc_t, float>::value, "exact sums of float losses");
  __shared__ uint64_t stage_full[kClaimedRowsWarps];
  __shared__ unsigned long long block_sums[kMaxTerms][kExactWords];  // ce, then z
  __shared__ sum_t scratch_sum[32];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t num_classes = params.num_classes;
  // Rows of a multiple of 128 bytes start at a boundary both in memory and in their stage.
  Pack<T, VEC>* stage = reinterpret_cast<Pack<T, VEC>*>(align_shared<kClaimedStageAlign>(dynamic_smem)) +
                        warp * (claimed_stage_bytes(params.stash_packs * sizeof(Pack<T, VEC>)) / sizeof(Pack<T, VEC>));
  unsigned int* next_row = params.finish.ticket + 1;
  // Where a row lands in the stage (its offset from a 128-byte boundary, as in memory).
  auto row_in_stage = [&](const T* x, const RowEdges<T, VEC, kEdges>& edges) {
    return stage + bulk_copy_offset<T, VEC>(x + edges.head);
  };
  // Lane 0: `row` on its way into the stage, unless past the end. Every warp's first row is
  // its own index; the counter hands out the rest (its first claims cost a round trip
  // that the first rows need not wait for).
  const int warps_per_block = blockDim.x / 32;
  const int64_t first_round = int64_t(gridDim.x) * warps_per_block;
  auto fetch_row = [&](int64_t row) {
    if (row < params.rows) {
      const T* x = params.logits + row * num_classes;
      const RowEdges<T, VEC, kEdges> edges(x, num_classes);
      bulk_copy_to_shared(row_in_stage(x, edges), x + edges.head,
                          static_cast<uint32_t>(edges.num_packs * sizeof(Pack<T, VEC>)), &stage_full[warp]);
    }
    return row;
  };
  wait_for_previous_kernel();
  int64_t row = 0;
  if (lane == 0) {
    mbarrier_init(&stage_full[warp], 1);
    row = fetch_row(int64_t(blockIdx.x) * warps_per_block + warp);
  }
  if (threadIdx.x < kMaxTerms * kExactWords) (&block_sums[0][0])[threadIdx.x] = 0;
  // 'mean''s divisors, by this block's share of the targets (a fixed share, unlike its
  // rows), while the first rows are on their way. Ends with a barrier.
  if (params.divisors_by_blocks != nullptr) {
    count_block_targets(static_cast<const index_t*>(params.target), params.rows, num_classes, params.ignore_index,
                        params.weight, scratch_sum, params.divisors_by_blocks);
  }
  __syncthreads();
  row = __shfl_sync(0xffffffffu, row, 0);

  // Up to 32 row losses wait in the warp's lanes (lane k the k-th), then go into the
  // block's sums at once (warp_exact_add): off the path from row to row.
  float kept_ce = 0, kept_z = 0;
  int num_kept = 0;
  auto add_kept = [&] {
    warp_exact_add(block_sums[0], kept_ce, lane < num_kept);
    if (params.finish.num_terms > 1) warp_exact_add(block_sums[1], kept_z, lane < num_kept);
    num_kept = 0;
  };
  for (uint32_t phase = 0; row < params.rows; phase ^= 1u) {
    const T* x = params.logits + row * num_classes;
    const RowTarget t = row_target<index_t, false>(params, row);
    const RowEdges<T, VEC, kEdges> edges(x, num_classes);
    const Pack<T, VEC>* packs = row_in_stage(x, edges);
    const int num_packs = static_cast<int>(edges.num_packs);
    const bool has_edge = edges.has(lane);
    const acc_t edge_x = has_edge ? static_cast<acc_t>(edges.element(x, lane).val[0]) : acc_t(0);
    // Two passes over the stage, as the register path makes over its registers: the
    // max, then independent exp sums (an online max and sum chains every pack to the last).
    acc_t thread_max = has_edge ? edge_x : -infinity<acc_t>();
    mbarrier_wait(&stage_full[warp], phase);
#pragma unroll 8
    for (int p = lane; p < num_packs; p += 32) thread_max = max_acc(thread_max, pack_max(load_pack<T, VEC>(packs[p].val)));
    const acc_t row_max = warp_allreduce(thread_max, MaxOp());
    exp_sum_t thread_sum = has_edge ? exp_minus<T>(edge_x, row_max) : acc_t(0);
#pragma unroll 8
    for (int p = lane; p < num_packs; p += 32) {
      const Pack<T, VEC> pack = load_pack<T, VEC>(packs[p].val);
      acc_t pack_sum = 0;
#pragma unroll
      for (int j = 0; j < VEC; ++j) pack_sum += exp_minus<T>(static_cast<acc_t>(pack.val[j]), row_max);
      thread_sum += pack_sum;
    }
    const exp_sum_t row_sum = warp_allreduce(thread_sum, SumOp<exp_sum_t>());
    // Lane 0 takes the target's logit from the stage (or memory, for an edge element)
    // before every lane is past the stage and it is refilled.
    acc_t target_logit = 0;
    const int64_t target_in_packs = t.index - edges.head;
    if (lane == 0 && t.counted()) {
      target_logit = target_in_packs >= 0 && target_in_packs < edges.num_packs * VEC
                         ? static_cast<acc_t>(packs[target_in_packs / VEC].val[target_in_packs % VEC])
                         : static_cast<acc_t>(x[t.index]);
    }
    __syncwarp();
    // The next row: claimed after the passes (claimed before them, its round trip was not
    // hidden and the call took 1 us longer: notes, v29).
    const int64_t next = lane == 0 ? fetch_row(first_round + atomicAdd(next_row, 1u)) : 0;
    sum_t ce = 0, z = 0;
    finish_row<T, false, false, true>(params, row, t, row_max, row_sum, ClassSums<sum_t>{}, target_logit,
                                      GradientScales<acc_t>{}, false, lane == 0, ce, z);
    // finish_row's float terms, widened to double: exact as floats again.
    const float row_ce = __shfl_sync(0xffffffffu, static_cast<float>(ce), 0);
    const float row_z = __shfl_sync(0xffffffffu, static_cast<float>(z), 0);
    if (lane == num_kept) {
      kept_ce = row_ce;
      kept_z = row_z;
    }
    if (++num_kept == 32) add_kept();
    row = __shfl_sync(0xffffffffu, next, 0);
  }
  add_kept();
  __syncthreads();
  // The block's sums into the stream's (integer adds: any order gives the same bits), where
  // the last block reads them: one word a thread, and most words are 0.
  if (threadIdx.x < params.finish.num_terms * kExactWords) {
    const unsigned long long word = (&block_sums[0][0])[threadIdx.x];
    unsigned long long* sum = params.finish.exact_sums + threadIdx.x;
    if (word != 0) threadIdx.x % kExactWords == kExactLimbs ? atomicOr(sum, word) : atomicAdd(sum, word);
  }
  __syncthreads();  // the adds come before thread 0's ticket
  finish_if_last_block<true>(params.finish, scratch_sum);
}

}  // namespace fused_losses
