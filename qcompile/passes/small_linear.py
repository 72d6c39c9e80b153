"""The small-linear pass: a decode-size floating-point linear layer with few outputs, typically a Mixture-of-Experts
router, as a reduction that inductor generates.

cuBLAS runs ``x [M, K] @ W[N, K]^T`` with a few rows and a small weight in a GEMM kernel that keeps few SMs busy:
about 5 µs on an H200 for a Qwen3-MoE router (128 x 2048 bf16, M = 1), which reads 0.5 MB, in every MoE layer of
every decode step. Written as ``sum(x[..., None, :] * W, -1)`` in fp32 (a bf16 GEMM's exact products and fp32
accumulation, rounded once to x's dtype; a bias is added in fp32 before that rounding), inductor generates one
reduction kernel over K that spreads the outputs over the GPU (1.8 µs for that router) and, on sm_90+, launches it
with PDL. The reduction reads W once per row of x (after the first from L2), so it pays while ``M x W's bytes`` is
small. On an H200 it was faster than cuBLAS in every measured cell with M x bytes <= 12 MiB (weights of 0.07 to
8.4 MB, bf16 and fp32, M = 1 to 16), the limit below; on three shapes held out of that choice it never took the
slower of the two (``docs/benchmarks.md``, MoE routers).

The pass rewrites a call to ``F.linear`` on CUDA whose output needs no gradient, with static shapes, floating x, weight
(and bias) of one dtype, M <= MAX_M rows and M x weight bytes <= MAX_ROW_BYTES, under inductor only (run as
separate ops the product would be materialized). Linear layers that qcompile quantizes are its ops by then, not
``F.linear``. ``backend(small_linear=False)`` turns the pass off.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx

from .lowering import example, replace_calls

MAX_M = 16  # rows of x
MAX_ROW_BYTES = 12 << 20  # M x the weight's bytes: what the reduction reads (L2 after the first row)
LINEAR = (torch._C._nn.linear, F.linear)


def linear_by_reduction(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as a product and a sum over K in fp32, rounded once to x's dtype."""
    out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _static(shape) -> bool:
    return all(isinstance(d, int) for d in shape)


def _rewritable(node: fx.Node, devices: tuple[str, ...]) -> tuple | None:
    """(x, weight[, bias]) when ``node`` is a linear this pass runs (see the module doc)."""
    if node.op != "call_function" or node.target not in LINEAR:
        return None
    args = dict(zip(("input", "weight", "bias"), node.args), **node.kwargs)
    x, w, b, out = example(args.get("input")), example(args.get("weight")), example(args.get("bias")), example(node)
    if not all(isinstance(t, torch.Tensor) for t in (x, w, out)) or (b is not None and not isinstance(b, torch.Tensor)):
        return None
    if x.device.type not in devices or out.requires_grad or w.dim() != 2 or x.dim() < 1:
        return None
    if not (x.dtype.is_floating_point and x.dtype == w.dtype and (b is None or b.dtype == x.dtype)):
        return None
    if not (_static(x.shape) and _static(w.shape)):
        return None
    m = math.prod(x.shape[:-1])
    if not 1 <= m <= MAX_M or m * w.numel() * w.element_size() > MAX_ROW_BYTES:
        return None
    return (args["input"], args["weight"]) + ((args["bias"],) if b is not None else ())


def rewrite_small_linears(gm: fx.GraphModule, example_inputs=None, devices: tuple[str, ...] = ("cuda",)) -> list:
    """Rewrite every small linear of ``gm`` on ``devices`` in place (see the module doc). Returns no explain rows;
    logs how many it rewrote."""
    return replace_calls(gm, lambda node: _rewritable(node, devices), linear_by_reduction,
                         "small linear layer(s) run as an inductor reduction")
