"""Where a forward call's time goes inside the kernel: %globaltimer stamps (notes v25).

Apply row_end_timing.patch to a checkout of d40d913 (`git apply`), which makes the CE warp-rows
kernel stamp each block's start, each warp's end with its multiprocessor, and the finish, and
adds a debug_times() op; run this with that tree as the working directory on a GPU machine.
"""
import sys, torch
sys.path.insert(0, ".")
import bench, loader
from torch.profiler import ProfilerActivity, profile
CASES = [("ce", 32768, 4096, torch.float32), ("ce", 8192, 4096, torch.float32)]
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))]
for loss, rows, cols, dtype in CASES:
    fn = bench.loss_fn_for("ours", loss)
    sets = bench.make_input_sets(loss, rows, cols, dtype)
    ops = loader.load_for_device({"ce": "cross_entropy", "mse": "mse", "kl": "kl_div"}[loss], torch.device("cuda"))
    with torch.no_grad():
        for i in range(5):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
        reports = []
        for trial in range(5):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(2_000_000)
                fn(*sets[trial % len(sets)])
                torch.cuda.synchronize()
            ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name]
            dur = sum(e.time_range.elapsed_us() for e in ks)
            sleep_end = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" in e.name]
            gap = ks[0].time_range.start - sleep_end[0].time_range.end if sleep_end and ks else float("nan")
            t = ops.debug_times().tolist()
            grid, threads = t[65534], t[65533]
            warps = grid * threads // 32
            starts = [x for x in t[:min(grid, 8192)]]
            ends = t[8192:8192 + min(warps, 32768)]
            t0 = min(starts)
            rel_s = [(x - t0) / 1e3 for x in starts]
            rel_e = [(x - t0) / 1e3 for x in ends]
            fin = (t[65535] - t0) / 1e3
            if trial == 0 and loss == "ce":
                sm = t[40960:40960 + len(ends)]
                per_sm = {}
                for e, m in zip(rel_e, sm):
                    per_sm.setdefault(m, []).append(e)
                means = sorted((sum(v) / len(v), k, len(v), min(v), max(v)) for k, v in per_sm.items())
                within = sorted(max(v) - min(v) for v in per_sm.values())
                print(f"  per-SM mean done: min {means[0][0]:.1f} (sm {means[0][1]}, {means[0][2]} warps) p50 {means[len(means)//2][0]:.1f} max {means[-1][0]:.1f} (sm {means[-1][1]}); within-SM spread p50 {within[len(within)//2]:.1f} max {within[-1]:.1f}")
                print("  slowest SMs:", [(round(m, 1), k) for m, k, *_ in means[-8:]], "fastest:", [(round(m, 1), k) for m, k, *_ in means[:8]])
            reports.append(f"  kernel {dur:7.1f} us (gap after sleep {gap:5.1f}) | grid {grid}x{threads}: block starts "
                           f"p50 {pct(rel_s,.5):5.1f} max {max(rel_s):5.1f} | warp rows done min {min(rel_e):6.1f} p10 "
                           f"{pct(rel_e,.1):6.1f} p50 {pct(rel_e,.5):6.1f} p90 {pct(rel_e,.9):6.1f} max {max(rel_e):6.1f}"
                           f" | finish {fin:6.1f} (after last rows {fin-max(rel_e):4.1f})")
    nbytes = sum(x.numel() * x.element_size() for x in sets[0] if x.is_floating_point())
    print(f"{loss} {rows}x{cols} {dtype}: {nbytes/1e6:.0f} MB, at 3100 GB/s {nbytes/3.1e6:.1f} us", flush=True)
    print("\n".join(reports), flush=True)
    del sets; bench.free_gpu_memory()
