"""qcompile.formats.compressed_tensors against vLLM's compressed-tensors schemes (reference 001) and the
llm-compressor producer's files."""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import ConfigError, UnsupportedError
from qcompile.formats import parse_quant_config
from qcompile.formats.compressed_tensors import CompressedTensorsConfig, parse
from qcompile.scheme import (MXFP4_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, ActSpec, Granularity, KVCacheSpec, Packing,
                             QDtype, QuantScheme, ScaleDtype, ScaleSpec, WeightSpec, canonical_shape, fp8_scheme,
                             mx_act, shape_matches)
from tests.conftest import TESTDATA
from tests.formats import fuzz

L0 = "model.layers.0"
LINEARS = [f"{L0}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
          [f"{L0}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def qargs(num_bits=8, type="float", strategy="tensor", dynamic=False, **kw):
    """A QuantizationArgs dict as llm-compressor writes it (all keys present)."""
    base = {"num_bits": num_bits, "type": type, "strategy": strategy, "dynamic": dynamic, "symmetric": True,
            "group_size": None, "block_structure": None, "actorder": None, "scale_dtype": None, "zp_dtype": None,
            "observer": None, "observer_kwargs": {}}
    return {**base, **kw}


def ct(weights, acts=None, fmt="float-quantized", targets=("Linear",), ignore=("lm_head",), **top):
    group = {"targets": list(targets), "weights": weights, "input_activations": acts, "output_activations": None,
             "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": list(ignore), "kv_cache_scheme": None, "quantization_status": "compressed", **top}


def names(lq):
    return [(t.role, t.name, t.reciprocal) for t in lq.tensors]


def real(ckpt):
    d = TESTDATA / ckpt
    if not d.is_dir():
        pytest.skip(f"producer testdata not found at {TESTDATA}")
    with open(d / "config.json") as f:
        return json.load(f)["quantization_config"]


# -- the producer's files ------------------------------------------------------------------------

REAL = {
    "llmcompressor-fp8-dynamic-dense": (fp8_scheme("channel", "dynamic_token"),
                                        [("weight", "weight", False), ("weight_scale", "weight_scale", False)]),
    "llmcompressor-nvfp4-dense": (QuantScheme(NVFP4_WEIGHT, NVFP4_ACT),
                                  [("weight", "weight_packed", False), ("weight_scale", "weight_scale", False),
                                   ("weight_global_scale", "weight_global_scale", True),
                                   ("input_global_scale", "input_global_scale", True)]),
    # actorder "static" (GPTQ reordering at calibration only): no weight_g_idx on disk
    "llmcompressor-w4a16-gptq-dense": (
        QuantScheme(WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=128), Packing.INT32)),
        [("weight", "weight_packed", False), ("weight_scale", "weight_scale", False),
         ("weight_shape", "weight_shape", False)]),
}
SAFETENSORS_DTYPES = {"weight": {"F8_E4M3", "U8", "I32", "I8"}, "weight_scale": {"BF16", "F32", "F8_E4M3", "U8"},
                      "weight_global_scale": {"F32", "BF16"}, "input_global_scale": {"F32", "BF16"},
                      "input_scale": {"F32", "BF16"}, "weight_shape": {"I64", "I32"}}


@pytest.mark.parametrize("ckpt", sorted(REAL))
def test_real_config(ckpt):
    scheme, tensors = REAL[ckpt]
    cfg = parse_quant_config(real(ckpt))
    assert isinstance(cfg, CompressedTensorsConfig) and cfg.format == "compressed-tensors"
    for name in LINEARS:
        lq = cfg.resolve(name)
        assert lq.scheme == scheme and names(lq) == tensors and not lq.online
        assert lq.source == "compressed-tensors config_groups.group_0"
    assert cfg.resolve("lm_head") is None and cfg.kv_cache is None
    assert cfg.resolve(f"{L0}.self_attn.qkv_proj").scheme == scheme  # fused, through its shards
    assert cfg.resolve(f"{L0}.mlp.experts", "moe").scheme == scheme  # "Linear" covers the experts


@pytest.mark.parametrize("ckpt", sorted(REAL))
def test_real_tensors_on_disk(ckpt):
    """Every tensor the LayerQuant names is in model.safetensors with a canonical shape."""
    from safetensors import safe_open

    cfg = parse(real(ckpt))
    with safe_open(str(TESTDATA / ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in LINEARS:
            lq = cfg.resolve(name)
            n, k = f.get_slice(f"{name}.{lq.tensor('weight').name}").get_shape()
            k = k * 32 // lq.scheme.weight.dtype.bits if lq.scheme.weight.packing is Packing.INT32 else \
                k * 2 if lq.scheme.weight.packing is Packing.UINT8 else k
            for t in lq.tensors:
                assert f"{name}.{t.name}" in keys
                sl = f.get_slice(f"{name}.{t.name}")
                assert sl.get_dtype() in SAFETENSORS_DTYPES[t.role], (name, t)
                assert shape_matches(sl.get_shape(), canonical_shape(t.role, lq.scheme, n, k)), (name, t)
            quant_suffixes = {key[len(name) + 1:] for key in keys if key.startswith(name + ".")}
            assert quant_suffixes == {t.name for t in lq.tensors}


# -- every compressed-tensors scheme of reference 001 (and the dense ones) -----------------------

NVFP4_W = qargs(4, strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn")
NVFP4_A = qargs(4, strategy="tensor_group", group_size=16, dynamic="local", scale_dtype="torch.float8_e4m3fn")
INT4_G128 = qargs(4, "int", "group", group_size=128)
TOKEN_FP8 = qargs(8, strategy="token", dynamic=True)
INT8_TOKEN = qargs(8, "int", "token", dynamic=True)
G = Granularity


def wspec(dtype, gran, packing=Packing.NONE, **kw):
    scale = {"group_size": kw.pop("group_size")} if "group_size" in kw else {}
    if "block" in kw:
        scale["block"] = kw.pop("block")
    return WeightSpec(dtype, ScaleSpec(gran, **scale), packing, **kw)


SCHEMES = {
    "nvfp4_w4a4": (ct(NVFP4_W, NVFP4_A, "nvfp4-pack-quantized"), QuantScheme(NVFP4_WEIGHT, NVFP4_ACT),
                   ["weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"]),
    "nvfp4_w4a16": (ct(NVFP4_W, None, "nvfp4-pack-quantized"), QuantScheme(NVFP4_WEIGHT),
                    ["weight_packed", "weight_scale", "weight_global_scale"]),
    "nvfp4_static_act": (ct(NVFP4_W, {**NVFP4_A, "dynamic": False}, "nvfp4-pack-quantized"),
                         QuantScheme(NVFP4_WEIGHT, NVFP4_ACT),
                         ["weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"]),
    "w4a8_int_channel": (ct(qargs(4, "int", "channel"), INT8_TOKEN, "int-quantized"),
                         QuantScheme(wspec(QDtype.INT4, G.CHANNEL), ActSpec(QDtype.INT8, True, ScaleSpec(G.TOKEN))),
                         ["weight", "weight_scale"]),
    "w4a8_int_group_packed": (ct(qargs(4, "int", "group", group_size=32), INT8_TOKEN, "pack-quantized"),
                              QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=32),
                                          ActSpec(QDtype.INT8, True, ScaleSpec(G.TOKEN))),
                              ["weight_packed", "weight_scale", "weight_shape"]),
    "fp8_tensor_static": (ct(qargs(), qargs()), fp8_scheme("tensor", "static_tensor"),
                          ["weight", "weight_scale", "input_scale"]),
    "fp8_tensor_dynamic": (ct(qargs(), qargs(dynamic=True)), fp8_scheme("tensor", "dynamic_tensor"),
                           ["weight", "weight_scale"]),
    "fp8_channel_token": (ct(qargs(strategy="channel"), TOKEN_FP8), fp8_scheme("channel", "dynamic_token"),
                          ["weight", "weight_scale"]),
    "fp8_block": (ct(qargs(strategy="block", block_structure=[128, 128]),
                     qargs(strategy="group", group_size=128, dynamic=True)),
                  fp8_scheme("block", "dynamic_group"), ["weight", "weight_scale"]),
    "fp8_block_legacy_string": (ct(qargs(strategy="block", block_structure="128x128"),
                                   qargs(strategy="group", group_size=128, dynamic=True)),
                                fp8_scheme("block", "dynamic_group"), ["weight", "weight_scale"]),
    "fp8_weight_only": (ct(qargs(strategy="channel")), fp8_scheme("channel", None), ["weight", "weight_scale"]),
    "wna16_int4_group": (ct(INT4_G128, fmt="pack-quantized"),
                         QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128)),
                         ["weight_packed", "weight_scale", "weight_shape"]),
    "wna16_int8_channel": (ct(qargs(8, "int", "channel"), fmt="pack-quantized"),
                           QuantScheme(wspec(QDtype.INT8, G.CHANNEL, Packing.INT32)),
                           ["weight_packed", "weight_scale", "weight_shape"]),
    "wna16_actorder_group": (ct({**INT4_G128, "actorder": "group"}, fmt="pack-quantized"),
                             QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128, act_order=True)),
                             ["weight_packed", "weight_scale", "weight_g_idx", "weight_shape"]),
    "wna16_actorder_true_legacy": (ct({**INT4_G128, "actorder": True}, fmt="pack-quantized"),
                                   QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128,
                                                     act_order=True)),
                                   ["weight_packed", "weight_scale", "weight_g_idx", "weight_shape"]),
    "wna16_actorder_weight": (ct({**INT4_G128, "actorder": "weight"}, fmt="pack-quantized"),
                              QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128)),
                              ["weight_packed", "weight_scale", "weight_shape"]),
    "wna16_int4_asym_group": (ct({**INT4_G128, "symmetric": False}, fmt="pack-quantized"),
                              QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128, zero_point=True)),
                              ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape"]),
    "wna16_int8_asym_channel": (ct(qargs(8, "int", "channel", symmetric=False), fmt="pack-quantized"),
                                QuantScheme(wspec(QDtype.INT8, G.CHANNEL, Packing.INT32, zero_point=True)),
                                ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape"]),
    "wna16_int4_asym_tensor": (ct(qargs(4, "int", "tensor", symmetric=False), fmt="pack-quantized"),
                               QuantScheme(wspec(QDtype.INT4, G.TENSOR, Packing.INT32, zero_point=True)),
                               ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape"]),
    "w8a8_int8_asym_weight": (ct(qargs(8, "int", "channel", symmetric=False), INT8_TOKEN, "int-quantized"),
                              QuantScheme(wspec(QDtype.INT8, G.CHANNEL, zero_point=True),
                                          ActSpec(QDtype.INT8, True, ScaleSpec(G.TOKEN))),
                              ["weight", "weight_scale", "weight_zero_point"]),
    "w8a8_int8_static_tensor": (ct(qargs(8, "int", "channel"), qargs(8, "int"), "int-quantized"),
                                QuantScheme(wspec(QDtype.INT8, G.CHANNEL),
                                            ActSpec(QDtype.INT8, False, ScaleSpec(G.TENSOR))),
                                ["weight", "weight_scale", "input_scale"]),
    "w4afp8": (ct(INT4_G128, TOKEN_FP8, "pack-quantized"),
               QuantScheme(wspec(QDtype.INT4, G.GROUP, Packing.INT32, group_size=128),
                           ActSpec(QDtype.FP8_E4M3, True, ScaleSpec(G.TOKEN))),
               ["weight_packed", "weight_scale", "weight_shape"]),
    "mxfp4_w4a16": (ct(qargs(4, strategy="group", group_size=32, scale_dtype="torch.uint8"), None,
                       "mxfp4-pack-quantized"), QuantScheme(MXFP4_WEIGHT), ["weight_packed", "weight_scale"]),
    "mxfp4_w4a4": (ct(qargs(4, strategy="group", group_size=32),
                      qargs(4, strategy="group", group_size=32, dynamic=True), "mxfp4-pack-quantized"), QuantScheme(MXFP4_WEIGHT, mx_act(QDtype.FP4_E2M1)),
                   ["weight_packed", "weight_scale"]),
    "mxfp8": (ct(qargs(8, strategy="group", group_size=32), qargs(8, strategy="group", group_size=32, dynamic=True,
                                                                   scale_dtype="torch.uint8"), "mxfp8-quantized"),
              QuantScheme(WeightSpec(QDtype.FP8_E4M3, ScaleSpec(G.GROUP, ScaleDtype.E8M0, group_size=32)),
                          mx_act(QDtype.FP8_E4M3)), ["weight", "weight_scale"]),
    "mxfp6": (ct(qargs(6, strategy="group", group_size=32), None, "mxfp6-pack-quantized"),
              QuantScheme(WeightSpec(QDtype.FP6_E2M3, ScaleSpec(G.GROUP, ScaleDtype.E8M0, group_size=32),
                                     Packing.UINT8_FP6)), ["weight_packed", "weight_scale"]),
}


@pytest.mark.parametrize("case", sorted(SCHEMES))
def test_schemes(case):
    config, scheme, tensor_names = SCHEMES[case]
    lq = parse(config).resolve(f"{L0}.mlp.down_proj")
    assert lq.scheme == scheme
    assert [t.name for t in lq.tensors] == tensor_names
    reciprocal = {t.name for t in lq.tensors if t.reciprocal}
    assert reciprocal == {"weight_global_scale", "input_global_scale"} & set(tensor_names)
    # pack-quantized packs group / channel zero points along out_features; a tensor one stays int8
    packed_zp = case.startswith("wna16") and "asym" in case and "tensor" not in case
    assert {t.name for t in lq.tensors if t.packed_rows} == ({"weight_zero_point"} if packed_zp else set())


def test_inferred_strategy_and_group_format():
    w = {"num_bits": 4, "type": "int", "group_size": 64}  # strategy inferred "group", defaults elsewhere
    cfg = parse({"config_groups": {"g": {"targets": ["Linear"], "weights": w, "format": "pack-quantized"}}})
    assert cfg.resolve("x.q_proj").scheme.weight.scale == ScaleSpec(G.GROUP, group_size=64)
    w = {"num_bits": 8, "type": "int", "group_size": -1}
    cfg = parse({"format": "int-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": w}}})
    assert cfg.resolve("x.q_proj").scheme.weight.scale.granularity is G.CHANNEL


def test_mixed_precision_groups():
    config = ct(NVFP4_W, NVFP4_A, "nvfp4-pack-quantized", targets=["re:.*mlp.*"])
    config["format"] = "mixed-precision"
    config["config_groups"]["group_1"] = {"targets": ["Linear"], "weights": qargs(strategy="channel"),
                                          "input_activations": TOKEN_FP8, "format": "float-quantized"}
    cfg = parse(config)
    assert cfg.resolve(f"{L0}.mlp.up_proj").scheme == QuantScheme(NVFP4_WEIGHT, NVFP4_ACT)
    assert cfg.resolve(f"{L0}.self_attn.o_proj").scheme == fp8_scheme("channel", "dynamic_token")
    assert "group_0" in cfg.describe() and "group_1" in cfg.describe()


def test_kv_cache_scheme():
    cfg = parse(ct(qargs(), qargs(), kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "dynamic": False, "symmetric": True}))
    assert cfg.kv_cache == KVCacheSpec(QDtype.FP8_E4M3, ("k_scale", "v_scale"), "compressed-tensors "
                                       "quantization_config.kv_cache_scheme")
    assert "kv cache fp8_e4m3" in cfg.describe()
    per_head = parse(ct(qargs(), qargs(), kv_cache_scheme=qargs(strategy="attn_head"))).kv_cache
    assert per_head.per_head and per_head.scale_names == ("k_scale", "v_scale")


# -- resolution ----------------------------------------------------------------------------------

def three_groups(ignore=("lm_head",)):
    config = ct(qargs(strategy="channel"), TOKEN_FP8, targets=["Linear"], ignore=ignore)
    groups = config["config_groups"]
    groups["attn"] = {**groups["group_0"], "targets": [r"re:.*self_attn\.[qkvo]_proj$"],
                      "input_activations": qargs(dynamic=True)}
    groups["q0"] = {**groups["group_0"], "targets": [f"{L0}.self_attn.q_proj"], "input_activations": qargs()}
    return parse(config)


def group_of(cfg, name, kind="linear"):
    lq = cfg.resolve(name, kind)
    return lq and lq.source.rsplit(".", 1)[-1]


def test_target_precedence_exact_regex_class():
    cfg = three_groups()
    assert group_of(cfg, f"{L0}.self_attn.q_proj") == "q0"  # exact beats regex and class
    assert group_of(cfg, "model.layers.1.self_attn.q_proj") == "attn"  # regex beats class
    assert group_of(cfg, f"{L0}.mlp.up_proj") == "group_0"  # class "Linear"
    assert group_of(cfg, "lm_head") is None


def test_regex_is_anchored_at_start_only():
    """compressed-tensors and vLLM use re.match: a regex target is a prefix match."""
    cfg = parse(ct(qargs(), qargs(), targets=["re:model.layers.1"], ignore=[]))
    assert cfg.resolve("model.layers.1.mlp.up_proj") is not None
    assert cfg.resolve("model.layers.11.mlp.up_proj") is not None
    assert cfg.resolve("model.layers.0.mlp.up_proj") is None
    assert cfg.resolve("x.model.layers.1.mlp.up_proj") is None


def test_ignore_beats_targets():
    cfg = three_groups(ignore=["lm_head", "re:.*down_proj$", f"{L0}.self_attn.q_proj"])
    assert cfg.resolve(f"{L0}.mlp.down_proj") is None and cfg.resolve(f"{L0}.self_attn.q_proj") is None
    assert group_of(cfg, f"{L0}.mlp.up_proj") == "group_0"
    assert parse(ct(qargs(), qargs(), ignore=["Linear"])).resolve(f"{L0}.mlp.up_proj") is None  # a class name


def test_fused_layers_resolve_through_shards():
    cfg = three_groups()
    assert group_of(cfg, "model.layers.1.self_attn.qkv_proj") == "attn"
    assert group_of(cfg, "model.layers.1.mlp.gate_up_proj") == "group_0"
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.qkv_proj.*different quantization"):
        cfg.resolve(f"{L0}.self_attn.qkv_proj")  # q_proj "q0", k/v_proj "attn"
    partial = parse(ct(qargs(), qargs(), ignore=["re:.*k_proj"]))
    with pytest.raises(ConfigError, match="unquantized"):
        partial.resolve(f"{L0}.self_attn.qkv_proj")
    own = parse(ct(qargs(), qargs(), ignore=["re:.*k_proj", "re:.*qkv_proj"]))
    assert own.resolve(f"{L0}.self_attn.qkv_proj") is None  # its own ignore entry decides
    own_target = parse(ct(qargs(), qargs(), targets=["re:.*self_attn.*"]))  # matches qkv_proj itself
    assert own_target.resolve(f"{L0}.self_attn.qkv_proj") is not None


def test_moe_experts():
    cfg = parse(ct(qargs(), qargs(), ignore=["lm_head", "re:.*mlp.gate$"]))
    assert cfg.resolve(f"{L0}.mlp.experts", "moe").scheme == fp8_scheme("tensor", "static_tensor")
    assert cfg.resolve(f"{L0}.mlp.gate") is None  # the router
    assert parse(ct(qargs(), qargs(), ignore=["re:.*experts"])).resolve(f"{L0}.mlp.experts", "moe") is None
    split = parse(ct(qargs(), qargs(), ignore=[r"re:.*experts\.\d+\.down_proj"]))
    with pytest.raises(ConfigError, match="expert projections"):
        split.resolve(f"{L0}.mlp.experts", "moe")
    only_attn = parse(ct(qargs(), qargs(), targets=["re:.*self_attn.*"]))
    assert only_attn.resolve(f"{L0}.mlp.experts", "moe") is None
    experts_only = parse(ct(qargs(), qargs(), targets=["re:.*mlp.experts"]))  # a prefix of every expert Linear
    assert experts_only.resolve(f"{L0}.mlp.experts", "moe") is not None
    assert experts_only.resolve(f"{L0}.mlp.up_proj") is None
    # a target / ignore naming only the parent module matches no Linear: no effect, as in compressed-tensors
    parent = parse(ct(qargs(), qargs(), targets=["re:.*mlp.experts$"]))
    assert parent.resolve(f"{L0}.mlp.experts", "moe") is None
    assert parse(ct(qargs(), qargs(), ignore=[f"{L0}.mlp.experts"])).resolve(f"{L0}.mlp.experts", "moe") is not None


def test_dispatcher_and_raw():
    config = ct(qargs(), qargs())
    cfg = parse_quant_config(copy.deepcopy(config))
    assert cfg.raw == config and cfg.format == "compressed-tensors"


# -- malformed / unsupported ---------------------------------------------------------------------

def edit(path, value=None, delete=False, base=None):
    """ct() with one key (dotted path under quantization_config) replaced or deleted."""
    config = copy.deepcopy(base or ct(qargs(), qargs()))
    *parents, last = path.split(".")
    node = config
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if delete:
        del node[last]
    else:
        node[last] = value
    return config


G0 = "config_groups.group_0"
MALFORMED = [
    (edit("config_groups", None), ConfigError, "config_groups"),
    (edit("config_groups", []), ConfigError, "config_groups"),
    (edit(f"{G0}.targets", []), ConfigError, f"{G0}.targets"),
    (edit(f"{G0}.targets", ["re:("]), ConfigError, f"{G0}.targets[0]"),
    (edit(f"{G0}.weights.strategy", "diagonal"), ConfigError, f"{G0}.weights.strategy"),
    (edit(f"{G0}.weights.num_bits", "8"), ConfigError, f"{G0}.weights.num_bits"),
    (edit(f"{G0}.weights.type", "complex"), ConfigError, f"{G0}.weights.type"),
    (edit(f"{G0}.weights.strategy", "group"), ConfigError, f"{G0}.weights.group_size"),
    (edit(f"{G0}.weights.strategy", "block"), ConfigError, f"{G0}.weights.block_structure"),
    (edit(f"{G0}.weights.block_structure", [128, 0], base=edit(f"{G0}.weights.strategy", "block")),
     ConfigError, f"{G0}.weights.block_structure"),
    (edit(f"{G0}.input_activations.strategy", "token"), ConfigError, f"{G0}.input_activations.dynamic"),
    (edit(f"{G0}.weights.dynamic", "sometimes"), ConfigError, f"{G0}.weights.dynamic"),
    (edit(f"{G0}.weights.actorder", "random"), ConfigError, f"{G0}.weights.actorder"),
    (edit(f"{G0}.weights.actorder", "group"), ConfigError, f"{G0}.weights.actorder"),  # needs strategy group
    (edit(f"{G0}.input_activations.actorder", "group"), ConfigError, f"{G0}.input_activations.actorder"),
    (edit(f"{G0}.weights.scale_dtype", "torch.float128"), ConfigError, f"{G0}.weights.scale_dtype"),
    (edit(f"{G0}.weights.stratgy", "tensor"), ConfigError, f"{G0}.weights.stratgy"),
    (edit(f"{G0}.weights.group_size", -5), ConfigError, f"{G0}.weights.group_size"),
    (edit(f"{G0}.format", "zip-quantized"), ConfigError, f"{G0}.format"),
    (edit(f"{G0}.format", "pack-quantized"), ConfigError, f"{G0}.format"),  # fp8 weights cannot be packed
    (edit(f"{G0}.format", "nvfp4-pack-quantized"), ConfigError, f"{G0}.weights"),
    (edit("format", None, base=edit(f"{G0}.format", None)), ConfigError, f"{G0}.format"),
    (edit(f"{G0}.format", None, base=edit("format", "mixed-precision")), ConfigError, f"{G0}.format"),
    (edit("ignore", "lm_head"), ConfigError, "ignore"),
    (edit("ignore", ["lm_head", 3]), ConfigError, "ignore[1]"),
    (edit("quant_method", "gptq"), ConfigError, "quant_method"),
    (edit("kv_cache_scheme", "fp8"), ConfigError, "kv_cache_scheme"),
    # well-formed, not representable
    (edit(f"{G0}.weights.num_bits", 2), UnsupportedError, f"{G0}.weights.num_bits"),
    (edit(f"{G0}.weights", {**INT4_G128, "num_bits": 3}, base=edit(f"{G0}.format", "pack-quantized")),
     UnsupportedError, f"{G0}.weights.num_bits"),
    (edit(f"{G0}.weights.symmetric", False), UnsupportedError, f"{G0}.weights.symmetric"),
    (edit(f"{G0}.input_activations.symmetric", False), UnsupportedError, f"{G0}.input_activations"),
    (edit(f"{G0}.output_activations", qargs()), UnsupportedError, f"{G0}.output_activations"),
    (edit(f"{G0}.weights.dynamic", True), UnsupportedError, f"{G0}.weights.dynamic"),
    (edit(f"{G0}.weights", None), UnsupportedError, f"{G0}.weights"),  # activation-only
    (edit(f"{G0}.format", "dense"), UnsupportedError, f"{G0}.format"),
    (edit(f"{G0}.format", "sparse-24-bitmask"), UnsupportedError, f"{G0}.format"),
    (edit("sparsity_config", {"format": "sparse-24-bitmask"}), UnsupportedError, "sparsity_config"),
    (edit("transform_config", {"config_groups": {"u": {}}}), UnsupportedError, "transform_config"),
    (edit("quantization_status", "frozen"), UnsupportedError, "quantization_status"),
    (edit(f"{G0}.weights.strategy", "attn_head"), UnsupportedError, f"{G0}.weights.strategy"),
    (edit("kv_cache_scheme", qargs(strategy="channel")), UnsupportedError, "kv_cache_scheme"),
    (edit(f"{G0}.input_activations.strategy", "attn_head"), UnsupportedError, f"{G0}.input_activations.strategy"),
    (edit("kv_cache_scheme", qargs(dynamic=True)), UnsupportedError, "kv_cache_scheme"),
    (edit("config_groups", {"W4A16": ["Linear"]}), UnsupportedError, "config_groups.W4A16"),
    (edit(f"{G0}.weights.symmetric", False, base=ct(qargs(4, strategy="group", group_size=32),
                                                fmt="mxfp4-pack-quantized")), UnsupportedError,
     f"{G0}.weights.symmetric"),
    (edit(f"{G0}.input_activations.dynamic", True, base=ct(NVFP4_W, NVFP4_A, "nvfp4-pack-quantized")),
     UnsupportedError, f"{G0}.input_activations"),
]


@pytest.mark.parametrize("config,error,key", MALFORMED, ids=[f"{i}-{m[2]}" for i, m in enumerate(MALFORMED)])
def test_malformed(config, error, key):
    with pytest.raises(error) as info:
        parse(config)
    assert f"quantization_config.{key}" in str(info.value) and info.value.fix


def test_duplicate_target_across_groups():
    config = ct(qargs(), qargs())
    config["config_groups"]["group_1"] = copy.deepcopy(config["config_groups"]["group_0"])
    with pytest.raises(ConfigError, match=r"config_groups.group_1.targets\[0\].*also in config_groups.group_0"):
        parse(config)


# -- fuzzing: nothing but QCompileError escapes --------------------------------------------------

KEYS = ["quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "targets", "weights",
        "input_activations", "output_activations", "num_bits", "type", "strategy", "group_size", "dynamic",
        "symmetric", "actorder", "block_structure", "scale_dtype", "quantization_status", "sparsity_config"]
WORDS = ["Linear", "re:.*", "re:(", "float", "int", "group", "tensor_group", "block", "token", "local", "static",
         "pack-quantized", "float-quantized", "nvfp4-pack-quantized", "mixed-precision", "torch.uint8", "128x128"]
json_values = fuzz.json_values(KEYS, WORDS)
PROBES = [f"{L0}.self_attn.q_proj", f"{L0}.self_attn.qkv_proj", f"{L0}.mlp.gate_up_proj", "lm_head", "Linear"]
exercise = partial(fuzz.exercise, parse, probes=PROBES, moe_probe=f"{L0}.mlp.experts")


@fuzz.FUZZ
@given(fuzz.config_dicts(KEYS, json_values))
def test_fuzz_arbitrary_dicts(config):
    exercise(config)


def seeds():
    found = [SCHEMES[k][0] for k in sorted(SCHEMES)] + [ct(qargs(), qargs(), kv_cache_scheme=qargs())]
    for ckpt in sorted(REAL):
        if (TESTDATA / ckpt).is_dir():
            found.append(real(ckpt))
    return found


SEEDS = seeds()


@fuzz.FUZZ
@given(st.data())
def test_fuzz_mutated_configs(data):
    exercise(fuzz.draw_mutated(data, SEEDS, KEYS, json_values, max_depth=5))
