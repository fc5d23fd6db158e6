// row_passes.cu: the row-pass engine: cross-entropy over a chunk of the classes, [class_start,
// class_start + width) of `classes`, of each row, in two passes: `stats` folds the chunk into
// per-row running statistics; `gradient`, given every row's lse, writes the chunk's gradient.
// What runs it (row_passes.py): linear_cross_entropy (chunks of logits that a matrix
// product just wrote, and the gradient written over them), cross_entropy with a softcap
// (whole rows), and vocabulary-parallel cross_entropy (this rank's shard, the statistics
// combined across ranks between the passes).
//
// With softcap s the logits are z' = s tanh(z / s) (Gemma 2), and dz'/dz = 1 - (z'/s)^2.
//   stats:    (5, rows) in the accumulation type: running max m, sum s of exp(z' - m), the
//             target's z' (0 until its chunk comes), the sum of z' (label smoothing) and the
//             sum of exp(z' - m) over the classes other than the target.
//   gradient: d/dz_c = r (p_c (1 + 2 z_loss lse) - eps / classes - (1 - eps) [c == t]) dz'/dz,
//             p_c = exp((z'_c - m) - log s), lse = m + log s (kept apart: a rounded lse of
//             60 is 4e-6 off), and at the target p_t - 1 = -(the others' sum) / s: written
//             p_t - 1 it cancels in a confident row (1e-5 off 1: 50 fp16 ulps), r the
//             row's scale (grad_output times the reduction's
//             factor; 0 for an ignored row, whose gradient is written as 0; NaN for a
//             class outside [0, classes), which the forward marked NaN).
// Bytes per logit (b = element size): stats b, gradient 2b. One warp a row, or a block a row
// where the rows are few (warps_per_row).
// whole_rows: rows that hold every class (linear_cross_entropy's chunks of rows) in one pass,
// the stats and then the gradient over the logits, 2b a logit: a block a row, each thread's
// first packs stashed in shared memory between the two.

#include <type_traits>

#include "device.cuh"
#include "finish.cuh"
#include "grad_output_guess.cuh"  // scale_by_grad_output_launch, which every build binds
#include "launch.cuh"

namespace fused_losses {

constexpr int kChunkThreads = 256;  // 8 warps a block
constexpr int kChunkWarps = kChunkThreads / 32;

constexpr int kUnroll = 4;          // packs a lane loads before it uses the first

// The capped logit z' = s tanh(y), y = z / s, and its slope dz'/dz = 1 - tanh^2(y), as
// 4 q (1 - q) with q = 1 / (e^2|y| + 1): written 1 - tanh^2, a saturated logit's slope would be
// the difference of two numbers near 1 (z = 200, s = 30: 5 bf16 ulps off). For a 2-byte dtype
// in float, with the hardware's exp and division, tanh = 1 - 2q (absolute error about 1e-7; the
// logits carry 2^-9): 8192 x 256000 bf16, softcap 30, a 4096-class chunk's stats pass took 68 us
// with tanhf and a division, 37 us so. For float32 logits in double: tanhf's and expf's 2 ulps
// made a 6-class gradient 3x eager's error against float64.
template <typename T>
struct Softcap {
  using acc_t = acc_type<T>;
  using math_t = std::conditional_t<sizeof(T) == 2, float, double>;
  math_t cap, inverse;  // cap 0: none. For 2-byte logits a product, not a division per logit
                        // (a division's dozen instructions made the passes compute-bound)
  __device__ explicit Softcap(double softcap) : cap(softcap), inverse(softcap > 0 ? 1 / softcap : 0) {}

  __device__ __forceinline__ math_t q_of(math_t y) const {
    if constexpr (sizeof(T) == 2) {
      return __fdividef(1.f, exp2_flush_subnormal(fabsf(y) * (2 * kLog2e)) + 1.f);
    } else {
      return 1 / (exp(2 * fabs(y)) + 1);
    }
  }
  __device__ __forceinline__ math_t y_of(acc_t z) const {
    return sizeof(T) == 2 ? static_cast<math_t>(z) * inverse : static_cast<math_t>(z) / cap;
  }
  __device__ __forceinline__ math_t tanh_of(math_t y, math_t q) const {
    if constexpr (sizeof(T) == 2) {
      return copysignf(1.f - 2.f * q, y);
    } else {
      return tanh(y);
    }
  }
  __device__ __forceinline__ acc_t apply(acc_t z) const {
    if (cap == 0) return z;
    const math_t y = y_of(z);
    return static_cast<acc_t>(cap * tanh_of(y, sizeof(T) == 2 ? q_of(y) : math_t(0)));
  }
  // z' and dz'/dz.
  __device__ __forceinline__ acc_t apply(acc_t z, acc_t& slope) const {
    if (cap == 0) {
      slope = 1;
      return z;
    }
    const math_t y = y_of(z);
    const math_t q = q_of(y);
    slope = static_cast<acc_t>(4 * q * (1 - q));
    return static_cast<acc_t>(cap * tanh_of(y, q));
  }
};

__device__ __forceinline__ int64_t target_of(const void* target, bool target_int32, int64_t row) {
  return target_int32 ? static_cast<const int32_t*>(target)[row] : static_cast<const int64_t*>(target)[row];
}

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

// A lane's share of a row's statistics: a running max, the sums of exp (all classes, and the
// others than the target) rescaled once per pack, and the sum of the (capped) logits.
template <typename T>
struct RowFold {
  using acc_t = acc_type<T>;
  acc_t m, s, others, sum;

  __device__ static RowFold empty() { return {-infinity<acc_t>(), 0, 0, 0}; }

  template <int VEC>
  __device__ __forceinline__ void add(const Pack<T, VEC>& pack, int64_t i, int64_t t, const Softcap<T>& softcap) {
    acc_t v[VEC];
    acc_t pack_max = -infinity<acc_t>();
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      v[k] = softcap.apply(static_cast<acc_t>(pack.val[k]));
      pack_max = max_acc(pack_max, v[k]);
      sum += v[k];
    }
    if (pack_max > m) {  // from -inf too: exp(-inf) = 0, and a NaN sum stays NaN
      const acc_t rescale = exp_minus<T>(m, pack_max);
      s *= rescale;
      others *= rescale;
      m = pack_max;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t e = v[k] == -infinity<acc_t>() ? acc_t(0) : exp_minus<T>(v[k], m);
      s += e;
      others += i + k == t ? acc_t(0) : e;
    }
  }

  // The row's: its max, each lane's sums moved onto it, then summed over the row's lanes.
  __device__ __forceinline__ RowFold row(int parts, acc_t* scratch) const {
    const acc_t row_max = row_allreduce(m, MaxOp(), -infinity<acc_t>(), parts, scratch);
    const acc_t to_row = m == row_max ? acc_t(1) : exp_minus<T>(m, row_max);
    return {row_max, row_allreduce(s * to_row, SumOp<acc_t>(), acc_t(0), parts, scratch),
            row_allreduce(others * to_row, SumOp<acc_t>(), acc_t(0), parts, scratch),
            row_allreduce(sum, SumOp<acc_t>(), acc_t(0), parts, scratch)};
  }
};

// A row's gradient from its softmax statistics (shift m, log s, the target's p - 1) and scale r.
template <typename T>
struct RowGradientTerms {
  using acc_t = acc_type<T>;
  acc_t shift, log_sum, target_p_minus_1, r, eps, a, b;
  int64_t t;

  __device__ RowGradientTerms(const LogitChunkCall& call, int64_t row, acc_t shift_, acc_t log_sum_,
                              acc_t target_p_minus_1_, int64_t t_)
      : shift(shift_), log_sum(log_sum_), target_p_minus_1(target_p_minus_1_), t(t_) {
    r = static_cast<const acc_t*>(call.row_scale)[row];
    eps = static_cast<acc_t>(call.label_smoothing);
    a = r * (acc_t(1) + acc_t(2 * call.z_loss) * (shift + log_sum));
    const acc_t classes = call.class_count != nullptr ? *static_cast<const acc_t*>(call.class_count)
                                                      : static_cast<acc_t>(call.classes);
    b = r * eps / classes;
  }

  template <int VEC>
  __device__ __forceinline__ Pack<T, VEC> of(Pack<T, VEC> pack, int64_t i, const Softcap<T>& softcap) const {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      acc_t slope;
      const acc_t capped = softcap.apply(static_cast<acc_t>(pack.val[k]), slope);
      const acc_t p = exp_minus<T>(capped - shift, log_sum);
      // At the target a p - r (1 - eps) - b, with p - 1 given.
      const acc_t g = i + k == t ? r * target_p_minus_1 + (a - r) * p + r * eps - b : a * p - b;
      // An ignored row: 0, not 0 times an infinite logit's terms.
      pack.val[k] = static_cast<T>(r == acc_t(0) ? acc_t(0) : g * slope);
    }
    return pack;
  }
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads) logit_chunk_stats_kernel(LogitChunkCall call, int parts) {
  using acc_t = acc_type<T>;
  __shared__ acc_t scratch[32];
  wait_for_previous_kernel();
  const RowShare share = row_share(parts);
  const int64_t row = share.row;
  if (row >= call.rows) return;  // a block a row has none past the end: no barrier skipped
  const Softcap<T> softcap(call.softcap);
  const T* z = static_cast<const T*>(call.logits) + row * call.width;
  const int64_t t = target_of(call.target, call.target_int32, row) - call.class_start;
  RowFold<T> fold = RowFold<T>::empty();
  for_each_lane_pack<T, VEC>(z, call.width, share, [&](const Pack<T, VEC>& pack, int64_t i) {
    fold.add(pack, i, t, softcap);
  });
  const RowFold<T> chunk = fold.row(parts, scratch);
  if (share.lane != 0) return;
  acc_t* stats = static_cast<acc_t*>(call.stats);
  acc_t& run_max = stats[row];
  acc_t& run_sum = stats[call.rows + row];
  acc_t& run_others = stats[4 * call.rows + row];
  // A NaN logit lives on in the sums (max_acc drops it).
  const acc_t new_max = max_acc(run_max, chunk.m);
  const acc_t old_scale = run_max == new_max ? acc_t(1) : exp_minus<T>(run_max, new_max);
  const acc_t new_scale = chunk.m == new_max ? acc_t(1) : exp_minus<T>(chunk.m, new_max);
  run_sum = run_sum * old_scale + chunk.s * new_scale;
  run_others = run_others * old_scale + chunk.others * new_scale;
  run_max = new_max;
  if (t >= 0 && t < call.width) stats[2 * call.rows + row] = softcap.apply(static_cast<acc_t>(z[t]));
  stats[3 * call.rows + row] += chunk.sum;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kChunkThreads) logit_chunk_gradient_kernel(LogitChunkCall call, int parts) {
  using acc_t = acc_type<T>;
  wait_for_previous_kernel();
  const RowShare share = row_share(parts);
  const int64_t row = share.row;
  if (row >= call.rows) return;
  const Softcap<T> softcap(call.softcap);
  const T* z = static_cast<const T*>(call.logits) + row * call.width;
  T* grad = static_cast<T*>(call.grad) + row * call.width;
  const acc_t* softmax_stats = static_cast<const acc_t*>(call.softmax_stats);
  const RowGradientTerms<T> terms(call, row, softmax_stats[row], softmax_stats[call.rows + row],
                                  softmax_stats[2 * call.rows + row],
                                  target_of(call.target, call.target_int32, row) - call.class_start);
  for_each_lane_pack<T, VEC>(z, call.width, share, [&](const Pack<T, VEC>& pack, int64_t i) {
    store_pack<T, VEC>(grad + i, terms.of(pack, i, softcap));
  });
}

// whole_rows: a block a row, one block a multiprocessor with all of its shared memory for the
// stash (so the fewest rows in flight: what is not stashed is read again, most likely from L2).
constexpr int kWholeRowThreads = 512;
constexpr int kWholeRowWarps = kWholeRowThreads / 32;

// A pack from global into shared memory: on sm_80 and later by cp.async, without registers,
// waited for by wait_for_copies (this thread's copies); elsewhere a load and a store.
template <typename T, int VEC>
__device__ __forceinline__ void copy_to_shared(Pack<T, VEC>* to, const T* from) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(Pack<T, VEC>) == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(to))),
                 "l"(from)
                 : "memory");
    return;
  }
#endif
  *to = load_pack<T, VEC>(from);
}

__device__ __forceinline__ void wait_for_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Rows of every class (class_start 0, width = classes), the gradient written over the logits:
// the statistics (written to stats as the stats kernel folds them into new ones, and the
// softmax statistics from them as row_passes.softmax_stats_of), then the gradient. Each
// thread's first `stash_packs` packs of a row are copied into shared memory (the stash) while
// the rest go through registers, and read from there again for the gradient; as each stashed
// pack's gradient is written, the same pack of the block's next row is copied in its place.
// No thread reads another's stash: no barrier but the reductions'.
template <typename T, int VEC>
__global__ void __launch_bounds__(kWholeRowThreads) whole_rows_kernel(LogitChunkCall call, int stash_packs) {
  using acc_t = acc_type<T>;
  __shared__ acc_t scratch[32];
  extern __shared__ __align__(16) unsigned char stash_bytes[];
  wait_for_previous_kernel();
  const Softcap<T> softcap(call.softcap);
  const int rank = threadIdx.x;
  const int64_t packs = call.width / VEC;  // VEC divides the width (whole_rows_launch)
  const int64_t mine = rank < packs ? (packs - 1 - rank) / kWholeRowThreads + 1 : 0;  // this thread's packs
  const int64_t stashed = mine < stash_packs ? mine : stash_packs;
  auto first_of = [&](int64_t n) { return (rank + n * kWholeRowThreads) * VEC; };  // its n-th pack's element
  Pack<T, VEC>* stash = reinterpret_cast<Pack<T, VEC>*>(stash_bytes) + rank;  // its n-th at [n * threads]
  T* logits = static_cast<T*>(call.grad);  // the logits, then their gradient
  acc_t* stats = static_cast<acc_t*>(call.stats);
  if (blockIdx.x < call.rows) {
    for (int64_t n = 0; n < stashed; ++n) copy_to_shared(stash + n * kWholeRowThreads, logits + blockIdx.x * call.width + first_of(n));
  }
  for (int64_t row = blockIdx.x; row < call.rows; row += gridDim.x) {
    T* z = logits + row * call.width;
    const int64_t t = target_of(call.target, call.target_int32, row);
    RowFold<T> fold = RowFold<T>::empty();
    for (int64_t n = stashed; n < mine; n += kUnroll) {  // the rest, while the stash's copies land
      Pack<T, VEC> loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (n + u < mine) loaded[u] = load_pack<T, VEC>(z + first_of(n + u));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (n + u < mine) fold.add(loaded[u], first_of(n + u), t, softcap);
      }
    }
    wait_for_copies();
    for (int64_t n = 0; n < stashed; ++n) fold.add(stash[n * kWholeRowThreads], first_of(n), t, softcap);
    // Read before the reductions' barriers: after them other threads write the gradient.
    const acc_t target_logit = rank == 0 && t >= 0 && t < call.width ? softcap.apply(static_cast<acc_t>(z[t])) : 0;
    const RowFold<T> whole = fold.row(kWholeRowWarps, scratch);
    if (rank == 0) {
      stats[row] = whole.m;
      stats[call.rows + row] = whole.s;
      stats[2 * call.rows + row] = target_logit;
      stats[3 * call.rows + row] = whole.sum;
      stats[4 * call.rows + row] = whole.others;
    }
    const RowGradientTerms<T> terms(call, row, whole.m, log_acc(whole.s), -whole.others / whole.s, t);
    for (int64_t n = stashed; n < mine; n += kUnroll) {  // read again: most likely from L2
      Pack<T, VEC> loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (n + u < mine) loaded[u] = load_pack<T, VEC>(z + first_of(n + u));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (n + u < mine) store_pack<T, VEC>(z + first_of(n + u), terms.of(loaded[u], first_of(n + u), softcap));
      }
    }
    const T* next = row + gridDim.x < call.rows ? z + gridDim.x * call.width : nullptr;
    for (int64_t n = 0; n < stashed; ++n) {
      store_pack<T, VEC>(z + first_of(n), terms.of(stash[n * kWholeRowThreads], first_of(n), softcap));
      if (next != nullptr) copy_to_shared(stash + n * kWholeRowThreads, next + first_of(n));
    }
  }
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

void whole_rows_launch(const LogitChunkCall& call, const LaunchContext& context) {
  if (call.rows == 0 || call.width == 0) return;
  dispatch_dtype(call.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = vec16<T>();
    auto launch = [&](auto kernel, int64_t pack_elements, size_t pack_bytes) {
      // Each thread's packs, as many as fit the multiprocessor's shared memory.
      const int64_t packs = call.width / pack_elements;
      const int64_t per_thread = (packs + kWholeRowThreads - 1) / kWholeRowThreads;
      const int64_t fit = int64_t(max_dynamic_smem(kernel, context.device) / (kWholeRowThreads * pack_bytes));
      const int stash_packs = int(std::min(per_thread, fit));
      const size_t smem = size_t(stash_packs) * kWholeRowThreads * pack_bytes;
      const int64_t resident = int64_t(multiprocessor_count(context.device)) *
                               resident_blocks_per_sm(kernel, kWholeRowThreads, context.device, smem);
      launch_kernel(kernel, std::min(call.rows, resident), kWholeRowThreads, smem, 1, context.device, context.stream,
                    call, stash_packs);
    };
    if (is_aligned16(call.grad) && call.width % VEC == 0) {
      launch(&whole_rows_kernel<T, VEC>, VEC, sizeof(Pack<T, VEC>));
    } else {
      launch(&whole_rows_kernel<T, 1>, 1, sizeof(Pack<T, 1>));
    }
  });
}

}  // namespace fused_losses
