"""Write ``bench/results/index.csv``: one row per raw result file under ``bench/results/`` with the
date and commit that added it, the GPU, the PyTorch and Triton versions and the command, read from
the file's header lines and the git history. Run from the repository root after adding results:

    python -m bench.index_results
"""

from __future__ import annotations

import csv
import pathlib
import re
import subprocess

RESULTS = pathlib.Path("bench/results")
FIELDS = ["file", "date", "commit", "gpu", "torch", "triton", "command"]
GPUS = (("h200x2", "2x NVIDIA H200"), ("h100x2", "2x NVIDIA H100"), ("h200", "NVIDIA H200"),
        ("h100", "NVIDIA H100 80GB HBM3"), ("cpu", "CPU"))  # fmt: skip


def _added(path: pathlib.Path) -> tuple[str, str]:
    """(date, short commit) of the commit that first added ``path``, following renames."""
    out = subprocess.run(
        ["git", "log", "--follow", "--diff-filter=A", "--format=%ad %h", "--date=short", "--", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return (out[-2], out[-1]) if len(out) >= 2 else ("", "")


def _header(path: pathlib.Path) -> str:
    if path.is_dir() or path.suffix in (".png",):
        return ""
    with open(path, errors="replace") as f:
        return "".join(f.readline() for _ in range(4))


def _version(text: str, name: str) -> str:
    found = re.search(rf"{name}[ =]*v?(\d+\.\d+(?:\.\d+)?)", text, re.IGNORECASE)
    return found.group(1) if found else ""


def _command(text: str) -> str:
    found = re.search(r"((?:python3?|bash|torchrun) [^;()\n]*)", text)
    return found.group(1).strip() if found else ""


def row(path: pathlib.Path) -> dict:
    text = _header(path)
    stem = path.name.lower()
    gpu = next((name for key, name in GPUS if key in stem), "")
    date, commit = _added(path)
    return dict(file=path.name, date=date, commit=commit, gpu=gpu, torch=_version(text, "(?:PyTorch|torch)"),
                triton=_version(text, "triton"), command=_command(text))  # fmt: skip


def main() -> None:
    rows = [row(p) for p in sorted(RESULTS.iterdir()) if p.name != "index.csv"]
    with open(RESULTS / "index.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} results indexed in {RESULTS / 'index.csv'}")


if __name__ == "__main__":
    main()
