"""Where the eager GPT step's time over plain goes at small token counts:
``examples/benchmark_mixing.py``'s GPT, plain and with ``HyperConnection`` sites, and two arms of
the same sites whose values are garbage and whose times split the difference:

- ``mhc-no-kernels``: the launchers do all their host work but launch nothing
  (``scripts/host_model.py``'s ``fake_launch``: the launch key and the cache lookup, not the
  compiled kernel's launcher);
- ``mhc-floor``: every launcher reduced to allocating its outputs (``OutputsOnly``: no launch
  plan, no partial buffers). What remains is the rest of a site's host work: its Python, the
  two autograd Functions and their nodes, the saved tensors, the parameters' gradient
  accumulation and their share of AdamW: the floor of the site's structure on this host.

    taskset -c 5 python scripts/eager_floor.py [--model 1024] [--batch 1 2 4] [--seq 1024] [--repeats 5]

Arms are interleaved within each round (``triton.testing.do_bench`` medians); each ratio is the
median of the within-round ratios against plain. ``--time-launchers``: then the host time of each
launcher of a site inside the model's eager step (``time.perf_counter`` around each call, launches
included), against what ``scripts/launch_host.py`` measures for them on their own.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import benchmark_mixing as bench  # noqa: E402
from host_model import faked_launches, outputs_only_launchers  # noqa: E402


def arms(cfg: dict, batch: int, seq: int) -> dict:
    """``{name: step}``: plain, mhc, mhc launching nothing, mhc with its launchers reduced to
    allocations."""
    plain, _, _ = bench.training_step("plain", cfg, batch, seq)
    mhc, _, _ = bench.training_step("mhc", cfg, batch, seq)
    mhc()  # fills the launch cache, which the next arm looks its kernels up in
    no_kernels_step, _, _ = bench.training_step("mhc", cfg, batch, seq)
    floor_step, _, _ = bench.training_step("mhc", cfg, batch, seq)
    with outputs_only_launchers() as stub:  # its first step takes the outputs' shapes from real launches
        floor_step()

    def no_kernels():
        with faked_launches():
            no_kernels_step()

    def floor():
        with outputs_only_launchers(stub):
            floor_step()

    return {"plain": plain, "mhc": mhc, "mhc-no-kernels": no_kernels, "mhc-floor": floor}


@contextlib.contextmanager
def timed_launchers(totals: collections.Counter):
    """Inside, each eager launcher of a site adds its host time (ns) to ``totals[name]``."""
    from mhc import mixing_ops

    launchers = mixing_ops._launchers()
    saved = dict(vars(launchers)), mixing_ops.sinkhorn_bwd_launch

    def timed(name, fn):
        def call(*args):
            t0 = time.perf_counter_ns()
            out = fn(*args)
            totals[name] += time.perf_counter_ns() - t0
            return out

        return call

    for name, fn in saved[0].items():
        setattr(launchers, name, timed(name, fn))
    mixing_ops.sinkhorn_bwd_launch = timed("sinkhorn_bwd", saved[1])
    try:
        yield
    finally:
        for name, fn in saved[0].items():
            setattr(launchers, name, fn)
        mixing_ops.sinkhorn_bwd_launch = saved[1]


def launcher_times(cfg: dict, batch: int, seq: int, steps: int = 50) -> None:
    step, _, _ = bench.training_step("mhc", cfg, batch, seq)
    for _ in range(10):
        step()
    totals = collections.Counter()
    with timed_launchers(totals):
        for _ in range(steps):
            step()
    torch.cuda.synchronize()
    per_site = steps * 2 * cfg["layers"]
    print(f"  {batch * seq:6d} tokens, each launcher's host time per site inside the eager step:")
    for name, ns in totals.most_common():
        print(f"    {name:>22} {ns / per_site / 1e3:7.1f} us")
    print(f"    {'all':>22} {sum(totals.values()) / per_site / 1e3:7.1f} us", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1024", choices=sorted(bench.MODELS))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-launchers", action="store_true")
    args = p.parse_args()
    cfg = bench.MODELS[args.model]
    sites = 2 * cfg["layers"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPT d = {cfg['dim']}, {sites} sites, eager")
    for batch in args.batch:
        steps = arms(cfg, batch, args.seq)
        times = {name: [] for name in steps}
        for _ in range(args.repeats):
            for name, step in steps.items():
                times[name].append(do_bench(step, warmup=50, rep=300, return_mode="median"))
        plain = statistics.median(times["plain"])
        for name, ts in times.items():
            ratios = sorted(t / q for t, q in zip(ts, times["plain"]))
            ms = statistics.median(ts)
            print(
                f"  {batch * args.seq:6d} tokens {name:>14} {ms:7.2f} ms {statistics.median(ratios):6.3f}x "
                f"({ratios[0]:.3f}-{ratios[-1]:.3f}); per site {(ms - plain) / sites * 1e3:6.1f} us over plain",
                flush=True,
            )
        del steps
        torch.cuda.empty_cache()
        if args.time_launchers:
            launcher_times(cfg, batch, args.seq)


if __name__ == "__main__":
    main()
