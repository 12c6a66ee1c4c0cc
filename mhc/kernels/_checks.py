"""Argument checks of the public launchers: every tensor a kernel reads has the shape, dtype and
device the kernel assumes (its layout is the launcher's business: it copies what is not
contiguous). A wrong shape would otherwise be read out of bounds, so these raise ``ValueError`` /
``TypeError`` rather than assert (asserts vanish under ``python -O``)."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(t, name: str, shape=None, dtypes=FLOATS, device=None, where="the first tensor argument") -> None:
    """``t``: a tensor of ``shape`` (a tuple, or None for any), one of ``dtypes``, on ``device``
    (``where``'s)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = dtypes[0] if len(dtypes) == 1 else [str(d) for d in dtypes]
        raise TypeError(f"{name} must be {'one of ' if len(dtypes) > 1 else ''}{want}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, {where} on {device}")


def check_streams(x, name: str, max_n: int) -> None:
    """Streams ``x [..., N, D]`` of a float dtype with ``1 <= N <= max_n``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {got}")
    if x.dim() < 2 or not 1 <= x.shape[-2] <= max_n:
        raise ValueError(f"{name} must have shape [..., N, D] with 1 <= N <= {max_n}, got {list(x.shape)}")


def check_matrices(t, name: str, max_n: int) -> tuple[int, int]:
    """``t [T, n, n]`` of float matrices with ``1 <= n <= max_n``: ``(T, n)``."""
    check_tensor(t, name)
    if t.dim() != 3 or t.shape[1] != t.shape[2] or not 1 <= t.shape[1] <= max_n:
        raise ValueError(f"{name} must have shape [T, n, n] with 1 <= n <= {max_n}, got {list(t.shape)}")
    return t.shape[0], t.shape[1]


def check_positive(value, name: str, integer: bool = True) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")


F32 = (torch.float32,)
