"""Stream helpers: ``n`` copies of the residual stream in (:func:`expand_streams`,
:class:`StreamExpand`), the streams out (:func:`reduce_streams`, the learned
:class:`StreamCollapse`, DeepSeek-V4's head).

Axis legend (einops): ``...`` leading dims, ``s`` stream, ``d`` channels (``dim``).
"""

from __future__ import annotations

import math

import torch
from einops import repeat
from torch import nn

from mhc._checks import (
    DEFAULT_RMS_EPS,
    check_floating,
    check_operand,
    check_positive_int,
    check_rms_eps,
    check_same_device,
    check_settings,
    check_streams_shape,
)
from mhc.ops.local import as_dtensor, assign, local_parameters, local_tokens
from mhc.ops.mixing import pre_mix
from mhc.ops.path import choose
from mhc.reference.site import collapse_weights

__all__ = ["expand_streams", "reduce_streams", "StreamExpand", "stream_collapse", "StreamCollapse"]

REDUCTIONS = ("mean", "sum")


def expand_streams(h: torch.Tensor, n_streams: int, embedding: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., dim] -> [..., n, dim]``: ``n`` copies of ``h``, plus ``embedding [n, dim]`` if given.

    Without ``embedding`` the result is a stride-0 view of ``h`` (no copy); the fused layers copy
    it once where it enters them."""
    check_positive_int(n_streams, "n_streams")
    check_floating(h, "h")
    if h.dim() < 1:
        raise ValueError("h must have shape [..., dim], got a 0-d tensor")
    if embedding is not None:
        check_operand(embedding, ((n_streams, h.shape[-1]),), "embedding", h.device, "h")
    x = repeat(h, "... d -> ... s d", s=n_streams)
    if embedding is not None:
        x = x + embedding.to(h.dtype)
    return x


def reduce_streams(x: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """``[..., n, dim] -> [..., dim]`` by ``"mean"`` or ``"sum"`` over the streams."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    check_floating(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., n, dim], got {tuple(x.shape)}")
    return x.mean(dim=-2) if reduce == "mean" else x.sum(dim=-2)


class StreamExpand(nn.Module):
    """``expand_streams`` with a learned per-stream embedding ``[n, dim]`` (initialised to zero)."""

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(self, n_streams: int, dim: int):
        super().__init__()
        self.n_streams = check_positive_int(n_streams, "n_streams")
        self.embedding = nn.Parameter(torch.zeros(n_streams, check_positive_int(dim, "dim")))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero embeddings (DTensor parameters too, see :meth:`HyperConnection.reset_parameters`)."""
        assign(self.embedding, torch.zeros(self.embedding.shape, dtype=self.embedding.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h [..., dim] -> [..., n, dim]``; a token-sharded ``DTensor`` ``h`` gives a ``DTensor``."""
        h, layout = local_tokens(h, 1, "StreamExpand")
        (embedding,) = local_parameters(self, (self.embedding,), layout)
        return as_dtensor(expand_streams(h, self.n_streams, embedding), layout)


def stream_collapse(
    x: torch.Tensor,
    phi: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rms_eps: float = DEFAULT_RMS_EPS,
    eps: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Learned per-token collapse of the streams, DeepSeek-V4's head: ``x [..., n, dim] -> [..., dim]``,
    ``out = sum_s h[..., s] x[..., s, :]`` with ``h`` from :func:`collapse_weights`; ``phi [n*dim, n]``,
    ``a [1]`` (or 0-d), ``b [n]``, any float dtype, on ``x``'s device.

    The weights come from PyTorch ops in fp32 (one projection per token, ``n`` columns); the
    weighted sum runs on the fused mixing kernel (``backend="triton"``, or ``"auto"`` on CUDA for
    ``n <= 16``) or in fp32 PyTorch ops (``"torch"``), and is returned in ``x``'s dtype."""
    check_streams_shape(x, x.shape[-2] if x.dim() >= 2 else 1, None, "x")
    n, dim = x.shape[-2], x.shape[-1]
    check_operand(phi, ((n * dim, n),), "phi", x.device)
    check_operand(a, ((), (1,)), "a", x.device)
    check_operand(b, ((n,),), "b", x.device)
    rms_eps = check_rms_eps(rms_eps)
    eps = check_settings(1, "exact", backend, eps)
    h = collapse_weights(x, phi, a, b, rms_eps, eps)
    if choose(backend, x, "mixing", n) == "triton":
        return pre_mix(x, h.reshape(-1, n).float())[0]
    return (h.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


class StreamCollapse(nn.Module):
    """Learned per-token collapse of ``n`` streams into one (DeepSeek-V4's ``hc_head``):
    ``forward(x [..., n, dim]) -> [..., dim]``, ``sum_s h[s] x[s]`` with
    ``h = sigmoid(a_pre * (v @ phi) / RMS(v) + b_pre) + eps`` from the flattened token ``v``.

    Starts as the mean of the streams (``phi = 0``, ``sigmoid(b_pre) = 1/n``), where
    :func:`reduce_streams` stays. ``eps`` is DeepSeek-V4's ``hc_eps`` (default 0).
    ``weights(x) -> [..., n]`` (fp32). See :func:`stream_collapse` for the paths."""

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(
        self, dim: int, n_streams: int, rms_eps: float = DEFAULT_RMS_EPS, eps: float = 0.0, backend: str = "auto"
    ):
        super().__init__()
        self.dim = check_positive_int(dim, "dim")
        self.n_streams = n = check_positive_int(n_streams, "n_streams")
        self.rms_eps = check_rms_eps(rms_eps)
        self.eps = check_settings(1, "exact", backend, eps)
        self.backend = backend
        self.phi = nn.Parameter(torch.empty(n * dim, n))
        self.a_pre = nn.Parameter(torch.empty(1))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The mean of the streams (DTensor parameters too, see :meth:`HyperConnection.reset_parameters`)."""
        n = self.n_streams
        assign(self.phi, torch.zeros(self.phi.shape, dtype=self.phi.dtype))
        assign(self.a_pre, torch.full((1,), 0.01, dtype=self.a_pre.dtype))
        assign(self.b_pre, torch.full((n,), -math.log(n - 1) if n > 1 else 20.0, dtype=self.b_pre.dtype))

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = local_tokens(x, 2, "StreamCollapse")
        check_streams_shape(x, self.n_streams, self.dim, "x")
        check_same_device(x, self.phi.device, "x", "the layer's parameters")
        return as_dtensor(collapse_weights(x, *self._parameters_for_ops(layout), self.rms_eps, self.eps), layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = local_tokens(x, 2, "StreamCollapse")
        check_streams_shape(x, self.n_streams, self.dim, "x")
        out = stream_collapse(x, *self._parameters_for_ops(layout), self.rms_eps, self.eps, self.backend)
        return as_dtensor(out, layout)

    def _parameters_for_ops(self, layout):
        return local_parameters(self, (self.phi, self.a_pre, self.b_pre), layout)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}" + (f", eps={self.eps}" if self.eps else "")
