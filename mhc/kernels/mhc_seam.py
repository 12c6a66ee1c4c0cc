"""The seam between two consecutive mHC sites: site ``l``'s post-mix and site ``l+1``'s coefficients
in one pass over the streams, and the matching backward.

Site ``l`` ends with ``x'[i] = sum_j h_res[i, j] x[j] + h_post[i] y`` (its post-mix and residual
merge); site ``l+1`` starts by projecting exactly those streams (``mhc_coefficients.py``). Run
apart, ``x'`` is written by one kernel and read back by the next, forward and backward alike.

Forward (``seam_fwd_kernel``): a program owns ``BLOCK_T`` tokens and walks the channels in
``BLOCK_D`` chunks. Per chunk it loads the ``N`` streams of ``x`` and ``y``, forms the ``N`` new
stream tiles, stores them, and feeds them (rounded to the stream dtype, as the unchained kernels
would read them back) to site ``l+1``'s projection and sum of squares. The epilogue is the
coefficient kernel's: gates, biases, the pre-mix pass over ``x'`` and the Sinkhorn core.

Backward (``seam_bwd_kernel``): site ``l+1``'s projection backward produces the streams'
gradient ``dx' = g @ phi^T - c x' + h_pre (x) dx_in + dx_acc``, which is exactly the ``dout`` of
site ``l``'s post-mix backward. A program owns a chunk of channels of all ``N`` streams for a
split of the tokens, so ``dx'`` never leaves the chip: from it the program writes site ``l``'s
``dx = h_res^T dx'`` and ``dy = sum_i h_post[i] dx'[i]``, and its partial sums over the chunk of
``<dx'_i, x_j>`` and ``<dx'_i, y>`` (the gradients of ``h_res`` and ``h_post``, summed over chunks
afterwards in a fixed order). ``dphi`` accumulates in registers over the split's tokens, as in
``projection_bwd_kernel``. ``docs/mixing.md`` ("The seam") counts the bytes.
"""

import torch
import triton
import triton.language as tl

from mhc.kernels._tiles import next_pow2
from mhc.kernels.mhc_coefficients import (
    _columns, _dot_fp32, _split_bf16, coefficient_grad, coefficients_epilogue, dx_precision, per_token_outputs,
    pre_mix_pass, sinkhorn_epilogue, token_splits,
)

# the streams of a chunk are unrolled and all live in the backward: beyond 4 the kernels spill
# (offline compiles for sm_90 with Triton 3.6: 3-7 KB of stack at n = 8)
MAX_SEAM_STREAMS = 4


@triton.jit
def _token_scalars(ptr, o_t, t_ok, COUNT: tl.constexpr):
    """``COUNT`` per-token fp32 values of a ``[T, COUNT]`` tensor, as a tuple of ``[BLOCK_T]``."""
    out = ()
    for k in tl.static_range(COUNT):
        out = out + (tl.load(ptr + o_t * COUNT + k, mask=t_ok, other=0.0),)
    return out


@triton.jit(do_not_specialize=["T", "eps", "hc_eps"])
def seam_fwd_kernel(
    # site l: streams x [T, N, D], branch output y [T, D], fp32 h_post [T, N], h_res [T, N, N]
    x_ptr, y_ptr, h_post_l_ptr, h_res_l_ptr,
    # site l+1: phi [N * D, M] fp32, gates (3 scalars), biases
    phi_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
    # outputs: the new streams x_next [T, N, D], then those of coefficients_fwd_kernel
    x_next_ptr, x_in_ptr, p_ptr, r_ptr, h_pre_ptr, h_post_ptr, z_res_ptr, h_res_ptr,
    T, D, eps, hc_eps,
    N: tl.constexpr, NP: tl.constexpr, NPP: tl.constexpr, NRES: tl.constexpr, ITERS: tl.constexpr,
    HAS_EPS: tl.constexpr, SPLIT_BF16: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    o_pp = tl.arange(0, NPP)
    o_res = tl.arange(0, NRES)
    m_pp = (o_pp < 2 * N)[None, :]
    m_res = (o_res < N * N)[None, :]
    w = _token_scalars(h_res_l_ptr, o_t, t_ok, N * N)
    b = _token_scalars(h_post_l_ptr, o_t, t_ok, N)

    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = o_d < D
        m = t_ok[:, None] & d_ok[None, :]
        xs = ()
        for j in tl.static_range(N):
            b_x = tl.load(x_ptr + o_t[:, None] * (N * D) + j * D + o_d[None, :], mask=m, other=0.0)
            xs = xs + (b_x.to(tl.float32),)
        y = tl.load(y_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        for i in tl.static_range(N):
            # the post-mix's order of operations (stream_mix_fwd_kernel): the same bits
            acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(N):
                acc += w[i * N + j][:, None] * xs[j]
            acc += b[i][:, None] * y
            out = acc.to(x_next_ptr.dtype.element_ty)
            tl.store(x_next_ptr + o_t[:, None] * (N * D) + i * D + o_d[None, :], out, mask=m)
            out_f = out.to(tl.float32)
            sum_sq += tl.sum(out_f * out_f, axis=1)
            p_phi = phi_ptr + (i * D + o_d)[:, None] * M
            b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=d_ok[:, None] & m_pp, other=0.0)
            b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=d_ok[:, None] & m_res, other=0.0)
            acc_pp += _dot_fp32(out, b_phi_pp, SPLIT_BF16)
            acc_res += _dot_fp32(out, b_phi_res, SPLIT_BF16)

    h_pp = coefficients_epilogue(
        acc_pp, acc_res, sum_sq, o_t, t_ok, N * D, eps, hc_eps, a_pre_ptr, a_post_ptr, a_res_ptr,
        b_pre_ptr, b_post_ptr, b_res_ptr, p_ptr, r_ptr, h_pre_ptr, h_post_ptr, z_res_ptr, N, NPP, NRES,
    )
    pre_mix_pass(x_next_ptr, x_in_ptr, h_pp, hc_eps, o_t, t_ok, D, N, NPP, BLOCK_T, BLOCK_D)
    sinkhorn_epilogue(z_res_ptr, h_res_ptr, i_t, T, hc_eps, ITERS, HAS_EPS, N, NP, BLOCK_T)


@triton.jit(do_not_specialize=["T", "SPLITS"])
def seam_bwd_kernel(
    # site l+1: streams x_next [T, N, D], phi [N * D, M], g [T, M], c [T] (coefficient_grad_kernel),
    # h_pre [T, N], dx_in [T, D] (its branch input's gradient), dx_acc [T, N, D] (added to dx_next)
    x_next_ptr, phi_ptr, g_ptr, c_ptr, h_pre_ptr, dx_in_ptr, dx_acc_ptr,
    # site l: streams x [T, N, D], branch output y [T, D], fp32 h_post [T, N], h_res [T, N, N]
    x_ptr, y_ptr, h_post_l_ptr, h_res_l_ptr,
    # outputs: dx [T, N, D] = h_res^T dx_next, dy [T, D], dphi_partial [SPLITS, N * D, M], and per
    # channel chunk fp32 partials dh_res [CHUNKS, T, N * N], dh_post [CHUNKS, T, N]
    dx_ptr, dy_ptr, dphi_ptr, dh_res_ptr, dh_post_ptr,
    T, D, SPLITS,
    N: tl.constexpr, MP: tl.constexpr, ACCUMULATE: tl.constexpr, SPLIT_BF16: tl.constexpr,
    DX_PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    # program: channels o_c of every stream, every SPLITS-th token block; the M columns of phi
    # and g as one tile MP wide (n <= 4: M <= 24, one tile of 32 rather than two of 16)
    i_c = tl.program_id(0)
    i_s = tl.program_id(1)
    o_c = i_c * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = o_c < D
    o_m = tl.arange(0, MP)
    m_m = (o_m < M)[None, :]

    dphi = ()
    for i in tl.static_range(N):
        dphi = dphi + (tl.zeros([BLOCK_D, MP], dtype=tl.float32),)
    o_tl = tl.arange(0, BLOCK_T)  # int32 offsets inside a token block, from its base pointers
    t0 = i_s.to(tl.int64) * BLOCK_T  # the block's first token
    for _ in range(i_s, tl.cdiv(T, BLOCK_T), SPLITS):
        t_ok = t0 + o_tl < T
        m = t_ok[:, None] & c_ok[None, :]
        o_s = o_tl[:, None] * (N * D) + o_c[None, :]  # stream 0's tile in a [T, N, D] tensor
        o_b = o_tl[:, None] * D + o_c[None, :]  # the tile in a [T, D] tensor
        b_g = tl.load(g_ptr + t0 * M + o_tl[:, None] * M + o_m[None, :], mask=t_ok[:, None] & m_m, other=0.0)
        c = tl.load(c_ptr + t0 + o_tl, mask=t_ok, other=0.0)
        b_dx_in = tl.load(dx_in_ptr + t0 * D + o_b, mask=m, other=0.0).to(tl.float32)

        # site l+1's projection backward, stream by stream (projection_bwd_kernel's terms)
        x_next_blk = x_next_ptr + t0 * (N * D)
        dx_acc_blk = dx_acc_ptr + t0 * (N * D)
        dx_next = ()
        dphi_new = ()
        for i in tl.static_range(N):
            phi_t = tl.trans(tl.load(phi_ptr + (i * D + o_c)[:, None] * M + o_m[None, :], mask=c_ok[:, None] & m_m,
                                     other=0.0))
            b_x = tl.load(x_next_blk + i * D + o_s, mask=m, other=0.0)
            h_pre = tl.load(h_pre_ptr + t0 * N + o_tl * N + i, mask=t_ok, other=0.0)
            rest = h_pre[:, None] * b_dx_in - c[:, None] * b_x.to(tl.float32)
            if ACCUMULATE:
                rest += tl.load(dx_acc_blk + i * D + o_s, mask=m, other=0.0).to(tl.float32)
            dx_i = tl.dot(b_g, phi_t, input_precision=DX_PRECISION) + rest
            # kept rounded to the stream dtype, as the unchained path stores it before the
            # post-mix backward reads it
            dx_next = dx_next + (dx_i.to(x_next_ptr.dtype.element_ty),)
            dphi_new = dphi_new + (dphi[i] + _dot_fp32(tl.trans(b_x), b_g, SPLIT_BF16),)
        dphi = dphi_new

        # site l's post-mix backward on the same tile (stream_mix_bwd_kernel's order)
        y = tl.load(y_ptr + t0 * D + o_b, mask=m, other=0.0).to(tl.float32)
        red = dh_post_ptr + (i_c * T + t0) * N + o_tl * N
        dy = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for i in tl.static_range(N):
            b_i = tl.load(h_post_l_ptr + t0 * N + o_tl * N + i, mask=t_ok, other=0.0)
            dx_i = dx_next[i].to(tl.float32)
            dy += b_i[:, None] * dx_i
            tl.store(red + i, tl.sum(dx_i * y, axis=1), mask=t_ok)
        tl.store(dy_ptr + t0 * D + o_b, dy.to(dy_ptr.dtype.element_ty), mask=m)
        x_blk = x_ptr + t0 * (N * D)
        dx_blk = dx_ptr + t0 * (N * D)
        red = dh_res_ptr + (i_c * T + t0) * (N * N) + o_tl * (N * N)
        w_blk = h_res_l_ptr + t0 * (N * N) + o_tl * (N * N)
        for j in tl.static_range(N):
            x_j = tl.load(x_blk + j * D + o_s, mask=m, other=0.0).to(tl.float32)
            dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for i in tl.static_range(N):
                dx_i = dx_next[i].to(tl.float32)
                w_ij = tl.load(w_blk + i * N + j, mask=t_ok, other=0.0)
                dx += w_ij[:, None] * dx_i
                tl.store(red + i * N + j, tl.sum(dx_i * x_j, axis=1), mask=t_ok)
            tl.store(dx_blk + j * D + o_s, dx.to(dx_ptr.dtype.element_ty), mask=m)
        t0 += SPLITS * BLOCK_T

    for i in tl.static_range(N):
        p_out = dphi_ptr + i_s.to(tl.int64) * (N * D) * M + (i * D + o_c)[:, None] * M + o_m[None, :]
        tl.store(p_out, dphi[i], mask=c_ok[:, None] & m_m)


# ------------------------------------------------------------------------------ launchers


def seam_fwd_config(n: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps, num_stages)``; registers from offline compiles for sm_90
    (Triton 3.6): n = 1 168, n = 2 195, n = 3 220, n = 4 255 with 8 bytes of stack."""
    if n <= 1:
        return 64, 64, 4, 2
    if n <= 2:
        return 64, 32, 4, 2
    return 64, 16, 4, 2


def seam_bwd_config(n: int, d: int) -> tuple[int, int, int, int, int, int | None]:
    """``(BLOCK_T, BLOCK_D, num_warps, num_stages, waves, maxnreg)``: all ``n`` streams of a
    ``BLOCK_T x BLOCK_D`` tile are live; 8 warps keep n = 4 at 255 registers with 48 bytes of stack."""
    if n <= 2:
        return 32, 128, 8, 2, 4, None
    return 32, 64, 8, 2, 4, None


def seam_fwd(x, y, h_post_l, h_res_l, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, iters: int, eps: float,
             hc_eps: float = 0.0):
    """Site ``l``'s post-mix and site ``l+1``'s coefficients and pre-mix in one pass.

    ``x [T, N, D]`` and ``y [T, D]`` are site ``l``'s streams and branch output, ``h_post_l [T, N]``
    and ``h_res_l [T, N, N]`` its fp32 coefficients (token stride 0 allowed); the rest are site
    ``l+1``'s parameters as in :func:`~mhc.kernels.coefficients_fwd`. Returns ``(x_next [T, N, D],
    x_in, p, r, h_pre, h_post, z_res, h_res)``: the new streams, then :func:`coefficients_fwd`'s
    outputs for them.
    """
    T, n, d = x.shape
    K, M = n * d, 2 * n + n * n
    assert phi.shape == (K, M) and 1 <= n <= MAX_SEAM_STREAMS and iters >= 1 and y.shape == (T, d)
    x, y = x.contiguous(), y.contiguous()
    x_next = torch.empty_like(x)
    x_in = torch.empty((T, d), dtype=x.dtype, device=x.device)
    p, r, h_pre, h_post, z_res, h_res = per_token_outputs(T, n, x.device)
    if T:
        block_t, block_d, num_warps, num_stages = seam_fwd_config(n)
        seam_fwd_kernel[(triton.cdiv(T, block_t),)](
            x, y, h_post_l.contiguous(), h_res_l.contiguous(),
            phi.contiguous(), a_pre, a_post, a_res, b_pre.contiguous(), b_post.contiguous(), b_res.contiguous(),
            x_next, x_in, p, r, h_pre, h_post, z_res, h_res,
            T, d, eps, hc_eps,
            NP=next_pow2(n), ITERS=iters, HAS_EPS=hc_eps > 0, SPLIT_BF16=_split_bf16(x), BLOCK_T=block_t,
            BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages, **_columns(n),
        )
    return x_next, x_in, p, r, h_pre, h_post, z_res, h_res


def seam_bwd(
    x_next, phi, a_pre, a_post, a_res, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, grad_x_acc,
    x, y, h_post_l, h_res_l, hc_eps: float = 0.0,
):
    """Backward of :func:`seam_fwd`.

    Site ``l+1``'s saved values and incoming gradients are those of
    :func:`~mhc.kernels.coefficients_bwd` (``grad_x_acc``: the gradient of ``x_next`` from later
    sites, or ``None``); ``x, y, h_post_l, h_res_l`` are site ``l``'s post-mix inputs. Returns
    ``(dx [T, N, D], dy [T, D], dh_post_l [T, N], dh_res_l [T, N, N], dphi [K, M], dbias_gate [M + 3])``;
    ``dx`` is the post-mix's part of site ``l``'s stream gradient.
    """
    T, n, d = x_next.shape
    K, M = n * d, 2 * n + n * n
    f32 = dict(dtype=torch.float32, device=x.device)
    x_next, x, y = x_next.contiguous(), x.contiguous(), y.contiguous()
    if T == 0:
        return (torch.zeros_like(x), torch.zeros_like(y), torch.zeros((0, n), **f32), torch.zeros((0, n, n), **f32),
                torch.zeros((K, M), **f32), torch.zeros((M + 3,), **f32))
    grad_x_in = grad_x_in.contiguous()
    g, c, partial_bias = coefficient_grad(
        x_next, a_pre, a_post, a_res, p, r, h_pre, h_post, dh_pre, dh_post, dz_res, grad_x_in, hc_eps
    )
    block_t, block_d, num_warps, num_stages, waves, maxnreg = seam_bwd_config(n, d)
    chunks = triton.cdiv(d, block_d)
    splits = token_splits(T, block_t, waves, chunks, x.device)
    dx, dy = torch.empty_like(x), torch.empty_like(y)
    partial_phi = torch.empty((splits, K, M), **f32)
    partial_res, partial_post = torch.empty((chunks, T, n * n), **f32), torch.empty((chunks, T, n), **f32)
    accumulate = grad_x_acc is not None
    seam_bwd_kernel[(chunks, splits)](
        x_next, phi.contiguous(), g, c, h_pre, grad_x_in, grad_x_acc.contiguous() if accumulate else x_next,
        x, y, h_post_l.contiguous(), h_res_l.contiguous(),
        dx, dy, partial_phi, partial_res, partial_post,
        T, d, splits,
        N=n, MP=max(16, next_pow2(M)), ACCUMULATE=accumulate, SPLIT_BF16=_split_bf16(x_next),
        DX_PRECISION=dx_precision(x_next, n), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
        num_stages=num_stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    return (dx, dy, partial_post.sum(0), partial_res.sum(0).view(T, n, n), partial_phi.sum(0),
            partial_bias.sum(0))
