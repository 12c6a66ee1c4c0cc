"""bench/weak_scaling.py end to end on the CPU (gloo, a small model): 1 and 2 processes per arm,
the table and the CSV."""

import csv
import os
import subprocess
import sys


def test_driver_runs_every_arm_on_one_and_two_processes(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bench.weak_scaling",
        "--gpus",
        "1",
        "2",
        "--tokens",
        "64",
        "--runs",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--dim",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq",
        "32",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # gloo on the CPU, whatever the machine has
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, env=env)
    with open(tmp_path / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["arm"], r["gpus"]) for r in rows} == {(a, g) for a in ("plain", "mhc", "mhc-chain") for g in ("1", "2")}
    assert all(float(r["step_ms"]) > 0 for r in rows)
    table = (tmp_path / "scaling.md").read_text()
    assert "| 64 | mhc-chain |" in table and "2 / 1 GPU" in table
