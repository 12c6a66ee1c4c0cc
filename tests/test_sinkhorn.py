"""Sinkhorn operator: maths, kernels against the fp64 reference, gradients, dtypes, errors.

Kernel tests run the real Triton kernels: compiled on a GPU, in Triton's interpreter on CPU.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mhc
import mhc.kernels
from mhc import reference
from mhc.kernels import sinkhorn_tiled
from mhc.layer import FusedMHC, sinkhorn
from tests.conftest import KERNEL_DEVICE

BACKENDS = ["triton", "torch"]


def random_logits(shape, scale, seed, dtype=torch.float64, device=KERNEL_DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def oracle(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """fp64 log-domain reference on the CPU, whatever the input."""
    return reference.sinkhorn_log(logits.detach().cpu().double(), iters)


def autograd_gradient(logits: torch.Tensor, grad_out: torch.Tensor, iters: int) -> torch.Tensor:
    """fp64 autograd through the unrolled textbook loop: the definition of the exact gradient."""
    x = logits.detach().cpu().double().requires_grad_()
    reference.sinkhorn_multiplicative(x, iters).backward(grad_out.detach().cpu().double())
    return x.grad


# ---------------------------------------------------------------- the reference itself


@given(n=st.integers(1, 8), iters=st.integers(1, 30), scale=st.floats(0.1, 5.0), seed=st.integers(0, 2**16))
def test_reference_forms_agree(n, iters, scale, seed):
    x = random_logits((3, n, n), scale, seed, device="cpu")
    want = reference.sinkhorn_log(x, iters)
    torch.testing.assert_close(reference.sinkhorn_multiplicative(x, iters), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(reference.sinkhorn_stable(x, iters), want, rtol=0, atol=1e-12)


def test_reference_implicit_backward_matches_autograd_at_convergence():
    x = random_logits((5, 4, 4), 0.5, 0, device="cpu")
    g = random_logits((5, 4, 4), 1.0, 1, device="cpu")
    out = reference.sinkhorn_log(x, 500)
    torch.testing.assert_close(
        reference.sinkhorn_implicit_backward(out, g), autograd_gradient(x, g, 500), rtol=0, atol=1e-10
    )


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 9),
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=2),
    iters=st.integers(1, 25),
    scale=st.floats(0.01, 8.0),
    seed=st.integers(0, 2**16),
)
def test_forward_matches_fp64_reference(backend, n, lead, iters, scale, seed):
    x = random_logits((*lead, n, n), scale, seed, dtype=torch.float32)
    out = sinkhorn(x, iters, backend=backend)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.cpu().double(), oracle(x, iters), rtol=0, atol=2e-6)


@pytest.mark.parametrize("n", [16, 33, 64])
def test_forward_large_n(n, nan_poison):
    x = random_logits((5, n, n), 2.0, n, dtype=torch.float32)
    out = sinkhorn(x, 20, backend="triton")
    torch.testing.assert_close(out.cpu().double(), oracle(x, 20), rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(2, 8), scale=st.floats(0.1, 1.5), seed=st.integers(0, 2**16))
def test_rows_exact_columns_converge(backend, n, scale, seed):
    x = random_logits((4, n, n), scale, seed, dtype=torch.float32)
    col_err = []
    for iters in (1, 10, 200):
        out = sinkhorn(x, iters, backend=backend)
        assert (out >= 0).all()
        torch.testing.assert_close(out.sum(-1), torch.ones_like(out.sum(-1)), rtol=0, atol=2e-6)
        col_err.append((out.sum(-2) - 1).abs().max().item())
    assert col_err[2] <= col_err[1] + 1e-6 <= col_err[0] + 2e-6
    assert col_err[2] < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [50.0, 1e3, 1e4])
def test_extreme_logits_stay_finite_and_row_stochastic(backend, scale):
    # A plain exp-then-divide loop turns whole rows into 0/0 here.
    x = random_logits((16, 5, 5), scale, int(scale), dtype=torch.float32)
    out = sinkhorn(x, 20, backend=backend)
    assert torch.isfinite(out).all() and (out >= 0).all()
    torch.testing.assert_close(out.sum(-1), torch.ones_like(out.sum(-1)), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.cpu().double(), oracle(x, 20), rtol=0, atol=1e-4)
    assert not torch.isfinite(reference.sinkhorn_multiplicative(x.cpu(), 20)).all()


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 8), seed=st.integers(0, 2**16), shift=st.floats(-100.0, 100.0))
def test_shift_invariance(backend, n, seed, shift):
    # The first step normalises columns, so column shifts (and whole-matrix shifts) never change
    # the output after any number of iterations; row shifts only leave the limit unchanged.
    x = random_logits((3, n, n), 2.0, seed)
    col_shift = random_logits((3, 1, n), 30.0, seed + 2)
    out = sinkhorn(x, 10, backend=backend)
    for shifted in (x + shift, x + col_shift):
        torch.testing.assert_close(sinkhorn(shifted, 10, backend=backend), out, rtol=0, atol=1e-9)


def test_unwritten_output_would_fail(nan_poison):
    # The poisoning fixture really poisons: a buffer nobody writes stays NaN.
    assert torch.isnan(torch.empty_like(torch.zeros(3))).all()
    x = random_logits((7, 3, 3), 1.0, 0, dtype=torch.float32)
    assert torch.isfinite(sinkhorn(x, 4, backend="triton")).all()


# ---------------------------------------------------------------- exact backward


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 8),
    iters=st.integers(1, 40),
    scale=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**16),
)
def test_exact_gradient_matches_autograd(backend, n, iters, scale, seed, nan_poison):
    x = random_logits((6, n, n), scale, seed).requires_grad_()
    g = random_logits((6, n, n), 1.0, seed + 1)
    sinkhorn(x, iters, backward="exact", backend=backend).backward(g)
    torch.testing.assert_close(x.grad.cpu(), autograd_gradient(x, g, iters), rtol=0, atol=1e-10)


@pytest.mark.parametrize("n", [16, 33])
@pytest.mark.parametrize("iters", [1, 20])
def test_exact_gradient_large_n_segments(n, iters, nan_poison):
    # At n = 16 the tiled kernel keeps SEG = 15 < 19 iterations on chip: two recomputed
    # segments, the first one short. n = 33 runs the NP = 64 configuration, which recomputes the
    # first iteration's row sums at the end (RECOMPUTE_R1). iters = 1: no reverse steps at all.
    x = random_logits((3, n, n), 1.0, n).requires_grad_()
    g = random_logits((3, n, n), 1.0, n + 1)
    sinkhorn(x, iters, backend="triton").backward(g)
    torch.testing.assert_close(x.grad.cpu(), autograd_gradient(x, g, iters), rtol=0, atol=1e-10)


@pytest.mark.parametrize("n", [9, 10, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_tiled_kernels_with_padded_rows(n, dtype, nan_poison):
    # Rows that are not 8-byte aligned are zero-padded to 16 bytes before the tiled kernels read
    # them (fp32 n = 9, bf16 n = 9, 10); the others are read in place. Outputs are [T, n, n].
    padded = {(9, torch.float32), (9, torch.bfloat16), (10, torch.bfloat16)}
    assert (sinkhorn_tiled.row_stride(n, dtype.itemsize) > n) == ((n, dtype) in padded)

    x = random_logits((5, n, n), 1.0, n, dtype=dtype)
    g = random_logits((5, n, n), 1.0, n + 1, dtype=dtype)
    tol = dict(rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    out = sinkhorn_tiled.sinkhorn_tiled_fwd(x, 20)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), oracle(x, 20), **tol)
    grad = sinkhorn_tiled.sinkhorn_tiled_bwd(x, g, 20)
    torch.testing.assert_close(grad.cpu().double(), autograd_gradient(x, g, 20), **tol)
    r = oracle(x, 7)  # not converged: the implicit backward's correction matters
    implicit = sinkhorn_tiled.sinkhorn_tiled_implicit_bwd(r.to(x.device, dtype), g)
    want = reference.sinkhorn_implicit_backward(r.to(dtype).double(), g.cpu().double())
    torch.testing.assert_close(implicit.cpu().double(), want, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_gradient_fp32_close_to_fp64(backend):
    x = random_logits((64, 4, 4), 2.0, 3, dtype=torch.float32).requires_grad_()
    g = random_logits((64, 4, 4), 1.0, 4, dtype=torch.float32)
    sinkhorn(x, 20, backend=backend).backward(g)
    want = autograd_gradient(x, g, 20)
    err = (x.grad.cpu().double() - want).norm() / want.norm()
    assert err < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 8), scale=st.floats(0.1, 10.0), seed=st.integers(0, 2**16))
def test_exact_gradient_has_zero_column_sums(backend, n, scale, seed):
    # Column shifts never change the output, so the gradient is orthogonal to them.
    x = random_logits((5, n, n), scale, seed).requires_grad_()
    sinkhorn(x, 20, backend=backend).backward(random_logits((5, n, n), 1.0, seed + 1))
    torch.testing.assert_close(x.grad.sum(-2), torch.zeros_like(x.grad.sum(-2)), rtol=0, atol=1e-10)


def test_exact_gradient_at_extreme_logits_is_finite():
    x = random_logits((8, 4, 4), 1e4, 5, dtype=torch.float32).requires_grad_()
    sinkhorn(x, 20, backend="triton").backward(random_logits((8, 4, 4), 1.0, 6, dtype=torch.float32))
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backward", ["exact", "implicit"])
def test_saved_memory_does_not_grow_with_iters(backward):
    saved = {}

    def pack(t):
        saved[iters] = saved.get(iters, 0) + t.numel() * t.element_size()
        return t

    x = random_logits((10, 4, 4), 1.0, 0, dtype=torch.float32).requires_grad_()
    for iters in (2, 50):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sinkhorn(x, iters, backward=backward, backend="triton")
    assert saved[2] == saved[50] == x.numel() * x.element_size()


@given(
    n=st.integers(1, 8),
    iters=st.integers(1, 30),
    eps=st.sampled_from([0.0, 1e-6, 0.05]),
    lead=st.lists(st.integers(0, 3), min_size=0, max_size=2),
    scale=st.floats(0.1, 5.0),
    seed=st.integers(0, 2**16),
)
def test_written_out_backward_matches_autograd_of_the_loop(n, iters, eps, lead, scale, seed):
    """The CPU path's exact backward (divisors kept, steps walked in reverse, tokens-last layout)
    against autograd through the same formulation, fp64, with and without DeepSeek-V4's eps."""
    x = random_logits((*lead, n, n), scale, seed, device="cpu").requires_grad_()
    g = random_logits((*lead, n, n), 1.0, seed + 1, device="cpu")
    loop = reference.sinkhorn_eps(x, iters, eps) if eps > 0 else reference.sinkhorn_stable(x, iters)
    (want,) = torch.autograd.grad(loop, x, g)
    out = sinkhorn(x, iters, backend="torch", eps=eps)
    torch.testing.assert_close(out, loop, rtol=0, atol=1e-13)
    (got,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    # the same functions on [..., n, n] and on [n, n, ...] (the layout the path runs on)
    kept = reference.sinkhorn_divisors(x.detach(), iters, eps)
    torch.testing.assert_close(reference.sinkhorn_exact_backward(x.detach(), *kept, g, eps), want, rtol=0, atol=1e-10)


def test_torch_path_saves_divisors_not_iterates():
    """The written-out backward keeps the logits, the output and two n-vectors per step: far less
    than autograd's graph of the unrolled loop (several n x n iterates per step)."""
    saved = []
    x = random_logits((10, 4, 4), 1.0, 0, device="cpu").requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sinkhorn(x, 20, backend="torch")
    assert sum(saved) <= 10 * (2 * 16 + 2 * 19 * 4)


def test_torch_path_double_backward():
    x = random_logits((3, 4, 4), 1.0, 2, device="cpu").requires_grad_()
    torch.autograd.gradgradcheck(lambda t: sinkhorn(t, 5, backend="torch"), (x,))
    torch.autograd.gradgradcheck(lambda t: sinkhorn(t, 5, backend="torch", eps=1e-3), (x,))


# ---------------------------------------------------------------- implicit backward


@pytest.mark.parametrize("n", [3, 6, 16, 40])
def test_implicit_kernel_matches_reference(n):
    x = random_logits((40 if n < 16 else 3, n, n), 2.0, 7)
    g = random_logits(x.shape, 1.0, 8)
    out = reference.sinkhorn_stable(x.cpu(), 7)  # not converged: the correction matters
    got = mhc.kernels.sinkhorn_implicit_bwd(out.to(KERNEL_DEVICE), g)
    torch.testing.assert_close(got.cpu(), reference.sinkhorn_implicit_backward(out, g.cpu()), rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 8), iters=st.integers(1, 30), scale=st.floats(0.1, 3.0), seed=st.integers(0, 2**16))
def test_implicit_gradient_is_shift_invariant(backend, n, iters, scale, seed, nan_poison):
    # Differentiating the fixed point: the gradient has zero row and column sums.
    x = random_logits((4, n, n), scale, seed).requires_grad_()
    sinkhorn(x, iters, backward="implicit", backend=backend).backward(random_logits((4, n, n), 1.0, seed + 1))
    zeros = torch.zeros_like(x.grad.sum(-1))
    torch.testing.assert_close(x.grad.sum(-1), zeros, rtol=0, atol=1e-9)
    torch.testing.assert_close(x.grad.sum(-2), zeros, rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_implicit_equals_exact_once_converged(backend):
    x = random_logits((8, 4, 4), 0.5, 9).requires_grad_()
    g = random_logits((8, 4, 4), 1.0, 10)
    sinkhorn(x, 300, backward="implicit", backend=backend).backward(g)
    torch.testing.assert_close(x.grad.cpu(), autograd_gradient(x, g, 300), rtol=0, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_implicit_differs_from_exact_before_convergence(backend):
    # Documented behaviour: at 3 iterations and large logits the fixed-point gradient is not the
    # gradient of the 3-step map.
    x = random_logits((8, 4, 4), 4.0, 11).requires_grad_()
    g = random_logits((8, 4, 4), 1.0, 12)
    sinkhorn(x, 3, backward="implicit", backend=backend).backward(g)
    want = autograd_gradient(x, g, 3)
    assert (x.grad.cpu() - want).norm() > 1e-2 * want.norm()


# ---------------------------------------------------------------- gradcheck (fp64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_exact(backend):
    x = random_logits((2, 3, 3), 1.0, 13).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 6, backend=backend), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_implicit_at_convergence(backend):
    # at this scale the column sums are 1 to fp64 rounding from 20 iterations on (the last step
    # normalises the rows)
    x = random_logits((2, 3, 3), 0.5, 14).requires_grad_()
    out = reference.sinkhorn_log(x.detach(), 20)
    torch.testing.assert_close(out.sum(-2), torch.ones_like(out.sum(-2)), rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 40, backward="implicit", backend=backend), (x,))


# ---------------------------------------------------------------- dtypes and layouts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_in_same_dtype_out(backend, dtype):
    x = random_logits((32, 4, 4), 2.0, 15, dtype=dtype).requires_grad_()
    g = random_logits((32, 4, 4), 1.0, 16, dtype=dtype)
    out = sinkhorn(x, 20, backend=backend)
    assert out.dtype == dtype
    want = oracle(x, 20)
    # three-way rule: fp32 arithmetic inside, so the error is the output's own rounding
    # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): one more ulp there.
    truncates = backend == "triton" and mhc.kernels.INTERPRET and dtype == torch.bfloat16
    rounding = (want.to(dtype).double() - want).abs().max()
    limit = 2 * rounding + 1e-6 + (2.0**-7 * want.abs().max() if truncates else 0)
    assert (out.cpu().double() - want).abs().max() <= limit
    out.backward(g)
    assert x.grad.dtype == dtype
    want_grad = autograd_gradient(x, g, 20)
    grad_rounding = (want_grad.to(dtype).double() - want_grad).abs().max()
    limit = 2 * grad_rounding + 1e-5 + (2.0**-7 * want_grad.abs().max() if truncates else 0)
    assert (x.grad.cpu().double() - want_grad).abs().max() <= limit


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_disabled_inside(backend):
    x = random_logits((8, 4, 4), 2.0, 17, dtype=torch.float32)
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        out = sinkhorn(x, 20, backend=backend)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), oracle(x, 20), rtol=0, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_input(backend, nan_poison):
    base = random_logits((5, 6, 6), 2.0, 18)
    x = base.transpose(-1, -2)[:, ::2, ::2].requires_grad_()
    assert not x.is_contiguous()
    g = random_logits((5, 3, 3), 1.0, 19).transpose(-1, -2)
    out = sinkhorn(x, 9, backend=backend)
    torch.testing.assert_close(out.cpu(), oracle(x, 9), rtol=0, atol=1e-12)
    out.backward(g)
    torch.testing.assert_close(x.grad.cpu(), autograd_gradient(x, g, 9), rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(4, 4), (0, 4, 4), (2, 0, 3, 3), (2, 3, 1, 5, 5)])
def test_leading_shapes(backend, shape):
    x = random_logits(shape, 1.0, 20).requires_grad_()
    out = sinkhorn(x, 5, backend=backend)
    assert out.shape == x.shape
    torch.testing.assert_close(out.cpu(), oracle(x, 5), rtol=0, atol=1e-12)
    out.backward(torch.ones_like(out) + random_logits(shape, 1.0, 21))
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- module and errors


def test_fused_mhc_module():
    layer = FusedMHC(mhc_iters=7, backward="implicit", backend="torch")
    assert repr(layer) == "FusedMHC(mhc_iters=7, backward='implicit', backend='torch')"
    assert list(layer.parameters()) == []
    x = random_logits((3, 4, 4), 1.0, 22)
    torch.testing.assert_close(layer(x), sinkhorn(x, 7, backward="implicit", backend="torch"))
    assert mhc.FusedMHC is FusedMHC and mhc.sinkhorn is sinkhorn


def test_kernel_limit_is_consistent():
    assert mhc.layer.MAX_N == mhc.kernels.MAX_N


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((torch.zeros(3),), {}, ValueError, r"\[\.\.\., n, n\]"),
        ((torch.zeros(2, 3, 4),), {}, ValueError, r"\[\.\.\., n, n\]"),
        ((torch.zeros(2, 0, 0),), {}, ValueError, "n >= 1"),
        ((torch.zeros(3, 3, dtype=torch.int64),), {}, TypeError, "float16"),
        (([[0.0]],), {}, TypeError, "torch.Tensor"),
        ((torch.zeros(3, 3), 0), {}, ValueError, "iters must be >= 1"),
        ((torch.zeros(3, 3), 2.5), {}, TypeError, "iters must be an int"),
        ((torch.zeros(3, 3), True), {}, TypeError, "iters must be an int"),
        ((torch.zeros(3, 3),), {"backward": "adjoint"}, ValueError, "backward must be one of"),
        ((torch.zeros(3, 3),), {"backend": "cuda"}, ValueError, "backend must be one of"),
        ((torch.zeros(65, 65),), {"backend": "triton"}, ValueError, "n <= 64"),
    ],
)
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        sinkhorn(*args, **kwargs)


def test_large_n_on_torch_backend():
    x = random_logits((2, 70, 70), 1.0, 23, device="cpu")
    torch.testing.assert_close(sinkhorn(x, 5, backend="torch"), oracle(x, 5), rtol=0, atol=1e-12)


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(mhc.kernels, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        sinkhorn(torch.zeros(3, 3), backend="triton")


def test_module_rejects_bad_settings():
    with pytest.raises(ValueError, match="backward must be one of"):
        FusedMHC(backward="nope")
    with pytest.raises(ValueError, match="iters must be >= 1"):
        FusedMHC(mhc_iters=0)


def test_auto_backend_on_cpu_is_torch():
    x = random_logits((3, 4, 4), 1.0, 24, device="cpu").requires_grad_()
    out = sinkhorn(x, 4)
    assert out.grad_fn is not None and "SinkhornFunction" not in type(out.grad_fn).__name__
    assert math.isclose(out.sum().item(), 12.0, rel_tol=1e-12)


def _poison(kind, z):
    """Put one kind of non-finite value into the first matrix of ``z [B, n, n]`` (n >= 3)."""
    if kind == "nan":
        z[0, 1, 2] = float("nan")
    elif kind == "+inf":
        z[0, 1, 2] = float("inf")
    elif kind == "-inf row":
        z[0, 1] = -float("inf")
    elif kind == "-inf column":
        z[0, :, 1] = -float("inf")
    elif kind == "-inf entry":
        z[0, 1, 2] = -float("inf")
    return z


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("backward", ["exact", "implicit"])
@pytest.mark.parametrize("kind", ["nan", "+inf", "-inf row", "-inf column", "-inf entry"])
@pytest.mark.parametrize("n", [4, 7], ids=["rows", "tiled"])  # the two kernel layouts
def test_non_finite_logits(kind, n, backward, backend):
    # documented in sinkhorn's docstring and docs/sinkhorn.md: non-finite logits act per matrix
    z = _poison(kind, random_logits((3, n, n), 1.0, 11, dtype=torch.float32)).requires_grad_()
    out = sinkhorn(z, 20, backward=backward, backend=backend)
    (grad,) = torch.autograd.grad(out, z, random_logits((3, n, n), 1.0, 12, dtype=torch.float32))
    clean = random_logits((3, n, n), 1.0, 11, dtype=torch.float32)[1:].requires_grad_()
    clean_out = sinkhorn(clean, 20, backward=backward, backend=backend)
    (clean_grad,) = torch.autograd.grad(clean_out, clean, random_logits((3, n, n), 1.0, 12, dtype=torch.float32)[1:])
    torch.testing.assert_close(out[1:], clean_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad[1:], clean_grad, rtol=0, atol=1e-5)
    if kind == "-inf entry":
        assert torch.isfinite(out).all() and out[0, 1, 2] == 0 and torch.isfinite(grad).all()
        torch.testing.assert_close(out[0].sum(-1), torch.ones(n, device=out.device), rtol=0, atol=1e-6)
        torch.testing.assert_close(out[0].sum(-2), torch.ones(n, device=out.device), rtol=0, atol=1e-3)
    else:
        assert torch.isnan(out[0]).all() and torch.isnan(grad[0]).all()
