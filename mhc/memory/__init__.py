"""Memory strategies for models with hyper-connection sites: streams recomputed in the backward
(:func:`recompute_streams`, plugged into the sites through their ``_recompute`` hook) and
activation checkpointing of whole layers (:func:`checkpoint_layers`, :func:`checkpoint_policy`)."""

from mhc.memory.checkpoint import checkpoint_layers, checkpoint_policy
from mhc.memory.recompute import recompute_streams

__all__ = ["recompute_streams", "checkpoint_layers", "checkpoint_policy"]
