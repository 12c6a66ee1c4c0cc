"""The local tensors of sequence-parallel modules' parameters, and initial values for ``DTensor``
parameters.

:func:`mhc.distributed.parallelize_sites` makes a module's own parameters ``DTensor``\\ s
replicated over the tensor-parallel mesh, and the module runs on its rank's share of the tokens.
The kernels and the reference ops take plain tensors: a module reads its parameters through
:func:`local_parameters`, which hands over each ``DTensor``'s local tensor with its gradient
declared a partial sum (``Partial``): each rank's gradient covers its own tokens only, and the
``DTensor`` sums them over the mesh where the gradient is used (FSDP2's reduction, the optimizer,
``full_tensor()``).
"""

from __future__ import annotations

import torch

from mhc._compat import is_dtensor, unsharded_dtensor

__all__ = ["assign", "local_parameters"]


def local_parameters(module, params: tuple) -> tuple:
    """``params`` (tensors or ``None``) as the ops take them: unchanged unless ``module`` is
    sequence-parallel (``module._mhc_sequence_parallel``), then each ``DTensor``'s local tensor."""
    if not module._mhc_sequence_parallel:
        return params
    if torch.compiler.is_compiling() or not all(p is None or _replicated(p) for p in params):
        return tuple(None if p is None else _local(p) for p in params)
    present = [p for p in params if p is not None]
    local = iter(_LocalTensors.apply(*present))
    return tuple(None if p is None else next(local) for p in params)


def _replicated(p) -> bool:
    return is_dtensor(p) and all(q.is_replicate() for q in p.placements)


def _local(p):
    if not is_dtensor(p):
        return p
    from torch.distributed.tensor import Partial

    return p.to_local(grad_placements=[Partial()] * p.device_mesh.ndim)


class _LocalTensors(torch.autograd.Function):
    """The local tensors of replicated ``DTensor`` parameters, their gradients ``Partial()``: what
    ``p.to_local(grad_placements=[Partial()])`` gives, in one autograd node for all of a module's
    parameters and with the gradients' specs reused (:func:`mhc._compat.unsharded_dtensor`), so a
    site's host work under sequence parallelism does not grow by a node and a spec per parameter.
    Double backward goes through ``DTensor.from_local``, which autograd follows."""

    @staticmethod
    def forward(ctx, *params):
        ctx.meshes = [p.device_mesh for p in params]
        ctx.set_materialize_grads(False)
        # without grad mode to_local() is the local tensor itself; autograd writes its metadata
        # into what a Function returns, hence fresh views
        return tuple(p.to_local().view_as(p.to_local()) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed.tensor import DTensor, Partial

        def partial(g, mesh):
            if torch.is_grad_enabled():  # create_graph: a gradient that autograd differentiates again
                return DTensor.from_local(g, mesh, [Partial()] * mesh.ndim, run_check=False)
            return unsharded_dtensor(g, mesh, Partial())

        return tuple(None if g is None else partial(g, mesh) for g, mesh in zip(grads, ctx.meshes))


def assign(param, value) -> None:
    """``param.copy_(value)`` for a whole-tensor ``value`` (built on the host): a ``DTensor``
    parameter (FSDP2's shards, a replicated site) takes its part of it, rank 0's values on every
    rank. Call under ``torch.no_grad()``."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
