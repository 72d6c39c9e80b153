"""``qcompile::wo_linear``: weight-only 4- and 8-bit linear layers (W4A16 / W8A16), decode-size M.

A Marlin-style mixed-precision GEMM in Triton: the weight is streamed in its canonical checkpoint
layout as 16-byte int32 words, each word's codes are decoded in registers (integer tricks, no
int->float conversion instructions), scaled and fed to ``tl.dot`` against x in bf16/fp16 with fp32
accumulation. Split-K fills the GPU when M is small (M=1..16: N/BLOCK_N tiles alone are < 132).

=====================  ===========================  ====================================  ==========
format (WeightSpec)     weight (canonical)           scale                                  global
=====================  ===========================  ====================================  ==========
int4, pack=int32        int32 [N, K/8], code j at    fp32 [] / [N] / [N, K/G] (+ zero       optional
                        bits 4j, offset +8           point same shape, + g_idx [K])
fp4_e2m1, pack=uint8    uint8 [N, K/2], low nibble   NVFP4: fp8 e4m3 [N, K/16];             NVFP4
                        = even element               MXFP4: e8m0 uint8 [N, K/32]
int8, pack=int32/none   int32 [N, K/4] (offset       fp32 [] / [N] / [N, K/G] (+ zero       optional
                        +128) or int8 [N, K]         point, + g_idx)
fp8_e4m3                float8_e4m3fn [N, K]         e8m0 uint8 [N, K/32] (MXFP8)          optional
=====================  ===========================  ====================================  ==========

Every weight is read as int32 words (a free ``view``): a uint8 e2m1 byte pair and an int8/fp8 byte
quad land at bits ``4j`` / ``8j`` of their little-endian word exactly like the pack-quantized codes.
Word ``w`` of row ``n`` holds elements ``k = EPW*w + j`` (EPW = 8 or 4), so the kernel computes
``sum_j dot(decode_j(words), x[:, j::EPW])``; the x slices come from one contiguous x tile split in
registers, or from x permuted once per call (``X_PERMUTED``). Weights tiled at load for ``wo_mma``
(quant_math.tile_words) are read in place: the kernels take the tiled offsets (``TILED``, ``NATURAL``).

Backends (the op's ``backend`` argument):

* ``"triton"`` (CUDA sm_80+, or CPU under ``TRITON_INTERPRET=1``): the kernel for M <= ``WO_MAX_M``
  of the format's family; above it the Triton dequantize kernel writes the weight in x.dtype once
  and ``F.linear`` runs the GEMM (cuBLAS is faster there).
* ``"dequant"`` (any device): dequantize (Triton kernel on CUDA, :mod:`quant_math` elsewhere), cast
  to x.dtype, ``F.linear``. The CPU path and the fallback of every shape the kernel rejects.

Math: ``out = x @ ((q - z) * s * g).T + bias``, fp32 accumulation, one rounding to x.dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..scheme import Granularity, Packing, QDtype, QuantScheme, ScaleDtype, WeightSpec, canonical_shape
from ..scheme import parse_scheme_key
from . import quant_math, wo_mma, wo_policy, wo_tune
from .fp8_quant_triton import HAS_TRITON, use_triton
from .reference import register_straight_through
from .registry import HALF, Kernel, KernelQuery, cuda_reason, register, unknown_backend
from .wo_gemm_triton import FMT_E2M1, FMT_FP8, FMT_INT4, FMT_INT8, FMT_INT8_OFFSET, SK_E4M3, SK_E8M0, SK_FP32

if HAS_TRITON:
    import triton

    from .wo_gemm_triton import _dequant_kernel, _permute_x_kernel, _splitk_reduce_kernel, _wo_gemm_kernel

OP = "qcompile::wo_linear"
BACKENDS = ("mma", "triton", "dequant")

# Largest M the Triton kernel runs, by family(): above it the "triton" backend dequantizes once and calls
# F.linear (cuBLAS), which is faster there; MXFP8 always takes that path.
WO_MAX_M = {"int4": 128, "fp4": 64, "8bit": 128, "fp8": 0}



@dataclass(frozen=True)
class Layout:
    """How the kernel reads one WeightSpec."""

    fmt: int
    epw: int  # elements per int32 word
    scale_kind: int
    group: int  # 0: one scale per row (channel) or per tensor (row stride 0)

    @property
    def min_block_k(self) -> int:
        return 16 * self.epw  # tl.dot needs 16 words per slice (a partial last K step is masked)


def layout_of(spec: WeightSpec) -> Layout:
    fmt = {(QDtype.INT4, Packing.INT32): FMT_INT4, (QDtype.FP4_E2M1, Packing.UINT8): FMT_E2M1,
           (QDtype.INT8, Packing.INT32): FMT_INT8_OFFSET, (QDtype.INT8, Packing.NONE): FMT_INT8,
           (QDtype.FP8_E4M3, Packing.NONE): FMT_FP8}[(spec.dtype, spec.packing)]
    kind = {ScaleDtype.FP32: SK_FP32, ScaleDtype.FP8_E4M3: SK_E4M3, ScaleDtype.E8M0: SK_E8M0}[spec.scale.dtype]
    group = spec.scale.group_size if spec.scale.granularity is Granularity.GROUP else 0
    return Layout(fmt, 8 if spec.dtype.bits == 4 else 4, kind, group)


def wo_reason(scheme: QuantScheme) -> str | None:
    """None when this op runs ``scheme``'s weights (either backend), else what is missing. Activations
    are never quantized here: a scheme with an ActSpec (NVFP4 W4A4 on a GPU without an FP4 GEMM) runs
    weight-only, and the Linear pass says so once."""
    w = scheme.weight
    combos = {(QDtype.INT4, Packing.INT32), (QDtype.FP4_E2M1, Packing.UINT8), (QDtype.INT8, Packing.INT32),
              (QDtype.INT8, Packing.NONE), (QDtype.FP8_E4M3, Packing.NONE)}
    if (w.dtype, w.packing) not in combos:
        return f"{w.dtype.value} weights packed as {w.packing.value} are not a wo_linear format"
    gran, sdt = w.scale.granularity, w.scale.dtype
    if gran not in (Granularity.TENSOR, Granularity.CHANNEL, Granularity.GROUP):
        return f"weight scales per {gran.value} (tensor, channel or group expected)"
    if w.dtype is QDtype.FP4_E2M1:
        if (sdt, w.scale.group_size) not in ((ScaleDtype.FP8_E4M3, 16), (ScaleDtype.E8M0, 32)):
            return f"e2m1 weights need fp8 scales per 16 (NVFP4) or e8m0 per 32 (MXFP4), have {w.scale.key()}"
    elif w.dtype is QDtype.FP8_E4M3:
        if (sdt, w.scale.group_size) != (ScaleDtype.E8M0, 32):  # fp32-scaled fp8: qcompile::fp8_linear
            return f"fp8 weights need e8m0 scales per 32 (MXFP8), have {w.scale.key()}"
    elif sdt is not ScaleDtype.FP32:
        return f"{w.dtype.value} weights need fp32 scales, have {sdt.value}"
    g = w.scale.group_size
    if gran is Granularity.GROUP and (g < 16 or g & (g - 1)):
        return f"group size {g} is not a power of two >= 16"
    if (w.zero_point or w.act_order or w.k_sorted) and w.dtype not in (QDtype.INT4, QDtype.INT8):
        return "zero points / act-order only with int4 / int8 weights"
    if (w.act_order or w.k_sorted) and gran is not Granularity.GROUP:
        return "act-order (g_idx) needs group scales"
    return None


# -- Triton kernels --------------------------------------------------------------------------------

# -- host side -------------------------------------------------------------------------------------

_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


# Launch configurations, by weight family and M bucket, from sweeps of benchmarks/bench_wo_linear.py --tune;
# 16 words = one int4 group of 128 per step, so its scale is applied after the dot.
TUNED: dict[tuple[str, int], tuple] = {
    # (family, M bucket): (BLOCK_M, BLOCK_N, words per step, warps, stages, waves, scale prefetch, x permuted)
    ("int4", 16): (16, 64, 16, 4, 4, 4, True, False), ("int4", 32): (32, 64, 16, 4, 4, 4, True, False),
    ("int4", 64): (64, 128, 16, 8, 3, 1, True, True), ("int4", 128): (128, 128, 16, 8, 3, 1, True, False),
    ("fp4", 16): (16, 64, 16, 4, 4, 4, False, True), ("fp4", 64): (64, 128, 16, 8, 3, 2, False, True),
    ("8bit", 16): (16, 64, 32, 4, 4, 4, False, False), ("8bit", 64): (64, 64, 32, 4, 3, 2, True, False),
    ("fp8", 16): (16, 64, 32, 4, 4, 4, False, False), ("fp8", 64): (64, 64, 32, 4, 3, 2, False, True),
}
DEQUANT_CONFIG = dict(BLOCK_N=32, BLOCK_WORDS=32, num_warps=4)


def family(lay: Layout) -> str:
    return {FMT_INT4: "int4", FMT_E2M1: "fp4", FMT_FP8: "fp8"}.get(lay.fmt, "8bit")


def m_bucket(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def pick_config(m: int, n: int, k: int, lay: Layout, sms: int, groups: int = 1) -> dict:
    """Launch configuration for an [m, k] x [n, k] product (``TUNED``: the family's entry for the M
    bucket or the nearest smaller one, else the int4 one); ``groups`` such products side by side (MoE
    experts of m rows each) share the GPU when K is split."""
    b, fam = m_bucket(m), family(lay)
    fams = (fam, "8bit", "int4") if fam == "fp8" else (fam, "int4")
    entry = next(TUNED[(f, bb)] for f in fams for bb in (b, 64, 32, 16) if bb <= b and (f, bb) in TUNED)
    bm, bn, words, warps, stages, waves, prefetch, xperm = entry
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=words * lay.epw, num_warps=warps, num_stages=stages,
               SCALE_PREFETCH=prefetch, X_PERMUTED=xperm)
    cfg["SPLIT_K"] = auto_split(m if groups == 1 else groups * -(-m // bm) * bm, n, k, cfg, sms, waves)
    return cfg


def auto_split(m: int, n: int, k: int, cfg: dict, sms: int, waves: float = 2.0) -> int:
    """Split K so that about ``waves`` x SMs programs run, each with >= 4 K steps."""
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    steps = -(-k // cfg["BLOCK_K"])
    split = max(1, min(round(waves * sms / tiles), steps // 4))
    return split


def _args(weight, scale, zero_point, g_idx, global_scale, spec: WeightSpec, n: int):
    """Tensors as the kernels read them: int32 words (canonical or tiled: the kernels' TILED), uint8
    fp8/e8m0 scales, row strides."""
    words = weight.contiguous().view(torch.int32)
    s = scale.contiguous()
    if s.dtype == torch.float8_e4m3fn:
        s = s.view(torch.uint8)
    gran = spec.scale.granularity
    stride_sn = 0 if gran is Granularity.TENSOR else (1 if gran is Granularity.CHANNEL else s.shape[-1])
    z = zero_point.contiguous() if zero_point is not None else None
    g = g_idx.contiguous() if g_idx is not None else None
    gs = global_scale.reshape(-1) if global_scale is not None else None
    return words, s, z, g, gs, stride_sn


def splits(k: int, cfg: dict) -> tuple[int, int]:
    """(the number of K splits that are not empty, K per split) of a launch configuration: whole
    BLOCK_K steps per split, the last split holds a partial last step where K % BLOCK_K != 0."""
    bk = cfg["BLOCK_K"]
    steps = -(-k // bk)
    k_split = -(-steps // cfg["SPLIT_K"]) * bk
    return -(-k // k_split), k_split


def fit_config(cfg: dict, k: int, spec: WeightSpec) -> dict:
    """``cfg`` as the kernel runs it at this K: where K % BLOCK_K != 0 (a partial last step), x is not
    permuted (``_permute_x_kernel`` moves whole steps) and tiled words (whose K wo_mma's rule makes a
    multiple of the layout's min_block_k) step by min_block_k, so that every step is whole."""
    if k % cfg["BLOCK_K"] == 0:
        return cfg
    cfg = dict(cfg, X_PERMUTED=False)
    if spec.tiled:
        bk = layout_of(spec).min_block_k
        if k % bk:
            raise UnsupportedError(f"tiled {spec.dtype.value} weights with K={k}, not a multiple of {bk}",
                                   where=OP, fix="keep such weights in the canonical layout")
        cfg["BLOCK_K"] = bk
    return cfg


def launch(x2: torch.Tensor, weight, scale, global_scale, zero_point, g_idx, bias, spec: WeightSpec, cfg: dict,
           dest: torch.Tensor, m: int, grid_m: int, **grouped) -> None:
    """One launch of ``_wo_gemm_kernel`` writing ``dest`` ([m, N] in x2.dtype, or fp32 partials
    [split, m, N]) with ``cfg`` as :func:`fit_config` gives it for this K (the caller sized ``dest`` from
    it). ``grouped``: the kernel's GROUPED arguments (:mod:`moe_wo`); the weight and its tensors are then
    stacked over experts, and their expert strides are filled in here."""
    k, n = x2.shape[1], weight.shape[-2]
    cfg = dict(cfg)
    lay = layout_of(spec)
    split, k_split = splits(k, cfg)
    del cfg["SPLIT_K"]
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    ptx = cfg.pop("PTX_DECODE", True) and x2.is_cuda
    natural = spec.tiled and quant_math.tiles_natural(spec)
    if cfg.pop("X_PERMUTED", False) and not natural:  # (natural tiles reorder x in registers)
        xp = torch.empty_like(x2)
        _permute_x_kernel[(x2.shape[0], k // cfg["BLOCK_K"])](x2, xp, k, BLOCK_K=cfg["BLOCK_K"], EPW=lay.epw,
                                                              num_warps=4)
        x2 = xp
        cfg["X_PERMUTED"] = True
    words, s, z, g, gs, stride_sn = _args(weight, scale, zero_point, g_idx, global_scale, spec, n)
    if grouped:
        grouped.update(GROUPED=True, stride_we=words.stride(0), stride_se=s.stride(0) if s.dim() else 0,
                       stride_ge=0 if g is None else g.stride(0), stride_be=0 if bias is None else bias.stride(0))
    grid = (grid_m, triton.cdiv(n, cfg["BLOCK_N"]), split)
    _wo_gemm_kernel[grid](
        x2, words, s, z, g, gs, bias, dest, m, n, k, words.shape[-1], stride_sn, k_split // lay.epw,
        FMT=lay.fmt, EPW=lay.epw, SCALE_KIND=lay.scale_kind, GROUP=lay.group, HAS_GS=gs is not None,
        HAS_ZP=z is not None, ACT_ORDER=g is not None, HAS_BIAS=bias is not None, PARTIAL=split > 1,
        EMULATE_DOT=not x2.is_cuda, PTX_DECODE=ptx, TILED=spec.tiled, NATURAL=natural,
        EVEN_K=k % cfg["BLOCK_K"] == 0, num_warps=warps, num_stages=stages, **cfg, **grouped)


def wo_gemm(x2: torch.Tensor, weight, scale, global_scale, zero_point, g_idx, bias, spec: WeightSpec,
            config: dict | None = None) -> torch.Tensor:
    """x2 [M, K] contiguous bf16/fp16 -> [M, N] x2.dtype through the Triton kernel (any M; the op
    switches to the dequant path above WO_MAX_M). ``config`` overrides :func:`pick_config`."""
    m, k = x2.shape
    n = weight.shape[0]
    cfg = fit_config(dict(config) if config else pick_config(m, n, k, layout_of(spec), _sm_count(x2.device)), k, spec)
    split, _ = splits(k, cfg)
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    launch(x2, weight, scale, global_scale, zero_point, g_idx, bias, spec, cfg, dest, m, triton.cdiv(m, cfg["BLOCK_M"]))
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            dest, bias, out, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def dequantize_triton(weight, scale, spec: WeightSpec, global_scale=None, zero_point=None, g_idx=None,
                      k: int | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[N, K] in ``dtype``: quant_math.dequantize_weight(...).to(dtype), in one Triton kernel
    (the same fp32 operations in the same order; bit-identical on the GPU). K: see triton_shape_reason
    (a partial last block is masked).
    A weight stacked over experts ([E, N, K'], every tensor with that leading E) gives [E, N, K]."""
    lay = layout_of(spec)
    n = weight.shape[-2]
    k = k or weight.shape[-1] * {Packing.NONE: 1, Packing.INT32: 32 // spec.dtype.bits, Packing.UINT8: 2}[spec.packing]
    words, s, z, g, gs, stride_sn = _args(weight, scale, zero_point, g_idx, global_scale, spec, n)
    out = torch.empty((*weight.shape[:-2], n, k), dtype=dtype, device=weight.device)
    grouped = {}
    if weight.dim() == 3:
        grouped = dict(GROUPED=True, stride_we=words.stride(0), stride_se=s.stride(0) if s.dim() else 0,
                       stride_ge=0 if g is None else g.stride(0))
    cfg = DEQUANT_CONFIG
    block_k, block_n = cfg["BLOCK_WORDS"] * lay.epw, cfg["BLOCK_N"]
    if k % block_k and k % lay.min_block_k == 0:
        block_k = lay.min_block_k
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k), weight.shape[0] if grouped else 1)](
        words, s, z, g, gs, out, n, k, words.shape[-1], stride_sn,
        FMT=lay.fmt, EPW=lay.epw, SCALE_KIND=lay.scale_kind, GROUP=lay.group, HAS_GS=gs is not None,
        HAS_ZP=z is not None, ACT_ORDER=g is not None, BLOCK_N=block_n, BLOCK_K=block_k, TILED=spec.tiled,
        NATURAL=spec.tiled and quant_math.tiles_natural(spec), EVEN_K=k % block_k == 0, num_warps=cfg["num_warps"],
        **grouped)
    return out


def triton_shape_reason(spec: WeightSpec, n: int, k: int) -> str | None:
    """What the Triton kernels need of the shape, beyond :func:`wo_reason`: K in whole 32-bit words and
    whole scale groups (a partial last K step is masked)."""
    lay = layout_of(spec)
    if k % lay.epw:
        return f"K={k} not a multiple of {lay.epw} (the {spec.dtype.bits}-bit elements of a 32-bit word)"
    if lay.group and k % lay.group:
        return f"K={k} not a multiple of the group size {lay.group}"
    return None


# -- the op ----------------------------------------------------------------------------------------

_WEIGHT_DTYPES = {Packing.INT32: (torch.int32,), Packing.UINT8: (torch.uint8,)}
_SCALE_DTYPES = {ScaleDtype.FP32: torch.float32, ScaleDtype.FP8_E4M3: torch.float8_e4m3fn,
                 ScaleDtype.E8M0: torch.uint8}


def validate(k: int, weight, scale, global_scale, zero_point, g_idx, spec: QuantScheme, scheme: str,
             where: str = OP, lead: tuple = (), prefix: str = ""):
    """UnsupportedError naming the tensor unless the canonical tensors of an [N, K] weight (``lead``: the
    leading dims of stacked experts, ``prefix``: their names' prefix) are what the kernels read."""
    why = wo_reason(spec)
    if why:
        raise UnsupportedError(why, where=where)
    w = spec.weight
    n = weight.shape[len(lead)] if weight.dim() > len(lead) else 0
    lead, ld = tuple(lead), list(lead)
    wdt = _WEIGHT_DTYPES.get(w.packing) or ((torch.int8,) if w.dtype is QDtype.INT8 else (torch.float8_e4m3fn,))
    want = lead + canonical_shape("weight", spec, n, k)
    if weight.dtype not in wdt or tuple(weight.shape) != want:
        raise UnsupportedError(f"{prefix}weight must be {wdt[0]} {list(want)} for K={k}, got {weight.dtype} "
                               f"{list(weight.shape)}", where=where)
    want = lead + canonical_shape("weight_scale", spec, n, k)
    if tuple(scale.shape) != want or scale.dtype != _SCALE_DTYPES[w.scale.dtype]:
        raise UnsupportedError(f"{prefix}weight_scale must be {_SCALE_DTYPES[w.scale.dtype]} {list(want)}, got "
                               f"{scale.dtype} {list(scale.shape)}", where=where,
                               fix="normalize scales at load (scheme.canonical_shape)")
    for name, t, needed in (("weight_global_scale", global_scale, w.global_scale),
                            ("weight_zero_point", zero_point, w.zero_point),
                            ("weight_g_idx", g_idx, w.act_order or w.k_sorted)):
        if (t is not None) != needed:
            raise UnsupportedError(f"scheme {scheme} {'needs' if needed else 'has no'} {prefix}{name}", where=where)
    if lead and global_scale is not None and tuple(global_scale.shape) != lead:
        raise UnsupportedError(f"{prefix}weight_global_scale must be {ld}, got {list(global_scale.shape)}", where=where)
    if zero_point is not None and tuple(zero_point.shape) != tuple(scale.shape):
        raise UnsupportedError(f"{prefix}weight_zero_point shape {list(zero_point.shape)} != scale shape", where=where)
    if g_idx is not None and tuple(g_idx.shape) != lead + (k,):
        raise UnsupportedError(f"{prefix}weight_g_idx must be {ld + [k]}, got {list(g_idx.shape)}", where=where)


def _dequant(x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec):
    n, k = weight.shape[0], x2.shape[1]
    if x2.is_cuda and HAS_TRITON and triton_shape_reason(spec, n, k) is None:
        w = dequantize_triton(weight, scale, spec, gs, zp, g_idx, k, x2.dtype)
    else:
        w = quant_math.dequantize_weight(weight, scale, spec, gs, zp, g_idx, k).to(x2.dtype)
    return F.linear(x2, w, None if bias is None else bias.to(x2.dtype))


def _triton(x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec):
    if not use_triton(x2):
        raise UnsupportedError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x2.device}",
                               where=OP, fix="use backend='dequant'")
    why = triton_shape_reason(spec, weight.shape[0], x2.shape[1])
    if why:
        raise UnsupportedError(f"backend 'triton': {why}", where=OP, fix="use backend='dequant'")
    if x2.shape[0] > WO_MAX_M[family(layout_of(spec))]:
        return _dequant(x2, weight, scale, gs, zp, g_idx, bias, spec)
    return wo_gemm(x2, weight, scale, gs, zp, g_idx, bias, spec)


def _mma(x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec):
    """The CUDA C++ kernel (wo_mma.cu) for bf16 / fp16 x: a measured choice for this shape where there is
    one (:mod:`wo_tune`), else the policy's route (:func:`_mma_policy`)."""
    args = (x2, weight, scale, gs, zp, g_idx, bias, spec)
    if wo_tune.on_gpu(x2):
        key = wo_tune.key_of(spec, x2.dtype, weight.shape[0], x2.shape[1], x2.shape[0])
        choice = wo_tune.lookup(wo_tune.gpu_name(x2), key)
        if choice is None and key is not None and wo_tune.enabled() and wo_tune.can_measure(x2):
            times = tune_call(*args)
            choice = wo_tune.best(times)
        if choice is not None:
            return run_choice(choice, *args)
    return _mma_policy(*args)


def _mma_policy(x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec):
    """The kernel where the policy gives it the rows (wo_policy.mma_rows: one launch, or on sm_90 row
    blocks); everything else as ``triton`` (or ``dequant`` where Triton cannot run it)."""
    n, k = weight.shape[0], x2.shape[1]
    if x2.is_cuda and wo_mma.mma_reason(spec, n, k, x2.dtype, None if zp is None else zp.dtype) is None:
        rows = wo_policy.mma_rows(spec, x2.shape[0], wo_mma.capability(x2.device))
        if rows is not None and len(rows) == 1:
            return wo_mma.wo_mma(x2, weight, scale, gs, zp, bias, spec)
        if rows:
            return wo_mma.wo_mma_blocked(x2, weight, scale, gs, zp, bias, spec, rows)
    if use_triton(x2) and triton_shape_reason(spec, n, k) is None:
        return _triton(x2, weight, scale, gs, zp, g_idx, bias, spec)
    return _dequant(x2, weight, scale, gs, zp, g_idx, bias, spec)


def run_choice(choice: wo_tune.Choice, x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec):
    """The call run as ``choice`` says; where that route cannot run it (no such build at this M, a shape
    the kernel does not take), as the policy says."""
    n, k = weight.shape[0], x2.shape[1]
    if choice.route == "mma" and wo_mma.mma_reason(spec, n, k, x2.dtype, None if zp is None else zp.dtype) is None:
        try:
            launch = wo_mma.decide(x2, weight, gs, zp, bias, spec, **choice.launch)
        except (ValueError, TypeError):
            launch = None
        if launch is not None:
            return wo_mma.run(launch, x2, weight, scale, gs, zp, bias, spec)
    elif choice.route == "triton" and use_triton(x2) and triton_shape_reason(spec, n, k) is None:
        return wo_gemm(x2, weight, scale, gs, zp, g_idx, bias, spec)
    elif choice.route == "dequant":
        return _dequant(x2, weight, scale, gs, zp, g_idx, bias, spec)
    return _mma_policy(x2, weight, scale, gs, zp, g_idx, bias, spec)


def weight_copies(args: tuple) -> list[tuple]:
    """``args`` (a call's x2, weight, scale, global scale, zero point, g_idx, bias, spec) and copies of it with
    their own weight, scale and zero-point tensors (:func:`wo_tune.copies_for`), for graph-timed tuning; fewer
    where the device runs out of memory for them."""
    x2, weight, scale, gs, zp, g_idx, bias, spec = args
    nbytes = sum(t.numel() * t.element_size() for t in (weight, scale, zp) if t is not None)
    out = [args]
    try:
        for _ in range(wo_tune.copies_for(nbytes) - 1):
            out.append((x2, weight.clone(), scale.clone(), gs, None if zp is None else zp.clone(), g_idx, bias, spec))
    except torch.OutOfMemoryError:
        pass
    return out


def tune_call(x2, weight, scale, gs, zp, g_idx, bias, spec: WeightSpec, reps: int = 20,
              keep: bool = True) -> dict:
    """µs of every candidate route of this call (:func:`wo_tune.candidates`), per call in a CUDA graph cycling
    through copies of its weights (:func:`weight_copies`, :func:`wo_tune.measure`) once its output has passed
    :func:`wo_tune.output_check`; with ``keep`` the fastest is added to the on-disk cache under the call's M bucket."""
    args = (x2, weight, scale, gs, zp, g_idx, bias, spec)
    m, n, k = x2.shape[0], weight.shape[0], x2.shape[1]
    mma_ok = wo_mma.mma_reason(spec, n, k, x2.dtype, None if zp is None else zp.dtype) is None
    triton_ok = use_triton(x2) and triton_shape_reason(spec, n, k) is None
    cands = wo_tune.candidates(spec, m, mma_ok, triton_ok, wo_mma.capability(x2.device),
                               lambda **kw: wo_mma.decide(x2, weight, gs, zp, bias, spec, **kw))
    copies = weight_copies(args)
    runs = [lambda c, a=a: run_choice(c, *a) for a in copies]
    check = wo_tune.output_check(runs[0])
    times = wo_tune.measure(cands, runs if len(runs) > 1 else runs[0], reps, check)  # (one: L2 flushed)
    del copies, runs
    choice = wo_tune.best(times)
    key = wo_tune.key_of(spec, x2.dtype, n, k, m)
    if keep and key is not None:
        figures = {"us": round(times[choice], 2), "policy_us": round(times.get(wo_tune.Choice("policy"), 0.0), 2)}
        wo_tune.store(wo_tune.gpu_name(x2), key, choice, figures)
    return times


_IMPLS = {"mma": _mma, "triton": _triton, "dequant": _dequant}


@torch.library.custom_op(OP, mutates_args=())
def wo_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              weight_global_scale: torch.Tensor | None, weight_zero_point: torch.Tensor | None,
              weight_g_idx: torch.Tensor | None, bias: torch.Tensor | None, scheme: str, backend: str) -> torch.Tensor:
    spec = parse_scheme_key(scheme)
    validate(x.shape[-1], weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, spec, scheme)
    impl = _IMPLS.get(backend)
    if impl is None:
        raise unknown_backend(OP, backend, BACKENDS)
    if x.dtype not in HALF:
        raise UnsupportedError(f"x must be bf16 or fp16, got {x.dtype}", where=OP,
                               fix="the kernel registry runs other activation dtypes on the reference op")
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    w = spec.weight
    if w.k_sorted:  # act-order sorted at load: x's columns in the stored order, then plain groups
        x2, weight_g_idx, w = x2.index_select(1, weight_g_idx), None, replace(w, k_sorted=False)
    out = impl(x2, weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, bias, w)
    return out.reshape(*lead, n)


@wo_linear.register_fake
def _(x, weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, bias, scheme, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register_straight_through(OP)


# -- registry --------------------------------------------------------------------------------------

def check_triton(q: KernelQuery) -> str | None:
    why = wo_reason(q.scheme)
    if why:
        return why
    return cuda_reason(q, (8, 0)) or triton_shape_reason(q.scheme.weight, q.n, q.k)


def check_mma(q: KernelQuery) -> str | None:
    why = wo_reason(q.scheme) or cuda_reason(q, (8, 0))
    return why or wo_mma.mma_reason(q.scheme.weight, q.n, q.k, q.act_dtype)


def check_dequant(q: KernelQuery) -> str | None:
    if q.scheme.act is not None and q.device != "cuda":
        # Dropping activation quantization buys speed only on a GPU; elsewhere stay faithful.
        return f"the scheme quantizes activations; on {q.device} the faithful reference is as fast"
    return wo_reason(q.scheme)


WO_MMA = register(Kernel(
    name="wo_mma", op=OP, backend="mma", priority=30, check=check_mma, act_dtypes=HALF, computes=wo_reason,
    layouts=("ksorted", "tiled"),  # it takes no g_idx; the tiled order streams ~25 % faster (docs/kernels-wo.md)
    description="CUDA C++ (NVRTC) tensor-core weight-only GEMM for M <= 32 (sm_90: 128, int4 96; up to 512 "
                "int4 / 384 as launches of 128 rows), else as wo_triton",
))
WO_TRITON = register(Kernel(
    name="wo_triton", op=OP, backend="triton", priority=28, check=check_triton, requires=("triton",),
    act_dtypes=HALF, computes=wo_reason, layouts=("ksorted",),  # its g_idx lookup: 13x slower than groups
    description="Triton split-K weight-only GEMM (M <= WO_MAX_M of the format), else Triton dequant + F.linear",
))
WO_DEQUANT = register(Kernel(
    name="wo_dequant", op=OP, backend="dequant", priority=12, check=check_dequant, act_dtypes=HALF, computes=wo_reason,
    description="dequantize to x.dtype + F.linear (any device)",
))
