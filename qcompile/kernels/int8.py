"""``qcompile::int8_linear``: INT8 W8A8 linear layers (Quark and compressed-tensors W8A8-INT8).

Weights int8 [N, K] with fp32 per-tensor ``[]`` or per-channel ``[N]`` scales, symmetric; activations
int8, symmetric, static per-tensor (``input_scale`` ``[]``) or dynamic per-tensor / per-token. The op
quantizes x in one Triton launch (:mod:`fp8_quant_triton`, the INT8 recipes), multiplies the codes with
``torch._int_mm`` (int32 accumulators; cuBLASLt IMMA on CUDA, oneDNN / a loop on CPU) and applies
``acc * s_x[m] * s_w[n] + bias`` in one epilogue launch. cuBLASLt's int8 GEMM needs more than 16 rows:
x is quantized into ``_rows(M)`` rows (zeros below M) and the output sliced back.

The result equals :func:`qcompile.kernels.quant_math.quantize_activation` + the integer matmul of the
reference exactly up to fp32 rounding of the epilogue: the int32 products are exact.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..scheme import Granularity, Packing, QDtype, QuantScheme, ScaleDtype, parse_scheme_key
from . import fp8_quant_triton as fq
from .reference import register_straight_through
from .registry import Kernel, KernelQuery, cuda_reason, register

OP = "qcompile::int8_linear"
MIN_ROWS = 32  # cuBLASLt int8: M > 16; a multiple of 8 keeps the rows aligned


def _rows(m: int, device: torch.device) -> int:
    return max(MIN_ROWS, -(-m // 8) * 8) if device.type == "cuda" else m


def int8_w8a8_reason(scheme: QuantScheme) -> str | None:
    """None when ``scheme`` is an INT8 W8A8 scheme this op runs, else what is missing."""
    w, a = scheme.weight, scheme.act
    not_int8 = f"scheme {scheme.key} is not INT8 W8A8"
    if w.dtype is not QDtype.INT8 or w.packing is not Packing.NONE:
        return f"{not_int8}: weights are {w.dtype.value} packed as {w.packing.value}"
    if w.zero_point or w.act_order or w.global_scale or w.scale.dtype is not ScaleDtype.FP32:
        return f"{not_int8}: weights carry zero points / act-order / a global scale / non-fp32 scales"
    if w.scale.granularity not in (Granularity.TENSOR, Granularity.CHANNEL):
        return f"{not_int8}: weight scales per {w.scale.granularity.value} (tensor or channel expected)"
    if a is None or a.dtype is not QDtype.INT8:
        return f"{not_int8}: activations are {'not quantized' if a is None else a.dtype.value}"
    if not a.symmetric or a.scale.dtype is not ScaleDtype.FP32:
        return f"{not_int8}: asymmetric activations or non-fp32 activation scales"
    if a.scale.granularity not in (Granularity.TENSOR, Granularity.TOKEN) or (
            not a.dynamic and a.scale.granularity is not Granularity.TENSOR):
        return f"{not_int8}: activation scales {a.key()} (static tensor, dynamic tensor or token expected)"
    return None


@torch.library.custom_op(OP, mutates_args=())
def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                bias: torch.Tensor | None, scheme: str, backend: str) -> torch.Tensor:
    spec = parse_scheme_key(scheme)
    why = int8_w8a8_reason(spec) or (None if backend == "int_mm" else f"unknown backend {backend!r}")
    if why is None and not spec.act.dynamic and input_scale is None:
        why = "static activations need input_scale"
    if why is None and (weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]):
        why = f"weight {weight.dtype} {tuple(weight.shape)} for x [..., {x.shape[-1]}] (int8 [N, K] expected)"
    if why:
        raise UnsupportedError(why, where=OP, fix="lower this layer with the kernel the registry selects")
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty((*lead, n))
    rows = _rows(m, x.device)
    if spec.act.dynamic:
        q, xs = fq.quantize(x2, spec.act, None)
        q = fq._pad_rows(q, rows)
    else:
        q, xs = fq.quantize_static_tensor(x2, input_scale, rows=rows, int8=True)
    acc = torch._int_mm(q, weight.t())[:m]
    # per-tensor scales fold into one [N] (or [M, 1]) vector; the epilogue takes row and column vectors
    ws = weight_scale.float().reshape(-1)
    row = xs.reshape(-1) if xs.numel() > 1 else None
    col = ws.expand(n) * (xs.reshape(()) if row is None else 1.0)
    return fq.scale_epilogue(acc, row, col.contiguous(), bias, x.dtype).reshape(*lead, n)


@int8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias, scheme, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register_straight_through(OP)


def check_int_mm(q: KernelQuery) -> str | None:
    why = int8_w8a8_reason(q.scheme)
    if why:
        return why
    if q.device == "cuda":
        why = cuda_reason(q, (7, 5))
        if why:
            return why
        for dim, v in (("N", q.n), ("K", q.k)):
            if v % 8:
                return f"{dim}={v} not a multiple of 8 (cuBLASLt int8)"
    elif q.device != "cpu":
        return f"runs on CUDA and CPU, not {q.device}"
    return None


# above the weight-only kernels (30), which would run these layers without quantizing the activations
INT8_INT_MM = register(Kernel(
    name="int8_int_mm", op=OP, backend="int_mm", priority=40, check=check_int_mm, computes=int8_w8a8_reason,
    description="Triton INT8 activation quant + torch._int_mm (cuBLASLt IMMA) + one scale epilogue",
))
