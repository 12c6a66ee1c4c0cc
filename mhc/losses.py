"""Fused linear + cross-entropy: ``cross_entropy(input @ W^T + b, target)`` without the ``[N, V]``
logits, as the functional :func:`linear_cross_entropy` and the module :class:`LinearCrossEntropy`.

Read top to bottom: input checks -> PyTorch chunked path -> autograd Function (either path) ->
functional -> module. The Triton kernels are in ``mhc.kernels.linear_cross_entropy``; both paths
compute the same three quantities (log-sum-exp and target logit forward, then per vocabulary chunk
``G = softmax - onehot`` and its two products backward), see ``docs/losses.md``.
"""

from __future__ import annotations

import torch
from torch import nn

from mhc.layer import BACKENDS, FLOAT_DTYPES

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

REDUCTIONS = ("mean", "sum", "none")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the PyTorch path's [N, chunk] logits buffer stays within this many bytes
TORCH_CHUNK_BYTES = 64 * 2**20


def _kernels():
    # Imported on first use so that CPU-only users of the torch backend never need Triton.
    import mhc.kernels.linear_cross_entropy

    return mhc.kernels


def _check_inputs(input, weight, target, bias, reduction, ignore_index, backend) -> None:
    for name, t in (("input", input), ("linear_weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"linear_bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if input.dim() < 1:
        raise ValueError("input must have shape [..., D], got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != input.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"linear_weight must have shape [V, D] with V >= 1 and D = input.shape[-1] = "
            f"{input.shape[-1]}, got {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(
            f"target must have shape input.shape[:-1] = {tuple(input.shape[:-1])}, got "
            f"{tuple(target.shape)} (input {tuple(input.shape)})"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear_bias must have shape [V] = [{weight.shape[0]}], got "
                         f"{tuple(bias.shape)}")
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    for name, t in (("linear_weight", weight), ("linear_bias", bias)):
        if t is not None and t.dtype != input.dtype:
            raise TypeError(f"{name} must have the input's dtype {input.dtype}, got {t.dtype}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    for name, t in (("linear_weight", weight), ("target", target), ("linear_bias", bias)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device}, input on {input.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    # one reduction and a host sync: PyTorch would index out of bounds (or assert on the device)
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bad.any():
        first = target[bad][0].item()
        raise ValueError(
            f"target holds class {first}, outside [0, {vocab}) and not ignore_index "
            f"({ignore_index})"
        )


def _resolve_backend(input: torch.Tensor, backend: str) -> str:
    if backend == "auto":
        return "triton" if input.is_cuda and input.dtype in KERNEL_DTYPES else "torch"
    if backend == "triton":
        if input.dtype not in KERNEL_DTYPES:
            raise ValueError(f"the Triton kernels take float16, bfloat16 or float32, got "
                             f"{input.dtype}; use backend='torch'")
        _kernels().check_device(input)
    return backend


# PyTorch path: the same passes as the kernels, one [N, chunk] block of logits at a time in fp32
# (fp64 for fp64 input). Signatures match lse_forward / grad_backward of the kernels.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torch_chunks(n_rows: int, vocab: int, element_size: int):
    width = max(1, min(vocab, TORCH_CHUNK_BYTES // max(1, n_rows * element_size)))
    for c0 in range(0, vocab, width):
        yield c0, min(vocab, c0 + width)


def _chunk_logits(x, weight, bias, c0, c1):
    logits = x @ weight[c0:c1].to(x.dtype).t()
    if bias is not None:
        logits += bias[c0:c1].to(x.dtype)
    return logits


def _target_in_chunk(target, c0, c1):
    """Whether each row's target is in ``[c0, c1)``, and its column there (0 where not)."""
    inside = (target >= c0) & (target < c1)
    return inside, torch.where(inside, target - c0, 0)


def torch_lse_forward(x, weight, bias, target):
    """Log-sum-exp of every row's logits and the target's logit (0 for out-of-range targets)."""
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    lse = torch.full((x.shape[0],), float("-inf"), device=x.device, dtype=compute)
    target_logit = torch.zeros(x.shape[0], device=x.device, dtype=compute)
    for c0, c1 in _torch_chunks(x.shape[0], weight.shape[0], xc.element_size()):
        logits = _chunk_logits(xc, weight, bias, c0, c1)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        inside, col = _target_in_chunk(target, c0, c1)
        picked = logits.gather(1, col[:, None]).squeeze(1)
        target_logit += torch.where(inside, picked, 0.0)
    return lse, target_logit


def torch_grad_backward(x, weight, bias, target, lse, row_scale, need_input, need_weight,
                        need_bias):
    """Gradients of ``sum_i row_scale[i] * loss_i`` for x, weight and bias (None where not needed)."""
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    scale = row_scale.to(compute)[:, None]
    grad_x = torch.zeros_like(xc) if need_input else None
    grad_w = torch.empty_like(weight) if need_weight else None
    grad_b = torch.empty_like(bias) if need_bias else None
    for c0, c1 in _torch_chunks(x.shape[0], weight.shape[0], xc.element_size()):
        probs = torch.exp(_chunk_logits(xc, weight, bias, c0, c1) - lse[:, None])
        inside, col = _target_in_chunk(target, c0, c1)
        g = probs.scatter_add_(1, col[:, None], -inside.to(compute)[:, None]).mul_(scale)
        if need_weight:
            grad_w[c0:c1] = g.t() @ xc
        if need_bias:
            grad_b[c0:c1] = g.sum(dim=0)
        if need_input:
            grad_x += g @ weight[c0:c1].to(compute)
    return (grad_x.to(x.dtype) if need_input else None), grad_w, grad_b


def _passes(backend: str):
    if backend == "torch":
        return torch_lse_forward, torch_grad_backward
    lce = _kernels().linear_cross_entropy
    return lce.lse_forward, lce.grad_backward


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``x [N, D]``, ``weight [V, D]``, ``bias [V] | None``, ``target [N]`` int64 -> loss.

    Saves the inputs and the ``[N]`` log-sum-exp; the backward recomputes the logits chunk by chunk.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, target, reduction, ignore_index, backend):
        lse_forward, _ = _passes(backend)
        lse, target_logit = lse_forward(x, weight, bias, target)
        valid = target != ignore_index
        losses = torch.where(valid, lse - target_logit, 0.0)
        if reduction == "none":
            loss = losses
        elif reduction == "sum":
            loss = losses.sum()
        else:  # an all-ignored batch gives 0 (PyTorch: NaN)
            loss = losses.sum() / valid.sum().clamp(min=1)
        ctx.save_for_backward(x, weight, bias, target, lse, valid)
        ctx.reduction = reduction
        ctx.backend = backend
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, bias, target, lse, valid = ctx.saved_tensors
        scale = grad_loss.to(lse.dtype) * valid
        if ctx.reduction == "mean":
            scale = scale / valid.sum().clamp(min=1)
        _, grad_backward = _passes(ctx.backend)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x, grad_w, grad_b = grad_backward(
            x, weight, bias, target, lse, scale, need_x, need_w, need_b and bias is not None
        )
        return grad_x, grad_w, grad_b, None, None, None, None


def _autocast(device_type, *tensors):
    """Cast floating fp16 / bf16 / fp32 tensors to the autocast dtype, as ``F.linear`` would."""
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in KERNEL_DTYPES else t
            for t in tensors]


@torch.compiler.disable
def _apply(x, weight, bias, target, reduction, ignore_index, backend):
    # host-side chunk loops and a host sync: torch.compile runs this op eagerly (a graph break)
    return LinearCrossEntropyFunction.apply(x, weight, bias, target, reduction, ignore_index,
                                            backend)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target)`` without the logits.

    Memory beyond the inputs and gradients is ``O(N)`` in the forward (the log-sum-exp) and a
    bounded ``[N, chunk]`` block plus an fp32 ``[N, D]`` input-gradient accumulator in the
    backward; the ``[N, V]`` logits never exist. Deterministic: bit-identical results run to run.

    Args:
        input: ``[..., D]`` float16 / bfloat16 / float32 / float64.
        linear_weight: ``[V, D]`` (the ``nn.Linear`` layout), the input's dtype.
        target: ``[...]`` (``input.shape[:-1]``) integer class indices in ``[0, V)`` or
            ``ignore_index``.
        linear_bias: ``[V]`` or None.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"`` (shape
            ``target.shape``).
        ignore_index: targets equal to it contribute neither loss nor gradient. A ``"mean"``
            over a batch in which every target is ignored is 0 with zero gradients (PyTorch
            returns NaN).
        backend: ``"auto"`` (Triton for fp16/bf16/fp32 CUDA tensors, PyTorch otherwise),
            ``"triton"`` (CUDA, or CPU with ``TRITON_INTERPRET=1``) or ``"torch"`` (chunked,
            any device; fp32 arithmetic, fp64 for fp64).

    Returns:
        The loss in the input's dtype: a scalar, or ``target.shape`` for ``"none"``. Arithmetic
        is fp32 (softmax, ``softmax - 1``, and the accumulation of both gradients) whatever
        the input dtype; under autocast, input, weight and bias are cast to the autocast dtype
        as ``F.linear`` would.
    """
    device_type = input.device.type if isinstance(input, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device_type):
        input, linear_weight, linear_bias = _autocast(device_type, input, linear_weight, linear_bias)
    _check_inputs(input, linear_weight, target, linear_bias, reduction, ignore_index, backend)
    backend = _resolve_backend(input, backend)
    vocab, dim = linear_weight.shape
    _check_targets(target, vocab, ignore_index)
    x = input.reshape(-1, dim).contiguous()
    t = target.reshape(-1).long()
    with torch.autocast(device_type=device_type, enabled=False):
        loss = _apply(x, linear_weight.contiguous(), linear_bias, t, reduction, ignore_index,
                      backend)
    return loss.view(target.shape) if reduction == "none" else loss


class LinearCrossEntropy(nn.Module):
    """Output projection and cross-entropy in one: ``forward(input [..., D], target [...])``.

    Owns the projection as an ``nn.Linear(in_features, num_classes, bias=bias)`` at ``.linear``
    (so a language model can use it as its head; ``.linear.weight`` can be tied to an
    embedding); the loss is :func:`linear_cross_entropy` of it.
    """

    def __init__(self, in_features: int, num_classes: int, *, bias: bool = False,
                 reduction: str = "mean", ignore_index: int = -100, backend: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        self.linear = nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.backend = backend

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            input, self.linear.weight, target, linear_bias=self.linear.bias,
            reduction=self.reduction, ignore_index=self.ignore_index, backend=self.backend,
        )

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"backend={self.backend!r}")
