"""Forward / training-step GPU time of ours for the cases below (notes v25's A/B), on a GPU machine.

Run from a checkout (or an unpacked variant of one: `git archive REV | tar -x -C DIR`) with
that tree as the working directory, e.g. `python3 notes/experiments/ab_times.py ce mse`; the
arguments pick cases by substring. Prints one JSON line {case: median ms of 30}, the host
queued ahead as in bench.py. Run each tree in turn in one machine session, twice.
"""
import json, statistics, sys, torch
sys.path.insert(0, ".")
import bench
CASES = [  # (loss, rows, cols, dtype, train)
    ("ce", 32768, 4096, torch.float32, False), ("ce", 8192, 4096, torch.float32, False),
    ("mse", 8192, 8192, torch.bfloat16, False), ("mse", 4096, 8192, torch.bfloat16, False),
    ("mse", 32768, 32768, torch.float32, False), ("kl", 16384, 16384, torch.float16, False),
    ("ce", 8192, 128256, torch.bfloat16, False), ("ce", 8192, 50257, torch.bfloat16, False),
    ("ce", 32768, 4096, torch.float32, True), ("mse", 8192, 8192, torch.bfloat16, True),
    ("ce", 8192, 50257, torch.bfloat16, True), ("ce", 16384, 2048, torch.float32, False),
    ("ce", 8192, 32000, torch.bfloat16, False), ("kl", 16384, 16384, torch.float32, True),
    ("ce", 8192, 128256, torch.bfloat16, True), ("kl", 16384, 16384, torch.float16, True),
    ("mse", 8192, 8192, torch.float16, True), ("kl", 16384, 16384, torch.bfloat16, True),
    ("mse", 32768, 32768, torch.float32, True),
]
only = sys.argv[1:]
out = {}
for loss, rows, cols, dtype, train in CASES:
    name = f"{loss} {rows}x{cols} {str(dtype)[6:]} {'train' if train else 'fwd'}"
    if only and not any(o in name for o in only):
        continue
    fn = bench.loss_fn_for("ours", loss)
    sets = bench.make_input_sets(loss, rows, cols, dtype)
    if train:
        for s in sets:
            s[0].requires_grad_(True)
        times = bench.training_step_times(fn, sets, 30, 5, True)
    else:
        times = bench.forward_times(fn, sets, 30, 5, True)
    out[name] = round(statistics.median(times), 5)
    del sets
    bench.free_gpu_memory()
print(json.dumps(out), flush=True)
