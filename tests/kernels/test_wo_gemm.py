"""qcompile::wo_linear: RTN quantizers and pack round trips, the op contract, the dequant backend,
the Triton kernels under the interpreter (subprocess), kernel selection, and GPU checks.

Weights are fresh random bf16-range matrices quantized here, round-to-nearest, into each format's
canonical tensors. CPU tests run everywhere (< 60 s); ``@pytest.mark.gpu`` ones skip without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcompile.errors import UnsupportedError
from qcompile.kernels import quant_math, registry
from qcompile.kernels import wo_gemm as wg
from qcompile.kernels.registry import KernelQuery
from qcompile.scheme import (MXFP4_WEIGHT, MXFP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, Granularity, Packing, QDtype,
                             QuantScheme, ScaleDtype, ScaleSpec, WeightSpec, fp8_scheme)
from tests.opcheck_util import opcheck

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()


def _int(dtype, gran, group=0, packing=Packing.INT32, **kw):
    return WeightSpec(dtype, ScaleSpec(gran, group_size=group), packing, **kw)


SPECS = {  # every format the op runs, the common ones first
    "int4_g128": _int(QDtype.INT4, Granularity.GROUP, 128),
    "int4_g64": _int(QDtype.INT4, Granularity.GROUP, 64),
    "int4_g32": _int(QDtype.INT4, Granularity.GROUP, 32),
    "int4_channel": _int(QDtype.INT4, Granularity.CHANNEL),
    "int4_g128_zp": _int(QDtype.INT4, Granularity.GROUP, 128, zero_point=True),
    "int4_g32_actorder": _int(QDtype.INT4, Granularity.GROUP, 32, act_order=True),
    "nvfp4": NVFP4_WEIGHT,
    "mxfp4": MXFP4_WEIGHT,
    "int8_channel_packed": _int(QDtype.INT8, Granularity.CHANNEL),
    "int8_g128": _int(QDtype.INT8, Granularity.GROUP, 128, Packing.NONE),
    "int8_tensor_zp": _int(QDtype.INT8, Granularity.TENSOR, packing=Packing.NONE, zero_point=True),
    "mxfp8": MXFP8_WEIGHT,
}


# -- RTN quantizers into the canonical tensors ------------------------------------------------------

def _columns(spec: WeightSpec, k: int, g: torch.Generator, device):
    """Scale column of every input column [K], the number of columns, and g_idx (act-order)."""
    gran, size = spec.scale.granularity, spec.scale.group_size
    if gran is not Granularity.GROUP:
        return torch.zeros(k, dtype=torch.long, device=device), 1, None
    if spec.act_order:
        g_idx = (torch.randperm(k, generator=g) // size).to(torch.int32).to(device)
        return g_idx.long(), k // size, g_idx
    return torch.arange(k, device=device) // size, k // size, None


def _reduce(v: torch.Tensor, col: torch.Tensor, ncol: int, how: str) -> torch.Tensor:
    init = torch.full((v.shape[0], ncol), float("-inf") if how == "amax" else float("inf"), device=v.device)
    return init.scatter_reduce(1, col.expand_as(v), v, how)


def _e8m0(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """OCP MX scale: 2^(floor(log2 amax) - emax) as a biased uint8 exponent."""
    e = torch.floor(torch.log2(amax.clamp(min=2.0**-120))) - emax
    return (e.clamp(-127, 127) + 127).to(torch.uint8)


def _nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    mags = torch.tensor(quant_math.E2M1_VALUES[:8], device=y.device)
    code = (y.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    return code | ((y < 0) & (code > 0)).long() << 3  # no -0: zero codes come back as +0


def rtn_quantize(spec: WeightSpec, w: torch.Tensor, seed: int = 0) -> dict:
    """Round-to-nearest quantization of fp32 ``w`` [N, K] into the op's tensors for ``spec``."""
    g = torch.Generator().manual_seed(seed)
    n, k = w.shape
    col, ncol, g_idx = _columns(spec, k, g, w.device)
    out = dict(weight_global_scale=None, weight_zero_point=None, weight_g_idx=g_idx)
    if spec.dtype in (QDtype.INT4, QDtype.INT8):
        qmax = 7 if spec.dtype is QDtype.INT4 else 127
        tensor = spec.scale.granularity is Granularity.TENSOR
        v, c = (w.reshape(1, -1), torch.zeros(w.numel(), dtype=torch.long, device=w.device)) if tensor else (w, col)
        if spec.zero_point:
            lo, hi = _reduce(v, c, ncol, "amin").clamp(max=0), _reduce(v, c, ncol, "amax").clamp(min=0)
            s = ((hi - lo) / (2 * qmax + 1)).clamp(min=1e-8)
            z = (torch.round(-lo / s) - qmax - 1).clamp(-qmax - 1, qmax)
            q = (torch.round(v / s[:, c]) + z[:, c]).clamp(-qmax - 1, qmax)
        else:
            s = (_reduce(v.abs(), c, ncol, "amax") / qmax).clamp(min=1e-8)
            q = torch.round(v / s[:, c]).clamp(-qmax - 1, qmax)
        q = q.reshape(n, k)
        shape = () if tensor else (n,) if spec.scale.granularity is Granularity.CHANNEL else (n, ncol)
        s = s.reshape(shape)
        if spec.zero_point:
            out["weight_zero_point"] = z.reshape(shape)
        bits = spec.dtype.bits
        weight = quant_math.pack_int32(q.to(torch.int32), bits) if spec.packing is Packing.INT32 else q.to(torch.int8)
        out.update(weight=weight, weight_scale=s.float())
    elif spec.dtype is QDtype.FP4_E2M1:
        amax = _reduce(w.abs(), col, ncol, "amax")
        if spec.scale.dtype is ScaleDtype.FP8_E4M3:  # NVFP4: fp8 block scale x fp32 global scale
            gs = (w.abs().amax() / (448.0 * 6.0)).float()
            s = (amax / 6.0 / gs).clamp(max=448.0).to(torch.float8_e4m3fn)
            unit = s.float()[:, col] * gs
            out["weight_global_scale"] = gs
        else:  # MXFP4
            s = _e8m0(amax, 2)
            unit = quant_math.scale_to_fp32(s, ScaleDtype.E8M0)[:, col]
        y = torch.where(unit > 0, w / unit, torch.zeros_like(w))
        out.update(weight=quant_math.pack_e2m1(_nearest_e2m1(y)), weight_scale=s)
    else:  # MXFP8
        s = _e8m0(_reduce(w.abs(), col, ncol, "amax"), 8)
        unit = quant_math.scale_to_fp32(s, ScaleDtype.E8M0)[:, col]
        out.update(weight=(w / unit).clamp(-448, 448).to(torch.float8_e4m3fn), weight_scale=s)
    return out


def make_case(name: str | WeightSpec, n: int, k: int, m_shape=(3,), dtype=torch.bfloat16, bias=False, seed=0,
              device="cpu"):
    """A random layer quantized as ``name`` (a key of SPECS, or a WeightSpec)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g)) / k**0.5
    w[:, :: max(1, k // 5)] *= 6  # a few large columns: groups differ
    spec = SPECS[name] if isinstance(name, str) else name
    q = rtn_quantize(spec, w, seed)
    x = torch.randn(*m_shape, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return dict(x=x.to(dtype).to(device), **{r: to(t) for r, t in q.items()}, bias=to(None if b is None else b.to(dtype)),
                scheme=QuantScheme(spec).key, w_ref=w)


# formats run with K not a multiple of BLOCK_K (the interpreter's tail cases)
TAIL_NAMES = ["nvfp4", "mxfp4", "mxfp8", "int4_g32", "int4_g32_actorder", "int4_channel", "int8_channel_packed",
              "int8_tensor_zp"]
ROLES = ("x", "weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx", "bias", "scheme")


def op_args(case, backend):
    return tuple(case[r] for r in ROLES) + (backend,)


def dequantized(case) -> torch.Tensor:
    spec = wg.parse_scheme_key(case["scheme"]).weight
    return quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec, case["weight_global_scale"],
                                        case["weight_zero_point"], case["weight_g_idx"], case["x"].shape[-1])


def reference(case) -> torch.Tensor:
    """x @ dequantize(W).T + b in fp64 (the math every backend approximates)."""
    k = case["x"].shape[-1]
    out = case["x"].reshape(-1, k).double() @ dequantized(case).double().t()
    if case["bias"] is not None:
        out = out + case["bias"].double()
    return out.reshape(*case["x"].shape[:-1], -1)


# -- quantizers and packing (exact round trips) -----------------------------------------------------

# quantize(dequantize(quantize(w))) == quantize(w): symmetric int (the max element sits on +-qmax,
# the scale comes back to 1 ulp) and MX (e8m0 exponent of a saturated block is unchanged). Not NVFP4
# (the fp8 block scale rounds) nor zero points (the range moves onto the grid).
IDEMPOTENT = [n for n, s in SPECS.items() if not s.zero_point and not s.global_scale]


@pytest.mark.parametrize("name", list(SPECS))
def test_rtn_round_trip(name):
    """The test's quantizers: close to the input (SQNR > 10 dB for 4-bit with its outlier columns, > 25 dB for 8-bit), and
    idempotent where the format allows (codes bit for bit, scales to 1 ulp)."""
    case = make_case(name, 64, 256, seed=3)
    spec = wg.parse_scheme_key(case["scheme"]).weight
    w1 = dequantized(case)
    if name in IDEMPOTENT:
        again = rtn_quantize(spec, w1, seed=3)
        assert torch.equal(_bytes(case["weight"]), _bytes(again["weight"]))
        assert torch.equal(case["weight_g_idx"], again["weight_g_idx"]) if spec.act_order else True
        torch.testing.assert_close(quant_math.scale_to_fp32(again["weight_scale"], spec.scale.dtype),
                                   quant_math.scale_to_fp32(case["weight_scale"], spec.scale.dtype),
                                   rtol=2.0**-23, atol=0)
    sqnr = 10 * torch.log10(case["w_ref"].pow(2).sum() / (w1 - case["w_ref"]).pow(2).sum())
    assert sqnr > (10 if spec.dtype.bits == 4 else 25), f"{name}: SQNR {sqnr:.1f} dB"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([4, 8]), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_pack_int32_round_trip(bits, words, seed):
    g = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    codes = torch.randint(lo, -lo, (3, words * 32 // bits), generator=g, dtype=torch.int32)
    packed = quant_math.pack_int32(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, words)
    assert torch.equal(quant_math.unpack_int32(packed, bits, codes.shape[1]), codes)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_pack_e2m1_round_trip_and_word_view(words, seed):
    """Two codes per byte, low nibble first; viewed as int32 words, code j sits at bits 4j (what the
    kernel reads) exactly as in the int4 pack-quantized layout."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (2, 8 * words), generator=g)
    packed = quant_math.pack_e2m1(codes)
    lut = torch.tensor(quant_math.E2M1_VALUES)
    assert torch.equal(quant_math.unpack_e2m1(packed), lut[codes])
    word_codes = quant_math.unpack_int32(packed.view(torch.int32), 4, 8 * words) + 8
    assert torch.equal(word_codes, codes)


# -- the op contract and the dequant backend (CPU) --------------------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
def test_opcheck(name):
    for i, (dtype, bias, m_shape) in enumerate([(torch.bfloat16, False, (5,)), (torch.float16, True, (2, 3))]):
        case = make_case(name, 64, 256, m_shape, dtype, bias, seed=i)
        opcheck(torch.ops.qcompile.wo_linear.default, op_args(case, "dequant"))
        out = torch.ops.qcompile.wo_linear(*op_args(case, "dequant"))
        assert out.shape == (*m_shape, 64) and out.dtype == dtype


def sorted_case(case):
    """An act-order case with its input columns sorted by group (quant_math.sort_act_order), as a GPU
    load does for wo_mma: scheme k_sorted, g_idx = the permutation."""
    spec = wg.parse_scheme_key(case["scheme"]).weight
    weight, perm = quant_math.sort_act_order(case["weight"], case["weight_g_idx"], spec, case["x"].shape[-1])
    return dict(case, weight=weight, weight_g_idx=perm,
                scheme=QuantScheme(replace(spec, act_order=False, k_sorted=True)).key)


@pytest.mark.parametrize("dtype,packing", [(QDtype.INT4, Packing.INT32), (QDtype.INT8, Packing.INT32),
                                           (QDtype.INT8, Packing.NONE)])
def test_sort_act_order_is_exact(dtype, packing):
    """Sorting an act-order weight's columns by group moves codes only: the dequantized layer is
    bit for bit the same, the op computes the same function, and a g_idx whose groups are not all
    G columns wide is left alone."""
    spec = _int(dtype, Granularity.GROUP, 32, packing, act_order=True)
    case = make_case(spec, 48, 256, (4,), torch.bfloat16, seed=7)
    srt = sorted_case(case)
    assert srt["scheme"].endswith("ksorted;a=none") and not torch.equal(srt["weight"], case["weight"])
    assert torch.equal(dequantized(srt), dequantized(case))
    opcheck(torch.ops.qcompile.wo_linear.default, op_args(srt, "dequant"))
    want = reference(case)
    got = torch.ops.qcompile.wo_linear(*op_args(srt, "dequant")).double()
    assert ((got - want).norm() / want.norm()).item() < 4e-3
    uneven = case["weight_g_idx"].clone()
    uneven[uneven == 1] = 0  # group 0 now 64 columns wide, group 1 empty
    assert quant_math.sort_act_order(case["weight"], uneven, spec, 256) is None


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequant_backend_matches_reference(name, dtype):
    """dequant = quant_math weights rounded to x.dtype, then F.linear. Against the fp64 reference:
    per output |out - ref| <= 2^-7 (bf16) / 2^-10 (fp16) * |ref| + 2^-8 / 2^-11 * rms(ref) * 4 (the
    weight rounding: K products each off by <= 1/2 ulp, random signs), and normwise < 4e-3 / 5e-4."""
    case = make_case(name, 96, 512, (2, 3), dtype, bias=True, seed=11)
    out = torch.ops.qcompile.wo_linear(*op_args(case, "dequant")).double()
    ref = reference(case)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    rms = ref.pow(2).mean().sqrt()
    assert ((out - ref).abs() <= ulp * ref.abs() + 2 * ulp * rms).all()
    assert (out - ref).norm() / ref.norm() < (4e-3 if dtype == torch.bfloat16 else 5e-4)


def test_op_rejects_what_it_cannot_run():
    case = make_case("int4_g128", 64, 256)
    args = list(op_args(case, "dequant"))
    with pytest.raises(UnsupportedError, match="unknown wo_linear backend"):
        torch.ops.qcompile.wo_linear(*args[:8], "marlin")
    if not wg.use_triton(case["x"]):
        with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
            torch.ops.qcompile.wo_linear(*args[:8], "triton")
    with pytest.raises(UnsupportedError, match="weight_scale must be"):
        torch.ops.qcompile.wo_linear(args[0], args[1], torch.ones(64, 3), *args[3:])
    with pytest.raises(UnsupportedError, match="weight must be"):
        torch.ops.qcompile.wo_linear(args[0], args[1][:, :16], *args[2:])
    with pytest.raises(UnsupportedError, match="needs weight_global_scale"):
        nv = make_case("nvfp4", 64, 256)
        torch.ops.qcompile.wo_linear(*op_args({**nv, "weight_global_scale": None}, "dequant"))
    fp6 = WeightSpec(QDtype.FP6_E2M3, MXFP4_WEIGHT.scale, Packing.UINT8_FP6)
    with pytest.raises(UnsupportedError, match="not a wo_linear format"):
        torch.ops.qcompile.wo_linear(*args[:7], QuantScheme(fp6).key, "dequant")


def test_scheme_with_activations_runs_weight_only():
    """NVFP4 W4A4 (no FP4 GEMM here) runs weight-only; the Linear pass warns about it."""
    case = make_case("nvfp4", 64, 256)
    w4a4 = QuantScheme(NVFP4_WEIGHT, NVFP4_ACT).key
    out = torch.ops.qcompile.wo_linear(*op_args({**case, "scheme": w4a4}, "dequant"))
    assert torch.equal(out, torch.ops.qcompile.wo_linear(*op_args(case, "dequant")))


def test_empty_batch():
    case = make_case("mxfp4", 64, 256, (0,))
    assert torch.ops.qcompile.wo_linear(*op_args(case, "dequant")).shape == (0, 64)


# -- the Triton kernels under the interpreter (subprocess: TRITON_INTERPRET is read at import) --------

INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json, os, torch
    from dataclasses import replace
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import wo_gemm as wg, quant_math as qm
    from tests.kernels.test_wo_gemm import SPECS, TAIL_NAMES, make_case, op_args, reference, dequantized
    res = {}
    # every code of every element format, every e8m0 / e4m3 scale byte: dequant kernel == quant_math;
    # K = 288 ends in a partial block (4.5 x 64, 1.125 x 256) where the group allows it
    n = 32
    for (name, spec), k in [(ns, k) for k in (256, 288) for ns in SPECS.items()]:
        if wg.triton_shape_reason(spec, n, k):
            continue
        tag = name if k == 256 else f"{name}-k{k}"
        case = make_case(name, n, k, seed=5)
        w = case["weight"]
        if w.dtype == torch.float8_e4m3fn:  # all non-NaN bytes
            b = torch.arange(256, dtype=torch.uint8).repeat(n * k // 256).view(n, k)
            w = torch.where((b & 0x7F) == 0x7F, 0, b).view(torch.float8_e4m3fn)
        elif w.dtype in (torch.uint8, torch.int8, torch.int32):
            w = torch.randint(0, 256, (n, w.shape[1] * w.element_size()), dtype=torch.uint8).view(w.dtype)
        s = case["weight_scale"]
        if s.dtype == torch.uint8:
            s = torch.randint(0, 255, s.shape, dtype=torch.uint8)  # 2^-127 .. 2^127
        elif s.dtype == torch.float8_e4m3fn:
            s = torch.randint(0, 127, s.shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
        case.update(weight=w, weight_scale=s)
        spec_w = wg.parse_scheme_key(case["scheme"]).weight
        got = wg.dequantize_triton(w, s, spec_w, case["weight_global_scale"], case["weight_zero_point"],
                                   case["weight_g_idx"], k, torch.float32)
        res[f"dequant-exact-{tag}"] = bool(torch.equal(got, dequantized(case)))
        if k == 256:  # the same weight in wo_mma's order (quant_math.tile_words)
            tiled = replace(spec_w, tiled=True)
            got = wg.dequantize_triton(qm.tile_weight(w, spec_w), s, tiled, case["weight_global_scale"],
                                       case["weight_zero_point"], case["weight_g_idx"], k, torch.float32)
            res[f"dequant-exact-tiled-{name}"] = bool(torch.equal(got, dequantized(case)))
    # the GEMM kernel, several configurations, vs the fp64 reference
    def cfgs(epw):
        bk = 16 * epw
        return {"dot": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=1, num_warps=4, num_stages=2),
                "dot-bk2-split2": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=2 * bk, SPLIT_K=2,
                                       num_warps=4, num_stages=2),
                "xperm-noprefetch-split3": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=3, num_warps=4,
                                                num_stages=2, X_PERMUTED=True, SCALE_PREFETCH=False)}
    errs = {}
    for name, spec in SPECS.items():
        lay = wg.layout_of(spec)
        for m in (1, 17):
            case = make_case(name, 40, 512, (m,), torch.bfloat16, bias=m == 17, seed=m)
            ref = reference(case)
            for cname, cfg in cfgs(lay.epw).items():
                out = wg.wo_gemm(case["x"], case["weight"], case["weight_scale"], case["weight_global_scale"],
                                 case["weight_zero_point"], case["weight_g_idx"], case["bias"], spec, cfg).double()
                rms = ref.pow(2).mean().sqrt()
                worst = ((out - ref).abs() / (2.0**-6 * ref.abs() + 2.0**-6 * rms)).max().item()
                errs[f"{name}-m{m}-{cname}"] = [worst, ((out - ref).norm() / ref.norm()).item()]
        case = make_case(name, 48, 512, (5,), torch.bfloat16, seed=3)  # tiled weights (N % 16 == 0)
        ref = reference(case)
        for cname in ("dot", "dot-bk2-split2"):
            out = wg.wo_gemm(case["x"], qm.tile_weight(case["weight"], spec), case["weight_scale"],
                             case["weight_global_scale"], case["weight_zero_point"], case["weight_g_idx"],
                             case["bias"], replace(spec, tiled=True), cfgs(lay.epw)[cname]).double()
            rms = ref.pow(2).mean().sqrt()
            worst = ((out - ref).abs() / (2.0**-6 * ref.abs() + 2.0**-6 * rms)).max().item()
            errs[f"{name}-tiled-{cname}"] = [worst, ((out - ref).norm() / ref.norm()).item()]
    # the op's triton backend, including the switch to dequant + F.linear above WO_MAX_M
    for m in (3, wg.WO_MAX_M["int4"] + 1):
        case = make_case("int4_g128", 32, 256, (m,), torch.float16, bias=True, seed=9)
        out = torch.ops.qcompile.wo_linear(*op_args(case, "triton")).double()
        ref = reference(case)
        errs[f"op-triton-m{m}"] = [0.0, ((out - ref).norm() / ref.norm()).item()]
    # K not a multiple of BLOCK_K (gpt-oss: 2880 = 22.5 x 128): the partial last step masked (prefetched
    # scales too), held by the last K split; x permutation dropped, tiled words stepped by whole chunks
    for name in TAIL_NAMES:
        spec = SPECS[name]
        for k in (288, 320):
            case = make_case(name, 40, k, (5,), torch.bfloat16, bias=True, seed=k)
            ref = reference(case)
            rms = ref.pow(2).mean().sqrt()
            for cname, cfg in cfgs(wg.layout_of(spec).epw).items():
                out = wg.wo_gemm(case["x"], case["weight"], case["weight_scale"], case["weight_global_scale"],
                                 case["weight_zero_point"], case["weight_g_idx"], case["bias"], spec, cfg).double()
                worst = ((out - ref).abs() / (2.0**-6 * ref.abs() + 2.0**-6 * rms)).max().item()
                errs[f"tail-{name}-k{k}-{cname}"] = [worst, ((out - ref).norm() / ref.norm()).item()]
            out = torch.ops.qcompile.wo_linear(*op_args(case, "triton")).double()
            errs[f"tail-{name}-k{k}-op-triton"] = [0.0, ((out - ref).norm() / ref.norm()).item()]
    for name in ("int8_channel_packed", "mxfp8"):  # tiled 8-bit words: K = 320 is 5 chunks of 64, not of 128
        spec = SPECS[name]
        case = make_case(name, 48, 320, (5,), torch.bfloat16, seed=4)
        ref = reference(case)
        out = wg.wo_gemm(case["x"], qm.tile_weight(case["weight"], spec), case["weight_scale"],
                         case["weight_global_scale"], case["weight_zero_point"], case["weight_g_idx"], case["bias"],
                         replace(spec, tiled=True), cfgs(4)["dot-bk2-split2"]).double()
        rms = ref.pow(2).mean().sqrt()
        worst = ((out - ref).abs() / (2.0**-6 * ref.abs() + 2.0**-6 * rms)).max().item()
        errs[f"tail-{name}-tiled-k320"] = [worst, ((out - ref).norm() / ref.norm()).item()]
    print(json.dumps({"exact": res, "errors": errs}))
""")



def _compile_sm90(fn, ptrs: dict, ints: tuple, constexprs: dict, divisible: tuple = (), **options):
    """Compile a Triton kernel for sm_90 without a GPU (ptxas included): the paths the interpreter
    cannot take (inline PTX decode, tuple indexing by constexpr, Hopper lowering) are checked in CI.
    ``divisible``: the arguments to compile as multiples of 16, as Triton's launcher specializes them."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: ptrs[n] if ptrs.get(n) else ("i32" if n in ints else "constexpr") for n in names}
    cx = dict(constexprs, **{n: None for n, t in ptrs.items() if t is None})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in cx.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return bool(get_ptxas(90).path)
    except Exception:  # noqa: BLE001 - no NVIDIA backend or no ptxas: the test cannot run here
        return False


def _compile_wo_kernels(name: str, m: int, x: str, tiled: bool = False, k: int = 8192):
    """The GEMM kernel with the launch configuration the op picks for [m, k] x [8192, k] (PTX decode on)
    and the dequant kernel, compiled for sm_90; K % BLOCK_K != 0 compiles their masked partial step."""
    from qcompile.kernels import wo_gemm_triton as wt
    spec = replace(SPECS[name], tiled=tiled)
    lay = wg.layout_of(spec)
    cfg = wg.fit_config(wg.pick_config(m, 8192, k, lay, 132), k, spec)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    split = cfg.pop("SPLIT_K")
    sk = "*fp32" if lay.scale_kind == wg.SK_FP32 else "*u8"
    zp = "*i32" if spec.zero_point else None
    gs = "*fp32" if spec.global_scale else None
    g = "*i32" if spec.act_order else None
    ptrs = dict(x_ptr="*" + x, w_ptr="*i32", s_ptr=sk, z_ptr=zp, g_ptr=g, gs_ptr=gs, bias_ptr=None,
                out_ptr="*fp32" if split > 1 else "*" + x)
    common = dict(FMT=lay.fmt, EPW=lay.epw, SCALE_KIND=lay.scale_kind, GROUP=lay.group, HAS_GS=gs is not None,
                  HAS_ZP=zp is not None, ACT_ORDER=g is not None, TILED=tiled,
                  NATURAL=tiled and quant_math.tiles_natural(spec))
    _compile_sm90(wt._wo_gemm_kernel, ptrs, ("M", "N", "K", "stride_wn", "stride_sn", "k_split_words"),
                  dict(common, HAS_BIAS=False, PARTIAL=split > 1, PTX_DECODE=True, EVEN_K=k % cfg["BLOCK_K"] == 0,
                       **cfg), num_warps=warps, num_stages=stages)
    _compile_sm90(wt._dequant_kernel, dict(w_ptr="*i32", s_ptr=sk, z_ptr=zp, g_ptr=g, gs_ptr=gs, out_ptr="*bf16"),
                  ("N", "K", "stride_wn", "stride_sn"),
                  dict(common, BLOCK_N=32, BLOCK_K=32 * lay.epw, EVEN_K=k % (32 * lay.epw) == 0))
    return cfg


@pytest.mark.skipif(not wg.HAS_TRITON or not _ptxas_available(), reason="triton's NVIDIA backend / ptxas missing")
@pytest.mark.parametrize("tiled", [False, True], ids=["canonical", "tiled"])
@pytest.mark.parametrize("name,m,x", [("int4_g128", 1, "bf16"), ("int4_g128", 16, "fp16"), ("int4_g128_zp", 16, "bf16"),
                                      ("nvfp4", 1, "bf16"), ("mxfp4", 64, "bf16"), ("int8_channel_packed", 16, "bf16")])
def test_triton_kernels_compile_for_sm90(name, m, x, tiled):
    """The GEMM kernel with the launch configuration the op picks (PTX decode on) and the dequant
    kernel compile for sm_90, canonical and tiled words (int4 g128 and int8 channel: in natural-x order)."""
    _compile_wo_kernels(name, m, x, tiled)


@pytest.mark.skipif(not wg.HAS_TRITON or not _ptxas_available(), reason="triton's NVIDIA backend / ptxas missing")
@pytest.mark.parametrize("name,m", [("int4_channel", 1), ("int4_g32_actorder", 16), ("nvfp4", 1), ("mxfp4", 16),
                                    ("mxfp8", 16)])
def test_triton_kernels_compile_for_sm90_k_tail(name, m):
    """K = 2880 (gpt-oss-20b's experts: 22.5 x 128): both kernels compile with their partial last K step
    masked (EVEN_K False), through the PTX decodes (int4 lop3 scaled after the dot, e2m1)."""
    cfg = _compile_wo_kernels(name, m, "bf16", k=2880)
    assert 2880 % cfg["BLOCK_K"] and not cfg["X_PERMUTED"]


@pytest.mark.skipif(not wg.HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    """(1) The dequant kernel equals quant_math.dequantize_weight bit for bit (fp32 out) for every
    format, on random words (all codes) and random scale bytes. (2) The GEMM kernel (dot with scales
    after / before the dot, split-K 1-3 with the reduce kernel, x permuted or split in registers,
    scales prefetched or not; N=40 masks a tile; K = 288 / 320, not a multiple of BLOCK_K, ends in a
    partial step, dequantized too) against the fp64 reference: per output |out - ref| <= 2^-6 (|ref| + rms(ref)), normwise < 1e-2.
    The interpreter truncates fp32 -> bf16 (weights scaled before the dot, and the output), so this is
    ~4x the GPU's rounding error; a wrong code, scale or split errs by O(1)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [k for k, ok in res["exact"].items() if not ok], res["exact"]
    assert {f"dequant-exact-{name}-k288" for name in TAIL_NAMES} <= set(res["exact"])
    bad = {k: v for k, v in res["errors"].items() if not (v[0] <= 1.0 and v[1] < 1e-2)}
    assert not bad, bad


# -- kernel selection -------------------------------------------------------------------------------

def _q(name, capability, n=4096, k=4096, act_dtype=torch.bfloat16, spec=None):
    scheme = QuantScheme(spec or SPECS[name])
    return KernelQuery(scheme, "cpu" if capability is None else "cuda", capability, n, k, act_dtype)


def test_selection_by_capability(monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "triton", True)
    names = [k.name for k in registry.kernels()]
    assert names.index("wo_triton") < names.index("wo_dequant") < names.index("reference")
    for name in SPECS:
        want = "wo_triton" if SPECS[name].act_order else "wo_mma"  # wo_mma: test_wo_mma.py
        assert registry.select(_q(name, (9, 0))).kernel.name == want, name
        assert registry.select(_q(name, (8, 0))).kernel.name == want, name
        sel = registry.select(_q(name, (7, 5)))
        assert sel.kernel.name == "wo_dequant" and dict(sel.rejected)["wo_triton"] == \
            "needs compute capability >= 8.0, have 7.5"
        sel = registry.select(_q(name, None))
        assert sel.kernel.name == "wo_dequant" and dict(sel.rejected)["wo_triton"] == "needs a CUDA device, have cpu"
    monkeypatch.setitem(registry._AVAILABLE, "triton", False)
    sel = registry.select(_q("int4_g32_actorder", (9, 0)))
    assert sel.kernel.name == "wo_dequant" and dict(sel.rejected)["wo_triton"] == "triton is not installed"


def test_selection_reasons(monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "triton", True)
    check = wg.check_triton
    assert check(_q("int4_g128", (9, 0), k=4000)) == "K=4000 not a multiple of the group size 128"
    assert check(_q("int8_g128", (9, 0), k=4032)) == "K=4032 not a multiple of the group size 128"
    assert check(_q("int4_channel", (9, 0), k=4004)) == \
        "K=4004 not a multiple of 8 (the 4-bit elements of a 32-bit word)"
    assert check(_q("int8_channel_packed", (9, 0), k=4002)) == \
        "K=4002 not a multiple of 4 (the 8-bit elements of a 32-bit word)"
    for name in ("mxfp4", "nvfp4", "mxfp8", "int4_g32"):  # gpt-oss-20b's experts: 2880 = 22.5 x 128
        assert check(_q(name, (9, 0), n=2880, k=2880)) is None, name
    assert check(_q("int4_g128", (9, 0), act_dtype=torch.float32)) == "needs bf16/fp16 activations, have torch.float32"
    assert check(_q("int4_g128", (9, 0), n=100)) is None  # N is masked: no limit
    assert check(_q("nvfp4", (9, 0))) is None
    block = WeightSpec(QDtype.INT4, ScaleSpec(Granularity.BLOCK, block=(128, 128)), Packing.INT32)
    assert check(_q("", (9, 0), spec=block)) == "weight scales per block (tensor, channel or group expected)"
    nvfp4_fp32 = WeightSpec(QDtype.FP4_E2M1, ScaleSpec(Granularity.GROUP, group_size=16), Packing.UINT8)
    assert wg.check_dequant(_q("", None, spec=nvfp4_fp32)).startswith("e2m1 weights need fp8 scales per 16")
    g48 = WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=48), Packing.INT32)
    assert check(_q("", (9, 0), spec=g48)) == "group size 48 is not a power of two >= 16"
    zp_fp4 = WeightSpec(QDtype.FP4_E2M1, MXFP4_WEIGHT.scale, Packing.UINT8, zero_point=True)
    assert check(_q("", (9, 0), spec=zp_fp4)) == "zero points / act-order only with int4 / int8 weights"
    # fp32-scaled FP8 stays with qcompile::fp8_linear / the reference
    assert registry.select(KernelQuery(fp8_scheme("channel", None), "cuda", (9, 0), 4096, 4096)).kernel.name \
        == "reference"
    # W4A4 on sm_90 runs weight-only (the pass warns)
    w4a4 = KernelQuery(QuantScheme(NVFP4_WEIGHT, NVFP4_ACT), "cuda", (9, 0), 4096, 4096)
    assert registry.select(w4a4).kernel.name == "wo_mma"


# -- GPU ------------------------------------------------------------------------------------------

GPU_MS = (1, 4, 16, 64, 256)
GPU_NK = ((4096, 4096), (8192, 8192))
GPU_NAMES = ["int4_g128", "int4_g32", "int4_channel", "int4_g128_zp", "int4_g32_actorder", "nvfp4", "mxfp4",
             "int8_channel_packed", "int8_g128", "mxfp8"]
GPU_TAIL_NAMES = ["int4_g32", "int4_g32_actorder", "int4_channel", "nvfp4", "mxfp4", "int8_channel_packed", "mxfp8"]


def _gpu_case(name, m, n, k, dtype, seed):
    """make_case on the GPU: quantize on the GPU's copy (fast at 8192^2), fresh data per call."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * (0.5 + torch.rand(n, 1, device="cuda", generator=g)) / k**0.5
    q = rtn_quantize(SPECS[name], w, seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if seed % 2 else None
    return dict(x=x, **q, bias=b, scheme=QuantScheme(SPECS[name]).key)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", GPU_NK, ids=str)
@pytest.mark.parametrize("name", GPU_NAMES)
def test_gpu_triton_matches_reference(name, n, k):
    """The op's triton backend (kernel for M <= WO_MAX_M, dequant + F.linear above) vs the fp32
    reference x @ dequantize(W).T on the GPU. Per output: |out - ref| <= 2^-7 |ref| + 2^-6 rms(ref)
    (bf16 output rounding, and weights scaled before the dot rounded to bf16: exact for NVFP4 / MXFP4
    / MXFP8 and for int4 scaled after the dot, 2^-9 relative otherwise); normwise < 4e-3."""
    _check_triton_on_gpu(name, n, k)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", GPU_TAIL_NAMES)
def test_gpu_triton_k_tail_matches_reference(name):
    """gpt-oss-20b's expert shape as a dense layer: N = K = 2880, not a multiple of BLOCK_K (22.5 x 128),
    the kernels' partial last K step masked; the bounds of test_gpu_triton_matches_reference."""
    _check_triton_on_gpu(name, 2880, 2880)


def _check_triton_on_gpu(name, n, k):
    """test_gpu_triton_matches_reference's comparisons for one format and [N, K], M over GPU_MS."""
    for i, m in enumerate(GPU_MS):
        case = _gpu_case(name, m, n, k, torch.bfloat16, seed=i)
        spec = wg.parse_scheme_key(case["scheme"]).weight
        w = quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec, case["weight_global_scale"],
                                         case["weight_zero_point"], case["weight_g_idx"], k)
        ref = case["x"].float() @ w.t() + (0 if case["bias"] is None else case["bias"].float())
        out = torch.ops.qcompile.wo_linear(*op_args(case, "triton")).float()
        assert out.shape == (m, n) and bool(torch.isfinite(out).all())
        rms = ref.pow(2).mean().sqrt()
        worst = ((out - ref).abs() - (2.0**-7 * ref.abs() + 2.0**-6 * rms)).max().item()
        assert worst <= 0, f"{name} M={m}: exceeds tolerance by {worst:.3g}"
        assert ((out - ref).norm() / ref.norm()).item() < 4e-3
        if m == 1:  # the Triton dequant kernel is quant_math bit for bit on the GPU too
            got = wg.dequantize_triton(case["weight"], case["weight_scale"], spec, case["weight_global_scale"],
                                       case["weight_zero_point"], case["weight_g_idx"], k, torch.float32)
            assert torch.equal(got, w), f"{(got != w).sum().item()} of {w.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_and_compile():
    for name, m in (("int4_g128", 1), ("nvfp4", 16), ("mxfp4", 300)):
        case = _gpu_case(name, m, 512, 1024, torch.float16, seed=1)
        args = op_args(case, "triton")
        eager = torch.ops.qcompile.wo_linear(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.qcompile.wo_linear(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        compiled = torch.compile(lambda *a: torch.ops.qcompile.wo_linear(*a), fullgraph=True)(*args)
        assert torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_split_partials_past_int32_offsets():
    """fp32 split-K partials [split, M, N] of more than 2**31 elements (16 x 8192 x 32768: 17 GB): the kernel
    stores and the reduction reads each split at an int64 offset; wrapped int32 offsets fault or read another
    split. Bounds of test_gpu_triton_matches_reference (normwise)."""
    m, n, k = 8192, 32768, 4096
    case = _gpu_case("int4_g128", m, n, k, torch.bfloat16, seed=2)
    spec = wg.parse_scheme_key(case["scheme"]).weight
    cfg = dict(wg.pick_config(m, n, k, wg.layout_of(spec), 132), SPLIT_K=16, BLOCK_K=128)
    assert wg.splits(k, cfg)[0] * m * n > 2**31
    out = wg.wo_gemm(case["x"], case["weight"], case["weight_scale"], None, None, None, case["bias"], spec,
                     config=cfg).float()
    w = quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec, None, None, None, k)
    ref = case["x"].float() @ w.t()
    assert ((out - ref).norm() / ref.norm()).item() < 4e-3
