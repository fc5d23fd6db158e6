"""linear_cross_entropy: torch 2.14's F.linear_cross_entropy, i.e. F.cross_entropy(F.linear(input,
linear_weight, linear_bias), target), a chunk of the vocabulary at a time. Every option and the
gradients of input, linear_weight and linear_bias against float64, on CPU and CUDA, with chunks
small enough that the classes span several; against torch's own function, its OpInfo samples and
its Module where torch has them (2.14+); the fallback (the logits whole) for class weights,
probabilities and K-dimensional weights; bad input and the old signature raise first; on CUDA:
bounded memory, no host sync, the same bits every run, torch.compile and CUDA graphs."""
import itertools
import math
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import linear_cross_entropy
import cross_entropy
import losses
from helpers import (CPU_FLOAT16_MATMUL, FLOOR, backwards_on_threads, check_against_float64 as check_float64,
                     default_grad_output, loss_and_grads, raises_as_torch, rel_err)


def check_against_float64(*args, **kwargs):
    """Norm-wise only: d input and d weight are matrix products of the rounded d logits, and a
    2-byte 'none' loss a function of the logits rounded to that dtype (as eager's), so neither is
    within 1 ulp of float64 element by element (H100, float16 with z-loss, 1200 draws: 2 over 1 ulp,
    the worst 2.2)."""
    return check_float64(*args, grads_within_ulps=False, loss_within_ulps=False, **kwargs)

OPTIONS = [dict(reduction=reduction, label_smoothing=smoothing, z_loss=z, softcap=softcap)
           for reduction, smoothing, z, softcap in itertools.product(
               ["mean", "sum", "none"], [0.0, 0.1], [0.0, 1e-2], [None, 5.0])]


def reference(options, ignore_index=-100):
    """torch's formula: the linear, the cap, then cross-entropy (plus the z-loss term)."""
    return lambda x, w, t, b: reference_of_logits(options, ignore_index)(F.linear(x, w, b), t)


def reference_of_logits(options, ignore_index=-100):
    """reference's loss of the logits (the cap, then cross-entropy)."""
    def loss(logits, t):
        if options["softcap"] is not None:
            logits = options["softcap"] * torch.tanh(logits / options["softcap"])
        logits = logits.reshape(-1, logits.shape[-1])
        value = cross_entropy.reference_cross_entropy(logits, t.reshape(-1), None, ignore_index, options["reduction"],
                                            options["label_smoothing"], options["z_loss"], False)
        return value.reshape(t.shape) if options["reduction"] == "none" else value
    return loss


def fused(options, ignore_index=-100):
    return lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, ignore_index=ignore_index, **options)


def make_inputs(shape, hidden, vocab, dtype, device, target_dtype=torch.int64):
    x = torch.randn(*shape, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, device=device).mul(0.1).to(dtype)
    t = torch.randint(0, vocab, shape, device=device)
    t = t.masked_fill(torch.rand(shape, device=device) < 0.25, -100).to(target_dtype)
    return [x, w, t, b]


# The gradients wanted pick the schedule (choose_schedule): for input's alone (a frozen head), or
# with d weight in the accumulation type, the rows; a 2-byte d weight, or 'none' with d weight,
# the rows then chunks of classes in backward.
GRADS_OF = {"input, weight and bias": (0, 1, 3), "input alone": (0,), "weight alone": (1,)}


def schedule_of(options, inputs, grad_of):
    x, w, t, b = inputs
    wants = tuple(i in grad_of for i in (0, 1, 3))
    return linear_cross_entropy.choose_schedule(wants, options["reduction"], w.dtype, x.dtype, None,
                                                options.get("softcap") or 0.0)


def check_schedule(options, inputs, grad_of, monkeypatch, floors=None):
    """check_against_float64 of a case, and that the passes of the schedule it calls for ran; floors:
    None, or a function of (inputs, grad_of, grad_output) giving the loss's floor and each gradient's
    (floors_of)."""
    ran = []
    for name in ("row_pass", "loss_pass", "gradient_pass"):
        monkeypatch.setattr(linear_cross_entropy, name,
                            lambda *args, _name=name, _pass=getattr(linear_cross_entropy, name): ran.append(_name)
                            or _pass(*args))
    grad_output = default_grad_output(reference(options), [t.double() if t.is_floating_point() else t for t in inputs])
    loss_floor, grad_floors = floors(inputs, grad_of, grad_output) if floors else (None, None)
    check_against_float64(fused(options), reference(options), inputs, grad_of=grad_of, grad_output=grad_output,
                          case=str(options), grad_floors=grad_floors,
                          **({} if loss_floor is None else dict(floor={inputs[0].dtype: loss_floor})))
    schedule = schedule_of(options, inputs, grad_of)
    expected = {"rows": {"row_pass"}, "rows_then_classes": {"row_pass", "gradient_pass"},
                "classes": {"loss_pass", "gradient_pass"}}[schedule]
    assert expected <= set(ran), (set(ran), expected)  # beside the no-grad call's passes (eval)
    assert schedule != "rows" or "gradient_pass" not in ran


def test_the_schedule_follows_the_wanted_gradients_and_their_dtype():
    choose = linear_cross_entropy.choose_schedule
    f32, bf16 = torch.float32, torch.bfloat16
    assert choose((False, False, False), "mean", bf16, bf16, None) == "classes"  # eval
    assert choose((True, False, False), "none", bf16, bf16, None) == "rows"  # frozen head
    assert choose((True, True, True), "mean", f32, bf16, None) == "rows"  # float32 master weight
    assert choose((True, True, False), "sum", f32, f32, None) == "rows"
    assert choose((True, True, False), "mean", bf16, bf16, None, float32_weight_sum=True) == "rows"
    assert choose((True, True, False), "mean", bf16, bf16, None) == "rows_then_classes"
    assert choose((False, False, True), "mean", bf16, bf16, None) == "rows_then_classes"
    assert choose((True, True, False), "none", f32, f32, None) == "rows_then_classes"
    assert choose((True, True, False), "mean", bf16, bf16, None, 30.0) == "classes"  # Gemma 2's softcap
    assert choose((True, False, False), "mean", bf16, bf16, None, 30.0) == "rows"
    assert choose((True, False, False), "mean", bf16, bf16, object()) == "classes"  # a process group
    assert choose((True, False, False), "mean", torch.float16, torch.float16, None) == "classes"
    assert choose((True, True, False), "mean", torch.float16, torch.float16, None,
                  float32_weight_sum=True) == "classes"


@pytest.mark.parametrize("vocab,hidden", [(128256, 4096), (256000, 2304), (50304, 1024), (1000, 64), (193, 8)])
def test_the_gradient_forms_chunks_tile_the_vocabulary_within_the_budget(vocab, hidden):
    """Rows a chunk where gradient_form: at least FORM_ROWS, whole tiles; its vocabulary in the fewest parts whose
    bytes fit the budget, which tile it without gaps in whole row_stats tiles."""
    lce = linear_cross_entropy
    budget = lce.row_chunk_rows(vocab, 2) * vocab * 2
    rows = lce.gradient_form_rows(vocab, hidden)
    assert rows >= lce.FORM_ROWS and rows % lce.ROW_ALIGN == 0
    for chunk in (rows, 700, 1):
        parts = lce.form_parts_for(chunk, vocab, hidden)
        bounds = lce.form_parts(vocab, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == vocab and len(bounds) <= parts
        assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
        assert all((end - first) % lce.FORM_PART_ALIGN == 0 for first, end in bounds[:-1])
        assert lce._form_bytes(chunk, vocab, hidden, parts) <= budget or len(bounds) == -(-vocab // lce.FORM_PART_ALIGN)
        assert parts == 1 or lce._form_bytes(chunk, vocab, hidden, parts - 1) > budget  # the fewest
    if (vocab, hidden) in ((128256, 4096), (256000, 2304)):  # Llama 3's and Gemma 2's, as measured (notes v70)
        assert (rows, lce.form_parts_for(rows, vocab, hidden)) == (1024, 2 if vocab == 128256 else 3)


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
@pytest.mark.parametrize("divisor", [7, torch.tensor(7.0), torch.tensor(7)], ids=["int", "float tensor", "int tensor"])
def test_divisor_divides_the_sum(divisor, grad_of, small_chunks):
    """num_items_in_batch's reduction: the sum over divisor, in the forward's gradients."""
    options = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-2, softcap=5.0)
    check_against_float64(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, divisor=divisor,
                                                                         **options),
                          lambda x, w, t, b: reference(options)(x, w, t, b) / 7, make_inputs((2, 5), 16, 50,
                                                                                             torch.float32, "cpu"),
                          grad_of=grad_of)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rows_then_classes_on_cpu(reduction, small_chunks):
    """A 2-byte d weight of a scalar loss: d input written in the forward and scaled in place in
    backward, which on CPU bumps a saved tensor's version; the saved logits' inputs are read first."""
    inputs = make_inputs((2, 5), 16, 50, torch.bfloat16, "cpu")
    assert schedule_of(dict(reduction=reduction), inputs, (0, 1, 3)) == "rows_then_classes"
    options = dict(OPTIONS[0], reduction=reduction)
    check_against_float64(fused(options), reference(options), inputs, grad_of=(1, 3))
    x, w, t, b = (tensor.requires_grad_() if tensor.is_floating_point() else tensor for tensor in inputs)
    losses.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction).backward()
    assert all(tensor.grad is not None for tensor in (x, w, b))


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
def test_a_chunk_of_classes_all_minus_inf_keeps_the_loss_and_gradients(grad_of, small_chunks):
    """float16 takes the "classes" schedule: classes 48 and 49 masked (bias -inf) make the last 16-class chunk
    all -inf, whose max must not shift its exps to NaN. Fails if row_passes._stats_torch drops its guard of an
    all -inf chunk (NaN gradients), or finish_loss multiplies the -inf logit sum by label_smoothing 0 (NaN loss)."""
    if not CPU_FLOAT16_MATMUL:
        pytest.skip("this torch's CPU matmul takes no float16")
    x, w, t, b = make_inputs((2, 5), 16, 50, torch.float16, "cpu")
    b[48:] = -torch.inf
    t = torch.where(t >= 48, t - 48, t)  # no target among the masked classes
    inputs = [x, w, t, b]
    options = OPTIONS[0]
    assert schedule_of(options, inputs, grad_of) == "classes"
    check_against_float64(fused(options), reference(options), inputs, grad_of=grad_of)


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
def test_label_smoothing_of_one_is_torchs(grad_of, small_chunks, monkeypatch):
    """torch takes label_smoothing=1.0 (the uniform target alone), and so do we. Fails if
    cross_entropy.check_smoothing_and_z_loss refuses 1.0 (< 1.0 for <= 1.0)."""
    options = dict(reduction="mean", label_smoothing=1.0, z_loss=0.0, softcap=None)
    check_schedule(options, make_inputs((2, 5), 16, 50, torch.float64, "cpu"), grad_of, monkeypatch)


def test_a_second_backward_of_forward_written_gradients_raises():
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    loss = losses.linear_cross_entropy(x.requires_grad_(), w, t, linear_bias=b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_concurrent_backwards_of_forward_written_gradients():
    """Backwards of a retained graph on 8 threads at once: one scales the gradients in place and
    gets them right, the others raise (none scales them a second time)."""
    x, w, t, b = make_inputs((64,), 8, 20, torch.float64, "cpu")
    x.requires_grad_()
    expected = torch.autograd.grad(reference(dict(OPTIONS[0], reduction="mean"))(x, w, t, b), x,
                                   torch.tensor(3.0, dtype=torch.float64))[0]
    for _ in range(20):
        loss = losses.linear_cross_entropy(x, w, t, linear_bias=b)
        outcomes = backwards_on_threads(loss, x, [torch.tensor(3.0, dtype=torch.float64)] * 8, retain_graph=True)
        grads = [outcome for outcome in outcomes if not isinstance(outcome, RuntimeError)]
        assert len(grads) == 1 and all("second backward" in str(error) for error in outcomes if error is not grads[0])
        torch.testing.assert_close(grads[0], expected)


# float32's floors here, each quantity's from its error bound, where FLOOR's one 4 u missed d input's 4.5 u (eager's
# 2.2 u) at FUSED_LOSSES_SEED=10 on 2 threads. An element is a float32 sum of terms, each behind a chain of roundings:
# its logit's dot product over H and the bias (H + 1), the d logit's own operations (D_LOGIT_OPS), then the sum over
# the V classes (d input, the lse) or over the N rows (d weight, d bias, a reduced loss). Over a chain of n roundings,
# each an independent error of mean 0 and at most u, an element's mean square error is at most n u^2 (sum |term|)^2
# (Higham and Mary, SIAM J. Sci. Comput. 41, 2019: sqrt(n) u, where the worst case is gamma_n = n u / (1 - n u)); in
# the Frobenius norm, relative to the truth, the root mean square is at most sqrt(n) u kappa, kappa = || |A| |B| || /
# || A B || the product's condition (from the float64 truth: its d logits G, x and W); 1 for the loss, a sum of terms
# >= 0 (lse - z_t taken without cancellation: row_passes._target_nll). Rounding to nearest's errors have a variance
# of u^2 / 3, a sqrt(3) margin. 200 seeds, 1 and 2 threads: at most 0.5 of this floor.
# The float32 operations on a logit between the matrix products, at most (row_passes._gradient_torch): the cap (3),
# the shift and exp (3), the row's factor a = r (1 + 2 z_loss lse), r = grad_output / count (6), p a - r eps / C (4),
# the cap's derivative 4 q (1 - q) (4 for q, 2, 1 to apply it), grad_output's scale in backward (1).
D_LOGIT_OPS = 24


def float64_d_logits(loss_of_logits, inputs, grad_output=None):
    """(x (N, H), w (V, H), b, the logits x w^T + b, their loss, its gradient G), all float64: the truth the
    floors below start from. loss_of_logits(logits (N, C), target) is the loss of the logits' rows; grad_output
    None for a scalar loss."""
    x, w, t, b = (v.double() if v.is_floating_point() else v for v in inputs)
    x, w, b = x.reshape(-1, x.shape[-1]), w.reshape(-1, w.shape[-1]), b.reshape(-1)
    logits = F.linear(x, w, b).requires_grad_()
    loss = loss_of_logits(logits, t)
    g, = torch.autograd.grad(loss, logits, None if grad_output is None else
                             grad_output.to(logits.device).reshape(loss.shape))
    return x, w, b, logits.detach(), loss.detach(), g


def product_conditions(loss_of_logits, inputs, grad_of, grad_output):
    """((rows, hidden, vocab), {i: (kappa, its sum's length)}) for the gradients of input (i = 0), weight (1)
    and bias (3) among grad_of, each a product A B of the float64 d logits G: d input G W, d weight G^T x,
    d bias G^T 1; kappa = || |A| |B| || / || A B ||, the product's condition. loss_of_logits(logits (N, C),
    target) is the loss of the logits' rows."""
    x, w, _, _, _, g = float64_d_logits(loss_of_logits, inputs, grad_output)
    (rows, hidden), vocab = x.shape, w.shape[0]
    ones = torch.ones(rows, 1, dtype=g.dtype, device=g.device)
    products = {0: (g, w, vocab), 1: (g.t(), x, rows), 3: (g.t(), ones, rows)}
    return (rows, hidden, vocab), {i: (((left.abs() @ right.abs()).norm() / (left @ right).norm()).item(), length)
                                   for i, (left, right, length) in products.items() if i in grad_of}


def float32_floors(loss_of_logits, reduced, inputs, grad_of, grad_output):
    """(the loss's floor, each gradient's) by the bound above; reduced: whether the loss sums over the rows.
    A gradient other than input's, weight's and bias's (probabilities') keeps FLOOR's."""
    u = torch.finfo(torch.float32).eps / 2
    (rows, hidden, vocab), conditions = product_conditions(loss_of_logits, inputs, grad_of, grad_output)
    chain = hidden + 1 + D_LOGIT_OPS
    floors = [math.sqrt(chain + conditions[i][1]) * u * conditions[i][0] if i in conditions else FLOOR[torch.float32]
              for i in grad_of]
    return math.sqrt(chain + vocab + (rows if reduced else 0)) * u, floors


def two_byte_floors(options, inputs, grad_of, grad_output):
    """A 2-byte case's gradient floors, the bound above with the 2-byte roundings alone (float32's are
    ~65000x smaller): the logit, its d logit and the result, 3 roundings of u = eps / 2 on a product of
    condition kappa: sqrt(3) u kappa; at least FLOOR's (one u, which d bias missed on an H200: bf16 21 x 4099,
    1.2 u where eager's was 0.54 u; kappa 1 there, 6 for d bias over 6000 rows of 300 classes)."""
    dtype = inputs[0].dtype
    u = torch.finfo(dtype).eps / 2
    _, conditions = product_conditions(reference_of_logits(options), inputs, grad_of, grad_output)
    return [max(FLOOR[dtype], math.sqrt(3) * u * conditions[i][0]) for i in grad_of]


def autocast_loss_floor(options, inputs):
    """The loss's floor under bf16 autocast: x, w, b and each logit rounded to bf16 (u = eps / 2) move the loss
    by G : dZ, independent roundings of variance u^2 / 3 each; 6 standard deviations of that, relative. A single
    scalar: eager's error can cancel to near 0 by chance (80 seeds, H200: eager's 4e-7 against ours 1.7e-5)."""
    x, w, b, logits, loss, g = float64_d_logits(reference_of_logits(options), inputs)
    # Each logit's variance: its own rounding, x's and w's through the sum, and b's.
    spread = logits ** 2 + 2 * (x ** 2) @ (w ** 2).t() + b ** 2
    u = torch.finfo(torch.bfloat16).eps / 2
    return 6 * u / math.sqrt(3) * (g ** 2 * spread).sum().sqrt().item() / abs(loss.item())


def floors_of(options):
    """float32_floors for reference(options): check_schedule's floors."""
    reduced = options["reduction"] != "none"
    return lambda inputs, grad_of, grad_output: float32_floors(reference_of_logits(options), reduced, inputs, grad_of,
                                                               grad_output)


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matches_float64_on_cpu(options, dtype, grad_of, small_chunks, monkeypatch):
    check_schedule(options, make_inputs((2, 5), 16, 50, dtype, "cpu"), grad_of, monkeypatch,
                   floors_of(options) if dtype == torch.float32 else None)


@pytest.mark.parametrize("options", OPTIONS[:4], ids=str)
def test_without_bias_int32_targets_and_an_ignore_index_of_our_own(options, small_chunks):
    inputs = make_inputs((11,), 16, 50, torch.float32, "cpu", target_dtype=torch.int32)
    inputs[2] = inputs[2].masked_fill(inputs[2] == -100, 7)
    check_against_float64(lambda x, w, t: fused(options, ignore_index=7)(x, w, t, None),
                          lambda x, w, t: reference(options, ignore_index=7)(x, w, t.long(), None),
                          inputs[:3], grad_of=(0, 1), case=str(options))


def test_return_lse():
    x, w, t, b = make_inputs((4, 3), 8, 20, torch.float64, "cpu")
    loss, lse = losses.linear_cross_entropy(x, w, t, linear_bias=b, return_lse=True, softcap=3.0)
    logits = 3.0 * torch.tanh(F.linear(x, w, b) / 3.0)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert lse.shape == t.shape and not lse.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 20), t.reshape(-1)))


def test_every_row_ignored_gives_torchs_nan_and_zero_gradients():
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    x.requires_grad_()
    loss = losses.linear_cross_entropy(x, w, torch.full_like(t, -100), linear_bias=b)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("class_weights", [False, True], ids=["fused", "class weights (the fallback)"])
@pytest.mark.parametrize("bad", [20, -3])
def test_a_class_outside_the_vocabulary_raises_index_error_on_cpu(bad, class_weights):
    """As torch's on CPU; ignore_index is not outside, even a negative one."""
    x, w, t, b = make_inputs((4,), 8, 20, torch.float64, "cpu")
    weight = torch.rand(20, dtype=torch.float64) + 0.5 if class_weights else None
    t = torch.tensor([3, -5, 19, 0])
    losses.linear_cross_entropy(x, w, t, linear_bias=b, weight=weight, ignore_index=-5)
    with pytest.raises(IndexError, match=f"target {bad} is out of bounds"):
        losses.linear_cross_entropy(x, w, torch.tensor([3, -5, bad, 0]), linear_bias=b, weight=weight,
                                    ignore_index=-5)


@pytest.mark.gpu
def test_a_class_outside_the_vocabulary_gives_nan_for_its_row_only_on_cuda():
    """As cross_entropy's kernels: no device-side assert (it would poison a CUDA context), no host sync."""
    x, w, t, b = make_inputs((4,), 8, 20, torch.float64, "cuda")
    t = torch.tensor([3, 20, -100, -5], device="cuda")
    x.requires_grad_()
    rows = losses.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none")
    assert torch.isnan(rows[[1, 3]]).all() and rows[2] == 0
    torch.testing.assert_close(rows[0], F.cross_entropy(F.linear(x[:1], w, b), t[:1], reduction="none")[0])
    rows.sum().backward()
    assert torch.isnan(x.grad[[1, 3]]).all() and not torch.isnan(x.grad[[0, 2]]).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("softcap", [None, 60.0])
def test_confident_rows_keep_their_small_loss(device, softcap, small_chunks):
    """A confident row's loss lse - z_t is far below 1: computed as that difference it cancels
    (float32: 1e-2 to 1 relative off at losses of 1e-4 to 1e-6; float64 too, further down). Per
    row, each within 1e-4 relative of log1p(sum of exp(z_c - z_t) over c != t) in float64 (eager
    float32 is 5e-4 to 3e-2 off here; 300 draws on CPU: 2.5e-5 at worst)."""
    x = torch.randn(64, 32, device=device) * 3  # logits' spread: targets 10-40 above the rest
    w = torch.randn(50, 32, device=device)
    logits = F.linear(x.double(), w.double())
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    target = logits.argmax(1)
    gaps = logits - logits.gather(1, target[:, None])
    truth = torch.log1p(gaps.exp().scatter(1, target[:, None], 0.0).sum(1))
    assert truth.min() < 1e-4  # the regime under test: confident rows
    calls = [lambda: losses.linear_cross_entropy(x, w, target, reduction="none", softcap=softcap)]
    if device == "cuda" and softcap is not None:  # the row passes over whole rows
        calls.append(lambda: losses.cross_entropy(F.linear(x, w), target, reduction="none", softcap=softcap))
    for call in calls:
        relative = (call().double() - truth).abs() / truth
        assert relative.max() < 1e-4, relative.max()


lce = losses.linear_cross_entropy


@pytest.mark.parametrize("case,call,message", [
    ("H differs", lambda x, w, t, b: lce(x[..., :7], w, t, linear_bias=b), "differs from linear_weight"),
    ("linear_weight 1-D", lambda x, w, t, b: lce(x, w[0], t, linear_bias=b), "linear_weight"),
    ("linear_weight dtype", lambda x, w, t, b: lce(x, w.double(), t, linear_bias=b), "linear_weight has dtype"),
    ("linear_bias length", lambda x, w, t, b: lce(x, w, t, linear_bias=b[:5]), "linear_bias must have shape"),
    ("target shape", lambda x, w, t, b: lce(x, w, t[:, :1], linear_bias=b), "target must hold class indices"),
    ("target dtype", lambda x, w, t, b: lce(x, w, t.float(), linear_bias=b),
     r"target of shape \(2, 3\) holds class indices, which must be int64, int32 or uint8, got torch.float32"),
    ("integer probabilities", lambda x, w, t, b: lce(x, w, torch.zeros(2, 3, 20, dtype=torch.long)),
     "floating point"),
    ("ignore_index with probabilities", lambda x, w, t, b: lce(x, w, torch.rand(2, 3, 20), ignore_index=-100),
     "ignore_index cannot be specified"),
    ("class weights length", lambda x, w, t, b: lce(x, w, t, weight=torch.ones(19)), r"weight \(class weights\)"),
    ("class weights dtype", lambda x, w, t, b: lce(x, w, t, weight=torch.ones(20, dtype=torch.float64)),
     "weight has dtype"),
    ("K-dim weight, (N, d, H) input", lambda x, w, t, b: lce(x, w.reshape(5, 4, 8), t), "takes input of shape"),
    ("K-dim weight, process_group", lambda x, w, t, b: lce(x[0], w.reshape(5, 4, 8), torch.zeros(3, 4).long(),
                                                            process_group=object()), "process_group takes"),
    ("class weights, process_group", lambda x, w, t, b: lce(x, w, t, weight=torch.ones(20), process_group=object()),
     "process_group takes"),
    ("softcap", lambda x, w, t, b: lce(x, w, t, linear_bias=b, softcap=0.0), "softcap"),
    ("smoothing", lambda x, w, t, b: lce(x, w, t, linear_bias=b, label_smoothing=-0.1), "smoothing"),
    ("reduction", lambda x, w, t, b: lce(x, w, t, linear_bias=b, reduction="batchmean"), "reduction"),
    ("divisor", lambda x, w, t, b: lce(x, w, t, linear_bias=b, divisor=4), "divisor divides"),
    ("divisor shape", lambda x, w, t, b: lce(x, w, t, linear_bias=b, reduction="sum", divisor=torch.ones(2)),
     "one-element"),
])
def test_bad_input_raises_before_any_work(case, call, message, monkeypatch):
    monkeypatch.setattr(F, "linear", lambda *args: _raise(AssertionError("work began before the checks")))
    with pytest.raises(ValueError, match=message):
        call(*make_inputs((2, 3), 8, 20, torch.float32, "cpu"))


def _raise(error):
    raise error


@pytest.mark.parametrize("case,call,message", [
    ("bias 4th positional", lambda x, w, t, b: lce(x, w, t, b), "the bias is now the keyword linear_bias="),
    ("bias=", lambda x, w, t, b: lce(x, w, t, bias=b), "the bias is now the keyword linear_bias="),
    ("weight= for the linear weight", lambda x, w, t, b: lce(x, weight=w, target=t),
     "the linear layer's weight is now linear_weight"),
])
def test_the_old_signature_gets_a_type_error_that_says_where_arguments_went(case, call, message):
    with pytest.raises(TypeError, match=message):
        call(*make_inputs((2, 3), 8, 20, torch.float32, "cpu"))


def test_the_linear_weight_given_as_class_weights_says_it_is_linear_weight_now():
    x, w, t, b = make_inputs((2, 3), 8, 20, torch.float32, "cpu")
    with pytest.raises(ValueError, match="The linear layer's weight is now linear_weight"):
        lce(x, w, t, weight=w)


def test_the_old_module_constructor_says_it_takes_torchs():
    with pytest.raises(TypeError, match="takes torch 2.14's constructor"):  # torch's: a TypeError too
        losses.LinearCrossEntropyLoss(-100, "mean")  # the old (ignore_index, reduction)
    with pytest.raises(RuntimeError, match="takes torch 2.14's constructor"):  # torch's: a negative size
        losses.LinearCrossEntropyLoss(-100, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matches_float64_on_cuda(options, dtype, grad_of, small_chunks, monkeypatch):
    check_schedule(options, make_inputs((2, 5), 16, 50, dtype, "cuda"), grad_of, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(21, 50257), (21, 4096 + 3), (6000, 300)])
def test_default_chunks_on_cuda(rows, vocab):
    """The chunk width the product picks, with a short, odd last chunk; the row passes with a
    block a row (few rows) and a warp a row (6000: more than 32 a multiprocessor)."""
    options = dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, softcap=30.0)
    inputs = make_inputs((rows,), 64, vocab, torch.bfloat16, "cuda")
    grad_output = torch.ones(())
    check_against_float64(fused(options), reference(options), inputs, grad_of=(0, 1, 3), case=str(vocab),
                          grad_output=grad_output, grad_floors=two_byte_floors(options, inputs, (0, 1, 3), grad_output))


def leaf_inputs(*args):
    """make_inputs' tensors, input, weight and bias requiring grad."""
    x, w, t, b = make_inputs(*args)
    return x.requires_grad_(), w.requires_grad_(), t, b.requires_grad_()


def _training_step(x, w, t, b, **options):
    x.grad = w.grad = b.grad = None
    losses.linear_cross_entropy(x, w, t, linear_bias=b, **options).backward()
    return x.grad, w.grad, b.grad


@pytest.mark.gpu
def test_same_bits_every_run_and_no_host_sync():
    x, w, t, b = leaf_inputs((512,), 128, 5000, torch.bfloat16, "cuda")
    first = _training_step(x, w, t, b, softcap=20.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        second = _training_step(x, w, t, b, softcap=20.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, c in zip(first, second):
        assert torch.equal(a, c)


@pytest.mark.gpu
def test_the_logits_never_exist_whole(monkeypatch):
    """Peak memory of a bf16 training step beyond its inputs and gradients: a chunk of rows in the
    forward, a chunk of classes in backward (plus the matrix products' workspace), where eager
    holds all N x V logits."""
    monkeypatch.setattr(linear_cross_entropy, "CHUNK_BYTES", 1 << 22)
    monkeypatch.setattr(linear_cross_entropy, "MIN_CHUNK_CLASSES", 1024)
    monkeypatch.setattr(linear_cross_entropy, "ROW_CHUNK_BYTES", 1 << 23)
    rows, hidden, vocab = 2048, 256, 32000  # logits: 131 MB in bf16
    x, w, t, b = leaf_inputs((rows,), hidden, vocab, torch.bfloat16, "cuda")
    _training_step(x, w, t, b)  # builds and warms up
    x.grad = w.grad = b.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _training_step(x, w, t, b)
    gradients = sum(tensor.numel() * tensor.element_size() for tensor in (x, w, b))
    extra = torch.cuda.max_memory_allocated() - before - gradients
    allowed = (1 << 23) + (1 << 22) + (16 << 20)  # slack: the matrix products' workspace, the rows' statistics
    assert extra <= allowed, f"{extra / 2**20:.1f} MB beyond the gradients, expected at most {allowed / 2**20:.1f}"


@pytest.mark.gpu
@pytest.mark.parametrize("grad_of", [(0, 1, 3), (1,)], ids=["input, weight and bias", "weight alone"])
def test_a_float32_master_weight_under_autocast(grad_of, monkeypatch):
    """AMP: float32 weight and bias, bf16 autocast: F.linear in bf16 as eager's, d weight and d bias
    summed in float32 over chunks of rows (the gradient itself, returned float32), in the forward."""
    monkeypatch.setattr(linear_cross_entropy, "row_chunk_rows", lambda vocab, element_size, summing=False: 128)
    ran = []
    row_pass = linear_cross_entropy.row_pass
    monkeypatch.setattr(linear_cross_entropy, "row_pass", lambda *args: ran.append(1) or row_pass(*args))
    options = dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, softcap=30.0)

    def autocast(fn):
        def call(*args):
            with torch.autocast("cuda", torch.bfloat16):
                return fn(*args)
        return call

    inputs = make_inputs((3, 150), 64, 1000, torch.float32, "cuda")
    check_against_float64(autocast(fused(options)), autocast(reference(options)), inputs, grad_of=grad_of,
                          floor={torch.float32: autocast_loss_floor(options, inputs)},
                          grad_floors=[FLOOR[torch.float32]] * len(grad_of))
    assert ran


@pytest.mark.gpu
def test_torch_compile_fullgraph_and_cuda_graphs():
    x, w, t, b = leaf_inputs((64,), 32, 1000, torch.float32, "cuda")
    expected = _training_step(x, w, t, b, label_smoothing=0.1)
    step = torch.compile(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1),
                         fullgraph=True)
    x.grad = w.grad = b.grad = None
    step(x, w, t, b).backward()
    for got, want in zip((x.grad, w.grad, b.grad), expected):
        torch.testing.assert_close(got, want)
    # Captured: forward and backward replayed on new inputs in place.
    x.grad = w.grad = b.grad = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _training_step(x, w, t, b, label_smoothing=0.1)
    torch.cuda.current_stream().wait_stream(stream)
    x.grad = w.grad = b.grad = None  # the captured backward makes them, and each replay writes them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = losses.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1)
        loss.backward()
    fresh = make_inputs((64,), 32, 1000, torch.float32, "cuda")
    with torch.no_grad():
        for tensor, new in zip((x, w, t, b), fresh):
            tensor.copy_(new)
    graph.replay()
    x2, w2, t2, b2 = (tensor.detach().clone().requires_grad_(tensor.dtype.is_floating_point) for tensor in fresh)
    want = _training_step(x2, w2, t2, b2, label_smoothing=0.1)
    torch.testing.assert_close(loss, losses.linear_cross_entropy(x2, w2, t2, linear_bias=b2, label_smoothing=0.1))
    for got, expected_grad in zip((x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, expected_grad)


# ----------------------------------------------------------------------------------
# torch 2.14's signature: against torch's own function, its OpInfo samples and its Module where the
# installed torch has them; the fallback (the logits whole) against its definition on any torch.

TORCH_LINEAR_CE = getattr(F, "linear_cross_entropy", None)  # torch 2.14+
needs_torchs = pytest.mark.skipif(TORCH_LINEAR_CE is None, reason="torch < 2.14 has no F.linear_cross_entropy")


def class_weights_for(x, classes):
    """0.5 to 1.5, bfloat16 values: every dtype holds them, so the float64 truth weighs as the dtype does."""
    return torch.linspace(0.5, 1.5, classes, device=x.device).to(torch.bfloat16).to(x.dtype)


def make_case(rows, hidden, classes, dtype, probabilities, ignore_index=None, out_features=(), target_dtype=None):
    """[input (*rows, H), linear_weight (C, *out_features, H), target, linear_bias (C, *out_features)]: class
    indices (a quarter ignore_index, where rows has more than one row) or probabilities."""
    x = torch.randn(*rows, hidden).to(dtype)
    w = (torch.randn(classes, *out_features, hidden) / hidden**0.5).to(dtype)
    b = torch.randn(classes, *out_features).mul(0.1).to(dtype)
    if probabilities:
        t = torch.randn(*rows, classes, *out_features).softmax(len(rows)).to(dtype)
    else:
        t = torch.randint(0, classes, (*rows, *out_features))
        if rows and target_dtype != torch.uint8:  # -100 is no uint8
            t = t.masked_fill(torch.rand(t.shape) < 0.25, -100 if ignore_index is None else ignore_index)
        t = t.to(target_dtype or torch.int64)
    return [x, w, t, b]


def check_path(monkeypatch, whole: bool):
    """Records the path taken: returns a function that asserts the fallback ran iff `whole`."""
    ran = []
    logits_whole = linear_cross_entropy._logits_whole
    monkeypatch.setattr(linear_cross_entropy, "_logits_whole", lambda *args: ran.append(1) or logits_whole(*args))
    return lambda case: (assert_path(bool(ran), whole, case))


def assert_path(ran: bool, whole: bool, case: str) -> None:
    assert ran == whole, f"{case}: the logits whole {'did not run' if whole else 'ran'}"


def with_class_weights(function, keywords):
    """function(x, w, t, b, **keywords), keywords' weight=True made class weights of x's dtype."""
    keywords = dict(keywords)
    weighted = keywords.pop("weight", False)
    return lambda x, w, t, b: function(x, w, t, linear_bias=b, weight=class_weights_for(x, w.shape[0]) if weighted
                                       else None, **keywords)


# name: (rows, probabilities, keywords (weight=True: class weights), target dtype); 50 classes, 3 chunks of 16
TORCH_CASES = {
    "class indices, ignore_index None": ((11,), False, {}, None),
    "ignore_index 7, sum": ((11,), False, dict(ignore_index=7, reduction="sum"), None),
    "none, label_smoothing": ((11,), False, dict(reduction="none", label_smoothing=0.1), None),
    "unbatched (H,)": ((), False, {}, None),
    "uint8 class indices": ((11,), False, {}, torch.uint8),
    "class weights": ((11,), False, dict(weight=True), None),
    "class weights, ignore_index 7, label_smoothing, none": (
        (11,), False, dict(weight=True, ignore_index=7, label_smoothing=0.1, reduction="none"), None),
    "probabilities": ((11,), True, {}, None),
    "probabilities, class weights, label_smoothing, sum": (
        (11,), True, dict(weight=True, label_smoothing=0.1, reduction="sum"), None),
    "unbatched probabilities, none": ((), True, dict(reduction="none"), None),
}


@needs_torchs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", TORCH_CASES)
def test_matches_torchs_linear_cross_entropy(case, dtype, small_chunks, monkeypatch):
    """Ours and torch's F.linear_cross_entropy(..., options=None) against float64: loss and the gradients
    of input, linear_weight, linear_bias (and of probabilities); class weights and probabilities take
    the fallback, the rest the row passes."""
    rows, probabilities, keywords, target_dtype = TORCH_CASES[case]
    inputs = make_case(rows, 16, 50, dtype, probabilities, keywords.get("ignore_index"), target_dtype=target_dtype)
    assert_path_taken = check_path(monkeypatch, whole=probabilities or "weight" in keywords)
    check_against_float64(with_class_weights(losses.linear_cross_entropy, keywords),
                          with_class_weights(TORCH_LINEAR_CE, keywords), inputs,
                          grad_of=(0, 1, 2, 3) if probabilities else (0, 1, 3), case=case)
    assert_path_taken(case)


def definition(x, w, t, linear_bias, **keywords):
    """F.linear_cross_entropy's definition, for torch < 2.14 too: the logits whole, then definition_of_logits."""
    return definition_of_logits(F.linear(x, w.reshape(-1, w.shape[-1]), linear_bias.reshape(-1)), x.shape, w.shape,
                                t, **keywords)


def definition_of_logits(logits, x_shape, w_shape, t, weight=None, reduction="mean", ignore_index=-100,
                         label_smoothing=0.0):
    """F.cross_entropy of F.linear's logits (x_shape[:-1], prod(w_shape[:-1])): (N, C, d1, ..., dK) for a
    K-dimensional w, rows of classes for (..., H) input."""
    if len(w_shape) > 2:
        logits = logits.reshape(x_shape[0], *w_shape[:-1])
    else:
        logits, t = logits.reshape(-1, w_shape[0]), (t.reshape(-1, w_shape[0]) if t.is_floating_point()
                                                      else t.reshape(-1))
    loss = F.cross_entropy(logits, t, weight=weight, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    return loss.reshape(x_shape[:-1]) if reduction == "none" and len(w_shape) == 2 else loss


def check_fallback(case, inputs, keywords):
    """The fallback (the logits whole) against definition in float64, float32's floors by float32_floors."""
    x, w = inputs[:2]
    ours = with_class_weights(losses.linear_cross_entropy, keywords)
    truth = with_class_weights(definition, {**keywords, "ignore_index": keywords.get("ignore_index", -100)})
    as_float64 = [v.double() if v.is_floating_point() else v for v in inputs]
    grad_output = default_grad_output(truth, as_float64)
    grad_of = (0, 1, 2, 3) if inputs[2].is_floating_point() else (0, 1, 3)
    floors = {}
    if x.dtype == torch.float32:
        options = {name: value for name, value in keywords.items() if name != "weight"}
        weight = class_weights_for(as_float64[0], w.shape[0]) if keywords.get("weight") else None
        loss_floor, floors["grad_floors"] = float32_floors(
            lambda logits, t: definition_of_logits(logits, x.shape, w.shape, t, weight=weight, **options),
            options.get("reduction", "mean") != "none", inputs, grad_of, grad_output)
        floors["floor"] = {torch.float32: loss_floor}
    check_against_float64(ours, truth, inputs, grad_of=grad_of, grad_output=grad_output, case=case, **floors)


# name: (rows, probabilities, keywords (weight=True: class weights), out_features); 5 classes
FALLBACK_CASES = {
    "class weights, (2, 5, H) input": ((2, 5), False, dict(weight=True), ()),
    "probabilities, (2, 5, H) input, none": ((2, 5), True, dict(reduction="none"), ()),
    "K-dimensional (C, 3, H), bias (C, 3)": ((7,), False, {}, (3,)),
    "K-dimensional (C, 2, 3, H), probabilities, none": ((7,), True, dict(reduction="none"), (2, 3)),
    "K-dimensional, class weights, ignore_index 1, label_smoothing, sum": (
        (7,), False, dict(weight=True, ignore_index=1, label_smoothing=0.1, reduction="sum"), (3,)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", FALLBACK_CASES)
def test_the_fallback_matches_the_definition_on_any_torch(case, dtype, monkeypatch):
    rows, probabilities, keywords, out_features = FALLBACK_CASES[case]
    inputs = make_case(rows, 8, 5, dtype, probabilities, keywords.get("ignore_index"), out_features)
    assert_path_taken = check_path(monkeypatch, whole=True)
    check_fallback(case, inputs, keywords)
    assert_path_taken(case)


def test_the_fallback_divides_by_divisor():
    x, w, t, b = make_case((11,), 8, 5, torch.float64, probabilities=True)
    loss, lse = losses.linear_cross_entropy(x, w, t, linear_bias=b, reduction="sum", divisor=7, return_lse=True)
    torch.testing.assert_close(loss, definition(x, w, t, b, reduction="sum") / 7)
    torch.testing.assert_close(lse, torch.logsumexp(F.linear(x, w, b), -1))


@pytest.mark.parametrize("probabilities", [False, True], ids=["class weights", "probabilities"])
def test_the_fallback_takes_softcap_and_divisor(probabilities):
    """The logits whole (class weights; probabilities) against torch's formula on capped logits, the sum over
    divisor, without return_lse. Fails if _logits_whole drops softcap=, or linear_cross_entropy drops divisor=
    where return_lse is False."""
    keywords = dict(reduction="sum", label_smoothing=0.1, weight=not probabilities)

    def theirs(x, w, t, linear_bias, weight=None, **keywords):
        logits = 3.0 * torch.tanh(F.linear(x, w, linear_bias) / 3.0)
        return F.cross_entropy(logits, t, weight=weight, **keywords) / 7
    check_against_float64(with_class_weights(lambda *args, **more: losses.linear_cross_entropy(
                              *args, **more, softcap=3.0, divisor=7), keywords),
                          with_class_weights(theirs, keywords), make_case((11,), 8, 5, torch.float64, probabilities),
                          grad_of=(0, 1, 2, 3) if probabilities else (0, 1, 3))


def test_the_fallback_returns_the_lse_in_targets_shape():
    x, w, t, b = make_case((2, 5), 8, 6, torch.float64, probabilities=True)
    loss, lse = losses.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none", return_lse=True)
    torch.testing.assert_close(lse, torch.logsumexp(F.linear(x, w, b), -1))
    torch.testing.assert_close(loss, definition(x, w, t, b, reduction="none"))


OPINFO_SAMPLES = """
import sys, types, unittest
import torch
try:
    import expecttest  # noqa: F401  (a test dependency of torch's, which requirements.txt leaves out)
except ImportError:  # its TestCase is all that importing torch's test module needs of it
    sys.modules["expecttest"] = stand_in = types.ModuleType("expecttest")
    stand_in.TestCase, stand_in.ACCEPT = unittest.TestCase, False
from torch.testing._internal.common_methods_invocations import sample_inputs_linear_cross_entropy
torch.manual_seed(int(sys.argv[2]))
torch.save([(sample.input, sample.args, sample.kwargs) for dtype in (torch.float64, torch.float32)
            for sample in sample_inputs_linear_cross_entropy(None, "cpu", dtype, True)], sys.argv[1])
"""


@pytest.fixture(scope="module")
def torchs_opinfo_samples(tmp_path_factory):
    """torch's OpInfo samples of F.linear_cross_entropy (options=None; float64 and float32, inputs that
    require grad), made in a subprocess: importing torch's test module forbids setting torch.backends
    flags for the rest of the process that imports it."""
    from conftest import SEED
    path = tmp_path_factory.mktemp("opinfo") / "samples.pt"
    made = subprocess.run([sys.executable, "-c", OPINFO_SAMPLES, str(path), str(SEED)], capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-4000:]
    return torch.load(path)


@needs_torchs
def test_torchs_opinfo_samples(torchs_opinfo_samples):
    """Every sample (unbatched, K-dimensional weights, class weights, ignore_index, linear_bias, class
    probabilities that require grad): ours gives torch's loss and gradients, from the same grad_output."""
    assert len(torchs_opinfo_samples) > 100  # 119 a dtype in torch 2.14
    for index, (input, args, kwargs) in enumerate(torchs_opinfo_samples):
        case = (f"sample {index}: input {tuple(input.shape)} {input.dtype}, linear_weight {tuple(args[0].shape)}, "
                f"target {tuple(args[1].shape)} {args[1].dtype}, {sorted(kwargs)} {kwargs.get('reduction')}")
        wanted = [t for t in (input, args[0], args[1], kwargs.get("linear_bias")) if t is not None and t.requires_grad]
        theirs = TORCH_LINEAR_CE(input, *args, **kwargs)
        grad_output = torch.rand_like(theirs) + 0.5
        ours = losses.linear_cross_entropy(input, *args, **kwargs)
        for got, expected in zip([ours, *torch.autograd.grad(ours, wanted, grad_output)],
                                 [theirs, *torch.autograd.grad(theirs, wanted, grad_output)]):
            torch.testing.assert_close(got, expected, msg=lambda message: f"{case}: {message}")


def test_the_module_owns_its_linear_layer():
    """torch's constructor; the class weights a buffer; forward(input, target) is the function of its
    linear layer's weight and bias, with every option handed on; gradients reach the layer."""
    weight = torch.rand(20, dtype=torch.float64) + 0.5
    module = losses.LinearCrossEntropyLoss(8, 20, bias=True, dtype=torch.float64, reduction="sum", weight=weight,
                                           ignore_index=3, label_smoothing=0.1, z_loss=1e-2, softcap=4.0,
                                           return_lse=True)
    assert isinstance(module.linear, nn.Linear) and module.linear.weight.shape == (20, 8)
    assert module.linear.weight.dtype == torch.float64 and module.linear.bias.shape == (20,)
    assert list(module.state_dict()) == ["weight", "linear.weight", "linear.bias"]  # torch's _WeightedLoss buffer
    x, t = torch.randn(2, 5, 8, dtype=torch.float64), torch.randint(0, 20, (2, 5))
    loss, lse = module(x, t)
    expected, expected_lse = losses.linear_cross_entropy(
        x, module.linear.weight, t, linear_bias=module.linear.bias, weight=weight, reduction="sum", ignore_index=3,
        label_smoothing=0.1, z_loss=1e-2, softcap=4.0, return_lse=True)
    assert torch.equal(loss, expected) and torch.equal(lse, expected_lse)
    loss.backward()
    assert module.linear.weight.grad is not None and module.linear.bias.grad is not None
    assert list(losses.LinearCrossEntropyLoss(8, 20).state_dict()) == ["linear.weight"]  # no bias, no class weights


def test_the_k_dimensional_module_reshapes_its_linear_layer():
    module = losses.LinearCrossEntropyLoss(8, 5, out_features=(3,), bias=True, dtype=torch.float64)
    assert module.linear.weight.shape == (15, 8) and module.linear.bias.shape == (15,)
    x, t = torch.randn(7, 8, dtype=torch.float64), torch.randint(0, 5, (7, 3))
    expected = definition(x, module.linear.weight.reshape(5, 3, 8), t, module.linear.bias.reshape(5, 3))
    torch.testing.assert_close(module(x, t), expected)


@needs_torchs
@pytest.mark.parametrize("config", [dict(), dict(bias=True, weight=True, reduction="none"),
                                    dict(out_features=(3,), bias=True),
                                    dict(ignore_index=2, label_smoothing=0.1, reduction="sum")], ids=str)
def test_the_module_matches_torchs(config):
    """The same state_dict keys, each module loads the other's, and the same loss and gradients."""
    config = {**config, "weight": torch.rand(5, dtype=torch.float64) + 0.5 if config.get("weight") else None}
    ours = losses.LinearCrossEntropyLoss(8, 5, dtype=torch.float64, **config)
    theirs = torch.nn.LinearCrossEntropyLoss(8, 5, dtype=torch.float64, **config)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 5, (7, *config.get("out_features", ())))
    results = []
    for module in (ours, theirs):
        loss = module(x, t)
        results.append([loss, *torch.autograd.grad(loss, [x, *module.linear.parameters()], torch.ones_like(loss))])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


@needs_torchs
@pytest.mark.parametrize("case,call", [
    ("H differs", lambda m, x, w, t, b: m.linear_cross_entropy(x, w[:, :7], t)),
    ("linear_weight 1-D", lambda m, x, w, t, b: m.linear_cross_entropy(x, w[0], t)),
    ("K-dim linear_weight, (N, d, H) input", lambda m, x, w, t, b: m.linear_cross_entropy(
        x[None], w.reshape(5, 4, 8), torch.zeros(1, 6, 4, dtype=torch.int64))),
    ("class weights length", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, weight=torch.ones(19))),
    ("class weights dtype", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, weight=torch.ones(20).double())),
    ("linear_weight dtype", lambda m, x, w, t, b: m.linear_cross_entropy(x, w.double(), t)),
    ("linear_bias dtype", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, linear_bias=b.double())),
    ("linear_bias length", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, linear_bias=b[:5])),
    ("target on another device", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t.to("meta"))),
    ("class weights on another device", lambda m, x, w, t, b: m.linear_cross_entropy(
        x, w, t, weight=torch.ones(20, device="meta"))),
    ("linear_bias on another device", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, linear_bias=b.to("meta"))),
    ("input on another device", lambda m, x, w, t, b: m.linear_cross_entropy(x.to("meta"), w, t)),
    ("float class indices", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t.float())),
    ("class indices of two dims", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t[:, None])),
    ("class indices of another batch", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t[:5])),  # torch: ValueError
    ("integer probabilities", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, torch.zeros(6, 20).long())),
    ("ignore_index with probabilities", lambda m, x, w, t, b: m.linear_cross_entropy(
        x, w, torch.rand(6, 20), ignore_index=-100)),
    ("label_smoothing above 1", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, label_smoothing=1.5)),
    ("reduction", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, reduction="batchmean")),  # torch: ValueError
    ("class weights a list", lambda m, x, w, t, b: m.linear_cross_entropy(x, w, t, weight=[1.0] * 20)),
    ("module, class weights length", lambda m, x, w, t, b: m.LinearCrossEntropyLoss(8, 20, weight=torch.ones(19))),
    ("module, input width", lambda m, x, w, t, b: m.LinearCrossEntropyLoss(7, 20)(x, t)),
    ("module, old constructor", lambda m, x, w, t, b: m.LinearCrossEntropyLoss(-100, "mean")),  # torch: TypeError
    ("module, a negative size", lambda m, x, w, t, b: m.LinearCrossEntropyLoss(-100, 20)),
])
def test_bad_calls_raise_what_torch_raises(case, call):
    """Code that catches torch's error for a bad call catches ours (torch's RuntimeErrors are
    ArgumentErrors here, still ValueErrors too). Not here: a list for input, linear_weight, target or
    linear_bias, on which torch's Python code raises AttributeError and ours TypeError (the test below)."""
    x, w, b, t = torch.randn(6, 8), torch.randn(20, 8), torch.randn(20), torch.randint(0, 20, (6,))
    torchs = types.SimpleNamespace(linear_cross_entropy=TORCH_LINEAR_CE,
                                   LinearCrossEntropyLoss=torch.nn.LinearCrossEntropyLoss)
    raises_as_torch(lambda: call(losses, x, w, t, b), lambda: call(torchs, x, w, t, b))


@pytest.mark.parametrize("name", ["input", "linear_weight", "target", "linear_bias", "weight"])
def test_a_non_tensor_gets_a_type_error_that_names_it(name):
    x, w, t, b = make_inputs((6,), 8, 20, torch.float32, "cpu")
    arguments = dict(input=x, linear_weight=w, target=t, linear_bias=b, weight=torch.ones(20))
    arguments[name] = arguments[name].tolist()
    with pytest.raises(TypeError, match=f"linear_cross_entropy: {name} must be a Tensor, got list"):
        lce(**arguments)


def test_an_argument_error_with_a_process_group_keeps_its_type():
    """As cross_entropy's: vocab_parallel.raise_on_every_rank, without a group to tell, raises the
    checks' error as it was."""
    x, w, t, b = make_inputs((6,), 8, 20, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"weight \(class weights\) must have shape \(20,\)"):
        lce(x, w, t, weight=torch.ones(19), process_group=object())


@pytest.mark.skipif(linear_cross_entropy._TORCH_OPTIONS is None, reason="torch < 2.14: no LinearCrossEntropyOptions")
def test_torchs_options_change_no_result():
    """chunking_method and the accumulation options are torch's chunked path's; ours gives the same bits with
    any (float32: d linear_weight is summed in float32 anyway). acc_policy="accurate" maps to a float32 sum
    of d linear_weight, batch_chunk_size to the rows a chunk (test_batch_chunk_size_sets_the_rows_a_chunk);
    options of another type raise."""
    options_class = torch.nn.LinearCrossEntropyOptions
    x, w, t, b = make_inputs((6,), 8, 20, torch.float32, "cpu")
    x.requires_grad_(), w.requires_grad_()

    def step(options):
        loss = losses.linear_cross_entropy(x, w, t, linear_bias=b, options=options)
        return [loss, *torch.autograd.grad(loss, [x, w])]
    expected = step(None)
    for options in (options_class(), options_class(allow_retain_graph=True),
                    options_class(acc_policy="accurate", acc_dtype=torch.float64),
                    options_class(chunking_method="aspect_ratio:4")):
        for got, want in zip(step(options), expected):
            assert torch.equal(got, want), options
    assert linear_cross_entropy._from_torch_options(None) == {}
    for policy, float32 in (("accurate", True), ("compact", False), ("auto", False)):
        mapped = linear_cross_entropy._from_torch_options(options_class(acc_policy=policy))
        assert mapped == {"float32_weight_sum": float32, "chunk_rows": 0, "allow_retain_graph": False}
    with pytest.raises(ValueError, match="options must be None or a torch.nn.LinearCrossEntropyOptions"):
        losses.linear_cross_entropy(x, w, t, options={"acc_policy": "accurate"})


@pytest.mark.skipif(linear_cross_entropy._TORCH_OPTIONS is None, reason="torch has no LinearCrossEntropyOptions")
def test_allow_retain_graph_allows_a_second_backward():
    """torch's option: the forward-written gradients scaled into new tensors, each backward alike."""
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    x.requires_grad_(), w.requires_grad_()
    loss = losses.linear_cross_entropy(x, w, t, linear_bias=b,
                                       options=linear_cross_entropy._TORCH_OPTIONS(allow_retain_graph=True))
    first = torch.autograd.grad(loss, [x, w], torch.tensor(2.0, dtype=torch.float64), retain_graph=True)
    second = torch.autograd.grad(loss, [x, w], torch.tensor(2.0, dtype=torch.float64))
    expected = torch.autograd.grad(reference(dict(reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None))(
        x, w, t, b), [x, w], torch.tensor(2.0, dtype=torch.float64))
    for a, c, e in zip(first, second, expected):
        assert torch.equal(a, c)
        torch.testing.assert_close(a, e)


@pytest.mark.skipif(linear_cross_entropy._TORCH_OPTIONS is not None, reason="torch has LinearCrossEntropyOptions")
def test_without_torchs_options_class_options_are_read_where_they_map():
    options = types.SimpleNamespace(acc_policy="accurate", batch_chunk_size=2)
    assert linear_cross_entropy._from_torch_options(options) == {"float32_weight_sum": True, "chunk_rows": 2,
                                                                 "allow_retain_graph": False}
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    assert torch.equal(losses.linear_cross_entropy(x, w, t, options=options), losses.linear_cross_entropy(x, w, t))
    for rows in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="options.batch_chunk_size must be a positive int or None"):
            losses.linear_cross_entropy(x, w, t, options=types.SimpleNamespace(batch_chunk_size=rows))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trains", [False, True])
def test_batch_chunk_size_sets_the_rows_a_chunk(weight_dtype, trains, monkeypatch):
    """torch's batch_chunk_size: the rows a chunk of the row schedules (a frozen head; a float32 d weight summed
    over the chunks; a 2-byte one's forward), the same results as one chunk to the sums' order."""
    options = (torch.nn.LinearCrossEntropyOptions(batch_chunk_size=3) if linear_cross_entropy._TORCH_OPTIONS
               else types.SimpleNamespace(batch_chunk_size=3))
    x, w, t, b = make_inputs((10,), 16, 50, weight_dtype, "cpu")
    x.requires_grad_(), w.requires_grad_(trains)
    heights = []
    rows_in_forward = linear_cross_entropy.rows_in_forward
    monkeypatch.setattr(linear_cross_entropy, "rows_in_forward",
                        lambda *args, **kwargs: heights.append(kwargs["chunk_rows"]) or rows_in_forward(*args, **kwargs))
    chunks = []
    fold_stats = linear_cross_entropy.row_passes.fold_stats
    monkeypatch.setattr(linear_cross_entropy.row_passes, "fold_stats",
                        lambda z, *args, **kwargs: chunks.append(z.shape[0]) or fold_stats(z, *args, **kwargs))

    def step(options):
        x.grad = w.grad = None
        loss = losses.linear_cross_entropy(x, w, t, linear_bias=b, options=options)
        loss.backward()
        return [loss, x.grad] + ([w.grad] if trains else [])
    whole = step(None)
    assert heights == [0]
    del heights[:], chunks[:]
    chunked = step(options)
    assert heights == [3] and chunks[:4] == [3, 3, 3, 1]  # the forward's chunks of rows (then classes, bf16)
    tolerance = 1e-2 if weight_dtype == torch.bfloat16 else 1e-5
    for got, want in zip(chunked, whole):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_acc_policy_accurate_sums_a_bfloat16_weights_gradient_in_float32(small_chunks, monkeypatch):
    """torch's acc_policy="accurate": d linear_weight summed in float32 over chunks of rows in the forward (the
    "rows" schedule), where a bfloat16 weight otherwise takes "rows_then_classes"."""
    options = (torch.nn.LinearCrossEntropyOptions(acc_policy="accurate") if linear_cross_entropy._TORCH_OPTIONS
               else types.SimpleNamespace(acc_policy="accurate"))
    schedules = []
    choose = linear_cross_entropy.choose_schedule
    monkeypatch.setattr(linear_cross_entropy, "choose_schedule",
                        lambda *args, **kwargs: schedules.append(choose(*args, **kwargs)) or schedules[-1])
    inputs = make_inputs((2, 5), 16, 50, torch.bfloat16, "cpu")
    check_against_float64(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, options=options),
                          reference(OPTIONS[0]), inputs, grad_of=(1, 3))
    assert schedules[0] == "rows"
    losses.linear_cross_entropy(inputs[0], inputs[1].requires_grad_(), inputs[2])  # the forward alone
    assert schedules[-1] == "rows_then_classes"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["class weights, (2, 5, H) input", "probabilities, (2, 5, H) input, none",
                                  "K-dimensional (C, 2, 3, H), probabilities, none"])
def test_the_fallback_on_cuda_and_strict_mode_refusing_it(case, monkeypatch):
    rows, probabilities, keywords, out_features = FALLBACK_CASES[case]
    inputs = [t.cuda() for t in make_case(rows, 8, 5, torch.float32, probabilities, None, out_features)]
    ours = with_class_weights(losses.linear_cross_entropy, keywords)
    with pytest.raises(RuntimeError, match="FUSED_LOSSES_STRICT"):
        ours(*inputs)
    monkeypatch.delenv("FUSED_LOSSES_STRICT")
    check_fallback(case, inputs, keywords)


@pytest.mark.gpu
def test_an_unbatched_ignored_target_on_cuda_is_torchs_zero():
    """torch's CUDA cross_entropy of (C,) logits with an ignored target gives 0, not 0 / 0."""
    x, w, _, b = make_case((), 8, 5, torch.float32, probabilities=False)
    x, w, b, t = x.cuda(), w.cuda(), b.cuda(), torch.tensor(-100, device="cuda")
    torch.testing.assert_close(losses.linear_cross_entropy(x, w, t, linear_bias=b), F.cross_entropy(F.linear(x, w, b), t))
