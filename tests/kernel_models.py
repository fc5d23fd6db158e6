"""Python models of the kernel ops: same signatures and outputs as kernels/*.cu, in torch
ops, so that tests without a GPU can run the loss modules' fused path on CPU tensors (the
kernels_modelled_on_cpu fixture in conftest.py). They prove the plumbing (what reaches
the ops, what autograd and torch.compile make of their outputs), never the kernels.
Kernel ops run below autograd, and so do the models (no_grad)."""
import torch
import torch.nn.functional as F

import cross_entropy
import loss_helpers

NONE, MEAN = loss_helpers.REDUCTION_CODES["none"], loss_helpers.REDUCTION_CODES["mean"]

def pointwise_model(math):
    """math(input, target, *op_args) -> (loss, d loss/d input, d loss/d target), per element,
    computed like the kernels in the accumulation type and rounded to the dtype once."""
    def accumulated(input, target, op_args):
        acc = loss_helpers.accumulation_dtype(input.dtype)
        return math(input.to(acc), target.to(acc), *op_args)

    @torch.no_grad()
    def forward(input, target, reduction, scale, float_loss, want_grad_input, want_grad_target, guess_grad_output,
                *op_args):
        loss, grad_input, grad_target = accumulated(input, target, op_args)
        if reduction == NONE:
            return loss.to(input.dtype), input.new_empty(0), input.new_empty(0)  # outputs never alias each other
        return (loss.double().sum().mul(scale).to(torch.float32 if float_loss else input.dtype),
                (grad_input * scale).to(input.dtype) if want_grad_input else input.new_empty(0),
                (grad_target * scale).to(input.dtype) if want_grad_target else input.new_empty(0))

    @torch.no_grad()
    def backward(input, target, grad_output, want_grad_input, want_grad_target, *op_args):
        _, grad_input, grad_target = accumulated(input, target, op_args)
        grad_output = grad_output.to(grad_input.dtype)
        return ((grad_input * grad_output).to(input.dtype) if want_grad_input else input.new_empty(0),
                (grad_target * grad_output).to(input.dtype) if want_grad_target else input.new_empty(0))

    @torch.no_grad()
    def recompute_gradients_(input, target, scale, grad_output, applied, grad_input, grad_target, *op_args):
        """The forward's gradients with grad_output as the factor, rounded once, over the saved ones
        (the kernel skips that where applied equals grad_output: the same values)."""
        _, *grads = accumulated(input, target, op_args)
        for saved, grad in zip((grad_input, grad_target), grads):
            if saved.numel():
                saved.copy_(grad * (scale * grad_output.item()))

    return forward, backward, recompute_gradients_


def squared_error(x, y):
    return (x - y) ** 2, 2 * (x - y), -2 * (x - y)


def kl_div_terms(input, target, log_input, log_target):
    log_p = input if log_input else input.log()
    q = target.exp() if log_target else target
    grad_input = -q if log_input else -q / input
    if log_target:
        loss = q * (target - log_p)
        return loss, grad_input, loss + q
    # d xlogy(q, q) / dq as torch's autograd gives it (and the kernel): NaN at q == 0.
    return torch.xlogy(q, q) - q * log_p, grad_input, torch.xlogy(q != 0, q) + q / q - log_p


REDUCTION_NAMES = {code: name for name, code in loss_helpers.REDUCTION_CODES.items()}


def cross_entropy_terms(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, temperature,
                        want_grads, grad_output=None, factor=1.0):
    """The loss by torch's formula (cross_entropy.reference_cross_entropy) of u = logits / temperature,
    and the gradients of logits and target that want_grads asks for, by the formulas in
    kernels/cross_entropy.cu (an op's implementation runs below autograd). In the accumulation type."""
    acc_dtype = loss_helpers.accumulation_dtype(logits.dtype)
    x = logits.to(acc_dtype) / temperature
    rows, num_classes = x.shape
    probs = target.is_floating_point()
    w = weight.to(acc_dtype) if weight is not None else x.new_ones(num_classes)
    loss = cross_entropy.reference_cross_entropy(x, target.to(acc_dtype) if probs else target,
                                       None if weight is None else weight.to(acc_dtype), ignore_index, reduction,
                                       label_smoothing, z_loss, False)
    log_softmax, lse = x.log_softmax(1), x.logsumexp(1)
    p = log_softmax.exp()
    share = label_smoothing / num_classes
    if probs:
        y = (1 - label_smoothing) * target.to(acc_dtype) + share
        counted = x.new_ones(rows)
        grad_x = p * (w * y).sum(1, keepdim=True) - w * y
        grad_y = -(1 - label_smoothing) * w * log_softmax
        divisor = z_divisor = rows
    else:
        counted = (target != ignore_index).to(acc_dtype)
        classes = target.long().masked_fill(target == ignore_index, 0)
        w_t = w[classes] * counted
        grad_x = (1 - label_smoothing) * w_t[:, None] * (p - F.one_hot(classes, num_classes)) \
            + share * (w.sum() * p - w) * counted[:, None]
        grad_y = None
        divisor, z_divisor = w_t.sum(), counted.sum()
    if reduction == "none":
        scale = z_scale = x.new_ones(rows) if grad_output is None else grad_output.to(acc_dtype)
    elif reduction == "mean":
        scale, z_scale = 1 / divisor, 1 / z_divisor
    else:
        scale = z_scale = 1.0
    keep = counted[:, None] > 0  # the kernel leaves an ignored row's gradient 0, whatever the scale (1 / 0)
    grad_x = torch.where(keep, grad_x * (scale[:, None] if reduction == "none" else scale), 0.0)
    grad_x = (grad_x + torch.where(keep, 2 * z_loss * (lse * z_scale)[:, None] * p, 0.0)) / temperature
    if grad_y is not None:
        grad_y = grad_y * scale[:, None] if reduction == "none" else grad_y * scale
    grads = [(grad * factor).to(logits.dtype) if wanted else logits.new_empty(0)
             for grad, wanted in zip((grad_x, grad_y), want_grads)]
    return loss, grads, lse


@torch.no_grad()
def cross_entropy_forward(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing, z_loss,
                          temperature, want_grad_logits, want_grad_target, want_lse, inplace, guess_grad_output):
    name = REDUCTION_NAMES[reduction]
    wants = (want_grad_logits, want_grad_target) if name != "none" else (False, False)
    loss, grads, lse = cross_entropy_terms(logits, target, weight, ignore_index, name, label_smoothing, z_loss,
                                           temperature, wants)
    if inplace:  # the kernel writes the gradient over the logits and returns them as it
        grads[0] = logits.copy_(grads[0])
    return (loss.to(torch.float32 if float_loss else logits.dtype), grads[0], grads[1],
            lse if want_lse else lse.new_empty(0))


@torch.no_grad()
def cross_entropy_backward(logits, target, weight, ignore_index, label_smoothing, z_loss, temperature, grad_output,
                           want_grad_logits, want_grad_target):
    _, grads, _ = cross_entropy_terms(logits, target, weight, ignore_index, "none", label_smoothing, z_loss,
                                      temperature, (want_grad_logits, want_grad_target), grad_output.to(logits.dtype))
    return tuple(grads)


@torch.no_grad()
def cross_entropy_recompute_gradients_(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                       temperature, grad_output, applied, grad_logits, grad_target):
    wants = (grad_logits.numel() > 0, grad_target.numel() > 0)
    _, grads, _ = cross_entropy_terms(logits, target, weight, ignore_index, REDUCTION_NAMES[reduction],
                                      label_smoothing, z_loss, temperature, wants, factor=grad_output.item())
    for saved, grad in zip((grad_logits, grad_target), grads):
        if saved.numel():
            saved.copy_(grad)


def scale_by_grad_output_(grad, grad_output):
    """In the accumulation type, rounded once: grad_output is not rounded to grad's dtype first."""
    assert grad_output.numel() == 1
    acc = loss_helpers.accumulation_dtype(grad.dtype)
    grad.copy_(grad.to(acc) * grad_output.reshape(()).to(acc))


class _ScaleSavedGradients(torch.autograd.Function):
    """kernels/autograd_node.h's node: backward scales the gradients the forward wrote; with
    create_graph=True it calls function(options, user_input, user_target, grad_output), where
    differentiable = (function, options)."""

    @staticmethod
    def forward(ctx, input, target, loss_and_grads):
        loss, ctx.grads, ctx.user_operands, ctx.differentiable, ctx.recompute = loss_and_grads
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if torch.is_grad_enabled():
            if ctx.differentiable is None:
                raise RuntimeError("model of the fused losses' node: this fused loss has no second derivative")
            function, options = ctx.differentiable
            return (*function(options, *ctx.user_operands, grad_output), None)
        if grad_output is None:  # no gradient reached the loss: none flows on
            return None, None, None
        # Scaled copies (the node scales in place when no later backward can come; same values).
        copies = [None if grad is None else grad.clone() for grad in ctx.grads]
        if ctx.recompute is not None:
            ctx.recompute(grad_output, None, *copies)
            return (*copies, None)
        for grad in copies:
            if grad is not None:
                scale_by_grad_output_(grad, grad_output)
        return (*copies, None)


def attach_saved_gradients(loss, input, grad_input, target, grad_target, user_input, user_target, differentiable,
                           recompute):
    grads = tuple(grad if operand.requires_grad else None
                  for operand, grad in ((input, grad_input), (target, grad_target)))
    return _ScaleSavedGradients.apply(input, target, (loss, grads, (user_input, user_target), differentiable,
                                                      recompute))


MODELS = {
    "mse": pointwise_model(squared_error),
    "kl_div": pointwise_model(kl_div_terms),
    "cross_entropy": (cross_entropy_forward, cross_entropy_backward, cross_entropy_recompute_gradients_),
}
