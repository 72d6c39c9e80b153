"""qcompile's own config for quantizing a bf16 / fp16 checkpoint while loading: ``quant_method: "online"``.

Spec: vLLM's ``quantization/online/fp8.py``::

    {"quant_method": "online", "scheme": "fp8_per_tensor" | "fp8_per_block",
     "ignore": [...], "block_size": 128}

* ``fp8_per_tensor``: one fp32 scale per weight (amax / 448), activations quantized dynamically per
  tensor (vLLM's MoE path and its non-CUTLASS Linear path; per-token is a kernel choice).
* ``fp8_per_block``: one scale per ``block_size`` x ``block_size`` weight tile (vLLM: 128x128),
  activations dynamically per 1 x ``block_size`` group. ``block_size`` is only valid here.
* ``ignore``: exact module names, ``re:<regex>`` (``re.match``, as compressed-tensors) and fnmatch
  globs. :data:`DEFAULT_IGNORE` is always added. Every other ``nn.Linear`` is quantized; fused layers
  and MoE experts (``kind="moe"``) resolve as in compressed-tensors: an own ignore entry, else the
  shards / expert 0's projections, which must agree.

The checkpoint holds only ``weight`` (bf16 / fp16); the loader quantizes it (``LayerQuant.online``).
"""

from __future__ import annotations

from typing import Any

from ..scheme import LayerQuant, QuantScheme, TensorSpec, fp8_scheme
from .base import ModuleKind, NamePattern, QuantConfig, need, require_type, shard_names

ROOT = "quantization_config"
SCHEMES = ("fp8_per_tensor", "fp8_per_block")
DEFAULT_BLOCK = 128
KEYS = ("quant_method", "scheme", "ignore", "block_size")
# vLLM never quantizes lm_head online (ParallelLMHead gets no quant method), and MoE routers
# (``mlp.gate``) are built unquantized (``quant_config=None``); both stay in the model dtype.
DEFAULT_IGNORE = ("lm_head", "*.lm_head", "*.mlp.gate")


def online_config(scheme: str = "fp8_per_tensor", ignore=(), block_size: int = DEFAULT_BLOCK) -> dict:
    """The ``{"quant_method": "online", ...}`` dict for ``scheme``; ``block_size`` is written for
    ``fp8_per_block`` only. Raises ConfigError for a bad argument (it is parsed once here)."""
    config: dict[str, Any] = {"quant_method": "online", "scheme": scheme,
                              "ignore": list(ignore) if isinstance(ignore, (list, tuple)) else ignore}
    if scheme == "fp8_per_block":
        config["block_size"] = block_size
    parse(config)
    return config


class OnlineConfig(QuantConfig):
    """``layer``: the LayerQuant of every quantized layer; ``ignore``: user entries + DEFAULT_IGNORE."""

    format = "online"

    def __init__(self, raw: dict, scheme: str, layer: LayerQuant, ignore: list[NamePattern]):
        super().__init__(raw, kv_cache=None)
        self.scheme, self.layer, self.ignore = scheme, layer, ignore

    def describe(self) -> str:
        return f"online {self.scheme} ({self.layer.scheme.key})"

    def is_ignored(self, name: str) -> bool:
        return any(p.matches(name) for p in self.ignore)

    def _resolve(self, name: str, kind: ModuleKind) -> LayerQuant | None:
        if self.is_ignored(name):
            return None
        if shard_names(name):
            return self.resolve_fused(name, kind, lambda n: None if n == name else self.resolve(n, "linear"))
        return self.layer

    def _resolve_moe(self, name: str, projections: tuple[str, str, str]) -> LayerQuant | None:
        return None if self.is_ignored(name) else super()._resolve_moe(name, projections)


def parse(config: dict[str, Any]) -> OnlineConfig:
    """Parse an online config (module docstring); every problem is a ConfigError naming the key."""
    require_type(config, dict, ROOT, "an online quantization config",
                 '{"quant_method": "online", "scheme": "fp8_per_tensor"}')
    for key in config:
        need(key in KEYS, f"{ROOT}.{key}", f"unknown key {key!r:.80}", f"an online config has only {list(KEYS)}")
    method = config.get("quant_method", "online")
    need(isinstance(method, str) and method.lower() == "online", f"{ROOT}.quant_method",
         f"quant_method is {method!r:.60}, not online", 'set "quant_method": "online"')
    scheme = config.get("scheme")
    need(scheme in SCHEMES, f"{ROOT}.scheme", f"unknown online scheme {scheme!r:.60}", f"use one of {list(SCHEMES)}")
    block = config.get("block_size")
    if scheme == "fp8_per_block":
        block = DEFAULT_BLOCK if block is None else require_type(block, int, f"{ROOT}.block_size", "block_size",
                                                                 "a positive integer, e.g. 128")
        need(block > 0, f"{ROOT}.block_size", f"block_size {block} is not positive", "e.g. 128")
        qscheme: QuantScheme = fp8_scheme("block", "dynamic_group", block=block)
    else:
        need(block is None, f"{ROOT}.block_size", "block_size applies to fp8_per_block only",
             'drop block_size or use "scheme": "fp8_per_block"')
        qscheme = fp8_scheme("tensor", "dynamic_tensor")
    ignore = [] if config.get("ignore") is None else config["ignore"]
    require_type(ignore, list, f"{ROOT}.ignore", "ignore", 'a list of module names, "re:" regexes or fnmatch globs')
    patterns = [NamePattern.compile(p, f"{ROOT}.ignore[{i}]", globs=True) for i, p in enumerate(ignore)]
    patterns += [NamePattern.compile(p, "DEFAULT_IGNORE", globs=True) for p in DEFAULT_IGNORE]
    layer = LayerQuant(qscheme, (TensorSpec("weight", "weight"),), source=f"online {scheme}", online=True)
    return OnlineConfig(config, scheme, layer, patterns)
