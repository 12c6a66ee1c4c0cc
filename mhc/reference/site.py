"""A hyper-connection site's maths as PyTorch ops: the pieces of its coefficients and its mixes.

Axis legend (einops): ``...`` leading dims, ``s`` source stream, ``t`` target stream, ``d`` channels.
Coefficients are fp32 whatever the activation dtype, fp64 when the activations or the parameters
are fp64 (so that a ``.double()`` layer is the exact oracle of the fused kernels); the mixes run
in the streams' dtype.
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange

__all__ = ["coefficient_dtype", "rms_inverse", "gates", "biases", "collapse_weights", "pre_mix", "post_mix"]


def coefficient_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when any of ``tensors`` is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rms_inverse(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / RMS(v)`` over the last dim, ``[..., 1]``; applied after the projection (paper Eq. 10-19)."""
    return torch.rsqrt(v.square().mean(dim=-1, keepdim=True) + eps)


def gates(alpha: torch.Tensor):
    """``(a_pre, a_post, a_res)``: the entries of ``alpha [3]`` (0-d views)."""
    return alpha.unbind()


def biases(bias: torch.Tensor, n: int):
    """``(b_pre [n], b_post [n], b_res [n, n])``: views of ``bias [2n + n*n]``."""
    b_pre, b_post, b_res = bias.split_with_sizes([n, n, n * n])
    return b_pre, b_post, b_res.view(n, n)


def collapse_weights(
    x: torch.Tensor, phi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rms_eps: float, eps: float = 0.0
) -> torch.Tensor:
    """``h = sigmoid(a * (v @ phi) / RMS(v) + b) + eps``, ``[..., n]`` in fp32 (fp64 for fp64 inputs),
    for streams ``x [..., n, dim]`` flattened to ``v [..., n*dim]``; ``phi [n*dim, n]``."""
    dtype = coefficient_dtype(x, phi)
    v = rearrange(x.to(dtype), "... s d -> ... (s d)")
    return torch.sigmoid(a.to(dtype) * ((v @ phi.to(dtype)) * rms_inverse(v, rms_eps)) + b.to(dtype)) + eps


def pre_mix(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """``x_in [..., d] = sum_s h_pre[..., s] x[..., s, :]`` in ``x``'s dtype."""
    if x.dtype == torch.float32:
        # a broadcast sum: a batched matmul of m = 1 has a far slower backward on CPUs
        return (h_pre.to(x.dtype).unsqueeze(-1) * x).sum(-2)
    # 16-bit streams: the matmul accumulates in fp32 and rounds once, not every product
    return einsum(h_pre.to(x.dtype), x, "... s, ... s d -> ... d")


def post_mix(x: torch.Tensor, h_res: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor) -> torch.Tensor:
    """``out[..., t, :] = sum_s h_res[..., t, s] x[..., s, :] + h_post[..., t] y`` ``[..., n, d]`` in
    ``x``'s dtype (also the step that rebuilds streams on the reference path)."""
    dtype = x.dtype
    # a matmul for the mix (einsum's permutes cost a CPU twice its time); the outer product by
    # broadcasting: as a matmul of k = 1 it is far slower on CPUs
    return h_res.to(dtype) @ x + h_post.to(dtype).unsqueeze(-1) * y.to(dtype).unsqueeze(-2)
