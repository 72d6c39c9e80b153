"""The launch policy of the ``wo_mma`` kernel: (format, N, K, M, x dtype, GPU) -> :class:`MmaLaunch`.

Pure functions of the call shape and a :class:`Gpu` (its compute capability, SM count and the driver's
occupancy answers for a compiled specialization); :func:`choose` is the one entry point, :func:`mma_rows`
says which M the kernel takes at all. The kernel's builds (wo_mma.cu explains them):

* mma.sync (any sm_80+ GPU, M <= :data:`MAX_M`): one warp per 16 weight rows, x staged in shared memory
  for the CTA's K range, split-K reduced in a thread-block cluster (sm_90, :func:`launch_plan`) or
  through global memory. On sm_90 with tiled weights the launch is refined (:func:`default_launch`):
  warps sharing a tile (:func:`tile_sharing`), two tiles per warp (:func:`rt_default`), x streamed
  through a ring (:func:`xs_default`).
* wgmma, lock-step (sm_90, M = :data:`WGMMA_MIN_M`..:data:`WGMMA_MAX_M`): warpgroup MMAs, x streamed
  per chunk (:func:`wgmma_launch`).
* wgmma, warp-specialized (sm_90, tiled weights, :func:`ws_default`): producer warps fill mbarrier
  rings (:func:`ws_launch`).

The thresholds are where one build overtook the other in sweeps over real (N, K) on an H100;
``benchmarks/tune_wo.py`` measures the alternatives per shape on the running GPU (:mod:`wo_tune`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Protocol

from ..scheme import Granularity, Packing, QDtype, ScaleDtype, WeightSpec
from . import quant_math

FMT = {(QDtype.INT4, Packing.INT32): 0, (QDtype.FP4_E2M1, Packing.UINT8): 1, (QDtype.INT8, Packing.INT32): 2,
       (QDtype.INT8, Packing.NONE): 3, (QDtype.FP8_E4M3, Packing.NONE): 4}
SK = {ScaleDtype.FP32: 0, ScaleDtype.FP8_E4M3: 1, ScaleDtype.E8M0: 2}
SMODE_END, SMODE_CHUNK, SMODE_PRE = 0, 1, 2
KPC = quant_math.TILE_K  # k per chunk (one 16-byte load per lane per row), by weight bits

MAX_M = 32  # the mma.sync build: 4 token tiles of 8
SMEM_BUDGET = 96 * 1024  # x slice per CTA of the mma.sync build; split-K grows until it fits
MAX_CLUSTER = 8  # splits reduced inside one thread-block cluster (the portable maximum), sm_90+
SM90_SMEM_PER_SM = 228 * 1024
SM90_SMEM_PER_CTA = 227 * 1024  # dynamic shared memory one CTA may use on sm_90
GROUPED_MMA_MAX_M = 16  # pair slots per block of the grouped mma.sync build; above, the warp-specialized build
# (stages, warps per SM) of the mma.sync build by layout (tiled or not), MMA_WARPS warps per CTA
LAUNCH = {True: (2, 32), False: (2, 16)}
MMA_WARPS = 8
# From this M a split shrinks until its clusters fit: the global reduction's tail grows with M.
CLUSTER_SHRINK_MIN_M = 5
WGMMA_MIN_M = 25  # the lock-step wgmma build from here (sm_90)
WGMMA_MAX_M = 128  # 16 token tiles (m64 n128 k16)
# sm_90, int4 weights not tiled: the lock-step wgmma build loses to dequantize + F.linear above this M.
SM90_MAX_M_INT4 = 96
# The warp-specialized build on tiled weights from this M by weight type: below, its per-chunk barriers cost
# more than the work; 8-bit weights take it where the lock-step build's next token tile makes it jump.
WS_MIN_M = {QDtype.INT4: 12, QDtype.FP4_E2M1: 12, QDtype.INT8: 57, QDtype.FP8_E4M3: 49}
WS_WIDE_MIN_M_8BIT = 17  # 8-bit weights wide enough for one column per SM (_wide) take it from here
# sm_90: above max_m, up to this M the kernel runs as row blocks of max_m rows before dequantize + F.linear wins.
BLOCKED_MAX_M = {QDtype.INT4: 512, QDtype.FP4_E2M1: 384, QDtype.INT8: 384, QDtype.FP8_E4M3: 384}
# Warps sharing a 16-row tile (tile_sharing) replace a split reduced across CTAs while the split stays
# <= KW_MAX_SPLIT, the CTAs fit in one wave and the x staged per SM stays within KW_X_SHARE of the weight bytes
# it streams; without a split, while each warp streams at most KW_CHUNK_GROWTH times its chunks unshared.
KW_MAX_SPLIT = 2
KW_X_SHARE = 0.9
KW_CHUNK_GROWTH = 1.3
KW_CLUSTER_MIN_M = 5  # from this M tile sharing also replaces a split reduced in a cluster
# Up to this many token tiles, shared-tile and cluster launches on sm_90 are compiled for the CTAs per SM
# they plan (__launch_bounds__); from 3 tiles that cap spills registers.
REG_CAP_MAX_MT = 2
# Two tiles per warp (rt = 2): 16 warps and 128 registers, one CTA per SM, whose x slice may take most of
# the SM's shared memory.
RT_SMEM = 200 * 1024
RT_MT = 2  # token tiles of the two-tile launch (from 3, 128 registers do not hold it)
RT_WIDE_MIN_M = 6  # at one token tile, wide weights take it from here
# x streamed (xs): a ring of XS_SLOTS chunks per K part, so the two-tile launch needs no split at any M.
XS_SLOTS = 3
XS_MIN_M = 5
XS_MAX_M = 16  # (x streamed: up to two token tiles)
# Where no tile sharing fits, x streamed rather than a split reduced in global memory, from this M by format
# (XS_MIN_M for the others): below it the global reduction measured faster on an H200.
XS_GLOBAL_MIN_M = {FMT[QDtype.INT4, Packing.INT32]: 3, FMT[QDtype.FP8_E4M3, Packing.NONE]: 8}
XS_MIN_FILL = 0.8  # ... where its first candidate fills this share of the SMs
XS_MIN_CHUNKS = 8  # int4 at two token tiles: where each warp streams this many chunks (the ring's handshake)


class Gpu(Protocol):
    """What the policy asks of a GPU: capability and SM count, and the driver's occupancy of a compiled
    specialization (which compiles it). Hashable; decisions are cached per GPU object."""

    capability: tuple[int, int]
    sms: int

    def blocks_per_sm(self, cfg: MmaConfig, smem: int) -> int: ...

    def max_active_clusters(self, cfg: MmaConfig, smem: int) -> int: ...


@dataclass(frozen=True)
class MmaConfig:
    """One compiled specialization of wo_mma.cu (its #defines) plus its CTA shape."""

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
    grouped: bool = False  # an MoE layer's routed experts, one token-sort block per grid z (mma.sync x staged, or ws)
    gact: int = 0  # grouped: the gated activation fused (moe_wo.ACT_CODES: the gate tiles and the up tiles in a CTA)
    xpad: bool = False  # grouped: x's rows narrower than K (a tiled weight's K padded to whole chunks), zeros past them

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


@dataclass(frozen=True)
class MmaLaunch:
    """The launch decision for one call shape: the specialization, grid (CTA columns x split), chunks per
    split and dynamic shared memory."""

    cfg: MmaConfig
    cols: int
    split: int
    cps: int
    smem: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.cols, self.split, 1

    @property
    def global_split(self) -> bool:
        """Split K reduced through global memory (fp32 partials and per-column counters)."""
        return self.split > 1 and self.cfg.cluster == 1

    @property
    def x_input(self) -> str:
        """How x reaches the kernel: ``tma`` (a tensor map of x itself), ``x_prep`` (rearranged by the x_prep
        kernel first) or ``x`` (a pointer)."""
        if (self.cfg.ws or self.cfg.xs) and self.cfg.xnat:
            return "tma"
        return "x_prep" if self.cfg.ws else "x"


# -- which M the kernel takes ----------------------------------------------------------------------

def max_m(spec: WeightSpec, capability: tuple[int, int]) -> int:
    """Largest M that one launch of the kernel takes on a GPU of ``capability``."""
    if capability[0] != 9:
        return MAX_M
    return SM90_MAX_M_INT4 if spec.dtype is QDtype.INT4 and not spec.tiled else WGMMA_MAX_M


def row_blocks(spec: WeightSpec, m: int, capability: tuple[int, int]) -> list[int] | None:
    """Row counts of the launches that run ``m`` rows above :func:`max_m` (sm_90, up to
    :data:`BLOCKED_MAX_M`): max_m rows each, the rest last (a launch's time grows slower than its rows);
    None where one launch takes ``m`` or dequantize + F.linear should."""
    top = max_m(spec, capability)
    if m <= top or capability[0] != 9 or m > BLOCKED_MAX_M[spec.dtype]:
        return None
    return [top] * (m // top) + ([m % top] if m % top else [])


def mma_rows(spec: WeightSpec, m: int, capability: tuple[int, int]) -> list[int] | None:
    """The rows of each kernel launch for ``m`` rows ([m]: one launch), or None: the Triton kernel or
    dequantize + F.linear runs them."""
    return [m] if m <= max_m(spec, capability) else row_blocks(spec, m, capability)


# -- shapes and shared memory ----------------------------------------------------------------------

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


def smem_bytes(m: int, cps: int, cfg: MmaConfig) -> int:
    """Dynamic shared memory of a launch of ``cfg`` whose CTAs stream ``cps`` chunks."""
    if cfg.ws:  # the rings: slots of one chunk of every consumer warp's 16 rows, and of x (xnat: 1024-byte aligned)
        smem = cfg.nstg * cfg.warps * 1024 + cfg.xstages * cfg.mt * 8 * KPC[cfg.bits] * 2 + 1024 * cfg.xnat
    else:
        smem = x_bytes(m, cps, cfg.bits, cfg.wgmma, cfg.xstages, cfg.kw if cfg.xs else 0, cfg.xnat)
    if cfg.kw > 1:  # the other warps' partials of each tile reuse x's shared memory
        smem = max(smem, (cfg.warps - cfg.warps // cfg.kw) * cfg.rt * cfg.mt * 512)
    if cfg.cluster > 1 or cfg.gact:  # the partials reuse x's shared memory: [M][tile rows] fp32
        smem = max(smem, m * cfg.tiles * 16 * 4)
    if cfg.xs:  # then the ring's full and empty mbarriers (wo_mma.cu: xs_bar_offset)
        smem = -(-smem // 16) * 16 + 16 * cfg.kw * cfg.xstages
    return smem


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


def _mma_plan(m: int, n: int, k: int, bits: int, sms: int, warps: int | None = None, split: int | None = None,
              kw: int = 1) -> tuple[int, int, int]:
    """:func:`plan` of the mma.sync build at its launch defaults for tiled weights (:data:`LAUNCH`)."""
    stages, warps_per_sm = LAUNCH[True]
    return plan(m, n, k, bits, warps or MMA_WARPS, stages, sms, split, warps_per_sm, kw=kw)


def _wide(n: int, sms: int) -> bool:
    """N gives most SMs a 16-warp column (256 rows) without a split."""
    return n >= 192 * sms


# -- build switches --------------------------------------------------------------------------------

def wgmma_default(m: int, capability: tuple[int, int]) -> bool:
    """The lock-step wgmma build from M = WGMMA_MIN_M on sm_90 (wgmma is Hopper's: sm_90a only)."""
    return capability[0] == 9 and m >= WGMMA_MIN_M


def wgmma_launch(bits: int, m: int) -> tuple[int, int]:
    """(warps per CTA, warps per SM) of the lock-step wgmma build: 16 warps (4 warpgroups, 256 rows), one CTA
    per SM; 4-bit weights above M = 64 (where 16 warps spill registers) 8 warps."""
    if bits == 4 and m > 64:
        return 8, 8
    return 16, 16


@functools.lru_cache(maxsize=None)  # per call shape: asked on every call
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
    """Wide weights below WS_MIN_M whose mma.sync x slice would leave fewer than 4 CTAs on an SM."""
    if m >= WGMMA_MIN_M or not _wide(n, sms):
        return False
    bits = spec.dtype.bits
    return x_bytes(m, _mma_plan(m, n, k, bits, sms)[2], bits) > SM90_SMEM_PER_SM // 4


def ws_launch(m: int, n: int, sms: int, dtype: QDtype | None = None) -> tuple[int, int]:
    """(consumer warps per CTA, CTAs per SM) of the warp-specialized build. 4-bit weights (and no ``dtype``):
    above M = 64, 2 warpgroups and one CTA per SM; otherwise 4 warpgroups (256 rows) when N gives most SMs a
    column without a split, else one warpgroup and 2 CTAs per SM. 8-bit weights: up to M = 64, 2 warpgroups on
    wide weights and MXFP8 4 warpgroups elsewhere; above, int8 one warpgroup and 2 CTAs per SM, MXFP8 2
    warpgroups."""
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


@functools.lru_cache(maxsize=None)  # per call shape
def tile_sharing(m: int, n: int, k: int, bits: int, capability: tuple[int, int],
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


@functools.lru_cache(maxsize=None)  # per call shape
def xs_default(spec: WeightSpec, m: int, n: int, k: int, capability: tuple[int, int], sms: int) -> bool:
    """Whether the default launch streams x (:func:`xs_launch`): tiled weights on sm_90 at M = XS_MIN_M..16
    where the first candidate fills the GPU (XS_MIN_FILL), at one token tile or for 8-bit weights, int4
    where each warp streams enough chunks (XS_MIN_CHUNKS); int4 on natural-order tiles (x by TMA) at two
    token tiles wherever there is a candidate. e2m1 at two token tiles stays staged."""
    if capability[0] != 9 or not spec.tiled or not XS_MIN_M <= m <= XS_MAX_M:
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


def trig_default(tiled: bool, wgmma: bool, ws: bool, m: int, k: int) -> bool:
    """Early launch_dependents (TRIG): the next call's CTAs take the SMs this call's first finishers leave.
    On for the mma.sync build on tiled weights and the warp-specialized build (except K > 8192 with M > 16,
    where it was slower); off for canonical words and the lock-step wgmma build, where it was slower."""
    if ws:
        return not (m > 16 and k > 8192)
    return tiled and not wgmma


def pdl_default(capability: tuple[int, int]) -> bool:
    """Programmatic dependent launch: sm_90+ (griddepcontrol), unless QCOMPILE_PDL=0."""
    return capability[0] >= 9 and os.environ.get("QCOMPILE_PDL", "1") != "0"


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



# -- launch plans ----------------------------------------------------------------------------------

_PLANS: dict[tuple, MmaLaunch | None] = {}
_DEFAULTS: dict[tuple, MmaLaunch] = {}


def launch_plan(gpu: Gpu, base: MmaConfig, m: int, n: int, k: int, split: int | None, warps_per_sm: int,
                smem_budget: int, max_cluster: int, cluster_only: bool = False) -> MmaLaunch | None:
    """The launch of ``base`` for one call shape.

    M < :data:`CLUSTER_SHRINK_MIN_M`: the split is capped so that every CTA runs in one wave,
    and that split is reduced in a thread-block cluster (sm_90+) when all of its clusters fit on the
    GPU at once, else through global memory (cheap at this M: a few partials per output).
    Larger M: the split is shrunk until its clusters fit (x still within ``smem_budget``), as the
    global reduction's tail grows with M. A forced ``split`` is kept either way. ``cluster_only``: None
    (and no kernel compiled for it) where the plan would reduce through global memory."""
    key = (gpu, base, m, n, k, split, warps_per_sm, smem_budget, max_cluster)
    if key in _PLANS:
        return _PLANS[key]
    bits, nch, sms = base.bits, k // KPC[base.bits], gpu.sms
    wg = base.wgmma or base.xs  # (the builds that stream x: no slice to fit)
    cols, nsplit, cps = plan(m, n, k, bits, base.warps, base.stages, sms, split, warps_per_sm, smem_budget, wg,
                             base.kw, base.rt)
    shrink = m >= CLUSTER_SHRINK_MIN_M
    glob = replace(base, cluster=1)

    def x_fits(chunks: int, limit: int) -> bool:  # the mma.sync build's x slice, unless streamed
        return wg or x_bytes(m, chunks, bits) <= limit

    if split is None and not shrink:  # one wave
        while nsplit > 1:
            per_sm = gpu.blocks_per_sm(glob, smem_bytes(m, cps, glob))
            if per_sm == 0 or cols * nsplit <= per_sm * sms:  # unknown occupancy: keep the split
                break
            c = -(-nch // (nsplit - 1))
            if not x_fits(c, smem_budget):
                break
            cps, nsplit = c, -(-nch // c)
    chosen = None
    if gpu.capability[0] >= 9:
        limit, s = max(smem_budget, x_bytes(m, cps, bits)), nsplit
        while 1 < s <= max_cluster:
            c = -(-nch // s)
            s = -(-nch // c)
            if not x_fits(c, limit):
                break
            cfg = replace(base, cluster=s)
            smem = smem_bytes(m, c, cfg)
            if gpu.max_active_clusters(cfg, smem) >= cols:
                chosen = MmaLaunch(cfg, cols, s, c, smem)
                break
            if split is not None or not shrink:  # kept, reduced through global memory
                break
            s -= 1
    if chosen is None:
        if cluster_only and nsplit > 1:
            return None
        chosen = MmaLaunch(glob, cols, nsplit, cps, smem_bytes(m, cps, glob))
    _PLANS[key] = chosen
    return chosen


def rt_launch(gpu: Gpu, base: MmaConfig, m: int, n: int, k: int, max_cluster: int) -> MmaLaunch | None:
    """:func:`launch_plan` of the first of :func:`rt_candidates` that runs without a split or reduces its
    split in a cluster (its clusters all fit on the GPU); None if none does."""
    for _, kw, split in rt_candidates(m, n, k, base.bits, gpu.sms):
        cfg = replace(base, warps=16, kw=kw, rt=2, minb=1)
        chosen = launch_plan(gpu, cfg, m, n, k, split, 16, RT_SMEM, max_cluster, cluster_only=True)
        if chosen is not None and (split == 1 or chosen.cfg.cluster > 1):
            return chosen
    return None


def xs_launch(gpu: Gpu, base: MmaConfig, m: int, n: int, k: int) -> MmaLaunch | None:
    """:func:`launch_plan` of the first candidate with x streamed (:func:`rt_candidates`); None if there is none."""
    cands = rt_candidates(m, n, k, base.bits, gpu.sms, xs=True, xnat=base.xnat)
    if not cands:
        return None
    cfg = replace(base, warps=16, kw=cands[0][1], rt=2, minb=1, xstages=XS_SLOTS, xs=True)
    return launch_plan(gpu, cfg, m, n, k, cands[0][2], 16, RT_SMEM, MAX_CLUSTER)


def default_launch(gpu: Gpu, base: MmaConfig, m: int, n: int, k: int, split: int | None, warps_per_sm: int,
                   smem_budget: int, max_cluster: int, rt: bool = False) -> MmaLaunch:
    """:func:`launch_plan` of the mma.sync build on tiled weights with the launch left to the policy
    (``base``: :data:`MMA_WARPS` warps, kw = 1), refined on sm_90: x streamed where ``base.xs``
    (:func:`xs_launch`); with ``rt`` (:func:`rt_default`) two tiles per warp (:func:`rt_launch`) where a
    candidate's clusters fit; otherwise warps sharing tiles (:func:`tile_sharing`) in place of a split reduced
    through global memory, or from :data:`KW_CLUSTER_MIN_M` in a cluster, and where no tile sharing fits, from
    :data:`XS_GLOBAL_MIN_M` x streamed (:func:`xs_launch`, no split) in place of the global reduction; the
    shared-tile launches and the remaining cluster plans compiled for the CTAs per SM they plan
    (:data:`REG_CAP_MAX_MT`)."""
    key = (gpu, base, m, n, k, split, warps_per_sm, smem_budget, max_cluster, rt)
    if key not in _DEFAULTS:
        _DEFAULTS[key] = _default_launch(gpu, base, (m, n, k, split, warps_per_sm, smem_budget, max_cluster), rt)
    return _DEFAULTS[key]


def _default_launch(gpu: Gpu, base: MmaConfig, plan_args: tuple, rt: bool) -> MmaLaunch:
    m, n, k, split, warps_per_sm, smem_budget, max_cluster = plan_args
    if base.xs and split is None:
        chosen = xs_launch(gpu, base, m, n, k)
        if chosen is not None:
            return chosen
    base = replace(base, xs=False)
    if rt and split is None:
        chosen = rt_launch(gpu, base, m, n, k, max_cluster)
        if chosen is not None:
            return chosen
    chosen = launch_plan(gpu, base, *plan_args)
    cap_regs = gpu.capability[0] == 9 and base.mt <= REG_CAP_MAX_MT and base.minb == 1
    if chosen.split > 1 and (chosen.cfg.cluster == 1 or m >= KW_CLUSTER_MIN_M):
        warps, kw, kw_split = tile_sharing(m, n, k, base.bits, gpu.capability, gpu.sms)
        if kw > 1:
            shared = replace(base, warps=warps, kw=kw, minb=warps_per_sm // warps if cap_regs else base.minb)
            return launch_plan(gpu, shared, m, n, k, kw_split, warps_per_sm, smem_budget, max_cluster)
    if chosen.split > 1 and chosen.cfg.cluster == 1 and gpu.capability[0] == 9 \
            and XS_GLOBAL_MIN_M.get(base.fmt, XS_MIN_M) <= m <= XS_MAX_M:
        streamed = xs_launch(gpu, base, m, n, k)  # (no split: x streamed in place of the global reduction)
        if streamed is not None:
            return streamed
    if cap_regs and chosen.cfg.cluster > 1:
        capped = launch_plan(gpu, replace(base, minb=warps_per_sm // base.warps), *plan_args)
        if capped.cfg.cluster > 1:
            return capped
    return chosen


# The grouped build's split aims at this many warps per SM: twice the dense launches' (more weight bytes in flight
# where few active experts leave few columns). Measured shapes use their table entries (docs/kernels-moe.md).
GROUPED_WARPS_PER_SM = 64


@functools.lru_cache(maxsize=None)  # asked on every call of the MoE op
def grouped_launch(gpu: Gpu, call: Call, active: int, pdl: bool, warps: int | None = None, split: int | None = None,
                   max_cluster: int = MAX_CLUSTER, kw: int = 1, rt: int = 1, gact: int = 0,
                   trig: bool = False, xpad: bool = False) -> MmaLaunch | None:
    """The launch of the grouped (MoE experts) mma.sync build for blocks of ``call.m`` pair slots of one expert each,
    about ``active`` of them busy: :data:`MMA_WARPS` warps per CTA and the split that gives the active blocks
    :data:`GROUPED_WARPS_PER_SM` warps per SM (:func:`plan` over their ``active * N`` rows), at most ``max_cluster``
    (reduced in a thread-block cluster; no split before sm_90). None where that leaves the x slice over
    :data:`SMEM_BUDGET`. ``warps`` / ``split`` fix the CTA size / the split (None where a forced split exceeds the
    cluster); ``kw`` warps share a 16-row tile, each group of them owning ``rt`` tiles (the mma.sync build's
    refinements; None where ``kw`` does not divide the warps). ``gact`` (an activation code) fuses the gated activation
    (None where the tile groups are odd or N / 2 is not a multiple of 16). ``trig`` (with PDL): the next kernel may
    launch once this one's CTAs have their block (after its griddepcontrol.wait), not after their main loop, so that
    its CTAs request their weights beside this one's. ``xpad``: x's rows are narrower than ``call.k`` (the weight's K
    padded to whole chunks; the build reads zeros past them). Its grid's third dimension is the token sort's block
    count, given at the launch."""
    spec, m, n, k = call.spec, call.m, call.n, call.k
    if m > GROUPED_MMA_MAX_M:
        if kw > 1 or rt > 1 or gact:  # (x's rows are gathered and padded to K first: xpad needs nothing)
            return None
        return grouped_ws_launch(gpu, call, active, pdl, warps, split, max_cluster, trig)
    stages = LAUNCH[spec.tiled][0]
    bits, warps, most = spec.dtype.bits, warps or MMA_WARPS, max_cluster if gpu.capability[0] >= 9 else 1
    nch = k // KPC[bits]
    if warps % kw or (gact and ((warps // kw) % 2 or n % 32)):
        return None
    if split is None:
        split = min(plan(m, n * active, k, bits, warps, stages, gpu.sms, None, GROUPED_WARPS_PER_SM, kw=kw,
                         rt=rt)[1], most)
    cps = -(-nch // split)
    split = -(-nch // cps)
    if split > most or x_bytes(m, cps, bits) > SMEM_BUDGET:
        return None
    cfg = call_config(call, m, stages, warps, cluster=split if split > 1 else 1, pdl=pdl, trig=trig and pdl,
                      grouped=True, kw=kw, rt=rt, gact=gact, xpad=xpad)
    return MmaLaunch(cfg, -(-(n // 16) // cfg.tiles), split, cps, smem_bytes(m, cps, cfg))


def grouped_ws_launch(gpu: Gpu, call: Call, active: int, pdl: bool, warps: int | None = None,
                      split: int | None = None, max_cluster: int = MAX_CLUSTER, trig: bool = False) -> MmaLaunch | None:
    """The grouped launch of the warp-specialized wgmma build (sm_90, tiled weights) for blocks of ``call.m`` pair
    slots (a multiple of 8, up to :data:`WGMMA_MAX_M`): the dense build's CTA (:func:`ws_launch` on one block's
    N) and the split that gives about ``active`` busy blocks that many CTAs per SM, reduced in a thread-block
    cluster (at most ``max_cluster``); None elsewhere or where the rings exceed a CTA's shared memory."""
    spec, m, n, k = call.spec, call.m, call.n, call.k
    if gpu.capability[0] != 9 or not spec.tiled or m % 8 or m > WGMMA_MAX_M:
        return None
    d_warps, per_sm = ws_launch(m, n, gpu.sms, spec.dtype)
    warps = warps or d_warps
    if warps % 4:
        return None
    nch = k // KPC[spec.dtype.bits]
    cols = -(-(n // 16) // warps)
    if split is None:
        split = max(1, min(max_cluster, round(per_sm * gpu.sms / (cols * max(active, 1))), nch))
    cps = -(-nch // split)
    split = -(-nch // cps)
    if split > max_cluster:
        return None
    cfg = call_config(call, m, 2, warps, True, cluster=split if split > 1 else 1, pdl=pdl,
                      xstages=3 if warps >= 16 else 4, ws=True, trig=trig and pdl, grouped=True)
    smem = smem_bytes(m, cps, cfg)
    return MmaLaunch(cfg, cols, split, cps, smem) if smem <= SM90_SMEM_PER_CTA else None


# -- the decision ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Call:
    """What the policy needs of one call: the weight's format, the layer's shape and optional tensors, M
    and x's dtype (fp16 or bf16)."""

    spec: WeightSpec
    m: int
    n: int
    k: int
    xf16: bool = False
    zp_t: str | None = None  # C type of the zero points (wo_mma.ZP_TYPES), None without
    has_gs: bool = False
    has_bias: bool = False


def call_config(call: Call, m: int, stages: int, warps: int, wgmma: bool = False, **build) -> MmaConfig:
    """The build of one call's format, optional tensors and x dtype for ``m`` rows (whole 8-row tiles), ``stages``
    and ``warps``; ``build``: the other :class:`MmaConfig` fields."""
    spec = call.spec
    smode, group = scale_mode(spec, wgmma)
    return MmaConfig(FMT[(spec.dtype, spec.packing)], SK[spec.scale.dtype], smode, group, call.zp_t is not None,
                     call.zp_t or "int", call.has_gs, call.has_bias, -(-m // 8), stages, warps, spec.tiled,
                     wgmma=wgmma, xf16=call.xf16, **build)


def choose(gpu: Gpu, call: Call, pdl: bool, stages: int | None = None, warps: int | None = None,
           split: int | None = None, warps_per_sm: int | None = None, smem_budget: int = SMEM_BUDGET,
           max_cluster: int = MAX_CLUSTER, wgmma: bool | None = None, xstages: int | None = None, minb: int = 1,
           ws: bool | None = None, nstg: int = 8, trig: bool | None = None, kw: int | None = None, rt: int = 1,
           xs: bool | None = None) -> MmaLaunch:
    """The launch of one call (M <= :func:`max_m`). Left to the policy: the build (:func:`ws_default`,
    :func:`wgmma_default`, else mma.sync), its CTA shape (:func:`ws_launch`, :func:`wgmma_launch`,
    :data:`LAUNCH`), on tiled weights the mma.sync refinements (:func:`default_launch`) and the split
    (:func:`launch_plan`). A caller's keyword fixes that part (wo_mma.wo_mma documents them); a combination
    the kernel has no build for raises ValueError."""
    spec, m, n, k = call.spec, call.m, call.n, call.k
    packed, cap, sms = spec.tiled, gpu.capability, gpu.sms
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
    # the mma.sync launch left to the policy on tiled weights
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
    if trig is None:
        trig = trig_default(packed, wgmma, ws, m, k)
    base = call_config(call, m, stages, warps, wgmma, pdl=pdl, xstages=xstages, minb=minb, ws=ws, nstg=nstg,
                       trig=trig, kw=kw, rt=rt, xs=xs)
    plan_args = (m, n, k, split, warps_per_sm, smem_budget, max_cluster)
    if auto:
        return default_launch(gpu, base, *plan_args, rt=rt_default(spec, m, n, k, cap, sms))
    return launch_plan(gpu, base, *plan_args)
