"""``HyperConnection``: mHC (arXiv 2512.24880) and plain HC (arXiv 2409.19606) around a branch.

The module holds the parameters and their initialisation; where its coefficients come from is
:mod:`mhc.modules.coefficients`, and how a call runs (path, split, finish, the seam between
chained sites) is :class:`mhc.modules.site.Site`. ``docs/mixing.md`` gives the equations and the
initialisation choices.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from mhc._checks import DEFAULT_RMS_EPS, check_positive_int, check_rms_eps, check_settings
from mhc.modules.coefficients import source_for
from mhc.modules.site import Site
from mhc.ops.local import assign
from mhc.reference.site import biases

__all__ = ["HyperConnection"]

CONSTRAINTS = ("sinkhorn", "none")
INITS = ("residual", "zero")


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
    between two dynamic mHC sites it runs as one autograd op (:mod:`mhc.modules.site`).

    Parameters: ``bias [2n + n*n]`` (``[b_pre | b_post | vec(b_res)]``), and for dynamic layers
    ``alpha [3]`` (the gates ``a_pre, a_post, a_res``) and ``phi`` (``[n*dim, 2n + n*n]`` for mHC,
    ``[dim, n + 2]`` for HC). ``b_pre``, ``b_post``, ``b_res``, ``a_pre``, ``a_post``, ``a_res``
    are views of them by those names."""

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
        self.dim = check_positive_int(dim, "dim")
        self.n_streams = n = check_positive_int(n_streams, "n_streams")
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
        self.rms_eps = check_rms_eps(rms_eps)
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
