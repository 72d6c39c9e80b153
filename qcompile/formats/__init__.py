"""Checkpoint-format parsers. Each module has ``parse(config: dict) -> QuantConfig``; this package
picks one by the config's ``quant_method``."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import FUSED_SHARDS, QuantConfig, shard_names

PARSERS = {
    "modelopt": "modelopt",
    "compressed-tensors": "compressed_tensors",
    "quark": "quark",
    "online": "online",
    "mxfp4": "mxfp4",
}


def parse_quant_config(config: Any) -> QuantConfig:
    """Parse a checkpoint's quantization config (the ``quantization_config`` of config.json, a
    ModelOpt ``hf_quant_config.json`` dict, gpt-oss's ``{"quant_method": "mxfp4", ...}``, or qcompile's
    own ``{"quant_method": "online", ...}``)."""
    import importlib

    if not isinstance(config, dict):
        raise ConfigError(f"a quantization config must be a JSON object, got {type(config).__name__}",
                          where="quantization_config", fix="check config.json / hf_quant_config.json")
    method = config.get("quant_method")
    if method is None and isinstance(config.get("quantization"), dict) and "producer" in config:
        method = "modelopt"  # a bare hf_quant_config.json has no quant_method
    if not isinstance(method, str) or method.lower() not in PARSERS:
        raise ConfigError(
            f"unknown quant_method {method!r}",
            where="quantization_config.quant_method",
            fix=f"qcompile reads {sorted(PARSERS)}; other methods load with plain transformers",
        )
    module = importlib.import_module(f".{PARSERS[method.lower()]}", __name__)
    return module.parse(config)


__all__ = ["parse_quant_config", "QuantConfig", "FUSED_SHARDS", "shard_names"]
