"""Stream mixing: ``HyperConnection`` (mHC and plain HC), ``LaneMixer``, stream helpers and the
paper's stability metric.

Axis legend (einops):
    ...   leading dims (batch, tokens; any number)
    s     source stream / lane
    t     target stream / lane
    d     channels (``dim``)

``HyperConnection`` is a thin module: its parameters and initialisation live here, where its
coefficients come from in :mod:`mhc.coefficients`, and which path runs it (fused kernels or the
PyTorch reference) and how one site hands over to the next in :mod:`mhc.sites`. Coefficients are
computed in fp32 whatever the activation dtype (fp64 when the activations or the parameters are
fp64); the mixing itself runs in the activation dtype. ``docs/mixing.md`` gives the equations and
the initialisation choices.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from einops import rearrange, repeat
from torch import nn

from mhc._checks import (
    MAX_STREAMS,
    check_floating,
    check_local,
    check_operand,
    check_same_device,
    check_settings,
    check_streams_shape,
)
from mhc._local import assign, local_parameters
from mhc.coefficients import biases, coefficient_dtype, rms_inverse, source_for
from mhc.layer import sinkhorn
from mhc.mixing_ops import post_mix, pre_mix
from mhc.sites import Site, layer_backend

__all__ = [
    "HyperConnection",
    "LaneMixer",
    "StreamCollapse",
    "stream_collapse",
    "StreamExpand",
    "expand_streams",
    "reduce_streams",
    "GainReport",
    "amax_gain",
    "collect_h_res",
    "MAX_STREAMS",
]

MAX_FUSED_STREAMS = MAX_STREAMS  # the former name of MAX_STREAMS

CONSTRAINTS = ("sinkhorn", "none")
INITS = ("residual", "zero")
REDUCTIONS = ("mean", "sum")
# RMS epsilon of the coefficient projection. The paper prints 1e-20, for which the gradient of a
# zero token is ~1e10 |a| |phi|; 1e-6 bounds it by 1e3 |a| |phi| (docs/mixing.md, "Zero and tiny tokens").
DEFAULT_RMS_EPS = 1e-6


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_rms_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"rms_eps must be a float, got {type(eps).__name__}")
    if not (0.0 < eps < math.inf):
        raise ValueError(f"rms_eps must be a finite float > 0, got {eps}")
    return float(eps)


# ------------------------------------------------------------------------------ stream helpers


def expand_streams(h: torch.Tensor, n_streams: int, embedding: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., dim] -> [..., n, dim]``: ``n`` copies of ``h``, plus ``embedding [n, dim]`` if given.

    Without ``embedding`` the result is a stride-0 view of ``h`` (no copy); the fused layers copy
    it once where it enters them."""
    _positive_int(n_streams, "n_streams")
    check_floating(h, "h")
    if h.dim() < 1:
        raise ValueError("h must have shape [..., dim], got a 0-d tensor")
    if embedding is not None:
        check_operand(embedding, ((n_streams, h.shape[-1]),), "embedding", h.device, "h")
    x = repeat(h, "... d -> ... s d", s=n_streams)
    if embedding is not None:
        x = x + embedding.to(h.dtype)
    return x


def reduce_streams(x: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """``[..., n, dim] -> [..., dim]`` by ``"mean"`` or ``"sum"`` over the streams."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    check_floating(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., n, dim], got {tuple(x.shape)}")
    return x.mean(dim=-2) if reduce == "mean" else x.sum(dim=-2)


class StreamExpand(nn.Module):
    """``expand_streams`` with a learned per-stream embedding ``[n, dim]`` (initialised to zero)."""

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(self, n_streams: int, dim: int):
        super().__init__()
        self.n_streams = _positive_int(n_streams, "n_streams")
        self.embedding = nn.Parameter(torch.zeros(n_streams, _positive_int(dim, "dim")))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero embeddings (DTensor parameters too, see :meth:`HyperConnection.reset_parameters`)."""
        assign(self.embedding, torch.zeros(self.embedding.shape, dtype=self.embedding.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        check_local(h, self)
        (embedding,) = local_parameters(self, (self.embedding,))
        return expand_streams(h, self.n_streams, embedding)


def collapse_weights(
    x: torch.Tensor, phi: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rms_eps: float, eps: float = 0.0
) -> torch.Tensor:
    """``h = sigmoid(a * (v @ phi) / RMS(v) + b) + eps``, ``[..., n]`` in fp32 (fp64 for fp64 inputs),
    for streams ``x [..., n, dim]`` flattened to ``v [..., n*dim]``; ``phi [n*dim, n]``."""
    dtype = coefficient_dtype(x, phi)
    v = rearrange(x.to(dtype), "... s d -> ... (s d)")
    return torch.sigmoid(a.to(dtype) * ((v @ phi.to(dtype)) * rms_inverse(v, rms_eps)) + b.to(dtype)) + eps


def stream_collapse(
    x: torch.Tensor,
    phi: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rms_eps: float = DEFAULT_RMS_EPS,
    eps: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Learned per-token collapse of the streams, DeepSeek-V4's head: ``x [..., n, dim] -> [..., dim]``,
    ``out = sum_s h[..., s] x[..., s, :]`` with ``h`` from :func:`collapse_weights`; ``phi [n*dim, n]``,
    ``a [1]`` (or 0-d), ``b [n]``, any float dtype, on ``x``'s device.

    The weights come from PyTorch ops in fp32 (one projection per token, ``n`` columns); the
    weighted sum runs on the fused mixing kernel (``backend="triton"``, or ``"auto"`` on CUDA for
    ``n <= 16``) or in fp32 PyTorch ops (``"torch"``), and is returned in ``x``'s dtype.
    """
    check_streams_shape(x, x.shape[-2] if x.dim() >= 2 else 1, None, "x")
    n, dim = x.shape[-2], x.shape[-1]
    check_operand(phi, ((n * dim, n),), "phi", x.device)
    check_operand(a, ((), (1,)), "a", x.device)
    check_operand(b, ((n,),), "b", x.device)
    rms_eps = _check_rms_eps(rms_eps)
    eps = check_settings(1, "exact", backend, eps)
    h = collapse_weights(x, phi, a, b, rms_eps, eps)
    if layer_backend(x, n, backend) == "triton":
        return pre_mix(x, h.reshape(-1, n).float())[0]
    return (h.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


class StreamCollapse(nn.Module):
    """Learned per-token collapse of ``n`` streams into one (DeepSeek-V4's ``hc_head``):
    ``forward(x [..., n, dim]) -> [..., dim]``, ``sum_s h[s] x[s]`` with
    ``h = sigmoid(a_pre * (v @ phi) / RMS(v) + b_pre) + eps`` from the flattened token ``v``.

    Starts as the mean of the streams (``phi = 0``, ``sigmoid(b_pre) = 1/n``), where
    :func:`reduce_streams` stays. ``eps`` is DeepSeek-V4's ``hc_eps`` (default 0).
    ``weights(x) -> [..., n]`` (fp32). See :func:`stream_collapse` for the paths.
    """

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(
        self, dim: int, n_streams: int, rms_eps: float = DEFAULT_RMS_EPS, eps: float = 0.0, backend: str = "auto"
    ):
        super().__init__()
        self.dim = _positive_int(dim, "dim")
        self.n_streams = n = _positive_int(n_streams, "n_streams")
        self.rms_eps = _check_rms_eps(rms_eps)
        self.eps = check_settings(1, "exact", backend, eps)
        self.backend = backend
        self.phi = nn.Parameter(torch.empty(n * dim, n))
        self.a_pre = nn.Parameter(torch.empty(1))
        self.b_pre = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The mean of the streams (DTensor parameters too, see :meth:`HyperConnection.reset_parameters`)."""
        n = self.n_streams
        assign(self.phi, torch.zeros(self.phi.shape, dtype=self.phi.dtype))
        assign(self.a_pre, torch.full((1,), 0.01, dtype=self.a_pre.dtype))
        assign(self.b_pre, torch.full((n,), -math.log(n - 1) if n > 1 else 20.0, dtype=self.b_pre.dtype))

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        check_streams_shape(x, self.n_streams, self.dim, "x")
        check_local(x, self)
        check_same_device(x, self.phi.device, "x", "the layer's parameters")
        return collapse_weights(x, *self._parameters_for_ops(), self.rms_eps, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_streams_shape(x, self.n_streams, self.dim, "x")
        check_local(x, self)
        return stream_collapse(x, *self._parameters_for_ops(), self.rms_eps, self.eps, self.backend)

    def _parameters_for_ops(self):
        return local_parameters(self, (self.phi, self.a_pre, self.b_pre))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_streams={self.n_streams}" + (f", eps={self.eps}" if self.eps else "")


def _packed_from_separate(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    """Accept checkpoints written while the gates and biases were separate parameters
    (``a_pre, a_post, a_res`` of shape ``[1]`` or 0-d; ``b_pre [n], b_post [n], b_res [n, n]``):
    they load into ``alpha [3]`` and ``bias [2n + n*n]``. A part of the wrong shape is reported
    as ``load_state_dict`` reports a size mismatch, and its packed parameter is left as it is, even
    where the parts' sizes add up to the packed parameter's."""
    n = module.n_streams
    layouts = (
        ("alpha", {"a_pre": ((), (1,)), "a_post": ((), (1,)), "a_res": ((), (1,))}),
        ("bias", {"b_pre": ((n,),), "b_post": ((n,),), "b_res": ((n, n),)}),
    )
    for packed, parts in layouts:
        keys = [prefix + name for name in parts]
        if prefix + packed in state_dict or not all(isinstance(state_dict.get(k), torch.Tensor) for k in keys):
            continue
        wrong = [
            (k, tuple(state_dict[k].shape), shapes[-1])
            for k, shapes in zip(keys, parts.values())
            if tuple(state_dict[k].shape) not in shapes
        ]
        for key, got, want in wrong:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {list(got)} from checkpoint, "
                f"the shape in current model is {list(want)} (packed into {prefix + packed})"
            )
        if not wrong:
            state_dict[prefix + packed] = torch.cat([state_dict.pop(k).reshape(-1) for k in keys])


# ------------------------------------------------------------------------------ hyper-connection


class HyperConnection(nn.Module, Site):
    """Hyper-connection around a branch ``F`` (attention, MLP, ...) on ``n`` residual streams.

    ``out[..., i, :] = sum_j h_res[..., i, j] x[..., j, :] + h_post[..., i] F(sum_j h_pre[..., j] x[..., j, :])``

    ``constraint="sinkhorn"`` is mHC (arXiv 2512.24880, Eq. 7-9): the flattened token ``[n*dim]`` is
    RMS-normalised (the division applied after one projection to ``n*n + 2n`` logits), scaled by
    gates ``a_pre, a_post, a_res`` (0.01 at init), biased, then ``h_pre = sigmoid``,
    ``h_post = 2 sigmoid`` and ``h_res = sinkhorn`` (one ``[n, n]`` matrix per token).
    ``constraint="none"`` is the original hyper-connection (arXiv 2409.19606): per-stream RMS norm,
    ``h = a * tanh(x W) + b`` with no constraint on ``h_res``.

    Args:
        dim: channels per stream.
        n_streams: ``n``.
        branch: the wrapped module; ``None`` to use :meth:`split` instead of ``forward``.
        sinkhorn_iters: Sinkhorn iterations for ``h_res`` (mHC).
        dynamic: per-token coefficients from the token itself; ``False``: static, per layer.
        constraint: ``"sinkhorn"`` (mHC) or ``"none"`` (HC).
        init: ``"residual"`` (default): a fresh network fed copied streams computes exactly the
            plain residual network it replaces (``h_pre`` sums to one, ``h_post = 1``, dynamic
            projections zero, ``h_res`` near identity). ``"zero"`` (mHC only): zero biases
            (``h_pre = 1/2``, ``h_post = 1``, ``h_res = J/n`` before the dynamic part) and a random
            projection, as Megatron, Liger and the DeepSeek-V4 port do.
        backward: the Sinkhorn backward, ``"exact"`` or ``"implicit"`` (:func:`mhc.layer.sinkhorn`).
        backend: the path of the whole layer. ``"triton"``: fused kernels (coefficient projection
            + RMS + Sinkhorn, pre-mix, post + residual merge, and their backward; CUDA, or CPU
            with ``TRITON_INTERPRET=1``; ``n <= 16``). HC (``constraint="none"``) and static
            coefficients use the fused mixing kernels with coefficients from PyTorch ops.
            ``"torch"``: the pure-PyTorch reference. ``"auto"``: ``"triton"`` for CUDA tensors
            with ``n <= 16``, else ``"torch"``.
        rms_eps: epsilon of the RMS normalisation, ``1 / sqrt(mean(v^2) + rms_eps)``. The default
            ``1e-6`` keeps the gradient of an all-zero or tiny token bounded (at most
            ``|a| (|phi_ik| + ||phi_k||) / sqrt(rms_eps)`` per logit); the paper's ``1e-20`` gives
            ``~1e10`` there. It changes tokens with an RMS below ``~1e-3`` only.
        hc_eps: ``0`` (default): the paper's coefficients. ``> 0`` (mHC only): DeepSeek-V4's,
            ``h_pre = sigmoid(.) + hc_eps`` and its Sinkhorn (``hc_eps`` added after the first
            softmax and to every sum divided by; :func:`mhc.layer.sinkhorn`'s ``eps``). Needs the
            exact backward.

    Shapes: ``forward(x [..., n, dim], *args, **kwargs) -> [..., n, dim]``; extra arguments go to
    the branch. A branch that returns a tuple ``(y, *extras)`` (attention weights, a cache) has
    ``y`` mixed into the streams, and ``forward`` returns ``(streams, *extras)``.
    ``coefficients(x) -> (h_pre [..., n], h_post [..., n], h_res [..., n, n])`` in fp32 (fp64 on
    the ``"torch"`` path for fp64 activations or parameters).

    Models that run their own layer loop chain the sites: ``x_in, finish = hc_1.split(x)``, then
    ``x_in, finish = finish(branch_1(x_in), next=hc_2)``, ..., and ``x = finish(branch_k(x_in))``
    for the last one. ``finish(y, next=hc_2)`` equals ``hc_2.split(finish(y))``; on the fused path
    between two dynamic mHC sites it runs as one autograd op (:mod:`mhc.sites`).

    Parameters: ``bias [2n + n*n]`` (``[b_pre | b_post | vec(b_res)]``), and for dynamic layers
    ``alpha [3]`` (the gates ``a_pre, a_post, a_res``) and ``phi`` (``[n*dim, 2n + n*n]`` for mHC,
    ``[dim, n + 2]`` for HC). ``b_pre``, ``b_post``, ``b_res``, ``a_pre``, ``a_post``, ``a_res``
    are views of them by those names. Checkpoints with the seven separate parameters of earlier
    versions load (a ``load_state_dict`` pre-hook packs them).
    """

    def __init__(
        self,
        dim: int,
        n_streams: int = 4,
        branch: nn.Module | Callable | None = None,
        sinkhorn_iters: int = 20,
        dynamic: bool = True,
        constraint: str = "sinkhorn",
        init: str = "residual",
        backward: str = "exact",
        backend: str = "auto",
        rms_eps: float = DEFAULT_RMS_EPS,
        hc_eps: float = 0.0,
    ):
        super().__init__()
        self.dim = _positive_int(dim, "dim")
        self.n_streams = n = _positive_int(n_streams, "n_streams")
        if constraint not in CONSTRAINTS:
            raise ValueError(f"constraint must be one of {CONSTRAINTS}, got {constraint!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if constraint == "none" and init != "residual":
            raise ValueError("constraint='none' (HC) supports init='residual' only")
        self.hc_eps = check_settings(sinkhorn_iters, backward, backend, hc_eps)
        if branch is not None and not callable(branch):
            raise TypeError(f"branch must be a module, a callable or None, got {type(branch).__name__}")
        if constraint == "none" and self.hc_eps > 0:
            raise ValueError("hc_eps is an option of mHC (constraint='sinkhorn'), got constraint='none'")
        self.branch = branch
        self.sinkhorn_iters = sinkhorn_iters
        self.dynamic = bool(dynamic)
        self.constraint = constraint
        self.init = init
        self.backward = backward
        self.backend = backend
        self.rms_eps = _check_rms_eps(rms_eps)
        self.source = source_for(constraint, self.dynamic)
        self._recorder: tuple | None = None  # the open collect_h_res blocks' lists

        # two or three parameters, not seven: optimizers and FSDP2 do host work per parameter
        # (dev/LOG.md, "Host time")
        self.bias = nn.Parameter(torch.zeros(2 * n + n * n))  # [b_pre | b_post | vec(b_res)]
        if self.dynamic:
            self.alpha = nn.Parameter(torch.full((3,), 0.01))  # the gates (a_pre, a_post, a_res)
            # mHC: one projection of the flattened token; HC: one per stream, shared across streams
            fan_in = n * dim if constraint == "sinkhorn" else dim
            self.phi = nn.Parameter(torch.zeros(fan_in, n * n + 2 * n if constraint == "sinkhorn" else n + 2))
        self.register_load_state_dict_pre_hook(_packed_from_separate)
        self.reset_parameters()

    # views of the packed parameters under the paper's names (writable in place, no .grad of their own)
    b_pre = property(lambda self: biases(self.bias, self.n_streams)[0], doc="``[n]``, a view of ``bias``")
    b_post = property(lambda self: biases(self.bias, self.n_streams)[1], doc="``[n]``, a view of ``bias``")
    b_res = property(lambda self: biases(self.bias, self.n_streams)[2], doc="``[n, n]``, a view of ``bias``")
    a_pre = property(lambda self: self._gate(0), doc="``[1]``, a view of ``alpha`` (dynamic layers)")
    a_post = property(lambda self: self._gate(1), doc="``[1]``, a view of ``alpha`` (dynamic layers)")
    a_res = property(lambda self: self._gate(2), doc="``[1]``, a view of ``alpha`` (dynamic layers)")

    def _gate(self, i: int) -> torch.Tensor:
        if not self.dynamic:
            raise AttributeError("a static HyperConnection (dynamic=False) has no gates")
        return self.alpha[i : i + 1]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The initial values (``init``), written in place: also into ``DTensor`` parameters
        (FSDP2, :func:`mhc.distributed.parallelize_sites`), e.g. after ``to_empty`` of a model
        built on the meta device."""
        n = self.n_streams
        bias = torch.zeros(self.bias.shape, dtype=self.bias.dtype)
        b_pre, b_post, b_res = biases(bias, n)
        if self.constraint == "sinkhorn":
            if self.init == "residual":
                # sigmoid(b_pre) = 1/n so the branch input is the mean of the streams; 2 sigmoid(0) = 1
                b_pre.fill_(-math.log(n - 1) if n > 1 else 20.0)
                b_res.copy_(4.0 * torch.eye(n))
        else:
            b_pre.fill_(1.0 / n)
            b_post.fill_(1.0)
            b_res.copy_(torch.eye(n))
        assign(self.bias, bias)
        if self.dynamic:
            assign(self.alpha, torch.full(self.alpha.shape, 0.01, dtype=self.alpha.dtype))
            phi = torch.zeros(self.phi.shape, dtype=self.phi.dtype)
            if self.init != "residual":
                nn.init.normal_(phi, std=self.phi.shape[0] ** -0.5)
            assign(self.phi, phi)

    def mixing_parameters(self):
        if self.dynamic:
            return self.phi, self.alpha, self.bias
        return None, None, self.bias

    def forward(self, x: torch.Tensor, *branch_args, **branch_kwargs):
        if self.branch is None:
            raise ValueError("this HyperConnection has no branch: use x_in, finish = hc.split(x)")
        x_in, finish = self.split(x)
        return finish(self.branch(x_in, *branch_args, **branch_kwargs))

    def extra_repr(self) -> str:
        eps = f", hc_eps={self.hc_eps}" if self.hc_eps else ""
        return (
            f"dim={self.dim}, n_streams={self.n_streams}, constraint={self.constraint!r}, "
            f"dynamic={self.dynamic}, init={self.init!r}, sinkhorn_iters={self.sinkhorn_iters}{eps}"
        )


# ------------------------------------------------------------------------------ lane mixer


class LaneMixer(nn.Module):
    """Doubly stochastic mixing of ``n`` lanes (MoE experts, parallel heads, ...).

    Static (``dynamic=False``): one learned ``P = lm.matrix()`` ``[n, n]``,
    ``out[..., i, :] = sum_j P[i, j] x[..., j, :]``. Dynamic (``dynamic=True``, needs ``dim``): one
    ``P`` per token from that token's lanes, ``lm.matrix(x) -> [..., n, n]``: the static logits plus
    a projection of the RMS-normalised flattened lanes (zero at init; ``rms_eps`` as in
    :class:`HyperConnection`).
    Shapes: ``forward(x [..., n, dim]) -> [..., n, dim]``.

    ``backend`` selects the Sinkhorn (:func:`~mhc.layer.sinkhorn`: Triton kernels for any
    ``n <= 64``) and the mix: the fused mixing kernel for ``n <= MAX_STREAMS`` (16), a batched
    matmul above (no fused kernel there; ``backend="triton"`` still runs the Sinkhorn kernels).
    """

    _mhc_sequence_parallel = False  # set by mhc.distributed.parallelize_sites

    def __init__(
        self,
        n_lanes: int,
        dim: int | None = None,
        iters: int = 20,
        dynamic: bool = False,
        backward: str = "exact",
        backend: str = "auto",
        rms_eps: float = DEFAULT_RMS_EPS,
    ):
        super().__init__()
        self.n_lanes = n = _positive_int(n_lanes, "n_lanes")
        self.dim = None if dim is None else _positive_int(dim, "dim")
        if dynamic and dim is None:
            raise ValueError("a dynamic LaneMixer needs dim")
        check_settings(iters, backward, backend)
        self.iters, self.dynamic, self.backward, self.backend = iters, bool(dynamic), backward, backend
        self.rms_eps = _check_rms_eps(rms_eps)
        self.logits = nn.Parameter(torch.empty(n, n))
        if self.dynamic:
            self.proj = nn.Parameter(torch.empty(n * dim, n * n))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Logits ``N(0, 0.02^2)``, a zero projection (DTensor parameters too, see
        :meth:`HyperConnection.reset_parameters`)."""
        assign(self.logits, torch.randn(self.logits.shape, dtype=self.logits.dtype) * 0.02)
        if self.dynamic:
            assign(self.proj, torch.zeros(self.proj.shape, dtype=self.proj.dtype))

    def matrix(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Static: ``[n, n]`` (``x`` not needed). Dynamic: ``[..., n, n]`` for lanes ``x [..., n, dim]``."""
        logits, proj = local_parameters(self, (self.logits, self.proj if self.dynamic else None))
        logits = logits.to(coefficient_dtype(logits))
        if self.dynamic:
            if x is None:
                raise ValueError("a dynamic LaneMixer needs the lanes x to build its matrices")
            self._check_input(x)
            dtype = coefficient_dtype(x, proj)
            v = rearrange(x.to(dtype), "... s d -> ... (s d)")
            dyn = (v @ proj.to(dtype)) * rms_inverse(v, self.rms_eps)
            logits = logits + rearrange(dyn, "... (t s) -> ... t s", t=self.n_lanes)
        return sinkhorn(logits, self.iters, backward=self.backward, backend=self.backend)

    def _check_input(self, x) -> None:
        check_streams_shape(x, self.n_lanes, self.dim, "x")
        check_local(x, self)
        check_same_device(x, self.logits.device, "x", "the layer's parameters")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        p = self.matrix(x)
        n = self.n_lanes
        if n <= MAX_STREAMS and layer_backend(x, n, self.backend) == "triton":
            T = math.prod(x.shape[:-2])
            p = p.float().reshape(T, n, n) if self.dynamic else p.float().expand(T, n, n)
            return post_mix(x, None, None, p)
        return p.to(x.dtype) @ x  # [n, n] or [..., n, n] @ [..., n, dim]; matmul returns no view

    def extra_repr(self) -> str:
        return f"n_lanes={self.n_lanes}, dim={self.dim}, iters={self.iters}, dynamic={self.dynamic}"


# ------------------------------------------------------------------------------ stability metric


@dataclass
class GainReport:
    """ "Amax gain magnitude" (paper Fig. 3), averaged over tokens, for ``L`` layers.

    ``forward[l]`` / ``backward[l]``: max absolute row / column sum of layer ``l``'s ``h_res``.
    ``composite_forward[l]`` / ``composite_backward[l]``: the same for the product
    ``h_res[l] @ ... @ h_res[0]`` (the map from the input streams to layer ``l``'s output).
    """

    forward: torch.Tensor
    backward: torch.Tensor
    composite_forward: torch.Tensor
    composite_backward: torch.Tensor


def _gains(m: torch.Tensor):
    a = m.abs()
    return a.sum(-1).amax(-1).mean(), a.sum(-2).amax(-1).mean()


def amax_gain(h_res: Sequence[torch.Tensor]) -> GainReport:
    """Per-layer and composite forward / backward gains of per-layer ``h_res`` ``[..., n, n]`` (fp64).

    ``h_res``: a list or tuple of ``L >= 1`` real tensors of one shape ``[..., n, n]`` (``n >= 1``,
    at least one token) on one device."""
    if isinstance(h_res, torch.Tensor) or not isinstance(h_res, Sequence):
        raise TypeError(
            f"h_res must be a sequence (list, tuple) of per-layer tensors, got {type(h_res).__name__} "
            f"(layers stacked in one tensor: pass list(h_res))"
        )
    if len(h_res) == 0:
        raise ValueError("h_res must hold at least one layer's matrices")
    for i, h in enumerate(h_res):
        if not isinstance(h, torch.Tensor):
            raise TypeError(f"h_res[{i}] must be a torch.Tensor, got {type(h).__name__}")
        if h.is_complex() or h.dtype == torch.bool:
            raise TypeError(f"h_res[{i}] must hold real numbers, got {h.dtype}")
    shape, device = h_res[0].shape, h_res[0].device
    for i, h in enumerate(h_res):
        if h.shape != shape or h.dim() < 2 or h.shape[-1] != h.shape[-2]:
            raise ValueError(
                f"every h_res must have the shape [..., n, n] of the first, {tuple(shape)}; "
                f"got {tuple(h.shape)} at h_res[{i}]"
            )
        check_same_device(h, device, f"h_res[{i}]", "h_res[0]")
    if shape[-1] == 0 or math.prod(shape[:-2]) == 0:
        raise ValueError(f"h_res must hold at least one token's [n, n] matrix with n >= 1, got shape {tuple(shape)}")
    fwd, bwd, cfwd, cbwd = [], [], [], []
    composite = None
    for h in h_res:
        h = h.detach().double()
        composite = h if composite is None else h @ composite
        for out, val in zip((fwd, bwd), _gains(h)):
            out.append(val)
        for out, val in zip((cfwd, cbwd), _gains(composite)):
            out.append(val)
    return GainReport(*(torch.stack(v) for v in (fwd, bwd, cfwd, cbwd)))


@contextlib.contextmanager
def collect_h_res(model: nn.Module) -> Iterator[list]:
    """Record the ``h_res`` of every :class:`HyperConnection` in ``model`` during the block.

    ``with collect_h_res(model) as h_res: model(x)``; then ``h_res`` holds one detached
    ``[..., n, n]`` tensor per hyper-connection call, in call order: ready for :func:`amax_gain`.
    Blocks nest: an inner block records what the outer one does while both are open.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    records: list = []
    layers = [m for m in model.modules() if isinstance(m, HyperConnection)]
    for m in layers:  # blocks nest: every open block records
        m._recorder = (m._recorder or ()) + (records,)
    try:
        yield records
    finally:
        for m in layers:
            m._recorder = tuple(r for r in m._recorder if r is not records) or None
