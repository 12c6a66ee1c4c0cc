"""Implicit-differentiation Sinkhorn backward kernel, corrected for a forward that has not converged.

From the output ``R`` (row sums ``r``, column sums ``c``) and ``G = dL/dR``: with ``S = R * G``,
``s_r = S 1``, ``s_c = S^T 1``, solve ``(diag(c) - R^T diag(r)^-1 R) beta = s_c - R^T diag(r)^-1 s_r``
by conjugate gradients in registers, then ``u = (s_r - R beta) / r`` and
``dL/dlogits = R * (G - u 1^T - 1 beta^T)``. The matrix is PSD with null vector 1 and the
right-hand side sums to zero, so CG stays in the complement. Elementwise products and sums only
(no ``tl.dot``): CG needs IEEE fp32, and ``n`` is far below the tensor cores' 16.
"""

import torch
import triton
import triton.language as tl

from mhc.kernels._checks import check_matrices, check_tensor
from mhc.kernels._launch import LaunchPlan, launch, launch_plan, per_size, static
from mhc.kernels._tiles import (
    MAX_N,
    TILED_MIN_N,
    _col_sums,
    _load_rows,
    _row_sums,
    _row_tile,
    _store_rows,
    cdiv,
    centered,
    launch_config,
)
from mhc.kernels.sinkhorn_tiled import sinkhorn_tiled_implicit_bwd

IMPLICIT_VALUES_PER_THREAD = 16


@triton.jit
def sinkhorn_implicit_bwd_kernel(
    r_ptr,
    g_ptr,
    dx_ptr,  # contiguous [T, N, N]
    T,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP64: tl.constexpr,
):
    offs, m = _row_tile(tl.program_id(0), T, N, BLOCK_T, NP)
    col_ok = tl.arange(0, NP)[None, :] < N
    r = _load_rows(r_ptr, offs, m, N, FP64)
    g = _load_rows(g_ptr, offs, m, N, FP64)

    row_sums = _row_sums(r, N)
    col_sums = _col_sums(r, N)
    rn = ()  # diag(r)^-1 R
    s_r = ()
    s_c = tl.zeros_like(r[0])
    for i in tl.static_range(N):
        rn = rn + (r[i] / row_sums[i],)
        s = r[i] * g[i]
        s_r = s_r + (tl.sum(s, axis=1, keep_dims=True),)
        s_c += s
    rhs = s_c
    for i in tl.static_range(N):
        rhs -= rn[i] * s_r[i]

    # CG on beta [B, NP]: A p = c * p - R^T diag(r)^-1 (R p). In exact arithmetic every iterate
    # is orthogonal to the null vector 1; in fp32 rounding leaks into it and CG amplifies the leak,
    # so the right-hand side and each residual are re-centred.
    beta = tl.zeros_like(rhs)
    res = centered(rhs, tl.sum(rhs, axis=1, keep_dims=True), col_ok, N)
    p = res
    rr = tl.sum(res * res, axis=1, keep_dims=True)
    for i_cg in range(N):
        ap = col_sums * p
        for i in tl.static_range(N):
            ap -= rn[i] * tl.sum(r[i] * p, axis=1, keep_dims=True)
        pap = tl.sum(p * ap, axis=1, keep_dims=True)
        alpha = tl.where(pap > 0.0, rr / tl.where(pap > 0.0, pap, 1.0), 0.0)
        beta += alpha * p
        res = res - alpha * ap
        res = centered(res, tl.sum(res, axis=1, keep_dims=True), col_ok, N)
        rr_new = tl.sum(res * res, axis=1, keep_dims=True)
        gamma = tl.where(rr > 0.0, rr_new / tl.where(rr > 0.0, rr, 1.0), 0.0)
        p = res + gamma * p
        rr = rr_new

    dx = ()
    for i in tl.static_range(N):
        u = (s_r[i] - tl.sum(r[i] * beta, axis=1, keep_dims=True)) / row_sums[i]
        dx = dx + (r[i] * (g[i] - u - beta),)
    _store_rows(dx_ptr, offs, m, dx, N)


def sinkhorn_implicit_bwd(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Implicit backward launcher: ``out [T, n, n]`` (the forward's output), ``grad_out`` -> grad.

    ``n >= TILED_MIN_N`` runs the tiled kernel of ``sinkhorn_tiled.py``."""
    check_matrices(out, "out", MAX_N)
    check_tensor(grad_out, "grad_out", out.shape, device=out.device)
    return sinkhorn_implicit_bwd_unchecked(out, grad_out)


def sinkhorn_implicit_bwd_unchecked(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """:func:`sinkhorn_implicit_bwd` without the argument checks, as
    :func:`mhc.kernels.sinkhorn.sinkhorn_bwd_unchecked`."""
    T, n = out.shape[0], static(out.shape[-1])
    if n >= TILED_MIN_N:
        return sinkhorn_tiled_implicit_bwd(out, grad_out)
    out = out.contiguous()
    grad_out = grad_out.contiguous()
    grad_in = torch.empty_like(out)
    if T == 0:
        return grad_in
    plan = per_size(_plan, T)(n, out.dtype == torch.float64, T)
    launch(sinkhorn_implicit_bwd_kernel, plan.grid, (out, grad_out), (grad_in,), (T,), plan.meta, plan.key)
    return grad_in


@launch_plan
def _plan(n: int, fp64: bool, T) -> LaunchPlan:
    """A program per ``BLOCK_T`` matrices (:func:`mhc.kernels._tiles.launch_config`)."""
    np2, block_t, num_warps = launch_config(n, IMPLICIT_VALUES_PER_THREAD)
    meta = dict(N=n, NP=np2, BLOCK_T=block_t, FP64=fp64, num_warps=num_warps)
    return LaunchPlan((cdiv(T, block_t),), meta, ("sinkhorn_implicit_bwd", n, fp64))
