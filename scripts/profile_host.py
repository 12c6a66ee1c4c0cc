"""Where a training step's host time goes: ``cProfile`` over steps of ``examples/benchmark_mixing.py``'s
GPT, one arm at a time, eager; the functions with the most own time per step.

    python scripts/profile_host.py [--model 1024] [--batch 2] [--seq 1024] [--arms plain mhc mhc-chain]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import benchmark_mixing as bench  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="1024", choices=sorted(bench.MODELS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--arms", nargs="+", default=["plain", "mhc", "mhc-chain"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=35)
    args = p.parse_args()
    cfg = bench.MODELS[args.model]
    for arm in args.arms:
        step, _, _ = bench.training_step(arm, cfg, args.batch, args.seq)
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
        print(f"## {arm}: {wall:.2f} ms per step unprofiled; cProfile over {args.steps} steps (tottime)")
        print(text.getvalue())


if __name__ == "__main__":
    main()
