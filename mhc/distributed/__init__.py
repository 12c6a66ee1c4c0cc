"""Distributed training with hyper-connection sites: sequence-parallel sites beside a
tensor-parallel plan (:func:`parallelize_sites`), and gradient reduction for parameters
replicated over ranks that each see part of the tokens (:func:`reduce_gradients`). FSDP2, DDP and
``torch.distributed.checkpoint`` need nothing from here (``docs/distributed.md``)."""

from mhc.distributed.sequence_parallel import parallelize_sites, reduce_gradients

__all__ = ["parallelize_sites", "reduce_gradients"]
