"""Fused CUDA loss kernels for PyTorch (see README.md).

Copied into a project as a package (any folder name):
    import fused_losses                      # fused_losses.cross_entropy(...)
    from fused_losses import losses, loader
"""
# Only as a package: test runners (pytest >= 9) also import this file as a plain
# module while collecting the folder, where relative imports have no parent package.
if __package__:
    from . import loader, losses
    from .losses import (CrossEntropyLoss, KLDivLoss, LinearCrossEntropyLoss, MSELoss, cross_entropy,  # noqa: F401
                         fuse_causal_lm_loss, kl_div, linear_cross_entropy, mse_loss)

    __all__ = ["loader", "losses", *losses.__all__]
