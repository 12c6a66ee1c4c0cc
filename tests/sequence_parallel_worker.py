"""Hyper-connection sites on sequence-sharded streams, for tests/test_sequence_parallel.py.

Run under ``torchrun`` (2 gloo processes on CPU):

    torchrun --nproc_per_node=2 tests/sequence_parallel_worker.py OUT_DIR [cpu|cuda]

(``cuda``: one GPU per rank over NCCL, the fused kernels compiled.)

Every rank builds the same model and the same full batch, keeps its half of the sequence, and runs
each scenario of :func:`run`; rank 0 writes the gathered outputs, input gradients and parameter
gradients to ``OUT_DIR/<scenario>.pt``. The test compares them with one process on the whole
sequence (``run`` with ``shard=None``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mhc.distributed import parallelize_sites, reduce_gradients
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse
from tests.site_stack import through_sites

DIM, STREAMS, BATCH, SEQ = 8, 4, 2, 6


class Scenario(NamedTuple):
    backend: str
    chained: bool = False
    recompute: bool = False
    dtensor: bool = False  # streams handed over as DTensors
    tensor_parallel: bool = False  # the branches' own TP + SP plan
    compiled: bool = False  # on GPUs only
    passes: int = 1  # backwards accumulated without zero_grad


SCENARIOS = {
    "torch": Scenario("torch"),
    "torch_accumulated": Scenario("torch", passes=2),
    "torch_chained_recompute": Scenario("torch", chained=True, recompute=True),
    "triton": Scenario("triton"),
    "triton_chained": Scenario("triton", chained=True),
    "torch_dtensor": Scenario("torch", dtensor=True),
    "torch_tp": Scenario("torch", tensor_parallel=True),
    "triton_chained_tp": Scenario("triton", chained=True, tensor_parallel=True),
    "triton_tp_compiled": Scenario("triton", tensor_parallel=True, compiled=True),
}
CPU_SCENARIOS = [name for name, s in SCENARIOS.items() if not s.compiled]


class Model(nn.Module):
    """Three mHC / HC sites around per-token MLPs, a LaneMixer, and V4's learned collapse."""

    def __init__(self, backend: str):
        super().__init__()
        torch.manual_seed(0)
        mlps = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(3)]
        kinds = ("sinkhorn", "none", "sinkhorn")
        self.sites = nn.ModuleList(
            HyperConnection(DIM, STREAMS, branch=m, constraint=c, backend=backend) for m, c in zip(mlps, kinds)
        )
        self.lanes = LaneMixer(STREAMS, DIM, dynamic=True, backend=backend)
        self.collapse = StreamCollapse(DIM, STREAMS)
        with torch.no_grad():  # away from the initial values, so that every gradient is non-trivial
            for p in self.parameters():
                p.add_(0.1 * torch.randn_like(p))

    def forward(self, x, chained: bool):
        return self.collapse(self.lanes(through_sites(self.sites, x, chained)))


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, STREAMS, DIM, generator=g)
    weight = torch.randn(BATCH, SEQ, DIM, generator=g)  # the upstream gradient: not all ones
    return x, weight


def run(name: str, shard: tuple[int, int] | None, device: str = "cpu") -> dict:
    """One scenario on the whole sequence (``shard=None``) or on shard ``(rank, world)``."""
    backend, chained, recompute, dtensor, tp, compiled, passes = SCENARIOS[name]
    model = Model(backend).to(device)
    if recompute:
        recompute_streams(model, every=2)
    x, weight = (t.to(device) for t in batch())
    hooked = 0
    if shard is not None:
        rank, world = shard
        piece = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
        x, weight = x[:, piece].contiguous(), weight[:, piece]
        parallelize_sites(model)
        from torch.distributed.device_mesh import init_device_mesh

        if tp:
            tensor_parallel_branches(model, init_device_mesh(device, (world,)))
        elif dtensor:  # branches on DTensor inputs: parameters replicated the way PyTorch does it
            from torch.distributed.tensor import distribute_module

            mesh = init_device_mesh(device, (world,))
            for site in model.sites:
                distribute_module(site.branch, mesh)
        else:  # replicated per-token branches: their gradients are summed like the sites'
            hooked = reduce_gradients((p for s in model.sites for p in s.branch.parameters()))
    x.requires_grad_()
    all_reduces = None
    for step in range(passes):
        out = forward(model, x, chained, dtensor and shard is not None, compiled)
        if step == 0 and shard is not None and backend == "torch":  # a dispatch mode routes the fused path
            with AllReduces() as counted:  # through its ops: counted on the reference path only
                (out * weight).sum().backward()
            all_reduces = counted.count
        else:
            (out * weight).sum().backward()
    grads = {n: _full(p.grad).cpu() for n, p in model.named_parameters()}
    # the mhc modules' gradients are reduced by parallelize_sites; a DTensor branch's DTensor reduces
    partial = sorted(
        n
        for n, p in model.named_parameters()
        if ".branch." not in n and any(q.is_partial() for q in _placements(p.grad))
    )
    return dict(out=out.detach(), x_grad=x.grad.clone(), grads=grads, partial=partial, all_reduces=all_reduces,
                hooked=hooked)  # fmt: skip


class AllReduces(TorchDispatchMode):
    """Counts the all-reduces run while it is active (``dist.all_reduce`` and DTensor's)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in ("allreduce_", "all_reduce")
        return func(*args, **(kwargs or {}))


def forward(model: Model, x: torch.Tensor, chained: bool, dtensor: bool, compiled: bool) -> torch.Tensor:
    if not dtensor:
        return (torch.compile(model) if compiled else model)(x, chained)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    streams = DTensor.from_local(x, init_device_mesh(x.device.type, (dist.get_world_size(),)), [Shard(1)])
    for site in model.sites:
        streams = site(streams)
    return model.collapse(model.lanes(streams.to_local()))


def tensor_parallel_branches(model, mesh) -> None:
    """Megatron's TP + SP MLP on the 1-D ``mesh``: the first linear column-wise from
    sequence-sharded input (the plan all-gathers the sequence), the second row-wise back to
    sequence shards (reduce-scatter)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    for site in model.sites:
        parallelize_module(site.branch, mesh, plan)


def _placements(grad: torch.Tensor) -> tuple:
    return getattr(grad, "placements", ())


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


def gather(t: torch.Tensor, world: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(pieces, t.contiguous())
    return torch.cat(pieces, dim=1)


def main(out_dir: str, device: str) -> None:
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank)
    for name in SCENARIOS if device == "cuda" else CPU_SCENARIOS:
        got = run(name, (rank, world), device)
        outputs = (gather(got[k], world).cpu() for k in ("out", "x_grad"))
        result = dict(zip(("out", "x_grad"), outputs))
        result.update((k, got[k]) for k in ("grads", "partial", "all_reduces", "hooked"))
        if rank == 0:
            torch.save(result, Path(out_dir) / f"{name}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
