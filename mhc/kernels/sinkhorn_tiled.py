"""Sinkhorn kernels for many lanes (n = 7..64): matrices as 5-D ``[BLOCK_T, RI, CB, RO, 4]`` tiles.

The maths of ``sinkhorn.py`` (forward, exact backward) and ``sinkhorn_implicit.py``, laid out for
larger ``n``: a program holds ``BLOCK_T`` whole matrices as one tile (``NP = next_pow2(n)``,
padding masked), entry ``(t, ri, cb, ro, c)`` is row ``ri * RO + ro``, column ``4 * cb + c``; row
vectors are ``[BLOCK_T, RI, 1, RO, 1]``, column vectors ``[BLOCK_T, 1, CB, 1, 4]``. Every loop is a
runtime loop, so code size does not grow with ``n``. The exact backward keeps the row scalings of
``SEG`` iterations in a history tile. ``docs/sinkhorn.md`` ("Many lanes (n = 7 to 64)") explains the layout.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mhc.kernels._arch import tuned
from mhc.kernels._checks import check_matrices, check_positive, check_tensor
from mhc.kernels._launch import INTERPRET, LaunchPlan, launch, launch_plan, per_size, static
from mhc.kernels._tiles import MAX_N, cdiv, centered, load_upcast, next_pow2, reciprocal, store_rounded

# Tiles per NP class ("8" to "64"), a table per architecture (mhc/kernels/tables, written by
# python -m bench.tune_sinkhorn tiles --write): fwd and implicit (BLOCK_T, RI, num_warps); bwd
# (BLOCK_T, RI, num_warps, SEG, RECOMPUTE_R1). SEG is the number of iterations whose row scalings
# the exact backward holds on chip; RECOMPUTE_R1 trades a second read of the logits for the
# registers of the first iteration's row sums.
TABLE = "sinkhorn_tiled"
VEC = tl.constexpr(4)  # columns per vector: the tile's last axis


@triton.jit
def _tile(i_b, T, N: tl.constexpr, NP: tl.constexpr, RS: tl.constexpr, BLOCK_T: tl.constexpr, RI: tl.constexpr):
    """Program ``i_b``'s ``[BLOCK_T, RI, CB, RO, 4]`` tile: the int64 starts of its first matrix in the
    inputs (``[T, N, RS]``, ``RS >= N``) and the output (``[T, N, N]``), the int32 offsets from there,
    their in-bounds masks, and the masks of real rows ``[1, RI, 1, RO, 1]`` and columns
    ``[1, 1, CB, 1, 4]``."""
    RO: tl.constexpr = NP // RI
    CB: tl.constexpr = NP // VEC
    t0 = i_b.to(tl.int64) * BLOCK_T
    t = tl.arange(0, BLOCK_T)[:, None, None, None, None]
    row = (tl.arange(0, RI)[:, None] * RO + tl.arange(0, RO)[None, :])[None, :, None, :, None]
    col = (tl.arange(0, CB)[:, None] * VEC + tl.arange(0, VEC)[None, :])[None, None, :, None, :]
    row_ok = row < N
    col_ok = col < N
    t_ok = (t < T - t0) & row_ok
    in_offs = t * (N * RS) + row * RS + col
    out_offs = t * (N * N) + row * N + col
    return (t0 * (N * RS), in_offs, t_ok & (col < RS), t0 * (N * N), out_offs, t_ok & col_ok, row_ok, col_ok)


@triton.jit
def _sum_over_cols(x):
    """Sums along rows: ``[B, RI, CB, RO, 4]`` -> row vector ``[B, RI, 1, RO, 1]``."""
    return tl.sum(tl.sum(x, axis=4, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _sum_over_rows(x):
    """Sums along columns: ``[B, RI, CB, RO, 4]`` -> column vector ``[B, 1, CB, 1, 4]``."""
    return tl.sum(tl.sum(x, axis=3, keep_dims=True), axis=1, keep_dims=True)


@triton.jit
def _max_over_cols(x):
    return tl.max(tl.max(x, axis=4, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _max_over_rows(x):
    return tl.max(tl.max(x, axis=3, keep_dims=True), axis=1, keep_dims=True)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


# Triton's interpreter (CI) runs a reduction with a combine function element by element in Python,
# about a second per call at n = 8: there the pair is two sums, as fast as any other reduction.
_ONE_REDUCTION = tl.constexpr(not INTERPRET)


@triton.jit
def _pair_over_rows(a, b):
    """``_sum_over_rows`` of two tiles in one reduction."""
    if _ONE_REDUCTION:
        a, b = tl.reduce((a, b), 3, _add_pairs, keep_dims=True)
        a, b = tl.reduce((a, b), 1, _add_pairs, keep_dims=True)
    else:
        a, b = _sum_over_rows(a), _sum_over_rows(b)
    return a, b


@triton.jit
def _first_iteration(x, row_ok, col_ok):
    """Column then row normalisation of ``exp(x)`` in the log domain: ``K`` (rows sum to one, 0 on
    padding) and ``r1``, the row sums of the column-normalised iterate (a row vector)."""
    x = tl.where(row_ok & col_ok, x, float("-inf"))
    col_max = tl.where(col_ok, _max_over_rows(x), 0.0)
    col_sum = _sum_over_rows(tl.exp(x - col_max))
    y = x - (col_max + tl.log(tl.where(col_ok, col_sum, 1.0)))
    row_max = tl.where(row_ok, _max_over_cols(y), 0.0)
    e = tl.exp(y - row_max)
    row_sum = _sum_over_cols(e)
    k = e * reciprocal(tl.where(row_ok, row_sum, 1.0))
    return k, tl.exp(row_max) * row_sum


@triton.jit
def _col_scaling(k, u, col_ok):
    """Column step ``v = 1 / (K^T u)``: a column vector, 0 on padded columns."""
    s = _sum_over_rows(k * u)
    return tl.where(col_ok, reciprocal(tl.where(col_ok, s, 1.0)), 0.0)


@triton.jit
def _row_scaling(k, v, row_ok):
    """Row step ``u = 1 / (K v)``: a row vector, 0 on padded rows."""
    s = _sum_over_cols(k * v)
    return tl.where(row_ok, reciprocal(tl.where(row_ok, s, 1.0)), 0.0)


@triton.jit
def _scalings(k, u, row_ok, col_ok, n_steps):
    """``n_steps`` multiplicative iterations (column then row step) from the row scaling ``u``."""
    v = tl.where(col_ok, 1.0, 0.0) + tl.zeros_like(_sum_over_rows(k))
    for _ in range(n_steps):
        v = _col_scaling(k, u, col_ok)
        u = _row_scaling(k, v, row_ok)
    return u, v


@triton.jit
def sinkhorn_tiled_fwd_kernel(
    x_ptr,
    out_ptr,  # contiguous [T, N, RS], [T, N, N]
    T,
    iters,
    N: tl.constexpr,
    NP: tl.constexpr,
    RS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RI: tl.constexpr,
    FP64: tl.constexpr,
):
    in_base, offs, m, out_base, out_offs, out_m, row_ok, col_ok = _tile(tl.program_id(0), T, N, NP, RS, BLOCK_T, RI)
    x_ptr += in_base
    out_ptr += out_base
    k, _ = _first_iteration(load_upcast(x_ptr, offs, m, FP64), row_ok, col_ok)
    ones_u = tl.where(row_ok, 1.0, 0.0) + tl.zeros_like(_sum_over_cols(k))
    u, v = _scalings(k, ones_u, row_ok, col_ok, iters - 1)
    store_rounded(out_ptr, out_offs, out_m, u * k * v)


@triton.jit
def _history_slots(SEGP: tl.constexpr):
    """Slot numbers of a history tile ``[1, 1, SEGP / 4, 1, 4]``: the column axes hold the slots."""
    i = tl.arange(0, SEGP // VEC)[None, None, :, None, None]
    j = tl.arange(0, VEC)[None, None, None, None, :]
    return i * VEC + j


@triton.jit
def _pick(hist, slot, h):
    """Slot ``h`` of a history tile: a row vector."""
    return _sum_over_cols(tl.where(slot == h, hist, 0.0))


@triton.jit
def _load_again(ptr, offs, m, FP64: tl.constexpr):
    """``load_upcast`` that the compiler may not merge with an earlier load of the same block:
    the block is re-read instead of held in registers across the reverse sweep."""
    b = tl.load(ptr + offs, mask=m, other=0.0, volatile=True)
    return b.to(tl.float64 if FP64 else tl.float32)


@triton.jit
def _final_terms(g_ptr, offs, m, k, u, v, FP64: tl.constexpr):
    """Start of the reverse sweep from the final iterate ``P = u K v``: the row and column sums
    of ``G * P`` and the accumulator's first term ``-G * u v^T`` (``G`` read here)."""
    g_uv = load_upcast(g_ptr, offs, m, FP64) * (u * v)
    d = g_uv * k
    return _sum_over_cols(d), _sum_over_rows(d), -g_uv


@triton.jit
def _segment_history(k, ones_u, slot, row_ok, col_ok, start, h_lo, SEG: tl.constexpr):
    """Row scalings of one segment of the exact backward: ``start + h_lo`` iterations from ``u = 1``,
    then ``SEG - h_lo`` more, slot ``h`` of the history holding ``u`` after ``start + h`` of them.
    Returns the last ``u``, ``v`` and the history."""
    u, v = _scalings(k, ones_u, row_ok, col_ok, start + h_lo)
    hist = tl.where(slot == h_lo, u, 0.0)
    for h in range(h_lo, SEG):
        v = _col_scaling(k, u, col_ok)
        u = _row_scaling(k, v, row_ok)
        hist = tl.where(slot == h + 1, u, hist)
    return u, v, hist


@triton.jit
def _reverse_segment(k, hist, slot, u_k, rs, cs, acc, col_ok, h_lo, SEG: tl.constexpr):
    """The reverse sweep over one segment's iterations (``SEG - h_lo`` of them, from the last),
    from the row scaling ``u_k`` after its last iteration. Returns ``rs, cs, acc``."""
    for j in range(SEG - h_lo):
        u_p = _pick(hist, slot, SEG - 1 - j)
        # row step on M = diag(u_k) K diag(v_k): alpha = rs; its column sums and the column
        # step's v_k = 1 / (K^T u_p) in one reduction over the rows
        a = rs * u_k
        col_sums, k_a = _pair_over_rows(k * u_p, k * a)
        v_k = tl.where(col_ok, reciprocal(tl.where(col_ok, col_sums, 1.0)), 0.0)
        cs = cs - v_k * k_a
        # column step on M = diag(u_p) K diag(v_k): beta = cs
        bv = cs * v_k
        rs = -u_p * _sum_over_cols(k * bv)
        acc += a * v_k  # two statements: two fused multiply-adds
        acc += u_p * bv
        cs = tl.zeros_like(cs)
        u_k = u_p
    return rs, cs, acc


@triton.jit
def sinkhorn_tiled_bwd_kernel(
    x_ptr,
    g_ptr,
    dx_ptr,  # contiguous [T, N, RS], [T, N, RS], [T, N, N]
    T,
    iters,
    N: tl.constexpr,
    NP: tl.constexpr,
    RS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RI: tl.constexpr,
    SEG: tl.constexpr,
    SEGP: tl.constexpr,
    RECOMPUTE_R1: tl.constexpr,
    FP64: tl.constexpr,
):
    in_base, offs, m, out_base, out_offs, out_m, row_ok, col_ok = _tile(tl.program_id(0), T, N, NP, RS, BLOCK_T, RI)
    x_ptr += in_base
    g_ptr += in_base
    dx_ptr += out_base
    k, r1 = _first_iteration(load_upcast(x_ptr, offs, m, FP64), row_ok, col_ok)
    ones_u = tl.where(row_ok, 1.0, 0.0) + tl.zeros_like(r1)
    slot = _history_slots(SEGP)

    # The iters - 1 multiplicative iterations (numbered 2..iters) run as n_seg segments of SEG,
    # the first one short by pad. The row / column sums (rs, cs) of dL/dlog(iterate) at the
    # current reverse position start from the final iterate P = u_t K v_t, and acc starts as
    # -G * u_t v_t^T and collects the reverse steps' outer products, so that dL/dlog(M_1) =
    # -K * acc. G is read once, where the reverse sweep starts (in the last segment, which runs
    # first); neither it nor the final scalings stay in registers to the end. With RECOMPUTE_R1
    # the first iteration's row sums are recomputed at the end instead of held.
    mult = iters - 1
    n_seg = (mult + SEG - 1) // SEG
    pad = n_seg * SEG - mult
    ones_v = tl.where(col_ok, 1.0, 0.0) + tl.zeros_like(_sum_over_rows(k))
    rs, cs, acc = tl.zeros_like(ones_u), tl.zeros_like(ones_v), tl.zeros_like(k)
    if n_seg == 0:  # iters == 1: the final scalings are ones
        rs, cs, acc = _final_terms(g_ptr, offs, m, k, ones_u, ones_v, FP64)
    for i_rev in range(n_seg):
        start = SEG * (n_seg - 1 - i_rev) - pad  # iterations before the segment's first, less 1
        h_lo = tl.maximum(0, -start)  # slots below h_lo are padding
        u, v, hist = _segment_history(k, ones_u, slot, row_ok, col_ok, start, h_lo, SEG)
        if i_rev == 0:
            rs, cs, acc = _final_terms(g_ptr, offs, m, k, u, v, FP64)
        rs, cs, acc = _reverse_segment(k, hist, slot, u, rs, cs, acc, col_ok, h_lo, SEG)

    # first iteration: row step on K (u = v = 1), then the column step on M1 = r1 * K
    cs = cs - _sum_over_rows(k * rs)
    if RECOMPUTE_R1:
        _, r1 = _first_iteration(_load_again(x_ptr, offs, m, FP64), row_ok, col_ok)
    dx = -k * (acc + rs + r1 * cs)
    store_rounded(dx_ptr, out_offs, out_m, dx)


@triton.jit
def sinkhorn_tiled_implicit_bwd_kernel(
    r_ptr,
    g_ptr,
    dx_ptr,  # contiguous [T, N, RS], [T, N, RS], [T, N, N]
    T,
    N: tl.constexpr,
    NP: tl.constexpr,
    RS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RI: tl.constexpr,
    CG_TOL: tl.constexpr,
    FP64: tl.constexpr,
):
    # The system and the CG loop of sinkhorn_implicit.py, on tiles: A beta = c * beta -
    # R^T diag(r)^-1 (R beta), right-hand side and residuals re-centred (see that file). The
    # CG vectors are column vectors; their dot products sum over the columns.
    in_base, offs, m, out_base, out_offs, out_m, row_ok, col_ok = _tile(tl.program_id(0), T, N, NP, RS, BLOCK_T, RI)
    r_ptr += in_base
    g_ptr += in_base
    dx_ptr += out_base
    r = load_upcast(r_ptr, offs, m, FP64)
    g = load_upcast(g_ptr, offs, m, FP64)
    row_sums = _sum_over_cols(r)
    col_sums = _sum_over_rows(r)
    rn = r / tl.where(row_ok, row_sums, 1.0)  # diag(r)^-1 R
    s = r * g
    s_r = _sum_over_cols(s)
    rhs = _sum_over_rows(s) - _sum_over_rows(rn * s_r)

    beta = tl.zeros_like(rhs)
    res = centered(rhs, _sum_over_cols(rhs), col_ok, N)
    p = res
    rr = _sum_over_cols(res * res)
    # At most N steps (exact in exact arithmetic); stop once every residual of the tile is below
    # CG_TOL of its start, which well-conditioned systems (logits of moderate scale) reach in a few.
    rr_stop = rr * (CG_TOL * CG_TOL)
    i_cg = 0
    while (i_cg < N) & (tl.max(tl.where(rr > rr_stop, 1, 0)) > 0):  # NaN matrices do not count
        i_cg += 1
        ap = col_sums * p - _sum_over_rows(rn * _sum_over_cols(r * p))
        pap = _sum_over_cols(p * ap)
        alpha = tl.where(pap > 0.0, rr / tl.where(pap > 0.0, pap, 1.0), 0.0)
        beta += alpha * p
        res = res - alpha * ap
        res = centered(res, _sum_over_cols(res), col_ok, N)
        rr_new = _sum_over_cols(res * res)
        gamma = tl.where(rr > 0.0, rr_new / tl.where(rr > 0.0, rr, 1.0), 0.0)
        p = res + gamma * p
        rr = rr_new

    u = (s_r - _sum_over_cols(r * beta)) / tl.where(row_ok, row_sums, 1.0)
    store_rounded(dx_ptr, out_offs, out_m, r * (g - u - beta))


# ----------------------------------------------------------------------------------- launchers


@launch_plan
def _plan(kind: str, n: int, rs: int, fp64: bool, T) -> LaunchPlan:
    """The ``kind`` (``fwd``, ``bwd``, ``implicit``) launch: a program per ``BLOCK_T`` matrices,
    tiled as the architecture's table says for ``n``'s power-of-two class."""
    block_t, ri, num_warps, *segments = tuned(TABLE)[str(max(8, next_pow2(n)))][kind]
    meta = dict(N=n, NP=next_pow2(n), RS=rs, BLOCK_T=block_t, RI=ri, FP64=fp64, num_warps=num_warps)
    if kind == "bwd":
        seg, recompute_r1 = segments
        meta.update(SEG=seg, SEGP=max(VEC.value, next_pow2(seg + 1)), RECOMPUTE_R1=recompute_r1)
    if kind == "implicit":
        meta.update(CG_TOL=1e-13 if fp64 else 1e-6)
    name = "sinkhorn_tiled_implicit_bwd" if kind == "implicit" else f"sinkhorn_tiled_{kind}"
    return LaunchPlan((cdiv(T, block_t),), meta, (name, n, rs, fp64))


def row_stride(n: int, element_size: int) -> int:
    """Entries per row of the inputs the kernels read: ``n``, or ``n`` rounded up to 16 bytes where rows
    are not 8-byte aligned (fp32: odd ``n``), which the compiler would load as scalars throughout."""
    if n * element_size % 8 == 0:
        return n
    per_vector = max(1, 16 // element_size)
    return -(-n // per_vector) * per_vector


def _operands(*tensors: torch.Tensor):
    """Shape checks; the inputs as contiguous ``[T, n, rs]`` (rows zero-padded to ``rs =
    row_stride(n)`` entries where that is more than ``n``: one copy each) and an empty
    ``[T, n, n]`` output. ``T``, ``n``, ``rs``."""
    T, n = check_matrices(tensors[0], "the first tensor", MAX_N)
    n = static(n)
    for i, t in enumerate(tensors[1:], 1):
        check_tensor(t, f"tensor argument {i}", tensors[0].shape, device=tensors[0].device)
    rs = row_stride(n, tensors[0].element_size())
    if rs == n:
        inputs = [t.contiguous() for t in tensors]
    else:
        inputs = [F.pad(t, (0, rs - n)) for t in tensors]
    out = torch.empty(T, n, n, device=tensors[0].device, dtype=tensors[0].dtype)
    return T, n, rs, (*inputs, out)


def sinkhorn_tiled_fwd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Forward launcher. ``logits [T, n, n]`` -> doubly stochastic ``[T, n, n]``, same dtype."""
    T, n, rs, (logits, out) = _operands(logits)
    check_positive(iters, "iters")
    if T == 0:
        return out
    plan = per_size(_plan, T)("fwd", n, rs, logits.dtype == torch.float64, T)
    launch(sinkhorn_tiled_fwd_kernel, plan.grid, (logits,), (out,), (T, iters), plan.meta, plan.key)
    return out


def sinkhorn_tiled_bwd(logits: torch.Tensor, grad_out: torch.Tensor, iters: int) -> torch.Tensor:
    """Exact backward launcher: ``dL/dlogits [T, n, n]`` of the ``iters``-step map, from the logits."""
    T, n, rs, (logits, grad_out, grad_in) = _operands(logits, grad_out)
    check_positive(iters, "iters")
    if T == 0:
        return grad_in
    plan = per_size(_plan, T)("bwd", n, rs, logits.dtype == torch.float64, T)
    launch(sinkhorn_tiled_bwd_kernel, plan.grid, (logits, grad_out), (grad_in,), (T, iters), plan.meta, plan.key)
    return grad_in


def sinkhorn_tiled_implicit_bwd(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Implicit backward launcher: ``out [T, n, n]`` (the forward's output), ``grad_out`` -> grad."""
    T, n, rs, (out, grad_out, grad_in) = _operands(out, grad_out)
    if T == 0:
        return grad_in
    plan = per_size(_plan, T)("implicit", n, rs, out.dtype == torch.float64, T)
    launch(sinkhorn_tiled_implicit_bwd_kernel, plan.grid, (out, grad_out), (grad_in,), (T,), plan.meta, plan.key)
    return grad_in
