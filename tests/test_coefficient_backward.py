"""The coefficient backward's one reduction (dev/LOG.md, "Fewer launches per site"): the
projection backward adds the coefficient-gradient kernel's per-program bias and gate sums into
its per-split partial ``dphi``, so that one sum over the splits gives both. Against the separate
sum of the per-program rows it replaces.

CPU: Triton's interpreter at a small width; GPU: the model width d = 1024.
"""

import pytest
import torch

from mhc import kernels
from mhc.kernels import mhc_coefficients
from mhc.kernels._launch import forget_launch_plans
from tests.conftest import HAS_CUDA, KERNEL_DEVICE

DEVICE = KERNEL_DEVICE
DIM = 1024 if HAS_CUDA else 24


def _forward(tokens, n, seed):
    g = torch.Generator().manual_seed(seed)
    K, M = n * DIM, 2 * n + n * n
    x = torch.randn(tokens, n, DIM, generator=g).to(DEVICE)
    phi = (torch.randn(K, M, generator=g) / K**0.5).to(DEVICE)
    alpha = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    bias = torch.randn(M, generator=g).to(DEVICE)
    _, p, r, h_pre, h_post, z_res, _ = kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    return g, x, phi, alpha, p, r, h_pre, h_post, z_res


@pytest.mark.parametrize("n", [4, 6])  # 6: the projection backward's separate dx and dphi passes
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("tokens", [1, 29] + ([1000] if HAS_CUDA else []))  # 29: 8 rows of sums, tiles of 2
def test_bias_sums_reduced_with_dphi_equal_the_separate_sums(n, splits, tokens, monkeypatch, request, nan_poison):
    g, x, phi, alpha, p, r, h_pre, h_post, z_res = _forward(tokens, n, seed=n + tokens)
    dz_res = torch.randn(z_res.shape, generator=g).to(DEVICE)
    dh_post = torch.randn(h_post.shape, generator=g).to(DEVICE)
    grad_x_in = torch.randn(x[:, 0].shape, generator=g).to(DEVICE)
    monkeypatch.setattr(mhc_coefficients, "token_splits", lambda *args: splits)
    monkeypatch.setattr(mhc_coefficients, "BIAS_TILE", 2)  # several tiles of rows per split
    forget_launch_plans()
    request.addfinalizer(forget_launch_plans)
    _, _, dbias_alpha = kernels.coefficients_bwd(x, phi, alpha, p, r, h_pre, h_post, None, dh_post, dz_res, grad_x_in)
    _, _, partial_bias = mhc_coefficients.coefficient_grad(
        x, alpha, p, r, h_pre, h_post, None, dh_post, dz_res, grad_x_in, 0.0
    )
    assert tokens == 1 or partial_bias.shape[0] > 2 * splits
    want = partial_bias.sum(0)
    torch.testing.assert_close(dbias_alpha, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
