"""The row-pass engine: cross-entropy over a chunk of classes of every row at a time, in two
passes: kernels/row_passes.cu on CUDA for class indices without class weights; the same math in
torch ops, its one twin, elsewhere and for class weights or probability targets (on every device).

fold_stats folds a chunk into each row's running statistics (max, sum of exp, target logit,
logit sum, sum of exp over the other classes, in float32; float64 for float64), from which
finish_loss gives the loss and the softmax's statistics; write_gradient, given those and each
row's scale, writes the chunk's gradient. Three schedules run them:
- RowPassCrossEntropy (here): whole (rows, C) logits, for cross_entropy with softcap, and a
  vocabulary shard's logits (vocab_parallel.py; with class weights or probabilities too), whose
  statistics are combined across the group between the passes (its Shards object);
- linear_cross_entropy.py: chunks of logits (of rows or of classes) that a matrix product just
  wrote, turned into their gradient in place (in the forward, or recomputed in backward).
"""
from __future__ import annotations

import torch

if __package__:
    from . import loss_helpers as helpers
else:
    import loss_helpers as helpers

_COMPILE_LIBRARY = helpers.define_compile_ops("row_passes", {"forward": helpers.no_outputs_fake,
                                                             "backward": helpers.no_outputs_fake})
STAT_ROWS = 5  # max, sum of exp, target logit, logit sum, sum of exp over the other classes
ENTROPY_STAT_ROWS = 6  # and sum_c exp(u_c - max) (u_c - max), the entropy's (log_probs with return_entropy)
WEIGHTED_STAT_ROWS = 7  # the torch twin's, for class weights or probabilities (the rows: above _weighted_targets)


def uses_kernels(target, weight) -> bool:
    """Class indices without class weights: the kernels' statistics (on CUDA)."""
    return not target.is_floating_point() and weight is None


def new_stats(rows: int, dtype: torch.dtype, device, stat_rows: int = STAT_ROWS) -> torch.Tensor:
    """Running statistics of no class yet, for logits of `dtype`: (stat_rows, rows)."""
    stats = torch.zeros(stat_rows, rows, dtype=helpers.accumulation_dtype(dtype), device=device)
    stats[0] = -torch.inf
    return stats


def fold_stats(z, target, start: int, classes: int, stats, softcap: float, weight=None, temperature: float = 1.0) -> None:
    """Folds z (rows, width), classes [start, start + width) of `classes`, into stats (their
    weighted rows where stats has WEIGHTED_STAT_ROWS, with weight (width,) or None; the entropy's
    too where it has ENTROPY_STAT_ROWS). The logits enter as u = softcap(z) / temperature."""
    if z.shape[1] == 0:  # an empty shard of the classes adds nothing
        return
    if z.is_cuda and len(stats) in (STAT_ROWS, ENTROPY_STAT_ROWS):
        helpers.kernel_ops("row_passes", z).forward(z, target, start, classes, stats, softcap, temperature)
    else:
        _stats_torch(z, target, start, stats, softcap, weight, temperature)


def finish_loss(stats, target, ignore_index: int, classes, label_smoothing: float, z_loss: float):
    """(per-row loss, softmax_stats, count) from complete statistics: loss 0 for an ignored row, NaN
    for a class outside [0, classes); softmax_stats (3, rows): each row's max and log(sum exp),
    whose sum is the lse (lse_of; write_gradient takes them apart), and its target's p - 1 as
    -(the other classes' sum) / (the sum), which does not cancel; count: the rows not ignored
    (0-dim, on the device: no host sync)."""
    softmax_stats = softmax_stats_of(stats)
    lse = lse_of(softmax_stats)
    counted, invalid = _row_counts(target, ignore_index, classes)
    ce = (1 - label_smoothing) * _target_nll(stats, lse)
    if label_smoothing:  # a masked class's -inf makes the logit sum -inf: 0 times it would be NaN, torch's term is 0
        ce = ce + label_smoothing * (lse - stats[3] / classes)
    loss = torch.where(invalid, torch.nan, torch.where(counted, ce + z_loss * lse.square(), 0.0))
    return loss, softmax_stats, counted.sum()


def softmax_stats_of(stats):
    """finish_loss's softmax_stats (3, rows) alone, from complete statistics; with the entropy's
    (ENTROPY_STAT_ROWS) a fourth row, sum_c p_c (u_c - max), the softmax's mean logit less the max."""
    rows = [stats[0], torch.log(stats[1]), -stats[4] / stats[1]]
    if len(stats) == ENTROPY_STAT_ROWS:
        rows.append(stats[5] / stats[1])
    return torch.stack(rows)


def entropy_of(softmax_stats):
    """Each row's softmax entropy, log(sum exp) - sum_c p_c (u_c - max): kept relative to the max,
    never sum_c p_c u_c, which cancels on a peaked row."""
    return softmax_stats[1] - softmax_stats[3]


def log_probs_of(stats, softmax_stats):
    """Each row's log p of its target, u_t - lse, exact on a confident row (_target_nll)."""
    return -_target_nll(stats, lse_of(softmax_stats))


def _target_nll(stats, lse):
    """lse - z_t, which cancels on a confident row (z_t the max, the loss far below 1): there as
    log1p(the other classes' exp sum / exp(z_t - max)), exact; where z_t is far below the max
    (no cancellation, and that exp would overflow) as the difference."""
    below_max = stats[0] - stats[2]
    near = below_max < 30
    return torch.where(near, torch.log1p(stats[4] * torch.exp(torch.where(near, below_max, 0.0))), lse - stats[2])


def finish(stats, target, ignore_index: int, classes: int, label_smoothing: float, z_loss: float, shards):
    """finish_loss of this call's statistics, combined with the group's first where the classes
    are sharded (shards: vocab_parallel.Shards, else None). Returns (per-row loss, softmax_stats,
    count, the number of classes: an int, or a 0-dim tensor where only the device knows it)."""
    stats, classes = combine(stats, classes, shards)
    return (*finish_loss(stats, target, ignore_index, classes, label_smoothing, z_loss), classes)


def combine(stats, classes: int, shards):
    """(stats, classes) combined with the group's where the classes are sharded; see finish."""
    return (stats, classes) if shards is None else shards.combine(stats)


def sums_at(stats, row_max):
    """stats[1:] moved onto row_max (each row's max over the parts, >= stats[0]): the exp sums scaled,
    the entropy's sum also shifted (sum e (u - max) moves with the max: + (max - row_max) sum e). Summed
    over the parts (vocabulary shards, the fused product's tiles: stats (rows..., parts, rows)) they are
    the whole row's; the target's terms only its part holds (0 elsewhere)."""
    to_max = torch.where(stats[0] == row_max, 1.0, torch.exp(stats[0] - row_max))
    sums = stats[1:].clone()
    sums[0] *= to_max
    sums[3] *= to_max
    if len(stats) == ENTROPY_STAT_ROWS:
        moved = torch.where(stats[1] == 0, 0.0, (stats[0] - row_max) * stats[1])
        sums[4] = (sums[4] + moved) * to_max
    return sums


def combine_tiles(partials):
    """(stat_rows, rows) statistics from the fused product's (tiles, stat_rows, rows) (linear_ce_gemm's
    row_stats): the tiles combined as shards are."""
    stats = partials.transpose(0, 1)
    row_max = stats[0].amax(0)
    return torch.cat([row_max[None], sums_at(stats, row_max).sum(1)])


def lse_of(softmax_stats):
    return softmax_stats[0] + softmax_stats[1]


def reduce_loss(loss, count, reduction: str):
    if reduction == "none":
        return loss
    return loss.sum() / count.to(loss.dtype) if reduction == "mean" else loss.sum()  # none counted: NaN, as torch


def row_scales(grad_output, target, count, ignore_index: int, classes, reduction: str, dtype):
    """Each row's factor on its gradient: grad_output (times 1 / count for 'mean'); 0 for an
    ignored row, NaN for a class outside [0, classes)."""
    scale = grad_output.to(dtype)
    if reduction == "mean":
        scale = scale / count.to(dtype)
    return per_row(scale, target, ignore_index, classes).contiguous()


def per_row(values, target, ignore_index: int, classes):
    """values (per row, or one for all): 0 at an ignored row, NaN at a class outside [0, classes)."""
    counted, invalid = _row_counts(target, ignore_index, classes)
    return torch.where(invalid, torch.nan, torch.where(counted, values, 0.0))


def write_gradient(z, grad, target, start: int, classes, softmax_stats, row_scale, label_smoothing: float,
                   z_loss: float, softcap: float, temperature: float = 1.0, entropy_scale=None) -> None:
    """Writes the gradient of z's chunk into grad (z's shape and dtype; may be z itself), given
    finish_loss's softmax_stats. classes: an int, or a 0-dim tensor of softmax_stats' dtype where only
    the device knows it. entropy_scale (rows) or None: each row's factor on the gradient of its
    entropy (entropy_of), added; softmax_stats then has the entropy's row."""
    if z.shape[1] == 0:  # an empty shard: no gradient to write
        return
    if entropy_scale is None:  # the entropy returned but not differentiated: the kernel takes 3 rows alone
        softmax_stats = softmax_stats[:3]
    if not z.is_cuda:
        _gradient_torch(z, grad, target, start, classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap,
                        temperature, entropy_scale)
        return
    ops = helpers.kernel_ops("row_passes", z)
    if isinstance(classes, torch.Tensor):
        ops.backward(z, grad, target, start, start + z.shape[1], classes, softmax_stats, row_scale, label_smoothing,
                     z_loss, softcap, temperature, entropy_scale)
    else:
        ops.backward(z, grad, target, start, classes, None, softmax_stats, row_scale, label_smoothing, z_loss, softcap,
                     temperature, entropy_scale)


def save_for_backward(ctx, saved, classes) -> None:
    """Saves `saved` and the number of classes (a tensor where only the device knows it)."""
    if isinstance(classes, torch.Tensor):
        ctx.save_for_backward(*saved, classes)
        ctx.classes = None
    else:
        ctx.save_for_backward(*saved)
        ctx.classes = classes


def saved_tensors(ctx):
    """(*saved, classes) as save_for_backward was given them."""
    return ctx.saved_tensors if ctx.classes is None else (*ctx.saved_tensors, ctx.classes)


def forward_outputs(ctx, loss, lse):
    """The end of every row-pass Function's forward: (loss, lse), the lse without gradient
    (backward gets grad_output alone, None if unused)."""
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    return loss, lse


class RowPassCrossEntropy(torch.autograd.Function):
    """Cross-entropy of whole (rows, C) logits, classes [start, start + C): the statistics, then
    the gradient in backward from the saved logits and statistics. target: class indices, or (rows, C)
    probabilities; weight: (C,) or None. options: (ignore_index, label_smoothing, z_loss, softcap
    or 0, reduction, shards, temperature; softcap and temperature other than 1 for class indices
    without weight only), shards a vocab_parallel.Shards (the logits are this rank's shard) or
    None. Returns (loss, lse) in the accumulation type."""

    @staticmethod
    def forward(ctx, logits, target, weight, options):
        ignore_index, label_smoothing, z_loss, softcap, reduction, shards, temperature = options
        start = 0 if shards is None else shards.start
        ctx.weighted = not uses_kernels(target, weight)  # class weights or probabilities: the torch twin's rows
        stats = new_stats(logits.shape[0], logits.dtype, logits.device,
                          WEIGHTED_STAT_ROWS if ctx.weighted else STAT_ROWS)
        fold_stats(logits, target, start, start + logits.shape[1], stats, softcap, weight, temperature)
        stats, classes = combine(stats, logits.shape[1], shards)
        ctx.options = options
        if not ctx.weighted:
            loss, softmax_stats, count = finish_loss(stats, target, ignore_index, classes, label_smoothing, z_loss)
            save_for_backward(ctx, (logits, target, softmax_stats, count), classes)
            return forward_outputs(ctx, reduce_loss(loss, count, reduction), lse_of(softmax_stats))
        loss, lse, divisors = _weighted_loss(stats, target, ignore_index, classes, label_smoothing, z_loss, reduction)
        save_for_backward(ctx, (logits, target, weight, stats, *divisors), classes)
        return forward_outputs(ctx, loss, lse)

    @staticmethod
    def backward(ctx, grad_output, _):
        if grad_output is None:
            return None, None, None, None
        ignore_index, label_smoothing, z_loss, softcap, reduction, shards, temperature = ctx.options
        helpers.no_second_derivative("cross_entropy with " + ("process_group" if shards else "softcap or temperature"))
        start = 0 if shards is None else shards.start
        if ctx.weighted:
            logits, target, weight, stats, *divisors, classes = saved_tensors(ctx)
            ce_scale, z_scale = (row_scales(grad_output, target, divisor, ignore_index, classes, reduction, stats.dtype)
                                 for divisor in divisors)
            grad, grad_target = _weighted_gradient(logits, target, weight, start, classes, stats, ce_scale, z_scale,
                                                   label_smoothing, z_loss)
            return grad.to(logits.dtype), None if grad_target is None else grad_target.to(target.dtype), None, None
        logits, target, softmax_stats, count, classes = saved_tensors(ctx)
        row_scale = row_scales(grad_output, target, count, ignore_index, classes, reduction, softmax_stats.dtype)
        grad = torch.empty_like(logits)
        write_gradient(logits, grad, target, start, classes, softmax_stats, row_scale, label_smoothing, z_loss,
                       softcap, temperature)
        return grad, None, None, None


def log_prob_outputs(stats, target, ignore_index: int, classes, return_entropy: bool):
    """(log_probs, entropy, softmax_stats) from complete statistics (entropy's rows with
    return_entropy, else entropy empty): per row, 0 at an ignored row, NaN at a class outside [0, V)."""
    softmax_stats = softmax_stats_of(stats)
    log_probs = per_row(log_probs_of(stats, softmax_stats), target, ignore_index, classes)
    entropy = per_row(entropy_of(softmax_stats), target, ignore_index, classes) if return_entropy else \
        log_probs.new_empty(0)
    return log_probs, entropy, softmax_stats


def log_prob_scales(grad_log_probs, grad_entropy, target, ignore_index: int, classes, softmax_stats):
    """write_gradient's (row_scale, entropy_scale) for the gradients of log_prob_outputs' outputs
    (either None): d log p_t / du = [c == t] - p is cross-entropy's gradient with its scale negated."""
    def row_factor(grad):
        return per_row(grad.to(softmax_stats.dtype), target, ignore_index, classes)

    row_scale = (-row_factor(grad_log_probs) if grad_log_probs is not None
                 else torch.zeros(target.shape[0], dtype=softmax_stats.dtype, device=target.device))
    return row_scale.contiguous(), None if grad_entropy is None else row_factor(grad_entropy)


def log_probs_forward_outputs(ctx, options, stats, classes, target, ignore_index: int, return_entropy: bool, saved):
    """The end of every log-probs Function's forward: log_prob_outputs' (log_probs, entropy), with
    `saved` and the softmax statistics saved for backward (saved_tensors gives them back, then
    classes), the entropy without gradient unless asked for."""
    log_probs, entropy, softmax_stats = log_prob_outputs(stats, target, ignore_index, classes, return_entropy)
    ctx.options = options
    save_for_backward(ctx, (*saved, softmax_stats), classes)
    if not return_entropy:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)
    return log_probs, entropy


class RowPassLogProbs(torch.autograd.Function):
    """log p of each row's target class (and with return_entropy the softmax's entropy) of whole
    (rows, C) logits at a temperature, classes [start, start + C): the statistics, then in backward
    the gradient of both from the saved logits and statistics. options: (ignore_index, softcap or
    0, temperature, return_entropy, shards) as RowPassCrossEntropy's. Returns log_prob_outputs'
    (log_probs, entropy), each (rows,) in the accumulation type."""

    @staticmethod
    def forward(ctx, logits, target, options):
        ignore_index, softcap, temperature, return_entropy, shards = options
        start = 0 if shards is None else shards.start
        stats = new_stats(logits.shape[0], logits.dtype, logits.device,
                          ENTROPY_STAT_ROWS if return_entropy else STAT_ROWS)
        fold_stats(logits, target, start, start + logits.shape[1], stats, softcap, temperature=temperature)
        stats, classes = combine(stats, logits.shape[1], shards)
        return log_probs_forward_outputs(ctx, options, stats, classes, target, ignore_index, return_entropy,
                                         (logits, target))

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None
        ignore_index, softcap, temperature, _, shards = ctx.options
        helpers.no_second_derivative("log_probs")
        logits, target, softmax_stats, classes = saved_tensors(ctx)
        row_scale, entropy_scale = log_prob_scales(grad_log_probs, grad_entropy, target, ignore_index, classes,
                                                   softmax_stats)
        grad = torch.empty_like(logits)
        write_gradient(logits, grad, target, 0 if shards is None else shards.start, classes, softmax_stats, row_scale,
                       0.0, 0.0, softcap, temperature, entropy_scale)
        return grad, None, None


def _row_counts(target, ignore_index, classes):
    if target.is_floating_point():  # probabilities: every row counts
        counted = torch.ones(target.shape[0], dtype=torch.bool, device=target.device)
        return counted, ~counted
    counted = target != ignore_index
    return counted, counted & ((target < 0) | (target >= classes))  # outside [0, V): NaN, as cross_entropy's kernels


# ----------------------------------------------------------------------------------
# The same math in torch ops: for devices without the kernels, and for what they do not take,
# class weights and probability targets.

def _capped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(z / softcap).mul_(softcap) if softcap else z


def _scaled(z: torch.Tensor, softcap: float, temperature: float) -> torch.Tensor:
    """u = softcap(z) / temperature; at temperature 1, softcap(z) itself (today's bits)."""
    capped = _capped(z, softcap)
    return capped / temperature if temperature != 1.0 else capped


def _target_slot(target, start: int, width: int):
    """Whether each row's class falls in [start, start + width), and its column there (clamped), (rows, 1)."""
    index = target - start
    return (index >= 0) & (index < width), index.clamp(0, width - 1).long()[:, None]


def _stats_torch(z, target, start, stats, softcap, weight, temperature=1.0):
    z = _scaled(z.to(stats.dtype), softcap, temperature)
    run_max = stats[0]
    chunk_max = z.amax(1)
    e = torch.where(chunk_max[:, None] == -torch.inf, 0.0, torch.exp(z - chunk_max[:, None]))
    new_max = torch.maximum(run_max, chunk_max)
    old_scale = torch.where(run_max == new_max, 1.0, torch.exp(run_max - new_max))
    new_scale = torch.where(chunk_max == new_max, 1.0, torch.exp(chunk_max - new_max))
    if len(stats) == ENTROPY_STAT_ROWS:
        # sum e (u - max) at the new max: each part's own sum plus (its max - the new max) times its exp sum
        # (a part with no class yet, exp sum 0 and max -inf, adds 0; a masked class's e is 0, not 0 * -inf)
        chunk_sum = torch.where(e == 0, 0.0, e * (z - chunk_max[:, None])).sum(1)
        moved = torch.where(stats[1] == 0, 0.0, (run_max - new_max) * stats[1])
        chunk_moved = torch.where(chunk_max == -torch.inf, 0.0, (chunk_max - new_max) * e.sum(1))
        stats[5] = (stats[5] + moved) * old_scale + (chunk_sum + chunk_moved) * new_scale
    stats[1] = stats[1] * old_scale + e.sum(1) * new_scale
    stats[0] = new_max
    if len(stats) == WEIGHTED_STAT_ROWS:
        w, wy = _weighted_targets(z, target, weight, start)
        target_terms = wy * z
        if not target.is_floating_point():  # a class index: the one-hot's zeros times masked classes' -inf are 0
            target_terms = torch.where(wy == 0, 0.0, target_terms)
        stats[2] += target_terms.sum(1)
        stats[3] += (w * z).sum(1)
        stats[5] += wy.sum(1)
        stats[6] += w.sum()
        return
    inside, at_target = _target_slot(target, start, z.shape[1])
    others = e.scatter(1, at_target, torch.where(inside[:, None], 0.0, e.gather(1, at_target))).sum(1)
    stats[4] = stats[4] * old_scale + others * new_scale
    stats[2] = torch.where(inside, z.gather(1, at_target)[:, 0], stats[2])
    stats[3] += z.sum(1)


def _gradient_torch(z, out, target, start, classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap,
                    temperature=1.0, entropy_scale=None):
    # The kernel's contract (entry_points.h's row_passes_backward), held here so CPU tests see it.
    assert softmax_stats.shape[0] == (3 if entropy_scale is None else 4), "softmax_stats' rows and entropy_scale disagree"
    capped = _scaled(z.to(softmax_stats.dtype), softcap, temperature)
    p = torch.exp((capped - softmax_stats[0, :, None]) - softmax_stats[1, :, None])
    a = row_scale * (1 + 2 * z_loss * lse_of(softmax_stats))
    grad = p * a[:, None] - (row_scale * label_smoothing / classes)[:, None]
    inside, at_target = _target_slot(target, start, z.shape[1])
    # At the target a p - r (1 - eps) - b, with p - 1 given: r (p - 1) + (a - r) p + r eps - b.
    at = (row_scale * softmax_stats[2] + (a - row_scale) * p.gather(1, at_target)[:, 0] + row_scale * label_smoothing
          - row_scale * label_smoothing / classes)
    grad.scatter_(1, at_target, torch.where(inside, at, grad.gather(1, at_target)[:, 0])[:, None])
    if entropy_scale is not None:  # dH/du_c = p_c (sum_k p_k (u_k - max) - (u_c - max))
        spread = torch.where(p == 0, 0.0, p * (softmax_stats[3, :, None] - (capped - softmax_stats[0, :, None])))
        grad += entropy_scale[:, None] * spread
    if temperature != 1.0:
        grad /= temperature
    if softcap:  # 1 - tanh^2 as 4 q (1 - q), q = 1 / (e^2|y| + 1): no cancellation where it saturates
        q = 1 / (torch.exp(2 * (z.to(softmax_stats.dtype) / softcap).abs()) + 1)
        grad.mul_(4 * q * (1 - q))
    ignored = row_scale[:, None] == 0 if entropy_scale is None else (row_scale[:, None] == 0) & (entropy_scale[:, None] == 0)
    out.copy_(torch.where(ignored, 0.0, grad))  # 0, not 0 times an infinite logit's terms


# Class weights w (C,) and probability targets y (rows, C). With y' = (1 - eps) y + eps / V (y
# one-hot for a class index) and a_c = w_c y'_c, a row's loss is S lse - sum_c a_c x_c, S = sum_c a_c;
# its gradient p_c S - a_c (plus the z-loss's 2 z_loss lse p_c), and (1 - eps) w_c (lse - x_c) for y_c.
# Their statistics add over shards: rows 2 and 3 weighted (sum w y x, sum w x), 4 unused, 5 sum w y, 6 sum w.

def _weighted_targets(x, target, weight, start):
    """(w, w y) over x's columns: w ones without class weights; y the probabilities, or the
    one-hot of a class index that falls among the columns."""
    w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    if target.is_floating_point():
        return w, w * target.to(x.dtype)
    if x.shape[1] == 0:  # an empty shard holds no target
        return w, torch.zeros_like(x)
    inside, at_target = _target_slot(target, start, x.shape[1])
    return w, torch.zeros_like(x).scatter_(1, at_target, inside.to(x.dtype)[:, None]) * w


def _weighted_loss(stats, target, ignore_index, classes, label_smoothing, z_loss, reduction):
    """(the loss reduced, lse, the divisors of 'mean': the ce's (the counted rows' target weight, as
    torch's; the rows for probabilities) and the z-loss's (the counted rows))."""
    lse = stats[0] + torch.log(stats[1])
    counted, invalid = _row_counts(target, ignore_index, classes)
    # S lse - sum_c a_c x_c, its two terms apart: each cancels less than the whole; the smoothing's only
    # where it is asked for (a masked class's -inf in the logit sum, times 0, would be NaN)
    ce = (1 - label_smoothing) * (stats[5] * lse - stats[2])
    if label_smoothing:
        ce = ce + label_smoothing / classes * (stats[6] * lse - stats[3])
    ce = torch.where(invalid, torch.nan, torch.where(counted, ce, 0.0))
    z = torch.where(counted, z_loss * lse.square(), 0.0)
    count = counted.sum().to(lse.dtype)
    ce_divisor = count if target.is_floating_point() else torch.where(counted, stats[5], 0.0).sum()
    return reduce_loss(ce, ce_divisor, reduction) + reduce_loss(z, count, reduction), lse, (ce_divisor, count)


def _weighted_gradient(x, target, weight, start, classes, stats, ce_scale, z_scale, label_smoothing, z_loss):
    """(the gradient of x, of probability targets or None), in stats' dtype; the scales as row_scales'."""
    x = x.to(stats.dtype)
    log_sum = torch.log(stats[1])
    lse = stats[0] + log_sum
    p = torch.exp((x - stats[0, :, None]) - log_sum[:, None])
    w, wy = _weighted_targets(x, target, weight, start)
    a = (1 - label_smoothing) * wy + label_smoothing / classes * w
    spread_weight = (1 - label_smoothing) * stats[5] + label_smoothing / classes * stats[6]  # S = sum_c a_c
    grad = p * (ce_scale * spread_weight + 2 * z_loss * z_scale * lse)[:, None] - ce_scale[:, None] * a
    grad = torch.where(ce_scale[:, None] == 0, 0.0, grad)  # an ignored row: 0, whatever its logits
    if not target.is_floating_point():
        return grad, None
    return grad, (1 - label_smoothing) * ce_scale[:, None] * w * (lse[:, None] - x)
