"""A dynamic mHC site's start on the CPU loops, as one autograd op: coefficients and pre-mix.

On the PyTorch path a site's start is some thirty-five small ops (the projection, its norm, the
gates, biases and sigmoids, Sinkhorn, the pre-mix) and twenty backward nodes; on a CPU each is a
dispatch and a pass over memory. Here the projection and its two gradients are matmuls and the
rest is one loop each way (``mhc_site_start_*`` in ``kernels.c``), so the op keeps ``x``, the
projection and a few values per token, and moves the streams twice each way. Values agree with
:meth:`mhc.coefficients.DynamicMHC.reference` and the pre-mix within fp32 rounding.

The backward runs the formulas as PyTorch ops instead of the loops where it builds a graph
(``create_graph=True``: double backward) and where an incoming gradient is not a tensor the loops
read (a subclass).
"""

from __future__ import annotations

import torch

from mhc import cpu, reference
from mhc.cpu.projection import normalized_projection_formula

__all__ = ["site_start"]


def _formula(x, phi, alpha, bias, iters, rms_eps, hc_eps):
    """``(x_in, h_post, h_res)`` as PyTorch ops, for ``x [T, n, d]``."""
    n = x.shape[-2]
    proj = normalized_projection_formula(x.flatten(-2), phi, rms_eps)
    pre, post, res = proj.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_res = bias.split([n, n, n * n])
    h_pre = torch.sigmoid(b_pre + alpha[0] * pre) + hc_eps
    h_post = 2.0 * torch.sigmoid(b_post + alpha[1] * post)
    logits = (b_res + alpha[2] * res).unflatten(-1, (n, n))
    h_res = reference.sinkhorn_loop(logits, iters, hc_eps)
    return (h_pre.unsqueeze(-1) * x).sum(-2), h_post, h_res


class _SiteStart(torch.autograd.Function):
    """``x [..., n, d]``, ``phi [n*d, M]``, ``alpha [3]``, ``bias [M]`` (``M = 2n + n*n``) ->
    ``(x_in [..., d], h_post [..., n], h_res [..., n, n])``. Double backward: under ``create_graph=True``
    the backward differentiates :func:`_formula`, which autograd differentiates again."""

    @staticmethod
    def forward(ctx, x, phi, alpha, bias, iters, rms_eps, hc_eps):
        # leading dims flattened in here, where views make no autograd nodes
        lead, (n, d) = x.shape[:-2], x.shape[-2:]
        tokens = x.reshape(-1, n, d).contiguous()
        proj = tokens.view(-1, n * d) @ phi
        x_in, h_pre, h_post, h_res, inv_rms = cpu.site_start_forward(
            tokens, proj, alpha.contiguous(), bias.contiguous(), iters, rms_eps, hc_eps, lead
        )
        # x itself (what double backward differentiates), and its copy only where it made one
        copy = None if x.is_contiguous() else tokens
        ctx.save_for_backward(x, copy, phi, alpha, bias, proj, inv_rms, h_pre)
        ctx.settings = iters, rms_eps, hc_eps
        return x_in, h_post, h_res  # shaped [*lead, ...]: no views, so a branch may modify x_in in place

    @staticmethod
    def backward(ctx, *grads):
        x, copy, phi, alpha, bias, proj, inv_rms, h_pre = ctx.saved_tensors
        if torch.is_grad_enabled() or not all(g is None or cpu.runs_on(g) for g in grads):
            return *_formula_gradients(ctx, (x, phi, alpha, bias), grads), None, None, None
        lead, (n, d) = x.shape[:-2], x.shape[-2:]
        iters, _, hc_eps = ctx.settings  # the backward reads 1 / RMS as the forward left it
        tokens = x.view(-1, n, d) if copy is None else copy
        T = tokens.shape[0]
        grads = tuple(None if g is None else g.reshape(T, *g.shape[len(lead) :]).contiguous() for g in grads)
        grad_x_in = grads[0]  # [T, d]; grad_h_post [T, n] and grad_h_res [T, n, n] follow
        per_token = cpu.site_start_backward(
            tokens, proj, alpha.contiguous(), bias.contiguous(), inv_rms, *grads, iters, hc_eps
        )
        grad_bias, grad_gates, grad_proj, rms_coef = per_token
        grad_x = grad_phi = None
        if ctx.needs_input_grad[0]:
            grad_x = cpu.site_start_grad_x((grad_proj @ phi.T).view(T, n, d), tokens, h_pre, grad_x_in, rms_coef)
            grad_x = grad_x.view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_phi = tokens.view(T, n * d).T @ grad_proj
        return grad_x, grad_phi, grad_gates.sum(0), grad_bias.sum(0), None, None, None


def _formula_gradients(ctx, inputs, grads):
    """The gradients of :func:`_formula` w.r.t. ``inputs`` (``None`` where not wanted): with a
    graph under ``create_graph=True``, else on detached inputs."""
    building = torch.is_grad_enabled()
    if not building:
        inputs = tuple(t.detach().requires_grad_(wanted) for t, wanted in zip(inputs, ctx.needs_input_grad))
    wanted = [t for t, want in zip(inputs, ctx.needs_input_grad) if want]
    with torch.enable_grad():
        outputs = _formula(*inputs, *ctx.settings)
        pairs = [(out, g) for out, g in zip(outputs, grads) if g is not None]
        found = torch.autograd.grad(
            [out for out, _ in pairs], wanted, [g for _, g in pairs], create_graph=building, allow_unused=True
        )
    found = iter(found)
    return tuple(next(found) if want else None for want in ctx.needs_input_grad[:4])


def site_start(x, phi, alpha, bias, iters: int, rms_eps: float, hc_eps: float):
    """``x [..., n, d]``, ``phi [n*d, 2n + n*n]``, ``alpha [3]``, ``bias [2n + n*n]`` ->
    ``(x_in [..., d], h_post [..., n], h_res [..., n, n])``: the coefficients of
    :meth:`mhc.coefficients.DynamicMHC.reference` and the pre-mix, for tensors
    :func:`mhc.cpu.runs_on` accepts, with ``n <=`` :data:`mhc.cpu.MAX_SINKHORN_N`."""
    return _SiteStart.apply(x, phi, alpha, bias, iters, rms_eps, hc_eps)
