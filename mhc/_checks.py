"""The input checks of the layers (sites, mixing modules, the functional ``sinkhorn``) and the
limits they check against. The kernels' own launcher checks are :mod:`mhc.kernels._checks`: the
kernel layer imports nothing above it, so the limits it owns are repeated here (tests keep them
equal) and ``import mhc`` never needs Triton.
"""

from __future__ import annotations

import math

import torch

from mhc._compat import transforms_active

BACKWARDS = ("exact", "implicit")
BACKENDS = ("auto", "triton", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_N = 64  # largest Sinkhorn matrix the kernels take (mhc.kernels.MAX_N)
MAX_EPS_N = 16  # largest matrix the eps > 0 kernels take (mhc.kernels.MAX_EPS_N)
MAX_STREAMS = 16  # largest n the fused mixing kernels take (mhc.kernels.MAX_STREAMS)
# RMS epsilon of the coefficient projection. The paper prints 1e-20, for which the gradient of a
# zero token is ~1e10 |a| |phi|; 1e-6 bounds it by 1e3 |a| |phi| (docs/mixing.md, "Zero and tiny tokens").
DEFAULT_RMS_EPS = 1e-6


def check_settings(iters, backward, backend, eps=0.0) -> float:
    """Validate the Sinkhorn settings shared by :func:`sinkhorn` and every module built on it;
    returns ``eps`` as a float."""
    if isinstance(iters, bool) or not isinstance(iters, int):
        raise TypeError(f"iters must be an int, got {type(iters).__name__}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite float >= 0, got {eps}")
    if eps > 0 and backward != "exact":
        raise ValueError("eps > 0 (DeepSeek-V4's Sinkhorn) has the exact backward only: use backward='exact'")
    return float(eps)


def check_floating(x, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {x.dtype}")


def check_streams_shape(x: torch.Tensor, n: int, dim: int | None, what: str) -> None:
    check_floating(x, what)
    if x.dim() < 2 or x.shape[-2] != n or (dim is not None and x.shape[-1] != dim):
        want = f"[..., {n}, {dim if dim is not None else 'dim'}]"
        raise ValueError(f"{what} must have shape {want}, got {tuple(x.shape)}")


def check_same_device(t: torch.Tensor, device: torch.device, what: str, where: str) -> None:
    """``t`` must be on ``device`` (the kernels take one device's pointers; PyTorch's own error
    names neither tensor)."""
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, {where} on {device}")


def check_site_input(x: torch.Tensor, n: int, dim: int, parameters) -> None:
    """Streams ``x [..., n, dim]`` on the device of every tensor of ``parameters`` (``None``
    entries skipped): the kernels take the parameters' addresses as they are, with no driver check
    per launch."""
    check_streams_shape(x, n, dim, "x")
    for p in parameters:
        if p is not None:
            check_same_device(x, p.device, "x", "the layer's parameters")


def check_operand(t, shapes: tuple, what: str, device: torch.device, where: str = "x") -> None:
    """A floating-point tensor of one of ``shapes`` (tuples) on ``device`` (``where``'s)."""
    check_floating(t, what)
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{what} must have shape {want}, got {list(t.shape)}")
    check_same_device(t, device, what, where)


def check_no_transform(
    what: str, instead: str = "use backend='torch' or 'auto' with backward='exact' (PyTorch ops)"
) -> None:
    """Raises ``RuntimeError`` where a ``torch.func`` transform runs or forward-mode AD is on:
    ``what`` is an autograd Function, which neither can run; ``instead`` says what can."""
    if transforms_active():
        raise RuntimeError(
            f"{what} runs as an autograd.Function, which torch.func transforms (grad, vmap, jvp, ...) and "
            f"forward-mode AD (torch.autograd.forward_ad) cannot run; there {instead}"
        )


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_rms_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"rms_eps must be a float, got {type(eps).__name__}")
    if not (0.0 < eps < math.inf):
        raise ValueError(f"rms_eps must be a finite float > 0, got {eps}")
    return float(eps)
