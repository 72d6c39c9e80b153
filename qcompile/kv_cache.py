"""FP8 KV cache: keys and values stored in ``float8_e4m3fn`` with per-layer (or per-KV-head) scales,
half the memory of a bf16 cache.

Usage — a transformers ``Cache`` passed to the model, not a ``cache_implementation`` name (transformers
validates that name against a fixed list and builds its caches in hard-coded branches, so a new
name cannot be registered cleanly)::

    from qcompile.kv_cache import FP8Cache, cache_kwargs

    model = qcompile.load(path)                                 # a checkpoint with KV-cache scales
    out = model.generate(ids, max_new_tokens=64, **cache_kwargs(model, FP8Cache(model)))
    cache = FP8Cache(model, max_cache_len=4096)                 # static: torch.compile / CUDA graphs

    model = qcompile.load(path, online="fp8_per_tensor", kv_cache="fp8")  # no scales on disk
    cache = FP8Cache(model)                                     # scales measured at the first prefill

``cache_kwargs`` names the argument as the installed transformers does (``cache=`` from 5.24,
``past_key_values=`` before). ``static_cache(model, n)`` is transformers' bf16 ``StaticCache`` with any
sliding-window layer held full length (the model's masks still slide): an own decode loop of a compiled step
compiles once, where transformers' sliding layer, which counts its length in a Python int, recompiles at
every token. ``FP8Cache(model)`` grows like ``DynamicCache`` (for ``generate``);
``FP8Cache(model, max_cache_len=n)`` preallocates like ``StaticCache`` and is compileable: its
buffers, position and scales keep their addresses, so a compiled decode step captures into a CUDA
graph (``generate`` compiles it on its own on a GPU, as for ``StaticCache``).

Scales (``s``, fp32, multiplying): a token's key is stored as ``fp8(clamp(k / s_k, ±448))`` and read
as ``fp8 · s_k``, values alike; values past ±448 · s saturate, as in vLLM. Where they come from:

* the checkpoint (static): what :func:`qcompile.load` loaded from ModelOpt ``kv_cache_quant_algo``
  (``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``), compressed-tensors ``kv_cache_scheme``
  (``self_attn.k_scale`` / ``v_scale``, per layer or per KV head) and Quark (``k_proj.output_scale``
  / ``v_proj.output_scale``) checkpoints, as ``k_scale`` / ``v_scale`` buffers of each attention
  module, [num_kv_heads] fp32. The producers calibrate them as amax / 448; the scales of ModelOpt
  NVFP4 KV caches (amax / 448 too) and of int8 ones (about amax / 127) serve the FP8 cache as well;
* dynamic: per layer, the first update's (the prefill's) amax / (448 / 2) — a factor 2 of headroom
  for later tokens. Kept once measured, ``reset()`` included; a new cache measures again.

Attention reads the cache dequantized: every update returns the whole cache as model-dtype tensors
(``fp8 · s``) and the model's own attention (sdpa / eager / ...) runs on them; SDPA (every backend,
CUDA included) takes K and V in the query's dtype. Eager, that is a dequantized copy of one layer's
K/V per step. Compiled with qcompile, the decode-attention pass finds that read and hands the fp8
codes and the scales to ``qcompile::decode_attention``, which dequantizes block by block in registers
(on CUDA; SDPA on the dequantized read elsewhere): no copy of the cache is made. The static layer keeps
its codes in uint8 buffers (``keys`` / ``values`` are their fp8 views) and writes a token's bytes with
``index_copy_`` on them (there is no float8 ``index_copy_`` on either device); under inductor that write
is done in place, as a bf16 cache's is (``benchmarks/kv_cache.py`` compares the two caches' speed).

Supported: decoder models of full-attention and sliding-window layers (no chunked attention), one scale
per layer or per KV head. A sliding-window layer is held full length, as :func:`static_cache` holds it: the
model's sliding masks hide the keys outside the window, so attention computes what transformers' sliding
layer gives, with the cache of a full layer.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from .errors import ConfigError, UnsupportedError
from .kernels.quant_math import FP8, FP8_MAX, dequantize_fp8, quantize_fp8
from .loading import is_attention

DYNAMIC_HEADROOM = 2.0  # dynamic scales put the first prefill's amax at FP8_MAX / DYNAMIC_HEADROOM
SCALES = ("checkpoint", "dynamic")


# a token's key / value: fp8(clamp(x / scale, ±448)), divided in fp32 (scale broadcasts over [B, H, S, D]); read
# back as dtype(q · scale), the read qcompile::decode_attention reproduces in registers
quantize_kv, dequantize_kv = quantize_fp8, dequantize_fp8


LAYER_TYPES = ("full_attention", "sliding_attention")  # what FP8Cache holds (sliding ones full length)


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """One scale for ``x``: its amax / (448 / headroom); a tiny positive value for an all-zero ``x``."""
    return (x.detach().abs().amax().float() * (DYNAMIC_HEADROOM / FP8_MAX)).clamp(min=torch.finfo(torch.float32).tiny)


class _FP8Layer:
    """What both FP8 layers share: the scales ([1, H or 1, 1, 1] fp32 on the cache's device, filled in
    place so their addresses stay fixed), quantizing an update and dequantizing the stored states."""

    def _setup_scales(self, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
        self._given = (k_scale, v_scale)  # [H] from the checkpoint, or None: dynamic
        self.k_scale = self.v_scale = None
        self.calibrated = k_scale is not None

    def _init_scales(self, key_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.k_scale is not None:  # measured or given already: kept across reset()
            return
        heads = key_states.shape[1]
        given = [torch.ones(1) if s is None else s for s in self._given]
        if any(s.numel() not in (1, heads) for s in given):
            raise UnsupportedError(f"{given[0].numel()} KV-cache scales for {heads} KV heads",
                                   where="FP8Cache", fix="the cache needs one scale per layer or per KV head")
        self.k_scale, self.v_scale = (s.to(self.device, torch.float32).reshape(1, -1, 1, 1).clone() for s in given)

    def _quantize(self, key_states: torch.Tensor, value_states: torch.Tensor):
        if not self.calibrated:
            self.k_scale.copy_(dynamic_scale(key_states))
            self.v_scale.copy_(dynamic_scale(value_states))
            self.calibrated = True
        return quantize_kv(key_states, self.k_scale), quantize_kv(value_states, self.v_scale)

    def _dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_kv(self.keys, self.k_scale, self.dtype), dequantize_kv(self.values, self.v_scale, self.dtype)


class FP8DynamicLayer(_FP8Layer, DynamicLayer):
    """A growing FP8 layer (``DynamicLayer`` with fp8 ``keys`` / ``values``; crop, beam reordering and
    batch selection act on them as stored)."""

    def __init__(self, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        super().__init__()
        self._setup_scales(k_scale, v_scale)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._init_scales(key_states)
        self.keys = torch.empty((*key_states.shape[:2], 0, key_states.shape[-1]), dtype=FP8, device=self.device)
        self.values = torch.empty((*value_states.shape[:2], 0, value_states.shape[-1]), dtype=FP8, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self._quantize(key_states, value_states)
        self.keys, self.values = (_cat_fp8(old, new) for old, new in ((self.keys, k), (self.values, v)))
        return self._dequantize()


def _cat_fp8(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat`` along the sequence through uint8 views: every device has a byte kernel."""
    return torch.cat([old.view(torch.uint8), new.view(torch.uint8)], dim=-2).view(FP8)


def _fp8_view(name: str) -> property:
    """A property reading the uint8 buffer ``name`` as fp8 (None while unset); set, it stores a tensor's bytes."""

    def get(self) -> torch.Tensor | None:
        t = getattr(self, name)
        return None if t is None else t.view(FP8)

    def put(self, t: torch.Tensor | None) -> None:
        setattr(self, name, None if t is None else t.view(torch.uint8))

    return property(get, put)


class FP8StaticLayer(_FP8Layer, StaticLayer):
    """A preallocated FP8 layer of ``max_cache_len`` positions (``StaticLayer`` with its fp8 codes in uint8
    buffers)."""

    def __init__(self, max_cache_len: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
        self._key_bytes = self._value_bytes = None
        super().__init__(max_cache_len=max_cache_len)
        self._setup_scales(k_scale, v_scale)

    # The buffers are uint8 tensors holding the fp8 codes, and ``keys`` / ``values`` their fp8 views: an update
    # writes the bytes (``index_copy_`` has no float8 kernel on either device) into the buffer itself, which a
    # compiled step does in place (a write through a uint8 view of an fp8 buffer, inductor on CUDA turns into a
    # copy of the layer's whole cache out and back).
    keys = _fp8_view("_key_bytes")
    values = _fp8_view("_value_bytes")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._init_scales(key_states)
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self._key_bytes = torch.zeros((*shape, self.k_head_dim), dtype=torch.uint8, device=self.device)
        self._value_bytes = torch.zeros((*shape, self.v_head_dim), dtype=torch.uint8, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # fixed addresses: compiled steps mutate them, CUDA graphs replay
            for t in (self._key_bytes, self._value_bytes, self.cumulative_length, self.k_scale, self.v_scale):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self._quantize(key_states, value_states)
        positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        self._key_bytes.index_copy_(2, positions, k.view(torch.uint8))
        self._value_bytes.index_copy_(2, positions, v.view(torch.uint8))
        return self._dequantize()


class FP8Cache(Cache):
    """The FP8 KV cache of ``model`` (module docstring). ``max_cache_len``: preallocate that many
    positions (static, compileable); None: grow. ``scales``: "checkpoint" (the loaded ``k_scale`` /
    ``v_scale`` of every attention layer), "dynamic" (measured at the first prefill), or None: the
    checkpoint's when the model has them, else dynamic if the model was loaded with
    ``kv_cache="fp8"``, else a ConfigError."""

    def __init__(self, model: nn.Module, max_cache_len: int | None = None, scales: str | None = None,
                 offloading: bool = False):
        config = model.config.get_text_config(decoder=True)
        _check_layer_types(config)
        per_layer = _layer_scales(model, config.num_hidden_layers, scales)
        if max_cache_len is None:
            layers = [FP8DynamicLayer(k, v) for k, v in per_layer]
        else:
            layers = [FP8StaticLayer(max_cache_len, k, v) for k, v in per_layer]
        super().__init__(layers=layers, offloading=offloading)


def model_kv_scales(model: nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer index: (k_scale, v_scale)}`` as loaded onto the attention modules ([num_kv_heads] fp32)."""
    return {m.layer_idx: (m.k_scale, m.v_scale) for m in model.modules()
            if is_attention(m) and isinstance(getattr(m, "k_scale", None), torch.Tensor)}


def _layer_scales(model: nn.Module, n_layers: int, scales: str | None) -> list[tuple]:
    found = model_kv_scales(model)
    if scales is None:
        scales = "checkpoint" if found else "dynamic" if getattr(model, "qcompile_kv_cache", None) == "fp8" else None
        if scales is None:
            raise ConfigError(f"the model ({type(model).__name__}) has no KV-cache scales", where="FP8Cache(model)",
                              fix='load it with qcompile.load(path, kv_cache="fp8") or pass FP8Cache(model, '
                                  'scales="dynamic") to measure them at the first prefill')
    if scales not in SCALES:
        raise ConfigError(f"unknown scales {scales!r:.40}", where="FP8Cache(scales=...)",
                          fix=f"one of {list(SCALES)}, or None for the checkpoint's when the model has them")
    if scales == "dynamic":
        return [(None, None)] * n_layers
    missing = [i for i in range(n_layers) if i not in found]
    if missing:
        raise ConfigError(f"the model has no KV-cache scales for layer {missing[0]} ({len(missing)} of {n_layers} "
                          "layers lack them)", where="FP8Cache(scales='checkpoint')",
                          fix='load a checkpoint with KV-cache scales through qcompile.load, or pass scales="dynamic"')
    return [found[i] for i in range(n_layers)]


def _check_layer_types(config) -> None:
    """Full-attention and sliding-window layers (held full length: the model's sliding masks hide the keys outside
    the window); chunked or other attention refused."""
    types = getattr(config, "layer_types", None)
    other = sorted({t for t in types if t not in LAYER_TYPES}) if types is not None else [
        f"attention_chunk_size={config.attention_chunk_size}"] if getattr(config, "attention_chunk_size", None) else []
    if other:
        raise UnsupportedError(f"the model has attention layers the FP8 cache does not hold ({', '.join(other)})",
                               where=f"{type(config).__name__}", fix="FP8Cache holds full-attention and "
                               "sliding-window layers; use transformers' own cache for this model")


def static_cache(model: nn.Module, max_cache_len: int) -> Cache:
    """transformers' ``StaticCache`` for ``model`` with its sliding-window layers made full-length
    ``StaticLayer``s (other layer kinds as transformers makes them): the model's sliding-window masks still
    hide the keys outside each window, so attention computes the same (tests/test_kv_cache.py), and a
    compiled decode step compiles once. transformers' own sliding layer counts its length in a Python int,
    which a compiled step guards on and recompiles for at every token. The sliding layers hold
    ``max_cache_len`` positions instead of the window."""
    import copy

    from transformers import StaticCache

    config = copy.deepcopy(model.config.get_text_config(decoder=True))
    sliding = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    types = getattr(config, "layer_types", None) or [sliding] * config.num_hidden_layers
    config.layer_types = ["full_attention" if t == "sliding_attention" else t for t in types]  # (chunked kept)
    config.sliding_window = None
    return StaticCache(config=config, max_cache_len=max_cache_len)


def cache_kwargs(model: nn.Module, cache: Cache) -> dict:
    """``{"cache": cache}`` where ``model.forward`` takes ``cache`` (transformers >= 5.24), else
    ``{"past_key_values": cache}``: for ``model(...)`` and ``model.generate(...)`` alike."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by the keys and values of ``cache``'s initialized layers (any transformers cache)."""
    return sum(t.nbytes for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values))


__all__ = ["FP8Cache", "FP8DynamicLayer", "FP8StaticLayer", "cache_kwargs", "cache_nbytes", "model_kv_scales",
           "static_cache", "quantize_kv", "dequantize_kv", "dynamic_scale"]
