"""Shared test setup: plain-folder imports, GPU skips, strict fused mode, a printed seed."""
import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the plain-folder way in: import losses, import loader

SEED = int(os.environ.get("FUSED_LOSSES_SEED") or random.SystemRandom().randrange(2**31))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "build: compiles kernels through the loader (needs nvcc, no GPU)")


def pytest_report_header(config):
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (GPU tests skip)"
    return [f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: {gpu}",
            f"random seed: {SEED} (rerun with FUSED_LOSSES_SEED={SEED})"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def strict_and_seeded(monkeypatch, request):
    """Every test: a torch fallback on a CUDA tensor raises (so a GPU test passing means
    the fused kernel ran), and fresh random inputs from a seed the header prints."""
    monkeypatch.setenv("FUSED_LOSSES_STRICT", "1")
    # crc32, not hash(): str hashes change with every interpreter, and the printed seed
    # must give the same inputs when a failure is rerun.
    torch.manual_seed(SEED + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def small_chunks(monkeypatch):
    """linear_cross_entropy in chunks of 16 classes: 50 classes span four chunks, the last one 2 wide (the
    kernels' unvectorized path); 3 rows a row chunk: 10 rows span four, the last one row."""
    import linear_cross_entropy

    monkeypatch.setattr(linear_cross_entropy, "chunk_width", lambda rows, vocab, element_size: 16)
    monkeypatch.setattr(linear_cross_entropy, "row_chunk_rows", lambda vocab, element_size, summing=False: 3)


@pytest.fixture
def kernels_modelled_on_cpu(monkeypatch):
    """CPU tensors take the fused path, with the kernel ops replaced by the Python models
    in kernel_models.py, reached through the same loader call a CUDA tensor takes (and on
    torch 2.4+ through the stable ops that torch.compile traces)."""
    import types

    import cross_entropy
    import kernel_models
    import loader
    import loss_helpers
    import op_signatures
    import pointwise_loss

    builds = {kernel: types.SimpleNamespace(forward=forward, backward=backward, recompute_gradients_=recompute,
                                            scale_by_grad_output_=kernel_models.scale_by_grad_output_,
                                            attach_saved_gradients=kernel_models.attach_saved_gradients)
              for kernel, (forward, backward, recompute) in kernel_models.MODELS.items()}
    monkeypatch.setattr(loader, "load_for_device", lambda kernel, device, dtype: builds[kernel])
    # Everything the kernels would take, which leaves out empty tensors (torch runs those).
    monkeypatch.setattr(pointwise_loss, "fusable",
                        lambda input, target: "empty tensors" if input.numel() * target.numel() == 0 else None)
    monkeypatch.setattr(cross_entropy, "_fusable",
                        lambda input, *args: "empty tensors" if input.numel() == 0 else None)
    libraries = []
    for kernel, ops in (op_signatures.KERNEL_OPS.items() if loss_helpers.COMPILE_OPS else ()):
        if kernel not in kernel_models.MODELS:
            continue
        library = torch.library.Library(f"fused_losses_{kernel}", "IMPL")
        for op in ops:
            library.impl(op, loss_helpers.call_build(kernel, op), "CPU")
        libraries.append(library)
    yield
    for library in libraries:
        library._destroy()
    if loss_helpers.COMPILE_OPS:
        torch._dynamo.reset()
