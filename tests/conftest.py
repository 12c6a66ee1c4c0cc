import os
import sys

import pytest
import torch

# Triton picks compiled or interpreted kernels when they are decorated, so this must precede any
# import of mhc.kernels: without a GPU the real kernels run in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter import install  # noqa: E402

    install()

# nan_poison is function-scoped on purpose: its patch holds for every example of a test.
common = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=20, derandomize=True, **common)
settings.register_profile("dev", max_examples=100, **common)
# on a GPU every new (n, iters) compiles a kernel: few examples there, the interpreter runs the many
settings.register_profile("gpu", max_examples=4, derandomize=True, **common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# Inductor's C++ code generation costs tens of seconds a test on a CPU. Tests about tracing
# (Dynamo, AOTAutograd, Inductor's partitioner) compile with this backend, which runs the
# partitioned graphs as they are there; a GPU runs them through Inductor.
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager_decomp_partition"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


# Their tests launch processes (torchrun, the examples) and run longest: started first, the two
# workers of `pytest -n 2` finish together rather than one running them alone at the end.
FIRST = ("test_train_toy_lm.py", "test_sequence_parallel.py", "test_distributed.py", "test_weak_scaling.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the order within stays
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Forget the launchers' cached plans around every test: tests replace the functions the plans
    are made from (``sm_count``, ``token_splits``, the tile configurations)."""

    def clear():
        module = sys.modules.get("mhc.kernels._launch")
        if module is not None:
            module.forget_launch_plans()

    clear()
    yield
    clear()


@pytest.fixture
def nan_poison(monkeypatch):
    """Fill every buffer the launchers allocate with NaN, so an unwritten output fails loudly."""

    def poison(allocate):
        def poisoned(*args, **kwargs):
            out = allocate(*args, **kwargs)
            if out.is_floating_point():
                out.fill_(float("nan"))
            return out

        return poisoned

    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))
    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    yield
