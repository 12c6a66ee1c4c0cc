"""Pure-PyTorch Sinkhorn-Knopp: the oracle for tests and benchmarks, and the CPU path.

Every function takes logits ``[..., n, n]`` and returns the matrix after ``iters`` iterations of
the paper's order (Eq. 9): ``M0 = exp(logits)``, then per iteration normalise every column, then
every row. Arithmetic happens in the input dtype; callers upcast (fp32 or fp64) first.

- :func:`sinkhorn_multiplicative` is the textbook loop. It is the clearest statement of the maths
  and the one autograd differentiates "exactly", but ``exp`` overflows or whole rows underflow
  once logits spread by more than ~80 (fp32).
- :func:`sinkhorn_log` runs the same iterations on log-values (log-sum-exp per axis): robust for
  any finite logits, several times more expensive.
- :func:`sinkhorn_stable` is the formulation the Triton kernels use: the first iteration in the
  log domain, the remaining ones multiplicatively. After one exact row normalisation every row and
  column sum stays within ``[1/n^2, n]``, so nothing can underflow to a zero row afterwards
  (``docs/sinkhorn.md`` has the argument).
- :func:`sinkhorn_eps` is DeepSeek-V4's iteration: ``eps`` added after the first (column)
  softmax and to every sum it divides by.
- :func:`sinkhorn_implicit_backward` is the implicit-differentiation gradient at the computed
  output with the correction for a forward that has not converged.
"""

from __future__ import annotations

import torch

__all__ = [
    "sinkhorn_multiplicative",
    "sinkhorn_log",
    "sinkhorn_stable",
    "sinkhorn_eps",
    "sinkhorn_implicit_backward",
]


def sinkhorn_multiplicative(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Textbook Sinkhorn: ``exp`` then alternate column / row division. ``[..., n, n]`` -> same."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def sinkhorn_log(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Log-domain Sinkhorn, robust for any finite logits. ``[..., n, n]`` -> same."""
    z = logits
    for _ in range(iters):
        z = z - torch.logsumexp(z, dim=-2, keepdim=True)
        z = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return torch.exp(z)


def _first_iteration(logits: torch.Tensor) -> torch.Tensor:
    """Column then row normalisation of ``exp(logits)``, both in the log domain."""
    z = logits - torch.logsumexp(logits, dim=-2, keepdim=True)
    return torch.softmax(z, dim=-1)


def sinkhorn_stable(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """The kernels' formulation: first iteration in log domain, then multiplicative."""
    m = _first_iteration(logits)
    for _ in range(iters - 1):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def sinkhorn_eps(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's Sinkhorn in this project's orientation (V4 applies the transpose):
    ``softmax over columns + eps``, then ``iters`` row steps interleaved with ``iters - 1`` column
    steps, each dividing by the sum plus ``eps``. ``eps = 0`` is :func:`sinkhorn_stable`."""
    m = torch.softmax(logits, dim=-2) + eps
    m = m / (m.sum(dim=-1, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
    return m


def sinkhorn_implicit_backward(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Implicit-differentiation gradient w.r.t. the logits, corrected for non-converged ``out``.

    With ``R = out`` (row sums ``r``, column sums ``c``), ``S = R * grad_out``, ``s_r = S 1`` and
    ``s_c = S^T 1``, solves ``(diag(c) - R^T diag(r)^-1 R) beta = s_c - R^T diag(r)^-1 s_r``,
    sets ``u = (s_r - R beta) / r`` and returns ``R * (grad_out - u 1^T - 1 beta^T)``.
    The system is singular (null vector 1) and its right-hand side sums to zero; the solve is
    gauge-fixed by pinning ``beta[-1] = 0``. Shapes ``[..., n, n]``.
    """
    n = out.shape[-1]
    r = out.sum(dim=-1)
    c = out.sum(dim=-2)
    s = out * grad_out
    s_r = s.sum(dim=-1)
    s_c = s.sum(dim=-2)
    r_inv_out = out / r.unsqueeze(-1)
    system = torch.diag_embed(c) - out.transpose(-1, -2) @ r_inv_out
    rhs = s_c - (r_inv_out.transpose(-1, -2) @ s_r.unsqueeze(-1)).squeeze(-1)
    beta = torch.zeros_like(rhs)
    if n > 1:
        beta[..., :-1] = torch.linalg.solve(system[..., :-1, :-1], rhs[..., :-1])
    u = (s_r - (out @ beta.unsqueeze(-1)).squeeze(-1)) / r
    return out * (grad_out - u.unsqueeze(-1) - beta.unsqueeze(-2))
