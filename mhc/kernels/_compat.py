"""Every private Triton and PyTorch-CUDA API the kernel layer uses, with the checks that fall back to
``kernel[grid](...)`` where they differ: a compiled kernel's own launcher (``CompiledKernel.run``,
``packed_metadata``, ``launch_metadata``), ``triton.knobs``' launch hooks (Triton >= 3.4), the raw
current stream, and ``is_fake``. The layers' private PyTorch APIs are :mod:`mhc._compat`.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

try:  # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:
    _knobs = None

__all__ = [
    "FAST_LAUNCH_SUPPORTED",
    "hook_metadata",
    "is_fake",
    "launch_hooks",
    "launches_directly",
    "raw_stream",
    "run",
]

_LAUNCHER_FIELDS = ("run", "function", "packed_metadata", "launch_metadata")

FAST_LAUNCH_SUPPORTED = _knobs is not None and hasattr(torch._C, "_cuda_getCurrentRawStream")


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (a graph being traced: no data, no address)."""
    return _is_fake(t)


def launch_hooks() -> tuple:
    """Triton's ``(launch_enter_hook, launch_exit_hook)`` as they are set now."""
    runtime = _knobs.runtime
    return runtime.launch_enter_hook, runtime.launch_exit_hook


def launches_directly(compiled) -> bool:
    """Whether ``compiled`` (what ``kernel[grid](...)`` returned) has the launcher the fast path
    calls."""
    return all(hasattr(compiled, name) for name in _LAUNCHER_FIELDS)


def raw_stream(device: int) -> int:
    """The handle of the current CUDA stream of ``device``."""
    return torch._C._cuda_getCurrentRawStream(device)


def run(compiled, grid_0: int, grid_1: int, grid_2: int, stream: int, metadata, enter, leave, *args) -> None:
    """Launch ``compiled`` through its own launcher: the grid, the stream, the launch metadata a
    hook gets (``None`` without hooks), the hooks, then the kernel's arguments in order (tensors or
    their addresses, scalars, constexprs)."""
    function, packed = compiled.function, compiled.packed_metadata
    compiled.run(grid_0, grid_1, grid_2, stream, function, packed, metadata, enter, leave, *args)


def hook_metadata(compiled, grid: tuple, stream: int, args: tuple):
    """What Triton's launch hooks get about a launch of ``compiled`` (a profiler's names and sizes)."""
    return compiled.launch_metadata(grid, stream, *args)
