"""Inputs across the public API, by class: layouts (views, offsets, stride 0, transposes) read
right on every path, double backward is either right or refused, bad arguments raise
``TypeError`` / ``ValueError`` naming the argument, and the stated numeric limits hold.

On CPU the kernels run in Triton's interpreter; on a GPU the same tests run the compiled kernels
(where an out-of-bounds read turns into garbage or a fault rather than a lucky zero).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mhc import kernels
from mhc.layer import sinkhorn
from mhc.losses import LinearCrossEntropy, linear_cross_entropy
from mhc.mixing import (
    HyperConnection,
    LaneMixer,
    StreamCollapse,
    amax_gain,
    collect_h_res,
    expand_streams,
    reduce_streams,
    stream_collapse,
)
from mhc.ops.mixing import mhc_pre_mix, mhc_seam, post_mix, pre_mix
from tests.conftest import KERNEL_DEVICE

DEVICE = KERNEL_DEVICE
BACKENDS = ["torch", "triton"]
LAYOUTS = ["offset", "strided", "transposed", "broadcast"]
FLT_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------ layouts


def relayout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values (differentiably) in another memory layout. ``"broadcast"`` repeats the first
    entry along dim 0 with stride 0 (new values: callers compare against its contiguous copy)."""
    if kind == "contiguous" or t.numel() == 0:
        return t
    if kind == "offset":  # a view starting 3 elements into its storage
        return torch.cat([t.new_zeros(3), t.reshape(-1)])[3:].view(t.shape)
    if kind == "strided" or (kind == "transposed" and t.dim() < 2):  # every other element
        return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    if kind == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "broadcast":
        if t.dim() == 0:
            return t
        return t.narrow(0, 0, 1).expand(t.shape)
    raise AssertionError(kind)


def assert_layouts_agree(fn, *tensors, kinds, grad=True):
    """``fn`` of ``tensors`` in the layouts ``kinds`` (one per tensor) against ``fn`` of their
    contiguous copies: values, and the gradients of every floating input for a random upstream
    gradient."""
    leaves = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in tensors]
    results = []
    for dense in (False, True):
        for leaf in leaves:
            leaf.grad = None
        args = [relayout(leaf, kind) for leaf, kind in zip(leaves, kinds)]
        relaid = any(not a.is_contiguous() or a.storage_offset() > 0 for a in args)
        assert relaid or all(k == "contiguous" for k in kinds) or dense
        if dense:
            args = [a.contiguous() for a in args]
        torch.manual_seed(5)  # layers that fn builds get the same parameters both times
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
        if grad:
            torch.manual_seed(7)
            diff = [o for o in outs if o.requires_grad]
            torch.autograd.backward(diff, [torch.randn(o.shape, device=o.device, dtype=o.dtype) for o in diff])
        results.append(([o.detach().clone() for o in outs], [leaf.grad for leaf in leaves]))
    (got, got_grads), (want, want_grads) = results
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def hc_layer(backend, constraint="sinkhorn", dynamic=True, seed=0):
    torch.manual_seed(seed)
    init = "zero" if constraint == "sinkhorn" else "residual"
    layer = HyperConnection(
        8, 4, nn.Linear(8, 8), constraint=constraint, dynamic=dynamic, init=init, backend=backend
    ).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def loss_case(kind_of_target):
    N, D, V = 10, 16, 37
    x, w, b = torch.randn(N, D), torch.randn(V, D) * 0.3, torch.randn(V)
    target = torch.randint(0, V, (N, 3))[:, -1] if kind_of_target == "column" else torch.randint(0, V, (N,))
    class_weight = torch.rand(V) + 0.5
    return [t.to(DEVICE) for t in (x, w, target, b, class_weight)]


def mixing_case(n=4, d=8, lead=(2, 3)):
    T = math.prod(lead)
    torch.manual_seed(3)
    x, y = torch.randn(*lead, n, d), torch.randn(*lead, d)
    h_pre, h_post, h_res = torch.rand(T, n), torch.rand(T, n) * 2, torch.rand(T, n, n)
    M = 2 * n + n * n
    params = (torch.randn(n * d, M) * 0.1, torch.tensor([0.5, -0.3, 0.8]), torch.randn(M) * 0.3)
    return [t.to(DEVICE) for t in (x, y, h_pre, h_post, h_res, *params)]


CASES = {
    # name: (function of the tensors, tensors)
    "sinkhorn exact": (lambda z: sinkhorn(z, 20, backend="triton"), lambda: [torch.randn(3, 4, 4, 4).to(DEVICE)]),
    "sinkhorn implicit": (
        lambda z: sinkhorn(z, 20, backward="implicit", backend="triton"),
        lambda: [torch.randn(6, 4, 4).to(DEVICE)],
    ),
    "sinkhorn eps": (lambda z: sinkhorn(z, 20, backend="triton", eps=1e-3), lambda: [torch.randn(6, 4, 4).to(DEVICE)]),
    "sinkhorn n=9 tiled": (lambda z: sinkhorn(z, 20, backend="triton"), lambda: [torch.randn(4, 9, 9).to(DEVICE)]),
    "pre_mix": (lambda x, h: pre_mix(x, h), lambda: [mixing_case()[0], mixing_case()[2]]),
    "post_mix": (lambda x, y, hp, hr: post_mix(x, y, hp, hr), lambda: [mixing_case()[i] for i in (0, 1, 3, 4)]),
    "post_mix, mix only": (lambda x, hr: post_mix(x, None, None, hr), lambda: [mixing_case()[i] for i in (0, 4)]),
    "mhc_pre_mix": (
        lambda x, phi, a, b: mhc_pre_mix(x, (phi, a, b), 20, "exact", 1e-6),
        lambda: [mixing_case()[i] for i in (0, 5, 6, 7)],
    ),
    "mhc_seam": (
        lambda x, y, hp, hr, phi, a, b: mhc_seam(x, y, hp, hr, (phi, a, b), 20, "exact", 1e-6),
        lambda: [mixing_case()[i] for i in (0, 1, 3, 4, 5, 6, 7)],
    ),
    "stream_collapse": (
        lambda x, phi, a, b: stream_collapse(x, phi, a, b, backend="triton"),
        lambda: [
            mixing_case()[0],
            torch.randn(32, 4).to(DEVICE) * 0.1,
            torch.tensor([0.7]).to(DEVICE),
            torch.randn(4).to(DEVICE),
        ],
    ),
    "expand_streams": (
        lambda h, e: expand_streams(h, 4, e),
        lambda: [torch.randn(3, 8).to(DEVICE), torch.randn(4, 8).to(DEVICE)],
    ),
    "reduce_streams": (lambda x: reduce_streams(x), lambda: [mixing_case()[0]]),
    "linear_cross_entropy": (
        lambda x, w, t, b, cw: linear_cross_entropy(
            x, w, t, linear_bias=b, weight=cw.detach(), backend="triton", label_smoothing=0.1
        ),
        lambda: loss_case("column"),
    ),
}
for _constraint, _dynamic in (("sinkhorn", True), ("none", True), ("sinkhorn", False)):
    CASES[f"HyperConnection {_constraint} dynamic={_dynamic}"] = (
        (lambda c, dy: lambda x: hc_layer("triton", c, dy)(x))(_constraint, _dynamic),
        lambda: [mixing_case()[0]],
    )


def chained(backend):
    """Two sites chained with ``finish(y, next=)`` (the seam on the fused path)."""
    first, second = hc_layer(backend, seed=1), hc_layer(backend, seed=2)

    def run(x):
        x_in, finish = first.split(x)
        x_in, finish = finish(first.branch(x_in), next=second)
        return finish(second.branch(x_in))

    return run


CASES["HyperConnection chained"] = (lambda x: chained("triton")(x), lambda: [mixing_case()[0]])
for _dynamic in (False, True):
    CASES[f"LaneMixer dynamic={_dynamic}"] = (
        (lambda dy: lambda x: LaneMixer(4, 8, dynamic=dy, backend="triton").to(DEVICE)(x))(_dynamic),
        lambda: [mixing_case()[0]],
    )


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_argument_in_any_layout_reads_right(case, kind):
    fn, make = CASES[case]
    torch.manual_seed(0)
    tensors = make()
    assert_layouts_agree(fn, *tensors, kinds=[kind] * len(tensors))


@given(case=st.sampled_from(sorted(CASES)), data=st.data())
def test_layouts_mixed_per_argument(case, data):
    fn, make = CASES[case]
    torch.manual_seed(0)
    tensors = make()
    kinds = [data.draw(st.sampled_from(["contiguous", *LAYOUTS])) for _ in tensors]
    assert_layouts_agree(fn, *tensors, kinds=kinds)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_reads_strided_and_stride0_targets_and_biases(backend):
    x, w, target, b, _ = loss_case("column")
    for t in (target, torch.tensor(3, device=DEVICE).expand(x.shape[0])):
        for bias in (b, relayout(b, "strided"), torch.tensor(0.25, device=DEVICE).expand(w.shape[0])):
            want = F.cross_entropy(F.linear(x.double(), w.double(), bias.double()), t)
            got = linear_cross_entropy(x, w, t, linear_bias=bias, backend=backend)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_launchers_take_any_layout():
    """The public launchers of mhc.kernels, with every tensor argument strided."""
    x, y, h_pre, h_post, h_res, phi, alpha, bias = mixing_case()
    strided = lambda ts: [relayout(t, "strided") for t in ts]  # noqa: E731
    for args in ((x, h_res, y, h_post), (x, h_res[:1].expand_as(h_res), y, h_post[:1].expand_as(h_post))):
        torch.testing.assert_close(kernels.stream_mix_fwd(*strided(args)), kernels.stream_mix_fwd(*args))
    one = (x[:1, :1], relayout(h_res[:1], "transposed"), y[:1, :1], relayout(h_post[:1], "strided"))
    torch.testing.assert_close(kernels.stream_mix_fwd(*one), kernels.stream_mix_fwd(*[t.contiguous() for t in one]))
    want = kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    got = kernels.coefficients_fwd(*strided((x, phi, alpha, bias)), 20, 1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    _, p, r, hp, hpo, z, _ = want
    g_in = torch.randn_like(y)
    bwd_args = (x, phi, alpha, p, r, hp, hpo, None, torch.randn_like(hpo), torch.randn_like(z), g_in)
    want = kernels.coefficients_bwd(*bwd_args)
    got = kernels.coefficients_bwd(*[t if t is None else relayout(t, "strided") for t in bwd_args])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------ double backward


def second_order(fn, inputs):
    """First gradients (with a graph) and a second derivative of a random functional of them."""
    torch.manual_seed(11)
    out = fn(*inputs)
    c = torch.randn_like(out)
    grads = torch.autograd.grad((out * c).sum(), inputs, create_graph=True)
    probe = sum((g * torch.randn_like(g)).sum() for g in grads)
    return [g.detach() for g in grads], torch.autograd.grad(probe, inputs, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backward,eps", [("exact", 0.0), ("exact", 1e-3), ("implicit", 0.0)])
def test_sinkhorn_double_backward_matches_the_reference(backward, eps):
    z = torch.randn(5, 4, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    fn = lambda be: lambda t: sinkhorn(t, 20, backward=backward, backend=be, eps=eps)  # noqa: E731
    want = second_order(fn("torch"), [z])
    got = second_order(fn("triton"), [z])
    for g, w in zip(got[0] + list(got[1]), want[0] + list(want[1])):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
    if backward == "exact":  # and the reference's own second derivative is right
        assert torch.autograd.gradgradcheck(fn("triton"), (z[:2].detach().requires_grad_(),))


FUSED_OPS = {
    "HyperConnection": lambda be: lambda x: hc_layer(be)(x),
    "HyperConnection HC": lambda be: lambda x: hc_layer(be, "none")(x),
    "HyperConnection static": lambda be: lambda x: hc_layer(be, dynamic=False)(x),
    "chained": chained,
    "LaneMixer": lambda be: lambda x: LaneMixer(4, 8, dynamic=True, backend=be).to(DEVICE)(x),
    "StreamCollapse": lambda be: lambda x: StreamCollapse(8, 4, backend=be).to(DEVICE)(x),
}


@pytest.mark.parametrize("op", list(FUSED_OPS))
def test_fused_paths_refuse_double_backward_and_the_reference_differentiates(op):
    x = mixing_case()[0].requires_grad_()
    with pytest.raises(RuntimeError, match="does not support double backward"):
        second_order(FUSED_OPS[op]("triton"), [x])
    _, second = second_order(FUSED_OPS[op]("torch"), [x])
    assert second[0] is not None and torch.isfinite(second[0]).all()
    out = FUSED_OPS[op]("triton")(x)  # first order, no graph: unaffected
    (g,) = torch.autograd.grad(out, x, torch.randn_like(out))
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_refuses_double_backward(backend):
    x, w, target, _, _ = loss_case("flat")
    x.requires_grad_()
    loss = linear_cross_entropy(x, w, target, backend=backend)
    with pytest.raises(RuntimeError, match="linear_cross_entropy does not support double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


# ------------------------------------------------------------------------------ checkpoints, recorder, loss options


def test_nested_collect_h_res_blocks_both_record():
    layers = nn.ModuleList(HyperConnection(8, 4, nn.Linear(8, 8), backend="torch") for _ in range(3))
    x = torch.randn(2, 4, 8)
    with collect_h_res(layers) as outer:
        layers[0](x)
        with collect_h_res(layers[1:]) as inner:
            layers[1](x)
        layers[2](x)
        with collect_h_res(layers) as again:
            layers[0](x)
    assert (len(outer), len(inner), len(again)) == (4, 1, 1)
    assert all(m._recorder is None for m in layers)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        with collect_h_res([layers[0]]):
            pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weights_that_require_grad_are_refused(backend):
    x, w, target, _, cw = loss_case("flat")
    cw.requires_grad_()
    with pytest.raises(ValueError, match="weight .class weights. requires grad"):
        linear_cross_entropy(x, w, target, weight=cw, backend=backend)
    with torch.no_grad():  # as F.cross_entropy: only where a gradient could be asked for
        linear_cross_entropy(x, w, target, weight=cw, backend=backend)
    linear_cross_entropy(x, w, target, weight=cw.detach(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_capturable_loss_never_indexes_outside_the_class_weights(backend):
    """``capturable=True`` skips the targets' range check (documented: the loss is then undefined);
    an out-of-range target must still not index outside the class weights (a device fault)."""
    x, w, target, _, cw = loss_case("flat")
    target[0], target[1] = w.shape[0] + 5, -7
    loss = linear_cross_entropy(x, w, target, weight=cw, capturable=True, backend=backend)
    assert loss.shape == ()
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(x, w, target, weight=cw, backend=backend)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_with_no_features_is_that_of_the_bias(backend, bias):
    V, N = 7, 5
    x = torch.zeros(N, 0, device=DEVICE, requires_grad=True)
    w = torch.zeros(V, 0, device=DEVICE, requires_grad=True)
    b = torch.randn(V, device=DEVICE, requires_grad=True) if bias else None
    t = torch.randint(0, V, (N,), device=DEVICE)
    got = linear_cross_entropy(x, w, t, linear_bias=b, backend=backend)
    want = F.cross_entropy(F.linear(x, w, b), t)
    torch.testing.assert_close(got, want)
    if bias:
        (got_grad,) = torch.autograd.grad(got, b)
        (want_grad,) = torch.autograd.grad(want, b)
        torch.testing.assert_close(got_grad, want_grad)
    else:
        torch.testing.assert_close(got, torch.tensor(math.log(V), device=DEVICE))


# ------------------------------------------------------------------------------ numeric limits


@given(scale=st.floats(1e30, FLT_MAX / 2), n=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_sinkhorn_is_finite_while_the_spread_is_within_fp32(scale, n, seed):
    """docs/inputs.md: finite for logits whose spread within a matrix (max - min) is at most
    fp32's largest value, on both backends."""
    g = torch.Generator().manual_seed(seed)
    z = ((torch.rand(8, n, n, generator=g) * 2 - 1) * scale).to(DEVICE)
    for backend in BACKENDS:
        out = sinkhorn(z, 20, backend=backend)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.sum(-1), torch.ones_like(out.sum(-1)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_tokens_within_the_stated_limit_keep_their_coefficients(backend):
    """docs/inputs.md: fp32 coefficients are right while a token's sum of squares stays below
    fp32's largest value; entries of 1e17 at n * dim = 32 are far inside it."""
    layer = hc_layer(backend)
    x = mixing_case()[0] * 1e17
    want = [c.float() for c in layer.double().coefficients(x.double())]
    got = hc_layer(backend).coefficients(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.reshape(w.shape), w, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ argument errors

n_, d_ = 4, 8
X = lambda: torch.randn(2, 3, n_, d_)  # noqa: E731  (modules and helpers: CPU)
XK = lambda: torch.randn(2, 3, n_, d_, device=DEVICE)  # noqa: E731  (the fused functionals: the kernels' device)
META = torch.device("meta")


def hc_with_parameter_on(device, name: str) -> HyperConnection:
    """A HyperConnection whose parameter ``name`` alone lives on ``device``."""
    hc = HyperConnection(d_, n_, nn.Identity())
    setattr(hc, name, nn.Parameter(torch.zeros_like(getattr(hc, name), device=device)))
    return hc


BAD_CALLS = [
    # (call, error, message naming the argument)
    (
        lambda: stream_collapse(X(), torch.randn(32, 5), torch.ones(1), torch.zeros(4)),
        ValueError,
        "phi must have shape",
    ),
    (lambda: stream_collapse(X(), torch.randn(32, 4), torch.ones(3), torch.zeros(4)), ValueError, "a must have shape"),
    (lambda: stream_collapse(X(), torch.randn(32, 4), torch.ones(1), torch.zeros(6)), ValueError, "b must have shape"),
    (lambda: stream_collapse(X(), [1.0], torch.ones(1), torch.zeros(4)), TypeError, "phi must be a torch.Tensor"),
    (
        lambda: stream_collapse(X(), torch.randn(32, 4, device=META), torch.ones(1), torch.zeros(4)),
        ValueError,
        "phi is on meta",
    ),
    (
        lambda: stream_collapse(X(), torch.randn(32, 4), torch.ones(1), torch.zeros(4), backend="cuda"),
        ValueError,
        "backend must be one of",
    ),
    (lambda: amax_gain([[1.0]]), TypeError, r"h_res\[0\] must be a torch.Tensor"),
    (lambda: amax_gain(torch.eye(2)[None]), TypeError, "h_res must be a sequence"),
    (lambda: amax_gain(None), TypeError, "h_res must be a sequence"),
    (lambda: amax_gain([torch.zeros(0, 2, 2)]), ValueError, "at least one token"),
    (lambda: amax_gain([torch.zeros(3, 0, 0)]), ValueError, "n >= 1"),
    (lambda: amax_gain([torch.eye(2), torch.eye(2, device=META)]), ValueError, r"h_res\[1\] is on meta"),
    (lambda: expand_streams([1.0], 2), TypeError, "h must be a torch.Tensor"),
    (lambda: expand_streams(torch.randn(3, 4), 2, [1.0]), TypeError, "embedding must be a torch.Tensor"),
    (
        lambda: expand_streams(torch.randn(3, 4), 2, torch.ones(2, 4, dtype=torch.long)),
        TypeError,
        "embedding must be a floating-point",
    ),
    (lambda: expand_streams(torch.randn(3, 4), 2, torch.ones(2, 4, device=META)), ValueError, "embedding is on meta"),
    (lambda: expand_streams(torch.tensor(1.0), 2), ValueError, "h must have shape"),
    (lambda: collect_h_res("model").__enter__(), TypeError, "model must be a torch.nn.Module"),
    (lambda: HyperConnection(8, 4, branch=3), TypeError, "branch must be a module"),
    (lambda: HyperConnection(d_, n_, nn.Identity())(torch.randn(2, n_, d_, device=META)), ValueError, "x is on meta"),
    (lambda: hc_with_parameter_on(META, "phi")(X()), ValueError, "x is on cpu, the layer's parameters on meta"),
    (lambda: hc_with_parameter_on(META, "alpha")(X()), ValueError, "x is on cpu, the layer's parameters on meta"),
    (lambda: HyperConnection(d_, n_, lambda h: h.long())(X()), TypeError, "branch output must be a floating"),
    (lambda: HyperConnection(d_, n_, lambda h: h.to(META))(X()), ValueError, "branch output is on meta"),
    (lambda: LaneMixer(n_)(torch.randn(2, n_, d_, device=META)), ValueError, "x is on meta"),
    (lambda: pre_mix([1.0], torch.rand(3, 2)), TypeError, "x must be a floating-point torch.Tensor"),
    (lambda: pre_mix(XK(), torch.rand(5, n_, device=DEVICE)), ValueError, "h_pre must have shape"),
    (lambda: pre_mix(XK(), torch.rand(6, n_, device=DEVICE).double()), TypeError, "h_pre must be torch.float32"),
    (lambda: post_mix(XK(), None, None, torch.rand(6, 3, 3, device=DEVICE)), ValueError, "h_res must have shape"),
    (
        lambda: post_mix(XK(), torch.randn(2, 3, d_, device=DEVICE), None, torch.rand(6, n_, n_, device=DEVICE)),
        ValueError,
        "y and h_post go together",
    ),
    (
        lambda: mhc_pre_mix(XK(), (torch.randn(32, 24, device=DEVICE),) * 3, 20, "exact", 1e-6),
        ValueError,
        "alpha must have shape",
    ),
    (lambda: mhc_pre_mix(XK(), mixing_case()[5:], 20, "exact", 0.0), ValueError, "eps .the RMS epsilon."),
    (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), [0, 1, 2]),
        TypeError,
        "target must be a torch.Tensor",
    ),
    (lambda: LinearCrossEntropy(4, 5, weight=torch.ones(5, requires_grad=True)), ValueError, "requires grad"),
    (
        lambda: linear_cross_entropy(
            torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), ignore_index=2**70
        ),
        ValueError,
        "ignore_index must fit in int64",
    ),
    # the public launchers of mhc.kernels: a wrong shape would be read out of bounds
    (
        lambda: kernels.sinkhorn_fwd(torch.randn(3, 5, 4, device=DEVICE), 20),
        ValueError,
        r"logits must have shape \[T, n, n\]",
    ),
    (
        lambda: kernels.sinkhorn_fwd(torch.randn(3, 9, 8, device=DEVICE), 20),
        ValueError,
        r"logits must have shape \[T, n, n\]",
    ),
    (
        lambda: kernels.sinkhorn_fwd(torch.ones(3, 4, 4, dtype=torch.long, device=DEVICE), 20),
        TypeError,
        "logits must be",
    ),
    (
        lambda: kernels.sinkhorn_bwd(torch.randn(3, 4, 4, device=DEVICE), torch.randn(3, 4, 5, device=DEVICE), 20),
        ValueError,
        "grad_out must have shape",
    ),
    (
        lambda: kernels.sinkhorn_implicit_bwd(torch.rand(3, 4, 4, device=DEVICE), torch.randn(2, 4, 4, device=DEVICE)),
        ValueError,
        "grad_out must have shape",
    ),
    (lambda: kernels.sinkhorn_eps_fwd(torch.randn(3, 4, 4, device=DEVICE), 20, 0.0), ValueError, "eps must be"),
    (lambda: kernels.sinkhorn_fwd(torch.randn(3, 4, 4, device=DEVICE), 0), ValueError, "iters must be"),
    (lambda: kernels.stream_mix_fwd(XK(), torch.rand(6, n_, n_ + 1, device=DEVICE)), ValueError, "w must have shape"),
    (lambda: kernels.stream_mix_fwd(XK(), torch.rand(6, n_, n_, device=DEVICE).double()), TypeError, "w must be"),
    (
        lambda: kernels.stream_mix_fwd(
            XK(),
            torch.rand(6, n_, n_, device=DEVICE),
            torch.randn(6, d_ - 1, device=DEVICE),
            torch.rand(6, n_, device=DEVICE),
        ),
        ValueError,
        "y must have shape",
    ),
    (
        lambda: kernels.stream_mix_bwd(
            XK(), torch.rand(6, n_, n_, device=DEVICE), None, None, torch.randn(6, n_, d_ + 1, device=DEVICE)
        ),
        ValueError,
        "grad_out must have shape",
    ),
    (
        lambda: kernels.coefficients_fwd(
            XK(),
            torch.randn(32, 23, device=DEVICE),
            torch.ones(3, device=DEVICE),
            torch.zeros(24, device=DEVICE),
            20,
            1e-6,
        ),
        ValueError,
        "phi must have shape",
    ),
    (lambda: StreamCollapse(d_, n_).weights(torch.randn(2, n_, d_, device=META)), ValueError, "x is on meta"),
]


@pytest.mark.parametrize("call,error,match", BAD_CALLS, ids=[f"{i}-{m[:24]}" for i, (_, _, m) in enumerate(BAD_CALLS)])
def test_bad_arguments_raise_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
