"""Run from the repository root on a CUDA machine: python3 notes/experiments/fixed_cost.py

Ours' forward time (no grad; GPU time with the host queued ahead, bench.py's timing, median
of 30) against size, for cross-entropy fp32 with 4096 classes and MSE in bf16 and fp32, and
a least-squares fit time = fixed + bytes / rate: what a call costs beside its streaming."""
import statistics, sys, torch
sys.path.insert(0, ".")
import bench
def run(loss, dtype, shapes):
    fn = bench.loss_fn_for("ours", loss)
    pts = []
    for rows, cols in shapes:
        sets = bench.make_input_sets(loss, rows, cols, dtype)
        ms = statistics.median(bench.forward_times(fn, sets, 30, 5, True))
        nbytes = sum(t.numel() * t.element_size() for t in sets[0] if t.is_floating_point())
        pts.append((nbytes, ms))
        print(f"{loss} {rows}x{cols} {dtype} {ms*1e3:.1f} us {nbytes/ms/1e6:.0f} GB/s", flush=True)
        del sets; bench.free_gpu_memory()
    # least squares ms = a + b * bytes
    n = len(pts); mx = sum(p[0] for p in pts) / n; my = sum(p[1] for p in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = my - b * mx
    print(f"  fit: fixed {a*1e3:.1f} us, rate {1/b/1e6:.0f} GB/s", flush=True)
run("ce", torch.float32, [(8192, 4096), (16384, 4096), (32768, 4096), (65536, 4096)])
run("mse", torch.bfloat16, [(4096, 8192), (8192, 8192), (16384, 8192), (32768, 8192)])
run("mse", torch.float32, [(8192, 8192), (16384, 8192), (32768, 8192)])
