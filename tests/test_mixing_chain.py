"""Chained sites, ``finish(y, next=site_2)``: equal to ``site_2.split(finish(y))`` (outputs and every
gradient) on both backends and for every kind of layer, the seam op included; errors,
tuple branches, the recorder and ``torch.compile``.

On CPU the kernels run in Triton's interpreter on small shapes; tests/test_mixing_gpu.py runs the
full sizes on a GPU.
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mhc.mixing import HyperConnection, collect_h_res
from mhc.ops import mixing as mixing_ops
from tests.conftest import COMPILE_BACKEND, HAS_CUDA, KERNEL_DEVICE
from tests.site_stack import through_sites
from tests.test_mixing_fused import Branch


def assert_all_close(got, want, rtol, atol):
    """Every entry within ``atol * max(1, max |want|) + rtol |want|``: sums of many terms (the
    gradients of a chain reach ~100 here) carry rounding errors that scale with the tensor."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] is not None, k
        scale = max(1.0, want[k].abs().amax().item()) if want[k].numel() else 1.0
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol * scale, msg=lambda m: f"{k}: {m}")


DEVICE = KERNEL_DEVICE
KINDS = {
    "mhc": ("sinkhorn", True),
    "static-mhc": ("sinkhorn", False),
    "hc": ("none", True),
    "static-hc": ("none", False),
}


def make_chain(kinds, dim, n, backend, seed, scale=0.5, **kwargs):
    """Sites of the given kinds, each with its own branch and randomised parameters."""
    torch.manual_seed(seed)
    sites = []
    for kind in kinds:
        constraint, dynamic = KINDS[kind]
        init = "zero" if constraint == "sinkhorn" else "residual"
        site_kwargs = kwargs if constraint == "sinkhorn" else {k: v for k, v in kwargs.items() if k != "hc_eps"}
        site = HyperConnection(
            dim, n, Branch(dim), constraint=constraint, dynamic=dynamic, init=init, backend=backend, **site_kwargs
        ).to(DEVICE)
        with torch.no_grad():
            for name, p in site.named_parameters():
                if not name.startswith("branch"):
                    p.add_(torch.randn_like(p) * scale)
        sites.append(site)
    return sites


def same_chain(sites, backend):
    """A copy of ``sites`` with the same parameters on another backend."""
    copies = copy.deepcopy(sites)
    for site in copies:
        site.backend = backend
    return copies


def run_chain(sites, x, grad, chained: bool):
    """Output, input gradient and every parameter gradient of the sites run one after another,
    ``finish(y, next=...)`` when ``chained``, ``next.split(finish(y))`` otherwise."""
    x = x.detach().clone().requires_grad_()
    for site in sites:
        site.zero_grad(set_to_none=True)
    x_in, finish = sites[0].split(x)
    for site, nxt in zip(sites, sites[1:] + [None]):
        y = site.branch(x_in)
        if nxt is None:
            out = finish(y)
        elif chained:
            x_in, finish = finish(y, next=nxt)
        else:
            x_in, finish = nxt.split(finish(y))
    out.backward(grad)
    got = {"out": out.detach(), "x": x.grad}
    for i, site in enumerate(sites):
        got.update({f"{i}.{k}": p.grad for k, p in site.named_parameters()})
    return got


@pytest.mark.parametrize("backend", ["triton", "torch"])
# each example runs three chains (chained, unchained, the reference): at most 12 examples
@settings(max_examples=min(12, settings.default.max_examples))
@given(
    # on a GPU every n compiles its own kernels: a few there, more in the interpreter
    n=st.sampled_from([1, 4]) if HAS_CUDA else st.integers(1, 8),
    dim=st.sampled_from([1, 7, 24, 33]),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=2, max_size=3),
    hc_eps=st.sampled_from([0.0, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_chained_equals_unchained(backend, n, dim, lead, kinds, hc_eps, seed, nan_poison):
    # the seam is the same op at any iteration count: a few in the interpreter, the default on a GPU
    iters = 20 if HAS_CUDA else 5
    sites = make_chain(kinds, dim, n, backend, seed, hc_eps=hc_eps, sinkhorn_iters=iters)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, dim, generator=g).to(DEVICE)
    grad = torch.randn(*lead, n, dim, generator=g).to(DEVICE)
    chained = run_chain(sites, x, grad, chained=True)
    # the seam's backward sums the coefficient gradients in another order: a few fp32 roundings,
    # amplified in the gates' gradients (one sum over every token with cancellation,
    # docs/mixing.md "Accuracy")
    assert_all_close(chained, run_chain(sites, x, grad, chained=False), rtol=5e-5, atol=1e-5)
    if backend == "triton":
        assert_all_close(chained, run_chain(same_chain(sites, "torch"), x, grad, chained=False), rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("n", [8, 12])  # the unrolled and the wide mixing kernels
def test_wide_chains(n):
    sites = make_chain(["mhc", "mhc", "mhc"], 6, n, "triton", seed=1, scale=0.2)
    x, grad = torch.randn(2, 5, n, 6, device=DEVICE), torch.randn(2, 5, n, 6, device=DEVICE)
    want = run_chain(same_chain(sites, "torch"), x, grad, chained=False)
    assert_all_close(run_chain(sites, x, grad, chained=True), want, rtol=5e-5, atol=5e-5)


def test_one_seam_op_between_dynamic_mhc_sites(monkeypatch):
    """Chained dynamic mHC sites hand over through one seam op each (the composition would run a
    post-mix op and a coefficient op); other kinds of next site are composed."""
    seams = []
    original = mixing_ops.MHCSeamFunction.apply
    monkeypatch.setattr(mixing_ops.MHCSeamFunction, "apply", lambda *a: seams.append(1) or original(*a))
    sites = make_chain(["mhc", "mhc", "static-mhc", "mhc"], 8, 4, "triton", seed=2)
    x = torch.randn(7, 4, 8, device=DEVICE)
    run_chain(sites, x, torch.randn_like(x), chained=True)
    assert len(seams) == 2  # mhc -> mhc and static-mhc -> mhc; mhc -> static-mhc is composed


def bf16_failures(sites, x, grad):
    """Keys whose bf16 chained error breaks the rule: the streams, their gradient and every tensor
    parameter's gradient meet the three-way rule (error against fp64 at most twice the reference
    path's bf16 error); the biases' and gates' gradients, single sums over every token whose error
    is one draw of many roundings (docs/mixing.md, "Accuracy"; the single-layer tests judge them
    over several draws), are as accurate chained as unchained. ``{key: (chained, reference,
    unchained)}`` relative errors."""
    exact = run_chain([s.double() for s in same_chain(sites, "torch")], x.double(), grad.double(), chained=False)
    low_ref = same_chain(sites, "torch")
    for site in sites + low_ref:
        site.branch.to(torch.bfloat16)
    results = [
        run_chain(low_ref, x.bfloat16(), grad.bfloat16(), chained=False),
        run_chain(sites, x.bfloat16(), grad.bfloat16(), chained=True),
        run_chain(sites, x.bfloat16(), grad.bfloat16(), chained=False),
    ]
    failed = {}
    for k in exact:
        if ".branch." in k:
            continue
        err_ref, err, err_un = (((r[k].double() - exact[k]).norm() / exact[k].norm()).item() for r in results)
        sum_over_tokens = k.endswith(("alpha", "bias"))  # branch parameters are skipped above
        if err > 1.25 * err_un + 1e-3 or (not sum_over_tokens and err > 2 * err_ref + 1e-6):
            failed[k] = (err, err_ref, err_un)
    return failed


def test_low_precision_three_way():
    sites = make_chain(["mhc", "mhc", "mhc"], 40, 4, "triton", seed=3)
    x = torch.randn(3, 30, 4, 40, device=DEVICE)
    failed = bf16_failures(sites, x, torch.randn_like(x))
    assert not failed, failed


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_next_must_be_a_site_with_the_same_shape(backend):
    site, other = make_chain(["mhc", "mhc"], 6, 2, backend, seed=4)
    x = torch.randn(3, 2, 6, device=DEVICE)
    x_in, finish = site.split(x)
    with pytest.raises(TypeError, match="next must be a HyperConnection"):
        finish(site.branch(x_in), next=nn.Linear(6, 6))
    for wrong in (HyperConnection(6, 3, backend=backend), HyperConnection(5, 2, backend=backend)):
        with pytest.raises(ValueError, match="same n_streams and dim"):
            finish(site.branch(x_in), next=wrong.to(DEVICE))
    x_in_2, finish_2 = finish(site.branch(x_in), next=other)
    assert x_in_2.shape == (3, 6) and finish_2(other.branch(x_in_2)).shape == x.shape


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tuple_branch_extras_follow_the_next_site(backend):
    site, other = make_chain(["mhc", "mhc"], 6, 3, backend, seed=5)
    x = torch.randn(4, 3, 6, device=DEVICE)
    x_in, finish = site.split(x)
    y = site.branch(x_in)
    x_in_2, finish_2, cache, extra = finish((y, "cache", 7), next=other)
    assert (cache, extra) == ("cache", 7)
    want_in, _ = other.split(site.split(x)[1](y))
    torch.testing.assert_close(x_in_2, want_in, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_recorder_sees_every_site_of_a_chain(backend):
    sites = make_chain(["mhc", "static-mhc", "mhc"], 6, 3, backend, seed=6)
    model = nn.ModuleList(sites)
    x = torch.randn(5, 3, 6, device=DEVICE)
    with collect_h_res(model) as h_res:
        run_chain(sites, x, torch.randn_like(x), chained=True)
    with collect_h_res(model) as want:
        run_chain(sites, x, torch.randn_like(x), chained=False)
    assert len(h_res) == 3
    for a, b in zip(h_res, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_fullgraph_matches_eager():
    sites = make_chain(["mhc", "mhc", "mhc"], 12, 3, "triton", seed=7)
    x, grad = torch.randn(4, 3, 12, device=DEVICE), torch.randn(4, 3, 12, device=DEVICE)
    model = nn.ModuleList(sites)

    def forward(x):
        return through_sites(model, x, chain=True)

    want = run_chain(sites, x, grad, chained=True)
    compiled = torch.compile(forward, fullgraph=True, backend=COMPILE_BACKEND)
    xc = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = compiled(xc)
    out.backward(grad)
    got = {"out": out.detach(), "x": xc.grad}
    for i, site in enumerate(sites):
        got.update({f"{i}.{k}": p.grad for k, p in site.named_parameters()})
    assert_all_close(got, want, rtol=1e-5, atol=1e-5)
