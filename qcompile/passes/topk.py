"""The top-k pass: a router's small top-k as ``k`` selection steps that inductor fuses into one kernel.

A Mixture-of-Experts router picks ``k`` of ``E`` experts per token with ``torch.topk`` (``k`` of 2..8, ``E`` of
8..256). Inductor has no lowering for ``topk``: it calls ATen's, two kernels on CUDA (a radix select, then a
sort of the ``k`` winners) that cost several microseconds each however small the row, every MoE layer, every
decode step. This pass writes it as ``k`` steps of "the largest value not yet picked, at its lowest index",

    m = max(where(picked, -inf, x));  i = min(position where x == m and not picked);  picked |= position == i

then gathers the values at the picked indices. Inductor fuses the whole chain, and usually the softmax before
it, into one kernel per router. The result is ``torch.topk``'s, sorted (largest first), with equal values in
ascending index order (where ``topk`` leaves their order unspecified) and NaN ranked above every number (+inf
too), as ``topk`` ranks it. It applies to floating-point ``topk`` over the last dimension with ``largest=True``,
no ``out=``, a static last dimension ``E <= MAX_E`` and ``k <= MAX_K``, on CUDA graphs compiled by inductor;
anything else is left alone. ``backend(small_topk=False)`` turns the pass off.
"""

from __future__ import annotations

import torch
from torch import fx

from .lowering import example, replace_calls

MAX_K = 16  # k selection steps (two reductions each) in one kernel
MAX_E = 1024  # a row inductor keeps in registers (a persistent reduction)
NAMES = ("input", "k", "dim", "largest", "sorted")


def topk_by_selection(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of a floating-point ``x`` in ``k`` selection steps (see the module doc)."""
    e = x.shape[-1]
    pos = torch.arange(e, device=x.device)
    nan = torch.isnan(x)
    key = torch.where(nan, torch.inf, x)  # topk ranks NaN above every number, +inf included:
    order = torch.where(nan, pos - e, pos)  # among equal keys, NaN first, then the lowest index
    picked = torch.zeros_like(x, dtype=torch.bool)
    ids = []
    for _ in range(k):
        masked = torch.where(picked, -torch.inf, key)
        best = masked.amax(-1, keepdim=True)
        first = torch.where((masked == best) & ~picked, order, e).amin(-1, keepdim=True)
        picked = picked | (order == first)
        ids.append(torch.where(first < 0, first + e, first))
    ids = torch.cat(ids, -1)
    return x.gather(-1, ids), ids


def _rewritable(node: fx.Node, devices: tuple[str, ...]) -> tuple[fx.Node, int] | None:
    """(input, k) when ``node`` is a top-k this pass runs (see the module doc)."""
    if not ((node.op == "call_function" and node.target is torch.topk)
            or (node.op == "call_method" and node.target == "topk")):
        return None
    args = dict(zip(NAMES, node.args), **node.kwargs)
    x, k = example(args.get("input")), args.get("k")
    if "out" in args or not isinstance(x, torch.Tensor) or not isinstance(k, int) or x.device.type not in devices:
        return None
    if not x.dtype.is_floating_point or x.dim() == 0 or not args.get("largest", True):
        return None
    if args.get("dim", -1) not in (-1, x.dim() - 1):
        return None
    e = x.shape[-1]
    if not isinstance(e, int) or not 1 <= k <= min(MAX_K, e) or e > MAX_E:  # a dynamic E: left alone
        return None
    return args["input"], k


def rewrite_small_topk(gm: fx.GraphModule, example_inputs=None, devices: tuple[str, ...] = ("cuda",)) -> list:
    """Rewrite every small top-k of ``gm`` on ``devices`` in place (see the module doc). Returns no explain
    rows (the table lists quantized layers); logs how many it rewrote."""
    return replace_calls(gm, lambda node: _rewritable(node, devices), topk_by_selection,
                         "small top-k call(s) run as selection steps inductor fuses")
