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

from mhc._sharding import is_dtensor

__all__ = ["assign", "local_parameters"]


def local_parameters(module, params: tuple) -> tuple:
    """``params`` (tensors or ``None``) as the ops take them: unchanged unless ``module`` is
    sequence-parallel (``module._mhc_sequence_parallel``), then each ``DTensor``'s local tensor."""
    if not module._mhc_sequence_parallel:
        return params
    return tuple(None if p is None else _local(p) for p in params)


def _local(p):
    if not is_dtensor(p):
        return p
    from torch.distributed.tensor import Partial

    return p.to_local(grad_placements=[Partial()] * p.device_mesh.ndim)


def assign(param, value) -> None:
    """``param.copy_(value)`` for a whole-tensor ``value`` (built on the host): a ``DTensor``
    parameter (FSDP2's shards, a replicated site) takes its part of it, rank 0's values on every
    rank. Call under ``torch.no_grad()``."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
    param.copy_(value)
