"""The MoE lane-mixing example: quick path, what it writes, the mixing matrices it reports."""

import json

import moe_lanes  # examples/ is on pytest's path (pyproject.toml)
import pytest
import torch

TINY = [
    "--dim",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--experts",
    "6",
    "--expert-dim",
    "32",
    "--seq-len",
    "24",
    "--batch-size",
    "8",
    "--eval-batches",
    "2",
    "--log-every",
    "2",
    "--device",
    "cpu",
]


def test_quick_path_learns_and_writes_everything(tmp_path):
    moe_lanes.main(["--steps", "30", "--eval-every", "10", "--lr", "1e-2", "--out-dir", str(tmp_path)] + TINY)
    for arm in moe_lanes.ARMS:
        log = [json.loads(line) for line in open(tmp_path / f"{arm}.jsonl")]
        assert log[-1]["step"] == 29 and all(r["tokens_per_s"] > 0 for r in log)
        assert log[-1]["train_loss"] < log[0]["train_loss"] - 0.1  # it learns
        assert log[-1]["val_loss"] < 2.7  # below the uniform guess ln(16) = 2.77
    mats = torch.tensor(json.loads((tmp_path / "mixing.json").read_text()))
    assert mats.shape == (2, 6, 6) and (mats >= 0).all()
    torch.testing.assert_close(mats.sum(-1), torch.ones(2, 6), rtol=0, atol=1e-5)  # rows exact
    torch.testing.assert_close(mats.sum(-2), torch.ones(2, 6), rtol=0, atol=5e-2)  # columns converge
    assert not torch.allclose(mats, torch.full_like(mats, 1 / 6), atol=1e-3)  # learned, not uniform
    for name in ("loss_curves.png", "mixing_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| none |" in summary and "| mixed |" in summary


def test_static_mixer_reports_its_matrix(tmp_path):
    moe_lanes.main(["--steps", "4", "--mixer", "static", "--out-dir", str(tmp_path)] + TINY)
    mats = torch.tensor(json.loads((tmp_path / "mixing.json").read_text()))
    assert mats.shape == (2, 6, 6) and (mats >= 0).all()
    torch.testing.assert_close(mats.sum(-1), torch.ones(2, 6), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "flags, message", [(["--experts", "1"], "--experts must be >= 2"), (["--experts", "65"], "--experts must be <= 64")]
)
def test_bad_flags_exit_with_a_clear_message(flags, message, capsys):
    with pytest.raises(SystemExit):
        moe_lanes.parse_args(flags)
    assert message in capsys.readouterr().err
