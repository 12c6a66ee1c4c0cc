"""Kernel launches with less host work than ``kernel[grid](...)``.

:func:`launch` keeps the compiled kernel of each specialization under a key at least as fine as
Triton's own (device, meta-parameters, per input its dtype and 16-byte alignment, per scalar what
Triton specializes on; the ``outputs`` a launcher has just allocated are left out) and calls its
launcher with the tensors' addresses as ints. A miss goes through ``kernel[grid]``. Under
``TRITON_INTERPRET=1`` every launch is ``kernel[grid]``; inside a ``torch.library.triton_op``'s body
(:func:`traced_launches`) it goes through ``torch.library.wrap_triton``.
"""

import contextlib
import functools
import os
from typing import NamedTuple

import torch
import triton

from mhc.kernels import _compat

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FAST = not INTERPRET and _compat.FAST_LAUNCH_SUPPORTED

_Tensor = torch.Tensor

tracing = False  # inside a triton_op's body: launches go through torch.library.wrap_triton


@contextlib.contextmanager
def traced_launches():
    """Launches in this context go through ``torch.library.wrap_triton`` (a ``triton_op``'s body)."""
    global tracing
    before, tracing = tracing, True
    try:
        yield
    finally:
        tracing = before


def traced_into_graph(t: torch.Tensor) -> bool:
    """Whether a launch for ``t`` is being traced into a graph (a ``triton_op``'s body run on fake
    tensors) rather than run. Inductor compiles such a kernel itself, with the launch's
    ``num_warps`` and ``num_stages`` but not its ``maxnreg``; launchers that cap registers plan
    those launches for uncapped kernels."""
    return tracing and _compat.is_fake(t)


def _specialization(inputs: tuple, scalars: tuple) -> tuple[tuple, list]:
    """``(key, addresses)``: what Triton specializes ``inputs`` (tensors) and ``scalars`` on,
    flattened into one tuple (one pass, no call per argument: this runs on every launch), and the
    inputs' addresses read on the way. The device is the launch's, not part of this key."""
    key, addresses = [], []
    for a in inputs:
        address = a.data_ptr()
        addresses.append(address)
        key += (a.dtype, address & 15 == 0)
    for a in scalars:
        if type(a) is int:
            key += (-(2**31) <= a < 2**31, a == 1, a & 15 == 0)
        else:
            key.append(a if type(a) is bool else type(a))
    return tuple(key), addresses


class _Cached:
    __slots__ = ("kernel", "constexprs")

    def __init__(self, kernel, constexprs):
        self.kernel, self.constexprs = kernel, constexprs


_CACHE: dict = {}
_MISSING = object()


def launch(kernel, grid, inputs: tuple, outputs: tuple, scalars: tuple, meta: dict, meta_key) -> None:
    """``kernel[grid](*inputs, *outputs, *scalars, **meta)``: the kernel's leading non-constexpr
    arguments in order, as three groups. ``inputs``: the tensors it reads (or any tensor not
    allocated by the caller for this launch); ``outputs``: tensors the caller has just allocated
    (``torch.empty``), each of an input's dtype or of one that ``meta_key`` fixes; ``scalars``: the
    ints, floats and bools after them. ``meta`` holds its constexpr arguments (as keywords) and
    launch options (``num_warps``, ...); ``meta_key`` is a hashable stand-in for ``meta``
    (launchers cache their meta per configuration)."""
    args = (*inputs, *outputs, *scalars)
    if tracing:
        _traced_launch(kernel, grid, args, meta, meta_key)
        return
    if not FAST:
        kernel[grid](*args, **meta)
        return
    # id(kernel): a JITFunction hashes through Python code; the kernels live as long as their module
    device = inputs[0].get_device()
    specialization, addresses = _specialization(inputs, scalars)
    key = (id(kernel), meta_key, device, specialization)
    cached = _CACHE.get(key, _MISSING)
    if cached is _MISSING:
        compiled = kernel[grid](*args, **meta)
        names = kernel.arg_names[len(args) :]
        direct = _compat.launches_directly(compiled)  # else this Triton's kernels launch as kernel[grid]
        _CACHE[key] = _Cached(compiled, tuple(meta[name] for name in names)) if direct else None
        return
    if cached is None:
        kernel[grid](*args, **meta)
        return
    compiled = cached.kernel
    stream = _compat.raw_stream(device)
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    enter, leave = _compat.launch_hooks()
    if _no_hook(enter) and _no_hook(leave):
        # the launcher calls no hook given None, and no hook needs the launch's metadata. It gets
        # addresses, not tensors: an int it takes as it is, while of a tensor it calls data_ptr()
        # and asks the driver about the address (cuPointerGetAttribute), argument by argument
        for out in outputs:
            addresses.append(out.data_ptr())
        _compat.run(
            compiled, grid[0], grid_1, grid_2, stream, None, None, None, *addresses, *scalars, *cached.constexprs
        )
        return
    full = (*args, *cached.constexprs)  # a hook may read the tensors (a profiler: their sizes)
    metadata = _compat.hook_metadata(compiled, grid, stream, full)
    _compat.run(compiled, grid[0], grid_1, grid_2, stream, metadata, enter, leave, *full)


# launch options that torch.library.wrap_triton takes as keywords; others (maxnreg) go into a
# one-config autotuner around the kernel, which Triton reads them from where the op body runs
# eagerly (Inductor leaves maxnreg out: traced_into_graph)
_WRAP_OPTIONS = ("num_warps", "num_stages")
_TUNED: dict = {}


def _traced_launch(kernel, grid, args, meta, meta_key) -> None:
    if "maxnreg" in meta:  # the config holds every launch option, the call none of them
        options = {k: meta[k] for k in ("maxnreg", *_WRAP_OPTIONS) if k in meta}
        key = (id(kernel), meta_key)
        if key not in _TUNED:
            _TUNED[key] = triton.autotune([triton.Config({}, **options)], key=[])(kernel)
        kernel = _TUNED[key]
        meta = {k: v for k, v in meta.items() if k not in options}
    torch.library.wrap_triton(kernel)[grid](*args, **meta)


def _no_hook(hook) -> bool:
    """Whether a launch hook of Triton's is unset: ``None``, or an empty chain of hooks (Triton
    3.5+ keeps a ``HookChain`` there always, and building the metadata for it costs host time)."""
    return not getattr(hook, "calls", hook)


# ------------------------------------------------------------------------------ launch plans
# A launcher's configuration (tiles, grid, meta-parameters) depends on the sizes only: worked out
# once per size and kept, it costs a dictionary lookup per launch instead of a few microseconds.

_PLANS: list = []


class LaunchPlan(NamedTuple):
    """One launch of a kernel, worked out for a size: ``grid``, the meta-parameters ``meta``
    (constexprs and compiler options) and ``key``, which names the compiled kernel ``meta`` selects
    in :func:`launch`'s cache."""

    grid: tuple
    meta: dict
    key: tuple


def launch_plan(configure):
    """``configure`` cached per argument tuple (its arguments hashable: sizes, dtypes, the device),
    and cleared by :func:`forget_launch_plans`."""
    cached = functools.lru_cache(maxsize=1024)(configure)
    _PLANS.append(cached)
    return cached


def static(size) -> int:
    """A size that picks a kernel's tiles or constexprs (streams, channels, matrix order), as an
    int. A symbolic one (a graph traced with dynamic shapes) is specialised: the graph guards on its
    value, as the kernel compiled for it requires. Token counts stay symbolic (:func:`per_size`)."""
    return size if type(size) is int else int(size)


def per_size(plan, tokens):
    """``plan`` (a :func:`launch_plan`), or the function it caches where the token count is symbolic
    (a graph traced for any count: a ``SymInt`` cannot key a cache)."""
    return plan if type(tokens) is int else plan.__wrapped__


def forget_launch_plans() -> None:
    """Clear every launcher's cached plans: for tests and sweeps that replace the functions they
    are made from (``sm_count``, the tile configurations)."""
    for plan in _PLANS:
        plan.cache_clear()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SM count (4 off CUDA: grids sized for a small GPU in Triton's interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def per_tile(tiles: int, waves: int, sms: int, most: int) -> int:
    """Programs per tile (splits of a tile's work) that give about ``waves`` programs per SM over
    ``tiles`` tiles, from 1 to ``most``."""
    return max(1, min(most, round(waves * sms / tiles)))
