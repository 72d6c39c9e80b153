"""compressed-tensors (llm-compressor) checkpoints: ``quant_method: "compressed-tensors"``.

Spec: vLLM's ``compressed_tensors`` package and the compressed-tensors library (0.9 - 0.20).

* ``config_groups.<group>`` holds ``targets``, ``weights`` / ``input_activations`` (QuantizationArgs)
  and an optional ``format`` (else the top-level ``format``); ``output_activations`` must be null.
* A target or ``ignore`` entry is an exact module name, ``re:<regex>`` or a class name. Regexes use
  ``re.match`` as compressed-tensors and vLLM do: anchored at the start, **not** at the end
  (``re:.*q_proj`` also matches ``...q_proj_extra``). Of class names only ``Linear`` matches the
  ``nn.Linear`` layers qcompile quantizes. A layer takes the group of its most specific target
  (compressed-tensors' ``match_targets``): exact name, then regexes in sorted order, then ``Linear``;
  ``ignore`` beats every target. One target in two groups is a ConfigError (compressed-tensors would
  silently take the last).
* Fused layers (``qkv_proj``): an own exact / regex target or ignore entry decides; otherwise the
  shards do, and must agree (:meth:`QuantConfig.resolve_fused`).
* MoE (``kind="moe"``, e.g. ``model.layers.0.mlp.experts``): :func:`resolve_experts` - the experts
  resolve as expert 0's ``gate_proj`` / ``up_proj`` / ``down_proj`` Linears do (on disk
  ``experts.0.gate_proj.*``), as vLLM's ``get_moe_method``: a ``Linear`` target covers them, and a
  target or ignore entry naming only the parent ``experts`` module has no effect (compressed-tensors
  matches every module on its own and quantizes Linears only). The LayerQuant describes one expert
  projection; its tensor names are relative to ``experts.<e>.<proj>``.

On-disk tensor names (suffixes after the module name), by ``format``:

=================================  ===============================================================
naive- / int- / float-quantized    ``weight`` (fp8, or int8 holding int8 / int4 codes), ``weight_scale``
                                   (bf16, [1] / [N, 1] / [N, K/g] / [N/bn, K/bk]), ``weight_zero_point``
                                   when asymmetric, ``weight_g_idx`` for actorder "group"
pack-quantized                     ``weight_packed`` int32 (32/bits codes, code + 2^(bits-1)),
                                   ``weight_scale``, ``weight_shape`` int64 [2], ``weight_g_idx``
                                   (actorder "group" only; "static" / "weight" store none);
                                   asymmetric: ``weight_zero_point`` int32 [ceil(N*bits/32), K/g or 1],
                                   the int8 zero points packed the same way along out_features
                                   (``pack_to_int32(zp, bits, packed_dim=0)``), unpacked at load
nvfp4-pack-quantized               ``weight_packed`` uint8, ``weight_scale`` fp8 [N, K/16],
                                   ``weight_global_scale`` and, for W4A4, ``input_global_scale``:
                                   both *reciprocal* (W = q * s / global) and inverted at load
mxfp4- / mxfp6-pack-quantized      ``weight_packed`` uint8 (2 e2m1 / byte; 4 e2m3 / 3 bytes),
                                   ``weight_scale`` uint8 e8m0 [N, K/32]
mxfp8-quantized                    ``weight`` fp8, ``weight_scale`` uint8 e8m0 [N, K/32]
=================================  ===============================================================

Static per-tensor activations add ``input_scale``. ``kv_cache_scheme`` -> ``self_attn.k_scale`` /
``v_scale`` in the model dtype, [1] (``tensor``) or [num_kv_heads, 1, 1] (``attn_head``). Refused as
not representable: asymmetric floats, output activations, 2/3/5/6/7-bit ints, sparse or transformed
checkpoints and ``quantization_status`` other than ``compressed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedError
from ..scheme import (ActSpec, Granularity, KVCacheSpec, LayerQuant, Packing, QDtype, QuantScheme, ScaleDtype,
                      ScaleSpec, TensorSpec, WeightSpec, mx_act)
from .base import ModuleKind, NamePattern, QuantConfig, need, require_type, shard_names

ROOT = "quantization_config"
LINEAR_CLASS = "Linear"  # the class-name target an HF nn.Linear matches (its MRO: Linear, Module)

# format -> (name of the weight codes on disk, packing); None / "dense": weights stored unquantized.
FORMATS = {
    "naive-quantized": ("weight", Packing.NONE), "int-quantized": ("weight", Packing.NONE),
    "float-quantized": ("weight", Packing.NONE), "mxfp8-quantized": ("weight", Packing.NONE),
    "pack-quantized": ("weight_packed", Packing.INT32),
    "nvfp4-pack-quantized": ("weight_packed", Packing.UINT8),
    "mxfp4-pack-quantized": ("weight_packed", Packing.UINT8),
    "mxfp6-pack-quantized": ("weight_packed", Packing.UINT8_FP6),
}
SPARSE_FORMATS = ("sparse-bitmask", "sparse-24-bitmask", "marlin-24")
MIXED = "mixed-precision"
# (type, num_bits) -> element dtype. int4 under a naive format is stored one code per int8.
DTYPES = {("float", 8): QDtype.FP8_E4M3, ("float", 4): QDtype.FP4_E2M1, ("float", 6): QDtype.FP6_E2M3,
          ("int", 8): QDtype.INT8, ("int", 4): QDtype.INT4}
# format -> (dtype, strategy, group_size, scale dtype) it requires: the layout is fixed by the format.
FIXED_LAYOUTS = {
    "nvfp4-pack-quantized": (QDtype.FP4_E2M1, "tensor_group", 16, ScaleDtype.FP8_E4M3),
    "mxfp4-pack-quantized": (QDtype.FP4_E2M1, "group", 32, ScaleDtype.E8M0),
    "mxfp6-pack-quantized": (QDtype.FP6_E2M3, "group", 32, ScaleDtype.E8M0),
    "mxfp8-quantized": (QDtype.FP8_E4M3, "group", 32, ScaleDtype.E8M0),
}
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
ARG_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
            "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs")
GROUP_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
ACTORDER = {None: None, False: None, "static": None, "weight": None, True: "group", "group": "group",
            "dynamic": "group"}
SCALE_DTYPES = {"float32": ScaleDtype.FP32, "float": ScaleDtype.FP32, "bfloat16": ScaleDtype.FP32,
                "float16": ScaleDtype.FP32, "half": ScaleDtype.FP32, "float8_e4m3fn": ScaleDtype.FP8_E4M3,
                "uint8": ScaleDtype.E8M0, "float8_e8m0fnu": ScaleDtype.E8M0}
ZP_DTYPES = ("int8", "uint8", "int16", "int32", "int64", "float8_e4m3fn", "bfloat16", "float16", "float32")


# -- shared with the Quark and online parsers ----------------------------------------------------

# -- the parsed config ---------------------------------------------------------------------------

class CompressedTensorsConfig(QuantConfig):
    """``groups``: group name -> its LayerQuant (None when the group quantizes nothing);
    ``targets``: target text -> group name; ``ignore``: the ignore patterns."""

    format = "compressed-tensors"

    def __init__(self, raw: dict, groups: dict[str, LayerQuant | None], targets: dict[str, str],
                 ignore: list[NamePattern], kv_cache: KVCacheSpec | None):
        super().__init__(raw, kv_cache)
        self.groups, self.targets, self.ignore = groups, targets, ignore
        # regexes in compressed-tensors' order (sorted by text); parse() has checked they compile
        self._regexes = [(NamePattern.compile(t, "targets"), targets[t])
                         for t in sorted(targets) if t.startswith("re:")]

    def describe(self) -> str:
        parts = [f"{g}: {lq.scheme.key if lq else 'unquantized'}" for g, lq in self.groups.items()]
        kv = f"; kv cache {self.kv_cache.dtype.value}" if self.kv_cache else ""
        return f"compressed-tensors ({'; '.join(parts)}){kv}"

    def is_ignored(self, name: str) -> bool:
        return any(p.matches(name) or p.text == LINEAR_CLASS for p in self.ignore)

    def _specific(self, name: str) -> str | None:
        """The group of an exact or regex target of ``name`` (no class-name match)."""
        if name in self.targets:
            return self.targets[name]
        return next((g for p, g in self._regexes if p.matches(name)), None)

    def _resolve(self, name: str, kind: ModuleKind) -> LayerQuant | None:
        if self.is_ignored(name):
            return None
        group = self._specific(name)
        if group is None and shard_names(name):
            return self.resolve_fused(name, kind, lambda n: None if n == name else self.resolve(n, "linear"))
        group = group or self.targets.get(LINEAR_CLASS)
        return self.groups[group] if group else None


# -- parsing -------------------------------------------------------------------------------------

def parse(config: dict[str, Any]) -> CompressedTensorsConfig:
    """Parse a compressed-tensors ``quantization_config`` (module docstring). Malformed input raises
    ConfigError, well-formed input qcompile cannot represent UnsupportedError; both name the key."""
    require_type(config, dict, ROOT, "a compressed-tensors config", "pass config.json's quantization_config")
    method = config.get("quant_method", "compressed-tensors")
    need(isinstance(method, str) and method.lower() == "compressed-tensors", f"{ROOT}.quant_method",
         f"quant_method is {method!r:.80}, not compressed-tensors", "use the parser for that quant_method")
    _refuse_math_changing_features(config)
    top_format = _format(config.get("format"), f"{ROOT}.format", top=True)
    groups_raw = config.get("config_groups")
    need(groups_raw is not None, f"{ROOT}.config_groups", "config_groups is missing",
         'add {"group_0": {"targets": ["Linear"], "weights": {...}}}')
    require_type(groups_raw, dict, f"{ROOT}.config_groups", "config_groups", "map group names to schemes")
    groups: dict[str, LayerQuant | None] = {}
    targets: dict[str, str] = {}
    for gname, group in groups_raw.items():
        where = f"{ROOT}.config_groups.{gname}"
        groups[gname] = _group(group, where, top_format)
        for i, t in enumerate(group["targets"]):
            NamePattern.compile(t, f"{where}.targets[{i}]")
            need(targets.get(t, gname) == gname, f"{where}.targets[{i}]",
                 f"target {t!r:.80} is also in config_groups.{targets.get(t)}", "list each target in one group only")
            targets[t] = gname
    ignore = [] if config.get("ignore") is None else config["ignore"]
    require_type(ignore, list, f"{ROOT}.ignore", "the ignore list", 'a list of module names / "re:" regexes')
    ignore = [NamePattern.compile(p, f"{ROOT}.ignore[{i}]") for i, p in enumerate(ignore)]
    kv = config.get("kv_cache_scheme")
    kv_cache = None if kv is None else _kv_cache(kv, f"{ROOT}.kv_cache_scheme")
    return CompressedTensorsConfig(config, groups, targets, ignore, kv_cache)


def _refuse_math_changing_features(config: dict) -> None:
    status = config.get("quantization_status", "compressed")
    require_type(status, str, f"{ROOT}.quantization_status", "quantization_status", '"compressed"')
    need(status == "compressed", f"{ROOT}.quantization_status", f"status {status!r:.40}: weights are not compressed",
         "save the model with llm-compressor's save_compressed=True", UnsupportedError)
    for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        value = config.get(key)
        if value is None or value == {}:
            continue
        require_type(value, dict, f"{ROOT}.{key}", key, "a JSON object or null")
        need(key == "sparsity_config" and value.get("format", "dense") == "dense", f"{ROOT}.{key}",
             f"{key} is set: sparse, transformed or expert-pruned checkpoints are not supported",
             "use a checkpoint quantized without it", UnsupportedError)


def _format(value: Any, where: str, top: bool = False) -> str | None:
    if value is None:
        return None
    fix = f"use one of {sorted(FORMATS) + ['dense']}" + (f" or {MIXED!r} (per-group formats)" if top else "")
    require_type(value, str, where, "format", fix)
    need(value not in SPARSE_FORMATS, where, f"format {value!r} (sparse storage) is not supported",
         "use a dense quantized checkpoint", UnsupportedError)
    need(value in FORMATS or value == "dense" or (top and value == MIXED), where, f"unknown format {value!r:.80}", fix)
    return value


def _group(group: Any, where: str, top_format: str | None) -> LayerQuant | None:
    need(not isinstance(group, list), where, "preset-name groups (a bare target list) are not read",
         "save the config with compressed-tensors, which expands presets", UnsupportedError)
    require_type(group, dict, where, "a config group", '{"targets": [...], "weights": {...}, "format": ...}')
    for key in group:
        need(key in GROUP_KEYS, f"{where}.{key}", f"unknown key {key!r:.80}", f"a group has only {list(GROUP_KEYS)}")
    targets = group.get("targets")
    need(isinstance(targets, list) and bool(targets), f"{where}.targets", "targets must be a non-empty list",
         'e.g. ["Linear"]')
    need(group.get("output_activations") is None, f"{where}.output_activations",
         "output activation quantization is not supported", "set output_activations to null", UnsupportedError)
    fmt = _format(group.get("format"), f"{where}.format") or top_format
    need(fmt != MIXED, f"{where}.format", f"the top-level format is {MIXED!r} but the group has none",
         f"give the group one of {sorted(FORMATS)}")
    w_raw, a_raw = group.get("weights"), group.get("input_activations")
    wargs = None if w_raw is None else _args(w_raw, f"{where}.weights")
    aargs = None if a_raw is None else _args(a_raw, f"{where}.input_activations")
    if wargs is None:
        need(aargs is None, f"{where}.weights", "activation-only quantization is not supported",
             "quantize the weights too", UnsupportedError)
        return None
    need(fmt is not None, f"{where}.format", "the group quantizes weights but no format is set",
         f"set the group's or the top-level format to one of {sorted(FORMATS)}")
    need(fmt != "dense", f"{where}.format", "format is dense: the weights were saved unquantized",
         'load it as a bf16 checkpoint (online="fp8_per_tensor" quantizes at load)', UnsupportedError)
    weight, tensors = _weight(wargs, fmt, where)
    act, act_tensors = (None, ()) if aargs is None else _act(aargs, f"{where}.input_activations")
    return LayerQuant(QuantScheme(weight, act), tensors + act_tensors, f"compressed-tensors {where[len(ROOT) + 1:]}")


@dataclass(frozen=True)
class Args:
    """One validated QuantizationArgs, strategy inferred as compressed-tensors does."""

    dtype: QDtype
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    dynamic: bool | str  # True, False or "local" (NVFP4: dynamic local scales, static global scale)
    actorder: str | None  # "group" (a g_idx on disk) or None
    scale_dtype: ScaleDtype | None
    where: str


def _args(raw: Any, where: str, kv_cache: bool = False) -> Args:
    require_type(raw, dict, where, "quantization args", '{"num_bits": 8, "type": "float", "strategy": ...}')
    for key in raw:
        need(key in ARG_KEYS, f"{where}.{key}", f"unknown key {key!r:.80}", f"QuantizationArgs has {list(ARG_KEYS)}")
    get = raw.get
    bits = require_type(get("num_bits", 8), int, f"{where}.num_bits", "num_bits", "an integer such as 4 or 8")
    kind = require_type(get("type", "int"), str, f"{where}.type", "type", '"int" or "float"').lower()
    need(kind in ("int", "float"), f"{where}.type", f"invalid type {kind!r:.40}", '"int" or "float"')
    need(bits >= 1, f"{where}.num_bits", f"invalid num_bits {bits}", "a positive integer such as 4 or 8")
    need((kind, bits) in DTYPES, f"{where}.num_bits", f"{bits}-bit {kind} quantization is not supported",
         f"qcompile reads {sorted(f'{t}{b}' for t, b in DTYPES)}", UnsupportedError)
    symmetric = require_type(get("symmetric", True), bool, f"{where}.symmetric", "symmetric", "true or false")
    group_size = get("group_size")
    if group_size is not None:
        require_type(group_size, int, f"{where}.group_size", "group_size", "a positive integer, -1 or null")
        need(group_size > 0 or group_size == -1, f"{where}.group_size", f"invalid group_size {group_size}",
             "a positive integer (group), -1 (channel) or null")
    strategy = get("strategy")
    if strategy is None:
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel"
    strategy = require_type(strategy, str, f"{where}.strategy", "strategy", f"one of {list(STRATEGIES)}").lower()
    need(strategy in STRATEGIES, f"{where}.strategy", f"unknown strategy {strategy!r:.40}",
         f"one of {list(STRATEGIES)}")
    block = _block(get("block_structure"), f"{where}.block_structure")
    dynamic = get("dynamic", False)
    dynamic = "local" if isinstance(dynamic, str) and dynamic.lower() == "local" else dynamic
    need(isinstance(dynamic, bool) or dynamic == "local", f"{where}.dynamic", f"invalid dynamic {dynamic!r:.40}",
         'true, false or "local"')
    actorder = get("actorder")
    actorder = actorder.lower() if isinstance(actorder, str) else actorder
    need(isinstance(actorder, (str, bool, type(None))) and actorder in ACTORDER, f"{where}.actorder",
         f"invalid actorder {actorder!r:.40}", 'null, "static", "weight" or "group"')
    scale_dtype = _torch_dtype(get("scale_dtype"), f"{where}.scale_dtype", SCALE_DTYPES)
    _torch_dtype(get("zp_dtype"), f"{where}.zp_dtype", dict.fromkeys(ZP_DTYPES))
    for key, kind_ in (("observer", str), ("observer_kwargs", dict)):
        if get(key) is not None:
            require_type(get(key), kind_, f"{where}.{key}", key, f"a {kind_.__name__} or null")
    # compressed-tensors' QuantizationArgs.validate_model_after, rule by rule.
    grouped = strategy in ("group", "tensor_group")
    need(not grouped or (group_size or 0) > 0, f"{where}.group_size", f"strategy {strategy!r} needs a group_size",
         "set a positive group_size, e.g. 128")
    need(grouped or (group_size or 0) <= 0, f"{where}.group_size", f"group_size {group_size} needs strategy group",
         "set strategy to group or group_size to null")
    need((strategy == "block") == (block is not None), f"{where}.block_structure",
         "strategy 'block' and block_structure go together", "set both or neither")
    need(strategy != "token" or bool(dynamic), f"{where}.dynamic", "per-token quantization must be dynamic",
         "set dynamic to true")
    need(not dynamic or strategy in ("token", "tensor", "tensor_group", "group"), f"{where}.dynamic",
         f"strategy {strategy!r} cannot be dynamic", "use token / tensor / group, or dynamic false")
    need(dynamic != "local" or strategy == "tensor_group", f"{where}.dynamic", '"local" needs strategy tensor_group',
         "set dynamic to true / false")
    need(strategy != "attn_head" or kv_cache, f"{where}.strategy", "per-attention-head quantization is for the "
         "KV cache only", "use tensor / channel / group strategies", UnsupportedError)
    return Args(DTYPES[kind, bits], symmetric, strategy, group_size, block, dynamic, ACTORDER[actorder], scale_dtype,
                where)


def _block(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str) and value.count("x") == 1:  # legacy "128x128"
        value = [int(p) if p.isdigit() else p for p in value.split("x")]
    need(isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value), where,
         f"invalid block_structure {value!r:.60}", "two positive integers [block_n, block_k]")
    return value[0], value[1]


def _torch_dtype(value: Any, where: str, table: dict) -> Any:
    if value is None:
        return None
    name = require_type(value, str, where, "a torch dtype", f"one of {list(table)}").removeprefix("torch.")
    need(name in table, where, f"unknown dtype {value!r:.60}", f"one of {['torch.' + n for n in table]}")
    return table[name]


def _weight(a: Args, fmt: str, group_where: str) -> tuple[WeightSpec, tuple[TensorSpec, ...]]:
    name, packing = FORMATS[fmt]
    need(not a.dynamic, f"{a.where}.dynamic", "dynamically quantized weights are not a compressed checkpoint",
         'set dynamic false (or load the bf16 model with online="fp8_per_tensor")', UnsupportedError)
    scale_dtype = ScaleDtype.FP32
    if fmt in FIXED_LAYOUTS:
        dtype, strategy, group, scale_dtype = FIXED_LAYOUTS[fmt]
        need((a.dtype, a.strategy, a.group_size) == (dtype, strategy, group), a.where,
             f"format {fmt!r} holds {dtype.value} weights, strategy {strategy!r}, group_size {group}",
             f"fix the weights or the format (these are {a.dtype.value}, {a.strategy!r}, group_size {a.group_size})")
    else:
        need(a.dtype not in (QDtype.FP4_E2M1, QDtype.FP6_E2M3) and not (packing is Packing.INT32 and a.dtype is
             QDtype.FP8_E4M3), f"{group_where}.format", f"format {fmt!r} cannot hold {a.dtype.value} weights",
             "pack-quantized holds int; float-/int-/naive-quantized fp8 or int; fp4 needs nvfp4-/mxfp4-pack-quantized")
    need(a.scale_dtype in (None, scale_dtype), f"{a.where}.scale_dtype", f"{a.scale_dtype} weight scales are not "
         "supported here", f"this format stores {scale_dtype.value} scales", UnsupportedError)
    need(a.strategy != "tensor_group" or fmt == "nvfp4-pack-quantized", f"{a.where}.strategy",
         "tensor_group weights are NVFP4 only", "use nvfp4-pack-quantized fp4 weights, group_size 16", UnsupportedError)
    need(a.symmetric or a.dtype.value.startswith("int"), f"{a.where}.symmetric",
         f"asymmetric {a.dtype.value} weights are not supported (zero points are for int weights)",
         "use symmetric quantization", UnsupportedError)
    need(not a.actorder or a.strategy == "group", f"{a.where}.actorder", 'actorder "group" needs strategy group',
         'set actorder to "static" or null')
    scale = {"tensor": ScaleSpec(Granularity.TENSOR), "channel": ScaleSpec(Granularity.CHANNEL),
             "block": ScaleSpec(Granularity.BLOCK, block=a.block or (0, 0))}.get(
        a.strategy, ScaleSpec(Granularity.GROUP, scale_dtype, group_size=a.group_size or 0))
    weight = WeightSpec(a.dtype, scale, packing, global_scale=a.strategy == "tensor_group",
                        zero_point=not a.symmetric, act_order=a.actorder == "group")
    optional = [(weight.global_scale, TensorSpec("weight_global_scale", "weight_global_scale", reciprocal=True)),
                # pack-quantized packs group / channel zero points along out_features (a tensor one is int8)
                (weight.zero_point, TensorSpec("weight_zero_point", "weight_zero_point", packed_rows=packing is
                                               Packing.INT32 and a.strategy in ("group", "channel"))),
                (weight.act_order, TensorSpec("weight_g_idx", "weight_g_idx")),
                (packing is Packing.INT32, TensorSpec("weight_shape", "weight_shape"))]
    return weight, (TensorSpec("weight", name), TensorSpec("weight_scale", "weight_scale"),
                    *(spec for present, spec in optional if present))


def _act(a: Args, where: str) -> tuple[ActSpec, tuple[TensorSpec, ...]]:
    fp = a.dtype.value.startswith("fp")
    need(not a.actorder, f"{where}.actorder", "actorder applies to weights only", "set it to null")
    need(a.strategy not in ("channel", "block"), f"{where}.strategy", f"{a.strategy!r} is not an activation strategy",
         "use token, tensor, group or tensor_group")
    need(a.dtype is not QDtype.INT4 and (a.symmetric or not fp), where,
         f"{'' if a.symmetric else 'asymmetric '}{a.dtype.value} activations are not supported",
         "use fp8 / int8 / nvfp4 / mx activations, symmetric for floats", UnsupportedError)
    if a.strategy == "tensor_group":  # NVFP4: dynamic per-16 fp8 scales under a static global scale
        need((a.dtype, a.group_size) == (QDtype.FP4_E2M1, 16) and a.dynamic is not True, where,
             "tensor_group activations are NVFP4 only: fp4, group_size 16, static global scale",
             'set type float, num_bits 4, group_size 16, dynamic "local"', UnsupportedError)
        return (ActSpec(QDtype.FP4_E2M1, True, ScaleSpec(Granularity.GROUP, ScaleDtype.FP8_E4M3, group_size=16),
                        global_scale=True), (TensorSpec("input_global_scale", "input_global_scale", reciprocal=True),))
    if a.strategy == "group":
        need(bool(a.dynamic), f"{where}.dynamic", "static per-group activation scales are not supported",
             "set dynamic to true", UnsupportedError)
        if a.dtype in (QDtype.FP4_E2M1, QDtype.FP6_E2M3) or a.scale_dtype is ScaleDtype.E8M0:
            need(a.group_size == 32, f"{where}.group_size", f"MX activations use groups of 32, not {a.group_size}",
                 "set group_size to 32", UnsupportedError)
            return mx_act(a.dtype), ()
        group = ScaleSpec(Granularity.GROUP, group_size=a.group_size or 0)
        return ActSpec(a.dtype, True, group, symmetric=a.symmetric), ()
    need(a.dtype not in (QDtype.FP4_E2M1, QDtype.FP6_E2M3), f"{where}.strategy", f"{a.dtype.value} activations need "
         "group scales", "use strategy tensor_group (NVFP4) or group 32 (MX)", UnsupportedError)
    need(a.scale_dtype in (None, ScaleDtype.FP32), f"{where}.scale_dtype", f"{a.scale_dtype} activation scales are "
         "not supported here", "drop scale_dtype", UnsupportedError)
    need(bool(a.dynamic) or a.symmetric, f"{where}.symmetric", "static asymmetric activations (an input zero point) "
         "are not supported", "use symmetric or dynamic activations", UnsupportedError)
    gran = Granularity.TOKEN if a.strategy == "token" else Granularity.TENSOR
    act = ActSpec(a.dtype, bool(a.dynamic), ScaleSpec(gran), symmetric=a.symmetric)
    return act, (() if act.dynamic else (TensorSpec("input_scale", "input_scale"),))


def _kv_cache(raw: Any, where: str) -> KVCacheSpec:
    """Static symmetric fp8 (or int8) per layer (``tensor``) or per KV head (``attn_head``)."""
    a = _args(raw, where, kv_cache=True)
    need(a.dtype in (QDtype.FP8_E4M3, QDtype.INT8) and a.strategy in ("tensor", "attn_head") and not a.dynamic
         and a.symmetric, where, f"KV-cache quantization {a.dtype.value} {a.strategy} "
         f"{'dynamic' if a.dynamic else 'static'}{'' if a.symmetric else ' asymmetric'} is not supported",
         "use static symmetric fp8 (or int8), strategy tensor or attn_head", UnsupportedError)
    return KVCacheSpec(a.dtype, ("k_scale", "v_scale"), source=f"compressed-tensors {where}",
                       per_head=a.strategy == "attn_head")
