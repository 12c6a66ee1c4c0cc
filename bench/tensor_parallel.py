"""Tensor + sequence parallel MLP blocks, plain residual against mHC sites, on 1 GPU or N.

    python -m bench.tensor_parallel                                   # one GPU, whole sequences
    torchrun --nproc_per_node=2 -m bench.tensor_parallel              # TP + SP over 2 GPUs

``layers`` blocks of ``RMSNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d)``, each around a plain
residual or an mHC site (``n = 4``), bf16, the same global tokens on any GPU count. With N ranks the
MLPs are Megatron's TP (column-wise in, row-wise out, the sequence gathered and scattered), the
activations between them sequence-sharded, the sites run by :func:`mhc.distributed.parallelize_sites`.
Prints per arm the median forward + backward step (10 after 3 warm-up steps) and its peak memory
above what was allocated before it.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

from mhc import HyperConnection, expand_streams, reduce_streams
from mhc.distributed import parallelize_sites, reduce_gradients


def mlp(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, 4 * dim, bias=False), nn.GELU(),
                         nn.Linear(4 * dim, dim, bias=False))  # fmt: skip


class Blocks(nn.Module):
    def __init__(self, arm: str, dim: int, layers: int):
        super().__init__()
        self.arm = arm
        self.mlps = nn.ModuleList(mlp(dim) for _ in range(layers))
        self.sites = nn.ModuleList(HyperConnection(dim, 4, branch=m) for m in self.mlps) if arm == "mhc" else None

    def forward(self, h):
        if self.sites is None:
            for m in self.mlps:
                h = h + m(h)
            return h
        x = expand_streams(h, 4)
        for site in self.sites:
            x = site(x)
        return reduce_streams(x)


def parallelize(model: Blocks, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (world,))
    plan = {"1": ColwiseParallel(input_layouts=Shard(1)), "3": RowwiseParallel(output_layouts=Shard(1))}
    for m in model.mlps:
        parallelize_module(m, mesh, plan)
        reduce_gradients(m[0].parameters())  # the norm runs on the sequence shard, replicated
    if model.sites is not None:
        parallelize_sites(model, mesh)


def measure(arm: str, args, world: int, rank: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = Blocks(arm, args.dim, args.layers).cuda().to(torch.bfloat16)
    if world > 1:
        parallelize(model, world)
    seq = args.seq // world
    h = torch.randn(args.tokens // args.seq, seq, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(h)

    def step():
        model(h).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
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
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="global tokens per step")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--arms", nargs="+", default=["plain", "mhc"])
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
    torch.cuda.set_device(rank)
    for arm in args.arms:
        ms, peak = measure(arm, args, world, rank)
        if rank == 0:
            print(
                f"{world} GPU(s) d={args.dim} {args.tokens} tok {arm:>6}: {ms:8.2f} ms, peak {peak:6.2f} GiB",
                flush=True,
            )
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
