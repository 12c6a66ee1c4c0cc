"""Benchmarks and tuning of ``mhc``, run from the repository root as modules:

- ``python -m bench.sinkhorn``: the Sinkhorn kernels against the PyTorch reference and the copy floor;
- ``python -m bench.mixing``: a site's kernels, one MLP block and whole GPTs (plain, HC, mHC, the
  peers), eager, compiled and checkpointed, with recompute and FSDP2 arms;
- ``python -m bench.decode``: sites forward only at 1 to 64 tokens in CUDA graphs (a 16-site stack, a
  KV-cached GPT decode step), and one site's kernels;
- ``python -m bench.loss``: the fused linear cross-entropy against its peers;
- ``python -m bench.weak_scaling``: the GPT on 1 and N GPUs under FSDP2 (``torchrun`` driver);
- ``python -m bench.tune_mixing`` / ``bench.tune_sinkhorn``: the launch-configuration sweeps;
- ``python -m bench.profile_model`` / ``profile_compile`` / ``profile_host``: where a step's time goes.

:mod:`bench.harness` holds what they share (peak memory above a baseline, CSV output). The
``*.sh`` files run a set of them on a CUDA machine and collect the logs.
"""
