"""Linear + cross-entropy without the whole logits (losses.linear_cross_entropy): the loss of
F.cross_entropy(F.linear(input, weight, bias), target), computed a chunk of rows at a time, so
that the (N, V) logits and their gradient never exist whole.

Per chunk of rows: logits = x_c W^T + b in the operands' dtype (what F.linear gives), capped
when asked (softcap * tanh(logits / softcap)), then in float32 (float64 for float64 operands)
each row's lse, loss and d loss / d logits, which go straight into d input (rounded to the
operands' dtype first, as eager's d logits are), d weight (summed over the chunks in a float32
buffer, in chunk order: the same bits every run) and d bias. Scalar reductions compute the
gradients in the forward and scale them by grad_output in backward; 'none' computes them in
backward from grad_output's per-row factors.

This is the torch-op path: on CPU, and on CUDA until a fused kernel exists (issue 38). Beyond
the inputs and their gradients it holds one chunk's logits and gradient (CHUNK_LOGITS
elements of float32 each) and the float32 weight-gradient buffer (V x H).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_LOGITS = 1 << 24  # logits a chunk: 64 MB of float32


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_LOGITS // max(vocab, 1))


def _loss_and_grads(x, weight, bias, target, options, row_scale, wants):
    """Per-row loss and lse of (N, H) x against (V, H) weight, and, for each of wants
    (input, weight, bias) asked for, the gradient of sum_rows(row_scale * loss_row); row_scale
    is 0-dim or (N,). Ignored rows: loss 0, gradient 0; rows whose class is outside [0, V): NaN."""
    ignore_index, label_smoothing, z_loss, softcap = options
    acc = _accumulation_dtype(x.dtype)
    rows, vocab = x.shape[0], weight.shape[0]
    loss = torch.empty(rows, dtype=acc, device=x.device)
    lse = torch.empty(rows, dtype=acc, device=x.device)
    grad_x = torch.empty_like(x) if wants[0] else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device) if wants[1] else None
    grad_b = torch.zeros(vocab, dtype=acc, device=x.device) if wants[2] else None
    for start in range(0, rows, _chunk_rows(vocab)):
        end = min(start + _chunk_rows(vocab), rows)
        logits = F.linear(x[start:end], weight, bias).to(acc)
        if softcap is not None:
            logits = torch.tanh(logits / softcap).mul_(softcap)
        t = target[start:end]
        counted = t != ignore_index
        # A class outside [0, V): NaN for its row, as cross_entropy's kernels give (no device assert).
        invalid = counted & ((t < 0) | (t >= vocab))
        index = torch.where(counted & ~invalid, t, 0).long()
        row_lse = torch.logsumexp(logits, 1)
        target_logit = logits.gather(1, index[:, None])[:, 0]
        ce = (1 - label_smoothing) * (row_lse - target_logit) + label_smoothing * (row_lse - logits.mean(1))
        loss[start:end] = torch.where(invalid, float("nan"), torch.where(counted, ce + z_loss * row_lse.square(), 0.0))
        lse[start:end] = row_lse
        if not any(wants):
            continue
        # d loss_row / d logits = p (1 + 2 z lse) - (1 - eps) one_hot - eps / V
        grad = torch.exp(logits - row_lse[:, None]).mul_((1 + 2 * z_loss * row_lse)[:, None])
        grad.sub_(label_smoothing / vocab)
        grad[torch.arange(end - start, device=x.device), index] -= 1 - label_smoothing
        scale = row_scale if row_scale.dim() == 0 else row_scale[start:end, None]
        grad = torch.where(counted[:, None], grad * scale, 0.0)  # 0, not 0 * inf, with no row counted
        grad = torch.where(invalid[:, None], float("nan"), grad)
        if softcap is not None:
            grad.mul_(1 - (logits / softcap).square())
        if wants[0]:
            grad_x[start:end] = grad.to(x.dtype) @ weight
        if wants[1]:
            grad_w.addmm_(grad.t(), x[start:end].to(acc))
        if wants[2]:
            grad_b += grad.sum(0)
    return loss, lse, (grad_x, grad_w, grad_b)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(N, H) input, (V, H) weight, (V,) bias or None, (N,) class indices. Returns
    (loss, lse): loss 0-dim for 'mean' and 'sum', (N,) for 'none'; lse (N,) without gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, options):
        reduction, float_loss = options[-2:]
        options = options[:-2]
        wants = tuple(ctx.needs_input_grad[:3]) if reduction != "none" else (False, False, False)
        counted = (target != options[0]).sum()
        # 'mean' divides by the counted rows (no row counted: 0 / 0, NaN, as torch).
        scale = (1.0 / counted.to(_accumulation_dtype(x.dtype)) if reduction == "mean"
                 else torch.ones((), dtype=_accumulation_dtype(x.dtype), device=x.device))
        loss, lse, grads = _loss_and_grads(x, weight, bias, target, options, scale, wants)
        ctx.reduction, ctx.options = reduction, options
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if reduction == "none":
            ctx.save_for_backward(x, weight, bias, target)
        else:
            ctx.save_for_backward(*grads)
            loss = loss.sum() * scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return loss.to(torch.float32 if float_loss else x.dtype), lse

    @staticmethod
    def backward(ctx, grad_output, _):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy has no second derivative: backward(create_graph=True) "
                               "through it is not supported")
        if grad_output is None:
            return None, None, None, None, None
        if ctx.reduction == "none":
            x, weight, bias, target = ctx.saved_tensors
            row_scale = grad_output.to(_accumulation_dtype(x.dtype))
            _, _, grads = _loss_and_grads(x, weight, bias, target, ctx.options, row_scale,
                                          tuple(ctx.needs_input_grad[:3]))
        else:
            grads = [None if grad is None else grad * grad_output.to(grad.dtype) for grad in ctx.saved_tensors]
        return (*(None if grad is None else grad.to(dtype) for grad, dtype in zip(grads, ctx.dtypes)), None, None)
