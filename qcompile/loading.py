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

import json
import logging
import os
import struct
import warnings
from typing import Any

import torch
from torch import nn
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          AutoHfQuantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .errors import CheckpointError, ConfigError, UnsupportedError
from .formats import QuantConfig, parse_quant_config
from .linear import QuantLinear
from .scheme import Granularity, QuantScheme

log = logging.getLogger("qcompile")

# Checkpoint tensor suffixes that only a quantized layer has.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale",
                  "input_global_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_scale_inv")
KV_SUFFIXES = ("k_scale", "v_scale", "q_scale", "prob_scale")

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}


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
        self.plan: dict[str, QuantLinear] = {}
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
        header = read_headers(checkpoint_files)
        self.plan = plan_model(model, self.qconfig, header)
        self.side_files = _side_files(checkpoint_files, self.qconfig)

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in self.plan.values():
            module.finalize()
        model.qcompile_plan = {name: m.lq for name, m in self.plan.items()}
        model.qcompile_config = self.qconfig
        if self.side_files:
            model.save_pretrained = _SaveWithSideFiles(model)
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
            if isinstance(module, QuantLinear):
                for key in module.state_dict():
                    if key != "bias":
                        del state[f"{name}.{key}"]
                state.update({f"{name}.{key}": t for key, t in module.disk_tensors().items()})
        if self.qconfig.format == "online":
            unquantized = sorted(name for name, m in modules.items() if isinstance(m, nn.Linear))
            self.quantization_config.saved_as = compressed_tensors_fp8(self.qconfig.layer.scheme, unquantized)
        if self.save_directory is not None:  # after the hub's timestamps, before its upload
            for file, content in self.side_files.items():
                with open(os.path.join(self.save_directory, file), "wb") as f:
                    f.write(content)
        return state, {}

    def _check_still_quantized(self, modules: dict[str, nn.Module]) -> None:
        for name in self.plan:
            if not isinstance(modules.get(name), QuantLinear):
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


def read_headers(checkpoint_files) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` from the safetensors headers (no tensor data is read)."""
    if not checkpoint_files:
        raise CheckpointError("no checkpoint files were found", where="checkpoint",
                              fix="point qcompile at a directory with model.safetensors (or its shards)")
    header: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            raise UnsupportedError(f"{os.path.basename(path)} is not a safetensors file", where=str(path),
                                   fix="quantized checkpoints must be saved as safetensors")
        with open(path, "rb") as f:
            try:
                (size,) = struct.unpack("<Q", f.read(8))
                meta = json.loads(f.read(size))
            except (struct.error, ValueError) as e:
                raise CheckpointError(f"unreadable safetensors header ({e})", where=str(path),
                                      fix="the file is truncated or not safetensors; re-download it") from None
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"tensor {name!r} has unknown dtype {info.get('dtype')!r}", where=str(path),
                                      fix="re-export the checkpoint")
            header[name] = (dtype, tuple(info["shape"]))
    return header


def plan_model(model: nn.Module, qconfig: QuantConfig, header: dict) -> dict[str, QuantLinear]:
    """Swap every quantized ``nn.Linear`` of ``model`` for a planned QuantLinear. Refuses checkpoint
    tensors that belong to a quantized module qcompile cannot run yet (e.g. fused MoE experts)."""
    plan: dict[str, QuantLinear] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
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
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, new) if parent else setattr(model, leaf, new)
        plan[name] = new
    _check_leftovers(model, plan, header, qconfig)
    return plan


def _check_unquantized(name: str, header: dict, qconfig: QuantConfig) -> None:
    """An excluded layer must be stored unquantized; otherwise config and checkpoint disagree."""
    entry = header.get(f"{name}.weight")
    scale = next((s for s in QUANT_SUFFIXES if f"{name}.{s}" in header), None)
    if scale is not None or (entry is not None and entry[0] not in (torch.float32, torch.bfloat16, torch.float16)):
        raise CheckpointError(
            f"the {qconfig.format} config leaves this layer unquantized but the checkpoint stores it quantized"
            f" ({name}.{scale or 'weight'}: {header.get(f'{name}.{scale}', entry)[0]})", where=name,
            fix="the quantization config's exclude/ignore list does not match the checkpoint; fix the config")


def _check_leftovers(model: nn.Module, plan: dict, header: dict, qconfig: QuantConfig) -> None:
    kv = []
    for key in header:
        module, _, suffix = key.rpartition(".")
        if module in plan:
            continue
        if suffix in KV_SUFFIXES:
            kv.append(key)
            continue
        if suffix in QUANT_SUFFIXES or (suffix == "weight" and header[key][0] in (torch.float8_e4m3fn, torch.uint8)):
            kind = "fused MoE experts" if ".experts." in key or key.endswith("experts") else "this module type"
            raise UnsupportedError(
                f"the checkpoint stores quantized tensors for a module qcompile cannot run yet ({key}; {kind})",
                where=module,
                fix="quantized MoE experts land with the fused-MoE issue; for now use a dense model or exclude the experts")
    if kv:
        warnings.warn(f"qcompile: the checkpoint has {len(kv)} KV-cache scales ({kv[0]}, ...); the KV cache stays in "
                      "the model dtype (KV-cache quantization is not implemented yet)", stacklevel=3)


# -- registration with transformers ------------------------------------------------------------

def _merge_quantization_configs(original):
    def merge(cls, quantization_config, quantization_config_from_args):
        if isinstance(quantization_config_from_args, QCompileConfig):
            # qcompile takes over the checkpoint's own config (compressed-tensors, Quark, ModelOpt)
            if quantization_config_from_args.online is not None:
                raise ConfigError("online quantization was asked for a checkpoint that is already quantized",
                                  where="QCompileConfig(online=...)", fix="drop online=... to run the checkpoint's own quantization")
            raw = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
            return QCompileConfig(source=dict(raw))
        return original(cls, quantization_config, quantization_config_from_args)
    return classmethod(merge)


def register_with_transformers() -> None:
    """Idempotent. Registers "qcompile" and "modelopt" quant methods with transformers."""
    if AUTO_QUANTIZER_MAPPING.get("qcompile") is QCompileHfQuantizer:
        return
    AUTO_QUANTIZATION_CONFIG_MAPPING["qcompile"] = QCompileConfig
    AUTO_QUANTIZER_MAPPING["qcompile"] = QCompileHfQuantizer
    if "modelopt" not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        AUTO_QUANTIZATION_CONFIG_MAPPING["modelopt"] = ModelOptConfig
        AUTO_QUANTIZER_MAPPING["modelopt"] = QCompileHfQuantizer
    AutoHfQuantizer.merge_quantization_configs = _merge_quantization_configs(
        AutoHfQuantizer.merge_quantization_configs.__func__)


# -- public entry point -------------------------------------------------------------------------

def checkpoint_quant_config(path: str) -> dict | None:
    """The producer config of a local checkpoint directory: config.json's quantization_config, else
    a ModelOpt hf_quant_config.json beside it, else None."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError("no config.json", where=path, fix="point at a HF checkpoint directory")
    with open(cfg_path) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ConfigError(f"config.json is not valid JSON ({e})", where=cfg_path, fix="repair the file") from None
    if isinstance(cfg.get("quantization_config"), dict):
        return cfg["quantization_config"]
    legacy = os.path.join(path, "hf_quant_config.json")
    if os.path.isfile(legacy):
        with open(legacy) as f:
            try:
                return json.load(f)
            except ValueError as e:
                raise ConfigError(f"not valid JSON ({e})", where=legacy, fix="repair the file") from None
    return None


def load(path: str, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16,
         online: str | None = None, ignore: list[str] | None = None, **kwargs):
    """Load a quantized (or, with ``online=``, a bf16) causal-LM checkpoint directory as a
    transformers model with qcompile's QuantLinear layers. ``device``: where weights go
    ("cpu", "cuda", ...). Extra kwargs go to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    register_with_transformers()
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
    device_map = {"": str(device)} if device is not None else None
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map, quantization_config=qcfg,
                                                **kwargs)
