"""Cross-entropy over a vocabulary split among the ranks of a torch.distributed group
(losses.cross_entropy(..., process_group=group)).

Each rank holds a contiguous shard of the classes: logits (rows, C_r) and weight (C_r,);
class-index targets are global ids, probability targets are sharded like the logits. The
loss, the lse and the gradient of this rank's shard equal single-device cross_entropy on the
gathered logits. Per call two all-reduces of (rows,)-sized tensors and no host sync: the
row maxima (MAX), then every row's sums packed together (SUM): the exp sum, the target's
logit and the smoothing sums (and with class weights the target's weight and how many ranks
own the target). The gradient is the local shard's alone, with no communication. The
result is deterministic for a fixed group.

Shards tile [0, V) in any rank order. A rank's first class is `vocab_start`, by default
rank * C_r (equal shards). The layout is checked from values the all-reduces carry anyway:
the first call with a new layout (as this rank sees it) reads them back once (one host sync)
and raises if the shards do not tile [0, V); a later call whose shards do not tile gives NaN.
Class ids travel in the accumulation type: up to 2^24 classes for 2- and 4-byte logits.

Class-index targets without weight (the usual case; softcap too) take the row-pass engine
(row_passes.py, kernels/row_passes.cu on CUDA) over the shard: its statistics, combined with
the group's by Shards.combine between the passes, and its gradient in backward, from the saved
logits and the global lse. linear_cross_entropy(process_group=...) runs the same engine over
chunks of its logits. Class weights or probability targets take torch ops in float32 (float64
for float64 logits), the gradient computed in the forward (_VocabParallelCrossEntropy); on CUDA
tensors FUSED_LOSSES_STRICT=1 makes that raise.
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
    [0, V), on the device: sorted by first class, each starts where the last ended. Exact in
    float32 up to 2^24 classes."""
    starts, ends = layout[0::2], layout[0::2] + layout[1::2]
    order = starts.argsort()
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(rows, C_r) logits; target (rows,) global class ids or (rows, C_r) probabilities.
    Returns (loss, lse)."""

    @staticmethod
    def forward(ctx, logits, target, weight, options):
        group, start, ignore_index, reduction, float_loss, label_smoothing, z_loss = options
        probs = target.is_floating_point()
        acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
        x = logits.to(acc)
        rows, local = x.shape
        w = weight.to(acc) if weight is not None else torch.ones(local, dtype=acc, device=x.device)

        _check_class_ids(logits, start, local)
        # All-reduce 1 (MAX): the row maxima and the vocabulary's end V.
        maxima = torch.cat([x.amax(1), x.new_tensor([start + local])])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        row_max, vocab = maxima[:rows], maxima[rows]
        e = torch.exp(x - row_max[:, None])
        share = label_smoothing / vocab  # eps / V
        if probs:
            y = target.to(acc)
            wy = w * y
            local_sums = [e.sum(1), wy.sum(1), (wy * x).sum(1), w.sum().expand(rows), (w * x).sum(1)]
        else:
            index = target.long() - start
            owned = (index >= 0) & (index < local) & (target != ignore_index)
            index = index.clamp(0, local - 1)
            target_logit = torch.where(owned, x.gather(1, index[:, None])[:, 0], 0.0)
            target_weight = torch.where(owned, w[index], 0.0)
            local_sums = [e.sum(1), target_logit, target_weight, owned.to(acc), w.sum().expand(rows), (w * x).sum(1)]
        columns, tiled = _all_reduce_sums(torch.stack(local_sums), group, start, local, vocab)
        # Shards that do not tile [0, V) (a layout this rank checked before, another rank's changed): NaN.
        lse = torch.where(tiled, row_max + columns[0].log(), float("nan"))
        weights_sum, weighted_logits = columns[-2], columns[-1]  # sum_c w_c, sum_c w_c x_c
        p = e / columns[0][:, None]

        if probs:
            _, wy_sum, wyx_sum = columns[:3]
            spread_weight = (1 - label_smoothing) * wy_sum + share * weights_sum  # sum_c w_c y'_c
            spread_logits = (1 - label_smoothing) * wyx_sum + share * weighted_logits
            ce = spread_weight * lse - spread_logits
            counted = torch.ones(rows, dtype=acc, device=x.device)
            ce_divisor = torch.tensor(float(rows), dtype=acc, device=x.device)
            grad = p * spread_weight[:, None] - w * ((1 - label_smoothing) * y + share)
            grad_y = (1 - label_smoothing) * w * (lse[:, None] - x)
        else:
            _, target_logit, target_weight, owners = columns[:4]
            ignored = target == ignore_index
            counted = (~ignored).to(acc)
            # No rank owns a target outside [0, V): NaN for its row, as on one GPU.
            valid = ignored | (owners > 0)
            ce = (1 - label_smoothing) * target_weight * (lse - target_logit) + share * (weights_sum * lse - weighted_logits)
            ce = torch.where(ignored, 0.0, torch.where(valid, ce, float("nan")))
            ce_divisor = target_weight.sum()
            one_hot = torch.zeros_like(x).scatter_(1, index[:, None], owned.to(acc)[:, None])
            grad = (p * ((1 - label_smoothing) * target_weight + share * weights_sum)[:, None] - share * w
                    - (1 - label_smoothing) * target_weight[:, None] * one_hot)
            grad = torch.where(valid[:, None], grad, float("nan"))
            grad_y = None
        z = z_loss * lse.square() * counted
        if reduction == "none":
            ce_scale = z_scale = 1.0
            loss = ce + z
        elif reduction == "sum":
            ce_scale = z_scale = 1.0
            loss = ce.sum() + z.sum()
        else:  # mean; z over the counted rows (none counted: the ce term is NaN, z adds 0)
            ce_scale, z_scale = 1 / ce_divisor, 1 / counted.sum().clamp_min(1)
            loss = ce.sum() * ce_scale + z.sum() * z_scale
        grad = grad * ce_scale
        if z_loss:
            grad = grad + (2 * z_loss * z_scale) * lse[:, None] * p
        # An ignored row's gradient is 0, as torch's, whatever the scale (1 / 0 with every row ignored).
        grad = torch.where(counted[:, None] > 0, grad, 0.0)
        ctx.reduction = reduction
        ctx.save_for_backward(grad.to(logits.dtype) if ctx.needs_input_grad[0] else None,
                              (grad_y * ce_scale).to(target.dtype) if probs and ctx.needs_input_grad[1] else None)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return loss.to(torch.float32 if float_loss else logits.dtype), lse

    @staticmethod
    def backward(ctx, grad_output, _):
        # The gradient was computed in the forward, with no graph: a second derivative through
        # it would silently treat it as a constant.
        helpers.no_second_derivative("cross_entropy with process_group")
        grad_logits, grad_target = ctx.saved_tensors
        if grad_output is None:
            return None, None, None, None
        scale = grad_output[:, None] if ctx.reduction == "none" else grad_output
        return (None if grad_logits is None else grad_logits * scale.to(grad_logits.dtype),
                None if grad_target is None else grad_target * scale.to(grad_target.dtype), None, None)


def cross_entropy_rows(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, softcap,
                       group, vocab_start):
    """(loss, lse) of (rows, C_r) logits; see the module's docstring."""
    shards = Shards(group, logits.shape[1], vocab_start, logits)
    if uses_row_passes(target, weight):
        loss, lse = row_passes.RowPassCrossEntropy.apply(logits.contiguous(), target.contiguous(), None, (
            ignore_index, label_smoothing, z_loss, softcap or 0.0, reduction, shards))
        return loss.to(torch.float32 if float_loss else logits.dtype), lse
    if softcap is not None:
        raise ValueError("cross_entropy: softcap with process_group takes class-index targets without weight")
    options = (shards.group, shards.start, ignore_index, reduction, float_loss, label_smoothing, z_loss)
    return _VocabParallelCrossEntropy.apply(logits, target, weight, options)


def uses_row_passes(target, weight) -> bool:
    """The one choice of path: class indices without class weights take the row passes."""
    return not target.is_floating_point() and weight is None
