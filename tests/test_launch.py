"""The launchers' fast path (``mhc.kernels._launch``): a cached kernel is one that ``kernel[grid]``
would pick, and results are the same bits either way."""

import pytest
import torch

from mhc.kernels import _launch
from mhc.mixing import HyperConnection
from tests.test_mixing_chain import make_chain, run_chain


def test_key_separates_what_triton_specializes_on():
    def key(arg):
        return (
            _launch._specialization((arg,), ())[0]
            if isinstance(arg, torch.Tensor)
            else _launch._specialization((), (arg,))[0]
        )

    base = torch.empty(64)
    assert key(base) != key(base[1:])  # 16-byte aligned or not
    assert key(base) != key(base.double())
    assert key(1) != key(2) and key(16) != key(17) and key(2) == key(3)
    assert key(2**31) != key(2**31 - 2)  # 32-bit range
    assert key(0.5) == key(2.0) and key(True) != key(False) and key(True) != key(1)
    assert _launch._specialization((base, base[1:]), ())[0] != _launch._specialization((base[1:], base), ())[0]
    assert key(base) == key(torch.empty(64))  # the address itself is not part of the key
    assert _launch._specialization((base, base[1:]), (3,))[1] == [base.data_ptr(), base[1:].data_ptr()]


KERNEL_MODULES = ("stream_mix", "mhc_coefficients", "sinkhorn", "sinkhorn_eps", "sinkhorn_implicit", "sinkhorn_tiled")


def test_launch_outputs_are_fresh_buffers_of_the_inputs_dtypes(monkeypatch):
    """The launch key leaves out the ``outputs`` a launcher passes. That holds only if each is a
    buffer the launcher has just allocated (not a view: its address is the allocator's, aligned),
    of fp32 or of an input's dtype, or else is one of the inputs themselves. Every launcher, on
    the paths a model takes: sites of each kind, chained and not, with their backward, fp32 and
    fp64, and the Sinkhorn kernels (exact, implicit, DeepSeek-V4's eps, tiled)."""
    import importlib

    from mhc.layer import sinkhorn

    launched, launch = [], _launch.launch

    def checking(kernel, grid, inputs, outputs, scalars, meta, meta_key):
        for out in outputs:
            if any(out is t for t in inputs):
                continue
            assert out._base is None and out.storage_offset() == 0 and out.data_ptr() % 16 == 0, kernel.fn.__name__
            assert out.dtype in {torch.float32, *(t.dtype for t in inputs)}, (kernel.fn.__name__, out.dtype)
        assert all(isinstance(t, torch.Tensor) for t in inputs + outputs)
        assert not any(isinstance(a, torch.Tensor) for a in scalars)
        launched.append(kernel.fn.__name__)
        launch(kernel, grid, inputs, outputs, scalars, meta, meta_key)

    for name in KERNEL_MODULES:
        monkeypatch.setattr(importlib.import_module("mhc.kernels." + name), "launch", checking)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # d = 256, 6 tokens: the coefficient forward split over K (few tokens); d = 24: one pass
    for dtype, dim in ((torch.float32, 24), (torch.float64, 24), (torch.float32, 256)):
        sites = [site.to(dtype) for site in make_chain(["mhc", "static-mhc", "hc", "mhc"], dim, 4, "triton", seed=1)]
        x = torch.randn(2, 3, 4, dim, device=device, dtype=dtype)
        for chained in (True, False):
            run_chain(sites, x, torch.randn_like(x), chained=chained)
        for n, backward, eps in (
            (4, "exact", 0.0),
            (4, "implicit", 0.0),
            (4, "exact", 1e-3),
            (8, "exact", 0.0),
            (8, "implicit", 0.0),
        ):
            logits = torch.randn(5, n, n, device=device, dtype=dtype, requires_grad=True)
            sinkhorn(logits, iters=5, backward=backward, backend="triton", eps=eps).backward(torch.randn_like(logits))
    kernels = set(launched)
    assert {
        "coefficients_fwd_kernel",
        "coefficients_finish_kernel",
        "projection_partial_kernel",
        "stream_mix_fwd_kernel",
        "stream_mix_bwd_kernel",
        "coefficient_grad_kernel",
        "projection_bwd_kernel",
        "sinkhorn_fwd_kernel",
        "sinkhorn_bwd_kernel",
        "sinkhorn_implicit_bwd_kernel",
        "sinkhorn_eps_fwd_kernel",
        "sinkhorn_eps_bwd_kernel",
        "sinkhorn_tiled_fwd_kernel",
        "sinkhorn_tiled_bwd_kernel",
        "sinkhorn_tiled_implicit_bwd_kernel",
    } <= kernels, kernels


@pytest.mark.gpu
def test_fast_launch_gives_the_same_bits(monkeypatch):
    """Forward and backward of a chain of sites and of a single site, fast path against
    ``kernel[grid]``, with aligned and misaligned inputs (a view one element in)."""
    sites = make_chain(["mhc", "mhc", "static-mhc"], 96, 4, "triton", seed=0)
    for offset in (0, 1):
        flat = torch.randn(offset + 37 * 4 * 96, device="cuda")
        x = flat[offset:].view(37, 4, 96)
        w = torch.randn_like(x)
        results = []
        for fast in (False, True, True):  # the second fast run launches from the cache
            monkeypatch.setattr(_launch, "FAST", fast)
            results.append(run_chain(sites, x, w, chained=True))
        for got in results[1:]:
            for k in results[0]:
                assert torch.equal(got[k], results[0][k]), (offset, k)


@pytest.mark.gpu
def test_fast_launch_hands_the_launcher_addresses(monkeypatch):
    """From the cache, with no launch hook, the compiled kernel's launcher gets every pointer as
    an int (the tensors' addresses: no data_ptr() call or driver query per argument there), and
    the results are those of ``kernel[grid]`` (``test_fast_launch_gives_the_same_bits``)."""
    hc = HyperConnection(64, 4, torch.nn.Linear(64, 64), init="zero").cuda()
    x = torch.randn(8, 4, 64, device="cuda")
    expected = hc(x)  # fills the cache
    handed = []

    class Spy:  # the compiled kernel, recording what its launcher is handed
        def __init__(self, compiled):
            self.compiled, self.function, self.packed_metadata = compiled, compiled.function, compiled.packed_metadata

        def run(self, *args):
            handed.append(args[9:])  # after grid, stream, function, metadata and the hooks
            return self.compiled.run(*args)

    for key, cached in list(_launch._CACHE.items()):
        monkeypatch.setitem(_launch._CACHE, key, _launch._Cached(Spy(cached.kernel), cached.constexprs))
    torch.testing.assert_close(hc(x), expected, rtol=0, atol=0)
    assert len(handed) == 2  # the coefficient forward and the post-mix
    for args in handed:
        assert not any(isinstance(a, torch.Tensor) for a in args)
        assert any(a == x.data_ptr() for a in args[:2])  # the streams, read as they are (contiguous)


@pytest.mark.gpu
def test_fast_launch_follows_new_shapes():
    hc = HyperConnection(64, 4, torch.nn.Linear(64, 64), init="zero").cuda()
    ref = HyperConnection(64, 4, hc.branch, init="zero", backend="torch").cuda()
    ref.load_state_dict(hc.state_dict())
    for tokens in (1, 16, 33, 1000):
        x = torch.randn(tokens, 4, 64, device="cuda")
        torch.testing.assert_close(hc(x), ref(x), rtol=1e-5, atol=1e-5)


def test_no_hook_reads_triton_hooks():
    class Chain:  # Triton 3.5+: a chain of hooks, empty or not
        def __init__(self, calls):
            self.calls = calls

    assert _launch._no_hook(None) and _launch._no_hook(Chain([]))
    assert not _launch._no_hook(Chain([print])) and not _launch._no_hook(print)


@pytest.mark.gpu
def test_fast_launch_calls_registered_launch_hooks():
    """A launch hook (a profiler's) still sees every launch from the cache, with its metadata."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    hc = HyperConnection(64, 4, torch.nn.Linear(64, 64), init="zero").cuda()
    x = torch.randn(8, 4, 64, device="cuda")
    hc(x)  # fills the cache
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        hc(x)
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    assert seen == ["coefficients_fwd_kernel", "stream_mix_fwd_kernel"], seen


@pytest.mark.gpu
def test_without_the_private_launcher_every_launch_is_kernel_grid(monkeypatch):
    """Where a Triton's compiled kernels lack the launcher the fast path calls
    (``mhc.kernels._compat.launches_directly``), every launch goes through ``kernel[grid]``: the
    cache holds no kernel and the results are the same bits."""
    from mhc.kernels import _compat

    hc = HyperConnection(64, 4, torch.nn.Linear(64, 64), init="zero").cuda()
    x = torch.randn(33, 4, 64, device="cuda")
    expected = hc(x)
    monkeypatch.setattr(_launch, "_CACHE", {})
    monkeypatch.setattr(_compat, "launches_directly", lambda compiled: False)
    for _ in range(2):  # the first call fills the cache, the second reads it
        torch.testing.assert_close(hc(x), expected, rtol=0, atol=0)
    assert _launch._CACHE and all(cached is None for cached in _launch._CACHE.values())


def test_kernel_compat_reports_what_the_fast_launch_needs():
    from mhc.kernels import _compat

    class Launcher:
        run = function = packed_metadata = launch_metadata = None

    assert _compat.launches_directly(Launcher()) and not _compat.launches_directly(object())
    if _compat.FAST_LAUNCH_SUPPORTED:
        assert len(_compat.launch_hooks()) == 2


def _token_plans(tokens, device):
    """Every per-token launch plan outside the coefficient kernels (those: test_small_tokens), for
    ``tokens`` matrices or tokens: ``(name, LaunchPlan)``."""
    from mhc.kernels import sinkhorn, sinkhorn_eps, sinkhorn_implicit, sinkhorn_tiled, stream_mix

    plans = [("sinkhorn_fwd", sinkhorn._fwd_plan.__wrapped__(4, 20, False, tokens))]
    plans.append(("sinkhorn_bwd", sinkhorn._bwd_plan.__wrapped__(6, 20, True, tokens)))
    plans.append(("sinkhorn_eps", sinkhorn_eps._plan.__wrapped__(4, 20, False, tokens)))
    plans.append(("sinkhorn_implicit", sinkhorn_implicit._plan.__wrapped__(5, False, tokens)))
    for kind in ("fwd", "bwd", "implicit"):
        plans.append((f"tiled_{kind}", sinkhorn_tiled._plan.__wrapped__(kind, 24, 24, False, tokens)))
    plans.append(("mix_fwd", stream_mix._fwd_plan.__wrapped__(4, 4, 1000, True, tokens)))
    plans.append(("mix_bwd", stream_mix._bwd_plan.__wrapped__(4, 1, 1000, tokens, False, True, True, device)[0]))
    return plans


def test_token_launch_plans_take_a_symbolic_token_count_without_a_guard():
    """A graph traced for any token count (an unbacked count raises on any guard): the token grid
    is an expression in the count, every meta-parameter an int."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    tokens = ShapeEnv().create_unbacked_symint()
    for name, plan in _token_plans(tokens, torch.device("cpu")):
        assert type(plan.grid[0]) is torch.SymInt, name
        assert all(type(g) is int for g in plan.grid[1:]), name
        assert all(type(v) is not torch.SymInt for v in plan.meta.values()), name


@pytest.mark.parametrize("tokens", [1, 2, 31, 32, 33, 1000, 65537])
def test_token_launch_plans_cover_every_token_once(tokens):
    """Programs of ``BLOCK_T`` tokens: none past the last token's tile, none missing."""
    for name, plan in _token_plans(tokens, torch.device("cpu")):
        block = plan.meta["BLOCK_T"]
        assert (plan.grid[0] - 1) * block < tokens <= plan.grid[0] * block, name
