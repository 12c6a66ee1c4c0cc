"""The launch limits per GPU architecture (``mhc.kernels._arch``): the ``default`` row holds every
launcher inside what any CUDA GPU Triton supports, ``MHC_ARCH`` picks a row, a bad value is an error.
The kernels under the ``default`` row run on the GPU with ``MHC_ARCH=default`` (dev/LOG.md)."""

import contextlib
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mhc.kernels import _arch, linear_cross_entropy, mhc_coefficients, sinkhorn_tiled
from mhc.kernels._launch import forget_launch_plans, traced_launches


@pytest.fixture
def row(monkeypatch):
    """Force a row by name for the duration of a test."""

    def force(name):
        monkeypatch.setenv("MHC_ARCH", name)
        _arch.arch.cache_clear()
        return _arch.arch()

    yield force
    _arch.arch.cache_clear()


def _coefficient_configs(n, d, dtype):
    configs = [mhc_coefficients.coefficients_fwd_config(n), mhc_coefficients.projection_bwd_config(n, d, dtype)]
    configs.append(mhc_coefficients.dphi_bwd_config(n, d, dtype))
    for tokens in (1, 10**6):
        split = mhc_coefficients.coefficients_split_config(n, d, tokens, 132)
        configs += [split] if split is not None else []
    return configs


@pytest.mark.parametrize("n", [1, 4, 6, 8, 12, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_row_stays_within_every_gpu(row, n, dtype):
    limits = row("default")
    for config in _coefficient_configs(n, 4096, dtype):
        assert config[3] <= limits.max_stages, config
    assert mhc_coefficients.projection_bwd_config(n, 4096, dtype)[5] is None  # no register cap
    for block_n, block_v, block_d, warps, stages in _arch.tuned("loss_tiles_16bit").values():
        assert stages <= limits.max_stages
        assert (block_n + block_v) * block_d * 2 * stages <= 100 * 1024  # 16-bit tiles in shared memory


def test_hopper_row_keeps_the_tuned_caps(row):
    limits = row("hopper")
    assert mhc_coefficients.projection_bwd_config(4, 4096)[5] is not None
    assert max(c[3] for c in _coefficient_configs(8, 4096, torch.bfloat16)) > row("default").max_stages
    assert limits.tensor_descriptors and not _arch.ARCHS["default"].tensor_descriptors


def _coefficient_backward_inputs(n, tokens, d):
    M = 2 * n + n * n
    h = lambda *shape: torch.rand(*shape) + 0.1
    x, grad_x_in = torch.randn(tokens, n, d, dtype=torch.bfloat16), torch.randn(tokens, d, dtype=torch.bfloat16)
    phi, alpha, p, r = torch.randn(n * d, M), torch.randn(3), torch.randn(tokens, M), h(tokens)
    dh_post, dz_res = torch.randn(tokens, n), torch.randn(tokens, n, n)
    return x, phi, alpha, p, r, h(tokens, n), h(tokens, n), None, dh_post, dz_res, grad_x_in


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("traced, fake", [(False, False), (True, False), (True, True)])
def test_a_launch_traced_into_a_graph_is_planned_without_register_caps(row, monkeypatch, n, traced, fake):
    """Inductor compiles a kernel traced into a graph without the ``maxnreg`` its launch asks for:
    the projection backward traced on fake tensors is planned as the uncapped configuration; run
    (an op body run eagerly included) it keeps Hopper's cap where it has one (n <= 4)."""
    row("hopper")
    forget_launch_plans()
    launches = []
    record = lambda kernel, grid, inputs, outputs, scalars, meta, key: launches.append((kernel, meta))
    monkeypatch.setattr(mhc_coefficients, "launch", record)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        inputs = _coefficient_backward_inputs(n, 256, 64)
        with traced_launches() if traced else contextlib.nullcontext():
            mhc_coefficients.coefficients_bwd_packed(*inputs)
    forget_launch_plans()
    metas = [meta for kernel, meta in launches if kernel is mhc_coefficients.projection_bwd_kernel]
    dx_meta = next(meta for meta in metas if meta["DX"])
    expected = mhc_coefficients.projection_bwd_config(n, 64, torch.bfloat16, capped=not fake)
    assert (dx_meta["BLOCK_T"], dx_meta["BLOCK_D"], dx_meta["num_warps"], dx_meta["num_stages"]) == expected[:4]
    assert dx_meta.get("maxnreg") == expected[5]
    assert (expected[5] is not None) == (n <= 4 and not fake)


@pytest.mark.parametrize("n, d", [(4, 64), (4, 1024), (8, 256)])
def test_the_capped_and_uncapped_projection_launches_have_their_own_keys(row, n, d):
    """The fast launch caches a compiled kernel by its plan's key: launches with different
    options (the capped and the uncapped projection backward, or a sweep's tiles) must not share
    one."""
    row("hopper")
    forget_launch_plans()
    plan, cpu = mhc_coefficients._projection_plan, torch.device("cpu")
    plans = {capped: dict(plan(n, d, 4096, torch.bfloat16, True, True, capped, cpu)) for capped in (True, False)}
    forget_launch_plans()
    for part in plans[True]:
        capped, uncapped = plans[True][part], plans[False][part]
        assert (capped.key == uncapped.key) == (capped.meta == uncapped.meta), part
    if n <= 4:  # Hopper caps the one-pass kernel's registers
        assert plans[True]["both"].meta != plans[False]["both"].meta


def test_interpreter_takes_small_loss_tiles_whatever_the_row(row):
    for name in _arch.ARCHS:
        row(name)
        assert linear_cross_entropy._tiles(torch.empty(2, 8, dtype=torch.bfloat16))["lse"] == (32, 32, 32, 1, 1)


def test_a_bad_row_name_is_an_error(row):
    with pytest.raises(ValueError, match="MHC_ARCH must be one of"):
        row("ampere")


@pytest.mark.parametrize("name", sorted(_arch.ARCHS))
def test_every_row_has_a_complete_table(name):
    sinkhorn = _arch.tuned(sinkhorn_tiled.TABLE, name)
    assert sorted(sinkhorn, key=int) == ["8", "16", "32", "64"]
    for tiles in sinkhorn.values():
        assert {k: len(v) for k, v in tiles.items()} == {"fwd": 3, "bwd": 5, "implicit": 3}
    loss = _arch.tuned("loss_tiles_16bit", name)
    assert sorted(loss) == sorted(linear_cross_entropy.TILES_16BIT)
    assert all(type(tile) is tuple and len(tile) == 5 for tile in loss.values())  # hashable: plans cache on it


def test_the_launch_plans_read_the_table_as_the_tuners_change_it(row):
    row("hopper")
    tiles = _arch.tuned(sinkhorn_tiled.TABLE)["16"]
    saved = tiles["fwd"]
    try:
        for block_t, ri, warps in ((4, 1, 2), saved):
            tiles["fwd"] = (block_t, ri, warps)  # as bench.tune_sinkhorn sweeps
            forget_launch_plans()
            plan = sinkhorn_tiled._plan("fwd", 12, 12, False, 1000)
            assert (plan.meta["BLOCK_T"], plan.meta["RI"], plan.meta["num_warps"]) == (block_t, ri, warps)
            assert plan.grid == (-(-1000 // block_t),)
    finally:
        tiles["fwd"] = saved


def test_a_tuner_writes_its_winners_into_a_copy_of_the_row(row, tmp_path):
    row("default")
    before = _arch.tuned(sinkhorn_tiled.TABLE)
    path = _arch.write_tuned(sinkhorn_tiled.TABLE, {"32": {**before["32"], "fwd": (4, 2, 2)}}, path=tmp_path / "t.json")
    written = _arch._frozen(json.loads(path.read_text()))
    assert written[sinkhorn_tiled.TABLE]["32"]["fwd"] == (4, 2, 2)
    assert {k: v for k, v in written[sinkhorn_tiled.TABLE].items() if k != "32"} == {
        k: v for k, v in before.items() if k != "32"
    }
    assert written["loss_tiles_16bit"] == _arch.tuned("loss_tiles_16bit")  # other sections kept
    assert _arch.tuned(sinkhorn_tiled.TABLE)["32"]["fwd"] == before["32"]["fwd"]  # the package's row untouched
