"""FP8 activation quantization (and the scale epilogue) as single Triton kernels, with torch fallbacks.

Each function returns exactly what :func:`qcompile.kernels.quant_math.quantize_activation` computes
(same scale, same fp8 bytes), laid out the way ``torch._scaled_mm`` / ``F.scaled_mm`` take it:

==========================  =====================  ===============================================
recipe                      launches               scale returned
==========================  =====================  ===============================================
static per-tensor           1                      the given ``[]`` scale
dynamic per-token           1                      ``[M, 1]`` contiguous (RowWise)
dynamic per-1x128-group     1                      ``[rows, ceil(K/128)]``, strides ``(1, rows)`` (BlockWise1x128)
dynamic per-tensor          2 (partial amax, quant)  ``[]``
==========================  =====================  ===============================================

``rows`` >= M pads the output with zero rows (cuBLASLt rejects the block recipe at M=1; see
docs/kernels-fp8.md). Every kernel divides with ``div_rn`` (Triton's ``/`` is the approximate
``div.full.f32`` on NVIDIA) so scales and codes match the torch reference bit for bit.

fp32 -> e4m3: on the GPU the native saturating RTNE convert. The Triton *interpreter* (3.9) rounds
fp8 wrongly (half-up without carry into the exponent), so there the kernels encode the byte with
integer arithmetic instead (``NATIVE_FP8=False``); both paths are tested against torch.
Runs under ``TRITON_INTERPRET=1`` on CPU tensors; without triton, everything falls back to torch.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..scheme import Granularity, QDtype
from . import cuda_driver, quant_math
from .wo_policy import pdl_default

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True

    @triton.jit
    def _pdl_start(PDL: tl.constexpr):
        """First statement of a kernel launched with :func:`pdl`: wait until the previous kernel has completed
        (its outputs written, the memory it reads free to reuse), then let the next kernel launch, so that its
        programs are resident and waiting when this one ends."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
except ImportError:  # pragma: no cover - triton is optional
    HAS_TRITON = False

FP8 = quant_math.FP8
FP8_MAX = quant_math.FP8_MAX
MIN_SCALE = quant_math.MIN_SCALE


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs CUDA tensors, or CPU tensors under the interpreter."""
    return HAS_TRITON and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


_PDL = [True]  # cleared inside :func:`without_pdl`


def pdl(t: torch.Tensor) -> dict:
    """The launch keywords of a Triton kernel that takes a ``PDL`` constexpr and starts with :func:`_pdl_start`:
    programmatic dependent launch for tensors on a GPU of sm_90+ (as the weight-only kernel decides it:
    ``QCOMPILE_PDL=0`` turns it off), else none."""
    on = (_PDL[0] and t.is_cuda and not interpreting()
          and pdl_default(cuda_driver.capability(cuda_driver.device_index(t.device))))  # queried once a device
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@contextlib.contextmanager
def without_pdl():
    """Inside, qcompile's Triton kernels launch without PDL (``wo_mma`` keeps its own choice): a benchmark's
    baseline."""
    _PDL[0] = False
    try:
        yield
    finally:
        _PDL[0] = True


def _native_fp8(t: torch.Tensor, native: bool | None) -> bool:
    if native is not None:
        return native
    return t.is_cuda and not interpreting()


if HAS_TRITON:

    @triton.jit
    def _to_e4m3_bits(y, NATIVE_FP8: tl.constexpr):
        """fp32 already clamped to [-448, 448] -> e4m3fn byte (RTNE), as uint8."""
        if NATIVE_FP8:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = y.to(tl.int32, bitcast=True)
            sign = (bits >> 31) & 1
            ay = tl.abs(y)
            a = ay.to(tl.int32, bitcast=True)
            # normal: round the fp32 mantissa to 3 bits (ties to even, carry into the exponent),
            # then move the exponent bias from 127 to 7
            normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
            # subnormal (|y| < 2^-6): the code is RTNE(|y| * 2^9); adding 2^23 rounds to an integer in fp32
            sub = (ay * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
            code = (tl.where(ay < 0.015625, sub, normal) | (sign << 7)).to(tl.uint8)
        return code

    @triton.jit
    def _quant(x, s, NATIVE_FP8: tl.constexpr, INT8: tl.constexpr):
        """fp32 x / s -> the code byte (uint8 bits): e4m3fn, or int8 (round half to even, saturating)."""
        y = tl.math.div_rn(x, s)
        if INT8:
            y = tl.minimum(tl.maximum(y, -128.0), 127.0)
            r = (tl.abs(y) + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # RTNE of |y| < 2**23
            code = tl.where(y < 0, -r, r).to(tl.int8).to(tl.uint8, bitcast=True)
        else:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            code = _to_e4m3_bits(y, NATIVE_FP8)
        return code

    @triton.jit
    def _scale_from_amax(amax, INT8: tl.constexpr, INT8_MIN_SCALE: tl.constexpr = 1.0 / (448.0 * 512.0)):
        """amax / 448 (fp8, at least 1/(448*512)) or amax / 127 (int8, at least INT8_MIN_SCALE)."""
        if INT8:
            s = tl.maximum(tl.math.div_rn(amax, 127.0), INT8_MIN_SCALE)
        else:
            s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
        return s

    @triton.jit
    def _static_tensor_kernel(x_ptr, q_ptr, s_ptr, M, K,
                              BLOCK_K: tl.constexpr, NATIVE_FP8: tl.constexpr, INT8: tl.constexpr):
        # grid (rows, cdiv(K, BLOCK_K)); rows >= M are written as zeros
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = cols < K
        row_ok = (cols * 0 + row) < M  # broadcast explicitly (the interpreter rejects a scalar mask)
        x = tl.load(x_ptr + row * K + cols, mask=in_k & row_ok, other=0.0).to(tl.float32)
        s = tl.load(s_ptr)
        tl.store(q_ptr + row * K + cols, _quant(x, s, NATIVE_FP8, INT8), mask=in_k)

    @triton.jit
    def _dynamic_token_kernel(x_ptr, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr, NATIVE_FP8: tl.constexpr,
                              INT8: tl.constexpr, INT8_MIN_SCALE: tl.constexpr):
        # grid (M,): amax over the row, then quantize it (the second pass re-reads from L1/L2)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * K + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = _scale_from_amax(tl.max(amax, axis=0), INT8, INT8_MIN_SCALE)
        tl.store(s_ptr + row, s)
        for k0 in range(0, K, BLOCK_K):
            m = k0 + offs < K
            x = tl.load(x_ptr + row * K + k0 + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k0 + offs, _quant(x, s, NATIVE_FP8, INT8), mask=m)

    @triton.jit
    def _dynamic_group_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_sm, stride_sg,
                              GROUP: tl.constexpr, GROUPS: tl.constexpr, NATIVE_FP8: tl.constexpr):
        # grid (rows, cdiv(K/GROUP, GROUPS)); each program quantizes a [GROUPS, GROUP] tile of one row
        row = tl.program_id(0)
        g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
        in_k = cols < K
        row_ok = (cols * 0 + row) < M
        x = tl.load(x_ptr + row * K + cols, mask=in_k & row_ok, other=0.0).to(tl.float32)
        s = _scale_from_amax(tl.max(tl.abs(x), axis=1), False)  # [GROUPS]
        tl.store(q_ptr + row * K + cols, _quant(x, s[:, None], NATIVE_FP8, False), mask=in_k)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, s, mask=g * GROUP < K)

    @triton.jit
    def _partial_amax_kernel(x_ptr, part_ptr, numel, ITERS, BLOCK: tl.constexpr):
        # grid (P,): program p reduces chunks p, p + P, ... (ITERS of them)
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, ITERS):
            idx = (pid + i * nprog) * BLOCK + offs
            x = tl.load(x_ptr + idx, mask=idx < numel, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        tl.store(part_ptr + pid, tl.max(amax, axis=0))

    @triton.jit
    def _dynamic_tensor_kernel(x_ptr, q_ptr, part_ptr, s_ptr, numel, NPART, PART_POW2: tl.constexpr,
                               BLOCK: tl.constexpr, NATIVE_FP8: tl.constexpr, INT8: tl.constexpr):
        # grid (cdiv(numel, BLOCK),): every program finishes the (tiny) amax reduction itself
        pid = tl.program_id(0)
        p = tl.arange(0, PART_POW2)
        s = _scale_from_amax(tl.max(tl.load(part_ptr + p, mask=p < NPART, other=0.0), axis=0), INT8)
        if pid == 0:
            tl.store(s_ptr, s)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        m = idx < numel
        x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
        tl.store(q_ptr + idx, _quant(x, s, NATIVE_FP8, INT8), mask=m)

    @triton.jit
    def _scale_epilogue_kernel(acc_ptr, out_ptr, row_ptr, col_ptr, bias_ptr, N,
                               HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_BIAS: tl.constexpr,
                               BLOCK_N: tl.constexpr):
        # out[m, n] = acc[m, n] * row[m] * col[n] + bias[n], grid (M, cdiv(N, BLOCK_N))
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = cols < N
        y = tl.load(acc_ptr + row * N + cols, mask=m, other=0).to(tl.float32)  # fp32 or int32 accumulators
        if HAS_ROW:
            y = y * tl.load(row_ptr + row)
        if HAS_COL:
            y = y * tl.load(col_ptr + cols, mask=m, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bytes_view(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# -- the four recipes ----------------------------------------------------------------------------

def quantize_static_tensor(x: torch.Tensor, scale: torch.Tensor, rows: int | None = None,
                           native: bool | None = None, int8: bool = False):
    """x [M, K] contiguous, scale [] fp32 -> (q [rows, K] fp8 (int8), scale [])."""
    m, k = x.shape
    rows = m if rows is None else rows
    scale = scale.float().reshape(())
    if not use_triton(x):
        q = quant_math.quantize_int8(x, scale) if int8 else quant_math.quantize_fp8(x, scale)
        return _pad_rows(q, rows), scale
    q = torch.empty((rows, k), dtype=_code_dtype(int8), device=x.device)
    block = min(_pow2(k), 2048)
    _static_tensor_kernel[(rows, triton.cdiv(k, block))](
        x, _bytes_view(q), scale, m, k, BLOCK_K=block, NATIVE_FP8=_native_fp8(x, native), INT8=int8, num_warps=4)
    return q, scale


def quantize_dynamic_token(x: torch.Tensor, native: bool | None = None, int8: bool = False,
                           int8_min_scale: float = MIN_SCALE):
    """x [M, K] contiguous -> (q [M, K] fp8 (int8), scale [M, 1]). ``int8_min_scale``: the least int8
    scale (the fused MoE's is the smallest normal fp32)."""
    m, k = x.shape
    if not use_triton(x):
        return _torch_dynamic(x, Granularity.TOKEN, int8, int8_min_scale)
    q = torch.empty((m, k), dtype=_code_dtype(int8), device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(_pow2(k), 8192)
    _dynamic_token_kernel[(m,)](x, _bytes_view(q), scale, k, BLOCK_K=block, NATIVE_FP8=_native_fp8(x, native),
                                INT8=int8, INT8_MIN_SCALE=int8_min_scale, num_warps=8 if block >= 4096 else 4)
    return q, scale


def quantize_dynamic_group(x: torch.Tensor, group: int = 128, rows: int | None = None,
                           native: bool | None = None):
    """x [M, K] contiguous -> (q [rows, K] fp8, scale [rows, ceil(K/group)] with strides (1, rows): the
    outer-dim-major layout ``F.scaled_mm`` wants for BlockWise1x128). When K % group != 0 the last
    group holds the K % group last columns (``quant_math.groups``)."""
    m, k = x.shape
    rows = m if rows is None else rows
    ng = -(-k // group)
    scale = torch.empty((ng, rows), dtype=torch.float32, device=x.device).t()  # [rows, ng], strides (1, rows)
    if not use_triton(x):
        s = quant_math.dynamic_fp8_scale(x, Granularity.GROUP, group)  # [M, ng]
        q = quant_math.quantize_fp8(quant_math.groups(x, group), s.unsqueeze(-1)).view(m, -1)[:, :k].contiguous()
        scale.fill_(MIN_SCALE)
        scale[:m].copy_(s)
        return _pad_rows(q, rows), scale
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    groups = min(_pow2(ng), 8)
    _dynamic_group_kernel[(rows, triton.cdiv(ng, groups))](
        x, _bytes_view(q), scale, m, k, scale.stride(0), scale.stride(1),
        GROUP=group, GROUPS=groups, NATIVE_FP8=_native_fp8(x, native), num_warps=4)
    return q, scale


def quantize_dynamic_tensor(x: torch.Tensor, native: bool | None = None, int8: bool = False):
    """x [M, K] contiguous -> (q [M, K] fp8 (int8), scale []). Two launches: partial amaxes, then quantize."""
    m, k = x.shape
    if not use_triton(x):
        return _torch_dynamic(x, Granularity.TENSOR, int8)
    numel = m * k
    block = 4096
    chunks = triton.cdiv(numel, block)
    nparts = min(chunks, 256)
    parts = torch.empty((nparts,), dtype=torch.float32, device=x.device)
    _partial_amax_kernel[(nparts,)](x, parts, numel, triton.cdiv(chunks, nparts), BLOCK=block, num_warps=8)
    q = torch.empty((m, k), dtype=_code_dtype(int8), device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    _dynamic_tensor_kernel[(chunks,)](x, _bytes_view(q), parts, scale, numel, nparts, PART_POW2=_pow2(nparts),
                                      BLOCK=block, NATIVE_FP8=_native_fp8(x, native), INT8=int8, num_warps=8)
    return q, scale


def _code_dtype(int8: bool) -> torch.dtype:
    return torch.int8 if int8 else FP8


def _torch_dynamic(x: torch.Tensor, granularity: Granularity, int8: bool, int8_min_scale: float = MIN_SCALE):
    if int8:
        spec = QDtype.INT8
        amax = x.float().abs().amax() if granularity is Granularity.TENSOR else x.float().abs().amax(-1, keepdim=True)
        scale = (amax / torch.full_like(amax, spec.max)).clamp(min=int8_min_scale)
        return quant_math.quantize_int8(x, scale), scale
    scale = quant_math.dynamic_fp8_scale(x, granularity)
    return quant_math.quantize_fp8(x, scale), scale


def quantize(x: torch.Tensor, act, input_scale: torch.Tensor | None, native: bool | None = None):
    """Dispatch on an ActSpec (FP8 or INT8, symmetric). Returns (q [M, K], scale as listed in the module
    doc); INT8 has the per-tensor and per-token recipes."""
    gran = act.scale.granularity
    int8 = act.dtype is QDtype.INT8
    if not act.dynamic:
        return quantize_static_tensor(x, input_scale, native=native, int8=int8)
    if gran is Granularity.TENSOR:
        return quantize_dynamic_tensor(x, native=native, int8=int8)
    if gran is Granularity.TOKEN:
        return quantize_dynamic_token(x, native=native, int8=int8)
    if gran is Granularity.GROUP and not int8:
        return quantize_dynamic_group(x, act.scale.group_size, native=native)
    raise AssertionError(f"activation granularity {gran}")


def scale_epilogue(acc: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] fp32 (a GEMM run with unit scales) -> acc * row_scale[m] * col_scale[n] + bias[n] in
    ``out_dtype``: one pass, for the small-M path that avoids the slower RowWise GEMM."""
    m, n = acc.shape
    if not use_triton(acc):
        y = acc
        if row_scale is not None:
            y = y * row_scale.reshape(m, 1)
        if col_scale is not None:
            y = y * col_scale.reshape(1, n)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    block = min(_pow2(n), 1024)
    _scale_epilogue_kernel[(m, triton.cdiv(n, block))](
        acc, out, row_scale if row_scale is not None else acc, col_scale if col_scale is not None else acc,
        bias if bias is not None else acc, n, HAS_ROW=row_scale is not None, HAS_COL=col_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block, num_warps=4)
    return out


def _pad_rows(q: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == q.shape[0]:
        return q
    out = torch.zeros((rows, q.shape[1]), dtype=q.dtype, device=q.device)
    out[: q.shape[0]] = q
    return out
