"""The paper's stability metric: the "Amax gain magnitude" of ``h_res`` per layer and composite
(:func:`amax_gain`), and :func:`collect_h_res`, which records the sites' ``h_res`` during a forward."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from mhc._checks import check_same_device
from mhc.modules.site import Site

__all__ = ["GainReport", "amax_gain", "collect_h_res"]


@dataclass
class GainReport:
    """ "Amax gain magnitude" (paper Fig. 3), averaged over tokens, for ``L`` layers.

    ``forward[l]`` / ``backward[l]``: max absolute row / column sum of layer ``l``'s ``h_res``.
    ``composite_forward[l]`` / ``composite_backward[l]``: the same for the product
    ``h_res[l] @ ... @ h_res[0]`` (the map from the input streams to layer ``l``'s output)."""

    forward: torch.Tensor
    backward: torch.Tensor
    composite_forward: torch.Tensor
    composite_backward: torch.Tensor


def _gains(m: torch.Tensor):
    a = m.abs()
    return a.sum(-1).amax(-1).mean(), a.sum(-2).amax(-1).mean()


def amax_gain(h_res: Sequence[torch.Tensor]) -> GainReport:
    """Per-layer and composite forward / backward gains of per-layer ``h_res`` ``[..., n, n]`` (fp64).

    ``h_res``: a list or tuple of ``L >= 1`` real tensors of one shape ``[..., n, n]`` (``n >= 1``,
    at least one token) on one device."""
    if isinstance(h_res, torch.Tensor) or not isinstance(h_res, Sequence):
        raise TypeError(
            f"h_res must be a sequence (list, tuple) of per-layer tensors, got {type(h_res).__name__} "
            f"(layers stacked in one tensor: pass list(h_res))"
        )
    if len(h_res) == 0:
        raise ValueError("h_res must hold at least one layer's matrices")
    for i, h in enumerate(h_res):
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"h_res[{i}] must be a torch.Tensor, got {type(h).__name__}")
        if h.is_complex() or h.dtype == torch.bool:
            raise TypeError(f"h_res[{i}] must hold real numbers, got {h.dtype}")
    shape, device = h_res[0].shape, h_res[0].device
    for i, h in enumerate(h_res):
        if h.shape != shape or h.dim() < 2 or h.shape[-1] != h.shape[-2]:
            raise ValueError(
                f"every h_res must have the shape [..., n, n] of the first, {tuple(shape)}; "
                f"got {tuple(h.shape)} at h_res[{i}]"
            )
        check_same_device(h, device, f"h_res[{i}]", "h_res[0]")
    if shape[-1] == 0 or math.prod(shape[:-2]) == 0:
        raise ValueError(f"h_res must hold at least one token's [n, n] matrix with n >= 1, got shape {tuple(shape)}")
    fwd, bwd, cfwd, cbwd = [], [], [], []
    composite = None
    for h in h_res:
        h = h.detach().double()
        composite = h if composite is None else h @ composite
        for out, val in zip((fwd, bwd), _gains(h)):
            out.append(val)
        for out, val in zip((cfwd, cbwd), _gains(composite)):
            out.append(val)
    return GainReport(*(torch.stack(v) for v in (fwd, bwd, cfwd, cbwd)))


@contextlib.contextmanager
def collect_h_res(model: nn.Module) -> Iterator[list]:
    """Record the ``h_res`` of every hyper-connection site in ``model`` during the block.

    ``with collect_h_res(model) as h_res: model(x)``; then ``h_res`` holds one detached
    ``[..., n, n]`` tensor per hyper-connection call, in call order: ready for :func:`amax_gain`.
    Blocks nest: an inner block records what the outer one does while both are open."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    records: list = []
    layers = [m for m in model.modules() if isinstance(m, Site)]
    for m in layers:  # blocks nest: every open block records
        m._recorder = (m._recorder or ()) + (records,)
    try:
        yield records
    finally:
        for m in layers:
            m._recorder = tuple(r for r in m._recorder if r is not records) or None
