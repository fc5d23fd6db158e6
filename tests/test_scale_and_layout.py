"""Sizes past 2^31 elements, every memory layout, and tensors on a GPU other than the
current one (GPU).

Past 2^31 elements any 32-bit index in a kernel wraps; the truth there is float64,
computed in chunks so that it fits next to the inputs.
"""
import math

import pytest
import torch

import losses
from helpers import FLOOR, LOSSES, check_against_float64, random_class_targets, random_logits

GIB = 1 << 30
CHUNK = 1 << 26  # elements of float64 truth at a time (512 MB)


def need_free_memory(gib: float) -> None:
    torch.cuda.empty_cache()  # blocks earlier tests left in torch's cache count as free here
    free, _ = torch.cuda.mem_get_info()
    if free < gib * GIB:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / GIB:.1f} GiB free")


def chunked_rel_err(value: torch.Tensor, truth_of) -> float:
    """||value - truth|| / ||truth|| over a flat tensor; truth_of(start, end) gives the
    float64 truth of value[start:end] (a tensor, or a float for a 1-element value)."""
    value = value.detach().reshape(-1)
    diff_sq = truth_sq = 0.0
    for start in range(0, value.numel(), CHUNK):
        end = min(start + CHUNK, value.numel())
        truth = torch.as_tensor(truth_of(start, end), dtype=torch.float64, device=value.device)
        diff_sq += (value[start:end].double() - truth).pow(2).sum().item()
        truth_sq += truth.pow(2).sum().item()
    return math.sqrt(diff_sq / truth_sq)


def assert_within_floor(name, error, dtype):
    assert error <= FLOOR[dtype], f"{name}: relative error {error:.3g} vs float64 exceeds {FLOOR[dtype]:.3g}"


# ----------------------------------------------------------------------------------
# More than 2^31 elements, bfloat16: loss and gradient against chunked float64.

@pytest.mark.gpu
def test_mse_past_2_to_the_31_elements():
    need_free_memory(20)  # x, y, grad of x: 4 GiB each; truth chunks
    n = 2**31 + 3  # odd: the scalar tail runs past 2^31 too
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16).requires_grad_()
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    loss = losses.mse_loss(x, y)
    loss.backward()

    def diff(start, end):
        return x.detach()[start:end].double() - y[start:end].double()

    truth_loss = sum(diff(s, min(s + CHUNK, n)).pow(2).sum().item() for s in range(0, n, CHUNK)) / n
    assert_within_floor("loss", abs(loss.item() - truth_loss) / truth_loss, torch.bfloat16)
    assert_within_floor("grad", chunked_rel_err(x.grad, lambda s, e: 2 * diff(s, e) / n), torch.bfloat16)


@pytest.mark.gpu
def test_kl_div_past_2_to_the_31_elements():
    need_free_memory(20)
    rows, cols = 2, 2**30 + 5  # 2^31 + 10 elements, batchmean divides by 2
    p = (torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) + 0.1).requires_grad_()
    q = torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) + 0.1
    loss = losses.kl_div(p, q, reduction="batchmean", log_input=False)
    loss.backward()
    flat_p, flat_q = p.detach().reshape(-1), q.reshape(-1)

    def terms(start, end):
        return flat_p[start:end].double(), flat_q[start:end].double()

    def pointwise_loss(start, end):
        pd, qd = terms(start, end)
        return qd * (qd.log() - pd.log())

    truth_loss = sum(pointwise_loss(s, min(s + CHUNK, p.numel())).sum().item()
                     for s in range(0, p.numel(), CHUNK)) / rows
    assert_within_floor("loss", abs(loss.item() - truth_loss) / abs(truth_loss), torch.bfloat16)

    def grad_truth(start, end):
        pd, qd = terms(start, end)
        return -qd / pd / rows

    assert_within_floor("grad", chunked_rel_err(p.grad, grad_truth), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_classes", [131072, 131071], ids=["C=131072", "C=131071 (odd: no vectors)"])
def test_cross_entropy_past_2_to_the_31_logits(num_classes):
    need_free_memory(30)  # float32 randn before the bf16 cast: 8 GiB twice; logits, gradient: 4 GiB each
    rows = 16385  # rows * num_classes > 2^31
    logits = random_logits(rows, num_classes, torch.bfloat16).requires_grad_()
    target = random_class_targets(rows, num_classes)
    loss = losses.cross_entropy(logits, target)
    loss.backward()

    rows_per_chunk = max(1, CHUNK // num_classes)
    counted = int((target != -100).sum())
    ignored = (target == -100)
    truth_sum = 0.0
    grad_diff_sq = grad_truth_sq = 0.0
    for start in range(0, rows, rows_per_chunk):
        end = min(start + rows_per_chunk, rows)
        log_softmax = logits.detach()[start:end].double().log_softmax(1)
        classes = target[start:end].masked_fill(ignored[start:end], 0)
        row_loss = -log_softmax.gather(1, classes[:, None])[:, 0]
        truth_sum += row_loss.masked_fill(ignored[start:end], 0).sum().item()
        grad = log_softmax.exp_()
        grad[torch.arange(end - start, device="cuda"), classes] -= 1
        grad.masked_fill_(ignored[start:end, None], 0).div_(counted)
        grad_diff_sq += (logits.grad[start:end].double() - grad).pow(2).sum().item()
        grad_truth_sq += grad.pow(2).sum().item()
    truth_loss = truth_sum / counted
    assert_within_floor("loss", abs(loss.item() - truth_loss) / truth_loss, torch.bfloat16)
    assert_within_floor("grad", math.sqrt(grad_diff_sq / grad_truth_sq), torch.bfloat16)


# ----------------------------------------------------------------------------------
# Layouts: views of every kind, for every input (the target too), against float64.

LAYOUTS = {
    "transposed": lambda make: make(1000, 64).t(),
    "sliced rows and columns": lambda make: make(70, 1100)[3:67, 50:1050],
    "expanded (stride 0)": lambda make: make(1, 1000).expand(64, 1000),
    "every other column": lambda make: make(64, 2000)[:, ::2],
}


def layout_inputs(name, layout, dtype):
    if name.startswith("cross_entropy") and LOSSES[name].grad_of == (0,):  # class-index targets
        logits = LAYOUTS[layout](lambda rows, cols: random_logits(rows, cols, dtype))
        target = random_class_targets(2 * logits.shape[0], logits.shape[1])[::2]  # a strided view
        return [logits, target]
    make = LOSSES[name].inputs
    return [LAYOUTS[layout](lambda rows, cols: make(rows, cols, dtype)[k]) for k in range(2)]


LAYOUT_CASES = [(name, reduction) for name, loss in LOSSES.items() for reduction in loss.reductions]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name,reduction", LAYOUT_CASES)
def test_layouts_match_float64(name, reduction, layout, dtype):
    loss = LOSSES[name]
    inputs = layout_inputs(name, layout, dtype)
    assert not all(t.is_contiguous() for t in inputs)
    check_against_float64(loss.fused(reduction), loss.reference(reduction), inputs, grad_of=loss.grad_of,
                          case=f"{name} {layout}")


# ----------------------------------------------------------------------------------
# Tensors on cuda:1 while cuda:0 is current: kernels must run on the tensors' device.

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name,reduction", LAYOUT_CASES)
def test_tensors_on_a_device_other_than_the_current_one(name, reduction):
    loss = LOSSES[name]
    with torch.cuda.device(0):
        inputs = [t.to("cuda:1") for t in loss.inputs(64, 1000, torch.float32)]
        leaves = [t.requires_grad_(i in loss.grad_of) for i, t in enumerate(inputs)]
        ours = loss.fused(reduction)(*leaves)
        assert ours.device == torch.device("cuda:1")
        ours.backward(torch.ones_like(ours))
        ours_grads = [leaves[i].grad for i in loss.grad_of]
        reference_leaves = [t.detach().requires_grad_(i in loss.grad_of) for i, t in enumerate(inputs)]
        expected = loss.reference(reduction)(*reference_leaves)
        expected.backward(torch.ones_like(expected))
        assert torch.cuda.current_device() == 0
    torch.testing.assert_close(ours.detach(), expected.detach())
    for i, grad in zip(loss.grad_of, ours_grads):
        assert grad.device == torch.device("cuda:1")
        torch.testing.assert_close(grad, reference_leaves[i].grad)
