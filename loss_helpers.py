"""What every loss module shares: argument checks, when torch's implementation runs instead
of the kernels, autocast, the ops of a build (eagerly, or under torch.compile as custom ops
declared in op_signatures.py), and the autograd helpers of a loss whose forward wrote its
gradients.

The grad_output guess (kernels/grad_output_guess.cuh has the protocol) is decided here, in
Python, and passed to the forward ops as guess_grad_output: True on the eager path alone,
where the C++ autograd node (kernels/autograd_node.h) scales the saved gradients in
backward; False in every autograd.Function, whose backward takes grad_output as it comes.
"""
from __future__ import annotations

import functools
import os

import torch
from torch.autograd import forward_ad
from torch.nn import _reduction

if __package__:
    from . import loader, op_signatures
else:
    import loader
    import op_signatures

# torch.compile traces the losses through stable custom ops (torch >= 2.4: register_fake).
COMPILE_OPS = hasattr(torch.library, "register_fake")
if COMPILE_OPS:
    from torch.compiler import is_compiling
else:
    def is_compiling() -> bool:
        return False

# Same codes as enum Reduction in kernels/ops.h.
REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2, "batchmean": 3}
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)
STRICT_VARIABLE = "FUSED_LOSSES_STRICT"


# ----------------------------------------------------------------------------------
# Argument checks.

class ArgumentError(ValueError, RuntimeError):
    """A bad argument for which torch's own function raises RuntimeError (another device, a
    weight of the wrong length): catchable as torch's RuntimeError, and as ValueError as before.
    Checks of arguments torch does not have (z_loss, softcap) raise ValueError."""


def check_reduction(reduction: str, allowed) -> None:
    if reduction not in allowed:  # torch raises ValueError here too
        raise ValueError(f"reduction must be one of {', '.join(map(repr, allowed))}, got {reduction!r}")


def legacy_reduction(size_average, reduce, reduction: str) -> str:
    """torch's deprecated size_average/reduce arguments, mapped as torch maps them."""
    if size_average is not None or reduce is not None:
        return _reduction.legacy_get_string(size_average, reduce)
    return reduction


def check_tensors(loss: str, input, target, weight=None) -> None:
    """input, target and weight (when given) must be tensors on input's device: torch's TypeError
    naming a non-tensor, its RuntimeError for another device. Written out rather than looped:
    every loss call pays it."""
    if not isinstance(input, torch.Tensor):
        raise not_a_tensor(loss, "input", input)
    if not isinstance(target, torch.Tensor):
        raise not_a_tensor(loss, "target", target)
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise not_a_tensor(loss, "weight", weight)
    device = input.device
    if target.device != device:
        raise device_error("target", target, input)
    if weight is not None and weight.device != device:
        raise device_error("weight", weight, input)


def not_a_tensor(loss: str, name: str, value) -> TypeError:
    return TypeError(f"{loss}: {name} must be a Tensor, got {type(value).__name__}")


def device_error(name: str, other: torch.Tensor, input: torch.Tensor) -> ArgumentError:
    return ArgumentError(f"{name} is on {other.device} but input is on {input.device}; move both to one device")


# ----------------------------------------------------------------------------------
# When torch's implementation runs.

def unfusable_reason(input: torch.Tensor) -> str | None:
    """Why no kernel can take a call on `input` whatever its arguments, or None. The caller
    adds its own reasons (dtypes, empty tensors)."""
    if not input.is_cuda:
        return "CPU tensors"
    if forward_ad._current_level >= 0:  # dual tensors: the kernels carry no tangents
        return "forward-mode AD (dual tensors)"
    if in_func_transform():
        return "a torch.func transform (grad, vmap, jacrev, jvp)"
    return None


def in_func_transform() -> bool:
    """Under torch.func's transforms tensors are wrappers without storage, which a kernel
    cannot take; torch's own ops can."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is not None and active()


def check_fallback_allowed(loss: str, why: str, input: torch.Tensor) -> None:
    """Before running torch's implementation: raises on a CUDA tensor in strict mode, except
    under a torch.func transform, which only torch's implementation can serve."""
    if input.is_cuda and os.environ.get(STRICT_VARIABLE) == "1" and not in_func_transform():
        raise RuntimeError(f"{loss}: {why}, so the fused kernel does not run here "
                           f"({STRICT_VARIABLE}=1 forbids torch fallbacks on CUDA tensors)")


# ----------------------------------------------------------------------------------
# Dtypes and autocast.

def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels accumulate in, and the dtype of cross-entropy's lse."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wants_grad(tensor: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and tensor.requires_grad


def under_autocast(tensor: torch.Tensor) -> bool:
    """Whether CUDA's autocast applies to this tensor."""
    return tensor.is_cuda and torch.is_autocast_enabled()  # no argument: CUDA's, torch 2.0 on


def autocast_dtype() -> torch.dtype:
    return torch.get_autocast_dtype("cuda") if hasattr(torch, "get_autocast_dtype") else torch.get_autocast_gpu_dtype()


def autocast_operands(reduction: str, *operands):
    """Under CUDA autocast, (operands, float_loss) as torch's autocast would have them.

    torch runs these losses in float32 under autocast (its float32 list: log_softmax,
    nll_loss, kl_div, mse_loss, log): float16 and bfloat16 operands are cast to float32 and
    the loss is float32. Ours does the same, except that bfloat16 operands of a scalar loss
    reach the kernel as they are: it computes in float32 anyway and writes the loss in
    float32 (float_loss). Their gradient, written in bfloat16 by the forward, is recomputed
    in backward where grad_output is not the factor it carries (keeps_operands), so it is
    rounded once, as torch's. A float16 gradient rounded before a loss scale of 2**16
    would flush most of a softmax's gradient to zero: float16 takes torch's way.
    Outside autocast, or for operands not on CUDA: (operands, False), unchanged."""
    if not under_autocast(operands[0]):
        return operands, False
    floating = [t for t in operands if t is not None and t.is_floating_point()]
    if not any(t.dtype in LOW_PRECISION for t in floating):
        return operands, False
    if reduction != "none" and all(t.dtype == torch.bfloat16 for t in floating):
        return operands, True
    return tuple(t.float() if t is not None and t.dtype in LOW_PRECISION else t for t in operands), False


# ----------------------------------------------------------------------------------
# A build's ops, eagerly and under torch.compile.
#
# A build is a Python module (pybind11) named after its arch and content hash, found by
# the loader, which reads files and takes locks: nothing a tracer can follow. So each
# kernel's ops are defined once more as custom ops under a stable name,
# torch.ops.fused_losses_<kernel>.<op>, with op_signatures.py's schema. Running one loads
# the build and calls its op; tracing one runs only its fake, which makes outputs of the
# right shapes and dtypes. Eager calls skip this layer and call the build directly: a
# custom op's dispatch costs microseconds, which launch-bound losses would feel.

def kernel_ops(kernel: str, like: torch.Tensor):
    """The ops of `kernel` for the device and dtype of `like` (each dtype is a build of its
    own): the build itself eagerly, its custom ops under torch.compile."""
    if COMPILE_OPS and is_compiling():
        return getattr(torch.ops, f"fused_losses_{kernel}")
    return loader.load_for_device(kernel, like.device, like.dtype)


def no_outputs_fake(*args):
    """The fake of an op that only writes its (a!) arguments."""
    return None


_FAKES: dict[str, dict] = {}  # kernel -> op -> fake, as define_compile_ops was given them


def call_build(kernel: str, op: str):
    """The custom op's implementation: the build's op, with an empty tensor for each output
    the build leaves undefined (the schema promises a tensor there)."""
    def call(*args):
        first = next(arg for arg in args if isinstance(arg, torch.Tensor))  # the input, or scale's grad
        device = first.device
        outputs = getattr(loader.load_for_device(kernel, device, first.dtype), op)(*args)
        if not isinstance(outputs, tuple) or all(output is not None for output in outputs):
            return outputs
        shapes = _FAKES[kernel][op](*[arg.to("meta") if isinstance(arg, torch.Tensor) else arg for arg in args])
        return tuple(torch.empty(0, dtype=shape.dtype, device=device) if output is None else output
                     for output, shape in zip(outputs, shapes))
    return call


def define_compile_ops(kernel: str, fakes: dict):
    """torch.ops.fused_losses_<kernel>.<op> for each op op_signatures.py declares for the
    kernel, with fakes[op]. Returns the Library (the definitions last as long as it), or None
    on torch < 2.4 and where this module was imported before under another name."""
    _FAKES[kernel] = fakes
    namespace = f"fused_losses_{kernel}"
    if not COMPILE_OPS or hasattr(getattr(torch.ops, namespace), "forward"):
        return None
    library = torch.library.Library(namespace, "DEF")
    for op, schema in op_signatures.KERNEL_OPS[kernel].items():
        library.define(op + schema)
        library.impl(op, call_build(kernel, op), "CUDA")
        torch.library.register_fake(f"{namespace}::{op}", fakes[op], lib=library)
    return library


# ----------------------------------------------------------------------------------
# Autograd.
#
# Eagerly, a scalar loss with grad gets its grad_fn in C++ (ops.attach_saved_gradients,
# kernels/autograd_node.h): its forward kernel wrote the gradients, and backward only
# scales them by grad_output. The Python Functions serve reduction 'none' (whose backward
# runs the backward kernel) and torch.compile, which traces them (it cannot trace the C++
# node). They take their non-tensor arguments as one tuple, `options`: apply inspects each
# argument it is given (an empty Function's apply, desktop CPU: 3.3 us with 12 arguments,
# 2.4 us with 4).

def use_python_function(want_grads: bool, reduction: str) -> bool:
    return want_grads and (reduction == "none" or is_compiling())


def create_graph() -> bool:
    """In backward: grad mode is on there only for backward(create_graph=True), whose
    gradients are to be differentiated again. The kernels' gradients have no graph of their
    own; there gradient_graph recomputes them by torch's formula instead. (Under
    torch.compile, AOTAutograd refuses double backward itself.)"""
    return torch.is_grad_enabled() and not is_compiling()


def gradient_graph(formula, operands, wants, grad_output):
    """The gradients of formula(*operands) (torch's formula of the loss) with respect to the
    operands that wants marks, from grad_output, as a graph: for backward(create_graph=True)
    alone, so the usual backward never pays for it. None for the others."""
    wanted = [operand for operand, want in zip(operands, wants) if want]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(formula(*operands), wanted, grad_output, create_graph=True,
                                         allow_unused=True))
    return tuple(next(grads) if want else None for want in wants)


def backward_from_saved_grads(ctx, grad_output: torch.Tensor):
    """Backward of a scalar loss whose forward wrote the gradients, in a Function (under
    torch.compile; eagerly, kernels/autograd_node.h's node does this): scale them by
    grad_output, or recompute them (ctx.recompute, see keeps_operands), and hand them to
    autograd. The compiled graph is functional: the op writes a copy of the saved gradient, so
    a second backward is correct there. Saved: the two gradients (None where not wanted), then
    a recompute's operands."""
    grads = ctx.saved_tensors[:2]
    present = [grad for grad in grads if grad is not None]
    ops = kernel_ops(ctx.kernel, present[0])
    if ctx.recompute is not None:
        recompute(ops.recompute_gradients_, ctx.saved_tensors[2:], *ctx.recompute, grad_output, None, *grads)
        return grads
    for grad in present:
        ops.scale_by_grad_output_(grad, grad_output)
    return grads


def keeps_operands(float_loss: bool) -> bool:
    """Whether a scalar loss's forward keeps its operands so that backward recomputes its
    gradients (the recompute_gradients_ ops; kernels/grad_output_guess.cuh): autocast's
    bfloat16 fast path (float_loss). torch applies autocast's float32 grad_output before it
    rounds the gradient to bfloat16 once; scaling the forward's bfloat16 gradient would round
    twice (up to 1.5 ulp). The cost: the operands live until backward (2 bytes an element of
    the input), and a grad_output other than the forward's guess pays a forward pass again
    rather than a scaling pass."""
    return float_loss


def recompute(op, operands, leading, trailing, grad_output, applied, *grads) -> None:
    """op(*operands, *leading, grad_output, applied, *grads, *trailing): a recompute_gradients_
    op into grads (None: not wanted, passed as no elements)."""
    empty = operands[0].new_empty(0)
    op(*operands, *leading, grad_output, applied, *(empty if grad is None else grad for grad in grads), *trailing)


def recompute_for_node(op, operands, leading, trailing=()):
    """The eager node's recompute(grad_output, applied, grad_input, grad_target)
    (kernels/autograd_node.h): it holds the operands, and raises as torch does for a saved tensor
    where one was modified in place since (it would read the new values)."""
    versions = tuple(None if operand is None else operand._version for operand in operands)
    return functools.partial(_recompute_unmodified, op, operands, versions, leading, trailing)


def _recompute_unmodified(op, operands, versions, leading, trailing, *call):
    if any(operand is not None and operand._version != version for operand, version in zip(operands, versions)):
        raise RuntimeError("one of the variables needed for gradient computation has been modified by an inplace "
                           "operation: under bfloat16 autocast a fused loss keeps its input to recompute its gradient "
                           "in backward, and that input was modified after the loss was computed")
    recompute(op, operands, leading, trailing, *call)


def no_second_derivative(what: str) -> None:
    """A Function whose backward builds no graph refuses backward(create_graph=True)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} has no second derivative: backward(create_graph=True) through it is not "
                           "supported")


def mark_overwritten(tensor: torch.Tensor) -> None:
    """Tells autograd that a kernel wrote over tensor's memory: its version counter (shared
    with its views and base) goes up, so backward raises where an op saved the old values.
    torch 2.0 has no increment_version; an in-place op on no elements bumps the counter
    too, and moves no data."""
    if hasattr(torch.autograd.graph, "increment_version"):
        torch.autograd.graph.increment_version(tensor)
    else:
        with torch.no_grad():
            tensor.view(-1)[:0].zero_()
