// cross_entropy/pipelined_kernel.cuh: cross_entropy_pipelined_kernel, sm_90's pipelined
// rows: long rows' gradients, the rows brought into shared memory by the copy engine,
// split among a cluster of blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cross_entropy/row_math.cuh"
#include "device.cuh"
#include "finish.cuh"
#include "launch.cuh"
#include "sm90.cuh"

namespace fused_losses {

// sm_90 (sm90_supported): the gradient of rows too long for registers, class-index targets
// without label smoothing. Rows come into shared memory by the copy engine, params.stages
// deep: while a block works on one row, the next rows' bytes are already on their way
// into its other stages, so the reads wait neither for its reductions nor for its
// gradient pass (the streamed kernel's reads stop for both). A row longer than a stage
// is split among a cluster of blocks on neighbouring multiprocessors, one segment of
// params.stash_packs packs each: each reduces its segment and sends the result to every
// block of the cluster (st.async, completing a barrier there: a cluster-wide barrier's
// release would wait for the block's gradient stores to drain, every row), and each
// writes its segment's gradient. Every row is read from HBM once.
// 512 threads: 256, 768 and 1024 were slower (notes, v21).
constexpr int kPipelineThreads = 512;
constexpr int kMaxPipelineStages = 3;
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size

// A segment's part of its row: its max and sum of exp(x - max), and the target's logit
// where the segment holds it (0 elsewhere, so the parts' sum is the target's logit).
template <typename acc_t, typename sum_type>
struct alignas(8) RowPart {
  MaxSum<acc_t, sum_type> max_sum;
  acc_t target_logit;
};

// A row's reductions across the cluster: each block sends its segment's part to every
// block of the cluster (st.async, completing a barrier there), then combines them all, the
// max first (allreduce_max_sum). Two slots, alternating row by row (parts).
template <typename Part, typename Pair, typename acc_t>
__device__ __forceinline__ void combine_cluster_parts(int64_t k, int rank, int blocks,
                                                      Part (&parts)[2][kMaxClusterBlocks], uint64_t (&parts_full)[2],
                                                      Pair& acc, acc_t& target_logit, acc_t s) {
  const int slot = static_cast<int>(k & 1);
  if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&parts_full[slot], blocks * sizeof(Part));
  if (threadIdx.x < blocks) {
    store_to_cluster_block(&parts[slot][rank], Part{acc, target_logit}, &parts_full[slot], threadIdx.x);
  }
  mbarrier_wait(&parts_full[slot], static_cast<uint32_t>(k >> 1) & 1u);
  // Combined in rank order by every block: each computes the same bits.
  acc.max = parts[slot][0].max_sum.max;
  for (int b = 1; b < blocks; ++b) acc.max = max_acc(acc.max, parts[slot][b].max_sum.max);
  acc.sum = 0;
  target_logit = 0;
  for (int b = 0; b < blocks; ++b) {
    acc.sum += sum_relative_to(parts[slot][b].max_sum, acc.max, s);
    target_logit += parts[slot][b].target_logit;
  }
}

// The gradient of a block's segment of a row (`packs` packs from `begin`, in its stage),
// into gx (the row's gradient):
// the packs without the one-hot term, then the target's element again with it, by the
// thread that wrote its pack (its second store lands after its first), and rank 0's edge
// elements (has_edge).
template <typename T, int VEC, bool kEdges, typename acc_t>
__device__ __forceinline__ void write_segment_gradient(const CrossEntropyParams<T>& params, T* gx,
                                                       const RowTarget& t, const RowEdges<T, VEC, kEdges>& edges,
                                                       const T* x, int64_t begin, int64_t packs,
                                                       const Pack<T, VEC>* segment, bool target_here,
                                                       int64_t target_in_segment, bool has_edge,
                                                       const RowGradient<acc_t>& g) {
  T* gx_segment = gx + edges.head + begin * VEC;
  const Pack<T, 1> no_target{};
  for (int p = threadIdx.x; p < static_cast<int>(packs); p += kPipelineThreads) {
    store_grad_pack<T, VEC, false, false, false>(load_pack<T, VEC>(segment[p].val), Pack<T, VEC>{}, p * VEC, g,
                                                 params.exp_c, params.weight, gx_segment, nullptr);
  }
  if (target_here && (target_in_segment / VEC) % kPipelineThreads == threadIdx.x) {
    Pack<T, 1> target_x;
    target_x.val[0] = segment[target_in_segment / VEC].val[target_in_segment % VEC];
    store_grad_pack<T, 1, false, false>(target_x, no_target, t.index, g, params.exp_c, params.weight, gx, nullptr);
  }
  if (has_edge) {
    store_grad_pack<T, 1, false, false>(edges.element(x, threadIdx.x), no_target, edges.class_of(threadIdx.x), g,
                                        params.exp_c, params.weight, gx, nullptr);
  }
}

template <typename T, int VEC, bool kEdges>
__global__ void __launch_bounds__(kPipelineThreads) cross_entropy_pipelined_kernel(CrossEntropyParams<T> params) {
  using acc_t = acc_type<T>;
  using Pair = MaxSum<acc_t, exp_sum_type<T>>;
  using Part = RowPart<acc_t, exp_sum_type<T>>;
  wait_for_previous_kernel();
  if (params.starts_next_kernel) start_next_kernel();  // the stashed kernel beside this one
  if (recompute_is_needless(params.guess_source, params.guess)) return;  // the whole cluster alike
  __shared__ acc_t scratch_max[32];
  __shared__ exp_sum_type<T> scratch_exp_sum[32];
  __shared__ sum_t scratch_sum[32];
  __shared__ acc_t target_logit_here;
  // Every block's part of the row, as the blocks send them; two rows' worth, so a block
  // that starts its next row cannot overwrite one that a slower block is still reading
  // (it can get no further: that row needs the slower block's part).
  __shared__ Part parts[2][kMaxClusterBlocks];
  __shared__ uint64_t parts_full[2];
  __shared__ uint64_t stage_full[kMaxPipelineStages];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int64_t num_classes = params.num_classes;
  const int64_t segment_packs = params.stash_packs;
  // Stages from a kBulkCopyAlign boundary, each with room to place its copy at the same
  // offset from a boundary as its source (bulk_copy_offset).
  const Pack<T, VEC>* stage_packs = reinterpret_cast<const Pack<T, VEC>*>(align_shared<kBulkCopyAlign>(dynamic_smem));
  const int64_t stage_stride = bulk_stage_packs<T, VEC>(segment_packs);
  // Where a row's segment from `begin` comes from in memory, and lands in `stage`.
  auto segment_source = [&](const T* x, const RowEdges<T, VEC, kEdges>& edges, int64_t begin) {
    return x + edges.head + begin * VEC;
  };
  auto stage_segment = [&](int stage, const T* src) {
    return stage_packs + stage * stage_stride + bulk_copy_offset<T, VEC>(src);
  };
  const int stages = params.stages;
  const ClusterPlace place = cluster_place();
  const int rank = place.rank, blocks = place.blocks;
  // The cluster's k-th row: every block of a cluster walks the same rows. Divided once, not a row.
  const int64_t first_row = blockIdx.x / blocks, row_step = gridDim.x / blocks;
  auto row_of = [&](int64_t k) { return first_row + k * row_step; };
  auto segment_begin = [&](const RowEdges<T, VEC, kEdges>& edges) {
    return std::min<int64_t>(edges.num_packs, rank * segment_packs);
  };
  auto segment_end = [&](const RowEdges<T, VEC, kEdges>& edges) {
    return std::min<int64_t>(edges.num_packs, (rank + 1) * segment_packs);
  };
  // Thread 0: the k-th row's segment into `stage` (k % stages).
  auto fill_stage = [&](int64_t k, int stage) {
    const int64_t row = row_of(k);
    if (row >= params.rows) return;
    const T* x = params.logits + row * num_classes;
    const RowEdges<T, VEC, kEdges> edges(x, num_classes);
    const int64_t begin = segment_begin(edges);
    const T* src = segment_source(x, edges, begin);
    bulk_copy_to_shared(const_cast<Pack<T, VEC>*>(stage_segment(stage, src)), src,
                        static_cast<uint32_t>((segment_end(edges) - begin) * sizeof(Pack<T, VEC>)), &stage_full[stage]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&stage_full[s], 1);
    for (int s = 0; s < 2; ++s) mbarrier_init(&parts_full[s], 1);
  }
  __syncthreads();
  if (blocks > 1) cluster_sync();  // every block's barriers are ready before parts arrive
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) fill_stage(s, s);
  }
  const GradientScales<acc_t> scales = gradient_scales<T, false>(params, true, scratch_sum);
  sum_t block_ce = 0, block_z = 0;  // meaningful in thread 0

  // The k-th row's stage (k % stages) and the parity of its barrier's phase (k / stages
  // % 2), counted rather than divided: stages is not a compile-time constant.
  int stage = 0;
  uint32_t stage_phase = 0;
  for (int64_t k = 0; row_of(k) < params.rows; ++k) {
    const int64_t row = row_of(k);
    const T* x = params.logits + row * num_classes;
    const RowTarget t = row_target<false>(params, row);
    const RowEdges<T, VEC, kEdges> edges(x, num_classes);
    const int64_t begin = segment_begin(edges), packs = segment_end(edges) - begin;
    // The row's edge elements are rank 0's, read from memory (no other block writes them).
    const bool has_edge = rank == 0 && edges.has(threadIdx.x);
    // Where the target lies: an edge element (rank 0's), or this block's segment.
    const int64_t target_in_segment = t.index - edges.head - begin * VEC;
    const bool target_on_edge = t.counted() && (t.index < edges.head || t.index >= edges.head + edges.num_packs * VEC);
    const bool target_here =
        t.counted() && !target_on_edge && target_in_segment >= 0 && target_in_segment < packs * VEC;
    Pair acc{-infinity<acc_t>(), 0};
    if (has_edge) acc = add_pack(acc, edges.element(x, threadIdx.x), params.exp_c);
    const Pack<T, VEC>* segment = stage_segment(stage, segment_source(x, edges, begin));
    mbarrier_wait(&stage_full[stage], stage_phase);
    // The target's logit where this block holds it: from its stage, or an edge (rank 0).
    // Not from memory in a pack of another block's segment: that block may already be
    // writing its gradient there (inplace_backward).
    if (threadIdx.x == 0) {
      acc_t logit = 0;
      if (target_on_edge && rank == 0) logit = static_cast<acc_t>(x[t.index]);
      if (target_here) logit = static_cast<acc_t>(segment[target_in_segment / VEC].val[target_in_segment % VEC]);
      target_logit_here = logit;  // read by all after the block's reduction
    }
    for (int p = threadIdx.x; p < static_cast<int>(packs); p += kPipelineThreads) {
      acc = add_pack(acc, load_pack<T, VEC>(segment[p].val), params.exp_c);
    }
    acc = allreduce_max_sum<false>(acc, params.inverse_temperature, scratch_max, scratch_exp_sum);
    acc_t target_logit = target_logit_here;
    if (blocks > 1) {
      combine_cluster_parts(k, rank, blocks, parts, parts_full, acc, target_logit, params.inverse_temperature);
    }
    const RowGradient<acc_t> g = finish_row<T, false, false, false>(
        params, row, t, acc.max, acc.sum, ClassSums<sum_t>{}, target_logit, scales, true, threadIdx.x == 0 && rank == 0,
        block_ce, block_z);  // rank 0 alone writes the row's loss and lse: one writer, the same bits every run

    T* gx = params.grad_logits + row * num_classes;
    write_segment_gradient(params, gx, t, edges, x, begin, packs, segment, target_here, target_in_segment, has_edge, g);
    __syncthreads();  // every thread is done with the stage: the copy engine may refill it
    if (threadIdx.x == 0) fill_stage(k + stages, stage);
    if (++stage == stages) {
      stage = 0;
      stage_phase ^= 1u;
    }
  }
  // No block leaves while a part it sent may still be landing in another's memory.
  if (blocks > 1) cluster_sync();
  if (params.finish.partials == nullptr) return;
  if (threadIdx.x == 0) {
    params.finish.partials[blockIdx.x] = block_ce;  // 0 but in rank 0
    params.finish.partials[params.finish.num_partials + blockIdx.x] = block_z;
  }
  finish_if_last_block(params.finish, scratch_sum);
}

}  // namespace fused_losses
