"""The multi-process training example (``examples/train_parallel.py``) on CPU over gloo: both arms
on 1, 2 (tensor + sequence parallel) and 4 processes (a 2 x 2 ``(dp, tp)`` mesh with FSDP2) log
the losses of one process within rounding, the loss falls, and a run stopped and resumed from its
``torch.distributed.checkpoint`` continues the same curve."""

import json
import os
from pathlib import Path

import pytest

from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples/train_parallel.py"
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--steps", "6",
        "--log-every", "1", "--save-every", "3", "--compare"]  # fmt: skip
pytestmark = pytest.mark.xdist_group("train_parallel")


def run(tmp: Path, nproc: int, *extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # a CPU run takes the reference path
    torchrun([SCRIPT, *TINY, "--out-dir", tmp, *extra], env=env, cwd=ROOT, timeout=600, nproc=nproc)
    return {arm: [json.loads(line) for line in open(tmp / f"{arm}.jsonl")] for arm in ("plain", "mhc")}


def losses(records) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run(tmp_path_factory.mktemp("one"), 1)


@pytest.mark.parametrize("nproc, layout", [(2, ["--tp", "2"]), (4, ["--dp", "2", "--tp", "2"])], ids=["tp2", "dp2xtp2"])
def test_processes_log_one_process_losses(tmp_path, one_process, nproc, layout):
    got = run(tmp_path, nproc, *layout)
    for arm, want in one_process.items():
        assert [r["step"] for r in got[arm]] == [r["step"] for r in want] == list(range(1, 7))
        assert losses(got[arm]) == pytest.approx(losses(want), rel=1e-4), arm
        assert all(r["tokens_per_s_per_process"] > 0 and r["peak_mem_mib"] > 0 for r in got[arm])
    assert losses(want)[-1] < losses(want)[0] - 0.1  # it learns


def test_a_stopped_run_resumes_on_the_same_curve(tmp_path, one_process):
    first = run(tmp_path, 2, "--dp", "2", "--stop-at", "3")
    stopped = run(tmp_path, 2, "--dp", "2", "--resume")
    for arm, want in one_process.items():
        assert [r["step"] for r in first[arm]] == [1, 2, 3]
        assert stopped[arm][:3] == first[arm]  # kept from the first run (timings too), not run again
        assert [r["step"] for r in stopped[arm]] == list(range(1, 7))  # the log continues, not doubled
        assert losses(stopped[arm]) == pytest.approx(losses(want), rel=1e-4), arm
