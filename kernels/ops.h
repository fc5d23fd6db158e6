// ops.h: every kernel build's entry points, as Python calls them.
//
// A build is one kernels/<kernel>.cu (compiled by nvcc) plus its Python bindings
// (loader.py's BINDINGS, compiled by the host compiler: nvcc has failed on pybind11's
// headers in some CUDA releases). Both include this file: the bindings call what is
// declared here, and a definition whose arguments drift from it leaves the declared
// function undefined, which the first load reports by name. Every kernel has
// <kernel>_forward and <kernel>_backward; scale_by_grad_output_ is finish.cuh's. The
// bindings also bind autograd_node.h's attach_saved_gradients (host code, not a kernel op),
// and for cross_entropy alone its test-only cross_entropy_path and force_cross_entropy_path.
// losses.py's KERNEL_OPS repeats these signatures as schemas for torch.compile.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace fused_losses {

// In place: grad *= grad_output (0-dim, read on the GPU; no work when it is 1).
void scale_by_grad_output_(at::Tensor grad, const at::Tensor& grad_output);

// mse.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> mse_forward(const at::Tensor& input, const at::Tensor& target,
                                                           int64_t reduction, double scale, bool float_loss,
                                                           bool want_grad_input, bool want_grad_target);
std::tuple<at::Tensor, at::Tensor> mse_backward(const at::Tensor& input, const at::Tensor& target,
                                                const at::Tensor& grad_output, bool want_grad_input,
                                                bool want_grad_target);

// kl_div.cu
std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_div_forward(const at::Tensor& input, const at::Tensor& target,
                                                              int64_t reduction, double scale, bool float_loss,
                                                              bool want_grad_input, bool want_grad_target,
                                                              bool log_input, bool log_target);
std::tuple<at::Tensor, at::Tensor> kl_div_backward(const at::Tensor& input, const at::Tensor& target,
                                                   const at::Tensor& grad_output, bool want_grad_input,
                                                   bool want_grad_target, bool log_input, bool log_target);

// cross_entropy.cu. The forward's 12 arguments, written once for every function that takes
// them (losses.py's schema repeats them for torch.compile).
#define FUSED_LOSSES_CROSS_ENTROPY_FORWARD_ARGS                                                                  \
  const at::Tensor &logits, const at::Tensor &target, const c10::optional<at::Tensor> &weight,                  \
      int64_t ignore_index, int64_t reduction, bool float_loss, double label_smoothing, double z_loss,          \
      bool want_grad_logits, bool want_grad_target, bool want_lse, bool inplace
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(
    FUSED_LOSSES_CROSS_ENTROPY_FORWARD_ARGS);
// Test-only (bound for cross_entropy alone): the path such a call takes, and a path forced on every call.
std::string cross_entropy_path(FUSED_LOSSES_CROSS_ENTROPY_FORWARD_ARGS);
void force_cross_entropy_path(const std::string& path);
std::tuple<at::Tensor, at::Tensor> cross_entropy_backward(const at::Tensor& logits, const at::Tensor& target,
                                                          const c10::optional<at::Tensor>& weight,
                                                          int64_t ignore_index, double label_smoothing,
                                                          double z_loss, const at::Tensor& grad_output,
                                                          bool want_grad_logits, bool want_grad_target);

}  // namespace fused_losses
