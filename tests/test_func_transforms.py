"""torch.func transforms (grad, vmap, vmap(grad), jacrev, jvp) over each loss give what they
give over torch's own loss: under a transform tensors are wrappers without storage, so every
loss runs torch's implementation there (a fallback strict mode allows), on CPU and on CUDA."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, jvp, vmap

import losses

ROWS, CLASSES, HIDDEN = 4, 6, 5


def cases(device):
    """name -> (ours, torch's), each a function of one (ROWS, CLASSES) float64 tensor."""
    other = torch.randn(ROWS, CLASSES, dtype=torch.float64, device=device)
    target = torch.randint(0, CLASSES, (ROWS,), device=device)
    head = torch.randn(CLASSES, CLASSES, dtype=torch.float64, device=device)
    probabilities = other.softmax(-1)
    return {
        "mse_loss": (lambda x: losses.mse_loss(x, other), lambda x: F.mse_loss(x, other)),
        "kl_div": (lambda x: losses.kl_div(x.log_softmax(-1), probabilities, reduction="batchmean"),
                   lambda x: F.kl_div(x.log_softmax(-1), probabilities, reduction="batchmean")),
        "cross_entropy": (lambda x: losses.cross_entropy(x, target, label_smoothing=0.1),
                          lambda x: F.cross_entropy(x, target, label_smoothing=0.1)),
        "cross_entropy probabilities": (lambda x: losses.cross_entropy(x, probabilities),
                                        lambda x: F.cross_entropy(x, probabilities)),
        "cross_entropy softcap": (lambda x: losses.cross_entropy(x, target, softcap=2.0),
                                  lambda x: F.cross_entropy(2.0 * torch.tanh(x / 2.0), target)),
        "cross_entropy z_loss": (lambda x: losses.cross_entropy(x, target, z_loss=0.01),
                                 lambda x: F.cross_entropy(x, target) + 0.01 * torch.logsumexp(x, -1).square().mean()),
        "linear_cross_entropy": (lambda x: losses.linear_cross_entropy(x, head, target),
                                 lambda x: F.cross_entropy(F.linear(x, head), target)),
    }


TRANSFORMS = {
    "grad": lambda f, x: grad(f)(x),
    "jacrev": lambda f, x: jacrev(f)(x),
    "jvp": lambda f, x: jvp(f, (x,), (torch.ones_like(x),)),
    # A batch of 3 problems: each element's loss, and each element's gradient.
    "vmap": lambda f, x: vmap(f)(torch.stack([x, 2 * x, -x])),
    "vmap(grad)": lambda f, x: vmap(grad(f))(torch.stack([x, 2 * x, -x])),
}


def check_transforms_match_torch(device):
    for name, (ours, theirs) in cases(device).items():
        x = torch.randn(ROWS, CLASSES, dtype=torch.float64, device=device)
        for transform_name, transform in TRANSFORMS.items():
            got, expected = transform(ours, x), transform(theirs, x)
            for got_part, expected_part in zip(torch.utils._pytree.tree_flatten(got)[0],
                                               torch.utils._pytree.tree_flatten(expected)[0]):
                torch.testing.assert_close(got_part, expected_part, rtol=1e-10, atol=1e-12,
                                           msg=lambda message: f"{name} under {transform_name}: {message}")


def test_transforms_match_torch_on_cpu():
    check_transforms_match_torch("cpu")


@pytest.mark.gpu
def test_transforms_match_torch_on_cuda_in_strict_mode():
    """conftest sets FUSED_LOSSES_STRICT=1: a transform is a fallback it allows."""
    check_transforms_match_torch("cuda")


@pytest.mark.gpu
def test_kernels_still_run_outside_a_transform():
    """Strict mode still refuses other fallbacks: the detection is the transform's alone."""
    logits = torch.randn(ROWS, CLASSES, device="cuda").requires_grad_()
    target = torch.randint(0, CLASSES, (ROWS,), device="cuda", dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="FUSED_LOSSES_STRICT"):
        losses.cross_entropy(logits, target)
