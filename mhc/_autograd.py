"""Double backward: which autograd Functions of the package support it, and the check of those
that do not.

A backward run with ``create_graph=True`` (``torch.autograd.grad(..., create_graph=True)``, a
gradient penalty, Hessian-vector products) runs with grad mode on. The Triton kernels' gradients
(and the fused loss's chunked PyTorch backward) carry no autograd graph, so a second derivative
through them would silently be zero: every such Function calls
:func:`refuse_double_backward` first and raises instead. The Sinkhorn
(:class:`mhc.layer.SinkhornFunction`) supports double backward by
recomputing its gradient with the PyTorch reference there; the ``"torch"`` paths of every layer
support it. ``docs/inputs.md`` lists them.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_double_backward"]


TORCH_BACKEND = "Run it with backend='torch' to differentiate its gradient"


def refuse_double_backward(op: str, alternative: str = TORCH_BACKEND) -> None:
    """Raise ``RuntimeError`` when called from a backward that builds a graph (``create_graph``)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support double backward: its gradient is computed without an autograd "
            f"graph, so a second derivative through it would be missing. {alternative}, or call "
            f"backward / autograd.grad without create_graph=True"
        )
