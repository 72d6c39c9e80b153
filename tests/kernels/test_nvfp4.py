"""``qcompile::nvfp4_linear`` (NVFP4 W4A4 on sm_100 through FlashInfer).

No sm_100 GPU and no FlashInfer here: the selection is tested with the capability and the module
mocked, and the FlashInfer call sequence against a CPU stand-in that implements FlashInfer's
documented conventions (reciprocal global scales, 128-row padded block scales, column-major B)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from qcompile import synth_4bit
from qcompile.errors import UnsupportedError
from qcompile.kernels import nvfp4, quant_math, registry
from qcompile.kernels.registry import KernelQuery
from qcompile.scheme import NVFP4_ACT, NVFP4_WEIGHT, QuantScheme
from tests.opcheck_util import opcheck

SCHEME = QuantScheme(NVFP4_WEIGHT, NVFP4_ACT)
WEIGHT_ONLY = QuantScheme(NVFP4_WEIGHT, None)


def make_args(m=5, n=256, k=384, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).bfloat16()
    t = synth_4bit.modelopt_nvfp4(w, w.abs().amax(), x.float().abs().amax())
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, t["weight"], t["weight_scale"], t["weight_scale_2"].reshape(1), t["input_scale"].reshape(1), b


def test_opcheck_and_emulated_is_the_reference():
    x, w, s, gw, gx, b = make_args()
    args = (x, w, s, gw, gx, b, SCHEME.key, "emulated")
    opcheck(torch.ops.qcompile.nvfp4_linear.default, args)
    opcheck(torch.ops.qcompile.nvfp4_linear.default, (x.reshape(1, *x.shape),) + args[1:])
    out = torch.ops.qcompile.nvfp4_linear(*args)
    ref = torch.ops.qcompile.linear_ref(x, w, s, gw, None, None, None, gx, b, SCHEME.key)
    assert torch.equal(out, ref)


def test_bad_input():
    x, w, s, gw, gx, b = make_args()
    with pytest.raises(UnsupportedError, match="is not NVFP4 W4A4"):
        torch.ops.qcompile.nvfp4_linear(x, w, s, gw, gx, b, WEIGHT_ONLY.key, "emulated")
    with pytest.raises(UnsupportedError, match=r"expected \[N, K/2\] and \[N, K/16\]"):
        torch.ops.qcompile.nvfp4_linear(x, w[:, :-8], s, gw, gx, b, SCHEME.key, "emulated")
    with pytest.raises(UnsupportedError, match="needs a CUDA tensor"):
        torch.ops.qcompile.nvfp4_linear(x, w, s, gw, gx, b, SCHEME.key, "flashinfer")
    with pytest.raises(UnsupportedError, match="unknown nvfp4_linear backend"):
        torch.ops.qcompile.nvfp4_linear(x, w, s, gw, gx, b, SCHEME.key, "cutlass")


def test_selection_by_capability(monkeypatch):
    """sm_100 with FlashInfer: the FP4 GEMM. Without FlashInfer, or on sm_90: weight-only (wo_*)."""
    q = lambda cap, n=4096, k=4096: KernelQuery(SCHEME, "cuda", cap, n, k)  # noqa: E731
    monkeypatch.setitem(registry._AVAILABLE, "flashinfer", False)
    sel = registry.select(q((10, 0)))
    assert sel.kernel.name != "nvfp4_flashinfer" and ("nvfp4_flashinfer", "flashinfer is not installed") in sel.rejected
    monkeypatch.setitem(registry._AVAILABLE, "flashinfer", True)
    assert registry.select(q((10, 0))).kernel.name == "nvfp4_flashinfer"
    assert registry.select(q((12, 0))).kernel.name == "nvfp4_flashinfer"
    sel = registry.select(q((9, 0)))
    assert sel.kernel.op == "qcompile::wo_linear"
    assert ("nvfp4_flashinfer", "needs compute capability >= 10.0, have 9.0") in sel.rejected
    assert nvfp4.check_flashinfer(q((10, 0), n=4096 + 16)) == "N=4112, K=4096 not multiples of 128"
    assert nvfp4.check_flashinfer(KernelQuery(WEIGHT_ONLY, "cuda", (10, 0), 4096, 4096)).endswith("is not NVFP4 W4A4")


def _fake_flashinfer(calls: list) -> types.ModuleType:
    """FlashInfer's documented NVFP4 conventions on the CPU: fp4_quantize(x, gs) stores
    q = e2m1(x * gs / s) with s = fp8(amax16 * gs / 6), scales padded to 128 rows; mm_fp4(a, b, sa, sb,
    alpha) = (q_a s_a) @ (q_b s_b) * alpha with b column-major [K/2, N] and sb [K/16, N_pad]."""
    fi = types.ModuleType("flashinfer")

    def pad128(t):
        rows = -(-t.shape[0] // 128) * 128
        out = t.new_zeros((rows, t.shape[1]))
        out[: t.shape[0]] = t
        return out

    def fp4_quantize(x, global_scale, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True):
        calls.append(("fp4_quantize", sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout))
        m, k = x.shape
        xg = x.float().view(m, k // 16, 16) * global_scale.float()
        s = (xg.abs().amax(-1, keepdim=True) / 6).clamp(max=448).to(torch.float8_e4m3fn)
        den = torch.where(s.float() > 0, s.float(), torch.ones_like(s.float()))
        codes = synth_4bit.e2m1_codes((xg / den).view(m, k))
        return quant_math.pack_e2m1(codes), pad128(s.view(m, k // 16).view(torch.uint8)).view(torch.float8_e4m3fn)

    def nvfp4_block_scale_interleave(sf):
        calls.append(("interleave", sf.dtype))
        assert sf.dtype == torch.uint8
        return pad128(sf)

    def mm_fp4(a, b, a_descale, b_descale, alpha, out_dtype, block_size=16):
        calls.append(("mm_fp4", block_size, out_dtype))
        m, n = a.shape[0], b.shape[1]
        da = quant_math.unpack_e2m1(a) * a_descale[:m].float().repeat_interleave(16, -1)
        db = quant_math.unpack_e2m1(b.t()) * b_descale.t()[:n].float().repeat_interleave(16, -1)
        return ((da @ db.t()) * alpha.float()).to(out_dtype)

    fi.fp4_quantize, fi.nvfp4_block_scale_interleave, fi.mm_fp4 = fp4_quantize, nvfp4_block_scale_interleave, mm_fp4
    return fi


def test_flashinfer_conventions_against_the_reference(monkeypatch):
    """The backend's global-scale conventions and layouts, through the CPU stand-in: the result is
    the faithful W4A4 reference up to the fp32 rounding of 1 / input_global_scale."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer(calls))
    for m in (1, 5, 130):
        x, w, s, gw, gx, b = make_args(m=m, bias=False)
        out = nvfp4._flashinfer(x, w, s, gw, gx, torch.bfloat16).float()
        ref = torch.ops.qcompile.nvfp4_linear(x, w, s, gw, gx, None, SCHEME.key, "emulated").float()
        assert ((out - ref).norm() / ref.norm()).item() < 5e-3, m  # seen: 0, 6e-5, 2.4e-3
    assert ("fp4_quantize", 16, False, True) in calls and ("interleave", torch.uint8) in calls
    assert ("mm_fp4", 16, torch.bfloat16) in calls
