"""Scalar losses launched on several CUDA streams at once (GPU).

A scalar loss is finished by the last block of its own kernel, which it finds with a
counter kept per stream: launches on one stream never overlap, launches on two may. Here
four streams run their own inputs (each shape a different grid) at the same time, round
after round without waiting, and every loss and gradient must be bit for bit what the same
call gives alone on the default stream.
"""
import pytest
import torch

from helpers import LOSSES, loss_and_grads, poison_allocator

STREAMS = 4
ROUNDS = 5
CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions if reduction != "none"]


@pytest.mark.gpu
@pytest.mark.parametrize("with_grad", [True, False], ids=["training step", "forward"])
@pytest.mark.parametrize("name,reduction", CASES)
def test_concurrent_streams_match_one_stream(name, reduction, with_grad):
    loss = LOSSES[name]
    fused = loss.fused(reduction)
    # Big enough that each kernel runs for tens of microseconds, so the streams' kernels
    # overlap; rows differ, so the grids do.
    inputs = [loss.inputs(1536 + 257 * s, 4099, torch.float32) for s in range(STREAMS)]

    def step(stream_inputs):
        if with_grad:
            return loss_and_grads(fused, stream_inputs, loss.grad_of)
        with torch.no_grad():
            return fused(*stream_inputs), []

    alone = [step(stream_inputs) for stream_inputs in inputs]
    torch.cuda.synchronize()

    streams = [torch.cuda.Stream() for _ in range(STREAMS)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = [[] for _ in range(STREAMS)]
    for _ in range(ROUNDS):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                # The next small block of this stream's pool holds NaN: a loss its kernel
                # failed to write shows as NaN, not as an earlier round's value.
                poison_allocator(torch.empty((), device="cuda"))
                results[s].append(step(inputs[s]))
    torch.cuda.synchronize()

    for s in range(STREAMS):
        expected_loss, expected_grads = alone[s]
        for round_, (got_loss, got_grads) in enumerate(results[s]):
            where = f"stream {s}, round {round_}"
            assert torch.equal(got_loss, expected_loss), f"{where}: loss {got_loss} != {expected_loss}"
            for index, got, expected in zip(loss.grad_of, got_grads, expected_grads):
                assert torch.equal(got, expected), f"{where}: gradient of input {index} differs"


CUDA_STREAM_PER_THREAD = 0x2  # the runtime's cudaStreamPerThread handle


@pytest.mark.gpu
@pytest.mark.parametrize("name,reduction", CASES)
def test_per_thread_default_stream(name, reduction):
    """On cudaStreamPerThread the loss is finished by a kernel of its own (no counter for a
    handle that names another stream in each thread): the same loss as on the default stream.
    (Forward only: torch's autograd runs backward on its own thread, where that handle names
    yet another stream.)"""
    loss = LOSSES[name]
    fused = loss.fused(reduction)
    inputs = loss.inputs(1536, 4099, torch.float32)
    with torch.no_grad():
        expected = fused(*inputs)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.ExternalStream(CUDA_STREAM_PER_THREAD)):
            poison_allocator(torch.empty((), device="cuda"))
            got = fused(*inputs)
            torch.cuda.current_stream().synchronize()
    torch.testing.assert_close(got, expected)
