"""Helpers shared by the kernels: tile arithmetic on the host, float arguments (:func:`fp32_arg`),
and the Sinkhorn kernels' two forms of a matrix: ``N`` row tensors ``[BLOCK_T, NP]`` (column sums
are elementwise adds, row sums stay in a thread for small ``N``), or ``N * N`` entries held by
every thread (every step elementwise: the decoding form).
"""

import triton
import triton.language as tl

MAX_N = 64
# From this n on, the Sinkhorn launchers run the tiled kernels of sinkhorn_tiled.py (docs/sinkhorn.md);
# the per-row kernels unroll their code per row and stay for small n, where they are faster.
TILED_MIN_N = 7


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host (``triton.cdiv`` is a constexpr function since Triton 3.5: a few
    microseconds per call from host code, on every launch)."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def prev_pow2(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def launch_config(n: int, values_per_thread: int) -> tuple[int, int, int]:
    """``(NP, BLOCK_T, num_warps)``: about ``values_per_thread`` matrix entries per thread."""
    np2 = next_pow2(n)
    num_warps = 4 if n * np2 <= 256 else 8
    block_t = prev_pow2(max(1, values_per_thread * 32 * num_warps // (n * np2)))
    return np2, min(block_t, 512), num_warps


@triton.jit
def fp32_arg(x):
    """A float argument as fp32, the type a launch from Python gives it: Inductor launches a
    compiled graph's user kernels with float arguments as fp64, which would take every operation
    they meet into fp64 (slower, and other values than the eager launch's)."""
    return tl.cast(x, tl.float32)


@triton.jit
def _row_tile(i_b, T, N: tl.constexpr, BLOCK_T: tl.constexpr, NP: tl.constexpr):
    """Offsets ``[BLOCK_T, NP]`` of row 0 of program ``i_b``'s matrices, and the in-bounds mask."""
    o_t = i_b.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_j = tl.arange(0, NP)
    m = (o_t[:, None] < T) & (o_j[None, :] < N)
    return o_t[:, None] * (N * N) + o_j[None, :], m


@triton.jit
def load_upcast(ptr, offs, m, FP64: tl.constexpr):
    """A block upcast to the compute dtype (fp64 for fp64 input, else fp32); 0 outside ``m``."""
    b = tl.load(ptr + offs, mask=m, other=0.0)
    # one return: compiled Triton rejects a constexpr branch that returns another dtype
    return b.to(tl.float64 if FP64 else tl.float32)


@triton.jit
def reciprocal(x):
    """``1 / x`` for the positive sums of the Sinkhorn steps. fp32: the square of the hardware
    reciprocal square root, two instructions where ``1.0 / x`` compiles to about seven (range
    fixups for huge and denormal divisors, which these sums never are: ``docs/sinkhorn.md`` bounds
    them to ``[1/n^2, n]``); relative error below 4e-7 there (tested on the GPU), about that of
    ``1.0 / x``'s 2 ulp. fp64 divides."""
    if x.dtype == tl.float64:
        return 1.0 / x
    r = tl.math.rsqrt(x)
    return r * r


@triton.jit
def entries_column_exp(x, N: tl.constexpr):
    """Of matrices held as their ``N * N`` entries (``x[i * N + j]``, one value per matrix each):
    per column ``j`` its max and the sum of ``exp(x - max)``, as ``(max_0, sum_0, max_1, ...)``."""
    out = ()
    for j in tl.static_range(N):
        col_max = x[j]
        for i in tl.static_range(1, N):
            col_max = tl.maximum(col_max, x[i * N + j])
        col_sum = tl.exp(x[j] - col_max)
        for i in tl.static_range(1, N):
            col_sum += tl.exp(x[i * N + j] - col_max)
        out = out + (col_max, col_sum)
    return out


@triton.jit
def entries_sums(k, w, N: tl.constexpr, COLUMNS: tl.constexpr):
    """On entries: the column sums of ``K^T w`` (``COLUMNS``), else the row sums of ``K w``."""
    out = ()
    for a in tl.static_range(N):
        s = k[a] * w[0] if COLUMNS else k[a * N] * w[0]
        for b in tl.static_range(1, N):
            s += (k[b * N + a] if COLUMNS else k[a * N + b]) * w[b]
        out = out + (s,)
    return out


@triton.jit
def entries_ones(x, N: tl.constexpr):
    """``N`` scalings of one, shaped as an entry of ``x``."""
    one = tl.zeros_like(x[0]) + 1.0
    out = ()
    for i in tl.static_range(N):
        out = out + (one,)
    return out


@triton.jit
def entries_scaled(u, k, v, N: tl.constexpr):
    """The entries of ``diag(u) K diag(v)``."""
    out = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            out = out + (u[i] * k[i * N + j] * v[j],)
    return out


@triton.jit
def centered(v, v_sum, col_ok, N: tl.constexpr):
    """Column vector ``v`` (entry sum ``v_sum``) minus its mean over the ``N`` real columns, 0 on
    padding: the component orthogonal to the null vector of the implicit backward's system."""
    return tl.where(col_ok, v - v_sum / N, 0.0)


@triton.jit
def store_rounded(ptr, offs, m, b):
    """Store a block in the output dtype, rounding to nearest even when narrowing from fp32."""
    if ptr.dtype.element_ty == tl.float16 or ptr.dtype.element_ty == tl.bfloat16:
        b = b.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        b = b.to(ptr.dtype.element_ty)
    tl.store(ptr + offs, b, mask=m)


@triton.jit
def _load_rows(ptr, offs, m, N: tl.constexpr, FP64: tl.constexpr):
    """The ``N`` rows, upcast to the compute dtype (fp64 for fp64 input, else fp32)."""
    rows = ()
    for i in tl.static_range(N):
        rows = rows + (load_upcast(ptr, offs + i * N, m, FP64),)
    return rows


@triton.jit
def _store_rows(ptr, offs, m, rows, N: tl.constexpr):
    """Store in the output dtype, rounding to nearest even when narrowing from fp32."""
    for i in tl.static_range(N):
        store_rounded(ptr, offs + i * N, m, rows[i])


@triton.jit
def _row_sums(rows, N: tl.constexpr):
    """Tuple of ``N`` row sums ``[BLOCK_T, 1]``."""
    out = ()
    for i in tl.static_range(N):
        out = out + (tl.sum(rows[i], axis=1, keep_dims=True),)
    return out


@triton.jit
def _col_sums(rows, N: tl.constexpr):
    """Column sums ``[BLOCK_T, NP]``."""
    s = rows[0]
    for i in tl.static_range(1, N):
        s = s + rows[i]
    return s
