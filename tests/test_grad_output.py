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
# A gradient that will be differentiated again (backward(create_graph=True): MAML, gradient
# penalties) cannot come from a kernel that wrote it with no graph: a clear error, never a
# second derivative that silently treats it as a constant.

CREATE_GRAPH_CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in ("sum", "none")]


def check_create_graph_raises(loss_fn, inputs):
    leaf = inputs[0].detach().requires_grad_()
    loss = loss_fn(leaf, *inputs[1:]).sum()
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, leaf, create_graph=True)


@pytest.mark.parametrize("name,reduction", CREATE_GRAPH_CASES, ids=str)
def test_create_graph_raises_on_cpu_models(name, reduction, kernels_modelled_on_cpu):
    check_create_graph_raises(LOSSES[name].fused(reduction), LOSSES[name].inputs(7, 100, torch.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", CREATE_GRAPH_CASES, ids=str)
def test_create_graph_raises(name, reduction):
    check_create_graph_raises(LOSSES[name].fused(reduction), LOSSES[name].inputs(7, 100, torch.float32))


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
