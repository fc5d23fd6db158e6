"""Same inputs, same bits: every loss, dtype and reduction, 100 runs (GPU).

The kernels reduce without float atomics (per-block partials added in a fixed order, or
exact integer sums where the order is not fixed), so nothing may change from run to run:
not the loss, not any gradient.
"""
import pytest
import torch

import losses
from helpers import LOSSES, loss_and_grads

RUNS = 100
SHAPES = [
    (513, 1037),  # many blocks for every kernel; odd, so vector bodies and scalar tails both run
    (33, 40000),  # cross-entropy rows beyond the register cache (streamed, kept in shared memory)
    (3, 270000),  # very long rows: float16 softmax inputs underflow to 0, so KL gives NaN as torch does
]

CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions]


def same_bits(a, b):
    """Bit for bit, NaN included (softmax rows of 270000 underflow to 0 in float16, and
    KL's 0 * log 0 terms are NaN as in torch)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,reduction", CASES)
def test_bitwise_identical_over_runs(name, reduction, dtype, rows, cols):
    loss = LOSSES[name]
    inputs = loss.inputs(rows, cols, dtype)
    fused = loss.fused(reduction)
    probe = fused(*inputs)
    grad_output = torch.ones((), device="cuda") if probe.dim() == 0 else torch.rand_like(probe) + 0.5
    first_loss, first_grads = loss_and_grads(fused, inputs, loss.grad_of, grad_output)
    for run in range(1, RUNS):
        again_loss, again_grads = loss_and_grads(fused, inputs, loss.grad_of, grad_output)
        assert same_bits(again_loss, first_loss), f"run {run}: loss differs"
        for index, (again, first) in zip(loss.grad_of, zip(again_grads, first_grads)):
            assert same_bits(again, first), f"run {run}: gradient of input {index} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_multiprocessor", [32, 320])
@pytest.mark.parametrize("z_loss", [0.0, 1e-4], ids=["no z-loss", "z-loss"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_warp_rows_forward_bitwise_identical_over_runs(dtype, reduction, z_loss, rows_per_multiprocessor):
    """Cross-entropy without grad on many rows (the sum-only kernels, a warp per row for
    2-byte logits, which the tests above do not reach: they take gradients): the sum is the
    same bits every run, with few rows per warp and with many."""
    rows = rows_per_multiprocessor * torch.cuda.get_device_properties(0).multi_processor_count + 3
    logits = torch.randn(rows, 4099, device="cuda", dtype=dtype) * 4
    target = torch.randint(0, 4099, (rows,), device="cuda")
    target[::7] = -100
    with torch.no_grad():
        first = losses.cross_entropy(logits, target, reduction=reduction, z_loss=z_loss)
        for run in range(1, RUNS):
            again = losses.cross_entropy(logits, target, reduction=reduction, z_loss=z_loss)
            assert same_bits(again, first), f"run {run}: loss differs"


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(513, 1037), (33, 40000), (1024, 128256)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cross_entropy_lse_bitwise_identical_over_runs(dtype, rows, cols):
    """return_lse's lse, with the gradient, the same bits every run. 1024 x 128256 takes sm_90's pipelined
    kernel, a cluster of blocks per row: each block's combined (max, sum) can differ by an ulp (a butterfly's
    lanes add in different orders), and while every block wrote the lse, bfloat16's differed from run to run
    (H200: 29 of 29 runs, 1.9e-6); rank 0 alone writes it now."""
    logits = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
    target = torch.randint(0, cols, (rows,), device="cuda")
    target[::7] = -100
    first = None
    for run in range(30):
        x = logits.clone().requires_grad_()
        loss, lse = losses.cross_entropy(x, target, return_lse=True)
        loss.backward()
        if first is None:
            first = (loss, lse, x.grad)
            continue
        for name, again, before in zip(("loss", "lse", "gradient"), (loss, lse, x.grad), first):
            assert same_bits(again, before), f"run {run}: {name} differs"
