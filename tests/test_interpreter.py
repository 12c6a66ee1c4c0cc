"""The test suite's faster Triton interpreter (tests/interpreter.py) computes what Triton's does."""

import pytest
import torch
import triton
import triton.language as tl

from tests.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs where there is no GPU")

from mhc.kernels import mhc_coefficients, sinkhorn  # noqa: E402


@triton.jit
def _cumsum_argmax_kernel(x_ptr, out_ptr, idx_ptr, N: tl.constexpr):
    # tl.cumsum and tl.argmax call Triton's own device functions, whose module names
    # triton.language.core rather than triton.language
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, tl.cumsum(x, axis=0))
    tl.store(idx_ptr, tl.argmax(x, axis=0))


def _with_triton_interpreter(run):
    """``run()`` with Triton's own ``_patch_lang`` and launch, the suite's restored after."""
    from triton.runtime import interpreter

    patched_lang, patched_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    if not getattr(patched_lang, "_mhc_cached", False):  # install() found other internals: Triton's own runs
        pytest.skip("this Triton's interpreter is not patched (tests/interpreter.py found other internals)")
    np_dtype = interpreter._get_np_dtype
    interpreter._patch_lang = patched_lang._mhc_original
    interpreter.GridExecutor.__call__ = patched_call._mhc_original
    interpreter._get_np_dtype = getattr(np_dtype, "_mhc_original", np_dtype)
    try:
        return run()
    finally:
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = patched_lang, patched_call
        interpreter._get_np_dtype = np_dtype


def _sinkhorn_and_coefficients():
    g = torch.Generator().manual_seed(0)
    logits, grad = torch.randn(5, 4, 4, generator=g), torch.randn(5, 4, 4, generator=g)
    x = torch.randn(3, 4, 16, generator=g)
    phi, alpha, bias = torch.randn(64, 24, generator=g) / 8, torch.rand(3, generator=g), torch.randn(24, generator=g)
    return (
        sinkhorn.sinkhorn_fwd(logits, 20),
        sinkhorn.sinkhorn_bwd(logits, grad, 20),
        *mhc_coefficients.coefficients_fwd(x, phi, alpha, bias, 20, 1e-6),
    )


def test_kernels_compute_the_same_as_with_tritons_interpreter():
    fast = _sinkhorn_and_coefficients()
    slow = _with_triton_interpreter(_sinkhorn_and_coefficients)
    for got, want in zip(fast, slow):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_device_functions_of_another_module_are_still_patched():
    x = torch.randn(16, generator=torch.Generator().manual_seed(1))
    out, idx = torch.empty(16), torch.empty(1, dtype=torch.int32)
    _cumsum_argmax_kernel[(1,)](x, out, idx, N=16)
    torch.testing.assert_close(out, torch.cumsum(x, 0))
    assert idx.item() == x.argmax().item()
