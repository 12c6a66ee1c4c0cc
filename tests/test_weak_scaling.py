"""bench/weak_scaling.py end to end on the CPU (gloo, a small model): 1 and 2 processes per arm,
the table and the CSV."""

import csv
import os

from bench import weak_scaling


def test_driver_runs_every_arm_on_one_and_two_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU, whatever the machine has
    sizes = "--tokens 64 --runs 1 --steps 1 --warmup 1 --dim 32 --layers 1 --heads 2 --seq 32"
    pin = "1" if len(os.sched_getaffinity(0)) >= 2 else "0"  # each of the 2 ranks on a core of its own
    weak_scaling.main(["--gpus", "1", "2", *sizes.split(), "--pin", pin, "--out", str(tmp_path)])
    with open(tmp_path / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["arm"], r["gpus"]) for r in rows} == {(a, g) for a in ("plain", "mhc", "mhc-chain") for g in ("1", "2")}
    assert all(0 < float(r["host_issue_ms"]) <= float(r["step_ms_max"]) for r in rows)
    assert all(float(r["step_ms"]) > 0 for r in rows)
    if pin == "1":
        assert {r["host_cores"] for r in rows} == {"1"}
    table = (tmp_path / "scaling.md").read_text()
    assert "| 64 | mhc-chain |" in table and "2 / 1 GPU" in table
