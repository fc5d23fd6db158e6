"""Masked classes: logits of -inf (a bias of -inf on padded vocabulary, masked logits) give torch's
values on every path: a finite loss without label smoothing and inf with it, inf for a row whose
target is masked, finite gradients that are 0 at the masked classes without smoothing. Ours in the
dtype under test against torch's formula on float64 copies of the same values: on CPU the row passes'
torch twin (linear_cross_entropy's schedules, cross_entropy's softcap, class weights) and a process
group on gloo; on a GPU every cross_entropy kernel path, the row-pass kernels (softcap, linear's
schedules, a process group of two ranks on one GPU)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cross_entropy
import losses
from helpers import CPU_FLOAT16_MATMUL, DTYPES, default_grad_output, loss_and_grads, run_on_ranks
from test_cross_entropy import (FORCED, MANY_STREAMED_ROWS, PIPELINED_PATHS, SHAPES, SUM_ONLY_PATHS,
                                WARP_ROWS_IN_REGISTERS, forced_path, rows_per_multiprocessor, why_path_cannot_run)

INF = float("inf")
# Finite elements, against float64: within this share of the tensor's largest finite magnitude
# (2-byte linear logits are rounded to the dtype before the softmax, as eager's: a few ulps).
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SMOOTHING = {"plain": dict(), "label smoothing and z-loss": dict(label_smoothing=0.1, z_loss=1e-3)}


def masked_classes(classes: int, device) -> torch.Tensor:
    """Which classes are masked: every 7th, and the last eighth (padded vocabulary; with 16-class
    chunks of 50 classes, the last chunk and most of the one before)."""
    masked = torch.zeros(classes, dtype=torch.bool, device=device)
    masked[3::7] = True
    masked[classes - max(classes // 8, 1):] = True
    return masked


def untargeted(masked: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The masked classes no row targets: their gradient is exactly 0 (a masked target's is p_t - 1)."""
    masked = masked.clone()
    masked[target] = False
    return masked


def unmasked_targets(masked: torch.Tensor, rows: int, masked_target_row: bool) -> torch.Tensor:
    """A class that is not masked for each row; with masked_target_row, row 0's is masked (its loss is inf)."""
    allowed = (~masked).nonzero()[:, 0]
    target = allowed[torch.randint(0, len(allowed), (rows,), device=masked.device)]
    if masked_target_row:
        target[0] = masked.nonzero()[0, 0]
    return target


def check_matches_torch(fused, reference, inputs, grad_of, zero_at=None, case="", loss_without_grad=True):
    """fused(*inputs) against reference on float64 copies, loss and the gradients at grad_of: NaN and
    +-inf in the same places, finite elements within TOLERANCE of the largest. zero_at: {input index:
    the elements of its gradient at the masked classes}, which must be exactly 0 (nothing smooths)."""
    dtype = inputs[0].dtype
    as_float64 = [t.double() if t.is_floating_point() else t for t in inputs]
    grad_output = default_grad_output(reference, as_float64).to(inputs[0].device)
    truth = loss_and_grads(reference, as_float64, grad_of, grad_output)
    ours = loss_and_grads(fused, inputs, grad_of, grad_output)
    with torch.no_grad():  # the kernels take other paths without a gradient
        ours_no_grad = fused(*inputs) if loss_without_grad else ours[0]
    names = ["loss", "loss without grad"] + [f"grad of input {i}" for i in grad_of]
    for name, mine, theirs in zip(names, [ours[0], ours_no_grad, *ours[1]], [truth[0], truth[0], *truth[1]]):
        mine = mine.double()
        for where in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(where(mine), where(theirs)), f"{case} {dtype}: {name}: {where.__name__} differs"
        finite = torch.isfinite(theirs)
        scale = theirs[finite].abs().max().item() if finite.any() else 0.0
        torch.testing.assert_close(mine[finite], theirs[finite], rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype] * scale, msg=lambda m: f"{case} {dtype}: {name}: {m}")
    for index, at_masked in (zero_at or {}).items():
        if index in grad_of:
            assert torch.all(at_masked(ours[1][grad_of.index(index)]) == 0), \
                f"{case} {dtype}: the gradient of input {index} at masked classes is not 0"


# ----------------------------------------------------------------------------------
# CPU (CI): linear_cross_entropy's schedules on the torch twin, softcap, class weights, a process group.

# The gradients wanted and the dtype pick the schedule (choose_schedule): rows (float32 d weight, or
# input's alone), rows then classes (a 2-byte d weight), classes (eval, float16).
LINEAR_GRADS = {"input, weight and bias": (0, 1, 3), "input alone": (0,), "bias alone": (3,), "eval": ()}


def check_linear(device, dtype, grad_of, smoothing, reduction, softcap=None):
    rows, hidden, classes = 10, 16, 50
    masked = masked_classes(classes, device)
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (torch.randn(classes, hidden, device=device) / hidden**0.5).to(dtype)
    b = torch.randn(classes, device=device).mul(0.1).masked_fill(masked, -INF).to(dtype)
    t = unmasked_targets(masked, rows, masked_target_row=reduction == "none")
    zero = untargeted(masked, t)
    options = dict(SMOOTHING[smoothing], reduction=reduction, softcap=softcap)

    def reference(x, w, t, b):
        logits = F.linear(x, w, b)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        return cross_entropy.reference_cross_entropy(logits, t, None, -100, reduction,
                                                     options.get("label_smoothing", 0.0), options.get("z_loss", 0.0),
                                                     False)

    check_matches_torch(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, **options),
                        reference, [x, w, t, b], grad_of,
                        zero_at=None if smoothing != "plain" or softcap else {1: lambda g: g[zero], 3: lambda g: g[zero]},
                        case=f"linear {grad_of} {options}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smoothing", SMOOTHING)
@pytest.mark.parametrize("grad_of", LINEAR_GRADS.values(), ids=LINEAR_GRADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_cross_entropy_on_cpu(dtype, grad_of, smoothing, reduction, small_chunks):
    if dtype == torch.float16 and not CPU_FLOAT16_MATMUL:
        pytest.skip("this torch's CPU matmul takes no float16")
    check_linear("cpu", dtype, grad_of, smoothing, reduction)


def test_linear_cross_entropy_with_softcap_on_cpu(small_chunks):
    """A capped -inf is -softcap: finite, its gradient 0 (the cap's slope), never NaN."""
    check_linear("cpu", torch.float32, (0, 1, 3), "label smoothing and z-loss", "none", softcap=5.0)


@pytest.mark.parametrize("smoothing", SMOOTHING)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_masked_target_gives_torchs_inf_on_cpu(reduction, smoothing, small_chunks):
    """A scalar loss with one row's target masked is inf, its gradients torch's (finite)."""
    masked = masked_classes(50, "cpu")
    x, w = torch.randn(10, 16), torch.randn(50, 16) / 4
    b = torch.zeros(50).masked_fill(masked, -INF)
    t = unmasked_targets(masked, 10, masked_target_row=True)
    options = dict(SMOOTHING[smoothing], reduction=reduction)
    check_matches_torch(lambda x, w, t, b: losses.linear_cross_entropy(x, w, t, linear_bias=b, **options),
                        lambda x, w, t, b: cross_entropy.reference_cross_entropy(
                            F.linear(x, w, b), t, None, -100, reduction, options.get("label_smoothing", 0.0),
                            options.get("z_loss", 0.0), False),
                        [x, w, t, b], (0, 1, 3))


@pytest.mark.parametrize("smoothing", SMOOTHING)
def test_class_weights_take_the_twin_without_nan(smoothing):
    """cross_entropy with class weights and a process group runs the twin's weighted statistics: a
    one-hot's zeros times masked logits are 0 there, not NaN (checked here without a group, through
    the engine's Function)."""
    import row_passes
    masked = masked_classes(50, "cpu")
    z = torch.randn(10, 50).masked_fill(masked, -INF)
    t = unmasked_targets(masked, 10, masked_target_row=False)
    weight = torch.rand(50) + 0.5
    options = SMOOTHING[smoothing]
    eps, z_loss = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)

    def ours(z, t):
        return row_passes.RowPassCrossEntropy.apply(z, t, weight, (-100, eps, z_loss, 0.0, "mean", None, 1.0))[0]

    check_matches_torch(ours, lambda z, t: cross_entropy.reference_cross_entropy(
        z, t, weight.double(), -100, "mean", eps, z_loss, False), [z, t], (0,),
        zero_at={0: lambda g: g[:, masked]} if smoothing == "plain" else None)


def masked_shard_case(rank, group, device, smoothing):
    """Two ranks: rank 0 holds classes [0, 20), rank 1 [20, 50), every one of rank 1's masked.
    cross_entropy and linear_cross_entropy of this rank's shard against torch's of the whole."""
    torch.manual_seed(321)  # the same inputs on both ranks
    rows, hidden, classes, cut = 6, 8, 50, 20
    masked = torch.arange(classes, device=device) >= cut
    masked[3] = True
    logits = torch.randn(rows, classes, device=device).masked_fill(masked, -INF)
    x, head = torch.randn(rows, hidden, device=device), torch.randn(classes, hidden, device=device)
    bias = torch.zeros(classes, device=device).masked_fill(masked, -INF)
    t = unmasked_targets(masked, rows, masked_target_row=False)
    start, end = (0, cut) if rank == 0 else (cut, classes)
    options = SMOOTHING[smoothing]
    eps, z_loss = options.get("label_smoothing", 0.0), options.get("z_loss", 0.0)

    shard = logits[:, start:end].clone().requires_grad_()
    loss = losses.cross_entropy(shard, t, **options, process_group=group, vocab_start=start)
    loss.backward()
    whole = logits.double().requires_grad_()
    expected = cross_entropy.reference_cross_entropy(whole, t, None, -100, "mean", eps, z_loss, False)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, msg=lambda m: f"cross_entropy, {smoothing}: loss: {m}")
    torch.testing.assert_close(shard.grad.double(), whole.grad[:, start:end],
                               msg=lambda m: f"cross_entropy, {smoothing}: grad: {m}")

    mine = [x.clone().requires_grad_(), head[start:end].clone().requires_grad_(),
            bias[start:end].clone().requires_grad_()]
    loss = losses.linear_cross_entropy(*mine[:2], t, linear_bias=mine[2], **options, process_group=group,
                                       vocab_start=start)
    loss.backward()
    full = [tensor.double().requires_grad_() for tensor in (x, head, bias)]
    expected = cross_entropy.reference_cross_entropy(F.linear(*full), t, None, -100, "mean", eps, z_loss, False)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, msg=lambda m: f"linear, {smoothing}: loss: {m}")
    for name, ours, theirs, part in (("input", mine[0], full[0], slice(None)), ("weight", mine[1], full[1],
                                     slice(start, end)), ("bias", mine[2], full[2], slice(start, end))):
        torch.testing.assert_close(ours.grad.double(), theirs.grad[part],
                                   msg=lambda m: f"linear, {smoothing}: grad of {name}: {m}")
    if smoothing == "plain":
        assert torch.all(mine[2].grad[masked[start:end]] == 0)


def fully_masked_row_case(rank, group, device):
    """Two ranks, an ignored row every class of which is masked: its lse is -inf (torch.logsumexp's) and its
    gradient 0 (the row passes' rule for an ignored row, kernel and twin: torch's is NaN, 0 times the row's
    NaN softmax); the other rows' loss and gradient are torch's."""
    torch.manual_seed(322)  # the same inputs on both ranks
    rows, classes, cut = 5, 12, 5
    logits = torch.randn(rows, classes, device=device)
    logits[2] = -INF
    t = torch.randint(0, classes, (rows,), device=device)
    t[2] = -100
    start, end = (0, cut) if rank == 0 else (cut, classes)
    shard = logits[:, start:end].clone().requires_grad_()
    loss, lse = losses.cross_entropy(shard, t, process_group=group, vocab_start=start, return_lse=True)
    loss.backward()
    kept = torch.arange(rows, device=device) != 2
    whole = logits[kept].double().requires_grad_()
    expected = F.cross_entropy(whole, t[kept])
    expected.backward()
    # Guards against Shards.combine without its -inf == -inf guard (exp(-inf - -inf): the row's lse NaN).
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), 1))
    torch.testing.assert_close(loss.double(), expected)
    # Guards against the twin's gradient without its ignored-row guard (row_scale 0: NaN, not 0).
    assert torch.all(shard.grad[2] == 0), shard.grad[2]
    torch.testing.assert_close(shard.grad[kept].double(), whole.grad[:, start:end])


def check_masked_shards(rank, device, on):
    """Both smoothings on this rank, then a fully masked row; `on` the tensors' device ('cuda': both ranks
    share one GPU)."""
    for smoothing in SMOOTHING:
        masked_shard_case(rank, dist.group.WORLD, torch.device(on), smoothing)
    fully_masked_row_case(rank, dist.group.WORLD, torch.device(on))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_masked_shard_under_a_process_group_with_gloo(tmp_path):
    run_on_ranks(check_masked_shards, ("cpu",), "gloo", tmp_path / "store")


# ----------------------------------------------------------------------------------
# GPU: every cross_entropy kernel path, the row-pass kernels, linear's schedules.

@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smoothing", SMOOTHING)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path,case", FORCED, ids=[f"{path}: {case}" for path, case in FORCED])
def test_cross_entropy_every_path(path, case, dtype, smoothing, reduction):
    """Each kernel path forced: masked classes in every row, the first class of row 1 too (the
    smoothing sums' reference point on long rows); with 'none' row 0's target masked."""
    why_not = why_path_cannot_run(path, dtype, reduction, "label_smoothing" if smoothing != "plain" else "indices")
    if why_not:
        pytest.skip(why_not)
    logits = {**SHAPES, **MANY_STREAMED_ROWS, WARP_ROWS_IN_REGISTERS: rows_per_multiprocessor(32, 3001)}[case](dtype)
    masked = masked_classes(logits.shape[1], "cuda")
    logits = logits.masked_fill(masked, -INF)
    logits[1, 0] = -INF
    target = unmasked_targets(masked, logits.shape[0], masked_target_row=reduction == "none")
    target[1] = target[1] if target[1] != 0 else 1
    zero = untargeted(masked, target)
    arguments = dict(SMOOTHING[smoothing], reduction=reduction)
    with forced_path(path):
        check_matches_torch(lambda x, t: losses.cross_entropy(x, t, **arguments),
                            lambda x, t: cross_entropy.reference_cross_entropy(
                                x, t, None, -100, reduction, arguments.get("label_smoothing", 0.0),
                                arguments.get("z_loss", 0.0), False),
                            [logits, target], () if path in SUM_ONLY_PATHS else (0,),
                            zero_at={0: lambda g: g[:, zero]} if smoothing == "plain" else None,
                            case=f"{path} {case}", loss_without_grad=path not in PIPELINED_PATHS)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(softcap=30.0), dict(weight=True), dict(weight=True, label_smoothing=0.1)],
                         ids=["softcap (the row passes)", "class weights", "class weights and smoothing"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_with_softcap_or_class_weights(dtype, options):
    logits = torch.randn(9, 4099, device="cuda").mul(2).to(dtype)
    masked = masked_classes(logits.shape[1], "cuda")
    logits = logits.masked_fill(masked, -INF)
    target = unmasked_targets(masked, logits.shape[0], masked_target_row=True)
    zero = untargeted(masked, target)
    weight = torch.rand(logits.shape[1], device="cuda").add(0.5).to(dtype) if options.get("weight") else None
    arguments = dict(options, weight=weight, reduction="none")

    def reference(x, t):
        if arguments.get("softcap"):
            x = arguments["softcap"] * torch.tanh(x / arguments["softcap"])
        return cross_entropy.reference_cross_entropy(x, t, None if weight is None else weight.double(), -100, "none",
                                                     arguments.get("label_smoothing", 0.0), 0.0, False)

    check_matches_torch(lambda x, t: losses.cross_entropy(x, t, **arguments), reference, [logits, target], (0,),
                        zero_at=None if "label_smoothing" in options or "softcap" in options else
                        {0: lambda g: g[:, zero]})


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", ["16 classes a chunk", "the memory rule's chunks"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("smoothing", SMOOTHING)
@pytest.mark.parametrize("grad_of", LINEAR_GRADS.values(), ids=LINEAR_GRADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_cross_entropy_on_gpu(dtype, grad_of, smoothing, reduction, chunks, request):
    if chunks == "16 classes a chunk":
        request.getfixturevalue("small_chunks")
    check_linear("cuda", dtype, grad_of, smoothing, reduction)


@pytest.mark.gpu
def test_linear_cross_entropy_with_softcap_on_gpu(small_chunks):
    check_linear("cuda", torch.bfloat16, (0, 1, 3), "label smoothing and z-loss", "none", softcap=5.0)


@pytest.mark.gpu
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_masked_shard_under_a_process_group_on_one_gpu(tmp_path):
    """Two gloo ranks on one GPU: the row-pass kernels over each shard, the statistics combined."""
    run_on_ranks(check_masked_shards, ("cuda",), "gloo", tmp_path / "store")
