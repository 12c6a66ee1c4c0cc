"""The CPU path's loops: Sinkhorn-Knopp (forward and exact backward), a site's pre-mix and
post-mix (forward and backward), and a dynamic mHC site's start (coefficients from the projection,
Sinkhorn and the pre-mix, forward and backward), in C (``kernels.c``, built at first use by
:mod:`mhc.cpu._build`).

On a CPU the PyTorch reference runs a site as a few hundred small ops (Sinkhorn's twenty
iterations alone are about 80 forward and 200 backward), each a dispatch and a pass over memory;
each function here is one loop. They compute the reference's values within fp32 rounding (the
Sinkhorn steps scale by reciprocal sums, as the GPU kernels do) and are deterministic: where the
build joins PyTorch's OpenMP team (:mod:`mhc.cpu._build`) they split the tokens over its threads,
and every token's values are the same for any thread count.

:func:`runs_on` says whether the layers take these loops for some tensors: plain fp32 CPU
tensors outside ``torch.compile``, tracing and autocast, with the library built. Elsewhere the
layers run the PyTorch ops, which stay the tests' oracle (in fp64). A dispatch mode (a FLOP
counter, selective checkpointing) does not see the loops: the autograd ops around them recompute
them whole, so a checkpointed model's values do not depend on its policy.

Launchers take contiguous fp32 CPU tensors of the shapes their docstrings give (checked) and
return new tensors. :mod:`mhc.cpu.mixing` wraps the mixes as autograd ops over streams
``[..., n, d]``; :mod:`mhc.cpu.site_start` a site's start; :mod:`mhc.cpu.projection` is the
coefficients' RMS projection as one autograd op (PyTorch ops, no loop) for the other coefficients.
"""

from __future__ import annotations

import math

import torch

from mhc._compat import is_plain, transforms_active
from mhc.cpu._build import build_error, library

__all__ = [
    "available",
    "runs_on",
    "path_name",
    "build_error",
    "MAX_SINKHORN_N",
    "sinkhorn_forward",
    "sinkhorn_backward",
    "pre_mix_forward",
    "pre_mix_backward",
    "post_mix_forward",
    "post_mix_backward",
    "site_start_forward",
    "site_start_backward",
    "site_start_grad_x",
]

MAX_SINKHORN_N = 16  # a block of 16 tokens keeps every iterate in cache: 2 * iters * n * n floats each


def available() -> bool:
    """Whether the loops are built and loaded (this builds them on the first call)."""
    return library() is not None


def path_name() -> str:
    """What runs the PyTorch path's mixing and Sinkhorn on fp32 CPU tensors: ``"C loops"`` or
    ``"PyTorch ops"``."""
    return "C loops" if available() else "PyTorch ops"


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the layers run these loops for ``tensors``: all plain fp32 tensors on the CPU (a
    subclass such as ``DTensor`` or a fake tensor has no data of its own to read), not while
    ``torch.compile`` or ``torch.jit.trace`` records the ops or a ``torch.func`` transform or
    forward-mode AD runs, not under CPU autocast (whose ops run in lower precision), and the library available."""
    for t in tensors:
        if not is_plain(t) or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.is_autocast_enabled("cpu"):
        return False
    return not transforms_active() and available()


def _check(t: torch.Tensor, name: str, shape: tuple) -> None:
    if (
        not is_plain(t)
        or t.dtype != torch.float32
        or t.device.type != "cpu"
        or not t.is_contiguous()
        or tuple(t.shape) != shape
    ):
        raise ValueError(
            f"{name}: the CPU loops take a contiguous float32 CPU tensor (not a subclass) of shape {shape}, "
            f"got {type(t).__name__} {t.dtype} on {t.device}, shape {tuple(t.shape)}, strides {t.stride()}"
        )


def _call(function, *args) -> None:
    """``function`` on the tensors' addresses (``None``: a null pointer, a zero gradient)."""
    if function(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)):
        raise MemoryError("mhc's CPU Sinkhorn could not allocate its working memory")


def sinkhorn_forward(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``logits [T, n, n]`` (n <= :data:`MAX_SINKHORN_N`) -> ``[T, n, n]``:
    :func:`mhc.reference.sinkhorn_stable`, or :func:`mhc.reference.sinkhorn_eps` for ``eps > 0``."""
    T, n, _ = logits.shape
    _check(logits, "logits", (T, n, n))
    if n > MAX_SINKHORN_N:
        raise ValueError(f"the CPU Sinkhorn takes n <= {MAX_SINKHORN_N}, got {n}")
    out = torch.empty_like(logits)
    _call(library().mhc_sinkhorn_forward, logits, out, T, n, iters, eps)
    return out


def sinkhorn_backward(logits: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The gradient w.r.t. ``logits [T, n, n]`` of :func:`sinkhorn_forward`'s output, given
    ``grad_out [T, n, n]``; the iterates are recomputed from the logits."""
    T, n, _ = logits.shape
    _check(logits, "logits", (T, n, n))
    _check(grad_out, "grad_out", (T, n, n))
    if n > MAX_SINKHORN_N:
        raise ValueError(f"the CPU Sinkhorn takes n <= {MAX_SINKHORN_N}, got {n}")
    grad = torch.empty_like(logits)
    _call(library().mhc_sinkhorn_backward, logits, grad_out, grad, T, n, iters, eps)
    return grad


def pre_mix_forward(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    """``x [T, n, d]``, ``h_pre [T, n]`` -> ``x_in [T, d] = sum_s h_pre[:, s] x[:, s]``."""
    T, n, d = x.shape
    _check(x, "x", (T, n, d))
    _check(h_pre, "h_pre", (T, n))
    out = x.new_empty(T, d)
    _call(library().mhc_pre_mix_forward, x, h_pre, out, T, n, d)
    return out


def pre_mix_backward(x: torch.Tensor, h_pre: torch.Tensor, grad: torch.Tensor):
    """``(grad_x [T, n, d], grad_h_pre [T, n])`` of :func:`pre_mix_forward`, given ``grad [T, d]``."""
    T, n, d = x.shape
    _check(x, "x", (T, n, d))
    _check(h_pre, "h_pre", (T, n))
    _check(grad, "grad", (T, d))
    grad_x, grad_h_pre = torch.empty_like(x), torch.empty_like(h_pre)
    _call(library().mhc_pre_mix_backward, x, h_pre, grad, grad_x, grad_h_pre, T, n, d)
    return grad_x, grad_h_pre


def _check_post_mix(x, h_res, y, h_post) -> tuple:
    T, n, d = x.shape
    _check(x, "x", (T, n, d))
    _check(h_res, "h_res", (T, n, n))
    _check(y, "y", (T, d))
    _check(h_post, "h_post", (T, n))
    return T, n, d


def post_mix_forward(x, h_res, y, h_post) -> torch.Tensor:
    """``x [T, n, d]``, ``h_res [T, n, n]``, ``y [T, d]``, ``h_post [T, n]`` ->
    ``out [T, n, d]``, ``out[:, i] = sum_j h_res[:, i, j] x[:, j] + h_post[:, i] y``."""
    T, n, d = _check_post_mix(x, h_res, y, h_post)
    out = torch.empty_like(x)
    _call(library().mhc_post_mix_forward, x, h_res, y, h_post, out, T, n, d)
    return out


def post_mix_backward(x, h_res, y, h_post, grad):
    """``(grad_x, grad_h_res, grad_y, grad_h_post)`` of :func:`post_mix_forward`, given
    ``grad [T, n, d]``."""
    T, n, d = _check_post_mix(x, h_res, y, h_post)
    _check(grad, "grad", (T, n, d))
    grads = torch.empty_like(x), torch.empty_like(h_res), torch.empty_like(y), torch.empty_like(h_post)
    _call(library().mhc_post_mix_backward, x, h_res, y, h_post, grad, *grads, T, n, d)
    return grads


def _check_site_start(x, proj, alpha, bias) -> tuple:
    T, n, d = x.shape
    if n > MAX_SINKHORN_N:
        raise ValueError(f"the CPU site start takes n <= {MAX_SINKHORN_N}, got {n}")
    M = 2 * n + n * n
    _check(x, "x", (T, n, d))
    _check(proj, "proj", (T, M))
    _check(alpha, "alpha", (3,))
    _check(bias, "bias", (M,))
    return T, n, d


def site_start_forward(x, proj, alpha, bias, iters: int, rms_eps: float, hc_eps: float, lead: tuple | None = None):
    """A dynamic mHC site's coefficients and pre-mix from the projection ``proj = x.flatten(-2) @ phi``.

    ``x [T, n, d]``, ``proj [T, 2n + n*n]``, ``alpha [3]``, ``bias [2n + n*n]`` ->
    ``(x_in [T, d], h_pre [T, n], h_post [T, n], h_res [T, n, n], inv_rms [T])``:
    :meth:`mhc.coefficients.DynamicMHC.reference` and the pre-mix, with ``inv_rms`` the
    ``1 / RMS`` of each flattened token, which the backward takes. ``lead``: the leading dims of
    ``x_in``, ``h_post`` and ``h_res`` in place of ``T`` (their product ``T``), so that they are
    no views."""
    T, n, d = _check_site_start(x, proj, alpha, bias)
    lead = (T,) if lead is None else tuple(lead)
    if math.prod(lead) != T:
        raise ValueError(f"lead {lead} must hold the {T} tokens of x")
    x_in, h_post, h_res = x.new_empty(*lead, d), x.new_empty(*lead, n), x.new_empty(*lead, n, n)
    h_pre, inv_rms = x.new_empty(T, n), x.new_empty(T)
    _call(
        library().mhc_site_start_forward,
        x,
        proj,
        alpha,
        bias,
        x_in,
        h_pre,
        h_post,
        h_res,
        inv_rms,
        T,
        n,
        d,
        iters,
        rms_eps,
        hc_eps,
    )
    return x_in, h_pre, h_post, h_res, inv_rms


def site_start_backward(x, proj, alpha, bias, inv_rms, grad_x_in, grad_h_post, grad_h_res, iters, hc_eps):
    """The backward of :func:`site_start_forward` up to the matmuls, given ``grad_x_in [T, d]``,
    ``grad_h_post [T, n]`` and ``grad_h_res [T, n, n]`` (each ``None`` for a zero gradient) ->
    per token ``(grad_bias [T, M], grad_gates [T, 3], grad_proj [T, M], rms_coef [T])``: the
    gradients of the bias, the gates and ``proj``, and the factor of ``x`` in the norm's gradient.
    Summed over tokens, the first two are the bias's and ``alpha``'s gradients."""
    T, n, d = _check_site_start(x, proj, alpha, bias)
    _check(inv_rms, "inv_rms", (T,))
    for grad, name, shape in (
        (grad_x_in, "grad_x_in", (T, d)),
        (grad_h_post, "grad_h_post", (T, n)),
        (grad_h_res, "grad_h_res", (T, n, n)),
    ):
        if grad is not None:
            _check(grad, name, shape)
    M = proj.shape[1]
    outputs = tuple(x.new_empty(s) for s in ((T, M), (T, 3), (T, M), (T,)))
    _call(
        library().mhc_site_start_backward,
        x,
        proj,
        alpha,
        bias,
        inv_rms,
        grad_x_in,
        grad_h_post,
        grad_h_res,
        *outputs,
        T,
        n,
        d,
        iters,
        hc_eps,
    )
    return outputs  # grad_bias, grad_gates, grad_proj, rms_coef


def site_start_grad_x(grad_x, x, h_pre, grad_x_in, rms_coef) -> torch.Tensor:
    """``grad_x [T, n, d]`` (``grad_proj @ phi^T`` viewed as streams) ``+= rms_coef[t] x[t] +
    h_pre[t, s] grad_x_in[t]``, in place (``grad_x_in`` ``None``: zero); returns ``grad_x``."""
    T, n, d = x.shape
    _check(grad_x, "grad_x", (T, n, d))
    _check(x, "x", (T, n, d))
    _check(h_pre, "h_pre", (T, n))
    _check(rms_coef, "rms_coef", (T,))
    if grad_x_in is not None:
        _check(grad_x_in, "grad_x_in", (T, d))
    _call(library().mhc_site_start_grad_x, grad_x, x, h_pre, grad_x_in, rms_coef, T, n, d)
    return grad_x
