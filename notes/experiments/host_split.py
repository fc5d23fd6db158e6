"""Run from the repository root on a CUDA machine: python3 notes/experiments/host_split.py

Where the host time of a small MSE training step goes (us a call), and what a C++ autograd
node would save against our Python autograd.Function: a prototype node, attached to the
op's loss, whose backward scales the saved gradient with one aten mul_ (as our scale op
is one launch), in C++ on autograd's device thread (no Python, no GIL)."""
import sys, time
import torch, torch.nn.functional as F
from torch.utils.cpp_extension import load_inline
sys.path.insert(0, ".")
import losses, loader

dev = "cuda"
x = torch.randn(64, 1000, device=dev); y = torch.randn_like(x)
leaf = x.detach().requires_grad_()
ops = loader.load_for_device("mse", x.device)

def per_call(fn, n=3000):
    for _ in range(300): fn()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - s) / n * 1e6

src = r'''
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
using torch::autograd::variable_list;
using NodeHandle = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;
template <typename N> void delete_node(N* node) { deleteNode(node); }
template <typename N> auto make_node() {
  if constexpr (std::is_same_v<NodeHandle, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N(), delete_node<N>);
  } else {
    return c10::make_intrusive<N>();
  }
}
struct ScaleSavedGrads : torch::autograd::Node {
  std::vector<at::Tensor> grads;
  variable_list apply(variable_list&& grad_outputs) override {
    TORCH_CHECK(!at::GradMode::is_enabled(), "no create_graph");
    for (auto& g : grads) if (g.defined()) g.mul_(grad_outputs[0]);
    variable_list out = std::move(grads);
    grads.clear();
    return out;
  }
  void release_variables() override { grads.clear(); }
  std::string name() const override { return "ScaleSavedGrads"; }
};
at::Tensor attach(at::Tensor loss, at::Tensor grad, const at::Tensor& input) {
  auto node = make_node<ScaleSavedGrads>();
  node->grads = {grad};
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(loss, node);
  return loss;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("attach", &attach); }
'''
proto = load_inline("node_proto", cpp_sources=[src], verbose=False)

def step_cpp_node():
    leaf.grad = None
    loss, grad, _ = ops.forward(leaf, y, 1, 1.0 / leaf.numel(), False, True, False)
    proto.attach(loss, grad, leaf).backward()

g = torch.empty_like(x); one = torch.ones((), device=dev)
class Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return one.clone()  # one launch, like our loss
    @staticmethod
    def backward(ctx, go):
        return g
def step_nothing():
    leaf.grad = None; Nothing.apply(leaf).backward()
def step_ours():
    leaf.grad = None; losses.mse_loss(leaf, y).backward()
def step_eager():
    leaf.grad = None; torch.mean((leaf - y) ** 2).backward()
def step_eager_mse():
    leaf.grad = None; F.mse_loss(leaf, y).backward()
for rnd in range(2):
    r = {
        "op forward with grad": per_call(lambda: ops.forward(x, y, 1, 1.0 / x.numel(), False, True, False)),
        "op forward no grad": per_call(lambda: ops.forward(x, y, 1, 1.0 / x.numel(), False, False, False)),
        "op scale_by_grad_output_": per_call(lambda: ops.scale_by_grad_output_(g, one)),
        "torch.ones(())": per_call(lambda: torch.ones((), device=dev)),
        "tiny aten add_": per_call(lambda: one.add_(0)),
        "losses.mse_loss fwd (grad)": per_call(lambda: losses.mse_loss(leaf, y)),
        "losses.mse_loss fwd (no grad)": per_call(lambda: losses.mse_loss(x, y)),
        "step: empty Python Function": per_call(step_nothing),
        "step: ours": per_call(step_ours),
        "step: ours via a C++ node": per_call(step_cpp_node),
        "step: eager mean((x-y)**2)": per_call(step_eager),
        "step: eager F.mse_loss": per_call(step_eager_mse),
    }
    for k, v in r.items():
        print(f"round {rnd} {k:32s} {v:7.1f} us")
