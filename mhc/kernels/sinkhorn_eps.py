"""Sinkhorn-Knopp with DeepSeek-V4's epsilon: forward and exact backward kernels, and launchers.

``B = softmax over columns(logits) + eps``, then ``ITERS`` times a row step ``u <- u / (u (B v) +
eps)`` and, but for the last time, a column step ``v <- v / (v (B^T u) + eps)``. The new scaling
depends on the old one, so the backward walks the steps in reverse, recomputing each iteration's
scalings from ``B``; only the logits are saved (``docs/sinkhorn.md``, "The epsilon of
DeepSeek-V4"). Layout as in ``sinkhorn.py``.
"""

import torch
import triton
import triton.language as tl

from mhc.kernels._checks import check_matrices, check_positive, check_tensor
from mhc.kernels._launch import LaunchPlan, launch, launch_plan, per_size, static
from mhc.kernels._tiles import (
    _load_rows,
    _row_tile,
    _store_rows,
    cdiv,
    entries_column_exp,
    entries_ones,
    entries_scaled,
    entries_sums,
    fp32_arg,
    launch_config,
    reciprocal,
)

MAX_EPS_N = 16  # the rows are unrolled: the fused mixing layer's range
VALUES_PER_THREAD = 16


@triton.jit
def _eps_base(x, eps, col_ok, N: tl.constexpr):
    """``B = softmax over columns(x) + eps`` on the real columns, 0 on padding."""
    col_max = x[0]
    for i in tl.static_range(1, N):
        col_max = tl.maximum(col_max, x[i])
    col_sum = tl.exp(x[0] - col_max)
    for i in tl.static_range(1, N):
        col_sum += tl.exp(x[i] - col_max)
    inv = reciprocal(tl.where(col_ok, col_sum, 1.0))
    b = ()
    for i in tl.static_range(N):
        b = b + (tl.where(col_ok, tl.exp(x[i] - col_max) * inv + eps, 0.0),)
    return b


@triton.jit
def _eps_row_step(b, u, v, eps, N: tl.constexpr):
    """``u <- u / (u (B v) + eps)``."""
    out = ()
    for i in tl.static_range(N):
        s = tl.sum(b[i] * v, axis=1, keep_dims=True)
        out = out + (u[i] * reciprocal(u[i] * s + eps),)
    return out


@triton.jit
def _eps_col_step(b, u, v, eps, N: tl.constexpr):
    """``v <- v / (v (B^T u) + eps)`` (0 stays 0 on padded columns)."""
    t = b[0] * u[0]
    for i in tl.static_range(1, N):
        t += b[i] * u[i]
    return v * reciprocal(v * t + eps)


@triton.jit
def _eps_start(b, col_ok, N: tl.constexpr, BLOCK_T: tl.constexpr):
    """The scalings after the first row step: ``u = 1 / (B 1 + eps)``, ``v = 1``."""
    v = tl.where(col_ok, 1.0, 0.0).to(b[0].dtype) + tl.zeros_like(b[0])
    u = ()
    for i in tl.static_range(N):
        u = u + (tl.full([BLOCK_T, 1], 1.0, b[0].dtype),)
    return v, u


@triton.jit
def _eps_scalings(b, eps, n_iters, col_ok, N: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(u, v)`` after ``n_iters`` whole iterations (the first is a row step only)."""
    v, u = _eps_start(b, col_ok, N, BLOCK_T)
    u = _eps_row_step(b, u, v, eps, N)
    for _ in range(n_iters - 1):
        v = _eps_col_step(b, u, v, eps, N)
        u = _eps_row_step(b, u, v, eps, N)
    return u, v


@triton.jit
def sinkhorn_eps_rows(x, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``ITERS`` iterations with ``eps``, callable from other kernels (the mHC coefficient epilogue)."""
    col_ok = tl.arange(0, NP)[None, :] < N
    b = _eps_base(x, eps, col_ok, N)
    u, v = _eps_scalings(b, eps, ITERS, col_ok, N, BLOCK_T)
    out = ()
    for i in tl.static_range(N):
        out = out + (u[i] * b[i] * v,)
    return out


@triton.jit
def sinkhorn_eps_entries(x, eps, ITERS: tl.constexpr, N: tl.constexpr):
    """:func:`sinkhorn_eps_rows` of matrices held as their ``N * N`` entries (as
    ``mhc.kernels.sinkhorn.sinkhorn_entries``): every step elementwise, for decoding."""
    cols = entries_column_exp(x, N)
    inv = ()
    for j in tl.static_range(N):
        inv = inv + (reciprocal(cols[2 * j + 1]),)
    base = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            base = base + (tl.exp(x[i * N + j] - cols[2 * j]) * inv[j] + eps,)
    u = entries_ones(x, N)
    v = entries_ones(x, N)
    u = _eps_step_entries(base, u, v, eps, N, False)
    for i_it in range(ITERS - 1):
        v = _eps_step_entries(base, v, u, eps, N, True)
        u = _eps_step_entries(base, u, v, eps, N, False)
    return entries_scaled(u, base, v, N)


@triton.jit
def _eps_step_entries(base, old, w, eps, N: tl.constexpr, COLUMNS: tl.constexpr):
    """On entries: the column step ``v <- v / (v (B^T u) + eps)`` (``COLUMNS``, ``old = v``,
    ``w = u``), else the row step ``u <- u / (u (B v) + eps)``."""
    s = entries_sums(base, w, N, COLUMNS)
    out = ()
    for a in tl.static_range(N):
        out = out + (old[a] * reciprocal(old[a] * s[a] + eps),)
    return out


@triton.jit
def sinkhorn_eps_rows_bwd(x, g, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``dL/dx`` of :func:`sinkhorn_eps_rows` for ``g = dL/dout``, recomputing every scaling."""
    col_ok = tl.arange(0, NP)[None, :] < N
    b = _eps_base(x, eps, col_ok, N)
    u, v = _eps_scalings(b, eps, ITERS, col_ok, N, BLOCK_T)
    # out = diag(u) B diag(v)
    db = ()
    du = ()
    dv = tl.zeros_like(b[0])
    for i in tl.static_range(N):
        gb = g[i] * b[i]
        db = db + (g[i] * u[i] * v,)
        du = du + (tl.sum(gb * v, axis=1, keep_dims=True),)
        dv += gb * u[i]
    for i_rev in range(ITERS - 1):
        k = ITERS - 1 - i_rev  # reverse iteration k: the column step, then the row step, of the forward
        u_p, v_p = _eps_scalings(b, eps, k, col_ok, N, BLOCK_T)
        t = b[0] * u_p[0]
        for i in tl.static_range(1, N):
            t += b[i] * u_p[i]
        v_k = v_p * reciprocal(v_p * t + eps)
        # row step u_k = u_p / (u_p s + eps), s = B v_k: du_p = du eps / w^2, ds = -du u_p^2 / w^2
        du_new = ()
        ds_b = tl.zeros_like(b[0])
        db_new = ()
        for i in tl.static_range(N):
            s = tl.sum(b[i] * v_k, axis=1, keep_dims=True)
            w_inv = reciprocal(u_p[i] * s + eps)
            ds = -du[i] * u_p[i] * u_p[i] * w_inv * w_inv
            du_new = du_new + (du[i] * eps * w_inv * w_inv,)
            db_new = db_new + (db[i] + ds * v_k,)
            ds_b += ds * b[i]
        dv += ds_b
        # column step v_k = v_p / (v_p t + eps), t = B^T u_p
        wc_inv = reciprocal(v_p * t + eps)
        dt = -dv * v_p * v_p * wc_inv * wc_inv
        dv = dv * eps * wc_inv * wc_inv
        du = ()
        db = ()
        for i in tl.static_range(N):
            du = du + (du_new[i] + tl.sum(b[i] * dt, axis=1, keep_dims=True),)
            db = db + (db_new[i] + u_p[i] * dt,)
    # first row step from u = v = 1: u_1 = 1 / (B 1 + eps)
    ones_v = tl.where(col_ok, 1.0, 0.0).to(b[0].dtype)
    dk = ()
    for i in tl.static_range(N):
        w_inv = reciprocal(tl.sum(b[i] * ones_v, axis=1, keep_dims=True) + eps)
        dk = dk + (db[i] - du[i] * w_inv * w_inv * ones_v,)
    # B = K + eps, K = softmax over columns: dx = K (dK - sum_rows(dK K)); K = B - eps
    col_dot = (b[0] - eps) * dk[0]
    for i in tl.static_range(1, N):
        col_dot += (b[i] - eps) * dk[i]
    dx = ()
    for i in tl.static_range(N):
        dx = dx + (tl.where(col_ok, (b[i] - eps) * (dk[i] - col_dot), 0.0),)
    return dx


@triton.jit(do_not_specialize=["T", "eps"])
def sinkhorn_eps_fwd_kernel(
    x_ptr,
    out_ptr,  # contiguous [T, N, N]
    T,
    eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP64: tl.constexpr,
):
    offs, m = _row_tile(tl.program_id(0), T, N, BLOCK_T, NP)
    out = sinkhorn_eps_rows(_load_rows(x_ptr, offs, m, N, FP64), fp32_arg(eps), ITERS, N, NP, BLOCK_T)
    _store_rows(out_ptr, offs, m, out, N)


@triton.jit(do_not_specialize=["T", "eps"])
def sinkhorn_eps_bwd_kernel(
    x_ptr,
    g_ptr,
    dx_ptr,  # contiguous [T, N, N]
    T,
    eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP64: tl.constexpr,
):
    offs, m = _row_tile(tl.program_id(0), T, N, BLOCK_T, NP)
    x = _load_rows(x_ptr, offs, m, N, FP64)
    g = _load_rows(g_ptr, offs, m, N, FP64)
    _store_rows(dx_ptr, offs, m, sinkhorn_eps_rows_bwd(x, g, fp32_arg(eps), ITERS, N, NP, BLOCK_T), N)


@launch_plan
def _plan(n: int, iters: int, fp64: bool, T) -> LaunchPlan:
    """A program per ``BLOCK_T`` matrices, forward and backward alike (the key leaves out the
    kernel, which :func:`mhc.kernels._launch.launch` keys on anyway)."""
    np2, block_t, num_warps = launch_config(n, VALUES_PER_THREAD)
    meta = dict(ITERS=iters, N=n, NP=np2, BLOCK_T=block_t, FP64=fp64, num_warps=num_warps)
    return LaunchPlan((cdiv(T, block_t),), meta, (n, iters, fp64))


def _launch(kernel, inputs, output, T: int, n: int, iters: int, eps: float) -> None:
    plan = per_size(_plan, T)(static(n), iters, inputs[0].dtype == torch.float64, T)
    launch(kernel, plan.grid, inputs, (output,), (T, eps), plan.meta, plan.key)


def sinkhorn_eps_fwd(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``logits [T, n, n]`` (n <= 16) -> ``[T, n, n]``, same dtype; fp32 arithmetic (fp64 for fp64)."""
    T, n = check_matrices(logits, "logits", MAX_EPS_N)
    check_positive(iters, "iters")
    check_positive(eps, "eps", integer=False)
    logits = logits.contiguous()
    out = torch.empty_like(logits)
    if T:
        _launch(sinkhorn_eps_fwd_kernel, (logits,), out, T, n, iters, eps)
    return out


def sinkhorn_eps_bwd(logits: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Exact backward of :func:`sinkhorn_eps_fwd`: ``dL/dlogits [T, n, n]`` from the logits."""
    check_matrices(logits, "logits", MAX_EPS_N)
    check_tensor(grad_out, "grad_out", logits.shape, device=logits.device)
    check_positive(iters, "iters")
    check_positive(eps, "eps", integer=False)
    return sinkhorn_eps_bwd_unchecked(logits, grad_out, iters, eps)


def sinkhorn_eps_bwd_unchecked(logits: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn_eps_bwd` without the argument checks, as
    :func:`mhc.kernels.sinkhorn.sinkhorn_bwd_unchecked`."""
    T, n = logits.shape[0], logits.shape[-1]
    logits = logits.contiguous()
    grad_in = torch.empty_like(logits)
    if T:
        _launch(sinkhorn_eps_bwd_kernel, (logits, grad_out.contiguous()), grad_in, T, n, iters, eps)
    return grad_in
