"""Where a training step's host time goes: ``cProfile`` over steps of ``bench/mixing.py``'s
GPT, one arm at a time; the functions with the most own time per step, and the kernels and
launches per step (``torch.profiler``).

    python -m bench.profile_host [--model 1024] [--batch 2] [--seq 1024] [--arms plain mhc mhc-chain]
                                   [--mode eager|compiled]

``--mode compiled`` profiles the step of ``torch.compile(model)`` (after its first, compiling,
step): what the generated code's launches and the optimizer cost on the host.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench import mixing as gpt


def launches_per_step(step, steps: int) -> tuple[float, list]:
    """``(kernels per step, [(host-side event, calls per step, host us per step)])``: the CUDA
    kernels one step runs, and the host events that launch them or run between them."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels, host = 0, collections.Counter()
    calls = collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += event.count
        elif event.device_type == torch.autograd.DeviceType.CPU:
            host[event.key] += event.self_cpu_time_total / steps
            calls[event.key] += event.count / steps
    top = sorted(host, key=host.get, reverse=True)[:25]
    return kernels / steps, [(key, calls[key], host[key]) for key in top]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1024", choices=sorted(gpt.MODELS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--arms", nargs="+", default=["plain", "mhc", "mhc-chain"])
    p.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=35)
    args = p.parse_args()
    cfg = gpt.MODELS[args.model]
    for arm in args.arms:
        torch._dynamo.reset()
        step, _, _ = gpt.training_step(arm, cfg, args.batch, args.seq, args.mode)
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.rows)
        kernels, host = launches_per_step(step, 5)
        print(
            f"## {arm}, {args.mode}: {wall:.2f} ms per step unprofiled; {kernels:.0f} kernels per step; "
            f"cProfile over {args.steps} steps (tottime)"
        )
        print(text.getvalue())
        print(f"### {arm}, {args.mode}: host events per step (torch.profiler, self time)")
        for key, count, us in host:
            print(f"{us:9.1f} us {count:7.1f} x  {key[:110]}")
        print()


if __name__ == "__main__":
    main()
