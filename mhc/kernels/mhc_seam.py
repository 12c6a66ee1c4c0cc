"""The seam forward: site ``l``'s post-mix and site ``l+1``'s mHC coefficient forward, the streams
between them written once and read once.

    x'[t, i] = sum_j h_res[t, i, j] x[t, j] + h_post[t, i] y[t]      (site l's new streams)

``post_mix_partial_kernel`` runs over (tile of tokens, range of channels). It forms the ``N`` new
stream tiles of its channels, stores them in the streams' dtype, and projects the stored values
(the values site ``l+1`` reads) onto ``phi``: the partial projections and sums of squares over its
range of ``K = N * D``, in the layout of ``projection_partial_kernel``. Then
``coefficients_finish_kernel`` adds the partials in a fixed order and runs site ``l+1``'s epilogue,
pre-mix (reading ``x'`` once more) and Sinkhorn, as in the coefficient forward split over ``K``.

Per token at n = 4, bf16 (``X = 8d`` bytes of streams, ``Y = 2d`` of a branch tensor): read ``x``
and ``y``, write ``x'`` (``18d``), read ``x'`` and write ``x_in`` (``10d``): ``28d``, against the
``36d`` of the post-mix followed by the coefficient forward (which reads ``x'`` twice).

Measured on an H100 at n = 4 (``python scripts/tune_mixing.py seam``,
docs/benchmarks/mixing_seam_split_h100.log): at best within 1% of the composition at 16k tokens
(d = 1024 0.238 against 0.241 ms, d = 4096 0.890 against 0.902 ms), 6% faster at d = 4096 with 8k
tokens, 14% slower at d = 1024 with 8k. The layer does not use it.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from mhc.kernels._launch import launch
from mhc.kernels._tiles import cdiv, next_pow2
from mhc.kernels.mhc_coefficients import (
    _columns, _dot_fp32, _split_bf16, coefficients_finish, coefficients_fwd, k_splits, partial_width, store_partial,
)
from mhc.kernels.stream_mix import _per_token, stream_mix_fwd


@triton.jit(do_not_specialize=["T", "stride_w", "stride_b"])
def post_mix_partial_kernel(
    # inputs: streams x [T, N, D], branch output y [T, D], fp32 h_res [T, N, N] and h_post [T, N]
    # (token strides stride_w / stride_b, 0: one set for every token), phi [N * D, M] (any float dtype)
    x_ptr, y_ptr, h_res_ptr, h_post_ptr, phi_ptr,
    # outputs: the new streams out [T, N, D] (x's dtype) and partial [splits, T, NPP + NRES + 1] fp32
    out_ptr, partial_ptr,
    T, D, d_split, stride_w, stride_b,
    N: tl.constexpr, NPP: tl.constexpr, NRES: tl.constexpr, SPLIT_BF16: tl.constexpr, HOIST_W: tl.constexpr,
    ONE_TILE: tl.constexpr, NC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    M: tl.constexpr = 2 * N + N * N
    i_s = tl.program_id(1)
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = o_t < T
    o_pp = tl.arange(0, NPP)
    o_res = tl.arange(0, NRES)
    m_pp, m_res = (o_pp < 2 * N)[None, :], (o_res < N * N)[None, :]
    # the coefficients of the program's tokens, read once for all its channels
    if HOIST_W:
        w = ()
        for ij in tl.static_range(N * N):
            w = w + (tl.load(h_res_ptr + o_t * stride_w + ij, mask=t_ok, other=0.0),)
        b = ()
        for i in tl.static_range(N):
            b = b + (tl.load(h_post_ptr + o_t * stride_b + i, mask=t_ok, other=0.0),)
    acc_pp = tl.zeros([BLOCK_T, NPP], dtype=tl.float32)
    acc_res = tl.zeros([BLOCK_T, NRES], dtype=tl.float32)
    o_c = tl.arange(0, NC)
    m_c = (o_c < M)[None, :]
    acc_c = tl.zeros([BLOCK_T, NC], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    d_begin = i_s * d_split
    d_end = tl.minimum(d_begin + d_split, D)
    for d0 in range(d_begin, d_end, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = o_d < d_end
        m = t_ok[:, None] & d_ok[None, :]
        xs = ()
        for j in tl.static_range(N):
            xs = xs + (tl.load(x_ptr + o_t[:, None] * (N * D) + j * D + o_d[None, :], mask=m, other=0.0),)
        y = tl.load(y_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0)
        for i in tl.static_range(N):
            acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(N):  # in the post-mix kernel's order: the same rounding
                if HOIST_W:
                    w_ij = w[i * N + j]
                else:
                    w_ij = tl.load(h_res_ptr + o_t * stride_w + (i * N + j), mask=t_ok, other=0.0)
                acc += w_ij[:, None] * xs[j].to(tl.float32)
            if HOIST_W:
                b_i = b[i]
            else:
                b_i = tl.load(h_post_ptr + o_t * stride_b + i, mask=t_ok, other=0.0)
            acc += b_i[:, None] * y.to(tl.float32)
            x_new = acc.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_t[:, None] * (N * D) + i * D + o_d[None, :], x_new, mask=m)
            x_newf = x_new.to(tl.float32)
            sum_sq += tl.sum(x_newf * x_newf, axis=1)
            p_phi = phi_ptr + (i * D + o_d)[:, None] * M
            if ONE_TILE:
                phi_c = tl.load(p_phi + o_c[None, :], mask=d_ok[:, None] & m_c, other=0.0).to(tl.float32)
                acc_c += _dot_fp32(x_new, phi_c, SPLIT_BF16)
            else:
                phi_pp = tl.load(p_phi + o_pp[None, :], mask=d_ok[:, None] & m_pp, other=0.0).to(tl.float32)
                phi_res = tl.load(p_phi + 2 * N + o_res[None, :], mask=d_ok[:, None] & m_res,
                                  other=0.0).to(tl.float32)
                acc_pp += _dot_fp32(x_new, phi_pp, SPLIT_BF16)
                acc_res += _dot_fp32(x_new, phi_res, SPLIT_BF16)
    if ONE_TILE:  # columns [pre | post] to the partial row's [pre | post] tile, res to its res tile
        row = partial_ptr + (o_t + i_s * T) * (NPP + NRES + 1)
        col = tl.where(o_c < 2 * N, o_c, o_c + NPP - 2 * N)
        tl.store(row[:, None] + col[None, :], acc_c, mask=t_ok[:, None] & m_c)
        tl.store(row + NPP + NRES, sum_sq, mask=t_ok)
    else:
        store_partial(partial_ptr, i_s, o_t, t_ok, T, acc_pp, acc_res, sum_sq, NPP, NRES)


# ------------------------------------------------------------------------------ launchers


def seam_config(n: int, d: int) -> tuple | None:
    """``(BLOCK_T, BLOCK_D, num_warps, num_stages, waves, HOIST_W, ONE_TILE)`` of
    ``post_mix_partial_kernel`` (about ``waves`` programs per SM; ``HOIST_W``: the coefficients
    read once per program; ``ONE_TILE``: the ``M`` columns of ``phi`` as one tile where it is no
    wider than the two), or ``None``: the post-mix followed by the coefficient forward. The best
    of the H100 sweep at n = 4 (docs/benchmarks/mixing_seam_split_h100.log); n > 4 not measured."""
    if n > 4:
        return None
    return 64, 32, 4, 4, 4, True, True


@functools.cache
def _seam_meta(n: int, d: int, split_bf16: bool):
    config = seam_config(n, d)
    if config is None:
        return None
    block_t, block_d, num_warps, num_stages, waves, *hoist = config
    cols, nc = _columns(n), max(16, next_pow2(2 * n + n * n))
    one_tile = len(hoist) > 1 and hoist[1] and nc <= cols["NPP"] + cols["NRES"]
    meta = dict(**cols, SPLIT_BF16=split_bf16, HOIST_W=bool(hoist and hoist[0]), ONE_TILE=one_tile, NC=nc,
                BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps,
                num_stages=num_stages)
    return block_t, block_d, waves, meta, ("post_mix_partial", n, d, split_bf16)


def seam_fwd(x, y, h_post, h_res, phi, alpha, bias, iters: int, eps: float, hc_eps: float = 0.0):
    """Site ``l``'s post-mix of streams ``x [..., N, D]`` with its branch output ``y [..., D]`` and
    fp32 coefficients ``h_post [T, N]``, ``h_res [T, N, N]`` (token stride 0 allowed), followed by
    site ``l+1``'s coefficient forward with ``(phi, alpha, bias)``.

    Returns ``(x_next [..., N, D], x_in, p, r, h_pre, h_post, z_res, h_res)``: the new streams in
    ``x``'s dtype, then :func:`mhc.kernels.mhc_coefficients.coefficients_fwd`'s outputs for them.
    """
    *lead, n, d = x.shape
    T = math.prod(lead)
    meta = _seam_meta(n, d, _split_bf16(x)) if T > 0 else None
    if meta is None:
        x_next = stream_mix_fwd(x, h_res, y, h_post)
        return (x_next, *coefficients_fwd(x_next, phi, alpha, bias, iters, eps, hc_eps))
    assert h_res.shape == (T, n, n) or h_res.shape == (1, n, n)
    assert y.numel() == T * d and phi.shape == (n * d, 2 * n + n * n)
    block_t, block_d, waves, meta, key = meta
    x, y = x.contiguous(), y.contiguous()
    h_res, stride_w = _per_token(h_res, n * n)
    h_post, stride_b = _per_token(h_post, n)
    x_next = torch.empty_like(x)
    splits, d_split = k_splits(T, d, block_t, block_d, waves, x.device)
    partial = torch.empty((splits, T, partial_width(n)), dtype=torch.float32, device=x.device)
    launch(post_mix_partial_kernel, (cdiv(T, block_t), splits),
           (x, y, h_res, h_post, phi.contiguous(), x_next, partial, T, d, d_split, stride_w, stride_b), meta, key)
    return (x_next, *coefficients_finish(x_next, partial, alpha, bias, iters, eps, hc_eps))
