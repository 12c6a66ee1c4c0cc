"""The model of the compiled-graph tests: HyperConnection sites, each around its own branch, on a
hidden state widened to ``n`` streams and reduced back, called one by one or chained
(``finish(y, next=)``; the loop is ``bench.harness.through_sites``, which the other tests' models
use too); and :func:`model_kinds`, one small model per way the layers are used."""

from torch import nn

from bench.harness import through_sites
from mhc.memory.checkpoint import checkpoint_layers
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse, expand_streams, reduce_streams


class SiteStack(nn.Module):
    """``[..., dim] -> [..., dim]`` through one site per module of ``branches``; ``site``: the
    sites' keyword arguments."""

    def __init__(self, dim: int, n: int, branches, chain: bool = False, **site):
        super().__init__()
        self.n, self.chain = n, chain
        self.sites = nn.ModuleList(HyperConnection(dim, n, branch, **site) for branch in branches)

    def forward(self, h):
        return reduce_streams(through_sites(self.sites, expand_streams(h, self.n), self.chain))


class CheckpointedStack(SiteStack):
    """A :class:`SiteStack` whose sites run in ``checkpoint_layers`` (one region per site)."""

    def forward(self, h):
        return reduce_streams(checkpoint_layers(self.sites, expand_streams(h, self.n)))


class LaneStack(nn.Module):
    """``[..., dim] -> [..., dim]``: a dynamic ``LaneMixer`` over ``n`` copies, then a ``StreamCollapse``."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.n = n
        self.mix, self.collapse = LaneMixer(n, dim, dynamic=True), StreamCollapse(dim, n)

    def forward(self, h):
        return self.collapse(self.mix(expand_streams(h, self.n)))


def _recomputed(model):
    recompute_streams(model)
    return model


def model_kinds(dim: int, n: int, sites: int = 3) -> dict:
    """Factories of ``[..., dim] -> [..., dim]`` models, one per way the layers are used, each
    building on the current default device and dtype."""

    def stack(cls=SiteStack, **site):
        return lambda: cls(dim, n, [nn.Linear(dim, dim) for _ in range(sites)], **site)

    return {
        "mhc": stack(),
        "mhc, implicit backward": stack(backward="implicit"),
        "mhc, static": stack(dynamic=False),
        "hc": stack(constraint="none"),
        "mhc, chained": stack(chain=True),
        "mhc, recompute_streams": lambda: _recomputed(stack()()),
        "mhc, checkpoint_layers": stack(CheckpointedStack),
        "lane mixer and collapse": lambda: LaneStack(dim, n),
    }
