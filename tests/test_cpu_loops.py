"""The CPU path's C loops (``mhc.cpu``) against the PyTorch formulas they replace: Sinkhorn and its
exact backward, the pre-mix and post-mix with their backwards, the normalised projection; when
the layers take them; and how the library is built."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mhc import cpu, reference
from mhc.cpu import _build
from mhc.cpu import mixing as cpu_mixing
from mhc.cpu import projection as cpu_projection
from mhc.cpu import site_start as cpu_site_start
from mhc.layer import sinkhorn
from mhc.mixing import HyperConnection

needs_loops = pytest.mark.skipif(not cpu.available(), reason=f"no C loops here: {cpu.build_error()}")


def randn(*shape, seed, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.fixture
def unwritten_is_nan(monkeypatch):
    """The launchers' outputs start as NaN, so an element the loops do not write fails the test."""
    empty_like, new_empty = torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: new_empty(*a, **k).fill_(float("nan")))


def test_loops_build_where_a_compiler_is_found():
    if os.environ.get("MHC_CPU_KERNELS") == "0" or not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here, or the loops are turned off")
    assert cpu.available(), cpu.build_error()
    assert cpu.path_name() == "C loops" and cpu.build_error() is None


# ---------------------------------------------------------------- Sinkhorn


@needs_loops
@given(
    n=st.integers(1, cpu.MAX_SINKHORN_N),
    tokens=st.integers(1, 40),  # blocks of 16 and their tails
    iters=st.integers(1, 25),
    eps=st.sampled_from([0.0, 1e-6, 0.05]),
    scale=st.floats(0.1, 8.0),
    seed=st.integers(0, 2**16),
)
def test_sinkhorn_loops_match_autograd_of_the_fp64_loop(n, tokens, iters, eps, scale, seed):
    logits = randn(tokens, n, n, seed=seed, scale=scale)
    grad_out = randn(tokens, n, n, seed=seed + 1)
    x = logits.double().requires_grad_()
    loop = reference.sinkhorn_eps(x, iters, eps) if eps > 0 else reference.sinkhorn_stable(x, iters)
    (want,) = torch.autograd.grad(loop, x, grad_out.double())
    out = cpu.sinkhorn_forward(logits, iters, eps)
    torch.testing.assert_close(out.double(), loop.detach(), rtol=0, atol=2e-5)
    got = cpu.sinkhorn_backward(logits, grad_out, iters, eps)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item() + 1e-6)


@needs_loops
def test_sinkhorn_loops_write_every_token(unwritten_is_nan):
    logits, grad_out = randn(37, 5, 5, seed=0), randn(37, 5, 5, seed=1)
    assert cpu.sinkhorn_forward(logits, 20, 0.0).isfinite().all()
    assert cpu.sinkhorn_backward(logits, grad_out, 20, 0.0).isfinite().all()


@needs_loops
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_non_finite_logits_act_per_matrix(eps):
    """As on the other paths: a NaN or a +inf makes its matrix NaN; a single -inf entry is a
    structural zero (eps there with eps > 0); the other matrices are untouched."""
    logits = randn(20, 4, 4, seed=3)
    clean = sinkhorn(logits, 20, eps=eps)
    bad = logits.clone()
    bad[2, 1, 3], bad[5, 0, 0], bad[9, 2, 2] = float("nan"), float("inf"), float("-inf")
    out = sinkhorn(bad, 20, eps=eps)
    assert out[2].isnan().all() and out[5].isnan().all() and out[9].isfinite().all()
    want = reference.sinkhorn_eps(bad.double(), 20, eps) if eps > 0 else reference.sinkhorn_stable(bad.double(), 20)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5, equal_nan=True)
    others = [i for i in range(20) if i not in (2, 5, 9)]
    assert torch.equal(out[others], clean[others])


@needs_loops
def test_sinkhorn_on_the_loops_keeps_only_the_logits():
    """The backward recomputes the iterates: what autograd keeps is the logits alone."""
    saved = []
    x = randn(10, 4, 4, seed=0).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sinkhorn(x, 20, backend="torch")
    assert saved == [x.numel()]


@needs_loops
def test_sinkhorn_double_backward_on_the_loops():
    x = randn(6, 4, 4, seed=4).requires_grad_()
    g, v = randn(6, 4, 4, seed=5), randn(6, 4, 4, seed=6)

    def second(logits_to_out):
        (grad,) = torch.autograd.grad(logits_to_out(x), x, g, create_graph=True)
        return torch.autograd.grad(grad, x, v)[0]

    want = second(lambda t: reference.sinkhorn_stable(t, 10))
    torch.testing.assert_close(second(lambda t: sinkhorn(t, 10, backend="torch")), want, rtol=1e-4, atol=1e-5)


@needs_loops
@pytest.mark.parametrize("n", [16, 17])
def test_sinkhorn_above_the_loops_n_runs_pytorch_ops(n):
    x = randn(3, n, n, seed=n)
    torch.testing.assert_close(sinkhorn(x, 20, backend="torch"), reference.sinkhorn_stable(x, 20), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- mixing


def post_mix_formula(x, h_res, y, h_post):
    return torch.einsum("...ij,...jd->...id", h_res, x) + h_post.unsqueeze(-1) * y.unsqueeze(-2)


def pre_mix_formula(x, h_pre):
    return (h_pre.unsqueeze(-1) * x).sum(-2)


def mixing_inputs(lead, n, d, seed):
    x = randn(*lead, n, d, seed=seed).requires_grad_()
    h_res = randn(*lead, n, n, seed=seed + 1).requires_grad_()
    y = randn(*lead, d, seed=seed + 2).requires_grad_()
    h_post = randn(*lead, n, seed=seed + 3).requires_grad_()
    return x, h_res, y, h_post


@needs_loops
@given(
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    n=st.integers(1, 6),
    d=st.integers(1, 70),  # the dot products' 8 lanes and their tails
    seed=st.integers(0, 2**16),
)
def test_mixing_loops_match_the_formulas(lead, n, d, seed):
    x, h_res, y, h_post = mixing_inputs(lead, n, d, seed)
    grad = randn(*lead, n, d, seed=seed + 4)
    inputs = (x, h_res, y, h_post)
    tol = dict(rtol=1e-5, atol=1e-5)
    want = post_mix_formula(*inputs)
    got = cpu_mixing.post_mix(*inputs)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(g, w, **tol)
    grad_in = randn(*lead, d, seed=seed + 5)
    want, got = pre_mix_formula(x, h_post), cpu_mixing.pre_mix(x, h_post)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(torch.autograd.grad(got, (x, h_post), grad_in), torch.autograd.grad(want, (x, h_post), grad_in)):
        torch.testing.assert_close(g, w, **tol)


@needs_loops
def test_mixing_loops_write_every_output(unwritten_is_nan):
    x, h_res, y, h_post = (t.detach() for t in mixing_inputs((19,), 3, 13, 0))
    grad = randn(19, 3, 13, seed=9)
    assert cpu.post_mix_forward(x, h_res, y, h_post).isfinite().all()
    assert all(g.isfinite().all() for g in cpu.post_mix_backward(x, h_res, y, h_post, grad))
    assert cpu.pre_mix_forward(x, h_post).isfinite().all()
    assert all(g.isfinite().all() for g in cpu.pre_mix_backward(x, h_post, grad[:, 0].contiguous()))


@pytest.fixture
def threads():
    """Sets PyTorch's intra-op thread count (the loops share its OpenMP team) for the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_loops
def test_loops_over_several_threads_match_one_thread_bit_for_bit(threads):
    """Above their size thresholds the loops split the tokens over the threads: every token's
    values must not depend on how many there are, and must still match the formulas."""
    logits, grad_logits = randn(16 * 9 + 5, 4, 4, seed=0, scale=3.0), randn(16 * 9 + 5, 4, 4, seed=1)
    x, h_res, y, h_post = (t.detach() for t in mixing_inputs((301,), 4, 64, 2))
    grad, grad_in = randn(301, 4, 64, seed=3), randn(301, 64, seed=4)
    calls = {
        "sinkhorn": lambda: (cpu.sinkhorn_forward(logits, 20, 0.0), cpu.sinkhorn_backward(logits, grad_logits, 20, 0)),
        "sinkhorn_eps": lambda: (cpu.sinkhorn_backward(logits, grad_logits, 7, 1e-3),),
        "post_mix": lambda: (
            cpu.post_mix_forward(x, h_res, y, h_post),
            *cpu.post_mix_backward(x, h_res, y, h_post, grad),
        ),
        "pre_mix": lambda: (cpu.pre_mix_forward(x, h_post), *cpu.pre_mix_backward(x, h_post, grad_in)),
    }
    start = start_inputs((301,), 4, 64, 5)
    proj = start[0].view(301, -1) @ start[1]
    calls["site_start"] = lambda: cpu.site_start_forward(start[0], proj, *start[2:], 20, 1e-6, 0.0)
    site_grads = grad_in, randn(301, 4, seed=6), randn(301, 4, 4, seed=7)
    inv_rms = calls["site_start"]()[-1]
    calls["site_start_backward"] = lambda: cpu.site_start_backward(
        start[0], proj, *start[2:], inv_rms, *site_grads, 20, 0.0
    )
    threads(1)
    one = {name: call() for name, call in calls.items()}
    threads(3)
    for name, call in calls.items():
        for got, want in zip(call(), one[name]):
            assert torch.equal(got, want), name
    few = logits[: 16 * 5]  # five blocks on more threads than blocks
    threads(16)
    assert torch.equal(cpu.sinkhorn_forward(few, 20, 0.0), one["sinkhorn"][0][: 16 * 5])
    torch.testing.assert_close(one["post_mix"][0], post_mix_formula(x, h_res, y, h_post), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one["pre_mix"][0], pre_mix_formula(x, h_post), rtol=1e-5, atol=1e-5)
    want = reference.sinkhorn_stable(logits.double(), 20)
    torch.testing.assert_close(one["sinkhorn"][0].double(), want, rtol=0, atol=2e-5)


def second_order(mix, inputs, grad):
    """Gradients w.r.t. the inputs and ``grad`` of a random direction through the first-order
    gradients of ``mix``, built with ``create_graph=True``."""
    first = torch.autograd.grad(mix(*inputs), inputs, grad, create_graph=True)
    directions = [randn(*f.shape, seed=20 + i) for i, f in enumerate(first)]
    total = sum((f * v).sum() for f, v in zip(first, directions))
    return torch.autograd.grad(total, (*inputs, grad), allow_unused=True)


@needs_loops
@pytest.mark.parametrize("which", ["pre_mix", "post_mix"])
def test_mixing_double_backward(which):
    x, h_res, y, h_post = mixing_inputs((4,), 3, 5, 1)
    if which == "pre_mix":
        inputs, grad, formula = (x, h_post), randn(4, 5, seed=7), pre_mix_formula
    else:
        inputs, grad, formula = (x, h_res, y, h_post), randn(4, 3, 5, seed=7), post_mix_formula
    grad.requires_grad_()
    got = second_order(getattr(cpu_mixing, which), inputs, grad)
    want = second_order(formula, inputs, grad)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class Marked(torch.Tensor):
    """A tensor subclass: what a tensor-parallel plan's asynchronous results look like to the loops."""


@needs_loops
def test_gradients_of_a_subclass_take_the_formulas():
    """The backward reads no subclass's data pointer (an asynchronous collective's holds nothing
    yet): a subclass gradient takes the PyTorch formulas, with the same values."""
    inputs = mixing_inputs((6,), 4, 9, 2)
    grad = randn(6, 4, 9, seed=3)
    want = torch.autograd.grad(cpu_mixing.post_mix(*inputs), inputs, grad)
    got = torch.autograd.grad(cpu_mixing.post_mix(*inputs), inputs, grad.as_subclass(Marked))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.as_subclass(torch.Tensor), w, rtol=1e-5, atol=1e-6)
    x, h_pre, grad_in = inputs[0], inputs[3], randn(6, 9, seed=4)
    want = torch.autograd.grad(cpu_mixing.pre_mix(x, h_pre), (x, h_pre), grad_in)
    got = torch.autograd.grad(cpu_mixing.pre_mix(x, h_pre), (x, h_pre), grad_in.as_subclass(Marked))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.as_subclass(torch.Tensor), w, rtol=1e-5, atol=1e-6)
    logits = randn(5, 4, 4, seed=5).requires_grad_()
    grad_out = randn(5, 4, 4, seed=6)
    (want,) = torch.autograd.grad(sinkhorn(logits, 20), logits, grad_out)
    (got,) = torch.autograd.grad(sinkhorn(logits, 20), logits, grad_out.as_subclass(Marked))
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=1e-4, atol=1e-6)


@needs_loops
@pytest.mark.parametrize(
    "bad",
    [
        lambda x: x.double(),
        lambda x: x.transpose(0, 1),
        lambda x: x[:, :, :-1],
        lambda x: x[:1].expand(x.shape),
        lambda x: x.as_subclass(Marked),
    ],
    ids=["fp64", "transposed", "sliced", "stride 0", "subclass"],
)
def test_launchers_refuse_layouts_the_loops_do_not_read(bad):
    x, _, _, h = (t.detach() for t in mixing_inputs((4,), 4, 6, 0))
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor .not a subclass."):
        cpu.pre_mix_forward(bad(x), h)


@needs_loops
def test_launchers_refuse_n_above_the_sinkhorn_limit():
    with pytest.raises(ValueError, match="n <= 16"):
        cpu.sinkhorn_forward(torch.zeros(2, 17, 17), 20, 0.0)


# ---------------------------------------------------------------- a site's start


class StartOf(torch.nn.Module):
    """The package's reference for a site's start: ``DynamicMHC.reference`` and the pre-mix
    formula, as PyTorch ops (fp64 inputs never take the loops)."""

    def __init__(self, site):
        super().__init__()
        self.site = site

    def forward(self, x):
        h_pre, h_post, h_res = self.site.source.reference(self.site, x)
        return pre_mix_formula(x, h_pre), h_post, h_res


def start_oracle(x, phi, alpha, bias, iters, rms_eps, hc_eps):
    n, d = x.shape[-2:]
    site = HyperConnection(d, n, backend="torch", sinkhorn_iters=iters, rms_eps=rms_eps, hc_eps=hc_eps)
    parameters = {"site.phi": phi, "site.alpha": alpha, "site.bias": bias}
    return torch.func.functional_call(StartOf(site), parameters, (x,))


def start_inputs(lead, n, d, seed, dtype=torch.float32):
    m = 2 * n + n * n
    return (
        randn(*lead, n, d, seed=seed, dtype=dtype),
        randn(n * d, m, seed=seed + 1, scale=0.3, dtype=dtype),
        randn(3, seed=seed + 2, dtype=dtype),
        randn(m, seed=seed + 3, dtype=dtype),
    )


def close_to_max(got, want, rtol):
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * want.abs().max().item() + 1e-6)


@needs_loops
@given(
    lead=st.lists(st.integers(1, 7), min_size=0, max_size=2),  # no leading dim, and blocks of 16 with tails
    n=st.integers(1, 6),
    d=st.integers(1, 40),
    iters=st.integers(1, 25),
    hc_eps=st.sampled_from([0.0, 1e-3]),
    given_grads=st.lists(st.booleans(), min_size=3, max_size=3).filter(any),
    wanted=st.lists(st.booleans(), min_size=4, max_size=4).filter(any),
    seed=st.integers(0, 2**16),
)
def test_site_start_matches_the_fp64_reference(lead, n, d, iters, hc_eps, given_grads, wanted, seed):
    """Forward and the gradients of every input that wants one, for any subset of the outputs'
    gradients (the others ``None``), against the reference path in fp64."""
    inputs = [t.requires_grad_(w) for t, w in zip(start_inputs(lead, n, d, seed), wanted)]
    doubles = [t.detach().double().requires_grad_(w) for t, w in zip(inputs, wanted)]
    got = cpu_site_start.site_start(*inputs, iters, 1e-6, hc_eps)
    want = start_oracle(*doubles, iters, 1e-6, hc_eps)
    for g, w in zip(got, want):
        close_to_max(g, w.detach(), 1e-5)
    grads = [
        randn(*w.shape, seed=seed + 10 + i) if given else None for i, (w, given) in enumerate(zip(want, given_grads))
    ]
    outputs = [(g, w, grad) for g, w, grad in zip(got, want, grads) if grad is not None]
    got_grads = torch.autograd.grad(
        [o[0] for o in outputs], [t for t in inputs if t.requires_grad], [o[2] for o in outputs], allow_unused=True
    )
    want_grads = torch.autograd.grad(
        [o[1] for o in outputs],
        [t for t in doubles if t.requires_grad],
        [o[2].double() for o in outputs],
        allow_unused=True,
    )
    for g, w in zip(got_grads, want_grads):
        if w is None:  # an input no given gradient reaches
            assert g is None or not g.any()
        else:
            close_to_max(g, w, 1e-4)


@needs_loops
def test_site_start_double_backward():
    inputs = [t.requires_grad_() for t in start_inputs((5,), 3, 6, 1)]
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    grads = [randn(5, 6, seed=2), randn(5, 3, seed=3), randn(5, 3, 3, seed=4)]

    def second(start, ins, cast):
        gs = [cast(g).requires_grad_() for g in grads]
        first = torch.autograd.grad(start(*ins, 20, 1e-6, 0.0), ins, gs, create_graph=True)
        total = sum((f * cast(randn(*f.shape, seed=20 + i))).sum() for i, f in enumerate(first))
        return torch.autograd.grad(total, (*ins, *gs))

    got = second(cpu_site_start.site_start, inputs, lambda t: t)
    want = second(start_oracle, doubles, lambda t: t.double())
    for g, w in zip(got, want):
        close_to_max(g, w, 1e-4)


@needs_loops
def test_site_start_keeps_x_the_projection_and_three_values_per_token():
    """No iterate, no streams-sized temporary: x itself (and its copy only where x is not
    contiguous, such as the stride-0 view of expanded streams), the parameters, the projection,
    ``1 / RMS`` and ``h_pre``."""
    T, n, d = 20, 4, 8
    m = 2 * n + n * n
    x, phi, alpha, bias = (t.requires_grad_() for t in start_inputs((T,), n, d, 0))
    h = randn(T, d, seed=5).requires_grad_()
    parameters = phi.numel() + alpha.numel() + bias.numel()
    for streams, copies in ((x, 0), (h.unsqueeze(-2).expand(T, n, d), 1)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = cpu_site_start.site_start(streams, phi, alpha, bias, 20, 1e-6, 0.0)
        assert sum(saved) == streams.numel() + copies * T * n * d + parameters + T * m + T + T * n
        grad = torch.autograd.grad(out[0], streams, randn(T, d, seed=6))[0]
        want = torch.autograd.grad(
            start_oracle(streams, phi, alpha, bias, 20, 1e-6, 0.0)[0], streams, randn(T, d, seed=6)
        )[0]
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5)


@needs_loops
def test_site_start_takes_the_formulas_for_a_subclass_gradient():
    inputs = [t.requires_grad_() for t in start_inputs((6,), 4, 5, 3)]
    grads = [randn(6, 5, seed=7), randn(6, 4, seed=8), randn(6, 4, 4, seed=9)]
    want = torch.autograd.grad(cpu_site_start.site_start(*inputs, 20, 1e-6, 0.0), inputs, grads)
    marked = [g.as_subclass(Marked) for g in grads]
    got = torch.autograd.grad(cpu_site_start.site_start(*inputs, 20, 1e-6, 0.0), inputs, marked)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.as_subclass(torch.Tensor), w, rtol=1e-4, atol=1e-6)


@needs_loops
def test_site_start_loops_write_every_output(unwritten_is_nan):
    x, phi, alpha, bias = start_inputs((37,), 3, 5, 0)
    proj = x.view(37, 15) @ phi
    outputs = cpu.site_start_forward(x, proj, alpha, bias, 20, 1e-6, 0.0)
    assert all(o.isfinite().all() for o in outputs)
    grads = randn(37, 5, seed=1), randn(37, 3, seed=2), randn(37, 3, 3, seed=3)
    per_token = cpu.site_start_backward(x, proj, alpha, bias, outputs[-1], *grads, 20, 0.0)
    assert all(g.isfinite().all() for g in per_token)
    grad_x = cpu.site_start_grad_x(torch.zeros(37, 3, 5), x, outputs[1], grads[0], per_token[-1])
    assert grad_x.isfinite().all()


@needs_loops
def test_site_start_launchers_refuse_what_the_loops_do_not_read():
    x, phi, alpha, bias = start_inputs((4,), 3, 5, 0)
    proj = x.view(4, 15) @ phi
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
        cpu.site_start_forward(x.transpose(1, 2).contiguous().transpose(1, 2), proj, alpha, bias, 20, 1e-6, 0.0)
    with pytest.raises(ValueError, match=r"proj.*shape \(4, 15\)"):
        cpu.site_start_forward(x, proj[:, :-1].contiguous(), alpha, bias, 20, 1e-6, 0.0)
    with pytest.raises(ValueError, match="must hold the 4 tokens"):
        cpu.site_start_forward(x, proj, alpha, bias, 20, 1e-6, 0.0, lead=(3,))
    with pytest.raises(ValueError, match="n <= 16"):
        big = start_inputs((2,), 17, 1, 0)
        cpu.site_start_forward(big[0], big[0].view(2, 17) @ big[1], *big[2:], 20, 1e-6, 0.0)


@needs_loops
@pytest.mark.parametrize(
    "settings, takes_it",
    [
        (dict(), True),
        (dict(hc_eps=1e-3), True),
        (dict(backward="implicit"), False),
        (dict(n=17), False),
        (dict(dtype=torch.float64), False),
        (dict(constraint="none"), False),
        (dict(static=True), False),
    ],
    ids=["default", "hc_eps", "implicit", "n=17", "fp64", "HC", "static"],
)
def test_which_sites_start_on_the_loops(settings, takes_it, monkeypatch):
    """Dynamic mHC sites on fp32 CPU tensors with the exact backward and n <= 16 take the op;
    the others keep the PyTorch ops, and both give the layer's values."""
    calls = []
    start = cpu_site_start.site_start
    monkeypatch.setattr(cpu_site_start, "site_start", lambda *a: calls.append(1) or start(*a))
    n, dtype = settings.pop("n", 4), settings.pop("dtype", torch.float32)
    static = settings.pop("static", False)
    site = HyperConnection(8, n, branch=torch.nn.Linear(8, 8), backend="torch", dynamic=not static, **settings)
    site = site.to(dtype)
    x = randn(3, n, 8, seed=0, dtype=dtype).requires_grad_()
    out = site(x)
    out.backward(randn(3, n, 8, seed=1, dtype=dtype))
    assert bool(calls) == takes_it


# ---------------------------------------------------------------- projection


@pytest.mark.parametrize("shape", [(5, 12), (2, 3, 8)])
def test_normalized_projection_gradcheck(shape):
    """The hand-written backward, in fp64 (the op runs any dtype; the layers use it for fp32 CPU)."""
    v = randn(*shape, seed=0, dtype=torch.float64).requires_grad_()
    phi = randn(shape[-1], 4, seed=1, dtype=torch.float64).requires_grad_()
    torch.autograd.gradcheck(lambda a, b: cpu_projection.normalized_projection(a, b, 1e-6), (v, phi))
    torch.autograd.gradgradcheck(lambda a, b: cpu_projection.normalized_projection(a, b, 1e-6), (v, phi))


def test_normalized_projection_of_a_constant_input():
    """Inputs that need no gradient get none."""
    v, phi = randn(3, 8, seed=0), randn(8, 2, seed=1).requires_grad_()
    out = cpu_projection.normalized_projection(v, phi, 1e-6)
    want = (v @ phi) * torch.rsqrt(v.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, want)
    (grad,) = torch.autograd.grad(out.square().sum(), phi)
    torch.testing.assert_close(grad, torch.autograd.grad(want.square().sum(), phi)[0])


# ---------------------------------------------------------------- when the layers take them


@needs_loops
def test_runs_on_plain_fp32_cpu_tensors_only():
    x = torch.zeros(2, 3)
    assert cpu.runs_on(x, torch.nn.Parameter(x))
    assert not cpu.runs_on(x, x.double()) and not cpu.runs_on(x.bfloat16())
    assert not cpu.runs_on(torch.zeros(2, 3, device="meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu.runs_on(x)


@needs_loops
@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
def test_a_site_on_the_loops_matches_pytorch_ops(constraint, monkeypatch):
    """A whole site, forward and every gradient, with the loops and without (``MHC_CPU_KERNELS=0``)."""

    def run():
        torch.manual_seed(0)
        site = HyperConnection(8, 4, branch=torch.nn.Linear(8, 8), constraint=constraint, backend="torch")
        x = randn(2, 5, 4, 8, seed=1).requires_grad_()
        out = site(x)
        grads = torch.autograd.grad(out, (x, *site.parameters()), randn(2, 5, 4, 8, seed=2))
        return out, grads

    out, grads = run()
    monkeypatch.setenv("MHC_CPU_KERNELS", "0")
    _build.library.cache_clear()
    try:
        assert not cpu.available() and cpu.build_error() == "turned off by MHC_CPU_KERNELS=0"
        want, want_grads = run()
    finally:
        monkeypatch.delenv("MHC_CPU_KERNELS")
        _build.library.cache_clear()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the build


def test_the_build_is_cached_and_named_by_its_source(tmp_path, monkeypatch):
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MHC_CACHE_DIR", str(tmp_path))
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    first = _build._compile(compiler, _build.FLAGS)
    built = first.stat().st_mtime_ns
    assert _build._compile(compiler, _build.FLAGS) == first and first.stat().st_mtime_ns == built  # reused
    assert list(tmp_path.iterdir()) == [first]  # no temporary left behind
    changed = tmp_path / "kernels.c"
    changed.write_text(_build.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(_build, "SOURCE", changed)
    assert _build._compile(compiler, _build.FLAGS) != first


@pytest.mark.parametrize(
    "compiler, reason", [("/nonexistent/cc", "no C compiler found"), ("false", "failed")], ids=["missing", "failing"]
)
def test_without_a_working_compiler_the_layers_keep_pytorch_ops(compiler, reason, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("MHC_CACHE_DIR", str(tmp_path))
    _build.library.cache_clear()
    try:
        assert not cpu.available() and reason in cpu.build_error()
        assert cpu.path_name() == "PyTorch ops" and not cpu.runs_on(torch.zeros(2))
        x = randn(4, 3, 3, seed=0)
        torch.testing.assert_close(sinkhorn(x, 20), reference.sinkhorn_stable(x, 20), rtol=0, atol=1e-6)
    finally:
        monkeypatch.delenv("CC")
        _build.library.cache_clear()


def test_a_compiler_without_openmp_builds_single_threaded_loops(tmp_path, monkeypatch):
    real = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if real is None or os.environ.get("MHC_CPU_KERNELS") == "0":
        pytest.skip("no C compiler here, or the loops are turned off")
    no_openmp = tmp_path / "cc-without-openmp"
    no_openmp.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    no_openmp.chmod(0o755)
    monkeypatch.setenv("CC", str(no_openmp))
    monkeypatch.setenv("MHC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_flags", lambda: (*_build.FLAGS, "-fopenmp"))
    _build.library.cache_clear()
    try:
        assert cpu.available(), cpu.build_error()
        x = randn(70, 4, 4, seed=0)
        torch.testing.assert_close(
            cpu.sinkhorn_forward(x, 20, 0.0), reference.sinkhorn_stable(x, 20), rtol=0, atol=2e-5
        )
    finally:
        monkeypatch.delenv("CC")
        _build.library.cache_clear()


OPENMP_PROBE = """
import json

import torch

def runtimes():
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libgomp" in line})

before = runtimes()  # PyTorch's own, if it uses GNU OpenMP
from mhc import cpu
cpu.sinkhorn_forward(torch.zeros(80, 4, 4), 2, 0.0)  # the loops loaded, their threads started
print(json.dumps([before, runtimes()]))
"""


@needs_loops
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_the_loops_share_pytorchs_openmp_runtime():
    """Built with OpenMP, the library joins the runtime PyTorch loaded instead of loading a second
    one (two runtimes would each keep their own threads). In a fresh process: a test process may
    hold other packages' own runtimes (scikit-learn vendors one)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", OPENMP_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    if before:
        assert after == before, (before, after)  # nothing new: PyTorch's runtime serves the loops
    else:
        assert len(after) <= 1, after
    if "-fopenmp" in _build._flags():
        assert len(after) == 1, after
