"""The layers' door to PyTorch internals (``mhc._compat``): what each helper reports, in the
states it must tell apart."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc import _compat


def test_saved_tensor_hooks_are_seen_while_open():
    def pack(t):
        return t

    def unpack(t):
        return t

    assert _compat.top_saved_tensor_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.top_saved_tensor_hooks() == (pack, unpack)
    assert _compat.top_saved_tensor_hooks() is None


def test_in_backward_only_inside_a_backward():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(_compat.in_backward())
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(_compat.in_backward())
            return g * 2

    x = torch.randn(3, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [False, True] and not _compat.in_backward()


def test_dispatch_mode_is_seen_while_active():
    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not _compat.dispatch_mode_active()
    with Mode():
        assert _compat.dispatch_mode_active()
    assert not _compat.dispatch_mode_active()
