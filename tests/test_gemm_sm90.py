"""linear_ce_gemm's gemm_nt and row_stats (kernels/gemm_sm90.cuh, notes/performance.md): a @ b.T on
sm_90a (the pingpong schedule: 128 x 192 tiles, one consumer warpgroup each), against float64 of the
same 2-byte inputs, and the same bits on every run and grid.

Needs a compute capability 9.0 GPU (H100, H200): the kernel is sm_90a code, built with
loader.load("linear_ce_gemm", dtype, arch="9.0a"). Elsewhere every test skips.
"""
import pytest
import torch

import loader


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90(), reason="needs a cc 9.0 GPU (sm_90a kernel)")]

DTYPES = [torch.bfloat16, torch.float16]
TILE_COLUMNS = 192  # classes a tile of row_stats' partials covers (kernels/ops.h, kGemmRowStatsTileColumns)

# (m, n, k), each hitting a regime of the 128 x 192 tiles (K blocks of 64, 5 stages) or of the
# persistent grid.
SHAPES = [
    (4096, 4096, 4096),      # square, 704 tiles: ~5 waves of 132 blocks
    (1024, 128256, 4096),    # Llama 3's head over 1024 rows: 8 x 668 tiles, group of 8 M tiles
    (1, 1000, 512),          # one row: A's 128-row box all but one row out of bounds (zeros)
    (127, 256, 64),          # one partial M tile, two N tiles (the second partial) and one K block
    (129, 257, 72),          # one row past an M tile, a second N tile of 65 columns, a partial K block
    (128, 256, 64),          # one full N tile and one partial
    (128, 192, 64),          # exactly one tile
    (300, 2000, 256),        # 3 x 11 tiles: fewer than the multiprocessors; 4 K blocks < 5 stages
    (256, 255, 4104),        # N = 192 + 63 (two N tiles); K one 8-element step past 64 blocks
    (200, 50257, 8),         # GPT-2's vocabulary (ragged, rows not 16 B-aligned: 2 B stores); K = 8, one K
                             # block a tile: the consumers' turns come faster than the stages
    (513, 1024, 4104),       # ragged M over several tiles, K ragged
]


class _Builds(dict):
    """linear_ce_gemm's build per dtype, loaded at its first test: a run of one dtype's tests (-k)
    builds only that one."""

    def __missing__(self, dtype):
        self[dtype] = loader.load("linear_ce_gemm", dtype, arch="9.0a")
        return self[dtype]


@pytest.fixture(scope="module")
def builds():
    return _Builds()


def random_operands(m, n, k, dtype, a_stride=None, b_stride=None):
    """Fresh normal operands (never zeros); with a row stride > k, views of wider tensors."""
    a = torch.randn(m, a_stride or k, device="cuda", dtype=dtype)[:, :k]
    b = torch.randn(n, b_stride or k, device="cuda", dtype=dtype)[:, :k]
    return a, b


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def gemm(builds, a, b, max_blocks=0):
    out = poisoned(a.shape[0], b.shape[0], a.dtype)
    result = builds[a.dtype].gemm_nt(a, b, out, max_blocks)
    assert result.data_ptr() == out.data_ptr()
    return out


def assert_close_to_float64(ours, a, b):
    """Our error norm against float64 within 1.5x of torch.mm's (cuBLAS, the same output dtype)."""
    truth = a.double() @ b.double().T
    theirs = torch.mm(a, b.T)
    assert not ours.isnan().any(), "an output element was never written"
    our_error = (ours.double() - truth).norm().item()
    their_error = (theirs.double() - truth).norm().item()
    eps = 1e-6 * truth.norm().item() + 1e-30
    assert our_error <= 1.5 * their_error + eps, (our_error, their_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_nt_matches_float64(builds, m, n, k, dtype):
    a, b = random_operands(m, n, k, dtype)
    assert_close_to_float64(gemm(builds, a, b), a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_operands_and_output(builds, dtype):
    """Row strides above k for both operands (views of wider tensors) and an output with row
    stride above n: the tensor maps' strides and the epilogue's ldc."""
    m, n, k = 300, 700, 520
    a, b = random_operands(m, n, k, dtype, a_stride=k + 64, b_stride=k + 8)
    wide = torch.full((m, n + 24), float("nan"), device="cuda", dtype=dtype)
    out = wide[:, :n]
    builds[dtype].gemm_nt(a, b, out, 0)
    assert_close_to_float64(out, a, b)
    assert wide[:, n:].isnan().all(), "wrote past the output's columns"


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_output_when_none_given(builds, dtype):
    a, b = random_operands(130, 300, 64, dtype)
    ours = builds[dtype].gemm_nt(a, b, None, 0)
    assert ours.shape == (130, 300) and ours.is_contiguous()
    assert_close_to_float64(ours, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (513, 50257, 264), (1024, 128256, 1024), (513, 20000, 72)])
def test_same_bits_every_run_and_grid(builds, m, n, k, dtype):
    """Three runs, then grids of 66, 7 and 1 blocks: each tile's K order is fixed and one consumer of
    one block owns it, so which block runs it, or when, changes no bit. At 7 and 1 blocks: a long
    alternation of turns, odd and even tile counts; K = 72: 2 K blocks < 5 stages."""
    a, b = random_operands(m, n, k, dtype)
    first = gemm(builds, a, b)
    for max_blocks in (0, 0, 66, 7, 1):
        assert torch.equal(gemm(builds, a, b, max_blocks), first), max_blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_zero_k(builds, dtype):
    ops = builds[dtype]
    assert ops.gemm_nt(*random_operands(0, 5, 8, dtype), None, 0).shape == (0, 5)
    assert ops.gemm_nt(*random_operands(5, 0, 8, dtype), None, 0).shape == (5, 0)
    a, b = random_operands(5, 6, 0, dtype)
    assert torch.equal(ops.gemm_nt(a, b, poisoned(5, 6, dtype), 0), torch.zeros(5, 6, device="cuda", dtype=dtype))


def test_refuses_what_the_copy_engine_cannot_read(builds):
    ops = builds[torch.bfloat16]
    a, b = random_operands(64, 64, 12, torch.bfloat16)  # 24 B rows: not a multiple of 16 B
    with pytest.raises(ValueError, match="multiples of 8"):
        ops.gemm_nt(a, b, None, 0)
    a, b = random_operands(64, 64, 64, torch.bfloat16, a_stride=68)  # row stride 136 B
    with pytest.raises(ValueError, match="multiples of 8"):
        ops.gemm_nt(a, b, None, 0)
    with pytest.raises(ValueError, match="bfloat16 or both float16"):
        ops.gemm_nt(a.float(), b.float(), None, 0)
    with pytest.raises(ValueError, match="both bfloat16 or both float16"):
        ops.gemm_nt(a, b.half(), None, 0)


# ---------------------------------------------------------------------------------
# row_stats: the fused product's epilogue, each row's statistics over each 192-class tile (the row
# passes' rows), combined by row_passes.combine_tiles.

def row_pass_stats(logits, target, softcap, temperature, stat_rows):
    """The row passes' statistics of whole logits (one chunk): the reference."""
    import row_passes
    stats = row_passes.new_stats(logits.shape[0], logits.dtype, logits.device, stat_rows)
    row_passes.fold_stats(logits, target, 0, logits.shape[1], stats, softcap, temperature=temperature)
    return stats


def logit_sum_scale(logits, softcap, temperature):
    """Each row's sum_c |u_c| (u = softcap(z) / T in float32, masked classes' -inf left out), at least 1: the
    scale of float32's rounding in stat row 3, sum_c u_c, whose signed terms ours and the row passes' add in
    another order (its partial sums may be far larger than |sum_c u_c|)."""
    import row_passes
    u = row_passes._scaled(logits.float(), softcap, temperature)
    return torch.where(u.isfinite(), u.abs(), 0.0).sum(1).clamp_min(1.0)


def exact_operands(m, n, k, dtype, seed, bias=False):
    """a (m, k), b (n, k) and a bias (n,) or None on a grid of 1/4 from a seeded generator: every logit exact in
    float32 and in the 2-byte dtype, whatever the order of the sums."""
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randint(-3, 4, (m, k), generator=generator) / 4).to(dtype).cuda()
    b = (torch.randint(-3, 4, (n, k), generator=generator) / 4).to(dtype).cuda()
    bias_ = (torch.randint(-8, 9, (n,), generator=generator) / 4).to(dtype).cuda() if bias else None
    return a, b, bias_


def targets(m, n, int32=False):
    target = torch.randint(0, n, (m,), device="cuda")
    target[::5] = -100
    return target.int() if int32 else target


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(300, 50257, 264), (129, 1000, 72), (1024, 128256, 512), (1, 300, 8)])
@pytest.mark.parametrize("stat_rows", [5, 6])
@pytest.mark.parametrize("softcap,temperature", [(0.0, 1.0), (0.0, 0.7), (30.0, 0.7)])
def test_row_stats_match_the_row_passes(builds, m, n, k, dtype, stat_rows, softcap, temperature):
    """Random operands, no bias: the epilogue's logits are gemm_nt's (the same sums rounded alike), so the
    statistics are the row passes' over gemm_nt's output: max and target exactly, the sums to float32's
    rounding (a tile's sum then the tiles', against the row passes' lanes). Rows 1, 4, 5 sum terms of one
    sign: on the scale of the largest result; row 3 (sum u) signed terms: on each row's sum |u|."""
    import row_passes
    a, b = random_operands(m, n, k, dtype)
    target = targets(m, n, int32=m == 300)
    partials = builds[dtype].row_stats(a, b, None, target, softcap, temperature, stat_rows, 0)
    assert partials.shape == (-(-n // TILE_COLUMNS), stat_rows, m)
    ours = row_passes.combine_tiles(partials)
    logits = gemm(builds, a, b)
    theirs = row_pass_stats(logits, target, softcap, temperature, stat_rows)
    assert ours.shape == theirs.shape == (stat_rows, m)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
    for row in (1, 3, 4, 5)[:stat_rows - 2]:
        scale = logit_sum_scale(logits, softcap, temperature) if row == 3 else theirs[row].abs().max().clamp_min(1.0)
        assert ((ours[row] - theirs[row]).abs() <= 2e-6 * scale * max(1, n / 4096)).all(), row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_row_stats_exact_logits_with_bias_and_masks(builds, dtype, bias):
    """Operands and bias on a grid of 1/4 (every logit exact in float32 and in the 2-byte dtype, whatever
    the order of the sums), masked classes (-inf bias, a masked target among them), N ragged: the
    statistics equal the row passes' over F.linear's logits."""
    import row_passes
    m, n, k = 260, 1037, 24
    a, b, bias_ = exact_operands(m, n, k, dtype, 7, bias)
    target = targets(m, n)
    if bias:
        bias_[100:300] = float("-inf")
        target[3] = 150  # a masked target: its u is -inf, as the row passes keep it
    logits = torch.nn.functional.linear(a, b, bias_)
    for stat_rows in (5, 6):
        ours = row_passes.combine_tiles(builds[dtype].row_stats(a, b, bias_, target, 0.0, 0.7, stat_rows, 0))
        theirs = row_pass_stats(logits, target, 0.0, 0.7, stat_rows)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
        # Sums in another order: float32's rounding, of the largest result's size for sums of one sign, of each
        # row's sum |u| for row 3's signed terms (u = z / 0.7 is rounded, and so are the partial sums).
        for row in (1, 4, 5)[:stat_rows - 3]:
            finite = theirs[row][theirs[row].isfinite()]
            scale = finite.abs().max().clamp_min(1.0) if finite.numel() else 1.0
            torch.testing.assert_close(ours[row], theirs[row], rtol=0, atol=4e-6 * scale, msg=f"row {row}")
        close = (ours[3] - theirs[3]).abs() <= 4e-6 * logit_sum_scale(logits, 0.0, 0.7)
        assert (close | (ours[3] == theirs[3])).all(), "row 3"  # == : the masked rows' -inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_stats_same_bits_every_run_and_grid(builds, dtype):
    """As gemm_nt's: grids of 66, 7 and 1 blocks; 5 tiles of M, so a block's consumers own tiles of both
    epilogue halves' rows masked and not."""
    import row_passes
    a, b = random_operands(513, 50257, 264, dtype)
    target = targets(513, 50257)
    first = builds[dtype].row_stats(a, b, None, target, 0.0, 0.7, 6, 0)
    for max_blocks in (0, 66, 7, 1):
        assert torch.equal(builds[dtype].row_stats(a, b, None, target, 0.0, 0.7, 6, max_blocks), first)
    assert row_passes.combine_tiles(first).isfinite().all()


def test_row_stats_refuses_bad_arguments(builds):
    ops = builds[torch.bfloat16]
    a, b = random_operands(64, 300, 64, torch.bfloat16)
    target = targets(64, 300)
    with pytest.raises(ValueError, match="stat_rows must be 5 or 6"):
        ops.row_stats(a, b, None, target, 0.0, 1.0, 4, 0)
    with pytest.raises(ValueError, match="target must be"):
        ops.row_stats(a, b, None, target[:10], 0.0, 1.0, 5, 0)
    with pytest.raises(ValueError, match="bias must be"):
        ops.row_stats(a, b, torch.zeros(299, device="cuda", dtype=torch.bfloat16), target, 0.0, 1.0, 5, 0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        ops.row_stats(a, b, None, target, 0.0, 0.0, 5, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,bias", [(None, False), (30.0, True)])
def test_linear_losses_through_the_fused_product(builds, dtype, softcap, bias, monkeypatch):
    """linear_log_probs and linear_cross_entropy without gradients take the fused product where
    linear_cross_entropy.fused_product says so, and give the cuBLAS chunks' values: operands on a grid of
    1/4, so both products' logits are exact and only the statistics' order of sums differs."""
    import linear_cross_entropy
    import losses
    m, n, k = 700, 50257, 24
    x, w, b = exact_operands(m, n, k, dtype, 9, bias)
    target = targets(m, n)
    assert linear_cross_entropy.fused_product(x, w, b)

    def outputs():
        with torch.no_grad():
            log_p, entropy = losses.linear_log_probs(x, w, target, linear_bias=b, temperature=0.7, softcap=softcap,
                                                     return_entropy=True)
            loss = losses.linear_cross_entropy(x, w, target, linear_bias=b, label_smoothing=0.1, softcap=softcap)
        return log_p, entropy, loss.float()

    fused = outputs()
    monkeypatch.setattr(linear_cross_entropy, "fused_product", lambda *arguments: False)
    for ours, theirs in zip(fused, outputs()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stat_rows", [5, 6])
def test_combine_row_stats_is_combine_tiles(builds, stat_rows):
    """The combine kernel against its torch twin on the partials of a real product, with masked tiles (every
    class -inf: max -inf, sums 0), a NaN row and a row of one tile: float32's rounding of the sums' order."""
    import row_passes
    a, b = random_operands(300, 50257, 264, torch.bfloat16)
    bias = torch.zeros(50257, device="cuda", dtype=torch.bfloat16)
    bias[:1024] = float("-inf")  # whole tiles masked
    a[7, 3] = float("nan")
    target = targets(300, 50257)
    partials = builds[torch.bfloat16].row_stats(a, b, bias, target, 0.0, 0.7, stat_rows, 0)
    ours = builds[torch.bfloat16].combine_row_stats(partials)
    theirs = row_passes.combine_tiles(partials)
    assert ours[1, 7].isnan() and theirs[1, 7].isnan()  # a NaN logit lives on in the sums, as the row passes'
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, equal_nan=True)
    one = builds[torch.bfloat16].combine_row_stats(partials[:1].contiguous())
    torch.testing.assert_close(one, row_passes.combine_tiles(partials[:1]), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("end", [5000, 4077])
def test_fused_statistics_of_a_vocabulary_shard(builds, end, monkeypatch):
    """fold_linear on a shard of the classes (start > 0: targets are global, those outside the shard match
    none of its columns, nor, with end 4077, the columns past its last class in its last tile) gives the
    cuBLAS chunks' statistics; operands on a grid of 1/4 (exact logits)."""
    import linear_cross_entropy
    x, w, _ = exact_operands(300, 5000, 24, torch.bfloat16, 13)
    target = targets(300, 5000)
    start = 1000
    shard = w[start:end]
    assert linear_cross_entropy.fused_product(x, shard, None)
    fused = linear_cross_entropy.fold_linear(x, shard, None, target, start, 0.0, 0.7, 6)
    monkeypatch.setattr(linear_cross_entropy, "fused_product", lambda *arguments: False)
    chunks = linear_cross_entropy.fold_linear(x, shard, None, target, start, 0.0, 0.7, 6)
    others = [0, 1, 2, 4, 5]  # row 3's signed sum on each row's sum |u| (logit_sum_scale)
    torch.testing.assert_close(fused[others], chunks[others], rtol=1e-5, atol=1e-5)
    assert ((fused[3] - chunks[3]).abs() <= 4e-6 * logit_sum_scale(x.float() @ shard.float().T, 0.0, 0.7)).all()
    outside = (target < start) | (target >= end)
    assert outside.any() and (fused[2][outside] == 0).all()  # a target outside the shard: no u of it here


def test_rows_that_overlap_take_the_cublas_chunks():
    import linear_cross_entropy
    h = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    assert not linear_cross_entropy.fused_product(h.expand(4, 64), w, None)
    assert linear_cross_entropy.fused_product(h.expand(4, 64).contiguous(), w, None)


# ---------------------------------------------------------------------------------
# The training form (row_stats_training: E = exp(u - each 64 classes' max) dz'/dz, 0 at the target) and
# grad_input (d input = g W from E, scaled a row and 64 classes at a time as the product reads it).

def training_form(ops, x, w, bias, target, softcap, temperature, stat_rows=5):
    """(E, piece_max, stats (stat_rows, m)) of x @ w.T (+ bias)."""
    m, n = x.shape[0], w.shape[0]
    e = torch.full((m, -(-n // 8) * 8), float("nan"), device="cuda", dtype=x.dtype)[:, :n]
    piece_max = torch.full((-(-n // 64), m), float("nan"), device="cuda")
    partials = ops.row_stats_training(x, w, bias, target, softcap, temperature, stat_rows, e, piece_max, 0)
    return e, piece_max, ops.combine_row_stats(partials)


def grad_input(ops, e, piece_max, w, stats, target, row_scale, out, first_class=0, carry=None, previous_stats=None,
               finish=True):
    ops.grad_input(e, piece_max, w, first_class, stats, target, row_scale, 0.0, 0.0, 1.0, out, carry, previous_stats,
                   finish, 0)


def float64_grad_input(logits, w, target, row_scale, softcap, temperature, z_loss):
    """d input in float64 from the (rounded) logits: row_passes.cu's gradient without smoothing, times w."""
    z = logits.double()
    u = (softcap * torch.tanh(z / softcap) if softcap else z) / temperature
    lse = torch.logsumexp(u, 1, keepdim=True)
    p = torch.exp(u - lse)
    onehot = torch.zeros_like(p)
    rows = (target >= 0).nonzero()[:, 0]
    onehot[rows, target[rows].long()] = 1
    slope = 1 - torch.tanh(z / softcap) ** 2 if softcap else 1.0
    g = row_scale.double()[:, None] * (p * (1 + 2 * z_loss * lse) - onehot) * slope / temperature
    return torch.where(row_scale.double()[:, None] == 0, 0.0, g) @ w.double()


def scaled_operands(m, n, k, dtype):
    """Operands whose logits spread as a language model's do (a few units), not as sqrt(k)."""
    a, b = random_operands(m, n, k, dtype)
    return (a.float() * (3 / k ** 0.5)).to(dtype), b


@pytest.mark.parametrize("m,n,k", [(300, 1000, 256), (129, 50257, 264), (1024, 32000, 512), (513, 4077, 2304)])
@pytest.mark.parametrize("softcap,temperature,z_loss,bias,stat_rows", [
    (0.0, 1.0, 0.0, False, 5), (30.0, 0.7, 1e-4, True, 5), (0.0, 0.7, 0.0, True, 6), (30.0, 1.0, 0.0, False, 6)])
def test_grad_input_from_the_training_form(builds, m, n, k, softcap, temperature, z_loss, bias, stat_rows):
    """The statistics are row_stats' (5 rows, or 6 with the entropy's); d input's error against float64 (of the same
    rounded logits) within 1.5x of the row passes' (the gradient rounded to bfloat16, then torch.mm); masked classes
    (-inf bias, whole pieces of 64 among them) add nothing; ignored rows get exact zeros. The shapes cover one K part and several
    (the tiles filling less than a wave: 16 parts for 129 x 264, 8 for 1024 x 512), ragged M, N and K."""
    import row_passes
    ops = builds[torch.bfloat16]
    x, w = scaled_operands(m, n, k, torch.bfloat16)
    bias_ = None
    if bias:
        bias_ = torch.randn(n, device="cuda").bfloat16()
        bias_[64:200] = float("-inf")
    target = targets(m, n, int32=m == 129)
    if bias:
        target[(target >= 64) & (target < 200)] = 3  # no masked target
    row_scale = torch.where(target == -100, 0.0, torch.rand(m, device="cuda") + 0.5)
    e, piece_max, stats = training_form(ops, x, w, bias_, target, softcap, temperature, stat_rows)
    plain = row_passes.combine_tiles(ops.row_stats(x, w, bias_, target, softcap, temperature, stat_rows, 0))
    logits = torch.nn.functional.linear(x, w, bias_)
    others = [0, 1, 2, 4, 5][:stat_rows - 1]  # row 3's signed sum on each row's sum |u| (logit_sum_scale)
    torch.testing.assert_close(stats[others], plain[others], rtol=2e-6, atol=2e-6 * max(1, n / 4096))
    close = (stats[3] - plain[3]).abs() <= 4e-6 * logit_sum_scale(logits, softcap, temperature)
    assert (close | (stats[3] == plain[3])).all(), "row 3"
    out = poisoned(m, k, torch.bfloat16)
    stats = stats[:5]  # grad_input's
    ops.grad_input(e, piece_max, w, 0, stats, target, row_scale, z_loss, softcap, temperature, out, None, None, True, 0)
    assert not out.isnan().any(), "an output element was never written"
    assert (out[target == -100] == 0).all()
    truth = float64_grad_input(logits, w, target, row_scale, softcap, temperature, z_loss)
    g = logits.clone()
    row_passes.write_gradient(g, g, target, 0, n, row_passes.softmax_stats_of(stats), row_scale, 0.0, z_loss, softcap,
                              temperature)
    theirs = g @ w
    our_error = (out.double() - truth).norm().item()
    their_error = (theirs.double() - truth).norm().item()
    assert our_error <= 1.5 * their_error + 1e-6 * truth.norm().item(), (our_error, their_error)
    for max_blocks in (7, 1):  # the same bits whatever the grid
        again = poisoned(m, k, torch.bfloat16)
        ops.grad_input(e, piece_max, w, 0, stats, target, row_scale, z_loss, softcap, temperature, again, None, None,
                       True, max_blocks)
        assert torch.equal(again, out), max_blocks


def test_the_target_gradient_of_confident_rows(builds):
    """Rows whose target's p is 1 - 1e-6 and beyond: the target's term comes from -others / sum, not p - 1 (which
    cancels), so d input matches float64 row by row."""
    ops = builds[torch.bfloat16]
    m, n, k = 64, 3000, 64
    x, w = scaled_operands(m, n, k, torch.bfloat16)
    target = torch.randint(0, n, (m,), device="cuda")
    target[::2] = 1234
    bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    bias[1234] = 24.0  # p_t ~ 1 - n e^-24 on the even rows; the odd rows' p_t ~ e^-24
    e, piece_max, stats = training_form(ops, x, w, bias, target, 0.0, 1.0)
    row_scale = torch.ones(m, device="cuda")
    out = poisoned(m, k, torch.bfloat16)
    ops.grad_input(e, piece_max, w, 0, stats, target, row_scale, 0.0, 0.0, 1.0, out, None, None, True, 0)
    truth = float64_grad_input(torch.nn.functional.linear(x, w, bias), w, target, row_scale, 0.0, 1.0, 0.0)
    error = (out.double() - truth).norm(dim=1)
    assert (error <= 2 ** -7 * truth.norm(dim=1) + 1e-30).all(), (error / truth.norm(dim=1)).max()


@pytest.mark.parametrize("m,n,k,parts", [(300, 1000, 256, 3), (129, 50257, 264, 2), (1024, 20000, 512, 4)])
@pytest.mark.parametrize("case", ["plain", "first part masked", "max in the last part", "entropy"])
def test_grad_input_in_vocabulary_parts(builds, m, n, k, parts, case):
    """A chunk's vocabulary in parts (linear_cross_entropy._gradient_form_chunk: E a part at a time, d input's float32
    sum carried from part to part and moved onto each part's row exponent): the statistics of the whole vocabulary,
    and d input within the whole call's error bound against float64 (1.5x the row passes'); a first part of masked
    classes alone (its exponent -inf), or every row's max in the last part (the carried sum moved by 2^-11 and
    more), change nothing; the entropy's sum (stat_rows 6) combines as row_stats' does; the same bits every run."""
    import linear_cross_entropy
    import row_passes
    ops = builds[torch.bfloat16]
    x, w = scaled_operands(m, n, k, torch.bfloat16)
    bounds = linear_cross_entropy.form_parts(n, parts)
    assert len(bounds) == parts
    bias = None
    target = targets(m, n, int32=m == 129)
    if case == "first part masked":
        bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        bias[:bounds[0][1]] = float("-inf")
        target[(target >= 0) & (target < bounds[0][1])] = n - 1
    elif case == "max in the last part":
        bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        bias[n - 3] = 8.0
    row_scale = torch.where(target == -100, 0.0, torch.rand(m, device="cuda") + 0.5)
    z_loss, softcap, temperature = 1e-4, 0.0, 1.0
    stat_rows = 6 if case == "entropy" else 5
    outs = []
    for _ in range(2):
        out = poisoned(m, k, torch.bfloat16)
        stats = linear_cross_entropy._gradient_form_chunk(x, w, bias, target, row_scale, z_loss, softcap, temperature,
                                                          out, parts, stat_rows)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    plain = row_passes.combine_tiles(ops.row_stats(x, w, bias, target, softcap, temperature, stat_rows, 0))
    rows = [0, 1, 2, 4, 5][:stat_rows - 1]
    torch.testing.assert_close(stats[rows], plain[rows], rtol=2e-6, atol=2e-6 * max(1, n / 4096))
    logits = torch.nn.functional.linear(x, w, bias)
    truth = float64_grad_input(logits, w, target, row_scale, softcap, temperature, z_loss)
    g = logits.clone()
    row_passes.write_gradient(g, g, target, 0, n, row_passes.softmax_stats_of(plain), row_scale, 0.0, z_loss, softcap,
                              temperature)
    their_error = ((g @ w).double() - truth).norm().item()
    our_error = (outs[0].double() - truth).norm().item()
    assert our_error <= 1.5 * their_error + 1e-6 * truth.norm().item(), (our_error, their_error)
    assert (outs[0][target == -100] == 0).all()


def test_grad_input_refuses_bad_arguments(builds):
    ops = builds[torch.bfloat16]
    x, w = scaled_operands(64, 300, 64, torch.bfloat16)
    target = targets(64, 300)
    e, piece_max, stats = training_form(ops, x, w, None, target, 0.0, 1.0)
    row_scale = torch.ones(64, device="cuda")
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="piece_max"):
        grad_input(ops, e, piece_max, w, stats[:3].contiguous(), target, row_scale, out)
    with pytest.raises(ValueError, match="piece_max"):
        grad_input(ops, e, piece_max[1:], w, stats, target, row_scale, out)
    with pytest.raises(ValueError, match="must be bfloat16"):
        grad_input(ops, e, piece_max, w.half(), stats, target, row_scale, out)
    with pytest.raises(ValueError, match="out must be"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale, out[:, :32])
    with pytest.raises(ValueError, match="row_scale"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale[:5], out)
    with pytest.raises(ValueError, match="rows of w"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale, out, first_class=1)
    with pytest.raises(ValueError, match="needs carry"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale, out, previous_stats=stats)
    with pytest.raises(ValueError, match="needs carry"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale, out, finish=False)
    with pytest.raises(ValueError, match="carry must be"):
        grad_input(ops, e, piece_max, w, stats, target, row_scale, out, carry=torch.empty(64, 64, device="cuda").t())
    with pytest.raises(ValueError, match="e must be"):
        ops.row_stats_training(x, w, None, target, 0.0, 1.0, 5, e[:, :299], piece_max, 0)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.row_stats_training(x.half(), w.half(), None, target, 0.0, 1.0, 5, e, piece_max, 0)


@pytest.mark.parametrize("softcap,z_loss,reduction,trains", [(None, 0.0, "mean", False), (30.0, 1e-4, "sum", False),
                                                             (None, 0.0, "none", False), (None, 0.0, "mean", True),
                                                             (None, 1e-4, "none", True)])
@pytest.mark.parametrize("in_parts", [False, True])
def test_d_input_through_the_training_form(builds, softcap, z_loss, reduction, trains, in_parts, monkeypatch):
    """linear_cross_entropy's forward that makes d input alone (a frozen head; a trained 2-byte head, whose d weight
    the backward makes from the logits again) takes the training form where gradient_form says so, and gives the
    cuBLAS chunks' loss and, row by row, their d input to bfloat16's rounding of the gradient (operands on a grid of
    1/4: both products' logits are exact); a trained head's d weight, from each path's statistics, the same. In
    parts: a smaller budget (ROW_CHUNK_BYTES) cuts the vocabulary into parts."""
    import linear_cross_entropy
    import losses
    m, n, k = 700, 50257, 24
    x, w, _ = exact_operands(m, n, k, torch.bfloat16, 17)  # exact logits: the paths' losses differ by sums' order
    x.requires_grad_()
    w.requires_grad_(trains)
    target = targets(m, n)
    weights = torch.rand(m, device="cuda") + 0.5
    assert linear_cross_entropy.gradient_form(x, w, None, (True, False, False), 0.0)
    assert linear_cross_entropy.gradient_form(x, w, None, (True, False, False), 0.0, 6)  # the entropy's sum too
    # Not where the forward sums d weight (a float32 one), nor with smoothing, nor for float16.
    assert not linear_cross_entropy.gradient_form(x, w, None, (True, True, False), 0.0)
    assert not linear_cross_entropy.gradient_form(x, w, None, (True, False, False), 0.1)
    assert not linear_cross_entropy.gradient_form(x.half(), w.half(), None, (True, False, False), 0.0)
    if in_parts:
        monkeypatch.setattr(linear_cross_entropy, "ROW_CHUNK_BYTES", 1 << 24)
    form_chunks = []
    chunk = linear_cross_entropy._gradient_form_chunk
    monkeypatch.setattr(linear_cross_entropy, "_gradient_form_chunk",
                        lambda *arguments: form_chunks.append(arguments[9]) or chunk(*arguments))  # parts

    def run():
        x.grad = w.grad = None
        loss = losses.linear_cross_entropy(x, w, target, reduction=reduction, z_loss=z_loss, softcap=softcap)
        (loss * weights).sum().backward() if reduction == "none" else loss.backward()
        return loss.detach().float(), x.grad.float(), None if w.grad is None else w.grad.float()

    fused = run()
    assert form_chunks and (max(form_chunks) > 1) == in_parts, form_chunks
    monkeypatch.setattr(linear_cross_entropy, "gradient_form", lambda *arguments: False)
    chunks = run()
    torch.testing.assert_close(fused[0], chunks[0], rtol=1e-5, atol=1e-5)
    difference = (fused[1] - chunks[1]).norm(dim=1)
    assert (difference <= 2 ** -6 * chunks[1].norm(dim=1)).all()
    assert (fused[1][target == -100] == 0).all()
    if trains:
        assert (fused[2] - chunks[2]).norm() <= 2 ** -8 * chunks[2].norm()
