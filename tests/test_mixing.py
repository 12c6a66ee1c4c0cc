"""mhc.mixing: HyperConnection (mHC / HC), LaneMixer, stream helpers, stability metrics."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from mhc.mixing import (
    HyperConnection,
    LaneMixer,
    StreamExpand,
    amax_gain,
    collect_h_res,
    expand_streams,
    reduce_streams,
)


def randomise(module: nn.Module, seed: int, scale: float = 0.5) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return module


def streams(lead, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, n, dim, generator=g)


@given(
    n=st.integers(1, 8),
    dim=st.integers(1, 12),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    constraint=st.sampled_from(["sinkhorn", "none"]),
    dynamic=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_output_is_the_formula(n, dim, lead, constraint, dynamic, seed):
    branch = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
    hc = randomise(HyperConnection(dim, n, branch, dynamic=dynamic, constraint=constraint), seed)
    x = streams(lead, n, dim, seed + 1)
    h_pre, h_post, h_res = hc.coefficients(x)
    assert h_pre.shape == (*lead, n) and h_post.shape == (*lead, n) and h_res.shape == (*lead, n, n)
    want = torch.zeros_like(x)
    y = branch((h_pre[..., :, None] * x).sum(-2))
    for i in range(n):
        want[..., i, :] = (h_res[..., i, :, None] * x).sum(-2) + h_post[..., i, None] * y
    torch.testing.assert_close(hc(x), want, rtol=1e-5, atol=1e-5)


@given(n=st.integers(1, 8), dim=st.integers(1, 12), dynamic=st.booleans(), seed=st.integers(0, 2**16))
def test_mhc_coefficient_ranges(n, dim, dynamic, seed):
    hc = randomise(HyperConnection(dim, n, dynamic=dynamic, init="zero"), seed, scale=0.5)
    h_pre, h_post, h_res = hc.coefficients(streams((5,), n, dim, seed + 1))
    assert h_pre.dtype == h_post.dtype == h_res.dtype == torch.float32
    assert ((h_pre > 0) & (h_pre < 1)).all() and ((h_post > 0) & (h_post < 2)).all()
    assert (h_res >= 0).all()
    torch.testing.assert_close(h_res.sum(-1), torch.ones(5, n), rtol=0, atol=1e-5)
    hc_long = HyperConnection(dim, n, dynamic=dynamic, init="zero", sinkhorn_iters=200)
    hc_long.load_state_dict(hc.state_dict())
    cols = hc_long.coefficients(streams((5,), n, dim, seed + 1))[2].sum(-2)
    assert (cols - 1).abs().max() <= (h_res.sum(-2) - 1).abs().max() + 1e-6  # columns approach 1


@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
def test_dynamic_coefficients_vary_across_tokens_static_do_not(constraint):
    x = streams((6,), 4, 8, 0)
    dyn = randomise(HyperConnection(8, 4, dynamic=True, constraint=constraint), 1)
    sta = randomise(HyperConnection(8, 4, dynamic=False, constraint=constraint), 1)
    for a, b in zip(dyn.coefficients(x), sta.coefficients(x)):
        assert (a[0] - a[1]).abs().max() > 1e-4
        assert (b - b[:1]).abs().max() == 0


@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_gradients_reach_every_parameter_and_the_input(constraint, dynamic):
    hc = randomise(HyperConnection(8, 4, nn.Linear(8, 8), dynamic=dynamic, constraint=constraint), 2, 0.1)
    x = streams((3, 5), 4, 8, 3).requires_grad_()
    hc(x).mul(streams((3, 5), 4, 8, 4)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in hc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
@given(n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_residual_init_equals_the_plain_residual_network(constraint, n, seed):
    torch.manual_seed(seed)
    dim, depth = 8, 3
    branches = [nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)]
    hcs = [HyperConnection(dim, n, b, constraint=constraint) for b in branches]
    h = streams((2, 5), 1, dim, seed)[..., 0, :]
    plain = h
    for b in branches:
        plain = plain + b(plain)
    x = expand_streams(h, n)
    for hc in hcs:
        x = hc(x)
    torch.testing.assert_close(reduce_streams(x), plain, rtol=1e-5, atol=1e-5)


def test_zero_init_is_not_the_residual_network():
    torch.manual_seed(0)
    branch = nn.Linear(8, 8)
    hc = HyperConnection(8, 4, branch, init="zero")
    h = streams((5,), 1, 8, 1)[..., 0, :]
    assert (reduce_streams(hc(expand_streams(h, 4))) - (h + branch(h))).abs().max() > 1e-3


def test_split_form_matches_forward_and_passes_branch_args():
    branch = nn.Linear(8, 8)
    hc = randomise(HyperConnection(8, 4, branch), 5)
    x = streams((2, 3), 4, 8, 6)
    x_in, finish = hc.split(x)
    torch.testing.assert_close(finish(branch(x_in)), hc(x))
    calls = {}

    def scaled(h, factor, *, shift):
        calls["args"] = (factor, shift)
        return h * factor + shift

    hc2 = randomise(HyperConnection(8, 4, scaled), 5)
    hc2(x, 2.0, shift=1.0)
    assert calls["args"] == (2.0, 1.0)
    with pytest.raises(ValueError, match="branch output"):
        finish(torch.zeros(2, 3, 7))


def test_wrong_shapes_and_settings_raise():
    hc = HyperConnection(8, 4, nn.Identity())
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 8\]"):
        hc(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 8\]"):
        hc(torch.zeros(2, 4, 9))
    with pytest.raises(ValueError, match="no branch"):
        HyperConnection(8, 4)(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="constraint"):
        HyperConnection(8, 4, constraint="birkhoff")
    with pytest.raises(ValueError, match="init"):
        HyperConnection(8, 4, init="identity")
    with pytest.raises(ValueError, match="init='residual' only"):
        HyperConnection(8, 4, constraint="none", init="zero")
    with pytest.raises(TypeError, match="n_streams"):
        HyperConnection(8, 4.0)
    with pytest.raises(ValueError, match="dynamic LaneMixer needs dim"):
        LaneMixer(4, dynamic=True)
    with pytest.raises(ValueError, match="reduce"):
        reduce_streams(torch.zeros(4, 8), reduce="max")


def test_state_dict_round_trip_and_bf16_autocast():
    hc = randomise(HyperConnection(8, 4, nn.Linear(8, 8)), 7)
    clone = HyperConnection(8, 4, nn.Linear(8, 8))
    clone.load_state_dict(hc.state_dict())
    x = streams((3,), 4, 8, 8)
    torch.testing.assert_close(clone(x), hc(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hc(x.bfloat16())
        h_pre, _, h_res = hc.coefficients(x.bfloat16())
    assert out.dtype == torch.bfloat16 and h_res.dtype == torch.float32
    torch.testing.assert_close(out.float(), hc(x), rtol=0.05, atol=0.05)


def test_stream_helpers():
    h = streams((2,), 1, 5, 9)[..., 0, :]
    x = expand_streams(h, 3)
    assert x.shape == (2, 3, 5) and (x == h[:, None]).all()
    x[:, 0] += 1  # copies, not views
    assert (x[:, 1] == h).all()
    torch.testing.assert_close(reduce_streams(expand_streams(h, 3), "sum"), 3 * h)
    emb = StreamExpand(3, 5)
    with torch.no_grad():
        emb.embedding.copy_(torch.arange(15.0).view(3, 5))
    torch.testing.assert_close(emb(h), expand_streams(h, 3) + torch.arange(15.0).view(3, 5))


def test_lane_mixer_static_and_dynamic():
    lm = LaneMixer(4)
    p = lm.matrix()
    assert p.shape == (4, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(4), rtol=0, atol=1e-5)
    x = streams((2, 3), 4, 6, 10)
    torch.testing.assert_close(lm(x), torch.einsum("ij,...jd->...id", p, x))
    dyn = randomise(LaneMixer(4, dim=6, dynamic=True), 11)
    pd = dyn.matrix(x)
    assert pd.shape == (2, 3, 4, 4) and (pd[0, 0] - pd[1, 2]).abs().max() > 1e-4
    torch.testing.assert_close(dyn(x), torch.einsum("...ij,...jd->...id", pd, x))
    x.requires_grad_()
    dyn(x).mul(streams((2, 3), 4, 6, 12)).sum().backward()
    assert dyn.proj.grad.abs().sum() > 0 and dyn.logits.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "constraint, dynamic", [("sinkhorn", True), ("sinkhorn", False), ("none", True), ("none", False)]
)
def test_fp64_layers_compute_their_coefficients_in_fp64(constraint, dynamic):
    # the fp64 reference is the exact oracle of the fused kernels' tests: no fp32 step inside
    hc = randomise(HyperConnection(6, 3, constraint=constraint, dynamic=dynamic, backend="torch"), 13)
    x = streams((2, 5), 3, 6, 14)
    low = hc.coefficients(x)
    exact = hc.double().coefficients(x.double())
    for got, want in zip(exact, low):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-5)
    lm = randomise(LaneMixer(3, dim=6, dynamic=True, backend="torch"), 15).double()
    assert lm.matrix(x.double()).dtype == torch.float64


def test_gain_metric_on_known_matrices():
    eye = torch.eye(3).expand(10, 3, 3)
    report = amax_gain([eye, eye])
    assert torch.allclose(report.forward, torch.ones(2, dtype=torch.float64))
    assert torch.allclose(report.composite_backward, torch.ones(2, dtype=torch.float64))
    m = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    report = amax_gain([m, m])
    assert report.forward[0] == 3.0 and report.backward[0] == 2.25
    mm = m @ m  # [[0, -2.5], [0.625, -0.9375]]
    assert (
        report.composite_forward[1] == mm.abs().sum(-1).max() and report.composite_backward[1] == mm.abs().sum(-2).max()
    )
    with pytest.raises(ValueError):
        amax_gain([])


def test_collect_h_res_and_mhc_gain_stays_near_one():
    torch.manual_seed(0)
    layers = nn.ModuleList(randomise(HyperConnection(8, 4, nn.Linear(8, 8), init="zero"), i, 2.0) for i in range(6))
    x = streams((5,), 4, 8, 13)
    with collect_h_res(layers) as h_res:
        for hc in layers:
            x = hc(x)
    assert len(h_res) == 6 and all(h.shape == (5, 4, 4) for h in h_res)
    assert layers[0]._recorder is None
    report = amax_gain(h_res)
    assert (report.composite_forward - 1).abs().max() < 1e-4  # rows of a product of row-stochastic maps
    assert report.composite_backward.max() < 4.0


class TinyBlock(nn.Module):
    def __init__(self, dim, n_streams):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.hc_attn = HyperConnection(dim, n_streams, self._attend, backend="torch")
        self.hc_mlp = HyperConnection(dim, n_streams, lambda h: self.mlp(self.norm2(h)), backend="torch")

    def _attend(self, h, mask):
        h = self.norm1(h)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]

    def forward(self, x, mask):
        return self.hc_mlp(self.hc_attn(x, mask))


def test_tiny_transformer_learns_a_sequence_task():
    torch.manual_seed(0)
    vocab, dim, n, seq = 8, 32, 4, 12
    emb, head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
    blocks = nn.ModuleList(TinyBlock(dim, n) for _ in range(2))
    params = [*emb.parameters(), *head.parameters(), *blocks.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
    losses = []
    for step in range(150):  # until the loss has halved (about 40 steps), at most 150
        start = torch.randint(0, vocab, (32, 2))
        toks = [start[:, 0], start[:, 1]]
        for _ in range(seq - 1):
            toks.append((toks[-1] + toks[-2]) % vocab)  # each token is determined by the two before
        toks = torch.stack(toks, 1)
        x = expand_streams(emb(toks[:, :-1]), n)
        for block in blocks:
            x = block(x, mask)
        logits = head(reduce_streams(x))[:, 1:]  # the first target needs two tokens of context
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), toks[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if len(losses) >= 20 and sum(losses[-10:]) < 0.5 * sum(losses[:10]):
            break
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), losses


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_checkpointed_site_compiles_as_one_graph(backend):
    """A site inside ``torch.utils.checkpoint`` traces as one graph (``fullgraph``): nothing in a
    site's call is a side effect the checkpoint region cannot hold (PyTorch 2.11 breaks the graph
    at an attribute write there, and the region then runs uncompiled)."""
    from torch.utils.checkpoint import checkpoint

    from tests.conftest import KERNEL_DEVICE

    device = KERNEL_DEVICE if backend == "triton" else "cpu"
    site = randomise(HyperConnection(8, 4, branch=nn.Linear(8, 8), backend=backend), seed=3).to(device)
    x = streams((2, 5), 4, 8, seed=4).to(device).requires_grad_()
    compiled = torch.compile(lambda x: checkpoint(site, x, use_reentrant=False), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), site(x))
