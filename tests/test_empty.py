"""Empty inputs give torch's results (the loss modules hand them to torch on every device, a
documented exception: there is nothing for a kernel to do). On CPU, so CI runs it; on a
GPU the same torch call runs after the same argument checks."""
import pytest
import torch
import torch.nn.functional as F

import losses
from helpers import check_special_values_match_torch

EMPTY_CASES = {
    "mse_loss (0, 7)": (lambda r: lambda x, y: losses.mse_loss(x, y, reduction=r),
                        lambda r: lambda x, y: F.mse_loss(x, y, reduction=r),
                        lambda: [torch.randn(0, 7), torch.randn(0, 7)], (0, 1), ("mean", "sum", "none")),
    "mse_loss (5, 0)": (lambda r: lambda x, y: losses.mse_loss(x, y, reduction=r),
                        lambda r: lambda x, y: F.mse_loss(x, y, reduction=r),
                        lambda: [torch.randn(5, 0), torch.randn(5, 0)], (0, 1), ("mean", "sum", "none")),
    "kl_div (0, 7)": (lambda r: lambda p, q: losses.kl_div(p, q, reduction=r, log_input=False),
                      lambda r: lambda p, q: F.kl_div(torch.log(p), q, reduction=r),
                      lambda: [torch.rand(0, 7), torch.rand(0, 7)], (0, 1), ("batchmean", "sum", "none")),
    "cross_entropy (0, 7)": (lambda r: lambda x, t: losses.cross_entropy(x, t, reduction=r),
                             lambda r: lambda x, t: F.cross_entropy(x, t, reduction=r),
                             lambda: [torch.randn(0, 7), torch.zeros(0, dtype=torch.int64)], (0,),
                             ("mean", "sum", "none")),
    "cross_entropy (0, 7) probabilities": (
        lambda r: lambda x, y: losses.cross_entropy(x, y, reduction=r, label_smoothing=0.1),
        lambda r: lambda x, y: F.cross_entropy(x, y, reduction=r, label_smoothing=0.1),
        lambda: [torch.randn(0, 7), torch.rand(0, 7)], (0, 1), ("mean", "sum", "none")),
}


@pytest.mark.parametrize("case", list(EMPTY_CASES))
def test_empty_inputs_match_torch(case):
    fused, reference, make_inputs, grad_of, reductions = EMPTY_CASES[case]
    for reduction in reductions:
        check_special_values_match_torch(fused(reduction), reference(reduction), make_inputs(), grad_of=grad_of)
