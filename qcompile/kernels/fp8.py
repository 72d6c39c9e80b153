"""``qcompile::fp8_linear``: FP8 W8A8 linear layers, and the kernels that run them.

One custom op, three implementations chosen by its ``backend`` argument:

* ``"emulated"`` (any device): the kernel math in fp32, from :mod:`quant_math`: quantize x as the
  scheme says, dequantize x and the weight, fp32 matmul, + bias, cast to x.dtype.
* ``"scaled_mm"`` (CUDA, sm_89+): one activation-quant Triton kernel (:mod:`fp8_quant_triton`), then

  ==========================================  ==================================================
  scheme (weight x activation)                 GEMM
  ==========================================  ==================================================
  tensor x tensor (static or dynamic)          ``torch._scaled_mm`` TensorWise
  channel and/or per-token, M < ROWWISE_MIN_M  TensorWise with unit scales, fp32 out, then one
                                               epilogue kernel: acc * s_x[m] * s_w[n] + bias
  channel and/or per-token, M >= ROWWISE_MIN_M ``torch._scaled_mm`` RowWise (per-tensor scales
                                               are expanded to [M, 1] / [1, N])
  block128 x group128 (or tensor / token act)  ``F.scaled_mm`` BlockWise1x128 x BlockWise128x128
                                               (sm_90 only), M padded to ``_block_rows(M)``
  ==========================================  ==================================================
* ``"flashinfer"`` (CUDA, per-tensor only): ``flashinfer.gemm.bmm_fp8`` (cuBLAS); JIT-compiles its
  module at first use (about 34 s on an H100).

Canonical inputs (see :mod:`qcompile.scheme`): x [..., K] bf16/fp16; weight fp8 e4m3 [N, K]
row-major; weight_scale fp32 [] / [N] / [N/128, K/128]; input_scale fp32 [] for static per-tensor
activations, else None. Output: x.dtype, [..., N]. Measurements: docs/kernels-fp8.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..scheme import Granularity, Packing, QDtype, QuantScheme, ScaleDtype, canonical_shape, parse_scheme_key
from . import fp8_gemv
from . import fp8_quant_triton as fq
from . import quant_math
from .reference import register_straight_through
from .registry import Kernel, KernelQuery, cuda_reason, register, unknown_backend

OP = "qcompile::fp8_linear"
BACKENDS = ("emulated", "scaled_mm", "gemv", "flashinfer")
IN_GRAPH_OP = "qcompile::fp8_linear_in_graph"  # the same math as graph ops for inductor (fp8_inductor)

# Below this many rows, channel / per-token scales go through a TensorWise GEMM + epilogue instead
# of RowWise _scaled_mm: where the two cross on an H100 (docs/kernels-fp8.md).
ROWWISE_MIN_M = 96

# cuBLASLt (torch 2.11+cu130, H100) answers NOT_SUPPORTED for the 1x128 x 128x128 block recipe
# unless M is a multiple of 4 (probed M = 1..16, 31, 33, 300..303: only 4, 8, 12, 16, 300 ran):
# x is quantized into _block_rows(M) rows (zeros below M) and the output sliced back.
BLOCK_MIN_ROWS = 4
BLOCK_ROW_MULTIPLE = 4


def _block_rows(m: int) -> int:
    rows = max(m, BLOCK_MIN_ROWS)
    return -(-rows // BLOCK_ROW_MULTIPLE) * BLOCK_ROW_MULTIPLE


# -- what the op accepts -------------------------------------------------------------------------

def fp8_w8a8_reason(scheme: QuantScheme) -> str | None:
    """None when ``scheme`` is an FP8 W8A8 scheme this op runs, else what is missing."""
    w, a = scheme.weight, scheme.act
    not_fp8 = f"scheme {scheme.key} is not FP8 W8A8"
    if w.dtype is not QDtype.FP8_E4M3 or w.packing is not Packing.NONE:
        return f"{not_fp8}: weights are {w.dtype.value}"
    if w.zero_point or w.act_order or w.global_scale:
        return f"{not_fp8}: weights carry zero points / act-order / a global scale"
    if w.scale.dtype is not ScaleDtype.FP32:
        return f"{not_fp8}: weight scales are {w.scale.dtype.value}, not fp32"
    if w.scale.granularity not in (Granularity.TENSOR, Granularity.CHANNEL, Granularity.BLOCK):
        return f"{not_fp8}: weight scales per {w.scale.granularity.value} (tensor, channel or block expected)"
    if a is None:
        return f"{not_fp8}: activations are not quantized (weight-only)"
    if a.dtype is not QDtype.FP8_E4M3 or a.scale.dtype is not ScaleDtype.FP32:
        return f"{not_fp8}: activations are {a.dtype.value} with {a.scale.dtype.value} scales"
    if not a.symmetric or a.global_scale:
        return f"{not_fp8}: asymmetric or globally scaled activations"
    if not a.dynamic and a.scale.granularity is not Granularity.TENSOR:
        return f"{not_fp8}: static activation scales per {a.scale.granularity.value} (only per tensor)"
    if a.scale.granularity not in (Granularity.TENSOR, Granularity.TOKEN, Granularity.GROUP):
        return f"{not_fp8}: activation scales per {a.scale.granularity.value}"
    return None


def _validate(x, weight, weight_scale, input_scale, spec: QuantScheme, scheme: str):
    why = fp8_w8a8_reason(spec)
    if why:
        raise UnsupportedError(why, where=OP)
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or x.shape[-1] != k:
        raise UnsupportedError(f"weight must be float8_e4m3fn [N, K={x.shape[-1]}], got {weight.dtype} "
                               f"{list(weight.shape)}", where=OP)
    want = canonical_shape("weight_scale", spec, n, k)
    if tuple(weight_scale.shape) != want:
        raise UnsupportedError(f"weight_scale has shape {list(weight_scale.shape)}, scheme {scheme} wants "
                               f"{list(want)}", where=OP, fix="normalize scales at load (scheme.canonical_shape)")
    if not spec.act.dynamic and input_scale is None:
        raise UnsupportedError(f"scheme {scheme} has static activation scales but input_scale is None", where=OP)
    g = spec.act.scale.group_size
    if spec.act.scale.granularity is Granularity.GROUP and k % g:
        raise UnsupportedError(f"K={k} not a multiple of the activation group size {g}", where=OP)


# -- implementations -----------------------------------------------------------------------------

def _emulated(x2, weight, weight_scale, input_scale, bias, spec, out_dtype):
    return quant_math.reference_linear(x2, spec, weight, weight_scale, input_scale=input_scale,
                                       bias=bias).to(out_dtype)


_UNIT: dict[torch.device, torch.Tensor] = {}


def _unit(device: torch.device) -> torch.Tensor:
    """A cached fp32 1.0 on ``device`` (not cached when first asked for inside a CUDA-graph capture)."""
    t = _UNIT.get(device)
    if t is None:
        t = torch.ones((), dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT[device] = t
    return t


def _require_cuda(x2, backend):
    if not x2.is_cuda:
        raise UnsupportedError(f"backend {backend!r} needs CUDA tensors, got {x2.device}", where=OP,
                               fix="use backend='emulated' off CUDA")


def _scaled_mm(x2, weight, weight_scale, input_scale, bias, spec, out_dtype):
    _require_cuda(x2, "scaled_mm")
    if bias is not None:
        bias = bias.to(out_dtype)
    if spec.weight.scale.granularity is Granularity.BLOCK:
        return _scaled_mm_block(x2, weight, weight_scale, input_scale, bias, spec, out_dtype)
    if spec.act.scale.granularity is Granularity.GROUP:
        raise UnsupportedError(f"backend 'scaled_mm' has no recipe for {spec.key} (group activations need "
                               "block weights)", where=OP, fix="use backend='emulated'")
    m, n = x2.shape[0], weight.shape[0]
    xq, xs = fq.quantize(x2, spec.act, input_scale)
    wt = weight.t()  # [K, N], column-major: the layout _scaled_mm wants for mat2
    per_token = spec.act.scale.granularity is Granularity.TOKEN
    per_channel = spec.weight.scale.granularity is Granularity.CHANNEL
    if not (per_token or per_channel):
        return torch._scaled_mm(xq, wt, xs, weight_scale, bias=bias, out_dtype=out_dtype)
    if m < ROWWISE_MIN_M:
        one = _unit(x2.device)
        acc = torch._scaled_mm(xq, wt, one if per_token else xs, one if per_channel else weight_scale,
                               out_dtype=torch.float32)
        return fq.scale_epilogue(acc, xs if per_token else None, weight_scale if per_channel else None,
                                 bias, out_dtype)
    sa = xs if per_token else xs.reshape(1, 1).expand(m, 1).contiguous()
    sb = weight_scale.reshape(1, n) if per_channel else weight_scale.reshape(1, 1).expand(1, n).contiguous()
    return torch._scaled_mm(xq, wt, sa, sb, bias=bias, out_dtype=out_dtype)


def _gemv(x2, weight, weight_scale, input_scale, bias, spec, out_dtype):
    """At M <= ``fp8_gemv.MAX_M``: the activation quantization launch, then ``qcompile::fp8_gemv`` (tensor /
    channel weights, tensor / token activations); larger M and the other recipes as ``scaled_mm``."""
    _require_cuda(x2, "gemv")
    if (x2.shape[0] > fp8_gemv.MAX_M or spec.weight.scale.granularity is Granularity.BLOCK
            or spec.act.scale.granularity is Granularity.GROUP):
        return _scaled_mm(x2, weight, weight_scale, input_scale, bias, spec, out_dtype)
    xq, xs = fq.quantize(x2, spec.act, input_scale)
    return _gemv_op(xq, xs, weight, weight_scale, bias, spec, out_dtype)


def _gemv_op(xq, xs, weight, weight_scale, bias, spec, out_dtype):
    """``qcompile::fp8_gemv`` on quantized x: the x scale per row (per-token) or one, the weight scale per row
    (per-channel) or one, as the op takes them."""
    per_token = spec.act.scale.granularity is Granularity.TOKEN
    per_channel = spec.weight.scale.granularity is Granularity.CHANNEL
    ws = weight_scale.float()
    return torch.ops.qcompile.fp8_gemv(xq, weight, xs.reshape(-1) if per_token else xs.reshape(()),
                                       ws.reshape(-1) if per_channel else ws.reshape(()), bias, out_dtype)


def _scaled_mm_block(x2, weight, weight_scale, input_scale, bias, spec, out_dtype):
    """1x128-group activations x 128x128-block weights through F.scaled_mm (cuBLASLt, sm_90)."""
    m, k = x2.shape
    rows = _block_rows(m)
    if spec.act.scale.granularity is Granularity.GROUP:
        xq, xs = fq.quantize_dynamic_group(x2, 128, rows=rows)
    else:  # per-tensor / per-token activations: broadcast their scale to every 1x128 group
        xq, s = fq.quantize(x2, spec.act, input_scale)
        xq = fq._pad_rows(xq, rows)
        xs = torch.ones((k // 128, rows), dtype=torch.float32, device=x2.device).t()  # [rows, K/128], (1, rows)
        xs[:m] = s.reshape(-1, 1).expand(m, k // 128)
    sb = _block_scale_b(weight_scale)
    # with a bias: fp32 out, then bias + one rounding in the epilogue (adding a bf16 bias to a bf16
    # output would round twice, which cancellation turns into large relative errors)
    out = F.scaled_mm(xq, weight.t(), xs, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                      output_dtype=out_dtype if bias is None else torch.float32)
    out = out[:m]
    return out if bias is None else fq.scale_epilogue(out, None, None, bias, out_dtype)


def _in_graph(x2, weight, weight_scale, input_scale, bias, spec, out_dtype, gemv: bool = True):
    """Activation quantization and ``torch._scaled_mm`` as plain aten ops (tensor / channel weights x
    static or dynamic tensor / token activations). Under inductor the op is replaced by these ops
    (:func:`decompositions`), so the quantization fuses into the kernel that produces x (RMSNorm, SiLU * up)
    and the small-M scale epilogue into the kernel that consumes the output; run as an op (eager,
    aot_eager) it computes the same. ``gemv``: where the tuning tables measured ``qcompile::fp8_gemv`` faster
    than cuBLASLt for this (N, K, M) on this GPU (:func:`fp8_gemv.chosen`), the matmul is that op (scales and bias
    inside)."""
    m, n = x2.shape[0], weight.shape[0]
    act = spec.act
    per_token = act.scale.granularity is Granularity.TOKEN
    per_channel = spec.weight.scale.granularity is Granularity.CHANNEL
    if act.dynamic:
        amax = x2.abs().amax(dim=-1, keepdim=True) if per_token else x2.abs().amax().reshape(1, 1)
        xs = quant_math.fp8_scale_from_amax(amax.float())
    else:
        xs = input_scale.float().reshape(1, 1)
    xq = (x2.float() / xs).clamp(-quant_math.FP8_MAX, quant_math.FP8_MAX).to(quant_math.FP8)
    ws = weight_scale.float()
    if gemv and isinstance(m, int) and fp8_gemv.runs(x2) and fp8_gemv.chosen(n, weight.shape[1], m, x2) is not None:
        return _gemv_op(xq, xs, weight, ws, bias, spec, out_dtype)
    if not (per_token or per_channel):
        return torch._scaled_mm(xq, weight.t(), xs.reshape(()), ws.reshape(()),
                                bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    if m < ROWWISE_MIN_M:  # TensorWise GEMM, the scales (and bias) as a pointwise epilogue
        one = torch.ones((), dtype=torch.float32, device=x2.device)
        acc = torch._scaled_mm(xq, weight.t(), one, one, out_dtype=torch.float32)
        y = acc * xs * ws.reshape(1, -1)
        return (y if bias is None else y + bias.float()).to(out_dtype)
    sa = xs if per_token else xs.expand(m, 1).contiguous()
    sb = ws.reshape(1, n) if per_channel else ws.reshape(1, 1).expand(1, n).contiguous()
    return torch._scaled_mm(xq, weight.t(), sa, sb, bias=None if bias is None else bias.to(out_dtype),
                            out_dtype=out_dtype)


def _block_scale_b(weight_scale: torch.Tensor) -> torch.Tensor:
    """scale_b for BlockWise128x128 on mat_b = weight.t(): torch 2.11 wants [round_up(K/128, 4), N/128]
    with strides (1, round_up(K/128, 4)), i.e. the transpose of [N/128, K/128] padded to a multiple
    of 4 k-blocks (probed: the unpadded transpose is rejected at K/128 = 3, 5)."""
    nb, kb = weight_scale.shape
    kp = -(-kb // 4) * 4
    if kp == kb:
        return weight_scale.contiguous().t()
    padded = weight_scale.new_zeros((nb, kp))
    padded[:, :kb] = weight_scale
    return padded.t()


def _flashinfer(x2, weight, weight_scale, input_scale, bias, spec, out_dtype):
    """Per-tensor x per-tensor through flashinfer.gemm.bmm_fp8: A [1, M, K], B [1, K, N] column-major."""
    _require_cuda(x2, "flashinfer")
    if spec.weight.scale.granularity is not Granularity.TENSOR or spec.act.scale.granularity is not Granularity.TENSOR:
        raise UnsupportedError(f"backend 'flashinfer' runs per-tensor scales only, not {spec.key}", where=OP)
    from flashinfer.gemm import bmm_fp8

    xq, xs = fq.quantize(x2, spec.act, input_scale)
    out = bmm_fp8(xq.unsqueeze(0), weight.t().unsqueeze(0), xs, weight_scale.float(), out_dtype)[0]
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


_IMPLS = {"emulated": _emulated, "scaled_mm": _scaled_mm, "gemv": _gemv, "flashinfer": _flashinfer}


@torch.library.custom_op(OP, mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, scheme: str, backend: str) -> torch.Tensor:
    spec = parse_scheme_key(scheme)
    _validate(x, weight, weight_scale, input_scale, spec, scheme)
    impl = _IMPLS.get(backend)
    if impl is None:
        raise unknown_backend(OP, backend, BACKENDS)
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    return impl(x2, weight, weight_scale, input_scale, bias, spec, x.dtype).reshape(*lead, n)


@fp8_linear.register_fake
def _(x, weight, weight_scale, input_scale, bias, scheme, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register_straight_through(OP)


@torch.library.custom_op(IN_GRAPH_OP, mutates_args=())
def fp8_linear_in_graph(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        input_scale: torch.Tensor | None, bias: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """``fp8_linear``'s tensor / token recipes as :func:`_in_graph`; inductor decomposes it into those ops."""
    spec = parse_scheme_key(scheme)
    _validate(x, weight, weight_scale, input_scale, spec, scheme)
    return _decompose(x, weight, weight_scale, input_scale, bias, scheme)


@fp8_linear_in_graph.register_fake
def _(x, weight, weight_scale, input_scale, bias, scheme):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _decompose(x, weight, weight_scale, input_scale, bias, scheme, gemv: bool = True):
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    out = _in_graph(x.reshape(-1, k), weight, weight_scale, input_scale, bias, parse_scheme_key(scheme), x.dtype,
                    gemv)
    return out.reshape(*lead, n)


register_straight_through(IN_GRAPH_OP)


def decompositions(gemv: bool = True) -> dict:
    """Inductor's decomposition of the in-graph op (``qcompile.backend``); ``gemv=False`` keeps cuBLASLt at every
    M (the backend option ``fp8_gemv``)."""
    return {torch.ops.qcompile.fp8_linear_in_graph.default: _decompose if gemv else functools.partial(_decompose,
                                                                                                     gemv=False)}


# -- registry ------------------------------------------------------------------------------------

def _cap(c: tuple[int, int] | None) -> str:
    return "none" if c is None else f"{c[0]}.{c[1]}"


def _cuda_reason(q: KernelQuery) -> str | None:
    why = fp8_w8a8_reason(q.scheme)
    if why:
        return why
    why = cuda_reason(q, (8, 9))
    if why:
        return why
    for dim, v in (("N", q.n), ("K", q.k)):
        if v % 16:
            return f"{dim}={v} not a multiple of 16"
    return None


def check_scaled_mm(q: KernelQuery) -> str | None:
    why = _cuda_reason(q)
    if why:
        return why
    w, a = q.scheme.weight.scale, q.scheme.act.scale
    if a.granularity is Granularity.GROUP and w.granularity is not Granularity.BLOCK:
        return (f"needs block weights for 1x{a.group_size}-group activations "
                f"(scaled_mm has no group x {w.granularity.value} recipe)")
    if a.granularity is Granularity.GROUP and a.group_size != 128:
        return f"needs 1x128 activation groups, have 1x{a.group_size}"
    if w.granularity is Granularity.BLOCK:
        if w.block != (128, 128):
            return f"needs 128x128 weight blocks, have {w.block[0]}x{w.block[1]}"
        if q.capability[0] != 9:
            return (f"needs compute capability 9.x for block FP8 (torch's 1x128 x 128x128 scaled_mm is "
                    f"Hopper-only), have {_cap(q.capability)}")
        if q.n % 128 or q.k % 128:
            return f"N={q.n}, K={q.k} not multiples of 128 (block scales)"
    return None


def check_inductor(q: KernelQuery) -> str | None:
    why = fp8_w8a8_reason(q.scheme)
    if why:
        return why
    w, a = q.scheme.weight.scale.granularity, q.scheme.act.scale.granularity
    if w is Granularity.BLOCK or a is Granularity.GROUP:
        return f"no block / group recipe (weight {w.value}, activation {a.value})"
    why = cuda_reason(q, (8, 9)) or (f"N={q.n}, K={q.k} not multiples of 16" if q.n % 16 or q.k % 16 else None)
    if why:  # the device first: on a CPU that is the reason, whatever the compiler
        return why
    if q.compiler != "inductor":
        return ("needs inductor as the inner compiler (its graph ops fuse there: backend(inner=\"inductor\")), "
                f"have {q.compiler}")
    return None


def check_flashinfer(q: KernelQuery) -> str | None:
    why = _cuda_reason(q)
    if why:
        return why
    w, a = q.scheme.weight.scale.granularity, q.scheme.act.scale.granularity
    if w is not Granularity.TENSOR or a is not Granularity.TENSOR:
        return f"needs per-tensor weight and activation scales, have weight {w.value}, activation {a.value}"
    return None


def check_emulated(q: KernelQuery) -> str | None:
    why = fp8_w8a8_reason(q.scheme)
    if why:
        return why
    a = q.scheme.act.scale
    if a.granularity is Granularity.GROUP and q.k % a.group_size:
        return f"K={q.k} not a multiple of the activation group size {a.group_size}"
    return None


FP8_SCALED_MM = register(Kernel(
    name="fp8_scaled_mm", op=OP, backend="scaled_mm", priority=30, check=check_scaled_mm, computes=fp8_w8a8_reason,
    description="Triton activation quant + torch._scaled_mm (tensor/row-wise) or F.scaled_mm (block, sm_90)",
))
FP8_INDUCTOR = register(Kernel(
    name="fp8_inductor", op=IN_GRAPH_OP, backend="", priority=35, check=check_inductor, computes=fp8_w8a8_reason,
    description="activation quant + torch._scaled_mm as graph ops: inductor fuses the quant into x's producer",
))
FP8_FLASHINFER = register(Kernel(
    name="fp8_flashinfer", op=OP, backend="flashinfer", priority=20, check=check_flashinfer,
    computes=fp8_w8a8_reason, requires=("flashinfer",),
    description="Triton activation quant + flashinfer bmm_fp8 (per-tensor only)",
))
FP8_EMULATED = register(Kernel(
    name="fp8_emulated", op=OP, backend="emulated", priority=10, check=check_emulated, computes=fp8_w8a8_reason,
    description="FP8 quantize-dequantize + fp32 matmul (any device)",
))
