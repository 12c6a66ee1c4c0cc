"""The model of the compiled-graph tests: HyperConnection sites, each around its own branch, on a
hidden state widened to ``n`` streams and reduced back, called one by one or chained
(``finish(y, next=)``), and that loop over sites for the other tests' models; and
:func:`model_kinds`, one small model per way the layers are used."""

from torch import nn

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


def through_sites(sites, x, chain: bool):
    """The streams ``x`` through ``sites`` (each around its own ``branch``), called one by one or
    chained (``finish(y, next=)``)."""
    if not chain:
        for site in sites:
            x = site(x)
        return x
    x_in, finish = sites[0].split(x)
    for site, nxt in zip(sites, list(sites[1:]) + [None]):
        y = site.branch(x_in)
        if nxt is None:
            return finish(y)
        x_in, finish = finish(y, next=nxt)


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
