"""Run from the repository root: python3 notes/experiments/binding_cost.py (a GPU is optional)

Host time of calling a C++ function with cross-entropy's 12 arguments (it does nothing and
returns its input) through torch.ops (a TORCH_LIBRARY op: its packet and its .default
overload) and through pybind11 (plain, and wrapped in torch::wrap_pybind_function as
loader.py's BINDINGS are), against F.cross_entropy and one tiny aten launch. The extension
is built for the CPU, so no CUDA toolkit is needed. Microseconds a call, three rounds."""
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SOURCE = r'''
#include <torch/library.h>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& logits, const at::Tensor& target, const c10::optional<at::Tensor>& weight,
    int64_t ignore_index, int64_t reduction, bool float_loss, double label_smoothing, double z_loss,
    bool want_grad_logits, bool want_grad_target, bool want_lse, bool inplace) {
  return {logits, at::Tensor(), at::Tensor(), at::Tensor()};
}
TORCH_LIBRARY(binding_cost, m) { m.def("forward", &forward); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward);
  m.def("wrapped", torch::wrap_pybind_function(forward));
}
'''


def per_call_us(fn, calls=30000):
    for _ in range(1000):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    build_dir = os.path.join(tempfile.gettempdir(), "binding_cost")
    os.makedirs(build_dir, exist_ok=True)
    module = load_inline("binding_cost", cpp_sources=[SOURCE], build_directory=build_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(64, 1000, device=device)
    t = torch.randint(0, 1000, (64,), device=device)
    one = torch.zeros(1, device=device)
    args = (x, t, None, -100, 1, False, 0.0, 0.0, False, False, False, False)
    calls = {
        "torch.ops": lambda: torch.ops.binding_cost.forward(*args),
        "torch.ops .default": lambda: torch.ops.binding_cost.forward.default(*args),
        "pybind11": lambda: module.forward(*args),
        "pybind11 wrapped": lambda: module.wrapped(*args),
        "F.cross_entropy": lambda: F.cross_entropy(x, t),
        "tiny aten launch": lambda: one.add_(1),
    }
    print(f"{device}, torch {torch.__version__}: us a call")
    with torch.no_grad():
        for _ in range(3):
            print("  ".join(f"{name} {per_call_us(fn):.2f}" for name, fn in calls.items()), flush=True)


if __name__ == "__main__":
    sys.exit(main())
