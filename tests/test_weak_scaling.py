"""bench/weak_scaling.py end to end on the CPU (gloo, a small model): 1 and 2 processes per arm,
the table and the CSV."""

import csv
import os

import pytest
import torch

from bench import weak_scaling


def test_driver_runs_every_arm_on_one_and_two_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks run gloo on the CPU, whatever the machine has
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # and so does this process, CUDA set up or not
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
    assert "64 tokens per GPU, 1 -> 2 GPUs: plain" in table and "mhc-chain" in table.splitlines()[-1]


def _rows(efficiencies: dict, source=None) -> list:
    """Rows of runs whose 2-GPU step makes each arm's efficiency ``efficiencies[arm][run]``."""
    rows = []
    for arm, per_run in efficiencies.items():
        for run, e in enumerate(per_run):
            for gpus, ms in ((1, 80.0 + run), (2, (80.0 + run) / e)):
                row = dict(run=str(run), tokens_per_gpu="8192", arm=arm, gpus=str(gpus), step_ms=str(ms))
                rows.append(row if source is None else dict(row, source=source))
    return rows


def test_efficiency_summary_reports_medians_and_a_paired_interval():
    plain = [0.90, 1.00, 0.95, 1.05, 0.97]
    shifted = [e - 0.05 for e in plain]  # every run 5 points lower: every resample's difference is -5
    noisy = [0.80, 1.10, 0.96, 0.99, 0.90]
    rows = _rows(dict(plain=plain, mhc=shifted, chain=noisy))
    (line,) = weak_scaling.efficiency_summary(rows, ["plain", "mhc", "chain"])
    assert line.startswith("8192 tokens per GPU, 1 -> 2 GPUs: plain 97.0% (5 runs); mhc 92.0% (5 runs), -5.0 points")
    assert "90% interval -5.0 .. -5.0" in line
    tail = line.split("chain 96.0% (5 runs), -1.0 points over its runs, 90% interval ")[1]
    low, high = (float(v) for v in tail.split(" .. "))
    assert low < -1.0 < high  # the noisy arm's interval is wide and holds its difference


def test_summarize_keeps_the_runs_of_each_file_apart(tmp_path):
    paths = []
    for i, per_run in enumerate(([0.9, 1.0], [1.1])):  # run ids 0, 1 and again 0
        path = tmp_path / f"scaling{i}.csv"
        rows = _rows(dict(plain=per_run, mhc=per_run))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        paths.append(str(path))
    (line,) = weak_scaling.summarize(paths)
    assert "plain 100.0% (3 runs); mhc 100.0% (3 runs), +0.0 points" in line


def test_an_arm_of_some_runs_is_paired_on_those_runs_only():
    # files pooled from runs with and without an arm: the others keep all their runs
    rows = _rows(dict(plain=[1.0, 0.9, 1.0, 0.8], mhc=[0.9, 0.9, 0.9, 0.9]))
    rows += [r for r in _rows(dict(chain=[1.0, 0.8])) if int(r["run"]) < 2]  # chain in runs 0 and 1 only
    (line,) = weak_scaling.efficiency_summary(rows, ["plain", "mhc", "chain"])
    assert "plain 95.0% (4 runs); mhc 90.0% (4 runs), -5.0 points" in line
    assert "chain 90.0% (2 runs), -5.0 points over its runs" in line  # against plain's 1.0, 0.9


def test_more_gpus_than_the_machine_has_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        weak_scaling.main(["--gpus", "1", "2", "--tokens", "2048"])
    assert exc.value.code == 2 and "--gpus 2: this machine has 1 GPU(s)" in capsys.readouterr().err
