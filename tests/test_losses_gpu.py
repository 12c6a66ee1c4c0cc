"""Full-size checks of the compiled linear cross-entropy kernels; run on a CUDA GPU."""

import pytest
import torch
import torch.nn.functional as F

import mhc.kernels.linear_cross_entropy as lce
from mhc.losses import linear_cross_entropy

pytestmark = pytest.mark.gpu


def _make(n, d, v, dtype, bias=False, seed=0, ignore_every=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, d, device="cuda", generator=g) * 2 / d**0.5).to(dtype)
    b = torch.randn(v, device="cuda", generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return x, w, b, t


def _loss_and_grads(fn, x, w, b, t, grad_out, reduction):
    leaves = [a.detach().clone().requires_grad_() for a in (x, w)]
    bias = b.detach().clone().requires_grad_() if b is not None else None
    loss = fn(leaves[0], leaves[1], bias, t, reduction)
    loss.backward(grad_out.to(loss.dtype))
    grads = [a.grad for a in leaves] + ([bias.grad] if bias is not None else [])
    return [loss.detach()] + grads


def _torch(x, w, b, t, reduction):
    return F.cross_entropy(F.linear(x, w, b).float(), t, reduction=reduction).to(x.dtype)


def _ours(x, w, b, t, reduction):
    return linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction)


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _assert_three_way(ours, theirs, want, dtype):
    """Loss and gradients: error against fp64 at most ~2x PyTorch's own in ``dtype``."""
    floor = {torch.float32: 5e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for name, a, p, r in zip(["loss", "dx", "dw", "db"], ours, theirs, want):
        assert a.dtype == dtype
        assert _rel(a, r) <= 2 * _rel(p, r) + floor, (name, _rel(a, r), _rel(p, r))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_three_way_rule(dtype, reduction, nan_poison):
    """Error against fp64 at most ~2x PyTorch's own error in the same dtype."""
    x, w, b, t = _make(1000, 384, 20011, dtype, bias=True, ignore_every=7)
    shape = (1000,) if reduction == "none" else ()
    grad_out = torch.rand(shape, device="cuda", dtype=torch.float64) + 0.5
    want = _loss_and_grads(_torch, x.double(), w.double(), b.double(), t, grad_out, reduction)
    ours = _loss_and_grads(_ours, x, w, b, t, grad_out, reduction)
    theirs = _loss_and_grads(_torch, x, w, b, t, grad_out, reduction)
    _assert_three_way(ours, theirs, want, dtype)


def test_deterministic_bitwise():
    x, w, b, t = _make(3000, 512, 40000, torch.bfloat16, bias=True, ignore_every=5)
    grad_out = torch.tensor(1.7, device="cuda", dtype=torch.float64)
    first = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
    for _ in range(2):
        again = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
        for a, c in zip(first, again):
            assert torch.equal(a, c)


def test_more_than_2_31_logits():
    """N * V > 2^31: 64-bit offsets; compared with the PyTorch chunked path on the GPU."""
    n, d, v = 33000, 16, 66000
    assert n * v > 2**31
    x, w, _, t = _make(n, d, v, torch.float32)
    grad_out = torch.tensor(1.0, device="cuda", dtype=torch.float64)
    ours = _loss_and_grads(_ours, x, w, None, t, grad_out, "sum")
    ref = _loss_and_grads(
        lambda *a: linear_cross_entropy(a[0], a[1], a[3], reduction=a[4], backend="torch"),
        x,
        w,
        None,
        t,
        grad_out,
        "sum",
    )
    for a, r in zip(ours, ref):
        assert _rel(a, r.double()) < 1e-4


def test_all_ignored():
    x, w, _, t = _make(300, 64, 9000, torch.bfloat16)
    t.fill_(-100)
    loss, dx, dw = _loss_and_grads(_ours, x, w, None, t, torch.tensor(1.0, device="cuda"), "mean")
    assert loss.item() == 0.0 and not dx.any() and not dw.any()


def test_many_chunks_match_one(monkeypatch):
    x, w, b, t = _make(700, 128, 10007, torch.float32, bias=True, ignore_every=3)
    grad_out = torch.tensor(1.0, device="cuda")
    one = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
    monkeypatch.setattr(lce, "MIN_CHUNK", 1000)
    monkeypatch.setattr(lce, "CHUNK_BYTES", 1)
    many = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
    for a, c in zip(one, many):
        assert _rel(a, c.double()) < 1e-5  # dx sums the chunks in another order


def test_triton_input_gradient_matches_cublas(monkeypatch):
    """The Triton dx kernel (PyTorch builds without fp32-output addmm) against the cuBLAS path."""
    x, w, b, t = _make(1500, 256, 12000, torch.bfloat16, ignore_every=4)
    grad_out = torch.tensor(1.0, device="cuda")
    default = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
    monkeypatch.setattr(lce, "_cublas_accumulates_fp32", lambda x: False)
    triton_dx = _loss_and_grads(_ours, x, w, b, t, grad_out, "mean")
    assert _rel(triton_dx[1], default[1].double()) < 4e-3  # bf16 roundings of equal fp32 sums
    assert torch.equal(triton_dx[2], default[2])


OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)


def _class_weights(v, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(v, device="cuda", generator=g) + 0.25


def _torch_options(class_weight):
    """PyTorch's own arithmetic in the input dtype (logits and soft-cap), CE and z-loss in fp32."""

    def fn(x, w, b, t, reduction):
        logits = F.linear(x, w, b)
        logits = OPTIONS["softcap"] * torch.tanh(logits / OPTIONS["softcap"])
        logits = logits.float() if x.dtype != torch.float64 else logits
        ce = F.cross_entropy(
            logits,
            t,
            weight=class_weight.to(logits.dtype),
            reduction=reduction,
            label_smoothing=OPTIONS["label_smoothing"],
        )
        valid = t != -100
        z = OPTIONS["lse_square_scale"] * torch.logsumexp(logits, dim=1).square() * valid
        z = z if reduction == "none" else z.sum() / valid.sum()
        return (ce + z).to(x.dtype)

    return fn


def _ours_options(class_weight):
    def fn(x, w, b, t, reduction):
        return linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, weight=class_weight, **OPTIONS)

    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_options_three_way_rule(dtype, nan_poison):
    """Class weights, label smoothing, z-loss and soft-cap together, full-size vocabulary."""
    x, w, b, t = _make(1000, 384, 20011, dtype, bias=True, ignore_every=7)
    x = 8 * x  # logits of tens: the soft-cap at 30 bends them
    cw = _class_weights(20011)
    grad_out = torch.rand(1000, device="cuda", dtype=torch.float64) + 0.5
    want = _loss_and_grads(_torch_options(cw), x.double(), w.double(), b.double(), t, grad_out, "none")
    ours = _loss_and_grads(_ours_options(cw), x, w, b, t, grad_out, "none")
    theirs = _loss_and_grads(_torch_options(cw), x, w, b, t, grad_out, "none")
    _assert_three_way(ours, theirs, want, dtype)


def test_options_deterministic_bitwise():
    x, w, b, t = _make(3000, 512, 40000, torch.bfloat16, bias=True, ignore_every=5)
    fn = _ours_options(_class_weights(40000))
    grad_out = torch.tensor(1.3, device="cuda", dtype=torch.float64)
    first = _loss_and_grads(fn, x, w, b, t, grad_out, "mean")
    again = _loss_and_grads(fn, x, w, b, t, grad_out, "mean")
    for a, c in zip(first, again):
        assert torch.equal(a, c)
