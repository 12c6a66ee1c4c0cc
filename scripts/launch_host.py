"""Where one kernel launch's host time goes on this machine (CUDA): a kernel with 10 pointer and 3
scalar arguments and a one-program grid (so that the GPU never holds the host back), launched
through ``kernel[grid]``, through :func:`mhc.kernels._launch.launch`, and through the compiled
kernel's launcher with tensors or with their addresses as ints (Triton's launcher asks the driver
about every pointer it gets as a tensor, ``cuPointerGetAttribute``, and takes an int as it is).
Then each launcher of a site alone (``scripts/host_model.py launchers``' calls, real launches).

    taskset -c 5 python scripts/launch_host.py
"""

from __future__ import annotations

import os
import sys
import timeit

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from host_model import site_launcher_calls  # noqa: E402

from mhc.kernels import _launch  # noqa: E402


@triton.jit
def ten_pointers_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, T, D, eps, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < T
    v = tl.load(a0 + o, mask=m) + tl.load(a1 + o, mask=m) + tl.load(a2 + o, mask=m) + tl.load(a3 + o, mask=m)
    tl.store(a9 + o, v * eps + D, mask=m)


def us_per_call(fn, number: int = 2000, repeat: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = timeit.default_timer()
        for _ in range(number):
            fn()
        best = min(best, (timeit.default_timer() - t0) / number * 1e6)  # the host's time: the queue never fills
        torch.cuda.synchronize()
    return best


def one_launch() -> None:
    tensors = [torch.zeros(64, device="cuda") for _ in range(10)]
    scalars, meta = (64, 3, 0.5), dict(BLOCK=64)
    grid = (1,)
    compiled = ten_pointers_kernel[grid](*tensors, *scalars, **meta)
    stream = torch._C._cuda_getCurrentRawStream(0)
    ints = [t.data_ptr() for t in tensors]
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    rows = {
        "kernel[grid](...)": lambda: ten_pointers_kernel[grid](*tensors, *scalars, **meta),
        "mhc launch(), 6 inputs + 4 outputs": lambda: _launch.launch(
            ten_pointers_kernel, grid, tuple(tensors[:6]), tuple(tensors[6:]), scalars, meta, "ten"
        ),
        "compiled launcher, tensors": lambda: run(
            1, 1, 1, stream, function, packed, None, None, None, *tensors, *scalars, 64
        ),
        "compiled launcher, ints": lambda: run(
            1, 1, 1, stream, function, packed, None, None, None, *ints, *scalars, 64
        ),
        "10 x data_ptr()": lambda: [t.data_ptr() for t in tensors],
        "torch.empty(64)": lambda: torch.empty(64, device="cuda"),
        "current stream": lambda: torch._C._cuda_getCurrentRawStream(0),
    }
    for name, fn in rows.items():
        print(f"{name:>40} {us_per_call(fn):6.2f} us", flush=True)


def site_launchers(n: int = 4, dim: int = 1024, tokens: int = 64) -> None:
    total = 0.0
    print(f"the launchers of a site, n = {n}, d = {dim}, {tokens} tokens:")
    for name, call in site_launcher_calls(n, dim, tokens, "cuda", torch.bfloat16).items():
        us = us_per_call(call, number=500)
        total += us
        print(f"{name:>40} {us:6.2f} us", flush=True)
    print(f"{'all five':>40} {total:6.2f} us")


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    one_launch()
    site_launchers()
