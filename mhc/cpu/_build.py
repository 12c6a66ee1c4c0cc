"""Builds ``kernels.c`` with the system C compiler and loads it (``ctypes``), once per process.

The library is compiled the first time it is needed (about two seconds) into ``$MHC_CACHE_DIR``
(default ``$XDG_CACHE_HOME/mhc``, ``~/.cache/mhc``, or the temporary directory without a home),
named by a hash of the source, the flags and the compiler's version, so a changed source or
compiler builds anew and a cached build is reused across processes. ``$CC`` names the compiler,
else the first of ``cc``, ``gcc`` and ``clang`` found. ``MHC_CPU_KERNELS=0`` turns the loops off.
Without a working compiler :func:`library` is ``None`` and the layers keep the PyTorch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["library", "build_error"]

SOURCE = Path(__file__).with_name("kernels.c")
# no fast-math: NaN, inf and rounding behave as in PyTorch (and ISO C mode contracts no a * b + c
# into an FMA); no trapping math: selects between floats become vector blends (values unchanged,
# only the floating-point exception flags, which nothing reads, may differ); no -march=native: a
# cached build must run on every CPU that shares the cache
FLAGS = ("-O3", "-std=c99", "-fno-trapping-math", "-shared", "-fPIC")


def _flags() -> tuple:
    """:data:`FLAGS`, plus 8-wide vectors where PyTorch found AVX2 on this x86 CPU, plus OpenMP
    where PyTorch runs its own ops on the GNU OpenMP runtime (the build's name includes its
    flags)."""
    flags = FLAGS
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags = (*flags, "-mavx2")
    return (*flags, "-fopenmp") if _shares_torch_openmp() else flags


def _shares_torch_openmp() -> bool:
    """Whether a library built with ``-fopenmp`` joins PyTorch's thread team: PyTorch's CPU ops run
    on OpenMP and the process has loaded GNU's runtime (``libgomp.so.1``, which the loader then
    reuses for the library instead of loading a second runtime with its own threads)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as maps:
            return any(line.rstrip().endswith("/libgomp.so.1") for line in maps)
    except OSError:  # not Linux
        return False


_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "mhc_sinkhorn_forward": (ctypes.c_int, [_PTR, _PTR, _I64, _I64, _I64, _F32]),
    "mhc_sinkhorn_backward": (ctypes.c_int, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _F32]),
    "mhc_pre_mix_forward": (None, [_PTR, _PTR, _PTR, _I64, _I64, _I64]),
    "mhc_pre_mix_backward": (None, [_PTR] * 5 + [_I64, _I64, _I64]),
    "mhc_post_mix_forward": (None, [_PTR] * 5 + [_I64, _I64, _I64]),
    "mhc_post_mix_backward": (None, [_PTR] * 9 + [_I64, _I64, _I64]),
    "mhc_site_start_forward": (ctypes.c_int, [_PTR] * 9 + [_I64] * 4 + [_F32, _F32]),
    "mhc_site_start_backward": (ctypes.c_int, [_PTR] * 12 + [_I64] * 4 + [_F32]),
    "mhc_site_start_grad_x": (None, [_PTR] * 5 + [_I64] * 3),
}

_why_not = {"error": None}  # why library() is None


def _cache_dir() -> Path:
    if os.environ.get("MHC_CACHE_DIR"):
        return Path(os.environ["MHC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if base.startswith("~"):  # no home directory to expand
        base = tempfile.gettempdir()
    return Path(base) / "mhc"


def _compile(compiler: str, flags: tuple) -> Path:
    """The shared library for this source, these flags and this compiler; written by an atomic
    rename, so processes that build it at once each leave a whole file."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *flags, version]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"mhc_cpu_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        command = [compiler, *flags, "-o", str(built), str(SOURCE), "-lm"]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(built, target)
    return target


def _build(compiler: str, flags: tuple) -> Path:
    """:func:`_compile`, again without OpenMP where the compiler cannot build it (no ``omp.h``):
    the loops then run on one thread."""
    try:
        return _compile(compiler, flags)
    except subprocess.CalledProcessError:
        if "-fopenmp" not in flags:
            raise
        return _compile(compiler, tuple(f for f in flags if f != "-fopenmp"))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions' signatures set, or ``None`` (turned off, or no
    compiler; :func:`build_error` says why)."""
    _why_not["error"] = None
    if os.environ.get("MHC_CPU_KERNELS", "1") == "0":
        _why_not["error"] = "turned off by MHC_CPU_KERNELS=0"
        return None
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    compiler = next((found for name in names if (found := shutil.which(name))), None)
    if compiler is None:
        _why_not["error"] = f"no C compiler found (tried {', '.join(names)})"
        return None
    try:
        loaded = ctypes.CDLL(str(_build(compiler, _flags())))
    except subprocess.CalledProcessError as error:
        _why_not["error"] = f"{compiler} failed: {(error.stderr or '').strip()[:500]}"
        return None
    except OSError as error:
        _why_not["error"] = f"could not build or load the library: {error}"
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(loaded, name)
        function.restype, function.argtypes = restype, argtypes
    return loaded


def build_error() -> str | None:
    """Why :func:`library` is ``None``, or ``None`` when it loaded (or was not tried yet)."""
    return _why_not["error"]
