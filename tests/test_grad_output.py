"""Gradients beyond loss.backward(), every loss (GPU unless noted): grad_output other than
one (a scalar loss's gradient is written in the forward pass and scaled by grad_output in
backward: the case that gets it wrong), create_graph, a second backward, .grad without a
copy, forward-mode AD."""
import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD

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
