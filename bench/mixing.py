"""Benchmark hyper-connections against plain residuals and the peers, from one kernel to a model.

    python -m bench.mixing --out-dir results/mixing      # on a CUDA GPU

Three tables, all bf16 activations, forward + backward, ``triton.testing.do_bench`` medians
after warm-up, in one run:

- ``kernels``: each fused kernel of one mHC layer (d = 4096, n = 4, 16k tokens) against the bytes
  it must move, as GB/s and as a fraction of a measured device copy;
- ``block``: one MLP block (RMSNorm, d -> 4d -> d, GELU) with a plain residual, inside an mhc
  ``HyperConnection`` (fused kernels and the PyTorch reference path) and inside Liger-Kernel's
  ``LigerMHC``, for every d and n asked; peak memory beyond the inputs;
- ``model``: GPTs (d = 1024: 8 layers, 16 heads, 8 x 2048 tokens; d = 4096: 2 layers, 32 heads,
  4 x 2048 tokens; SDPA attention, two hyper-connections per layer), bf16 weights (mhc's
  coefficient parameters fp32), AdamW: one training step, eager and ``torch.compile``, the arms
  interleaved over ``--repeats`` rounds; step time, tokens/s, ratio to the plain model (median of
  the within-round ratios), peak memory. ``mhc`` calls every site as a module, ``mhc-chain``
  chains them (``finish(y, next=...)``: one seam op between sites).

Then a profile of the fused block (where the time goes). Peers that are not installed are
reported as skipped. Writes ``kernels.csv``, ``block.csv``, ``model.csv`` and ``profile.txt``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.harness import peak_extra, through_sites, write_csv
from mhc.memory.checkpoint import checkpoint_layers, checkpoint_policy
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, expand_streams, reduce_streams

DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------ modules


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, h):
        return self.down(F.gelu(self.up(self.norm(h))))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, h):
        B, T, D = h.shape
        q, k, v = self.qkv(self.norm(h)).view(B, T, 3, self.heads, D // self.heads).unbind(dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Residual(nn.Module):
    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, h):
        return h + self.branch(h)


def _liger():
    try:
        from liger_kernel.transformers import LigerMHC

        return LigerMHC, None
    except ImportError as e:
        return None, f"not installed ({e})"


def wrap(arm: str, branch: nn.Module, dim: int, n: int) -> nn.Module:
    """The branch (already bf16) inside the arm's residual connection; coefficients as each
    library keeps them (fp32 for mhc, bf16 ``phi`` for Liger)."""
    if arm == "plain":
        return Residual(branch)
    if arm in ("mhc", "mhc-chain"):
        return HyperConnection(dim, n, branch, init="zero").cuda()
    if arm == "mhc-torch":
        return HyperConnection(dim, n, branch, init="zero", backend="torch").cuda()
    if arm == "liger":
        return _liger()[0](branch, hc=n, c=dim, phi_dtype=DTYPE).cuda()
    raise ValueError(arm)


def _arms():
    arms, skipped = ["plain", "mhc", "mhc-torch"], {}
    if _liger()[0] is None:
        skipped["liger"] = _liger()[1]
    else:
        arms.append("liger")
    return arms, skipped


# ------------------------------------------------------------------------------ kernels


def kernel_table(dim, n, tokens, copy_gbps):
    """Each launcher of one layer, timed alone, against the bytes it must move."""
    from triton.testing import do_bench

    from mhc import kernels

    T, K, M = tokens, n * dim, 2 * n + n * n
    x = torch.randn(T, n, dim, device="cuda", dtype=DTYPE)
    y = torch.randn(T, dim, device="cuda", dtype=DTYPE)
    phi = torch.randn(K, M, device="cuda") / math.sqrt(K)
    alpha = torch.full((3,), 0.5, device="cuda")
    bias = torch.zeros(2 * n + n * n, device="cuda")
    x_in, p, r, h_pre, h_post, z_res, h_res = kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    g_out = torch.randn_like(x)
    g_in = torch.randn_like(y)
    dh_res = torch.randn_like(h_res)
    X, Y = x.numel() * 2, y.numel() * 2
    calls = {
        "coefficients + pre-mix fwd (read x twice, write x_in)": (
            lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6),
            2 * X + Y,
        ),
        "post + residual fwd (read x, y; write out)": (lambda: kernels.stream_mix_fwd(x, h_res, y, h_post), 2 * X + Y),
        "post + residual bwd (read dout, x, y; write dx, dy)": (
            lambda: kernels.stream_mix_bwd(x, h_res, y, h_post, g_out),
            3 * X + 2 * Y,
        ),
        "sinkhorn bwd": (lambda: kernels.sinkhorn_bwd(z_res, dh_res, 20), 3 * z_res.numel() * 4),
        "coefficients + pre-mix bwd (read x twice, dx_acc, dx_in twice; write dx)": (
            lambda: kernels.coefficients_bwd(x, phi, alpha, p, r, h_pre, h_post, None, h_post, dh_res, g_in, g_out),
            4 * X + 2 * Y,
        ),
    }
    rows = []
    for name, (call, nbytes) in calls.items():
        ms = do_bench(call, warmup=25, rep=100, return_mode="median")
        gbps = nbytes / ms / 1e6
        rows.append(dict(kernel=name, ms=ms, bytes_moved=nbytes, gbps=gbps, of_copy=gbps / copy_gbps))
        print(f"  {name:>55} {ms:8.3f} ms {gbps:7.0f} GB/s ({gbps / copy_gbps:4.0%} of copy)", flush=True)
    return rows


# ------------------------------------------------------------------------------ block


def block_table(dims, ns, tokens, repeats=3):
    """Every arm is timed ``repeats`` times, the arms interleaved (plain, mhc, ..., plain, mhc,
    ...), so that a drift of the device's clocks moves every arm alike; the ratio to the plain
    block is the median over the rounds of the ratio within a round, printed with its range."""
    from triton.testing import do_bench

    arms, skipped = _arms()
    rows = []
    for dim in dims:
        for n in ns:
            runs = {}
            for arm in arms:
                torch.manual_seed(0)
                module = wrap(arm, MLP(dim).cuda().to(DTYPE), dim, n)
                shape = (tokens, dim) if arm == "plain" else (tokens, n, dim)
                x = torch.randn(shape, device="cuda", dtype=DTYPE, requires_grad=True)
                w = torch.randn(shape, device="cuda", dtype=DTYPE)
                runs[arm] = (lambda module=module, x=x, w=w: module(x).backward(w)), [x, *module.parameters()]
            times = {arm: [] for arm in arms}
            for _ in range(repeats):
                for arm, (step, grads) in runs.items():
                    times[arm].append(do_bench(step, warmup=50, rep=500, grad_to_none=grads, return_mode="median"))
            for arm, (step, _) in runs.items():
                ratios = sorted(t / p for t, p in zip(times[arm], times["plain"]))
                ms, ratio = statistics.median(times[arm]), statistics.median(ratios)
                peak = peak_extra(step)
                rows.append(
                    dict(
                        dim=dim,
                        n=n,
                        arm=arm,
                        ms=ms,
                        x_plain=ratio,
                        x_plain_min=ratios[0],
                        x_plain_max=ratios[-1],
                        peak_extra_gib=peak / 2**30,
                        note="",
                    )
                )
                print(
                    f"  d={dim:5d} n={n} {arm:>10} {ms:8.3f} ms {ratio:6.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f} "
                    f"over {repeats} rounds)  peak +{peak / 2**30:6.2f} GiB",
                    flush=True,
                )
            del runs
            torch.cuda.empty_cache()
            for arm, reason in skipped.items():
                rows.append(
                    dict(
                        dim=dim,
                        n=n,
                        arm=arm,
                        ms=float("nan"),
                        x_plain=float("nan"),
                        x_plain_min=float("nan"),
                        x_plain_max=float("nan"),
                        peak_extra_gib=float("nan"),
                        note=reason,
                    )
                )
    return rows


# ------------------------------------------------------------------------------ model


MODELS = {
    "1024": dict(dim=1024, layers=8, heads=16, batch=8),
    "4096": dict(dim=4096, layers=2, heads=32, batch=4),
}


class GPT(nn.Module):
    """``ckpt``: layers (an attention and an MLP block each) per activation-checkpoint region
    (:func:`mhc.memory.checkpoint.checkpoint_layers`), ``None`` for none; ``save``: the ``mhc`` ops whose
    outputs a selective policy keeps there (:func:`mhc.memory.checkpoint.checkpoint_policy`)."""

    def __init__(self, arm, vocab=32768, dim=1024, layers=8, heads=16, n=4, ckpt=None, save=()):
        super().__init__()
        self.arm, self.n, self.ckpt = arm, n, ckpt
        self.context_fn = None
        if save:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            self.context_fn = functools.partial(create_selective_checkpoint_contexts, checkpoint_policy(save))
        self.embed = nn.Embedding(vocab, dim).to(DTYPE)
        branches = [b for _ in range(layers) for b in (Attention(dim, heads), MLP(dim))]
        self.blocks = nn.ModuleList(wrap(arm, b.cuda().to(DTYPE), dim, n) for b in branches)
        # the layers as units (checkpoint regions, FSDP2 units); the blocks stay registered once
        self.layers = [nn.Sequential(self.blocks[i], self.blocks[i + 1]) for i in range(0, len(self.blocks), 2)]
        self.norm = nn.RMSNorm(dim).to(DTYPE)
        self.head = nn.Linear(dim, vocab, bias=False).to(DTYPE)

    def _run_layers(self, x):
        if self.ckpt:
            return checkpoint_layers(self.layers, x, every=self.ckpt, context_fn=self.context_fn)
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, tokens, targets):
        h = self.embed(tokens)
        if self.arm == "plain":
            h = self._run_layers(h)
        elif self.arm == "mhc-chain":
            h = reduce_streams(through_sites(self.blocks, expand_streams(h, self.n), chain=True))
        else:
            h = reduce_streams(self._run_layers(expand_streams(h, self.n)))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _static_bytes(model, opt) -> int:
    """Parameters and optimizer state of one model: what its step's peak holds besides activations."""
    tensors = list(model.parameters()) + [
        t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def _recompute_arms(arms, recompute, layers, ckpt=(), ckpt_save=()) -> list:
    """``arms``; for each block length in ``recompute`` (``0``: all sites), the mhc and chained
    arms with their streams recomputed, named ``"<arm> L_r=<every>"``; for each ``k`` in ``ckpt``
    the plain (``k = 1``) and mhc arms with ``k`` layers per checkpoint region, ``"<arm> ckpt=<k>"``;
    for each ``k`` in ``ckpt_save`` the mhc arm whose policy keeps ``mhc_coefficients_fwd``,
    ``"mhc ckpt=<k> save"``."""
    sites = 2 * layers
    extra = [f"{arm} L_r={every or sites}" for arm in ("mhc", "mhc-chain") if arm in arms for every in recompute]
    extra += [f"{arm} ckpt={k}" for arm in ("plain", "mhc") if arm in arms for k in ckpt if arm == "mhc" or k == 1]
    extra += [f"mhc ckpt={k} save" for k in ckpt_save if "mhc" in arms]
    return arms + extra


def _arm_settings(arm: str) -> tuple:
    """``(kind, recompute, ckpt, save)`` of an arm's name (:func:`_recompute_arms`)."""
    kind, _, every = arm.partition(" L_r=")
    kind, _, ckpt = kind.partition(" ckpt=")
    ckpt, _, save = ckpt.partition(" ")
    return (kind, int(every) if every else None, int(ckpt) if ckpt else None, ("mhc_coefficients_fwd",) if save else ())


def _fully_shard(model):
    """FSDP2 on this process alone: fp32 master weights, each block (a site or residual with its
    branch) a unit, then the root, bf16 parameters and fp32 gradient reduction."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model.float()
    policy = MixedPrecisionPolicy(param_dtype=DTYPE, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


MODES = {"eager": None, "compiled": {}, "graphs": dict(mode="reduce-overhead")}  # torch.compile arguments


def training_step(
    arm: str,
    cfg: dict,
    batch: int,
    seq: int,
    mode: str = "eager",
    recompute: int | None = None,
    ckpt: int | None = None,
    fsdp: bool = False,
    save: tuple = (),
):
    """``(step, model, optimizer)``: one AdamW training step of the GPT ``arm`` (seed 0) on random
    tokens ``[batch, seq]``, run in ``mode`` (a key of :data:`MODES`), with
    :func:`mhc.memory.recompute.recompute_streams` at block length ``recompute`` if given, ``ckpt``
    layers per checkpoint region if given (``save``: the ``mhc`` ops a selective policy keeps
    there), and FSDP2 on this process (``fsdp``)."""
    torch.manual_seed(0)
    model = GPT(arm, dim=cfg["dim"], layers=cfg["layers"], heads=cfg["heads"], ckpt=ckpt, save=save).cuda()
    if recompute:
        recompute_streams(model, recompute)
    if fsdp:
        model = _fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    run = model if MODES[mode] is None else torch.compile(model, **MODES[mode])
    tokens = torch.randint(0, 32768, (batch, seq), device="cuda")
    targets = torch.randint(0, 32768, (batch, seq), device="cuda")

    def step():
        run(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model, opt


def model_table(configs, seq, modes, only=None, repeats=3, recompute=(), batch=None, ckpt=(), fsdp=False, ckpt_save=()):
    """Every arm of a configuration is built first, then timed ``repeats`` times, interleaved
    (plain, mhc, ..., plain, mhc, ...); the ratio to the plain model is the median of the
    within-round ratios. Peak memory: the arm's own parameters and optimizer state plus the peak
    of one step (the other arms' models are resident meanwhile and not counted). ``recompute``:
    block lengths of :func:`mhc.memory.recompute.recompute_streams` to add as arms. ``modes``: names in
    :data:`MODES` (``"graphs"``: ``torch.compile(mode="reduce-overhead")``, CUDA graphs). ``batch``:
    sequences per step instead of the configuration's. ``ckpt``: layers per checkpoint region to
    add as arms (plain with 1, mhc with each); ``ckpt_save``: the same for mhc with a selective policy
    that keeps the coefficients. ``fsdp``: every arm under FSDP2 on this process."""
    from triton.testing import do_bench

    available, skipped = _arms()
    base = [
        arm
        for arm in ["plain", "mhc", "mhc-chain", "mhc-torch", "liger"]
        if arm in available + ["mhc-chain"] and (only is None or arm in only)
    ]
    rows = []
    for config in configs:
        cfg = MODELS[config]
        batch_size = batch or cfg["batch"]
        tokens_per_step = batch_size * seq
        arms = _recompute_arms(base, recompute, cfg["layers"], ckpt, ckpt_save)
        for name in modes:
            compiled = MODES[name] is not None
            # every model instance recompiles the same forward: past Dynamo's limit of recompiles
            # (8 by default) a later arm would silently run eager; the arms of earlier tables are gone
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(arms))
            runs = {}
            for arm in arms:
                if compiled and arm == "liger":  # 90 s to compile and not among the compiled targets
                    continue
                kind, every, k, save = _arm_settings(arm)
                step, model, opt = training_step(kind, cfg, batch_size, seq, name, every, k, fsdp, save)
                t0 = time.perf_counter()
                try:
                    step()
                    torch.cuda.synchronize()
                    runs[arm] = (step, model, opt, time.perf_counter() - t0, "")
                except Exception as e:  # a peer that cannot run is reported, not hidden
                    runs[arm] = (None, model, opt, float("nan"), f"failed: {type(e).__name__}: {e}"[:200])
            times = {arm: [] for arm in runs}
            for _ in range(repeats):
                for arm, (step, *_rest) in runs.items():
                    times[arm].append(
                        do_bench(step, warmup=50, rep=300, return_mode="median") if step else float("nan")
                    )
            peaks, step_peaks = {}, {}
            for arm, (step, model, opt, _, _) in runs.items():
                if step is None:
                    peaks[arm] = step_peaks[arm] = float("nan")
                    continue
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                step_peaks[arm] = (torch.cuda.max_memory_allocated() - before) / 2**30
                peaks[arm] = step_peaks[arm] + _static_bytes(model, opt) / 2**30
            for arm, (step, model, opt, first, note) in runs.items():
                ratios = sorted(t / p for t, p in zip(times[arm], times["plain"]))
                ms = statistics.median(times[arm])
                ratio = statistics.median(ratios)
                rows.append(
                    dict(
                        model=f"d={cfg['dim']} L={cfg['layers']} B={batch_size}" + (" fsdp2" if fsdp else ""),
                        tokens=tokens_per_step,
                        mode=name,
                        arm=arm,
                        ms=ms,
                        tokens_per_s=tokens_per_step / ms * 1e3,
                        x_plain=ratio,
                        x_plain_min=ratios[0],
                        x_plain_max=ratios[-1],
                        peak_gib=peaks[arm],
                        peak_x_plain=peaks[arm] / peaks["plain"],
                        step_peak_gib=step_peaks[arm],
                        first_step_s=first,
                        note=note,
                    )
                )
                print(
                    f"  d={cfg['dim']:5d} {tokens_per_step:6d} tok {name:>8} {arm:>16} {ms:8.2f} ms "
                    f"{tokens_per_step / ms:7.0f}k tok/s {ratio:5.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f}) "
                    f"peak {peaks[arm]:6.2f} GiB ({peaks[arm] / peaks['plain']:4.2f}x) "
                    f"step peak {step_peaks[arm]:6.2f} GiB  first step {first:5.1f} s "
                    f"{note}",
                    flush=True,
                )
            del runs
            torch.cuda.empty_cache()
    for arm, reason in skipped.items():
        rows.append(
            dict(
                model="",
                tokens=0,
                mode="",
                arm=arm,
                ms=float("nan"),
                tokens_per_s=float("nan"),
                x_plain=float("nan"),
                x_plain_min=float("nan"),
                x_plain_max=float("nan"),
                peak_gib=float("nan"),
                peak_x_plain=float("nan"),
                step_peak_gib=float("nan"),
                first_step_s=float("nan"),
                note=reason,
            )
        )
    return rows


# ------------------------------------------------------------------------------ profile


def profile_block(dim, n, tokens, rows_shown):
    from torch.profiler import ProfilerActivity, profile

    module = wrap("mhc", MLP(dim).cuda().to(DTYPE), dim, n)
    x = torch.randn(tokens, n, dim, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.randn_like(x)
    for _ in range(3):
        module(x).backward(w)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            module(x).backward(w)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows_shown)


def copy_bandwidth() -> float:
    """GB/s of a large device copy, bytes read plus written."""
    from triton.testing import do_bench

    a = torch.empty(2**28, device="cuda", dtype=torch.float32)
    ms = do_bench(lambda: a.clone(), warmup=25, rep=100, return_mode="median")
    return 2 * a.numel() * 4 / ms / 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    p.add_argument("--streams", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=3, help="block table: interleaved rounds of every arm")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--tables",
        nargs="+",
        default=["kernels", "block", "model", "profile"],
        choices=["kernels", "block", "model", "profile"],
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["eager", "compiled"],
        choices=sorted(MODES),
        help="model table: eager, torch.compile, torch.compile(mode='reduce-overhead') (CUDA graphs)",
    )
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[None],
        help="model table: sequences per step (default: the configuration's); several: one table each",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=None,
        choices=["plain", "mhc", "mhc-chain", "mhc-torch", "liger"],
        help="model table: only these arms (default: all)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["1024", "4096"],
        choices=sorted(MODELS),
        help="model table: the GPT configurations (by width)",
    )
    p.add_argument(
        "--recompute",
        type=int,
        nargs="*",
        default=[],
        help="model table: also the mhc arms with recompute_streams at these block lengths (0: all sites)",
    )
    p.add_argument(
        "--ckpt",
        type=int,
        nargs="*",
        default=[],
        help="model table: also plain (1) and mhc arms with this many layers per checkpoint region",
    )
    p.add_argument(
        "--ckpt-save",
        type=int,
        nargs="*",
        default=[],
        help="model table: also mhc arms with this many layers per region and a selective policy that "
        "keeps mhc_coefficients_fwd",
    )
    p.add_argument(
        "--fsdp", action="store_true", help="model table: every arm under FSDP2 (one process, a unit per block)"
    )
    p.add_argument("--out-dir", default="results/mixing")
    p.add_argument("--profile-rows", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.mixing needs a CUDA GPU")
    os.makedirs(args.out_dir, exist_ok=True)
    copy_gbps = copy_bandwidth()
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, forward+backward; "
        f"device copy {copy_gbps:.0f} GB/s",
        flush=True,
    )
    if "kernels" in args.tables:
        rows = []
        for dim in args.dims:
            for n in args.streams:
                print(f"## kernels: d={dim}, n={n}, tokens", args.tokens, flush=True)
                rows += [dict(dim=dim, n=n, **row) for row in kernel_table(dim, n, args.tokens, copy_gbps)]
        write_csv(rows, f"{args.out_dir}/kernels.csv", ["dim", "n", "kernel", "ms", "bytes_moved", "gbps", "of_copy"])
    if "block" in args.tables:
        print("## block: MLP, tokens", args.tokens, flush=True)
        rows = block_table(args.dims, args.streams, args.tokens, args.repeats)
        write_csv(
            rows,
            f"{args.out_dir}/block.csv",
            ["dim", "n", "arm", "ms", "x_plain", "x_plain_min", "x_plain_max", "peak_extra_gib", "note"],
        )
    if "model" in args.tables:
        print(
            f"## model: GPTs {args.models}, sequences of {args.seq}, AdamW step, {args.repeats} interleaved rounds",
            flush=True,
        )
        rows = [
            row
            for batch in args.batch
            for row in model_table(
                args.models,
                args.seq,
                args.modes,
                args.arms,
                args.repeats,
                args.recompute,
                batch,
                args.ckpt,
                args.fsdp,
                args.ckpt_save,
            )
        ]
        write_csv(
            rows,
            f"{args.out_dir}/model.csv",
            [
                "model",
                "tokens",
                "mode",
                "arm",
                "ms",
                "tokens_per_s",
                "x_plain",
                "x_plain_min",
                "x_plain_max",
                "peak_gib",
                "peak_x_plain",
                "step_peak_gib",
                "first_step_s",
                "note",
            ],
        )
    if "profile" in args.tables:
        table = profile_block(4096, 4, args.tokens, args.profile_rows)
        print(table, flush=True)
        with open(f"{args.out_dir}/profile.txt", "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
