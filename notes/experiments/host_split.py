"""Run from the repository root on a CUDA machine: python3 notes/experiments/host_split.py

Where the host time of a small MSE training step goes (device host), us per call."""
import sys, time
import torch, torch.nn.functional as F
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
        "step: eager mean((x-y)**2)": per_call(step_eager),
        "step: eager F.mse_loss": per_call(step_eager_mse),
    }
    for k, v in r.items():
        print(f"round {rnd} {k:32s} {v:7.1f} us")
