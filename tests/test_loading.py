"""Loading real producers' checkpoints and synthesized ones: storage kept, reference semantics right."""

from __future__ import annotations

import copy

import pytest
import torch

import qcompile
from qcompile.linear import QuantLinear, dequantize_model

FP8_SYNTH = ["modelopt-fp8", "modelopt-fp8-pcpt", "modelopt-fp8-pbwo", "ct-fp8-static", "ct-fp8-dynamic",
             "ct-fp8-block"]
EXPECTED_SCHEME = {
    "modelopt-fp8": "w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor",
    "modelopt-fp8-pcpt": "w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token",
    "modelopt-fp8-pbwo": "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128",
    "ct-fp8-static": "w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor",
    "ct-fp8-dynamic": "w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token",
    "ct-fp8-block": "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128",
}
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 300, 11]])


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_model(model, scheme: str | None):
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    for m in layers:
        assert m.weight.dtype == torch.float8_e4m3fn
        assert m.weight_scale.dtype == torch.float32
        if scheme:
            assert m.scheme_key == scheme
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    # eager (reference semantics) vs the dequantized bf16 reference: only activation quantization differs.
    # FP8 e4m3 rounds each activation by up to 2^-4 (RMS ~3.6%), compounding over 2 layers: 7-8% seen
    # for static per-tensor scales; a scale convention bug (reciprocal, wrong axis) gives >= 100%.
    ref = dequantize_model(copy.deepcopy(model))
    with torch.no_grad():
        out, want = model(IDS).logits, ref(IDS).logits
    assert rel_err(out, want) < 0.12
    return out


@pytest.mark.parametrize("fmt", FP8_SYNTH)
def test_synth_formats_load_with_their_scheme(synth_ckpt, fmt):
    model = qcompile.load(str(synth_ckpt(fmt)))
    check_model(model, EXPECTED_SCHEME[fmt])


@pytest.mark.parametrize("name,scheme", [
    ("modelopt-fp8-dense", EXPECTED_SCHEME["modelopt-fp8"]),
    ("llmcompressor-fp8-dynamic-dense", EXPECTED_SCHEME["ct-fp8-dynamic"]),
])
def test_producer_checkpoints_load(testdata, name, scheme):
    model = qcompile.load(str(testdata / name))
    check_model(model, scheme)


def test_producer_checkpoint_matches_base_model(testdata):
    """The quantized checkpoints were made from base-bf16-dense: dequantized logits stay close."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(testdata / "base-bf16-dense"), dtype=torch.bfloat16)
    for name in ("modelopt-fp8-dense", "llmcompressor-fp8-dynamic-dense"):
        model = qcompile.load(str(testdata / name))
        with torch.no_grad():
            # weight rounding alone is 8.5% for ModelOpt's per-tensor scales on this random model
            assert rel_err(model(IDS).logits, base(IDS).logits) < 0.2, name


def test_plain_from_pretrained_loads_modelopt(testdata):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(testdata / "modelopt-fp8-dense"))
    check_model(model, EXPECTED_SCHEME["modelopt-fp8"])


def test_from_pretrained_with_qcompile_config_takes_over_compressed_tensors(testdata):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(testdata / "llmcompressor-fp8-dynamic-dense"),
                                                 quantization_config=qcompile.QCompileConfig())
    check_model(model, EXPECTED_SCHEME["ct-fp8-dynamic"])


def test_legacy_hf_quant_config_only(synth_ckpt, tmp_path):
    """ModelOpt checkpoints with the config only in hf_quant_config.json."""
    import json
    import shutil

    src = synth_ckpt("modelopt-fp8")
    shutil.copytree(src, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    check_model(qcompile.load(str(tmp_path / "ck")), EXPECTED_SCHEME["modelopt-fp8"])


@pytest.mark.parametrize("online,scheme", [
    ("fp8_per_tensor", "w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor"),
    ("fp8_per_block", "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128"),
])
def test_online_fp8_of_bf16_checkpoint(testdata, online, scheme):
    from transformers import AutoModelForCausalLM

    model = qcompile.load(str(testdata / "base-bf16-dense"), online=online)
    out = check_model(model, scheme)
    base = AutoModelForCausalLM.from_pretrained(str(testdata / "base-bf16-dense"), dtype=torch.bfloat16)
    with torch.no_grad():
        assert rel_err(out, base(IDS).logits) < 0.2


@pytest.mark.parametrize("name,scheme,tol", [
    # weight-only: eager (fp32 math on the dequantized weight) vs the bf16 dequantized model
    ("llmcompressor-w4a16-gptq-dense", "w=int4/group128/pack=int32;a=none", 0.03),
    ("quark-w-mxfp4-dense", "w=fp4_e2m1/group32:e8m0/pack=uint8;a=none", 0.03),
    # W4A4: the reference quantize-dequantizes activations to NVFP4 (e2m1 keeps 1 mantissa bit)
    ("modelopt-nvfp4-dense", "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global", 0.35),
    ("llmcompressor-nvfp4-dense", "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global", 0.35),
])
def test_4bit_producer_checkpoints_run_the_reference(testdata, name, scheme, tol):
    """4-bit formats keep their packed storage and run the reference op."""
    model = qcompile.load(str(testdata / name))
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.scheme_key == scheme
    assert q.weight.dtype in (torch.uint8, torch.int32) and q.weight.numel() == 256 * 256 // (8 if q.weight.dtype == torch.int32 else 2)
    ref = dequantize_model(copy.deepcopy(model))
    with torch.no_grad():
        assert rel_err(model(IDS).logits, ref(IDS).logits) < tol


def test_modelopt_and_compressed_tensors_nvfp4_agree(testdata):
    """Same base model, same algorithm, opposite global-scale conventions: same weights."""
    a = qcompile.load(str(testdata / "modelopt-nvfp4-dense"))
    b = qcompile.load(str(testdata / "llmcompressor-nvfp4-dense"))
    wa = dequantize_model(a).model.layers[0].mlp.down_proj.weight.float()
    wb = dequantize_model(b).model.layers[0].mlp.down_proj.weight.float()
    # 3 % seen: the two producers round block scales differently; a convention bug gives >= 100 %
    assert ((wa - wb).norm() / wb.norm()) < 0.05


def test_quantized_moe_experts_load(testdata):
    """Quantized MoE experts load as QuantExperts with the stacked fp8 storage (tests/test_experts.py has
    every producer's MoE checkpoint)."""
    from qcompile.experts import QuantExperts

    model = qcompile.load(str(testdata / "modelopt-fp8-moe"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.w13_weight.dtype == torch.float8_e4m3fn
    assert not any(isinstance(m, QuantLinear) for m in experts.modules())


def test_inductor_on_cpu_matches_the_dequantized_reference(testdata):
    """The default inner compiler (inductor) on the CPU, fp8 kernel op = emulated backend."""
    torch._dynamo.reset()
    model = qcompile.load(str(testdata / "modelopt-fp8-dense"))
    ref = dequantize_model(copy.deepcopy(model))
    be = qcompile.backend()
    with torch.no_grad():
        out = torch.compile(model, backend=be)(IDS).logits
        want = ref(IDS).logits
    assert {r.kernel for r in be.rows} == {"fp8_emulated"}
    assert rel_err(out, want) < 0.15


def test_online_layers_quantize_as_their_weight_arrives():
    """Loading never holds more than one layer's bf16 weight: the swap happens in __setattr__."""
    from qcompile.formats import parse_quant_config
    from qcompile.formats.online import online_config

    lq = parse_quant_config(online_config("fp8_per_block")).resolve("model.layers.0.mlp.up_proj")
    linear = torch.nn.Linear(256, 512, bias=False, device="meta", dtype=torch.bfloat16)
    name = "model.layers.0.mlp.up_proj"
    mod = QuantLinear.plan(linear, name, lq, {f"{name}.weight": (torch.bfloat16, (512, 256))})
    w = torch.randn(512, 256, dtype=torch.bfloat16)
    setattr(mod, "weight", torch.nn.Parameter(w, requires_grad=False))  # what transformers does
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale.shape == (4, 2)
    mod.finalize()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    rel = (mod(x).float() - x.float() @ w.float().t()).norm() / (x.float() @ w.float().t()).norm()
    assert rel < 0.1


@pytest.mark.parametrize("bits,strategy,n", [(8, "channel", 20), (4, "group", 20), (8, "group", 64)])
def test_asymmetric_pack_quantized_zero_points_unpack_at_load(bits, strategy, n):
    """compressed-tensors asymmetric pack-quantized: zero points packed 32/bits per int32 along
    out_features (N = 20 leaves a partial last word), unpacked to int8 [N] / [N, K/g] at load; the
    layer computes (q - z) * s."""
    from qcompile.formats import parse_quant_config
    from qcompile.kernels.quant_math import pack_int32

    k, g = 256, 128
    args = {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": False,
            "group_size": g if strategy == "group" else None}
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"g": {"targets": ["Linear"], "weights": args}}}
    name = "model.layers.0.mlp.up_proj"
    lq = parse_quant_config(cfg).resolve(name)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    gen = torch.Generator().manual_seed(bits + n)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    cols = k // g if strategy == "group" else 1
    zp = torch.randint(lo, hi, (n, cols), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, cols, generator=gen) + 0.5
    tensors = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.bfloat16(),
               "weight_zero_point": pack_int32(zp.t().contiguous(), bits).t().contiguous(),
               "weight_shape": torch.tensor([n, k])}
    assert tensors["weight_zero_point"].shape == (-(-n * bits // 32), cols)
    linear = torch.nn.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16)
    mod = QuantLinear.plan(linear, name, lq, {f"{name}.{t}": (v.dtype, tuple(v.shape)) for t, v in tensors.items()})
    for t, v in tensors.items():
        setattr(mod, t, torch.nn.Parameter(v, requires_grad=False))
    mod.finalize()
    want_zp = zp if strategy == "group" else zp.view(n)
    assert mod.weight_zero_point.dtype == torch.int8 and torch.equal(mod.weight_zero_point, want_zp)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    w = (q.float() - zp.float().repeat_interleave(k // cols, 1)) * scale.bfloat16().float().repeat_interleave(k // cols, 1)
    ref = x.float() @ w.t()
    assert ((mod(x).float() - ref).norm() / ref.norm()).item() < 1e-2
