"""Fused CUDA losses with torch.nn.functional's signatures and results: the public face.

    import losses                                   # or: from fused_losses import losses
    losses.cross_entropy(logits, target)            # functional, as F.cross_entropy
    losses.CrossEntropyLoss(ignore_index=-100)      # modules, as torch.nn's

On CUDA tensors each loss runs fused kernels (kernels/<loss>.cu, built on first use by
loader.py). When grad is needed and the reduction is a scalar, the forward kernel also
writes the gradient, so backward only scales it by grad_output (read on the GPU; no host
sync anywhere). Under CUDA autocast they give what torch's give there: a float32 loss.

CPU tensors, torch.func transforms, forward-mode AD and argument combinations the kernels
do not cover run torch's own implementation: same results. FUSED_LOSSES_STRICT=1 makes such
a fallback on a CUDA tensor raise instead (the GPU tests do, to prove the kernels ran).

A bad argument raises what torch's function raises for the same call: a TypeError naming a
non-tensor; where torch raises RuntimeError (another device, a weight of the wrong length),
ArgumentError (losses.ArgumentError), a RuntimeError and a ValueError at once.

Each loss family lives in a module of its own, read top to bottom (user function, Module,
autograd Functions, compile ops); this file only hands their names on:
    mse.py, kl_div.py            on pointwise_loss.py (kernels/pointwise.cuh's engine)
    cross_entropy.py             its paths; softcap and vocab_parallel.py on row_passes.py
    linear_cross_entropy.py      linear + cross-entropy on row_passes.py
    causal_lm.py                 fuse_causal_lm_loss: a transformers causal LM's loss through it
    loss_helpers.py, op_signatures.py, loader.py   what they share, each op's declaration, builds
"""
from __future__ import annotations

if __package__:  # copied into a project as a package: from fused_losses import losses
    from . import loader  # noqa: F401  (losses.loader: the notebook's reload)
    from .causal_lm import fuse_causal_lm_loss
    from .cross_entropy import CrossEntropyLoss, cross_entropy, log_probs
    from .kl_div import KLDivLoss, kl_div
    from .linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy, linear_log_probs
    from .loss_helpers import ArgumentError
    from .mse import MSELoss, mse_loss
else:  # a plain folder on sys.path, or a notebook's working directory: import losses
    import loader  # noqa: F401
    from causal_lm import fuse_causal_lm_loss
    from cross_entropy import CrossEntropyLoss, cross_entropy, log_probs
    from kl_div import KLDivLoss, kl_div
    from linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy, linear_log_probs
    from loss_helpers import ArgumentError
    from mse import MSELoss, mse_loss

__all__ = ["cross_entropy", "kl_div", "mse_loss", "linear_cross_entropy", "CrossEntropyLoss", "KLDivLoss", "MSELoss",
           "LinearCrossEntropyLoss", "fuse_causal_lm_loss", "ArgumentError", "log_probs",
           "linear_log_probs"]
