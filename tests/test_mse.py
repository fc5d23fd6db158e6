"""mse_loss / MSELoss: CPU behaviour (CI) and the fused kernel against float64 (GPU)."""
import types

import pytest
import torch
import torch.nn.functional as F

import losses
from helpers import DTYPES, check_against_float64, check_special_values_match_torch, raises_as_torch

REDUCTIONS = ["mean", "sum", "none"]


def reference(input, target, reduction="mean"):
    return F.mse_loss(input, target, reduction=reduction)


# ----------------------------------------------------------------------------------
# CPU (runs everywhere, CI included).

@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cpu_matches_torch(reduction):
    x, y = torch.randn(5, 7, requires_grad=True), torch.randn(5, 7, requires_grad=True)
    ours = losses.mse_loss(x, y, reduction=reduction)
    torch.testing.assert_close(ours, F.mse_loss(x, y, reduction=reduction))
    ours.sum().backward()
    assert x.grad is not None and y.grad is not None


def test_module_and_legacy_arguments_match_torch():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    for kwargs in ({}, {"reduction": "sum"}, {"reduction": "none"}, {"size_average": False}, {"reduce": False}):
        torch.testing.assert_close(losses.MSELoss(**kwargs)(x, y), torch.nn.MSELoss(**kwargs)(x, y))
    torch.testing.assert_close(losses.mse_loss(x, y, False), F.mse_loss(x, y, False))


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="reduction must be one of"):
        losses.mse_loss(x, x, reduction="batchmean")
    with pytest.raises(ValueError, match="target is on meta"):
        losses.mse_loss(x, torch.empty(3, device="meta"))


TORCH = types.SimpleNamespace(mse_loss=F.mse_loss, MSELoss=torch.nn.MSELoss)


@pytest.mark.parametrize("case,call", [
    ("target on another device", lambda m, x: m.mse_loss(x, x.to("meta"))),
    ("input on another device", lambda m, x: m.mse_loss(x.to("meta"), x)),
    ("shapes that do not broadcast", lambda m, x: m.mse_loss(x, x[:, :4])),
    ("weight of another shape", lambda m, x: m.mse_loss(x, x, weight=torch.ones(4))),  # torch: ValueError
    ("reduction", lambda m, x: m.mse_loss(x, x, reduction="batchmean")),  # torch: ValueError
    ("module, reduction", lambda m, x: m.MSELoss(reduction="batchmean")(x, x)),
])
def test_bad_calls_raise_what_torch_raises(case, call):
    x = torch.randn(6, 5)
    raises_as_torch(lambda: call(losses, x), lambda: call(TORCH, x))


@pytest.mark.parametrize("name", ["input", "target", "weight"])
def test_a_non_tensor_gets_a_type_error_that_names_it(name):
    """As torch's cross_entropy and kl_div do (its mse_loss, Python code, raises AttributeError)."""
    arguments = dict(input=torch.randn(6, 5), target=torch.randn(6, 5), weight=torch.ones(6, 5))
    arguments[name] = arguments[name].tolist()
    with pytest.raises(TypeError, match=f"mse_loss: {name} must be a Tensor, got list"):
        losses.mse_loss(**arguments)


# ----------------------------------------------------------------------------------
# GPU: the fused kernel against torch in float64.

# Each case hits one regime of the kernel. Built on the GPU, so views stay views.
def randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=dtype)


SHAPES = {
    "one row, odd length (vector body + scalar tail)": lambda dtype: randn(1, 4099, dtype=dtype),
    "7x1000": lambda dtype: randn(7, 1000, dtype=dtype),
    "3-D batch": lambda dtype: randn(4, 33, 77, dtype=dtype),
    "non-contiguous view (stride 2)": lambda dtype: randn(64, 260, dtype=dtype)[:, ::2],
    "misaligned view (no 16-byte vectors)": lambda dtype: randn(3003, dtype=dtype)[1:3001].view(2, 1500),
    "single element": lambda dtype: randn(dtype=dtype),
}


def make_inputs(case, dtype):
    return [SHAPES[case](dtype), SHAPES[case](dtype)]


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
def test_matches_float64(case, dtype, reduction):
    inputs = make_inputs(case, dtype)
    check_against_float64(lambda x, y: losses.mse_loss(x, y, reduction=reduction),
                          lambda x, y: reference(x, y, reduction), inputs, grad_of=(0, 1), case=case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seed_shape(dtype):
    """The seeds' workload: 32768 x 32768 (2^30 elements)."""
    inputs = [torch.randn(32768, 32768, device="cuda", dtype=dtype) for _ in range(2)]
    check_against_float64(losses.mse_loss, reference, inputs, grad_of=(0,), case="32768x32768")


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [((4, 3), (3,)), ((4, 1), (4, 5)), ((), (6,)), ((2, 1, 5), (3, 1))], ids=str)
def test_broadcasting_matches_float64_with_torchs_warning(shapes):
    inputs = [randn(*shapes[0], dtype=torch.float32), randn(*shapes[1], dtype=torch.float32)]
    for reduction in REDUCTIONS:
        with pytest.warns(UserWarning, match="different to the input size"):
            check_against_float64(lambda x, y: losses.mse_loss(x, y, reduction=reduction),
                                  lambda x, y: reference(x, y, reduction), inputs, grad_of=(0, 1), case=str(shapes))


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.bfloat16, torch.float16),
                                    (torch.float32, torch.float64)], ids=str)
def test_mixed_dtypes_promote_like_torch(dtypes):
    """torch computes in the promoted dtype (its own backward of mixed dtypes fails, so the
    reference casts first, as its forward does)."""
    inputs = [randn(7, 1000, dtype=dtypes[0]), randn(7, 1000, dtype=dtypes[1])]

    def promoted(x, y, reduction):
        dtype = torch.promote_types(x.dtype, y.dtype)
        return reference(x.to(dtype), y.to(dtype), reduction)

    for reduction in REDUCTIONS:
        check_against_float64(lambda x, y: losses.mse_loss(x, y, reduction=reduction),
                              lambda x, y: promoted(x, y, reduction), inputs, grad_of=(0, 1), case=str(dtypes))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_and_inf_match_torch(reduction, dtype):
    special = [float("nan"), float("inf"), -float("inf"), 0.0, 1.5, float("inf")]
    x = torch.tensor(special + [0.5] * 10, device="cuda", dtype=dtype)
    y = torch.tensor([1.0, 2.0, 3.0, 0.0, float("inf"), float("inf")] + [0.25] * 10, device="cuda", dtype=dtype)
    check_special_values_match_torch(lambda a, b: losses.mse_loss(a, b, reduction=reduction),
                                     lambda a, b: reference(a, b, reduction), [x, y], grad_of=(0, 1))


@pytest.mark.gpu
def test_unfused_combination_falls_back_only_outside_strict_mode(monkeypatch):
    """mse_loss's weight (torch 2.6+) is not fused: torch runs it, except in strict mode."""
    if "weight" not in F.mse_loss.__code__.co_varnames:
        pytest.skip(f"torch {torch.__version__} has no mse_loss weight")
    x, y, w = torch.randn(4, 3, device="cuda"), torch.randn(4, 3, device="cuda"), torch.rand(4, 3, device="cuda")
    with pytest.raises(RuntimeError, match="weight is not fused yet"):
        losses.mse_loss(x, y, weight=w)
    monkeypatch.delenv("FUSED_LOSSES_STRICT")
    torch.testing.assert_close(losses.mse_loss(x, y, weight=w), F.mse_loss(x, y, weight=w))
