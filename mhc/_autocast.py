"""Autocast queries that also hold on devices without autocast.

``torch.is_autocast_enabled``, ``torch.get_autocast_dtype`` and ``torch.autocast`` raise for a
device type autocast does not know, such as ``"meta"`` (tensors with shapes and no data, which
model-size and FLOP estimates run forwards on). There is no autocast state to read or change
there, so these helpers answer "off" and do nothing.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_available", "autocast_enabled", "autocast_off", "autocast_state", "autocast_restored"]


def autocast_available(device_type: str) -> bool:
    """Whether ``torch.autocast`` knows ``device_type``."""
    if device_type in ("cuda", "cpu"):  # no call: Dynamo before PyTorch 2.13 cannot trace the query
        return True
    return torch.amp.is_autocast_available(device_type)


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (``False`` where autocast is unknown)."""
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context that turns autocast off on ``device_type``; a no-op where autocast is unknown."""
    if autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_state(device_type: str) -> dict | None:
    """The arguments of ``torch.autocast`` that restore the current autocast state of
    ``device_type`` (as ``torch.utils.checkpoint`` replays its forward); ``None`` where autocast
    is unknown."""
    if not autocast_available(device_type):
        return None
    return dict(
        device_type=device_type,
        enabled=torch.is_autocast_enabled(device_type),
        dtype=torch.get_autocast_dtype(device_type),
        cache_enabled=torch.is_autocast_cache_enabled(),
    )


def autocast_restored(state: dict | None):
    """A context under the autocast state :func:`autocast_state` returned (a no-op for ``None``)."""
    return contextlib.nullcontext() if state is None else torch.autocast(**state)
