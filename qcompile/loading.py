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

import logging
import os
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
from .linear import QuantLinear

log = logging.getLogger("qcompile")

# Checkpoint tensor suffixes that only a quantized layer has.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "weight_packed", "weight_global_scale",
                  "input_global_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "weight_scale_inv")
KV_SUFFIXES = ("k_scale", "v_scale", "q_scale", "prob_scale")

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
        if online is not None:
            from .formats.online import online_config
            self.source = online_config(online, ignore=self.ignore)

    def parsed(self) -> QuantConfig:
        if self.source is None:
            raise ConfigError("the checkpoint has no quantization config and no online scheme was asked for",
                              where="QCompileConfig", fix='pass QCompileConfig(online="fp8_per_tensor") for a bf16 checkpoint')
        return parse_quant_config(self.source)

    def to_dict(self) -> dict[str, Any]:
        # Saving the model writes the producer's config back, unchanged.
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

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in self.plan.values():
            module.finalize()
        model.qcompile_plan = {name: m.lq for name, m in self.plan.items()}
        model.qcompile_config = self.qconfig
        return model

    def is_serializable(self):
        return False

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def read_headers(checkpoint_files, directory: str | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` of the files transformers resolved, validated completely
    (:mod:`qcompile.checkpoint_files`: every header, the shard index beside them, each file inside the
    checkpoint ``directory``); no tensor data is read."""
    files = [str(f) for f in checkpoint_files or ()]
    local = directory if directory and os.path.isdir(directory) else None
    root = confinement_root(local or os.path.dirname(os.path.abspath(files[0]))) if files else None
    return read_checkpoint(files, find_index(files, local), root)


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
         online: str | None = None, ignore: list[str] | None = None, **kwargs):
    """Load a quantized (or, with ``online=``, a bf16) causal-LM checkpoint directory as a
    transformers model with qcompile's QuantLinear layers. ``device``: where weights go
    ("cpu", "cuda", ...). Extra kwargs go to ``from_pretrained``. Safe to call from several threads
    (loads run one at a time)."""
    from transformers import AutoModelForCausalLM

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
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map,
                                                    quantization_config=qcfg, **kwargs)
