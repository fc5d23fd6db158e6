"""linear_cross_entropy: F.cross_entropy(F.linear(input, weight, bias), target) a chunk of the
vocabulary at a time. Every option and the gradients of input, weight and bias against float64,
on CPU and CUDA, with chunks small enough that the classes span several; bad input raises first;
on CUDA: bounded memory, no host sync, the same bits every run, torch.compile and CUDA graphs."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import linear_cross_entropy
import cross_entropy
import losses
from helpers import check_against_float64 as check_float64


def check_against_float64(*args, **kwargs):
    """Gradients norm-wise only: d input and d weight are matrix products of the rounded d logits,
    within 1 ulp of float64 element by element no more than eager's."""
    return check_float64(*args, grads_within_ulps=False, **kwargs)

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
        value = cross_entropy.reference_cross_entropy(logits, t.reshape(-1), None, ignore_index, options["reduction"],
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
    """16 classes a chunk: 50 classes span four chunks, the last one 2 wide (the kernels' unvectorized
    path); 3 rows a row chunk: 10 rows span four, the last one row."""
    monkeypatch.setattr(linear_cross_entropy, "chunk_width", lambda rows, vocab, element_size: 16)
    monkeypatch.setattr(linear_cross_entropy, "row_chunk_rows", lambda vocab, element_size, summing=False: 3)


# The gradients wanted pick the schedule (choose_schedule): for input's alone (a frozen head), or
# with d weight in the accumulation type, the rows; a 2-byte d weight, or 'none' with d weight,
# the rows then chunks of classes in backward.
GRADS_OF = {"input, weight and bias": (0, 1, 3), "input alone": (0,), "weight alone": (1,)}


def schedule_of(options, inputs, grad_of):
    x, w, t, b = inputs
    wants = tuple(i in grad_of for i in (0, 1, 3))
    return linear_cross_entropy.choose_schedule(wants, options["reduction"], w.dtype, x.dtype, None)


def check_schedule(options, inputs, grad_of, monkeypatch):
    """check_against_float64 of a case, and that the passes of the schedule it calls for ran."""
    ran = []
    for name in ("row_pass", "loss_pass", "gradient_pass"):
        monkeypatch.setattr(linear_cross_entropy, name,
                            lambda *args, _name=name, _pass=getattr(linear_cross_entropy, name): ran.append(_name)
                            or _pass(*args))
    check_against_float64(fused(options), reference(options), inputs, grad_of=grad_of, case=str(options))
    schedule = schedule_of(options, inputs, grad_of)
    expected = {"rows": {"row_pass"}, "rows_then_classes": {"row_pass", "gradient_pass"},
                "classes": {"loss_pass", "gradient_pass"}}[schedule]
    assert expected <= set(ran), (set(ran), expected)  # beside the no-grad call's passes (eval)
    assert schedule != "rows" or "gradient_pass" not in ran


def test_the_schedule_follows_the_wanted_gradients_and_their_dtype():
    choose = linear_cross_entropy.choose_schedule
    f32, bf16 = torch.float32, torch.bfloat16
    assert choose((False, False, False), "mean", bf16, bf16, None) == "rows"  # eval
    assert choose((True, False, False), "none", bf16, bf16, None) == "rows"  # frozen head
    assert choose((True, True, True), "mean", f32, bf16, None) == "rows"  # float32 master weight
    assert choose((True, True, False), "sum", f32, f32, None) == "rows"
    assert choose((True, True, False), "mean", bf16, bf16, None, float32_weight_sum=True) == "rows"
    assert choose((True, True, False), "mean", bf16, bf16, None) == "rows_then_classes"
    assert choose((False, False, True), "mean", bf16, bf16, None) == "rows_then_classes"
    assert choose((True, True, False), "none", f32, f32, None) == "rows_then_classes"
    assert choose((True, False, False), "mean", bf16, bf16, object()) == "classes"  # a process group
    assert choose((True, False, False), "mean", torch.float16, torch.float16, None) == "classes"
    assert choose((False, False, False), "mean", torch.float16, torch.float16, None) == "rows"


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
@pytest.mark.parametrize("divisor", [7, torch.tensor(7.0), torch.tensor(7)], ids=["int", "float tensor", "int tensor"])
def test_divisor_divides_the_sum(divisor, grad_of, small_chunks):
    """num_items_in_batch's reduction: the sum over divisor, in the forward's gradients."""
    options = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-2, softcap=5.0)
    check_against_float64(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, divisor=divisor, **options),
                          lambda x, w, t, b: reference(options)(x, w, t, b) / 7, make_inputs((2, 5), 16, 50,
                                                                                             torch.float32, "cpu"),
                          grad_of=grad_of)


def test_a_second_backward_of_forward_written_gradients_raises():
    x, w, t, b = make_inputs((6,), 8, 20, torch.float64, "cpu")
    loss = losses.linear_cross_entropy(x.requires_grad_(), w, t, b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("grad_of", GRADS_OF.values(), ids=GRADS_OF)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_matches_float64_on_cpu(options, dtype, grad_of, small_chunks, monkeypatch):
    check_schedule(options, make_inputs((2, 5), 16, 50, dtype, "cpu"), grad_of, monkeypatch)


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


@pytest.mark.parametrize("case,call,message", [
    ("H differs", lambda x, w, t, b: losses.linear_cross_entropy(x[..., :7], w, t, b), "differs from weight"),
    ("weight dtype", lambda x, w, t, b: losses.linear_cross_entropy(x, w.double(), t, b), "weight has dtype"),
    ("bias length", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b[:5]), "bias must have shape"),
    ("target shape", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t[:, :1], b), "leading shape"),
    ("target dtype", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t.float(), b), "class indices"),
    ("softcap", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, softcap=0.0), "softcap"),
    ("smoothing", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, label_smoothing=-0.1), "smoothing"),
    ("reduction", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, reduction="batchmean"), "reduction"),
    ("divisor", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, divisor=4), "divisor divides"),
    ("divisor shape", lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, reduction="sum",
                                                                     divisor=torch.ones(2)), "one-element"),
])
def test_bad_input_raises_before_any_work(case, call, message):
    with pytest.raises(ValueError, match=message):
        call(*make_inputs((2, 3), 8, 20, torch.float32, "cpu"))


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
    check_against_float64(fused(options), reference(options), inputs, grad_of=(0, 1, 3), case=str(vocab))


def leaf_inputs(*args):
    """make_inputs' tensors, input, weight and bias requiring grad."""
    x, w, t, b = make_inputs(*args)
    return x.requires_grad_(), w.requires_grad_(), t, b.requires_grad_()


def _training_step(x, w, t, b, **options):
    x.grad = w.grad = b.grad = None
    losses.linear_cross_entropy(x, w, t, b, **options).backward()
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
    check_against_float64(autocast(fused(options)), autocast(reference(options)), inputs, grad_of=grad_of)
    assert ran


@pytest.mark.gpu
def test_torch_compile_fullgraph_and_cuda_graphs():
    x, w, t, b = leaf_inputs((64,), 32, 1000, torch.float32, "cuda")
    expected = _training_step(x, w, t, b, label_smoothing=0.1)
    step = torch.compile(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, b, label_smoothing=0.1),
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
        loss = losses.linear_cross_entropy(x, w, t, b, label_smoothing=0.1)
        loss.backward()
    fresh = make_inputs((64,), 32, 1000, torch.float32, "cuda")
    with torch.no_grad():
        for tensor, new in zip((x, w, t, b), fresh):
            tensor.copy_(new)
    graph.replay()
    x2, w2, t2, b2 = (tensor.detach().clone().requires_grad_(tensor.dtype.is_floating_point) for tensor in fresh)
    want = _training_step(x2, w2, t2, b2, label_smoothing=0.1)
    torch.testing.assert_close(loss, losses.linear_cross_entropy(x2, w2, t2, b2, label_smoothing=0.1))
    for got, expected_grad in zip((x.grad, w.grad, b.grad), want):
        torch.testing.assert_close(got, expected_grad)
