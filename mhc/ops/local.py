"""Per-token modules on ``DTensor``\\ s (``docs/distributed.md``): a token-sharded input runs as its
local shard (:func:`local_tokens`) and comes back as a ``DTensor`` of the input's layout, uneven
shards included (:func:`as_dtensor`); replicated ``DTensor`` parameters are taken as their local
tensors (:func:`local_parameters`), whose gradients are ``Partial()`` over the mesh dims that shard
the tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mhc._compat import is_dtensor, unsharded_dtensor

__all__ = ["TokenLayout", "local_tokens", "as_dtensor", "local_parameters", "assign"]


class TokenLayout(NamedTuple):
    """How a ``DTensor`` input was laid out: its mesh and placements, its global token dims
    ``lead``, and the placements of the parameters' gradients (``grads``)."""

    mesh: object
    placements: tuple
    lead: tuple
    grads: tuple


def local_tokens(x, trailing: int, what: str):
    """``(local, layout)``: the local shard of ``x`` (a ``DTensor`` whose dims but the last
    ``trailing`` are tokens), and its :class:`TokenLayout`; ``(x, None)`` for any other tensor.
    Raises ``ValueError`` for a ``DTensor`` sharded over a non-token dim or holding partial sums."""
    if not is_dtensor(x):
        return x, None
    from torch.distributed.tensor import Partial, Replicate

    tokens = x.dim() - trailing
    for p in x.placements:
        if p.is_partial() or (p.is_shard() and not 0 <= p.dim % x.dim() < tokens):
            raise ValueError(
                f"{what} computes per token: a DTensor input may be sharded over its token dims (the first "
                f"{tokens} of shape {tuple(x.shape)}) or replicated, got placements {tuple(x.placements)}; "
                "redistribute it first, e.g. x.redistribute(mesh, [Shard(1)])"
            )
    grads = tuple(Partial() if p.is_shard() else Replicate() for p in x.placements)
    layout = TokenLayout(x.device_mesh, tuple(x.placements), tuple(x.shape[:tokens]), grads)
    return x.to_local(grad_placements=x.placements), layout


def local_like(t, layout: TokenLayout | None, what: str):
    """A branch output ``t`` as the local shard of ``layout``'s tokens: a ``DTensor`` is
    redistributed to ``layout``'s placements first (a tensor-parallel branch's output, replicated
    or partial); a plain tensor is taken as the local shard already."""
    if layout is None or not is_dtensor(t):
        return t
    if t.device_mesh != layout.mesh:
        raise ValueError(f"{what} is a DTensor on another mesh than the streams': {t.device_mesh} vs {layout.mesh}")
    if tuple(t.placements) != layout.placements:
        t = t.redistribute(layout.mesh, layout.placements)
    return t.to_local(grad_placements=layout.placements)


def as_dtensor(t: torch.Tensor, layout: TokenLayout | None):
    """``t`` (a local result whose leading dims are the local tokens) as a ``DTensor`` of
    ``layout``: its mesh and placements, the global token dims and ``t``'s trailing ones, with
    contiguous strides. ``t`` itself where ``layout`` is ``None``."""
    if layout is None:
        return t
    from torch.distributed.tensor import DTensor

    shape = torch.Size((*layout.lead, *t.shape[len(layout.lead) :]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t, layout.mesh, layout.placements, run_check=False, shape=shape, stride=stride)


def local_parameters(module, params: tuple, layout: TokenLayout | None = None, tokens: bool = True) -> tuple:
    """``params`` (tensors or ``None``) as the ops take them: ``DTensor`` parameters as their local
    tensors with the gradient placements of ``layout``; plain ones as they are. A ``TypeError`` for
    plain parameters with a ``DTensor`` input (their gradients would cover one rank's tokens), and for
    ``DTensor`` parameters with a plain input to a module that is not sequence-parallel, unless no
    tokens come in (``tokens=False``: a static ``LaneMixer``'s matrix)."""
    dtensors = [p for p in params if p is not None and is_dtensor(p)]
    if not dtensors:
        if layout is not None and any(p is not None for p in params):
            raise TypeError(
                f"{type(module).__name__} got a DTensor input but its parameters are plain tensors, whose "
                "gradients would cover this rank's tokens only: make them DTensors replicated over the input's "
                "mesh (mhc.distributed.parallelize_sites(model, mesh), or torch's distribute_module / "
                "SequenceParallel()), or pass the local tensor (x.to_local()) and reduce the gradients yourself"
            )
        return params
    if layout is None and not module._mhc_sequence_parallel:
        if not tokens:
            return params
        raise TypeError(
            f"{type(module).__name__} got a plain tensor input but its parameters are DTensors: pass the "
            "input as a DTensor sharded over its tokens (the module runs on the local shard), or call "
            "mhc.distributed.parallelize_sites(model, mesh) to hand it local shards"
        )
    for p in dtensors:
        if not _replicated(p):
            raise ValueError(
                f"{type(module).__name__}'s parameters must be replicated DTensors (Replicate() on every mesh "
                f"dim), got placements {tuple(p.placements)}"
            )
        if layout is not None and p.device_mesh != layout.mesh:
            raise ValueError(
                f"{type(module).__name__}'s parameters live on {p.device_mesh}, its input on {layout.mesh}: "
                "replicate the parameters over the input's mesh"
            )
    if layout is None:  # parallelize_sites: a local shard of the tokens on every mesh dim
        from torch.distributed.tensor import Partial

        grads = (Partial(),) * dtensors[0].device_mesh.ndim
    else:
        grads = layout.grads
    if torch.compiler.is_compiling() or not all(p is None or is_dtensor(p) for p in params):
        return tuple(None if p is None else _local(p, grads) for p in params)
    present = [p for p in params if p is not None]
    local = iter(_LocalTensors.apply(grads, *present))
    return tuple(None if p is None else next(local) for p in params)


def _replicated(p) -> bool:
    return is_dtensor(p) and all(q.is_replicate() for q in p.placements)


def _local(p, grads):
    return p.to_local(grad_placements=grads) if is_dtensor(p) else p


class _LocalTensors(torch.autograd.Function):
    """``p.to_local(grad_placements=grads)`` for all of a module's replicated ``DTensor`` parameters in
    one autograd node, the gradients' specs reused (:func:`mhc._compat.unsharded_dtensor`). Double
    backward goes through ``DTensor.from_local``."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.meshes = [p.device_mesh for p in params]
        ctx.grads = grads
        ctx.set_materialize_grads(False)
        # without grad mode to_local() is the local tensor itself; autograd writes its metadata
        # into what a Function returns, hence fresh views
        return tuple(p.to_local().view_as(p.to_local()) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed.tensor import DTensor

        def gradient(g, mesh):
            if torch.is_grad_enabled():  # create_graph: a gradient that autograd differentiates again
                return DTensor.from_local(g, mesh, ctx.grads, run_check=False)
            return unsharded_dtensor(g, mesh, ctx.grads)

        return None, *(None if g is None else gradient(g, mesh) for g, mesh in zip(grads, ctx.meshes))


def assign(param, value) -> None:
    """``param.copy_(value)`` for a whole-tensor ``value`` (built on the host): a ``DTensor``
    parameter (FSDP2's shards, a replicated site) takes its part of it, rank 0's values on every
    rank. Call under ``torch.no_grad()``."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
