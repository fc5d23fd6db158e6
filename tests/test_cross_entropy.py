"""cross_entropy / CrossEntropyLoss: CPU behaviour (CI) and the fused kernel against float64 (GPU)."""
import pytest
import torch
import torch.nn.functional as F

import losses
from helpers import DTYPES, check_against_float64

REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100


def reference(logits, target, reduction="mean", ignore_index=IGNORE):
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def class_targets(logits, index_dtype=torch.int64, ignored_fraction=0.25, ignore_index=IGNORE):
    """Class indices for logits with classes in dim 1 (dim 0 for 1-D), some set to
    ignore_index, never all of them (that case has its own test)."""
    num_classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    shape = (logits.shape[0],) + tuple(logits.shape[2:]) if logits.dim() > 1 else ()
    target = torch.randint(0, num_classes, shape, device=logits.device)
    if target.dim():
        ignored = torch.rand(shape, device=logits.device) < ignored_fraction
        ignored.view(-1)[0] = False
        target[ignored] = ignore_index
    return target.to(index_dtype)


# ----------------------------------------------------------------------------------
# CPU (runs everywhere, CI included).

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(6, 5), (5,), (3, 4, 2, 2)], ids=str)
def test_cpu_matches_torch(shape, reduction):
    logits = torch.randn(*shape, requires_grad=True)
    target = class_targets(logits)
    ours = losses.cross_entropy(logits, target, reduction=reduction)
    torch.testing.assert_close(ours, reference(logits, target, reduction))
    ours.sum().backward()
    assert logits.grad is not None


def test_cpu_unfused_arguments_match_torch():
    logits, weight = torch.randn(6, 5), torch.rand(5)
    target = class_targets(logits, ignored_fraction=0)
    soft_target = torch.randn(6, 5).softmax(-1)
    torch.testing.assert_close(losses.cross_entropy(logits, target, weight=weight),
                               F.cross_entropy(logits, target, weight=weight))
    torch.testing.assert_close(losses.cross_entropy(logits, target, label_smoothing=0.1),
                               F.cross_entropy(logits, target, label_smoothing=0.1))
    torch.testing.assert_close(losses.cross_entropy(logits, soft_target), F.cross_entropy(logits, soft_target))


def test_module_and_legacy_arguments_match_torch():
    logits = torch.randn(6, 5)
    target = class_targets(logits, ignore_index=1)
    for kwargs in ({}, {"reduction": "sum"}, {"ignore_index": 1}, {"reduce": False}, {"label_smoothing": 0.2}):
        torch.testing.assert_close(losses.CrossEntropyLoss(**kwargs)(logits, target),
                                   torch.nn.CrossEntropyLoss(**kwargs)(logits, target))


def test_bad_arguments_raise_clear_errors():
    logits = torch.randn(6, 5)
    with pytest.raises(ValueError, match=r"target must have shape \(6,\)"):
        losses.cross_entropy(logits, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        losses.cross_entropy(torch.tensor(1.0), torch.tensor(0))
    with pytest.raises(ValueError, match="reduction must be one of"):
        losses.cross_entropy(logits, class_targets(logits), reduction="batchmean")
    with pytest.raises(ValueError, match="target is on meta"):
        losses.cross_entropy(logits, torch.zeros(6, dtype=torch.int64, device="meta"))


# ----------------------------------------------------------------------------------
# GPU: the fused kernel against torch in float64.

def randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).mul(2).to(dtype)


# Each case hits one regime of the kernel. Built on the GPU, so views stay views.
SHAPES = {
    "one row": lambda dtype: randn(1, 1000, dtype=dtype),
    "7x1000": lambda dtype: randn(7, 1000, dtype=dtype),
    "1-D input (C,), 0-dim target": lambda dtype: randn(1000, dtype=dtype),
    "3-D (N, C, d): classes in dim 1": lambda dtype: randn(4, 10, 7, dtype=dtype),
    "4-D (N, C, d1, d2)": lambda dtype: randn(2, 5, 3, 4, dtype=dtype),
    "non-contiguous (transposed) logits": lambda dtype: randn(1000, 7, dtype=dtype).t(),
    "odd C = 1001 (no 16-byte vectors)": lambda dtype: randn(9, 1001, dtype=dtype),
    "tiny C = 3, many rows": lambda dtype: randn(3000, 3, dtype=dtype),
    "row beyond the register cache (C = 40000, read twice)": lambda dtype: randn(5, 40000, dtype=dtype),
    "LLM vocabulary C = 128256": lambda dtype: randn(3, 128256, dtype=dtype),
}


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
def test_matches_float64(case, dtype, reduction, index_dtype):
    logits = SHAPES[case](dtype)
    target = class_targets(logits, index_dtype)
    # torch takes int32 class indices only from 2.x on some paths: compare with int64.
    check_against_float64(lambda x, t: losses.cross_entropy(x, t.to(index_dtype), reduction=reduction),
                          lambda x, t: reference(x, t.long(), reduction), [logits, target], case=case)


@pytest.mark.gpu
def test_ignore_index_inside_the_class_range():
    logits = SHAPES["7x1000"](torch.float32)
    target = class_targets(logits, ignored_fraction=0)
    target[::2] = 3
    check_against_float64(lambda x, t: losses.cross_entropy(x, t, ignore_index=3),
                          lambda x, t: reference(x, t, ignore_index=3), [logits, target])


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", [((32768, 4096), torch.float32), ((32768, 4096), torch.bfloat16),
                                        ((8192, 128256), torch.bfloat16)], ids=str)
def test_seed_shapes(case, dtype):
    """The seeds' 32768 x 4096, and an LLM's 8192 x 128256 in bf16."""
    logits = randn(*case, dtype=dtype)
    check_against_float64(losses.cross_entropy, reference, [logits, class_targets(logits, ignored_fraction=0.05)],
                          case=str(case))


@pytest.mark.gpu
def test_every_target_ignored_gives_torch_result():
    logits = SHAPES["7x1000"](torch.float32).requires_grad_()
    target = torch.full((7,), IGNORE, device="cuda")
    ours, theirs = losses.cross_entropy(logits, target), reference(logits, target)
    assert torch.isnan(ours) and torch.isnan(theirs)
    (grad,) = torch.autograd.grad(ours, logits)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.gpu
def test_out_of_range_target_gives_nan_and_leaves_cuda_usable():
    logits = SHAPES["7x1000"](torch.float32)
    target = class_targets(logits, ignored_fraction=0)
    target[2] = 1000
    per_row = losses.cross_entropy(logits, target, reduction="none")
    assert torch.isnan(per_row[2]) and torch.isfinite(per_row[[0, 1, 3, 4, 5, 6]]).all()
    torch.cuda.synchronize()  # the context still works


@pytest.mark.gpu
def test_unfused_arguments_fall_back_only_outside_strict_mode(monkeypatch):
    logits = SHAPES["7x1000"](torch.float32)
    target, weight = class_targets(logits), torch.rand(1000, device="cuda")
    with pytest.raises(RuntimeError, match="weight is not fused yet"):
        losses.cross_entropy(logits, target, weight=weight)
    monkeypatch.delenv("FUSED_LOSSES_STRICT")
    torch.testing.assert_close(losses.cross_entropy(logits, target, weight=weight),
                               F.cross_entropy(logits, target, weight=weight))


@pytest.mark.gpu
def test_backward_twice_with_retain_graph_raises_clearly():
    logits = SHAPES["7x1000"](torch.float32).requires_grad_()
    loss = losses.cross_entropy(logits, class_targets(logits))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through it twice"):
        loss.backward()
