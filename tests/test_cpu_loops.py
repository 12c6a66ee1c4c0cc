"""The CPU path's C loops (``mhc.cpu``) against the PyTorch formulas they replace: Sinkhorn and its
exact backward, the pre-mix and post-mix with their backwards, the normalised projection; when
the layers take them; and how the library is built."""

import os
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mhc import cpu, reference
from mhc.cpu import _build
from mhc.cpu import mixing as cpu_mixing
from mhc.cpu import projection as cpu_projection
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
    threads(1)
    one = {name: call() for name, call in calls.items()}
    threads(3)
    for name, call in calls.items():
        for got, want in zip(call(), one[name]):
            assert torch.equal(got, want), name
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
