"""Train a small GPT whose residual connections are plain (baseline), hyper-connections (HC) or mHC.

    python examples/train_toy_lm.py --compare                  # all three arms, CPU, < 5 minutes
    python examples/train_toy_lm.py --residual mhc --steps 500
    python examples/train_toy_lm.py --preset gpu --compare     # one GPU: Triton kernels, fused loss
    python examples/train_toy_lm.py --text book.txt --compare  # bytes of any text file
    torchrun --nproc_per_node=2 examples/train_toy_lm.py --compare   # data-parallel (DDP)
    torchrun --nproc_per_node=2 examples/train_toy_lm.py --fsdp      # sharded (FSDP2, per block)
    python examples/train_toy_lm.py --checkpoint-activations         # recompute blocks in backward
    python examples/train_toy_lm.py --report runs/toy_lm       # redraw plots and table from logs

The default data is a synthetic language with a known optimum: an order-2 Markov chain whose
every context allows ``--branching`` next tokens, started in its stationary distribution, so the
best achievable loss is computed exactly and drawn under the loss curves. Everything is
deterministic given ``--seed``: every arm of a comparison sees the same batches.

Outputs under ``--out-dir``: ``<arm>_seed<s>.jsonl`` (one record per logged step: train loss, val
loss, gradient norm, tokens/s, peak memory, and for HC/mHC the per-layer and composite "Amax gain"
of ``h_res``), ``<arm>_seed<s>.pt`` (checkpoint, used by ``--resume``), ``<arm>_seed<s>_h_res.json``
(a few ``h_res`` matrices), and with ``--compare``: ``loss_curves.png``, ``gain.png``,
``h_res_heatmap.png``, ``speed.json`` (tokens/s with the arms' steps timed in turn, one process)
and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from mhc.losses import LinearCrossEntropy
from mhc.mixing import HyperConnection, amax_gain, collect_h_res, expand_streams, reduce_streams
from mhc.ops.path import choose

ARMS = ("baseline", "hc", "mhc")
SPEED_FILE = "speed.json"  # --compare's tokens/s with the arms timed in turn
PRESETS = {
    # a 2-core CPU runs the three-arm comparison in a few minutes
    "cpu": dict(
        dim=64,
        layers=4,
        heads=4,
        seq_len=64,
        batch_size=16,
        steps=600,
        lr=1e-2,
        vocab=16,
        branching=4,
        eval_every=50,
        eval_batches=4,
        loss="torch",
        dtype="float32",
    ),
    # one GPU: bf16 autocast, the fused hyper-connection kernels and the fused linear cross-entropy
    "gpu": dict(
        dim=512,
        layers=8,
        heads=8,
        seq_len=256,
        batch_size=32,
        steps=1000,
        lr=2e-3,
        vocab=32,
        branching=4,
        eval_every=50,
        eval_batches=8,
        loss="fused",
        dtype="bfloat16",
    ),
}


# ------------------------------------------------------------------------------ data


class MarkovSource:
    """Order-``order`` Markov chain over ``vocab`` tokens; each context allows ``branching`` next
    tokens, with probabilities drawn from a flat Dirichlet. Sequences start in the stationary
    distribution of contexts, so the optimal loss at every position is known exactly."""

    def __init__(self, vocab: int, branching: int, seed: int, order: int = 2):
        g = torch.Generator().manual_seed(10_007 * seed + 1)
        self.vocab, self.order = vocab, order
        contexts = vocab**order
        self.successors = torch.rand(contexts, vocab, generator=g).argsort(dim=1)[:, :branching]
        weights = -torch.log(torch.rand(contexts, branching, generator=g, dtype=torch.float64))
        self.probs = weights / weights.sum(dim=1, keepdim=True)  # Dirichlet(1, ..., 1)
        # context (a_1 .. a_k) -> (a_2 .. a_k, c): the index drops a_1 and appends c
        self.next_context = (torch.arange(contexts)[:, None] % vocab ** (order - 1)) * vocab + self.successors
        self.stationary = self._stationary()

    def _stationary(self, iters: int = 3000) -> torch.Tensor:
        # Cesaro average of the power iteration: a stationary distribution even for periodic chains
        p = torch.full((self.probs.shape[0],), 1.0 / self.probs.shape[0], dtype=torch.float64)
        total = torch.zeros_like(p)
        for i in range(iters):
            p = torch.zeros_like(p).index_add_(0, self.next_context.reshape(-1), (p[:, None] * self.probs).reshape(-1))
            if i >= iters // 2:
                total += p
        return total / total.sum()

    def entropy_rate(self) -> float:
        """Nats per token once a whole context is visible: the loss floor for most positions."""
        h = -(self.probs * self.probs.log()).sum(dim=1)
        return float((self.stationary * h).sum())

    def optimum(self, seq_len: int) -> float:
        """Best achievable mean loss over the ``seq_len`` predicted positions of a window."""
        joint = self.stationary.reshape([self.vocab] * self.order)
        prefix_entropy = []  # H(X_0 .. X_t) for t < order
        for t in range(self.order):
            marginal = joint.sum(dim=tuple(range(t + 1, self.order))) if t + 1 < self.order else joint
            m = marginal[marginal > 0]
            prefix_entropy.append(float(-(m * m.log()).sum()))
        per_position = []
        for t in range(1, seq_len + 1):  # position t is predicted from tokens 0 .. t-1
            per_position.append(prefix_entropy[t] - prefix_entropy[t - 1] if t < self.order else self.entropy_rate())
        return sum(per_position) / seq_len

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``[batch, length]`` token ids."""
        context = torch.multinomial(self.stationary, batch, replacement=True, generator=generator)
        tokens = [(context // self.vocab ** (self.order - 1 - i)) % self.vocab for i in range(self.order)]
        while len(tokens) < length:
            choice = torch.multinomial(self.probs[context], 1, generator=generator).squeeze(1)
            tokens.append(self.successors[context, choice])
            context = self.next_context[context, choice]
        return torch.stack(tokens[:length], dim=1)


class TextSource:
    """Bytes of a text file (vocabulary 256): the first 90% for training, the rest for validation."""

    vocab = 256

    def __init__(self, path: str):
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        split = int(0.9 * len(data))
        self.parts = {"train": data[:split], "val": data[split:]}

    def optimum(self, seq_len: int) -> None:
        return None  # unknown for real text

    def sample(self, batch: int, length: int, generator: torch.Generator, split: str = "train") -> torch.Tensor:
        data = self.parts[split]
        starts = torch.randint(0, len(data) - length, (batch,), generator=generator)
        return torch.stack([data[s : s + length] for s in starts.tolist()])


def make_source(args):
    return TextSource(args.text) if args.text else MarkovSource(args.vocab, args.branching, args.seed)


def batch_for_step(source, args, step: int, split: str = "train") -> torch.Tensor:
    """The global batch ``[batch_size, seq_len + 1]`` of a step: a pure function of (seed, step),
    so every arm, every rank and a resumed run see the same data."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step + (0 if split == "train" else 500_009))
    if isinstance(source, TextSource):
        return source.sample(args.batch_size, args.seq_len + 1, g, split)
    return source.sample(args.batch_size, args.seq_len + 1, g)


# ------------------------------------------------------------------------------ model


class Attention(nn.Module):
    """Pre-norm causal self-attention."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, D = h.shape
        q, k, v = self.qkv(self.norm(h)).view(B, T, 3, self.heads, D // self.heads).unbind(dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    """Pre-norm two-layer GELU MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(h))))


class TinyGPT(nn.Module):
    """GPT whose every branch (attention, MLP) sits on a plain residual (``baseline``) or inside a
    :class:`HyperConnection` on ``streams`` residual streams (``hc``: unconstrained, ``mhc``: h_res
    doubly stochastic). The head and loss are one :class:`LinearCrossEntropy`. With
    ``checkpoint_blocks`` every block's activations are recomputed in the backward. With ``chain``
    (and without checkpointing) the hyper-connections hand over to one another,
    ``finish(y, next=...)``: on a GPU one seam op joins consecutive mHC sites. FSDP2
    shards each hyper-connection as its own unit and gathers its parameters when the module is
    called, so sharded runs call every site as a module (``chain=False``)."""

    def __init__(
        self,
        vocab,
        dim,
        layers,
        heads,
        seq_len,
        residual,
        streams,
        sinkhorn_iters,
        loss,
        checkpoint_blocks=False,
        chain=True,
        capturable=False,
    ):
        super().__init__()
        self.residual, self.streams, self.loss = residual, streams, loss
        self.checkpoint_blocks = checkpoint_blocks
        self.chain = chain and not checkpoint_blocks
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        branches = [m for _ in range(layers) for m in (Attention(dim, heads), MLP(dim))]
        if residual == "baseline":
            self.blocks = nn.ModuleList(branches)
        else:
            constraint = "sinkhorn" if residual == "mhc" else "none"
            self.blocks = nn.ModuleList(
                HyperConnection(dim, streams, branch=b, sinkhorn_iters=sinkhorn_iters, constraint=constraint)
                for b in branches
            )
        self.norm = nn.RMSNorm(dim)
        self.head = LinearCrossEntropy(dim, vocab, capturable=capturable)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        if self.residual == "baseline":
            for branch in self.blocks:
                h = h + self._run(branch, h)
        elif self.chain:
            x_in, finish = self.blocks[0].split(expand_streams(h, self.streams))  # streams [B, T, n, dim]
            for hc, nxt in zip(self.blocks, list(self.blocks[1:]) + [None]):
                y = hc.branch(x_in)
                if nxt is None:
                    h = reduce_streams(finish(y))
                else:
                    x_in, finish = finish(y, next=nxt)
        else:
            x = expand_streams(h, self.streams)  # [B, T, n, dim]
            for hc in self.blocks:
                x = self._run(hc, x)
            h = reduce_streams(x)
        return self.norm(h)

    def _run(self, block, inputs):
        if self.checkpoint_blocks and torch.is_grad_enabled():
            return checkpoint(block, inputs, use_reentrant=False)
        return block(inputs)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.hidden(tokens)
        if self.loss == "fused":
            return self.head(h, targets)
        logits = self.head.linear(h)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(args, arm: str, vocab: int) -> TinyGPT:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return TinyGPT(
        vocab,
        args.dim,
        args.layers,
        args.heads,
        args.seq_len,
        arm,
        args.streams,
        args.sinkhorn_iters,
        args.loss,
        args.checkpoint_activations,
        chain=not args.fsdp,
        capturable=args.cuda_graph,
    )


def shard(model: TinyGPT, args, device: torch.device) -> TinyGPT:
    """FSDP2: one unit per transformer block (a hyper-connection with its branch), then the root,
    over all processes on ``device``'s type (FSDP2's default mesh would take the GPU even for
    ``--device cpu``). bf16 / fp16 runs gather parameters in that dtype and reduce gradients in fp32."""
    dtype = None if args.dtype == "float32" else getattr(torch, args.dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def full_state(model, opt, args) -> dict:
    """Model and optimizer state as full tensors (collective under FSDP: every rank calls it)."""
    if not args.fsdp:
        return dict(model=model.state_dict(), optimizer=opt.state_dict())
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(
        model=get_model_state_dict(model, options=options),
        optimizer=get_optimizer_state_dict(model, opt, options=options),
    )


def load_full_state(model, opt, state, args) -> None:
    if not args.fsdp:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, opt, state["optimizer"], options=options)


# ------------------------------------------------------------------------------ measurement


def autocast(args, device):
    enabled = args.dtype != "float32"
    return torch.autocast(device.type, dtype=getattr(torch, args.dtype), enabled=enabled)


@torch.no_grad()
def evaluate(model, val_batches, args, device) -> dict:
    """Mean validation loss, and for HC/mHC the Amax gains of h_res on the first val batch."""
    model.eval()
    losses = []
    record = {}
    for i, batch in enumerate(val_batches):
        batch = batch.to(device)
        with autocast(args, device), collect_h_res(model) as h_res:
            losses.append(model(batch[:, :-1], batch[:, 1:]).float().item())
        if i == 0 and h_res:
            record["gain"] = gain_record(h_res)
    model.train()
    record["val_loss"] = sum(losses) / len(losses)
    return record


def gain_record(h_res: list) -> dict:
    report = amax_gain(h_res)
    return {k: getattr(report, k).tolist() for k in ("forward", "backward", "composite_forward", "composite_backward")}


def peak_memory_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB -> MiB (process RSS)


# ------------------------------------------------------------------------------ training


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_seed{seed}"


def lr_at(step: int, args) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10%."""
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class GraphedStep:
    """One training step (forward, backward, gradient clipping, AdamW) captured in a CUDA graph:
    the first ``WARMUP`` steps run eagerly on a side stream (so that every kernel is compiled and
    the allocator has seen the step), the next is captured, and every step from then on copies its
    batch and learning rate into the static inputs and replays the graph: no host work per kernel.
    Needs ``AdamW(capturable=True)`` with a tensor learning rate and a loss without host reads."""

    WARMUP = 3

    def __init__(self, trained, model, opt, args, device, batch_shape):
        self.trained, self.model, self.opt, self.args, self.device = trained, model, opt, args, device
        self.batch = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.graph, self.calls, self.out = None, 0, None

    def _step(self):
        with autocast(self.args, self.device):
            loss = self.trained(self.batch[:, :-1], self.batch[:, 1:])
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.opt.step()
        return loss, grad_norm

    def __call__(self, batch, lr):
        self.batch.copy_(batch)
        for group in self.opt.param_groups:
            group["lr"].fill_(lr)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.out
        self.opt.zero_grad(set_to_none=True)
        if self.calls <= self.WARMUP:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = self._step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            return out
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()
        self.graph.replay()
        return self.out


def site_path(model: nn.Module, device, dtype: str) -> str:
    """What runs the model's hyper-connections: the fused Triton kernels or the PyTorch reference,
    as the sites themselves decide."""
    site = next((m for m in model.modules() if isinstance(m, HyperConnection)), None)
    if site is None:
        return "plain residual"
    probe = torch.empty(0, site.n_streams, site.dim, device=device)
    if choose(site.backend, probe, "mixing", site.n_streams) == "triton":
        return "fused kernels"
    return "PyTorch reference"


def make_optimizer(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)


def training_step(trained, model, opt, batch, lr, args, device):
    """One eager optimizer step on ``batch [B, T + 1]`` (``trained``: the model as wrapped for
    data parallelism); returns ``(loss, grad_norm)``."""
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast(args, device):
        loss = trained(batch[:, :-1], batch[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    opt.step()
    return loss, grad_norm


def alternated_speed(arms, args, source, device) -> dict:
    """Tokens/s of each arm's training step with the arms timed in turn: a warm-up round, then
    ``args.speed_rounds`` rounds in which each arm runs ``args.speed_steps`` steps of a fresh model
    on one batch; the median over rounds. The arms train one after another, so a machine whose
    speed drifts over a minute (a shared CPU, by tens of percent) would bias the training
    intervals' tokens/s; alternating the arms puts every arm in every stretch."""
    batch = batch_for_step(source, args, 0).to(device)
    runs = {}
    for arm in arms:
        model = build_model(args, arm, source.vocab).to(device)
        runs[arm] = (model, make_optimizer(model, args))
    seconds = {arm: [] for arm in arms}
    for round_ in range(args.speed_rounds + 1):
        for arm, (model, opt) in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(args.speed_steps):
                training_step(model, model, opt, batch, args.lr, args, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:  # round 0 warms up
                seconds[arm].append(time.perf_counter() - start)
    tokens = args.speed_steps * args.batch_size * args.seq_len
    return {arm: tokens / sorted(s)[len(s) // 2] for arm, s in seconds.items()}


def train_side_by_side(arms, args, source, device, jobs: int) -> list[Path]:
    """The arms trained at once on a CPU, each in a process of its own with a share of the cores:
    at this size PyTorch's threads split an op over the cores for little gain, so the arms side by
    side finish the comparison sooner. Every arm computes what it would alone (its data is a
    function of the step); tokens/s come from :func:`alternated_speed`, in this process."""
    import concurrent.futures
    import multiprocessing

    threads = max(1, torch.get_num_threads() // jobs)
    quiet = argparse.Namespace(**{**vars(args), "no_progress": True})
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context, initializer=torch.set_num_threads,
                                                initargs=(threads,)) as pool:  # fmt: skip
        # the costliest arm first: mhc, hc, then the baseline behind whichever ends first
        futures = {arm: pool.submit(train, arm, quiet, source, device, 0, 1) for arm in reversed(arms)}
        start = time.perf_counter()
        for future in concurrent.futures.as_completed(futures.values()):
            arm = next(a for a, f in futures.items() if f is future)
            print(
                f"{arm}: trained in {time.perf_counter() - start:.0f} s ({jobs} arms at a time, {threads} threads each)"
            )
    return [futures[arm].result() for arm in arms]


def train(arm: str, args, source, device, rank: int, world: int) -> Path:
    """Train one arm; returns its JSONL log. Rank 0 logs, evaluates and checkpoints."""
    out = Path(args.out_dir)
    name = run_name(arm, args.seed)
    log_path, ckpt_path = out / f"{name}.jsonl", out / f"{name}.pt"
    model = build_model(args, arm, source.vocab).to(device)
    if args.fsdp:
        model = shard(model, args, device)  # before the optimizer: its parameters become sharded DTensors
    if args.cuda_graph:  # a tensor learning rate: set on the device between replays
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=torch.tensor(args.lr, device=device),
            betas=(0.9, 0.95),
            weight_decay=0.0,
            capturable=True,
        )
    else:
        opt = make_optimizer(model, args)
    start = 0
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        load_full_state(model, opt, state, args)
        start = state["step"]
    records = [json.loads(line) for line in open(log_path)] if start and log_path.exists() else []
    records = [r for r in records if r["step"] <= start]  # drop what was logged after the checkpoint
    if rank == 0:
        with open(log_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    trained = nn.parallel.DistributedDataParallel(model) if world > 1 and not args.fsdp else model
    every_rank_runs_model = args.fsdp  # FSDP's forward is collective: evaluation runs on all ranks
    val_batches = [batch_for_step(source, args, i, "val") for i in range(args.eval_batches)]
    optimum = source.optimum(args.seq_len)
    progress = _progress(args, rank, start, name)
    tokens_per_step = args.batch_size * args.seq_len
    path = site_path(model, device, args.dtype)
    tick, last_logged = time.perf_counter(), start
    graphed = (
        GraphedStep(trained, model, opt, args, device, (args.batch_size, args.seq_len + 1)) if args.cuda_graph else None
    )
    for step in range(start, args.steps):
        batch = batch_for_step(source, args, step).chunk(world)[rank].to(device)  # this rank's rows
        if graphed is not None:
            loss, grad_norm = graphed(batch, lr_at(step, args))
        else:
            loss, grad_norm = training_step(trained, model, opt, batch, lr_at(step, args), args, device)
        done = step + 1
        if done % args.log_every and done != args.steps and done % args.eval_every:
            progress.update(1)
            continue
        train_loss = loss.detach().float()
        if world > 1:
            dist.all_reduce(train_loss)
            train_loss /= world
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        record = dict(
            step=done,
            train_loss=train_loss.item(),
            grad_norm=grad_norm.item(),
            tokens_per_s=(done - last_logged) * tokens_per_step / (now - tick),
            peak_mem_mib=peak_memory_mib(device),
            lr=lr_at(step, args),
            optimum=optimum,
            path=path,
        )
        tick, last_logged = now, done
        if (rank == 0 or every_rank_runs_model) and (done % args.eval_every == 0 or done == args.steps):
            record.update(evaluate(model, val_batches, args, device))
        if rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        progress.set_postfix(loss=f"{record['train_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        progress.update(1)
        if done % args.checkpoint_every == 0 or done == args.steps:
            state = full_state(model, opt, args) if rank == 0 or every_rank_runs_model else None
            if rank == 0:
                torch.save(dict(**state, step=done, args=vars(args), arm=arm), ckpt_path)
        tick = time.perf_counter()  # evaluation and checkpointing are not training time
    progress.close()
    if (rank == 0 or every_rank_runs_model) and arm != "baseline":
        save_h_res(model, val_batches[0], args, device, out / f"{name}_h_res.json", write=rank == 0)
    return log_path


def _progress(args, rank, start, name):
    from tqdm import tqdm

    return tqdm(total=args.steps, initial=start, desc=name, disable=rank != 0 or args.no_progress, dynamic_ncols=True)


@torch.no_grad()
def save_h_res(model, batch, args, device, path: Path, write: bool = True) -> None:
    """h_res of the first, middle and last hyper-connection for the first validation token."""
    model.eval()
    with autocast(args, device), collect_h_res(model) as h_res:
        model(batch[:1, :-1].to(device), batch[:1, 1:].to(device))
    model.train()
    if not write:
        return
    layers = sorted({0, len(h_res) // 2, len(h_res) - 1})
    path.write_text(json.dumps({str(i): h_res[i][0, 0].float().tolist() for i in layers}))


# ------------------------------------------------------------------------------ report


def load_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def make_report(out: Path, arms, seed: int, command: str) -> None:
    """Loss curves, gain plot, h_res heatmap and a Markdown table from the logs in ``out``."""
    logs = {
        arm: load_log(out / f"{run_name(arm, seed)}.jsonl")
        for arm in arms
        if (out / f"{run_name(arm, seed)}.jsonl").exists()
    }
    write_summary(out, logs, command)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib, then --report)")
        return
    plot_losses(plt, logs, out / "loss_curves.png")
    plot_gains(plt, logs, out / "gain.png")
    plot_h_res(plt, out, [a for a in logs if a != "baseline"], seed, out / "h_res_heatmap.png")


def _final(records, key):
    values = [r[key] for r in records if key in r]
    return values[-1] if values else float("nan")


def write_summary(out: Path, logs: dict, command: str) -> None:
    optimum = next((r["optimum"] for rs in logs.values() for r in rs if r.get("optimum") is not None), None)
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    lines = [f"Command: `{run.get('command', command)}`", f"Hardware: {run.get('hardware', hardware())}", ""]
    if optimum is not None:
        lines.append(f"Optimum (entropy of the synthetic source over the window): {optimum:.4f} nats/token")
        lines.append("")
    speed = json.loads((out / SPEED_FILE).read_text()) if (out / SPEED_FILE).exists() else None
    lines.append(
        "| arm | path | train loss | val loss | val - optimum | tokens/s | peak memory (MiB) "
        "| max composite gain fwd / bwd |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for arm, rs in logs.items():
        val = _final(rs, "val_loss")
        gap = f"{val - optimum:.4f}" if optimum is not None else "n/a"
        if speed is not None and arm in speed["tokens_per_s"]:
            tokens_per_s = speed["tokens_per_s"][arm]
        else:
            tokens_per_s = sorted(r["tokens_per_s"] for r in rs)[len(rs) // 2]  # median over logged intervals
        gains = [r["gain"] for r in rs if "gain" in r]
        gain = (
            f"{max(gains[-1]['composite_forward']):.3g} / {max(gains[-1]['composite_backward']):.3g}"
            if gains
            else "n/a"
        )
        lines.append(
            f"| {arm} | {_final(rs, 'path')} | {_final(rs, 'train_loss'):.4f} | {val:.4f} | {gap} | {tokens_per_s:.0f} "
            f"| {_final(rs, 'peak_mem_mib'):.0f} | {gain} |"
        )
    lines.append("")
    if speed is not None:
        lines.append(
            f"tokens/s: the arms' training steps timed in turn, {speed['rounds']} rounds of {speed['steps']} "
            "steps each (median)."
        )
    else:
        lines.append("tokens/s: the median over the logged intervals of each arm's training.")
    lines += [
        "val - optimum: the validation loss above the best any model can reach on this data (lower is better).",
        "max composite gain fwd / bwd: the largest Amax gain magnitude (paper Fig. 3) of the product",
        "h_res[l] ... h_res[0] over the sites: its largest row sum (forward) and column sum (backward);",
        "1 means the streams are neither amplified nor damped through depth.",
    ]
    if any(_final(rs, "path").startswith("PyTorch reference") for rs in logs.values()):
        lines += [
            "On a CPU the hyper-connections run the PyTorch reference path: its tokens/s say what mHC costs",
            "there. On a GPU the fused kernels run: the same comparison there is the GPU table of",
            "docs/toy_lm.md (mHC at 0.84x the baseline's tokens/s at d = 512, eager, one H200).",
        ]
    lines += ["", f"Files in {out}: summary.md, loss_curves.png, gain.png, h_res_heatmap.png, <arm>_seed<s>.jsonl."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"CPU ({cpu}, {torch.get_num_threads()} threads), torch {torch.__version__}"


def plot_losses(plt, logs, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, rs in logs.items():
        (line,) = ax.plot([r["step"] for r in rs], [r["train_loss"] for r in rs], alpha=0.35, lw=1)
        ev = [r for r in rs if "val_loss" in r]
        ax.plot(
            [r["step"] for r in ev],
            [r["val_loss"] for r in ev],
            "o-",
            color=line.get_color(),
            ms=3,
            label=f"{arm} (val)",
        )
    optimum = next((r["optimum"] for rs in logs.values() for r in rs if r.get("optimum") is not None), None)
    if optimum is not None:
        ax.axhline(optimum, color="k", ls="--", lw=1, label=f"optimum {optimum:.3f}")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Training (thin) and validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gains(plt, logs, path):
    arms = [a for a, rs in logs.items() if any("gain" in r for r in rs)]
    if not arms:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for arm in arms:
        gain = [r["gain"] for r in logs[arm] if "gain" in r][-1]
        layers = range(len(gain["forward"]))
        for ax, prefix in zip(axes, ("", "composite_")):
            (line,) = ax.plot(layers, gain[prefix + "forward"], "-", label=f"{arm} forward")
            ax.plot(layers, gain[prefix + "backward"], "--", color=line.get_color(), label=f"{arm} backward")
    site = "site l (two per layer: attention, MLP)"
    axes[0].set(title="Single-site h_res", xlabel=site, ylabel="Amax gain magnitude", yscale="log")
    axes[1].set(title="Composite h_res[l] ... h_res[0]", xlabel=site)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)  # below, over no line
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_h_res(plt, out, arms, seed, path):
    mats = {
        a: json.loads((out / f"{run_name(a, seed)}_h_res.json").read_text())
        for a in arms
        if (out / f"{run_name(a, seed)}_h_res.json").exists()
    }
    if not mats:
        return
    cols = max(len(m) for m in mats.values())
    fig, axes = plt.subplots(len(mats), cols, figsize=(3 * cols, 3 * len(mats)), squeeze=False)
    for row, (arm, layers) in enumerate(mats.items()):
        for col, (layer, m) in enumerate(layers.items()):
            m = torch.tensor(m).numpy()
            ax = axes[row][col]
            limit = abs(m).max()
            im = ax.imshow(m, cmap="RdBu_r", vmin=-limit, vmax=limit)
            for (i, j), v in _cells(m):
                dark = abs(v) > 0.6 * limit  # white figures on the saturated cells
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
            ax.set(title=f"{arm}: site {layer}", xticks=[], yticks=[])
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cells(m):
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            yield (i, j), float(m[i, j])


# ------------------------------------------------------------------------------ command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="model, data and schedule sizes")
    p.add_argument("--residual", choices=ARMS, default="mhc", help="residual connection of a single run")
    p.add_argument("--compare", action="store_true", help="train every arm (baseline, hc, mhc) and report")
    p.add_argument("--streams", type=int, default=4, help="residual streams n of HC / mHC")
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--loss", choices=("torch", "fused"), help="F.cross_entropy on logits, or mhc's fused loss")
    p.add_argument("--text", help="train on the bytes of this text file instead of the synthetic source")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/toy_lm")
    p.add_argument("--resume", action="store_true", help="continue each run from its checkpoint")
    p.add_argument("--report", metavar="DIR", help="only redraw the plots and table from the logs in DIR")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for name in (
        "dim",
        "layers",
        "heads",
        "seq_len",
        "batch_size",
        "steps",
        "vocab",
        "branching",
        "eval_every",
        "eval_batches",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset")
    p.add_argument("--lr", type=float, help="override the preset")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="autocast dtype (override the preset)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument(
        "--speed-rounds",
        type=int,
        default=5,
        help="--compare on one process: rounds of the arms' steps timed in turn for tokens/s (0: off)",
    )
    p.add_argument("--speed-steps", type=int, default=10, help="steps per arm and round of --speed-rounds")
    p.add_argument(
        "--jobs",
        type=int,
        help="--compare on one CPU process: arms trained at once, each in a process of its own "
        "(default: one per core, at most one per arm; 1: one after another)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard with FSDP2 (one unit per block; bf16/fp16 parameters, fp32 reduction) under torchrun",
    )
    p.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="recompute each block's activations in the backward (torch.utils.checkpoint)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="capture the training step in a CUDA graph and replay it (one GPU, fused loss)",
    )
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.streams < 1:
        p.error(f"--streams must be >= 1, got {args.streams}")
    if args.text and not Path(args.text).is_file():
        p.error(f"--text: no such file: {args.text}")
    for name in (
        "dim",
        "layers",
        "heads",
        "seq_len",
        "batch_size",
        "steps",
        "eval_every",
        "eval_batches",
        "log_every",
        "checkpoint_every",
        "speed_steps",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.speed_rounds < 0:
        p.error(f"--speed-rounds must be >= 0, got {args.speed_rounds}")
    if args.dim % args.heads:
        p.error(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if not args.text and not 1 <= args.branching <= args.vocab:
        p.error(f"--branching must be in [1, --vocab], got {args.branching}")
    if args.cuda_graph and (args.fsdp or args.loss != "fused" or args.resume):
        p.error("--cuda-graph runs one process with the fused loss, without --fsdp or --resume")
    return args


def main(argv=None) -> list[Path]:
    args = parse_args(argv)
    command = "python examples/train_toy_lm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.report:
        make_report(Path(args.report), ARMS, args.seed, command)
        return []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    distributed = "WORLD_SIZE" in os.environ  # launched by torchrun, even with one process
    if args.fsdp and not distributed:
        sys.exit("--fsdp needs a process group: launch with torchrun --nproc_per_node=N")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.cuda_graph and (device.type != "cuda" or world > 1):
        sys.exit("--cuda-graph needs one process on a CUDA device")
    if distributed:
        if args.batch_size % world:
            sys.exit(f"--batch-size ({args.batch_size}) must be divisible by the {world} processes")
        if device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if local_rank >= torch.cuda.device_count():
                sys.exit(
                    f"process {local_rank} of this node has no GPU of its own ({torch.cuda.device_count()} "
                    "here): launch at most one process per GPU, or pass --device cpu"
                )
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    source = make_source(args)
    if rank == 0 and source.optimum(args.seq_len) is not None:
        print(
            f"synthetic source: vocab {source.vocab}, optimum {source.optimum(args.seq_len):.4f} nats/token "
            f"(uniform guess {math.log(source.vocab):.4f})"
        )
    arms = ARMS if args.compare else (args.residual,)
    if rank == 0:  # what produced the logs, for reports redrawn later with --report
        (Path(args.out_dir) / "run.json").write_text(
            json.dumps(dict(command=command, hardware=hardware(), world_size=world))
        )
    speed_path = Path(args.out_dir) / SPEED_FILE
    if rank == 0:
        speed_path.unlink(missing_ok=True)  # a table speaks of this run's arms only
    jobs = min(len(arms), args.jobs or os.cpu_count() or 1) if device.type == "cpu" and not distributed else 1
    if jobs > 1:
        logs = train_side_by_side(arms, args, source, device, jobs)
    else:
        logs = [train(arm, args, source, device, rank, world) for arm in arms]
    if rank == 0 and len(arms) > 1 and world == 1 and not args.cuda_graph and args.speed_rounds:
        speeds = alternated_speed(arms, args, source, device)
        speed_path.write_text(json.dumps(dict(rounds=args.speed_rounds, steps=args.speed_steps, tokens_per_s=speeds)))
    if rank == 0:
        make_report(Path(args.out_dir), arms, args.seed, command)
    if distributed:
        dist.destroy_process_group()
    return logs


if __name__ == "__main__":
    main()
