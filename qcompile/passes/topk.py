"""The top-k pass: a router's small top-k as ``k`` selection steps that inductor fuses into one kernel.

A Mixture-of-Experts router picks ``k`` of ``E`` experts per token with ``torch.topk`` (``k`` of 2..8, ``E`` of
8..256). Inductor has no lowering for ``topk``: it calls ATen's, two kernels on CUDA (a radix select, then a
sort of the ``k`` winners) that cost several microseconds each however small the row, every MoE layer, every
decode step. This pass writes it as ``k`` steps of "the largest value not yet picked, at its lowest index" on one
int64 key per element (the value's fp32 bits mapped to an order-preserving int32 in the high half, ``E - 1 - i`` in
the low half, so that the lower index wins a tie):

    best = max(key);  i = E - 1 - (best & 0xFFFFFFFF);  key = where(key == best, INT64_MIN, key)

one max reduction per step, then gathers the values at the picked indices. Inductor fuses the whole chain, and
usually the softmax before it, into one kernel per router. The result is ``torch.topk``'s, sorted (largest first),
with equal values in ascending index order (where ``topk`` leaves their order unspecified) and NaN ranked above
every number (+inf too), as ``topk`` ranks it. It applies to floating-point ``topk`` over the last dimension with
``largest=True``, no ``out=``, a static last dimension ``E <= MAX_E`` and ``k <= MAX_K``, on CUDA graphs compiled by
inductor; anything else is left alone. ``backend(small_topk=False)`` turns the pass off.
"""

from __future__ import annotations

import torch
from torch import fx

from .lowering import example, replace_calls

MAX_K = 16  # k selection steps (two reductions each) in one kernel
MAX_E = 1024  # a row inductor keeps in registers (a persistent reduction)
NAMES = ("input", "k", "dim", "largest", "sorted")


INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)


def topk_by_selection(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of a floating-point ``x`` in ``k`` selection steps (see the module doc).

    Each element is one int64 key, value then position: the high half the fp32 value's bits mapped so that signed
    integer order is the float order (NaN above +inf, -0.0 made +0.0 so that zeros tie), the low half ``E - 1 - i``
    (the lower index wins a tie). A step is then one max reduction over the keys, where a value and an index each
    took one."""
    e = x.shape[-1]
    bits = (x.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    value = torch.where(torch.isnan(x), INT32_MAX, bits ^ ((bits >> 31) & INT32_MAX))
    key = (value.long() << 32) | (e - 1 - torch.arange(e, device=x.device))
    ids = []
    for _ in range(k):
        best = key.amax(-1, keepdim=True)
        key = torch.where(key == best, INT64_MIN, key)
        ids.append(e - 1 - (best & 0xFFFFFFFF))
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
