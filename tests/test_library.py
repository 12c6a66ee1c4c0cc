"""How launchers become ops (``mhc.ops.library``): ``triton_op`` where it can trace them, ``custom_op``
otherwise, and launches routed through ``torch.library.wrap_triton`` exactly while a ``triton_op``'s
body runs. The compiled and exported graphs themselves are tested on the GPU
(``tests/test_compiled_gpu.py``)."""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

from mhc.kernels import _launch
from mhc.ops import library as _library

_names = itertools.count()


def _register(monkeypatch, triton_op: bool):
    """A fresh op through :func:`kernel_op` that records whether launches were being traced."""
    monkeypatch.setattr(_library, "TRITON_OP", triton_op)
    seen = []

    def fake(x):
        return torch.empty_like(x)

    @_library.kernel_op(f"mhc_test::probe_{next(_names)}", fake)
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(_launch.tracing)
        return x * 2

    return probe, seen


def test_triton_op_body_runs_with_launches_traced(monkeypatch):
    probe, seen = _register(monkeypatch, True)
    x = torch.randn(5)
    torch.testing.assert_close(probe(x), 2 * x)
    assert seen == [True]
    assert _launch.tracing is False  # restored after the body
    with torch._subclasses.FakeTensorMode():  # the fake implementation is the body itself
        assert probe(torch.empty(3, 2)).shape == (3, 2)
    assert seen == [True, True]


def test_custom_op_leaves_launches_alone(monkeypatch):
    probe, seen = _register(monkeypatch, False)
    x = torch.randn(5)
    torch.testing.assert_close(probe(x), 2 * x)
    assert seen == [False]
    with torch._subclasses.FakeTensorMode():  # the registered fake, not the body
        assert probe(torch.empty(3, 2)).shape == (3, 2)
    assert seen == [False]


def test_tracing_is_restored_when_the_body_raises(monkeypatch):
    monkeypatch.setattr(_library, "TRITON_OP", True)

    @_library.kernel_op(f"mhc_test::raises_{next(_names)}", None)
    def raises(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        raises(torch.randn(2))
    assert _launch.tracing is False


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"TRITON_INTERPRET": "1"}, False),
        ({"MHC_TRITON_OP": "0"}, False),
        ({"TRITON_INTERPRET": "0", "MHC_TRITON_OP": "1"}, importlib.util.find_spec("triton") is not None),
    ],
)
def test_which_registration_the_environment_picks(env, expected):
    """Decided at import: the interpreter's kernels cannot be traced, ``MHC_TRITON_OP=0`` asks for
    the opaque ops, and otherwise ``triton_op``; the package's ops are registered either way."""
    code = (
        "import torch, mhc.ops.mixing, mhc.layer\nfrom mhc.ops import library as _library\n"
        "assert hasattr(torch.ops.mhc, 'stream_mix_fwd') and hasattr(torch.ops.mhc, 'sinkhorn_fwd')\n"
        "print(_library.TRITON_OP)"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MHC_TRITON_OP")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == str(expected)


@pytest.mark.gpu
def test_an_op_with_a_register_cap_runs_eagerly_again():
    """A ``triton_op``'s body run eagerly (a ``DTensor``, a dispatch mode) launches through
    ``wrap_triton``; a kernel with a register cap goes through a one-config autotuner that holds
    its launch options, on the second call as on the first (the coefficient backward at n = 4)."""
    g = torch.Generator().manual_seed(0)
    n, d, T = 4, 64, 32
    x = torch.randn(T, n, d, generator=g).cuda()
    phi, alpha, bias = torch.randn(n * d, 24, generator=g).cuda() / 16, torch.ones(3).cuda(), torch.zeros(24).cuda()
    _, p, r, h_pre, h_post, _, _ = torch.ops.mhc.mhc_coefficients_fwd(x, phi, alpha, bias, 3, 1e-6, 0.0)
    grads = torch.randn(T, n).cuda(), torch.randn(T, n).cuda(), torch.randn(T, n, n).cuda(), torch.randn(T, d).cuda()
    args = (x, phi, alpha, p, r, h_pre, h_post, *grads, None, 0.0)
    first = torch.ops.mhc.mhc_coefficients_bwd(*args)
    second = torch.ops.mhc.mhc_coefficients_bwd(*args)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b)
