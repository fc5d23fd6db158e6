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
// Two groups of warps, a row apart: the reducers reduce row k + 1 while the writers write
// row k's gradient, so that neither's latencies (the reduction's barriers and shuffles, the
// cluster's exchange) leave the multiprocessor idle. The reducers' leader finishes each row
// and hands its gradient's coefficients to the writers in shared memory, one slot a stage.
// 512 threads: 256, 768 and 1024 were slower, with one group (notes, v21, v67).
constexpr int kPipelineThreads = 512;
// The reducers are threads [0, reducers), the writers the rest: more reducers where a block
// holds a whole row (kClustered false), fewer where a cluster shares it (H200, 320 / 192
// against 256 / 256: 8192 x 32000 -6.5%, 8192 x 128256 +7%). As constants: chosen at run
// time, 8192 x 50257 and 32000 ran 2% slower (notes, v68).
constexpr int pipeline_reducers(bool clustered) { return clustered ? 256 : 320; }
constexpr int kMaxPipelineStages = 3;
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size
// Named barriers: each group's own, and one a stage that the reducers arrive at and the
// writers wait at (its row's coefficients are in its slot).
constexpr int kReducersBarrier = 1, kWritersBarrier = 2, kFirstRowReadyBarrier = 3;

// A segment's part of its row: its max and sum of exp(x - max), and the target's logit
// where the segment holds it (0 elsewhere, so the parts' sum is the target's logit).
template <typename acc_t, typename sum_type>
struct alignas(8) RowPart {
  MaxSum<acc_t, sum_type> max_sum;
  acc_t target_logit;
};

// A row's reductions across the cluster, by the reducers' leader: it sends its segment's
// part to every block of the cluster (st.async, completing a barrier there), then
// combines them all, the max first. Two slots, alternating row by row (parts).
template <typename Part, typename Pair, typename acc_t>
__device__ __forceinline__ void combine_cluster_parts(int64_t k, int rank, int blocks,
                                                      Part (&parts)[2][kMaxClusterBlocks], uint64_t (&parts_full)[2],
                                                      Pair& acc, acc_t& target_logit, acc_t s) {
  const int slot = static_cast<int>(k & 1);
  mbarrier_arrive_expect_tx(&parts_full[slot], blocks * sizeof(Part));
  for (int b = 0; b < blocks; ++b) {
    store_to_cluster_block(&parts[slot][rank], Part{acc, target_logit}, &parts_full[slot], b);
  }
  mbarrier_wait(&parts_full[slot], static_cast<uint32_t>(k >> 1) & 1u);
  // Combined in rank order by every block's leader: each computes the same bits.
  acc.max = parts[slot][0].max_sum.max;
  for (int b = 1; b < blocks; ++b) acc.max = max_acc(acc.max, parts[slot][b].max_sum.max);
  acc.sum = 0;
  target_logit = 0;
  for (int b = 0; b < blocks; ++b) {
    acc.sum += sum_relative_to(parts[slot][b].max_sum, acc.max, s);
    target_logit += parts[slot][b].target_logit;
  }
}

// Where a class lies for a block: an edge element (rank 0's), or in its segment (at `in_segment`), or neither.
struct SegmentPlace {
  bool on_edge, here;
  int64_t in_segment;
};

// Where a block's segment of a row lies.
template <typename T, int VEC, bool kEdges>
struct RowSegment {
  RowEdges<T, VEC, kEdges> edges;
  int64_t begin, packs;  // the segment's first pack and its number of packs

  __device__ __forceinline__ RowSegment(const T* x, int64_t num_classes, int rank, int64_t segment_packs)
      : edges(x, num_classes) {
    begin = std::min<int64_t>(edges.num_packs, rank * segment_packs);
    packs = std::min<int64_t>(edges.num_packs, (rank + 1) * segment_packs) - begin;
  }
  __device__ __forceinline__ const T* source(const T* x) const { return x + edges.head + begin * VEC; }
  // Where class c lies (counted: a target with a loss; else nowhere).
  __device__ __forceinline__ SegmentPlace place_of(int64_t c, bool counted) const {
    const int64_t in_segment = c - edges.head - begin * VEC;
    const bool on_edge = counted && (c < edges.head || c >= edges.head + edges.num_packs * VEC);
    return {on_edge, counted && !on_edge && in_segment >= 0 && in_segment < packs * VEC, in_segment};
  }
};

// The writers' part of a row (w: the writer's index): the gradient of the block's segment
// (in its stage) into gx, without the one-hot term, then the target's element again with
// it, by the writer that wrote its pack (its second store lands after its first), and rank
// 0's edge elements.
template <int writers, typename T, int VEC, bool kEdges, typename acc_t>
__device__ __forceinline__ void write_segment_gradient(const CrossEntropyParams<T>& params, T* gx, const T* x,
                                                       const RowSegment<T, VEC, kEdges>& seg,
                                                       const Pack<T, VEC>* segment, bool has_edge, int w,
                                                       const RowGradient<acc_t>& g) {
  const SegmentPlace target = seg.place_of(g.one_hot, g.one_hot >= 0);
  T* gx_segment = gx + seg.edges.head + seg.begin * VEC;
  const Pack<T, 1> no_target{};
  for (int p = w; p < static_cast<int>(seg.packs); p += writers) {
    store_grad_pack<T, VEC, false, false, false>(load_pack<T, VEC>(segment[p].val), Pack<T, VEC>{}, p * VEC, g,
                                                 params.exp_c, params.weight, gx_segment, nullptr);
  }
  if (target.here && static_cast<int>(target.in_segment / VEC) % writers == w) {
    Pack<T, 1> target_x;
    target_x.val[0] = segment[target.in_segment / VEC].val[target.in_segment % VEC];
    store_grad_pack<T, 1, false, false>(target_x, no_target, g.one_hot, g, params.exp_c, params.weight, gx, nullptr);
  }
  if (has_edge) {
    store_grad_pack<T, 1, false, false>(seg.edges.element(x, w), no_target, seg.edges.class_of(w), g, params.exp_c,
                                        params.weight, gx, nullptr);
  }
}

// kClustered: launched in clusters of more than one block (pipelined_kernel).
template <typename T, int VEC, bool kEdges, bool kClustered>
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
  // Every block's part of the row, as the blocks send them; two rows' worth, so a block
  // that starts its next row cannot overwrite one that a slower block is still reading
  // (it can get no further: that row needs the slower block's part).
  __shared__ Part parts[2][kMaxClusterBlocks];
  __shared__ uint64_t parts_full[2];
  __shared__ uint64_t stage_full[kMaxPipelineStages];
  __shared__ RowGradient<acc_t> row_gradient[kMaxPipelineStages];  // the reducers' leader's, for the writers
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  const int64_t num_classes = params.num_classes;
  const int64_t segment_packs = params.stash_packs;
  // Stages from a kBulkCopyAlign boundary, each with room to place its copy at the same
  // offset from a boundary as its source (bulk_copy_offset).
  const Pack<T, VEC>* stage_packs = reinterpret_cast<const Pack<T, VEC>*>(align_shared<kBulkCopyAlign>(dynamic_smem));
  const int64_t stage_stride = bulk_stage_packs<T, VEC>(segment_packs);
  auto stage_segment = [&](int stage, const T* src) {
    return stage_packs + stage * stage_stride + bulk_copy_offset<T, VEC>(src);
  };
  const int stages = params.stages;
  const ClusterPlace place = cluster_place();
  const int rank = place.rank, blocks = place.blocks;
  // The cluster's k-th row: every block of a cluster walks the same rows. Divided once, not a row.
  const int64_t first_row = blockIdx.x / blocks, row_step = gridDim.x / blocks;
  auto row_of = [&](int64_t k) { return first_row + k * row_step; };
  // The k-th row's segment into `stage` (k % stages), by one thread.
  auto fill_stage = [&](int64_t k, int stage) {
    const int64_t row = row_of(k);
    if (row >= params.rows) return;
    const T* x = params.logits + row * num_classes;
    const RowSegment<T, VEC, kEdges> seg(x, num_classes, rank, segment_packs);
    const T* src = seg.source(x);
    bulk_copy_to_shared(const_cast<Pack<T, VEC>*>(stage_segment(stage, src)), src,
                        static_cast<uint32_t>(seg.packs * sizeof(Pack<T, VEC>)), &stage_full[stage]);
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
  auto next_stage = [&] {
    if (++stage == stages) {
      stage = 0;
      stage_phase ^= 1u;
    }
  };
  constexpr int reducers = pipeline_reducers(kClustered), writers = kPipelineThreads - reducers;
  if (threadIdx.x < reducers) {
    for (int64_t k = 0; row_of(k) < params.rows; ++k, next_stage()) {
      const int64_t row = row_of(k);
      const T* x = params.logits + row * num_classes;
      const RowSegment<T, VEC, kEdges> seg(x, num_classes, rank, segment_packs);
      // The row's edge elements are rank 0's, read from memory (no other block writes them).
      const bool has_edge = rank == 0 && seg.edges.has(threadIdx.x);
      Pair acc{-infinity<acc_t>(), 0};
      if (has_edge) acc = add_pack(acc, seg.edges.element(x, threadIdx.x), params.exp_c);
      const Pack<T, VEC>* segment = stage_segment(stage, seg.source(x));
      mbarrier_wait(&stage_full[stage], stage_phase);
      // The target (the leader's alone) and its logit where this block holds it: from its
      // stage, or an edge (rank 0). Not from memory in a pack of another block's segment:
      // that block's writers may already be writing its gradient there (inplace_backward).
      RowTarget t{};
      acc_t target_logit = 0;
      if (threadIdx.x == 0) {
        t = row_target<false>(params, row);
        const SegmentPlace target = seg.place_of(t.index, t.counted());
        if (target.on_edge && rank == 0) target_logit = static_cast<acc_t>(x[t.index]);
        if (target.here) {
          target_logit = static_cast<acc_t>(segment[target.in_segment / VEC].val[target.in_segment % VEC]);
        }
      }
      for (int p = threadIdx.x; p < static_cast<int>(seg.packs); p += reducers) {
        acc = add_pack(acc, load_pack<T, VEC>(segment[p].val), params.exp_c);
      }
      acc = allreduce_max_sum<false>(acc, params.inverse_temperature, scratch_max, scratch_exp_sum, kReducersBarrier,
                                     reducers);
      if (threadIdx.x == 0) {
        if (blocks > 1) {
          combine_cluster_parts(k, rank, blocks, parts, parts_full, acc, target_logit, params.inverse_temperature);
        }
        // Rank 0 alone writes the row's loss and lse: one writer, the same bits every run.
        row_gradient[stage] = finish_row<T, false, false, false>(params, row, t, acc.max, acc.sum, ClassSums<sum_t>{},
                                                                 target_logit, scales, true, rank == 0, block_ce,
                                                                 block_z);
      }
      named_barrier_arrive(kFirstRowReadyBarrier + stage, kPipelineThreads);
    }
  } else {
    const int w = threadIdx.x - reducers;
    for (int64_t k = 0; row_of(k) < params.rows; ++k, next_stage()) {
      const int64_t row = row_of(k);
      const T* x = params.logits + row * num_classes;
      const RowSegment<T, VEC, kEdges> seg(x, num_classes, rank, segment_packs);
      named_barrier_sync(kFirstRowReadyBarrier + stage, kPipelineThreads);
      // Long complete (the reducers waited on it): so that the stage's bytes are seen here too.
      mbarrier_wait(&stage_full[stage], stage_phase);
      const RowGradient<acc_t> g = row_gradient[stage];
      const Pack<T, VEC>* segment = stage_segment(stage, seg.source(x));
      write_segment_gradient<writers>(params, params.grad_logits + row * num_classes, x, seg, segment,
                                      rank == 0 && seg.edges.has(w), w, g);
      // Every writer is done with the stage: the copy engine may refill it.
      named_barrier_sync(kWritersBarrier, writers);
      if (w == 0) fill_stage(k + stages, stage);
    }
  }
  __syncthreads();
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
