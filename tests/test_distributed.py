"""Vocabulary-parallel cross-entropy (losses.cross_entropy(..., process_group=...)) and linear
cross-entropy (the output layer's rows sharded): 2 processes, each holding a shard of the
classes, against the unsharded loss in float64 (loss, lse, and each rank's part of the
gradients). On CPU with gloo (CI) and on 2 GPUs with NCCL."""
import contextlib
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cross_entropy
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
    # Unequal shards without vocab_start: rank * C_r does not tile the vocabulary. A layout
    # new to the rank raises; one it saw tile before (another rank's changed) gives NaN.
    shard = logits[:, :3] if rank == 0 else logits[:, 3:]
    target = torch.zeros(4, dtype=torch.long, device=device)
    vocab_parallel._checked_layouts.clear()
    with pytest.raises(ValueError, match="do not tile"):
        losses.cross_entropy(shard, target, process_group=group)
    if rank == 1:
        vocab_parallel._checked_layouts.add((id(group), 7, 7))
    with pytest.raises(ValueError, match="do not tile") if rank == 0 else contextlib.nullcontext():
        loss = losses.cross_entropy(shard, target, process_group=group)
        assert torch.isnan(loss)
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
