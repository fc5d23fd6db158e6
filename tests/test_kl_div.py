"""kl_div / KLDivLoss: CPU behaviour (CI) and the fused kernel against float64 (GPU)."""
import types

import pytest
import torch
import torch.nn.functional as F

import losses
from helpers import DTYPES, check_against_float64, check_special_values_match_torch, raises_as_torch

REDUCTIONS = ["batchmean", "mean", "sum", "none"]


def reference(input, target, reduction="batchmean", log_target=False, log_input=True):
    """What users write today; for log_input=False that is F.kl_div(torch.log(p), q, ...)."""
    return F.kl_div(input if log_input else torch.log(input), target, reduction=reduction, log_target=log_target)


def probabilities(*shape, device="cpu", dtype=torch.float32):
    """Rows of a random distribution along the last dim (a 0-dim tensor holds 1)."""
    logits = torch.randn(shape, device=device)
    return (logits.softmax(-1) if logits.dim() else torch.ones((), device=device)).to(dtype)


def make_pair(shape_fn, log_input, log_target):
    """input (p, or log p) and target (q, or log q) from one shape function."""
    p, q = shape_fn(), shape_fn()
    return [p if not log_input else p.log(), q if not log_target else q.log()]


# ----------------------------------------------------------------------------------
# CPU (runs everywhere, CI included).

@pytest.mark.parametrize("log_input", [True, False])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_cpu_matches_torch(reduction, log_target, log_input):
    input, target = make_pair(lambda: probabilities(6, 5), log_input, log_target)
    input.requires_grad_()
    ours = losses.kl_div(input, target, reduction=reduction, log_target=log_target, log_input=log_input)
    torch.testing.assert_close(ours, reference(input, target, reduction, log_target, log_input))
    ours.sum().backward()
    assert input.grad is not None


def test_mean_warns_like_torch():
    p, q = probabilities(3, 4).log(), probabilities(3, 4)
    with pytest.warns(UserWarning, match="'mean' divides the total loss by both"):
        losses.kl_div(p, q, reduction="mean")


def test_module_matches_torch():
    p, q = probabilities(4, 3), probabilities(4, 3)
    torch.testing.assert_close(losses.KLDivLoss(reduction="batchmean")(p.log(), q),
                               torch.nn.KLDivLoss(reduction="batchmean")(p.log(), q))
    torch.testing.assert_close(losses.KLDivLoss(reduction="batchmean", log_input=False)(p, q),
                               torch.nn.KLDivLoss(reduction="batchmean")(p.log(), q))
    torch.testing.assert_close(losses.KLDivLoss(reduce=False)(p.log(), q), torch.nn.KLDivLoss(reduce=False)(p.log(), q))


def test_bad_arguments_raise_clear_errors():
    p = probabilities(3, 4)
    with pytest.raises(ValueError, match="reduction must be one of"):
        losses.kl_div(p, p, reduction="average")
    with pytest.raises(ValueError, match="target is on meta"):
        losses.kl_div(p, torch.empty(3, 4, device="meta"))


TORCH = types.SimpleNamespace(kl_div=F.kl_div, KLDivLoss=torch.nn.KLDivLoss)


@pytest.mark.parametrize("case,call", [
    ("target on another device", lambda m, p: m.kl_div(p, p.to("meta"), reduction="sum")),
    ("input on another device", lambda m, p: m.kl_div(p.to("meta"), p, reduction="sum")),
    ("integer target", lambda m, p: m.kl_div(p, p.long(), reduction="sum")),
    ("shapes that do not broadcast", lambda m, p: m.kl_div(p, p[:, :3], reduction="sum")),
    ("reduction", lambda m, p: m.kl_div(p, p, reduction="average")),  # torch: ValueError
    ("input a list", lambda m, p: m.kl_div(p.tolist(), p, reduction="sum")),  # torch: TypeError
    ("target a list", lambda m, p: m.kl_div(p, p.tolist(), reduction="sum")),
    ("module, target a list", lambda m, p: m.KLDivLoss(reduction="sum")(p, p.tolist())),
])
def test_bad_calls_raise_what_torch_raises(case, call):
    p = probabilities(3, 4)
    raises_as_torch(lambda: call(losses, p), lambda: call(TORCH, p))


@pytest.mark.parametrize("name", ["input", "target"])
def test_a_non_tensor_gets_a_type_error_that_names_it(name):
    arguments = dict(input=probabilities(3, 4), target=probabilities(3, 4))
    arguments[name] = arguments[name].tolist()
    with pytest.raises(TypeError, match=f"kl_div: {name} must be a Tensor, got list"):
        losses.kl_div(**arguments)


# ----------------------------------------------------------------------------------
# GPU: the fused kernel against torch in float64.

# Each case hits one regime of the kernel. Built on the GPU, so views stay views.
SHAPES = {
    "one row, odd length (vector body + scalar tail)": lambda dtype: probabilities(1, 4099, device="cuda", dtype=dtype),
    "7x1000": lambda dtype: probabilities(7, 1000, device="cuda", dtype=dtype),
    "3-D batch": lambda dtype: probabilities(4, 33, 77, device="cuda", dtype=dtype),
    "non-contiguous view (stride 2)": lambda dtype: probabilities(64, 260, device="cuda", dtype=dtype)[:, ::2],
    "misaligned view (no 16-byte vectors)":
        lambda dtype: probabilities(3, 1001, device="cuda", dtype=dtype).view(-1)[1:3001].view(2, 1500),
    "single element": lambda dtype: probabilities(device="cuda", dtype=dtype),
}


@pytest.mark.gpu
@pytest.mark.parametrize("log_input", [True, False], ids=["log_input", "probability_input"])
@pytest.mark.parametrize("log_target", [False, True], ids=["prob_target", "log_target"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
def test_matches_float64(case, dtype, reduction, log_target, log_input):
    inputs = make_pair(lambda: SHAPES[case](dtype), log_input, log_target)
    check_against_float64(
        lambda i, t: losses.kl_div(i, t, reduction=reduction, log_target=log_target, log_input=log_input),
        lambda i, t: reference(i, t, reduction, log_target, log_input), inputs, grad_of=(0, 1), case=case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_seed_shape(dtype):
    """The seeds' workload: F.kl_div(torch.log(p), q, 'batchmean') on 16384 x 16384."""
    inputs = [probabilities(16384, 16384, device="cuda", dtype=dtype) for _ in range(2)]
    check_against_float64(lambda p, q: losses.kl_div(p, q, reduction="batchmean", log_input=False),
                          lambda p, q: reference(p, q, "batchmean", log_input=False), inputs, grad_of=(0,),
                          case="16384x16384")


@pytest.mark.gpu
def test_mean_warns_on_the_fused_path_too():
    p, q = probabilities(3, 4, device="cuda").log(), probabilities(3, 4, device="cuda")
    with pytest.warns(UserWarning, match="'mean' divides the total loss by both"):
        losses.kl_div(p, q, reduction="mean")


@pytest.mark.gpu
@pytest.mark.parametrize("shapes", [((4, 3), (3,)), ((3,), (4, 3)), ((4, 1), (4, 5))], ids=str)
@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
def test_broadcasting_matches_float64(shapes):
    inputs = [probabilities(*shapes[0], device="cuda"), probabilities(*shapes[1], device="cuda")]
    for reduction in REDUCTIONS:
        check_against_float64(lambda p, q: losses.kl_div(p, q, reduction=reduction, log_input=False),
                              lambda p, q: reference(p, q, reduction, log_input=False), inputs, grad_of=(0, 1),
                              case=str(shapes))


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16)], ids=str)
def test_mixed_dtypes_promote_like_torch(dtypes):
    inputs = [probabilities(7, 1000, device="cuda", dtype=dtypes[0]).log(),
              probabilities(7, 1000, device="cuda", dtype=dtypes[1])]
    check_against_float64(lambda i, t: losses.kl_div(i, t, reduction="batchmean"),
                          lambda i, t: reference(i, t, "batchmean"), inputs, grad_of=(0, 1), case=str(dtypes))


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("subnormal", ["p", "q"])
def test_bfloat16_subnormal_probabilities_match_float64(subnormal, reduction):
    """bfloat16 holds values below float32's smallest normal. The fast path's reciprocal
    flushes a subnormal p to 0 (an infinite ratio), which must send its pair to the exact
    formula rather than an infinity into the loss; a subnormal q must keep its value
    through the fast path's products. Some in every pack, next to ordinary values."""
    p, q = (probabilities(8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        (p if subnormal == "p" else q)[:, ::7] = 3e-39
    # d/dp = -q/p is about 1e37 where p is subnormal: it would drown every other element's
    # error in the relative norm, so there only the loss and the target's gradient are checked.
    check_against_float64(lambda p, q: losses.kl_div(p, q, reduction=reduction, log_input=False),
                          lambda p, q: reference(p, q, reduction, log_input=False), [p, q],
                          grad_of=(1,) if subnormal == "p" else (0, 1), case=f"subnormal {subnormal}")


@pytest.mark.gpu
@pytest.mark.parametrize("log_input", [True, False], ids=["log_input", "probability_input"])
@pytest.mark.parametrize("log_target", [False, True], ids=["prob_target", "log_target"])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "none"])
def test_zeros_nan_and_inf_follow_torchs_conventions(reduction, log_target, log_input):
    """q == 0 contributes 0; p == 0 where q > 0 gives inf; NaN stays NaN; gradients too."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [float("nan"), 0.5, 0.25, 0.25]],
                     device="cuda", dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, float("nan"), 0.5]],
                     device="cuda", dtype=torch.float64)
    input, target = (p.log() if log_input else p), (q.log() if log_target else q)
    with torch.no_grad():  # log(0) = -inf is an input here, not something to differentiate through
        input, target = input.clone(), target.clone()
    check_special_values_match_torch(
        lambda i, t: losses.kl_div(i, t, reduction=reduction, log_target=log_target, log_input=log_input),
        lambda i, t: reference(i, t, reduction, log_target, log_input), [input, target], grad_of=(0, 1),
        rtol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("integral", ["input", "target", "both"])
def test_integer_tensors_raise_as_torch(device, integral):
    """torch refuses integer (and bool) operands before any type promotion; so do we, also
    where a float operand would have promoted them into the fused kernel."""
    floats = probabilities(4, 5, device=device)
    ints = torch.randint(0, 3, (4, 5), device=device)
    input, target = {"input": (ints, floats), "target": (floats, ints), "both": (ints, ints)}[integral]
    with pytest.raises(RuntimeError, match="kl_div: Integral inputs not supported"):
        F.kl_div(input, target, reduction="batchmean")
    for log_input in (True, False):
        with pytest.raises(RuntimeError, match="kl_div: Integral inputs not supported"):
            losses.kl_div(input, target, reduction="batchmean", log_input=log_input)
