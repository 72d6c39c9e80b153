"""The ``mma`` backend of ``qcompile::wo_linear``: a CUDA C++ weight-only GEMM for decode-size M.

``wo_mma.cu`` holds the kernel (its header comment explains the design): tensor cores (mma.sync
m16n8k16, bf16) fed with weights decoded in registers, from the canonical checkpoint layout or the
tiled one (quant_math.tile_words), x in shared memory, split-K reduced inside a thread-block cluster
(sm_90, up to 8 splits whose clusters all fit on the GPU at once) or by the last CTA of each column.
On sm_90 it is launched with programmatic dependent launch (cuLaunchKernelEx): its first weight
loads overlap the previous kernel's tail, and where that measured faster it lets the next kernel
launch from its own start (:func:`trig_default`; ``QCOMPILE_PDL=0`` turns PDL off). On sm_90, tiled
weights at M = 9..16 (wide ones from M = 6) run the mma.sync build with two 16-row tiles per warp
(:func:`rt_default`); from M = 17 (4-bit; 12 where that has no launch) / 57 (int8) / 49 (fp8) up to 128
its warp-specialized wgmma build (producer warps, mbarrier rings, :func:`ws_default`); other M = 25..128
(25..96 for int4 weights not tiled, :func:`max_m`) its lock-step wgmma build (:func:`wgmma_default`);
elsewhere the mma.sync build runs M <= 32.

It is compiled at first use for the running GPU with NVRTC, the runtime compiler that ships with
PyTorch's CUDA build (no CUDA toolkit, no C++ compiler, no ninja needed), one specialization per
(format, scale mode, M tile, ...) and cached for the process. ``QCOMPILE_NVRTC`` may name another
``libnvrtc.so`` (used to compile for sm_90 on a machine without a GPU, to read the SASS).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..scheme import Granularity, Packing, QDtype, ScaleDtype, WeightSpec
from . import quant_math

SOURCE = Path(__file__).with_name("wo_mma.cu")

FMT = {(QDtype.INT4, Packing.INT32): 0, (QDtype.FP4_E2M1, Packing.UINT8): 1, (QDtype.INT8, Packing.INT32): 2,
       (QDtype.INT8, Packing.NONE): 3, (QDtype.FP8_E4M3, Packing.NONE): 4}
SK = {ScaleDtype.FP32: 0, ScaleDtype.FP8_E4M3: 1, ScaleDtype.E8M0: 2}
SMODE_END, SMODE_CHUNK, SMODE_PRE = 0, 1, 2
KPC = quant_math.TILE_K  # k per chunk (one 16-byte load per lane per row), by weight bits
ZP_TYPES = {torch.int32: "int", torch.int8: "signed char", torch.uint8: "unsigned char"}
MAX_M = 32  # 4 token tiles of 8; above, the Triton kernel / dequant + F.linear
# Shared memory for x per CTA (M x K-range bf16); split-K grows until it fits.
SMEM_BUDGET = 96 * 1024
MAX_CLUSTER = 8  # splits reduced inside one thread-block cluster (the portable maximum), sm_90+
# From this M up the split shrinks until its clusters fit (launch_plan). Below, a shrunk split lost to
# the one-wave global-memory reduction by up to 3 us (int4) / 8 us (NVFP4) on an H100; at M = 8 the
# shapes split both ways, so they keep shrinking.
CLUSTER_SHRINK_MIN_M = 5
# M range of the wgmma build on sm_90 (x streamed per chunk, warpgroup MMAs): from M = 25 it beat the
# mma.sync build at every measured shape on an H100 (int4; NVFP4 at N = K = 8192 within 1 %); at M = 17..24
# the shapes split both ways.
WGMMA_MIN_M = 25
WGMMA_MAX_M = 128  # 16 token tiles (m64 n128 k16); what wo_mma(..., wgmma=True) accepts
# Largest M the mma backend runs through this kernel on sm_90 for int4 weights not tiled (the lock-step wgmma
# build; the others: up to WGMMA_MAX_M). Above M = 32 that build beat the Triton kernel / dequant + F.linear by
# 1.1-4x for e2m1, MX, fp8 and int8 weights up to M = 128 on an H100; for int4 it won or tied up to M = 96 (by
# 1.3x at M = 80, 96 with wgmma_launch) and lost at M = 128 on 2 of 4 shapes.
# Elsewhere the mma.sync build runs M <= MAX_M.
SM90_MAX_M_INT4 = 96
# The warp-specialized wgmma build (producer warps filling mbarrier rings with bulk copies; x loaded by TMA on
# natural-order tiles, else rearranged once per call by x_prep) runs tiled weights on sm_90 from this M, by weight
# type. H100: 4-bit weights at M = 12..128 beat the mma.sync / wgmma builds in 42 of 48 cells (3 shapes x 2
# formats; by up to 2x at M = 96..128); at M <= 8 they lost at 5 of 6 shape-format pairs (the per-chunk barriers
# cost more than the work). 8-bit weights take it where the lock-step wgmma build's next token tile makes that
# one jump (4 shapes, M = 17..63): int8 from M = 57 (8 tiles; 8192^2 40.3 us against 47.5, 28672x8192 115 against
# 132; at M = 49..56 it lost by 2-5.5 us), MXFP8 from M = 49 (7 tiles; 8192^2 49.3 against 53.4). int8 channel at
# M = 25..56 is within +-2 us of the lock-step build at 3 of 4 shapes (the wide one: WS_WIDE_MIN_M_8BIT).
WS_MIN_M = {QDtype.INT4: 12, QDtype.FP4_E2M1: 12, QDtype.INT8: 57, QDtype.FP8_E4M3: 49}
# 8-bit weights wide enough for one column per SM (_wide) take it from this M (above the two-tile mma.sync build),
# with 2 warpgroups and one CTA per SM up to M = 64 (ws_launch). H100, 28672x8192 int8 channel M = 17 / 64: 84.3 /
# 91.4 us against 96.5 / 110.0 with 4 warpgroups; MXFP8 99.2 / 113.1 against 106.4 / 123.7. At M = 25..56 they
# also beat the lock-step build (int8 M = 56 87.0 against 106.5).
WS_WIDE_MIN_M_8BIT = 17
# Below WS_MIN_M, weights wide enough for its one-column-per-SM launch (ws_launch: 16 warps, no
# split) still take the warp-specialized build when the mma.sync build's x slice (all M rows of its
# CTA's K range, staged before the first MMA) would leave fewer than 4 of its CTAs (32 warps) on an SM.
# H100, us, mma.sync vs warp-specialized: 28672x8192 M = 8 int4 (70 KB of x) 70 vs 58, NVFP4 78 vs 65,
# int8 (65 KB) 115 vs 94; int4 M = 6 (52 KB) 52 vs 58. At N = 8192 (4 consumer warps, split K) it lost: 8192x28672
# M = 8 NVFP4 71 vs 91.
SM90_SMEM_PER_SM = 228 * 1024


def _mma_plan(m: int, n: int, k: int, bits: int, sms: int, warps: int | None = None, split: int | None = None,
              kw: int = 1) -> tuple[int, int, int]:
    """:func:`plan` of the mma.sync build at its launch defaults for tiled weights (:data:`LAUNCH`)."""
    stages, warps_per_sm = LAUNCH[True]
    return plan(m, n, k, bits, warps or MMA_WARPS, stages, sms, split, warps_per_sm, kw=kw)


@functools.lru_cache(maxsize=None)  # per call shape: wo_mma asks on every call
def ws_default(spec: WeightSpec, m: int, n: int, k: int, capability: tuple[int, int], sms: int) -> bool:
    """The warp-specialized build: tiled weights on sm_90, M = WS_MIN_M[dtype]..WGMMA_MAX_M, or smaller M
    of wide weights whose mma.sync x slice would crowd out that build's CTAs; not where the mma.sync build
    with two tiles per warp runs (:func:`rt_default`)."""
    if capability[0] != 9 or not spec.tiled or m > WGMMA_MAX_M or rt_default(spec, m, n, k, capability, sms):
        return False
    if spec.dtype.bits == 8 and m >= WS_WIDE_MIN_M_8BIT and _wide(n, sms):
        return True
    return m >= WS_MIN_M[spec.dtype] or _ws_wide(spec, m, n, k, sms)


def _ws_wide(spec: WeightSpec, m: int, n: int, k: int, sms: int) -> bool:
    """Wide weights below WS_MIN_M whose mma.sync x slice would crowd out the warp-specialized build."""
    if m >= WGMMA_MIN_M or not _wide(n, sms):  # (8-bit M = 25..56: the lock-step build or WS_WIDE_MIN_M_8BIT)
        return False
    bits = spec.dtype.bits
    return x_bytes(m, _mma_plan(m, n, k, bits, sms)[2], bits) > SM90_SMEM_PER_SM // 4


# KW: warps of the mma.sync build sharing one 16-row tile, each streaming part of the CTA's K range, their
# partial sums added in shared memory. More warps per tile leave fewer K splits to reduce across CTAs
# (through global memory or a cluster: at 8192^2 M = 1 that epilogue cost about 2 us on an H100), but
# every CTA stages x for a longer K range. Taken on sm_90 in place of a plan that reduces split K through
# global memory (from KW_CLUSTER_MIN_M also in a cluster: default_launch), while the split stays <=
# KW_MAX_SPLIT, the CTAs fit in one wave and the x staged on an SM stays within KW_X_SHARE of the weight
# bytes it streams; 16 warps per CTA from 4 per tile (fewer CTAs stage x: 16384x8192 M = 4 26.9 against
# 38.2 us with 8). H100, 8192^2 M = 1: int4 13.7 us against 17.5-18.1 with one warp per tile, NVFP4 16.8
# against 21.8.
# Where the rounded split would spill the CTAs into a second wave, no split is tried instead, with fewer
# warps than the SMs hold, while each warp streams at most KW_CHUNK_GROWTH times the chunks it would
# without shared tiles (5120^2 M = 1 int4 8.3 against 9.3 us, 5 chunks per warp against 4; 10240x8192,
# 16 against 10, lost: 21.8 against 19.1).
KW_MAX_SPLIT = 2
KW_X_SHARE = 0.9
KW_CHUNK_GROWTH = 1.3
# From this M shared tiles also replace a split reduced in a cluster. H100, over 9 shapes x 4 formats, shared
# tiles against the cluster plan: 8192^2 M = 8 int4 17.1 against 18.8 us, NVFP4 19.3 against 22.5; 16384x8192
# M = 6 NVFP4 33.9 against 43.1; worst 28672x4096 int4 M = 6, +1.0. Below M = 5 the cluster plans stay
# (sharing lost up to 4.3 us there: 28672x8192 M = 3, 14336x4096 M = 4).
KW_CLUSTER_MIN_M = 5
# Up to this many 8-token tiles, two mma.sync launches on tiled weights (sm_90) are compiled for the CTAs
# per SM their plan assumes (__launch_bounds__ minimum blocks: 64 registers at 32 warps per SM): the
# shared-tile launches, and 8-warp plans reduced in a cluster. Left to itself ptxas gives int4 g128 at
# M = 9..16 70 registers (3 of 4 planned CTAs per SM) and other formats fewer than fit, 48-57. H100,
# capped against uncapped: 8192^2 NVFP4 M = 1 16.3 against 17.0 us, 28672x8192 MXFP8 M = 4 87.9 against
# 98.4; slower where the capped plan takes another split (11008x4096 int4 M = 11 +2.0). 8-warp plans
# reduced through global memory stay uncapped (capped, they ran 2-3.5 us slower at 5 of 7 shapes on one
# machine and faster on another). From 3 tiles the cap spills (int4: 56-104 bytes of stack).
REG_CAP_MAX_MT = 2


@functools.lru_cache(maxsize=None)  # per call shape
def mma_launch(m: int, n: int, k: int, bits: int, capability: tuple[int, int],
               sms: int) -> tuple[int, int, int | None]:
    """(warps per CTA, warps per tile, split or None for the plan's) of the mma.sync build on tiled
    weights: the most warps per tile (a power of two up to 16) that the GPU's warp slots (LAUNCH) give
    every tile, 16 warps per CTA from 4 per tile; fewer while the split is too large (KW_MAX_SPLIT), the
    CTAs do not fit in one wave (x slices over SMEM_BUDGET split K further), the x slices take too much
    (KW_X_SHARE) or, without a split, the warps too many chunks each (KW_CHUNK_GROWTH)."""
    if capability[0] != 9:
        return MMA_WARPS, 1, None
    warps_per_sm = LAUNCH[True][1]
    cps1 = _mma_plan(m, n, k, bits, sms)[2]
    kw = 1
    while kw < 16 and 2 * kw * (n // 16) <= warps_per_sm * sms:
        kw *= 2
    while kw > 1:
        warps, forced = 16 if kw >= 4 else 8, None
        ctas = warps_per_sm // warps
        cols, split, cps = _mma_plan(m, n, k, bits, sms, warps, kw=kw)
        if cols * split > ctas * sms >= cols:
            forced = 1
            cols, split, cps = _mma_plan(m, n, k, bits, sms, warps, 1, kw)
        x_sm = x_bytes(m, cps, bits) * ctas
        if (split <= KW_MAX_SPLIT and cols * split <= ctas * sms and x_sm <= KW_X_SHARE * n * k * bits / 8 / sms
                and x_sm + 1024 * ctas <= SM90_SMEM_PER_SM and (forced is None or cps / kw <= KW_CHUNK_GROWTH * cps1)):
            return warps, kw, forced
        kw //= 2
    return MMA_WARPS, 1, None


# RT = 2 (two 16-row tiles per warp, one x fragment load for both): 16 warps per CTA, 128 registers, so
# one CTA per SM; its x slice may then take most of the SM's shared memory. Taken on sm_90 for tiled
# weights at 2 token tiles (M = 9..16), in place of the warp-specialized build (4-bit from M = 12, wide
# weights) and the one-tile mma.sync launches: the first of rt_candidates whose split is reduced in a
# cluster (rt_launch). H100, against one tile per warp: 8192^2 M = 16 int4 19.0 us against 20.5, NVFP4 21.7
# against 25.1; 28672x8192 int4 50.0 against 56.3. Of 9 shapes x 4 formats x M = 9, 12, 16 it lost at
# 8192x28672 int4 M = 12, 16 (55.8 against 53.1: the first cluster that fits is 6 splits of one warp per
# tile) and by up to 1.1 us at a few other cells (int8; 14336x4096 int4).
RT_SMEM = 200 * 1024
RT_MT = 2  # token tiles of the two-tile launch (from 3, 128 registers do not hold it)
# At one token tile, wide weights (one 16-warp column per SM, ws_launch) take it where the warp-specialized
# build would (_ws_wide) and from this M: H100, 28672x8192 int4 M = 8 47.2 us against 58.4 on the
# warp-specialized build, M = 6 46.5 against 51.9 on the one-tile launch. Below M = 6 8-bit weights lost
# 1-3 us (28672x4096 MXFP8 M = 1..4) and 4-bit ones won or lost up to 2 us by candidate, so they keep
# their launch.
RT_WIDE_MIN_M = 6


def rt_candidates(m: int, n: int, k: int, bits: int, sms: int, xs: bool = False,
                  xnat: bool = False) -> list[tuple[int, int, int]]:
    """(CTAs, warps per tile, split) of the mma.sync build with two tiles per warp, 16 warps per CTA and
    one CTA per SM: every split up to MAX_CLUSTER whose CTAs fit in one wave, whose x slice fits
    RT_SMEM and whose warps stream at least 2 chunks each; most CTAs first, then fewer splits. ``xs`` (x
    streamed): no split, and the ring of XS_SLOTS chunks per K part within RT_SMEM in place of the slice."""
    nch = k // KPC[bits]
    out = []
    for kw in (1, 2, 4, 8, 16):
        cols = -(-(n // 16) // (16 // kw * 2))
        for split in range(1, 2 if xs else MAX_CLUSTER + 1):
            cps = -(-nch // split)
            if -(-nch // cps) != split or cols * split > sms:
                continue
            x = x_bytes(m, 1, bits, xstages=XS_SLOTS, xs_parts=kw, xnat=xnat) if xs else x_bytes(m, cps, bits)
            if x <= RT_SMEM and cps >= 2 * kw:
                out.append((cols * split, kw, split))
    return sorted(out, key=lambda c: (-c[0], c[2]))


@functools.lru_cache(maxsize=None)  # per call shape
def rt_default(spec: WeightSpec, m: int, n: int, k: int, capability: tuple[int, int], sms: int) -> bool:
    """Whether the default launch tries two tiles per warp (:func:`rt_launch`): tiled weights on sm_90 at
    RT_MT token tiles, or fewer where the warp-specialized build would take wide weights, with some
    candidate launch."""
    if capability[0] != 9 or not spec.tiled or -(-m // 8) > RT_MT:
        return False
    if -(-m // 8) < RT_MT and not (_ws_wide(spec, m, n, k, sms)
                                    or (m >= RT_WIDE_MIN_M and _wide(n, sms))):
        return False
    return bool(rt_candidates(m, n, k, spec.dtype.bits, sms))


def rt_launch(base: MmaConfig, m: int, n: int, k: int, device: torch.device, max_cluster: int) -> tuple | None:
    """:func:`launch_plan` of the first of :func:`rt_candidates` that runs without a split or reduces its
    split in a cluster (its clusters all fit on the GPU); None if none does."""
    for _, kw, split in rt_candidates(m, n, k, base.bits, _sm_count(device)):
        cfg = replace(base, warps=16, kw=kw, rt=2, minb=1)
        chosen = launch_plan(cfg, m, n, k, device, split, 16, RT_SMEM, max_cluster, cluster_only=True)
        if chosen is not None and (split == 1 or chosen[0].cluster > 1):
            return chosen
    return None


# x streamed (XS: a ring of XS_SLOTS chunks per K part filled by one warp of each part, cp.async or on natural-order
# tiles TMA, mbarriers) lets the two-tile launch take a column's whole K range (no split, no reduction) at any M:
# the staged x slice no longer has to fit. Taken on sm_90 for tiled weights at M = XS_MIN_M..16 where its first
# candidate fills at least XS_MIN_FILL of the SMs, at one token tile or for 8-bit weights; int4 at two token tiles
# only where each warp streams at least XS_MIN_CHUNKS chunks (the per-chunk ring handshake costs more than the
# staging below), and int4 on natural-order tiles (x by TMA, read with ldmatrix) at two token tiles wherever a
# candidate exists; e2m1 (NVFP4, MXFP4) at two token tiles stays staged (won or lost by < 1 us, its decode heavier).
# H100, streamed against staged: 8192^2 int4 M = 8 15.1 us against 16.3, int8 M = 16 26.1 against 28.4;
# 16384x8192 NVFP4 M = 8 31.3 against 42.1; int4 on natural-order tiles at M = 16: 4096x14336 17.1 against 20.3,
# 11008x4096 13.4 against 15.4. The TMA fill against 4-byte cp.async copies: 8192^2 int4 M = 16 15.1-15.4 against
# 17.8-18.1. Losses taken: MXFP8 at one token tile on 14336x4096 and 4096^2 (+0.5-1.1), wide int4 weights at one
# token tile (28672x8192 M = 8 +0.5); left out: launches of 86 CTAs (11008x4096 MXFP8 +1.2-1.4).
XS_SLOTS = 3  # ring slots (chunks) per K part
XS_MIN_M = 5
XS_MIN_FILL = 0.8
XS_MIN_CHUNKS = 8


@functools.lru_cache(maxsize=None)  # per call shape
def xs_default(spec: WeightSpec, m: int, n: int, k: int, capability: tuple[int, int], sms: int) -> bool:
    """Whether the default launch streams x (:func:`xs_launch`): tiled weights on sm_90 at M = XS_MIN_M..16
    where the first candidate fills the GPU (see XS_MIN_FILL); int4 on natural-order tiles (x by TMA) at two
    token tiles wherever there is a candidate."""
    if capability[0] != 9 or not spec.tiled or not XS_MIN_M <= m <= 16:
        return False
    bits, xnat = spec.dtype.bits, quant_math.tiles_natural(spec)
    cands = rt_candidates(m, n, k, bits, sms, xs=True, xnat=xnat)
    if cands and m > 8 and xnat and spec.dtype is QDtype.INT4:
        return True
    if not cands or cands[0][0] < XS_MIN_FILL * sms:
        return False
    if m <= 8 or bits == 8:
        return True
    return spec.dtype is QDtype.INT4 and k // KPC[bits] // cands[0][1] >= XS_MIN_CHUNKS


def xs_launch(base: MmaConfig, m: int, n: int, k: int, device: torch.device) -> tuple | None:
    """:func:`launch_plan` of the first candidate with x streamed (:func:`rt_candidates`); None if there is none."""
    cands = rt_candidates(m, n, k, base.bits, _sm_count(device), xs=True, xnat=base.xnat)
    if not cands:
        return None
    cfg = replace(base, warps=16, kw=cands[0][1], rt=2, minb=1, xstages=XS_SLOTS, xs=True)
    return launch_plan(cfg, m, n, k, device, cands[0][2], 16, RT_SMEM, MAX_CLUSTER)


def trig_default(tiled: bool, wgmma: bool, ws: bool, m: int, k: int) -> bool:
    """Early launch_dependents (TRIG): the next call's CTAs take the SMs this call's first finishers
    leave. Measured on an H100 over 7 shapes, each build with and without it: the mma.sync build on tiled
    weights 0-1.7 us faster at every shape and M measured; the warp-specialized build 0.3-4.5 us faster,
    except at K > 8192 with M > 16 (4096x14336 M = 32 / 64: 2-2.5 us slower, cause not found;
    8192x28672 M = 64 / 128 no better). After the main loop where it lost: canonical words in the
    mma.sync build (8192^2 NVFP4 M = 1: 31.7 vs 27.9) and the lock-step wgmma build (MXFP8 M = 32: 50.6
    vs 41.4)."""
    if ws:
        return not (m > 16 and k > 8192)
    return tiled and not wgmma


def _wide(n: int, sms: int) -> bool:
    """N gives most SMs a 16-warp column (256 rows) without a split."""
    return n >= 192 * sms


def ws_launch(m: int, n: int, sms: int, dtype: QDtype | None = None) -> tuple[int, int]:
    """(consumer warps per CTA, CTAs per SM) of the warp-specialized build, from H100 sweeps. 4-bit weights
    (and no ``dtype``): above M = 64, 2 warpgroups and one CTA per SM; otherwise 4 warpgroups (256 rows) when N
    gives most SMs a column without a split (N = 28672: up to 1.2x faster there), else one warpgroup and 2 CTAs
    per SM. 8-bit weights (4 shapes, M = 17..128): up to M = 64, 2 warpgroups on wide weights (see
    WS_WIDE_MIN_M_8BIT) and MXFP8 4 warpgroups elsewhere (8192^2 M = 64 44.2 us against 50.6 with one warpgroup);
    above, int8 one warpgroup and 2 CTAs per SM (8192^2 M = 96 30.9 against 33.8 with 2 warpgroups), MXFP8 2
    warpgroups (one warpgroup lost 2 of 8 cells there by 3-6 us)."""
    if dtype is not None and dtype.bits == 8:
        if m <= 64:
            return (8, 1) if _wide(n, sms) else (16, 1) if dtype is QDtype.FP8_E4M3 else (4, 2)
        if dtype is QDtype.INT8:
            return 4, 2
    if m > 64:
        return 8, 1
    if _wide(n, sms):
        return 16, 1
    return 4, 2


def max_m(spec: WeightSpec, capability: tuple[int, int]) -> int:
    """Largest M that the mma backend gives this kernel on a GPU of ``capability`` (bf16 or fp16 x)."""
    if capability[0] != 9:
        return MAX_M
    return SM90_MAX_M_INT4 if spec.dtype is QDtype.INT4 and not spec.tiled else WGMMA_MAX_M


# Up to this M (by weight type) the mma backend runs M above max_m on sm_90 as row blocks of max_m rows, one
# wgmma launch each (:func:`row_blocks`), before dequantize + F.linear takes over. H100, µs, blocks against the
# dequant fallback: 3 blocks (M = 384) won for every format at 8192^2 (int4 111 vs
# 134, NVFP4 128 vs 141, MXFP4 122 vs 133, int8 122 vs 142, MXFP8 138 vs 144); 4 blocks (M = 512) only for int4
# (149 vs 155; 28672x8192 467 vs 575), the others lost by 6-21 µs.
BLOCKED_MAX_M = {QDtype.INT4: 512, QDtype.FP4_E2M1: 384, QDtype.INT8: 384, QDtype.FP8_E4M3: 384}


def row_blocks(spec: WeightSpec, m: int, capability: tuple[int, int]) -> list[int] | None:
    """Row counts of the launches that run ``m`` rows above :func:`max_m` (sm_90, up to
    :data:`BLOCKED_MAX_M`): max_m rows each, the rest last (a launch's time grows slower than its rows: H100,
    8192^2 M = 136 as 128 + 8 rows int4 52.3 µs / MXFP8 76.8, as 72 + 64 55.3 / 114.3); None where one launch
    takes ``m`` or the dequant fallback should."""
    top = max_m(spec, capability)
    if m <= top or capability[0] != 9 or m > BLOCKED_MAX_M[spec.dtype]:
        return None
    return [top] * (m // top) + ([m % top] if m % top else [])


def wo_mma_blocked(x2: torch.Tensor, weight, scale, global_scale, zero_point, bias, spec: WeightSpec,
                   blocks: list[int]) -> torch.Tensor:
    """:func:`wo_mma` over consecutive row blocks of x2 (``blocks``: their row counts, :func:`row_blocks`),
    each launch writing its rows of one [M, N] output."""
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype, device=x2.device)
    r0 = 0
    for rows in blocks:
        wo_mma(x2[r0:r0 + rows], weight, scale, global_scale, zero_point, bias, spec, out=out[r0:r0 + rows])
        r0 += rows
    return out


def default_launch(base: MmaConfig, m: int, n: int, k: int, device: torch.device, split: int | None,
                   warps_per_sm: int, smem_budget: int, max_cluster: int, rt: bool = False) -> tuple:
    """:func:`launch_plan` of the mma.sync build on tiled weights with the launch left to ``wo_mma``
    (``base``: :data:`MMA_WARPS` warps, kw = 1), and the policy on top of it on sm_90: with ``rt``
    (:func:`rt_default`) two tiles per warp (:func:`rt_launch`) where a candidate's clusters fit; otherwise warps
    sharing tiles (:func:`mma_launch`) in place of a split reduced through global memory, or from
    :data:`KW_CLUSTER_MIN_M` in a cluster; the shared-tile launches and the remaining cluster plans
    compiled for the CTAs per SM they plan (:data:`REG_CAP_MAX_MT`). Cached per call shape: decided
    once, one lookup on later calls."""
    plan_args = (m, n, k, device, split, warps_per_sm, smem_budget, max_cluster)
    key = (base, m, n, k, _index(device), split, warps_per_sm, smem_budget, max_cluster, rt)
    if key not in _DEFAULTS:
        _DEFAULTS[key] = _default_launch(base, plan_args, rt)
    return _DEFAULTS[key]


_DEFAULTS: dict[tuple, tuple] = {}


def _default_launch(base: MmaConfig, plan_args: tuple, rt: bool) -> tuple:
    m, n, k, device, split, warps_per_sm, smem_budget, max_cluster = plan_args
    cap = _capability(_index(device))
    if base.xs and split is None:
        chosen = xs_launch(base, m, n, k, device)
        if chosen is not None:
            return chosen
    base = replace(base, xs=False)
    if rt and split is None:
        chosen = rt_launch(base, m, n, k, device, max_cluster)
        if chosen is not None:
            return chosen
    chosen = launch_plan(base, *plan_args)
    cfg, nsplit = chosen[0], chosen[3]
    cap_regs = cap[0] == 9 and base.mt <= REG_CAP_MAX_MT and base.minb == 1
    if nsplit > 1 and (cfg.cluster == 1 or m >= KW_CLUSTER_MIN_M):
        warps, kw, kw_split = mma_launch(m, n, k, base.bits, cap, _sm_count(device))
        if kw > 1:
            shared = replace(base, warps=warps, kw=kw, minb=warps_per_sm // warps if cap_regs else base.minb)
            return launch_plan(shared, m, n, k, device, kw_split, warps_per_sm, smem_budget, max_cluster)
    if cap_regs and cfg.cluster > 1:
        capped = launch_plan(replace(base, minb=warps_per_sm // base.warps), *plan_args)
        if capped[0].cluster > 1:
            return capped
    return chosen


def wgmma_launch(bits: int, m: int) -> tuple[int, int]:
    """(warps per CTA, warps per SM) of the wgmma build: 16 warps (4 warpgroups, 256 rows), one CTA
    per SM; for 4-bit weights above M = 64, where 16 warps spill, 8 warps (1.1-1.5x faster at
    M = 96..128 on an H100). 8-bit weights were faster with 16 warps at most
    measured shapes and M."""
    if bits == 4 and m > 64:
        return 8, 8
    return 16, 16


@dataclass(frozen=True)
class MmaConfig:
    """One compiled specialization (the #defines) plus its launch shape."""

    fmt: int
    sk: int
    smode: int
    group: int
    has_zp: bool
    zp_t: str
    has_gs: bool
    has_bias: bool
    mt: int
    stages: int = 4
    warps: int = 4
    packed: bool = False
    cluster: int = 1
    pdl: bool = False
    wgmma: bool = False  # sm_90a: warpgroup MMAs, x streamed per chunk through shared memory
    xstages: int = 4  # wgmma: x chunks in flight (cp.async staging ring)
    minb: int = 1  # CTAs per SM that the register allocation must allow (__launch_bounds__)
    ws: bool = False  # wgmma, warp-specialized: producer warps, mbarrier rings (`nstg` weight, `xstages` x slots)
    nstg: int = 8
    trig: bool = False  # PDL: the next kernel may launch from this one's start (else after the main loop)
    kw: int = 1  # mma.sync: warps per 16-row tile, splitting the CTA's K range (reduced in shared memory)
    rt: int = 1  # mma.sync: 16-row tiles per warp (group of kw warps), sharing each x fragment load
    xf16: bool = False  # fp16 x and output, else bf16
    xs: bool = False  # mma.sync, sm_90: x streamed through a ring of `xstages` chunks per K part, not staged first

    @property
    def bits(self) -> int:
        return 4 if self.fmt in (0, 1) else 8

    @property
    def xnat(self) -> bool:
        """Tiled words in natural-x order (wo_mma.cu: XNAT; quant_math.tiles_natural): one scale per chunk."""
        return self.packed and (self.smode == SMODE_END or self.group >= KPC[self.bits])

    @property
    def threads(self) -> int:
        return 32 * self.warps + (64 if self.ws else 0)

    @property
    def tiles(self) -> int:
        """16-row tiles per CTA."""
        return self.warps // self.kw * self.rt

    def defines(self) -> str:
        d = dict(FMT=self.fmt, SK=self.sk, SMODE=self.smode, GROUP=max(self.group, 1), HAS_ZP=int(self.has_zp),
                 ZP_T=self.zp_t, HAS_GS=int(self.has_gs), HAS_BIAS=int(self.has_bias), MT=self.mt,
                 STAGES=self.stages, WARPS=self.warps, PACKED=int(self.packed), CLUSTER=self.cluster,
                 PDL=int(self.pdl), WGMMA=int(self.wgmma), XSTAGES=self.xstages,
                 MINB=self.minb, WS=int(self.ws), NSTG=self.nstg, TRIG=int(self.trig), KW=self.kw,
                 RT=self.rt, XF16=int(self.xf16), XS=int(self.xs))
        return "".join(f"#define {k} {v}\n" for k, v in d.items())


def chunk_k(spec: WeightSpec) -> int:
    return KPC[spec.dtype.bits]


def scale_mode(spec: WeightSpec, wgmma: bool = False) -> tuple[int, int]:
    """(scale mode, group): row scales in the epilogue; groups that cover a chunk after each
    chunk's MMA (the wgmma build has no per-chunk fp32 step: multiplied into the decoded weights,
    like smaller groups)."""
    gran = spec.scale.granularity
    if gran in (Granularity.TENSOR, Granularity.CHANNEL):
        return SMODE_END, 0
    g = spec.scale.group_size
    return (SMODE_CHUNK if g >= chunk_k(spec) and not wgmma else SMODE_PRE), g


def mma_reason(spec: WeightSpec, n: int, k: int, x_dtype: torch.dtype = torch.bfloat16,
               zp_dtype: torch.dtype | None = None) -> str | None:
    """None when the kernel runs this weight for x of ``x_dtype`` (any M <= :func:`max_m`), else why not."""
    if (spec.dtype, spec.packing) not in FMT:
        return f"{spec.dtype.value} weights packed as {spec.packing.value}"
    if x_dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x_dtype}, the kernel takes bf16 or fp16"
    if x_dtype == torch.float16 and spec.scale.dtype is ScaleDtype.E8M0:
        return "x is torch.float16 and the scales are e8m0 (MX), beyond fp16's range: the kernel takes bf16 x for them"
    if spec.act_order:
        return "act-order (g_idx) weights"
    if spec.scale.granularity not in (Granularity.TENSOR, Granularity.CHANNEL, Granularity.GROUP):
        return f"scales per {spec.scale.granularity.value}"
    kc = chunk_k(spec)
    if n % 16 or k % kc:
        return f"[N, K] = [{n}, {k}]: N must be a multiple of 16 and K of {kc}"
    if spec.scale.granularity is Granularity.GROUP:
        g = spec.scale.group_size
        if g < 16 or g & (g - 1) or k % g:
            return f"group size {g} (a power of two >= 16 dividing K expected)"
        if spec.dtype is QDtype.FP8_E4M3 and spec.scale.dtype is not ScaleDtype.E8M0:
            return "fp8 weights with fp32 scales belong to qcompile::fp8_linear"
    if zp_dtype is not None and zp_dtype not in ZP_TYPES:
        return f"zero points of dtype {zp_dtype}"
    return None


# -- NVRTC -----------------------------------------------------------------------------------------

def _nvrtc() -> ctypes.CDLL:
    path = os.environ.get("QCOMPILE_NVRTC")
    if path:
        return ctypes.CDLL(path)
    from torch.cuda._utils import _get_gpu_rtc_library

    return _get_gpu_rtc_library()


def compile_cubin(src: str, arch: str, name: str = "wo_mma", extra: tuple[str, ...] = ()) -> bytes:
    """NVRTC ``src`` for ``sm_<arch>``; the cubin. Compilation errors raise with NVRTC's log."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what} failed: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", *extra]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if rc != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC compilation of {name} failed:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
    buf = ctypes.create_string_buffer(size.value)
    check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def _wgmma_k16(n: int, f16: bool = False) -> str:
    """``wgmma_k16`` for ``n`` tokens: one m64 x n x k16 wgmma (bf16 in, or fp16 with ``f16``; fp32
    accumulators d[n / 2] in the mma.sync fragment order), A from registers, B through a shared-memory
    descriptor. The operand list depends on n, so it is generated."""
    t = "f16" if f16 else "bf16"
    nd = n // 2
    d = ",".join(f"%{i}" for i in range(nd))
    a = ",".join(f"%{nd + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    asm = (f"{{ .reg .pred p; setp.ne.b32 p, 1, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} "
           f"{{{d}}}, {{{a}}}, %{nd + 4}, p, 1, 1, 0; }}")
    return ("__device__ __forceinline__ void wgmma_k16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, "
            f"unsigned long long desc) {{\n  asm volatile(\"{asm}\" : {outs} : \"r\"(a0), \"r\"(a1), \"r\"(a2), "
            f"\"r\"(a3), \"l\"(desc));\n}}\n")


def source(cfg: MmaConfig) -> str:
    src = SOURCE.read_text()
    if cfg.wgmma:  # after the typedefs
        head, sep, rest = src.partition("#define FMT_INT4")
        src = head + _wgmma_k16(8 * cfg.mt, cfg.xf16) + sep + rest
    return cfg.defines() + src


def arch_of(cfg: MmaConfig, major: int, minor: int) -> str:
    """NVRTC's architecture: wgmma needs the architecture-specific sm_90a."""
    return f"{major}{minor}" + ("a" if cfg.wgmma else "")


_KERNELS: dict[tuple, object] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _kernel(cfg: MmaConfig, device: torch.device, name: str = "wo_mma"):
    """The compiled ``name`` of ``cfg`` (``wo_mma``, or the warp-specialized build's ``x_prep``)."""
    idx = _index(device)
    key = (cfg, idx)
    if key not in _KERNELS:
        from torch.cuda._utils import _cuda_load_module

        major, minor = _capability(idx)
        names = ["wo_mma", "x_prep"] if cfg.ws else ["wo_mma"]
        with torch.cuda.device(idx):
            cubin = compile_cubin(source(cfg), arch_of(cfg, major, minor))
            _KERNELS[key] = _cuda_load_module(cubin, names)
    return _KERNELS[key][name]


# -- launch ----------------------------------------------------------------------------------------

_COUNTERS: dict[tuple[int, int], tuple[ctypes.c_void_p, int]] = {}  # (device, stream) -> (pointer, ints)
_SPARE: dict[int, tuple[ctypes.c_void_p, int]] = {}  # device -> a zeroed buffer for the next capture stream
_SMS: dict[int, int] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor | ctypes.c_void_p:
    """Zeroed int32 counters, one per CTA column; each launch leaves them zero again.

    One buffer per (device, stream): launches on two streams may run at the same time and must not
    count each other's CTAs. Cached buffers come from cuMemAlloc, outside PyTorch's caching
    allocator: while torch.compile's cudagraph trees warm up, every allocation of the thread goes to
    the graphs' memory pool, which must not keep a tensor that outlives its graphs. No buffer can be
    allocated and zeroed while a stream is captured, so each allocation outside a capture sets a spare
    one aside, which the first capture on a stream without a buffer takes (graphs are usually captured
    on a stream that never runs eagerly). Without it the call gets its own zeroed tensor, and the graph
    replays that memset before every launch: 2-3.5 us per call on an H100 (a memset node, and the
    programmatic dependent launch of the next kernel lost). Graphs captured on one stream and replayed
    at the same time on two streams still share their buffer."""
    idx = _index(device)
    key = (idx, torch.cuda.current_stream(device).cuda_stream)
    have = _COUNTERS.get(key)
    if have is not None and have[1] >= n:
        return have[0]
    if torch.cuda.is_current_stream_capturing():
        spare = _SPARE.get(idx)
        if have is None and spare is not None and spare[1] >= n:
            _COUNTERS[key] = _SPARE.pop(idx)
            return spare[0]
        return torch.zeros(n, dtype=torch.int32, device=device)
    size = max(n, 16384)
    _COUNTERS[key] = _zeroed(idx, size, have)
    spare = _SPARE.get(idx)
    if spare is None or spare[1] < size:
        _SPARE[idx] = _zeroed(idx, size, spare)
    return _COUNTERS[key][0]


def _zeroed(idx: int, size: int, old: tuple[ctypes.c_void_p, int] | None) -> tuple[ctypes.c_void_p, int]:
    """A zeroed cuMemAlloc buffer of ``size`` int32 on device ``idx``, in place of ``old`` (freed)."""
    from torch.cuda._utils import _get_gpu_runtime_library

    lib, ptr = _get_gpu_runtime_library(), ctypes.c_void_p()

    def check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"wo_mma: {what} failed with CUresult {code} (split-K counters, {4 * size} bytes)")

    with torch.cuda.device(idx):
        check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4 * size)), "cuMemAlloc")
        check(lib.cuMemsetD32_v2(ptr, ctypes.c_uint(0), ctypes.c_size_t(size)), "cuMemsetD32")
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")  # the zeros, and a replaced buffer's last launch
        if old is not None:
            check(lib.cuMemFree_v2(old[0]), "cuMemFree")
    return ptr, size


def _sm_count(device: torch.device) -> int:
    idx = _index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


# (stages, warps per SM) by layout, MMA_WARPS warps per CTA: the fastest on the H100 at N=K=8192 and
# N=28672, K=8192 for M = 1..32 (benchmarks/bench_wo_linear.py --mma-sweep).
LAUNCH = {True: (2, 32), False: (2, 16)}
MMA_WARPS = 8


def x_row_stride(chunks: int, bits: int) -> int:
    """Bytes per x row in shared memory (wo_mma.cu: x_row_stride)."""
    u = chunks * (256 + 16 if bits == 4 else 128) // 16
    mod = 2 if bits == 4 else 1
    return (u + (mod - u % 8 + 8) % 8) * 16


def x_bytes(m: int, chunks: int, bits: int, wgmma: bool = False, xstages: int = 4, xs_parts: int = 0,
            xnat: bool = False) -> int:
    """Shared memory for the x rows of ``chunks`` chunks; wgmma: two B buffers and ``xstages``
    staging slots of one chunk each (whole 8-token groups), whatever the K range; ``xs_parts`` (the
    mma.sync build with x streamed): a ring of ``xstages`` chunks for each of that many K parts (``xnat``:
    whole 8-token groups as TMA writes them, from a 1024-byte aligned base)."""
    if xs_parts:
        slot = -(-m // 8) * 8 * KPC[bits] * 2 if xnat else m * x_row_stride(1, bits)
        return xs_parts * xstages * slot + 1024 * xnat
    if wgmma:
        rows = -(-m // 8) * 8
        return 2 * rows * KPC[bits] * 2 + xstages * rows * (KPC[bits] * 2 + 16)
    return m * x_row_stride(chunks, bits)


def plan(m: int, n: int, k: int, bits: int, warps: int, stages: int, sms: int, split: int | None = None,
         warps_per_sm: int = 16, smem_budget: int = SMEM_BUDGET, wgmma: bool = False,
         kw: int = 1, rt: int = 1) -> tuple[int, int, int]:
    """(CTA columns, split, chunks per split): about ``warps_per_sm`` warps per SM, each streaming
    at least ``stages`` chunks, and the CTA's x slice within ``smem_budget`` bytes. ``kw`` warps share
    each 16-row tile; each (group of ``kw``) owns ``rt`` tiles."""
    cols = -(-(n // 16) // (warps // kw * rt))
    nch = k // KPC[bits]
    if split is None:
        split = max(1, min(round(warps_per_sm * sms / (cols * warps)), nch // stages))
        while not wgmma and split < nch and x_bytes(m, -(-nch // split), bits) > smem_budget:
            split += 1
    cps = -(-nch // split)
    return cols, -(-nch // cps), cps


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL: dict[int, bool] = {}
_CAP: dict[int, tuple[int, int]] = {}


def _capability(idx: int) -> tuple[int, int]:
    if idx not in _CAP:
        _CAP[idx] = torch.cuda.get_device_capability(idx)
    return _CAP[idx]


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device`` (queried once per process)."""
    return _capability(_index(device))


def wgmma_default(m: int, capability: tuple[int, int]) -> bool:
    """The wgmma build from M = WGMMA_MIN_M on sm_90 (wgmma is Hopper's: sm_90a only)."""
    return capability[0] == 9 and m >= WGMMA_MIN_M


def _pdl_default(device: torch.device) -> bool:
    """Programmatic dependent launch: sm_90+ (griddepcontrol), unless QCOMPILE_PDL=0."""
    idx = _index(device)
    if idx not in _PDL:
        _PDL[idx] = (_capability(idx)[0] >= 9
                     and os.environ.get("QCOMPILE_PDL", "1") != "0")
    return _PDL[idx]


_TENSOR_MAP_U16, _SWIZZLE_128B, _L2_PROMOTION_256B = 1, 3, 3  # CUtensorMapDataType / Swizzle / L2promotion


def _x_tensor_map(x2: torch.Tensor, rows: int) -> ctypes.Array:
    """The warp-specialized build's tensor map of x [M, K] (16-bit, 16-byte aligned) on natural-order tiles: boxes
    of 64 k x ``rows`` tokens, 128-byte swizzled, which is wgmma's K-major B layout (wo_mma.cu: tma_load_x); tokens
    from M on read as zeros. 128 bytes (a CUtensorMap), passed to the kernel by value."""
    from torch.cuda._utils import _get_gpu_runtime_library

    m, k = x2.shape
    tmap = (ctypes.c_uint64 * 16)()
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = _get_gpu_runtime_library().cuTensorMapEncodeTiled(
        ctypes.byref(tmap), _TENSOR_MAP_U16, u32(2), ctypes.c_void_p(x2.data_ptr()), (u64 * 2)(k, m), (u64 * 1)(2 * k),
        (u32 * 2)(64, rows), (u32 * 2)(1, 1), 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise RuntimeError(f"wo_mma: cuTensorMapEncodeTiled failed with CUresult {rc} (x {list(x2.shape)}, "
                           f"box 64 x {rows})")
    return tmap


def _launch(kern, grid, block, smem: int, pdl: bool, args: list) -> None:
    """cuLaunchKernelEx on the current stream of the first tensor's device. With ``pdl`` the launch
    may begin while the previous kernel of the stream finishes (programmatic stream serialization);
    the kernel waits for it (griddepcontrol.wait) before it reads x or writes anything, so only its
    weight loads overlap. Tensors (and ctypes pointers) are passed as pointers, ints as int32, ctypes arrays
    (a tensor map) by value."""
    from torch.cuda._utils import _get_gpu_runtime_library

    held = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
            else a if isinstance(a, (ctypes.c_void_p, ctypes.Array)) else ctypes.c_int(a) for a in args]
    ptrs = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    attr = _LaunchAttr(_PROGRAMMATIC_STREAM_SERIALIZATION, 0, (ctypes.c_int * 16)(1))
    stream = torch.cuda.current_stream(args[0].device)
    conf = _LaunchConfig(grid, block, smem, stream._as_parameter_,
                         ctypes.cast(ctypes.byref(attr), ctypes.c_void_p) if pdl else None, 1 if pdl else 0)
    rc = _get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(conf), kern.func, ptrs, None)
    if rc != 0:
        raise RuntimeError(f"wo_mma: cuLaunchKernelEx failed with CUresult {rc}")


def _max_active_clusters(kern, cfg: MmaConfig, smem: int) -> int:
    """How many clusters of ``cfg.cluster`` CTAs the GPU holds at once (cuOccupancyMaxActiveClusters;
    the kernel's cluster shape is compiled in); 0 if the driver cannot say."""
    from torch.cuda._utils import _get_gpu_runtime_library

    conf = _LaunchConfig((1, cfg.cluster, 1), (cfg.threads, 1, 1), smem, None, None, 0)
    n = ctypes.c_int(0)
    rc = _get_gpu_runtime_library().cuOccupancyMaxActiveClusters(ctypes.byref(n), kern.func, ctypes.byref(conf))
    return n.value if rc == 0 else 0


def _smem(m: int, cps: int, cfg: MmaConfig) -> int:
    if cfg.ws:  # the rings: slots of one chunk of every consumer warp's 16 rows, and of x (xnat: 1024-byte aligned)
        smem = cfg.nstg * cfg.warps * 1024 + cfg.xstages * cfg.mt * 8 * KPC[cfg.bits] * 2 + 1024 * cfg.xnat
    else:
        smem = x_bytes(m, cps, cfg.bits, cfg.wgmma, cfg.xstages, cfg.kw if cfg.xs else 0, cfg.xnat)
    if cfg.kw > 1:  # the other warps' partials of each tile reuse x's shared memory
        smem = max(smem, (cfg.warps - cfg.warps // cfg.kw) * cfg.rt * cfg.mt * 512)
    if cfg.cluster > 1:  # the partials reuse x's shared memory: [M][tile rows] fp32
        smem = max(smem, m * cfg.tiles * 16 * 4)
    if cfg.xs:  # then the ring's full and empty mbarriers (wo_mma.cu: xs_bar_offset)
        smem = -(-smem // 16) * 16 + 16 * cfg.kw * cfg.xstages
    return smem


def _prepare(kern, smem: int):
    if smem > kern._max_shared_mem_bytes:
        kern.set_shared_memory_config(max(smem, 48 * 1024))
    return kern


_PLANS: dict[tuple, tuple] = {}


def _blocks_per_sm(kern, cfg: MmaConfig, smem: int) -> int:
    """CTAs of ``kern`` one SM holds at once (cuOccupancyMaxActiveBlocksPerMultiprocessor); 0 if the
    driver cannot say."""
    from torch.cuda._utils import _get_gpu_runtime_library

    n = ctypes.c_int(0)
    rc = _get_gpu_runtime_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), kern.func, cfg.threads, ctypes.c_size_t(smem))
    return n.value if rc == 0 else 0


def launch_plan(base: MmaConfig, m: int, n: int, k: int, device: torch.device, split: int | None,
                warps_per_sm: int, smem_budget: int, max_cluster: int, cluster_only: bool = False) -> tuple | None:
    """(config, kernel, CTA columns, split, chunks per split, shared memory) for one call shape.

    M < :data:`CLUSTER_SHRINK_MIN_M`: the split is capped so that every CTA runs in one wave,
    and that split is reduced in a thread-block cluster (sm_90+) when all of its clusters fit on the
    GPU at once, else through global memory (cheap at this M: a few partials per output).
    Larger M: the split is shrunk until its clusters fit (x still within ``smem_budget``), as the
    global reduction's tail grows with M. A forced ``split`` is kept either way. ``cluster_only``: None
    (and no kernel compiled for it) where the plan would reduce through global memory."""
    idx = _index(device)
    key = (base, m, n, k, idx, split, warps_per_sm, smem_budget, max_cluster)
    if key in _PLANS:
        return _PLANS[key]
    bits, nch, sms = base.bits, k // KPC[base.bits], _sm_count(device)
    wg = base.wgmma or base.xs  # (the builds that stream x: no slice to fit)
    cols, nsplit, cps = plan(m, n, k, bits, base.warps, base.stages, sms, split, warps_per_sm, smem_budget, wg,
                             base.kw, base.rt)
    shrink = m >= CLUSTER_SHRINK_MIN_M
    glob = replace(base, cluster=1)

    def x_fits(chunks: int, limit: int) -> bool:  # the mma.sync build's x slice, unless streamed
        return wg or x_bytes(m, chunks, bits) <= limit

    if split is None and not shrink:  # one wave
        while nsplit > 1:
            smem = _smem(m, cps, glob)
            per_sm = _blocks_per_sm(_prepare(_kernel(glob, device), smem), glob, smem)
            if per_sm == 0 or cols * nsplit <= per_sm * sms:  # unknown occupancy: keep the split
                break
            c = -(-nch // (nsplit - 1))
            if not x_fits(c, smem_budget):
                break
            cps, nsplit = c, -(-nch // c)
    chosen = None
    if _capability(idx)[0] >= 9:
        limit, s = max(smem_budget, x_bytes(m, cps, bits)), nsplit
        while 1 < s <= max_cluster:
            c = -(-nch // s)
            s = -(-nch // c)
            if not x_fits(c, limit):
                break
            cfg = replace(base, cluster=s)
            smem = _smem(m, c, cfg)
            kern = _prepare(_kernel(cfg, device), smem)
            if _max_active_clusters(kern, cfg, smem) >= cols:
                chosen = (cfg, kern, cols, s, c, smem)
                break
            if split is not None or not shrink:  # kept, reduced through global memory
                break
            s -= 1
    if chosen is None:
        if cluster_only and nsplit > 1:
            return None
        smem = _smem(m, cps, glob)
        chosen = (glob, _prepare(_kernel(glob, device), smem), cols, nsplit, cps, smem)
    _PLANS[key] = chosen
    return chosen


def wo_mma(x2: torch.Tensor, weight, scale, global_scale, zero_point, bias, spec: WeightSpec,
           stages: int | None = None, warps: int | None = None, split: int | None = None,
           warps_per_sm: int | None = None, smem_budget: int = SMEM_BUDGET,
           max_cluster: int = MAX_CLUSTER, pdl: bool | None = None, wgmma: bool | None = None,
           xstages: int | None = None, minb: int = 1, ws: bool | None = None, nstg: int = 8,
           trig: bool | None = None, kw: int | None = None, rt: int = 1, xs: bool | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] contiguous bf16 or fp16 (M <= :func:`max_m`) -> [M, N] of x2's dtype. Checks are the caller's
    (:func:`mma_reason`); the tensors are the op's canonical ones, the weight tiled when
    ``spec.tiled`` (quant_math.tile_words). Launch defaults: :data:`LAUNCH` (8 warps per CTA), or
    :func:`wgmma_launch` for the wgmma build (default: :func:`wgmma_default`); splits up to
    ``max_cluster`` are reduced in a thread-block cluster (sm_90+), more through global memory
    (:func:`launch_plan`). ``pdl``: programmatic dependent launch (default: sm_90+ unless
    ``QCOMPILE_PDL=0``). ``xstages`` / ``minb``: x chunks in flight and CTAs per SM (wgmma).
    ``ws``: the warp-specialized wgmma build (default: :func:`ws_default`; tiled weights; ``warps``
    consumer warps plus two producers, ``nstg`` weight and ``xstages`` x slots; launch:
    :func:`ws_launch`, another ``warps`` one CTA per SM unless ``warps_per_sm`` says; x loaded by TMA from x
    itself on natural-order tiles (quant_math.tiles_natural), else rearranged first by the ``x_prep`` kernel).
    ``trig``: with PDL, let the next kernel launch from this one's start (default: :func:`trig_default`).
    ``kw``: mma.sync build, warps sharing each 16-row tile (default 1; for tiled weights with the launch left
    to it, :func:`default_launch` decides). ``rt``: mma.sync build, 16-row tiles per warp (or per ``kw`` warps).
    ``out``: a contiguous [M, N] tensor of x2's dtype to write (a row block of a larger output)."""
    packed = spec.tiled
    if pdl is None:
        pdl = _pdl_default(x2.device)
    cap = _capability(_index(x2.device))
    m, k = x2.shape
    n, sms = weight.shape[0], _sm_count(x2.device)
    xf16 = x2.dtype == torch.float16
    mma_sync = (kw or 1) > 1 or rt > 1 or bool(xs)  # kw / rt / xs ask for the mma.sync build
    if ws is None:  # a caller's wgmma=True / False asks for that build
        ws = wgmma is None and ws_default(spec, m, n, k, cap, sms) and not mma_sync
    if wgmma is None and not ws:
        wgmma = wgmma_default(m, cap) and not mma_sync
    if ws:
        if not packed or cap[0] != 9 or m > WGMMA_MAX_M:
            raise ValueError(f"wo_mma: the warp-specialized build streams tiled weights on an sm_90 GPU, M <= "
                             f"{WGMMA_MAX_M}; have tiled={packed}, sm_{cap[0]}{cap[1]}, M = {m}")
        d_warps, d_per_sm = ws_launch(m, n, sms, spec.dtype)
        if warps and warps != d_warps:  # a caller's CTA size: one CTA per SM (its registers always suffice)
            d_per_sm = 1
        warps = warps or d_warps
        if warps_per_sm is None:
            warps_per_sm, minb = d_per_sm * warps, max(minb, d_per_sm)
        wgmma, xstages = True, xstages or (3 if warps >= 16 else 4)
    elif wgmma:
        if cap[0] != 9 or m > WGMMA_MAX_M:
            raise ValueError(f"wo_mma: the wgmma build needs an sm_90 GPU and M <= {WGMMA_MAX_M}, "
                             f"have sm_{cap[0]}{cap[1]} and M = {m}")
        d_warps, d_wps = wgmma_launch(spec.dtype.bits, m)
        warps, warps_per_sm = warps or d_warps, warps_per_sm or d_wps
    elif m > MAX_M:
        raise ValueError(f"wo_mma: the mma.sync build takes M <= {MAX_M}, have M = {m}")
    # the mma.sync launch left to wo_mma on tiled weights
    auto = kw is None and rt == 1 and packed and not wgmma and not (warps or stages or warps_per_sm or split)
    if xs is None:
        xs = auto and xs_default(spec, m, n, k, cap, sms)
    kw, warps = kw or 1, warps or MMA_WARPS
    if kw > 1 and (wgmma or warps % kw):
        raise ValueError(f"wo_mma: kw={kw} (warps sharing a tile) takes the mma.sync build with warps a multiple "
                         f"of it, have wgmma={wgmma}, warps={warps}")
    if rt > 1 and wgmma:
        raise ValueError(f"wo_mma: rt={rt} (tiles per warp) takes the mma.sync build, have wgmma=True")
    if xs and (wgmma or cap[0] != 9 or (xstages or 2) < 2):
        raise ValueError(f"wo_mma: xs=True (x streamed) takes the mma.sync build on an sm_90 GPU and xstages >= 2 "
                         f"ring slots, have wgmma={wgmma}, sm_{cap[0]}{cap[1]}, xstages={xstages}")
    xstages = xstages or 4
    d_stages, d_wps = LAUNCH[packed]
    stages, warps_per_sm = stages or d_stages, warps_per_sm or d_wps
    mt = -(-m // 8)
    if trig is None:
        trig = trig_default(packed, wgmma, ws, m, k)
    smode, group = scale_mode(spec, wgmma)
    zp_t = ZP_TYPES[zero_point.dtype] if zero_point is not None else "int"
    base = MmaConfig(FMT[(spec.dtype, spec.packing)], SK[spec.scale.dtype], smode, group, zero_point is not None,
                     zp_t, global_scale is not None, bias is not None, mt, stages, warps, packed, pdl=pdl,
                     wgmma=wgmma, xstages=xstages, minb=minb, ws=ws, nstg=nstg, trig=trig, kw=kw, rt=rt, xf16=xf16, xs=xs)
    plan_args = (m, n, k, x2.device, split, warps_per_sm, smem_budget, max_cluster)
    if auto:
        cfg, kern, cols, nsplit, cps, smem = default_launch(base, *plan_args, rt=rt_default(spec, m, n, k, cap, sms))
    else:
        cfg, kern, cols, nsplit, cps, smem = launch_plan(base, *plan_args)
    gran = spec.scale.granularity
    s = scale.contiguous()
    if s.dtype != torch.float32:
        s = s.view(torch.uint8)
    ss = 0 if gran is Granularity.TENSOR else (1 if gran is Granularity.CHANNEL else s.shape[-1])
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    if out is None:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    elif out.shape != (m, n) or out.dtype != x2.dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"wo_mma: out must be a contiguous, 16-byte aligned {x2.dtype} [{m}, {n}] tensor, have "
                         f"{out.dtype} {list(out.shape)}")
    global_split = nsplit > 1 and cfg.cluster == 1
    part = torch.empty((nsplit, m, n), dtype=torch.float32, device=x2.device) if global_split else out
    counters = _counters(x2.device, cols) if global_split else out
    w = weight.contiguous().view(torch.int32)
    dummy = out
    tail = []
    if (ws or cfg.xs) and cfg.xnat:  # x loaded as it is by TMA (wo_mma.cu: XNAT)
        tail = [_x_tensor_map(x2, mt * 8)]
    elif ws:  # x as the B operand, chunk by chunk (wo_mma.cu: x_prep)
        kpc = KPC[cfg.bits]
        xp = torch.empty((k // kpc) * mt * 8 * kpc, dtype=x2.dtype, device=x2.device)
        tasks = (k // kpc) * mt * 8 * (kpc // 32)
        _launch(_kernel(cfg, x2.device, "x_prep"), (-(-tasks // 256), 1, 1), (256, 1, 1), 0, cfg.pdl,
                [x2, xp, m, k])
        x2 = xp
    _launch(kern, (cols, nsplit, 1), (cfg.threads, 1, 1), smem, cfg.pdl,
            [x2, w, s, zero_point.contiguous() if zero_point is not None else dummy,
             global_scale.float().reshape(1) if global_scale is not None else dummy,
             bias.to(x2.dtype).contiguous() if bias is not None else dummy,
             out, part, counters, m, n, k, ss, cps, *tail])
    return out
