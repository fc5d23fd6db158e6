"""Gradients beyond loss.backward(), every loss (GPU unless noted): grad_output other than
one (a scalar loss's gradient is written in the forward pass and scaled by grad_output in
backward: the case that gets it wrong), create_graph, a second backward, .grad without a
copy, forward-mode AD."""
import itertools
import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import loss_helpers
import losses
from helpers import FLOOR, LOSSES, backwards_on_threads, check_against_float64, max_ulps, rel_err

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


# ----------------------------------------------------------------------------------
# Second derivatives (backward(create_graph=True): MAML, gradient penalties, Hessian-vector
# products): the gradient is recomputed by torch's formula as a graph, so a derivative of it
# equals torch's. The eager node holds the operands weakly: freed ones raise, clearly.

CREATE_GRAPH_CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions]


def second_derivatives(loss_fn, inputs, grad_of):
    """The gradients (with create_graph) and a Hessian-vector product through them."""
    leaves = [t.detach().requires_grad_(i in grad_of) for i, t in enumerate(inputs)]
    wrt = [leaves[i] for i in grad_of]
    loss = loss_fn(*leaves)
    grad_output = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).reshape(loss.shape)
    grads = torch.autograd.grad(loss, wrt, grad_output, create_graph=True)
    directions = [torch.randn_like(g) for g in grads]
    products = torch.autograd.grad(sum((g * d).sum() for g, d in zip(grads, directions)), wrt, allow_unused=True)
    return [g.detach() for g in grads], [torch.zeros_like(w) if h is None else h for h, w in zip(products, wrt)]


def check_second_derivatives_match_torch(name, reduction, device):
    loss = LOSSES[name]
    inputs = loss.inputs(7, 100, torch.float64, device)
    torch.manual_seed(0)
    ours = second_derivatives(loss.fused(reduction), inputs, loss.grad_of)
    torch.manual_seed(0)
    theirs = second_derivatives(loss.reference(reduction), inputs, loss.grad_of)
    for mine, torchs in zip(ours, theirs):
        for a, b in zip(mine, torchs):
            torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("name,reduction", CREATE_GRAPH_CASES, ids=str)
def test_second_derivatives_match_torch_on_cpu_models(name, reduction, kernels_modelled_on_cpu):
    check_second_derivatives_match_torch(name, reduction, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", CREATE_GRAPH_CASES, ids=str)
def test_second_derivatives_match_torch(name, reduction):
    check_second_derivatives_match_torch(name, reduction, "cuda")


@pytest.mark.gpu
def test_create_graph_through_a_freed_input_raises_clearly():
    leaf = torch.randn(7, 100, device="cuda", requires_grad=True)
    loss = LOSSES["mse_loss"].fused("sum")(leaf * 2, torch.randn(7, 100, device="cuda"))  # leaf * 2 is freed
    with pytest.raises(RuntimeError, match="input, which is no longer alive"):
        torch.autograd.grad(loss, leaf, create_graph=True)


# ----------------------------------------------------------------------------------
# The eager node of a scalar loss (kernels/autograd_node.h): it hands on the gradient the
# forward wrote, once.

SCALAR_CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions
                if reduction != "none"]


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", SCALAR_CASES, ids=str)
def test_backward_again_with_retain_graph_matches_torch(name, reduction):
    """retain_graph=True: a second backward (here with another grad_output) gives torch's
    gradients; a third, after one without retain_graph, raises as torch does."""
    inputs = LOSSES[name].inputs(7, 1000, torch.float32)

    def two_backwards(loss_fn):
        leaf = inputs[0].detach().clone().requires_grad_()
        loss = loss_fn(leaf, *inputs[1:])
        loss.backward(retain_graph=True)
        first = leaf.grad.clone()
        loss.backward(torch.tensor(0.5, device=loss.device, dtype=loss.dtype))
        return loss, first, leaf.grad

    loss, *ours = two_backwards(LOSSES[name].fused(reduction))
    _, *theirs = two_backwards(LOSSES[name].reference(reduction))
    for mine, torchs in zip(ours, theirs):
        torch.testing.assert_close(mine, torchs)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_concurrent_backwards_of_one_graph(name):
    """Backwards of a retained graph on 8 threads at once each get their own gradient, as from
    torch's nodes; without retain_graph one thread gets the gradient and the others raise."""
    inputs = LOSSES[name].inputs(64, 1000, torch.float32)
    leaf = inputs[0].requires_grad_()
    reference = LOSSES[name].reference("sum")(*inputs)
    scales = [torch.tensor(2.0 ** k + k, device="cuda") for k in range(8)]
    loss = LOSSES[name].fused("sum")(*inputs)
    for _ in range(5):
        for got, scale in zip(backwards_on_threads(loss, leaf, scales, retain_graph=True), scales):
            torch.testing.assert_close(got, torch.autograd.grad(reference, leaf, scale, retain_graph=True)[0])
    outcomes = backwards_on_threads(LOSSES[name].fused("sum")(*inputs), leaf, scales, retain_graph=False)
    errors = [outcome for outcome in outcomes if isinstance(outcome, RuntimeError)]
    assert len(errors) == 7, errors
    assert all("second time" in str(error) for error in errors), errors


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_gradient_becomes_grad_without_a_copy(name):
    """backward allocates nothing the size of the input: the gradient written in the
    forward pass becomes .grad itself."""
    inputs = LOSSES[name].inputs(512, 1000, torch.float32)
    leaf = inputs[0].requires_grad_()
    loss = LOSSES[name].fused("sum")(*inputs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < leaf.numel() * leaf.element_size()
    assert loss.grad_fn.name() == "FusedLossBackward"


# ----------------------------------------------------------------------------------
# The forward's guess at grad_output (kernels/grad_output_guess.cuh): the last one this
# loss's backward saw on the stream, which spares backward a pass over the gradient when
# it comes true ((loss / 8).backward(), a GradScaler). Right or wrong, the gradient is torch's.

SCALES = [1.0, 0.125, 0.125, 3.0, 3.0, 2.0**15, 2.0**15, 0.0, 1.0, -1.0, -1.0, 2.0**-30, 2.0**-30, 0.375, 1.0]


def recorded_guess(loss: torch.Tensor) -> float:
    """The factor the loss's forward multiplied its gradients by, kept beside the loss."""
    pair = torch.empty(0, dtype=loss.dtype, device=loss.device)
    return pair.set_(loss.untyped_storage(), loss.storage_offset(), (2,), (1,))[1].item()


def usable_guess(grad_output: float, dtype: torch.dtype) -> float:
    """kernels/grad_output_guess.cuh, grad_output_guess: what a forward takes from the last grad_output."""
    mantissa, exponent = math.frexp(abs(grad_output))
    return grad_output if dtype != torch.float16 and mantissa == 0.5 and -23 <= exponent <= 1 else 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,reduction", SCALAR_CASES, ids=str)
def test_guessed_grad_output_gives_torchs_gradient(name, reduction, dtype):
    """Steps whose grad_output repeats (the guess comes true) or changes (it does not), with
    guesses the forward must refuse (0, 3, tiny ones, float16's): the gradient is torch's, and
    the same bits as without a guess (the compiled graphs' path, which makes none)."""
    loss = LOSSES[name]
    inputs = loss.inputs(7, 1000, dtype)
    previous = None
    for scale in SCALES:
        grad_output = torch.tensor(scale, dtype=dtype, device="cuda")  # as the dtype holds it
        leaves = [t.detach().requires_grad_(i in loss.grad_of) for i, t in enumerate(inputs)]
        ours = loss.fused(reduction)(*leaves)
        if previous is not None:
            assert recorded_guess(ours) == usable_guess(previous, dtype), (scale, previous)
        ours.backward(grad_output)
        unguessed = [t.detach().requires_grad_(i in loss.grad_of) for i, t in enumerate(inputs)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loss_helpers, "is_compiling", lambda: True)  # the Python Functions, as compiled graphs
            loss.fused(reduction)(*unguessed).backward(grad_output)
        for i in loss.grad_of:
            assert torch.equal(leaves[i].grad, unguessed[i].grad), (scale, i)
        truth_leaves = [t.detach().double().requires_grad_(i in loss.grad_of) if t.is_floating_point() else t
                        for i, t in enumerate(inputs)]
        loss.reference(reduction)(*truth_leaves).backward(grad_output.double())
        if dtype == torch.float16 and abs(scale) > 1:
            previous = grad_output.item()
            continue  # float16's gradient is rounded before a scale up (README, Limits): torch's is not
        for i in loss.grad_of:
            mine, truth = leaves[i].grad, truth_leaves[i].grad
            if dtype in (torch.float16, torch.bfloat16):  # rounded, then scaled: twice
                assert max_ulps(mine, truth) <= 2, (scale, i)
            else:
                assert rel_err(mine, truth) <= 2 * FLOOR[dtype], (scale, i)
        previous = grad_output.item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_loss_scale_is_not_guessed_where_it_could_overflow(dtype):
    """After a backward from 2^24, a gradient of 2^106 (MSE of inputs 2^105 apart) backward from 1:
    torch's is finite, and so is ours (a guess of 2^24 would have written inf in the forward)."""
    x = torch.randn(4, 1000, device="cuda", dtype=dtype)
    for scale, gap in ((2.0**24, 1.0), (1.0, 2.0**105)):
        grads = []
        for mse_loss in (losses.mse_loss, torch.nn.functional.mse_loss):
            leaf = x.detach().requires_grad_()
            loss = mse_loss(leaf, x + gap, reduction="sum")
            loss.backward(torch.tensor(scale, device="cuda", dtype=loss.dtype))
            grads.append(leaf.grad)
        assert torch.isfinite(grads[0]).all()
        torch.testing.assert_close(*grads)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_two_calls_scaled_differently_in_one_backward(name):
    """Two calls of one loss whose backwards bring different grad_outputs, step after step:
    each backward divides out the guess its own forward made."""
    loss = LOSSES[name]
    reduction = loss.reductions[0]
    first, second = loss.inputs(7, 1000, torch.float32), loss.inputs(7, 1000, torch.float32)
    for _ in range(4):
        grads = []
        for fn in (loss.fused(reduction), loss.reference(reduction)):
            a = [t.detach().requires_grad_(i in loss.grad_of) for i, t in enumerate(first)]
            b = [t.detach().requires_grad_(i in loss.grad_of) for i, t in enumerate(second)]
            (0.25 * fn(*a) + 3.0 * fn(*b)).backward()
            grads.append([a[i].grad for i in loss.grad_of] + [b[i].grad for i in loss.grad_of])
        for mine, torchs in zip(*grads):
            torch.testing.assert_close(mine, torchs)


# ----------------------------------------------------------------------------------
# Forward-mode AD: the kernels carry no tangents, so inside a dual level torch runs (an
# output without its tangent would be a silent wrong answer); strict mode says so.

@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", CREATE_GRAPH_CASES, ids=str)
def test_forward_mode_ad_runs_torch(name, reduction, monkeypatch):
    loss = LOSSES[name]
    inputs = loss.inputs(7, 100, torch.float32)
    tangent = torch.randn_like(inputs[0])
    with fwAD.dual_level():
        dual = [fwAD.make_dual(inputs[0], tangent), *inputs[1:]]
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            loss.fused(reduction)(*dual)
        monkeypatch.delenv("FUSED_LOSSES_STRICT")
        ours = fwAD.unpack_dual(loss.fused(reduction)(*dual))
        theirs = fwAD.unpack_dual(loss.reference(reduction)(*dual))
    assert ours.tangent is not None
    torch.testing.assert_close(ours.primal, theirs.primal)
    torch.testing.assert_close(ours.tangent, theirs.tangent)
