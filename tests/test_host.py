"""``read_later``: a device scalar read on the host without waiting for later work."""

import torch

from mhc.kernels._host import read_later
from tests.conftest import KERNEL_DEVICE


def _busy(size):
    big = torch.randn(size, size, device=KERNEL_DEVICE)
    for _ in range(4):
        big = big @ big / size**0.5
    return big


def test_read_later_gives_the_value_at_the_call_not_after_later_writes():
    size = 4096 if KERNEL_DEVICE == "cuda" else 64
    _busy(size)  # queued first: the copy below completes only after it
    s = torch.arange(10.0, device=KERNEL_DEVICE).sum()
    later = read_later(s)
    _busy(size)  # work queued after the read, then a write to the same tensor
    s.add_(100.0)
    assert later() == 45.0
    assert s.item() == 145.0


def test_read_later_keeps_the_dtype():
    flag = read_later(torch.tensor([1, 5, 3], device=KERNEL_DEVICE).gt(4).any())
    count = read_later(torch.tensor(7, device=KERNEL_DEVICE))
    assert flag() is True and count() == 7
