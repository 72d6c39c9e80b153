"""qcompile.formats.modelopt against vLLM's ModelOpt classes (the spec) and the producer's files."""

from __future__ import annotations

import copy
import json
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import ConfigError
from qcompile.formats import parse_quant_config
from qcompile.formats.modelopt import LAYER_QUANTS, ModelOptConfig, parse, split_subtree_patterns
from qcompile.scheme import (MXFP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, Packing, QDtype, QuantScheme, canonical_shape,
                             fp8_scheme, mx_act, shape_matches)
from tests.conftest import TESTDATA
from tests.formats import fuzz

ATTN = "model.layers.0.self_attn"


def legacy(algo="FP8", **quantization):
    """An hf_quant_config.json dict (NVFP4 / MXFP8 need kv_cache_quant_algo etc. present)."""
    q = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    q.update(quantization)
    return {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": q}


def cfgjson(algo="FP8", **fields):
    """A config.json quantization_config dict."""
    return {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"], **fields}


BOTH_FORMS = pytest.mark.parametrize("form", [legacy, cfgjson], ids=["hf_quant_config", "config_json"])


def names(lq):
    return [(t.role, t.name, t.reciprocal) for t in lq.tensors]


# -- the producer's real files -------------------------------------------------------------------

REAL = {  # checkpoint -> (scheme of q_proj, unquantized modules)
    "modelopt-fp8-dense": (fp8_scheme("tensor", "static_tensor"), ["lm_head", "model.embed_tokens"]),
    "modelopt-nvfp4-dense": (QuantScheme(NVFP4_WEIGHT, NVFP4_ACT), ["lm_head", "model.embed_tokens"]),
    "modelopt-fp8-moe": (fp8_scheme("tensor", "static_tensor"),
                         ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),
    "modelopt-w4a16-nvfp4-moe": (QuantScheme(NVFP4_WEIGHT, None), ["lm_head", "model.embed_tokens",
                                                                   "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),
    "modelopt-w4a16-nvfp4-mixtral": (QuantScheme(NVFP4_WEIGHT, None),
                                     ["lm_head", "model.embed_tokens", "model.layers.0.block_sparse_moe.gate",
                                      "model.layers.1.block_sparse_moe.gate"]),
}


def real_configs(ckpt: str) -> dict[str, dict]:
    d = TESTDATA / ckpt
    if not d.is_dir():
        pytest.skip(f"producer testdata not found at {TESTDATA}")
    with open(d / "hf_quant_config.json") as f:
        hf = json.load(f)
    with open(d / "config.json") as f:
        cj = json.load(f)["quantization_config"]
    return {"hf_quant_config": hf, "config_json": cj}


def header(ckpt: str) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(TESTDATA / ckpt / "model.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("form", ["hf_quant_config", "config_json"])
@pytest.mark.parametrize("ckpt", sorted(REAL))
def test_real_config_resolves(ckpt, form):
    cfg = parse(real_configs(ckpt)[form])
    scheme, unquantized = REAL[ckpt]
    assert isinstance(cfg, ModelOptConfig) and cfg.format == "modelopt" and cfg.kv_cache is None
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"):
        assert cfg.resolve(f"{ATTN}.{leaf}").scheme == scheme
    for name in unquantized:
        assert cfg.resolve(name) is None, name
    if "moe" in ckpt or "mixtral" in ckpt:
        assert cfg.resolve("model.layers.0.mlp.experts", "moe").scheme == scheme
        assert cfg.resolve("model.layers.1.mlp.experts.3.gate_proj").scheme == scheme
        assert cfg.resolve("model.layers.1.block_sparse_moe.experts.3.w1").scheme == scheme
    else:
        assert cfg.resolve("model.layers.1.mlp.gate_up_proj").scheme == scheme


@pytest.mark.parametrize("ckpt", sorted(REAL))
def test_real_tensors_match_the_declared_names_dtypes_and_shapes(ckpt):
    """Every quantized linear of the file stores exactly the tensors the parser names, in canonical shape."""
    cfg = parse(real_configs(ckpt)["hf_quant_config"])
    hdr = header(ckpt)
    weights = [k[: -len(".weight")] for k in hdr if k.endswith(".weight") and "norm" not in k]
    checked = 0
    for module in weights:
        lq = cfg.resolve(module)
        if lq is None:
            assert hdr[f"{module}.weight"][0] == "BF16", module
            continue
        n, cols = hdr[f"{module}.weight"][1]
        k = cols * 2 if lq.scheme.weight.packing is Packing.UINT8 else cols
        fp4 = lq.scheme.weight.dtype is QDtype.FP4_E2M1
        want = {"weight": "U8" if fp4 else "F8_E4M3", "weight_scale": "F8_E4M3" if fp4 else "F32"}
        stored = {key[len(module) + 1:] for key in hdr if key.startswith(f"{module}.")}
        assert stored == {t.name for t in lq.tensors}, module  # W4A16_NVFP4: no input_scale
        for t in lq.tensors:
            dtype, shape = hdr[f"{module}.{t.name}"]
            assert shape_matches(shape, canonical_shape(t.role, lq.scheme, n, k)), (module, t)
            assert dtype == want.get(t.role, "F32"), (module, t, dtype)
        checked += 1
    assert checked >= 14


def test_dispatcher_picks_modelopt_for_both_forms():
    assert parse_quant_config(legacy()).format == "modelopt"
    assert parse_quant_config(cfgjson()).format == "modelopt"


# -- every quant_algo ------------------------------------------------------------------------------

ALGOS = {
    "FP8": (fp8_scheme("tensor", "static_tensor"),
            [("weight", "weight", False), ("weight_scale", "weight_scale", False), ("input_scale", "input_scale", False)]),
    "FP8_PER_CHANNEL_PER_TOKEN": (fp8_scheme("channel", "dynamic_token"),
                                  [("weight", "weight", False), ("weight_scale", "weight_scale", False)]),
    "FP8_PB_WO": (fp8_scheme("block", "dynamic_group"),
                  [("weight", "weight", False), ("weight_scale", "weight_scale", False)]),
    "MXFP8": (QuantScheme(MXFP8_WEIGHT, mx_act(QDtype.FP8_E4M3)),
              [("weight", "weight", False), ("weight_scale", "weight_scale", False)]),
    "NVFP4": (QuantScheme(NVFP4_WEIGHT, NVFP4_ACT),
              [("weight", "weight", False), ("weight_scale", "weight_scale", False),
               ("weight_global_scale", "weight_scale_2", False), ("input_global_scale", "input_scale", False)]),
    "W4A16_NVFP4": (QuantScheme(NVFP4_WEIGHT, None),
                    [("weight", "weight", False), ("weight_scale", "weight_scale", False),
                     ("weight_global_scale", "weight_scale_2", False)]),
}


@BOTH_FORMS
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_every_algo_maps_to_its_scheme_and_disk_names(form, algo):
    cfg = parse(form(algo.lower()))  # quant_algo is case-insensitive
    scheme, tensors = ALGOS[algo]
    assert cfg.quant_algo == algo
    for name, kind in ((f"{ATTN}.q_proj", "linear"), ("model.layers.0.mlp.experts", "moe")):
        lq = cfg.resolve(name, kind)
        assert lq.scheme == scheme and names(lq) == tensors and algo in lq.source
    assert cfg.resolve("lm_head") is None
    assert set(LAYER_QUANTS) == set(ALGOS)


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4"])
def test_nvfp4_group_size_defaults_to_16_in_config_json_and_accepts_int_strings(algo):
    assert parse(cfgjson(algo)).resolve("x.q_proj").scheme.weight.scale.group_size == 16
    assert parse(cfgjson(algo, group_size="16")).resolve("x.q_proj") is not None
    assert parse(cfgjson(algo, group_size=16.0)).resolve("x.q_proj") is not None
    assert parse(cfgjson("FP8", group_size=128)).resolve("x.q_proj") is not None  # unused by FP8


# -- MIXED_PRECISION -------------------------------------------------------------------------------

MIXED_LAYERS = {
    f"{ATTN}.q_proj": {"quant_algo": "FP8"},
    f"{ATTN}.k_proj": {"quant_algo": "fp8"},
    f"{ATTN}.v_proj": {"quant_algo": "FP8"},
    f"{ATTN}.o_proj": {"quant_algo": "NVFP4", "group_size": 16},
    "model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4", "group_size": 16},
    "model.layers.0.mlp.experts.1.up_proj": {"quant_algo": "NVFP4"},
    "model.layers.1.self_attn.q_proj": {"quant_algo": "FP8"},
    "model.layers.1.self_attn.k_proj": {"quant_algo": "NVFP4"},
    "model.layers.1.self_attn.v_proj": {"quant_algo": "FP8"},
    "model.layers.1.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"},
    "model.layers.1.mlp.experts.1.gate_proj": {"quant_algo": "FP8"},
    "model.layers.2.self_attn.q_proj": {"quant_algo": "FP8"},
    "model.vision_tower.blocks.0.qkv": {"quant_algo": "FP8"},
}


@BOTH_FORMS
def test_mixed_precision_lookups(form):
    cfg = parse(form("MIXED_PRECISION", quantized_layers=MIXED_LAYERS, exclude_modules=["*.layers.2.*"],
                     ignore=["*.layers.2.*"]))
    fp8, nvfp4 = LAYER_QUANTS["FP8"].scheme, LAYER_QUANTS["NVFP4"].scheme
    assert cfg.resolve(f"{ATTN}.q_proj").scheme == fp8  # direct
    assert cfg.resolve(f"{ATTN}.o_proj").scheme == nvfp4
    assert names(cfg.resolve(f"{ATTN}.o_proj")) == ALGOS["NVFP4"][1]
    assert cfg.resolve(f"{ATTN}.qkv_proj").scheme == fp8  # fused, from its shards
    assert cfg.resolve("model.layers.0.mlp.experts", "moe").scheme == nvfp4  # parent prefix
    assert "MIXED_PRECISION" in cfg.resolve(f"{ATTN}.q_proj").source
    assert cfg.resolve(f"{ATTN}.rotary") is None  # not listed: unquantized
    assert cfg.resolve("model.layers.0.mlp.gate_up_proj") is None
    assert cfg.resolve("model.layers.2.self_attn.q_proj") is None  # excluded beats quantized_layers
    assert cfg.resolve("model.vision_tower.blocks.0.qkv").scheme == fp8  # no vision skip when layers are listed
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.qkv_proj"):
        cfg.resolve("model.layers.1.self_attn.qkv_proj")  # conflicting shards
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.experts.*mix quant_algo"):
        cfg.resolve("model.layers.1.mlp.experts", "moe")


def test_mixed_precision_partially_listed_fused_layer_is_an_error():
    cfg = parse(cfgjson("MIXED_PRECISION", quantized_layers={f"{ATTN}.q_proj": {"quant_algo": "FP8"}}))
    with pytest.raises(ConfigError, match="qkv_proj.*unquantized"):
        cfg.resolve(f"{ATTN}.qkv_proj")


def test_mixed_precision_group_size():
    layers = {"a.q_proj": {"quant_algo": "NVFP4", "group_size": 16}, "a.k_proj": {"quant_algo": "FP8"}}
    assert parse(cfgjson("MIXED_PRECISION", quantized_layers=layers)).resolve("a.q_proj") is not None
    # a top-level group_size only matters when some layer is NVFP4
    parse(cfgjson("MIXED_PRECISION", group_size=64, quantized_layers={"a.q_proj": {"quant_algo": "FP8"}}))
    with pytest.raises(ConfigError, match=r"quantization_config\.group_size"):
        parse(cfgjson("MIXED_PRECISION", group_size=64, quantized_layers=layers))


# -- exclude_modules / ignore ----------------------------------------------------------------------

EXCLUDE_CASES = [  # (patterns, module, excluded)
    (["lm_head"], "lm_head", True),  # exact
    (["model.layers.0.mlp.down_proj"], "model.layers.0.mlp.down_proj", True),
    ([f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj"], f"{ATTN}.qkv_proj", True),  # fused from shards
    (["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], "model.layers.0.mlp.gate_up_proj", True),
    ([f"{ATTN}.qkv_proj"], f"{ATTN}.qkv_proj", True),  # a fused name listed itself
    (["self_attn"], f"{ATTN}.o_proj", True),  # substring (pre-0.39 exports)
    (["model.layers.0.mlp"], "language_model.model.layers.0.mlp.down_proj", True),  # language_model. prefix
    (["lm_head"], "model.layers.0.mlp.down_proj", False),
    (["model.layers.*.mlp.gate"], "model.layers.7.mlp.gate", True),  # fnmatch
    (["*.mlp.gate"], "model.layers.0.mlp.gate_proj", False),
    (["model.layers.[01].self_attn.*"], f"{ATTN}.o_proj", True),
    (["model.layers.[01].self_attn.*"], "model.layers.2.self_attn.o_proj", False),
    (["model.layers.0.mlp.experts*"], "model.layers.0.mlp.experts", True),  # x* -> x and x.*
    (["model.layers.0.mlp.experts*"], "model.layers.0.mlp.experts.3.up_proj", True),
    (["model.*.mlp*"], "model.layers.0.mlp", True),
    (["model.*.mlp*"], "model.layers.0.mlp.down_proj", True),
    (["model.*.mlp*"], "model.layers.0.mlp_extra.down_proj", False),  # what the split changes
    (["*lm_head*"], "model.lm_head_extra", False),
    (["*lm_head*"], "lm_head", True),
    (["Model.Layers.*"], f"{ATTN}.o_proj", False),  # case-sensitive
    ([], "lm_head", False),
    (None, f"{ATTN}.o_proj", False),
]


@BOTH_FORMS
@pytest.mark.parametrize("patterns,module,excluded", EXCLUDE_CASES)
def test_exclude_rules(form, patterns, module, excluded):
    cfg = parse(form("FP8", exclude_modules=patterns, ignore=patterns))
    assert (cfg.resolve(module) is None) == excluded
    assert cfg.is_excluded(module) == excluded


def test_exclude_applies_to_experts_modules():
    cfg = parse(legacy("FP8", exclude_modules=["model.layers.0.mlp.experts*"]))
    assert cfg.resolve("model.layers.0.mlp.experts", "moe") is None
    assert cfg.resolve("model.layers.1.mlp.experts", "moe") is not None


def test_split_subtree_patterns():
    assert split_subtree_patterns(["a*", "a.*", "*", "ab", "a**"]) == ["a", "a.*", "a.*", "*", "ab", "a*", "a*.*"]


def test_partially_excluded_fused_layer_is_an_error():
    cfg = parse(legacy("FP8", exclude_modules=[f"{ATTN}.q_proj"]))
    with pytest.raises(ConfigError, match=r"self_attn\.qkv_proj.*some but not all"):
        cfg.resolve(f"{ATTN}.qkv_proj")


@pytest.mark.parametrize("module", ["model.vision_tower.layers.0.qkv", "visual.vision_model.encoder.fc1"])
def test_vision_modules_are_skipped(module):
    assert parse(cfgjson("NVFP4", ignore=[])).resolve(module) is None


# -- KV cache --------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,dtype", [
    (legacy(kv_cache_quant_algo="FP8"), QDtype.FP8_E4M3),
    (legacy(kv_cache_quant_algo="fp8"), QDtype.FP8_E4M3),
    (legacy(kv_cache_quant_algo="NVFP4"), QDtype.FP4_E2M1),
    (legacy(kv_cache_quant_algo=None), None),
    (legacy(kv_cache_quant_algo=""), None),
    (cfgjson(kv_cache_scheme={"type": "float", "num_bits": 8, "dynamic": False}), QDtype.FP8_E4M3),
    (cfgjson(kv_cache_scheme={"type": "float", "num_bits": 4}), QDtype.FP4_E2M1),
    (cfgjson(kv_cache_scheme=None), None),
    (cfgjson(kv_cache_quant_algo="FP8"), QDtype.FP8_E4M3),
    (cfgjson("MIXED_PRECISION", kv_cache_scheme={"type": "float", "num_bits": 8},
             quantized_layers={"a": {"quant_algo": "FP8"}}), QDtype.FP8_E4M3),
    (cfgjson(kv_cache_scheme="NVFP4"), QDtype.FP4_E2M1),  # ModelOpt names every algorithm but FP8 this way
])
def test_kv_cache(config, dtype):
    cfg = parse(config)
    if dtype is None:
        assert cfg.kv_cache is None
    else:
        assert cfg.kv_cache.dtype is dtype and cfg.kv_cache.scale_names == ("k_proj.k_scale", "v_proj.v_scale")
        assert cfg.kv_cache.source.startswith("modelopt") and dtype.value in cfg.describe()


# -- malformed configs -----------------------------------------------------------------------------

def _drop(config, key):
    config = copy.deepcopy(config)
    del config["quantization"][key]
    return config


MALFORMED = [  # (id, config, substrings the message must contain)
    ("not-a-dict", ["FP8"], ["quantization_config", "list"]),
    ("quantization-not-dict", {"quantization": "FP8"}, ["quantization", "str"]),
    ("quantization-null", {"quantization": None}, ["quantization", "NoneType"]),
    ("algo-missing-legacy", {"quantization": {}}, ["quantization.quant_algo", "missing", "NVFP4"]),
    ("algo-missing-json", {"quant_method": "modelopt"}, ["quantization_config.quant_algo", "missing"]),
    ("algo-empty", cfgjson(""), ["quantization_config.quant_algo"]),
    ("algo-int", cfgjson(8), ["quantization_config.quant_algo", "int"]),
    ("algo-list", legacy(["FP8"]), ["quantization.quant_algo", "list"]),
    ("algo-unknown-legacy", legacy("INT4_AWQ"), ["quantization.quant_algo", "INT4_AWQ", "FP8_PB_WO", "MIXED_PRECISION"]),
    ("algo-unknown-json", cfgjson("fp16"), ["quantization_config.quant_algo", "fp16", "W4A16_NVFP4"]),
    ("exclude-str", legacy(exclude_modules="lm_head"), ["quantization.exclude_modules", "list"]),
    ("exclude-dict", legacy(exclude_modules={"lm_head": 1}), ["quantization.exclude_modules", "dict"]),
    ("exclude-item-int", legacy(exclude_modules=["lm_head", 3]), ["quantization.exclude_modules[1]", "str"]),
    ("ignore-str", cfgjson(ignore="lm_head"), ["quantization_config.ignore", "list"]),
    ("ignore-item-null", cfgjson(ignore=[None]), ["quantization_config.ignore[0]"]),
    ("ignore-item-empty", cfgjson(ignore=["lm_head", ""]), ["quantization_config.ignore[1]", "empty"]),
    ("group-size-str", cfgjson("NVFP4", group_size="sixteen"), ["quantization_config.group_size", "integer"]),
    ("group-size-list", legacy("NVFP4", group_size=[16]), ["quantization.group_size", "list"]),
    ("group-size-bool", legacy("NVFP4", group_size=True), ["quantization.group_size", "bool"]),
    ("group-size-float", cfgjson("FP8", group_size=16.5), ["quantization_config.group_size"]),
    ("group-size-32", legacy("NVFP4", group_size=32), ["quantization.group_size", "32", "16"]),
    ("group-size-32-w4a16", cfgjson("W4A16_NVFP4", group_size="32"), ["quantization_config.group_size", "32"]),
    ("nvfp4-legacy-missing-group", _drop(legacy("NVFP4"), "group_size"), ["quantization", "group_size", "NVFP4"]),
    ("nvfp4-legacy-missing-kv", _drop(legacy("NVFP4"), "kv_cache_quant_algo"), ["quantization", "kv_cache_quant_algo"]),
    ("mxfp8-legacy-missing-exclude", _drop(legacy("MXFP8"), "exclude_modules"), ["quantization", "exclude_modules"]),
    ("kv-int", legacy(kv_cache_quant_algo=8), ["quantization.kv_cache_quant_algo", "int"]),
    ("kv-unknown", legacy(kv_cache_quant_algo="INT8"), ["quantization.kv_cache_quant_algo", "INT8", "FP8"]),
    ("kv-json-unknown", cfgjson(kv_cache_quant_algo="fp16"), ["quantization_config.kv_cache_quant_algo", "fp16"]),
    ("kv-scheme-str", cfgjson(kv_cache_scheme="INT4"), ["quantization_config.kv_cache_scheme", "INT4", "FP8"]),
    ("kv-scheme-list", cfgjson(kv_cache_scheme=[8]), ["quantization_config.kv_cache_scheme", "dict"]),
    ("kv-scheme-int8", cfgjson(kv_cache_scheme={"type": "int", "num_bits": 8}),
     ["quantization_config.kv_cache_scheme", "int"]),
    ("kv-scheme-bits-str", cfgjson(kv_cache_scheme={"type": "float", "num_bits": "8"}),
     ["quantization_config.kv_cache_scheme", "num_bits"]),
    ("mixed-no-layers", cfgjson("MIXED_PRECISION"), ["quantization_config.quantized_layers", "non-empty"]),
    ("mixed-empty-layers", legacy("MIXED_PRECISION", quantized_layers={}), ["quantization.quantized_layers"]),
    ("mixed-layers-list", cfgjson("MIXED_PRECISION", quantized_layers=["a.q_proj"]),
     ["quantization_config.quantized_layers", "list"]),
    ("mixed-entry-str", cfgjson("MIXED_PRECISION", quantized_layers={"a.q_proj": "FP8"}),
     ["quantized_layers['a.q_proj']", "str"]),
    ("mixed-entry-no-algo", legacy("MIXED_PRECISION", quantized_layers={"a.o_proj": {"group_size": 16}}),
     ["quantization.quantized_layers['a.o_proj']", "quant_algo"]),
    ("mixed-entry-algo-int", cfgjson("MIXED_PRECISION", quantized_layers={"a.k_proj": {"quant_algo": 4}}),
     ["quantized_layers['a.k_proj'].quant_algo", "int"]),
    ("mixed-entry-pbwo", cfgjson("MIXED_PRECISION", quantized_layers={"a.v_proj": {"quant_algo": "FP8_PB_WO"}}),
     ["quantized_layers['a.v_proj'].quant_algo", "FP8_PB_WO", "NVFP4"]),
    ("mixed-entry-group-32", cfgjson("MIXED_PRECISION",
                                     quantized_layers={"a.up_proj": {"quant_algo": "NVFP4", "group_size": 32}}),
     ["quantized_layers['a.up_proj'].group_size", "32"]),
    ("mixed-entry-group-str", cfgjson("MIXED_PRECISION",
                                      quantized_layers={"a.up_proj": {"quant_algo": "NVFP4", "group_size": "x"}}),
     ["quantized_layers['a.up_proj'].group_size"]),
]


@pytest.mark.parametrize("config,expected", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_configs_name_the_key(config, expected):
    with pytest.raises(ConfigError) as info:
        parse(config)
    message = str(info.value)
    for text in expected:
        assert text in message, (text, message)
    assert "Fix:" in message


def test_malformed_cases_are_many_and_distinct():
    assert len({c[0] for c in MALFORMED}) == len(MALFORMED) >= 25


# -- fuzzing: only ConfigError may escape ----------------------------------------------------------

KEYS = ["quantization", "quant_algo", "kv_cache_quant_algo", "exclude_modules", "ignore", "group_size",
        "quantized_layers", "kv_cache_scheme", "type", "num_bits", "quant_method", "producer"]
ALGO_WORDS = ["FP8", "fp8", "NVFP4", "W4A16_NVFP4", "MXFP8", "FP8_PB_WO", "FP8_PER_CHANNEL_PER_TOKEN",
              "MIXED_PRECISION", "float", "lm_head", "*", "x*", "", f"{ATTN}.q_proj", "model.layers.0.mlp.experts"]
json_values = fuzz.json_values(KEYS, ALGO_WORDS, ints=(-2**70, 2**70), text_size=12, key_size=8)

SEEDS = [legacy(a) for a in ALGOS] + [cfgjson(a) for a in ALGOS] + [
    cfgjson("MIXED_PRECISION", quantized_layers=MIXED_LAYERS, kv_cache_scheme={"type": "float", "num_bits": 8})]
for _ckpt in REAL:
    if (TESTDATA / _ckpt).is_dir():
        SEEDS += [json.load(open(TESTDATA / _ckpt / "hf_quant_config.json")),
                  json.loads((TESTDATA / _ckpt / "config.json").read_text())["quantization_config"]]

PROBES = [f"{ATTN}.q_proj", f"{ATTN}.qkv_proj", "model.layers.0.mlp.gate_up_proj", "lm_head",
          "model.vision_tower.x", "model.layers.0.mlp.experts.0.gate_proj"]

# parse + resolve; returns normally or raises ConfigError, never anything else
exercise = partial(fuzz.exercise, parse, probes=PROBES, moe_probe="model.layers.0.mlp.experts", errors=ConfigError)


@fuzz.FUZZ
@given(fuzz.config_dicts(KEYS, json_values))
def test_fuzz_arbitrary_dicts(config):
    exercise(config)


@fuzz.FUZZ
@given(json_values)
def test_fuzz_arbitrary_json(config):
    exercise(config)


@fuzz.FUZZ
@given(st.data())
def test_fuzz_mutated_real_configs(data):
    exercise(fuzz.draw_mutated(data, SEEDS, KEYS, json_values, max_depth=4))
