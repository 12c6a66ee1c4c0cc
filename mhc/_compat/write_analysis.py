"""One write analysis per kernel specialization while ``torch.compile`` traces mhc's kernels.

PyTorch works out which arguments a traced Triton kernel writes by generating its TTIR, uncached
and up to four times per call (pytorch/pytorch#193227): most of a many-site model's first
compile. The answer depends only on the kernel and on what TTIR generation sees of the arguments,
so :func:`install` caches it on exactly that, for mhc's kernels only (other kernels, TMA
descriptors and arguments that cannot be keyed go straight through). Installed at the first trace
of an ``mhc`` op (:mod:`mhc.ops.library`); ``ENABLED = False`` (tests) leaves PyTorch alone.
"""

from __future__ import annotations

import copy
import functools

import torch

__all__ = ["install", "installed"]

# PyTorch's analysis, by version: the first one its module has is wrapped
_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")

_CACHE: dict = {}
ENABLED = True  # False: install() leaves PyTorch's analysis as it is (comparisons in the tests)


def _jit_function(kernel):
    """The ``JITFunction`` inside ``kernel`` (an autotuner or heuristics around one, or itself);
    ``None`` for anything else (the interpreter's kernels too)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        if not hasattr(kernel, "fn"):
            return None
        kernel = kernel.fn
    return kernel


def _is_own(jit_function) -> bool:
    return getattr(jit_function.fn, "__module__", "").startswith("mhc.")


def _argument_key(value):
    """What the TTIR generation sees of one argument, hashable; ``None`` when it cannot be keyed."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor) or type(value).__name__ == "TensorBox":
        return ("tensor", value.dtype)
    if isinstance(value, torch.Tensor):  # a real tensor is passed on: Triton sees its alignment
        try:
            return ("tensor", value.dtype, value.data_ptr() % 16 == 0)
        except RuntimeError:  # a wrapper subclass without storage
            return None
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(value).__module__.startswith("sympy"):
        return ("symbolic",)
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


def _call_key(kernel, kwargs, tma_descriptor_metadata):
    """The key of one analysis, or ``None`` to leave it to PyTorch. Dynamo wraps a kernel launched
    with ``num_warps`` in a new one-config autotuner at every call, so the key holds the
    ``JITFunction`` inside, and the first config's arguments, which the TTIR generation adds."""
    jit_function = _jit_function(kernel)
    if tma_descriptor_metadata or jit_function is None or not _is_own(jit_function):
        return None
    configs = getattr(kernel, "configs", None)
    if configs:
        kwargs = {**kwargs, **configs[0].kwargs}
    key = [id(jit_function)]
    for name in sorted(kwargs):
        arg = _argument_key(kwargs[name])
        if arg is None:
            return None
        key += (name, arg)
    return tuple(key)


def _cached(analysis):
    # ``(kernel, kwargs, tma_descriptor_metadata)``; PyTorch before 2.6 passes no TMA metadata
    @functools.wraps(analysis)
    def analyse(kernel, kwargs, *rest, **options):
        key = None if len(rest) > 1 or options else _call_key(kernel, kwargs, rest[0] if rest else None)
        if key is None:
            return analysis(kernel, kwargs, *rest, **options)
        if key not in _CACHE:
            # the JITFunction is kept with its answer: the key holds its id
            _CACHE[key] = (_jit_function(kernel), analysis(kernel, kwargs, *rest))
        return copy.deepcopy(_CACHE[key][1])  # callers get their own copy, as from PyTorch

    analyse.mhc_uncached = analysis
    return analyse


def installed() -> bool:
    """Whether PyTorch's write analysis goes through the cache."""
    module = _module()
    return module is not None and any(hasattr(getattr(module, name, None), "mhc_uncached") for name in _ANALYSES)


def _module():
    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return None
    return triton_kernel_wrap


def install() -> None:
    """Wrap PyTorch's write analysis with the cache (once; nothing where PyTorch has neither
    analysis, or without :data:`ENABLED`). Its callers look it up in its module at each call, so
    replacing the module's attribute reaches them all."""
    module = _module()
    if module is None or not ENABLED or installed():
        return
    for name in _ANALYSES:
        analysis = getattr(module, name, None)
        if analysis is not None:
            setattr(module, name, _cached(analysis))
            return
