// cross_entropy.cu: cross-entropy over rows of logits with class-index targets, as
// F.cross_entropy(logits, target, ignore_index=..., reduction=...) for (N, C) logits.
//
//   lse_r  = log(sum_c exp(x_rc))                       (online max / sum, one pass)
//   loss_r = lse_r - x_r,t_r,  or 0 where t_r == ignore_index
//   d loss_r / d x_rc = (exp(x_rc - lse_r) - [c == t_r]) * scale_r
// reduced by 'mean' (/ number of non-ignored rows), 'sum' or 'none'. A target outside
// [0, C) that is not ignore_index gives NaN for its row (torch raises a device-side
// assert, which would poison the CUDA context).
//
// Bytes per logit (b = element size): forward b. Training step: 2b (read the logits,
// write the gradient in the same kernel; backward only scales it by grad_output, and
// not at all when that is 1). A row of up to kCachePacks * kMaxThreads packs stays in
// registers between the two passes, so it is read from HBM once; a longer row is read
// twice, the second time mostly from L2.

#include "common.cuh"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Device helpers.

// 16-byte packs per thread kept in registers (8 x 4 registers) when the row fits.
constexpr int kCachePacks = 8;

// Running max and sum of exp(x - max) over part of a row, in acc_t (float, or double
// for float64 logits).
template <typename acc_t>
struct MaxSum {
  acc_t max;
  acc_t sum;
};

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> combine(MaxSum<acc_t> a, MaxSum<acc_t> b) {
  const acc_t max = max_acc(a.max, b.max);
  // When both maxima are -inf nothing has been added yet: keep the sum at 0, not NaN.
  if (max == -infinity<acc_t>()) return {max, acc_t(0)};
  return {max, a.sum * exp_acc(a.max - max) + b.sum * exp_acc(b.max - max)};
}

template <typename acc_t>
__device__ __forceinline__ MaxSum<acc_t> shfl_xor(MaxSum<acc_t> v, int mask) {
  return {shfl_xor(v.max, mask), shfl_xor(v.sum, mask)};
}

struct CombineMaxSum {
  template <typename acc_t>
  __device__ __forceinline__ MaxSum<acc_t> operator()(MaxSum<acc_t> a, MaxSum<acc_t> b) const {
    return combine(a, b);
  }
};

template <typename T, int VEC, typename acc_t = at::opmath_type<T>>
__device__ __forceinline__ MaxSum<acc_t> add_pack(MaxSum<acc_t> acc, const Pack<T, VEC>& pack) {
  acc_t pack_max = -infinity<acc_t>();
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack_max = max_acc(pack_max, static_cast<acc_t>(pack.val[k]));
  const acc_t max = max_acc(acc.max, pack_max);
  if (max == -infinity<acc_t>()) return acc;
  acc_t sum = acc.sum * exp_acc(acc.max - max);
#pragma unroll
  for (int k = 0; k < VEC; ++k) sum += exp_for<T>(static_cast<acc_t>(pack.val[k]) - max);
  return {max, sum};
}

// The gradient of one pack of a row: (softmax - one_hot(target)) * scale, with
// softmax = exp((x - row_max) - log_sum): x - row_max is exact where it matters most
// (near the max), so this rounds less than exp(x - lse).
template <typename T, int VEC, typename acc_t>
__device__ __forceinline__ Pack<T, VEC> grad_pack(const Pack<T, VEC>& logits, int64_t first_class,
                                                  int64_t one_hot_class, acc_t row_max, acc_t log_sum,
                                                  acc_t scale) {
  Pack<T, VEC> grad;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const acc_t softmax = exp_for<T>((static_cast<acc_t>(logits.val[k]) - row_max) - log_sum);
    const acc_t one_hot = first_class + k == one_hot_class ? acc_t(1) : acc_t(0);
    grad.val[k] = static_cast<T>((softmax - one_hot) * scale);
  }
  return grad;
}

// Visits every pack of a row read from memory (a row too long for the register cache,
// or backward of 'none'), kLoadsAhead packs in flight per thread: visit(pack, index).
template <typename T, int VEC, typename Visit>
__device__ __forceinline__ void for_each_row_pack(const T* x, int64_t num_packs, Visit visit) {
  int64_t p = threadIdx.x;
  for (; p + (kLoadsAhead - 1) * blockDim.x < num_packs; p += kLoadsAhead * blockDim.x) {
    Pack<T, VEC> packs[kLoadsAhead];
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) packs[u] = load_pack<T, VEC>(x + (p + u * blockDim.x) * VEC);
#pragma unroll
    for (int u = 0; u < kLoadsAhead; ++u) visit(packs[u], p + u * blockDim.x);
  }
  for (; p < num_packs; p += blockDim.x) visit(load_pack<T, VEC>(x + p * VEC), p);
}

// The gradient of a row read from memory.
template <typename T, int VEC, typename acc_t>
__device__ __forceinline__ void store_row_grad(const T* x, T* g, int64_t num_packs, int64_t one_hot, acc_t row_max,
                                               acc_t log_sum, acc_t scale) {
  for_each_row_pack<T, VEC>(x, num_packs, [&](const Pack<T, VEC>& pack, int64_t p) {
    store_pack<T, VEC>(g + p * VEC, grad_pack(pack, p * VEC, one_hot, row_max, log_sum, scale));
  });
}

struct RowTarget {
  int64_t index;
  bool ignored;  // == ignore_index: contributes no loss and a zero gradient
  bool valid;    // in [0, C)

  // The class whose gradient gets the -1, or -1 for none (an ignored row's gradient is
  // softmax * 0, as torch computes it: 0, or NaN where the row's softmax is NaN).
  __device__ __forceinline__ int64_t one_hot_class() const { return ignored ? -1 : index; }
};

template <typename index_t>
__device__ __forceinline__ RowTarget row_target(const index_t* target, int64_t row, int64_t num_classes,
                                                int64_t ignore_index) {
  const int64_t t = static_cast<int64_t>(target[row]);
  return {t, t == ignore_index, t >= 0 && t < num_classes};
}

// ---------------------------------------------------------------------------------
// Kernels.

// Counts targets != ignore_index (the divisor of 'mean'); integer atomics, so the
// count is exact and the same every run. `count` starts at 0.
template <typename index_t>
__global__ void count_valid_targets_kernel(const index_t* target, int64_t rows, int64_t ignore_index,
                                           int64_t* count) {
  __shared__ long long scratch[32];
  long long local = 0;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    local += static_cast<int64_t>(target[r]) != ignore_index;
  }
  local = block_sum(local, scratch);
  if (threadIdx.x == 0 && local != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(count), static_cast<unsigned long long>(local));
  }
}

struct CrossEntropyOutputs {
  void* loss_per_row;  // T[rows], reduction 'none'
  void* lse;           // acc_t[rows], reduction 'none' with grad: saved for backward
  sum_t* partials;     // [gridDim.x], scalar reductions
  void* grad_logits;   // T[rows, C], scalar reductions with grad
  const int64_t* valid_count;  // 'mean' with grad: the gradient scale is 1 / *valid_count
};

// One block per row (grid-stride over rows). A row that fits the register cache is read
// from HBM once: max and sum(exp(x - max)) are then two exact passes over registers,
// and the gradient is written from them. A longer row is read with an online max/sum,
// and read again (mostly from L2) for the gradient.
template <typename T, typename index_t, int VEC>
__global__ void __launch_bounds__(kMaxThreads) cross_entropy_forward_kernel(
    const T* __restrict__ logits, const index_t* __restrict__ target, int64_t rows, int64_t num_classes,
    int64_t ignore_index, CrossEntropyOutputs out) {
  using acc_t = at::opmath_type<T>;
  __shared__ MaxSum<acc_t> scratch_pair[32];
  __shared__ acc_t scratch[32];
  const int64_t num_packs = num_classes / VEC;
  const bool row_in_registers = num_packs <= int64_t(kCachePacks) * blockDim.x;
  T* grad_logits = static_cast<T*>(out.grad_logits);
  const acc_t grad_scale = out.valid_count != nullptr ? acc_t(1) / acc_t(*out.valid_count) : acc_t(1);
  sum_t block_loss = 0;  // meaningful in thread 0

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * num_classes;
    Pack<T, VEC> cache[kCachePacks];
    acc_t row_max, sum;
    if (row_in_registers) {
      acc_t thread_max = -infinity<acc_t>();
#pragma unroll
      for (int k = 0; k < kCachePacks; ++k) {
        const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
        if (p < num_packs) cache[k] = load_pack<T, VEC>(x + p * VEC);
      }
#pragma unroll
      for (int k = 0; k < kCachePacks; ++k) {
        if (threadIdx.x + int64_t(k) * blockDim.x < num_packs) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) thread_max = max_acc(thread_max, static_cast<acc_t>(cache[k].val[j]));
        }
      }
      row_max = block_allreduce(thread_max, MaxOp(), -infinity<acc_t>(), scratch);
      acc_t thread_sum = 0;
#pragma unroll
      for (int k = 0; k < kCachePacks; ++k) {
        if (threadIdx.x + int64_t(k) * blockDim.x < num_packs) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) thread_sum += exp_for<T>(static_cast<acc_t>(cache[k].val[j]) - row_max);
        }
      }
      sum = block_sum(thread_sum, scratch);
    } else {
      MaxSum<acc_t> acc = {-infinity<acc_t>(), acc_t(0)};
      for_each_row_pack<T, VEC>(x, num_packs, [&](const Pack<T, VEC>& pack, int64_t) { acc = add_pack(acc, pack); });
      acc = block_allreduce(acc, CombineMaxSum(), MaxSum<acc_t>{-infinity<acc_t>(), acc_t(0)}, scratch_pair);
      row_max = acc.max;
      sum = acc.sum;
    }
    const acc_t log_sum = log_acc(sum);
    const RowTarget t = row_target(target, row, num_classes, ignore_index);

    if (threadIdx.x == 0) {
      // (max - x_t) + log_sum: the difference first, so a loss near 0 keeps its digits.
      const acc_t row_loss = t.ignored ? acc_t(0)
                             : t.valid ? (row_max - static_cast<acc_t>(x[t.index])) + log_sum
                                       : quiet_nan<acc_t>();
      if (out.loss_per_row != nullptr) static_cast<T*>(out.loss_per_row)[row] = static_cast<T>(row_loss);
      if (out.lse != nullptr) static_cast<acc_t*>(out.lse)[row] = row_max + log_sum;
      block_loss += row_loss;
    }

    if (grad_logits != nullptr) {
      T* g = grad_logits + row * num_classes;
      const acc_t scale = t.ignored ? acc_t(0) : t.valid ? grad_scale : quiet_nan<acc_t>();
      const int64_t one_hot = t.one_hot_class();
      if (row_in_registers) {
#pragma unroll
        for (int k = 0; k < kCachePacks; ++k) {
          const int64_t p = threadIdx.x + int64_t(k) * blockDim.x;
          if (p < num_packs) {
            store_pack<T, VEC>(g + p * VEC, grad_pack(cache[k], p * VEC, one_hot, row_max, log_sum, scale));
          }
        }
      } else {
        store_row_grad<T, VEC>(x, g, num_packs, one_hot, row_max, log_sum, scale);
      }
    }
  }
  if (out.partials != nullptr && threadIdx.x == 0) out.partials[blockIdx.x] = block_loss;
}

// Backward of reduction 'none': grad = (softmax - one_hot) * grad_output[row], with
// the lse the forward saved.
template <typename T, typename index_t, int VEC>
__global__ void __launch_bounds__(kMaxThreads) cross_entropy_backward_kernel(
    const T* __restrict__ logits, const index_t* __restrict__ target,
    const at::opmath_type<T>* __restrict__ lse, const T* __restrict__ grad_output, int64_t rows,
    int64_t num_classes, int64_t ignore_index, T* __restrict__ grad_logits) {
  using acc_t = at::opmath_type<T>;
  const int64_t num_packs = num_classes / VEC;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * num_classes;
    T* g = grad_logits + row * num_classes;
    const RowTarget t = row_target(target, row, num_classes, ignore_index);
    const acc_t scale = t.ignored ? acc_t(0) : t.valid ? static_cast<acc_t>(grad_output[row]) : quiet_nan<acc_t>();
    const int64_t one_hot = t.one_hot_class();
    store_row_grad<T, VEC>(x, g, num_packs, one_hot, lse[row], acc_t(0), scale);
  }
}

// ---------------------------------------------------------------------------------
// Host entry points.

struct RowLaunch {
  int threads;
  int64_t grid;
};

// Threads per row: enough that the row fits the register cache, at most kMaxThreads.
// One block per row, as many blocks as fit on the GPU at once.
template <typename Kernel>
RowLaunch row_launch(Kernel kernel, int64_t rows, int64_t num_packs, int device) {
  int threads = 32;
  while (threads < kMaxThreads && int64_t(threads) * kCachePacks < num_packs) threads *= 2;
  return {threads, grid_for(rows * threads, threads, resident_blocks_per_sm(kernel, threads), device)};
}

// The saved lse is kept in the accumulation type.
inline at::ScalarType lse_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_cross_entropy_inputs(const at::Tensor& logits, const at::Tensor& target) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "cross_entropy: input must be 2-D (N, C) on CUDA");
  TORCH_CHECK(target.device() == logits.device(), "cross_entropy: target must be on input's device");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), "cross_entropy: target must have shape (N,)");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "cross_entropy: target must be int64 or int32 class indices");
}

// The types a launch is compiled for, passed to a generic lambda as a tag.
template <typename T, typename index_t, int VEC>
struct Config {
  using scalar = T;
  using index = index_t;
  static constexpr int vec = VEC;
};

// Calls body(Config<scalar_t, index_t, VEC>{}) for the tensors' types and the widest
// vector width the row layout allows.
template <typename Body>
void dispatch_cross_entropy(const at::Tensor& logits, const at::Tensor& target, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy", [&] {
    constexpr int VEC = vec16<scalar_t>();
    const bool vector_ok = is_aligned16(logits.data_ptr()) && logits.size(1) % VEC == 0;
    auto with_index = [&](auto index_zero) {
      using index_t = decltype(index_zero);
      if (vector_ok) {
        body(Config<scalar_t, index_t, VEC>{});
      } else {
        body(Config<scalar_t, index_t, 1>{});
      }
    };
    if (target.scalar_type() == at::kLong) {
      with_index(int64_t(0));
    } else {
      with_index(int32_t(0));
    }
  });
}

// Returns (loss, grad_logits, lse):
//   scalar reduction: loss is 0-dim; grad_logits is written when want_grad; lse is empty.
//   'none': loss is (N,); grad_logits is empty; lse ((N,), float32, or float64 for
//   float64 logits) is written when want_grad, for backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits_arg,
                                                                     const at::Tensor& target_arg,
                                                                     int64_t ignore_index, int64_t reduction,
                                                                     bool want_grad) {
  check_cross_entropy_inputs(logits_arg, target_arg);
  c10::cuda::CUDAGuard guard(logits_arg.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor logits = logits_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const int64_t rows = logits.size(0);
  const int64_t num_classes = logits.size(1);
  const bool scalar_loss = reduction != kNone;
  const auto lse_options = logits.options().dtype(lse_dtype(logits));
  at::Tensor loss = scalar_loss ? at::empty({}, logits.options()) : at::empty({rows}, logits.options());
  at::Tensor grad_logits = scalar_loss && want_grad ? at::empty_like(logits) : at::empty({0}, logits.options());
  at::Tensor lse = !scalar_loss && want_grad ? at::empty({rows}, lse_options) : at::empty({0}, lse_options);
  if (rows == 0 || num_classes == 0) return {loss, grad_logits, lse};  // losses.py sends these to torch

  dispatch_cross_entropy(logits, target, [&](auto config) {
    using T = typename decltype(config)::scalar;
    using index_t = typename decltype(config)::index;
    constexpr int VEC = decltype(config)::vec;
    at::Tensor valid_count;
    if (reduction == kMean) {
      valid_count = at::zeros({1}, logits.options().dtype(at::kLong));
      const int threads = 256;
      static const int count_blocks_per_sm = resident_blocks_per_sm(count_valid_targets_kernel<index_t>, threads);
      const int64_t count_grid = grid_for(rows, threads, count_blocks_per_sm, logits.get_device());
      count_valid_targets_kernel<index_t><<<count_grid, threads, 0, stream>>>(
          target.data_ptr<index_t>(), rows, ignore_index, valid_count.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const RowLaunch launch =
        row_launch(cross_entropy_forward_kernel<T, index_t, VEC>, rows, num_classes / VEC, logits.get_device());
    at::Tensor partials = at::empty({scalar_loss ? launch.grid : 0}, logits.options().dtype(at::kDouble));
    CrossEntropyOutputs out;
    out.loss_per_row = scalar_loss ? nullptr : loss.data_ptr();
    out.lse = lse.numel() ? lse.data_ptr() : nullptr;
    out.partials = scalar_loss ? partials.data_ptr<sum_t>() : nullptr;
    out.grad_logits = grad_logits.numel() ? grad_logits.data_ptr() : nullptr;
    out.valid_count = reduction == kMean && want_grad ? valid_count.data_ptr<int64_t>() : nullptr;
    cross_entropy_forward_kernel<T, index_t, VEC><<<launch.grid, launch.threads, 0, stream>>>(
        logits.data_ptr<T>(), target.data_ptr<index_t>(), rows, num_classes, ignore_index, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (scalar_loss) {
      finish_sum(partials, 1.0, reduction == kMean ? valid_count.data_ptr<int64_t>() : nullptr, loss);
    }
  });
  return {loss, grad_logits, lse};
}

// Backward of reduction 'none': grad_output has shape (N,).
at::Tensor cross_entropy_backward(const at::Tensor& logits_arg, const at::Tensor& target_arg,
                                  const at::Tensor& lse_arg, const at::Tensor& grad_output_arg,
                                  int64_t ignore_index) {
  check_cross_entropy_inputs(logits_arg, target_arg);
  const int64_t rows = logits_arg.size(0);
  TORCH_CHECK(lse_arg.numel() == rows && lse_arg.scalar_type() == lse_dtype(logits_arg), "cross_entropy: bad saved lse");
  TORCH_CHECK(grad_output_arg.numel() == rows && grad_output_arg.scalar_type() == logits_arg.scalar_type(),
              "cross_entropy: grad_output must have N elements of input's dtype");
  c10::cuda::CUDAGuard guard(logits_arg.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor logits = logits_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const at::Tensor lse = lse_arg.contiguous();
  const at::Tensor grad_output = grad_output_arg.contiguous();
  at::Tensor grad_logits = at::empty_like(logits);
  const int64_t num_classes = logits.size(1);
  if (grad_logits.numel() == 0) return grad_logits;
  dispatch_cross_entropy(logits, target, [&](auto config) {
    using T = typename decltype(config)::scalar;
    using index_t = typename decltype(config)::index;
    constexpr int VEC = decltype(config)::vec;
    const RowLaunch launch =
        row_launch(cross_entropy_backward_kernel<T, index_t, VEC>, rows, num_classes / VEC, logits.get_device());
    cross_entropy_backward_kernel<T, index_t, VEC><<<launch.grid, launch.threads, 0, stream>>>(
        logits.data_ptr<T>(), target.data_ptr<index_t>(), lse.data_ptr<at::opmath_type<T>>(), grad_output.data_ptr<T>(), rows,
        num_classes, ignore_index, grad_logits.data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_logits;
}

}  // namespace fused_losses

// ---------------------------------------------------------------------------------
// Bindings (FUSED_LOSSES_LIBRARY: see common.cuh).

FUSED_LOSSES_LIBRARY(m) {
  m.def("forward", &fused_losses::cross_entropy_forward);
  m.def("backward", &fused_losses::cross_entropy_backward);
  m.def("scale_by_grad_output_(Tensor(a!) grad, Tensor grad_output) -> ()",
        &fused_losses::scale_by_grad_output_);
}
