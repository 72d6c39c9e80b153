"""``qcompile::linear_ref``: the reference quantized linear.

This is the op a loaded model's ``QuantLinear.forward`` calls, so the uncompiled model is correct on
any device (slowly); it is also what the Linear pass finds in the graph Dynamo hands the backend and
lowers to a kernel op, and the oracle kernels are tested against. Its math, in fp32:

    out = qdq(x) @ dequantize(weight).T + bias        (qdq only when the scheme quantizes activations)

Arguments follow the canonical roles of :mod:`qcompile.scheme` (kernel ops reuse these names).

Autograd, for every qcompile quantized-linear op (:func:`register_straight_through`): the gradient
reaches x through the dequantized weight (``qcompile::dequantize_weight``), straight through any
activation quantization; the quantized weight and its scales are frozen.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..scheme import Granularity, Packing, QDtype, ScaleDtype, parse_scheme_key
from . import quant_math
from .registry import Kernel, KernelQuery, register

OP = "qcompile::linear_ref"


def reference_supports(scheme) -> str | None:
    """None when the reference math covers ``scheme``, else what is missing."""
    w, a = scheme.weight, scheme.act
    decodable = (w.packing is Packing.NONE and w.dtype in (QDtype.FP8_E4M3, QDtype.INT8, QDtype.INT4)) or \
        (w.packing is Packing.INT32 and w.dtype in (QDtype.INT4, QDtype.INT8)) or \
        (w.packing is Packing.UINT8 and w.dtype is QDtype.FP4_E2M1) or \
        (w.packing is Packing.UINT8_FP6 and w.dtype in (QDtype.FP6_E2M3, QDtype.FP6_E3M2))
    if not decodable:
        return f"{w.dtype.value} weights packed as {w.packing.value} are not runnable yet"
    if a is None:
        return None
    if not a.symmetric:
        return "asymmetric activation quantization is not runnable"
    if a.dtype in (QDtype.FP8_E4M3, QDtype.INT8) and a.scale.dtype is ScaleDtype.FP32 and \
            (a.dtype is QDtype.FP8_E4M3 or a.scale.granularity in (Granularity.TENSOR, Granularity.TOKEN)):
        return None  # FP8 (any weight: emulated) or INT8 per tensor / token activations
    if a.dtype is QDtype.FP4_E2M1 and a.global_scale:  # NVFP4 W4A4 (emulated: quantize-dequantize)
        return None
    if a.scale.dtype is ScaleDtype.E8M0 and a.dynamic and a.scale.granularity is Granularity.GROUP:
        return None  # OCP MX activations (emulated)
    return f"{a.dtype.value} activations ({a.key()}) with {w.dtype.value} weights are not runnable yet"


@torch.library.custom_op(OP, mutates_args=())
def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    weight_global_scale: torch.Tensor | None,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    input_global_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    scheme: str,
) -> torch.Tensor:
    spec = parse_scheme_key(scheme)
    why = reference_supports(spec)
    if why:
        raise UnsupportedError(why, where=OP)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    out = quant_math.reference_linear(x2, spec, weight, weight_scale, weight_global_scale, weight_zero_point,
                                      weight_g_idx, input_scale, input_global_scale, bias)
    return out.to(x.dtype).reshape(*lead, out.shape[-1])


@linear_ref.register_fake
def _(x, weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, input_scale,
      input_global_scale, bias, scheme):
    n = weight.shape[0]
    return x.new_empty(*x.shape[:-1], n)


def _check(q: KernelQuery) -> str | None:
    return reference_supports(q.scheme)


REFERENCE = register(Kernel(
    name="reference", op=OP, backend="", priority=0, check=_check, computes=reference_supports,
    description="dequantize + fp32 matmul (any device); the oracle",
))


# -- autograd: straight through the quantization -------------------------------------------------

WEIGHT_ROLES = ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx")


@torch.library.custom_op("qcompile::dequantize_weight", mutates_args=())
def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor | None,
                      weight_zero_point: torch.Tensor | None, weight_g_idx: torch.Tensor | None, k: int,
                      scheme: str) -> torch.Tensor:
    """The weight of a quantized linear as fp32 [N, K] (:func:`quant_math.dequantize_weight`, in the
    original column order of an act-order weight sorted at load). An op, so that a compiled backward
    calls it as it is instead of tracing the unpacking."""
    spec = parse_scheme_key(scheme).weight
    return quant_math.dequantize_weight(weight, weight_scale, spec, weight_global_scale, weight_zero_point,
                                        weight_g_idx, k=k)


@dequantize_weight.register_fake
def _(weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, k, scheme):
    return weight.new_empty((weight.shape[0], k), dtype=torch.float32)


def register_straight_through(op: str) -> None:
    """Register the autograd formula of the quantized-linear op ``op`` ("qcompile::fp8_linear"; its
    arguments named by the canonical roles: ``x``, the ``WEIGHT_ROLES`` it has, ``bias``, ``scheme``).

    ``grad_x = grad_out @ dequantize(weight)`` in fp32, cast to x.dtype: the activation quantization is
    passed straight through, as quantization-aware training does. A bias that requires grad gets
    ``grad_out`` summed over the rows. The quantized weight and its scales are frozen: no gradient.
    Autograd calls ``setup_context`` only when grad mode is on and an input requires grad; under
    ``no_grad`` or with frozen inputs the op runs exactly as without a formula."""
    ns, name = op.split("::")
    names = [a.name for a in getattr(getattr(torch.ops, ns), name).default._schema.arguments]
    at = {arg: i for i, arg in enumerate(names)}
    x_at, bias_at = at["x"], at["bias"]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*(inputs[at[role]] if role in at else None for role in WEIGHT_ROLES))
        x, bias = inputs[x_at], inputs[bias_at]
        ctx.k, ctx.x_dtype, ctx.scheme = x.shape[-1], x.dtype, inputs[at["scheme"]]
        ctx.bias_dtype = None if bias is None else bias.dtype

    def backward(ctx, grad):
        grads = [None] * len(names)
        if ctx.needs_input_grad[x_at]:
            w = torch.ops.qcompile.dequantize_weight(*ctx.saved_tensors, ctx.k, ctx.scheme)
            grads[x_at] = (grad.float() @ w).to(ctx.x_dtype)
        if ctx.needs_input_grad[bias_at]:
            grads[bias_at] = grad.float().reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return tuple(grads)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


register_straight_through(OP)
