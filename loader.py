"""Builds kernels/<name>.cu at first use and loads it, cached per GPU arch and content.

    ops = load("mse", "bfloat16")       # for the current GPU; ops.forward(...), ops.backward(...)
    reload("mse")                       # after editing kernels/mse.cu in a notebook
    python loader.py --arch 8.0 9.0     # ahead-of-time builds, no GPU needed

Each build is one extension, compiled with torch.utils.cpp_extension.load_inline for one
GPU arch and one dtype: a first call builds only what it runs. Its name carries the
kernel, dtype, arch and a hash of everything that shapes the binary (the .cu and the
kernels/ headers it includes, subfolders too, its bindings, compile flags, torch and CUDA
versions, Python version), so a new GPU, an edited kernel or a torch upgrade gets a build
of its own and nothing stale is ever loaded. A build is a Python module of that same name
(pybind11 bindings, BINDINGS), so several builds can live in one process.

Builds go under $TORCH_EXTENSIONS_DIR (torch's default cache when unset)/fused_losses.
A build runs under an OS-level lock (fcntl.flock), released by the kernel when its
process dies, so a build killed half-way never blocks the next one; a finished build
leaves a marker, and a cached load is one file check and an import.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

if __package__:
    from . import op_signatures
else:  # a plain folder on sys.path, or `python loader.py`
    import op_signatures

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
KERNELS = ("cross_entropy", "kl_div", "mse", "row_passes")
# Built only when asked for by name, for arch "9.0a" (their wgmma code runs on cc 9.0 only;
# other archs build a launcher that refuses): the sm_90a product (notes/performance.md).
SM90A_KERNELS = ("linear_ce_gemm",)
# sm_90a takes nvcc 12.0 or later; the toolkit a build uses has torch's CUDA major version.
BUILDS_SM90A = torch.version.cuda is not None and int(torch.version.cuda.split(".")[0]) >= 12
# The dtypes a build can hold, by name, with kernels/ops.h's DType codes.
DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
# The host's main.cpp (bindings, autograd node) at -O1: first use waits on it, and it builds 2.7-3 s
# sooner than at -O3 (cross_entropy on a 16-core H200 host: 16.3 -> 13.7 s fp32; notes, v56).
EXTRA_CFLAGS = ["-O1"]
EXTRA_CUDA_CFLAGS = ["-O3", "-lineinfo"]
# More nvcc flags for every build, space-separated, part of the cache key: e.g.
# "-Xptxas -v" (registers and spills, shown with verbose=True) or "-DFUSED_LOSSES_GEMM_DEBUG=1".
NVCC_FLAGS_ENV = "FUSED_LOSSES_NVCC_FLAGS"
BUILD_OK = "BUILD_OK"  # marker written after a build finished and loaded

_loaded: dict[tuple[str, str, str], object] = {}  # (kernel name, dtype, arch) -> the build's module
_loaded_for_device: dict[tuple[str, int, torch.dtype], object] = {}  # (kernel, device index, dtype) -> the same
# Builds this process has imported, by extension name. The same name in another cache
# directory is the same build (the name hashes everything in it): the module already
# imported serves.
_loaded_extensions: dict[str, object] = {}

# The Python side of a kernel's build (kernels/entry_points.h defines what it binds), compiled
# by the host compiler as load_inline's main.cpp, written from op_signatures.py: every op's
# parameter list and return type as macros that entry_points.h declares its functions with,
# and each op bound with its declared argument names. pybind11's and torch's exception
# headers rather than torch/extension.h (the whole C++ frontend: 13 s more to compile; older
# torch adds it anyway). pybind11 rather than a torch.ops registration: on an H100 machine's
# host a call through torch.ops costs 9-11 us, through pybind11 4-7 (cross-entropy's 12
# arguments; notes, v24), and the small losses are bound by host time. wrap_pybind_function
# raises torch's Python exceptions (torch.OutOfMemoryError...) where pybind11 alone would
# raise RuntimeError.
BINDINGS = """#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

{declarations}

#include "autograd_node.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
{definitions}  m.def("attach_saved_gradients", torch::wrap_pybind_function(fused_losses::attach_saved_gradients));
}}
"""


def bindings(kernel: str) -> str:
    """The build's main.cpp: BINDINGS for `kernel`'s ops (op_signatures.KERNEL_OPS and EXTRA_BINDINGS)."""
    functions = {op: (op if op == "scale_by_grad_output_" else f"{kernel}_{op}", schema)
                 for op, schema in op_signatures.KERNEL_OPS.get(kernel, {}).items()}
    functions.setdefault("scale_by_grad_output_", ("scale_by_grad_output_", op_signatures.SCALE_BY_GRAD_OUTPUT))
    for name, schema in op_signatures.EXTRA_BINDINGS.get(kernel, {}).items():
        functions[name] = (name, schema)
    definitions = "".join(
        f'  m.def("{name}", torch::wrap_pybind_function(fused_losses::{function})'
        f'{op_signatures.pybind_arguments(schema) if schema else ""});\n'
        for name, (function, schema) in functions.items())
    return BINDINGS.format(declarations=op_signatures.cpp_declarations(), definitions=definitions)


_toolkit_checked = False
_nvcc_flags: list[str] = []  # what this toolkit's nvcc adds to EXTRA_CUDA_CFLAGS (check_toolchain)
# torch < 2.1 ignores the -gencode that _build passes when choosing arch flags and reads
# TORCH_CUDA_ARCH_LIST (else asks the visible GPUs: IndexError when there are none). The
# environment is the process's, so there builds run one at a time.
TORCH_READS_ARCH_LIST = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) < (2, 1)
_extra_ldflags: list[str] = []  # set by check_toolchain for a toolkit without libcudart.so


class BuildError(RuntimeError):
    """A kernel could not be built; the message says why and what to do."""


# ----------------------------------------------------------------------------------
# What a build is: sources, arch, cache key.

def kernel_sources(name: str) -> dict[str, str]:
    """kernels/<name>.cu, the bindings (BINDINGS) as main.cpp, and every kernels/ header
    either includes (recursively), by path relative to kernels/ ("cross_entropy/row_math.cuh")."""
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel named {name!r}: expected {path} (kernels: {', '.join(KERNELS + SM90A_KERNELS)})")
    sources = {"main.cpp": bindings(name)}
    pending = [path, *_included_headers(sources["main.cpp"])]
    while pending:
        file = pending.pop()
        key = file.relative_to(KERNEL_DIR).as_posix()
        if key in sources:
            continue
        text = file.read_text()
        sources[key] = text
        pending.extend(_included_headers(text))
    return sources


def _included_headers(text: str) -> list[Path]:
    """The kernels/ headers that C++ source text includes ("..." includes only). Every file,
    in a subfolder too, names them relative to kernels/ (the build's include path)."""
    found = (KERNEL_DIR / name for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, flags=re.M))
    return [header for header in found if header.is_file()]


def normalize_arch(arch: str) -> str:
    """'8.0', '80', 'sm_80' -> '8.0'; '9.0a' keeps its suffix."""
    match = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)(a?)", str(arch).strip().lower())
    if not match:
        raise ValueError(f"arch must look like '8.0' or '9.0a', got {arch!r}")
    major, minor, suffix = match.groups()
    return f"{int(major)}.{minor}{suffix}"


def normalize_dtype(dtype) -> str:
    """torch.bfloat16, 'bfloat16', 'torch.bfloat16' -> 'bfloat16' (a key of DTYPES)."""
    name = str(dtype)
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def device_arch(device: torch.device | int | None = None) -> str:
    """The compute capability of a CUDA device as '9.0'."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def gencode_flag(arch: str) -> str:
    digits = arch.replace(".", "")
    return f"-gencode=arch=compute_{digits},code=sm_{digits}"


def env_cuda_cflags() -> list[str]:
    """$FUSED_LOSSES_NVCC_FLAGS, split: added to every build's nvcc flags and to its cache key."""
    return os.environ.get(NVCC_FLAGS_ENV, "").split()


def cache_key(sources: dict[str, str], arch: str, dtype: str = "float32", cflags=EXTRA_CFLAGS,
              cuda_cflags=EXTRA_CUDA_CFLAGS) -> str:
    digest = hashlib.sha256()
    for part in (
        *(f"{file}\0{text}" for file, text in sorted(sources.items())),
        arch, dtype, " ".join(cflags), " ".join(cuda_cflags),
        torch.__version__, str(torch.version.cuda), f"py{sys.version_info[0]}{sys.version_info[1]}",
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def extension_name(name: str, dtype: str, arch: str, key: str) -> str:
    return f"fused_losses_{name}_{dtype}_sm{arch.replace('.', '')}_{key}"


def cache_root() -> Path:
    """$TORCH_EXTENSIONS_DIR/fused_losses, else torch's default cache (~/.cache/torch_extensions)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not base:
        base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "torch_extensions"
    return Path(base) / "fused_losses"


# ----------------------------------------------------------------------------------
# The toolchain: checked once per process, before the first build.

def _cpp_extension():
    """torch.utils.cpp_extension, imported on first build only (it imports setuptools). Without a
    GPU its import says "No CUDA runtime is found, using CUDA_HOME=<its guess>" (a log record; a
    print to stderr before torch 2.x's logging): that line alone is dropped, as a build for a named
    arch needs no GPU and find_cuda_home picks the toolkit."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    logger.addFilter(_drop_no_cuda_runtime)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            import torch.utils.cpp_extension as cpp_extension
    finally:
        logger.removeFilter(_drop_no_cuda_runtime)
        sys.stderr.write("".join(line for line in printed.getvalue().splitlines(keepends=True)
                                 if not line.startswith(_NO_CUDA_RUNTIME)))
    return cpp_extension


_NO_CUDA_RUNTIME = "No CUDA runtime is found"


def _drop_no_cuda_runtime(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_NO_CUDA_RUNTIME)


def _nvcc_parallel_flags(home: Path) -> list[str]:
    """--split-compile=0 where this nvcc has it: cicc and ptxas then optimize the kernels on
    every core (cross_entropy.cu's build is mostly those two, one kernel after another)."""
    try:
        out = subprocess.run([str(home / "bin" / "nvcc"), "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["--split-compile=0"] if "--split-compile" in out else []


def _nvcc_release(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


DEBIAN_TOOLKIT = Path("/usr/lib/nvidia-cuda-toolkit")


def _has_cudart(home: Path) -> bool:
    """cuda_runtime.h and libcudart.so inside the toolkit (Debian's package keeps them in
    the system directories instead; only for that toolkit do those count)."""
    libs = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
    headers = [home / "include", home / "targets" / "x86_64-linux" / "include"]
    if home == DEBIAN_TOOLKIT:
        libs.append(Path("/usr/lib/x86_64-linux-gnu"))
        headers.append(Path("/usr/include"))
    return (any((lib / "libcudart.so").exists() for lib in libs)
            and any((inc / "cuda_runtime.h").exists() for inc in headers))


def _wheel_cudart(home: Path, major: str) -> Path | None:
    """lib/libcudart.so.<major> when `home` has it and include/cuda_runtime.h: the layout of
    NVIDIA's pip toolkit (site-packages/nvidia/cu<major>), which has no libcudart.so."""
    cudart = home / "lib" / f"libcudart.so.{major}"
    return cudart if cudart.is_file() and (home / "include" / "cuda_runtime.h").is_file() else None


def pip_toolkit_home(major: str) -> Path | None:
    """site-packages/nvidia/cu<major> holding bin/nvcc (NVIDIA's pip toolkit), in any folder
    on sys.path; None when it is not installed. Not through the `nvidia` package: CUDA 11
    wheels make it a regular package, which hides the same folder in other sys.path entries."""
    for base in sys.path:
        home = Path(base or ".") / "nvidia" / f"cu{major}"
        if (home / "bin" / "nvcc").is_file():
            return home
    return None


def pip_toolkit_command() -> str | None:
    """The pip command that installs NVIDIA's compiler at the CUDA version this torch pins
    (its `cuda-toolkit==X` requirement); None for a torch that pins none (CUDA 12 wheels and
    older, conda or source builds). An unpinned nvcc pulls a newer nvvm whose PTX the
    matching ptxas rejects."""
    try:
        requirements = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        match = re.match(r"cuda-toolkit\s*(?:\[[^\]]*\])?\s*==\s*([\w.]+)", requirement)
        if match:
            return f'{sys.executable} -m pip install "cuda-toolkit[nvcc,cccl]=={match.group(1)}"'
    return None


def _cudart_link_dir(cudart: Path) -> Path:
    """A directory in the kernel cache (site-packages may be read-only) whose libcudart.so
    links to `cudart`, one per toolkit."""
    link_dir = cache_root() / f"cudart-{hashlib.sha256(str(cudart).encode()).hexdigest()[:12]}"
    link = link_dir / "libcudart.so"
    if not link.exists():
        try:
            link_dir.mkdir(parents=True, exist_ok=True)
            temporary = link_dir / f"libcudart.so.{os.getpid()}.tmp"
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(cudart)
            os.replace(temporary, link)  # atomic: a concurrent first use sees a link or none
        except OSError as error:
            raise _cache_write_error(cache_root(), error) from None
    return link_dir


def system_toolkit_candidates() -> list[Path]:
    """Where a system CUDA toolkit may be: torch's own guess (which on some machines is
    /usr/local, from a wrapper nvcc in /usr/local/bin, with no libcudart), /usr/local/cuda,
    /usr/local/cuda-<torch's version>, the directory of the nvcc on PATH followed through
    links, and Debian's /usr/lib/nvidia-cuda-toolkit."""
    candidates = []
    guessed = _cpp_extension().CUDA_HOME
    if guessed:
        candidates.append(Path(guessed))
    candidates += [Path("/usr/local/cuda"), Path(f"/usr/local/cuda-{torch.version.cuda}")]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path).resolve().parent.parent)
    candidates.append(DEBIAN_TOOLKIT)
    return candidates


def find_cuda_home() -> Path:
    """A CUDA toolkit whose nvcc matches torch's CUDA major version.

    $CUDA_HOME (or $CUDA_PATH) wins when set. Otherwise the system toolkits
    (system_toolkit_candidates), then NVIDIA's pip toolkit (pip_toolkit_home).
    """
    want_major = torch.version.cuda.split(".")[0]
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        candidates = [Path(explicit)]
    else:
        candidates = system_toolkit_candidates()
        pip_home = pip_toolkit_home(want_major)
        if pip_home:
            candidates.append(pip_home)

    seen = []
    for home in dict.fromkeys(candidates):
        nvcc = home / "bin" / "nvcc"
        if not nvcc.is_file():
            continue
        release = _nvcc_release(nvcc)
        if release is None or not (_has_cudart(home) or _wheel_cudart(home, want_major)):
            seen.append(f"{home} (nvcc there does not run, or no libcudart.so / cuda_runtime.h)")
            continue
        if release.split(".")[0] != want_major:
            seen.append(f"{home} (nvcc {release})")
            continue
        return home

    where = "; ".join(seen) if seen else "none found"
    if explicit:
        raise BuildError(
            f"CUDA_HOME={explicit} is not a usable CUDA {want_major}.x toolkit ({where}). "
            f"torch {torch.__version__} was built with CUDA {torch.version.cuda}: point CUDA_HOME at a "
            f"CUDA {want_major}.x toolkit (the directory holding bin/nvcc).")
    pip_command = pip_toolkit_command()
    fix = (f"Install NVIDIA's compiler for this torch with: {pip_command} (or install the CUDA "
           f"{want_major}.x toolkit and set CUDA_HOME to it)." if pip_command else
           f"Install the CUDA {want_major}.x toolkit (nvcc) and set CUDA_HOME to it, e.g. CUDA_HOME=/usr/local/cuda.")
    raise BuildError(
        f"no CUDA {want_major}.x toolkit found to compile the kernels (torch {torch.__version__} was built "
        f"with CUDA {torch.version.cuda}; toolkits seen: {where}). {fix}")


def check_toolchain() -> None:
    """Raises BuildError naming what is missing: CUDA torch, ninja, a matching nvcc."""
    global _toolkit_checked, _nvcc_flags, _extra_ldflags
    if _toolkit_checked:
        return
    if torch.version.cuda is None:
        raise BuildError(
            f"torch {torch.__version__} is a CPU-only build, so the CUDA kernels cannot be built. "
            "Install a CUDA build of torch (see https://pytorch.org/get-started/locally/); on CPU "
            "tensors the losses use torch's own implementation and need no build.")
    if shutil.which("ninja") is None:
        # A venv's ninja is in its bin/, which is not on PATH unless the venv is activated.
        try:
            import ninja
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise BuildError("ninja is needed to build the kernels: pip install ninja") from None
    home = find_cuda_home()
    # torch reads its module-level CUDA_HOME for nvcc, include and library paths.
    _cpp_extension().CUDA_HOME = str(home)
    os.environ["CUDA_HOME"] = str(home)
    _nvcc_flags = _nvcc_parallel_flags(home)
    wheel_cudart = None if _has_cudart(home) else _wheel_cudart(home, torch.version.cuda.split(".")[0])
    # torch links with -lcudart, which needs a libcudart.so; -L adds a search directory for it.
    _extra_ldflags = [f"-L{_cudart_link_dir(wheel_cudart)}"] if wheel_cudart else []
    _toolkit_checked = True


# ----------------------------------------------------------------------------------
# Building and loading.

def _cache_write_error(root: Path, error: OSError) -> BuildError:
    """Read-only, full, or not a directory: says which, and what to do."""
    return BuildError(f"cannot write the kernel cache at {root} ({error.strerror}); set "
                      "TORCH_EXTENSIONS_DIR to a writable directory with a few hundred MB free")


def _build(name: str, dtype: str, arch: str, ext_name: str, build_dir: Path, sources: dict[str, str],
           verbose: bool):
    check_toolchain()
    # torch < 2.1 guards its build directory with a lock *file* whose mere existence
    # blocks; a build killed mid-way leaves it behind. We hold our own flock, so any
    # such file is stale.
    (build_dir / "lock").unlink(missing_ok=True)
    # A build takes seconds to minutes: say so before it starts, not only after.
    print(f"fused_losses: building {name} ({dtype}) for sm_{arch.replace('.', '')} ... (first use; cached after)",
          file=sys.stderr, flush=True)
    started = time.perf_counter()
    saved_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if TORCH_READS_ARCH_LIST:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    load_inline = _cpp_extension().load_inline
    # Newer torch can leave out the headers load_inline adds: torch/extension.h to main.cpp,
    # and torch/types.h to the .cu, most of an ATen-free .cu's compile time. Older torch adds them.
    optional = {"no_implicit_headers": True} if "no_implicit_headers" in inspect.signature(load_inline).parameters else {}
    try:
        load_inline(
            name=ext_name,
            cpp_sources=[sources["main.cpp"]],
            cuda_sources=[sources[f"{name}.cu"]],
            extra_cflags=EXTRA_CFLAGS,
            extra_cuda_cflags=EXTRA_CUDA_CFLAGS + env_cuda_cflags() + _nvcc_flags
            + [gencode_flag(arch), f"-DFUSED_LOSSES_DTYPE={DTYPES[dtype]}"],
            extra_include_paths=[str(KERNEL_DIR)],
            extra_ldflags=list(_extra_ldflags),
            build_directory=str(build_dir),
            is_python_module=False,  # build only: _open_build imports it
            verbose=verbose,
            **optional,
        )
    except Exception as error:  # load_inline raises RuntimeError with the compiler's output
        raise BuildError(f"building kernel {name!r} ({dtype}) for sm_{arch.replace('.', '')} in {build_dir} "
                         f"failed:\n{error}") from None
    finally:
        if TORCH_READS_ARCH_LIST:
            if saved_arch_list is None:
                del os.environ["TORCH_CUDA_ARCH_LIST"]
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved_arch_list
    seconds = time.perf_counter() - started
    try:
        (build_dir / BUILD_OK).write_text(f"{ext_name}\n")
    except OSError as error:  # a disk that filled up during the build
        raise _cache_write_error(build_dir.parent, error) from None
    print(f"fused_losses: built {name} ({dtype}) for sm_{arch.replace('.', '')} in {seconds:.1f} s -> {build_dir}",
          file=sys.stderr, flush=True)


def _open_build(name: str, dtype: str, arch: str, verbose: bool = False):
    """Imports the build of `name` for `dtype` and `arch`, building it first if needed."""
    sources = kernel_sources(name)
    ext_name = extension_name(name, dtype, arch,
                              cache_key(sources, arch, dtype, cuda_cflags=EXTRA_CUDA_CFLAGS + env_cuda_cflags()))
    if ext_name in _loaded_extensions:
        return _loaded_extensions[ext_name]
    root = cache_root()
    build_dir = root / ext_name
    library = build_dir / f"{ext_name}.so"

    def built() -> bool:
        return (build_dir / BUILD_OK).is_file() and library.is_file()

    if not built():
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            lock_file = open(root / f"{ext_name}.lock", "a")
        except OSError as error:
            raise _cache_write_error(root, error) from None
        with lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes or the process dies
            if not built():  # another process may have built it meanwhile
                _build(name, dtype, arch, ext_name, build_dir, sources, verbose)
    spec = importlib.util.spec_from_file_location(ext_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded_extensions[ext_name] = module
    return module


def load(name: str, dtype="float32", arch: str | None = None, verbose: bool = False):
    """The ops of kernel `name` for inputs of `dtype` (a torch.dtype or its name) and
    `arch` (default: the current CUDA device's).

    First use builds (a line on stderr as it starts, another with where and how long);
    later calls in the process return the same module at once.
    """
    if arch is None:
        if not torch.cuda.is_available():
            raise BuildError(
                f"no CUDA device is visible, so there is no GPU arch to build {name!r} for. "
                "Pass arch (e.g. load(name, arch='9.0'), or python loader.py --arch 8.0 9.0) "
                "to build ahead of time without a GPU.")
        arch = device_arch()
    arch = normalize_arch(arch)
    dtype = normalize_dtype(dtype)
    ops = _loaded.get((name, dtype, arch))
    if ops is None:
        ops = _loaded[(name, dtype, arch)] = _open_build(name, dtype, arch, verbose)
    return ops


def load_for_device(name: str, device: torch.device, dtype: torch.dtype):
    """load(name, dtype) for the arch of a CUDA device; the hot path of every loss call."""
    ops = _loaded_for_device.get((name, device.index, dtype))
    if ops is None:
        arch = device_arch(device) + ("a" if name in SM90A_KERNELS else "")  # their wgmma code: sm_90a
        ops = _loaded_for_device[(name, device.index, dtype)] = load(name, dtype, arch)
    return ops


def load_together_for_device(names, device: torch.device, dtype: torch.dtype) -> None:
    """load_for_device of each of `names`, those not loaded yet side by side (each build its own compiler
    processes): a first call that needs several builds waits for the longest, not their sum."""
    missing = [name for name in names if (name, device.index, dtype) not in _loaded_for_device]
    if len(missing) < 2 or TORCH_READS_ARCH_LIST:
        return  # load_for_device at first use, as ever
    try:
        check_toolchain()  # once, before the threads; where a build needs a missing toolkit, its load raises
    except BuildError:
        pass
    with ThreadPoolExecutor(len(missing)) as pool:
        list(pool.map(lambda name: load_for_device(name, device, dtype), missing))


def reload(name: str | None = None) -> None:
    """Forgets loaded builds of `name` (or of every kernel), so the next load re-reads
    the sources: an edited kernel gets a new build, used from then on."""
    for cache in (_loaded, _loaded_for_device):
        for key in [key for key in cache if name is None or key[0] == name]:
            del cache[key]


def build(archs, names=KERNELS, dtypes=tuple(DTYPES), verbose: bool = False) -> list[str]:
    """Ahead-of-time builds of `names` for each dtype in `dtypes` and arch in `archs`, all
    at once (each build is its own nvcc and host compiler processes); no GPU needed."""
    tasks = [(name, normalize_dtype(dtype), normalize_arch(arch)) for arch in archs for name in names
             for dtype in dtypes]
    check_toolchain()  # once, before the threads
    workers = 1 if TORCH_READS_ARCH_LIST else min(len(tasks), os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda task: load(task[0], task[1], arch=task[2], verbose=verbose), tasks))
    return [f"{name} {dtype} sm_{arch.replace('.', '')}" for name, dtype, arch in tasks]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the fused loss kernels ahead of time (no GPU needed).")
    parser.add_argument("--arch", nargs="+", required=True, help="GPU archs, e.g. 8.0 9.0")
    parser.add_argument("--kernel", nargs="+", default=list(KERNELS), choices=KERNELS + SM90A_KERNELS,
                        help=f"default: {' '.join(KERNELS)}; {' '.join(SM90A_KERNELS)} only when named (arch 9.0a)")
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    try:
        built = build(args.arch, args.kernel, args.dtype, verbose=args.verbose)
    except (BuildError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"built or found in {cache_root()}: {', '.join(built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
