"""Sequence parallelism for hyper-connection sites (``docs/distributed.md``).

Everything a site computes is per token, so under sequence parallelism it runs on its rank's shard
of the streams as it is. :func:`parallelize_sites` makes the sites' parameters ``DTensor``\\ s
``Replicate()``-d over the tensor-parallel mesh; each rank's gradient (its tokens' share,
``Partial()``) is reduced once at the end of the backward, one all-reduce per mesh and dtype
(FSDP2 on a ``(dp, tp)`` mesh reduces them itself). The branches follow the model's own plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mhc._compat import after_backward, backward_task, unsharded_dtensor
from mhc.modules import LaneMixer, Site, StreamCollapse, StreamExpand

__all__ = ["parallelize_sites", "reduce_gradients"]

PER_TOKEN = (Site, LaneMixer, StreamCollapse, StreamExpand)


def reduce_gradients(params, group=None) -> int:
    """Sum every gradient that reaches ``params`` over ``group`` (the default process group if
    ``None``) before it accumulates in ``.grad``: for parameters replicated over ranks that each
    see part of the tokens (a branch's norm under sequence parallelism, say). Each backward
    contribution is reduced once, so gradient accumulation over micro-batches stays right.
    Returns how many parameters got the hook.

    The hooks sit on these parameter objects: under FSDP2, which computes with unsharded copies,
    they never run. There, make the parameters ``DTensor``\\ s replicated over the group, as
    :func:`parallelize_sites` does for the sites."""
    count = 0
    for p in params:
        if p.requires_grad:
            p.register_hook(_summed_over(group))
            count += 1
    return count


def _summed_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def parallelize_sites(model: nn.Module, mesh=None) -> nn.Module:
    """Make every per-token ``mhc`` module of ``model`` (sites, ``LaneMixer``, ``StreamCollapse``,
    ``StreamExpand``) run on sequence-sharded activations; returns ``model``, changed in place.

    Their own parameters become ``DTensor``\\ s replicated over ``mesh`` (a 1-D ``DeviceMesh`` such as
    ``mesh["tp"]``, or a process group; default: the default group) with rank 0's values. Their
    gradients, partial sums over the ranks' tokens, are all-reduced at the end of each backward, one
    collective per mesh and dtype (under FSDP2: by FSDP2). The modules then take their rank's tokens
    as plain local shards or as token-sharded ``DTensor``\\ s. Call it after initialisation and before
    ``fully_shard``. The branches' parameters are left to the model's tensor-parallel plan; tensor
    parallel without sequence parallel needs no call.

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: ``model`` holds no such module, they were parallelized already, or ``mesh``
            has more than one dimension."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if isinstance(m, PER_TOKEN)]
    if not modules:
        raise ValueError("model holds no hyper-connection site or stream module to parallelize")
    if any(m._mhc_sequence_parallel for m in modules):
        raise ValueError("these sites are sequence-parallel already: parallelize_sites runs once per model")
    mesh = _one_dim_mesh(mesh, next(modules[0].parameters()).device.type)
    reducer = _PartialGradients()
    for module in modules:
        _replicate_parameters(module, mesh, reducer)
        module._mhc_sequence_parallel = True
    return model


def _one_dim_mesh(mesh, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        mesh = DeviceMesh.from_group(mesh or dist.group.WORLD, device_type)
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_sites takes a 1-D mesh (the tensor-parallel one, e.g. mesh['tp']), got a {mesh.ndim}-D mesh"
        )
    return mesh


def _replicate_parameters(module: nn.Module, mesh, reducer: _PartialGradients) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    for name, p in list(module.named_parameters(recurse=False)):
        replicated = distribute_tensor(p.detach(), mesh, [Replicate()])  # rank 0's values on every rank
        param = nn.Parameter(replicated, requires_grad=p.requires_grad)
        if param.requires_grad:
            reducer.add(param)
        module.register_parameter(name, param)


class _PartialGradients:
    """Reduces the partial-sum gradients of one model's site parameters once per backward: each
    parameter's accumulation marks it, and at the end of the backward the marked gradients of one
    mesh and dtype go through a single all-reduce. One collective per parameter would cost each its
    own launch and ``DTensor`` redistribution on the host, in the middle of the backward."""

    def __init__(self):
        self.order: dict[int, int] = {}  # id(param) -> registration index: the same order on every rank
        self.pending: list[nn.Parameter] = []
        self.queued_for = None  # the backward whose end runs flush

    def add(self, param: nn.Parameter) -> None:
        self.order[id(param)] = len(self.order)
        param.register_post_accumulate_grad_hook(self.mark)

    def mark(self, param: nn.Parameter) -> None:
        self.pending.append(param)
        task = backward_task()
        # queued once per backward, by its first mark: one that raised strands none in the next
        if task is None or task != self.queued_for:
            self.queued_for = task
            after_backward(self.flush)

    def flush(self) -> None:
        # once each: a backward that raised leaves its marks for the next one to reduce
        pending = {id(param): param for param in self.pending}.values()
        self.pending = []
        buckets: dict[tuple, list[nn.Parameter]] = {}
        for param in sorted(pending, key=lambda q: self.order[id(q)]):
            grad = param.grad
            # the mesh is 1-D; its partial is a sum (local_parameters and the ops' sharding rules)
            if grad is not None and grad.placements[0].is_partial():
                buckets.setdefault((grad.device_mesh, grad.dtype), []).append(param)
            # else: accumulated onto a replicated gradient, which DTensor reduced already
        with torch.no_grad():
            for (mesh, _), params in buckets.items():
                _reduce_bucket(params, mesh)


def _reduce_bucket(params: list[nn.Parameter], mesh) -> None:
    """Sum the partial gradients of ``params`` (all of ``mesh``, one dtype) in one all-reduce."""
    from torch.distributed.tensor import Replicate

    local = [p.grad.to_local() for p in params]
    flat = torch.cat([t.reshape(-1) for t in local])
    dist.all_reduce(flat, group=mesh.get_group())
    for param, t, summed in zip(params, local, flat.split([t.numel() for t in local])):
        param.grad = unsharded_dtensor(summed.view(t.shape), mesh, Replicate())
