"""The Triton launchers as ``torch.library`` ops that ``torch.compile`` and ``torch.export`` trace.

:func:`kernel_op` registers a launcher as a ``triton_op`` (Inductor launches its kernels from its
own generated code) where it can, and as an opaque ``custom_op`` under ``TRITON_INTERPRET=1``,
with ``MHC_TRITON_OP=0`` or without Triton (``docs/compile.md``). While a ``triton_op``'s body
runs, :func:`mhc.kernels._launch.launch` goes through ``wrap_triton``. The first trace installs
the two wrappers of ``docs/architecture.md`` ("What ``import mhc`` changes outside ``mhc``").
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from mhc import _compat
from mhc._compat import write_analysis as _write_analysis

__all__ = ["TRITON_OP", "REGISTERED", "kernel_op", "kernels"]

TRITON_OP = (
    os.environ.get("TRITON_INTERPRET", "0") != "1"
    and os.environ.get("MHC_TRITON_OP", "1") != "0"
    and importlib.util.find_spec("triton") is not None
)

REGISTERED: list[str] = []  # the names of the ops registered so far ("mhc::...")

_traced = False


def _first_trace() -> None:
    """Install the wrappers that only a traced graph needs, once (module docstring)."""
    global _traced
    if not _traced:
        _traced = True
        _write_analysis.install()
        _compat.backport_checkpoint_tags()


def kernels():
    """:mod:`mhc.kernels`, imported on first use: CPU-only users of the reference never need Triton."""
    import mhc.kernels

    return mhc.kernels


def kernel_op(name: str, fake, opaque: bool = False):
    """Register the launcher ``fn`` as the op ``name`` (``"mhc::..."``, no argument mutated): a
    ``triton_op`` where :data:`TRITON_OP`, else a ``custom_op`` with the fake implementation ``fake``.
    ``opaque``: always a ``custom_op``, whose identical calls the compiled graph's common-subexpression
    pass merges (it leaves a ``triton_op``'s ``aten.empty`` outputs alone)."""

    def register(fn):
        REGISTERED.append(name)
        if opaque or not TRITON_OP:
            op = torch.library.custom_op(name, fn, mutates_args=())

            @functools.wraps(fake)
            def traced(*args):
                _first_trace()
                return fake(*args)

            op.register_fake(traced)
            return op

        @functools.wraps(fn)
        def body(*args):
            from mhc.kernels._launch import traced_launches  # the body runs only where Triton is

            _first_trace()
            with traced_launches():
                return fn(*args)

        return torch.library.triton_op(name, body, mutates_args=())

    return register
