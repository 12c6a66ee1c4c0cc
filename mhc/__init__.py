"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch.

The layers, top to bottom (``docs/architecture.md``):

- ``mhc.kernels``: the Triton kernels and their launchers (imported on first use);
- ``mhc.reference``: the pure-PyTorch oracle of every op (the tests' oracle and the CPU path);
- ``mhc.ops``: the registered ``mhc::`` ops, their autograd Functions, and the one place that
  decides which path runs (``mhc.ops.path``);
- ``mhc.modules``: ``HyperConnection`` (mHC / HC), ``LaneMixer``, stream helpers, the stability
  metric; ``mhc.mixing`` is their public home, ``mhc.layer`` that of ``sinkhorn`` and ``FusedMHC``;
- ``mhc.memory``: stream recompute and layer checkpointing;
- ``mhc.distributed``, ``mhc.integrations``: sequence-parallel sites; DeepSeek-V4 in transformers;
- ``mhc.losses``: ``linear_cross_entropy`` and ``LinearCrossEntropy`` (fused linear +
  cross-entropy, never materialising the logits).

The names users reach for are also importable from ``mhc`` itself.
"""

from mhc.layer import FusedMHC, sinkhorn
from mhc.losses import LinearCrossEntropy, linear_cross_entropy
from mhc.memory import checkpoint_layers, checkpoint_policy, recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse, StreamExpand, expand_streams, reduce_streams
from mhc.ops.sharding import register_rules

register_rules()  # DTensor runs the ops above per token (mhc.ops.sharding)

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
