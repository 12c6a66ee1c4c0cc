"""A small Mixture-of-Experts language model whose expert outputs are mixed by a LaneMixer.

    python examples/moe_lanes.py                    # both arms on CPU, a few minutes
    python examples/moe_lanes.py --preset gpu       # one GPU, 16 experts, bf16, Triton kernels
    python examples/moe_lanes.py --mixer static     # one learned mixing matrix per layer

Every MoE layer runs all ``--experts`` expert MLPs on every token (a dense, softly routed MoE), so a
token has ``n = experts`` lanes ``[..., n, dim]``; a router's softmax weights combine them. The
``mixed`` arm puts a :class:`mhc.mixing.LaneMixer` between the experts and the router: each lane
becomes a doubly stochastic combination of all experts' outputs (dynamic by default: one matrix
per token). The ``none`` arm is the same model without the mixer. The data is the toy LM's
synthetic Markov language, whose optimal loss is known (``examples/train_toy_lm.py``).

Outputs under ``--out-dir``: ``<arm>.jsonl`` (train / val loss, tokens/s per logged step),
``mixing.json`` (each layer's mixing matrix: static, or averaged over a validation batch),
``loss_curves.png``, ``mixing_heatmap.png`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from train_toy_lm import Attention, MarkovSource, autocast, batch_for_step, hardware

from mhc.mixing import LaneMixer

ARMS = ("none", "mixed")
PRESETS = {
    "cpu": dict(
        dim=64,
        layers=4,
        heads=4,
        experts=8,
        expert_dim=64,
        seq_len=64,
        batch_size=16,
        steps=600,
        lr=1e-2,
        vocab=16,
        branching=4,
        eval_every=50,
        eval_batches=4,
        dtype="float32",
    ),
    "gpu": dict(
        dim=256,
        layers=4,
        heads=8,
        experts=16,
        expert_dim=256,
        seq_len=256,
        batch_size=32,
        steps=600,
        lr=2e-3,
        vocab=32,
        branching=4,
        eval_every=50,
        eval_batches=8,
        dtype="bfloat16",
    ),
}


class MoE(nn.Module):
    """Pre-norm dense MoE: ``experts`` GELU MLPs on every token, lanes ``[..., experts, dim]``,
    optionally mixed by ``mixer``, then combined by a softmax router. ``[..., dim] -> [..., dim]``."""

    def __init__(self, dim: int, experts: int, expert_dim: int, mixer: LaneMixer | None):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, expert_dim) / math.sqrt(dim))
        self.down = nn.Parameter(torch.randn(experts, expert_dim, dim) / math.sqrt(expert_dim) / experts)
        self.mixer = mixer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        hidden = F.gelu(torch.einsum("btd,edf->btef", h, self.up))
        lanes = torch.einsum("btef,efd->bted", hidden, self.down)  # [B, T, experts, dim]
        if self.mixer is not None:
            lanes = self.mixer(lanes)
        gate = torch.softmax(self.router(h).float(), dim=-1).to(lanes.dtype)
        return torch.einsum("bte,bted->btd", gate, lanes)


class MoEGPT(nn.Module):
    def __init__(self, args, arm: str):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.pos = nn.Parameter(torch.randn(args.seq_len, args.dim) * 0.02)
        blocks = []
        for _ in range(args.layers):
            mixer = None
            if arm == "mixed":
                dynamic = args.mixer == "dynamic"
                mixer = LaneMixer(args.experts, dim=args.dim if dynamic else None, dynamic=dynamic)
            blocks += [Attention(args.dim, args.heads), MoE(args.dim, args.experts, args.expert_dim, mixer)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def mixers(self) -> list[LaneMixer]:
        return [b.mixer for b in self.blocks if isinstance(b, MoE) and b.mixer is not None]


def evaluate(model, args, source, device) -> float:
    model.eval()
    losses = []
    with torch.no_grad(), autocast(args, device):
        for i in range(args.eval_batches):
            batch = batch_for_step(source, args, i, split="val").to(device)
            losses.append(model(batch[:, :-1], batch[:, 1:]).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def mixing_matrices(model, args, source, device) -> list[list[list[float]]]:
    """Each layer's mixing matrix: the static one, or the mean over a validation batch's tokens."""
    batch = batch_for_step(source, args, 0, split="val").to(device)
    captured = []
    hooks = [
        m.register_forward_hook(lambda m, inp, out: captured.append(m.matrix(inp[0]).float())) for m in model.mixers()
    ]
    with autocast(args, device):
        model(batch[:, :-1], batch[:, 1:])
    for hook in hooks:
        hook.remove()
    return [p.reshape(-1, args.experts, args.experts).mean(0).cpu().tolist() for p in captured]


def train(arm: str, args, source, device) -> list[dict]:
    torch.manual_seed(args.seed)
    model = MoEGPT(args, arm).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    records, tokens_per_step = [], args.batch_size * args.seq_len
    start = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:  # cosine decay to 10%
            group["lr"] = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps)))
        batch = batch_for_step(source, args, step).to(device)
        with autocast(args, device):
            loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step == args.steps - 1
        if step % args.log_every == 0 or last:
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            record = dict(step=step, train_loss=loss.item(), tokens_per_s=tokens_per_step * (step + 1) / elapsed)
            if step % args.eval_every == 0 or last:
                record["val_loss"] = evaluate(model, args, source, device)
            records.append(record)
            print(
                f"{arm:5s} step {step:4d} loss {record['train_loss']:.3f}"
                + (f" val {record['val_loss']:.3f}" if "val_loss" in record else ""),
                flush=True,
            )
    if arm == "mixed":
        (Path(args.out_dir) / "mixing.json").write_text(json.dumps(mixing_matrices(model, args, source, device)))
    return records


def report(out: Path, logs: dict, optimum: float, args, command: str) -> None:
    lines = [
        "# Dense MoE with and without lane mixing\n",
        f"`{command}` on {hardware()}; "
        f"{args.experts} experts, {args.layers} layers, mixer {args.mixer}, {args.steps} steps.\n",
        "| arm | final val loss | optimum | tokens/s |",
        "| --- | --- | --- | --- |",
    ]
    for arm, rs in logs.items():
        val = [r["val_loss"] for r in rs if "val_loss" in r][-1]
        lines.append(f"| {arm} | {val:.4f} | {optimum:.4f} | {rs[-1]['tokens_per_s']:,.0f} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
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
    ax.axhline(optimum, color="k", ls="--", lw=1, label=f"optimum {optimum:.3f}")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="Dense MoE: training (thin) and validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)
    mats = json.loads((out / "mixing.json").read_text())
    fig, axes = plt.subplots(1, len(mats), figsize=(3.6 * len(mats), 3.4), squeeze=False)
    for layer, (ax, m) in enumerate(zip(axes[0], mats)):
        im = ax.imshow(m, cmap="viridis", vmin=0.0)
        ax.set(title=f"layer {layer}: lane i <- expert j", xlabel="expert j", ylabel="lane i")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out / "mixing_heatmap.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--mixer", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--out-dir", default="runs/moe_lanes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--log-every", type=int, default=10)
    for name in (
        "dim",
        "layers",
        "heads",
        "experts",
        "expert_dim",
        "seq_len",
        "batch_size",
        "steps",
        "eval_every",
        "eval_batches",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset")
    p.add_argument("--lr", type=float, help="override the preset")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.experts < 2:
        p.error("--experts must be >= 2 (lanes to mix)")
    if args.experts > 64:
        p.error("--experts must be <= 64 (the Sinkhorn kernels' limit)")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = MarkovSource(args.vocab, args.branching, args.seed)
    logs = {}
    for arm in ARMS:
        logs[arm] = train(arm, args, source, device)
        (out / f"{arm}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logs[arm]))
    command = "python examples/moe_lanes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report(out, logs, source.optimum(args.seq_len), args, command.strip())
    return out


if __name__ == "__main__":
    main()
