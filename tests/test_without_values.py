"""Tensors without values: meta tensors and ``FakeTensorMode``, which model-size, memory and FLOP
estimates run models on. Every layer runs forward and backward there with the shapes, dtypes and
(meta) the FLOP count of the same model on real fp64 CPU tensors, which take the same PyTorch ops."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from mhc import linear_cross_entropy, sinkhorn
from tests.site_stack import model_kinds

DIM, N, VOCAB = 16, 4, 11
MODELS = model_kinds(DIM, N)


@contextlib.contextmanager
def set_default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _step(name, device, dtype):
    """Forward and backward of a model with the loss head; returns what a run without values
    must reproduce: the loss's shape and dtype, every gradient's shape and dtype, and the FLOPs."""
    torch.manual_seed(0)
    with torch.device(device), set_default_dtype(dtype):
        model = MODELS[name]()
        tokens = torch.randn(2, 5, DIM, dtype=dtype, requires_grad=True)
        target = torch.randint(0, VOCAB, (2, 5))
        weight = torch.randn(VOCAB, DIM, dtype=dtype, requires_grad=True)
    with FlopCounterMode(display=False) as flops:
        loss = linear_cross_entropy(model(tokens), weight, target, label_smoothing=0.1, lse_square_scale=1e-4)
        loss.backward()
    grads = [(p.grad.shape, p.grad.dtype, p.grad.device.type) for p in (tokens, weight, *model.parameters())]
    return (loss.shape, loss.dtype, loss.device.type), grads, flops.get_total_flops()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_meta_tensors_run_forward_and_backward_like_real_ones(name):
    (shape, dtype, device), grads, flops = _step(name, "meta", torch.float64)
    (real_shape, real_dtype, _), real_grads, real_flops = _step(name, "cpu", torch.float64)
    assert (shape, dtype, device) == (real_shape, real_dtype, "meta")
    assert [g[:2] for g in grads] == [g[:2] for g in real_grads]
    assert all(g[2] == "meta" for g in grads)
    assert flops == real_flops > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_tensors_run_forward_and_backward_like_real_ones(name):
    with FakeTensorMode():
        (shape, dtype, _), grads, _ = _step(name, "cpu", torch.float32)
    (real_shape, real_dtype, _), real_grads, _ = _step(name, "cpu", torch.float32)
    assert (shape, dtype) == (real_shape, real_dtype)
    assert [g[:2] for g in grads] == [g[:2] for g in real_grads]


@pytest.mark.parametrize("backward", ["exact", "implicit"])
def test_sinkhorn_on_meta_keeps_shape_and_dtype(backward):
    logits = torch.randn(3, 2, 5, 5, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = sinkhorn(logits, backward=backward)
    out.backward(torch.randn_like(out))
    assert (out.shape, out.dtype, out.device.type) == (logits.shape, torch.bfloat16, "meta")
    assert logits.grad.shape == logits.shape


def test_a_meta_target_is_not_range_checked_but_a_real_one_is():
    weight = torch.randn(VOCAB, DIM)
    # a meta target has no values: the range check is skipped, not run on garbage
    target = torch.empty(4, dtype=torch.long, device="meta")
    loss = linear_cross_entropy(torch.randn(4, DIM, device="meta"), weight.to("meta"), target)
    assert loss.shape == () and loss.is_meta
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(torch.randn(4, DIM), weight, torch.tensor([0, 1, VOCAB, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake CUDA tensors take the fused layers' registered ops")
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_cuda_tensors_run_forward_and_backward_like_real_ones(name):
    with FakeTensorMode():
        (shape, dtype, device), grads, _ = _step(name, "cuda", torch.float32)
    (real_shape, real_dtype, _), real_grads, _ = _step(name, "cuda", torch.float32)
    assert (shape, dtype, device) == (real_shape, real_dtype, "cuda")
    assert [g[:2] for g in grads] == [g[:2] for g in real_grads]
