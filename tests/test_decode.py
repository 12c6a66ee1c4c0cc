"""Decoding: the fused path forward only, at few tokens.

- The seam's forward-only launcher (``mhc.kernels.mhc_coefficients.seam_fwd``): where the
  coefficients are split over ``K`` the projection computes the previous site's post-mix as it
  reads it; its outputs equal the post-mix kernel followed by the coefficient kernels, and the
  fp64 reference within rounding, at 0 to 64 tokens, n = 1 to the fused maximum, odd widths,
  strided streams.
- Chained sites under ``torch.no_grad()`` and ``torch.inference_mode()`` (where the site takes
  that launcher) equal the same sites recording a graph, and the reference path.

CPU: Triton's interpreter, with an H100's SM count given to the launchers so that few tokens take
the split (the CPU's stand-in count is 4); GPU: the device's own count, at model widths too.
"""

import pytest
import torch

from mhc import reference
from mhc.kernels import mhc_coefficients
from mhc.kernels._launch import forget_launch_plans
from mhc.kernels.stream_mix import stream_mix_fwd
from mhc.mixing import HyperConnection
from tests.conftest import HAS_CUDA, KERNEL_DEVICE
from tests.site_stack import through_sites
from tests.test_mixing_fused import Branch

DEVICE = KERNEL_DEVICE
TOKENS = [0, 1, 2, 3, 7, 64]
# (n, d): up to n = 8 widths that take the decoding split over K (n * d >= 1024), odd ones among
# them (d = 256: blocks of 64 columns lie in one stream); n = 16, the fused maximum, runs in one pass
SHAPES = [(1, 1025), (2, 513), (3, 343), (4, 257), (4, 256), (5, 205), (8, 129), (16, 17)]
if HAS_CUDA:
    SHAPES += [(4, 4096), (4, 7168), (8, 2048)]


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: 132)


def _seam_inputs(tokens, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    K, M = n * d, 2 * n + n * n
    x = torch.randn(tokens, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(tokens, d, generator=g, dtype=torch.float64)
    h_post = 2 * torch.rand(tokens, n, generator=g)
    h_res = torch.softmax(torch.randn(tokens, n, n, generator=g), -1)
    phi = torch.randn(K, M, generator=g) / K**0.5
    alpha, bias = torch.rand(3, generator=g) + 0.5, 0.1 * torch.randn(M, generator=g)
    cast = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return (cast(x), cast(y), h_post.to(DEVICE), h_res.to(DEVICE), phi.to(DEVICE), alpha.to(DEVICE), bias.to(DEVICE))


def _split(n, d, tokens):
    plan = mhc_coefficients._forward_plan(n, d, tokens, 20, False, False, torch.device(DEVICE))
    return plan.finish is not None


# the interpreter takes about 20 s a case at 64 tokens: there, one width at 64
CASES = [(n, d, t) for n, d in SHAPES for t in TOKENS if HAS_CUDA or t < 64 or (n, d) == (4, 257)]


@pytest.mark.parametrize("n, d, tokens", CASES)
def test_the_seam_forward_equals_the_post_mix_then_the_coefficients(n, d, tokens, monkeypatch):
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, y, h_post, h_res, phi, alpha, bias = _seam_inputs(tokens, n, d, dtype)
    mix = (x, h_res, y, h_post)
    want = (*mhc_coefficients.coefficients_fwd(stream_mix_fwd(*mix), phi, alpha, bias, 20, 1e-6), stream_mix_fwd(*mix))
    if tokens and _split(n, d, tokens):  # the post-mix runs in the projection: the kernel alone is not called

        def refuse(*args):
            raise AssertionError("the post-mix kernel ran")

        monkeypatch.setattr(mhc_coefficients, "stream_mix_fwd_unchecked", refuse)
    got = mhc_coefficients.seam_fwd(x, y, h_post, h_res, phi, alpha, bias, 20, 1e-6)
    names = ("x_in", "p", "r", "h_pre", "h_post", "z_res", "h_res", "x_next")
    for name, a, b in zip(names, got, want, strict=True):
        # the same sums in the same order: equal, up to the order a compiled reduction picks
        tol = dict(rtol=0, atol=0) if not HAS_CUDA else dict(rtol=1e-5, atol=1e-5)
        if name in ("x_in", "x_next") and HAS_CUDA:
            tol = dict(rtol=1e-2, atol=1e-2)  # bf16: one rounding of a value either side
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n, d", [(4, 257), (8, 129)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_the_seam_forward_matches_the_fp64_reference(n, d, tokens):
    x, y, h_post, h_res, phi, alpha, bias = _seam_inputs(tokens, n, d, torch.float64, seed=1)
    x_in, p, r, h_pre, h_post_2, z_res, h_res_2, x_next = mhc_coefficients.seam_fwd(
        x, y, h_post, h_res, phi, alpha, bias, 30, 1e-6
    )
    want_next = reference.post_mix(x, h_res.double(), y, h_post.double())
    torch.testing.assert_close(x_next, want_next, rtol=1e-5, atol=1e-5)  # the kernels sum in fp32
    logits = reference.rms_inverse(want_next.flatten(-2), 1e-6) * (want_next.flatten(-2) @ phi.double())
    torch.testing.assert_close(p.double(), logits, rtol=1e-5, atol=1e-5)
    want_pre = torch.sigmoid(alpha[0] * logits[:, :n] + bias[:n])
    torch.testing.assert_close(h_pre.double(), want_pre, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_in, reference.pre_mix(want_next, want_pre), rtol=1e-5, atol=1e-5)
    want_res = reference.sinkhorn_stable((alpha[2] * logits[:, 2 * n :] + bias[2 * n :]).view(tokens, n, n), 30)
    torch.testing.assert_close(h_res_2.double(), want_res, rtol=1e-5, atol=1e-5)


def test_the_seam_forward_reads_strided_streams():
    n, d, tokens = 4, 257, 3
    x, y, h_post, h_res, phi, alpha, bias = _seam_inputs(tokens, n, d, torch.float32)
    x_wide = torch.zeros(tokens, n, 2 * d, device=DEVICE).copy_(torch.cat([x, x], -1))[..., ::2]
    y_wide = torch.stack([y, y], -1)[..., 0]  # a view with stride 2
    assert not x_wide.is_contiguous() and not y_wide.is_contiguous()
    rest = (h_post, h_res, phi, alpha, bias, 20, 1e-6)
    got = mhc_coefficients.seam_fwd(x_wide, y_wide, *rest)
    want = mhc_coefficients.seam_fwd(x_wide.contiguous(), y_wide.contiguous(), *rest)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("n, d, tokens", [c for c in CASES if c[0] <= 8 and c[2] in (1, 3, 64)])
@pytest.mark.parametrize("hc_eps", [0.0, 1e-3])
def test_the_decoding_tiles_match_one_pass(n, d, tokens, hc_eps, monkeypatch, nan_poison):
    x, _, _, _, phi, alpha, bias = _seam_inputs(tokens, n, d, torch.float32, seed=2)
    plan = mhc_coefficients._forward_plan(n, d, tokens, 20, hc_eps > 0, False, x.device)
    assert mhc_coefficients.decoding(n, d, tokens) and plan.finish.meta["BLOCK_T"] == 1
    got = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6, hc_eps)
    monkeypatch.setattr(mhc_coefficients, "coefficients_split_config", lambda *args: None)
    forget_launch_plans()
    want = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6, hc_eps)
    for name, a, b in zip(("x_in", "p", "r", "h_pre", "h_post", "z_res", "h_res"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_seam_forward_refuses_wrong_arguments():
    x, y, h_post, h_res, phi, alpha, bias = _seam_inputs(2, 4, 257, torch.float32)
    with pytest.raises(ValueError, match="y must have shape"):
        mhc_coefficients.seam_fwd(x, y[:1], h_post, h_res, phi, alpha, bias, 20, 1e-6)
    with pytest.raises(TypeError, match="h_res must be"):
        mhc_coefficients.seam_fwd(x, y, h_post, h_res.double(), phi, alpha, bias, 20, 1e-6)
    with pytest.raises(ValueError, match="phi must have shape"):
        mhc_coefficients.seam_fwd(x, y, h_post, h_res, phi[1:], alpha, bias, 20, 1e-6)
    with pytest.raises(ValueError, match="iters"):
        mhc_coefficients.seam_fwd(x, y, h_post, h_res, phi, alpha, bias, 0, 1e-6)


def _chain(n, d, backend, seed=0, hc_eps=0.0):
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


@pytest.mark.parametrize(
    "mode, n, d, tokens, hc_eps",
    [
        ("no_grad", 4, 257, 1, 0.0),
        ("inference_mode", 4, 257, 3, 1e-3),
        ("no_grad", 2, 513, 7, 1e-3),
        ("inference_mode", 8, 129, 2, 0.0),
        ("no_grad", 4, 257, 0, 0.0),
    ]
    + ([("no_grad", 4, 4096, 64, 0.0), ("inference_mode", 8, 2048, 64, 1e-3)] if HAS_CUDA else []),
)
def test_chained_sites_forward_only_equal_the_recorded_forward(mode, n, d, tokens, hc_eps):
    sites = _chain(n, d, "triton", hc_eps=hc_eps)
    x = torch.randn(tokens, n, d, device=DEVICE)
    want = through_sites(sites, x.requires_grad_(), chain=True)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        got = through_sites(sites, x.detach(), chain=True)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach(), rtol=0 if not HAS_CUDA else 1e-5, atol=0 if not HAS_CUDA else 1e-5)
    reference_sites = _chain(n, d, "torch", hc_eps=hc_eps)
    for fused, ref in zip(sites, reference_sites):
        ref.load_state_dict(fused.state_dict())
    with torch.no_grad():
        ref = through_sites(reference_sites, x.detach(), chain=True)
    # the GPU's projection: tf32x3 products, a few ulps of fp32 apart
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 if not HAS_CUDA else 1e-3)


def test_chained_sites_forward_only_keep_leading_dims_and_non_contiguous_streams():
    n, d = 4, 257
    sites = _chain(n, d, "triton")
    x = torch.randn(2, n, 3, d, device=DEVICE).transpose(1, 2)  # [2, 3, n, d], not contiguous
    with torch.no_grad():
        got = through_sites(sites, x, chain=True)
        want = through_sites(sites, x.contiguous(), chain=False)
    assert got.shape == (2, 3, n, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
