"""Cross-entropy over a vocabulary split among the ranks of a torch.distributed group
(losses.cross_entropy(..., process_group=group)).

Each rank holds a contiguous shard of the classes: logits (rows, C_r) and weight (C_r,);
class-index targets are global ids, probability targets are sharded like the logits. The
loss, the lse and the gradient of this rank's shard equal single-device cross_entropy on the
gathered logits. Per call the facts' all-reduce (below), then two of (rows,)-sized tensors, and no host
sync on a GPU: the row maxima (MAX), then every row's sums packed together (SUM): the exp sum, the target's
logit and the smoothing sums (with class weights or probabilities, their weighted sums and the
target's weight). The gradient is the local shard's alone, with no communication. The
result is deterministic for a fixed group.

Shards tile [0, V) in any rank order (an empty shard anywhere). A rank's first class is
`vocab_start`, by default rank * C_r (equal shards). Validity is decided collectively: a first, tiny
all-reduce, before any of the rows' size, carries every rank's facts (first class, classes, rows, input
width, dtype, and the text of a ValueError its argument checks raised: raise_on_every_rank), which every
rank that reads them judges alike. An argument error, or ranks that disagree on rows, width or dtype,
raise at once (their all-reduces could not match); a tiling that fails (overlap, gap, past the class limit)
raises after the call's last all-reduce (raise_if_invalid: for linear_cross_entropy with gradients, in
backward), so no peer is left waiting. On CPU the facts are host memory, read at every call: every rank
raises the same ArgumentError (a ValueError and a RuntimeError), naming the faulty rank. On a GPU a read is a
host sync: a rank reads them when it first sees its layout (group, first class, classes, dtype), and not after
(CUDA graphs capture after a warm-up call). So where every rank is new to its layout, every rank raises; a
layout new to one rank later raises there alone, and its peers, which read nothing, get NaN (the device's
verdict, _layout_on_device); an argument error there raises on that rank alone, and other rows or input width
after a rank's first call go unseen: the peers wait in their next all-reduce.
Class ids travel in the accumulation type: up to 2^24 classes for 2- and 4-byte logits.

Every call takes the row-pass engine (row_passes.py) over the shard: its statistics, combined
with the group's by Shards.combine between the passes, and its gradient in backward, from the
saved logits and the global statistics. Class-index targets without weight (the usual case;
softcap too) run kernels/row_passes.cu on CUDA; class weights or probability targets the
engine's torch twin, in float32 (float64 for float64 logits), on CUDA tensors too, where
FUSED_LOSSES_STRICT=1 makes that raise. linear_cross_entropy(process_group=...) runs the same
engine over chunks of its logits.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

if __package__:
    from . import loss_helpers as helpers
    from . import row_passes
else:
    import loss_helpers as helpers
    import row_passes

CLASS_ID_LIMIT = 2**24  # class ids and V travel in the accumulation type: float32 holds integers exactly to here
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # the facts' dtype codes
# A rank's facts: _FACTS columns (first class, classes, rows, input width, dtype code), then an argument
# error's text (UTF-8, its first 8 x _MESSAGE_WORDS bytes, 8 to a word; all 0 for none).
_FACTS, _MESSAGE_WORDS = 5, 32
# The layouts (first class, classes, dtype) this rank has checked, per group. Weak keys: a destroyed
# group's entry goes with it, so a new group at its address is checked afresh.
_checked_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shard_start(group, local_classes: int, vocab_start: int | None) -> int:
    return int(vocab_start) if vocab_start is not None else dist.get_rank(group) * local_classes


def check_group_device(group, logits: torch.Tensor) -> None:
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl" and not logits.is_cuda:
        raise helpers.ArgumentError(f"process_group uses NCCL, which takes CUDA tensors; input is on {logits.device}")


def check_arguments(facts) -> str | None:
    """The first argument error a rank's call raised (raise_on_every_rank), naming the rank, or None."""
    for rank, row in enumerate(facts):
        if any(row[_FACTS:]):
            text = b"".join(word.to_bytes(8, "little", signed=True) for word in row[_FACTS:]).rstrip(b"\0")
            return f"process_group: rank {rank}'s call is not valid: {text.decode(errors='replace')}"
    return None


def check_agreement(facts) -> str | None:
    """What the ranks' facts (a row a rank: first class, classes, rows, input width, dtype code) disagree
    on, naming the odd rank and what most ranks have, or None. Every rank reads the same facts, so every
    rank gets the same text. Such calls cannot go on: their all-reduces would differ in size or dtype."""
    for column, says in ((4, "input is {}, rank {}'s {}: every rank's must be the same dtype"),
                         (2, "input has {} rows, rank {}'s {}: every rank takes the same rows"),
                         (3, "input has width {}, rank {}'s {}: every rank takes the same input")):
        values = [row[column] if column != 4 else _DTYPES[row[column]] for row in facts]
        usual = max(values, key=values.count)  # most ranks' value (a tie: the lowest rank's)
        odd = [rank for rank, value in enumerate(values) if value != usual]
        if odd:
            return f"process_group: rank {odd[0]}'s " + says.format(values[odd[0]], values.index(usual), usual)
    return None


def check_tiling(facts) -> str | None:
    """Whether the shards tile [0, V) within the class limit: what is wrong, naming the offending rank and
    what was expected, or None (the same text on every rank)."""
    listed = ", ".join(f"rank {rank} [{start}, {start + width})" for rank, (start, width, *_) in enumerate(facts))
    shards = sorted((start, start + width, rank) for rank, (start, width, *_) in enumerate(facts) if width > 0)
    dtype = _DTYPES[facts[0][4]]
    for start, end, rank in shards:
        if end > CLASS_ID_LIMIT and dtype != torch.float64:
            return (f"process_group: rank {rank}'s shard [{start}, {end}) ends past class 2^24 = {CLASS_ID_LIMIT}, "
                    f"the most with {dtype} logits (class ids travel in float32). Shards: {listed}")
    expected, previous = 0, None  # each shard starts where the one before ends (an empty one holds no class)
    for start, end, rank in shards:
        if start != expected:
            before = "" if previous is None else f", where rank {previous[2]}'s [{previous[0]}, {previous[1]}) ends"
            wrong = (f"classes [{expected}, {start}) belong to no rank" if start > expected else
                     "it starts before class 0" if previous is None else "the two overlap")
            return (f"process_group: the vocabulary shards do not tile [0, V): rank {rank}'s shard [{start}, {end}) "
                    f"should start at {expected}{before}: {wrong}. Shards: {listed}. Shards of unequal width need "
                    f"vocab_start= (each rank's first class); without it a rank's first class is rank * its classes.")
        expected, previous = end, (start, end, rank)
    return None


def _share_facts(group, like: torch.Tensor, facts, error: str | None = None) -> torch.Tensor:
    """The facts' all-reduce (SUM), before any of the rows' size: every rank's facts and argument error,
    (world, _FACTS + _MESSAGE_WORDS) int64 on like's device, a row a rank."""
    encoded = (error or "").encode()[:8 * _MESSAGE_WORDS]
    words = [int.from_bytes(encoded[at:at + 8].ljust(8, b"\0"), "little", signed=True)
             for at in range(0, len(encoded), 8)]
    rank = dist.get_rank(group)
    shared = torch.zeros(dist.get_world_size(group), _FACTS + _MESSAGE_WORDS, dtype=torch.int64, device=like.device)
    for column, value in enumerate((*facts, *words)):
        if value:  # a fill kernel: a copy from the host would sync (and cannot be captured)
            shared[rank, column].fill_(value)
    dist.all_reduce(shared, op=dist.ReduceOp.SUM, group=group)
    return shared


def raise_on_every_rank(group, like, error: ValueError):
    """For a call whose argument checks raised `error` (called from their except clause: a try costs
    the calls that raise nothing no host time): where group is a process group, this rank joins the
    facts' all-reduce its peers are in with the error's text, and raises what every rank that reads the
    facts raises (check_arguments). Where they read nothing (a GPU after a layout's first call) they go
    on to their next all-reduce, which this rank does not join. Without a group to tell (None, not
    one, or torch.distributed not initialized): raises error itself."""
    if group is not None and isinstance(like, torch.Tensor):
        try:
            check_group_device(group, like)
            shared = _share_facts(group, like, (0,) * _FACTS, str(error) or type(error).__name__)
        except Exception:
            raise error from None
        raise helpers.ArgumentError(check_arguments(shared.tolist())) from error
    raise error


def _reads_every_call(shared: torch.Tensor) -> bool:
    """On CPU the facts are host memory, free to read; on a GPU a read is a sync."""
    return shared.device.type == "cpu"


def _layout_on_device(shared: torch.Tensor, dtype: torch.dtype):
    """(V, whether the layout is valid), on the device: check_tiling's verdict, for the calls
    that do not read the facts. Sorted by first class, each shard starts where the one before ends; an
    empty shard, whose first class does not matter, sorts first."""
    widths = shared[:, 1]
    starts = torch.where(widths > 0, shared[:, 0], 0)
    ends = starts + widths
    vocab = ends.max()
    order = (2 * starts + (widths > 0)).argsort()
    starts, ends = starts[order], ends[order]
    valid = (starts[0] == 0) & (starts[1:] == ends[:-1]).all()
    return vocab, valid if dtype == torch.float64 else valid & (vocab <= CLASS_ID_LIMIT)


class Shards:
    """The classes split among a group's ranks, as this rank sees them: its first class `start` and its
    width `local`. Made on every rank at once: the facts' all-reduce, checked (check_agreement, check_tiling)
    on every call on CPU and where this rank sees its layout first on a GPU; `hidden`: input's width
    (linear), which backward's all-reduce of d input needs equal."""

    def __init__(self, group, local: int, vocab_start: int | None, like: torch.Tensor, hidden: int = 0):
        check_group_device(group, like)
        self.group, self.local = group, local
        self.start = shard_start(group, local, vocab_start)
        shared = _share_facts(group, like, (self.start, local, like.shape[0], hidden, _DTYPES.index(like.dtype)))
        layout, checked = (self.start, local, like.dtype), _checked_layouts.setdefault(group, set())
        self.error = None  # a tiling this rank saw fail: raise_if_invalid raises it once the call's all-reduces are done
        if _reads_every_call(shared) or layout not in checked:
            facts = shared.tolist()
            error = check_arguments(facts) or check_agreement(facts)
            if error is not None:  # where every rank reads (CPU, or a first call everywhere), every rank raises
                raise helpers.ArgumentError(error)
            self.error = check_tiling(facts)
            if self.error is None:
                checked.add(layout)
        self.vocab, self.valid = _layout_on_device(shared, like.dtype)

    def combine(self, stats):
        """This rank's statistics (row_passes.new_stats') combined with the group's in two
        all-reduces: (the group's statistics, V on the device)."""
        # All-reduce 1 (MAX): the row maxima.
        row_max = stats[0].clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=self.group)
        # All-reduce 2 (SUM): the other rows taken to the global max (row_passes.sums_at).
        sums = row_passes.sums_at(stats, row_max)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        # A layout that is not valid (on a GPU, another rank's changed since this rank checked): NaN.
        sums[0] = torch.where(self.valid, sums[0], torch.nan)
        return torch.cat([row_max[None], sums]), self.vocab.to(stats.dtype)

    def raise_if_invalid(self) -> None:
        """Called after the call's last all-reduce (for linear_cross_entropy with gradients, backward's), so that
        a rank that raises leaves no peer waiting: the ranks that read the facts raise, the others have NaN."""
        if self.error is not None:
            raise helpers.ArgumentError(self.error)

    def sum_over_group(self, tensor: torch.Tensor) -> None:
        """In place: the sum of `tensor` over the group (input's gradient, to which every rank's classes add)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def cross_entropy_rows(logits, target, weight, ignore_index, reduction, float_loss, label_smoothing, z_loss,
                       temperature, softcap, group, vocab_start):
    """(loss, lse) of (rows, C_r) logits; see the module's docstring."""
    shards = Shards(group, logits.shape[1], vocab_start, logits)
    loss, lse = row_passes.RowPassCrossEntropy.apply(logits.contiguous(), target.contiguous(), weight, (
        ignore_index, label_smoothing, z_loss, softcap or 0.0, reduction, shards, temperature))
    shards.raise_if_invalid()  # its backward has no all-reduce
    return loss.to(torch.float32 if float_loss else logits.dtype), lse
