"""The GPU archs that the tests which compile kernels build for.

FUSED_LOSSES_BUILD_ARCHS (e.g. "8.0 9.0"; .ci/run sets it) names them, GPU or not. Unset,
they are the local GPU's arch, or, with no GPU, none: those tests then skip with NO_ARCH,
since building every kernel for other archs takes minutes (6-19 on 2 cores), too long for
a newcomer's first `python3 -m pytest`.
"""
import os

import torch

import loader

ASKED = os.environ.get("FUSED_LOSSES_BUILD_ARCHS", "").split()
ARCHS = ASKED or ([loader.device_arch()] if torch.cuda.is_available() else [])
NO_ARCH = ("no GPU here and no arch asked for: builds for other GPUs take minutes; "
           'set FUSED_LOSSES_BUILD_ARCHS="8.0 9.0" to build every kernel for sm_80 and sm_90')
