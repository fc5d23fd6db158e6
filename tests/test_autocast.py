"""Under CUDA autocast every loss behaves as torch's does there: a float32 loss, and
gradients that a loss scale of 2**16 (GradScaler's) reaches before they are rounded.

torch runs these losses in float32 under autocast. Ours casts float16 operands to
float32 as torch does; bfloat16 operands of a scalar loss reach the kernel as they are
and the kernel writes the loss in float32 (loss_helpers.autocast_operands says why).
"""
import types

import pytest
import torch
import torch.nn.functional as F

import loss_helpers
import losses
from helpers import FLOOR, LOSSES, check_against_float64, loss_and_grads, max_ulps

LOSS_SCALE = 2.0 ** 16  # GradScaler's initial scale


def under_autocast(fn, dtype):
    def run(*inputs):
        with torch.autocast("cuda", dtype=dtype):
            return fn(*inputs)
    return run


# ----------------------------------------------------------------------------------
# CPU (CI): what reaches the kernel ops, with the ops modelled in Python and autocast
# taken as on.

@pytest.fixture
def forward_calls(kernels_modelled_on_cpu, monkeypatch):
    """Every forward op call's arguments, in order; CPU tensors count as under autocast."""
    calls = []
    unspied = loss_helpers.kernel_ops

    def spied(kernel, device):
        ops = unspied(kernel, device)

        def forward(*args):
            calls.append((kernel, args))
            return ops.forward(*args)
        return types.SimpleNamespace(**{**vars(ops), "forward": forward})
    monkeypatch.setattr(loss_helpers, "kernel_ops", spied)
    monkeypatch.setattr(loss_helpers, "under_autocast", lambda tensor: True)
    return calls


def what_the_op_got(kernel, args):
    """(dtype of the first operand, float_loss) of a forward op call."""
    float_loss_at = 5 if kernel == "cross_entropy" else 4  # after the reduction's arguments
    return args[0].dtype, args[float_loss_at]


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("dtype,reduction,kernel_dtype,float_loss", [
    (torch.bfloat16, "sum", torch.bfloat16, True),    # the fast path: bf16 in, float32 loss out
    (torch.float16, "sum", torch.float32, False),     # torch's way: cast to float32
    (torch.bfloat16, "none", torch.float32, False),   # a per-element loss: torch's way
    (torch.float32, "sum", torch.float32, False),     # nothing to cast
], ids=str)
def test_what_reaches_the_kernel_under_autocast(name, dtype, reduction, kernel_dtype, float_loss, forward_calls):
    x, *others = LOSSES[name].inputs(6, 10, dtype, "cpu")
    x.requires_grad_()
    loss = LOSSES[name].fused(reduction)(x, *others)
    (kernel, args), = forward_calls
    assert what_the_op_got(kernel, args) == (kernel_dtype, float_loss)
    assert loss.dtype == torch.float32
    loss.sum().mul(2.5).backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


def test_a_float32_weight_with_bfloat16_logits_is_computed_in_float32(forward_calls):
    """torch's autocast casts every operand to float32; the kernel takes one dtype."""
    logits = torch.randn(6, 10, dtype=torch.bfloat16)
    losses.cross_entropy(logits, torch.randint(0, 10, (6,)), weight=torch.rand(10))
    (kernel, args), = forward_calls
    assert what_the_op_got(kernel, args) == (torch.float32, False)


@pytest.mark.parametrize("grad_output", [1 / 3, 0.1])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_float32_grad_output_reaches_a_bfloat16_gradient_before_its_one_rounding(name, grad_output,
                                                                                    forward_calls):
    check_one_rounding(name, grad_output, "cpu", LOSSES[name].fused("sum"))


def check_one_rounding(name, grad_output, device, fused):
    """Autocast's loss is float32, and so is its grad_output: torch multiplies the float32 gradient by it
    and rounds to bfloat16 once, 0.5 ulp from float64. Ours too: the forward keeps its operands and
    backward recomputes the gradient with grad_output (rounding the forward's bfloat16 gradient again
    would give up to 1.5 ulp). The same bits whatever backward ran before: 1, a guess below 1 (2^-20),
    grad_output itself."""
    x, *others = LOSSES[name].inputs(64, 100, torch.bfloat16, device)
    truth = x.double().requires_grad_()
    LOSSES[name].reference("sum")(truth, *[t.double() if t.is_floating_point() else t for t in others]).backward(
        torch.tensor(grad_output, dtype=torch.float64, device=device))
    grads = []
    for before in (1.0, 2.0**-20, grad_output):
        fused(x.detach().requires_grad_(), *others).backward(torch.tensor(before, device=device))
        leaf = x.detach().requires_grad_()
        fused(leaf, *others).backward(torch.tensor(grad_output, device=device))
        assert max_ulps(leaf.grad, truth.grad) <= 0.5, before
        grads.append(leaf.grad)
    assert all(torch.equal(grad, grads[0]) for grad in grads[1:])


@pytest.mark.parametrize("name", list(LOSSES))
def test_an_input_modified_after_the_loss_raises_in_backward(name, forward_calls):
    """The input kept for the recompute is checked as torch checks a saved tensor."""
    leaf, *others = LOSSES[name].inputs(6, 10, torch.bfloat16, "cpu")
    input = leaf.requires_grad_() * 1
    loss = LOSSES[name].fused("sum")(input, *others)
    with torch.no_grad():
        input.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward(torch.tensor(0.1))


def test_outside_autocast_nothing_changes(kernels_modelled_on_cpu):
    x = torch.randn(6, 10, dtype=torch.bfloat16)
    assert losses.mse_loss(x, torch.randn_like(x)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------
# GPU: the real kernels against torch under autocast, backward from a loss scale.

GPU_CASES = [(name, reduction, dtype)
             for name, loss in LOSSES.items()
             for reduction in loss.reductions
             for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction,dtype", GPU_CASES, ids=str)
def test_matches_torch_under_autocast_with_a_loss_scale(name, reduction, dtype):
    loss = LOSSES[name]
    inputs = loss.inputs(67, 1000, dtype)
    # A mean's gradient is small enough for GradScaler's scale; a sum's would overflow
    # float16 with it (torch's as well): 8 there. 'none': random per element.
    grad_output = {"mean": LOSS_SCALE, "batchmean": LOSS_SCALE, "sum": 8.0}.get(reduction)
    grad_output = None if grad_output is None else torch.tensor(grad_output)
    ours_errors, eager_errors = check_against_float64(
        under_autocast(loss.fused(reduction), dtype), under_autocast(loss.reference(reduction), dtype), inputs,
        grad_of=loss.grad_of, grad_output=grad_output, case=name)
    # The loss is float32 on both sides: held to float32's floor, not the inputs' dtype's.
    for ours_loss_error in ours_errors[:2]:  # with grad, and without
        assert ours_loss_error <= max(eager_errors[0], FLOOR[torch.float32]), (name, ours_loss_error, eager_errors[0])


@pytest.mark.gpu
def test_float16_softmax_gradient_is_not_flushed_before_the_loss_scale():
    """Most dlogits of a wide softmax, (p - onehot) / N, are below float16's smallest
    subnormal until the loss scale multiplies them: rounded first, they would be 0."""
    logits = torch.randn(512, 8192, device="cuda").mul(2).half()
    target = torch.randint(0, 8192, (512,), device="cuda")
    grads = []
    for fn in (F.cross_entropy, losses.cross_entropy):
        _, (grad,) = loss_and_grads(under_autocast(fn, torch.float16), [logits, target], (0,),
                                    torch.tensor(LOSS_SCALE, device="cuda"))
        grads.append(grad)
    torch_zeros, ours_zeros = [(grad == 0).float().mean().item() for grad in grads]
    assert ours_zeros <= torch_zeros + 1e-3, (ours_zeros, torch_zeros)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("grad_output", [1 / 3, 0.1])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_float32_grad_output_reaches_a_bfloat16_gradient_before_its_one_rounding_on_the_gpu(name, grad_output,
                                                                                               compiled):
    fused = under_autocast(LOSSES[name].fused("sum"), torch.bfloat16)
    check_one_rounding(name, grad_output, "cuda", torch.compile(fused, fullgraph=True) if compiled else fused)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_wrong_guess_below_1_costs_tiny_gradients_no_bits(compiled):
    """After a backward at 2^-20 the forward guesses it: tiny gradients times 2^-20 fall below
    2^-126, where bfloat16 keeps fewer bits. Backward at 1 recomputes them, exact."""
    fused = under_autocast(losses.mse_loss, torch.bfloat16)
    if compiled:
        fused = torch.compile(fused, fullgraph=True)
    x = (torch.rand(64, 100, device="cuda") * 2.0**-100).bfloat16()  # gradients 2x / n near 2^-112
    y = torch.zeros_like(x)
    fused(x.detach().requires_grad_(), y).backward(torch.tensor(2.0**-20, device="cuda"))
    leaf = x.detach().requires_grad_()
    fused(leaf, y).backward(torch.tensor(1.0, device="cuda"))
    assert max_ulps(leaf.grad, 2 * x.double() / x.numel()) <= 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_kept_operands_go_with_the_first_backward_and_a_retained_graph_recomputes_each_time(name):
    """The operands a bfloat16 loss keeps for its recompute live until the backward that keeps no graph."""
    import weakref
    fused = under_autocast(LOSSES[name].fused("mean"), torch.bfloat16)
    leaf, *others = LOSSES[name].inputs(64, 100, torch.bfloat16, "cuda")
    leaf.requires_grad_()
    input = leaf * 1  # the operand the loss keeps, held by nothing else
    kept = weakref.ref(input)
    loss = fused(input, *others)
    del input
    assert kept() is not None
    grads = []
    for grad_output in (0.1, 1 / 3):
        loss.backward(torch.tensor(grad_output, device="cuda"), retain_graph=True)
        grads.append(leaf.grad)
        leaf.grad = None
        assert kept() is not None
    loss.backward(torch.tensor(0.1, device="cuda"))
    assert kept() is None
    assert torch.equal(leaf.grad, grads[0])
    assert not torch.equal(grads[0], grads[1])
