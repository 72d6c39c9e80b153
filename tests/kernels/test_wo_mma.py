"""The CUDA C++ weight-only kernel (qcompile/kernels/wo_mma.cu, backend "mma" of qcompile::wo_linear).

CPU: what it accepts, how it splits the work, that the source compiles for sm_90 when an NVRTC
library is at hand (QCOMPILE_NVRTC), and selection with the capability mocked. GPU (-m gpu): every
format against the fp32 reference on fresh data, M = 1..128, shapes with idle warps and uneven
splits, forced split counts (cluster and global-memory reductions), determinism and CUDA-graph
capture.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace

import pytest
import torch

from qcompile.kernels import quant_math, registry
from qcompile.kernels import wo_gemm as wg
from qcompile.kernels import cuda_driver, wo_mma, wo_policy
from qcompile.kernels.registry import KernelQuery
from qcompile.scheme import Granularity, Packing, QDtype, QuantScheme, ScaleDtype, ScaleSpec, WeightSpec

from tests.gpu_util import graph_replay

from .test_wo_gemm import SPECS, _gpu_case, op_args, sorted_case

HAS_CUDA = torch.cuda.is_available()
MMA_NAMES = [n for n, s in SPECS.items() if not s.act_order]


def _spec(name):
    return SPECS[name]


def test_reasons():
    assert wo_mma.mma_reason(_spec("int4_g128"), 4096, 4096) is None
    assert wo_mma.mma_reason(_spec("int4_g32_actorder"), 4096, 4096) == "act-order (g_idx) weights"
    assert wo_mma.mma_reason(_spec("nvfp4"), 4096, 4096, torch.float16) is None  # fp16 x: the mma.sync build
    assert wo_mma.mma_reason(_spec("mxfp4"), 4096, 4096, torch.float16) == \
        "x is torch.float16 and the scales are e8m0 (MX), beyond fp16's range: the kernel takes bf16 x for them"
    assert wo_mma.mma_reason(_spec("int4_g128"), 4096, 4096, torch.float32) == \
        "x is torch.float32, the kernel takes bf16 or fp16"
    assert wo_mma.mma_reason(_spec("int4_g128"), 4100, 4096) == \
        "[N, K] = [4100, 4096]: N must be a multiple of 16 and K of 128"
    assert wo_mma.mma_reason(_spec("int8_channel_packed"), 4096, 4128) == \
        "[N, K] = [4096, 4128]: N must be a multiple of 16 and K of 64"
    g48 = WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=48), Packing.INT32)
    assert wo_mma.mma_reason(g48, 4096, 4096).startswith("group size 48")
    assert wo_mma.mma_reason(_spec("int4_g128_zp"), 4096, 4096, zp_dtype=torch.int64) == \
        "zero points of dtype torch.int64"
    for gran in (Granularity.TENSOR, Granularity.CHANNEL):  # fp32-scaled fp8 (qcompile::fp8_linear's), any granularity
        fp8 = WeightSpec(QDtype.FP8_E4M3, ScaleSpec(gran))
        assert wo_mma.mma_reason(fp8, 4096, 4096).startswith("fp8 weights with fp32 scales belong to qcompile::")
    assert wo_mma.mma_reason(_spec("mxfp8"), 4096, 4096) is None


def test_scale_modes():
    assert wo_policy.scale_mode(_spec("int4_channel")) == (wo_policy.SMODE_END, 0)
    assert wo_policy.scale_mode(_spec("int4_g128")) == (wo_policy.SMODE_CHUNK, 128)
    assert wo_policy.scale_mode(_spec("int4_g64")) == (wo_policy.SMODE_PRE, 64)
    assert wo_policy.scale_mode(_spec("nvfp4")) == (wo_policy.SMODE_PRE, 16)
    assert wo_policy.scale_mode(_spec("int8_g128")) == (wo_policy.SMODE_CHUNK, 128)
    assert wo_policy.scale_mode(_spec("mxfp8")) == (wo_policy.SMODE_PRE, 32)
    assert wo_policy.scale_mode(_spec("int4_g128"), wgmma=True) == (wo_policy.SMODE_PRE, 128)


@pytest.mark.parametrize("m,n,k,bits", [(1, 8192, 8192, 4), (16, 8192, 8192, 4), (32, 28672, 8192, 4),
                                         (1, 4112, 4224, 4), (8, 2048, 8192, 8)])
def test_plan_covers_k_and_fits_shared_memory(m, n, k, bits):
    cols, split, cps = wo_policy.plan(m, n, k, bits, warps=4, stages=4, sms=132)
    nch = k // wo_policy.KPC[bits]
    assert cols * 4 * 16 >= n > (cols - 1) * 4 * 16
    assert (split - 1) * cps < nch <= split * cps  # every chunk once, no empty split
    assert wo_policy.x_bytes(m, cps, bits) <= wo_mma.SMEM_BUDGET


def test_two_tile_candidates():
    """rt_candidates: one 16-warp CTA per SM with two tiles per warp; every (warps per tile, split) whose
    CTAs fit one wave, whose x slice fits RT_SMEM and whose warps stream >= 2 chunks; most CTAs first,
    then fewer splits."""
    c = wo_policy.rt_candidates(16, 8192, 8192, 4, 132)
    assert c[:3] == [(128, 4, 2), (128, 2, 4), (128, 1, 8)]  # kw 8 without a split: x 278 KB
    assert wo_policy.x_bytes(16, 64, 4) > wo_policy.RT_SMEM >= wo_policy.x_bytes(16, 32, 4)
    assert wo_policy.rt_candidates(9, 8192, 8192, 4, 132)[0] == (128, 8, 1)
    assert wo_policy.rt_candidates(16, 28672, 8192, 4, 132) == [(112, 1, 2)]
    assert wo_policy.rt_candidates(16, 57344, 8192, 4, 132) == []
    for m, n, k, bits in ((16, 8192, 8192, 4), (12, 4096, 14336, 8), (9, 11008, 4096, 4)):
        nch = k // wo_policy.KPC[bits]
        for ctas, kw, split in wo_policy.rt_candidates(m, n, k, bits, 132):
            cps = -(-nch // split)
            assert ctas == -(-(n // 16) // (16 // kw * 2)) * split <= 132 and -(-nch // cps) == split
            assert wo_policy.x_bytes(m, cps, bits) <= wo_policy.RT_SMEM and cps >= 2 * kw


def test_tile_sharing_plan():
    """KW warps per 16-row tile: the CTA's columns and split count tiles, not warps; tile_sharing takes
    the most warps per tile the SMs' warp slots give every tile, while the split stays <= 2, the CTAs
    fit in one wave and the x slices stay within 90 % of the weight bytes per SM; where the rounded
    split spills into a second wave, no split while each warp streams at most 1.3x the chunks it would
    without shared tiles (sm_90 only)."""
    # 8192^2 int4: 512 tiles, 2 per 16-warp CTA -> 256 CTAs, no split (one warp per tile: 64 columns x split 8)
    assert wo_policy.plan(1, 8192, 8192, 4, warps=16, stages=2, sms=132, warps_per_sm=32, kw=8) == (256, 1, 64)
    assert wo_policy.plan(1, 8192, 8192, 4, warps=8, stages=2, sms=132, warps_per_sm=32) == (64, 8, 8)
    launch = {(m, n, k): wo_policy.tile_sharing(m, n, k, 4, (9, 0), 132)
              for m in (1, 4, 5, 8) for n, k in ((8192, 8192), (4096, 14336), (14336, 4096), (28672, 8192))}
    assert launch == {
        (1, 8192, 8192): (16, 8, None), (4, 8192, 8192): (16, 8, None),  # x 70 KB x 2 CTAs at M = 4
        (5, 8192, 8192): (16, 8, None),  # 87 KB x 2: 69 % of the 254 KB of weights per SM
        (8, 8192, 8192): (16, 4, None),  # kw 8: x over SMEM_BUDGET, split 2, 512 CTAs in two waves
        (1, 4096, 14336): (16, 16, None), (4, 4096, 14336): (16, 8, None), (5, 4096, 14336): (16, 8, None),
        (8, 4096, 14336): (8, 1, None),
        (1, 14336, 4096): (16, 4, None), (4, 14336, 4096): (16, 4, None), (5, 14336, 4096): (16, 4, None),
        (8, 14336, 4096): (16, 4, None),
        (1, 28672, 8192): (8, 2, None), (4, 28672, 8192): (8, 1, None), (5, 28672, 8192): (8, 1, None),
        (8, 28672, 8192): (8, 1, None)}
    # 5120^2: split 2 would need 320 CTAs of 16 warps (264 fit): no split, 5 chunks per warp against 4;
    # 11008x4096: 8 against 6 (over 1.3x), no shared tiles
    assert wo_policy.tile_sharing(1, 5120, 5120, 4, (9, 0), 132) == (16, 8, 1)
    assert wo_policy.tile_sharing(1, 11008, 4096, 4, (9, 0), 132) == (8, 1, None)
    assert {wo_policy.tile_sharing(1, 8192, 8192, 4, cap, 132) for cap in ((8, 0), (10, 0), (12, 0))} == {(8, 1, None)}
    for m, n, k, bits, warps, kw, rt in ((1, 8192, 8192, 4, 16, 8, 1), (3, 4112, 4224, 4, 8, 4, 1),
                                         (2, 4096, 14336, 8, 16, 16, 1), (16, 4112, 4224, 4, 16, 2, 2),
                                         (16, 8192, 8192, 4, 16, 1, 2)):
        cols, split, cps = wo_policy.plan(m, n, k, bits, warps, 2, 132, warps_per_sm=32, kw=kw, rt=rt)
        rows = warps // kw * rt * 16  # per CTA
        assert cols * rows >= n > (cols - 1) * rows
        assert (split - 1) * cps < k // wo_policy.KPC[bits] <= split * cps
    # the partial sums of the other warps of each tile reuse x's shared memory
    cfg = wo_policy.MmaConfig(0, 0, 1, 128, False, "int", False, False, 2, warps=16, packed=True, kw=8)
    assert wo_policy.smem_bytes(1, 1, cfg) == (16 - 2) * 2 * 512
    assert wo_policy.smem_bytes(16, 64, replace(cfg, cluster=2)) == wo_policy.x_bytes(16, 64, 4)
    # two tiles per warp: twice the partials, and a cluster's [M][tile rows] over 32 tiles
    assert wo_policy.smem_bytes(1, 1, replace(cfg, rt=2)) == (16 - 2) * 2 * 2 * 512
    assert wo_policy.smem_bytes(16, 4, replace(cfg, kw=1, rt=2, cluster=8)) == 16 * 32 * 16 * 4 > wo_policy.x_bytes(16, 4, 4)
    # x streamed: a ring of xstages chunks (rows padded to 288 bytes) per K part, whatever the K range, then
    # a full and an empty mbarrier per slot; on natural-order tiles (g128 here) whole 8-token groups of 256-byte
    # rows as TMA writes them, from a 1024-byte aligned base
    ring = 8 * 4 * 16 * 288
    assert wo_policy.x_bytes(16, 64, 4, xstages=4, xs_parts=8) == wo_policy.x_bytes(16, 1, 4) * 8 * 4 == ring
    g32 = replace(cfg, smode=2, group=32)
    assert cfg.xnat and not g32.xnat
    assert wo_policy.smem_bytes(16, 64, replace(g32, cluster=2, xs=True)) == ring + 16 * 8 * 4
    assert wo_policy.smem_bytes(16, 2, replace(g32, cluster=2, xs=True)) == ring + 16 * 8 * 4
    nat = 8 * 4 * 16 * 256 + 1024
    assert wo_policy.x_bytes(16, 64, 4, xstages=4, xs_parts=8, xnat=True) == nat
    assert wo_policy.x_bytes(9, 64, 4, xstages=4, xs_parts=8, xnat=True) == nat  # (rows 9..15 zeros from TMA)
    assert wo_policy.smem_bytes(16, 64, replace(cfg, cluster=2, xs=True)) == nat + 16 * 8 * 4
    assert wo_policy.smem_bytes(1, 3, replace(g32, kw=2, rt=2, xs=True, xstages=3)) == (16 - 8) * 2 * 2 * 512 + 16 * 2 * 3


def test_x_streamed_candidates_and_policy():
    """rt_candidates with x streamed: no split, the ring (not the K range) within RT_SMEM, most CTAs first; xs_default: tiled
    weights on sm_90 at M = 5..16 where the first candidate fills 80% of the SMs; at two token tiles int4 only
    where each warp streams >= 8 chunks, e2m1 not; int4 on natural-order tiles (x by TMA) at two token tiles
    wherever there is a candidate (the H100 measurements behind wo_policy.xs_default)."""
    assert wo_policy.rt_candidates(16, 8192, 8192, 4, 132, xs=True)[:2] == [(128, 8, 1), (64, 4, 1)]  # staged: 278 KB
    assert wo_policy.rt_candidates(16, 4096, 14336, 4, 132, xs=True)[0] == (64, 8, 1)  # kw 16: a 221 KB ring
    assert wo_policy.rt_candidates(16, 4096, 14336, 4, 132, xs=True, xnat=True)[0] == (128, 16, 1)  # TMA: 193 KB
    assert wo_policy.rt_candidates(16, 4096, 14336, 8, 132, xs=True)[0] == (128, 16, 1)
    for m, n, k, bits in ((16, 8192, 8192, 4), (6, 28672, 8192, 8), (12, 4096, 4096, 4)):
        for ctas, kw, split in wo_policy.rt_candidates(m, n, k, bits, 132, xs=True):
            assert split == 1 and ctas == -(-(n // 16) // (16 // kw * 2)) <= 132
            assert wo_policy.x_bytes(m, 1, bits, xstages=wo_policy.XS_SLOTS, xs_parts=kw) <= wo_policy.RT_SMEM

    def xs(name, m, n, k, cap=(9, 0), tiled=True):
        return wo_policy.xs_default(replace(SPECS[name], tiled=tiled), m, n, k, cap, 132)

    assert all(xs(name, m, 8192, 8192) for name in ("int4_g128", "int8_channel_packed", "mxfp8") for m in (5, 8, 16))
    assert xs("nvfp4", 8, 8192, 8192) and not xs("nvfp4", 9, 8192, 8192)  # 4-bit e2m1 at two token tiles
    assert xs("int4_g128", 8, 14336, 4096) and xs("int4_g128", 12, 14336, 4096)  # 112 CTAs, 8 chunks per warp
    assert xs("int4_g128", 16, 28672, 8192) and xs("int4_g128", 16, 4096, 14336)  # 112 CTAs; 128 (the TMA ring)
    assert xs("int4_g128", 12, 4096, 4096) and xs("int8_channel_packed", 12, 4096, 4096)  # 2 chunks per warp
    assert not xs("int4_g32", 12, 4096, 4096) and not xs("int4_g64", 16, 4096, 14336)  # (lane-order tiles: cp.async)
    assert not xs("int8_channel_packed", 8, 11008, 4096)  # 86 CTAs
    assert not any((xs("int4_g128", 4, 8192, 8192), xs("int4_g128", 17, 8192, 8192),
                    xs("int4_g128", 8, 8192, 8192, (10, 0)), xs("int4_g128", 8, 8192, 8192, tiled=False)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,w", [(16, 16), (48, 64), (4096, 512)])
def test_tile_words_round_trip(n, w, bits, monkeypatch):
    monkeypatch.setattr(quant_math, "_PAIR_ROWS", 32)  # several steps of the nibble permutation
    words = torch.randint(-2**31, 2**31 - 1, (n, w), dtype=torch.int32)
    kept = words.clone()
    packed = quant_math.tile_words(words, bits)
    assert torch.equal(words, kept)  # (16 x 16: the word permutation is a view; the input stays)
    assert packed.shape == words.shape and torch.equal(quant_math.untile_words(packed, bits), words)
    assert torch.equal(words, kept)
    as_bytes = words.view(torch.uint8)  # the e2m1 / int8 layouts tile as their 4-byte words
    assert torch.equal(quant_math.tile_words(as_bytes, bits).view(torch.int32), packed)
    # warp (tile t, chunk c), half h, lane l = 4r + q, word j <- row 16t + 8h + r, word 16c + 4q + j
    t, c, h, r, q, j = n // 16 - 1, w // 16 - 1, 1, 5, 3, 2
    got = packed.view(-1)[((t * (w // 16) + c) * 2 + h) * 128 + (4 * r + q) * 4 + j].item()
    src = words[16 * t + 8 * h + r, 16 * c + 4 * q + j].item()
    if bits == 8:
        assert got == src
    else:  # 4-bit element e at nibble e // 2 + 4 (e % 2): nibbles (p, p + 4) are elements (2p, 2p + 1)
        assert [(got >> 4 * (e // 2 + 4 * (e % 2))) & 15 for e in range(8)] == [(src >> 4 * e) & 15 for e in range(8)]
    # natural-x order: lane q's element p of a chunk (word p // epw) is the row's k = kpc c + 8 (p // 2) + 2q + p % 2
    nat = quant_math.tile_words(words, bits, natural=True)
    assert nat.shape == words.shape and torch.equal(quant_math.untile_words(nat, bits, natural=True), words)
    assert torch.equal(words, kept)
    epw, kpc = 32 // bits, quant_math.TILE_K[bits]
    codes = quant_math.unpack_int32(words, bits, w * epw) + 2 ** (bits - 1)  # [n, k] raw codes
    lane = nat.view(-1)[((t * (w // 16) + c) * 2 + h) * 128 + (4 * r + q) * 4:][:4]
    order = [e // 2 + 4 * (e % 2) for e in range(8)] if bits == 4 else list(range(4))  # element -> code slot
    got = [int((int(lane[p // epw]) >> bits * order[p % epw]) & (2**bits - 1)) for p in range(4 * epw)]
    want = [int(codes[16 * t + 8 * h + r, kpc * c + 8 * (p // 2) + 2 * q + p % 2]) for p in range(4 * epw)]
    assert got == want


def _q(name, capability, act_dtype=torch.bfloat16):
    return KernelQuery(QuantScheme(SPECS[name]), "cuda" if capability else "cpu", capability, 4096, 4096, act_dtype)


def test_selection(monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "triton", True)
    for name in SPECS:
        want = "wo_triton" if SPECS[name].act_order else "wo_mma"
        assert registry.select(_q(name, (9, 0))).kernel.name == want, name
        assert registry.select(_q(name, (8, 0))).kernel.name == want, name
    assert registry.select(_q("nvfp4", (9, 0), torch.float16)).kernel.name == "wo_mma"
    sel = registry.select(_q("mxfp8", (9, 0), torch.float16))
    assert sel.kernel.name == "wo_triton"
    assert dict(sel.rejected)["wo_mma"].startswith("x is torch.float16 and the scales are e8m0 (MX)")
    sel = registry.select(_q("int4_g128", (7, 5)))
    assert dict(sel.rejected)["wo_mma"] == "needs compute capability >= 8.0, have 7.5"


def test_wgmma_selection_and_shared_memory():
    # the wgmma build: M >= 25 on sm_90 only (Blackwell has no wgmma; sm_80 neither), up to M = 128
    # (int4: 96, above it the Triton kernel won); elsewhere the mma.sync build up to M = 32
    assert [m for m in range(1, 40) if wo_policy.wgmma_default(m, (9, 0))] == list(range(25, 40))
    assert not any(wo_policy.wgmma_default(m, cap) for m in (25, 32, 64) for cap in ((8, 0), (10, 0), (12, 0)))
    assert {name: wo_mma.max_m(SPECS[name], (9, 0)) for name in ("int4_g128", "int8_channel_packed", "nvfp4")} \
        == {"int4_g128": 96, "int8_channel_packed": 128, "nvfp4": 128}
    # tiled weights: the warp-specialized build from M = 12 (4-bit) / 57 (int8) / 49 (fp8), int4 up to 128,
    # but not at M = 9..16 where two tiles per warp have a launch (rt_default)
    tiled = {name: replace(SPECS[name], tiled=True) for name in MMA_NAMES}
    assert wo_mma.max_m(tiled["int4_g128"], (9, 0)) == 128
    def ws(name, m, cap=(9, 0), n=8192, k=8192):
        return wo_policy.ws_default(tiled[name], m, n, k, cap, 132)

    assert [m for m in range(1, 130) if ws("nvfp4", m)] == list(range(17, 129))
    assert [m for m in range(1, 130) if ws("mxfp8", m)] == list(range(49, 129))
    assert [m for m in range(1, 130) if ws("int8_channel_packed", m)] == list(range(57, 129))
    assert {name for name in MMA_NAMES if ws(name, 32)} == {name for name in MMA_NAMES if SPECS[name].dtype.bits == 4}
    assert not any(wo_policy.ws_default(SPECS[name], 64, 8192, 8192, (9, 0), 132) for name in MMA_NAMES)  # not tiled
    assert not any(ws("int4_g128", 64, cap) for cap in ((8, 0), (10, 0), (12, 0)))
    # below M = 12, wide weights (one 16-warp column per SM) whose mma.sync x slice (M rows of the CTA's K
    # range) would leave fewer than 4 of its CTAs on an SM (N = 28672, K = 8192 from M = 7: 70 KB at M = 8,
    # 52 KB at M = 6) would take it (_ws_wide), but two tiles per warp run them when they have a launch,
    # and every wide weight from M = 6
    assert [m for m in range(1, 12) if wo_policy._ws_wide(tiled["int4_g128"], m, 28672, 8192, 132)] == [7, 8, 9, 10, 11]
    assert wo_policy.x_bytes(6, 32, 4) < wo_policy.SM90_SMEM_PER_SM // 4 < wo_policy.x_bytes(7, 32, 4)
    assert [m for m in range(1, 9) if wo_policy._ws_wide(tiled["nvfp4"], m, 57344, 8192, 132)] == [4, 5, 7, 8]
    assert not any(ws(name, m, n=n) for name in MMA_NAMES for m in range(1, 12) for n in (28672, 57344))
    assert [m for m in range(1, 17) if wo_policy.rt_default(tiled["nvfp4"], m, 57344, 8192, (9, 0), 132)] == \
        [4, 5, 6, 7, 8, 9, 10, 11]  # from M = 12 the x slice of an unsplit K is over RT_SMEM
    assert [m for m in range(1, 17) if wo_policy.rt_default(tiled["mxfp8"], m, 28672, 4096, (9, 0), 132)] == \
        list(range(6, 17))
    assert not any(ws(name, m, n=n, k=k) for name in ("int4_g128", "nvfp4") for m in range(1, 12)
                   for n, k in ((8192, 8192), (28672, 4096), (4096, 14336), (14336, 4096), (8192, 28672)))
    # 8-bit weights the same way below the lock-step build's M = 25 (N = 28672 from M = 8, 65 KB; N = 57344
    # at M = 4, 5 and from 8), and wide ones from M = 17 all the way (WS_WIDE_MIN_M_8BIT: the lock-step build
    # loses there). Two tiles per warp take M up to 16 as above, at N = 57344 only up to M = 12 (from 13 the
    # x slice of an unsplit K is over RT_SMEM)
    assert [m for m in range(1, 57) if ws("int8_channel_packed", m, n=28672)] == list(range(17, 57))
    assert [m for m in range(1, 49) if ws("mxfp8", m, n=57344)] == list(range(13, 49))
    assert not any(ws(name, m, n=14336, k=4096) for name in ("int8_channel_packed", "mxfp8") for m in range(17, 49))
    rt = wo_policy.rt_default
    assert [m for m in range(1, 40) if rt(tiled["int4_g128"], m, 8192, 8192, (9, 0), 132)] == list(range(9, 17))
    assert not any(rt(spec, 16, 8192, 8192, cap, 132) for spec, cap in ((SPECS["int4_g128"], (9, 0)),
                                                                        (tiled["int4_g128"], (8, 0)),
                                                                        (tiled["int4_g128"], (10, 0))))
    assert not any(ws("int8_channel_packed", m) for m in range(1, 57))
    # early launch_dependents: the mma.sync build on tiled weights; the warp-specialized one but at M > 16
    # with K > 8192; not the lock-step wgmma build, nor canonical words
    trig = wo_policy.trig_default
    assert [trig(True, False, False, m, k) for m, k in ((1, 8192), (32, 28672))] == [True, True]
    assert not trig(False, False, False, 1, 8192) and not trig(True, True, False, 32, 8192)
    assert [trig(True, True, True, m, k) for m, k in ((64, 8192), (16, 14336), (17, 14336), (128, 4096))] \
        == [True, True, False, True]
    # its launch: 2 warpgroups above M = 64; 4 when N fills most SMs without a split; else 1, 2 per SM
    assert [wo_policy.ws_launch(m, n, 132) for m, n in ((12, 8192), (64, 8192), (64, 28672), (65, 28672), (128, 4096))] \
        == [(4, 2), (4, 2), (16, 1), (8, 1), (8, 1)]
    assert wo_policy.ws_launch(64, 8192, 132, QDtype.INT4) == (4, 2)
    # 8-bit weights: 2 warpgroups on wide weights up to M = 64, MXFP8 4 elsewhere; int8 above M = 64 one
    # warpgroup, 2 CTAs per SM
    launches = {dt: [wo_policy.ws_launch(m, n, 132, dt) for m, n in ((17, 28672), (64, 28672), (64, 8192), (65, 8192),
                                                                   (128, 28672))]
                for dt in (QDtype.INT8, QDtype.FP8_E4M3)}
    assert launches == {QDtype.INT8: [(8, 1), (8, 1), (4, 2), (4, 2), (4, 2)],
                        QDtype.FP8_E4M3: [(8, 1), (8, 1), (16, 1), (8, 1), (8, 1)]}
    assert {wo_mma.max_m(SPECS[name], cap) for name in MMA_NAMES for cap in ((8, 0), (10, 0), (12, 0))} == {32}
    # launch: 16 warps, one CTA per SM; 8 for 4-bit weights above M = 64 (16 spilled there)
    assert [wo_policy.wgmma_launch(4, m) for m in (25, 64, 65, 128)] == [(16, 16), (16, 16), (8, 8), (8, 8)]
    assert {wo_policy.wgmma_launch(8, m) for m in (25, 56, 64, 96, 128)} == {(16, 16)}
    # x streams through a fixed ring: its shared memory does not grow with the K range, so the plan
    # never raises the split to fit it (the mma.sync build's whole-range x needs a split of 7 there)
    ring = wo_policy.x_bytes(32, 1, 4, wgmma=True)
    assert ring == 2 * 32 * 256 + 4 * 32 * 272 == wo_policy.x_bytes(32, 64, 4, wgmma=True)
    assert wo_policy.plan(32, 28672, 8192, 4, warps=16, stages=2, sms=132, warps_per_sm=16, wgmma=True)[1] == 1
    assert wo_policy.plan(32, 28672, 8192, 4, warps=16, stages=2, sms=132, warps_per_sm=16)[1] == 7
    assert wo_policy.plan(32, 8192, 8192, 4, warps=16, stages=2, sms=132, warps_per_sm=16, wgmma=True)[1] == 4
    # the warp-specialized build's rings: 8 weight slots of 1 KB per warp, 4 x slots of one chunk; x's slots
    # aligned to 1024 bytes where x comes by TMA (natural-order tiles, int4 g128), not for NVFP4
    cfg = wo_policy.MmaConfig(0, 0, 2, 128, False, "int", False, False, 8, warps=4, wgmma=True, ws=True, packed=True)
    assert cfg.threads == 192 and cfg.xnat and wo_policy.smem_bytes(64, 32, cfg) == 8 * 4 * 1024 + 4 * 64 * 128 * 2 + 1024
    fp4 = replace(cfg, fmt=1, sk=1, group=16)
    assert not fp4.xnat and wo_policy.smem_bytes(64, 32, fp4) == 8 * 4 * 1024 + 4 * 64 * 128 * 2
    assert wo_policy.smem_bytes(64, 32, replace(cfg, cluster=2)) == wo_policy.smem_bytes(64, 32, cfg)  # partials fit the rings


def test_row_blocks():
    # above max_m on sm_90 (128 rows; 96 for int4 weights not tiled): blocks of max_m rows, the rest last;
    # none elsewhere, nor above BLOCKED_MAX_M (int4 512, the others 384)
    tiled = replace(SPECS["int4_g128"], tiled=True)
    blocks = {m: wo_policy.row_blocks(tiled, m, (9, 0)) for m in (128, 129, 200, 256, 257, 300, 512, 513)}
    assert blocks == {128: None, 129: [128, 1], 200: [128, 72], 256: [128, 128], 257: [128, 128, 1],
                      300: [128, 128, 44], 512: [128] * 4, 513: None}
    assert wo_policy.row_blocks(SPECS["int4_g128"], 200, (9, 0)) == [96, 96, 8]
    assert wo_policy.row_blocks(replace(SPECS["nvfp4"], tiled=True), 385, (9, 0)) is None
    for name in MMA_NAMES:
        spec = replace(SPECS[name], tiled=True)
        top, limit = wo_mma.max_m(spec, (9, 0)), wo_policy.BLOCKED_MAX_M[spec.dtype]
        for m in range(top + 1, limit + 1, 7):
            b = wo_policy.row_blocks(spec, m, (9, 0))
            assert sum(b) == m and b[:-1] == [top] * (len(b) - 1) and len(b) == -(-m // top), (name, m, b)
        assert wo_policy.row_blocks(spec, limit + 1, (9, 0)) is None
        assert not any(wo_policy.row_blocks(spec, 200, cap) for cap in ((8, 0), (10, 0), (12, 0)))


NVRTC = os.environ.get("QCOMPILE_NVRTC")


@pytest.mark.skipif(not NVRTC and not HAS_CUDA, reason="needs an NVRTC library (QCOMPILE_NVRTC) or a GPU")
@pytest.mark.parametrize("name", MMA_NAMES)
@pytest.mark.parametrize("mt,cluster,pdl,wgmma,arch,ws", [
    (1, 1, True, False, "90", False), (2, 8, False, False, "90", False), (4, 4, True, False, "90", False),
    (1, 1, True, False, "80", False), (8, 1, True, True, "90", False), (16, 4, True, True, "90", False),
    (3, 2, True, True, "90", True), (16, 1, False, True, "90", True), (2, 2, True, False, "90", False)])
@pytest.mark.parametrize("trig", [False, True])
def test_source_compiles(name, mt, cluster, pdl, wgmma, arch, ws, trig):
    spec = SPECS[name]
    smode, group = wo_policy.scale_mode(spec, wgmma)
    cfg = wo_policy.MmaConfig(wo_policy.FMT[(spec.dtype, spec.packing)], wo_policy.SK[spec.scale.dtype], smode, group,
                           spec.zero_point, "int", spec.global_scale, True, mt, warps=8, cluster=cluster, pdl=pdl,
                           wgmma=wgmma, packed=ws, ws=ws, trig=trig, kw=4 if mt == 2 else 1)
    cubin = wo_mma.compile_cubin(wo_mma.source(cfg), wo_mma.arch_of(cfg, int(arch[0]), int(arch[1])))
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.skipif(not NVRTC and not HAS_CUDA, reason="needs an NVRTC library (QCOMPILE_NVRTC) or a GPU")
@pytest.mark.parametrize("name", MMA_NAMES)
def test_source_compiles_x_streamed(name):
    """x streamed in (XS, sm_90): with two tiles per warp and shared tiles reduced in a cluster, one tile per
    warp reduced through global memory, 4 token tiles; refused with the wgmma builds."""
    spec = SPECS[name]
    smode, group = wo_policy.scale_mode(spec)
    cfg = wo_policy.MmaConfig(wo_policy.FMT[(spec.dtype, spec.packing)], wo_policy.SK[spec.scale.dtype], smode, group,
                           spec.zero_point, "int", spec.global_scale, True, 2, warps=16, cluster=2, pdl=True,
                           packed=True, kw=4, rt=2, xs=True)
    for c in (cfg, replace(cfg, mt=1, kw=1, rt=1, cluster=1, warps=8, packed=False), replace(cfg, mt=4, rt=1)):
        assert wo_mma.compile_cubin(wo_mma.source(c), "90")[:4] == b"\x7fELF"
    with pytest.raises(RuntimeError, match="XS: the mma.sync build"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, kw=1, rt=1, wgmma=True, smode=wo_policy.scale_mode(spec, True)[0])),
                             "90a")


@pytest.mark.skipif(not NVRTC and not HAS_CUDA, reason="needs an NVRTC library (QCOMPILE_NVRTC) or a GPU")
@pytest.mark.parametrize("name", MMA_NAMES)
def test_source_compiles_grouped(name):
    """The MoE experts' grouped build: one or two token tiles, a split in a cluster or none, checkpoint-order
    and tiled words, float zero points, every gated activation fused, x rows narrower than a padded K (XPAD);
    refused with x streamed, the activation with an odd number of tile groups, and XPAD outside the grouped build."""
    spec = SPECS[name]
    smode, group = wo_policy.scale_mode(spec)
    cfg = wo_policy.MmaConfig(wo_policy.FMT[(spec.dtype, spec.packing)], wo_policy.SK[spec.scale.dtype], smode, group,
                              spec.zero_point, "float", spec.global_scale, True, 1, warps=8, pdl=True, grouped=True)
    two = replace(cfg, mt=2, cluster=4, packed=True)
    fused = [replace(c, gact=a) for c in (cfg, two) for a in (1, 2, 4, 5)]
    trig = [replace(cfg, trig=True), replace(two, gact=1, trig=True)]  # the next kernel launched from the start
    xpad = [replace(two, xpad=True), replace(two, gact=4, xpad=True)]
    for c in [cfg, two, replace(cfg, gact=1, kw=2, rt=2)] + fused + trig + xpad:
        assert wo_mma.compile_cubin(wo_mma.source(c), "90")[:4] == b"\x7fELF", c
    with pytest.raises(RuntimeError, match="GROUPED: the mma.sync build with x staged"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, xs=True, packed=True)), "90")
    with pytest.raises(RuntimeError, match="GACT: the grouped build with an even number of tile groups"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, gact=1, warps=4, kw=4)), "90")
    with pytest.raises(RuntimeError, match="XPAD: the grouped mma.sync build"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, grouped=False, xpad=True)), "90")


@pytest.mark.skipif(not NVRTC and not HAS_CUDA, reason="needs an NVRTC library (QCOMPILE_NVRTC) or a GPU")
@pytest.mark.parametrize("name", MMA_NAMES)
def test_source_compiles_grouped_ws(name):
    """The grouped warp-specialized build (MoE blocks of 32 to 128 pair slots, tiled experts): 4, 8 and 16 token
    tiles, a split in a cluster or none, the next kernel launched from the start; refused with the lock-step wgmma
    build, a fused activation and XPAD."""
    spec = SPECS[name]
    smode, group = wo_policy.scale_mode(spec, True)
    cfg = wo_policy.MmaConfig(wo_policy.FMT[(spec.dtype, spec.packing)], wo_policy.SK[spec.scale.dtype], smode, group,
                              spec.zero_point, "int", spec.global_scale, True, 8, stages=2, warps=8, packed=True,
                              pdl=True, wgmma=True, ws=True, grouped=True)
    for c in (cfg, replace(cfg, mt=4, cluster=4, trig=True), replace(cfg, mt=16, warps=4, cluster=2)):
        assert wo_mma.compile_cubin(wo_mma.source(c), "90a")[:4] == b"\x7fELF", c
    with pytest.raises(RuntimeError, match="GROUPED: the mma.sync build with x staged, or the warp-specialized"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, ws=False)), "90a")
    with pytest.raises(RuntimeError, match="GACT: the grouped build"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, gact=1)), "90a")
    with pytest.raises(RuntimeError, match="XPAD: the grouped mma.sync build"):
        wo_mma.compile_cubin(wo_mma.source(replace(cfg, xpad=True)), "90a")


def test_operands_as_the_kernel_reads_them():
    """x copied only where it is not 16-byte aligned, int32 words, fp32 scales as they are and 8-bit ones as
    bytes with the scale row stride of their granularity, bias in x's dtype, None where absent."""
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    w = torch.randint(0, 255, (16, 64), dtype=torch.uint8)
    for name, scale, ss in (("int4_g128", torch.rand(16, 1), 1), ("nvfp4", torch.rand(16, 8).to(torch.float8_e4m3fn), 8),
                            ("int4_channel", torch.rand(16, 1), 1)):
        spec = SPECS[name]
        want_ss = {Granularity.TENSOR: 0, Granularity.CHANNEL: 1}.get(spec.scale.granularity, scale.shape[-1])
        bias = torch.randn(16)
        x2, words, s, got_ss, z, b = wo_mma.operands(x, w, scale, None, bias, spec)
        assert x2.data_ptr() == x.data_ptr()  # aligned: no copy
        assert words.dtype == torch.int32 and words.shape == (16, 16)
        assert s.dtype == (torch.float32 if scale.dtype == torch.float32 else torch.uint8) and got_ss == want_ss
        assert z is None and b.dtype == torch.bfloat16
    shifted = torch.empty(3 * 128 + 1, dtype=torch.bfloat16)[1:].view(3, 128).copy_(x)  # 2-byte offset
    x2 = wo_mma.operands(shifted, w, torch.rand(16, 1), None, None, SPECS["int4_g128"])[0]
    assert x2.data_ptr() % 16 == 0 and x2.data_ptr() != shifted.data_ptr() and torch.equal(x2, shifted)


FP16_NAMES = [n for n in MMA_NAMES if SPECS[n].scale.dtype is not ScaleDtype.E8M0]


@pytest.mark.skipif(not NVRTC and not HAS_CUDA, reason="needs an NVRTC library (QCOMPILE_NVRTC) or a GPU")
@pytest.mark.parametrize("name", FP16_NAMES)
def test_source_compiles_fp16(name):
    """fp16 x (XF16): the mma.sync build (shared tiles, clusters), the lock-step and warp-specialized
    wgmma builds; MX weights refuse it at compile time."""
    spec = SPECS[name]
    smode, group = wo_policy.scale_mode(spec)
    cfg = wo_policy.MmaConfig(wo_policy.FMT[(spec.dtype, spec.packing)], wo_policy.SK[spec.scale.dtype], smode, group,
                           spec.zero_point, "int", spec.global_scale, True, 2, warps=8, cluster=2, pdl=True,
                           packed=True, kw=4, xf16=True)
    assert wo_mma.compile_cubin(wo_mma.source(cfg), "90")[:4] == b"\x7fELF"
    wg_smode = wo_policy.scale_mode(spec, True)[0]
    for ws in (False, True):
        wcfg = replace(cfg, kw=1, warps=4, wgmma=True, ws=ws, smode=wg_smode, stages=2)
        assert wo_mma.compile_cubin(wo_mma.source(wcfg), "90a")[:4] == b"\x7fELF"
    mx = SPECS["mxfp4"]
    with pytest.raises(RuntimeError, match="fp16 x: weights other than MX"):
        mx_cfg = replace(cfg, sk=wo_policy.SK[mx.scale.dtype], fmt=wo_policy.FMT[(mx.dtype, mx.packing)])
        wo_mma.compile_cubin(wo_mma.source(mx_cfg), "90")


# -- GPU ------------------------------------------------------------------------------------------

GPU_MS = (1, 3, 8, 9, 16, 17, 32, 96, 128)  # on sm_90 96 and 128 run the wgmma build (int4 at 128: Triton)
GPU_NK = ((4096, 4096), (4112, 4224), (8192, 8192))


def _check(out, case, k, what):
    spec = wg.parse_scheme_key(case["scheme"]).weight
    w = quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec, case["weight_global_scale"],
                                     case["weight_zero_point"], case["weight_g_idx"], k)
    ref = case["x"].float() @ w.t() + (0 if case["bias"] is None else case["bias"].float())
    out = out.float()
    assert out.shape == ref.shape and bool(torch.isfinite(out).all()), what
    rms = ref.pow(2).mean().sqrt()
    worst = ((out - ref).abs() - (2.0**-7 * ref.abs() + 2.0**-6 * rms)).max().item()
    assert worst <= 0, f"{what}: exceeds tolerance by {worst:.3g}"
    assert ((out - ref).norm() / ref.norm()).item() < 4e-3, what


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", GPU_NK, ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_mma_matches_reference(name, n, k):
    """Per output |out - ref| <= 2^-7 |ref| + 2^-6 rms(ref) against fp32 x @ dequantize(W).T (+ bias):
    bf16 output rounding, and int4/int8 weights with groups smaller than a chunk scaled in bf16 before
    the MMA (e2m1 / e4m3 values times fp8 / e8m0 scales are exact there); normwise < 4e-3."""
    if k % wo_mma.chunk_k(SPECS[name]) or k % max(SPECS[name].scale.group_size, 1):
        pytest.skip("shape not a multiple of the chunk / group")
    for i, m in enumerate(GPU_MS):
        case = _gpu_case(name, m, n, k, torch.bfloat16, seed=i)
        _check(torch.ops.qcompile.wo_linear(*op_args(case, "mma")), case, k, f"{name} M={m}")


WGMMA_MS = (1, 17, 33, 56, 64, 100, 128)


def _sm90() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("n,k", GPU_NK, ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_wgmma_matches_reference(name, n, k):
    """The wgmma build (x streamed per chunk, group scales in bf16 before the MMA), tiled weights,
    M up to 128, against the same tolerance as the mma.sync build; forced splits through a cluster
    and through global memory."""
    _tiled_build_matches(name, n, k, WGMMA_MS, dict(wgmma=True),
                         (dict(split=3, max_cluster=1), dict(split=4, warps=16), dict(split=1, stages=4)))


def _wo_mma_case(name, m, n, k, dtype, seed):
    """One GPU case for wo_mma; skips shapes and formats that it refuses."""
    spec = SPECS[name]
    if k % wo_mma.chunk_k(spec) or k % max(spec.scale.group_size, 1):
        pytest.skip("shape not a multiple of the chunk / group")
    case = _gpu_case(name, m, n, k, dtype, seed=seed)
    zp = case["weight_zero_point"]
    why = wo_mma.mma_reason(spec, n, k, dtype, None if zp is None else zp.dtype)
    if why:
        pytest.skip(why)
    return case


def _wo_mma_args(case, tiled):
    """wo_mma's positional arguments for ``case``: the weight's tiled words or its canonical ones."""
    sp = replace(wg.parse_scheme_key(case["scheme"]).weight, tiled=tiled)
    w = quant_math.tile_weight(case["weight"], sp) if tiled else case["weight"]
    return (case["x"], w, case["weight_scale"], case["weight_global_scale"], case["weight_zero_point"],
            case["bias"], sp)


def _matches(case, args, k, what, deterministic=True, **launch):
    """wo_mma(*args, **launch) within the reference tolerance; the same bits again if ``deterministic``."""
    out = wo_mma.wo_mma(*args, **launch)
    _check(out, case, k, what)
    if deterministic:
        assert torch.equal(out, wo_mma.wo_mma(*args, **launch)), what
    return out


def _tiled_build_matches(name, n, k, ms, build, variants):
    """wo_mma with ``build`` (its keywords) on tiled weights against the reference, for each M in
    ``ms``: the default launch and one of ``variants`` in turn; M = 17 and 100 twice, bit-identical."""
    for i, m in enumerate(ms):
        case = _wo_mma_case(name, m, n, k, torch.bfloat16, i)
        args = _wo_mma_args(case, True)
        for kw in (dict(), variants[i % len(variants)]):
            _matches(case, args, k, f"{name} M={m} {build} {kw}", m in (17, 100), **build, **kw)


WS_MS = (1, 16, 17, 33, 64, 100, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("n,k", GPU_NK, ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_ws_matches_reference(name, n, k):
    """The warp-specialized wgmma build (producer warps, mbarrier rings, x rearranged by x_prep)
    against the reference at the wgmma build's tolerance: ring depths, warpgroups per CTA, splits
    reduced in a cluster and through global memory, N not a multiple of the CTA's rows (4112);
    deterministic."""
    _tiled_build_matches(name, n, k, WS_MS, dict(ws=True),
                         (dict(split=3, max_cluster=1, nstg=2), dict(split=4, warps=4, nstg=6, xstages=2),
                          dict(split=1, warps=16, nstg=3)))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (M above 128 as wgmma row blocks)")
@pytest.mark.parametrize("n,k", ((4096, 4096), (4112, 4224)), ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_mma_row_blocks(name, n, k):
    """M above 128 through the op's mma backend on tiled weights: row blocks (wo_policy.row_blocks; the last one a
    single row at M = 129, not a whole token tile at 300) written into one output, against the reference (bias
    where the case has one), deterministic. A NaN tensor of the output's size is freed just before, so the
    caching allocator hands its block to the output and a row no launch wrote fails the check."""
    for i, m in enumerate((129, 200, 300)):
        case = _wo_mma_case(name, m, n, k, torch.bfloat16, i)
        x, w, s, gs, zp, bias, sp = _wo_mma_args(case, True)
        assert wo_policy.row_blocks(sp, m, (9, 0)), (name, m)
        torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # in the allocator's cache
        out = wg._mma(x, w, s, gs, zp, None, bias, sp)
        _check(out, case, k, f"{name} M={m} row blocks")
        assert torch.equal(out, wg._mma(x, w, s, gs, zp, None, bias, sp)), f"{name} M={m} not deterministic"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["int4_g128", "nvfp4", "int8_channel_packed"])
def test_gpu_mma_forced_splits_and_determinism(name):
    n = k = 4096
    for m in (1, 16):
        case = _gpu_case(name, m, n, k, torch.bfloat16, seed=m + 1)
        args, tiled = _wo_mma_args(case, False), _wo_mma_args(case, True)
        # splits up to 8 reduce in a cluster, more (or max_cluster=1) through global memory
        for split in (1, 3, 7, 8, k // wo_mma.chunk_k(args[-1])):
            for stages, warps, a, cl in ((2, 4, args, 8), (4, 8, tiled, 8), (8, 4, tiled, 8), (4, 16, tiled, 8),
                                         (2, 8, tiled, 1)):
                kw = dict(stages=stages, warps=warps, split=split, max_cluster=cl)
                _matches(case, a, k, f"{name} M={m} {kw} tiled={a is tiled}", **kw)
        # the cluster reduction did run: 4096 / 128 CTA columns of clusters fit on any sm_90
        assert {v.cfg.cluster for v in wo_policy._PLANS.values() if v is not None} >= {3, 7, 8}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", ((4096, 4096), (4112, 4224)), ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_mma_tile_sharing(name, n, k):
    """KW warps per tile, their K parts summed in shared memory, and RT tiles per warp (one x fragment
    load for RT tiles' MMAs): every format, tiled and canonical words, with no split, splits reduced in a
    cluster and through global memory, parts of unequal or no chunks (4224 = 33 chunks of 128), idle
    warps past N (4112) and a warp whose second tile is past N (4112 = 257 tiles); deterministic."""
    launches = (dict(kw=2), dict(kw=4, split=2), dict(kw=8, warps=16), dict(kw=16, warps=16),
                dict(kw=4, split=3, max_cluster=1), dict(kw=8, warps=8, split=2, max_cluster=1),
                dict(kw=4, warps=16), dict(rt=2), dict(rt=2, warps=16, split=8), dict(rt=2, kw=2, warps=16, split=4),
                dict(rt=2, split=3, max_cluster=1), dict(rt=2, kw=4, warps=4))
    for i, m in enumerate((1, 3, 8, 16, 32)):
        case = _wo_mma_case(name, m, n, k, torch.bfloat16, 20 + i)
        for j, launch in enumerate(launches):
            tiled = (i + j) % 2 == 0
            # (kw / rt alone ask for the mma.sync build, also at M = 32 and on tiled weights)
            _matches(case, _wo_mma_args(case, tiled), k, f"{name} M={m} {launch} tiled={tiled}", **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (mbarrier.try_wait)")
@pytest.mark.parametrize("n,k", ((4096, 4096), (4112, 4224)), ids=str)
@pytest.mark.parametrize("name", MMA_NAMES)
def test_gpu_mma_x_streamed(name, n, k):
    """x streamed through a ring per K part (xs=True): within the reference tolerance in every launch shape of
    the mma.sync build (one or two tiles per warp, warps sharing a tile with parts of unequal or no chunks:
    4224 = 33 chunks; splits reduced in a cluster, whose partials, like the KW partials, reuse the ring's
    memory, and through global memory; idle warps and tile groups past N = 4112; tiled and canonical words;
    2 to 4 ring slots; fp16 x), and the same bits as x staged first where that launch fits."""
    launches = (dict(split=2), dict(kw=4, split=2, xstages=2), dict(kw=8, warps=16, split=1, xstages=2),
                dict(rt=2, kw=4, warps=16, split=2, xstages=3), dict(rt=2, warps=16, split=8),
                dict(split=3, max_cluster=1), dict(rt=2, kw=2, split=3, max_cluster=1), dict(split=1, stages=4),
                dict(rt=2, kw=8, warps=16, split=1, xstages=3))
    spec = SPECS[name]
    nch = k // wo_policy.KPC[spec.dtype.bits]
    for i, m in enumerate((1, 3, 8, 9, 16, 32)):
        dtype = torch.float16 if i == 2 and name in FP16_NAMES else torch.bfloat16
        case = _wo_mma_case(name, m, n, k, dtype, 60 + i)
        for j, launch in enumerate(launches):
            args = _wo_mma_args(case, (i + j) % 2 == 0)
            what = f"{name} M={m} {launch} tiled={(i + j) % 2 == 0} {dtype}"
            out = _matches(case, args, k, what, xs=True, **launch)
            if wo_policy.x_bytes(m, -(-nch // launch["split"]), spec.dtype.bits) <= wo_policy.RT_SMEM:
                staged = {a: b for a, b in launch.items() if a != "xstages"}
                assert torch.equal(out, wo_mma.wo_mma(*args, xs=False, wgmma=False, **staged)), what


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", ((4096, 4096), (4112, 4224)), ids=str)
@pytest.mark.parametrize("name", FP16_NAMES)
def test_gpu_mma_fp16_matches_reference(name, n, k):
    """fp16 x and output: the op's mma backend on canonical words (mma.sync, on sm_90 the lock-step
    wgmma build from M = 25), and wo_mma on tiled words (shared tiles, cluster and global splits; on
    sm_90 the warp-specialized build from M = 12), against the fp32 reference at the bf16 tolerance;
    deterministic."""
    launches = (dict(), dict(kw=8, warps=16), dict(kw=4, split=2), dict(split=3, max_cluster=1), dict(split=5))
    for i, m in enumerate((1, 3, 8, 12, 17, 32, 64, 100)):
        case = _wo_mma_case(name, m, n, k, torch.float16, 40 + i)
        out = torch.ops.qcompile.wo_linear(*op_args(case, "mma"))
        assert out.dtype == torch.float16
        _check(out, case, k, f"{name} fp16 M={m} op")
        args = _wo_mma_args(case, True)
        tiled = dict(case, weight=args[1], scheme=QuantScheme(args[-1]).key)
        _check(torch.ops.qcompile.wo_linear(*op_args(tiled, "mma")), case, k, f"{name} fp16 M={m} tiled op")
        if m > wo_policy.MAX_M:
            continue
        launch = launches[i % len(launches)]
        out = _matches(case, args, k, f"{name} fp16 M={m} tiled {launch}", **launch)
        assert out.dtype == torch.float16


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (tile sharing is chosen there)")
def test_gpu_mma_default_launch_policy(monkeypatch):
    """The default launch on tiled weights (wo_policy.default_launch, H100): warps share tiles in place of a
    split reduced through global memory (4096^2 M = 1: split 16), or in a cluster from M = 5
    (14336x4096 M = 8); not where the x slices would not fit (4096^2 M = 8), nor below M = 5 in a
    cluster (14336x4096 M = 1). Shared-tile launches and cluster plans are compiled for the CTAs per SM
    they plan (minb), plans reduced through global memory are not. At M = 9..16 two tiles per warp, one
    16-warp CTA per SM: 4096^2 M = 16 without a split (16 warps per tile), 8192^2 M = 12 with 4 per tile
    and a split of 2 in a cluster; wide weights from M = 6 (28672x4096 M = 8). That is the policy with x
    staged; with x streamed (xs_default) the launches from M = 5 where the GPU is filled, and int4 g128 (x by TMA)
    at M = 9..16 wherever a candidate exists, take two tiles per warp and no split. Every launch matches the
    reference."""
    spec = replace(SPECS["int4_g128"], tiled=True)
    launched = []
    default = wo_policy.default_launch
    monkeypatch.setattr(wo_policy, "default_launch", lambda *a, **k: launched.append(default(*a, **k)) or launched[-1])
    streamed = {}
    for m, n, k in ((8, 4096, 4096), (8, 14336, 4096), (12, 8192, 8192), (16, 4096, 4096)):
        case = _gpu_case("int4_g128", m, n, k, torch.bfloat16, seed=4)
        out = wo_mma.wo_mma(case["x"], quant_math.tile_weight(case["weight"], spec), case["weight_scale"], None, None,
                            case["bias"], spec)
        _check(out, case, k, f"M={m} {n}x{k} xs")
        cfg, split = launched[-1].cfg, launched[-1].split
        streamed[(m, n)] = (cfg.xs, cfg.kw, cfg.rt, split)
    assert streamed == {(8, 4096): (True, 16, 2, 1), (8, 14336): (True, 4, 2, 1), (12, 8192): (True, 8, 2, 1),
                        (16, 4096): (True, 16, 2, 1)}
    monkeypatch.setattr(wo_policy, "xs_default", lambda *a: False)
    chosen = {}
    for m, n, k in ((1, 4096, 4096), (8, 4096, 4096), (1, 14336, 4096), (8, 14336, 4096), (16, 4096, 4096),
                    (12, 8192, 8192), (8, 28672, 4096)):
        case = _gpu_case("int4_g128", m, n, k, torch.bfloat16, seed=3)
        out = wo_mma.wo_mma(case["x"], quant_math.tile_weight(case["weight"], spec), case["weight_scale"], None, None,
                            case["bias"], spec)
        _check(out, case, k, f"M={m} {n}x{k}")
        cfg, split = launched[-1].cfg, launched[-1].split
        chosen[(m, n)] = (cfg.kw, cfg.warps, split, cfg.cluster, cfg.minb)
        assert cfg.rt == (2 if m > 8 or n == 28672 else 1)
    assert chosen[(1, 4096)] == (16, 16, 1, 1, 2)
    assert chosen[(16, 4096)] == (16, 16, 1, 1, 1) and chosen[(12, 8192)] == (4, 16, 2, 2, 1)
    kw, _, split, cluster, minb = chosen[(8, 4096)]
    assert kw == 1 and split > 1 and cluster == 1 and minb == 1
    kw, warps, _, cluster, minb = chosen[(1, 14336)]
    assert kw == 1 and cluster > 1 and minb == 32 // warps
    kw, warps, _, _, minb = chosen[(8, 14336)]
    assert kw > 1 and minb == 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_act_order_sorted_runs_wo_mma():
    """Act-order int4: sorted by group (and tiled) the weight runs wo_mma through the op's mma backend
    (x's columns gathered per call), within the reference tolerance, M up to 128; and a GPU load of
    a compressed-tensors act-order layer does that sort by itself."""
    from qcompile.formats import parse_quant_config
    from qcompile.linear import QuantLinear

    n = k = 4096
    for i, m in enumerate((1, 16, 64, 128)):
        case = _gpu_case("int4_g32_actorder", m, n, k, torch.bfloat16, seed=30 + i)
        srt = sorted_case(case)
        spec = wg.parse_scheme_key(srt["scheme"]).weight
        tiled = dict(srt, weight=quant_math.tile_weight(srt["weight"], spec),
                     scheme=QuantScheme(replace(spec, tiled=True)).key)
        assert wo_mma.mma_reason(replace(spec, k_sorted=False), n, k) is None
        _check(torch.ops.qcompile.wo_linear(*op_args(tiled, "mma")), case, k, f"act-order sorted M={m}")
        # fp16 x: the Triton kernel's plain group path on the sorted weight
        h = dict(case, x=case["x"].half(), bias=None if case["bias"] is None else case["bias"].half())
        _check(torch.ops.qcompile.wo_linear(*op_args(dict(srt, x=h["x"], bias=h["bias"]), "triton")), h, k,
               f"act-order sorted fp16 M={m}")
    # the load path: QuantLinear.finalize on the GPU sorts and tiles an act-order layer
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                           "symmetric": True, "actorder": "group"}}}}
    name = "model.layers.0.mlp.up_proj"
    lq = parse_quant_config(cfg).resolve(name)
    tensors = {"weight_packed": case["weight"], "weight_scale": case["weight_scale"].bfloat16(),
               "weight_g_idx": case["weight_g_idx"], "weight_shape": torch.tensor([n, k])}
    header = {f"{name}.{t}": (v.dtype, tuple(v.shape)) for t, v in tensors.items()}
    mods = {}
    for dtype in (torch.float16, torch.bfloat16):  # both run wo_mma: sorted and tiled
        mods[dtype] = QuantLinear.plan(torch.nn.Linear(k, n, bias=False, device="meta", dtype=dtype), name, lq, header)
        for t, v in tensors.items():
            setattr(mods[dtype], t, torch.nn.Parameter(v.cuda(), requires_grad=False))
        mods[dtype].finalize()
    assert mods[torch.float16].scheme_key == "w=int4/group32/pack=int32/tiled/ksorted;a=none"
    mod = mods[torch.bfloat16]
    assert mod.scheme_key == "w=int4/group32/pack=int32/tiled/ksorted;a=none", mod.scheme_key
    got = torch.ops.qcompile.wo_linear(case["x"], mod.weight, mod.weight_scale, None, None, mod.weight_g_idx, None,
                                       mod.scheme_key, "mma")
    ref_case = dict(case, weight_scale=case["weight_scale"].bfloat16().float(), bias=None)  # bf16 scales, as stored
    _check(got, ref_case, k, "loaded act-order layer")


# x streamed at two token tiles, no split: at K = 4096 each of the 8 K parts refills its 3 ring slots (int4 g128: by
# TMA, natural-order tiles)
XS16 = dict(xs=True, rt=2, kw=8, warps=16, xstages=3, split=1)


def _on_two_streams(call, reps):
    """``call(i)`` queued ``reps`` times on each of two new streams i, behind a sleep kernel on both (so that their
    launches do run concurrently); ([outputs of stream 0, of stream 1], the streams), synchronized."""
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for st in streams:
        with torch.cuda.stream(st):
            torch.cuda._sleep(50_000_000)  # ~25 ms: both queues fill before either runs
    outs = [[], []]
    for _ in range(reps):
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                outs[i].append(call(i))
    torch.cuda.synchronize()
    return outs, streams


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mma_global_split_on_two_streams():
    """Split-K reduced through global memory (max_cluster=1) on two streams at once: each stream
    counts its own CTAs, so both give their serial results bit for bit. Both streams wait behind a
    sleep kernel while the calls are queued, so their launches do run concurrently (one counter
    buffer shared by both streams fails this test)."""
    n = k = 4096
    cases = [_gpu_case("int4_g128", 1, n, k, torch.bfloat16, seed=s) for s in (21, 22)]
    spec = wg.parse_scheme_key(cases[0]["scheme"]).weight

    def call(c):
        return wo_mma.wo_mma(c["x"], c["weight"], c["weight_scale"], c["weight_global_scale"],
                             c["weight_zero_point"], c["bias"], spec, split=8, max_cluster=1)

    want = [call(c) for c in cases]
    outs = _on_two_streams(lambda i: call(cases[i]), 100)[0]
    for i in range(2):
        _check(want[i], cases[i], k, f"stream {i}")
        assert all(torch.equal(o, want[i]) for o in outs[i]), f"stream {i}"


def _counter_values(n):
    """The first ``n`` split-K counters of the current stream's buffer, read back."""
    from torch.cuda._utils import _get_gpu_runtime_library

    torch.cuda.synchronize()
    ptr, size = cuda_driver._COUNTERS[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)]
    host = (ctypes.c_int * n)()
    assert _get_gpu_runtime_library().cuMemcpyDtoH_v2(host, ptr, ctypes.c_size_t(4 * n)) == 0
    return list(host)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (wgmma)")
def test_gpu_tma_x_on_two_streams():
    """The builds that load x by TMA from the tensor map of each call's x (warp-specialized, M = 64; x streamed,
    M = 16) on two streams at once, each alternating them with a split-K call reduced through global memory:
    every call gives its serial result bit for bit, and each stream's split-K counters end at zero."""
    k = 4096
    ws_cases = [_gpu_case("int4_g128", 64, 4096, k, torch.bfloat16, seed=s) for s in (31, 32)]
    sk_cases = [_gpu_case("int4_g128", 4, 8192, k, torch.bfloat16, seed=s) for s in (33, 34)]
    xs_cases = [_gpu_case("int4_g128", 16, 4096, k, torch.bfloat16, seed=s) for s in (35, 36)]
    spec = replace(wg.parse_scheme_key(ws_cases[0]["scheme"]).weight, tiled=True)
    wts = [quant_math.tile_weight(c["weight"], spec) for c in ws_cases + sk_cases + xs_cases]

    def call(i, c, **kw):
        return wo_mma.wo_mma(c["x"], wts[i], c["weight_scale"], None, None, c["bias"], spec, **kw)

    def calls(s):  # the three calls of stream s
        return (call(s, ws_cases[s], ws=True, warps=8), call(2 + s, sk_cases[s], split=8, max_cluster=1),
                call(4 + s, xs_cases[s], **XS16))

    want = [calls(s) for s in (0, 1)]
    _check(want[0][0], ws_cases[0], k, "ws")
    _check(want[0][1], sk_cases[0], k, "split-K")
    _check(want[0][2], xs_cases[0], k, "xs")
    assert _counter_values(8192 // 16) == [0] * (8192 // 16)
    outs, streams = _on_two_streams(calls, 50)
    for i, st in enumerate(streams):
        assert all(all(map(torch.equal, got, want[i])) for got in outs[i]), f"stream {i}"
        with torch.cuda.stream(st):
            assert _counter_values(8192 // 16) == [0] * (8192 // 16), f"stream {i}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mma_capture_takes_spare_counters(monkeypatch):
    """A graph captured on a stream without split-K counters takes the zeroed spare buffer that an eager
    call set aside (no zeroing captured before each launch); its replays match eager bit for bit."""
    monkeypatch.setattr(cuda_driver, "_COUNTERS", {})
    monkeypatch.setattr(cuda_driver, "_SPARE", {})
    case = _gpu_case("int4_g128", 8, 4096, 4096, torch.bfloat16, seed=7)
    spec = wg.parse_scheme_key(case["scheme"]).weight

    def call():
        return wo_mma.wo_mma(case["x"], case["weight"], case["weight_scale"], None, None, case["bias"], spec,
                             split=8, max_cluster=1)

    want = call()
    idx = torch.cuda.current_device()
    assert idx in cuda_driver._SPARE
    s = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        got = call()
    assert (idx, s.cuda_stream) in cuda_driver._COUNTERS and idx not in cuda_driver._SPARE
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    _check(want, case, 4096, "eager")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mma_cuda_graph():
    case = _gpu_case("nvfp4", 4, 4096, 4096, torch.bfloat16, seed=5)
    fn = lambda: torch.ops.qcompile.wo_linear(*op_args(case, "mma"))  # noqa: E731
    want = fn()
    got, graph = graph_replay(fn, lambda: None)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["int4_g128", "nvfp4"])
@pytest.mark.parametrize("m,max_cluster,launch", [(1, 1, {}), (16, 8, {}), (5, 8, {}), (28, 8, {}),
                                                   (64, 8, dict(ws=True)), (17, 1, dict(ws=True)), (16, 8, XS16)],
                         ids=str)
@pytest.mark.parametrize("trig", [False, True])
def test_gpu_mma_pdl_chain(name, m, max_cluster, launch, trig):
    """Each call's input is the previous call's output (back to back, or through another kernel),
    captured in one CUDA graph: with programmatic dependent launch the kernel must still wait for
    its input, so the chain equals the one launched without it, bit for bit, and eager; also when
    the next call may launch from the start of this one (``trig``). ``ws``: the warp-specialized build, whose
    x warp stages x by TMA once the previous kernel has completed (no x_prep launch in between); ``xs``: x
    streamed in the mma.sync build, on natural-order tiles by TMA from its producer warps (M = 5 streams x by
    default at this shape)."""
    if launch and not _sm90():
        pytest.skip("needs an sm_90 GPU (wgmma, mbarriers)")
    n = k = 4096
    case = _gpu_case(name, m, n, k, torch.bfloat16, seed=11)
    spec = replace(wg.parse_scheme_key(case["scheme"]).weight, tiled=True)
    w = quant_math.tile_weight(case["weight"], spec)

    def chain(pdl):
        x = case["x"]
        for i in range(9):
            y = wo_mma.wo_mma(x, w, case["weight_scale"], case["weight_global_scale"], case["weight_zero_point"],
                              None, spec, max_cluster=max_cluster, pdl=pdl, trig=trig, **launch)
            x = y if i % 3 else y / y.float().norm(dim=-1, keepdim=True).clamp_min(1e-6).bfloat16() * 64
        return x

    eager = chain(False)
    assert bool(torch.isfinite(eager.float()).all()) and eager.float().abs().amax() > 0
    got = {}
    for pdl in (False, True):
        chain(pdl)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(pdl)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        got[pdl] = out.clone()
    assert torch.equal(got[True], got[False]) and torch.equal(got[False], eager)
    assert torch.equal(chain(True), eager)
