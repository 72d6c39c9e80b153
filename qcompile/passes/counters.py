"""The counter pass: the layers' in-place length-counter increments as one multi-tensor add at the graph's end.

transformers' static cache (and qcompile's FP8 cache) keeps one length counter per layer, a 0-dim integer tensor
the layer's ``update`` reads (``cache_position = arange(n) + counter``) and then bumps in place
(``counter.add_(n)``) in the middle of the layer. Compiled, every increment is its own tiny kernel between the
layer's matmuls: 32 launches per decode step of a 32-layer model, none of which anything later in the step
reads. This pass removes those ``add_`` calls and adds one ``torch._foreach_add_(counters, n)`` per amount at
the end of the graph, which inductor compiles into one kernel. The counters end the step with the same values.

An increment is moved only where that cannot change what the graph computes: ``tensor.add_(number)`` with its
result unused, on a 0-dim integer graph input that nothing reads after the increment (the reads before it being
arithmetic that makes a new tensor, or anything whose uses all come before the increment), whose memory no other
graph input shares. At least two such increments per graph, or nothing changes.
``backend(batch_counters=False)`` turns the pass off.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from .lowering import finish_rewrites

# calls that read a tensor into a new one (their results never alias the counter)
_NEW = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.lt, operator.le,
        operator.gt, operator.ge, operator.eq, operator.ne, torch.add, torch.sub, torch.mul, torch.eq, torch.lt,
        torch.le, torch.gt, torch.ge}
_NEW_METHODS = {"add", "sub", "mul", "eq", "lt", "le", "gt", "ge", "item", "tolist", "clone"}


def _makes_new(node: fx.Node) -> bool:
    return node.target in _NEW if node.op == "call_function" else \
        node.op == "call_method" and node.target in _NEW_METHODS


def _read_only_before(counter: fx.Node, increment: fx.Node, order: dict) -> bool:
    """Whether every use of ``counter`` other than ``increment``, and every use of a value that may be a view of
    it, is placed before ``increment``."""
    todo, seen = [counter], {increment}
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if order[user] >= order[increment]:
                return False
            if not _makes_new(user):
                todo.append(user)
    return True


def _increment(node: fx.Node, order: dict) -> tuple[fx.Node, int | float] | None:
    """(the counter placeholder, the amount) when ``node`` is an increment the pass may move (module doc)."""
    if not (node.op == "call_method" and node.target == "add_" and len(node.args) == 2 and not node.kwargs
            and not node.users):
        return None
    counter, amount = node.args
    if not (isinstance(counter, fx.Node) and counter.op == "placeholder" and type(amount) in (int, float)):
        return None
    value = counter.meta.get("example_value")
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point
            and not value.is_complex() and value.dtype != torch.bool):
        return None
    return (counter, amount) if _read_only_before(counter, node, order) else None


def _storage(t) -> tuple | None:
    """(device, address) of ``t``'s memory; None where there is none to compare (not a tensor, a fake, a
    subclass)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _distinct(counters: list[fx.Node], gm: fx.GraphModule, example_inputs) -> bool:
    """Whether no other graph input shares memory with a counter, nor two counters one another: judged on the
    tensors Dynamo passes as example inputs (without them, or with fake ones, nothing is moved)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(example_inputs or ()) != len(placeholders):
        return False
    storages = [_storage(t) if isinstance(t, torch.Tensor) else None for t in example_inputs]
    for node in counters:
        key = storages[placeholders.index(node)]
        if key is None or key[1] == 0 or storages.count(key) != 1:
            return False
    return True


def batch_counter_increments(gm: fx.GraphModule, example_inputs=None) -> list:
    """Move the counter increments of ``gm`` to one ``_foreach_add_`` per amount at its end (module doc).
    Returns no explain rows; logs how many increments it moved."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = [(n, hit) for n in graph.nodes if (hit := _increment(n, order)) is not None]
    groups: dict[tuple, list] = {}
    for node, (counter, amount) in found:
        value = counter.meta["example_value"]
        groups.setdefault((amount, type(amount), value.device, value.dtype), []).append((node, counter))
    output = next(n for n in graph.nodes if n.op == "output")
    count = 0
    for (amount, *_), members in groups.items():
        counters = [c for _, c in members]
        if len(members) < 2 or len(set(counters)) != len(counters) or not _distinct(counters, gm, example_inputs):
            continue
        for node, _ in members:
            graph.erase_node(node)
        with graph.inserting_before(output):
            graph.call_function(torch._foreach_add_, (counters, amount))
        count += len(members)
    return finish_rewrites(gm, count, "counter increment(s) batched into one multi-tensor add")
