// mse.cu: mean squared error, as F.mse_loss(input, target, reduction).
//
//   loss_i = (x_i - y_i)^2          reduced by 'mean' (/n), 'sum' or 'none'
//   d loss / d x_i = 2 (x_i - y_i) * scale,   d loss / d y_i = -d loss / d x_i
//
// Bytes per element (b = element size): forward 2b (read x, y). Training step with the
// gradient of x: 3b (the forward writes dx while it reads x and y; backward only scales
// dx by grad_output, and not at all when grad_output is 1); with dy as well: 4b.
// Reduction 'none': forward 3b (writes the loss), backward 3b + b per gradient.

#include "pointwise.cuh"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// The math of one element.

struct SquaredErrorOp {
  // Light math: batches of 4 packs, 8 of 4-byte elements (32768^2 fp32 forward 2.756 ->
  // 2.741 ms; 8 bf16 packs spill: 8192^2 forward 0.087 -> 0.142 ms), no prefetch
  // (prefetching needs more registers and was no faster: 8192^2 bf16 forward 1.08-1.26x
  // the floor without, 1.24-2.36x with).
  template <typename T>
  __host__ __device__ static constexpr int batch() { return sizeof(T) == 4 ? 8 : 4; }
  static constexpr bool kPrefetch = false;
  static constexpr bool kFastPath = false;  // no special cases
  // Its own training pass made the 8192^2 bf16 training step 3% slower on the H100 (0.1444
  // -> 0.1489 ms) and 0.8% faster on the H200 (0.1081 -> 0.1073); fp16 and fp32 within 1.5%.
  static constexpr bool kOwnScalarGradPass = false;

  template <typename T, typename acc_t = at::opmath_type<T>>
  __device__ __forceinline__ void compute(acc_t input, acc_t target, Needs, acc_t& loss, acc_t& d_input,
                                          acc_t& d_target) const {
    const acc_t diff = input - target;
    loss = diff * diff;
    d_input = acc_t(2) * diff;
    d_target = -d_input;
  }
};

// ---------------------------------------------------------------------------------
// Host entry points.

// `scale` is the reduction's factor (1/n for 'mean'); float_loss: a scalar loss in
// float32. Returns (loss, grad_input, grad_target); gradients are written only for a
// scalar reduction and when asked for, else they are undefined (None).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mse_forward(const at::Tensor& input, const at::Tensor& target,
                                                           int64_t reduction, double scale, bool float_loss,
                                                           bool want_grad_input, bool want_grad_target) {
  return pointwise_loss_forward(input, target, SquaredErrorOp{}, reduction, scale, float_loss, want_grad_input,
                                want_grad_target);
}

// Backward of reduction 'none'.
std::tuple<at::Tensor, at::Tensor> mse_backward(const at::Tensor& input, const at::Tensor& target,
                                                const at::Tensor& grad_output, bool want_grad_input,
                                                bool want_grad_target) {
  return pointwise_loss_backward(input, target, grad_output, SquaredErrorOp{}, want_grad_input, want_grad_target);
}

}  // namespace fused_losses
