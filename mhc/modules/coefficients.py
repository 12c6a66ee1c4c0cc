"""Where a hyper-connection site's coefficients come from: one small stateless source per kind of
layer, held as ``site.source``.

:data:`DYNAMIC_MHC` (per-token mHC, arXiv 2512.24880 Eq. 7-19), :data:`DYNAMIC_HC` (per-token
hyper-connections, arXiv 2409.19606: per-stream RMS norm, ``a * tanh(x W) + b``), :data:`STATIC_MHC`
and :data:`STATIC_HC` (one set per layer, from its biases). Each computes the coefficients with
PyTorch ops (:meth:`reference`: the reference path and the tests' oracle) and starts a site on the
fused path (:meth:`fused_start`); only dynamic mHC has fused coefficient kernels. Coefficients are
fp32 whatever the activations' dtype, fp64 for fp64 activations or parameters. Axes (einops):
``...`` leading dims, ``s`` source stream, ``t`` target stream, ``d`` channels.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from mhc.ops.mixing import MHCPreMixFunction, PreMixFunction, fused_mix
from mhc.ops.rebuild import function_args, function_outputs, note_conversion
from mhc.ops.sinkhorn import sinkhorn
from mhc.reference.site import biases, coefficient_dtype, gates, rms_inverse

__all__ = ["DYNAMIC_MHC", "DYNAMIC_HC", "STATIC_MHC", "STATIC_HC", "source_for"]


def as_coefficient_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, known to recompute mode as the streams' copy (:func:`mhc.ops.rebuild.note_conversion`)."""
    converted = x.to(dtype)
    note_conversion(x, converted)
    return converted


class DynamicMHC:
    """Per-token mHC coefficients from ``site.compute_parameters()``:
    ``(phi [n*d, 2n + n*n], alpha [3], bias [2n + n*n])``."""

    fused_coefficients = True  # one kernel computes them with the pre-mix; the seam needs this

    def logits(self, site, x: torch.Tensor, parameters=None):
        """``(a_pre * pre, a_post * post, a_res * res)``: the gated projections before the biases,
        ``[..., n]``, ``[..., n]``, ``[..., n, n]``. ``parameters``: ``site.compute_parameters()``
        if the caller has them (a sequence-parallel site's are new local tensors each call)."""
        n = site.n_streams
        phi, alpha, _ = parameters or site.compute_parameters()
        dtype = coefficient_dtype(x, phi)
        a_pre, a_post, a_res = gates(alpha.to(dtype))
        v = rearrange(as_coefficient_dtype(x, dtype), "... s d -> ... (s d)")
        phi = phi.to(dtype)
        proj = (v @ phi) * rms_inverse(v, site.rms_eps)
        pre, post, res = proj.split([n, n, n * n], dim=-1)
        return a_pre * pre, a_post * post, a_res * rearrange(res, "... (t s) -> ... t s", t=n)

    def reference(self, site, x: torch.Tensor):
        parameters = site.compute_parameters()
        bias = parameters[2]
        dtype = coefficient_dtype(x, bias)
        b_pre, b_post, b_res = biases(bias.to(dtype), site.n_streams)
        pre, post, res = self.logits(site, x, parameters)
        pre, post, res = b_pre + pre, b_post + post, b_res + res
        h_res = sinkhorn(res, site.sinkhorn_iters, backward=site.backward, backend=site.backend, eps=site.hc_eps)
        return torch.sigmoid(pre) + site.hc_eps, 2.0 * torch.sigmoid(post), h_res

    def fused_start(self, site, x: torch.Tensor, plan=None, with_h_pre: bool = True):
        """``(x_in, h_pre, h_post, h_res, x_pass)``; ``with_h_pre=False``: ``None`` for ``h_pre``
        (:class:`mhc.ops.mixing.MHCPreMixFunction`). The other sources return it either way."""
        settings = (site.sinkhorn_iters, site.backward, site.rms_eps, site.hc_eps, with_h_pre)
        outputs = MHCPreMixFunction.apply(x, *self.fused_parameters(site), *settings, *function_args(plan))
        return function_outputs(plan, outputs)

    def fused_parameters(self, site):
        """``site.compute_parameters()`` as they are: the kernels read any float dtype into fp32, so
        parameters that FSDP2's mixed precision hands over in bf16 need no cast op per call."""
        return site.compute_parameters()


class DynamicHC:
    """Per-token coefficients of the unconstrained hyper-connection: ``phi [d, n + 2]`` shared by
    the streams, each stream RMS-normalised on its own."""

    fused_coefficients = False

    def logits(self, site, x: torch.Tensor, parameters=None):
        phi, alpha, _ = parameters or site.compute_parameters()
        dtype = coefficient_dtype(x, phi)
        a_pre, a_post, a_res = gates(alpha.to(dtype))
        xf = as_coefficient_dtype(x, dtype)
        phi = phi.to(dtype)
        proj = torch.tanh((xf * rms_inverse(xf, site.rms_eps)) @ phi)
        return a_pre * proj[..., 0], a_post * proj[..., 1], a_res * proj[..., 2:]

    def reference(self, site, x: torch.Tensor):
        parameters = site.compute_parameters()
        bias = parameters[2]
        dtype = coefficient_dtype(x, bias)
        b_pre, b_post, b_res = biases(bias.to(dtype), site.n_streams)
        pre, post, res = self.logits(site, x, parameters)
        return b_pre + pre, b_post + post, b_res + res

    def fused_start(self, site, x: torch.Tensor, plan=None, with_h_pre: bool = True):
        T = math.prod(x.shape[:-2])
        with site._recompute.scope(plan, x, fused_mix, compiled="keep"):  # the ops below save x
            coefficients = self.reference(site, x)
        h_pre, h_post, h_res = (c.reshape(T, *c.shape[x.dim() - 2 :]).float() for c in coefficients)
        x_in, x_pass = function_outputs(plan, PreMixFunction.apply(x, h_pre, *function_args(plan)))
        return x_in, h_pre, h_post, h_res, x_pass


class Static:
    """One set of coefficients per layer, from the biases: ``sigmoid``, ``2 sigmoid`` and Sinkhorn
    for mHC (``constraint="sinkhorn"``), the biases themselves for HC."""

    fused_coefficients = False

    def __init__(self, constrained: bool):
        self.constrained = constrained

    def coefficients(self, site):
        """``(h_pre [n], h_post [n], h_res [n, n])``, fp32 (fp64 for fp64 parameters)."""
        bias = site.compute_parameters()[2]
        b_pre, b_post, b_res = biases(bias.to(coefficient_dtype(bias)), site.n_streams)
        if not self.constrained:
            return b_pre, b_post, b_res
        h_res = sinkhorn(b_res, site.sinkhorn_iters, backward=site.backward, backend=site.backend, eps=site.hc_eps)
        return torch.sigmoid(b_pre) + site.hc_eps, 2.0 * torch.sigmoid(b_post), h_res

    def reference(self, site, x: torch.Tensor):
        lead = x.shape[:-2]
        h_pre, h_post, h_res = self.coefficients(site)
        return h_pre.expand(*lead, -1), h_post.expand(*lead, -1), h_res.expand(*lead, -1, -1)

    def fused_start(self, site, x: torch.Tensor, plan=None, with_h_pre: bool = True):
        # one set of coefficients, broadcast over tokens (token stride 0)
        T, n = math.prod(x.shape[:-2]), x.shape[-2]
        h_pre, h_post, h_res = (c.float() for c in self.coefficients(site))
        h_pre, h_post, h_res = h_pre.expand(T, n), h_post.expand(T, n), h_res.expand(T, n, n)
        x_in, x_pass = function_outputs(plan, PreMixFunction.apply(x, h_pre, *function_args(plan)))
        return x_in, h_pre, h_post, h_res, x_pass


DYNAMIC_MHC = DynamicMHC()
DYNAMIC_HC = DynamicHC()
STATIC_MHC = Static(constrained=True)
STATIC_HC = Static(constrained=False)


def source_for(constraint: str, dynamic: bool):
    """The source of a layer with ``constraint`` (``"sinkhorn"`` or ``"none"``) and ``dynamic``."""
    if dynamic:
        return DYNAMIC_MHC if constraint == "sinkhorn" else DYNAMIC_HC
    return STATIC_MHC if constraint == "sinkhorn" else STATIC_HC
