// row_passes.cu: the row-pass engine: cross-entropy over a chunk of the classes, [class_start,
// class_start + width) of `classes`, of each row, in two passes: `stats` folds the chunk into
// per-row running statistics; `gradient`, given every row's lse, writes the chunk's gradient.
// What runs it (row_passes.py): linear_cross_entropy (chunks of logits that a matrix
// product just wrote, and the gradient written over them), cross_entropy with a softcap
// (whole rows), and vocabulary-parallel cross_entropy (this rank's shard, the statistics
// combined across ranks between the passes).
//
// With softcap s the logits are z' = s tanh(z / s) (Gemma 2), and dz'/dz = 1 - (z'/s)^2; at a
// temperature T every statistic below is of u = z' / T (written z' below), and the gradient
// carries 1 / T.
//   stats:    (5, rows) in the accumulation type: running max m, sum s of exp(z' - m), the
//             target's z' (0 until its chunk comes), the sum of z' (label smoothing) and the
//             sum of exp(z' - m) over the classes other than the target; with the entropy
//             (6, rows), also sum exp(z' - m) (z' - m), moved with m as the sums are (log_probs).
//   gradient: d/dz_c = r (p_c (1 + 2 z_loss lse) - eps / classes - (1 - eps) [c == t]) dz'/dz,
//             p_c = exp((z'_c - m) - log s), lse = m + log s (kept apart: a rounded lse of
//             60 is 4e-6 off), and at the target p_t - 1 = -(the others' sum) / s: written
//             p_t - 1 it cancels in a confident row (1e-5 off 1: 50 fp16 ulps), r the
//             row's scale (grad_output times the reduction's
//             factor; 0 for an ignored row, whose gradient is written as 0; NaN for a
//             class outside [0, classes), which the forward marked NaN); with the entropy, plus
//             h p_c (mu - (z'_c - m)), mu = sum_k p_k (z'_k - m), h the row's entropy_scale.
// Bytes per logit (b = element size): stats b, gradient 2b. One warp a row, or a block a row
// where the rows are few (warps_per_row).

#include <type_traits>

#include "device.cuh"
#include "finish.cuh"
#include "grad_output_guess.cuh"  // scale_by_grad_output_launch, which every build binds
#include "launch.cuh"

namespace fused_losses {

constexpr int kChunkThreads = 256;  // 8 warps a block
constexpr int kChunkWarps = kChunkThreads / 32;

constexpr int kUnroll = 4;          // packs a lane loads before it uses the first

// Where a row's packs go: `parts` warps a row (1, or kChunkWarps: the block), this thread the
// `lane`th of the row's 32 * parts.
struct RowShare {
  int64_t row;
  int lane, parts;
};

__device__ __forceinline__ RowShare row_share(int parts) {
  const int warp = threadIdx.x / 32;
  return {int64_t(blockIdx.x) * (kChunkWarps / parts) + warp / parts, (warp % parts) * 32 + int(threadIdx.x % 32),
          parts};
}

// body(pack, i) for each of this thread's packs of a row `width` long, i the pack's first
// element; kUnroll packs are loaded before the first is used.
template <typename T, int VEC, typename Body>
__device__ __forceinline__ void for_each_lane_pack(const T* row, int64_t width, RowShare share, Body body) {
  const int64_t step = int64_t(32) * share.parts * VEC;  // between one thread's packs
  for (int64_t first = int64_t(share.lane) * VEC; first < width; first += step * kUnroll) {
    Pack<T, VEC> packs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * step < width) packs[u] = load_pack<T, VEC>(row + first + u * step);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u * step >= width) break;
      body(packs[u], first + u * step);
    }
  }
}

// A row's reduction over its warps (parts is the same across the block: the barriers are too).
template <typename T, typename Combine>
__device__ __forceinline__ T row_allreduce(T value, Combine combine, T identity, int parts, T* scratch) {
  return parts == 1 ? warp_allreduce(value, combine) : block_allreduce(value, combine, identity, scratch);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads) logit_chunk_stats_kernel(LogitChunkCall call, int parts) {
  using acc_t = acc_type<T>;
  __shared__ acc_t scratch[32];
  wait_for_previous_kernel();
  const RowShare share = row_share(parts);
  const int64_t row = share.row;
  if (row >= call.rows) return;  // a block a row has none past the end: no barrier skipped
  const Softcap<T> softcap(call.softcap);
  const acc_t inverse_t = static_cast<acc_t>(1 / call.temperature);  // 1: u = z' exactly
  const bool entropy = call.entropy;
  const T* z = static_cast<const T*>(call.logits) + row * call.width;
  const int64_t t = target_of(call.target, call.target_int32, row) - call.class_start;
  // Per lane: a running max and sums of exp (all classes, the others; with the entropy, of exp
  // times u - max), rescaled once per pack.
  acc_t m = -infinity<acc_t>(), s = 0, others = 0, sum = 0, spread = 0;
  for_each_lane_pack<T, VEC>(z, call.width, share, [&](const Pack<T, VEC>& pack, int64_t i) {
    acc_t v[VEC];
    acc_t pack_max = -infinity<acc_t>();
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = softcap.apply(static_cast<acc_t>(pack.val[k])) * inverse_t;
      pack_max = max_acc(pack_max, v[k]);
      sum += v[k];
    }
    if (pack_max > m) {  // from -inf too: exp(-inf) = 0, and a NaN sum stays NaN
      const acc_t rescale = exp_minus<T>(m, pack_max);
      if (entropy) spread = s == acc_t(0) ? acc_t(0) : (spread + (m - pack_max) * s) * rescale;
      s *= rescale;
      others *= rescale;
      m = pack_max;
    }
    // Where the lane's max is -inf so is every value of the pack: exp relative to 0 gives their 0s
    // (relative to -inf, NaN); elsewhere exp(-inf - m) is 0 already.
    const acc_t m_exp = m == -infinity<acc_t>() ? acc_t(0) : m;
    const int64_t t_in_pack = t - i;  // k == t_in_pack at the target: one 64-bit difference a pack
    const int target_k = t_in_pack >= 0 && t_in_pack < VEC ? static_cast<int>(t_in_pack) : -1;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t e = exp_minus<T>(v[k], m_exp);
      s += e;
      if (k != target_k) others += e;
      if (entropy && e != acc_t(0)) spread += e * (v[k] - m);
    }
  });
  // The row's max, each lane's sums moved onto it, then the row's.
  const acc_t row_max = row_allreduce(m, MaxOp(), -infinity<acc_t>(), parts, scratch);
  const acc_t to_row = m == row_max ? acc_t(1) : exp_minus<T>(m, row_max);
  if (entropy) {
    spread = s == acc_t(0) ? acc_t(0) : (spread + (m - row_max) * s) * to_row;
    spread = row_allreduce(spread, SumOp<acc_t>(), acc_t(0), parts, scratch);
  }
  s = row_allreduce(s * to_row, SumOp<acc_t>(), acc_t(0), parts, scratch);
  others = row_allreduce(others * to_row, SumOp<acc_t>(), acc_t(0), parts, scratch);
  sum = row_allreduce(sum, SumOp<acc_t>(), acc_t(0), parts, scratch);
  if (share.lane != 0) return;
  acc_t* stats = static_cast<acc_t*>(call.stats);
  acc_t& run_max = stats[row];
  acc_t& run_sum = stats[call.rows + row];
  acc_t& run_others = stats[4 * call.rows + row];
  // A NaN logit lives on in the sums (max_acc drops it).
  const acc_t new_max = max_acc(run_max, row_max);
  const acc_t old_scale = run_max == new_max ? acc_t(1) : exp_minus<T>(run_max, new_max);
  const acc_t new_scale = row_max == new_max ? acc_t(1) : exp_minus<T>(row_max, new_max);
  if (entropy) {  // each part's sum exp (u - max) moved to the new max: + (its max - the new max) its exp sum
    acc_t& run_spread = stats[5 * call.rows + row];
    const acc_t old_part = run_sum == acc_t(0) ? acc_t(0) : (run_spread + (run_max - new_max) * run_sum) * old_scale;
    const acc_t new_part = s == acc_t(0) ? acc_t(0) : (spread + (row_max - new_max) * s) * new_scale;
    run_spread = old_part + new_part;
  }
  run_sum = run_sum * old_scale + s * new_scale;
  run_others = run_others * old_scale + others * new_scale;
  run_max = new_max;
  if (t >= 0 && t < call.width) stats[2 * call.rows + row] = softcap.apply(static_cast<acc_t>(z[t])) * inverse_t;
  stats[3 * call.rows + row] += sum;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads) logit_chunk_gradient_kernel(LogitChunkCall call, int parts) {
  using acc_t = acc_type<T>;
  wait_for_previous_kernel();
  const RowShare share = row_share(parts);
  const int64_t row = share.row;
  if (row >= call.rows) return;
  const Softcap<T> softcap(call.softcap);
  const acc_t inverse_t = static_cast<acc_t>(1 / call.temperature);
  const T* z = static_cast<const T*>(call.logits) + row * call.width;
  T* grad = static_cast<T*>(call.grad) + row * call.width;
  const acc_t r = static_cast<const acc_t*>(call.row_scale)[row];
  // The entropy's factor h and mean mu (0 without: its term adds 0).
  const acc_t h = call.entropy ? static_cast<const acc_t*>(call.entropy_scale)[row] : acc_t(0);
  const acc_t mu = call.entropy ? static_cast<const acc_t*>(call.softmax_stats)[3 * call.rows + row] : acc_t(0);
  const acc_t shift = static_cast<const acc_t*>(call.softmax_stats)[row];
  const acc_t log_sum = static_cast<const acc_t*>(call.softmax_stats)[call.rows + row];
  const acc_t target_p_minus_1 = static_cast<const acc_t*>(call.softmax_stats)[2 * call.rows + row];
  const acc_t lse = shift + log_sum;
  const acc_t eps = static_cast<acc_t>(call.label_smoothing);
  const acc_t a = r * (acc_t(1) + acc_t(2 * call.z_loss) * lse);
  const acc_t classes = call.class_count != nullptr ? *static_cast<const acc_t*>(call.class_count)
                                                    : static_cast<acc_t>(call.classes);
  const acc_t b = r * eps / classes;
  const int64_t t = target_of(call.target, call.target_int32, row) - call.class_start;
  for_each_lane_pack<T, VEC>(z, call.width, share, [&](Pack<T, VEC> pack, int64_t i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_t slope;
      const acc_t capped = softcap.apply(static_cast<acc_t>(pack.val[k]), slope) * inverse_t;
      const acc_t p = exp_minus<T>(capped - shift, log_sum);
      // At the target a p - r (1 - eps) - b, with p - 1 given.
      acc_t g = i + k == t ? r * target_p_minus_1 + (a - r) * p + r * eps - b : a * p - b;
      if (call.entropy && p != acc_t(0)) g += h * p * (mu - (capped - shift));  // a masked class: 0, not 0 * inf
      // An ignored row: 0, not 0 times an infinite logit's terms.
      pack.val[k] = static_cast<T>(r == acc_t(0) && h == acc_t(0) ? acc_t(0) : g * (slope * inverse_t));
    }
    store_pack<T, VEC>(grad + i, pack);
  });
}

// Warps a row: one, or the whole block where the rows are too few for a warp each to keep the
// memory busy (H100, Gemma 2's 512-row chunks of 256000 classes: frozen head 44.0 -> 39.5 ms; notes v47).
int warps_per_row(int64_t rows, int device) {
  return rows < int64_t(multiprocessor_count(device)) * 32 ? kChunkWarps : 1;
}

template <typename Pick>
void launch_logit_chunk(const LogitChunkCall& call, const LaunchContext& context, Pick pick) {
  if (call.rows == 0 || call.width == 0) return;
  dispatch_dtype(call.dtype, [&](auto tag) {
    constexpr int VEC = vec16<decltype(tag)>();
    // 16-byte packs when every row starts on a 16-byte boundary.
    const bool vector_ok = is_aligned16(call.logits) && (call.grad == nullptr || is_aligned16(call.grad)) &&
                           call.width % VEC == 0;
    auto kernel = vector_ok ? pick(tag, std::integral_constant<int, VEC>{}) : pick(tag, std::integral_constant<int, 1>{});
    const int parts = warps_per_row(call.rows, context.device);
    const int64_t rows_a_block = kChunkWarps / parts;
    launch_kernel(kernel, (call.rows + rows_a_block - 1) / rows_a_block, kChunkThreads, 0, 1, context.device,
                  context.stream, call, parts);
  });
}

// Host entry points (ops.h; entry_points.h's row_passes_forward and row_passes_backward
// call them).

void logit_chunk_stats_launch(const LogitChunkCall& call, const LaunchContext& context) {
  launch_logit_chunk(call, context, [](auto tag, auto vec) {
    return &logit_chunk_stats_kernel<decltype(tag), decltype(vec)::value>;
  });
}

void logit_chunk_gradient_launch(const LogitChunkCall& call, const LaunchContext& context) {
  launch_logit_chunk(call, context, [](auto tag, auto vec) {
    return &logit_chunk_gradient_kernel<decltype(tag), decltype(vec)::value>;
  });
}

}  // namespace fused_losses
