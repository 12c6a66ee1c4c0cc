"""Per-token modules on sequence-sharded ``DTensor``\\ s whose parameters PyTorch's own API made
replicated (``distribute_module``, ``SequenceParallel()``, a tensor-parallel branch's plan): on 2
and 4 gloo ranks, both paths (the kernels in Triton's interpreter), against one process on the
whole batch. Global shapes (uneven shards too), outputs, input gradients and every parameter
gradient, eager and compiled (``fullgraph``, uneven). On 4 ranks the layouts that change with the
rank count (even, uneven, chained, recompute, a tensor-parallel branch) and a 2-D ``(dp, tp)`` mesh."""

import os
from pathlib import Path

import pytest
import torch

from tests import dtensor_api_worker as worker
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("dtensor_api")


def launch(tmp_path_factory, world: int) -> Path:
    out = tmp_path_factory.mktemp(f"dtensor_api_{world}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    torchrun([ROOT / "tests/dtensor_api_worker.py", out], env=env, cwd=ROOT, timeout=900, nproc=world)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return launch(tmp_path_factory, 4)


def assert_equals_one_process(out: Path, world: int, case: str, backend: str) -> None:
    shape, got, dx, dparams = torch.load(out / f"{case}_{backend}.pt", weights_only=True)
    want_shape, want, want_dx, want_dparams = worker.run(case, backend, world)
    assert shape == want_shape  # the global shape, uneven shards too
    tol = dict(rtol=1e-4, atol=2e-5)  # fp32, sums over tokens in another order
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(dx, want_dx, **tol)
    assert dparams.keys() == want_dparams.keys()
    for name in want_dparams:
        torch.testing.assert_close(dparams[name], want_dparams[name], **tol, msg=name)


@pytest.mark.parametrize("backend", worker.BACKENDS)
@pytest.mark.parametrize("case", worker.CASES)
def test_two_ranks_equal_one_process(two_ranks, case, backend):
    assert_equals_one_process(two_ranks, 2, case, backend)


@pytest.mark.parametrize("backend", worker.BACKENDS)
@pytest.mark.parametrize("case", worker.FOUR_RANK_CASES)
def test_four_ranks_equal_one_process(four_ranks, case, backend):
    assert_equals_one_process(four_ranks, 4, case, backend)
