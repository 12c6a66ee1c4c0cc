"""Fused linear + cross-entropy: ``cross_entropy(input @ W^T + b, target)`` without the ``[N, V]``
logits, as :func:`linear_cross_entropy` and :class:`LinearCrossEntropy`, with class weights, label
smoothing, a z-loss and logit soft-capping (``docs/losses.md``).

Read top to bottom: input checks -> PyTorch chunked path -> loss terms and autograd Function
(either path; the kernels are :mod:`mhc.kernels.linear_cross_entropy`) -> functional -> module.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from mhc._autocast import autocast_enabled, autocast_off
from mhc._autograd import refuse_double_backward
from mhc._checks import BACKENDS, FLOAT_DTYPES, check_no_transform
from mhc._compat import without_values
from mhc.ops.path import choose_loss

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

REDUCTIONS = ("mean", "sum", "none")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels read
DEFAULT_IGNORE_INDEX = -100  # PyTorch's, also where ignore_index=None is passed
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
        raise ValueError(f"linear_bias must have shape [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
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
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_number(name: str, value, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    above_low = low < value if low_open else low <= value
    if not (math.isfinite(value) and above_low and value <= high):
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high == math.inf else ']'}"
        raise ValueError(f"{name} must be a finite float in {bounds}, got {value}")
    return value


def _check_loss_options(class_weight, vocab, device, label_smoothing, lse_square_scale, softcap, return_z_loss):
    """Validates the options beyond plain cross-entropy; returns them as floats."""
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(class_weight).__name__}")
        if not class_weight.is_floating_point():
            raise TypeError(f"weight must be a floating-point tensor, got {class_weight.dtype}")
        if tuple(class_weight.shape) != (vocab,):
            raise ValueError(f"weight (class weights) must have shape [V] = [{vocab}], got {tuple(class_weight.shape)}")
        if class_weight.device != device:
            raise ValueError(f"weight is on {class_weight.device}, input on {device}")
        if class_weight.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "weight (class weights) requires grad: the loss is not differentiable with "
                "respect to the class weights (neither is F.cross_entropy); pass weight.detach()"
            )
    label_smoothing = _check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    lse_square_scale = _check_number("lse_square_scale", lse_square_scale, low=0.0)
    if softcap is not None:
        softcap = _check_number("softcap", softcap, low=0.0, low_open=True)
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"return_z_loss must be a bool, got {type(return_z_loss).__name__}")
    return label_smoothing, lse_square_scale, softcap


def _target_check(target: torch.Tensor, vocab: int, ignore_index: int):
    """Queues the range check of the targets and returns a function that raises ``ValueError`` for a
    target outside ``[0, vocab)`` that is not ``ignore_index``; call it once the forward pass is queued,
    so the GPU is not left idle. Meta and fake tensors are not checked."""
    if without_values(target):  # a meta or fake tensor: no values to check
        return lambda: None
    from mhc.kernels._host import read_later  # the kernel package, imported on first use

    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    any_bad = read_later(bad.any())

    def raise_if_bad():
        if any_bad():
            first = target[bad][0].item()
            raise ValueError(f"target holds class {first}, outside [0, {vocab}) and not ignore_index ({ignore_index})")

    return raise_if_bad


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


def torch_lse_forward(x, weight, bias, target, *, class_weight=None, smoothing=False, softcap=None):
    """Per row: log-sum-exp of the (soft-capped) logits, the target's logit (0 for out-of-range
    targets) and with ``smoothing`` the class-weighted logit sum (None without)."""
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    lse = torch.full((x.shape[0],), float("-inf"), device=x.device, dtype=compute)
    target_logit = torch.zeros(x.shape[0], device=x.device, dtype=compute)
    smooth_sum = torch.zeros_like(target_logit) if smoothing else None
    for c0, c1 in _torch_chunks(x.shape[0], weight.shape[0], xc.element_size()):
        logits = _chunk_logits(xc, weight, bias, c0, c1)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        inside, col = _target_in_chunk(target, c0, c1)
        picked = logits.gather(1, col[:, None]).squeeze(1)
        target_logit += torch.where(inside, picked, 0.0)
        if smoothing:
            weighted = logits if class_weight is None else logits * class_weight[c0:c1]
            smooth_sum += weighted.sum(dim=1)
    return lse, target_logit, smooth_sum


def torch_grad_backward(
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
    """Gradients for x, weight and bias (None where not needed); the logits' gradient is
    ``prob_scale * softmax - target_scale * onehot - smooth_scale * class_weight`` per row.
    No host reads (``capturable`` changes nothing here)."""
    compute = _compute_dtype(x.dtype)
    xc = x.to(compute)
    prob_scale, target_scale = prob_scale.to(compute)[:, None], target_scale.to(compute)
    grad_x = torch.zeros_like(xc) if need_input else None
    grad_w = torch.empty_like(weight) if need_weight else None
    grad_b = torch.empty_like(bias) if need_bias else None
    for c0, c1 in _torch_chunks(x.shape[0], weight.shape[0], xc.element_size()):
        logits = _chunk_logits(xc, weight, bias, c0, c1)
        if softcap is not None:
            capped = torch.tanh(logits / softcap)
            logits = softcap * capped
        g = torch.exp(logits - lse[:, None]).mul_(prob_scale)
        inside, col = _target_in_chunk(target, c0, c1)
        g.scatter_add_(1, col[:, None], -(inside * target_scale)[:, None])
        if smooth_scale is not None:
            smooth = smooth_scale.to(compute)[:, None]
            g -= smooth if class_weight is None else smooth * class_weight[c0:c1]
        if softcap is not None:
            g *= 1.0 - capped * capped
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


# The loss from the per-row quantities of the forward pass, and the per-row coefficients of the
# logits' gradient for the backward (docs/losses.md derives both). Row i, logits z (soft-capped),
# target y, class weights w (all ones without), smoothing e, z-loss scale k, V classes:
#
#   ce_i = (1 - e) w_y (lse - z_y) + (e / V) (sum_c w_c lse - sum_c w_c z_c),   z_i = k lse^2


@dataclasses.dataclass(frozen=True)
class LossOptions:
    reduction: str = "mean"
    ignore_index: int = DEFAULT_IGNORE_INDEX
    label_smoothing: float = 0.0
    lse_square_scale: float = 0.0
    softcap: float | None = None
    capturable: bool = False


def _target_weights(target, valid, class_weight, dtype):
    """``w_y`` per row, 0 on ignored rows (1 on the others without class weights)."""
    if class_weight is None:
        return valid.to(dtype)
    # clamped: with capturable=True the targets' range is not checked, and no index may leave it
    index = torch.where(valid, target, 0).clamp(0, class_weight.shape[0] - 1)
    return torch.where(valid, class_weight[index], 0.0)


def _divisors(reduction, target_weight, valid):
    """What ``mean`` divides the cross-entropy and the z-loss sums by: the summed target weights
    and the number of non-ignored rows (1 where either is 0: the loss is then the sum, 0 when
    every target is ignored). 1 and 1 for the other reductions."""
    if reduction != "mean":
        return 1.0, 1.0
    weight_sum = target_weight.sum()
    return torch.where(weight_sum == 0, 1.0, weight_sum), valid.sum().clamp(min=1)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """``x [N, D]``, ``weight [V, D]``, ``bias [V] | None``, ``target [N]`` int64, class weights
    ``[V] | None`` (compute dtype) -> (loss, z-loss), both reduced as ``options.reduction``.

    Saves the inputs and ``[N]`` per-row scalars; the backward recomputes the logits chunk by
    chunk."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, class_weight, options, backend):
        lse_forward, _ = _passes(backend)
        smoothing = options.label_smoothing > 0
        if not options.capturable:
            check_targets = _target_check(target, weight.shape[0], options.ignore_index)
        lse, target_logit, smooth_sum = lse_forward(
            x, weight, bias, target, class_weight=class_weight, smoothing=smoothing, softcap=options.softcap
        )
        if not options.capturable:
            check_targets()  # before the class weights are indexed by target
        valid = target != options.ignore_index
        target_weight = _target_weights(target, valid, class_weight, lse.dtype)
        ce = target_weight * (lse - target_logit)
        if smoothing:
            e, vocab = options.label_smoothing, weight.shape[0]
            total_weight = vocab if class_weight is None else class_weight.sum()
            ce = (1 - e) * ce + (e / vocab) * (total_weight * lse - smooth_sum)
        ce = torch.where(valid, ce, 0.0)
        z = torch.where(valid, options.lse_square_scale * lse.square(), 0.0)
        ce_div, z_div = _divisors(options.reduction, target_weight, valid)
        if options.reduction == "none":
            loss, z_loss = ce + z, z
        else:
            z_loss = z.sum() / z_div
            loss = ce.sum() / ce_div + z_loss
        ctx.save_for_backward(x, weight, bias, target, class_weight, lse, target_weight, valid)
        ctx.options, ctx.backend = options, backend
        ctx.set_materialize_grads(False)
        return loss.to(x.dtype), z_loss.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_loss, grad_z_loss):
        refuse_double_backward(
            "linear_cross_entropy", "F.cross_entropy(F.linear(input, linear_weight), target) has one"
        )
        x, weight, bias, target, class_weight, lse, target_weight, valid = ctx.saved_tensors
        options = ctx.options
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_loss is None and grad_z_loss is None:
            return None, None, None, None, None, None, None
        zero = torch.zeros((), device=lse.device, dtype=lse.dtype)
        grad_loss = zero if grad_loss is None else grad_loss.to(lse.dtype)
        grad_z_loss = zero if grad_z_loss is None else grad_z_loss.to(lse.dtype)
        # upstream gradient of each row's ce_i and z_i (the loss holds both)
        ce_div, z_div = _divisors(options.reduction, target_weight, valid)
        grad_ce = grad_loss / ce_div * valid
        grad_z = (grad_loss + grad_z_loss) / z_div * valid
        e, vocab = options.label_smoothing, weight.shape[0]
        target_scale = grad_ce * (1 - e) * target_weight
        prob_scale = target_scale
        smooth_scale = None
        if e > 0:
            total_weight = vocab if class_weight is None else class_weight.sum()
            prob_scale = prob_scale + grad_ce * (e / vocab) * total_weight
            smooth_scale = grad_ce * (e / vocab)
        if options.lse_square_scale > 0:
            prob_scale = prob_scale + grad_z * (2 * options.lse_square_scale) * lse
        _, grad_backward = _passes(ctx.backend)
        scales = (prob_scale.contiguous(), target_scale.contiguous(), smooth_scale)
        needs = (need_x, need_w, need_b and bias is not None)
        keywords = dict(class_weight=class_weight, softcap=options.softcap, capturable=options.capturable)
        grad_x, grad_w, grad_b = grad_backward(x, weight, bias, target, lse, *scales, *needs, **keywords)
        return grad_x, grad_w, grad_b, None, None, None, None


def _autocast(device_type, *tensors):
    """Cast floating fp16 / bf16 / fp32 tensors to the autocast dtype, as ``F.linear`` would."""
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in KERNEL_DTYPES else t for t in tensors]


@torch.compiler.disable
def _apply(x, weight, bias, target, class_weight, options, backend):
    # host-side chunk loops and a host sync: torch.compile runs this op eagerly (a graph break)
    return LinearCrossEntropyFunction.apply(x, weight, bias, target, class_weight, options, backend)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    backend: str = "auto",
    capturable: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    label_smoothing=label_smoothing)`` without the logits, plus a z-loss and logit soft-capping.

    Memory beyond the inputs and gradients is ``O(N)`` in the forward (per-row scalars) and a
    bounded ``[N, chunk]`` block plus an fp32 ``[N, D]`` input-gradient accumulator in the
    backward; the ``[N, V]`` logits never exist. Deterministic: bit-identical results run to run.

    Args:
        input: ``[..., D]`` float16 / bfloat16 / float32 / float64.
        linear_weight: ``[V, D]`` (the ``nn.Linear`` layout), the input's dtype.
        target: ``[...]`` (``input.shape[:-1]``) integer class indices in ``[0, V)`` or
            ``ignore_index``.
        linear_bias: ``[V]`` or None.
        weight: ``[V]`` class weights (any floating dtype, used in fp32; fp64 for fp64 input) or
            None, as ``F.cross_entropy``'s ``weight``: row i's loss is scaled by
            ``weight[target_i]`` and ``mean`` divides by the summed weights of the non-ignored
            targets; label smoothing weights class c's term by ``weight[c]``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (shape ``target.shape``).
        ignore_index: targets equal to it contribute neither loss nor gradient; None means
            -100, as in PyTorch. A ``"mean"`` whose divisor is 0 (every target ignored, or all
            their weights 0) is the sum: 0 with zero gradients when every target is ignored
            (PyTorch returns NaN).
        label_smoothing: in ``[0, 1]``, PyTorch's definition: the target distribution is
            ``(1 - label_smoothing) onehot + label_smoothing / V``.
        lse_square_scale: z-loss coefficient (PaLM): adds ``lse_square_scale * logsumexp(z)^2``
            per non-ignored row, reduced like the loss but never class-weighted (``mean``
            divides it by the number of non-ignored rows). 0 (default) adds nothing.
        softcap: None, or a positive float: the logits become ``softcap * tanh(z / softcap)``
            before the softmax (Gemma 2). Applies to every term above.
        return_z_loss: also return the z-loss term (already included in the loss) for logging;
            it is differentiable.
        backend: ``"auto"`` (Triton for fp16/bf16/fp32 CUDA tensors, PyTorch otherwise),
            ``"triton"`` (CUDA, or CPU with ``TRITON_INTERPRET=1``) or ``"torch"`` (chunked,
            any device; fp32 arithmetic, fp64 for fp64).
        capturable: no host reads, so that a training step can be captured in a CUDA graph
            (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``). The targets'
            range is then not checked (a target outside ``[0, V)`` that is not ``ignore_index``
            gives an undefined loss instead of a ``ValueError``), and the gradient's scale is
            applied on the device after the products rather than as their ``alpha`` (one more
            pass over ``dW``, and one more rounding of it in the weight dtype).

    Returns:
        The loss in the input's dtype: a scalar, or ``target.shape`` for ``"none"``; with
        ``return_z_loss`` a pair ``(loss, z_loss)`` of that shape. Arithmetic is fp32 (softmax,
        its gradient and the accumulation of both gradients) whatever the input dtype; under
        autocast, input, weight and bias are cast to the autocast dtype as ``F.linear`` would."""
    check_no_transform(
        "linear_cross_entropy", "compute F.cross_entropy(F.linear(input, linear_weight, linear_bias), target)"
    )
    device_type = input.device.type if isinstance(input, torch.Tensor) else "cpu"
    if autocast_enabled(device_type):
        input, linear_weight, linear_bias = _autocast(device_type, input, linear_weight, linear_bias)
    if ignore_index is None:
        ignore_index = DEFAULT_IGNORE_INDEX
    _check_inputs(input, linear_weight, target, linear_bias, reduction, ignore_index, backend)
    vocab, dim = linear_weight.shape
    label_smoothing, lse_square_scale, softcap = _check_loss_options(
        weight, vocab, input.device, label_smoothing, lse_square_scale, softcap, return_z_loss
    )
    backend = choose_loss(backend, input)
    x = input.reshape(target.numel(), dim).contiguous()
    t = target.reshape(-1).long()
    class_weight = None if weight is None else weight.to(_compute_dtype(x.dtype)).contiguous()
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
    options = LossOptions(reduction, ignore_index, label_smoothing, lse_square_scale, softcap, capturable)
    with autocast_off(device_type):
        loss, z_loss = _apply(x, linear_weight.contiguous(), linear_bias, t, class_weight, options, backend)
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss


class LinearCrossEntropy(nn.Module):
    """Output projection and cross-entropy in one: ``forward(input [..., D], target [...])``.

    Owns the projection as an ``nn.Linear(in_features, num_classes, bias=bias)`` at ``.linear``
    (so a language model can use it as its head; ``.linear.weight`` can be tied to an
    embedding); the loss is :func:`linear_cross_entropy` of it with the options given here.
    ``weight`` (class weights ``[num_classes]``) is kept as a buffer, as in
    ``nn.CrossEntropyLoss``. ``forward`` returns ``(loss, z_loss)`` with ``return_z_loss``."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        bias: bool = False,
        weight: torch.Tensor | None = None,
        reduction: str = "mean",
        ignore_index: int = DEFAULT_IGNORE_INDEX,
        label_smoothing: float = 0.0,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
        backend: str = "auto",
        capturable: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
        self.label_smoothing, self.lse_square_scale, self.softcap = _check_loss_options(
            weight,
            num_classes,
            weight.device if weight is not None else None,
            label_smoothing,
            lse_square_scale,
            softcap,
            return_z_loss,
        )
        self.linear = nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.return_z_loss = return_z_loss
        self.backend = backend
        self.capturable = capturable

    def forward(self, input: torch.Tensor, target: torch.Tensor):
        return linear_cross_entropy(
            input,
            self.linear.weight,
            target,
            linear_bias=self.linear.bias,
            weight=self.weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale,
            softcap=self.softcap,
            return_z_loss=self.return_z_loss,
            backend=self.backend,
            capturable=self.capturable,
        )

    def extra_repr(self) -> str:
        extras = [f"reduction={self.reduction!r}", f"ignore_index={self.ignore_index}"]
        if self.label_smoothing:
            extras.append(f"label_smoothing={self.label_smoothing}")
        if self.lse_square_scale:
            extras.append(f"lse_square_scale={self.lse_square_scale}")
        if self.softcap is not None:
            extras.append(f"softcap={self.softcap}")
        return ", ".join(extras + [f"backend={self.backend!r}"])
