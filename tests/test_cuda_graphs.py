"""Every loss, forward and backward, captured in a CUDA graph and replayed on new input
values (GPU). The losses must not sync with the host or allocate outside the graph's
pool, and a scalar loss's backward (which scales the gradient its forward wrote, in
place) must work on every replay.
"""
import pytest
import torch

from helpers import LOSSES, capture_step, loss_and_grads

CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,reduction", CASES)
def test_replay_on_new_inputs_matches_eager(name, reduction, dtype):
    loss = LOSSES[name]
    fused = loss.fused(reduction)
    static_inputs = [t.requires_grad_(i in loss.grad_of) for i, t in enumerate(loss.inputs(64, 1000, dtype))]
    probe = fused(*static_inputs).detach()
    # 2.5 for a scalar loss, so that backward really scales the gradient the forward wrote.
    grad_output = torch.full_like(probe, 2.5) if probe.dim() == 0 else torch.rand_like(probe) + 0.5
    graph, static_loss, static_grads = capture_step(fused, static_inputs, loss.grad_of, grad_output)

    for scale in (2.5, 0.125, 1.0):  # a scalar loss's grad_output changes between replays too
        new_inputs = loss.inputs(64, 1000, dtype)
        with torch.no_grad():
            for static, new in zip(static_inputs, new_inputs):
                static.copy_(new)
            if probe.dim() == 0:
                grad_output.fill_(scale)
        graph.replay()
        eager_loss, eager_grads = loss_and_grads(fused, new_inputs, loss.grad_of, grad_output)
        torch.testing.assert_close(static_loss, eager_loss)
        for index, static_grad, eager_grad in zip(loss.grad_of, static_grads, eager_grads):
            torch.testing.assert_close(static_grad, eager_grad, msg=lambda m: f"gradient of input {index}: {m}")
