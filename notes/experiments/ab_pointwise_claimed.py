"""Not yet run (written in session 13, which had no device time left). Forward GPU time (ms, median of
ROUNDS x 30) of the library's sum-only pointwise forward against pointwise_claimed_proto.cu: warps claim
chunks that the copy engine brings into shared memory, exact sums. VARIANTS = chunk bytes:warps:stages:
blocks a multiprocessor; CASES = loss:rows:cols:dtype. Run from the repository root on an sm_90 GPU."""
import json, os, statistics, sys, time, torch
sys.path.insert(0, ".")
import bench
from torch.utils.cpp_extension import load_inline
here = os.path.dirname(os.path.abspath(__file__))
t0 = time.time()
ext = load_inline(
    name="pw_claimed_exp", cpp_sources=["at::Tensor claimed_loss(at::Tensor input, at::Tensor target, int64_t which, int64_t chunk_bytes, int64_t warps, int64_t stages, int64_t max_blocks, double scale);"],
    cuda_sources=["namespace fused_losses { at::Tensor claimed_loss(at::Tensor, at::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double); }\n"
                  "at::Tensor claimed_loss(at::Tensor a, at::Tensor b, int64_t w, int64_t c, int64_t wa, int64_t s, int64_t m, double sc) { return fused_losses::claimed_loss(a, b, w, c, wa, s, m, sc); }\n"
                  + open(os.path.join(here, "pointwise_claimed_proto.cu")).read()],
    functions=["claimed_loss"], extra_include_paths=[os.path.abspath("kernels")],
    extra_cuda_cflags=["-O3", "-lineinfo", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
print(f"built in {time.time()-t0:.0f} s", flush=True)
VARIANTS = [tuple(int(x) for x in v.split(":")) for v in os.environ.get("VARIANTS",
    "4096:8:2:1 4096:8:1:2 8192:8:1:1 2048:16:2:1 4096:16:1:1 2048:8:2:1 4096:4:2:2 8192:4:2:1 2048:8:2:2 1024:16:2:2 4096:8:3:1 2048:16:1:2").split()]
CASES = [c.split(":") for c in os.environ.get("CASES", "mse:8192:8192:bfloat16 mse:32768:32768:float32 kl:16384:16384:float32 kl:16384:16384:float16").split()]
ROUNDS = int(os.environ.get("ROUNDS", "2"))
results = {}
for loss, rows, cols, dt in CASES:
    rows, cols, dtype = int(rows), int(cols), getattr(torch, dt)
    sets = bench.make_input_sets(loss, rows, cols, dtype)
    n = rows * cols
    scale = 1.0 / n if loss == "mse" else 1.0 / rows
    which = 0 if loss == "mse" else 1
    fns = {"lib": bench.loss_fn_for("ours", loss)}
    for v in VARIANTS:
        fns["c%d w%d s%d b%d" % v] = (lambda v: lambda a, b: ext.claimed_loss(a, b, which, v[0], v[1], v[2], v[3], scale))(v)
    ref = fns["lib"](*sets[0]).double().item()
    times = {k: [] for k in fns}
    bad = {}
    for name, fn in fns.items():
        try:
            a = fn(*sets[0]); b = fn(*sets[0]); torch.cuda.synchronize()
            if not torch.equal(a, b): bad[name] = "nondeterministic"
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            if abs(a.double().item() - ref) > tol * abs(ref): bad[name] = f"value {a.item()} vs {ref}"
        except Exception as e:
            bad[name] = str(e)[:200]
    for r in range(ROUNDS):
        for name, fn in fns.items():
            if name in bad: continue
            times[name] += bench.forward_times(fn, sets, 30, 5, True)
    key = f"{loss} {rows}x{cols} {dt}"
    results[key] = {k: round(statistics.median(t), 5) for k, t in times.items() if t}
    results[key]["bad"] = bad
    print(key, json.dumps(results[key]), flush=True)
    del sets; bench.free_gpu_memory()
out = os.environ.get("OUT", ".")
json.dump(results, open(os.path.join(out, "claimed.json"), "w"), indent=1)
