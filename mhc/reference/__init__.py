"""The PyTorch oracle of every op: plain PyTorch formulas, no autograd Functions, no kernels.

The tests hold the Triton kernels to these (in fp64), the benchmarks time them, and on a CPU the
layers run them (:mod:`mhc.ops` wraps them where a written-out backward is cheaper than autograd's).

- :mod:`mhc.reference.sinkhorn`: Sinkhorn-Knopp (textbook, log-domain, the kernels' stable form,
  DeepSeek-V4's ``eps`` form) and its exact and implicit backwards;
- :mod:`mhc.reference.site`: a site's coefficients (RMS projection, gates, biases) and its mixes.
"""

from mhc.reference.sinkhorn import (
    sinkhorn_divisors,
    sinkhorn_eps,
    sinkhorn_exact_backward,
    sinkhorn_implicit_backward,
    sinkhorn_log,
    sinkhorn_loop,
    sinkhorn_multiplicative,
    sinkhorn_stable,
)
from mhc.reference.site import biases, coefficient_dtype, collapse_weights, gates, post_mix, pre_mix, rms_inverse

__all__ = [
    "sinkhorn_multiplicative",
    "sinkhorn_log",
    "sinkhorn_stable",
    "sinkhorn_eps",
    "sinkhorn_loop",
    "sinkhorn_implicit_backward",
    "sinkhorn_divisors",
    "sinkhorn_exact_backward",
    "coefficient_dtype",
    "rms_inverse",
    "gates",
    "biases",
    "collapse_weights",
    "pre_mix",
    "post_mix",
]
