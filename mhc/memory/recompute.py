"""Recomputing the streams in the backward: mHC at about the plain model's activation memory
(arXiv 2512.24880, section 4.3; ``docs/recompute.md``).

With :func:`recompute_streams` the sites form blocks of ``every`` consecutive sites; the first of
a block keeps its streams, the others a recipe (those streams and the post-mix steps since, whose
coefficients and branch outputs the post-mixes keep anyway). The backward rebuilds the streams
with the forward's mixing kernel, bit-identical; the branches never run again.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mhc._compat import in_backward, top_saved_tensor_hooks
from mhc.modules.site import KEEP_STREAMS, Site
from mhc.ops.rebuild import Plan, StreamsAt, reference_scope

__all__ = ["recompute_streams", "optimal_block", "StreamRecompute"]


def optimal_block(n_streams: int, n_sites: int) -> int:
    """The paper's block length ``L_r* = sqrt(n L / (n + 2))`` for ``n`` streams and ``L`` sites,
    rounded to the nearest integer, at least 1."""
    return max(1, round(math.sqrt(n_streams * n_sites / (n_streams + 2))))


# ------------------------------------------------------------------------------ the schedule
# StreamRecompute (one per model) follows the forward: which streams tensor continues the current
# block, its recipe, and where a new block starts. A site continues the block only if its input
# *is* the tensor the previous site returned (anything done to the streams in between starts a
# new block) and the block has room.


def _under_checkpoint() -> bool:
    """Whether ``torch.utils.checkpoint`` decides what this op saves (its forward, or its rerun in
    the backward; the reentrant form reruns in a backward without hooks): the sites there keep
    their streams, so that both runs save the same tensors and no block outlives the backward."""
    if torch.compiler.is_compiling():
        return False
    if in_backward():
        return True
    hooks = top_saved_tensor_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _kept(t: torch.Tensor | None) -> torch.Tensor | None:
    """What the setting keeps of a recipe tensor: under ``torch.compile`` a detached alias (a tensor held
    past the compiled forward becomes a graph output, and one that requires grad gets a gradient of
    zeros); eager mode keeps the tensor (the reference path's double backward goes through it)."""
    return t.detach() if t is not None and torch.compiler.is_compiling() else t


class StreamRecompute:
    """The recompute setting of one model's sites and the block its forward is building.

    ``every``: the block length ``L_r`` (sites per block; the first keeps its streams).
    ``last_site``: the model's last site in module order, which no site follows (``None``: not
    known). Made by :func:`recompute_streams`; sites read it as ``site._recompute``."""

    def __init__(self, every: int, last_site=None):
        self.every, self.last_site = every, last_site
        self.clear()

    def clear(self) -> None:
        """Forget the block being built (the model's forward hooks call this before and after
        each forward, so that no tensor outlives the forward here)."""
        self._start_block(None, None)

    def plan(self, x: torch.Tensor, path: str) -> Plan | None:
        """The plan of a site reading ``x`` on ``path`` (``"triton"`` or ``"torch"``): ``None`` when
        ``x`` starts a block (the site saves it), else the recipe that rebuilds it."""
        if not torch.is_grad_enabled() or _under_checkpoint():
            self.streams = None  # a site that saves its streams breaks the chain
            return None
        if self._current(x) and path == self.path and len(self.steps) < self.every:
            return Plan(self.start, tuple(self.steps), self.at, self, self.version)
        return None

    def _current(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is the streams the block's last step made, unchanged: the same tensor, not
        modified in place since (its version counter; not readable under ``torch.compile``)."""
        if x is not self.streams:
            return False
        return torch.compiler.is_compiling() or x._version == self.version

    def begin(self, x: torch.Tensor, path: str) -> None:
        """``x`` (as the site saved it) starts a block."""
        if torch.is_grad_enabled() and not _under_checkpoint():
            self._start_block(path, x)

    def _start_block(self, path: str | None, x: torch.Tensor | None) -> None:
        self.path, self.start, self.steps, self.streams, self.at, self.link = path, _kept(x), [], x, None, None
        self.version = 0
        if x is not None:
            self._stamp(x)

    def passes(self, x: torch.Tensor, x_pass: torch.Tensor) -> None:
        """A site's Function read ``x`` and returned the same streams as ``x_pass``."""
        if x is self.streams:
            self.streams = x_pass
            self._stamp(x_pass)

    def continues(self, x: torch.Tensor) -> bool:
        """Whether the streams after a post-mix of ``x`` stay in this block."""
        return self._current(x) and len(self.steps) + 1 < self.every

    def _stamp(self, x: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self.version = x._version

    def next_at(self) -> StreamsAt | None:
        """The cache of the position after the next step (``None`` under ``torch.compile``)."""
        return None if torch.compiler.is_compiling() else StreamsAt(self.at)

    def scope(self, plan: Plan | None, x: torch.Tensor, step, compiled: str = "raise"):
        """The reference path's ops on streams ``x`` save what rebuilds them from ``plan``
        (:func:`mhc.ops.rebuild.reference_scope`)."""
        return reference_scope(plan, x, step, compiled)

    def advance(self, x: torch.Tensor, step: tuple, out: torch.Tensor, at: StreamsAt | None, site=None) -> None:
        """A post-mix made ``out`` from ``x`` with ``step = (h_res, y, h_post)``; ``at``: the cache of
        ``out``'s position; ``site``: the site whose post-mix it was, if no site is chained to it. ``out``
        is kept for the next site's identity check unless the block is full or ``site`` is the last."""
        if not self._current(x):
            self.streams = None
            return
        self.steps.append(tuple(_kept(t) for t in step))
        ends = len(self.steps) >= self.every or (site is not None and site is self.last_site)
        self.streams, self.at = (None if ends else out), at
        self._stamp(out)


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
        ValueError: ``every < 1``, or ``model`` has no hyper-connection site."""
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
        site._recompute = KEEP_STREAMS if setting is None else setting
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
