"""The model of the compiled-graph tests: HyperConnection sites, each around its own branch, on a
hidden state widened to ``n`` streams and reduced back, called one by one or chained
(``finish(y, next=)``), and that loop over sites for the other tests' models."""

from torch import nn

from mhc.mixing import HyperConnection, expand_streams, reduce_streams


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
