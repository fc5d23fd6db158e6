"""Mean squared error: F.mse_loss fused (kernels/mse.cu on the pointwise engine)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

if __package__:
    from . import loss_helpers as helpers
    from . import pointwise_loss
else:
    import loss_helpers as helpers
    import pointwise_loss

_COMPILE_LIBRARY = helpers.define_compile_ops("mse", pointwise_loss.COMPILE_FAKES)


def mse_loss(input: torch.Tensor, target: torch.Tensor, size_average=None, reduce=None, reduction: str = "mean",
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """F.mse_loss(input, target, ...). `weight` (torch 2.6+) runs torch's implementation."""
    reduction = helpers.legacy_reduction(size_average, reduce, reduction)
    helpers.check_reduction(reduction, ("none", "mean", "sum"))
    helpers.check_tensors("mse_loss", input, target, weight)
    why_not = "weight is not fused yet" if weight is not None else pointwise_loss.fusable(input, target)
    if why_not is None:
        if input.shape != target.shape:  # torch's warning, word for word
            warnings.warn(f"Using a target size ({target.size()}) that is different to the input size "
                          f"({input.size()}). This will likely lead to incorrect results due to broadcasting. "
                          "Please ensure they have the same size.", stacklevel=2)
        user_operands = (input, target)
        input, target = pointwise_loss.operands(input, target)
        scale = 1.0 / input.numel() if reduction == "mean" else 1.0
        return pointwise_loss.pointwise_loss("mse", input, target, reduction, scale, (), user_operands)
    helpers.check_fallback_allowed("mse_loss", why_not, input)
    if weight is not None:
        return F.mse_loss(input, target, reduction=reduction, weight=weight)
    return F.mse_loss(input, target, reduction=reduction)


class MSELoss(nn.MSELoss):
    """nn.MSELoss on the fused kernel."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse_loss(input, target, reduction=self.reduction)
