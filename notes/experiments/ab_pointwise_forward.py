"""Forward GPU time (ms, median of 2x30) of ours for the KL and MSE bench cases; run with a tree as cwd. Notes v30."""
import json, statistics, sys, torch
sys.path.insert(0, ".")
import bench
out = {}
for loss, rows, cols, dtype in [("mse", 8192, 8192, torch.bfloat16), ("mse", 32768, 32768, torch.float32),
                                ("kl", 16384, 16384, torch.float32), ("kl", 16384, 16384, torch.float16),
                                ("mse", 4096, 8192, torch.bfloat16)]:
    fn = bench.loss_fn_for("ours", loss)
    sets = bench.make_input_sets(loss, rows, cols, dtype)
    times = []
    for _ in range(2):
        times += bench.forward_times(fn, sets, 30, 5, True)
    out[f"{loss} {rows}x{cols} {str(dtype)[6:]}"] = round(statistics.median(times), 5)
    del sets
    bench.free_gpu_memory()
print(json.dumps(out), flush=True)
