"""The backward of a site without the post-mix's ``dx``: what the projection backward costs when it
mixes the post-mix's output gradient itself, against the post-mix backward writing ``dx`` and the
projection backward reading it back.

    python scripts/dx_handover_bench.py [--dims 1024 4096] [--tokens 1024 2048 16384] [--block-d 64 32 16]

Per size, bf16 streams, n = 4, four sets of inputs in turn (more bytes than L2 holds), each
launch replayed from a CUDA graph (do_bench_cudagraph medians, us per set):

- ``handover``: ``stream_mix_bwd`` writes ``dx = h_res^T dout``, ``coefficients_bwd`` adds it;
- ``mixed``: ``stream_mix_bwd`` writes no ``dx``, ``coefficients_bwd`` reads ``dout`` and adds
  ``h_res^T dout`` itself (``acc_h_res``).

Also prints the largest difference of the two ``dx`` relative to their size. ``--block-d``: the
projection backward's channel tiles per stream (the launcher's is 64); narrower tiles are what a
program covering every stream of a chunk would read per stream, with the registers of today's.
"""

import argparse

import torch
from triton.testing import do_bench_cudagraph

from mhc.kernels import _launch, mhc_coefficients, stream_mix

N = 4


def inputs(dim: int, T: int):
    x = torch.randn(T, N, dim, device="cuda", dtype=torch.bfloat16)
    phi = torch.randn(N * dim, 2 * N + N * N, device="cuda") / (N * dim) ** 0.5
    alpha = torch.full((3,), 0.5, device="cuda")
    bias = torch.zeros(2 * N + N * N, device="cuda")
    _, p, r, h_pre, h_post, z_res, h_res = mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6)
    y = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(x)
    dx_in = torch.randn_like(y)
    dz = torch.randn_like(z_res)
    return x, phi, alpha, p, r, h_pre, h_post, h_res, y, dout, dx_in, dz


def handover(x, phi, alpha, p, r, h_pre, h_post, h_res, y, dout, dx_in, dz):
    dx_post = stream_mix.stream_mix_bwd_unchecked(x, h_res, y, h_post, dout, None, True)[0]
    return mhc_coefficients.coefficients_bwd_packed(x, phi, alpha, p, r, h_pre, h_post, None, h_post, dz, dx_in,
                                                    dx_post)[0]


def mixed(x, phi, alpha, p, r, h_pre, h_post, h_res, y, dout, dx_in, dz):
    stream_mix.stream_mix_bwd_unchecked(x, h_res, y, h_post, dout, None, False)
    return mhc_coefficients.coefficients_bwd_packed(x, phi, alpha, p, r, h_pre, h_post, None, h_post, dz, dx_in,
                                                    dout, 0.0, h_res)[0]


def time_us(call, sets) -> float:
    run = lambda: [call(*s) for s in sets]
    run()
    return do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(sets)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 16384])
    p.add_argument("--block-d", type=int, nargs="+", default=[])
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for dim in args.dims:
        for T in args.tokens:
            if T * dim > 16384 * 4096:
                continue
            torch.manual_seed(0)
            sets = [inputs(dim, T) for _ in range(4)]
            a, b = handover(*sets[0]), mixed(*sets[0])
            err = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
            mix_dx = time_us(lambda *s: stream_mix.stream_mix_bwd_unchecked(s[0], s[7], s[8], s[6], s[9], None, True),
                             sets)
            mix_no_dx = time_us(
                lambda *s: stream_mix.stream_mix_bwd_unchecked(s[0], s[7], s[8], s[6], s[9], None, False), sets)
            both_a, both_b = time_us(handover, sets), time_us(mixed, sets)
            print(f"d={dim} T={T}: handover {both_a:7.1f} us (post-mix bwd {mix_dx:6.1f}), "
                  f"mixed {both_b:7.1f} us (post-mix bwd {mix_no_dx:6.1f}); "
                  f"coefficient bwd {both_a - mix_dx:6.1f} -> {both_b - mix_no_dx:6.1f}; "
                  f"mixed/handover {both_b / both_a:.3f}; dx rel. diff {err:.1e}", flush=True)
            for block_d in args.block_d:
                narrow_tiles(block_d)
                print(f"  projection backward tiles (64, {block_d}): handover {time_us(handover, sets):7.1f} us, "
                      f"mixed {time_us(mixed, sets):7.1f} us", flush=True)
            if args.block_d:
                narrow_tiles(None)


def narrow_tiles(block_d: int | None) -> None:
    """The projection backward's tiles with ``block_d`` channels (``None``: the launcher's own)."""
    if block_d is None:
        mhc_coefficients.projection_bwd_config = CONFIG
    else:
        mhc_coefficients.projection_bwd_config = lambda n, d, dtype=None: (64, block_d, *CONFIG(n, d)[2:])
    _launch.FAST = False  # the fast path caches kernels by configuration name, not by tile
    _launch.forget_launch_plans()


CONFIG = mhc_coefficients.projection_bwd_config


if __name__ == "__main__":
    main()
