"""How close is the implicit (fixed-point) Sinkhorn gradient to the exact one?

    python examples/implicit_accuracy.py            # fp64, CPU, prints a Markdown table

For random logits of a given scale, compares ``backward="implicit"`` with ``backward="exact"``
(autograd through the same ``iters`` iterations) under a random upstream gradient, in fp64 so that
only the maths differs. Reports the median and max over matrices of the relative error
``|g_implicit - g_exact| / |g_exact|`` (per matrix), and the column-sum error of the output (how
far the forward is from converged).
"""

import argparse

import torch

from mhc.layer import sinkhorn


def relative_errors(n, T, scale, iters, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, n, generator=g, dtype=torch.float64) * scale
    w = torch.randn(T, n, n, generator=g, dtype=torch.float64)
    grads = {}
    for mode in ("exact", "implicit"):
        xg = x.clone().requires_grad_()
        out = sinkhorn(xg, iters, backward=mode, backend="torch")
        out.backward(w)
        grads[mode] = xg.grad
    err = (grads["implicit"] - grads["exact"]).flatten(1).norm(dim=1)
    rel = err / grads["exact"].flatten(1).norm(dim=1).clamp_min(1e-300)
    col_err = (out.detach().sum(-2) - 1).abs().amax(-1)
    return rel.median().item(), rel.max().item(), col_err.median().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--T", type=int, default=2000)
    p.add_argument("--scales", type=float, nargs="+", default=[0.1, 1.0, 3.0, 10.0])
    p.add_argument("--iters", type=int, nargs="+", default=[5, 20, 100])
    args = p.parse_args(argv)
    print(
        f"n = {args.n}, {args.T} matrices per cell, fp64; median / max relative error; "
        "median column-sum error of the output\n"
    )
    print("| logit std | " + " | ".join(f"iters = {i}" for i in args.iters) + " |")
    print("| --- |" + " --- |" * len(args.iters))
    for scale in args.scales:
        cells = []
        for iters in args.iters:
            med, mx, col = relative_errors(args.n, args.T, scale, iters)
            cells.append(f"{med:.1e} / {mx:.1e} (col {col:.0e})")
        print(f"| {scale:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
