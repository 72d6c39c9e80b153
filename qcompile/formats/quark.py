"""AMD Quark checkpoints: ``quant_method: "quark"`` (spec: vLLM's ``quark`` package, amd-quark 0.13).

Which config a Linear layer gets (as Quark's exporter and vLLM's ``_find_matched_config``):

1. ``exclude``: exact names, fnmatch globs (Quark) and ``re:`` regexes (vLLM) -> unquantized;
2. the first ``layer_quant_config`` key (in file order) that fnmatches the module name;
3. ``layer_type_quant_config["Linear"]``;
4. ``global_quant_config``.

The chosen layer config is used whole (no field-wise inheritance from the global one), and
``weight: null`` means unquantized. Fused layers follow the compressed-tensors rule: an own
``layer_quant_config`` key or exclude entry decides, otherwise the shards, which must agree. MoE
experts (``kind="moe"``) resolve as expert 0's ``gate_proj`` / ``up_proj`` / ``down_proj``
(:func:`~qcompile.formats.compressed_tensors.resolve_experts`): Quark matches every module on its own
and quantizes Linears only, so an entry naming just the parent ``experts`` module has no effect
(its docs: "``*.mlp.gate`` excludes only ``model.layers.0.mlp.gate`` itself, not its descendants").
Experts must have a scheme one of vLLM's Quark MoE methods runs (W8A8 FP8, W8A8 INT8, W4A8 FP8, OCP-MX:
:func:`_moe_refusal`); others are refused naming the experts module.

A layer config has ``weight`` / ``input_tensors`` / ``output_tensors`` / ``bias``, each a tensor spec
(``dtype``, ``qscheme`` per_tensor | per_channel | per_group, ``group_size``, ``is_dynamic``,
``symmetric``, ``scale_format``, ``scale_type``, ``ch_axis``); a list of specs (multi-stage) other than
int4_fp8's weight and quantized ``bias`` / ``output_tensors`` are refused (output_tensors of KV-cache
layers describe the KV cache instead); int4 / uint4 run only as int4_fp8's second stage. Keys qcompile
does not read (``observer_cls``, ``round_method``, ...) are allowed: Quark adds some every release.
Schemes and their tensors on disk:

===================  ==========================================================================
OCP-MX weights       ``weight`` uint8 (MXFP4: 2 e2m1 codes / byte, low nibble = even element;
                     MXFP6: 4 codes / 3 bytes), ``weight_scale`` uint8 e8m0 [N, K/32]; activations
                     none, dynamic MX (fp4 / fp6 / fp8, groups of 32) or fp8 per tensor
MXFP8 weights        ``weight`` fp8, ``weight_scale`` uint8 e8m0 [N, K/32]
FP8 W8A8             ``weight`` fp8, ``weight_scale`` bf16 0-d (per tensor) or [N] (per channel),
                     ``input_scale`` bf16 0-d when static per tensor; dynamic per tensor / token
INT8 W8A8            ``weight`` int8 per channel (or tensor / group), ``weight_scale``; activations
                     per token dynamic or per tensor static (``input_scale``). Symmetric: the
                     all-zero ``weight_zero_point`` / ``input_zero_point`` Quark also stores are
                     checked to be zero and not read (vLLM drops them), written back when saving
W4A8 FP8 (int4_fp8)  two-stage ``weight`` [fp8_e4m3 per_tensor, int4 per_channel]: int32 words
                     [N, K/8] of two's-complement int4 codes (``export.pack_method`` "reorder":
                     nibble i holds code [0, 2, 4, 6, 1, 3, 5, 7][i] of its 8), ``weight_scale_2``
                     fp32 [N], ``weight_scale`` fp32 0-d: W = q · weight_scale_2 · weight_scale (an
                     INT4 channel scheme with a global scale); all-zero ``weight_zero_point_2``
                     int32 [N/8] (checked, kept for saving); fp8 activations
===================  ==========================================================================

``is_dynamic: null`` on activations means static (vLLM). KV cache: ``kv_cache_quant_config`` entries'
``output_tensors``, or the legacy ``export.kv_cache_group`` patterns selecting ``layer_quant_config``
entries; fp8 per tensor static -> scales ``k_proj.output_scale`` / ``v_proj.output_scale`` (relative
to the attention module). ``softmax_quant_spec`` (attention) is not read: attention runs unquantized.
"""

from __future__ import annotations

import fnmatch
import re
from functools import partial
from typing import Any

from ..errors import UnsupportedError
from ..scheme import (ActSpec, Granularity, KVCacheSpec, LayerQuant, Packing, QDtype, QuantScheme,
                      ScaleDtype, ScaleSpec, TensorSpec, WeightSpec, mx_act)
from .base import ModuleKind, NamePattern, QuantConfig, need, require_type, shard_names

ROOT = "quantization_config"
DTYPES = {"fp8_e4m3": QDtype.FP8_E4M3, "int8": QDtype.INT8, "fp4": QDtype.FP4_E2M1,
          "fp6_e3m2": QDtype.FP6_E3M2, "fp6_e2m3": QDtype.FP6_E2M3}
UNSUPPORTED_DTYPES = ("uint8", "int4", "uint4", "int3", "int2", "uint2", "int16", "uint16", "int32", "bfloat16",
                      "float16", "fp8_e5m2", "fp8_e5m3", "mx", "mx6", "mx9")
QSCHEMES = ("per_tensor", "per_channel", "per_group", "per_block")
SCALE_FORMATS = (None, "float32", "float16", "bfloat16", "e8m0")  # "e5m3" / "e4m3" exist but are not OCP-MX
SCALE_TYPES = (None, "float", "pof2", "float32", "float16", "bfloat16", "float8_e8m0fnu")
LAYER_TYPES = ("Linear", "Conv2d", "ConvTranspose2d")  # Quark's QUARK_LAYER_TYPES
MX_GROUP = 32
SPEC_FIELDS = {"dtype": str, "qscheme": str, "group_size": int, "is_dynamic": bool, "symmetric": bool,
               "scale_format": str, "scale_type": str, "ch_axis": int, "mx_element_dtype": str}
KV_SCALES = ("k_proj.output_scale", "v_proj.output_scale")
INT4_REORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # code held by each nibble of an int32 word (pack_method "reorder")


class QuarkConfig(QuantConfig):
    """``entries``: (fnmatch regex, LayerQuant | None) of layer_quant_config in file order;
    ``default``: the Linear layer_type config or the global one."""

    format = "quark"

    def __init__(self, raw: dict, default: LayerQuant | None, entries: list[tuple[re.Pattern, LayerQuant | None]],
                 exclude: list[NamePattern], kv_cache: KVCacheSpec | None):
        super().__init__(raw, kv_cache)
        self.default, self.entries, self.exclude = default, entries, exclude

    def describe(self) -> str:
        kv = f"; kv cache {self.kv_cache.dtype.value}" if self.kv_cache else ""
        default = self.default.scheme.key if self.default else "unquantized"
        return f"quark ({default}; {len(self.entries)} per-layer entries){kv}"

    def is_excluded(self, name: str) -> bool:
        return any(p.matches(name) for p in self.exclude)

    def _resolve_moe(self, module_name: str, projections: tuple[str, str, str]) -> LayerQuant | None:
        lq = super()._resolve_moe(module_name, projections)
        why = lq and _moe_refusal(lq.scheme)
        need(not why, module_name, f"Quark MoE experts quantized {lq and lq.scheme.key} ({lq and lq.source}) are "
             f"not supported: {why}", "quantize the experts with a Quark MoE scheme (FP8 or INT8 W8A8 per tensor, or "
             "per-channel weights with dynamic per-token activations; int4_fp8; OCP-MX weights) or exclude them",
             UnsupportedError)
        return lq

    def _resolve(self, name: str, kind: ModuleKind) -> LayerQuant | None:
        if self.is_excluded(name):
            return None
        for pattern, lq in self.entries:
            if pattern.match(name):
                return lq
        if shard_names(name):
            return self.resolve_fused(name, kind, lambda n: None if n == name else self.resolve(n, "linear"))
        return self.default


def _moe_refusal(scheme: QuantScheme) -> str | None:
    """Why vLLM's Quark MoE methods (W8A8 FP8, W8A8 INT8, W4A8 FP8, OCP-MX) have none for ``scheme``, or None."""
    w, a = scheme.weight, scheme.act
    a_mx = a is not None and a.scale.dtype is ScaleDtype.E8M0
    if w.scale.dtype is ScaleDtype.E8M0:
        if w.dtype is QDtype.FP8_E4M3:
            return "MXFP8 weights have no Quark MoE method"
        if a is None or (a_mx and a.dtype is not QDtype.FP8_E4M3 and w.dtype in (QDtype.FP4_E2M1, a.dtype)):
            return None
        if w.dtype is QDtype.FP4_E2M1 and a.dtype is QDtype.FP8_E4M3 and not a_mx and not a.dynamic and \
                a.scale.granularity is Granularity.TENSOR:
            return None
        return f"OCP-MX {w.dtype.value} weights run with unquantized activations, MX activations of their type " \
               "(mxfp4 weights: also mxfp6) or static per-tensor fp8 (mxfp4 weights only)"
    if w.dtype is QDtype.INT4 and w.global_scale:  # int4_fp8 (the parser admits fp8 activations only)
        return None
    if a is None:
        return f"{w.dtype.value} weight-only experts have no Quark MoE method (OCP-MX weights alone do)"
    if w.dtype in (QDtype.FP8_E4M3, QDtype.INT8) and a is not None and a.dtype is w.dtype and not a_mx:
        pair = (w.scale.granularity, a.scale.granularity)
        if w.dtype is QDtype.FP8_E4M3 and pair in ((Granularity.TENSOR, Granularity.TENSOR),
                                                   (Granularity.CHANNEL, Granularity.TOKEN)):
            return None
        if w.dtype is QDtype.INT8 and not w.zero_point and pair[0] in (Granularity.TENSOR, Granularity.CHANNEL) \
                and (pair[1] is Granularity.TOKEN or (pair[1] is Granularity.TENSOR and not a.dynamic)):
            return None
        return {QDtype.FP8_E4M3: "FP8 experts run per-tensor weights with per-tensor activations, or per-channel "
                                 "weights with dynamic per-token activations",
                QDtype.INT8: "INT8 experts run symmetric per-tensor or per-channel weights with static per-tensor or "
                             "dynamic per-token activations"}[w.dtype]
    return "no Quark MoE method runs these weights and activations"


# -- parsing -------------------------------------------------------------------------------------

def parse(config: dict[str, Any]) -> QuarkConfig:
    """Parse a Quark ``quantization_config`` (module docstring). Malformed input raises ConfigError,
    well-formed input qcompile cannot represent UnsupportedError; both name the key."""
    require_type(config, dict, ROOT, "a Quark quantization config", "pass config.json's quantization_config")
    method = config.get("quant_method", "quark")
    need(isinstance(method, str) and method.lower() == "quark", f"{ROOT}.quant_method",
         f"quant_method is {method!r:.80}, not quark", "use the parser for that quant_method")
    export = _optional(config, "export", dict) or {}
    weight_format = _optional(export, "weight_format", str, f"{ROOT}.export")
    need(weight_format in (None, "real_quantized"), f"{ROOT}.export.weight_format",
         f"weights are {weight_format!r:.40}", 'export with weight_format="real_quantized"', UnsupportedError)
    # int4 words: Quark's "reorder" (the default) interleaves the codes; any other value keeps them in order
    pack_method = _optional(export, "pack_method", str, f"{ROOT}.export")
    layer = partial(_layer, int4_order=INT4_REORDER if pack_method in (None, "reorder") else tuple(range(8)))
    kv_group = [NamePattern.compile(p, f"{ROOT}.export.kv_cache_group[{i}]", globs=True)
                for i, p in enumerate(_optional(export, "kv_cache_group", list, f"{ROOT}.export") or [])]
    kv_entries = _optional(config, "kv_cache_quant_config", dict) or {}
    kv_keys = list(kv_entries) + [p.text for p in kv_group]

    need("global_quant_config" in config, f"{ROOT}.global_quant_config", "global_quant_config is missing",
         'add {"weight": {...}, "input_tensors": ..., "output_tensors": null}')
    default = layer(config["global_quant_config"], f"{ROOT}.global_quant_config")
    for cls_name, cfg in (_optional(config, "layer_type_quant_config", dict) or {}).items():
        where = f"{ROOT}.layer_type_quant_config.{cls_name}"
        need(cls_name in LAYER_TYPES, where, f"unknown layer type {cls_name!r:.60}",
             f"Quark keys layer types as {list(LAYER_TYPES)}")
        lq = layer(cfg, where)
        default = lq if cls_name == "Linear" else default
    entries, kv_specs = [], []
    for key, cfg in (_optional(config, "layer_quant_config", dict) or {}).items():
        where = f"{ROOT}.layer_quant_config.{key}"
        # vLLM: output_tensors of KV-cache layers describe the KV cache; "*q_proj"'s are dropped with them.
        is_kv = bool(kv_keys) and (any(fnmatch.fnmatchcase(key, p) for p in kv_keys) or key == "*q_proj")
        entries.append((re.compile(fnmatch.translate(key)), layer(cfg, where, kv_layer=is_kv)))
        if is_kv and key != "*q_proj" and cfg.get("output_tensors") is not None:
            kv_specs.append((cfg["output_tensors"], f"{where}.output_tensors"))
    for key, cfg in kv_entries.items():
        where = f"{ROOT}.kv_cache_quant_config.{key}"
        require_type(cfg, dict, where, "a KV-cache layer config", '{"output_tensors": {"dtype": "fp8_e4m3", ...}}')
        kv_specs.append((cfg.get("output_tensors"), f"{where}.output_tensors"))
    need(not kv_group or bool(kv_specs), f"{ROOT}.export.kv_cache_group",
         "kv_cache_group is set but no layer config quantizes the KV cache",
         "add the KV layers' output_tensors to layer_quant_config or empty kv_cache_group")
    exclude = [NamePattern.compile(p, f"{ROOT}.exclude[{i}]", globs=True)
               for i, p in enumerate(_optional(config, "exclude", list) or [])]
    return QuarkConfig(config, default, entries, exclude, _kv_cache(kv_specs) if kv_specs else None)


def _optional(section: dict, key: str, kind: type, path: str = ROOT) -> Any:
    value = section.get(key)
    if value is not None:
        require_type(value, kind, f"{path}.{key}", key, f"a {kind.__name__} or null")
    return value


def _single(value: Any, where: str) -> dict | None:
    """A tensor spec, or None; a list (multi-stage quantization) is refused."""
    need(not isinstance(value, list), where, "multi-stage quantization (a list of specs) is not supported",
         "use a single quantization spec per tensor", UnsupportedError)
    if value is not None:
        require_type(value, dict, where, "a tensor quantization spec", '{"dtype": "fp8_e4m3", "qscheme": ...}')
    return value


def _layer(cfg: Any, where: str, kv_layer: bool = False, int4_order: tuple[int, ...] = ()) -> LayerQuant | None:
    require_type(cfg, dict, where, "a layer quantization config", '{"weight": {...}, "input_tensors": ...}')
    two_stage = isinstance(cfg.get("weight"), list)  # checked first: the refusal of the others names the weight
    w4a8 = _w4a8_weight(cfg["weight"], f"{where}.weight", int4_order) if two_stage else None
    weight = cfg["weight"] if two_stage else _single(cfg.get("weight"), f"{where}.weight")
    act = _single(cfg.get("input_tensors"), f"{where}.input_tensors")
    need(_single(cfg.get("bias"), f"{where}.bias") is None, f"{where}.bias", "bias quantization is not supported",
         "set bias to null", UnsupportedError)
    output = _single(cfg.get("output_tensors"), f"{where}.output_tensors")
    need(output is None or kv_layer, f"{where}.output_tensors", "output tensor quantization is not supported",
         "set output_tensors to null (KV-cache layers go in kv_cache_quant_config)", UnsupportedError)
    if output is not None:
        _spec(output, f"{where}.output_tensors")
    if weight is None:
        need(act is None, f"{where}.weight", "activation-only quantization is not supported",
             "quantize the weights too", UnsupportedError)
        return None
    wspec, tensors = w4a8 or _weight(_spec(weight, f"{where}.weight"), f"{where}.weight")
    aspec, act_tensors = (None, ()) if act is None else _act(_spec(act, f"{where}.input_tensors"),
                                                             f"{where}.input_tensors")
    need(not two_stage or (aspec is not None and aspec.dtype is QDtype.FP8_E4M3 and aspec.scale.dtype is
                           ScaleDtype.FP32), f"{where}.input_tensors", "int4_fp8 (W4A8) weights without fp8_e4m3 "
         "activations are not supported", "quantize the activations to fp8_e4m3 (per tensor, or dynamic)",
         UnsupportedError)
    return LayerQuant(QuantScheme(wspec, aspec), tensors + act_tensors, f"quark {where[len(ROOT) + 1:]}")


def _w4a8_weight(stages: list, where: str, int4_order: tuple[int, ...]) -> tuple[WeightSpec, tuple[TensorSpec, ...]]:
    """A two-stage weight: only Quark's ``int4_fp8`` (vLLM's W4A8 FP8), an fp8 per-tensor scale
    ``weight_scale`` over int4 per-channel codes and scales ``weight_scale_2``: W = q · weight_scale_2 ·
    weight_scale, an INT4 channel scheme with a global scale."""
    for i, stage in enumerate(stages):
        require_type(stage, dict, f"{where}[{i}]", "a tensor quantization spec", '{"dtype": "int4", "qscheme": ...}')
    fp8, int4 = (stages + [{}, {}])[:2]
    w4a8 = (len(stages) == 2 and (fp8.get("dtype"), fp8.get("qscheme")) == ("fp8_e4m3", "per_tensor") and
            (int4.get("dtype"), int4.get("qscheme"), int4.get("ch_axis")) == ("int4", "per_channel", 0) and
            int4.get("symmetric") is True and not any(s.get("is_dynamic") for s in stages))
    need(w4a8, where, "two-stage weight quantization (" + ", then ".join(
        f"{s.get('dtype')!r:.20} {s.get('qscheme')!r:.20}" for s in stages) + ") is not supported",
         "qcompile reads a two-stage weight only as Quark's int4_fp8: [fp8_e4m3 per_tensor, int4 per_channel "
         "ch_axis 0 symmetric]; NVFP4 runs from ModelOpt and llm-compressor exports", UnsupportedError)
    weight = WeightSpec(QDtype.INT4, ScaleSpec(Granularity.CHANNEL), Packing.INT32, global_scale=True)
    return weight, (TensorSpec("weight", "weight", int4_order=int4_order), TensorSpec("weight_scale", "weight_scale_2"),
                    TensorSpec("weight_global_scale", "weight_scale"),
                    TensorSpec("unused_weight_zero_point", "weight_zero_point_2", optional=True, packed_rows=True))


def _spec(raw: dict, where: str) -> dict:
    """Check the fields qcompile reads; returns the spec with ``dtype`` as a QDtype and ``mx`` set."""
    for key, kind in SPEC_FIELDS.items():
        if raw.get(key) is not None:
            require_type(raw[key], kind, f"{where}.{key}", key, f"a {kind.__name__} or null")
    dtype, qscheme, group = raw.get("dtype"), raw.get("qscheme"), raw.get("group_size")
    need(dtype not in ("int4", "uint4"), f"{where}.dtype", f"dtype {dtype!r} is not supported: Quark int4 runs only "
         "as the second stage of int4_fp8 (W4A8), as in vLLM", "quantize with int4_fp8 ([fp8_e4m3 per_tensor, int4 "
         "per_channel] weights, fp8 activations), or export int4 weight-only as a compressed-tensors W4A16 "
         "checkpoint (llm-compressor), which qcompile runs", UnsupportedError)
    need(dtype not in UNSUPPORTED_DTYPES, f"{where}.dtype", f"dtype {dtype!r} is not supported",
         f"qcompile reads Quark {sorted(DTYPES)} (OCP-MX: fp4 / fp6 / fp8 with scale_format e8m0)", UnsupportedError)
    need(dtype in DTYPES, f"{where}.dtype", f"unknown dtype {dtype!r:.60}", f"one of {sorted(DTYPES)}")
    need(qscheme in QSCHEMES, f"{where}.qscheme", f"unknown qscheme {qscheme!r:.60}", f"one of {list(QSCHEMES)}")
    need(qscheme != "per_block", f"{where}.qscheme", "per_block quantization is not supported",
         "use per_tensor, per_channel or per_group", UnsupportedError)
    need(qscheme != "per_group" or (group or 0) > 0, f"{where}.group_size", "per_group needs a positive group_size",
         "e.g. 32")
    for key, allowed in (("scale_format", SCALE_FORMATS), ("scale_type", SCALE_TYPES)):
        need(raw.get(key) in allowed, f"{where}.{key}", f"{key} {raw.get(key)!r:.40} is not supported",
             f"one of {[a for a in allowed if a]}", UnsupportedError)
    mx = raw.get("scale_format") == "e8m0"
    need(not mx or dtype != "int8", f"{where}.scale_format", "int8 with e8m0 scales is not OCP-MX",
         "use float scales for int8", UnsupportedError)
    need(not mx or (qscheme, group) == ("per_group", MX_GROUP), f"{where}.group_size",
         "e8m0 (OCP-MX) scales need per_group with group_size 32", "set qscheme per_group, group_size 32",
         UnsupportedError)
    need(mx or dtype in ("fp8_e4m3", "int8"), f"{where}.scale_format", f"{dtype} needs OCP-MX e8m0 scales",
         'set scale_format "e8m0", qscheme per_group, group_size 32', UnsupportedError)
    need(raw.get("symmetric") is not False or dtype == "int8", f"{where}.symmetric", f"asymmetric {dtype} is not "
         "supported", "set symmetric true", UnsupportedError)
    return dict(raw, dtype=DTYPES[dtype], mx=mx)


def _weight(s: dict, where: str) -> tuple[WeightSpec, tuple[TensorSpec, ...]]:
    dtype, qscheme, axis = s["dtype"], s["qscheme"], s.get("ch_axis")
    if s["mx"]:
        packing = {QDtype.FP8_E4M3: Packing.NONE, QDtype.FP4_E2M1: Packing.UINT8}.get(dtype, Packing.UINT8_FP6)
        weight = WeightSpec(dtype, ScaleSpec(Granularity.GROUP, ScaleDtype.E8M0, group_size=MX_GROUP), packing)
    else:
        need(qscheme != "per_channel" or axis in (None, 0, -2), f"{where}.ch_axis",
             f"per-channel weight scales along axis {axis} are not supported",
             "weights are scaled per output channel: ch_axis 0", UnsupportedError)
        need(qscheme != "per_group" or axis in (None, 1, -1), f"{where}.ch_axis",
             f"weight groups along axis {axis} are not supported", "groups run along in_features: ch_axis -1",
             UnsupportedError)
        scale = {"per_tensor": ScaleSpec(Granularity.TENSOR), "per_channel": ScaleSpec(Granularity.CHANNEL)}.get(
            qscheme, ScaleSpec(Granularity.GROUP, group_size=s.get("group_size") or 0))
        weight = WeightSpec(dtype, scale, zero_point=s.get("symmetric") is False)
    tensors = (TensorSpec("weight", "weight"), TensorSpec("weight_scale", "weight_scale"))
    if weight.zero_point:
        return weight, tensors + (TensorSpec("weight_zero_point", "weight_zero_point"),)
    return weight, tensors + _unused_zero_point("weight", dtype)


def _unused_zero_point(tensor: str, dtype: QDtype) -> tuple[TensorSpec, ...]:
    """The all-zero zero point Quark stores beside a symmetric integer scale (not read; kept for saving)."""
    return (TensorSpec(f"unused_{tensor}_zero_point", f"{tensor}_zero_point", optional=True),) \
        if dtype is QDtype.INT8 else ()


def _act(s: dict, where: str) -> tuple[ActSpec, tuple[TensorSpec, ...]]:
    dtype, qscheme, dynamic = s["dtype"], s["qscheme"], bool(s.get("is_dynamic"))
    symmetric = s.get("symmetric") is not False
    if s["mx"] or qscheme == "per_group":
        need(dynamic, f"{where}.is_dynamic", "static per-group (MX) activation scales are not supported",
             "set is_dynamic true", UnsupportedError)
        group = ScaleSpec(Granularity.GROUP, group_size=s["group_size"])
        return (mx_act(dtype) if s["mx"] else ActSpec(dtype, True, group, symmetric=symmetric)), ()
    need(qscheme != "per_channel" or dynamic, f"{where}.is_dynamic", "static per-channel activation scales are not "
         "supported", "per-token activations are dynamic: set is_dynamic true", UnsupportedError)
    need(dynamic or symmetric, f"{where}.symmetric", "static asymmetric activations (an input zero point) are not "
         "supported", "use symmetric or dynamic activations", UnsupportedError)
    gran = Granularity.TOKEN if qscheme == "per_channel" else Granularity.TENSOR
    act = ActSpec(dtype, dynamic, ScaleSpec(gran), symmetric=symmetric)
    return act, (() if dynamic else (TensorSpec("input_scale", "input_scale"),) + _unused_zero_point("input", dtype))


def _kv_cache(specs: list[tuple[Any, str]]) -> KVCacheSpec:
    """All KV-cache layers must share one spec: fp8 (or int8) per tensor, static, symmetric."""
    first, first_where = specs[0]
    for value, where in specs:
        spec = _spec(_single(value, where) or {}, where)
        need(value == first, where, f"the KV-cache layers disagree ({first_where} vs this)",
             "give k_proj and v_proj the same output_tensors spec")
        need(spec["qscheme"] == "per_tensor" and not spec.get("is_dynamic") and spec["dtype"] in
             (QDtype.FP8_E4M3, QDtype.INT8), where, "KV-cache quantization must be static per-tensor fp8 / int8",
             'use {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": false}', UnsupportedError)
    return KVCacheSpec(spec["dtype"], KV_SCALES, source=f"quark {first_where[len(ROOT) + 1:]}")
