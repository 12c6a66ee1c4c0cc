"""Full-size checks of the compiled kernels; run on a CUDA GPU (skipped elsewhere)."""

import math

import pytest
import torch
import triton
import triton.language as tl

from mhc import reference
from mhc.kernels._tiles import reciprocal
from mhc.layer import sinkhorn

pytestmark = pytest.mark.gpu


def _fp64_forward_and_grad(x, g, iters):
    xd = x.detach().double().requires_grad_()
    out = reference.sinkhorn_stable(xd, iters)
    out.backward(g.double())
    return out.detach(), xd.grad


@pytest.mark.parametrize("n", [1, 3, 4, 8, 16, 33, 64], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("backward", ["exact", "implicit"])
def test_full_size_matches_fp64(n, backward, nan_poison):
    T = 2**16 if n <= 16 else 2**12
    iters = 20 if backward == "exact" else 100
    scale = 1.0 if backward == "exact" else 0.3  # implicit is compared where the forward converged
    x = (torch.randn(T, n, n, device="cuda") * scale).requires_grad_()
    g = torch.randn(T, n, n, device="cuda")
    out = sinkhorn(x, iters, backward=backward)
    out.backward(g)
    want_out, want_grad = _fp64_forward_and_grad(x, g, iters)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-6)
    err = (x.grad.double() - want_grad).norm() / want_grad.norm().clamp_min(1e-30)
    assert err < 1e-5


@pytest.mark.parametrize("n", [4, 16, 33], ids=["rows", "tiled", "tiled-np64"])
@pytest.mark.parametrize("backward", ["exact", "implicit"])
def test_fp64_compiles_and_matches_fp64_reference(n, backward, nan_poison):
    # fp64 logits run fp64 kernels (FP64 constexpr), a separate compilation from fp32's. n = 33
    # runs the NP = 64 configuration (RECOMPUTE_R1); fp64 rows are always 8-byte aligned, unpadded.
    x = (torch.randn(512, n, n, device="cuda", dtype=torch.float64) * 0.3).requires_grad_()
    g = torch.randn(512, n, n, device="cuda", dtype=torch.float64)
    iters = 20 if backward == "exact" else 200
    out = sinkhorn(x, iters, backward=backward, backend="triton")
    out.backward(g)
    want_out, want_grad = _fp64_forward_and_grad(x, g, iters)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=1e-9 if backward == "implicit" else 1e-12)


def test_extreme_scale_full_size():
    x = torch.randn(2**16, 4, 4, device="cuda") * 1e4
    out = sinkhorn(x, 20)
    assert torch.isfinite(out).all() and (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones_like(out.sum(-1)), rtol=0, atol=1e-5)


def test_torch_compile_fullgraph():
    def block(logits, w):
        return (sinkhorn(logits * 2.0, 20) * w).sum()

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(4096, 4, 4, device="cuda", requires_grad=True)
    w = torch.randn(4096, 4, 4, device="cuda")
    compiled(x, w).backward()
    got = x.grad.clone()
    x.grad = None
    block(x, w).backward()
    torch.testing.assert_close(got, x.grad)


def test_bf16_and_fp16_on_gpu():
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2**14, 4, 4, device="cuda", dtype=dtype, requires_grad=True)
        out = sinkhorn(x, 20)
        assert out.dtype == dtype
        want = reference.sinkhorn_log(x.detach().double(), 20)
        rounding = (want.to(dtype).double() - want).abs().max()
        assert (out.double() - want).abs().max() <= 2 * rounding
        out.backward(torch.randn_like(out))
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


@triton.jit
def _reciprocal_kernel(x_ptr, out_ptr, size, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < size
    tl.store(out_ptr + offs, reciprocal(tl.load(x_ptr + offs, mask=m, other=1.0)), mask=m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reciprocal_over_the_range_of_sinkhorn_sums(dtype):
    # The kernels' 1 / x (fp32: the square of the hardware rsqrt) over every divisor a step can
    # meet, [1 / n^2, n] for n <= 64 (docs/sinkhorn.md), log-uniform, against the exact value.
    x = torch.exp(torch.empty(2**22, device="cuda", dtype=torch.float64).uniform_(-math.log(4096), math.log(64)))
    x = x.to(dtype)
    out = torch.empty_like(x)
    _reciprocal_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    rel = ((out.double() - 1 / x.double()) * x.double()).abs().max().item()
    assert rel < (4e-7 if dtype == torch.float32 else 1e-15)
