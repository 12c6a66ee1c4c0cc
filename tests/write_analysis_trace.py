"""Trace the compiled forward and backward of a few HyperConnection sites on the CPU, through
functionalization, and print what PyTorch's write analysis answered for every kernel call and how
many TTIR generations it took, as JSON, with the seconds the trace and the generations took.
Run by ``tests/test_write_analysis.py`` in a subprocess:
the kernels must be real ``JITFunction``\\ s (no ``TRITON_INTERPRET``), and a stand-in driver gives
Triton a Hopper target, so the TTIR is generated without a GPU. CPU tensors stand in for CUDA ones;
no kernel runs (the trace stops before the compiled graph would).

    python -m tests.write_analysis_trace SITES [--chain]     (from the repository's root)
"""

import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class HopperDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


driver.set_active(HopperDriver())

import mhc.kernels  # noqa: E402
from mhc._compat import write_analysis as _write_analysis  # noqa: E402
from mhc.ops import library as _library  # noqa: E402
from tests.site_stack import SiteStack  # noqa: E402

mhc.kernels.check_device = lambda x: None  # CPU tensors stand in for CUDA ones: nothing launches

DIM, N = 64, 4


class Traced(Exception):
    """Raised by the stand-in compiler: the joint graph is traced and functionalized by then."""


def _stop(gm, example_inputs):
    raise Traced


def _answer(result) -> list:
    """A write analysis's answer as JSON: the written names, and the read names and epilogue
    flag where PyTorch reports them."""
    if isinstance(result, list):
        return sorted(result)
    rw = result.read_writes
    return [sorted(d.name for d in rw.writes), sorted(d.name for d in rw.reads), result.can_fuse_epilogue]


def main():
    sites, chain = int(sys.argv[1]), "--chain" in sys.argv
    _write_analysis.ENABLED = "--uncached" not in sys.argv
    _write_analysis.install()  # before the recorder below wraps the analysis (else the first trace)
    _library._traced = True  # and not again over the recorder at the first trace
    model = SiteStack(DIM, N, [nn.Linear(DIM, DIM) for _ in range(sites)], chain, backend="triton")
    name = next(n for n in ("identify_accessed_tensors", "identify_mutated_tensors") if hasattr(triton_kernel_wrap, n))
    analysis = getattr(triton_kernel_wrap, name)
    answers, generations, generating = [], [0], [0.0]

    def recorded(kernel, kwargs, *args):
        result = analysis(kernel, kwargs, *args)
        answers.append([_write_analysis._jit_function(kernel).fn.__name__, _answer(result)])
        return result

    generate_ttir = triton_kernel_wrap.generate_ttir

    def counted(*args, **kwargs):
        start = time.perf_counter()
        result = generate_ttir(*args, **kwargs)
        generations[0] += 1
        generating[0] += time.perf_counter() - start
        return result

    setattr(triton_kernel_wrap, name, recorded)
    triton_kernel_wrap.generate_ttir = counted
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=_stop, bw_compiler=_stop), fullgraph=True)
    start = time.perf_counter()
    try:
        compiled(torch.randn(32, DIM, requires_grad=True))
    except Exception as e:  # Dynamo wraps the compiler's exception
        if "Traced" not in repr(e):
            raise
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            dict(
                triton_op=_library.TRITON_OP,
                cached=hasattr(analysis, "mhc_uncached"),
                generations=generations[0],
                generation_seconds=round(generating[0], 2),
                trace_seconds=round(seconds, 2),
                answers=answers,
            )
        )
    )


if __name__ == "__main__":
    main()
