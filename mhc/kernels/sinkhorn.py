"""Sinkhorn-Knopp forward and exact backward kernels, and their launchers (``docs/sinkhorn.md``).

The first iteration runs in the log domain (no row underflows whatever the logits' scale); later
ones update the scalings ``v <- 1 / (K^T u)``, ``u <- 1 / (K v)``. The exact backward recomputes
them from the logits and walks the iterations in reverse, ``u`` of up to ``SEG`` iterations in
registers (longer runs in segments); only the logits are saved.
"""

import torch
import triton
import triton.language as tl

from mhc.kernels._checks import check_matrices, check_positive, check_tensor
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
    entries_column_exp,
    entries_ones,
    entries_scaled,
    entries_sums,
    launch_config,
    next_pow2,
    reciprocal,
)
from mhc.kernels.sinkhorn_tiled import sinkhorn_tiled_bwd, sinkhorn_tiled_fwd

# Iterations whose row scalings the backward keeps in registers: SEG ~ SEGMENT_BUDGET / n^2, which
# bounds both the registers and the unrolled code (compile time grows with SEG * n^2).
SEGMENT_BUDGET = 384
# forward: one whole matrix per thread at n <= 4 (measured best), 32 values per thread above
FWD_VALUES_PER_THREAD = 32
BWD_VALUES_PER_THREAD = 16


@triton.jit
def _first_iteration(x, col_ok, N: tl.constexpr):
    """Column then row normalisation of ``exp(x)``, in the log domain.

    Returns ``K`` (rows, each summing to one) and ``r1`` (``N`` values ``[B, 1]``), the row sums
    of the column-normalised iterate, so that row ``i`` of ``M1`` is ``r1[i] * K[i]``."""
    col_max = x[0]
    for i in tl.static_range(1, N):
        col_max = tl.maximum(col_max, x[i])
    col_sum = tl.exp(x[0] - col_max)
    for i in tl.static_range(1, N):
        col_sum += tl.exp(x[i] - col_max)
    log_col = col_max + tl.log(col_sum)
    k = ()
    r1 = ()
    for i in tl.static_range(N):
        y = tl.where(col_ok, x[i] - log_col, float("-inf"))
        row_max = tl.max(y, axis=1, keep_dims=True)
        e = tl.exp(y - row_max)
        row_sum = tl.sum(e, axis=1, keep_dims=True)
        k = k + (e * reciprocal(row_sum),)
        r1 = r1 + (tl.exp(row_max) * row_sum,)
    return k, r1


@triton.jit
def _col_scaling(k, u, col_ok, N: tl.constexpr):
    """Column step ``v = 1 / (K^T u)``: ``[B, NP]``, 0 on padded columns."""
    s = k[0] * u[0]
    for i in tl.static_range(1, N):
        s += k[i] * u[i]
    return tl.where(col_ok, reciprocal(tl.where(col_ok, s, 1.0)), 0.0)


@triton.jit
def _row_scaling(k, v, N: tl.constexpr):
    """Row step ``u = 1 / (K v)``: ``N`` values ``[B, 1]``."""
    u = ()
    for i in tl.static_range(N):
        u = u + (reciprocal(tl.sum(k[i] * v, axis=1, keep_dims=True)),)
    return u


@triton.jit
def _ones(BLOCK_T: tl.constexpr, N: tl.constexpr, dtype: tl.constexpr):
    u = ()
    for i in tl.static_range(N):
        u = u + (tl.full([BLOCK_T, 1], 1.0, dtype),)
    return u


@triton.jit
def sinkhorn_rows(x, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``ITERS`` Sinkhorn iterations of ``BLOCK_T`` matrices held as ``N`` rows ``[BLOCK_T, NP]``.

    The forward's whole computation, callable from other kernels (the mHC coefficient epilogue)."""
    col_ok = tl.arange(0, NP)[None, :] < N
    k, _ = _first_iteration(x, col_ok, N)
    u = _ones(BLOCK_T, N, k[0].dtype)
    v = tl.where(col_ok, 1.0, 0.0).to(k[0].dtype) + tl.zeros_like(k[0])
    for i_it in range(ITERS - 1):
        v = _col_scaling(k, u, col_ok, N)
        u = _row_scaling(k, v, N)
    out = ()
    for i in tl.static_range(N):
        out = out + (u[i] * k[i] * v,)
    return out


@triton.jit
def _entries_scaling(k, w, N: tl.constexpr, COLUMNS: tl.constexpr):
    """On entries: the column step ``v = 1 / (K^T u)`` (``COLUMNS``, ``w = u``), else the row step
    ``u = 1 / (K v)`` (``w = v``)."""
    s = entries_sums(k, w, N, COLUMNS)
    out = ()
    for a in tl.static_range(N):
        out = out + (reciprocal(s[a]),)
    return out


@triton.jit
def sinkhorn_entries(x, ITERS: tl.constexpr, N: tl.constexpr):
    """:func:`sinkhorn_rows` of matrices held as their ``N * N`` entries, ``x[i * N + j]`` a
    tensor of one value per matrix: every step is elementwise, with no reduction across threads.
    The latency form, for a program that holds one matrix (decoding)."""
    cols = entries_column_exp(x, N)
    log_col = ()
    for j in tl.static_range(N):
        log_col = log_col + (cols[2 * j] + tl.log(cols[2 * j + 1]),)
    k = ()
    for i in tl.static_range(N):
        # the first row step in the log domain, on the column-normalised logits
        y = ()
        for j in tl.static_range(N):
            y = y + (x[i * N + j] - log_col[j],)
        row_max = y[0]
        for j in tl.static_range(1, N):
            row_max = tl.maximum(row_max, y[j])
        e = ()
        for j in tl.static_range(N):
            e = e + (tl.exp(y[j] - row_max),)
        row_sum = e[0]
        for j in tl.static_range(1, N):
            row_sum += e[j]
        inv = reciprocal(row_sum)
        for j in tl.static_range(N):
            k = k + (e[j] * inv,)
    u = entries_ones(x, N)
    v = entries_ones(x, N)
    for i_it in range(ITERS - 1):
        v = _entries_scaling(k, u, N, True)
        u = _entries_scaling(k, v, N, False)
    return entries_scaled(u, k, v, N)


@triton.jit
def sinkhorn_fwd_kernel(
    x_ptr,
    out_ptr,  # contiguous [T, N, N]
    T,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP64: tl.constexpr,
):
    offs, m = _row_tile(tl.program_id(0), T, N, BLOCK_T, NP)
    out = sinkhorn_rows(_load_rows(x_ptr, offs, m, N, FP64), ITERS, N, NP, BLOCK_T)
    _store_rows(out_ptr, offs, m, out, N)


@triton.jit
def sinkhorn_bwd_kernel(
    x_ptr,
    g_ptr,
    dx_ptr,  # contiguous [T, N, N]
    T,
    # the ITERS-1 multiplicative iterations run as NSEG segments of SEG, the first short by PAD
    ITERS: tl.constexpr,
    SEG: tl.constexpr,
    NSEG: tl.constexpr,
    PAD: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP64: tl.constexpr,
):
    offs, m = _row_tile(tl.program_id(0), T, N, BLOCK_T, NP)
    col_ok = tl.arange(0, NP)[None, :] < N
    g = _load_rows(g_ptr, offs, m, N, FP64)
    k, r1 = _first_iteration(_load_rows(x_ptr, offs, m, N, FP64), col_ok, N)
    ones_u = _ones(BLOCK_T, N, k[0].dtype)
    ones_v = tl.where(col_ok, 1.0, 0.0).to(k[0].dtype) + tl.zeros_like(k[0])

    # Final scalings (P = u_T K v_T) and the row / column sums (rs, cs) of the gradient w.r.t.
    # the log of the iterate at the current reverse position; set for ITERS == 1 here and
    # overwritten by the last segment otherwise. acc collects the per-step outer products:
    # dL/dlog(M_1) = G * P - K * acc.
    u_t = ones_u
    v_t = ones_v
    rs = _row_sums(_mul_rows(g, k, N), N)
    cs = _col_sums(_mul_rows(g, k, N), N)
    acc = ()
    for i in tl.static_range(N):
        acc = acc + (tl.zeros_like(k[0]),)

    for i_rev in range(NSEG):
        i_seg = NSEG - 1 - i_rev
        k_lo = 2 + i_seg * SEG - PAD  # first iteration of the segment; below 2 is padding
        u = ones_u
        v = ones_v
        for i_it in range(2, k_lo):
            v = _col_scaling(k, u, col_ok, N)
            u = _row_scaling(k, v, N)

        hist = (u,)  # hist[h] = u after iteration k_lo - 1 + h
        for h in tl.static_range(SEG):
            active = (k_lo + h >= 2) | (PAD == 0)
            v = tl.where(active, _col_scaling(k, u, col_ok, N), v)
            u_new = _row_scaling(k, v, N)
            u_sel = ()
            for i in tl.static_range(N):
                u_sel = u_sel + (tl.where(active, u_new[i], u[i]),)
            u = u_sel
            hist = hist + (u,)

        is_last = i_seg == NSEG - 1
        v_t = tl.where(is_last, v, v_t)
        d = ()
        u_sel = ()
        for i in tl.static_range(N):
            u_sel = u_sel + (tl.where(is_last, u[i], u_t[i]),)
            d = d + (g[i] * (u[i] * k[i] * v),)
        u_t = u_sel
        rs_last = _row_sums(d, N)
        rs_sel = ()
        for i in tl.static_range(N):
            rs_sel = rs_sel + (tl.where(is_last, rs_last[i], rs[i]),)
        rs = rs_sel
        cs = tl.where(is_last, _col_sums(d, N), cs)

        for h in tl.static_range(SEG - 1, -1, -1):
            active = (k_lo + h >= 2) | (PAD == 0)
            u_k = hist[h + 1]
            u_p = hist[h]
            v_k = _col_scaling(k, u_p, col_ok, N)
            # row step: M = diag(u_k) K diag(v_k); alpha = rs
            ka = tl.zeros_like(k[0])
            acc_new = ()
            for i in tl.static_range(N):
                a = tl.where(active, rs[i], 0.0) * u_k[i]
                ka += k[i] * a
                acc_new = acc_new + (acc[i] + a * v_k,)
            cs = cs - v_k * ka
            # column step: M = diag(u_{k-1}) K diag(v_k); beta = cs
            bv = tl.where(active, cs, 0.0) * v_k
            rs_new = ()
            acc = ()
            for i in tl.static_range(N):
                kb = tl.sum(k[i] * bv, axis=1, keep_dims=True)
                rs_new = rs_new + (tl.where(active, -u_p[i] * kb, rs[i]),)
                acc = acc + (acc_new[i] + u_p[i] * bv,)
            rs = rs_new
            cs = tl.where(active, 0.0, cs)

    # first iteration: row step on K (u = v = 1), then the column step on M1 = r1 * K
    ka = tl.zeros_like(k[0])
    for i in tl.static_range(N):
        ka += k[i] * rs[i]
    cs = cs - ka
    dx = ()
    for i in tl.static_range(N):
        dx = dx + (k[i] * (u_t[i] * g[i] * v_t - acc[i] - rs[i] - r1[i] * cs),)
    _store_rows(dx_ptr, offs, m, dx, N)


@triton.jit
def _mul_rows(a, b, N: tl.constexpr):
    out = ()
    for i in tl.static_range(N):
        out = out + (a[i] * b[i],)
    return out


def sinkhorn_fwd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Forward launcher. ``logits [T, n, n]`` -> doubly stochastic ``[T, n, n]``, same dtype.

    fp32 arithmetic (fp64 for fp64 input). Non-contiguous input is copied first. ``n >=
    TILED_MIN_N`` runs the tiled kernel of ``sinkhorn_tiled.py``."""
    T, n = check_matrices(logits, "logits", MAX_N)
    check_positive(iters, "iters")
    n = static(n)
    if n >= TILED_MIN_N:
        return sinkhorn_tiled_fwd(logits, iters)
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    if T == 0:
        return out
    plan = per_size(_fwd_plan, T)(n, iters, logits.dtype == torch.float64, T)
    launch(sinkhorn_fwd_kernel, plan.grid, (logits,), (out,), (T,), plan.meta, plan.key)
    return out


@launch_plan
def _fwd_plan(n: int, iters: int, fp64: bool, T) -> LaunchPlan:
    """A program per ``BLOCK_T`` matrices (:func:`mhc.kernels._tiles.launch_config`)."""
    np2, block_t, num_warps = launch_config(n, min(FWD_VALUES_PER_THREAD, n * next_pow2(n)))
    meta = dict(ITERS=iters, N=n, NP=np2, BLOCK_T=block_t, FP64=fp64, num_warps=num_warps)
    return LaunchPlan((cdiv(T, block_t),), meta, ("sinkhorn_fwd", n, iters, fp64))


@launch_plan
def _bwd_plan(n: int, iters: int, fp64: bool, T) -> LaunchPlan:
    """As :func:`_fwd_plan`, with the backward's segments (:func:`backward_schedule`)."""
    np2, block_t, num_warps = launch_config(n, BWD_VALUES_PER_THREAD)
    meta = dict(**backward_schedule(iters, n), N=n, NP=np2, BLOCK_T=block_t, FP64=fp64, num_warps=num_warps)
    return LaunchPlan((cdiv(T, block_t),), meta, ("sinkhorn_bwd", n, iters, fp64))


def backward_schedule(iters: int, n: int) -> dict:
    """Segments of the exact backward: ``iters - 1`` multiplicative iterations, ``SEG`` at a time."""
    mult = iters - 1
    seg = max(1, min(mult, SEGMENT_BUDGET // (n * n)))
    nseg = -(-mult // seg)
    return dict(ITERS=iters, SEG=seg, NSEG=nseg, PAD=nseg * seg - mult)


def sinkhorn_bwd(logits: torch.Tensor, grad_out: torch.Tensor, iters: int) -> torch.Tensor:
    """Exact backward launcher: ``dL/dlogits [T, n, n]`` of the ``iters``-step map, from the logits."""
    check_matrices(logits, "logits", MAX_N)
    check_tensor(grad_out, "grad_out", logits.shape, device=logits.device)
    check_positive(iters, "iters")
    return sinkhorn_bwd_unchecked(logits, grad_out, iters)


def sinkhorn_bwd_unchecked(logits: torch.Tensor, grad_out: torch.Tensor, iters: int) -> torch.Tensor:
    """:func:`sinkhorn_bwd` without the argument checks (host time per launch), for autograd
    backwards: their saved tensors and incoming gradients are right by construction."""
    T, n = logits.shape[0], static(logits.shape[-1])
    if n >= TILED_MIN_N:
        return sinkhorn_tiled_bwd(logits, grad_out, iters)
    logits = logits.contiguous()
    grad_out = grad_out.contiguous()
    grad_in = torch.empty_like(logits)
    if T == 0:
        return grad_in
    plan = per_size(_bwd_plan, T)(n, iters, logits.dtype == torch.float64, T)
    launch(sinkhorn_bwd_kernel, plan.grid, (logits, grad_out), (grad_in,), (T,), plan.meta, plan.key)
    return grad_in
