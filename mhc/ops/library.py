"""How the Triton launchers become ``torch.library`` ops that ``torch.compile`` and ``torch.export``
trace.

``torch.library.triton_op`` registers an op whose body the compiler traces: the
Triton kernels it launches through ``torch.library.wrap_triton`` appear in the compiled graph and
Inductor launches them from its own generated code (Python, ``cpp_wrapper`` C++ or an AOTInductor
package), with no Python op wrapper or launcher of ours per kernel. ``torch.library.custom_op`` is
opaque: the compiled graph calls back into Python for every op. :func:`kernel_op` registers a
launcher as a ``triton_op`` where it can and as a ``custom_op`` otherwise:

- ``TRITON_INTERPRET=1``: the interpreter's kernels cannot be traced (they are not compiled
  ``JITFunction``\\ s) and Inductor would compile them for the CPU;
- ``MHC_TRITON_OP=0``: the opaque ops on purpose (comparison, debugging);
- no Triton installed (nothing launches then anyway).

While a ``triton_op``'s body runs (traced with fake tensors, or eagerly), the kernel layer's
:data:`mhc.kernels._launch.tracing` is set and :func:`mhc.kernels._launch.launch` goes through
``wrap_triton`` instead of its cached launcher, which reads data pointers that fake tensors do not
have. Outside the ops (eager mode)
nothing changes.

The first trace of an op (its fake implementation, or a ``triton_op``'s body) installs the two
wrappers of PyTorch internals that act on ``mhc``'s graph pieces only (never at import,
``docs/architecture.md``): :mod:`mhc._compat.write_analysis` (PyTorch analyses which arguments a
traced kernel writes once per kernel specialization instead of several times per call, which would
otherwise dominate the compile time of a model with many sites) and
:func:`mhc._compat.backport_checkpoint_tags` (checkpointed regions under ``torch.compile`` on
PyTorch < 2.12).
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
    """Register the launcher ``fn`` as the op ``name`` (``"mhc::..."``, no argument mutated):
    a ``triton_op`` where :data:`TRITON_OP`, else a ``custom_op`` with the fake implementation
    ``fake`` (a ``triton_op`` derives its own by running ``fn`` on fake tensors).

    ``opaque``: always a ``custom_op``, one node of the compiled graph. Identical calls of such an
    op are merged by the graph's common-subexpression pass; a ``triton_op``'s calls never are, since
    each allocates its output with ``aten.empty``, which that pass leaves alone."""

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
