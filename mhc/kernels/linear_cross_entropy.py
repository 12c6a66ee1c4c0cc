"""Fused linear + cross-entropy kernels and their launchers: ``CE(x @ W^T + b, target)`` without
the ``[N, V]`` logits (``docs/losses.md`` derives the passes).

Forward (:func:`lse_forward`): logit tiles reduced by an online log-sum-exp into per-program
partials, combined in fp32. Backward (:func:`grad_backward`), one vocabulary chunk at a time:
:func:`grad_logits_kernel` writes the chunk's logit gradient ``G`` (the only large temporary),
cuBLAS computes ``dW[c0:c1] = G^T x``, :func:`grad_input_kernel` adds ``G W[c0:c1]`` into an fp32
``dx``. No atomics: bit-identical run to run. Offsets are 64-bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mhc.kernels._arch import arch, tuned
from mhc.kernels._host import read_later
from mhc.kernels._launch import LaunchPlan, launch_plan, per_size, sm_count
from mhc.kernels._tiles import cdiv

try:  # Triton >= 3.3 on Hopper: the logits tiles come through the tensor copy engine (TMA)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

# The [N, chunk] gradient buffer of the backward: at most this many bytes, but at least
# MIN_CHUNK vocabulary columns (fewer chunks means fewer passes over the fp32 dx accumulator;
# a larger buffer saves little more).
CHUNK_BYTES = 64 * 2**20
MIN_CHUNK = 4096
# forward programs per multiprocessor (each walks a range of vocabulary blocks)
PROGRAMS_PER_SM = 4


@triton.jit
def _grouped_tile(pid, n_row_blocks, n_col_blocks, GROUP: tl.constexpr):
    """Map a 1D program id to (row block, column block), GROUP row blocks at a time, so that
    programs running together share their rows of x and their columns of W in L2."""
    per_group = GROUP * n_col_blocks
    first_row = (pid // per_group) * GROUP
    group_rows = tl.minimum(n_row_blocks - first_row, GROUP)
    in_group = pid % per_group
    return first_row + in_group % group_rows, in_group // group_rows


@triton.jit
def _softcap(logits, softcap):
    """``softcap * tanh(logits / softcap)`` and the ``tanh``. The tanh is built from ``exp`` of a
    non-positive argument (libdevice's tanh does not run in Triton's interpreter) with a fast
    division: absolute error about 1e-7, so about ``softcap * 1e-7`` on the capped logit."""
    u = logits * (1.0 / softcap)
    e = tl.exp(-2.0 * tl.abs(u))
    magnitude = tl.fdiv(1.0 - e, 1.0 + e, ieee_rounding=False)
    tanh = tl.where(u < 0, -magnitude, magnitude)
    return softcap * tanh, tanh


@triton.jit
def _logits_tile(
    x_src,
    w_src,
    row0,
    col0,
    row_ok,
    col_ok,
    D,
    stride_x,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
):
    """``x[row0:] @ W[col0:]^T``: ``[BLOCK_N, BLOCK_V]`` fp32; rows, columns out of range read as 0.

    With ``TMA`` the sources are tensor descriptors (the copy engine fetches the tiles, out of
    bounds as zeros); otherwise pointers to rows of unit inner stride."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if TMA:
        for k0 in range(0, D, BLOCK_D):
            x = x_src.load([row0, k0])
            w = w_src.load([col0, k0]).T
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:
        ks = tl.arange(0, BLOCK_D)
        rows = (row0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = (col0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        x_ptrs = x_src + rows[:, None] * stride_x + ks[None, :]
        w_ptrs = w_src + cols[None, :] * stride_w + ks[:, None]
        for k0 in range(0, D, BLOCK_D):
            if EVEN_D:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + ks) < D
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_D
            w_ptrs += BLOCK_D
    return acc


@triton.jit
def lse_partials_kernel(
    x_src,
    w_src,
    b_ptr,
    t_ptr,
    cw_ptr,
    max_ptr,
    sum_ptr,
    target_logit_ptr,
    smooth_ptr,
    N,
    V,
    D,
    stride_x,
    stride_w,
    blocks_per_split,
    n_splits,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
):
    """Per (row block, vocabulary range): running max, sum of exp and the target's logit, and
    with ``SMOOTH`` the class-weighted sum of the logits (label smoothing's term). Logits are
    soft-capped first with ``SOFTCAP``: ``softcap * tanh(logits / softcap)``."""
    row_block, split = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP)
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    target = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_N,), dtype=tl.float32)
    smooth_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(V, BLOCK_V))
    for vb in range(first, last):
        cols = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        logits = _logits_tile(
            x_src,
            w_src,
            row_block * BLOCK_N,
            vb * BLOCK_V,
            row_ok,
            col_ok,
            D,
            stride_x,
            stride_w,
            BLOCK_N,
            BLOCK_V,
            BLOCK_D,
            EVEN_D,
            PRECISION,
            UPCAST,
            TMA,
        )
        if HAS_BIAS:
            logits += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            logits, _ = _softcap(logits, softcap)
        if SMOOTH:
            if HAS_CLASS_WEIGHT:
                class_weight = tl.load(cw_ptr + cols, mask=col_ok, other=0.0)
                smooth_sum += tl.sum(logits * class_weight[None, :], axis=1)
            else:
                smooth_sum += tl.sum(tl.where(col_ok[None, :], logits, 0.0), axis=1)
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        # every block holds at least one real column, so new_max is finite
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), axis=1)
        run_max = new_max
        is_target = cols[None, :] == target[:, None]
        target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
    out = rows.to(tl.int64) * n_splits + split
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(target_logit_ptr + out, target_logit, mask=row_ok)
    if SMOOTH:
        tl.store(smooth_ptr + out, smooth_sum, mask=row_ok)


@triton.jit
def grad_logits_kernel(
    x_src,
    w_src,
    b_ptr,
    t_ptr,
    cw_ptr,
    lse_ptr,
    prob_scale_ptr,
    target_scale_ptr,
    smooth_scale_ptr,
    g_ptr,
    N,
    D,
    col_start,
    col_end,
    stride_x,
    stride_w,
    stride_g,
    softcap,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
):
    """One chunk of the logits' gradient, columns ``[col_start, col_end)``:
    ``G = prob_scale * softmax - target_scale * onehot - smooth_scale * class_weight``, times
    ``1 - tanh^2`` of the soft-cap with ``SOFTCAP`` (the coefficients are per row)."""
    row_block, col_block = _grouped_tile(
        tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(col_end - col_start, BLOCK_V), GROUP
    )
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col_start + col_block * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < col_end
    logits = _logits_tile(
        x_src,
        w_src,
        row_block * BLOCK_N,
        col_start + col_block * BLOCK_V,
        row_ok,
        col_ok,
        D,
        stride_x,
        stride_w,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        EVEN_D,
        PRECISION,
        UPCAST,
        TMA,
    )
    if HAS_BIAS:
        logits += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        logits, tanh = _softcap(logits, softcap)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    prob_scale = tl.load(prob_scale_ptr + rows, mask=row_ok, other=0.0)
    target_scale = tl.load(target_scale_ptr + rows, mask=row_ok, other=0.0)
    target = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    is_target = cols[None, :] == target[:, None]
    grad = tl.exp(logits - lse[:, None]) * prob_scale[:, None] - tl.where(is_target, target_scale[:, None], 0.0)
    if SMOOTH:
        smooth_scale = tl.load(smooth_scale_ptr + rows, mask=row_ok, other=0.0)
        if HAS_CLASS_WEIGHT:
            class_weight = tl.load(cw_ptr + cols, mask=col_ok, other=0.0)
            grad -= smooth_scale[:, None] * class_weight[None, :]
        else:
            grad -= smooth_scale[:, None]
    if SOFTCAP:
        grad *= 1.0 - tanh * tanh
    g_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + (cols - col_start)[None, :]
    tl.store(g_ptrs, grad.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def grad_input_kernel(
    g_ptr,
    w_ptr,
    dx_ptr,
    N,
    D,
    K,
    stride_g,
    stride_w,
    stride_dx,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``dx[N, D] += G[N, K] @ W[K, D]`` with ``dx`` fp32 (``w_ptr`` at the chunk's first row)."""
    row_block, col_block = _grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP)
    rows = row_block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < D
    ks = tl.arange(0, BLOCK_K)
    dx_ptrs = dx_ptr + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.load(dx_ptrs, mask=out_ok, other=0.0)
    g_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + ks[None, :]
    w_ptrs = w_ptr + ks.to(tl.int64)[:, None] * stride_w + cols[None, :]
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        g = tl.load(g_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            g, w = g.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(g, w, acc, input_precision=PRECISION)
        g_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w
    tl.store(dx_ptrs, acc, mask=out_ok)


# Launchers. Inputs: x [N, D], weight [V, D], bias [V] or None (same dtype: fp16, bf16 or fp32),
# target [N] int64. The kernels read every tensor as contiguous (x and W by rows with unit inner
# stride): the launchers copy those that are not, so views, offsets and stride-0 inputs read right.


def _dense(*tensors):
    """``tensors`` made contiguous where they are not (``None`` stays ``None``)."""
    return [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]


def _check_target(target: torch.Tensor, n_rows: int) -> None:
    if target.dtype != torch.int64 or target.shape != (n_rows,):
        raise ValueError(f"target must be int64 of shape [{n_rows}], got {target.dtype} {tuple(target.shape)}")


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get fp32 products, as torch.matmul gives them unless TF32 is allowed
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _sources(x, weight, block_n, block_v, block_d):
    """Tensor descriptors for x and W where the copy engine can fetch their tiles (Hopper or
    newer, or the interpreter; 16-byte aligned rows), else the tensors themselves; and which."""
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))
    hopper = not x.is_cuda or (torch.cuda.get_device_capability(x.device)[0] >= 9 and arch().tensor_descriptors)
    if TensorDescriptor is None or not (aligned and hopper and USE_TMA):
        return x, weight, False
    return (
        TensorDescriptor.from_tensor(x, [block_n, block_d]),
        TensorDescriptor.from_tensor(weight, [block_v, block_d]),
        True,
    )


def _upcast(x: torch.Tensor) -> bool:
    # Triton's interpreter multiplies bfloat16 tiles wrongly (numpy has no bfloat16): fp32 there
    return not x.is_cuda


def _tiles(x: torch.Tensor) -> dict:
    """Block shapes: for 16-bit inputs the architecture's table (``mhc/kernels/tables``, swept by
    ``python -m bench.loss --sweep --write``); small under the interpreter, where every program is
    a Python loop."""
    if not x.is_cuda:
        small = (32, 32, 32, 1, 1)
        return dict(lse=small, grad_logits=small, grad_logits_softcap=small, grad_input=small)
    if x.dtype == torch.float32:
        fp32 = (64, 64, 32, 4, 3)
        return dict(lse=fp32, grad_logits=fp32, grad_logits_softcap=fp32, grad_input=fp32)
    return tuned("loss_tiles_16bit")


# (BLOCK_N, BLOCK_V or BLOCK_D, BLOCK_D or BLOCK_K, num_warps, num_stages); 16-bit ones per
# architecture in mhc/kernels/tables. The soft-cap's epilogue spills registers with grad_logits'
# tile, so it has its own.
TILES_16BIT = ("lse", "grad_logits", "grad_logits_softcap", "grad_input")
GROUP = 8
USE_TMA = True  # tensor-memory-accelerator loads where Triton has them (faster on Hopper); False: pointers


def _numerics(x: torch.Tensor) -> tuple[str, bool]:
    """``(PRECISION, UPCAST)`` of the products: read per call (``allow_tf32`` may change)."""
    return _precision(x.dtype), _upcast(x)


# ------------------------------------------------------------------------------ launch plans
# One per kernel: its grid and meta-parameters for a size, from the tiles of ``_tiles`` (per
# architecture). Whether the tiles come through TMA depends on the tensors' addresses: per call.


@launch_plan
def _lse_plan(N, V: int, D: int, tile: tuple, precision: str, upcast: bool, flags: tuple, sms: int):
    """``(LaunchPlan, blocks_per_split, n_splits)`` of the forward: a program per row block and
    range of ``blocks_per_split`` vocabulary blocks, about ``PROGRAMS_PER_SM`` programs per SM.
    ``flags``: ``(HAS_BIAS, SOFTCAP, SMOOTH, HAS_CLASS_WEIGHT)``."""
    block_n, block_v = tile[:2]
    row_blocks, vocab_blocks = cdiv(N, block_n), cdiv(V, block_v)
    n_splits = min(vocab_blocks, max(1, cdiv(PROGRAMS_PER_SM * sms, max(1, row_blocks))))
    blocks_per_split = cdiv(vocab_blocks, n_splits)
    n_splits = cdiv(vocab_blocks, blocks_per_split)  # no empty split
    meta = _logits_meta(D, tile, precision, upcast, flags)
    return (
        LaunchPlan((row_blocks * n_splits,), meta, ("lse", tile, precision, upcast, flags)),
        blocks_per_split,
        n_splits,
    )


@launch_plan
def _grad_logits_plan(N, D: int, width: int, tile: tuple, precision: str, upcast: bool, flags: tuple):
    """A program per ``[BLOCK_N, BLOCK_V]`` tile of a chunk of ``width`` vocabulary columns,
    grouped ``GROUP`` row blocks at a time."""
    block_n, block_v = tile[:2]
    meta = _logits_meta(D, tile, precision, upcast, flags)
    grid = (cdiv(N, block_n) * cdiv(width, block_v),)
    return LaunchPlan(grid, meta, ("grad_logits", tile, precision, upcast, flags))


@launch_plan
def _grad_input_plan(N, D: int, tile: tuple, precision: str, upcast: bool):
    """A program per ``[BLOCK_N, BLOCK_D]`` tile of ``dx``, grouped as :func:`_grad_logits_plan`."""
    block_n, block_d, block_k, warps, stages = tile
    meta = dict(BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_K=block_k, GROUP=GROUP, PRECISION=precision, UPCAST=upcast)
    meta.update(num_warps=warps, num_stages=stages)
    return LaunchPlan((cdiv(N, block_n) * cdiv(D, block_d),), meta, ("grad_input", tile, precision, upcast))


def _logits_meta(D: int, tile: tuple, precision: str, upcast: bool, flags: tuple) -> dict:
    """The meta-parameters of the two kernels that compute logit tiles."""
    block_n, block_v, block_d, warps, stages = tile
    has_bias, softcap, smoothing, has_class_weight = flags
    meta = dict(HAS_BIAS=has_bias, SOFTCAP=softcap, SMOOTH=smoothing, HAS_CLASS_WEIGHT=has_class_weight)
    meta.update(BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_D=block_d, GROUP=GROUP, EVEN_D=D % block_d == 0)
    meta.update(PRECISION=precision, UPCAST=upcast, num_warps=warps, num_stages=stages)
    return meta


def lse_forward(x, weight, bias, target, *, class_weight=None, smoothing=False, softcap=None):
    """Per row: log-sum-exp of the (soft-capped) logits, the target's logit (0 for targets outside
    ``[0, V)``: ignored rows), and with ``smoothing`` the class-weighted sum of the logits
    ``sum_c class_weight[c] * logits[c]`` (None without): fp32 ``[N]`` tensors.

    ``class_weight``: fp32 ``[V]`` or None (all ones); ``softcap``: a positive float or None."""
    N, D = x.shape
    V = weight.shape[0]
    _check_target(target, N)
    x, weight, bias, target, class_weight = _dense(x, weight, bias, target, class_weight)
    flags = (bias is not None, softcap is not None, smoothing, class_weight is not None)
    tile = _tiles(x)["lse"]
    plan, blocks_per_split, n_splits = per_size(_lse_plan, N)(N, V, D, tile, *_numerics(x), flags, sm_count(x.device))
    partial = torch.empty(4 if smoothing else 3, N, n_splits, device=x.device, dtype=torch.float32)
    if N > 0:
        x_src, w_src, tma = _sources(x, weight, *tile[:3])
        cw = class_weight if class_weight is not None else partial
        tensors = (x_src, w_src, bias if bias is not None else x, target, cw, *partial[:3], partial[-1])
        scalars = (N, V, D, x.stride(0), weight.stride(0), blocks_per_split, n_splits, float(softcap or 1.0))
        lse_partials_kernel[plan.grid](*tensors, *scalars, TMA=tma, **plan.meta)
    run_max, run_sum, target_logit = partial[:3]
    row_max = run_max.amax(dim=1)
    lse = row_max + torch.log((run_sum * torch.exp(run_max - row_max[:, None])).sum(dim=1))
    smooth_sum = partial[3].sum(dim=1) if smoothing else None
    return lse, target_logit.sum(dim=1), smooth_sum


@functools.lru_cache(maxsize=None)
def _cublas_fp32_accumulation(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c_fp32, a, b, torch.float32, out=c_fp32)`` works here for 16-bit
    ``a``, ``b`` (PyTorch builds with the out_dtype overloads, CUDA only): cuBLAS then adds the
    chunk's ``G W`` into the fp32 accumulator, faster than grad_input_kernel."""
    try:
        a = torch.ones(2, 3, device=device, dtype=dtype)
        c = torch.ones(2, 2, device=device, dtype=torch.float32)
        torch.addmm(c, a, a.t(), torch.float32, out=c)
        return bool((c == 4).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _cublas_accumulates_fp32(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float32 and _cublas_fp32_accumulation(x.device, x.dtype)


def chunk_columns(n_rows: int, vocab: int, element_size: int) -> int:
    """Vocabulary columns per backward chunk: the ``[n_rows, chunk]`` buffer within CHUNK_BYTES,
    at least MIN_CHUNK, at most the vocabulary."""
    fit = CHUNK_BYTES // max(1, n_rows * element_size)
    return max(1, min(vocab, max(MIN_CHUNK, fit)))


def _zero_grads(x, grad_x, grad_w, grad_b):
    """The gradients of a loss whose logits' gradient is 0 (every row ignored, a zero upstream
    gradient, or no rows); None where not needed."""
    for g in (grad_w, grad_b):
        if g is not None:
            g.zero_()
    return (grad_x.to(x.dtype) if grad_x is not None else None), grad_w, grad_b


def grad_backward(
    x,
    weight,
    bias,
    target,
    lse,
    prob_scale,
    target_scale,
    smooth_scale,
    need_input,
    need_weight,
    need_bias,
    *,
    class_weight=None,
    softcap=None,
    capturable=False,
):
    """Gradients for x, weight and bias (None where not needed) of a loss whose gradient with
    respect to the (soft-capped) logits ``z`` of row i is

        prob_scale[i] * softmax(z)[c] - target_scale[i] * [c == target[i]]
            - smooth_scale[i] * class_weight[c]

    (``mhc.losses`` derives the coefficients; ``smooth_scale`` None: no such term). The three
    fp32 ``[N]`` coefficients are 0 on ignored rows. Their largest combined magnitude is factored
    out of ``G`` (so fp16 ``G`` keeps its precision) and applied in the products' fp32 epilogues,
    read on the host; ``capturable``: applied on the device after the products instead (no host
    read, for CUDA graph capture)."""
    N, D = x.shape
    V = weight.shape[0]
    _check_target(target, N)
    x, weight, bias, target, class_weight, lse, prob_scale, target_scale, smooth_scale = _dense(
        x, weight, bias, target, class_weight, lse, prob_scale, target_scale, smooth_scale
    )
    grad_x = torch.zeros(N, D, device=x.device, dtype=torch.float32) if need_input else None
    grad_w = torch.empty_like(weight) if need_weight else None
    grad_b = torch.empty_like(bias) if need_bias else None
    if N == 0:
        return _zero_grads(x, grad_x, grad_w, grad_b)
    bound = prob_scale.abs() + target_scale.abs()
    if smooth_scale is not None:
        class_max = class_weight.abs().max() if class_weight is not None else 1.0
        bound = bound + smooth_scale.abs() * class_max
    # Divided on the device; the host needs the value only as the products' alpha, read once the
    # first G chunk is queued (waiting for the copy alone: the GPU stays busy meanwhile).
    bound_max = bound.max()
    scale_max_later = None if capturable else read_later(bound_max)
    divisor = bound_max.clamp(min=torch.finfo(bound.dtype).tiny)
    prob_scale, target_scale = prob_scale / divisor, target_scale / divisor
    smoothing = smooth_scale is not None
    smooth_scale = smooth_scale / divisor if smoothing else prob_scale
    scales = (prob_scale, target_scale, smooth_scale)
    flags = (bias is not None, softcap is not None, smoothing, class_weight is not None)
    tiles = _tiles(x)
    tile = tiles["grad_logits" if softcap is None else "grad_logits_softcap"]
    numerics = _numerics(x)
    chunk = chunk_columns(N, V, x.element_size())
    grads = torch.empty(N, chunk, device=x.device, dtype=x.dtype)
    x_src, w_src, tma = _sources(x, weight, *tile[:3])
    scale_max = None
    for c0 in range(0, V, chunk):
        c1 = min(V, c0 + chunk)
        g = grads[:, : c1 - c0]
        plan = per_size(_grad_logits_plan, N)(N, D, c1 - c0, tile, *numerics, flags)
        cw = class_weight if class_weight is not None else lse
        tensors = (x_src, w_src, bias if bias is not None else x, target, cw, lse, *scales, g)
        scalars = (N, D, c0, c1, x.stride(0), weight.stride(0), grads.stride(0), float(softcap or 1.0))
        grad_logits_kernel[plan.grid](*tensors, *scalars, TMA=tma, **plan.meta)
        if scale_max is None and capturable:
            scale_max = 1.0  # the products unscaled; the device divisor is applied below
        elif scale_max is None:
            scale_max = scale_max_later()
            if scale_max == 0.0:  # every row ignored, or a zero upstream gradient
                return _zero_grads(x, grad_x, grad_w, grad_b)
        if need_weight:
            # one product over all N: fp32 accumulation inside, dW rows written once
            torch.addmm(grad_w[c0:c1], g.t(), x, beta=0, alpha=scale_max, out=grad_w[c0:c1])
        if need_bias:
            grad_b[c0:c1] = g.sum(dim=0, dtype=torch.float32) * scale_max
        if need_input and _cublas_accumulates_fp32(x):
            torch.addmm(grad_x, g, weight[c0:c1], torch.float32, out=grad_x)
        elif need_input:
            plan = per_size(_grad_input_plan, N)(N, D, tiles["grad_input"], *numerics)
            strides = (grads.stride(0), weight.stride(0), grad_x.stride(0))
            grad_input_kernel[plan.grid](g, weight[c0:c1], grad_x, N, D, c1 - c0, *strides, **plan.meta)
    del grads, g  # before the cast below allocates dx
    scale = divisor if capturable else scale_max
    if need_input:
        grad_x = grad_x.mul_(scale).to(x.dtype)
    if capturable and need_weight:
        grad_w.mul_(scale)
    if capturable and need_bias:
        grad_b.mul_(scale)
    return grad_x, grad_w, grad_b


__all__ = ["lse_forward", "grad_backward", "chunk_columns"]
