"""Activation checkpointing of layers holding hyper-connection sites, eager and compiled.

Gradients of checkpointed layers are compared with the same model without checkpointing, bit for
bit (compiled: the graphs as Inductor's partitioner splits them, run as they are, so the same
kernels); what a compiled step keeps for its backward is read off the partitioned graphs (the
backward graph's inputs). Both paths;
on CPU the fused kernels run in Triton's interpreter.
"""

import collections
import functools

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from mhc import _compat
from mhc.memory.checkpoint import SAVABLE_OPS, checkpoint_layers, checkpoint_policy
from mhc.memory.recompute import recompute_streams
from mhc.mixing import HyperConnection, expand_streams, reduce_streams
from tests.conftest import KERNEL_DEVICE

BACKENDS = ["torch", "triton"]
DIM, N, LAYERS, ITERS = 16, 4, 3, 4
LEAD = (2, 5)


class Branch(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, h):
        return self.down(torch.tanh(self.up(h)))


class Layer(nn.Module):
    """Two sites (attention-like and MLP-like), called one by one or chained inside the layer."""

    def __init__(self, backend, chain):
        super().__init__()
        self.chain = chain
        # a few Sinkhorn iterations: what is saved or recomputed does not depend on their number,
        # and the compiled tests trace each one
        self.a = HyperConnection(DIM, N, Branch(DIM), backend=backend, sinkhorn_iters=ITERS)
        self.b = HyperConnection(DIM, N, Branch(DIM), backend=backend, sinkhorn_iters=ITERS)

    def forward(self, x):
        if not self.chain:
            return self.b(self.a(x))
        x_in, finish = self.a.split(x)
        x_in, finish = finish(self.a.branch(x_in), next=self.b)
        return finish(self.b.branch(x_in))


class Model(nn.Module):
    """``LAYERS`` layers on widened streams; ``every``: layers per checkpoint region (``None``:
    none); ``context_fn``: selective checkpointing."""

    def __init__(self, backend, chain=False):
        super().__init__()
        self.layers = nn.ModuleList(Layer(backend, chain) for _ in range(LAYERS))
        self.every, self.context_fn = None, None
        with torch.no_grad():  # off the init, so that every coefficient matters
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.2)

    def forward(self, h):
        x = expand_streams(h, N)
        if self.every is None:
            for layer in self.layers:
                x = layer(x)
        else:
            x = checkpoint_layers(self.layers, x, every=self.every, context_fn=self.context_fn)
        return reduce_streams(x)


def model(backend, chain=False, seed=0):
    torch.manual_seed(seed)
    return Model(backend, chain).to(KERNEL_DEVICE)


def gradients(run, m, h, grad, autocast=False):
    """The input's and every parameter's gradient (random upstream gradient: the output is a mean
    of the streams, an all-ones gradient would hide the mixing)."""
    m.zero_grad(set_to_none=True)
    h = h.clone().requires_grad_()
    with torch.autocast(KERNEL_DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = run(h)
    out.float().backward(grad)
    return [h.grad, *(p.grad for p in m.parameters())]


def inputs():
    torch.manual_seed(1)
    h = torch.randn(*LEAD, DIM, device=KERNEL_DEVICE)
    return h, torch.randn_like(h)


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


class Partitioned:
    """A ``torch.compile`` backend that keeps the partitioned forward and backward graphs (the
    default partitioner of Inductor, graphs run as they are)."""

    def __init__(self):
        self.forward = self.backward = None
        self.backend = aot_autograd(
            fw_compiler=self._keep("forward"),
            bw_compiler=self._keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )

    def _keep(self, which):
        def compiler(gm, example_inputs):
            setattr(self, which, gm)
            return gm

        return compiler

    def saved_activations(self) -> list:
        """The shapes of what the forward keeps for the backward, parameters and inputs aside."""
        kept = [n for n in self.backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        return [
            tuple(n.meta["val"].shape)
            for n in kept
            if isinstance(n.meta.get("val"), torch.Tensor) and not n.name.startswith("primals")
        ]

    def tangents(self) -> list:
        """The shapes of the gradients the compiled backward takes in (one per forward output)."""
        return [
            tuple(n.meta["val"].shape)
            for n in self.backward.graph.nodes
            if n.op == "placeholder" and n.name.startswith("tangents")
        ]

    def backward_ops(self) -> collections.Counter:
        return collections.Counter(str(n.target) for n in self.backward.graph.nodes if n.op == "call_function")


def compiled(m):
    torch._dynamo.reset()
    graphs = Partitioned()
    return torch.compile(m, backend=graphs.backend, fullgraph=True), graphs


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointed_gradients_equal_eager(backend, chain, every):
    m = model(backend, chain)
    h, grad = inputs()
    want = gradients(m, m, h, grad)
    m.every = every
    assert_same(gradients(m, m, h, grad), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpointed_with_recompute_streams(backend):
    # eager: sites inside checkpointed regions keep their streams there, the gradients are those
    # without either
    m = model(backend)
    h, grad = inputs()
    want = gradients(m, m, h, grad)
    recompute_streams(m, 4)
    m.every = 1
    assert_same(gradients(m, m, h, grad), want)


def test_compiled_checkpoint_with_recompute_streams_is_refused():
    # compiled, a checkpointed region may not change the recompute setting that lives outside it
    # (docs/recompute.md: compiled models checkpoint or recompute, not both)
    m = model("triton")
    recompute_streams(m, 4)
    m.every = 1
    h, grad = inputs()
    run, _ = compiled(m)
    with pytest.raises(Exception, match="(?i)side effect"):
        gradients(run, m, h, grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpointed_under_autocast(backend):
    m = model(backend)
    h, grad = inputs()
    want = gradients(m, m, h, grad, autocast=True)
    m.every = 1
    assert_same(gradients(m, m, h, grad, autocast=True), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_streams_under_autocast(backend):
    # the reference path rebuilds the streams under the forward's autocast state: a bf16 post-mix
    # there, not an fp32 one
    m = model(backend)
    h, grad = inputs()
    want = gradients(m, m, h, grad, autocast=True)
    recompute_streams(m, 6)
    assert_same(gradients(m, m, h, grad, autocast=True), want)


# ------------------------------------------------------------------------------ what is kept


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
def test_compiled_checkpoint_keeps_only_layer_inputs(backend, chain):
    # inside a checkpointed region no site keeps its streams, branch input or coefficients: the
    # layers' input streams are kept (the first layer's is rebuilt from the model's input); the
    # gradients are those of the compiled model without checkpoints, bit for bit
    m = model(backend, chain)
    h, grad = inputs()
    run, graphs = compiled(m)
    want = gradients(run, m, h, grad)
    streams = (*LEAD, N, DIM)
    assert any(shape != streams for shape in graphs.saved_activations())  # sanity: internals without
    m.every = 1
    run, graphs = compiled(m)
    assert_same(gradients(run, m, h, grad), want)
    kept = graphs.saved_activations()
    assert kept == [streams] * (LAYERS - 1), kept


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_policy_keeps_what_it_names(backend):
    m = model(backend)
    h, grad = inputs()
    want = gradients(m, m, h, grad)
    m.every = 1
    tokens, M = LEAD[0] * LEAD[1], 2 * N + N * N
    for save in ((), ("mhc_coefficients_fwd",)):
        m.context_fn = functools.partial(create_selective_checkpoint_contexts, checkpoint_policy(save))
        assert_same(gradients(m, m, h, grad), want)  # eager: the policy's choice changes no value
        if backend == "triton":
            run, graphs = compiled(m)
            assert_same(gradients(run, m, h, grad), want)
            kept = graphs.saved_activations()
            assert ((tokens, M) in kept) == bool(save), kept  # the projection's per-token values
            assert kept.count((*LEAD, N, DIM)) == LAYERS - 1, kept  # and the regions' outputs


def test_policy_sees_the_fused_ops_in_eager_mode():
    seen = []

    def watch(ctx, op, *args, **kwargs):
        seen.append(str(op))
        return checkpoint_policy()(ctx, op, *args, **kwargs)

    m = model("triton")
    m.every, m.context_fn = 1, functools.partial(create_selective_checkpoint_contexts, watch)
    h, grad = inputs()
    gradients(m, m, h, grad)
    assert "mhc.mhc_coefficients_fwd.default" in seen and "mhc.stream_mix_fwd.default" in seen


def compiled_one_block() -> Partitioned:
    """The partitioned graphs of one compiled step, all 6 sites in one recompute block."""
    m = model("triton")
    recompute_streams(m, 2 * LAYERS)
    h, grad = inputs()
    run, graphs = compiled(m)
    gradients(run, m, h, grad)
    return graphs


def test_compiled_recompute_rebuilds_each_step_once():
    # 5 rebuilt positions, each one post-mix step in the backward graph (the block's Functions ask
    # for the same steps; the graph merges them)
    assert compiled_one_block().backward_ops()["mhc.stream_recompute.default"] == 2 * LAYERS - 1


def test_compiled_recompute_leaves_no_recipe_in_the_backward():
    # the setting outlives the compiled forward: what it still holds there becomes an output of the
    # compiled graph, and gets a gradient of zeros if it requires grad. It keeps the recipe detached
    # and no streams after the model's last site, so only the block's one-element link is left
    extra = compiled_one_block().tangents()[1:]  # the first is the model's output
    assert extra == [(1,)], extra


# ------------------------------------------------------------------------------ the helpers


def test_checkpoint_layers_runs_plain_layers_too():
    layers = [nn.Linear(4, 4) for _ in range(5)]
    x = torch.randn(3, 4, requires_grad=True)
    want = x
    for layer in layers:
        want = layer(want)
    for every in (1, 2, 5, 9):
        got = checkpoint_layers(layers, x, every=every)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        assert torch.equal(checkpoint_layers(layers, x, every=2), want)


def test_checkpoint_layers_passes_extra_arguments():
    x = torch.randn(3, requires_grad=True)
    out = checkpoint_layers([lambda x, s, t=0.0: x * s + t, lambda x, s, t=0.0: x + s - t], x, 2.0, every=2, t=0.5)
    assert torch.equal(out, (x * 2.0 + 0.5) + 2.0 - 0.5)


def test_errors():
    with pytest.raises(ValueError, match="save takes names from"):
        checkpoint_policy(["stream_mix_bwd"])
    with pytest.raises(TypeError, match="collection of op names"):
        checkpoint_policy("mhc_coefficients_fwd")
    with pytest.raises(TypeError, match="otherwise must be a policy"):
        checkpoint_policy(otherwise=3)
    assert all(hasattr(torch.ops.mhc, name) for name in SAVABLE_OPS)
    x = torch.randn(2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="every must be >= 1"):
            checkpoint_layers([], x, every=bad)
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match="every must be an int"):
            checkpoint_layers([], x, every=bad)
    with pytest.raises(TypeError, match=r"layers\[1\] must be callable"):
        checkpoint_layers([nn.Identity(), 3], x)


def test_recompute_streams_refuses_a_container():
    m = model("torch")
    with pytest.raises(TypeError, match="without a forward of its own"):
        recompute_streams(m.layers)


def test_checkpoint_tags_backport_only_where_needed():
    from torch._higher_order_ops.wrap import TagActivationCheckpoint

    needed = hasattr(TagActivationCheckpoint, "tag_nodes")
    assert _compat.backport_checkpoint_tags() == needed
