"""A site's pre-mix and post-mix on the CPU loops, as autograd ops over streams ``[..., n, d]``.

The PyTorch path (:func:`mhc.sites.reference_pre_mix`, :func:`mhc.sites.reference_post_mix`) calls
these for the tensors :func:`mhc.cpu.runs_on` accepts. The backward runs the gradients' bilinear
formulas as PyTorch ops instead of the loops where it builds a graph (``create_graph=True``:
double backward) and where the incoming gradient is not a tensor the loops read (a subclass, such
as a tensor-parallel plan's asynchronous collective result).
"""

from __future__ import annotations

import torch

from mhc import cpu

__all__ = ["pre_mix", "post_mix"]


class _PreMix(torch.autograd.Function):
    """``x [T, n, d]``, ``h_pre [T, n]`` -> ``[T, d]``. Double backward: under ``create_graph=True``
    the backward runs as PyTorch ops, which autograd differentiates again."""

    @staticmethod
    def forward(ctx, x, h_pre):
        ctx.save_for_backward(x, h_pre)
        return cpu.pre_mix_forward(x, h_pre)

    @staticmethod
    def backward(ctx, grad):
        x, h_pre = ctx.saved_tensors
        if torch.is_grad_enabled() or not cpu.runs_on(grad):
            return h_pre.unsqueeze(-1) * grad.unsqueeze(-2), (grad.unsqueeze(-2) * x).sum(-1)
        return cpu.pre_mix_backward(x, h_pre, grad.contiguous())


class _PostMix(torch.autograd.Function):
    """``x [T, n, d]``, ``h_res [T, n, n]``, ``y [T, d]``, ``h_post [T, n]`` -> ``[T, n, d]``. Double
    backward: as :class:`_PreMix`."""

    @staticmethod
    def forward(ctx, x, h_res, y, h_post):
        ctx.save_for_backward(x, h_res, y, h_post)
        return cpu.post_mix_forward(x, h_res, y, h_post)

    @staticmethod
    def backward(ctx, grad):
        x, h_res, y, h_post = ctx.saved_tensors
        if torch.is_grad_enabled() or not cpu.runs_on(grad):
            return (
                torch.einsum("tij,tid->tjd", h_res, grad),
                torch.einsum("tid,tjd->tij", grad, x),
                torch.einsum("ti,tid->td", h_post, grad),
                torch.einsum("tid,td->ti", grad, y),
            )
        return cpu.post_mix_backward(x, h_res, y, h_post, grad.contiguous())


def _tokens(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """``t`` as ``[T, *trailing dims]``, contiguous (a view when it already is)."""
    return t.reshape(-1, *t.shape[t.dim() - trailing :]).contiguous()


def pre_mix(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """``x [..., n, d]``, ``h_pre [..., n]`` -> ``sum_s h_pre[..., s] x[..., s, :]`` ``[..., d]``."""
    out = _PreMix.apply(_tokens(x, 2), _tokens(h_pre, 1))
    return out.view(*x.shape[:-2], x.shape[-1])


def post_mix(x: torch.Tensor, h_res: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor) -> torch.Tensor:
    """``x [..., n, d]``, ``h_res [..., n, n]``, ``y [..., d]``, ``h_post [..., n]`` ->
    ``out[..., i, :] = sum_j h_res[..., i, j] x[..., j, :] + h_post[..., i] y`` ``[..., n, d]``."""
    out = _PostMix.apply(_tokens(x, 2), _tokens(h_res, 2), _tokens(y, 1), _tokens(h_post, 1))
    return out.view(x.shape)
