"""The fused linear cross-entropy's options beyond plain cross-entropy: class weights, label
smoothing, the z-loss (``lse_square_scale``, ``return_z_loss``) and logit soft-capping, alone and
together, against an fp64 reference built from ``F.cross_entropy``; against PyTorch's own
``F.linear_cross_entropy`` where the installed PyTorch has it; bf16 by the three-way rule; errors.

The ``triton`` backend runs the real kernels: compiled on a GPU, in Triton's interpreter on CPU.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import mhc.kernels._host
import mhc.kernels.linear_cross_entropy as lce
import mhc.losses
from mhc.losses import LinearCrossEntropy, linear_cross_entropy
from tests.conftest import KERNEL_DEVICE
from tests.test_losses import fp64, make

BACKENDS = ["triton", "torch"]


def _device(backend):
    return KERNEL_DEVICE if backend == "triton" else "cpu"


def class_weights(v, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 2)
    return (torch.rand(v, generator=g, dtype=torch.float64) * 1.9 + 0.1).to(dtype)


def reference(x, w, t, b, reduction, class_weight=None, label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    """(loss, z_loss): PyTorch's cross-entropy of the (soft-capped) logits plus the z-loss."""
    logits = F.linear(x, w, b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = t != -100
    if reduction == "mean" and not valid.any():
        reduction = "sum"  # the documented difference: 0, where PyTorch's mean gives NaN
    ce = F.cross_entropy(logits, t, weight=class_weight, label_smoothing=label_smoothing, reduction=reduction)
    z_rows = torch.where(valid, lse_square_scale * torch.logsumexp(logits, dim=1) ** 2, 0.0)
    if reduction == "none":
        z = z_rows
    else:
        z = z_rows.sum() / (valid.sum().clamp(min=1) if reduction == "mean" else 1)
    return ce + z, z


def loss_and_grads(fn, x, w, b, t, grad_loss, grad_z):
    """Both outputs and the gradients of ``<loss, grad_loss> + <z_loss, grad_z>``."""
    leaves = [a.detach().clone().requires_grad_() for a in (x, w)]
    bias = None if b is None else b.detach().clone().requires_grad_()
    loss, z = fn(leaves[0], leaves[1], t, bias)
    cast = lambda g: g.to(device=loss.device, dtype=loss.dtype)
    torch.autograd.backward([loss, z], [cast(grad_loss), cast(grad_z)])
    grads = [a.grad for a in leaves] + ([] if bias is None else [bias.grad])
    return [loss.detach(), z.detach()] + grads


def ours(backend, reduction, **options):
    def fn(x, w, t, b):
        cw = options.get("weight")
        opts = dict(options, weight=None if cw is None else cw.to(x.device))
        return linear_cross_entropy(
            x, w, t, linear_bias=b, reduction=reduction, return_z_loss=True, backend=backend, **opts
        )

    return fn


def theirs(reduction, **options):
    def fn(x, w, t, b):
        cw = options.get("weight")
        return reference(
            x,
            w,
            t,
            b,
            reduction,
            None if cw is None else cw.to(x.dtype),
            options.get("label_smoothing", 0.0),
            options.get("lse_square_scale", 0.0),
            options.get("softcap"),
        )

    return fn


def upstreams(reduction, n, seed):
    g = torch.Generator().manual_seed(seed + 1)
    shape = (n,) if reduction == "none" else ()
    return (torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64))


def assert_matches(got, want, atol, rtol=1e-4):
    for a, r in zip(got, want):
        torch.testing.assert_close(a.detach().cpu().double(), r.cpu(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- against fp64


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    n=st.integers(1, 30),
    d=st.integers(1, 24),
    v=st.integers(1, 70),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    ignore_frac=st.sampled_from([0.0, 0.3]),
    weighted=st.booleans(),
    label_smoothing=st.sampled_from([0.0, 0.1, 0.6, 1.0]),
    lse_square_scale=st.sampled_from([0.0, 1e-2]),
    softcap=st.sampled_from([None, 1.5, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_options_match_fp64_reference(
    backend,
    n,
    d,
    v,
    bias,
    reduction,
    ignore_frac,
    weighted,
    label_smoothing,
    lse_square_scale,
    softcap,
    seed,
    nan_poison,
):
    """Every option and their combinations, random shapes, random upstream gradients for both
    the loss and the returned z-loss."""
    x, w, b, t = make(n, d, v, bias=bias, seed=seed, ignore_frac=ignore_frac, device=_device(backend))
    options = dict(
        weight=class_weights(v, seed) if weighted else None,
        label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
    )
    grad_loss, grad_z = upstreams(reduction, n, seed)
    want = loss_and_grads(theirs(reduction, **options), *fp64(x, w, b), t.cpu(), grad_loss, grad_z)
    got = loss_and_grads(ours(backend, reduction, **options), x, w, b, t, grad_loss, grad_z)
    assert_matches(got, want, atol=3e-5)


def test_fp64_torch_backend_with_every_option():
    x, w, b, t = make(25, 12, 40, bias=True, seed=11, ignore_frac=0.2, dtype=torch.float64)
    options = dict(weight=class_weights(40, 11), label_smoothing=0.2, lse_square_scale=3e-2, softcap=2.0)
    for reduction in ("mean", "sum", "none"):
        grad_loss, grad_z = upstreams(reduction, 25, 11)
        got = loss_and_grads(ours("torch", reduction, **options), x, w, b, t, grad_loss, grad_z)
        want = loss_and_grads(theirs(reduction, **options), x, w, b, t, grad_loss, grad_z)
        assert_matches(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"), reason=f"torch {torch.__version__} has no F.linear_cross_entropy"
)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_linear_cross_entropy(backend, reduction):
    """The arguments PyTorch's own op has (weight, label_smoothing, ignore_index), on CPU."""
    x, w, b, t = make(37, 20, 53, bias=True, seed=12, ignore_frac=0.25)
    cw = class_weights(53, 12, torch.float32)
    t[3] = 7
    seven = torch.where(t == -100, 7, t)  # ignore_index=7 with no -100 left
    dev = _device(backend)
    for ignore_index, target in ((None, t), (7, seven)):
        want = F.linear_cross_entropy(
            x, w, target, linear_bias=b, weight=cw, reduction=reduction, ignore_index=ignore_index, label_smoothing=0.15
        )
        got = linear_cross_entropy(
            x.to(dev),
            w.to(dev),
            target.to(dev),
            linear_bias=b.to(dev),
            weight=cw.to(dev),
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=0.15,
            backend=backend,
        )
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_options_half_precision_three_way_rule(backend, dtype):
    """Error against fp64 no worse than ~2x PyTorch's own error in the same dtype."""
    x, w, b, t = make(48, 64, 100, bias=True, seed=13, ignore_frac=0.1, dtype=dtype, device=_device(backend))
    options = dict(weight=class_weights(100, 13), label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)
    grad_loss, grad_z = upstreams("mean", 48, 13)
    want = loss_and_grads(theirs("mean", **options), *fp64(x, w, b), t.cpu(), grad_loss, grad_z)
    got = loss_and_grads(ours(backend, "mean", **options), x, w, b, t, grad_loss, grad_z)
    pytorch = loss_and_grads(theirs("mean", **options), x.cpu(), w.cpu(), b.cpu(), t.cpu(), grad_loss, grad_z)
    rel = lambda a, r: ((a.cpu().double() - r).norm() / r.norm()).item()
    for a, p, r in zip(got, pytorch, want):
        assert a.dtype == dtype
        assert rel(a, r) <= 2 * rel(p, r) + 1e-3


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_is_lse_squared_and_included(backend):
    x, w, _, t = make(20, 16, 30, bias=False, seed=14, ignore_frac=0.3, device=_device(backend))
    plain = linear_cross_entropy(x, w, t, backend=backend)
    loss, z = linear_cross_entropy(x, w, t, lse_square_scale=0.05, return_z_loss=True, backend=backend)
    valid = (t != -100).cpu()
    lse = torch.logsumexp(F.linear(x.cpu().double(), w.cpu().double()), dim=1)[valid]
    torch.testing.assert_close(z.cpu().double(), 0.05 * lse.square().mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, plain + z)
    _, z_off = linear_cross_entropy(x, w, t, return_z_loss=True, backend=backend)
    assert z_off.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weights_scale_rows_and_mean_divides_by_their_sum(backend):
    x, w, _, t = make(16, 8, 12, bias=False, seed=15, ignore_frac=0.25, device=_device(backend))
    cw = class_weights(12, 15, torch.float32).to(_device(backend))
    per_row = linear_cross_entropy(x, w, t, weight=cw, reduction="none", backend=backend)
    plain = linear_cross_entropy(x, w, t, reduction="none", backend=backend)
    valid = t != -100
    target_weight = torch.where(valid, cw[torch.where(valid, t, 0)], 0.0)
    torch.testing.assert_close(per_row, plain * target_weight)
    mean = linear_cross_entropy(x, w, t, weight=cw, backend=backend)
    torch.testing.assert_close(mean, per_row.sum() / target_weight.sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_with_options_is_zero(backend):
    x, w, b, t = make(10, 8, 20, bias=True, seed=16, device=_device(backend))
    t = torch.full_like(t, -100)
    options = dict(weight=class_weights(20, 16), label_smoothing=0.3, lse_square_scale=0.1, softcap=4.0)
    grad_loss, grad_z = upstreams("mean", 10, 16)
    loss, z, dx, dw, db = loss_and_grads(ours(backend, "mean", **options), x, w, b, t, grad_loss, grad_z)
    assert loss.item() == 0.0 and z.item() == 0.0
    assert not dx.any() and not dw.any() and not db.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_bounds_the_logits(backend):
    """With a small cap every logit lies in (-cap, cap): the loss of a row is at most
    log(V) + 2 cap, however large the raw logits."""
    x, w, _, t = make(12, 8, 30, bias=False, seed=17, device=_device(backend))
    per_row = linear_cross_entropy(100 * x, w, t, softcap=0.5, reduction="none", backend=backend)
    assert (per_row <= torch.log(torch.tensor(30.0)) + 1.0 + 1e-5).all()
    uncapped = linear_cross_entropy(100 * x, w, t, reduction="none", backend=backend)
    assert uncapped.max() > 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_over_many_vocabulary_chunks(backend, monkeypatch):
    x, w, b, t = make(33, 24, 150, bias=True, seed=18, ignore_frac=0.2, device=_device(backend))
    options = dict(weight=class_weights(150, 18), label_smoothing=0.1, lse_square_scale=1e-2, softcap=3.0)
    grad_loss, grad_z = upstreams("none", 33, 18)
    one = loss_and_grads(ours(backend, "none", **options), x, w, b, t, grad_loss, grad_z)
    monkeypatch.setattr(lce, "MIN_CHUNK", 40)  # 4 chunks, the last one partial
    monkeypatch.setattr(lce, "CHUNK_BYTES", 1)
    monkeypatch.setattr(mhc.losses, "TORCH_CHUNK_BYTES", 33 * 4 * 40)
    many = loss_and_grads(ours(backend, "none", **options), x, w, b, t, grad_loss, grad_z)
    for a, c in zip(one, many):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_module_with_options():
    torch.manual_seed(0)
    cw = torch.rand(50) + 0.5
    head = LinearCrossEntropy(
        16, 50, weight=cw, label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0, return_z_loss=True
    )
    assert torch.equal(head.weight, cw) and "weight" in dict(head.named_buffers())
    x = torch.randn(3, 4, 16)
    t = torch.randint(0, 50, (3, 4))
    loss, z = head(x, t)
    want, want_z = reference(
        x.reshape(12, 16).double(),
        head.linear.weight.double(),
        t.reshape(12),
        None,
        "mean",
        cw.double(),
        0.1,
        1e-3,
        10.0,
    )
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z.double(), want_z.detach(), atol=1e-6, rtol=1e-5)
    assert "label_smoothing=0.1" in repr(head) and "softcap=10.0" in repr(head)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(weight=torch.ones(29)), ValueError, r"weight \(class weights\) must have shape \[V\]"),
        (dict(weight=torch.ones(30, dtype=torch.long)), TypeError, "floating-point"),
        (dict(weight=[1.0] * 30), TypeError, "weight must be a torch.Tensor"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be a finite float in \[0.0, 1.0\]"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a float"),
        (dict(lse_square_scale=-1e-4), ValueError, "lse_square_scale"),
        (dict(lse_square_scale=float("nan")), ValueError, "lse_square_scale"),
        (dict(softcap=0.0), ValueError, r"softcap must be a finite float in \(0.0, inf\)"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap=True), TypeError, "softcap"),
        (dict(return_z_loss=1), TypeError, "return_z_loss must be a bool"),
    ],
)
def test_bad_options_raise(options, error, match):
    x, w, _, t = make(8, 12, 30, bias=False, seed=0)
    with pytest.raises(error, match=match):
        linear_cross_entropy(x, w, t, **options)


def test_ignore_index_none_is_minus_100():
    x, w, _, t = make(12, 8, 20, bias=False, seed=19, ignore_frac=0.4)
    assert (t == -100).any()
    torch.testing.assert_close(
        linear_cross_entropy(x, w, t, ignore_index=None), linear_cross_entropy(x, w, t, ignore_index=-100)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capturable_reads_nothing_on_the_host(dtype, monkeypatch):
    """``capturable=True``: no host read in forward or backward (``read_later`` and ``.item()``
    refused), the same loss and gradients as the default path, every option on."""
    g = torch.Generator().manual_seed(21)
    device = KERNEL_DEVICE
    x = torch.randn(37, 24, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(50, 24, generator=g) * 0.3).to(device=device, dtype=dtype)
    b = (torch.randn(50, generator=g) * 0.1).to(device=device, dtype=dtype)
    t = torch.randint(0, 50, (37,), generator=g).to(device)
    t[3] = -100
    weights = class_weights(50, 1).float().to(device)
    options = dict(weight=weights, label_smoothing=0.1, lse_square_scale=1e-3, softcap=20.0, backend="triton")
    grad_up = torch.tensor(0.7, device=device, dtype=dtype)

    def run(capturable):
        xs, ws, bs = (v.clone().requires_grad_() for v in (x, w, b))
        loss = linear_cross_entropy(xs, ws, t, linear_bias=bs, capturable=capturable, **options)
        loss.backward(grad_up)
        return loss.detach(), xs.grad, ws.grad, bs.grad

    want = run(False)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read")

    monkeypatch.setattr(mhc.kernels._host, "read_later", refuse)  # the loss's target check
    monkeypatch.setattr(lce, "read_later", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    got = run(True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, **tol)
    with pytest.raises(TypeError, match="capturable must be a bool"):
        linear_cross_entropy(x, w, t, capturable=1)
