"""Pure-PyTorch Sinkhorn-Knopp: the oracle for tests and benchmarks, and the CPU path.

Every function takes logits ``[..., n, n]`` and runs ``iters`` iterations of the paper's order
(Eq. 9: ``exp``, then per iteration the columns, then the rows) in the input dtype (callers upcast).
:func:`sinkhorn_multiplicative` is the textbook loop (``exp`` overflows past a spread of ~80 in
fp32), :func:`sinkhorn_log` the same in the log domain, :func:`sinkhorn_stable` the kernels' form
(first iteration in the log domain, the rest multiplicative; ``docs/sinkhorn.md``),
:func:`sinkhorn_eps` DeepSeek-V4's. :func:`sinkhorn_divisors` and :func:`sinkhorn_exact_backward`
are the CPU path's exact backward without autograd (each step's divisors kept, walked in reverse).
"""

from __future__ import annotations

import torch

__all__ = [
    "sinkhorn_multiplicative",
    "sinkhorn_log",
    "sinkhorn_stable",
    "sinkhorn_eps",
    "sinkhorn_loop",
    "sinkhorn_implicit_backward",
    "sinkhorn_divisors",
    "sinkhorn_exact_backward",
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


def _first_iteration_at(logits: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Column then row normalisation of ``exp(logits)``, both in the log domain; the matrices' row
    index is dim ``rows``, the column index dim ``cols``."""
    return torch.softmax(logits - torch.logsumexp(logits, dim=rows, keepdim=True), dim=cols)


def sinkhorn_stable(logits: torch.Tensor, iters: int, dims: tuple = (-2, -1)) -> torch.Tensor:
    """The kernels' formulation: first iteration in log domain, then multiplicative. ``dims``:
    where the row and column indices are (:func:`sinkhorn_divisors`)."""
    r, c = dims
    m = _first_iteration_at(logits, r, c)
    for _ in range(iters - 1):
        m = m / m.sum(dim=r, keepdim=True)
        m = m / m.sum(dim=c, keepdim=True)
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


def sinkhorn_loop(logits: torch.Tensor, iters: int, eps: float = 0.0) -> torch.Tensor:
    """The layers' Sinkhorn as an unrolled loop of PyTorch ops, which autograd differentiates:
    :func:`sinkhorn_eps` for ``eps > 0``, else :func:`sinkhorn_stable`."""
    return sinkhorn_eps(logits, iters, eps) if eps > 0 else sinkhorn_stable(logits, iters)


def sinkhorn_implicit_backward(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Implicit-differentiation gradient w.r.t. the logits, corrected for non-converged ``out``.

    With ``R = out`` (row sums ``r``, column sums ``c``), ``S = R * grad_out``, ``s_r = S 1`` and
    ``s_c = S^T 1``, solves ``(diag(c) - R^T diag(r)^-1 R) beta = s_c - R^T diag(r)^-1 s_r``,
    sets ``u = (s_r - R beta) / r`` and returns ``R * (grad_out - u 1^T - 1 beta^T)``.
    The system is singular (null vector 1) and its right-hand side sums to zero; the solve is
    gauge-fixed by pinning ``beta[-1] = 0``. Shapes ``[..., n, n]``."""
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


def sinkhorn_divisors(logits: torch.Tensor, iters: int, eps: float = 0.0, dims: tuple = (-2, -1)):
    """``(out, first_row, cols, rows)``: :func:`sinkhorn_stable` (``eps = 0``) or :func:`sinkhorn_eps`
    with the divisors of every multiplicative step (``first_row`` for ``eps > 0``, else ``None``;
    ``cols``, ``rows`` ``[iters - 1, ...]``). ``dims``: where the row and column indices are; ``(0, 1)``
    (tokens contiguous) is several times faster on a CPU at small ``n``."""
    r, c = dims
    if eps > 0:
        m = torch.softmax(logits, dim=r) + eps
        first_row = m.sum(dim=c, keepdim=True) + eps
        m = m / first_row
    else:
        m, first_row = _first_iteration_at(logits, r, c), None
    if iters == 1:
        empty = logits.new_empty((0,))
        return m, first_row, empty, empty
    # in place, into preallocated divisors: the same ops in the same order, without an allocation
    # per step (each op here is small; on a CPU the allocations cost as much as the arithmetic)
    cols = m.new_empty((iters - 1, *_kept_dim(m.shape, r)))
    rows = m.new_empty((iters - 1, *_kept_dim(m.shape, c)))
    for i in range(iters - 1):
        for divisors, dim in ((cols, r), (rows, c)):
            divisor = torch.sum(m, dim=dim, keepdim=True, out=divisors[i])
            if eps > 0:
                divisor.add_(eps)
            m.div_(divisor)
    return m, first_row, cols, rows


def _kept_dim(shape, dim: int) -> tuple:
    shape = list(shape)
    shape[dim] = 1
    return tuple(shape)


def _divided_backward(grad: torch.Tensor, after: torch.Tensor, divisor: torch.Tensor, dim: int):
    """``(grad_before, before)`` of ``after = before / divisor`` with ``divisor = sum(before, dim) +
    eps``: ``(grad - sum(grad * after, dim)) / divisor``, and ``before = after * divisor``."""
    return (grad - (grad * after).sum(dim=dim, keepdim=True)) / divisor, after * divisor


def sinkhorn_exact_backward(logits, out, first_row, cols, rows, grad_out, eps: float = 0.0, dims: tuple = (-2, -1)):
    """The gradient of :func:`sinkhorn_divisors`' output w.r.t. ``logits``, from what it returned
    (same ``dims``): each step's iterate is rebuilt from the next one (``before = after * divisor``,
    within a few roundings), the first (softmax) step from ``logits`` itself."""
    r, c = dims
    grad, m = grad_out.clone(), out.clone()  # updated in place below (as the forward)
    product = torch.empty_like(m)
    for i in range(cols.shape[0] - 1, -1, -1):
        for divisor, dim in ((rows[i], c), (cols[i], r)):
            grad.sub_(torch.mul(grad, m, out=product).sum(dim=dim, keepdim=True)).div_(divisor)
            m.mul_(divisor)
    p = torch.softmax(logits, dim=r)  # the first (column) softmax
    if eps > 0:
        grad, _ = _divided_backward(grad, m, first_row, c)
        return p * (grad - (grad * p).sum(dim=r, keepdim=True))
    first = _first_iteration_at(logits, r, c)  # softmax over rows of the column-normalised logits
    grad_z = first * (grad - (grad * first).sum(dim=c, keepdim=True))
    return grad_z - p * grad_z.sum(dim=r, keepdim=True)
