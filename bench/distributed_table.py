"""Markdown table of toy LM runs (examples/train_toy_lm.py logs) against a reference run.

    python -m bench.distributed_table REFERENCE_DIR RUN_DIR [RUN_DIR ...] [--arm mhc] [--skip 20]

Per run: processes (from its run.json), final train and validation loss, the largest per-step
train-loss difference to the reference run (same steps), tokens/s (median of the logged
intervals after the first ``--skip`` steps: compilation and warm-up excluded), tokens/s per GPU,
and peak memory of rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(run: Path, arm: str):
    records = [json.loads(line) for line in open(run / f"{arm}_seed0.jsonl")]
    meta = json.loads((run / "run.json").read_text())
    return records, meta


def row(name: str, records, meta, reference, skip: int) -> str:
    world = meta.get("world_size", 1)
    ref_loss = {r["step"]: r["train_loss"] for r in reference}
    diffs = [abs(r["train_loss"] - ref_loss[r["step"]]) for r in records if r["step"] in ref_loss]
    speed = statistics.median(r["tokens_per_s"] for r in records if r["step"] > skip)
    val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), float("nan"))
    return (
        f"| {name} | {world} | {records[-1]['train_loss']:.4f} | {val:.4f} | {max(diffs):.2e} | "
        f"{speed:,.0f} | {speed / world:,.0f} | {max(r['peak_mem_mib'] for r in records):,.0f} |"
    )


def main(args) -> None:
    reference, _ = load(Path(args.reference), args.arm)
    print(
        "| run | GPUs | train loss | val loss | max step loss diff to reference | tokens/s | tokens/s per GPU "
        "| peak MiB (rank 0) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in [args.reference, *args.runs]:
        records, meta = load(Path(run), args.arm)
        print(row(Path(run).name, records, meta, reference, args.skip))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--arm", default="mhc")
    parser.add_argument("--skip", type=int, default=20)
    main(parser.parse_args())
