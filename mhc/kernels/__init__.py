"""Triton kernels and their launchers. Importing this module needs Triton.

Set ``TRITON_INTERPRET=1`` before the first import to run the kernels on CPU tensors (slow; tests).
"""

import os

from mhc.kernels._tiles import MAX_N
from mhc.kernels.mhc_coefficients import coefficients_bwd, coefficients_fwd
from mhc.kernels.sinkhorn import sinkhorn_bwd, sinkhorn_fwd
from mhc.kernels.sinkhorn_eps import MAX_EPS_N, sinkhorn_eps_bwd, sinkhorn_eps_fwd
from mhc.kernels.sinkhorn_implicit import sinkhorn_implicit_bwd
from mhc.kernels.stream_mix import MAX_STREAMS, stream_mix_bwd, stream_mix_fwd

# Triton decides at decoration time whether kernels are compiled or interpreted.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(tensor) -> None:
    """Raise unless the kernels can run on ``tensor``: CUDA, or any device under the interpreter."""
    if not tensor.is_cuda and not INTERPRET:
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before mhc is "
            f"imported to run the kernels on the CPU; got a tensor on {tensor.device}"
        )


__all__ = [
    "MAX_N",
    "MAX_EPS_N",
    "MAX_STREAMS",
    "INTERPRET",
    "check_device",
    "sinkhorn_fwd",
    "sinkhorn_bwd",
    "sinkhorn_eps_fwd",
    "sinkhorn_eps_bwd",
    "sinkhorn_implicit_bwd",
    "stream_mix_fwd",
    "stream_mix_bwd",
    "coefficients_fwd",
    "coefficients_bwd",
]
