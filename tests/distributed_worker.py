"""A small model built from every ``mhc`` module, trained under FSDP2, DDP and activation
checkpointing, and saved / loaded with ``torch.distributed.checkpoint``.

Run by tests/test_distributed.py under ``torchrun`` (2 gloo processes on CPU):

    torchrun --nproc_per_node=2 tests/distributed_worker.py OUT_DIR

Each scenario writes its per-step losses and its final full (unsharded) parameters to
``OUT_DIR/<scenario>.pt`` on rank 0; the test compares them with one process on the same global
batch. ``build_model``, ``batches`` and ``train`` are shared with that single-process run.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from mhc.layer import FusedMHC
from mhc.losses import LinearCrossEntropy
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, LaneMixer, StreamExpand, reduce_streams

VOCAB, DIM, STREAMS, SEQ, BATCH, STEPS, LR = 16, 8, 4, 6, 8, 4, 1e-3


class MLP(nn.Module):
    def __init__(self, dim, checkpointed: bool = False):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.checkpointed = checkpointed

    def forward(self, h):
        if self.checkpointed:
            return checkpoint(self._forward, h, use_reentrant=False)
        return self._forward(h)

    def _forward(self, h):
        return self.down(torch.tanh(self.up(h)))


class EveryModule(nn.Module):
    """Embedding -> StreamExpand -> mHC and HC hyper-connections -> a FusedMHC-mixed and a
    LaneMixer-mixed stream -> mean of two streams -> LinearCrossEntropy."""

    def __init__(self, checkpoint_blocks: bool = False, checkpoint_branches: bool = False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.embed = nn.Embedding(VOCAB, DIM)
        self.expand = StreamExpand(STREAMS, DIM)
        self.blocks = nn.ModuleList(
            [
                HyperConnection(DIM, STREAMS, MLP(DIM, checkpoint_branches), init="zero"),
                HyperConnection(DIM, STREAMS, MLP(DIM, checkpoint_branches), constraint="none"),
                HyperConnection(DIM, STREAMS, MLP(DIM, checkpoint_branches), dynamic=False),
            ]
        )
        self.mix_logits = nn.Parameter(torch.randn(STREAMS, STREAMS))
        self.sinkhorn = FusedMHC(mhc_iters=10)
        self.lanes = LaneMixer(STREAMS, dim=DIM, dynamic=True)
        self.head = LinearCrossEntropy(DIM, VOCAB)
        with torch.no_grad():  # move every parameter off its init, so each one matters
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.1)

    def forward(self, tokens, targets):
        x = self.expand(self.embed(tokens))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        x = self.sinkhorn(self.mix_logits) @ x
        x = self.lanes(x)
        return self.head(reduce_streams(x[..., :2, :]), targets)  # all n streams' mean would not see the mixing


def build_model(checkpoint_blocks: bool = False, checkpoint_branches: bool = False, recompute: int = 1) -> EveryModule:
    """``recompute``: the block length of :func:`mhc.memory.recompute.recompute_streams` (1: off)."""
    torch.manual_seed(0)
    model = EveryModule(checkpoint_blocks, checkpoint_branches)
    recompute_streams(model, recompute)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def train(model, rank: int = 0, world: int = 1, wrapped=None):
    """``STEPS`` AdamW steps on this rank's rows of each global batch; the global mean losses."""
    wrapped = wrapped or model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches():
        rows = batch.chunk(world)[rank]
        loss = wrapped(rows[:, :-1], rows[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def shard(model: EveryModule, mp_policy=None, per_module: bool = True) -> EveryModule:
    """FSDP2: every mhc module its own unit (``per_module``), then the root, on a CPU mesh (FSDP2's
    default mesh is on the accelerator wherever there is one)."""
    kwargs = dict(mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if mp_policy is not None:
        kwargs.update(mp_policy=mp_policy)
    if per_module:
        for module in (*model.blocks, model.expand, model.sinkhorn, model.lanes, model.head):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state(model) -> dict:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}

    def progress(step):  # on stderr: the test shows it when the launch fails
        print(f"rank {rank}: {step}", file=sys.stderr, flush=True)

    model = shard(build_model())
    results["fsdp"] = dict(losses=train(model, rank, world), params=full_state(model))
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "dcp")  # sharded: each rank its shards

    # loaded into a differently sharded model (root unit only): the same parameters
    resharded = shard(build_model(), per_module=False)
    state = get_model_state_dict(resharded)
    dcp.load(state, checkpoint_id=out / "dcp")
    resharded.load_state_dict(state)
    results["dcp_resharded"] = dict(params=full_state(resharded))
    progress("dcp_resharded")

    model = shard(build_model(checkpoint_blocks=True))
    results["fsdp_checkpointed"] = dict(losses=train(model, rank, world), params=full_state(model))
    progress("fsdp_checkpointed")

    # the streams recomputed in blocks of 2 sites, alone and with checkpointed branches or blocks
    for name, options in (
        ("fsdp_recompute", {}),
        ("fsdp_recompute_checkpointed_branches", dict(checkpoint_branches=True)),
        ("fsdp_recompute_checkpointed", dict(checkpoint_blocks=True)),
    ):
        model = shard(build_model(recompute=2, **options))
        results[name] = dict(losses=train(model, rank, world), params=full_state(model))
        progress(name)

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard(build_model(), mp_policy=mp)
    results["fsdp_bf16"] = dict(losses=train(model, rank, world), params=full_state(model))
    progress("fsdp_bf16")

    model = build_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    results["ddp"] = dict(losses=train(model, rank, world, wrapped=ddp), params=model.state_dict())
    progress("ddp")
    del ddp
    model = build_model(recompute=2)
    ddp = nn.parallel.DistributedDataParallel(model)
    results["ddp_recompute"] = dict(losses=train(model, rank, world, wrapped=ddp), params=model.state_dict())
    progress("ddp_recompute")

    if rank == 0:
        for name, result in results.items():
            torch.save(result, out / f"{name}.pt")
    # DDP's reducer holds the process group: release it while the group is alive, not at
    # interpreter exit (a rare abort there: "terminate called without an active exception").
    del ddp, model
    gc.collect()
    dist.barrier()  # no rank tears down its process group while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
