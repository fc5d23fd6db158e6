"""Each kernel op's signature, written once, in torch's schema language.

From these declarations come: the schemas of the ops torch.compile traces (loss_helpers.
define_compile_ops), their fakes' argument names, and the C++ side of every build:
loader.py writes each entry point's parameter list and return type as macros into the
build's main.cpp (cpp_declarations), which kernels/entry_points.h declares its functions
with, and binds each function with its argument names (pybind_arguments). An argument
added here and not to the C++ body, or the other way round, fails the build.

    "(Tensor logits, Tensor? weight, int reduction, float z_loss, bool want_lse) -> (Tensor, Tensor)"

Tensor(a!) marks a tensor the op writes in place; "()" returns nothing.

An argument added to cross-entropy's forward: its schema here (recompute_gradients_'s too, where
it changes the gradient); cross_entropy.py's user function, Module and the call's argument tuple
(and _recompute_arguments); the field it fills in kernels/ops.h's CrossEntropyCall (entry_points.h's
CrossEntropyInputs, one line) and the math that reads it; tests/kernel_models.py's model.
"""
from __future__ import annotations

import re

# Every build binds this one (finish.cuh): a scalar loss's saved gradients times grad_output.
SCALE_BY_GRAD_OUTPUT = "(Tensor(a!) grad, Tensor grad_output) -> ()"

_POINTWISE_FORWARD = ("(Tensor input, Tensor target, int reduction, float scale, bool float_loss, "
                      "bool want_grad_input, bool want_grad_target, bool guess_grad_output{}) "
                      "-> (Tensor, Tensor, Tensor)")
_POINTWISE_BACKWARD = ("(Tensor input, Tensor target, Tensor grad_output, bool want_grad_input, "
                       "bool want_grad_target{}) -> (Tensor, Tensor)")
_KL_DIV_OPTIONS = ", bool log_input, bool log_target"
# Backward's recompute (kernels/grad_output_guess.cuh): the forward's kernel again, over the
# saved gradients (no elements: not wanted), with grad_output as the factor; applied: the
# factor they carry (the eager forward's guess), None: 1.
_POINTWISE_RECOMPUTE = ("(Tensor input, Tensor target, float scale, Tensor grad_output, Tensor? applied, "
                        "Tensor(a!) grad_input, Tensor(b!) grad_target{}) -> ()")

# kernel -> op -> schema (without the op's name). Op <op> is the build's <kernel>_<op> in
# kernels/entry_points.h; the shared scale_by_grad_output_ keeps its name.
KERNEL_OPS = {
    "mse": {
        "forward": _POINTWISE_FORWARD.format(""),
        "backward": _POINTWISE_BACKWARD.format(""),
        "recompute_gradients_": _POINTWISE_RECOMPUTE.format(""),
        "scale_by_grad_output_": SCALE_BY_GRAD_OUTPUT,
    },
    "kl_div": {
        "forward": _POINTWISE_FORWARD.format(_KL_DIV_OPTIONS),
        "backward": _POINTWISE_BACKWARD.format(_KL_DIV_OPTIONS),
        "recompute_gradients_": _POINTWISE_RECOMPUTE.format(_KL_DIV_OPTIONS),
        "scale_by_grad_output_": SCALE_BY_GRAD_OUTPUT,
    },
    "cross_entropy": {
        # inplace=True returns the logits as their gradient: never passed under torch.compile.
        "forward": ("(Tensor logits, Tensor target, Tensor? weight, int ignore_index, int reduction, "
                    "bool float_loss, float label_smoothing, float z_loss, float temperature, "
                    "bool want_grad_logits, bool want_grad_target, bool want_lse, bool inplace, bool guess_grad_output) "
                    "-> (Tensor, Tensor, Tensor, Tensor)"),
        "backward": ("(Tensor logits, Tensor target, Tensor? weight, int ignore_index, float label_smoothing, "
                     "float z_loss, float temperature, Tensor grad_output, bool want_grad_logits, "
                     "bool want_grad_target) "
                     "-> (Tensor, Tensor)"),
        "recompute_gradients_": ("(Tensor logits, Tensor target, Tensor? weight, int ignore_index, int reduction, "
                                 "float label_smoothing, float z_loss, float temperature, Tensor grad_output, "
                                 "Tensor? applied, "
                                 "Tensor(a!) grad_logits, Tensor(b!) grad_target) -> ()"),
        "scale_by_grad_output_": SCALE_BY_GRAD_OUTPUT,
    },
    "row_passes": {  # row_passes.py: they write their (a!) arguments
        "forward": ("(Tensor logits, Tensor target, int class_start, int classes, Tensor(a!) stats, "
                    "float softcap, float temperature) -> ()"),
        "backward": ("(Tensor logits, Tensor(a!) grad, Tensor target, int class_start, int classes, "
                     "Tensor? class_count, Tensor softmax_stats, Tensor row_scale, float label_smoothing, "
                     "float z_loss, float softcap, float temperature, Tensor? entropy_scale) -> ()"),
    },
    # sm_90a only (loader.SM90A_KERNELS): gemm_nt (a @ b.T, 2-byte operands, into out when given,
    # returned; for the tests and the benchmark), the fused product's statistics and its training form,
    # and d input from that form (linear_cross_entropy.py); max_blocks > 0 caps the persistent grid, 0: one
    # block a multiprocessor.
    "linear_ce_gemm": {
        "gemm_nt": "(Tensor a, Tensor b, Tensor(a!)? out, int max_blocks) -> Tensor",
        "row_stats": ("(Tensor a, Tensor b, Tensor? bias, Tensor target, float softcap, float temperature, "
                      "int stat_rows, int max_blocks) -> Tensor"),
        "combine_row_stats": "(Tensor partials) -> Tensor",
        "row_stats_training": ("(Tensor a, Tensor b, Tensor? bias, Tensor target, float softcap, float temperature, "
                               "int stat_rows, Tensor(a!) e, Tensor(b!) piece_max, int max_blocks) -> Tensor"),
        "grad_input": ("(Tensor e, Tensor piece_max, Tensor w, int first_class, Tensor stats, Tensor target, "
                       "Tensor row_scale, float z_loss, float softcap, float temperature, Tensor(a!) out, "
                       "Tensor(b!)? carry, Tensor? previous_stats, bool finish, int max_blocks) -> ()"),
    },
}

# What the build binds beyond KERNEL_OPS, with its schema (None: bound without argument names):
# cross-entropy's test-only path query takes the forward's arguments (entry_points.h).
EXTRA_BINDINGS = {"cross_entropy": {"cross_entropy_path": KERNEL_OPS["cross_entropy"]["forward"],
                                    "force_cross_entropy_path": None}}

_CPP_TYPES = {"Tensor": "const at::Tensor&", "Tensor?": "const c10::optional<at::Tensor>&", "Tensor(a!)": "at::Tensor",
              "Tensor(b!)": "at::Tensor", "Tensor(a!)?": "const c10::optional<at::Tensor>&",
              "Tensor(b!)?": "const c10::optional<at::Tensor>&",
              "int": "int64_t", "float": "double", "bool": "bool"}


def parse(schema: str):
    """([(type, name), ...], [return types]) of "(Tensor x, int n) -> (Tensor, Tensor)"."""
    match = re.fullmatch(r"\((.*)\) -> (.*)", schema)
    if not match:
        raise ValueError(f"not a schema: {schema!r}")
    arguments = [tuple(argument.strip().rsplit(" ", 1)) for argument in match.group(1).split(",") if argument.strip()]
    returns = match.group(2).strip("()")
    return arguments, [kind.strip() for kind in returns.split(",") if kind.strip()]


def argument_names(kernel: str, op: str) -> list[str]:
    return [name for _, name in parse(KERNEL_OPS[kernel][op])[0]]


def _macro(kernel: str, op: str) -> str:
    """The C++ name of an op: FUSED_LOSSES_MSE_FORWARD; the shared scale_by_grad_output_ has one."""
    return "FUSED_LOSSES_SCALE_BY_GRAD_OUTPUT" if op == "scale_by_grad_output_" else f"FUSED_LOSSES_{kernel}_{op}".upper()


def cpp_declarations() -> str:
    """#defines of every op's C++ parameter list (<MACRO>_PARAMS) and return type
    (<MACRO>_RETURNS), for the build's main.cpp, ahead of entry_points.h."""
    lines = []
    for kernel, ops in KERNEL_OPS.items():
        for op, schema in ops.items():
            arguments, returns = parse(schema)
            params = ", ".join(f"{_CPP_TYPES[kind]} {name}" for kind, name in arguments)
            result = ("void" if not returns else "at::Tensor" if len(returns) == 1 else
                      f"std::tuple<{', '.join(['at::Tensor'] * len(returns))}>")
            lines += [f"#define {_macro(kernel, op)}_PARAMS {params}", f"#define {_macro(kernel, op)}_RETURNS {result}"]
    return "\n".join(dict.fromkeys(lines))  # scale_by_grad_output_'s, once


def pybind_arguments(schema: str) -> str:
    """', py::arg("logits"), ...' for the build's m.def of an op with this schema."""
    return "".join(f', py::arg("{name}")' for _, name in parse(schema)[0])
