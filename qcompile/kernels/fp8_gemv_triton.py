"""FP8 W8A8 linear for a few rows (decode) in one Triton launch that quantizes x itself.

``y[m, n] = sum_k q_x[m, k] s_x(m, k) w[n, k] s_w(n, k) + bias[n]`` with the fp8 codes ``q_x`` and scales
``s_x`` that :func:`quant_math.quantize_activation` gives (bit-identical: the pieces of
:mod:`fp8_quant_triton`, ``div_rn`` and the e4m3 encode), for every activation recipe (static per tensor,
dynamic per tensor / per token / per 1x128 group) and weight scales per tensor ``[]``, per channel ``[N]`` or
per 128x128 block ``[ceil(N/128), ceil(K/128)]`` (partial edge blocks included). Products of two e4m3 codes
are exact in fp32 and the sums are fp32, so the result differs from ``quant_math.reference_linear`` only in
summation order and the final rounding.

One program owns ``BLOCK_N`` output columns (rows of W) and streams them in ``BLOCK_K`` steps; the few x
rows are re-read (from L2) by every program. A dynamic per-token / per-tensor scale needs the rows' amax
before the first code, so every program first reads its x rows once (x is tiny next to W); a 1x128-group
scale is made per 128-chunk as it is reached. Per-tensor / per-channel / per-token scales multiply the
accumulated sums at the end; per-group and per-block scales (constant over a 128-chunk of a program: its
``BLOCK_N`` <= 128 rows lie in one 128-row block) multiply each 128-chunk's contribution.

Launch parameters (keyword arguments of :func:`fp8_gemv`, so a benchmark can sweep them): ``block_n``,
``block_k``, ``num_warps``, ``num_stages``, ``split_k`` (> 1: fp32 partials and a second, reducing launch)
and ``use_dot`` (``tl.dot`` fp8 x fp8 -> fp32 on ``W [BLOCK_N, k] @ q_x^T [k, 16]``, rows padded to 16,
or a broadcast multiply-and-sum in fp32 whose K reduction is deferred to the end). Defaults:
:func:`default_config`. Runs on CUDA (sm_89+ for the native fp8 converts and fp8 dots) and on CPU under
``TRITON_INTERPRET=1`` (there the codes are encoded and decoded with integer arithmetic and the dot is
taken in fp32). CUDA-graph capturable: no host sync, allocations depend on shapes only.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..scheme import Granularity, QuantScheme
from . import fp8_quant_triton as fq
from .wo_gemm import _sm_count

if fq.HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_quant_triton import _quant, _scale_from_amax
    from .wo_gemm_triton import _FMT_FP8, _decode, _splitk_reduce_kernel

# activation recipes (constexpr ACT) and weight scales (constexpr WSCALE)
ACT_STATIC, ACT_TENSOR, ACT_TOKEN, ACT_GROUP = range(4)
WS_TENSOR, WS_CHANNEL, WS_BLOCK = range(3)
GROUP = 128  # the 1x128 activation group and the 128x128 weight block

if fq.HAS_TRITON:
    _ACT_STATIC = tl.constexpr(ACT_STATIC)
    _ACT_TENSOR = tl.constexpr(ACT_TENSOR)
    _ACT_GROUP = tl.constexpr(ACT_GROUP)
    _WS_TENSOR = tl.constexpr(WS_TENSOR)
    _WS_CHANNEL = tl.constexpr(WS_CHANNEL)
    _WS_BLOCK = tl.constexpr(WS_BLOCK)

    @triton.jit
    def _fp8_value(code, NATIVE_FP8: tl.constexpr):
        """uint8 e4m3 code -> its fp32 value (the interpreter's fp8 convert is not trusted: integer decode)."""
        if NATIVE_FP8:
            v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = _decode(code.to(tl.int32), _FMT_FP8)
        return v

    @triton.jit
    def _rows_amax(x_ptr, offs_m, m_ok, K, BLOCK_M: tl.constexpr, AMAX_K: tl.constexpr):
        """max |x[m, :]| per row, fp32 [BLOCK_M] (0 for rows >= M)."""
        kk = tl.arange(0, AMAX_K)
        amax = tl.zeros((BLOCK_M, AMAX_K), dtype=tl.float32)
        for k0 in range(0, K, AMAX_K):
            x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + kk)[None, :], mask=m_ok[:, None] & (k0 + kk < K)[None, :],
                        other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        return tl.max(amax, axis=1)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, in_s_ptr, bias_ptr, out_ptr, M, N, K, stride_wn, stride_wsn, k_split,
                         ACT: tl.constexpr, WSCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                         AMAX_K: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                         NATIVE_FP8: tl.constexpr):
        # grid (cdiv(N, BLOCK_N), split). x [M, K] contiguous, W [N, K] uint8 codes (row stride stride_wn).
        # out [M, N] (out dtype), or fp32 partials [split, M, N] when PARTIAL (bias added by the reduction).
        # Each BLOCK_K step is taken in BLOCK_K // SUB chunks of SUB columns (SUB = 128 when a group or block
        # scale varies along K, else BLOCK_K); the accumulator is out^T [BLOCK_N, BLOCK_M] (dot), or the
        # products [BLOCK_N, BLOCK_M, SUB] summed over their last axis after the loop (no dot).
        FOLD: tl.constexpr = ACT == _ACT_GROUP or WSCALE == _WS_BLOCK  # a scale per 128-chunk
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_n < N, offs_n, 0)  # clamped: the weight loads stay unmasked along N
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        if ACT == _ACT_STATIC:
            sx = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(in_s_ptr)
        elif ACT == _ACT_GROUP:
            sx = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        else:
            amax = _rows_amax(x_ptr, offs_m, m_ok, K, BLOCK_M, AMAX_K)
            if ACT == _ACT_TENSOR:
                amax = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.max(amax, axis=0)
            sx = _scale_from_amax(amax, False)
        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc3 = tl.zeros((BLOCK_N, BLOCK_M, SUB), dtype=tl.float32)
        kc = tl.arange(0, SUB)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB):
                kk = k0 + j * SUB + kc
                if EVEN_K:
                    xv = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=m_ok[:, None], other=0.0)
                    wb = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :])
                else:
                    k_ok = (kk < k_hi)[None, :]
                    xv = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
                    wb = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=k_ok, other=0)
                xv = xv.to(tl.float32)
                if ACT == _ACT_GROUP:
                    s = _scale_from_amax(tl.max(tl.abs(xv), axis=1), False)  # [BLOCK_M]
                else:
                    s = sx
                codes = _quant(xv, s[:, None], NATIVE_FP8, False)  # [BLOCK_M, SUB] uint8
                wb = wb.to(tl.uint8, bitcast=True)
                if FOLD:  # the chunk's scale: group scale per row x the block's weight scale
                    f = s if ACT == _ACT_GROUP else tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
                    if WSCALE == _WS_BLOCK:
                        f = f * tl.load(ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn + (k0 + j * SUB) // 128)
                if USE_DOT:
                    if NATIVE_FP8:
                        part = tl.dot(wb.to(tl.float8e4nv, bitcast=True), tl.trans(codes.to(tl.float8e4nv, bitcast=True)))
                    else:
                        part = tl.dot(_fp8_value(wb, False), tl.trans(_fp8_value(codes, False)), input_precision="ieee")
                    if FOLD:
                        acc += part * f[None, :]
                    else:
                        acc += part
                else:
                    xq = _fp8_value(codes, NATIVE_FP8)
                    if FOLD:
                        xq = xq * f[:, None]
                    acc3 += _fp8_value(wb, NATIVE_FP8)[:, None, :] * xq[None, :, :]
        if USE_DOT:
            res = acc
        else:
            res = tl.sum(acc3, axis=2)  # [BLOCK_N, BLOCK_M]
        if ACT != _ACT_GROUP:
            res = res * sx[None, :]
        if WSCALE == _WS_TENSOR:
            res = res * tl.load(ws_ptr)
        elif WSCALE == _WS_CHANNEL:
            res = res * tl.load(ws_ptr + rows)[:, None]
        n2 = offs_n[:, None]
        m2 = offs_m[None, :]
        mask = (n2 < N) & (m2 < M)
        if PARTIAL:
            tl.store(out_ptr + pid_k * M * N + m2 * N + n2, res, mask=mask)
        else:
            if HAS_BIAS:
                res = res + tl.load(bias_ptr + n2, mask=n2 < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + m2 * N + n2, res.to(out_ptr.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_ACTS = {Granularity.TENSOR: ACT_TENSOR, Granularity.TOKEN: ACT_TOKEN, Granularity.GROUP: ACT_GROUP}
_WSCALES = {Granularity.TENSOR: WS_TENSOR, Granularity.CHANNEL: WS_CHANNEL, Granularity.BLOCK: WS_BLOCK}
MAX_M = 16  # the largest M a launch configuration is built for (BLOCK_M <= 16)


def reason(spec: QuantScheme) -> str | None:
    """None when the kernel computes ``spec`` (an FP8 W8A8 scheme that ``fp8.fp8_w8a8_reason`` accepts)."""
    w, a = spec.weight.scale, spec.act.scale
    if w.granularity is Granularity.BLOCK and w.block != (GROUP, GROUP):
        return f"weight blocks {w.block[0]}x{w.block[1]}, not {GROUP}x{GROUP}"
    if a.granularity is Granularity.GROUP and a.group_size != GROUP:
        return f"activation groups 1x{a.group_size}, not 1x{GROUP}"
    return None


def default_config(m: int, n: int, k: int, spec: QuantScheme, sms: int) -> dict:
    """The launch when none is given (a rule to be replaced by measurements): up to 4 rows the broadcast
    product (BLOCK_M = pow2(M)) with BLOCK_K = 512 / BLOCK_M (so the deferred products stay at 16 x 512
    per program), else ``tl.dot`` with rows padded to 16, BLOCK_N = 32, BLOCK_K = 256; the broadcast path
    halves BLOCK_N from 16 (down to 4) while there are fewer column blocks than SMs. 4 warps, 3 stages,
    no split (one launch)."""
    fold = spec.weight.scale.granularity is Granularity.BLOCK or spec.act.scale.granularity is Granularity.GROUP
    if m > 4:
        return dict(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=1, use_dot=True)
    bn = 16
    while bn > 4 and -(-n // bn) < sms:
        bn //= 2
    bk = max(GROUP if fold else 64, 512 // _pow2(m))
    return dict(block_n=bn, block_k=bk, num_warps=4, num_stages=3, split_k=1, use_dot=False)


def _launch_reason(spec: QuantScheme, m: int, weight: torch.Tensor, cfg: dict) -> str | None:
    why = reason(spec)
    if why:
        return why
    if m > MAX_M:
        return f"M={m} rows, more than {MAX_M}"
    if weight.stride(1) != 1:
        return f"weight strides {weight.stride()}: K must be contiguous"
    bn, bk = cfg["block_n"], cfg["block_k"]
    if _pow2(bn) != bn or _pow2(bk) != bk or bk < 16 or (cfg["use_dot"] and bn < 16):
        return f"BLOCK_N={bn}, BLOCK_K={bk}: powers of two, BLOCK_K >= 16 (and BLOCK_N >= 16 with tl.dot)"
    fold = spec.weight.scale.granularity is Granularity.BLOCK or spec.act.scale.granularity is Granularity.GROUP
    if fold and (bk % GROUP or bn > GROUP):
        return f"group / block scales need BLOCK_K a multiple of {GROUP} and BLOCK_N <= {GROUP}, have {bn}, {bk}"
    return None


def fp8_gemv(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
             bias: torch.Tensor | None, spec: QuantScheme, out_dtype: torch.dtype | None = None, *,
             block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None, split_k: int | None = None, use_dot: bool | None = None,
             native: bool | None = None) -> torch.Tensor:
    """x2 [M, K] bf16/fp16 (M <= MAX_M), weight fp8 e4m3 [N, K] with unit stride along K, canonical scales
    (``scheme.canonical_shape``) -> [M, N] in ``out_dtype`` (default x2.dtype; fp32 gives the sums before
    the output rounding). Launch parameters not given come from :func:`default_config`; ``native`` forces
    the fp8 convert path (default: native on CUDA, integer encode / decode under the interpreter)."""
    m, k = x2.shape
    n = weight.shape[0]
    cfg = default_config(m, n, k, spec, _sm_count(x2.device))
    given = dict(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages, split_k=split_k,
                 use_dot=use_dot)
    cfg.update({key: v for key, v in given.items() if v is not None})
    why = _launch_reason(spec, m, weight, cfg)
    if why:
        raise UnsupportedError(f"fp8_gemv cannot run this call: {why}", where="qcompile::fp8_linear",
                               fix="route it to the scaled_mm GEMM")
    act = _ACTS[spec.act.scale.granularity] if spec.act.dynamic else ACT_STATIC
    wgran = _WSCALES[spec.weight.scale.granularity]
    fold = act == ACT_GROUP or wgran == WS_BLOCK
    bn, bk = cfg["block_n"], cfg["block_k"]
    bm = max(_pow2(m), 16) if cfg["use_dot"] else _pow2(m)
    k_split = -(-(-(-k // bk)) // max(1, cfg["split_k"])) * bk  # whole BLOCK_K steps per split
    split = -(-k // k_split)
    x2 = x2.contiguous()
    ws = weight_scale.float().contiguous()
    in_s = input_scale.float().reshape(()) if input_scale is not None else ws
    bias = bias.contiguous() if bias is not None else None
    out = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    native = x2.is_cuda and not fq.interpreting() if native is None else native
    _fp8_gemv_kernel[(triton.cdiv(n, bn), split)](
        x2, weight.view(torch.uint8), ws, in_s, bias if bias is not None else ws, dest, m, n, k, weight.stride(0),
        ws.stride(0) if ws.dim() == 2 else 0, k_split,
        ACT=act, WSCALE=wgran, HAS_BIAS=bias is not None, PARTIAL=split > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SUB=GROUP if fold else bk, AMAX_K=min(_pow2(k), max(64, 4096 // bm)), USE_DOT=cfg["use_dot"],
        EVEN_K=k % bk == 0, NATIVE_FP8=native, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            dest, bias, out, m * n, n, SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
