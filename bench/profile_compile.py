"""Where the first compiled step's time goes (compile time): ``cProfile`` of ``torch.compile``'s first
training step of ``bench/mixing.py``'s GPT, one arm.

    python -m bench.profile_compile [--arm mhc] [--model 1024] [--batch 2] [--seq 1024]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from bench import mixing as gpt


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arm", default="mhc")
    p.add_argument("--model", default="1024", choices=sorted(gpt.MODELS))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rows", type=int, default=40)
    args = p.parse_args()
    cfg = gpt.MODELS[args.model]
    step, _, _ = gpt.training_step(args.arm, cfg, args.batch, args.seq, "compiled")
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    step()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"## {args.arm}: first compiled step {time.perf_counter() - t0:.1f} s (profiled)")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.rows)
    print(text.getvalue())


if __name__ == "__main__":
    main()
