"""The Experts pass with online FP8: each HF experts region (grouped_mm, batched_mm, the fp32
grouped_mm_fallback) becomes one experts_ref on constants (expecttest graph diffs of the rewritten
region), an eager experts implementation is reported, and the result equals the load-time model."""

from __future__ import annotations

import re

import pytest
import torch
from expecttest import assert_expected_inline
from transformers import AutoConfig, AutoModelForCausalLM

import qcompile
from tests.passes.graph_util import renumbered

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])
# One Qwen3-MoE layer: 4 experts, top-2, hidden 128, experts' intermediate 128.
CONFIG = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256, num_experts=4,
              num_experts_per_tok=2, max_position_embeddings=256)
# the statements of an experts region: its matmuls, and the op that replaces it
_REGION = ("_grouped_mm", "grouped_mm_fallback", "torch.bmm", "experts_ref")
_PARAM = r"\bl_(?:self|args_0)_modules_(\w+?)_parameters_(\w+?)_\b"


def _region_lines(code: str) -> list[str]:
    lines = []
    for line in code.splitlines():
        stmt = line.strip().split(";  ")[0]
        if any(t in stmt for t in _REGION):
            lines.append(re.sub(_PARAM, lambda m: m.group(1).replace("_modules_", ".") + "." + m.group(2), stmt))
    return lines


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = AutoConfig.for_model("qwen3_moe", **CONFIG)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3_moe")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    return path


def _compile(path, implementation: str, dtype=torch.bfloat16, online="fp8_per_tensor"):
    """(region statements before, after, output, backend) of the bf16 model compiled with online FP8, names
    renumbered (:func:`renumbered`) over both."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.set_experts_implementation(implementation)
    graphs = []
    torch._dynamo.reset()
    # fuse=False: the linears keep their own scales, as at load
    be = qcompile.backend(online=online, inner="eager", fuse=False, on_graph=lambda b, a: graphs.append((b, a)))
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits
    assert len(graphs) == 1
    before, after = _region_lines(graphs[0][0]), _region_lines(graphs[0][1])
    lines = renumbered(before + after)
    return "\n".join(lines[:len(before)]), "\n".join(lines[len(before):]), out, be


def _load_time(path, dtype=torch.bfloat16, online="fp8_per_tensor"):
    with torch.no_grad():
        return qcompile.load(str(path), online=online, dtype=dtype)(IDS).logits


def test_grouped_mm_region(checkpoint):
    before, after, out, be = _compile(checkpoint, "grouped_mm")
    assert_expected_inline(before, """\
out = torch._grouped_mm(to, transpose, offs = offsets, bias = None, out_dtype = None)
out_1 = torch._grouped_mm(to_1, transpose_1, offs = offsets, bias = None, out_dtype = None)""")
    assert_expected_inline(after, """\
experts_ref_default = torch.ops.qcompile.experts_ref.default(hidden_states_reshaped, router_indices, router_top_value, _qcompile_online_experts0_w13_weight, _qcompile_online_experts0_w13_weight_scale, None, None, None, None, None, _qcompile_online_experts0_w2_weight, _qcompile_online_experts0_w2_weight_scale, None, None, None, None, None, None, None, 'silu', 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor')
hidden_states = experts_ref_default.reshape(1, 8, 128)""")
    assert [r.op for r in be.rows if r.module == "model.layers.0.mlp.experts"] == ["qcompile::experts_ref"]
    assert torch.equal(out, _load_time(checkpoint))


def test_batched_mm_region(checkpoint):
    """What generate switches to for decoding on a GPU."""
    before, after, out, _ = _compile(checkpoint, "batched_mm")
    assert_expected_inline(before, """\
bmm = torch.bmm(selected_weights, unsqueeze)
bmm_1 = torch.bmm(selected_weights_1, unsqueeze_1)""")
    assert_expected_inline(after, """\
experts_ref_default = torch.ops.qcompile.experts_ref.default(hidden_states_reshaped, router_indices, router_top_value, _qcompile_online_experts0_w13_weight, _qcompile_online_experts0_w13_weight_scale, None, None, None, None, None, _qcompile_online_experts0_w2_weight, _qcompile_online_experts0_w2_weight_scale, None, None, None, None, None, None, None, 'silu', 'w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor')
hidden_states = experts_ref_default.reshape(1, 8, 128)""")
    assert torch.equal(out, _load_time(checkpoint))


def test_fp32_fallback_region_per_block(checkpoint):
    """fp32 weights compile through transformers' grouped_mm_fallback op; 128 x 128 block scales."""
    before, after, out, _ = _compile(checkpoint, "grouped_mm", torch.float32, "fp8_per_block")
    assert "grouped_mm_fallback" in before and "experts_ref" in after and "grouped_mm" not in after
    assert "'w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128'" in after


def test_eager_experts_implementation_is_reported(checkpoint):
    with pytest.warns(UserWarning, match=r'eager experts implementation.*set_experts_implementation\("grouped_mm"\)'):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        model.set_experts_implementation("eager")
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=qcompile.backend(online="fp8_per_tensor", inner="eager"))(IDS)


def test_ignored_experts_stay_bf16(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    torch._dynamo.reset()
    be = qcompile.backend(online="fp8_per_tensor", inner="eager", ignore=["re:.*experts"])
    with torch.no_grad():
        torch.compile(model, backend=be)(IDS)
    row = next(r for r in be.rows if r.module == "model.layers.0.mlp.experts")
    assert (row.kernel, row.reason) == ("bf16", "excluded by the online config")
