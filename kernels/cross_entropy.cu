// cross_entropy.cu: F.cross_entropy over rows of logits (N, C), fused: class-index
// targets (ignore_index, weight, label_smoothing) or class-probability targets (weight,
// label_smoothing), every reduction; beyond torch, a z-loss term and the per-row lse.
//
// Per row, with lse = log(sum_c exp(x_c)), w_c the class weight (1 without weight), eps
// the label smoothing and C the number of classes:
//   class index t:    ce = (1 - eps) w_t (lse - x_t) + eps/C sum_c w_c (lse - x_c)
//                     (0 where t == ignore_index; NaN where t is outside [0, C): torch
//                     raises a device-side assert, which would poison the CUDA context)
//   probabilities y:  ce = sum_c w_c y'_c (lse - x_c),  y' = (1 - eps) y + eps/C
//   z-loss:           z = z_loss lse^2 (0 where the row is ignored)
// 'none' gives ce + z per row and 'sum' their sum. 'mean' divides the ce sum by the
// weight of the non-ignored targets (their number without weight; the number of rows
// for probabilities), as torch does, and the z sum by the number of counted rows.
//
// Gradient, with p = softmax(x) and per-row coefficients (RowGradient):
//   d/dx_c = p_c A - w_c (a y_c + b) - [c == t] B,     d/dy_c = a w_c (lse - x_c).
//
// Bytes per logit (b = element size): forward b. Training step: 2b (the forward writes
// the gradient as it goes; backward only scales it by grad_output, and not at all when
// that is 1), or b with inplace_backward, whose gradient overwrites the logits. A row of
// up to cache_packs * kMaxThreads packs stays in registers between the passes, so it is
// read from HBM once (without a gradient, many such rows are streamed by a warp each).
// A longer row is streamed; when its gradient is written, on sm_90 (class-index
// targets, no label smoothing, 2- and 4-byte dtypes) the copy engine brings
// it into shared memory, split among a cluster of blocks where it is longer than half a
// block's (cross_entropy_pipelined_kernel): read once. Elsewhere the first pass keeps as
// much of its front in shared memory as one block can have (227 KB on an H100: all of a
// 40000-class fp32 row, 90% of a 128256-class bf16 row), and the gradient pass reads the
// rest again, what the first pass read last, mostly from L2.
// Probability targets add b per logit read (and b written for their gradient).

#include "common.cuh"

#include <initializer_list>
#include <type_traits>

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Device helpers.

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

// Running max (acc_t: float, or double for float64 logits) and sum of exp(x - max) over
// part of a row.
template <typename acc_t, typename sum_type>
struct MaxSum {
  acc_t max;
  sum_type sum;
};

template <typename acc_t, typename sum_type>
__device__ __forceinline__ MaxSum<acc_t, sum_type> combine(MaxSum<acc_t, sum_type> a, MaxSum<acc_t, sum_type> b) {
  const acc_t max = max_acc(a.max, b.max);
  // When both maxima are -inf nothing but -inf (or NaN) has been added: keep the sum at 0
  // (not exp(-inf - -inf), NaN), or NaN where a part holds one.
  if (max == -infinity<acc_t>()) return {max, a.sum + b.sum};
  return {max, a.sum * exp_acc(a.max - max) + b.sum * exp_acc(b.max - max)};
}

template <typename acc_t, typename sum_type>
__device__ __forceinline__ MaxSum<acc_t, sum_type> shfl_xor(MaxSum<acc_t, sum_type> v, int mask) {
  return {shfl_xor(v.max, mask), shfl_xor(v.sum, mask)};
}

struct CombineMaxSum {
  template <typename acc_t, typename sum_type>
  __device__ __forceinline__ MaxSum<acc_t, sum_type> operator()(MaxSum<acc_t, sum_type> a,
                                                                MaxSum<acc_t, sum_type> b) const {
    return combine(a, b);
  }
};

// max that returns NaN where either is one (max.NaN, sm_80).
__device__ __forceinline__ float max_nan_wins(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}
__device__ __forceinline__ double max_nan_wins(double a, double b) { return isnan(a) ? a : isnan(b) ? b : fmax(a, b); }

// The largest value of a pack: NaN loses, as in max_acc, or with kNaNWins it wins. 2-byte
// values pairwise in their own format first (max.f16x2 / max.bf16x2, sm_80): exact, and
// 4 instructions for 8 values where converting each to float first took 16.
template <typename T, int VEC, typename acc_t = at::opmath_type<T>, bool kNaNWins = false>
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

template <typename T, int VEC, typename acc_t, typename sum_type>
__device__ __forceinline__ MaxSum<acc_t, sum_type> add_pack(MaxSum<acc_t, sum_type> acc, const Pack<T, VEC>& pack) {
  const acc_t pack_top = pack_max<T, VEC, acc_t, true>(pack);  // NaN if the pack holds one
  const acc_t max = max_acc(acc.max, pack_top);
  // Nothing but -inf so far: the sum stays 0, or NaN. (A NaN passed over here was lost
  // from rows whose first element, an edge added alone, was NaN.)
  if (max == -infinity<acc_t>()) return {max, isnan(pack_top) ? quiet_nan<sum_type>() : acc.sum};
  acc_t pack_sum = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack_sum += exp_minus<T>(static_cast<acc_t>(pack.val[k]), max);
  return {max, acc.sum * exp_minus<T>(acc.max, max) + pack_sum};
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
// each miss would evict the next part this pass needs). kL2Block: loads that ask L2 for
// 256-byte blocks (load_pack_l2_block), for rows read once and never written here.
template <typename T, int VEC, bool kProbs, bool kL2Block = false, typename Team, typename Visit>
__device__ __forceinline__ void for_each_row_pack(const T* x, const T* y, int64_t num_packs, bool backwards,
                                                  const Team& team, Visit visit) {
  auto load = [](const T* ptr) { return kL2Block ? load_pack_l2_block<T, VEC>(ptr) : load_pack<T, VEC>(ptr); };
  Pack<T, VEC> none;
  auto pack_at = [&](int64_t p) { return backwards ? num_packs - 1 - p : p; };
  int64_t p = team.rank();
  for (; p + (kStreamLoadsAhead - 1) * team.size() < num_packs; p += kStreamLoadsAhead * team.size()) {
    Pack<T, VEC> xs[kStreamLoadsAhead], ys[kProbs ? kStreamLoadsAhead : 1];
#pragma unroll
    for (int u = 0; u < kStreamLoadsAhead; ++u) {
      xs[u] = load(x + pack_at(p + u * team.size()) * VEC);
      if constexpr (kProbs) ys[u] = load(y + pack_at(p + u * team.size()) * VEC);
    }
#pragma unroll
    for (int u = 0; u < kStreamLoadsAhead; ++u) visit(xs[u], kProbs ? ys[u] : none, pack_at(p + u * team.size()));
  }
  for (; p < num_packs; p += team.size()) {
    const int64_t q = pack_at(p);
    visit(load(x + q * VEC), kProbs ? load(y + q * VEC) : none, q);
  }
}

// A row's gradient, d/dx_c = p_c A - w_c (a y_c + b) - [c == one_hot] B and
// d/dy_c = a w_c (lse - x_c), already multiplied by the reduction's scale or grad_output.
// p_c A is computed as exp(x_c - row_max) * A_over_sum: the argument of exp stays small
// (exp(x_c - lse) would round an argument near -log C, about 1e-6 of p in float32).
template <typename acc_t>
struct RowGradient {
  acc_t row_max, log_sum;
  acc_t A_over_sum, a, b, B;
  int64_t one_hot;  // -1 for none
};

// kOneHot false: the caller corrects the one-hot class's element itself.
template <typename T, int VEC, bool kProbs, bool kClassSums, bool kOneHot = true, typename acc_t>
__device__ __forceinline__ void store_grad_pack(const Pack<T, VEC>& x, const Pack<T, VEC>& y, int64_t first_class,
                                                const RowGradient<acc_t>& g, const acc_t* weight, T* grad_x,
                                                T* grad_y) {
  Pack<T, VEC> dx, dy;
  // The one-hot class's place in this pack (-1: not here), as a 32-bit index: compared per
  // element as first_class + k, the 64-bit class index cost four instructions a logit.
  const int64_t one_hot_in_pack = g.one_hot - first_class;
  const int one_hot_k =
      kOneHot && one_hot_in_pack >= 0 && one_hot_in_pack < VEC ? static_cast<int>(one_hot_in_pack) : -1;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    acc_t d = exp_minus<T>(static_cast<acc_t>(x.val[k]), g.row_max) * g.A_over_sum;
    if (kOneHot && k == one_hot_k) d -= g.B;
    if constexpr (kClassSums) {
      const acc_t w = class_weight(weight, first_class + k);
      d -= w * ((kProbs ? g.a * static_cast<acc_t>(y.val[k]) : acc_t(0)) + g.b);
      if constexpr (kProbs) {
        dy.val[k] = static_cast<T>(g.a * w * (g.log_sum - (static_cast<acc_t>(x.val[k]) - g.row_max)));
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
// Kernels.

// The divisors of 'mean' with class indices, the weight and the number of targets !=
// ignore_index, over rows first, first + stride, ... < rows; summed over the block.
template <typename index_t, typename acc_t>
__device__ __forceinline__ void count_targets(const index_t* target, int64_t first, int64_t stride, int64_t rows,
                                              int64_t num_classes, int64_t ignore_index, const acc_t* weight,
                                              sum_t* scratch, sum_t& weight_sum, sum_t& count) {
  weight_sum = count = 0;
  for (int64_t r = first; r < rows; r += stride) {
    const int64_t t = static_cast<int64_t>(target[r]);
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
template <typename index_t, typename acc_t>
__device__ __noinline__ void count_block_targets(const index_t* target, int64_t rows, int64_t num_classes,
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

template <typename index_t, typename acc_t>
__global__ void count_targets_kernel(const index_t* target, int64_t rows, int64_t num_classes,
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
  const void* target;         // index_t (rows) or T (rows, C) probabilities
  const at::opmath_type<T>* weight;  // (C) or nullptr
  int64_t rows, num_classes, ignore_index;
  double label_smoothing, z_loss;
  // Gradient scale of the ce and z terms without grad_output: 1, 1/rows ('mean' with
  // probabilities), or from `divisors` ('mean' with class indices: 1/weight, 1/count).
  double ce_scale;
  const sum_t* divisors;  // (2, num_divisors), or nullptr
  int64_t num_divisors;
  sum_t* counted_divisors;  // or, up to kRowsCountedPerBlock rows: every block counts, block 0 writes (2, 1)
  // Or, without a gradient (nothing waits for them): each block counts what
  // count_targets_kernel's block of the same index would (count_block_targets), (2,
  // gridDim.x), after its rows (before them in the claimed-rows kernel).
  sum_t* divisors_by_blocks;
  const T* grad_output;   // (rows): backward of 'none' (replaces the scales), or nullptr
  // Outputs, each nullptr when not wanted.
  T* loss_per_row;        // (rows): ce + z, reduction 'none'
  at::opmath_type<T>* lse;  // (rows)
  Finish finish;          // partials (2, gridDim.x): per block, the sum of ce and of z (a term with z_loss)
  T* grad_logits;         // (rows, C); may be `logits` itself (inplace_backward)
  T* grad_target;         // (rows, C): probabilities
  // Rows beyond the register cache, when a gradient is written: how many packs of the
  // row's front (at most all of them) the first pass keeps in dynamic shared memory, so
  // the gradient pass reads them from there rather than from L2 or HBM (0: none).
  int64_t stash_packs;
  // cross_entropy_pipelined_kernel: rows (or a cluster's segments of rows, stash_packs
  // packs each) in flight per block.
  int stages;
};

// The scales of the ce and z terms' gradients for a scalar reduction: params.ce_scale,
// or for 'mean' with class indices 1 / the divisors, which the block sums (or counts
// itself, up to kRowsCountedPerBlock rows) before its first row.
template <typename acc_t>
struct GradientScales {
  acc_t ce, z;
};

template <typename T, typename index_t, bool kProbs, typename acc_t = at::opmath_type<T>>
__device__ __forceinline__ GradientScales<acc_t> gradient_scales(const CrossEntropyParams<T>& params, bool want_grad,
                                                                 sum_t* scratch) {
  GradientScales<acc_t> scales{static_cast<acc_t>(params.ce_scale), static_cast<acc_t>(params.ce_scale)};
  if constexpr (!kProbs) {
    if (params.counted_divisors != nullptr) {
      sum_t weight_sum, count;
      count_targets(static_cast<const index_t*>(params.target), threadIdx.x, blockDim.x, params.rows,
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
  return scales;
}

template <typename index_t, bool kProbs, typename T>
__device__ __forceinline__ RowTarget row_target(const CrossEntropyParams<T>& params, int64_t row) {
  RowTarget t{-1, false, true};
  if constexpr (!kProbs) {
    t.index = static_cast<int64_t>(static_cast<const index_t*>(params.target)[row]);
    t.ignored = t.index == params.ignore_index;
    t.valid = t.index >= 0 && t.index < params.num_classes;
  }
  return t;
}

// A row after its reductions (row_max, sum = sum_c exp(x_c - row_max), the class sums
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
  const acc_t log_sum = log_acc(static_cast<acc_t>(sum));
  const acc_t lse = row_max + log_sum;
  // The ce term's pieces: target_weight multiplies the target's nll (max - x_t) +
  // log_sum (the difference first, so a loss near 0 keeps its digits), spread_weight
  // multiplies log_sum and spread_logits is subtracted: sum_c w_c y'_c (log_sum - (x_c - max)).
  acc_t target_weight = 0, spread_weight = 0, spread_logits = 0;
  if constexpr (kProbs) {
    spread_weight = static_cast<acc_t>((1 - smoothing) * sums.targets + class_share * sums.weights);
    spread_logits = static_cast<acc_t>((1 - smoothing) * sums.target_logits + class_share * sums.logits);
  } else {
    if (t.counted()) target_weight = (1 - smoothing) * class_weight(params.weight, t.index);
    if constexpr (kClassSums) {
      spread_weight = static_cast<acc_t>(class_share * sums.weights);
      spread_logits = static_cast<acc_t>(class_share * sums.logits);
    }
  }

  if (leader) {
    acc_t ce = 0, z = 0;
    if (!t.valid && !t.ignored) {
      ce = quiet_nan<acc_t>();
    } else if (!t.ignored) {
      ce = spread_weight * log_sum - spread_logits;
      if (!kProbs) ce += target_weight * ((row_max - target_logit) + log_sum);
      z = z_loss * lse * lse;
    }
    if (!kSumOnly && params.loss_per_row != nullptr) params.loss_per_row[row] = static_cast<T>(ce + z);
    if (!kSumOnly && params.lse != nullptr) params.lse[row] = lse;
    block_ce += ce;
    block_z += z;
  }

  RowGradient<acc_t> g{row_max, log_sum, 0, 0, 0, 0, -1};
  if (want_grad) {
    const acc_t s = params.grad_output != nullptr ? static_cast<acc_t>(params.grad_output[row]) : scales.ce;
    const acc_t sz = params.grad_output != nullptr ? s : scales.z;
    if (!t.valid && !t.ignored) {
      g.A_over_sum = g.B = quiet_nan<acc_t>();
    } else if (!t.ignored) {  // an ignored row's gradient is softmax * 0, as torch computes it
      g.B = target_weight * s;
      g.a = (1 - smoothing) * s;
      g.b = class_share * s;
      g.A_over_sum = static_cast<acc_t>(((target_weight + spread_weight) * s + 2 * z_loss * lse * sz) / sum);
      g.one_hot = kProbs ? -1 : t.index;
    }
  }
  return g;
}

// Threads of a block that streams a row and stashes its front, one such block per
// multiprocessor with all of its shared memory (two blocks of 256 with half each were
// slower: 128256-class bf16 training 1.38x vs 1.33x the floor with 512). 1024 where the
// kernel fits in 64 registers, class-index targets without label smoothing in 2- and
// 4-byte dtypes: twice the loads in flight of 512 (1.23x -> 1.17x); the class sums and
// float64 need more registers.
template <typename T>
constexpr int stash_threads(bool probs, bool class_sums) {
  return probs || class_sums || sizeof(T) > 4 ? kMaxThreads : 1024;
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
template <typename T, typename index_t, int VEC, bool kEdges, bool kProbs, bool kClassSums, bool kStreamed,
          bool kSumOnly, bool kWarpRows = false, bool kL2Blocks = false>
__global__ void __launch_bounds__(kStreamed && !kSumOnly ? stash_threads<T>(kProbs, kClassSums) : kMaxThreads)
    cross_entropy_kernel(CrossEntropyParams<T> params) {
  static_assert(!kWarpRows || (kStreamed && kSumOnly && !kProbs && !kClassSums), "warp rows: sum-only, streamed");
  static_assert(!kL2Blocks || (kStreamed && kSumOnly && !kWarpRows && sizeof(T) <= 4),
                "loads by L2 blocks: sum-only rows streamed by blocks, 2- or 4-byte logits (l2_block_rows)");
  using acc_t = at::opmath_type<T>;
  constexpr int kPacks = cache_packs<kProbs>();
  __shared__ acc_t scratch[32];
  using exp_sum_t = exp_sum_type<T>;
  __shared__ MaxSum<acc_t, exp_sum_t> scratch_pair[32];
  __shared__ exp_sum_t scratch_exp_sum[32];
  __shared__ ClassSums<sum_t> scratch_sums[kClassSums ? 32 : 1];
  __shared__ sum_t scratch_sum[32];
  const int64_t num_classes = params.num_classes;
  constexpr bool row_in_registers = !kStreamed;
  // Bytes, not Pack<T, VEC>: every instantiation of this template shares the one array.
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  Pack<T, VEC>* stash = reinterpret_cast<Pack<T, VEC>*>(dynamic_smem);
  const RowTeam<kWarpRows> team;
  // The k-th pack of the row this thread caches, when it is < the row's num_packs.
  auto cached_pack = [&](int k) { return team.rank() + int64_t(k) * team.size(); };
  // Constant false in kSumOnly: the gradient pass below compiles out.
  const bool want_grad = !kSumOnly && (params.grad_logits != nullptr || params.grad_target != nullptr);

  wait_for_previous_kernel();
  const GradientScales<acc_t> scales = gradient_scales<T, index_t, kProbs>(params, want_grad, scratch_sum);
  sum_t block_ce = 0, block_z = 0;  // meaningful in team leaders

  for (int64_t row = team.first_row(); row < params.rows; row += team.row_stride()) {
    const T* x = params.logits + row * num_classes;
    const T* y = kProbs ? static_cast<const T*>(params.target) + row * num_classes : nullptr;
    const RowTarget t = row_target<index_t, kProbs>(params, row);
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
      // Every load is issued before the first is used: the whole row is in flight at once.
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
        thread_sum = exp_minus<T>(static_cast<acc_t>(edge_x.val[0]), row_max);
        if constexpr (kClassSums) {
          sums.add(pack_class_sums<kProbs>(edge_x, kProbs ? edge(y) : edge_x, edges.class_of(team.rank()),
                                           params.weight, row_max));
        }
      }
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int64_t p = cached_pack(k);
        if (p < num_packs) {
          acc_t pack_sum = 0;
#pragma unroll
          for (int j = 0; j < VEC; ++j) pack_sum += exp_minus<T>(static_cast<acc_t>(cache[k].val[j]), row_max);
          thread_sum += pack_sum;
          if constexpr (kClassSums) {
            sums.add(pack_class_sums<kProbs>(cache[k], target_cache[kProbs ? k : 0], first_class(p), params.weight,
                                             row_max));
          }
        }
      }
      sum = block_sum(thread_sum, scratch_exp_sum);
    } else {
      MaxSum<acc_t, exp_sum_t> acc = {-infinity<acc_t>(), exp_sum_t(0)};
      if (has_edge) {
        const Pack<T, 1> edge_x = edge(x);
        acc = add_pack(acc, edge_x);
        if constexpr (kClassSums) {
          sums.add(pack_class_sums<kProbs>(edge_x, kProbs ? edge(y) : edge_x, edges.class_of(team.rank()),
                                           params.weight, first_logit));
        }
      }
      for_each_row_pack<T, VEC, kProbs, kL2Blocks>(x_packs, y_packs, num_packs, false, team,
                                                   [&](const Pack<T, VEC>& xp, const Pack<T, VEC>& yp, int64_t p) {
        acc = add_pack(acc, xp);
        if (!kSumOnly && p < stash_packs) stash[p] = xp;
        if constexpr (kClassSums) {
          sums.add(pack_class_sums<kProbs>(xp, yp, first_class(p), params.weight, first_logit));
        }
      });
      read_target_logit();
      acc = team.allreduce(acc, CombineMaxSum(), MaxSum<acc_t, exp_sum_t>{-infinity<acc_t>(), exp_sum_t(0)},
                           scratch_pair);
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
      if constexpr (row_in_registers) {
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int64_t p = cached_pack(k);
          if (p < num_packs) {
            store_grad_pack<T, VEC, kProbs, kClassSums>(cache[k], target_cache[kProbs ? k : 0], first_class(p), g,
                                                        params.weight, gx, gy);
          }
        }
      } else {
        // The part not stashed first, from its end: L2 still holds what the first pass
        // read last. Then the stash, each thread the packs it stashed itself, so no
        // barrier is needed here or before the next row's first pass refills it.
        const int64_t rest = stash_packs * VEC;
        for_each_row_pack<T, VEC, kProbs>(x_packs + rest, kProbs ? y_packs + rest : y_packs, num_packs - stash_packs,
                                          true, team, [&](const Pack<T, VEC>& xp, const Pack<T, VEC>& yp, int64_t p) {
          store_grad_pack<T, VEC, kProbs, kClassSums>(xp, yp, first_class(stash_packs + p), g, params.weight, gx,
                                                      gy);
        });
        for (int64_t p = team.rank(); p < stash_packs; p += team.size()) {
          // By value, so the pack is one 16-byte shared load: through a reference the
          // compiler reads it element by element (8 LDS.U16 per bf16 pack, per ncu).
          const Pack<T, VEC> xp = load_pack<T, VEC>(stash[p].val);
          const Pack<T, VEC> yp = kProbs ? load_pack<T, VEC>(y_packs + p * VEC) : Pack<T, VEC>{};
          store_grad_pack<T, VEC, kProbs, kClassSums>(xp, yp, first_class(p), g, params.weight, gx, gy);
        }
      }
      // Each thread writes its own edge element, which no other thread reads: no barrier
      // is needed here either, and with inplace_backward it still holds the logit.
      if (has_edge) {
        store_grad_pack<T, 1, kProbs, kClassSums>(edge(x), kProbs ? edge(y) : Pack<T, 1>{},
                                                  edges.class_of(team.rank()), g, params.weight, gx, gy);
      }
    }
  }
  if (params.finish.partials == nullptr) return;
  if constexpr (kWarpRows) {  // each warp's leader holds its rows' sums
    block_ce = block_sum(block_ce, scratch_sum);
    if (params.z_loss != 0) block_z = block_sum(block_z, scratch_sum);  // else no term reads it
  }
  if (threadIdx.x == 0) {
    params.finish.partials[blockIdx.x] = block_ce;
    params.finish.partials[gridDim.x + blockIdx.x] = block_z;
  }
  if constexpr (!kProbs) {
    if (params.divisors_by_blocks != nullptr) {
      count_block_targets(static_cast<const index_t*>(params.target), params.rows, num_classes, params.ignore_index,
                          params.weight, scratch_sum, params.divisors_by_blocks);
    }
  }
  finish_if_last_block(params.finish, scratch_sum);
}

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
// 512 threads: 1024 were slower (128256-class bf16 rows in clusters of 4: 1.57 -> 1.81 ms),
// as were 256 and 768.
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

template <typename T, typename index_t, int VEC, bool kEdges>
__global__ void __launch_bounds__(kPipelineThreads) cross_entropy_pipelined_kernel(CrossEntropyParams<T> params) {
  using acc_t = at::opmath_type<T>;
  using Pair = MaxSum<acc_t, exp_sum_type<T>>;
  using Part = RowPart<acc_t, exp_sum_type<T>>;
  wait_for_previous_kernel();
  __shared__ Pair scratch_pair[32];
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
  // The cluster's k-th row: every block of a cluster walks the same rows.
  auto row_of = [&](int64_t k) { return int64_t(blockIdx.x / blocks) + k * int64_t(gridDim.x / blocks); };
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
  const GradientScales<acc_t> scales = gradient_scales<T, index_t, false>(params, true, scratch_sum);
  sum_t block_ce = 0, block_z = 0;  // meaningful in thread 0

  // The k-th row's stage (k % stages) and the parity of its barrier's phase (k / stages
  // % 2), counted rather than divided: stages is not a compile-time constant.
  int stage = 0;
  uint32_t stage_phase = 0;
  for (int64_t k = 0; row_of(k) < params.rows; ++k) {
    const int64_t row = row_of(k);
    const T* x = params.logits + row * num_classes;
    const RowTarget t = row_target<index_t, false>(params, row);
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
    if (has_edge) acc = add_pack(acc, edges.element(x, threadIdx.x));
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
    for (int p = threadIdx.x; p < static_cast<int>(packs); p += blockDim.x) {
      acc = add_pack(acc, load_pack<T, VEC>(segment[p].val));
    }
    acc = block_allreduce(acc, CombineMaxSum(), Pair{-infinity<acc_t>(), 0}, scratch_pair);
    acc_t target_logit = target_logit_here;
    if (blocks > 1) {
      const int slot = static_cast<int>(k & 1);
      if (threadIdx.x == 0) mbarrier_arrive_expect_tx(&parts_full[slot], blocks * sizeof(Part));
      if (threadIdx.x < blocks) {
        store_to_cluster_block(&parts[slot][rank], Part{acc, target_logit}, &parts_full[slot], threadIdx.x);
      }
      mbarrier_wait(&parts_full[slot], static_cast<uint32_t>(k >> 1) & 1u);
      // Combined in rank order by every block: each computes the same bits.
      acc = parts[slot][0].max_sum;
      target_logit = parts[slot][0].target_logit;
      for (int b = 1; b < blocks; ++b) {
        acc = combine(acc, parts[slot][b].max_sum);
        target_logit += parts[slot][b].target_logit;
      }
    }
    const RowGradient<acc_t> g = finish_row<T, false, false, false>(
        params, row, t, acc.max, acc.sum, ClassSums<sum_t>{}, target_logit, scales, true, threadIdx.x == 0, block_ce,
        block_z);

    // The packs without the one-hot term, then the target's element again with it, by
    // the thread that wrote its pack (its second store lands after its first).
    T* gx = params.grad_logits + row * num_classes;
    T* gx_segment = gx + edges.head + begin * VEC;
    const Pack<T, 1> no_target{};
    for (int p = threadIdx.x; p < static_cast<int>(packs); p += blockDim.x) {
      store_grad_pack<T, VEC, false, false, false>(load_pack<T, VEC>(segment[p].val), Pack<T, VEC>{}, p * VEC, g,
                                                   params.weight, gx_segment, nullptr);
    }
    if (target_here && (target_in_segment / VEC) % blockDim.x == threadIdx.x) {
      Pack<T, 1> target_x;
      target_x.val[0] = segment[target_in_segment / VEC].val[target_in_segment % VEC];
      store_grad_pack<T, 1, false, false>(target_x, no_target, t.index, g, params.weight, gx, nullptr);
    }
    if (has_edge) {
      store_grad_pack<T, 1, false, false>(edges.element(x, threadIdx.x), no_target, edges.class_of(threadIdx.x), g,
                                          params.weight, gx, nullptr);
    }
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
    // Every block of a cluster computed each row's loss: rank 0's counts.
    params.finish.partials[blockIdx.x] = rank == 0 ? block_ce : 0;
    params.finish.partials[gridDim.x + blockIdx.x] = rank == 0 ? block_z : 0;
  }
  finish_if_last_block(params.finish, scratch_sum);
}

// sm_90: the sum-only forward of many rows that a warp's stage of shared memory holds
// (class-index targets without label smoothing; where a warp per row would stream them).
// Each warp has the copy engine bring its row into its own stage and takes its next row
// from a counter (the stream's, beside the finish ticket): rows go to the warps that are
// ready, and every warp keeps a whole row in flight until the rows run out. Warps that
// streamed fixed rows through registers ended 5-8 us apart (notes, v25), and the reads
// thinned out at the end of each call. Which block adds which row changes from run to run,
// so the sums are exact (warp_exact_add), the blocks' added into the stream's exact sums:
// the same bits every run. H100, forward ms, warp per row -> claimed (notes, v30):
// 32768x4096 fp32 0.1821 -> 0.1785, 16384x8192 bf16 0.1006 -> 0.0955, 65536x2048 fp32
// 0.1797 -> 0.1779; with 8 to 16 rows a warp faster for some shapes and slower for others
// (32768x4096 bf16 0.0998 -> 0.0948; 16384x2048 fp32 0.0510 -> 0.0522, 8192x16384 bf16
// 0.0957 -> 0.0984): the first rows and the last cost the same however many come between.
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

// ---------------------------------------------------------------------------------
// Host side.

// The tensors of one call, checked and made contiguous. losses.py checks everything
// first with friendlier messages; these checks guard direct calls of the ops.
struct CrossEntropyInputs {
  at::Tensor logits, target, weight;  // weight: in the accumulation type, or undefined
  bool probs;                         // target holds class probabilities
  int64_t ignore_index;
  double label_smoothing, z_loss;

  CrossEntropyInputs(const at::Tensor& logits_arg, const at::Tensor& target_arg,
                     const c10::optional<at::Tensor>& weight_arg,
                     int64_t ignore_index, double label_smoothing, double z_loss)
      : ignore_index(ignore_index), label_smoothing(label_smoothing), z_loss(z_loss) {
    TORCH_CHECK(logits_arg.is_cuda() && logits_arg.dim() == 2, "cross_entropy: input must be 2-D (N, C) on CUDA");
    TORCH_CHECK(target_arg.device() == logits_arg.device(), "cross_entropy: target must be on input's device");
    probs = target_arg.is_floating_point();
    if (probs) {
      TORCH_CHECK(target_arg.sizes() == logits_arg.sizes() && target_arg.scalar_type() == logits_arg.scalar_type(),
                  "cross_entropy: probability targets must have input's shape and dtype");
    } else {
      TORCH_CHECK(target_arg.dim() == 1 && target_arg.size(0) == logits_arg.size(0),
                  "cross_entropy: class-index target must have shape (N,)");
      TORCH_CHECK(target_arg.scalar_type() == at::kLong || target_arg.scalar_type() == at::kInt,
                  "cross_entropy: class-index target must be int64 or int32");
    }
    TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "cross_entropy: label_smoothing must be in [0, 1]");
    logits = logits_arg.contiguous();
    target = target_arg.contiguous();
    // Probabilities are read in the same 16-byte packs as the logits (RowEdges): at the
    // logits' offset from 16 bytes, copied there in the rare case they are not.
    if (probs) target = at_offset(target, offset());
    if (weight_arg.has_value() && weight_arg->defined()) {
      TORCH_CHECK(weight_arg->dim() == 1 && weight_arg->size(0) == logits.size(1) &&
                      weight_arg->device() == logits.device(),
                  "cross_entropy: weight must have shape (C,) on input's device");
      weight = weight_arg->to(accumulation_dtype()).contiguous();
    }
  }

  uintptr_t offset() const { return offset_from_16_bytes(logits.data_ptr()); }

  // A fresh tensor of the logits' shape and dtype that rows are written to (a gradient):
  // at their offset from 16 bytes, so that both are read and written in the same packs.
  at::Tensor empty_row_tensor() const { return empty_at_offset(logits, offset()); }

  // The lse and the weights are kept in the accumulation type (float, or double for float64).
  at::ScalarType accumulation_dtype() const {
    return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  }
};

// The kernel's types, passed to a generic lambda as a tag.
template <typename T, typename index_t, bool kEdges, bool kProbs, bool kClassSums>
struct Config {
  using scalar = T;
  using index = index_t;
  static constexpr int vec = vec16<T>();
  static constexpr bool edges = kEdges;
  static constexpr bool probs = kProbs;
  static constexpr bool class_sums = kClassSums;
};

// Calls body(Config<...>{}) for the inputs' types, whether rows have edge elements
// (RowEdges), and whether the class sums are needed (label smoothing, or probability
// targets). Every row tensor must sit at the logits' offset from 16 bytes.
template <typename Body>
void dispatch_cross_entropy(const CrossEntropyInputs& in, std::initializer_list<const void*> row_pointers, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.logits.scalar_type(), "cross_entropy", [&] {
    const uintptr_t offset = in.offset();
    TORCH_CHECK(offset % sizeof(scalar_t) == 0, "cross_entropy: input's data must start on a whole element");
    for (const void* ptr : row_pointers) {
      TORCH_CHECK(ptr == nullptr || offset_from_16_bytes(ptr) == offset,
                  "cross_entropy: internal error: a row tensor is not at the logits' offset from 16 bytes");
    }
    const bool edges = offset != 0 || in.logits.size(1) % vec16<scalar_t>() != 0;
    auto with_edges = [&](auto index_zero, auto probs, auto class_sums) {
      using index_t = decltype(index_zero);
      if (edges) {
        body(Config<scalar_t, index_t, true, decltype(probs)::value, decltype(class_sums)::value>{});
      } else {
        body(Config<scalar_t, index_t, false, decltype(probs)::value, decltype(class_sums)::value>{});
      }
    };
    using yes = std::true_type;
    using no = std::false_type;
    if (in.probs) {
      with_edges(int64_t(0), yes{}, yes{});
    } else if (in.target.scalar_type() == at::kLong) {
      in.label_smoothing != 0.0 ? with_edges(int64_t(0), no{}, yes{}) : with_edges(int64_t(0), no{}, no{});
    } else {
      in.label_smoothing != 0.0 ? with_edges(int32_t(0), no{}, yes{}) : with_edges(int32_t(0), no{}, no{});
    }
  });
}

// The sum-only forward (no gradient) streams each row through one warp (kWarpRows)
// where the register path would take it by a block of 64 to 512 threads, if the rows
// give every multiprocessor at least kWarpRowsPerMultiprocessor warps. The register path
// loads its row, then reduces it with the loads stopped, at a few blocks per
// multiprocessor; a warp per row reduces without a barrier, with 32 to 48 warps per
// multiprocessor hiding one another's reductions. H100, forward ms, block per row -> warp per row
// (notes, v23): 32000-class bf16 rows, 8192 of them, 0.297 -> 0.189; 8192 classes bf16
// 4096 rows 0.041 -> 0.032; 2048 classes fp32 16384 rows 0.063 -> 0.054; 4096 classes fp32
// 32768 rows 0.185 either way; 16384 classes fp32 8192 rows 0.185 -> 0.188 (its one loss).
// Longer rows stay a block's: by warps, 50257 classes were as fast and 128256 3% slower,
// and few rows (1536 of 50257 classes) 6% slower.
constexpr int kWarpRowsThreads = 256;
constexpr int64_t kWarpRowsPerMultiprocessor = 8;

// For rows the register path would take (not streamed) with class-index targets.
inline bool use_warp_rows(int64_t rows, int64_t num_packs, int device) {
  return num_packs > 32 * int64_t(cache_packs<false>()) &&
         rows >= kWarpRowsPerMultiprocessor * multiprocessor_count(device);
}

// Teams (warps or clusters) for `rows` rows, each team taking every teams-th row: the
// fewest, at most `resident`, that give every team the same number of rows (the last
// teams one fewer at most). `resident` teams would leave a last round that only some of
// them have (8192 rows on 264 teams: 31 rounds, then 8 teams alone for a 32nd), and the
// GPU would wait on those. Measured on an H100 (notes, v24): a warp per row 0.3-1.3%
// faster (16384x2048 fp32 0.054 -> 0.0535 ms), the pipelined kernel 1% (50257-class bf16
// training 0.621 -> 0.615 ms); rows by blocks mostly slower (8192x128256 bf16 forward 0.690
// -> 0.699 ms, 8192x50257 0.284 -> 0.287: fewer blocks, fewer loads in flight; 1536x50257
// 0.0647 -> 0.0639), so those keep every resident block.
inline int64_t balanced_teams(int64_t rows, int64_t resident) {
  const int64_t rounds = (rows + resident - 1) / resident;
  return (rows + rounds - 1) / rounds;
}

// How a launch lays rows on the GPU.
struct RowLaunch {
  int threads;
  int64_t blocks;
  size_t dynamic_smem;  // bytes: the stash, or the pipelined or claimed-rows kernel's stages
  int64_t stash_packs;  // packs: stashed, a pipelined segment's, or a claimed row's
  int cluster_blocks = 1;
  int stages = 0;  // the pipelined kernel's
};

// Threads of a block that streams a row without a gradient: 256, so that several blocks
// share a multiprocessor and one's barriers hide behind the others' loads, but float32 rows
// by 512 (H100, forward ms, 256 / 512 threads: 4096x40001 fp32 0.228 / 0.224-0.226,
// 2048x128256 fp32 0.364 / 0.353, 8192x50257 fp32 0.545 either way; 8192x50257 bf16 0.276 /
// 0.278, 8192x128256 bf16 0.693 / 0.697, 2048x50257 float64 0.397 / 0.406; notes, v33).
template <typename T>
constexpr int stream_threads() {
  return sizeof(T) == 4 ? kMaxThreads : 256;
}

// Whether sum-only rows streamed by blocks load by 256-byte L2 blocks (kL2Blocks), by the
// rows' bytes: faster for rows up to 201 KB (H100, forward ms, plain / L2 loads: 8192x50257
// bf16 0.284 / 0.279, 8192x50257 fp32 0.558 / 0.545, 4096x40001 fp32 0.233 / 0.229; notes,
// v33); for rows of 256 KB and more the same on the H100 (8192x128256 bf16 0.693 / 0.693,
// 2048x128256 fp32 0.364 / 0.364) and slower on the H200 (8192x128256 bf16 0.478 / 0.505,
// where 8192x50257 bf16 reads 0.204 / 0.205; notes, v35). Not for float64 (2048x50257 0.392
// / 0.397), warp rows (not measured faster), nor rows read again for a gradient.
inline bool l2_block_rows(int64_t row_bytes) {
  return row_bytes <= 224 * 1024;
}

// Threads per row: enough that the row fits the register cache, at most kMaxThreads. A
// row too long for it is streamed: without a gradient, by stream_block_threads. With a
// gradient, the row is kept in shared memory for the gradient pass: whole rows by two
// blocks per multiprocessor where they fit, else the row's front, as much as the
// multiprocessor holds, by stash_block_threads. As many blocks as fit on the GPU at once.
template <typename Kernel>
RowLaunch row_launch(Kernel kernel, bool streamed, bool warp_rows, int64_t rows, int64_t num_packs, int cached_packs,
                     size_t pack_bytes, bool want_grad, int stream_block_threads, int stash_block_threads,
                     int device) {
  if (warp_rows) {
    constexpr int warps = kWarpRowsThreads / 32;
    const int64_t teams = balanced_teams(rows, warps * grid_for(kernel, rows * 32, kWarpRowsThreads, device));
    return {kWarpRowsThreads, (teams + warps - 1) / warps, 0, 0};
  }
  int threads = stream_block_threads;
  size_t smem = 0;
  int64_t stash_packs = 0;
  if (!streamed) {
    threads = 32;
    while (int64_t(threads) * cached_packs < num_packs) threads *= 2;
  } else if (want_grad) {
    const size_t budget = max_dynamic_smem(kernel, device);
    const size_t row_bytes = num_packs * pack_bytes;
    // Where two blocks, each with a whole row in shared memory, fit on a multiprocessor,
    // each stashes whole rows, so one's reductions and gradient pass overlap the other's
    // loads (50257-class bf16 training 1.31x -> 1.29x the floor with 256 threads), by
    // blocks of 512 threads where their registers fit (1.21x -> 1.20x: more loads in flight).
    threads = 0;
    for (const int whole_row_threads : {kMaxThreads, 256}) {
      if (row_bytes <= budget && resident_blocks_per_sm(kernel, whole_row_threads, device, row_bytes) >= 2) {
        threads = whole_row_threads;
        stash_packs = num_packs;
        break;
      }
    }
    if (threads == 0) {
      threads = stash_block_threads;
      stash_packs = std::min<int64_t>(num_packs, budget / pack_bytes);
    }
    smem = stash_packs * pack_bytes;
  }
  return {threads, grid_for(kernel, rows * threads, threads, device, smem), smem, stash_packs};
}

// The pipelined kernel's launch (sm_90), or blocks == 0 where it does not fit: the
// fewest blocks per cluster whose segments of a row fit twice in one block's shared
// memory (so, for the long rows, one block per multiprocessor), then as many stages as
// fit there, up to kMaxPipelineStages. Measured on an H100 (notes, v21-v22), 8192 rows of
// bf16: 50257 classes one block of two stages (clusters of 2 with three stages: 0.62 ->
// 0.66 ms); 128256 four blocks, three stages rather than two 1.58 -> 1.51 ms (two rows
// on their way while the block works on a third); more and smaller blocks per row
// (clusters of 2 for 50257, of 8 for 128256) were 2-60% slower. A cluster's blocks share
// a GPC, and GPCs hold different numbers of multiprocessors from one GPU to the next: the
// H100s here held 30 clusters of 4 (120 of 132 multiprocessors). Clusters of 3 filled no
// more (39) and ran slower (v21, two stages: 1.72 ms against 1.62).
template <typename Kernel>
RowLaunch pipelined_launch(Kernel kernel, int64_t rows, int64_t num_packs, size_t pack_bytes, int device) {
  const size_t budget = max_dynamic_smem(kernel, device);
  for (int cluster_blocks = 1; cluster_blocks <= kMaxClusterBlocks; cluster_blocks *= 2) {
    const int64_t segment_packs = (num_packs + cluster_blocks - 1) / cluster_blocks;
    // Each stage with its slack (bulk_stage_bytes), and kBulkCopyAlign more to align the first.
    const size_t segment_bytes = bulk_stage_bytes(segment_packs * pack_bytes);
    if (2 * segment_bytes + kBulkCopyAlign > budget) continue;
    const int stages =
        static_cast<int>(std::min<size_t>(kMaxPipelineStages, (budget - kBulkCopyAlign) / segment_bytes));
    const size_t smem = stages * segment_bytes + kBulkCopyAlign;
    int64_t resident_clusters = 0;
    if (cluster_blocks == 1) {
      resident_clusters =
          int64_t(multiprocessor_count(device)) * resident_blocks_per_sm(kernel, kPipelineThreads, device, smem);
    } else {
      resident_clusters = resident_clusters_of(kernel, cluster_blocks, kPipelineThreads, device, smem);
    }
    if (resident_clusters == 0) continue;
    const int64_t clusters = balanced_teams(rows, std::min(resident_clusters, rows));
    RowLaunch launch{kPipelineThreads, clusters * cluster_blocks, smem, segment_packs};
    launch.cluster_blocks = cluster_blocks;
    launch.stages = stages;
    return launch;
  }
  return {0, 0, 0, 0};
}

// The claimed-rows kernel's launch (sm_90), or blocks == 0 where rows are too long or too
// few for it: a stage of a row per warp (with its alignment slack), kClaimedRowsBytes of
// rows per multiprocessor (whole rows in flight, enough to keep the reads at full speed),
// at most kClaimedRowsWarps warps a block and at least 4, and kClaimedRowsPerWarp rows for
// each warp. The row counter is 32-bit.
template <typename Kernel>
RowLaunch claimed_rows_launch(Kernel kernel, int64_t rows, int64_t num_packs, size_t pack_bytes, int device) {
  const size_t row_bytes = num_packs * pack_bytes;
  const int64_t warps = std::min<int64_t>(kClaimedRowsWarps, kClaimedRowsBytes / row_bytes);
  const size_t smem = warps * claimed_stage_bytes(row_bytes) + kClaimedStageAlign;
  if (warps < 4 || rows >= (int64_t(1) << 31) || smem > max_dynamic_smem(kernel, device)) return {0, 0, 0, 0};
  const int threads = static_cast<int>(warps * 32);
  const int64_t per_sm = std::min<int64_t>(resident_blocks_per_sm(kernel, threads, device, smem),
                                           kClaimedRowsBytes / (warps * row_bytes));
  const int64_t blocks = multiprocessor_count(device) * per_sm;
  if (rows < kClaimedRowsPerWarp * warps * blocks) return {0, 0, 0, 0};
  return {threads, blocks, smem, num_packs};
}

// What a launch writes; undefined tensors are not written. `loss` is a scalar
// reduction's (0-dim), `loss_per_row` reduction 'none''s.
struct CrossEntropyOutputs {
  at::Tensor loss, loss_per_row, lse, grad_logits, grad_target;
};

// Runs the kernel for a scalar reduction (`reduction`), reduction 'none' (forward), or
// the backward of 'none' (grad_output defined).
inline void launch_cross_entropy(const CrossEntropyInputs& in, int64_t reduction, const at::Tensor& grad_output,
                                 CrossEntropyOutputs& out) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int device = in.logits.get_device();
  const int64_t rows = in.logits.size(0);
  const bool scalar_loss = reduction != kNone && !grad_output.defined();
  dispatch_cross_entropy(in, {in.logits.data_ptr(), in.probs ? in.target.data_ptr() : nullptr,
                              out.grad_logits.defined() ? out.grad_logits.data_ptr() : nullptr,
                              out.grad_target.defined() ? out.grad_target.data_ptr() : nullptr},
                         [&](auto config) {
    using Cfg = decltype(config);
    using T = typename Cfg::scalar;
    using acc_t = at::opmath_type<T>;
    const int64_t num_packs = in.logits.size(1) / Cfg::vec;
    const bool sum_only = scalar_loss && !out.grad_logits.defined() && !out.grad_target.defined() &&
                          !out.lse.defined();
    const bool streamed = num_packs > int64_t(cache_packs<Cfg::probs>()) * kMaxThreads;
    constexpr bool warp_rows_possible = !Cfg::probs && !Cfg::class_sums;
    const bool warp_rows = warp_rows_possible && sum_only && !streamed && use_warp_rows(rows, num_packs, device);
    auto kernel_for = [&](auto streamed_tag, auto sum_only_tag) {
      return cross_entropy_kernel<T, typename Cfg::index, Cfg::vec, Cfg::edges, Cfg::probs, Cfg::class_sums,
                                  decltype(streamed_tag)::value, decltype(sum_only_tag)::value>;
    };
    using yes = std::true_type;
    using no = std::false_type;
    auto kernel = streamed ? (sum_only ? kernel_for(yes{}, yes{}) : kernel_for(yes{}, no{}))
                           : (sum_only ? kernel_for(no{}, yes{}) : kernel_for(no{}, no{}));
    if constexpr (sizeof(T) <= 4) {
      if (streamed && sum_only && l2_block_rows(num_packs * sizeof(Pack<T, Cfg::vec>))) {
        kernel = cross_entropy_kernel<T, typename Cfg::index, Cfg::vec, Cfg::edges, Cfg::probs, Cfg::class_sums, true,
                                      true, false, true>;
      }
    }
    if constexpr (warp_rows_possible) {  // the sum-only streamed kernel, a warp per row
      if (warp_rows) {
        kernel = cross_entropy_kernel<T, typename Cfg::index, Cfg::vec, Cfg::edges, false, false, true, true, true>;
      }
    }
    const bool want_grad = out.grad_logits.defined() || out.grad_target.defined();
    // On sm_90: long rows' gradients by the pipelined kernel, where its stages fit; warp
    // rows claimed from the stream's counter, where there is one (no stream capture).
    RowLaunch launch{0, 0, 0, 0};
    if constexpr (!Cfg::probs && !Cfg::class_sums && sizeof(T) <= 4) {
      if (streamed && want_grad && sm90_supported(device)) {
        auto pipelined = cross_entropy_pipelined_kernel<T, typename Cfg::index, Cfg::vec, Cfg::edges>;
        launch = pipelined_launch(pipelined, rows, num_packs, sizeof(Pack<T, Cfg::vec>), device);
        if (launch.blocks > 0) kernel = pipelined;
      }
      if (warp_rows && sm90_supported(device) && finish_ticket(device, stream) != nullptr) {
        auto claimed_rows = cross_entropy_claimed_rows_kernel<T, typename Cfg::index, Cfg::vec, Cfg::edges>;
        launch = claimed_rows_launch(claimed_rows, rows, num_packs, sizeof(Pack<T, Cfg::vec>), device);
        if (launch.blocks > 0) kernel = claimed_rows;
      }
    }
    if (launch.blocks == 0) {
      launch = row_launch(kernel, streamed, warp_rows, rows, num_packs, cache_packs<Cfg::probs>(),
                          sizeof(Pack<T, Cfg::vec>), want_grad, stream_threads<T>(),
                          stash_threads<T>(Cfg::probs, Cfg::class_sums), device);
    }
    CrossEntropyParams<T> params{};
    params.logits = in.logits.data_ptr<T>();
    params.target = in.target.data_ptr();
    params.weight = data_or_null<acc_t>(in.weight);
    params.rows = rows;
    params.num_classes = in.logits.size(1);
    params.ignore_index = in.ignore_index;
    params.label_smoothing = in.label_smoothing;
    params.z_loss = in.z_loss;
    params.ce_scale = reduction == kMean && in.probs ? 1.0 / double(rows) : 1.0;
    params.grad_output = data_or_null<T>(grad_output);
    params.loss_per_row = data_or_null<T>(out.loss_per_row);
    params.lse = data_or_null<acc_t>(out.lse);
    params.grad_logits = data_or_null<T>(out.grad_logits);
    params.grad_target = data_or_null<T>(out.grad_target);
    params.stash_packs = launch.stash_packs;
    params.stages = launch.stages;
    auto run_loss_kernel = [&] {
      launch_kernel(kernel, launch.blocks, launch.threads, launch.dynamic_smem, launch.cluster_blocks, stream,
                    params);
    };
    if (!scalar_loss) {
      run_loss_kernel();
      return;
    }
    // 'mean' with class indices divides by what count_targets finds. A gradient needs it
    // before its first row: counted by every block of the loss kernel up to
    // kRowsCountedPerBlock rows, else by its own kernel first. Without a gradient the loss
    // kernel's blocks count after their rows (one launch fewer: 2 us, and a 1 us gap).
    using index_t = typename Cfg::index;
    auto count_kernel = count_targets_kernel<index_t, acc_t>;
    const int count_threads = 256;
    const bool divided = reduction == kMean && !Cfg::probs;
    const bool counted_by_blocks = divided && !want_grad;
    const bool counted_here = divided && want_grad && rows <= kRowsCountedPerBlock;
    const int64_t num_partials = launch.blocks;
    const int64_t num_divisors = !divided            ? 0
                                 : counted_by_blocks ? launch.blocks
                                 : counted_here       ? 1
                                                      : grid_for(count_kernel, rows, count_threads, device);
    // One allocation (launch-bound calls feel each one): per block, the ce and z sums
    // (2, num_partials; the claimed-rows kernel's blocks add into the stream's exact sums
    // instead), and for 'mean' with class indices the divisors (2, num_divisors).
    const at::Tensor workspace = at::empty({2 * (num_partials + num_divisors)}, in.logits.options().dtype(at::kDouble));
    sum_t* partials = workspace.data_ptr<sum_t>();
    sum_t* divisors = divided ? partials + 2 * num_partials : nullptr;
    if (counted_by_blocks) {
      params.divisors_by_blocks = divisors;
    } else if (counted_here) {
      params.counted_divisors = divisors;
    } else if (divided) {
      launch_kernel(count_kernel, num_divisors, count_threads, 0, 1, stream, in.target.data_ptr<index_t>(), rows,
                    params.num_classes, in.ignore_index, params.weight, divisors);
      params.divisors = divisors;
      params.num_divisors = num_divisors;
    }
    // The z term only with z_loss: without, the finish adds one term, as torch's loss has.
    params.finish = make_finish(partials, in.z_loss != 0 ? 2 : 1, num_partials, params.ce_scale, divisors,
                                num_divisors, out.loss, stream);
    run_loss_kernel();
    finish_without_ticket(params.finish, stream);
  });
}

// Forward. Returns (loss, grad_logits, grad_target, lse):
//   loss: 0-dim for a scalar reduction (float32 when float_loss, else logits' dtype),
//     (N,) for 'none';
//   grad_logits / grad_target: written for a scalar reduction when asked for (for 'none'
//     see cross_entropy_backward); grad_logits is `logits` itself when inplace;
//   lse: (N,) in the accumulation type when want_lse.
// Whatever is not written is undefined (None in Python).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& target, const c10::optional<at::Tensor>& weight, int64_t ignore_index,
    int64_t reduction, bool float_loss, double label_smoothing, double z_loss, bool want_grad_logits,
    bool want_grad_target, bool want_lse, bool inplace) {
  TORCH_CHECK(!inplace || (logits.is_contiguous() && reduction != kNone && want_grad_logits),
              "cross_entropy: inplace needs contiguous logits, a scalar reduction and their gradient");
  c10::cuda::CUDAGuard guard(logits.device());
  const CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss);
  TORCH_CHECK(!want_grad_target || in.probs, "cross_entropy: only probability targets have a gradient");
  const int64_t rows = in.logits.size(0);
  const bool scalar_loss = reduction != kNone;
  const auto options = in.logits.options();
  at::Tensor loss = loss_tensor(in.logits, reduction, float_loss, {rows});
  CrossEntropyOutputs out;
  if (scalar_loss) {
    out.loss = loss;
  } else {
    out.loss_per_row = loss;
  }
  if (want_lse) out.lse = at::empty({rows}, options.dtype(in.accumulation_dtype()));
  if (scalar_loss && want_grad_logits) out.grad_logits = inplace ? in.logits : in.empty_row_tensor();
  if (scalar_loss && want_grad_target) out.grad_target = in.empty_row_tensor();
  if (in.logits.numel() > 0) launch_cross_entropy(in, reduction, at::Tensor(), out);  // losses.py sends empty inputs to torch
  return {loss, out.grad_logits, out.grad_target, out.lse};
}

// Backward of reduction 'none': grad_output has shape (N,). Returns (grad_logits,
// grad_target), undefined where not asked for.
std::tuple<at::Tensor, at::Tensor> cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                                                          const c10::optional<at::Tensor>& weight,
                                                          int64_t ignore_index,
                                                          double label_smoothing, double z_loss,
                                                          const at::Tensor& grad_output, bool want_grad_logits,
                                                          bool want_grad_target) {
  c10::cuda::CUDAGuard guard(logits.device());
  const CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss);
  TORCH_CHECK(grad_output.numel() == in.logits.size(0) && grad_output.scalar_type() == in.logits.scalar_type() &&
                  grad_output.device() == in.logits.device(),
              "cross_entropy: grad_output must have N elements of input's dtype on input's device");
  TORCH_CHECK(!want_grad_target || in.probs, "cross_entropy: only probability targets have a gradient");
  CrossEntropyOutputs out;
  if (want_grad_logits) out.grad_logits = in.empty_row_tensor();
  if (want_grad_target) out.grad_target = in.empty_row_tensor();
  if (in.logits.numel() > 0 && (want_grad_logits || want_grad_target)) launch_cross_entropy(in, kNone, grad_output.contiguous(), out);
  return {out.grad_logits, out.grad_target};
}

}  // namespace fused_losses
