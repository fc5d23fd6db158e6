"""The one test pattern all three losses share, and the table of losses (LOSSES) for
the tests that run every loss alike.

check_against_float64 runs a loss three ways on the same inputs: torch on float64
copies (the truth), torch eager in the dtype under test, and ours; then checks that
our loss and every gradient are, norm-wise, within twice torch's own eager error or a
floor of one rounding of the dtype (FLOOR), and, in 2-byte dtypes, element by element
within ULPS units in the last place of the truth.
Our outputs land in memory poisoned with NaN first, so an element the kernel did not
write shows up as an error.
"""
import concurrent.futures
import faulthandler
import inspect
import json
import math
import os
import signal
import threading
import time
from typing import Callable, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import cross_entropy
import losses

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _cpu_float16_matmul() -> bool:
    try:
        torch.ones(1, 1, dtype=torch.float16) @ torch.ones(1, 1, dtype=torch.float16)
        return True
    except RuntimeError:  # torch 2.0's CPU addmm has no float16 kernel
        return False


CPU_FLOAT16_MATMUL = _cpu_float16_matmul()

# Relative error ||ours - truth|| / ||truth|| that always passes. 2-byte dtypes: the unit
# roundoff, what rounding the output alone costs. float32, float64: four of it, for sums of
# many terms in a different order than torch's.
FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 2.5e-7,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
# The norm-wise bound is this many times eager's own error (or FLOOR).
EAGER_ERROR_FACTOR = 2
# 2-byte outputs, element by element: at most ULPS units in the last place of the truth
# (in the output's dtype) off it, after a slack of 2^-22 of the tensor's largest truth for
# elements that cancel to near zero in float32 arithmetic. Ours rounds once from float32:
# over the GPU suite's 6173 2-byte checks (H100, notes v41) the worst element was 0.50 ulp
# off; 1 leaves room for float32's own error at a rounding tie.
ULPS = {torch.float16: 1.0, torch.bfloat16: 1.0}
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}
_MIN_NORMAL_EXPONENT = {torch.float16: -14, torch.bfloat16: -126}

_CHUNK = 1 << 26


def raises_as_torch(ours, theirs):
    """Runs theirs (torch's call) and ours (the same bad arguments): ours must raise what
    `except type(torch's error)` catches."""
    with pytest.raises(Exception) as torch_error:
        theirs()
    with pytest.raises(type(torch_error.value)):
        ours()


def rel_err(value: torch.Tensor, truth: torch.Tensor) -> float:
    """||value - truth|| / ||truth||, in float64, chunked so huge tensors fit."""
    value, truth = value.detach().reshape(-1), truth.detach().reshape(-1)
    assert value.numel() == truth.numel()
    diff_sq = truth_sq = 0.0
    for start in range(0, value.numel(), _CHUNK):
        v = value[start:start + _CHUNK].double()
        t = truth[start:start + _CHUNK].double()
        diff_sq += (v - t).pow(2).sum().item()
        truth_sq += t.pow(2).sum().item()
    return math.sqrt(diff_sq) / math.sqrt(truth_sq) if truth_sq > 0 else math.sqrt(diff_sq)


def max_ulps(value: torch.Tensor, truth: torch.Tensor, scale: float = 0.0) -> float:
    """max over elements of |value - truth| (less the cancellation slack, see ULPS: 2^-22 of
    the larger of `scale` and truth's largest magnitude) in units in the last place of truth
    in value's (2-byte) dtype. Where truth rounds to inf in that dtype, value must be that
    inf; any other NaN or inf counts as inf."""
    dtype = value.dtype
    value, truth = value.detach().reshape(-1), truth.detach().reshape(-1)
    slack = 2.0**-22 * max([scale] + [truth[s:s + _CHUNK].double().abs().max().item()
                                      for s in range(0, truth.numel(), _CHUNK)])
    worst = 0.0
    for start in range(0, value.numel(), _CHUNK):
        v = value[start:start + _CHUNK].double()
        t = truth[start:start + _CHUNK].double()
        exponent = torch.frexp(t)[1].sub(1).clamp(min=_MIN_NORMAL_EXPONENT[dtype])  # floor(log2|t|)
        ulp = torch.pow(2.0, (exponent - _MANTISSA_BITS[dtype]).double())
        excess = ((v - t).abs() - slack).clamp(min=0) / ulp
        overflow = t.to(dtype).isinf()  # beyond the dtype's range: torch's inf is the answer
        excess = torch.where(overflow, torch.where(v == t.to(dtype).double(), 0.0, math.inf), excess)
        worst = max(worst, excess.nan_to_num(nan=math.inf).max().item() if excess.numel() else 0.0)
    return worst


def input_scale(input: torch.Tensor) -> float:
    """The largest finite magnitude in `input` (0 for none)."""
    finite = input.detach()[torch.isfinite(input.detach())]
    return finite.abs().max().item() if finite.numel() else 0.0


def _log_errors(record: dict) -> None:
    """With FUSED_LOSSES_ERROR_LOG set, append one check's errors to that file (JSON lines):
    how the tolerances above were measured."""
    path = os.environ.get("FUSED_LOSSES_ERROR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def poison_allocator(*tensors_like):
    """Fill the caching allocator's next blocks of these sizes with NaN, so outputs
    allocated right after start out as NaN rather than stale, plausible values."""
    blocks = [torch.full_like(t, float("nan")) for t in tensors_like]
    del blocks


def loss_and_grads(loss_fn, inputs, grad_of, grad_output=None):
    """loss_fn(*inputs) and the gradients of the inputs at grad_of, from grad_output
    (ones in the loss's shape when None); grad_of empty: the loss alone."""
    leaves = [t.detach().requires_grad_(i in grad_of) for i, t in enumerate(inputs)]
    loss = loss_fn(*leaves)
    if not grad_of:
        return loss.detach(), []
    loss.backward(torch.ones_like(loss) if grad_output is None else grad_output.to(loss.dtype).reshape(loss.shape))
    return loss.detach(), [leaves[i].grad for i in grad_of]


def default_grad_output(reference, inputs):
    """What backward starts from when a check is not given one: 1 for a scalar loss, else
    random values that every dtype holds exactly, so that the truth gets ours."""
    with torch.no_grad():
        probe = reference(*inputs)
    return torch.ones(()) if probe.dim() == 0 else (torch.rand_like(probe) + 0.5).bfloat16().double()


def check_against_float64(fused, reference, inputs, grad_of=(0,), grad_output=None, case="",
                          loss_without_grad=True, floor=FLOOR, grads_within_ulps=True, grad_floors=None,
                          loss_within_ulps=True):
    """fused(*inputs) vs reference(*inputs) (a torch.nn.functional formula).

    inputs: tensors in the dtype under test (integer ones, like class indices, are
    passed as they are). grad_of: indices of inputs that get gradients (empty: the loss
    alone). grad_output: what backward starts from (default 1 for a scalar loss, random
    for 'none'). loss_without_grad: the loss is also computed under torch.no_grad. floor:
    the norm-wise floor per dtype (FLOOR). grads_within_ulps: each element of a 2-byte
    gradient within ULPS of float64 too (False where eager's is not either: a gradient that is
    a matrix product of rounded values, as linear_cross_entropy's). grad_floors: each gradient's
    floor instead (for gradients that are differences of larger terms). loss_within_ulps: the
    same for a 2-byte loss (False where it is a function of rounded values, as eager's).
    """
    dtype = inputs[0].dtype
    as_float64 = [t.double() if t.is_floating_point() else t for t in inputs]
    if grad_output is None:
        grad_output = default_grad_output(reference, as_float64)
    grad_output = grad_output.to(inputs[0].device)

    truth_loss, truth_grads = loss_and_grads(reference, as_float64, grad_of, grad_output.double())
    del as_float64
    eager_loss, eager_grads = loss_and_grads(reference, inputs, grad_of, grad_output)
    # The loss is checked twice, computed with grad and without (below): both against eager's error.
    eager_loss_error = rel_err(eager_loss, truth_loss)
    eager_errors = [eager_loss_error, eager_loss_error] + [rel_err(g, t) for g, t in zip(eager_grads, truth_grads)]
    del eager_grads

    poison_allocator(*(inputs[i] for i in grad_of), eager_loss)
    ours_loss, ours_grads = loss_and_grads(fused, inputs, grad_of, grad_output)
    assert ours_loss.dtype == eager_loss.dtype and ours_loss.shape == eager_loss.shape, case
    for grad, i in zip(ours_grads, grad_of):
        assert grad is not None and grad.shape == inputs[i].shape and grad.dtype == inputs[i].dtype, case
    # The loss without grad too: the kernels take other paths there (no gradient written,
    # so other launch shapes; cross-entropy's long rows streamed without a stash).
    with torch.no_grad():
        ours_no_grad_loss = fused(*inputs) if loss_without_grad else ours_loss
    assert ours_no_grad_loss.dtype == eager_loss.dtype and ours_no_grad_loss.shape == eager_loss.shape, case
    ours_errors = ([rel_err(ours_loss, truth_loss), rel_err(ours_no_grad_loss, truth_loss)] +
                   [rel_err(g, t) for g, t in zip(ours_grads, truth_grads)])

    names = ["loss", "loss without grad"] + [f"grad of input {i}" for i in grad_of]
    truths = [truth_loss, truth_loss] + list(truth_grads)
    outputs = [ours_loss, ours_no_grad_loss] + list(ours_grads)
    # A loss is a difference of terms as large as the input (cross-entropy's lse - x_t): near 0
    # it carries their float32 rounding.
    scales = [input_scale(inputs[0])] * 2 + [0.0] * len(ours_grads)
    elementwise = (names[:2] if loss_within_ulps else []) + (names[2:] if grads_within_ulps else [])
    ulps = {name: max_ulps(ours, truth, scale) for name, ours, truth, scale in zip(names, outputs, truths, scales)
            if ours.dtype in ULPS and name in elementwise}
    _log_errors({"case": case, "dtype": str(dtype), "ours": ours_errors, "eager": eager_errors, "ulps": ulps})
    floors = [floor[dtype]] * 2 + list(grad_floors or [floor[dtype]] * len(grad_of))
    for name, ours, eager, floor_here in zip(names, ours_errors, eager_errors, floors):
        bound = max(EAGER_ERROR_FACTOR * eager, floor_here)
        assert ours <= bound, (f"{case} {dtype}: {name} relative error {ours:.3g} vs float64 exceeds "
                               f"max({EAGER_ERROR_FACTOR} x torch eager's {eager:.3g}, floor {floor_here:.3g})")
    for name, output in zip(names, outputs):
        if name in ulps:
            assert ulps[name] <= ULPS[output.dtype], \
                f"{case} {output.dtype}: {name} is {ulps[name]:.3g} ulp off float64 (> {ULPS[output.dtype]})"
    return ours_errors, eager_errors


def check_special_values_match_torch(fused, reference, inputs, grad_of=(0,), rtol=1e-6):
    """For inputs holding NaN, inf or zeros, where a relative error says nothing: ours
    and torch, in the inputs' dtype, give the same loss and gradients element by
    element, with NaN and inf (and their signs) in the same places. Finite elements agree
    within rtol of themselves or of the tensor's largest finite magnitude: an element that
    cancels to near zero (p_c - eps/C with label smoothing) carries its parts' rounding."""
    results = []
    for fn in (reference, fused):
        loss, grads = loss_and_grads(fn, inputs, grad_of)
        results.append([loss] + grads)
    names = ["loss"] + [f"grad of input {i}" for i in grad_of]
    for name, theirs, ours in zip(names, *results):
        finite = theirs[torch.isfinite(theirs)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol * scale, equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------
# Every fused loss, for the tests that treat all of them alike (GPU inputs).

class Loss(NamedTuple):
    fused: Callable            # reduction -> ours, called on the inputs
    reference: Callable        # reduction -> torch's, called on the inputs
    inputs: Callable           # (rows, cols, dtype, device="cuda") -> list of tensors, fresh random values
    grad_of: Tuple[int, ...]   # inputs that can get gradients
    reductions: Tuple[str, ...]


def random_logits(rows, cols, dtype, device="cuda"):
    return torch.randn(rows, cols, device=device).mul(2).to(dtype)


def random_probabilities(rows, cols, dtype, device="cuda"):
    return torch.randn(rows, cols, device=device).softmax(-1).to(dtype)


def random_class_targets(rows, cols, ignore_index=-100, device="cuda"):
    """int64 class indices in [0, cols), about a quarter of them ignore_index."""
    target = torch.randint(0, cols, (rows,), device=device)
    return target.masked_fill(torch.rand(rows, device=device) < 0.25, ignore_index)


LOSSES = {
    "mse_loss": Loss(
        fused=lambda reduction: lambda x, y: losses.mse_loss(x, y, reduction=reduction),
        reference=lambda reduction: lambda x, y: F.mse_loss(x, y, reduction=reduction),
        inputs=lambda rows, cols, dtype, device="cuda": [random_logits(rows, cols, dtype, device),
                                                         random_logits(rows, cols, dtype, device)],
        grad_of=(0, 1), reductions=("mean", "sum", "none")),
    "kl_div": Loss(  # probabilities in, the log fused: the seeds' use
        fused=lambda reduction: lambda p, q: losses.kl_div(p, q, reduction=reduction, log_input=False),
        reference=lambda reduction: lambda p, q: F.kl_div(torch.log(p), q, reduction=reduction),
        inputs=lambda rows, cols, dtype, device="cuda": [random_probabilities(rows, cols, dtype, device),
                                                         random_probabilities(rows, cols, dtype, device)],
        grad_of=(0, 1), reductions=("batchmean", "sum", "none")),
    "cross_entropy": Loss(
        fused=lambda reduction: lambda x, t: losses.cross_entropy(x, t, reduction=reduction),
        reference=lambda reduction: lambda x, t: F.cross_entropy(x, t, reduction=reduction),
        inputs=lambda rows, cols, dtype, device="cuda": [random_logits(rows, cols, dtype, device),
                                                         random_class_targets(rows, cols, device=device)],
        grad_of=(0,), reductions=("mean", "sum", "none")),
    # The other kernel paths: class sums (label smoothing), weights, z-loss; soft labels.
    "cross_entropy weight+smoothing+z": Loss(
        fused=lambda reduction: lambda x, t: losses.cross_entropy(
            x, t, weight=class_weights(x), reduction=reduction, label_smoothing=0.1, z_loss=1e-3),
        reference=lambda reduction: lambda x, t: cross_entropy.reference_cross_entropy(
            x, t, class_weights(x), -100, reduction, 0.1, 1e-3, False),
        inputs=lambda rows, cols, dtype, device="cuda": [random_logits(rows, cols, dtype, device),
                                                         random_class_targets(rows, cols, device=device)],
        grad_of=(0,), reductions=("mean", "sum", "none")),
    "cross_entropy probabilities": Loss(
        fused=lambda reduction: lambda x, y: losses.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1),
        reference=lambda reduction: lambda x, y: F.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1),
        inputs=lambda rows, cols, dtype, device="cuda": [random_logits(rows, cols, dtype, device),
                                                         random_probabilities(rows, cols, dtype, device)],
        grad_of=(0, 1), reductions=("mean", "sum", "none")),
}


def class_weights(logits):
    """Per-class weights from 0.5 to 1.5, in the logits' dtype and device. Each is a
    bfloat16 value, so every dtype holds it exactly: the float64 truth then weighs the
    classes as the tested dtype does (rounded to bfloat16 on one side only, the weights
    alone moved a loss by up to 1e-4)."""
    weights = torch.linspace(0.5, 1.5, logits.shape[1], device=logits.device).to(torch.bfloat16)
    return weights.to(logits.dtype)


# ----------------------------------------------------------------------------------
# Process groups: a test body on every rank of one group, failures reported with the rank.

def fsdp2_mesh(device: torch.device):
    """A mesh of device's type over the group, for fully_shard: its default mesh is CUDA whenever a GPU
    is present, even under gloo on CPU, where the ranks then crash (SIGSEGV, torch 2.11 on an H200)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (dist.get_world_size(),))


def run_on_ranks(body, args, backend, store_path, world=2, timeout=600, step_timeout=None):
    """body(rank, device, *args) in `world` spawned processes of one torch.distributed group
    (gloo on CPU, NCCL on a GPU each); asserts every rank finished, else shows each rank's error.

    A body that is a generator runs in steps: it yields (name, call); each rank calls call() and
    reports what it did (outcome 'returned' or the exception's type, its text, seconds taken), then
    waits, alive and outside any collective, until every rank has answered that step. A rank that
    has not answered a step (or gone on to the next) within step_timeout is stuck: the run fails,
    naming it. Returns {step name: [each rank's report]}."""
    context = mp.get_context("spawn")
    failures, messages = context.SimpleQueue(), context.SimpleQueue()
    between_steps = context.Barrier(world)
    processes = [context.Process(target=_run_rank, args=(body, args, rank, world, backend, str(store_path), failures,
                                                         messages, between_steps, timeout))
                 for rank in range(world)]
    for process in processes:
        process.start()
    began = time.monotonic()
    reports, last, stuck = {}, {}, []  # last: each rank's latest (time, event, step)

    def read_messages():
        while not messages.empty():
            rank, event, name, report = messages.get()
            last[rank] = (time.monotonic(), event, name)
            if event == "answered":
                reports.setdefault(name, [None] * world)[rank] = report

    while not stuck and any(process.is_alive() for process in processes):
        read_messages()
        if any(process.exitcode not in (None, 0) for process in processes):
            break  # its error is in failures; its peers may wait for it forever
        now = time.monotonic()
        stuck = [rank for rank in range(world) if processes[rank].is_alive() and
                 _is_stuck(last.get(rank), reports, last, now, step_timeout or timeout, now - began > timeout)]
        time.sleep(0.05)
    for rank in stuck:
        os.kill(processes[rank].pid, signal.SIGUSR1)  # its Python stack, on stderr
    killed = []
    for rank, process in enumerate(processes):
        process.join(timeout=1 if any(p.exitcode for p in processes) or stuck else timeout)
        if process.is_alive():
            process.kill()
            process.join()
            killed.append(rank)
    read_messages()
    lines = []
    while not failures.empty():
        lines.append(failures.get())
    lines += [f"rank {rank}: exited with code {process.exitcode}" for rank, process in enumerate(processes)
              if process.exitcode != 0 and rank not in killed and not any(f"rank {rank}:" in line for line in lines)]
    for rank in stuck:
        _, event, name = last.get(rank, (0, "starting", None))
        where = {"started": f" in step {name!r}", "answered": f" after step {name!r}"}.get(event, "")
        lines.append(f"rank {rank}: stuck{where}, killed after {step_timeout if where else timeout} s")
    if lines:
        lines += [f"step {name!r}, rank {rank}: {report}" for name, ranks in reports.items()
                  for rank, report in enumerate(ranks)]
    assert not lines, "\n".join(lines)
    return reports


def _is_stuck(mine, reports, last, now, step_timeout, too_long):
    """Whether a rank whose latest event is `mine` has taken too long: over its step, or since every
    rank answered the step it answered (a rank waiting for its peers' answers is not stuck)."""
    if mine is None:
        return too_long  # spawning, importing, joining the group: the run's timeout
    since, event, name = mine
    if event == "answered":
        if None in reports[name]:
            return False
        since = max(at for at, _, step in last.values() if step == name)
    return now - since > step_timeout


def _run_rank(body, args, rank, world, backend, store_path, failures, messages, between_steps, timeout):
    faulthandler.register(signal.SIGUSR1)  # the parent's signal where this rank is stuck
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        steps = body(rank, device, *args)
        for name, call in steps if inspect.isgenerator(steps) else ():
            messages.put((rank, "started", name, None))
            began = time.perf_counter()
            try:
                call()
                outcome, text = "returned", ""
            except Exception as error:  # the step's answer, which the test judges
                outcome, text = type(error).__name__, str(error)
            messages.put((rank, "answered", name, (outcome, text, time.perf_counter() - began)))
            between_steps.wait(timeout)  # alive, in no collective, until every rank has answered
        dist.barrier()
    except BaseException as error:  # reported by the parent, with the rank
        failures.put(f"rank {rank}: {type(error).__name__}: {error}")
        dist.destroy_process_group()
        raise
    # Every rank is done: leave without tearing the group down, whose destructors hung one
    # rank of a gloo pair on torch 2.0 in about 1 run of 5 (the other had exited).
    os._exit(0)


def backwards_on_threads(loss, leaf, grad_outputs, retain_graph):
    """torch.autograd.grad(loss, leaf, g) on a thread per g, all started at once: each thread's
    gradient, or the RuntimeError it raised."""
    barrier = threading.Barrier(len(grad_outputs))

    def backward(grad_output):
        barrier.wait()
        try:
            return torch.autograd.grad(loss, leaf, grad_output, retain_graph=retain_graph)[0]
        except RuntimeError as error:
            return error
    with concurrent.futures.ThreadPoolExecutor(len(grad_outputs)) as pool:
        return list(pool.map(backward, grad_outputs))


def capture_step(fused, inputs, grad_of, grad_output):
    """A graph of loss + gradients over static `inputs` (leaves), after a warm-up on a side
    stream as torch's docs ask. Returns the graph, its static loss and gradients."""
    wants_grad = [inputs[i] for i in grad_of]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(fused(*inputs), wants_grad, grad_output)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = fused(*inputs)
        static_grads = torch.autograd.grad(static_loss, wants_grad, grad_output)
    return graph, static_loss, static_grads
