"""Each GPU kernel of one loss step, with its time and the gap before the next (on a machine with a CUDA GPU).

    python3 scripts/kernel_timeline.py [CASE_SUBSTRING ...]      e.g. ce-8192 mse

For the large cases of bench.py (ours, and torch.compile's for MSE), forward and training step:
torch.profiler records 20 steps run back to back after a warm-up, and this prints, per kernel
of a step, the median of its GPU time, the median gap before the next kernel of the step, and
the median span of a step (first kernel's start to last kernel's end). It shows where a step's
fixed costs are (the count of cross-entropy's targets, autograd's kernels, launch gaps) beside
the main kernel, which bench.py times only as a whole.
"""
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench  # noqa: E402

STEPS = 20


def step_function(fn, input_sets, train: bool):
    def step(i):
        inputs = input_sets[i % len(input_sets)]
        if train:
            inputs[0].grad = None
            fn(*inputs).backward()
        else:
            with torch.no_grad():
                fn(*inputs)
    return step


def kernels_of_steps(step):
    """The CUDA kernels (copies and memsets left out) of STEPS steps, in start order."""
    for i in range(10):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(STEPS):
            step(i)
        torch.cuda.synchronize()
    kernels = [event for event in prof.events()
               if event.device_type == torch.autograd.DeviceType.CUDA
               and "Memcpy" not in event.name and "Memset" not in event.name]
    return sorted(kernels, key=lambda event: event.time_range.start)


def report(title, kernels) -> None:
    per_step = len(kernels) // STEPS
    if per_step == 0 or len(kernels) % STEPS:
        print(f"{title}: {len(kernels)} kernels in {STEPS} steps, not the same number per step")
        return
    steps = [kernels[s * per_step:(s + 1) * per_step] for s in range(STEPS)]
    span = statistics.median(step[-1].time_range.end - step[0].time_range.start for step in steps)
    print(f"{title}: {per_step} kernels a step, step span {span:.1f} us (median)")
    for k in range(per_step):
        time = statistics.median(step[k].time_range.elapsed_us() for step in steps)
        gap = (f"{statistics.median(step[k + 1].time_range.start - step[k].time_range.end for step in steps):6.1f}"
               if k + 1 < per_step else "     -")
        print(f"   {steps[0][k].name[:72]:<72} {time:8.1f} us   gap after {gap} us")


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to time.")
        return 0
    for loss, rows, cols, dtype in bench.CASES:
        name = bench.case_name(loss, rows, cols, dtype)
        if bench.is_small(rows, cols, dtype) or (argv and not any(word in name for word in argv)):
            continue
        for impl in ("ours", "compile") if loss == "mse" else ("ours",):
            fn = bench.loss_fn_for(impl, loss)
            for train in (False, True):
                input_sets = [bench.make_inputs(loss, rows, cols, dtype) for _ in range(2)]
                for inputs in input_sets:
                    inputs[0].requires_grad_(train)
                report(f"{name} {impl} {'training step' if train else 'forward'}",
                       kernels_of_steps(step_function(fn, input_sets, train)))
                del input_sets
                bench.free_gpu_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
