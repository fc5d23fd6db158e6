"""Our sm_90a gemm_nt (kernels/gemm_sm90.cuh) against torch.mm (cuBLAS) on an H100/H200.

    python scripts/gemm_bench.py                      # bf16, three shapes
    python scripts/gemm_bench.py --dtype float16 --shapes 4096x4096x4096
    python scripts/gemm_bench.py --stats              # also row_stats, combine, and eval's log-probs
    python scripts/gemm_bench.py --debug              # barrier waits trap instead of hanging
    python scripts/gemm_bench.py --grad-input --shapes 768x128256x4096 384x256000x2304 --softcap 0 30

Per shape M x N x K (C = A B^T, A: M x K, B: N x K, both K-contiguous): CUDA-event time of each run
after warm-up, median of --runs; TFLOP/s = 2 M N K / time; ours / torch; whether 3 runs of ours gave
the same bits; our error norm against a float64 product of a row slice vs torch's. With --grad-input (a frozen
head's chunk of M rows, N classes, H = K): the training form (row_stats_training + combine) against torch.mm + the
statistics pass, and grad_input against the gradient pass + torch.mm (d input = g W), at each --softcap. With --stats:
row_stats alone, combine_row_stats, both, and linear_log_probs' eval through the fused product
against cuBLAS + row passes (the fused product's gate). The third default shape has d input's sizes
(8192 x 4096 x 128256), but as an NT product.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ["8192x128256x4096", "4096x4096x4096", "8192x4096x128256"]


def timed_median(fn, runs: int, warmup: int) -> float:
    """Median milliseconds of `runs` calls of fn, each between its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def slice_errors(ours, theirs, a, b, rows: int = 256):
    """Error norms of ours and of torch's against float64, over the first `rows` rows."""
    truth = a[:rows].double() @ b.double().T
    return ((ours[:rows].double() - truth).norm().item(), (theirs[:rows].double() - truth).norm().item())


def grad_input_times(ops, a, b, softcap: float, args) -> None:
    """A frozen head's chunk (rows a, classes b): ours (training form, then grad_input) against cuBLAS and the row
    passes, ms, and grad_input's TFLOP/s."""
    import row_passes
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    x = (a.float() * (3 / k ** 0.5)).to(a.dtype)  # logits of a few units, as a language model's
    target = torch.randint(0, n, (m,), device="cuda")
    row_scale = torch.full((m,), 1 / m, device="cuda")
    e = torch.empty(m, -(-n // 8) * 8, dtype=a.dtype, device="cuda")[:, :n]
    piece_max = torch.empty(-(-n // 64), m, device="cuda")
    grad = torch.empty(m, k, device="cuda", dtype=a.dtype)
    logits = torch.empty(m, n, device="cuda", dtype=a.dtype)

    def form():
        return ops.combine_row_stats(ops.row_stats_training(x, b, None, target, softcap, 1.0, 5, e, piece_max, 0))

    stats = form()
    softmax_stats = row_passes.softmax_stats_of(stats)  # the row passes'

    def cublas_forward():
        torch.mm(x, b.T, out=logits)
        fresh = row_passes.new_stats(m, a.dtype, a.device)
        row_passes.fold_stats(logits, target, 0, n, fresh, softcap)

    def cublas_backward():  # the gradient pass in place (on a gradient after the first run: the same work)
        row_passes.write_gradient(logits, logits, target, 0, n, softmax_stats, row_scale, 0.0, 0.0, softcap, 1.0)
        torch.mm(logits, b, out=grad)

    times = {name: timed_median(fn, args.runs, args.warmup) for name, fn in (
        ("form", form), ("cublas forward", cublas_forward),
        ("grad_input", lambda: ops.grad_input(e, piece_max, b, 0, stats, target, row_scale, 0.0, softcap, 1.0, grad,
                                              None, None, True, 0)),
        ("cublas backward", cublas_backward), ("mm alone", lambda: torch.mm(logits, b, out=grad)))}
    ours, theirs = times["form"] + times["grad_input"], times["cublas forward"] + times["cublas backward"]
    print(f"{'':>22} softcap {softcap:g}: training form {times['form']:.3f} ms (mm + stats {times['cublas forward']:.3f}),"
          f" grad_input {times['grad_input']:.3f} ({2 * m * n * k / times['grad_input'] / 1e9:.0f} TF/s; gradient "
          f"pass + mm {times['cublas backward']:.3f}, mm alone {times['mm alone']:.3f}); chunk {ours:.3f} against "
          f"{theirs:.3f} ({theirs / ours:.3f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="MxNxK")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--debug", action="store_true", help="build with -DFUSED_LOSSES_GEMM_DEBUG=1")
    parser.add_argument("--stats", action="store_true", help="also time row_stats (the fused product's statistics)")
    parser.add_argument("--grad-input", action="store_true", help="also time the training form and grad_input")
    parser.add_argument("--softcap", type=float, nargs="+", default=[0.0], help="--grad-input's softcaps")
    args = parser.parse_args(argv)
    if args.debug:
        os.environ["FUSED_LOSSES_NVCC_FLAGS"] = (os.environ.get("FUSED_LOSSES_NVCC_FLAGS", "") +
                                                " -DFUSED_LOSSES_GEMM_DEBUG=1").strip()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a compute capability 9.0 GPU (H100, H200)", file=sys.stderr)
        return 1
    import loader

    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    ops = loader.load("linear_ce_gemm", dtype, arch="9.0a")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; "
          f"load (build on first use) {time.perf_counter() - started:.1f} s")
    print(f"{'M x N x K':>22} {'ours ms':>9} {'torch ms':>9} {'ours TF/s':>10} {'torch TF/s':>11} {'ratio':>6} "
          f"{'bits':>5} {'err ours/torch':>15}")
    for shape in args.shapes:
        m, n, k = (int(part) for part in shape.lower().split("x"))
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype)
        ours = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        theirs = torch.empty(m, n, device="cuda", dtype=dtype)
        torch_ms = timed_median(lambda: torch.mm(a, b.T, out=theirs), args.runs, args.warmup)
        flop = 2 * m * n * k
        first = ops.gemm_nt(a, b, ours, 0).clone()
        same_bits = all(torch.equal(ops.gemm_nt(a, b, ours, 0), first) for _ in range(2))
        del first
        ours_ms = timed_median(lambda: ops.gemm_nt(a, b, ours, 0), args.runs, args.warmup)
        our_error, their_error = slice_errors(ours, theirs, a, b)
        print(f"{shape:>22} {ours_ms:9.3f} {torch_ms:9.3f} {flop / ours_ms / 1e9:10.1f} {flop / torch_ms / 1e9:11.1f} "
              f"{torch_ms / ours_ms:6.3f} {'same' if same_bits else 'DIFF':>5} {our_error / their_error:15.3f}")
        if args.stats:  # the fused product's statistics (eval's log-probs and entropy at T 0.7) against ours today
            import linear_cross_entropy
            import losses
            target = torch.randint(0, n, (m,), device="cuda")
            alone_ms = [timed_median(lambda: ops.row_stats(a, b, None, target, 0.0, 0.7, rows, 0), args.runs,
                                     args.warmup) for rows in (6, 5)]
            partials = ops.row_stats(a, b, None, target, 0.0, 0.7, 6, 0)
            combine_ms = timed_median(lambda: ops.combine_row_stats(partials), args.runs, args.warmup)
            del partials
            stats_ms = timed_median(lambda: ops.combine_row_stats(ops.row_stats(a, b, None, target, 0.0, 0.7, 6, 0)),
                                    args.runs, args.warmup)
            print(f"{'':>22} row_stats alone {alone_ms[0]:.3f} ms (5 rows: {alone_ms[1]:.3f}), combine {combine_ms:.3f}, "
                  f"both {stats_ms:.3f} ({torch_ms / stats_ms:.3f} of torch.mm's speed)")
            chosen = linear_cross_entropy.fused_product
            eval_ms = {}
            for path, decide in (("fused product", chosen), ("cuBLAS + row passes", lambda *arguments: False)):
                linear_cross_entropy.fused_product = decide
                with torch.no_grad():
                    eval_ms[path] = timed_median(lambda: losses.linear_log_probs(
                        a, b, target, temperature=0.7, return_entropy=True), args.runs, args.warmup)
            linear_cross_entropy.fused_product = chosen
            print(f"{'':>22} linear_log_probs eval (T 0.7, entropy): " +
                  ", ".join(f"{path} {ms:.3f} ms" for path, ms in eval_ms.items()) +
                  f" (fused {eval_ms['cuBLAS + row passes'] / eval_ms['fused product']:.3f}x)")
        if args.grad_input:
            for softcap in args.softcap:
                grad_input_times(ops, a, b, softcap, args)
        del a, b, ours, theirs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
