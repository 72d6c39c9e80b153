"""qcompile.formats.mxfp4 against transformers' Mxfp4Config / Mxfp4HfQuantizer (gpt-oss's own checkpoints):
the experts get the MXFP4 weight-only scheme, stored fused; linears never; modules_to_not_convert as
transformers' should_convert_module matches them."""

from __future__ import annotations

import copy
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import ConfigError
from qcompile.formats import parse_quant_config
from qcompile.formats.mxfp4 import Mxfp4Config, parse
from qcompile.scheme import MXFP4_WEIGHT, QuantScheme
from tests.formats import fuzz

L0 = "model.layers.0"
# gpt-oss-20b / -120b's config.json
OPENAI = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def test_experts_only():
    cfg = parse_quant_config(OPENAI)
    assert isinstance(cfg, Mxfp4Config) and cfg.format == "mxfp4" and cfg.fused_experts and cfg.kv_cache is None
    lq = cfg.resolve(f"{L0}.mlp.experts", "moe")
    assert lq.scheme == QuantScheme(MXFP4_WEIGHT) and not lq.online
    assert [(t.role, t.name, t.blocks) for t in lq.tensors] == [("weight", "blocks", True),
                                                                ("weight_scale", "scales", False)]
    for linear in (f"{L0}.self_attn.q_proj", f"{L0}.mlp.router", "lm_head", f"{L0}.mlp.down_proj"):
        assert cfg.resolve(linear) is None
    assert parse({"quant_method": "mxfp4"}).resolve(f"{L0}.mlp.experts", "moe") == lq
    assert parse({"quant_method": "MXFP4", "dequantize": False}).resolve(f"{L0}.mlp.experts", "moe") == lq


@pytest.mark.parametrize("entry,excluded,kept", [
    ("model.layers.1", ["model.layers.1.mlp.experts"], ["model.layers.11.mlp.experts"]),  # module boundary
    ("model.layers.*.mlp", ["model.layers.3.mlp.experts"], ["model.mlp_layers.3.experts"]),  # a regex
    ("mlp.experts", ["model.layers.0.mlp.experts"], []),  # a suffix
    ("model.layers.[02].mlp.experts", ["model.layers.2.mlp.experts"], ["model.layers.1.mlp.experts"]),
])
def test_modules_to_not_convert_as_transformers(entry, excluded, kept):
    from transformers.quantizers.quantizers_utils import should_convert_module

    cfg = parse({"quant_method": "mxfp4", "modules_to_not_convert": [entry]})
    # transformers' own rule (before 5.24 it had no module boundary: "model.layers.1" matched layer 11 too)
    bounded = should_convert_module("model.layers.11.mlp.experts", ["model.layers.1"])
    for name in excluded + kept:
        if bounded:
            assert should_convert_module(name, [entry]) == (name in kept), name
        assert (cfg.resolve(name, "moe") is not None) == (name in kept), name


MALFORMED = [
    ({**OPENAI, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
    ({**OPENAI, "modules_to_not_convert": ["lm_head", 3]}, "modules_to_not_convert[1]"),
    ({**OPENAI, "modules_to_not_convert": [""]}, "modules_to_not_convert[0]"),
    ({**OPENAI, "modules_to_not_convert": ["(lm_head"]}, "modules_to_not_convert[0]"),
    ({**OPENAI, "modules_to_not_convert": ["(a+)+b"]}, "modules_to_not_convert[0]"),  # would backtrack
    ({**OPENAI, "dequantize": "yes"}, "dequantize"),
    ({**OPENAI, "quant_method": "fp4"}, "quant_method"),
]


@pytest.mark.parametrize("config,key", MALFORMED, ids=[f"{i}-{m[1]}" for i, m in enumerate(MALFORMED)])
def test_malformed(config, key):
    with pytest.raises(ConfigError) as info:
        parse(copy.deepcopy(config))
    assert f"quantization_config.{key}" in str(info.value) and info.value.fix


KEYS = ["quant_method", "modules_to_not_convert", "dequantize"]
WORDS = ["mxfp4", "lm_head", "model.layers.*.self_attn", "(", ".*", "*", "[", "(a|ab)*", "experts"]
json_values = fuzz.json_values(KEYS, WORDS, dict_size=4, max_leaves=12)
PROBES = [f"{L0}.self_attn.q_proj", "lm_head"]
exercise = partial(fuzz.exercise, parse, probes=PROBES, moe_probe=f"{L0}.mlp.experts")


@fuzz.FUZZ
@given(fuzz.config_dicts(KEYS, json_values, key_size=6, max_size=4))
def test_fuzz_arbitrary_dicts(config):
    with fuzz.bounded(seconds=5):
        exercise(config)


@fuzz.FUZZ
@given(st.sampled_from(KEYS), json_values)
def test_fuzz_mutated_configs(key, value):
    with fuzz.bounded(seconds=5):
        exercise({**OPENAI, key: value})


@fuzz.FUZZ
@given(st.lists(st.sampled_from(WORDS) | st.text(max_size=8), max_size=5))
def test_fuzz_patterns(entries):
    with fuzz.bounded(seconds=5):
        exercise({"quant_method": "mxfp4", "modules_to_not_convert": entries})
