"""Weak scaling of a GPT with plain residuals and with mhc hyper-connections under FSDP2: the same
tokens per GPU on 1 and on N GPUs, several runs each.

    python -m bench.weak_scaling --gpus 1 2 --tokens 8192 16384 --runs 5 --out results/scaling [--compile]

The driver launches one ``torchrun`` job per (tokens, GPUs); a job builds each arm's model afresh
for every run, the arms interleaved within a run, and times it. The driver writes ``scaling.csv``
and ``scaling.md`` (per-run step times, and the N-GPU step over the 1-GPU step of the same run);
the CSV also holds the host's median time to issue a step (``step()`` returned, before the device
sync): a step issued in about its wall time is bound by the host. ``--pin K`` pins rank ``r`` to
the ``r``-th ``K`` of the cores the job may use. Below the table, each arm's efficiency (median
over runs of the 1-GPU step over the N-GPU step) and, for the arms after the first, the
difference to the first arm's with a 90% bootstrap interval over the runs: single runs of a
host-bound step spread by many points, and the interval says how far the medians can be trusted.

    python -m bench.weak_scaling --summarize a/scaling.csv b/scaling.csv   # the same over saved runs

``--profile`` adds a torch.profiler trace summary of each arm's step on the largest GPU count
(``profile_<arm>.txt``): GPU busy time against step time, and how long the host takes to issue a
step.

The model (issue-sized): d = 2048, 8 layers (16 sites), 16 heads, n = 4 streams, sequences of
2048 tokens, fp32 master weights, FSDP2 ``fully_shard`` per layer and at the root with
``MixedPrecisionPolicy(bf16, fp32)``, AdamW; 3 warm-up steps, then 10 timed steps (synchronised
wall time each). Arms: ``plain``, ``mhc`` (every site called as a module) and ``mhc-chain`` (the
two sites of a layer joined by ``finish(y, next=...)``; FSDP2 gathers a layer's parameters once
for both). ``--compile`` compiles each layer before sharding it (``layer.compile(dynamic=False)``,
as torchtitan does), every arm alike; ``--cpp-wrapper`` also sets Inductor's ``cpp_wrapper`` (the
compiled graphs launch their kernels from C++).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.mixing import MLP, Attention

ARMS = ("plain", "mhc", "mhc-chain")
SEQ = 2048
# NVLink multicast stays off (shared machines): every process started here inherits these
SAFE_ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


class Layer(nn.Module):
    """Attention and MLP, on a plain residual or on two hyper-connection sites (one FSDP2 unit)."""

    def __init__(self, arm, dim, heads, n):
        super().__init__()
        from mhc.mixing import HyperConnection

        self.arm = arm
        if arm == "plain":
            self.attn, self.mlp = Attention(dim, heads), MLP(dim)
        else:
            self.attn = HyperConnection(dim, n, Attention(dim, heads), init="zero")
            self.mlp = HyperConnection(dim, n, MLP(dim), init="zero")

    def forward(self, x):
        if self.arm == "plain":
            x = x + self.attn(x)
            return x + self.mlp(x)
        if self.arm == "mhc":
            return self.mlp(self.attn(x))
        x_in, finish = self.attn.split(x)
        x_in, finish = finish(self.attn.branch(x_in), next=self.mlp)
        return finish(self.mlp.branch(x_in))


class GPT(nn.Module):
    def __init__(self, arm, vocab=32768, dim=2048, layers=8, heads=16, n=4):
        super().__init__()
        self.arm, self.n = arm, n
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(arm, dim, heads, n) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets):
        from mhc.mixing import expand_streams, reduce_streams

        h = self.embed(tokens)
        x = h if self.arm == "plain" else expand_streams(h, self.n)
        for layer in self.layers:
            x = layer(x)
        h = x if self.arm == "plain" else reduce_streams(x)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ------------------------------------------------------------------------------ worker (one torchrun job)


def worker(args):
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.pin:  # each rank on its own cores: a host-bound step then moves less with the scheduler
        if not hasattr(os, "sched_setaffinity"):
            raise SystemExit("--pin needs os.sched_setaffinity (Linux)")
        cores = sorted(os.sched_getaffinity(0))[local * args.pin : (local + 1) * args.pin]
        if len(cores) < args.pin:
            raise SystemExit(f"--pin {args.pin}: rank {local} finds {len(cores)} of the cores it may use left")
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(args.pin)  # no more intra-op threads than the rank's cores
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        sync = torch.cuda.synchronize
    else:  # the script's own test: gloo on the CPU, a small model
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        sync = lambda device: None  # noqa: E731
    results = []
    for run in range(args.runs):
        for arm in args.arms:
            times, issues, peak, summary = _run(arm, args, device, rank, sync)
            results.append(
                dict(run=run, arm=arm, times=times, issues=issues, peak_gib=peak, profile=summary, graphs=_graphs(),
                     cores=_usable_cores())
            )  # fmt: skip
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _usable_cores() -> int:
    """How many cores this process may run on (all of the machine's where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _graphs() -> int:
    """Graphs compiled so far in this process (a layer over the recompile limit would run eager)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _run(arm, args, device, rank, sync):
    """Build ``arm``'s model on the device, shard it, time ``args.steps`` steps after warm-up."""
    from torch._inductor import config as inductor_config
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    with device:
        model = GPT(arm, dim=args.dim, layers=args.layers, heads=args.heads)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    inductor_config.cpp_wrapper = args.cpp_wrapper
    for layer in model.layers:
        if args.compile:
            layer.compile(dynamic=False)  # one static graph per arm (the arms share the code)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator(device=device).manual_seed(1 + rank)
    tokens = torch.randint(0, 32768, (args.tokens[0] // args.seq, args.seq + 1), device=device, generator=g)

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # the previous arm's model is garbage in reference cycles (modules and FSDP2's hooks): collect
    # it now rather than inside a timed step, where a collection would stall the host
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, issues = [], []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        issued = time.perf_counter()
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            issues.append((issued - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    summary = _profile(step, device, sync) if args.profile else None
    model = opt = step = None  # drop the arm before collecting
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times, issues, peak, summary


def _profile(step, device, sync):
    """GPU busy time, step time and the host's time to issue a step, over 3 profiled steps (every
    rank profiles, as every rank runs the collectives; rank 0 reports)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        issued = time.perf_counter()
        sync(device)
    done = time.perf_counter()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels)
    comm = sum(e.device_time for e in kernels if "nccl" in e.name.lower())
    top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return dict(
        step_ms=(done - t0) / 3 * 1e3,
        host_issue_ms=(issued - t0) / 3 * 1e3,
        gpu_busy_ms=busy / 3e3,
        nccl_ms=comm / 3e3,
        top_cpu=top,
    )


# ------------------------------------------------------------------------------ driver


def launch(arms, runs, gpus, tokens, args, profile=False):
    """One torchrun job: ``runs`` rounds of every arm on ``gpus`` GPUs; its per-run results."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    sizes = dict(runs=runs, tokens=tokens, steps=args.steps, warmup=args.warmup, dim=args.dim)
    sizes.update(layers=args.layers, heads=args.heads, seq=args.seq, pin=args.pin)
    flags = dict(profile=profile, compile=args.compile, cpp_wrapper=args.cpp_wrapper)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    cmd += ["-m", "bench.weak_scaling", "--worker", "--arms", *arms, "--result", result]
    cmd += [arg for name, value in sizes.items() for arg in (f"--{name}", str(value))]
    cmd += [f"--{name.replace('_', '-')}" for name, on in flags.items() if on]
    env = {**os.environ, **SAFE_ENV}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"{arms} on {gpus} GPU(s) failed")
    with open(result) as f:
        return json.load(f)


def driver(args):
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for tokens in args.tokens:
        for gpus in args.gpus:
            for r in launch(args.arms, args.runs, gpus, tokens, args):
                ms = statistics.median(r["times"])
                rows.append(
                    dict(
                        run=r["run"],
                        tokens_per_gpu=tokens,
                        arm=r["arm"],
                        gpus=gpus,
                        step_ms=ms,
                        step_ms_min=min(r["times"]),
                        step_ms_max=max(r["times"]),
                        host_issue_ms=statistics.median(r["issues"]),
                        host_cores=r["cores"],
                        peak_gib=r["peak_gib"],
                        graphs=r.get("graphs", 0),
                    )
                )
                print(
                    f"  run {r['run']} tokens/GPU {tokens:6d} {r['arm']:>9} {gpus} GPU(s): {ms:8.2f} ms "
                    f"({min(r['times']):.2f}-{max(r['times']):.2f}), "
                    f"host issue {statistics.median(r['issues']):.2f} ms, peak {r['peak_gib']:.2f} GiB, "
                    f"{r.get('graphs', 0)} graphs compiled",
                    flush=True,
                )
    with open(os.path.join(args.out, "scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "| tokens per GPU | arm | "
        + " | ".join(f"{g} GPU(s), ms" for g in args.gpus)
        + " | "
        + " | ".join(f"{g} / {args.gpus[0]} GPU" for g in args.gpus[1:])
        + " |",
        "| --- " * (2 + 2 * len(args.gpus) - 1) + "|",
    ]
    for tokens in args.tokens:
        for arm in args.arms:
            cells, ratios = [], []
            for g in args.gpus:
                ms = [r["step_ms"] for r in rows if (r["tokens_per_gpu"], r["arm"], r["gpus"]) == (tokens, arm, g)]
                cells.append(", ".join(f"{v:.1f}" for v in ms))
            base = [
                r["step_ms"] for r in rows if (r["tokens_per_gpu"], r["arm"], r["gpus"]) == (tokens, arm, args.gpus[0])
            ]
            for g in args.gpus[1:]:
                ms = [r["step_ms"] for r in rows if (r["tokens_per_gpu"], r["arm"], r["gpus"]) == (tokens, arm, g)]
                ratios.append(", ".join(f"{m / b:.3f}" for m, b in zip(ms, base)))
            lines.append(f"| {tokens} | {arm} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    table = "\n".join(lines + [""] + efficiency_summary(rows, args.arms))
    print(table)
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(table + "\n")
    if args.profile:
        for arm, r in (
            (r["arm"], r["profile"]) for r in launch(args.arms, 1, max(args.gpus), args.tokens[0], args, True)
        ):
            text = (
                f"{arm}, {max(args.gpus)} GPUs, {args.tokens[0]} tokens per GPU: step {r['step_ms']:.2f} ms, "
                f"host issues a step in {r['host_issue_ms']:.2f} ms, GPU busy {r['gpu_busy_ms']:.2f} ms "
                f"(NCCL {r['nccl_ms']:.2f} ms)\n" + r["top_cpu"]
            )
            print(text.splitlines()[0], flush=True)
            with open(os.path.join(args.out, f"profile_{arm}.txt"), "w") as f:
                f.write(text)


def efficiency_summary(rows, arms, resamples: int = 10000, seed: int = 0) -> list[str]:
    """One line per token count and GPU count above the fewest: each arm's efficiency (median over
    runs of the fewest-GPU step over this count's, in %) and, for the arms after the first, the
    difference to the first arm's over the runs that have both, with a 90% bootstrap interval
    (runs resampled with their arms together: the arms of a run share its host). ``rows``: dicts
    with ``run``, ``tokens_per_gpu``, ``arm``, ``gpus``, ``step_ms`` and optionally ``source``
    (runs of different files kept apart)."""
    steps = {}
    for r in rows:
        run = (r.get("source", 0), int(r["run"]))
        steps[int(r["tokens_per_gpu"]), run, r["arm"], int(r["gpus"])] = float(r["step_ms"])
    rng, lines = random.Random(seed), []
    for tokens in sorted({key[0] for key in steps}):
        counts = sorted({key[3] for key in steps if key[0] == tokens})
        for g in counts[1:]:
            ratio = {}  # arm -> {run: efficiency}
            for t, run, arm, n in steps:
                if (t, n) == (tokens, g) and (tokens, run, arm, counts[0]) in steps:
                    ratio.setdefault(arm, {})[run] = steps[tokens, run, arm, counts[0]] / steps[tokens, run, arm, g]
            present = [a for a in arms if a in ratio]
            if not present:
                continue
            cells = []
            for a in present:
                cell = f"{a} {100 * statistics.median(ratio[a].values()):.1f}% ({len(ratio[a])} runs)"
                paired = sorted(set(ratio[a]) & set(ratio.get(arms[0], {}))) if a != arms[0] else []
                if paired:
                    mine, base = [ratio[a][r] for r in paired], [ratio[arms[0]][r] for r in paired]
                    low, high = _bootstrap_difference(mine, base, resamples, rng)
                    diff = 100 * (statistics.median(mine) - statistics.median(base))
                    cell += f", {diff:+.1f} points over its runs, 90% interval {100 * low:+.1f} .. {100 * high:+.1f}"
                cells.append(cell)
            lines.append(f"{tokens} tokens per GPU, {counts[0]} -> {g} GPUs: " + "; ".join(cells))
    return lines


def _bootstrap_difference(a: list, b: list, resamples: int, rng) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``median(a) - median(b)`` over runs drawn with replacement
    (the same runs for both)."""
    n = len(a)
    diffs = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        diffs.append(statistics.median(a[i] for i in pick) - statistics.median(b[i] for i in pick))
    diffs.sort()
    return diffs[int(0.05 * resamples)], diffs[min(resamples - 1, int(0.95 * resamples))]


def summarize(paths) -> list[str]:
    """:func:`efficiency_summary` over saved ``scaling.csv`` files (each file's runs kept apart),
    the arms in the order the files first name them (the first is the reference)."""
    rows = []
    for source, path in enumerate(paths):
        with open(path, newline="") as f:
            rows += [dict(r, source=source) for r in csv.DictReader(f)]
    if not rows:
        raise ValueError(f"no rows in {list(paths)}")
    return efficiency_summary(rows, list(dict.fromkeys(r["arm"] for r in rows)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="tokens per GPU (multiples of 2048)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--compile", action="store_true", help="compile each layer before sharding it")
    p.add_argument("--cpp-wrapper", action="store_true", help="with --compile: Inductor's cpp_wrapper")
    p.add_argument("--pin", type=int, default=0, help="pin rank r to the r-th PIN of the usable cores (0: none)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--out", default="results/scaling")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--summarize", nargs="+", metavar="CSV", help="the efficiency summary of saved scaling.csv files")
    args = p.parse_args(argv)
    if args.summarize:
        print("\n".join(summarize(args.summarize)))
        return
    if args.pin < 0:
        p.error("--pin takes a core count >= 0")
    if any(t % args.seq for t in args.tokens):
        p.error(f"--tokens must be multiples of --seq ({args.seq})")
    if not args.worker and torch.cuda.is_available() and max(args.gpus) > torch.cuda.device_count():
        p.error(f"--gpus {max(args.gpus)}: this machine has {torch.cuda.device_count()} GPU(s), one per process")
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
