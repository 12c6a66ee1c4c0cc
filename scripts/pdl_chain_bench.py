"""What programmatic dependent launch (PDL) saves between the kernels of a chain on this GPU.

    python scripts/pdl_chain_bench.py

Ten elementwise kernels in a row, each reading what the last one wrote (8 MiB and 33.5 MiB of
bf16: about a d = 4096 site's ``y`` and ``x`` at 1k tokens), at 264 and 1056 programs. Each
chain runs captured in a CUDA graph and eagerly, launched plainly or with PDL: every program
first waits for the kernel before it (``gdc_wait``), and with ``early`` also lets the next kernel
launch at once (``gdc_launch_dependents``). do_bench medians; the difference over the nine kernel
boundaries is what PDL would give a site's chain of kernels (docs/small_tokens.md). Needs a
Triton with ``launch_pdl`` (3.6 has it).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.testing import do_bench

BLOCK = 2048
KERNELS = 10


@triton.jit
def scale_kernel(
    src_ptr, dst_ptr, numel, BLOCK: tl.constexpr, ITERS: tl.constexpr, WAIT: tl.constexpr, TRIGGER: tl.constexpr
):
    if WAIT:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    for i in range(ITERS):
        offsets = (tl.program_id(0) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask) * 1.0001, mask=mask)


def chain(buffers, programs: int, mode: str) -> None:
    """``KERNELS`` launches, each reading the other buffer's last write. ``mode``: ``off``,
    ``wait`` (PDL, programs wait first) or ``early`` (and trigger the next launch at once)."""
    numel = buffers[0].numel()
    iters = triton.cdiv(numel, programs * BLOCK)
    pdl = {} if mode == "off" else {"launch_pdl": True}
    for k in range(KERNELS):
        src, dst = buffers[k % 2], buffers[(k + 1) % 2]
        scale_kernel[(triton.cdiv(numel, iters * BLOCK),)](
            src, dst, numel, BLOCK=BLOCK, ITERS=iters, WAIT=mode != "off", TRIGGER=mode == "early", num_warps=4, **pdl
        )


def main() -> None:
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"{KERNELS} kernels per chain, do_bench medians",
        flush=True,
    )
    for mib in (8, 33.5):
        numel = int(mib * 2**20 / 2)
        buffers = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        for programs in (264, 1056):
            graph_us, eager_us = {}, {}
            for mode in ("off", "wait", "early"):
                chain(buffers, programs, mode)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(buffers, programs, mode)
                graph_us[mode] = 1e3 * do_bench(graph.replay, warmup=50, rep=300)
                eager_us[mode] = 1e3 * do_bench(lambda: chain(buffers, programs, mode), warmup=50, rep=300)
            print(
                f"{mib:5} MiB, {programs:4} programs: graph off {graph_us['off']:.1f} us, PDL wait "
                f"{graph_us['wait']:.1f}, PDL early {graph_us['early']:.1f}; eager off {eager_us['off']:.1f}, "
                f"PDL wait {eager_us['wait']:.1f}, PDL early {eager_us['early']:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
