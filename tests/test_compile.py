"""torch.compile(fullgraph=True) through each loss, forward and backward, equal to eager, in
every compile mode.

On the GPU the real kernels run (torch >= 2.4). On CPU (CI) the same tracing runs with
the kernels replaced by the Python models of kernel_models.py (the kernels_modelled_on_cpu
fixture), registered as the CPU implementation of the stable ops: that proves the losses trace without a graph break, the fakes agree with
the ops' outputs, and the in-place backward survives compilation.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import loss_helpers
import losses

needs_compile_ops = pytest.mark.skipif(
    not loss_helpers.COMPILE_OPS,
    reason=f"torch {torch.__version__} has no torch.library.register_fake (2.4+): the losses run eagerly only")

NONE, MEAN = loss_helpers.REDUCTION_CODES["none"], loss_helpers.REDUCTION_CODES["mean"]


# ----------------------------------------------------------------------------------
# Each loss inside a small model step: logits = x @ weight, then the loss.

def model_step(loss):
    def step(weight, x, target):
        return loss(x @ weight, target)
    return step


STEPS = {
    "cross_entropy mean": model_step(lambda logits, t: losses.cross_entropy(logits, t)),
    "cross_entropy none": model_step(lambda logits, t: losses.cross_entropy(logits, t, reduction="none")),
    "cross_entropy every option": model_step(lambda logits, t: losses.cross_entropy(
        logits, t, weight=torch.linspace(0.5, 1.5, logits.shape[1], device=logits.device), label_smoothing=0.1,
        z_loss=1e-3, inplace_backward=True)),
    "mse_loss mean": model_step(lambda out, y: losses.mse_loss(out, y)),
    "mse_loss none": model_step(lambda out, y: losses.mse_loss(out, y, reduction="none")),
    "kl_div log_input=False": model_step(
        lambda logits, q: losses.kl_div(logits.softmax(-1), q, reduction="batchmean", log_input=False)),
    "kl_div log_input=True": model_step(
        lambda logits, q: losses.kl_div(logits.log_softmax(-1), q, reduction="batchmean")),
    # The linear's schedules: d weight summed in the forward (rows); 'none' (rows, then classes in
    # backward); input's gradient alone, through a fixed head of 50 classes (a frozen head).
    "linear_cross_entropy mean": lambda weight, x, t: losses.linear_cross_entropy(x, weight.t(), t, softcap=5.0),
    "linear_cross_entropy none": lambda weight, x, t: losses.linear_cross_entropy(x, weight.t(), t, reduction="none"),
    "linear_cross_entropy frozen head": lambda weight, x, t: losses.linear_cross_entropy(
        x @ weight, torch.linspace(-1, 1, 5000, device=x.device).reshape(50, 100), t % 50, label_smoothing=0.1),
}


def step_inputs(case, device):
    weight = torch.randn(32, 100, device=device) / 6
    x = torch.randn(64, 32, device=device)
    if "cross_entropy" in case:
        target = torch.randint(0, 100, (64,), device=device)
        target[::7] = -100  # some ignored rows
    elif case.startswith("kl_div"):
        target = torch.randn(64, 100, device=device).softmax(-1)
    else:
        target = torch.randn(64, 100, device=device)
    return weight, x, target


def run_step(step, weight, x, target):
    """Loss and the weight's gradient; backward from 2.5 (scalar) or from 0.5..1.5 (per
    element), so a gradient the forward wrote must be scaled."""
    weight = weight.detach().requires_grad_()
    loss = step(weight, x, target)
    grad_output = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
    grad_output = torch.full_like(loss, 2.5) if loss.dim() == 0 else grad_output
    loss.backward(grad_output)
    return loss.detach(), weight.grad


def check_compiled_matches_eager(case, device, backend):
    torch._dynamo.reset()
    inputs = step_inputs(case, device)
    eager = run_step(STEPS[case], *inputs)
    compiled_step = torch.compile(STEPS[case], fullgraph=True, backend=backend)
    for _ in range(2):  # the second call runs the cached graph
        torch.testing.assert_close(run_step(compiled_step, *inputs), eager)


# ----------------------------------------------------------------------------------
# The fakes: outputs of the shapes and dtypes the ops give.

def op_calls(device):
    """(kernel, op, args) covering every op and every output-shaping argument."""
    x, y = torch.rand(6, 10, device=device) + 0.1, torch.rand(6, 10, device=device) + 0.1
    calls = []
    for kernel, op_args in (("mse", ()), ("kl_div", (False, False))):
        for reduction, float_loss in ((NONE, False), (MEAN, False), (MEAN, True)):
            for wants in ((True, False), (False, True), (True, True), (False, False)):
                calls.append((kernel, "forward", (x, y, reduction, 0.5, float_loss, *wants, False, *op_args)))
        calls.append((kernel, "backward", (x, y, torch.rand_like(x), True, False, *op_args)))
        calls.append((kernel, "backward", (x, y, torch.rand_like(x), False, True, *op_args)))
        calls.append((kernel, "scale_by_grad_output_", (x.clone(), torch.tensor(2.0, device=device))))
        calls.append((kernel, "recompute_gradients_", (x, y, 0.5, torch.tensor(2.0, device=device), None,
                                                       torch.empty_like(x), x.new_empty(0), *op_args)))
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(6, 10, device=device, dtype=dtype).t()  # non-contiguous: outputs are not
        no_weight, weight = None, torch.rand(6, device=device, dtype=dtype)
        indices = torch.randint(0, 6, (10,), device=device)
        probabilities = torch.rand(10, 6, device=device, dtype=dtype).softmax(1)
        grad_output = torch.rand(10, device=device, dtype=dtype)
        for target, weights in ((indices, no_weight), (probabilities, weight)):
            probs = target.is_floating_point()
            for reduction, float_loss in ((NONE, False), (MEAN, False), (MEAN, True)):
                for want_grad_logits, want_lse in ((True, False), (False, True)):
                    calls.append(("cross_entropy", "forward", (logits, target, weights, -100, reduction, float_loss,
                                                               0.1, 1e-3, 0.7, want_grad_logits, probs, want_lse,
                                                               False, False)))
            calls.append(("cross_entropy", "backward", (logits, target, weights, -100, 0.1, 1e-3, 0.7, grad_output,
                                                        True, probs)))
            grad_target = torch.empty(10, 6, device=device, dtype=dtype) if probs else logits.new_empty(0)
            calls.append(("cross_entropy", "recompute_gradients_", (
                logits, target, weights, -100, MEAN, 0.1, 1e-3, 0.7, grad_output[0], torch.ones((), device=device),
                torch.empty(10, 6, device=device, dtype=dtype), grad_target)))
    return calls


def check_fakes_match_the_ops(device):
    for kernel, op, args in op_calls(device):
        stable_op = getattr(getattr(torch.ops, f"fused_losses_{kernel}"), op)
        real = stable_op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = stable_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert len(real) == len(fake), (kernel, op)
        for index, (r, f) in enumerate(zip(real, fake)):
            if r is None:
                assert f is None, (kernel, op, index)
                continue
            where = f"{kernel}.{op} output {index}"
            assert (f.shape, f.dtype, f.device, f.stride()) == (r.shape, r.dtype, r.device, r.stride()), where


# ----------------------------------------------------------------------------------
# CPU (CI): tracing with the models.

@needs_compile_ops
@pytest.mark.parametrize("case", list(STEPS))
def test_compiles_without_graph_break_on_cpu_models(case, kernels_modelled_on_cpu):
    """aot_eager: dynamo and AOTAutograd (where a graph break or the in-place backward
    would fail) without code generation, which the GPU test adds."""
    check_compiled_matches_eager(case, "cpu", backend="aot_eager")


@needs_compile_ops
def test_fakes_match_the_cpu_models(kernels_modelled_on_cpu):
    check_fakes_match_the_ops("cpu")


@needs_compile_ops
def test_fake_outputs_on_cuda_need_no_gpu():
    """Tracing a CUDA program happens on fake tensors: the fakes run without a GPU."""
    with FakeTensorMode():
        logits = torch.empty(5, 7, device="cuda", dtype=torch.bfloat16)
        target = torch.empty(5, device="cuda", dtype=torch.int64)
        loss, grad_logits, grad_target, lse = torch.ops.fused_losses_cross_entropy.forward(
            logits, target, None, -100, NONE, False, 0.0, 0.0, 1.0, True, False, True, False, False)
        assert (loss.shape, grad_logits.shape, grad_target.shape, lse.shape, lse.dtype) == (
            (5,), (0,), (0,), (5,), torch.float32)
        assert loss.device.type == "cuda" and loss.dtype == torch.bfloat16
        loss, grad_input, grad_target = torch.ops.fused_losses_mse.forward(logits, logits, MEAN, 0.1, True, True,
                                                                           False, False)
        assert (loss.shape, loss.dtype, grad_input.shape, grad_target.shape) == ((), torch.float32, (5, 7), (0,))


def test_old_torch_runs_eagerly_without_the_stable_ops():
    if loss_helpers.COMPILE_OPS:
        assert hasattr(torch.ops.fused_losses_mse, "forward")
    else:
        assert not loss_helpers.is_compiling() and loss_helpers.define_compile_ops("mse", {}) is None


# ----------------------------------------------------------------------------------
# GPU: the real kernels, compiled by inductor.

@pytest.mark.gpu
@needs_compile_ops
@pytest.mark.parametrize("case", list(STEPS))
def test_compiled_matches_eager(case):
    check_compiled_matches_eager(case, "cuda", backend="inductor")


@pytest.mark.gpu
@needs_compile_ops
def test_fakes_match_the_kernels():
    check_fakes_match_the_ops("cuda")


# ----------------------------------------------------------------------------------
# GPU: every compile mode, in training (compiled forward, backward outside it) and in
# no-grad evaluation, each checked against torch's own loss, which is compiled in the same
# mode as the control. The model is a scale of the inputs (no matmul for max-autotune to tune).

def scaled_step(loss):
    def step(scale, x, target):
        return loss(x * scale, target)
    return step


def kl_log_input_false(ours):
    if ours:
        return lambda x, q: losses.kl_div(x.softmax(-1), q, reduction="batchmean", log_input=False)
    return lambda x, q: F.kl_div(x.softmax(-1).log(), q, reduction="batchmean")


MODE_STEPS = {  # case: (ours, torch's)
    "cross_entropy mean": (lambda x, t: losses.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t)),
    "cross_entropy none": (lambda x, t: losses.cross_entropy(x, t, reduction="none"),
                           lambda x, t: F.cross_entropy(x, t, reduction="none")),
    "mse_loss mean": (lambda x, y: losses.mse_loss(x, y), lambda x, y: F.mse_loss(x, y)),
    "kl_div log_input=False": (kl_log_input_false(True), kl_log_input_false(False)),
}
COMPILE_MODES = {"default": {}, "reduce-overhead": {"mode": "reduce-overhead"},
                 "max-autotune": {"mode": "max-autotune"}, "dynamic=True": {"dynamic": True}}


def mode_inputs(case, rows):
    weight, x, target = step_inputs(case, "cuda")
    return torch.linspace(0.5, 1.5, 100, device="cuda"), (x @ weight)[:rows] * 3, target[:rows]


@pytest.mark.gpu
@needs_compile_ops
@pytest.mark.parametrize("use", ["training", "evaluation"])
@pytest.mark.parametrize("mode", list(COMPILE_MODES))
@pytest.mark.parametrize("case", list(MODE_STEPS))
def test_every_compile_mode_matches_torch(case, mode, use):
    """Three calls (CUDA graph trees warm up, record, replay), the last with fewer rows
    (a new shape: dynamic=True traces it symbolically, the others recompile)."""
    torch._dynamo.reset()
    ours, theirs = (torch.compile(scaled_step(loss), fullgraph=True, **COMPILE_MODES[mode])
                    for loss in MODE_STEPS[case])
    for rows in (64, 64, 48):
        inputs = mode_inputs(case, rows)
        if use == "training":  # outputs of CUDA graphs are cloned before the next graph runs, as users must
            ours_out, control = (tuple(out.clone() for out in run_step(step, *inputs)) for step in (ours, theirs))
            expected = run_step(scaled_step(MODE_STEPS[case][1]), *inputs)
        else:
            with torch.no_grad():
                ours_out, control = ours(*inputs).clone(), theirs(*inputs).clone()
                expected = scaled_step(MODE_STEPS[case][1])(*inputs)
        torch.testing.assert_close(control, expected)  # torch's loss works in this mode
        torch.testing.assert_close(ours_out, expected)
