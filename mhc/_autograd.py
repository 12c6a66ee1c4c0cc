"""Double backward: the check of the autograd Functions that do not support it (``docs/inputs.md``).

The kernels' gradients carry no autograd graph, so a second derivative through them would be
silently zero: such a Function calls :func:`refuse_double_backward` first and raises instead. The
Sinkhorn supports double backward (the reference recomputes its gradient), as do the ``"torch"``
paths of every layer.
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
