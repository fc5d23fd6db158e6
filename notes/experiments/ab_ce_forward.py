"""Forward GPU time (ms, median of 2x30) of ours for CE shapes from AB_CASES ("rows:cols:dtype ..."), run with a
tree as cwd (bench.py and losses.py importable); also the loss error against float64. Used for notes v30."""
import json, os, statistics, sys, torch
sys.path.insert(0, ".")
import bench, losses
out = {}
for spec in os.environ.get("AB_CASES", "32768:4096:float32").split():
    rows, cols, dt = spec.split(":")
    rows, dtype, cols = int(rows), getattr(torch, dt), int(cols)
    fn = bench.loss_fn_for("ours", "ce")
    sets = bench.make_input_sets("ce", rows, cols, dtype)
    x, t = sets[0][:2]
    with torch.no_grad():
        err = abs(fn(x, t).double().item() - torch.nn.functional.cross_entropy(x.double(), t).item())
    times = []
    for _ in range(2):
        times += bench.forward_times(fn, sets, 30, 5, True)
    out[f"{rows}x{cols} {dt[5:] if dt.startswith('float') else dt}"] = (round(statistics.median(times), 5), f"{err:.0e}")
    del sets, x, t
    bench.free_gpu_memory()
print(json.dumps(out), flush=True)
