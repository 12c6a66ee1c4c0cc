r"""The registered ``mhc::`` ops, their autograd Functions and the one place that decides which path
runs (:mod:`mhc.ops.path`). Read one op top to bottom: ``torch.library`` ops over the launchers of
:mod:`mhc.kernels` -> autograd Functions -> functionals.

- :mod:`mhc.ops.sinkhorn`: the Sinkhorn operator (``sinkhorn``);
- :mod:`mhc.ops.mixing`: a site's fused ops (pre-mix, post-mix, mHC coefficients, the seam);
- :mod:`mhc.ops.rebuild`: how those ops rebuild streams they did not save (stream recompute);
- :mod:`mhc.ops.sharding`, :mod:`mhc.ops.local`: the ops on ``DTensor``\ s;
- :mod:`mhc.ops.library`: how a launcher becomes a ``triton_op``.
"""
