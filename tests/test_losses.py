"""Fused linear + cross-entropy against an fp64 PyTorch reference: both backends, every reduction,
ignored targets, bias, awkward shapes, dtypes, chunking, errors.

The ``triton`` backend runs the real kernels: compiled on a GPU, in Triton's interpreter on CPU.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import mhc.kernels.linear_cross_entropy as lce
import mhc.losses
from mhc.losses import LinearCrossEntropy, linear_cross_entropy
from tests.conftest import KERNEL_DEVICE

BACKENDS = ["triton", "torch"]


def _device(backend):
    return KERNEL_DEVICE if backend == "triton" else "cpu"


def make(n, d, v, *, bias, seed, ignore_frac=0.0, dtype=torch.float32, device="cpu", lead=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * 2 / d**0.5
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignore_frac] = -100
    if lead is not None:
        x, t = x.reshape(*lead, d), t.reshape(lead)
    cast = lambda a: None if a is None else a.to(device=device, dtype=dtype)
    return cast(x), cast(w), cast(b), t.to(device)


def run(fn, x, w, b, t, grad_out, reduction):
    """Loss and gradients of ``fn``, upstream gradient ``grad_out``; fp64 leaves get fp64 results."""
    leaves = [a.detach().clone().requires_grad_() for a in (x, w)]
    bias = None if b is None else b.detach().clone().requires_grad_()
    loss = fn(leaves[0], leaves[1], t, bias, reduction)
    loss.backward(grad_out.to(device=loss.device, dtype=loss.dtype))
    return [loss.detach()] + [a.grad for a in leaves] + ([] if bias is None else [bias.grad])


def reference(x, w, t, b, reduction):
    if reduction == "mean" and not (t != -100).any():
        reduction = "sum"  # the documented difference: 0, where PyTorch's mean gives NaN
    return F.cross_entropy(F.linear(x, w, b), t, reduction=reduction)


def fp64(x, w, b):
    return [None if a is None else a.detach().cpu().double() for a in (x, w, b)]


def upstream(reduction, shape, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape if reduction == "none" else (), generator=g, dtype=torch.float64)


def ours(backend):
    def fn(x, w, t, b, reduction):
        return linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, backend=backend)

    return fn


def assert_matches_fp64(got, want, atol, rtol=1e-4):
    for a, r in zip(got, want):
        torch.testing.assert_close(a.detach().cpu().double(), r, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- against fp64


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 40),
    v=st.integers(1, 80),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    ignore_frac=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_matches_fp64_reference(backend, n, d, v, bias, reduction, ignore_frac, seed, nan_poison):
    """Random shapes (V not a multiple of the tile, V = 1, small D), random upstream gradients."""
    x, w, b, t = make(n, d, v, bias=bias, seed=seed, ignore_frac=ignore_frac, device=_device(backend))
    g = upstream(reduction, (n,), seed)
    want = run(reference, *fp64(x, w, b), t.cpu(), g, reduction)
    got = run(ours(backend), x, w, b, t, g, reduction)
    assert_matches_fp64(got, want, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_noncontiguous_input(backend):
    x, w, b, t = make(24, 20, 37, bias=True, seed=3, ignore_frac=0.2, device=_device(backend), lead=(4, 6))
    x = x.transpose(0, 1).contiguous().transpose(0, 1)  # [4, 6, 20] with permuted strides
    assert not x.is_contiguous()
    g = upstream("none", (4, 6), 3)
    want = run(reference, *fp64(x.reshape(24, 20), w, b), t.reshape(24).cpu(), g.reshape(24), "none")
    got = run(ours(backend), x, w, b, t, g, "none")
    assert got[0].shape == (4, 6) and got[1].shape == (4, 6, 20)
    want[0], want[1] = want[0].reshape(4, 6), want[1].reshape(4, 6, 20)
    assert_matches_fp64(got, want, atol=2e-5)


def test_fp64_torch_backend_is_fp64_accurate():
    x, w, b, t = make(30, 16, 50, bias=True, seed=5, ignore_frac=0.2, dtype=torch.float64)
    for reduction in ("mean", "sum", "none"):
        g = upstream(reduction, (30,), 5)
        got = run(ours("auto"), x, w, b, t, g, reduction)
        want = run(reference, x, w, b, t, g, reduction)
        assert_matches_fp64(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_three_way_rule(backend, dtype):
    """Error against fp64 no worse than ~2x PyTorch's own error in the same dtype."""
    x, w, b, t = make(48, 64, 100, bias=True, seed=7, ignore_frac=0.1, dtype=dtype, device=_device(backend))
    g = upstream("mean", (), 7)
    want = run(reference, *fp64(x, w, b), t.cpu(), g, "mean")
    got = run(ours(backend), x, w, b, t, g, "mean")
    theirs = run(reference, x.cpu(), w.cpu(), b.cpu(), t.cpu(), g, "mean")
    rel = lambda a, r: ((a.cpu().double() - r).norm() / r.norm()).item()
    for a, p, r in zip(got, theirs, want):
        assert a.dtype == dtype
        assert rel(a, r) <= 2 * rel(p, r) + 1e-3


# ---------------------------------------------------------------- ignore_index and reductions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_gradients(backend, reduction):
    x, w, b, t = make(12, 8, 30, bias=True, seed=1, device=_device(backend))
    t = torch.full_like(t, -100)
    loss, dx, dw, db = run(ours(backend), x, w, b, t, upstream(reduction, (12,), 1), reduction)
    assert torch.isfinite(loss).all() and not loss.any()
    assert not dx.any() and not dw.any() and not db.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_ignore_index_and_mean_divisor(backend):
    x, w, _, t = make(20, 8, 10, bias=False, seed=2, device=_device(backend))
    t[:7] = 3
    got = linear_cross_entropy(x, w, t, ignore_index=3, backend=backend)
    keep = t.cpu() != 3
    want = F.cross_entropy(F.linear(x.cpu().double(), w.cpu().double())[keep], t.cpu()[keep])
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
    per_row = linear_cross_entropy(x, w, t, ignore_index=3, reduction="none", backend=backend)
    assert not per_row.cpu()[~keep].any()
    torch.testing.assert_close(got, per_row.sum() / keep.sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    x, w, _, t = make(0, 8, 10, bias=False, seed=0, device=_device(backend))
    loss, dx, dw = run(ours(backend), x, w, None, t, torch.tensor(1.0), "mean")
    assert loss.item() == 0.0 and dx.shape == (0, 8) and not dw.any()


# ---------------------------------------------------------------- chunking


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_vocabulary_chunks_match_one(backend, monkeypatch):
    x, w, b, t = make(33, 24, 150, bias=True, seed=4, ignore_frac=0.2, device=_device(backend))
    g = upstream("none", (33,), 4)
    one = run(ours(backend), x, w, b, t, g, "none")
    monkeypatch.setattr(lce, "MIN_CHUNK", 40)  # 4 chunks, the last one partial
    monkeypatch.setattr(lce, "CHUNK_BYTES", 1)
    monkeypatch.setattr(mhc.losses, "TORCH_CHUNK_BYTES", 33 * 4 * 40)
    many = run(ours(backend), x, w, b, t, g, "none")
    for a, c in zip(one, many):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_chunk_width_bounds_the_buffer():
    assert lce.chunk_columns(8192, 128256, 2) == 4096  # 64 MiB buffer
    assert lce.chunk_columns(1024, 128256, 2) == 32768
    assert lce.chunk_columns(16, 100, 2) == 100  # never wider than the vocabulary
    assert lce.chunk_columns(2**20, 128256, 2) == lce.MIN_CHUNK


def test_torch_path_never_holds_the_full_logits(monkeypatch):
    """The PyTorch path multiplies by one [N, chunk] slice of W at a time."""
    seen = []
    chunk_logits = mhc.losses._chunk_logits

    def spy(x, weight, bias, c0, c1):
        seen.append(c1 - c0)
        return chunk_logits(x, weight, bias, c0, c1)

    monkeypatch.setattr(mhc.losses, "_chunk_logits", spy)
    monkeypatch.setattr(mhc.losses, "TORCH_CHUNK_BYTES", 64 * 4 * 100)
    x, w, _, t = make(64, 16, 1000, bias=False, seed=0)
    run(ours("torch"), x, w, None, t, torch.tensor(1.0), "mean")
    assert max(seen) == 100 and sum(seen) == 2 * 1000  # forward + backward, 10 chunks each


# ---------------------------------------------------------------- gradients needed / module


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_or_input(backend):
    x, w, _, t = make(16, 8, 20, bias=False, seed=6, device=_device(backend))
    xg = x.clone().requires_grad_()
    linear_cross_entropy(xg, w, t, backend=backend).backward()
    wg = w.clone().requires_grad_()
    linear_cross_entropy(x, wg, t, backend=backend).backward()
    want = run(reference, *fp64(x, w, None), t.cpu(), torch.tensor(1.0, dtype=torch.float64), "mean")
    torch.testing.assert_close(xg.grad.cpu().double(), want[1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(wg.grad.cpu().double(), want[2], atol=2e-5, rtol=1e-4)


def test_module_owns_the_projection():
    torch.manual_seed(0)
    head = LinearCrossEntropy(16, 50, bias=True, reduction="sum")
    assert isinstance(head.linear, torch.nn.Linear) and head.linear.weight.shape == (50, 16)
    x = torch.randn(2, 5, 16)
    t = torch.randint(0, 50, (2, 5))
    loss = head(x, t)
    want = F.cross_entropy(head.linear(x).reshape(10, 50), t.reshape(10), reduction="sum")
    torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-5)
    loss.backward()
    assert head.linear.weight.grad is not None and head.linear.bias.grad is not None
    assert "reduction='sum'" in repr(head)


def test_autocast_casts_like_linear():
    x, w, _, t = make(16, 32, 40, bias=False, seed=8)
    wg = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, wg, t)
    assert loss.dtype == torch.bfloat16
    loss.float().backward()
    assert wg.grad.dtype == torch.float32
    want = run(reference, *fp64(x, w, None), t, torch.tensor(1.0, dtype=torch.float64), "mean")
    torch.testing.assert_close(loss.double(), want[0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(wg.grad.double(), want[2], atol=5e-3, rtol=0.05)
    # activations already in bf16, fp32 master weights: cast like F.linear, no dtype error
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = linear_cross_entropy(x.bfloat16(), wg, t)
    torch.testing.assert_close(mixed, loss)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make_args, error, match",
    [
        (lambda x, w, t: (x, w[:, :5], t), ValueError, r"\[V, D\].*\(30, 5\)"),
        (lambda x, w, t: (x, w, t[:3]), ValueError, r"target must have shape.*\(8,\).*\(3,\)"),
        (lambda x, w, t: (x, w.double(), t), TypeError, "dtype"),
        (lambda x, w, t: (x, w, t.float()), TypeError, "integer class indices"),
        (lambda x, w, t: (x.long(), w, t), TypeError, "float16, bfloat16"),
        (lambda x, w, t: (x, w, torch.full_like(t, 30)), ValueError, r"class 30, outside \[0, 30\)"),
        (lambda x, w, t: (x, w, torch.full_like(t, -1)), ValueError, "outside"),
        (lambda x, w, t: (x[0, 0], w, t), ValueError, "0-d"),
    ],
)
def test_bad_input_raises(make_args, error, match):
    x, w, _, t = make(8, 12, 30, bias=False, seed=0)
    with pytest.raises(error, match=match):
        linear_cross_entropy(*make_args(x, w, t))


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_out_of_range_raises_before_class_weights_are_indexed(backend):
    """The range check runs once the forward pass is queued (it never indexes by the target),
    and before the class weights are picked by target."""
    x, w, _, t = make(8, 12, 30, bias=False, seed=0, device=_device(backend))
    t[3] = 30
    class_weights = torch.rand(30, device=x.device)
    with pytest.raises(ValueError, match=r"class 30, outside \[0, 30\)"):
        linear_cross_entropy(x, w, t, weight=class_weights, backend=backend)


def test_bad_settings_raise():
    x, w, b, t = make(8, 12, 30, bias=True, seed=0)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(x, w, t, backend="cuda")
    with pytest.raises(ValueError, match=r"linear_bias must have shape \[V\]"):
        linear_cross_entropy(x, w, t, linear_bias=b[:4])
    with pytest.raises(TypeError, match="ignore_index"):
        linear_cross_entropy(x, w, t, ignore_index=1.5)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        linear_cross_entropy(x.double(), w.double(), t, backend="triton")
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropy(4, 5, reduction="avg")


def test_descriptor_and_pointer_loads_agree(monkeypatch):
    """Aligned rows go through tensor descriptors (TMA on Hopper), others through pointers."""
    x, w, b, t = make(40, 32, 90, bias=True, seed=9, ignore_frac=0.2, device=KERNEL_DEVICE)
    g = upstream("none", (40,), 9)
    with_tma = run(ours("triton"), x, w, b, t, g, "none")
    monkeypatch.setattr(lce, "USE_TMA", False)
    with_pointers = run(ours("triton"), x, w, b, t, g, "none")
    for a, c in zip(with_tma, with_pointers):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)
    assert lce._sources(x, w, 32, 32, 32)[2] is False
    monkeypatch.setattr(lce, "USE_TMA", True)
    assert lce._sources(x, w, 32, 32, 32)[2] is (lce.TensorDescriptor is not None)
    assert lce._sources(x[:, 1:], w[:, 1:], 32, 32, 32)[2] is False  # rows not 16-byte aligned


def test_inside_torch_compile_is_a_clean_graph_break():
    """torch.compile runs the op eagerly (it loops over chunks on the host); results unchanged."""
    x, w, _, t = make(16, 8, 20, bias=False, seed=10)
    w = w.requires_grad_()

    def step(x, w, t):
        return linear_cross_entropy(torch.tanh(x) * 2.0, w, t)

    compiled = torch.compile(step, backend="eager")
    compiled(x, w, t).backward()
    got = w.grad.clone()
    w.grad = None
    step(x, w, t).backward()
    torch.testing.assert_close(got, w.grad)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    import mhc.kernels

    x, w, _, t = make(8, 12, 30, bias=False, seed=0)
    monkeypatch.setattr(mhc.kernels, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        linear_cross_entropy(x, w, t, backend="triton")
