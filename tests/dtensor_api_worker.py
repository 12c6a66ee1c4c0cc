"""Per-token modules on sequence-sharded ``DTensor``\\ s, made the way PyTorch's public API makes
them, for tests/test_dtensor_api.py.

Run under ``torchrun`` (gloo processes on CPU; the kernels in Triton's interpreter):

    torchrun --nproc_per_node=P tests/dtensor_api_worker.py OUT_DIR

Every rank builds the same modules and the same full batch. Each case makes the module's
parameters replicated ``DTensor``\\ s with ``distribute_module`` or a ``SequenceParallel()`` plan
(no ``mhc.distributed`` call), hands it the batch as a ``DTensor`` sharded over the sequence
(``distribute_tensor``, so uneven lengths shard as PyTorch shards them), and runs forward and
backward with a seeded upstream gradient. Rank 0 writes, per case, the global output shape and the
full output, input gradient and parameter gradients to ``OUT_DIR/<case>.pt``; the test compares
them with one process on the whole batch (:func:`run` without a mesh).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse, StreamExpand

DIM, STREAMS, BATCH = 8, 4, 2
BACKENDS = ("torch", "triton")


class Chain(nn.Module):
    """Three sites chained with ``finish(y, next=)``."""

    def __init__(self, backend):
        super().__init__()
        self.sites = nn.ModuleList(
            HyperConnection(DIM, STREAMS, branch=nn.Linear(DIM, DIM), init="zero", backend=backend) for _ in range(3)
        )

    def forward(self, x):
        x_in, finish = self.sites[0].split(x)
        for site, nxt in zip(self.sites, [*self.sites[1:], None]):
            y = site.branch(x_in)
            if nxt is None:
                return finish(y)
            x_in, finish = finish(y, next=nxt)


class Stack(nn.Module):
    """Four sites called as modules, with their streams recomputed in the backward."""

    def __init__(self, backend):
        super().__init__()
        self.sites = nn.ModuleList(
            HyperConnection(DIM, STREAMS, branch=nn.Linear(DIM, DIM), init="zero", backend=backend) for _ in range(4)
        )
        recompute_streams(self, every=2)

    def forward(self, x):
        for site in self.sites:
            x = site(x)
        return x


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def build(case: str, backend: str) -> nn.Module:
    torch.manual_seed(0)
    kind = case.removeprefix("sp_")
    if kind in ("site", "uneven", "mesh_2d", "compiled"):
        model = HyperConnection(DIM, STREAMS, branch=nn.Identity(), init="zero", backend=backend)
    elif kind == "tp_branch":
        model = HyperConnection(DIM, STREAMS, branch=MLP(), init="zero", backend=backend)
    elif kind == "chain":
        model = Chain(backend)
    elif kind == "recompute":
        model = Stack(backend)
    elif kind == "lanes":
        model = LaneMixer(STREAMS, DIM, dynamic=True, backend=backend)
    elif kind == "collapse":
        model = StreamCollapse(DIM, STREAMS, backend=backend)
    elif kind == "expand":
        model = StreamExpand(STREAMS, DIM)
    else:
        raise ValueError(case)
    with torch.no_grad():  # away from the initial values, so every parameter's gradient matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model


def inputs(case: str, seq: int):
    g = torch.Generator().manual_seed(1)
    kind = case.removeprefix("sp_")
    shape = (BATCH, seq, DIM) if kind == "expand" else (BATCH, seq, STREAMS, DIM)
    x = torch.randn(shape, generator=g)
    out_shape = (BATCH, seq, DIM) if kind == "collapse" else (BATCH, seq, STREAMS, DIM)
    return x, torch.randn(out_shape, generator=g)


def sequence_length(case: str, world: int) -> int:
    return 2 * world + 1 if case.startswith(("uneven", "compiled")) else 2 * world


def run(case: str, backend: str, world: int, mesh=None):
    """``(shape, out, dx, {name: dparam})``, full tensors; ``mesh``: run distributed."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    model = build(case, backend)
    x, grad = inputs(case, sequence_length(case, world))
    if mesh is not None:
        if case.startswith(("lanes", "sp_")):  # PyTorch's plan replicates every parameter
            from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

            parallelize_module(model, mesh, SequenceParallel(use_local_output=False))
        elif case.startswith("tp_branch"):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {"up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}
            parallelize_module(model.branch, mesh, plan)
            for name, p in list(model.named_parameters(recurse=False)):
                model.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
        else:
            distribute_module(model, mesh)  # every parameter Replicate()
        placements = [Shard(0), Shard(1)] if mesh.ndim == 2 else [Shard(1)]
        x = distribute_tensor(x, mesh, placements)
        grad = distribute_tensor(grad, mesh, placements)
    x.requires_grad_()
    if case.startswith("compiled"):  # Dynamo and AOTAutograd trace the DTensor path (no C++ build)
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    else:
        out = model(x)
    out.backward(grad)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    params = {name: full(p.grad).detach() for name, p in model.named_parameters()}
    return tuple(out.shape), full(out).detach(), full(x.grad).detach(), params


CASES = ["site", "uneven", "chain", "recompute", "tp_branch", "lanes", "collapse", "expand", "compiled"]
CASES += ["sp_site", "sp_collapse", "sp_expand"]  # SequenceParallel() on modules without nested parameters
# on 4 ranks (CI's time): the layouts that change with the rank count, and the 2 x 2 mesh
FOUR_RANK_CASES = ["site", "uneven", "chain", "recompute", "tp_branch", "mesh_2d"]


def main():
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    names = FOUR_RANK_CASES if world == 4 else CASES
    cases = [(c, b) for c in names for b in BACKENDS]
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if world == 4 else None
    for case, backend in cases:
        result = run(case, backend, world, mesh_2d if case == "mesh_2d" else mesh)
        if rank == 0:
            torch.save(result, out_dir / f"{case}_{backend}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
