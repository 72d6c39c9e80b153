"""The 4-bit (and pack-quantized int8, MXFP8) writers behind :func:`qcompile.synth.write_checkpoint`.

Each function reproduces its producer's arithmetic, checked bit for bit against the producers' tiny
test checkpoints (``QCOMPILE_TESTDATA``, made from ``base-bf16-dense``) where a producer file exists: same
codes, scales and global scales from the same bf16 weights (tests/test_synth_4bit.py). Formats with no
producer file there (``ct-w4a16-asym``, ``modelopt-mxfp8``) follow the producer's source, named below.
What each producer does, from its source:

* **ModelOpt 0.47 MXFP8**: see :func:`modelopt_mxfp8`.

* **ModelOpt 0.47 NVFP4** (``NVFP4QTensor``): ``weight_scale_2 = amax / (6 * 448)`` in fp32, one amax
  shared by the fused q/k/v and gate/up (``preprocess_linear_fusion``); per 16 elements ``weight_scale
  = fp8(clamp(block_amax / (6 * weight_scale_2), 2^-9, 448))``, an all-zero block gets 1.0; codes
  ``e2m1(w / (weight_scale * weight_scale_2))``, sign kept on values that round to zero (-0 is code 8).
  ``input_scale = amax_x / (6 * 448)``. FP8 layers (MIXED_PRECISION): ``weight_scale = amax / 448``
  per layer and ``fp8(w / weight_scale)`` with the quotient rounded to bf16 first; ``input_scale =
  amax_x / 448``.
* **compressed-tensors 0.19 / llm-compressor 0.14 NVFP4** (``generate_gparam``, ``calculate_qparams``):
  ``global = 2688 / amax`` computed in bf16 as torch does ``float / tensor`` (reciprocal, then
  multiply), stored fp32 [1] and *reciprocal* (``W = e2m1 · weight_scale / global``), shared by the
  fused layers as in ModelOpt; ``weight_scale = fp8(global · bf16(block_amax / 6))`` (a zero becomes
  0.125). ``input_global_scale`` the same from the calibrated activation amax.
* **OCP MX (Quark 0.13 ``scale_calculation_mode: even``, compressed-tensors ``generate_mx_scales``)**:
  per 32 elements ``scale = 2^(floor(log2(amax')) - 2)`` where ``amax'`` is the amax rounded to a power
  of two, *up* from 1.75·2^e; elements ``e2m1(w / scale)``, saturating at 6; stored as the biased
  exponent (uint8, 127 = 1.0). Quark writes +0 for a negative value that rounds to zero,
  compressed-tensors -0.
* **compressed-tensors pack-quantized int** (``calculate_qparams``, ``pack_to_int32``): symmetric
  ``scale = bf16(amax / ((qmax - qmin) / 2))`` (amax / 7.5 for int4, / 127.5 for int8),
  ``q = round(clamp(bf16(w / scale), qmin, qmax))`` (ties to even, so -7.5 -> -8), ``q + 2^(bits-1)``
  packed 32/bits per int32, element j at bits·j. Asymmetric (``W4A16_ASYM``): the group's range
  widened to hold 0, ``scale = bf16((max - min) / (qmax - qmin))``, an int8 zero point ``round(clamp(qmin
  - min / scale))``, ``q = round(clamp(bf16(w / scale) + zp))``; the zero points are packed like the
  codes but along out_features. No producer file of this format is among the test checkpoints: the
  packing follows compressed-tensors 0.19's ``pack_to_int32(zp, 4, packed_dim=0)``.

e2m1 rounding is round-to-nearest-even in every producer (ModelOpt's searchsorted bounds, compressed-
tensors' threshold ladder and Quark's ``half_even``): :func:`e2m1_codes`.
"""

from __future__ import annotations

import copy

import torch

from .kernels.quant_math import pack_e2m1, pack_int32

FORMATS = ("modelopt-nvfp4", "modelopt-w4a16-nvfp4", "modelopt-mixed", "ct-nvfp4", "ct-nvfp4a16", "ct-w4a16",
           "ct-w4a16-asym", "ct-w8a16", "ct-mxfp4", "quark-mxfp4", "modelopt-mxfp8")

FP4_MAX, E4M3_MAX = 6.0, 448.0
NVFP4_GROUP, MX_GROUP = 16, 32
# Layers that one fused kernel runs: both NVFP4 producers give them one global scale.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MIXED_FP8_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj")  # modelopt-mixed: attention FP8, MLP NVFP4
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}
MODELOPT_EXCLUDE = ["lm_head", "model.embed_tokens"]


# -- element and scale rounding ------------------------------------------------------------------

def e2m1_codes(v: torch.Tensor, signed_zero: bool = True) -> torch.Tensor:
    """fp32 values -> e2m1 codes (uint8 0..15: sign bit 3, magnitude index 0..7 of 0, .5, 1, 1.5, 2, 3,
    4, 6), round to nearest, ties to the even code, saturating at 6. ``signed_zero=False`` writes +0
    for negative values that round to zero (Quark)."""
    a = v.abs()
    # the midpoints between neighbours; ">=" where the upper neighbour has the even code (ties go up)
    mag = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
           + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    neg = v < 0
    if not signed_zero:
        neg = neg & (mag > 0)
    return (mag | (neg.int() << 3)).to(torch.uint8)


def div(t: torch.Tensor, d: float) -> torch.Tensor:
    """``t / d`` divided as on the CPU on every device: the divisor a tensor of ``t``'s dtype on ``t``'s
    device (CUDA multiplies by the reciprocal of a Python-number or CPU-scalar divisor, 1 ulp off for
    some values, which would change the written bytes). ``d`` must be exact in ``t``'s dtype."""
    return t / torch.tensor(d, dtype=t.dtype, device=t.device)


def _bf16_rdiv(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """``numerator / t`` for a bf16 tensor as torch computes it (``Tensor.__rtruediv__``: the bf16
    reciprocal times the number, rounded to bf16 again): what compressed-tensors' global scale is."""
    return t.to(torch.bfloat16).reciprocal() * numerator


def _ct_global(amax: torch.Tensor) -> torch.Tensor:
    return _bf16_rdiv(E4M3_MAX * FP4_MAX, amax).float().reshape(1)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Producers' OCP-MX shared exponent for fp4 blocks: amax rounded to a power of two (up from
    1.75·2^e: add 2^21 to the fp32 bits, keep sign and exponent), then minus emax(e2m1) = 2."""
    bits = amax.float().clamp(min=2.0 ** -126).contiguous().view(torch.int32)
    rounded = ((bits + (1 << 21)) & -(1 << 23)).view(torch.float32)
    return (torch.floor(torch.log2(rounded)) - 2).clamp(-127, 127)


# -- per-layer writers: weight [N, K] bf16 -> {on-disk suffix: tensor} ---------------------------

def modelopt_nvfp4(w: torch.Tensor, w_amax: torch.Tensor, x_amax: torch.Tensor | None) -> dict:
    n, k = w.shape
    scale_2 = div(w_amax.float(), FP4_MAX * E4M3_MAX)
    blocks = w.float().view(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block_scale = blocks.abs().amax(-1) / (FP4_MAX * scale_2)
    block_scale[block_scale == 0] = 1.0
    scale = block_scale.clamp(2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_codes((blocks / (scale.float() * scale_2).unsqueeze(-1)).view(n, k))
    out = {"weight": pack_e2m1(codes), "weight_scale": scale, "weight_scale_2": scale_2}
    if x_amax is not None:
        out["input_scale"] = div(x_amax.float(), FP4_MAX * E4M3_MAX)
    return out


def modelopt_fp8(w: torch.Tensor, x_amax: torch.Tensor) -> dict:
    scale = div(w.abs().amax().float(), E4M3_MAX)
    return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale,  # bf16 quotient, as ModelOpt
            "input_scale": div(x_amax.float(), E4M3_MAX)}


def ct_nvfp4(w: torch.Tensor, w_amax: torch.Tensor, x_amax: torch.Tensor | None) -> dict:
    n, k = w.shape
    g = _ct_global(w_amax)
    blocks = w.view(n, k // NVFP4_GROUP, NVFP4_GROUP)
    local = div(blocks.abs().amax(-1), FP4_MAX)  # in the weight dtype
    scale = (g * local).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # g is [1]: fp32 product
    scale = torch.where(scale.float() == 0, 0.125, scale.float()).to(torch.float8_e4m3fn)
    codes = e2m1_codes((blocks.float() / (scale.float() / g).unsqueeze(-1)).view(n, k))
    out = {"weight_packed": pack_e2m1(codes), "weight_scale": scale, "weight_global_scale": g}
    if x_amax is not None:
        out["input_global_scale"] = _ct_global(x_amax)
    return out


def mxfp4(w: torch.Tensor, signed_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed uint8 [N, K/2], e8m0 scale uint8 [N, K/32])."""
    n, k = w.shape
    blocks = w.float().view(n, k // MX_GROUP, MX_GROUP)
    exp = _mx_exponent(blocks.abs().amax(-1))
    codes = e2m1_codes((blocks / torch.exp2(exp).unsqueeze(-1)).view(n, k), signed_zero)
    return pack_e2m1(codes), (exp + 127).to(torch.uint8)


def modelopt_mxfp8(w: torch.Tensor) -> dict:
    """ModelOpt 0.47 MXFP8 (``MXFP8QTensor``): per 32 elements ``e = clamp(ceil(log2(amax / 448)), -127,
    127)`` (-127 for an all-zero block), ``weight_scale = e + 127`` (uint8 e8m0), ``weight = fp8(clamp(w *
    2^-e, -448, 448))`` computed in fp32; no input scale (activations are quantized per call)."""
    n, k = w.shape
    blocks = w.view(n, k // MX_GROUP, MX_GROUP)
    descale = div(blocks.abs().amax(-1).float(), E4M3_MAX)
    exp = torch.where(descale > 0, torch.log2(descale), -127.0).ceil().clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    q = torch.clamp(blocks * torch.exp2(127 - scale.float()).unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    return {"weight": q.to(torch.float8_e4m3fn).view(n, k), "weight_scale": scale}


def ct_int(w: torch.Tensor, bits: int, group: int | None, symmetric: bool = True) -> dict:
    """compressed-tensors pack-quantized int; ``group=None``: one scale per row (channel). Asymmetric
    (W4A16_ASYM): ``scale = (max' - min') / (qmax - qmin)`` over the range widened to hold 0, ``zp =
    round(clamp(qmin - min' / scale, qmin, qmax))`` int8, ``q = round(clamp(bf16(w / scale) + zp))``; the
    zero points are packed like the codes but along out_features (``pack_to_int32(zp, packed_dim=0)``)."""
    n, k = w.shape
    g = group or k
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = w.view(n, k // g, g)
    if symmetric:
        scale = div(groups.abs().amax(-1, keepdim=True), (qmax - qmin) / 2)
    else:
        lo = torch.clamp(groups.amin(-1, keepdim=True), max=0)
        hi = torch.clamp(groups.amax(-1, keepdim=True), min=0)
        scale = div(hi - lo, qmax - qmin)
        zp = torch.round(torch.clamp(qmin - lo / scale, qmin, qmax)).to(torch.int8)
    scale = torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)
    scaled = groups / scale if symmetric else groups / scale + zp.to(w.dtype)
    q = torch.round(torch.clamp(scaled, qmin, qmax)).to(torch.int8).view(n, k)
    out = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.view(n, k // g).contiguous(),
           "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zp.view(n, k // g).t().contiguous(), bits).t().contiguous()
    return out


# -- the whole state dict ------------------------------------------------------------------------

def quantize_state(fmt: str, state: dict, amax: dict[str, float], routers: list[str] = ()) -> dict:
    """Replace the bf16 weights of the linears in ``amax`` (module name -> calibrated input amax) in
    ``state`` by ``fmt``'s tensors, in place. Returns ``{"config": quantization_config,
    "hf_quant_config": ...}`` (the latter for ModelOpt only); MoE ``routers`` are listed among the
    ignored / excluded modules, as the producers' MoE recipes list ``mlp.gate``."""
    names = [key[:-len(".weight")] for key in state if key.endswith(".weight") and key[:-len(".weight")] in amax]
    w_amax = _shared({n: state[f"{n}.weight"].abs().amax() for n in names})
    x_amax = _shared({n: torch.tensor(amax[n], dtype=torch.bfloat16) for n in names})  # activations were bf16
    for n in names:
        w = state.pop(f"{n}.weight")
        if fmt in ("modelopt-nvfp4", "modelopt-w4a16-nvfp4"):
            t = modelopt_nvfp4(w, w_amax[n], x_amax[n] if fmt == "modelopt-nvfp4" else None)
        elif fmt == "modelopt-mxfp8":
            t = modelopt_mxfp8(w)
        elif fmt == "modelopt-mixed":
            t = modelopt_fp8(w, x_amax[n]) if _leaf(n) in MIXED_FP8_LEAVES else modelopt_nvfp4(w, w_amax[n], x_amax[n])
        elif fmt in ("ct-nvfp4", "ct-nvfp4a16"):
            t = ct_nvfp4(w, w_amax[n], x_amax[n] if fmt == "ct-nvfp4" else None)
        elif fmt in ("ct-w4a16", "ct-w4a16-asym", "ct-w8a16"):
            t = ct_int(w, 8, None) if fmt == "ct-w8a16" else ct_int(w, 4, 128, symmetric=fmt == "ct-w4a16")
        elif fmt in ("ct-mxfp4", "quark-mxfp4"):
            packed, scale = mxfp4(w, signed_zero=fmt == "ct-mxfp4")
            t = {"weight_packed" if fmt == "ct-mxfp4" else "weight": packed, "weight_scale": scale}
        else:
            raise ValueError(f"{fmt!r} is not a 4-bit synthetic format; choose from {FORMATS}")
        state.update({f"{n}.{suffix}": v.contiguous() for suffix, v in t.items()})
    if fmt.startswith("modelopt"):
        out = _modelopt_configs(fmt, names)
        lists = [out["config"]["ignore"], out["hf_quant_config"]["quantization"].get("exclude_modules", [])]
    else:
        out = {"config": copy.deepcopy(QUARK_MXFP4) if fmt == "quark-mxfp4" else _ct_config(fmt)}
        lists = [out["config"]["exclude" if fmt == "quark-mxfp4" else "ignore"]]
    for names_list in lists:
        # the producers' order: ModelOpt after its excludes, llm-compressor and Quark before lm_head
        at = len(names_list) if fmt.startswith("modelopt") or "lm_head" not in names_list else names_list.index("lm_head")
        names_list[at:at] = [r for r in routers if r not in names_list]
    return out


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _block(name: str) -> str:
    """The module whose linears one kernel fuses: the decoder layer (``model.layers.i``) of a dense
    linear, the expert (``...experts.E``) of an expert's."""
    owner = name.rpartition(".")[0]
    return owner if ".experts." in name else owner.rpartition(".")[0]


def _shared(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's value replaced by the max over its fused group (q/k/v, gate/up of one block)."""
    groups: dict[tuple, list[str]] = {}
    for name in values:
        group = next((g for g in FUSED if _leaf(name) in g), None)
        if group is not None:
            groups.setdefault((_block(name), group), []).append(name)
    out = dict(values)
    for members in groups.values():
        shared = torch.stack([values[m] for m in members]).max()
        out.update(dict.fromkeys(members, shared))
    return out


# -- configs -------------------------------------------------------------------------------------

def _modelopt_group(algo: str) -> dict:
    """ModelOpt's ``_quant_algo_to_group_config`` / ``convert_hf_quant_config_format`` groups."""
    if algo == "FP8":
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    if algo == "MXFP8":  # "dynamic": False as ModelOpt writes it, though MXFP8 activations are per call
        mx = {"dynamic": False, "num_bits": 8, "type": "float", "group_size": MX_GROUP}
        return {"input_activations": dict(mx), "weights": dict(mx)}
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
    return {"weights": dict(fp4)} if algo == "W4A16_NVFP4" else {"input_activations": dict(fp4), "weights": dict(fp4)}


def _modelopt_configs(fmt: str, names: list[str]) -> dict:
    if fmt == "modelopt-mixed":
        layers = {n: {"quant_algo": "FP8"} if _leaf(n) in MIXED_FP8_LEAVES else
                  {"quant_algo": "NVFP4", "group_size": NVFP4_GROUP} for n in names}
        groups = {}
        for algo in ("FP8", "NVFP4"):  # one group per distinct layer config, in first-seen order
            groups[f"group_{len(groups)}"] = dict(_modelopt_group(algo), targets=sorted(
                n for n, c in layers.items() if c["quant_algo"] == algo))
        # process_layer_quant_config drops exclude_modules for MIXED_PRECISION: ignore is empty
        config = {"config_groups": groups, "quantized_layers": layers, "ignore": [], "quant_algo": "MIXED_PRECISION",
                  "producer": MODELOPT_PRODUCER, "quant_method": "modelopt"}
        legacy = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
        return {"config": config, "hf_quant_config": {"producer": MODELOPT_PRODUCER, "quantization": legacy}}
    algo = {"modelopt-nvfp4": "NVFP4", "modelopt-w4a16-nvfp4": "W4A16_NVFP4", "modelopt-mxfp8": "MXFP8"}[fmt]
    config = {"config_groups": {"group_0": dict(_modelopt_group(algo), targets=["Linear"])},
              "ignore": list(MODELOPT_EXCLUDE), "quant_algo": algo, "producer": MODELOPT_PRODUCER,
              "quant_method": "modelopt"}
    legacy = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": MX_GROUP if algo == "MXFP8" else
              NVFP4_GROUP, "exclude_modules": list(MODELOPT_EXCLUDE)}
    return {"config": config, "hf_quant_config": {"producer": MODELOPT_PRODUCER, "quantization": legacy}}


def _ct_args(type_: str, bits: int, strategy: str, group: int | None = None, dynamic=False,
             observer: str | None = "memoryless_minmax", scale_dtype: str | None = None, symmetric=True) -> dict:
    """compressed-tensors 0.19's serialized QuantizationArgs (keys sorted, zp_dtype null when symmetric)."""
    return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": group, "num_bits": bits,
            "observer": observer, "observer_kwargs": {}, "scale_dtype": scale_dtype, "strategy": strategy,
            "symmetric": symmetric, "type": type_, "zp_dtype": None if symmetric else "torch.int8"}


def _ct_config(fmt: str) -> dict:
    fp8, u8 = "torch.float8_e4m3fn", "torch.uint8"
    nvfp4_w = _ct_args("float", 4, "tensor_group", NVFP4_GROUP, scale_dtype=fp8)
    mxfp4_w = _ct_args("float", 4, "group", MX_GROUP, scale_dtype=u8)
    fmt_name, weights, acts = {
        "ct-nvfp4": ("nvfp4-pack-quantized", nvfp4_w,
                     _ct_args("float", 4, "tensor_group", NVFP4_GROUP, "local", "static_minmax", fp8)),
        "ct-nvfp4a16": ("nvfp4-pack-quantized", nvfp4_w, None),
        "ct-w4a16": ("pack-quantized", _ct_args("int", 4, "group", 128), None),
        "ct-w4a16-asym": ("pack-quantized", _ct_args("int", 4, "group", 128, symmetric=False), None),
        "ct-w8a16": ("pack-quantized", _ct_args("int", 8, "channel"), None),
        "ct-mxfp4": ("mxfp4-pack-quantized", mxfp4_w, _ct_args("float", 4, "group", MX_GROUP, True, None, u8)),
    }[fmt]
    group = {"format": fmt_name, "input_activations": acts, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": fmt_name, "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}


# amd-quark 0.13 export_safetensors of an MXFP4 weight-only model (quark-w-mxfp4-dense)
QUARK_MXFP4 = {
    "algo_config": None, "exclude": ["lm_head"],
    "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder", "weight_format": "real_quantized",
               "weight_merge_groups": None},
    "global_quant_config": {
        "bias": None, "input_tensors": None, "output_tensors": None, "target_device": None,
        "weight": {"block_size": None, "ch_axis": -1, "dtype": "fp4", "enable_buffer_reuse": False, "group_size": 32,
                   "is_dynamic": False, "is_scale_quant": False, "max_input_numel": 4194304, "mx_element_dtype": None,
                   "observer_cls": "PerBlockMXObserver", "qscheme": "per_group", "round_method": "half_even",
                   "scale_calculation_mode": "even", "scale_format": "e8m0", "scale_type": "float", "symmetric": None,
                   "zero_point_type": "int32"}},
    "kv_cache_post_rope": False, "kv_cache_quant_config": {}, "layer_quant_config": {}, "layer_type_quant_config": {},
    "quant_method": "quark", "quant_mode": "eager_mode", "softmax_quant_spec": None, "version": "0.13",
}
