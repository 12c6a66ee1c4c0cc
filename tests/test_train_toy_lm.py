"""The toy language-model example: quick path per arm, resume, data parallel, metrics, bad flags."""

import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhc.mixing import amax_gain, collect_h_res
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_toy_lm.py"
spec = importlib.util.spec_from_file_location("train_toy_lm", SCRIPT)
toy = importlib.util.module_from_spec(spec)
sys.modules["train_toy_lm"] = toy  # the arms' processes find what this process pickles by name
spec.loader.exec_module(toy)

TINY = [
    "--dim",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "24",
    "--batch-size",
    "8",
    "--eval-batches",
    "2",
    "--log-every",
    "2",
    "--no-progress",
    "--device",
    "cpu",
]


def records(path):
    return [json.loads(line) for line in open(path)]


def final_params(path):
    return torch.load(path, weights_only=True)["model"]


def test_compare_quick_path_learns_and_writes_everything(tmp_path):
    toy.main(["--compare", "--steps", "24", "--eval-every", "12", "--lr", "1e-2", "--out-dir", str(tmp_path)] + TINY)
    for arm in toy.ARMS:
        log = records(tmp_path / f"{arm}_seed0.jsonl")
        assert [r["step"] for r in log] == list(range(2, 25, 2))
        assert log[-1]["train_loss"] < log[0]["train_loss"] - 0.1  # it learns
        assert log[-1]["val_loss"] < 2.7  # below the uniform guess ln(16) = 2.77
        assert all(r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0 and r["grad_norm"] > 0 for r in log)
        assert ("gain" in log[-1]) == (arm != "baseline")
    for name in ("loss_curves.png", "gain.png", "h_res_heatmap.png", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {arm} |" in summary for arm in toy.ARMS) and "Optimum" in summary
    # the table says which path ran: on the CPU the PyTorch reference
    assert "| mhc | PyTorch reference |" in summary and "| baseline | plain residual |" in summary
    assert "On a GPU the fused kernels run" in summary and "lower is better" in summary
    # tokens/s from the arms' steps timed in turn, and the table shows those
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert set(speed["tokens_per_s"]) == set(toy.ARMS) and all(v > 0 for v in speed["tokens_per_s"].values())
    assert "timed in turn, 5 rounds of 10 steps" in summary
    for arm, value in speed["tokens_per_s"].items():
        row = next(line for line in summary.splitlines() if line.startswith(f"| {arm} |"))
        assert row.split("|")[6].strip() == f"{value:.0f}"


def test_a_single_arm_run_drops_an_earlier_comparisons_speeds(tmp_path):
    common = ["--steps", "4", "--eval-every", "4", "--out-dir", str(tmp_path), *TINY]
    toy.main(["--compare", "--speed-rounds", "1", "--speed-steps", "1", *common])
    assert (tmp_path / "speed.json").exists()
    toy.main(["--residual", "mhc", *common])
    assert not (tmp_path / "speed.json").exists()
    assert "median over the logged intervals" in (tmp_path / "summary.md").read_text()


def test_logged_gains_are_the_mixing_metric(tmp_path):
    """The JSONL gains equal amax_gain of the final model's h_res on the first validation batch."""
    args = ["--residual", "hc", "--steps", "6", "--eval-every", "6", "--lr", "1e-2", "--out-dir", str(tmp_path)] + TINY
    toy.main(args)
    logged = records(tmp_path / "hc_seed0.jsonl")[-1]["gain"]
    parsed = toy.parse_args(args)
    model = toy.build_model(parsed, "hc", parsed.vocab)
    model.load_state_dict(final_params(tmp_path / "hc_seed0.pt"))
    batch = toy.batch_for_step(toy.make_source(parsed), parsed, 0, "val")
    model.eval()
    with torch.no_grad(), collect_h_res(model) as h_res:
        model(batch[:, :-1], batch[:, 1:])
    report = amax_gain(h_res)
    assert len(h_res) == 4  # 2 layers x (attention, MLP)
    for key in ("forward", "backward", "composite_forward", "composite_backward"):
        torch.testing.assert_close(torch.tensor(logged[key], dtype=torch.float64), getattr(report, key))
    assert max(logged["composite_forward"]) > 1.0 + 1e-6  # HC drifted away from the identity


def test_resume_continues_exactly(tmp_path, monkeypatch):
    common = ["--residual", "mhc", "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4"] + TINY
    toy.main(common + ["--out-dir", str(tmp_path / "straight")])
    batch_for_step = toy.batch_for_step

    def interrupted(source, args, step, split="train"):
        if step == 6 and split == "train":
            raise KeyboardInterrupt  # killed after the step-4 checkpoint, with steps 5-6 logged
        return batch_for_step(source, args, step, split)

    monkeypatch.setattr(toy, "batch_for_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        toy.main(common + ["--out-dir", str(tmp_path / "resumed")])
    monkeypatch.setattr(toy, "batch_for_step", batch_for_step)
    # the resume starts from this checkpoint, not from scratch (which would also end equal)
    assert torch.load(tmp_path / "resumed/mhc_seed0.pt", weights_only=True)["step"] == 4
    toy.main(common + ["--out-dir", str(tmp_path / "resumed"), "--resume"])
    straight, resumed = (
        final_params(tmp_path / "straight/mhc_seed0.pt"),
        final_params(tmp_path / "resumed/mhc_seed0.pt"),
    )
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    steps = [r["step"] for r in records(tmp_path / "resumed/mhc_seed0.jsonl")]
    assert steps == [2, 4, 6, 8]  # the records logged after the checkpoint were replaced, not doubled


class _Payload:
    """Stands in for code a checkpoint could carry: unpickling it would import and call this."""

    def __reduce__(self):
        return (print, ("ran code from the checkpoint",))


def test_resume_refuses_a_checkpoint_that_carries_code(tmp_path):
    common = ["--residual", "mhc", "--steps", "4", "--eval-every", "4", "--checkpoint-every", "4"] + TINY
    toy.main(common + ["--out-dir", str(tmp_path)])
    state = torch.load(tmp_path / "mhc_seed0.pt", weights_only=True)  # state dicts only: loads
    torch.save({**state, "extra": _Payload()}, tmp_path / "mhc_seed0.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        toy.main(common + ["--out-dir", str(tmp_path), "--resume"])


def test_fused_loss_matches_torch_loss(tmp_path):
    losses = {}
    for loss in ("torch", "fused"):
        out = tmp_path / loss
        toy.main(
            ["--residual", "mhc", "--steps", "4", "--eval-every", "4", "--loss", loss, "--out-dir", str(out)] + TINY
        )
        losses[loss] = [r["train_loss"] for r in records(out / "mhc_seed0.jsonl")]
    torch.testing.assert_close(torch.tensor(losses["fused"]), torch.tensor(losses["torch"]), atol=1e-4, rtol=1e-4)


def test_text_file_data(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    toy.main(
        ["--residual", "baseline", "--text", str(text), "--steps", "4", "--eval-every", "4", "--out-dir", str(tmp_path)]
        + TINY
    )
    log = records(tmp_path / "baseline_seed0.jsonl")
    assert log[-1]["optimum"] is None and 0 < log[-1]["val_loss"] < 6.0
    assert "| baseline |" in (tmp_path / "summary.md").read_text()


def test_optimum_matches_the_sampled_sequences():
    source = toy.MarkovSource(vocab=8, branching=3, seed=3)
    tokens = source.sample(4000, 17, torch.Generator().manual_seed(0))
    joint = source.stationary.reshape(8, 8)
    nll = [-(joint[tokens[:, 0], tokens[:, 1]] / joint.sum(1)[tokens[:, 0]]).log().mean()]
    for t in range(2, 17):
        ctx = tokens[:, t - 2] * 8 + tokens[:, t - 1]
        p = (source.probs[ctx] * (source.successors[ctx] == tokens[:, t : t + 1])).sum(1)
        nll.append(-p.log().mean())
    assert abs(float(torch.stack(nll).mean()) - source.optimum(16)) < 0.02
    assert source.optimum(16) < torch.log(torch.tensor(3.0))  # never above log(branching) on average


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--residual", "resnet"], "invalid choice: 'resnet'"),
        (["--streams", "0"], "--streams must be >= 1"),
        (["--text", "/no/such/file.txt"], "no such file"),
        (["--dim", "30", "--heads", "4"], "multiple of --heads"),
        (["--branching", "40"], "--branching must be in"),
        (["--speed-rounds", "-1"], "--speed-rounds must be >= 0"),
        (["--speed-steps", "0"], "--speed-steps must be >= 1"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        toy.parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


TWO_PROCESS_ARGS = ["--residual", "mhc", "--eval-every", "3", "--log-every", "1", "--checkpoint-every", "2"] + TINY
TWO_PROCESS_ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """The directory of one process's 3 steps on the whole batch, which both engines must equal."""
    out = tmp_path_factory.mktemp("single")
    subprocess.run(
        [sys.executable, str(SCRIPT)] + TWO_PROCESS_ARGS + ["--steps", "3", "--out-dir", str(out)],
        check=True,
        env=TWO_PROCESS_ENV,
        cwd=ROOT,
        timeout=300,
    )
    return out


@pytest.mark.xdist_group("toy_lm_two_processes")  # one worker runs both: one reference run
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_equal_one(tmp_path, engine, one_process_run):
    """torchrun with 2 gloo processes on CPU ends with the parameters of one process on the same
    global batch: DDP all-reduces the two half-batch gradients, FSDP2 (one unit per block, fp32
    here) reduce-scatters them. The FSDP2 run stops after step 2 and resumes from its checkpoint
    (the full state dict gathered from the shards); one process runs straight through
    (``test_resume_continues_exactly``: resuming changes nothing there).

    Losses and gradient norms agree to float rounding. Parameters agree to a tenth of one Adam
    step (lr = 1e-2): Adam divides by the gradient's magnitude, so on parameters whose gradient is
    near zero (b_pre) it turns rounding differences of the reduction into visible updates."""
    launches = [(3, [])] if engine == "ddp" else [(2, ["--fsdp"]), (3, ["--fsdp", "--resume"])]  # (last step, flags)
    for steps, flags in launches:
        out = ["--steps", str(steps), "--out-dir", tmp_path / engine]
        torchrun([SCRIPT] + TWO_PROCESS_ARGS + flags + out, env=TWO_PROCESS_ENV, cwd=ROOT, timeout=300)
        # each launch ends with a checkpoint of its last step: the resumed launch starts at step 2
        assert torch.load(tmp_path / engine / "mhc_seed0.pt", weights_only=False)["step"] == steps
    params = final_params(tmp_path / engine / "mhc_seed0.pt")
    single_params = final_params(one_process_run / "mhc_seed0.pt")
    assert params.keys() == single_params.keys()
    for key in single_params:
        torch.testing.assert_close(params[key], single_params[key], rtol=0, atol=1e-3, msg=key)
    log, single_log = records(tmp_path / engine / "mhc_seed0.jsonl"), records(one_process_run / "mhc_seed0.jsonl")
    assert len(log) == len(single_log) == 2 and "val_loss" in log[-1] and "gain" in log[-1]  # steps 2, 3
    for a, b in zip(log, single_log):
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-5 and abs(a["grad_norm"] / b["grad_norm"] - 1) < 1e-5
    assert abs(log[-1]["val_loss"] - single_log[-1]["val_loss"]) < 1e-5


def test_fsdp_needs_torchrun(capsys):
    with pytest.raises(SystemExit, match="torchrun"):
        toy.main(["--fsdp", "--steps", "1", "--out-dir", "unused"] + TINY)


def test_more_processes_than_gpus_exit_with_a_clear_message(monkeypatch):
    # torchrun's second process on a one-GPU machine: refused before any CUDA call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    tiny_on_gpu = [a for a in TINY if a not in ("--device", "cpu")]
    with pytest.raises(SystemExit, match="no GPU of its own .1 here.: launch at most one process per GPU"):
        toy.main(["--steps", "1", "--out-dir", "unused"] + tiny_on_gpu)


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path):
    # recomputation replays the same ops on the same inputs: bit-identical training
    args = ["--residual", "mhc", "--steps", "4", "--eval-every", "4"] + TINY
    toy.main(args + ["--out-dir", str(tmp_path / "plain")])
    toy.main(args + ["--checkpoint-activations", "--out-dir", str(tmp_path / "checkpointed")])
    plain, checkpointed = (
        final_params(tmp_path / "plain/mhc_seed0.pt"),
        final_params(tmp_path / "checkpointed/mhc_seed0.pt"),
    )
    for key in plain:
        assert torch.equal(plain[key], checkpointed[key]), key
    losses = [[r["train_loss"] for r in records(tmp_path / d / "mhc_seed0.jsonl")] for d in ("plain", "checkpointed")]
    assert losses[0] == losses[1]


@pytest.mark.gpu
def test_gpu_path_with_kernels_and_fused_loss(tmp_path):
    """The GPU preset's path: bf16 autocast, Triton Sinkhorn kernels, fused loss; it learns."""
    toy.main(
        [
            "--preset",
            "gpu",
            "--compare",
            "--steps",
            "100",
            "--eval-every",
            "50",
            "--dim",
            "64",
            "--layers",
            "2",
            "--heads",
            "2",
            "--seq-len",
            "64",
            "--batch-size",
            "16",
            "--eval-batches",
            "2",
            "--vocab",
            "16",
            "--lr",
            "1e-2",
            "--no-progress",
            "--device",
            "cuda",
            "--out-dir",
            str(tmp_path),
        ]
    )
    for arm in toy.ARMS:
        log = records(tmp_path / f"{arm}_seed0.jsonl")
        assert log[-1]["val_loss"] < math.log(16) - 0.15  # below the uniform guess
        assert log[-1]["path"] == ("plain residual" if arm == "baseline" else "fused kernels")
