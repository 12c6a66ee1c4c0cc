"""The Python examples of the README and ``docs/`` run as written, on small CPU tensors.

Each file's ```python blocks run in order in one namespace, seeded with what the prose around
them names (``dim``, ``h``, ``branches``, ``model``, ...). Blocks that need what a CPU test does
not have (a pretrained checkpoint, a process group, an AOTInductor build) are listed with the
reason and left out; every other block must run, so a renamed function or a changed signature
fails here."""

import pathlib
import re

import pytest
import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
DIM, VOCAB, N = 16, 11, 4

# (file, block index) -> why it cannot run here
NOT_HERE = {
    ("README.md", 3): "patch_deepseek_v4 on a transformers DeepSeek-V4 model (tests/test_deepseek_v4.py)",
    ("docs/compile.md", 0): "an AOTInductor build (tests/test_export.py)",
    ("docs/compile.md", 1): "a CUDA graph of a training step (tests/test_capture_gpu.py)",
    ("docs/decode.md", 0): "a CUDA graph of a decode step (tests/test_decode.py)",
    ("docs/deepseek_v4.md", 0): "from_pretrained downloads a checkpoint",
    ("docs/distributed.md", 0): "a process group (tests/test_distributed.py)",
    ("docs/distributed.md", 1): "a 2-D device mesh (tests/test_sequence_parallel.py)",
    ("docs/recompute.md", 0): "patch_deepseek_v4 on a transformers DeepSeek-V4 model (tests/test_deepseek_v4.py)",
}


class Branch(nn.Module):
    """A branch that takes an optional extra argument, as the docs' ``hc(x, mask)`` passes one."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, h, mask=None):
        return self.linear(h) if mask is None else self.linear(h) * mask


class Model(nn.Module):
    """What the docs call ``model``: ``.layers`` and ``.blocks``, sites around branches."""

    def __init__(self, *_):
        super().__init__()
        from mhc import HyperConnection

        self.layers = nn.ModuleList(HyperConnection(DIM, N, branch=Branch()) for _ in range(4))
        self.blocks = self.layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _namespace() -> dict:
    from mhc import HyperConnection, expand_streams

    torch.manual_seed(0)
    model = Model()
    x = expand_streams(torch.randn(2, 5, DIM), N).requires_grad_()
    return dict(
        torch=torch,
        nn=nn,
        dim=DIM,
        vocab=VOCAB,
        h=torch.randn(2, 5, DIM),
        branches=[Branch() for _ in range(3)],
        attn=Branch(),
        mask=torch.ones(DIM),
        hcs=[HyperConnection(DIM, N, branch=Branch()) for _ in range(3)],
        logits=torch.randn(3, N, N),
        lm_head=nn.Linear(DIM, VOCAB, bias=False),
        W=torch.randn(VOCAB, DIM),
        b=torch.randn(VOCAB),
        class_weights=torch.rand(VOCAB),
        targets=torch.randint(0, VOCAB, (2, 5)),
        model=model,
        layer=model.layers[0],
        x=x,
        GPT=Model,
    )


def _blocks():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in files:
        name = path.relative_to(ROOT).as_posix()
        yield name, BLOCK.findall(path.read_text())


def _runnable(name, blocks):
    return [(index, code) for index, code in enumerate(blocks) if (name, index) not in NOT_HERE]


# the files with at least one example that runs here
FILES = [name for name, blocks in _blocks() if _runnable(name, blocks)]


@pytest.mark.parametrize("name", FILES)
def test_the_python_examples_run_as_written(name):
    namespace = _namespace()
    for index, code in _runnable(name, dict(_blocks())[name]):
        exec(compile(code, f"{name} block {index}", "exec"), namespace)


def test_every_skipped_example_still_exists():
    """A listed block that moved or disappeared would silently stop being skipped for its reason."""
    blocks = dict(_blocks())
    for name, index in NOT_HERE:
        assert index < len(blocks[name]), f"{name} has no block {index}: update NOT_HERE"
