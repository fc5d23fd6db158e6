"""linear_cross_entropy: F.cross_entropy(F.linear(input, weight, bias), target) a chunk of rows
at a time. Every option and the gradients of input, weight and bias against float64, on CPU
(and CUDA), with chunks small enough that the rows span several; bad input raises first."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_ce
import losses
from helpers import check_against_float64

OPTIONS = [dict(reduction=reduction, label_smoothing=smoothing, z_loss=z, softcap=softcap)
           for reduction, smoothing, z, softcap in itertools.product(
               ["mean", "sum", "none"], [0.0, 0.1], [0.0, 1e-2], [None, 5.0])]


def reference(options, ignore_index=-100):
    """torch's formula: the linear, the cap, then cross-entropy (plus the z-loss term)."""
    def loss(x, w, t, b):
        logits = F.linear(x, w, b)
        if options["softcap"] is not None:
            logits = options["softcap"] * torch.tanh(logits / options["softcap"])
        logits = logits.reshape(-1, logits.shape[-1])
        value = losses._torch_cross_entropy(logits, t.reshape(-1), None, ignore_index, options["reduction"],
                                            options["label_smoothing"], options["z_loss"], False)
        return value.reshape(t.shape) if options["reduction"] == "none" else value
    return loss


def fused(options, ignore_index=-100):
    return lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, ignore_index=ignore_index, **options)


def make_inputs(shape, hidden, vocab, dtype, device, target_dtype=torch.int64):
    x = torch.randn(*shape, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, device=device).mul(0.1).to(dtype)
    t = torch.randint(0, vocab, shape, device=device)
    t = t.masked_fill(torch.rand(shape, device=device) < 0.25, -100).to(target_dtype)
    return [x, w, t, b]


@pytest.fixture
def small_chunks(monkeypatch):
    """Three rows a chunk for 50 classes: the rows span several chunks, the last one short."""
    monkeypatch.setattr(linear_ce, "CHUNK_LOGITS", 3 * 50)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matches_float64_on_cpu(options, dtype, small_chunks):
    inputs = make_inputs((2, 5), 16, 50, dtype, "cpu")
    check_against_float64(fused(options), reference(options), inputs, grad_of=(0, 1, 3), case=str(options))


@pytest.mark.parametrize("options", OPTIONS[:4], ids=str)
def test_without_bias_int32_targets_and_an_ignore_index_of_our_own(options, small_chunks):
    inputs = make_inputs((11,), 16, 50, torch.float32, "cpu", target_dtype=torch.int32)
    inputs[2] = inputs[2].masked_fill(inputs[2] == -100, 7)
    check_against_float64(lambda x, w, t: fused(options, ignore_index=7)(x, w, t, None),
                          lambda x, w, t: reference(options, ignore_index=7)(x, w, t.long(), None),
                          inputs[:3], grad_of=(0, 1), case=str(options))


def test_return_lse_and_the_module():
    x, w, t, b = make_inputs((4, 3), 8, 20, torch.float64, "cpu")
    loss, lse = losses.LinearCrossEntropyLoss(return_lse=True, softcap=3.0)(x, w, t, b)
    logits = 3.0 * torch.tanh(F.linear(x, w, b) / 3.0)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert lse.shape == t.shape and not lse.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 20), t.reshape(-1)))


def test_every_row_ignored_gives_torchs_nan_and_zero_gradients():
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    x.requires_grad_()
    loss = losses.linear_cross_entropy(x, w, torch.full_like(t, -100), b)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_a_class_outside_the_vocabulary_gives_nan_for_its_row_only():
    """As cross_entropy's kernels: no device-side assert (it would poison a CUDA context)."""
    x, w, t, b = make_inputs((4,), 8, 20, torch.float64, "cpu")
    t = torch.tensor([3, 20, -100, -5])
    x.requires_grad_()
    rows = losses.linear_cross_entropy(x, w, t, b, reduction="none")
    assert torch.isnan(rows[[1, 3]]).all() and rows[2] == 0
    torch.testing.assert_close(rows[0], F.cross_entropy(F.linear(x[:1], w, b), t[:1], reduction="none")[0])
    rows.sum().backward()
    assert torch.isnan(x.grad[[1, 3]]).all() and not torch.isnan(x.grad[[0, 2]]).any()


@pytest.mark.parametrize("case,call,message", [
    ("H differs", lambda x, w, t, b: losses.linear_cross_entropy(x[..., :7], w, t, b), "differs from weight"),
    ("weight dtype", lambda x, w, t, b: losses.linear_cross_entropy(x, w.double(), t, b), "weight has dtype"),
    ("bias length", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b[:5]), "bias must have shape"),
    ("target shape", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t[:, :1], b), "leading shape"),
    ("target dtype", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t.float(), b), "class indices"),
    ("softcap", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, softcap=0.0), "softcap"),
    ("smoothing", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, label_smoothing=-0.1), "smoothing"),
    ("reduction", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, reduction="batchmean"), "reduction"),
])
def test_bad_input_raises_before_any_work(case, call, message):
    with pytest.raises(ValueError, match=message):
        call(*make_inputs((2, 3), 8, 20, torch.float32, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matches_float64_on_cuda(options, small_chunks, monkeypatch):
    monkeypatch.delenv("FUSED_LOSSES_STRICT")  # torch ops for now: strict mode refuses them
    inputs = make_inputs((2, 5), 16, 50, torch.float32, "cuda")
    check_against_float64(fused(options), reference(options), inputs, grad_of=(0, 1, 3), case=str(options))


@pytest.mark.gpu
def test_strict_mode_refuses_the_torch_op_path_on_cuda():
    with pytest.raises(RuntimeError, match="no fused kernel yet"):
        losses.linear_cross_entropy(*make_inputs((2, 3), 8, 20, torch.float32, "cuda"))
