"""The model of the compiled-graph tests: HyperConnection sites, each around its own branch, on a
hidden state widened to ``n`` streams and reduced back, called one by one or chained
(``finish(y, next=)``)."""

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
        x = expand_streams(h, self.n)
        if not self.chain:
            for site in self.sites:
                x = site(x)
            return reduce_streams(x)
        x_in, finish = self.sites[0].split(x)
        for site, nxt in zip(self.sites, list(self.sites[1:]) + [None]):
            y = site.branch(x_in)
            if nxt is None:
                return reduce_streams(finish(y))
            x_in, finish = finish(y, next=nxt)
