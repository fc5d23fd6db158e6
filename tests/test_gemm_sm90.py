"""linear_ce_gemm's gemm_nt (kernels/gemm_sm90.cuh, stage 1 of scratch/gemm_plan.md): a @ b.T on
sm_90a, against float64 of the same 2-byte inputs, and the same bits on every run and grid.

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

# (m, n, k), each hitting a regime of the 128 x 256 x 64 tiles and the persistent grid.
SHAPES = [
    (4096, 4096, 4096),      # square, 512 tiles: ~4 waves of 132 blocks
    (1024, 128256, 4096),    # Llama 3's head over 1024 rows: 8 x 501 tiles, group of 8 M tiles
    (1, 1000, 512),          # one row: A's 128-row box all but one row out of bounds (zeros)
    (127, 256, 64),          # one partial M tile, exactly one N tile and one K block
    (129, 257, 72),          # one row and one column past a tile, a partial K block
    (128, 256, 64),          # exactly one tile
    (300, 2000, 256),        # 3 x 8 = 24 tiles: fewer than the multiprocessors
    (256, 255, 4104),        # N one short of a tile; K one 8-element step past 64 blocks
    (200, 50257, 8),         # GPT-2's vocabulary (ragged, rows not 16 B-aligned: 2 B stores); K = 8
    (513, 1024, 4104),       # ragged M over several tiles, K ragged
]


@pytest.fixture(scope="module")
def builds():
    return {dtype: loader.load("linear_ce_gemm", dtype, arch="9.0a") for dtype in DTYPES}


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
@pytest.mark.parametrize("m,n,k", [(4096, 4096, 4096), (513, 50257, 264), (1024, 128256, 1024)])
def test_same_bits_every_run_and_grid(builds, m, n, k, dtype):
    """Three runs, then grids of 66 and 7 blocks: each tile's K order is fixed and one block
    owns it, so which block runs it, or when, changes no bit."""
    a, b = random_operands(m, n, k, dtype)
    first = gemm(builds, a, b)
    for max_blocks in (0, 0, 66, 7):
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
