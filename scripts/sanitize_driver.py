"""Runs every fused kernel once per regime, for compute-sanitizer (scripts/sanitize.sh).

Each loss x float32/float16/bfloat16 x reduction, forward without grad, and forward +
backward with grad (backward from 2.5, so the in-place scale runs too), on odd shapes:
a vector body with a scalar tail, one element, a misaligned view, and for
cross-entropy rows in registers (C = 5) and beyond them (C = 40000, 150001, and 40001 and 65537
in more rows than the grid has blocks; C = 4099 in enough rows for a warp each without grad),
with weight, label smoothing, z-loss, probability targets and inplace_backward; under bfloat16
autocast the same kernels again in backward (their recompute, grad_output 2.5). The row passes
(kernels/row_passes.cu): cross-entropy with softcap (a warp a row, and a block a row where rows are few) in
float64 too, and linear_cross_entropy under each schedule (choose_schedule), float32 d weight summed.
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["FUSED_LOSSES_STRICT"] = "1"  # a torch fallback would leave a kernel unchecked
import losses  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def misaligned(rows, cols, dtype):
    """A view one element into its storage: no 16-byte vectors."""
    return torch.randn(rows * cols + 1, device="cuda", dtype=dtype)[1:].view(rows, cols)


def pointwise_shapes(dtype):
    yield torch.randn(7, 1000, device="cuda", dtype=dtype)
    yield torch.randn(3, 4099, device="cuda", dtype=dtype)  # 4099: scalar tail
    yield torch.randn(1, 1, device="cuda", dtype=dtype)
    yield misaligned(3, 1001, dtype)


def logits_shapes(dtype):
    yield torch.randn(7, 1000, device="cuda", dtype=dtype)
    yield torch.randn(3, 4099, device="cuda", dtype=dtype)
    yield torch.randn(1, 1, device="cuda", dtype=dtype)
    yield misaligned(3, 1001, dtype)
    yield torch.randn(9, 5, device="cuda", dtype=dtype)  # C = 5: many rows per block's worth
    yield torch.randn(3, 40000, device="cuda", dtype=dtype)  # beyond the register cache: streamed, stashed
    yield torch.randn(2, 150001, device="cuda", dtype=dtype)  # odd, and too long to stash whole: a tail read twice
    # More rows than blocks: each block (sm_90: each cluster) takes several, its shared
    # memory refilled row after row.
    rows = 2 * torch.cuda.get_device_properties(0).multi_processor_count + 1
    yield torch.randn(rows, 40001, device="cuda", dtype=dtype)
    # The same with three stages per block (sm_90: 65537 classes, clusters of 2 or 4).
    yield torch.randn(rows, 65537, device="cuda", dtype=dtype)
    # Without grad, a warp per row: at least 8 rows per multiprocessor, odd C beyond a warp's registers.
    yield torch.randn(8 * rows, 4099, device="cuda", dtype=dtype)


def run(loss_fn, inputs, grad_of):
    with torch.no_grad():
        loss_fn(*inputs)
    leaves = [t.detach().requires_grad_(i in grad_of) for i, t in enumerate(inputs)]
    loss = loss_fn(*leaves)
    loss.backward(torch.full_like(loss, 2.5))


def main():
    for dtype in DTYPES:
        for x in pointwise_shapes(dtype):
            y = torch.randn_like(x)
            for reduction in ("mean", "sum", "none"):
                run(lambda a, b: losses.mse_loss(a, b, reduction=reduction), [x, y], (0, 1))
            p, q = x.sigmoid() + 0.01, y.sigmoid()
            for reduction in ("batchmean", "sum", "none"):
                for log_input in (False, True):
                    for log_target in (False, True):
                        inputs = [p if not log_input else p.log(), q if not log_target else q.log()]
                        run(lambda a, b: losses.kl_div(a, b, reduction=reduction, log_target=log_target,
                                                       log_input=log_input), inputs, (0, 1))
        for logits in logits_shapes(dtype):
            rows, classes = logits.shape
            target = torch.randint(0, classes, (rows,), device="cuda")
            target[0] = -100  # one ignored row
            weight = torch.rand(classes, device="cuda", dtype=dtype)
            probabilities = torch.randn(rows, classes, device="cuda").softmax(1).to(dtype)
            for reduction in ("mean", "sum", "none"):
                for index_dtype in (torch.int64, torch.int32):
                    run(lambda a, t: losses.cross_entropy(a, t, reduction=reduction),
                        [logits, target.to(index_dtype)], (0,))
                run(lambda a, t: losses.cross_entropy(a, t, weight=weight, reduction=reduction, label_smoothing=0.1,
                                                      z_loss=1e-3), [logits, target], (0,))
                run(lambda a, y: losses.cross_entropy(a, y, weight=weight, reduction=reduction, label_smoothing=0.1),
                    [logits, probabilities], (0, 1))
                # a temperature: the exp's constant and the coefficients' 1 / T in every path
                run(lambda a, t: losses.cross_entropy(a, t, weight=weight, reduction=reduction, label_smoothing=0.1,
                                                      temperature=0.7), [logits, target], (0,))
            run(lambda a, t: losses.cross_entropy(a * 1, t, inplace_backward=True, return_lse=True)[0],
                [logits, target], (0,))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        recomputes()
    for dtype in DTYPES + (torch.float64,):
        row_passes(dtype)
    torch.cuda.synchronize()
    print("sanitize_driver: every kernel ran")


def recomputes():
    """Autocast's bfloat16 scalar losses: backward from 2.5 runs each forward kernel again (recompute_gradients_)."""
    for x in pointwise_shapes(torch.bfloat16):
        run(lambda a, b: losses.mse_loss(a, b), [x, torch.randn_like(x)], (0, 1))
        run(lambda a, b: losses.kl_div(a, b, reduction="batchmean"), [x.sigmoid().log(), x.sigmoid()], (0, 1))
    for logits in logits_shapes(torch.bfloat16):
        rows, classes = logits.shape
        target = torch.randint(0, classes, (rows,), device="cuda")
        weight = torch.rand(classes, device="cuda", dtype=torch.bfloat16)
        probabilities = torch.randn(rows, classes, device="cuda").softmax(1).bfloat16()
        run(lambda a, t: losses.cross_entropy(a, t, weight=weight, label_smoothing=0.1, z_loss=1e-3), [logits, target],
            (0,))
        run(lambda a, y: losses.cross_entropy(a, y, reduction="sum"), [logits, probabilities], (0, 1))


def row_passes(dtype):
    """Softcap cross-entropy, linear_cross_entropy and the log-probs, which run kernels/row_passes.cu."""
    many = 32 * torch.cuda.get_device_properties(0).multi_processor_count + 3  # a warp a row from here
    for rows, classes in ((3, 1000), (many, 1001), (2, 70001), (1, 1)):
        logits = torch.randn(rows, classes, device="cuda", dtype=dtype)
        target = torch.randint(0, classes, (rows,), device="cuda")
        target[0] = -100
        for reduction in ("mean", "sum", "none"):
            run(lambda a, t: losses.cross_entropy(a, t, softcap=30.0, label_smoothing=0.1, z_loss=1e-3,
                                                  reduction=reduction), [logits, target], (0,))
        # log-probs and entropy at a temperature: the entropy's statistic and gradient term
        run(lambda a, t: sum(losses.log_probs(a, t, temperature=0.7, softcap=30.0, return_entropy=True)),
            [logits, target], (0,))
    x = torch.randn(37, 64, device="cuda", dtype=dtype)
    head, bias = torch.randn(1001, 64, device="cuda", dtype=dtype) / 8, torch.randn(1001, device="cuda", dtype=dtype)
    target = torch.randint(0, 1001, (37,), device="cuda")
    target[1] = -100
    for grad_of in ((0,), (0, 1, 3), (1,)):  # frozen head, the whole layer, the head alone
        run(lambda a, w, t, b: sum(losses.linear_log_probs(a, w, t, linear_bias=b, temperature=0.7,
                                                           return_entropy=True)), [x, head, target, bias], grad_of)
        for reduction in ("mean", "sum", "none"):
            for softcap in (None, 30.0):
                run(lambda a, w, t, b: losses.linear_cross_entropy(a, w, t, linear_bias=b, reduction=reduction,
                                                                   softcap=softcap, z_loss=1e-3),
                    [x, head, target, bias], grad_of)
    if dtype == torch.bfloat16:  # a float32 master weight under autocast: d weight summed in float32
        with torch.autocast("cuda", dtype=dtype):
            run(lambda a, w, t: losses.linear_cross_entropy(a, w, t), [x.float(), head.float(), target], (0, 1))


if __name__ == "__main__":
    main()
