// autograd_node.h: the autograd node of an eager scalar loss whose forward wrote its
// gradients. Included by the bindings only (loader.py's BINDINGS, host compiler).
//
// Why C++: a launch-bound training step is bound by host time, and a Python
// autograd.Function costs 10-37 us a step more than this node (notes, v19 and v26): its
// apply, and its backward, which runs Python on autograd's device thread (and takes the
// GIL there). torch.compile cannot trace this node; under it the loss modules use their Python
// Functions, whose graphs are functional.
//
// backward(create_graph=True) alone calls back into Python (each loss module's _gradient_graph):
// the gradient is recomputed by torch's formula from the loss's operands, which the node
// holds weakly, so that the usual backward keeps nothing alive.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Optional.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "entry_points.h"

namespace fused_losses {

// backward: scales the saved gradients in place by grad_output over the forward's guess at
// it (grad_output_guess.cuh), or, where the forward kept its operands (`recompute`),
// recomputes them with grad_output, and hands them on. The node holds their only reference, so
// autograd makes them .grad without a copy. Under retain_graph=True another backward may
// follow: that backward hands on scaled copies and keeps the gradients.
struct ScaleSavedGradients : torch::autograd::Node {
  torch::autograd::variable_list grads;  // one per next edge; undefined where none is wanted
  at::Tensor guess;                      // the forward's guess_slot (entry_points.h), or undefined
  bool handed_on = false;                // grads are gone: a later backward has nothing to give
  // For create_graph=True: the operands as the user passed them, held weakly, their versions
  // then, and differentiable = (function, options): function(options, input, target,
  // grad_output) -> (grad, grad), in Python.
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  std::optional<WeakTensor> input_ref, target_ref;
  int64_t input_version = 0, target_version = 0;
  PyObject* differentiable = nullptr;  // owned
  // Or nullptr: recompute(grad_output, applied, grad_input, grad_target) writes the gradients
  // into the last two (None: not wanted) with grad_output as the factor, in Python (it holds
  // the forward's operands, which the first backward that keeps no graph lets go).
  PyObject* recompute = nullptr;  // owned

  ~ScaleSavedGradients() override {
    // Autograd may free a node on a thread without the GIL, or after Python is gone.
    if ((differentiable != nullptr || recompute != nullptr) && Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      Py_XDECREF(differentiable);
      Py_XDECREF(recompute);
    }
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grad_outputs) override {
    // Grad mode is on in backward only for create_graph=True: the gradient must carry a graph.
    if (at::GradMode::is_enabled()) return gradient_graph(grad_outputs[0]);
    // Backwards of a retained graph may run this node on several threads at once (as torch's own
    // nodes, which lock it too): one hands the gradients on, the others raise or take copies.
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!handed_on,
                "Trying to backward through the graph a second time: this fused loss handed on the gradient its "
                "forward computed. Specify retain_graph=True if you need to backward through the graph a second time.");
    const bool keep = torch::autograd::get_current_graph_task_keep_graph();
    torch::autograd::variable_list out = keep ? grads : std::exchange(grads, {});
    handed_on = !keep;
    const at::Tensor& grad_output = grad_outputs[0];
    // No gradient reached the loss (a later node gave it none): none flows on, as from
    // torch's own nodes.
    if (!grad_output.defined()) return torch::autograd::variable_list(out.size());
    for (at::Tensor& grad : out) {
      if (grad.defined() && keep) grad = grad.clone();
    }
    if (recompute != nullptr) {
      pybind11::gil_scoped_acquire gil;
      pybind11::reinterpret_borrow<pybind11::object>(recompute)(grad_output, guess, out[0], out[1]);
      if (!keep) Py_CLEAR(recompute);
      return out;
    }
    for (at::Tensor& grad : out) {
      if (grad.defined()) scale_by_grad_output_over_guess_(grad, grad_output, guess);
    }
    return out;
  }

  // The operand held weakly, if it is still alive and unchanged since the forward.
  static at::Tensor alive(const std::optional<WeakTensor>& ref, int64_t version, const char* name) {
    auto strong = ref.has_value() ? ref->lock() : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>();
    TORCH_CHECK(strong.defined(),
                "backward(create_graph=True) through a fused loss recomputes its gradient from its ", name,
                ", which is no longer alive: the fused loss keeps no reference to it (its memory is freed after the "
                "forward). Keep a reference to the loss's ", name, " until this backward.");
    at::Tensor tensor(std::move(strong));
    TORCH_CHECK(tensor._version() == version, "backward(create_graph=True) through a fused loss recomputes its "
                "gradient from its ", name, ", which was modified in place after the forward");
    return tensor;
  }

  torch::autograd::variable_list gradient_graph(const at::Tensor& grad_output) {
    TORCH_CHECK(differentiable != nullptr, "this fused loss has no second derivative");
    const at::Tensor input = alive(input_ref, input_version, "input");
    const at::Tensor target = alive(target_ref, target_version, "target");
    pybind11::gil_scoped_acquire gil;
    const auto function_and_options = pybind11::reinterpret_borrow<pybind11::tuple>(differentiable);
    const pybind11::tuple result = function_and_options[0](function_and_options[1], input, target, grad_output);
    torch::autograd::variable_list out;
    for (const auto& grad : result) out.push_back(grad.is_none() ? at::Tensor() : grad.cast<at::Tensor>());
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    grads.clear();
  }

  std::string name() const override { return "FusedLossBackward"; }
};

// torch 2.0 holds autograd nodes in shared_ptr, later versions in intrusive_ptr.
using NodePtr = std::decay_t<decltype(std::declval<const at::TensorBase&>().grad_fn())>;

template <typename N>
NodePtr new_node() {  // a template, so that only the branch for this torch is compiled
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), [](N* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<N>();
  }
}

// loss: the 0-dim result of a forward that also wrote grad_input and grad_target (None
// where not asked for). Returns loss, now with a ScaleSavedGradients grad_fn whose next
// edges are input's and target's. For create_graph=True: the operands as the user passed
// them (user_input, user_target) and differentiable = (function, options), where
// function(options, user_input, user_target, grad_output) gives the gradients of input and
// target as a graph (None: no second derivative). recompute: ScaleSavedGradients::recompute, or
// None.
inline at::Tensor attach_saved_gradients(at::Tensor loss, const at::Tensor& input,
                                         const c10::optional<at::Tensor>& grad_input, const at::Tensor& target,
                                         const c10::optional<at::Tensor>& grad_target, const at::Tensor& user_input,
                                         const at::Tensor& user_target, pybind11::object differentiable,
                                         pybind11::object recompute) {
  TORCH_CHECK(loss.dim() == 0 && !loss.requires_grad(), "loss must be a 0-dim tensor without a grad_fn");
  NodePtr node = new_node<ScaleSavedGradients>();
  auto* scale = static_cast<ScaleSavedGradients*>(node.get());
  auto wanted = [](const at::Tensor& operand, const c10::optional<at::Tensor>& grad) {
    return operand.requires_grad() && grad.has_value() ? *grad : at::Tensor();
  };
  scale->grads = {wanted(input, grad_input), wanted(target, grad_target)};
  scale->guess = guess_slot(loss);
  if (!differentiable.is_none()) {
    TORCH_CHECK(pybind11::isinstance<pybind11::tuple>(differentiable) && pybind11::len(differentiable) == 2,
                "differentiable must be (function, options) or None");
    scale->input_ref = ScaleSavedGradients::WeakTensor(user_input.getIntrusivePtr());
    scale->target_ref = ScaleSavedGradients::WeakTensor(user_target.getIntrusivePtr());
    scale->input_version = user_input._version();
    scale->target_version = user_target._version();
    scale->differentiable = differentiable.release().ptr();
  }
  if (!recompute.is_none()) scale->recompute = recompute.release().ptr();
  node->set_next_edges(torch::autograd::collect_next_edges(input, target));
  torch::autograd::set_history(loss, node);
  return loss;
}

}  // namespace fused_losses
