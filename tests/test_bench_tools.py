"""The front doors of the GPU tools (``bench.harness.dev_tool_args``, ``bench.tensor_parallel``):
help, unknown sections, a machine without CUDA and too few GPUs end in a message, not in a
traceback from the first kernel."""

import pytest
import torch

from bench.harness import dev_tool_args

SECTIONS = ["tiles", "--write", "layout", "n"]


def test_help_prints_the_tools_docstring(capsys):
    with pytest.raises(SystemExit) as exc:
        dev_tool_args("the tool's manual", SECTIONS, ["layout", "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "the tool's manual"


@pytest.mark.parametrize("argv", [["bogus"], ["layout", "tile"], ["=tiles"]])
def test_unknown_sections_are_named(argv):
    with pytest.raises(SystemExit, match=r"unknown argument\(s\) \[.*\]; this tool takes tiles, --write, layout, n"):
        dev_tool_args("", SECTIONS, argv)


def test_no_gpu_stops_with_a_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA GPU"):
        dev_tool_args("", SECTIONS, ["layout"])


def test_sections_with_values_pass_through(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["tiles=bwd,implicit:picked.jsonl", "--write=row.json", "n=8", "layout"]
    assert dev_tool_args("", SECTIONS, argv) == argv
    assert dev_tool_args("", SECTIONS, []) == []


def test_tensor_parallel_wants_one_gpu_per_process(monkeypatch, capsys):
    from bench import tensor_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", ["bench.tensor_parallel"])
    with pytest.raises(SystemExit) as exc:
        tensor_parallel.main()
    assert exc.value.code == 2 and "one GPU per process: 2 process(es), 1 GPU(s) here" in capsys.readouterr().err
