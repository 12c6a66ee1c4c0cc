"""mHC coefficient kernels (paper Eq. 10-19): projection, RMS, gates, biases, Sinkhorn; and backward.

Per token ``t`` with flattened streams ``v = x[t] [K = N * D]`` and ``phi [K, M]``,
``M = 2N + N^2`` columns ``[pre | post | res]``:

    r     = 1 / sqrt(mean(v^2) + eps)                   # the RMS division, after the projection
    p     = r * (v @ phi)                               # saved, fp32 [T, M]
    z     = a_group * p + b                             # gate per column group, bias per column
    h_pre = sigmoid(z_pre);  h_post = 2 sigmoid(z_post);  h_res = sinkhorn(z_res as [N, N])

The forward reads ``x`` once in its own dtype; the projection runs on the tensor cores with
fp32 accuracy (``_dot_fp32``). Its epilogue calls the Sinkhorn core (``sinkhorn_rows``) on the
program's own tokens. The backward is split in two passes because the input gradient of the
projection needs every coefficient's gradient first:

1. ``coefficient_grad_kernel`` (per token, tiny): ``dz`` for every column (``dh_res`` already
   through the Sinkhorn backward), the per-token sums ``s_g = sum_{m in g} dz_m p_m`` for the
   gates, and ``c = r^2 / K * sum_g a_g s_g``, the RMS term.
2. ``projection_bwd_kernel`` over ``(K chunk, token split)``: ``g = a * dz * r``,
   ``dv = g @ phi^T - c v`` added to the other gradients of ``x`` (one read and one write of the
   streams), and ``dphi = v^T g`` accumulated in registers over the split's tokens, written as one
   partial per split (summed in a fixed order afterwards: deterministic, no atomics).

``docs/mixing.md`` derives the gradients.
"""

import torch
import triton
import triton.language as tl

from mhc.kernels._tiles import _load_rows, _row_tile, _store_rows, next_pow2
from mhc.kernels.sinkhorn import sinkhorn_rows
from mhc.kernels.stream_mix import MAX_STREAMS


@triton.jit
def _dot_fp32(a, b, SPLIT_BF16: tl.constexpr):
    """``a @ b`` with fp32 accuracy on the tensor cores; ``a`` exact in its dtype, ``b`` fp32.

    bf16 ``a`` (``SPLIT_BF16``): ``b`` split into two bf16 terms (16 significant bits, two
    products). Otherwise tf32x3 on fp32 operands (fp16 and bf16 are exact in tf32).
    """
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
def coefficients_fwd_kernel(
    # pointers: streams x [T, K], phi [K, M] fp32, gates (3 scalars), biases
    x_ptr, phi_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
    # outputs (fp32): p [T, M], r [T], h_pre [T, N], h_post [T, N], z_res [T, N, N], h_res [T, N, N]
    p_ptr, r_ptr, h_pre_ptr, h_post_ptr, z_res_ptr, h_res_ptr,
    T, K, eps,
    N: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr, NRES: tl.constexpr, ITERS: tl.constexpr,
    SPLIT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    o_pp, m_pre, m_post = _column_groups(N, NPP)
    o_res = tl.arange(0, NRES)
    m_res = o_res < N * N

    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = o_k < K
        b_x = tl.load(x_ptr + o_t[:, None] * K + o_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        b_xf = b_x.to(tl.float32)
        sum_sq += tl.sum(b_xf * b_xf, axis=1)
        p_phi = phi_ptr + o_k[:, None] * M
        b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=k_ok[:, None] & (o_pp < 2 * N)[None, :], other=0.0)
        b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=k_ok[:, None] & m_res[None, :], other=0.0)
        acc_pp += _dot_fp32(b_x, b_phi_pp, SPLIT_BF16)
        acc_res += _dot_fp32(b_x, b_phi_res, SPLIT_BF16)

    r = 1.0 / tl.sqrt(sum_sq / K + eps)
    p_pp = acc_pp * r[:, None]
    p_res = acc_res * r[:, None]
    tl.store(r_ptr + o_t, r, mask=t_ok)
    tl.store(p_ptr + o_t[:, None] * M + o_pp[None, :], p_pp, mask=t_ok[:, None] & (o_pp < 2 * N)[None, :])
    tl.store(p_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], p_res, mask=t_ok[:, None] & m_res[None, :])

    a_pre = tl.load(a_pre_ptr)
    a_post = tl.load(a_post_ptr)
    a_res = tl.load(a_res_ptr)
    bias_pp = tl.load(b_pre_ptr + o_pp, mask=m_pre, other=0.0) + tl.load(b_post_ptr + (o_pp - N), mask=m_post, other=0.0)
    h_pp = tl.sigmoid(tl.where(m_pre, a_pre, a_post)[None, :] * p_pp + bias_pp[None, :])
    m_t = t_ok[:, None]
    tl.store(h_pre_ptr + o_t[:, None] * N + o_pp[None, :], h_pp, mask=m_t & m_pre[None, :])
    tl.store(h_post_ptr + o_t[:, None] * N + (o_pp - N)[None, :], 2.0 * h_pp, mask=m_t & m_post[None, :])
    z_res = a_res * p_res + tl.load(b_res_ptr + o_res, mask=m_res, other=0.0)[None, :]
    tl.store(z_res_ptr + o_t[:, None] * (N * N) + o_res[None, :], z_res, mask=m_t & m_res[None, :])

    # Sinkhorn of this program's matrices, read back as rows (the layout of the Sinkhorn core)
    tl.debug_barrier()
    offs, m = _row_tile(i_t, T, N, BLOCK_T, NP)
    h_res = sinkhorn_rows(_load_rows(z_res_ptr, offs, m, N, False), ITERS, N, NP, BLOCK_T)
    _store_rows(h_res_ptr, offs, m, h_res, N)


@triton.jit
def coefficient_grad_kernel(
    # inputs (fp32): dh_pre, h_pre, dh_post, h_post [T, N]; dz_res [T, N*N]; p [T, M]; r [T]; gates
    dh_pre_ptr, h_pre_ptr, dh_post_ptr, h_post_ptr, dz_res_ptr, p_ptr, r_ptr,
    a_pre_ptr, a_post_ptr, a_res_ptr,
    # outputs (fp32): dz [T, M], s [T, 3] (per-group sum of dz * p), c [T] (RMS term)
    dz_ptr, s_ptr, c_ptr,
    T, K,
    N: tl.constexpr, NPP: tl.constexpr, NRES: tl.constexpr, BLOCK_T: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = (o_t < T)[:, None]
    o_pp, m_pre, m_post = _column_groups(N, NPP)
    o_res = tl.arange(0, NRES)
    m_res = m_t & (o_res < N * N)[None, :]
    p_pre = o_t[:, None] * N + o_pp[None, :]
    p_post = o_t[:, None] * N + (o_pp - N)[None, :]
    mp_pre = m_t & m_pre[None, :]
    mp_post = m_t & m_post[None, :]

    h_pre = tl.load(h_pre_ptr + p_pre, mask=mp_pre, other=0.0)
    h_post = tl.load(h_post_ptr + p_post, mask=mp_post, other=0.0)
    dz_pp = tl.load(dh_pre_ptr + p_pre, mask=mp_pre, other=0.0) * h_pre * (1.0 - h_pre)
    dz_pp += tl.load(dh_post_ptr + p_post, mask=mp_post, other=0.0) * h_post * (1.0 - 0.5 * h_post)
    dz_res = tl.load(dz_res_ptr + o_t[:, None] * (N * N) + o_res[None, :], mask=m_res, other=0.0)
    m_pp = m_t & (o_pp < 2 * N)[None, :]
    tl.store(dz_ptr + o_t[:, None] * M + o_pp[None, :], dz_pp, mask=m_pp)
    tl.store(dz_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], dz_res, mask=m_res)

    dz_p_pp = dz_pp * tl.load(p_ptr + o_t[:, None] * M + o_pp[None, :], mask=m_pp, other=0.0)
    s_pre = tl.sum(tl.where(m_pre[None, :], dz_p_pp, 0.0), axis=1)
    s_post = tl.sum(tl.where(m_post[None, :], dz_p_pp, 0.0), axis=1)
    p_res = tl.load(p_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], mask=m_res, other=0.0)
    s_res = tl.sum(dz_res * p_res, axis=1)
    t_ok = o_t < T
    tl.store(s_ptr + o_t * 3, s_pre, mask=t_ok)
    tl.store(s_ptr + o_t * 3 + 1, s_post, mask=t_ok)
    tl.store(s_ptr + o_t * 3 + 2, s_res, mask=t_ok)
    r = tl.load(r_ptr + o_t, mask=t_ok, other=0.0)
    a_s = tl.load(a_pre_ptr) * s_pre + tl.load(a_post_ptr) * s_post + tl.load(a_res_ptr) * s_res
    tl.store(c_ptr + o_t, r * r / K * a_s, mask=t_ok)


@triton.jit
def projection_bwd_kernel(
    # inputs: x [T, K = N * D], phi [K, M], dz [T, M], r [T], c [T], gates; the pre-mix's
    # h_pre [T, N] and dx_in [T, D]; dx_acc [T, K] (added to dx)
    x_ptr, phi_ptr, dz_ptr, r_ptr, c_ptr, a_pre_ptr, a_post_ptr, a_res_ptr,
    h_pre_ptr, dx_in_ptr, dx_acc_ptr,
    # outputs: dx [T, K] (x's dtype), dphi_partial [SPLITS, K, M] fp32
    dx_ptr, dphi_ptr,
    T, D, SPLITS,
    N: tl.constexpr, NPP: tl.constexpr, NRES: tl.constexpr, ACCUMULATE: tl.constexpr,
    SPLIT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    K = N * D
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = o_k < K
    o_j = o_k // D  # stream and channel of each flattened column
    o_c = o_k % D
    o_pp, m_pre, m_post = _column_groups(N, NPP)
    o_res = tl.arange(0, NRES)
    m_pp = (o_pp < 2 * N)[None, :]
    m_res = (o_res < N * N)[None, :]
    # phi's rows of this chunk, kept for every token block
    p_phi = phi_ptr + o_k[:, None] * M
    b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=k_ok[:, None] & m_pp, other=0.0)
    b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=k_ok[:, None] & m_res, other=0.0)
    gate_pp = tl.where(m_pre, tl.load(a_pre_ptr), tl.load(a_post_ptr))
    a_res = tl.load(a_res_ptr)

    dphi_pp = tl.zeros([BLOCK_K, NPP], dtype=tl.float32)
    dphi_res = tl.zeros([BLOCK_K, NRES], dtype=tl.float32)
    for i_t in range(i_s, tl.cdiv(T, BLOCK_T), SPLITS):
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = o_t < T
        m_tk = t_ok[:, None] & k_ok[None, :]
        r = tl.load(r_ptr + o_t, mask=t_ok, other=0.0)
        c = tl.load(c_ptr + o_t, mask=t_ok, other=0.0)
        dz_pp = tl.load(dz_ptr + o_t[:, None] * M + o_pp[None, :], mask=t_ok[:, None] & m_pp, other=0.0)
        dz_res = tl.load(dz_ptr + o_t[:, None] * M + 2 * N + o_res[None, :], mask=t_ok[:, None] & m_res, other=0.0)
        g_pp = dz_pp * gate_pp[None, :] * r[:, None]
        g_res = dz_res * (a_res * r)[:, None]

        p_x = o_t[:, None] * K + o_k[None, :]
        b_x = tl.load(x_ptr + p_x, mask=m_tk, other=0.0)
        dv = tl.dot(g_pp, tl.trans(b_phi_pp), input_precision="tf32x3")
        dv += tl.dot(g_res, tl.trans(b_phi_res), input_precision="tf32x3")
        dv -= c[:, None] * b_x.to(tl.float32)
        # the pre-mix's gradient, h_pre[j] * dx_in
        h_pre = tl.load(h_pre_ptr + o_t[:, None] * N + o_j[None, :], mask=m_tk, other=0.0)
        dv += h_pre * tl.load(dx_in_ptr + o_t[:, None] * D + o_c[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if ACCUMULATE:
            dv += tl.load(dx_acc_ptr + p_x, mask=m_tk, other=0.0).to(tl.float32)
        tl.store(dx_ptr + p_x, dv.to(dx_ptr.dtype.element_ty), mask=m_tk)

        b_xt = tl.trans(b_x)
        dphi_pp += _dot_fp32(b_xt, g_pp, SPLIT_BF16)
        dphi_res += _dot_fp32(b_xt, g_res, SPLIT_BF16)

    p_out = dphi_ptr + i_s.to(tl.int64) * K * M + o_k[:, None] * M
    tl.store(p_out + o_pp[None, :], dphi_pp, mask=k_ok[:, None] & m_pp)
    tl.store(p_out + 2 * N + o_res[None, :], dphi_res, mask=k_ok[:, None] & m_res)


# ------------------------------------------------------------------------------ launchers


def _columns(n: int) -> dict:
    """Tile widths of the ``[pre | post]`` and ``res`` column groups (``tl.dot`` needs >= 16)."""
    return dict(N=n, NPP=max(16, next_pow2(2 * n)), NRES=max(16, next_pow2(n * n)))


def _split_bf16(x: torch.Tensor) -> bool:
    # Triton's interpreter multiplies bfloat16 tiles wrongly (numpy has no bfloat16): tf32x3
    # there, which it runs as fp32
    return x.dtype == torch.bfloat16 and x.is_cuda


def _fwd_block_t(n: int) -> int:
    return 64 if n <= 4 else (32 if n <= 8 else 16)


def coefficients_fwd(x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters: int, eps: float):
    """``x [T, N, D]`` -> ``(p [T, M], r [T], h_pre [T, N], h_post [T, N], z_res, h_res [T, N, N])``.

    All outputs fp32. ``phi [N*D, M]``, gates 0-d or ``[1]``, biases ``[N]``, ``[N]``, ``[N, N]``,
    all fp32.
    """
    T, n, d = x.shape
    K, M = n * d, 2 * n + n * n
    assert phi.shape == (K, M) and 1 <= n <= MAX_STREAMS and iters >= 1
    x = x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    p, r = torch.empty((T, M), **f32), torch.empty((T,), **f32)
    h_pre, h_post = torch.empty((T, n), **f32), torch.empty((T, n), **f32)
    z_res, h_res = torch.empty((T, n, n), **f32), torch.empty((T, n, n), **f32)
    if T == 0:
        return p, r, h_pre, h_post, z_res, h_res
    cols = _columns(n)
    block_t = _fwd_block_t(n)
    block_k = max(16, min(128, next_pow2(8192 // (cols["NPP"] + cols["NRES"])) // 2))
    coefficients_fwd_kernel[(triton.cdiv(T, block_t),)](
        x, phi.contiguous(), a_pre, a_post, a_res, b_pre.contiguous(), b_post.contiguous(), b_res.contiguous(),
        p, r, h_pre, h_post, z_res, h_res,
        T, K, eps,
        NP=next_pow2(n), ITERS=iters, SPLIT_BF16=_split_bf16(x), BLOCK_T=block_t, BLOCK_K=block_k,
        num_warps=4, **cols,
    )
    return p, r, h_pre, h_post, z_res, h_res


def coefficients_bwd(
    x, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc=None
):
    """Backward of the coefficients and the pre-mix: ``(dx [T, N, D], dphi [K, M], dz [T, M], s [T, 3])``.

    ``dh_pre``, ``dh_post [T, N]`` and ``dz_res [T, N, N]`` (the gradient of the Sinkhorn logits)
    are the coefficients' gradients, ``grad_x_in [T, D]`` the pre-mix output's; ``dz`` and ``s``
    give the biases' and gates' gradients (``db = dz.sum(0)``, ``da = s.sum(0)``).
    ``dx = h_pre (x) grad_x_in + d(projection)/dx + grad_x_acc`` (when given), in one pass.
    """
    T, n, d = x.shape
    K, M = n * d, 2 * n + n * n
    x = x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    dz, s, c = torch.empty((T, M), **f32), torch.empty((T, 3), **f32), torch.empty((T,), **f32)
    dx = torch.empty_like(x)
    if T == 0:
        return dx.zero_(), torch.zeros((K, M), **f32), dz, s
    cols = _columns(n)
    coefficient_grad_kernel[(triton.cdiv(T, 128),)](
        dh_pre.contiguous(), h_pre, dh_post.contiguous(), h_post, dz_res.contiguous(), p, r,
        a_pre, a_post, a_res, dz, s, c, T, K, BLOCK_T=128, num_warps=4, **cols,
    )
    block_t = 64 if n <= 8 else 32
    block_k = 64
    k_chunks = triton.cdiv(K, block_k)
    splits = max(1, min(triton.cdiv(T, block_t), triton.cdiv(4 * _sm_count(x.device), k_chunks)))
    partial = torch.empty((splits, K, M), **f32)
    accumulate = grad_x_acc is not None
    projection_bwd_kernel[(k_chunks, splits)](
        x, phi.contiguous(), dz, r, c, a_pre, a_post, a_res,
        h_pre, grad_x_in.contiguous(), grad_x_acc.contiguous() if accumulate else x, dx, partial,
        T, d, splits,
        ACCUMULATE=accumulate, SPLIT_BF16=_split_bf16(x), BLOCK_T=block_t, BLOCK_K=block_k,
        num_warps=4, **cols,
    )
    return dx, partial.sum(0), dz, s


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
