"""``qcompile::fused_moe``: a fused Mixture-of-Experts layer with FP8 or INT8 expert weights, in Triton.

Math (:func:`fused_moe_reference`, fp32; also the CPU path): for each token ``t`` and each of its
``k`` experts ``e = topk_ids[t, j]``

    h   = act(qdq(x_t) @ deq(w13[e]).T)          gated: act(h[:I]) * h[I:] (w13 rows: gate, then up)
    y   = qdq(h) @ deq(w2[e]).T                  h held in x.dtype between the GEMMs, as vLLM does
    out_t = sum_j topk_weights[t, j] * y         (with apply_router_weight_on_input the weight
                                                  multiplies x_t before the first GEMM instead)

``qdq`` quantizes activations as the scheme says (a :class:`~qcompile.scheme.QuantScheme` key):

===================  =========================  ====================================================
weights              scales (fp32, multiply)    activations (x and h alike)
===================  =========================  ====================================================
fp8_e4m3             [E] / [E, N] / 128x128     fp8: static per tensor (a13/a2_scale, 0-d), dynamic
                     blocks [E, N/128, K/128]   per tensor, per token, or per 1x128 group; scale
                                                amax / 448 (at least 1/(448*512))
int8 (symmetric)     [E] / [E, N]               int8: static per tensor, or dynamic per token with
                                                scale amax / 127; codes round-half-even, [-128, 127]
===================  =========================  ====================================================

Expert ids outside ``[0, E)`` (another rank's experts) contribute nothing.

Kernels (:func:`fused_moe`), per layer call:

1. ``moe_align`` (:mod:`moe_align`): pairs grouped per expert in blocks of ``block_m`` rows; or, in
   ``per_pair`` mode (decode), none: each program takes one pair and reads its expert's weights.
2. Activation quantization: in the GEMM's prologue (``fuse_quant``: static, per-token and group
   scales) or one separate kernel (the only way for dynamic per-tensor scales).
3. GEMM 1 (``_moe_gemm_kernel``): the gate and the up tile of each output column block in one
   program, the activation in the epilogue; writes h [T·k, I] in x.dtype (rows by pair).
4. GEMM 2: the same kernel without activation; the router weight in the epilogue; writes
   y [split_k, T·k, H] (fp32 partials when split over K, else x.dtype).
5. ``_moe_sum_kernel``: out[t] = sum over j (then splits) of y[., t·k + j] in a fixed order: no
   atomics, deterministic.

The GEMM computes acc^T = W · A^T when ``swap`` (the weight tile is the MMA's M side: Hopper's
wgmma wants M >= 64, and decode has 1..16 rows) and A · W^T otherwise; FP8 x FP8 and INT8 x INT8
run on the tensor cores (fp32 / int32 accumulation); per-tensor / channel / token scales multiply
the accumulator once, 128x128-block and 1x128-group scales every K step (``BLOCK_K`` = 128).
Launch parameters: :class:`MoeConfig`, from the :func:`tune` cache, the ``TUNED`` table or
:func:`default_config`. Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..scheme import Granularity, QDtype, QuantScheme, ScaleDtype, parse_scheme_key
from . import fp8_quant_triton as fq
from . import quant_math
from .fp8_quant_triton import HAS_TRITON, interpreting, use_triton
from .moe_kernels import A_CODES, A_DYNAMIC, A_STATIC, G_BLOCK, G_ROW, G_TENSOR, align_sizes, moe_align

if HAS_TRITON:
    import triton

    from .moe_kernels import _moe_gemm_kernel, _moe_sum_kernel, _quant_rows_kernel

OP = "qcompile::fused_moe"
BACKENDS = ("reference", "triton")
# name -> (kernel code, gated)
ACTIVATIONS = {"silu": (1, True), "gelu_tanh": (2, True), "silu_no_mul": (1, False),
               "gelu_tanh_no_mul": (2, False), "relu2_no_mul": (3, False)}
INT8_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row must not divide by zero


# -- schemes and inputs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeQuant:
    """What the kernels need of a scheme: element type, weight / activation scale granularity."""

    scheme: QuantScheme
    int8: bool
    w_gran: int  # G_TENSOR / G_ROW (channel) / G_BLOCK (128x128)
    a_gran: int  # G_TENSOR / G_ROW (token) / G_BLOCK (1x128 group)
    a_static: bool

    @property
    def per_step(self) -> bool:
        """Scales change along K (block weights or group activations): BLOCK_K must be 128."""
        return G_BLOCK in (self.w_gran, self.a_gran)

    @property
    def kind(self) -> str:
        return "int8" if self.int8 else "fp8_block" if self.per_step else "fp8"


def moe_quant(scheme: str) -> MoeQuant:
    """The :class:`MoeQuant` of a scheme key, or UnsupportedError naming what the kernels lack."""
    spec = parse_scheme_key(scheme)
    w, a = spec.weight, spec.act
    fix = "use an FP8 W8A8 (fp8_e4m3 weights and activations) or INT8 W8A8 scheme"
    if w.dtype not in (QDtype.FP8_E4M3, QDtype.INT8) or a is None or a.dtype is not w.dtype:
        what = "weight-only" if a is None else f"{a.dtype.value} activations"
        raise UnsupportedError(f"scheme {scheme} ({w.dtype.value} weights, {what}) is not FP8 or INT8 W8A8",
                               where=OP, fix=fix)
    if (w.packing.value != "none" or w.zero_point or w.act_order or w.global_scale or w.tiled
            or w.scale.dtype is not ScaleDtype.FP32 or a.scale.dtype is not ScaleDtype.FP32
            or not a.symmetric or a.global_scale):
        raise UnsupportedError(f"scheme {scheme}: packed / zero-point / act-order / globally scaled weights or "
                               "non-fp32 scales are not run by the fused MoE kernels", where=OP, fix=fix)
    wg = {Granularity.TENSOR: G_TENSOR, Granularity.CHANNEL: G_ROW, Granularity.BLOCK: G_BLOCK}.get(w.scale.granularity)
    ag = {Granularity.TENSOR: G_TENSOR, Granularity.TOKEN: G_ROW, Granularity.GROUP: G_BLOCK}.get(a.scale.granularity)
    if wg is None or (wg == G_BLOCK and w.scale.block != (128, 128)):
        raise UnsupportedError(f"scheme {scheme}: weight scales {w.scale.key()} (tensor, channel or 128x128 blocks "
                               "expected)", where=OP)
    if ag is None or (ag == G_BLOCK and a.scale.group_size != 128) or (not a.dynamic and ag != G_TENSOR):
        raise UnsupportedError(f"scheme {scheme}: activation scales {a.key()} (static per tensor, or dynamic per "
                               "tensor, token or 1x128 group expected)", where=OP)
    int8 = w.dtype is QDtype.INT8
    if int8 and (wg == G_BLOCK or ag == G_BLOCK or (a.dynamic and ag == G_TENSOR)):
        raise UnsupportedError(f"scheme {scheme}: INT8 runs per-tensor / per-channel weights with static per-tensor "
                               "or dynamic per-token activations", where=OP)
    return MoeQuant(spec, int8, wg, ag, not a.dynamic)


def _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                  q: MoeQuant, activation: str) -> tuple[int, int, int, int, int]:
    """(T, H, I, E, k) after checking every tensor against the scheme; UnsupportedError naming the
    tensor otherwise."""
    def bad(what, fix=None):
        raise UnsupportedError(what, where=OP, fix=fix)

    if activation not in ACTIVATIONS:
        bad(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        bad(f"x must be a float [T, H] tensor, got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        bad(f"topk_ids must be int32/int64 [T={t}, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        bad(f"topk_weights must be float [T={t}, k={k}], got {topk_weights.dtype} {list(topk_weights.shape)}")
    wdt = torch.int8 if q.int8 else torch.float8_e4m3fn
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != wdt or w2.dtype != wdt:
        bad(f"w13 [E, N1, H] and w2 [E, H, I] must be {wdt}, got {w13.dtype} {list(w13.shape)} and "
            f"{w2.dtype} {list(w2.shape)}")
    e, n1, _ = w13.shape
    i = w2.shape[2]
    gated = ACTIVATIONS[activation][1]
    if w13.shape[2] != h or tuple(w2.shape[:2]) != (e, h) or n1 != (2 * i if gated else i):
        bad(f"w13 {list(w13.shape)} and w2 {list(w2.shape)} do not fit x [T, H={h}] with "
            f"{'gated' if gated else 'non-gated'} activation {activation!r} (w13 [E, {'2I' if gated else 'I'}, H], "
            "w2 [E, H, I])")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        bad("w13 and w2 must be contiguous along their last dimension")
    for name, s, n, kk in (("w13_scale", w13_scale, n1, h), ("w2_scale", w2_scale, h, i)):
        want = {G_TENSOR: (e,), G_ROW: (e, n), G_BLOCK: (e, -(-n // 128), -(-kk // 128))}[q.w_gran]
        if tuple(s.shape) != want or s.dtype != torch.float32:
            bad(f"{name} must be fp32 {list(want)} for scheme {q.scheme.key}, got {s.dtype} {list(s.shape)}",
                "normalize scales at load (per tensor [E], per channel [E, N], 128x128 blocks [E, N/128, K/128])")
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if q.a_static and (s is None or s.numel() != 1):
            bad(f"scheme {q.scheme.key} has static activation scales but {name} is "
                f"{'None' if s is None else list(s.shape)}", "pass the per-tensor input scale (0-d fp32)")
    if q.a_gran == G_BLOCK and (h % 128 or i % 128):
        bad(f"H={h} and I={i} must be multiples of the 128-wide activation groups")
    return t, h, i, e, k


# -- launch parameters -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1  # K split over programs (fp32 partials summed by the final reduction; GEMM 2 only)
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = True  # acc^T = W A^T: the weight tile is the MMA's M side
    fuse_quant: bool = True  # quantize A in the prologue instead of a separate kernel


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    per_pair: bool = False  # GEMM 1 (and 2): one program per (token, expert) pair, no alignment (decode)
    gemm1: GemmConfig = GemmConfig()
    gemm2: GemmConfig = GemmConfig()
    # GEMM 2: one program per token runs its k experts in turn and sums them (no top-k sum kernel)
    fold_topk: bool = False

    def to_dict(self) -> dict:
        return {"block_m": self.block_m, "per_pair": self.per_pair, "gemm1": vars(self.gemm1).copy(),
                "gemm2": vars(self.gemm2).copy(), "fold_topk": self.fold_topk}

    @staticmethod
    def from_dict(d: dict) -> "MoeConfig":
        return MoeConfig(d["block_m"], d["per_pair"], GemmConfig(**d["gemm1"]), GemmConfig(**d["gemm2"]),
                         d.get("fold_topk", False))


# Measured winners of :func:`tune` (config_key -> MoeConfig.to_dict()); looked up after the on-disk cache.
TUNED: dict[str, dict] = {}


def config_key(kind: str, e: int, h: int, i: int, k: int, t: int, gated: bool = True) -> str:
    """The table key: scheme kind (fp8 / fp8_block / int8), shape, top-k, tokens rounded up to a power of 2."""
    return f"{kind}/E{e}/H{h}/I{i}/k{k}/T{1 << max(0, (t - 1).bit_length())}" + ("" if gated else "/nogate")


def default_config(q: MoeQuant, e: int, h: int, i: int, k: int, t: int, num_sms: int = 132) -> MoeConfig:
    """The rule without measurements. Decode (few rows per expert): 16-row tiles, weights as the MMA's
    M side, quantization in the prologue, enough programs for every SM (narrower column tiles for GEMM
    1, split-K for GEMM 2); pairs unaligned while they are few enough to hit distinct experts, and
    then GEMM 2 folds the top-k sum (3 launches become 2). Prefill: 64- or 128-row tiles, activations
    quantized once by a separate kernel."""
    p = t * k
    rows = p / max(1, min(e, p))  # rows per active expert
    per_pair = p <= max(2, e // 4)
    bm = 16 if per_pair or rows <= 16 else 32 if rows <= 32 else 64 if rows <= 96 or q.per_step else 128
    small = bm <= 32
    blocks = p if per_pair else min(e, p) * math.ceil(rows / bm)
    # (sm_90 with ptxas: 8 warps keep 64-128 row tiles below 255 registers, block scales included)
    warps, stages = (4, 4) if small else (8, 3)
    bn1 = 64 if not small or blocks * math.ceil(i / 64) >= num_sms else 32
    g1 = GemmConfig(bn1, 128, 1, warps, stages, small, small)
    bn2 = 64 if small else 128
    split = 1
    while small and blocks * math.ceil(h / bn2) * split < 2 * num_sms and i // (2 * split) >= 512:
        split *= 2
    g2 = GemmConfig(bn2, 128, split, warps, stages, small, small)
    if per_pair:  # GEMM 2 per token: narrow column tiles (and split-K) for programs enough
        bn2 = next((b for b in (64, 32) if t * math.ceil(h / b) >= num_sms), 16)
        split = 1
        while t * math.ceil(h / bn2) * split < num_sms and i // (2 * split) >= 2048:
            split *= 2
        g2 = GemmConfig(bn2, 128 if q.per_step else 256, split, 4, 4, True, True)
    return MoeConfig(bm, per_pair, g1, g2, per_pair)


def normalize_config(cfg: MoeConfig, q: MoeQuant, gated: bool) -> MoeConfig:
    """``cfg`` made valid for the scheme: 128-wide K steps under per-step scales, no split of a gated
    GEMM 1, 16-row tiles per pair, separate quantization for dynamic per-tensor scales."""
    fuse_ok = q.a_static or q.a_gran != G_TENSOR

    def fix(g: GemmConfig, split_ok: bool) -> GemmConfig:
        return GemmConfig(g.block_n, 128 if q.per_step else g.block_k, g.split_k if split_ok else 1, g.num_warps,
                          g.num_stages, g.swap, g.fuse_quant and fuse_ok)

    return MoeConfig(16 if cfg.per_pair else cfg.block_m, cfg.per_pair, fix(cfg.gemm1, not gated),
                     fix(cfg.gemm2, True), cfg.fold_topk)


_CACHE: dict | None = None


def cache_path() -> Path:
    """Where :func:`tune` keeps its winners: {device name: {config_key: config}}."""
    return Path.home() / ".cache" / "qcompile" / "fused_moe.json"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"


def _cached(device: torch.device) -> dict:
    global _CACHE
    if _CACHE is None:
        try:
            _CACHE = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _CACHE = {}
    return _CACHE.get(_device_name(device), {})


@functools.lru_cache(maxsize=1024)
def get_config(q: MoeQuant, e: int, h: int, i: int, k: int, t: int, gated: bool, device: torch.device) -> MoeConfig:
    """The tuned config of this device (on-disk cache), else the ``TUNED`` table, else :func:`default_config`."""
    key = config_key(q.kind, e, h, i, k, t, gated)
    found = _cached(device).get(key) or TUNED.get(key)
    if found is not None:
        cfg = MoeConfig.from_dict(found)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        cfg = default_config(q, e, h, i, k, t, sms)
    return normalize_config(cfg, q, gated)


# -- the Triton pipeline ---------------------------------------------------------------------------

def _native_fp8(x: torch.Tensor) -> bool:
    return x.is_cuda and not interpreting()


def _act_operand(a: torch.Tensor, q: MoeQuant, static_scale, fuse: bool):
    """A operand of a GEMM from x.dtype rows ``a`` [M, K]: (tensor, scale, A mode, scale strides (row, group)).
    Fused: ``a`` itself, quantized in the GEMM's prologue. Else quantized here by one kernel."""
    if static_scale is not None:
        static_scale = static_scale.reshape(()).float()
    if fuse:
        mode = A_STATIC if q.a_static else A_DYNAMIC
        return a, static_scale if q.a_static else a, mode, 0, 0
    if q.int8:
        m, k = a.shape
        codes = torch.empty((m, k), dtype=torch.int8, device=a.device)
        scale = static_scale if q.a_static else torch.empty(m, dtype=torch.float32, device=a.device)
        _quant_rows_kernel[(m,)](a, codes, scale, k, INT8=True, STATIC=q.a_static, NATIVE_FP8=False,
                                 BLOCK_K=min(_pow2(k), 4096), num_warps=4)
        return codes, scale, A_CODES, 1, 0
    codes, scale = fq.quantize(a, q.scheme.act, static_scale)
    if q.a_gran == G_TENSOR:
        return codes, scale, A_CODES, 0, 0
    return codes, scale, A_CODES, scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _splits(k: int, g: GemmConfig) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits that are not empty)."""
    k_split = -(-(-(-k // g.split_k)) // g.block_k) * g.block_k
    return k_split, -(-k // k_split)


def _gemm(a, a_scale, a_mode, a_strides, a_div, w, w_scale, out, route, rows, q: MoeQuant, g: GemmConfig,
          n: int, k: int, act: int, gated: bool, per_pair: bool, block_m: int, num_pairs: int, fold_topk: int = 0):
    """One launch of the grouped GEMM: out[split, pair, :n] for every pair of ``rows`` (sorted_ids,
    block_expert) or, per pair, (None, topk_ids flat); out[split, token, :n] when folding ``fold_topk``
    pairs per token. Returns the number of K splits."""
    sorted_ids, experts = rows
    k_split, splits = _splits(k, g)
    ws = [w_scale.stride(d) if d < w_scale.dim() else 0 for d in range(3)]
    grid = (experts.numel() // max(1, fold_topk), triton.cdiv(n, g.block_n), splits)
    _moe_gemm_kernel[grid](
        a, a_scale, w, w_scale, out, sorted_ids if sorted_ids is not None else experts, experts,
        route if route is not None else a_scale, n, k, num_pairs, w.shape[0], a_div, n if gated else 0, k_split,
        a.stride(0), a_strides[0], a_strides[1], w.stride(0), w.stride(1), ws[0], ws[1], ws[2],
        out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        W_INT8=q.int8, W_GRAN=q.w_gran, A_GRAN=q.a_gran, A_MODE=a_mode, GATED=gated, ACT=act,
        ROUTE=route is not None, PER_PAIR=per_pair, FOLD_TOPK=fold_topk, SWAP=g.swap, NATIVE_FP8=_native_fp8(a),
        BLOCK_M=block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, num_warps=g.num_warps, num_stages=g.num_stages)
    return splits


def fused_moe(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale=None, a2_scale=None, *,
              scheme: str, activation: str = "silu", apply_router_weight_on_input: bool = False,
              config: MoeConfig | None = None) -> torch.Tensor:
    """The MoE layer of the module doc with the Triton kernels (CUDA, or CPU under the interpreter;
    elsewhere :func:`fused_moe_reference`). ``config``: launch parameters (default: :func:`get_config`)."""
    q = moe_quant(scheme)
    t, h, i, e, k = _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                  q, activation)
    if not use_triton(x):
        return fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                   scheme=scheme, activation=activation,
                                   apply_router_weight_on_input=apply_router_weight_on_input)
    act, gated = ACTIVATIONS[activation]
    cfg = normalize_config(config or get_config(q, e, h, i, k, t, gated, x.device), q, gated)
    p, dev = t * k, x.device
    if t == 0:
        return x.new_empty((0, h))
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    route = topk_weights.reshape(-1).contiguous()
    rows = (None, ids) if cfg.per_pair else moe_align(topk_ids, e, cfg.block_m)
    if apply_router_weight_on_input:  # the weight scales each pair's copy of x before quantization
        a1, a_div, route2 = (x.float().unsqueeze(1) * topk_weights.float().unsqueeze(2)).reshape(p, h), 1, None
    else:
        a1, a_div, route2 = x, k, route
    common = dict(q=q, per_pair=cfg.per_pair, block_m=cfg.block_m, num_pairs=p)
    a, s, mode, strides = _unpack(_act_operand(a1, q, a13_scale, cfg.gemm1.fuse_quant))
    # h rows of pairs without a local expert stay zero where a dynamic per-tensor scale reads all rows
    hid = (torch.zeros if q.a_gran == G_TENSOR and not q.a_static else torch.empty)((p, i), dtype=x.dtype, device=dev)
    _gemm(a, s, mode, strides, a_div, w13, w13_scale, hid, None, rows, g=cfg.gemm1, n=i, k=h, act=act, gated=gated,
          **common)
    a, s, mode, strides = _unpack(_act_operand(hid, q, a2_scale, cfg.gemm2.fuse_quant))
    split = _splits(i, cfg.gemm2)[1]
    out = torch.empty((t, h), dtype=x.dtype, device=dev)
    if cfg.fold_topk and split == 1:  # GEMM 2 writes the output itself
        _gemm(a, s, mode, strides, 1, w2, w2_scale, out, route2, (None, ids), g=cfg.gemm2, n=h, k=i, act=0,
              gated=False, fold_topk=k, **common)
        return out
    rows_out = t if cfg.fold_topk else p
    part = torch.empty((split, rows_out, h), dtype=torch.float32 if split > 1 else x.dtype, device=dev)
    _gemm(a, s, mode, strides, 1, w2, w2_scale, part, route2, (None, ids) if cfg.fold_topk else rows, g=cfg.gemm2,
          n=h, k=i, act=0, gated=False, fold_topk=k if cfg.fold_topk else 0, **common)
    block_h = min(_pow2(h), 512)
    _moe_sum_kernel[(t, triton.cdiv(h, block_h))](part, ids, out, h, e, part.stride(0), TOPK=1 if cfg.fold_topk else k,
                                                  SPLIT=split, CHECK_IDS=not cfg.fold_topk, BLOCK_H=block_h,
                                                  num_warps=4)
    return out


def _unpack(operand):
    a, s, mode, srow, sgrp = operand
    return a, s, mode, (srow, sgrp)


# -- the reference ---------------------------------------------------------------------------------

def _qdq(a: torch.Tensor, q: MoeQuant, static_scale) -> torch.Tensor:
    """Quantize-dequantize activation rows a [M, K] (fp32) as the scheme says."""
    if not q.int8:
        return quant_math.qdq_activation(a, q.scheme.act, static_scale)
    if q.a_static:
        s = static_scale.float().reshape(())
    else:
        amax = a.abs().amax(dim=-1, keepdim=True)
        s = (amax / torch.full_like(amax, 127.0)).clamp(min=INT8_MIN_SCALE)
    return torch.round(a / s).clamp(-128, 127) * s


def _dequant(w: torch.Tensor, s: torch.Tensor, q: MoeQuant) -> torch.Tensor:
    """One expert's weight [N, K] in fp32 from its codes and its scale ([] / [N] / [N/128, K/128])."""
    n, k = w.shape
    gran = {G_TENSOR: Granularity.TENSOR, G_ROW: Granularity.CHANNEL, G_BLOCK: Granularity.BLOCK}[q.w_gran]
    return w.float() * quant_math.expand_scale(s, gran, n, k, block=(128, 128))


def _activation_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    code, gated = ACTIVATIONS[activation]
    if gated:
        g, up = g.chunk(2, dim=-1)
    y = {1: F.silu, 2: lambda v: F.gelu(v, approximate="tanh"), 3: lambda v: F.relu(v).square()}[code](g)
    return y * up if gated else y


def fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale=None, a2_scale=None, *,
                        scheme: str, activation: str = "silu",
                        apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The math of the module doc in fp32 on any device (a loop over the experts that have pairs)."""
    q = moe_quant(scheme)
    t, h, i, e, k = _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                  q, activation)
    p, dev = t * k, x.device
    ids = topk_ids.reshape(-1).long()
    route = topk_weights.reshape(-1).float()
    tok = torch.arange(p, device=dev) // k
    if apply_router_weight_on_input:
        a1, a_row = x.float()[tok] * route[:, None], torch.arange(p, device=dev)
    else:
        a1, a_row = x.float(), tok
    a1 = _qdq(a1, q, a13_scale)
    experts = [(j, (ids == j).nonzero().flatten()) for j in ids[(ids >= 0) & (ids < e)].unique().tolist()]
    hid = torch.zeros((p, i), device=dev)
    for j, sel in experts:
        hid[sel] = _activation_ref(a1[a_row[sel]] @ _dequant(w13[j], w13_scale[j], q).t(), activation)
    hid = _qdq(hid.to(x.dtype).float(), q, a2_scale)  # h is held in x.dtype between the GEMMs
    y = torch.zeros((p, h), device=dev)
    for j, sel in experts:
        y[sel] = hid[sel] @ _dequant(w2[j], w2_scale[j], q).t()
    if not apply_router_weight_on_input:
        y = y * route[:, None]
    return y.view(t, k, h).sum(1).to(x.dtype)


# -- the op ----------------------------------------------------------------------------------------

@torch.library.custom_op(OP, mutates_args=())
def fused_moe_op(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, a13_scale: torch.Tensor | None,
                 a2_scale: torch.Tensor | None, scheme: str, activation: str, apply_router_weight_on_input: bool,
                 backend: str) -> torch.Tensor:
    """``backend``: "reference" (any device, :func:`fused_moe_reference`) or "triton" (:func:`fused_moe`)."""
    if backend not in BACKENDS:
        raise UnsupportedError(f"unknown fused_moe backend {backend!r}", where=OP, fix=f"use one of {BACKENDS}")
    if backend == "triton" and not use_triton(x):
        raise UnsupportedError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {x.device}",
                               where=OP, fix="use backend='reference'")
    fn = fused_moe if backend == "triton" else fused_moe_reference
    return fn(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, scheme=scheme,
              activation=activation, apply_router_weight_on_input=apply_router_weight_on_input)


@fused_moe_op.register_fake
def _(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, scheme, activation,
      apply_router_weight_on_input, backend):
    return x.new_empty(x.shape)


# -- inputs and tuning -----------------------------------------------------------------------------

def quantize_expert_weights(w: torch.Tensor, q: MoeQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes and scales of fp32 expert weights w [E, N, K] in the scheme's granularity."""
    e, n, k = w.shape
    qmax = 127.0 if q.int8 else quant_math.FP8_MAX
    if q.w_gran == G_BLOCK:
        nb, kb = -(-n // 128), -(-k // 128)
        pad = F.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(e, nb, 128, kb, 128)
        scale = (pad.abs().amax(dim=(2, 4)) / qmax).clamp(min=1e-12)
        full = scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    else:
        amax = w.abs().amax(dim=(1, 2)) if q.w_gran == G_TENSOR else w.abs().amax(dim=2)
        scale = (amax / qmax).clamp(min=1e-12)
        full = scale.view(e, 1, 1) if q.w_gran == G_TENSOR else scale.unsqueeze(2)
    v = (w / full).clamp(-qmax, qmax)
    codes = torch.round(v).to(torch.int8) if q.int8 else v.to(quant_math.FP8)
    return codes, scale.float()


def make_moe_inputs(scheme: str, e: int, h: int, i: int, k: int, t: int, activation: str = "silu",
                    dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """Random keyword arguments of :func:`fused_moe` (tests, benchmarks, :func:`tune`): x with a few
    outlier columns, distinct experts per token, weights ~ N(0, 1/K) quantized to the scheme, static
    scales (when the scheme has them) from x's amax and, for h, from 4 standard deviations of the
    projections (whose std is x's rms): squared for gated and relu^2 activations."""
    q = moe_quant(scheme)
    gen = torch.Generator(device=device).manual_seed(seed)
    n1 = 2 * i if ACTIVATIONS[activation][1] else i
    x = torch.randn(t, h, generator=gen, device=device) * (1 + 2 * torch.rand(t, 1, generator=gen, device=device))
    x[:, :: max(1, h // 7)] *= 4
    ids = torch.rand(t, e, generator=gen, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.rand(t, k, generator=gen, device=device)
    ws = []
    for n, kk in ((n1, h), (h, i)):
        codes, scales = zip(*(quantize_expert_weights(torch.randn(1, n, kk, generator=gen, device=device) / kk**0.5, q)
                              for _ in range(e)))  # one expert at a time: bounded fp32 temporaries
        ws += [torch.cat(codes), torch.cat(scales)]
    qmax = 127.0 if q.int8 else quant_math.FP8_MAX
    a13 = a2 = None
    if q.a_static and t:
        hmax = 4 * x.pow(2).mean().sqrt()
        hmax = hmax**2 if ACTIVATIONS[activation][1] or activation == "relu2_no_mul" else hmax
        a13, a2 = (x.abs().amax() / qmax).float(), (hmax / qmax).float()
    return dict(x=x.to(dtype), topk_ids=ids, topk_weights=weights, w13=ws[0], w2=ws[2], w13_scale=ws[1],
                w2_scale=ws[3], a13_scale=a13, a2_scale=a2, scheme=scheme, activation=activation)


# tune's axes, tried one at a time from the current best (coordinate descent)
TUNE_LAYOUTS = ((16, True), (16, False), (32, False), (64, False), (128, False))
TUNE_AXES = {"block_n": (32, 64, 128), "block_k": (128, 256), "num_stages": (2, 3, 4, 5), "num_warps": (4, 8),
             "swap": (True, False), "fuse_quant": (True, False), "split_k": (1, 2, 4, 8)}


def tune(e: int, h: int, i: int, k: int, t: int, scheme: str, activation: str = "silu", dtype=torch.bfloat16,
         save: bool = True, calls: int = 20, replays: int = 10, log=print) -> MoeConfig:
    """Time :func:`fused_moe` configurations on this GPU with CUDA graphs, starting from
    :func:`get_config` and varying the row layout, then each GEMM's parameters one at a time; the
    fastest is returned and (``save``) written to :func:`cache_path` for this device."""
    if not torch.cuda.is_available():
        raise UnsupportedError("tune times the kernels on a CUDA GPU and this machine has none", where="fused_moe tune",
                               fix="run it on the GPU that will run the model")
    from ..bench import graph_time_us

    q = moe_quant(scheme)
    gated = ACTIVATIONS[activation][1]
    args = make_moe_inputs(scheme, e, h, i, k, t, activation, dtype, "cuda")
    timed: dict[MoeConfig, float] = {}

    def time_of(cfg: MoeConfig) -> float:
        cfg = normalize_config(cfg, q, gated)
        if cfg not in timed:
            try:
                timed[cfg] = graph_time_us(lambda: fused_moe(**args, config=cfg), calls, replays)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                torch.cuda.synchronize()
                timed[cfg] = math.inf
                log(f"  skipped {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return timed[cfg]

    best = get_config(q, e, h, i, k, t, gated, torch.device("cuda"))
    for bm, per_pair in TUNE_LAYOUTS:
        d = default_config(q, e, h, i, k, t, torch.cuda.get_device_properties(0).multi_processor_count)
        cand = MoeConfig(bm, per_pair, replace(d.gemm1, swap=bm < 64), replace(d.gemm2, swap=bm < 64))
        best = min((best, cand), key=time_of)
    for gemm in ("gemm1", "gemm2"):
        for field, values in TUNE_AXES.items():
            for v in values:
                best = min((best, replace(best, **{gemm: replace(getattr(best, gemm), **{field: v})})), key=time_of)
    best = normalize_config(best, q, gated)
    log(f"fused_moe {config_key(q.kind, e, h, i, k, t, gated)}: {timed[best]:.1f} us with {best} "
        f"({len(timed)} configurations timed)")
    if save:
        global _CACHE
        path = cache_path()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data.setdefault(_device_name(torch.device("cuda")), {})[config_key(q.kind, e, h, i, k, t, gated)] = best.to_dict()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        _CACHE = data
        get_config.cache_clear()
    return best
