"""Sequence-parallel sites on a 2-D ``(dp, tp)`` mesh, FSDP2 over ``dp`` and Megatron's TP + SP
MLPs over ``tp``, for tests/test_sequence_parallel.py. Run under ``torchrun`` (4 processes):

    torchrun --nproc_per_node=4 tests/mesh_2d_worker.py OUT_DIR [cpu|cuda] [torch|triton]

Each data-parallel rank takes one sample of the batch, each tensor-parallel rank half of its
sequence (torchtitan's order: tensor parallel, then ``fully_shard`` per site and at the root).
After one forward and backward, rank 0 writes the gradients of every parameter (summed over the
data-parallel ranks) to ``OUT_DIR/grads.pt`` and the error for the 2-D mesh given whole to
``parallelize_sites`` to ``OUT_DIR/refused.txt``; after one SGD step every rank saves its shards of
the model with DCP to ``OUT_DIR/dcp``, which the test loads into one process. Last, the same
model built on the meta device (torchtitan's flow: parallelized and sharded there, then
``to_empty`` and ``reset_parameters``): its ``mhc`` parameters go to ``OUT_DIR/initialised.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from mhc.distributed import parallelize_sites
from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse
from tests.sequence_parallel_worker import BATCH, SEQ, Model, batch, tensor_parallel_branches

LR = 0.5
INIT_SEED = 7


def reset_mhc_parameters(model) -> None:
    torch.manual_seed(INIT_SEED)
    for module in model.modules():
        if isinstance(module, (HyperConnection, LaneMixer, StreamCollapse)):
            module.reset_parameters()


def mhc_parameters(model) -> dict:
    return {n: p for n, p in model.named_parameters() if ".branch." not in n}


def meta_initialised(mesh, device: str, backend: str) -> dict:
    with torch.device("meta"):
        model = Model(backend)
    shard(model, mesh)
    model.to_empty(device=device)
    reset_mhc_parameters(model)
    return {n: p.full_tensor().cpu() for n, p in mhc_parameters(model).items()}


def shard(model, mesh) -> None:
    """torchtitan's order: tensor parallel, then ``fully_shard`` per site and at the root."""
    tensor_parallel_branches(model, mesh["tp"])
    parallelize_sites(model, mesh["tp"])
    for site in model.sites:
        fully_shard(site, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def main(out_dir: str, device: str, backend: str) -> None:
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    assert BATCH == 2 and SEQ % 2 == 0

    try:  # the whole 2-D mesh is refused: the sites take the tp one
        parallelize_sites(Model(backend).to(device), mesh)
        refused = ""
    except ValueError as e:
        refused = str(e)

    model = Model(backend).to(device)
    shard(model, mesh)

    x, weight = (t.to(device) for t in batch())
    piece = slice(tp * SEQ // 2, (tp + 1) * SEQ // 2)
    x, weight = x[dp : dp + 1, piece].contiguous(), weight[dp : dp + 1, piece]
    (model(x, chained=False) * weight).sum().backward()

    # FSDP2 averages over dp: the sum over the batch is dp times that
    for p in model.parameters():
        p.grad.mul_(2)
    grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, Path(out_dir) / "grads.pt")
        (Path(out_dir) / "refused.txt").write_text(refused)
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)
    dcp.save(get_model_state_dict(model), checkpoint_id=str(Path(out_dir) / "dcp"))
    initialised = meta_initialised(mesh, device, backend)
    if rank == 0:
        torch.save(initialised, Path(out_dir) / "initialised.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu", sys.argv[3] if len(sys.argv) > 3 else "torch")
