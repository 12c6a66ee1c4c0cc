"""Every private PyTorch API the layers use, in one place, with its version checks and fallbacks
(the kernel layer's private Triton APIs are in :mod:`mhc.kernels._compat`): dispatcher and autograd
state behind ``torch._C``, the autograd engine's callback queue, ``DTensor`` from its spec, fake
tensors, and the two wrappers of PyTorch internals that ``docs/architecture.md`` ("What ``import
mhc`` changes outside ``mhc``") describes: :func:`backport_checkpoint_tags` (checkpointed regions
under ``torch.compile``, PyTorch < 2.12, pytorch/pytorch#177396) and
:mod:`mhc._compat.write_analysis`. Both are installed the first time ``torch.compile`` traces an
``mhc`` op, never at import.
"""

from __future__ import annotations

import operator

import torch
from torch.autograd import forward_ad

__all__ = [
    "backport_checkpoint_tags",
    "is_dtensor",
    "dispatch_mode_active",
    "transforms_active",
    "is_plain",
    "through_ops",
    "without_values",
    "marked_must_save",
    "top_saved_tensor_hooks",
    "in_backward",
    "materialized",
    "after_backward",
    "backward_task",
    "unsharded_dtensor",
]


_TAGS = ("ac_graph_id", "recompute")

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor as _DTensor
else:
    _DTensor = None


def is_dtensor(x) -> bool:
    """Whether ``x`` is a ``DTensor`` (``False`` where ``torch.distributed`` is not built)."""
    return type(x) is not torch.Tensor and _DTensor is not None and isinstance(x, _DTensor)


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active (selective activation checkpointing, a FLOP
    counter): the fused layers then call their kernels through the registered ops, which such a
    mode sees, instead of launching them directly."""
    stack = getattr(torch._C, "_len_torch_dispatch_stack", None)
    return stack is not None and stack() > 0


def transforms_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) runs or forward-mode
    AD is on (a ``torch.autograd.forward_ad.dual_level`` is open). The layers' autograd Functions
    cannot run there (they define no ``setup_context``, vmap rule or ``jvp``), so the layers then
    take their PyTorch ops. ``False`` while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return False
    if getattr(forward_ad, "_current_level", -1) >= 0:
        return True
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is not None and active()


def is_plain(x: torch.Tensor) -> bool:
    """Whether ``x`` is a plain tensor (or parameter), whose data pointer holds its values: not a
    subclass such as ``DTensor``, a fake tensor or an asynchronous collective's result."""
    return type(x) in (torch.Tensor, torch.nn.Parameter)


def without_values(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a shape but no values to read on the host: a meta tensor, or a fake
    tensor (``FakeTensorMode``, which memory and FLOP estimates run models under)."""
    if t.is_meta:
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def through_ops(x: torch.Tensor) -> bool:
    """Whether the fused layers call their kernels through the registered ops for inputs like
    ``x``, rather than launching them directly: while ``torch.compile`` traces, under a
    ``TorchDispatchMode``, and for a tensor subclass such as ``DTensor``, whose dispatch only the
    ops reach (a launcher reads raw data pointers)."""
    return not is_plain(x) or torch.compiler.is_compiling() or dispatch_mode_active()


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a plain copy of it where ``t`` is the result of an asynchronous functional
    collective (``AsyncCollectiveTensor``: a wrapper whose data the kernels, which read raw
    pointers, cannot take before it is waited for; a tensor-parallel branch's reduce-scatter
    returns one). The copy is an op on the wrapper, so autograd follows it."""
    if type(t) is torch.Tensor:
        return t
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:
        return t
    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def top_saved_tensor_hooks():
    """The innermost open ``torch.autograd.graph.saved_tensors_hooks`` pair ``(pack, unpack)``, or
    ``None`` (also where PyTorch does not expose it)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def in_backward() -> bool:
    """Whether this runs inside an autograd backward (a graph task is executing)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def backward_task():
    """The id of the autograd backward now executing (each ``backward()`` call, and each nested
    one, gets its own), or ``None`` where PyTorch does not expose it."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return None if task is None else task()


def after_backward(callback) -> None:
    """Run ``callback`` once the autograd backward now executing has finished (the engine's
    callback queue, as DDP and FSDP use it). Call it only from inside a backward (a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


_SPECS: dict = {}


def unsharded_dtensor(local: torch.Tensor, mesh, placement) -> torch.Tensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False)`` for placements that shard nothing
    (``Replicate()`` or ``Partial()``; ``placement``: one for every mesh dim, or a tuple), with the
    spec built once per mesh, placement, shape, stride and dtype instead of per call. Not
    differentiable: call it without grad mode."""
    placements = tuple(placement) if isinstance(placement, (tuple, list)) else (placement,) * mesh.ndim
    key = (mesh, placements, local.shape, local.stride(), local.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        try:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        except ImportError:  # a PyTorch that moved the spec: the public path
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(local, mesh, placements, run_check=False)
        meta = TensorMeta(shape=local.shape, stride=local.stride(), dtype=local.dtype)
        spec = _SPECS[key] = DTensorSpec(mesh, placements, tensor_meta=meta)
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


_installed = False


def backport_checkpoint_tags() -> bool:
    """Tag the forward subgraphs of ``autograd.Function``\\ s inside checkpointed regions under
    ``torch.compile`` as their region (PyTorch < 2.12); returns whether the hook is installed."""
    global _installed
    if _installed:
        return True
    try:
        from torch._higher_order_ops.wrap import TagActivationCheckpoint
    except ImportError:
        return False
    original = getattr(TagActivationCheckpoint, "tag_nodes", None)
    if original is None or not hasattr(torch.ops.higher_order, "autograd_function_apply"):
        return False  # a PyTorch that tags every op itself

    def tag_nodes(gmod, *args, **kwargs):
        gmod = original(gmod, *args, **kwargs)
        tag_function_bodies(gmod)
        save_function_outputs(gmod)
        return gmod

    TagActivationCheckpoint.tag_nodes = staticmethod(tag_nodes)
    _installed = True
    return True


def tag_function_bodies(gmod: torch.fx.GraphModule) -> None:
    """Copy each ``autograd_function_apply`` node's checkpoint tags onto the nodes of its forward
    subgraph (and of the subgraphs nested in it), for the Functions that call ``mhc::`` ops."""
    for node in gmod.graph.nodes:
        body = _forward_body(gmod, node)
        if body is None or not _calls_mhc_ops(body):
            continue
        tags = {key: node.meta[key] for key in _TAGS if key in node.meta}
        for inner in body.graph.nodes:
            if inner.op in ("call_function", "call_method", "call_module"):
                inner.meta.update(tags)
        tag_function_bodies(body)


def _calls_mhc_ops(gmod: torch.fx.GraphModule) -> bool:
    """Whether ``gmod`` (or a subgraph it holds) calls an op of the ``mhc`` namespace, or one of
    ``mhc``'s Triton kernels (a ``triton_op``'s body is traced into the graph as its kernels)."""
    for node in gmod.graph.nodes:
        if node.op == "call_function" and (str(node.target).startswith("mhc.") or _is_mhc_kernel_call(node)):
            return True
        if node.op == "get_attr" and isinstance(sub := getattr(gmod, node.target, None), torch.fx.GraphModule):
            if _calls_mhc_ops(sub):
                return True
    return False


def _is_mhc_kernel_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` launches one of ``mhc``'s Triton kernels (a traced ``wrap_triton`` call)."""
    if "kernel_idx" not in node.kwargs:
        return False
    try:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    except ImportError:
        return False
    from mhc._compat.write_analysis import _jit_function

    function = _jit_function(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]))
    return function is not None and getattr(function.fn, "__module__", "").startswith("mhc.")


def save_function_outputs(gmod: torch.fx.GraphModule) -> None:
    """Mark the ops that make a checkpointed region's outputs inside ``autograd.Function`` bodies
    ``MUST_SAVE``: the region's output is the next region's input, which checkpointing keeps. The
    partitioner does that itself for an output made by a tagged op, but not where the op is a
    user Triton kernel (a ``triton_op``), whose outputs are ``getitem``\\ s of one node and are
    never forced to be saved: the next region's backward would then recompute every region
    before it."""
    from torch.utils.checkpoint import CheckpointPolicy

    output = next(n for n in gmod.graph.nodes if n.op == "output")
    for value in _flat(output.args):
        function, index = value, 0
        if value.op == "call_function" and value.target is operator.getitem:
            function, index = value.args
        body = _forward_body(gmod, function) if isinstance(index, int) else None
        if body is None or not _calls_mhc_ops(body):
            continue
        body_output = next(n for n in body.graph.nodes if n.op == "output")
        outputs = body_output.args[0][0]  # a Function's body returns ((outputs...), (saved...))
        made = outputs[index] if isinstance(outputs, (tuple, list)) and index < len(outputs) else None
        if isinstance(made, torch.fx.Node) and made.op == "call_function":
            made.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _forward_body(gmod: torch.fx.GraphModule, node) -> torch.fx.GraphModule | None:
    """The forward subgraph of ``node`` if it is an ``autograd_function_apply``, else ``None``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
        return None
    if node.target is not torch.ops.higher_order.autograd_function_apply:
        return None
    body_node = node.args[0]
    if not isinstance(body_node, torch.fx.Node) or body_node.op != "get_attr":
        return None
    return getattr(gmod, body_node.target)


def _flat(args) -> list:
    """The nodes in a nested tuple of graph arguments."""
    nodes = []
    torch.fx.node.map_arg(args, nodes.append)
    return nodes


def marked_must_save() -> bool:
    """Whether the graph node being traced is one that :func:`save_function_outputs` marked: a
    selective checkpointing policy keeps such an op's output (the region's output), since its
    choice would otherwise replace the mark."""
    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    return fx_traceback.get_current_meta().get("recompute") == CheckpointPolicy.MUST_SAVE
