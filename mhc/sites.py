"""Which path runs a hyper-connection site, and how one site hands over to the next.

A *site* is one hyper-connection around one branch: ``x_in, finish = site.split(x)`` mixes the
streams into the branch input, ``finish(y)`` merges the branch output back into the streams.
:class:`Site` holds the part every site shares; :class:`mhc.mixing.HyperConnection` is the site
users build, and :mod:`mhc.integrations` adapt other models' modules to it.

Two paths, chosen per call by :func:`layer_backend`:

- the reference path (``"torch"``): coefficients from ``site.source.reference`` and the mixes as
  ``einsum``; :class:`ReferenceFinish`;
- the fused path (``"triton"``): ``site.source.fused_start`` (for dynamic mHC one kernel computes
  the coefficients and the pre-mix) and the post-mix kernel; :class:`FusedFinish`.

``finish(y, next=site_2)`` ends this site and starts the next one, returning ``site_2``'s
``(x_in, finish)``: the same values as ``site_2.split(finish(y))``. On the fused path, when the
next site has dynamic mHC coefficients, the two steps run as one autograd op, the *seam*
(:class:`mhc.mixing_ops.MHCSeamFunction`: one node and one set of saved tensors per boundary
instead of two). Everywhere else ``next=`` composes the two steps.
"""

from __future__ import annotations

import torch
from einops import einsum

from mhc._checks import MAX_STREAMS, check_local, check_no_transform, check_same_device, check_streams_shape
from mhc._compat import materialized, transforms_active
from mhc._local import local_parameters
from mhc.layer import _kernels
from mhc.mixing_ops import MHCSeamFunction, PostMixFunction
from mhc.rebuild import function_args, function_outputs, reference_scope

__all__ = ["Site", "ReferenceFinish", "FusedFinish", "layer_backend"]


def layer_backend(x: torch.Tensor, n: int, backend: str) -> str:
    """The path of a whole mixing layer: ``"auto"`` is the fused kernels on CUDA for
    ``n <= MAX_STREAMS`` and the PyTorch reference otherwise (and under ``torch.func`` transforms
    or forward-mode AD, which the fused autograd Functions cannot run under)."""
    if backend == "auto":
        return "triton" if x.is_cuda and n <= MAX_STREAMS and not transforms_active() else "torch"
    if backend == "triton":
        if n > MAX_STREAMS:
            raise ValueError(f"the fused mixing kernels take n <= {MAX_STREAMS} streams, got {n}; use backend='torch'")
        check_no_transform("the fused path (backend='triton')")
        _kernels().check_device(x)
    return backend


def branch_output(out, shape, device):
    """``(y, rest)``: a branch may return a tensor, or a tuple / list whose first element is the
    tensor mixed into the streams (attention modules returning weights or a cache)."""
    rest = ()
    if isinstance(out, (tuple, list)):
        if len(out) == 0:
            raise ValueError("the branch returned an empty tuple; its first element must be the output tensor")
        out, rest = out[0], tuple(out[1:])
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the branch must return a torch.Tensor (or a tuple starting with one), got {type(out).__name__}"
        )
    if out.shape != shape:
        raise ValueError(f"branch output must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.is_floating_point():
        raise TypeError(f"branch output must be a floating-point tensor, got {out.dtype}")
    check_same_device(out, device, "branch output", "the streams")
    return out, rest


def reference_pre_mix(x, h_pre):
    """The reference pre-mix ``x_in = sum_s h_pre[s] x[s]`` in ``x``'s dtype."""
    if x.dtype == torch.float32:
        # a broadcast sum: einsum's batched matmul of m = 1 has a far slower backward on CPUs
        return (h_pre.to(x.dtype).unsqueeze(-1) * x).sum(-2)
    # 16-bit streams: the matmul accumulates in fp32 and rounds once, not every product
    return einsum(h_pre.to(x.dtype), x, "... s, ... s d -> ... d")


def reference_post_mix(x, h_res, y, h_post):
    """The reference post-mix ``out[i] = sum_j h_res[i, j] x[j] + h_post[i] y`` in ``x``'s dtype (also
    the step that rebuilds streams on the reference path)."""
    dtype = x.dtype
    mixed = einsum(h_res.to(dtype), x, "... t s, ... s d -> ... t d")
    # the outer product by broadcasting: einsum makes it a batched matmul of k = 1, far slower on CPUs
    return mixed + h_post.to(dtype).unsqueeze(-1) * y.to(dtype).unsqueeze(-2)


def _returned(rest, *values):
    """``finish``'s result: the values alone, or a tuple with the branch's extras after them."""
    if len(values) == 1 and not rest:
        return values[0]
    return (*values, *rest)


class Site:
    """What every hyper-connection site shares: the checks, the choice of path and the recorder.

    A subclass provides ``n_streams``, ``dim``, ``backend``, ``sinkhorn_iters``, ``backward``,
    ``rms_eps``, ``hc_eps``, ``source`` (an :mod:`mhc.coefficients` source), ``_recorder``
    (``None``, or the tuple of lists that the open :func:`mhc.mixing.collect_h_res` blocks set) and
    :meth:`mixing_parameters`. ``_recompute`` is the model's :class:`mhc.rebuild.StreamRecompute`
    (``None``: the site saves its streams), set by :func:`mhc.recompute.recompute_streams`.
    """

    _recompute = None
    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def mixing_parameters(self):
        """``(phi, alpha, bias)``: the projection, the gates ``alpha [3] = (a_pre, a_post, a_res)``
        and the biases ``bias [2n + n*n] = [b_pre | b_post | vec(b_res)]`` (``phi`` and ``alpha``
        ``None`` for static sources), in any float dtype."""
        raise NotImplementedError

    def compute_parameters(self):
        """:meth:`mixing_parameters` as the ops take them: the local tensors of a sequence-parallel
        site's ``DTensor`` parameters (:mod:`mhc._local`), else the parameters themselves."""
        return local_parameters(self, self.mixing_parameters())

    def coefficients(self, x: torch.Tensor):
        """``(h_pre [..., n], h_post [..., n], h_res [..., n, n])`` in fp32 (fp64 on the reference
        path for fp64 activations or parameters) for streams ``x [..., n, dim]``."""
        self._check_input(x)
        n, lead = self.n_streams, x.shape[:-2]
        if self.source is not None and self.source.fused_coefficients and layer_backend(x, n, self.backend) == "triton":
            _, h_pre, h_post, h_res, _ = self.source.fused_start(self, x)
            return h_pre.view(*lead, n), h_post.view(*lead, n), h_res.view(*lead, n, n)
        return self.source.reference(self, x)

    def split(self, x: torch.Tensor):
        """Two-step form for blocks that cannot be wrapped.

        ``x_in, finish = site.split(x)``; ``x_in [..., dim]`` is the branch input; after computing
        ``y = branch(x_in)``, ``finish(y) [..., n, dim]`` is the site's output, and
        ``finish(y, next=site_2)`` is ``site_2.split(finish(y))`` (see :mod:`mhc.sites`). If ``y``
        is a tuple (or list), its first element is mixed into the streams and the extras follow
        the result: ``(streams, *y[1:])``, or ``(x_in_2, finish_2, *y[1:])`` with ``next``.
        """
        self._check_input(x)
        path = layer_backend(x, self.n_streams, self.backend)
        schedule = self._recompute
        plan = None if schedule is None else schedule.plan(x, path)
        if path == "triton":
            x_in, _, h_post, h_res, x_pass = self.source.fused_start(self, x, plan, with_h_pre=False)
            if schedule is not None:
                schedule.begin(x_pass, path) if plan is None else schedule.passes(x, x_pass)
            return self._fused_finish(x_in, h_post, h_res, x_pass, plan)
        with reference_scope(plan, x, reference_post_mix):
            h_pre, h_post, h_res = self.source.reference(self, x)
            x_in = reference_pre_mix(x, h_pre)
        if schedule is not None and plan is None:
            schedule.begin(x, path)
        self._record(h_res)
        return x_in, ReferenceFinish(self, x, h_post, h_res, plan)

    def _check_input(self, x) -> None:
        # every parameter: the kernels take their addresses as they are (no driver check per launch)
        check_streams_shape(x, self.n_streams, self.dim, "x")
        check_local(x, self)
        for p in self.mixing_parameters():
            if p is not None:
                check_same_device(x, p.device, "x", "the layer's parameters")

    def _fused_finish(self, x_in, h_post, h_res, x_pass, plan):
        if self._recorder is not None:  # the reshape only while recording: it costs host time per site
            n = self.n_streams
            self._record(h_res.expand(h_post.shape[0], n, n).reshape(*x_pass.shape[:-2], n, n))
        return x_in, FusedFinish(self, x_pass, h_post, h_res, plan)

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

    def __init__(self, site: Site, x, h_post, h_res, plan=None):
        self.site, self.x, self.h_post, self.h_res, self.plan = site, x, h_post, h_res, plan

    def __call__(self, y, next: Site | None = None):
        x = self.x
        y, rest = branch_output(y, x.shape[:-2] + x.shape[-1:], x.device)
        if next is not None:
            self.site._check_next(next)
        with reference_scope(self.plan, x, reference_post_mix):
            out = reference_post_mix(x, self.h_res, y, self.h_post)
        schedule = self.site._recompute
        if schedule is not None:
            last = self.site if next is None else None
            schedule.advance(x, (self.h_res, y, self.h_post), out, schedule.next_at(), last)
        return _returned(rest, out) if next is None else _returned(rest, *next.split(out))


class FusedFinish:
    """``finish`` of the fused path: the post-mix, or with ``next`` the seam op when the next
    site's coefficients are dynamic mHC. Streams keep their leading dims; the coefficients are per
    flattened token. ``plan``: how the site's Functions rebuild ``x_pass`` in recompute mode."""

    def __init__(self, site: Site, x_pass, h_post, h_res, plan=None):
        self.site, self.x_pass, self.h_post, self.h_res, self.plan = site, x_pass, h_post, h_res, plan

    def __call__(self, y, next: Site | None = None):
        site, x = self.site, self.x_pass
        y, rest = branch_output(y, x.shape[:-2] + x.shape[-1:], x.device)
        y = materialized(y)  # the kernels read its pointer
        schedule = site._recompute
        if next is None:
            return _returned(rest, self._post_mix(y, schedule))
        site._check_next(next)
        if not (next.source.fused_coefficients and layer_backend(x, site.n_streams, next.backend) == "triton"):
            return _returned(rest, *next.split(self._post_mix(y, schedule, next)))
        args = (
            x,
            y,
            self.h_post,
            self.h_res,
            *next.source.fused_parameters(next),
            next.sinkhorn_iters,
            next.backward,
            next.rms_eps,
            next.hc_eps,
            False,
        )  # False: no h_pre (MHCPreMixFunction)
        continues = schedule is not None and next._recompute is schedule and schedule.continues(x)
        if schedule is None:
            outputs, next_at = MHCSeamFunction.apply(*args), None
        else:
            outputs, next_at = self._seam_in_block(args, schedule, continues)
        x_in, _, h_post, h_res, x_pass = outputs
        plan = None
        if continues:
            schedule.advance(x, (self.h_res, y, self.h_post), x_pass, next_at)
            plan = schedule.plan(x_pass, "triton")
        elif next._recompute is not None:
            next._recompute.begin(x_pass, "triton")
        return _returned(rest, *next._fused_finish(x_in, h_post, h_res, x_pass, plan))

    def _seam_in_block(self, args, schedule, continues):
        """The seam in recompute mode: ``(outputs, next_at)``. Its ``x`` is rebuilt from the plan
        (or saved: it starts the block); the next site's streams are saved when they start a block
        and otherwise rebuilt from ``x``: cached at ``next_at`` in eager mode, linked under
        torch.compile."""
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
        if schedule is not None:
            last = self.site if next is None else None  # a site chained to another is not the last
            schedule.advance(self.x_pass, (self.h_res, y, self.h_post), out, schedule.next_at(), last)
        return out
