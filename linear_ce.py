"""Cross-entropy a chunk of classes at a time, and linear + cross-entropy built on it.

The two row passes over a chunk of classes of every row (kernels/chunked_cross_entropy.cu on
CUDA, the same math in torch ops elsewhere): fold_stats folds a chunk into each row's running
statistics (max, sum of exp, target logit, logit sum, sum of exp over the other classes, in
float32; float64 for float64), from which finish_loss gives the loss and the softmax's
statistics; write_gradient, given those and each row's scale, writes the chunk's gradient.
losses.py runs them over whole rows (cross_entropy with softcap), vocab_parallel.py over this
rank's shard, and linear_cross_entropy over chunks of logits:

linear_cross_entropy, F.cross_entropy(F.linear(input, weight, bias), target) without the (N, V)
logits in memory. Forward: for each chunk of classes, the logits z = x W_c^T + b_c (F.linear, in
the operands' dtype, as eager's), folded into the statistics; then lse and the loss. Backward:
each chunk's logits again, turned into their gradient in place (times grad_output and the
reduction's factor, rounded to the operands' dtype as eager's d logits are); then d input += g W_c
(summed in float32), d W_c = g^T x and d b_c = sum of g's rows. Each chunk of d weight is written
once, whole: no atomics, the same bits every run.

A training step is four matrix products where eager's is three: the logits are computed twice,
the price of never holding them (the softmax's gradient needs every row's lse before any of it).
Beyond the inputs and gradients a step holds one chunk of logits (CHUNK_BYTES) and, for inputs
of 2 bytes, d input in float32 (N x H x 4 bytes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

if __package__:
    from . import loader
else:
    import loader

CHUNK_BYTES = 1 << 26  # one chunk of logits: 64 MB, or MIN_CHUNK_CLASSES wide when N is larger
# d input's float32 sum is read and written once a chunk: narrower chunks make that traffic
# count (H100, 16384 x 4096 x 128256 bf16: 2048 classes a chunk, 1.62x the floor; 4096: 1.52x).
MIN_CHUNK_CLASSES = 4096
CHUNK_ALIGN = 128      # chunk widths, in classes: whole tiles for the matrix products
# torch >= 2.8 multiplies 2-byte matrices into a float32 sum on CUDA (addmm's out_dtype).
_ADDMM_OUT_DTYPE = "dtype" in torch.ops.aten.addmm.overloads()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_width(rows: int, vocab: int, element_size: int) -> int:
    """Classes per chunk: CHUNK_BYTES of logits in whole CHUNK_ALIGN tiles, at least
    MIN_CHUNK_CLASSES, at most vocab."""
    width = CHUNK_BYTES // max(rows * element_size, 1) // CHUNK_ALIGN * CHUNK_ALIGN
    return max(1, min(max(width, MIN_CHUNK_CLASSES), vocab))


def _chunks(weight, bias, width):
    for start in range(0, weight.shape[0], width):
        end = min(start + width, weight.shape[0])
        yield start, weight[start:end], None if bias is None else bias[start:end]


def _capped(z: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(z / softcap).mul_(softcap) if softcap else z


# ----------------------------------------------------------------------------------
# The row passes.

def new_stats(rows: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Running statistics of no class yet, for logits of `dtype`: (5, rows)."""
    stats = torch.zeros(5, rows, dtype=_accumulation_dtype(dtype), device=device)
    stats[0] = -torch.inf
    return stats


def fold_stats(z, target, start: int, classes: int, stats, softcap: float) -> None:
    """Folds z (rows, width), classes [start, start + width) of `classes`, into stats."""
    ops = _row_ops(z)
    if ops is None:
        _stats_torch(z, target, start, classes, stats, softcap)
    else:
        ops.forward(z, target, start, classes, stats, softcap)


def finish_loss(stats, target, ignore_index: int, classes: int, label_smoothing: float, z_loss: float):
    """(per-row loss, softmax_stats, count) from complete statistics: loss 0 for an ignored row, NaN
    for a class outside [0, classes); softmax_stats (3, rows): each row's max and log(sum exp),
    whose sum is the lse (lse_of; write_gradient takes them apart), and its target's p - 1 as
    -(the other classes' sum) / (the sum), which does not cancel; count: the rows not ignored
    (0-dim, on the device: no host sync)."""
    softmax_stats = torch.stack([stats[0], torch.log(stats[1]), -stats[4] / stats[1]])
    lse = lse_of(softmax_stats)
    counted, invalid = _row_counts(target, ignore_index, classes)
    ce = (1 - label_smoothing) * (lse - stats[2]) + label_smoothing * (lse - stats[3] / classes)
    loss = torch.where(invalid, torch.nan, torch.where(counted, ce + z_loss * lse.square(), 0.0))
    return loss, softmax_stats, counted.sum()


def lse_of(softmax_stats):
    return softmax_stats[0] + softmax_stats[1]


def forward_outputs(ctx, loss, softmax_stats, saved):
    """The end of every row-pass Function's forward: saves `saved` for backward and returns
    (loss, lse), the lse without gradient (backward gets grad_output alone, None if unused)."""
    ctx.save_for_backward(*saved)
    lse = lse_of(softmax_stats)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    return loss, lse


def no_second_derivative(what: str) -> None:
    """A row-pass Function's backward builds no graph: refuse backward(create_graph=True)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} has no second derivative: backward(create_graph=True) through it is not "
                           "supported")


def reduce_loss(loss, count, reduction: str):
    if reduction == "none":
        return loss
    return loss.sum() / count.to(loss.dtype) if reduction == "mean" else loss.sum()  # none counted: NaN, as torch


def row_scales(grad_output, target, count, ignore_index: int, classes: int, reduction: str, dtype):
    """Each row's factor on its gradient: grad_output (times 1 / count for 'mean'); 0 for an
    ignored row, NaN for a class outside [0, classes)."""
    counted, invalid = _row_counts(target, ignore_index, classes)
    scale = grad_output.to(dtype)
    if reduction == "mean":
        scale = scale / count.to(dtype)
    return torch.where(invalid, torch.nan, torch.where(counted, scale, 0.0)).contiguous()


def write_gradient(z, grad, target, start: int, classes, softmax_stats, row_scale, label_smoothing: float,
                   z_loss: float, softcap: float) -> None:
    """Writes the gradient of z's chunk into grad (z's shape and dtype; may be z itself), given
    finish_loss's softmax_stats. classes: an int, or a 0-dim tensor of softmax_stats' dtype where only
    the device knows it."""
    ops = _row_ops(z)
    if ops is None:
        _gradient_torch(z, grad, target, start, classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap)
    elif isinstance(classes, torch.Tensor):
        ops.backward(z, grad, target, start, start + z.shape[1], classes, softmax_stats, row_scale, label_smoothing,
                     z_loss, softcap)
    else:
        ops.backward(z, grad, target, start, classes, None, softmax_stats, row_scale, label_smoothing, z_loss, softcap)


def logits_stats(logits, target, start: int, softcap: float):
    """The statistics of whole (rows, C) logits, classes [start, start + C) (start > 0: a shard)."""
    stats = new_stats(logits.shape[0], logits.dtype, logits.device)
    fold_stats(logits, target, start, start + logits.shape[1], stats, softcap)
    return stats


def logits_gradient(logits, target, start: int, classes, softmax_stats, count, grad_output, ignore_index: int,
                    reduction: str, label_smoothing: float, z_loss: float, softcap: float):
    """The gradient of whole (rows, C) logits, classes [start, start + C) of `classes` (as
    write_gradient's), from finish_loss's softmax_stats and count."""
    row_scale = row_scales(grad_output, target, count, ignore_index, classes, reduction, softmax_stats.dtype)
    grad = torch.empty_like(logits)
    write_gradient(logits, grad, target, start, classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap)
    return grad


def _row_ops(z: torch.Tensor):
    """The row passes' kernels for z's device and dtype (under torch.compile their ops, which
    losses.py defines); None off CUDA."""
    if not z.is_cuda:
        return None
    if _is_compiling():
        return torch.ops.fused_losses_chunked_cross_entropy
    return loader.load_for_device("chunked_cross_entropy", z.device, z.dtype)


# The same math in torch ops, for devices without the kernels.

def _stats_torch(z, target, start, vocab, stats, softcap):
    z = _capped(z.to(stats.dtype), softcap)
    run_max = stats[0]
    chunk_max = z.amax(1)
    e = torch.where(chunk_max[:, None] == -torch.inf, 0.0, torch.exp(z - chunk_max[:, None]))
    index = target - start
    inside = (index >= 0) & (index < z.shape[1])
    at_target = index.clamp(0, z.shape[1] - 1).long()[:, None]
    others = e.scatter(1, at_target, torch.where(inside[:, None], 0.0, e.gather(1, at_target))).sum(1)
    new_max = torch.maximum(run_max, chunk_max)
    old_scale = torch.where(run_max == new_max, 1.0, torch.exp(run_max - new_max))
    new_scale = torch.where(chunk_max == new_max, 1.0, torch.exp(chunk_max - new_max))
    stats[1] = stats[1] * old_scale + e.sum(1) * new_scale
    stats[4] = stats[4] * old_scale + others * new_scale
    stats[0] = new_max
    stats[2] = torch.where(inside, z.gather(1, at_target)[:, 0], stats[2])
    stats[3] += z.sum(1)


def _gradient_torch(z, out, target, start, vocab, softmax_stats, row_scale, label_smoothing, z_loss, softcap):
    capped = _capped(z.to(softmax_stats.dtype), softcap)
    p = torch.exp((capped - softmax_stats[0, :, None]) - softmax_stats[1, :, None])
    a = row_scale * (1 + 2 * z_loss * lse_of(softmax_stats))
    grad = p * a[:, None] - (row_scale * label_smoothing / vocab)[:, None]
    index = target - start
    inside = (index >= 0) & (index < z.shape[1])
    at_target = index.clamp(0, z.shape[1] - 1).long()[:, None]
    # At the target a p - r (1 - eps) - b, with p - 1 given: r (p - 1) + (a - r) p + r eps - b.
    at = (row_scale * softmax_stats[2] + (a - row_scale) * p.gather(1, at_target)[:, 0] + row_scale * label_smoothing
          - row_scale * label_smoothing / vocab)
    grad.scatter_(1, at_target, torch.where(inside, at, grad.gather(1, at_target)[:, 0])[:, None])
    if softcap:  # 1 - tanh^2 as 4 q (1 - q), q = 1 / (e^2|y| + 1): no cancellation where it saturates
        q = 1 / (torch.exp(2 * (z.to(softmax_stats.dtype) / softcap).abs()) + 1)
        grad.mul_(4 * q * (1 - q))
    out.copy_(torch.where(row_scale[:, None] == 0, 0.0, grad))  # 0, not 0 times an infinite logit's terms


def _add_matmul_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, with total in the accumulation type."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif _ADDMM_OUT_DTYPE and a.is_cuda:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:  # older torch: each chunk's product rounded once to the operands' dtype
        total.add_(a @ b)


def _row_counts(target, ignore_index, vocab):
    counted = target != ignore_index
    return counted, counted & ((target < 0) | (target >= vocab))  # outside [0, V): NaN, as cross_entropy's kernels


# ----------------------------------------------------------------------------------
# Linear + cross-entropy.

def fold_linear(x, weight, bias, target, start: int, softcap: float):
    """The statistics of F.linear(x, weight, bias)'s rows, classes [start, start + V) of weight's V
    rows (start > 0: a shard of a larger vocabulary), a chunk of classes at a time."""
    rows, local = x.shape[0], weight.shape[0]
    stats = new_stats(rows, x.dtype, x.device)
    for first, w, b in _chunks(weight, bias, chunk_width(rows, local, x.element_size())):
        fold_stats(F.linear(x, w, b), target, start + first, start + local, stats, softcap)
    return stats


def linear_gradients(x, weight, bias, target, start: int, classes, softmax_stats, row_scale,
                     label_smoothing: float, z_loss: float, softcap: float, wants):
    """The gradients of input (in the accumulation type), weight and bias (None where wants says
    no), the logits recomputed a chunk at a time; classes as write_gradient's."""
    acc = softmax_stats.dtype
    local = weight.shape[0]
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if wants[0] else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=x.device) if wants[1] else None
    grad_b = torch.empty(local, dtype=acc, device=x.device) if wants[2] else None
    for first, w, b in _chunks(weight, bias, chunk_width(x.shape[0], local, x.element_size())):
        g = F.linear(x, w, b)
        write_gradient(g, g, target, start + first, classes, softmax_stats, row_scale, label_smoothing, z_loss,
                       softcap)  # in place
        end = first + g.shape[1]
        if wants[0]:
            _add_matmul_(grad_x, g, w)
        if wants[1]:
            torch.mm(g.t(), x, out=grad_w[first:end])
        if wants[2]:
            torch.sum(g, 0, dtype=acc, out=grad_b[first:end])
    return grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


def loss_pass(x, weight, bias, target, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
              reduction: str):
    """The forward: (loss, softmax_stats, count) (finish_loss's), loss reduced: 0-dim, or (N,) for 'none'."""
    stats = fold_linear(x, weight, bias, target, 0, softcap)
    loss, softmax_stats, count = finish_loss(stats, target, ignore_index, weight.shape[0], label_smoothing, z_loss)
    return reduce_loss(loss, count, reduction), softmax_stats, count


def gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, ignore_index: int,
                  label_smoothing: float, z_loss: float, softcap: float, reduction: str, wants):
    """The backward: the gradients of input, weight and bias (None where wants says no)."""
    vocab = weight.shape[0]
    row_scale = row_scales(grad_output, target, count, ignore_index, vocab, reduction, softmax_stats.dtype)
    grad_x, grad_w, grad_b = linear_gradients(x, weight, bias, target, 0, vocab, softmax_stats, row_scale,
                                              label_smoothing, z_loss, softcap, wants)
    return None if grad_x is None else grad_x.to(x.dtype), grad_w, grad_b


# ----------------------------------------------------------------------------------
# Under torch.compile linear + cross-entropy's two passes are opaque ops: a tracer sees two
# calls, not the chunk loop with its out= products. (The row passes' kernels have compile ops
# of their own: losses.KERNEL_OPS, which _row_ops returns when compiling.)

_LOSS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
                "float z_loss, float softcap, str reduction) -> (Tensor, Tensor, Tensor)")
_GRADIENTS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor softmax_stats, Tensor count, "
                     "Tensor grad_output, int ignore_index, float label_smoothing, float z_loss, float softcap, "
                     "str reduction, bool[] wants) -> (Tensor, Tensor, Tensor)")


def _loss_fake(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
    acc = _accumulation_dtype(x.dtype)
    shape = (x.shape[0],) if reduction == "none" else ()
    return (x.new_empty(shape, dtype=acc), x.new_empty((3, x.shape[0]), dtype=acc),
            x.new_empty((), dtype=torch.int64))


def _gradients_op(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *options)
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)  # the schema's tensors


def _gradients_fake(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    wants = options[-1]
    likes = (x, weight, bias)
    return tuple(torch.empty_like(like) if want else x.new_empty(0) for want, like in zip(wants, likes))


def _define_compile_ops():
    if not hasattr(torch.library, "register_fake") or hasattr(torch.ops.fused_losses_linear_ce, "loss"):
        return None  # torch < 2.4, or defined by this file imported under another name
    library = torch.library.Library("fused_losses_linear_ce", "DEF")
    for name, schema, impl, fake in (("loss", _LOSS_SCHEMA, loss_pass, _loss_fake),
                                     ("gradients", _GRADIENTS_SCHEMA, _gradients_op, _gradients_fake)):
        library.define(name + schema)
        for device in ("CPU", "CUDA"):
            library.impl(name, impl, device)
        torch.library.register_fake(f"fused_losses_linear_ce::{name}", fake, lib=library)
    return library


_COMPILE_LIBRARY = _define_compile_ops()  # the definitions last as long as the Library


def _is_compiling() -> bool:
    return hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling") and torch.compiler.is_compiling()


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(N, H) input, (V, H) weight, (V,) bias or None, (N,) class indices. Returns
    (loss, lse) in the accumulation type: loss 0-dim for 'mean' and 'sum', (N,) for 'none'; lse (N,)
    without gradient. options: (ignore_index, label_smoothing, z_loss, softcap or 0, reduction).
    The caller casts the loss: a cast here that returns its input (float32) made torch.compile
    (torch 2.11) hand backward a grad_output of 0."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, arguments):
        if _is_compiling():
            loss, softmax_stats, count = torch.ops.fused_losses_linear_ce.loss(x, weight, bias, target, *arguments)
        else:
            loss, softmax_stats, count = loss_pass(x, weight, bias, target, *arguments)
        ctx.arguments = arguments
        return forward_outputs(ctx, loss, softmax_stats, (x, weight, bias, target, softmax_stats, count))

    @staticmethod
    def backward(ctx, grad_output, _):
        no_second_derivative("linear_cross_entropy")
        if grad_output is None:
            return None, None, None, None, None
        x, weight, bias, target, softmax_stats, count = ctx.saved_tensors
        wants = list(ctx.needs_input_grad[:3])
        if _is_compiling():
            grads = torch.ops.fused_losses_linear_ce.gradients(x, weight, bias, target, softmax_stats, count,
                                                                grad_output, *ctx.arguments, wants)
            grads = [grad if want else None for grad, want in zip(grads, wants)]
        else:
            grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *ctx.arguments, wants)
        return (*grads, None, None)
