"""Cross-entropy over a vocabulary split among the ranks of a torch.distributed group
(losses.cross_entropy(..., process_group=group)).

Each rank holds a contiguous shard of the classes: logits (rows, C_r) and weight (C_r,);
class-index targets are global ids, probability targets are sharded like the logits. The
loss, the lse and the gradient of this rank's shard equal single-device cross_entropy on the
gathered logits. Per call two all-reduces of (rows,)-sized tensors and no host sync: the
row maxima (MAX), then every row's sums packed together (SUM): the exp sum, the target's
logit and the smoothing sums (with class weights or probabilities, their weighted sums and the
target's weight). The gradient is the local shard's alone, with no communication. The
result is deterministic for a fixed group.

Shards tile [0, V) in any rank order. A rank's first class is `vocab_start`, by default
rank * C_r (equal shards). The layout is checked from values the all-reduces carry anyway:
the first call with a new layout (as this rank sees it) reads them back once (one host sync)
and raises if the shards do not tile [0, V); a later call whose shards do not tile gives NaN.
Class ids travel in the accumulation type: up to 2^24 classes for 2- and 4-byte logits.

Every call takes the row-pass engine (row_passes.py) over the shard: its statistics, combined
with the group's by Shards.combine between the passes, and its gradient in backward, from the
saved logits and the global statistics. Class-index targets without weight (the usual case;
softcap too) run kernels/row_passes.cu on CUDA; class weights or probability targets the
engine's torch twin, in float32 (float64 for float64 logits), on CUDA tensors too, where
FUSED_LOSSES_STRICT=1 makes that raise. linear_cross_entropy(process_group=...) runs the same
engine over chunks of its logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

if __package__:
    from . import loss_helpers as helpers
    from . import row_passes
else:
    import loss_helpers as helpers
    import row_passes

# Layouts checked by this process: (group, C_r, vocab_start) as seen by this rank.
_checked_layouts: set = set()


def shard_start(group, local_classes: int, vocab_start: int | None) -> int:
    return int(vocab_start) if vocab_start is not None else dist.get_rank(group) * local_classes


def check_group_device(group, logits: torch.Tensor) -> None:
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl" and not logits.is_cuda:
        raise ValueError(f"process_group uses NCCL, which takes CUDA tensors; input is on {logits.device}")


def _shards_tile(layout: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Whether the shards (layout: every rank's first class and width, interleaved) tile
    [0, V), on the device: sorted by first class, each starts where the last ended. An empty
    shard sorts before a shard that starts where it does, so it never breaks the chain. Exact
    in float32 up to 2^24 classes."""
    starts, widths = layout[0::2], layout[1::2]
    ends = starts + widths
    order = (2 * starts + (widths > 0)).argsort()
    starts, ends = starts[order], ends[order]
    return (starts[0] == 0) & (ends[-1] == vocab) & (starts[1:] == ends[:-1]).all()


def _check_layout(group, local_classes, start, layout, vocab, tiled) -> None:
    """Raises unless the shards tile [0, V) (the first read of a layout is a host sync; then cached)."""
    key = (id(group), local_classes, start)
    if key in _checked_layouts:
        return
    if not bool(tiled.item()):
        shards = [(int(first), int(first + width)) for first, width in layout.view(-1, 2).tolist()]
        raise ValueError(
            f"cross_entropy: the vocabulary shards of the process group do not tile [0, V): the ranks' shards "
            f"are classes {', '.join(f'[{a}, {b})' for a, b in shards)} (this rank's [{start}, "
            f"{start + local_classes})), V = {int(vocab.item())}. Shards of unequal width need vocab_start= "
            f"(each rank's first class id); without it a rank's first class is rank * C_r.")
    _checked_layouts.add(key)


def _check_class_ids(logits, start, local) -> None:
    if start + local > 2**24 and logits.dtype != torch.float64:
        raise ValueError(f"cross_entropy: process_group takes up to 2^24 classes with {logits.dtype} logits "
                         f"(class ids travel in float32); this shard ends at class {start + local}")


def _all_reduce_sums(local_sums, group, start, local, vocab):
    """All-reduce 2 (SUM): the rows' sums (k, rows) and every rank's first class and width (this
    rank's slots). Returns (the group's sums, whether the shards tile [0, V), on the device)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = torch.zeros(2 * world, dtype=local_sums.dtype)
    layout[2 * rank], layout[2 * rank + 1] = start, local
    sums = torch.cat([local_sums.reshape(-1), layout.to(local_sums.device)])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    layout = sums[local_sums.numel():]
    tiled = _shards_tile(layout, vocab)
    _check_layout(group, local, start, layout, vocab, tiled)
    return sums[:local_sums.numel()].view_as(local_sums), tiled


class Shards:
    """The classes split among a group's ranks, as this rank sees them: its first class `start`
    and its width `local`. Checks what this rank alone can check (the group's backend takes
    `like`'s device; class ids exact in the accumulation type)."""

    def __init__(self, group, local: int, vocab_start: int | None, like: torch.Tensor):
        check_group_device(group, like)
        self.group, self.local = group, local
        self.start = shard_start(group, local, vocab_start)
        _check_class_ids(like, self.start, local)

    def combine(self, stats):
        """This rank's statistics (row_passes.new_stats') combined with the group's in two
        all-reduces: (the group's statistics, V on the device)."""
        rows = stats.shape[1]
        # All-reduce 1 (MAX): the row maxima and the vocabulary's end V.
        maxima = torch.cat([stats[0], stats.new_tensor([self.start + self.local])])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        row_max, vocab = maxima[:rows], maxima[rows]
        to_global = torch.where(stats[0] == row_max, 1.0, torch.exp(stats[0] - row_max))
        # All-reduce 2 (SUM): the other rows, the exp sums (rows 1 and 4) taken to the global max;
        # the target's terms only its owner holds (0 elsewhere).
        sums = stats[1:].clone()
        sums[0] *= to_global
        sums[3] *= to_global
        sums, tiled = _all_reduce_sums(sums, self.group, self.start, self.local, vocab)
        # Shards that do not tile [0, V) (a layout this rank checked before, another rank's changed): NaN.
        sums[0] = torch.where(tiled, sums[0], torch.nan)
        return torch.cat([row_max[None], sums]), vocab

    def sum_over_group(self, tensor: torch.Tensor) -> None:
        """In place: the sum of `tensor` over the group (input's gradient, to which every rank's classes add)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def cross_entropy_rows(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, softcap,
                       group, vocab_start):
    """(loss, lse) of (rows, C_r) logits; see the module's docstring."""
    if softcap is not None and not row_passes.uses_kernels(target, weight):
        raise ValueError("cross_entropy: softcap with process_group takes class-index targets without weight")
    shards = Shards(group, logits.shape[1], vocab_start, logits)
    loss, lse = row_passes.RowPassCrossEntropy.apply(logits.contiguous(), target.contiguous(), weight, (
        ignore_index, label_smoothing, z_loss, softcap or 0.0, reduction, shards))
    return loss.to(torch.float32 if float_loss else logits.dtype), lse
