"""Linear + cross-entropy: torch 2.14's F.linear_cross_entropy(input, linear_weight, target, *,
linear_bias, weight, ...), i.e. F.cross_entropy(F.linear(input, linear_weight, linear_bias), target),
without the (N, V) logits in memory, on the row-pass engine (row_passes.py). Below the public
function, weight and bias are the linear layer's (F.linear's names); its `weight` is class
weights, as torch's. Class weights, probabilities and K-dimensional weights take its fallback:
the logits whole.

The logits are made a chunk at a time, F.linear in the operands' dtype as eager's, and turned
into their gradient in place (rounded to that dtype as eager's d logits are). choose_schedule
picks how, from the gradients wanted and d weight's dtype:
- "rows": chunks of rows with every class (ROW_CHUNK_BYTES), so each row's lse is complete in its
  chunk: the forward writes the loss, d input = g W and, where wanted, d weight += g^T x summed in
  the accumulation type over the chunks (a float32 master weight's gradient is that sum itself):
  1 product for eval, 2 for a frozen head, 3 for a float32 d weight. Backward only scales them by
  grad_output (on CUDA nothing to do for 1). Chunks that make d input alone (a frozen head, and the
  forward below) take our products on cc 9.0 (gradient_form): the first writes the logits' gradient
  form with the statistics, the second reads it into d input: no pass over the chunk.
- "rows_then_classes": a 2-byte d weight: the forward as above for the loss and d input; backward
  recomputes the logits a chunk of classes at a time (CHUNK_BYTES) for d W_c = g^T x, written once,
  whole: 4 products, one chunk of memory, no float32 sum.
- "classes": with a process group, or float16 gradients: the statistics a chunk of classes at a
  time, then in backward every gradient from the logits recomputed (d input summed in float32).
No atomics anywhere: the same bits every run.

With process_group (vocab_parallel.Shards) weight and bias are this rank's rows of the
vocabulary: the statistics are combined across the group between the passes, and input's
gradient is summed over it (one more all-reduce, of N x H, in backward).
"""
from __future__ import annotations

import functools
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.loss import _WeightedLoss

if __package__:
    from . import cross_entropy as ce
    from . import loss_helpers as helpers
    from . import row_passes, vocab_parallel
else:
    import cross_entropy as ce
    import loss_helpers as helpers
    import row_passes
    import vocab_parallel

CHUNK_BYTES = 1 << 26  # one chunk of logits: 64 MB, or MIN_CHUNK_CLASSES wide when N is larger
# d input's float32 sum is read and written once a chunk: narrower chunks make that traffic
# count (H100, 16384 x 4096 x 128256 bf16: 2048 classes a chunk, 1.62x the floor; 4096: 1.52x).
MIN_CHUNK_CLASSES = 4096
CHUNK_ALIGN = 128      # chunk widths, in classes: whole tiles for the matrix products
# torch >= 2.8 multiplies 2-byte matrices into a float32 sum on CUDA (addmm's out_dtype).
_ADDMM_OUT_DTYPE = "dtype" in torch.ops.aten.addmm.overloads()


def chunk_width(rows: int, vocab: int, element_size: int) -> int:
    """Classes per chunk: CHUNK_BYTES of logits in whole CHUNK_ALIGN tiles, at least
    MIN_CHUNK_CLASSES, at most vocab."""
    width = CHUNK_BYTES // max(rows * element_size, 1) // CHUNK_ALIGN * CHUNK_ALIGN
    return max(1, min(max(width, MIN_CHUNK_CLASSES), vocab))


# Row chunks hold every class, so each row's lse is complete in its chunk: at most ROW_CHUNK_BYTES
# of logits. Smaller chunks cost the products and the row passes their efficiency (H100, frozen
# Llama 3 8192 rows a step: 128 MB chunks 31.3 ms, 256 MB 28.7, 512 MB 27.0; notes v47).
ROW_CHUNK_BYTES = 1 << 28
ROW_ALIGN = 128  # rows a chunk: whole tiles for the matrix products
# d weight summed over row chunks is read and written once a chunk (V x H x 8 bytes): at least
# SUM_CHUNK_ROWS rows a chunk keep that traffic small beside the products.
SUM_CHUNK_ROWS = 4096


def row_chunk_rows(vocab: int, element_size: int, summing: bool = False) -> int:
    """Rows per chunk: ROW_CHUNK_BYTES of logits in whole ROW_ALIGN tiles, at least ROW_ALIGN
    (SUM_CHUNK_ROWS where d weight is summed over the chunks)."""
    rows = max(ROW_CHUNK_BYTES // max(vocab * element_size, 1) // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN)
    return max(rows, SUM_CHUNK_ROWS) if summing else rows


def choose_schedule(wants, reduction: str, weight_dtype, input_dtype, shards, softcap: float = 0.0,
                    float32_weight_sum: bool = False) -> str:
    """The one choice of schedule, from the gradients wanted (input, weight, bias) and where d
    weight may be summed:
    "rows": everything in the forward, a chunk of rows (every class) at a time: the loss, d input,
      and d weight and d bias summed over the chunks in the accumulation type. Taken where that
      sum is the gradient itself (a float32 master weight under autocast; float32 or float64
      throughout) or float32_weight_sum asks for it (a V x H float32 buffer for 2-byte weights),
      and for no d weight at all (a frozen head): 2 or 3 matrix products.
    "rows_then_classes": a 2-byte d weight, or reduction 'none' (whose per-row grad_output a sum
      cannot take): the loss and d input by rows in the forward, d weight and d bias by chunks of
      classes in backward, their logits recomputed: 4 products, one chunk of memory. Not with a
      softcap: its second gradient pass, compute-bound there, costs more than the float32 d input
      sum that "classes" adds (H100, Gemma 2 8192 x 2304 x 256000: 71.9 ms against 65.6).
    "classes": a 2-byte d weight with a softcap (above); no gradient (eval: its one product in
      chunks of classes, whose row passes have every row to run over, ran 1-8% faster on an H100);
      a process group; float16 gradients (whose range cannot hold them before a loss scale
      multiplies them: grad_output comes in backward): the statistics by chunks of classes, every
      gradient from the logits recomputed in backward."""
    if shards is not None or not any(wants) or input_dtype == torch.float16:
        return "classes"
    if not (wants[1] or wants[2]):
        return "rows"
    exact_sum = weight_dtype == helpers.accumulation_dtype(input_dtype) or float32_weight_sum
    if exact_sum and reduction != "none":
        return "rows"
    return "classes" if softcap else "rows_then_classes"


def _chunks(weight, bias, width):
    for start in range(0, weight.shape[0], width):
        end = min(start + width, weight.shape[0])
        yield start, weight[start:end], None if bias is None else bias[start:end]


def _add_matmul_(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """total += a @ b, with total in the accumulation type; first: total = a @ b, total's old
    values (uninitialized memory) never read."""
    beta = 0 if first else 1
    if a.dtype == total.dtype:
        total.addmm_(a, b, beta=beta)
    elif not a.is_cuda:
        total.addmm_(a.to(total.dtype), b.to(total.dtype), beta=beta)  # as _mm
    elif _ADDMM_OUT_DTYPE:
        torch.addmm(total, a, b, beta=beta, out_dtype=total.dtype, out=total)
    elif first:  # older torch: each chunk's product rounded once to the operands' dtype
        total.copy_(a @ b)
    else:
        total.add_(a @ b)


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b. On CPU 2-byte operands are multiplied in float32, rounded once: torch 2.0's CPU
    kernels sum some shapes in the 2-byte type, twice eager's error on d weight."""
    if a.is_cuda or a.dtype not in helpers.LOW_PRECISION:
        torch.mm(a, b, out=out)
    else:
        out.copy_(a.float() @ b.float())


def _counts(target, ignore_index: int, divisor):
    """The rows a 'mean' divides by: those not ignored, or divisor (0-dim, the accumulation type)."""
    return (target != ignore_index).sum() if divisor is None else divisor


def fused_product(x, weight, bias) -> bool:
    """The one choice of how the statistics are made: by our sm_90a product with the row passes in its
    epilogue (linear_ce_gemm's row_stats: no logits in memory), or by cuBLAS chunks and the row passes.
    The fused product takes a cc 9.0 GPU and a CUDA 12+ torch (loader.BUILDS_SM90A), 2-byte operands of one
    dtype (bias too), rows the copy engine reads (contiguous along H, H and the row strides multiples of 8,
    rows apart, 16 B-aligned; < 2^31 rows), outside torch.compile."""
    if not (x.is_cuda and x.dtype in helpers.LOW_PRECISION and weight.dtype == x.dtype and x.numel() and weight.numel()
            and (bias is None or bias.dtype == x.dtype) and not helpers.is_compiling()):
        return False
    if not helpers.loader.BUILDS_SM90A or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    return all(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.stride(0) >= t.shape[1] and t.shape[0] < 2**31
               and t.data_ptr() % 16 == 0 for t in (x, weight)) and \
        x.shape[1] % 8 == 0


def gradient_form(x, weight, bias, wants, label_smoothing: float, stat_rows: int = row_passes.STAT_ROWS) -> bool:
    """The one choice of how a chunk of rows that makes d input alone (a frozen head; a 2-byte d weight's forward,
    whose d weight the backward makes from the logits again) makes it: by our sm_90a products (linear_ce_gemm's
    row_stats_training writes the logits' gradient form, E, with the statistics; grad_input multiplies it by the
    weight, scaling each row and 64 classes as it reads them: no pass over the chunk), or by cuBLAS and the row
    passes. The form takes the fused product (fused_product), bfloat16 (float16 gradients wait for their loss
    scale), and no label smoothing (its term is not a row's multiple of E); the entropy's sum rides along (stat_rows
    6: linear_log_probs' return_entropy, without its gradient). H200, power-capped: Gemma 2's frozen step 7% faster,
    Llama 3's the same; a 2-byte d weight's step the same at Llama 3 (8k, 16k), 9% faster at 8192 x 1024 x 50304;
    less memory (notes v61, v62, v65, v71)."""
    return (tuple(wants) == (True, False, False) and x.dtype == torch.bfloat16 and not label_smoothing
            and fused_product(x, weight, bias))


# At least FORM_ROWS rows a chunk where gradient_form: fewer make d input's product skinny (H200, frozen Llama 3
# 8192 x 4096 x 128256: 896 rows 27.9 ms, 1024 in 2 parts 26.8; Gemma 2: 384 rows 34.8, 1024 in 3 parts 33.3;
# notes v70). Their bytes stay within the budget by a vocabulary in parts (form_parts).
FORM_ROWS = 1024
FORM_PART_ALIGN = 192  # a vocabulary part's classes: whole tiles of row_stats' (kGemmRowStatsTileColumns)


def _part_width(vocab: int, parts: int) -> int:
    """The classes of each of form_parts' parts but the last: whole FORM_PART_ALIGN tiles."""
    share = -(-vocab // parts)
    return min(-(-share // FORM_PART_ALIGN) * FORM_PART_ALIGN, vocab)


def _form_bytes(rows: int, vocab: int, hidden: int, parts: int, stat_rows: int = row_passes.STAT_ROWS) -> int:
    """A gradient-form chunk's bytes: a part's E and its pieces' exponents, with its statistics' partials and d
    input's float32 sum (in the partials' memory after them where the vocabulary is whole; carried beside them
    from part to part)."""
    width = _part_width(vocab, parts)
    partials, carry = 4 * stat_rows * -(-width // FORM_PART_ALIGN), 4 * hidden
    return rows * (2 * (-(-width // 8) * 8) + 4 * -(-width // 64) +
                   (max(partials, carry) if parts == 1 else partials + carry))


def _form_budget(vocab: int) -> int:
    """A gradient-form chunk's bytes at most: the logits a cuBLAS chunk of row_chunk_rows holds."""
    return row_chunk_rows(vocab, 2) * vocab * 2


def gradient_form_rows(vocab: int, hidden: int, stat_rows: int = row_passes.STAT_ROWS) -> int:
    """Rows a chunk where gradient_form: as many whole ROW_ALIGN tiles as keep its bytes (_form_bytes, the vocabulary
    whole) within _form_budget, and at least FORM_ROWS (form_parts_for then cuts the vocabulary into parts)."""
    rows = _form_budget(vocab) // _form_bytes(1, vocab, hidden, 1, stat_rows) // ROW_ALIGN * ROW_ALIGN
    return max(rows, FORM_ROWS)


def form_parts_for(rows: int, vocab: int, hidden: int, stat_rows: int = row_passes.STAT_ROWS) -> int:
    """The fewest vocabulary parts whose bytes (_form_bytes) a chunk of `rows` keeps within _form_budget."""
    budget = _form_budget(vocab)
    parts = 1
    while parts * FORM_PART_ALIGN < vocab and _form_bytes(rows, vocab, hidden, parts, stat_rows) > budget:
        parts += 1
    return parts


def form_parts(vocab: int, parts: int) -> list:
    """[(first, end), ...]: the vocabulary in at most `parts` parts of _part_width classes (the last the rest)."""
    width = _part_width(vocab, parts)
    return [(first, min(first + width, vocab)) for first in range(0, vocab, width)]


def _gradient_form_chunk(x, weight, bias, target, row_scale, z_loss: float, softcap: float, temperature: float,
                         grad_x, parts: int = 1, stat_rows: int = row_passes.STAT_ROWS):
    """A chunk of rows by the gradient form (gradient_form): its statistics (stat_rows, rows) returned, its d input
    for a grad_output of 1 written into grad_x. The vocabulary in `parts` (form_parts): each part's E in turn, d
    input's float32 sum carried from part to part (grad_input), the statistics combined as they come."""
    ops = helpers.kernel_ops("linear_ce_gemm", x)
    rows, vocab = x.shape[0], weight.shape[0]
    bounds = form_parts(vocab, parts)
    width = max(end - first for first, end in bounds)
    e_rows = torch.empty(rows, -(-width // 8) * 8, dtype=x.dtype, device=x.device)  # rows 16 B-aligned
    piece_rows = torch.empty(-(-width // 64), rows, dtype=torch.float32, device=x.device)
    carry = torch.empty(x.shape, dtype=torch.float32, device=x.device) if len(bounds) > 1 else None
    stats = None
    for first, end in bounds:
        e, piece_max = e_rows[:, :end - first], piece_rows[:-(-(end - first) // 64)]  # the part's columns, pieces
        part_stats = ops.combine_row_stats(ops.row_stats_training(
            x, weight[first:end], None if bias is None else bias[first:end].contiguous(),
            target - first if first else target, float(softcap), float(temperature), stat_rows, e, piece_max, 0))
        previous, stats = stats, (part_stats if stats is None else
                                  ops.combine_row_stats(torch.stack((stats, part_stats))))  # as tiles of the row
        head = row_passes.STAT_ROWS  # grad_input reads the statistics without the entropy's row
        ops.grad_input(e, piece_max, weight, first, stats[:head], target, row_scale, float(z_loss), float(softcap),
                       float(temperature), grad_x, carry, None if previous is None else previous[:head], end == vocab, 0)
    return stats


def forward_wants(wants, schedule: str) -> tuple:
    """The gradients (input, weight, bias) a row schedule's forward writes: all of them for "rows", d input alone
    for "rows_then_classes" (its backward makes d weight and d bias from the logits again)."""
    return tuple(wants) if schedule == "rows" else (wants[0], False, False)


def build_together(rows, weight, bias, wants, schedule: str, label_smoothing: float = 0.0,
                   stat_rows: int = row_passes.STAT_ROWS) -> None:
    """A first call that needs two builds (the classes schedule's fused statistics, then its row passes' gradient;
    the gradient form, then the row passes' scale of d input by grad_output or the backward's gradient) has them
    built side by side, not one after the other."""
    if ((schedule == "classes" and any(wants) and fused_product(rows, weight, bias)) or
            (schedule != "classes" and gradient_form(rows, weight, bias, forward_wants(wants, schedule),
                                                     label_smoothing, stat_rows))):
        helpers.loader.load_together_for_device(("linear_ce_gemm", "row_passes"), rows.device, rows.dtype)


def fold_linear(x, weight, bias, target, start: int, softcap: float, temperature: float = 1.0,
                stat_rows: int = row_passes.STAT_ROWS):
    """The statistics of F.linear(x, weight, bias)'s rows, classes [start, start + V) of weight's V
    rows (start > 0: a shard of a larger vocabulary): from the fused product where fused_product says
    so, else a chunk of classes at a time."""
    rows, local = x.shape[0], weight.shape[0]
    if fused_product(x, weight, bias):
        ops = helpers.kernel_ops("linear_ce_gemm", x)
        local_target = target - start if start else target
        partials = ops.row_stats(x, weight, None if bias is None else bias.contiguous(), local_target, float(softcap),
                                 float(temperature), stat_rows, 0)  # the launcher's grid
        return ops.combine_row_stats(partials)  # row_passes.combine_tiles' arithmetic, one kernel
    stats = row_passes.new_stats(rows, x.dtype, x.device, stat_rows)
    for first, w, b in _chunks(weight, bias, chunk_width(rows, local, x.element_size())):
        row_passes.fold_stats(F.linear(x, w, b), target, start + first, start + local, stats, softcap,
                              temperature=temperature)
    return stats


def linear_gradients(x, weight, bias, target, start: int, classes, softmax_stats, row_scale,
                     label_smoothing: float, z_loss: float, softcap: float, wants, temperature: float = 1.0,
                     entropy_scale=None):
    """The gradients of input (in the accumulation type), weight and bias (in the operands'
    dtype; None where wants says no), the logits recomputed a chunk of classes at a time; the rest
    as write_gradient's."""
    acc = softmax_stats.dtype
    local = weight.shape[0]
    grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if wants[0] else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=x.device) if wants[1] else None
    grad_b = torch.empty(local, dtype=acc, device=x.device) if wants[2] else None
    for first, w, b in _chunks(weight, bias, chunk_width(x.shape[0], local, x.element_size())):
        g = F.linear(x, w, b)
        row_passes.write_gradient(g, g, target, start + first, classes, softmax_stats, row_scale, label_smoothing,
                                  z_loss, softcap, temperature, entropy_scale)  # in place
        end = first + g.shape[1]
        if wants[0]:
            _add_matmul_(grad_x, g, w)
        if wants[1]:
            _mm(g.t(), x, grad_w[first:end])
        if wants[2]:
            torch.sum(g, 0, dtype=acc, out=grad_b[first:end])
    return grad_x, grad_w, grad_b


def loss_pass(x, weight, bias, target, divisor, ignore_index: int, label_smoothing: float, z_loss: float,
              softcap: float, temperature: float, reduction: str, shards=None):
    """The "classes" forward: (loss, softmax_stats, count, classes) (row_passes.finish's; count
    divisor where given), the loss reduced: 0-dim, or (N,) for 'none'."""
    stats = fold_linear(x, weight, bias, target, 0 if shards is None else shards.start, softcap, temperature)
    loss, softmax_stats, count, classes = row_passes.finish(stats, target, ignore_index, weight.shape[0],
                                                            label_smoothing, z_loss, shards)
    count = count if divisor is None else divisor
    return row_passes.reduce_loss(loss, count, reduction), softmax_stats, count, classes


def rows_in_forward(x, weight, bias, target, row_scale, label_smoothing: float, z_loss: float, softcap: float,
                    temperature: float, wants, stat_rows: int = row_passes.STAT_ROWS, chunk_rows: int = 0):
    """The "rows" schedule's pass, a chunk of rows with every class at a time: their logits and statistics, then
    their gradient (in place, each row times row_scale's), times weight into d input, and summed into d weight and
    d bias (wants says which); by the gradient form where gradient_form says so (d input alone). chunk_rows: rows a
    chunk (torch's batch_chunk_size), 0 for the memory rule (gradient_form_rows, row_chunk_rows). Returns
    (stats, (d input, d weight, d bias)), None where not wanted; d weight and d bias in the accumulation type."""
    rows, vocab = x.shape[0], weight.shape[0]
    acc = helpers.accumulation_dtype(x.dtype)
    stats = row_passes.new_stats(rows, x.dtype, x.device, stat_rows)
    grad_x = torch.empty_like(x) if wants[0] else None
    # Written by the first chunk's product (beta 0): no pass to zero it. No rows: zeros.
    grad_w = (torch.empty if rows else torch.zeros)(weight.shape, dtype=acc, device=x.device) if wants[1] else None
    grad_b = torch.zeros(vocab, dtype=acc, device=x.device) if wants[2] else None
    form = gradient_form(x, weight, bias, wants, label_smoothing, stat_rows)
    height = chunk_rows or (gradient_form_rows(vocab, x.shape[1], stat_rows) if form else
                            row_chunk_rows(vocab, x.element_size(), wants[1]))
    for first in range(0, rows, height):
        end = min(first + height, rows)
        if form:
            stats[:, first:end] = _gradient_form_chunk(x[first:end], weight, bias, target[first:end],
                                                       row_scale[first:end], z_loss, softcap, temperature,
                                                       grad_x[first:end],
                                                       form_parts_for(end - first, vocab, x.shape[1], stat_rows),
                                                       stat_rows)
            continue
        z, t = F.linear(x[first:end], weight, bias), target[first:end]
        chunk_stats = row_passes.new_stats(end - first, x.dtype, x.device, stat_rows)  # contiguous, for the kernels
        row_passes.fold_stats(z, t, 0, vocab, chunk_stats, softcap, temperature=temperature)
        stats[:, first:end] = chunk_stats
        if any(wants):
            row_passes.write_gradient(z, z, t, 0, vocab, row_passes.softmax_stats_of(chunk_stats),
                                      row_scale[first:end], label_smoothing, z_loss, softcap, temperature)
        if wants[0]:
            _mm(z, weight, grad_x[first:end])
        if wants[1]:
            _add_matmul_(grad_w, z.t(), x[first:end], first=first == 0)
        if wants[2]:
            grad_b += z.sum(0, dtype=acc)
        del z  # before the next chunk's logits: one chunk held at a time
    return stats, (grad_x, grad_w, grad_b)


def row_pass(x, weight, bias, target, divisor, ignore_index: int, label_smoothing: float, z_loss: float,
             softcap: float, temperature: float, reduction: str, wants, chunk_rows: int = 0):
    """The "rows" forward (rows_in_forward) for a grad_output of 1, and the loss. Returns (loss reduced,
    softmax_stats, count, (d input, d weight, d bias))."""
    vocab, acc = weight.shape[0], helpers.accumulation_dtype(x.dtype)
    count = _counts(target, ignore_index, divisor)
    row_scale = row_passes.row_scales(torch.ones((), dtype=acc, device=x.device), target, count, ignore_index,
                                      vocab, reduction, acc)
    stats, grads = rows_in_forward(x, weight, bias, target, row_scale, label_smoothing, z_loss, softcap, temperature,
                                   wants, chunk_rows=chunk_rows)
    loss, softmax_stats, _ = row_passes.finish_loss(stats, target, ignore_index, vocab, label_smoothing, z_loss)
    return row_passes.reduce_loss(loss, count, reduction), softmax_stats, count, grads


def gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, ignore_index: int,
                  label_smoothing: float, z_loss: float, softcap: float, temperature: float, reduction: str, wants,
                  classes=None, shards=None):
    """The backward by chunks of classes: the gradients of input, weight and bias (None where
    wants says no); classes as loss_pass returned it (None: weight's V)."""
    classes = weight.shape[0] if classes is None else classes
    row_scale = row_passes.row_scales(grad_output, target, count, ignore_index, classes, reduction,
                                      softmax_stats.dtype)
    grad_x, grad_w, grad_b = linear_gradients(x, weight, bias, target, 0 if shards is None else shards.start,
                                              classes, softmax_stats, row_scale, label_smoothing, z_loss, softcap,
                                              wants, temperature)
    if grad_x is not None and shards is not None:
        shards.sum_over_group(grad_x)  # every rank's classes add to it
    if shards is not None:
        shards.raise_if_invalid()
    return None if grad_x is None else grad_x.to(x.dtype), grad_w, grad_b


# ----------------------------------------------------------------------------------
# Under torch.compile the passes (loss, rows, gradients) are opaque ops: a tracer sees one call
# each, not the chunk loops with their out= products. (The row passes' kernels have compile ops of their own.) No
# C++ side: these schemas are their only declaration.

_LOSS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? divisor, int ignore_index, "
                "float label_smoothing, float z_loss, float softcap, float temperature, str reduction) "
                "-> (Tensor, Tensor, Tensor)")
_ROWS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? divisor, int ignore_index, "
                "float label_smoothing, float z_loss, float softcap, float temperature, str reduction, bool[] wants, "
                "int chunk_rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_GRADIENTS_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor softmax_stats, Tensor count, "
                     "Tensor grad_output, int ignore_index, float label_smoothing, float z_loss, float softcap, "
                     "float temperature, str reduction, bool[] wants) -> (Tensor, Tensor, Tensor)")


def _loss_fake(x, weight, bias, target, divisor, ignore_index, label_smoothing, z_loss, softcap, temperature,
               reduction):
    acc = helpers.accumulation_dtype(x.dtype)
    shape = (x.shape[0],) if reduction == "none" else ()
    return (x.new_empty(shape, dtype=acc), x.new_empty((3, x.shape[0]), dtype=acc),
            x.new_empty((), dtype=torch.int64 if divisor is None else acc))


def _fresh(count, divisor):
    """A custom op's output may not be its input: divisor as count, copied."""
    return count.clone() if count is divisor else count


def _loss_op(x, weight, bias, target, divisor, *options):
    loss, softmax_stats, count, _ = loss_pass(x, weight, bias, target, divisor, *options)
    return loss, softmax_stats, _fresh(count, divisor)


def _rows_op(x, weight, bias, target, divisor, *options):
    loss, softmax_stats, count, grads = row_pass(x, weight, bias, target, divisor, *options)
    return (loss, softmax_stats, _fresh(count, divisor), *(x.new_empty(0) if grad is None else grad for grad in grads))


def _rows_fake(x, weight, bias, target, divisor, *options):
    wants = options[-2]
    loss, softmax_stats, count = _loss_fake(x, weight, bias, target, divisor, *options[:-2])
    acc = softmax_stats.dtype
    grads = (torch.empty_like(x), weight.new_empty(weight.shape, dtype=acc),
             weight.new_empty(weight.shape[0], dtype=acc))
    return (loss, softmax_stats, count, *(grad if want else x.new_empty(0) for grad, want in zip(grads, wants)))


def _gradients_op(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *options)
    return tuple(x.new_empty(0) if grad is None else grad for grad in grads)  # the schema's tensors


def _gradients_fake(x, weight, bias, target, softmax_stats, count, grad_output, *options):
    wants = options[-1]
    likes = (x, weight, bias)
    return tuple(torch.empty_like(like) if want else x.new_empty(0) for want, like in zip(wants, likes))


def _define_compile_ops():
    if not helpers.COMPILE_OPS or hasattr(torch.ops.fused_losses_linear_ce, "rows"):
        return None  # torch < 2.4, or defined by this file imported under another name
    library = torch.library.Library("fused_losses_linear_ce", "DEF")
    for name, schema, impl, fake in (("loss", _LOSS_SCHEMA, _loss_op, _loss_fake),
                                     ("rows", _ROWS_SCHEMA, _rows_op, _rows_fake),
                                     ("gradients", _GRADIENTS_SCHEMA, _gradients_op, _gradients_fake)):
        library.define(name + schema)
        for device in ("CPU", "CUDA"):
            library.impl(name, impl, device)
        torch.library.register_fake(f"fused_losses_linear_ce::{name}", fake, lib=library)
    return library


_COMPILE_LIBRARY = _define_compile_ops()  # the definitions last as long as the Library


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(N, H) input, (V, H) weight, (V,) bias or None (of input's dtype, or float32 masters of a
    2-byte input under autocast: cast here, their gradients returned in their dtype), (N,) class
    indices, divisor: a 0-dim tensor in the accumulation type that 'mean' divides by, or None (the
    rows not ignored). Returns (loss, lse) in the accumulation type: loss 0-dim for 'mean' and
    'sum', (N,) for 'none'; lse (N,) without gradient. options: (ignore_index, label_smoothing,
    z_loss, softcap or 0, temperature, reduction, shards, schedule (choose_schedule's), wants (input, weight, bias),
    chunk_rows (rows_in_forward's), allow_retain_graph (backward's scale of forward-written gradients into new
    tensors)).
    The caller casts the loss: a cast here that returns its input (float32) made torch.compile
    (torch 2.11) hand backward a grad_output of 0."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, divisor, options):
        *arguments, shards, schedule, wants, chunk_rows, _ = options
        ctx.options, ctx.dtypes = options, (weight.dtype, None if bias is None else bias.dtype)
        weight = weight.to(x.dtype)  # autocast's copy of a float32 master, as eager's F.linear makes
        bias = None if bias is None else bias.to(x.dtype)
        if schedule != "classes":
            in_forward = forward_wants(wants, schedule)
            if helpers.is_compiling():
                loss, softmax_stats, count, *grads = torch.ops.fused_losses_linear_ce.rows(
                    x, weight, bias, target, divisor, *arguments, list(in_forward), chunk_rows)
                grads = [grad if want else None for grad, want in zip(grads, in_forward)]
            else:
                loss, softmax_stats, count, grads = row_pass(x, weight, bias, target, divisor, *arguments, in_forward,
                                                             chunk_rows)
            saved = (x, weight, bias, target, softmax_stats, count) if schedule == "rows_then_classes" else ()
            ctx.save_for_backward(*grads, *saved)
            ctx.scaled = False
            return row_passes.forward_outputs(ctx, loss, row_passes.lse_of(softmax_stats))
        if shards is None and helpers.is_compiling():
            loss, softmax_stats, count = torch.ops.fused_losses_linear_ce.loss(x, weight, bias, target, divisor,
                                                                               *arguments)
            classes = weight.shape[0]
        else:
            loss, softmax_stats, count, classes = loss_pass(x, weight, bias, target, divisor, *arguments, shards)
        row_passes.save_for_backward(ctx, (x, weight, bias, target, softmax_stats, count), classes)
        return row_passes.forward_outputs(ctx, loss, row_passes.lse_of(softmax_stats))

    @staticmethod
    def backward(ctx, grad_output, _):
        helpers.no_second_derivative("linear_cross_entropy")
        if grad_output is None:
            return None, None, None, None, None, None
        *arguments, shards, schedule, wants, _, _ = ctx.options
        if schedule == "classes":
            x, weight, bias, target, softmax_stats, count, classes = row_passes.saved_tensors(ctx)
            if shards is None and helpers.is_compiling():
                grads = torch.ops.fused_losses_linear_ce.gradients(x, weight, bias, target, softmax_stats, count,
                                                                    grad_output, *arguments, list(wants))
                grads = [grad if want else None for grad, want in zip(grads, wants)]
            else:
                grads = gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output, *arguments,
                                      wants, classes, shards)
        else:
            grads, others = _scaled_forward_gradients(ctx, grad_output)
            if schedule == "rows_then_classes":
                x, weight, bias, target, softmax_stats, count = others
                grads = (grads[0], *gradient_pass(x, weight, bias, target, softmax_stats, count, grad_output,
                                                  *arguments, (False, *wants[1:]))[1:])
        grad_x, grad_w, grad_b = grads
        return (grad_x, None if grad_w is None else grad_w.to(ctx.dtypes[0]),
                None if grad_b is None else grad_b.to(ctx.dtypes[1]), None, None, None)


_SCALING = threading.Lock()


def _times(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad * scale in the accumulation type, rounded once to grad's dtype (autocast's float32 grad_output is
    not rounded to bfloat16 first)."""
    acc = helpers.accumulation_dtype(grad.dtype)
    return (grad.to(acc) * scale.to(acc)).to(grad.dtype)


def _scaled_forward_gradients(ctx, grad_output):
    """The gradients the forward wrote for a grad_output of 1, times grad_output: in place for
    a scalar loss (on CUDA no work at all for 1; so a second backward would scale them twice
    and raises), new tensors for 'none' (rows only: the forward summed nothing) or where options
    allow a second backward (allow_retain_graph: a pass over each gradient). Returns them
    and the other saved tensors, read first: an in-place scale on CPU bumps a saved tensor's
    version, which a later read of ctx.saved_tensors refuses."""
    in_place = not (grad_output.dim() or helpers.is_compiling() or ctx.options[-1])  # a compiled graph is functional
    if in_place:
        with _SCALING:  # backwards of a retained graph may run on several threads: one of them scales
            already_scaled, ctx.scaled = ctx.scaled, True
        if already_scaled:
            raise RuntimeError("linear_cross_entropy wrote its gradients in the forward and its backward scaled "
                               "them: a second backward through the same call is not supported (retain_graph=True)")
    saved = ctx.saved_tensors
    grads, others = saved[:3], saved[3:]
    if not in_place:
        scale = grad_output[:, None] if grad_output.dim() else grad_output
        return tuple(None if grad is None else _times(grad, scale) for grad in grads), others
    for grad in grads:
        if grad is None or grad.numel() == 0:
            continue
        if grad.is_cuda:
            helpers.kernel_ops("row_passes", grad).scale_by_grad_output_(grad, grad_output)
        else:
            grad.copy_(_times(grad, grad_output))  # as the kernel does
    return grads, others


# ----------------------------------------------------------------------------------
# The public function and Module: torch 2.14's F.linear_cross_entropy and nn.LinearCrossEntropyLoss.

_TORCH_OPTIONS = getattr(nn, "LinearCrossEntropyOptions", None)  # torch 2.14+
_SIGNATURE = ("linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, "
              "reduction='mean', ignore_index=None, label_smoothing=0.0, options=None, ...)")


def _from_torch_options(options) -> dict:
    """What of torch's LinearCrossEntropyOptions maps onto this implementation: float32_weight_sum
    (choose_schedule's keyword) from acc_policy "accurate" (d linear_weight summed in float32;
    "compact" and "auto": False), chunk_rows from batch_chunk_size (rows a chunk where chunks are of
    rows; 0, unset: the memory rule, row_chunk_rows), and allow_retain_graph (a second backward through a
    call whose forward wrote its gradients: they are scaled into new tensors). Nothing else maps:
    chunking_method (torch's rule for its own chunks), acc_dtype (sums here are float32, float64 for
    float64). Raises unless options is None or, where torch has the class, one of its instances."""
    if options is None:
        return {}
    if _TORCH_OPTIONS is not None and not isinstance(options, _TORCH_OPTIONS):
        raise ValueError(f"options must be None or a torch.nn.LinearCrossEntropyOptions, got {type(options).__name__}")
    rows = getattr(options, "batch_chunk_size", None)
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"options.batch_chunk_size must be a positive int or None, got {rows!r}")
    return {"float32_weight_sum": getattr(options, "acc_policy", "auto") == "accurate", "chunk_rows": rows or 0,
            "allow_retain_graph": bool(getattr(options, "allow_retain_graph", False))}


def _check_arguments(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
                     z_loss, softcap) -> bool:
    """Every argument checked before any work, as errors that name it: TypeError for a non-tensor,
    ArgumentError where torch's own raises RuntimeError. Returns whether target holds class probabilities."""
    for name, tensor in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(tensor, torch.Tensor):
            raise helpers.not_a_tensor("linear_cross_entropy", name, tensor)
    for name, tensor in (("linear_bias", linear_bias), ("weight", weight)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise helpers.not_a_tensor("linear_cross_entropy", name, tensor)
    helpers.check_reduction(reduction, ("none", "mean", "sum"))
    if input.dim() < 1 or linear_weight.dim() < 2:
        raise helpers.ArgumentError(f"input must be (..., H) and linear_weight (C, H) or (C, d1, ..., dK, H); got "
                                    f"input {tuple(input.shape)}, linear_weight {tuple(linear_weight.shape)}")
    classes, out_features = linear_weight.shape[0], tuple(linear_weight.shape[1:-1])
    if input.shape[-1] != linear_weight.shape[-1]:
        raise helpers.ArgumentError(f"input's last dimension H = {input.shape[-1]} differs from linear_weight's "
                                    f"{tuple(linear_weight.shape)} (H last)")
    if out_features and input.dim() != 2:
        raise helpers.ArgumentError(f"a K-dimensional linear_weight {tuple(linear_weight.shape)} takes input of shape "
                                    f"(N, H), as torch's, got {tuple(input.shape)}")
    for name, tensor in (("target", target), ("linear_weight", linear_weight), ("linear_bias", linear_bias),
                         ("weight", weight)):
        if tensor is not None and tensor.device != input.device:
            raise helpers.device_error(name, tensor, input)
    if weight is not None and tuple(weight.shape) != (classes,):
        moved = (" The linear layer's weight is now linear_weight (the second argument) and weight= means class "
                 "weights, as in torch 2.14's F.linear_cross_entropy." if weight.dim() > 1 else "")
        raise helpers.ArgumentError(f"weight (class weights) must have shape ({classes},), one value per class, got "
                                    f"{tuple(weight.shape)}.{moved}")
    for name, tensor in (("linear_weight", linear_weight), ("linear_bias", linear_bias), ("weight", weight)):
        if tensor is not None and tensor.dtype != input.dtype and not helpers.under_autocast(input):
            raise helpers.ArgumentError(f"{name} has dtype {tensor.dtype}, input {input.dtype}: they must match "
                                        f"(outside autocast, as F.linear and F.cross_entropy require)")
    if linear_bias is not None and tuple(linear_bias.shape) != (classes, *out_features):
        raise helpers.ArgumentError(f"linear_bias must have shape {(classes, *out_features)}, one value per logit, "
                                    f"got {tuple(linear_bias.shape)}")
    logits_shape = (*input.shape[:-1], classes, *out_features)
    probabilities = tuple(target.shape) == logits_shape  # as torch tells them apart
    if probabilities and not target.is_floating_point():
        raise helpers.ArgumentError(f"target of the logits' shape {logits_shape} holds class probabilities, which "
                                    f"must be floating point, got {target.dtype}")
    if probabilities and ignore_index is not None:
        raise helpers.ArgumentError("ignore_index cannot be specified when target contains probabilities (leave it "
                                    "None)")
    if not probabilities:
        expected = (*input.shape[:-1], *out_features)
        if tuple(target.shape) != expected:
            raise helpers.ArgumentError(f"target must hold class indices of shape {expected} or probabilities of the "
                                        f"logits' shape {logits_shape}, got {tuple(target.shape)}")
        if target.dtype not in (torch.int64, torch.int32, torch.uint8):  # torch: "expected target dtype to be Long"
            raise helpers.ArgumentError(f"target of shape {expected} holds class indices, which must be int64, int32 "
                                        f"or uint8, got {target.dtype} (class probabilities take the logits' shape "
                                        f"{logits_shape})")
    ce.check_smoothing_and_z_loss(label_smoothing, z_loss)
    ce.check_softcap(softcap)
    return probabilities


def _check_divisor(divisor, reduction: str) -> None:
    if divisor is None:
        return
    if reduction != "sum":
        raise ValueError(f"divisor divides reduction='sum' (e.g. by num_items_in_batch); got reduction={reduction!r}")
    if isinstance(divisor, torch.Tensor) and divisor.numel() != 1:
        raise ValueError(f"divisor must be a number or a one-element tensor, got shape {tuple(divisor.shape)}")


def _why_logits_whole(linear_weight, probabilities: bool, weight) -> str | None:
    """Why the row passes over chunks of rows or classes cannot take the call, or None. Class weights
    and probabilities would need the engine's weighted statistics in the chunk loops: not wired (yet)."""
    if linear_weight.dim() > 2:
        return "a K-dimensional linear_weight"
    if probabilities:
        return "probability targets"
    if weight is not None:
        return "class weights"
    return None


def _check_classes_on_cpu(target, ignore_index: int, classes: int) -> None:
    """torch's IndexError for a class index outside [0, C) that is not ignore_index. Read back on the
    host: free of a device sync on CPU alone (on CUDA the row is NaN instead)."""
    outside = (target != ignore_index) & ((target < 0) | (target >= classes))
    if outside.any():
        raise IndexError(f"target {int(target[outside][0])} is out of bounds: class indices are in [0, {classes}) "
                         f"or ignore_index ({ignore_index})")


def _logits_whole(input, linear_weight, target, linear_bias, weight, probabilities: bool, reduction: str,
                  ignore_index: int, label_smoothing: float, z_loss: float, softcap, return_lse: bool,
                  temperature: float = 1.0):
    """The fallback: cross_entropy of F.linear's logits, all of them at once (torch's own
    F.linear_cross_entropy with options=None computes the same)."""
    classes, hidden = linear_weight.shape[0], linear_weight.shape[-1]
    logits = F.linear(input, linear_weight.reshape(-1, hidden),
                      None if linear_bias is None else linear_bias.reshape(-1))
    rows_of = input.dim() > 2 and linear_weight.dim() == 2  # (..., H): rows of classes, for cross_entropy
    if linear_weight.dim() > 2:  # (N, C, d1, ..., dK): the classes in dim 1
        logits = logits.reshape(input.shape[0], *linear_weight.shape[:-1])
    elif rows_of:
        logits = logits.reshape(-1, classes)
        target = target.reshape(-1, classes) if probabilities else target.reshape(-1)
    result = ce.cross_entropy(logits, target, weight, ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, return_lse=return_lse,
                              temperature=temperature)
    if not rows_of:
        return result
    loss, lse = result if return_lse else (result, None)
    loss = loss.reshape(input.shape[:-1]) if reduction == "none" else loss
    return (loss, lse.reshape(input.shape[:-1])) if return_lse else loss


def _old_signature_hint(function):
    """Calls in the signature before torch 2.14's (bias the 4th positional argument or bias=, the
    linear layer's weight as weight=) get a TypeError that says where each argument went."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        if len(args) > 3 or "bias" in kwargs:
            raise TypeError(f"linear_cross_entropy takes torch 2.14's signature, {_SIGNATURE}: the bias is now the "
                            f"keyword linear_bias=")
        if len(args) < 2 and "linear_weight" not in kwargs and "weight" in kwargs:
            raise TypeError(f"linear_cross_entropy takes torch 2.14's signature, {_SIGNATURE}: the linear layer's "
                            f"weight is now linear_weight, and weight= means class weights")
        return function(*args, **kwargs)
    return call


@_old_signature_hint
def linear_cross_entropy(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                         linear_bias: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                         reduction: str = "mean", ignore_index: int | None = None, label_smoothing: float = 0.0,
                         options=None, z_loss: float = 0.0, softcap: float | None = None, return_lse: bool = False,
                         process_group=None, vocab_start: int | None = None, divisor=None,
                         temperature: float = 1.0):
    """torch 2.14's F.linear_cross_entropy: F.cross_entropy(F.linear(input, linear_weight,
    linear_bias), target, weight=weight, ...), same signature and results, without the (N, C)
    logits in memory: a chunk of rows or of classes at a time (choose_schedule's schedules).

    input (H) or (N, H), and beyond torch (..., H); linear_weight (C, H); linear_bias (C,);
    target: class indices (int64, and beyond torch int32) of shape input.shape[:-1], or class
    probabilities of the logits' shape (..., C). weight: class weights (C,), as torch's.
    ignore_index: None is -100 for class indices; with probabilities it must stay None.
    A class index outside [0, C) (not ignore_index) raises IndexError on CPU, as torch's; on
    CUDA it gives NaN for its row (a check would sync every call), as with process_group.

    Fused (the row passes over chunks): class indices without class weights, every reduction,
    ignore_index, label_smoothing and ours below. The fallback, the logits whole then
    cross_entropy (torch ops, or our fused cross_entropy on them on CUDA, where
    FUSED_LOSSES_STRICT=1 makes it raise): class weights and probability targets (their weighted
    statistics are not wired into the chunk loops), a K-dimensional linear_weight (C, d1, ..., dK,
    H) with bias (C, d1, ..., dK) and input (N, H), and calls under a torch.func transform.

    options: torch's LinearCrossEntropyOptions (or None) picks torch's chunked path; here
    acc_policy, batch_chunk_size and allow_retain_graph count. Chunks follow a memory rule
    (CHUNK_BYTES, ROW_CHUNK_BYTES: 256 MiB of logits); batch_chunk_size sets the rows a chunk where
    chunks are of rows (a frozen head, a float32 d weight, a 2-byte one's forward): larger chunks
    take more memory and run faster (notes: the linear losses' chunks); chunking_method is ignored.
    acc_policy "accurate" (d
    linear_weight summed in float32) is choose_schedule's float32_weight_sum: a 2-byte
    linear_weight's gradient summed over chunks of rows in a float32 buffer (C x H x 4 bytes), in
    the forward. acc_dtype is ignored (sums are float32, float64 for float64). Without
    allow_retain_graph a second backward through a call whose forward wrote its gradients raises;
    with it backward scales them into new tensors (a pass over each).

    Ours, keywords after torch's: z_loss and return_lse as in cross_entropy (lse in target's
    shape for class indices, float32); softcap: the logits become softcap * tanh(logits /
    softcap) first (Gemma 2); temperature as in cross_entropy. process_group (class indices without class weights):
    linear_weight and linear_bias hold this rank's contiguous rows of the output layer, its shard
    of the classes (first class vocab_start, by default rank * C_r), as cross_entropy's; input is
    the same on every rank and target holds global class ids. The loss equals the unsharded one;
    linear_weight's and linear_bias's gradients are this shard's; input's is summed over the
    group (one more all-reduce, of N x H, in backward). divisor (with reduction='sum'): the sum
    divided by it, a number or a 0-dim tensor, e.g. a Hugging Face trainer's num_items_in_batch;
    in the forward's gradients, so it costs no pass. Under CUDA autocast the linear runs in
    autocast's dtype and the loss is float32, as torch's.
    """
    try:
        probabilities = _check_arguments(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                         label_smoothing, z_loss, softcap)
        _check_divisor(divisor, reduction)
        ce.check_temperature(temperature)
        schedule_options = _from_torch_options(options)
        why_whole = _why_logits_whole(linear_weight, probabilities, weight)
        if process_group is not None and why_whole is not None:
            raise ValueError(f"process_group takes class indices without class weights and a (C, H) linear_weight, "
                             f"got {why_whole}")
    except ValueError as error:  # with process_group: raised on every rank
        vocab_parallel.raise_on_every_rank(process_group, input, error)
    allow_retain_graph = schedule_options.pop("allow_retain_graph", False)
    chunk_rows = schedule_options.pop("chunk_rows", 0)
    ignore_index = -100 if ignore_index is None else int(ignore_index)
    if target.dtype == torch.uint8:  # torch takes uint8 class indices; the row passes int64 or int32
        target = target.long()
    if (not probabilities and not input.is_cuda and process_group is None and not helpers.is_compiling()
            and not helpers.in_func_transform()):
        _check_classes_on_cpu(target, ignore_index, linear_weight.shape[0])
    if why_whole is None and process_group is None and helpers.in_func_transform():
        why_whole = "a torch.func transform"  # tensors without storage: torch's ops take them
    if why_whole is not None:
        helpers.check_fallback_allowed("linear_cross_entropy", why_whole + " take the logits whole", input)
        result = _logits_whole(input, linear_weight, target, linear_bias, weight, probabilities, reduction,
                               ignore_index, label_smoothing, z_loss, softcap, return_lse, float(temperature))
        if divisor is None:
            return result
        return (result[0] / divisor, result[1]) if return_lse else result / divisor
    weight, bias = linear_weight, linear_bias  # from here on the engine's names: weight is the linear layer's
    float_loss = False
    if helpers.under_autocast(input):  # F.linear in autocast's dtype (the Function casts weight), the loss in float32
        input = input.to(helpers.autocast_dtype())
        float_loss = True
    with torch.autocast(input.device.type, enabled=False):
        rows, rows_target = input.reshape(-1, input.shape[-1]), target.reshape(-1).contiguous()
        shards = (None if process_group is None else
                  vocab_parallel.Shards(process_group, weight.shape[0], vocab_start, rows, rows.shape[1]))
        wants = tuple(helpers.wants_grad(tensor) if tensor is not None else False for tensor in (rows, weight, bias))
        if divisor is not None:  # 'mean' over divisor's count
            reduction = "mean"
            divisor = torch.as_tensor(divisor).to(device=input.device, dtype=helpers.accumulation_dtype(input.dtype))
        schedule = choose_schedule(wants, reduction, weight.dtype, input.dtype, shards, softcap or 0.0,
                                   **schedule_options)
        build_together(rows, weight, bias, wants, schedule, float(label_smoothing))
        loss, lse = LinearCrossEntropyFunction.apply(rows, weight, bias, rows_target, divisor, (
            ignore_index, float(label_smoothing), float(z_loss), float(softcap or 0.0), float(temperature), reduction,
            shards, schedule, wants, chunk_rows, allow_retain_graph))
        if shards is not None and not any(wants):  # else backward raises, after its all-reduce
            shards.raise_if_invalid()
        loss = loss.to(torch.float32 if float_loss else input.dtype)
    if input.dim() == 1 and reduction == "mean" and not label_smoothing and input.is_cuda:
        # torch's CUDA loss of one unbatched, ignored target is 0 (its 1-D kernel), not 0 / 0: as cross_entropy's.
        loss = loss.masked_fill(rows_target[0] == ignore_index, 0)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return (loss, lse.reshape(target.shape)) if return_lse else loss


def log_prob_rows(x, weight, bias, target, ignore_index: int, softcap: float, temperature: float, stat_rows: int):
    """A frozen head's forward (choose_schedule's "rows"): rows_in_forward with each row's d log p_t = -(d
    cross-entropy) for a grad_output of 1 (backward scales each row by its own), d input in x's dtype: 2
    products, where chunks of classes take 3 (the logits again in backward). Returns (stats, d input)."""
    acc = helpers.accumulation_dtype(x.dtype)
    # log_prob_scales' row scale for a weight of 1
    row_scale = -row_passes.per_row(torch.ones((), dtype=acc, device=x.device), target, ignore_index,
                                    weight.shape[0]).contiguous()
    stats, (grad_x, _, _) = rows_in_forward(x, weight, bias, target, row_scale, 0.0, 0.0, softcap, temperature,
                                            (True, False, False), stat_rows)
    return stats, grad_x


class LinearLogProbsFunction(torch.autograd.Function):
    """log p of each row's target (and with return_entropy the softmax's entropy) of F.linear(x,
    weight, bias) at a temperature. weight and bias: of x's dtype, or float32 masters of a 2-byte x
    under autocast (cast here, their gradients returned in their dtype). options: (ignore_index,
    softcap or 0, temperature, return_entropy, shards, wants, schedule), schedule choose_schedule's:
    "rows" (a frozen head): log_prob_rows, d input in the forward, backward scales it by the per-row
    weights and recomputes the logits only for the entropy's gradient, if that is wanted; otherwise the
    statistics a chunk of classes at a time and every gradient from the logits recomputed in backward
    (per-row weights are known only there). Returns row_passes.log_prob_outputs' (log_probs, entropy),
    in the accumulation type."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, options):
        ignore_index, softcap, temperature, return_entropy, shards, wants, schedule = options
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        weight = weight.to(x.dtype)  # autocast's copy of a float32 master, as eager's F.linear makes
        bias = None if bias is None else bias.to(x.dtype)
        stat_rows = row_passes.ENTROPY_STAT_ROWS if return_entropy else row_passes.STAT_ROWS
        if schedule == "rows":
            stats, grad_x = log_prob_rows(x, weight, bias, target, ignore_index, softcap, temperature, stat_rows)
            saved = (x, weight, bias, target, grad_x)
        else:
            stats = fold_linear(x, weight, bias, target, 0 if shards is None else shards.start, softcap,
                                temperature, stat_rows)
            saved = (x, weight, bias, target)
        stats, classes = row_passes.combine(stats, weight.shape[0], shards)
        return row_passes.log_probs_forward_outputs(ctx, options, stats, classes, target, ignore_index,
                                                    return_entropy, saved)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None
        ignore_index, softcap, temperature, _, shards, wants, schedule = ctx.options
        helpers.no_second_derivative("linear_log_probs")
        x, weight, bias, target, *in_forward, softmax_stats, classes = row_passes.saved_tensors(ctx)
        if schedule == "rows":
            grad_x = None if grad_log_probs is None else _times(in_forward[0], grad_log_probs[:, None])
            if grad_entropy is not None:  # the entropy's term: the logits again, by chunks of classes
                zeros = torch.zeros(target.shape[0], dtype=softmax_stats.dtype, device=x.device)
                _, entropy_scale = row_passes.log_prob_scales(None, grad_entropy, target, ignore_index, classes,
                                                              softmax_stats)
                grad_h = linear_gradients(x, weight, bias, target, 0, classes, softmax_stats, zeros, 0.0, 0.0,
                                          softcap, wants, temperature, entropy_scale)[0]
                grad_x = grad_h if grad_x is None else grad_h + grad_x
            return grad_x.to(x.dtype), None, None, None, None
        row_scale, entropy_scale = row_passes.log_prob_scales(grad_log_probs, grad_entropy, target, ignore_index,
                                                              classes, softmax_stats)
        grad_x, grad_w, grad_b = linear_gradients(x, weight, bias, target, 0 if shards is None else shards.start,
                                                  classes, softmax_stats, row_scale, 0.0, 0.0, softcap, wants,
                                                  temperature, entropy_scale)
        if grad_x is not None and shards is not None:
            shards.sum_over_group(grad_x)  # every rank's classes add to it
        if shards is not None:
            shards.raise_if_invalid()
        return (None if grad_x is None else grad_x.to(x.dtype), None if grad_w is None else grad_w.to(ctx.dtypes[0]),
                None if grad_b is None else grad_b.to(ctx.dtypes[1]), None, None)


def linear_log_probs(input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, *,
                     linear_bias: torch.Tensor | None = None, temperature: float = 1.0, softcap: float = 0.0,
                     ignore_index: int = -100, return_entropy: bool = False, process_group=None,
                     vocab_start: int | None = None):
    """log p(target) of each row of F.linear(input, linear_weight, linear_bias) at a temperature,
    without the logits in memory: as losses.log_probs of those logits (its semantics, outputs and
    dtypes), a chunk of classes at a time. input (..., H), linear_weight (C, H), linear_bias (C,),
    target (...) class indices (int64 or int32). process_group and vocab_start as in
    linear_cross_entropy: linear_weight and linear_bias hold this rank's shard of the classes;
    input's gradient is summed over the group."""
    try:
        _check_arguments(input, linear_weight, target, linear_bias, None, "none", ignore_index, 0.0, 0.0,
                         softcap or None)
        ce.check_temperature(temperature)
        if linear_weight.dim() != 2:
            raise helpers.ArgumentError(f"linear_log_probs: linear_weight must be (C, H), got "
                                        f"{tuple(linear_weight.shape)}")
        ce.check_class_indices("linear_log_probs", target)
    except ValueError as error:  # with process_group: raised on every rank
        vocab_parallel.raise_on_every_rank(process_group, input, error)
    weight, bias = linear_weight, linear_bias  # the engine's names: weight is the linear layer's
    if helpers.under_autocast(input):  # F.linear in autocast's dtype (the Function casts weight), as linear_cross_entropy
        input = input.to(helpers.autocast_dtype())
    with torch.autocast(input.device.type, enabled=False):  # backward's products in the forward's dtype too
        rows, rows_target = input.reshape(-1, input.shape[-1]), target.reshape(-1).contiguous()
        shards = (None if process_group is None else
                  vocab_parallel.Shards(process_group, weight.shape[0], vocab_start, rows, rows.shape[1]))
        wants = tuple(helpers.wants_grad(tensor) if tensor is not None else False for tensor in (rows, weight, bias))
        # A frozen head's d input in the forward (eager: a compiled graph keeps the chunks of classes).
        schedule = "classes" if helpers.is_compiling() else choose_schedule(wants, "none", weight.dtype, rows.dtype,
                                                                            shards, softcap or 0.0)
        build_together(rows, weight, bias, wants, schedule, 0.0,
                       row_passes.ENTROPY_STAT_ROWS if return_entropy else row_passes.STAT_ROWS)
        values, entropy = LinearLogProbsFunction.apply(rows, weight, bias, rows_target, (
            int(ignore_index), float(softcap or 0.0), float(temperature), bool(return_entropy), shards, wants,
            schedule))
        if shards is not None and not any(wants):  # else backward raises, after its all-reduce
            shards.raise_if_invalid()
    values = values.reshape(target.shape)
    return (values, entropy.reshape(target.shape)) if return_entropy else values


class LinearCrossEntropyLoss(_WeightedLoss):
    """torch 2.14's nn.LinearCrossEntropyLoss on linear_cross_entropy: it owns its linear layer,
    self.linear (nn.Linear(in_features, C * prod(out_features)), its state_dict keys
    linear.weight and linear.bias as torch's), and forward(input, target). weight: class
    weights, a buffer as in torch's _WeightedLoss. Takes linear_cross_entropy's z_loss, softcap,
    return_lse, process_group, vocab_start and temperature as keywords after torch's (with process_group,
    num_classes is this rank's shard of the classes)."""

    def __init__(self, in_features: int, num_classes: int, *, out_features: tuple = (), bias: bool = False,
                 device=None, dtype=None, reduction: str = "mean", weight: torch.Tensor | None = None,
                 ignore_index: int | None = None, label_smoothing: float = 0.0, options=None, z_loss: float = 0.0,
                 softcap: float | None = None, return_lse: bool = False, process_group=None,
                 vocab_start: int | None = None, temperature: float = 1.0) -> None:
        sizes = (("in_features", in_features), ("num_classes", num_classes),
                 *(("out_features", size) for size in out_features))
        hint = ("LinearCrossEntropyLoss takes torch 2.14's constructor: (in_features, num_classes, *, ...), and owns "
                "its linear layer")
        for name, size in sizes:  # every type first: torch's TypeError wins over a size it would refuse
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{name} must hold ints, got {size!r} ({hint})")
        for name, size in sizes:
            if size < 1:
                raise helpers.ArgumentError(f"{name} must hold positive ints, got {size!r} ({hint})")
        if weight is not None and tuple(weight.shape) != (num_classes,):
            raise helpers.ArgumentError(f"weight (class weights) must have shape ({num_classes},), got "
                                        f"{tuple(weight.shape)}")
        helpers.check_reduction(reduction, ("none", "mean", "sum"))
        ce.check_smoothing_and_z_loss(label_smoothing, z_loss)
        ce.check_softcap(softcap)
        ce.check_temperature(temperature)
        _from_torch_options(options)
        super().__init__(weight, None, None, reduction)
        self.num_classes, self.out_features = num_classes, tuple(out_features)
        self.ignore_index, self.label_smoothing, self.options = ignore_index, label_smoothing, options
        self.z_loss, self.softcap, self.return_lse = z_loss, softcap, return_lse
        self.process_group, self.vocab_start, self.temperature = process_group, vocab_start, temperature
        # nn.Linear's weight is 2-D: (C * d1 * ... * dK, H), reshaped in forward, as torch's.
        self.linear = nn.Linear(in_features, math.prod(self.out_features, start=num_classes), bias=bias,
                                device=device, dtype=dtype)

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        linear_weight = self.linear.weight.reshape(self.num_classes, *self.out_features, self.linear.in_features)
        linear_bias = None if self.linear.bias is None else self.linear.bias.reshape(self.num_classes,
                                                                                     *self.out_features)
        return linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
                                    reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, options=self.options, z_loss=self.z_loss,
                                    softcap=self.softcap, return_lse=self.return_lse,
                                    process_group=self.process_group, vocab_start=self.vocab_start,
                                    temperature=self.temperature)

    def extra_repr(self) -> str:
        return (f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
                f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
                f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, options={self.options}")
