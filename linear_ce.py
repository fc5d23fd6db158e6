"""Linear + cross-entropy without the logits in memory (losses.linear_cross_entropy): the loss
of F.cross_entropy(F.linear(input, weight, bias), target), a chunk of the vocabulary at a time.

Forward: for each chunk of classes, the logits z = x W_c^T + b_c (F.linear, in the operands'
dtype, as eager's), folded by a row pass into each row's running statistics in float32
(float64 for float64): max, sum of exp, target logit, logit sum; then lse and the loss.
Backward: each chunk's logits again, which a second row pass turns into their gradient in place
(times grad_output and the reduction's factor, rounded to the operands' dtype as eager's d logits
are); then d input += g W_c (summed in float32), d W_c = g^T x and d b_c = sum of g's rows. Each
chunk of d weight is written once, whole: no atomics, the same bits every run.

A training step is four matrix products where eager's is three: the logits are computed twice,
the price of never holding them (the softmax's gradient needs every row's lse before any of it).
Beyond the inputs and gradients a step holds one chunk of logits (CHUNK_BYTES) and, for inputs
of 2 bytes, d input in float32 (N x H x 4 bytes).

The row passes are kernels/linear_cross_entropy.cu on CUDA, torch ops elsewhere (the same math).
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
# count (H100, 16384 x 4096 x 128256 bf16: 2048 classes a chunk, 1.62x the floor; 4096: 1.36x).
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


# The row passes in torch ops: kernels/linear_cross_entropy.cu's math, for devices without it.

def _stats_torch(z, target, start, vocab, stats, softcap):
    z = _capped(z.to(stats.dtype), softcap)
    run_max, run_sum = stats[0], stats[1]
    chunk_max = z.amax(1)
    chunk_sum = torch.where(chunk_max == -torch.inf, 0.0, torch.exp(z - chunk_max[:, None]).sum(1))
    new_max = torch.maximum(run_max, chunk_max)
    run_sum.copy_(torch.where(run_max == new_max, run_sum, run_sum * torch.exp(run_max - new_max)) +
                  torch.where(chunk_max == new_max, chunk_sum, chunk_sum * torch.exp(chunk_max - new_max)))
    run_max.copy_(new_max)
    index = target - start
    inside = (index >= 0) & (index < z.shape[1])
    stats[2] = torch.where(inside, z.gather(1, index.clamp(0, z.shape[1] - 1).long()[:, None])[:, 0], stats[2])
    stats[3] += z.sum(1)


def _gradient_torch(z, target, start, vocab, lse, row_scale, label_smoothing, z_loss, softcap):
    capped = _capped(z.to(lse.dtype), softcap)
    grad = torch.exp(capped - lse[:, None]).mul_((row_scale * (1 + 2 * z_loss * lse))[:, None])
    grad.sub_((row_scale * label_smoothing / vocab)[:, None])
    index = target - start
    inside = (index >= 0) & (index < z.shape[1])
    grad.scatter_add_(1, index.clamp(0, z.shape[1] - 1).long()[:, None],
                      torch.where(inside, -row_scale * (1 - label_smoothing), 0.0)[:, None])
    if softcap:
        grad.mul_(1 - (capped / softcap).square())
    z.copy_(torch.where(row_scale[:, None] == 0, 0.0, grad))  # 0, not 0 times an infinite logit's terms


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


def loss_pass(x, weight, bias, target, ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
              reduction: str):
    """The forward: (loss, lse, count). loss in the accumulation type, 0-dim or (N,) for 'none';
    lse (N,); count: the rows not ignored (0-dim int64, on the device: no host sync)."""
    acc = _accumulation_dtype(x.dtype)
    rows, vocab = x.shape[0], weight.shape[0]
    ops = _row_ops(x)
    stats = torch.zeros(4, rows, dtype=acc, device=x.device)
    stats[0] = -torch.inf
    for start, w, b in _chunks(weight, bias, chunk_width(rows, vocab, x.element_size())):
        z = F.linear(x, w, b)
        if ops is None:
            _stats_torch(z, target, start, vocab, stats, softcap)
        else:
            ops.forward(z, target, start, vocab, stats, softcap)
    lse = stats[0] + torch.log(stats[1])
    counted, invalid = _row_counts(target, ignore_index, vocab)
    ce = (1 - label_smoothing) * (lse - stats[2]) + label_smoothing * (lse - stats[3] / vocab)
    loss = torch.where(invalid, torch.nan, torch.where(counted, ce + z_loss * lse.square(), 0.0))
    count = counted.sum()
    if reduction != "none":
        loss = loss.sum() / count.to(acc) if reduction == "mean" else loss.sum()  # no row counted: NaN, as torch
    return loss, lse, count


def gradient_pass(x, weight, bias, target, lse, count, grad_output, ignore_index: int, label_smoothing: float,
                  z_loss: float, softcap: float, reduction: str, wants):
    """The backward: the gradients of input, weight and bias (None where wants says no)."""
    acc = lse.dtype
    vocab = weight.shape[0]
    ops = _row_ops(x)
    counted, invalid = _row_counts(target, ignore_index, vocab)
    scale = grad_output.to(acc)
    if reduction == "mean":
        scale = scale / count.to(acc)
    row_scale = torch.where(invalid, torch.nan, torch.where(counted, scale, 0.0)).contiguous()
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if wants[0] else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=x.device) if wants[1] else None
    grad_b = torch.empty(vocab, dtype=acc, device=x.device) if wants[2] else None
    for start, w, b in _chunks(weight, bias, chunk_width(x.shape[0], vocab, x.element_size())):
        g = F.linear(x, w, b)  # becomes the chunk's gradient, in place
        if ops is None:
            _gradient_torch(g, target, start, vocab, lse, row_scale, label_smoothing, z_loss, softcap)
        else:
            ops.backward(g, target, start, vocab, lse, row_scale, label_smoothing, z_loss, softcap)
        end = start + g.shape[1]
        if wants[0]:
            _add_matmul_(grad_x, g, w)
        if wants[1]:
            torch.mm(g.t(), x, out=grad_w[start:end])
        if wants[2]:
            torch.sum(g, 0, dtype=acc, out=grad_b[start:end])
    return (None if grad_x is None else grad_x.to(x.dtype), grad_w,
            None if grad_b is None else grad_b.to(bias.dtype))


def _row_ops(x: torch.Tensor):
    """The build of kernels/linear_cross_entropy.cu for x's device and dtype; None off CUDA."""
    return loader.load_for_device("linear_cross_entropy", x.device, x.dtype) if x.is_cuda else None


# ----------------------------------------------------------------------------------
# Under torch.compile the two passes are opaque ops: a tracer sees two calls, not the chunk loop
# with its in-place kernels and out= products (whose functionalized trace gave wrong gradients).

_LOSS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index, float label_smoothing, "
                "float z_loss, float softcap, str reduction) -> (Tensor, Tensor, Tensor)")
_GRADIENTS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor lse, Tensor count, "
                     "Tensor grad_output, int ignore_index, float label_smoothing, float z_loss, float softcap, "
                     "str reduction, bool[] wants) -> (Tensor, Tensor, Tensor)")


def _loss_fake(x, weight, bias, target, ignore_index, label_smoothing, z_loss, softcap, reduction):
    acc = _accumulation_dtype(x.dtype)
    shape = (x.shape[0],) if reduction == "none" else ()
    return (x.new_empty(shape, dtype=acc), x.new_empty(x.shape[0], dtype=acc),
            x.new_empty((), dtype=torch.int64))


def _gradients_op(x, weight, bias, target, lse, count, grad_output, *options):
    grads = gradient_pass(x, weight, bias, target, lse, count, grad_output, *options)
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)  # the schema's tensors


def _gradients_fake(x, weight, bias, target, lse, count, grad_output, *options):
    wants = options[-1]
    likes = (x, weight, bias)
    return tuple(torch.empty_like(like) if want else x.new_empty(0) for want, like in zip(wants, likes))


def _define_compile_ops():
    namespace = "fused_losses_linear_ce"
    if not hasattr(torch.library, "register_fake") or hasattr(getattr(torch.ops, namespace), "loss"):
        return None  # torch < 2.4, or defined by this file imported under another name
    library = torch.library.Library(namespace, "DEF")
    for name, schema, impl, fake in (("loss", _LOSS_SCHEMA, loss_pass, _loss_fake),
                                     ("gradients", _GRADIENTS_SCHEMA, _gradients_op, _gradients_fake)):
        library.define(name + schema)
        for device in ("CPU", "CUDA"):
            library.impl(name, impl, device)
        torch.library.register_fake(f"{namespace}::{name}", fake, lib=library)
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
            loss, lse, count = torch.ops.fused_losses_linear_ce.loss(x, weight, bias, target, *arguments)
        else:
            loss, lse, count = loss_pass(x, weight, bias, target, *arguments)
        ctx.arguments = arguments
        ctx.save_for_backward(x, weight, bias, target, lse, count)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_output, _):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy has no second derivative: backward(create_graph=True) "
                               "through it is not supported")
        if grad_output is None:
            return None, None, None, None, None
        x, weight, bias, target, lse, count = ctx.saved_tensors
        wants = list(ctx.needs_input_grad[:3])
        if _is_compiling():
            grads = torch.ops.fused_losses_linear_ce.gradients(x, weight, bias, target, lse, count, grad_output,
                                                                *ctx.arguments, wants)
            grads = [grad if want else None for grad, want in zip(grads, wants)]
        else:
            grads = gradient_pass(x, weight, bias, target, lse, count, grad_output, *ctx.arguments, wants)
        return (*grads, None, None)
