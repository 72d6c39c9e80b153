"""qcompile.formats.online against vLLM's online FP8 methods (reference 002)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qcompile.errors import ConfigError, QCompileError
from qcompile.formats import parse_quant_config
from qcompile.formats.online import DEFAULT_IGNORE, OnlineConfig, online_config, parse
from qcompile.scheme import ActSpec, Granularity, QDtype, QuantScheme, ScaleSpec, WeightSpec, fp8_scheme
from tests.formats import fuzz

L0 = "model.layers.0"


def test_online_config_dicts():
    assert online_config() == {"quant_method": "online", "scheme": "fp8_per_tensor", "ignore": []}
    assert online_config("fp8_per_block", ignore=("re:.*down_proj",)) == {
        "quant_method": "online", "scheme": "fp8_per_block", "ignore": ["re:.*down_proj"], "block_size": 128}
    with pytest.raises(ConfigError, match="quantization_config.scheme"):
        online_config("int8_per_tensor")


def test_per_tensor():
    """Fp8PerTensorOnline*: static per-tensor weight scale, dynamic per-tensor activations."""
    cfg = parse_quant_config(online_config("fp8_per_tensor"))
    assert isinstance(cfg, OnlineConfig) and cfg.format == "online" and cfg.kv_cache is None
    lq = cfg.resolve(f"{L0}.self_attn.q_proj")
    assert lq.online and lq.scheme == fp8_scheme("tensor", "dynamic_tensor")
    assert [(t.role, t.name) for t in lq.tensors] == [("weight", "weight")]
    assert lq.source == "online fp8_per_tensor" and "fp8_per_tensor" in cfg.describe()


def test_per_block():
    """Fp8PerBlockOnline*: 128x128 weight blocks, activations dynamic per 1x128 group."""
    lq = parse(online_config("fp8_per_block")).resolve(f"{L0}.mlp.down_proj")
    assert lq.online and lq.scheme == fp8_scheme("block", "dynamic_group")
    custom = parse({"quant_method": "online", "scheme": "fp8_per_block", "block_size": 64})
    assert custom.resolve("x.up_proj").scheme == QuantScheme(
        WeightSpec(QDtype.FP8_E4M3, ScaleSpec(Granularity.BLOCK, block=(64, 64))),
        ActSpec(QDtype.FP8_E4M3, True, ScaleSpec(Granularity.GROUP, group_size=64)))


def test_ignore_and_defaults():
    cfg = parse(online_config(ignore=["model.layers.1.mlp.up_proj", "re:.*self_attn\\.o_proj", "*.layers.2.*"]))
    assert cfg.resolve("model.layers.1.mlp.up_proj") is None
    assert cfg.resolve(f"{L0}.self_attn.o_proj") is None
    assert cfg.resolve("model.layers.2.mlp.gate_proj") is None
    assert cfg.resolve("model.layers.1.mlp.gate_proj") is not None
    assert "lm_head" in DEFAULT_IGNORE
    for name in ("lm_head", "model.lm_head", f"{L0}.mlp.gate"):  # DEFAULT_IGNORE
        assert cfg.resolve(name) is None
    assert cfg.resolve(f"{L0}.mlp.gate_proj") is not None


def test_fused_and_moe():
    cfg = parse(online_config(ignore=["re:.*k_proj"]))
    assert cfg.resolve(f"{L0}.mlp.gate_up_proj") is not None
    with pytest.raises(ConfigError, match="different quantization"):
        cfg.resolve(f"{L0}.self_attn.qkv_proj")
    assert parse(online_config(ignore=["*qkv_proj"])).resolve(f"{L0}.self_attn.qkv_proj") is None
    assert parse(online_config()).resolve(f"{L0}.mlp.experts", "moe").online
    assert parse(online_config(ignore=["*.experts"])).resolve(f"{L0}.mlp.experts", "moe") is None
    with pytest.raises(ConfigError, match="expert projections"):
        parse(online_config(ignore=["*.experts.*.down_proj"])).resolve(f"{L0}.mlp.experts", "moe")


BASE = {"quant_method": "online", "scheme": "fp8_per_block", "ignore": [], "block_size": 128}
MALFORMED = [
    ({**BASE, "scheme": None}, "scheme"),
    ({**BASE, "scheme": "fp8"}, "scheme"),
    ({**BASE, "scheme": ["fp8_per_tensor"]}, "scheme"),
    ({**BASE, "block_size": 0}, "block_size"),
    ({**BASE, "block_size": "128"}, "block_size"),
    ({**BASE, "block_size": True}, "block_size"),
    ({**BASE, "scheme": "fp8_per_tensor"}, "block_size"),  # block_size is per-block only
    ({**BASE, "ignore": "lm_head"}, "ignore"),
    ({**BASE, "ignore": ["lm_head", None]}, "ignore[1]"),
    ({**BASE, "ignore": [""]}, "ignore[0]"),
    ({**BASE, "ignore": ["re:*"]}, "ignore[0]"),
    ({**BASE, "quant_method": "fp8"}, "quant_method"),
    ({**BASE, "blocksize": 128}, "blocksize"),
]


@pytest.mark.parametrize("config,key", MALFORMED, ids=[f"{i}-{m[1]}" for i, m in enumerate(MALFORMED)])
def test_malformed(config, key):
    with pytest.raises(ConfigError) as info:
        parse(copy.deepcopy(config))
    assert f"quantization_config.{key}" in str(info.value) and info.value.fix


KEYS = ["quant_method", "scheme", "ignore", "block_size"]
WORDS = ["online", "fp8_per_tensor", "fp8_per_block", "lm_head", "re:(", "re:.*", "*", "[", "*proj"]
json_scalars = fuzz.json_scalars(WORDS)
json_values = fuzz.json_values(KEYS, WORDS, dict_size=4, max_leaves=12)
PROBES = [f"{L0}.self_attn.qkv_proj", "lm_head", f"{L0}.mlp.down_proj"]
exercise = partial(fuzz.exercise, parse, probes=PROBES, moe_probe=f"{L0}.mlp.experts")


@fuzz.FUZZ
@given(fuzz.config_dicts(KEYS, json_values, key_size=6, max_size=5))
def test_fuzz_arbitrary_dicts(config):
    exercise(config)


@fuzz.FUZZ
@given(st.sampled_from([online_config(), online_config("fp8_per_block")]), st.sampled_from(KEYS), json_values)
def test_fuzz_mutated_configs(config, key, value):
    exercise({**config, key: value})


@fuzz.FUZZ
@given(st.sampled_from(["fp8_per_tensor", "fp8_per_block"]), st.lists(json_scalars, max_size=4),
       st.integers(-2, 300))
def test_fuzz_online_config(scheme, ignore, block_size):
    try:
        config = online_config(scheme, ignore=ignore, block_size=block_size)
    except QCompileError:
        return
    exercise(config)
