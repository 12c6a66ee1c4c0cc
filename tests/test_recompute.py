"""``recompute_streams``: the streams rebuilt in the backward instead of saved.

Gradients with recompute are compared with the same model without it (bit-identical: the same
kernels run on the same values in the same order), over sites called one by one and chained,
mixed kinds of layer, block lengths from 1 to beyond the number of sites and both paths; what
autograd saves is sized with saved-tensor hooks. On CPU the fused path runs in Triton's
interpreter; on a GPU the compiled kernels.
"""

import copy
import math

import pytest
import torch
from einops import einsum
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from mhc.memory.recompute import StreamRecompute, optimal_block, recompute_streams
from mhc.mixing import HyperConnection, expand_streams, reduce_streams
from mhc.modules.site import KEEP_STREAMS
from mhc.reference import post_mix as reference_post_mix
from tests.conftest import COMPILE_BACKEND, KERNEL_DEVICE

BACKENDS = ["torch", "triton"]
# a few Sinkhorn iterations: the rebuilt streams do not depend on their number (the kernels run
# them in Triton's interpreter on CPU)
KINDS = {"mhc": dict(sinkhorn_iters=4), "hc": dict(constraint="none"), "static": dict(dynamic=False)}


class Branch(nn.Module):
    def __init__(self, dim, checkpointed=False):
        super().__init__()
        self.linear, self.checkpointed = nn.Linear(dim, dim), checkpointed

    def forward(self, h):
        if self.checkpointed:
            return checkpoint(self._forward, h, use_reentrant=False)
        return self._forward(h)

    def _forward(self, h):
        return torch.tanh(self.linear(h))


class Stack(nn.Module):
    """Sites over small branches, called one by one (``chain=False``) or chained with
    ``finish(y, next=)``; ``touch``: the streams are changed between sites 1 and 2 (``"copy"``:
    ``x * 1.5``, ``"in place"``: ``x.mul_(1.5)``)."""

    def __init__(self, dim, n, kinds, backend, chain=False, checkpointed=False, touch=None):
        super().__init__()
        self.n, self.chain, self.touch = n, chain, touch
        self.sites = nn.ModuleList(
            HyperConnection(dim, n, Branch(dim, checkpointed), backend=backend, **KINDS[kind]) for kind in kinds
        )
        with torch.no_grad():  # off the init, so that every coefficient matters
            for p in self.parameters():
                p.add_(torch.randn_like(p) * 0.2)

    def forward(self, h):
        x = expand_streams(h, self.n)
        if not self.chain:
            for i, site in enumerate(self.sites):
                x = site(x)
                if self.touch == "copy" and i == 1:
                    x = x * 1.5
                if self.touch == "in place" and i == 1:
                    x.mul_(1.5)
            return reduce_streams(x)
        x_in, finish = self.sites[0].split(x)
        for site, following in zip(self.sites, [*self.sites[1:], None]):
            y = site.branch(x_in)
            if following is None:
                return reduce_streams(finish(y))
            x_in, finish = finish(y, next=following)


def stack(kinds, backend, seed=0, dim=8, n=4, dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    return Stack(dim, n, kinds, backend, **kwargs).to(KERNEL_DEVICE, dtype)


def gradients(model, h, grad):
    """The input's and every parameter's gradient for upstream gradient ``grad`` (random: the
    output is a mean of the streams, an all-ones gradient would hide the mixing)."""
    model.zero_grad(set_to_none=True)
    h = h.clone().requires_grad_()
    model(h).backward(grad)
    return [h.grad, *(p.grad for p in model.parameters())]


def assert_equal_gradients(model, every, lead=(2, 3), dtype=torch.float32):
    """The gradients with blocks of ``every`` sites (an int or several) equal those without
    recompute (blocks of one site: every site saves its streams), bit for bit."""
    dim = model.sites[0].dim
    h = torch.randn(*lead, dim, device=KERNEL_DEVICE, dtype=dtype)
    grad = torch.randn_like(h)
    recompute_streams(model, 1)
    want = gradients(model, h, grad)
    for block in [every] if isinstance(every, int) else every:
        recompute_streams(model, block)
        got = gradients(model, h, grad)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (block, (g - w).abs().max())


def saved_bytes(model, h) -> int:
    """The bytes of every storage autograd saves during a forward (saved-tensor hooks)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(h.clone().requires_grad_())
    return sum(storages.values())


def first_sites(n_sites: int, every: int) -> int:
    return math.ceil(n_sites / every)


# ------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
# each example runs a stack of up to 5 sites twice: at most 10 examples (CI's profile draws 20)
@settings(max_examples=min(10, settings.default.max_examples))
@given(
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=5),
    every=st.integers(1, 7),
    lead=st.sampled_from([(3,), (2, 3), (1, 1, 2)]),
    n=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([4, 8, 24]),
)
def test_gradients_equal_without_recompute(backend, chain, kinds, every, lead, n, dim):
    model = stack(kinds, backend, dim=dim, n=n, chain=chain)
    assert_equal_gradients(model, every, lead)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
def test_every_block_length_from_one_to_beyond_the_sites(backend, chain):
    model = stack(["mhc", "mhc", "hc", "mhc", "static", "mhc"], backend, chain=chain)
    assert_equal_gradients(model, range(2, 8))  # 7: one block longer than the 6 sites


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_gradients_equal(backend):
    model = stack(["mhc", "hc", "mhc", "mhc"], backend, dtype=torch.bfloat16)
    assert_equal_gradients(model, 3, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("touch", ["copy", "in place"])
def test_streams_changed_between_sites_start_a_block(backend, touch):
    # x * 1.5 or x.mul_(1.5) between two sites: the next site cannot rebuild its input from the
    # block (a new tensor, or the same one at a new version), so it saves it; gradients stay exact
    model = stack(["mhc"] * 4, backend, touch=touch)
    assert_equal_gradients(model, 4)
    h = torch.randn(2, 3, 8, device=KERNEL_DEVICE)
    recompute_streams(model, 4)
    touched = saved_bytes(model, h)
    model.touch = None
    assert saved_bytes(model, h) < touched


def test_streams_changed_between_split_and_finish_are_kept():
    # the reference path's finish reads the site's input, which the caller holds: changed in place
    # after split (without recompute autograd refuses this, the coefficients saved it), the
    # post-mix keeps what it read instead of a rebuild of the streams before the change
    model = stack(["mhc"] * 3, "torch", dtype=torch.float64)
    first, middle, last = model.sites
    h = torch.randn(2, 8, dtype=torch.float64, device=KERNEL_DEVICE, requires_grad=True)
    scale = 1.0 + 2.0**-10

    def loss(x):
        return reduce_streams(last(x)).square().sum()

    x = first(expand_streams(h, 4))  # the same program written out of place
    h_pre, h_post, h_res = middle.coefficients(x)
    y = middle.branch(einsum(h_pre, x, "... s, ... s d -> ... d"))
    (want,) = torch.autograd.grad(loss(reference_post_mix(x * scale, h_res, y, h_post)), h)
    recompute_streams(model, 3)
    x = first(expand_streams(h, 4))
    x_in, finish = middle.split(x)
    x.mul_(scale)
    (got,) = torch.autograd.grad(loss(finish(middle.branch(x_in))), h)
    # to fp64 rounding (the two programs sum the gradients of x in another order); rebuilding the
    # streams from before the change would be off by about the change, 1e-3
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
def test_checkpointed_branches_and_backward_twice(backend, chain):
    model = stack(["mhc", "hc", "mhc"], backend, chain=chain, checkpointed=True)
    assert_equal_gradients(model, 3)
    h = torch.randn(2, 3, 8, device=KERNEL_DEVICE, requires_grad=True)
    grad = torch.randn_like(h)
    out = model(h)
    first = torch.autograd.grad(out, h, grad, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(out, h, grad)[0], first)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_sites_keep_their_streams(backend, reentrant):
    # sites inside torch.utils.checkpoint: checkpointing decides what is saved there, both in the
    # forward and in its rerun (which would otherwise save other tensors and raise)
    model = stack(["mhc"] * 4, backend)
    recompute_streams(model, 4)
    h = torch.randn(2, 3, 8, device=KERNEL_DEVICE, requires_grad=True)
    x = expand_streams(h, 4)
    for site in model.sites:
        x = checkpoint(site, x, use_reentrant=reentrant)
    reduce_streams(x).sum().backward()
    setting = model.sites[0]._recompute
    assert setting.start is None and setting.streams is None  # the reruns in the backward left nothing
    want = h.grad.clone()
    h.grad = None
    recompute_streams(model, 1)
    x = expand_streams(h, 4)
    for site in model.sites:
        x = site(x)
    reduce_streams(x).sum().backward()
    assert torch.equal(h.grad, want)


def test_torch_backend_double_backward():
    model = stack(["mhc", "hc", "mhc"], "torch", dtype=torch.float64)
    h = torch.randn(2, 8, dtype=torch.float64, device=KERNEL_DEVICE, requires_grad=True)
    grads = []
    for every in (1, 3):
        recompute_streams(model, every)
        (g,) = torch.autograd.grad(model(h).square().sum(), h, create_graph=True)
        grads.append(torch.autograd.grad(g.sum(), h)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ what is saved


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
def test_saved_tensors_shrink_by_the_rebuilt_streams(backend, chain):
    # exactly one stream tensor [4, 16, n, d] fewer for every site that is not first in its block
    sites, n, dim = 6, 4, 16
    model = stack(["mhc", "hc", "static", "mhc", "mhc", "mhc"], backend, n=n, dim=dim, chain=chain)
    h = torch.randn(4, 16, dim, device=KERNEL_DEVICE)
    streams = 4 * 16 * n * dim * 4
    recompute_streams(model, 1)
    full = saved_bytes(model, h)
    for every in (2, 3, 6, 10):
        recompute_streams(model, every)
        rebuilt = sites - first_sites(sites, every)
        assert full - saved_bytes(model, h) == rebuilt * streams, every


def test_reference_path_drops_the_streams_fp32_copy_too():
    # bf16 streams, fp32 coefficients: the coefficient ops save an fp32 copy of the streams, which
    # is rebuilt as well
    sites, n, dim = 4, 4, 16
    model = stack(["mhc"] * sites, "torch", n=n, dim=dim, dtype=torch.bfloat16)
    h = torch.randn(4, 16, dim, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    recompute_streams(model, 1)
    full = saved_bytes(model, h)
    recompute_streams(model, sites)
    assert full - saved_bytes(model, h) == (sites - 1) * 4 * 16 * n * dim * (2 + 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tensor_outlives_the_forward(backend):
    model = stack(["mhc"] * 3, backend)
    setting = recompute_streams(model, 2)
    model(torch.randn(2, 8, device=KERNEL_DEVICE, requires_grad=True)).sum().backward()
    assert setting.start is None and setting.streams is None and setting.steps == []


def kept_at_the_end(model) -> list:
    """What the model's recompute setting keeps of the streams as each forward leaves them, one
    entry per forward: a forward hook registered before :func:`recompute_streams`'s own runs
    before they clear the setting."""
    kept = []

    def record(module, args, out):
        setting = getattr(module, "_mhc_recompute", None)
        kept.append(None if setting is None else setting.streams)

    model.register_forward_hook(record)
    return kept


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chain", [False, True])
def test_streams_kept_only_while_a_site_may_continue(backend, chain):
    # a site's output is kept for the next site's identity check, not after a full block or the
    # model's last site: under torch.compile what is kept at the end of the forward leaves the
    # graph as an output and gets a gradient of zeros the size of the streams
    model = stack(["mhc"] * 5, backend, chain=chain)
    h = torch.randn(2, 3, 8, device=KERNEL_DEVICE, requires_grad=True)
    kept = kept_at_the_end(model)
    for every in (2, 3, 5, 10):
        recompute_streams(model, every)
        model(h)
        assert kept[-1] is None, every
    if chain:  # chained sites are not called as modules: no hook sees each one's output
        return
    after_site = {}

    def record(site, args, out):  # returns None: a forward hook's result replaces the output
        after_site.setdefault(list(model.sites).index(site), site._recompute.streams is out)

    for site in model.sites:
        site.register_forward_hook(record)
    recompute_streams(model, 2)
    model(h)
    # blocks [1, 2], [3, 4], [5]: kept after the first site of each block but the last
    assert after_site == {0: True, 1: False, 2: True, 3: False, 4: False}


class RunsBackwards(Stack):
    """The sites run in the reverse of their module order: the model's last site runs first."""

    def forward(self, h):
        x = expand_streams(h, self.n)
        for site in reversed(self.sites):
            x = site(x)
        return reduce_streams(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sites_out_of_module_order_only_end_a_block_early(backend):
    # the last site in module order keeps no output for a next site, so the site after it starts
    # a block of its own: one more set of streams saved, the same gradients
    torch.manual_seed(0)
    model = RunsBackwards(8, 4, ["mhc"] * 4, backend).to(KERNEL_DEVICE)
    assert_equal_gradients(model, [2, 4])
    h = torch.randn(4, 16, 8, device=KERNEL_DEVICE)
    recompute_streams(model, 4)
    in_order = stack(["mhc"] * 4, backend)
    recompute_streams(in_order, 4)
    streams = h.numel() * 4 * h.element_size()  # one set: [4, 16, n = 4, dim = 8] fp32
    assert saved_bytes(model, h) - saved_bytes(in_order, h) == streams


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_grad_nothing_changes(backend):
    model = stack(["mhc", "hc"], backend)
    h = torch.randn(2, 8, device=KERNEL_DEVICE)
    want = model(h)
    recompute_streams(model, 2)
    with torch.no_grad():
        assert torch.equal(model(h), want)


# ------------------------------------------------------------------------------ torch.compile


def test_compiled_fused_path_matches_eager():
    # fullgraph: the block bookkeeping and the Functions' recipes trace without graph breaks
    for chain in (False, True):
        model = stack(["mhc", "hc", "mhc", "mhc"], "triton", chain=chain)
        h = torch.randn(2, 3, 8, device=KERNEL_DEVICE)
        grad = torch.randn_like(h)
        want = gradients(model, h, grad)
        kept = kept_at_the_end(model)
        recompute_streams(model, 3)
        torch._dynamo.reset()
        got = gradients(torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND), h, grad)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert kept[-1] is None  # no streams leave the compiled forward for the setting


def test_compiled_reference_path_raises():
    model = stack(["mhc", "mhc"], "torch")
    recompute_streams(model, 2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="eager mode only"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 8, device=KERNEL_DEVICE, requires_grad=True))


# ------------------------------------------------------------------------------ the setting


def test_default_block_length_is_the_papers_optimum():
    assert [optimal_block(4, L) for L in (1, 2, 8, 16, 60)] == [1, 1, 2, 3, 6]
    model = stack(["mhc"] * 16, "torch")
    assert recompute_streams(model).every == 3
    assert all(site._recompute.every == 3 for site in model.sites)


def test_turning_it_off_and_on_again():
    model = stack(["mhc"] * 3, "torch")
    setting = recompute_streams(model, 2)
    assert isinstance(setting, StreamRecompute) and len(model._mhc_recompute_hooks) == 2
    assert recompute_streams(model, 1) is None
    assert all(site._recompute is KEEP_STREAMS for site in model.sites)
    assert not model._forward_pre_hooks and not model._forward_hooks
    recompute_streams(model, 3)
    recompute_streams(model, 2)  # again: the hooks are replaced, not added
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1


def test_a_copied_model_has_its_own_setting():
    model = stack(["mhc"] * 3, "torch")
    recompute_streams(model, 3)
    twin = copy.deepcopy(model)
    assert twin.sites[0]._recompute is twin._mhc_recompute is not model._mhc_recompute
    twin(torch.randn(2, 8, device=KERNEL_DEVICE, requires_grad=True))
    assert twin._mhc_recompute.streams is None  # the copy's hooks clear the copy's setting
    assert_equal_gradients(twin, 3)


def test_errors():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        recompute_streams("model")
    with pytest.raises(ValueError, match="no hyper-connection site"):
        recompute_streams(nn.Linear(2, 2))
    model = stack(["mhc"], "torch")
    with pytest.raises(ValueError, match="every must be >= 1"):
        recompute_streams(model, 0)
    for bad in (2.0, "2", True):
        with pytest.raises(TypeError, match="every must be an int"):
            recompute_streams(model, bad)
