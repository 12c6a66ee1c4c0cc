"""How ``DTensor`` runs the registered ``mhc`` ops: a sharding rule per op (``docs/distributed.md``).

Every op computes per token (tokens in dim 0; the site's parameters apart), so it runs without
communication with everything ``Replicate()``, or with the per-token tensors ``Shard(0)`` and the
parameters replicated (their gradients then ``Partial()``). ``DTensor`` redistributes any other
layout to one of these. The rules are registered at import wherever ``torch.distributed`` is.
"""

from __future__ import annotations

import torch

from mhc._compat import is_dtensor

__all__ = ["register_rules", "is_dtensor", "on_local_shards"]


def on_local_shards(fn, x, block_dims: int):
    """``fn(x)`` on each rank's local tensor of a ``DTensor`` ``x``, for an ``fn`` that treats each block
    of the last ``block_dims`` dims on its own; a mesh dim that shards a block dim or holds partial
    sums is replicated first. Returns a ``DTensor`` like ``x``; autograd flows through."""
    from torch.distributed.tensor import DTensor, Replicate

    def kept(p):
        return p.is_replicate() or (p.is_shard() and p.dim % x.ndim < x.ndim - block_dims)

    placements = tuple(p if kept(p) else Replicate() for p in x.placements)
    if placements != tuple(x.placements):
        x = x.redistribute(x.device_mesh, placements)
    out = fn(x.to_local())
    stride = torch.empty(x.shape, device="meta").stride()  # fn's output is contiguous
    return DTensor.from_local(out, x.device_mesh, placements, run_check=False, shape=x.shape, stride=stride)


def _is_tensor(arg) -> bool:
    # register_sharding hands over tensor arguments as DTensor's specs, which carry placements
    return hasattr(arg, "placements")


def _strategies(args, outputs: int, replicated=(), partial_outputs=(), empty_outputs=()):
    """The two layouts of the module docstring for an op called with ``args``: ``(outputs,
    inputs)`` placement lists, ``None`` for arguments that are not tensors. ``replicated``: the
    indices of parameter arguments; ``partial_outputs``: outputs that sum over tokens;
    ``empty_outputs``: placeholder outputs of size 0 (replicated)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def inputs(per_token):
        return [
            None if not _is_tensor(a) else (Replicate() if i in replicated else per_token) for i, a in enumerate(args)
        ]

    def sharded_output(i):
        if i in empty_outputs:
            return Replicate()
        return Partial() if i in partial_outputs else Shard(0)

    everything_replicated = ([Replicate()] * outputs, inputs(Replicate()))
    tokens_sharded = ([sharded_output(i) for i in range(outputs)], inputs(Shard(0)))
    return [everything_replicated, tokens_sharded]


def _one_output(*args):
    """Sinkhorn forward and backwards, the stream mix: every tensor per token."""
    return _strategies(args, outputs=1)


def _stream_recompute(x, h_res, y, h_post, after):
    # after: the backward's one-element anchor, not per token (mhc.ops.mixing)
    return _strategies((x, h_res, y, h_post, after), outputs=1, replicated=(4,))


def _stream_mix_bwd(x, w, y, b, grad_out, grad_x_acc, need_grad_x):
    # (grad_x, grad_y, grad_w, grad_b): empty placeholders where there is nothing to return
    empty = {i for i, absent in enumerate((not need_grad_x, y is None, False, y is None)) if absent}
    return _strategies((x, w, y, b, grad_out, grad_x_acc, need_grad_x), outputs=4, empty_outputs=empty)


def _coefficients_fwd(x, phi, alpha, bias, iters, eps, hc_eps):
    # outputs per flattened token: only streams [T, n, d] shard like them
    strategies = _strategies((x, phi, alpha, bias, iters, eps, hc_eps), outputs=7, replicated=(1, 2, 3))
    return strategies if x.ndim == 3 else strategies[:1]


def _coefficients_bwd(x, phi, alpha, *rest):
    # (grad_x, [vec(dphi) | dbias | dalpha]): the parameters' gradient sums over tokens
    args = (x, phi, alpha, *rest)
    strategies = _strategies(args, outputs=2, replicated=(1, 2), partial_outputs=(1,))
    return strategies if x.ndim == 3 else strategies[:1]


def register_rules() -> bool:
    """Register the rules with ``DTensor``; ``False`` where ``torch.distributed`` (or its
    ``register_sharding``) is not available."""
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:
        return False
    ops = torch.ops.mhc
    rules = {
        _one_output: [
            ops.sinkhorn_fwd.default,
            ops.sinkhorn_bwd.default,
            ops.sinkhorn_implicit_bwd.default,
            ops.sinkhorn_eps_fwd.default,
            ops.sinkhorn_eps_bwd.default,
            ops.stream_mix_fwd.default,
        ],
        _stream_recompute: [ops.stream_recompute.default],
        _stream_mix_bwd: [ops.stream_mix_bwd.default],
        _coefficients_fwd: [ops.mhc_coefficients_fwd.default],
        _coefficients_bwd: [ops.mhc_coefficients_bwd.default],
    }
    for rule, overloads in rules.items():
        register_sharding(overloads)(rule)
    return True
