"""``qcompile::linear_ref``: the reference quantized linear.

This is the op a loaded model's ``QuantLinear.forward`` calls, so the uncompiled model is correct on
any device (slowly); it is also what the Linear pass finds in the graph Dynamo hands the backend and
lowers to a kernel op, and the oracle kernels are tested against. Its math, in fp32:

    out = qdq(x) @ dequantize(weight).T + bias        (qdq only when the scheme quantizes activations)

Arguments follow the canonical roles of :mod:`qcompile.scheme` (kernel ops reuse these names).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..scheme import QDtype, parse_scheme_key
from . import quant_math
from .registry import Kernel, KernelQuery, register

OP = "qcompile::linear_ref"


def reference_supports(scheme) -> str | None:
    """None when the reference math covers ``scheme``, else what is missing."""
    if scheme.weight.dtype is not QDtype.FP8_E4M3 or scheme.weight.packing.value != "none":
        return f"{scheme.weight.dtype.value} weights are not runnable yet (weight-only 4/8-bit kernels: issue #3)"
    if scheme.weight.zero_point or scheme.weight.act_order or scheme.weight.global_scale:
        return "FP8 weights with zero points / act-order / a global scale are not runnable"
    if scheme.act is not None and scheme.act.dtype is not QDtype.FP8_E4M3:
        return f"{scheme.act.dtype.value} activations are not runnable yet"
    if scheme.act is not None and not scheme.act.symmetric:
        return "asymmetric activation quantization is not runnable"
    return None


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
    w = quant_math.dequantize_weight(weight, weight_scale, spec.weight, weight_global_scale)
    if spec.act is not None:
        q, s = quant_math.quantize_activation(x2, spec.act, input_scale)
        xf = quant_math.dequantize_activation(q, s, spec.act)
    else:
        xf = x2.float()
    out = xf @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, w.shape[0])


@linear_ref.register_fake
def _(x, weight, weight_scale, weight_global_scale, weight_zero_point, weight_g_idx, input_scale,
      input_global_scale, bias, scheme):
    n = weight.shape[0]
    return x.new_empty(*x.shape[:-1], n)


def _check(q: KernelQuery) -> str | None:
    return reference_supports(q.scheme)


REFERENCE = register(Kernel(
    name="reference", op=OP, backend="", priority=0, check=_check,
    description="dequantize + fp32 matmul (any device); the oracle",
))
