"""Sizes past 2^31 elements, every memory layout, and tensors on a GPU other than the
current one (GPU).

Past 2^31 elements any 32-bit index in a kernel wraps; the truth there is float64,
computed in chunks so that it fits next to the inputs.
"""
import math

import pytest
import torch

import losses
from helpers import (FLOOR, LOSSES, ULPS, check_against_float64, max_ulps, random_class_targets, random_logits,
                     rel_err)

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
# More than 2^31 elements, bfloat16, against chunked float64: 2^28 elements past 2^31, each
# checked (a wrapped 32-bit index reads or writes the wrong ones), in training, without
# grad and with reduction 'none' (its backward too).

PAST_2_31 = 2**31 + 2**28
BIG_MODES = ["training", "no grad", "none"]


def check_flat_past_2_31(name, value, truth_of, dtype=torch.bfloat16):
    """value (any shape, viewed flat) against truth_of(start, end), the float64 truth of
    value.flatten()[start:end]: norm-wise over all of it, and element by element (ULPS)
    from element 2^31 on."""
    assert_within_floor(name, chunked_rel_err(value, truth_of), dtype)
    flat = value.detach().reshape(-1)
    assert flat.numel() - 2**31 >= 2**28, name
    worst = max(max_ulps(flat[s:min(s + CHUNK, flat.numel())], truth_of(s, min(s + CHUNK, flat.numel())))
                for s in range(2**31, flat.numel(), CHUNK))
    assert worst <= ULPS[dtype], f"{name}: {worst:.3g} ulp off float64 past element 2^31 (> {ULPS[dtype]})"


def check_scalar(name, value, truth):
    assert max_ulps(value, torch.tensor(truth, device=value.device)) <= ULPS[value.dtype], \
        f"{name}: {value.item()} vs float64 {truth}"


def pointwise_past_2_31(loss_fn, inputs, pointwise_truth, grad_truth, scale, mode):
    """A pointwise loss (flat inputs; scalar reduction: sum of the elements times scale)
    checked in `mode` against pointwise_truth(start, end) and grad_truth(start, end)
    (d element / d input 0)."""
    first, other = inputs
    n = first.numel()
    if mode == "none":
        first.requires_grad_()
        out = loss_fn(first, other, "none")
        check_flat_past_2_31("loss per element", out, pointwise_truth)
        grad_output = torch.rand_like(out) + 0.5
        out.backward(grad_output)
        del out
        flat_go = grad_output.reshape(-1)
        check_flat_past_2_31("grad (from grad_output)", first.grad,
                             lambda s, e: grad_truth(s, e) * flat_go[s:e].double())
        return
    truth = sum(pointwise_truth(s, min(s + CHUNK, n)).sum().item() for s in range(0, n, CHUNK)) * scale
    if mode == "no grad":
        with torch.no_grad():
            check_scalar("loss without grad", loss_fn(first, other, "sum" if scale == 1 else "mean"), truth)
        return
    first.requires_grad_()
    loss = loss_fn(first, other, "sum" if scale == 1 else "mean")
    loss.backward()
    check_scalar("loss", loss.detach(), truth)
    check_flat_past_2_31("grad", first.grad, lambda s, e: grad_truth(s, e) * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", BIG_MODES)
def test_mse_past_2_to_the_31_elements(mode):
    need_free_memory(30)  # x, y, grad, 'none' output and its grad_output: 4.5 GiB each; truth chunks
    n = PAST_2_31 + 3  # odd: the scalar tail runs past 2^31 too
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)

    def diff(start, end):
        return x.detach()[start:end].double() - y[start:end].double()

    pointwise_past_2_31(lambda a, b, reduction: losses.mse_loss(a, b, reduction=reduction), (x, y),
                        lambda s, e: diff(s, e).pow(2), lambda s, e: 2 * diff(s, e), 1.0 / n, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", BIG_MODES)
def test_kl_div_past_2_to_the_31_elements(mode):
    need_free_memory(30)
    rows, cols = 2, PAST_2_31 // 2 + 5  # batchmean divides by 2
    p = torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) + 0.1
    q = torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) + 0.1

    def terms(start, end):
        return p.detach().reshape(-1)[start:end].double(), q.reshape(-1)[start:end].double()

    def pointwise_loss(start, end):
        pd, qd = terms(start, end)
        return qd * (qd.log() - pd.log())

    def grad(start, end):
        pd, qd = terms(start, end)
        return -qd / pd

    reduction_of = {"sum": "sum", "mean": "batchmean", "none": "none"}
    pointwise_past_2_31(lambda a, b, reduction: losses.kl_div(a, b, reduction=reduction_of[reduction], log_input=False),
                        (p, q), pointwise_loss, grad, 1.0 / rows, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", BIG_MODES)
@pytest.mark.parametrize("num_classes", [131072, 131071], ids=["C=131072", "C=131071 (odd: no vectors)"])
def test_cross_entropy_past_2_to_the_31_logits(num_classes, mode):
    need_free_memory(36)  # float32 randn before the bf16 cast: 9.6 GiB twice; logits, gradients: 4.8 GiB each
    rows = PAST_2_31 // num_classes + 2
    logits = random_logits(rows, num_classes, torch.bfloat16)
    target = random_class_targets(rows, num_classes)
    ignored = target == -100
    counted = int((~ignored).sum())
    rows_per_chunk = max(1, CHUNK // num_classes)
    first_row_past = 2**31 // num_classes  # holds element 2^31 or lies before it

    def row_truth(start, end):
        """Per-row loss and d loss_row / d logits of rows [start, end), float64 (0 where ignored)."""
        log_softmax = logits.detach()[start:end].double().log_softmax(1)
        classes = target[start:end].masked_fill(ignored[start:end], 0)
        row_loss = (-log_softmax.gather(1, classes[:, None])[:, 0]).masked_fill(ignored[start:end], 0)
        grad = log_softmax.exp_()
        grad[torch.arange(end - start, device="cuda"), classes] -= 1
        return row_loss, grad.masked_fill_(ignored[start:end, None], 0)

    def check_grad(grad_of_logits, row_scale):
        """Every row's gradient against float64 times row_scale(start, end) (a (rows, 1) tensor
        or a float): norm-wise over all rows, element by element past 2^31."""
        diff_sq = truth_sq = worst = 0.0
        for start in range(0, rows, rows_per_chunk):
            end = min(start + rows_per_chunk, rows)
            truth = row_truth(start, end)[1] * row_scale(start, end)
            diff_sq += (grad_of_logits[start:end].double() - truth).pow(2).sum().item()
            truth_sq += truth.pow(2).sum().item()
            if end > first_row_past:
                worst = max(worst, max_ulps(grad_of_logits[start:end], truth))
        assert_within_floor("grad", math.sqrt(diff_sq / truth_sq), torch.bfloat16)
        assert worst <= ULPS[torch.bfloat16], f"grad: {worst:.3g} ulp off float64 past element 2^31"

    if mode == "none":
        logits.requires_grad_()
        out = losses.cross_entropy(logits, target, reduction="none")
        truth = torch.cat([row_truth(s, min(s + rows_per_chunk, rows))[0] for s in range(0, rows, rows_per_chunk)])
        assert max_ulps(out[first_row_past:], truth[first_row_past:]) <= ULPS[torch.bfloat16]
        assert_within_floor("loss per row", rel_err(out, truth), torch.bfloat16)
        grad_output = torch.rand(rows, device="cuda").add(0.5).to(torch.bfloat16)
        out.backward(grad_output)
        check_grad(logits.grad, lambda s, e: grad_output[s:e, None].double())
        return
    truth_loss = sum(row_truth(s, min(s + rows_per_chunk, rows))[0].sum().item()
                     for s in range(0, rows, rows_per_chunk)) / counted
    if mode == "no grad":
        with torch.no_grad():
            check_scalar("loss without grad", losses.cross_entropy(logits, target), truth_loss)
        return
    logits.requires_grad_()
    loss = losses.cross_entropy(logits, target)
    loss.backward()
    check_scalar("loss", loss.detach(), truth_loss)
    check_grad(logits.grad, lambda s, e: 1.0 / counted)


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
