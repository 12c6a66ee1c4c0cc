"""The kernels inside compiled and exported graphs (``mhc.ops.library``): ``torch.compile`` launches
the Triton kernels from Inductor's own code (no ``torch.ops.mhc`` call left in it), with the
Python wrapper and with ``cpp_wrapper``; ``torch.export`` + AOTInductor runs HyperConnection sites
from a package. Values and gradients against eager mode."""

import pytest
import torch
from torch import nn

from mhc.layer import sinkhorn
from mhc.ops import library as _library
from mhc.ops.mixing import post_mix, pre_mix
from tests.site_stack import SiteStack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _library.TRITON_OP, reason="the ops are custom_ops (TRITON_INTERPRET=1 or MHC_TRITON_OP=0)"),
]

DIM, N = 64, 4
# every kernel of a site, forward and backward: mHC (Sinkhorn backward included), plain HC (its
# coefficients are PyTorch ops)
SITE_KERNELS = {
    "sinkhorn": (
        "coefficients_fwd_kernel",
        "stream_mix_fwd_kernel",
        "stream_mix_bwd_kernel",
        "coefficient_grad_kernel",
        "projection_bwd_kernel",
        "sinkhorn_bwd_kernel",
    ),
    "none": ("stream_mix_fwd_kernel", "stream_mix_bwd_kernel"),
}


def _model(chain=False, seed=0, **site):
    torch.manual_seed(seed)
    branches = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(3)]
    model = SiteStack(DIM, N, branches, chain, **site).cuda()
    with torch.no_grad():  # away from the identity start, so every coefficient matters
        for name, p in model.named_parameters():
            if not name.split(".")[2:3] == ["branch"]:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _step(run, model, h, w):
    model.zero_grad(set_to_none=True)
    h = h.detach().requires_grad_()
    out = run(h)
    out.backward(w)
    return out.detach(), h.grad, [p.grad for p in model.parameters()]


def _assert_step_close(got, want, rtol, atol):
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol)
    for g, e in zip(got[2], want[2]):
        # a site's gates (alpha, 3 values): each gradient sums a term of every token and column and
        # cancels to near 0, so the order of that sum (per-program partials added by eager's and
        # by the compiled graph's reductions) moves it by more than the other gradients' rounding
        torch.testing.assert_close(g, e, rtol=rtol, atol=10 * atol if e.shape == (3,) else atol)


def _inputs(tokens, dtype=torch.float32):
    torch.manual_seed(1)
    h = torch.randn(tokens, DIM, device="cuda", dtype=dtype)
    return h, torch.randn_like(h)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
def test_compiled_step_launches_the_kernels_itself(chain, constraint):
    """The compiled forward and backward hold the kernels as Inductor-launched Triton kernels and
    no call of a ``torch.ops.mhc`` op (each of which would run Python per kernel)."""
    from torch._inductor.utils import run_and_get_code

    model = _model(chain, constraint=constraint, init="zero" if constraint == "sinkhorn" else "residual")
    h, w = _inputs(96)
    want = _step(model, model, h, w)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    got, code = run_and_get_code(lambda: _step(compiled, model, h, w))
    _assert_step_close(got, want, rtol=1e-4, atol=1e-5)
    source = "\n".join(code)
    assert "torch.ops.mhc" not in source
    for kernel in SITE_KERNELS[constraint]:
        assert kernel in source, kernel


@pytest.mark.parametrize("chain", [False, True])
def test_compiled_step_with_the_mix_backward_split_over_d(chain, monkeypatch):
    """Where tokens are few, the mix backward runs over ranges of ``D`` and a second kernel adds
    their partial coefficient gradients: both inside the compiled graph, which matches eager."""
    from torch._inductor.utils import run_and_get_code

    from mhc.kernels import _launch, stream_mix

    config = stream_mix._bwd_config
    monkeypatch.setattr(stream_mix, "_bwd_config", lambda n, n_out, d: (config(n, n_out, d)[0], 16, 4))  # 4 chunks
    monkeypatch.setattr(stream_mix, "bwd_d_splits", lambda n, n_out, d, tokens, sms: 3)
    _launch.forget_launch_plans()
    model = _model(chain)
    h, w = _inputs(96)
    want = _step(model, model, h, w)
    torch._dynamo.reset()
    got, code = run_and_get_code(lambda: _step(torch.compile(model, fullgraph=True), model, h, w))
    _launch.forget_launch_plans()
    _assert_step_close(got, want, rtol=1e-4, atol=1e-5)
    assert "partial_sums_kernel" in "\n".join(code)


@pytest.mark.parametrize("dim", [64, 4096])  # 4096: the forward's split over K (n * d >= 16384)
def test_compiled_step_with_a_dynamic_token_count(dim):
    """A graph compiled for any token count (``dynamic=True``, or automatic dynamic shapes after a
    recompile): the launch plans take no guard on the count, so a second count reuses the graph,
    and both counts match eager."""
    torch.manual_seed(0)
    model = SiteStack(dim, N, [nn.Linear(dim, dim) for _ in range(2)], False).cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True, fullgraph=True)
    for tokens in (96, 200):
        torch.manual_seed(tokens)
        h = torch.randn(tokens, dim, device="cuda")
        w = torch.randn_like(h)
        want = _step(model, model, h, w)
        with torch.compiler.set_stance("fail_on_recompile" if tokens == 200 else "default"):
            got = _step(compiled, model, h, w)
        # at d = 4096 eager takes the small-token split over K and the graph the split of many
        # tokens: the same sums in another order, and the bias gradients cancel to near 0
        _assert_step_close(got, want, rtol=1e-4, atol=1e-5 if dim == 64 else 5e-5)


def _cuda(*shape):
    return torch.randn(*shape, device="cuda")


def _post_mix_inputs(tokens):
    return [_cuda(tokens, N, DIM), _cuda(tokens, DIM), _cuda(tokens, N).sigmoid(), _cuda(tokens, N, N).sigmoid()]


# (op, its inputs at a token count): the public functional ops
FUNCTIONAL_OPS = {
    "sinkhorn": (lambda z: sinkhorn(z, iters=20), lambda t: [_cuda(t, N, N)]),
    "implicit": (lambda z: sinkhorn(z, iters=20, backward="implicit"), lambda t: [_cuda(t, N, N)]),
    "eps": (lambda z: sinkhorn(z, iters=20, eps=1e-6), lambda t: [_cuda(t, N, N)]),
    "tiled": (lambda z: sinkhorn(z, iters=20), lambda t: [_cuda(t, 24, 24)]),
    "pre_mix": (lambda x, h: pre_mix(x, h)[0], lambda t: [_cuda(t, N, DIM), _cuda(t, N).sigmoid()]),
    "post_mix": (post_mix, _post_mix_inputs),
}


@pytest.mark.parametrize("name", list(FUNCTIONAL_OPS))
def test_functional_ops_under_dynamic_shapes(name):
    """``torch.compile(dynamic=True)`` of each functional op, every size symbolic: the sizes that
    pick a kernel's constexprs are specialised (guards), the token count is not, so a second count
    reuses the graph. Values and every input's gradient match eager."""
    fn, make = FUNCTIONAL_OPS[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
    for tokens in (96, 200):
        torch.manual_seed(tokens)
        inputs = [t.requires_grad_() for t in make(tokens)]
        want = fn(*inputs)
        grad = torch.randn_like(want)
        with torch.compiler.set_stance("fail_on_recompile" if tokens == 200 else "default"):
            got = compiled(*inputs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_compiled_step_analyses_each_kernel_once(monkeypatch):
    """PyTorch asks which arguments a kernel writes several times per kernel call (functionalization,
    Inductor's lowering); through ``mhc._compat.write_analysis`` each kernel specialization's TTIR is
    generated once for the whole compiled step, which still matches eager."""
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._inductor import config

    from mhc._compat import write_analysis as _write_analysis

    assert _write_analysis.installed()
    generated = []
    generate_ttir = triton_kernel_wrap.generate_ttir

    def counted(kernel, *args, **kwargs):
        generated.append(_write_analysis._jit_function(kernel).fn.__name__)
        return generate_ttir(kernel, *args, **kwargs)

    monkeypatch.setattr(triton_kernel_wrap, "generate_ttir", counted)
    monkeypatch.setattr(_write_analysis, "_CACHE", {})
    model = _model()
    h, w = _inputs(96)
    want = _step(model, model, h, w)
    torch._dynamo.reset()
    # the earlier tests' graphs are in Inductor's caches: a hit would skip the analyses altogether
    with config.patch(force_disable_caches=True):
        got = _step(torch.compile(model, fullgraph=True), model, h, w)
    _assert_step_close(got, want, rtol=1e-4, atol=1e-5)
    assert set(SITE_KERNELS["sinkhorn"]) <= set(generated)
    assert len(generated) == len(_write_analysis._CACHE)  # no specialization analysed twice


@pytest.mark.parametrize("chain", [False, True])
def test_cpp_wrapper_step_matches_eager(chain):
    from torch._inductor import config

    model = _model(chain)
    h, w = _inputs(130)
    want = _step(model, model, h, w)
    torch._dynamo.reset()
    with config.patch(cpp_wrapper=True):
        compiled = torch.compile(model, fullgraph=True)
        got = _step(compiled, model, h, w)
    _assert_step_close(got, want, rtol=1e-4, atol=1e-5)


# Loads an AOTInductor package and checks it against saved inputs and outputs, in a process of its
# own: a loader that crashes must not take the test session with it.
_LOAD_AND_CHECK = """
import sys, torch
package, cases, rtol, atol = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
loaded = torch._inductor.aoti_load_package(package)
for x, want in torch.load(cases):
    torch.testing.assert_close(loaded(x), want, rtol=rtol, atol=atol)
print("ok")
"""


def _package(module, example, path, dynamic_shapes=None):
    with torch.no_grad():
        exported = torch.export.export(module, (example,), dynamic_shapes=dynamic_shapes)
        return exported, torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


def _load_and_check(package, cases, path, rtol, atol):
    import subprocess
    import sys

    torch.save(cases, path)
    return subprocess.run(
        [sys.executable, "-c", _LOAD_AND_CHECK, package, str(path), str(rtol), str(atol)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def aoti_loads(tmp_path_factory):
    """Whether this machine's AOTInductor loads any package: a plain ``nn.Linear``'s. On the H100
    image the compiler that ``CXX`` names (``/opt/gcc/bin/g++``, a wrapper) builds package
    libraries without the shared ``libstdc++``, and they crash (SIGSEGV) in ``std::regex`` while
    the loader builds the model; set ``CXX`` to the system's ``g++`` there (docs/compile.md)."""
    tmp = tmp_path_factory.mktemp("aoti_linear")
    linear = nn.Linear(DIM, DIM).cuda().eval()
    x = torch.randn(8, DIM, device="cuda")
    _, package = _package(linear, x, tmp / "linear.pt2")
    with torch.no_grad():
        result = _load_and_check(package, [(x, linear(x))], tmp / "cases.pt", 1e-5, 1e-6)
    return result.returncode == 0, f"exit status {result.returncode}: {result.stderr[-300:]}"


@pytest.mark.parametrize("dtype, hc_eps", [(torch.float32, 0.0), (torch.bfloat16, 1e-6)])
def test_export_and_aoti_package_run_the_sites(tmp_path, aoti_loads, dtype, hc_eps):
    """``torch.export`` of a model with mHC sites: the exported program, and the AOTInductor package
    built from it and loaded back, give eager's forward at the exported token count and at another
    (the token count is dynamic)."""
    model = _model(hc_eps=hc_eps).to(dtype).eval()
    h, _ = _inputs(96, dtype)
    tokens = torch.export.Dim("tokens", min=2, max=4096)
    exported, package = _package(model, h, tmp_path / "sites.pt2", dynamic_shapes=({0: tokens},))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    cases = []
    for rows in (96, 1000):
        x = torch.randn(rows, DIM, device="cuda", dtype=dtype)
        with torch.no_grad():
            want = model(x)
            torch.testing.assert_close(exported.module()(x), want, **tol)
        cases.append((x, want))
    loads, why = aoti_loads
    if not loads:
        pytest.skip(
            f"AOTInductor cannot load a plain nn.Linear package on this machine ({why}); "
            "see this fixture's docstring for the C++ compiler it may take"
        )
    result = _load_and_check(package, cases, tmp_path / "cases.pt", **tol)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


# 300 tokens: the forward split over K with its finishing kernel; 9000: the one-pass forward
@pytest.mark.parametrize("T, hc_eps", [(300, 1e-6), (9000, 0.0)])
def test_compiled_coefficient_kernels_are_the_eager_ones(T, hc_eps):
    """Inside a compiled graph the coefficient kernels give their eager launches' bits: Inductor
    passes float arguments as fp64, which the kernels take as fp32, as a launch from Python does."""
    from torch._inductor.utils import run_and_get_code

    from mhc.kernels import mhc_coefficients

    torch.manual_seed(0)
    n, d = N, 256
    x = torch.randn(T, n, d, device="cuda", dtype=torch.bfloat16)
    phi = torch.randn(n * d, 2 * n + n * n, device="cuda") / d
    alpha, bias = torch.rand(3, device="cuda"), torch.randn(2 * n + n * n, device="cuda")
    settings = (20, 1e-6, hc_eps)
    want = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, *settings)
    dx_in, dh_post, dz_res = torch.randn_like(want[0]), torch.randn_like(want[4]), torch.randn_like(want[5])
    backward = (x, phi, alpha, *want[1:5], None, dh_post, dz_res, dx_in, None, hc_eps)
    want_grads = mhc_coefficients.coefficients_bwd_packed(*backward)

    def both():
        return torch.ops.mhc.mhc_coefficients_fwd(x, phi, alpha, bias, *settings), torch.ops.mhc.mhc_coefficients_bwd(
            *backward
        )

    torch._dynamo.reset()
    (got, got_grads), code = run_and_get_code(torch.compile(both, fullgraph=True))
    for g, w in zip((*got, got_grads[0]), (*want, want_grads[0])):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # the packed parameter gradients add per-split partials with a PyTorch sum, which the compiled
    # graph reduces in its own order: fp32 rounding of the largest sums
    scale = want_grads[1].abs().max().item()
    torch.testing.assert_close(got_grads[1], want_grads[1], rtol=1e-5, atol=4e-6 * scale)
    assert "torch.ops.mhc" not in "\n".join(code)


def test_compiled_sinkhorn_with_eps_is_the_eager_one():
    """DeepSeek-V4's Sinkhorn (``eps > 0``, a float argument of its kernels) in a compiled graph:
    the eager launches' bits."""
    torch.manual_seed(0)
    logits = torch.randn(300, N, N, device="cuda", requires_grad=True)
    g = torch.randn(300, N, N, device="cuda")
    out = sinkhorn(logits, iters=20, eps=1e-6)
    (want,) = torch.autograd.grad(out, logits, g)
    torch._dynamo.reset()
    got_out = torch.compile(lambda z: sinkhorn(z, iters=20, eps=1e-6), fullgraph=True)(logits)
    (got,) = torch.autograd.grad(got_out, logits, g)
    torch.testing.assert_close(got_out, out, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backward", ["exact", "implicit"])
@pytest.mark.parametrize("n", [4, 24])
def test_compiled_sinkhorn_matches_eager(backward, n):
    """The Sinkhorn ops (the per-token and the tiled kernels) inside a compiled graph."""
    torch.manual_seed(0)
    logits = torch.randn(300, n, n, device="cuda", requires_grad=True)
    g = torch.randn(300, n, n, device="cuda")
    out = sinkhorn(logits, iters=20, backward=backward)
    (want,) = torch.autograd.grad(out, logits, g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda z: sinkhorn(z, iters=20, backward=backward), fullgraph=True)
    got_out = compiled(logits)
    (got,) = torch.autograd.grad(got_out, logits, g)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_registered_ops_run_eagerly():
    """The ops called outside a compiled graph (as an exported program run in Python does) give the
    launchers' results."""
    from mhc.kernels import stream_mix_fwd

    torch.manual_seed(0)
    x = torch.randn(70, N, DIM, device="cuda")
    w = torch.rand(70, N, N, device="cuda")
    y = torch.randn(70, DIM, device="cuda")
    b = torch.rand(70, N, device="cuda")
    torch.testing.assert_close(torch.ops.mhc.stream_mix_fwd(x, w, y, b), stream_mix_fwd(x, w, y, b), rtol=0, atol=0)
