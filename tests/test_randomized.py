"""A seeded walk over each loss's whole argument space: CASES random cases per loss, each
compared with torch against float64 (helpers.check_against_float64), or, where the float64
loss or a gradient is not finite or the batch is empty, element by element.

Shapes include one class, unbatched inputs and empty batches; every dtype and option;
ignore patterns from none to every row; weights and probability targets; gradients of
every input that can have one. Where cross-entropy's gradient is a difference of larger
terms (p near the smoothed target), its floor is the arithmetic's on those terms
(cross_entropy_gradient_terms): eager's error there is as much luck as ours, and twice it
failed a case now and then (seed 941187102, case 33: 2 classes, float32, p near y'). A
failure names its case and the seed that rebuilds it (FUSED_LOSSES_SEED reruns the same
walk). On CPU (CI) the same walk runs through the Python models of the kernels
(kernels_modelled_on_cpu): the Python layer is checked there, the kernels on the GPU.
"""
import contextlib
import os
import random

import pytest
import torch
import torch.nn.functional as F

import cross_entropy
import losses
from conftest import SEED
from helpers import DTYPES, FLOOR, check_against_float64, default_grad_output, input_scale, loss_and_grads

CASES = 300  # per loss
CHUNKS = 10  # test items per loss, CASES / CHUNKS cases each
MAX_ELEMENTS = 1 << 21


def class_weights(num_classes, rng, device):
    """Weights from 0.5 to 1.5 (bfloat16 values: every dtype holds them exactly)."""
    weights = torch.tensor([rng.uniform(0.5, 1.5) for _ in range(num_classes)], device=device)
    return weights.to(torch.bfloat16).float()


def cross_entropy_case(rng, device):
    dtype = rng.choice(DTYPES)
    classes = rng.choice([1, 2, 3, 7, 100, 1000, 1001, 4099, 40001])
    layout = rng.choice(["unbatched", "rows", "rows", "(N, C, d)"])
    rows = rng.choice([0, 1, 3, 17, 64]) if layout != "unbatched" else 1
    rows = min(rows, max(1, MAX_ELEMENTS // classes))
    extra = rng.choice([1, 3]) if layout == "(N, C, d)" else 1
    shape = {"unbatched": (classes,), "rows": (rows, classes), "(N, C, d)": (rows, classes, extra)}[layout]
    logits = (torch.randn(shape, device=device) * rng.choice([0.1, 2.0, 8.0])).to(dtype)
    probs = rng.random() < 0.25
    ignore_index = -100 if probs else rng.choice([-100, -100, 0, classes - 1])
    options = dict(reduction=rng.choice(["mean", "sum", "none"]), label_smoothing=rng.choice([0.0, 0.0, 0.1, 0.35]),
                   z_loss=rng.choice([0.0, 0.0, 1e-3]), ignore_index=ignore_index)
    weights = class_weights(classes, rng, device) if rng.random() < 0.4 else None
    if probs:
        target = torch.randn(shape, device=device).mul(rng.choice([0.5, 3.0])).softmax(1 if len(shape) > 1 else 0)
        target = target.to(dtype)
        ignored = "-"
    else:
        target_shape = {"unbatched": (), "rows": (rows,), "(N, C, d)": (rows, extra)}[layout]
        target = torch.randint(0, classes, target_shape, device=device)
        ignored = rng.choice(["none", "some", "all"])
        if ignored != "none":
            mask = torch.rand(target_shape, device=device) < (0.3 if ignored == "some" else 2.0)
            target = target.masked_fill(mask, ignore_index)
        target = target.to(rng.choice([torch.int64, torch.int32]))
    grad_of = (0, 1) if probs and rng.random() < 0.5 else (0,)

    def fused(x, t):
        w = None if weights is None else weights.to(x.dtype)
        return losses.cross_entropy(x, t, weight=w, **options)

    def reference(x, t):
        w = None if weights is None else weights.to(x.dtype)
        return cross_entropy.reference_cross_entropy(x, t.long() if not t.is_floating_point() else t, w,
                                           options["ignore_index"], options["reduction"],
                                           options["label_smoothing"], options["z_loss"], False)

    def grad_floors(inputs, truth_grads, grad_output):
        """The logits' gradient's floor: the arithmetic's (float32's, or float64's) on the size of
        the terms it is a difference of, where that exceeds the dtype's."""
        truth_norm = truth_grads[0].norm().item()
        terms = cross_entropy_gradient_terms(inputs[0], inputs[1], weights, options, grad_output)
        conditioning = terms.norm().item() / truth_norm if truth_norm > 0 else 1.0  # an exact 0 stays exact
        arithmetic = FLOOR_OF_FEW_ELEMENTS[torch.float64 if dtype == torch.float64 else torch.float32]
        return ([max(FLOOR_OF_FEW_ELEMENTS[dtype], arithmetic * conditioning)] +
                [FLOOR_OF_FEW_ELEMENTS[dtype]] * (len(grad_of) - 1))

    name = (f"cross_entropy {tuple(shape)} {dtype} {'probabilities' if probs else f'{target.dtype} ignored {ignored}'} "
            f"weight={weights is not None} {options} grads of {grad_of}")
    return name, fused, reference, [logits, target], grad_of, grad_floors


def cross_entropy_gradient_terms(x, target, weight, options, grad_output):
    """The logits' gradient is a difference, s (p W - w y') (s the row's scale, y' the smoothed
    target, W = sum_c w_c y'_c), plus the z-loss's 2 z lse p: the size of its terms, s (p W + w y')
    + |2 z lse p|, in float64. Where they nearly cancel (p near y'), any float32 formula is off by
    a few units of the terms, eager's too: the norm-wise floor scales with them."""
    class_dim = 1 if x.dim() > 1 else 0
    x = x.double().movedim(class_dim, -1)
    classes = x.shape[-1]
    p = x.softmax(-1)
    smoothing, reduction = options["label_smoothing"], options["reduction"]
    w = torch.ones(classes, dtype=torch.float64, device=x.device) if weight is None else weight.double()
    if target.is_floating_point():
        y = target.double().movedim(class_dim, -1) * (1 - smoothing) + smoothing / classes
        counted = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        divisor = counted.sum()
    else:
        counted = target != options["ignore_index"]
        index = target.long().clamp(0, classes - 1)
        y = (F.one_hot(index, classes).double() * (1 - smoothing) + smoothing / classes) * counted[..., None]
        divisor = w[index][counted].sum()
    grad_output = grad_output.double().to(x.device)
    scale = {"none": grad_output, "sum": grad_output, "mean": grad_output / divisor}[reduction]
    g = scale[..., None] * w * y
    terms = g + p * g.sum(-1, keepdim=True) if classes > 1 else torch.zeros_like(p)  # one class: no ce term at all
    if options["z_loss"]:
        z_scale = grad_output / counted.sum() if reduction == "mean" else grad_output
        lse = torch.logsumexp(x, -1)
        terms = terms + (2 * options["z_loss"] * lse.abs() * z_scale * counted)[..., None] * p
    return terms.movedim(-1, class_dim)


def pointwise_shape(rng):
    shape = rng.choice([(), (0,), (1,), (7,), (5, 1), (33, 100), (4, 3, 9), (257, 1001), (64, 4099)])
    return shape


def mse_case(rng, device):
    dtype = rng.choice(DTYPES)
    shape = pointwise_shape(rng)
    scale = rng.choice([0.01, 1.0, 100.0])
    x, y = (torch.randn(shape, device=device).mul(scale).to(dtype) for _ in range(2))
    reduction = rng.choice(["mean", "sum", "none"])
    grad_of = rng.choice([(0,), (1,), (0, 1)])
    name = f"mse_loss {shape} {dtype} scale {scale} {reduction} grads of {grad_of}"
    return (name, lambda a, b: losses.mse_loss(a, b, reduction=reduction),
            lambda a, b: F.mse_loss(a, b, reduction=reduction), [x, y], grad_of, None)


def kl_div_case(rng, device):
    dtype = rng.choice(DTYPES)
    shape = pointwise_shape(rng)
    log_input, log_target = rng.random() < 0.5, rng.random() < 0.5
    last = -1 if len(shape) else 0
    p = torch.randn(shape, device=device).mul(rng.choice([0.5, 4.0])).softmax(last) if shape else torch.rand(())
    q = torch.randn(shape, device=device).mul(rng.choice([0.5, 4.0])).softmax(last) if shape else torch.rand(())
    p, q = p.to(device), q.to(device)
    if rng.random() < 0.2 and p.numel() > 1:  # zeros in the target: xlogy's special case
        q = q.masked_fill(torch.rand(shape, device=device) < 0.3, 0.0)
    input = (p.log() if log_input else p).to(dtype)
    target = (q.log() if log_target else q).to(dtype)
    reduction = rng.choice(["batchmean", "sum", "none"])
    grad_of = rng.choice([(0,), (1,), (0, 1)])

    def reference(a, b):
        return F.kl_div(a if log_input else a.log(), b, reduction=reduction, log_target=log_target)

    name = f"kl_div {shape} {dtype} log_input={log_input} log_target={log_target} {reduction} grads of {grad_of}"
    return (name, lambda a, b: losses.kl_div(a, b, reduction=reduction, log_target=log_target, log_input=log_input),
            reference, [input, target], grad_of, None)


CASE_MAKERS = {"cross_entropy": cross_entropy_case, "mse_loss": mse_case, "kl_div": kl_div_case}


@contextlib.contextmanager
def torch_fallback_allowed(inputs):
    """Empty tensors run torch's code by design: strict mode is off for them."""
    if all(t.numel() > 0 for t in inputs[:1]):
        yield
        return
    strict = os.environ.pop("FUSED_LOSSES_STRICT", None)
    try:
        yield
    finally:
        if strict is not None:
            os.environ["FUSED_LOSSES_STRICT"] = strict


# Element by element, where norms say nothing (NaN, inf, an empty batch) and for the CPU
# models (Python formulas, not the kernels' arithmetic): each element within rtol (of itself
# or of its tensor's largest finite magnitude) of float64's, or of torch's in the same dtype
# (which may overflow to inf, or hold NaN, where float64 does not), or equal to float64's rounded
# to the dtype; NaN only where one has it.
ELEMENTWISE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def check_elementwise(name, fused, reference, inputs, grad_of, grad_output, truth):
    ours = loss_and_grads(fused, inputs, grad_of, grad_output)
    eager = loss_and_grads(reference, inputs, grad_of, grad_output)
    rtol = ELEMENTWISE_RTOL[inputs[0].dtype]
    names = ["loss"] + [f"grad of input {i}" for i in grad_of]
    for what, mine, exact, theirs in zip(names, [ours[0], *ours[1]], [truth[0], *truth[1]], [eager[0], *eager[1]]):
        assert mine.shape == exact.shape, (name, what)
        finite = exact[torch.isfinite(exact)]
        tiny = torch.finfo(inputs[0].dtype).smallest_normal * torch.finfo(inputs[0].dtype).eps  # a subnormal step
        # A loss near 0 is a difference of terms as large as the input (lse - x_t), rounded in float32.
        arithmetic = 2.0**-22 * input_scale(inputs[0]) if inputs[0].dtype != torch.float64 else 0.0
        atol = max(rtol * (finite.abs().max().item() if finite.numel() else 0.0), tiny, arithmetic)
        # float64's value as the output's dtype holds it: past float16's largest, inf (IEEE rounding).
        rounded = exact.to(mine.dtype).double()
        mine = mine.double()
        close = (torch.isclose(mine, exact, rtol=rtol, atol=atol, equal_nan=True) |
                 torch.isclose(mine, theirs.double(), rtol=rtol, atol=atol, equal_nan=True) | (mine == rounded))
        assert close.all(), (f"{name}: {what}: {int((~close).sum())} of {close.numel()} elements off, e.g. "
                             f"ours {mine[~close][:3].tolist()} float64 {exact[~close][:3].tolist()} "
                             f"torch {theirs.double()[~close][:3].tolist()}")


# The norm-wise floor here: these cases include outputs of one or a few elements, each a
# difference of larger terms (KL's log(q / p) where q is near p): their float32 roundings,
# a few units of the terms, are many units of the result. 2-byte dtypes keep helpers' FLOOR.
FLOOR_OF_FEW_ELEMENTS = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: FLOOR[torch.float16],
                         torch.bfloat16: FLOOR[torch.bfloat16]}


def check_case(name, fused, reference, inputs, grad_of, grad_floors, device):
    with torch_fallback_allowed(inputs):
        as_float64 = [t.double() if t.is_floating_point() else t for t in inputs]
        grad_output = default_grad_output(reference, as_float64).to(inputs[0].device)
        truth = loss_and_grads(reference, as_float64, grad_of, grad_output)
        finite = all(torch.isfinite(t).all() for t in [truth[0], *truth[1]])
        if device == "cuda" and finite and inputs[0].numel() > 0:
            floors = grad_floors(as_float64, truth[1], grad_output) if grad_floors and grad_of else None
            check_against_float64(fused, reference, inputs, grad_of, grad_output, case=name,
                                  floor=FLOOR_OF_FEW_ELEMENTS, grad_floors=floors)
        else:
            check_elementwise(name, fused, reference, inputs, grad_of, grad_output, truth)


def torch_has_2_byte_losses_on_cpu() -> bool:
    """torch < 2.1 has no float16 or bfloat16 log_softmax, nll_loss or mse_loss on CPU."""
    try:
        for dtype in (torch.float16, torch.bfloat16):
            F.cross_entropy(torch.zeros(2, 3, dtype=dtype), torch.zeros(2, dtype=torch.long))
            F.mse_loss(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype))
    except RuntimeError:
        return False
    return True


def run_chunk(loss, chunk, device):
    two_byte_ok = device == "cuda" or torch_has_2_byte_losses_on_cpu()
    for index in range(chunk * CASES // CHUNKS, (chunk + 1) * CASES // CHUNKS):
        rng = random.Random(f"{SEED} {loss} {index}")
        torch.manual_seed(rng.randrange(2**31))
        name, fused, reference, inputs, grad_of, grad_floors = CASE_MAKERS[loss](rng, device)
        if not two_byte_ok and inputs[0].element_size() == 2:
            continue
        try:
            check_case(name, fused, reference, inputs, grad_of, grad_floors, device)
        except Exception as error:
            raise AssertionError(f"case {index} (seed {SEED}): {name}") from error


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("loss", list(CASE_MAKERS))
def test_random_cases_match_torch(loss, chunk):
    run_chunk(loss, chunk, "cuda")


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("loss", list(CASE_MAKERS))
def test_random_cases_through_the_cpu_models(loss, chunk, kernels_modelled_on_cpu):
    run_chunk(loss, chunk, "cpu")
