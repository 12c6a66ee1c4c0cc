"""Activation checkpointing of models with hyper-connection sites (``docs/recompute.md``).

``torch.utils.checkpoint`` works on layers holding sites, eager and compiled. In addition:
:func:`checkpoint_policy`, a selective checkpointing policy over ``mhc``'s ops, and
:func:`checkpoint_layers`, ``every`` consecutive layers as one region.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from mhc._compat import marked_must_save

__all__ = ["checkpoint_policy", "checkpoint_layers", "SAVABLE_OPS"]

# mhc's forward ops whose outputs a policy may keep (names in the "mhc" op namespace):
# the dynamic-mHC coefficients with the pre-mix (branch input, per-token coefficients), the
# stream mix (pre-mix of the other sources, post-mix: new streams) and the Sinkhorn forwards.
SAVABLE_OPS = ("mhc_coefficients_fwd", "stream_mix_fwd", "sinkhorn_fwd", "sinkhorn_eps_fwd")


def _mhc_op_name(op) -> str | None:
    """``"stream_mix_fwd"`` for ``torch.ops.mhc.stream_mix_fwd.default``; ``None`` for other ops."""
    schema = getattr(op, "_schema", None)
    if getattr(op, "namespace", None) != "mhc" or schema is None:
        return None
    return schema.name.split("::", 1)[1]


def checkpoint_policy(save: Iterable[str] = (), otherwise: Callable | None = None) -> Callable:
    """A selective activation checkpointing policy for ``mhc``'s ops.

    Inside a region checkpointed with ``context_fn=functools.partial(create_selective_checkpoint_contexts,
    policy)``, the ``mhc`` ops named in ``save`` keep their outputs and every other ``mhc`` op is
    recomputed; ops that are not ``mhc``'s are decided by ``otherwise(ctx, op, *args, **kwargs)``
    (default: recompute), so that it composes with a model's own policy. Eager and compiled alike.

    Args:
        save: names from :data:`SAVABLE_OPS`. ``("mhc_coefficients_fwd",)`` keeps each site's branch
            input and per-token coefficients, so that the backward recomputes only the post-mixes.
        otherwise: the policy of every other op, or ``None``.

    Raises:
        ValueError: a name in ``save`` is not in :data:`SAVABLE_OPS`.
        TypeError: ``save`` is a single string, or ``otherwise`` is not callable."""
    if isinstance(save, str):
        raise TypeError(f"save must be a collection of op names, got the string {save!r}; write ({save!r},)")
    save = tuple(save)
    unknown = [name for name in save if name not in SAVABLE_OPS]
    if unknown:
        raise ValueError(f"save takes names from {SAVABLE_OPS}, got {unknown}")
    if otherwise is not None and not callable(otherwise):
        raise TypeError(f"otherwise must be a policy function or None, got {type(otherwise).__name__}")
    saved = frozenset(save)

    def policy(ctx, op, *args, **kwargs):
        name = _mhc_op_name(op)
        if name is None:
            return CheckpointPolicy.PREFER_RECOMPUTE if otherwise is None else otherwise(ctx, op, *args, **kwargs)
        if name in saved or marked_must_save():  # the latter: a compiled region's output
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_layers(
    layers: Sequence[Callable], x: torch.Tensor, *args, every: int = 1, context_fn: Callable | None = None, **kwargs
):
    """``x = layer(x, *args, **kwargs)`` for each of ``layers``, ``every`` consecutive layers per
    non-reentrant checkpoint region (the extra arguments go to every layer). A region keeps only its
    input streams; its backward holds its layers' recomputed activations at once. ``context_fn`` goes
    to ``torch.utils.checkpoint.checkpoint``. With grad mode off the layers just run.

    Raises:
        TypeError: ``every`` is not an int, a layer is not callable.
        ValueError: ``every < 1``."""
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"every must be an int, got {type(every).__name__}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise TypeError(f"layers[{i}] must be callable, got {type(layer).__name__}")
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for first in range(0, len(layers), every):
        group = layers[first : first + every]
        if torch.is_grad_enabled():
            x = checkpoint(_run_group, group, x, *args, use_reentrant=False, **extra, **kwargs)
        else:
            x = _run_group(group, x, *args, **kwargs)
    return x


def _run_group(group, x, *args, **kwargs):
    for layer in group:
        x = layer(x, *args, **kwargs)
    return x
