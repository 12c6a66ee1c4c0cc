"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch.

- ``mhc.layer``: ``sinkhorn`` and ``FusedMHC`` (Triton Sinkhorn-Knopp with exact and implicit
  backward kernels).
- ``mhc.mixing``: ``HyperConnection`` (mHC / HC), ``LaneMixer``, stream helpers, stability metric.
- ``mhc.recompute``: ``recompute_streams`` (the sites' streams rebuilt in the backward, not saved).
- ``mhc.losses``: ``linear_cross_entropy`` and ``LinearCrossEntropy`` (fused linear + cross-entropy,
  never materialising the logits).
- ``mhc.reference``: the pure-PyTorch oracle.
- ``mhc.checkpoint``: activation checkpointing of layers with sites (``checkpoint_layers``, a
  selective checkpointing policy).
- ``mhc.kernels``: the Triton kernels and launchers (imported on first use).

The names users reach for are also importable from ``mhc`` itself.
"""

from mhc._sharding import register_rules
from mhc.checkpoint import checkpoint_layers, checkpoint_policy
from mhc.layer import FusedMHC, sinkhorn
from mhc.losses import LinearCrossEntropy, linear_cross_entropy
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse, StreamExpand, expand_streams, reduce_streams
from mhc.recompute import recompute_streams

register_rules()  # DTensor runs the ops above per token (mhc._sharding)

__version__ = "0.1.0"

__all__ = [
    "FusedMHC",
    "sinkhorn",
    "HyperConnection",
    "LaneMixer",
    "StreamCollapse",
    "StreamExpand",
    "expand_streams",
    "reduce_streams",
    "recompute_streams",
    "checkpoint_layers",
    "checkpoint_policy",
    "LinearCrossEntropy",
    "linear_cross_entropy",
    "__version__",
]
