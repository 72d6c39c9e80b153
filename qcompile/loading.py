"""Loading quantized HF checkpoints through transformers, keeping the quantized storage.

There is one loading path: transformers' ``from_pretrained`` with qcompile's ``HfQuantizer``.

* ModelOpt checkpoints: importing qcompile registers ``quant_method: "modelopt"`` with transformers,
  so plain ``AutoModelForCausalLM.from_pretrained(path)`` works (transformers 5 has no ModelOpt
  support and otherwise loads them as silently wrong bf16).
* compressed-tensors, Quark, online FP8: pass ``quantization_config=qcompile.QCompileConfig(...)``
  to ``from_pretrained`` (or call :func:`qcompile.load`); qcompile then takes over from
  transformers' own quantizer for that checkpoint.

Before any weight is read, the quantizer reads the safetensors *headers*, resolves every
``nn.Linear`` through the parsed :class:`~qcompile.formats.QuantConfig`, validates the layer's
tensors (presence, dtype, shape) and swaps in a :class:`~qcompile.linear.QuantLinear` whose
parameters have the on-disk dtypes; transformers then streams the shards into them.
"""

from __future__ import annotations

import inspect
import math
import logging
import os
import re
import threading
import warnings
from typing import Any

import torch
from torch import nn
from transformers import modeling_utils
from transformers import utils as transformers_utils
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          AutoHfQuantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .checkpoint_files import (confinement_root, find_index, index_weight_map, read_checkpoint, read_checkpoint_dir,
                               read_json)
from .errors import CheckpointError, ConfigError, UnsupportedError
from .formats import QuantConfig, parse_quant_config
from .experts import QuantExperts, experts_on_disk, is_experts, locate_experts
from .generation import DeferredGenerate
from .linear import QuantLinear
from .modules import is_router, linear_shape
from .scheme import Granularity, QuantScheme, squeezed

log = logging.getLogger("qcompile")

# Checkpoint tensor suffixes that only a quantized layer has.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale",
                  "input_global_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_scale_inv")
# Where producers store a layer's KV-cache scales, relative to its attention module (the three that
# vLLM's maybe_remap_kv_scale_name reads): ModelOpt's HF export; compressed-tensors (and Quark's "fp8"
# export mode); Quark.
KV_SCALE_NAMES = (("k_proj.k_scale", "v_proj.v_scale"), ("k_scale", "v_scale"),
                  ("k_proj.output_scale", "v_proj.output_scale"))
ATTENTION_SCALES = ("q_scale", "prob_scale")  # quantized attention itself, which qcompile does not run

class QCompileConfig(QuantizationConfigMixin):
    """qcompile's quantization config for ``from_pretrained``.

    ``QCompileConfig()`` runs the checkpoint's own quantization config (compressed-tensors, Quark,
    ModelOpt); ``QCompileConfig(online="fp8_per_tensor" | "fp8_per_block", ignore=[...])`` quantizes a
    bf16/fp16 checkpoint to FP8 while loading. ``source`` (set by qcompile) is the producer config dict.
    """

    def __init__(self, online: str | None = None, ignore: list[str] | None = None, source: dict | None = None,
                 **kwargs):
        self.quant_method = "qcompile"
        self.online = online
        self.ignore = list(ignore or [])
        self.source = source
        self.saved_as: dict | None = None  # an online config's compressed-tensors form, set when saving
        if online is not None:
            from .formats.online import online_config
            self.source = online_config(online, ignore=self.ignore)

    def parsed(self) -> QuantConfig:
        if self.source is None:
            raise ConfigError("the checkpoint has no quantization config and no online scheme was asked for",
                              where="QCompileConfig", fix='pass QCompileConfig(online="fp8_per_tensor") for a bf16 checkpoint')
        return parse_quant_config(self.source)

    def to_dict(self) -> dict[str, Any]:
        # Saving the model writes the producer's config back, unchanged; an online one as the
        # compressed-tensors config of the FP8 layers it made (QCompileHfQuantizer.get_state_dict_and_metadata).
        if self.saved_as is not None:
            return dict(self.saved_as)
        return dict(self.source) if self.source else {"quant_method": "qcompile", "online": self.online}


class ModelOptConfig(QCompileConfig):
    """What transformers builds from a ModelOpt ``quantization_config`` once qcompile is imported."""

    def __init__(self, **config):
        super().__init__(source=dict(config))
        self.quant_method = "modelopt"


class QCompileHfQuantizer(HfQuantizer):
    requires_calibration = False

    def __init__(self, quantization_config: QCompileConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.plan: dict[str, QuantLinear | QuantExperts] = {}
        self.kv_scales: dict[str, tuple[str, str]] = {}
        self.kv_disk: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # KV-scale name -> (dtype, shape) as read
        self.side_files: dict[str, bytes] = {}  # files the checkpoint keeps beside config.json, saved back
        self.save_directory: str | None = None  # while save_pretrained runs (_SaveWithSideFiles)

    def validate_environment(self, *args, **kwargs):
        self.qconfig = self.quantization_config.parsed()
        # A legacy ModelOpt checkpoint keeps its config in hf_quant_config.json only, so transformers
        # does not know it is pre-quantized; the parsed format decides.
        self.pre_quantized = self.qconfig.format != "online"

    def update_dtype(self, dtype):
        return dtype if dtype is not None else torch.bfloat16

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        header = read_headers(checkpoint_files, getattr(model.config, "name_or_path", None))
        self.plan = plan_model(model, self.qconfig, header)
        self.kv_scales = plan_kv_scales(model, self.qconfig, header)
        self.kv_disk = {f"{name}.{suffix}": header[f"{name}.{suffix}"]
                        for name, pair in self.kv_scales.items() for suffix in pair}
        self.side_files = _side_files(checkpoint_files, self.qconfig)

    def update_weight_conversions(self, weight_conversions, model=None):
        """transformers' checkpoint conversions, less those that would merge the per-expert tensors of a
        planned QuantExperts into the fused HF parameters: those tensors load unmerged into its slots."""
        fused = [f"{name}.{p}" for name, m in self.plan.items() if isinstance(m, QuantExperts)
                 and not getattr(m, "loads_fused", False) for p in m.hf_template._parameters]
        kept = [c for c in weight_conversions if not _merges_into(c, fused)]
        base = super().update_weight_conversions
        return base(kept, model) if "model" in inspect.signature(base).parameters else base(kept)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in self.plan.values():
            module.finalize()
        finalize_kv_scales(model, self.kv_scales)
        model.qcompile_plan = {name: m.lq for name, m in self.plan.items()}
        model.qcompile_config = self.qconfig
        if self.side_files:
            model.save_pretrained = _SaveWithSideFiles(model)
        if hasattr(type(model), "generate"):
            model.generate = DeferredGenerate(model)
        return model

    def is_serializable(self, *args, **kwargs):
        return True

    def get_state_dict_and_metadata(self, model):
        """What ``save_pretrained`` writes: the model's state dict with every QuantLinear's tensors as its
        checkpoint stored them (:meth:`QuantLinear.disk_tensors`); the config is the producer's (to_dict).
        An online model is saved as the compressed-tensors float-quantized checkpoint it now is."""
        modules = dict(model.named_modules())
        self._check_still_quantized(modules)
        state = model.state_dict()
        for name, module in modules.items():
            if isinstance(module, (QuantLinear, QuantExperts)):
                for key in module.state_dict():
                    if key != "bias":
                        del state[f"{name}.{key}"]
                state.update({f"{name}.{key}": t for key, t in module.disk_tensors().items()})
        state.update(self._kv_disk_tensors(modules))
        if self.qconfig.format == "online":
            unquantized = sorted(name for name, m in modules.items() if isinstance(m, nn.Linear))
            self.quantization_config.saved_as = compressed_tensors_fp8(self.qconfig.layer.scheme, unquantized)
        if self.save_directory is not None:  # after the hub's timestamps, before its upload
            for file, content in self.side_files.items():
                with open(os.path.join(self.save_directory, file), "wb") as f:
                    f.write(content)
        return state, {}

    def _kv_disk_tensors(self, modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
        """The KV-cache scales as the checkpoint stored them (names, dtypes, shapes): a per-layer scale was
        repeated per KV head at load, so its first element is the stored value."""
        out = {}
        for name, pair in self.kv_scales.items():
            for suffix, leaf in zip(pair, ("k_scale", "v_scale")):
                dtype, shape = self.kv_disk[f"{name}.{suffix}"]
                t = getattr(modules[name], leaf)
                t = t[:1] if math.prod(shape) == 1 else t
                out[f"{name}.{suffix}"] = t.reshape(shape).to(dtype).clone()
        return out

    def _check_still_quantized(self, modules: dict[str, nn.Module]) -> None:
        for name, planned in self.plan.items():
            if not isinstance(modules.get(name), type(planned)):
                raise UnsupportedError(
                    f"the quantized layer was replaced after loading (now {type(modules.get(name)).__name__}); the "
                    "checkpoint's config would no longer describe it", where=name,
                    fix="save the model as loaded; to save a dequantized model in bf16, delete model.hf_quantizer and "
                        "model.config.quantization_config first")

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _merges_into(conversion, params: list[str]) -> bool:
    """Whether transformers' ``conversion`` (a WeightConverter) builds one of ``params`` (full names)."""
    if type(conversion).__name__ != "WeightConverter":
        return False
    for pattern in getattr(conversion, "_original_target_patterns", conversion.target_patterns):
        try:
            regex = re.compile(pattern.lstrip("^") + r"$")
        except re.error:
            continue
        if any(regex.search(p) for p in params):
            return True
    return False


def _side_files(checkpoint_files, qconfig: QuantConfig) -> dict[str, bytes]:
    """ModelOpt's hf_quant_config.json beside the checkpoint, as bytes (saving writes it back)."""
    if qconfig.format != "modelopt" or not checkpoint_files:
        return {}
    path = os.path.join(os.path.dirname(checkpoint_files[0]), "hf_quant_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        return {"hf_quant_config.json": f.read()}


class _SaveWithSideFiles:
    """``model.save_pretrained`` of a checkpoint with files beside config.json: the quantizer writes them
    into the save directory during the save (so that a push to the Hub uploads them too). An object,
    not a bound method, so that the model still pickles and deep-copies."""

    def __init__(self, model):
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        quantizer = self.model.hf_quantizer
        quantizer.save_directory = os.fspath(save_directory)
        try:
            return type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        finally:
            quantizer.save_directory = None


def compressed_tensors_fp8(scheme: QuantScheme, ignore: list[str]) -> dict[str, Any]:
    """The compressed-tensors float-quantized config of FP8 layers of ``scheme`` (online FP8: per-tensor
    weights with dynamic per-tensor activations, or b x b blocks with dynamic 1 x b groups); ``ignore``:
    the Linear modules left unquantized."""
    w, act = scheme.weight, scheme.act
    block = w.scale.granularity is Granularity.BLOCK

    def args(strategy: str, dynamic: bool, **kw) -> dict[str, Any]:
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": kw.get("group"), "block_structure": kw.get("block"), "actorder": None}
    weights = args("block", False, block=list(w.scale.block)) if block else args("tensor", False)
    acts = args("group", True, group=act.scale.group_size) if block else args("tensor", True)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None,
             "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignore, "kv_cache_scheme": None}


def read_headers(checkpoint_files, directory: str | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` of the files transformers resolved, validated completely
    (:mod:`qcompile.checkpoint_files`: every header, the shard index beside them, each file inside the
    checkpoint ``directory``); no tensor data is read."""
    files = [str(f) for f in checkpoint_files or ()]
    local = directory if directory and os.path.isdir(directory) else None
    root = confinement_root(local or os.path.dirname(os.path.abspath(files[0]))) if files else None
    return read_checkpoint(files, find_index(files, local), root)


def plan_model(model: nn.Module, qconfig: QuantConfig, header: dict) -> dict[str, nn.Module]:
    """Swap every quantized ``nn.Linear`` of ``model`` for a planned QuantLinear and every quantized
    experts module for a planned QuantExperts. Refuses checkpoint tensors that belong to a quantized
    module qcompile cannot run."""
    plan: dict[str, nn.Module] = {}
    covered: list[str] = []  # checkpoint prefixes of the planned experts
    routers: list[str] = []
    on_disk = experts_on_disk(header)
    for name, module in list(model.named_modules()):
        if is_experts(module):
            new = _plan_experts(name, module, qconfig, header, on_disk)
            if new is not None:
                _swap(model, name, new)
                plan[name] = new
                covered.append(new.disk_prefix + ".")
            continue
        if linear_shape(module) is None:
            continue
        if qconfig.format == "online" and is_router(name, module):
            routers.append(name)  # routers choose experts; never quantized online (qcompile.modules)
            continue
        lq = qconfig.resolve(name, "linear")
        if lq is None:
            _check_unquantized(name, header, qconfig)
            continue
        if not lq.online and not any(f"{name}.{t.name}" in header for t in lq.tensors):
            # A module the config targets but the checkpoint stored unquantized (e.g. a router the
            # producer skipped without listing it): leave it in bf16, as the producer did.
            if f"{name}.weight" in header:
                log.info("qcompile: %s is targeted by %s but stored unquantized; kept in bf16", name, lq.source)
                continue
        new = QuantLinear.plan(module, name, lq, header)
        _swap(model, name, new)
        plan[name] = new
    _check_leftovers(model, plan, header, qconfig, tuple(covered))
    _report_coverage(model, plan, routers, qconfig)
    return plan


def _report_coverage(model: nn.Module, plan: dict, routers: list[str], qconfig: QuantConfig) -> None:
    """Say how much of the model was quantized: a warning when nothing was, or when modules that hold
    most weights (MoE experts, modules with a forward of their own) stay unquantized."""
    linears = [name for name, m in model.named_modules() if linear_shape(m) is not None or name in plan]
    left = [name for name in linears if name not in plan and name not in routers]
    log.info("qcompile: %d of %d linear layers quantized (%s); left as they are: %d routers, %s", len(plan),
             len(linears), qconfig.describe(), len(routers), left[:8])
    if not plan:
        warnings.warn(f"qcompile: no layer of {type(model).__name__} was quantized ({qconfig.describe()}): no "
                      "module is a linear the config targets", stacklevel=4)
    skipped = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and linear_shape(m) is None and not is_router(name, m)]
    if skipped:
        warnings.warn(f"qcompile: {len(skipped)} nn.Linear subclasses with a forward of their own stay unquantized "
                      f"({skipped[0]}: {type(model.get_submodule(skipped[0])).__name__})", stacklevel=4)
    experts = [name for name, m in model.named_modules() if is_experts(m) and name not in plan]
    if experts:
        warnings.warn(f"qcompile: {len(experts)} MoE experts modules stay in {next(model.parameters()).dtype} "
                      f"({experts[0]}, ...): {qconfig.describe()} does not quantize them", stacklevel=4)


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    model.get_submodule(parent).register_module(leaf, new) if parent else setattr(model, leaf, new)


def _plan_experts(name: str, module: nn.Module, qconfig: QuantConfig, header: dict,
                  on_disk: dict[str, set[str]]) -> QuantExperts | None:
    """The QuantExperts for the HF experts module ``name``, or None when its experts stay in the model
    dtype (the config leaves them unquantized). Online: an OnlineExperts, whichever way the checkpoint
    stores the experts (per expert or fused)."""
    if qconfig.format == "online":
        from .online_experts import OnlineExperts

        lq = qconfig.resolve(name, "moe")
        return None if lq is None else OnlineExperts.plan_online(module, name, lq)
    if qconfig.fused_experts:
        lq = qconfig.resolve(name, "moe")
        if lq is None:
            _check_fused_unquantized(name, header, qconfig)
            return None
        return QuantExperts.plan(module, name, lq, header, name, fused=True)
    found = locate_experts(name, on_disk)
    if found is None:
        return None  # stored fused in the model's own layout (bf16), or not at all: transformers loads it
    prefix, naming = found
    lq = qconfig.resolve(prefix, "moe", naming)
    if lq is None or lq.online:
        for e in range(module.gate_up_proj.shape[0]):
            for leaf in naming:
                _check_unquantized(f"{prefix}.{e}.{leaf}", header, qconfig)
        return None
    return QuantExperts.plan(module, name, lq, header, prefix, naming)


def _check_fused_unquantized(name: str, header: dict, qconfig: QuantConfig) -> None:
    """An experts module a fused-experts config leaves unquantized must hold float tensors only."""
    stored = next((key for key, (dtype, _) in header.items() if key.startswith(f"{name}.") and dtype not in
                   (torch.float32, torch.bfloat16, torch.float16)), None)
    if stored is not None:
        raise CheckpointError(
            f"the {qconfig.format} config leaves this experts module unquantized but the checkpoint stores it "
            f"quantized ({stored}: {header[stored][0]})", where=name,
            fix="the quantization config's modules_to_not_convert does not match the checkpoint; fix the config")


def _check_unquantized(name: str, header: dict, qconfig: QuantConfig) -> None:
    """An excluded layer must be stored unquantized; otherwise config and checkpoint disagree."""
    entry = header.get(f"{name}.weight")
    scale = next((s for s in QUANT_SUFFIXES if f"{name}.{s}" in header), None)
    if scale is not None or (entry is not None and entry[0] not in (torch.float32, torch.bfloat16, torch.float16)):
        raise CheckpointError(
            f"the {qconfig.format} config leaves this layer unquantized but the checkpoint stores it quantized"
            f" ({name}.{scale or 'weight'}: {header.get(f'{name}.{scale}', entry)[0]})", where=name,
            fix="the quantization config's exclude/ignore list does not match the checkpoint; fix the config")


def _check_leftovers(model: nn.Module, plan: dict, header: dict, qconfig: QuantConfig, covered: tuple[str, ...]
                     ) -> None:
    """Quantized tensors of modules qcompile does not plan (``covered``: checkpoint prefixes the planned
    experts take). KV-cache scales are :func:`plan_kv_scales`'s."""
    unused = []
    for key in header:
        module, _, suffix = key.rpartition(".")
        if module in plan or key.startswith(covered):
            continue
        if suffix in ATTENTION_SCALES:
            unused.append(key)
            continue
        if suffix in QUANT_SUFFIXES or (suffix == "weight" and header[key][0] in (torch.float8_e4m3fn, torch.uint8)):
            raise UnsupportedError(
                f"the checkpoint stores quantized tensors for a module qcompile cannot run ({key}): no Linear or "
                "experts module of the model holds them", where=module,
                fix="check that config.json's architecture matches the checkpoint, or exclude the module in the "
                    "quantization config")
    if unused:
        warnings.warn(f"qcompile: the checkpoint has {len(unused)} attention-quantization scales ({unused[0]}, ...) "
                      "that are not used: attention runs in the model dtype", stacklevel=3)


# -- KV-cache scales -------------------------------------------------------------------------------

def is_attention(module: nn.Module) -> bool:
    """A decoder attention module of transformers: what reads and writes one KV-cache layer."""
    return type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int)


def _num_kv_heads(model: nn.Module) -> int:
    cfg = model.config.get_text_config()
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def plan_kv_scales(model: nn.Module, qconfig: QuantConfig, header: dict) -> dict[str, tuple[str, str]]:
    """Find every attention module's KV-cache scales in ``header`` (any of :data:`KV_SCALE_NAMES`) and
    declare fp32 buffers under their checkpoint names, so that transformers loads them;
    :func:`finalize_kv_scales` then moves them to the attention module. Returns ``{attention module:
    (key suffix, value suffix)}``. The config and the tensors must agree: scales for every attention
    layer exactly when the config declares a KV cache, float, one per layer (or per KV head for a
    per-head config); anything else is a CheckpointError naming the tensor."""
    attention = [name for name, m in model.named_modules() if is_attention(m)]
    found = {}
    for name in attention:
        pairs = [p for p in KV_SCALE_NAMES if any(f"{name}.{s}" in header for s in p)]
        if len(pairs) > 1:
            raise CheckpointError(f"the checkpoint stores two sets of KV-cache scales ({name}.{pairs[0][0]} and "
                                  f"{name}.{pairs[1][0]})", where=name, fix="keep the set its producer writes")
        if pairs:
            found[name] = pairs[0]
    spec = qconfig.kv_cache
    stray = sorted(k for k in header if k.rpartition(".")[2] in ("k_scale", "v_scale") and
                   not any(k.startswith(f"{a}.") for a in found))
    if spec is None and (found or stray):
        key = next((f"{name}.{pair[0]}" for name, pair in found.items()), None) or stray[0]
        raise CheckpointError(f"the checkpoint stores KV-cache scales ({key}, ...) but its {qconfig.format} config "
                              "declares no KV-cache quantization", where=key.rpartition(".")[0],
                              fix="add the producer's KV-cache entry to the config (ModelOpt kv_cache_quant_algo, "
                                  "compressed-tensors kv_cache_scheme) or remove the scales from the checkpoint")
    missing = [name for name in attention if name not in found]
    if spec is not None and missing:
        have = f" (other layers have them, e.g. {next(iter(found))})" if found else ""
        raise CheckpointError(
            f"the config declares a {spec.dtype.value} KV cache ({spec.source}) but tensor "
            f"{missing[0]}.{spec.scale_names[0]} is missing{have}", where=missing[0],
            fix="re-export the checkpoint with its KV-cache scales, or drop the KV-cache entry from the config "
                '(qcompile.load(..., kv_cache="fp8") then computes scales at the first prefill)')
    heads = _num_kv_heads(model)
    for name, pair in found.items():
        for suffix in pair:
            _declare_kv_scale(model, name, suffix, header, heads if spec.per_head else 1)
    if stray:
        warnings.warn(f"qcompile: {len(stray)} KV-cache scales belong to no decoder attention layer ({stray[0]}, "
                      "...); they are not used", stacklevel=3)
    return found


def _declare_kv_scale(model: nn.Module, attention: str, suffix: str, header: dict, count: int) -> None:
    key = f"{attention}.{suffix}"
    if key not in header:
        raise CheckpointError(f"tensor {key!r} is missing; the checkpoint has its key / value pair", where=attention,
                              fix="re-export the checkpoint: every attention layer stores a key and a value scale")
    dtype, shape = header[key]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or squeezed(shape) != squeezed((count,)):
        per = f"one per KV head ({count})" if count > 1 else "one per layer"
        raise CheckpointError(f"tensor {key!r} is {dtype} {list(shape)}; a KV-cache scale is a float, {per}",
                              where=attention, fix="the checkpoint does not match its KV-cache config; re-export it")
    owner, _, leaf = key.rpartition(".")
    parent, _, child = owner.rpartition(".")
    if owner != attention and not hasattr(model.get_submodule(parent), child):  # e.g. k_proj of a fused qkv model
        model.get_submodule(parent).register_module(child, KVScalePlaceholder())
    model.get_submodule(owner).register_buffer(leaf, torch.empty(shape, dtype=torch.float32, device="meta"))


class KVScalePlaceholder(nn.Module):
    """Holds a KV-cache scale stored under a module the model does not have, while it loads."""


@torch.no_grad()
def finalize_kv_scales(model: nn.Module, found: dict[str, tuple[str, str]]) -> None:
    """Check the loaded scales (finite, positive) and register them on their attention module as
    non-persistent fp32 buffers ``k_scale`` / ``v_scale`` of shape [num_kv_heads] (a per-layer scale
    repeated), where :class:`qcompile.kv_cache.FP8Cache` reads them."""
    heads = _num_kv_heads(model)
    for name, pair in found.items():
        attn = model.get_submodule(name)
        scales = []
        for suffix in pair:
            owner, _, leaf = f"{name}.{suffix}".rpartition(".")
            holder = model.get_submodule(owner)
            t = holder._buffers.pop(leaf)
            if t.device.type == "meta":
                raise CheckpointError(f"tensor {name}.{suffix} was not loaded", where=name,
                                      fix="the checkpoint index lists it but no shard held it; check the shards")
            t = t.float().reshape(-1)
            if not (torch.isfinite(t).all() and (t > 0).all()):
                raise CheckpointError(f"tensor {name}.{suffix} holds {t.tolist()[:4]}: a KV-cache scale must be "
                                      "finite and positive", where=name, fix="re-export or re-calibrate the checkpoint")
            scales.append(t.expand(heads).contiguous() if t.numel() == 1 else t.contiguous())
            if isinstance(holder, KVScalePlaceholder) and not holder._buffers:
                delattr(model.get_submodule(owner.rpartition(".")[0]), owner.rpartition(".")[2])
        for leaf, t in zip(("k_scale", "v_scale"), scales):
            attn.register_buffer(leaf, t, persistent=False)


# -- registration with transformers ------------------------------------------------------------

# transformers' own quantizers for formats qcompile reads too, and the check for the package each needs.
TRANSFORMERS_BACKENDS = {"compressed-tensors": ("compressed-tensors", "is_compressed_tensors_available"),
                         "quark": ("amd-quark", "is_quark_available")}
_REGISTER_LOCK = threading.Lock()
_LOAD_LOCK = threading.RLock()  # from_pretrained switches process-wide state (the default dtype)


def _merge_quantization_configs(original):
    def merge(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, QCompileConfig):
            # qcompile takes over the checkpoint's own config (compressed-tensors, Quark, ModelOpt)
            if quantization_config_from_args.online is not None:
                raise ConfigError("online quantization was asked for a checkpoint that is already quantized",
                                  where="QCompileConfig(online=...)", fix="drop online=... to run the checkpoint's own quantization")
            raw = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
            return QCompileConfig(source=dict(raw))
        if quantization_config_from_args is None:
            _refuse_missing_backend(quantization_config)
        return original(cls, quantization_config, quantization_config_from_args)
    return classmethod(merge)


def _refuse_missing_backend(config) -> None:
    """A checkpoint transformers would hand to its own quantizer, whose package is not installed:
    qcompile can run it, so say how instead of asking for the package."""
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    package, check = TRANSFORMERS_BACKENDS.get(getattr(method, "value", method), (None, None))
    if package and not getattr(transformers_utils, check)():
        raise ConfigError(f"the checkpoint is {method}, which transformers loads only with the {package} package; "
                          "qcompile reads this format itself", where="from_pretrained(quantization_config=None)",
                          fix="pass quantization_config=qcompile.QCompileConfig() to from_pretrained, or call "
                              "qcompile.load(path)")


def _checked_shard_index(original):
    """transformers' get_checkpoint_shard_files, after qcompile's check of a local index's structure
    (a broken index is qcompile's CheckpointError naming it, not a KeyError inside transformers)."""
    def get_checkpoint_shard_files(pretrained_model_name_or_path, index_filename, *args, **kwargs):
        if os.path.isfile(index_filename):
            index_weight_map(index_filename)
        return original(pretrained_model_name_or_path, index_filename, *args, **kwargs)
    get_checkpoint_shard_files.qcompile_checked = True
    return get_checkpoint_shard_files


def register_with_transformers() -> None:
    """Idempotent and thread-safe. Registers "qcompile" and "modelopt" quant methods with transformers."""
    with _REGISTER_LOCK:
        if AUTO_QUANTIZER_MAPPING.get("qcompile") is QCompileHfQuantizer:
            return
        AUTO_QUANTIZATION_CONFIG_MAPPING["qcompile"] = QCompileConfig
        AUTO_QUANTIZER_MAPPING["qcompile"] = QCompileHfQuantizer
        if "modelopt" not in AUTO_QUANTIZATION_CONFIG_MAPPING:
            AUTO_QUANTIZATION_CONFIG_MAPPING["modelopt"] = ModelOptConfig
            AUTO_QUANTIZER_MAPPING["modelopt"] = QCompileHfQuantizer
        AutoHfQuantizer.merge_quantization_configs = _merge_quantization_configs(
            AutoHfQuantizer.merge_quantization_configs.__func__)
        if not getattr(modeling_utils.get_checkpoint_shard_files, "qcompile_checked", False):
            modeling_utils.get_checkpoint_shard_files = _checked_shard_index(modeling_utils.get_checkpoint_shard_files)


# -- public entry point -------------------------------------------------------------------------

def checkpoint_quant_config(path: str) -> dict | None:
    """The producer config of a local checkpoint directory: config.json's quantization_config, else
    a ModelOpt hf_quant_config.json beside it, else None."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError("no config.json", where=path, fix="point at a HF checkpoint directory")
    quant = read_json(cfg_path, "config.json").get("quantization_config")
    if quant is not None:
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config must be a JSON object, got a JSON {type(quant).__name__}",
                              where=f"{cfg_path}: quantization_config",
                              fix="write the producer's quantization config object there, or remove the key")
        return quant
    legacy = os.path.join(path, "hf_quant_config.json")
    return read_json(legacy, "hf_quant_config.json") if os.path.isfile(legacy) else None


def _device_map(device: str | torch.device | None) -> dict | None:
    """``from_pretrained``'s device_map for ``device``, refused when torch cannot place a tensor there."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"invalid device {device!r:.80} ({str(e).splitlines()[0]})",
                          where="qcompile.load(device=...)",
                          fix='pass "cpu", "cuda", "cuda:<index>" or a torch.device') from None
    try:
        torch.empty(0, device=dev)
    except (AssertionError, RuntimeError) as e:
        raise UnsupportedError(f"this machine cannot place tensors on {dev} ({e})", where="qcompile.load(device=...)",
                               fix='pass device="cpu" (or leave it out), or run where that device exists') from None
    return {"": str(dev)}


def load(path: str, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
         online: str | None = None, ignore: list[str] | None = None, kv_cache: str | None = None, **kwargs):
    """Load a quantized (or, with ``online=``, a bf16) causal-LM checkpoint directory as a
    transformers model with qcompile's QuantLinear layers. ``device``: where weights go
    ("cpu", "cuda", ...). ``kv_cache="fp8"``: the model runs with :class:`qcompile.kv_cache.FP8Cache`,
    on the checkpoint's KV-cache scales when it has them, else on scales measured at the first
    prefill (the checkpoint's scales load either way). Extra kwargs go to ``from_pretrained``. Safe to
    call from several threads (loads run one at a time)."""
    from transformers import AutoModelForCausalLM

    if kv_cache not in (None, "fp8"):
        raise ConfigError(f"unknown KV-cache dtype {kv_cache!r:.40}", where="qcompile.load(kv_cache=...)",
                          fix='pass kv_cache="fp8" or leave it out (the cache then stays in the model dtype)')
    register_with_transformers()
    device_map = _device_map(device)
    source = checkpoint_quant_config(path)
    if online is not None:
        if source is not None:
            raise ConfigError("online quantization was asked for a checkpoint that is already quantized",
                              where=path, fix="drop online=...")
        qcfg = QCompileConfig(online=online, ignore=ignore)
    elif source is None:
        raise ConfigError("the checkpoint has no quantization config", where=path,
                          fix='pass online="fp8_per_tensor" (or "fp8_per_block") to quantize a bf16 checkpoint')
    else:
        qcfg = QCompileConfig(source=source)
    parse_quant_config(qcfg.source)  # fail fast, before transformers builds anything
    read_checkpoint_dir(os.path.join(path, kwargs.get("subfolder") or ""), kwargs.get("variant"))
    with _LOAD_LOCK:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map,
                                                      quantization_config=qcfg, **kwargs)
    (loaded[0] if isinstance(loaded, tuple) else loaded).qcompile_kv_cache = kv_cache  # output_loading_info=True
    return loaded
