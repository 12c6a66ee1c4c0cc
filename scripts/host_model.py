"""A CPU model of a site's host work: everything a step does on the host, with the kernel launches
replaced by the fast launcher's cache lookup (no kernel runs, no GPU needed).

    python scripts/host_model.py site    # one HyperConnection (MLP branch) and one site of a chain of 8
    python scripts/host_model.py floor   # the same with the launchers reduced to allocating their outputs
    python scripts/host_model.py fsdp    # scripts/weak_scaling.py's GPT under FSDP2 (gloo, one process)
    python scripts/host_model.py launchers  # each launcher of a site alone, at a small-token split's shape

Prints the host time each site adds over the plain residual, in us. Differences between two
versions of the package are what it is for (``PYTHONPATH=<other checkout> python ...``): absolute
numbers depend on the machine (the H100 machines' hosts are about 5x slower than this project's
development machine, an AMD EPYC).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time

if __name__ == "__main__":  # imported (scripts/eager_floor.py), the kernels run on the GPU
    os.environ["TRITON_INTERPRET"] = "1"  # lets the fused path run on CPU tensors; launches are faked below
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mhc.kernels import _launch  # noqa: E402
from mhc.mixing import HyperConnection  # noqa: E402

KERNEL_MODULES = ("stream_mix", "mhc_coefficients", "sinkhorn", "sinkhorn_eps", "sinkhorn_tiled", "sinkhorn_implicit")


def fake_launch(kernel, grid, *groups) -> None:
    """The host part of :func:`mhc.kernels._launch.launch` on a cache hit, without the launch.
    ``groups``: ``(inputs, outputs, scalars, meta, meta_key)``, or ``(args, meta, meta_key)`` for
    versions of the package before the launch key left out the outputs (to compare with them)."""
    if len(groups) == 3:
        args, _, meta_key = groups
        _launch._CACHE.get((id(kernel), meta_key, args[0].get_device(), _launch._specialization(args)))
        return
    inputs, outputs, scalars, _, meta_key = groups
    (*inputs, *outputs, *scalars)  # launch() builds this argument tuple and reads the outputs' addresses:
    [out.data_ptr() for out in outputs]  # part of its host cost, kept here
    _launch._CACHE.get((id(kernel), meta_key, inputs[0].get_device(), _launch._specialization(inputs, scalars)[0]))


@contextlib.contextmanager
def faked_launches():
    """Inside, every kernel module's launches are :func:`fake_launch`: the launchers' host work
    without the launch."""
    modules = [importlib.import_module("mhc.kernels." + name) for name in KERNEL_MODULES]
    saved = [(m, m.launch) for m in modules if hasattr(m, "launch")]
    for module, _ in saved:
        module.launch = fake_launch
    try:
        yield
    finally:
        for module, launch in saved:
            module.launch = launch


class OutputsOnly:
    """Launchers that only allocate their outputs (shapes and dtypes taken from one real call):
    what a site costs on the host with no launcher work at all, the floor of its structure
    (autograd Functions, saved tensors, parameter gradients, the layer's Python)."""

    def __init__(self, launchers, **more):
        self.launchers, self.more, self.templates = launchers, more, {}

    def _call(self, name, *args):
        if name not in self.templates:
            real = self.more[name] if name in self.more else getattr(self.launchers, name)
            self.templates[name] = real(*args)
        out = self.templates[name]
        if isinstance(out, torch.Tensor):
            return torch.empty_like(out)
        return tuple(None if t is None else torch.empty_like(t) for t in out)

    def __getattr__(self, name):
        return lambda *args: self._call(name, *args)


@contextlib.contextmanager
def outputs_only_launchers(stub: OutputsOnly | None = None):
    """Inside, the eager sites' launchers only allocate their outputs (``stub``: one kept from an
    earlier use, its shapes already taken)."""
    from mhc import layer, mixing_ops
    from mhc.kernels import mhc_coefficients

    # the names of mixing_ops' eager launchers; the coefficient backward's is the packed one
    if stub is None:
        stub = OutputsOnly(
            layer._kernels(),
            sinkhorn_bwd=mixing_ops.sinkhorn_bwd_launch,
            coefficients_bwd=mhc_coefficients.coefficients_bwd_packed,
        )
    saved = mixing_ops._launchers(), mixing_ops.sinkhorn_bwd_launch
    mixing_ops._EAGER = stub
    mixing_ops.sinkhorn_bwd_launch = lambda *args: stub._call("sinkhorn_bwd", *args)
    try:
        yield stub
    finally:
        mixing_ops._EAGER, mixing_ops.sinkhorn_bwd_launch = saved


def per_call_us(fn, calls: int, rounds: int = 15) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    times = []
    for _ in range(rounds):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)  # the fastest round: a shared machine's noise only adds time


def fused(module: nn.Module) -> nn.Module:
    for m in module.modules():
        if isinstance(m, HyperConnection):
            m.backend = "triton"
    return module


def site_model(dim: int = 64, n: int = 4, tokens: int = 4) -> None:
    from benchmark_mixing import MLP

    torch.manual_seed(0)
    plain_branch = MLP(dim)
    h = torch.randn(tokens, dim, requires_grad=True)
    site = fused(HyperConnection(dim, n, MLP(dim), init="zero"))
    chain = fused(nn.ModuleList(HyperConnection(dim, n, MLP(dim), init="zero") for _ in range(8)))
    x = torch.randn(tokens, n, dim, requires_grad=True)
    grad_h, grad_x = torch.randn_like(h), torch.randn_like(x)

    def plain():
        plain_branch.zero_grad(set_to_none=True)
        (h + plain_branch(h)).backward(grad_h)

    def one_site():
        site.zero_grad(set_to_none=True)
        site(x).backward(grad_x)

    def chained():
        chain.zero_grad(set_to_none=True)
        x_in, finish = chain[0].split(x)
        for s, nxt in zip(chain[:-1], chain[1:]):
            x_in, finish = finish(s.branch(x_in), next=nxt)
        finish(chain[-1].branch(x_in)).backward(grad_x)

    base = per_call_us(plain, 1000)
    single, in_chain = per_call_us(one_site, 1000), per_call_us(chained, 200) / 8
    print(
        f"plain residual {base:.0f} us; a site adds +{single - base:.0f} us, a site of a chain of 8 "
        f"+{in_chain - base:.0f} us"
    )


def site_launcher_calls(n: int, dim: int, tokens: int, device="cpu", dtype=torch.float32) -> dict:
    """``{name: call}``: each launcher a site calls, with arguments of a site's shapes."""
    from mhc import layer
    from mhc.kernels import mhc_coefficients as coefficients
    from mhc.kernels import stream_mix

    torch.manual_seed(0)
    M = 2 * n + n * n
    x, y = torch.randn(tokens, n, dim, dtype=dtype, device=device), torch.randn(tokens, dim, dtype=dtype, device=device)
    phi, alpha, bias = (nn.Parameter(torch.randn(shape, device=device)) for shape in ((n * dim, M), (3,), (M,)))
    _, p, r, h_pre, h_post, z_res, h_res = coefficients.coefficients_fwd_unchecked(x, phi, alpha, bias, 20, 1e-6)
    grad_x, grad_y = torch.randn_like(x), torch.randn_like(y)
    return {
        "coefficients forward": lambda: coefficients.coefficients_fwd_unchecked(x, phi, alpha, bias, 20, 1e-6),
        "post-mix forward": lambda: stream_mix.stream_mix_fwd_unchecked(x, h_res, y, h_post),
        "post-mix backward": lambda: stream_mix.stream_mix_bwd_unchecked(x, h_res, y, h_post, grad_x, None, True),
        "Sinkhorn backward": lambda: layer.sinkhorn_bwd_launch(z_res, h_res, 20, "exact", 0.0),
        "coefficient backward": lambda: coefficients.coefficients_bwd_packed(
            x, phi, alpha, p, r, h_pre, h_post, None, h_post, z_res, grad_y, grad_x, 0.0
        ),
    }


def launcher_times(n: int = 4, dim: int = 256, tokens: int = 64) -> None:
    """Each launcher a site calls, alone, on the path it takes on a GPU where tokens are few (the
    CPU's stand-in SM count makes 64 tokens at ``n * d = 1024`` take the forward split)."""
    import timeit

    total = 0.0
    for name, call in site_launcher_calls(n, dim, tokens).items():
        us = min(timeit.repeat(call, number=2000, repeat=15)) / 2000 * 1e6
        total += us
        print(f"{name:>22} {us:6.1f} us")
    print(f"{'all five':>22} {total:6.1f} us (the coefficient backward's sum of partial results runs on the CPU here)")


def fsdp_model(dim: int = 64, layers: int = 8, seq: int = 16) -> None:
    import torch.distributed as dist
    import weak_scaling
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)

    def build(arm):
        torch.manual_seed(0)
        model = fused(weak_scaling.GPT(arm, vocab=256, dim=dim, layers=layers, heads=4))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        tokens = torch.randint(0, 256, (1, seq + 1))

        def step():
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    times = {arm: per_call_us(build(arm), 20) for arm in weak_scaling.ARMS}
    sites = 2 * layers
    print(
        f"FSDP2 step: plain {times['plain'] / 1e3:.2f} ms; per site: "
        + ", ".join(f"{arm} +{(times[arm] - times['plain']) / sites:.0f} us" for arm in weak_scaling.ARMS[1:])
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "site"
    if what not in ("site", "floor", "fsdp", "launchers"):
        sys.exit(f"usage: python {sys.argv[0]} [site|floor|fsdp|launchers]")
    with faked_launches(), outputs_only_launchers() if what == "floor" else contextlib.nullcontext():
        {"fsdp": fsdp_model, "launchers": launcher_times}.get(what, site_model)()
