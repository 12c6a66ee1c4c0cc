"""Triton's interpreter without its per-call re-patching of ``triton.language`` (test speed only).

With ``TRITON_INTERPRET=1`` a kernel launch patches the ``triton.language`` modules that the
kernel's globals name (their builtins become NumPy-backed functions), runs the grid, and restores
them. Every call of a ``@triton.jit`` device function from inside the kernel patches again: it
walks the modules' members with ``inspect.getmembers`` (about 0.3 ms), though they are patched
already and the walk changes nothing that is still unpatched. The kernels call small device
functions in loops (a Sinkhorn backward: thousands of calls per launch), and in the recompute and
Sinkhorn tests this walk was about 45% of the run time.

:func:`install` keeps the first patch of a launch and skips a device function's when every module
it would patch is patched already in that launch; a device function that names another module
(``triton.language.core`` through Triton's own helpers) is patched as before. The kernels compute
exactly what they did. Nothing is installed where the interpreter's internals differ from what
this expects.

It also remembers the NumPy dtype of each Triton type (``_get_np_dtype`` builds its table of
twenty types at each of its calls, hundreds of thousands per test).
"""

from __future__ import annotations

import functools
import inspect


def install() -> bool:
    """Patch the interpreter in this process; returns whether it was patched."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or executor is None or scope_type is None or getattr(original, "_mhc_cached", False):
        return False
    patched: set[int] = set()  # ids of the modules patched in the launch running now

    @functools.lru_cache(maxsize=None)
    def modules_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        wanted = modules_of(fn)
        if patched and wanted <= patched:
            return scope_type()  # nothing to change and nothing to restore
        scope = original(fn)
        patched.update(wanted)
        return scope

    launch = executor.__call__

    def call(self, *args, **kwargs):
        outer = set(patched)
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()
            patched.update(outer)

    patch_lang._mhc_cached, patch_lang._mhc_original, call._mhc_original = True, original, launch
    interpreter._patch_lang = patch_lang
    executor.__call__ = call
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        interpreter._get_np_dtype = _remembered(np_dtype)
    return True


def _remembered(fn):
    """``fn`` of a Triton type, computed once per type (equal types give equal NumPy dtypes)."""
    known = {}

    def remembered(tt_dtype):
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = result = fn(tt_dtype)
            return result
        except TypeError:  # a type that cannot be hashed
            return fn(tt_dtype)

    remembered._mhc_original = fn
    return remembered
