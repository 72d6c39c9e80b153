"""The Linear pass: graph before/after (expecttest), match counts, negatives, numerics."""

from __future__ import annotations

import difflib
import re

import pytest
import torch
from expecttest import assert_expected_inline

import qcompile
from qcompile import synth

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])


def _graph_diff(before: str, after: str) -> str:
    """Changed lines only, with Dynamo's long placeholder names shortened to the module path."""
    def short(line: str) -> str:
        line = re.sub(r"l_self_modules_model_modules_layers_modules_(\d+)_modules_(\w+?)_modules_(\w+?)_parameters_(\w+?)_",
                      r"L\1.\2.\3.\4", line)
        return line.strip()
    diff = difflib.unified_diff([short(x) for x in before.splitlines()], [short(x) for x in after.splitlines()],
                                lineterm="", n=0)
    return "\n".join(x for x in diff if x[:1] in "+-" and not x.startswith(("+++", "---")))


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    cache = {}

    def make(fmt):
        if fmt not in cache:
            path = tmp_path_factory.mktemp(fmt)
            synth.write_checkpoint(str(path), fmt, config=synth.tiny_llama_config(num_hidden_layers=1))
            cache[fmt] = path
        return cache[fmt]
    return make


def compile_and_diff(model, **options):
    graphs = []
    be = qcompile.backend(inner="eager", on_graph=lambda b, a: graphs.append((b, a)), **options)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits
    assert len(graphs) == 1, "the model must compile as one graph"
    return out, _graph_diff(*graphs[0]), be


def test_modelopt_fp8_per_tensor(one_layer):
    model = qcompile.load(str(one_layer("modelopt-fp8")))
    out, diff, be = compile_and_diff(model)
    assert_expected_inline(diff, """""")
    assert len(be.rows) == 7


def test_modelopt_fp8_per_channel_per_token(one_layer):
    model = qcompile.load(str(one_layer("modelopt-fp8-pcpt")))
    out, diff, be = compile_and_diff(model)
    assert_expected_inline(diff, """""")


def test_modelopt_fp8_block(one_layer):
    model = qcompile.load(str(one_layer("modelopt-fp8-pbwo")))
    out, diff, be = compile_and_diff(model)
    assert_expected_inline(diff, """""")


def test_compressed_tensors_fp8_static(one_layer):
    model = qcompile.load(str(one_layer("ct-fp8-static")))
    out, diff, be = compile_and_diff(model)
    assert_expected_inline(diff, """""")


def test_online_fp8_per_tensor_at_compile_time(one_layer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(one_layer("bf16")), dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(IDS).logits
    out, diff, be = compile_and_diff(model, online="fp8_per_tensor")
    assert_expected_inline(diff, """""")
    kernels = {r.module: r.kernel for r in be.rows}
    assert kernels["lm_head"] == "bf16"  # excluded: never quantized online
    assert ((out.float() - want.float()).norm() / want.float().norm()) < 0.05


def test_kernel_override_to_reference_leaves_the_reference_op(one_layer):
    model = qcompile.load(str(one_layer("modelopt-fp8")))
    out, diff, be = compile_and_diff(model, kernels="reference")
    assert diff == ""  # nothing rewritten: the graph already holds the reference op
    assert {r.kernel for r in be.rows} == {"reference"}


def test_unquantized_model_is_left_alone(one_layer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(one_layer("bf16")), dtype=torch.bfloat16)
    out, diff, be = compile_and_diff(model)
    assert diff == "" and be.rows == []


def test_compiled_matches_eager_for_every_scheme(one_layer):
    for fmt in ("modelopt-fp8", "modelopt-fp8-pcpt", "modelopt-fp8-pbwo", "ct-fp8-static", "ct-fp8-dynamic",
                "ct-fp8-block"):
        model = qcompile.load(str(one_layer(fmt)))
        with torch.no_grad():
            want = model(IDS).logits
        out, _, _ = compile_and_diff(model)
        rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-2, (fmt, rel)


def test_router_is_never_quantized_online():
    """A MoE router (an nn.Linear named `gate`) stays bf16 under online quantization."""
    from qcompile.passes.linear import ROUTER_LEAVES

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(128, 16, bias=False, dtype=torch.bfloat16)
            self.up_proj = torch.nn.Linear(128, 256, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            return self.gate(x).sum(-1, keepdim=True) * self.up_proj(x)

    be = qcompile.backend(inner="eager", online="fp8_per_tensor")
    torch.compile(Block(), backend=be)(torch.randn(4, 128, dtype=torch.bfloat16))
    kinds = {r.module: r.kernel for r in be.rows}
    assert "gate" in ROUTER_LEAVES and kinds["gate"] == "bf16" and kinds["up_proj"] != "bf16"
