"""Benchmark: mhc Sinkhorn kernels vs eager PyTorch, torch.compile and the memory floor.

    python -m bench.sinkhorn --out results/sinkhorn.csv       # on a CUDA GPU
    python -m bench.sinkhorn --plot results/sinkhorn.csv      # draw the plot (anywhere)
    python -m bench.sinkhorn --n 4 8 16 32 64 --mib 256 --impl mhc_exact mhc_implicit compile
                                                       # many lanes: 256 MiB of logits per n

For each n and T (matrices of n x n, fp32 logits, 20 iterations) it times forward and
forward+backward through autograd with ``triton.testing.do_bench`` (median, after warm-up,
gradients reset between runs) and records the extra peak memory of one forward+backward beyond the
inputs. For the mhc kernels it also times forward+backward launchers replayed in a CUDA graph
(mode ``kernels``): the GPU time without Python launch overhead, which dominates at small T. The
memory floor is one read and one write of the logits (``torch.clone``).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

from bench.harness import peak_extra, write_csv
from mhc import reference
from mhc.layer import sinkhorn

FIELDS = ["n", "T", "impl", "mode", "ms", "gbps", "x_floor", "peak_extra_mib", "x_logits"]


def _impls(iters: int):
    compiled = torch.compile(reference.sinkhorn_multiplicative)
    return {
        "mhc_exact": lambda x: sinkhorn(x, iters, backward="exact"),
        "mhc_implicit": lambda x: sinkhorn(x, iters, backward="implicit"),
        "eager": lambda x: reference.sinkhorn_multiplicative(x, iters),
        "compile": lambda x: compiled(x, iters),
    }


def _kernel_row(n, T, name, x, w, iters, floor, nbytes):
    """Forward + backward launchers only, replayed in a CUDA graph (no Python overhead)."""
    from triton.testing import do_bench_cudagraph

    from mhc import kernels

    if name == "mhc_exact":
        call = lambda: (kernels.sinkhorn_fwd(x, iters), kernels.sinkhorn_bwd(x, w, iters))
    else:
        call = lambda: kernels.sinkhorn_implicit_bwd(kernels.sinkhorn_fwd(x, iters), w)
    ms = do_bench_cudagraph(call, rep=100, return_mode="median")
    return dict(
        n=n,
        T=T,
        impl=name,
        mode="kernels",
        ms=ms,
        gbps=5 * nbytes / ms / 1e6,
        x_floor=ms / floor,
        peak_extra_mib=float("nan"),
        x_logits=float("nan"),
    )


def run(ns, ts, iters, impl_names, out_path):
    from triton.testing import do_bench

    impls = _impls(iters)
    rows = []
    for n in ns:
        for T in ts:
            x = torch.randn(T, n, n, device="cuda")
            w = torch.randn_like(x)  # random upstream gradient: all-ones would give ~0 gradients
            nbytes = x.numel() * x.element_size()
            floor = do_bench(lambda: x.clone(), warmup=25, rep=100, return_mode="median")
            rows.append(
                dict(
                    n=n,
                    T=T,
                    impl="floor",
                    mode="clone",
                    ms=floor,
                    gbps=2 * nbytes / floor / 1e6,
                    x_floor=1.0,
                    peak_extra_mib=0,
                    x_logits=0,
                )
            )
            for name in impl_names:
                fn = impls[name]
                xg = x.clone().requires_grad_()
                try:
                    fwd = lambda: fn(x)
                    fwd_bwd = lambda: fn(xg).backward(w)
                    for mode, call, grads in (("fwd", fwd, None), ("fwd+bwd", fwd_bwd, [xg])):
                        ms = do_bench(call, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
                        xg.grad = None
                        peak = peak_extra(call)
                        xg.grad = None
                        moved = 2 * nbytes if mode == "fwd" else 5 * nbytes
                        rows.append(
                            dict(
                                n=n,
                                T=T,
                                impl=name,
                                mode=mode,
                                ms=ms,
                                gbps=moved / ms / 1e6,
                                x_floor=ms / floor,
                                peak_extra_mib=peak / 2**20,
                                x_logits=peak / nbytes,
                            )
                        )
                except torch.cuda.OutOfMemoryError:
                    rows.append(
                        dict(
                            n=n,
                            T=T,
                            impl=name,
                            mode="oom",
                            ms=float("nan"),
                            gbps=0,
                            x_floor=float("nan"),
                            peak_extra_mib=float("nan"),
                            x_logits=float("nan"),
                        )
                    )
                if name.startswith("mhc_"):
                    rows.append(_kernel_row(n, T, name, x, w, iters, floor, nbytes))
                xg = None
                torch.cuda.empty_cache()
            for r in rows[-(1 + 2 * len(impl_names) + sum(i.startswith("mhc_") for i in impl_names)) :]:
                print(
                    f"n={r['n']:>2} T={r['T']:>8} {r['impl']:>12} {r['mode']:>7} "
                    f"{r['ms']:9.4f} ms {r['x_floor']:7.1f}x floor  peak+{r['x_logits']:5.1f}x",
                    flush=True,
                )
    if out_path:
        write_csv(rows, out_path, FIELDS)
    return rows


def plot(csv_path: str, png_path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["mode"] in ("fwd+bwd", "clone", "kernels")]
    ns = sorted({int(r["n"]) for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for impl, mode, label, style in (
            ("floor", "clone", "memory floor (clone)", "-"),
            ("mhc_exact", "fwd+bwd", "mhc exact", "-"),
            ("mhc_exact", "kernels", "mhc exact, kernels only", "--"),
            ("mhc_implicit", "fwd+bwd", "mhc implicit", "-"),
            ("mhc_implicit", "kernels", "mhc implicit, kernels only", "--"),
            ("compile", "fwd+bwd", "torch.compile", "-"),
            ("eager", "fwd+bwd", "eager PyTorch", "-"),
        ):
            pts = sorted(
                (int(r["T"]), float(r["ms"]))
                for r in rows
                if int(r["n"]) == n and r["impl"] == impl and r["mode"] == mode
            )
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=label)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="T (matrices)",
            ylabel="ms, forward+backward",
            title=f"Sinkhorn, n = {n}, 20 iterations, fp32",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--T", type=int, nargs="+", default=[2**12, 2**16, 2**20])
    p.add_argument("--mib", type=int, help="instead of --T: per n, the T that makes this many MiB of logits")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--impl", nargs="+", default=["mhc_exact", "mhc_implicit", "compile", "eager"])
    p.add_argument("--out", default="results/sinkhorn.csv", help="CSV to write")
    p.add_argument("--plot", metavar="CSV", help="only draw the plot of an existing CSV (PNG beside it)")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    if not torch.cuda.is_available():
        sys.exit("bench.sinkhorn needs a CUDA GPU (use --plot CSV to draw an existing result)")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}",
        flush=True,
    )
    if args.mib:
        rows = [r for n in args.n for r in run([n], [args.mib * 2**20 // (4 * n * n)], args.iters, args.impl, None)]
        write_csv(rows, args.out, FIELDS)
        return
    run(args.n, args.T, args.iters, args.impl, args.out)


if __name__ == "__main__":
    main()
