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
    monkeypatch.setattr(loader, "_extra_ldflags", [])
    cpp_extension = loader._cpp_extension()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    for name in ("CUDA_HOME", "CUDA_PATH"):  # check_toolchain sets CUDA_HOME: restored (or unset) after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


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


def fake_pip_toolkit(site: Path, release: str, with_cudart: bool = True) -> Path:
    """site/nvidia/cu<major> laid out as NVIDIA's pip toolkit: bin/nvcc reporting `release`,
    include/cuda_runtime.h and lib/libcudart.so.<major> (no libcudart.so)."""
    major = release.split(".")[0]
    home = site / "nvidia" / f"cu{major}"
    fake_toolkit(home, release, with_cudart=False)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    (home / "lib").mkdir()
    if with_cudart:
        (home / "lib" / f"libcudart.so.{major}").write_text("")
    return home


TORCH_REQUIRES_CUDA_13 = ['cuda-toolkit[cublas,cudart,nvrtc]==13.0.3; platform_system == "Linux"',
                          'nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"']
TORCH_REQUIRES_CUDA_12 = ['nvidia-cuda-runtime-cu12==12.4.127; platform_system == "Linux"',
                          'nvidia-cuda-nvrtc-cu12==12.4.127; platform_system == "Linux"']


# ----------------------------------------------------------------------------------
# What a build is.

SHARED_HEADERS = {"device.cuh", "launch.cuh", "finish.cuh", "grad_output_guess.cuh", "ops.h", "entry_points.h",
                  "autograd_node.h"}
KERNEL_HEADERS = {
    "mse": {"pointwise.cuh"},
    "kl_div": {"pointwise.cuh"},
    "cross_entropy": {"sm90.cuh", "cross_entropy/row_math.cuh", "cross_entropy/row_kernels.cuh",
                      "cross_entropy/pipelined_kernel.cuh", "cross_entropy/launch_policy.cuh"},
    "row_passes": set(),
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
    assert loader.cache_key(sources, "9.0", "bfloat16") != base
    assert loader.cache_key(sources, "9.0", cuda_cflags=["-O2"]) != base
    assert loader.cache_key(sources, "9.0", cflags=["-O0"]) != base
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert loader.cache_key(sources, "9.0") != base


def test_extension_name_carries_kernel_dtype_arch_and_key():
    name = loader.extension_name("cross_entropy", "bfloat16", "9.0", "0123abcd")
    assert name == "fused_losses_cross_entropy_bfloat16_sm90_0123abcd" and name.isidentifier()


@pytest.mark.parametrize("given", [torch.bfloat16, "bfloat16", "torch.bfloat16"])
def test_dtype_names(given):
    assert loader.normalize_dtype(given) == "bfloat16"


@pytest.mark.parametrize("bad", [torch.int64, "float8", ""])
def test_bad_dtype_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="dtype must be one of float32, float64, float16, bfloat16"):
        loader.normalize_dtype(bad)


def test_cache_root_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert loader.cache_root() == tmp_path / "fused_losses"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.cache_root() == tmp_path / "xdg" / "torch_extensions" / "fused_losses"


# ----------------------------------------------------------------------------------
# Errors that name their fix.

def test_builds_a_call_needs_load_side_by_side(monkeypatch):
    """load_together_for_device loads the builds not yet loaded at once, a thread each (a first linear call's
    two builds: the longer one's time, not their sum); with one missing it leaves it to its first use."""
    import threading
    both_in_flight = threading.Barrier(2, timeout=30)  # a load waits here for the other: one after another breaks it
    loaded = []

    def load_for_device(name, device, dtype):
        both_in_flight.wait()
        loaded.append(name)

    monkeypatch.setattr(loader, "load_for_device", load_for_device)
    monkeypatch.setattr(loader, "check_toolchain", lambda: None)
    monkeypatch.setattr(loader, "TORCH_READS_ARCH_LIST", False)
    device, names = torch.device("cuda", 0), ("linear_ce_gemm", "row_passes")
    loader.load_together_for_device(names, device, torch.bfloat16)
    assert sorted(loaded) == sorted(names)
    loaded.clear()
    monkeypatch.setitem(loader._loaded_for_device, ("row_passes", 0, torch.bfloat16), object())
    loader.load_together_for_device(names, device, torch.bfloat16)
    assert loaded == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_no_gpu_and_no_arch_says_to_pass_an_arch():
    with pytest.raises(loader.BuildError, match=r"no CUDA device is visible.*--arch 8.0 9.0"):
        loader.load("mse")


def test_cpu_only_torch(monkeypatch, fresh_toolchain_check):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(loader.BuildError, match="CPU-only build"):
        loader.check_toolchain()


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
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


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_pip_toolkit_is_used_when_no_system_toolkit_is_found(monkeypatch, tmp_path, fresh_toolchain_check):
    """Found through the nvidia namespace package; linked through a libcudart.so in the cache."""
    monkeypatch.setattr(loader, "system_toolkit_candidates", lambda: [])
    home = fake_pip_toolkit(tmp_path / "site", torch.version.cuda)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert loader.find_cuda_home() == home
    loader.check_toolchain()
    assert loader._cpp_extension().CUDA_HOME == str(home)
    [flag] = loader._extra_ldflags
    assert flag.startswith("-L")
    link = Path(flag[2:]) / "libcudart.so"
    assert link.parent.parent == tmp_path / "cache" / "fused_losses"
    assert link.resolve() == home / "lib" / f"libcudart.so.{torch.version.cuda.split('.')[0]}"


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_system_toolkit_wins_over_the_pip_toolkit(monkeypatch, tmp_path, fresh_toolchain_check):
    system = fake_toolkit(tmp_path / "cuda", torch.version.cuda)
    monkeypatch.setattr(loader, "system_toolkit_candidates", lambda: [system])
    fake_pip_toolkit(tmp_path / "site", torch.version.cuda)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    assert loader.find_cuda_home() == system
    loader.check_toolchain()
    assert loader._extra_ldflags == []  # it has its own libcudart.so


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_pip_toolkit_without_cudart_is_passed_over(monkeypatch, tmp_path, fresh_toolchain_check):
    monkeypatch.setattr(loader, "system_toolkit_candidates", lambda: [])
    home = fake_pip_toolkit(tmp_path / "site", torch.version.cuda, with_cudart=False)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(loader.BuildError, match=rf"toolkits seen: {home} \(.*no libcudart"):
        loader.find_cuda_home()


def test_cudart_link_dir_is_made_once_per_library(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "libcudart.so.13", tmp_path / "b" / "libcudart.so.13"
    link_dir = loader._cudart_link_dir(first)
    assert Path(os.readlink(link_dir / "libcudart.so")) == first
    assert loader._cudart_link_dir(first) == link_dir  # already there
    assert [p.name for p in link_dir.iterdir()] == ["libcudart.so"]  # no temporary left
    assert loader._cudart_link_dir(second) != link_dir


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_no_toolkit_names_the_pip_command_for_this_torch(monkeypatch, fresh_toolchain_check):
    monkeypatch.setattr(loader, "system_toolkit_candidates", lambda: [])
    monkeypatch.setattr(loader, "pip_toolkit_home", lambda major: None)
    monkeypatch.setattr(loader.importlib.metadata, "requires", lambda name: TORCH_REQUIRES_CUDA_13)
    command = f'{sys.executable} -m pip install "cuda-toolkit[nvcc,cccl]==13.0.3"'
    with pytest.raises(loader.BuildError, match=r"no CUDA \d+\.x toolkit found.*with: ") as raised:
        loader.check_toolchain()
    assert command in str(raised.value)


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_no_toolkit_for_a_torch_that_pins_no_pip_toolkit(monkeypatch, fresh_toolchain_check):
    """CUDA 12 wheels of torch depend on the runtime libraries one by one: no pip command."""
    monkeypatch.setattr(loader, "system_toolkit_candidates", lambda: [])
    monkeypatch.setattr(loader, "pip_toolkit_home", lambda major: None)
    monkeypatch.setattr(loader.importlib.metadata, "requires", lambda name: TORCH_REQUIRES_CUDA_12)
    assert loader.pip_toolkit_command() is None
    with pytest.raises(loader.BuildError, match=r"Install the CUDA \d+\.x toolkit \(nvcc\) and set CUDA_HOME"):
        loader.check_toolchain()


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
    with pytest.raises(loader.BuildError, match=r"(?s)building kernel 'broken' \(float32\) for sm_80.*error"):
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


@pytest.mark.parametrize("help_text,flags", [("--split-compile <number>  Specify ...", ["--split-compile=0"]),
                                             ("--threads <number>  Specify ...", [])], ids=["has it", "lacks it"])
def test_split_compile_only_where_nvcc_has_it(tmp_path, help_text, flags):
    nvcc = fake_toolkit(tmp_path, "11.7") / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '{help_text}'\n")
    assert loader._nvcc_parallel_flags(tmp_path) == flags


@pytest.mark.skipif(not torch.version.cuda, reason="a CPU-only torch looks for no CUDA toolkit")
def test_no_missing_cuda_runtime_line_from_the_build_import(tmp_path):
    """Without a GPU (CUDA_VISIBLE_DEVICES='' hides any) torch.utils.cpp_extension's import logs "No
    CUDA runtime is found" where it finds a CUDA_HOME: torch's own import does (the control), the
    loader's does not, and leaves the logger's other lines to it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUDA_HOME=str(tmp_path))

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], cwd=Path(loader.__file__).parent, env=env,
                              capture_output=True, text=True, check=True).stderr

    assert "No CUDA runtime is found" in stderr("import torch.utils.cpp_extension")
    assert "No CUDA runtime is found" not in stderr(
        "import logging, loader\nloader._cpp_extension()\n"
        "assert not logging.getLogger('torch.utils.cpp_extension').filters")
