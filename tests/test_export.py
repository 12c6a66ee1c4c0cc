"""``torch.export`` of models with fused HyperConnection sites, against eager mode, on the kernels'
device: Triton's interpreter on a CPU (the ops are ``custom_op``s there, ``mhc.ops.library``), the GPU
otherwise (``triton_op``s; the AOTInductor package is tested in ``tests/test_compiled_gpu.py``).
The token count is exported as dynamic and checked at the exported count and at others."""

import pytest
import torch
from torch import nn

from tests.conftest import KERNEL_DEVICE
from tests.site_stack import SiteStack

DIM, N = 32, 4


def _model(chain: bool, constraint: str, dtype=torch.float32):
    torch.manual_seed(0)
    branches = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(3)]
    model = SiteStack(DIM, N, branches, chain, backend="triton", constraint=constraint)
    model = model.to(KERNEL_DEVICE, dtype).eval()
    with torch.no_grad():  # away from the identity start, so that every coefficient matters
        for name, p in model.named_parameters():
            if ".branch." not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("constraint", ["sinkhorn", "none"])
@pytest.mark.parametrize("chain", [False, True])
def test_exported_program_matches_eager_at_any_token_count(chain, constraint):
    model = _model(chain, constraint)
    tokens = torch.export.Dim("tokens", min=2, max=4096)
    with torch.no_grad():
        exported = torch.export.export(
            model, (torch.randn(24, DIM, device=KERNEL_DEVICE),), dynamic_shapes=({0: tokens},)
        )
        ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
        assert "mhc.stream_mix_fwd.default" in ops
        if constraint == "sinkhorn":
            assert "mhc.mhc_coefficients_fwd.default" in ops
        for rows in (24, 7, 65):
            x = torch.randn(rows, DIM, device=KERNEL_DEVICE)
            torch.testing.assert_close(exported.module()(x), model(x), rtol=1e-5, atol=1e-6)


def test_exported_program_keeps_leading_dims():
    """A ``[batch, seq, dim]`` input with both dims dynamic: the sites flatten tokens inside."""
    model = _model(False, "sinkhorn")
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=4096)
    with torch.no_grad():
        exported = torch.export.export(
            model, (torch.randn(2, 12, DIM, device=KERNEL_DEVICE),), dynamic_shapes=({0: batch, 1: seq},)
        )
        x = torch.randn(3, 5, DIM, device=KERNEL_DEVICE)
        torch.testing.assert_close(exported.module()(x), model(x), rtol=1e-5, atol=1e-6)
