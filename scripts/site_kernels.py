"""What one hyper-connection site costs on the GPU with the host out of the picture: one MLP block's
forward + backward captured in a CUDA graph, plain residual against ``HyperConnection`` (n = 4),
over token counts, and the site's kernels one by one against the copy time of their bytes.

    python scripts/site_kernels.py [--dims 1024 4096] [--tokens 1024 2048 4096 8192 16384] [--out site_kernels.txt]

Block times: graph replays timed by ``triton.testing.do_bench`` (median), the two arms interleaved
over 5 rounds; the ratio is the median of the within-round ratios. A site moves ``100 d`` bytes
per token in bf16 (streams of ``8 d`` bytes read or written 11 times, the branch's ``2 d`` bytes 6
times); ``copy`` is that at the device's copy rate. Kernel times: ``torch.profiler`` over 10 graph
replays, per replay: what each kernel name adds over the plain block.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import benchmark_mixing as bench  # noqa: E402


def captured_step(arm: str, dim: int, n: int, tokens: int):
    """A CUDA graph of one block's forward + backward (gradients of the input and the parameters),
    and what it reads and writes: they must outlive the graph, which replays their addresses."""
    torch.manual_seed(0)
    module = bench.wrap(arm, bench.MLP(dim).cuda().to(bench.DTYPE), dim, n)
    shape = (tokens, dim) if arm == "plain" else (tokens, n, dim)
    x = torch.randn(shape, device="cuda", dtype=bench.DTYPE, requires_grad=True)
    w = torch.randn(shape, device="cuda", dtype=bench.DTYPE)
    inputs = [x, *module.parameters()]

    def step():
        return torch.autograd.grad(module(x), inputs, w, allow_unused=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, (module, x, w, outputs)


def kernel_times(graph, replays: int = 10) -> collections.Counter:
    """Microseconds per replay of each kernel in ``graph``."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    us = collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            us[event.key] += event.self_device_time_total / replays
    return us


def main() -> None:
    from triton.testing import do_bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the two arms")
    p.add_argument("--out", default="site_kernels.txt")
    args = p.parse_args()
    copy_gbps = bench.copy_bandwidth()
    lines = [
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, n = {args.n}, MLP block fwd + bwd "
        f"in a CUDA graph; device copy {copy_gbps:.0f} GB/s"
    ]
    print(lines[0], flush=True)
    for dim in args.dims:
        for tokens in args.tokens:
            graphs = {arm: captured_step(arm, dim, args.n, tokens) for arm in ("plain", "mhc")}
            times = {arm: [] for arm in graphs}
            for _ in range(args.rounds):
                for arm, (graph, _) in graphs.items():
                    times[arm].append(do_bench(graph.replay, warmup=25, rep=200, return_mode="median"))
            plain, mhc = statistics.median(times["plain"]), statistics.median(times["mhc"])
            ratio = statistics.median(m / q for m, q in zip(times["mhc"], times["plain"]))
            copy_ms = 100 * dim * tokens / copy_gbps / 1e6
            plain_kernels, mhc_kernels = (kernel_times(graphs[arm][0]) for arm in ("plain", "mhc"))
            site = {k: t - plain_kernels[k] for k, t in mhc_kernels.items() if t - plain_kernels[k] > 0.5}
            site_ms = sum(site.values()) / 1e3
            row = (
                f"d={dim:5d} T={tokens:6d}  plain {plain:7.3f} ms  mhc {mhc:7.3f} ms  {ratio:5.3f}x  "
                f"site +{mhc - plain:6.3f} ms = {(mhc - plain) / copy_ms:4.2f}x copy ({copy_ms:.3f} ms); "
                f"site kernels {site_ms:.3f} ms"
            )
            lines.append(row)
            lines += [f"      {t:8.1f} us  {k[:100]}" for k, t in sorted(site.items(), key=lambda kv: -kv[1])]
            print("\n".join(lines[-1 - len(site) :]), flush=True)
            del graphs
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
