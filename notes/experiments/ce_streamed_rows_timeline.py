"""Timeline of the CE sum-only streamed forward (rows by blocks), from %globaltimer stamps (notes v33).

Apply ce_streamed_rows_timeline.patch to a checkout of 542ae28 (`git apply`): the kernel then stamps each
block's start, each row's end with its block and multiprocessor, and the finish, and the build gains a
debug_times() op. Run this with that tree as the working directory on a GPU machine. Times in us from the
first block's start; "floor" is the case's bytes at 3004 GB/s.
"""
import sys, torch
sys.path.insert(0, ".")
import bench, loader
ops = loader.load_for_device("cross_entropy", torch.device("cuda"))
def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))]
for rows, cols, dtype in [(8192, 50257, torch.bfloat16), (8192, 50304, torch.bfloat16), (16384, 50257, torch.bfloat16), (8192, 128256, torch.bfloat16)]:
    fn = bench.loss_fn_for("ours", "ce")
    sets = bench.make_input_sets("ce", rows, cols, dtype)
    row_bytes = cols * 2
    with torch.no_grad():
        for i in range(5): fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
        for trial in range(3):
            torch.cuda._sleep(2_000_000)  # the call's launch queued behind it: no host gaps
            fn(*sets[trial % len(sets)])
            torch.cuda.synchronize()
            t = ops.debug_times().tolist()
            grid, threads = t[65534], t[65533]
            starts = t[:grid]
            t0 = min(starts)
            ends = [(x - t0) / 1e3 for x in t[8192:8192 + rows]]
            info = t[40960:40960 + rows]
            fin = (t[65535] - t0) / 1e3
            rel_s = [(x - t0) / 1e3 for x in starts]
            # each block's last row end
            last_by_block = {}
            for e, inf in zip(ends, info):
                b = inf >> 16
                last_by_block[b] = max(last_by_block.get(b, 0), e)
            lb = list(last_by_block.values())
            print(f"{rows}x{cols}: grid {grid}x{threads}, floor@3004 GB/s {rows * row_bytes / 3.004e6:.1f} us | "
                  f"starts p50 {pct(rel_s,.5):.1f} max {max(rel_s):.1f} | block done min {min(lb):.1f} p10 {pct(lb,.1):.1f} "
                  f"p50 {pct(lb,.5):.1f} p90 {pct(lb,.9):.1f} max {max(lb):.1f} | finish {fin:.1f} (+{fin-max(lb):.1f})", flush=True)
            if trial == 0:
                # bytes finished per 10 us bin (rows counted at their end: a lagging view of the read rate)
                bins = {}
                for e in ends: bins[int(e // 10)] = bins.get(int(e // 10), 0) + 1
                print("  rows ended per 10 us:", [bins.get(i, 0) for i in range(int(max(ends) // 10) + 1)])
                print("  GB/s per 10 us bin:", [round(bins.get(i, 0) * row_bytes / 10e3) for i in range(int(max(ends) // 10) + 1)], flush=True)
                first_end = sorted(ends)[:5]
                print("  first row ends:", [round(x, 1) for x in first_end], flush=True)
    del sets; bench.free_gpu_memory()
