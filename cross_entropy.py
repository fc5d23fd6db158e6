"""Cross-entropy: F.cross_entropy fused (kernels/cross_entropy.cu), plus z-loss, the lse,
in-place backward, softcap and a vocabulary split over a process group.

One stack, top to bottom: cross_entropy() checks its arguments and picks one path
(choose_path), then
- "fused": kernels/cross_entropy.cu, eagerly with the C++ autograd node, or through
  _CrossEntropyFunction (reduction 'none', torch.compile);
- "row_passes": softcap with class indices, on the row-pass engine (row_passes.py);
- "process_group": a vocabulary shard (vocab_parallel.py, on the same engine where it can);
- "torch": torch's own F.cross_entropy (reference_cross_entropy): CPU tensors, and what no
  kernel takes (FUSED_LOSSES_STRICT=1 makes that raise on CUDA).
linear_cross_entropy.py builds on this module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

if __package__:
    from . import loss_helpers as helpers
    from . import op_signatures, row_passes, vocab_parallel
else:
    import loss_helpers as helpers
    import op_signatures
    import row_passes
    import vocab_parallel

REDUCTION_CODES = helpers.REDUCTION_CODES


# ----------------------------------------------------------------------------------
# The kernels' ops under torch.compile.

_FORWARD_ARGUMENTS = op_signatures.argument_names("cross_entropy", "forward")


def _forward_fake(*args):
    named = dict(zip(_FORWARD_ARGUMENTS, args))
    logits = named["logits"]
    scalar_loss = named["reduction"] != REDUCTION_CODES["none"]
    rows = logits.shape[0]
    loss_dtype = torch.float32 if named["float_loss"] else logits.dtype
    loss = logits.new_empty(() if scalar_loss else (rows,), dtype=loss_dtype)
    grad_logits = logits.new_empty(logits.shape if scalar_loss and named["want_grad_logits"] else (0,))
    grad_target = logits.new_empty(logits.shape if scalar_loss and named["want_grad_target"] else (0,))
    lse = logits.new_empty((rows,) if named["want_lse"] else (0,), dtype=helpers.accumulation_dtype(logits.dtype))
    return loss, grad_logits, grad_target, lse


def _backward_fake(logits, target, weight, ignore_index, label_smoothing, z_loss, temperature, grad_output,
                   want_grad_logits, want_grad_target):
    return (logits.new_empty(logits.shape if want_grad_logits else (0,)),
            logits.new_empty(logits.shape if want_grad_target else (0,)))


_COMPILE_LIBRARY = helpers.define_compile_ops("cross_entropy", {
    "forward": _forward_fake, "backward": _backward_fake, "recompute_gradients_": helpers.no_outputs_fake,
    "scale_by_grad_output_": helpers.no_outputs_fake})


# ----------------------------------------------------------------------------------
# Autograd.

class _CrossEntropyFunction(torch.autograd.Function):
    """(N, C) logits; target (N,) class indices or (N, C) probabilities. Returns the loss;
    with want_lse a tuple, (loss, lse)."""

    @staticmethod
    def forward(ctx, logits, target, weight, options):
        (ignore_index, reduction, float_loss, label_smoothing, z_loss, temperature, want_grad_logits, want_grad_target,
         want_lse) = options
        # Not inplace; no guess at grad_output (see loss_helpers).
        loss, grad_logits, grad_target, lse = helpers.kernel_ops("cross_entropy", logits).forward(
            logits, target, weight, ignore_index, REDUCTION_CODES[reduction], float_loss, label_smoothing, z_loss,
            temperature, want_grad_logits, want_grad_target, want_lse, False, False)
        ctx.kernel, ctx.reduction = "cross_entropy", reduction
        ctx.arguments = (ignore_index, label_smoothing, z_loss, temperature)
        ctx.want_grads = (want_grad_logits, want_grad_target)
        ctx.recompute = None
        if reduction == "none":
            ctx.save_for_backward(logits, target, weight)
        else:
            kept = (logits, target, weight) if helpers.keeps_operands(float_loss) else ()
            ctx.recompute = ((_recompute_arguments(ignore_index, reduction, label_smoothing, z_loss, temperature), ())
                             if kept else None)
            ctx.save_for_backward(grad_logits if want_grad_logits else None,
                                  grad_target if want_grad_target else None, *kept)
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
        if ctx.reduction == "none" and helpers.create_graph():
            logits, target, weight = ctx.saved_tensors
            formula = _formula(weight, ctx.arguments[0], "none", False, *ctx.arguments[1:])
            return (*helpers.gradient_graph(formula, (logits, target), ctx.want_grads, grad_output), None, None)
        if ctx.reduction == "none":
            logits, target, weight = ctx.saved_tensors
            grad_logits, grad_target = helpers.kernel_ops(ctx.kernel, logits).backward(
                logits, target, weight, *ctx.arguments, grad_output.contiguous(), *ctx.want_grads)
            grad_logits = grad_logits if ctx.want_grads[0] else None
            grad_target = grad_target if ctx.want_grads[1] else None
        else:
            grad_logits, grad_target = helpers.backward_from_saved_grads(ctx, grad_output)
        return grad_logits, grad_target, None, None


def _recompute_arguments(ignore_index, reduction, label_smoothing, z_loss, temperature):
    """recompute_gradients_'s arguments between the operands and grad_output."""
    return ignore_index, REDUCTION_CODES[reduction], label_smoothing, z_loss, temperature


def _rows(input: torch.Tensor, target: torch.Tensor, probs: bool):
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


def _formula(weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, temperature):
    """The loss by torch's formula (plus the z-loss), as the kernel computes it from its rows."""
    def formula(logits, target):
        w = weight
        if float_loss:
            logits, w = logits.float(), None if weight is None else weight.float()
            target = target.float() if target.is_floating_point() else target
        return reference_cross_entropy(logits, target, w, ignore_index, reduction, label_smoothing, z_loss, False,
                                       temperature=temperature)
    return formula


def _gradient_graph(options, input, target, grad_output):
    """For the eager node under create_graph=True, as pointwise_loss's: options holds the
    (C,) weight, no other tensor."""
    weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, temperature, dtypes, wants = options
    probs = target.is_floating_point()
    operands = _rows(input.to(dtypes[0]), target.to(dtypes[1]) if probs else target, probs)
    formula = _formula(weight, ignore_index, reduction, float_loss, label_smoothing, z_loss, temperature)
    return helpers.gradient_graph(formula, operands, wants, grad_output)


def _check_inplace_backward(input: torch.Tensor, reduction: str) -> None:
    if reduction == "none":
        raise ValueError("inplace_backward=True needs reduction 'mean' or 'sum' (the gradient of 'none' is "
                         "computed in backward)")
    if any(tensor is not None and tensor.is_leaf and tensor.requires_grad for tensor in (input, input._base)):
        raise ValueError("inplace_backward=True overwrites input with its gradient, which a leaf tensor that "
                         "requires grad (or a view of one) does not allow; pass the logits from the model "
                         "(a non-leaf tensor)")


def _check_arguments(input, target, weight, ignore_index, label_smoothing, z_loss) -> None:
    """torch's rules for these arguments, as ArgumentErrors (torch raises RuntimeError) that name
    the argument."""
    dim, shape = input.dim(), input.shape
    if dim == 0:
        raise helpers.ArgumentError("input must have at least 1 dimension (the classes), got a 0-dim tensor")
    num_classes = shape[1] if dim > 1 else shape[0]
    if target.shape == shape:  # class probabilities: torch tells them apart by shape alone
        if not target.is_floating_point():
            raise helpers.ArgumentError(f"target of input's shape {tuple(shape)} holds class probabilities, which "
                                        f"must be floating point, got {target.dtype}")
        if ignore_index != -100:
            raise helpers.ArgumentError("ignore_index is not supported for floating point target (class "
                                        "probabilities)")
    else:
        # Class indices: (N) for (N, C), the usual case, checked cheaply first.
        if not (dim == 2 and target.dim() == 1 and target.shape[0] == shape[0]):
            expected = (shape[0],) + tuple(shape[2:]) if dim >= 2 else ()
            if tuple(target.shape) != expected:
                raise helpers.ArgumentError(f"target must have shape {expected} for input of shape {tuple(shape)} "
                                            f"(class dim 1), or input's shape for class probabilities, got "
                                            f"{tuple(target.shape)}")
        if target.is_floating_point():  # torch: "expected target dtype to be Long"
            raise helpers.ArgumentError(f"target of shape {tuple(target.shape)} holds class indices, which must be "
                                        f"int64, int32 or uint8, got {target.dtype} (class probabilities take "
                                        f"input's shape {tuple(shape)})")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != num_classes):
        raise helpers.ArgumentError(f"weight must have shape ({num_classes},), one value per class, got "
                                    f"{tuple(weight.shape)}")
    check_smoothing_and_z_loss(label_smoothing, z_loss)


def check_softcap(softcap) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")


def check_smoothing_and_z_loss(label_smoothing: float, z_loss: float) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise helpers.ArgumentError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def choose_path(input, target, weight, softcap=None, process_group=None) -> tuple[str, str | None]:
    """The one choice among cross_entropy's paths (the module's docstring): (path, why the
    kernels do not take the call, for "torch"; else None)."""
    if process_group is not None:
        return "process_group", None
    why_not = _fusable(input, target, weight)
    if why_not is None and softcap is not None:  # with a temperature too: the row passes take both
        if row_passes.uses_kernels(target, weight):
            return "row_passes", None
        why_not = "softcap with class weights or probabilities (their kernels take class indices alone)"
    return ("fused", None) if why_not is None else ("torch", why_not)


def _fusable(input, target, weight) -> str | None:
    why_not = helpers.unfusable_reason(input)
    if why_not is not None:
        return why_not
    if input.dtype not in helpers.FUSED_DTYPES:
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


def reference_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, return_lse,
                            softcap=None, temperature=1.0):
    """torch's F.cross_entropy, plus the z-loss, lse, softcap and temperature that the kernels add
    (their definitions, in torch ops)."""
    if softcap is not None:
        input = softcap * torch.tanh(input / softcap)
    if temperature != 1.0:
        input = input / temperature
    if target.dtype == torch.int32:  # the kernels take int32 class indices; torch's loss takes int64
        target = target.long()
    loss = F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if not (z_loss or return_lse):
        return loss
    class_dim = 1 if input.dim() > 1 else 0
    lse = torch.logsumexp(input.to(helpers.accumulation_dtype(input.dtype)), class_dim)
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
                  vocab_start: int | None = None, temperature: float = 1.0):
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
        passes over the logits (the row-pass engine: stats, then the gradient in
        backward); with weight or probabilities, torch ops. Not with inplace_backward.
    temperature: the logits (capped where softcap is given) are divided by it, a float > 0;
        the loss, lse, z-loss and smoothing are those of the divided logits, and the gradient
        carries 1 / temperature. The fused kernels take it; with softcap the row passes, which take
        class indices without weight (else torch's ops, or with process_group an error).
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
    try:
        reduction = helpers.legacy_reduction(size_average, reduce, reduction)
        helpers.check_reduction(reduction, ("none", "mean", "sum"))
        helpers.check_tensors("cross_entropy", input, target, weight)
        _check_arguments(input, target, weight, ignore_index, label_smoothing, z_loss)
        check_softcap(softcap)
        check_temperature(temperature)
        if inplace_backward:
            if process_group is not None or softcap is not None:
                raise ValueError("inplace_backward is not supported with process_group or softcap")
            _check_inplace_backward(input, reduction)
        if (process_group is not None and (softcap is not None or temperature != 1.0)
                and not row_passes.uses_kernels(target, weight)):
            raise ValueError("cross_entropy: softcap or temperature with process_group takes class-index targets "
                             "without weight")
    except ValueError as error:  # with process_group: raised on every rank
        vocab_parallel.raise_on_every_rank(process_group, input, error)
    user_operands = (input, target)
    (input, target, weight), float_loss = helpers.autocast_operands(reduction, input, target, weight)
    path, why_not = choose_path(input, target, weight, softcap, process_group)
    if path == "torch":
        helpers.check_fallback_allowed("cross_entropy", why_not, input)
        return reference_cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                                       return_lse, softcap, float(temperature))
    if path == "process_group" and input.is_cuda and not row_passes.uses_kernels(target, weight):
        helpers.check_fallback_allowed("cross_entropy", "process_group with class weights or probabilities runs "
                                       "torch ops", input)
    probs = target.is_floating_point()
    dim = input.dim()
    logits, rows_target = _rows(input, target, probs)
    want_grad_logits, want_grad_target = helpers.wants_grad(input), probs and helpers.wants_grad(target)
    want_grads = want_grad_logits or want_grad_target
    arguments = (int(ignore_index), reduction, float_loss, float(label_smoothing), float(z_loss), float(temperature))
    if path == "process_group":
        loss, lse = vocab_parallel.cross_entropy_rows(logits, rows_target, weight, *arguments, softcap, process_group,
                                                      vocab_start)
    elif path == "row_passes":
        loss, lse = row_passes.RowPassCrossEntropy.apply(
            logits.contiguous(), rows_target.contiguous(), None,
            (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0), reduction, None,
             float(temperature)))
        # Cast outside the Function: see linear_cross_entropy.LinearCrossEntropyFunction.
        loss = loss.to(torch.float32 if float_loss else input.dtype)
    elif helpers.use_python_function(want_grads, reduction):
        outputs = _CrossEntropyFunction.apply(logits, rows_target, weight,
                                              (*arguments, want_grad_logits, want_grad_target, return_lse))
        loss, lse = outputs if return_lse else (outputs, None)
    else:
        # No grad, or eager training (a compiled graph takes the Function above, where
        # graphs are functional and inplace_backward does nothing).
        inplace = inplace_backward and want_grad_logits
        if inplace and not logits.is_contiguous():
            logits = logits.contiguous()
        ops = helpers.kernel_ops("cross_entropy", logits)
        loss, grad_logits, grad_target, lse = ops.forward(
            logits, rows_target, weight, arguments[0], REDUCTION_CODES[reduction], *arguments[2:], want_grad_logits,
            want_grad_target, return_lse, inplace, want_grads)  # guess_grad_output: the C++ node's path
        if inplace:
            helpers.mark_overwritten(logits)
        if want_grads:
            differentiable = None if inplace else (_gradient_graph, (
                weight, *arguments, (input.dtype, target.dtype), (want_grad_logits, want_grad_target)))
            # inplace: the logits are the gradient now; it is scaled, not recomputed.
            recompute = (helpers.recompute_for_node(ops.recompute_gradients_, (logits, rows_target, weight),
                                                    _recompute_arguments(arguments[0], reduction, *arguments[3:]))
                         if helpers.keeps_operands(float_loss) and not inplace else None)
            loss = ops.attach_saved_gradients(loss, logits, grad_logits, rows_target, grad_target, *user_operands,
                                              differentiable, recompute)
    if dim == 1 and reduction == "mean" and not probs and not label_smoothing and logits.is_cuda:
        # torch's CUDA loss of one unbatched, ignored target is 0 (its 1-D kernel), not 0 / 0.
        loss = loss.masked_fill(rows_target[0] == ignore_index, 0)
    if dim == 2 or not (reduction == "none" or return_lse):
        return (loss, lse) if return_lse else loss
    row_shape = input.shape[:1] + input.shape[2:] if dim > 1 else torch.Size()
    if reduction == "none":
        loss = loss.reshape(row_shape)
    return (loss, lse.reshape(row_shape)) if return_lse else loss


def check_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a float > 0, got {temperature!r}")


def check_class_indices(function: str, target) -> None:
    """The log-probs' targets: class indices, int64 or int32."""
    if target.is_floating_point() or target.dtype not in (torch.int64, torch.int32):
        raise helpers.ArgumentError(f"{function}: target must hold class indices, int64 or int32, got {target.dtype}")


def log_probs(logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0, softcap: float = 0.0,
              ignore_index: int = -100, return_entropy: bool = False, process_group=None,
              vocab_start: int | None = None):
    """log p(target) of each row of logits (..., C), classes last, at a temperature: with
    u = softcap(logits) / temperature, u_t - logsumexp(u), in target's shape (...), float32
    (float64 for float64 logits); 0 where target == ignore_index, NaN for a class outside [0, C).
    For RL post-training (GRPO, PPO): the sampled tokens' log-probabilities without a
    log_softmax of the whole logits.

    return_entropy: also the softmax's entropy of each row, log sum exp(u - max) -
        sum_c p_c (u_c - max) (relative to the row's max: no cancellation on a peaked row),
        same shape and dtype, 0 at ignored rows: (log_probs, entropy). Both are
        differentiable; the entropy's gradient is p_c (sum_k p_k u_k - u_c) / temperature.
    softcap: 0 (none) or > 0: softcap * tanh(logits / softcap) before the temperature.
    process_group, vocab_start: logits hold this rank's shard of the classes, as in
        cross_entropy; target holds global class ids.
    Runs the row-pass engine (two passes over the logits, no (rows, C) float32 copy)."""
    try:
        helpers.check_tensors("log_probs", logits, target)
        check_temperature(temperature)
        if softcap is None:
            softcap = 0.0
        if softcap != 0.0:
            check_softcap(softcap)
        if logits.dim() < 1 or not logits.is_floating_point():
            raise helpers.ArgumentError(f"log_probs: logits must be floating point with classes in the last dim, "
                                        f"got {logits.dtype} of shape {tuple(logits.shape)}")
        check_class_indices("log_probs", target)
        if target.shape != logits.shape[:-1]:
            raise helpers.ArgumentError(f"log_probs: target's shape {tuple(target.shape)} must be logits' without "
                                        f"its last dim, {tuple(logits.shape[:-1])}")
    except ValueError as error:  # with process_group: raised on every rank
        vocab_parallel.raise_on_every_rank(process_group, logits, error)
    rows = logits.reshape(-1, logits.shape[-1]).contiguous()
    rows_target = target.reshape(-1).contiguous()
    shards = None if process_group is None else vocab_parallel.Shards(process_group, rows.shape[1], vocab_start, rows)
    values, entropy = row_passes.RowPassLogProbs.apply(
        rows, rows_target, (int(ignore_index), float(softcap), float(temperature), bool(return_entropy), shards))
    if shards is not None:
        shards.raise_if_invalid()
    values = values.reshape(target.shape)
    return (values, entropy.reshape(target.shape)) if return_entropy else values


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """nn.CrossEntropyLoss on the fused kernel; takes cross_entropy's z_loss, softcap,
    return_lse, inplace_backward, process_group, vocab_start and temperature as keyword
    arguments too."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                 softcap: float | None = None, return_lse: bool = False, inplace_backward: bool = False,
                 process_group=None, vocab_start: int | None = None, temperature: float = 1.0) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        check_temperature(temperature)
        self.z_loss, self.softcap, self.return_lse, self.inplace_backward = z_loss, softcap, return_lse, inplace_backward
        self.process_group, self.vocab_start, self.temperature = process_group, vocab_start, temperature

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                             softcap=self.softcap, return_lse=self.return_lse, inplace_backward=self.inplace_backward,
                             process_group=self.process_group, vocab_start=self.vocab_start,
                             temperature=self.temperature)


