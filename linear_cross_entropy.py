"""Linear + cross-entropy: F.cross_entropy(F.linear(input, weight, bias), target) without the
(N, V) logits in memory, on the row-pass engine (row_passes.py).

Forward: for each chunk of classes, the logits z = x W_c^T + b_c (F.linear, in the operands'
dtype, as eager's), folded into the row statistics; then lse and the loss. Backward: each
chunk's logits again, turned into their gradient in place (times grad_output and the
reduction's factor, rounded to the operands' dtype as eager's d logits are); then d input +=
g W_c (summed in float32), d W_c = g^T x and d b_c = sum of g's rows. Each chunk of d weight is
written once, whole: no atomics, the same bits every run.

A training step is four matrix products where eager's is three: the logits are computed twice,
the price of never holding them (the softmax's gradient needs every row's lse before any of it).
Beyond the inputs and gradients a step holds one chunk of logits (CHUNK_BYTES) and, for inputs
of 2 bytes, d input in float32 (N x H x 4 bytes).

That is the "vocabulary_chunks" schedule. When input's gradient alone is wanted (a frozen head),
choose_schedule picks "input_in_forward": a chunk of rows with every class (ROW_CHUNK_BYTES), whose
lse is complete, so the forward writes the loss and d input at once: two products.

With process_group (vocab_parallel.Shards) weight and bias are this rank's rows of the
vocabulary: the statistics are combined across the group between the passes, and input's
gradient is summed over it (one more all-reduce, of N x H, in backward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

if __package__:
    from . import cross_entropy as ce
    from . import loss_helpers as helpers
    from . import row_passes, vocab_parallel
else:
    import cross_entropy as ce
    import loss_helpers as helpers
    import row_passes
    import vocab_parallel

CHUNK_BYTES = 1 << 26  # one chunk of logits: 64 MB, or MIN_CHUNK_CLASSES wide when N is larger
# d input's float32 sum is read and written once a chunk: narrower chunks make that traffic
# count (H100, 16384 x 4096 x 128256 bf16: 2048 classes a chunk, 1.62x the floor; 4096: 1.52x).
MIN_CHUNK_CLASSES = 4096
CHUNK_ALIGN = 128      # chunk widths, in classes: whole tiles for the matrix products
# torch >= 2.8 multiplies 2-byte matrices into a float32 sum on CUDA (addmm's out_dtype).
_ADDMM_OUT_DTYPE = "dtype" in torch.ops.aten.addmm.overloads()


def chunk_width(rows: int, vocab: int, element_size: int) -> int:
    """Classes per chunk: CHUNK_BYTES of logits in whole CHUNK_ALIGN tiles, at least
    MIN_CHUNK_CLASSES, at most vocab."""
    width = CHUNK_BYTES // max(rows * element_size, 1) // CHUNK_ALIGN * CHUNK_ALIGN
    return max(1, min(max(width, MIN_CHUNK_CLASSES), vocab))


# Input only (a frozen head): rows of every class a chunk, at most ROW_CHUNK_BYTES of logits, so
# each row's lse is complete in the chunk and its d input written at once (2 matrix products).
# The row passes take a warp a row: fewer rows starve them (H100, frozen Llama 3 8192 rows
# a step: 64 MB chunks 40.4 ms, 128 MB 32.4, 256 MB 29.1; Gemma 2: 117, 62.8, 44.2).
ROW_CHUNK_BYTES = 1 << 28
ROW_ALIGN = 128  # rows a chunk: whole tiles for the matrix products


def row_chunk_rows(vocab: int, element_size: int) -> int:
    """Rows per chunk: ROW_CHUNK_BYTES of logits in whole ROW_ALIGN tiles, at least ROW_ALIGN."""
    return max(ROW_CHUNK_BYTES // max(vocab * element_size, 1) // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN)


def choose_schedule(wants, shards, compiling: bool) -> str:
    """The one choice of schedule, from which gradients are wanted (input, weight, bias):
    "input_in_forward": input's alone, written with the loss a chunk of rows at a time;
    "vocabulary_chunks": otherwise (and with a process group or under torch.compile): the
    statistics a chunk of classes at a time, every gradient from the logits recomputed in backward."""
    if tuple(wants) == (True, False, False) and shards is None and not compiling:
        return "input_in_forward"
    return "vocabulary_chunks"


def _chunks(weight, bias, width):
    for start in range(0, weight.shape[0], width):
        end = min(start + width, weight.shape[0])
        yield start, weight[start:end], None if bias is None else bias[start:end]


def _add_matmul_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, with total in the accumulation type."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif _ADDMM_OUT_DTYPE and a.is_cuda:
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:  # older torch: each chunk's product rounded once to the operands' dtype
        total.add_(a @ b)


def fold_linear(x, weight, bias, target, start: int, softcap: float):
    """The statistics of F.linear(x, weight, bias)'s rows, classes [start, start + V) of weight's V
    rows (start > 0: a shard of a larger vocabulary), a chunk of classes at a time."""
    rows, local = x.shape[0], weight.shape[0]
    stats = row_passes.new_stats(rows, x.dtype, x.device)
    for first, w, b in _chunks(weight, bias, chunk_width(rows, local, x.element_size())):
        row_passes.fold_stats(F.linear(x, w, b), target, start + first, start + local, stats, softcap)
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
        row_passes.write_gradient(g, g, target, start + first, classes, softmax_stats, row_scale, label_smoothing,
                                  z_loss, softcap)  # in place
        end = first + g.shape[1]
        if wants[0]:
            _add_matmul_(grad_x, g, w)
        if wants[1]:
            torch.mm(g.t(), x, out=grad_w[first:end])
        if wants[2]:
            torch.sum(g, 0, dtype=acc, out=grad_b[first:end])
    return grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


def loss_pass(x, weight, bias, target, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
              reduction: str, shards=None):
    """The forward: (loss, softmax_stats, count, classes) (row_passes.finish's), the loss reduced:
    0-dim, or (N,) for 'none'."""
    stats = fold_linear(x, weight, bias, target, 0 if shards is None else shards.start, softcap)
    loss, softmax_stats, count, classes = row_passes.finish(stats, target, ignore_index, weight.shape[0],
                                                            label_smoothing, z_loss, shards)
    return row_passes.reduce_loss(loss, count, reduction), softmax_stats, count, classes


def input_gradient_pass(x, weight, bias, target, ignore_index: int, label_smoothing: float, z_loss: float,
                        softcap: float, reduction: str):
    """The "input_in_forward" schedule: (loss reduced, lse, input's gradient for a grad_output of 1),
    a chunk of rows at a time: their logits, statistics and gradient (in place), then that
    gradient times weight."""
    rows, vocab = x.shape[0], weight.shape[0]
    acc = helpers.accumulation_dtype(x.dtype)
    count = (target != ignore_index).sum()
    one = torch.ones((), dtype=acc, device=x.device)
    loss, lse = torch.empty(rows, dtype=acc, device=x.device), torch.empty(rows, dtype=acc, device=x.device)
    grad_x = torch.empty_like(x)
    height = row_chunk_rows(vocab, x.element_size())
    for first in range(0, rows, height):
        end = min(first + height, rows)
        z, t = F.linear(x[first:end], weight, bias), target[first:end]
        stats = row_passes.new_stats(end - first, x.dtype, x.device)
        row_passes.fold_stats(z, t, 0, vocab, stats, softcap)
        loss[first:end], softmax_stats, _ = row_passes.finish_loss(stats, t, ignore_index, vocab, label_smoothing,
                                                                   z_loss)
        lse[first:end] = row_passes.lse_of(softmax_stats)
        row_scale = row_passes.row_scales(one, t, count, ignore_index, vocab, reduction, acc)
        row_passes.write_gradient(z, z, t, 0, vocab, softmax_stats, row_scale, label_smoothing, z_loss, softcap)
        torch.mm(z, weight, out=grad_x[first:end])
        del z  # before the next chunk's logits: one chunk held at a time
    return row_passes.reduce_loss(loss, count, reduction), lse, grad_x


def gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, ignore_index: int,
                  label_smoothing: float, z_loss: float, softcap: float, reduction: str, wants, classes=None,
                  shards=None):
    """The backward: the gradients of input, weight and bias (None where wants says no); classes
    as loss_pass returned it (None: weight's V)."""
    classes = weight.shape[0] if classes is None else classes
    row_scale = row_passes.row_scales(grad_output, target, count, ignore_index, classes, reduction,
                                      softmax_stats.dtype)
    grad_x, grad_w, grad_b = linear_gradients(x, weight, bias, target, 0 if shards is None else shards.start,
                                              classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap,
                                              wants)
    if grad_x is not None and shards is not None:
        shards.sum_over_group(grad_x)  # every rank's classes add to it
    return None if grad_x is None else grad_x.to(x.dtype), grad_w, grad_b


# ----------------------------------------------------------------------------------
# Under torch.compile the two passes are opaque ops: a tracer sees two calls, not the chunk
# loop with its out= products. (The row passes' kernels have compile ops of their own.) No
# C++ side: these schemas are their only declaration.

_LOSS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
                "float z_loss, float softcap, str reduction) -> (Tensor, Tensor, Tensor)")
_GRADIENTS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor softmax_stats, Tensor count, "
                     "Tensor grad_output, int ignore_index, float label_smoothing, float z_loss, float softcap, "
                     "str reduction, bool[] wants) -> (Tensor, Tensor, Tensor)")


def _loss_fake(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
    acc = helpers.accumulation_dtype(x.dtype)
    shape = (x.shape[0],) if reduction == "none" else ()
    return (x.new_empty(shape, dtype=acc), x.new_empty((3, x.shape[0]), dtype=acc),
            x.new_empty((), dtype=torch.int64))


def _loss_op(*args):
    return loss_pass(*args)[:3]


def _gradients_op(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *options)
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)  # the schema's tensors


def _gradients_fake(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    wants = options[-1]
    likes = (x, weight, bias)
    return tuple(torch.empty_like(like) if want else x.new_empty(0) for want, like in zip(wants, likes))


def _define_compile_ops():
    if not helpers.COMPILE_OPS or hasattr(torch.ops.fused_losses_linear_ce, "loss"):
        return None  # torch < 2.4, or defined by this file imported under another name
    library = torch.library.Library("fused_losses_linear_ce", "DEF")
    for name, schema, impl, fake in (("loss", _LOSS_SCHEMA, _loss_op, _loss_fake),
                                     ("gradients", _GRADIENTS_SCHEMA, _gradients_op, _gradients_fake)):
        library.define(name + schema)
        for device in ("CPU", "CUDA"):
            library.impl(name, impl, device)
        torch.library.register_fake(f"fused_losses_linear_ce::{name}", fake, lib=library)
    return library


_COMPILE_LIBRARY = _define_compile_ops()  # the definitions last as long as the Library


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(N, H) input, (V, H) weight, (V,) bias or None, (N,) class indices. Returns (loss, lse) in
    the accumulation type: loss 0-dim for 'mean' and 'sum', (N,) for 'none'; lse (N,) without
    gradient. options: (ignore_index, label_smoothing, z_loss, softcap or 0, reduction, shards,
    schedule: choose_schedule's).
    The caller casts the loss: a cast here that returns its input (float32) made torch.compile
    (torch 2.11) hand backward a grad_output of 0."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, options):
        *arguments, shards, schedule = options
        ctx.options = options
        if schedule == "input_in_forward":
            loss, lse, grad_x = input_gradient_pass(x, weight, bias, target, *arguments)
            ctx.save_for_backward(grad_x)
            return row_passes.forward_outputs(ctx, loss, lse)
        if shards is None and helpers.is_compiling():
            loss, softmax_stats, count = torch.ops.fused_losses_linear_ce.loss(x, weight, bias, target, *arguments)
            classes = weight.shape[0]
        else:
            loss, softmax_stats, count, classes = loss_pass(x, weight, bias, target, *arguments, shards)
        row_passes.save_for_backward(ctx, (x, weight, bias, target, softmax_stats, count), classes)
        return row_passes.forward_outputs(ctx, loss, row_passes.lse_of(softmax_stats))

    @staticmethod
    def backward(ctx, grad_output, _):
        helpers.no_second_derivative("linear_cross_entropy")
        if grad_output is None:
            return None, None, None, None, None
        *arguments, shards, schedule = ctx.options
        if schedule == "input_in_forward":  # written for a grad_output of 1: one pass over (N, H)
            grad_x, = ctx.saved_tensors
            scale = grad_output[:, None] if grad_output.dim() else grad_output
            return grad_x * scale.to(grad_x.dtype), None, None, None, None
        x, weight, bias, target, softmax_stats, count, classes = row_passes.saved_tensors(ctx)
        wants = list(ctx.needs_input_grad[:3])
        if shards is None and helpers.is_compiling():
            grads = torch.ops.fused_losses_linear_ce.gradients(x, weight, bias, target, softmax_stats, count,
                                                                grad_output, *arguments, wants)
            grads = [grad if want else None for grad, want in zip(grads, wants)]
        else:
            grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *arguments, wants,
                                  classes, shards)
        return (*grads, None, None)


def _check_arguments(input, weight, target, bias, label_smoothing, z_loss, softcap) -> None:
    """Every argument checked before any work, as ValueErrors that name it."""
    if input.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"input must be (..., H) and weight (V, H); got input {tuple(input.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dimension H = {input.shape[-1]} differs from weight's "
                         f"(V, H) = {tuple(weight.shape)}")
    helpers.check_same_device(input, target, weight)
    if bias is not None and bias.device != input.device:
        raise helpers.device_error("bias", bias, input)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != input.dtype and not helpers.under_autocast(input):
            raise ValueError(f"{name} has dtype {tensor.dtype}, input {input.dtype}: they must match (outside "
                             f"autocast, as F.linear requires)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), one value per class, got {tuple(bias.shape)}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target must have input's leading shape {tuple(input.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    ce.check_smoothing_and_z_loss(label_smoothing, z_loss)
    ce.check_softcap(softcap)


def linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                         return_lse: bool = False, process_group=None, vocab_start: int | None = None):
    """F.cross_entropy(F.linear(input, weight, bias), target, ...) without the (N, V) logits in
    memory: a chunk of the vocabulary at a time, the logits computed again in backward.

    input (..., H), weight (V, H), bias (V,), target: class indices (int64 or int32) of shape
    input.shape[:-1]. softcap: the logits become softcap * tanh(logits / softcap) first (Gemma 2).
    z_loss and return_lse as in cross_entropy (lse in target's shape, float32). Under CUDA
    autocast the linear runs in autocast's dtype and the loss is float32, as torch's.
    process_group: weight and bias hold this rank's contiguous rows of the output layer, its
    shard of the classes (first class vocab_start, by default rank * V_r), as cross_entropy's;
    input is the same on every rank and target holds global class ids. The loss equals the
    unsharded one; weight's and bias's gradients are this shard's; input's is summed over the
    group (one more all-reduce, of N x H, in backward), the full gradient on every rank.
    Under a torch.func transform (no process_group) it is cross_entropy of F.linear's logits.
    """
    helpers.check_reduction(reduction, ("none", "mean", "sum"))
    _check_arguments(input, weight, target, bias, label_smoothing, z_loss, softcap)
    if helpers.in_func_transform() and process_group is None:  # torch's ops: the logits whole
        return ce.cross_entropy(F.linear(input, weight, bias).reshape(-1, weight.shape[0]), target.reshape(-1),
                                ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                z_loss=z_loss, softcap=softcap, return_lse=return_lse)
    float_loss = False
    if helpers.under_autocast(input):  # F.linear in autocast's dtype, the loss in float32
        dtype = helpers.autocast_dtype()
        input, weight = input.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        float_loss = True
    with torch.autocast(input.device.type, enabled=False):
        rows, rows_target = input.reshape(-1, input.shape[-1]), target.reshape(-1).contiguous()
        shards = (None if process_group is None else
                  vocab_parallel.Shards(process_group, weight.shape[0], vocab_start, rows, rows.shape[1]))
        wants = [helpers.wants_grad(tensor) if tensor is not None else False for tensor in (rows, weight, bias)]
        schedule = choose_schedule(wants, shards, helpers.is_compiling())
        loss, lse = LinearCrossEntropyFunction.apply(rows, weight, bias, rows_target, (
            int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0), reduction, shards,
            schedule))
        loss = loss.to(torch.float32 if float_loss else input.dtype)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


class LinearCrossEntropyLoss(nn.Module):
    """linear_cross_entropy as a module: forward(input, weight, target, bias=None)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0, *,
                 z_loss: float = 0.0, softcap: float | None = None, return_lse: bool = False, process_group=None,
                 vocab_start: int | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.return_lse = z_loss, softcap, return_lse
        self.process_group, self.vocab_start = process_group, vocab_start

    def forward(self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None):
        return linear_cross_entropy(input, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    z_loss=self.z_loss, softcap=self.softcap, return_lse=self.return_lse,
                                    process_group=self.process_group, vocab_start=self.vocab_start)
