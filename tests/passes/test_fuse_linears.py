"""The Fuse pass: q/k/v and gate/up run as one quantized matmul each. Graph before/after (expecttest) on the
producers' checkpoints, numerics against the eager model, and the cases that must stay separate."""

from __future__ import annotations

import copy

import pytest
import torch
from expecttest import assert_expected_inline
from torch.multiprocessing.reductions import StorageWeakRef

import qcompile
from qcompile.kernels import quant_math
from qcompile.linear import QuantLinear, dequantize_model
from qcompile.passes.fuse_linears import fused_name, shard_names
from qcompile.scheme import Granularity

from .test_linear_pass import IDS, compile_and_diff


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fused_diff(testdata, name, **options):
    """(eager logits, compiled logits, graph diff of layer 0, backend) of a producer checkpoint."""
    model = qcompile.load(str(testdata / name))
    with torch.no_grad():
        want = model(IDS).logits
    out, diff, be = compile_and_diff(model, fuse=True, **options)
    # 4 quantized matmuls per decoder layer: qkv, o, gate_up, down
    assert [r.module.split(".", 3)[-1] for r in be.rows] == \
        ["self_attn.{q,k,v}_proj", "self_attn.o_proj", "mlp.{gate,up}_proj", "mlp.down_proj"] * 2, be.explain()
    return model, want, out, _layer0(diff), be


def _layer0(diff: str) -> str:
    """The diff's lines of decoder layer 0: its removed calls, and the added lines before layer 1's
    first fused constant."""
    lines = diff.splitlines()
    end = next(i for i, line in enumerate(lines) if "_qcompile_fused2_" in line)
    return "\n".join([line for line in lines if line.startswith("-") and "layers.0." in line] +
                     [line for line in lines[:end] if line.startswith("+")])


def test_modelopt_fp8_per_tensor_requantizes_to_the_largest_scale(testdata):
    """ModelOpt writes one weight scale per shard (q, k, v differ): the fused weight is every shard
    requantized to the largest, as the reference does; the compiled model equals the eager model with
    its shards requantized so, which is what the eager model now holds (the shards view the fused codes)."""
    expected = qcompile.load(str(testdata / "modelopt-fp8-dense"))
    for layer in expected.model.layers:  # the producer's scales differ
        assert len({float(m.weight_scale) for m in (layer.mlp.gate_proj, layer.mlp.up_proj)}) > 1
    requantized_like_fused(expected)
    model, want, out, diff, be = fused_diff(testdata, "modelopt-fp8-dense")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, model.layers.0.self_attn.q_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, model.layers.0.self_attn.k_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, model.layers.0.self_attn.v_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, model.layers.0.self_attn.o_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, model.layers.0.mlp.gate_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, model.layers.0.mlp.up_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, model.layers.0.mlp.down_proj.input_scale, None, None, 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor')
+_qcompile_fused0_weight = self._qcompile_fused0_weight
+_qcompile_fused0_weight_scale = self._qcompile_fused0_weight_scale
+_qcompile_fused0_input_scale = self._qcompile_fused0_input_scale
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = _qcompile_fused0_weight, weight_scale = _qcompile_fused0_weight_scale, input_scale = _qcompile_fused0_input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+split_with_sizes_default = torch.ops.aten.split_with_sizes.default(fp8_linear_default, [256, 128, 128], -1)
+getitem = split_with_sizes_default[0]
+getitem_1 = split_with_sizes_default[1]
+getitem_2 = split_with_sizes_default[2]
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = model.layers.0.self_attn.o_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+_qcompile_fused1_weight = self._qcompile_fused1_weight
+_qcompile_fused1_weight_scale = self._qcompile_fused1_weight_scale
+_qcompile_fused1_input_scale = self._qcompile_fused1_input_scale
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = _qcompile_fused1_weight, weight_scale = _qcompile_fused1_weight_scale, input_scale = _qcompile_fused1_input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')
+split_with_sizes_default_1 = torch.ops.aten.split_with_sizes.default(fp8_linear_default_2, [512, 512], -1)
+getitem_3 = split_with_sizes_default_1[0]
+getitem_4 = split_with_sizes_default_1[1]
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = model.layers.0.mlp.down_proj.input_scale, bias = None, scheme = 'w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor', backend = 'emulated')""")
    with torch.no_grad():
        assert rel(out, expected(IDS).logits) < 1e-3
        assert torch.equal(model(IDS).logits, expected(IDS).logits)
    # the requantization itself, on this random model (on the trained one: 1 %, perplexity unchanged,
    # tests/test_trained_model.py)
    assert rel(out, want) < 0.15


def requantized_like_fused(model):
    """In place: each decoder layer's q/k/v and gate/up QuantLinears whose per-tensor FP8 scales differ
    requantized to their largest, as the Fuse pass does (the oracle of a fused compiled model). Returns it."""
    for layer in model.model.layers:
        for shards in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                       (layer.mlp.gate_proj, layer.mlp.up_proj)):
            if not all(isinstance(m, QuantLinear) for m in shards) or len({m.scheme_key for m in shards}) > 1 \
                    or getattr(shards[0], "weight_scale", torch.empty(1)).dim() != 0 \
                    or shards[0].weight.dtype != torch.float8_e4m3fn:
                continue
            codes, scale = quant_math.requantize_to_max_scale([m.weight.data for m in shards],
                                                              [m.weight_scale.data for m in shards])
            for m, part in zip(shards, codes.split([m.out_features for m in shards])):
                m.weight.data, m.weight_scale.data = part, scale
    return model


def test_compressed_tensors_fp8_channel(testdata):
    _, want, out, diff, _ = fused_diff(testdata, "llmcompressor-fp8-dynamic-dense")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, None, None, None, 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token')
+_qcompile_fused0_weight = self._qcompile_fused0_weight
+_qcompile_fused0_weight_scale = self._qcompile_fused0_weight_scale
+fp8_linear_default = torch.ops.qcompile.fp8_linear.default(x = hidden_states, weight = _qcompile_fused0_weight, weight_scale = _qcompile_fused0_weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+split_with_sizes_default = torch.ops.aten.split_with_sizes.default(fp8_linear_default, [256, 128, 128], -1)
+getitem = split_with_sizes_default[0]
+getitem_1 = split_with_sizes_default[1]
+getitem_2 = split_with_sizes_default[2]
+fp8_linear_default_1 = torch.ops.qcompile.fp8_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+_qcompile_fused1_weight = self._qcompile_fused1_weight
+_qcompile_fused1_weight_scale = self._qcompile_fused1_weight_scale
+fp8_linear_default_2 = torch.ops.qcompile.fp8_linear.default(x = hidden_states_1, weight = _qcompile_fused1_weight, weight_scale = _qcompile_fused1_weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')
+split_with_sizes_default_1 = torch.ops.aten.split_with_sizes.default(fp8_linear_default_2, [512, 512], -1)
+getitem_3 = split_with_sizes_default_1[0]
+getitem_4 = split_with_sizes_default_1[1]
+fp8_linear_default_3 = torch.ops.qcompile.fp8_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, input_scale = None, bias = None, scheme = 'w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token', backend = 'emulated')""")
    assert rel(out, want) < 1e-3  # the per-channel scales concatenate: nothing requantized


def test_compressed_tensors_w4a16_group(testdata):
    model, _, out, diff, be = fused_diff(testdata, "llmcompressor-w4a16-gptq-dense")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-attn_output = torch.ops.qcompile.linear_ref(attn_output_1, model.layers.0.self_attn.o_proj.weight, model.layers.0.self_attn.o_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
-down_proj = torch.ops.qcompile.linear_ref(mul, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.down_proj.weight_scale, None, None, None, None, None, None, 'w=int4/group128/pack=int32;a=none')
+_qcompile_fused0_weight = self._qcompile_fused0_weight
+_qcompile_fused0_weight_scale = self._qcompile_fused0_weight_scale
+wo_linear_default = torch.ops.qcompile.wo_linear.default(x = hidden_states, weight = _qcompile_fused0_weight, weight_scale = _qcompile_fused0_weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+split_with_sizes_default = torch.ops.aten.split_with_sizes.default(wo_linear_default, [256, 128, 128], -1)
+getitem = split_with_sizes_default[0]
+getitem_1 = split_with_sizes_default[1]
+getitem_2 = split_with_sizes_default[2]
+wo_linear_default_1 = torch.ops.qcompile.wo_linear.default(x = attn_output_1, weight = model.layers.0.self_attn.o_proj.weight, weight_scale = model.layers.0.self_attn.o_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+_qcompile_fused1_weight = self._qcompile_fused1_weight
+_qcompile_fused1_weight_scale = self._qcompile_fused1_weight_scale
+wo_linear_default_2 = torch.ops.qcompile.wo_linear.default(x = hidden_states_1, weight = _qcompile_fused1_weight, weight_scale = _qcompile_fused1_weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')
+split_with_sizes_default_1 = torch.ops.aten.split_with_sizes.default(wo_linear_default_2, [512, 512], -1)
+getitem_3 = split_with_sizes_default_1[0]
+getitem_4 = split_with_sizes_default_1[1]
+wo_linear_default_3 = torch.ops.qcompile.wo_linear.default(x = mul, weight = model.layers.0.mlp.down_proj.weight, weight_scale = model.layers.0.mlp.down_proj.weight_scale, weight_global_scale = None, weight_zero_point = None, weight_g_idx = None, bias = None, scheme = 'w=int4/group128/pack=int32;a=none', backend = 'dequant')""")
    assert {r.kernel for r in be.rows} == {"wo_dequant"}  # the weight-only op takes the fused N
    with torch.no_grad():
        assert rel(out, dequantize_model(copy.deepcopy(model))(IDS).logits) < 1e-2


def test_nvfp4_shares_its_global_scales(testdata):
    """Both NVFP4 producers give the fused shards one global weight and input scale: fused exactly."""
    _, want, out, diff, be = fused_diff(testdata, "modelopt-nvfp4-dense")
    assert_expected_inline(diff, """\
-linear_ref = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.q_proj.weight, model.layers.0.self_attn.q_proj.weight_scale, model.layers.0.self_attn.q_proj.weight_global_scale, None, None, None, model.layers.0.self_attn.q_proj.input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
-linear_ref_1 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.k_proj.weight_scale, model.layers.0.self_attn.k_proj.weight_global_scale, None, None, None, model.layers.0.self_attn.k_proj.input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
-linear_ref_2 = torch.ops.qcompile.linear_ref(hidden_states, model.layers.0.self_attn.v_proj.weight, model.layers.0.self_attn.v_proj.weight_scale, model.layers.0.self_attn.v_proj.weight_global_scale, None, None, None, model.layers.0.self_attn.v_proj.input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
-linear_ref_3 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.gate_proj.weight_scale, model.layers.0.mlp.gate_proj.weight_global_scale, None, None, None, model.layers.0.mlp.gate_proj.input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
-linear_ref_4 = torch.ops.qcompile.linear_ref(hidden_states_1, model.layers.0.mlp.up_proj.weight, model.layers.0.mlp.up_proj.weight_scale, model.layers.0.mlp.up_proj.weight_global_scale, None, None, None, model.layers.0.mlp.up_proj.input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
+_qcompile_fused0_weight = self._qcompile_fused0_weight
+_qcompile_fused0_weight_scale = self._qcompile_fused0_weight_scale
+_qcompile_fused0_weight_global_scale = self._qcompile_fused0_weight_global_scale
+_qcompile_fused0_input_global_scale = self._qcompile_fused0_input_global_scale
+linear_ref_default = torch.ops.qcompile.linear_ref.default(hidden_states, _qcompile_fused0_weight, _qcompile_fused0_weight_scale, _qcompile_fused0_weight_global_scale, None, None, None, _qcompile_fused0_input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
+split_with_sizes_default = torch.ops.aten.split_with_sizes.default(linear_ref_default, [256, 128, 128], -1)
+getitem = split_with_sizes_default[0]
+getitem_1 = split_with_sizes_default[1]
+getitem_2 = split_with_sizes_default[2]
+_qcompile_fused1_weight = self._qcompile_fused1_weight
+_qcompile_fused1_weight_scale = self._qcompile_fused1_weight_scale
+_qcompile_fused1_weight_global_scale = self._qcompile_fused1_weight_global_scale
+_qcompile_fused1_input_global_scale = self._qcompile_fused1_input_global_scale
+linear_ref_default_1 = torch.ops.qcompile.linear_ref.default(hidden_states_1, _qcompile_fused1_weight, _qcompile_fused1_weight_scale, _qcompile_fused1_weight_global_scale, None, None, None, _qcompile_fused1_input_global_scale, None, 'w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global')
+split_with_sizes_default_1 = torch.ops.aten.split_with_sizes.default(linear_ref_default_1, [512, 512], -1)
+getitem_3 = split_with_sizes_default_1[0]
+getitem_4 = split_with_sizes_default_1[1]""")
    assert {r.kernel for r in be.rows} == {"reference"}  # off CUDA: the faithful reference
    assert rel(out, want) < 1e-3


def test_online_fp8_at_compile_time_fuses_before_quantizing(testdata):
    """bf16 shards are concatenated, then quantized once: per block that is what quantizing each at load
    gives (the shards' rows are whole blocks)."""
    from transformers import AutoModelForCausalLM

    path = str(testdata / "base-bf16-dense")
    with torch.no_grad():
        want = qcompile.load(path, online="fp8_per_block")(IDS).logits
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    out, _, be = compile_and_diff(model, online="fp8_per_block", fuse=True)
    fused = [r.module for r in be.rows if "{" in r.module]
    assert fused == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.{q,k,v}_proj", "mlp.{gate,up}_proj")]
    assert rel(out, want) < 1e-3


def test_pass_off(testdata):
    _, _, be = compile_and_diff(qcompile.load(str(testdata / "llmcompressor-fp8-dynamic-dense")), fuse=False)
    assert len(be.rows) == 14 and not any("{" in r.module for r in be.rows)


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors``: views of one storage count once."""
    return sum({(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", ["modelopt-fp8-dense", "llmcompressor-fp8-dynamic-dense",
                                  "llmcompressor-w4a16-gptq-dense"])
def test_compiled_model_holds_its_weights_once(testdata, name):
    """The shards' tensors become views of the fused constants: the quantized linears and the graphs
    compiled for them (a recompile for another length too) hold the weights' bytes once, the fused shards'
    own storage is freed, and the eager model computes what it did (ModelOpt: with the fused shards'
    codes requantized, as compiled)."""
    model = qcompile.load(str(testdata / name))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    tensors = lambda: [t for m in linears for t in (*m.parameters(), *m.buffers())]  # noqa: E731
    before = storage_bytes(tensors())
    own = [StorageWeakRef(m.weight.untyped_storage()) for m in linears]
    with torch.no_grad():
        want = requantized_like_fused(qcompile.load(str(testdata / name)))(IDS).logits
    graphs = []
    be = qcompile.backend(inner="eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, example_inputs: graphs.append(gm) or be(gm, example_inputs))
    with torch.no_grad():
        for length in (8, 5, 6, 8):
            compiled(IDS[:, :length])
        assert torch.equal(model(IDS).logits, want)
    assert len(graphs) == 2  # the second with a dynamic length
    after = storage_bytes(tensors() + [t for gm in graphs for t in (*gm.parameters(), *gm.buffers())])
    assert after <= 1.02 * before, f"{after} bytes after compiling, {before} before"
    fused = [not m.name.endswith(("o_proj", "down_proj")) for m in linears]
    assert [ref.expired() for ref in own] == fused


def test_a_shard_read_elsewhere_keeps_its_own_tensors():
    """A shard whose weight another call reads too (its layout must stay as traced): the group fuses on a
    copy, the shards keep their tensors, not requantized."""
    torch.manual_seed(0)

    class Reused(Shards):
        def forward(self, x):
            return torch.cat([super().forward(x), self.shards[0](x * 2)], -1)

    module = Reused([fp8_shard(32), fp8_shard(16)])
    weights = [m.weight.clone() for m in module.shards]
    out, want, calls, _ = run(module)
    assert calls == 2 and torch.equal(out[:, 48:], want[:, 48:]) and rel(out, want) < 0.05
    assert all(torch.equal(m.weight.view(torch.uint8), w.view(torch.uint8)) for m, w in zip(module.shards, weights))
    assert len({m.weight.untyped_storage().data_ptr() for m in module.shards}) == 2


def test_shards_with_biases_share_the_fused_storage():
    torch.manual_seed(0)
    module = Shards([fp8_shard(32, granularity=Granularity.CHANNEL, bias=True) for _ in range(3)])
    out, want, calls, _ = run(module)
    assert calls == 1 and torch.equal(out, want)
    for role in ("weight", "weight_scale", "bias"):
        assert len({getattr(m, role).untyped_storage().data_ptr() for m in module.shards}) == 1, role


# -- the cases that stay separate, on small modules calling the reference op ----------------------

FP8_TENSOR = "w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor"


class Shard(torch.nn.Module):
    def __init__(self, scheme, tensors, bias):
        super().__init__()
        self.scheme = scheme
        for role in ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx",
                     "input_scale", "input_global_scale"):
            self.register_buffer(role, tensors.get(role))
        self.register_buffer("bias", bias)

    def forward(self, x):
        return torch.ops.qcompile.linear_ref(x, self.weight, self.weight_scale, self.weight_global_scale,
                                             self.weight_zero_point, self.weight_g_idx, self.input_scale,
                                             self.input_global_scale, self.bias, self.scheme)


class Shards(torch.nn.Module):
    """Linears ``shards.<i>`` on one input (``same_x``), or the second on ``2 x``; each ``(scheme, tensors, bias)``."""

    def __init__(self, shards, same_x=True):
        super().__init__()
        self.shards, self.same_x = torch.nn.ModuleList(Shard(*s) for s in shards), same_x

    def forward(self, x):
        return torch.cat([m(x if self.same_x or i == 0 else x * 2) for i, m in enumerate(self.shards)], -1)


def fp8_shard(n, k=64, granularity=Granularity.TENSOR, bias=False):
    q, s = quant_math.quantize_weight_fp8(torch.randn(n, k), granularity)
    return FP8_TENSOR if granularity is Granularity.TENSOR else FP8_TENSOR.replace("/tensor;", "/channel;"), \
        {"weight": q, "weight_scale": s}, torch.randn(n, dtype=torch.bfloat16) if bias else None


def int4_shard(n, k=64, g_idx=None):
    """int4 group-32 act-order."""
    return "w=int4/group32/pack=int32/actorder;a=none", \
        {"weight": torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32),
         "weight_scale": torch.rand(n, k // 32) + 0.1, "weight_g_idx": g_idx}, None


def nvfp4_shard(n, global_scale, k=64):
    return "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none", \
        {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
         "weight_scale": (torch.rand(n, k // 16) + 0.5).to(torch.float8_e4m3fn),
         "weight_global_scale": torch.tensor(global_scale)}, None


def run(module, **options):
    """(compiled output, eager output, number of linear calls left in the compiled graph, backend)."""
    torch._dynamo.reset()
    graphs = []
    be = qcompile.backend(inner="eager", kernels="reference", on_graph=lambda b, a: graphs.append(a), **options)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out, want = torch.compile(module, backend=be)(x), module(x)
    return out, want, graphs[0].count("qcompile.linear_ref"), be


def test_shards_with_and_without_bias_fuse_with_zeros():
    torch.manual_seed(0)
    out, want, calls, be = run(Shards([fp8_shard(32, bias=True), fp8_shard(16), fp8_shard(48, bias=True)]))
    assert calls == 1 and [r.module for r in be.rows] == ["shards.{0,1,2}"]
    assert rel(out, want) < 0.05  # per-tensor scales requantized to the largest


def test_channel_scales_concatenate_exactly():
    torch.manual_seed(0)
    out, want, calls, _ = run(Shards([fp8_shard(32, granularity=Granularity.CHANNEL) for _ in range(2)]))
    assert calls == 1 and torch.equal(out, want)


@pytest.mark.parametrize("case", ["different x", "mixed schemes", "global scales differ", "g_idx differ",
                                  "override on one", "pass off"])
def test_stays_separate(case):
    torch.manual_seed(0)
    options, same_x = {}, case != "different x"
    perm = torch.arange(64) // 32
    shards = [fp8_shard(32), fp8_shard(32)]
    if case == "mixed schemes":
        shards[1] = fp8_shard(32, granularity=Granularity.CHANNEL)
    elif case == "global scales differ":
        shards = [nvfp4_shard(32, 0.5), nvfp4_shard(32, 0.25)]
    elif case == "g_idx differ":
        shards = [int4_shard(32, g_idx=perm.int()), int4_shard(32, g_idx=perm.flip(0).int())]
    elif case == "override on one":
        options["kernels"] = {"shards.0": "reference"}
    elif case == "pass off":
        options["fuse"] = False
    module = Shards(shards, same_x=same_x)
    if options.get("kernels"):  # run() forces the reference everywhere; here one shard is named
        torch._dynamo.reset()
        graphs = []
        be = qcompile.backend(inner="eager", on_graph=lambda b, a: graphs.append(a), **options)
        with torch.no_grad():
            torch.compile(module, backend=be)(torch.randn(3, 64, dtype=torch.bfloat16))
        assert len(be.rows) == 2
        return
    out, want, calls, _ = run(module, **options)
    assert calls == 2 and torch.equal(out, want)


def test_compiled_graph_takes_the_inputs_left_or_all():
    """The inner compiler gets the graph less the shards' inputs, which Dynamo leaves out when it calls it;
    a caller that passes every input it gave the backend has those left out for it."""
    torch.manual_seed(0)
    module, compiled = Shards([fp8_shard(32, granularity=Granularity.CHANNEL) for _ in range(2)]), []
    be = qcompile.backend(inner="eager", kernels="reference")

    def backend(gm, example_inputs):
        given = list(example_inputs)
        compiled.append((be(gm, example_inputs), given, len(gm.graph.find_nodes(op="placeholder"))))
        return compiled[-1][0]

    torch._dynamo.reset()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(module, backend=backend)(x)
        fn, given, left = compiled[0]
        assert left == len(given) - 4  # the shards' weights and scales
        assert torch.equal(fn(*given)[0], out) and torch.equal(out, module(x))


def test_equal_g_idx_and_global_scales_fuse():
    torch.manual_seed(0)
    perm = (torch.arange(64) // 32).flip(0).int()
    for shards in ([int4_shard(32, g_idx=perm), int4_shard(16, g_idx=perm)], [nvfp4_shard(32, 0.5), nvfp4_shard(16, 0.5)]):
        out, want, calls, _ = run(Shards(shards))
        assert calls == 1 and rel(out, want) < 1e-6


def test_tiled_shards_concatenate_as_tiled():
    """wo_mma's tiling permutes within 16-row tiles: tiling the concatenation is concatenating the tiled."""
    torch.manual_seed(0)
    for scheme in ("w=int4/group128/pack=int32;a=none", "w=int4/group32/pack=int32;a=none"):
        from qcompile.scheme import parse_scheme_key

        spec = parse_scheme_key(scheme).weight
        a, b = (torch.randint(-2**31, 2**31 - 1, (n, 64), dtype=torch.int32) for n in (48, 16))
        assert torch.equal(quant_math.tile_weight(torch.cat([a, b]), spec),
                           torch.cat([quant_math.tile_weight(a, spec), quant_math.tile_weight(b, spec)]))


def test_fused_name_round_trips():
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert fused_name(names) == "model.layers.0.self_attn.{q,k,v}_proj"
    assert shard_names(fused_name(names)) == names
    assert fused_name(["mlp.gate_proj", "mlp.up_proj"]) == "mlp.{gate,up}_proj"
    assert shard_names("model.layers.0.mlp.down_proj") == ["model.layers.0.mlp.down_proj"]
