"""Decoding: mHC sites forward only at 1 to 64 tokens, replayed from CUDA graphs.

    python -m bench.decode --tables stack gpt profile --out-dir results/decode

- ``stack``: 16 sites around one bf16 ``Linear(d, d)`` each, under ``torch.no_grad()``, the
  whole stack captured in one CUDA graph and replayed, against the same stack with plain
  residuals (``h + branch(h)``); sites called as modules and chained (``finish(y, next=)``).
  ``d`` 2048 / 4096 / 7168, 1 / 8 / 64 tokens; what mHC adds per site, and kernels per stack.
- ``gpt``: one decode step of a KV-cached GPT (8 layers, d = 4096, 32 heads, a 4d GELU MLP,
  vocabulary 32k, a static cache of 1024 positions with 512 filled), one CUDA graph per step, at
  batch 1 and 8: plain residuals against mHC sites (modules, and chained), n = 4.
- ``profile``: one site's kernels at d = 4096, 1 and 64 tokens (mean of 50 forward calls).

Medians of ``triton.testing.do_bench`` over graph replays. ``--root`` imports ``mhc`` from another
checkout (a before / after comparison in one run).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from bench.harness import through_sites, write_csv

SITES = 16


def _mhc():
    import mhc.mixing

    return mhc.mixing


def graphed(fn):
    """``fn`` (no arguments) captured in a CUDA graph after a warm-up on a side stream: the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def replay_ms(replay) -> float:
    import triton.testing

    return triton.testing.do_bench(replay, warmup=50, rep=300, return_mode="median")


def kernel_count(fn) -> int:
    """Kernels one eager call of ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# ------------------------------------------------------------------------------ the stack


def stack_rows(dims, tokens_list, n: int):
    mixing = _mhc()
    rows = []
    for d in dims:
        branches = [nn.Linear(d, d, device="cuda", dtype=torch.bfloat16) for _ in range(SITES)]
        sites = [mixing.HyperConnection(d, n, b).cuda() for b in branches]
        for tokens in tokens_list:
            h = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
            x = mixing.expand_streams(h, n).contiguous()

            def plain(h=h):
                for b in branches:
                    h = h + b(h)
                return h

            arms = {"plain": plain}
            arms["mhc"] = lambda x=x: through_sites(sites, x, False)
            arms["mhc chained"] = lambda x=x: through_sites(sites, x, True)
            with torch.no_grad():
                times = {name: replay_ms(graphed(fn)) for name, fn in arms.items()}
                kernels = {name: kernel_count(fn) for name, fn in arms.items()}
            for name in list(arms)[1:]:
                rows.append(
                    dict(
                        d=d,
                        tokens=tokens,
                        arm=name,
                        plain_ms=round(times["plain"], 4),
                        ms=round(times[name], 4),
                        ratio=round(times[name] / times["plain"], 3),
                        us_per_site=round((times[name] - times["plain"]) * 1000 / SITES, 2),
                        kernels_plain=kernels["plain"],
                        kernels=kernels[name],
                    )
                )
                print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------ a KV-cached GPT


class Attention(nn.Module):
    """Causal self-attention over a static KV cache ``[B, H, S, hd]``; ``pos`` (a one-element
    device tensor, written before each replay) is the new token's position."""

    def __init__(self, d, heads, batch, positions):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm = nn.RMSNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        shape = (batch, heads, positions, self.hd)
        self.register_buffer("k", torch.randn(shape) * 0.1)
        self.register_buffer("v", torch.randn(shape) * 0.1)
        self.register_buffer("pos", torch.tensor([positions // 2]))

    def forward(self, h):  # [B, 1, d]
        B = h.shape[0]
        q, k, v = self.qkv(self.norm(h)).view(B, 1, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        self.k.index_copy_(2, self.pos, k)
        self.v.index_copy_(2, self.pos, v)
        mask = (torch.arange(self.k.shape[2], device=h.device) <= self.pos)[None, :]
        o = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(B, 1, -1))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(d), nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h)), approximate="tanh"))


class GPT(nn.Module):
    """Plain residuals (``n = 0``) or mHC sites with ``n`` streams around every attention and MLP."""

    def __init__(self, d, layers, heads, vocab, batch, positions, n=0):
        super().__init__()
        self.n = n
        self.embed, self.head, self.norm = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False), nn.RMSNorm(d)
        branches = []
        for _ in range(layers):
            branches += [Attention(d, heads, batch, positions), MLP(d)]
        if n:
            mixing = _mhc()
            self.sites = nn.ModuleList(mixing.HyperConnection(d, n, b) for b in branches)
        else:
            self.branches = nn.ModuleList(branches)

    def forward(self, tokens, chain=False):  # [B, 1] -> logits [B, 1, vocab]
        h = self.embed(tokens)
        if self.n:
            mixing = _mhc()
            h = mixing.reduce_streams(through_sites(list(self.sites), mixing.expand_streams(h, self.n), chain))
        else:
            for b in self.branches:
                h = h + b(h)
        return self.head(self.norm(h))


def gpt_rows(batches, n: int, d=4096, layers=8, heads=32, vocab=32768, positions=1024):
    rows = []
    for batch in batches:
        times, kernels = {}, {}
        for arm in ("plain", "mhc", "mhc chained"):
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = GPT(d, layers, heads, vocab, batch, positions, 0 if arm == "plain" else n)
            model = model.to(torch.bfloat16)
            if arm != "plain":  # the mixing parameters in fp32, as a model trained with them keeps them
                for site in model.sites:
                    for name, p in site.named_parameters(recurse=False):
                        p.data = p.data.float()
            tokens = torch.randint(vocab, (batch, 1), device="cuda")
            with torch.no_grad():
                fn = lambda model=model, tokens=tokens, arm=arm: model(tokens, chain=arm == "mhc chained")  # noqa: E731
                times[arm] = replay_ms(graphed(fn))
                kernels[arm] = kernel_count(fn)
            del model
            torch.cuda.empty_cache()
        for arm in ("mhc", "mhc chained"):
            rows.append(
                dict(
                    batch=batch,
                    arm=arm,
                    plain_ms=round(times["plain"], 4),
                    ms=round(times[arm], 4),
                    ratio=round(times[arm] / times["plain"], 3),
                    us_per_site=round((times[arm] - times["plain"]) * 1000 / (2 * layers), 2),
                    kernels_plain=kernels["plain"],
                    kernels=kernels[arm],
                )
            )
            print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------------ one site's kernels


def profile_rows(tokens_list, n: int, d: int = 4096, calls: int = 50):
    mixing = _mhc()
    site = mixing.HyperConnection(d, n, nn.Linear(d, d, dtype=torch.bfloat16)).cuda()
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, n, d, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(5):
                site(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    site(x)
                torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us = e.device_time_total / calls
                rows.append(dict(d=d, tokens=tokens, kernel=e.key[:80], us_per_call=round(us, 2), calls=e.count))
                print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="+", default=["stack", "gpt"], choices=["stack", "gpt", "profile"])
    p.add_argument("--dims", type=int, nargs="+", default=[2048, 4096, 7168])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--root", default=None, help="import mhc from this checkout")
    p.add_argument("--out-dir", default="results/decode")
    args = p.parse_args(argv)
    if args.root:
        sys.path.insert(0, os.path.abspath(args.root))

    torch.backends.cuda.matmul.allow_tf32 = True
    for table in args.tables:
        if table == "stack":
            rows = stack_rows(args.dims, args.tokens, args.streams)
        elif table == "gpt":
            rows = gpt_rows(args.batches, args.streams)
        else:
            rows = profile_rows([1, 64], args.streams)
        write_csv(rows, os.path.join(args.out_dir, f"{table}.csv"), list(rows[0]))


if __name__ == "__main__":
    main()
