"""qcompile.modules: one rule for what is a linear and what is a router, and the loader saying how much of
a model it quantized."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from qcompile.formats import parse_quant_config
from qcompile.formats.online import online_config
from qcompile.loading import _report_coverage
from qcompile.modules import LinearShape, is_router, linear_shape


class ScaledLinear(nn.Linear):  # a forward of its own that still computes x @ W.T + b
    def forward(self, x):
        return x @ self.weight.T + self.bias


class TopKRouter(nn.Linear):  # a forward of its own that is not a linear (Llama-4 style)
    def forward(self, x):
        logits = super().forward(x)
        return torch.sigmoid(logits), logits.topk(1, dim=-1).indices


def test_linear_shape():
    assert linear_shape(nn.Linear(5, 3)) == LinearShape(3, 5, True, False)
    assert linear_shape(ScaledLinear(5, 3)) == LinearShape(3, 5, True, False)
    assert linear_shape(Conv1D(3, 5)) == LinearShape(3, 5, True, True)  # Conv1D(nf=out, nx=in)
    assert linear_shape(TopKRouter(5, 3)) is None
    assert linear_shape(nn.Embedding(4, 3)) is None


def test_linear_shape_probe_ignores_the_default_device():
    with torch.device("meta"):
        layer = ScaledLinear(7, 2)
    assert linear_shape(layer) == LinearShape(2, 7, True, False)


@pytest.mark.parametrize("name,module,want", [
    ("model.layers.0.mlp.gate", nn.Linear(4, 2), True),
    ("model.layers.0.mlp.router", nn.Linear(4, 2), True),
    ("model.layers.0.mlp.shared_expert_gate", nn.Linear(4, 1), True),
    ("model.layers.0.feed_forward.router", TopKRouter(4, 2), True),
    ("model.layers.0.mlp.gate_proj", nn.Linear(4, 2), False),
    ("model.layers.0.mlp.gate_up_proj", nn.Linear(4, 2), False),
])
def test_is_router(name, module, want):
    assert is_router(name, module) is want


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.router = TopKRouter(4, 2)
        self.odd = type("OddLinear", (nn.Linear,), {"forward": lambda self, x: x.relu()})(4, 4)


def test_coverage_warns_when_nothing_was_quantized(caplog):
    qconfig = parse_quant_config(online_config())
    with caplog.at_level(logging.INFO, logger="qcompile"), pytest.warns(UserWarning) as record:
        _report_coverage(Toy(), {}, ["router"], qconfig)
    messages = [str(w.message) for w in record]
    assert any("no layer of Toy was quantized" in m for m in messages)
    assert any("1 nn.Linear subclasses with a forward of their own" in m and "OddLinear" in m for m in messages)
    assert "0 of 1 linear layers quantized" in caplog.text
