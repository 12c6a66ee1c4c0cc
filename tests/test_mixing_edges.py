"""Numerical edges of the mixing layers: zero and tiny tokens (``rms_eps``), on both paths.

The fused path runs in Triton's interpreter on CPU and compiled on a GPU.
"""

import pytest
import torch
from torch import nn

from mhc.mixing import DEFAULT_RMS_EPS, HyperConnection, LaneMixer
from tests.conftest import KERNEL_DEVICE

SCALES = [0.0, 1e-30, 1e-8, 1e-3, 1.0]


def logits_of_token(layer, token):
    """The gated logits ``a * (v . phi) * r`` of one token ``[n, dim]``, flattened (reference path)."""
    pre, post, res = layer.source.logits(layer, token)
    return torch.cat([pre.flatten(), post.flatten(), res.flatten()])


def jacobian_bound(phi, gates, eps):
    """``|a_k| (|phi_ik| + ||phi_k||) / sqrt(eps)`` as ``[K, M]`` (docs/mixing.md, "Zero and tiny tokens")."""
    return gates.abs() * (phi.abs() + phi.norm(dim=0)) / eps**0.5


@pytest.mark.parametrize("eps", [DEFAULT_RMS_EPS, 1e-20])
@pytest.mark.parametrize("scale", SCALES)
def test_mhc_logit_jacobian_within_the_stated_bound(scale, eps):
    n, dim = 4, 16
    torch.manual_seed(0)
    hc = HyperConnection(dim, n, init="zero", backend="torch", rms_eps=eps).double()
    with torch.no_grad():
        for a, value in ((hc.a_pre, 0.3), (hc.a_post, -0.7), (hc.a_res, 1.1)):
            a.fill_(value)
    token = torch.randn(n, dim, dtype=torch.float64) * scale
    jac = torch.autograd.functional.jacobian(lambda t: logits_of_token(hc, t), token)  # [M, n, dim]
    jac = jac.reshape(jac.shape[0], n * dim).T  # [K, M], the layout of phi
    gates = torch.cat([hc.a_pre.expand(n), hc.a_post.expand(n), hc.a_res.expand(n * n)]).detach()
    bound = jacobian_bound(hc.phi.detach(), gates, eps)
    assert torch.isfinite(jac).all()
    assert (jac.abs() <= bound * (1 + 1e-6)).all()
    if scale == 0.0:  # the first term is exact at a zero token: the bound's phi_ik part is attained
        torch.testing.assert_close(jac, gates * hc.phi.detach() / eps**0.5, rtol=1e-12, atol=0)


@pytest.mark.parametrize("scale", SCALES)
def test_hc_logit_jacobian_within_the_stated_bound(scale):
    n, dim = 3, 8
    torch.manual_seed(1)
    hc = HyperConnection(dim, n, constraint="none", backend="torch").double()
    with torch.no_grad():
        hc.phi.normal_()
        hc.a_pre.fill_(2.0)
    token = torch.randn(n, dim, dtype=torch.float64) * scale
    jac = torch.autograd.functional.jacobian(lambda t: logits_of_token(hc, t), token)
    # streams are normalised separately: logit k of stream s depends on stream s only
    gates = torch.cat([hc.a_pre.expand(1), hc.a_post.expand(1), hc.a_res.expand(n)]).detach()
    bound = jacobian_bound(hc.phi.detach(), gates, DEFAULT_RMS_EPS)  # [dim, n + 2]
    pre, post, res = jac[:n], jac[n : 2 * n], jac[2 * n :].reshape(n, n, n, dim)
    for s in range(n):
        per_stream = torch.cat([pre[s, s][:, None], post[s, s][:, None], res[s, :, s].T], dim=1)  # [dim, n + 2]
        assert (per_stream.abs() <= bound * (1 + 1e-6)).all()


def zero_token_layer(backend, dtype, eps=DEFAULT_RMS_EPS):
    """The example of the bug report: ``HyperConnection(64, 4, nn.Linear(64, 64), init="zero")``."""
    torch.manual_seed(0)
    return HyperConnection(64, 4, nn.Linear(64, 64), init="zero", backend=backend, rms_eps=eps).to(KERNEL_DEVICE, dtype)


def input_gradient(layer, x, seed=1):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    out.backward(grad)
    return x.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_token_gradients_bounded(backend, dtype):
    layer = zero_token_layer(backend, dtype)
    x = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(2))
    unit = input_gradient(layer, x.to(KERNEL_DEVICE, dtype)).abs().max()
    for scale in (0.0, 1e-30):
        grad = input_gradient(layer, (x * scale).to(KERNEL_DEVICE, dtype))
        assert torch.isfinite(grad).all()
        # the same order as a unit-scale token (measured 2.6 against 2.4), not 1e7
        assert grad.abs().max() <= 2 * unit, (scale, grad.abs().max().item(), unit.item())
        phi_grad = layer.phi.grad
        assert torch.isfinite(phi_grad).all()
        layer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paper_eps_stays_available(backend):
    # rms_eps=1e-20 is the paper's value: the zero-token gradient is then a_k phi_ik / 1e-10
    layer = zero_token_layer(backend, torch.float32, eps=1e-20)
    grad = input_gradient(layer, torch.zeros(6, 4, 64, device=KERNEL_DEVICE))
    assert torch.isfinite(grad).all() and grad.abs().max() > 1e6


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_tokens_fused_matches_reference(backend):
    # a batch mixing zero, tiny and ordinary tokens: every path gives the reference's gradients
    ref, other = zero_token_layer("torch", torch.float32), zero_token_layer(backend, torch.float32)
    x = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(3))
    x[0] = 0.0
    x[1] *= 1e-30
    x[2, 1] = 0.0  # one zero stream in an ordinary token
    x = x.to(KERNEL_DEVICE)
    torch.testing.assert_close(input_gradient(other, x), input_gradient(ref, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other.phi.grad, ref.phi.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [DEFAULT_RMS_EPS, 1e-20])
def test_lane_mixer_zero_lanes_bounded(eps):
    # out = P(x) x: dL/dP scales with x, so the coefficient part of dL/dx stays bounded even with
    # the paper's eps; the gradient of zero lanes is P^T g alone
    torch.manual_seed(0)
    lm = LaneMixer(4, dim=16, dynamic=True, backend="torch", rms_eps=eps)
    with torch.no_grad():
        lm.proj.normal_(std=0.1)
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2))
    unit = input_gradient(lm, x).abs().max()
    for scale in (0.0, 1e-30):
        grad = input_gradient(lm, x * scale)
        assert torch.isfinite(grad).all() and grad.abs().max() <= 2 * unit


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("inf"), float("nan")])
def test_rms_eps_must_be_positive_and_finite(eps):
    with pytest.raises(ValueError, match="rms_eps"):
        HyperConnection(8, 2, rms_eps=eps)
    with pytest.raises(ValueError, match="rms_eps"):
        LaneMixer(2, dim=8, dynamic=True, rms_eps=eps)
    with pytest.raises(TypeError, match="rms_eps"):
        HyperConnection(8, 2, rms_eps="1e-6")
