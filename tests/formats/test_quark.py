"""qcompile.formats.quark against vLLM's Quark schemes (reference 003) and amd-quark's files."""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import ConfigError, UnsupportedError
from qcompile.formats import parse_quant_config
from qcompile.formats.quark import QuarkConfig, parse
from qcompile.scheme import (MXFP4_WEIGHT, MXFP8_WEIGHT, ActSpec, Granularity, KVCacheSpec, Packing, QDtype,
                             QuantScheme, ScaleDtype, ScaleSpec, WeightSpec, canonical_shape, fp8_scheme, mx_act,
                             shape_matches)
from tests.conftest import TESTDATA
from tests.formats import fuzz

L0 = "model.layers.0"
LINEARS = [f"{L0}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
          [f"{L0}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
G = Granularity


def spec(dtype, qscheme="per_tensor", is_dynamic=False, **kw):
    """A QTensorConfig dict as amd-quark writes it (informational keys included)."""
    base = {"dtype": dtype, "qscheme": qscheme, "is_dynamic": is_dynamic, "ch_axis": None, "group_size": None,
            "symmetric": True, "scale_format": None, "scale_type": "float", "round_method": "half_even",
            "observer_cls": "PerTensorMinMaxObserver", "mx_element_dtype": None, "is_scale_quant": False}
    return {**base, **kw}


def mx(dtype, is_dynamic=False):
    return spec(dtype, "per_group", is_dynamic, group_size=32, ch_axis=-1, symmetric=None, scale_format="e8m0",
                observer_cls="PerBlockMXObserver")


def quark(weight, inputs=None, exclude=("lm_head",), **top):
    return {"quant_method": "quark", "exclude": list(exclude), "algo_config": None, "quant_mode": "eager_mode",
            "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                       "weight_format": "real_quantized", "weight_merge_groups": None},
            "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None,
                                    "target_device": None},
            "layer_quant_config": {}, "layer_type_quant_config": {}, "kv_cache_quant_config": {},
            "softmax_quant_spec": None, "version": "0.13", **top}


def names(lq):
    return [t.name for t in lq.tensors]


def real(ckpt="quark-w-mxfp4-dense"):
    d = TESTDATA / ckpt
    if not d.is_dir():
        pytest.skip(f"producer testdata not found at {TESTDATA}")
    with open(d / "config.json") as f:
        return json.load(f)["quantization_config"]


# -- the producer's file -------------------------------------------------------------------------

def test_real_mxfp4_config():
    cfg = parse_quant_config(real())
    assert isinstance(cfg, QuarkConfig) and cfg.format == "quark" and cfg.kv_cache is None
    for name in LINEARS:
        lq = cfg.resolve(name)
        assert lq.scheme == QuantScheme(MXFP4_WEIGHT) and names(lq) == ["weight", "weight_scale"]
        assert lq.source == "quark global_quant_config" and not any(t.reciprocal for t in lq.tensors)
    assert cfg.resolve("lm_head") is None
    assert cfg.resolve(f"{L0}.self_attn.qkv_proj").scheme == QuantScheme(MXFP4_WEIGHT)
    assert cfg.resolve(f"{L0}.mlp.experts", "moe").scheme == QuantScheme(MXFP4_WEIGHT)


def test_real_tensors_on_disk():
    from safetensors import safe_open

    cfg = parse(real())
    with safe_open(str(TESTDATA / "quark-w-mxfp4-dense" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in LINEARS:
            lq = cfg.resolve(name)
            n, packed = f.get_slice(f"{name}.weight").get_shape()
            assert f.get_slice(f"{name}.weight").get_dtype() == "U8"
            assert f.get_slice(f"{name}.weight_scale").get_dtype() == "U8"  # e8m0 biased exponents
            for t in lq.tensors:
                shape = f.get_slice(f"{name}.{t.name}").get_shape()
                assert shape_matches(shape, canonical_shape(t.role, lq.scheme, n, packed * 2))
            assert {k[len(name) + 1:] for k in keys if k.startswith(name + ".")} == set(names(lq))


# -- every Quark scheme of reference 003 (+ FP8 W8A8) ----------------------------------------------

def mx_w(dtype, packing):
    return WeightSpec(dtype, ScaleSpec(G.GROUP, ScaleDtype.E8M0, group_size=32), packing)


MXFP6_E3M2_W = mx_w(QDtype.FP6_E3M2, Packing.UINT8_FP6)
MXFP6_E2M3_W = mx_w(QDtype.FP6_E2M3, Packing.UINT8_FP6)
INT8_CHANNEL = WeightSpec(QDtype.INT8, ScaleSpec(G.CHANNEL))
W4A8_WEIGHT = [spec("fp8_e4m3", scale_type="float32"),  # amd-quark 0.13's int4_fp8
               spec("int4", "per_channel", ch_axis=0, scale_type="float32", observer_cls="PerChannelMinMaxObserver")]
W4A8 = WeightSpec(QDtype.INT4, ScaleSpec(G.CHANNEL), Packing.INT32, global_scale=True)
SCHEMES = {
    "w_mxfp4": (quark(mx("fp4")), QuantScheme(MXFP4_WEIGHT), ["weight", "weight_scale"]),
    "w_mxfp4_a_mxfp4": (quark(mx("fp4"), mx("fp4", True)), QuantScheme(MXFP4_WEIGHT, mx_act(QDtype.FP4_E2M1)),
                        ["weight", "weight_scale"]),
    "w_mxfp4_a_mxfp6_e3m2": (quark(mx("fp4"), mx("fp6_e3m2", True)),
                             QuantScheme(MXFP4_WEIGHT, mx_act(QDtype.FP6_E3M2)), ["weight", "weight_scale"]),
    "w_mxfp4_a_mxfp6_e2m3": (quark(mx("fp4"), mx("fp6_e2m3", True)),
                             QuantScheme(MXFP4_WEIGHT, mx_act(QDtype.FP6_E2M3)), ["weight", "weight_scale"]),
    "w_mxfp6_e3m2_a_mxfp6_e3m2": (quark(mx("fp6_e3m2"), mx("fp6_e3m2", True)),
                                  QuantScheme(MXFP6_E3M2_W, mx_act(QDtype.FP6_E3M2)), ["weight", "weight_scale"]),
    "w_mxfp6_e2m3_a_mxfp6_e2m3": (quark(mx("fp6_e2m3"), mx("fp6_e2m3", True)),
                                  QuantScheme(MXFP6_E2M3_W, mx_act(QDtype.FP6_E2M3)), ["weight", "weight_scale"]),
    "w_mxfp4_a_fp8": (quark(mx("fp4"), spec("fp8_e4m3")),
                      QuantScheme(MXFP4_WEIGHT, ActSpec(QDtype.FP8_E4M3, False, ScaleSpec(G.TENSOR))),
                      ["weight", "weight_scale", "input_scale"]),
    "w_mxfp6_e3m2_a_fp8": (quark(mx("fp6_e3m2"), spec("fp8_e4m3")),
                           QuantScheme(MXFP6_E3M2_W, ActSpec(QDtype.FP8_E4M3, False, ScaleSpec(G.TENSOR))),
                           ["weight", "weight_scale", "input_scale"]),
    "w_mxfp8_a_mxfp8": (quark(mx("fp8_e4m3"), mx("fp8_e4m3", True)), QuantScheme(MXFP8_WEIGHT, mx_act(QDtype.FP8_E4M3)),
                        ["weight", "weight_scale"]),
    "w8a8_int8_token": (quark(spec("int8", "per_channel", ch_axis=0), spec("int8", "per_channel", True, ch_axis=1)),
                        QuantScheme(INT8_CHANNEL, ActSpec(QDtype.INT8, True, ScaleSpec(G.TOKEN))),
                        ["weight", "weight_scale", "weight_zero_point"]),
    "w8a8_int8_static_tensor": (quark(spec("int8", "per_channel", ch_axis=0), spec("int8")),
                                QuantScheme(INT8_CHANNEL, ActSpec(QDtype.INT8, False, ScaleSpec(G.TENSOR))),
                                ["weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point"]),
    "w8a8_int8_per_tensor_weight": (quark(spec("int8"), spec("int8", is_dynamic=True)),
                                    QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(G.TENSOR)),
                                                ActSpec(QDtype.INT8, True, ScaleSpec(G.TENSOR))),
                                    ["weight", "weight_scale", "weight_zero_point"]),
    "int8_asym_weight": (quark(spec("int8", "per_channel", symmetric=False), None),
                         QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(G.CHANNEL), zero_point=True)),
                         ["weight", "weight_scale", "weight_zero_point"]),
    "fp8_w8a8_static": (quark(spec("fp8_e4m3"), spec("fp8_e4m3")), fp8_scheme("tensor", "static_tensor"),
                        ["weight", "weight_scale", "input_scale"]),
    "fp8_w8a8_dynamic": (quark(spec("fp8_e4m3"), spec("fp8_e4m3", is_dynamic=True)),
                         fp8_scheme("tensor", "dynamic_tensor"), ["weight", "weight_scale"]),
    "fp8_channel_token": (quark(spec("fp8_e4m3", "per_channel", ch_axis=0), spec("fp8_e4m3", "per_channel", True)),
                          fp8_scheme("channel", "dynamic_token"), ["weight", "weight_scale"]),
    "fp8_weight_only": (quark(spec("fp8_e4m3")), fp8_scheme("tensor", None), ["weight", "weight_scale"]),
    "fp8_is_dynamic_null_is_static": (quark(spec("fp8_e4m3"), spec("fp8_e4m3", is_dynamic=None)),
                                      fp8_scheme("tensor", "static_tensor"), ["weight", "weight_scale", "input_scale"]),
    "w4a8_int4_fp8": (quark(W4A8_WEIGHT, spec("fp8_e4m3", is_dynamic=True, scale_type="float32")),
                      QuantScheme(W4A8, ActSpec(QDtype.FP8_E4M3, True, ScaleSpec(G.TENSOR))),
                      ["weight", "weight_scale_2", "weight_scale", "weight_zero_point_2"]),
    "w4a8_int4_fp8_static": (quark(W4A8_WEIGHT, spec("fp8_e4m3")),
                             QuantScheme(W4A8, ActSpec(QDtype.FP8_E4M3, False, ScaleSpec(G.TENSOR))),
                             ["weight", "weight_scale_2", "weight_scale", "weight_zero_point_2", "input_scale"]),
}
# What vLLM's Quark MoE methods refuse for experts (QuarkMoEMethod.get_moe_method and the methods' checks)
MOE_REFUSED = {"fp8_weight_only": "weight-only", "int8_asym_weight": "weight-only",
               "w8a8_int8_per_tensor_weight": "INT8 experts run", "w_mxfp6_e3m2_a_fp8": "OCP-MX fp6_e3m2",
               "w_mxfp8_a_mxfp8": "MXFP8"}


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_schemes(case):
    config, scheme, tensor_names = SCHEMES[case]
    lq = parse(config).resolve(f"{L0}.mlp.down_proj")
    assert lq.scheme == scheme and names(lq) == tensor_names
    # a symmetric int8 scale's zero point, which Quark stores all-zero: checked, not read
    unused = [t for t in lq.tensors if t.role.startswith("unused_")]
    assert all(t.optional and t.name.startswith(t.role[len("unused_"):]) for t in unused)
    assert len(unused) == (not scheme.weight.zero_point and scheme.weight.dtype in (QDtype.INT8, QDtype.INT4)) + \
        (scheme.act is not None and scheme.act.dtype is QDtype.INT8 and not scheme.act.dynamic)
    assert [t.int4_order for t in lq.tensors if t.int4_order] == ([(0, 2, 4, 6, 1, 3, 5, 7)] if "w4a8" in case else [])


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_moe_experts_take_the_reference_moe_schemes_only(case):
    cfg = parse(SCHEMES[case][0])
    if case not in MOE_REFUSED:
        assert cfg.resolve(f"{L0}.mlp.experts", "moe").scheme == SCHEMES[case][1]
        return
    with pytest.raises(UnsupportedError, match=rf"^{L0}\.mlp\.experts: Quark MoE .*{MOE_REFUSED[case]}") as info:
        cfg.resolve(f"{L0}.mlp.experts", "moe")
    assert "exclude them" in info.value.fix
    assert cfg.resolve(f"{L0}.mlp.down_proj").scheme == SCHEMES[case][1]  # a Linear takes it


def test_int4_words_in_order_without_reorder():
    config = quark(W4A8_WEIGHT, spec("fp8_e4m3", is_dynamic=True))
    config["export"]["pack_method"] = "order"
    assert parse(config).resolve(f"{L0}.mlp.down_proj").tensor("weight").int4_order == tuple(range(8))


def test_quark_int4_words_convert_exactly():
    """Quark's int32 words (two's-complement codes, nibble i holding code order[i] of 8) -> the canonical
    word (code j at nibble j, offset 8) and back, bit for bit."""
    import torch

    from qcompile.kernels.quant_math import permute_int4_words, unpack_int32

    order = (0, 2, 4, 6, 1, 3, 5, 7)
    codes = torch.randint(-8, 8, (6, 32), generator=torch.Generator().manual_seed(0))
    words = torch.zeros(6, 4, dtype=torch.int32)
    for i, element in enumerate(order):  # Quark's Pack_4_bits
        words |= (codes[:, element::8] & 0xF).to(torch.int32) << (4 * i)
    canonical = permute_int4_words(words, tuple(order.index(j) for j in range(8)))
    assert torch.equal(unpack_int32(canonical, 4, 32), codes)
    assert torch.equal(permute_int4_words(canonical, order), words)


def test_unknown_informational_keys_are_allowed():
    config = quark({**mx("fp4"), "enable_buffer_reuse": False, "max_input_numel": 4194304, "future_field": 1})
    assert parse(config).resolve("x.q_proj").scheme == QuantScheme(MXFP4_WEIGHT)


# -- resolution ----------------------------------------------------------------------------------

def layered():
    config = quark(mx("fp4"), mx("fp4", True), exclude=["lm_head", "*.mlp.gate", "re:.*vision.*"])
    config["layer_type_quant_config"] = {"Linear": {"weight": spec("fp8_e4m3", "per_channel"),
                                                    "input_tensors": spec("fp8_e4m3", "per_channel", True)}}
    config["layer_quant_config"] = {
        "*.self_attn.o_proj": {"weight": spec("fp8_e4m3"), "input_tensors": spec("fp8_e4m3")},
        "model.layers.1.*": {"weight": None, "input_tensors": None},
        "*down_proj": {"weight": spec("int8", "per_channel"), "input_tensors": spec("int8", "per_channel", True)},
        "model.layers.2.mlp.down_proj": {"weight": spec("fp8_e4m3"), "input_tensors": None},  # after *down_proj
    }
    return parse(config)


def test_layer_quant_config_first_match_then_type_then_global():
    cfg = layered()
    assert cfg.resolve(f"{L0}.self_attn.o_proj").scheme == fp8_scheme("tensor", "static_tensor")
    assert cfg.resolve(f"{L0}.self_attn.o_proj").source == "quark layer_quant_config.*.self_attn.o_proj"
    assert cfg.resolve("model.layers.1.self_attn.o_proj").scheme == fp8_scheme("tensor", "static_tensor")
    assert cfg.resolve("model.layers.1.mlp.up_proj") is None  # weight: null
    assert cfg.resolve("model.layers.2.mlp.down_proj").scheme.weight.dtype is QDtype.INT8  # file order
    assert cfg.resolve(f"{L0}.mlp.up_proj").scheme == fp8_scheme("channel", "dynamic_token")  # type "Linear"
    assert cfg.resolve(f"{L0}.mlp.up_proj").source == "quark layer_type_quant_config.Linear"
    no_type = quark(mx("fp4"))
    assert parse(no_type).resolve(f"{L0}.mlp.up_proj").source == "quark global_quant_config"


def test_exclude_names_globs_regexes():
    cfg = layered()
    for name in ("lm_head", f"{L0}.mlp.gate", "model.vision_tower.proj"):
        assert cfg.resolve(name) is None
    assert cfg.resolve(f"{L0}.mlp.gate_proj") is not None  # fnmatch is a full match


def test_fused_and_moe():
    cfg = layered()
    assert cfg.resolve(f"{L0}.self_attn.qkv_proj").scheme == fp8_scheme("channel", "dynamic_token")
    with pytest.raises(ConfigError, match="expert projections"):  # down_proj int8, gate/up fp8
        cfg.resolve(f"{L0}.mlp.experts", "moe")
    assert cfg.resolve("model.layers.1.mlp.experts", "moe") is None
    config = quark(mx("fp4"), exclude=["*k_proj"])
    with pytest.raises(ConfigError, match="different quantization"):
        parse(config).resolve(f"{L0}.self_attn.qkv_proj")
    config["layer_quant_config"] = {"*qkv_proj": {"weight": None}}
    assert parse(config).resolve(f"{L0}.self_attn.qkv_proj") is None  # its own entry decides
    parent_only = quark(mx("fp4"), exclude=["*.experts"])  # Quark never expands an exclude to descendants
    assert parse(parent_only).resolve(f"{L0}.mlp.experts", "moe") == parse(parent_only).resolve(f"{L0}.mlp.up_proj")
    assert parse(quark(mx("fp4"), exclude=["*.experts.*"])).resolve(f"{L0}.mlp.experts", "moe") is None


def kv_spec():
    return spec("fp8_e4m3", observer_cls="PerTensorMinMaxObserver")


def kv_config():
    config = quark(spec("fp8_e4m3"), spec("fp8_e4m3"))
    config["kv_cache_quant_config"] = {p: {"weight": spec("fp8_e4m3"), "input_tensors": spec("fp8_e4m3"),
                                           "output_tensors": kv_spec()} for p in ("*k_proj", "*v_proj")}
    config["layer_quant_config"] = copy.deepcopy(config["kv_cache_quant_config"])
    return config


def legacy_kv_config():
    config = quark(spec("fp8_e4m3"), spec("fp8_e4m3"))
    config["export"]["kv_cache_group"] = ["*k_proj", "*v_proj"]
    config["layer_quant_config"] = {p: {"weight": spec("fp8_e4m3"), "input_tensors": spec("fp8_e4m3"),
                                        "output_tensors": kv_spec()} for p in ("*k_proj", "*v_proj", "*q_proj")}
    return config


def test_kv_cache_quant_config():
    cfg = parse(kv_config())
    assert cfg.kv_cache == KVCacheSpec(QDtype.FP8_E4M3, ("k_proj.output_scale", "v_proj.output_scale"),
                                       "quark layer_quant_config.*k_proj.output_tensors")
    assert cfg.resolve(f"{L0}.self_attn.k_proj").scheme == fp8_scheme("tensor", "static_tensor")


def test_legacy_kv_cache_group():
    cfg = parse(legacy_kv_config())
    assert cfg.kv_cache.dtype is QDtype.FP8_E4M3
    assert cfg.resolve(f"{L0}.self_attn.q_proj") is not None  # *q_proj output kept with the KV cache: ignored


# -- malformed / unsupported ---------------------------------------------------------------------

def edit(path, value=None, delete=False, base=None):
    config = copy.deepcopy(base or quark(spec("fp8_e4m3"), spec("fp8_e4m3")))
    *parents, last = path.split(".")
    node = config
    for p in parents:
        node = node[p]
    if delete:
        del node[last]
    else:
        node[last] = value
    return config


GQ = "global_quant_config"
KV_BAD = edit("kv_cache_quant_config", {"*k_proj": {"output_tensors": spec("fp8_e4m3")},
                                        "*v_proj": {"output_tensors": spec("fp8_e4m3", "per_channel", True)}})
MALFORMED = [
    (edit(GQ, None, delete=True), ConfigError, GQ),
    (edit(GQ, "fp8"), ConfigError, GQ),
    (edit(f"{GQ}.weight.dtype", "fp7"), ConfigError, f"{GQ}.weight.dtype"),
    (edit(f"{GQ}.weight.dtype", None), ConfigError, f"{GQ}.weight.dtype"),
    (edit(f"{GQ}.weight.qscheme", "per_row"), ConfigError, f"{GQ}.weight.qscheme"),
    (edit(f"{GQ}.weight.group_size", "32"), ConfigError, f"{GQ}.weight.group_size"),
    (edit(f"{GQ}.weight.qscheme", "per_group"), ConfigError, f"{GQ}.weight.group_size"),
    (edit(f"{GQ}.input_tensors.is_dynamic", "yes"), ConfigError, f"{GQ}.input_tensors.is_dynamic"),
    (edit(f"{GQ}.weight.symmetric", 1), ConfigError, f"{GQ}.weight.symmetric"),
    (edit("exclude", "lm_head"), ConfigError, "exclude"),
    (edit("exclude", ["re:["]), ConfigError, "exclude[0]"),
    (edit("layer_type_quant_config", {"Lineer": {"weight": None}}), ConfigError, "layer_type_quant_config.Lineer"),
    (edit("layer_quant_config", {"*q_proj": None}), ConfigError, "layer_quant_config.*q_proj"),
    (edit("quant_method", "awq"), ConfigError, "quant_method"),
    (edit("export.kv_cache_group", ["*k_proj"]), ConfigError, "export.kv_cache_group"),
    (KV_BAD, ConfigError, "kv_cache_quant_config.*v_proj.output_tensors"),
    # well-formed, not representable
    (edit(f"{GQ}.weight", [spec("fp8_e4m3"), spec("fp8_e4m3")]), UnsupportedError, f"{GQ}.weight"),
    # amd-quark 0.13's nvfp4: fp4 per 16 (float32 scales), then an fp8 per-tensor scale of the scales
    (edit(f"{GQ}.weight", [spec("fp4", "per_group", group_size=16, scale_format="float32"),
                           spec("fp8_e4m3", is_scale_quant=True)]), UnsupportedError, f"{GQ}.weight"),
    (edit(f"{GQ}.weight", [W4A8_WEIGHT[0], {**W4A8_WEIGHT[1], "ch_axis": 1}]), UnsupportedError, f"{GQ}.weight"),
    (edit(f"{GQ}.weight", W4A8_WEIGHT, base=edit(f"{GQ}.input_tensors", spec("int8"))), UnsupportedError,
     f"{GQ}.input_tensors"),
    (edit(f"{GQ}.weight", W4A8_WEIGHT, base=edit(f"{GQ}.input_tensors", None)), UnsupportedError,
     f"{GQ}.input_tensors"),
    (edit(f"{GQ}.weight", [W4A8_WEIGHT[0], "int4"]), ConfigError, f"{GQ}.weight[1]"),
    (edit(f"{GQ}.input_tensors", [spec("fp8_e4m3")]), UnsupportedError, f"{GQ}.input_tensors"),
    (edit(f"{GQ}.output_tensors", spec("fp8_e4m3")), UnsupportedError, f"{GQ}.output_tensors"),
    (edit(f"{GQ}.bias", spec("int8")), UnsupportedError, f"{GQ}.bias"),
    (edit(f"{GQ}.weight.dtype", "uint8"), UnsupportedError, f"{GQ}.weight.dtype"),
    (edit(f"{GQ}.weight.dtype", "int4"), UnsupportedError, f"{GQ}.weight.dtype"),
    # amd-quark 0.13's uint4_wo_128 (int4_wo_128: int4, symmetric)
    (edit(f"{GQ}.weight", spec("uint4", "per_group", group_size=128, ch_axis=-1, symmetric=False)), UnsupportedError,
     f"{GQ}.weight.dtype"),
    (edit(f"{GQ}.weight.dtype", "mx"), UnsupportedError, f"{GQ}.weight.dtype"),
    (edit(f"{GQ}.weight.symmetric", False), UnsupportedError, f"{GQ}.weight.symmetric"),
    (edit(f"{GQ}.weight", spec("fp4", "per_group", group_size=16, scale_format="float32")), UnsupportedError,
     f"{GQ}.weight.scale_format"),
    (edit(f"{GQ}.weight", {**mx("fp4"), "group_size": 16}), UnsupportedError, f"{GQ}.weight.group_size"),
    (edit(f"{GQ}.input_tensors", mx("fp4", is_dynamic=False)), UnsupportedError, f"{GQ}.input_tensors.is_dynamic"),
    (edit(f"{GQ}.weight.ch_axis", 1, base=edit(f"{GQ}.weight.qscheme", "per_channel")), UnsupportedError,
     f"{GQ}.weight.ch_axis"),
    (edit(f"{GQ}.weight.qscheme", "per_block"), UnsupportedError, f"{GQ}.weight.qscheme"),
    (edit(f"{GQ}.weight", None), UnsupportedError, f"{GQ}.weight"),
    (edit("export.weight_format", "fake_quantized"), UnsupportedError, "export.weight_format"),
]


@pytest.mark.parametrize("config,error,key", MALFORMED, ids=[f"{i}-{m[2]}" for i, m in enumerate(MALFORMED)])
def test_malformed(config, error, key):
    with pytest.raises(error) as info:
        parse(config)
    assert f"quantization_config.{key}" in str(info.value) and info.value.fix


# -- fuzzing: nothing but QCompileError escapes --------------------------------------------------

KEYS = ["quant_method", "global_quant_config", "layer_quant_config", "layer_type_quant_config", "exclude", "export",
        "kv_cache_quant_config", "kv_cache_group", "weight", "input_tensors", "output_tensors", "bias", "dtype",
        "qscheme", "group_size", "is_dynamic", "symmetric", "scale_format", "ch_axis", "Linear", "weight_format"]
WORDS = ["fp4", "fp8_e4m3", "int8", "fp6_e2m3", "uint8", "mx", "per_group", "per_tensor", "per_channel", "e8m0", "*",
         "*k_proj", "re:(", "lm_head", "real_quantized"]
json_values = fuzz.json_values(KEYS, WORDS, ints=(-100, 100))
PROBES = [f"{L0}.self_attn.q_proj", f"{L0}.self_attn.qkv_proj", f"{L0}.mlp.gate_up_proj", "lm_head"]
exercise = partial(fuzz.exercise, parse, probes=PROBES, moe_probe=f"{L0}.mlp.experts")


@fuzz.FUZZ
@given(fuzz.config_dicts(KEYS, json_values))
def test_fuzz_arbitrary_dicts(config):
    exercise(config)


SEEDS = [SCHEMES[k][0] for k in sorted(SCHEMES)] + [kv_config(), legacy_kv_config()] + (
    [real()] if (TESTDATA / "quark-w-mxfp4-dense").is_dir() else [])


@fuzz.FUZZ
@given(st.data())
def test_fuzz_mutated_configs(data):
    exercise(fuzz.draw_mutated(data, SEEDS, KEYS, json_values, max_depth=5))
