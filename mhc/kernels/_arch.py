"""Launch limits per GPU architecture, one row each: pipelining depth, whether the tuned register
caps apply, whether tensor descriptors are used.

``hopper`` (H100, H200) is what the kernels were tuned on; ``default`` is a conservative row for
any other CUDA GPU (fewer stages, the compiler's registers, pointer loads). Swept tiles are tables,
``mhc/kernels/tables/<row>.json``, written by the tuning commands (``--write``).
``MHC_ARCH=hopper|default`` forces a row (before the first launch); otherwise compute capability
9.x picks ``hopper``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Arch", "ARCHS", "arch", "tuned", "write_tuned"]


@dataclass(frozen=True)
class Arch:
    name: str
    max_stages: int  # software-pipelining stages of the tiled loops (shared memory per SM)
    register_caps: bool  # apply the launchers' maxnreg caps (tuned on this architecture's SMs)
    tensor_descriptors: bool  # load the fused loss's tiles through TMA descriptors


ARCHS = {
    "hopper": Arch("hopper", max_stages=4, register_caps=True, tensor_descriptors=True),
    # about 100 KiB of shared memory per SM is the smallest of the GPUs Triton supports
    "default": Arch("default", max_stages=2, register_caps=False, tensor_descriptors=False),
}


@functools.cache
def arch() -> Arch:
    """The row this process launches with (``MHC_ARCH``, else the current CUDA device's)."""
    forced = os.environ.get("MHC_ARCH")
    if forced is not None:
        if forced not in ARCHS:
            raise ValueError(f"MHC_ARCH must be one of {sorted(ARCHS)}, got {forced!r}")
        return ARCHS[forced]
    if not torch.cuda.is_available():
        return ARCHS["hopper"]  # Triton's interpreter: the tuned rules, which it runs as they are
    major, _ = torch.cuda.get_device_capability()
    return ARCHS["hopper" if major == 9 else "default"]


TABLES = Path(__file__).with_name("tables")


def _frozen(value):
    """JSON lists as tuples (the launch plans are cached per argument: hashable), recursively."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value


@functools.cache
def _table(row: str) -> dict:
    with open(TABLES / f"{row}.json") as f:
        return _frozen(json.load(f))


def tuned(section: str, row: str | None = None) -> dict:
    """Table ``section`` of a row (this process's, :func:`arch`, unless named): e.g.
    ``tuned("loss_tiles_16bit")["lse"]``. Tiles are tuples. It is the table the launchers read:
    the tuners sweep by changing it in place (then ``forget_launch_plans()``)."""
    return _table(row or arch().name)[section]


def write_tuned(section: str, entries: dict, row: str | None = None, path: Path | None = None) -> Path:
    """Merge ``entries`` into table ``section`` of a row's file (nested tables key by key) and write
    it there (or to ``path``): what the tuning commands call with their winners. Returns the file
    written."""
    row = row or arch().name
    source = TABLES / f"{row}.json"
    with open(source) as f:
        table = json.load(f)
    table[section] = _merged(table.get(section, {}), json.loads(json.dumps(entries)))
    target = Path(path) if path is not None else source
    target.write_text(_dumps(table) + "\n")
    if target == source:
        _table.cache_clear()
    return target


def _merged(old: dict, new: dict) -> dict:
    """``old`` with ``new``'s entries, nested tables merged key by key."""
    out = dict(old)
    for key, value in new.items():
        both = isinstance(value, dict) and isinstance(old.get(key), dict)
        out[key] = _merged(old[key], value) if both else value
    return out


def _dumps(table: dict) -> str:
    """JSON with each tile on one line, as the files are laid out."""
    text = json.dumps(table, indent=2)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text)
