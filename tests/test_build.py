"""Every kernel builds through the loader for each arch, with no GPU needed (CI).

Archs come from FUSED_LOSSES_BUILD_ARCHS (.ci/run: "8.0 9.0"), else the local GPU's
(tests/build_archs.py). With neither, or without a CUDA toolkit, these tests skip, unless
FUSED_LOSSES_REQUIRE_BUILD=1 (set by .ci/run), which turns either into a failure.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import loader
import losses
import op_signatures
from build_archs import ARCHS, NO_ARCH

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = os.environ.get("FUSED_LOSSES_REQUIRE_BUILD") == "1"


def _toolchain_problem():
    try:
        loader.check_toolchain()
    except loader.BuildError as error:
        return str(error)
    return None


PROBLEM = _toolchain_problem()
pytestmark = [
    pytest.mark.build,
    pytest.mark.skipif(not ARCHS and not REQUIRED, reason=NO_ARCH),
    pytest.mark.skipif(PROBLEM is not None and not REQUIRED, reason=f"no toolchain to build with: {PROBLEM}"),
]


def build_arch() -> str:
    """The arch a test builds for; where it cannot build (which only FUSED_LOSSES_REQUIRE_BUILD=1
    lets a test reach), it fails with the reason."""
    assert PROBLEM is None, PROBLEM
    assert ARCHS, NO_ARCH
    return ARCHS[0]


def build_cli(*args, env=None, **kwargs):
    return subprocess.run([sys.executable, str(ROOT / "loader.py"), *args], env=env, capture_output=True,
                          text=True, **kwargs)


def type_kind(annotation: str) -> str:
    """Tensor, Tensor?, bool, float or int, from any spelling: a schema's (Tensor?, or
    Optional[Tensor] in newer torch), pybind11 2.x's (int, Optional[torch.Tensor]) or
    3.x's (typing.SupportsInt | typing.SupportsIndex, torch.Tensor | None)."""
    if "Tensor" in annotation:
        return "Tensor?" if "?" in annotation or "Optional" in annotation or "None" in annotation else "Tensor"
    for name in ("bool", "float", "int"):  # float before int: 3.x's floats also take SupportsIndex
        if name in annotation.lower():
            return name
    raise AssertionError(f"unexpected type in a signature: {annotation}")


def schema_signature(schema):
    """A schema's (name, type) arguments and return types in order."""
    return ([(a.name, type_kind(str(a.type))) for a in schema.arguments],
            [type_kind(str(r.type)) for r in schema.returns])


def binding_signature(function):
    """A bound function's (name, type) arguments and return types in order, from pybind11's
    signature line: `forward(logits: torch.Tensor, ...) -> tuple[torch.Tensor, torch.Tensor]`."""
    match = re.match(r"\w+\((.*)\) -> (.*)", function.__doc__.strip().splitlines()[0])
    assert match, function.__doc__
    parts = re.split(r",?\s*(\w+): ", match.group(1))[1:]
    returns = match.group(2)
    return [(name, type_kind(kind)) for name, kind in zip(parts[::2], parts[1::2])], ["Tensor"] * returns.count("Tensor")


def declared_signature(kernel, op):
    return schema_signature(torch._C.parse_schema(op + op_signatures.KERNEL_OPS[kernel][op]))


@pytest.mark.parametrize("arch", ARCHS or [None])
@pytest.mark.parametrize("name", loader.KERNELS)
def test_kernel_builds_and_binds_its_ops(name, arch):
    """...with the names and types op_signatures.py declares (the build's C++ signatures are
    written from them: a mismatch would not compile; this checks the binding's side)."""
    build_arch()
    ops = loader.load(name, arch=arch)
    for op in op_signatures.KERNEL_OPS[name]:
        assert binding_signature(getattr(ops, op)) == declared_signature(name, op), op


@pytest.mark.skipif("9.0" not in ARCHS, reason="sm_90 not among the archs built for")
@pytest.mark.skipif(not loader.BUILDS_SM90A, reason="sm_90a code takes CUDA 12 or later")
@pytest.mark.parametrize("name", loader.SM90A_KERNELS)
def test_sm90a_kernel_builds_and_binds_its_ops(name):
    """The sm_90a product's build ("9.0a", where sm_90 is asked for; bfloat16, one of its two dtypes), as above."""
    ops = loader.load(name, "bfloat16", arch="9.0a")
    for op in op_signatures.KERNEL_OPS[name]:
        assert binding_signature(getattr(ops, op)) == declared_signature(name, op), op


def test_cross_entropy_path_query_takes_the_forwards_arguments():
    """The test-only path query is bound with the forward's declared arguments, and the path
    switch names what it refuses."""
    ops = loader.load("cross_entropy", arch=build_arch())
    assert binding_signature(ops.cross_entropy_path)[0] == declared_signature("cross_entropy", "forward")[0]
    with pytest.raises(ValueError, match="no path named 'fastest' \\(paths: register_rows, "):
        ops.force_cross_entropy_path("fastest")
    ops.force_cross_entropy_path("")


def test_a_builds_checks_raise_python_errors():
    """A check in C++ reaches Python as an exception with its message (no GPU needed: the
    check comes before any CUDA call), and the process goes on."""
    ops = loader.load("mse", arch=build_arch())
    with pytest.raises(RuntimeError, match="grad must be a contiguous CUDA tensor"):
        ops.scale_by_grad_output_(torch.zeros(3), torch.ones(()))
    with pytest.raises(TypeError):  # pybind11's own check of the argument types
        ops.scale_by_grad_output_(torch.zeros(3))


def test_a_builds_autograd_node_wires_the_graph():
    """kernels/autograd_node.h, on CPU tensors (its checks come before any CUDA call): the
    loss gets the node as its grad_fn, whose next edges are input's and target's."""
    ops = loader.load("mse", arch=build_arch())
    leaf = torch.randn(3, requires_grad=True)
    input, target = leaf * 2, torch.randn(3)
    loss = ops.attach_saved_gradients(torch.zeros(()), input, torch.ones(3), target, None, input, target, None, None)
    assert loss.requires_grad and loss.grad_fn.name() == "FusedLossBackward"
    assert [edge[0] for edge in loss.grad_fn.next_functions] == [input.grad_fn, None]
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="loss must be a 0-dim tensor without a grad_fn"):
        ops.attach_saved_gradients(loss, input, None, target, None, input, target, None, None)


def test_a_builds_autograd_node_differentiates_again_through_its_callback():
    """create_graph=True: the node calls function(options, user_input, user_target,
    grad_output) (here torch's MSE formula) on the operands it holds weakly; a freed operand
    raises."""
    ops = loader.load("mse", arch=build_arch())
    leaf, target = torch.randn(3, requires_grad=True), torch.randn(3)

    def gradient_graph(options, input, target, grad_output):
        (grad,) = torch.autograd.grad(((input - target) ** 2).sum(), input, grad_output, create_graph=True)
        return grad, None

    differentiable = (gradient_graph, ())

    input = leaf * 2
    loss = ops.attach_saved_gradients(torch.zeros(()), input, torch.ones(3), target, None, input, target,
                                      differentiable, None)
    (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
    torch.testing.assert_close(grad, 4 * (leaf * 2 - target))  # d/dleaf of sum((2 leaf - t)^2)
    (second,) = torch.autograd.grad(grad.sum(), leaf)
    torch.testing.assert_close(second, torch.full((3,), 8.0))
    loss = ops.attach_saved_gradients(torch.zeros(()), leaf * 2, torch.ones(3), target, None, leaf * 2, target,
                                      differentiable, None)  # its input, leaf * 2, is freed at once
    with pytest.raises(RuntimeError, match="input, which is no longer alive"):
        torch.autograd.grad(loss, leaf, create_graph=True)


class _NoGradientForFirst(torch.autograd.Function):
    """a + b, whose backward gives a no gradient (None)."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def test_a_builds_autograd_node_passes_on_no_gradient():
    """A node after the loss may give it no gradient: the input then gets none (as from
    torch's own nodes), and the node never reaches the GPU-only scale."""
    ops = loader.load("mse", arch=build_arch())
    leaf, other = torch.randn(3, requires_grad=True), torch.randn((), requires_grad=True)
    input, target = leaf * 2, torch.randn(3)
    loss = ops.attach_saved_gradients(torch.zeros(()), input, torch.ones(3), target, None, input, target, None, None)
    _NoGradientForFirst.apply(loss, other).backward()
    assert leaf.grad is None and other.grad is not None


def test_cached_load_is_silent_and_fast():
    """A second process finds the build: no build line, no compiler."""
    arch = build_arch()
    loader.load("mse", arch=arch)  # built (or found) by now
    started = time.perf_counter()
    result = build_cli("--arch", arch, "--kernel", "mse", "--dtype", "float32", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "building mse" not in result.stderr and "built mse" not in result.stderr
    assert time.perf_counter() - started < 30  # interpreter + torch import; a build takes far longer


@pytest.fixture
def forget_loaded_builds():
    """Builds memoized by earlier tests must not answer this one's loads (and this
    test's temporary builds must not answer later tests')."""
    loader.reload()
    yield
    loader.reload()


def test_edited_kernel_gets_a_new_build_after_reload(monkeypatch, tmp_path, forget_loaded_builds):
    arch = build_arch()
    kernels = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", kernels)
    monkeypatch.setattr(loader, "KERNEL_DIR", kernels)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    first = loader.load("mse", arch=arch)
    assert loader.load("mse", arch=arch) is first  # memoized
    with open(kernels / "mse.cu", "a") as f:
        f.write("\n// an edit in a notebook\n")
    assert loader.load("mse", arch=arch) is first  # not re-read until reload
    loader.reload("mse")
    second = loader.load("mse", arch=arch)
    assert second.__name__ != first.__name__
    assert (tmp_path / "cache" / "fused_losses" / second.__name__ / loader.BUILD_OK).is_file()


def test_same_build_in_another_cache_dir_is_not_loaded_twice(monkeypatch, tmp_path, forget_loaded_builds):
    """The same build (its name hashes everything in it) found in another cache directory:
    the loader reuses the module it already imported."""
    arch = build_arch()
    first = loader.load("mse", arch=arch)
    loader.reload()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
    assert loader.load("mse", arch=arch) is first


def test_build_killed_half_way_does_not_block_the_next(tmp_path):
    """SIGKILL a build mid-compile (it may leave torch's lock file and half a build dir);
    the next load must build and succeed, not wait forever."""
    arch = build_arch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    victim = subprocess.Popen([sys.executable, str(ROOT / "loader.py"), "--arch", arch, "--kernel", "mse", "--dtype", "float32"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    build_dirs = tmp_path / "fused_losses"
    deadline = time.time() + 120
    while not list(build_dirs.glob("*/build.ninja")):  # compiling has started
        assert victim.poll() is None and time.time() < deadline, "the build never started"
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(victim.pid, signal.SIGKILL)  # the compiler processes too
    victim.wait()
    for build_dir in build_dirs.iterdir():  # what torch < 2.1 leaves behind after a kill
        if build_dir.is_dir():
            (build_dir / "lock").touch()
    result = build_cli("--arch", arch, "--kernel", "mse", "--dtype", "float32", env=env, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "built mse (float32)" in result.stderr


def test_concurrent_first_use_builds_once(tmp_path):
    """8 processes load one kernel at once on an empty cache: one builds, the others wait on
    its lock and load that build; all succeed."""
    arch = build_arch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    processes = [subprocess.Popen([sys.executable, str(ROOT / "loader.py"), "--arch", arch, "--kernel", "mse", "--dtype", "float32"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(8)]
    outputs = [process.communicate(timeout=900) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    for line in ("building mse (float32)", "built mse (float32)"):  # the build's start and end, once each
        assert sum(stderr.count(line) for _, stderr in outputs) == 1, line
    assert len([p for p in (tmp_path / "fused_losses").iterdir() if p.is_dir()]) == 1
