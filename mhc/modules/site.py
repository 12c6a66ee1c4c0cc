"""A hyper-connection site: ``x_in, finish = site.split(x)`` mixes the streams into the branch input,
``finish(y)`` merges the branch output back into them (``docs/architecture.md``).

:class:`Site` holds what every site shares; :class:`mhc.mixing.HyperConnection` is the one users
build. The path (:func:`mhc.ops.path.choose`) is the reference (:class:`ReferenceFinish`) or the
fused kernels (:class:`FusedFinish`). ``finish(y, next=site_2)`` returns ``site_2.split(finish(y))``;
on the fused path, when ``site_2`` has dynamic mHC coefficients, as one autograd op, the *seam*
(:class:`mhc.ops.mixing.MHCSeamFunction`).
"""

from __future__ import annotations

import contextlib

import torch

from mhc import reference
from mhc._checks import check_same_device, check_site_input
from mhc._compat import materialized
from mhc.ops.local import as_dtensor, local_like, local_parameters, local_tokens
from mhc.ops.mixing import MHCSeamFunction, PostMixFunction
from mhc.ops.path import choose
from mhc.ops.rebuild import function_args, function_outputs

__all__ = ["Site", "ReferenceFinish", "FusedFinish", "KeepStreams", "KEEP_STREAMS"]


class KeepStreams:
    """A site's default ``_recompute`` hook: every Function saves the streams it reads.

    A memory strategy replaces it with an object that answers the same calls
    (:class:`mhc.memory.recompute.StreamRecompute`): ``plan`` (how the site's Functions get
    streams they do not save; ``None``: save them), ``begin`` / ``passes`` (the streams a site
    read or passed on), ``continues`` and ``advance`` (a post-mix made new streams), ``next_at``
    (where the backward caches the streams after a step)."""

    def plan(self, x, path):
        return None

    def begin(self, x, path) -> None:
        pass

    def passes(self, x, x_pass) -> None:
        pass

    def continues(self, x) -> bool:
        return False

    def next_at(self):
        return None

    def advance(self, x, step, out, at, site=None) -> None:
        pass

    def scope(self, plan, x, step, compiled: str = "raise"):
        """The context PyTorch ops of a site run in on streams ``x``; ``step`` is the post-mix
        that rebuilds them. Here nothing: the ops save what they save."""
        return contextlib.nullcontext()


KEEP_STREAMS = KeepStreams()


def branch_output(out, shape, device, layout=None):
    """``(y, rest)``: a branch may return a tensor, or a tuple / list whose first element is the
    tensor mixed into the streams (attention modules returning weights or a cache). With the
    streams' ``layout`` a ``DTensor`` ``y`` becomes the local shard of their tokens."""
    rest = ()
    if isinstance(out, (tuple, list)):
        if len(out) == 0:
            raise ValueError("the branch returned an empty tuple; its first element must be the output tensor")
        out, rest = out[0], tuple(out[1:])
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the branch must return a torch.Tensor (or a tuple starting with one), got {type(out).__name__}"
        )
    out = local_like(out, layout, "the branch output")
    if out.shape != shape:
        raise ValueError(f"branch output must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.is_floating_point():
        raise TypeError(f"branch output must be a floating-point tensor, got {out.dtype}")
    check_same_device(out, device, "branch output", "the streams")
    return out, rest


def _returned(rest, *values):
    """``finish``'s result: the values alone, or a tuple with the branch's extras after them."""
    if len(values) == 1 and not rest:
        return values[0]
    return (*values, *rest)


class Site:
    """What every hyper-connection site shares: the checks, the choice of path and the recorder.

    A subclass (an ``nn.Module``) sets the attributes declared below and defines
    :meth:`mixing_parameters`: :class:`mhc.modules.hyper_connection.HyperConnection` in its
    ``__init__``, :func:`mhc.integrations.transformers.patch_deepseek_v4` from V4's config."""

    n_streams: int
    dim: int
    backend: str  # "auto", "triton" or "torch" (mhc.ops.path.choose)
    sinkhorn_iters: int
    backward: str  # the Sinkhorn backward, "exact" or "implicit"
    rms_eps: float
    hc_eps: float
    source: object  # where the coefficients come from: a source of mhc.modules.coefficients
    _recorder: tuple | None = None  # the lists of the open mhc.mixing.collect_h_res blocks
    _recompute = KEEP_STREAMS  # the memory strategy's hook (mhc.memory.recompute)
    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites
    _layout = None  # the TokenLayout of the DTensor streams this site runs on (mhc.ops.local)

    def mixing_parameters(self):
        """``(phi, alpha, bias)``: the projection, the gates ``alpha [3] = (a_pre, a_post, a_res)``
        and the biases ``bias [2n + n*n] = [b_pre | b_post | vec(b_res)]`` (``phi`` and ``alpha``
        ``None`` for static sources), in any float dtype."""
        raise NotImplementedError

    def compute_parameters(self):
        """:meth:`mixing_parameters` as the ops take them: the local tensors of ``DTensor``
        parameters (:mod:`mhc.ops.local`), else the parameters themselves."""
        return local_parameters(self, self.mixing_parameters(), self._layout)

    def coefficients(self, x: torch.Tensor):
        """``(h_pre [..., n], h_post [..., n], h_res [..., n, n])`` in fp32 (fp64 on the reference
        path for fp64 activations or parameters) for streams ``x [..., n, dim]`` (local tensors for
        a ``DTensor`` ``x``: its tokens' coefficients on this rank)."""
        x, layout = local_tokens(x, 2, type(self).__name__)
        self._set_layout(layout)
        check_site_input(x, self.n_streams, self.dim, self.mixing_parameters())
        n, lead = self.n_streams, x.shape[:-2]
        if (
            self.source is not None
            and self.source.fused_coefficients
            and choose(self.backend, x, "mixing", n) == "triton"
        ):
            _, h_pre, h_post, h_res, _ = self.source.fused_start(self, x)
            return h_pre.view(*lead, n), h_post.view(*lead, n), h_res.view(*lead, n, n)
        return self.source.reference(self, x)

    def split(self, x: torch.Tensor):
        """Two-step form for blocks that cannot be wrapped.

        ``x_in, finish = site.split(x)``; ``x_in [..., dim]`` is the branch input; after computing
        ``y = branch(x_in)``, ``finish(y) [..., n, dim]`` is the site's output, and
        ``finish(y, next=site_2)`` is ``site_2.split(finish(y))`` (see :mod:`mhc.modules.site`). If ``y``
        is a tuple (or list), its first element is mixed into the streams and the extras follow
        the result: ``(streams, *y[1:])``, or ``(x_in_2, finish_2, *y[1:])`` with ``next``.

        ``DTensor`` streams sharded over their tokens run as their local shards; ``x_in`` and the
        streams ``finish`` returns are ``DTensor``\\ s of the same layout (:mod:`mhc.ops.local`)."""
        return self._split(x)

    def _split(self, x: torch.Tensor, layout=None):
        """:meth:`split` of streams ``x``, or of the local streams ``x`` of ``layout`` (a chained
        site hands over its output's)."""
        if layout is None:
            x, layout = local_tokens(x, 2, type(self).__name__)
        self._set_layout(layout)
        path = choose(self.backend, x, "mixing", self.n_streams)
        check_site_input(x, self.n_streams, self.dim, self.mixing_parameters())
        schedule = self._recompute
        plan = schedule.plan(x, path)
        if path == "triton":
            x_in, _, h_post, h_res, x_pass = self.source.fused_start(self, x, plan, with_h_pre=False)
            schedule.begin(x_pass, path) if plan is None else schedule.passes(x, x_pass)
            return self._fused_finish(x_in, h_post, h_res, x_pass, plan)
        with schedule.scope(plan, x, reference.post_mix):
            h_pre, h_post, h_res = self.source.reference(self, x)
            x_in = reference.pre_mix(x, h_pre)
        if plan is None:
            schedule.begin(x, path)
        self._record(h_res)
        return as_dtensor(x_in, layout), ReferenceFinish(self, x, h_post, h_res, plan, layout)

    def _set_layout(self, layout) -> None:
        # written only when it changes: an attribute written inside a checkpointed region is a side
        # effect that torch.compile cannot trace there (the region would run uncompiled)
        if self._layout is not layout:
            self._layout = layout

    def _fused_finish(self, x_in, h_post, h_res, x_pass, plan):
        if self._recorder is not None:  # the reshape only while recording: it costs host time per site
            n = self.n_streams
            self._record(h_res.expand(h_post.shape[0], n, n).reshape(*x_pass.shape[:-2], n, n))
        layout = self._layout
        return as_dtensor(x_in, layout), FusedFinish(self, x_pass, h_post, h_res, plan, layout)

    def _record(self, h_res: torch.Tensor) -> None:
        for records in self._recorder or ():
            records.append(h_res.detach())

    def _check_next(self, next) -> None:
        if not isinstance(next, Site):
            raise TypeError(f"next must be a HyperConnection (an mhc site), got {type(next).__name__}")
        if (next.n_streams, next.dim) != (self.n_streams, self.dim):
            raise ValueError(
                f"next must have the same n_streams and dim as this site ({self.n_streams}, {self.dim}), "
                f"got ({next.n_streams}, {next.dim})"
            )


class ReferenceFinish:
    """``finish`` of the reference path: ``out[i] = sum_j h_res[i, j] x[j] + h_post[i] y``."""

    def __init__(self, site: Site, x, h_post, h_res, plan=None, layout=None):
        self.site, self.x, self.h_post, self.h_res, self.plan = site, x, h_post, h_res, plan
        self.layout = layout

    def __call__(self, y, next: Site | None = None):
        x = self.x
        y, rest = branch_output(y, x.shape[:-2] + x.shape[-1:], x.device, self.layout)
        if next is not None:
            self.site._check_next(next)
        schedule = self.site._recompute
        with schedule.scope(self.plan, x, reference.post_mix):
            out = reference.post_mix(x, self.h_res, y, self.h_post)
        last = self.site if next is None else None
        schedule.advance(x, (self.h_res, y, self.h_post), out, schedule.next_at(), last)
        if next is None:
            return _returned(rest, as_dtensor(out, self.layout))
        return _returned(rest, *next._split(out, self.layout))


class FusedFinish:
    """``finish`` of the fused path: the post-mix, or with ``next`` the seam op when the next
    site's coefficients are dynamic mHC. Streams keep their leading dims; the coefficients are per
    flattened token. ``plan``: how the site's Functions rebuild ``x_pass`` in recompute mode."""

    def __init__(self, site: Site, x_pass, h_post, h_res, plan=None, layout=None):
        self.site, self.x_pass, self.h_post, self.h_res, self.plan = site, x_pass, h_post, h_res, plan
        self.layout = layout

    def __call__(self, y, next: Site | None = None):
        site, x, layout = self.site, self.x_pass, self.layout
        y, rest = branch_output(y, x.shape[:-2] + x.shape[-1:], x.device, layout)
        y = materialized(y)  # the kernels read its pointer
        schedule = site._recompute
        if next is None:
            return _returned(rest, as_dtensor(self._post_mix(y, schedule), layout))
        site._check_next(next)
        if not (next.source.fused_coefficients and choose(next.backend, x, "mixing", site.n_streams) == "triton"):
            return _returned(rest, *next._split(self._post_mix(y, schedule, next), layout))
        next._set_layout(layout)
        settings = (next.sinkhorn_iters, next.backward, next.rms_eps, next.hc_eps, False)  # False: no h_pre
        args = (x, y, self.h_post, self.h_res, *next.source.fused_parameters(next), *settings)
        continues = next._recompute is schedule and schedule.continues(x)
        outputs, next_at = self._seam(args, schedule, continues)
        x_in, _, h_post, h_res, x_pass = outputs
        plan = None
        if continues:
            schedule.advance(x, (self.h_res, y, self.h_post), x_pass, next_at)
            plan = schedule.plan(x_pass, "triton")
        else:
            next._recompute.begin(x_pass, "triton")
        return _returned(rest, *next._fused_finish(x_in, h_post, h_res, x_pass, plan))

    def _seam(self, args, schedule, continues):
        """The seam: ``(outputs, next_at)``. Its ``x`` is saved, or rebuilt from the plan; the next
        site's streams are saved when they start a block (always without recompute) and otherwise
        rebuilt from ``x``: cached at ``next_at`` in eager mode, linked under torch.compile."""
        next_at = schedule.next_at() if continues else None
        at, linked, link, *recipe = function_args(self.plan) or (None, False, None)
        if continues and self.plan is None and torch.compiler.is_compiling():
            linked, link = True, schedule.link  # x is saved, but x_next is rebuilt from it
        outputs = MHCSeamFunction.apply(*args, at, linked, link, next_at, not continues, *recipe)
        if linked:
            schedule.link, outputs = outputs[-1], outputs[:-1]
        return outputs, next_at

    def _post_mix(self, y, schedule, next=None):
        outputs = PostMixFunction.apply(self.x_pass, y, self.h_post, self.h_res, *function_args(self.plan))
        out = function_outputs(self.plan, outputs, single=True)
        last = self.site if next is None else None  # a site chained to another is not the last
        schedule.advance(self.x_pass, (self.h_res, y, self.h_post), out, schedule.next_at(), last)
        return out
