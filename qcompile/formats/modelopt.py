"""NVIDIA ModelOpt checkpoints (spec: vLLM's ``quantization/modelopt.py``).

Two spellings of one config are accepted:

* the legacy ``hf_quant_config.json``: ``{"producer": ..., "quantization": {"quant_algo",
  "kv_cache_quant_algo", "exclude_modules", "group_size", "quantized_layers"}}`` (error keys
  ``quantization.*``);
* config.json's ``quantization_config``: ``{"quant_method": "modelopt", "quant_algo", "ignore",
  "kv_cache_scheme", "group_size", "quantized_layers", ...}`` (error keys ``quantization_config.*``;
  its compressed-tensors style ``config_groups`` only restate ``quant_algo`` and are not read).

One ``quant_algo`` (case-insensitive) applies to every layer not excluded, except ``MIXED_PRECISION``
whose ``quantized_layers`` maps module names to a per-layer ``FP8`` / ``NVFP4`` (vLLM builds no other
per-layer method). On-disk tensors are named after the module (``q_proj.weight_scale``), in these
conventions (all scalars are 0-d fp32):

=========================  ===================================================================
FP8                        fp8 weight, per-tensor ``weight_scale``, static ``input_scale``
FP8_PER_CHANNEL_PER_TOKEN  fp8 weight, ``weight_scale`` [N]; activations dynamic per token
FP8_PB_WO                  fp8 weight, ``weight_scale`` [N/128, 1, K/128, 1]; activations dynamic 1x128
MXFP8                      fp8 weight, e8m0 ``weight_scale`` (uint8) [N, K/32]; activations dynamic MXFP8
NVFP4                      uint8 weight (2 e2m1 / byte), fp8 ``weight_scale`` [N, K/16], fp32
                           ``weight_scale_2`` and ``input_scale`` global scales, both *multiplying*
W4A16_NVFP4                NVFP4 weight tensors, bf16 activations (an ``input_scale`` on disk is unused)
=========================  ===================================================================

A KV-cache algorithm (``kv_cache_quant_algo`` / ``kv_cache_scheme``: FP8 or NVFP4) stores per layer
``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale``: fp32 0-d, the calibrated amax / 448.
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

from ..errors import ConfigError
from ..scheme import (MXFP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, KVCacheSpec, LayerQuant, QDtype, QuantScheme,
                      TensorSpec, fp8_scheme, mx_act)
from .base import ModuleKind, QuantConfig, require_type, shard_names

NVFP4_GROUP_SIZE = 16  # every NVFP4 kernel of the reference hard-codes 16 (``in_features % 16``)
MIXED = "MIXED_PRECISION"
MIXED_LAYER_ALGOS = ("FP8", "NVFP4")  # what ModelOptMixedPrecisionConfig dispatches per layer
KV_CACHE_ALGOS = {"FP8": QDtype.FP8_E4M3, "NVFP4": QDtype.FP4_E2M1}
# ModelOpt's HF export renames the attention's k/v_bmm_quantizer amax to these, divided by 448 for
# every KV-cache algorithm (fp32, 0-d): relative to the attention module, as vLLM remaps them.
KV_SCALE_NAMES = ("k_proj.k_scale", "v_proj.v_scale")
VISION_MARKERS = ("vision_tower", "vision_model")  # skipped outright, for pre-0.39 ModelOpt exports

_WEIGHT = TensorSpec("weight", "weight")
_SCALE = TensorSpec("weight_scale", "weight_scale")
# weight_scale_2 = amax / (6 * 448) multiplies as stored (no reciprocal, unlike compressed-tensors).
_NVFP4_GLOBAL = TensorSpec("weight_global_scale", "weight_scale_2")
# ModelOpt's NVFP4 input_scale is amax / (6 * 448) too: ModelOptNvFp4LinearMethod builds the output
# scale alpha = input_scale * weight_scale_2 and hands 1 / input_scale to the activation quantizer,
# so it already is the canonical multiplying global scale and is read without reciprocal.
_NVFP4_INPUT_GLOBAL = TensorSpec("input_global_scale", "input_scale")


def _lq(algo: str, scheme: QuantScheme, *tensors: TensorSpec) -> LayerQuant:
    return LayerQuant(scheme, (_WEIGHT, _SCALE) + tensors, source=f"modelopt {algo}")


# quant_algo -> the quantization of every layer it covers.
LAYER_QUANTS: dict[str, LayerQuant] = {
    "FP8": _lq("FP8", fp8_scheme("tensor", "static_tensor"), TensorSpec("input_scale", "input_scale")),
    "FP8_PER_CHANNEL_PER_TOKEN": _lq("FP8_PER_CHANNEL_PER_TOKEN", fp8_scheme("channel", "dynamic_token")),
    # 128x128 weight blocks; vLLM's Fp8PbWo method quantizes activations dynamically per 1x128 group.
    "FP8_PB_WO": _lq("FP8_PB_WO", fp8_scheme("block", "dynamic_group")),
    # ModelOptMxFp8FusedMoE quantizes the hidden states with mxfp8_e4m3_quantize: W8A8 MXFP8, no
    # activation scale on disk (a weight-only Marlin kernel is a kernel choice, not the format).
    "MXFP8": _lq("MXFP8", QuantScheme(MXFP8_WEIGHT, mx_act(QDtype.FP8_E4M3))),
    "NVFP4": _lq("NVFP4", QuantScheme(NVFP4_WEIGHT, NVFP4_ACT), _NVFP4_GLOBAL, _NVFP4_INPUT_GLOBAL),
    # Global scale used as stored, no reciprocal (ModelOptNvFp4W4A16LinearMethod).
    "W4A16_NVFP4": _lq("W4A16_NVFP4", QuantScheme(NVFP4_WEIGHT, None), _NVFP4_GLOBAL),
}
QUANT_ALGOS = (*LAYER_QUANTS, MIXED)
_USES_NVFP4 = ("NVFP4", "W4A16_NVFP4")
# hf_quant_config.json keys the reference insists on per algo (config.json's form has no such check).
_LEGACY_REQUIRED = {
    "NVFP4": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
    "W4A16_NVFP4": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
    "MXFP8": ("kv_cache_quant_algo", "exclude_modules"),
}


class ModelOptConfig(QuantConfig):
    """A parsed ModelOpt config. ``quant_algo`` is upper-case; ``exclude`` is the exclude list with
    ``x*`` patterns already split (see :func:`split_subtree_patterns`); ``quantized_layers`` maps
    module name -> per-layer algo for MIXED_PRECISION, else is ``None``."""

    format = "modelopt"

    def __init__(self, raw: dict, quant_algo: str, exclude: list[str], quantized_layers: dict[str, str] | None,
                 kv_cache: KVCacheSpec | None):
        super().__init__(raw, kv_cache)
        self.quant_algo = quant_algo
        self.exclude = exclude
        self._exact = set(exclude)
        self.quantized_layers = quantized_layers

    def describe(self) -> str:
        kv = f", kv cache {self.kv_cache.dtype.value}" if self.kv_cache else ""
        return f"modelopt {self.quant_algo}{kv}"

    def is_excluded(self, name: str) -> bool:
        """The reference's ``is_layer_excluded``, in its order:

        1. exact name; a fused module (``qkv_proj``) is excluded when all its shards are, and some but
           not all shards excluded is a ConfigError;
        2. substring: any entry contained in the name (kept for pre-0.39 exports; it also covers a
           ``language_model.`` prefix the entries lack);
        3. ``fnmatch`` wildcards, case-sensitive.
        """
        shards = shard_names(name)
        if shards:
            hits = [s in self._exact for s in shards]
            if all(hits):
                return True
            if any(hits):
                excluded = [s for s, h in zip(shards, hits) if h]
                raise ConfigError(f"some but not all shards of the fused layer are excluded ({excluded})",
                                  where=name, fix="exclude all of its shards or none")
        elif name in self._exact:
            return True
        return any(p in name for p in self.exclude) or any(fnmatchcase(name, p) for p in self.exclude)

    def _resolve(self, name: str, kind: ModuleKind) -> LayerQuant | None:
        if self.is_excluded(name):
            return None
        if self.quantized_layers is None:
            if any(m in name for m in VISION_MARKERS):
                return None
            return LAYER_QUANTS[self.quant_algo]  # linear layers and fused experts alike
        return self.resolve_fused(name, kind, self._mixed_entry) or self._mixed_parent(name)

    def _resolve_moe(self, name: str, projections: tuple[str, str, str]) -> LayerQuant | None:
        """One quant_algo covers fused experts as it covers Linears (vLLM's FusedMoE method of the config);
        the exclude list and MIXED_PRECISION's entries are read for the experts module itself."""
        return self._resolve(name, "moe")

    def _mixed_entry(self, name: str) -> LayerQuant | None:
        algo = self.quantized_layers.get(name)
        return _mixed_lq(algo) if algo else None

    def _mixed_parent(self, name: str) -> LayerQuant | None:
        """A parent of listed modules (fused experts ``mlp.experts`` over ``mlp.experts.0.up_proj``...)
        takes their algo; they must agree, as one fused kernel runs them all."""
        algos = {algo for key, algo in self.quantized_layers.items() if key.startswith(name + ".")}
        if len(algos) > 1:
            raise ConfigError(f"the modules under this one mix quant_algo {sorted(algos)}", where=name,
                              fix="give every expert / child of a fused module the same quant_algo in quantized_layers")
        return _mixed_lq(algos.pop()) if algos else None


def _mixed_lq(algo: str) -> LayerQuant:
    return replace(LAYER_QUANTS[algo], source=f"modelopt {MIXED} {algo}")


# -- parsing -------------------------------------------------------------------------------------

def parse(config: dict[str, Any]) -> ModelOptConfig:
    """Parse either ModelOpt config form (module docstring); every problem is a ConfigError naming
    the key path and the fix."""
    require_type(config, dict, "quantization_config", "a ModelOpt quantization config",
                 "pass config.json's quantization_config or the hf_quant_config.json object")
    legacy = "quantization" in config
    if legacy:
        path, exclude_key = "quantization", "exclude_modules"
        section = require_type(config["quantization"], dict, path, "the quantization section",
                               'hf_quant_config.json holds {"quantization": {"quant_algo": ...}}')
    else:
        path, exclude_key, section = "quantization_config", "ignore", config

    algo = _quant_algo(section.get("quant_algo"), f"{path}.quant_algo")
    if legacy:
        missing = [k for k in _LEGACY_REQUIRED.get(algo, ()) if k not in section]
        if missing:
            raise ConfigError(f"{algo} requires the keys {missing}", where=path,
                              fix=f"add {missing} to hf_quant_config.json (null / [] when unused)")
    exclude = split_subtree_patterns(_patterns(section.get(exclude_key), f"{path}.{exclude_key}"))
    group_size = _optional_int(section.get("group_size"), f"{path}.group_size")
    # config.json's form: the reference reads kv_cache_scheme; kv_cache_quant_algo is checked too and
    # honoured without it rather than silently dropped
    kv_cache = _kv_cache_algo(section.get("kv_cache_quant_algo"), f"{path}.kv_cache_quant_algo")
    if not legacy and section.get("kv_cache_scheme") is not None:
        scheme = _kv_cache_scheme(section["kv_cache_scheme"], f"{path}.kv_cache_scheme")
        if kv_cache is not None and kv_cache.dtype != scheme.dtype:
            raise ConfigError(f"kv_cache_scheme ({scheme.dtype.value}) and kv_cache_quant_algo "
                              f"({kv_cache.dtype.value}) disagree", where=f"{path}.kv_cache_scheme",
                              fix="keep one of them, or make them name the same KV-cache format")
        kv_cache = scheme

    layers = None
    if algo == MIXED:
        layers = _quantized_layers(section.get("quantized_layers"), f"{path}.quantized_layers")
        if group_size is not None and "NVFP4" in layers.values():
            _check_nvfp4_group(group_size, f"{path}.group_size")
    elif algo in _USES_NVFP4 and group_size is not None:
        _check_nvfp4_group(group_size, f"{path}.group_size")
    return ModelOptConfig(config, algo, exclude, layers, kv_cache)


def split_subtree_patterns(patterns: list[str]) -> list[str]:
    """ModelOpt writes ``x*`` for "the module x and its whole subtree"; as in the reference's
    ``apply_vllm_mapper`` it becomes ``x`` and ``x.*`` (``*`` preceded by ``.`` is left alone)."""
    out = []
    for p in patterns:
        out.extend([p[:-1], p[:-1] + ".*"] if len(p) >= 2 and p[-1] == "*" and p[-2] != "." else [p])
    return out


def _quant_algo(value: Any, where: str) -> str:
    fix = f"set it to one of {list(QUANT_ALGOS)}"
    if value is None or value == "":
        raise ConfigError("quant_algo is missing", where=where, fix=fix)
    algo = require_type(value, str, where, "quant_algo", fix).strip().upper()
    if algo not in QUANT_ALGOS:
        raise ConfigError(f"unsupported ModelOpt quant_algo {value!r:.80}", where=where, fix=fix)
    return algo


def _patterns(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    fix = 'a list of module names / fnmatch patterns, e.g. ["lm_head", "model.layers.*.mlp.gate"]'
    require_type(value, list, where, "the exclude list", fix)
    for i, p in enumerate(value):
        require_type(p, str, f"{where}[{i}]", "an exclude entry", fix)
        if not p:  # as a substring, "" would exclude every layer
            raise ConfigError("an exclude entry is empty", where=f"{where}[{i}]", fix="remove the empty string")
    return list(value)


def _optional_int(value: Any, where: str) -> int | None:
    """None, an int, an integral float or a numeric string (the reference calls ``int()`` on it)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    return require_type(value, int, where, "group_size", "write an integer, e.g. 16")


def _check_nvfp4_group(group_size: int, where: str) -> None:
    if group_size != NVFP4_GROUP_SIZE:
        raise ConfigError(f"NVFP4 group_size {group_size} is not supported", where=where,
                          fix=f"NVFP4 scales one fp8 value per {NVFP4_GROUP_SIZE} elements; set {NVFP4_GROUP_SIZE}")


def _kv_cache_algo(value: Any, where: str) -> KVCacheSpec | None:
    if value is None or value == "":  # the reference treats a falsy algo as "no KV-cache quantization"
        return None
    fix = f"use one of {list(KV_CACHE_ALGOS)} or null"
    algo = require_type(value, str, where, "the KV-cache algorithm", fix).strip().upper()
    if algo not in KV_CACHE_ALGOS:
        raise ConfigError(f"unsupported KV-cache quantization {value!r:.80}", where=where, fix=fix)
    return KVCacheSpec(KV_CACHE_ALGOS[algo], KV_SCALE_NAMES, source=f"modelopt {where}={algo}")


def _kv_cache_scheme(value: Any, where: str) -> KVCacheSpec:
    """config.json's compressed-tensors style ``{"type": "float", "num_bits": 8}`` (the reference's
    FP8 case); ``num_bits: 4`` is read as the NVFP4 cache of the legacy key. ModelOpt writes the
    algorithm's name instead of a dict for every KV-cache algorithm but FP8 (``"NVFP4"``)."""
    if isinstance(value, str):
        return _kv_cache_algo(value, where)
    fix = 'write {"type": "float", "num_bits": 8} (or 4 for NVFP4), or null'
    require_type(value, dict, where, "kv_cache_scheme", fix)
    kind, bits = value.get("type"), value.get("num_bits")
    for dtype in KV_CACHE_ALGOS.values():
        if kind == "float" and type(bits) in (int, float) and bits == dtype.bits:
            return KVCacheSpec(dtype, KV_SCALE_NAMES, source=f"modelopt {where}")
    raise ConfigError(f"unsupported KV-cache scheme type={kind!r:.40} num_bits={bits!r:.40}", where=where, fix=fix)


def _quantized_layers(value: Any, where: str) -> dict[str, str]:
    """MIXED_PRECISION's ``{module: {"quant_algo": "FP8" | "NVFP4", "group_size": 16}}`` -> module -> algo."""
    fix = 'map each quantized module to {"quant_algo": "FP8"} or {"quant_algo": "NVFP4", "group_size": 16}'
    if not value:
        raise ConfigError("MIXED_PRECISION needs a non-empty quantized_layers mapping", where=where, fix=fix)
    require_type(value, dict, where, "quantized_layers", fix)
    layers = {}
    for name, info in value.items():
        at = f"{where}[{name!r}]"
        require_type(name, str, at, "a module name", fix)
        require_type(info, dict, at, "a quantized_layers entry", fix)
        algo = info.get("quant_algo")
        if algo is None:
            raise ConfigError("the entry has no quant_algo", where=at, fix=fix)
        algo = require_type(algo, str, f"{at}.quant_algo", "quant_algo", fix).strip().upper()
        if algo not in MIXED_LAYER_ALGOS:
            raise ConfigError(f"per-layer quant_algo {info['quant_algo']!r:.80} is not supported",
                              where=f"{at}.quant_algo", fix=f"MIXED_PRECISION layers use one of {list(MIXED_LAYER_ALGOS)}")
        group_size = _optional_int(info.get("group_size"), f"{at}.group_size")
        if algo == "NVFP4" and group_size is not None:
            _check_nvfp4_group(group_size, f"{at}.group_size")
        layers[name] = algo
    return layers
