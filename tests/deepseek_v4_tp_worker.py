"""A patched DeepSeek-V4 model under transformers' tensor-parallel plan, for
tests/test_deepseek_v4.py. Run under ``torchrun`` (2 processes):

    torchrun --nproc_per_node=2 tests/deepseek_v4_tp_worker.py CHECKPOINT OUT_DIR [cpu|cuda] [torch|triton]

Every rank loads the tiny model saved at ``CHECKPOINT`` with ``tp_plan="auto"`` (the experts
sharded over the ranks), patches it and runs one training step; rank 0 writes the loss, the
logits, the gradient of every replicated parameter (the mHC parameters, attention, norms: all
but those the plan shards, whose packed expert shards PyTorch 2.11 cannot gather) and the names
of the sharded ones to ``OUT_DIR/step.pt``, and the error that ``patch_deepseek_v4`` gives for sharded mHC parameters
to ``OUT_DIR/error.txt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import DeepseekV4ForCausalLM

from mhc.integrations.transformers import patch_deepseek_v4
from tests.deepseek_v4_data import step_ids, tiny_config


def main(checkpoint: str, out_dir: str, device: str, backend: str) -> None:
    model = DeepseekV4ForCausalLM.from_pretrained(checkpoint, tp_plan="auto", dtype=torch.float32)
    rank = dist.get_rank()
    assert any(_sharded(p) for p in model.parameters())  # the experts are sharded
    patch_deepseek_v4(model, backend=backend)
    ids = step_ids().to(model.device)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None and not _sharded(p)}
    error = _sharded_site_error(device)
    if rank == 0:
        sharded = [n for n, p in model.named_parameters() if _sharded(p)]
        step = dict(loss=out.loss.detach().cpu(), logits=_full(out.logits).detach().cpu(), grads=grads, sharded=sharded)
        torch.save(step, Path(out_dir) / "step.pt")
        (Path(out_dir) / "error.txt").write_text(error)
    dist.destroy_process_group()


def _sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sharded_site_error(device: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = DeepseekV4ForCausalLM(tiny_config()).to(device)
    site = model.model.layers[0].attn_hc
    site.fn = nn.Parameter(distribute_tensor(site.fn.detach(), init_device_mesh(device, (2,)), [Shard(0)]))
    try:
        patch_deepseek_v4(model)
    except ValueError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2] if len(args) > 2 else "cpu", args[3] if len(args) > 3 else "torch")
