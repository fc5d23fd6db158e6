"""Where a launch-bound loss call spends its host time (on a machine with a CUDA GPU).

    python3 scripts/host_overhead.py [--rows 64] [--cols 1000] [--calls 3000]

Small losses are bound by host work per call, not by the GPU. For each loss this times,
per call, with no synchronization inside the loop (the queue stays full, as in training):
  eager      torch's formula (what users write today)
  ours       the losses.* call, Python layer included
  op         the kernel op alone, called with the arguments the loss module would pass
  launch     one tiny aten kernel launch (x.add_(1) on a 1-element tensor), for scale
and the same for a training step (forward + backward). "ours - op" is our Python layer;
"op" holds the C++ checks, allocations and our launch (one: the loss kernel's last block
adds the blocks' partial sums).
"""
import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import loader  # noqa: E402
import loss_helpers  # noqa: E402
import losses  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA GPU: nothing to time.")
        return 0
    device = torch.device("cuda")
    x = torch.randn(args.rows, args.cols, device=device)
    y = torch.randn_like(x)
    p, q = x.softmax(-1), y.softmax(-1)
    t = torch.randint(0, args.cols, (args.rows,), device=device)
    mean = loss_helpers.REDUCTION_CODES["mean"]
    batchmean = loss_helpers.REDUCTION_CODES["batchmean"]
    ce_op = loader.load_for_device("cross_entropy", device, x.dtype).forward
    mse_op = loader.load_for_device("mse", device, x.dtype).forward
    kl_op = loader.load_for_device("kl_div", device, x.dtype).forward
    cases = {
        "cross_entropy": (lambda a: F.cross_entropy(a, t), lambda a: losses.cross_entropy(a, t),
                          lambda a, g: ce_op(a, t, None, -100, mean, False, 0.0, 0.0, 1.0, g, False, False, False, g)),
        "mse_loss": (lambda a: torch.mean((a - y) ** 2), lambda a: losses.mse_loss(a, y),
                     lambda a, g: mse_op(a, y, mean, 1.0 / a.numel(), False, g, False, g)),
        "kl_div": (lambda a: F.kl_div(torch.log(a), q, reduction="batchmean"),
                   lambda a: losses.kl_div(a, q, reduction="batchmean", log_input=False),
                   lambda a, g: kl_op(a, q, batchmean, 1.0 / a.shape[0], False, g, False, g, False, False)),
    }
    one = torch.zeros(1, device=device)
    launch = per_call_us(lambda: one.add_(1), args.calls)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.rows}x{args.cols} float32; "
          f"microseconds per call; one tiny aten launch: {launch:.1f}")
    print(f"{'loss':<14} {'pass':<9} {'eager':>7} {'ours':>7} {'op':>7}  ours - op (our Python)")
    for name, (eager, ours, op) in cases.items():
        inputs = p if name == "kl_div" else x
        with torch.no_grad():
            row = [per_call_us(lambda: fn(inputs), args.calls) for fn in (eager, ours)]
            row.append(per_call_us(lambda: op(inputs, False), args.calls))
        print(f"{name:<14} {'forward':<9} {row[0]:7.1f} {row[1]:7.1f} {row[2]:7.1f}  {row[1] - row[2]:.1f}")
        leaf = inputs.detach().requires_grad_()

        def train(fn):
            leaf.grad = None
            fn(leaf).backward()
        row = [per_call_us(lambda: train(fn), args.calls) for fn in (eager, ours)]
        print(f"{name:<14} {'training':<9} {row[0]:7.1f} {row[1]:7.1f} {'-':>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
