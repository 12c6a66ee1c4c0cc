"""Development tool for the fused hyper-connection kernels, on a CUDA GPU (one run, one table each).

    python -m bench.tune_mixing [compile] [overhead] [host] [projection] [projection-split [tf32]]
                                  [projection-compiled]
                                  [coefficients] [coefficients-split] [small-tokens] [small-tokens-epilogues]
                                  [small-tokens-mix] [small-tokens-split] [mix-bwd] [n=8]

- ``compile``: first-call time (cold Triton cache) of a fused layer's forward + backward per n;
- ``projection``: the coefficient backward over a few tile configurations at d = 4096, 2048 and
  1024 with registers and spills, and the precision of its ``g @ phi^T`` (at n = 5..8, where the
  projection backward runs in two passes, ``projection-split``); ``coefficients``: the
  forward coefficient kernel over tile configurations at d = 4096 and 1024; n = 4 (``n=8`` as an
  argument: n = 8), 16k tokens (the launchers' config functions are replaced for the sweep);
- ``coefficients-split``: the forward split over ``K`` (``projection_partial_kernel`` +
  ``coefficients_finish_kernel``) over tile configurations and programs per SM, against one pass,
  at d = 4096 and 1024, 16k and 8k tokens, with the largest difference of its outputs;
- ``projection-compiled``: the one-pass projection backward as a compiled graph launches it
  (Inductor drops ``maxnreg``): eager against compiled, the uncapped kernel over tiles;
- ``projection-split``: at n = 5..8 (``n=8``), the projection backward as one pass against two
  (``dx``, then ``dphi``) over tile configurations of each pass;
- ``mix-bwd``: the post + residual backward at n = 6 and 8, unrolled against the wide path;
- ``small-tokens``: the coefficient forward (one pass over token tiles of 64, 32 and 16, and the
  split over ``K``) and backward (programs per SM of the projection backward) at 1k-8k tokens,
  d = 1024 and 4096, timed in CUDA graphs (no host time); ``small-tokens-epilogues``: the
  forward's finishing kernel and the coefficient-gradient kernel over tiles there;
- ``small-tokens-split``: the mix backward over ranges of ``D`` where tokens are few;
- ``host`` / ``overhead``: cProfile and host time of one layer's forward + backward at 64 tokens.

A whole training step's GPU time by kernel: ``bench/profile_model.py``.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())  # cold cache for the compile table

import torch
import torch._functorch.config
import torch._inductor.config

from bench.harness import dev_tool_args, through_sites
from mhc import kernels
from mhc.kernels import _launch, mhc_coefficients, stream_mix


def _uncached():
    """Sweeps replace the launchers' config functions: forget the configurations the launchers
    cached, and launch through ``kernel[grid]`` (which the sweeps intercept to read registers)."""
    _launch.FAST = False
    _launch.forget_launch_plans()


def compile_times():
    """First call of each launcher of one bf16 layer, per n (the Triton cache is cold)."""
    for n in (4, 16):
        x, phi, alpha, bias = _inputs(64, n, 64)
        y = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        times = {}

        def first(name, call):
            t0 = time.perf_counter()
            out = call()
            torch.cuda.synchronize()
            times[name] = time.perf_counter() - t0
            return out

        x_in, p, r, h_pre, h_post, z_res, h_res = first(
            "coefficients fwd", lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
        )
        first("post-mix fwd", lambda: kernels.stream_mix_fwd(x, h_res, y, h_post))
        first("post-mix bwd", lambda: kernels.stream_mix_bwd(x, h_res, y, h_post, torch.randn_like(x)))
        first("sinkhorn bwd", lambda: kernels.sinkhorn_bwd(z_res, torch.randn_like(z_res), 20))
        first(
            "coefficients bwd",
            lambda: kernels.coefficients_bwd(
                x, phi, alpha, p, r, h_pre, h_post, None, h_post, z_res, y, torch.randn_like(x)
            ),
        )
        print(f"  compile n={n}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()), flush=True)


def launch_overhead():
    """Host time of one site's forward + backward at 64 tokens (GPU time negligible): the branch
    alone, a plain residual, a HyperConnection called as a module, one site of a chain of eight
    (``finish(y, next=...)``), and Liger-Kernel's LigerMHC. The arms take turns over 7 rounds of
    200 calls (medians), with the gradients accumulating, and with ``zero_grad(set_to_none=True)``
    before each step as in training."""
    import statistics

    from torch import nn

    from bench.mixing import MLP, wrap
    from mhc.mixing import HyperConnection

    dim, sites, dev = 256, 8, "cuda"
    branch = MLP(dim).cuda().to(torch.bfloat16)
    h = torch.randn(64, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w_h = torch.randn_like(h)
    arms = {"branch alone": (branch, lambda: branch(h).backward(w_h), 1)}
    for arm in ("plain", "mhc", "liger"):
        try:
            module = wrap(arm, MLP(dim).cuda().to(torch.bfloat16), dim, 4)
        except Exception as e:
            print(f"  {arm}: skipped ({type(e).__name__})")
            continue
        x = torch.randn(
            (64, dim) if arm == "plain" else (64, 4, dim), device=dev, dtype=torch.bfloat16, requires_grad=True
        )
        arms[arm] = (module, (lambda m=module, x=x, w=torch.randn_like(x): m(x).backward(w)), 1)
    chain = [HyperConnection(dim, 4, MLP(dim).cuda().to(torch.bfloat16), init="zero").cuda() for _ in range(sites)]
    xc = torch.randn(64, 4, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    wc = torch.randn_like(xc)

    def chained():
        through_sites(chain, xc, chain=True).backward(wc)

    arms[f"one site of a chain of {sites}"] = (nn.ModuleList(chain), chained, sites)
    times = {(arm, fresh): [] for arm in arms for fresh in (False, True)}
    for _, step, _ in arms.values():
        _wall_time(step, 30, 1)
    for _ in range(7):
        for arm, (module, step, per) in arms.items():
            times[(arm, False)].append(_wall_time(step, 0, 200) / per)
            times[(arm, True)].append(_wall_time(lambda: (module.zero_grad(set_to_none=True), step()), 0, 200) / per)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    for arm in arms:
        acc, fresh = med[(arm, False)], med[(arm, True)]
        print(
            f"  host time fwd+bwd {arm:>28}: grads accumulating {acc:6.0f} us "
            f"(+{acc - med[('branch alone', False)]:5.0f}), zero_grad + step {fresh:6.0f} us "
            f"(+{fresh - med[('branch alone', True)]:5.0f})",
            flush=True,
        )


def _wall_time(step, warmup: int, reps: int) -> float:
    """Seconds per call of ``step``, synchronised, after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def host_profile():
    """cProfile of the host side of one mHC layer's forward + backward at 64 tokens."""
    import cProfile
    import pstats

    from bench.mixing import MLP, wrap

    module = wrap("mhc", MLP(256).cuda().to(torch.bfloat16), 256, 4)
    x = torch.randn(64, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn_like(x)
    for _ in range(20):
        module(x).backward(w)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        module(x).backward(w)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def _inputs(dim, n, T):
    K, M = n * dim, 2 * n + n * n
    x = torch.randn(T, n, dim, device="cuda", dtype=torch.bfloat16)
    phi = torch.randn(K, M, device="cuda") / math.sqrt(K)
    alpha = torch.full((3,), 0.5, device="cuda")
    bias = torch.zeros(2 * n + n * n, device="cuda")
    return x, phi, alpha, bias


def _time(label, call, nbytes):
    """Median ms of ``call`` and its GB/s; a configuration the device cannot run is reported."""
    from triton.testing import do_bench

    try:
        ms = do_bench(call, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # e.g. more shared memory than the device has
        print(f"  {label}: failed {type(e).__name__}", flush=True)
        return None
    print(f"  {label}: {ms:7.3f} ms {nbytes / ms / 1e6:6.0f} GB/s", flush=True)
    return ms


def _coefficient_backward_call(dim, n, T):
    """``(call, nbytes, inputs)``: the coefficient backward of bf16 streams ``[T, n, dim]`` as a
    function of nothing, the bytes its one-pass form moves (``4X + 2Y``) and its inputs
    ``(x, phi, alpha, p, r, h_pre, h_post, h_res, g_in, g_acc)``."""
    x, phi, alpha, bias = _inputs(dim, n, T)
    x_in, p, r, h_pre, h_post, z_res, h_res = kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    g_in = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    g_acc = torch.randn_like(x)
    nbytes = 4 * x.numel() * 2 + 2 * g_in.numel() * 2
    call = lambda: kernels.coefficients_bwd(x, phi, alpha, p, r, h_pre, h_post, None, h_post, h_res, g_in, g_acc)
    return call, nbytes, (x, phi, alpha, p, r, h_pre, h_post, h_res, g_in, g_acc)


def _compiled_projection_kernel(call):
    """The compiled projection backward kernel that ``call`` launches (its registers and spills),
    with the launches going through ``kernel[grid]`` (:func:`_uncached`)."""
    jit, captured = mhc_coefficients.projection_bwd_kernel, {}

    class Capture:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured["k"] = jit[grid](*args, **kwargs)

            return launch

    mhc_coefficients.projection_bwd_kernel = Capture()
    try:
        call()
    finally:
        mhc_coefficients.projection_bwd_kernel = jit
    return captured["k"]


def sweep_projection():
    """Coefficient backward (gradient + projection kernels) over tile configurations of the
    one-pass projection backward (n <= 4), with the registers and spills of each compile; then
    ``g @ phi^T`` in tf32x3 against tf32 (bf16 ``dx``). At n = 5..8 the launcher runs two passes:
    :func:`sweep_projection_split` sweeps those."""
    if 4 < STREAMS <= 8:
        sweep_projection_split()
        return
    configs = [
        (64, 64, 4, 3, 8, None),
        (64, 64, 4, 3, 8, 168),
        (64, 64, 4, 3, 4, 168),
        (64, 64, 4, 2, 8, 168),
        (64, 64, 4, 3, 16, 168),
        (32, 128, 4, 3, 8, None),
        (64, 128, 8, 3, 8, None),
        (64, 64, 4, 2, 4, None),
    ]
    original, precision = mhc_coefficients.projection_bwd_config, mhc_coefficients.dx_precision
    for dim in (4096, 2048, 1024):
        n, T = STREAMS, 16384
        call, nbytes, (x, phi, alpha, p, r, h_pre, h_post, h_res, g_in, g_acc) = _coefficient_backward_call(dim, n, T)
        print(f"  d={dim}: launcher's choice {original(n, dim)}", flush=True)
        for cfg in configs:
            mhc_coefficients.projection_bwd_config = lambda *args, cfg=cfg: cfg
            _uncached()
            k = _compiled_projection_kernel(call)
            resources = f"regs {k.n_regs} spills {k.n_spills} shared {k.metadata.shared}"
            _time(f"coefficients bwd d={dim} {cfg} {resources}", call, nbytes)
        mhc_coefficients.projection_bwd_config = original
        _uncached()
        dx32, dphi32 = kernels.coefficients_bwd(
            x.float(), phi, alpha, p, r, h_pre, h_post, None, h_post, h_res, g_in.float(), g_acc.float()
        )[:2]
        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
        for mode in ("tf32x3", "tf32") if n <= 4 else ():  # tf32 for n > 8: see dx_precision
            mhc_coefficients.dx_precision = lambda dtype, n, mode=mode: mode
            _uncached()
            dx, dphi = call()[:2]
            _time(f"coefficients bwd d={dim} g @ phi^T in {mode}", call, nbytes)
            print(f"    dx {rel(dx, dx32):.3e}, dphi {rel(dphi, dphi32):.3e} from the fp32 path", flush=True)
        mhc_coefficients.dx_precision = precision


def sweep_projection_compiled():
    """The one-pass projection backward (n <= 4) as a compiled graph launches it: Inductor compiles
    a traced kernel without the launch's ``maxnreg``. The coefficient backward op eager and
    compiled with the launchers' choices (and the time per call of each of its kernels); the
    uncapped kernel eagerly over tiles, warps, stages and programs per SM, and with the token
    splits that finish in the fewest rounds of the programs its registers let an SM hold; then the
    fastest three compiled. d = 4096, 2048 and 1024, 16k tokens."""
    tiles = [(bt, bd, w, s) for bt in (32, 64, 128) for bd in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    config, resident = mhc_coefficients.projection_bwd_config, mhc_coefficients.resident_programs
    fast, op = _launch.FAST, torch.ops.mhc.mhc_coefficients_bwd
    # a cached graph is found by the graph (one call of the op), not by the kernels it launches
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False

    def use(cfg, programs=None):
        """The launcher's rules (``cfg`` None), or ``cfg`` with its splits planned for ``programs``
        resident per SM (None: about ``waves`` per SM); timed through the fast launch."""
        mhc_coefficients.projection_bwd_config = config if cfg is None else lambda *args: cfg
        mhc_coefficients.resident_programs = resident if programs is None else lambda *args: programs
        _launch.forget_launch_plans()
        _launch.FAST = fast

    for dim in (4096, 2048, 1024):
        n, T = STREAMS, 16384
        call, nbytes, (x, phi, alpha, p, r, h_pre, h_post, h_res, g_in, g_acc) = _coefficient_backward_call(dim, n, T)
        args = (x, phi, alpha, p, r, h_pre, h_post, None, h_post, h_res, g_in, g_acc, 0.0)

        def compiled(cfg, programs=None):
            use(cfg, programs)
            torch._dynamo.reset()
            step = torch.compile(lambda *a: op(*a), fullgraph=True)
            step(*args)
            return lambda: step(*args)

        use(None)
        _time(f"d={dim} eager, launcher's choice {config(n, dim)}", call, nbytes)
        _print_kernel_times("eager", call)
        step = compiled(None)
        _time(f"d={dim} compiled, launcher's choice {config(n, dim, torch.bfloat16, False)}", step, nbytes)
        _print_kernel_times("compiled", step)
        results = []
        for tile in tiles:
            use((*tile, 2, None))
            _uncached()
            try:
                k = _compiled_projection_kernel(call)
            except Exception as e:  # e.g. more shared memory than the device has
                print(f"  d={dim} {tile}: failed {type(e).__name__}", flush=True)
                continue
            programs = max(1, resident(k.n_regs, tile[2]))  # what the kernel's registers let an SM hold
            for waves, rounds_of in [(w, None) for w in (2, 3, 4, 6, 8)] + [(8, programs)]:
                cfg = (*tile, waves, None)
                use(cfg, rounds_of)
                plan = f"fewest rounds of {programs}" if rounds_of else f"{waves} per SM"
                label = f"d={dim} uncapped {cfg} {plan}, regs {k.n_regs} spills {k.n_spills}"
                ms = _time(label, call, nbytes)
                if ms is not None:
                    results.append((ms, cfg, rounds_of))
        for _, cfg, rounds_of in sorted(results)[:3]:
            _time(f"d={dim} compiled {cfg} rounds of {rounds_of}", compiled(cfg, rounds_of), nbytes)
    use(None)


def _print_kernel_times(label, call, reps: int = 20):
    """GPU time per call of each kernel ``call`` launches (``torch.profiler``), in microseconds."""
    from bench.profile_model import device_times

    call()
    ms, _ = device_times(call, reps)
    for name, per_call in ms.items():
        print(f"    {label} {name[:60]}: {per_call * 1e3:8.1f} us/call", flush=True)


def sweep_projection_split():
    """Coefficient backward at n = 5..8 with the projection backward as one pass (``dx`` and
    ``dphi`` together) against two passes (``dx``, then ``dphi``), over tile configurations of each
    pass, at d = 4096 and 1024, 16k tokens: time, registers and spills, and the results' agreement
    with the one-pass kernel. ``tf32`` among the arguments: the ``dx`` pass's ``g @ phi^T`` in one
    tf32 product instead of tf32x3 (run it in a process of its own: it may stop the context)."""
    n, T = STREAMS, 16384
    precision = "tf32" if "tf32" in sys.argv[1:] else "tf32x3"
    originals = (
        mhc_coefficients.projection_bwd_config,
        mhc_coefficients.dphi_bwd_config,
        mhc_coefficients.projection_passes,
        mhc_coefficients.dx_precision,
    )
    jit = mhc_coefficients.projection_bwd_kernel
    captured = []

    class Capture:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                captured.append(jit[grid](*args, **kwargs))

            return launch

    def run(passes, dx_cfg, dphi_cfg, label, call, nbytes):
        mhc_coefficients.projection_passes = lambda n: passes
        mhc_coefficients.projection_bwd_config = lambda *args: dx_cfg
        mhc_coefficients.dphi_bwd_config = lambda n, d, dtype=None: dphi_cfg
        mhc_coefficients.dx_precision = lambda dtype, n: precision if passes == ("dx", "dphi") else "tf32x3"
        _uncached()
        captured.clear()
        mhc_coefficients.projection_bwd_kernel = Capture()
        try:
            out = call()
        except Exception as e:
            print(f"  {label}: failed {type(e).__name__}", flush=True)
            return None, None
        finally:
            mhc_coefficients.projection_bwd_kernel = jit
        resources = " | ".join(f"regs {k.n_regs} spills {k.n_spills}" for k in captured)
        return out, _time(f"{label} [{resources}]", call, nbytes)

    one_pass = originals[0](n, 4096)
    dx_configs = [
        (64, 64, 4, 3, 6, None),
        (64, 64, 4, 2, 4, None),
        (32, 64, 4, 3, 6, None),
        (64, 128, 8, 3, 4, None),
        (32, 128, 4, 3, 6, None),
        (64, 64, 4, 3, 6, 168),
        (128, 64, 8, 3, 4, None),
    ]
    dphi_configs = [
        (64, 64, 4, 3, 4, None),
        (128, 64, 4, 3, 4, None),
        (64, 128, 8, 3, 4, None),
        (64, 64, 4, 4, 8, None),
        (128, 128, 8, 3, 4, None),
        (32, 64, 4, 3, 8, None),
    ]
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    for dim in (4096, 1024):
        call, nbytes, _ = _coefficient_backward_call(dim, n, T)
        ref, _ = run(("both",), one_pass, None, f"d={dim} n={n} one pass {one_pass}", call, nbytes)
        best = {}
        for which, configs in (("dx", dx_configs), ("dphi", dphi_configs)):
            for cfg in configs:
                dx_cfg = cfg if which == "dx" else best.get("dx", dx_configs[0])
                dphi_cfg = cfg if which == "dphi" else dphi_configs[0]
                out, ms = run(
                    ("dx", "dphi"),
                    dx_cfg,
                    dphi_cfg,
                    f"d={dim} n={n} two passes ({precision}) dx {dx_cfg} dphi {dphi_cfg}",
                    call,
                    nbytes,
                )
                if ms is not None:
                    if ms < best.get(which + "_ms", float("inf")):
                        best[which], best[which + "_ms"] = cfg, ms
                    print(
                        f"    against one pass: dx {rel(out[0], ref[0]):.2e}, dphi {rel(out[1], ref[1]):.2e}, "
                        f"biases and gates {rel(out[2], ref[2]):.2e}",
                        flush=True,
                    )
        print(f"  d={dim}: best dx pass {best.get('dx')}, dphi pass {best.get('dphi')}", flush=True)
    (
        mhc_coefficients.projection_bwd_config,
        mhc_coefficients.dphi_bwd_config,
        mhc_coefficients.projection_passes,
        mhc_coefficients.dx_precision,
    ) = originals
    _uncached()


def sweep_coefficients():
    configs = [
        (64, 128, 4, 3),
        (64, 64, 4, 4),
        (32, 128, 4, 3),
        (64, 256, 8, 3),
        (128, 64, 8, 3),
        (32, 256, 4, 3),
        (64, 128, 8, 4),
        (32, 64, 4, 3),
        (16, 64, 4, 3),
        (16, 128, 4, 3),
        (32, 64, 8, 3),
        (32, 32, 4, 3),
    ]
    if STREAMS > 4:  # registers from offline sm_90 compiles: 244, 166, 156, 175, 147 (no spills)
        configs = [
            (64, 64, 4, 4),
            (32, 64, 4, 3),
            (64, 32, 4, 3),
            (32, 128, 8, 3),
            (64, 64, 8, 3),
            # 128 tokens per program: half the reads of phi from L2 (10 MiB per program at n = 8)
            (128, 32, 8, 3),
            (128, 64, 8, 3),
            (128, 32, 4, 3),
            (128, 64, 8, 2),
        ]
    original = mhc_coefficients.coefficients_fwd_config, mhc_coefficients.coefficients_split_config
    mhc_coefficients.coefficients_split_config = lambda n, d, tokens, sms: None  # the one-pass kernel
    for dim in (4096, 1024):
        x, phi, alpha, bias = _inputs(dim, STREAMS, 16384)
        for cfg in configs:
            mhc_coefficients.coefficients_fwd_config = lambda n, cfg=cfg: cfg
            _uncached()
            call = lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
            _time(f"coefficients fwd d={dim} {cfg}", call, 2 * x.numel() * 2)
    mhc_coefficients.coefficients_fwd_config, mhc_coefficients.coefficients_split_config = original
    _uncached()


def sweep_coefficients_split():
    configs = [
        None,
        (128, 64, 8, 3, 4),
        (128, 64, 8, 3, 2),
        (128, 64, 4, 3, 4),
        (128, 128, 8, 3, 4),
        (256, 64, 8, 3, 4),
        (64, 64, 4, 4, 4),
        (128, 64, 8, 4, 6),
        (128, 32, 4, 3, 4),
    ]
    finishes = [(64, 64, 4), (32, 128, 4), (64, 128, 8)]  # the first: with every configuration
    original = mhc_coefficients.coefficients_split_config, mhc_coefficients.coefficients_finish_config
    for dim in (4096, 1024):
        for T in (16384, 8192):
            x, phi, alpha, bias = _inputs(dim, STREAMS, T)
            ref = None
            for cfg in configs:
                for fin in finishes if cfg == (128, 64, 8, 3, 4) else finishes[:1]:
                    mhc_coefficients.coefficients_split_config = lambda n, d, tokens, sms, cfg=cfg: cfg
                    mhc_coefficients.coefficients_finish_config = lambda n, few, decode=False, fin=fin: fin
                    _uncached()
                    call = lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
                    out = call()
                    ref = out if ref is None else ref
                    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, ref))
                    splits = (
                        "one pass"
                        if cfg is None
                        else mhc_coefficients.k_splits(T, STREAMS * dim, cfg[0], cfg[1], cfg[4], x.device)
                    )
                    _time(
                        f"coefficients fwd d={dim} T={T} {cfg} finish {fin} splits {splits} diff {err:.1e}",
                        call,
                        2 * x.numel() * 2,
                    )
    mhc_coefficients.coefficients_split_config, mhc_coefficients.coefficients_finish_config = original
    _uncached()


def _time_graph(label, call, nbytes):
    """``_time`` with the calls replayed from a CUDA graph: the kernels' time without the host's."""
    from triton.testing import do_bench_cudagraph

    call()
    ms = do_bench_cudagraph(call, rep=50, return_mode="median")
    print(f"  {label}: {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s", flush=True)
    return ms


def sweep_small_tokens():
    """Where tokens are few, the coefficient forward's one-pass grid (a program per 64 tokens) is
    smaller than the GPU: token tiles of 64, 32, 16 against the split over ``K``; and the
    projection backward's token splits (its partial ``dphi`` grows with them) at 2-12 programs
    per SM."""
    one_pass = [(64, 128, 4, 3), (32, 128, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3)]
    splits = [(128, 64, 8, 3, 4), (64, 64, 4, 3, 4), (64, 64, 4, 3, 8), (128, 64, 8, 3, 8), (64, 128, 4, 3, 4)]
    originals = (
        mhc_coefficients.coefficients_fwd_config,
        mhc_coefficients.coefficients_split_config,
        mhc_coefficients.projection_bwd_config,
    )
    for dim in (1024, 4096):
        for T in (1024, 2048, 4096, 8192):
            x, phi, alpha, bias = _inputs(dim, STREAMS, T)
            fwd = lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
            for cfg in one_pass + splits:
                split = cfg if len(cfg) == 5 else None
                mhc_coefficients.coefficients_split_config = lambda n, d, tokens, sms, split=split: split
                mhc_coefficients.coefficients_fwd_config = lambda n, cfg=cfg: cfg[:4]
                _uncached()
                if split is None:
                    detail = f"one pass, {mhc_coefficients.cdiv(T, cfg[0])} programs"
                else:
                    k_split = mhc_coefficients.k_splits(T, STREAMS * dim, cfg[0], cfg[1], cfg[4], x.device)[0]
                    detail = f"split, {mhc_coefficients.cdiv(T, cfg[0])} x {k_split} programs"
                _time_graph(f"fwd d={dim} T={T} {cfg} {detail}", fwd, 2 * x.numel() * 2)
            mhc_coefficients.coefficients_fwd_config, mhc_coefficients.coefficients_split_config = originals[:2]
            call, nbytes, _ = _coefficient_backward_call(dim, STREAMS, T)
            for waves in (2, 3, 6, 12):
                mhc_coefficients.projection_bwd_config = lambda *args, w=waves: (
                    *originals[2](*args)[:4],
                    w,
                    originals[2](*args)[5],
                )
                _uncached()
                _time_graph(f"bwd d={dim} T={T} waves {waves}", call, nbytes)
            mhc_coefficients.projection_bwd_config = originals[2]
    _uncached()


def sweep_small_tokens_epilogues():
    """The launches around the projections where tokens are few: the forward's finishing kernel
    (after the split over ``K``) over token tiles, and the coefficient-gradient kernel over tiles
    and warps, at 1k-4k tokens and at 16k (no loss there)."""
    finishes = [(32, 128, 4), (16, 128, 4), (16, 256, 4), (16, 64, 4), (8, 128, 4), (16, 128, 2)]
    grads = [(8, 128, 4), (4, 128, 4), (4, 256, 4), (16, 128, 4), (8, 256, 4), (8, 128, 8), (16, 256, 8), (4, 128, 2)]
    original = mhc_coefficients.coefficients_finish_config
    for dim in (1024, 4096):
        for T in (1024, 2048, 4096, 16384):
            x, phi, alpha, bias = _inputs(dim, STREAMS, T)
            fwd = lambda: kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
            split = mhc_coefficients.coefficients_split_config(STREAMS, dim, T, mhc_coefficients.sm_count(x.device))
            for cfg in finishes if split is not None else []:
                mhc_coefficients.coefficients_finish_config = lambda n, few, decode=False, cfg=cfg: cfg
                _uncached()
                _time_graph(f"fwd d={dim} T={T} split {split} finish {cfg}", fwd, 2 * x.numel() * 2)
            mhc_coefficients.coefficients_finish_config = original
            g_in = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
            _sweep_coefficient_grad(x, phi, alpha, bias, g_in, grads)
    _uncached()


def _sweep_coefficient_grad(x, phi, alpha, bias, g_in, configs):
    """The coefficient-gradient kernel over ``configs`` (``coefficient_grad_config``'s tuples)."""
    (T, _, dim), original = x.shape, mhc_coefficients.coefficient_grad_config
    _, p, r, h_pre, h_post, z_res, _ = kernels.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    grad = lambda: mhc_coefficients.coefficient_grad(x, alpha, p, r, h_pre, h_post, None, h_post, z_res, g_in, 0.0)
    for cfg in configs:
        mhc_coefficients.coefficient_grad_config = lambda n, d, tokens, sms, cfg=cfg: cfg
        _uncached()
        _time_graph_or_fail(f"coefficient grad d={dim} T={T} {cfg}", grad, x.numel() * 2 + g_in.numel() * 2)
    mhc_coefficients.coefficient_grad_config = original


def sweep_small_tokens_projection():
    """The projection backward where tokens are few: token and channel tiles, warps, stages,
    programs per SM and the fewest token blocks per split, the whole coefficient backward timed
    from CUDA-graph replays at 1k-4k tokens and at 16k (no loss there)."""
    # (BLOCK_T, BLOCK_D, num_warps, num_stages, waves, maxnreg, MIN_SPLIT_BLOCKS)
    configs = [
        (64, 64, 4, 3, 6, 168, 4),
        (64, 64, 4, 3, 3, 168, 4),
        (64, 64, 4, 3, 6, 168, 2),
        (32, 64, 4, 3, 6, 168, 4),
        (32, 64, 4, 3, 12, 168, 4),
        (64, 32, 4, 3, 6, 168, 4),
        (32, 32, 4, 3, 12, None, 4),
        (64, 64, 4, 2, 6, 168, 4),
        (64, 128, 8, 3, 6, None, 4),
        (32, 128, 4, 3, 6, None, 4),
        (128, 64, 8, 3, 6, None, 4),
    ]
    original, min_blocks = mhc_coefficients.projection_bwd_config, mhc_coefficients.MIN_SPLIT_BLOCKS
    for dim in (1024, 4096):
        for T in (1024, 2048, 4096, 16384):
            call, nbytes, _ = _coefficient_backward_call(dim, STREAMS, T)
            for cfg in configs:
                mhc_coefficients.projection_bwd_config = lambda *args, cfg=cfg: cfg[:6]
                mhc_coefficients.MIN_SPLIT_BLOCKS = cfg[6]
                _uncached()
                _time_graph(f"bwd d={dim} T={T} {cfg}", call, nbytes)
    mhc_coefficients.projection_bwd_config, mhc_coefficients.MIN_SPLIT_BLOCKS = original, min_blocks
    _uncached()


def sweep_small_tokens_mix():
    """The two launches that run a program per few tokens over all of ``D`` where tokens are few:
    the post-mix backward (``stream_mix_bwd``, n = 4 streams out) and the coefficient-gradient
    kernel, over ``(BLOCK_T, BLOCK_D, num_warps)`` at 1k-4k tokens and at 16k (no loss there),
    d = 1024 and 4096, timed from CUDA-graph replays."""
    mixes = [
        (4, 256, 4),
        (2, 512, 4),
        (1, 1024, 4),
        (1, 1024, 8),
        (2, 256, 4),
        (1, 512, 4),
        (2, 512, 8),
        (1, 512, 2),
        (1, 256, 2),
    ]
    grads = [
        (4, 128, 4),
        (2, 256, 4),
        (1, 512, 4),
        (1, 1024, 4),
        (2, 512, 4),
        (1, 256, 2),
        (2, 128, 2),
        (1, 1024, 8),
        (1, 512, 2),
    ]
    original = stream_mix._bwd_config
    for dim in (1024, 4096):
        for T in (1024, 2048, 4096, 16384):
            x, phi, alpha, bias = _inputs(dim, STREAMS, T)
            y = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
            w, b = torch.rand(T, STREAMS, STREAMS, device="cuda"), torch.rand(T, STREAMS, device="cuda")
            g = torch.randn_like(x)
            mix = lambda: kernels.stream_mix_bwd(x, w, y, b, g)
            for cfg in mixes:
                stream_mix._bwd_config = lambda n, n_out, d, cfg=cfg: cfg
                _uncached()
                _time_graph_or_fail(f"mix bwd d={dim} T={T} {cfg}", mix, 3 * x.numel() * 2 + 2 * y.numel() * 2)
            stream_mix._bwd_config = original
            _sweep_coefficient_grad(x, phi, alpha, bias, y, grads)
    _uncached()


def sweep_small_tokens_split():
    """The backward of a mix split over ranges of ``D`` where tokens are few (``bwd_d_splits``):
    the post-mix (4 streams out, with ``y``) and the pre-mix (one out, adding another gradient of
    ``x``) over 1-8 ranges, their partial sums' launch included, at 512-4k tokens and at 16k (no
    loss there), d = 1024-8192. Each call runs over 4 sets of inputs in turn (more bytes than L2
    holds), timed from CUDA-graph replays; the launcher's own choice is marked."""
    original = stream_mix.bwd_d_splits
    sms = mhc_coefficients.sm_count(torch.device("cuda"))
    for dim in (1024, 2048, 4096, 8192):
        for T in (512, 1024, 2048, 4096, 16384):
            if T * dim > 16384 * 4096:
                continue
            for n_out in (STREAMS, 1):
                chosen = original(STREAMS, n_out, dim, T, sms)
                sets = []
                for _ in range(4):
                    x = torch.randn(T, STREAMS, dim, device="cuda", dtype=torch.bfloat16)
                    w = torch.rand(T, n_out, STREAMS, device="cuda")
                    y, b = (
                        (torch.randn(T, dim, device="cuda", dtype=torch.bfloat16), torch.rand(T, n_out, device="cuda"))
                        if n_out > 1
                        else (None, None)
                    )
                    g = torch.randn(T, n_out, dim, device="cuda", dtype=torch.bfloat16)
                    acc = torch.randn_like(x) if n_out == 1 else None
                    sets.append((x, w, y, b, g, acc))
                nbytes = (2 * x.numel() + g.numel() + (y.numel() * 2 if n_out > 1 else x.numel())) * 2
                calls = lambda: [kernels.stream_mix_bwd(*args) for args in sets]
                chunks = -(-dim // stream_mix._bwd_config(STREAMS, n_out, dim)[1])
                for splits in (1, 2, 3, 4, 8):
                    if splits > 1 and chunks < splits * 2:  # ranges of 2 chunks at least
                        continue
                    stream_mix.bwd_d_splits = lambda n, n_out, d, tokens, s, splits=splits: splits
                    _uncached()
                    mark = " <- launcher" if splits == chosen else ""
                    _time_graph(
                        f"{'post' if n_out > 1 else 'pre'}-mix bwd d={dim} T={T} ranges={splits}{mark}",
                        calls,
                        4 * nbytes,
                    )
    stream_mix.bwd_d_splits = original
    _uncached()


def _time_graph_or_fail(label, call, nbytes):
    try:
        return _time_graph(label, call, nbytes)
    except Exception as e:  # a configuration that does not compile or run
        print(f"  {label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def sweep_mix_bwd():
    """Post + residual backward (N_OUT = n) at d = 4096, n = 6 and 8: unrolled stream tiles against
    the wide 3-D path (streams padded to 16 for its batched dot), over tile shapes."""
    unroll, config = stream_mix._unroll, stream_mix._bwd_config
    T = 16384
    for dim in (4096,):
        for n in (6, 8):
            x = torch.randn(T, n, dim, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(T, n, n, device="cuda")
            b = torch.rand(T, n, device="cuda")
            g = torch.randn_like(x)
            nbytes = 3 * x.numel() * 2 + 2 * y.numel() * 2
            variants = [("unrolled", True, c) for c in ((2, 256), (4, 128), (8, 64), (16, 32), (4, 256))]
            variants += [("wide", False, c) for c in ((4, 64), (8, 32), (2, 128), (8, 64), (16, 16))]
            for name, unrolled, cfg in variants:
                stream_mix._unroll = lambda n, n_out, u=unrolled: dict(UNROLL=u, NP=max(16, stream_mix.next_pow2(n)))
                stream_mix._bwd_config = lambda n, n_out, d, cfg=cfg: (*cfg, 4)
                _uncached()
                _time(f"mix bwd d={dim} n={n} {name} {cfg}", lambda: kernels.stream_mix_bwd(x, w, y, b, g), nbytes)
    stream_mix._unroll, stream_mix._bwd_config = unroll, config


SWEEPS = (
    ("compile", compile_times),
    ("overhead", launch_overhead),
    ("projection", sweep_projection),
    ("projection-split", sweep_projection_split),
    ("projection-compiled", sweep_projection_compiled),
    ("mix-bwd", sweep_mix_bwd),
    ("coefficients", sweep_coefficients),
    ("coefficients-split", sweep_coefficients_split),
    ("small-tokens", sweep_small_tokens),
    ("small-tokens-epilogues", sweep_small_tokens_epilogues),
    ("small-tokens-projection", sweep_small_tokens_projection),
    ("small-tokens-mix", sweep_small_tokens_mix),
    ("small-tokens-split", sweep_small_tokens_split),
)


if __name__ == "__main__":
    args = dev_tool_args(__doc__, [name for name, _ in SWEEPS] + ["host", "tf32", "n"])
    # "n=8" among the arguments: the projection and coefficient sweeps at n = 8 streams (default 4)
    STREAMS = next((int(a[2:]) for a in args if a.startswith("n=")), 4)
    todo = args or ["compile", "overhead", "projection", "coefficients"]
    if "host" in todo:
        host_profile()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name, fn in SWEEPS:
        if name in todo:
            print(f"# {name}", flush=True)
            fn()
