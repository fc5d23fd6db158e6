// cross_entropy/row_kernels.cuh: cross_entropy_kernel, every path but sm_90's: rows in
// registers and streamed rows, by a block per row, or without a gradient by a warp per row.
#pragma once

#include <cstdint>

#include "cross_entropy/row_math.cuh"
#include "device.cuh"
#include "finish.cuh"
#include "launch.cuh"

namespace fused_losses {

// The threads that read a row together: the whole block, or (warps) each warp its own
// rows, reduced without a barrier (where and why: use_warp_rows). Read from the special
// registers when used, not held: held, they cost the block kernels registers.
template <bool kWarps>
struct RowTeam {
  // This thread's place in the team, and the team's threads.
  __device__ __forceinline__ int rank() const { return kWarps ? threadIdx.x % 32 : threadIdx.x; }
  __device__ __forceinline__ int size() const { return kWarps ? 32 : blockDim.x; }
  // The team's first row, and the distance to its next (grid-stride over rows).
  __device__ __forceinline__ int64_t first_row() const {
    return kWarps ? int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32 : int64_t(blockIdx.x);
  }
  __device__ __forceinline__ int64_t row_stride() const {
    return kWarps ? int64_t(gridDim.x) * (blockDim.x / 32) : int64_t(gridDim.x);
  }
  __device__ __forceinline__ bool leader() const { return rank() == 0; }
  // Every thread of the team gets the result. A warp's needs no barrier, nor scratch.
  template <typename V, typename Combine>
  __device__ __forceinline__ V allreduce(V value, Combine combine, V identity, V* scratch) const {
    if constexpr (kWarps) return warp_allreduce(value, combine);
    return block_allreduce(value, combine, identity, scratch);
  }
};

// Packs per thread in flight when a row is streamed: 4 x 16 B per thread is what covered
// memory latency (notes: v3).
constexpr int kStreamLoadsAhead = 4;

// Visits every pack of a row read from memory (with the matching pack of target
// probabilities when kProbs), kStreamLoadsAhead packs in flight per thread: visit(x, y,
// index). `backwards` visits the row from its end: a second pass over a row then starts
// with what the first pass read last, the part most likely still in L2 (front to back,
// each miss would evict the next part this pass needs).
template <typename T, int VEC, bool kProbs, typename Team, typename Visit>
__device__ __forceinline__ void for_each_row_pack(const T* x, const T* y, int64_t num_packs, bool backwards,
                                                  const Team& team, Visit visit) {
  Pack<T, VEC> none;
  auto pack_at = [&](int64_t p) { return backwards ? num_packs - 1 - p : p; };
  int64_t p = team.rank();
  for (; p + (kStreamLoadsAhead - 1) * team.size() < num_packs; p += kStreamLoadsAhead * team.size()) {
    Pack<T, VEC> xs[kStreamLoadsAhead], ys[kProbs ? kStreamLoadsAhead : 1];
#pragma unroll
    for (int u = 0; u < kStreamLoadsAhead; ++u) {
      xs[u] = load_pack<T, VEC>(x + pack_at(p + u * team.size()) * VEC);
      if constexpr (kProbs) ys[u] = load_pack<T, VEC>(y + pack_at(p + u * team.size()) * VEC);
    }
#pragma unroll
    for (int u = 0; u < kStreamLoadsAhead; ++u) visit(xs[u], kProbs ? ys[u] : none, pack_at(p + u * team.size()));
  }
  for (; p < num_packs; p += team.size()) {
    const int64_t q = pack_at(p);
    visit(load_pack<T, VEC>(x + q * VEC), kProbs ? load_pack<T, VEC>(y + q * VEC) : none, q);
  }
}

// Threads of a block that streams a row and stashes its front, one such block per
// multiprocessor with all of its shared memory (two blocks of 256 with half each were
// slower). 1024 where the kernel fits in 64 registers, class-index targets without label
// smoothing in 2- and 4-byte dtypes: twice the loads in flight of 512 (notes, v20); the
// class sums and float64 need more registers.
template <typename T>
constexpr int stash_threads(bool probs, bool class_sums) {
  return probs || class_sums || sizeof(T) > 4 ? kMaxThreads : 1024;
}

// The register-row reduction: every load of the row issued before the first is used (the
// whole row in flight at once), then exact passes over the registers: the max, then
// sum(exp(x - max)) and the class sums, relative to the max.
template <typename T, int VEC, bool kEdges, bool kProbs, bool kClassSums, int kPacks, typename Team, typename acc_t,
          typename exp_sum_t, typename ReadTargetLogit>
__device__ __forceinline__ void reduce_row_in_registers(const CrossEntropyParams<T>& params, const Team& team,
                                                        const RowEdges<T, VEC, kEdges>& edges, const T* x, const T* y,
                                                        const T* x_packs, const T* y_packs, bool has_edge,
                                                        Pack<T, VEC> (&cache)[kPacks],
                                                        Pack<T, VEC> (&target_cache)[kProbs ? kPacks : 1],
                                                        ReadTargetLogit read_target_logit, acc_t* scratch,
                                                        exp_sum_t* scratch_exp_sum, acc_t& row_max, exp_sum_t& sum,
                                                        ClassSums<sum_t>& sums) {
  const int64_t num_packs = edges.num_packs;
  auto cached_pack = [&](int k) { return team.rank() + int64_t(k) * team.size(); };
  auto edge = [&](const T* row) { return edges.element(row, team.rank()); };
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = cached_pack(k);
    if (p < num_packs) {
      cache[k] = load_pack<T, VEC>(x_packs + p * VEC);
      if constexpr (kProbs) target_cache[k] = load_pack<T, VEC>(y_packs + p * VEC);
    }
  }
  read_target_logit();
  acc_t thread_max = has_edge ? static_cast<acc_t>(edge(x).val[0]) : -infinity<acc_t>();
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (cached_pack(k) < num_packs) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) thread_max = max_acc(thread_max, static_cast<acc_t>(cache[k].val[j]));
    }
  }
  row_max = block_allreduce(thread_max, MaxOp(), -infinity<acc_t>(), scratch);
  exp_sum_t thread_sum = 0;
  if (has_edge) {
    const Pack<T, 1> edge_x = edge(x);
    thread_sum = exp_minus_scaled<T>(static_cast<acc_t>(edge_x.val[0]), row_max, params.exp_c);
    if constexpr (kClassSums) {
      sums.add(pack_class_sums<kProbs>(edge_x, kProbs ? edge(y) : edge_x, edges.class_of(team.rank()), params.weight,
                                       row_max));
    }
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int64_t p = cached_pack(k);
    if (p < num_packs) {
      acc_t pack_sum = 0;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        pack_sum += exp_minus_scaled<T>(static_cast<acc_t>(cache[k].val[j]), row_max, params.exp_c);
      }
      thread_sum += pack_sum;
      if constexpr (kClassSums) {
        sums.add(pack_class_sums<kProbs>(cache[k], target_cache[kProbs ? k : 0], edges.head + p * VEC, params.weight,
                                         row_max));
      }
    }
  }
  sum = block_sum(thread_sum, scratch_exp_sum);
}

// The gradient pass of a row into gx and gy (its rows of grad_logits and grad_target, or
// nullptr): from the registers, or for a streamed row the part not stashed and then the
// stash; then each thread's edge element.
template <typename T, int VEC, bool kEdges, bool kProbs, bool kClassSums, bool kStreamed, int kPacks, typename Team,
          typename acc_t>
__device__ __forceinline__ void write_row_gradient(const CrossEntropyParams<T>& params, const Team& team,
                                                   const RowEdges<T, VEC, kEdges>& edges, const T* x, const T* y,
                                                   const T* x_packs, const T* y_packs, bool has_edge,
                                                   const Pack<T, VEC> (&cache)[kPacks],
                                                   const Pack<T, VEC> (&target_cache)[kProbs ? kPacks : 1],
                                                   const Pack<T, VEC>* stash, int64_t stash_packs,
                                                   const RowGradient<acc_t>& g, T* gx, T* gy) {
  const int64_t num_packs = edges.num_packs;
  auto first_class = [&](int64_t p) { return edges.head + p * VEC; };
  auto edge = [&](const T* row) { return edges.element(row, team.rank()); };
  if constexpr (!kStreamed) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int64_t p = team.rank() + int64_t(k) * team.size();
      if (p < num_packs) {
        store_grad_pack<T, VEC, kProbs, kClassSums>(cache[k], target_cache[kProbs ? k : 0], first_class(p), g,
                                                    params.exp_c, params.weight, gx, gy);
      }
    }
  } else {
    // The part not stashed first, from its end: L2 still holds what the first pass
    // read last. Then the stash, each thread the packs it stashed itself, so no
    // barrier is needed here or before the next row's first pass refills it.
    const int64_t rest = stash_packs * VEC;
    for_each_row_pack<T, VEC, kProbs>(x_packs + rest, kProbs ? y_packs + rest : y_packs, num_packs - stash_packs,
                                      true, team, [&](const Pack<T, VEC>& xp, const Pack<T, VEC>& yp, int64_t p) {
      store_grad_pack<T, VEC, kProbs, kClassSums>(xp, yp, first_class(stash_packs + p), g, params.exp_c, params.weight, gx, gy);
    });
    for (int64_t p = team.rank(); p < stash_packs; p += team.size()) {
      // By value, so the pack is one 16-byte shared load: through a reference the
      // compiler reads it element by element (8 LDS.U16 per bf16 pack, per ncu).
      const Pack<T, VEC> xp = load_pack<T, VEC>(stash[p].val);
      const Pack<T, VEC> yp = kProbs ? load_pack<T, VEC>(y_packs + p * VEC) : Pack<T, VEC>{};
      store_grad_pack<T, VEC, kProbs, kClassSums>(xp, yp, first_class(p), g, params.exp_c, params.weight, gx, gy);
    }
  }
  // Each thread writes its own edge element, which no other thread reads: no barrier
  // is needed here either, and with inplace_backward it still holds the logit.
  if (has_edge) {
    store_grad_pack<T, 1, kProbs, kClassSums>(edge(x), kProbs ? edge(y) : Pack<T, 1>{}, edges.class_of(team.rank()),
                                              g, params.exp_c, params.weight, gx, gy);
  }
}

// One block per row (grid-stride over rows). A row that fits the register cache is read
// from HBM once: max, then sum(exp(x - max)) (and the class sums), are exact passes over
// registers, and the gradient is written from them. A longer row (kStreamed) is read
// with an online max/sum; for the gradient, its front comes from the shared-memory stash
// and the rest is read again, mostly from L2. Two instantiations rather than one kernel
// with both paths: each path's registers are then its own. kSumOnly: a scalar loss with
// no gradient, lse or per-row loss, an instantiation without their code and registers
// (more blocks per multiprocessor, for the forward of a no-grad call). kWarpRows: the
// sum-only streamed kernel with a warp per row rather than a block (RowTeam; class-index
// targets without label smoothing, the forward's usual case).
template <typename T, int VEC, bool kEdges, bool kProbs, bool kClassSums, bool kStreamed,
          bool kSumOnly, bool kWarpRows = false>
// The streamed class-sums kernels with a gradient: at least 1 block (0: no bound), else ptxas aims at
// two 512-thread blocks, 64 registers, and spills (H200: 3-6% slower with label smoothing).
__global__ void __launch_bounds__(kStreamed && !kSumOnly ? stash_threads<T>(kProbs, kClassSums) : kMaxThreads,
                                   kStreamed && !kSumOnly && kClassSums ? 1 : 0)
    cross_entropy_kernel(CrossEntropyParams<T> params) {
  static_assert(!kWarpRows || (kStreamed && kSumOnly && !kProbs && !kClassSums), "warp rows: sum-only, streamed");
  using acc_t = acc_type<T>;
  constexpr int kPacks = cache_packs<kProbs>();
  __shared__ acc_t scratch[32];
  using exp_sum_t = exp_sum_type<T>;
  __shared__ exp_sum_t scratch_exp_sum[32];
  __shared__ ClassSums<sum_t> scratch_sums[kClassSums ? 32 : 1];
  __shared__ sum_t scratch_sum[32];
  const int64_t num_classes = params.num_classes;
  constexpr bool row_in_registers = !kStreamed;
  // Bytes, not Pack<T, VEC>: every instantiation of this template shares the one array.
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  Pack<T, VEC>* stash = reinterpret_cast<Pack<T, VEC>*>(dynamic_smem);
  const RowTeam<kWarpRows> team;
  // Constant false in kSumOnly: the gradient pass below compiles out.
  const bool want_grad = !kSumOnly && (params.grad_logits != nullptr || params.grad_target != nullptr);

  // Beside the pipelined kernel (params.beside_previous_kernel) its rows are not that kernel's: it is
  // waited for at the end.
  if (!params.beside_previous_kernel) wait_for_previous_kernel();
  if (recompute_is_needless(params.guess_source, params.guess)) {
    if (params.beside_previous_kernel) wait_for_previous_kernel();
    return;
  }
  const GradientScales<acc_t> scales = gradient_scales<T, kProbs>(params, want_grad, scratch_sum);
  sum_t block_ce = 0, block_z = 0;  // meaningful in team leaders

  for (int64_t row = team.first_row(); row < params.rows; row += team.row_stride()) {
    const T* x = params.logits + row * num_classes;
    const T* y = kProbs ? static_cast<const T*>(params.target.data) + row * num_classes : nullptr;
    const RowTarget t = row_target<kProbs>(params, row);
    // The target's logit, for thread 0's loss. Read after the row's loads are issued (its
    // address waits for the target index), and before the first barrier, after which
    // threads may overwrite the row with its gradient (inplace_backward).
    acc_t target_logit = 0;
    auto read_target_logit = [&] {
      if (!kProbs && t.counted() && team.leader()) target_logit = static_cast<acc_t>(x[t.index]);
    };
    // The reference of the class sums for a row read in one pass; 0 when x[0] is -inf
    // (a masked class), which would make every x - ref infinite.
    acc_t first_logit = kClassSums && !row_in_registers ? static_cast<acc_t>(x[0]) : acc_t(0);
    if (!isfinite(first_logit)) first_logit = 0;

    // The row's 16-byte packs begin at its first 16-byte aligned element (RowEdges); the
    // few elements before and after them are read one per thread.
    const RowEdges<T, VEC, kEdges> edges(x, num_classes);
    const int64_t num_packs = edges.num_packs;
    const T* x_packs = x + edges.head;
    const T* y_packs = kProbs ? y + edges.head : y;
    auto first_class = [&](int64_t p) { return edges.head + p * VEC; };
    const int64_t stash_packs = params.stash_packs < num_packs ? params.stash_packs : num_packs;
    // Fewer than 2 * VEC <= 16 edge elements: a warp holds them all.
    const bool has_edge = edges.has(team.rank());
    // This thread's edge element (its logit, and its target probability), read when used
    // rather than held in registers through the row: the register path has none to spare.
    auto edge = [&](const T* row) { return edges.element(row, team.rank()); };

    Pack<T, VEC> cache[kPacks], target_cache[kProbs ? kPacks : 1];
    acc_t row_max;
    exp_sum_t sum;
    ClassSums<sum_t> sums{};
    if constexpr (row_in_registers) {
      reduce_row_in_registers<T, VEC, kEdges, kProbs, kClassSums>(params, team, edges, x, y, x_packs, y_packs, has_edge,
                                                                  cache, target_cache, read_target_logit, scratch, scratch_exp_sum,
                                                                  row_max, sum, sums);
    } else {
      MaxSum<acc_t, exp_sum_t> acc = {-infinity<acc_t>(), exp_sum_t(0)};
      if (has_edge) {
        const Pack<T, 1> edge_x = edge(x);
        acc = add_pack(acc, edge_x, params.exp_c);
        if constexpr (kClassSums) {
          sums.add(pack_class_sums<kProbs>(edge_x, kProbs ? edge(y) : edge_x, edges.class_of(team.rank()),
                                           params.weight, first_logit));
        }
      }
      for_each_row_pack<T, VEC, kProbs>(x_packs, y_packs, num_packs, false, team,
                                                   [&](const Pack<T, VEC>& xp, const Pack<T, VEC>& yp, int64_t p) {
        acc = add_pack(acc, xp, params.exp_c);
        if (!kSumOnly && p < stash_packs) stash[p] = xp;
        if constexpr (kClassSums) {
          sums.add(pack_class_sums<kProbs>(xp, yp, first_class(p), params.weight, first_logit));
        }
      });
      read_target_logit();
      // scratch and scratch_exp_sum: the register path's alone otherwise.
      acc = allreduce_max_sum<kWarpRows>(acc, params.inverse_temperature, scratch, scratch_exp_sum);
      row_max = acc.max;
      sum = acc.sum;
    }
    if constexpr (kClassSums) {
      sums = team.allreduce(sums, SumOp<ClassSums<sum_t>>(), ClassSums<sum_t>{}, scratch_sums)
                 .relative_to(row_in_registers ? row_max : first_logit, row_max);
    }
    const RowGradient<acc_t> g =
        finish_row<T, kProbs, kClassSums, kSumOnly>(params, row, t, row_max, sum, sums, target_logit, scales,
                                                    want_grad, team.leader(), block_ce, block_z);
    if (want_grad) {
      T* gx = params.grad_logits != nullptr ? params.grad_logits + row * num_classes : nullptr;
      T* gy = params.grad_target != nullptr ? params.grad_target + row * num_classes : nullptr;
      write_row_gradient<T, VEC, kEdges, kProbs, kClassSums, kStreamed>(params, team, edges, x, y, x_packs, y_packs,
                                                                        has_edge, cache, target_cache, stash,
                                                                        stash_packs, g, gx, gy);
    }
  }
  if (params.beside_previous_kernel) wait_for_previous_kernel();
  if (params.finish.partials == nullptr) return;
  if constexpr (kWarpRows) {  // each warp's leader holds its rows' sums
    block_ce = block_sum(block_ce, scratch_sum);
    if (params.z_loss != 0) block_z = block_sum(block_z, scratch_sum);  // else no term reads it
  }
  if (threadIdx.x == 0) {
    sum_t* partials = params.finish.partials + params.first_partial;
    partials[blockIdx.x] = block_ce;
    partials[params.finish.num_partials + blockIdx.x] = block_z;
  }
  if constexpr (!kProbs) {
    if (params.divisors_by_blocks != nullptr) {
      count_block_targets(params.target, params.rows, num_classes, params.ignore_index,
                          params.weight, scratch_sum, params.divisors_by_blocks);
    }
  }
  finish_if_last_block(params.finish, scratch_sum);
}


}  // namespace fused_losses
