"""KL divergence: F.kl_div fused (kernels/kl_div.cu on the pointwise engine), plus log_input."""
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

_COMPILE_LIBRARY = helpers.define_compile_ops("kl_div", pointwise_loss.COMPILE_FAKES)

# torch's own words (F.kl_div), so that filters written for torch's warning still match.
KL_MEAN_WARNING = (
    "reduction: 'mean' divides the total loss by both the batch size and the support size."
    "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
    "'mean' will be changed to behave the same as 'batchmean' in the next major release.")


def kl_div(input: torch.Tensor, target: torch.Tensor, size_average=None, reduce=None, reduction: str = "mean",
           log_target: bool = False, *, log_input: bool = True) -> torch.Tensor:
    """F.kl_div(input, target, ...), plus log_input.

    log_input=True (torch's convention): input holds log-probabilities.
    log_input=False: input holds probabilities p and the log is taken inside the kernel:
    kl_div(p, q, reduction='batchmean', log_input=False) == F.kl_div(torch.log(p), q,
    reduction='batchmean').
    """
    reduction = helpers.legacy_reduction(size_average, reduce, reduction)
    helpers.check_reduction(reduction, ("none", "batchmean", "mean", "sum"))
    helpers.check_tensors("kl_div", input, target)
    if not (input.is_floating_point() and target.is_floating_point()):  # torch's checks, before any promotion
        kind = "Complex" if input.is_complex() or target.is_complex() else "Integral"
        raise RuntimeError(f"kl_div: {kind} inputs not supported.")
    why_not = pointwise_loss.fusable(input, target)
    if why_not is None:
        batch_size = input.shape[0] if input.dim() != 0 else 1  # torch's, before broadcasting
        user_operands = (input, target)
        input, target = pointwise_loss.operands(input, target)
        if reduction == "mean":
            warnings.warn(KL_MEAN_WARNING, stacklevel=2)
            scale = 1.0 / input.numel()
        elif reduction == "batchmean":
            scale = 1.0 / batch_size
        else:
            scale = 1.0
        return pointwise_loss.pointwise_loss("kl_div", input, target, reduction, scale, (log_input, log_target),
                                             user_operands)
    helpers.check_fallback_allowed("kl_div", why_not, input)
    return F.kl_div(input if log_input else torch.log(input), target, reduction=reduction, log_target=log_target)


class KLDivLoss(nn.KLDivLoss):
    """nn.KLDivLoss on the fused kernel; log_input=False takes probabilities (see kl_div)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False,
                 *, log_input: bool = True) -> None:
        super().__init__(size_average, reduce, reduction, log_target)
        self.log_input = log_input

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target,
                      log_input=self.log_input)
