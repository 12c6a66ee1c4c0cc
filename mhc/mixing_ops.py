"""Fused hyper-connection ops: ``torch.library`` ops over the stream-mixing and mHC coefficient
kernels, their autograd Functions and the functionals that :mod:`mhc.mixing` calls on its
``"triton"`` path.

Read top to bottom: ops (what ``torch.compile`` traces) -> Functions -> functionals.

Every Function works on flattened tokens: streams ``x [T, n, d]``, branch tensors ``[T, d]``,
coefficients fp32. The pre-mix Functions return ``x`` itself as their last output (``x_pass``),
which the post-mix then consumes: the post-mix's gradient of ``x`` arrives at the pre-mix's
backward as the gradient of ``x_pass`` and is added there in the same pass that writes the
pre-mix's own gradient, so the streams' gradient is written once (no separate sum of two
stream-sized gradients).
"""

from __future__ import annotations

import torch

from mhc.layer import _kernels

__all__ = ["pre_mix", "post_mix", "mhc_pre_mix"]

# ------------------------------------------------------------------------------ ops
# Optional outputs come back as empty tensors: custom ops return plain tensors only.


def _none_if_empty(t: torch.Tensor) -> torch.Tensor | None:
    # the placeholder is the only 1-D output: real ones are [T, ...] with 2 or 3 dims
    return None if t.dim() == 1 and t.numel() == 0 else t


@torch.library.custom_op("mhc::stream_mix_fwd", mutates_args=())
def _stream_mix_fwd_op(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    return _kernels().stream_mix_fwd(x, w, y, b)


@_stream_mix_fwd_op.register_fake
def _(x, w, y, b):
    return x.new_empty((x.shape[0], w.shape[1], x.shape[2]))


@torch.library.custom_op("mhc::stream_mix_bwd", mutates_args=())
def _stream_mix_bwd_op(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, b: torch.Tensor | None,
    grad_out: torch.Tensor, grad_x_acc: torch.Tensor | None, need_grad_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    outs = _kernels().stream_mix_bwd(x, w, y, b, grad_out, grad_x_acc, need_grad_x)
    return tuple(x.new_empty((0,)) if t is None else t for t in outs)


@_stream_mix_bwd_op.register_fake
def _(x, w, y, b, grad_out, grad_x_acc, need_grad_x):
    T, n, _ = x.shape
    n_out = w.shape[1]
    f32 = dict(dtype=torch.float32)
    return (
        torch.empty_like(x) if need_grad_x else x.new_empty((0,)),
        torch.empty_like(y) if y is not None else x.new_empty((0,)),
        x.new_empty((T, n_out, n), **f32),
        x.new_empty((T, n_out), **f32) if y is not None else x.new_empty((0,)),
    )


@torch.library.custom_op("mhc::mhc_coefficients_fwd", mutates_args=())
def _coefficients_fwd_op(
    x: torch.Tensor, phi: torch.Tensor, a_pre: torch.Tensor, a_post: torch.Tensor, a_res: torch.Tensor,
    b_pre: torch.Tensor, b_post: torch.Tensor, b_res: torch.Tensor, iters: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels().coefficients_fwd(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters, eps)


@_coefficients_fwd_op.register_fake
def _(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters, eps):
    T, n, d = x.shape
    f32 = dict(dtype=torch.float32)
    return (
        x.new_empty((T, d)), x.new_empty((T, phi.shape[1]), **f32), x.new_empty((T,), **f32),
        x.new_empty((T, n), **f32), x.new_empty((T, n), **f32),
        x.new_empty((T, n, n), **f32), x.new_empty((T, n, n), **f32),
    )


@torch.library.custom_op("mhc::mhc_coefficients_bwd", mutates_args=())
def _coefficients_bwd_op(
    x: torch.Tensor, phi: torch.Tensor, a_pre: torch.Tensor, a_post: torch.Tensor, a_res: torch.Tensor,
    p: torch.Tensor, r: torch.Tensor, h_pre: torch.Tensor, h_post: torch.Tensor,
    dh_pre: torch.Tensor | None, dh_post: torch.Tensor, dz_res: torch.Tensor, grad_x_in: torch.Tensor,
    grad_x_acc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels().coefficients_bwd(
        x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc
    )


@_coefficients_bwd_op.register_fake
def _(x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc):
    f32 = dict(dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(phi), x.new_empty((p.shape[1] + 3,), **f32)


def _launchers():
    """The kernels' launchers in eager mode, the registered ops while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        ops = torch.ops.mhc

        def stream_mix_bwd(*args):
            return tuple(_none_if_empty(t) for t in ops.stream_mix_bwd(*args))

        return dict(
            stream_mix_fwd=ops.stream_mix_fwd, stream_mix_bwd=stream_mix_bwd,
            coefficients_fwd=ops.mhc_coefficients_fwd, coefficients_bwd=ops.mhc_coefficients_bwd,
            sinkhorn_bwd=ops.sinkhorn_bwd, sinkhorn_implicit_bwd=ops.sinkhorn_implicit_bwd,
        )
    k = _kernels()
    return dict(
        stream_mix_fwd=k.stream_mix_fwd, stream_mix_bwd=k.stream_mix_bwd,
        coefficients_fwd=k.coefficients_fwd, coefficients_bwd=k.coefficients_bwd,
        sinkhorn_bwd=k.sinkhorn_bwd, sinkhorn_implicit_bwd=k.sinkhorn_implicit_bwd,
    )


# ------------------------------------------------------------------------------ Functions


class PreMixFunction(torch.autograd.Function):
    """``x_in = sum_j h_pre[:, j] x[:, j]`` for given coefficients. ``(x [T, n, d], h_pre [T, n])``
    -> ``(x_in [T, d], x_pass = x)``."""

    @staticmethod
    def forward(ctx, x, h_pre):
        T, n, d = x.shape
        x_in = _launchers()["stream_mix_fwd"](x, h_pre[:, None, :], None, None)
        ctx.save_for_backward(x, h_pre)
        return x_in.view(T, d), x

    @staticmethod
    def backward(ctx, grad_x_in, grad_x_pass):
        x, h_pre = ctx.saved_tensors
        T, n, d = x.shape
        if grad_x_in is None:
            grad_x_in = x.new_zeros((T, d))
        dx, _, dh_pre, _ = _launchers()["stream_mix_bwd"](
            x, h_pre[:, None, :], None, None, grad_x_in[:, None, :], grad_x_pass, True
        )
        return dx, dh_pre.view(T, n)


class PostMixFunction(torch.autograd.Function):
    """``out[:, i] = sum_j h_res[:, i, j] x[:, j] + h_post[:, i] y``.
    ``(x [T, n, d], y [T, d] or None, h_post [T, n] or None, h_res [T, n, n])`` -> ``[T, n, d]``."""

    @staticmethod
    def forward(ctx, x, y, h_post, h_res):
        ctx.save_for_backward(x, y, h_post, h_res)
        return _launchers()["stream_mix_fwd"](x, h_res, y, h_post)

    @staticmethod
    def backward(ctx, grad_out):
        x, y, h_post, h_res = ctx.saved_tensors
        dx, dy, dh_res, dh_post = _launchers()["stream_mix_bwd"](x, h_res, y, h_post, grad_out, None, True)
        return dx, dy, dh_post, dh_res


class MHCPreMixFunction(torch.autograd.Function):
    """Dynamic mHC coefficients and the pre-mix in one op (the kernels of ``mhc_coefficients``).

    ``(x [T, n, d], phi [n*d, 2n + n*n], a_pre, a_post, a_res, b_pre [n], b_post [n], b_res [n, n])``
    -> ``(x_in [T, d], h_pre [T, n], h_post [T, n], h_res [T, n, n], x_pass = x)``.
    Saved: ``x`` and per-token fp32 values (``p``, ``r``, coefficients, Sinkhorn logits).
    """

    @staticmethod
    def forward(ctx, x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters, backward, eps):
        x_in, p, r, h_pre, h_post, z_res, h_res = _launchers()["coefficients_fwd"](
            x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters, eps
        )
        ctx.save_for_backward(x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, z_res if backward == "exact" else h_res)
        ctx.iters, ctx.backward_mode = iters, backward
        return x_in, h_pre, h_post, h_res, x

    @staticmethod
    def backward(ctx, grad_x_in, grad_h_pre, grad_h_post, grad_h_res, grad_x_pass):
        x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, sinkhorn_saved = ctx.saved_tensors
        T, n, d = x.shape
        run = _launchers()
        if grad_x_in is None:
            grad_x_in = x.new_zeros((T, d))
        if grad_h_post is None:
            grad_h_post = h_post.new_zeros((T, n))
        if grad_h_res is None:
            grad_h_res = h_post.new_zeros((T, n, n))
        if ctx.backward_mode == "exact":
            dz_res = run["sinkhorn_bwd"](sinkhorn_saved, grad_h_res.contiguous(), ctx.iters)
        else:
            dz_res = run["sinkhorn_implicit_bwd"](sinkhorn_saved, grad_h_res.contiguous())
        dx, dphi, dbias_gate = run["coefficients_bwd"](
            x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, grad_h_pre, grad_h_post, dz_res, grad_x_in, grad_x_pass
        )
        db, da = dbias_gate[: 2 * n + n * n], dbias_gate[2 * n + n * n :]
        return (
            dx, dphi, da[0].reshape(a_pre.shape), da[1].reshape(a_post.shape), da[2].reshape(a_res.shape),
            db[:n], db[n : 2 * n], db[2 * n :].view(n, n), None, None, None,
        )


# ------------------------------------------------------------------------------ functionals


def pre_mix(x: torch.Tensor, h_pre: torch.Tensor):
    """``(x_in [T, d], x_pass [T, n, d])`` from streams ``x [T, n, d]`` and fp32 ``h_pre [T, n]``
    (a token stride of 0 broadcasts one set). Feed ``x_pass`` to :func:`post_mix`."""
    return PreMixFunction.apply(x, h_pre)


def post_mix(x: torch.Tensor, y: torch.Tensor | None, h_post: torch.Tensor | None, h_res: torch.Tensor):
    """``out [T, n, d] = h_res @ x + h_post (x) y``, fp32 coefficients; ``y = h_post = None`` mixes only."""
    return PostMixFunction.apply(x, y, h_post, h_res)


def mhc_pre_mix(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters: int, backward: str, eps: float):
    """Dynamic mHC coefficients and pre-mix: ``(x_in, h_pre, h_post, h_res, x_pass)``; see
    :class:`MHCPreMixFunction`."""
    return MHCPreMixFunction.apply(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters, backward, eps)
