"""Sinkhorn-Knopp as PyTorch ops: ``torch.library`` ops over the Triton kernels, their autograd
Function, the reference path's Functions, and the functional :func:`sinkhorn`
(:class:`mhc.layer.FusedMHC` is its module).

Read top to bottom: input checks -> Triton path (ops, autograd Function) -> PyTorch reference
path -> functional.
"""

from __future__ import annotations

import torch

from mhc import reference
from mhc._autocast import autocast_off
from mhc._checks import FLOAT_DTYPES, MAX_N, check_no_transform, check_settings
from mhc._compat import is_dtensor, through_ops, transforms_active
from mhc.ops.library import kernel_op, kernels
from mhc.ops.path import choose
from mhc.ops.sharding import on_local_shards

__all__ = ["sinkhorn", "SinkhornFunction", "sinkhorn_bwd_launch", "MAX_N"]


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must have shape [..., n, n], got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have n >= 1, got n = 0")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")


# Triton path. The launchers are registered as torch.library ops (mhc.ops.library: triton_op, whose
# kernels the compiled graph launches itself) so that torch.compile (fullgraph=True) and
# torch.export trace through SinkhornFunction; in eager mode the Function calls the launchers
# directly, since the op wrappers cost more than the kernels at realistic sizes. Inputs are
# [T, n, n]; outputs have the input's dtype.


def _like_first(first, *rest):
    return first.new_empty(first.shape)


@kernel_op("mhc::sinkhorn_fwd", _like_first)
def _sinkhorn_fwd_op(logits: torch.Tensor, iters: int) -> torch.Tensor:
    return kernels().sinkhorn_fwd(logits, iters)


@kernel_op("mhc::sinkhorn_bwd", _like_first)
def _sinkhorn_bwd_op(logits: torch.Tensor, grad_out: torch.Tensor, iters: int) -> torch.Tensor:
    return kernels().sinkhorn_bwd(logits, grad_out, iters)


@kernel_op("mhc::sinkhorn_implicit_bwd", _like_first)
def _sinkhorn_implicit_bwd_op(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    return kernels().sinkhorn_implicit_bwd(out, grad_out)


@kernel_op("mhc::sinkhorn_eps_fwd", _like_first)
def _sinkhorn_eps_fwd_op(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return kernels().sinkhorn_eps_fwd(logits, iters, eps)


@kernel_op("mhc::sinkhorn_eps_bwd", _like_first)
def _sinkhorn_eps_bwd_op(logits: torch.Tensor, grad_out: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return kernels().sinkhorn_eps_bwd(logits, grad_out, iters, eps)


def sinkhorn_launchers(x: torch.Tensor):
    """``(forward, exact backward, implicit backward, eps forward, eps backward)`` for inputs like
    ``x``: the kernels' launchers in eager mode, the registered ops while ``torch.compile`` traces,
    a dispatch mode watches or ``x`` is a ``DTensor`` (:func:`mhc._compat.through_ops`)."""
    if through_ops(x):
        ops = torch.ops.mhc
        return ops.sinkhorn_fwd, ops.sinkhorn_bwd, ops.sinkhorn_implicit_bwd, ops.sinkhorn_eps_fwd, ops.sinkhorn_eps_bwd
    k = kernels()
    # the backwards without argument checks: autograd hands them what their forward saved and a
    # gradient of the output's shape, dtype and device
    return (
        k.sinkhorn_fwd,
        k.sinkhorn.sinkhorn_bwd_unchecked,
        k.sinkhorn_implicit.sinkhorn_implicit_bwd_unchecked,
        k.sinkhorn_eps_fwd,
        k.sinkhorn_eps.sinkhorn_eps_bwd_unchecked,
    )


def sinkhorn_bwd_launch(saved: torch.Tensor, grad_out: torch.Tensor, iters: int, backward: str, eps: float):
    """The backward matching :class:`SinkhornFunction`'s forward: ``saved`` is the logits for the
    exact backward, the output for the implicit one."""
    _, bwd, implicit_bwd, _, eps_bwd = sinkhorn_launchers(saved)
    if eps > 0:
        return eps_bwd(saved, grad_out, iters, eps)
    if backward == "exact":
        return bwd(saved, grad_out, iters)
    return implicit_bwd(saved, grad_out)


class SinkhornFunction(torch.autograd.Function):
    """Triton Sinkhorn with its exact or implicit backward. ``[T, n, n]`` -> ``[T, n, n]``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int, backward: str, eps: float) -> torch.Tensor:
        fwd, _, _, eps_fwd, _ = sinkhorn_launchers(logits)
        out = fwd(logits, iters) if eps == 0 else eps_fwd(logits, iters, eps)
        # exact: only the input, every iterate is recomputed; implicit: only the output
        ctx.save_for_backward(logits if backward == "exact" else out)
        ctx.iters, ctx.backward_mode, ctx.eps = iters, backward, eps
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (saved,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate again
            grad = differentiable_backward(saved, grad_out, ctx.iters, ctx.backward_mode, ctx.eps)
        else:
            grad = sinkhorn_bwd_launch(saved, grad_out, ctx.iters, ctx.backward_mode, ctx.eps)
        return grad, None, None, None


def differentiable_backward(saved: torch.Tensor, grad_out: torch.Tensor, iters: int, backward: str, eps: float):
    """The gradient :func:`sinkhorn_bwd_launch` computes, as PyTorch ops on the reference
    formulation (fp32, fp64 for fp64), so that it carries a graph for double backward: the exact
    backward differentiates the unrolled iterations, the implicit one is
    :func:`mhc.reference.sinkhorn_implicit_backward` at the saved output."""
    compute = torch.float64 if saved.dtype == torch.float64 else torch.float32
    if backward == "implicit":
        return reference.sinkhorn_implicit_backward(saved.to(compute), grad_out.to(compute)).to(saved.dtype)
    logits = saved.to(compute)
    out = reference.sinkhorn_loop(logits, iters, eps)
    (grad,) = torch.autograd.grad(out, saved, grad_out.to(compute), create_graph=True)
    return grad


# PyTorch path: the reference formulation under autograd (exact), or with the implicit backward.


class _TorchImplicit(torch.autograd.Function):
    """The reference Sinkhorn forward with the implicit backward (:func:`mhc.reference.sinkhorn_implicit_backward`,
    PyTorch ops on the saved output). Double backward differentiates those ops, the output through
    this Function's own implicit backward. ``[..., n, n]`` -> ``[..., n, n]``."""

    @staticmethod
    def forward(ctx, logits, iters):
        if torch.compiler.is_compiling():
            out = reference.sinkhorn_stable(logits, iters)
        else:  # tokens contiguous, as in _TorchExact
            out = _tokens_first(reference.sinkhorn_stable(_tokens_last(logits), iters, dims=(0, 1)))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (out,) = ctx.saved_tensors
        return reference.sinkhorn_implicit_backward(out, grad_out), None


class _TorchExact(torch.autograd.Function):
    """The reference with its exact backward written out, on ``[n, n, tokens]`` (tokens contiguous):
    the forward keeps each step's divisors, the backward walks the steps in reverse
    (:func:`mhc.reference.sinkhorn_exact_backward`); double backward differentiates the loop."""

    @staticmethod
    def forward(ctx, logits, iters, eps):
        ctx.iters, ctx.eps = iters, eps
        out, first_row, cols, rows = reference.sinkhorn_divisors(_tokens_last(logits), iters, eps, dims=(0, 1))
        ctx.save_for_backward(logits, out, first_row, cols, rows)
        return _tokens_first(out)

    @staticmethod
    def backward(ctx, grad_out):
        logits, *kept = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True
            return differentiable_backward(logits, grad_out, ctx.iters, "exact", ctx.eps), None, None
        out, first_row, cols, rows = kept
        grad = reference.sinkhorn_exact_backward(
            _tokens_last(logits), out, first_row, cols, rows, _tokens_last(grad_out), ctx.eps, dims=(0, 1)
        )
        return _tokens_first(grad), None, None


def _tokens_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim((-2, -1), (0, 1)).contiguous()


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim((0, 1), (-2, -1)).contiguous()


def _sinkhorn_torch(logits: torch.Tensor, iters: int, backward: str, eps: float = 0.0) -> torch.Tensor:
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    with autocast_off(logits.device.type):
        x = logits.to(compute)
        if backward == "implicit":
            check_no_transform("the implicit backward (backward='implicit')")
            out = _TorchImplicit.apply(x, iters)
        elif torch.compiler.is_compiling() or transforms_active():  # autograd differentiates the loop itself
            out = reference.sinkhorn_loop(x, iters, eps)
        else:
            out = _TorchExact.apply(x, iters, eps)
    return out.to(logits.dtype)


def sinkhorn(
    logits: torch.Tensor, iters: int = 20, backward: str = "exact", backend: str = "auto", eps: float = 0.0
) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of ``exp(logits)`` into doubly stochastic matrices.

    Each of the ``iters`` iterations divides every column by its sum, then every row by its sum
    (the mHC paper's order), so rows sum to one exactly and columns approach one as ``iters``
    grows. Subtracting a constant from a row, a column or the whole matrix leaves the result
    unchanged. Robust for any finite logits (the first iteration runs in the log domain).

    Args:
        logits: ``[..., n, n]`` float16 / bfloat16 / float32 / float64, any strides, any number
            of leading dims (none included). Arithmetic is fp32 (fp64 for fp64 input), autocast
            is disabled inside.
        iters: iterations, >= 1 (the paper uses 20).
        backward: ``"exact"`` is the gradient of the ``iters``-step computation (autograd through
            the unrolled loop, recomputed on chip by the kernel; only the logits are saved).
            ``"implicit"`` differentiates the fixed point at the computed output, corrected for a
            non-converged output (saves the output); close to exact only once the forward has
            converged: see ``docs/sinkhorn.md``.
        backend: ``"auto"`` (Triton on CUDA tensors with n <= 64, PyTorch otherwise),
            ``"triton"`` (CUDA, or CPU with ``TRITON_INTERPRET=1``; n <= 64, else a ValueError)
            or ``"torch"``.
        eps: ``0`` (default) is the paper's iteration. ``eps > 0`` is DeepSeek-V4's: ``eps`` is
            added to every entry after the first (column) softmax and to every row and column
            sum the iteration divides by, so rows sum to ``1 - O(eps)`` rather than exactly one
            (:func:`mhc.reference.sinkhorn_eps`). Exact backward only; ``n <= 16`` on the kernels.

    Returns:
        ``[..., n, n]`` doubly stochastic matrices, same dtype as ``logits``, contiguous.

    Non-finite logits act per matrix, on both backends and in both backwards: a NaN anywhere in a
    matrix makes that whole matrix (and its gradient) NaN, as in ``torch.softmax``; so does a
    ``+inf`` logit, and a row or column that is all ``-inf`` (no doubly stochastic matrix has a zero
    row). A single ``-inf`` entry is a structural zero: the result is finite, with 0 there. Other
    matrices of the batch are unaffected. Details and tests: ``docs/sinkhorn.md``."""
    _check_logits(logits)
    eps = check_settings(iters, backward, backend, eps)
    backend = choose(backend, logits, "sinkhorn" if eps == 0 else "sinkhorn_eps", logits.shape[-1])
    if is_dtensor(logits):  # one Sinkhorn per matrix: on each rank's matrices
        return on_local_shards(lambda m: sinkhorn(m, iters, backward, backend, eps), logits, block_dims=2)
    if backend == "torch":
        return _sinkhorn_torch(logits, iters, backward, eps)
    n = logits.shape[-1]
    return SinkhornFunction.apply(logits.reshape(-1, n, n), iters, backward, eps).view(logits.shape)
