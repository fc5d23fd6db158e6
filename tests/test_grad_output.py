"""loss * 2.5 before backward, every loss (GPU): a scalar loss's gradient is written in
the forward pass and scaled by grad_output in backward; this is the case that gets wrong."""
import itertools

import pytest
import torch

from helpers import LOSSES, check_against_float64

CASES = [(name, reduction, grad_of)
         for name, loss in LOSSES.items()
         for reduction in loss.reductions if reduction != "none"
         for size in range(1, len(loss.grad_of) + 1)
         for grad_of in itertools.combinations(loss.grad_of, size)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction,grad_of", CASES, ids=str)
def test_grad_output_not_one(name, reduction, grad_of):
    loss = LOSSES[name]
    fused, reference = loss.fused(reduction), loss.reference(reduction)
    check_against_float64(lambda *inputs: fused(*inputs) * 2.5, lambda *inputs: reference(*inputs) * 2.5,
                          loss.inputs(7, 1000, torch.float32), grad_of=grad_of, case=name)
