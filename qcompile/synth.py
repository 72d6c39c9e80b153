"""Tiny checkpoints written in the producers' exact on-disk formats, from a config and random weights.

Nothing can be downloaded here, so tests and ``qcompile run`` (with no checkpoint) build their models
with these writers. Each writer reproduces the tensor names, dtypes, shapes, scale conventions and
config files of the real producer (compare with ``tests/data/checkpoints``, written by
nvidia-modelopt 0.47 and llm-compressor 0.14):

* ModelOpt: fp8 weights, fp32 scales (0-d per tensor, [N] per channel, [N/128, 1, K/128, 1] per
  block), ``hf_quant_config.json`` beside ``config.json`` whose ``quantization_config`` has
  ``quant_method: "modelopt"``; ``lm_head`` and ``model.embed_tokens`` excluded.
* compressed-tensors: fp8 weights, scales in the model dtype (bf16), per-tensor scales of shape [1],
  channel scales [N, 1], block scales [N/128, K/128]; ``format: float-quantized``; ``lm_head`` ignored.
* MoE experts per expert, as each producer names them (:data:`MOE_DISK_NAMES`): a Mixtral's
  ``block_sparse_moe.experts.E.w1 / w3 / w2`` (ModelOpt; bf16 as transformers saves it) or
  ``block_sparse_moe.experts.E.{gate,up,down}_proj`` (compressed-tensors), the routers ignored as
  ``block_sparse_moe.gate``; other architectures' ``mlp.experts.E.{gate,up,down}_proj``, routers ``mlp.gate``.
* 4-bit (ModelOpt NVFP4 / W4A16_NVFP4 / MIXED_PRECISION, compressed-tensors NVFP4 / MXFP4 / int4 and
  int8 pack-quantized, Quark MXFP4): :mod:`qcompile.synth_4bit`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from . import synth_4bit
from .errors import ConfigError
from .kernels.quant_math import FP8_MAX, fp8_scale_from_amax, quantize_weight_fp8
from .modules import is_router
from .scheme import Granularity

FORMATS = ("bf16", "modelopt-fp8", "modelopt-fp8-pcpt", "modelopt-fp8-pbwo", "ct-fp8-static", "ct-fp8-dynamic",
           "ct-fp8-block", "ct-w8a8-int8") + synth_4bit.FORMATS
# The quantized formats: what ``qcompile run --format`` offers ("bf16" is the unquantized source that
# online quantization starts from).
QUANTIZED_FORMATS = FORMATS[1:]
# What the writer writes of a MoE model: no format that calibrates a static input scale per expert.
MOE_FORMATS = ("bf16", "modelopt-fp8", "ct-fp8-dynamic") + synth_4bit.FORMATS
# gpt-oss's own checkpoint format (``quant_method: "mxfp4"``), written of a gpt-oss model only
GPTOSS_MXFP4 = "gptoss-mxfp4"
GPTOSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KV_CACHE_OPTIONS = {"modelopt": (None, "fp8"), "ct": (None, "fp8", "fp8-head")}  # by the format's producer

# How a producer family names a MoE block on disk where it departs from transformers' in-memory names
# (``mlp.experts.E.{gate,up,down}_proj``, router ``mlp.gate``): (model_type, family) -> (the block's name,
# {projection: its name}). As the producers' Mixtral files show (tests/data/checkpoints/*mixtral*):
# transformers' save_pretrained and ModelOpt write Mixtral's own ``block_sparse_moe.experts.E.w1 / w3 / w2``
# and ``block_sparse_moe.gate``, llm-compressor renames the block only. Families: "bf16" (transformers),
# "modelopt", "ct" (compressed-tensors), "quark"; every other pair keeps the in-memory names.
MIXTRAL_OWN_NAMES = ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
MOE_DISK_NAMES = {("mixtral", "bf16"): MIXTRAL_OWN_NAMES, ("mixtral", "modelopt"): MIXTRAL_OWN_NAMES,
                  ("mixtral", "ct"): ("block_sparse_moe", {})}


def tiny_llama_config(**overrides):
    """The shape of tests/data's base model: hidden 256, intermediate 512, 2 layers, heads 4/2,
    head_dim 64, vocab 384, tied embeddings (all linear dims are multiples of 128)."""
    from transformers import LlamaConfig

    kw = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=384, tie_word_embeddings=True,
              max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.05)
    kw.update(overrides)
    return LlamaConfig(**kw)


def write_bf16(path: str, config=None, seed: int = 0, dtype=torch.bfloat16) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config or tiny_llama_config()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def write_tokenizer(path: str) -> None:
    """A byte-level tokenizer (256 byte tokens + <pad>/<s>/</s>): enough for ``qcompile run``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)


def calibrate(model, n_tokens: int = 64, seed: int = 0) -> dict[str, float]:
    """Per-linear input amax over random tokens (drawn on the CPU, the same on every device): what a
    producer's calibration measures. Fused experts (:func:`fused_experts`) as ModelOpt calibrates them,
    every expert on every token that enters the block: the gate/up input amax is the block input's, the
    down input amax the max over the experts (one value per layer, as ModelOpt's files show)."""
    amax: dict[str, float] = {}

    def record(name: str, value) -> None:
        amax[name] = max(amax.get(name, 0.0), float(value))

    def linear_hook(m, args, name):
        record(name, args[0].detach().abs().amax())

    def experts_hook(m, args, name):
        x = args[0].detach().reshape(-1, args[0].shape[-1])
        inter = m.down_proj.shape[2]
        down = max(float((m.act_fn(g) * u).abs().amax()) for g, u in
                   ((x @ m.gate_up_proj[e].t()).split(inter, -1) for e in range(m.gate_up_proj.shape[0])))
        for e in range(m.gate_up_proj.shape[0]):
            record(f"{name}.{e}.gate_proj", x.abs().amax())
            record(f"{name}.{e}.up_proj", x.abs().amax())
            record(f"{name}.{e}.down_proj", down)

    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rpartition(".")[2] in LINEAR_LEAVES:
            hooks.append(mod.register_forward_pre_hook(functools.partial(linear_hook, name=name)))
        elif fused_experts(mod):
            hooks.append(mod.register_forward_pre_hook(functools.partial(experts_hook, name=name)))
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (2, n_tokens), generator=g).to(device))
    for h in hooks:
        h.remove()
    return amax


def fused_experts(module) -> bool:
    """A transformers 5 fused experts module in the Qwen3-MoE / Mixtral layout: ``gate_up_proj`` [E, 2I, H]
    (gate rows first) and ``down_proj`` [E, H, I] parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1])


def disk_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under their on-disk names, where the model is (views, no copies): a tied
    ``lm_head`` left out, fused experts split per expert into ``experts.E.{gate,up,down}_proj.weight`` as
    ``save_pretrained`` and the producers write a Qwen3-MoE's (:func:`moe_disk_names` renames a Mixtral's)."""
    experts = {name for name, m in model.named_modules() if fused_experts(m)}
    tied = model.config.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if tied and key == "lm_head.weight":
            continue
        if owner not in experts:
            state[key] = t.contiguous()
        elif leaf == "gate_up_proj":
            for e, w13 in enumerate(t.unbind(0)):
                state[f"{owner}.{e}.gate_proj.weight"], state[f"{owner}.{e}.up_proj.weight"] = w13.chunk(2)
        elif leaf == "down_proj":
            state.update((f"{owner}.{e}.down_proj.weight", w) for e, w in enumerate(t.unbind(0)))
        else:
            raise ValueError(f"{key}: the experts writer knows gate_up_proj and down_proj only")
    return state


def moe_disk_names(model_type: str, fmt: str):
    """A function from in-memory tensor / module names to the names ``fmt``'s producer writes for a
    ``model_type`` model (:data:`MOE_DISK_NAMES`); None where they are the same."""
    naming = MOE_DISK_NAMES.get((model_type, "bf16" if fmt == "bf16" else fmt.partition("-")[0]))
    if naming is None:
        return None
    block, leaves = naming
    expert = re.compile(r"(\.experts\.\d+\.)(gate_proj|up_proj|down_proj)(?=\.|$)")

    def rename(name: str) -> str:
        name = re.sub(r"\.mlp(?=\.)", f".{block}", name)
        return expert.sub(lambda m: m[1] + leaves.get(m[2], m[2]), name)
    return rename


def _renamed(obj, rename):
    """``obj`` (a quantization config: dicts, lists, strings) with every module name renamed."""
    if isinstance(obj, dict):
        return {rename(k): _renamed(v, rename) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_renamed(v, rename) for v in obj]
    return rename(obj) if isinstance(obj, str) else obj


def write_checkpoint(path: str, fmt: str, config=None, seed: int = 0, source: str | None = None,
                     kv_cache: str | None = None) -> str:
    """Write a tiny model in ``fmt`` (one of FORMATS) to ``path``; returns ``path``. ``source``: an
    unquantized checkpoint directory to quantize instead of a random model (``config`` / ``seed`` are
    then unused), e.g. tests/data's base-bf16-dense to compare with the producers' own files.
    ``kv_cache``: also write FP8 KV-cache scales as the producer does (:func:`_add_kv_scales`),
    ``"fp8"`` one per layer, ``"fp8-head"`` one per KV head (compressed-tensors ``attn_head``)."""
    from transformers import AutoModelForCausalLM

    if fmt not in FORMATS:
        raise ValueError(f"unknown synthetic format {fmt!r}; choose from {FORMATS}")
    if kv_cache not in KV_CACHE_OPTIONS.get(fmt.partition("-")[0], (None,)):
        raise ValueError(f"{fmt!r} has no KV-cache option {kv_cache!r}; ModelOpt formats take "
                         f"{KV_CACHE_OPTIONS['modelopt']}, compressed-tensors formats {KV_CACHE_OPTIONS['ct']}")
    os.makedirs(path, exist_ok=True)
    if source is not None:
        _copy_unquantized(source, path)
    else:
        write_bf16(path, config, seed)
    if fmt == "bf16":
        return path
    return write_model(path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), fmt, kv_cache)


def write_model(path: str, model, fmt: str, kv_cache: str | None = None, max_shard_bytes: int | None = None) -> str:
    """Write ``model`` (a transformers model in bf16, on any device: the quantization runs where the
    weights are, with the same arithmetic and bytes as on the CPU) in ``fmt`` to ``path``; returns
    ``path``. Calibrates first (:func:`calibrate`). A ``config.json`` already in ``path`` (from
    ``save_pretrained``) must describe ``model`` (:data:`SHAPE_FIELDS`; ConfigError otherwise) and gets the
    quantization config in place of any it had (a stale ``hf_quant_config.json`` is removed); else the model's
    config and a tokenizer are written. ``max_shard_bytes``: split the tensors into
    ``model-0000i-of-0000n.safetensors`` files and an index, as ``save_pretrained`` does; else one
    ``model.safetensors``. MoE models (fused experts) are written in bf16, ModelOpt FP8, compressed-tensors
    FP8_DYNAMIC and the 4-bit formats (each expert's gate and up share one NVFP4 global scale), experts and routers
    named as ``fmt``'s producer names them (:data:`MOE_DISK_NAMES`). :data:`GPTOSS_MXFP4` writes a gpt-oss model
    as OpenAI's checkpoints hold it
    (:func:`gptoss_mxfp4_state`; no calibration)."""
    if fmt == GPTOSS_MXFP4:
        _save(path, model, *gptoss_mxfp4_state(model), max_shard_bytes)
        return path
    if fmt not in FORMATS:
        raise ValueError(f"unknown synthetic format {fmt!r}; choose from {FORMATS}")
    moe = any(fused_experts(m) for m in model.modules())
    if moe and fmt not in MOE_FORMATS:
        raise ValueError(f"{fmt!r}: the MoE writer covers {MOE_FORMATS}")
    qcfg = None
    if fmt == "bf16":
        state = disk_state(model)
    else:
        amax = calibrate(model)
        state = disk_state(model)
        routers = [n for n, m in model.named_modules() if is_router(n, m) and hasattr(m, "weight")]
        if fmt in synth_4bit.FORMATS:
            qcfg = synth_4bit.quantize_state(fmt, state, amax, routers)
        else:
            qcfg = _quantize_fp8(fmt, state, amax, routers)
        if kv_cache is not None:
            _add_kv_scales(fmt, kv_cache == "fp8-head", model, state, qcfg)
    rename = moe_disk_names(model.config.model_type, fmt) if moe else None
    if rename is not None:
        state = {rename(k): v for k, v in state.items()}
        qcfg = _renamed(qcfg, rename)
    _save(path, model, state, qcfg, max_shard_bytes)
    return path


def gptoss_mxfp4_state(model) -> tuple[dict, dict]:
    """(tensors, quantization config) of a gpt-oss ``model`` as OpenAI publishes gpt-oss (``quant_method:
    "mxfp4"``): each experts parameter ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H] as
    ``<name>_blocks`` uint8 [E, N, K/32, 16] (its rows [N, K], MXFP4 as Quark and compressed-tensors round it:
    :func:`synth_4bit.mxfp4`) and ``<name>_scales`` uint8 e8m0 [E, N, K/32]; everything else, the experts'
    biases included, as it is (attention, routers, embeddings and ``lm_head`` listed in
    ``modules_to_not_convert``)."""
    if model.config.model_type != "gpt_oss":
        raise ValueError(f"{GPTOSS_MXFP4!r} writes gpt-oss models, not {model.config.model_type!r}")
    state = {}
    for key, t in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = t.shape
            packed, scale = synth_4bit.mxfp4(t.transpose(1, 2).reshape(e * n, k), signed_zero=False)
            state[f"{key}_blocks"] = packed.view(e, n, k // 32, 16)
            state[f"{key}_scales"] = scale.view(e, n, k // 32)
        else:
            state[key] = t.contiguous()
    return state, {"config": {"quant_method": "mxfp4", "modules_to_not_convert": list(GPTOSS_NOT_CONVERTED)}}


# config fields that fix a model's tensor shapes: a config.json already in the target directory must agree on them
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                "num_local_experts", "tie_word_embeddings")


def _check_existing_config(config_path: str, model) -> None:
    """A config.json left in the target directory (save_pretrained's, or a stale one from another model) must
    describe ``model``: the tensors written beside it are loaded against it."""
    with open(config_path) as f:
        on_disk = json.load(f)
    mine = model.config.to_dict()
    differ = [f"{k} {on_disk[k]!r} (the model: {mine[k]!r})" for k in SHAPE_FIELDS
              if k in on_disk and k in mine and on_disk[k] != mine[k]]
    if differ:
        raise ConfigError(f"describes another model: {', '.join(differ)}", where=config_path,
                          fix="write the checkpoint into an empty directory, or delete this one first")


def _save(path: str, model, state: dict, qcfg: dict | None, max_shard_bytes: int | None) -> None:
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, "config.json")
    if os.path.exists(config_path):
        _check_existing_config(config_path, model)
    else:  # a model built in memory: what save_pretrained writes beside it
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        write_tokenizer(path)
    for name in os.listdir(path):
        if name.startswith("model") and ".safetensors" in name:
            os.remove(os.path.join(path, name))
    _save_tensors(path, state, max_shard_bytes)
    with open(config_path) as f:
        cfg = json.load(f)
    if qcfg is not None or "quantization_config" in cfg:  # a bf16 checkpoint drops one left in the directory
        cfg.pop("quantization_config", None)
        if qcfg is not None:
            cfg["quantization_config"] = qcfg["config"]
        with open(config_path, "w") as f:
            json.dump(cfg, f, indent=2)
    hf_quant = os.path.join(path, "hf_quant_config.json")
    if qcfg is not None and "hf_quant_config" in qcfg:
        with open(hf_quant, "w") as f:
            json.dump(qcfg["hf_quant_config"], f, indent=4)
    elif os.path.exists(hf_quant):  # a ModelOpt config left by an earlier checkpoint in this directory
        os.remove(hf_quant)


def _save_tensors(path: str, state: dict, max_shard_bytes: int | None) -> None:
    """``state`` (on any device) as safetensors files, one shard at a time through the CPU."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: state[k].contiguous().cpu() for k in keys}, os.path.join(path, name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, ks in zip(names, shards) for k in ks}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _add_kv_scales(fmt: str, per_head: bool, model, state: dict, qcfg: dict) -> None:
    """FP8 KV-cache scales of every attention layer, in place on ``state`` and the configs. Both producers
    observe the keys after RoPE and the values as the attention reads them, over the calibration tokens:

    * ModelOpt 0.47 (``k_bmm_quantizer`` / ``v_bmm_quantizer``, renamed by ``postprocess_state_dict``):
      ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` = fp32(amax) / 448, fp32 0-d;
      ``kv_cache_quant_algo: "FP8"`` in hf_quant_config.json, ``kv_cache_scheme: {"dynamic": false,
      "num_bits": 8, "type": "float"}`` in config.json (``convert_hf_quant_config_format``);
    * compressed-tensors 0.19 (``initialize_attn_qparams``, ``calculate_qparams``):
      ``self_attn.k_scale`` / ``v_scale`` = amax / 448 in the model dtype (bf16), [1] for strategy
      ``tensor``, [num_kv_heads, 1, 1] (amax per head) for ``attn_head``; ``kv_cache_scheme`` holds the
      serialized QuantizationArgs."""
    from transformers import DynamicCache

    from .kv_cache import cache_kwargs
    from .loading import is_attention

    cache = DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(0)  # the tokens _calibrate draws
    with torch.no_grad():
        model(torch.randint(3, model.config.vocab_size, (2, 64), generator=g).to(model.device), use_cache=True,
              **cache_kwargs(model, cache))
    dims = (0, 2, 3) if per_head else tuple(range(4))
    attention = sorted((m.layer_idx, name) for name, m in model.named_modules() if is_attention(m))
    for idx, name in attention:
        layer = cache.layers[idx]
        for amax, k_name, ct_name in ((layer.keys.abs().amax(dims), "k_proj.k_scale", "k_scale"),
                                      (layer.values.abs().amax(dims), "v_proj.v_scale", "v_scale")):
            if fmt.startswith("modelopt"):
                state[f"{name}.{k_name}"] = synth_4bit.div(amax.float(), FP8_MAX)
            else:
                scale = synth_4bit.div(amax, FP8_MAX)
                state[f"{name}.{ct_name}"] = scale.reshape(-1, 1, 1) if per_head else scale.reshape(1)
    if fmt.startswith("modelopt"):
        qcfg["hf_quant_config"]["quantization"]["kv_cache_quant_algo"] = "FP8"
        config = qcfg["config"]
        rest = {k: config.pop(k) for k in list(config)[list(config).index("quant_algo") + 1:]}
        config.update(kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"}, **rest)
    else:
        qcfg["config"]["kv_cache_scheme"] = synth_4bit._ct_args("float", 8, "attn_head" if per_head else "tensor",
                                                                observer=None)


def _copy_unquantized(source: str, path: str) -> None:
    with open(os.path.join(source, "config.json")) as f:
        if "quantization_config" in json.load(f) or os.path.exists(os.path.join(source, "hf_quant_config.json")):
            raise ValueError(f"{source} is quantized; write_checkpoint(source=...) needs an unquantized checkpoint")
    if not os.path.exists(os.path.join(source, "model.safetensors")):
        raise ValueError(f"{source} has no single model.safetensors")
    for name in os.listdir(source):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))


def _quantize_fp8(fmt: str, state: dict, amax: dict[str, float], routers: list[str] = ()) -> dict:
    """The FP8 formats and compressed-tensors W8A8-INT8 (int8 channel weights, dynamic per-token int8
    activations, as llm-compressor's W8A8 preset), in place on ``state``; returns the configs (see
    ``synth_4bit.quantize_state``). ModelOpt gives an expert's gate and up one weight scale (the max of
    the two amaxes); both producers list the MoE ``routers`` among the ignored modules (ModelOpt after its
    excludes, llm-compressor before ``lm_head``)."""
    modelopt = fmt.startswith("modelopt")
    gran = {"modelopt-fp8": Granularity.TENSOR, "ct-fp8-static": Granularity.TENSOR,
            "modelopt-fp8-pcpt": Granularity.CHANNEL, "ct-fp8-dynamic": Granularity.CHANNEL,
            "modelopt-fp8-pbwo": Granularity.BLOCK, "ct-fp8-block": Granularity.BLOCK,
            "ct-w8a8-int8": Granularity.CHANNEL}[fmt]
    static_act = fmt in ("modelopt-fp8", "ct-fp8-static")
    scale_dtype = torch.float32 if modelopt else torch.bfloat16
    pair_amax = {name: torch.maximum(state[f"{name}.weight"].abs().amax(), state[f"{partner}.weight"].abs().amax())
                 for name in amax if (partner := _expert_partner(name)) in amax and modelopt
                 and gran is Granularity.TENSOR}
    for name in amax:
        w = state.pop(f"{name}.weight")
        q, s = quantize_weight_fp8(w, gran)
        if name in pair_amax:
            s = fp8_scale_from_amax(pair_amax[name].float())
        if fmt == "ct-w8a8-int8":  # round(w / s) to int8 in fp32, s = amax / 127 in bf16
            s = synth_4bit.div(w.float().abs().amax(1), 127).clamp(min=1e-8).to(torch.bfloat16).float()
            q = torch.round(w.float() / s[:, None]).clamp(-128, 127).to(torch.int8)
        elif not modelopt:
            # llm-compressor divides in the model dtype by the stored (bf16) scale
            s = s.to(torch.bfloat16)
            q = (w / _expand(s, gran, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            s = s.float()
        else:  # ModelOpt rounds w / scale to bf16 before the fp8 cast
            q = (w.float() / _expand(s, gran, w.shape)).to(torch.bfloat16).clamp(-FP8_MAX, FP8_MAX).to(
                torch.float8_e4m3fn)
        state[f"{name}.weight"] = q
        if gran is Granularity.TENSOR:
            s = s.reshape(()) if modelopt else s.reshape(1)
        elif gran is Granularity.CHANNEL:
            s = s if modelopt else s.reshape(-1, 1)
        elif modelopt:  # FP8_PB_WO: [N/128, 1, K/128, 1]
            s = s[:, None, :, None]
        state[f"{name}.weight_scale"] = s.to(scale_dtype).contiguous()
        if static_act:
            a = torch.tensor(amax[name] / FP8_MAX, dtype=torch.float32)
            state[f"{name}.input_scale"] = a if modelopt else a.reshape(1).to(torch.bfloat16)
    return _modelopt_configs(fmt, routers) if modelopt else _ct_config(fmt, routers)


def _expand(s, gran, shape):
    n, k = shape
    if gran is Granularity.TENSOR:
        return s
    if gran is Granularity.CHANNEL:
        return s[:, None]
    return s.repeat_interleave(128, 0).repeat_interleave(128, 1)


def _expert_partner(name: str) -> str | None:
    """``...experts.E.up_proj`` for ``...experts.E.gate_proj`` and back; None for other layers."""
    owner, _, leaf = name.rpartition(".")
    pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
    return f"{owner}.{pair[leaf]}" if leaf in pair and ".experts." in name else None


def _modelopt_configs(fmt: str, routers: list[str] = ()) -> dict:
    algo = {"modelopt-fp8": "FP8", "modelopt-fp8-pcpt": "FP8_PER_CHANNEL_PER_TOKEN", "modelopt-fp8-pbwo": "FP8_PB_WO"}[fmt]
    exclude = ["lm_head", "model.embed_tokens", *routers]
    producer = {"name": "modelopt", "version": "0.47.0"}
    group = {"weights": {"dynamic": False, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}
    if algo == "FP8":
        group["input_activations"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    config = {"config_groups": {"group_0": group}, "ignore": exclude, "quant_algo": algo, "producer": producer,
              "quant_method": "modelopt"}
    legacy = {"producer": producer, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                                      "exclude_modules": exclude}}
    return {"config": config, "hf_quant_config": legacy}


def _ct_config(fmt: str, routers: list[str] = ()) -> dict:
    kind = "int" if fmt == "ct-w8a8-int8" else "float"

    def args(strategy, dynamic, **kw):
        return {"actorder": None, "block_structure": kw.get("block"), "dynamic": dynamic,
                "group_size": kw.get("group"), "num_bits": 8, "observer": None if dynamic else "memoryless_minmax",
                "observer_kwargs": {}, "scale_dtype": None, "strategy": strategy, "symmetric": True, "type": kind,
                "zp_dtype": None}
    weights, acts = {
        "ct-fp8-static": (args("tensor", False), args("tensor", False)),
        "ct-fp8-dynamic": (args("channel", False), args("token", True)),
        "ct-fp8-block": (args("block", False, block=[128, 128]), args("group", True, group=128)),
        "ct-w8a8-int8": (args("channel", False), args("token", True)),
    }[fmt]
    layout = f"{kind}-quantized"
    group = {"format": layout, "input_activations": acts, "output_activations": None,
             "targets": ["Linear"], "weights": weights}
    return {"config": {"config_groups": {"group_0": group}, "format": layout,
                       "global_compression_ratio": None, "ignore": [*routers, "lm_head"], "kv_cache_scheme": None,
                       "quant_method": "compressed-tensors", "quantization_status": "compressed",
                       "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}}
