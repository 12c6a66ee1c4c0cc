"""Other libraries' models on ``mhc``'s kernels. Each integration imports its library on first use,
so ``import mhc`` never needs it.

- :mod:`mhc.integrations.transformers`: ``patch_deepseek_v4(model)`` for Hugging Face
  transformers' DeepSeek-V4 (``pip install -e ".[transformers]"``).
"""
