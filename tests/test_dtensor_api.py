"""Per-token modules on sequence-sharded ``DTensor``\\ s whose parameters PyTorch's own API made
replicated (``distribute_module``, ``SequenceParallel()``, a tensor-parallel branch's plan): on 2
and 4 gloo ranks, both paths (the kernels in Triton's interpreter), against one process on the
whole batch. Global shapes (uneven shards too), outputs, input gradients and every parameter
gradient, eager and compiled (``fullgraph``, uneven); on 4 ranks also a 2-D ``(dp, tp)`` mesh."""

import os
from pathlib import Path

import pytest
import torch

from tests import dtensor_api_worker as worker
from tests.torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("dtensor_api")


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"dtensor_api_{request.param}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    torchrun([ROOT / "tests/dtensor_api_worker.py", out], env=env, cwd=ROOT, timeout=900, nproc=request.param)
    return request.param, out


@pytest.mark.parametrize("backend", worker.BACKENDS)
@pytest.mark.parametrize("case", [*worker.CASES, "mesh_2d"])
def test_sharded_dtensor_equals_one_process(ranks, case, backend):
    world, out = ranks
    if case == "mesh_2d" and world != 4:
        pytest.skip("the 2-D mesh needs 4 ranks")
    shape, got, dx, dparams = torch.load(out / f"{case}_{backend}.pt", weights_only=True)
    want_shape, want, want_dx, want_dparams = worker.run(case, backend, world)
    assert shape == want_shape  # the global shape, uneven shards too
    tol = dict(rtol=1e-4, atol=2e-5)  # fp32, sums over tokens in another order
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(dx, want_dx, **tol)
    assert dparams.keys() == want_dparams.keys()
    for name in want_dparams:
        torch.testing.assert_close(dparams[name], want_dparams[name], **tol, msg=name)
