"""Sharded and data-parallel training of every mhc module, activation checkpointing, distributed
checkpoints, and old checkpoints with 0-d gates.

One ``torchrun`` launch (2 gloo processes on CPU) runs every scenario of
tests/distributed_worker.py; the tests compare its results with one process on the same global
batch.

Tolerances (fp32). Losses: 1e-5 (the shards' gradients are averaged by a reduce-scatter or
all-reduce, so the sums run in another order: rounding only; measured 5e-7). Parameters: 1e-5, a
hundredth of one AdamW step (lr = 1e-3; measured 5e-7): Adam divides by the gradient's magnitude,
so on a parameter whose gradient is near zero reduction-order rounding becomes a visible part of a
step, and a bound tighter than a fraction of a step would test that noise.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mhc.mixing import HyperConnection
from tests import distributed_worker as worker
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
# one worker runs the module, so its torchrun fixture runs once (pytest -n, --dist=loadgroup)
pytestmark = pytest.mark.xdist_group("distributed")


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the PyTorch path; no kernels run here
    torchrun([ROOT / "tests/distributed_worker.py", out], env=env, cwd=ROOT, timeout=600)
    return out


@pytest.fixture(scope="module")
def single_process():
    model = worker.build_model()
    return dict(losses=worker.train(model), params=model.state_dict())


def assert_same_training(result, reference, loss_atol=1e-5, param_atol=1e-5):
    assert len(result["losses"]) == worker.STEPS
    for got, want in zip(result["losses"], reference["losses"]):
        assert abs(got - want) < loss_atol, (result["losses"], reference["losses"])
    assert result["params"].keys() == reference["params"].keys()
    for key, want in reference["params"].items():
        torch.testing.assert_close(result["params"][key], want, rtol=0, atol=param_atol, msg=key)


def test_the_model_trains_every_parameter(single_process):
    # the comparisons below would pass vacuously for parameters that never move
    start = worker.build_model().state_dict()
    for key, value in single_process["params"].items():
        assert not torch.equal(value, start[key]), key
    batch = worker.batches()[0]
    trained = worker.build_model()
    trained.load_state_dict(single_process["params"])
    loss = trained(batch[:, :-1], batch[:, 1:])
    assert loss < single_process["losses"][0]


@pytest.mark.parametrize(
    "scenario",
    [
        "fsdp",
        "fsdp_checkpointed",
        "ddp",
        "fsdp_recompute",
        "fsdp_recompute_checkpointed_branches",
        "fsdp_recompute_checkpointed",
        "ddp_recompute",
    ],
)
def test_two_ranks_equal_one_process(distributed_results, single_process, scenario):
    # with recompute_streams the same training to rounding: the streams are rebuilt exactly
    assert_same_training(torch.load(distributed_results / f"{scenario}.pt"), single_process)


def test_fsdp_mixed_precision_trains_close_to_fp32(distributed_results, single_process):
    # bf16 parameters in the forward and backward, fp32 reduction and master weights: losses within
    # bf16 rounding of the fp32 run (measured 9e-3), and the same update direction (measured cosine
    # 0.998; Adam's normalisation turns bf16 gradient noise into whole-step differences on
    # parameters with small gradients, so elementwise closeness is not expected)
    result = torch.load(distributed_results / "fsdp_bf16.pt")
    assert_same_training(result, single_process, loss_atol=2e-2, param_atol=worker.LR * worker.STEPS)
    start = worker.build_model().state_dict()
    update, reference = (
        torch.cat([(p[k] - start[k]).flatten() for k in start]) for p in (result["params"], single_process["params"])
    )
    assert torch.nn.functional.cosine_similarity(update, reference, dim=0) > 0.98


@pytest.mark.parametrize(
    "options",
    [
        dict(checkpoint_blocks=True),
        dict(checkpoint_branches=True),
        dict(recompute=2),
        dict(recompute=3, checkpoint_branches=True),
        dict(recompute=2, checkpoint_blocks=True),
    ],
)
def test_activation_checkpointing_and_recompute_give_identical_gradients(options):
    batch = worker.batches()[0]
    grads = []
    for kwargs in ({}, options):
        model = worker.build_model(**kwargs)
        model(batch[:, :-1], batch[:, 1:]).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for key, grad in grads[0].items():
        assert torch.equal(grads[1][key], grad), key


def test_dcp_sharded_save_loads_resharded_and_unsharded(distributed_results):
    saved = torch.load(distributed_results / "fsdp.pt")["params"]
    resharded = torch.load(distributed_results / "dcp_resharded.pt")["params"]
    model = worker.build_model()  # one process, no process group, no sharding
    state = model.state_dict()
    dcp.load(state, checkpoint_id=distributed_results / "dcp")
    model.load_state_dict(state)
    for key, value in saved.items():
        assert torch.equal(resharded[key], value), key
        assert torch.equal(model.state_dict()[key], value), key


def test_state_dict_of_separate_gates_and_biases_is_refused():
    # one layout only: alpha [3] and bias [2n + n*n]; the seven separate parameters are not keys
    n = 3
    old = {"b_pre": torch.zeros(n), "b_post": torch.zeros(n), "b_res": torch.zeros(n, n)}
    old.update(a_pre=torch.zeros(1), a_post=torch.zeros(1), a_res=torch.zeros(1), phi=torch.zeros(n * 8, 2 * n + n * n))
    with pytest.raises(RuntimeError, match="Missing key.*alpha.*bias|Unexpected key"):
        HyperConnection(8, n).load_state_dict(old)


def test_gates_are_not_scalars():
    # FSDP2 refuses 0-d parameters ("fully_shard doesn't support scalar parameters")
    hc = HyperConnection(8, 2)
    assert all(p.dim() >= 1 for p in hc.parameters())


def test_the_module_runs_on_one_worker(request):
    # under pytest -n the torchrun fixture runs once only while xdist keeps the module on one
    # worker (--dist=loadgroup): pytest 9.2 silently undid that (pytest-dev/pytest-xdist#1386)
    if not request.config.getoption("loadgroup", False):
        pytest.skip("not under pytest-xdist's --dist=loadgroup")
    assert request.node.nodeid.endswith("@distributed"), request.node.nodeid
