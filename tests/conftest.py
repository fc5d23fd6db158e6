"""Shared test setup: plain-folder imports, GPU skips, strict fused mode, a printed seed."""
import os
import random
import sys
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
    torch.manual_seed(SEED + hash(request.node.nodeid) % 1000003)
