"""The 4-bit synthetic writers (qcompile/synth_4bit.py): loadable by qcompile, close to the bf16 model
they were made from, laid out like the producers' own files, and - from the same bf16 weights - bit
for bit what the producers wrote."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import qcompile
from qcompile import synth, synth_4bit
from qcompile.kernels.quant_math import E2M1_VALUES, pack_int32, round_to_e2m1, unpack_int32
from qcompile.linear import QuantLinear, dequantize_model

NVFP4 = "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global"
NVFP4_A16 = "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none"
FP8 = "w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
U8, FP8_T, I32, F32 = torch.uint8, torch.float8_e4m3fn, torch.int32, torch.float32
# fmt -> (scheme key of attention layers, of MLP layers, weight dtype as stored, weight_scale dtype kept)
EXPECTED = {
    "modelopt-nvfp4": (NVFP4, NVFP4, U8, FP8_T),
    "modelopt-w4a16-nvfp4": (NVFP4_A16, NVFP4_A16, U8, FP8_T),
    "modelopt-mixed": (FP8, NVFP4, None, None),  # per layer: see test_mixed_layers
    "ct-nvfp4": (NVFP4, NVFP4, U8, FP8_T),
    "ct-nvfp4a16": (NVFP4_A16, NVFP4_A16, U8, FP8_T),
    "ct-w4a16": ("w=int4/group128/pack=int32;a=none",) * 2 + (I32, F32),  # bf16 scales widened at load
    "ct-w4a16-asym": ("w=int4/group128/pack=int32/zp;a=none",) * 2 + (I32, F32),
    "ct-w8a16": ("w=int8/channel/pack=int32;a=none",) * 2 + (I32, F32),
    "ct-mxfp4": ("w=fp4_e2m1/group32:e8m0/pack=uint8;a=fp4_e2m1/dynamic/group32:e8m0",) * 2 + (U8, U8),
    "quark-mxfp4": ("w=fp4_e2m1/group32:e8m0/pack=uint8;a=none",) * 2 + (U8, U8),
    "modelopt-mxfp8": ("w=fp8_e4m3/group32:e8m0;a=fp8_e4m3/dynamic/group32:e8m0",) * 2 + (FP8_T, U8),
}
# Per-weight ||W_deq - W|| / ||W|| on the synthetic model (seed 0), observed: NVFP4 0.095 (both
# producers), MXFP4 0.113, int4 group-128 0.111, int8 channel 0.008, FP8 per tensor (mixed) 0.017,
# MXFP8 0.026-0.027.
MAX_ERR = {4: 0.15, 8: 0.03}
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])


def test_every_new_format_is_listed():
    assert set(EXPECTED) == set(synth_4bit.FORMATS) and set(synth_4bit.FORMATS) <= set(synth.FORMATS)


@pytest.fixture(scope="module")
def loaded(synth_ckpt):
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = qcompile.load(str(synth_ckpt(fmt)))
        return cache[fmt]
    return get


def quant_layers(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- 1. qcompile parses and loads them, storage as on disk ---------------------------------------

@pytest.mark.parametrize("fmt", synth_4bit.FORMATS)
def test_loads_with_scheme_and_disk_dtypes(loaded, fmt):
    model = loaded(fmt)
    layers = quant_layers(model)
    assert len(layers) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    attn_key, mlp_key, w_dtype, s_dtype = EXPECTED[fmt]
    for name, m in layers.items():
        is_attn = name.rpartition(".")[2] in ATTN
        assert m.scheme_key == (attn_key if is_attn else mlp_key), name
        if w_dtype is not None:
            assert m.weight.dtype == w_dtype and m.weight_scale.dtype == s_dtype, name
        if m.lq.scheme.weight.global_scale:
            assert m.weight_global_scale.dtype == F32 and m.weight_global_scale.shape == ()
        if m.lq.scheme.act is not None and m.lq.scheme.act.global_scale:
            assert m.input_global_scale.dtype == F32 and m.input_global_scale.shape == ()
    assert not isinstance(model.lm_head, QuantLinear)
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_mixed_layers(loaded):
    """MIXED_PRECISION: attention FP8 per tensor with a static input scale, MLP NVFP4."""
    for name, m in quant_layers(loaded("modelopt-mixed")).items():
        if name.rpartition(".")[2] in ATTN:
            assert (m.weight.dtype, m.weight_scale.dtype, m.input_scale.shape) == (FP8_T, F32, ())
        else:
            assert (m.weight.dtype, m.weight_scale.dtype) == (U8, FP8_T) and m.input_global_scale.shape == ()


# -- 2. dequantized by qcompile, close to the bf16 model they were made from ---------------------

@pytest.mark.parametrize("fmt", synth_4bit.FORMATS)
def test_dequantized_weights_match_bf16_origin(loaded, synth_ckpt, fmt):
    base = load_file(str(synth_ckpt("bf16") / "model.safetensors"))  # same config and seed
    model = loaded(fmt)
    bits = {n: m.lq.scheme.weight.dtype.bits for n, m in quant_layers(model).items()}
    ref = dequantize_model(copy.deepcopy(model))
    for name, b in bits.items():
        err = rel(ref.get_submodule(name).weight, base[f"{name}.weight"])
        assert 0.001 < err < MAX_ERR[b], f"{name}: relative error {err:.4f} ({b}-bit)"


# -- 3. the producers' layout: tensor names, dtypes, shapes, config keys -------------------------

def disk_header(path) -> dict[str, tuple[torch.dtype, tuple]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (f.get_tensor(k).dtype, tuple(f.get_tensor(k).shape)) for k in f.keys()}


def qconfig(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def expected_layout(fmt, testdata) -> dict:
    """The producer checkpoint of the same shape, transformed where no producer file of ``fmt`` exists
    by the rule that differs (dropped activation scale, renamed tensor, other packing)."""
    hdr = lambda name: disk_header(testdata / name)  # noqa: E731
    if fmt == "modelopt-w4a16-nvfp4":
        return {k: v for k, v in hdr("modelopt-nvfp4-dense").items() if not k.endswith(".input_scale")}
    if fmt == "ct-nvfp4a16":
        return {k: v for k, v in hdr("llmcompressor-nvfp4-dense").items() if not k.endswith(".input_global_scale")}
    if fmt == "modelopt-mixed":  # attention as ModelOpt FP8 writes it, MLP as ModelOpt NVFP4
        attn = lambda k: any(f".{p}." in k for p in ATTN)  # noqa: E731
        fp8 = {k: v for k, v in hdr("modelopt-fp8-dense").items() if attn(k)}
        return fp8 | {k: v for k, v in hdr("modelopt-nvfp4-dense").items() if not attn(k)}
    if fmt == "ct-mxfp4":  # compressed-tensors' MXFP4 is Quark's byte layout under weight_packed
        return {(k[:-len("weight")] + "weight_packed" if "proj.weight" in k and k.endswith(".weight") else k): v
                for k, v in hdr("quark-w-mxfp4-dense").items()}
    if fmt == "modelopt-mxfp8":  # ModelOpt FP8's fp8 weights, an e8m0 scale per 32, no input scale
        out = {}
        for k, (dt, shape) in hdr("modelopt-fp8-dense").items():
            if k.endswith(".weight_scale"):
                n_k = hdr("modelopt-fp8-dense")[k[:-len("_scale")]][1]
                out[k] = (torch.uint8, (n_k[0], n_k[1] // 32))
            elif not k.endswith(".input_scale"):
                out[k] = (dt, shape)
        return out
    if fmt == "ct-w4a16-asym":  # + the int8 zero points packed 8 per int32 along out_features
        out = dict(hdr("llmcompressor-w4a16-gptq-dense"))
        for k, (dt, shape) in list(out.items()):
            if k.endswith(".weight_scale"):
                out[k[:-len("scale")] + "zero_point"] = (torch.int32, (-(-shape[0] // 8), shape[1]))
        return out
    if fmt == "ct-w8a16":  # int4 group 128 -> int8 channel: 4 codes per int32, one bf16 scale per row
        out = {}
        for k, (dt, shape) in hdr("llmcompressor-w4a16-gptq-dense").items():
            if k.endswith(".weight_packed"):
                shape = (shape[0], shape[1] * 2)
            elif k.endswith(".weight_scale"):
                shape = (shape[0], 1)
            out[k] = (dt, shape)
        return out
    return hdr(PRODUCER[fmt])


PRODUCER = {"modelopt-nvfp4": "modelopt-nvfp4-dense", "ct-nvfp4": "llmcompressor-nvfp4-dense",
            "ct-w4a16": "llmcompressor-w4a16-gptq-dense", "quark-mxfp4": "quark-w-mxfp4-dense"}


@pytest.mark.parametrize("fmt", synth_4bit.FORMATS)
def test_tensor_layout_like_producer(synth_ckpt, testdata, fmt):
    ours = disk_header(synth_ckpt(fmt))
    want = expected_layout(fmt, testdata)
    assert sorted(ours) == sorted(want)
    bad = {k: (ours[k], want[k]) for k in want if ours[k] != want[k]}
    assert not bad, f"dtype / shape differ from the producer: {bad}"


def keys_tree(d):
    return {k: keys_tree(v) if isinstance(v, dict) else None for k, v in d.items()}


def test_configs_like_producers(synth_ckpt, testdata):
    # identical to the producers' files
    for fmt, name in PRODUCER.items():
        ours, theirs = qconfig(synth_ckpt(fmt)), qconfig(testdata / name)
        if fmt == "ct-w4a16":  # GPTQ wrote actorder "static"; RTN has none
            theirs["config_groups"]["group_0"]["weights"]["actorder"] = None
        assert ours == theirs, fmt
    legacy = lambda p: json.loads((p / "hf_quant_config.json").read_text())  # noqa: E731
    assert legacy(synth_ckpt("modelopt-nvfp4")) == legacy(testdata / "modelopt-nvfp4-dense")
    # weight-only NVFP4: the W4A4 config without activations (ModelOpt: and its own quant_algo)
    mo = qconfig(testdata / "modelopt-nvfp4-dense")
    del mo["config_groups"]["group_0"]["input_activations"]
    mo["quant_algo"] = "W4A16_NVFP4"
    assert qconfig(synth_ckpt("modelopt-w4a16-nvfp4")) == mo
    mo_legacy = legacy(testdata / "modelopt-nvfp4-dense")
    mo_legacy["quantization"]["quant_algo"] = "W4A16_NVFP4"
    assert legacy(synth_ckpt("modelopt-w4a16-nvfp4")) == mo_legacy
    # MXFP8: ModelOpt's NVFP4 config with quant_algo MXFP8 and its group (fp8, 32 per e8m0 scale)
    mo = qconfig(testdata / "modelopt-nvfp4-dense")
    mx = {"dynamic": False, "num_bits": 8, "type": "float", "group_size": 32}
    mo["config_groups"]["group_0"] |= {"input_activations": dict(mx), "weights": dict(mx)}
    mo["quant_algo"] = "MXFP8"
    assert qconfig(synth_ckpt("modelopt-mxfp8")) == mo
    mo_legacy = legacy(testdata / "modelopt-nvfp4-dense")
    mo_legacy["quantization"] |= {"quant_algo": "MXFP8", "group_size": 32}
    assert legacy(synth_ckpt("modelopt-mxfp8")) == mo_legacy
    ct = qconfig(testdata / "llmcompressor-nvfp4-dense")
    ct["config_groups"]["group_0"]["input_activations"] = None
    assert qconfig(synth_ckpt("ct-nvfp4a16")) == ct
    # W4A16_ASYM: the GPTQ file's config (RTN: no actorder) with symmetric false and int8 zero points
    ct = qconfig(testdata / "llmcompressor-w4a16-gptq-dense")
    ct["config_groups"]["group_0"]["weights"] |= {"actorder": None, "symmetric": False, "zp_dtype": "torch.int8"}
    assert qconfig(synth_ckpt("ct-w4a16-asym")) == ct
    # other compressed-tensors formats: the same keys everywhere
    for fmt, like in (("ct-w8a16", "llmcompressor-w4a16-gptq-dense"), ("ct-mxfp4", "llmcompressor-nvfp4-dense")):
        assert keys_tree(qconfig(synth_ckpt(fmt))) == keys_tree(qconfig(testdata / like)), fmt


def test_asym_zero_points_packed_along_out_features(loaded, synth_ckpt):
    """W4A16_ASYM: word r of column c holds the zero points of rows 8r..8r+7, row 8r+i at bits 4i
    with +8 (compressed-tensors' pack_to_int32(zp, 4, packed_dim=0)); loaded as int8 [N, K/128]."""
    name = "model.layers.0.mlp.down_proj"
    raw = load_file(str(synth_ckpt("ct-w4a16-asym") / "model.safetensors"))[f"{name}.weight_zero_point"]
    zp = quant_layers(loaded("ct-w4a16-asym"))[name].weight_zero_point
    assert raw.dtype == I32 and zp.dtype == torch.int8 and zp.shape == (raw.shape[0] * 8, raw.shape[1])
    rows = torch.arange(zp.shape[0])
    want = (raw[rows // 8] >> (4 * (rows % 8)).unsqueeze(1)) & 15
    assert torch.equal(zp.int() + 8, want) and zp.min() >= -8 and zp.max() <= 7 and len(zp.unique()) > 4
    # a partial last word: 20 rows (0..7, -8..-1, 0..3) -> 3 words, the 4 unused nibbles 0
    codes = torch.arange(-8, 12).remainder(16).sub(8).to(torch.int8).view(20, 1)
    words = pack_int32(codes.t(), 4).t()
    assert words.shape == (3, 1) and words[:, 0].tolist() == [0xFEDCBA98 - 2**32, 0x76543210, 0xBA98]
    assert torch.equal(unpack_int32(words.t(), 4, 20).t().to(torch.int8), codes)


def test_mixed_precision_config(synth_ckpt):
    """ModelOpt's MIXED_PRECISION export (process_layer_quant_config / convert_hf_quant_config_format):
    legacy quantization has quant_algo, kv_cache_quant_algo, quantized_layers (no exclude_modules);
    config.json adds one config group per distinct layer config, targets by name."""
    path = synth_ckpt("modelopt-mixed")
    cfg = qconfig(path)
    legacy = json.loads((path / "hf_quant_config.json").read_text())
    layers = {f"model.layers.{i}.{p}": {"quant_algo": "FP8"} for i in range(2) for p in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")}
    layers |= {f"model.layers.{i}.mlp.{p}": {"quant_algo": "NVFP4", "group_size": 16} for i in range(2)
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert legacy["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                      "quantized_layers": legacy["quantization"]["quantized_layers"]}
    assert legacy["quantization"]["quantized_layers"] == layers == cfg["quantized_layers"]
    assert list(cfg) == ["config_groups", "quantized_layers", "ignore", "quant_algo", "producer", "quant_method"]
    assert cfg["quant_algo"] == "MIXED_PRECISION" and cfg["ignore"] == []
    groups = cfg["config_groups"]
    assert groups["group_0"]["targets"] == sorted(n for n, c in layers.items() if c["quant_algo"] == "FP8")
    assert groups["group_0"]["weights"]["num_bits"] == 8 and groups["group_1"]["weights"]["num_bits"] == 4
    # both spellings parse to the same per-layer algos
    from qcompile.formats import parse_quant_config
    assert parse_quant_config(cfg).quantized_layers == parse_quant_config(legacy).quantized_layers


# -- 4. ModelOpt vs compressed-tensors NVFP4: only the global-scale convention differs ----------

def test_modelopt_and_ct_nvfp4_agree(loaded):
    mo, ct = loaded("modelopt-nvfp4"), loaded("ct-nvfp4")
    mo_q, ct_q = quant_layers(mo), quant_layers(ct)
    mo_ref, ct_ref = dequantize_model(copy.deepcopy(mo)), dequantize_model(copy.deepcopy(ct))
    for name in mo_q:
        # canonical (multiplying) global scales: compressed-tensors' reciprocal, inverted at load, equals
        # ModelOpt's amax / 2688 up to the bf16 rounding compressed-tensors computes it in (seen <= 0.55 %)
        for role in ("weight_global_scale", "input_global_scale"):
            ratio = (getattr(mo_q[name], role) / getattr(ct_q[name], role)).item()
            assert abs(ratio - 1) < 2 ** -7, (name, role, ratio)
        # that shift moves some fp8 block scales and then codes: up to 4.4 % of codes, 5 % of the weight
        # (the quantization error itself is 9.5 %); a reciprocal left uninverted would be ~10^8 off
        assert rel(mo_ref.get_submodule(name).weight, ct_ref.get_submodule(name).weight) < 0.07, name
    with torch.no_grad():
        assert rel(mo_ref(IDS).logits, ct_ref(IDS).logits) < 0.1


# -- 5. from the producers' own bf16 model: their bytes, exactly ---------------------------------

@pytest.fixture(scope="module")
def from_base(testdata, tmp_path_factory):
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = synth.write_checkpoint(str(tmp_path_factory.mktemp(f"base-{fmt}")), fmt,
                                                source=str(testdata / "base-bf16-dense"))
        return cache[fmt]
    return get


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt,exact", [
    ("modelopt-nvfp4", ("weight", "weight_scale", "weight_scale_2")),
    ("ct-nvfp4", ("weight_packed", "weight_scale", "weight_global_scale")),
    ("quark-mxfp4", ("weight", "weight_scale")),
    ("ct-w4a16", ("weight_scale", "weight_shape")),  # GPTQ changed the codes, not the group scales
])
def test_bit_exact_with_producer(from_base, testdata, fmt, exact):
    """Activation scales differ only because the producers calibrated on other tokens."""
    n = 0
    with safe_open(f"{from_base(fmt)}/model.safetensors", "pt") as ours, \
            safe_open(str(testdata / PRODUCER[fmt] / "model.safetensors"), "pt") as theirs:
        for key in theirs.keys():
            if key.rpartition(".")[2] in exact and "_proj." in key:
                a, b = ours.get_tensor(key), theirs.get_tensor(key)
                assert a.dtype == b.dtype and a.shape == b.shape, key
                assert same_bytes(a, b), key
                n += 1
    assert n == 14 * len(exact)


def test_mixed_bit_exact_with_modelopt(from_base, testdata):
    """MIXED_PRECISION layers are ModelOpt's FP8 / NVFP4 layers: attention as in modelopt-fp8-dense,
    MLP as in modelopt-nvfp4-dense."""
    n = 0
    with safe_open(f"{from_base('modelopt-mixed')}/model.safetensors", "pt") as ours:
        for producer, attn in (("modelopt-fp8-dense", True), ("modelopt-nvfp4-dense", False)):
            with safe_open(str(testdata / producer / "model.safetensors"), "pt") as theirs:
                for key in theirs.keys():
                    if key.rpartition(".")[2] in ("weight", "weight_scale", "weight_scale_2") and "_proj." in key \
                            and any(f".{p}." in key for p in ATTN) == attn:
                        a, b = ours.get_tensor(key), theirs.get_tensor(key)
                        assert a.dtype == b.dtype and same_bytes(a, b), key
                        n += 1
    assert n == 8 * 2 + 6 * 3


def test_source_must_be_unquantized(testdata, tmp_path):
    with pytest.raises(ValueError, match="quantized"):
        synth.write_checkpoint(str(tmp_path), "ct-nvfp4", source=str(testdata / "modelopt-nvfp4-dense"))


# -- the rounding helper ---------------------------------------------------------------------------

def test_e2m1_codes_round_to_nearest_even():
    grid = torch.arange(-56, 57, dtype=torch.float32) / 8  # every tie of e2m1 and saturation past 6
    v = torch.cat([grid, torch.randn(1000) * 3])
    lut = torch.tensor(E2M1_VALUES)
    codes = synth_4bit.e2m1_codes(v)
    assert torch.equal(lut[codes.long()], round_to_e2m1(v))
    assert codes[(v < 0) & (v > -0.25)].eq(8).all()  # -0 kept (ModelOpt, compressed-tensors)
    unsigned = synth_4bit.e2m1_codes(v, signed_zero=False)
    assert torch.equal(lut[unsigned.long()], round_to_e2m1(v)) and not unsigned.eq(8).any()  # Quark: +0
