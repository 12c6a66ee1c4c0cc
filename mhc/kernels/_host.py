"""Reading a device scalar on the host without draining the GPU's queue.

``t.item()`` waits for everything queued on the stream and leaves the GPU idle until the host
queues more. ``read_later(t)`` starts the copy now and returns a function that waits only for
that copy: kernels queued in between keep the GPU busy while the host waits.
"""

from __future__ import annotations

from typing import Callable

import torch


def read_later(t: torch.Tensor) -> Callable[[], float | int | bool]:
    """``t`` (one element) -> a function returning the value ``t`` holds now, as ``t.item()``
    would. On CUDA the copy to the host is queued here (after the work that computes ``t``) and
    the function waits for that copy alone, not for work queued after it."""
    if not t.is_cuda:
        value = t.item()
        return lambda: value
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def value():
        copied.synchronize()
        return host.item()

    return value
