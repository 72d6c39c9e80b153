"""Quantization arithmetic in plain PyTorch: the semantics every kernel is checked against.

All functions are device-generic and work in fp32. Shapes: x [M, K], weight [N, K] (row-major, as
``nn.Linear`` stores it), scales in the canonical shapes of :func:`qcompile.scheme.canonical_shape`.
"""

from __future__ import annotations

import torch

from ..scheme import ActSpec, Granularity, QDtype, ScaleDtype, WeightSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest dynamic scale: an all-zero row must not divide by zero (vLLM uses 1/(448*512) likewise).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating x / scale -> fp8 e4m3 (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_fp8_scale(x: torch.Tensor, granularity: Granularity, group_size: int = 0) -> torch.Tensor:
    """Scale for dynamic activation quantization of x [M, K]:
    TENSOR -> [] ; TOKEN -> [M, 1] ; GROUP -> [M, K // group_size]."""
    xf = x.float().abs()
    if granularity is Granularity.TENSOR:
        amax = xf.amax()
    elif granularity is Granularity.TOKEN:
        amax = xf.amax(dim=-1, keepdim=True)
    elif granularity is Granularity.GROUP:
        m, k = x.shape
        amax = xf.view(m, k // group_size, group_size).amax(dim=-1)
    else:
        raise AssertionError(f"activation granularity {granularity}")
    return fp8_scale_from_amax(amax)


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # 1 ulp off for about half the scales, which flips ~0.07 % of the fp8 codes vs the kernels.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def expand_scale(scale: torch.Tensor, spec_granularity: Granularity, n: int, k: int,
                 group_size: int = 0, block: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Broadcast a canonical weight scale to [n, k] (or something broadcastable to it)."""
    if spec_granularity is Granularity.TENSOR:
        return scale.reshape(())
    if spec_granularity is Granularity.CHANNEL:
        return scale.reshape(n, 1)
    if spec_granularity is Granularity.GROUP:
        return scale.repeat_interleave(group_size, dim=1)[:, :k]
    if spec_granularity is Granularity.BLOCK:
        bn, bk = block
        return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    raise AssertionError(f"weight granularity {spec_granularity}")


def scale_to_fp32(scale: torch.Tensor, dtype: ScaleDtype) -> torch.Tensor:
    if dtype is ScaleDtype.E8M0:  # uint8 biased exponent
        return torch.exp2(scale.to(torch.int32).float() - 127.0)
    return scale.float()


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, spec: WeightSpec,
                      global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [N, K] from an FP8 weight and its canonical scale (the other element types land with
    their kernels, see docs/formats.md)."""
    if spec.dtype is not QDtype.FP8_E4M3:
        raise NotImplementedError(f"reference dequantization of {spec.dtype.value} weights")
    n, k = weight.shape
    s = expand_scale(scale_to_fp32(scale, spec.scale.dtype), spec.scale.granularity, n, k,
                     spec.scale.group_size, spec.scale.block)
    w = weight.float() * s
    if global_scale is not None:
        w = w * global_scale.float()
    return w


def quantize_activation(x: torch.Tensor, act: ActSpec, input_scale: torch.Tensor | None = None):
    """FP8-quantize x [M, K] as ``act`` says. Returns (q fp8 [M, K], scale broadcastable to the
    per-element scale: [] / [M, 1] / [M, K//g])."""
    if act.dtype is not QDtype.FP8_E4M3:
        raise NotImplementedError(f"reference quantization of {act.dtype.value} activations")
    if act.dynamic:
        scale = dynamic_fp8_scale(x, act.scale.granularity, act.scale.group_size)
    else:
        scale = input_scale.float().reshape(())
    if act.scale.granularity is Granularity.GROUP:
        m, k = x.shape
        g = act.scale.group_size
        q = quantize_fp8(x.float().view(m, k // g, g), scale.unsqueeze(-1)).view(m, k)
    else:
        q = quantize_fp8(x, scale)
    return q, scale


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, act: ActSpec) -> torch.Tensor:
    if act.scale.granularity is Granularity.GROUP:
        m, k = q.shape
        g = act.scale.group_size
        return (q.float().view(m, k // g, g) * scale.unsqueeze(-1)).view(m, k)
    return q.float() * scale


def requantize_to_max_scale(weights: list[torch.Tensor], scales: list[torch.Tensor]):
    """Several FP8 shards with per-tensor scales that run as one matmul (fused qkv / gate_up, or the
    experts' gate and up): dequantize each and requantize with the largest scale, as the reference
    does. Returns (fp8 [sum N_i, K], fp32 scalar scale)."""
    max_scale = torch.stack([s.float().reshape(()) for s in scales]).max()
    parts = [quantize_fp8(w.float() * s.float().reshape(()), max_scale) for w, s in zip(weights, scales)]
    return torch.cat(parts, dim=0), max_scale


def quantize_weight_fp8(weight: torch.Tensor, granularity: Granularity, block: int = 128):
    """Online FP8 weight quantization of a bf16/fp16 [N, K] weight. TENSOR -> scale []; CHANNEL ->
    [N]; BLOCK -> [N/block, K/block] (N and K must divide; the caller checks and names the layer)."""
    w = weight.float()
    n, k = w.shape
    if granularity is Granularity.TENSOR:
        scale = fp8_scale_from_amax(w.abs().amax())
        return quantize_fp8(w, scale), scale
    if granularity is Granularity.CHANNEL:
        scale = fp8_scale_from_amax(w.abs().amax(dim=1))
        return quantize_fp8(w, scale[:, None]), scale
    if granularity is Granularity.BLOCK:
        tiles = w.view(n // block, block, k // block, block)
        scale = fp8_scale_from_amax(tiles.abs().amax(dim=(1, 3)))
        q = quantize_fp8(tiles, scale[:, None, :, None]).view(n, k)
        return q, scale
    raise AssertionError(f"online weight granularity {granularity}")
