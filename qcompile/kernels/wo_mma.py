"""The ``mma`` backend of ``qcompile::wo_linear``: a CUDA C++ weight-only GEMM for decode-size M.

``wo_mma.cu`` holds the kernel (its header comment explains the design): tensor cores fed with weights
decoded in registers, from the canonical checkpoint layout or the tiled one (quant_math.tile_words), in
three builds (mma.sync, lock-step wgmma, warp-specialized wgmma). Which build and launch a call gets is
:mod:`wo_policy`'s decision (an :class:`~wo_policy.MmaLaunch`); this module turns it into source, compiles
it at first use for the running GPU with NVRTC (one specialization per :class:`~wo_policy.MmaConfig`,
cached for the process) and launches it through :mod:`cuda_driver`, with programmatic dependent launch on
sm_90 (``QCOMPILE_PDL=0`` turns it off).
"""

from __future__ import annotations

import ctypes
from dataclasses import fields
from pathlib import Path

import torch

from ..scheme import Granularity, QDtype, ScaleDtype, WeightSpec
from . import cuda_driver, wo_policy
from .wo_policy import (
    FMT,
    MAX_CLUSTER,
    SMEM_BUDGET,
    Call,
    MmaConfig,
    MmaLaunch,
    chunk_k,
)

SOURCE = Path(__file__).with_name("wo_mma.cu")
ZP_TYPES = {torch.int32: "int", torch.int8: "signed char", torch.uint8: "unsigned char", torch.float32: "float"}


# -- source and build ------------------------------------------------------------------------------

_DEFINES = dict(fmt="FMT", sk="SK", smode="SMODE", group="GROUP", has_zp="HAS_ZP", zp_t="ZP_T", has_gs="HAS_GS",
                has_bias="HAS_BIAS", mt="MT", stages="STAGES", warps="WARPS", packed="PACKED", cluster="CLUSTER",
                pdl="PDL", wgmma="WGMMA", xstages="XSTAGES", minb="MINB", ws="WS", nstg="NSTG", trig="TRIG",
                kw="KW", rt="RT", xf16="XF16", xs="XS", grouped="GROUPED", gact="GACT", xpad="XPAD")


def defines(cfg: MmaConfig) -> str:
    """The #defines of one specialization (wo_mma.cu's compile-time configuration)."""
    out = []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        v = max(v, 1) if f.name == "group" else int(v) if isinstance(v, bool) else v
        out.append(f"#define {_DEFINES[f.name]} {v}\n")
    return "".join(out)


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
    return defines(cfg) + src


def arch_of(cfg: MmaConfig, major: int, minor: int) -> str:
    """NVRTC's architecture: wgmma needs the architecture-specific sm_90a."""
    return f"{major}{minor}" + ("a" if cfg.wgmma else "")


def compile_cubin(src: str, arch: str) -> bytes:
    return cuda_driver.compile_cubin(src, arch, "wo_mma")


_KERNELS: dict[tuple, dict] = {}


def _kernel(cfg: MmaConfig, idx: int, name: str = "wo_mma"):
    """The compiled ``name`` of ``cfg`` on device ``idx`` (``wo_mma``, or the warp-specialized build's ``x_prep``)."""
    key = (cfg, idx)
    if key not in _KERNELS:
        major, minor = cuda_driver.capability(idx)
        names = ["wo_mma", "x_prep"] if cfg.ws else ["wo_mma"]
        _KERNELS[key] = cuda_driver.load_module(compile_cubin(source(cfg), arch_of(cfg, major, minor)), names, idx)
    return _KERNELS[key][name]


class CudaGpu:
    """:class:`wo_policy.Gpu` of one CUDA device: the driver's occupancy of each specialization (compiled
    for the query, as the launch needs it anyway)."""

    def __init__(self, idx: int):
        self.idx, self.capability, self.sms = idx, cuda_driver.capability(idx), cuda_driver.sm_count(idx)
        self.pdl = wo_policy.pdl_default(self.capability)

    def _prepared(self, cfg: MmaConfig, smem: int):
        return cuda_driver.with_shared_memory(_kernel(cfg, self.idx), smem)

    def blocks_per_sm(self, cfg: MmaConfig, smem: int) -> int:
        return cuda_driver.blocks_per_sm(self._prepared(cfg, smem), cfg.threads, smem)

    def max_active_clusters(self, cfg: MmaConfig, smem: int) -> int:
        return cuda_driver.max_active_clusters(self._prepared(cfg, smem), cfg.cluster, cfg.threads, smem)


_GPUS: dict[int, CudaGpu] = {}


def gpu(device: torch.device) -> CudaGpu:
    idx = cuda_driver.device_index(device)
    if idx not in _GPUS:
        _GPUS[idx] = CudaGpu(idx)
    return _GPUS[idx]


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of ``device`` (queried once per process)."""
    return gpu(device).capability


def max_m(spec: WeightSpec, capability: tuple[int, int]) -> int:
    return wo_policy.max_m(spec, capability)


# -- the op's kernel -------------------------------------------------------------------------------

def call_of(x2: torch.Tensor, weight, global_scale, zero_point, bias, spec: WeightSpec) -> Call:
    return Call(spec, x2.shape[0], weight.shape[0], x2.shape[1], x2.dtype == torch.float16,
                ZP_TYPES[zero_point.dtype] if zero_point is not None else None, global_scale is not None,
                bias is not None)


def decide(x2: torch.Tensor, weight, global_scale, zero_point, bias, spec: WeightSpec, pdl: bool | None = None,
           **launch) -> MmaLaunch:
    """The policy's launch of ``wo_mma(x2, ...)`` with these keywords (:func:`wo_policy.choose`)."""
    g = gpu(x2.device)
    return wo_policy.choose(g, call_of(x2, weight, global_scale, zero_point, bias, spec),
                            g.pdl if pdl is None else pdl, **launch)


def wo_mma(x2: torch.Tensor, weight, scale, global_scale, zero_point, bias, spec: WeightSpec,
           stages: int | None = None, warps: int | None = None, split: int | None = None,
           warps_per_sm: int | None = None, smem_budget: int = SMEM_BUDGET,
           max_cluster: int = MAX_CLUSTER, pdl: bool | None = None, wgmma: bool | None = None,
           xstages: int | None = None, minb: int = 1, ws: bool | None = None, nstg: int = 8,
           trig: bool | None = None, kw: int | None = None, rt: int = 1, xs: bool | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] contiguous bf16 or fp16 (M <= :func:`wo_policy.max_m`) -> [M, N] of x2's dtype. Checks are
    the caller's (:func:`mma_reason`); the tensors are the op's canonical ones, the weight tiled when
    ``spec.tiled`` (quant_math.tile_words). The launch is :func:`wo_policy.choose`'s; a keyword fixes one part
    of it: ``stages`` / ``warps`` / ``warps_per_sm`` / ``split`` / ``smem_budget`` (the CTA shape and split-K;
    splits up to ``max_cluster`` reduced in a thread-block cluster on sm_90+), ``pdl`` (programmatic dependent
    launch; default sm_90+ unless ``QCOMPILE_PDL=0``), ``trig`` (with PDL, let the next kernel launch from this
    one's start), ``wgmma`` (the lock-step wgmma build) with ``xstages`` x chunks in flight and ``minb`` CTAs
    per SM, ``ws`` (the warp-specialized build, tiled weights: ``warps`` consumer warps, ``nstg`` weight and
    ``xstages`` x slots), and for the mma.sync build ``kw`` (warps sharing each 16-row tile), ``rt`` (16-row
    tiles per warp) and ``xs`` (x streamed through a ring). ``out``: a contiguous [M, N] tensor of x2's dtype
    to write (a row block of a larger output)."""
    launch = decide(x2, weight, global_scale, zero_point, bias, spec, pdl, stages=stages, warps=warps, split=split,
                    warps_per_sm=warps_per_sm, smem_budget=smem_budget, max_cluster=max_cluster, wgmma=wgmma,
                    xstages=xstages, minb=minb, ws=ws, nstg=nstg, trig=trig, kw=kw, rt=rt, xs=xs)
    return run(launch, x2, weight, scale, global_scale, zero_point, bias, spec, out)


def operands(x2: torch.Tensor, weight, scale, zero_point, bias, spec: WeightSpec) -> tuple:
    """(x, words, scales, scale row stride, zero points, bias) as the kernel reads them: x 16-byte aligned (a
    copy where it is not), the weight as int32 words, fp32 scales or the bytes of 8-bit ones with their stride
    per row (0 per tensor, 1 per channel, the groups of a row), bias in x's dtype; None where absent."""
    s = scale.contiguous()
    if s.dtype != torch.float32:
        s = s.view(torch.uint8)
    gran = spec.scale.granularity
    ss = 0 if gran is Granularity.TENSOR else (1 if gran is Granularity.CHANNEL else s.shape[-1])
    x2 = x2.clone() if x2.data_ptr() % 16 else x2
    return (x2, weight.contiguous().view(torch.int32), s, ss,
            zero_point.contiguous() if zero_point is not None else None,
            bias.to(x2.dtype).contiguous() if bias is not None else None)


def run(launch: MmaLaunch, x2: torch.Tensor, weight, scale, global_scale, zero_point, bias, spec: WeightSpec,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch ``launch`` (:func:`decide`) on these tensors."""
    cfg, idx = launch.cfg, cuda_driver.device_index(x2.device)
    m, k = x2.shape
    n = weight.shape[0]
    x2, w, s, ss, z, b = operands(x2, weight, scale, zero_point, bias, spec)
    if out is None:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    elif out.shape != (m, n) or out.dtype != x2.dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"wo_mma: out must be a contiguous, 16-byte aligned {x2.dtype} [{m}, {n}] tensor, have "
                         f"{out.dtype} {list(out.shape)}")
    part = torch.empty((launch.split, m, n), dtype=torch.float32, device=x2.device) if launch.global_split else out
    counters = cuda_driver.counters(x2.device, launch.cols) if launch.global_split else out
    dummy = out
    tail = []
    if launch.x_input == "tma":  # x loaded as it is by TMA (wo_mma.cu: XNAT), boxes of 64 k x the token tiles
        tail = [cuda_driver.tensor_map_2d(x2, 64, cfg.mt * 8)]
    elif launch.x_input == "x_prep":  # x as the B operand, chunk by chunk (wo_mma.cu: x_prep)
        x2 = _x_prepped(cfg, idx, x2, m, k, spec)
    kern = cuda_driver.with_shared_memory(_kernel(cfg, idx), launch.smem)
    cuda_driver.launch(kern, launch.grid, (cfg.threads, 1, 1), launch.smem, cfg.pdl,
                       [x2, w, s, z if z is not None else dummy,
                        global_scale.float().reshape(1) if global_scale is not None else dummy,
                        b if b is not None else dummy, out, part, counters, m, n, k, ss, launch.cps, *tail])
    return out


def _x_prepped(cfg: MmaConfig, idx: int, x: torch.Tensor, m: int, k: int, spec: WeightSpec,
               blocks: int = 1) -> torch.Tensor:
    """x_prep's launch: x ([blocks * m, k], blocks of m <= 8 MT rows) as the B operand of the warp-specialized build,
    chunk by chunk and block by block (grid y)."""
    kpc = chunk_k(spec)
    xp = torch.empty(blocks * k * cfg.mt * 8, dtype=x.dtype, device=x.device)
    tasks = (k // kpc) * cfg.mt * 8 * (kpc // 32)
    cuda_driver.launch(_kernel(cfg, idx, "x_prep"), (-(-tasks // 256), blocks, 1), (256, 1, 1), 0, cfg.pdl,
                       [x, xp, m, k])
    return xp


def _per_expert(a: torch.Tensor, global_scale, route: torch.Tensor | None, e: int) -> tuple:
    """(global scales [E] fp32 or None, router weights as the grouped builds read them (fp32, or of a's 16-bit dtype
    as they are), rh: 1 where they are of a's dtype)."""
    gs = global_scale.float().reshape(e).contiguous() if global_scale is not None else None
    if route is None:
        return gs, None, 0
    rh = int(route.dtype == a.dtype)
    return gs, route.contiguous() if rh or route.dtype == torch.float32 else route.float().contiguous(), rh


def grouped_launch(x_dtype: torch.dtype, device: torch.device, weight, global_scale, zero_point, bias,
                   spec: WeightSpec, k: int, block_m: int, active: int, **fixed) -> MmaLaunch | None:
    """:func:`wo_policy.grouped_launch` of one projection of an MoE layer's experts (``weight`` [E, N, ...], x of
    ``x_dtype`` with K = ``k``) in blocks of ``block_m`` pair slots, about ``active`` of them busy; None where
    the kernel has no launch for it (:func:`mma_reason`, or no split that fits a cluster). ``fixed``: the
    policy's ``warps`` / ``split`` / ``kw`` / ``rt``, and ``gact`` (the gated activation fused)."""
    n = weight.shape[1]
    zp_dtype = zero_point.dtype if zero_point is not None else None
    if mma_reason(spec, n, k, x_dtype, zp_dtype):
        return None
    g = gpu(device)
    call = Call(spec, block_m, n, k, x_dtype == torch.float16, ZP_TYPES[zp_dtype] if zp_dtype else None,
                global_scale is not None, bias is not None)
    return wo_policy.grouped_launch(g, call, active, g.pdl, **fixed)


def grouped(launch: MmaLaunch, a: torch.Tensor, a_div: int, weight, scale, global_scale, zero_point, bias,
            spec: WeightSpec, align: tuple[torch.Tensor, torch.Tensor] | torch.Tensor, pairs: int,
            route: torch.Tensor | None, ready: bool = False, alpha: float = 0.0, limit: float = 0.0) -> torch.Tensor:
    """One projection of an MoE layer's routed experts in one launch (wo_mma.cu: GROUPED; ``launch`` from
    :func:`grouped_launch`): fp32 [pairs, N] whose row p is a[p // a_div] @ dequantize(weight[e]).T (+ bias[e]) (x
    route[p]) for pair p of expert e. A launch with ``gact`` returns the gated activation of those rows instead,
    [pairs, N / 2] in a's dtype (``alpha`` / ``limit``: swigluoai's). ``align``: moe_align's (sorted ids, block
    experts) in blocks of the launch's MT * 8 pair slots, or the pairs' expert ids themselves (int32 / int64
    [pairs]: one block per pair; rows of ids outside [0, E) are not written); the weight tensors stacked over
    experts ([E, ...], the op's canonical forms). ``route`` fp32 or of a's dtype. ``ready``: the ids / sort were
    complete before the previous kernel of the stream began (it was launched without PDL), so the kernel requests
    its weights before waiting for that kernel."""
    e, n, _ = weight.shape
    kx = a.shape[1]
    k = spec.stored_k(kx)  # (a tiled weight's K padded to whole chunks: x is read as zeros past kx)
    cfg = launch.cfg
    if cfg.ws:
        return _grouped_ws(launch, a, a_div, weight, scale, global_scale, zero_point, bias, spec, align, pairs, route)
    if cfg.xpad != (k != kx):
        raise ValueError(f"wo_mma: a launch {'with' if cfg.xpad else 'without'} xpad for x of {kx} columns and K = {k}")
    direct = isinstance(align, torch.Tensor)
    blocks = align.numel() if direct else align[1].numel()
    rows = torch.empty((pairs, n // 2 if cfg.gact else n), dtype=a.dtype if cfg.gact else torch.float32,
                       device=a.device)
    if blocks == 0:
        return rows
    a, w, s, ss, z, b = operands(a.contiguous(), weight, scale, zero_point, bias, spec)
    gs, route, rh = _per_expert(a, global_scale, route, e)
    if direct:
        ids = align.contiguous()
        sorted_ids, block_expert, mode = rows, ids, 2 if ids.dtype == torch.int64 else 1
    else:
        (sorted_ids, block_expert), mode = align, 0
    kern = cuda_driver.with_shared_memory(_kernel(cfg, cuda_driver.device_index(a.device)), launch.smem)
    cuda_driver.launch(kern, (launch.cols, launch.split, blocks), (cfg.threads, 1, 1), launch.smem,
                       cfg.pdl, [a, w, s, z if z is not None else rows, gs if gs is not None else rows,
                                 b if b is not None else rows, rows, rows, rows, cfg.mt * 8, n, k, ss, launch.cps,
                                 sorted_ids, block_expert, route, pairs, a_div, ctypes.c_longlong(w.numel() // e),
                                 s.numel() // e, z.numel() // e if z is not None else 0, rh, mode, e, int(ready),
                                 ctypes.c_float(alpha), ctypes.c_float(limit), kx])
    return rows


def gathered_rows(a: torch.Tensor, a_div: int, sorted_ids: torch.Tensor, pairs: int, k: int) -> torch.Tensor:
    """[slots, k] in a's dtype: row j is a[sorted_ids[j] // a_div] (zero columns from a's width to ``k``), a zero row
    where the slot holds no pair (sorted_ids[j] >= ``pairs``). Device ops only (no host sync)."""
    valid = sorted_ids < pairs
    rows = a.index_select(0, torch.where(valid, sorted_ids // a_div, 0))
    rows = rows * valid.unsqueeze(1).to(rows.dtype)
    return rows if k == a.shape[1] else torch.nn.functional.pad(rows, (0, k - a.shape[1]))


def _grouped_ws(launch: MmaLaunch, a: torch.Tensor, a_div: int, weight, scale, global_scale, zero_point, bias,
                spec: WeightSpec, align, pairs: int, route: torch.Tensor | None) -> torch.Tensor:
    """:func:`grouped` on the warp-specialized build: each block's x rows gathered first (:func:`gathered_rows`),
    read by TMA at the block's row offset (XNAT) or rearranged per block by x_prep."""
    if isinstance(align, torch.Tensor):
        raise ValueError("wo_mma: the grouped warp-specialized build takes moe_align's blocks, not the pairs' ids")
    cfg, idx = launch.cfg, cuda_driver.device_index(a.device)
    e, n, _ = weight.shape
    k, bm = spec.stored_k(a.shape[1]), cfg.mt * 8
    sorted_ids, block_expert = align
    blocks = block_expert.numel()
    rows = torch.empty((pairs, n), dtype=torch.float32, device=a.device)
    if blocks == 0:
        return rows
    xg = gathered_rows(a.contiguous(), a_div, sorted_ids, pairs, k)
    _, w, s, ss, z, b = operands(xg, weight, scale, zero_point, bias, spec)
    gs, route, rh = _per_expert(a, global_scale, route, e)
    if launch.x_input == "tma":
        xmap = cuda_driver.tensor_map_2d(xg, 64, bm)
    else:  # x as the B operand, per block and chunk
        xg, xmap = _x_prepped(cfg, idx, xg, bm, k, spec, blocks), (ctypes.c_ulonglong * 16)()
    kern = cuda_driver.with_shared_memory(_kernel(cfg, idx), launch.smem)
    cuda_driver.launch(kern, (launch.cols, launch.split, blocks), (cfg.threads, 1, 1), launch.smem, cfg.pdl,
                       [xg, w, s, z if z is not None else rows, gs if gs is not None else rows,
                        b if b is not None else rows, rows, rows, rows, bm, n, k, ss, launch.cps, xmap, sorted_ids,
                        block_expert, route, pairs, ctypes.c_longlong(w.numel() // e), s.numel() // e,
                        z.numel() // e if z is not None else 0, rh, e])
    return rows


def wo_mma_blocked(x2: torch.Tensor, weight, scale, global_scale, zero_point, bias, spec: WeightSpec,
                   blocks: list[int]) -> torch.Tensor:
    """:func:`wo_mma` over consecutive row blocks of x2 (``blocks``: their row counts,
    :func:`wo_policy.row_blocks`), each launch writing its rows of one [M, N] output."""
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=x2.dtype, device=x2.device)
    r0 = 0
    for rows in blocks:
        wo_mma(x2[r0:r0 + rows], weight, scale, global_scale, zero_point, bias, spec, out=out[r0:r0 + rows])
        r0 += rows
    return out


def mma_reason(spec: WeightSpec, n: int, k: int, x_dtype: torch.dtype = torch.bfloat16,
               zp_dtype: torch.dtype | None = None) -> str | None:
    """None when the kernel runs this weight for x of ``x_dtype`` (any M <= :func:`wo_policy.max_m`), else why not."""
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
    if spec.dtype is QDtype.FP8_E4M3 and spec.scale.dtype is not ScaleDtype.E8M0:
        return "fp8 weights with fp32 scales belong to qcompile::fp8_linear (the kernel decodes MXFP8's e8m0 scales)"
    kc = chunk_k(spec)
    if n % 16 or k % kc:
        return f"[N, K] = [{n}, {k}]: N must be a multiple of 16 and K of {kc}"
    if spec.scale.granularity is Granularity.GROUP:
        g = spec.scale.group_size
        if g < 16 or g & (g - 1) or k % g:
            return f"group size {g} (a power of two >= 16 dividing K expected)"
    if zp_dtype is not None and zp_dtype not in ZP_TYPES:
        return f"zero points of dtype {zp_dtype}"
    return None
