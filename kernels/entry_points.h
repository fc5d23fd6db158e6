// entry_points.h: every build's entry points, as Python calls them. Their parameter lists
// and return types are op_signatures.py's declarations, which loader.py writes as macros
// (FUSED_LOSSES_<KERNEL>_<OP>_PARAMS / _RETURNS) into the build's main.cpp and binds by name.
// The tensor side of each call: checks, contiguity, outputs and scratch memory, on the
// current stream of the inputs' device. Compiled by the host compiler in the build's
// main.cpp; the kernels (ops.h) get raw pointers. Every kernel has <kernel>_forward and
// <kernel>_backward; cross_entropy also the test-only cross_entropy_path and
// force_cross_entropy_path. The loss modules check everything first with friendlier messages;
// these checks guard direct calls of the ops.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "ops.h"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// Shared by every loss.

inline DType dtype_of(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, "expected float32, float64, float16 or bfloat16 tensors, got ", tensor.scalar_type());
  }
}

inline ScalarOut scalar_out(const at::Tensor& loss) { return {loss.data_ptr(), dtype_of(loss)}; }

// What the kernels accumulate in: float64 for float64, else float32.
inline at::ScalarType accumulation_type(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

inline void* data_or_null(const at::Tensor& tensor) { return tensor.defined() ? tensor.data_ptr() : nullptr; }

// One call's launch context: the current stream of `like`'s device (made current for the
// call's life), and scratch memory from torch's caching allocator on it, held until the
// call returns (kernels that read it are ordered before any later use on the stream).
class CallContext {
 public:
  explicit CallContext(const at::Tensor& like) : guard_(like.device()), options_(like.options().dtype(at::kByte)) {}

  LaunchContext launch() {
    return {static_cast<int>(options_.device().index()), c10::cuda::getCurrentCUDAStream().stream(),
            &CallContext::allocate, this};
  }

 private:
  static void* allocate(void* self, size_t bytes) {
    auto* call = static_cast<CallContext*>(self);
    TORCH_CHECK(call->used_ < kMaxBuffers, "fused_losses: internal error: more scratch buffers than a call holds");
    at::Tensor& buffer = call->buffers_[call->used_++];
    buffer = at::empty({static_cast<int64_t>(bytes)}, call->options_);
    return buffer.data_ptr();
  }

  static constexpr int kMaxBuffers = 2;
  c10::cuda::CUDAGuard guard_;
  at::TensorOptions options_;
  at::Tensor buffers_[kMaxBuffers];
  int used_ = 0;
};

// Runs a kernel call, raising its std::invalid_argument (a bad argument found on the
// kernels' side) as a ValueError and its other std::exceptions as RuntimeErrors, each raised
// by torch's check from the message alone: on one toolchain an exception carrying a string made
// here crashed the process on its way to Python (notes, v54). torch's own errors pass as they are.
template <typename Launch>
void run_kernels(Launch launch) {
  try {
    launch();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK_VALUE(false, error.what());
  } catch (const std::exception& error) {
    TORCH_CHECK(false, error.what());
  }
}

// Whether a forward guesses grad_output (grad_output_guess.cuh has the protocol): a scalar
// loss with a gradient whose caller asked for it (Python's guess_grad_output: the eager
// autograd node's path alone).
inline bool guesses_grad_output(int64_t reduction, bool want_grad, bool guess_grad_output) {
  return guess_grad_output && reduction != kNone && want_grad;
}

// The tensor the loss is written to. A scalar reduction's is 0-dim, in the input's dtype or
// in float32 when float_loss (what torch's autocast gives for these losses; Python asks
// for it there); reduction 'none' gives one value per element or row, `unreduced_shape`.
// With `guess`, the 0-dim loss is the first of two elements: the second records the guess
// at grad_output that the gradients were multiplied by (guess_slot).
inline at::Tensor loss_tensor(const at::Tensor& input, int64_t reduction, bool float_loss,
                              at::IntArrayRef unreduced_shape, bool guess = false) {
  if (reduction == kNone) {
    TORCH_CHECK(!float_loss, "float_loss is for scalar reductions");
    return at::empty(unreduced_shape, input.options());
  }
  const at::TensorOptions options = input.options().dtype(float_loss ? at::kFloat : input.scalar_type());
  return guess ? at::empty({2}, options).select(0, 0).detach() : at::empty({}, options);  // detach: not a view
}

// The guess's element beside a scalar loss from loss_tensor(..., guess=true), as a 0-dim
// tensor on the loss's memory; undefined for any other loss. Detached: an autograd view
// would hold the loss, whose node holds this (a cycle that would keep every step's graph).
inline at::Tensor guess_slot(const at::Tensor& loss) {
  if (loss.dim() != 0 || loss.storage().nbytes() < (loss.storage_offset() + 2) * loss.element_size()) return {};
  return loss.as_strided({}, {}, loss.storage_offset() + 1).detach();
}

inline GradOutputGuess grad_output_guess_in(const at::Tensor& loss) {
  const at::Tensor slot = guess_slot(loss);
  return {slot.defined() ? scalar_out(slot) : ScalarOut{}};
}

// A contiguous tensor of `like`'s shape and dtype whose data starts `offset` bytes past a
// 16-byte boundary (a multiple of the element size): a few elements more are allocated
// (the allocator's blocks start aligned) and viewed from there.
inline at::Tensor empty_at_offset(const at::Tensor& like, uintptr_t offset) {
  if (offset == 0) return at::empty(like.sizes(), like.options());
  const int64_t element = like.element_size();
  return at::empty({like.numel() + 16 / element}, like.options())
      .narrow(0, static_cast<int64_t>(offset) / element, like.numel())
      .view(like.sizes());
}

// `tensor` (contiguous) itself when it starts `offset` bytes past a 16-byte boundary,
// else a copy that does.
inline at::Tensor at_offset(const at::Tensor& tensor, uintptr_t offset) {
  if (offset_from_16_bytes(tensor.data_ptr()) == offset) return tensor;
  return empty_at_offset(tensor, offset).copy_(tensor);
}

// In place: grad *= grad_output / guess (0-dim tensors on grad's device, grad_output of
// grad's dtype, read on the GPU; no work when they are equal). `guess`: guess_slot of the
// forward's loss, or undefined for none (1).
inline void scale_by_grad_output_over_guess_(at::Tensor grad, const at::Tensor& grad_output,
                                             const at::Tensor& guess) {
  TORCH_CHECK(grad.is_cuda() && grad.is_contiguous(), "grad must be a contiguous CUDA tensor");
  TORCH_CHECK(grad_output.numel() == 1 && grad_output.device() == grad.device(),
              "grad_output must be one element on grad's device");
  if (grad.numel() == 0) return;
  // The kernel reads grad_output in grad's dtype or its accumulation type: as it comes where it is one
  // of them (autocast's float32 grad_output of a bfloat16 gradient is not rounded to bfloat16 first).
  const at::ScalarType acc = accumulation_type(grad.scalar_type());
  const bool as_it_comes = grad_output.scalar_type() == grad.scalar_type() || grad_output.scalar_type() == acc;
  const at::Tensor scale = as_it_comes ? grad_output : grad_output.to(acc);
  CallContext context(grad);
  scale_by_grad_output_launch(dtype_of(grad), grad.data_ptr(), grad.numel(), scalar_out(scale),
                              guess.defined() ? scalar_out(guess) : ScalarOut{}, context.launch());
}

// Backward's recompute (grad_output_guess.cuh): `grad_output` (one element on `like`'s
// device) is the factor, `applied` the one the saved gradients carry (the forward's guess_slot;
// None: 1).
inline GradOutputGuess recompute_guess(const at::Tensor& grad_output, const c10::optional<at::Tensor>& applied,
                                       const at::Tensor& like) {
  TORCH_CHECK(grad_output.numel() == 1 && grad_output.device() == like.device() &&
                  grad_output.is_floating_point(),
              "grad_output must be one floating-point element on input's device");
  GradOutputGuess guess;
  guess.exact = scalar_out(grad_output);
  if (applied.has_value() && applied->defined()) {
    TORCH_CHECK(applied->numel() == 1 && applied->device() == like.device(), "applied must be one element on "
                "input's device");
    guess.applied = scalar_out(*applied);
  }
  return guess;
}

// A saved gradient that a recompute writes into: none (no elements), or one of `like`'s shape
// and dtype, contiguous.
inline void* saved_gradient(const at::Tensor& grad, const at::Tensor& like, const char* name) {
  if (grad.numel() == 0) return nullptr;
  TORCH_CHECK(grad.sizes() == like.sizes() && grad.scalar_type() == like.scalar_type() &&
                  grad.device() == like.device() && grad.is_contiguous(),
              name, " must be the gradient the forward wrote: contiguous, of input's shape, dtype and device");
  return grad.data_ptr();
}

// The compiled graphs' backward (their forward makes no guess).
inline FUSED_LOSSES_SCALE_BY_GRAD_OUTPUT_RETURNS scale_by_grad_output_(FUSED_LOSSES_SCALE_BY_GRAD_OUTPUT_PARAMS) {
  scale_by_grad_output_over_guess_(grad, grad_output, at::Tensor());
}

// ---------------------------------------------------------------------------------
// Pointwise losses (mse, kl_div): `launch(call, context)` is the kernel's launcher.

// `other` (named `other_name` in messages) must match input in device, dtype and shape.
inline void check_matches_input(const at::Tensor& input, const char* other_name, const at::Tensor& other) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor");
  TORCH_CHECK(other.device() == input.device(), other_name, " must be on the same device as input");
  TORCH_CHECK(other.scalar_type() == input.scalar_type(), other_name, " must have the dtype of input");
  TORCH_CHECK(other.sizes() == input.sizes(), other_name, " must have the shape of input");
}

// Returns (loss, grad_input, grad_target); a gradient not asked for is undefined (None
// in Python). `scale` is the reduction's factor (1/n for 'mean'). For reduction 'none' no
// gradient is computed here (it needs grad_output): see pointwise_backward.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pointwise_forward(const at::Tensor& input_arg,
                                                                 const at::Tensor& target_arg, int64_t reduction,
                                                                 double scale, bool float_loss, bool want_grad_input,
                                                                 bool want_grad_target, bool guess_grad_output,
                                                                 Launch launch) {
  check_matches_input(input_arg, "target", target_arg);
  const bool scalar_loss = reduction != kNone;
  CallContext context(input_arg);
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const bool guess = guesses_grad_output(reduction, want_grad_input || want_grad_target, guess_grad_output);
  at::Tensor loss = loss_tensor(input, reduction, float_loss, input.sizes(), guess);
  at::Tensor grad_input = scalar_loss && want_grad_input ? at::empty_like(input) : at::Tensor();
  at::Tensor grad_target = scalar_loss && want_grad_target ? at::empty_like(input) : at::Tensor();
  PointwiseCall call{dtype_of(input), input.numel(), scale, input.data_ptr(), target.data_ptr(), nullptr,
                     scalar_loss ? nullptr : loss.data_ptr(), data_or_null(grad_input), data_or_null(grad_target),
                     scalar_loss ? scalar_out(loss) : ScalarOut{}, grad_output_guess_in(loss)};
  launch(call, context.launch());
  return {loss, grad_input, grad_target};
}

// Backward of reduction 'none': grad = d loss_i / d input_i * grad_output_i.
// Returns (grad_input, grad_target), undefined where not asked for.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> pointwise_backward(const at::Tensor& input_arg, const at::Tensor& target_arg,
                                                      const at::Tensor& grad_output_arg, bool want_grad_input,
                                                      bool want_grad_target, Launch launch) {
  check_matches_input(input_arg, "target", target_arg);
  check_matches_input(input_arg, "grad_output", grad_output_arg);
  CallContext context(input_arg);
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const at::Tensor grad_output = grad_output_arg.contiguous();
  at::Tensor grad_input = want_grad_input ? at::empty_like(input) : at::Tensor();
  at::Tensor grad_target = want_grad_target ? at::empty_like(input) : at::Tensor();
  PointwiseCall call{dtype_of(input), input.numel(), 1.0, input.data_ptr(), target.data_ptr(),
                     grad_output.data_ptr(), nullptr, data_or_null(grad_input), data_or_null(grad_target),
                     ScalarOut{}, GradOutputGuess{}};
  launch(call, context.launch());
  return {grad_input, grad_target};
}

// Backward's recompute of a scalar loss's gradients (recompute_guess) into the saved ones;
// `scale` is the forward's.
template <typename Launch>
void pointwise_recompute_gradients(const at::Tensor& input_arg, const at::Tensor& target_arg, double scale,
                                   const at::Tensor& grad_output, const c10::optional<at::Tensor>& applied,
                                   const at::Tensor& grad_input, const at::Tensor& grad_target, Launch launch) {
  check_matches_input(input_arg, "target", target_arg);
  CallContext context(input_arg);
  const at::Tensor input = input_arg.contiguous();
  const at::Tensor target = target_arg.contiguous();
  const at::Tensor loss = at::empty({}, input.options().dtype(accumulation_type(input.scalar_type())));  // unused
  PointwiseCall call{dtype_of(input), input.numel(), scale, input.data_ptr(), target.data_ptr(), nullptr, nullptr,
                     saved_gradient(grad_input, input, "grad_input"), saved_gradient(grad_target, input, "grad_target"),
                     scalar_out(loss), recompute_guess(grad_output, applied, input)};
  if (call.grad_input != nullptr || call.grad_target != nullptr) launch(call, context.launch());
}

// `scale` is the reduction's factor (1/n for 'mean'); float_loss: a scalar loss in
// float32. Gradients are written only for a scalar reduction and when asked for.
inline FUSED_LOSSES_MSE_FORWARD_RETURNS mse_forward(FUSED_LOSSES_MSE_FORWARD_PARAMS) {
  return pointwise_forward(input, target, reduction, scale, float_loss, want_grad_input, want_grad_target,
                           guess_grad_output, mse_launch);
}

inline FUSED_LOSSES_MSE_BACKWARD_RETURNS mse_backward(FUSED_LOSSES_MSE_BACKWARD_PARAMS) {
  return pointwise_backward(input, target, grad_output, want_grad_input, want_grad_target, mse_launch);
}

inline FUSED_LOSSES_MSE_RECOMPUTE_GRADIENTS__RETURNS mse_recompute_gradients_(
    FUSED_LOSSES_MSE_RECOMPUTE_GRADIENTS__PARAMS) {
  pointwise_recompute_gradients(input, target, scale, grad_output, applied, grad_input, grad_target, mse_launch);
}

// `scale`: 1/n for 'mean', 1/input.size(0) for 'batchmean'.
inline FUSED_LOSSES_KL_DIV_FORWARD_RETURNS kl_div_forward(FUSED_LOSSES_KL_DIV_FORWARD_PARAMS) {
  return pointwise_forward(input, target, reduction, scale, float_loss, want_grad_input, want_grad_target,
                           guess_grad_output,
                           [&](const PointwiseCall& call, const LaunchContext& context) {
                             kl_div_launch(call, log_input, log_target, context);
                           });
}

inline FUSED_LOSSES_KL_DIV_BACKWARD_RETURNS kl_div_backward(FUSED_LOSSES_KL_DIV_BACKWARD_PARAMS) {
  return pointwise_backward(input, target, grad_output, want_grad_input, want_grad_target,
                            [&](const PointwiseCall& call, const LaunchContext& context) {
                              kl_div_launch(call, log_input, log_target, context);
                            });
}

inline FUSED_LOSSES_KL_DIV_RECOMPUTE_GRADIENTS__RETURNS kl_div_recompute_gradients_(
    FUSED_LOSSES_KL_DIV_RECOMPUTE_GRADIENTS__PARAMS) {
  pointwise_recompute_gradients(input, target, scale, grad_output, applied, grad_input, grad_target,
                                [&](const PointwiseCall& call, const LaunchContext& context) {
                                  kl_div_launch(call, log_input, log_target, context);
                                });
}

// ---------------------------------------------------------------------------------
// Cross-entropy (cross_entropy.cu's header has the math).

// The tensors of one call, checked and made contiguous, as a CrossEntropyCall with no
// outputs yet.
struct CrossEntropyInputs {
  at::Tensor logits, target, weight;  // weight: in the accumulation type, or undefined
  CrossEntropyCall call{};

  CrossEntropyInputs(const at::Tensor& logits_arg, const at::Tensor& target_arg,
                     const c10::optional<at::Tensor>& weight_arg, int64_t ignore_index, double label_smoothing,
                     double z_loss, double temperature) {
    TORCH_CHECK(logits_arg.is_cuda() && logits_arg.dim() == 2, "cross_entropy: input must be 2-D (N, C) on CUDA");
    TORCH_CHECK(target_arg.device() == logits_arg.device(), "cross_entropy: target must be on input's device");
    const bool probs = target_arg.is_floating_point();
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
    TORCH_CHECK(temperature > 0.0, "cross_entropy: temperature must be > 0");
    logits = logits_arg.contiguous();
    target = target_arg.contiguous();
    // Probabilities are read in the same 16-byte packs as the logits (RowEdges): at the
    // logits' offset from 16 bytes, copied there in the rare case they are not.
    if (probs) target = at_offset(target, offset_from_16_bytes(logits.data_ptr()));
    if (weight_arg.has_value() && weight_arg->defined()) {
      TORCH_CHECK(weight_arg->dim() == 1 && weight_arg->size(0) == logits.size(1) &&
                      weight_arg->device() == logits.device(),
                  "cross_entropy: weight must have shape (C,) on input's device");
      weight = weight_arg->to(accumulation_type(logits.scalar_type())).contiguous();
    }
    call.dtype = dtype_of(logits);
    call.rows = logits.size(0);
    call.classes = logits.size(1);
    call.logits = logits.data_ptr();
    call.target = target.data_ptr();
    call.probs = probs;
    call.target_int32 = target.scalar_type() == at::kInt;
    call.weight = data_or_null(weight);
    call.ignore_index = ignore_index;
    call.label_smoothing = label_smoothing;
    call.z_loss = z_loss;
    call.temperature = temperature;
  }

  // A fresh tensor of the logits' shape and dtype that rows are written to (a gradient):
  // at their offset from 16 bytes, so that both are read and written in the same packs.
  at::Tensor empty_row_tensor() const { return empty_at_offset(logits, offset_from_16_bytes(logits.data_ptr())); }

  // The lse is kept in the accumulation type (float, or double for float64).
  at::Tensor empty_lse() const {
    return at::empty({logits.size(0)}, logits.options().dtype(accumulation_type(logits.scalar_type())));
  }
};

// Forward. Returns (loss, grad_logits, grad_target, lse):
//   loss: 0-dim for a scalar reduction (float32 when float_loss, else logits' dtype),
//     (N,) for 'none';
//   grad_logits / grad_target: written for a scalar reduction when asked for (for 'none'
//     see cross_entropy_backward); grad_logits is `logits` itself when inplace;
//   lse: (N,) in the accumulation type when want_lse.
// Whatever is not written is undefined (None in Python).

// The forward's tensors, checked and allocated, handed to use(call, launch context): the
// launch, or the path query. Returns (loss, grad_logits, grad_target, lse).
template <typename Use>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_cross_entropy_forward(
    FUSED_LOSSES_CROSS_ENTROPY_FORWARD_PARAMS, Use use) {
  TORCH_CHECK(!inplace || (logits.is_contiguous() && reduction != kNone && want_grad_logits),
              "cross_entropy: inplace needs contiguous logits, a scalar reduction and their gradient");
  CallContext context(logits);
  CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss, temperature);
  TORCH_CHECK(!want_grad_target || in.call.probs, "cross_entropy: only probability targets have a gradient");
  const bool scalar_loss = reduction != kNone;
  at::Tensor loss = loss_tensor(in.logits, reduction, float_loss, {in.call.rows},
                                guesses_grad_output(reduction, want_grad_logits || want_grad_target, guess_grad_output));
  at::Tensor lse = want_lse ? in.empty_lse() : at::Tensor();
  at::Tensor grad_logits, grad_target;
  if (scalar_loss && want_grad_logits) grad_logits = inplace ? in.logits : in.empty_row_tensor();
  if (scalar_loss && want_grad_target) grad_target = in.empty_row_tensor();
  in.call.reduction = reduction;
  in.call.loss = scalar_loss ? scalar_out(loss) : ScalarOut{};
  in.call.loss_per_row = scalar_loss ? nullptr : loss.data_ptr();
  in.call.lse = data_or_null(lse);
  in.call.grad_logits = data_or_null(grad_logits);
  in.call.grad_target = data_or_null(grad_target);
  in.call.guess = grad_output_guess_in(loss);
  run_kernels([&] { use(in.call, context.launch()); });
  return {loss, grad_logits, grad_target, lse};
}

inline FUSED_LOSSES_CROSS_ENTROPY_FORWARD_RETURNS cross_entropy_forward(FUSED_LOSSES_CROSS_ENTROPY_FORWARD_PARAMS) {
  return with_cross_entropy_forward(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing,
                                    z_loss, temperature, want_grad_logits, want_grad_target, want_lse, inplace,
                                    guess_grad_output, cross_entropy_launch);
}

// Backward of reduction 'none': grad_output has shape (N,). Returns (grad_logits,
// grad_target), undefined where not asked for.
inline FUSED_LOSSES_CROSS_ENTROPY_BACKWARD_RETURNS cross_entropy_backward(FUSED_LOSSES_CROSS_ENTROPY_BACKWARD_PARAMS) {
  CallContext context(logits);
  CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss, temperature);
  TORCH_CHECK(grad_output.numel() == in.call.rows && grad_output.scalar_type() == in.logits.scalar_type() &&
                  grad_output.device() == in.logits.device(),
              "cross_entropy: grad_output must have N elements of input's dtype on input's device");
  TORCH_CHECK(!want_grad_target || in.call.probs, "cross_entropy: only probability targets have a gradient");
  const at::Tensor grad_output_rows = grad_output.contiguous();
  at::Tensor grad_logits = want_grad_logits ? in.empty_row_tensor() : at::Tensor();
  at::Tensor grad_target = want_grad_target ? in.empty_row_tensor() : at::Tensor();
  in.call.reduction = kNone;
  in.call.grad_output = grad_output_rows.data_ptr();
  in.call.grad_logits = data_or_null(grad_logits);
  in.call.grad_target = data_or_null(grad_target);
  if (want_grad_logits || want_grad_target) run_kernels([&] { cross_entropy_launch(in.call, context.launch()); });
  return {grad_logits, grad_target};
}

// Backward's recompute of a scalar reduction's gradients (recompute_guess) into the saved
// grad_logits and grad_target (no elements: not wanted), from the forward's operands.
inline FUSED_LOSSES_CROSS_ENTROPY_RECOMPUTE_GRADIENTS__RETURNS cross_entropy_recompute_gradients_(
    FUSED_LOSSES_CROSS_ENTROPY_RECOMPUTE_GRADIENTS__PARAMS) {
  TORCH_CHECK(reduction != kNone, "cross_entropy: a recompute is for a scalar reduction");
  CallContext context(logits);
  CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss, temperature);
  TORCH_CHECK(grad_target.numel() == 0 || in.call.probs, "cross_entropy: only probability targets have a gradient");
  const at::Tensor loss = at::empty({}, in.logits.options().dtype(accumulation_type(in.logits.scalar_type())));
  in.call.reduction = reduction;
  in.call.loss = scalar_out(loss);  // written, unused
  in.call.grad_logits = saved_gradient(grad_logits, in.logits, "grad_logits");
  in.call.grad_target = saved_gradient(grad_target, in.logits, "grad_target");
  // Row tensors share the logits' offset from 16 bytes (CrossEntropyCall): the forward's do.
  for (const at::Tensor* grad : {&grad_logits, &grad_target}) {
    TORCH_CHECK(grad->numel() == 0 || offset_from_16_bytes(grad->data_ptr()) == offset_from_16_bytes(in.call.logits),
                "cross_entropy: a recompute needs the logits the forward read (their offset from 16 bytes)");
  }
  in.call.guess = recompute_guess(grad_output, applied, in.logits);
  if (in.call.grad_logits != nullptr || in.call.grad_target != nullptr) {
    run_kernels([&] { cross_entropy_launch(in.call, context.launch()); });
  }
}

// The path (CrossEntropyPath, by name) that cross_entropy_forward with these arguments
// takes on the tensors' device; launches nothing. For the tests.
inline std::string cross_entropy_path(FUSED_LOSSES_CROSS_ENTROPY_FORWARD_PARAMS) {
  std::string name;
  with_cross_entropy_forward(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing, z_loss,
                             temperature, want_grad_logits, want_grad_target, want_lse, inplace, guess_grad_output,
                             [&](const CrossEntropyCall& call, const LaunchContext& context) {
                               name = cross_entropy_call_path(call, context);
                             });
  return name;
}

// Test-only: every call takes the path named `path` (cross_entropy_path's names), or
// raises where that path cannot run it; "" gives the choice back.
inline void force_cross_entropy_path(const std::string& path) {
  run_kernels([&] { set_forced_cross_entropy_path(path.c_str()); });
}

// ---------------------------------------------------------------------------------
// The row passes: cross-entropy a chunk of classes at a time (row_passes.cu).

// A chunk's call: (rows, width) logits, contiguous, classes [class_start, class_start +
// width) of `classes`; (rows,) class indices; per-row tensors (rows,) or (k, rows) in the
// accumulation type.
inline LogitChunkCall logit_chunk_call(const at::Tensor& logits, const at::Tensor& target, int64_t class_start,
                                       int64_t classes, double softcap, double temperature) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "row_passes: logits must be a contiguous (rows, width) CUDA tensor");
  TORCH_CHECK(target.device() == logits.device() && target.dim() == 1 && target.size(0) == logits.size(0) &&
                  target.is_contiguous() && (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
              "row_passes: target must be (rows,) contiguous int64 or int32 on the logits' device");
  TORCH_CHECK(class_start >= 0 && class_start + logits.size(1) <= classes,
              "row_passes: the chunk's classes must lie in [0, classes)");
  LogitChunkCall call{};
  call.dtype = dtype_of(logits);
  call.rows = logits.size(0);
  call.width = logits.size(1);
  call.class_start = class_start;
  call.classes = classes;
  call.logits = logits.data_ptr();
  call.target = target.data_ptr();
  call.target_int32 = target.scalar_type() == at::kInt;
  call.softcap = softcap;
  TORCH_CHECK(temperature > 0, "row_passes: temperature must be > 0");
  call.temperature = temperature;
  return call;
}

// message: a literal (a message formatted in the extension crashed the process on one toolchain instead of
// raising: notes, v54).
inline void check_row_tensor(const at::Tensor& tensor, const at::Tensor& logits, int64_t leading,
                             const char* message) {
  const auto acc = accumulation_type(logits.scalar_type());
  TORCH_CHECK(tensor.device() == logits.device() && tensor.scalar_type() == acc && tensor.is_contiguous() &&
                  tensor.numel() == leading * logits.size(0),
              message);
}

// Forward: folds the chunk into stats (5, rows): running max, sum of exp, target logit, logit
// sum, sum of exp over the other classes; (6, rows): also the entropy's sum exp(u - m) (u - m).
inline FUSED_LOSSES_ROW_PASSES_FORWARD_RETURNS row_passes_forward(FUSED_LOSSES_ROW_PASSES_FORWARD_PARAMS) {
  CallContext context(logits);
  LogitChunkCall call = logit_chunk_call(logits, target, class_start, classes, softcap, temperature);
  call.entropy = stats.dim() == 2 && stats.size(0) == 6;
  check_row_tensor(stats, logits, call.entropy ? 6 : 5,
                   "row_passes: stats must be (5 or 6, rows), contiguous, of the accumulation type, on the logits' "
                   "device");
  call.stats = stats.data_ptr();
  run_kernels([&] { logit_chunk_stats_launch(call, context.launch()); });
}

// Backward: writes the chunk's gradient into `grad` (logits' shape and dtype; it may be
// `logits`), given each row's softmax_stats (3, rows: max, log sum exp, the target's p - 1)
// and scale. class_count: one value of the accumulation type, the number of classes where only
// the device knows it (vocabulary-parallel), or None: `classes`. entropy_scale (rows) or None:
// each row's factor on its entropy's gradient, added (softmax_stats then has a fourth row).
inline FUSED_LOSSES_ROW_PASSES_BACKWARD_RETURNS row_passes_backward(FUSED_LOSSES_ROW_PASSES_BACKWARD_PARAMS) {
  CallContext context(logits);
  LogitChunkCall call = logit_chunk_call(logits, target, class_start, classes, softcap, temperature);
  if (entropy_scale.has_value() && entropy_scale->defined()) {
    check_row_tensor(*entropy_scale, logits, 1,
                     "row_passes: entropy_scale must be (rows,), contiguous, of the accumulation type, on the "
                     "logits' device");
    call.entropy = true;
    call.entropy_scale = entropy_scale->data_ptr();
  }
  TORCH_CHECK(grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type() &&
                  grad.device() == logits.device() && grad.is_contiguous(),
              "row_passes: grad must be contiguous, of the logits' shape, dtype and device");
  check_row_tensor(softmax_stats, logits, call.entropy ? 4 : 3,
                   "row_passes: softmax_stats must be (3, rows), or (4, rows) with entropy_scale, contiguous, of the "
                   "accumulation type, on the logits' device");
  check_row_tensor(row_scale, logits, 1,
                   "row_passes: row_scale must be (rows,), contiguous, of the accumulation type, on the logits' "
                   "device");
  if (class_count.has_value() && class_count->defined()) {
    TORCH_CHECK(class_count->numel() == 1 && class_count->scalar_type() == softmax_stats.scalar_type() &&
                    class_count->device() == logits.device(),
                "row_passes: class_count must be one value of lse's dtype on the logits' device");
    call.class_count = class_count->data_ptr();
  }
  call.grad = grad.data_ptr();
  call.softmax_stats = softmax_stats.data_ptr();
  call.row_scale = row_scale.data_ptr();
  call.label_smoothing = label_smoothing;
  call.z_loss = z_loss;
  run_kernels([&] { logit_chunk_gradient_launch(call, context.launch()); });
}

// ---------------------------------------------------------------------------------
// linear_ce_gemm (sm_90a only). Checks with literal messages (a formatted one crashed one
// toolchain's process instead of raising: notes, v54).
inline GemmCall gemm_call(const at::Tensor& a, const at::Tensor& b, int64_t max_blocks) {
  TORCH_CHECK(a.is_cuda() && a.dim() == 2 && b.dim() == 2 && b.device() == a.device() && a.size(1) == b.size(1),
              "linear_ce_gemm: a (m, k) and b (n, k) must be 2-D CUDA tensors on one device with the same k");
  TORCH_CHECK_VALUE((a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf) &&
                        b.scalar_type() == a.scalar_type(),
                    "linear_ce_gemm: a and b must be both bfloat16 or both float16");
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  // A single row's stride is never stepped: any value a 16 B-aligned copy accepts will do.
  const int64_t lda = m == 1 ? k : a.stride(0), ldb = n == 1 ? k : b.stride(0);
  TORCH_CHECK_VALUE((k == 0 || a.stride(1) == 1 || m == 0) && (k == 0 || b.stride(1) == 1 || n == 0),
                    "linear_ce_gemm: a and b must be contiguous along k");
  TORCH_CHECK_VALUE(k == 0 || m == 0 || n == 0 ||
                        (k % 8 == 0 && lda % 8 == 0 && ldb % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(b.data_ptr()) % 16 == 0),
                    "linear_ce_gemm: k and the row strides must be multiples of 8 and a, b 16 B-aligned (the copy "
                    "engine moves 16 B-aligned rows)");
  GemmCall call{};
  call.dtype = dtype_of(a);
  call.m = m;
  call.n = n;
  call.k = k;
  call.a = a.data_ptr();
  call.lda = lda;
  call.b = b.data_ptr();
  call.ldb = ldb;
  call.max_blocks = max_blocks;
  return call;
}

// a @ b.T for 2-byte a (m, k) and b (n, k) with K contiguous (row strides may exceed k), into
// `out` ((m, n), columns contiguous, rows at any stride; returned) or else a new contiguous (m, n)
// tensor. max_blocks > 0 caps the persistent grid (tests); 0: one block a multiprocessor.
inline FUSED_LOSSES_LINEAR_CE_GEMM_GEMM_NT_RETURNS linear_ce_gemm_gemm_nt(FUSED_LOSSES_LINEAR_CE_GEMM_GEMM_NT_PARAMS) {
  GemmCall call = gemm_call(a, b, max_blocks);
  at::Tensor c;
  if (out.has_value() && out->defined()) {
    c = *out;
    TORCH_CHECK_VALUE(c.dim() == 2 && c.size(0) == call.m && c.size(1) == call.n &&
                          c.scalar_type() == a.scalar_type() && c.device() == a.device() &&
                          (c.stride(1) == 1 || call.n <= 1) && (c.stride(0) >= call.n || call.m <= 1),
                      "gemm_nt: out must be (m, n) of a's dtype and device, contiguous along n");
  } else {
    c = at::empty({call.m, call.n}, a.options());
  }
  if (call.m == 0 || call.n == 0) return c;
  if (call.k == 0) return c.zero_();
  CallContext context(a);
  call.c = c.data_ptr();
  call.ldc = call.m == 1 ? call.n : c.stride(0);
  run_kernels([&] { gemm_nt_launch(call, context.launch()); });
  return c;
}

// The fused product's statistics (gemm_sm90.cuh's GemmRowStats): for the logits a @ b.T (+ bias)
// at softcap and temperature, each row's statistics over each tile of 192 classes (ops.h's
// kGemmRowStatsTileColumns), (tiles, stat_rows, m) float32, stat_rows 5 or 6 (row_passes' rows;
// the tiles combined by the caller). target (m,) int64 or int32 class indices
// (others, e.g. -100, match no class); bias (n,) of a's dtype or None.
// row_stats' arguments checked, its partials allocated (row_stats and row_stats_training share them).
inline GemmRowStats row_stats_arguments(const GemmCall& call, const at::Tensor& a, const c10::optional<at::Tensor>& bias,
                                        const at::Tensor& target, double softcap, double temperature,
                                        int64_t stat_rows, at::Tensor& partials) {
  TORCH_CHECK_VALUE(call.k > 0, "gemm_row_stats: k must be > 0");
  TORCH_CHECK_VALUE(stat_rows == 5 || stat_rows == 6, "gemm_row_stats: stat_rows must be 5 or 6");
  TORCH_CHECK_VALUE(target.device() == a.device() && target.dim() == 1 && target.size(0) == call.m &&
                        target.is_contiguous() && (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
                    "gemm_row_stats: target must be (m,) contiguous int64 or int32 on a's device");
  GemmRowStats stats{};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->device() == a.device() && bias->dim() == 1 && bias->size(0) == call.n &&
                          bias->is_contiguous() && bias->scalar_type() == a.scalar_type(),
                      "gemm_row_stats: bias must be (n,) contiguous of a's dtype on a's device");
    stats.bias = bias->data_ptr();
  }
  TORCH_CHECK_VALUE(temperature > 0 && softcap >= 0, "gemm_row_stats: temperature must be > 0 and softcap >= 0");
  const int64_t tiles_n = (call.n + kGemmRowStatsTileColumns - 1) / kGemmRowStatsTileColumns;
  partials = at::empty({tiles_n, stat_rows, call.m}, a.options().dtype(at::kFloat));
  stats.partials = partials.data_ptr<float>();
  stats.target = target.data_ptr();
  stats.target_int32 = target.scalar_type() == at::kInt;
  stats.softcap = static_cast<float>(softcap);
  stats.softcap_inverse = softcap > 0 ? static_cast<float>(1 / static_cast<double>(stats.softcap)) : 0.f;
  stats.inverse_temperature = static_cast<float>(1 / temperature);
  stats.stat_rows = static_cast<int>(stat_rows);
  return stats;
}

// The fused product's statistics (gemm_sm90.cuh's GemmRowStats): for the logits a @ b.T (+ bias)
// at softcap and temperature, each row's statistics over each tile of 192 classes (ops.h's
// kGemmRowStatsTileColumns), (tiles, stat_rows, m) float32, stat_rows 5 or 6 (row_passes' rows;
// the tiles combined by the caller). target (m,) int64 or int32 class indices
// (others, e.g. -100, match no class); bias (n,) of a's dtype or None.
inline FUSED_LOSSES_LINEAR_CE_GEMM_ROW_STATS_RETURNS linear_ce_gemm_row_stats(FUSED_LOSSES_LINEAR_CE_GEMM_ROW_STATS_PARAMS) {
  GemmCall call = gemm_call(a, b, max_blocks);
  at::Tensor partials;
  GemmRowStats stats = row_stats_arguments(call, a, bias, target, softcap, temperature, stat_rows, partials);
  if (call.m == 0 || call.n == 0) return partials;
  CallContext context(a);
  run_kernels([&] { gemm_row_stats_launch(call, stats, context.launch()); });
  return partials;
}

// row_stats (stat_rows 5 or 6) and the training form d input's product reads (gemm_grad_input): e (m, n) bfloat16,
// rows 16 B-aligned (its row stride a multiple of 8), E = 2^(u log2 e - k) dz'/dz, 0 at the target; piece_max
// (ceil(n / 64), m) float32, each 64 classes' k.
inline FUSED_LOSSES_LINEAR_CE_GEMM_ROW_STATS_TRAINING_RETURNS linear_ce_gemm_row_stats_training(
    FUSED_LOSSES_LINEAR_CE_GEMM_ROW_STATS_TRAINING_PARAMS) {
  GemmCall call = gemm_call(a, b, max_blocks);
  TORCH_CHECK_VALUE(a.scalar_type() == at::kBFloat16, "gemm_row_stats_training: a and b must be bfloat16");
  at::Tensor partials;
  GemmRowStats stats = row_stats_arguments(call, a, bias, target, softcap, temperature, stat_rows, partials);
  TORCH_CHECK_VALUE(e.device() == a.device() && e.dim() == 2 && e.size(0) == call.m && e.size(1) == call.n &&
                        e.scalar_type() == a.scalar_type() && (e.stride(1) == 1 || call.n <= 1) &&
                        (e.stride(0) % 8 == 0 || call.m <= 1) && reinterpret_cast<uintptr_t>(e.data_ptr()) % 16 == 0,
                    "gemm_row_stats_training: e must be (m, n) bfloat16 on a's device, n contiguous, rows 16 B-aligned");
  TORCH_CHECK_VALUE(piece_max.device() == a.device() && piece_max.scalar_type() == at::kFloat &&
                        piece_max.dim() == 2 && piece_max.size(0) == (call.n + 63) / 64 &&
                        piece_max.size(1) == call.m && piece_max.is_contiguous(),
                    "gemm_row_stats_training: piece_max must be a contiguous (ceil(n / 64), m) float32 tensor");
  if (call.m == 0 || call.n == 0) return partials;
  stats.e = e.data_ptr();
  stats.ld_e = call.m == 1 ? call.n : e.stride(0);
  stats.piece_max = piece_max.data_ptr<float>();
  CallContext context(a);
  run_kernels([&] { gemm_row_stats_launch(call, stats, context.launch()); });
  return partials;
}

// d input (m, n) = g w for the logits' gradient g that row_stats_training's e, piece_max and the combined stats
// ((5, m)) give, for a grad_output of 1 and row_scale (m,), without label
// smoothing or the entropy's term (gemm_sm90_grad_input.cuh), into out ((m, n) bfloat16, n contiguous).
// w: (classes, n) bfloat16, n contiguous, rows 16 B-aligned; e holds classes [first_class, first_class + its
// columns). A vocabulary in parts, a call a part in order: carry ((m, n) float32) holds the sum between the
// calls, previous_stats the stats before this part (None for the first), finish the last (it writes out).
inline FUSED_LOSSES_LINEAR_CE_GEMM_GRAD_INPUT_RETURNS linear_ce_gemm_grad_input(
    FUSED_LOSSES_LINEAR_CE_GEMM_GRAD_INPUT_PARAMS) {
  TORCH_CHECK(e.is_cuda() && e.dim() == 2 && w.dim() == 2 && w.device() == e.device(),
              "gemm_grad_input: e (m, part) and w (classes, n) must be 2-D CUDA tensors on one device");
  TORCH_CHECK_VALUE(first_class >= 0 && first_class + e.size(1) <= w.size(0),
                    "gemm_grad_input: classes [first_class, first_class + e.size(1)) must be rows of w");
  TORCH_CHECK_VALUE(e.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                        out.scalar_type() == at::kBFloat16,
                    "gemm_grad_input: e, w and out must be bfloat16");
  const int64_t m = e.size(0), k = e.size(1), n = w.size(1);
  TORCH_CHECK_VALUE((e.stride(1) == 1 || k <= 1) && (e.stride(0) % 8 == 0 || m <= 1) &&
                        (w.stride(1) == 1 || n <= 1) && (w.stride(0) % 8 == 0 || w.size(0) <= 1) && n % 8 == 0 &&
                        reinterpret_cast<uintptr_t>(e.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
                    "gemm_grad_input: e and w must be contiguous along their rows, rows 16 B-aligned, n % 8 == 0");
  TORCH_CHECK_VALUE(out.device() == e.device() && out.dim() == 2 && out.size(0) == m && out.size(1) == n &&
                        (out.stride(1) == 1 || n <= 1) && out.stride(0) % 2 == 0,
                    "gemm_grad_input: out must be (m, n) on e's device, n contiguous, an even row stride");
  auto rows_of = [&](const at::Tensor& t, int64_t rows, int64_t columns) {
    return t.device() == e.device() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
           t.size(0) == rows && t.size(1) == columns;
  };
  TORCH_CHECK_VALUE(rows_of(piece_max, (k + 63) / 64, m) && rows_of(stats, 5, m),
                    "gemm_grad_input: piece_max (ceil(classes / 64), m) and stats (5, m) must be contiguous float32 "
                    "tensors on e's device");
  TORCH_CHECK_VALUE(row_scale.device() == e.device() && row_scale.scalar_type() == at::kFloat &&
                        row_scale.dim() == 1 && row_scale.size(0) == m && row_scale.is_contiguous() &&
                        target.device() == e.device() && target.dim() == 1 && target.size(0) == m &&
                        target.is_contiguous() &&
                        (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
                    "gemm_grad_input: row_scale (m,) float32 and target (m,) int64 or int32 must be contiguous on "
                    "e's device");
  TORCH_CHECK_VALUE(temperature > 0 && softcap >= 0, "gemm_grad_input: temperature must be > 0 and softcap >= 0");
  const bool carried = carry.has_value() && carry->defined();
  const bool continued = previous_stats.has_value() && previous_stats->defined();
  TORCH_CHECK_VALUE(!carried || rows_of(*carry, m, n), "gemm_grad_input: carry must be a contiguous (m, n) float32 "
                    "tensor on e's device");
  TORCH_CHECK_VALUE(!continued || rows_of(*previous_stats, 5, m), "gemm_grad_input: previous_stats must be a "
                    "contiguous (5, m) float32 tensor on e's device");
  TORCH_CHECK_VALUE(carried || (finish && !continued), "gemm_grad_input: a part that continues a sum (previous_stats) "
                    "or leaves one (finish false) needs carry");
  TORCH_CHECK_VALUE(k > 0 || !carried, "gemm_grad_input: a part of a vocabulary in parts must hold classes");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    out.zero_();
    return;
  }
  CallContext context(e);
  GemmGradInput call{};
  call.dtype = dtype_of(e);
  call.m = m;
  call.n = n;
  call.k = k;
  call.e = e.data_ptr();
  call.ld_e = m == 1 ? k : e.stride(0);
  call.w = w.data_ptr();
  call.ld_w = w.size(0) == 1 ? n : w.stride(0);
  call.first_class = first_class;
  call.classes = w.size(0);
  call.previous_stats = continued ? previous_stats->data_ptr<float>() : nullptr;
  call.finish = finish;
  call.partial = carried ? carry->data_ptr<float>() : nullptr;
  call.piece_max = piece_max.data_ptr<float>();
  call.stats = stats.data_ptr<float>();
  call.row_scale = row_scale.data_ptr<float>();
  call.target = target.data_ptr();
  call.target_int32 = target.scalar_type() == at::kInt;
  call.z_loss = static_cast<float>(z_loss);
  call.inverse_temperature = static_cast<float>(1 / temperature);
  call.softcap = static_cast<float>(softcap);
  call.softcap_inverse = softcap > 0 ? static_cast<float>(1 / static_cast<double>(call.softcap)) : 0.f;
  call.out = out.data_ptr();
  call.ld_out = m == 1 ? n : out.stride(0);
  call.max_blocks = max_blocks;
  run_kernels([&] { gemm_grad_input_launch(call, context.launch()); });
}

// row_stats' partials (tiles, stat_rows, rows) float32 combined into the rows' statistics (stat_rows,
// rows), as row_passes.combine_tiles does in torch ops, in one pass.
inline FUSED_LOSSES_LINEAR_CE_GEMM_COMBINE_ROW_STATS_RETURNS linear_ce_gemm_combine_row_stats(
    FUSED_LOSSES_LINEAR_CE_GEMM_COMBINE_ROW_STATS_PARAMS) {
  TORCH_CHECK_VALUE(partials.is_cuda() && partials.dim() == 3 && partials.scalar_type() == at::kFloat &&
                        partials.is_contiguous() && partials.size(0) > 0 &&
                        (partials.size(1) == 5 || partials.size(1) == 6),
                    "combine_row_stats: partials must be a contiguous (tiles > 0, 5 or 6, rows) float32 CUDA tensor");
  const int64_t tiles = partials.size(0), stat_rows = partials.size(1), rows = partials.size(2);
  at::Tensor stats = at::empty({stat_rows, rows}, partials.options());
  CallContext context(partials);
  run_kernels([&] {
    combine_row_stats_launch(partials.data_ptr<float>(), stats.data_ptr<float>(), tiles, static_cast<int>(stat_rows),
                             rows, context.launch());
  });
  return stats;
}

}  // namespace fused_losses
