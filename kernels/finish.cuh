// finish.cuh: the end of every scalar reduction: the finish that adds the blocks' partials
// in a fixed order, the per-stream ticket, and the backward of a scalar loss
// (scale_by_grad_output_).
//
// Scalar reductions are deterministic to the bit: every block writes one partial sum,
// then the kernel's last block adds the partials in a fixed order (see Finish). The grid
// size depends only on the problem size and the GPU, so the same inputs give the same
// bits run after run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "device.cuh"
#include "launch.cuh"
#include "ops.h"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Stage two of every scalar reduction: one block adds the per-block partials in a
// fixed order and writes the loss. `partials` holds `num_terms` rows of `num_partials`
// block sums; the loss is scale * sum over terms of (term's sum / term's divisor).
// A divisor is 1, or, when `divisors` is given (cross-entropy 'mean': the number or the
// weight of the non-ignored targets, known only on the device), the sum of its row of
// `num_divisors` block sums.
//
// That block is the loss kernel's own block that finishes last (finish_if_last_block):
// one launch per call rather than two, which saves launch-bound calls a few microseconds
// of host time and large ones the GPU's gap between two kernels plus a kernel's start.
// It knows it is last from a per-stream ticket (finish_ticket). Where there is none (a
// stream being captured into a CUDA graph), finish_sum_kernel runs after the loss kernel.
// Either way the sum's order depends only on the grid and block sizes: same bits each run.

constexpr int kMaxTerms = 2;  // cross-entropy's ce and z-loss
constexpr int kFinishThreads = 512;

struct Finish {
  sum_t* partials = nullptr;  // (num_terms, num_partials); nullptr: no scalar loss
  int64_t num_partials = 0;
  int num_terms = 1;
  double scale = 1.0;
  const sum_t* divisors = nullptr;  // (num_terms, num_divisors), or nullptr
  int64_t num_divisors = 0;
  void* loss = nullptr;  // 0-dim, of loss_type
  c10::ScalarType loss_type = c10::ScalarType::Float;
  unsigned int* ticket = nullptr;  // the loss kernel's finished blocks; nullptr: finish_sum_kernel
};

template <typename out_t>
__device__ __forceinline__ void store_as(void* out, double value) {
  *static_cast<out_t*>(out) = static_cast<out_t>(value);
}

// Partials are read through L2 (ld.global.cg): other blocks of the same launch wrote them.
__device__ __noinline__ void finish_partials(Finish finish, sum_t* scratch) {
  // Every load of every term and divisor goes out before any is added: one trip to memory
  // rather than one per term and divisor (cross-entropy's 'mean' made four: 4.4-5.3 us
  // on an H100, against 1.7 us for one term).
  sum_t totals[kMaxTerms] = {}, divisor_sums[kMaxTerms] = {};
  const int64_t count = finish.num_partials > finish.num_divisors ? finish.num_partials : finish.num_divisors;
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
#pragma unroll
    for (int term = 0; term < kMaxTerms; ++term) {
      if (term < finish.num_terms && i < finish.num_partials) {
        totals[term] += __ldcg(finish.partials + term * finish.num_partials + i);
      }
      if (term < finish.num_terms && i < finish.num_divisors) {
        divisor_sums[term] += __ldcg(finish.divisors + term * finish.num_divisors + i);
      }
    }
  }
  double result = 0;
#pragma unroll
  for (int term = 0; term < kMaxTerms; ++term) {
    if (term < finish.num_terms) {
      const sum_t total = block_sum(totals[term], scratch);
      result += finish.divisors != nullptr ? total / block_sum(divisor_sums[term], scratch) : total;
    }
  }
  if (threadIdx.x != 0) return;
  result *= finish.scale;
  switch (finish.loss_type) {
    case c10::ScalarType::Double: store_as<double>(finish.loss, result); break;
    case c10::ScalarType::Half: store_as<at::Half>(finish.loss, result); break;
    case c10::ScalarType::BFloat16: store_as<at::BFloat16>(finish.loss, result); break;
    default: store_as<float>(finish.loss, result); break;
  }
}

__global__ void finish_sum_kernel(Finish finish) {
  __shared__ sum_t scratch[32];
  wait_for_previous_kernel();
  finish_partials(finish, scratch);
}

// Thread 0 takes the block's ticket: whether the block is the launch's last. One
// acquire-release atomic at GPU scope. Release: the writes before it (this thread's, and
// other threads' before a __syncthreads that precedes it) are visible to whoever takes a
// later ticket. Acquire: the last block's reads after it see every block's writes.
// CUDA's threadFenceReduction pattern (a sequentially consistent fence before a relaxed
// atomicAdd, another after it in the last block) ended an MSE forward 0.3-0.5 us later on an
// H100; a release atomic with an acquire fence in the last block, 0.3 us later (notes, v32).
__device__ __forceinline__ bool take_ticket_is_last(unsigned int* ticket) {
  unsigned int taken;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(taken) : "l"(ticket) : "memory");
  return taken == gridDim.x - 1;
}

// The end of a loss kernel, after thread 0 wrote the block's partials (and divisors), or
// other threads wrote them before a __syncthreads: the last block to get here adds everyone's.
__device__ __forceinline__ void finish_if_last_block(const Finish& finish, sum_t* scratch) {
  if (finish.ticket == nullptr) return;
  __shared__ bool last;
  if (threadIdx.x == 0) last = take_ticket_is_last(finish.ticket);
  __syncthreads();
  if (!last) return;
  finish_partials(finish, scratch);
  if (threadIdx.x == 0) *finish.ticket = 0;  // ready for the stream's next launch
}

// The ticket of `stream`: a counter of the launch's finished blocks, zeroed once, that each
// launch's last block sets back to 0. One per stream and device, since launches on one
// stream never overlap and on two they may. Kept for the life of the process (4 bytes per
// stream: torch's streams come from a fixed pool).
// nullptr while the stream is being captured into a CUDA graph: a graph may be replayed
// on another stream, beside launches on this one. nullptr for cudaStreamPerThread too:
// one handle that names another stream in each host thread.
inline unsigned int* finish_ticket(int device, cudaStream_t stream) {
  if (stream == cudaStreamPerThread || is_capturing(stream)) return nullptr;
  static Remembered<std::pair<int, cudaStream_t>, unsigned int*> tickets;
  return tickets.get({device, stream}, [&] {
    // A tensor never destroyed: its memory stays ours, and no destructor runs after the
    // allocator's at exit. Zeroed on `stream`, so the first launch there sees 0.
    auto* ticket = new at::Tensor(
        at::zeros({1}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kInt)));
    return static_cast<unsigned int*>(ticket->data_ptr());
  });
}

// What a loss kernel launched on `stream` needs to finish the scalar `loss` (0-dim) itself.
inline Finish make_finish(sum_t* partials, int num_terms, int64_t num_partials, double scale,
                          const sum_t* divisors, int64_t num_divisors, const at::Tensor& loss, cudaStream_t stream) {
  TORCH_CHECK(num_terms >= 1 && num_terms <= kMaxTerms, "make_finish: internal error: ", num_terms, " terms");
  Finish finish;
  finish.partials = partials;
  finish.num_partials = num_partials;
  finish.num_terms = num_terms;
  finish.scale = scale;
  finish.divisors = divisors;
  finish.num_divisors = num_divisors;
  finish.loss = loss.data_ptr();
  finish.loss_type = loss.scalar_type();
  finish.ticket = finish_ticket(loss.get_device(), stream);
  return finish;
}

// After the loss kernel: the finish it could not do itself (no ticket), in a launch of its own.
inline void finish_without_ticket(const Finish& finish, cudaStream_t stream) {
  if (finish.partials == nullptr || finish.ticket != nullptr) return;
  launch_kernel(finish_sum_kernel, 1, kFinishThreads, 0, 1, stream, finish);
}

// ---------------------------------------------------------------------------------
// Backward of a scalar loss whose gradient the forward already wrote: multiply it by
// grad_output in place. grad_output is read on the device (no host sync), and when it
// is exactly 1, the usual loss.backward(), every block returns without touching memory.

template <typename T, int VEC>
__global__ void scale_by_grad_output_kernel(T* grad, int64_t n, const T* grad_output) {
  using acc_t = at::opmath_type<T>;
  wait_for_previous_kernel();
  const acc_t scale = static_cast<acc_t>(*grad_output);
  if (scale == acc_t(1)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_packs = n / VEC;
  for (int64_t p = first; p < num_packs; p += stride) {
    Pack<T, VEC> pack = load_pack<T, VEC>(grad + p * VEC);
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.val[k] = static_cast<T>(static_cast<acc_t>(pack.val[k]) * scale);
    store_pack<T, VEC>(grad + p * VEC, pack);
  }
  for (int64_t i = num_packs * VEC + first; i < n; i += stride) {
    grad[i] = static_cast<T>(static_cast<acc_t>(grad[i]) * scale);
  }
}

// In place: grad *= grad_output (a 0-dim tensor of grad's dtype on grad's device). Not
// inline: the bindings call it from another translation unit (ops.h); each build
// compiles this header once.
void scale_by_grad_output_(at::Tensor grad, const at::Tensor& grad_output) {
  TORCH_CHECK(grad.is_cuda() && grad.is_contiguous(), "grad must be a contiguous CUDA tensor");
  TORCH_CHECK(grad_output.numel() == 1 && grad_output.scalar_type() == grad.scalar_type() &&
                  grad_output.device() == grad.device(),
              "grad_output must be one element of grad's dtype on grad's device");
  if (grad.numel() == 0) return;
  c10::cuda::CUDAGuard guard(grad.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 256;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "scale_by_grad_output", [&] {
    constexpr int VEC = vec16<scalar_t>();
    const bool vector_ok = is_aligned16(grad.data_ptr());
    auto kernel = vector_ok ? scale_by_grad_output_kernel<scalar_t, VEC> : scale_by_grad_output_kernel<scalar_t, 1>;
    const int64_t grid = grid_for(kernel, vector_ok ? grad.numel() / VEC + 1 : grad.numel(), threads, grad.get_device());
    launch_kernel(kernel, grid, threads, 0, 1, stream, grad.data_ptr<scalar_t>(), grad.numel(),
                  grad_output.data_ptr<scalar_t>());
  });
}

}  // namespace fused_losses
