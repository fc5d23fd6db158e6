// kl_div.cu: KL divergence, as F.kl_div(input, target, reduction, log_target), plus
// log_input=False: input holds probabilities p and the log is taken here, so that
// kl_div(p, q, 'batchmean', log_input=False) == F.kl_div(torch.log(p), q, 'batchmean')
// in one kernel.
//
// With lp = log p (= input, or log(input) when log_input is false):
//   log_target false:  loss_i = xlogy(q_i, q_i) - q_i * lp_i
//   log_target true:   loss_i = exp(t_i) * (t_i - lp_i)            (t = log q)
// reduced by 'batchmean' (/ input.size(0)), 'mean' (/ n), 'sum' or 'none'.
//
// Bytes per element (b = element size): forward 2b (read input, target). Training step
// with the gradient of input: 3b (the forward writes it; backward only scales it by
// grad_output, and not at all when the forward guessed it: grad_output_guess.cuh); with
// the target's gradient too: 4b.

#include "pointwise.cuh"

namespace fused_losses {

// ---------------------------------------------------------------------------------
// The math of one element. Gradients follow torch's autograd of the composite
// formula above term by term, so special values (q = 0, p = 0) come out as torch's do.

struct KlDivOp {
  // Heavy math: one pack computed while the next is loaded (16384^2 fp32 forward 1.31x
  // the floor without prefetch, 1.00x with; batches of 2 cost occupancy: fp16 1.26x -> 1.47x).
  template <typename T>
  __host__ __device__ static constexpr int batch() { return 1; }
  static constexpr bool kPrefetch = true;
  static constexpr bool kFastPath = true;
  // The training step's forward, 16384^2, H100 / H200 ms: bf16 0.589 -> 0.573 / 0.497 ->
  // 0.417, fp16 0.561 -> 0.568 / 0.431 -> 0.413, fp32 1.139 -> 1.130 / 0.770 -> 0.765.
  static constexpr bool kOwnScalarGradPass = true;

  bool log_input;
  bool log_target;

  // Probabilities in, the common case: q log(q / p) needs one log and one division where
  // the formula of compute() takes two logs and two divisions, and it is the more accurate
  // where p is close to q (the log of a ratio near 1 has no cancellation). d/dp = -q / p,
  // d/dq = log(q / p) + 1. It holds where the loss is finite and q != 0; elsewhere
  // compute() decides, so special values come out exactly as torch's. For 2-byte inputs
  // the hardware's approximations with subnormals flushed: a flushed ratio or p makes
  // the loss infinite, which sends the pack to compute().
  template <typename T, typename acc_t = acc_type<T>>
  __device__ __forceinline__ bool fast(acc_t input, acc_t target, Needs, acc_t& loss, acc_t& d_input,
                                       acc_t& d_target) const {
    if (log_input || log_target) return false;
    acc_t ratio, log_ratio;
    if constexpr (sizeof(T) == 2) {
      float inverse, log2_ratio;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inverse) : "f"(input));
      ratio = target * inverse;
      asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(log2_ratio) : "f"(ratio));
      log_ratio = log2_ratio * kLn2;
    } else {
      ratio = target / input;
      log_ratio = log_acc(ratio);
    }
    loss = target * log_ratio;
    d_input = -ratio;
    d_target = log_ratio + acc_t(1);
    return isfinite(loss) && target != acc_t(0);
  }

  template <typename T, typename acc_t = acc_type<T>>
  __device__ __forceinline__ void compute(acc_t input, acc_t target, Needs need, acc_t& loss, acc_t& d_input,
                                          acc_t& d_target) const {
    const acc_t log_p = log_input ? input : log_for<T>(input);
    // d loss / d log p = -q; d / dp = that / p, as autograd through torch.log gives it.
    if (log_target) {
      const acc_t q = exp_for<T>(target);
      loss = q * (target - log_p);
      if (need.d_input) d_input = log_input ? -q : -q / input;
      if (need.d_target) d_target = loss + q;
    } else {
      const acc_t q = target;
      if (need.d_input) d_input = log_input ? -q : -q / input;
      if (need.loss || need.d_target) {
        // xlogy(q, q) is 0 where q == 0 (unless q is NaN).
        const acc_t log_q_or_0 = q == acc_t(0) ? acc_t(0) : log_for<T>(q);
        loss = q * log_q_or_0 - q * log_p;
        // torch: d xlogy(q, q) / dq = xlogy(q != 0, q) + q / q, which is NaN at q == 0.
        if (need.d_target) d_target = log_q_or_0 + q / q - log_p;
      }
    }
  }
};

// ---------------------------------------------------------------------------------
// Host entry point (ops.h; entry_points.h's kl_div_forward and kl_div_backward call it).

void kl_div_launch(const PointwiseCall& call, bool log_input, bool log_target, const LaunchContext& context) {
  launch_pointwise_loss(call, KlDivOp{log_input, log_target}, context);
}

}  // namespace fused_losses
