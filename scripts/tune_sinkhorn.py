"""Development tool for the Sinkhorn kernels on a CUDA GPU (one run, one table per section).

    python scripts/tune_sinkhorn.py [tiles | tiles=bwd,implicit] [layout] [ir] [compile]

- ``tiles``: the tiled kernels' ``(BLOCK_T, num_warps[, SEG, RECOMPUTE_R1])`` over a grid of choices, per
  ``NP`` class (n = 8, 16, 32, 64) at 256 MiB of fp32 logits, 20 iterations; each row is one
  kernel's median time (``do_bench``) against the clone of the logits;
- ``layout``: per-row kernels (``sinkhorn.py``) against the tiled ones at n = 4..16, with the
  configurations in the source: where the ``TILED_MIN_N`` switch belongs;
- ``ir``: registers, spills and layout conversions of each tiled kernel per n, as compiled;
- ``compile``: first call (cold Triton cache, fresh process) of forward + exact + implicit
  backward per n.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

from mhc import kernels
from mhc.kernels import _tiles, sinkhorn, sinkhorn_implicit, sinkhorn_tiled

ITERS = 20


def _logits(n: int, mib: int = 256) -> torch.Tensor:
    T = mib * 2**20 // (4 * n * n)
    return torch.randn(T, n, n, device="cuda")


def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def _tiles_for(np2: int, values_per_thread: int, num_warps: int) -> int:
    return max(1, values_per_thread * 32 * num_warps // (np2 * np2))


def tiles(only: str = "fwd,bwd,implicit"):
    for n in (8, 16, 32, 64):
        x = _logits(n)
        g = torch.randn_like(x)
        out = kernels.sinkhorn_fwd(x, ITERS)
        clone = _ms(lambda: x.clone())
        print(f"\n# tiles n={n} T={x.shape[0]} clone {clone:.3f} ms", flush=True)
        config = sinkhorn_tiled.TILED_CONFIGS[n]
        saved = dict(config)
        kinds = {
            "fwd": (lambda: sinkhorn_tiled.sinkhorn_tiled_fwd(x, ITERS), [()]),
            "bwd": (lambda: sinkhorn_tiled.sinkhorn_tiled_bwd(x, g, ITERS),
                    [(7, False), (15, False), (19, False), (19, True)]),
            "implicit": (lambda: sinkhorn_tiled.sinkhorn_tiled_implicit_bwd(out, g), [()]),
        }
        for kind, (call, extras) in kinds.items():
            if kind not in only.split(","):
                continue
            results = []
            for vpt in (32, 64, 128):
                for warps in (1, 2, 4):
                    block_t = _tiles_for(n, vpt, warps)
                    if block_t * n * n > 128 * 32 * warps:
                        continue
                    for extra in extras:
                        config[kind] = (block_t, warps, *extra)
                        try:
                            ms = _ms(call)
                        except Exception as exc:  # noqa: BLE001 - a config may not compile
                            print(f"  {kind} {config[kind]}: {type(exc).__name__}", flush=True)
                            continue
                        results.append((ms, config[kind]))
            config[kind] = saved[kind]
            for ms, cfg in sorted(results)[:6]:
                print(f"  {kind:9s} {str(cfg):14s} {ms:8.3f} ms ({ms / clone:5.2f}x clone)", flush=True)


def layout():
    for n in (4, 5, 6, 8, 12, 16):
        x = _logits(n)
        g = torch.randn_like(x)
        clone = _ms(lambda: x.clone())
        cells = []
        for name, switch in (("rows", _tiles.MAX_N + 1), ("tiled", 1)):
            for module in (sinkhorn, sinkhorn_implicit):
                module.TILED_MIN_N = switch
            out = kernels.sinkhorn_fwd(x, ITERS)
            fwd = _ms(lambda: kernels.sinkhorn_fwd(x, ITERS))
            bwd = _ms(lambda: kernels.sinkhorn_bwd(x, g, ITERS))
            imp = _ms(lambda: kernels.sinkhorn_implicit_bwd(out, g))
            cells.append(f"{name} fwd {fwd / clone:5.2f}x bwd {bwd / clone:5.2f}x implicit {imp / clone:5.2f}x")
        print(f"  layout n={n:2d} T={x.shape[0]} clone {clone:.3f} ms: " + " | ".join(cells), flush=True)
    for module in (sinkhorn, sinkhorn_implicit):
        module.TILED_MIN_N = _tiles.TILED_MIN_N


def ir():
    """What the compiler made of each tiled kernel (its last launch's configuration)."""
    for n in (8, 16, 32, 64):
        x = torch.randn(64, n, n, device="cuda")
        g = torch.randn_like(x)
        launches = {
            "fwd": lambda: sinkhorn_tiled.sinkhorn_tiled_fwd(x, ITERS),
            "bwd": lambda: sinkhorn_tiled.sinkhorn_tiled_bwd(x, g, ITERS),
            "implicit": lambda: sinkhorn_tiled.sinkhorn_tiled_implicit_bwd(x, g),
        }
        kernels_ = {
            "fwd": sinkhorn_tiled.sinkhorn_tiled_fwd_kernel,
            "bwd": sinkhorn_tiled.sinkhorn_tiled_bwd_kernel,
            "implicit": sinkhorn_tiled.sinkhorn_tiled_implicit_bwd_kernel,
        }
        for kind, launch in launches.items():
            launch()
            try:
                c = [c for cache in kernels_[kind].device_caches.values() for c in cache[0].values()][-1]
            except (AttributeError, IndexError, KeyError, TypeError) as exc:
                print(f"  ir n={n} {kind}: no compiled kernel found ({exc!r})")
                continue
            ttgir = c.asm["ttgir"]
            print(f"  ir n={n} {kind:8s} regs {c.n_regs} spills {c.n_spills} "
                  f"convert_layout {ttgir.count('convert_layout')} local_alloc {ttgir.count('local_alloc')}",
                  flush=True)


def _first_call(n: int) -> None:
    x = torch.randn(64, n, n, device="cuda")
    g = torch.randn_like(x)
    t0 = time.perf_counter()
    out = kernels.sinkhorn_fwd(x, ITERS)
    kernels.sinkhorn_bwd(x, g, ITERS)
    kernels.sinkhorn_implicit_bwd(out, g)
    torch.cuda.synchronize()
    print(f"  compile n={n:2d}: forward + exact + implicit backward {time.perf_counter() - t0:.1f} s", flush=True)


def compile_times():
    for n in (4, 8, 16, 32, 33, 64):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp())
        subprocess.run([sys.executable, __file__, f"first-call={n}"], env=env, check=True)


if __name__ == "__main__":
    args = sys.argv[1:] or ["layout"]
    for arg in args:
        if arg.startswith("first-call="):
            _first_call(int(arg.split("=")[1]))
        elif arg.startswith("tiles="):
            tiles(arg.split("=")[1])
        else:
            {"tiles": tiles, "layout": layout, "ir": ir, "compile": compile_times}[arg]()
