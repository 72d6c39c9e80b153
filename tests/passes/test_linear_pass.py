"""The Linear pass: graph before/after (expecttest), match counts, negatives, numerics."""

from __future__ import annotations

import copy
import difflib
import re

import pytest
import torch
from expecttest import assert_expected_inline

import qcompile
from qcompile.linear import dequantize_model
from tests.passes.graph_util import renumbered

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])


# Dynamo names a parameter after the path from the traced module: l_self_modules_model_modules_layers_modules_0_
# modules_mlp_modules_up_proj_parameters_weight_, or l_args_0_modules_... where the module reaches the traced
# frame as its first argument (transformers 5.24's forward wrapper)
_PARAM = r"\bl_(?:self|args_0)_modules_\w+"


def _short_name(m: re.Match) -> str:
    name = re.sub(r"^l_(?:self|args_0)_modules_", "", m.group(0)).removesuffix("_")
    return name.replace("_modules_", ".").replace("_parameters_", ".")


def _linear_lines(code: str) -> list[str]:
    """The statements that compute a linear (and split a fused one's output), with Dynamo's placeholder names shortened to module paths
    and FX's trailing `;  a = b = None` clean-up dropped."""
    lines = []
    for line in code.splitlines():
        stmt = line.strip().split(";  ")[0]
        if any(t in stmt for t in ("torch.ops.qcompile", "_C._nn.linear", "self._qcompile", "split_with_sizes")):
            lines.append(re.sub(_PARAM, _short_name, stmt))
    return lines


def _graph_diff(before: str, after: str) -> str:
    """Before/after of the linears only: what the pass rewrote, names renumbered (:func:`renumbered`)."""
    diff = difflib.unified_diff(_linear_lines(before), _linear_lines(after), lineterm="", n=0)
    return "\n".join(renumbered([x for x in diff if x[:1] in "+-" and not x.startswith(("+++", "---"))]))


def compile_and_diff(model, **options):
    """(logits, graph diff of the linears, backend) of ``model`` compiled with ``options``; the Linear pass
    alone unless ``fuse=True`` (tests/passes/test_fuse_linears.py)."""
    options.setdefault("fuse", False)
    graphs = []
    torch._dynamo.reset()  # a model of the same structure compiled earlier would be reused silently
    be = qcompile.backend(inner="eager", on_graph=lambda b, a: graphs.append((b, a)), **options)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits
    assert len(graphs) == 1, "the model must compile as one graph"
    return out, _graph_diff(*graphs[0]), be


def load_and_diff(one_layer, fmt, **options):
    """compile_and_diff of the one-layer checkpoint in ``fmt``, loaded with qcompile.load: (diff, backend)."""
    _, diff, be = compile_and_diff(qcompile.load(str(one_layer(fmt))), **options)
    return diff, be


def test_modelopt_fp8_per_tensor(one_layer):
    diff, be = load_and_diff(one_layer, "modelopt-fp8")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, model.layers.0.self_attn.q_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, model.layers.0.self_attn.k_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, model.layers.0.self_attn.v_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, model.layers.0.self_attn.o_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, model.layers.0.mlp.gate_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, model.layers.0.mlp.up_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, model.layers.0.mlp.down_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, input_scale = model.layers.0.self_attn.q_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, input_scale = model.layers.0.self_attn.k_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, input_scale = model.layers.0.self_attn.v_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = model.layers.0.self_attn.o_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_4 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, input_scale = model.layers.0.mlp.gate_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_5 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, input_scale = model.layers.0.mlp.up_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_6 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = model.layers.0.mlp.down_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')""")
    assert len(be.rows) == 7


def test_modelopt_fp8_per_channel_per_token(one_layer):
    diff, be = load_and_diff(one_layer, "modelopt-fp8-pcpt")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_4 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_5 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+fp8_linear_default_6 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')""")


def test_modelopt_fp8_block(one_layer):
    diff, be = load_and_diff(one_layer, "modelopt-fp8-pbwo")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128')
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_4 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_5 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')
+fp8_linear_default_6 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128', backend = 'emulated')""")


def test_compressed_tensors_fp8_static(one_layer):
    diff, be = load_and_diff(one_layer, "ct-fp8-static")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, model.layers.0.self_attn.q_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, model.layers.0.self_attn.k_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, model.layers.0.self_attn.v_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, model.layers.0.self_attn.o_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, model.layers.0.mlp.gate_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, model.layers.0.mlp.up_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, model.layers.0.mlp.down_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, input_scale = model.layers.0.self_attn.q_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, input_scale = model.layers.0.self_attn.k_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, input_scale = model.layers.0.self_attn.v_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = model.layers.0.self_attn.o_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_4 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, input_scale = model.layers.0.mlp.gate_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_5 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, input_scale = model.layers.0.mlp.up_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+fp8_linear_default_6 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = model.layers.0.mlp.down_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')""")


def test_online_fp8_per_tensor_at_compile_time(one_layer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(one_layer("bf16")), dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(IDS).logits
    out, diff, be = compile_and_diff(model, online="fp8_per_tensor")
    assert_expected_inline(diff, """\
-linear = torch._C._nn.linear(hidden_states, model.layers.0.self_attn.q_proj.weight, None)
-linear_1 = torch._C._nn.linear(hidden_states, model.layers.0.self_attn.k_proj.weight, None)
-linear_2 = torch._C._nn.linear(hidden_states, model.layers.0.self_attn.v_proj.weight, None)
-attn_output = torch._C._nn.linear(attn_output_1, model.layers.0.self_attn.o_proj.weight, None)
-linear_3 = torch._C._nn.linear(hidden_states_1, model.layers.0.mlp.gate_proj.weight, None)
-linear_4 = torch._C._nn.linear(hidden_states_1, model.layers.0.mlp.up_proj.weight, None)
-down_proj = torch._C._nn.linear(mul, model.layers.0.mlp.down_proj.weight, None)
+_qcompile_online_w0 = self._qcompile_online_w0
+_qcompile_online_s0 = self._qcompile_online_s0
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = _qcompile_online_w0, weight_scale = _qcompile_online_s0, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w1 = self._qcompile_online_w1
+_qcompile_online_s1 = self._qcompile_online_s1
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = _qcompile_online_w1, weight_scale = _qcompile_online_s1, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w2 = self._qcompile_online_w2
+_qcompile_online_s2 = self._qcompile_online_s2
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = _qcompile_online_w2, weight_scale = _qcompile_online_s2, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w3 = self._qcompile_online_w3
+_qcompile_online_s3 = self._qcompile_online_s3
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = _qcompile_online_w3, weight_scale = _qcompile_online_s3, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w4 = self._qcompile_online_w4
+_qcompile_online_s4 = self._qcompile_online_s4
+fp8_linear_default_4 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = _qcompile_online_w4, weight_scale = _qcompile_online_s4, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w5 = self._qcompile_online_w5
+_qcompile_online_s5 = self._qcompile_online_s5
+fp8_linear_default_5 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = _qcompile_online_w5, weight_scale = _qcompile_online_s5, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')
+_qcompile_online_w6 = self._qcompile_online_w6
+_qcompile_online_s6 = self._qcompile_online_s6
+fp8_linear_default_6 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = _qcompile_online_w6, weight_scale = _qcompile_online_s6, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor', backend = 'emulated')""")
    rows = {r.module: r for r in be.rows}
    # lm_head is tied to the embedding: Dynamo hands one weight, named after the embedding
    assert rows["model.embed_tokens"].kernel == "bf16" and "tied" in rows["model.embed_tokens"].reason
    assert sum(r.kernel != "bf16" for r in be.rows) == 7
    # per-tensor FP8 weights + activations on this random model: ~9 % (see docs/design.md, Numerics)
    assert ((out.float() - want.float()).norm() / want.float().norm()) < 0.15



# (inner compiler, tolerance vs the eager model quantized the same way at load): eager and aot_eager run the
# same ops (identical); inductor keeps fp32 intermediates in the norms / RoPE / softmax where eager rounds to
# bf16, which FP8 activation rounding amplifies to a few % (docs/design.md, Numerics)
INNERS = {"eager": 1e-3, "aot_eager": 1e-3, "inductor": 0.1}


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("online,scheme", [("fp8_per_tensor", "w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor"),
                                           ("fp8_per_block", "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128")])
def test_online_fp8_at_compile_time_with_every_inner_compiler(one_layer, inner, online, scheme):
    """The pass's quantized weights are graph constants AOTAutograd (aot_eager, inductor) accepts: the
    compiled bf16 model matches the same model quantized while loading."""
    from transformers import AutoModelForCausalLM

    path = str(one_layer("bf16"))
    with torch.no_grad():
        want = qcompile.load(path, online=online)(IDS).logits.float()
    torch._dynamo.reset()
    be = qcompile.backend(inner=inner, online=online, fuse=False)  # fused per-tensor: one scale for q, k, v
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits.float()
    rows = [r for r in be.rows if r.kernel != "bf16"]
    assert len(rows) == 7 and {(r.scheme, r.op) for r in rows} == {(scheme, "qcompile::fp8_linear")}
    assert "fp8_scaled_mm: needs a CUDA device" in rows[0].reason
    rel = ((out - want).norm() / want.norm()).item()
    assert torch.isfinite(out).all() and rel < INNERS[inner], rel

def test_kernel_override_to_reference_leaves_the_reference_op(one_layer):
    diff, be = load_and_diff(one_layer, "modelopt-fp8", kernels="reference")
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
    from qcompile.modules import ROUTER_LEAVES

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


def test_compressed_tensors_w4a16_lowers_to_the_weight_only_op(one_layer):
    diff, be = load_and_diff(one_layer, "ct-w4a16")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
+wo_linear_default = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_1 = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_2 = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_3 = torch.ops.qcompile.wo_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_4 = torch.ops.qcompile.wo_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_5 = torch.ops.qcompile.wo_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+wo_linear_default_6 = torch.ops.qcompile.wo_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')""")
    assert {r.kernel for r in be.rows} == {"wo_dequant"}  # on CUDA: wo_triton


def test_compressed_tensors_w4a16_asym_passes_its_zero_points(one_layer):
    """W4A16_ASYM: the zero points unpacked at load reach the weight-only op; compiled output equals
    the dequantized bf16 model's up to rounding."""
    model = qcompile.load(str(one_layer("ct-w4a16-asym")))
    with torch.no_grad():
        want = dequantize_model(copy.deepcopy(model))(IDS).logits
    out, diff, be = compile_and_diff(model)
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, model.layers.0.self_attn.q_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, model.layers.0.self_attn.k_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, model.layers.0.self_attn.v_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, model.layers.0.self_attn.o_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, model.layers.0.mlp.gate_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, model.layers.0.mlp.up_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, model.layers.0.mlp.down_proj.weight_zero_point, None, None, None, None, 'w=int4/group128/pack=int32/zp;a=none')
+wo_linear_default = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.q_proj.weight, weight_scale = model.layers.0.self_attn.q_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.self_attn.q_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_1 = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.k_proj.weight, weight_scale = model.layers.0.self_attn.k_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.self_attn.k_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_2 = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = model.layers.0.self_attn.v_proj.weight, weight_scale = model.layers.0.self_attn.v_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.self_attn.v_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_3 = torch.ops.qcompile.wo_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.self_attn.o_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_4 = torch.ops.qcompile.wo_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.gate_proj.weight, weight_scale = model.layers.0.mlp.gate_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.mlp.gate_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_5 = torch.ops.qcompile.wo_linear.default(x = hidden_states_1, weight = model.layers.0.mlp.up_proj.weight, weight_scale = model.layers.0.mlp.up_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.mlp.up_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')
+wo_linear_default_6 = torch.ops.qcompile.wo_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, weight_global_scale = None, weight_zero_point = model.layers.0.mlp.down_proj.weight_zero_point, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32/zp;a=none', backend = 'dequant')""")
    assert {r.kernel for r in be.rows} == {"wo_dequant"}
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "modelopt-mxfp8"])
def test_nvfp4_w4a4_stays_faithful_off_cuda(one_layer, fmt):
    """Off CUDA nothing is gained by dropping NVFP4 / MXFP8 activation quantization: the reference stays."""
    diff, be = load_and_diff(one_layer, fmt)
    assert diff == "" and {r.kernel for r in be.rows} == {"reference"}
    assert "on cpu the faithful reference is as fast" in be.rows[0].reason


def test_source_name_from_either_root():
    """A parameter's module path from Dynamo's source, whether the module is the traced frame's `self` or
    reaches it as its first argument (transformers 5.24 wraps `forward` so)."""
    from types import SimpleNamespace

    from qcompile.passes.linear import module_of, source_name

    def node(text):
        return SimpleNamespace(name="p", meta={"grapharg": SimpleNamespace(source=SimpleNamespace(name=lambda: text))})

    path = "._modules['model']._modules['layers']._modules['0']._modules['mlp']._modules['up_proj']._parameters['weight']"
    for root in ("L['self']", "L['args'][0]"):
        assert source_name(node(root + path)) == "model.layers.0.mlp.up_proj.weight"
        assert module_of(node(root + path)) == "model.layers.0.mlp.up_proj"
    assert source_name(SimpleNamespace(name="p", meta={})) == "p"
