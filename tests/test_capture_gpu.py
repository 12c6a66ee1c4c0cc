"""Training steps captured in CUDA graphs: ``torch.cuda.graph`` and ``torch.compile(mode=
"reduce-overhead")`` over HyperConnection (chained and not, streams saved or recomputed), LaneMixer
and the fused loss (``capturable=True``), against the same steps run eagerly; the toy LM's
``--cuda-graph``."""

import json

import pytest
import torch
from torch import nn

from mhc.losses import LinearCrossEntropy
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, expand_streams, reduce_streams
from tests.site_stack import through_sites

pytestmark = pytest.mark.gpu

DIM, N, VOCAB = 64, 4, 96


class Model(nn.Module):
    """Embedding, four mHC sites around MLPs (chained or called one by one), a dynamic LaneMixer over
    the streams, and the fused loss without host reads."""

    def __init__(self, chain: bool):
        super().__init__()
        self.chain = chain
        self.embed = nn.Embedding(VOCAB, DIM)
        self.sites = nn.ModuleList(
            HyperConnection(
                DIM, N, nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)), init="zero"
            )
            for _ in range(4)
        )
        self.lanes = LaneMixer(N, dim=DIM, dynamic=True)
        self.head = LinearCrossEntropy(DIM, VOCAB, capturable=True)

    def forward(self, tokens, targets):
        x = through_sites(self.sites, expand_streams(self.embed(tokens), N), self.chain)
        return self.head(reduce_streams(self.lanes(x)), targets)


def _batches(steps):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (8, 33), generator=g).cuda() for _ in range(steps)]


def _setup(chain, recompute=1):
    torch.manual_seed(0)
    model = Model(chain).cuda()
    recompute_streams(model, recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3, device="cuda"), capturable=True)
    return model, opt


def _eager_losses(chain, batches):
    model, opt = _setup(chain)
    losses = []
    for batch in batches:
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recompute", [1, 3])
@pytest.mark.parametrize("chain", [False, True])
def test_cuda_graph_step_equals_eager(chain, recompute):
    batches = _batches(12)
    want = _eager_losses(chain, batches)
    model, opt = _setup(chain, recompute)
    static = torch.zeros_like(batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    losses = []
    with torch.cuda.stream(side):  # warm-up: the kernels compile, the allocator sees the step
        for batch in batches[:3]:
            static.copy_(batch)
            opt.zero_grad(set_to_none=True)
            loss = model(static[:, :-1], static[:, 1:])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = model(static[:, :-1], static[:, 1:])
        static_loss.backward()
        opt.step()
    for batch in batches[3:]:
        static.copy_(batch)
        graph.replay()
        losses.append(static_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", [1, 2])
def test_compile_reduce_overhead_matches_eager(recompute):
    batches = _batches(8)
    want = _eager_losses(True, batches)
    model, opt = _setup(True, recompute)
    compiled = torch.compile(model, mode="reduce-overhead")
    losses = []
    for batch in batches:
        loss = compiled(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_toy_lm_cuda_graph_equals_eager(tmp_path):
    """The toy LM's GPU model (smaller), fp32: 20 steps captured against 20 eager steps."""
    from train_toy_lm import main

    common = [
        "--preset",
        "gpu",
        "--steps",
        "20",
        "--layers",
        "2",
        "--dim",
        "128",
        "--batch-size",
        "8",
        "--log-every",
        "1",
        "--eval-every",
        "1000",
        "--dtype",
        "float32",
        "--no-progress",
        "--residual",
        "mhc",
    ]
    logs = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        (path,) = main(common + ["--out-dir", str(tmp_path / name)] + extra)
        logs[name] = [json.loads(line)["train_loss"] for line in open(path)]
    assert len(logs["graph"]) == 20
    torch.testing.assert_close(torch.tensor(logs["graph"]), torch.tensor(logs["eager"]), rtol=1e-4, atol=1e-5)
