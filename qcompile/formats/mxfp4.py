"""gpt-oss checkpoints as OpenAI publishes them: ``quant_method: "mxfp4"`` (transformers' ``Mxfp4Config``)::

    {"quant_method": "mxfp4",
     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                "lm_head"]}

Only MoE experts are quantized, as transformers' ``replace_with_mxfp4_linear`` does: every experts module that
no ``modules_to_not_convert`` entry matches; every Linear stays in the model dtype. A pattern matches as
transformers 5.24's ``should_convert_module``: as a regex from the start of the module name up to a module
boundary (``model.layers.1`` matches ``model.layers.1.mlp.experts``, not ``model.layers.11...``, which
transformers 5.17's rule still matched; ``*`` is the regex repeat), or as a suffix of the name.

The experts are stored fused per parameter of the transformers experts module, in its row order (gpt-oss:
gate and up interleaved along 2I, even rows gate) but not transposed ([E, N, K]), relative to the experts
module (:attr:`QuantConfig.fused_experts`):

============================  =================================================================
``gate_up_proj_blocks``       uint8 [E, 2I, H/32, 16]: e2m1 codes, two per byte, the low nibble the even element
``gate_up_proj_scales``       uint8 [E, 2I, H/32]: e8m0, one per 32 elements, 2^(byte - 127)
``gate_up_proj_bias``         float [E, 2I]
``down_proj_blocks`` / ...    the same for ``down_proj`` ([E, H, I/32, 16], [E, H, I/32], [E, H])
============================  =================================================================

That is the MXFP4 weight-only scheme of Quark and compressed-tensors (:data:`~qcompile.scheme.MXFP4_WEIGHT`),
each row's bytes split per scale group (``TensorSpec.blocks``). ``dequantize`` (a transformers loading option)
is accepted and not read: qcompile keeps the quantized storage. Other keys are allowed (transformers ignores
them too).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError
from ..scheme import MXFP4_WEIGHT, LayerQuant, QuantScheme, TensorSpec
from .base import ModuleKind, QuantConfig, backtracking_risk, need, require_type

ROOT = "quantization_config"
BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"  # transformers' should_convert_module
EXPERTS = LayerQuant(QuantScheme(MXFP4_WEIGHT), (TensorSpec("weight", "blocks", blocks=True),
                                                 TensorSpec("weight_scale", "scales")), source="mxfp4 (gpt-oss)")


class Mxfp4Config(QuantConfig):
    """``not_converted``: (entry, compiled regex) of ``modules_to_not_convert``."""

    format = "mxfp4"
    fused_experts = True

    def __init__(self, raw: dict, not_converted: list[tuple[str, re.Pattern]]):
        super().__init__(raw, kv_cache=None)
        self.not_converted = not_converted

    def describe(self) -> str:
        return f"mxfp4 (experts {EXPERTS.scheme.key}; {len(self.not_converted)} modules_to_not_convert entries)"

    def converts(self, name: str) -> bool:
        return not any(regex.match(name) or name.endswith(text) for text, regex in self.not_converted)

    def _resolve(self, name: str, kind: ModuleKind) -> LayerQuant | None:
        return None  # linears are never quantized by this format

    def _resolve_moe(self, name: str, projections: tuple[str, str, str]) -> LayerQuant | None:
        return EXPERTS if self.converts(name) else None


def parse(config: dict[str, Any]) -> Mxfp4Config:
    """Parse an mxfp4 config (module docstring); every problem is a ConfigError naming the key."""
    require_type(config, dict, ROOT, "an mxfp4 quantization config", '{"quant_method": "mxfp4"}')
    method = config.get("quant_method")
    need(isinstance(method, str) and method.lower() == "mxfp4", f"{ROOT}.quant_method",
         f"quant_method is {method!r:.60}, not mxfp4", 'set "quant_method": "mxfp4"')
    if config.get("dequantize") is not None:
        require_type(config["dequantize"], bool, f"{ROOT}.dequantize", "dequantize", "true or false")
    entries = config.get("modules_to_not_convert")
    entries = [] if entries is None else entries
    require_type(entries, list, f"{ROOT}.modules_to_not_convert", "modules_to_not_convert",
                 'a list of module-name regexes, e.g. ["model.layers.*.self_attn", "lm_head"]')
    not_converted = []
    for i, text in enumerate(entries):
        where = f"{ROOT}.modules_to_not_convert[{i}]"
        require_type(text, str, where, "an entry", "a module name or regex")
        need(bool(text), where, "the entry is empty", "a module name or regex")
        try:
            risk = backtracking_risk(text)
            regex = None if risk else re.compile(f"(?:{text}){BOUNDARY}")
        except (re.error, RecursionError, OverflowError) as e:
            raise ConfigError(f"invalid regex {text!r:.80} ({e})", where=where, fix="a module name or regex") from None
        need(risk is None, where, f"the pattern {text!r:.80} can backtrack for hours on one name: {risk}",
             "simplify it: no repeat inside a repeat, no alternatives starting alike under a repeat")
        not_converted.append((text, regex))
    return Mxfp4Config(config, not_converted)
