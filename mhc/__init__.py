"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch.

The layers, top to bottom (``docs/architecture.md``): ``mhc.kernels`` (Triton kernels and
launchers), ``mhc.reference`` (the PyTorch oracle and CPU path), ``mhc.ops`` (the ``mhc::`` ops,
their autograd and the path decision), ``mhc.modules`` (public home ``mhc.mixing``; ``mhc.layer``
holds ``sinkhorn`` and ``FusedMHC``), ``mhc.memory``, ``mhc.distributed``, ``mhc.integrations``,
and ``mhc.losses`` (the fused linear + cross-entropy). The names users reach for are importable
from ``mhc`` itself.
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
