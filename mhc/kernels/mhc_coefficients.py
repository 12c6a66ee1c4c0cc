"""mHC coefficient kernels (paper Eq. 10-19): projection, RMS, gates, biases, Sinkhorn; and backward.

Per token ``t`` with flattened streams ``v = x[t] [K = N * D]`` and ``phi [K, M]``,
``M = 2N + N^2`` columns ``[pre | post | res]``:

    r     = 1 / sqrt(mean(v^2) + eps)                   # the RMS division, after the projection
    p     = r * (v @ phi)                               # saved, fp32 [T, M]
    z     = a_group * p + b                             # gate per column group, bias per column
    h_pre = sigmoid(z_pre);  h_post = 2 sigmoid(z_post);  h_res = sinkhorn(z_res as [N, N])

Forward: one pass (``coefficients_fwd_kernel``), or split over ``K`` (``projection_partial_kernel``
then ``coefficients_finish_kernel``), both ending in the pre-mix and the Sinkhorn core. Backward:
``coefficient_grad_kernel`` (every coefficient's gradient), then ``projection_bwd_kernel`` (``dx``
and per-split ``dphi``). Partial sums are added in a fixed order: no atomics. ``docs/mixing.md``
("Inside the coefficient kernels") gives the passes and derives the gradients.
"""

import functools
import math
from fractions import Fraction
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mhc.kernels._arch import arch
from mhc.kernels._checks import check_positive, check_streams, check_tensor
from mhc.kernels._launch import LaunchPlan, launch, launch_plan, per_size, per_tile, sm_count, static, traced_into_graph
from mhc.kernels._tiles import _load_rows, _row_tile, _store_rows, cdiv, fp32_arg, next_pow2
from mhc.kernels.sinkhorn import sinkhorn_entries, sinkhorn_rows
from mhc.kernels.sinkhorn_eps import sinkhorn_eps_entries, sinkhorn_eps_rows
from mhc.kernels.stream_mix import MAX_STREAMS


@triton.jit
def _dot_fp32(a, b, SPLIT_BF16: tl.constexpr):
    """``a @ b`` with fp32 accuracy on the tensor cores; ``a`` exact in its dtype, ``b`` fp32.

    bf16 ``a`` (``SPLIT_BF16``): ``b`` split into two bf16 terms (16 significant bits, two
    products). Otherwise tf32x3 on fp32 operands (fp16 and bf16 are exact in tf32)."""
    if SPLIT_BF16:
        b_hi = b.to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a, b_hi) + tl.dot(a, b_lo)
    return tl.dot(a.to(tl.float32), b, input_precision="tf32x3")


@triton.jit
def _column_groups(N: tl.constexpr, NPP: tl.constexpr):
    """Columns of the ``[pre | post]`` tile ``[NPP]``: masks of the pre and the post columns."""
    o_c = tl.arange(0, NPP)
    return o_c, o_c < N, (o_c >= N) & (o_c < 2 * N)


@triton.jit
def _gates(alpha_ptr):
    """``(a_pre, a_post, a_res)`` in fp32 from ``alpha [3]`` (in the parameters' dtype)."""
    return (
        tl.load(alpha_ptr).to(tl.float32),
        tl.load(alpha_ptr + 1).to(tl.float32),
        tl.load(alpha_ptr + 2).to(tl.float32),
    )


@triton.jit
def coefficients_epilogue(
    acc_pp,
    acc_res,
    sum_sq,
    o_t,
    t_ok,
    K,
    eps,
    hc_eps,
    alpha_ptr,
    bias_ptr,
    p_ptr,
    r_ptr,
    h_pre_ptr,
    h_post_ptr,
    z_res_ptr,
    N: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    store=True,
):
    """From the projection ``acc = v @ phi`` and the sum of squares of the tokens ``o_t``: store
    ``r``, ``p``, ``h_pre`` (``+ hc_eps``), ``h_post`` and the Sinkhorn logits (where ``store``, a
    constant or a per-program condition); return the ``[pre | post]`` tile of gates (``h_pre``
    without ``hc_eps`` on its pre columns)."""
    M: tl.constexpr = 2 * N + N * N
    o_pp, m_pre, m_post = _column_groups(N, NPP)
    r = 1.0 / tl.sqrt(sum_sq / K + eps)
    p_pp = acc_pp * r[:, None]
    m_t = t_ok[:, None]
    a_pre, a_post, a_res = _gates(alpha_ptr)
    # bias = [b_pre | b_post | vec(b_res)]: the [pre | post] tile's columns are its first 2N entries
    bias_pp = tl.load(bias_ptr + o_pp, mask=o_pp < 2 * N, other=0.0).to(tl.float32)
    h_pp = tl.sigmoid(tl.where(m_pre, a_pre, a_post)[None, :] * p_pp + bias_pp[None, :])
    if store:
        o_res = tl.arange(0, NRES)
        m_res = o_res < N * N
        p_res = acc_res * r[:, None]
        tl.store(r_ptr + o_t, r, mask=t_ok)
        tl.store(p_ptr + o_t[:, None] * M + o_pp[None, :], p_pp, mask=m_t & (o_pp < 2 * N)[None, :])
        tl.store(p_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], p_res, mask=m_t & m_res[None, :])
        tl.store(h_pre_ptr + o_t[:, None] * N + o_pp[None, :], h_pp + hc_eps, mask=m_t & m_pre[None, :])
        tl.store(h_post_ptr + o_t[:, None] * N + (o_pp - N)[None, :], 2.0 * h_pp, mask=m_t & m_post[None, :])
        z_res = a_res * p_res + tl.load(bias_ptr + 2 * N + o_res, mask=m_res, other=0.0).to(tl.float32)[None, :]
        tl.store(z_res_ptr + o_t[:, None] * (N * N) + o_res[None, :], z_res, mask=m_t & m_res[None, :])
    return h_pp


@triton.jit
def pre_mix_pass(
    x_ptr,
    x_in_ptr,
    h_pp,
    hc_eps,
    o_t,
    t_ok,
    D,
    first_chunk,
    chunks,
    N: tl.constexpr,
    NPP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``x_in = sum_j h_pre[j] x[j]`` over the tokens ``o_t`` of ``x [T, N, D]`` and the ``chunks``
    channel chunks (``BLOCK_D`` wide) from ``first_chunk`` on, last chunks first (the most recently
    read or written, the likeliest still in L2)."""
    o_pp = tl.arange(0, NPP)
    h_pre = ()
    for j in tl.static_range(N):
        h_pre = h_pre + (tl.sum(tl.where(o_pp[None, :] == j, h_pp, 0.0), axis=1) + hc_eps,)
    for i_rev in range(chunks):
        o_d = (first_chunk + chunks - 1 - i_rev) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = t_ok[:, None] & (o_d < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(N):
            b_x = tl.load(x_ptr + o_t[:, None] * (N * D) + j * D + o_d[None, :], mask=m, other=0.0)
            acc += h_pre[j][:, None] * b_x.to(tl.float32)
        tl.store(x_in_ptr + o_t[:, None] * D + o_d[None, :], acc.to(x_in_ptr.dtype.element_ty), mask=m)


@triton.jit
def sinkhorn_epilogue(
    z_res_ptr,
    h_res_ptr,
    i_t,
    T,
    hc_eps,
    ITERS: tl.constexpr,
    HAS_EPS: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Sinkhorn of the program's matrices, read back as rows (the layout of the Sinkhorn core)."""
    tl.debug_barrier()
    offs, m = _row_tile(i_t, T, N, BLOCK_T, NP)
    z = _load_rows(z_res_ptr, offs, m, N, False)
    if HAS_EPS:
        h_res = sinkhorn_eps_rows(z, hc_eps, ITERS, N, NP, BLOCK_T)
    else:
        h_res = sinkhorn_rows(z, ITERS, N, NP, BLOCK_T)
    _store_rows(h_res_ptr, offs, m, h_res, N)


@triton.jit
def sinkhorn_entries_epilogue(
    z_res_ptr, h_res_ptr, o_t, t_ok, hc_eps, ITERS: tl.constexpr, HAS_EPS: tl.constexpr, N: tl.constexpr
):
    """Sinkhorn of the tokens ``o_t``'s matrices read back as their ``N * N`` entries, every
    entry held by every thread, so that each step is elementwise (``sinkhorn_entries``) where the
    rows' form reduces across threads at every step: the ``2 * ITERS`` steps are a decoding
    site's longest chain."""
    tl.debug_barrier()
    z = ()
    for e in tl.static_range(N * N):
        z = z + (tl.load(z_res_ptr + o_t * (N * N) + e, mask=t_ok, other=0.0),)
    if HAS_EPS:
        h = sinkhorn_eps_entries(z, hc_eps, ITERS, N)
    else:
        h = sinkhorn_entries(z, ITERS, N)
    for e in tl.static_range(N * N):
        tl.store(h_res_ptr + o_t * (N * N) + e, h[e], mask=t_ok)


@triton.jit
def project_tokens(
    x_ptr,
    phi_ptr,
    o_t,
    t_ok,
    k_begin,
    k_end,
    K,
    N: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``(acc_pp, acc_res, sum_sq)``: the projection ``v @ phi`` of the tokens ``o_t`` over the
    columns ``[k_begin, k_end)`` of ``v``, split into its ``[pre | post]`` and ``res`` column tiles,
    and the sum of squares of the same columns."""
    M: tl.constexpr = 2 * N + N * N
    o_pp = tl.arange(0, NPP)
    o_res = tl.arange(0, NRES)
    m_res = o_res < N * N
    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = o_k < k_end
        b_x = tl.load(x_ptr + o_t[:, None] * K + o_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b_xf = b_x.to(tl.float32)
        sum_sq += tl.sum(b_xf * b_xf, axis=1)
        p_phi = phi_ptr + o_k[:, None] * M
        b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=k_ok[:, None] & (o_pp < 2 * N)[None, :], other=0.0)
        b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=k_ok[:, None] & m_res[None, :], other=0.0)
        b_phi_pp, b_phi_res = b_phi_pp.to(tl.float32), b_phi_res.to(tl.float32)
        acc_pp += _dot_fp32(b_x, b_phi_pp, SPLIT_BF16)
        acc_res += _dot_fp32(b_x, b_phi_res, SPLIT_BF16)
    return acc_pp, acc_res, sum_sq


@triton.jit(do_not_specialize=["T", "eps", "hc_eps"])
def coefficients_fwd_kernel(
    # pointers: streams x [T, N, D]; phi [N * D, M], gates alpha [3] = (a_pre, a_post, a_res) and
    # biases bias [M] = [b_pre | b_post | vec(b_res)], any float dtype (read into fp32)
    x_ptr,
    phi_ptr,
    alpha_ptr,
    bias_ptr,
    # outputs: x_in [T, D] (x's dtype); fp32 p [T, M], r [T], h_pre [T, N], h_post [T, N],
    # z_res [T, N, N] (Sinkhorn logits), h_res [T, N, N]
    x_in_ptr,
    p_ptr,
    r_ptr,
    h_pre_ptr,
    h_post_ptr,
    z_res_ptr,
    h_res_ptr,
    T,
    D,
    eps,
    hc_eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_EPS: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    eps, hc_eps = fp32_arg(eps), fp32_arg(hc_eps)
    K = N * D
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    acc_pp, acc_res, sum_sq = project_tokens(
        x_ptr, phi_ptr, o_t, t_ok, 0, K, K, N, NPP, NRES, SPLIT_BF16, BLOCK_T, BLOCK_K
    )
    h_pp = coefficients_epilogue(
        acc_pp,
        acc_res,
        sum_sq,
        o_t,
        t_ok,
        K,
        eps,
        hc_eps,
        alpha_ptr,
        bias_ptr,
        p_ptr,
        r_ptr,
        h_pre_ptr,
        h_post_ptr,
        z_res_ptr,
        N,
        NPP,
        NRES,
    )
    pre_mix_pass(x_ptr, x_in_ptr, h_pp, hc_eps, o_t, t_ok, D, 0, tl.cdiv(D, BLOCK_K), N, NPP, BLOCK_T, BLOCK_K)
    sinkhorn_epilogue(z_res_ptr, h_res_ptr, i_t, T, hc_eps, ITERS, HAS_EPS, N, NP, BLOCK_T)


@triton.jit(do_not_specialize=["T"])
def projection_partial_kernel(
    # x [T, N, D] -> partial [splits, T, NPP + NRES + 1] fp32: per split the [pre | post] and res
    # tiles of the projection over its columns, then the sum of squares
    x_ptr,
    phi_ptr,
    partial_ptr,
    T,
    D,
    k_split,
    N: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    W: tl.constexpr = NPP + NRES + 1
    K = N * D
    i_s = tl.program_id(1)
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    k_begin = i_s * k_split
    k_end = tl.minimum(k_begin + k_split, K)
    acc_pp, acc_res, sum_sq = project_tokens(
        x_ptr, phi_ptr, o_t, t_ok, k_begin, k_end, K, N, NPP, NRES, SPLIT_BF16, BLOCK_T, BLOCK_K
    )
    row = partial_ptr + (o_t + i_s * T) * W
    tl.store(row[:, None] + tl.arange(0, NPP)[None, :], acc_pp, mask=t_ok[:, None])
    tl.store(row[:, None] + NPP + tl.arange(0, NRES)[None, :], acc_res, mask=t_ok[:, None])
    tl.store(row + NPP + NRES, sum_sq, mask=t_ok)


@triton.jit(do_not_specialize=["T", "splits", "mix_chunks", "eps", "hc_eps"])
def coefficients_finish_kernel(
    # the coefficient forward's epilogue after projection_partial_kernel: arguments as
    # coefficients_fwd_kernel's, with partial [splits, T, NPP + NRES + 1] in place of phi
    x_ptr,
    partial_ptr,
    alpha_ptr,
    bias_ptr,
    x_in_ptr,
    p_ptr,
    r_ptr,
    h_pre_ptr,
    h_post_ptr,
    z_res_ptr,
    h_res_ptr,
    T,
    D,
    splits,
    mix_chunks,
    eps,
    hc_eps,
    N: tl.constexpr,
    NP: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_EPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROLES: tl.constexpr,
    DECODE: tl.constexpr,
):
    """Adds the split's partial projections, ``BLOCK_S`` splits per load, then runs the epilogue,
    Sinkhorn and pre-mix. ``ROLES``: a tile's first program does the coefficients (latency), the
    others the pre-mix, ``mix_chunks`` channel chunks each (bytes); otherwise one program does both.
    ``DECODE`` (a token per program): the Sinkhorn on the matrix's entries."""
    eps, hc_eps = fp32_arg(eps), fp32_arg(hc_eps)
    W: tl.constexpr = NPP + NRES + 1
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    # the coefficients' program stores them (without ROLES the grid has one column: every program);
    # a pre-mix program reads only the partials of h_pre and of the sum of squares
    coefficients = tl.program_id(1) == 0
    o_pp = tl.arange(0, NPP)[None, None, :]
    o_res = tl.arange(0, NRES)[None, None, :]
    read_pp = o_pp < tl.where(coefficients, 2 * N, N)
    read_res = o_res < tl.where(coefficients, N * N, 0)
    for s0 in range(0, splits, BLOCK_S):  # in a fixed order: deterministic
        o_s = s0 + tl.arange(0, BLOCK_S)
        m = t_ok[:, None] & (o_s < splits)[None, :]
        row = partial_ptr + (o_t[:, None] + o_s[None, :] * T) * W  # [BLOCK_T, BLOCK_S]
        acc_pp += tl.sum(tl.load(row[:, :, None] + o_pp, mask=m[:, :, None] & read_pp, other=0.0), axis=1)
        acc_res += tl.sum(tl.load(row[:, :, None] + NPP + o_res, mask=m[:, :, None] & read_res, other=0.0), axis=1)
        sum_sq += tl.sum(tl.load(row + NPP + NRES, mask=m, other=0.0), axis=1)
    h_pp = coefficients_epilogue(
        acc_pp,
        acc_res,
        sum_sq,
        o_t,
        t_ok,
        N * D,
        eps,
        hc_eps,
        alpha_ptr,
        bias_ptr,
        p_ptr,
        r_ptr,
        h_pre_ptr,
        h_post_ptr,
        z_res_ptr,
        N,
        NPP,
        NRES,
        coefficients,
    )
    if ROLES:
        if coefficients:
            if DECODE:
                sinkhorn_entries_epilogue(z_res_ptr, h_res_ptr, o_t, t_ok, hc_eps, ITERS, HAS_EPS, N)
            else:
                sinkhorn_epilogue(z_res_ptr, h_res_ptr, i_t, T, hc_eps, ITERS, HAS_EPS, N, NP, BLOCK_T)
        else:
            first_chunk = (tl.program_id(1) - 1) * mix_chunks
            pre_mix_pass(x_ptr, x_in_ptr, h_pp, hc_eps, o_t, t_ok, D, first_chunk, mix_chunks, N, NPP, BLOCK_T, BLOCK_D)
    else:
        pre_mix_pass(x_ptr, x_in_ptr, h_pp, hc_eps, o_t, t_ok, D, 0, tl.cdiv(D, BLOCK_D), N, NPP, BLOCK_T, BLOCK_D)
        sinkhorn_epilogue(z_res_ptr, h_res_ptr, i_t, T, hc_eps, ITERS, HAS_EPS, N, NP, BLOCK_T)


@triton.jit(do_not_specialize=["T", "hc_eps"])
def coefficient_grad_kernel(
    # inputs: x [T, K], dx_in [T, D] (the pre-mix output's gradient), dh_pre [T, N] (optional,
    # another gradient of h_pre), h_pre, dh_post, h_post [T, N], dz_res [T, N*N], p [T, M], r [T]
    x_ptr,
    dx_in_ptr,
    dh_pre_ptr,
    h_pre_ptr,
    dh_post_ptr,
    h_post_ptr,
    dz_res_ptr,
    p_ptr,
    r_ptr,
    alpha_ptr,
    # outputs (fp32): g [T, M] (projection gradient), c [T] (RMS term), partial [programs, M + 3]
    # (this program's sums of dz and of the gate terms s)
    g_ptr,
    c_ptr,
    partial_ptr,
    T,
    D,
    hc_eps,
    N: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    HAS_DH_PRE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    hc_eps = fp32_arg(hc_eps)
    M: tl.constexpr = 2 * N + N * N
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    m_t = t_ok[:, None]
    o_pp, m_pre, m_post = _column_groups(N, NPP)
    o_res = tl.arange(0, NRES)
    m_res = m_t & (o_res < N * N)[None, :]

    # dh_pre[j] = <x_j, dx_in>, reduced over D
    dots = ()
    for j in tl.static_range(N):
        dots = dots + (tl.zeros([BLOCK_T], dtype=tl.float32),)
    for i_d in range(tl.cdiv(D, BLOCK_D)):
        o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        m = m_t & (o_d < D)[None, :]
        b_dx_in = tl.load(dx_in_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        dots_new = ()
        for j in tl.static_range(N):
            b_x = tl.load(x_ptr + o_t[:, None] * (N * D) + j * D + o_d[None, :], mask=m, other=0.0)
            dots_new = dots_new + (dots[j] + tl.sum(b_x.to(tl.float32) * b_dx_in, axis=1),)
        dots = dots_new
    dh_pre = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    for j in tl.static_range(N):
        dh_pre = tl.where(o_pp[None, :] == j, dots[j][:, None], dh_pre)

    p_pre = o_t[:, None] * N + o_pp[None, :]
    p_post = o_t[:, None] * N + (o_pp - N)[None, :]
    mp_pre = m_t & m_pre[None, :]
    mp_post = m_t & m_post[None, :]
    if HAS_DH_PRE:
        dh_pre += tl.load(dh_pre_ptr + p_pre, mask=mp_pre, other=0.0)
    h_pre = tl.load(h_pre_ptr + p_pre, mask=mp_pre, other=0.0) - hc_eps  # the sigmoid itself
    h_post = tl.load(h_post_ptr + p_post, mask=mp_post, other=0.0)
    # d sigmoid = h (1 - h); d (2 sigmoid) = h_post (1 - h_post / 2)
    dz_pp = dh_pre * h_pre * (1.0 - h_pre)
    dz_pp += tl.load(dh_post_ptr + p_post, mask=mp_post, other=0.0) * h_post * (1.0 - 0.5 * h_post)
    dz_res = tl.load(dz_res_ptr + o_t[:, None] * (N * N) + o_res[None, :], mask=m_res, other=0.0)

    m_pp = m_t & (o_pp < 2 * N)[None, :]
    dz_p_pp = dz_pp * tl.load(p_ptr + o_t[:, None] * M + o_pp[None, :], mask=m_pp, other=0.0)
    s_pre = tl.sum(tl.where(m_pre[None, :], dz_p_pp, 0.0), axis=1)
    s_post = tl.sum(tl.where(m_post[None, :], dz_p_pp, 0.0), axis=1)
    p_res = tl.load(p_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], mask=m_res, other=0.0)
    s_res = tl.sum(dz_res * p_res, axis=1)

    a_pre, a_post, a_res = _gates(alpha_ptr)
    r = tl.load(r_ptr + o_t, mask=t_ok, other=0.0)
    g_pp = dz_pp * tl.where(m_pre, a_pre, a_post)[None, :] * r[:, None]
    tl.store(g_ptr + o_t[:, None] * M + o_pp[None, :], g_pp, mask=m_pp)
    tl.store(g_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], dz_res * (a_res * r)[:, None], mask=m_res)
    tl.store(c_ptr + o_t, r * r / (N * D) * (a_pre * s_pre + a_post * s_post + a_res * s_res), mask=t_ok)

    p_part = partial_ptr + i_t.to(tl.int64) * (M + 3)
    tl.store(p_part + o_pp, tl.sum(dz_pp, axis=0), mask=o_pp < 2 * N)
    tl.store(p_part + 2 * N + o_res, tl.sum(dz_res, axis=0), mask=o_res < N * N)
    tl.store(p_part + M, tl.sum(s_pre, axis=0))
    tl.store(p_part + M + 1, tl.sum(s_post, axis=0))
    tl.store(p_part + M + 2, tl.sum(s_res, axis=0))


@triton.jit(do_not_specialize=["T", "SPLITS", "BIAS_ROWS"])
def projection_bwd_kernel(
    # inputs: x [T, N, D], phi [N * D, M], g [T, M], c [T]; the pre-mix's h_pre [T, N] and
    # dx_in [T, D]; dx_acc [T, N, D] (added to dx); partial_bias [BIAS_ROWS, M + 3] (the
    # coefficient-gradient kernel's per-program sums)
    x_ptr,
    phi_ptr,
    g_ptr,
    c_ptr,
    h_pre_ptr,
    dx_in_ptr,
    dx_acc_ptr,
    partial_bias_ptr,
    # outputs: dx [T, N, D] (x's dtype); partial [SPLITS, N * D * M + M + 3] fp32, per split its
    # dphi [N * D, M] then its share of the sums of partial_bias, so that one sum over the splits
    # gives both
    dx_ptr,
    partial_ptr,
    T,
    D,
    SPLITS,
    BIAS_ROWS,
    N: tl.constexpr,
    NPP: tl.constexpr,
    NRES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    DX_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DX: tl.constexpr,
    DPHI: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
):
    # DX / DPHI: which of the two results this launch computes (both, or one per launch where
    # holding both accumulators at once spills: see projection_passes)
    M: tl.constexpr = 2 * N + N * N
    # program: stream j, channels o_c (rows j * D + o_c of phi), every SPLITS-th token block
    n_c = tl.cdiv(D, BLOCK_D)
    j = tl.program_id(0) // n_c
    i_s = tl.program_id(1)
    o_c = (tl.program_id(0) % n_c) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = o_c < D
    o_k = j * D + o_c
    o_pp = tl.arange(0, NPP)
    o_res = tl.arange(0, NRES)
    m_pp = (o_pp < 2 * N)[None, :]
    m_res = (o_res < N * N)[None, :]
    if DX:
        p_phi = phi_ptr + o_k[:, None] * M
        b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=c_ok[:, None] & m_pp, other=0.0)
        b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=c_ok[:, None] & m_res, other=0.0)
        phi_pp_t, phi_res_t = tl.trans(b_phi_pp.to(tl.float32)), tl.trans(b_phi_res.to(tl.float32))

    dphi_pp = tl.zeros([BLOCK_D, NPP], dtype=tl.float32)
    dphi_res = tl.zeros([BLOCK_D, NRES], dtype=tl.float32)
    for i_t in range(i_s, tl.cdiv(T, BLOCK_T), SPLITS):
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = o_t < T
        m = t_ok[:, None] & c_ok[None, :]
        b_g_pp = tl.load(g_ptr + o_t[:, None] * M + o_pp[None, :], mask=t_ok[:, None] & m_pp, other=0.0)
        b_g_res = tl.load(g_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], mask=t_ok[:, None] & m_res, other=0.0)
        p_x = o_t[:, None] * (N * D) + o_k[None, :]
        b_x = tl.load(x_ptr + p_x, mask=m, other=0.0)

        if DX:
            c = tl.load(c_ptr + o_t, mask=t_ok, other=0.0)
            h_pre = tl.load(h_pre_ptr + o_t * N + j, mask=t_ok, other=0.0)
            b_dx_in = tl.load(dx_in_ptr + o_t[:, None] * D + o_c[None, :], mask=m, other=0.0).to(tl.float32)
            # the elementwise terms first, in the layout they were loaded in, then added to the
            # products as one tile: one layout conversion into the products' layout instead of
            # one per loaded tile (fewer registers: 249 -> 186 at n = 4)
            dx_rest = h_pre[:, None] * b_dx_in - c[:, None] * b_x.to(tl.float32)
            if ACCUMULATE:
                dx_rest += tl.load(dx_acc_ptr + p_x, mask=m, other=0.0).to(tl.float32)
            dx = tl.dot(b_g_pp, phi_pp_t, input_precision=DX_PRECISION)
            dx += tl.dot(b_g_res, phi_res_t, input_precision=DX_PRECISION)
            dx += dx_rest
            tl.store(dx_ptr + p_x, dx.to(dx_ptr.dtype.element_ty), mask=m)

        if DPHI:
            b_xt = tl.trans(b_x)
            dphi_pp += _dot_fp32(b_xt, b_g_pp, SPLIT_BF16)
            dphi_res += _dot_fp32(b_xt, b_g_res, SPLIT_BF16)

    if DPHI:
        p_split = partial_ptr + i_s.to(tl.int64) * (N * D * M + M + 3)
        p_out = p_split + o_k[:, None] * M
        tl.store(p_out + o_pp[None, :], dphi_pp, mask=c_ok[:, None] & m_pp)
        tl.store(p_out + 2 * N + o_res[None, :], dphi_res, mask=c_ok[:, None] & m_res)
        if tl.program_id(0) == 0:
            # this split's share of the bias and gate sums: row tiles i_s, i_s + SPLITS, ...
            o_b = tl.arange(0, NB)
            acc = tl.zeros([BLOCK_R, NB], dtype=tl.float32)
            for i_r in range(i_s * BLOCK_R, BIAS_ROWS, SPLITS * BLOCK_R):
                o_r = i_r + tl.arange(0, BLOCK_R)
                m_b = (o_r < BIAS_ROWS)[:, None] & (o_b < M + 3)[None, :]
                acc += tl.load(partial_bias_ptr + o_r[:, None] * (M + 3) + o_b[None, :], mask=m_b, other=0.0)
            tl.store(p_split + N * D * M + o_b, tl.sum(acc, axis=0), mask=o_b < M + 3)


# ------------------------------------------------------------------------------ launchers


def coefficients_fwd(x, phi, alpha, bias, iters: int, eps: float, hc_eps: float = 0.0):
    """Coefficients and pre-mix of streams ``x [..., N, D]`` (``T`` tokens).

    Returns ``(x_in [..., D], p [T, M], r [T], h_pre [T, N], h_post [T, N], z_res, h_res [T, N, N])``:
    ``x_in`` in ``x``'s dtype, the rest fp32 (``p`` the RMS-scaled projection, ``r`` the inverse RMS,
    ``z_res`` the Sinkhorn logits). ``phi [N*D, M]``, ``alpha [3]``, ``bias [M]`` in any float dtype.
    ``hc_eps > 0``: DeepSeek-V4's ``h_pre = sigmoid + hc_eps`` and Sinkhorn."""
    check_streams(x, "x", MAX_STREAMS)
    n, d = x.shape[-2:]
    M = 2 * n + n * n
    for name, t, shape in (("phi", phi, (n * d, M)), ("alpha", alpha, (3,)), ("bias", bias, (M,))):
        check_tensor(t, name, shape, device=x.device)
    check_positive(iters, "iters")
    return coefficients_fwd_unchecked(x, phi, alpha, bias, iters, eps, hc_eps)


def coefficients_fwd_unchecked(x, phi, alpha, bias, iters: int, eps: float, hc_eps: float = 0.0):
    """:func:`coefficients_fwd` without the argument checks (host time per launch), for callers
    whose arguments are right by construction (:mod:`mhc.ops.mixing`' Functions)."""
    *lead, n, d = x.shape
    n, d, T = static(n), static(d), math.prod(lead)
    x = x.contiguous()
    x_in = torch.empty((*lead, d), dtype=x.dtype, device=x.device)
    p, r, h_pre, h_post, z_res, h_res = per_token_outputs(T, n, x.device)
    if T == 0:
        return x_in, p, r, h_pre, h_post, z_res, h_res
    phi, alpha, bias = phi.contiguous(), alpha.contiguous(), bias.contiguous()
    outputs = (x_in, p, r, h_pre, h_post, z_res, h_res)
    plan = per_size(_forward_plan, T)(n, d, T, iters, hc_eps > 0, _split_bf16(x), x.device)
    main = plan.main
    if plan.finish is None:
        launch(
            coefficients_fwd_kernel, main.grid, (x, phi, alpha, bias), outputs, (T, d, eps, hc_eps), main.meta, main.key
        )
        return outputs
    partial = torch.empty(plan.partial, dtype=torch.float32, device=x.device)
    launch(projection_partial_kernel, main.grid, (x, phi), (partial,), (T, d, plan.k_split), main.meta, main.key)
    finish = plan.finish
    scalars = (T, d, plan.partial[0], plan.mix_chunks, eps, hc_eps)
    launch(
        coefficients_finish_kernel, finish.grid, (x, partial, alpha, bias), outputs, scalars, finish.meta, finish.key
    )
    return outputs


def per_token_outputs(T: int, n: int, device):
    """The fp32 per-token outputs of a coefficient forward: ``(p, r, h_pre, h_post, z_res, h_res)``."""
    shapes = ((T, 2 * n + n * n), (T,), (T, n), (T, n), (T, n, n), (T, n, n))
    return tuple(torch.empty(shape, dtype=torch.float32, device=device) for shape in shapes)


def coefficient_grad(x, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, hc_eps: float):
    """First pass of the coefficient backward: ``(g [T, M], c [T], partial_bias [programs, M + 3])``,
    the projection's gradient, the RMS term and per-program sums for the biases and gates."""
    n, d = static(x.shape[-2]), static(x.shape[-1])
    T, M = math.prod(x.shape[:-2]), 2 * n + n * n
    f32 = dict(dtype=torch.float32, device=x.device)
    g, c = torch.empty((T, M), **f32), torch.empty((T,), **f32)
    has_dh_pre = dh_pre is not None
    plan = per_size(_grad_plan, T)(n, d, T, has_dh_pre, x.device)
    partial_bias = torch.empty((plan.grid[0], M + 3), **f32)
    dh_pre = dh_pre.contiguous() if has_dh_pre else h_pre  # read only with HAS_DH_PRE
    inputs = (x, grad_x_in, dh_pre, h_pre, dh_post.contiguous(), h_post, dz_res.contiguous(), p, r, alpha.contiguous())
    launch(coefficient_grad_kernel, plan.grid, inputs, (g, c, partial_bias), (T, d, hc_eps), plan.meta, plan.key)
    return g, c, partial_bias


def coefficients_bwd(
    x, phi, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc=None, hc_eps: float = 0.0
):
    """Backward of the coefficients and the pre-mix: ``(dx, dphi [K, M], dbias_alpha [M + 3])``.

    ``dh_pre [T, N] | None``, ``dh_post [T, N]``, ``dz_res [T, N, N]`` (through the Sinkhorn backward)
    and ``grad_x_in [..., D]`` are the outputs' gradients; ``dx = h_pre (x) grad_x_in +
    d(projection)/dx (+ grad_x_acc)``, written once. ``dbias_alpha`` holds the gradients of ``bias``
    then ``alpha``, fp32; it and ``dphi`` are views of :func:`coefficients_bwd_packed`'s one tensor."""
    dx, packed = coefficients_bwd_packed(
        x, phi, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc, hc_eps
    )
    dphi, dbias_alpha = packed.split_with_sizes((phi.numel(), packed.numel() - phi.numel()))
    return dx, dphi.view(phi.shape), dbias_alpha


def coefficients_bwd_packed(
    x, phi, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc=None, hc_eps: float = 0.0
):
    """:func:`coefficients_bwd` with the parameters' gradients packed: ``(dx, [vec(dphi) | dbias |
    dalpha])``, fp32 (a ``torch.library`` op's outputs may not alias)."""
    n, d = static(x.shape[-2]), static(x.shape[-1])
    T, K, M = math.prod(x.shape[:-2]), n * d, 2 * n + n * n
    x = x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    if T == 0:
        return torch.zeros_like(x), torch.zeros((K * M + M + 3,), **f32)
    grad_x_in = grad_x_in.contiguous()
    p, r, h_pre, h_post = p.contiguous(), r.contiguous(), h_pre.contiguous(), h_post.contiguous()
    g, c, partial_bias = coefficient_grad(x, alpha, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, hc_eps)
    dx = torch.empty_like(x)
    accumulate = grad_x_acc is not None
    phi, grad_x_acc = phi.contiguous(), grad_x_acc.contiguous() if accumulate else x
    inputs = (x, phi, g, c, h_pre, grad_x_in, grad_x_acc, partial_bias)
    capped = not traced_into_graph(x)
    for part, plan in per_size(_projection_plan, T)(n, d, T, x.dtype, accumulate, _split_bf16(x), capped, x.device):
        splits = plan.grid[1]
        if part != "dx":
            partial = torch.empty((splits, K * M + M + 3), **f32)
        outputs = (dx, partial if part != "dx" else dx)
        scalars = (T, d, splits, partial_bias.shape[0])
        launch(projection_bwd_kernel, plan.grid, inputs, outputs, scalars, plan.meta, plan.key)
    return dx, partial.sum(0)


def _split_bf16(x: torch.Tensor) -> bool:
    # Triton's interpreter multiplies bfloat16 tiles wrongly (numpy has no bfloat16): tf32x3
    # there, which it runs as fp32
    return x.dtype == torch.bfloat16 and x.is_cuda


# ------------------------------------------------------------------------------ launch plans
# One per launcher: its launches for a size (mhc.kernels._launch.LaunchPlan), worked out once per
# size and kept (host time per launch). The tile rules they apply follow, each with its reason.


class ForwardPlan(NamedTuple):
    """The launches of a coefficient forward: ``main`` alone (``coefficients_fwd_kernel``, one
    pass), or the split over ``K``: ``main`` (``projection_partial_kernel``, columns ``k_split``
    wide) writes ``partial [splits, T, width]``, then ``finish`` (``coefficients_finish_kernel``,
    ``mix_chunks`` channel chunks per pre-mix program)."""

    main: LaunchPlan
    finish: LaunchPlan | None = None
    partial: tuple | None = None
    k_split: int = 0
    mix_chunks: int = 0


@launch_plan
def _forward_plan(n: int, d: int, T: int, iters: int, has_eps: bool, split_bf16: bool, device) -> ForwardPlan:
    sms, cols = sm_count(device), _columns(n)
    sinkhorn = dict(NP=next_pow2(n), ITERS=iters, HAS_EPS=has_eps)
    config = coefficients_split_config(n, d, T, sms)
    if config is None:
        block_t, block_k, num_warps, num_stages = coefficients_fwd_config(n)
        meta = dict(**cols, **sinkhorn, SPLIT_BF16=split_bf16, BLOCK_T=block_t, BLOCK_K=block_k)
        meta.update(num_warps=num_warps, num_stages=num_stages)
        key = ("coefficients_fwd", n, iters, has_eps, split_bf16)
        return ForwardPlan(LaunchPlan((cdiv(T, block_t),), meta, key))
    block_t, block_k, num_warps, num_stages, waves = config
    splits, k_split = k_splits(T, n * d, block_t, block_k, waves, device)
    meta = dict(**cols, SPLIT_BF16=split_bf16, BLOCK_T=block_t, BLOCK_K=block_k)
    meta.update(num_warps=num_warps, num_stages=num_stages)
    main = LaunchPlan((cdiv(T, block_t), splits), meta, ("projection_partial", config, n, split_bf16))
    decode = decoding(n, d, T)
    entries = decode and n <= ENTRIES_MAX_N
    few = decode or few_tokens(n, d, T, sms)
    finish_t, finish_d, finish_warps = finish_config = coefficients_finish_config(n, few, decode)
    block_s = finish_split_block(splits, finish_t, cols["NRES"])
    meta = dict(**cols, **sinkhorn, BLOCK_T=finish_t, BLOCK_D=finish_d, BLOCK_S=block_s, ROLES=few, DECODE=entries)
    meta.update(num_warps=finish_warps)
    tiles, chunks = cdiv(T, finish_t), cdiv(d, finish_d)
    if few:  # a program for the coefficients, then one per share of the chunks
        mix_chunks = cdiv(chunks, pre_mix_programs(tiles, chunks, sms))
        grid = (tiles, 1 + cdiv(chunks, mix_chunks))
    else:
        mix_chunks, grid = chunks, (tiles,)
    finish = LaunchPlan(grid, meta, ("coefficients_finish", finish_config, n, iters, has_eps, few, entries, block_s))
    width = cols["NPP"] + cols["NRES"] + 1  # a partial row: [pre | post] tile, res tile, sum of squares
    return ForwardPlan(main, finish, (splits, T, width), k_split, mix_chunks)


@launch_plan
def _grad_plan(n: int, d: int, T: int, has_dh_pre: bool, device) -> LaunchPlan:
    block_t, block_d, num_warps = config = coefficient_grad_config(n, d, T, sm_count(device))
    meta = dict(**_columns(n), HAS_DH_PRE=has_dh_pre, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps)
    return LaunchPlan((cdiv(T, block_t),), meta, ("coefficient_grad", n, d, has_dh_pre, config))


@launch_plan
def _projection_plan(n: int, d: int, T: int, dtype, accumulate: bool, split_bf16: bool, capped: bool, device) -> tuple:
    """``((part, LaunchPlan), ...)``: the projection backward's passes (:func:`projection_passes`),
    each over a ``(channel chunks, token splits)`` grid. ``capped``: whether the kernel is compiled
    with the register cap its launch asks for (:func:`projection_bwd_config`)."""
    precision, plans = dx_precision(dtype, n), []
    for part in projection_passes(n):
        if part == "dphi":
            config = dphi_bwd_config(n, d, dtype)
        else:
            config = projection_bwd_config(n, d, dtype, capped)
        block_t, block_d, num_warps, num_stages, waves, maxnreg = config
        meta = dict(**_columns(n), ACCUMULATE=accumulate, SPLIT_BF16=split_bf16, DX_PRECISION=precision)
        meta.update(BLOCK_T=block_t, BLOCK_D=block_d, DX=part != "dphi", DPHI=part != "dx")
        meta.update(BLOCK_R=BIAS_TILE, NB=next_pow2(2 * n + n * n + 3), num_warps=num_warps, num_stages=num_stages)
        if maxnreg is not None:
            meta.update(maxnreg=maxnreg)
        chunks = n * cdiv(d, block_d)
        splits = token_splits(T, block_t, waves, chunks, device, resident_programs(maxnreg, num_warps))
        key = ("projection_bwd", config, n, d, dtype, accumulate, split_bf16, precision, part, BIAS_TILE)
        plans.append((part, LaunchPlan((chunks, splits), meta, key)))
    return tuple(plans)


# ------------------------------------------------------------------------------ tile rules


def _columns(n: int) -> dict:
    """Tile widths of the ``[pre | post]`` and ``res`` column groups (``tl.dot`` needs >= 16)."""
    return dict(N=n, NPP=max(16, next_pow2(2 * n)), NRES=max(16, next_pow2(n * n)))


def dx_precision(dtype: torch.dtype, n: int) -> str:
    """Precision of ``g @ phi^T`` in the projection backward: one tf32 product for bf16 ``dx`` up to
    n = 8 (its 8 significant bits hide tf32's rounding; at n = 5..8 only the split backward's ``dx``
    pass runs, the one-pass kernel failed with tf32 under Triton 3.6); tf32x3 otherwise."""
    return "tf32" if dtype == torch.bfloat16 and n <= 8 else "tf32x3"


def coefficients_fwd_config(n: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_K, num_warps, num_stages)`` of the forward projection in one pass (where
    ``coefficients_split_config`` is ``None``; its n = 5..8 tiles serve the sweeps of
    ``bench/tune_mixing.py``, which compare the split against them)."""
    stages = arch().max_stages
    if 4 < n <= 8:  # larger token tiles at n = 5..8 (the sweep of dev/LOG.md, "Launch choices")
        return 64, 64, 4, min(4, stages)
    cols = _columns(n)
    block_k = max(16, min(128, next_pow2(8192 // (cols["NPP"] + cols["NRES"])) // 2))
    return (SMALL_TILE if n <= 4 else 16), block_k, 4, min(3, stages)


def coefficients_split_config(n: int, d: int, tokens: int, sms: int) -> tuple[int, int, int, int, int] | None:
    """``(BLOCK_T, BLOCK_K, num_warps, num_stages, waves)`` of the forward split over ``K``
    (``projection_partial_kernel``, about ``waves`` programs per SM), or ``None``: one pass.

    Many tokens: the split pays where one program's ``K`` loop is long (n = 5..8, ``n * d >= 16384``).
    Few tokens and decoding: the one-pass grid leaves SMs idle; decoding takes one program per SM
    (more splits cost the finishing kernel more partials than they save). A symbolic token count takes
    the rule for many tokens (``python -m bench.tune_mixing coefficients-split | small-tokens``)."""
    stages = min(3, arch().max_stages)
    if decoding(n, d, tokens):  # n > 8: res tiles up to 256 wide, so 32 x 32 tiles of tokens and columns
        return (SMALL_TILE, 64, 4, stages, 1) if n <= ENTRIES_MAX_N else (32, 32, 4, stages, 1)
    if few_tokens(n, d, tokens, sms):
        return SMALL_TILE, 64, 4, stages, 4
    if 4 < n <= 8 or (n <= 4 and n * d >= 16384):
        return 128, 64, 8, stages, 4
    return None


SMALL_TILE = 64  # tokens per program of the one-pass forward at n <= 4, and of the small-token split


def few_tokens(n: int, d: int, tokens, sms: int) -> bool:
    """Whether the forward at n <= 4 (``n * d >= 1024``) takes the small-token split: at most one
    one-pass program (``SMALL_TILE`` tokens) per SM. False for a symbolic count."""
    return n <= 4 and n * d >= 1024 and isinstance(tokens, int) and cdiv(tokens, SMALL_TILE) <= sms


def decoding(n: int, d: int, tokens) -> bool:
    """Whether the forward takes the decoding tiles (``docs/decode.md``): at most ``DECODE_TOKENS``
    tokens, ``n * d >= 1024``."""
    return n * d >= 1024 and type(tokens) is int and tokens <= DECODE_TOKENS


DECODE_TOKENS = 64
ENTRIES_MAX_N = 8  # the decoding Sinkhorn on entries holds n * n values per thread: the rows' form beyond


def coefficients_finish_config(n: int, few: bool, decode: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps)`` of ``coefficients_finish_kernel``: 32-token tiles; 8-token ones
    after the small-token split (``few``); one token per program when ``decode``-ing, one warp for the
    entries' Sinkhorn (its reductions stay in the warp), four for the rows' form beyond n = 8."""
    if decode:  # one warp for the entries' Sinkhorn; the rows' form reduces across four
        return 1, 128, (1 if n <= ENTRIES_MAX_N else 4)
    return (8, 128, 4) if few else (32, 128, 4)


def finish_split_block(splits: int, block_t: int, nres: int) -> int:
    """Splits whose partial projections ``coefficients_finish_kernel`` adds at once: up to 2048
    values of its widest tile (16 per thread at 4 warps, 64 at the decoding tiles' one)."""
    return max(1, min(next_pow2(splits), 2048 // (block_t * nres)))


def k_splits(T: int, K: int, block_t: int, block_k: int, waves: int, device) -> tuple[int, int]:
    """``(splits, k_split)``: about ``waves`` programs per SM over ``cdiv(T, block_t)`` token
    tiles, each split ``k_split`` columns wide (a multiple of ``block_k``). A symbolic token count
    takes the rule for many tokens, where the token tiles alone fill the GPU: one split."""
    chunks = cdiv(K, block_k)
    splits = per_tile(cdiv(T, block_t), waves, sm_count(device), chunks) if type(T) is int else 1
    k_split = cdiv(chunks, splits) * block_k
    return cdiv(K, k_split), k_split


def pre_mix_programs(tiles: int, chunks: int, sms: int) -> int:
    """Pre-mix programs per token tile of the small-token finishing kernel: about
    ``PRE_MIX_WAVES`` per SM over all tiles, at most one per channel chunk. One program per tile
    keeps a few KiB of ``x`` in flight per SM, far from what an HBM GPU's bandwidth needs."""
    return per_tile(tiles, PRE_MIX_WAVES, sms, chunks)


PRE_MIX_WAVES = 4


def coefficient_grad_config(n: int, d: int, tokens, sms: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps)`` of ``coefficient_grad_kernel``: 4-token programs over all of
    ``D``; where those give fewer than ``GRAD_WAVES`` programs per SM (n <= 4, about 1k tokens),
    one-token programs 1024 channels wide: more programs, more bytes in flight each
    (``python -m bench.tune_mixing small-tokens-mix``). A symbolic token count takes 4-token tiles."""
    if n <= 4 and type(tokens) is int and cdiv(tokens, 4) < GRAD_WAVES * sms:
        return 1, min(1024, next_pow2(d)), 4
    return 4, min(128, next_pow2(d)), 4


GRAD_WAVES = 2


def projection_bwd_config(
    n: int, d: int, dtype=torch.bfloat16, capped: bool = True
) -> tuple[int, int, int, int, int, int | None]:
    """``(BLOCK_T, BLOCK_D, num_warps, num_stages, waves, maxnreg)`` for streams of ``dtype``
    (``maxnreg``: the register cap, ``None`` for the compiler's choice). ``capped=False``: the kernel
    is compiled without a cap, as Inductor does (``python -m bench.tune_mixing projection-compiled``)."""
    limits = arch()
    stages = min(3, limits.max_stages)
    if n <= 4:
        if capped and limits.register_caps:
            # 168 registers let three programs share an SM, and 6 programs per SM are two full
            # rounds of them (faster than uncapped registers or 8 programs per SM at every d swept)
            return 64, 64, 4, stages, 6, 168
        # two stages: 166 registers uncapped, three programs per SM still (three stages: 182, two)
        return 64, 64, 4, min(2, limits.max_stages), 6, None
    if n <= 8:
        # the dx pass of the split backward (projection_passes): 128 registers with a tf32 product,
        # 244 with tf32x3, no spills; fp32 tiles need two stages to fit in shared memory
        return 64, 64, 4, stages if dtype.itemsize <= 2 else 2, 6, None
    return 16, 32, 4, 2, 4, None


def resident_programs(maxnreg: int | None, num_warps: int) -> int | None:
    """Programs an SM holds at once where the registers per thread are capped (64K registers per
    SM), else ``None``: unknown."""
    return None if maxnreg is None else 65536 // (maxnreg * 32 * num_warps)


def projection_passes(n: int) -> tuple[str, ...]:
    """The launches of the projection backward: ``("both",)``, one pass writing ``dx`` and
    ``dphi``; or ``("dx", "dphi")``, two passes over ``x`` where the ``dphi`` accumulators beside
    the ``dx`` tiles spill (n = 5..8: res columns 32 or 64 wide)."""
    return ("dx", "dphi") if 4 < n <= 8 else ("both",)


def dphi_bwd_config(n: int, d: int, dtype=torch.bfloat16) -> tuple[int, int, int, int, int, int | None]:
    """``projection_bwd_config`` of the ``dphi`` pass of a split projection backward: 150
    registers, no spills (the fastest of the n = 8 sweep). fp16 and fp32 streams take tf32x3
    products on fp32 tiles, and fp32 ``(128, 128)`` tiles need more shared memory than a Hopper SM
    has: ``(64, 64)``."""
    wide = dtype == torch.bfloat16 and arch().max_stages >= 3  # 128 x 128 tiles in three stages
    return (128, 128, 8, 3, 4, None) if wide else (64, 64, 4, 2, 4, None)


def token_splits(T: int, block_t: int, waves: int, chunks: int, device, resident: int | None = None) -> int:
    """Token splits of a ``(chunks, splits)`` grid, at least ``MIN_SPLIT_BLOCKS`` token blocks each: every
    split writes a partial ``dphi`` that is read again, so where tokens are few more splits move more
    bytes than they save. Where ``resident`` (programs an SM holds at once) is known, the splits that
    finish in the fewest whole rounds of resident programs, the fewest on ties; otherwise about
    ``waves`` programs per SM. A symbolic token count takes a rule independent of the count."""
    sms = sm_count(device)
    if type(T) is not int:
        most = per_tile(chunks, waves, sms, waves * sms)
        return most if resident is None else _fewest_rounds_per_block(chunks, resident * sms, most)
    blocks = cdiv(T, block_t)
    most = per_tile(chunks, waves, sms, blocks // MIN_SPLIT_BLOCKS)
    if resident is None:
        return most
    return _fewest_rounds(blocks, chunks, resident * sms, most)


@functools.lru_cache(maxsize=256)
def _fewest_rounds(blocks: int, chunks: int, slots: int, most: int) -> int:
    return min(range(1, most + 1), key=lambda s: (cdiv(chunks * s, slots) * cdiv(blocks, s), s))


def _fewest_rounds_per_block(chunks: int, slots: int, most: int) -> int:
    # _fewest_rounds as the token blocks grow: cdiv(blocks, s) -> blocks / s
    return min(range(1, most + 1), key=lambda s: (Fraction(cdiv(chunks * s, slots), s), s))


MIN_SPLIT_BLOCKS = 4


BIAS_TILE = 64  # rows of the per-program bias sums that a dphi program adds at a time
