"""qcompile::linear_ref (the oracle) and the quantization math it uses."""

from __future__ import annotations

import pytest
import torch

import qcompile  # noqa: F401  (registers the ops)
from qcompile.errors import UnsupportedError
from qcompile.kernels import quant_math
from tests.opcheck_util import opcheck
from qcompile.scheme import NVFP4_ACT, NVFP4_WEIGHT, Granularity, QuantScheme, fp8_scheme

SCHEMES = {
    "tensor/static": fp8_scheme("tensor", "static_tensor"),
    "tensor/dynamic": fp8_scheme("tensor", "dynamic_tensor"),
    "channel/token": fp8_scheme("channel", "dynamic_token"),
    "block/group": fp8_scheme("block", "dynamic_group"),
}


def make_args(scheme, m=5, n=256, k=384, dtype=torch.bfloat16, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    gran = scheme.weight.scale.granularity
    q, s = quant_math.quantize_weight_fp8(w, gran)
    x = torch.randn(m, k, generator=g).to(dtype)
    input_scale = (x.float().abs().amax() / 448).reshape(()) if not scheme.act.dynamic else None
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, q, s.float(), input_scale, b, w


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck(name, dtype):
    x, q, s, xs, b, _ = make_args(SCHEMES[name], dtype=dtype)
    x, b = x.requires_grad_(), b.requires_grad_()  # the autograd checks of opcheck need inputs requiring grad
    args = (x, q, s, None, None, None, xs, None, b, SCHEMES[name].key)
    opcheck(torch.ops.qcompile.linear_ref.default, args)
    x3 = x.reshape(1, *x.shape)
    opcheck(torch.ops.qcompile.linear_ref.default, (x3,) + args[1:])


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_reference_matches_independent_math(name):
    """Against a direct fp32 computation: dequantized weight, activation quantized by hand."""
    scheme = SCHEMES[name]
    x, q, s, xs, b, w = make_args(scheme, bias=True)
    out = torch.ops.qcompile.linear_ref(x, q, s, None, None, None, xs, None, b, scheme.key).float()
    # independent: weights back to fp32 by broadcasting the scale by hand
    gran = scheme.weight.scale.granularity
    if gran is Granularity.TENSOR:
        wf = q.float() * s
    elif gran is Granularity.CHANNEL:
        wf = q.float() * s[:, None]
    else:
        wf = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((wf - w).norm() / w.norm()) < 0.05  # fp8 weight rounding
    xf = x.float()
    if scheme.act.scale.granularity is Granularity.GROUP:
        xg = xf.view(x.shape[0], -1, 128)
        sc = (xg.abs().amax(-1, keepdim=True) / 448).clamp(min=quant_math.MIN_SCALE)
        xq = ((xg / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc).view_as(xf)
    else:
        sc = {"token": xf.abs().amax(-1, keepdim=True) / 448, "tensor": xf.abs().amax() / 448}[
            scheme.act.scale.granularity.value] if scheme.act.dynamic else xs
        xq = (xf / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc
    want = xq @ wf.t() + b.float()
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2)  # bf16 output rounding


def test_reference_refuses_formats_without_kernels():
    from qcompile.scheme import ActSpec, QDtype, ScaleSpec
    asym = QuantScheme(fp8_scheme("channel", None).weight,
                       ActSpec(QDtype.INT8, True, ScaleSpec(Granularity.TOKEN), symmetric=False))
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="asymmetric activation"):
        torch.ops.qcompile.linear_ref(x, torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(16), None, None,
                                      None, None, None, None, asym.key)


@pytest.mark.parametrize("dtype", ["fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_minifloat_codes_round_trip(dtype):
    """Every code decodes to its value and encodes back (the two signed zeros included); fp6 packs four
    codes in three bytes, element i at bits 6i of the little-endian word (Quark's layout)."""
    from qcompile.scheme import QDtype
    qd = QDtype(dtype)
    values = quant_math.minifloat_values(qd)
    codes = torch.arange(len(values), dtype=torch.uint8)
    assert torch.equal(quant_math.minifloat_codes(values, qd), codes)
    if qd is QDtype.FP4_E2M1:
        assert values.tolist() == list(quant_math.E2M1_VALUES)
        return
    assert values.abs().max() == qd.max and values[1] == 2.0 ** (-3 if dtype == "fp6_e2m3" else -4)
    row = codes.reshape(1, -1)
    packed = quant_math.pack_fp6(row)
    assert packed.shape == (1, 48) and packed[0, :3].tolist() == [0 | 1 << 6, 1 >> 2 | 2 << 4, 3 << 2]
    torch.testing.assert_close(quant_math.unpack_fp6(packed, qd), values.reshape(1, -1), rtol=0, atol=0)


@pytest.mark.parametrize("wdtype", ["fp6_e2m3", "fp6_e3m2"])
def test_mxfp6_linear_matches_independent_math(wdtype):
    """Quark MXFP6 weights with MXFP6 activations through the reference: weights decode to code values
    times 2^(e - 127), activations are MX quantize-dequantized."""
    from qcompile.scheme import MXFP4_WEIGHT, Packing, QDtype, WeightSpec, mx_act
    qd = QDtype(wdtype)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 64, (16, 64), generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 130, (16, 2), generator=g, dtype=torch.uint8)
    spec = WeightSpec(qd, MXFP4_WEIGHT.scale, Packing.UINT8_FP6)
    scheme = QuantScheme(spec, mx_act(qd))
    x = torch.randn(3, 64, generator=g, dtype=torch.bfloat16)
    out = torch.ops.qcompile.linear_ref(x, quant_math.pack_fp6(codes), exps, None, None, None, None, None, None,
                                        scheme.key)
    w = quant_math.minifloat_values(qd)[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, 1)
    want = quant_math.qdq_mx_activation(x.float(), qd) @ w.t()
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("act", ["dynamic_token", "dynamic_tensor", "static_tensor"])
def test_int8_activations(act):
    """W8A8-INT8 through the reference: x rounded half-even to int8 steps of amax / 127 (per token or per
    tensor), or of the static scale, saturating at [-128, 127]."""
    from qcompile.scheme import ActSpec, QDtype, ScaleSpec, WeightSpec
    gran = Granularity.TOKEN if act == "dynamic_token" else Granularity.TENSOR
    scheme = QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(Granularity.CHANNEL)),
                         ActSpec(QDtype.INT8, act != "static_tensor", ScaleSpec(gran)))
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
    s = torch.rand(32, generator=g) * 0.01 + 1e-3
    x = torch.randn(4, 64, generator=g)
    xs = torch.tensor(0.02) if act == "static_tensor" else None
    out = torch.ops.qcompile.linear_ref(x, q, s, None, None, None, xs, None, None, scheme.key)
    sx = xs if xs is not None else (x.abs().amax(-1, keepdim=True) if gran is Granularity.TOKEN else x.abs().amax()) / 127
    want = (torch.round(x / sx).clamp(-128, 127) * sx) @ (q.float() * s[:, None]).t()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_nvfp4_activation_qdq():
    """Values land on e2m1 x (fp8 block scale) x global; a block's max maps to 6 units."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * 3
    gs = torch.tensor(0.01)
    y = quant_math.qdq_nvfp4_activation(x, gs)
    blocks_x, blocks_y = x.view(4, 4, 16), y.view(4, 4, 16)
    s = (blocks_x.abs().amax(-1, keepdim=True) / 6 / gs).to(torch.float8_e4m3fn).float() * gs
    codes = blocks_y / s
    grid = torch.tensor(quant_math.E2M1_MAGNITUDES)
    assert (codes.abs().unsqueeze(-1) - grid).abs().amin(-1).max() < 1e-4
    # e2m1 spacing is at most 2 (between 4 and 6): error per element at most one unit of the scale
    assert ((blocks_y - blocks_x).abs() <= s * 1.0 + 1e-6).all()


NVFP4 = QuantScheme(NVFP4_WEIGHT, NVFP4_ACT)


def test_requantize_to_max_scale():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(64, 128, generator=g) * a for a in (0.01, 0.05, 0.2)]
    qs = [quant_math.quantize_weight_fp8(w, Granularity.TENSOR) for w in ws]
    fused, scale = quant_math.requantize_to_max_scale([q for q, _ in qs], [s for _, s in qs])
    assert fused.shape == (192, 128) and fused.dtype == torch.float8_e4m3fn
    assert scale == max(s for _, s in qs)
    deq = fused.float() * scale
    for i, (q, s) in enumerate(qs):
        part = deq[64 * i: 64 * (i + 1)]
        orig = q.float() * s
        # the shard with the largest scale is unchanged; the others lose at most the coarser grid
        assert ((part - orig).abs().max() <= scale * 2 ** -3 * 448 / 2 ** 3 + 1e-9)
    torch.testing.assert_close(deq[128:], qs[2][0].float() * qs[2][1])


def test_dynamic_scale_never_zero():
    s = quant_math.dynamic_fp8_scale(torch.zeros(3, 128), Granularity.TOKEN)
    assert (s > 0).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_pack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(lo, hi + 1, (16, 64), generator=g, dtype=torch.int32)
    packed = quant_math.pack_int32(codes, bits)
    assert packed.shape == (16, 64 * bits // 32) and packed.dtype == torch.int32
    assert torch.equal(quant_math.unpack_int32(packed, bits, 64), codes)


def test_e2m1_pack_round_trip_and_values():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 2)  # [4, 32]
    packed = quant_math.pack_e2m1(codes)
    assert packed.shape == (4, 16)
    assert int(packed[0, 0]) == 0x10  # element 0 in the low nibble, element 1 in the high one
    values = quant_math.unpack_e2m1(packed)
    assert values[0, :16].tolist() == list(quant_math.E2M1_VALUES)


@pytest.mark.parametrize("name,names,spec,err", [
    # (checkpoint, (codes, scale, global or None, reciprocal global), scheme, weight error vs base)
    ("llmcompressor-w4a16-gptq-dense", ("weight_packed", "weight_scale", None, False), "int4", 0.2),
    ("llmcompressor-nvfp4-dense", ("weight_packed", "weight_scale", "weight_global_scale", True), "nvfp4", 0.12),
    ("modelopt-nvfp4-dense", ("weight", "weight_scale", "weight_scale_2", False), "nvfp4", 0.12),
    ("quark-w-mxfp4-dense", ("weight", "weight_scale", None, False), "mxfp4", 0.14),
])
def test_reference_dequantizes_producer_weights(testdata, name, names, spec, err):
    """The producers' 4-bit weights dequantize back to the base model's (their conventions are right:
    a wrong nibble order, offset or reciprocal gives >= 100 %)."""
    from safetensors import safe_open

    from qcompile.scheme import MXFP4_WEIGHT, NVFP4_WEIGHT, Packing, ScaleSpec, WeightSpec, QDtype
    specs = {"int4": WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=128), Packing.INT32),
             "nvfp4": NVFP4_WEIGHT, "mxfp4": MXFP4_WEIGHT}
    layer = "model.layers.0.mlp.down_proj"
    with safe_open(str(testdata / "base-bf16-dense" / "model.safetensors"), "pt") as f:
        base = f.get_tensor(f"{layer}.weight").float()
    codes, scale, glob, recip = names
    with safe_open(str(testdata / name / "model.safetensors"), "pt") as f:
        g = f.get_tensor(f"{layer}.{glob}") if glob else None
        g = 1.0 / g if (g is not None and recip) else g
        w = quant_math.dequantize_weight(f.get_tensor(f"{layer}.{codes}"), f.get_tensor(f"{layer}.{scale}"),
                                         specs[spec], g, k=base.shape[1])
    assert ((w - base).norm() / base.norm()) < err


def test_minifloat_rounding_matches_torch_fp8_and_known_values():
    from qcompile.scheme import QDtype
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 50
    assert torch.equal(quant_math.round_to_minifloat(x, QDtype.FP8_E4M3), x.to(torch.float8_e4m3fn).float())
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3])  # e2m1: ties to even mantissa
    assert quant_math.round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5]
    assert quant_math.round_to_minifloat(torch.tensor([7.6, 0.1]), QDtype.FP6_E2M3).tolist() == [7.5, 0.125]
    assert quant_math.round_to_minifloat(torch.tensor([29.0, 0.03]), QDtype.FP6_E3M2).tolist() == [28.0, 0.0]


@pytest.mark.parametrize("dtype,rel", [("fp4_e2m1", 0.2), ("fp6_e2m3", 0.06), ("fp6_e3m2", 0.1), ("fp8_e4m3", 0.04)])
def test_mx_activation_qdq(dtype, rel):
    """Power-of-two scale per 32; the group max keeps the element type's top exponent."""
    from qcompile.scheme import QDtype
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(4))
    y = quant_math.qdq_mx_activation(x, QDtype(dtype))
    assert ((y - x).norm() / x.norm()) < rel
    scale = torch.exp2(torch.floor(torch.log2(x.view(8, 4, 32).abs().amax(-1))) - quant_math.MX_EMAX[QDtype(dtype)])
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))  # powers of two
