"""log_probs (issue 57): per-token log p(target) and the softmax's entropy at a temperature,
against float64 torch formulas: values, each output's gradient alone and both together (per-token
weights, as advantages), softcap, ignored rows, masked classes, (..., C) shapes and int32 targets."""
import functools
import math

import pytest
import torch
import torch.distributed as dist

import loss_helpers
import losses
from helpers import capture_step, loss_and_grads, rel_err, run_on_ranks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# How far from float64 each dtype's outputs and gradients may be, relative to the tensor's size:
# the logits are exact in every dtype (rounded first), so this is the arithmetic alone.
RTOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 2e-6}
GRAD_RTOL = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 2**-8}


def reference(logits, target, temperature, softcap, ignore_index):
    """(log p(target), entropy) in float64 by torch's ops, 0 at ignored rows."""
    z = logits.double()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    u = z / temperature
    log_p = torch.log_softmax(u, -1)
    ignored = target == ignore_index
    safe = torch.where(ignored, 0, target).long()
    picked = log_p.gather(-1, safe[..., None])[..., 0]
    entropy = -(torch.where(log_p == -math.inf, 0.0, log_p.exp() * log_p)).sum(-1)
    return torch.where(ignored, 0.0, picked), torch.where(ignored, 0.0, entropy)


def case(shape, classes, dtype, device, seed=0, ignore_index=-100):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, classes, generator=generator)).to(dtype).to(device)
    target = torch.randint(0, classes, shape, generator=generator)
    target[(torch.rand(shape, generator=generator) < 0.2)] = ignore_index
    return logits, target.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("wanted", ["log_probs", "entropy", "both"])
def test_matches_float64(device, dtype, temperature, softcap, wanted):
    logits, target = case((3, 5), 37, dtype, device)
    x = logits.detach().requires_grad_()
    ours, entropy = losses.log_probs(x, target, temperature=temperature, softcap=softcap, return_entropy=True)
    reference_x = logits.double().detach().requires_grad_()
    theirs, their_entropy = reference(reference_x, target, temperature, softcap, -100)
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert ours.dtype == entropy.dtype == expected_dtype and ours.shape == target.shape == entropy.shape
    assert rel_err(ours, theirs) <= RTOL[dtype] and rel_err(entropy, their_entropy) <= RTOL[dtype]
    weights = torch.rand(target.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pick = {"log_probs": (1, 0), "entropy": (0, 1), "both": (1, 1)}[wanted]
    (pick[0] * (ours * weights.to(ours.dtype).to(device)).sum()
     + pick[1] * (entropy * weights.flip(0).to(ours.dtype).to(device)).sum()).backward()
    (pick[0] * (theirs * weights.to(device)).sum() + pick[1] * (their_entropy * weights.flip(0).to(device)).sum()).backward()
    assert x.grad.dtype == dtype
    assert rel_err(x.grad, reference_x.grad) <= GRAD_RTOL[dtype], rel_err(x.grad, reference_x.grad)
    assert (x.grad[target == -100] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_without_entropy_returns_log_probs_alone(device):
    logits, target = case((2, 4), 11, torch.float32, device)
    ours = losses.log_probs(logits, target.int(), temperature=0.5)
    theirs, _ = reference(logits, target, 0.5, 0.0, -100)
    assert isinstance(ours, torch.Tensor) and rel_err(ours, theirs) <= RTOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_peaked_rows_keep_their_digits(device):
    """Confident rows (the target 20 to 60 above the rest): log p to its relative precision, as
    -log1p(sum of the others' exp(u_c - u_t)) in float64 (torch's float64 log_softmax gives 0 from
    margin 40); the entropy within the issue's 1e-6 max(1, H)."""
    logits = torch.zeros(4, 50, dtype=torch.float64)
    target = torch.tensor([3, 7, 0, 49])
    logits[torch.arange(4), target] = torch.tensor([20.0, 30.0, 40.0, 60.0], dtype=torch.float64)
    ours, entropy = losses.log_probs(logits.float().to(device), target.to(device), return_entropy=True)
    others = (logits - logits.gather(1, target[:, None])).scatter(1, target[:, None], -math.inf).exp().sum(1)
    exact = -torch.log1p(others)
    _, their_entropy = reference(logits, target, 1.0, 0.0, -100)
    assert ((ours.double().cpu() - exact).abs() <= 4e-6 * exact.abs()).all()
    assert ((entropy.double().cpu() - their_entropy).abs() <= 1e-6 * their_entropy.abs().clamp(min=1)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("linear", [False, True], ids=["log_probs", "linear_log_probs"])
def test_an_entropy_returned_as_a_metric_leaves_the_gradient_alone(device, linear, small_chunks):
    """GRPO's pattern: the entropy returned, detached (a metric), only the log-probs differentiated:
    the gradient is return_entropy=False's (the kernel then takes the statistics without the entropy's row)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 16, generator=generator).to(device)
    w = (torch.randn(45, 16, generator=generator) / 2).to(device)
    target = torch.randint(0, 45, (2, 5), generator=generator)
    target[1, 2] = -100
    target, advantages = target.to(device), torch.randn(2, 5, generator=generator).to(device)
    grads = []
    for return_entropy in (True, False):
        leaf = (x if linear else x @ w.t()).detach().requires_grad_()
        operands = (leaf, w, target) if linear else (leaf, target)
        outputs = (losses.linear_log_probs if linear else losses.log_probs)(*operands, temperature=0.7,
                                                                          return_entropy=return_entropy)
        values, metric = outputs if return_entropy else (outputs, torch.zeros(()))
        ((values * advantages).sum() + metric.detach().sum()).backward()
        grads.append(leaf.grad)
    assert rel_err(grads[0], grads[1]) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_masked_classes(device):
    """-inf logits (a masked vocabulary): finite log-probs, entropy and gradients, 0 at the masked classes."""
    logits, target = case((6,), 20, torch.float32, device)
    target = target.clamp(0, 15)
    logits[:, 16:] = -math.inf
    x = logits.detach().requires_grad_()
    ours, entropy = losses.log_probs(x, target, temperature=0.8, return_entropy=True)
    (ours.sum() + entropy.sum()).backward()
    theirs, their_entropy = reference(logits[:, :16], target, 0.8, 0.0, -100)
    assert rel_err(ours, theirs) <= 1e-6 and rel_err(entropy, their_entropy) <= 1e-6
    assert torch.isfinite(x.grad).all() and (x.grad[:, 16:] == 0).all()


@pytest.mark.parametrize("temperature", [0, -1.0, True, "1", float("nan"), None])
def test_temperature_must_be_positive(temperature):
    logits, target = case((2,), 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="temperature"):
        losses.log_probs(logits, target, temperature=temperature)


def test_bad_targets_are_refused():
    logits, target = case((2, 3), 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="shape"):
        losses.log_probs(logits, target[0])
    with pytest.raises(RuntimeError, match="int64 or int32"):
        losses.log_probs(logits, target.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,softcap", [(1.0, 0.0), (0.7, 0.0), (0.7, 30.0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_linear_log_probs_match_float64(device, dtype, temperature, softcap, bias, head, small_chunks):
    """linear_log_probs against log_softmax of F.linear in float64: values and the gradients of input,
    weight and bias under per-token weights on both outputs, chunks of a few classes or rows (small_chunks).
    A frozen head's d input comes from the forward (choose_schedule's "rows"), the entropy's term from the
    logits made again in backward."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=generator).to(dtype).to(device).requires_grad_()
    w = (torch.randn(45, 16, generator=generator) / 2).to(dtype).to(device).requires_grad_(head == "trained")
    b = torch.randn(45, generator=generator).to(dtype).to(device).requires_grad_(head == "trained") if bias else None
    target = torch.randint(0, 45, (2, 5), generator=generator)
    target[0, 1] = -100
    target = target.to(device)
    ours, entropy = losses.linear_log_probs(x, w, target.int(), linear_bias=b, temperature=temperature,
                                            softcap=softcap, return_entropy=True)
    leaves = [t.detach().double().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    logits = torch.nn.functional.linear(*leaves)
    theirs, their_entropy = reference(logits, target, temperature, softcap, -100)
    assert ours.shape == target.shape and ours.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # The values from the logits as the product rounds them (to bfloat16 for bfloat16), as linear_cross_entropy's.
    rounded = torch.nn.functional.linear(x.detach(), w.detach(), None if b is None else b.detach()).double()
    values, entropies = reference(rounded, target, temperature, softcap, -100)
    assert rel_err(ours, values) <= 2 * RTOL[dtype] and rel_err(entropy, entropies) <= 2 * RTOL[dtype]
    weights = torch.rand(target.shape, generator=generator, dtype=torch.float64).to(device)
    ((ours * weights.to(ours.dtype)).sum() - (entropy * weights.flip(1).to(ours.dtype)).sum()).backward()
    ((theirs * weights).sum() - (their_entropy * weights.flip(1)).sum()).backward()
    for mine, truth in zip([t for t in (x, w, b) if t is not None and t.requires_grad], leaves):
        assert mine.grad.dtype == dtype and rel_err(mine.grad, truth.grad) <= 2 * GRAD_RTOL[dtype]


def check_sharded(rank, device):
    """Two ranks: rank 0 holds classes [0, 17), rank 1 [17, 40), rank 1's last three masked. Each
    rank's log-probs and entropy equal those of the whole logits; its gradient is its shard's."""
    logits, target = case((3, 4), 40, torch.float32, device, seed=5)
    logits[..., 37:] = -math.inf
    target = torch.where(target == -100, -100, target.clamp(max=36))
    start, end = (0, 17) if rank == 0 else (17, 40)
    shard = logits[..., start:end].clone().requires_grad_()
    ours, entropy = losses.log_probs(shard, target, temperature=0.7, softcap=20.0, return_entropy=True,
                                     process_group=dist.group.WORLD, vocab_start=start)
    weights = torch.rand(target.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ((ours * weights.float()).sum() + (entropy * weights.flip(0).float()).sum()).backward()
    whole = logits.double().requires_grad_()
    theirs, their_entropy = reference(whole, target, 0.7, 20.0, -100)
    ((theirs * weights).sum() + (their_entropy * weights.flip(0)).sum()).backward()
    assert rel_err(ours, theirs) <= 2e-6 and rel_err(entropy, their_entropy) <= 2e-6
    assert rel_err(shard.grad, whole.grad[..., start:end]) <= 2e-6

    torch.manual_seed(6)  # linear_log_probs: this rank's rows of the head
    x, head = torch.randn(3, 4, 8), torch.randn(40, 8)
    mine = [x.clone().requires_grad_(), head[start:end].clone().requires_grad_()]
    ours, entropy = losses.linear_log_probs(*mine, target, temperature=1.5, return_entropy=True,
                                            process_group=dist.group.WORLD, vocab_start=start)
    ((ours * weights.float()).sum() + (entropy * weights.flip(0).float()).sum()).backward()
    full = [x.double().requires_grad_(), head.double().requires_grad_()]
    theirs, their_entropy = reference(torch.nn.functional.linear(*full), target, 1.5, 0.0, -100)
    ((theirs * weights).sum() + (their_entropy * weights.flip(0)).sum()).backward()
    assert rel_err(ours, theirs) <= 4e-6 and rel_err(entropy, their_entropy) <= 4e-6
    assert rel_err(mine[0].grad, full[0].grad) <= 4e-6 and rel_err(mine[1].grad, full[1].grad[start:end]) <= 4e-6


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_process_group_on_gloo(tmp_path):
    run_on_ranks(check_sharded, (), "gloo", tmp_path / "store")


# ----------------------------------------------------------------------------------
# temperature= on cross_entropy: the loss, lse, z-loss and smoothing of u = softcap(z) / T.

@pytest.mark.parametrize("device", ["cpu", "cpu models"] + DEVICES[1:])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3}, {"softcap": 20.0},
                                     {"weight": True}], ids=["plain", "smoothing+z_loss", "softcap", "weight"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_at_a_temperature(device, dtype, options, reduction, request):
    """On CUDA the fused kernels (softcap: the row passes); "cpu models": their plumbing on CPU (the
    kernels' Python models: the temperature reaches forward and backward)."""
    if device == "cpu models":
        request.getfixturevalue("kernels_modelled_on_cpu")
        device = "cpu"
    logits, target = case((12,), 30, dtype, device, seed=4)
    options = dict(options)
    if options.pop("weight", False):
        options["weight"] = torch.linspace(0.5, 1.5, 30, dtype=dtype, device=device)
    x = logits.detach().requires_grad_()
    loss, lse = losses.cross_entropy(x, target, reduction=reduction, temperature=0.6, return_lse=True, **options)
    whole = logits.double().requires_grad_()
    reference_options = {k: (v.double() if k == "weight" else v) for k, v in options.items()}
    z_loss, softcap = reference_options.pop("z_loss", 0.0), reference_options.pop("softcap", None)
    u = (whole if softcap is None else softcap * torch.tanh(whole / softcap)) / 0.6
    expected = torch.nn.functional.cross_entropy(u, target, reduction=reduction, **reference_options)
    their_lse = torch.logsumexp(u, 1)
    counted = (target != -100).double()
    z = z_loss * their_lse.square() * counted
    expected = expected + (z if reduction == "none" else z.sum() / counted.sum())
    weights = torch.rand(expected.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device)
    (loss * weights.to(loss.dtype)).sum().backward()
    (expected * weights).sum().backward()
    # bfloat16: torch's formula (CPU, and the fallback) divides in bfloat16, u rounded to 2^-9 of itself
    rtol = 2**-6 if dtype == torch.bfloat16 else RTOL[dtype] * 4
    assert rel_err(loss, expected) <= rtol and rel_err(lse, their_lse) <= max(rtol, 2e-6)
    assert rel_err(x.grad, whole.grad) <= max(rtol, GRAD_RTOL[dtype] * 2)


def test_temperature_one_is_todays_call():
    logits, target = case((16,), 50, torch.float32, "cpu", seed=8)
    assert torch.equal(losses.cross_entropy(logits, target, temperature=1.0), losses.cross_entropy(logits, target))
    with pytest.raises(ValueError, match="temperature"):
        losses.cross_entropy(logits, target, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        losses.CrossEntropyLoss(temperature=-2.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("wants", ["input", "all"])
def test_linear_cross_entropy_at_a_temperature(device, dtype, reduction, wants, small_chunks):
    """Every schedule's plumbing (the loss, rows and gradients passes): linear_cross_entropy at
    temperature 0.6 with smoothing and z-loss equals cross_entropy of F.linear's logits at it."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(7, 12, generator=generator, dtype=dtype).to(device).requires_grad_()
    w = torch.randn(33, 12, generator=generator, dtype=dtype).to(device).requires_grad_(wants == "all")
    target = torch.randint(0, 33, (7,), generator=generator).to(device)
    target[2] = -100
    options = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, temperature=0.6)
    ours = losses.linear_cross_entropy(x, w, target, **options)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    theirs = losses.cross_entropy(torch.nn.functional.linear(*leaves), target, **options)
    ours.sum().backward()
    theirs.sum().backward()
    assert rel_err(ours, theirs) <= 4 * RTOL[dtype]
    for mine, truth in zip([x, w] if wants == "all" else [x], leaves):
        assert rel_err(mine.grad, truth.grad) <= 4 * GRAD_RTOL[dtype]


def grpo_step(linear, h, head, target, advantages):
    """A GRPO-like step's loss: per-token weights on the log-probs at temperature 0.7, an entropy bonus."""
    if linear:
        values, entropy = losses.linear_log_probs(h, head, target, temperature=0.7, return_entropy=True)
    else:
        values, entropy = losses.log_probs(h @ head.t(), target, temperature=0.7, return_entropy=True)
    return (values * advantages).sum() + 0.01 * entropy.sum()


@pytest.mark.skipif(not loss_helpers.COMPILE_OPS, reason="torch.compile of the losses needs torch 2.4+")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("linear", [False, True], ids=["log_probs", "linear_log_probs"])
def test_compiles_whole(device, linear):
    """torch.compile(fullgraph=True) of a GRPO-like step (per-token weights on the log-probs, an
    entropy bonus): no graph break, eager's values and gradients (aot_eager: tracing, no codegen)."""
    generator = torch.Generator().manual_seed(11)
    h = torch.randn(3, 5, 8, generator=generator).to(device).requires_grad_()
    head = torch.randn(33, 8, generator=generator).to(device).requires_grad_()
    target = torch.randint(0, 33, (3, 5), generator=generator).to(device)
    target[0, 0] = -100
    advantages = torch.randn(3, 5, generator=generator).to(device)
    step = functools.partial(grpo_step, linear)
    eager = step(h, head, target, advantages)
    eager_grads = torch.autograd.grad(eager, (h, head))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(h, head, target, advantages)
    grads = torch.autograd.grad(compiled, (h, head))
    assert rel_err(compiled, eager) <= 1e-6
    for grad, eager_grad in zip(grads, eager_grads):
        assert rel_err(grad, eager_grad) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("linear,head", [(False, "trained"), (True, "trained"), (True, "frozen")],
                         ids=["log_probs", "linear_log_probs", "linear_log_probs, frozen head"])
def test_a_cuda_graph_replays_on_new_inputs(linear, head):
    """A GRPO-like step and its gradients captured in a CUDA graph (no host sync, nothing allocated outside
    its pool) and replayed on new hidden states, head, targets and advantages: eager's values and gradients.
    A frozen head's d input comes from the forward."""
    def fresh():
        target = torch.randint(0, 1000, (64,), device="cuda").masked_fill(torch.rand(64, device="cuda") < 0.2, -100)
        return [torch.randn(64, 32, device="cuda"), torch.randn(1000, 32, device="cuda") / 6, target,
                torch.randn(64, device="cuda")]

    step = functools.partial(grpo_step, linear)
    static = fresh()
    grad_of = (0, 1) if head == "trained" else (0,)
    for index in grad_of:
        static[index].requires_grad_()
    graph, static_loss, static_grads = capture_step(step, static, grad_of, None)
    for _ in range(3):
        new = fresh()
        with torch.no_grad():
            for static_tensor, new_tensor in zip(static, new):
                static_tensor.copy_(new_tensor)
        graph.replay()
        eager_loss, eager_grads = loss_and_grads(step, new, grad_of)
        torch.testing.assert_close(static_loss, eager_loss)
        for static_grad, eager_grad in zip(static_grads, eager_grads):
            torch.testing.assert_close(static_grad, eager_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("head", ["trained", "frozen"])
def test_linear_log_probs_under_autocast(head):
    """Under CUDA autocast (bfloat16), float32 hidden states and head: the products run in bfloat16, forward
    and backward, as linear_cross_entropy's. The outputs and gradients are those of the call on bfloat16
    copies, bit for bit (backward used to make the logits again in float32)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(300, 64, generator=generator).cuda()
    w = (torch.randn(5000, 64, generator=generator) / 8).cuda()
    target = torch.randint(0, 5000, (300,), generator=generator).cuda()
    weights = torch.randn(300, generator=generator).cuda()
    results = []
    for autocast in (True, False):
        leaves = [t.detach().clone() if autocast else t.detach().bfloat16() for t in (x, w)]
        for leaf in leaves[:2 if head == "trained" else 1]:
            leaf.requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            values, entropy = losses.linear_log_probs(*leaves, target, temperature=0.7, return_entropy=True)
        ((values * weights).sum() + entropy.mean()).backward()
        results.append([values, entropy] + [leaf.grad.float() for leaf in leaves if leaf.requires_grad])
    assert results[0][0].dtype == torch.float32
    for under_autocast, on_copies in zip(*results):
        assert torch.equal(under_autocast, on_copies)
