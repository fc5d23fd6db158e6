"""cross_entropy / CrossEntropyLoss: CPU behaviour (CI) and the fused kernel against float64 (GPU)."""
import contextlib
import math
import types

import pytest
import torch
import torch.nn.functional as F

import loader
import cross_entropy
import loss_helpers
import losses
from helpers import DTYPES, FLOOR, check_against_float64, check_special_values_match_torch, raises_as_torch, rel_err

REDUCTIONS = ["mean", "sum", "none"]
IGNORE = -100


def reference(logits, target, reduction="mean", ignore_index=IGNORE, label_smoothing=0.0):
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def class_targets(logits, index_dtype=torch.int64, ignored_fraction=0.25, ignore_index=IGNORE):
    """Class indices for logits with classes in dim 1 (dim 0 for 1-D), some set to
    ignore_index, never all of them (that case has its own test)."""
    num_classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    shape = (logits.shape[0],) + tuple(logits.shape[2:]) if logits.dim() > 1 else ()
    target = torch.randint(0, num_classes, shape, device=logits.device)
    if target.dim():
        ignored = torch.rand(shape, device=logits.device) < ignored_fraction
        target[ignored] = ignore_index
    # The first stays a class, whether the mask or randint (when ignore_index is a class) made it ignore_index.
    first = target.view(-1)[:1]
    first[first == ignore_index] = (ignore_index + 1) % num_classes
    return target.to(index_dtype)


# ----------------------------------------------------------------------------------
# CPU (runs everywhere, CI included).

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(6, 5), (5,), (3, 4, 2, 2)], ids=str)
def test_cpu_matches_torch(shape, reduction):
    logits = torch.randn(*shape, requires_grad=True)
    target = class_targets(logits)
    ours = losses.cross_entropy(logits, target, reduction=reduction)
    torch.testing.assert_close(ours, reference(logits, target, reduction))
    ours.sum().backward()
    assert logits.grad is not None


def test_cpu_weight_smoothing_and_probabilities_match_torch():
    logits, weight = torch.randn(6, 5), torch.rand(5)
    target = class_targets(logits, ignored_fraction=0)
    soft_target = torch.randn(6, 5).softmax(-1)
    torch.testing.assert_close(losses.cross_entropy(logits, target, weight=weight),
                               F.cross_entropy(logits, target, weight=weight))
    torch.testing.assert_close(losses.cross_entropy(logits, target, label_smoothing=0.1),
                               F.cross_entropy(logits, target, label_smoothing=0.1))
    torch.testing.assert_close(losses.cross_entropy(logits, soft_target), F.cross_entropy(logits, soft_target))


@pytest.mark.parametrize("targets", ["indices", "probabilities"])
def test_label_smoothing_of_one_is_torchs(targets, kernels_modelled_on_cpu):
    """torch takes label_smoothing=1.0 (the uniform target alone), and so do we, through the fused path's
    plumbing (the kernels' CPU models). Fails if check_smoothing_and_z_loss refuses 1.0 (< 1.0 for <= 1.0)."""
    logits = torch.randn(6, 5, dtype=torch.float64)
    target = class_targets(logits) if targets == "indices" else torch.randn(6, 5, dtype=torch.float64).softmax(-1)
    check_against_float64(lambda x, y: losses.cross_entropy(x, y, label_smoothing=1.0),
                          lambda x, y: F.cross_entropy(x, y, label_smoothing=1.0), [logits, target],
                          grad_of=(0, 1) if targets == "probabilities" else (0,))
    torch.testing.assert_close(losses.CrossEntropyLoss(label_smoothing=1.0)(logits, target),
                               F.cross_entropy(logits, target, label_smoothing=1.0))


def test_cpu_z_loss_and_lse_follow_their_definitions():
    """z_loss adds z * lse^2 per non-ignored row ('mean': over those rows); return_lse
    gives logsumexp over the classes. Worked out by hand on a 2-row example."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]], dtype=torch.float64)
    target = torch.tensor([2, IGNORE])
    lse0 = math.log(math.exp(0.0) + math.exp(1.0) + math.exp(2.0))
    loss, lse = losses.cross_entropy(logits, target, z_loss=0.25, return_lse=True)
    assert loss.item() == pytest.approx((lse0 - 2.0) + 0.25 * lse0 ** 2, rel=1e-12)
    assert lse.shape == (2,) and lse.dtype == torch.float64 and not lse.requires_grad
    assert lse[0].item() == pytest.approx(lse0, rel=1e-12)
    per_row = losses.cross_entropy(logits, target, z_loss=0.25, reduction="none")
    assert per_row[1].item() == 0.0
    bf16_lse = losses.cross_entropy(logits.bfloat16(), target, return_lse=True)[1]  # torch 2.0 CPU has no half
    assert bf16_lse.dtype == torch.float32 and bf16_lse[0].item() == pytest.approx(lse0, rel=1e-2)


def test_module_and_legacy_arguments_match_torch():
    logits = torch.randn(6, 5)
    target = class_targets(logits, ignore_index=1)
    for kwargs in ({}, {"reduction": "sum"}, {"ignore_index": 1}, {"reduce": False}, {"label_smoothing": 0.2}):
        torch.testing.assert_close(losses.CrossEntropyLoss(**kwargs)(logits, target),
                                   torch.nn.CrossEntropyLoss(**kwargs)(logits, target))


def test_bad_arguments_raise_clear_errors():
    logits = torch.randn(6, 5)
    target = class_targets(logits)
    bad = [
        (dict(target=torch.zeros(5, dtype=torch.int64)), r"target must have shape \(6,\)"),
        (dict(input=torch.tensor(1.0), target=torch.tensor(0)), "at least 1 dimension"),
        (dict(reduction="batchmean"), "reduction must be one of"),
        (dict(target=torch.zeros(6, dtype=torch.int64, device="meta")), "target is on meta"),
        (dict(target=torch.rand(6, 4)), r"target must have shape \(6,\) .*, or input's shape for class probabilities"),
        (dict(target=torch.rand(6)), r"target of shape \(6,\) holds class indices, which must be int64, int32 or "
                                     r"uint8, got torch.float32 \(class probabilities take input's shape \(6, 5\)\)"),
        (dict(target=torch.zeros(6, 5, dtype=torch.int64)), "holds class probabilities, which must be floating point"),
        (dict(target=torch.rand(6, 5), ignore_index=0), "ignore_index is not supported"),
        (dict(weight=torch.rand(4)), r"weight must have shape \(5,\)"),
        (dict(label_smoothing=1.5), "label_smoothing must be between 0.0 and 1.0"),
        (dict(label_smoothing=-0.1), "label_smoothing must be between 0.0 and 1.0"),  # torch takes it (README)
        (dict(z_loss=-1.0), "z_loss must be >= 0"),
        (dict(reduction="none", inplace_backward=True), "inplace_backward=True needs reduction"),
        (dict(input=torch.randn(6, 5, requires_grad=True), inplace_backward=True), "leaf tensor"),
        (dict(input=torch.randn(7, 5, requires_grad=True)[1:], inplace_backward=True), "view of one"),
        (dict(input=torch.randn(7, 5)[1:].requires_grad_(), inplace_backward=True), "leaf tensor"),
    ]
    for kwargs, message in bad:
        arguments = dict(input=logits, target=target) | kwargs
        with pytest.raises(ValueError, match=message):
            losses.cross_entropy(**arguments)


TORCH = types.SimpleNamespace(cross_entropy=F.cross_entropy, CrossEntropyLoss=torch.nn.CrossEntropyLoss)


@pytest.mark.parametrize("case,call", [
    ("weight of another length", lambda m, x, t: m.cross_entropy(x, t, weight=torch.ones(4))),
    ("weight of two dims", lambda m, x, t: m.cross_entropy(x, t, weight=torch.ones(5, 1))),
    ("weight on another device", lambda m, x, t: m.cross_entropy(x, t, weight=torch.ones(5, device="meta"))),
    ("target on another device", lambda m, x, t: m.cross_entropy(x, t.to("meta"))),
    ("input on another device", lambda m, x, t: m.cross_entropy(x.to("meta"), t)),
    ("weight of another dtype", lambda m, x, t: m.cross_entropy(x, t, weight=torch.ones(5, dtype=torch.float64))),
    ("float class indices", lambda m, x, t: m.cross_entropy(x, t.float())),
    ("float target of another shape", lambda m, x, t: m.cross_entropy(x, torch.rand(6, 4))),
    ("integer probabilities", lambda m, x, t: m.cross_entropy(x, torch.zeros(6, 5, dtype=torch.int64))),
    ("class indices of two dims", lambda m, x, t: m.cross_entropy(x, t[:, None])),
    ("class indices of another batch", lambda m, x, t: m.cross_entropy(x, t[:5])),  # torch: ValueError
    ("0-dim input", lambda m, x, t: m.cross_entropy(x[0, 0], t[0])),
    ("ignore_index with probabilities", lambda m, x, t: m.cross_entropy(x, x.softmax(1), ignore_index=0)),
    ("label_smoothing above 1", lambda m, x, t: m.cross_entropy(x, t, label_smoothing=1.5)),
    ("reduction", lambda m, x, t: m.cross_entropy(x, t, reduction="batchmean")),  # torch: ValueError
    ("input a list", lambda m, x, t: m.cross_entropy(x.tolist(), t)),  # torch: TypeError
    ("target a list", lambda m, x, t: m.cross_entropy(x, t.tolist())),
    ("weight a list", lambda m, x, t: m.cross_entropy(x, t, weight=[1.0] * 5)),
    ("module, weight of another length", lambda m, x, t: m.CrossEntropyLoss(weight=torch.ones(4))(x, t)),
    ("module, target a list", lambda m, x, t: m.CrossEntropyLoss()(x, t.tolist())),
])
def test_bad_calls_raise_what_torch_raises(case, call):
    """Code that catches torch's error for a bad call catches ours (torch's RuntimeErrors are
    ArgumentErrors here, still ValueErrors too)."""
    x, t = torch.randn(6, 5), torch.randint(0, 5, (6,))
    raises_as_torch(lambda: call(losses, x, t), lambda: call(TORCH, x, t))


@pytest.mark.parametrize("name", ["input", "target", "weight"])
def test_a_non_tensor_gets_a_type_error_that_names_it(name):
    arguments = dict(input=torch.randn(6, 5), target=torch.randint(0, 5, (6,)), weight=torch.ones(5))
    arguments[name] = arguments[name].tolist()
    with pytest.raises(TypeError, match=f"cross_entropy: {name} must be a Tensor, got list"):
        losses.cross_entropy(**arguments)


def test_an_argument_error_with_a_process_group_keeps_its_type():
    """The checks' errors pass through vocab_parallel.raise_on_every_rank (which catches ValueError);
    without a group to tell (not one here) it raises them as they were: RuntimeError too."""
    x, t = torch.randn(6, 5), torch.randint(0, 5, (6,))
    with pytest.raises(RuntimeError, match=r"weight must have shape \(5,\)"):
        losses.cross_entropy(x, t, weight=torch.ones(4), process_group=object())


def test_module_takes_our_keyword_arguments():
    logits = torch.randn(6, 5, dtype=torch.float64)
    target = class_targets(logits)
    module = losses.CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-3, return_lse=True)
    loss, lse = module(logits, target)
    torch.testing.assert_close(loss, losses.cross_entropy(logits, target, label_smoothing=0.1, z_loss=1e-3))
    torch.testing.assert_close(lse, torch.logsumexp(logits, 1))


# ----------------------------------------------------------------------------------
# GPU: the fused kernel against torch in float64.

def randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).mul(2).to(dtype)


# Rows beyond the register cache are streamed; with a gradient, their front is kept in
# shared memory (227 KB on an H100) and the rest read a second time.
LONG_ROW = "row beyond the register cache (C = 40000: whole in shared memory, fp64 in part)"
ODD_LONG_ROW = "odd C = 40001 beyond the register cache (rows start off 16 bytes: edge elements)"
ODD_ROW = "odd C = 1001 (rows start off 16 bytes: edge elements)"
VIEW_OFF_16_BYTES = "view from the second row (data off 16 bytes)"
STREAMED_ROW = "very long row (C = 270000: front in shared memory, the rest read twice)"
# 4095 packs of 2-byte logits: in registers only by a block alone on its multiprocessor (pipelined on sm_90)
WIDE_ROW = "wide row C = 32760"

# Without grad, many rows longer than a warp's register cache are read by a warp each
# (kWarpRows): at least 8 per multiprocessor, of 2-byte logits or rows of at most 8 KB (C =
# 4099 for 2-byte dtypes, 2049 float32, 1023 float64). Odd C: rows start at every offset from 16 bytes.
WARP_ROWS = "many rows of odd C just beyond a warp's registers (without grad: a warp per row)"


def rows_per_multiprocessor(per_multiprocessor, num_classes):
    """Logits of per_multiprocessor rows for each multiprocessor of the GPU, and a few more."""
    def make(dtype):
        rows = per_multiprocessor * torch.cuda.get_device_properties(0).multi_processor_count + 3
        return randn(rows, num_classes, dtype=dtype)
    return make


# Each case hits one regime of the kernel. Built on the GPU, so views stay views.
SHAPES = {
    "one row": lambda dtype: randn(1, 1000, dtype=dtype),
    "7x1000": lambda dtype: randn(7, 1000, dtype=dtype),
    "1-D input (C,), 0-dim target": lambda dtype: randn(1000, dtype=dtype),
    "3-D (N, C, d): classes in dim 1": lambda dtype: randn(4, 10, 7, dtype=dtype),
    "4-D (N, C, d1, d2)": lambda dtype: randn(2, 5, 3, 4, dtype=dtype),
    "non-contiguous (transposed) logits": lambda dtype: randn(1000, 7, dtype=dtype).t(),
    ODD_ROW: lambda dtype: randn(9, 1001, dtype=dtype),
    # Contiguous, from the second row on: the data starts off 16 bytes, so the gradient
    # is allocated at the same offset (and probability targets copied there).
    VIEW_OFF_16_BYTES: lambda dtype: randn(10, 1001, dtype=dtype)[1:],
    "tiny C = 3, many rows": lambda dtype: randn(3000, 3, dtype=dtype),
    LONG_ROW: lambda dtype: randn(5, 40000, dtype=dtype),
    ODD_LONG_ROW: lambda dtype: randn(3, 40001, dtype=dtype),
    STREAMED_ROW: lambda dtype: randn(2, 270000, dtype=dtype),
    WIDE_ROW: lambda dtype: randn(3, 32760, dtype=dtype),
    "LLM vocabulary C = 128256": lambda dtype: randn(3, 128256, dtype=dtype),
    WARP_ROWS: lambda dtype: rows_per_multiprocessor(32, {2: 4099, 4: 2049, 8: 1023}[torch.finfo(dtype).bits // 8])(dtype),
}


def path_of(logits, target, reduction="mean", grad=False, lse=False, label_smoothing=0.0):
    """The kernel path (kernels/cross_entropy/launch_policy.cuh) of a call with 2-D logits."""
    return loader.load_for_device("cross_entropy", logits.device, logits.dtype).cross_entropy_path(
        logits, target, None, IGNORE, loss_helpers.REDUCTION_CODES[reduction], False, label_smoothing, 0.0, 1.0, grad,
        False, lse, False, False)


@contextlib.contextmanager
def forced_path(path):
    """Every cross-entropy call in the block takes `path` (or raises where it cannot), in
    every dtype: each dtype's build holds its own switch."""
    device = torch.device("cuda", torch.cuda.current_device())
    builds = [loader.load_for_device("cross_entropy", device, getattr(torch, dtype)) for dtype in loader.DTYPES]
    for ops in builds:
        ops.force_cross_entropy_path(path)
    try:
        yield
    finally:
        for ops in builds:
            ops.force_cross_entropy_path("")


def on_hopper():
    return torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cases_take_the_paths_the_tests_expect(dtype):
    """The shapes reach the paths their names say, so the tests of each case test that kernel.
    sm_90's kernels take 2- and 4-byte logits only."""
    sm90 = on_hopper() and dtype != torch.float64

    def path(case, **options):
        logits = SHAPES[case](dtype)
        return path_of(logits, class_targets(logits), **options)

    assert path("7x1000") == path("7x1000", grad=True) == "register_rows"
    assert path(WARP_ROWS) == "warp_rows"
    assert path(WARP_ROWS, grad=True) == path(WARP_ROWS, lse=True) == "register_rows"
    assert path(LONG_ROW) == path(STREAMED_ROW) == "streamed_sum_rows"
    assert path(LONG_ROW, grad=True) == ("pipelined_rows" if sm90 else "stashed_rows")
    assert path(LONG_ROW, grad=True, label_smoothing=0.1) == path(LONG_ROW, reduction="none") == "stashed_rows"
    # sm_90 pipelines a 2-byte row that the registers hold only in a block alone on its multiprocessor
    two_bytes = dtype in (torch.float16, torch.bfloat16)
    assert path(WIDE_ROW, grad=True) == ("pipelined_rows" if sm90 else "register_rows" if two_bytes else "stashed_rows")
    assert path(WIDE_ROW) == ("register_rows" if two_bytes else "streamed_sum_rows")
    for packs in (2048, 3072):  # 2048: two blocks of 256 fit; 3072 4-byte logits: 512 threads, kept
        row = randn(3, packs * 128 // torch.finfo(dtype).bits, dtype=dtype)
        expected = "pipelined_rows" if sm90 and two_bytes and packs > 2048 else "register_rows"
        assert path_of(row, class_targets(row), grad=True) == expected, packs
    # Many rows split among clusters of 4 blocks: the H200 holds 30 on its 132 multiprocessors, and the
    # stashed kernel takes a share of the rows on the 12 left; an H100 (SXM) holds 33. Under CUDA graph
    # capture, where launches are not dependent, the pipelined kernel alone.
    many = MANY_STREAMED_ROWS[MANY_LLM_ROWS](dtype)
    name = torch.cuda.get_device_name()
    targets = class_targets(many)
    chosen = path_of(many, targets, grad=True)
    if not sm90:
        assert chosen == "stashed_rows"
    elif "H200" in name and dtype != torch.float32:
        assert chosen == "pipelined_and_stashed_rows"
    elif "H100 80GB HBM3" in name and dtype != torch.float32:
        assert chosen == "pipelined_rows"
    if sm90:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert path_of(many, targets, grad=True) == "pipelined_rows"
            many.mul(2)


# Each path forced on cases it can run, where most of them take another path: every kernel
# runs on the GPU at hand, an A100's paths included on an H100/H200 (its stashed rows with
# a gradient, warp rows). The sum-only paths compute a scalar loss alone; sm_90's take
# class indices without label smoothing in 2- and 4-byte logits.
SUM_ONLY_PATHS = {"warp_rows", "streamed_sum_rows"}
# sm_90's: gradients alone. The second shares the rows with the stashed kernel, forced here even where
# the GPU's clusters leave no multiprocessor for it (it then runs after the pipelined kernel).
PIPELINED_PATHS = {"pipelined_rows", "pipelined_and_stashed_rows"}
MANY_ODD_ROWS = "many rows of odd C = 40001 (whole in shared memory but for fp64)"
# With a gradient on sm_90, rows split among clusters of blocks; on the H200 a share of them beside the clusters.
MANY_LLM_ROWS = "many rows of C = 128256"
# Without grad a warp per row, in registers for every dtype and target (4099 classes of
# float64 probabilities are beyond them).
WARP_ROWS_IN_REGISTERS = "many rows of odd C = 3001 (without grad: a warp per row)"
FORCED_CASES = {
    "register_rows": ["7x1000", ODD_ROW, VIEW_OFF_16_BYTES, WARP_ROWS_IN_REGISTERS],
    "warp_rows": ["7x1000", ODD_ROW, WARP_ROWS, ODD_LONG_ROW],
    "streamed_sum_rows": ["7x1000", ODD_ROW, WARP_ROWS, ODD_LONG_ROW, STREAMED_ROW],
    "stashed_rows": ["7x1000", ODD_ROW, LONG_ROW, ODD_LONG_ROW, STREAMED_ROW, MANY_ODD_ROWS],
    "pipelined_rows": ["7x1000", ODD_ROW, LONG_ROW, ODD_LONG_ROW, MANY_ODD_ROWS],
    "pipelined_and_stashed_rows": ["7x1000", ODD_ROW, ODD_LONG_ROW, MANY_ODD_ROWS, MANY_LLM_ROWS],
}
FORCED = [(path, case) for path, cases in FORCED_CASES.items() for case in cases]


def why_path_cannot_run(path, dtype, reduction, targets):
    """Why `path` cannot run these calls on this GPU (the kernels' rules), or None."""
    if path in PIPELINED_PATHS and not (on_hopper() and dtype != torch.float64):
        return f"{path} runs on sm_90, 2- and 4-byte logits"
    if path in SUM_ONLY_PATHS and reduction == "none":
        return f"{path} computes a scalar loss alone"
    if path in PIPELINED_PATHS and reduction == "none":
        return f"{path} writes gradients: the forward of 'none' writes none"
    if (path == "warp_rows" or path in PIPELINED_PATHS) and targets != "indices":
        return f"{path} takes class indices without label smoothing"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("targets", ["indices", "label_smoothing", "probabilities"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path,case", FORCED, ids=[f"{path}: {case}" for path, case in FORCED])
def test_every_path_forced_matches_float64(path, case, dtype, reduction, targets):
    why_not = why_path_cannot_run(path, dtype, reduction, targets)
    if why_not:
        pytest.skip(why_not)
    logits = {**SHAPES, **MANY_STREAMED_ROWS, WARP_ROWS_IN_REGISTERS: rows_per_multiprocessor(32, 3001)}[case](dtype)
    label_smoothing = 0.1 if targets == "label_smoothing" else 0.0
    if targets == "probabilities":
        target = torch.randn(logits.shape, device="cuda").softmax(1).to(dtype)
    else:
        target = class_targets(logits)
    arguments = dict(reduction=reduction, label_smoothing=label_smoothing)
    sum_only = path in SUM_ONLY_PATHS
    with forced_path(path):
        check_against_float64(lambda x, t: losses.cross_entropy(x, t, **arguments),
                              lambda x, t: F.cross_entropy(x, t, **arguments), [logits, target],
                              grad_of=() if sum_only else (0, 1) if targets == "probabilities" else (0,),
                              loss_without_grad=path not in PIPELINED_PATHS, case=f"{path} {case} {targets}")


@pytest.mark.gpu
def test_forcing_a_path_that_cannot_run_the_call_raises():
    logits = SHAPES[STREAMED_ROW](torch.float32)
    target = class_targets(logits)
    with forced_path("register_rows"), pytest.raises(ValueError, match="register_rows cannot run this call: the row"):
        losses.cross_entropy(logits, target)
    with forced_path("warp_rows"), pytest.raises(ValueError, match="warp_rows cannot run this call: it computes"):
        losses.cross_entropy(logits.requires_grad_(), target)
    with forced_path("pipelined_rows"), pytest.raises(ValueError, match="pipelined_rows cannot run this call"):
        losses.cross_entropy(logits.double(), target)
    with forced_path("warp_rows"), pytest.raises(ValueError, match="without label smoothing"):
        losses.cross_entropy(logits, target, label_smoothing=0.1)
    with pytest.raises(ValueError, match="no path named 'fastest'"):
        loader.load_for_device("cross_entropy", logits.device, logits.dtype).force_cross_entropy_path("fastest")
    assert path_of(logits, target) == "streamed_sum_rows"  # nothing left forced


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
def test_matches_float64(case, dtype, reduction, index_dtype):
    logits = SHAPES[case](dtype)
    target = class_targets(logits, index_dtype)
    # torch takes int32 class indices only from 2.x on some paths: compare with int64.
    check_against_float64(lambda x, t: losses.cross_entropy(x, t.to(index_dtype), reduction=reduction),
                          lambda x, t: reference(x, t.long(), reduction), [logits, target], case=case)


# Streamed rows, more than the grid has blocks, so each block takes several and refills its
# stash row after row. Odd C: rows start at every offset from 16 bytes, so the number of
# packs, and of them stashed, differs from row to row.
def many_streamed_rows(num_classes):
    return rows_per_multiprocessor(4, num_classes)


MANY_STREAMED_ROWS = {
    MANY_ODD_ROWS: many_streamed_rows(40001),
    MANY_LLM_ROWS: rows_per_multiprocessor(8, 128256),
    "many rows of C = 270000 (front in shared memory)": many_streamed_rows(270000),
}


@pytest.mark.gpu
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(MANY_STREAMED_ROWS))
def test_many_streamed_rows_per_block(case, dtype, label_smoothing):
    logits = MANY_STREAMED_ROWS[case](dtype)
    check_against_float64(lambda x, t: losses.cross_entropy(x, t, label_smoothing=label_smoothing),
                          lambda x, t: reference(x, t, label_smoothing=label_smoothing),
                          [logits, class_targets(logits)], case=case)


# Class indices where a row is split: its first and last elements (edge elements, read
# one per thread, when rows start off 16 bytes) and around each 1/2, 1/4 and 1/8 of it,
# where sm_90's pipelined kernel splits a long row among a cluster of blocks (each reads
# the target's logit only from its own part, and one thread adds the one-hot term).
def targets_where_rows_split(logits):
    rows, num_classes = logits.shape
    places = {0, 1, 2, 7, 8, 9, num_classes - 1, num_classes - 2, num_classes - 8, num_classes - 9}
    for parts in (2, 4, 8):
        for j in range(1, parts):
            places.update(range(j * num_classes // parts - 9, j * num_classes // parts + 10))
    places = sorted(c for c in places if 0 <= c < num_classes)
    return torch.tensor([places[i % len(places)] for i in range(rows)], device=logits.device)


SPLIT_ROWS = {
    "many rows of odd C = 50257": many_streamed_rows(50257),
    "many rows of C = 128256": many_streamed_rows(128256),
}


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["", "inplace_backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SPLIT_ROWS))
def test_targets_where_rows_are_split(case, dtype, inplace):
    logits = SPLIT_ROWS[case](dtype)
    # x * 1: inplace_backward overwrites a non-leaf, as a model's output, not the input itself.
    check_against_float64(lambda x, t: losses.cross_entropy(x * 1, t, inplace_backward=inplace),
                          lambda x, t: reference(x, t), [logits, targets_where_rows_split(logits)], case=case)


@pytest.mark.gpu
def test_ignore_index_inside_the_class_range():
    logits = SHAPES["7x1000"](torch.float32)
    target = class_targets(logits, ignored_fraction=0)
    target[::2] = 3
    check_against_float64(lambda x, t: losses.cross_entropy(x, t, ignore_index=3),
                          lambda x, t: reference(x, t, ignore_index=3), [logits, target])


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", [((32768, 4096), torch.float32), ((32768, 4096), torch.bfloat16),
                                        ((8192, 128256), torch.bfloat16)], ids=str)
def test_seed_shapes(case, dtype):
    """The seeds' 32768 x 4096, and an LLM's 8192 x 128256 in bf16."""
    logits = randn(*case, dtype=dtype)
    check_against_float64(losses.cross_entropy, reference, [logits, class_targets(logits, ignored_fraction=0.05)],
                          case=str(case))


@pytest.mark.gpu
def test_every_target_ignored_gives_torch_result():
    logits = SHAPES["7x1000"](torch.float32).requires_grad_()
    target = torch.full((7,), IGNORE, device="cuda")
    ours, theirs = losses.cross_entropy(logits, target), reference(logits, target)
    assert torch.isnan(ours) and torch.isnan(theirs)
    (grad,) = torch.autograd.grad(ours, logits)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.gpu
def test_out_of_range_target_gives_nan_and_leaves_cuda_usable():
    logits = SHAPES["7x1000"](torch.float32)
    target = class_targets(logits, ignored_fraction=0)
    target[2] = 1000
    per_row = losses.cross_entropy(logits, target, reduction="none")
    assert torch.isnan(per_row[2]) and torch.isfinite(per_row[[0, 1, 3, 4, 5, 6]]).all()
    torch.cuda.synchronize()  # the context still works


@pytest.mark.gpu
def test_unfused_arguments_fall_back_only_outside_strict_mode(monkeypatch):
    """uint8 class indices (torch takes them) are not fused: torch runs them, except in strict mode."""
    logits = SHAPES["7x1000"](torch.float32)
    target = class_targets(logits, ignored_fraction=0).to(torch.uint8)
    with pytest.raises(RuntimeError, match="class indices must be int64 or int32 to be fused"):
        losses.cross_entropy(logits, target)
    monkeypatch.delenv("FUSED_LOSSES_STRICT")
    torch.testing.assert_close(losses.cross_entropy(logits, target), F.cross_entropy(logits, target))


# ----------------------------------------------------------------------------------
# GPU: every argument of F.cross_entropy (and our z_loss), crossed, in each regime.

def _options(probs=False, weight=False, ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0):
    return dict(probs=probs, weight=weight, ignore_index=ignore_index, label_smoothing=label_smoothing,
                z_loss=z_loss)


OPTIONS = (
    [_options(weight=w, ignore_index=i, label_smoothing=s) for w in (False, True) for i in (IGNORE, 1)
     for s in (0.0, 0.1)]
    + [_options(probs=True, weight=w, label_smoothing=s) for w in (False, True) for s in (0.0, 0.1)]
    + [_options(z_loss=0.01), _options(weight=True, ignore_index=1, label_smoothing=0.1, z_loss=0.01),
       _options(probs=True, weight=True, label_smoothing=0.1, z_loss=0.01)]
)


def _option_id(options):
    parts = ["probabilities" if options["probs"] else "indices"]
    parts += [f"{name}={value}" for name, value in options.items()
              if name != "probs" and value != _options()[name]]
    return ",".join(parts)


CROSSED_SHAPES = ["7x1000", "1-D input (C,), 0-dim target", "3-D (N, C, d): classes in dim 1",
                  ODD_ROW, VIEW_OFF_16_BYTES, LONG_ROW, ODD_LONG_ROW, STREAMED_ROW, WARP_ROWS]


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CROSSED_SHAPES)
def test_arguments_crossed_match_float64(case, dtype, reduction, options):
    """Each regime x dtype x reduction x argument combination against torch in float64
    (the z-loss against its definition in torch ops). Probability targets get a
    gradient too."""
    logits = SHAPES[case](dtype)
    class_dim = 1 if logits.dim() > 1 else 0
    num_classes = logits.shape[class_dim]
    if options["probs"]:
        target = torch.randn(logits.shape, device="cuda").softmax(class_dim).to(dtype)
    else:
        target = class_targets(logits, ignore_index=options["ignore_index"])
    inputs = [logits, target]
    if options["weight"]:
        inputs.append(torch.rand(num_classes, device="cuda").add(0.1).to(dtype))
    arguments = dict(ignore_index=options["ignore_index"], reduction=reduction,
                     label_smoothing=options["label_smoothing"])
    z_loss = options["z_loss"]

    def fused(x, t, w=None):
        return losses.cross_entropy(x, t, weight=w, z_loss=z_loss, **arguments)

    def truth(x, t, w=None):
        return cross_entropy.reference_cross_entropy(x, t, w, arguments["ignore_index"], reduction,
                                           arguments["label_smoothing"], z_loss, False)

    check_against_float64(fused, truth, inputs, grad_of=(0, 1) if options["probs"] else (0,),
                          case=f"{case} {_option_id(options)} {reduction}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["7x1000", LONG_ROW, STREAMED_ROW])
def test_return_lse_matches_float64(case, dtype):
    logits = SHAPES[case](dtype)
    target = class_targets(logits)
    for reduction in REDUCTIONS:
        for requires_grad in (False, True):
            x = logits.detach().requires_grad_(requires_grad)
            loss, lse = losses.cross_entropy(x, target, reduction=reduction, return_lse=True)
            truth = torch.logsumexp(logits.double(), 1)
            assert lse.dtype == torch.float32 and lse.shape == target.shape and not lse.requires_grad
            assert rel_err(lse, truth) <= 2 * FLOOR[torch.float32], (reduction, requires_grad)
            torch.testing.assert_close(loss, losses.cross_entropy(logits, target, reduction=reduction))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["7x1000", LONG_ROW, STREAMED_ROW, "3-D (N, C, d): classes in dim 1",
                                  *MANY_STREAMED_ROWS])
def test_inplace_backward_gives_the_same_gradient_in_the_logits_buffer(case, dtype):
    source = {**SHAPES, **MANY_STREAMED_ROWS}[case](dtype)
    target = class_targets(source)
    for options in (dict(), dict(label_smoothing=0.1, z_loss=1e-2)):
        expected_grads = []
        for inplace in (False, True):
            x = source.detach().requires_grad_()
            logits = x * 1  # a non-leaf, like a model's output
            logits.retain_grad()
            loss = losses.cross_entropy(logits, target, inplace_backward=inplace, **options)
            (loss * 2.5).backward()
            expected_grads.append((loss.detach(), x.grad, logits.grad.clone()))
        torch.testing.assert_close(expected_grads[1], expected_grads[0], rtol=0, atol=0)
    x = source.detach().requires_grad_()
    logits = x * 1
    if logits.dim() == 2:  # 2-D contiguous logits are overwritten where they lie
        pointer = logits.data_ptr()
        losses.cross_entropy(logits, target, inplace_backward=True).backward()
        assert logits.data_ptr() == pointer and not torch.equal(logits.detach(), source)


# Views of a model's output, as logits reach a loss: what backward must write through.
LOGITS_VIEWS = {
    "reshape (B, T, C) -> (B*T, C)": lambda output: output.view(-1, output.shape[-1]),
    "rows from the second on (data off 16 bytes)": lambda output: output.view(-1, output.shape[-1])[1:],
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("view", list(LOGITS_VIEWS))
def test_inplace_backward_into_a_view_of_the_logits(view, dtype):
    """The gradient lands where the viewed logits lie, and flows back through the view."""
    source = randn(2, 5, 1001, dtype=dtype)
    target = class_targets(LOGITS_VIEWS[view](source))
    grads = []
    for inplace in (False, True):
        x = source.detach().requires_grad_()
        output = x * 1
        logits = LOGITS_VIEWS[view](output)
        pointer = logits.data_ptr()
        losses.cross_entropy(logits, target, inplace_backward=inplace, label_smoothing=0.1).backward()
        grads.append(x.grad)
    assert logits.data_ptr() == pointer
    torch.testing.assert_close(logits.detach(), LOGITS_VIEWS[view](grads[0]), rtol=0, atol=0)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.gpu
def test_inplace_backward_is_guarded_against_later_use_of_the_logits():
    """exp saves its output for backward: overwriting it must make backward raise, not
    silently use the gradient as if it were exp's output."""
    x = SHAPES["7x1000"](torch.float32).requires_grad_()
    for view in [lambda output: output] + list(LOGITS_VIEWS.values()):
        logits = view(x.exp())
        loss = losses.cross_entropy(logits, class_targets(logits), inplace_backward=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.gpu
def test_inplace_backward_saves_the_gradients_memory():
    x = randn(4096, 8192, dtype=torch.float32).requires_grad_()
    target = class_targets(x)
    peaks = []
    for inplace in (False, True):
        logits = x * 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        losses.cross_entropy(logits, target, inplace_backward=inplace).backward()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del logits
        x.grad = None
    # The gradient of logits is 128 MiB: inplace must not allocate it.
    assert peaks[0] - peaks[1] >= x.numel() * 4 * 0.9, peaks


SPECIAL_ROWS_SHAPES = {WARP_ROWS: SHAPES[WARP_ROWS], "many streamed rows of odd C = 40001": many_streamed_rows(40001)}


@pytest.mark.gpu
@pytest.mark.parametrize("special", ["nan", "+inf", "+inf and nan", "-inf row"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(SPECIAL_ROWS_SHAPES))
def test_special_rows_among_many_match_torch(case, dtype, reduction, special):
    """Many rows (without grad a warp per row; streamed rows): a row whose loss is NaN or
    +inf makes the scalar loss NaN or +inf as in torch, with grad and without. The NaN sits
    in the first class of row 1, which starts off 16 bytes (odd C): an edge element, added
    before any pack of its row, where a streamed row's running max once passed it over."""
    logits = SPECIAL_ROWS_SHAPES[case](dtype)
    target = class_targets(logits)
    rows = logits.shape[0]
    special_rows = [torch.randint(2, rows, ()).item(), 1, torch.randint(2, rows, ()).item()]
    target[special_rows] = 3
    if "inf" in special and "row" not in special:
        logits[special_rows[0], 1] = float("inf")  # not the target's class: the row's loss is +inf
    if "nan" in special:
        logits[special_rows[1], 0] = float("nan")
    if special == "-inf row":
        logits[special_rows[2]] = float("-inf")  # every class masked: torch's loss is NaN
    with torch.no_grad():
        ours = losses.cross_entropy(logits, target, ignore_index=IGNORE, reduction=reduction)
        theirs = F.cross_entropy(logits.double(), target, ignore_index=IGNORE, reduction=reduction)
    torch.testing.assert_close(ours.double(), theirs, rtol=FLOOR[dtype], atol=0, equal_nan=True)
    if dtype == torch.float32:  # and with the gradient, element by element
        check_special_values_match_torch(
            lambda x, t: losses.cross_entropy(x, t, ignore_index=IGNORE, reduction=reduction),
            lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE, reduction=reduction),
            [logits, target], rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("weight", [False, True])
def test_every_target_ignored_with_options_gives_torch_result(weight):
    logits = SHAPES["7x1000"](torch.float32)
    target = torch.full((7,), IGNORE, device="cuda")
    w = torch.rand(1000, device="cuda") if weight else None
    ours = losses.cross_entropy(logits, target, weight=w, label_smoothing=0.1)
    theirs = F.cross_entropy(logits, target, weight=w, label_smoothing=0.1)
    assert torch.isnan(ours) and torch.isnan(theirs)
    assert losses.cross_entropy(logits, target, weight=w, reduction="sum").item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("num_classes", [1000, 40000, 270000],
                         ids=["row in registers", "streamed row (partly stashed in fp64)",
                              "very long streamed row"])
def test_masked_nan_and_inf_logits_match_torch(num_classes, reduction, label_smoothing):
    """-inf logits (masked classes), a NaN, a +inf, a row of only -inf, and -inf in the
    first column (the reference point of the smoothing sums on long rows)."""
    inf = float("inf")
    logits = torch.randn(6, num_classes, device="cuda", dtype=torch.float64)
    target = torch.tensor([1, 2, 3, 4, 5, 6], device="cuda")
    logits[0, ::3] = -inf
    logits[1, 5] = float("nan")
    logits[2, 7] = inf
    logits[3, :] = -inf
    logits[4, 0] = -inf
    check_special_values_match_torch(
        lambda x, t: losses.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing),
        lambda x, t: F.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing),
        [logits, target], rtol=1e-9)


# ----------------------------------------------------------------------------------
# Exact edges: where torch's loss is exactly 0 ours is too, and torch's CUDA answer for
# one unbatched, ignored target.

EXACT_ZERO_SHAPES = {name: SHAPES[name] for name in ("7x1000", LONG_ROW, STREAMED_ROW, "LLM vocabulary C = 128256")}
EXACT_ZERO_SHAPES["one class"] = lambda dtype: randn(7, 1, dtype=dtype)
EXACT_ZERO_SHAPES[WARP_ROWS] = SHAPES[WARP_ROWS]


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(EXACT_ZERO_SHAPES))
def test_loss_is_exactly_zero_where_torchs_is(case, dtype, reduction, grad):
    """Rows whose target logit exceeds every other by 60 (the rest of the softmax sum is
    below the rounding of 1, float64's too), and one-class rows: torch's loss is exactly 0, and so
    is ours, in every dtype, reduction and kernel path (the 2-byte exp's rounding of the
    max once left 1e-7 to 2e-6), and the target's gradient too. With 'none' every other
    row is ordinary, and matches torch as well."""
    logits = EXACT_ZERO_SHAPES[case](dtype)
    rows, classes = logits.shape
    target = torch.randint(0, classes, (rows,), device="cuda")
    every = 2 if reduction == "none" else 1
    peaked = torch.arange(rows, device="cuda") % every == 0
    logits[peaked, target[peaked]] = (logits[peaked].float().amax(1) + 60).to(dtype)
    theirs = F.cross_entropy(logits, target, reduction="none")
    assert (theirs[peaked] == 0).all()
    x = logits.detach().requires_grad_(grad)
    ours = losses.cross_entropy(x, target, reduction=reduction)
    if reduction == "none":
        assert (ours[peaked] == 0).all(), ours[peaked]
        # An ordinary row within 1 ulp of torch's: both round a float32 loss to the dtype (H200, float16,
        # 'none': one row of 4227 at 7.9e-4 relative, over FLOOR's half ulp).
        torch.testing.assert_close(ours, theirs, rtol=2 * FLOOR[dtype], atol=0)
        return
    assert ours.item() == 0
    if grad:
        ours.backward()
        assert (x.grad[torch.arange(rows, device="cuda"), target] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("target_kind", ["indices", "probabilities"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_class_gradient_is_the_z_loss_term_alone(dtype, target_kind):
    """One class: the ce term and its gradient are exactly 0 (as torch's), so with z_loss,
    smoothing and weights the gradient is the z-loss term's, 2 z lse / N, to its rounding."""
    rows, z_loss = 64, 1e-3
    x = randn(rows, 1, dtype=dtype).requires_grad_()
    target = (torch.zeros(rows, dtype=torch.long, device="cuda") if target_kind == "indices"
              else torch.ones(rows, 1, device="cuda", dtype=dtype))
    loss = losses.cross_entropy(x, target, weight=torch.tensor([0.7], device="cuda", dtype=dtype),
                                label_smoothing=0.1, z_loss=z_loss)
    loss.backward()
    truth = 2 * z_loss * x.detach().double() / rows
    assert loss.item() == pytest.approx(z_loss * x.detach().double().pow(2).mean().item(), rel=FLOOR[dtype])
    subnormal_step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # float16's gradient is subnormal
    torch.testing.assert_close(x.grad.double(), truth, rtol=FLOOR[dtype], atol=subnormal_step)


@pytest.mark.gpu
@pytest.mark.parametrize("weight", [False, True], ids=["no weight", "weight"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_one_unbatched_ignored_target_gives_torchs_cuda_result(weight, reduction, label_smoothing):
    """A (C,) input whose 0-dim target is ignore_index: torch's CUDA loss is 0 for 'mean'
    without label smoothing (its 1-D kernel), NaN with it; ours gives the same."""
    logits = randn(1000, dtype=torch.float32).requires_grad_()
    target = torch.tensor(IGNORE, device="cuda")
    w = torch.rand(1000, device="cuda") if weight else None
    arguments = dict(weight=w, ignore_index=IGNORE, reduction=reduction, label_smoothing=label_smoothing)
    ours = losses.cross_entropy(logits, target, **arguments)
    theirs = F.cross_entropy(logits, target, **arguments)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    if not theirs.isnan():
        (ours_grad,) = torch.autograd.grad(ours, logits)
        (theirs_grad,) = torch.autograd.grad(theirs, logits)
        torch.testing.assert_close(ours_grad, theirs_grad)


# ----------------------------------------------------------------------------------
# softcap: the capped logits' loss, by the row passes on CUDA, torch ops elsewhere.

def capped_reference(softcap, **options):
    def loss(logits, target):
        return cross_entropy.reference_cross_entropy(softcap * torch.tanh(logits / softcap), target, None, IGNORE,
                                           options.get("reduction", "mean"), options.get("label_smoothing", 0.0),
                                           options.get("z_loss", 0.0), False)
    return loss


SOFTCAP_OPTIONS = [dict(reduction=reduction, label_smoothing=smoothing, z_loss=z)
                   for reduction in REDUCTIONS for smoothing, z in [(0.0, 0.0), (0.1, 1e-3)]]


@pytest.mark.parametrize("options", SOFTCAP_OPTIONS, ids=str)
def test_softcap_on_cpu_matches_float64(options):
    logits = torch.randn(7, 40) * 20
    check_against_float64(lambda x, t: losses.cross_entropy(x, t, softcap=15.0, **options),
                          capped_reference(15.0, **options), [logits, class_targets(logits)], case=str(options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softcap_through_the_fused_paths_plumbing_on_cpu(dtype, kernels_modelled_on_cpu):
    """softcap where the kernels would run (choose_path's "row_passes": the row-pass engine, its torch
    twin on CPU), as on CUDA: the capped loss, in input's dtype; with class weights, torch's ops."""
    # Guards against mutants of cross_entropy's row_passes branch: softcap dropped, the loss returned as
    # float32, class weights taken there (choose_path without its uses_kernels check: the weights dropped).
    logits = (torch.randn(7, 40) * 20).to(dtype)
    target = class_targets(logits)
    assert cross_entropy.choose_path(logits, target, None, 15.0) == ("row_passes", None)
    for options in SOFTCAP_OPTIONS:
        check_against_float64(lambda x, t: losses.cross_entropy(x, t, softcap=15.0, **options),
                              capped_reference(15.0, **options), [logits, target], case=str(options))
    weight = torch.rand(40).add(0.5).to(dtype)
    torch.testing.assert_close(losses.cross_entropy(logits, target, weight, softcap=15.0),
                               F.cross_entropy(15.0 * torch.tanh(logits / 15.0), target, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1000), (5, 128256), (3, 50257), (4, 6, 3)], ids=str)
@pytest.mark.parametrize("options", SOFTCAP_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_matches_float64(dtype, options, shape):
    logits = (torch.randn(*shape, device="cuda") * 20).to(dtype)
    target = class_targets(logits, index_dtype=torch.int32 if shape[0] == 5 else torch.int64)
    check_against_float64(lambda x, t: losses.cross_entropy(x, t, softcap=30.0, **options),
                          capped_reference(30.0, **options), [logits, target], case=f"{shape} {options}")


@pytest.mark.gpu
def test_softcap_lse_module_compile_and_strict_refusals(monkeypatch):
    logits = torch.randn(16, 300, device="cuda", requires_grad=True)
    target = class_targets(logits)
    capped = 5.0 * torch.tanh(logits / 5.0)
    loss, lse = losses.CrossEntropyLoss(softcap=5.0, return_lse=True)(logits, target)
    torch.testing.assert_close(lse, torch.logsumexp(capped, 1))
    torch.testing.assert_close(loss, F.cross_entropy(capped, target))
    compiled = torch.compile(lambda x, t: losses.cross_entropy(x, t, softcap=5.0, z_loss=1e-3), fullgraph=True)
    grad, = torch.autograd.grad(compiled(logits, target), logits)
    want, = torch.autograd.grad(losses.cross_entropy(logits, target, softcap=5.0, z_loss=1e-3), logits)
    torch.testing.assert_close(grad, want)
    with pytest.raises(RuntimeError, match="softcap with class weights"):  # strict mode: no torch ops
        losses.cross_entropy(logits, target, weight=torch.rand(300, device="cuda"), softcap=5.0)
    with pytest.raises(ValueError, match="inplace_backward"):
        losses.cross_entropy(logits.detach().clone(), target, softcap=5.0, inplace_backward=True)
    with pytest.raises(ValueError, match="softcap"):
        losses.cross_entropy(logits, target, softcap=-1.0)
