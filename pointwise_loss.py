"""The pointwise loss engine that MSE and KL share (kernels/pointwise.cuh on the device):
one Function and one eager path; only the kernels' math and torch's formula differ.

Stack: <loss>.py checks and scales -> pointwise_loss() -> eagerly the build's forward and
the C++ autograd node, or _PointwiseLossFunction (reduction 'none', torch.compile).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

if __package__:
    from . import loss_helpers as helpers
else:
    import loss_helpers as helpers


def forward_fake(input, target, reduction, scale, float_loss, want_grad_input, want_grad_target, guess_grad_output,
                 *op_args):
    scalar_loss = reduction != helpers.REDUCTION_CODES["none"]
    loss = input.new_empty(() if scalar_loss else input.shape, dtype=torch.float32 if float_loss else input.dtype)
    grad_input = input.new_empty(input.shape if scalar_loss and want_grad_input else (0,))
    grad_target = input.new_empty(input.shape if scalar_loss and want_grad_target else (0,))
    return loss, grad_input, grad_target


def backward_fake(input, target, grad_output, want_grad_input, want_grad_target, *op_args):
    return (input.new_empty(input.shape if want_grad_input else (0,)),
            input.new_empty(input.shape if want_grad_target else (0,)))


COMPILE_FAKES = {"forward": forward_fake, "backward": backward_fake, "recompute_gradients_": helpers.no_outputs_fake,
                 "scale_by_grad_output_": helpers.no_outputs_fake}


class _PointwiseLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, options):
        kernel, reduction, scale, float_loss, op_args, want_grad_input, want_grad_target = options
        loss, grad_input, grad_target = helpers.kernel_ops(kernel, input).forward(
            input, target, helpers.REDUCTION_CODES[reduction], scale, float_loss, want_grad_input, want_grad_target,
            False, *op_args)
        ctx.kernel, ctx.reduction, ctx.op_args, ctx.scale, ctx.float_loss = kernel, reduction, op_args, scale, float_loss
        ctx.want_grads = (want_grad_input, want_grad_target)
        ctx.recompute = None
        if reduction == "none":
            ctx.save_for_backward(input, target)
        else:
            kept = (input, target) if helpers.keeps_operands(float_loss) else ()
            ctx.recompute = ((scale,), tuple(op_args)) if kept else None
            ctx.save_for_backward(grad_input if want_grad_input else None,
                                  grad_target if want_grad_target else None, *kept)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none" and helpers.create_graph():
            formula = _formula(ctx.kernel, ctx.reduction, ctx.scale, ctx.float_loss, ctx.op_args)
            return (*helpers.gradient_graph(formula, ctx.saved_tensors, ctx.want_grads, grad_output), None)
        if ctx.reduction == "none":
            input, target = ctx.saved_tensors
            grad_input, grad_target = helpers.kernel_ops(ctx.kernel, input).backward(
                input, target, grad_output.contiguous(), *ctx.want_grads, *ctx.op_args)
            grad_input = grad_input if ctx.want_grads[0] else None
            grad_target = grad_target if ctx.want_grads[1] else None
        else:
            grad_input, grad_target = helpers.backward_from_saved_grads(ctx, grad_output)
        return grad_input, grad_target, None


def fusable(input: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take these tensors, or None when it can."""
    why_not = helpers.unfusable_reason(input)
    if why_not is not None or not target.is_cuda:
        return why_not or "CPU tensors"
    same = input.dtype == target.dtype and input.shape == target.shape  # the usual case, checked cheaply
    dtype = input.dtype if same else torch.promote_types(input.dtype, target.dtype)
    if dtype not in helpers.FUSED_DTYPES:
        return f"dtype {dtype} has no kernel"
    if (input.numel() if same else math.prod(torch.broadcast_shapes(input.shape, target.shape))) == 0:
        return "empty tensors"
    return None


def operands(input: torch.Tensor, target: torch.Tensor):
    """input and target as the kernel takes them: one dtype (torch's type promotion) and
    one shape (torch's broadcasting). The casts and expands are autograd-tracked, so the
    gradients reach the originals in their own dtype and shape; they cost a copy, which
    the same dtype and shape never pay."""
    if input.dtype != target.dtype:
        dtype = torch.promote_types(input.dtype, target.dtype)
        input, target = input.to(dtype), target.to(dtype)
    if input.shape != target.shape:
        input, target = torch.broadcast_tensors(input, target)
    return input, target


def _formula(kernel: str, reduction: str, scale: float, float_loss: bool, op_args):
    """The loss by torch's formula, as the kernel computes it from its operands."""
    def formula(input, target):
        if float_loss:
            input, target = input.float(), target.float()
        if kernel == "mse":
            per_element = F.mse_loss(input, target, reduction="none")
        else:
            log_input, log_target = op_args
            per_element = F.kl_div(input if log_input else input.log(), target, reduction="none", log_target=log_target)
        return per_element if reduction == "none" else per_element.sum() * scale
    return formula


def _gradient_graph(options, input, target, grad_output):
    """For the eager node (kernels/autograd_node.h) under create_graph=True: the gradients
    from the operands as the user passed them, through the forward's promotion, broadcast
    and casts (options: what the forward saw). The node is given (this function, options):
    nothing built per call but the tuple, and no tensor held."""
    kernel, reduction, scale, float_loss, op_args, dtypes, wants = options
    cast = tuple(operand.to(dtype) for operand, dtype in zip(operands(input, target), dtypes))
    return helpers.gradient_graph(_formula(kernel, reduction, scale, float_loss, op_args), cast, wants, grad_output)


def pointwise_loss(kernel: str, input, target, reduction: str, scale: float, op_args, user_operands):
    """The loss of `kernel` ("mse", "kl_div") on operands() of the user's input and target
    (user_operands: as the user passed them); scale: the reduction's factor."""
    (input, target), float_loss = helpers.autocast_operands(reduction, input, target)
    want_grad_input, want_grad_target = helpers.wants_grad(input), helpers.wants_grad(target)
    want_grads = want_grad_input or want_grad_target
    if helpers.use_python_function(want_grads, reduction):
        return _PointwiseLossFunction.apply(input, target, (kernel, reduction, scale, float_loss, tuple(op_args),
                                                            want_grad_input, want_grad_target))
    ops = helpers.kernel_ops(kernel, input)
    loss, grad_input, grad_target = ops.forward(input, target, helpers.REDUCTION_CODES[reduction], scale, float_loss,
                                                want_grad_input, want_grad_target, want_grads, *op_args)
    if not want_grads:  # no graph to record
        return loss
    differentiable = (_gradient_graph, (kernel, reduction, scale, float_loss, op_args,
                                        (input.dtype, target.dtype), (want_grad_input, want_grad_target)))
    recompute = (helpers.recompute_for_node(ops.recompute_gradients_, (input, target), (scale,), tuple(op_args))
                 if helpers.keeps_operands(float_loss) else None)
    return ops.attach_saved_gradients(loss, input, grad_input, target, grad_target, *user_operands, differentiable,
                                      recompute)
