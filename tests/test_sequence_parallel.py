"""Sequence-parallel sites (``mhc.distributed``) on 2 gloo ranks against one process on the whole
sequence: outputs, input gradients and every parameter gradient, on both paths (the kernels in
Triton's interpreter), chained sites, recompute and DTensor streams. On 4 ranks, a 2-D
``(dp, tp)`` mesh with FSDP2 and tensor-parallel MLPs, and a DCP checkpoint saved on it and loaded
into one process."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from mhc.distributed import parallelize_sites
from tests import mesh_2d_worker
from tests import sequence_parallel_worker as worker
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
# one worker runs the module, so its torchrun fixtures run once (pytest -n, --dist=loadgroup)
pytestmark = pytest.mark.xdist_group("sequence_parallel")


def run_sequence_parallel(tmp_path_factory, device: str):
    out = tmp_path_factory.mktemp(f"sequence_parallel_{device}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    if device == "cuda":
        env.pop("TRITON_INTERPRET")
    torchrun([ROOT / "tests/sequence_parallel_worker.py", out, device], env=env, cwd=ROOT, timeout=600)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_sequence_parallel(tmp_path_factory, "cpu")


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory):
    return run_sequence_parallel(tmp_path_factory, "cuda")


def run_mesh_2d(tmp_path_factory, device: str, backend: str):
    out = tmp_path_factory.mktemp(f"mesh_2d_{device}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun([ROOT / "tests/mesh_2d_worker.py", out, device, backend], env=env, cwd=ROOT, timeout=600, nproc=4)
    return out


@pytest.fixture(scope="module")
def mesh_2d_results(tmp_path_factory):
    return run_mesh_2d(tmp_path_factory, "cpu", "torch")


@pytest.fixture(scope="module")
def mesh_2d_gpu_results(tmp_path_factory):
    return run_mesh_2d(tmp_path_factory, "cuda", "triton")


def assert_same(got, want):
    assert got["partial"] == [], "gradients left as partial sums: each optimizer op would reduce them"
    torch.testing.assert_close(got["out"], want["out"].cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["x_grad"], want["x_grad"].cpu(), rtol=1e-6, atol=1e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert grad.abs().max() > 0, name  # every parameter gets a gradient
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels run in the interpreter on CPU")
@pytest.mark.parametrize("scenario", worker.CPU_SCENARIOS)
def test_two_sequence_shards_equal_one_process(results, scenario):
    got = torch.load(results / f"{scenario}.pt")
    assert_same(got, worker.run(scenario, shard=None))
    if worker.SCENARIOS[scenario].backend == "torch":  # counted on the reference path
        # the hooked branch parameters one all-reduce each; every site gradient in one more
        assert got["all_reduces"] == got["hooked"] + 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("scenario", list(worker.SCENARIOS))
def test_two_gpus_equal_one_gpu(gpu_results, scenario):
    """The same over NCCL, one GPU per rank, the fused kernels compiled."""
    assert_same(torch.load(gpu_results / f"{scenario}.pt"), worker.run(scenario, shard=None, device="cuda"))


def assert_mesh_2d_equals_one_process(out, backend: str, device: str):
    model = worker.Model(backend).to(device)
    x, weight = (t.to(device) for t in worker.batch())
    (model(x, chained=False) * weight).sum().backward()
    got = torch.load(out / "grads.pt")
    assert "takes a 1-D mesh" in (out / "refused.txt").read_text()
    assert got.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], p.grad.cpu(), rtol=1e-5, atol=1e-6, msg=name)

    # the checkpoint of the 2-D layout, loaded into one process: the parameters after one SGD step
    import torch.distributed.checkpoint as dcp

    loaded = worker.Model(backend)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    for name, p in model.named_parameters():
        want = (p - mesh_2d_worker.LR * p.grad).detach().cpu()
        assert not torch.equal(state[name], p.detach().cpu()), name
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=name)

    # built on the meta device, sharded, materialised: reset_parameters writes the initial values
    fresh = worker.Model(backend)
    mesh_2d_worker.reset_mhc_parameters(fresh)
    initialised = torch.load(out / "initialised.pt")
    want = mesh_2d_worker.mhc_parameters(fresh)
    assert initialised.keys() == want.keys() and any("lanes.logits" in k for k in want)
    for name, p in want.items():
        assert torch.equal(initialised[name], p.detach()), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_by_tensor_parallel_mesh_equals_one_process(mesh_2d_results):
    assert_mesh_2d_equals_one_process(mesh_2d_results, "torch", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_fsdp_by_tensor_parallel_mesh_on_four_gpus(mesh_2d_gpu_results):
    """The 2-D mesh over NCCL, the fused kernels."""
    assert_mesh_2d_equals_one_process(mesh_2d_gpu_results, "triton", "cuda")


def test_bad_arguments():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        parallelize_sites("model")
    with pytest.raises(ValueError, match="no hyper-connection site"):
        parallelize_sites(nn.Linear(2, 2))
    with pytest.raises(TypeError):  # the sequence dim is read from a DTensor's placements
        parallelize_sites(worker.Model("torch"), sequence_dim=1)
