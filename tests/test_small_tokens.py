"""The coefficient kernels' launch choices where tokens are few (dev/LOG.md): the forward
split over ``K`` when a program per 64 tokens would leave SMs idle, the backward's token splits,
at least 4 token blocks each, and the coefficient gradient's one-token tiles where 4-token tiles
are too few programs; the stream-mix backward's split of ``D`` where its programs are few. Each
against the kernels without it at the boundaries of the choices, forward and backward.

CPU: Triton's interpreter at a small width, with an H100's SM count given to the launchers (the
CPU's stand-in count is 4); GPU: the model width d = 1024 and the device's own SM count.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from mhc.kernels import mhc_coefficients, stream_mix
from mhc.kernels._launch import forget_launch_plans
from tests.conftest import HAS_CUDA, KERNEL_DEVICE

DEVICE = KERNEL_DEVICE
N = 4
DIM = 1024 if HAS_CUDA else 40
SMS = 132  # an H100's
TILE = mhc_coefficients.SMALL_TILE
# the tiles where tokens are few, and when decoding: the same tiles, a program per SM
SMALL_SPLIT = mhc_coefficients.coefficients_split_config(4, 1024, mhc_coefficients.DECODE_TOKENS + 1, SMS)
DECODE_SPLIT = mhc_coefficients.coefficients_split_config(4, 1024, 1, SMS)
LARGE_SPLIT = mhc_coefficients.coefficients_split_config(8, 64, 10**6, SMS)  # n = 8 / large K


@pytest.fixture
def h100_sms(monkeypatch):
    """On the CPU, launch grids sized for an H100's SMs; on a GPU, the device's own."""
    if not HAS_CUDA:
        monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: SMS)
    yield
    forget_launch_plans()


def _inputs(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    K, M = N * DIM, 2 * N + N * N
    x = torch.randn(tokens, N, DIM, generator=g).to(DEVICE)
    phi = (torch.randn(K, M, generator=g) / K**0.5).to(DEVICE)
    alpha, bias = (torch.rand(3, generator=g) + 0.5).to(DEVICE), (0.1 * torch.randn(M, generator=g)).to(DEVICE)
    return x, phi, alpha, bias


@given(
    tokens=st.integers(1, 10**6),
    sms=st.integers(1, 200),
    n=st.integers(1, 16),
    d=st.sampled_from([16, 128, 255, 256, 1024, 4095, 4096, 7168]),
)
def test_the_split_is_chosen_where_one_pass_programs_are_fewer_than_sms(tokens, sms, n, d):
    config = mhc_coefficients.coefficients_split_config(n, d, tokens, sms)
    few = -(-tokens // TILE) <= sms
    assert mhc_coefficients.few_tokens(n, d, tokens, sms) == (n <= 4 and n * d >= 1024 and few)
    decode = n * d >= 1024 and tokens <= mhc_coefficients.DECODE_TOKENS
    assert mhc_coefficients.decoding(n, d, tokens) == decode
    assert DECODE_SPLIT == (*SMALL_SPLIT[:4], 1)
    if decode and n <= 8:
        assert config == DECODE_SPLIT
    elif decode:  # res tiles 256 wide: narrower tiles, still a program per SM
        assert config[:2] == (32, 32) and config[-1] == 1
    elif n <= 4 and n * d >= 1024 and few:
        assert config == SMALL_SPLIT and config[0] == TILE
    elif 4 < n <= 8 or (n <= 4 and n * d >= 16384):
        assert config == LARGE_SPLIT
    else:
        assert config is None


@pytest.mark.parametrize("sms", [1, 132])
def test_the_split_rule_boundary(sms):
    last_few = TILE * sms
    small = DECODE_SPLIT if last_few <= mhc_coefficients.DECODE_TOKENS else SMALL_SPLIT
    assert mhc_coefficients.coefficients_split_config(4, 1024, last_few, sms) == small
    assert mhc_coefficients.coefficients_split_config(4, 1024, last_few + 1, sms) is None
    assert mhc_coefficients.coefficients_split_config(4, 4096, last_few + 1, sms) == LARGE_SPLIT


def test_a_symbolic_token_count_takes_the_rule_for_many_tokens():
    """A graph compiled for any token count must not guard on it: no small-token split there."""
    tokens = ShapeEnv().create_unbacked_symint()
    assert not mhc_coefficients.decoding(4, 1024, tokens)
    assert mhc_coefficients.coefficients_split_config(4, 1024, tokens, SMS) is None
    assert mhc_coefficients.coefficients_split_config(4, 4096, tokens, SMS) == LARGE_SPLIT


@given(
    tokens=st.integers(1, 10**6),
    block_t=st.sampled_from([16, 64, 128]),
    waves=st.integers(1, 12),
    chunks=st.integers(1, 2048),
    sms=st.integers(1, 200),
)
def test_token_splits_hold_at_least_four_blocks(tokens, block_t, waves, chunks, sms, monkeypatch):
    monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: sms)
    blocks = -(-tokens // block_t)
    splits = mhc_coefficients.token_splits(tokens, block_t, waves, chunks, torch.device(DEVICE))
    assert 1 <= splits <= blocks
    assert splits == 1 or blocks >= mhc_coefficients.MIN_SPLIT_BLOCKS * splits
    assert splits <= max(1, round(waves * sms / chunks))


@pytest.mark.parametrize("n, d", [(4, 1024), (4, 4096), (8, 1024), (12, 256)])
def test_launch_plans_take_a_symbolic_token_count_without_a_guard(n, d):
    """Every coefficient launch plan, worked out for a graph that serves any token count (an
    unbacked count raises on any guard): grids in the count, the rest ints."""
    tokens, device = ShapeEnv().create_unbacked_symint(), torch.device(DEVICE)
    plan = mhc_coefficients._forward_plan.__wrapped__(n, d, tokens, 20, False, False, device)
    launches = [plan.main] + ([plan.finish] if plan.finish else [])
    launches.append(mhc_coefficients._grad_plan.__wrapped__(n, d, tokens, True, device))
    projection = mhc_coefficients._projection_plan.__wrapped__
    for dtype in (torch.bfloat16, torch.float32):
        for capped in (True, False):  # run, or traced into a graph that Inductor compiles
            launches += [p for _, p in projection(n, d, tokens, dtype, True, False, capped, device)]
    for launch in launches:
        assert all(type(v) is not torch.SymInt for v in launch.meta.values()), launch.key
    assert all(type(g) is int for g in launches[-1].grid)  # the projection: chunks and token splits


def test_sizes_that_pick_constexprs_are_specialised():
    """A symbolic stream count or width becomes its value, with a guard in the graph; an int is
    returned as it is."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from mhc.kernels._launch import static

    env = ShapeEnv()
    source = ConstantSource("n")
    symbol = env.create_symbol(4, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    n = env.create_symintnode(symbol, hint=4, source=source)
    assert static(7) == 7
    assert type(static(n)) is int and static(n) == 4
    assert env.guards  # the graph is specialised to n = 4


@given(
    block_t=st.sampled_from([16, 64, 128]),
    waves=st.integers(1, 12),
    chunks=st.integers(1, 2048),
    sms=st.integers(1, 200),
    resident=st.one_of(st.none(), st.integers(1, 4)),
)
def test_a_symbolic_token_count_takes_the_splits_of_many_tokens(block_t, waves, chunks, sms, resident, monkeypatch):
    """A graph compiled for any token count takes the split counts of the limit of many tokens,
    without a guard on the count (an unbacked count raises on any guard)."""
    monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: sms)
    device = torch.device(DEVICE)
    symbolic = ShapeEnv().create_unbacked_symint()
    # a count whose blocks every split count divides, and that no cap limits
    blocks = math.lcm(*range(1, waves * sms + 1)) * mhc_coefficients.MIN_SPLIT_BLOCKS
    many = mhc_coefficients.token_splits(blocks * block_t, block_t, waves, chunks, device, resident)
    assert mhc_coefficients.token_splits(symbolic, block_t, waves, chunks, device, resident) == many
    tiles = 2 * waves * sms  # more token tiles than programs the GPU holds: one split over K
    assert mhc_coefficients.k_splits(tiles * block_t, 64 * chunks, block_t, 64, waves, device)[0] == 1
    assert mhc_coefficients.k_splits(symbolic, 64 * chunks, block_t, 64, waves, device) == (1, 64 * chunks)


@given(
    tokens=st.integers(1, 10**6),
    block_t=st.sampled_from([16, 64, 128]),
    waves=st.integers(1, 12),
    chunks=st.integers(1, 2048),
    sms=st.integers(1, 200),
    resident=st.integers(1, 4),
)
def test_token_splits_fill_whole_rounds_of_resident_programs(
    tokens, block_t, waves, chunks, sms, resident, monkeypatch
):
    monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: sms)
    device = torch.device(DEVICE)
    blocks = -(-tokens // block_t)
    most = mhc_coefficients.token_splits(tokens, block_t, waves, chunks, device)
    splits = mhc_coefficients.token_splits(tokens, block_t, waves, chunks, device, resident)

    def finish(s):  # rounds of resident programs times the token blocks of a split
        return -(-chunks * s // (resident * sms)) * -(-blocks // s)

    assert 1 <= splits <= most
    assert all(finish(splits) < finish(s) or (finish(splits) == finish(s) and splits <= s) for s in range(1, most + 1))


@pytest.mark.parametrize(
    "dim, tokens, splits",
    [
        (1024, 1024, 4),
        (1024, 2048, 6),
        (1024, 4096, 6),
        (1024, 16384, 6),
        (4096, 1024, 3),
        (4096, 2048, 3),
        (4096, 4096, 3),
        (4096, 16384, 3),
    ],
)
def test_token_splits_at_the_swept_sizes(dim, tokens, splits, monkeypatch):
    """The choices measured best on an H100 (n = 4: 3 resident programs per SM;
    ``tune_mixing.py small-tokens-projection``, dev/LOG.md)."""
    monkeypatch.setattr(mhc_coefficients, "sm_count", lambda device: SMS)
    device = torch.device(DEVICE)
    ((part, plan),) = mhc_coefficients._projection_plan(N, dim, tokens, torch.bfloat16, True, True, True, device)
    assert mhc_coefficients.resident_programs(plan.meta["maxnreg"], plan.meta["num_warps"]) == 3
    assert part == "both" and plan.grid == (N * -(-dim // plan.meta["BLOCK_D"]), splits)


@given(
    tokens=st.integers(1, 10**6),
    sms=st.integers(1, 200),
    n=st.integers(1, 16),
    d=st.sampled_from([16, 128, 255, 1024, 4095, 4096, 7168]),
)
def test_the_coefficient_gradient_takes_one_token_tiles_where_four_token_tiles_are_few(tokens, sms, n, d):
    block_t, block_d, _ = mhc_coefficients.coefficient_grad_config(n, d, tokens, sms)
    few = n <= 4 and -(-tokens // 4) < mhc_coefficients.GRAD_WAVES * sms
    assert (block_t, block_d) == (
        (1, min(1024, 1 << (d - 1).bit_length())) if few else (4, min(128, 1 << (d - 1).bit_length()))
    )


def test_the_coefficient_gradient_rule_boundary_and_a_symbolic_count():
    last_few = 4 * mhc_coefficients.GRAD_WAVES * SMS - 4  # the last count with fewer programs than that
    assert mhc_coefficients.coefficient_grad_config(N, 4096, last_few, SMS)[0] == 1
    assert mhc_coefficients.coefficient_grad_config(N, 4096, last_few + 1, SMS)[0] == 4
    assert mhc_coefficients.coefficient_grad_config(N, 4096, ShapeEnv().create_unbacked_symint(), SMS)[0] == 4


GRAD_TILES = {
    "one token": mhc_coefficients.coefficient_grad_config(N, DIM, 1, SMS),
    "four tokens": mhc_coefficients.coefficient_grad_config(N, DIM, 10**6, SMS),
}


@pytest.mark.parametrize("tokens", [1, 63, 64, 65] + ([1024, 4096] if HAS_CUDA else []))
def test_coefficient_gradient_tiles_agree_at_the_boundaries(tokens, monkeypatch, nan_poison):
    """The whole coefficient backward with one-token against four-token tiles in its first kernel
    (the per-program bias sums then come in 4x the rows)."""
    x, phi, alpha, bias = _inputs(tokens, seed=tokens + 2)
    _, p, r, h_pre, h_post, z_res, _ = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    g = torch.Generator().manual_seed(tokens)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE) for t in (h_pre, h_post, z_res, x[:, 0], x)]
    results = {}
    for name, tile in GRAD_TILES.items():
        monkeypatch.setattr(mhc_coefficients, "coefficient_grad_config", lambda n, d, t, s, tile=tile: tile)
        forget_launch_plans()
        results[name] = mhc_coefficients.coefficients_bwd(x, phi, alpha, p, r, h_pre, h_post, *grads)
    assert GRAD_TILES["one token"][0] == 1 and GRAD_TILES["four tokens"][0] == 4
    for name, got, want in zip(("dx", "dphi", "dbias_alpha"), results["one token"], results["four tokens"]):
        atol = 1e-6 * want.abs().max().item() * max(1, tokens) ** 0.5  # sums over tokens in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


FORWARD = ("x_in", "p", "r", "h_pre", "h_post", "z_res", "h_res")
BOUNDARY_TOKENS = [1, 63, 64, 65, 1024] + ([4096] if HAS_CUDA else [])


# the interpreter runs a 1024-token forward in half a minute: there, hc_eps at the small counts only
FORWARD_CASES = [(t, e) for t in BOUNDARY_TOKENS for e in (0.0, 1e-6) if HAS_CUDA or t < 1024 or e == 0.0]


@pytest.mark.parametrize("tokens, hc_eps", FORWARD_CASES)
def test_forward_split_matches_one_pass_at_the_boundaries(tokens, hc_eps, h100_sms, monkeypatch, nan_poison):
    x, phi, alpha, bias = _inputs(tokens, seed=tokens)
    small = DECODE_SPLIT if mhc_coefficients.decoding(N, DIM, tokens) else SMALL_SPLIT
    if HAS_CUDA:  # the launcher's own choice at the model width
        assert mhc_coefficients.coefficients_split_config(N, DIM, tokens, mhc_coefficients.sm_count(x.device)) == small
    outputs = {}
    monkeypatch.setattr(mhc_coefficients, "few_tokens", lambda *args: True)  # the split's small-token finish
    for split in (None, small):
        monkeypatch.setattr(mhc_coefficients, "coefficients_split_config", lambda n, d, t, s, split=split: split)
        forget_launch_plans()
        outputs[split] = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6, hc_eps)
    block_t, block_k, _, _, waves = small
    splits, _ = mhc_coefficients.k_splits(tokens, N * DIM, block_t, block_k, waves, x.device)
    assert splits > 1  # partial projections of several programs are added
    for name, got, want in zip(FORWARD, outputs[small], outputs[None]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mixers", [1, 2, 3, 5])
@pytest.mark.parametrize("tokens", [1, 65])
def test_pre_mix_programs_cover_every_channel_once(tokens, mixers, h100_sms, monkeypatch, nan_poison):
    """The small-token finishing kernel with 1-5 pre-mix programs per token tile over 3 channel
    chunks (the last program's share partly or wholly past the end), against one pass."""
    dim = 3 * mhc_coefficients.coefficients_finish_config(N, True)[1]
    g = torch.Generator().manual_seed(tokens + mixers)
    K, M = N * dim, 2 * N + N * N
    x = torch.randn(tokens, N, dim, generator=g).to(DEVICE)
    phi = (torch.randn(K, M, generator=g) / K**0.5).to(DEVICE)
    alpha, bias = (torch.rand(3, generator=g) + 0.5).to(DEVICE), (0.1 * torch.randn(M, generator=g)).to(DEVICE)
    monkeypatch.setattr(mhc_coefficients, "few_tokens", lambda *args: True)
    monkeypatch.setattr(mhc_coefficients, "pre_mix_programs", lambda tiles, chunks, sms: mixers)
    outputs = {}
    for split in (None, SMALL_SPLIT):
        monkeypatch.setattr(mhc_coefficients, "coefficients_split_config", lambda n, d, t, s, split=split: split)
        forget_launch_plans()
        outputs[split] = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    plan = mhc_coefficients._forward_plan(N, dim, tokens, 20, False, mhc_coefficients._split_bf16(x), x.device)
    assert plan.finish.grid[1] == 1 + min(mixers, 3)  # a program per share: (3 / mixers rounded up) chunks
    for name, got, want in zip(FORWARD, outputs[SMALL_SPLIT], outputs[None]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(HAS_CUDA, reason="a GPU's launch table picks its own token block")
def test_the_backward_splits_tokens_from_eight_blocks(h100_sms):
    # the CPU's plans (an H100's SMs): 448 tokens are 7 blocks of 64, one split; 449 are 8 blocks,
    # the last holding one token, in 2 splits
    def splits(tokens):
        ((_, plan),) = mhc_coefficients._projection_plan(N, DIM, tokens, torch.float32, True, False, True, "cpu")
        return plan.grid[1]

    assert [splits(448), splits(449)] == [1, 2]


# 1-65 tokens: the tile's boundaries, one split; 545: 9 blocks of 64, the last partly filled, in 2
# splits of 5 and 4; on the GPU also 1024 and 4096 (4 and 6 splits)
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 545] + ([1024, 4096] if HAS_CUDA else []))
def test_backward_token_splits_match_one_split_at_the_boundaries(tokens, h100_sms, monkeypatch, nan_poison):
    x, phi, alpha, bias = _inputs(tokens, seed=tokens + 1)
    if not HAS_CUDA:  # the coefficient gradient's tiles are not what this tests: the interpreter's fewest programs
        monkeypatch.setattr(mhc_coefficients, "coefficient_grad_config", lambda n, d, t, s: GRAD_TILES["four tokens"])
    _, p, r, h_pre, h_post, z_res, _ = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    g = torch.Generator().manual_seed(tokens)
    grads = [torch.randn(t.shape, generator=g).to(DEVICE) for t in (h_post, z_res, x[:, 0], x)]

    def backward():
        return mhc_coefficients.coefficients_bwd(x, phi, alpha, p, r, h_pre, h_post, None, *grads)

    chosen = backward()
    token_splits = mhc_coefficients.token_splits
    monkeypatch.setattr(mhc_coefficients, "token_splits", lambda *args: 1)
    forget_launch_plans()
    single = backward()
    monkeypatch.setattr(mhc_coefficients, "token_splits", token_splits)
    forget_launch_plans()
    ((_, plan),) = mhc_coefficients._projection_plan(N, DIM, tokens, x.dtype, True, False, True, x.device)
    splits = plan.grid[1]
    if tokens >= 545:
        assert splits > 1  # the partial dphi of several splits are added
    for name, got, want in zip(("dx", "dphi", "dbias_alpha"), chosen, single):
        # sums over the tokens in another order: rounding relative to the largest of them
        atol = 1e-6 * want.abs().max().item() * max(1, tokens) ** 0.5
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------ the stream-mix backward's split of D


@given(
    tokens=st.integers(1, 10**6),
    sms=st.integers(1, 200),
    n=st.integers(1, 16),
    one_out=st.booleans(),
    d=st.sampled_from([16, 255, 1024, 2047, 2048, 4096, 7168, 16384]),
)
def test_the_mix_backward_splits_d_where_its_programs_are_few(tokens, sms, n, one_out, d):
    n_out = 1 if one_out else n
    splits = stream_mix.bwd_d_splits(n, n_out, d, tokens, sms)
    block_t, block_d, _ = stream_mix._bwd_config(n, n_out, d)
    chunks, programs = -(-d // block_d), -(-tokens // block_t)
    one_stream_out = n_out == 1  # a pre-mix, also where n = 1
    aim = (stream_mix.PRE_MIX_BWD_WAVES if one_stream_out else stream_mix.MIX_BWD_WAVES) * sms  # programs in all
    most = chunks // (stream_mix.PRE_MIX_MIN_SPLIT_CHUNKS if one_stream_out else stream_mix.MIN_SPLIT_CHUNKS)
    assert splits >= 1
    if n > 4 or most <= 1:
        assert splits == 1
    else:  # the count of ranges whose programs come nearest the aim, each range wide enough to pay
        assert splits <= most
        if 1 < splits < most:
            assert abs(programs * splits - aim) <= programs / 2
        elif splits == most:  # capped: the aim asked for as many or more
            assert aim >= programs * (most - 0.5)
        if splits == 1:
            assert programs * 1.5 >= aim


# (d, tokens, ranges) of the one-stream pre-mix swept on an H100 (132 SMs): the fastest count, or
# within 1% of it (dev/LOG.md, the small-token split sweep)
PRE_MIX_SWEPT = [
    (1024, 512, 2),
    (1024, 1024, 2),
    (1024, 2048, 2),
    (1024, 4096, 1),
    (2048, 512, 4),
    (2048, 1024, 4),
    (2048, 2048, 2),
    (2048, 4096, 1),
    (4096, 512, 8),
    (4096, 1024, 4),
    (4096, 2048, 2),
    (4096, 4096, 1),
]


@pytest.mark.parametrize("d, tokens, ranges", PRE_MIX_SWEPT)
def test_the_pre_mix_backward_ranges_at_the_swept_sizes(d, tokens, ranges):
    assert stream_mix.bwd_d_splits(N, 1, d, tokens, 132) == ranges


@pytest.mark.parametrize("tokens", [1, 100, 1024, 4096, 10**6])
@pytest.mark.parametrize("splits", [1, 2, 3, 5, 16])
def test_the_mix_backward_grid_covers_every_chunk_once(tokens, splits, monkeypatch):
    monkeypatch.setattr(stream_mix, "bwd_d_splits", lambda n, n_out, d, t, s: splits)
    forget_launch_plans()
    for d in (1, 256, 257, 4096, 5000):
        plan, split_chunks = stream_mix._bwd_plan(4, 4, d, tokens, True, True, False, torch.device(DEVICE))
        grid, meta = plan.grid, plan.meta
        chunks = -(-d // meta["BLOCK_D"])
        assert grid[0] * meta["BLOCK_T"] >= tokens > (grid[0] - 1) * meta["BLOCK_T"]
        assert (grid[1] - 1) * split_chunks < chunks <= grid[1] * split_chunks  # no range empty, none missing
        assert grid[1] <= splits
    forget_launch_plans()


def test_a_symbolic_token_count_takes_one_range_of_d():
    assert stream_mix.bwd_d_splits(N, N, 4096, ShapeEnv().create_unbacked_symint(), SMS) == 1
    if HAS_CUDA:  # the launcher's own choice where the site's backward was slowest (dev/LOG.md)
        assert stream_mix.bwd_d_splits(N, N, 4096, 1024, mhc_coefficients.sm_count(torch.device(DEVICE))) > 1


# (n, n_out, with y, with dx_acc): the post-mix, the pre-mix (adding another gradient of x), a lane
# mixer, and the wide path (n > 8)
MIXES = [(4, 4, True, False), (4, 1, False, True), (3, 3, False, False), (12, 12, True, False)]
# several chunks of the launcher's tiles (256 channels; 64 on the wide path), the last one short
MIX_DIM = 1200 if HAS_CUDA else 600
# ranges asked for: 5 covers more ranges than 3 chunks on the GPU only (the interpreter's time)
MIX_RANGES = (1, 2, 3, 5) if HAS_CUDA else (1, 2, 3)


def _mix_reference(x, w, y, b, dout, dx_acc):
    xf, doutf = x.double(), dout.double()
    dx = torch.einsum("tij,tid->tjd", w.double(), doutf) + (dx_acc.double() if dx_acc is not None else 0)
    dw = torch.einsum("tid,tjd->tij", doutf, xf)
    dy = torch.einsum("ti,tid->td", b.double(), doutf) if y is not None else None
    db = torch.einsum("tid,td->ti", doutf, y.double()) if y is not None else None
    return dx, dy, dw, db


# one token (a part-filled tile), counts that end on a whole tile and one token past it; the GPU
# adds a tile part-filled by three and many tiles
@pytest.mark.parametrize("tokens", [1, 64, 65] + ([63, 1024, 4096] if HAS_CUDA else []))
@pytest.mark.parametrize("n, n_out, with_y, with_acc", MIXES)
def test_mix_backward_splits_of_d_agree_with_one_range(tokens, n, n_out, with_y, with_acc, monkeypatch, nan_poison):
    """The backward over 1, 2, 3 (and 5) ranges of ``D`` (the last range shorter, the last chunk past ``D``)
    against one range and against the reference: ``dx`` and ``dy`` the same values, the partial
    coefficient gradients added to the same sums up to rounding."""
    g = torch.Generator().manual_seed(tokens + 10 * n + n_out)
    x = torch.randn(tokens, n, MIX_DIM, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.rand(tokens, n_out, n, generator=g).to(DEVICE)
    y = torch.randn(tokens, MIX_DIM, generator=g).to(DEVICE, torch.bfloat16) if with_y else None
    b = torch.rand(tokens, n_out, generator=g).to(DEVICE) if with_y else None
    dout = torch.randn(tokens, n_out, MIX_DIM, generator=g).to(DEVICE, torch.bfloat16)
    dx_acc = torch.randn(x.shape, generator=g).to(DEVICE, torch.bfloat16) if with_acc else None
    results = {}
    for splits in MIX_RANGES:
        monkeypatch.setattr(stream_mix, "bwd_d_splits", lambda n, n_out, d, t, s, splits=splits: splits)
        forget_launch_plans()
        grid = stream_mix._bwd_plan(n, n_out, MIX_DIM, tokens, with_y, True, with_acc, x.device)[0].grid
        assert grid[1] == min(splits, -(-MIX_DIM // stream_mix._bwd_config(n, n_out, MIX_DIM)[1]))
        results[splits] = stream_mix.stream_mix_bwd(x, w, y, b, dout, dx_acc)
    names = ("dx", "dy", "dw", "db")
    if HAS_CUDA:  # the last count of ranges again: the same bits
        again = stream_mix.stream_mix_bwd(x, w, y, b, dout, dx_acc)
        for name, got, want in zip(names, again, results[MIX_RANGES[-1]]):
            assert want is None or torch.equal(got, want), name
    forget_launch_plans()
    for splits in MIX_RANGES[1:]:
        for name, got, want in zip(names, results[splits], results[1]):
            if want is None:
                assert got is None, name
            else:  # dx and dy per channel, no sum over D: the same values
                tol = dict(rtol=0, atol=0) if name in ("dx", "dy") else dict(rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}, {splits} ranges: {m}")
    for name, got, want in zip(names, results[3], _mix_reference(x, w, y, b, dout, dx_acc)):
        if want is not None:
            tol = dict(rtol=2e-2, atol=2e-2) if got.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{name} against the reference: {m}")
