"""mhc: manifold-constrained hyper-connections (mHC) for PyTorch.

- ``mhc.layer``: ``sinkhorn`` and ``FusedMHC`` (Triton Sinkhorn-Knopp with exact and implicit
  backward kernels).
- ``mhc.mixing``: ``HyperConnection`` (mHC / HC), ``LaneMixer``, stream helpers, stability metric.
- ``mhc.recompute``: ``recompute_streams`` (the sites' streams rebuilt in the backward, not saved).
- ``mhc.losses``: ``linear_cross_entropy`` and ``LinearCrossEntropy`` (fused linear + cross-entropy,
  never materialising the logits).
- ``mhc.reference``: the pure-PyTorch oracle.
- ``mhc.kernels``: the Triton kernels and launchers (imported on first use).
"""

from mhc.layer import FusedMHC, sinkhorn

__version__ = "0.1.0"

__all__ = ["FusedMHC", "sinkhorn", "__version__"]
