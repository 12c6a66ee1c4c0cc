"""The package's import graph: imports point down the layers of ``docs/architecture.md``, never
in a circle, and the kernel layer (``mhc/kernels/``) imports nothing above it. Imports inside
functions count too."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import mhc

ROOT = pathlib.Path(mhc.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set) -> set:
    """The ``mhc`` modules ``path`` imports (``from mhc import x`` counts as ``mhc.x`` when that is
    a module, else as the package ``mhc``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mhc"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mhc":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def _graph() -> dict:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _cycle(graph: dict) -> list | None:
    """One import circle among the modules below the package root, or ``None``. The root
    ``mhc/__init__.py`` only gathers the public names and imports everything, so it is left out."""
    graph = {m: {d for d in deps if d != "mhc" and d in graph} for m, deps in graph.items() if m != "mhc"}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_is_read():
    graph = _graph()
    assert "mhc.kernels.sinkhorn" in graph["mhc.kernels"]
    assert "mhc.modules.site" in graph["mhc.memory.recompute"]


def test_no_import_circle():
    assert _cycle(_graph()) is None


def test_the_circle_finder_finds_one():
    assert _cycle({"mhc.a": {"mhc.b"}, "mhc.b": {"mhc.c"}, "mhc.c": {"mhc.a"}}) == ["mhc.a", "mhc.b", "mhc.c", "mhc.a"]
    assert _cycle({"mhc.a": {"mhc.b"}, "mhc.b": set()}) is None


# docs/architecture.md, bottom to top; a module may import its own layer and the ones below
LAYERS = (
    ("mhc._checks", "mhc._compat", "mhc._autocast", "mhc._autograd", "mhc.kernels"),
    ("mhc.reference",),
    ("mhc.ops",),
    ("mhc.modules",),
    ("mhc.memory", "mhc.distributed"),
    ("mhc.integrations",),
    ("mhc.layer", "mhc.mixing", "mhc.losses", "mhc"),
)


def _layer(module: str) -> int:
    if module == "mhc":
        return len(LAYERS) - 1
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "mhc"):
            return rank
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def test_imports_point_down_the_layers():
    up = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        for d in deps
        if _layer(d) > _layer(m)
        or (_layer(m) == 0 and _layer(d) == 0 and m.startswith("mhc.kernels") != d.startswith("mhc.kernels"))
    ]
    assert not up, up


def test_the_layer_check_sees_an_arrow_up():
    assert _layer("mhc.ops.mixing") < _layer("mhc.modules.site") < _layer("mhc.memory.recompute")
    with pytest.raises(AssertionError):
        _layer("mhc.somewhere_new")


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("mhc.kernels")))
def test_kernel_layer_imports_nothing_above_it(module):
    above = {d for d in _graph()[module] if not d.startswith("mhc.kernels")}
    assert not above, f"{module} imports {sorted(above)}"


PRIVATE = re.compile(
    r"torch\._[a-zA-Z]|\._C\.|triton\.(knobs|runtime|compiler)|from triton import knobs"
    r"|packed_metadata|launch_metadata|compiled\.run\("
)
DOORS = ("_compat/", "kernels/_compat.py")  # the two modules that own every private API


def test_private_apis_only_behind_the_compat_doors():
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in ROOT.rglob("*.py")
        if not str(path.relative_to(ROOT)).startswith(DOORS)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0])
    ]
    assert not found, found


def test_the_private_api_pattern_matches():
    assert PRIVATE.search("stream = torch._C._cuda_getCurrentRawStream(0)")
    assert PRIVATE.search("from triton import knobs") and not PRIVATE.search("import triton.language as tl")


def test_import_changes_nothing_outside_mhc():
    """``import mhc`` leaves PyTorch's checkpoint tagging and Triton write analysis as they are
    (``mhc`` wraps them at the first trace of one of its ops, for its own graph pieces only)."""
    code = (
        "import torch\n"
        "from torch._higher_order_ops import triton_kernel_wrap as w\n"
        "from torch._higher_order_ops.wrap import TagActivationCheckpoint as T\n"
        "names = [n for n in ('identify_accessed_tensors', 'identify_mutated_tensors') if hasattr(w, n)]\n"
        "before = [getattr(w, n) for n in names] + [T.__dict__.get('tag_nodes')]\n"
        "import mhc, mhc.mixing, mhc.layer, mhc.losses, mhc.memory, mhc.distributed, mhc.reference\n"
        "after = [getattr(w, n) for n in names] + [T.__dict__.get('tag_nodes')]\n"
        "assert names and all(a is b for a, b in zip(before, after)), (before, after)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_checkpoint_tags_reach_only_bodies_that_call_mhc_ops():
    from mhc._compat import _calls_mhc_ops

    ours = torch.fx.symbolic_trace(lambda x, w: torch.ops.mhc.stream_mix_fwd(x, w, None, None).sin())
    theirs = torch.fx.symbolic_trace(lambda x, w: (w @ x).sin())
    assert _calls_mhc_ops(ours) and not _calls_mhc_ops(theirs)
    graph = torch.fx.Graph()
    graph.output(graph.get_attr("body"))
    assert _calls_mhc_ops(torch.fx.GraphModule({"body": ours}, graph))  # an mhc op one subgraph down
