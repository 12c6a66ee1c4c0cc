"""HyperConnection on a CUDA GPU: the fused kernels at full sizes, torch.compile, bf16 autocast."""

import copy

import pytest
import torch
from torch import nn

from mhc.mixing import HyperConnection
from tests.test_mixing_fused import run

pytestmark = pytest.mark.gpu


def _block():
    torch.manual_seed(0)
    hc = HyperConnection(64, 4, nn.Sequential(nn.Linear(64, 64), nn.GELU()), init="zero").cuda()
    x = torch.randn(8, 16, 4, 64, device="cuda", requires_grad=True)
    return hc, x


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()  # no compiled frames or recompile counts from earlier tests
    hc, x = _block()
    w = torch.randn_like(x)
    compiled = torch.compile(hc, fullgraph=True)
    compiled(x).backward(w)
    got_x, got_phi = x.grad.clone(), hc.phi.grad.clone()
    x.grad = None
    hc.zero_grad()
    hc(x).backward(w)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_phi, hc.phi.grad, rtol=1e-4, atol=1e-5)


def test_triton_and_torch_backends_agree_under_bf16_autocast():
    hc, x = _block()
    ref = HyperConnection(64, 4, hc.branch, init="zero", backend="torch").cuda()
    ref.load_state_dict(hc.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, want = hc(x), ref(x)
        h_res = hc.coefficients(x)[2]
    assert h_res.dtype == torch.float32
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ fused path, full sizes


def _pair(dim, n, seed, dtype):
    """Fused and reference layers with the same random parameters; ``phi`` at the scale of a
    trained projection (``1/sqrt(n*dim)``), gates and biases of order one."""
    torch.manual_seed(seed)
    branch = nn.Linear(dim, dim, bias=False).cuda()
    fused = HyperConnection(dim, n, branch, init="zero", backend="triton").cuda()
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if name == "phi":
                p.normal_(std=p.shape[0] ** -0.5)
            elif not name.startswith("branch"):
                p.add_(torch.randn_like(p) * 0.5)
    ref = HyperConnection(dim, n, branch, init="zero", backend="torch").cuda()
    ref.load_state_dict(fused.state_dict())
    return fused, ref


def _low_precision_runs(seed, dim=4096, n=4, tokens=2048, dtype=torch.bfloat16):
    """``(exact, fused, reference)``: output and gradients (the branch's left out) of the fp64
    reference path and of the fused and the reference path in ``dtype`` (bf16, d = 4096, n = 4,
    2048 tokens unless given)."""
    fused, ref = _pair(dim, n, seed, dtype)
    x = torch.randn(tokens, n, dim, device="cuda")
    w = torch.randn_like(x)
    exact = run(copy.deepcopy(ref).double(), x.double(), w.double())
    ref.branch.to(dtype)
    fused.branch.to(dtype)
    low = run(ref, x.to(dtype), w.to(dtype))
    got = run(fused, x.to(dtype), w.to(dtype))
    keep = lambda d: {k: v for k, v in d.items() if not k.startswith("branch")}  # noqa: E731
    return keep(exact), keep(got), keep(low)


def _relative(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


def test_fused_bf16_full_size_three_way():
    exact, got, low = _low_precision_runs(0)
    errors = {k: (_relative(got[k], exact[k]), _relative(low[k], exact[k])) for k in exact if k != "alpha"}
    assert all(err <= 2 * err_ref + 1e-6 for err, err_ref in errors.values()), errors


@pytest.mark.parametrize(
    "dim, n, dtype",
    [(1024, 5, torch.bfloat16), (1000, 7, torch.bfloat16), (4096, 8, torch.bfloat16), (1000, 6, torch.float16)],
)
def test_fused_five_to_eight_streams_three_way(dim, n, dtype):
    """n = 5..8 run the projection backward as two passes (``dx``, with a tf32 ``g @ phi^T`` for
    bf16, then ``dphi``): the output and the gradients of ``x`` and ``phi`` within the three-way
    rule. The biases' and gates' gradients (sums over tokens, single draws) come from the
    gradient kernel that every n shares; they are tested over draws at n = 4 above."""
    exact, got, low = _low_precision_runs(0, dim, n, tokens=1024, dtype=dtype)
    errors = {k: (_relative(got[k], exact[k]), _relative(low[k], exact[k])) for k in ("out", "x", "phi")}
    assert all(err <= 2 * err_ref + 1e-6 for err, err_ref in errors.values()), errors


def test_fused_bf16_full_size_gate_gradients_three_way():
    """The gates' gradients are one number each: a single draw of a sum of independent rounding
    errors, which may cancel in one path and not in the other (docs/mixing.md, Accuracy). The
    rule is applied to the error over eight draws."""
    gates = ("a_pre", "a_post", "a_res")
    draws = []
    for seed in range(8):
        draws.append([{k: d["alpha"][i : i + 1] for i, k in enumerate(gates)} for d in _low_precision_runs(seed)])
    errors = {}
    for k in gates:
        exact, got, low = (torch.cat([draw[i][k] for draw in draws]) for i in range(3))
        errors[k] = (_relative(got, exact), _relative(low, exact))
    assert all(err <= 2 * err_ref + 1e-6 for err, err_ref in errors.values()), errors


def _fp32_errors(dim, n):
    """``{name: (fused error, reference error)}`` against fp64, relative, fp32 at ``dim, n``."""
    fused, ref = _pair(dim, n, 1, torch.float32)
    x = torch.randn(3, 333, n, dim, device="cuda")
    w = torch.randn_like(x)
    got, low = run(fused, x, w), run(ref, x, w)
    exact = run(copy.deepcopy(ref).double(), x.double(), w.double())
    return {k: (_relative(got[k], exact[k]), _relative(low[k], exact[k])) for k in exact}


@pytest.mark.parametrize("dim, n", [(1000, 4), (1536, 8), (7168, 4), (96, 16)])
def test_fused_fp32_awkward_sizes_three_way(dim, n):
    """fp32 at awkward sizes: error against fp64 at most twice the reference path's fp32 error."""
    errors = _fp32_errors(dim, n)
    assert all(err <= 2 * err_ref + 1e-6 for err, err_ref in errors.values()), errors


def test_fused_gradients_bit_identical_at_scale():
    fused, _ = _pair(2048, 4, 2, torch.bfloat16)
    fused.branch.to(torch.bfloat16)
    x = torch.randn(16384, 4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn_like(x)
    first, second = run(fused, x, w), run(fused, x, w)
    for k in first:
        assert torch.equal(first[k], second[k]), k


@pytest.mark.parametrize("n", [16, 32, 64])
@pytest.mark.parametrize("dynamic", [False, True])
def test_lane_mixer_many_lanes_matches_fp64_reference(n, dynamic):
    # Sinkhorn on the tiled kernels; the mix fused at n = 16, a batched matmul above.
    from mhc.mixing import LaneMixer

    torch.manual_seed(n)
    lm = LaneMixer(n, dim=96 if dynamic else None, dynamic=dynamic).cuda()
    with torch.no_grad():  # logits of std ~0.5: static part and projection of the unit-RMS lanes
        lm.logits.add_(torch.randn_like(lm.logits) * 0.3)
        if dynamic:
            lm.proj.add_(torch.randn_like(lm.proj) * 0.3 / (n * 96) ** 0.5)
    ref = LaneMixer(n, dim=96 if dynamic else None, dynamic=dynamic, backend="torch").double()
    ref.load_state_dict({k: v.double().cpu() for k, v in lm.state_dict().items()})
    x, grad = torch.randn(2048, n, 96, device="cuda"), torch.randn(2048, n, 96, device="cuda")
    got = run(lm, x, grad)
    want = run(ref, x.double().cpu(), grad.double().cpu())
    for name, value in want.items():
        err = (got[name].double().cpu() - value).norm() / value.norm()
        assert err < 1e-5, (name, err.item())


def test_sinkhorn_auto_above_kernel_limit_runs_torch():
    from mhc.layer import sinkhorn

    x = torch.randn(4, 70, 70, device="cuda")
    torch.testing.assert_close(sinkhorn(x, 5), sinkhorn(x, 5, backend="torch"))
