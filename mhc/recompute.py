"""Recomputing the streams in the backward: mHC at about the plain model's activation memory
(arXiv 2512.24880, section 4.3).

Without recompute every site saves the streams it reads, ``n * dim`` values per token. With
:func:`recompute_streams`, the sites of a model form blocks of ``every`` consecutive sites (in the
order they run); only the first site of a block keeps its streams. Every later site keeps a
*recipe* instead: the block's first streams ``x_s`` and the post-mix steps since,
``x_{k+1} = h_res_k x_k + h_post_k y_k``, whose per-token coefficients and branch outputs ``y_k``
the post-mixes keep anyway. The backward rebuilds the streams with the forward's own mixing
kernel (so they are bit-identical to the forward's); the branches never run again.

``docs/recompute.md`` gives the memory arithmetic, the measurements and why the design is a
model-level setting rather than an argument of each site.
"""

from __future__ import annotations

import math

from torch import nn

from mhc.rebuild import StreamRecompute
from mhc.sites import Site

__all__ = ["recompute_streams", "optimal_block", "StreamRecompute"]


def optimal_block(n_streams: int, n_sites: int) -> int:
    """The paper's block length ``L_r* = sqrt(n L / (n + 2))`` for ``n`` streams and ``L`` sites,
    rounded to the nearest integer, at least 1."""
    return max(1, round(math.sqrt(n_streams * n_sites / (n_streams + 2))))


# ------------------------------------------------------------------------------ the setting


def _sites(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Site)]


def recompute_streams(model: nn.Module, every: int | None = None) -> StreamRecompute | None:
    """Recompute the streams of ``model``'s hyper-connection sites in the backward instead of
    saving them; returns the setting (``None`` when turned off).

    Args:
        model: any module holding :class:`mhc.mixing.HyperConnection` sites (or sites of a model
            patched by :func:`mhc.integrations.transformers.patch_deepseek_v4`), called one by
            one or chained with ``finish(y, next=)``.
        every: the block length ``L_r``: the streams are kept at the first of every ``every``
            consecutive sites and rebuilt for the others. ``None``: the paper's optimum
            :func:`optimal_block` for the model's ``n`` and number of sites, which balances the
            kept streams against one block's rebuilt ones; where a step peaks before the backward
            rebuilds any (a compiled model, often), longer blocks hold less (docs/recompute.md).
            ``1`` turns recompute off (every site keeps its streams, as without this call).

    Gradients are those without recompute: the backward rebuilds the streams with the forward's
    mixing ops. A block ends early where the streams are changed between two sites (a new tensor,
    or the same one modified in place), where the path changes (fused / reference), inside
    ``torch.utils.checkpoint`` (checkpointing decides what is saved there) and with grad mode off.
    Under ``torch.compile`` an in-place change between two sites cannot be seen (tensor versions do
    not trace): change the streams out of place there (``x = x * s``, not ``x.mul_(s)``).

    Raises:
        TypeError: ``model`` is not a module, has no ``forward`` of its own (an ``nn.ModuleList``),
            or ``every`` is not an int.
        ValueError: ``every < 1``, or ``model`` has no hyper-connection site.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
        raise TypeError(f"every must be an int or None, got {type(every).__name__}")
    if every is not None and every < 1:
        raise ValueError(f"every must be >= 1 (1 turns recompute off), got {every}")
    if type(model).forward is nn.Module.forward:
        raise TypeError(
            f"model must be the module whose forward runs the sites, got a {type(model).__name__} without a "
            "forward of its own: recompute_streams clears its state around the model's forward (hooks on that "
            "forward), and a container's would never run. Pass the model that calls these modules."
        )
    sites = _sites(model)
    if not sites:
        raise ValueError("model holds no hyper-connection site (HyperConnection or a patched model's)")
    for handle in getattr(model, "_mhc_recompute_hooks", ()):
        handle.remove()
    if every is None:
        every = optimal_block(max(s.n_streams for s in sites), len(sites))
    setting = StreamRecompute(every, last_site=sites[-1]) if every > 1 else None
    for site in sites:
        site._recompute = setting
    model._mhc_recompute = setting
    model._mhc_recompute_hooks = (
        ()
        if setting is None
        else (model.register_forward_pre_hook(_clear_before), model.register_forward_hook(_clear_after))
    )
    return setting


# Module-level hooks (not closures): a copied or pickled model keeps hooks that find its own setting.
def _clear_before(model, args) -> None:
    model._mhc_recompute.clear()


def _clear_after(model, args, output) -> None:
    model._mhc_recompute.clear()
