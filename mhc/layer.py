"""The Sinkhorn operator: the functional :func:`sinkhorn` (:mod:`mhc.ops.sinkhorn`) and its module
:class:`FusedMHC`."""

from __future__ import annotations

import torch
from torch import nn

from mhc._checks import MAX_N, check_settings
from mhc.ops.sinkhorn import sinkhorn

__all__ = ["sinkhorn", "FusedMHC", "MAX_N"]


class FusedMHC(nn.Module):
    """Sinkhorn-Knopp as a module (no parameters): ``[..., n, n]`` logits -> doubly stochastic.

    ``FusedMHC(mhc_iters=20, backward="exact", backend="auto")``; see :func:`sinkhorn`."""

    def __init__(self, mhc_iters: int = 20, backward: str = "exact", backend: str = "auto"):
        super().__init__()
        check_settings(mhc_iters, backward, backend)
        self.mhc_iters = mhc_iters
        self.backward = backward
        self.backend = backend

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return sinkhorn(logits, self.mhc_iters, backward=self.backward, backend=self.backend)

    def extra_repr(self) -> str:
        return f"mhc_iters={self.mhc_iters}, backward={self.backward!r}, backend={self.backend!r}"
