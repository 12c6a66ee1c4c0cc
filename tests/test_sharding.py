"""The registered ``mhc`` ops, the fused Functions and the functional ``sinkhorn`` on ``DTensor``
arguments (``mhc.ops.sharding``): tokens sharded over a 2-rank mesh or replicated, parameters
replicated.

One process joins a fake 2-rank process group: nothing moves between ranks, the test holds rank
0's shard and counts the collectives. On token shards every op runs on its rank's tokens with no
collective, its outputs equal the op's outputs on those tokens and are placed as its rule says
(the parameters' gradients as partial sums). The values across real ranks, for whole sites:
tests/test_sequence_parallel.py. (The same kernels on the same data: equal up to the order of
atomic additions on a GPU.)
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mhc.layer import sinkhorn
from mhc.ops.library import REGISTERED
from mhc.ops.mixing import MHCPreMixFunction, PostMixFunction
from tests.conftest import HAS_CUDA, KERNEL_DEVICE

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

T, N, D = 6, 4, 8
M = 2 * N + N * N  # coefficients per token


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is initialized already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh(KERNEL_DEVICE, (2,))
    dist.destroy_process_group()


def randn(*shape, g):
    return torch.randn(*shape, generator=g).to(KERNEL_DEVICE)


def op_cases():
    """``name -> (op, args(g), parameter argument indices, output placements on token shards)``:
    one call of every registered op. ``S``: sharded over tokens, ``P``: partial sum, ``R``: a
    replicated (empty placeholder) output."""
    ops = torch.ops.mhc

    def coefficients_fwd(g):
        x, phi = randn(T, N, D, g=g), randn(N * D, M, g=g) / (N * D) ** 0.5
        alpha, bias = torch.rand(3, generator=g).to(KERNEL_DEVICE) + 0.5, 0.1 * randn(M, g=g)
        return x, phi, alpha, bias, 3, 1e-6, 0.0

    def coefficients_bwd(g):
        x, phi, alpha, bias, *_ = coefficients_fwd(g)
        _, p, r, h_pre, h_post, _, _ = ops.mhc_coefficients_fwd(x, phi, alpha, bias, 3, 1e-6, 0.0)
        grads = randn(T, N, g=g), randn(T, N, g=g), randn(T, N, N, g=g), randn(T, D, g=g)
        return x, phi, alpha, p, r, h_pre, h_post, *grads, None, 0.0

    def logits(g):
        return randn(T, N, N, g=g)

    return {
        "sinkhorn_fwd": (ops.sinkhorn_fwd, lambda g: (logits(g), 3), (), "S"),
        "sinkhorn_bwd": (ops.sinkhorn_bwd, lambda g: (logits(g), logits(g), 3), (), "S"),
        "sinkhorn_implicit_bwd": (
            ops.sinkhorn_implicit_bwd,
            lambda g: (sinkhorn(logits(g), 20), logits(g)),
            (),
            "S",
        ),
        "sinkhorn_eps_fwd": (ops.sinkhorn_eps_fwd, lambda g: (logits(g), 3, 1e-3), (), "S"),
        "sinkhorn_eps_bwd": (ops.sinkhorn_eps_bwd, lambda g: (logits(g), logits(g), 3, 1e-3), (), "S"),
        "stream_mix_fwd": (
            ops.stream_mix_fwd,
            lambda g: (randn(T, N, D, g=g), randn(T, N, N, g=g), randn(T, D, g=g), randn(T, N, g=g)),
            (),
            "S",
        ),
        "stream_mix_fwd_pre": (
            ops.stream_mix_fwd,
            lambda g: (randn(T, N, D, g=g), randn(T, 1, N, g=g), None, None),
            (),
            "S",
        ),
        "stream_mix_bwd": (
            ops.stream_mix_bwd,
            lambda g: (
                randn(T, N, D, g=g),
                randn(T, N, N, g=g),
                randn(T, D, g=g),
                randn(T, N, g=g),
                randn(T, N, D, g=g),
                None,
                True,
            ),  # fmt: skip
            (),
            "SSSS",
        ),
        "stream_mix_bwd_pre": (
            ops.stream_mix_bwd,
            lambda g: (
                randn(T, N, D, g=g),
                randn(T, 1, N, g=g),
                None,
                None,
                randn(T, 1, D, g=g),
                randn(T, N, D, g=g),
                True,
            ),  # fmt: skip
            (),
            "SRSR",
        ),
        "mhc_coefficients_fwd": (ops.mhc_coefficients_fwd, coefficients_fwd, (1, 2, 3), "SSSSSSS"),
        "mhc_coefficients_bwd": (ops.mhc_coefficients_bwd, coefficients_bwd, (1, 2), "SP"),
        "stream_recompute": (
            ops.stream_recompute,
            lambda g: (randn(T, N, D, g=g), randn(T, N, N, g=g), randn(T, D, g=g), randn(T, N, g=g), randn(1, g=g)),
            (4,),
            "S",
        ),
    }


OP_CASES = op_cases()


def as_dtensors(args, mesh, sharded: bool, parameters=()):
    """``args`` as ``DTensor``\\ s: rank 0's half of the tokens (``sharded``) or the whole
    tensors, replicated; the arguments at ``parameters`` replicated either way."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def convert(i, a):
        if not isinstance(a, torch.Tensor):
            return a
        if sharded and i not in parameters:
            return DTensor.from_local(a.chunk(2)[0], mesh, [Shard(0)], run_check=False)
        return DTensor.from_local(a, mesh, [Replicate()], run_check=False)

    return tuple(convert(i, a) for i, a in enumerate(args))


def rank_zero_args(args, parameters=()):
    return tuple(
        a.chunk(2)[0] if isinstance(a, torch.Tensor) and i not in parameters else a for i, a in enumerate(args)
    )


def as_tuple(out):
    return out if isinstance(out, (tuple, list)) else (out,)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_runs_on_its_rank_tokens(mesh, name):
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    op, make_args, parameters, placed = OP_CASES[name]
    args = make_args(torch.Generator().manual_seed(0))
    with CommDebugMode() as comm:
        outs = as_tuple(op(*as_dtensors(args, mesh, sharded=True, parameters=parameters)))
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    want = as_tuple(op(*rank_zero_args(args, parameters)))
    expected = {"S": Shard(0), "P": Partial(), "R": Replicate()}
    assert [o.placements for o in outs] == [(expected[c],) for c in placed]
    for got, ref in zip(outs, want):
        torch.testing.assert_close(got.to_local(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_runs_whole_on_replicated_arguments(mesh, name):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    op, make_args, _, _ = OP_CASES[name]
    args = make_args(torch.Generator().manual_seed(0))
    with CommDebugMode() as comm:
        outs = as_tuple(op(*as_dtensors(args, mesh, sharded=False)))
    assert comm.get_total_counts() == 0
    for got, ref in zip(outs, as_tuple(op(*args))):
        assert got.placements == (Replicate(),)
        torch.testing.assert_close(got.to_local(), ref, rtol=1e-6, atol=1e-6)


def test_every_registered_op_is_run_here():
    ours = {name for name in REGISTERED if name.startswith("mhc::")}  # not the tests' probes
    assert ours == {op._qualified_op_name for op, *_ in OP_CASES.values()}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shard_dim", [0, 1, None])
def test_sinkhorn_on_dtensor(mesh, backend, shard_dim):
    """Logits ``[2, 6, n, n]`` sharded on either batch dim or replicated: forward and backward on
    each rank's matrices, no collective, the gradient placed like the logits."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    g = torch.Generator().manual_seed(1)
    logits, grad = randn(2, T, N, N, g=g), randn(2, T, N, N, g=g)
    placement = Replicate() if shard_dim is None else Shard(shard_dim)

    def local(t):
        return t if shard_dim is None else t.chunk(2, dim=shard_dim)[0]

    leaf = local(logits).requires_grad_()
    dlogits = DTensor.from_local(leaf, mesh, [placement], run_check=False)
    with CommDebugMode() as comm:
        out = sinkhorn(dlogits, 5, backend=backend)
        out.backward(DTensor.from_local(local(grad), mesh, [placement], run_check=False))
    assert comm.get_total_counts() == 0
    assert out.placements == (placement,) and out.shape == logits.shape
    want = local(logits).requires_grad_()
    ref = sinkhorn(want, 5, backend=backend)
    ref.backward(local(grad))
    torch.testing.assert_close(out.to_local(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaf.grad, want.grad, rtol=1e-6, atol=1e-6)


def site_through_functions(x, phi, alpha, bias):
    """A dynamic mHC site of the fused Functions around a branch ``tanh``: ``[T, n, d]`` -> same."""
    x_in, _, h_post, h_res, x_pass = MHCPreMixFunction.apply(x, phi, alpha, bias, 4, "exact", 1e-6, 0.0)
    return PostMixFunction.apply(x_pass, torch.tanh(x_in), h_post, h_res)


def test_fused_site_runs_on_token_shards(mesh):
    """The fused Functions on token-sharded streams and replicated parameters: outputs and stream
    gradients sharded like the streams, the parameters' gradients partial sums of each rank's
    tokens, no collective."""
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    make_args = OP_CASES["mhc_coefficients_fwd"][1]
    x, phi, alpha, bias, *_ = make_args(torch.Generator().manual_seed(2))
    grad = randn(T, N, D, g=torch.Generator().manual_seed(3))
    leaves = [t.detach().requires_grad_() for t in as_dtensors((x, phi, alpha, bias), mesh, True, (1, 2, 3))]
    with CommDebugMode() as comm:
        out = site_through_functions(*leaves)
        out.backward(as_dtensors((grad,), mesh, sharded=True)[0])
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(0),)
    assert [t.grad.placements for t in leaves] == [(Shard(0),)] + [(Partial(),)] * 3
    want = [t.clone().requires_grad_() for t in rank_zero_args((x, phi, alpha, bias), (1, 2, 3))]
    ref = site_through_functions(*want)
    ref.backward(grad.chunk(2)[0])
    torch.testing.assert_close(out.to_local(), ref, rtol=1e-6, atol=1e-6)
    for got, expected in zip(leaves, want):
        torch.testing.assert_close(got.grad.to_local(), expected.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_CUDA, reason="compiles the fused kernels on a GPU")
def test_fused_site_compiles_on_token_shards(mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    make_args = OP_CASES["mhc_coefficients_fwd"][1]
    x, phi, alpha, bias, *_ = make_args(torch.Generator().manual_seed(2))
    dx = DTensor.from_local(x.chunk(2)[0], mesh, [Shard(0)], run_check=False)
    params = [DTensor.from_local(p, mesh, [Replicate()], run_check=False) for p in (phi, alpha, bias)]
    out = torch.compile(site_through_functions, fullgraph=True)(dx, *params)
    assert out.placements == (Shard(0),)
    torch.testing.assert_close(out.to_local(), site_through_functions(x.chunk(2)[0], phi, alpha, bias))


@pytest.mark.parametrize("kind", ["HyperConnection", "LaneMixer", "StreamCollapse", "StreamExpand"])
def test_module_refuses_dtensor_streams_without_parallelize_sites(mesh, kind):
    """A module's parameters are plain tensors until ``parallelize_sites`` replicates them: a
    ``DTensor`` input is refused with what to do, rather than failing inside an op."""
    from torch.distributed.tensor import DTensor, Shard

    from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse, StreamExpand

    module = {
        "HyperConnection": lambda: HyperConnection(D, N, branch=torch.nn.Identity()),
        "LaneMixer": lambda: LaneMixer(N, D),
        "StreamCollapse": lambda: StreamCollapse(D, N),
        "StreamExpand": lambda: StreamExpand(N, D),
    }[kind]().to(KERNEL_DEVICE)
    shape = (2, T, D) if kind == "StreamExpand" else (2, T, N, D)
    x = DTensor.from_local(torch.randn(shape, device=KERNEL_DEVICE), mesh, [Shard(1)], run_check=False)
    with pytest.raises(TypeError, match="parallelize_sites"):
        module(x)


def test_functional_mixes_run_on_token_shards(mesh):
    """``pre_mix`` and ``post_mix`` (the Functions without a site) on token-sharded streams and
    coefficients, forward and backward: no collective, each rank's tokens as on their own."""
    from torch.distributed.tensor.debug import CommDebugMode

    from mhc.ops.mixing import post_mix, pre_mix

    g = torch.Generator().manual_seed(4)
    x, y, grad = randn(T, N, D, g=g), randn(T, D, g=g), randn(T, N, D, g=g)
    h_pre, h_post, h_res = (torch.rand(*s, generator=g).to(KERNEL_DEVICE) for s in ((T, N), (T, N), (T, N, N)))

    def mix(x, y, h_pre, h_post, h_res):
        x_in, x_pass = pre_mix(x, h_pre)
        return post_mix(x_pass, y * x_in, h_post, h_res)

    leaves = [t.detach().requires_grad_() for t in as_dtensors((x, y, h_pre, h_post, h_res), mesh, sharded=True)]
    with CommDebugMode() as comm:
        out = mix(*leaves)
        out.backward(as_dtensors((grad,), mesh, sharded=True)[0])
    assert comm.get_total_counts() == 0
    want = [t.clone().requires_grad_() for t in rank_zero_args((x, y, h_pre, h_post, h_res))]
    ref = mix(*want)
    ref.backward(grad.chunk(2)[0])
    torch.testing.assert_close(out.to_local(), ref, rtol=1e-6, atol=1e-6)
    for got, expected in zip(leaves, want):
        torch.testing.assert_close(got.grad.to_local(), expected.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "double-backward"])
@pytest.mark.parametrize("present", [(True, True, True), (True, False, True)], ids=["all", "with-None"])
def test_local_parameters_of_a_sequence_parallel_module(mesh, create_graph, present):
    """A sequence-parallel module's replicated parameters as the ops take them: their local
    tensors (``None`` kept in its place), the gradients partial sums (``Partial()``) with the
    values of ``to_local(grad_placements=[Partial()])``, and with ``create_graph`` gradients that
    autograd differentiates again."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from mhc.ops.local import local_parameters

    g = torch.Generator().manual_seed(5)
    values = [randn(N * D, M, g=g), randn(3, g=g), randn(M, g=g)]
    weights = [randn(*v.shape, g=g) for v in values]
    module = type("Module", (), {"_mhc_sequence_parallel": True})()

    def run(unwrap, create_graph):
        params = [nn.Parameter(DTensor.from_local(v.clone(), mesh, [Replicate()], run_check=False)) for v in values]
        given = tuple(p if keep else None for p, keep in zip(params, present))
        local = unwrap(given)
        assert [t is None for t in local] == [t is None for t in given]
        used = [(p, t, w) for p, t, w in zip(params, local, weights) if t is not None]
        assert all(type(t) is torch.Tensor for _, t, _ in used)
        loss = sum((w * t * t).sum() for _, t, w in used)
        grads = torch.autograd.grad(loss, [p for p, _, _ in used], create_graph=create_graph)
        assert all(gr.placements == (Partial(),) for gr in grads)
        if create_graph:
            sum((gr.to_local() * w).sum() for gr, (_, _, w) in zip(grads, used)).backward()
            for p, _, w in used:  # d/dp sum(w * dloss/dp) = 2 w w
                torch.testing.assert_close(p.grad.full_tensor(), 2 * w * w, rtol=1e-6, atol=1e-6)
        return [gr.to_local() for gr in grads]

    def to_local(params):
        return tuple(None if p is None else p.to_local(grad_placements=[Partial()]) for p in params)

    got = run(lambda params: local_parameters(module, params), create_graph)
    for a, b in zip(got, run(to_local, False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_site_gradients_reduced_after_a_backward_that_raised(mesh):
    """A backward that raises after the sites' parameters took their partial gradients never runs
    its end-of-backward reduction; the next backward reduces them all (nothing stays ``Partial()``
    or pending), with one all-reduce for the sites' parameters."""
    from torch.distributed.tensor import Replicate

    from mhc.distributed import parallelize_sites
    from mhc.mixing import HyperConnection

    class RaiseInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("stop here")

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(HyperConnection(D, N, branch=nn.Linear(D, D), backend="torch") for _ in range(2)))
    model = parallelize_sites(model.to(KERNEL_DEVICE), mesh)
    site_params = [p for n, p in model.named_parameters() if ".branch." not in n]
    x = torch.randn(2, T, N, D, device=KERNEL_DEVICE, requires_grad=True)
    grad = torch.randn_like(x)
    with pytest.raises(RuntimeError, match="stop here"):
        model(RaiseInBackward.apply(x)).backward(grad)
    assert all(p.grad is not None and p.grad.placements[0].is_partial() for p in site_params)

    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda tensor, *args, **kwargs: calls.append(tensor.numel()) or original(tensor, *args, **kwargs)
    try:
        model(x).backward(grad)
    finally:
        dist.all_reduce = original
    assert [p.grad.placements for p in site_params] == [(Replicate(),)] * len(site_params)
    assert calls == [sum(p.numel() for p in site_params)]


@pytest.mark.parametrize("kind", ["HyperConnection", "LaneMixer", "StreamCollapse"])
def test_module_refuses_streams_not_sharded_over_tokens(mesh, kind):
    """Sharded over the channels or the streams, or holding partial sums, a ``DTensor`` is not a set
    of whole tokens: a ``ValueError`` that says to redistribute, before any op runs."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module

    from mhc.mixing import HyperConnection, LaneMixer, StreamCollapse

    module = {
        "HyperConnection": lambda: HyperConnection(D, N, branch=torch.nn.Identity()),
        "LaneMixer": lambda: LaneMixer(N, D),
        "StreamCollapse": lambda: StreamCollapse(D, N),
    }[kind]().to(KERNEL_DEVICE)
    distribute_module(module, mesh)  # replicated DTensor parameters: what is refused is the layout
    local = torch.randn(2, T, N, D, device=KERNEL_DEVICE)
    for placement in (Shard(3), Shard(-2), Partial()):
        x = DTensor.from_local(local, mesh, [placement], run_check=False)
        with pytest.raises(ValueError, match="computes per token.*redistribute"):
            module(x)
    replicated = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    assert module(replicated).placements == (Replicate(),)  # whole tokens on every rank: it runs


def test_module_with_dtensor_parameters_refuses_a_plain_input(mesh):
    """``distribute_module`` made the parameters ``DTensor``\\ s: a plain input is refused with what
    to pass, rather than failing inside an op on mixed tensors; a static ``LaneMixer``'s matrix,
    which takes no tokens, is a ``DTensor``."""
    from torch.distributed.tensor import DTensor, distribute_module

    from mhc.mixing import HyperConnection, LaneMixer

    site = HyperConnection(D, N, branch=torch.nn.Identity()).to(KERNEL_DEVICE)
    distribute_module(site, mesh)
    with pytest.raises(TypeError, match="plain tensor input but its parameters are DTensors"):
        site(torch.randn(2, T, N, D, device=KERNEL_DEVICE))
    lanes = LaneMixer(N).to(KERNEL_DEVICE)
    distribute_module(lanes, mesh)
    assert isinstance(lanes.matrix(), DTensor)
