"""``qcompile::nvfp4_linear``: NVFP4 W4A4 linear layers with real FP4 tensor-core GEMMs (sm_100+).

One op, two implementations chosen by its ``backend`` argument:

* ``"emulated"`` (any device): the reference math (:func:`quant_math.reference_linear`): x
  quantize-dequantized to NVFP4 under its static global scale, the weight dequantized, fp32 matmul.
* ``"flashinfer"`` (CUDA sm_100+, FlashInfer installed): ``flashinfer.fp4_quantize`` for x, then
  ``flashinfer.mm_fp4`` on the checkpoint's own packed weight. FlashInfer's global scales are the
  reciprocals of the canonical multiplying ones (``x ≈ q · s / gs``), so x is quantized with
  ``1 / input_global_scale`` and the product is rescaled by ``alpha = input_global_scale ·
  weight_global_scale``. The weight's block scales go in FlashInfer's 128x4-swizzled layout
  (``nvfp4_block_scale_interleave``), built per call for now.

On sm_90 and below NVFP4 W4A4 runs weight-only (``qcompile::wo_linear``) with a one-time warning, as
the reference does; ``kernels='reference'`` gives the faithful W4A4 emulation there. The Blackwell
path is written against FlashInfer's documented API and selected by capability; no sm_100 GPU was
available, so its tests mock the capability and FlashInfer (tests/kernels/test_nvfp4.py; the
registry table in docs/kernels-wo.md).

Canonical inputs: x [..., K] bf16/fp16; weight uint8 [N, K/2] (low nibble = even element);
weight_scale fp8 e4m3 [N, K/16]; weight_global_scale and input_global_scale fp32 [1] (multiplying).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..scheme import NVFP4_ACT, NVFP4_WEIGHT, parse_scheme_key
from . import quant_math
from .reference import register_straight_through
from .registry import Kernel, KernelQuery, cuda_reason, register, unknown_backend

OP = "qcompile::nvfp4_linear"
BACKENDS = ("emulated", "flashinfer")
ALIGN = 128  # N and K multiples of this for mm_fp4 (the 128x4 scale tiles; real model dims are)


def nvfp4_w4a4_reason(scheme) -> str | None:
    if scheme.weight != NVFP4_WEIGHT or scheme.act != NVFP4_ACT:
        return f"scheme {scheme.key} is not NVFP4 W4A4"
    return None


def _flashinfer(x2, weight, weight_scale, weight_global_scale, input_global_scale, out_dtype):
    import flashinfer

    g_x = input_global_scale.float().reshape(1)
    xq, xs = flashinfer.fp4_quantize(x2, 1.0 / g_x, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True)
    ws = flashinfer.nvfp4_block_scale_interleave(weight_scale.contiguous().view(torch.uint8))
    ws = ws.view(torch.float8_e4m3fn).reshape(-1, weight_scale.shape[1])
    alpha = (g_x * weight_global_scale.float().reshape(1)).reshape(1)
    return flashinfer.mm_fp4(xq, weight.t(), xs, ws.t(), alpha, out_dtype, block_size=16)


@torch.library.custom_op(OP, mutates_args=())
def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                 input_global_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str, backend: str
                 ) -> torch.Tensor:
    spec = parse_scheme_key(scheme)
    why = nvfp4_w4a4_reason(spec)
    if why:
        raise UnsupportedError(why, where=OP)
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    if weight.shape != (n, k // 2) or weight_scale.shape != (n, k // 16):
        raise UnsupportedError(f"weight {tuple(weight.shape)} / weight_scale {tuple(weight_scale.shape)} do not "
                               f"match K={k}: expected [N, K/2] and [N, K/16]", where=OP,
                               fix="pass the canonical NVFP4 tensors (qcompile.scheme)")
    x2 = x.reshape(-1, k).contiguous()
    if backend == "emulated":
        out = quant_math.reference_linear(x2, spec, weight, weight_scale, weight_global_scale, None, None, None,
                                          input_global_scale, bias).to(x.dtype)
    elif backend == "flashinfer":
        if not x2.is_cuda:
            raise UnsupportedError("backend 'flashinfer' needs a CUDA tensor", where=OP, fix="use backend='emulated'")
        out = _flashinfer(x2, weight, weight_scale, weight_global_scale, input_global_scale, x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
    else:
        raise unknown_backend(OP, backend, BACKENDS)
    return out.reshape(*lead, n)


@nvfp4_linear.register_fake
def _(x, weight, weight_scale, weight_global_scale, input_global_scale, bias, scheme, backend):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


register_straight_through(OP)


def check_flashinfer(q: KernelQuery) -> str | None:
    why = nvfp4_w4a4_reason(q.scheme) or cuda_reason(q, (10, 0))
    if why:
        return why
    if q.n % ALIGN or q.k % ALIGN:
        return f"N={q.n}, K={q.k} not multiples of {ALIGN}"
    return None


NVFP4_FLASHINFER = register(Kernel(
    name="nvfp4_flashinfer", op=OP, backend="flashinfer", priority=40, check=check_flashinfer,
    computes=nvfp4_w4a4_reason, requires=("flashinfer",), description="flashinfer fp4_quantize + mm_fp4 (NVFP4 W4A4, sm_100+)",
))
