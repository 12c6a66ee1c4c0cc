"""Tensor + sequence parallel GPT blocks, plain residual against mHC sites, on 1 GPU or N.

    python -m bench.tensor_parallel                                   # one GPU, whole sequences
    torchrun --nproc_per_node=2 -m bench.tensor_parallel              # TP + SP over 2 GPUs
    torchrun --nproc_per_node=2 -m bench.tensor_parallel --compile    # each site / branch compiled

``layers`` blocks of causal attention (``RMSNorm``, q/k/v/out projections, ``d / 128`` heads) and an
MLP (``RMSNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d)``), each branch around a plain residual or
an mHC site (``n = 4``), bf16, the same global tokens on any GPU count. With N ranks the branches
are Megatron's TP (the sequence gathered once into the column-wise projections, scattered back
out of the row-wise one), the activations between them sequence-sharded, the sites run by
:func:`mhc.distributed.parallelize_sites`. Prints per arm the median forward + backward step over
``--rounds`` rounds of 10 steps (arms interleaved, 3 warm-up steps) and its peak memory above what
was allocated before it; ``--profile``: the collectives one step launches, per arm (the sites add
none: the streams stay sharded), and per rank the step's GPU time in them and in the rest;
``--host``: per rank, the host's time to issue a step against the step's wall time, steps started
together (a step bound by the host issues in about its wall time, and a late rank holds the others
in their collectives).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mhc import HyperConnection, expand_streams, reduce_streams
from mhc.distributed import parallelize_sites, reduce_gradients

HEAD_DIM = 128


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, h):
        q, k, v = (w(h).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the rank's heads, whole sequence
        return self.wo(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class Branch(nn.Sequential):
    def __init__(self, dim: int, core: nn.Module):
        super().__init__(nn.RMSNorm(dim), core)


class Blocks(nn.Module):
    def __init__(self, arm: str, dim: int, layers: int):
        super().__init__()
        self.branches = nn.ModuleList(Branch(dim, core) for _ in range(layers) for core in (Attention(dim), MLP(dim)))
        self.sites = None
        if arm == "mhc":
            self.sites = nn.ModuleList(HyperConnection(dim, 4, branch=b) for b in self.branches)

    def forward(self, h):
        if self.sites is None:
            for b in self.branches:
                h = h + b(h)
            return h
        x = expand_streams(h, 4)
        for site in self.sites:
            x = site(x)
        return reduce_streams(x)


def parallelize(model: Blocks, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cuda", (world,))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    attention = {"1": gather, "1.wq": ColwiseParallel(), "1.wk": ColwiseParallel(), "1.wv": ColwiseParallel(),
                 "1.wo": RowwiseParallel(output_layouts=Shard(1))}  # fmt: skip
    mlp = {"1.up": ColwiseParallel(input_layouts=Shard(1)), "1.down": RowwiseParallel(output_layouts=Shard(1))}
    for b in model.branches:
        parallelize_module(b, mesh, attention if isinstance(b[1], Attention) else mlp)
        reduce_gradients(b[0].parameters())  # the norm runs on the sequence shard, replicated
    if model.sites is not None:
        parallelize_sites(model, mesh)


def build(arm: str, args, world: int):
    torch.manual_seed(0)
    model = Blocks(arm, args.dim, args.layers).cuda().to(torch.bfloat16)
    if world > 1:
        parallelize(model, world)
    if args.compile:  # after tensor parallel, as torchtitan orders them: one graph per site or branch
        for unit in model.sites if model.sites is not None else model.branches:
            unit.compile(dynamic=False)
    seq = args.seq // world
    h = torch.randn(args.tokens // args.seq, seq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(h)

    def step():  # a training step's forward and backward: gradients cleared first, as the optimizer's step does
        model.zero_grad(set_to_none=True)
        model(h).backward(grad)

    return step


def measure(step, world: int) -> tuple[list[float], float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times, (torch.cuda.max_memory_allocated() - base) / 2**30


def host_times(step, world: int, steps: int = 10) -> tuple[float, float]:
    """Median over ``steps`` steps, each started together on every rank (barrier, then a device
    sync): the host's time to issue the step and the step's wall time, in ms. A step whose host
    time is close to its wall time is bound by the host."""
    issue, wall = [], []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        issue.append((issued - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(issue), statistics.median(wall)


def collectives(step) -> tuple[dict[str, int], str]:
    """How many NCCL kernels of each kind one step launches, and where its GPU time goes: the
    kernels' span, the time in collectives and in the rest, and the five longest other kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = {"nccl": 0.0, "other": 0.0}
    other: dict[str, float] = {}
    for event in kernels:
        us = event.time_range.elapsed_us()
        if "nccl" in event.name.lower():
            kind = event.name.split("(")[0]
            counts[kind] = counts.get(kind, 0) + 1
            busy["nccl"] += us
        else:
            busy["other"] += us
            other[event.name[:60]] = other.get(event.name[:60], 0.0) + us
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    top = sorted(other.items(), key=lambda kv: -kv[1])[:5]
    summary = f"span {span / 1e3:.1f} ms, collectives {busy['nccl'] / 1e3:.1f} ms, "
    summary += f"other kernels {busy['other'] / 1e3:.1f} ms; "
    summary += "longest: " + "; ".join(f"{name} {us / 1e3:.2f} ms" for name, us in top)
    return counts, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="global tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--arms", nargs="+", default=["plain", "mhc"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="count the collectives of one step per arm")
    p.add_argument("--compile", action="store_true", help="compile each site (mHC) or branch (plain)")
    p.add_argument("--host", action="store_true", help="per rank: host time to issue a step against its wall time")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available() or world > torch.cuda.device_count():
        p.error(f"one GPU per process: {world} process(es), {torch.cuda.device_count()} GPU(s) here")
    rank = 0
    if world > 1:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
    torch.cuda.set_device(rank)
    steps = {arm: build(arm, args, world) for arm in args.arms}
    times, peaks = {arm: [] for arm in args.arms}, {}
    for _ in range(args.rounds):
        for arm, step in steps.items():
            t, peaks[arm] = measure(step, world)
            times[arm] += t
    if rank == 0:
        for arm in args.arms:
            ms, low, high = statistics.median(times[arm]), min(times[arm]), max(times[arm])
            print(f"{world} GPU(s) d={args.dim} {args.tokens} tok {arm:>6}: {ms:8.2f} ms ({low:.1f} .. {high:.1f}), "
                  f"peak {peaks[arm]:6.2f} GiB", flush=True)  # fmt: skip
    if args.host:
        for arm, step in steps.items():
            issue, wall = host_times(step, world)
            ranks = [None] * world
            if world > 1:
                dist.all_gather_object(ranks, (issue, wall))
            else:
                ranks = [(issue, wall)]
            if rank == 0:
                each = ", ".join(f"rank {r}: {i:.1f} / {w:.1f} ms" for r, (i, w) in enumerate(ranks))
                print(f"{world} GPU(s) {arm:>6} host issue / wall per step, started together: {each}", flush=True)
    if args.profile:
        for arm, step in steps.items():
            counts, summary = collectives(step)
            summaries = [summary] * world
            if world > 1:
                dist.all_gather_object(summaries, summary)
            if rank == 0:
                print(f"{world} GPU(s) {arm:>6} collectives per step: {dict(sorted(counts.items()))}", flush=True)
                for r, text in enumerate(summaries):
                    print(f"    rank {r}: {text}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
