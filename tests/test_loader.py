"""loader.py without compiling anything: cache keys, names, locks and error messages (CPU, CI)."""
import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

import loader


@pytest.fixture
def fresh_toolchain_check(monkeypatch):
    """Each test sees the toolchain unchecked and restores torch's CUDA_HOME after."""
    monkeypatch.setattr(loader, "_toolkit_checked", False)
    cpp_extension = loader._cpp_extension()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)


def fake_toolkit(root: Path, release: str, with_cudart: bool = True) -> Path:
    """A directory that looks like a CUDA toolkit whose nvcc reports `release`."""
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(0o755)
    if with_cudart:
        (root / "lib64").mkdir()
        (root / "lib64" / "libcudart.so").write_text("")
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("")
    return root


# ----------------------------------------------------------------------------------
# What a build is.

SHARED_HEADERS = {"device.cuh", "launch.cuh", "finish.cuh", "ops.h", "autograd_node.h"}
KERNEL_HEADERS = {
    "mse": {"pointwise.cuh"},
    "kl_div": {"pointwise.cuh"},
    "cross_entropy": {"sm90.cuh", "cross_entropy_row.cuh", "cross_entropy_rows.cuh", "cross_entropy_pipelined.cuh",
                      "cross_entropy_claimed.cuh", "cross_entropy_launch.cuh"},
}


def test_sources_include_the_shared_headers_and_the_bindings():
    for name in loader.KERNELS:
        sources = loader.kernel_sources(name)
        assert set(sources) == {f"{name}.cu", "main.cpp"} | SHARED_HEADERS | KERNEL_HEADERS[name]
        assert f"fused_losses::{name}_forward" in sources["main.cpp"]


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="no kernel named 'hinge'"):
        loader.kernel_sources("hinge")


@pytest.mark.parametrize("given,expected", [("8.0", "8.0"), ("80", "8.0"), ("sm_90", "9.0"), ("9.0a", "9.0a"),
                                            ("sm90a", "9.0a"), ("10.0", "10.0"), ("12.0", "12.0")])
def test_arch_names(given, expected):
    assert loader.normalize_arch(given) == expected


@pytest.mark.parametrize("bad", ["", "ampere", "8", "8.0.1"])
def test_bad_arch_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="arch must look like"):
        loader.normalize_arch(bad)


def test_gencode_targets_exactly_the_arch():
    assert loader.gencode_flag("8.0") == "-gencode=arch=compute_80,code=sm_80"
    assert loader.gencode_flag("9.0a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_cache_key_changes_with_everything_that_shapes_the_binary(monkeypatch):
    sources = loader.kernel_sources("mse")
    base = loader.cache_key(sources, "9.0")
    assert loader.cache_key(dict(sources), "9.0") == base  # stable
    edited_kernel = dict(sources, **{"mse.cu": sources["mse.cu"] + "\n// edited"})
    edited_header = dict(sources, **{"device.cuh": sources["device.cuh"] + "\n// edited"})
    assert loader.cache_key(edited_kernel, "9.0") != base
    assert loader.cache_key(edited_header, "9.0") != base
    assert loader.cache_key(dict(sources, **{"main.cpp": sources["main.cpp"] + "\n// edited"}), "9.0") != base
    assert loader.cache_key(sources, "8.0") != base
    assert loader.cache_key(sources, "9.0", cuda_cflags=["-O2"]) != base
    assert loader.cache_key(sources, "9.0", cflags=["-O0"]) != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert loader.cache_key(sources, "9.0") != base


def test_extension_name_carries_kernel_arch_and_key():
    name = loader.extension_name("cross_entropy", "9.0", "0123abcd")
    assert name == "fused_losses_cross_entropy_sm90_0123abcd" and name.isidentifier()


def test_cache_root_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert loader.cache_root() == tmp_path / "fused_losses"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_root() == tmp_path / "xdg" / "torch_extensions" / "fused_losses"


# ----------------------------------------------------------------------------------
# Errors that name their fix.

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_no_gpu_and_no_arch_says_to_pass_an_arch():
    with pytest.raises(loader.BuildError, match=r"no CUDA device is visible.*--arch 8.0 9.0"):
        loader.load("mse")


def test_cpu_only_torch(monkeypatch, fresh_toolchain_check):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(loader.BuildError, match="CPU-only build"):
        loader.check_toolchain()


def test_no_ninja(monkeypatch, fresh_toolchain_check):
    real_which = loader.shutil.which
    monkeypatch.setattr(loader.shutil, "which", lambda cmd: None if cmd == "ninja" else real_which(cmd))
    monkeypatch.setitem(sys.modules, "ninja", None)  # import ninja -> ImportError
    with pytest.raises(loader.BuildError, match="pip install ninja"):
        loader.check_toolchain()


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_nvcc_of_another_major_version(monkeypatch, tmp_path, fresh_toolchain_check):
    other_major = "11.8" if not torch.version.cuda.startswith("11") else "12.4"
    monkeypatch.setenv("CUDA_HOME", str(fake_toolkit(tmp_path / "cuda", other_major)))
    with pytest.raises(loader.BuildError, match=rf"nvcc {other_major}.*CUDA {torch.version.cuda}"):
        loader.check_toolchain()


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_cuda_home_without_a_toolkit(monkeypatch, tmp_path, fresh_toolchain_check):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(loader.BuildError, match=r"CUDA_HOME=.*nowhere is not a usable"):
        loader.check_toolchain()


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_a_wrong_guess_by_torch_is_passed_over(monkeypatch, tmp_path, fresh_toolchain_check):
    """torch guesses CUDA_HOME from the nvcc on PATH; a wrapper in /usr/local/bin makes that
    /usr/local, which has nvcc but no libcudart. The loader must not pick such a directory."""
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    wrong = fake_toolkit(tmp_path / "usr_local", torch.version.cuda, with_cudart=False)
    monkeypatch.setattr(loader._cpp_extension(), "CUDA_HOME", str(wrong))
    try:
        chosen = loader.find_cuda_home()
    except loader.BuildError as error:  # no real toolkit on this machine: the message lists the wrong one
        assert str(wrong) in str(error)
    else:
        assert chosen != wrong


def test_compile_errors_show_the_compiler_message(monkeypatch, tmp_path):
    """A kernel that does not compile: BuildError with the compiler's own words."""
    if torch.version.cuda is None:
        pytest.skip("needs a CUDA build of torch")
    try:
        loader.check_toolchain()
    except loader.BuildError as error:
        pytest.skip(f"no CUDA toolkit here: {error}")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "broken.cu").write_text("this is not C++;\n")
    monkeypatch.setattr(loader, "KERNEL_DIR", kernels)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    with pytest.raises(loader.BuildError, match=r"(?s)building kernel 'broken' for sm_80.*error"):
        loader.load("broken", arch="8.0")


# ----------------------------------------------------------------------------------
# Locks: a killed build must never block the next one.

def test_build_lock_dies_with_its_process(tmp_path):
    lock_path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(lock_path)!r}, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with open(lock_path, "a") as f:
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.time() + 5
        while True:  # the kernel releases it as the process dies
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.time() < deadline, "lock outlived its process"
                time.sleep(0.05)


def test_unwritable_cache_is_a_clear_error(monkeypatch, tmp_path):
    # Builds memoized or loaded by earlier tests would answer without touching the cache.
    loader.reload()
    monkeypatch.setattr(loader, "_loaded_extensions", set())
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("")  # a file where a directory must go fails even for root
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker))
    else:
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(read_only))
    with pytest.raises(loader.BuildError, match="TORCH_EXTENSIONS_DIR to a writable directory"):
        loader.load("mse", arch="9.0")
    loader.reload()


def test_full_cache_disk_is_a_clear_error(monkeypatch, tmp_path):
    """No space left when the cache directory is made, or when the finished build's marker
    is written (the compiler itself reports ENOSPC in its own output)."""
    loader.reload()
    monkeypatch.setattr(loader, "_loaded_extensions", set())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(loader.Path, "mkdir", disk_full)
        with pytest.raises(loader.BuildError, match="No space left on device.*TORCH_EXTENSIONS_DIR"):
            loader.load("mse", arch="9.0")
    monkeypatch.setattr(loader, "check_toolchain", lambda: None)
    monkeypatch.setattr(loader, "_cpp_extension", lambda: types.SimpleNamespace(load_inline=lambda **kwargs: None))
    monkeypatch.setattr(loader.Path, "write_text", disk_full)
    with pytest.raises(loader.BuildError, match="No space left on device.*TORCH_EXTENSIONS_DIR"):
        loader.load("mse", arch="9.0")
    loader.reload()
