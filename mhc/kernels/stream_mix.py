"""Stream mixing kernels: ``out[t, i] = sum_j w[t, i, j] x[t, j] + b[t, i] y[t]``, and its backward.

One kernel pair serves every mix: the pre-mix (``N_OUT = 1``, ``w = h_pre``, no ``y``), the post-mix
(``w = h_res``, ``b = h_post``) and a lane mixer (no ``y``). Streams ``x [T, N, D]`` in the
activation dtype, ``y [T, D]``, fp32 coefficients whose token stride may be 0 (one set for every
token); fp32 arithmetic, each tile read and written once. Up to ``N = 8`` each stream is its own
tile and each coefficient an unrolled product; beyond, one ``[BLOCK_T, NP, BLOCK_D]`` tile and
batched ``tl.dot``, so code size does not grow with ``N * N_OUT``. The backward writes
``dx = w^T dout (+ dx_acc)``, ``dy`` and per-token ``dw``, ``db`` reduced over ``D`` in the program; where
tokens are few ``D`` is split into ranges whose partials one more launch adds in a fixed order.
"""

import math

import torch
import triton
import triton.language as tl

from mhc.kernels._checks import F32, check_streams, check_tensor
from mhc.kernels._launch import LaunchPlan, launch, launch_plan, per_size, per_tile, sm_count, static
from mhc.kernels._tiles import cdiv, next_pow2

MAX_STREAMS = 16  # streams are unrolled per program: code size grows with N * N_OUT


@triton.jit
def _token_tile(i_t, i_d, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    return o_t, o_d, (o_t < T)[:, None] & (o_d < D)[None, :]


@triton.jit
def _load_streams(x_ptr, o_t, o_d, m, D, N: tl.constexpr):
    """The ``N`` stream tiles ``[BLOCK_T, BLOCK_D]`` of ``x [T, N, D]``, in fp32."""
    xs = ()
    for j in tl.static_range(N):
        p_x = x_ptr + o_t[:, None] * (N * D) + j * D + o_d[None, :]
        xs = xs + (tl.load(p_x, mask=m, other=0.0).to(tl.float32),)
    return xs


@triton.jit
def _load_streams_3d(x_ptr, o_t, o_d, m, D, N: tl.constexpr, NP: tl.constexpr):
    """The streams as one tile ``[BLOCK_T, NP, BLOCK_D]`` in fp32 (padded streams read as 0), and
    the stream offsets ``[NP]``: code size independent of ``N``, for wide mixes."""
    o_j = tl.arange(0, NP)
    p_x = x_ptr + o_t[:, None, None] * (N * D) + o_j[None, :, None] * D + o_d[None, None, :]
    m3 = m[:, None, :] & (o_j < N)[None, :, None]
    return tl.load(p_x, mask=m3, other=0.0).to(tl.float32), o_j


# sizes that set alignment (D) stay specialised: Triton then knows rows are 16-byte aligned
@triton.jit(do_not_specialize=["T", "stride_w", "stride_b"])
def stream_mix_fwd_kernel(
    # pointers: x [T, N, D], y [T, D], w [T, N_OUT, N], b [T, N_OUT], out [T, N_OUT, D]
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    # sizes and the coefficients' token strides (0: one set for all tokens)
    T,
    D,
    stride_w,
    stride_b,
    N: tl.constexpr,
    N_OUT: tl.constexpr,
    HAS_Y: tl.constexpr,
    UNROLL: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    o_t, o_d, m = _token_tile(tl.program_id(0), tl.program_id(1), T, D, BLOCK_T, BLOCK_D)
    t_ok = o_t < T
    if UNROLL:
        xs = _load_streams(x_ptr, o_t, o_d, m, D, N)
    else:
        x3, o_j = _load_streams_3d(x_ptr, o_t, o_d, m, D, N, NP)
    if HAS_Y:
        y = tl.load(y_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    for i in tl.static_range(N_OUT):
        if UNROLL:
            acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(N):
                w_ij = tl.load(w_ptr + o_t * stride_w + (i * N + j), mask=t_ok, other=0.0)
                acc += w_ij[:, None] * xs[j]
        else:
            p_w = w_ptr + o_t[:, None] * stride_w + i * N + o_j[None, :]
            w_i = tl.load(p_w, mask=t_ok[:, None] & (o_j < N)[None, :], other=0.0)
            acc = tl.sum(w_i[:, :, None] * x3, axis=1)
        if HAS_Y:
            b_i = tl.load(b_ptr + o_t * stride_b + i, mask=t_ok, other=0.0)
            acc += b_i[:, None] * y
        p_out = out_ptr + o_t[:, None] * (N_OUT * D) + i * D + o_d[None, :]
        tl.store(p_out, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T", "stride_w", "stride_b", "split_chunks"])
def stream_mix_bwd_kernel(
    # pointers: the forward's inputs, dout [T, N_OUT, D], dx_acc [T, N, D] (added to dx),
    # outputs dx [T, N, D], dy [T, D], dw [RANGES, T, N_OUT, N] and db [RANGES, T, N_OUT] (fp32,
    # contiguous; a partial sum per range of D, RANGES = grid[1])
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    dout_ptr,
    dx_acc_ptr,
    dx_ptr,
    dy_ptr,
    dw_ptr,
    db_ptr,
    T,
    D,
    stride_w,
    stride_b,
    split_chunks,
    N: tl.constexpr,
    N_OUT: tl.constexpr,
    HAS_Y: tl.constexpr,
    UNROLL: tl.constexpr,
    NP: tl.constexpr,
    WRITE_DX: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # program: a tile of BLOCK_T tokens over range program_id(1) of D, split_chunks chunks of
    # BLOCK_D channels (one range: all of D)
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    first = i_s * split_chunks
    last = tl.minimum(first + split_chunks, tl.cdiv(D, BLOCK_D))
    dw_ptr += i_s.to(tl.int64) * T * (N_OUT * N)
    db_ptr += i_s.to(tl.int64) * T * N_OUT
    t_ok = o_t < T
    if UNROLL:
        # one tile per stream; one [BLOCK_T] accumulator per coefficient (n <= 8)
        dw = ()
        for k in tl.static_range(N_OUT * N):
            dw = dw + (tl.zeros([BLOCK_T], dtype=tl.float32),)
        db = ()
        for i in tl.static_range(N_OUT):
            db = db + (tl.zeros([BLOCK_T], dtype=tl.float32),)

        for i_d in range(first, last):
            _, o_d, m = _token_tile(i_t, i_d, T, D, BLOCK_T, BLOCK_D)
            xs = _load_streams(x_ptr, o_t, o_d, m, D, N)
            douts = _load_streams(dout_ptr, o_t, o_d, m, D, N_OUT)
            if HAS_Y:
                y = tl.load(y_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
                dy = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                db_new = ()
                for i in tl.static_range(N_OUT):
                    b_i = tl.load(b_ptr + o_t * stride_b + i, mask=t_ok, other=0.0)
                    dy += b_i[:, None] * douts[i]
                    db_new = db_new + (db[i] + tl.sum(douts[i] * y, axis=1),)
                db = db_new
                tl.store(dy_ptr + o_t[:, None] * D + o_d[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m)
            dw_new = ()
            for i in tl.static_range(N_OUT):
                for j in tl.static_range(N):
                    dw_new = dw_new + (dw[i * N + j] + tl.sum(douts[i] * xs[j], axis=1),)
            dw = dw_new
            if WRITE_DX:
                for j in tl.static_range(N):
                    p_dx = o_t[:, None] * (N * D) + j * D + o_d[None, :]
                    if ACCUMULATE:
                        dx = tl.load(dx_acc_ptr + p_dx, mask=m, other=0.0).to(tl.float32)
                    else:
                        dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                    for i in tl.static_range(N_OUT):
                        w_ij = tl.load(w_ptr + o_t * stride_w + (i * N + j), mask=t_ok, other=0.0)
                        dx += w_ij[:, None] * douts[i]
                    tl.store(dx_ptr + p_dx, dx.to(dx_ptr.dtype.element_ty), mask=m)

        for k in tl.static_range(N_OUT * N):
            tl.store(dw_ptr + o_t * (N_OUT * N) + k, dw[k], mask=t_ok)
        if HAS_Y:
            for i in tl.static_range(N_OUT):
                tl.store(db_ptr + o_t * N_OUT + i, db[i], mask=t_ok)
    else:
        # streams as [BLOCK_T, NP, BLOCK_D] tiles; per-token products over streams as batched
        # tl.dot (IEEE fp32): code size independent of n (n > 8)
        NO: tl.constexpr = NP if N_OUT > 1 else 1
        o_i = tl.arange(0, NO)
        o_j = tl.arange(0, NP)
        m_w = t_ok[:, None, None] & (o_i < N_OUT)[None, :, None] & (o_j < N)[None, None, :]
        w3 = tl.load(
            w_ptr + o_t[:, None, None] * stride_w + o_i[None, :, None] * N + o_j[None, None, :], mask=m_w, other=0.0
        )
        if HAS_Y:
            m_b = t_ok[:, None] & (o_i < N_OUT)[None, :]
            b2 = tl.load(b_ptr + o_t[:, None] * stride_b + o_i[None, :], mask=m_b, other=0.0)
            db = tl.zeros([BLOCK_T, NO], dtype=tl.float32)
        dw = tl.zeros([BLOCK_T, NO, NP], dtype=tl.float32)
        for i_d in range(first, last):
            _, o_d, m = _token_tile(i_t, i_d, T, D, BLOCK_T, BLOCK_D)
            x3, _ = _load_streams_3d(x_ptr, o_t, o_d, m, D, N, NP)
            p_do = dout_ptr + o_t[:, None, None] * (N_OUT * D) + o_i[None, :, None] * D + o_d[None, None, :]
            dout3 = tl.load(p_do, mask=m[:, None, :] & (o_i < N_OUT)[None, :, None], other=0.0).to(tl.float32)
            if HAS_Y:
                y = tl.load(y_ptr + o_t[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
                dy = tl.sum(b2[:, :, None] * dout3, axis=1)
                db += tl.sum(dout3 * y[:, None, :], axis=2)
                tl.store(dy_ptr + o_t[:, None] * D + o_d[None, :], dy.to(dy_ptr.dtype.element_ty), mask=m)
            if N_OUT > 1:
                dw += tl.dot(dout3, tl.permute(x3, (0, 2, 1)), input_precision="ieee")
            else:
                dw += tl.sum(dout3 * x3, axis=2)[:, None, :]
            if WRITE_DX:
                p_dx = o_t[:, None, None] * (N * D) + o_j[None, :, None] * D + o_d[None, None, :]
                m3 = m[:, None, :] & (o_j < N)[None, :, None]
                if ACCUMULATE:
                    dx3 = tl.load(dx_acc_ptr + p_dx, mask=m3, other=0.0).to(tl.float32)
                else:
                    dx3 = tl.zeros([BLOCK_T, NP, BLOCK_D], dtype=tl.float32)
                if N_OUT > 1:
                    dx3 += tl.dot(tl.permute(w3, (0, 2, 1)), dout3, input_precision="ieee")
                else:
                    dx3 += tl.permute(w3, (0, 2, 1)) * dout3
                tl.store(dx_ptr + p_dx, dx3.to(dx_ptr.dtype.element_ty), mask=m3)
        tl.store(dw_ptr + o_t[:, None, None] * (N_OUT * N) + o_i[None, :, None] * N + o_j[None, None, :], dw, mask=m_w)
        if HAS_Y:
            tl.store(db_ptr + o_t[:, None] * N_OUT + o_i[None, :], db, mask=t_ok[:, None] & (o_i < N_OUT)[None, :])


@triton.jit
def _add_splits(parts_ptr, out_ptr, o_t, T, splits, W: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr):
    """``out[t] = sum_s parts[s, t]`` over rows ``o_t`` of ``W`` values, in range order."""
    o_w = tl.arange(0, WP)
    m = (o_t < T)[:, None] & (o_w < W)[None, :]
    acc = tl.zeros([BLOCK_T, WP], dtype=tl.float32)
    for i_s in range(splits):
        acc += tl.load(parts_ptr + (i_s * T + o_t[:, None]) * W + o_w[None, :], mask=m, other=0.0)
    tl.store(out_ptr + o_t[:, None] * W + o_w[None, :], acc, mask=m)


@triton.jit(do_not_specialize=["T", "splits"])
def partial_sums_kernel(
    # dw_parts [splits, T, W], db_parts [splits, T, B] (fp32) -> dw [T, W], db [T, B]: the
    # backward's partial coefficient gradients over ranges of D, added in range order
    dw_parts_ptr,
    db_parts_ptr,
    dw_ptr,
    db_ptr,
    T,
    splits,
    W: tl.constexpr,
    WP: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _add_splits(dw_parts_ptr, dw_ptr, o_t, T, splits, W, WP, BLOCK_T)
    if B > 0:
        _add_splits(db_parts_ptr, db_ptr, o_t, T, splits, B, BP, BLOCK_T)


# ------------------------------------------------------------------------------ launchers


def _unroll(n: int, n_out: int) -> dict:
    """Streams unrolled one tile each up to n = 8 (fastest); beyond, one ``[BLOCK_T, NP, BLOCK_D]``
    tile, so that code size and compile time stay flat in n."""
    return dict(UNROLL=n <= 8, NP=next_pow2(n))


def _fwd_config(n: int, d: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_D)``: about 1024 values per stream tile (8 per thread); smaller tiles
    for the wide path, which holds every stream at once."""
    block_d = min(256, next_pow2(d)) if n <= 8 else max(16, min(64, next_pow2(d)))
    values = 1024 if n <= 8 else 256
    return max(1, values // block_d), block_d


def _bwd_config(n: int, n_out: int, d: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps)`` of the backward: about 1024 values per stream tile up to n = 8;
    the wide path's batched dot reduces over ``BLOCK_D``: at least 16. The same where tokens are few
    (``python -m bench.tune_mixing small-tokens-mix``)."""
    block_d = min(256, next_pow2(d)) if n <= 8 else max(16, min(64, next_pow2(d)))
    values = 1024 if n <= 8 else 256
    return max(1, values // block_d), block_d, 4


@launch_plan
def _fwd_plan(n: int, n_out: int, d: int, has_y: bool, T) -> LaunchPlan:
    """A program per tile of ``BLOCK_T`` tokens and ``BLOCK_D`` channels (:func:`_fwd_config`)."""
    block_t, block_d = _fwd_config(n, d)
    meta = dict(N=n, N_OUT=n_out, HAS_Y=has_y, **_unroll(n, n_out), BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return LaunchPlan((cdiv(T, block_t), cdiv(d, block_d)), meta, ("fwd", n, n_out, d, has_y))


# Where tokens are few the backward's programs are few too (256 at d = 4096 and 1k tokens): D is
# then split over programs, which write partial coefficient gradients that one launch adds. The
# split pays at 1k tokens and not from 4k on (``python -m bench.tune_mixing small-tokens-split``).
MIX_BWD_WAVES = 4  # programs per SM the split aims at: the post-mix (several streams out)
PRE_MIX_BWD_WAVES = 8  # one stream out: less work per program, more programs pay
# chunks of BLOCK_D channels per range at least: the post-mix gained nothing from ranges of 2 chunks
# (d = 1024), where a site is bound by the host, which the partial sums' launch costs; the pre-mix
# gains from them (the sweep's fastest count, or close to it, at 512 to 16k tokens, d = 1024 to 8192)
MIN_SPLIT_CHUNKS = 4
PRE_MIX_MIN_SPLIT_CHUNKS = 2


def bwd_d_splits(n: int, n_out: int, d: int, tokens, sms: int) -> int:
    """Ranges of ``D`` per token tile in the backward: about ``MIX_BWD_WAVES`` programs per SM, each range
    at least ``MIN_SPLIT_CHUNKS`` chunks (one stream out: the ``PRE_MIX_`` constants); n <= 4, and 1
    for a symbolic token count."""
    if n > 4 or type(tokens) is not int:
        return 1
    block_t, block_d, _ = _bwd_config(n, n_out, d)
    if n_out > 1:
        waves, min_chunks = MIX_BWD_WAVES, MIN_SPLIT_CHUNKS
    else:
        waves, min_chunks = PRE_MIX_BWD_WAVES, PRE_MIX_MIN_SPLIT_CHUNKS
    most = cdiv(d, block_d) // min_chunks
    return per_tile(cdiv(tokens, block_t), waves, sms, most)


@launch_plan
def _bwd_plan(n: int, n_out: int, d: int, T, has_y: bool, need_grad_x: bool, accumulate: bool, device):
    """``(LaunchPlan, split_chunks)`` of the backward: a program per token tile and range of
    ``split_chunks`` channel chunks (``grid[1]`` ranges; one: all of ``D``)."""
    block_t, block_d, num_warps = _bwd_config(n, n_out, d)
    chunks = cdiv(d, block_d)
    split_chunks = max(1, cdiv(chunks, bwd_d_splits(n, n_out, d, T, sm_count(device))))
    meta = dict(N=n, N_OUT=n_out, HAS_Y=has_y, **_unroll(n, n_out), WRITE_DX=need_grad_x, ACCUMULATE=accumulate)
    meta.update(BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps)
    grid = (cdiv(T, block_t), max(1, cdiv(chunks, split_chunks)))
    key = ("bwd", n, n_out, d, has_y, need_grad_x, accumulate)
    return LaunchPlan(grid, meta, key), split_chunks


def _per_token(c: torch.Tensor | None, per_token: int):
    """``(c, token stride)``: fp32 coefficients whose token stride is 0 (shared) or dense."""
    if c is None:
        return None, 0
    # a token's coefficients are read as one dense block; tokens at stride 0 or per_token. (One
    # call for the strides and one for the shape: this runs on every launch.)
    shape, stride = c.shape, c.stride()
    dense_rows = stride[-1] == 1 and (len(shape) == 2 or stride[1] == shape[2])
    if not dense_rows or (shape[0] > 1 and stride[0] not in (0, per_token)):
        c = c.contiguous()
        stride = c.stride()
    return c, (0 if shape[0] == 1 else stride[0])


def _check_mix(x, w, y, b):
    """``(T, N, D, N_OUT)`` of a mix's arguments, checked."""
    check_streams(x, "x", MAX_STREAMS)
    *lead, n, d = x.shape
    T = math.prod(lead)
    check_tensor(w, "w", dtypes=F32, device=x.device)
    if w.dim() != 3 or w.shape[0] != T or w.shape[2] != n or not 1 <= w.shape[1] <= MAX_STREAMS:
        raise ValueError(f"w must have shape [{T}, N_OUT, {n}] with 1 <= N_OUT <= {MAX_STREAMS}, got {list(w.shape)}")
    n_out = w.shape[1]
    if (y is None) != (b is None):
        raise ValueError("y and b go together: pass both or neither")
    if y is not None:
        check_tensor(y, "y", device=x.device)
        if y.numel() != T * d or y.shape[-1:] != (d,):
            raise ValueError(f"y must have shape [..., {d}] over {T} tokens, got {list(y.shape)}")
        check_tensor(b, "b", (T, n_out), F32, x.device)
    return T, n, d, n_out


def stream_mix_fwd(
    x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None = None, b: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., N, D]``, ``w [T, N_OUT, N]`` fp32, ``y [..., D]``, ``b [T, N_OUT]`` fp32 ->
    ``[..., N_OUT, D]`` (``T`` the number of tokens, the product of the leading dims).

    Output in ``x``'s dtype. ``w`` and ``b`` may have token stride 0; ``x`` and ``y`` are made
    contiguous."""
    _check_mix(x, w, y, b)
    return stream_mix_fwd_unchecked(x, w, y, b)


def stream_mix_fwd_unchecked(x, w, y=None, b=None):
    """:func:`stream_mix_fwd` without the argument checks (host time per launch), for callers whose
    arguments are right by construction (:mod:`mhc.ops.mixing`' Functions); layouts still copied."""
    *lead, n, d = x.shape
    n, d, T, n_out = static(n), static(d), math.prod(lead), static(w.shape[1])
    x = x.contiguous()
    out = torch.empty((*lead, n_out, d), dtype=x.dtype, device=x.device)
    if T == 0 or d == 0:
        return out
    has_y = y is not None
    if has_y:
        y = y.contiguous()
    w, stride_w = _per_token(w, n_out * n)
    b, stride_b = _per_token(b, n_out)
    grid, meta, key = per_size(_fwd_plan, T)(n, n_out, d, has_y, T)  # a LaunchPlan
    inputs = (x, y if has_y else x, w, b if has_y else w)
    launch(stream_mix_fwd_kernel, grid, inputs, (out,), (T, d, stride_w, stride_b), meta, key)
    return out


def stream_mix_bwd(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor | None,
    b: torch.Tensor | None,
    grad_out: torch.Tensor,
    grad_x_acc: torch.Tensor | None = None,
    need_grad_x: bool = True,
):
    """Backward of :func:`stream_mix_fwd`: ``(dx, dy, dw, db)``.

    ``dx`` shaped like ``x`` in ``x``'s dtype (``+ grad_x_acc`` when given; ``None`` unless
    ``need_grad_x``), ``dy`` like ``y`` in ``y``'s dtype, ``dw [T, N_OUT, N]`` and ``db [T, N_OUT]``
    per token in fp32 (``None`` without ``y``). ``grad_out [..., N_OUT, D]`` and ``grad_x_acc``
    may have other leading dims than ``x``, with the same number of tokens."""
    T, n, d, n_out = _check_mix(x, w, y, b)
    check_tensor(grad_out, "grad_out", device=x.device)
    if grad_out.shape[-2:] != (n_out, d) or grad_out.numel() != T * n_out * d:
        raise ValueError(f"grad_out must have shape [..., {n_out}, {d}] over {T} tokens, got {list(grad_out.shape)}")
    if grad_x_acc is not None:
        check_tensor(grad_x_acc, "grad_x_acc", device=x.device)
        if grad_x_acc.numel() != x.numel() or grad_x_acc.shape[-2:] != x.shape[-2:]:
            raise ValueError(f"grad_x_acc must have x's shape {list(x.shape)}, got {list(grad_x_acc.shape)}")
    return stream_mix_bwd_unchecked(x, w, y, b, grad_out, grad_x_acc, need_grad_x)


def stream_mix_bwd_unchecked(x, w, y, b, grad_out, grad_x_acc=None, need_grad_x=True):
    """:func:`stream_mix_bwd` without the argument checks, as :func:`stream_mix_fwd_unchecked`."""
    n, d = static(x.shape[-2]), static(x.shape[-1])
    T, n_out = math.prod(x.shape[:-2]), static(w.shape[1])
    x = x.contiguous()
    grad_out = grad_out.contiguous()
    has_y = y is not None
    accumulate = grad_x_acc is not None
    if has_y:
        y = y.contiguous()
    if accumulate:
        grad_x_acc = grad_x_acc.contiguous()
    dx = torch.empty_like(x) if need_grad_x else None
    dy = torch.empty_like(y) if has_y else None
    f32 = dict(dtype=torch.float32, device=x.device)
    if T == 0:
        return dx, dy, torch.empty((T, n_out, n), **f32), torch.empty((T, n_out), **f32) if has_y else None
    w, stride_w = _per_token(w, n_out * n)
    b, stride_b = _per_token(b, n_out)
    (grid, meta, key), split_chunks = per_size(_bwd_plan, T)(n, n_out, d, T, has_y, need_grad_x, accumulate, x.device)
    splits = grid[1]
    parts = (splits,) if splits > 1 else ()
    dw = torch.empty((*parts, T, n_out, n), **f32)
    db = torch.empty((*parts, T, n_out), **f32) if has_y else None
    inputs = (x, y if has_y else x, w, b if has_y else w, grad_out, grad_x_acc if accumulate else x)
    # in place of an output not written: an input, or dw
    outputs = (dx if need_grad_x else x, dy if has_y else x, dw, db if has_y else dw)
    launch(stream_mix_bwd_kernel, grid, inputs, outputs, (T, d, stride_w, stride_b, split_chunks), meta, key)
    if splits == 1:
        return dx, dy, dw, db
    return dx, dy, *_add_partial_sums(dw, db)


SUM_TOKENS = 64  # tokens per program of the partial sums


@launch_plan
def _sums_plan(n: int, n_out: int, has_b: bool, T) -> LaunchPlan:
    """A program per ``SUM_TOKENS`` tokens."""
    meta = dict(W=n_out * n, WP=next_pow2(n_out * n), B=n_out if has_b else 0, BP=next_pow2(n_out))
    meta.update(BLOCK_T=SUM_TOKENS, num_warps=4)
    return LaunchPlan((cdiv(T, SUM_TOKENS),), meta, ("sums", n_out, n, has_b))


def _add_partial_sums(dw_parts, db_parts):
    """``(dw [T, N_OUT, N], db [T, N_OUT] or None)``: the partial sums of the ranges of ``D``
    (``[ranges, T, ...]``) added in range order (deterministic), both in one launch."""
    splits, T, n_out, n = dw_parts.shape
    has_b = db_parts is not None
    dw = torch.empty((T, n_out, n), dtype=torch.float32, device=dw_parts.device)
    db = torch.empty((T, n_out), dtype=torch.float32, device=dw_parts.device) if has_b else None
    plan = _sums_plan(n, n_out, has_b, T)  # T is an int: D is split only then
    inputs, outputs = (dw_parts, db_parts if has_b else dw_parts), (dw, db if has_b else dw_parts)
    launch(partial_sums_kernel, plan.grid, inputs, outputs, (T, splits), plan.meta, plan.key)
    return dw, db
