"""Decoding: the coefficient forward at few tokens (``mhc.kernels.mhc_coefficients.decoding``),
and sites forward only under ``torch.no_grad()`` and ``torch.inference_mode()``.

- The decoding tiles (a program per token in the finishing kernel, every split's partial added
  at once, the Sinkhorn on the matrix's entries up to n = 8, on rows beyond) equal the one-pass
  kernel at 1 to 64 tokens, n = 1 to 16, odd widths, with and without ``hc_eps``; the entries'
  Sinkhorn equals the fp64 reference at n = 1 to 8.
- Sites (called as modules and chained) on the fused path equal the reference path forward only,
  at 0 to 64 tokens, n = 1 to the fused maximum, on strided and non-contiguous streams.

CPU: Triton's interpreter, with an H100's SM count given to the launchers (the CPU's stand-in
count is 4); GPU: the device's own count, at model widths too.
"""

import pytest
import torch
import triton
import triton.language as tl

from mhc.kernels import mhc_coefficients
from mhc.kernels._launch import forget_launch_plans
from mhc.kernels.sinkhorn import sinkhorn_entries
from mhc.kernels.sinkhorn_eps import sinkhorn_eps_entries
from mhc.mixing import HyperConnection
from mhc.reference import sinkhorn_eps, sinkhorn_stable
from tests.conftest import HAS_CUDA, KERNEL_DEVICE
from tests.site_stack import through_sites
from tests.test_mixing_fused import Branch

DEVICE = KERNEL_DEVICE
TOKENS = [1, 2, 3, 7, 64]
# (n, d): widths that take the decoding tiles (n * d >= 1024), odd ones among them
SHAPES = [(1, 1025), (2, 513), (3, 343), (4, 257), (5, 205), (8, 129), (9, 115), (16, 65)]
if HAS_CUDA:
    SHAPES += [(4, 4096), (4, 7168), (8, 2048), (16, 2048)]
# the interpreter takes about 10 s a case at 64 tokens: there, one width at 64, and n > 8 at 1 and 3
CASES = [
    (n, d, t)
    for n, d in SHAPES
    for t in TOKENS
    if HAS_CUDA or (t < 64 and (n <= 8 or t in (1, 3))) or (n, d) == (4, 257)
]


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: 132)


def _inputs(tokens, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    K, M = n * d, 2 * n + n * n
    x = torch.randn(tokens, n, d, generator=g)
    phi = torch.randn(K, M, generator=g) / K**0.5
    alpha, bias = torch.rand(3, generator=g) + 0.5, 0.1 * torch.randn(M, generator=g)
    return tuple(t.to(DEVICE) for t in (x, phi, alpha, bias))


# DeepSeek-V4's hc_eps (its own Sinkhorn core) at two widths: the tiles do not depend on it
EPS_CASES = [(*c, 0.0) for c in CASES] + [(*c, 1e-3) for c in CASES if HAS_CUDA or c[:2] in ((4, 257), (8, 129))]


@pytest.mark.parametrize("n, d, tokens, hc_eps", EPS_CASES)
def test_the_decoding_tiles_match_one_pass(n, d, tokens, hc_eps, monkeypatch, nan_poison):
    x, phi, alpha, bias = _inputs(tokens, n, d, seed=tokens)
    plan = mhc_coefficients._forward_plan(n, d, tokens, 20, hc_eps > 0, False, x.device)
    assert mhc_coefficients.decoding(n, d, tokens) and plan.finish.meta["BLOCK_T"] == 1
    assert plan.partial[0] > 1  # several splits' partials are added
    got = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6, hc_eps)
    monkeypatch.setattr(mhc_coefficients, "coefficients_split_config", lambda *args: None)
    forget_launch_plans()
    want = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6, hc_eps)
    # Rounding, from adding in another order: x_in sums n products h_pre[j] x[j] (h_pre <= 1); p
    # (and z_res = a p + b) adds K / 16 or more tiles' products into an fp32 accumulator of |p|
    eps32 = torch.finfo(torch.float32).eps
    atol = dict(x_in=n * eps32 * x.abs().max().item(), p=eps32 * (n * d / 16) ** 0.5 * want[1].abs().max().item())
    atol["z_res"] = atol["p"] * alpha.max().item()
    for name, a, b in zip(("x_in", "p", "r", "h_pre", "h_post", "z_res", "h_res"), got, want, strict=True):
        tol = max(1e-6, atol.get(name, 0.0))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=tol, msg=lambda m: f"{name}: {m}")


def test_the_decoding_rule_and_its_split_blocks():
    assert mhc_coefficients.decoding(4, 256, 64) and not mhc_coefficients.decoding(4, 256, 65)
    assert not mhc_coefficients.decoding(4, 255, 1)  # K < 1024: one pass
    # n > 8: the same split, the Sinkhorn's rows' form on four warps (n * n entries per thread spill)
    plan = mhc_coefficients._forward_plan(9, 4096, 1, 20, False, False, torch.device(DEVICE))
    assert plan.finish.meta["num_warps"] == 4 and not plan.finish.meta["DECODE"] and plan.finish.meta["ROLES"]
    # every split of a 1-token tile at n = 4 in one load up to 128 splits, then 128 at a time
    assert mhc_coefficients.finish_split_block(128, 1, 16) == 128
    assert mhc_coefficients.finish_split_block(448, 1, 16) == 128
    assert mhc_coefficients.finish_split_block(3, 1, 64) == 4
    assert mhc_coefficients.finish_split_block(256, 8, 16) == 16
    # a projection program per SM, then one-warp finishing programs, a token each
    plan = mhc_coefficients._forward_plan(4, 4096, 1, 20, False, False, torch.device(DEVICE))
    assert plan.main.grid == (1, 128) and plan.finish.meta["num_warps"] == 1
    assert plan.finish.meta["DECODE"] and plan.finish.grid[0] == 1
    plan = mhc_coefficients._forward_plan(4, 4096, 65, 20, False, False, torch.device(DEVICE))
    assert not plan.finish.meta["DECODE"]


@triton.jit
def _sinkhorn_entries_kernel(z_ptr, out_ptr, eps, ITERS: tl.constexpr, N: tl.constexpr, HAS_EPS: tl.constexpr):
    """A matrix per program through the decoding Sinkhorn (``sinkhorn_entries``)."""
    o = tl.program_id(0).to(tl.int64) * (N * N) + tl.arange(0, 1)
    z = ()
    for e in tl.static_range(N * N):
        z = z + (tl.load(z_ptr + o + e),)
    h = sinkhorn_eps_entries(z, eps, ITERS, N) if HAS_EPS else sinkhorn_entries(z, ITERS, N)
    for e in tl.static_range(N * N):
        tl.store(out_ptr + o + e, h[e])


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("iters, eps", [(1, 0.0), (2, 0.0), (20, 0.0), (1, 1e-3), (3, 1e-3), (20, 1e-3)])
def test_the_entries_sinkhorn_matches_the_reference(n, iters, eps):
    """fp32 logits at three scales (a softmax near one-hot at the largest) against the fp64 oracle."""
    g = torch.Generator().manual_seed(n * 100 + iters)
    z = torch.randn(12, n, n, generator=g) * torch.tensor([0.1, 1.0, 8.0]).repeat_interleave(4)[:, None, None]
    out = torch.empty_like(z, device=DEVICE)
    _sinkhorn_entries_kernel[(z.shape[0],)](z.to(DEVICE), out, eps, iters, n, eps > 0)
    want = sinkhorn_eps(z.double(), iters, eps) if eps > 0 else sinkhorn_stable(z.double(), iters)
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-5, atol=1e-6)


def _sites(n, d, backend, hc_eps=0.0, seed=0):
    torch.manual_seed(seed)
    sites = []
    for _ in range(3):
        site = HyperConnection(d, n, Branch(d), init="zero", backend=backend, hc_eps=hc_eps).to(DEVICE)
        with torch.no_grad():
            for name, p in site.named_parameters():
                if not name.startswith("branch"):
                    p.add_(0.5 * torch.randn_like(p))
        sites.append(site)
    return sites


SITE_CASES = [
    ("no_grad", 4, 257, 1, 0.0, False),
    ("fp64", 3, 343, 2, 0.0, True),
    ("inference_mode", 4, 257, 3, 1e-3, True),
    ("no_grad", 2, 513, 7, 1e-3, True),
    ("inference_mode", 8, 129, 2, 0.0, False),
    ("no_grad", 16, 17, 3, 0.0, True),  # the fused maximum, n * d < 1024: one pass
    ("inference_mode", 12, 86, 2, 1e-3, True),  # n > 8 decoding: the rows' Sinkhorn
    ("no_grad", 4, 257, 0, 0.0, True),
] + ([("no_grad", 4, 4096, 64, 0.0, True), ("inference_mode", 8, 2048, 64, 1e-3, False)] if HAS_CUDA else [])


@pytest.mark.parametrize("mode, n, d, tokens, hc_eps, chain", SITE_CASES)
def test_sites_forward_only_match_the_reference(mode, n, d, tokens, hc_eps, chain):
    fused, reference = _sites(n, d, "triton", hc_eps), _sites(n, d, "torch", hc_eps)
    for a, b in zip(fused, reference):
        b.load_state_dict(a.state_dict())
    dtype = torch.float64 if mode == "fp64" else torch.float32
    if mode == "fp64":
        fused, reference = [s.double() for s in fused], [s.double() for s in reference]
    # strided streams: every other channel of a wider tensor
    x = torch.randn(tokens, n, 2 * d, device=DEVICE, dtype=dtype)[..., ::2]
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        got = through_sites(fused, x, chain)
        want = through_sites(reference, x.contiguous(), chain)
    assert got.shape == (tokens, n, d) and not got.requires_grad
    # the GPU's projection: tf32x3 products, a few ulps of fp32 apart
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 if not HAS_CUDA else 1e-3)


def test_sites_forward_only_keep_leading_dims_of_non_contiguous_streams():
    n, d = 4, 257
    sites = _sites(n, d, "triton")
    x = torch.randn(2, n, 3, d, device=DEVICE).transpose(1, 2)  # [2, 3, n, d], not contiguous
    with torch.inference_mode():
        got = through_sites(sites, x, chain=True)
        want = through_sites(sites, x.reshape(6, n, d), chain=True)
    assert got.shape == (2, 3, n, d)
    torch.testing.assert_close(got.reshape(6, n, d), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_decoding_sites_in_a_cuda_graph_and_compiled_with_reduce_overhead(tokens):
    n, d = 4, 4096
    sites = _sites(n, d, "triton")
    x = torch.randn(tokens, n, d, device=DEVICE)
    with torch.inference_mode():
        want = through_sites(sites, x, chain=True)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            through_sites(sites, x, chain=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = through_sites(sites, x, chain=True)
        graph.replay()
        # the branches' matmuls (k = 4096) may take other cuBLAS or Inductor kernels: fp32 sums in
        # another order, through three sites
        tol = dict(rtol=1e-4, atol=2e-4)
        torch.testing.assert_close(captured, want, **tol)
        compiled = torch.compile(lambda x: through_sites(sites, x, chain=False), mode="reduce-overhead")
        for _ in range(3):  # warm-up, recording, replay
            got = compiled(x)
        torch.testing.assert_close(got, want, **tol)
