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

#include <c10/cuda/CUDAGuard.h>

#include <string>
#include <tuple>

#include "cross_entropy_launch.cuh"
#include "finish.cuh"
#include "launch.cuh"

namespace fused_losses {

// Forward. Returns (loss, grad_logits, grad_target, lse):
//   loss: 0-dim for a scalar reduction (float32 when float_loss, else logits' dtype),
//     (N,) for 'none';
//   grad_logits / grad_target: written for a scalar reduction when asked for (for 'none'
//     see cross_entropy_backward); grad_logits is `logits` itself when inplace;
//   lse: (N,) in the accumulation type when want_lse.
// Whatever is not written is undefined (None in Python).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    FUSED_LOSSES_CROSS_ENTROPY_FORWARD_ARGS) {
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

// The path (CrossEntropyPath, by name) that cross_entropy_forward with these arguments
// takes on the tensors' device and the current stream; launches nothing. For the tests.
std::string cross_entropy_path(FUSED_LOSSES_CROSS_ENTROPY_FORWARD_ARGS) {
  c10::cuda::CUDAGuard guard(logits.device());
  const CrossEntropyInputs in(logits, target, weight, ignore_index, label_smoothing, z_loss);
  const bool scalar_loss = reduction != kNone;
  const bool want_grad = scalar_loss && (want_grad_logits || want_grad_target);
  std::string name;
  dispatch_cross_entropy(in, {in.logits.data_ptr(), in.probs ? in.target.data_ptr() : nullptr}, [&](auto config) {
    using Cfg = decltype(config);
    const CrossEntropyCall call = cross_entropy_call(in, scalar_loss, want_grad, want_lse, Cfg::vec);
    name = cross_entropy_path_name(cross_entropy_path_of<Cfg>(call));
  });
  return name;
}

// Test-only: every call takes the path named `path` (cross_entropy_path's names), or
// raises where that path cannot run it; "" gives the choice back to
// choose_cross_entropy_path.
void force_cross_entropy_path(const std::string& path) {
  if (path.empty()) {
    forced_cross_entropy_path().store(-1);
    return;
  }
  for (int i = 0; i < kCrossEntropyPaths; ++i) {
    if (path == kCrossEntropyPathNames[i]) {
      forced_cross_entropy_path().store(i);
      return;
    }
  }
  std::string names;
  for (const char* name : kCrossEntropyPathNames) names += std::string(names.empty() ? "" : ", ") + name;
  TORCH_CHECK_VALUE(false, "cross_entropy: no path named '", path, "' (paths: ", names, ")");
}

}  // namespace fused_losses
