"""Which implementation runs an op: the one place that decides (``docs/architecture.md``).

Every entry point takes ``backend="auto" | "triton" | "torch"`` and asks :func:`choose` (the loss:
:func:`choose_loss`) once per call. ``"auto"``: the kernels for CUDA tensors they take, the PyTorch
reference elsewhere (a CPU, ``torch.func`` transforms, forward-mode AD); ``"triton"``: the kernels
or an error saying why not; ``"torch"``: :mod:`mhc.reference`, the code the tests trust in fp64.
"""

from __future__ import annotations

import torch

from mhc._checks import MAX_EPS_N, MAX_N, MAX_STREAMS, check_no_transform
from mhc._compat import transforms_active, without_values
from mhc.ops.library import kernels

__all__ = ["choose", "choose_loss", "OPS"]

# per kind of op: the largest n its kernels take, what they are called in errors, and under transforms
OPS = {
    "sinkhorn": (MAX_N, "the Triton kernels", "the Triton Sinkhorn"),
    "sinkhorn_eps": (MAX_EPS_N, "the Triton kernels with eps > 0", "the Triton Sinkhorn"),
    "mixing": (MAX_STREAMS, "the fused mixing kernels", "the fused path (backend='triton')"),
}
LOSS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def choose(backend: str, x: torch.Tensor, op: str, n: int) -> str:
    """``"triton"`` or ``"torch"`` for ``op`` (``"sinkhorn"``, ``"sinkhorn_eps"`` or ``"mixing"``)
    on tensors like ``x`` with ``n`` streams (matrices ``[n, n]``); ``backend`` as the caller was
    given it (checked there). Raises ``ValueError`` / ``RuntimeError`` where ``backend="triton"``
    cannot run."""
    limit, kernels_name, under_transforms = OPS[op]
    if backend == "auto":
        return "triton" if x.is_cuda and n <= limit and not transforms_active() else "torch"
    if backend == "triton":
        if n > limit:
            raise ValueError(f"{kernels_name} take n <= {limit}, got n = {n}; use backend='torch'")
        check_no_transform(under_transforms)
        kernels().check_device(x)
    return backend


def choose_loss(backend: str, x: torch.Tensor) -> str:
    """:func:`choose` for the fused linear cross-entropy on inputs like ``x [..., features]``."""
    if x.shape[-1] == 0:  # no features: the logits are the bias (or 0), no product to fuse
        return "torch"
    if backend == "auto":
        backend = "triton" if x.is_cuda and x.dtype in LOSS_DTYPES else "torch"
    elif backend == "triton":
        if x.dtype not in LOSS_DTYPES:
            raise ValueError(
                f"the Triton kernels take float16, bfloat16 or float32, got {x.dtype}; use backend='torch'"
            )
        kernels().check_device(x)
    # a fake CUDA tensor has no data for a kernel to read: the same passes as PyTorch ops
    return "torch" if without_values(x) else backend
