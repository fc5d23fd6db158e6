"""Fused CUDA losses with torch.nn.functional's signatures and results.

    from losses import cross_entropy, kl_div, mse_loss          # functional
    from losses import CrossEntropyLoss, KLDivLoss, MSELoss     # modules

On CUDA tensors each loss runs one fused kernel (kernels/<loss>.cu, built on first use
by loader.py). When grad is needed and the reduction is a scalar, that kernel also
writes the gradient, so backward only scales it by grad_output (read on the GPU; no
host sync anywhere).

Under CUDA autocast they give what torch's give there: a float32 loss (_autocast_operands).

CPU tensors, and argument combinations the kernels do not cover yet, run
torch.nn.functional itself: same results. Set FUSED_LOSSES_STRICT=1 to make such a
fallback on a CUDA tensor raise instead (the GPU tests do, to prove the kernels ran).
"""
from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.nn import _reduction

if __package__:  # copied into a project as a package: from fused_losses import losses
    from . import linear_ce
    from . import loader, vocab_parallel
else:  # a plain folder on sys.path, or a notebook's working directory: import losses
    import linear_ce
    import loader
    import vocab_parallel

__all__ = ["cross_entropy", "kl_div", "mse_loss", "linear_cross_entropy", "CrossEntropyLoss", "KLDivLoss", "MSELoss",
           "LinearCrossEntropyLoss"]

# torch.compile traces the losses through stable custom ops (torch >= 2.4: register_fake).
COMPILE_OPS = hasattr(torch.library, "register_fake")
if COMPILE_OPS:
    from torch.compiler import is_compiling
else:
    def is_compiling() -> bool:
        return False

# Same codes as enum Reduction in kernels/launch.cuh.
REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2, "batchmean": 3}
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ----------------------------------------------------------------------------------
# Shared plumbing.

def _ops(kernel: str, like: torch.Tensor):
    """The ops of `kernel` (forward, backward, scale_by_grad_output_) for the device and
    dtype of `like` (the loss's input: each dtype is a build of its own).

    Eagerly: the build itself, from the loader. Under torch.compile: the same ops under
    stable names (see "Kernel ops under torch.compile" below), which a tracer can follow.
    """
    if COMPILE_OPS and is_compiling():
        return getattr(torch.ops, f"fused_losses_{kernel}")
    return loader.load_for_device(kernel, like.device, like.dtype)


def _check_reduction(reduction: str, allowed) -> None:
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, allowed))}, got {reduction!r}")


def _legacy_reduction(size_average, reduce, reduction: str) -> str:
    """torch's deprecated size_average/reduce arguments, mapped as torch maps them."""
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_string(size_average, reduce)
    return reduction


def _check_same_device(input: torch.Tensor, target, weight: torch.Tensor | None = None) -> None:
    """target (when a tensor: torch raises its own error for anything else) and weight
    must be on input's device. Written out rather than looped: every loss call pays it."""
    device = input.device
    if isinstance(target, torch.Tensor) and target.device != device:
        raise _device_error("target", target, input)
    if weight is not None and weight.device != device:
        raise _device_error("weight", weight, input)


def _device_error(name: str, other: torch.Tensor, input: torch.Tensor) -> ValueError:
    return ValueError(f"{name} is on {other.device} but input is on {input.device}; move both to one device")


def _check_fallback_allowed(loss: str, why: str, input: torch.Tensor) -> None:
    """Before running torch's implementation: raises on a CUDA tensor in strict mode."""
    if input.is_cuda and os.environ.get("FUSED_LOSSES_STRICT") == "1":
        raise RuntimeError(f"{loss}: {why}, so the fused kernel does not run here "
                           "(FUSED_LOSSES_STRICT=1 forbids torch fallbacks on CUDA tensors)")


def _in_forward_ad() -> bool:
    """Inside torch.autograd.forward_ad.dual_level(): the kernels carry no tangents (their
    outputs would silently have none), torch's ops do."""
    return forward_ad._current_level >= 0


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels accumulate in, and the dtype of cross-entropy's lse."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _wants_grad(tensor: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


LOW_PRECISION = (torch.float16, torch.bfloat16)


def _under_autocast(tensor: torch.Tensor) -> bool:
    """Whether CUDA's autocast applies to this tensor."""
    return tensor.is_cuda and torch.is_autocast_enabled()  # no argument: CUDA's, torch 2.0 on


def _autocast_operands(reduction: str, *operands):
    """Under CUDA autocast, (operands, float_loss) as torch's autocast would have them.

    torch runs these losses in float32 under autocast (its float32 list: log_softmax,
    nll_loss, kl_div, mse_loss, log): float16 and bfloat16 operands are cast to float32 and
    the loss is float32. Ours does the same, except that bfloat16 operands of a scalar loss
    reach the kernel as they are: it computes in float32 anyway and writes the loss in
    float32 (float_loss). Their gradient is rounded to bfloat16 before backward scales it by
    grad_output, which bfloat16's float32-sized exponent range allows (a loss scale, a power
    of two, scales it exactly). A float16 gradient rounded before a loss scale of 2**16
    would flush most of a softmax's gradient to zero: float16 takes torch's way.
    Outside autocast, or for operands not on CUDA: (operands, False), unchanged."""
    if not _under_autocast(operands[0]):
        return operands, False
    floating = [t for t in operands if t is not None and t.is_floating_point()]
    if not any(t.dtype in LOW_PRECISION for t in floating):
        return operands, False
    if reduction != "none" and all(t.dtype == torch.bfloat16 for t in floating):
        return operands, True
    return tuple(t.float() if t is not None and t.dtype in LOW_PRECISION else t for t in operands), False


def _create_graph() -> bool:
    """In backward: grad mode is on there only for backward(create_graph=True), whose
    gradients are to be differentiated again. The kernels' gradients have no graph of their
    own; there _gradient_graph recomputes them by torch's formula instead. (Under
    torch.compile, AOTAutograd refuses double backward itself.)"""
    return torch.is_grad_enabled() and not is_compiling()


def _gradient_graph(formula, operands, wants, grad_output):
    """The gradients of formula(*operands) (torch's formula of the loss) with respect to the
    operands that wants marks, from grad_output, as a graph: for backward(create_graph=True)
    alone, so the usual backward never pays for it. None for the others."""
    wanted = [operand for operand, want in zip(operands, wants) if want]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(formula(*operands), wanted, grad_output, create_graph=True,
                                         allow_unused=True))
    return tuple(next(grads) if want else None for want in wants)


def _backward_from_saved_grads(ctx, grad_output: torch.Tensor):
    """Backward of a scalar loss whose forward wrote the gradients, under torch.compile
    (eagerly, kernels/autograd_node.h's node does this): scale them by grad_output and
    hand them to autograd. The compiled graph is functional: the scale writes a copy of
    the saved gradient, so a second backward is correct there and nothing needs checking."""
    grads = ctx.saved_tensors
    present = [grad for grad in grads if grad is not None]
    dtype = present[0].dtype
    scale = grad_output if grad_output.dim() == 0 and grad_output.dtype == dtype else grad_output.reshape(()).to(dtype)
    ops = _ops(ctx.kernel, present[0])
    for grad in present:
        ops.scale_by_grad_output_(grad, scale)
    return grads


# ----------------------------------------------------------------------------------
# Kernel ops under torch.compile.
#
# A build is a Python module (pybind11) named after its arch and content hash, found by
# the loader, which reads files and takes locks: nothing a tracer can follow. So each
# kernel's ops are defined once more as custom ops under a stable name,
# torch.ops.fused_losses_<kernel>.<op>, with a schema. Running one loads the build and
# calls its op; tracing one runs only its fake, which makes outputs of the right shapes
# and dtypes. Eager calls skip this layer and call the build directly: a custom op's
# dispatch costs microseconds, which launch-bound losses would feel.
#
# KERNEL_OPS mirrors kernels/entry_points.h: op name -> (schema without the name, fake). A changed
# kernel signature changes its row here (tests/test_build.py compares them).

def _pointwise_forward_fake(input, target, reduction, scale, float_loss, want_grad_input, want_grad_target,
                            *op_args):
    scalar_loss = reduction != REDUCTION_CODES["none"]
    loss = input.new_empty(() if scalar_loss else input.shape, dtype=torch.float32 if float_loss else input.dtype)
    grad_input = input.new_empty(input.shape if scalar_loss and want_grad_input else (0,))
    grad_target = input.new_empty(input.shape if scalar_loss and want_grad_target else (0,))
    return loss, grad_input, grad_target


def _pointwise_backward_fake(input, target, grad_output, want_grad_input, want_grad_target, *op_args):
    return (input.new_empty(input.shape if want_grad_input else (0,)),
            input.new_empty(input.shape if want_grad_target else (0,)))


def _schema_argument_names(schema: str) -> list[str]:
    """The argument names of a schema "(Tensor logits, int reduction, ...) -> ...", in order."""
    return [argument.split()[-1] for argument in schema[1:schema.index(") ->")].split(",")]


# Its 12 arguments are written here once (kernels/entry_points.h has them once in C++); the fake
# reads them by name.
_CROSS_ENTROPY_FORWARD = ("(Tensor logits, Tensor target, Tensor? weight, int ignore_index, int reduction, "
                          "bool float_loss, float label_smoothing, float z_loss, bool want_grad_logits, "
                          "bool want_grad_target, bool want_lse, bool inplace) -> (Tensor, Tensor, Tensor, Tensor)")
_CROSS_ENTROPY_FORWARD_ARGUMENTS = _schema_argument_names(_CROSS_ENTROPY_FORWARD)


def _cross_entropy_forward_fake(*args):
    named = dict(zip(_CROSS_ENTROPY_FORWARD_ARGUMENTS, args))
    logits = named["logits"]
    scalar_loss = named["reduction"] != REDUCTION_CODES["none"]
    rows = logits.shape[0]
    loss_dtype = torch.float32 if named["float_loss"] else logits.dtype
    loss = logits.new_empty(() if scalar_loss else (rows,), dtype=loss_dtype)
    grad_logits = logits.new_empty(logits.shape if scalar_loss and named["want_grad_logits"] else (0,))
    grad_target = logits.new_empty(logits.shape if scalar_loss and named["want_grad_target"] else (0,))
    lse = logits.new_empty((rows,) if named["want_lse"] else (0,), dtype=_accumulation_dtype(logits.dtype))
    return loss, grad_logits, grad_target, lse


def _cross_entropy_backward_fake(logits, target, weight, ignore_index, label_smoothing, z_loss, grad_output,
                                 want_grad_logits, want_grad_target):
    return (logits.new_empty(logits.shape if want_grad_logits else (0,)),
            logits.new_empty(logits.shape if want_grad_target else (0,)))


def _no_outputs_fake(*args):  # an op that only writes its (a!) arguments
    return None


_POINTWISE_FORWARD = ("(Tensor input, Tensor target, int reduction, float scale, bool float_loss, "
                      "bool want_grad_input, bool want_grad_target{}) -> (Tensor, Tensor, Tensor)")
_POINTWISE_BACKWARD = ("(Tensor input, Tensor target, Tensor grad_output, bool want_grad_input, "
                       "bool want_grad_target{}) -> (Tensor, Tensor)")
_SCALE_BY_GRAD_OUTPUT = ("(Tensor(a!) grad, Tensor grad_output) -> ()", _no_outputs_fake)
_KL_ARGS = ", bool log_input, bool log_target"

KERNEL_OPS = {
    "chunked_cross_entropy": {  # the row passes (linear_ce.py): they write their (a!) arguments
        "forward": ("(Tensor logits, Tensor target, int class_start, int classes, Tensor(a!) stats, "
                    "float softcap) -> ()", _no_outputs_fake),
        "backward": ("(Tensor logits, Tensor(a!) grad, Tensor target, int class_start, int classes, "
                     "Tensor? class_count, Tensor softmax_stats, Tensor row_scale, float label_smoothing, float z_loss, "
                     "float softcap) -> ()", _no_outputs_fake),
    },
    "mse": {
        "forward": (_POINTWISE_FORWARD.format(""), _pointwise_forward_fake),
        "backward": (_POINTWISE_BACKWARD.format(""), _pointwise_backward_fake),
        "scale_by_grad_output_": _SCALE_BY_GRAD_OUTPUT,
    },
    "kl_div": {
        "forward": (_POINTWISE_FORWARD.format(_KL_ARGS), _pointwise_forward_fake),
        "backward": (_POINTWISE_BACKWARD.format(_KL_ARGS), _pointwise_backward_fake),
        "scale_by_grad_output_": _SCALE_BY_GRAD_OUTPUT,
    },
    "cross_entropy": {
        # inplace=True returns the logits as their gradient: never passed under torch.compile.
        "forward": (_CROSS_ENTROPY_FORWARD, _cross_entropy_forward_fake),
        "backward": ("(Tensor logits, Tensor target, Tensor? weight, int ignore_index, float label_smoothing, "
                     "float z_loss, Tensor grad_output, bool want_grad_logits, bool want_grad_target) "
                     "-> (Tensor, Tensor)", _cross_entropy_backward_fake),
        "scale_by_grad_output_": _SCALE_BY_GRAD_OUTPUT,
    },
}


def _call_build(kernel: str, op: str):
    fake = KERNEL_OPS[kernel][op][1]

    def call(*args):
        first = next(arg for arg in args if isinstance(arg, torch.Tensor))  # the input, or scale's grad
        device = first.device
        outputs = getattr(loader.load_for_device(kernel, device, first.dtype), op)(*args)
        if not isinstance(outputs, tuple) or all(output is not None for output in outputs):
            return outputs
        # A build returns None for an output it did not write; the schema promises a
        # tensor there: an empty one of the dtype the fake gives it.
        shapes = fake(*[arg.to("meta") if isinstance(arg, torch.Tensor) else arg for arg in args])
        return tuple(torch.empty(0, dtype=shape.dtype, device=device) if output is None else output
                     for output, shape in zip(outputs, shapes))
    return call


def _define_compile_ops() -> list:
    libraries = []
    for kernel, ops in KERNEL_OPS.items():
        namespace = f"fused_losses_{kernel}"
        if hasattr(getattr(torch.ops, namespace), "forward"):
            continue  # defined by this file imported under another name (plain folder and package)
        library = torch.library.Library(namespace, "DEF")
        for op, (schema, fake) in ops.items():
            library.define(op + schema)
            library.impl(op, _call_build(kernel, op), "CUDA")
            torch.library.register_fake(f"{namespace}::{op}", fake, lib=library)
        libraries.append(library)
    return libraries


# The definitions last as long as their Library objects.
_COMPILE_LIBRARIES = _define_compile_ops() if COMPILE_OPS else []


# ----------------------------------------------------------------------------------
# Autograd.
#
# Eagerly, a scalar loss with grad gets its grad_fn in C++ (ops.attach_saved_gradients,
# kernels/autograd_node.h): its forward kernel wrote the gradients, and backward only
# scales them by grad_output. The Python Functions below serve reduction 'none' (whose
# backward runs the backward kernel) and torch.compile, which traces them (it cannot
# trace the C++ node). They take their non-tensor arguments as one tuple, `options`:
# apply inspects each argument it is given (an empty Function's apply, desktop CPU:
# 3.3 us with 12 arguments, 2.4 us with 4).

def _use_python_function(want_grads: bool, reduction: str) -> bool:
    return want_grads and (reduction == "none" or is_compiling())


# ----------------------------------------------------------------------------------
# Pointwise losses (MSE and KL share one Function: only their kernels' math differs).

class _PointwiseLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, options):
        kernel, reduction, scale, float_loss, op_args, want_grad_input, want_grad_target = options
        loss, grad_input, grad_target = _ops(kernel, input).forward(
            input, target, REDUCTION_CODES[reduction], scale, float_loss, want_grad_input, want_grad_target,
            *op_args)
        ctx.kernel, ctx.reduction, ctx.op_args, ctx.scale, ctx.float_loss = kernel, reduction, op_args, scale, float_loss
        ctx.want_grads = (want_grad_input, want_grad_target)
        if reduction == "none":
            ctx.save_for_backward(input, target)
        else:
            ctx.save_for_backward(grad_input if want_grad_input else None,
                                  grad_target if want_grad_target else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none" and _create_graph():
            formula = _pointwise_formula(ctx.kernel, ctx.reduction, ctx.scale, ctx.float_loss, ctx.op_args)
            return (*_gradient_graph(formula, ctx.saved_tensors, ctx.want_grads, grad_output), None)
        if ctx.reduction == "none":
            input, target = ctx.saved_tensors
            grad_input, grad_target = _ops(ctx.kernel, input).backward(
                input, target, grad_output.contiguous(), *ctx.want_grads, *ctx.op_args)
            grad_input = grad_input if ctx.want_grads[0] else None
            grad_target = grad_target if ctx.want_grads[1] else None
        else:
            grad_input, grad_target = _backward_from_saved_grads(ctx, grad_output)
        return grad_input, grad_target, None


def _pointwise_fusable(input: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take these tensors, or None when it can."""
    if not (input.is_cuda and target.is_cuda):
        return "CPU tensors"
    if _in_forward_ad():
        return "forward-mode AD (dual tensors)"
    same = input.dtype == target.dtype and input.shape == target.shape  # the usual case, checked cheaply
    dtype = input.dtype if same else torch.promote_types(input.dtype, target.dtype)
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} has no kernel"
    if (input.numel() if same else math.prod(torch.broadcast_shapes(input.shape, target.shape))) == 0:
        return "empty tensors"
    return None


def _pointwise_operands(input: torch.Tensor, target: torch.Tensor):
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


def _pointwise_formula(kernel: str, reduction: str, scale: float, float_loss: bool, op_args):
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


def _pointwise_gradient_graph(options, input, target, grad_output):
    """For the eager node (kernels/autograd_node.h) under create_graph=True: the gradients
    from the operands as the user passed them, through the forward's promotion, broadcast
    and casts (options: what the forward saw). The node is given (this function, options):
    nothing built per call but the tuple, and no tensor held."""
    kernel, reduction, scale, float_loss, op_args, dtypes, wants = options
    operands = tuple(operand.to(dtype) for operand, dtype in zip(_pointwise_operands(input, target), dtypes))
    return _gradient_graph(_pointwise_formula(kernel, reduction, scale, float_loss, op_args), operands, wants,
                           grad_output)


def _pointwise_loss(kernel: str, input, target, reduction: str, scale: float, op_args, user_operands):
    """user_operands: input and target as the user passed them (before _pointwise_operands)."""
    (input, target), float_loss = _autocast_operands(reduction, input, target)
    want_grad_input, want_grad_target = _wants_grad(input), _wants_grad(target)
    want_grads = want_grad_input or want_grad_target
    if _use_python_function(want_grads, reduction):
        return _PointwiseLossFunction.apply(input, target, (kernel, reduction, scale, float_loss, tuple(op_args),
                                                            want_grad_input, want_grad_target))
    ops = _ops(kernel, input)
    loss, grad_input, grad_target = ops.forward(input, target, REDUCTION_CODES[reduction], scale, float_loss,
                                                want_grad_input, want_grad_target, *op_args)
    if not want_grads:  # no graph to record
        return loss
    differentiable = (_pointwise_gradient_graph, (kernel, reduction, scale, float_loss, op_args,
                                                  (input.dtype, target.dtype), (want_grad_input, want_grad_target)))
    return ops.attach_saved_gradients(loss, input, grad_input, target, grad_target, *user_operands, differentiable)


# ----------------------------------------------------------------------------------
# KL divergence.

# torch's own words (F.kl_div), so that filters written for torch's warning still match.
KL_MEAN_WARNING = (
    "reduction: 'mean' divides the total loss by both the batch size and the support size."
    "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
    "'mean' will be changed to behave the same as 'batchmean' in the next major release.")

def kl_div(input: torch.Tensor, target: torch.Tensor, size_average=None, reduce=None, reduction: str = "mean",
           log_target: bool = False, *, log_input: bool = True) -> torch.Tensor:
    """F.kl_div(input, target, ...), plus log_input.

    log_input=True (torch's convention): input holds log-probabilities.
    log_input=False: input holds probabilities p and the log is taken inside the kernel:
    kl_div(p, q, reduction='batchmean', log_input=False) == F.kl_div(torch.log(p), q,
    reduction='batchmean').
    """
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction, ("none", "batchmean", "mean", "sum"))
    _check_same_device(input, target)
    if not (input.is_floating_point() and target.is_floating_point()):  # torch's checks, before any promotion
        kind = "Complex" if input.is_complex() or target.is_complex() else "Integral"
        raise RuntimeError(f"kl_div: {kind} inputs not supported.")
    why_not = _pointwise_fusable(input, target)
    if why_not is None:
        batch_size = input.shape[0] if input.dim() != 0 else 1  # torch's, before broadcasting
        user_operands = (input, target)
        input, target = _pointwise_operands(input, target)
        if reduction == "mean":
            warnings.warn(KL_MEAN_WARNING, stacklevel=2)
            scale = 1.0 / input.numel()
        elif reduction == "batchmean":
            scale = 1.0 / batch_size
        else:
            scale = 1.0
        return _pointwise_loss("kl_div", input, target, reduction, scale, (log_input, log_target), user_operands)
    _check_fallback_allowed("kl_div", why_not, input)
    return F.kl_div(input if log_input else torch.log(input), target, reduction=reduction, log_target=log_target)


class KLDivLoss(nn.KLDivLoss):
    """nn.KLDivLoss on the fused kernel; log_input=False takes probabilities (see kl_div)."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False,
                 *, log_input: bool = True) -> None:
        super().__init__(size_average, reduce, reduction, log_target)
        self.log_input = log_input

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target,
                      log_input=self.log_input)


# ----------------------------------------------------------------------------------
# Mean squared error.

def mse_loss(input: torch.Tensor, target: torch.Tensor, size_average=None, reduce=None, reduction: str = "mean",
             weight: torch.Tensor | None = None) -> torch.Tensor:
    """F.mse_loss(input, target, ...). `weight` (torch 2.6+) runs torch's implementation."""
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction, ("none", "mean", "sum"))
    _check_same_device(input, target, weight)
    why_not = "weight is not fused yet" if weight is not None else _pointwise_fusable(input, target)
    if why_not is None:
        if input.shape != target.shape:  # torch's warning, word for word
            warnings.warn(f"Using a target size ({target.size()}) that is different to the input size "
                          f"({input.size()}). This will likely lead to incorrect results due to broadcasting. "
                          "Please ensure they have the same size.", stacklevel=2)
        user_operands = (input, target)
        input, target = _pointwise_operands(input, target)
        scale = 1.0 / input.numel() if reduction == "mean" else 1.0
        return _pointwise_loss("mse", input, target, reduction, scale, (), user_operands)
    _check_fallback_allowed("mse_loss", why_not, input)
    if weight is not None:
        return F.mse_loss(input, target, reduction=reduction, weight=weight)
    return F.mse_loss(input, target, reduction=reduction)


class MSELoss(nn.MSELoss):
    """nn.MSELoss on the fused kernel."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse_loss(input, target, reduction=self.reduction)


# ----------------------------------------------------------------------------------
# Cross-entropy.

class _CrossEntropyFunction(torch.autograd.Function):
    """(N, C) logits; target (N,) class indices or (N, C) probabilities. Returns the loss;
    with want_lse a tuple, (loss, lse)."""

    @staticmethod
    def forward(ctx, logits, target, weight, options):
        ignore_index, reduction, float_loss, label_smoothing, z_loss, want_grad_logits, want_grad_target, want_lse = options
        loss, grad_logits, grad_target, lse = _ops("cross_entropy", logits).forward(
            logits, target, weight, ignore_index, REDUCTION_CODES[reduction], float_loss, label_smoothing, z_loss,
            want_grad_logits, want_grad_target, want_lse, False)
        ctx.kernel, ctx.reduction = "cross_entropy", reduction
        ctx.arguments = (ignore_index, label_smoothing, z_loss)
        ctx.want_grads = (want_grad_logits, want_grad_target)
        if reduction == "none":
            ctx.save_for_backward(logits, target, weight)
        else:
            ctx.save_for_backward(grad_logits if want_grad_logits else None,
                                  grad_target if want_grad_target else None)
        # Only the loss has a gradient: autograd need not make zeros for the others.
        ctx.set_materialize_grads(False)
        outputs = (loss,)
        if want_lse:
            ctx.mark_non_differentiable(lse)
            outputs += (lse,)
        return outputs if len(outputs) > 1 else loss

    @staticmethod
    def backward(ctx, grad_output, *unused_grads):
        if grad_output is None:  # the loss was not used
            return None, None, None, None
        if ctx.reduction == "none" and _create_graph():
            logits, target, weight = ctx.saved_tensors
            formula = _cross_entropy_formula(weight, ctx.arguments[0], "none", False, *ctx.arguments[1:])
            return (*_gradient_graph(formula, (logits, target), ctx.want_grads, grad_output), None, None)
        if ctx.reduction == "none":
            logits, target, weight = ctx.saved_tensors
            grad_logits, grad_target = _ops(ctx.kernel, logits).backward(
                logits, target, weight, *ctx.arguments, grad_output.contiguous(), *ctx.want_grads)
            grad_logits = grad_logits if ctx.want_grads[0] else None
            grad_target = grad_target if ctx.want_grads[1] else None
        else:
            grad_logits, grad_target = _backward_from_saved_grads(ctx, grad_output)
        return grad_logits, grad_target, None, None


class _SoftcapCrossEntropyFunction(torch.autograd.Function):
    """Class-index cross-entropy of capped logits by the row passes (linear_ce.py) over whole
    rows: (rows, C) logits, (rows,) targets. Returns (loss, lse) in the accumulation type;
    the gradient is written in backward, from the saved logits and lse."""

    @staticmethod
    def forward(ctx, logits, target, arguments):
        ignore_index, label_smoothing, z_loss, softcap, reduction = arguments
        stats = linear_ce.logits_stats(logits, target, 0, softcap)
        loss, softmax_stats, count = linear_ce.finish_loss(stats, target, ignore_index, logits.shape[1],
                                                           label_smoothing, z_loss)
        ctx.arguments = arguments
        return linear_ce.forward_outputs(ctx, linear_ce.reduce_loss(loss, count, reduction), softmax_stats,
                                         (logits, target, softmax_stats, count))

    @staticmethod
    def backward(ctx, grad_output, _):
        if grad_output is None:
            return None, None, None
        linear_ce.no_second_derivative("cross_entropy with softcap")
        logits, target, softmax_stats, count = ctx.saved_tensors
        ignore_index, label_smoothing, z_loss, softcap, reduction = ctx.arguments
        return linear_ce.logits_gradient(logits, target, 0, logits.shape[1], softmax_stats, count, grad_output,
                                         ignore_index, reduction, label_smoothing, z_loss, softcap), None, None


def _cross_entropy_rows(input: torch.Tensor, target: torch.Tensor, probs: bool):
    """The kernel takes rows of classes: (C) -> (1, C); (N, C, d...) -> (N * d..., C), and
    probabilities alike. The movedim copy is autograd-tracked, so the gradient flows back to
    the original layout."""
    dim = input.dim()
    if dim == 2:
        return input, target
    if dim == 1:
        return input.unsqueeze(0), (target.unsqueeze(0) if probs else target.reshape(1))
    logits = input.movedim(1, -1).reshape(-1, input.shape[1])
    return logits, (target.movedim(1, -1).reshape(-1, input.shape[1]) if probs else target.reshape(-1))


def _cross_entropy_formula(weight, ignore_index, reduction, float_loss, label_smoothing, z_loss):
    """The loss by torch's formula (plus the z-loss), as the kernel computes it from its rows."""
    def formula(logits, target):
        w = weight
        if float_loss:
            logits, w = logits.float(), None if weight is None else weight.float()
            target = target.float() if target.is_floating_point() else target
        return _torch_cross_entropy(logits, target, w, ignore_index, reduction, label_smoothing, z_loss, False)
    return formula


def _cross_entropy_gradient_graph(options, input, target, grad_output):
    """For the eager node under create_graph=True, as _pointwise_gradient_graph: options
    holds the (C,) weight, no other tensor."""
    weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, dtypes, wants = options
    probs = target.is_floating_point()
    operands = _cross_entropy_rows(input.to(dtypes[0]), target.to(dtypes[1]) if probs else target, probs)
    formula = _cross_entropy_formula(weight, ignore_index, reduction, float_loss, label_smoothing, z_loss)
    return _gradient_graph(formula, operands, wants, grad_output)


def _check_inplace_backward(input: torch.Tensor, reduction: str) -> None:
    if reduction == "none":
        raise ValueError("inplace_backward=True needs reduction 'mean' or 'sum' (the gradient of 'none' is "
                         "computed in backward)")
    if any(tensor is not None and tensor.is_leaf and tensor.requires_grad for tensor in (input, input._base)):
        raise ValueError("inplace_backward=True overwrites input with its gradient, which a leaf tensor that "
                         "requires grad (or a view of one) does not allow; pass the logits from the model "
                         "(a non-leaf tensor)")


def _mark_overwritten(tensor: torch.Tensor) -> None:
    """Tells autograd that a kernel wrote over tensor's memory: its version counter (shared
    with its views and base) goes up, so backward raises where an op saved the old values.
    torch 2.0 has no increment_version; an in-place op on no elements bumps the counter
    too, and moves no data."""
    if hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(tensor)
    else:
        with torch.no_grad():
            tensor.view(-1)[:0].zero_()


def _check_cross_entropy_arguments(input, target, weight, ignore_index, label_smoothing, z_loss) -> None:
    """torch's rules for these arguments, as ValueErrors that name the argument."""
    dim, shape = input.dim(), input.shape
    if dim == 0:
        raise ValueError("input must have at least 1 dimension (the classes), got a 0-dim tensor")
    num_classes = shape[1] if dim > 1 else shape[0]
    if target.is_floating_point():
        if target.shape != shape:
            raise ValueError(f"target of class probabilities must have input's shape {tuple(shape)}, "
                             f"got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError("ignore_index is not supported for floating point target (class probabilities)")
    # Class indices: (N) for (N, C), the usual case, checked cheaply first.
    elif not (dim == 2 and target.dim() == 1 and target.shape[0] == shape[0]):
        expected = (shape[0],) + tuple(shape[2:]) if dim >= 2 else ()
        if tuple(target.shape) != expected:
            raise ValueError(f"target must have shape {expected} for input of shape {tuple(shape)} "
                             f"(class dim 1), got {tuple(target.shape)}")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != num_classes):
        raise ValueError(f"weight must have shape ({num_classes},), one value per class, got {tuple(weight.shape)}")
    _check_smoothing_and_z_loss(label_smoothing, z_loss)


def _check_softcap(softcap) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")


def _check_smoothing_and_z_loss(label_smoothing: float, z_loss: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def _cross_entropy_fusable(input, target, weight) -> str | None:
    if not input.is_cuda:
        return "CPU tensors"
    if _in_forward_ad():
        return "forward-mode AD (dual tensors)"
    if input.dtype not in FUSED_DTYPES:
        return f"dtype {input.dtype} has no kernel"
    if target.is_floating_point():
        if target.dtype != input.dtype:
            return f"class probabilities of dtype {target.dtype} for input of dtype {input.dtype}"
    elif target.dtype not in (torch.int64, torch.int32):
        return f"target of dtype {target.dtype} (class indices must be int64 or int32 to be fused)"
    if weight is not None and weight.dtype != input.dtype:
        return f"weight of dtype {weight.dtype} for input of dtype {input.dtype}"
    if input.numel() == 0:
        return "empty tensors"
    return None


def _torch_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, return_lse,
                         softcap=None):
    """torch's F.cross_entropy, plus the z-loss, lse and softcap that the kernels add (their
    definitions, in torch ops)."""
    if softcap is not None:
        input = softcap * torch.tanh(input / softcap)
    if target.dtype == torch.int32:  # the kernels take int32 class indices; torch's loss takes int64
        target = target.long()
    loss = F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if not (z_loss or return_lse):
        return loss
    class_dim = 1 if input.dim() > 1 else 0
    lse = torch.logsumexp(input.to(_accumulation_dtype(input.dtype)), class_dim)
    if z_loss:
        counted = torch.ones_like(lse) if target.is_floating_point() else (target != ignore_index).to(lse.dtype)
        z = z_loss * lse.square() * counted
        if reduction == "mean":  # no row counted: the ce term is NaN already; z adds 0 (and no NaN gradient)
            z = z.sum() / counted.sum().clamp_min(1)
        elif reduction == "sum":
            z = z.sum()
        loss = loss + z.to(loss.dtype)
    return (loss, lse.detach()) if return_lse else loss


def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average=None, ignore_index: int = -100, reduce=None, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float | None = None,
                  return_lse: bool = False, inplace_backward: bool = False, process_group=None,
                  vocab_start: int | None = None):
    """F.cross_entropy(input, target, ...), fused, plus options of our own.

    Input (C), (N, C) or (N, C, d1, ...), classes in dim 1 as in torch. target: class
    indices (int64 or int32; shape (), (N) or (N, d1, ...)) or class probabilities
    (input's shape and dtype). weight, ignore_index, label_smoothing and every
    reduction are fused. A class index outside [0, C) (other than ignore_index) gives
    NaN for its row where torch would stop with a device-side assert.

    z_loss: adds z_loss * lse^2 per counted row (lse = logsumexp over the classes),
        reduced like the loss ('mean' divides by the number of non-ignored rows).
    softcap: the logits become softcap * tanh(logits / softcap) first (Gemma 2), the lse
        and z-loss those of the capped logits. Class-index targets without weight run two
        passes over the logits (chunked_cross_entropy.cu: stats, then the gradient in
        backward); with weight or probabilities, torch ops. Not with inplace_backward.
    return_lse: also return the per-row lse, float32 (float64 for float64 input), in
        target's shape for class indices: (loss, lse). It carries no gradient.
    inplace_backward: with grad and a scalar reduction, the gradient is written over
        input's memory (no extra memory for it); input holds the gradient afterwards,
        and autograd raises if anything still needs its old values. input may be a view
        (logits.view(-1, C)) but not a leaf tensor that requires grad, nor a view of one.
        On CPU this option changes nothing.
    process_group: a torch.distributed group among which the classes are split
        (vocab_parallel.py): input and weight hold this rank's contiguous shard of the
        classes, probability targets too; class-index targets are global ids. The
        shard's first class is vocab_start, by default rank * (its number of classes).
        The loss equals cross_entropy of the gathered logits, and the gradient is this
        shard's part of it. Not with inplace_backward.
    """
    reduction = _legacy_reduction(size_average, reduce, reduction)
    _check_reduction(reduction, ("none", "mean", "sum"))
    _check_same_device(input, target, weight)
    _check_cross_entropy_arguments(input, target, weight, ignore_index, label_smoothing, z_loss)
    _check_softcap(softcap)
    if inplace_backward:
        if process_group is not None or softcap is not None:
            raise ValueError("inplace_backward is not supported with process_group or softcap")
        _check_inplace_backward(input, reduction)
    user_operands = (input, target)
    (input, target, weight), float_loss = _autocast_operands(reduction, input, target, weight)
    if process_group is not None:
        if input.is_cuda and not vocab_parallel.uses_row_passes(target, weight):
            _check_fallback_allowed("cross_entropy", "process_group with class weights or probabilities runs torch "
                                    "ops", input)
        why_not = None
    else:
        why_not = _cross_entropy_fusable(input, target, weight)
        if why_not is None and softcap is not None and (target.is_floating_point() or weight is not None):
            why_not = "softcap with class weights or probabilities (its kernels take class indices alone)"
    if why_not is not None:
        _check_fallback_allowed("cross_entropy", why_not, input)
        return _torch_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                    return_lse, softcap)
    probs = target.is_floating_point()
    dim = input.dim()
    logits, rows_target = _cross_entropy_rows(input, target, probs)
    want_grad_logits, want_grad_target = _wants_grad(input), probs and _wants_grad(target)
    want_grads = want_grad_logits or want_grad_target
    arguments = (int(ignore_index), reduction, float_loss, float(label_smoothing), float(z_loss))
    if process_group is not None:
        loss, lse = vocab_parallel.cross_entropy_rows(logits, rows_target, weight, *arguments, softcap, process_group,
                                                      vocab_start)
    elif softcap is not None:
        loss, lse = _SoftcapCrossEntropyFunction.apply(
            logits.contiguous(), rows_target.contiguous(),
            (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap), reduction))
        loss = loss.to(torch.float32 if float_loss else input.dtype)  # outside: see LinearCrossEntropyFunction
    elif _use_python_function(want_grads, reduction):
        outputs = _CrossEntropyFunction.apply(logits, rows_target, weight,
                                              (*arguments, want_grad_logits, want_grad_target, return_lse))
        loss, lse = outputs if return_lse else (outputs, None)
    else:
        # No grad, or eager training (a compiled graph takes the Function above, where
        # graphs are functional and inplace_backward does nothing).
        inplace = inplace_backward and want_grad_logits
        if inplace and not logits.is_contiguous():
            logits = logits.contiguous()
        ops = _ops("cross_entropy", logits)
        loss, grad_logits, grad_target, lse = ops.forward(
            logits, rows_target, weight, arguments[0], REDUCTION_CODES[reduction], *arguments[2:], want_grad_logits,
            want_grad_target, return_lse, inplace)
        if inplace:
            _mark_overwritten(logits)
        if want_grads:
            differentiable = None if inplace else (_cross_entropy_gradient_graph, (
                weight, *arguments, (input.dtype, target.dtype), (want_grad_logits, want_grad_target)))
            loss = ops.attach_saved_gradients(loss, logits, grad_logits, rows_target, grad_target, *user_operands,
                                              differentiable)
    if dim == 1 and reduction == "mean" and not probs and not label_smoothing and logits.is_cuda:
        # torch's CUDA loss of one unbatched, ignored target is 0 (its 1-D kernel), not 0 / 0.
        loss = loss.masked_fill(rows_target[0] == ignore_index, 0)
    if dim == 2 or not (reduction == "none" or return_lse):
        return (loss, lse) if return_lse else loss
    row_shape = input.shape[:1] + input.shape[2:] if dim > 1 else torch.Size()
    if reduction == "none":
        loss = loss.reshape(row_shape)
    return (loss, lse.reshape(row_shape)) if return_lse else loss


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss on the fused kernel; takes cross_entropy's z_loss, softcap,
    return_lse, inplace_backward, process_group and vocab_start as keyword arguments too."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float | None = None, return_lse: bool = False, inplace_backward: bool = False,
                 process_group=None, vocab_start: int | None = None) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss, self.softcap, self.return_lse, self.inplace_backward = z_loss, softcap, return_lse, inplace_backward
        self.process_group, self.vocab_start = process_group, vocab_start

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                             softcap=self.softcap, return_lse=self.return_lse, inplace_backward=self.inplace_backward,
                             process_group=self.process_group, vocab_start=self.vocab_start)


# ----------------------------------------------------------------------------------
# Linear + cross-entropy (linear_ce.py): the logits never exist whole.

def _check_linear_cross_entropy_arguments(input, weight, target, bias, ignore_index, label_smoothing, z_loss,
                                          softcap) -> None:
    """Every argument checked before any work, as ValueErrors that name it."""
    if input.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"input must be (..., H) and weight (V, H); got input {tuple(input.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if input.shape[-1] != weight.shape[1]:
        raise ValueError(f"input's last dimension H = {input.shape[-1]} differs from weight's "
                         f"(V, H) = {tuple(weight.shape)}")
    _check_same_device(input, target, weight)
    if bias is not None and bias.device != input.device:
        raise _device_error("bias", bias, input)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != input.dtype and not _under_autocast(input):
            raise ValueError(f"{name} has dtype {tensor.dtype}, input {input.dtype}: they must match (outside "
                             f"autocast, as F.linear requires)")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), one value per class, got {tuple(bias.shape)}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target must have input's leading shape {tuple(input.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target must hold class indices as int64 or int32, got {target.dtype}")
    _check_smoothing_and_z_loss(label_smoothing, z_loss)
    _check_softcap(softcap)


def linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                         return_lse: bool = False, process_group=None, vocab_start: int | None = None):
    """F.cross_entropy(F.linear(input, weight, bias), target, ...) without the (N, V) logits in
    memory: a chunk of the vocabulary at a time (linear_ce.py), the logits computed again in
    backward.

    input (..., H), weight (V, H), bias (V,), target: class indices (int64 or int32) of shape
    input.shape[:-1]. softcap: the logits become softcap * tanh(logits / softcap) first (Gemma 2).
    z_loss and return_lse as in cross_entropy (lse in target's shape, float32). Under CUDA
    autocast the linear runs in autocast's dtype and the loss is float32, as torch's.
    process_group: weight and bias hold this rank's contiguous rows of the output layer, its
    shard of the classes (first class vocab_start, by default rank * V_r), as cross_entropy's;
    input is the same on every rank and target holds global class ids. The loss equals the
    unsharded one; weight's and bias's gradients are this shard's; input's is summed over the
    group (one more all-reduce, of N x H, in backward), the full gradient on every rank.
    """
    _check_reduction(reduction, ("none", "mean", "sum"))
    _check_linear_cross_entropy_arguments(input, weight, target, bias, ignore_index, label_smoothing, z_loss,
                                          softcap)
    float_loss = False
    if _under_autocast(input):  # F.linear in autocast's dtype, the loss in float32
        dtype = torch.get_autocast_dtype("cuda") if hasattr(torch, "get_autocast_dtype") else torch.get_autocast_gpu_dtype()
        input, weight = input.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        float_loss = True
    with torch.autocast(input.device.type, enabled=False):
        options = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0), reduction)
        rows, rows_target = input.reshape(-1, input.shape[-1]), target.reshape(-1).contiguous()
        if process_group is None:
            loss, lse = linear_ce.LinearCrossEntropyFunction.apply(rows, weight, bias, rows_target, options)
        else:
            loss, lse = vocab_parallel.linear_cross_entropy_rows(rows, weight, bias, rows_target, options[0], reduction,
                                                                 *options[1:4], process_group, vocab_start)
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
