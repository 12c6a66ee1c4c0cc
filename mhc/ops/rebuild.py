"""How an op's backward rebuilds the streams it did not save: the op-level half of
:func:`mhc.memory.recompute_streams` (arXiv 2512.24880, section 4.3; ``docs/recompute.md``).

A :class:`Plan` is what a site's Functions get in place of streams (the block's first streams and
the post-mix steps since; :func:`function_args`). :class:`StreamsAt` caches the rebuilt streams in
the backward, each position built once and freed after its last reader. Under ``torch.compile``
each Function rebuilds from the block's first streams (``mhc::stream_recompute``), and *links*
between them let common-subexpression elimination merge the repeats. The reference path runs
under saved-tensor hooks (:func:`reference_scope`) that swap saved streams for rebuilding handles.
"""

from __future__ import annotations

import contextlib

import torch

from mhc._autocast import autocast_restored, autocast_state
from mhc._compat import top_saved_tensor_hooks

__all__ = ["StreamsAt", "Plan", "reference_scope", "note_conversion", "function_args", "function_outputs", "steps_of"]


class StreamsAt:
    """The streams at one position ``p >= 1`` of a block, rebuilt at most once in the backward.

    ``previous`` is the position before (``None`` for position 1, whose previous streams are the
    block's first, saved as they are). A position keeps the one before alive, so the rebuilt
    streams of a block live until the backward has passed them."""

    __slots__ = ("previous", "value")

    def __init__(self, previous: StreamsAt | None):
        self.previous, self.value = previous, None

    def get(self, start: torch.Tensor, steps, step):
        """The streams at this position: ``start`` advanced by ``steps`` (``p`` tuples of ``step``'s
        arguments after the streams), reusing and filling the cache of every position below."""
        missing, known = [], self
        while known is not None and known.value is None:
            missing.append(known)
            known = known.previous
        x = start if known is None else known.value
        for at, args in zip(reversed(missing), steps[len(steps) - len(missing) :]):
            x = step(x, *args)
            at.value = x
        return x


class Plan:
    """How a site's Functions get streams they do not save: the block's first streams ``start``, the
    steps since (``(h_res, y, h_post)``), the backward's cache ``at`` (``None`` under
    ``torch.compile``), the ``schedule`` holding the block's link, the streams' ``version`` counter
    when read (eager), and the forward's ``autocast`` state (the reference post-mix is an autocast op)."""

    __slots__ = ("start", "steps", "at", "schedule", "version", "autocast")

    def __init__(self, start, steps, at, schedule, version):
        self.start, self.steps, self.at, self.schedule, self.version = start, steps, at, schedule, version
        self.autocast = None if torch.compiler.is_compiling() else autocast_state(start.device.type)

    def recipe(self) -> tuple:
        """``(start, h_res_1, y_1, h_post_1, ...)``: the tensors to save, flat."""
        return (self.start, *(t for step in self.steps for t in step))


def function_args(plan: Plan | None) -> tuple:
    """The trailing arguments of a fused Function (:mod:`mhc.ops.mixing`): ``(at, linked, link,
    *recipe)`` in recompute mode, none (the defaults: save the streams) without a plan."""
    if plan is None:
        return ()
    linked = torch.compiler.is_compiling()
    return (plan.at, linked, plan.schedule.link if linked else None, *plan.recipe())


def function_outputs(plan: Plan | None, outputs, single: bool = False):
    """A fused Function's outputs without the link that a linked one returns last (kept as the
    block's link for the next Function); ``single``: the Function returns one tensor."""
    if plan is None or not torch.compiler.is_compiling():
        return outputs
    plan.schedule.link = outputs[-1]
    return outputs[0] if single else outputs[:-1]


def steps_of(recipe) -> list:
    """The steps of a flat recipe (the inverse of :meth:`Plan.recipe` after ``start``)."""
    return [tuple(recipe[i : i + 3]) for i in range(1, len(recipe), 3)]


# ------------------------------------------------------------------------------ reference path


class _Rebuild:
    """What a reference-path op saved in place of a tensor sharing the streams' memory: ``layout``
    (shape, strides) of the streams, ``geometry`` (size, strides, offset) of the saved tensor in
    them, and the dtype of the source it views (the streams or a conversion of them)."""

    __slots__ = ("plan", "layout", "geometry", "dtype")

    def __init__(self, plan, layout, geometry, dtype):
        self.plan, self.layout, self.geometry, self.dtype = plan, layout, geometry, dtype


class _Outer:
    """What the enclosing saved-tensor hooks (offloading, counting) packed of any other tensor."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


@contextlib.contextmanager
def reference_scope(plan: Plan | None, x: torch.Tensor, step, compiled: str = "raise"):
    """Run PyTorch ops on streams ``x`` so that what they save of ``x`` (views, and conversions from
    :func:`note_conversion`) is rebuilt from ``plan`` in the backward; ``step``: the post-mix. Under
    ``torch.compile`` (no saved-tensor hooks) ``compiled="raise"`` raises, ``"keep"`` saves ``x``."""
    if plan is None or (compiled == "keep" and torch.compiler.is_compiling()):
        yield
        return
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "recompute_streams on the reference path (backend='torch') runs in eager mode only: it saves "
            "through saved-tensor hooks. Compile with backend='triton' sites, or turn it off with "
            "recompute_streams(model, every=1)"
        )
    sources = {x.untyped_storage().data_ptr(): x}
    layout = (tuple(x.shape), tuple(x.stride()))
    outer = top_saved_tensor_hooks()  # what is not the streams still goes through them

    def pack(t):
        source = sources.get(t.untyped_storage().data_ptr()) if t.device == x.device else None
        changed = source is x and x._version != plan.version  # modified in place since the site read it
        if source is None or changed or t.storage_offset() < source.storage_offset():
            return t if outer is None else _Outer(outer[0](t))
        geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - source.storage_offset())
        return _Rebuild(plan, layout, geometry, source.dtype)

    def unpack(saved):
        if isinstance(saved, _Outer):
            return outer[1](saved.packed)
        if not isinstance(saved, _Rebuild):
            return saved
        p = saved.plan
        with autocast_restored(p.autocast):
            base = p.at.get(p.start, p.steps, step)
        shape, stride = saved.layout
        if base.dtype != saved.dtype or base.stride() != stride or base.storage_offset() != 0:
            base = torch.empty_strided(shape, stride, dtype=saved.dtype, device=base.device).copy_(base)
        size, strides, offset = saved.geometry
        return base.as_strided(size, strides, offset)

    _CONVERSIONS.append(sources)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _CONVERSIONS.pop()


_CONVERSIONS: list = []  # the open reference scopes' {storage: source} maps


def note_conversion(x: torch.Tensor, converted: torch.Tensor) -> None:
    """``converted`` is ``x.to(dtype)``: inside a :func:`reference_scope` over ``x``, what ops save
    of it is rebuilt too."""
    if _CONVERSIONS and converted is not x:
        sources = _CONVERSIONS[-1]
        if x.untyped_storage().data_ptr() in sources:
            sources[converted.untyped_storage().data_ptr()] = converted
