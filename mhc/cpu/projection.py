"""The coefficients' RMS-normalised projection on the CPU path, as one autograd op.

``(v @ phi) * rsqrt(mean(v^2) + eps)`` per row of ``v``: written as PyTorch ops, the norm's forward
and backward make four temporaries the size of ``v`` (the flattened streams for mHC, every
stream for HC), each a pass over memory that costs a CPU more than the projection itself. Here
the norm is one reduction and its gradient is added in place to the projection's, so the op
moves ``v`` once each way. Values agree with the PyTorch formula within fp32 rounding.
"""

from __future__ import annotations

import torch

__all__ = ["normalized_projection", "normalized_projection_formula"]


def normalized_projection_formula(v: torch.Tensor, phi: torch.Tensor, eps: float) -> torch.Tensor:
    """``(v @ phi) * rsqrt(mean(v^2, -1) + eps)`` as PyTorch ops."""
    return (v @ phi) * torch.rsqrt(v.square().mean(dim=-1, keepdim=True) + eps)


class _NormalizedProjection(torch.autograd.Function):
    """``v [T, K]``, ``phi [K, M]`` -> ``[T, M]``. Double backward: the backward of a backward
    that builds a graph differentiates :func:`normalized_projection_formula` with autograd."""

    @staticmethod
    def forward(ctx, v, phi, eps):
        projected = v @ phi
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        inverse = torch.rsqrt(norm.square() / v.shape[-1] + eps)
        ctx.save_for_backward(v, phi, projected, inverse)
        ctx.eps = eps
        return projected * inverse

    @staticmethod
    def backward(ctx, grad):
        v, phi, projected, inverse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True
            wanted = [t for t in (v, phi) if t.requires_grad]
            found = iter(
                torch.autograd.grad(normalized_projection_formula(v, phi, ctx.eps), wanted, grad, create_graph=True)
            )
            return *(next(found) if t.requires_grad else None for t in (v, phi)), None
        grad_projected = grad * inverse
        # d inverse / d v = -inverse^3 v / K
        grad_inverse = (grad * projected).sum(dim=-1, keepdim=True) * inverse.pow(3) / -v.shape[-1]
        grad_v = (grad_projected @ phi.T).addcmul_(v, grad_inverse)
        return grad_v, v.T @ grad_projected, None


def normalized_projection(v: torch.Tensor, phi: torch.Tensor, eps: float) -> torch.Tensor:
    """``(v @ phi) * rsqrt(mean(v^2, -1) + eps)`` for ``v [..., K]``, ``phi [K, M]`` -> ``[..., M]``."""
    out = _NormalizedProjection.apply(v.reshape(-1, v.shape[-1]), phi, eps)
    return out.view(*v.shape[:-1], phi.shape[-1])
