"""What every lowering pass shares: finding a reference op's module, asking the registry, the explain
row, and emitting the selected kernel's op in place of the reference op.

A pass (``passes/linear.py``, ``passes/experts.py``) only says which reference op it looks for and how
a node's arguments make a :class:`~qcompile.kernels.registry.KernelQuery`; :func:`lower_node` does the
rest. Kernel ops share their reference op's argument names, so :func:`emit` fills any kernel op from
its schema by name (plus ``scheme`` and ``backend``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import fx

from ..kernels.registry import KernelQuery, Selection, select

log = logging.getLogger("qcompile")


@dataclass
class ExplainRow:
    module: str
    scheme: str
    op: str
    kernel: str
    reason: str = ""


def source_name(node: fx.Node) -> str:
    """``model.layers.0.mlp.up_proj.weight`` for a parameter placeholder (from Dynamo's source); for a
    constant a pass made, the name it recorded in ``node.meta["qcompile_source"]``."""
    if "qcompile_source" in node.meta:
        return node.meta["qcompile_source"]
    ga = node.meta.get("grapharg")
    text = getattr(ga, "source", None)
    text = getattr(text, "name", None)
    text = text() if callable(text) else text
    if not text:
        return node.name
    # L['self']._modules['model']._modules['layers']._modules['0']...._parameters['weight'], or with the
    # module reaching the frame as an argument, L['args'][0]._modules['model']... (transformers 5.24)
    parts = [a or b or c for a, b, c in re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", text)]
    marks = ("_modules", "_parameters", "_buffers")
    start = next((i for i, p in enumerate(parts) if p in marks), 1)  # past the root (L['self'], L['args'][0])
    parts = [p for p in parts[start:] if p not in marks]
    return ".".join(parts) or text


def module_of(node) -> str:
    """The module a parameter node belongs to ("?" for a value that is not a graph node)."""
    return source_name(node).rpartition(".")[0] if hasattr(node, "meta") else "?"


def op_of(name: str):
    """``"qcompile::fp8_linear"`` -> its default overload."""
    ns, op = name.split("::")
    return getattr(getattr(torch.ops, ns), op).default


def bind(node: fx.Node, op) -> dict:
    """A call node's arguments by the op's argument names."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def finish_rewrites(gm: fx.GraphModule, count: int, what: str) -> list:
    """After a pass that rewrote ``count`` nodes: check and regenerate ``gm``, log ``count`` and ``what``.
    Returns no explain rows (for the passes that lower no quantized layer)."""
    if count:
        gm.graph.lint()
        gm.recompile()
        log.info("qcompile: %d %s", count, what)
    return []


def replace_calls(gm: fx.GraphModule, match, fn, what: str) -> list:
    """Replace every node of ``gm`` for which ``match(node)`` gives a tuple of arguments by ``fn(*arguments)``
    (same meta, same users), then :func:`finish_rewrites` with ``what``. For the passes that rewrite calls
    into plain graph ops."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(fn, found)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    return finish_rewrites(gm, count, what)


def example(node_or_const):
    """The example value (a tensor, or its fake) behind a node argument."""
    return node_or_const.meta.get("example_value", node_or_const.meta.get("val")) \
        if isinstance(node_or_const, fx.Node) else node_or_const


def emit(graph: fx.Graph, node: fx.Node, args: dict, sel: Selection, scheme_key: str) -> fx.Node:
    """The selected kernel's op, called with ``args`` by name, inserted before ``node``."""
    op = op_of(sel.kernel.op)
    kwargs = {}
    for a in op._schema.arguments:
        if a.name == "scheme":
            kwargs[a.name] = scheme_key
        elif a.name == "backend":
            kwargs[a.name] = sel.kernel.backend
        elif a.name in args:
            kwargs[a.name] = args[a.name]
        elif not a.has_default_value():
            kwargs[a.name] = None
    with graph.inserting_before(node):
        new = graph.call_function(op, kwargs=kwargs)
    new.meta.update(node.meta)
    return new


def lower_node(graph: fx.Graph, node: fx.Node, args: dict, query: KernelQuery, module: str, kernels,
               reference_op: str) -> tuple[ExplainRow, Selection]:
    """Select the kernel for ``query`` and, unless it is the reference op ``node`` already calls,
    replace ``node`` by the kernel's op. Returns the explain row and the selection."""
    sel = select(query, kernels, module)
    row = ExplainRow(module, args["scheme"], sel.kernel.op, sel.kernel.name, sel.reason)
    if sel.kernel.op == reference_op and node.target in (op_of(reference_op), op_of(reference_op).overloadpacket):
        return row, sel  # already the reference
    new = emit(graph, node, args, sel, args["scheme"])
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    log.info("qcompile: %s [%s] -> %s (%s)%s", module, args["scheme"], sel.kernel.op, sel.kernel.name,
             f"; passed over {sel.reason}" if sel.reason else "")
    return row, sel
