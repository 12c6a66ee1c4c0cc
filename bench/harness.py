"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import csv
import os
import sys

import torch


def peak_extra(fn) -> int:
    """Bytes allocated at peak by ``fn()`` beyond what was live before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def through_sites(sites, x, chain: bool):
    """The streams ``x`` through hyper-connection ``sites`` (each around its own ``branch``),
    called one by one or chained (``finish(y, next=)``)."""
    if not chain:
        for site in sites:
            x = site(x)
        return x
    x_in, finish = sites[0].split(x)
    for site, nxt in zip(sites, list(sites[1:]) + [None]):
        y = site.branch(x_in)
        if nxt is None:
            return finish(y)
        x_in, finish = finish(y, next=nxt)


def write_csv(rows: list[dict], path: str, fields: list[str]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def dev_tool_args(doc: str, sections, argv=None) -> list[str]:
    """The arguments of a GPU development tool run as ``python -m bench.<tool> [section ...]``
    (``bench.tune_mixing``, ``bench.tune_sinkhorn``): ``-h`` / ``--help`` prints ``doc``; an
    argument whose name (before any ``=``) is not in ``sections``, or a machine without CUDA,
    stops the tool with a message instead of a traceback."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in args):
        print(doc)
        raise SystemExit(0)
    unknown = [a for a in args if a.split("=", 1)[0] not in sections]
    if unknown:
        raise SystemExit(f"unknown argument(s) {unknown}; this tool takes {', '.join(sections)} (--help)")
    if not torch.cuda.is_available():
        raise SystemExit("this tool times kernels on a CUDA GPU, and PyTorch finds none here")
    return args
