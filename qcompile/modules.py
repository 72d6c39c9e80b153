"""Which modules of a transformers model are linears, and which are MoE routers: one rule for the
loader and the compile-time pass.

A module is a linear when its forward computes a linear: ``nn.Linear`` itself, a subclass whose own
forward still computes ``x @ W.T + b`` (Falcon's ``FalconLinear``; checked once per class on a small
probe), and transformers' ``Conv1D`` (GPT-2 style: ``x @ W + b`` with ``W`` stored [in, out]). A
subclass whose forward computes something else (Llama-4's router: top-k and a sigmoid after the
matmul, returning a tuple) is not. Routers and gates (modules named ``gate``, ``router``, ``shared_expert_gate``, or
whose class is a router) choose experts; they are never quantized online, as vLLM builds them
unquantized.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    bias: bool
    transposed: bool  # the weight is stored [in, out] (Conv1D)


def _conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - every supported transformers has it
        return None
    return Conv1D


_PROBED: dict[type, bool] = {}


def _forward_is_linear(module: nn.Linear) -> bool:
    """Whether ``type(module).forward`` computes ``x @ W.T + b``: run once per class on a copy of the
    module holding a small random weight (the real one may still be on the meta device)."""
    cls = type(module)
    if cls.forward is nn.Linear.forward:
        return True
    if cls not in _PROBED:
        probe = copy.copy(module)
        probe._parameters, probe._buffers, probe._modules = dict(module._parameters), {}, {}
        gen = torch.Generator().manual_seed(0)  # on the CPU, whatever default device a load has set
        w, x = torch.randn(3, 5, generator=gen, device="cpu"), torch.randn(2, 5, generator=gen, device="cpu")
        b = torch.randn(3, generator=gen, device="cpu") if module.bias is not None else None
        probe.weight = nn.Parameter(w, requires_grad=False)
        probe.bias = None if b is None else nn.Parameter(b, requires_grad=False)
        probe.in_features, probe.out_features = 5, 3
        try:
            with torch.no_grad():
                out = cls.forward(probe, x)
            _PROBED[cls] = isinstance(out, torch.Tensor) and out.shape == (2, 3) and torch.allclose(
                out, torch.nn.functional.linear(x, w, b), atol=1e-5)
        except Exception:  # noqa: BLE001 - any failure means: not a plain linear
            _PROBED[cls] = False
    return _PROBED[cls]


def linear_shape(module: nn.Module) -> LinearShape | None:
    """The linear ``module`` computes, or None when its forward is not a plain linear."""
    if isinstance(module, nn.Linear):
        if not _forward_is_linear(module):
            return None
        return LinearShape(module.out_features, module.in_features, module.bias is not None, False)
    conv1d = _conv1d()
    if conv1d is not None and isinstance(module, conv1d) and type(module).forward is conv1d.forward:
        k, n = module.weight.shape
        return LinearShape(n, k, module.bias is not None, True)
    return None


def is_router(name: str, module: nn.Module | None = None) -> bool:
    """True for an MoE router or gate, by its name (``...mlp.gate``) or its class (``*Router``)."""
    if name.rpartition(".")[2] in ROUTER_LEAVES:
        return True
    return module is not None and "Router" in type(module).__name__
