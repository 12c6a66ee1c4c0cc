"""Benchmark the fused linear + cross-entropy against PyTorch and the peers, side by side.

    python -m bench.loss --out results/loss.csv           # on a CUDA GPU
    python -m bench.loss --options --tokens 8192         # LM-training extras on
    python -m bench.loss --sweep [--write]               # tile shapes of mhc's kernels
    python -m bench.loss --profile                       # idle gaps of mhc's step

Forward+backward of ``loss = CE(x @ W^T, target)`` (mean), bf16 ``x [N, D]`` and ``W [V, D]``, random
data, for each N and (D, V): ``triton.testing.do_bench`` median time and peak memory beyond the
inputs and the two gradients (the logits, chunks, accumulators: everything a method adds). Methods:
mhc, PyTorch eager (``x @ W.T`` then ``F.cross_entropy``), ``torch.compile`` of that, PyTorch's
own ``F.linear_cross_entropy`` (where the installed PyTorch has it), Liger-Kernel's fused linear
cross-entropy (as shipped, bf16 ``dW`` accumulation, and with ``accum_dtype=float32``), and Apple's
Cut Cross-Entropy. A peer that is not installed or fails is reported as skipped.

``--options`` turns on the LM-training extras for every method that has them: label smoothing
0.1, z-loss 1e-4 and logit soft-cap 30 (mhc, PyTorch eager and compiled, Liger).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.harness import peak_extra, write_csv
from mhc.losses import linear_cross_entropy

SHAPES = [(4096, 128256), (2304, 256000)]
OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)
TOKENS = [4096, 8192, 16384]
FLOPS_PER_SECOND = 800e12  # dense bf16 products measured on the H100 (8192^3 matmul)


def eager(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t)


def eager_with_options(x, w, t):
    logits = (x @ w.t()).float()
    logits = OPTIONS["softcap"] * torch.tanh(logits / OPTIONS["softcap"])
    z_loss = OPTIONS["lse_square_scale"] * torch.logsumexp(logits, dim=1).square().mean()
    return F.cross_entropy(logits, t, label_smoothing=OPTIONS["label_smoothing"]) + z_loss


def _methods(options=False):
    """name -> loss function (x, w, t), and name -> reason for the peers that are skipped."""
    extras = OPTIONS if options else {}
    reference = eager_with_options if options else eager
    methods = {
        "mhc": lambda x, w, t: linear_cross_entropy(x, w, t, **extras),
        "torch eager": reference,
        "torch.compile": torch.compile(reference),
    }
    skipped = {}
    if options:
        skipped["torch F.linear_cross_entropy"] = "has no z-loss or soft-cap"
    elif hasattr(F, "linear_cross_entropy"):
        methods["torch F.linear_cross_entropy"] = lambda x, w, t: F.linear_cross_entropy(x, w, t)
    else:
        skipped["torch F.linear_cross_entropy"] = f"not in torch {torch.__version__}"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(**extras)
        liger32 = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32, **extras)
        methods["Liger"] = lambda x, w, t: liger(w, x, t)
        methods["Liger (fp32 dW)"] = lambda x, w, t: liger32(w, x, t)
    except ImportError as e:
        skipped["Liger"] = f"not installed ({e})"
    if options:
        skipped["Cut Cross-Entropy"] = "has no label smoothing or z-loss"
        return methods, skipped
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        methods["Cut Cross-Entropy"] = lambda x, w, t: cce(x, w, t)
    except ImportError as e:
        skipped["Cut Cross-Entropy"] = f"not installed ({e})"
    return methods, skipped


def _inputs(n, d, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    return x, w, t


def measure(fn, x, w, t):
    """(median ms, peak MiB beyond inputs and gradients, loss) of forward + backward."""
    from triton.testing import do_bench

    def step():
        x.grad = w.grad = None
        loss = fn(x, w, t)
        loss.backward()
        return loss

    loss = step().item()  # compile / autotune outside the timing
    x.grad = w.grad = None
    extra = peak_extra(step) - (x.numel() * x.element_size() + w.numel() * w.element_size())
    ms = do_bench(step, warmup=100, rep=500, return_mode="median")
    return ms, extra / 2**20, loss


def run(out_path, tokens=TOKENS, only=None, shapes=SHAPES, options=False):
    methods, skipped = _methods(options)
    if only:
        methods = {k: f for k, f in methods.items() if k in only}
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    rows = []
    for d, v in shapes:
        for n in tokens:
            x, w, t = _inputs(n, d, v)
            floor = 6 * n * d * v / FLOPS_PER_SECOND * 1e3
            for name, fn in methods.items():
                try:
                    ms, mib, loss = measure(fn, x, w, t)
                except Exception as e:  # a peer failing at one size must not stop the table
                    print(f"{name} N={n} D={d} V={v} failed: {type(e).__name__}: {e}"[:300])
                    torch.cuda.empty_cache()
                    continue
                rows.append(
                    dict(
                        N=n,
                        D=d,
                        V=v,
                        method=name,
                        ms=round(ms, 2),
                        peak_extra_mib=round(mib, 1),
                        loss=round(loss, 4),
                        x_floor=round(ms / floor, 2),
                    )
                )
                print(
                    f"N={n:6d} D={d} V={v} {name:30s} {ms:8.2f} ms {mib:10.1f} MiB  "
                    f"loss {loss:.4f}  {ms / floor:.2f}x the 6NDV floor ({floor:.1f} ms)",
                    flush=True,
                )
                x.grad = w.grad = None
                torch.cuda.empty_cache()
            del x, w, t
    if out_path:
        write_csv(rows, out_path, ["N", "D", "V", "method", "ms", "peak_extra_mib", "loss", "x_floor"])
    return rows


def sweep(n=8192, d=4096, v=128256, write=False):
    """Time mhc's passes for each tile shape in a short list (16-bit inputs), and the two logits
    passes with the soft-cap and label smoothing on; ``write``: the fastest tile of the forward and
    of the logits' gradient into this GPU's row of ``mhc/kernels/tables``."""
    from triton.testing import do_bench

    import mhc.kernels.linear_cross_entropy as lce

    x, w, t = _inputs(n, d, v)
    x, w = x.detach(), w.detach()
    lse = lce.lse_forward(x, w, None, t)[0]
    scale = torch.full((n,), 1.0 / n, device="cuda")

    def forward(**extras):
        return do_bench(lambda: lce.lse_forward(x, w, None, t, **extras), rep=300)

    def backward(need_x, need_w, smooth_scale=None, **extras):
        return do_bench(
            lambda: lce.grad_backward(x, w, None, t, lse, scale, scale, smooth_scale, need_x, need_w, False, **extras),
            rep=300,
        )

    logits_tiles = [
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 8, 4),
    ]
    tuned = lce._tiles
    timed = {"lse": [], "grad_logits": []}
    for tiles in logits_tiles:
        lce._tiles = lambda x, tiles=tiles: {**tuned(x), "lse": tiles, "grad_logits": tiles}
        try:
            fwd_ms, g_ms = forward(), backward(False, False)
        except Exception as e:
            print(f"logits tiles {tiles}: failed {type(e).__name__}: {e}"[:300])
            continue
        print(f"logits tiles {tiles}: lse forward {fwd_ms:.2f} ms, G for all V {g_ms:.2f} ms", flush=True)
        timed["lse"].append((fwd_ms, tiles))
        timed["grad_logits"].append((g_ms, tiles))
    lce._tiles = tuned
    if write and timed["lse"]:
        from mhc.kernels import _arch

        path = _arch.write_tuned("loss_tiles_16bit", {k: min(v)[1] for k, v in timed.items()})
        print(f"wrote the lse and grad_logits tiles ({_arch.arch().name}) to {path}", flush=True)
    base = backward(False, False)
    dx_ms = backward(True, False) - base
    dw_ms = backward(False, True) - base
    print(
        f"dx pass through cuBLAS (fp32 accumulator) {dx_ms:.2f} ms; "
        f"dW pass (cuBLAS) {dw_ms:.2f} ms; floor per pass 2NDV = "
        f"{2 * n * d * v / FLOPS_PER_SECOND * 1e3:.2f} ms",
        flush=True,
    )
    # For reference: the logits' product through cuBLAS alone (which also writes the logits).
    logits_ms = do_bench(lambda: x @ w.t(), rep=300)
    print(
        f"cuBLAS x @ W^T for all V (bf16 out) {logits_ms:.2f} ms; the four passes at that rate "
        f"for the two logits passes: 2 x {logits_ms:.2f} + {dx_ms:.2f} + {dw_ms:.2f} = "
        f"{2 * logits_ms + dx_ms + dw_ms:.2f} ms",
        flush=True,
    )
    softcap = dict(softcap=OPTIONS["softcap"])
    for name, fwd, bwd in [
        ("plain", {}, {}),
        ("soft-cap", softcap, softcap),
        ("smoothing", dict(smoothing=True), dict(smooth_scale=scale)),
        ("both", dict(smoothing=True, **softcap), dict(smooth_scale=scale, **softcap)),
    ]:
        print(
            f"{name}: lse forward {forward(**fwd):.2f} ms, G for all V {backward(False, False, **bwd):.2f} ms",
            flush=True,
        )


def profile(n=8192, d=4096, v=128256, steps=3):
    """Where a step's time goes beyond its kernels: torch.profiler over a few steps of mhc, the
    GPU's kernel time against the steps' span, and the largest idle gaps between kernels (a host
    sync leaves the GPU idle until the host queues more)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x, w, t = _inputs(n, d, v)

    def step():
        x.grad = w.grad = None
        linear_cross_entropy(x, w, t).backward()

    for _ in range(steps + 2):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    k = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    busy, span = sum(b - a for a, b, _ in k), k[-1][1] - k[0][0]
    print(
        f"N={n} D={d} V={v}, {steps} steps: kernels busy {busy / 1e3:.2f} ms of a "
        f"{span / 1e3:.2f} ms span; largest gaps (us):"
    )
    gaps = sorted(((k[i + 1][0] - k[i][1], k[i][2], k[i + 1][2]) for i in range(len(k) - 1)), reverse=True)
    for gap, before, after in gaps[:6]:
        print(f"  {gap:9.1f}  after {before[:50]}  before {after[:50]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="CSV path for the table")
    p.add_argument("--sweep", action="store_true", help="time tile shapes of mhc's kernels instead")
    p.add_argument("--write", action="store_true", help="with --sweep: write the fastest tiles into the table")
    p.add_argument(
        "--profile", action="store_true", help="kernel time against step time and the idle gaps of mhc's step instead"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="values of N")
    p.add_argument("--shapes", nargs="+", default=[f"{d}x{v}" for d, v in SHAPES], help="(D, V) pairs written DxV")
    p.add_argument("--methods", nargs="+", default=None, help="only these methods (names as printed)")
    p.add_argument(
        "--options", action="store_true", help="label smoothing 0.1, z-loss 1e-4, soft-cap 30 for every method"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.loss needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if args.sweep:
        sweep(n=args.tokens[0] if args.tokens != TOKENS else 8192, write=args.write)
    elif args.profile:
        profile(n=args.tokens[0] if args.tokens != TOKENS else 8192)
    else:
        shapes = [tuple(int(a) for a in s.split("x")) for s in args.shapes]
        run(args.out, args.tokens, args.methods, shapes, args.options)


if __name__ == "__main__":
    main()
