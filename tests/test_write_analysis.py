"""The cache of PyTorch's write analysis for mhc's kernels (``mhc._compat.write_analysis``): keys by
class of argument, one analysis per key, other kernels left alone, and a traced model whose every
kernel call gets the answer PyTorch gives without the cache, from one TTIR generation per kernel
specialization."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton import Config, autotune
from triton.runtime.jit import JITFunction

from mhc._compat import write_analysis as _write_analysis

ROOT = pathlib.Path(__file__).parents[1]


def _kernel_source(x_ptr, out_ptr, n, BLOCK):  # never run: only its identity and module matter
    pass


def _jit(module: str) -> JITFunction:
    """A ``JITFunction`` (also under ``TRITON_INTERPRET=1``, where ``triton.jit`` makes another
    kind) of a function that claims to live in ``module``."""
    fn = type(_kernel_source)(_kernel_source.__code__, _kernel_source.__globals__, "_kernel_source")
    fn.__module__ = module
    return JITFunction(fn)


OWN, FOREIGN = _jit("mhc.kernels.example"), _jit("someone_else.kernels")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    """Each test starts from an empty cache: the module's cache is shared by every wrapper."""
    monkeypatch.setattr(_write_analysis, "_CACHE", {})


def _fakes(*dtypes, shape=(8, 4)):
    with FakeTensorMode():
        return [torch.empty(shape, dtype=dtype) for dtype in dtypes]


def _kwargs(x, out, n=64, block=32):
    return dict(x_ptr=x, out_ptr=out, n=n, BLOCK=block)


def test_key_holds_dtypes_and_values_but_not_shapes():
    x32, out32, x16 = _fakes(torch.float32, torch.float32, torch.bfloat16)
    (wide,) = _fakes(torch.float32, shape=(1024, 16))
    key = _write_analysis._call_key(OWN, _kwargs(x32, out32), {})
    assert key is not None
    assert _write_analysis._call_key(OWN, _kwargs(wide, out32), {}) == key  # TTIR sees 2 elements
    assert _write_analysis._call_key(OWN, _kwargs(x16, out32), {}) != key
    assert _write_analysis._call_key(OWN, _kwargs(x32, out32, n=65), {}) != key
    assert _write_analysis._call_key(OWN, _kwargs(x32, out32, block=64), {}) != key
    assert _write_analysis._call_key(OWN, _kwargs(x32, None), {}) != key  # a missing optional tensor


def test_key_of_symbolic_values_and_real_tensors():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    x, out = _fakes(torch.float32, torch.float32)
    symbolic = ShapeEnv().create_unbacked_symint()
    key = _write_analysis._call_key(OWN, _kwargs(x, out, n=symbolic), {})
    assert key is not None and key != _write_analysis._call_key(OWN, _kwargs(x, out, n=2), {})
    base = torch.empty(64)
    aligned = _write_analysis._call_key(OWN, _kwargs(base[:8], out), {})
    offset = _write_analysis._call_key(OWN, _kwargs(base[1:9], out), {})  # 4 bytes off 16
    assert aligned != offset


def test_key_sees_through_autotuners():
    x, out = _fakes(torch.float32, torch.float32)
    key = _write_analysis._call_key(OWN, _kwargs(x, out), {})
    # Dynamo wraps a launch with num_warps in a new one-config autotuner at every call
    wrapped = autotune([Config({}, num_warps=4)], key=[])(OWN)
    assert _write_analysis._call_key(wrapped, _kwargs(x, out), {}) == key
    kwargs = _kwargs(x, out)
    del kwargs["BLOCK"]  # the generation takes it from the first config
    configured = autotune([Config({"BLOCK": 32})], key=[])(OWN)
    assert _write_analysis._call_key(configured, kwargs, {}) == key


@pytest.mark.parametrize("case", ["foreign kernel", "tma", "unhashable", "not a kernel"])
def test_calls_left_to_pytorch(case):
    x, out = _fakes(torch.float32, torch.float32)
    kernel, kwargs, tma = OWN, _kwargs(x, out), {}
    if case == "foreign kernel":
        kernel = FOREIGN
    elif case == "tma":
        tma = {"x_ptr": ("stable", ([8, 4],))}
    elif case == "unhashable":
        kwargs["n"] = [64]
    else:
        kernel = object()
    assert _write_analysis._call_key(kernel, kwargs, tma) is None


def test_cached_analysis_runs_once_per_key_and_hands_out_copies():
    calls = []

    def analysis(kernel, kwargs, tma_descriptor_metadata):
        calls.append(kernel)
        return [name for name, value in kwargs.items() if name.startswith("out")]

    cached = _write_analysis._cached(analysis)
    x, out, x16 = _fakes(torch.float32, torch.float32, torch.bfloat16)
    first = cached(OWN, _kwargs(x, out), {})
    assert first == ["out_ptr"]
    first.append("changed by the caller")
    assert cached(OWN, _kwargs(x, out), {}) == ["out_ptr"]
    assert len(calls) == 1
    cached(OWN, _kwargs(x16, out), {})
    assert len(calls) == 2
    cached(FOREIGN, _kwargs(x, out), {})
    cached(FOREIGN, _kwargs(x, out), {})
    assert len(calls) == 4  # other kernels: PyTorch's analysis every time
    assert cached.mhc_uncached is analysis


def test_cached_analysis_takes_the_signature_without_tma_metadata():
    calls = []

    def analysis(kernel, kwargs):  # PyTorch before 2.6
        calls.append(kernel)
        return ["out_ptr"]

    cached = _write_analysis._cached(analysis)
    x, out = _fakes(torch.float32, torch.float32)
    assert cached(OWN, _kwargs(x, out)) == cached(OWN, _kwargs(x, out)) == ["out_ptr"]
    assert len(calls) == 1


def _analysis_name():
    from torch._higher_order_ops import triton_kernel_wrap

    return triton_kernel_wrap, next(n for n in _write_analysis._ANALYSES if hasattr(triton_kernel_wrap, n))


def test_install_wraps_once_and_can_be_turned_off(monkeypatch):
    module, name = _analysis_name()
    original = getattr(module, name)
    original = getattr(original, "mhc_uncached", original)
    monkeypatch.setattr(module, name, original)
    monkeypatch.setattr(_write_analysis, "ENABLED", False)
    _write_analysis.install()
    assert not _write_analysis.installed() and getattr(module, name) is original
    monkeypatch.setattr(_write_analysis, "ENABLED", True)
    _write_analysis.install()
    _write_analysis.install()
    assert _write_analysis.installed()
    assert getattr(module, name).mhc_uncached is original  # wrapped once


def _trace(cache: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.write_analysis_trace", "3"] + ([] if cache else ["--uncached"]),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(torch.library, "triton_op"), reason="torch.library.triton_op needs PyTorch >= 2.6")
def test_traced_sites_get_pytorchs_answers_from_one_generation_per_kernel():
    cached, uncached = _trace(cache=True), _trace(cache=False)
    assert cached["triton_op"] and cached["cached"] and not uncached["cached"]
    kernels = {name for name, _ in cached["answers"]}
    assert {
        "coefficients_fwd_kernel",
        "stream_mix_fwd_kernel",
        "stream_mix_bwd_kernel",
        "sinkhorn_bwd_kernel",
    } <= kernels
    assert cached["answers"] == uncached["answers"]  # every call, in order
    assert uncached["generations"] == len(uncached["answers"]) > len(kernels)
    assert cached["generations"] == len(kernels)  # three sites of one shape: one per kernel
