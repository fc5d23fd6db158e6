"""10,000 training steps of every loss hold memory steady (GPU): nothing a step leaves
behind (saved tensors, gradients, cached builds, host-side state) may pile up."""
import gc

import pytest
import torch

from helpers import LOSSES

STEPS = 10_000
CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in (loss.reductions[0], "none")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", CASES)
def test_memory_holds_steady_over_10k_steps(name, reduction):
    loss = LOSSES[name]
    fused = loss.fused(reduction)
    inputs = [t.requires_grad_(i in loss.grad_of) for i, t in enumerate(loss.inputs(256, 4096, torch.float32))]
    probe = fused(*inputs).detach()
    grad_output = torch.ones_like(probe) if probe.dim() == 0 else torch.rand_like(probe) + 0.5
    del probe

    def step():
        fused(*inputs).backward(grad_output)
        for i in loss.grad_of:
            inputs[i].grad = None  # what optimizer.zero_grad() does

    for _ in range(5):  # first calls load the build and fill the allocator's cache
        step()
    gc.collect()  # earlier tests' garbage, collected mid-loop, would count as this loss's memory
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        step()
    early_peak = torch.cuda.max_memory_allocated()
    for _ in range(STEPS - 10):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated_before, "memory left allocated after the steps"
    assert torch.cuda.max_memory_allocated() == early_peak, "the peak grew after the first steps"
