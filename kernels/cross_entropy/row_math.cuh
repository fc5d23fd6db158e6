// cross_entropy/row_math.cuh: the math of one cross-entropy row, shared by every row kernel:
// running max and sum, class sums, where a row's packs lie, its target, its loss and its
// gradient's coefficients (finish_row), the kernels' parameters, and the targets counted
// for 'mean'. The formulas are cross_entropy.cu's header.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device.cuh"
#include "finish.cuh"
#include "grad_output_guess.cuh"

namespace fused_losses {

// 16-byte packs per thread kept in registers when the row fits: 8 x 4 registers of
// logits, or 4 + 4 packs of logits and target probabilities.
template <bool kProbs>
constexpr int cache_packs() {
  return kProbs ? 4 : 8;
}

// The type of a row's sum of exp(x - max): double for float32 and float64 logits, each
// pack adding its own acc_t sum, so that long rows (an LLM's vocabulary) lose no digits to
// a long chain of float additions; float for 2-byte logits, whose outputs cannot show the
// difference and whose long rows ran about 5% slower with the double math (notes, v7).
template <typename T>
using exp_sum_type = std::conditional_t<sizeof(T) == 2, float, sum_t>;

// The softmax of u = s x, s = 1 / temperature, relative to m, a max of x (max u = s m, as T > 0):
// exp(s (x - m)). `c` = exp_constant<T>(s): for 2-byte T exp_minus's one FMA with log2(e) s for
// its constant, else one multiply more. At s = 1 these are exp_minus's values bit for bit
// (log2(e) * 1 and (x - m) * 1 are exact), so a call without a temperature is today's.
template <typename T>
__host__ __device__ constexpr acc_type<T> exp_constant(acc_type<T> s) {
  return sizeof(T) == 2 ? kLog2e * s : s;
}

template <typename T>
__device__ __forceinline__ acc_type<T> exp_minus_scaled(acc_type<T> x, acc_type<T> m, acc_type<T> c) {
  if constexpr (sizeof(T) == 2) {
    return exp2_flush_subnormal(fmaf(x, c, -(m * c)));
  } else {
    return exp_acc((x - m) * c);
  }
}

// Running max (acc_t: float, or double for float64 logits) and sum of exp(s (x - max)) over
// part of a row.
template <typename acc_t, typename sum_type>
struct MaxSum {
  acc_t max;
  sum_type sum;
};

// A part's sum of exp(s (x - part.max)) made relative to `max` (>= part.max): one exp. A part
// that saw only -inf, or the max itself, keeps its sum (0, or NaN) rather than multiply it by
// exp(-inf - -inf), NaN.
template <typename acc_t, typename sum_type>
__device__ __forceinline__ sum_type sum_relative_to(MaxSum<acc_t, sum_type> part, acc_t max, acc_t s) {
  return part.max == max ? part.sum : part.sum * exp_acc((part.max - max) * s);
}

// A row's (max, sum) from the parts its team's threads hold, given to every thread: the max
// first, then each thread's sum relative to it, then the sums. Pairs combined level by level
// cost two exps a level on the critical path (the pipelined kernel's once-a-row code was 39%
// of its instructions, notes v67). kWarp: one warp, no barrier. Else the block's first
// `threads` threads (0: the block) at named barrier `barrier` (0: __syncthreads), twice, and
// not after: scratch_max and scratch_sum must be this reduction's alone (a next call writes
// each only after a barrier that every thread reaches after reading it).
template <bool kWarp, typename acc_t, typename sum_type>
__device__ __forceinline__ MaxSum<acc_t, sum_type> allreduce_max_sum(MaxSum<acc_t, sum_type> part, acc_t s,
                                                                     acc_t* scratch_max, sum_type* scratch_sum,
                                                                     int barrier = 0, int threads = 0) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int num_warps = (threads == 0 ? blockDim.x : threads) / 32;
  auto sync = [&] {
    if (barrier == 0) {
      __syncthreads();
    } else {
      named_barrier_sync(barrier, threads);
    }
  };
  acc_t max = warp_allreduce(part.max, MaxOp());
  if constexpr (!kWarp) {
    if (lane == 0) scratch_max[warp] = max;
    sync();
    max = warp_allreduce(lane < num_warps ? scratch_max[lane] : -infinity<acc_t>(), MaxOp());
  }
  sum_type sum = warp_allreduce(sum_relative_to(part, max, s), SumOp<sum_type>());
  if constexpr (!kWarp) {
    if (lane == 0) scratch_sum[warp] = sum;
    sync();
    sum = warp_allreduce(lane < num_warps ? scratch_sum[lane] : sum_type(0), SumOp<sum_type>());
  }
  return {max, sum};
}

// The largest value of a pack: NaN loses, as in max_acc, or with kNaNWins it wins. 2-byte
// values pairwise in their own format first (max.f16x2 / max.bf16x2, sm_80): exact, and
// 4 instructions for 8 values where converting each to float first took 16.
template <typename T, int VEC, typename acc_t = acc_type<T>, bool kNaNWins = false>
__device__ __forceinline__ acc_t pack_max(const Pack<T, VEC>& pack) {
  auto max2 = [](acc_t a, acc_t b) { return kNaNWins ? max_nan_wins(a, b) : max_acc(a, b); };
  if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
    uint32_t pairs[VEC / 2];
    memcpy(pairs, &pack, sizeof(pairs));
    uint32_t m = pairs[0];
#pragma unroll
    for (int k = 1; k < VEC / 2; ++k) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if constexpr (kNaNWins) {
          asm("max.NaN.bf16x2 %0, %0, %1;" : "+r"(m) : "r"(pairs[k]));
        } else {
          asm("max.bf16x2 %0, %0, %1;" : "+r"(m) : "r"(pairs[k]));
        }
      } else {
        if constexpr (kNaNWins) {
          asm("max.NaN.f16x2 %0, %0, %1;" : "+r"(m) : "r"(pairs[k]));
        } else {
          asm("max.f16x2 %0, %0, %1;" : "+r"(m) : "r"(pairs[k]));
        }
      }
    }
    const T low(static_cast<uint16_t>(m & 0xffffu), T::from_bits());
    const T high(static_cast<uint16_t>(m >> 16), T::from_bits());
    return max2(static_cast<acc_t>(low), static_cast<acc_t>(high));
  } else {
    acc_t max = -infinity<acc_t>();
#pragma unroll
    for (int k = 0; k < VEC; ++k) max = max2(max, static_cast<acc_t>(pack.val[k]));
    return max;
  }
}

// c: exp_constant<T>(1 / temperature).
template <typename T, int VEC, typename acc_t, typename sum_type>
__device__ __forceinline__ MaxSum<acc_t, sum_type> add_pack(MaxSum<acc_t, sum_type> acc, const Pack<T, VEC>& pack,
                                                            acc_t c) {
  const acc_t pack_top = pack_max<T, VEC, acc_t, true>(pack);  // NaN if the pack holds one
  const acc_t max = max_acc(acc.max, pack_top);
  // Nothing but -inf so far: the sum stays 0, or NaN. (A NaN passed over here was lost
  // from rows whose first element, an edge added alone, was NaN.)
  if (max == -infinity<acc_t>()) return {max, isnan(pack_top) ? quiet_nan<sum_type>() : acc.sum};
  acc_t pack_sum = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack_sum += exp_minus_scaled<T>(static_cast<acc_t>(pack.val[k]), max, c);
  // Rescaled only when the max moved: exp_minus(m, m) of 2-byte T is 1 within the rounding of
  // m log2e, not exactly 1, and a factor taken each pack would compound along the row.
  return {max, (max == acc.max ? acc.sum : acc.sum * exp_minus_scaled<T>(acc.max, max, c)) + pack_sum};
}

// Sums over a row that label smoothing and probability targets need. Logits enter as
// x - ref, with ref a logit of the row that the whole block agrees on (the row max when
// the row is in registers, else its first logit): the sums then hold the spread of the
// row, not its offset, and lose no digits to cancellation when the loss subtracts them.
// Each pack is summed in acc_t and the packs in double (sum_t), for every dtype: a
// gradient that multiplies p by these sums would otherwise carry their rounding.
template <typename acc_t>
struct ClassSums {
  acc_t weights;         // sum_c w_c
  acc_t logits;          // sum_c w_c (x_c - ref)
  acc_t targets;         // sum_c w_c y_c              (probabilities)
  acc_t target_logits;   // sum_c w_c y_c (x_c - ref)  (probabilities)

  __device__ __forceinline__ ClassSums operator+(const ClassSums& o) const {
    return {weights + o.weights, logits + o.logits, targets + o.targets, target_logits + o.target_logits};
  }
  template <typename pack_t>
  __device__ __forceinline__ void add(const ClassSums<pack_t>& o) {
    weights += o.weights;
    logits += o.logits;
    targets += o.targets;
    target_logits += o.target_logits;
  }
  // The same sums relative to the row max instead of ref.
  __device__ __forceinline__ ClassSums relative_to(acc_t ref, acc_t row_max) const {
    const acc_t shift = row_max - ref;
    return {weights, logits - shift * weights, targets, target_logits - shift * targets};
  }
};

template <typename acc_t>
__device__ __forceinline__ ClassSums<acc_t> shfl_xor(ClassSums<acc_t> v, int mask) {
  return {shfl_xor(v.weights, mask), shfl_xor(v.logits, mask), shfl_xor(v.targets, mask),
          shfl_xor(v.target_logits, mask)};
}

// What a row's classes weigh: weight[c], or 1 without a weight tensor.
template <typename acc_t>
__device__ __forceinline__ acc_t class_weight(const acc_t* weight, int64_t c) {
  return weight != nullptr ? weight[c] : acc_t(1);
}

// The class sums of one pack.
template <bool kProbs, typename T, int VEC, typename acc_t>
__device__ __forceinline__ ClassSums<acc_t> pack_class_sums(const Pack<T, VEC>& x, const Pack<T, VEC>& y,
                                                           int64_t first_class, const acc_t* weight, acc_t ref) {
  ClassSums<acc_t> sums{};
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const acc_t w = class_weight(weight, first_class + k);
    const acc_t wx = w * (static_cast<acc_t>(x.val[k]) - ref);
    sums.weights += w;
    sums.logits += wx;
    if constexpr (kProbs) {
      const acc_t yk = static_cast<acc_t>(y.val[k]);
      sums.targets += w * yk;
      sums.target_logits += wx * yk;
    }
  }
  return sums;
}

// A row's gradient, d/dx_c = p_c A - w_c (a y_c + b) - [c == one_hot] B and
// d/dy_c = a_y w_c (lse - u_c), already multiplied by the reduction's scale or grad_output (u = s x).
// p_c A is computed as exp(x_c - row_max) * A_over_sum: the argument of exp stays small
// (exp(x_c - lse) would round an argument near -log C, about 1e-6 of p in float32).
// With a temperature (u = s x) the coefficients of dx carry s; a_y (probabilities' dy) does not.
template <typename acc_t>
struct RowGradient {
  acc_t row_max, log_sum;
  acc_t A_over_sum, a, b, B;
  int64_t one_hot;  // -1 for none
  acc_t s, a_y;
};

// kOneHot false: the caller corrects the one-hot class's element itself.
template <typename T, int VEC, bool kProbs, bool kClassSums, bool kOneHot = true, typename acc_t>
__device__ __forceinline__ void store_grad_pack(const Pack<T, VEC>& x, const Pack<T, VEC>& y, int64_t first_class,
                                                const RowGradient<acc_t>& g, acc_t exp_c, const acc_t* weight,
                                                T* grad_x, T* grad_y) {
  Pack<T, VEC> dx, dy;
  // The one-hot class's place in this pack (-1: not here), as a 32-bit index: compared per
  // element as first_class + k, the 64-bit class index cost four instructions a logit.
  const int64_t one_hot_in_pack = g.one_hot - first_class;
  const int one_hot_k =
      kOneHot && one_hot_in_pack >= 0 && one_hot_in_pack < VEC ? static_cast<int>(one_hot_in_pack) : -1;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    // Rounded before the one-hot term: where p_t A rounds to B (a row whose max dwarfs the rest) the
    // target's gradient is then exactly 0, as torch's.
    acc_t d = mul_rn(exp_minus_scaled<T>(static_cast<acc_t>(x.val[k]), g.row_max, exp_c), g.A_over_sum);
    if (kOneHot && k == one_hot_k) d -= g.B;
    if constexpr (kClassSums) {
      const acc_t w = class_weight(weight, first_class + k);
      d -= w * ((kProbs ? g.a * static_cast<acc_t>(y.val[k]) : acc_t(0)) + g.b);
      if constexpr (kProbs) {
        dy.val[k] = static_cast<T>(g.a_y * w * (g.log_sum - (static_cast<acc_t>(x.val[k]) - g.row_max) * g.s));
      }
    }
    dx.val[k] = static_cast<T>(d);
  }
  // Streaming stores: the gradient is not read again here, so its lines should be the
  // first to leave L2, before the logits that a streamed row reads a second time
  // (128256-class bf16 training 1.33x -> 1.30x the floor, fp32 4096: 1.15x -> 1.12x).
  if (grad_x != nullptr) store_pack_streaming<T, VEC>(grad_x + first_class, dx);
  if (kProbs && grad_y != nullptr) store_pack_streaming<T, VEC>(grad_y + first_class, dy);
}

// Where a row's 16-byte packs lie. With kEdges (C % VEC != 0, or tensors that start off
// a 16-byte boundary) they start at the row's first 16-byte aligned element, `head`
// elements in (fewer than VEC), and fewer than VEC elements are left after the last
// whole pack. Those edge elements go one per thread: thread i < head holds class i, and
// head <= i < num_edges class i + num_packs * VEC. So a row of odd length (a 50257-class
// vocabulary) is read in 16-byte packs all the same. Every tensor of a row sits at the
// logits' offset from 16 bytes (launch_cross_entropy), so the logits' head is theirs.
// Without kEdges every row starts aligned and is whole packs: nothing to compute per row.
template <typename T, int VEC, bool kEdges>
struct RowEdges {
  int head = 0;
  int64_t num_packs;
  int num_edges = 0;

  __device__ __forceinline__ RowEdges(const T* row, int64_t num_classes) : num_packs(num_classes / VEC) {
    if constexpr (kEdges) {
      const int misaligned = static_cast<int>(offset_from_16_bytes(row) / sizeof(T));
      head = misaligned == 0 ? 0 : static_cast<int>(num_classes < VEC - misaligned ? num_classes : VEC - misaligned);
      num_packs = (num_classes - head) / VEC;
      num_edges = static_cast<int>(num_classes - num_packs * VEC);
    }
  }
  __device__ __forceinline__ bool has(int i) const { return kEdges && i < num_edges; }
  __device__ __forceinline__ int64_t class_of(int i) const { return i < head ? i : i + num_packs * VEC; }
  // Edge element i of `row` (the logits, or a tensor of the row's shape at their offset).
  __device__ __forceinline__ Pack<T, 1> element(const T* row, int i) const {
    Pack<T, 1> pack;
    pack.val[0] = row[class_of(i)];
    return pack;
  }
};

struct RowTarget {
  int64_t index;
  bool ignored;  // == ignore_index: contributes no loss and a zero gradient
  bool valid;    // in [0, C)

  __device__ __forceinline__ bool counted() const { return !ignored && valid; }
};

// ---------------------------------------------------------------------------------
// Targets counted for 'mean', the kernels' parameters, and a row's end.

// The targets: class indices, int64 or int32 (told apart at run time: one load a row, so a
// template flag would only double the instantiations), or T (rows, C) probabilities.
struct Targets {
  const void* data;
  bool int32;

  __device__ __forceinline__ int64_t index(int64_t row) const {
    return int32 ? static_cast<const int32_t*>(data)[row] : static_cast<const int64_t*>(data)[row];
  }
};

// The divisors of 'mean' with class indices, the weight and the number of targets !=
// ignore_index, over rows first, first + stride, ... < rows; summed over the block.
template <typename acc_t>
__device__ __forceinline__ void count_targets(Targets target, int64_t first, int64_t stride, int64_t rows,
                                              int64_t num_classes, int64_t ignore_index, const acc_t* weight,
                                              sum_t* scratch, sum_t& weight_sum, sum_t& count) {
  weight_sum = count = 0;
  for (int64_t r = first; r < rows; r += stride) {
    const int64_t t = target.index(r);
    if (t == ignore_index) continue;
    count += 1;
    // An index outside [0, C) makes its row's loss NaN; it must not be read from weight.
    weight_sum += t >= 0 && t < num_classes ? class_weight(weight, t) : acc_t(1);
  }
  weight_sum = block_sum(weight_sum, scratch);
  // Without class weights every counted target weighs 1: the same sum, and a block
  // reduction fewer at the end of the sum-only kernels (notes, v25).
  count = weight == nullptr ? weight_sum : block_sum(count, scratch);
}

// Many rows: per block, the two divisors as doubles in `divisors` (2, gridDim.x), summed
// in a fixed order by whoever needs them, so the result is the same every run. Written by
// count_targets_kernel, or by the loss kernel's blocks after their rows when no gradient
// waits for the divisors. Not inlined: inlined after the rows, it costs the loss kernel's
// row loop registers (rows in registers, fp32: 90 -> 120).
template <typename acc_t>
__device__ __noinline__ void count_block_targets(Targets target, int64_t rows, int64_t num_classes,
                                                 int64_t ignore_index, const acc_t* weight, sum_t* scratch,
                                                 sum_t* divisors) {
  sum_t weight_sum, count;
  count_targets(target, int64_t(blockIdx.x) * blockDim.x + threadIdx.x, int64_t(gridDim.x) * blockDim.x, rows,
                num_classes, ignore_index, weight, scratch, weight_sum, count);
  if (threadIdx.x == 0) {
    divisors[blockIdx.x] = weight_sum;
    divisors[gridDim.x + blockIdx.x] = count;
  }
}

template <typename acc_t>
__global__ void count_targets_kernel(Targets target, int64_t rows, int64_t num_classes,
                                     int64_t ignore_index, const acc_t* weight, sum_t* divisors) {
  __shared__ sum_t scratch[32];
  wait_for_previous_kernel();
  count_block_targets(target, rows, num_classes, ignore_index, weight, scratch, divisors);
}

// Up to this many rows, every block of the loss kernel counts all targets itself rather
// than wait for count_targets_kernel: one launch fewer where launches are the cost.
constexpr int64_t kRowsCountedPerBlock = 1024;

template <typename T>
struct CrossEntropyParams {
  const T* logits;            // (rows, C)
  Targets target;
  const acc_type<T>* weight;  // (C) or nullptr
  int64_t rows, num_classes, ignore_index;
  double label_smoothing, z_loss;
  // u = s x: s = 1 / temperature (1: none), c = exp_constant<T>(s).
  acc_type<T> inverse_temperature, exp_c;
  // Gradient scale of the ce and z terms without grad_output: 1, 1/rows ('mean' with
  // probabilities), or from `divisors` ('mean' with class indices: 1/weight, 1/count).
  double ce_scale;
  const sum_t* divisors;  // (2, num_divisors), or nullptr
  int64_t num_divisors;
  sum_t* counted_divisors;  // or, up to kRowsCountedPerBlock rows: every block counts, block 0 writes (2, 1)
  // Or, without a gradient (nothing waits for them): each block counts what
  // count_targets_kernel's block of the same index would (count_block_targets), (2,
  // gridDim.x), after its rows.
  sum_t* divisors_by_blocks;
  const T* grad_output;   // (rows): backward of 'none' (replaces the scales), or nullptr
  double* guess_source;  // a scalar reduction's guess at grad_output (grad_output_guess.cuh), or nullptr
  GradOutputGuess guess;  // where the factor used is recorded, or a recompute's
  // Outputs, each nullptr when not wanted.
  T* loss_per_row;        // (rows): ce + z, reduction 'none'
  acc_type<T>* lse;  // (rows)
  Finish finish;          // partials (2, finish.num_partials): per block from first_partial, the sum of ce and of z
  int64_t first_partial;  // 0, or beside the pipelined kernel (beside_previous_kernel) its blocks' number
  T* grad_logits;         // (rows, C); may be `logits` itself (inplace_backward)
  T* grad_target;         // (rows, C): probabilities
  // Rows beyond the register cache, when a gradient is written: how many packs of the
  // row's front (at most all of them) the first pass keeps in dynamic shared memory, so
  // the gradient pass reads them from there rather than from L2 or HBM (0: none).
  int64_t stash_packs;
  // cross_entropy_pipelined_kernel: rows (or a cluster's segments of rows, stash_packs
  // packs each) in flight per block.
  int stages;
  // Two kernels at once, a share of the rows each (launch_policy.cuh, kPipelinedAndStashedRows): the
  // pipelined kernel lets the next launch start at once (starts_next_kernel), and that, the stashed
  // kernel on the multiprocessors its clusters leave, waits for it at its end rather than its start
  // (beside_previous_kernel), so that its end is theirs and its last block can finish both's sum.
  bool starts_next_kernel, beside_previous_kernel;
};

// The scales of the ce and z terms' gradients for a scalar reduction: params.ce_scale,
// or for 'mean' with class indices 1 / the divisors, which the block sums (or counts
// itself, up to kRowsCountedPerBlock rows) before its first row.
template <typename acc_t>
struct GradientScales {
  acc_t ce, z;
};

template <typename T, bool kProbs, typename acc_t = acc_type<T>>
__device__ __forceinline__ GradientScales<acc_t> gradient_scales(const CrossEntropyParams<T>& params, bool want_grad,
                                                                 sum_t* scratch) {
  GradientScales<acc_t> scales{static_cast<acc_t>(params.ce_scale), static_cast<acc_t>(params.ce_scale)};
  if constexpr (!kProbs) {
    if (params.counted_divisors != nullptr) {
      sum_t weight_sum, count;
      count_targets(params.target, threadIdx.x, blockDim.x, params.rows,
                    params.num_classes, params.ignore_index, params.weight, scratch, weight_sum, count);
      if (blockIdx.x == 0 && threadIdx.x == 0) {
        params.counted_divisors[0] = weight_sum;
        params.counted_divisors[1] = count;
      }
      scales = {static_cast<acc_t>(1.0 / weight_sum), static_cast<acc_t>(1.0 / count)};
    }
  }
  if (params.divisors != nullptr && want_grad) {
    sum_t weight_sum = 0, count = 0;
    for (int64_t i = threadIdx.x; i < params.num_divisors; i += blockDim.x) {
      weight_sum += params.divisors[i];
      count += params.divisors[params.num_divisors + i];
    }
    scales.ce = static_cast<acc_t>(1.0 / block_sum(weight_sum, scratch));
    scales.z = static_cast<acc_t>(1.0 / block_sum(count, scratch));
  }
  if (want_grad) {
    const auto factor = static_cast<acc_t>(grad_output_factor<T>(params.guess_source, params.guess));
    scales.ce *= factor;
    scales.z *= factor;
  }
  return scales;
}

template <bool kProbs, typename T>
__device__ __forceinline__ RowTarget row_target(const CrossEntropyParams<T>& params, int64_t row) {
  RowTarget t{-1, false, true};
  if constexpr (!kProbs) {
    t.index = params.target.index(row);
    t.ignored = t.index == params.ignore_index;
    t.valid = t.index >= 0 && t.index < params.num_classes;
  }
  return t;
}

// A row after its reductions (row_max of x, sum = sum_c exp(s (x_c - row_max)), the class sums
// relative to row_max, and the leader's target logit): the leader (one thread of those
// that read the row) writes the row's loss and lse where asked and adds its terms to its
// sums; with want_grad every thread gets the gradient's coefficients.
template <typename T, bool kProbs, bool kClassSums, bool kSumOnly, typename acc_t, typename exp_sum_t>
__device__ __forceinline__ RowGradient<acc_t> finish_row(const CrossEntropyParams<T>& params, int64_t row,
                                                         const RowTarget& t, acc_t row_max, exp_sum_t sum,
                                                         const ClassSums<sum_t>& sums, acc_t target_logit,
                                                         GradientScales<acc_t> scales, bool want_grad,
                                                         bool leader, sum_t& block_ce, sum_t& block_z) {
  const acc_t smoothing = static_cast<acc_t>(params.label_smoothing);
  const acc_t z_loss = static_cast<acc_t>(params.z_loss);
  const acc_t class_share = smoothing / static_cast<acc_t>(params.num_classes);  // eps / C
  // u = s x: every logit below enters as s (x - max), the gradient of x as s times u's.
  const acc_t s = params.inverse_temperature;
  // For 2-byte T every term of the sum, the max's own included, carries exp_minus's factor
  // exp_minus(max, max) (1 within the rounding of max log2e): divided out, a row whose max
  // dwarfs the rest sums to exactly 1 and its loss is exactly 0, as torch's.
  exp_sum_t own_term = 1;
  if constexpr (sizeof(T) == 2) {
    if (isfinite(row_max)) own_term = exp_minus_scaled<T>(row_max, row_max, params.exp_c);  // else 0 or NaN already
  }
  const acc_t log_sum = log_acc(static_cast<acc_t>(sum / own_term));
  const acc_t lse = row_max * s + log_sum;
  // The ce term's pieces (x - max in u's units: times s): target_weight multiplies the target's nll (max - x_t) +
  // log_sum (the difference first, so a loss near 0 keeps its digits), spread_weight
  // multiplies log_sum and spread_logits is subtracted: sum_c w_c y'_c (log_sum - (x_c - max)).
  acc_t target_weight = 0, spread_weight = 0, spread_logits = 0;
  if constexpr (kProbs) {
    spread_weight = static_cast<acc_t>((1 - smoothing) * sums.targets + class_share * sums.weights);
    spread_logits = static_cast<acc_t>((1 - smoothing) * sums.target_logits + class_share * sums.logits) * s;
  } else {
    if (t.counted()) target_weight = (1 - smoothing) * class_weight(params.weight, t.index);
    if constexpr (kClassSums) {
      spread_weight = static_cast<acc_t>(class_share * sums.weights);
      spread_logits = static_cast<acc_t>(class_share * sums.logits) * s;
    }
  }

  if (leader) {
    acc_t ce = 0, z = 0;
    if (!t.valid && !t.ignored) {
      ce = quiet_nan<acc_t>();
    } else if (!t.ignored) {
      ce = spread_weight * log_sum - spread_logits;
      if (!kProbs) ce += target_weight * ((row_max - target_logit) * s + log_sum);
      z = z_loss * lse * lse;
    }
    if (!kSumOnly && params.loss_per_row != nullptr) params.loss_per_row[row] = static_cast<T>(ce + z);
    if (!kSumOnly && params.lse != nullptr) params.lse[row] = lse;
    block_ce += ce;
    block_z += z;
  }

  RowGradient<acc_t> g{row_max, log_sum, 0, 0, 0, 0, -1, s, 0};
  if (want_grad) {
    const acc_t scale = params.grad_output != nullptr ? static_cast<acc_t>(params.grad_output[row]) : scales.ce;
    const acc_t sz = params.grad_output != nullptr ? scale : scales.z;
    // One class: p = 1, so the ce term's gradient is identically 0; computed, its parts would
    // cancel only to a rounding of the weight, which would land on the z-loss gradient.
    const acc_t scale_of_ce = params.num_classes == 1 ? acc_t(0) : scale;
    if (!t.valid && !t.ignored) {
      g.A_over_sum = g.B = quiet_nan<acc_t>();
    } else if (!t.ignored) {  // an ignored row's gradient is softmax * 0, as torch computes it
      // d/dx = s d/du: the temperature's s on every coefficient of dx (1: today's bits), not on dy's.
      g.B = target_weight * scale_of_ce * s;
      g.a_y = (1 - smoothing) * scale_of_ce;
      g.a = g.a_y * s;
      g.b = class_share * scale_of_ce * s;
      g.A_over_sum =
          static_cast<acc_t>(((target_weight + spread_weight) * scale_of_ce + 2 * z_loss * lse * sz) / sum) * s;
      g.one_hot = kProbs ? -1 : t.index;
    }
  }
  return g;
}

}  // namespace fused_losses
