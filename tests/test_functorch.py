"""``torch.func`` transforms and forward-mode AD over the layers: under ``grad``, ``vmap`` and
``jvp``, and inside a ``torch.autograd.forward_ad.dual_level``, the layers take their PyTorch ops
(the fused path's autograd Functions, which neither can run), with the values
autograd gives outside them; what cannot run says so."""

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch.func import functional_call

from mhc.layer import sinkhorn
from mhc.losses import linear_cross_entropy
from mhc.mixing import HyperConnection, LaneMixer
from tests.site_stack import model_kinds

SITES = {
    "mhc": dict(),
    "mhc hc_eps": dict(hc_eps=1e-3),
    "hc": dict(constraint="none"),
    "static mhc": dict(dynamic=False),
}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # on CUDA the fused path runs outside


def randn(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)


def site(kind, dtype, device="cpu"):
    torch.manual_seed(0)
    layer = HyperConnection(8, 4, branch=torch.nn.Linear(8, 8), **SITES[kind]).to(device, dtype)
    with torch.no_grad():  # away from the identity-like init, so every coefficient matters
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", list(SITES))
def test_grad_over_a_site_matches_autograd(kind, dtype, device):
    layer = site(kind, dtype, device)
    x, weight = (randn(2, 3, 4, 8, seed=s, dtype=dtype, device=device) for s in (1, 2))
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p, x):
        return (functional_call(layer, p, (x,)) * weight).sum()

    got_p, got_x = torch.func.grad(loss, argnums=(0, 1))(params, x)
    x_ = x.clone().requires_grad_()
    (layer(x_) * weight).sum().backward()  # outside the transform: the reference's Functions or the fused kernels
    # fp64 on CUDA: the fused kernels outside the transform compute the coefficients in fp32
    exact = dtype == torch.float64 and device == "cpu"
    tol = dict(rtol=1e-10, atol=1e-12) if exact else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_x, x_.grad, **tol)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got_p[name], p.grad, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(SITES))
def test_vmap_over_a_site_matches_a_loop(kind, device):
    layer, xs = site(kind, torch.float32, device), randn(3, 5, 4, 8, seed=3, device=device)
    got = torch.func.vmap(layer)(xs)
    torch.testing.assert_close(got, torch.stack([layer(x) for x in xs]), rtol=1e-4, atol=1e-5)


def test_jvp_of_a_site_is_the_adjoint_of_its_vjp():
    """<J v, u> = <v, J^T u>, forward mode against reverse mode, in fp64."""
    layer = site("mhc", torch.float64)
    x, v, u = (randn(3, 4, 8, seed=s, dtype=torch.float64) for s in (4, 5, 6))
    _, jv = torch.func.jvp(layer, (x,), (v,))
    _, vjp = torch.func.vjp(layer, x)
    (jtu,) = vjp(u)
    torch.testing.assert_close((jv * u).sum(), (v * jtu).sum(), rtol=1e-10, atol=1e-12)


def test_lane_mixer_and_sinkhorn_under_grad():
    mixer, x = LaneMixer(4, 8, dynamic=True), randn(6, 4, 8, seed=7)
    got = torch.func.grad(lambda x: mixer(x).square().sum())(x)
    x_ = x.clone().requires_grad_()
    mixer(x_).square().sum().backward()
    torch.testing.assert_close(got, x_.grad, rtol=1e-4, atol=1e-6)
    logits, weight = randn(5, 4, 4, seed=8), randn(5, 4, 4, seed=9)
    got = torch.func.grad(lambda z: (sinkhorn(z, 20) * weight).sum())(logits)
    z = logits.clone().requires_grad_()
    (sinkhorn(z, 20) * weight).sum().backward()
    torch.testing.assert_close(got, z.grad, rtol=1e-4, atol=1e-6)


FORWARD_AD_MODELS = {k: v for k, v in model_kinds(8, 4).items() if k != "mhc, implicit backward"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(FORWARD_AD_MODELS))
def test_forward_mode_ad_is_the_adjoint_of_the_backward(kind, device):
    """<J v, u> from a dual tensor against <v, J^T u> from the backward outside it; fp64 on the
    CPU (the PyTorch ops both ways), fp32 on CUDA (the fused kernels outside)."""
    if kind == "mhc, checkpoint_layers" and not hasattr(torch.utils.checkpoint._CheckpointFrame, "save_inputs"):
        pytest.skip("this PyTorch's checkpoint saves its inputs through an autograd.Function without jvp")
    dtype = torch.float64 if device == "cpu" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = FORWARD_AD_MODELS[kind]().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x, v, u = (randn(2, 3, 8, seed=s, dtype=dtype, device=device) for s in (10, 11, 12))
    with fwad.dual_level():
        jv = fwad.unpack_dual(model(fwad.make_dual(x, v))).tangent
    x_ = x.clone().requires_grad_()
    (model(x_) * u).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((jv * u).sum(), (v * x_.grad).sum(), **tol)


def _under_grad(call):
    torch.func.grad(lambda z: call(z).sum())(randn(3, 4, 4, seed=0))


def _under_forward_ad(call):
    with fwad.dual_level():
        z = randn(3, 4, 4, seed=0)
        call(fwad.make_dual(z, torch.ones_like(z)))


LOSS_WEIGHT = torch.randn(5, 4)


@pytest.mark.parametrize("transform", [_under_grad, _under_forward_ad], ids=["torch.func.grad", "forward_ad"])
@pytest.mark.parametrize(
    "call, what",
    [
        (lambda z: sinkhorn(z, 20, backward="implicit"), "implicit backward"),
        (lambda z: sinkhorn(z, 20, backend="triton"), "Triton Sinkhorn"),
        (lambda z: HyperConnection(4, 4, branch=torch.nn.Identity(), backend="triton")(z), "fused path"),
        (lambda z: linear_cross_entropy(z.flatten(0, 1), LOSS_WEIGHT, torch.zeros(12).long()), "linear_cross_entropy"),
    ],
    ids=["implicit", "triton sinkhorn", "triton site", "loss"],
)
def test_what_transforms_cannot_run_says_so(call, what, transform):
    with pytest.raises(RuntimeError, match=f"{what}.*torch.func transforms.*forward-mode AD"):
        transform(call)
