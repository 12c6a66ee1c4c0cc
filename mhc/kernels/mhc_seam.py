"""The seam between two consecutive mHC sites, forward: site ``l``'s post-mix and site ``l+1``'s
coefficients in one pass over the streams.

Site ``l`` ends with ``x'[i] = sum_j h_res[i, j] x[j] + h_post[i] y`` (its post-mix and residual
merge); site ``l+1`` starts by projecting exactly those streams (``mhc_coefficients.py``). Run
apart, ``x'`` is written by one kernel and read back by the next.

``seam_fwd_kernel``: a program owns ``BLOCK_T`` tokens and walks the channels in ``BLOCK_D``
chunks. Per chunk it loads the ``N`` streams of ``x`` and ``y``, forms the ``N`` new stream tiles,
stores them, and feeds them (rounded to the stream dtype, as the unchained kernels would read them
back), side by side as one ``[BLOCK_T, N * BLOCK_D]`` operand, to site ``l+1``'s projection and
sum of squares. The epilogue is the coefficient kernel's: gates, biases, the pre-mix pass over
``x'`` and the Sinkhorn core.

The backward of a seam runs the unchained kernels (``coefficients_bwd`` then ``stream_mix_bwd``):
a fused backward that keeps ``dx'`` on chip needs every stream's tile live at once and ran at
half their speed on the H100 (``docs/mixing.md``, "The seam").
"""

import functools

import torch
import triton
import triton.language as tl

from mhc.kernels._launch import launch
from mhc.kernels._tiles import next_pow2
from mhc.kernels.mhc_coefficients import (
    _columns, _dot_fp32, _split_bf16, coefficients_epilogue, per_token_outputs, pre_mix_pass, sinkhorn_epilogue,
)

# the streams of a chunk are unrolled and side by side in one operand of up to 4 tiles
MAX_SEAM_STREAMS = 4


@triton.jit
def _token_scalars(ptr, o_t, t_ok, COUNT: tl.constexpr):
    """``COUNT`` per-token fp32 values of a ``[T, COUNT]`` tensor, as a tuple of ``[BLOCK_T]``."""
    out = ()
    for k in tl.static_range(COUNT):
        out = out + (tl.load(ptr + o_t * COUNT + k, mask=t_ok, other=0.0),)
    return out


@triton.jit
def _streams_side_by_side(tiles, NP: tl.constexpr):
    """``NP`` tiles ``[BLOCK_T, BLOCK_D]`` (a power of two up to 4) as one ``[BLOCK_T, NP * BLOCK_D]``,
    stream-major: one operand for the projection's product instead of one product per stream."""
    if NP == 1:
        out = tiles[0]
    elif NP == 2:
        both = tl.join(tiles[0], tiles[1])  # [BLOCK_T, BLOCK_D, 2]
        out = tl.reshape(tl.permute(both, (0, 2, 1)), (both.shape[0], 2 * both.shape[1]))
    else:
        # [BLOCK_T, BLOCK_D, a, b] holds stream 2 b + a
        four = tl.join(tl.join(tiles[0], tiles[1]), tl.join(tiles[2], tiles[3]))
        out = tl.reshape(tl.permute(four, (0, 3, 2, 1)), (four.shape[0], 4 * four.shape[1]))
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
    t0 = i_t.to(tl.int64) * BLOCK_T
    o_tl = tl.arange(0, BLOCK_T)
    o_t = t0 + o_tl
    t_ok = o_t < T
    o_pp = tl.arange(0, NPP)
    o_res = tl.arange(0, NRES)
    m_pp = (o_pp < 2 * N)[None, :]
    m_res = (o_res < N * N)[None, :]
    # the projection's rows of a chunk, stream-major: [NP * BLOCK_D]
    o_sd = tl.reshape(tl.arange(0, NP)[:, None] * D + tl.arange(0, BLOCK_D)[None, :], (NP * BLOCK_D,))
    o_dl = tl.reshape(0 * tl.arange(0, NP)[:, None] + tl.arange(0, BLOCK_D)[None, :], (NP * BLOCK_D,))
    s_ok = tl.reshape((tl.arange(0, NP) < N)[:, None] & (tl.arange(0, BLOCK_D) >= 0)[None, :], (NP * BLOCK_D,))
    w = _token_scalars(h_res_l_ptr, o_t, t_ok, N * N)
    b = _token_scalars(h_post_l_ptr, o_t, t_ok, N)
    x_blk = x_ptr + t0 * (N * D)
    x_next_blk = x_next_ptr + t0 * (N * D)
    o_s = o_tl[:, None] * (N * D)

    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = o_d < D
        m = t_ok[:, None] & d_ok[None, :]
        xs = ()
        for j in tl.static_range(N):
            xs = xs + (tl.load(x_blk + o_s + j * D + o_d[None, :], mask=m, other=0.0).to(tl.float32),)
        y = tl.load(y_ptr + t0 * D + o_tl[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        outs = ()
        for i in tl.static_range(NP):
            if i < N:
                # the post-mix's order of operations (stream_mix_fwd_kernel): the same bits
                acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(N):
                    acc += w[i * N + j][:, None] * xs[j]
                acc += b[i][:, None] * y
                out = acc.to(x_next_ptr.dtype.element_ty)
                tl.store(x_next_blk + o_s + i * D + o_d[None, :], out, mask=m)
                out_f = out.to(tl.float32)
                sum_sq += tl.sum(out_f * out_f, axis=1)
                outs = outs + (out,)
            else:
                outs = outs + (tl.zeros([BLOCK_T, BLOCK_D], dtype=x_next_ptr.dtype.element_ty),)
        b_out = _streams_side_by_side(outs, NP)
        k_ok = s_ok & (d0 + o_dl < D)
        p_phi = phi_ptr + (o_sd + d0)[:, None] * M
        b_phi_pp = tl.load(p_phi + o_pp[None, :], mask=k_ok[:, None] & m_pp, other=0.0)
        b_phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=k_ok[:, None] & m_res, other=0.0)
        acc_pp += _dot_fp32(b_out, b_phi_pp, SPLIT_BF16)
        acc_res += _dot_fp32(b_out, b_phi_res, SPLIT_BF16)

    h_pp = coefficients_epilogue(
        acc_pp, acc_res, sum_sq, o_t, t_ok, N * D, eps, hc_eps, a_pre_ptr, a_post_ptr, a_res_ptr,
        b_pre_ptr, b_post_ptr, b_res_ptr, p_ptr, r_ptr, h_pre_ptr, h_post_ptr, z_res_ptr, N, NPP, NRES,
    )
    pre_mix_pass(x_next_ptr, x_in_ptr, h_pp, hc_eps, o_t, t_ok, D, N, NPP, BLOCK_T, BLOCK_D * NP)
    sinkhorn_epilogue(z_res_ptr, h_res_ptr, i_t, T, hc_eps, ITERS, HAS_EPS, N, NP, BLOCK_T)


# ------------------------------------------------------------------------------ launchers


def seam_fwd_config(n: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps, num_stages)``. H100, bf16, 16k tokens, n = 4
    (``docs/benchmarks/mixing_seam_h100.log``): (64, 32, 4, 2) 0.246 ms at d = 1024 and 0.958 ms
    at d = 4096, the best of six tiles, against 0.242 / 0.938 ms for the post-mix and coefficient
    kernels run apart."""
    if n <= 1:
        return 64, 64, 4, 2
    return 64, 32, 4, 2


@functools.cache
def _fwd_meta(n: int, iters: int, has_eps: bool, split_bf16: bool):
    block_t, block_d, num_warps, num_stages = seam_fwd_config(n)
    meta = dict(**_columns(n), NP=next_pow2(n), ITERS=iters, HAS_EPS=has_eps, SPLIT_BF16=split_bf16,
                BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages)
    return block_t, meta, ("seam_fwd", n, iters, has_eps, split_bf16)


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
        block_t, meta, key = _fwd_meta(n, iters, hc_eps > 0, _split_bf16(x))
        args = (x, y, h_post_l.contiguous(), h_res_l.contiguous(), phi.contiguous(), a_pre, a_post, a_res,
                b_pre.contiguous(), b_post.contiguous(), b_res.contiguous(), x_next, x_in, p, r, h_pre, h_post,
                z_res, h_res, T, d, eps, hc_eps)
        launch(seam_fwd_kernel, (triton.cdiv(T, block_t),), args, meta, key)
    return x_next, x_in, p, r, h_pre, h_post, z_res, h_res
