"""Which implementation runs an op: the one place that decides.

Every public entry point (``sinkhorn``, a site, ``LaneMixer``, ``stream_collapse``, the fused
loss) takes ``backend="auto" | "triton" | "torch"`` and asks :func:`choose` once per call:

- ``"auto"``: the Triton kernels for CUDA tensors the kernels take (``n`` within their limit,
  the loss's dtypes), the PyTorch reference everywhere else: the CPU, ``torch.func`` transforms
  and forward-mode AD (which autograd Functions cannot run under), meta and fake tensors;
- ``"triton"``: the kernels, or an error that says why they cannot run (nothing falls back);
- ``"torch"``: the PyTorch reference (:mod:`mhc.reference`).

On a CPU the reference is the path: the same PyTorch ops the tests trust in fp64. For a faster
CPU run, compile the model (``torch.compile``: Inductor's C++ backend on the reference ops).
"""

from __future__ import annotations

import torch

from mhc._checks import MAX_EPS_N, MAX_N, MAX_STREAMS, check_no_transform
from mhc._compat import transforms_active, without_values

__all__ = ["choose", "LIMITS"]

# what each kind of op's kernels take: the largest n, or the dtypes (the loss)
LIMITS = {
    "sinkhorn": MAX_N,
    "sinkhorn_eps": MAX_EPS_N,
    "mixing": MAX_STREAMS,
}
LOSS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_WHAT = {
    "sinkhorn": "the Triton kernels take",
    "sinkhorn_eps": "the Triton kernels with eps > 0 take",
    "mixing": "the fused mixing kernels take",
}


_NO_TRANSFORM = {
    "sinkhorn": "the Triton Sinkhorn",
    "sinkhorn_eps": "the Triton Sinkhorn",
    "mixing": "the fused path (backend='triton')",
}


def _kernels():
    import mhc.kernels  # on first use: CPU-only users of the reference never need Triton

    return mhc.kernels


def choose(backend: str, x: torch.Tensor, op: str, n: int | None = None) -> str:
    """``"triton"`` or ``"torch"`` for ``op`` (``"sinkhorn"``, ``"sinkhorn_eps"``, ``"mixing"`` or
    ``"loss"``) on tensors like ``x`` with ``n`` streams (matrices ``[n, n]``); ``backend`` as the
    caller was given it (checked there). Raises ``ValueError`` / ``RuntimeError`` where
    ``backend="triton"`` cannot run."""
    if op == "loss":
        return _choose_loss(backend, x)
    limit = LIMITS[op]
    if backend == "auto":
        return "triton" if x.is_cuda and n <= limit and not transforms_active() else "torch"
    if backend == "triton":
        if n > limit:
            raise ValueError(f"{_WHAT[op]} n <= {limit}, got n = {n}; use backend='torch'")
        check_no_transform(_NO_TRANSFORM[op])
        _kernels().check_device(x)
    return backend


def _choose_loss(backend: str, x: torch.Tensor) -> str:
    if x.shape[-1] == 0:  # no features: the logits are the bias (or 0), no product to fuse
        return "torch"
    if backend == "auto":
        backend = "triton" if x.is_cuda and x.dtype in LOSS_DTYPES else "torch"
    elif backend == "triton":
        if x.dtype not in LOSS_DTYPES:
            raise ValueError(
                f"the Triton kernels take float16, bfloat16 or float32, got {x.dtype}; use backend='torch'"
            )
        _kernels().check_device(x)
    # a fake CUDA tensor has no data for a kernel to read: the same passes as PyTorch ops
    return "torch" if without_values(x) else backend
