"""Where a GPT training step's GPU time goes: CUDA kernel time per step by kernel, for the plain
and the mHC arms of ``bench/mixing.py``'s GPT, eager and compiled.

    python -m bench.profile_model [--model 4096] [--arms plain mhc] [--steps 3] [--rows 45] [--out profile_model.txt]

Each arm runs 5 steps, then ``--steps`` steps under ``torch.profiler``; the table lists the
kernels with the most time per step (ms) and how often each runs per step. Comparing the arms'
tables shows what the hyper-connections add besides their own kernels (copies, lost fusions).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from bench import mixing as gpt


def kernel_times(arm: str, config: dict, compiled: bool, steps: int, seq: int = 2048):
    """``(ms per step, calls per step)`` of every CUDA kernel of one arm's training step."""
    step, _, _ = gpt.training_step(arm, config, config["batch"], seq, "compiled" if compiled else "eager")

    for _ in range(5):
        step()
    return device_times(step, steps)


def device_times(call, reps: int):
    """``(ms per call, launches per call)`` of every CUDA kernel that ``call`` launches, over
    ``reps`` calls under ``torch.profiler`` (warm ``call`` up first)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    ms, calls = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            ms[event.key] += event.self_device_time_total / reps / 1e3
            calls[event.key] += event.count / reps
    return ms, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="4096", choices=sorted(gpt.MODELS))
    p.add_argument("--arms", nargs="+", default=["plain", "mhc"], choices=["plain", "mhc", "mhc-chain"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=45)
    p.add_argument("--out", default="profile_model.txt")
    args = p.parse_args()
    lines = [
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, GPT {args.model}: "
        f"{gpt.MODELS[args.model]}, CUDA kernel time per step over {args.steps} profiled steps"
    ]
    for compiled in (False, True):
        for arm in args.arms:
            ms, calls = kernel_times(arm, gpt.MODELS[args.model], compiled, args.steps)
            lines.append(f"== {'compiled' if compiled else 'eager'} {arm}: {sum(ms.values()):.2f} ms per step")
            lines += [f"  {t:8.3f} ms  {calls[k]:5.1f}x  {k[:110]}" for k, t in ms.most_common(args.rows)]
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
