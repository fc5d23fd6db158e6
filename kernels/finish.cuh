// finish.cuh: the end of every scalar reduction: the finish that adds the blocks' partials
// in a fixed order, and the per-stream state (the finish's ticket, the guess's source).
//
// Scalar reductions are deterministic to the bit: every block writes one partial sum,
// then the kernel's last block adds the partials in a fixed order (see Finish). The grid
// size depends only on the problem size and the GPU, so the same inputs give the same
// bits run after run.
#pragma once

#include <cstdint>
#include <utility>

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
  ScalarOut loss;  // 0-dim
  unsigned int* ticket = nullptr;  // the loss kernel's finished blocks; nullptr: finish_sum_kernel
};

template <typename out_t>
__device__ __forceinline__ void store_as(void* out, double value) {
  *static_cast<out_t*>(out) = static_cast<out_t>(value);
}

__device__ __forceinline__ void store_scalar(ScalarOut out, double value) {
  switch (out.dtype) {
    case DType::kFloat64: store_as<double>(out.data, value); break;
    case DType::kFloat16: store_as<c10::Half>(out.data, value); break;
    case DType::kBFloat16: store_as<c10::BFloat16>(out.data, value); break;
    case DType::kFloat32: store_as<float>(out.data, value); break;
  }
}

__device__ __forceinline__ double load_scalar(ScalarOut in) {
  switch (in.dtype) {
    case DType::kFloat64: return *static_cast<const double*>(in.data);
    case DType::kFloat16: return static_cast<float>(*static_cast<const c10::Half*>(in.data));
    case DType::kBFloat16: return static_cast<float>(*static_cast<const c10::BFloat16*>(in.data));
    default: return *static_cast<const float*>(in.data);
  }
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
  store_scalar(finish.loss, result * finish.scale);
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

// What a build keeps per stream on the device. One per stream and device, since launches
// on one stream never overlap and on two they may; zeroed once:
//   ticket: a counter of the launch's finished blocks, that each launch's last block sets
//     back to 0;
//   grad_output: the next forward's guess at grad_output (grad_output_guess.cuh).
// Kept for the life of the process (16 bytes per stream: torch's streams come from a fixed
// pool). From cudaMalloc, not torch's allocator: memory kept for good must not sit in a
// CUDA graph's pool (torch.compile's reduce-overhead mode allocates from one while it warms up).
// nullptr while the stream is being captured into a CUDA graph: a graph may be replayed
// on another stream, beside launches on this one. nullptr for cudaStreamPerThread too:
// one handle that names another stream in each host thread.
struct StreamState {
  unsigned int ticket;
  double grad_output;
};

inline StreamState* stream_state(int device, cudaStream_t stream) {
  if (stream == cudaStreamPerThread || is_capturing(stream)) return nullptr;
  static Remembered<std::pair<int, cudaStream_t>, StreamState*> states;
  return states.get({device, stream}, [&] {
    void* state = nullptr;
    cuda_check(cudaMalloc(&state, sizeof(StreamState)), "cudaMalloc of the stream's state");
    // Zeroed on `stream`, so the first launch there sees 0.
    cuda_check(cudaMemsetAsync(state, 0, sizeof(StreamState), stream), "cudaMemsetAsync of the stream's state");
    return static_cast<StreamState*>(state);
  });
}

inline unsigned int* finish_ticket(int device, cudaStream_t stream) {
  StreamState* state = stream_state(device, stream);
  return state != nullptr ? &state->ticket : nullptr;
}

// What a loss kernel launched on the context's stream needs to finish the scalar `loss` itself.
inline Finish make_finish(sum_t* partials, int num_terms, int64_t num_partials, double scale,
                          const sum_t* divisors, int64_t num_divisors, ScalarOut loss, const LaunchContext& context) {
  check(num_terms >= 1 && num_terms <= kMaxTerms, "make_finish: internal error: a number of terms out of range");
  Finish finish;
  finish.partials = partials;
  finish.num_partials = num_partials;
  finish.num_terms = num_terms;
  finish.scale = scale;
  finish.divisors = divisors;
  finish.num_divisors = num_divisors;
  finish.loss = loss;
  finish.ticket = finish_ticket(context.device, context.stream);
  return finish;
}

// After the loss kernel: the finish it could not do itself (no ticket), in a launch of its own.
inline void finish_without_ticket(const Finish& finish, const LaunchContext& context) {
  if (finish.partials == nullptr || finish.ticket != nullptr) return;
  launch_kernel(finish_sum_kernel, 1, kFinishThreads, 0, 1, context.device, context.stream, finish);
}

}  // namespace fused_losses
