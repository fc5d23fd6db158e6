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
// A temperature T: all of the above of u = x / T (lse, p, the z-loss), the max still taken on x,
// and d/dx = d/du / T (row_math.cuh's exp_minus_scaled and finish_row).
//
// Bytes per logit (b = element size): forward b. Training step: 2b (the forward writes the
// gradient as it goes; backward only scales it by grad_output, and not at all when the
// forward guessed it: grad_output_guess.cuh), or b with inplace_backward, whose gradient
// overwrites the logits. A row of up to cache_packs * kMaxThreads packs stays in registers
// between the passes, so it is read from HBM once (without a gradient, many such rows are
// streamed by a warp each). A longer row is streamed; when its gradient is written, on
// sm_90 (class-index targets, no label smoothing, 2- and 4-byte dtypes) the copy engine
// brings it into shared memory, split among a cluster of blocks where it is longer than
// half a block's (cross_entropy_pipelined_kernel): read once; so does a 2-byte row the
// registers hold only in a block alone on its multiprocessor. Where the clusters leave
// multiprocessors (the H200's 132 hold 30 clusters of 4), the streamed kernel below takes a
// share of the rows on them at the same time. Elsewhere the first pass
// keeps as much of its front in shared memory as one block can have (227 KB on an H100:
// all of a 40000-class fp32 row, 90% of a 128256-class bf16 row), and the gradient pass
// reads the rest again, what the first pass read last, mostly from L2.
// Probability targets add b per logit read (and b written for their gradient).
//
// Its own headers, in cross_entropy/: row_math.cuh (one row's math), row_kernels.cuh and
// pipelined_kernel.cuh (the kernels), launch_policy.cuh (which kernel takes a call).

#include <string>

#include "cross_entropy/launch_policy.cuh"
#include "finish.cuh"
#include "launch.cuh"

namespace fused_losses {

// Host entry points (ops.h; entry_points.h's cross_entropy_forward, cross_entropy_backward,
// cross_entropy_path and force_cross_entropy_path call them).

void cross_entropy_launch(const CrossEntropyCall& call, const LaunchContext& context) {
  if (call.rows * call.classes > 0) launch_cross_entropy(call, context);  // Python sends empty inputs to torch
}

const char* cross_entropy_call_path(const CrossEntropyCall& call, const LaunchContext& context) {
  const char* name = nullptr;
  dispatch_cross_entropy(call, [&](auto config) {
    using Cfg = decltype(config);
    name = cross_entropy_path_name(
        cross_entropy_path_of<Cfg>(cross_entropy_shape(call, Cfg::vec, context.device, context.stream)));
  });
  return name;
}

void set_forced_cross_entropy_path(const char* path) {
  const std::string wanted = path;
  if (wanted.empty()) {
    forced_cross_entropy_path().store(-1);
    return;
  }
  for (int i = 0; i < kCrossEntropyPaths; ++i) {
    if (wanted == kCrossEntropyPathNames[i]) {
      forced_cross_entropy_path().store(i);
      return;
    }
  }
  std::string names;
  for (const char* name : kCrossEntropyPathNames) names += std::string(names.empty() ? "" : ", ") + name;
  throw std::invalid_argument("cross_entropy: no path named '" + wanted + "' (paths: " + names + ")");
}

}  // namespace fused_losses
