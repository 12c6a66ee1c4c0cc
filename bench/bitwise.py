"""Bit-for-bit comparison of two checkouts of ``mhc`` on one GPU: the same seeded layers, inputs
and upstream gradients run under each, and every output and gradient must be equal.

A move of code between files (or any change that should not change the maths) is checked with::

    python -m bench.bitwise run  --root OLD_CHECKOUT --out old.pt
    python -m bench.bitwise run  --root .            --out new.pt
    python -m bench.bitwise compare old.pt new.pt

``run`` imports ``mhc`` from ``--root`` only, through its public names, so any two versions with
the same public API compare: fused dynamic mHC (one site, chained sites, recompute), static mHC,
HC, DeepSeek-V4's ``hc_eps``, a dynamic ``LaneMixer`` and a ``StreamCollapse``, in bf16 and fp32.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn


def _layers(mhc, d: int, n: int) -> dict:
    hc = mhc.HyperConnection
    return {
        "mhc": lambda: hc(d, n, branch=nn.Linear(d, d), init="zero"),
        "static": lambda: hc(d, n, branch=nn.Linear(d, d), dynamic=False),
        "hc": lambda: hc(d, n, branch=nn.Linear(d, d), constraint="none"),
        "hc_eps": lambda: hc(d, n, branch=nn.Linear(d, d), init="zero", hc_eps=1e-6),
        "lanes": lambda: mhc.LaneMixer(n, d, dynamic=True),
        "collapse": lambda: mhc.mixing.StreamCollapse(d, n),
    }


class _Chain(nn.Module):
    def __init__(self, mhc, d, n, sites=3):
        super().__init__()
        self.sites = nn.ModuleList(mhc.HyperConnection(d, n, branch=nn.Linear(d, d), init="zero") for _ in range(sites))

    def forward(self, x):
        x_in, finish = self.sites[0].split(x)
        for site, nxt in zip(self.sites, list(self.sites[1:]) + [None]):
            y = site.branch(x_in)
            if nxt is None:
                return finish(y)
            x_in, finish = finish(y, next=nxt)


class _Stack(nn.Module):
    def __init__(self, mhc, d, n, sites=4):
        super().__init__()
        self.sites = nn.ModuleList(mhc.HyperConnection(d, n, branch=nn.Linear(d, d), init="zero") for _ in range(sites))

    def forward(self, x):
        for site in self.sites:
            x = site(x)
        return x


def _perturbed(module: nn.Module, g: torch.Generator) -> nn.Module:
    """Every parameter moved off its initial value, so that the dynamic parts matter."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
    return module


def run(root: str, out: str, d: int = 1024, n: int = 4, tokens: int = 2048) -> None:
    sys.path.insert(0, root)
    import mhc
    import mhc.mixing

    print("mhc from", mhc.__file__)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        makers = {**_layers(mhc, d, n), "chain": lambda: _Chain(mhc, d, n), "recompute": lambda: _Stack(mhc, d, n)}
        models = {}
        for name, make in makers.items():
            torch.manual_seed(0)  # the layers' own initialisation draws from the global generator
            models[name] = make()
        mhc.recompute_streams(models["recompute"], every=2)
        for name, model in models.items():
            g = torch.Generator().manual_seed(0)
            model = _perturbed(model, g).cuda()
            x = torch.randn(tokens, n, d, generator=g).to("cuda", dtype).requires_grad_()
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                y = model(x)
            grad = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
            y.backward(grad)
            key = f"{name}/{str(dtype).removeprefix('torch.')}"
            results[key + "/out"] = y.detach().cpu()
            results[key + "/dx"] = x.grad.cpu()
            for pname, p in model.named_parameters():
                results[f"{key}/d{pname}"] = p.grad.cpu()
    torch.save(results, out)
    print(f"{len(results)} tensors -> {out}")


def compare(a: str, b: str) -> int:
    left, right = torch.load(a), torch.load(b)
    if set(left) != set(right):
        print("different keys:", sorted(set(left) ^ set(right)))
        return 1
    differ = [k for k in left if not torch.equal(left[k], right[k])]
    for k in differ:
        print("differs:", k, (left[k].float() - right[k].float()).abs().max().item())
    print(f"{len(left) - len(differ)} of {len(left)} tensors bit-identical")
    return 1 if differ else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--root", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--n", type=int, default=4, help="streams (n > 8: the mixing kernels' 3-D tiles)")
    r.add_argument("--d", type=int, default=1024)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    if args.command == "run":
        run(args.root, args.out, d=args.d, n=args.n)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
