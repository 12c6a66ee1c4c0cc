"""Sinkhorn with DeepSeek-V4's epsilon (``sinkhorn(..., eps=)``): the reference against V4's own
loop, the kernels against the fp64 reference (forward and exact gradient), dtypes, edges, errors.

Kernel tests run the real Triton kernels: compiled on a GPU, in Triton's interpreter on CPU.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mhc.kernels
from mhc import reference
from mhc._checks import MAX_EPS_N
from mhc.layer import sinkhorn
from tests.conftest import KERNEL_DEVICE
from tests.test_sinkhorn import random_logits


def deepseek_v4_comb(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's loop as transformers ships it (``DeepseekV4HyperConnection.forward``): rows
    first, its output applied transposed."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def fp64_gradient(logits, grad_out, iters, eps):
    x = logits.detach().cpu().double().requires_grad_()
    reference.sinkhorn_eps(x, iters, eps).backward(grad_out.detach().cpu().double())
    return x.grad


@given(
    n=st.integers(1, 6),
    iters=st.integers(1, 25),
    eps=st.sampled_from([0.0, 1e-6, 1e-3, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_reference_is_deepseek_v4_transposed(n, iters, eps, seed):
    x = random_logits((3, n, n), 2.0, seed, device="cpu")
    got = reference.sinkhorn_eps(x.transpose(-1, -2), iters, eps).transpose(-1, -2)
    torch.testing.assert_close(got, deepseek_v4_comb(x, iters, eps), rtol=0, atol=1e-14)
    if eps == 0:
        torch.testing.assert_close(
            reference.sinkhorn_eps(x, iters, 0.0), reference.sinkhorn_stable(x, iters), rtol=0, atol=1e-12
        )


def test_eps_rows_sum_below_one():
    """Rows sum to ``1 / (1 + eps / row_sum)``-ish, not exactly one: the epsilon is not cosmetic."""
    x = random_logits((50, 4, 4), 1.0, 0, device="cpu")
    rows = reference.sinkhorn_eps(x, 20, 1e-2).sum(-1)
    assert (rows < 1).all() and (rows > 0.98).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@given(
    n=st.integers(1, MAX_EPS_N),
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
    iters=st.integers(1, 21),
    scale=st.floats(0.01, 6.0),
    eps=st.sampled_from([1e-6, 1e-4, 1e-2, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference_forward_and_gradient(backend, n, lead, iters, scale, eps, seed):
    x = random_logits((*lead, n, n), scale, seed, dtype=torch.float32).requires_grad_()
    g = random_logits((*lead, n, n), 1.0, seed + 1, dtype=torch.float32)
    out = sinkhorn(x, iters, backend=backend, eps=eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(
        out.cpu().double(), reference.sinkhorn_eps(x.detach().cpu().double(), iters, eps), rtol=0, atol=3e-6
    )
    (dx,) = torch.autograd.grad(out, x, g)
    want = fp64_gradient(x, g, iters, eps)
    scale = max(1.0, want.abs().amax().item()) if want.numel() else 1.0
    torch.testing.assert_close(dx.cpu().double(), want, rtol=1e-4, atol=2e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_in_and_out(dtype, nan_poison):
    x = random_logits((40, 4, 4), 2.0, 3, dtype=dtype).requires_grad_()
    out = sinkhorn(x, 20, backend="triton", eps=1e-6)
    assert out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(
        out.double().cpu(), reference.sinkhorn_eps(x.detach().double().cpu(), 20, 1e-6), rtol=0, atol=tol
    )
    out.backward(torch.randn_like(out))
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


def test_non_finite_logits_act_per_matrix():
    x = random_logits((3, 4, 4), 1.0, 4, dtype=torch.float32)
    x[0, 1, 2] = float("nan")
    x[1, 2, 3] = float("-inf")  # a structural zero of the softmax, then eps
    out = sinkhorn(x, 20, backend="triton", eps=1e-3)
    assert torch.isnan(out[0]).all()
    assert torch.isfinite(out[1:]).all()
    torch.testing.assert_close(
        out[1:].cpu().double(), reference.sinkhorn_eps(x[1:].cpu().double(), 20, 1e-3), rtol=0, atol=2e-6
    )


def test_settings_and_limits_raise():
    x = torch.randn(2, 4, 4, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="exact backward"):
        sinkhorn(x, 20, backward="implicit", eps=1e-6)
    for bad in (-1e-6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
            sinkhorn(x, 20, eps=bad)
    with pytest.raises(TypeError, match="eps must be a float"):
        sinkhorn(x, 20, eps="1e-6")
    big = torch.randn(2, MAX_EPS_N + 1, MAX_EPS_N + 1, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=f"n <= {MAX_EPS_N}"):
        sinkhorn(big, 3, backend="triton", eps=1e-6)
    assert mhc.kernels.MAX_EPS_N == MAX_EPS_N
    # "auto" keeps large n on the PyTorch path (here on CPU it is the PyTorch path anyway)
    torch.testing.assert_close(sinkhorn(big.cpu(), 3, eps=1e-6), reference.sinkhorn_eps(big.cpu(), 3, 1e-6))
