"""Train a GPT with mHC sites, and the same GPT with plain residuals, over several processes.

    torchrun --nproc_per_node=4 examples/train_parallel.py --dp 2 --tp 2 --compare       # CPU: gloo
    torchrun --nproc_per_node=2 examples/train_parallel.py --tp 2 --compile --compare    # GPUs: NCCL

The mesh is ``(dp, tp)``: FSDP2 shards every block and the embeddings over ``dp``; over ``tp``
attention and MLP are tensor-parallel (heads and hidden units split, Megatron's column / row
plan) and everything between them is sequence-parallel: the streams (or the plain residual), the
norms and the hyper-connection sites hold ``seq / tp`` tokens per rank as ``DTensor``\\ s, and the
sites' parameters are replicated over ``tp`` (:func:`mhc.distributed.parallelize_sites`).
Options: per-layer activation checkpointing (``--checkpoint-activations``), ``torch.compile`` per
block (``--compile``). The data is the toy LM's synthetic language (``examples/train_toy_lm.py``),
whose optimal loss is known; every step's global batch is a function of the step, so any layout
and a resumed run see the same data. Logs loss, tokens/s per process and peak memory; saves and
resumes with ``torch.distributed.checkpoint`` (``--resume``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_toy_lm as toy  # noqa: E402  (the synthetic language, the schedule, the MLP)

from mhc.distributed import parallelize_sites  # noqa: E402
from mhc.mixing import HyperConnection, expand_streams, reduce_streams  # noqa: E402

ARMS = ("plain", "mhc")


class Attention(nn.Module):
    """Pre-norm causal self-attention on the local heads (``tp`` splits them)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.norm = nn.RMSNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, h):
        h = self.norm(h)
        q, k, v = (f(h) for f in (self.q, self.k, self.v))  # local tensors [B, T, heads / tp * head_dim]
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Residual(nn.Module):
    """``h + branch(h)``: the plain arm's block."""

    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, h):
        return h + self.branch(h)


class GPT(nn.Module):
    """Token embedding, ``layers`` x (attention, MLP) each on a plain residual or in a
    :class:`HyperConnection` on ``streams`` streams, final norm and head."""

    def __init__(self, arm: str, vocab: int, dim: int, layers: int, heads: int, seq_len: int, streams: int):
        super().__init__()
        self.arm, self.streams = arm, streams
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        branches = [b for _ in range(layers) for b in (Attention(dim, heads), toy.MLP(dim))]
        if arm == "mhc":
            self.blocks = nn.ModuleList(HyperConnection(dim, streams, branch=b) for b in branches)
        else:
            self.blocks = nn.ModuleList(Residual(b) for b in branches)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.sequence_mesh = None  # set by parallelize: the tp mesh the residual is sharded over
        self.checkpointed = False

    def forward(self, tokens, targets):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        if self.sequence_mesh is not None:  # the residual holds this rank's share of the sequence
            h = DTensor.from_local(h, self.sequence_mesh, [Replicate()]).redistribute(placements=[Shard(1)])
        x = expand_streams(h, self.streams) if self.arm == "mhc" else h
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        h = self.norm(reduce_streams(x) if self.arm == "mhc" else x)
        if isinstance(h, DTensor):
            h = h.full_tensor()  # the head on the whole sequence
        return F.cross_entropy(self.head(h).float().flatten(0, 1), targets.flatten())


def parallelize(model: GPT, mesh, args) -> GPT:
    """Tensor and sequence parallel over ``mesh["tp"]``, FSDP2 over ``mesh["dp"]`` (torchtitan's
    order), then activation checkpointing and ``torch.compile`` per block."""
    tp = mesh["tp"]
    if tp.size() > 1:
        attention = {
            "norm": SequenceParallel(),
            **{name: ColwiseParallel(input_layouts=Shard(1)) for name in ("q", "k", "v")},
            "proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        mlp = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        for block in model.blocks:
            branch = block.branch
            parallelize_module(branch, tp, attention if isinstance(branch, Attention) else mlp)
        parallelize_module(model, tp, {"norm": SequenceParallel()})
        if model.arm == "mhc":
            parallelize_sites(model, tp)
        model.sequence_mesh = tp
    if mesh["dp"].size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.checkpointed = args.checkpoint_activations
    if args.compile:
        for block in model.blocks:
            block.compile()
    return model


def evaluate_optimum(args) -> float | None:
    return toy.make_source(args).optimum(args.seq_len)


def train(arm: str, args, mesh, device) -> list[dict]:
    rank = dist.get_rank()
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    source = toy.make_source(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(arm, source.vocab, args.dim, args.layers, args.heads, args.seq_len, args.streams).to(device)
    model = parallelize(model, mesh, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    out = Path(args.out_dir)
    ckpt = out / f"{arm}_dcp"
    log_path = out / f"{arm}.jsonl"
    start = 0
    if args.resume and (ckpt / "step.json").exists():
        state_model, state_opt = get_state_dict(model, opt)
        state = {"model": state_model, "optim": state_opt}
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = json.loads((ckpt / "step.json").read_text())["step"]
    records = [json.loads(line) for line in open(log_path)] if start and log_path.exists() else []
    records = [r for r in records if r["step"] <= start]
    tokens_per_rank = args.batch_size // dp * args.seq_len
    tick, logged = time.perf_counter(), start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(start, min(args.steps, args.stop_at or args.steps)):
        batch = toy.batch_for_step(source, args, step).chunk(dp)[dp_rank].to(device)
        for group in opt.param_groups:
            group["lr"] = toy.lr_at(step, args)
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if done % args.log_every and done not in (args.steps, args.stop_at):
            continue
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # every tp rank holds the same loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        record = dict(
            step=done,
            loss=mean.item() / dp,
            tokens_per_s_per_process=(done - logged) * tokens_per_rank / (now - tick),
            peak_mem_mib=toy.peak_memory_mib(device),
        )
        records.append(record)
        if rank == 0:
            print(f"{arm} step {done}/{args.steps}: loss {record['loss']:.4f}, "
                  f"{record['tokens_per_s_per_process']:.0f} tok/s per process, {record['peak_mem_mib']:.0f} MiB",
                  flush=True)  # fmt: skip
            log_path.write_text("".join(json.dumps(r) + "\n" for r in records))
        if done % args.save_every == 0 or done in (args.steps, args.stop_at):
            state_model, state_opt = get_state_dict(model, opt)
            dcp.save({"model": state_model, "optim": state_opt}, checkpoint_id=str(ckpt))
            if rank == 0:
                (ckpt / "step.json").write_text(json.dumps({"step": done}))
            dist.barrier()
        tick, logged = time.perf_counter(), done
    return records


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", choices=ARMS, default="mhc", help="the residual of a single run")
    p.add_argument("--compare", action="store_true", help="train both arms, one after the other")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: processes / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor- and sequence-parallel size")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all dp ranks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--branching", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute each block in the backward")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--resume", action="store_true", help="continue each arm from its DCP checkpoint")
    p.add_argument("--stop-at", type=int, help="stop (and save) after this step, as if interrupted")
    p.add_argument("--out-dir", default="runs/parallel")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    args.text = None  # the synthetic language (train_toy_lm's make_source)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --nproc_per_node=2 examples/train_parallel.py --tp 2")
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dp = args.dp or world // args.tp
    for name, value, of in (
        ("dp x tp", dp * args.tp, world),
        ("heads % tp", args.heads % args.tp, 0),
        ("batch % dp", args.batch_size % dp, 0),
        ("seq_len % tp", args.seq_len % args.tp, 0),
    ):
        if value != of:
            sys.exit(f"{name} must be {of}, got {value} (dp {dp}, tp {args.tp}, {world} processes)")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    optimum = evaluate_optimum(args)
    if dist.get_rank() == 0:
        print(f"{world} processes, mesh dp {dp} x tp {args.tp} on {device.type}; optimum {optimum:.4f} nats/token")
    results = {arm: train(arm, args, mesh, device) for arm in (ARMS if args.compare else (args.arm,))}
    if dist.get_rank() == 0:
        for arm, records in results.items():
            last = records[-1]
            speed, memory = last["tokens_per_s_per_process"], last["peak_mem_mib"]
            loss = last["loss"]
            print(f"{arm}: loss {loss:.4f} (optimum {optimum:.4f}), {speed:.0f} tok/s per process, {memory:.0f} MiB")
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
