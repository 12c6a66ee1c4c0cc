"""Launch limits per GPU architecture: the data the launchers' configurations are clamped to.

The kernels' tile shapes are rules in their launchers (each with its reason); what those rules
assume of the hardware is here, one row per architecture: how deep the software pipelining may go
in shared memory, whether the register caps tuned on that architecture apply, whether tensor
descriptors (Hopper's copy engine) are used, and the fused loss's tiles. ``hopper`` (H100, H200)
is what the kernels were tuned on (``python -m bench.tune_mixing``, ``bench.tune_sinkhorn``,
``bench.loss --sweep``; the measurements are in dev/LOG.md); ``default`` is a conservative row for
any other CUDA GPU Triton supports (A100, consumer GPUs, Blackwell until it is tuned): fewer
stages, the compiler's register allocation, pointer loads, smaller loss tiles.

``MHC_ARCH=hopper|default`` forces a row (set it before the first launch); otherwise the current
CUDA device's compute capability picks it (9.x: ``hopper``). One row serves the whole process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

__all__ = ["Arch", "ARCHS", "arch"]


@dataclass(frozen=True)
class Arch:
    name: str
    max_stages: int  # software-pipelining stages of the tiled loops (shared memory per SM)
    register_caps: bool  # apply the launchers' maxnreg caps (tuned on this architecture's SMs)
    tensor_descriptors: bool  # load the fused loss's tiles through TMA descriptors
    loss_tiles_16bit: tuple  # (lse, grad_logits, grad_logits_softcap, grad_input) of the fused loss


ARCHS = {
    "hopper": Arch(
        "hopper",
        max_stages=4,
        register_caps=True,
        tensor_descriptors=True,
        loss_tiles_16bit=((128, 256, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 3)),
    ),
    # about 100 KiB of shared memory per SM is the smallest of the GPUs Triton supports
    "default": Arch(
        "default",
        max_stages=2,
        register_caps=False,
        tensor_descriptors=False,
        loss_tiles_16bit=((64, 128, 64, 4, 2),) * 4,
    ),
}


@functools.cache
def arch() -> Arch:
    """The row this process launches with (``MHC_ARCH``, else the current CUDA device's)."""
    forced = os.environ.get("MHC_ARCH")
    if forced is not None:
        if forced not in ARCHS:
            raise ValueError(f"MHC_ARCH must be one of {sorted(ARCHS)}, got {forced!r}")
        return ARCHS[forced]
    if not torch.cuda.is_available():
        return ARCHS["hopper"]  # Triton's interpreter: the tuned rules, which it runs as they are
    major, _ = torch.cuda.get_device_capability()
    return ARCHS["hopper" if major == 9 else "default"]
