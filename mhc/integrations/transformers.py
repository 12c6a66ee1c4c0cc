"""DeepSeek-V4 in Hugging Face transformers on ``mhc``'s fused kernels: :func:`patch_deepseek_v4`.

The patch swaps the classes of the model's mHC modules for subclasses that run ``mhc``:
``DeepseekV4HyperConnection`` becomes a :class:`mhc.modules.site.Site` over V4's own ``fn``,
``base`` and ``scale`` (the ``comb`` block read transposed, V4's ``hc_eps``), the decoder layer's
mixing a ``split`` / ``finish(y, next=)`` / ``finish`` chain, ``DeepseekV4HyperHead``
:func:`mhc.mixing.stream_collapse`. Parameters stay the same tensors under the same names
(``docs/deepseek_v4.md``).
"""

from __future__ import annotations

import torch

from mhc._checks import BACKENDS, MAX_EPS_N, MAX_STREAMS
from mhc.memory.recompute import recompute_streams
from mhc.modules.coefficients import DYNAMIC_MHC
from mhc.modules.site import Site
from mhc.modules.streams import stream_collapse

__all__ = ["patch_deepseek_v4"]


def _deepseek_v4():
    """transformers' DeepSeek-V4 module, or an ImportError saying what is needed."""
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4
    except ImportError as e:
        raise ImportError(
            'patch_deepseek_v4 needs transformers with DeepSeek-V4 (5.23 or newer): pip install -e ".[transformers]"'
        ) from e
    return modeling_deepseek_v4


def _v4_parameters(fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int):
    """V4's ``fn [(2 + n) n, n D]``, ``base [(2 + n) n]``, ``scale [3]`` as ``mhc``'s
    ``(phi [n D, 2n + n n], alpha [3], bias [2n + n n])``: ``scale`` itself, and views and
    concatenations of the same tensors, so gradients reach them.

    ``fn``'s rows and ``base`` are ``[pre | post | comb]`` with ``comb[p, q]`` at ``2n + p n + q``;
    ``mhc``'s ``h_res[t, s] = comb[s, t]`` (V4 mixes ``out[q] = sum_p comb[p, q] x[p]``)."""
    k = fn.shape[1]
    comb_t = fn[2 * n :].view(n, n, k).transpose(0, 1).reshape(n * n, k)
    phi = torch.cat([fn[: 2 * n], comb_t], dim=0).t()
    bias = torch.cat([base[: 2 * n], base[2 * n :].view(n, n).t().reshape(n * n)])
    return phi, scale, bias


def _norm_eps(norm) -> float:
    """The epsilon of V4's unweighted RMS norm: ``variance_epsilon`` from transformers 5.25, ``eps`` before."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _check_not_distributed(base) -> None:
    sites = [m for layer in base.layers for m in (layer.attn_hc, layer.ffn_hc)] + [base.hc_head]
    for site in sites:
        for name, p in site.named_parameters(recurse=False):
            if hasattr(p, "device_mesh"):
                raise ValueError(
                    f"patch_deepseek_v4 takes the mHC parameters as plain tensors, replicated as transformers' "
                    f"tensor-parallel plan leaves them; {type(site).__name__}.{name} is a DTensor {p.placements}"
                )


def _patched_classes():
    """The subclasses that replace V4's mHC classes (built once, on first use)."""
    if _PATCHED:
        return _PATCHED
    v4 = _deepseek_v4()

    class MHCDeepseekV4HyperConnection(v4.DeepseekV4HyperConnection, Site):
        """``DeepseekV4HyperConnection`` as an ``mhc`` site over its own parameters."""

        source = DYNAMIC_MHC
        backward = "exact"
        _recorder = None

        @property
        def n_streams(self) -> int:
            return self.hc_mult

        @property
        def dim(self) -> int:
            return self.fn.shape[1] // self.hc_mult

        @property
        def sinkhorn_iters(self) -> int:
            return self.hc_sinkhorn_iters

        @property
        def rms_eps(self) -> float:
            return _norm_eps(self.input_norm)

        def mixing_parameters(self):
            return _v4_parameters(self.fn, self.base, self.scale, self.hc_mult)

        def forward(self, hidden_streams: torch.Tensor):
            """V4's interface, ``(post [..., n], comb [..., n, n], collapsed [..., D])``, from
            ``mhc``'s coefficients (``comb = h_res^T``)."""
            x_in, _ = self.split(hidden_streams)
            _, h_post, h_res = self.coefficients(hidden_streams)
            return h_post, h_res.transpose(-1, -2), x_in

    class MHCDeepseekV4DecoderLayer(v4.DeepseekV4DecoderLayer):
        """``DeepseekV4DecoderLayer`` whose two sites run on ``mhc``, handing over through the seam."""

        def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs):
            x_in, finish = self.attn_hc.split(hidden_states)  # streams [B, S, hc_mult, D]
            attn_output, _ = self.self_attn(self.input_layernorm(x_in), **kwargs)
            x_in, finish = finish(attn_output, next=self.ffn_hc)
            return finish(self.mlp(self.post_attention_layernorm(x_in), input_ids=input_ids))

    class MHCDeepseekV4HyperHead(v4.DeepseekV4HyperHead):
        """``DeepseekV4HyperHead`` as :func:`mhc.mixing.stream_collapse` over its own parameters."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return stream_collapse(
                x, self.hc_fn.t(), self.hc_scale, self.hc_base, _norm_eps(self.input_norm), self.eps, self.backend
            )

    _PATCHED.update(hc=MHCDeepseekV4HyperConnection, layer=MHCDeepseekV4DecoderLayer, head=MHCDeepseekV4HyperHead)
    return _PATCHED


_PATCHED: dict = {}


def patch_deepseek_v4(model, backend: str = "auto", recompute: bool | int = False):
    """Run a transformers DeepSeek-V4 model's hyper-connections on ``mhc``, in place; returns ``model``.

    Args:
        model: a ``DeepseekV4ForCausalLM`` or ``DeepseekV4Model`` (already patched is fine).
        backend: ``"auto"`` (fused Triton kernels for CUDA tensors, the PyTorch reference
            otherwise), ``"triton"`` (CUDA, or CPU with ``TRITON_INTERPRET=1``) or ``"torch"``.
        recompute: rebuild the streams in the backward (:func:`mhc.memory.recompute.recompute_streams`):
            ``True`` with the paper's block length, an int for that block length, ``False`` (or 1)
            to save them at every site.

    Afterwards transformers' ``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead`` and
    ``DeepseekV4DecoderLayer`` forwards no longer run for this model; attention, MoE, norms, cache
    and generation stay transformers' own. The model computes what transformers computes (fp32: to
    rounding) with the same parameters. Tensor parallel (``tp_plan="auto"``) shards the experts only:
    every rank runs its sites whole.

    Raises:
        ImportError: transformers without DeepSeek-V4.
        TypeError: ``model`` is not a DeepSeek-V4 model.
        ValueError: ``hc_mult`` above 16 on ``backend="triton"``, an unknown ``backend``, or mHC
            parameters that are ``DTensor``\\ s."""
    v4 = _deepseek_v4()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(model, (v4.DeepseekV4ForCausalLM, v4.DeepseekV4Model)):
        raise TypeError(
            f"patch_deepseek_v4 takes a DeepseekV4ForCausalLM or DeepseekV4Model, got {type(model).__name__}"
        )
    if not isinstance(recompute, (bool, int)):
        raise TypeError(f"recompute must be a bool or an int, got {type(recompute).__name__}")
    if recompute is not False and recompute is not True and recompute < 1:
        raise ValueError(f"recompute must be True, False or a block length >= 1, got {recompute}")
    base = model.model if isinstance(model, v4.DeepseekV4ForCausalLM) else model
    n = base.config.hc_mult
    limit = min(MAX_STREAMS, MAX_EPS_N)
    if backend == "triton" and n > limit:
        raise ValueError(f"the fused kernels take hc_mult <= {limit}, got {n}; use backend='torch'")
    _check_not_distributed(base)
    classes = _patched_classes()
    for layer in base.layers:
        layer.__class__ = classes["layer"]
        for site in (layer.attn_hc, layer.ffn_hc):
            site.__class__ = classes["hc"]
            site.backend = backend
    base.hc_head.__class__ = classes["head"]
    base.hc_head.backend = backend
    recompute_streams(model, None if recompute is True else 1 if recompute is False else recompute)
    return model
