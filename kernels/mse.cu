// mse.cu: mean squared error, as F.mse_loss(input, target, reduction).
//
//   loss_i = (x_i - y_i)^2          reduced by 'mean' (/n), 'sum' or 'none'
//   d loss / d x_i = 2 (x_i - y_i) * scale,   d loss / d y_i = -d loss / d x_i
//
// Bytes per element (b = element size): forward 2b (read x, y). Training step with the
// gradient of x: 3b (the forward writes dx while it reads x and y; backward only scales
// dx by grad_output, and not at all when the forward guessed it: grad_output_guess.cuh);
// with dy as well: 4b.
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

  template <typename T, typename acc_t = acc_type<T>>
  __device__ __forceinline__ void compute(acc_t input, acc_t target, Needs, acc_t& loss, acc_t& d_input,
                                          acc_t& d_target) const {
    const acc_t diff = input - target;
    loss = diff * diff;
    d_input = acc_t(2) * diff;
    d_target = -d_input;
  }
};

// ---------------------------------------------------------------------------------
// Host entry point (ops.h; entry_points.h's mse_forward and mse_backward call it).

void mse_launch(const PointwiseCall& call, const LaunchContext& context) {
  launch_pointwise_loss(call, SquaredErrorOp{}, context);
}

}  // namespace fused_losses
