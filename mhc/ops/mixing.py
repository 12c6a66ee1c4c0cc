"""Fused hyper-connection ops, read top to bottom: ``torch.library`` ops over the stream-mixing and
coefficient kernels -> autograd Functions -> the functionals :mod:`mhc.modules.site` calls.

Streams ``x [..., n, d]``, branch tensors ``[..., d]``, per-token fp32 coefficients flattened over
the leading dims. The Functions that start a site return the streams they mix as ``x_pass``,
which the post-mix consumes, so the post-mix's gradient of the streams is added in the starting
Function's backward: the streams' gradient is written once per site (``docs/mixing.md``).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch

from mhc._autograd import refuse_double_backward
from mhc._checks import MAX_STREAMS, check_settings
from mhc._compat import materialized, through_ops
from mhc.ops.library import kernel_op, kernels
from mhc.ops.rebuild import steps_of
from mhc.ops.sinkhorn import sinkhorn_bwd_launch

__all__ = ["pre_mix", "post_mix", "mhc_pre_mix", "mhc_seam"]


def _waited_gradients(backward):
    """A Function's backward on plain gradients: a tensor-parallel branch's input gradient can
    arrive as an unwaited collective's result, whose pointer the kernels cannot read."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        return backward(ctx, *(None if g is None else materialized(g) for g in grads))

    return run


# ------------------------------------------------------------------------------ ops
# Optional outputs come back as empty tensors: custom ops return plain tensors only.


def _none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    # the placeholder is the only 1-D output: real ones are [T, ...] with 2 or 3 dims
    return None if t.dim() == 1 and t.numel() == 0 else t


def _stream_mix_fwd_fake(x, w, y, b):
    return x.new_empty((*x.shape[:-2], w.shape[1], x.shape[-1]))


@kernel_op("mhc::stream_mix_fwd", _stream_mix_fwd_fake)
def _stream_mix_fwd_op(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    return kernels().stream_mix.stream_mix_fwd_unchecked(x, w, y, b)


def _stream_mix_bwd_fake(x, w, y, b, grad_out, grad_x_acc, need_grad_x):
    T, n_out, n = w.shape
    f32 = dict(dtype=torch.float32)
    return (
        torch.empty_like(x) if need_grad_x else x.new_empty((0,)),
        torch.empty_like(y) if y is not None else x.new_empty((0,)),
        x.new_empty((T, n_out, n), **f32),
        x.new_empty((T, n_out), **f32) if y is not None else x.new_empty((0,)),
    )


@kernel_op("mhc::stream_mix_bwd", _stream_mix_bwd_fake)
def _stream_mix_bwd_op(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor | None,
    b: torch.Tensor | None,
    grad_out: torch.Tensor,
    grad_x_acc: torch.Tensor | None,
    need_grad_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = kernels().stream_mix.stream_mix_bwd_unchecked(x, w, y, b, grad_out, grad_x_acc, need_grad_x)
    return tuple(x.new_empty((0,)) if t is None else t for t in outs)


def _coefficients_fwd_fake(x, phi, alpha, bias, iters, eps, hc_eps):
    """Fake ``(x_in, p, r, h_pre, h_post, z_res, h_res)`` of a coefficient forward on ``x [..., n, d]``."""
    *lead, n, d = x.shape
    T = math.prod(lead)
    shapes = ((T, 2 * n + n * n), (T,), (T, n), (T, n), (T, n, n), (T, n, n))
    return (x.new_empty((*lead, d)), *(x.new_empty(shape, dtype=torch.float32) for shape in shapes))


@kernel_op("mhc::mhc_coefficients_fwd", _coefficients_fwd_fake)
def _coefficients_fwd_op(
    x: torch.Tensor, phi: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor, iters: int, eps: float, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels().mhc_coefficients.coefficients_fwd_unchecked(x, phi, alpha, bias, iters, eps, hc_eps)


def _coefficients_bwd_fake(x, phi, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc, hc_eps):
    # the parameters' gradients, packed [vec(dphi) | dbias | dalpha], are fp32 whatever their dtype
    return torch.empty_like(x), x.new_empty((phi.numel() + p.shape[1] + 3,), dtype=torch.float32)


@kernel_op("mhc::mhc_coefficients_bwd", _coefficients_bwd_fake)
def _coefficients_bwd_op(
    x: torch.Tensor,
    phi: torch.Tensor,
    alpha: torch.Tensor,
    p: torch.Tensor,
    r: torch.Tensor,
    h_pre: torch.Tensor,
    h_post: torch.Tensor,
    dh_pre: torch.Tensor | None,
    dh_post: torch.Tensor,
    dz_res: torch.Tensor,
    grad_x_in: torch.Tensor,
    grad_x_acc: torch.Tensor | None,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels().mhc_coefficients.coefficients_bwd_packed(
        x, phi, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc, hc_eps
    )


@kernel_op("mhc::stream_recompute", lambda x, h_res, y, h_post, after: torch.empty_like(x), opaque=True)
def _stream_recompute_op(
    x: torch.Tensor, h_res: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, after: torch.Tensor
) -> torch.Tensor:
    # One post-mix step that rebuilds streams in a backward: the forward's kernel. ``after``: the
    # block's anchor (a value of the backward), unused. It keeps the op in the backward graph: an
    # op that depends on forward values only is moved to the forward by the partitioner, which
    # then saves its output (docs/recompute.md). Opaque, so that the identical rebuilds of a
    # block's Functions merge into one per step.
    return kernels().stream_mix.stream_mix_fwd_unchecked(x, h_res, y, h_post)


def _stream_mix_bwd_compiled(*args):
    return tuple(_none_if_empty(t) for t in torch.ops.mhc.stream_mix_bwd(*args))


_EAGER = None
_OPS = SimpleNamespace(
    stream_mix_fwd=lambda *a: torch.ops.mhc.stream_mix_fwd(*a),
    stream_mix_bwd=_stream_mix_bwd_compiled,
    coefficients_fwd=lambda *a: torch.ops.mhc.mhc_coefficients_fwd(*a),
    coefficients_bwd=lambda *a: torch.ops.mhc.mhc_coefficients_bwd(*a),
    stream_recompute=lambda *a: torch.ops.mhc.stream_recompute(*a),
)


def _launchers(x: torch.Tensor):
    """The kernels' launchers for streams like ``x`` in eager mode; the registered ops while
    ``torch.compile`` traces, a dispatch mode watches (selective activation checkpointing decides
    per op) or ``x`` is a ``DTensor`` (:func:`mhc._compat.through_ops`)."""
    global _EAGER
    if through_ops(x):
        return _OPS
    if _EAGER is None:
        k = kernels()  # the launches without the public launchers' argument checks (host time)
        _EAGER = SimpleNamespace(
            stream_mix_fwd=k.stream_mix.stream_mix_fwd_unchecked,
            stream_mix_bwd=k.stream_mix.stream_mix_bwd_unchecked,
            coefficients_fwd=k.mhc_coefficients.coefficients_fwd_unchecked,
            coefficients_bwd=k.mhc_coefficients.coefficients_bwd_packed,
            stream_recompute=lambda x, h_res, y, h_post, after: k.stream_mix.stream_mix_fwd_unchecked(
                x, h_res, y, h_post
            ),
        )
    return _EAGER


# ------------------------------------------------------------------------------ Functions
# Each Function takes the streams with their leading dims and flattens inside, where autograd
# records nothing (no view nodes around the ops), and returns tensors that are not views (an
# output that is a view of a tensor made inside a Function cannot be modified in place).
# Streams are made contiguous once, where they enter a Function, and that copy is what the
# kernels read, what is saved and what is passed on (``x_pass``): streams from
# ``expand_streams`` are a stride-0 view, which every launcher would otherwise copy again (four
# stream-sized copies per step at the first site, forward and backward).
# ``set_materialize_grads(False)``: an unused output's gradient arrives as ``None`` instead of a
# tensor of zeros made and filled for nothing.


def _tokens_of(x: torch.Tensor, d: int) -> tuple:
    """The leading dims of streams ``x [..., n, d]`` followed by ``d``: the shape of a branch tensor."""
    return (*x.shape[:-2], d)


# Recompute mode (mhc.memory.recompute): a Function that starts or post-mixes a site which is not the
# first of its block gets ``at`` (the backward's cache of its streams, or None under
# torch.compile) and the flat ``recipe`` (the block's first streams and the post-mix steps since),
# and saves the recipe instead of the streams; otherwise ``at`` is None and ``recipe`` empty.
# Under torch.compile the Functions of a block are also ``linked``: each takes the previous one's
# ``link`` (a one-element tensor) and returns its own as a last output. In the backward the last
# Function's gradient becomes the block's anchor, handed back through the links' gradients, and
# every rebuild of the block depends on it: so the partitioner keeps the rebuilds in the backward,
# and the identical ones of different Functions (one step each, from the same anchor) are merged
# by the compiled graph's common-subexpression pass: one rebuild per step and block, as in eager.


def fused_mix(x, h_res, y, h_post):
    """One post-mix step on the fused path (the forward's kernel): what rebuilds streams there."""
    return _launchers(x).stream_mix_fwd(x, h_res, y, h_post)


def _save_with_streams(ctx, x, at, linked, link, recipe, *tensors) -> tuple:
    """Save ``tensors`` and then the streams ``x``, or in recompute mode the recipe that rebuilds
    them; returns the extra output: ``(link,)`` for a linked Function, else ``()``."""
    ctx.at, ctx.recipe_len, ctx.linked, ctx.link_in = at, len(recipe), linked, link is not None
    ctx.save_for_backward(*tensors, *(recipe or (x,)))
    return (x.new_zeros(1, dtype=torch.float32),) if linked else ()


def _anchor(ctx, grad_link, *grads):
    """A linked Function's anchor: the link's gradient, or for the block's last one, one element
    of the first gradient this backward received. ``None`` when not linked (eager mode)."""
    if not ctx.linked or grad_link is not None:
        return grad_link
    g = next(g for g in grads if g is not None)
    return g[(0,) * g.dim()].reshape(1).float()


def _grads_after(ctx, anchor) -> tuple:
    """The gradients of the recompute arguments ``(at, linked, link, *recipe)``."""
    return (None, None, anchor if ctx.link_in else None, *(None,) * ctx.recipe_len)


def _saved_and_streams(ctx, anchor):
    """``(tensors, x)``: what :func:`_save_with_streams` saved, with the streams rebuilt in
    recompute mode. Reads ``ctx.saved_tensors`` once (activation checkpointing allows one read)."""
    saved = ctx.saved_tensors
    k = ctx.recipe_len or 1
    tensors, recipe = saved[:-k], saved[-k:]
    return tensors, _rebuild(ctx.at, recipe, (), anchor)


def _rebuild(at, recipe, more_steps: tuple, anchor):
    """The streams of ``recipe`` advanced by ``more_steps`` (a flat triple or nothing): from the
    block's cache ``at`` in eager mode; under torch.compile one ``stream_recompute`` op per step,
    each depending on the block's ``anchor``."""
    start, steps = recipe[0], recipe[1:] + more_steps
    if at is not None:
        return at.get(start, steps_of((start, *steps)), fused_mix) if steps else start
    x = start
    for i in range(0, len(steps), 3):
        x = _launchers(x).stream_recompute(x, *steps[i : i + 3], anchor)
    return x


class PreMixFunction(torch.autograd.Function):
    """``x_in = sum_j h_pre[:, j] x[..., j, :]`` for given coefficients. ``(x [..., n, d], h_pre [T, n])``
    -> ``(x_in [..., d], x_pass = x)``; ``at, linked, link, *recipe``: recompute mode (above)."""

    @staticmethod
    def forward(ctx, x, h_pre, at=None, linked=False, link=None, *recipe):
        ctx.set_materialize_grads(False)
        x = x.contiguous()
        x_in = _launchers(x).stream_mix_fwd(x, h_pre[:, None, :], None, None)
        extra = _save_with_streams(ctx, x, at, linked, link, recipe, h_pre)
        return torch.ops.aten._unsafe_view(x_in, _tokens_of(x, x.shape[-1])), x, *extra

    @staticmethod
    @_waited_gradients
    def backward(ctx, grad_x_in, grad_x_pass, grad_link=None):
        refuse_double_backward("the fused pre-mix (HyperConnection, StreamCollapse)")
        if grad_x_in is None:
            return grad_x_pass, None, *_grads_after(ctx, grad_link)
        anchor = _anchor(ctx, grad_link, grad_x_in)
        (h_pre,), x = _saved_and_streams(ctx, anchor)
        ctx.at = None  # the streams' cache is freed once no Function of the site needs it
        dx, _, dh_pre, _ = _launchers(x).stream_mix_bwd(
            x, h_pre[:, None, :], None, None, grad_x_in.unsqueeze(-2), grad_x_pass, True
        )
        return dx, dh_pre.view(h_pre.shape), *_grads_after(ctx, anchor)


class PostMixFunction(torch.autograd.Function):
    """``out[..., i, :] = sum_j h_res[:, i, j] x[..., j, :] + h_post[:, i] y``.
    ``(x [..., n, d], y [..., d] or None, h_post [T, n] or None, h_res [T, n, n])`` -> ``[..., n, d]``;
    ``at, linked, link, *recipe``: recompute mode (above; a linked post-mix returns ``(out, link)``)."""

    @staticmethod
    def forward(ctx, x, y, h_post, h_res, at=None, linked=False, link=None, *recipe):
        ctx.set_materialize_grads(False)
        x = x.contiguous()
        extra = _save_with_streams(ctx, x, at, linked, link, recipe, y, h_post, h_res)
        out = _launchers(x).stream_mix_fwd(x, h_res, y, h_post)
        return (out, *extra) if extra else out

    @staticmethod
    @_waited_gradients
    def backward(ctx, grad_out, grad_link=None):
        refuse_double_backward("the fused post-mix (HyperConnection, LaneMixer)")
        if grad_out is None:
            return None, None, None, None, *_grads_after(ctx, grad_link)
        anchor = _anchor(ctx, grad_link, grad_out)
        (y, h_post, h_res), x = _saved_and_streams(ctx, anchor)
        ctx.at = None
        dx, dy, dh_res, dh_post = _launchers(x).stream_mix_bwd(x, h_res, y, h_post, grad_out, None, True)
        return dx, dy, dh_post, dh_res, *_grads_after(ctx, anchor)


def _save_coefficients(ctx, x, params, outputs, settings, at, linked, link, recipe, *extra):
    """Save what a coefficient forward's backward needs: ``phi`` and ``alpha``, the per-token
    fp32 values and the Sinkhorn's saved tensor (its logits; its output for the implicit backward),
    ``extra``, then the streams ``x`` (or their recipe); returns the link output, if any."""
    p, r, h_pre, h_post, z_res, h_res = outputs
    sinkhorn_saved = z_res if settings[1] == "exact" else h_res
    ctx.set_materialize_grads(False)
    ctx.settings = settings
    ctx.phi_shape = params[0].shape
    ctx.packed_split = [params[0].numel(), params[2].numel(), 3]  # the kernels' [vec(dphi) | dbias | dalpha]
    return _save_with_streams(
        ctx, x, at, linked, link, recipe, *params[:2], p, r, h_pre, h_post, sinkhorn_saved, *extra
    )


def _coefficients_backward(ctx, x, saved, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass):
    """``(dx, packed)`` of a coefficient forward over the streams ``x``: the Sinkhorn backward of
    ``grad_h_res``, then the coefficient kernels' backward. ``saved``: what
    :func:`_save_coefficients` saved before the streams (``phi, alpha, p, r, h_pre, h_post`` and
    the Sinkhorn's tensor); absent gradients count as zeros."""
    phi, alpha, p, r, h_pre, h_post, sinkhorn_saved = saved
    iters, backward, _, hc_eps = ctx.settings
    if grad_x_in is None:
        grad_x_in = x.new_zeros(_tokens_of(x, x.shape[-1]))
    if grad_h_post is None:
        grad_h_post = torch.zeros_like(h_post)
    if grad_h_res is None:
        grad_h_res = torch.zeros_like(sinkhorn_saved)
    dz_res = sinkhorn_bwd_launch(sinkhorn_saved, grad_h_res.contiguous(), iters, backward, hc_eps)
    return _launchers(x).coefficients_bwd(
        x, phi, alpha, p, r, h_pre, h_post, grad_h_pre, grad_h_post, dz_res, grad_x_in, grad_x_pass, hc_eps
    )


def _parameter_grads(ctx, packed):
    """The gradients of ``(phi, alpha, bias)`` from the kernels' packed ``[vec(dphi) | dbias |
    dalpha]`` (fp32; autograd casts them to the parameters' dtype)."""
    dphi, dbias, dalpha = packed.split_with_sizes(ctx.packed_split)
    return dphi.view(ctx.phi_shape), dalpha, dbias


class MHCPreMixFunction(torch.autograd.Function):
    """Dynamic mHC coefficients and the pre-mix in one op (the kernels of ``mhc_coefficients``).

    ``(x [..., n, d], phi [n*d, 2n + n*n], alpha [3], bias [2n + n*n])`` (any float dtype) ->
    ``(x_in [..., d], h_pre [T, n], h_post [T, n], h_res [T, n, n], x_pass = x)``. Saves ``x`` and
    per-token fp32 values; ``at, *recipe``: recompute mode (above). ``with_h_pre=False`` returns
    ``None`` for ``h_pre`` (under ``torch.compile`` an unused output gets a kernel of zeros)."""

    @staticmethod
    def forward(
        ctx,
        x,
        phi,
        alpha,
        bias,
        iters,
        backward,
        eps,
        hc_eps,
        with_h_pre=True,
        at=None,
        linked=False,
        link=None,
        *recipe,
    ):
        params = (phi, alpha, bias)
        x = x.contiguous()
        x_in, *outputs = _launchers(x).coefficients_fwd(x, *params, iters, eps, hc_eps)
        extra = _save_coefficients(ctx, x, params, outputs, (iters, backward, eps, hc_eps), at, linked, link, recipe)
        return x_in, outputs[2] if with_h_pre else None, outputs[3], outputs[5], x, *extra

    @staticmethod
    @_waited_gradients
    def backward(ctx, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass, grad_link=None):
        refuse_double_backward("the fused mHC coefficients (HyperConnection)")
        anchor = _anchor(ctx, grad_link, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass)
        saved, x = _saved_and_streams(ctx, anchor)
        ctx.at = None
        dx, packed = _coefficients_backward(ctx, x, saved, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass)
        return (dx, *_parameter_grads(ctx, packed), None, None, None, None, None, *_grads_after(ctx, anchor))


class MHCSeamFunction(torch.autograd.Function):
    """The seam between two mHC sites: site ``l``'s post-mix and site ``l+1``'s coefficients and pre-mix
    as one autograd op (one node, one set of saved tensors).

    ``(x [..., n, d], y [..., d], h_post_l [T, n], h_res_l [T, n, n])`` and site ``l+1``'s ``(phi,
    alpha, bias)`` -> site ``l+1``'s ``(x_in, h_pre, h_post, h_res, x_pass)``. Recompute mode (above):
    ``at, linked, link, *recipe`` rebuild ``x``; ``next_at`` caches ``x_pass``, saved only with
    ``keep_next`` (it starts a block) and otherwise rebuilt from ``x``."""

    @staticmethod
    def forward(
        ctx,
        x,
        y,
        h_post_l,
        h_res_l,
        phi,
        alpha,
        bias,
        iters,
        backward,
        eps,
        hc_eps,
        with_h_pre=True,
        at=None,
        linked=False,
        link=None,
        next_at=None,
        keep_next=True,
        *recipe,
    ):
        params = (phi, alpha, bias)
        run = _launchers(x)
        x = x.contiguous()
        x_next = run.stream_mix_fwd(x, h_res_l, y, h_post_l)
        x_in, *outputs = run.coefficients_fwd(x_next, *params, iters, eps, hc_eps)
        kept = (x_next,) if keep_next else ()
        settings, post_mix = (iters, backward, eps, hc_eps), (h_res_l, y, h_post_l)
        extra = _save_coefficients(ctx, x, params, outputs, settings, at, linked, link, recipe, *post_mix, *kept)
        ctx.next_at = next_at
        return x_in, outputs[2] if with_h_pre else None, outputs[3], outputs[5], x_next, *extra

    @staticmethod
    @_waited_gradients
    def backward(ctx, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass, grad_link=None):
        refuse_double_backward("the fused seam of chained sites (finish(y, next=))")
        anchor = _anchor(ctx, grad_link, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass)
        saved = ctx.saved_tensors
        k = ctx.recipe_len or 1
        tensors, recipe = saved[:-k], saved[-k:]
        coefficients, (h_res_l, y, h_post_l, *kept) = tensors[:7], tensors[7:]
        x = _rebuild(ctx.at, recipe, (), anchor)
        if kept:
            x_next = kept[0]
        elif ctx.next_at is not None:  # eager: x_next's position in the cache (x's is filled now)
            x_next = _rebuild(ctx.next_at, recipe, (h_res_l, y, h_post_l), anchor)
        else:
            x_next = _rebuild(None, recipe, (h_res_l, y, h_post_l), anchor)
        ctx.at = ctx.next_at = None
        dx_next, packed = _coefficients_backward(
            ctx, x_next, coefficients, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass
        )
        dx, dy, dh_res_l, dh_post_l = _launchers(x_next).stream_mix_bwd(x, h_res_l, y, h_post_l, dx_next, None, True)
        grads = (dx, dy, dh_post_l, dh_res_l, *_parameter_grads(ctx, packed), *(None,) * 5)  # 5 settings
        after = _grads_after(ctx, anchor)  # (at, linked, link, *recipe)
        return (*grads, *after[:3], None, None, *after[3:])  # None, None: next_at, keep_next


# ------------------------------------------------------------------------------ functionals
# The public entry points check their arguments; mhc.modules.site and mhc.modules.coefficients, which build the
# arguments themselves, call the Functions directly (host time per site).


def _check_streams(x) -> None:
    kernels()._checks.check_streams(x, "x", MAX_STREAMS)
    kernels().check_device(x)


def _check_tensor(t, what: str, shape: tuple, dtype, device) -> None:
    """``t``: a tensor of ``shape`` on ``x``'s ``device``, of ``dtype`` (or any float dtype for None)."""
    checks = kernels()._checks
    checks.check_tensor(t, what, shape, checks.FLOATS if dtype is None else (dtype,), device, where="x")


def _check_post_mix(x, y, h_post, h_res) -> None:
    _check_streams(x)
    *lead, n, d = x.shape
    T = math.prod(lead)
    _check_tensor(h_res, "h_res", (T, n, n), torch.float32, x.device)
    if (y is None) != (h_post is None):
        raise ValueError("y and h_post go together: pass both or neither")
    if y is not None:
        _check_tensor(y, "y", (*lead, d), None, x.device)
        _check_tensor(h_post, "h_post", (T, n), torch.float32, x.device)


def _check_parameters(x, params) -> None:
    if not isinstance(params, (tuple, list)) or len(params) != 3:
        raise TypeError("params must be the tuple (phi, alpha, bias)")
    n, d = x.shape[-2:]
    M = 2 * n + n * n
    for name, t, shape in zip(("phi", "alpha", "bias"), params, ((n * d, M), (3,), (M,))):
        _check_tensor(t, name, shape, None, x.device)


def _check_sinkhorn(iters, backward, eps, hc_eps) -> None:
    check_settings(iters, backward, "auto", hc_eps)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps (the RMS epsilon) must be a finite float > 0, got {eps!r}")


def pre_mix(x: torch.Tensor, h_pre: torch.Tensor):
    """``(x_in [..., d], x_pass [..., n, d])`` from streams ``x [..., n, d]`` and fp32 ``h_pre [T, n]``
    (``T`` tokens; a token stride of 0 broadcasts one set). Feed ``x_pass`` to :func:`post_mix`."""
    _check_streams(x)
    _check_tensor(h_pre, "h_pre", (math.prod(x.shape[:-2]), x.shape[-2]), torch.float32, x.device)
    return PreMixFunction.apply(x, h_pre)


def post_mix(x: torch.Tensor, y: torch.Tensor | None, h_post: torch.Tensor | None, h_res: torch.Tensor):
    """``out [..., n, d] = h_res @ x + h_post (x) y`` for streams ``x [..., n, d]``, ``y [..., d]`` and
    fp32 coefficients ``h_post [T, n]``, ``h_res [T, n, n]``; ``y = h_post = None`` mixes only."""
    _check_post_mix(x, y, h_post, h_res)
    return PostMixFunction.apply(x, y, h_post, h_res)


def mhc_pre_mix(x, params, iters: int, backward: str, eps: float, hc_eps: float = 0.0):
    """Dynamic mHC coefficients and pre-mix of ``x [..., n, d]``: ``(x_in, h_pre, h_post, h_res, x_pass)``.

    ``params``: ``(phi [n*d, 2n + n*n], alpha [3], bias [2n + n*n])``; ``eps`` the RMS epsilon,
    ``hc_eps`` DeepSeek-V4's; see :class:`MHCPreMixFunction`."""
    _check_streams(x)
    _check_parameters(x, params)
    _check_sinkhorn(iters, backward, eps, hc_eps)
    return MHCPreMixFunction.apply(x, *params, iters, backward, eps, hc_eps)


def mhc_seam(x, y, h_post, h_res, params, iters: int, backward: str, eps: float, hc_eps: float = 0.0):
    """Site ``l``'s post-mix of ``(x, y, h_post, h_res)`` followed by the next site's dynamic mHC
    coefficients and pre-mix (``params`` as :func:`mhc_pre_mix`'s), in one op: the next site's
    ``(x_in, h_pre, h_post, h_res, x_pass)``; see :class:`MHCSeamFunction`."""
    _check_post_mix(x, y, h_post, h_res)
    if y is None:
        raise ValueError("the seam needs site l's branch output y and h_post")
    _check_parameters(x, params)
    _check_sinkhorn(iters, backward, eps, hc_eps)
    return MHCSeamFunction.apply(x, y, h_post, h_res, *params, iters, backward, eps, hc_eps)
