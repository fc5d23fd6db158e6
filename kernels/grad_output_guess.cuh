// grad_output_guess.cuh: the forward's guess at grad_output, and the backward that
// divides it out or recomputes. The whole protocol, in one place:
//
// Why: a scalar loss's forward writes its gradients as it reads the inputs, and backward
// then only scales them by grad_output. Where grad_output is known in advance (it repeats
// from step to step: (loss / 8).backward()) that pass goes too.
//   Writer: the forward kernel multiplies the gradients it writes by the guess
//     (grad_output_factor) and records the factor it used in the slot beside the 0-dim
//     loss (GradOutputGuess::applied in ops.h; entry_points.h's guess_slot).
//   Reader: backward (the eager C++ autograd node, autograd_node.h, or a Function) either
//     multiplies the saved gradients by grad_output / that factor, read on the GPU, no host
//     sync (scale_by_grad_output_launch), or, where the forward kept its operands,
//     recomputes them: the forward kernel again, with grad_output itself as the factor
//     (GradOutputGuess::exact), over the saved gradients. Either does no work at all when
//     the guess came true.
//   Source: the last grad_output this build's backward saw on the stream, which that
//     backward records (StreamState::grad_output in finish.cuh; 0, no guess, until then).
// Recompute: autocast's bfloat16 scalar losses (float_loss), whose float32 grad_output torch
// applies before the one rounding to bfloat16; scaling a rounded gradient would round twice.
// Their operands are held to backward for it (2 bytes an element of the logits).
// Off (the factor is 1, and backward scales by grad_output as it comes): no gradient;
// reduction 'none'; float16, whose range the guess could leave; a value that is not a
// power of two within 2^-24..1 (scaling by one commutes with every rounding, so the
// gradient's bits never depend on the guess, except where a factor below 1 takes a value
// under 2^-126 / factor to a subnormal: there a wrong guess costs it low bits unless
// backward recomputes; above 1 a wrong guess could overflow, so none is taken); a stream
// being captured into a CUDA graph (it may be replayed on another stream) or
// cudaStreamPerThread; and whenever Python does not ask for it. Python decides
// (loss_helpers.py): the forward ops' guess_grad_output is True on the eager path alone,
// whose backward is the C++ node; every autograd.Function (reduction 'none', torch.compile)
// passes False, and its backward takes grad_output as it comes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device.cuh"
#include "finish.cuh"
#include "launch.cuh"
#include "ops.h"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Forward: the guess.

// The factor a forward multiplies its gradients by (after wait_for_previous_kernel): a
// recompute's exact grad_output; else the guess at `source` where usable, else 1, which
// block 0's thread 0 records in `guess.applied`.
template <typename T>
__device__ __forceinline__ double grad_output_factor(const double* source, const GradOutputGuess& guess) {
  if (guess.exact.data != nullptr) return load_scalar(guess.exact);
  const double wanted = source != nullptr && !std::is_same<T, c10::Half>::value ? *source : 1.0;
  int exponent = 0;
  // 2^-24 .. 1: a factor above 1 could overflow a large gradient that grad_output would have kept finite
  const bool power_of_two = frexp(fabs(wanted), &exponent) == 0.5 && exponent >= -23 && exponent <= 1;  // NaN: no
  const double usable = power_of_two ? wanted : 1.0;
  if (guess.applied.data != nullptr && blockIdx.x == 0 && threadIdx.x == 0) store_scalar(guess.applied, usable);
  return usable;
}

// First thing in a loss kernel (after wait_for_previous_kernel): for a recompute, records
// grad_output as the stream's next guess (`source`) and tells whether the saved gradients
// carry it already, in which case every block returns without touching memory.
__device__ __forceinline__ bool recompute_is_needless(double* source, const GradOutputGuess& guess) {
  if (guess.exact.data == nullptr) return false;
  const double wanted = load_scalar(guess.exact);
  if (source != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *source = wanted;
  return wanted == (guess.applied.data != nullptr ? load_scalar(guess.applied) : 1.0);
}

// Where a forward that guesses (call.guess.applied set) reads its guess, and a recompute
// (call.guess.exact set) records the next one: nullptr for neither.
inline double* grad_output_guess_source(const GradOutputGuess& guess, const LaunchContext& context) {
  if (guess.applied.data == nullptr && guess.exact.data == nullptr) return nullptr;
  StreamState* state = stream_state(context.device, context.stream);
  return state != nullptr ? &state->grad_output : nullptr;
}

// ---------------------------------------------------------------------------------
// Backward: grad *= grad_output / applied in place, both read on the device; every block
// returns without touching memory when they are equal. grad_output becomes the stream's
// next guess (`guess`, nullptr: none kept).

template <typename T, int VEC>
__global__ void scale_by_grad_output_kernel(T* grad, int64_t n, ScalarOut grad_output, ScalarOut applied,
                                            double* guess) {
  using acc_t = acc_type<T>;
  wait_for_previous_kernel();
  const double wanted = load_scalar(grad_output);  // grad's dtype or its accumulation type: not rounded to T
  if (guess != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *guess = wanted;
  const double had = applied.data != nullptr ? load_scalar(applied) : 1.0;
  if (wanted == had) return;
  const acc_t scale = static_cast<acc_t>(wanted / had);
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

// Not inline: the bindings call it from another translation unit (ops.h); each build
// compiles this header once.
void scale_by_grad_output_launch(DType dtype, void* grad, int64_t n, ScalarOut grad_output, ScalarOut applied,
                                 const LaunchContext& context) {
  if (n == 0) return;
  StreamState* state = stream_state(context.device, context.stream);
  double* guess = state != nullptr ? &state->grad_output : nullptr;
  const int threads = 256;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int VEC = vec16<T>();
    const bool vector_ok = is_aligned16(grad);
    auto kernel = vector_ok ? scale_by_grad_output_kernel<T, VEC> : scale_by_grad_output_kernel<T, 1>;
    const int64_t grid = grid_for(kernel, vector_ok ? n / VEC + 1 : n, threads, context.device);
    launch_kernel(kernel, grid, threads, 0, 1, context.device, context.stream, static_cast<T*>(grad), n,
                  grad_output, applied, guess);
  });
}

}  // namespace fused_losses
