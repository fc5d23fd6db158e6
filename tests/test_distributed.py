"""Vocabulary-parallel cross-entropy (losses.cross_entropy(..., process_group=...)) and linear
cross-entropy (the output layer's rows sharded): 2 processes, each holding a shard of the
classes, against the unsharded loss in float64 (loss, lse, and each rank's part of the
gradients); and faults injected on one rank of 2, 3 or 4, which every rank must report alike. On CPU
with gloo (CI) and on 2 GPUs with NCCL."""
import gc
import os
import random
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cross_entropy
import loss_helpers
import losses
import vocab_parallel
from helpers import run_on_ranks

WORLD = 2
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def shard_bounds(vocab, equal):
    """Each rank's [start, end): equal shards, or unequal ones (rank 0 holds about a third)."""
    cut = vocab // WORLD if equal else vocab // 3
    return [(0, cut), (cut, vocab)]


def make_case(index, device):
    """A random case, the same on every rank (seeded by the case index)."""
    rng = random.Random(index)
    torch.manual_seed(index)
    equal = rng.random() < 0.5
    # 64128: Llama 3's 128256 classes in two shards, whose class ids pass float32's 2^24 in sums
    vocab = rng.choice([2, 7, 64, 1000, 64128]) * (WORLD if equal else 1) + (0 if equal else rng.choice([0, 1]))
    vocab = max(vocab, 3)
    layout = rng.choice(["rows", "rows", "unbatched", "(N, C, d)"])
    rows = rng.choice([1, 5, 33])
    shape = {"rows": (rows, vocab), "unbatched": (vocab,), "(N, C, d)": (rows, vocab, 2)}[layout]
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    logits = (torch.randn(shape) * rng.choice([1.0, 6.0])).to(dtype).to(device)
    probs = rng.random() < 0.25
    if probs:
        target = torch.randn(shape).softmax(1 if len(shape) > 1 else 0).to(dtype).to(device)
        ignore_index = -100
    else:
        ignore_index = rng.choice([-100, 0, vocab - 1])
        target_shape = {"rows": (rows,), "unbatched": (), "(N, C, d)": (rows, 2)}[layout]
        target = torch.randint(0, vocab, target_shape)
        if rng.random() < 0.5:
            target = target.masked_fill(torch.rand(target_shape) < 0.3, ignore_index)
        target = target.to(rng.choice([torch.int64, torch.int32])).to(device)
    weight = torch.rand(vocab).add(0.5).to(dtype).to(device) if rng.random() < 0.4 else None
    options = dict(reduction=rng.choice(["mean", "sum", "none"]), ignore_index=ignore_index,
                   label_smoothing=rng.choice([0.0, 0.0, 0.2]), z_loss=rng.choice([0.0, 1e-2]),
                   softcap=rng.choice([None, 4.0]) if weight is None and not probs else None)
    return logits, target, weight, options, shard_bounds(vocab, equal), equal


def slice_classes(tensor, start, end):
    return tensor.narrow(1 if tensor.dim() > 1 else 0, start, end - start)


def check_case(index, rank, group, device):
    logits, target, weight, options, bounds, equal = make_case(index, device)
    start, end = bounds[rank]
    probs = target.is_floating_point()
    # The truth: the whole logits in float64, by torch's formula (plus the z-loss and lse).
    full = logits.double().requires_grad_()
    full_target = target.double().requires_grad_() if probs else target.long()
    truth, truth_lse = cross_entropy.reference_cross_entropy(full, full_target, None if weight is None else weight.double(),
                                                   options["ignore_index"], options["reduction"],
                                                   options["label_smoothing"], options["z_loss"], True,
                                                   options["softcap"])
    grad_output = torch.rand_like(truth) + 0.5
    truth.backward(grad_output)
    # Ours: this rank's shard.
    shard = slice_classes(logits, start, end).detach().requires_grad_()
    shard_target = slice_classes(target, start, end).detach().requires_grad_() if probs else target
    shard_weight = None if weight is None else weight[start:end]
    loss, lse = losses.cross_entropy(shard, shard_target, shard_weight, **options, return_lse=True,
                                     process_group=group, vocab_start=None if equal else start)
    loss.backward(grad_output.to(loss.dtype))
    tolerance = TOLERANCE[logits.dtype]
    case = f"case {index}: {tuple(logits.shape)} {logits.dtype} shards {bounds} probabilities={probs} {options}"
    # torch's and the unsharded loss's dtype (float32 where a mutant returned it for bfloat16 logits)
    assert loss.dtype == logits.dtype, f"{case}: loss is {loss.dtype}"
    torch.testing.assert_close(loss.double(), truth.detach(), rtol=tolerance, atol=tolerance, equal_nan=True, msg=lambda m: f"{case}: loss: {m}")
    torch.testing.assert_close(lse.double(), truth_lse, rtol=tolerance, atol=tolerance, equal_nan=True, msg=lambda m: f"{case}: lse: {m}")
    scale = full.grad.abs().max().item()
    torch.testing.assert_close(shard.grad.double(), slice_classes(full.grad, start, end), rtol=tolerance,
                               atol=tolerance * scale, equal_nan=True, msg=lambda m: f"{case}: grad of input: {m}")
    if probs:
        torch.testing.assert_close(shard_target.grad.double(), slice_classes(full_target.grad, start, end),
                                   rtol=tolerance, atol=tolerance * full_target.grad.abs().max().item(), equal_nan=True,
                                   msg=lambda m: f"{case}: grad of target: {m}")
    return loss.detach()


def check_linear_case(index, rank, group, device):
    """linear_cross_entropy with weight and bias sharded by rows (classes); input and target the same
    on every rank. Its input's gradient is the full one on every rank."""
    rng = random.Random(f"linear {index}")
    torch.manual_seed(index)
    equal = rng.random() < 0.5
    vocab = rng.choice([3, 50, 1001, 4099]) * (WORLD if equal else 1)
    rows, hidden = rng.choice([1, 7, 33]), rng.choice([8, 64])
    dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    x = torch.randn(rows, hidden).to(dtype).to(device)
    weight = (torch.randn(vocab, hidden) * rng.choice([0.3, 2.0])).to(dtype).to(device)
    bias = torch.randn(vocab).to(dtype).to(device) if rng.random() < 0.5 else None
    ignore_index = rng.choice([-100, 0])
    target = torch.randint(0, vocab, (rows,)).masked_fill(torch.rand(rows) < 0.3, ignore_index).to(device)
    options = dict(reduction=rng.choice(["mean", "sum", "none"]), ignore_index=ignore_index,
                   label_smoothing=rng.choice([0.0, 0.1]), z_loss=rng.choice([0.0, 1e-2]), softcap=rng.choice([None, 3.0]))
    start, end = shard_bounds(vocab, equal)[rank]
    # The truth: float64 by torch's formula; for bfloat16, our unsharded loss (its own float64 test is
    # test_linear_cross_entropy.py's: bfloat16 logits carry errors far above a sharding's).
    if dtype == torch.bfloat16:
        full = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        truth, truth_lse = losses.linear_cross_entropy(full[0], full[1], target, linear_bias=full[2], **options,
                                                        return_lse=True)
        truth, truth_lse = truth.double(), truth_lse.double()
    else:
        full = [t.detach().double().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        truth, truth_lse = cross_entropy.reference_cross_entropy(torch.nn.functional.linear(*full), target, None, ignore_index,
                                                       options["reduction"], options["label_smoothing"],
                                                       options["z_loss"], True, options["softcap"])
    grad_output = torch.rand_like(truth) + 0.5
    truth.backward(grad_output)
    mine = [x.clone().requires_grad_(), weight[start:end].clone().requires_grad_(),
            None if bias is None else bias[start:end].clone().requires_grad_()]
    loss, lse = losses.linear_cross_entropy(mine[0], mine[1], target, linear_bias=mine[2], **options, return_lse=True,
                                            process_group=group, vocab_start=None if equal else start)
    loss.backward(grad_output.to(loss.dtype))
    tolerance = TOLERANCE[dtype]
    case = f"linear case {index}: {rows}x{hidden}x{vocab} {dtype} shards {shard_bounds(vocab, equal)} {options}"
    assert loss.dtype == dtype, f"{case}: loss is {loss.dtype}"
    torch.testing.assert_close(loss.double(), truth.detach(), rtol=tolerance, atol=tolerance, equal_nan=True,
                               msg=lambda m: f"{case}: loss: {m}")
    torch.testing.assert_close(lse.double(), truth_lse, rtol=tolerance, atol=tolerance, msg=lambda m: f"{case}: lse: {m}")
    for name, ours, whole, part in (("input", mine[0], full[0], slice(None)), ("weight", mine[1], full[1], slice(start, end)),
                                    ("bias", mine[2], full[2], slice(start, end))):
        if ours is not None:
            expected = whole.grad[part].double()
            torch.testing.assert_close(ours.grad.double(), expected, rtol=tolerance,
                                       atol=tolerance * expected.abs().max().item(), msg=lambda m: f"{case}: {name}: {m}")
    return loss.detach(), mine[1].grad


def check_errors_and_edges(rank, group, device):
    logits = torch.randn(4, 10, device=device)
    # Unequal shards without vocab_start: rank * C_r does not tile the vocabulary (more in check_faults).
    shard = logits[:, :3] if rank == 0 else logits[:, 3:]
    target = torch.zeros(4, dtype=torch.long, device=device)
    vocab_parallel._checked_layouts.clear()  # every rank sees its layout first (on a GPU, where each judges it)
    with pytest.raises(ValueError, match="do not tile"):
        losses.cross_entropy(shard, target, process_group=group)
    # A target outside [0, V): NaN for its row, as on one GPU; the other rows as ever.
    target = torch.tensor([1, 10, 7, -100], device=device)
    rows = losses.cross_entropy(logits[:, 5 * rank:5 * rank + 5], target, reduction="none", process_group=group)
    expected = torch.nn.functional.cross_entropy(logits, target.clamp(max=9), reduction="none")
    assert torch.isnan(rows[1]) and not torch.isnan(rows[[0, 2, 3]]).any()
    torch.testing.assert_close(rows[[0, 2, 3]], expected[[0, 2, 3]])
    with pytest.raises(ValueError, match="inplace_backward is not supported with process_group"):
        losses.cross_entropy(logits[:, :5].clone(), target, inplace_backward=True, process_group=group)
    shard = logits[:, 5 * rank:5 * rank + 5].clone().requires_grad_()
    loss = losses.cross_entropy(shard, target.clamp(max=9), process_group=group)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, shard, create_graph=True)
    check_empty_shard(rank, group, device)


def check_empty_shard(rank, group, device):
    """A shard of no classes is a valid layout: rank 0 holds none, rank 1 all ten. Each loss gives
    the unsharded one, rank 1 the whole gradient, rank 0 an empty one."""
    torch.manual_seed(12345)  # the same inputs on both ranks
    logits, weight = torch.randn(4, 10, device=device), torch.rand(10, device=device) + 0.5
    target = torch.tensor([1, 9, 3, -100], device=device)
    probabilities = torch.randn(4, 10, device=device).softmax(1)
    x, head, bias = torch.randn(4, 6, device=device), torch.randn(10, 6, device=device), torch.randn(10, device=device)
    width = 0 if rank == 0 else 10
    cases = {  # name: (ours of this rank's shards, torch's of the whole)
        "class indices": (lambda z, *_: losses.cross_entropy(z, target, label_smoothing=0.1, z_loss=1e-2,
                                                             process_group=group, vocab_start=0),
                          lambda z: cross_entropy.reference_cross_entropy(z, target, None, -100, "mean", 0.1, 1e-2,
                                                                          False)),
        "class weights": (lambda z, w, *_: losses.cross_entropy(z, target, w, process_group=group, vocab_start=0),
                          lambda z: F.cross_entropy(z, target, weight)),
        "probabilities": (lambda z, w, y: losses.cross_entropy(z, y, process_group=group, vocab_start=0),
                          lambda z: F.cross_entropy(z, probabilities)),
    }
    for name, (ours, theirs) in cases.items():
        shard = logits[:, :width].clone().requires_grad_()
        loss = ours(shard, weight[:width], probabilities[:, :width])
        loss.backward()
        whole = logits.clone().requires_grad_()
        expected = theirs(whole)
        expected.backward()
        torch.testing.assert_close(loss, expected, msg=lambda m: f"empty shard, {name}: loss: {m}")
        torch.testing.assert_close(shard.grad, whole.grad[:, :width], msg=lambda m: f"empty shard, {name}: grad: {m}")
    mine = [x.clone().requires_grad_(), head[:width].clone().requires_grad_(), bias[:width].clone().requires_grad_()]
    loss = losses.linear_cross_entropy(*mine[:2], target, linear_bias=mine[2], process_group=group, vocab_start=0)
    loss.backward()
    whole = [t.clone().requires_grad_() for t in (x, head, bias)]
    expected = F.cross_entropy(F.linear(*whole), target)
    expected.backward()
    torch.testing.assert_close(loss, expected, msg=lambda m: f"empty shard, linear: loss: {m}")
    for ours, theirs, part in ((mine[0], whole[0], slice(None)), (mine[1], whole[1], slice(0, width)),
                               (mine[2], whole[2], slice(0, width))):
        torch.testing.assert_close(ours.grad, theirs.grad[part], msg=lambda m: f"empty shard, linear: grad: {m}")


# The layout checks alone, on the facts every rank reads (first class, classes, rows, input width, dtype code):
# check_tiling's verdict and the device's (_layout_on_device, for the calls that read no facts) agree.
F32, F64 = vocab_parallel._DTYPES.index(torch.float32), vocab_parallel._DTYPES.index(torch.float64)
LIMIT = vocab_parallel.CLASS_ID_LIMIT
# name: (each rank's (first class, classes), dtype code, the error's text or None for a valid layout, V)
LAYOUTS = {
    # An empty shard anywhere (the module's docstring): fails if check_tiling counts empty shards (width >= 0).
    "rank 1 empty, past the end": ([(0, 12), (12, 0)], F32, None, 12),
    "rank 1 empty, far past the end": ([(0, 12), (40, 0)], F32, None, 12),
    "rank 1 empty, past 2^24": ([(0, 12), (LIMIT + 5, 0)], F32, None, 12),
    "rank 1 empty, inside rank 0's": ([(0, 12), (5, 0)], F32, None, 12),
    "rank 0 empty, at 0": ([(0, 0), (0, 12)], F32, None, 12),
    "rank 1 of 3 empty, between": ([(0, 5), (9, 0), (5, 7)], F32, None, 12),
    # The class limit, to the class: fails if a shard ending at 2^24 is refused (>= for >), or one past it taken.
    "ending at 2^24": ([(0, LIMIT // 2), (LIMIT // 2, LIMIT // 2)], F32, None, LIMIT),
    "ending at 2^24 + 1": ([(0, LIMIT // 2), (LIMIT // 2, LIMIT // 2 + 1)], F32, "past class 2", LIMIT + 1),
    "ending at 2^24 + 1, float64": ([(0, LIMIT // 2), (LIMIT // 2, LIMIT // 2 + 1)], F64, None, LIMIT + 1),
    "gap": ([(0, 5), (6, 6)], F32, "belong to no rank", 12),
    "overlap": ([(0, 6), (5, 7)], F32, "the two overlap", 12),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_is_judged_alike_by_the_facts_and_on_the_device(name):
    shards, dtype, says, vocab = LAYOUTS[name]
    facts = [[start, width, 4, 8, dtype] + [0] * vocab_parallel._MESSAGE_WORDS for start, width in shards]
    error = vocab_parallel.check_tiling(facts)
    assert (error is None) if says is None else (error is not None and re.search(says, error)), f"{name}: {error}"
    on_device, valid = vocab_parallel._layout_on_device(torch.tensor(facts), vocab_parallel._DTYPES[dtype])
    assert bool(valid) == (says is None) and on_device.item() == vocab, f"{name}: {on_device}, {valid}"


def check_all(rank, device, cases):
    """Every case twice (the same bits), the linear cases, the errors and edges: one rank's part."""
    if device.type == "cuda":
        os.environ.pop("FUSED_LOSSES_STRICT", None)  # class weights and probabilities take torch ops
    group = dist.group.WORLD
    for index in cases:
        first = check_case(index, rank, group, device)
        torch.testing.assert_close(check_case(index, rank, group, device), first, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"case {index}: not the same bits on a second run: {m}")
    for index in range(len(cases) // 4):
        first = check_linear_case(index, rank, group, device)
        torch.testing.assert_close(check_linear_case(index, rank, group, device), first, rtol=0, atol=0,
                                   equal_nan=True, msg=lambda m: f"linear case {index}: not the same bits: {m}")
    check_errors_and_edges(rank, group, device)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_vocab_parallel_on_cpu_with_gloo(tmp_path):
    run_on_ranks(check_all, (range(120),), "gloo", tmp_path / "store", WORLD)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_vocab_parallel_on_two_gpus_with_nccl(tmp_path):
    run_on_ranks(check_all, (range(120),), "nccl", tmp_path / "store", WORLD)


# ----------------------------------------------------------------------------------
# torch.compile and CUDA graphs with process_group=: the same numbers as eager calls.

def graphed(step, operands):
    """step(*operands) (a forward and backward) captured in a CUDA graph after warm-up calls on a side
    stream (a rank checks its layout once, at its first call); returns replay(*new operands), which copies
    them into the captured ones and returns step's outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for operand in operands:
                operand.grad = None
            step(*operands)
    torch.cuda.current_stream().wait_stream(side)
    for operand in operands:
        operand.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*operands)

    def replay(*new):
        with torch.no_grad():
            for operand, value in zip(operands, new):
                operand.copy_(value)
        graph.replay()
        return outputs
    return replay


def check_compiled_and_graphed(rank, device):
    """Both losses with process_group=, compiled (and on a GPU captured in a CUDA graph), against eager
    calls: loss and gradients, for three fresh inputs."""
    group, classes, rows, hidden = dist.group.WORLD, 1000, 33, 64
    first = rank * classes // 2
    target = torch.empty(rows, dtype=torch.long, device=device)

    def cross_entropy_step(shard):
        loss = losses.cross_entropy(shard, target, label_smoothing=0.1, process_group=group, vocab_start=first)
        loss.backward()
        return loss.detach(), shard.grad

    def linear_step(x, head):
        loss = losses.linear_cross_entropy(x, head, target, softcap=20.0, process_group=group, vocab_start=first)
        loss.backward()
        return loss.detach(), x.grad, head.grad

    def inputs(seed, step):
        generator = torch.Generator().manual_seed(seed)  # the same on every rank: each takes its classes
        target.copy_(torch.randint(0, classes, (rows,), generator=generator))
        if step is cross_entropy_step:
            return [torch.randn(rows, classes, generator=generator)[:, first:first + classes // 2].to(device)]
        x, head = torch.randn(rows, hidden, generator=generator), torch.randn(classes, hidden, generator=generator)
        return [x.to(device), head[first:first + classes // 2].to(device)]

    def eager(step, values):
        operands = [value.clone().requires_grad_() for value in values]
        return [output.clone() for output in step(*operands)]

    for step in (cross_entropy_step, linear_step):
        runs = {"compiled": torch.compile(step)}
        if device.type == "cuda":
            runs["CUDA graph"] = graphed(step, [value.clone().requires_grad_() for value in inputs(0, step)])
        for how, run in runs.items():
            for seed in (1, 2, 3):
                values = inputs(seed, step)
                expected = eager(step, values)
                operands = values if how == "CUDA graph" else [value.clone().requires_grad_() for value in values]
                got = run(*operands)
                for name, ours, theirs in zip(("loss", "grad", "grad"), got, expected):
                    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7,
                                               msg=lambda m: f"{step.__name__}, {how}, seed {seed}: {name}: {m}")


@pytest.mark.skipif(not dist.is_available() or not loss_helpers.COMPILE_OPS, reason="needs torch.distributed, torch >= 2.4")
def test_compiled_with_gloo(tmp_path):
    run_on_ranks(check_compiled_and_graphed, (), "gloo", tmp_path / "store", WORLD)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_compiled_and_cuda_graphs_on_two_gpus_with_nccl(tmp_path):
    run_on_ranks(check_compiled_and_graphed, (), "nccl", tmp_path / "store", WORLD)


# ----------------------------------------------------------------------------------
# Faults, each injected on one rank: every rank raises the same error, naming that rank, within
# FAULT_SECONDS (a rank that has not answered by then is stuck in a collective and fails the run).

FAULT_SECONDS = 60
ROWS, HIDDEN = 4, 6


def tiling(world, empty=None):
    """Every rank's (first class, classes): unequal shards, rank r holding r + 2 classes (none for `empty`)."""
    widths = [0 if rank == empty else rank + 2 for rank in range(world)]
    return [(sum(widths[:rank]), widths[rank]) for rank in range(world)]


# name: (the faulty rank in a group of `world`, its change to its call, what every rank's error says)
FAULTS = {
    "overlap": (lambda world: world - 1, lambda call: dict(call, start=call["start"] - 1), "the two overlap"),
    "gap": (lambda world: 0, lambda call: dict(call, start=1, width=1), r"classes \[0, 1\) belong to no rank"),
    "past 2^24 classes": (lambda world: world - 1, lambda call: dict(call, start=2**24 - 1), "past class 2"),
    "rows": (lambda world: 1, lambda call: dict(call, rows=ROWS - 1), "rows"),
    "dtype": (lambda world: 0, lambda call: dict(call, dtype=torch.float64), "same dtype"),
    "input width (linear)": (lambda world: world - 1, lambda call: dict(call, hidden=HIDDEN + 1), "width"),
    "an argument": (lambda world: world // 2, lambda call: dict(call, target_rows=ROWS - 1),
                    r"call is not valid: target must (have|hold)"),
    "layout change between calls": (lambda world: world - 1, lambda call: dict(call, start=call["start"] + 1),
                                    "belong to no rank"),
    "group reused after destruction": (lambda world: world - 1, lambda call: dict(call, start=call["start"] - 1),
                                       "the two overlap"),
}
# A fault that a GPU sees on the faulty rank alone: a layout new to it after the group's first calls (its
# peers read no facts then: a read would sync). It raises there; its peers' losses are NaN.
SEEN_BY_THE_FAULTY_RANK_ON_A_GPU = "layout change between calls"


def one_call(loss, group, device, start, width, vocab=None, rows=ROWS, dtype=torch.float32, hidden=HIDDEN,
             target=None, target_rows=None):
    """loss ('cross_entropy' or 'linear') on this rank's classes [start, start + width), forward and backward.
    Given vocab (a valid layout), the inputs are the same on every rank and the loss and gradients are
    checked against torch's unsharded ones (a target outside [0, V): NaN for its row alone)."""
    generator = torch.Generator().manual_seed(0)
    classes, first = (vocab, start) if vocab is not None else (width, 0)
    x = torch.randn(rows, hidden, generator=generator).to(dtype).to(device)
    shape = (classes, hidden) if loss == "linear" else (rows, classes)  # the head (V, H), or the logits (N, V)
    whole = torch.randn(shape, generator=generator).to(dtype).to(device)
    if target is None:
        target = torch.randint(0, max(classes, 1), (target_rows or rows,), generator=generator).to(device)
    mine = whole[first:first + width] if loss == "linear" else whole[:, first:first + width]
    mine, x_mine = mine.clone().requires_grad_(), x.clone().requires_grad_()
    if loss == "linear":
        ours = losses.linear_cross_entropy(x_mine, mine, target, reduction="none", process_group=group,
                                           vocab_start=start)
    else:
        ours = losses.cross_entropy(mine, target, reduction="none", process_group=group, vocab_start=start)
    ours.sum().backward()
    if vocab is None:
        return ours
    whole, x = whole.clone().requires_grad_(), x.clone().requires_grad_()
    inside = (target >= 0) & (target < vocab)
    theirs = F.cross_entropy(F.linear(x, whole) if loss == "linear" else whole, target.clamp(0, vocab - 1),
                             reduction="none")
    (theirs * inside).sum().backward()
    assert torch.isnan(ours[~inside]).all(), f"{loss}: a target outside [0, {vocab}) gives {ours}"
    torch.testing.assert_close(ours[inside], theirs[inside], msg=lambda m: f"{loss}: loss: {m}")
    if inside.all():
        part = whole.grad[first:first + width] if loss == "linear" else whole.grad[:, first:first + width]
        torch.testing.assert_close(mine.grad, part, msg=lambda m: f"{loss}: grad: {m}")
        if loss == "linear":
            torch.testing.assert_close(x_mine.grad, x.grad, msg=lambda m: f"{loss}: input's grad: {m}")


def check_faults(rank, device, policies):
    """The steps of run_on_ranks: valid calls, then each fault on one rank, for both losses, under each
    policy: 'every call' (CPU's, the facts read at every call) and 'first sight' (a GPU's: a rank reads
    them where it first sees its layout; on CPU by making _reads_every_call say no, each fault on a group
    every rank sees first, as a fresh process would)."""
    world, group = dist.get_world_size(), dist.group.WORLD
    layout = tiling(world)
    start, width = layout[rank]
    valid = dict(start=start, width=width, vocab=sum(layout[-1]))
    for policy in policies:
        if policy == "first sight":
            vocab_parallel._reads_every_call = lambda shared: False
        for loss in ("cross_entropy", "linear"):
            yield f"{policy}: valid, {loss}", lambda: one_call(loss, group, device, **valid)
            empty = tiling(world, empty=0)
            yield (f"{policy}: valid, rank 0 holds no class, {loss}",
                   lambda: one_call(loss, group, device, *empty[rank], vocab=sum(empty[-1])))
            outside = torch.tensor([0, valid["vocab"], -5, 1], device=device)
            yield f"{policy}: a target outside [0, V), {loss}", lambda: one_call(loss, group, device, **valid,
                                                                                 target=outside)
        for fault, (faulty, change, _) in FAULTS.items():
            mine = change(valid) if rank == faulty(world) else valid
            mine = {key: value for key, value in mine.items() if key != "vocab"}
            for loss in ("linear",) if "linear" in fault else ("cross_entropy", "linear"):
                vocab_parallel._checked_layouts.clear()  # every rank sees the group first
                if fault == SEEN_BY_THE_FAULTY_RANK_ON_A_GPU:
                    def twice():
                        one_call(loss, group, device, **valid)
                        result = one_call(loss, group, device, **mine)  # raises on the rank that read its facts
                        assert policy == "first sight" and torch.isnan(result).all(), f"{loss} gave {result}"
                    yield f"{policy}: {fault}, {loss}", twice
                elif fault == "group reused after destruction":
                    old = dist.new_group(list(range(world)))
                    one_call(loss, old, device, **valid)
                    dist.barrier(group=old)  # destroyed under a peer's last all-reduce, torch 2.0's gloo hung
                    dist.destroy_process_group(old)
                    del old
                    gc.collect()
                    assert all(key is group for key in vocab_parallel._checked_layouts), "a dead group's layouts"
                    new = dist.new_group(list(range(world)))
                    yield f"{policy}: {fault}, {loss}", lambda: one_call(loss, new, device, **mine)
                else:
                    yield f"{policy}: {fault}, {loss}", lambda: one_call(loss, group, device, **mine)
        for loss in ("cross_entropy", "linear"):  # the group goes on as before
            yield f"{policy}: valid again, {loss}", lambda: one_call(loss, group, device, **valid)


def check_fault_reports(reports, world, backend):
    """Each fault: every rank raised the same ArgumentError (a ValueError and a RuntimeError), naming the
    faulty rank, within FAULT_SECONDS; every valid step returned. Prints what each rank saw."""
    print(f"\n{backend}, {world} ranks:")
    for name, ranks in reports.items():
        fault = next((fault for fault in FAULTS if f": {fault}, " in name), None)
        outcomes = sorted({outcome for outcome, _, _ in ranks})
        texts = sorted({text for _, text, _ in ranks})
        seen = f"{outcomes[0]} on every rank" if len(outcomes) == 1 else ", ".join(
            f"rank {rank} {outcome}" for rank, (outcome, _, _) in enumerate(ranks))
        print(f"  {name}: {seen}, {max(s for _, _, s in ranks):.3f} s at most"
              + (f": {texts[0]}" if fault and len(texts) == 1 else ""))
        if fault is None:
            assert outcomes == ["returned"], f"{name}: {ranks}"
            continue
        faulty, _, says = FAULTS[fault]
        if name.startswith("first sight") and fault == SEEN_BY_THE_FAULTY_RANK_ON_A_GPU:
            assert [outcome for outcome, _, _ in ranks] == ["ArgumentError" if rank == faulty(world) else "returned"
                                                            for rank in range(world)], f"{name}: {ranks}"
            texts = [ranks[faulty(world)][1]]
        else:
            assert outcomes == ["ArgumentError"] and len(texts) == 1, f"{name}: not the same error on every rank: {ranks}"
        assert f"rank {faulty(world)}" in texts[0] and re.search(says, texts[0]), f"{name}: {texts[0]}"
        assert all(seconds < FAULT_SECONDS for _, _, seconds in ranks), f"{name}: {ranks}"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_faults_raise_on_every_rank_with_gloo(tmp_path, world):
    began = time.monotonic()
    reports = run_on_ranks(check_faults, (("every call", "first sight"),), "gloo", tmp_path / "store", world,
                           timeout=300, step_timeout=FAULT_SECONDS)
    check_fault_reports(reports, world, "gloo")
    print(f"  {time.monotonic() - began:.1f} s in all")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_faults_raise_on_every_rank_with_nccl(tmp_path):
    reports = run_on_ranks(check_faults, (("first sight",),), "nccl", tmp_path / "store", WORLD, timeout=300,
                           step_timeout=FAULT_SECONDS)
    check_fault_reports(reports, WORLD, "nccl")
