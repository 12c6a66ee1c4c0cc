"""Development tool for the Sinkhorn kernels on a CUDA GPU (one run, one table per section).

    python -m bench.tune_sinkhorn [tiles | tiles=bwd,implicit[:FILE]] [--write[=PATH]] [layout] [ir] [compile]

- ``tiles``: the tiled kernels' ``(BLOCK_T, RI, num_warps[, SEG, RECOMPUTE_R1])`` over a grid of
  choices (``candidates``, or the ones a JSON-lines FILE lists), per ``NP`` class (n = 8, 16, 32,
  64) at 256 MiB of fp32 logits, 20 iterations; each row is one kernel's median time
  (``do_bench``) against the clone of the logits, with its registers and spills; ``*`` marks the
  configuration in the table; ``--write`` writes each swept class's fastest into this GPU's row of
  ``mhc/kernels/tables`` (``--write=PATH``: a copy of the row with them, elsewhere);
- ``layout``: per-row kernels (``sinkhorn.py``) against the tiled ones at n = 4..16, with the
  configurations in the source: where the ``TILED_MIN_N`` switch belongs;
- ``ir``: registers, spills and layout conversions of each tiled kernel per n, as compiled;
- ``compile``: first call (cold Triton cache, fresh process) of forward + exact + implicit
  backward per n.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from bench.harness import dev_tool_args
from mhc import kernels
from mhc.kernels import _arch, _tiles, sinkhorn, sinkhorn_implicit, sinkhorn_tiled
from mhc.kernels._launch import forget_launch_plans

ITERS = 20


def _logits(n: int, mib: int = 256) -> torch.Tensor:
    T = mib * 2**20 // (4 * n * n)
    return torch.randn(T, n, n, device="cuda")


def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def candidates(np2: int, kind: str):
    """Configurations ``(BLOCK_T, RI, num_warps[, SEG, RECOMPUTE_R1])`` of the tiles table with 8
    to 128 (forward) or 64 (backward) tile entries per thread."""
    for warps in (1, 2, 4):
        for block_t in (1, 2, 4, 8, 16, 32, 64, 128):
            per_thread = block_t * np2 * np2 // (32 * warps)
            if not 8 <= per_thread <= (128 if kind == "fwd" else 64):
                continue
            for ri in (r for r in (1, 2, 4, 8, 16) if r <= np2):
                if kind == "bwd":
                    for seg in (7, 15) if np2 <= 16 else (15, 19):
                        yield (block_t, ri, warps, seg, False)
                else:
                    yield (block_t, ri, warps)


def _compiled(kernel):
    """The last compiled version of a Triton kernel (registers, spills, IR)."""
    return [c for cache in kernel.device_caches.values() for c in cache[0].values()][-1]


def tiles(only: str = "fwd,bwd,implicit", listed: str | None = None, write: str | bool = False):
    """Time every configuration of ``candidates`` per NP class, or those listed in a JSON-lines
    file (``{"np": 64, "kind": "fwd", "cfg": [1, 4, 1]}`` per line, e.g. from a compile sweep);
    ``write``: the fastest of each swept class into the table (a path: a copy of it there)."""
    chosen = None
    if listed:
        chosen = {}
        with open(listed) as f:
            for line in f:
                row = json.loads(line)
                chosen.setdefault((row["np"], row["kind"]), []).append(tuple(row["cfg"]))
    table = _arch.tuned(sinkhorn_tiled.TABLE)  # the launchers read this dict: swept in place
    winners = {}
    for n in (8, 16, 32, 64):
        x = _logits(n)
        g = torch.randn_like(x)
        out = kernels.sinkhorn_fwd(x, ITERS)
        clone = _ms(lambda: x.clone())
        print(f"\n# tiles n={n} T={x.shape[0]} clone {clone:.3f} ms", flush=True)
        config = table[str(n)]
        saved = dict(config)
        kinds = {
            "fwd": (lambda: sinkhorn_tiled.sinkhorn_tiled_fwd(x, ITERS), sinkhorn_tiled.sinkhorn_tiled_fwd_kernel),
            "bwd": (lambda: sinkhorn_tiled.sinkhorn_tiled_bwd(x, g, ITERS), sinkhorn_tiled.sinkhorn_tiled_bwd_kernel),
            "implicit": (
                lambda: sinkhorn_tiled.sinkhorn_tiled_implicit_bwd(out, g),
                sinkhorn_tiled.sinkhorn_tiled_implicit_bwd_kernel,
            ),
        }
        for kind, (call, kernel) in kinds.items():
            cfgs = candidates(n, kind) if chosen is None else chosen.get((n, kind), [])
            if kind not in only.split(",") or not cfgs:
                continue
            results = []
            for cfg in dict.fromkeys([saved[kind], *cfgs]):
                config[kind] = cfg
                forget_launch_plans()
                try:
                    ms = _ms(call)
                except Exception as exc:  # noqa: BLE001 - a config may not compile
                    print(f"  {kind} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                c = _compiled(kernel)
                results.append((ms, cfg, c.n_regs, c.n_spills))
            config[kind] = saved[kind]
            forget_launch_plans()
            for ms, cfg, regs, spills in sorted(results)[:8]:
                mark = "*" if cfg == saved[kind] else " "
                print(
                    f" {mark}{kind:9s} {str(cfg):22s} {ms:8.3f} ms ({ms / clone:5.2f}x clone) "
                    f"regs {regs} spills {spills}",
                    flush=True,
                )
            if results:
                winners.setdefault(str(n), dict(saved))[kind] = min(results)[1]
    if write and winners:
        path = _arch.write_tuned(sinkhorn_tiled.TABLE, winners, path=None if write is True else write)
        print(f"\nwrote {sorted(winners)} of {sinkhorn_tiled.TABLE} ({_arch.arch().name}) to {path}", flush=True)


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
                c = _compiled(kernels_[kind])
            except (AttributeError, IndexError, KeyError, TypeError) as exc:
                print(f"  ir n={n} {kind}: no compiled kernel found ({exc!r})")
                continue
            ttgir = c.asm["ttgir"]
            print(
                f"  ir n={n} {kind:8s} regs {c.n_regs} spills {c.n_spills} "
                f"convert_layout {ttgir.count('convert_layout')} local_alloc {ttgir.count('local_alloc')}",
                flush=True,
            )


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
    args = dev_tool_args(__doc__, ["tiles", "--write", "first-call", "layout", "ir", "compile"]) or ["layout"]
    writes = [a.partition("=")[2] or True for a in args if a.startswith("--write")]
    write = writes[0] if writes else False
    for arg in (a for a in args if not a.startswith("--write")):
        if arg.startswith("first-call="):
            _first_call(int(arg.split("=")[1]))
        elif arg.startswith("tiles"):
            kinds, _, listed = arg.partition("=")[2].partition(":")
            tiles(kinds or "fwd,bwd,implicit", listed or None, write)
        else:
            {"layout": layout, "ir": ir, "compile": compile_times}[arg]()
