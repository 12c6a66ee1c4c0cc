"""``LaneMixer``: a doubly stochastic mix of ``n`` lanes (MoE experts, parallel heads, ...).

Axis legend (einops): ``...`` leading dims, ``s`` source lane, ``t`` target lane, ``d`` channels.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from mhc._checks import (
    DEFAULT_RMS_EPS,
    MAX_STREAMS,
    check_positive_int,
    check_rms_eps,
    check_same_device,
    check_settings,
    check_streams_shape,
)
from mhc.ops.local import as_dtensor, assign, local_parameters, local_tokens
from mhc.ops.mixing import post_mix
from mhc.ops.path import choose
from mhc.ops.sinkhorn import sinkhorn
from mhc.reference.site import coefficient_dtype, rms_inverse

__all__ = ["LaneMixer"]


class LaneMixer(nn.Module):
    """Doubly stochastic mixing of ``n`` lanes (MoE experts, parallel heads, ...).

    Static (``dynamic=False``): one learned ``P = lm.matrix()`` ``[n, n]``,
    ``out[..., i, :] = sum_j P[i, j] x[..., j, :]``. Dynamic (``dynamic=True``, needs ``dim``): one
    ``P`` per token from that token's lanes, ``lm.matrix(x) -> [..., n, n]``: the static logits plus
    a projection of the RMS-normalised flattened lanes (zero at init; ``rms_eps`` as in
    :class:`HyperConnection`).
    Shapes: ``forward(x [..., n, dim]) -> [..., n, dim]``.

    ``backend`` selects the Sinkhorn (:func:`~mhc.layer.sinkhorn`: Triton kernels for any
    ``n <= 64``) and the mix: the fused mixing kernel for ``n <= MAX_STREAMS`` (16), a batched
    matmul above (no fused kernel there; ``backend="triton"`` still runs the Sinkhorn kernels)."""

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(
        self,
        n_lanes: int,
        dim: int | None = None,
        iters: int = 20,
        dynamic: bool = False,
        backward: str = "exact",
        backend: str = "auto",
        rms_eps: float = DEFAULT_RMS_EPS,
    ):
        super().__init__()
        self.n_lanes = n = check_positive_int(n_lanes, "n_lanes")
        self.dim = None if dim is None else check_positive_int(dim, "dim")
        if dynamic and dim is None:
            raise ValueError("a dynamic LaneMixer needs dim")
        check_settings(iters, backward, backend)
        self.iters, self.dynamic, self.backward, self.backend = iters, bool(dynamic), backward, backend
        self.rms_eps = check_rms_eps(rms_eps)
        self.logits = nn.Parameter(torch.empty(n, n))
        if self.dynamic:
            self.proj = nn.Parameter(torch.empty(n * dim, n * n))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Logits ``N(0, 0.02^2)``, a zero projection (DTensor parameters too, see
        :meth:`HyperConnection.reset_parameters`)."""
        assign(self.logits, torch.randn(self.logits.shape, dtype=self.logits.dtype) * 0.02)
        if self.dynamic:
            assign(self.proj, torch.zeros(self.proj.shape, dtype=self.proj.dtype))

    def matrix(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Static: ``[n, n]`` (``x`` not needed). Dynamic: ``[..., n, n]`` for lanes ``x [..., n, dim]``
        (a ``DTensor`` of ``x``'s layout for a token-sharded ``DTensor`` ``x``)."""
        x, layout = local_tokens(x, 2, "LaneMixer")
        return as_dtensor(self._matrix(x, layout), layout if self.dynamic else None)

    def _matrix(self, x, layout):
        params = (self.logits, self.proj if self.dynamic else None)
        logits, proj = local_parameters(self, params, layout, tokens=x is not None)
        logits = logits.to(coefficient_dtype(logits))
        if self.dynamic:
            if x is None:
                raise ValueError("a dynamic LaneMixer needs the lanes x to build its matrices")
            self._check_input(x)
            dtype = coefficient_dtype(x, proj)
            v = rearrange(x.to(dtype), "... s d -> ... (s d)")
            dyn = (v @ proj.to(dtype)) * rms_inverse(v, self.rms_eps)
            logits = logits + rearrange(dyn, "... (t s) -> ... t s", t=self.n_lanes)
        return sinkhorn(logits, self.iters, backward=self.backward, backend=self.backend)

    def _check_input(self, x) -> None:
        check_streams_shape(x, self.n_lanes, self.dim, "x")
        check_same_device(x, self.logits.device, "x", "the layer's parameters")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = local_tokens(x, 2, "LaneMixer")
        self._check_input(x)
        p = self._matrix(x, layout)
        n = self.n_lanes
        if n <= MAX_STREAMS and choose(self.backend, x, "mixing", n) == "triton":
            T = math.prod(x.shape[:-2])
            p = p.float().reshape(T, n, n) if self.dynamic else p.float().expand(T, n, n)
            return as_dtensor(post_mix(x, None, None, p), layout)
        return as_dtensor(p.to(x.dtype) @ x, layout)  # [n, n] or [..., n, n] @ [..., n, dim]: no view

    def extra_repr(self) -> str:
        return f"n_lanes={self.n_lanes}, dim={self.dim}, iters={self.iters}, dynamic={self.dynamic}"
