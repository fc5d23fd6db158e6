"""Benchmark: our fused losses against eager PyTorch, torch.compile and Liger-Kernel.

    python3 bench.py                      # every case, writes bench_out/bench.json and .png
    python3 bench.py --quick              # fewer repetitions
    python3 bench.py --cases kl,ce-64     # only cases whose name contains one of these
    python3 bench.py --impls ours,eager --json out.json --plot out.png
    python3 bench.py --vocab-parallel     # 2 GPUs: tp=2 cross-entropy, ours against Megatron's formula
    python3 bench.py --linear             # linear + cross-entropy on LLM shapes (--linear-bench below)

What it measures, per case (loss, shape, dtype) and implementation:
  ours     losses.kl_div(p, q, reduction='batchmean', log_input=False), losses.mse_loss,
           losses.cross_entropy
  eager    the formulas users write today: F.kl_div(torch.log(p), q, reduction='batchmean'),
           torch.mean((x - y) ** 2), F.cross_entropy(logits, target)
  eager_F  F.mse_loss(x, y) (MSE only: the other eager formulas are torch.nn.functional's already)
  compile  torch.compile (default mode) of those same formulas
  liger    Liger-Kernel's liger_kl_div(torch.log(p), q, reduction='batchmean') and
           liger_cross_entropy(logits, target), when importable; it has no MSE
Forward time is taken under torch.no_grad(); the training step is forward + backward with the
gradient of the first input only (p, x, logits), three ways: loss.backward() ('train'),
(loss / 8).backward() as in gradient accumulation ('train/8'), and, in float16 cases, a
GradScaler's scaler.scale(loss).backward() (scale 2**16, 'scaler'). Times are medians over many
groups of 5 back-to-back steps, each group between two CUDA events, after a warm-up that
includes kernel builds and compilation. In a large case the GPU spins before each group
for twice as long as the host takes to queue it, so the events time the GPU's work with
the queue full, as in a training loop whose loss is launched while the model's kernels
still run: a step whose host side (Python, autograd) is slower than its kernels would
otherwise be timed by the host (rep_times_ms, host_ahead). In a small (launch-bound) case
the host sets the times, as it does for a small model, and its speed drifts during a run:
there the implementations take turns (5 rounds), so that the drift falls on all of them
alike. Inputs are random (softmax of randn for KL, randn for MSE and logits); the
large cases are far larger than L2, the small (launch-bound) ones rotate among enough
input sets to cover more than L2.

Bytes are the floor, the bytes any implementation must move (b = element size, per
element of the first input; CE's int64 targets are left out):
  cross-entropy  forward b   (read logits)      training 2b (+ write dlogits)
  KL             forward 2b  (read p, q)        training 3b (+ write dp)
  MSE            forward 2b  (read x, y)        training 3b (+ write dx)
GB/s = floor bytes / time. The floor time is floor bytes / the device-to-device copy
bandwidth measured in the same run (dst.copy_(src) of a 1 GiB tensor, read + write
counted), and "x floor" = measured time / floor time (1.0 = as fast as a copy). For the
small cases x floor is meaningless (launch-bound) and shown as '-'.
Liger's cross-entropy writes its gradient into the logits during the training step's
forward, so every implementation gets freshly made inputs (same seed, same data).
Peak extra memory: torch.cuda.max_memory_allocated() during one training step minus the
memory allocated just before it (inputs already allocated); it includes the gradient.
After timing, each implementation's training step ((loss / 8).backward() on copies of the
inputs) and its no-grad loss are compared with eager's (in float32 for fp16/bf16 inputs): loss
within a relative 1e-4 (fp32) or 2e-2 (fp16/bf16), gradient within the same norm-wise
relative error. The 'check' column says ok or MISMATCH; a MISMATCH of ours makes the run
exit 1. Ours runs in strict mode (FUSED_LOSSES_STRICT=1): a torch fallback raises rather
than being timed.

First use: each loss's first call in a fresh process with an empty temporary kernel cache
(the build of its kernel, then the call; one loss at a time, as a user meets it), and the
load of the three built kernels in another fresh process (after `import torch, losses`).

Without a CUDA GPU it says so, checks the CPU path against torch.nn.functional (no files
written), and exits 0, or 1 if they disagree.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import losses

try:
    from liger_kernel.transformers.functional import liger_cross_entropy, liger_kl_div
    LIGER_MISSING = None
except Exception as error:  # ImportError, or triton failing to import
    LIGER_MISSING = f"liger_kernel is not importable ({type(error).__name__}: {error})"

IMPLS = ("ours", "eager", "eager_F", "compile", "liger")
# (loss, rows, columns, dtype); cases of fewer than SMALL_CASE_BYTES per input are launch-bound.
CASES = [
    ("kl", 16384, 16384, torch.float32), ("kl", 16384, 16384, torch.float16), ("kl", 64, 1000, torch.float32),
    ("mse", 32768, 32768, torch.float32), ("mse", 8192, 8192, torch.bfloat16), ("mse", 64, 1000, torch.float32),
    ("ce", 32768, 4096, torch.float32), ("ce", 8192, 128256, torch.bfloat16),
    ("ce", 8192, 50257, torch.bfloat16),  # GPT-2's vocabulary: odd, so rows start off 16 bytes
    ("ce", 8192, 32000, torch.bfloat16),  # Llama 2's vocabulary: rows in registers, a warp per row without grad
    ("ce", 64, 1000, torch.float32),
]
SMALL_CASE_BYTES = 16 * 2**20
L2_COVER_BYTES = 128 * 2**20  # small cases rotate among input sets that add up to this much
MAX_INPUT_SETS = 512
SMALL_CASE_ROUNDS = 5  # launch-bound cases: the implementations take turns this many times
FLOOR_BYTES_PER_ELEMENT = {  # in units of the element size: (forward, training step)
    "kl": (2, 3), "mse": (2, 3), "ce": (1, 2),
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float64: 1e-8}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
COPY_BYTES = 2**30  # size of the tensor copied to measure bandwidth
# The timed modes, each a result column <mode>_ms: the no-grad forward, then training steps
# that differ in what backward starts from (grad_output): the loss itself, loss / 8
# (gradient accumulation over 8 micro-batches), and a float16 loop's GradScaler.
MODES = ("forward", "train", "train_div8", "train_scaler")
MODE_LABELS = {"forward": "fwd", "train": "train", "train_div8": "train/8", "train_scaler": "scaler"}
GRAD_SCALE = 2.0**16  # GradScaler's default initial scale


# ----------------------------------------------------------------------------------
# The losses, one function per (implementation, loss); all take the case's inputs.

def ours_kl(p, q):
    return losses.kl_div(p, q, reduction="batchmean", log_input=False)


def eager_kl(p, q):
    return F.kl_div(torch.log(p), q, reduction="batchmean")


def eager_mse(x, y):
    return torch.mean((x - y) ** 2)


def eager_ce(logits, target):
    return F.cross_entropy(logits, target)


def eager_f_mse(x, y):
    return F.mse_loss(x, y)


def liger_kl(p, q):
    return liger_kl_div(torch.log(p), q, reduction="batchmean")


def liger_ce(logits, target):
    return liger_cross_entropy(logits, target)


OURS = {"kl": ours_kl, "mse": losses.mse_loss, "ce": losses.cross_entropy}
EAGER = {"kl": eager_kl, "mse": eager_mse, "ce": eager_ce}
EAGER_F = {"mse": eager_f_mse}
LIGER = {"kl": liger_kl, "ce": liger_ce}


def loss_fn_for(impl: str, loss: str):
    """The callable to time (liger: only for the losses it has, when importable)."""
    if impl == "ours":
        return OURS[loss]
    if impl == "eager":
        return EAGER[loss]
    if impl == "eager_F":
        return EAGER_F[loss]
    if impl == "compile":
        return fresh_compile(EAGER[loss])
    return LIGER[loss]


def fresh_compile(fn):
    """torch.compile(fn) with an empty cache: every case compiles for itself, with no recompile
    limit (past 8 recompiles of one function torch runs it eagerly) and no dynamic shapes."""
    import torch._dynamo  # not imported by `import torch` on older versions
    torch._dynamo.reset()
    return torch.compile(fn)


# ----------------------------------------------------------------------------------
# Cases and inputs.

def case_name(loss, rows, cols, dtype) -> str:
    return f"{loss}-{rows}x{cols}-{DTYPE_NAMES[dtype]}"


def element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def is_small(rows, cols, dtype) -> bool:
    return rows * cols * element_size(dtype) < SMALL_CASE_BYTES


def make_inputs(loss, rows, cols, dtype):
    """One input set on the GPU: (p, q), (x, y) or (logits, target)."""
    if loss == "kl":  # softmax of 0.5 * randn: no probability near zero, even in fp16
        p = torch.softmax(0.5 * torch.randn(rows, cols, device="cuda"), dim=-1).to(dtype)
        q = torch.softmax(0.5 * torch.randn(rows, cols, device="cuda"), dim=-1).to(dtype)
        return p, q
    if loss == "mse":
        return torch.randn(rows, cols, device="cuda", dtype=dtype), torch.randn(rows, cols, device="cuda", dtype=dtype)
    logits = torch.randn(rows, cols, device="cuda", dtype=dtype)
    return logits, torch.randint(0, cols, (rows,), device="cuda")


def make_input_sets(loss, rows, cols, dtype, seed=0):
    """Input sets to rotate among; the same seed gives every implementation the same data."""
    torch.manual_seed(seed)
    bytes_per_set = 2 * rows * cols * element_size(dtype)
    count = min(MAX_INPUT_SETS, max(1, math.ceil(L2_COVER_BYTES / bytes_per_set)))
    return [make_inputs(loss, rows, cols, dtype) for _ in range(count)]


def free_gpu_memory():
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------
# Timing.

@functools.lru_cache(maxsize=None)
def sleep_cycles_per_ms() -> float:
    """Clock cycles of torch.cuda._sleep (a spinning kernel) per millisecond on this GPU."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 10**7 / start.elapsed_time(end)


def rep_times_ms(step, before_step, count: int, reps: int, warmup: int, group: int = 5,
                 host_ahead: bool = False) -> list[float]:
    """The time per step of each of reps, each rep timing `group` back-to-back steps
    between two CUDA events. before_step(i) (clearing .grad) runs inside the group; i
    cycles through the input sets.

    host_ahead: the GPU first spins (torch.cuda._sleep) for twice as long as the host takes
    to queue a group, so the events time the GPU's work alone, with the queue full: the
    host's launch overhead hidden, as in a training step whose loss is launched while the
    model's earlier kernels still run. A rep whose group the GPU began before the host had
    queued all of it is caught (its start event done too early) and the run repeated once
    with a longer spin; a step that waits for the GPU itself is timed with its waits.
    Without host_ahead (the launch-bound small cases) the time is the host's wherever the
    host is the slower side."""
    def run_steps(i, steps):
        """Steps i, i + 1, ... (input sets cycled); returns the next i."""
        for _ in range(steps):
            before_step(i % count)
            step(i % count)
            i += 1
        return i

    run_steps(0, warmup)
    torch.cuda.synchronize()
    spin_cycles = 0
    if host_ahead:
        host_ms, i = 0.0, 0
        for _ in range(3):  # the slowest of three groups
            began = time.perf_counter()
            i = run_steps(i, group)
            host_ms = max(host_ms, (time.perf_counter() - began) * 1e3)
            torch.cuda.synchronize()
        spin_cycles = int(2 * host_ms * sleep_cycles_per_ms())
    for attempt in range(2):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        started_early = 0
        i = 0
        for rep in range(reps):
            if spin_cycles:
                torch.cuda._sleep(spin_cycles)
            starts[rep].record()
            i = run_steps(i, group)
            ends[rep].record()
            started_early += spin_cycles > 0 and starts[rep].query()
        torch.cuda.synchronize()  # every event has completed before elapsed_time reads it
        if not started_early:
            break
        spin_cycles *= 4
    if started_early:  # Liger's steps: its forward and backward wait for the GPU (.item(), torch.equal)
        print(f"note: the GPU began {started_early} of {reps} groups before the host had queued them (a step "
              "that waits for the GPU, or a slow host): those times include the host's", file=sys.stderr)
    return [start.elapsed_time(end) / group for start, end in zip(starts, ends)]


def case_modes(dtype) -> tuple:
    """The modes timed for a case of this dtype: GradScaler steps only in float16."""
    return tuple(mode for mode in MODES if mode != "train_scaler" or dtype == torch.float16)


def what_backward_starts_from(mode: str):
    """loss -> the tensor whose backward() a training step of this mode calls."""
    if mode == "train":
        return lambda loss: loss
    if mode == "train_div8":
        return lambda loss: loss / 8
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):  # torch 2.3+
        return torch.amp.GradScaler("cuda", init_scale=GRAD_SCALE).scale
    return torch.cuda.amp.GradScaler(init_scale=GRAD_SCALE).scale


def forward_times(loss_fn, input_sets, reps, warmup, host_ahead) -> list[float]:
    def step(i):
        loss_fn(*input_sets[i])
    with torch.no_grad():
        return rep_times_ms(step, lambda i: None, len(input_sets), reps, warmup, host_ahead=host_ahead)


def training_step_times(loss_fn, input_sets, reps, warmup, host_ahead, mode="train") -> list[float]:
    """Inputs whose first tensor requires grad; its .grad is cleared (untimed) before each step."""
    backward_from = what_backward_starts_from(mode)

    def clear_grad(i):
        input_sets[i][0].grad = None

    def step(i):
        backward_from(loss_fn(*input_sets[i])).backward()
    return rep_times_ms(step, clear_grad, len(input_sets), reps, warmup, host_ahead=host_ahead)


def peak_extra_bytes(loss_fn, input_sets) -> int:
    """Memory a training step needs beyond its inputs (max allocated during it minus before)."""
    for inputs in input_sets:
        inputs[0].grad = None
    inputs = input_sets[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss_fn(*inputs).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    inputs[0].grad = None
    return peak


def copy_bandwidth_gbps(reps: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written, median of reps."""
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(rep_times_ms(lambda i: dst.copy_(src), lambda i: None, 1, reps, warmup=3, group=1))
    return 2 * COPY_BYTES / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------
# One (case, implementation).

def relative_error(value: torch.Tensor, reference: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||value - reference|| / ||reference||, in float64 a chunk at a time (the gradients are GBs)."""
    value, reference = value.reshape(-1), reference.reshape(-1)
    diff_sq = ref_sq = 0.0
    for start in range(0, value.numel(), chunk):
        v, r = value[start:start + chunk].double(), reference[start:start + chunk].double()
        diff_sq += float((v - r).pow(2).sum())
        ref_sq += float(r.pow(2).sum())
    return math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)


def training_step_result(loss_fn, inputs):
    """The loss and first input's gradient of (loss / 8).backward(), on a copy of that input
    (Liger's cross-entropy overwrites its logits with the gradient)."""
    first = inputs[0].detach().clone().requires_grad_()
    value = loss_fn(first, *inputs[1:])
    (value / 8).backward()
    return value.detach(), first.grad


def check_against_eager(loss, loss_fn, inputs, dtype) -> str:
    """ok / MISMATCH (what differs): this implementation's no-grad loss and its training
    step's loss and gradient against eager's on the same inputs, computed in float32 for
    2-byte dtypes (eager's own float16 KL gradient underflows: 20% off)."""
    tolerance = TOLERANCE[dtype]
    with torch.no_grad():
        no_grad_value = loss_fn(*inputs)
    value, grad = training_step_result(loss_fn, inputs)
    widened = [t.float() if t.is_floating_point() and t.element_size() == 2 else t for t in inputs]
    reference_value, reference_grad = training_step_result(EAGER[loss], widened)
    del widened
    reference = float(reference_value.double())
    problems = []
    for name, v in (("no-grad loss", no_grad_value), ("loss", value)):
        v = float(v.double())
        if not (math.isfinite(v) and abs(v - reference) <= tolerance * max(abs(reference), 1e-30)):
            problems.append(f"{name} {v:.6g} vs eager {reference:.6g}")
    grad_error = relative_error(grad, reference_grad)
    if not grad_error <= tolerance:  # NaN fails too
        problems.append(f"gradient relative error {grad_error:.3g} vs eager's")
    del no_grad_value, value, grad, reference_value, reference_grad
    free_gpu_memory()
    return "ok" if not problems else f"MISMATCH ({'; '.join(problems)})"


class Contender:
    """One implementation on one case: its loss function, its inputs, its timings so far and
    its row of results. A failure (a compile error, out of memory) ends its measurements
    with 'err' in its row; the run goes on."""

    def __init__(self, loss, rows, cols, dtype, impl):
        self.result = {"impl": impl, "check": "-", **{f"{mode}_ms": None for mode in MODES}, "peak_extra_MB": None,
                       "error": None, "note": None}
        self.times = {mode: [] for mode in case_modes(dtype)}
        self.loss_fn = self.input_sets = None
        self.impl, self.loss, self.dtype = impl, loss, dtype
        if impl == "liger" and (LIGER_MISSING or loss not in LIGER):
            self.result["note"] = LIGER_MISSING or f"liger has no {loss}"
            return

        def prepare():
            self.loss_fn = loss_fn_for(impl, loss)
            self.input_sets = make_input_sets(loss, rows, cols, dtype)
        self.attempt(prepare)

    @property
    def ready(self) -> bool:
        return self.input_sets is not None

    def attempt(self, action) -> None:
        try:
            action()
        except Exception as error:
            if self.result["check"] == "-":
                self.result["check"] = "err"
            first_line = (str(error).strip().splitlines() or [""])[0]
            self.result["error"] = f"{type(error).__name__}: {first_line[:200]}"
            self.release()

    def time(self, mode: str, reps: int, warmup: int, host_ahead: bool) -> None:
        """Adds reps timings of the forward ('forward') or a training step (MODES' others)."""
        def measure():
            if mode == "forward":
                self.times[mode] += forward_times(self.loss_fn, self.input_sets, reps, warmup, host_ahead)
                return
            for inputs in self.input_sets:
                inputs[0].requires_grad_(True)
            self.times[mode] += training_step_times(self.loss_fn, self.input_sets, reps, warmup, host_ahead, mode)
        if self.ready:
            self.attempt(measure)

    def finish(self) -> dict:
        """Medians and peak memory into the row; frees the inputs."""
        def summarize():
            for mode, times in self.times.items():
                self.result[f"{mode}_ms"] = statistics.median(times)
            self.result["peak_extra_MB"] = peak_extra_bytes(self.loss_fn, self.input_sets) / 2**20
            # Last: the check's float32 copies left a 2-byte case's later forward timings 18% slower (H100).
            self.result["check"] = ("ref" if self.impl == "eager" else
                                    check_against_eager(self.loss, self.loss_fn, self.input_sets[0], self.dtype))
        if self.ready:
            self.attempt(summarize)
        self.release()
        return self.result

    def release(self) -> None:
        self.loss_fn = self.input_sets = None
        free_gpu_memory()


def run_case(loss, rows, cols, dtype, small, impls, reps, warmup) -> list[dict]:
    """The rows of one case, one per implementation (in impls' order). A large case times
    one implementation after the other, each with the GPU's memory to itself. A small
    (launch-bound, is_small) case's times are the host's, whose speed drifts during a run:
    there the implementations take turns, SMALL_CASE_ROUNDS rounds of reps /
    SMALL_CASE_ROUNDS groups each, so that every one of them meets the same drift."""
    impls = [impl for impl in impls if impl != "eager_F" or loss in EAGER_F]  # the others' eager is F's
    turns = [impls] if small else [[impl] for impl in impls]
    rounds = SMALL_CASE_ROUNDS if small else 1
    results = []
    for together in turns:
        contenders = []
        for impl in together:
            print(f"[{case_name(loss, rows, cols, dtype)}] {impl} ...", file=sys.stderr, flush=True)
            contenders.append(Contender(loss, rows, cols, dtype, impl))
        for mode in case_modes(dtype):
            for round_index in range(rounds):
                for contender in contenders:
                    contender.time(mode, max(1, reps // rounds), warmup if round_index == 0 else 1,
                                   host_ahead=not small)
        results += [contender.finish() for contender in contenders]
    return results


def add_derived_columns(rows_of_case, loss, rows, cols, dtype, copy_gbps):
    """GB/s, x floor and speedup of ours, from the measured times."""
    n_bytes = rows * cols * element_size(dtype)
    small = is_small(rows, cols, dtype)
    ours = next((row for row in rows_of_case if row["impl"] == "ours"), None)
    for row in rows_of_case:
        for mode in MODES:
            per_element = FLOOR_BYTES_PER_ELEMENT[loss][0 if mode == "forward" else 1]
            ms = row[f"{mode}_ms"]
            floor_bytes = per_element * n_bytes
            floor_ms = floor_bytes / (copy_gbps * 1e9) * 1e3
            row[f"{mode}_floor_bytes"] = floor_bytes
            row[f"{mode}_GBps"] = floor_bytes / (ms * 1e-3) / 1e9 if ms and not small else None
            row[f"{mode}_x_floor"] = ms / floor_ms if ms and not small else None
            ours_ms = ours[f"{mode}_ms"] if ours else None
            row[f"ours_speedup_{mode}"] = ms / ours_ms if ms and ours_ms and row["impl"] != "ours" else None


# ----------------------------------------------------------------------------------
# First use: builds into an empty cache, and the cached load.

# The dtypes whose first call is measured: each is a build of its own.
FIRST_USE_DTYPES = ("float32", "bfloat16")
# Run in a fresh process: prints the seconds of its timed part. {calls} lists (loss, dtype).
FIRST_CALL = """
import time, torch, losses
def call(name, dtype):
    x = torch.rand(64, 1000, device="cuda", dtype=getattr(torch, dtype))
    if name == "cross_entropy":
        return losses.cross_entropy(x, torch.zeros(64, dtype=torch.long, device="cuda"))
    if name == "kl_div":
        return losses.kl_div(x, x, reduction="batchmean", log_input=False)
    return losses.mse_loss(x, x)
started = time.perf_counter()
for name, dtype in {calls}:
    call(name, dtype)
torch.cuda.synchronize()
print(time.perf_counter() - started)
"""
CACHED_LOAD = """
import time, torch, losses
started = time.perf_counter()
for name, dtype in {calls}:
    losses.loader.load(name, dtype)
print(time.perf_counter() - started)
"""


def timed_in_fresh_process(code: str, cache: str) -> float:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=cache)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode != 0:
        raise RuntimeError(f"first-use measurement failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def first_use_seconds() -> dict:
    """{"first_call_s": {"loss dtype": s}, "build_steps_s": {"loss dtype": ninja_step_seconds}, "build_all_s": s,
    "cached_load_s": s}: each loss's first call in each of FIRST_USE_DTYPES into an empty cache of its
    own; `python loader.py --arch <this GPU>` (every kernel and dtype) into another; then every build
    loaded from there by a fresh process."""
    with tempfile.TemporaryDirectory(prefix="fused_losses_bench_") as root:
        first_call, build_steps = {}, {}
        for name in losses.loader.KERNELS:
            for dtype in FIRST_USE_DTYPES:
                cache = os.path.join(root, f"{name}_{dtype}")
                first_call[f"{name} {dtype}"] = timed_in_fresh_process(FIRST_CALL.format(calls=[(name, dtype)]), cache)
                build_steps[f"{name} {dtype}"] = ninja_step_seconds(cache)
        warm = os.path.join(root, "all")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "loader.py", "--arch", losses.loader.device_arch()],
                              env=dict(os.environ, TORCH_EXTENSIONS_DIR=warm), capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        if done.returncode != 0:
            raise RuntimeError(f"loader.py --arch failed:\n{done.stderr[-3000:]}")
        build_all = time.perf_counter() - started
        every_build = [(name, dtype) for name in losses.loader.KERNELS for dtype in losses.loader.DTYPES]
        cached = timed_in_fresh_process(CACHED_LOAD.format(calls=every_build), warm)
        return {"first_call_s": first_call, "build_steps_s": build_steps, "build_all_s": build_all,
                "cached_load_s": cached}


def ninja_step_seconds(cache: str) -> dict:
    """How long each step of the one build under `cache` took, from ninja's log: {"cuda.cu": s (nvcc),
    "main.cpp": s (the host compiler: bindings and autograd node), "link": s}. The two compiles run
    side by side: the longer one and the link are the build's critical path."""
    steps = {}
    for log in Path(cache).glob("fused_losses/*/.ninja_log"):
        for line in log.read_text().splitlines()[1:]:
            start_ms, end_ms, _, output = line.split("\t")[:4]
            step = "cuda.cu" if output.endswith(".cuda.o") else "main.cpp" if output == "main.o" else "link"
            steps[step] = (int(end_ms) - int(start_ms)) / 1000
    return steps


def print_first_use(first_use):
    def steps(name):
        parts = first_use["build_steps_s"][name]  # empty where no ninja log was found
        return f" ({', '.join(f'{step} {s:.1f}' for step, s in parts.items())})" if parts else ""

    calls = ", ".join(f"{name} {seconds:.1f} s{steps(name)}" for name, seconds in first_use["first_call_s"].items())
    print(f"First call, empty cache (builds the loss's kernel for this GPU and dtype): {calls}. "
          f"Every kernel and dtype at once (loader.py --arch): {first_use['build_all_s']:.1f} s. "
          f"Cached load of all {len(losses.loader.KERNELS) * len(losses.loader.DTYPES)} builds in a "
          f"fresh process: {first_use['cached_load_s']:.2f} s.")


# ----------------------------------------------------------------------------------
# Output.

def fmt(value, spec=".2f", suffix=""):
    return "-" if value is None else f"{value:{spec}}{suffix}"


def print_table(results, gpu, copy_gbps):
    modes = [mode for mode in MODES if any(r[f"{mode}_ms"] is not None for r in results)]
    header = (["case", "impl", "check"] + [f"{MODE_LABELS[m]} {what}" for m in modes for what in ("ms", "x floor")]
              + [f"ours speedup {MODE_LABELS[m]}" for m in modes] + ["peak extra MB"])
    lines = [header]
    for r in results:
        check = "MISMATCH" if r["check"].startswith("MISMATCH") else r["check"]
        lines.append([r["case"], r["impl"], check]
                     + [fmt(r[f"{m}_{key}"], spec) for m in modes for key, spec in (("ms", ".3f"), ("x_floor", ".2f"))]
                     + [fmt(r[f"ours_speedup_{m}"], ".2f", "x") for m in modes] + [fmt(r["peak_extra_MB"], ".0f")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(f"\nGPU: {gpu}   copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) if j < 3 else cell.rjust(w) for j, (cell, w) in enumerate(zip(line, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("x floor: time / (floor bytes / copy bandwidth); '-' for launch-bound cases. "
          "ours speedup: that row's time / ours' time.\n"
          "Large cases: GPU time, the host queued ahead; small cases: time per call as the host sees it.")
    for r in results:
        if r["error"]:
            print(f"  {r['case']} {r['impl']}: {r['error']}")
        if r["check"].startswith("MISMATCH"):
            print(f"  {r['case']} {r['impl']}: {r['check']}")
    if any(r["impl"] == "liger" for r in results):
        print(f"liger: {LIGER_MISSING}" if LIGER_MISSING else "liger has no MSE loss: '-'.")


def write_json(path, report):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    print(f"wrote {path}", file=sys.stderr)


def write_plot(path, results, impls):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot", file=sys.stderr)
        return
    cases = [c for c in dict.fromkeys(r["case"] for r in results)
             if any(r["case"] == c and r["forward_x_floor"] is not None for r in results)]
    if not cases:
        return
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(cases)) * 2, 5))
    width = 0.8 / len(impls)
    for ax, mode in zip(axes, ("forward", "train")):
        for k, impl in enumerate(impls):
            values = {r["case"]: r[f"{mode}_x_floor"] for r in results if r["impl"] == impl}
            xs = [i + k * width for i, c in enumerate(cases) if values.get(c) is not None]
            ys = [values[c] for c in cases if values.get(c) is not None]
            ax.bar(xs, ys, width, label=impl)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right")
        ax.set_ylabel("time / floor time (lower is better, 1 = copy speed)")
        ax.set_title("forward (under no_grad)" if mode == "forward" else "training step (forward + backward)")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


# ----------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy (--vocab-parallel, 2 GPUs): ours with process_group= against
# Megatron-LM's formula in torch ops, on the same shards of 8192 x 128256 bf16 logits.

VOCAB_PARALLEL_CASE = (8192, 128256, torch.bfloat16)


class MegatronCrossEntropy(torch.autograd.Function):
    """Megatron-LM's tensor-parallel cross-entropy as torch ops ('mean' over rows): the
    shard's max, shifted logits, exp and softmax are (N, V/tp) float32 tensors, the softmax
    kept for backward, which turns it into the gradient in place."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        import torch.distributed as dist
        shifted = logits.float()
        row_max = shifted.max(dim=1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted -= row_max[:, None]
        owned = (target >= vocab_start) & (target < vocab_start + logits.shape[1])
        index = (target - vocab_start).clamp(0, logits.shape[1] - 1)
        sums = torch.stack([shifted.exp().sum(dim=1), shifted.gather(1, index[:, None])[:, 0] * owned])
        dist.all_reduce(sums, group=group)
        softmax = shifted.exp_().div_(sums[0][:, None])
        ctx.save_for_backward(softmax, index, owned)
        ctx.dtype = logits.dtype
        return (sums[0].log() - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, index] -= owned.float()
        return softmax.mul_(grad / softmax.shape[0]).to(ctx.dtype), None, None, None


def vocab_parallel_worker(rank, store, reps, warmup, results):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rows, vocab, dtype = VOCAB_PARALLEL_CASE
        width, start = vocab // 2, rank * (vocab // 2)
        torch.manual_seed(0)  # every rank draws the whole logits and keeps its shard
        full = torch.randn(rows, vocab, device="cuda", dtype=dtype)
        shard = full[:, start:start + width].clone().requires_grad_()
        target = torch.randint(0, vocab, (rows,), device="cuda")
        del full
        group = dist.group.WORLD
        impls = {"ours": lambda x: losses.cross_entropy(x, target, process_group=group),
                 "megatron": lambda x: MegatronCrossEntropy.apply(x, target, group, start)}
        report = {}
        for name, loss_fn in impls.items():
            checked = shard.detach().clone().requires_grad_()
            value = loss_fn(checked)
            value.backward()
            report[f"{name}_loss"], report[f"{name}_grad"] = value.item(), checked.grad
            dist.barrier()
            # Not host_ahead: its retry could run one rank's collectives without the other's.
            times = training_step_times(loss_fn, [(shard,)], reps, warmup, host_ahead=False)
            report[f"{name}_train_ms"] = statistics.median(times)
            report[f"{name}_peak_extra_MB"] = peak_extra_bytes(loss_fn, [(shard,)]) / 2**20
        ours_grad, megatron_grad = report.pop("ours_grad"), report.pop("megatron_grad")
        report["grad_relative_difference"] = relative_error(ours_grad, megatron_grad)
        if rank == 0:
            report["gpu"] = torch.cuda.get_device_name()
            results.put(report)
    finally:
        dist.destroy_process_group()


def run_vocab_parallel(reps, warmup) -> dict:
    """Times a tp=2 training step (forward + backward of this rank's shard) on GPUs 0 and 1."""
    import torch.multiprocessing as mp
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        processes = [context.Process(target=vocab_parallel_worker,
                                     args=(rank, os.path.join(folder, "store"), reps, warmup, results))
                     for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
    if any(process.exitcode != 0 for process in processes) or results.empty():
        raise RuntimeError(f"a vocab-parallel rank failed: exit codes {[p.exitcode for p in processes]}")
    report = results.get()
    rows, vocab, dtype = VOCAB_PARALLEL_CASE
    print(f"\nVocabulary-parallel cross-entropy, tp=2, {rows}x{vocab} {DTYPE_NAMES[dtype]} (rank 0's shard "
          f"{rows}x{vocab // 2}), {report['gpu']} x2, training step (forward + backward):")
    for name in ("ours", "megatron"):
        print(f"  {name:9s} {report[name + '_train_ms']:.3f} ms   peak extra {report[name + '_peak_extra_MB']:.0f} MB"
              f"   loss {report[name + '_loss']:.6f}")
    print(f"  gradient relative difference ours vs Megatron's formula: {report['grad_relative_difference']:.2e}")
    return report


# ----------------------------------------------------------------------------------
# Linear + cross-entropy (--linear): a step's loss from the last hidden states (N, H) and the
# output layer's weight (V, H), 5% of targets ignored, in each setup (LINEAR_SETUPS):
#   train         bf16 input and weight, gradients of both      floor: 3 products (x w^T, g w, g^T x)
#   frozen head   bf16, input's gradient alone (LoRA)            floor: 2 (x w^T, g w)
#   fp32 master   float32 weight under bf16 autocast, both grads floor: 3 (and eager's bf16 copy of w)
#   accurate      train, ours with acc_policy="accurate" (d weight  floor: 3
#                 summed in float32, rounded once; the peers as in train)
#   eval          bf16, no gradient                              floor: 1 (x w^T)
# The implementations:
#   floor      the setup's matrix products alone, cuBLAS
#   ours       losses.linear_cross_entropy
#   eager      F.cross_entropy(F.linear(x, w), target) (softcap: s * tanh(logits / s) between)
#   compile    torch.compile (default mode) of eager
#   liger      Liger-Kernel's LigerFusedLinearCrossEntropyLoss, when importable
#   cce        Cut Cross-Entropy's linear_cross_entropy (default: small gradients filtered out),
#   cce_exact  and with filter_eps=None, when importable
# The implementations take turns, LINEAR_ROUNDS rounds of steps each between two CUDA events, so
# that the GPU's clock (an H100 at its 700 W limit runs these at 1.3-1.6 GHz) falls on all alike.
# Peak extra MB: peak allocated during one step, minus what was allocated before it, minus the
# gradients it returns (no .grad held before the step). The check compares the loss and the
# gradients with eager's (relative norm-wise error <= 2e-2).

# RL scoring (issue 57): per-token log-probs at a temperature and the entropy (detached), the
# log-probs weighted by per-token advantages; setups as below but fp32 master; verl's fused kernel
# where a verl wheel is installed (pip install --no-deps is enough). (name, rows, hidden, vocab, temperature)
RL_CASES = (("Llama 3 RL, T 0.7", 8192, 4096, 128256, 0.7),)
RL_SETUPS = ("eval", "frozen head", "train")
YARDSTICKS = ("ours lce",)  # rl_impls' call of another sum: timed, not checked against eager
LINEAR_CASES = (("Llama 3", 8192, 4096, 128256, None), ("Llama 3, longer", 16384, 4096, 128256, None),
                ("Gemma 2 2B", 8192, 2304, 256000, 30.0))
# setup -> (weight's dtype, gradients of (input, weight), autocast, matrix products of the floor)
LINEAR_SETUPS = {"train": (torch.bfloat16, (True, True), False, 3),
                 "frozen head": (torch.bfloat16, (True, False), False, 2),
                 "fp32 master": (torch.float32, (True, True), True, 3),
                 "accurate": (torch.bfloat16, (True, True), False, 3),
                 "eval": (torch.bfloat16, (False, False), False, 1)}
LINEAR_ROUNDS = 3


def accurate_options():
    """acc_policy="accurate" (d weight summed in float32): torch 2.14's options, or a stand-in where torch has none."""
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    return options(acc_policy="accurate") if options is not None else types.SimpleNamespace(acc_policy="accurate")


def linear_ce_impls(softcap, setup: str) -> dict:
    def eager(x, w, t):
        logits = F.linear(x, w)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, t)

    options = accurate_options() if setup == "accurate" else None
    impls = {"ours": lambda x, w, t: losses.linear_cross_entropy(x, w, t, softcap=softcap, options=options),
             "eager": eager, "compile": fresh_compile(eager)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        impls["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as error:  # not installed, or triton failing to import
        print(f"liger: not importable ({type(error).__name__}: {error})", file=sys.stderr)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        impls["cce"] = lambda x, w, t: cce(x, w, t, softcap=softcap)
        impls["cce_exact"] = lambda x, w, t: cce(x, w, t, softcap=softcap, filter_eps=None)
    except Exception as error:
        print(f"cce: not importable ({type(error).__name__}: {error})", file=sys.stderr)
    return impls


def rl_impls(temperature, advantages) -> dict:
    """GRPO's per-token terms: (log p(target) * advantages).sum() plus the mean entropy, detached (a
    metric). eager: TRL's formula, the logits whole in float32; ours: linear_log_probs; ours lce:
    linear_cross_entropy(reduction='none') at temperature 1 without the entropy (ours may cost <= 3% more)."""
    def eager(x, w, t):
        log_p = torch.log_softmax(F.linear(x, w).float() / temperature, -1)
        picked = log_p.gather(-1, t.clamp(min=0)[:, None])[:, 0].masked_fill(t == -100, 0.0)
        with torch.no_grad():
            entropy = -(log_p.exp() * log_p).sum(-1).masked_fill(t == -100, 0.0)
        return (picked * advantages).sum() + entropy.mean()

    def ours(x, w, t):
        picked, entropy = losses.linear_log_probs(x, w, t, temperature=temperature, return_entropy=True)
        return (picked * advantages).sum() + entropy.detach().mean()

    def ours_without(x, w, t):  # issue 57's yardstick: the same call without the entropy and the temperature
        return -(losses.linear_cross_entropy(x, w, t, reduction="none").float() * advantages).sum()

    impls = {"ours": ours, "ours lce": ours_without, "eager": eager, "compile": fresh_compile(eager)}
    try:
        verl = verl_linear_cross_entropy()

        def verl_step(x, w, t):  # its labels take no ignore_index: ignored rows get class 0, then 0 weight
            picked, entropy = verl(x, w, t.clamp(min=0), float(temperature), "none")
            return (picked.masked_fill(t == -100, 0.0) * advantages).sum() + entropy.detach().mean()

        impls["verl"] = verl_step
    except Exception as error:
        print(f"verl: not importable ({type(error).__name__}: {error})", file=sys.stderr)
    return impls


def verl_linear_cross_entropy():
    """verl's fused (log-probs, entropy) kernel from an installed verl wheel, without verl's package
    imports (Ray and the rest): its two kernel files as a package, with the four device helpers they use."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("no verl wheel installed")
    root = spec.submodule_search_locations[0]
    for name, folder in (("verl", root), ("verl.utils", f"{root}/utils"), ("verl.utils.kernel", f"{root}/utils/kernel")):
        package = types.ModuleType(name)
        package.__path__ = [folder]
        sys.modules[name] = package
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_capability = lambda device_id=0: torch.cuda.get_device_capability(device_id)
    sys.modules["verl.utils.device"] = device
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    return linear_cross_entropy


def linear_floor(x, w, products: int):
    """The setup's matrix products, cuBLAS alone."""
    with torch.no_grad():
        g = x @ w.t()
        if products >= 2:
            g @ w
        if products >= 3:
            g.t() @ x


def run_linear_case(name, rows, hidden, vocab, softcap, setup, reps, warmup, temperature=None) -> list[dict]:
    """A case of LINEAR_CASES (softcap), or of RL_CASES (temperature: rl_impls)."""
    weight_dtype, (grad_x, grad_w), autocast, products = LINEAR_SETUPS[setup]
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(grad_x)
    w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).to(weight_dtype).requires_grad_(grad_w)
    target = torch.randint(0, vocab, (rows,), device="cuda").masked_fill_(torch.rand(rows, device="cuda") < 0.05, -100)
    leaves = [tensor for tensor in (x, w) if tensor.requires_grad]
    grad_bytes = sum(tensor.numel() * tensor.element_size() for tensor in leaves)
    impls = (linear_ce_impls(softcap, setup) if temperature is None
             else rl_impls(temperature, torch.randn(rows, device="cuda")))

    def step(loss_fn):
        x.grad = w.grad = None
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast), torch.set_grad_enabled(bool(leaves)):
            loss = loss_fn(x, w, target)
        if leaves:
            loss.backward()
        return loss

    floor_w = w.detach().to(torch.bfloat16)
    steps = {"floor": lambda: linear_floor(x, floor_w, products),
             **{impl: functools.partial(step, loss_fn) for impl, loss_fn in impls.items()}}
    failed = {}
    for impl, run_step in list(steps.items()):  # warm-up: builds, compilation, autotuning
        try:
            for _ in range(warmup):
                run_step()
        except Exception as error:  # a peer that does not take this setup
            failed[impl] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
            del steps[impl]
    times = {impl: [] for impl in steps}
    for _ in range(LINEAR_ROUNDS):
        for impl, run_step in steps.items():
            for _ in range(max(1, reps // LINEAR_ROUNDS)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run_step()
                end.record()
                end.synchronize()
                times[impl].append(start.elapsed_time(end))
    results = []
    eager = None
    for impl in steps:
        free_gpu_memory()
        x.grad = w.grad = None
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outputs = None
        if impl == "floor":
            steps[impl]()
            extra = None
        else:
            value = steps[impl]()
            extra = (torch.cuda.max_memory_allocated() - before - grad_bytes) / 2**20
            outputs = (value.detach().float(), *(tensor.grad for tensor in leaves))
            if impl == "eager":
                eager = outputs
        results.append({"case": name, "setup": setup, "shape": [rows, hidden, vocab], "softcap": softcap,
                        "impl": impl, "train_ms": statistics.median(times[impl]), "peak_extra_MB": extra,
                        "outputs": outputs})
    x.grad = w.grad = None
    floor_ms = results[0]["train_ms"]
    for result in results:
        outputs = result.pop("outputs")
        result["x_floor"] = result["train_ms"] / floor_ms
        if outputs is not None and eager is not None and result["impl"] not in YARDSTICKS:
            errors = [relative_error(ours, reference) for ours, reference in zip(outputs, eager)]
            result["check"] = "ok" if max(errors) <= 2e-2 else "MISMATCH " + ", ".join(f"{e:.2g}" for e in errors)
    results.extend({"case": name, "setup": setup, "shape": [rows, hidden, vocab], "softcap": softcap, "impl": impl,
                    "check": f"failed: {why}"} for impl, why in failed.items())
    del eager
    free_gpu_memory()
    return results


def run_linear(reps, warmup, filter_text="") -> list[dict]:
    wanted = [word for word in filter_text.split(",") if word]
    results = []
    for case in LINEAR_CASES:
        for setup in LINEAR_SETUPS:
            if not wanted or any(word in f"{case[0]} / {setup}" for word in wanted):
                results.append(run_linear_case(*case, setup, reps, warmup))
    for name, rows, hidden, vocab, temperature in RL_CASES:
        for setup in RL_SETUPS:
            if not wanted or any(word in f"{name} / {setup}" for word in wanted):
                results.append(run_linear_case(name, rows, hidden, vocab, None, setup, reps, warmup, temperature))
    gpu = torch.cuda.get_device_name()
    print(f"\nLinear + cross-entropy, a step of each setup (bf16 products), {gpu}:")
    print(f"  {'case':17s} {'setup':12s} {'impl':10s} {'ms':>8s} {'x floor':>8s} {'peak extra MB':>14s} "
          f"{'ours faster':>12s}  check")
    for case_results in results:
        ours_ms = next((r["train_ms"] for r in case_results if r["impl"] == "ours" and "train_ms" in r), None)
        for r in case_results:
            if "train_ms" not in r:
                print(f"  {r['case']:17s} {r['setup']:12s} {r['impl']:10s} {r['check']}")
                continue
            extra = "-" if r["peak_extra_MB"] is None else f"{r['peak_extra_MB']:.0f}"
            faster = "-" if r["impl"] in ("floor", "ours") or ours_ms is None else f"{r['train_ms'] / ours_ms:.2f}x"
            print(f"  {r['case']:17s} {r['setup']:12s} {r['impl']:10s} {r['train_ms']:8.2f} {r['x_floor']:8.2f} "
                  f"{extra:>14s} {faster:>12s}  {r.get('check', '')}")
    return [r for case_results in results for r in case_results]


# ----------------------------------------------------------------------------------
# Entry points.

def cpu_check():
    """No GPU: show the CPU path giving torch.nn.functional's values."""
    print("No CUDA GPU found: nothing to time. Checking the CPU path against torch.nn.functional:")
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(64, 1000), dim=-1)
    q = torch.softmax(torch.randn(64, 1000), dim=-1)
    x, y = torch.randn(64, 1000), torch.randn(64, 1000)
    target = torch.randint(0, 1000, (64,))
    hidden, head, bias = torch.randn(64, 128), torch.randn(1000, 128) / 128**0.5, torch.randn(1000)
    pairs = [
        ("kl_div", ours_kl(p, q), eager_kl(p, q)),
        ("mse_loss", losses.mse_loss(x, y), F.mse_loss(x, y)),
        ("cross_entropy", losses.cross_entropy(x, target), F.cross_entropy(x, target)),
        # torch 2.14's F.linear_cross_entropy, by its definition (older torch has none)
        ("linear_cross_entropy", losses.linear_cross_entropy(hidden, head, target, linear_bias=bias),
         F.cross_entropy(F.linear(hidden, head, bias), target)),
    ]
    mismatches = 0
    for name, ours, reference in pairs:
        match = torch.allclose(ours, reference, rtol=1e-6, atol=0)
        mismatches += not match
        print(f"  {name:20s} ours {ours.item():.6f}  torch {reference.item():.6f}  {'match' if match else 'MISMATCH'}")
    print("No timings without a GPU, so nothing is written to bench_out/.")
    return 1 if mismatches else 0


def liger_version():
    if LIGER_MISSING:
        return None
    try:
        from importlib.metadata import version
        return version("liger-kernel")
    except Exception:  # importable from a plain folder, without package metadata
        return "unknown version"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (5 warm-up, 10 timed)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names, e.g. kl,ce-64 "
                        "(with --linear: of 'case / setup', e.g. 'Llama 3 / frozen')")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 50, quick 10)")
    parser.add_argument("--json", default="bench_out/bench.json", help="where to write the results")
    parser.add_argument("--plot", default="bench_out/bench.png", help="where to write the plot")
    parser.add_argument("--no-first-use", action="store_true", help="skip the first-use builds (about 1-2 minutes)")
    parser.add_argument("--linear", action="store_true",
                        help="only linear + cross-entropy on Llama 3 and Gemma 2 shapes (LINEAR_CASES)")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="only the tp=2 cross-entropy over torch.distributed (NCCL, GPUs 0 and 1)")
    return parser.parse_args(argv)


def selected_cases(filter_text):
    wanted = [word for word in filter_text.split(",") if word]
    return [case for case in CASES if not wanted or any(word in case_name(*case) for word in wanted)]


def main(argv=None):
    """bench.py's command line as a function (the notebook calls it): strict mode only while it runs."""
    strict = os.environ.get("FUSED_LOSSES_STRICT")
    try:
        return run(parse_args(argv))
    finally:
        if strict is None:
            os.environ.pop("FUSED_LOSSES_STRICT", None)
        else:
            os.environ["FUSED_LOSSES_STRICT"] = strict


def run(args):
    if not torch.cuda.is_available():
        return cpu_check()
    impls = [impl for impl in args.impls.split(",") if impl]
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        print(f"unknown --impls {','.join(unknown)}; choose from {','.join(IMPLS)}", file=sys.stderr)
        return 2
    reps = args.reps or (10 if args.quick else 50)
    warmup = 5 if args.quick else 10
    if args.vocab_parallel:
        os.environ["FUSED_LOSSES_STRICT"] = "1"  # ours: the row passes, never the torch-op path
        if torch.cuda.device_count() < 2:
            print("--vocab-parallel needs 2 GPUs", file=sys.stderr)
            return 2
        report = run_vocab_parallel(reps, warmup)
        write_json(args.json, {"torch": torch.__version__, "cuda": torch.version.cuda, "vocab_parallel": report})
        close = abs(report["ours_loss"] - report["megatron_loss"]) <= 2e-2 * abs(report["megatron_loss"])
        return 0 if close and report["grad_relative_difference"] <= 2e-2 else 1
    os.environ["FUSED_LOSSES_STRICT"] = "1"  # time our kernels, never a torch fallback
    if args.linear:
        results = run_linear(args.reps or (6 if args.quick else 15), 2 if args.quick else 3, args.cases)
        write_json(args.json, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "cuda": torch.version.cuda, "linear": results})
        return 0 if all(r.get("check", "ok") == "ok" for r in results if r["impl"] == "ours") else 1
    gpu = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps(reps)
    free_gpu_memory()
    print(f"{gpu}: copy bandwidth {copy_gbps:.0f} GB/s", file=sys.stderr)
    if LIGER_MISSING:
        print(LIGER_MISSING, file=sys.stderr)

    first_use = None if args.no_first_use else first_use_seconds()
    results = []
    for loss, rows, cols, dtype in selected_cases(args.cases):
        name = case_name(loss, rows, cols, dtype)
        small = is_small(rows, cols, dtype)
        case_reps = 4 * reps if small else reps  # launch-bound: cheap, and noisier
        rows_of_case = run_case(loss, rows, cols, dtype, small, impls, case_reps, warmup)
        for result in rows_of_case:
            result.update(case=name, loss=loss, shape=[rows, cols], dtype=DTYPE_NAMES[dtype], launch_bound=small)
        add_derived_columns(rows_of_case, loss, rows, cols, dtype, copy_gbps)
        results.extend(rows_of_case)

    report = {
        "gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
        "copy_bandwidth_GBps": copy_gbps, "copy_bytes_moved": 2 * COPY_BYTES,
        "reps": reps, "warmup": warmup, "quick": args.quick,
        "timing": "large cases: GPU time, the host queued ahead (rep_times_ms host_ahead); "
                  "small cases: per call as the host sees it",
        "liger": liger_version(), "liger_note": LIGER_MISSING,
        "floor_bytes_per_element": {loss: {"forward": fwd, "train": train}
                                    for loss, (fwd, train) in FLOOR_BYTES_PER_ELEMENT.items()},
        "first_use": first_use,
        "results": results,
    }
    write_json(args.json, report)
    write_plot(args.plot, results, impls)
    print_table(results, gpu, copy_gbps)
    if first_use:
        print_first_use(first_use)
    failed = [r["case"] for r in results if r["impl"] == "ours" and r["check"] != "ok"]
    if failed:
        print(f"ours failed its check (or ran into an error) in: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
