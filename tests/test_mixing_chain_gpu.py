"""Chained sites and DeepSeek-V4's epsilon on a CUDA GPU: the seam op and the eps kernels at full sizes."""

import pytest
import torch

from mhc import reference
from mhc.layer import sinkhorn
from tests.test_mixing_chain import bf16_failures, make_chain, run_chain, same_chain

pytestmark = pytest.mark.gpu


def _relative(got, exact):
    return ((got.double() - exact.double()).norm() / exact.double().norm()).item()


def _scaled(sites, dim):
    """``phi`` at the scale of a trained projection (``1/sqrt(n*dim)``), as tests/test_mixing_gpu.py."""
    with torch.no_grad():
        for site in sites:
            site.phi.normal_(std=site.phi.shape[0] ** -0.5)
    return sites


def _is_sum_over_tokens(k):
    """The gates' and the biases' gradients: a few numbers, each one sum over every
    token, whose error is a single draw of many roundings (docs/mixing.md, "Accuracy")."""
    return k.endswith(("alpha", "bias")) and ".branch." not in k


@pytest.mark.parametrize("dim, n, hc_eps", [(1000, 4, 0.0), (1536, 8, 0.0), (4096, 4, 1e-6), (96, 2, 0.0)])
def test_chain_fp32_three_way(dim, n, hc_eps):
    """fp32, three sites chained through seam ops (n = 8 too): error against fp64 at most
    twice the reference path's fp32 error for the output and every tensor's gradient. The sums
    over tokens carry the tensor cores' tf32x3 rounding amplified by their cancellation, which
    moves their error by several times from one draw to the next in both fused paths: over four
    draws together, chained within twice the worse of the unchained fused and the reference path."""
    draws = []
    for seed in range(4):
        sites = _scaled(make_chain(["mhc", "mhc", "mhc"], dim, n, "triton", seed=seed, hc_eps=hc_eps), dim)
        x = torch.randn(2, 333, n, dim, device="cuda")
        w = torch.randn_like(x)
        exact = run_chain([s.double() for s in same_chain(sites, "torch")], x.double(), w.double(), chained=False)
        draws.append(
            (
                exact,
                run_chain(sites, x, w, chained=True),
                run_chain(same_chain(sites, "torch"), x, w, chained=False),
                run_chain(sites, x, w, chained=False),
            )
        )
    failed = {}
    for k in draws[0][0]:
        if _is_sum_over_tokens(k):
            exact, got, low, unchained = (torch.cat([draw[i][k].flatten() for draw in draws]) for i in range(4))
            err, bound = _relative(got, exact), 2 * max(_relative(low, exact), _relative(unchained, exact)) + 1e-6
        else:
            exact, got, low, _ = (result[k] for result in draws[0])
            err, bound = _relative(got, exact), 2 * _relative(low, exact) + 1e-6
        if err > bound:
            failed[k] = (err, bound)
    assert not failed, failed


def test_chain_bf16_full_size():
    """bf16, d = 4096, n = 4, 2048 tokens: tests/test_mixing_chain.py's rule at full size."""
    sites = _scaled(make_chain(["mhc", "mhc"], 4096, 4, "triton", seed=2), 4096)
    x = torch.randn(2048, 4, 4096, device="cuda")
    failed = bf16_failures(sites, x, torch.randn_like(x))
    assert not failed, failed


def test_chain_gradients_bit_identical_at_scale():
    sites = _scaled(make_chain(["mhc", "mhc", "mhc"], 2048, 4, "triton", seed=3), 2048)
    for site in sites:
        site.branch.to(torch.bfloat16)
    x = torch.randn(16384, 4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn_like(x)
    first, second = run_chain(sites, x, w, chained=True), run_chain(sites, x, w, chained=True)
    for k in first:
        assert torch.equal(first[k], second[k]), k


def test_sinkhorn_eps_kernels_at_scale():
    """2^20 matrices, n = 4, 20 iterations, V4's eps: forward and exact gradient against fp64."""
    x = (torch.randn(2**20, 4, 4, device="cuda") * 2).requires_grad_()
    g = torch.randn_like(x)
    out = sinkhorn(x, 20, eps=1e-6)
    (dx,) = torch.autograd.grad(out, x, g)
    xd = x.detach().double().requires_grad_()
    want = reference.sinkhorn_eps(xd, 20, 1e-6)
    (dx_want,) = torch.autograd.grad(want, xd, g.double())
    assert (out.double() - want).abs().max() < 2e-6
    assert _relative(dx, dx_want) < 1e-5


def test_hc_eps_layer_matches_fp64_at_full_size():
    """One site with ``hc_eps = 1e-6`` (DeepSeek-V4), d = 4096, fp32: fused against fp64."""
    (site,) = _scaled(make_chain(["mhc"], 4096, 4, "triton", seed=4, hc_eps=1e-6), 4096)
    x = torch.randn(1024, 4, 4096, device="cuda")
    w = torch.randn_like(x)
    got = run_chain([site], x, w, chained=False)
    exact = run_chain([s.double() for s in same_chain([site], "torch")], x.double(), w.double(), chained=False)
    for k in exact:
        assert _relative(got[k], exact[k]) < 2e-5, k
