"""A first look at mhc's Sinkhorn operator (runs on CPU or GPU in a few seconds).

python examples/demo.py
"""

import torch

from mhc import reference
from mhc.layer import FusedMHC

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

layer = FusedMHC(mhc_iters=20)  # Triton kernels on CUDA, the PyTorch reference on CPU
print(layer, "on", device)

logits = (torch.randn(8, 4, 4, device=device) * 3).requires_grad_()
P = layer(logits)
print("one mixing matrix:\n", P[0].detach().cpu())
print("row sums:   ", P.sum(-1)[0].detach().cpu().tolist())
print("column sums:", P.sum(-2)[0].detach().cpu().tolist())

upstream = torch.randn_like(P)  # a random upstream gradient (all-ones would give ~0)
P.backward(upstream)
x64 = logits.detach().double().requires_grad_()
reference.sinkhorn_multiplicative(x64, 20).backward(upstream.double())
err = (logits.grad.double() - x64.grad).norm() / x64.grad.norm()
print(f"exact gradient vs fp64 autograd through the unrolled loop: relative error {err:.1e}")

huge = torch.randn(8, 4, 4, device=device) * 1e4
print("logits of scale 1e4 stay finite:", bool(torch.isfinite(layer(huge)).all()))
