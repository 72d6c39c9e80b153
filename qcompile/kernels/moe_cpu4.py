"""``qcompile::dyn4bit_moe``: W4A8-int MoE experts on the CPU through PyTorch's dynamic 4-bit matmul.

compressed-tensors W4A8-int experts (int4 weights, symmetric, per channel or in groups; int8 activations,
dynamic per token), as vLLM runs them on the CPU (``CompressedTensorsW4A8Int8MoEMethod``): every expert's
projections packed once by ``aten._dyn_quant_pack_4bit_weight`` (weights as unsigned nibbles, scales fp32 per
channel or bf16 per group, the bias inside), each routed expert's rows multiplied by
``aten._dyn_quant_matmul_4bit``, which quantizes them to int8 per token itself. On Arm CPUs PyTorch runs these
ops on KleidiAI's kernels; elsewhere on a fallback slower than the reference, so the registry picks this kernel
only where ``torch.backends.kleidiai.is_available()``.

    h   = dyn4bit(x_t, w13[e]) (+ b13[e])      fp32, x_t quantized to int8 per token by the op
    a   = act(h)                                rounded to x.dtype (experts_ref's order)
    y_t += r * dyn4bit(a, w2[e]) (+ b2[e])      (apply_router_weight_on_input: r scales x_t)

Against ``qcompile::experts_ref`` on the same scheme the results differ by the activation quantization
(KleidiAI's per-token int8 is asymmetric, the scheme's symmetric) and by group scales rounded to bf16 for the
packing, as in vLLM. ``backend="reference"`` runs experts_ref's math.

The packed payload is the kernel's own layout: made at the first call on a layer's weights and kept beside them
(one more copy of the experts on the host), so the module, the reference path and ``save_pretrained`` keep the
checkpoint's tensors.
"""

from __future__ import annotations

import sys
import weakref

import torch

from ..errors import UnsupportedError
from ..scheme import Granularity, Packing, QDtype, QuantScheme, parse_scheme_key
from .experts_ref import (ACTIVATIONS, NON_GATED, check_call, gated_activation, reference_experts,
                          register_straight_through)
from .registry import Kernel, KernelQuery, register, unknown_backend

OP = "qcompile::dyn4bit_moe"
BACKENDS = ("reference", "kleidiai")
PROJECTIONS = ("gate/up projection w13", "down projection w2")


def scheme_reason(scheme: QuantScheme) -> str | None:
    """None when the scheme is W4A8-int as this kernel computes it, else what it is not."""
    w, a = scheme.weight, scheme.act
    if w.dtype is not QDtype.INT4 or w.global_scale or w.zero_point or w.act_order or w.k_sorted or w.tiled or \
            w.packing not in (Packing.NONE, Packing.INT32):
        return "computes symmetric int4 weights (per channel or group) only"
    if w.scale.granularity not in (Granularity.CHANNEL, Granularity.GROUP):
        return f"computes int4 weights per channel or group, have scales per {w.scale.granularity.value}"
    if a is None or a.dtype is not QDtype.INT8 or not a.dynamic or a.scale.granularity is not Granularity.TOKEN:
        return "computes int8 activations quantized per token at run time (W4A8-int) only"
    return None


def shape_reason(scheme: QuantScheme, k: int) -> str | None:
    """Why the packing does not take a projection with ``k`` inputs (KleidiAI: groups of a multiple of 32
    dividing K), or None."""
    g = scheme.weight.scale.group_size
    if scheme.weight.scale.granularity is Granularity.GROUP and (g % 32 or k % g):
        return f"K={k}, group size {g}: the 4-bit packing takes groups of a multiple of 32 dividing K (or channels)"
    return None


def available() -> bool:
    """PyTorch's KleidiAI kernels back the dynamic 4-bit ops on this CPU."""
    kai = getattr(torch.backends, "kleidiai", None)
    return bool(kai is not None and kai.is_available())


def _nibbles(w: torch.Tensor, k: int) -> torch.Tensor:
    """One expert's int4 codes -> uint8 [N, K/2], low nibble the even element, code + 8 (the packing's input)."""
    if w.dtype == torch.int8:  # one code per element in [-8, 7]
        u = (w.to(torch.int16) + 8).to(torch.uint8)
        return u[:, ::2] | (u[:, 1::2] << 4)
    if sys.byteorder != "little":
        raise UnsupportedError("int32-packed int4 words need a little-endian CPU here", where=OP)
    return w.contiguous().view(torch.uint8).reshape(w.shape[0], k // 2)  # words: code j at bits 4j, + 8


def block(scheme: QuantScheme, k: int) -> int:
    """The packing's block along K: the scale group, or K itself for channel scales (and a group of K)."""
    return scheme.weight.scale.group_size if scheme.weight.scale.granularity is Granularity.GROUP else k


def _pack(weight, scale, bias, scheme: QuantScheme, k: int) -> list[torch.Tensor]:
    """Every expert's payload of ``aten._dyn_quant_pack_4bit_weight``."""
    group = block(scheme, k)
    out = []
    for e in range(weight.shape[0]):
        n = weight.shape[1]
        s = scale[e].reshape(n, -1).float()
        s = s.to(torch.bfloat16) if group < k else s  # (the kernel's scale types: bf16 per group, fp32 per channel)
        b = None if bias is None else bias[e].float()
        out.append(torch.ops.aten._dyn_quant_pack_4bit_weight(_nibbles(weight[e], k), s, b, group, k, n))
    return out


_PACKED: dict[int, tuple] = {}  # id of a weight -> (weakref to it, what the payloads were made from, payloads)


def packed(weight, scale, bias, scheme: QuantScheme, k: int) -> list[torch.Tensor]:
    """The payloads of one projection's experts, made at the first call and kept while the weight lives (made
    again where the weight changed in place or comes with other scales, bias or scheme)."""
    made_from = (weight._version, id(scale), id(bias), scheme.key)
    hit = _PACKED.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == made_from:
        return hit[2]
    payloads = _pack(weight, scale, bias, scheme, k)
    if hit is None or hit[0]() is not weight:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    _PACKED[id(weight)] = (weakref.ref(weight), made_from, payloads)
    return payloads


def dyn4bit_experts(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, scheme: QuantScheme, i: int,
                    on_input: bool) -> torch.Tensor:
    """The module doc's math for x [T, H]: fp32 [T, H]; ``w13`` / ``w2``: (weight, scale) stacked over experts,
    ``i`` the down projection's inputs."""
    t, h = x.shape
    e, n1 = w13[0].shape[:2]
    p13, p2 = packed(*w13, b13, scheme, h), packed(*w2, b2, scheme, i)
    g13, g2 = block(scheme, h), block(scheme, i)
    out = torch.zeros((t, h), dtype=torch.float32)
    for ex in torch.unique(ids).tolist():
        if not 0 <= ex < e:
            continue
        rows, slot = torch.where(ids == ex)
        r = weights[rows, slot].float().unsqueeze(-1)
        xe = (x[rows].float() * r).to(x.dtype) if on_input else x[rows]
        hid = torch.ops.aten._dyn_quant_matmul_4bit(xe.float().contiguous(), p13[ex], g13, h, n1)
        a = gated_activation(hid, activation).to(x.dtype)
        y = torch.ops.aten._dyn_quant_matmul_4bit(a.float().contiguous(), p2[ex], g2, i, h)
        out.index_add_(0, rows, y if on_input else y * r)
    return out


def _check(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, scheme: QuantScheme) -> int:
    """I after checking the call (experts_ref.check_call, then the W4A8-int tensors); UnsupportedError naming
    the tensor otherwise."""
    why = scheme_reason(scheme)
    if why:
        raise UnsupportedError(f"scheme {scheme.key}: {why}", where=OP, fix="use qcompile::experts_ref")
    def check_projection(prefix: str, k: int, e: int) -> None:
        (w, s), what = (w13, PROJECTIONS[0]) if prefix == "w13" else (w2, PROJECTIONS[1])
        width = k if w.dtype == torch.int8 else k // 8
        if w.dtype not in (torch.int8, torch.int32) or w.shape[-1] != width or s is None or s.shape[:2] != w.shape[:2]:
            raise UnsupportedError(f"{what}: expected int8 or int32 weights [E, N, K'] with scales [E, N, ...], got "
                                   f"{w.dtype} {list(w.shape)} and {None if s is None else list(s.shape)}", where=OP)

    return check_call(x, ids, weights, w13[0], w2[0], b13, b2, activation, OP, check_projection)[1]


@torch.library.custom_op(OP, mutates_args=())
def dyn4bit_moe(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    scheme: str,
    apply_router_weight_on_input: bool = False,
    backend: str = "reference",
) -> torch.Tensor:
    """A layer of W4A8-int routed experts (module doc). ``backend``: "reference" (experts_ref's math, any
    device) or "kleidiai" (PyTorch's dynamic 4-bit matmul, CPU)."""
    if backend not in BACKENDS:
        raise unknown_backend(OP, backend, BACKENDS)
    spec = parse_scheme_key(scheme)
    x = hidden_states
    w13, w2 = (w13_weight, w13_weight_scale), (w2_weight, w2_weight_scale)
    i = _check(x, top_k_index, top_k_weights, w13, w2, w13_bias, w2_bias, activation, spec)
    lead, h, k = x.shape[:-1], x.shape[-1], top_k_index.shape[-1]
    x2, ids, weights = x.reshape(-1, h), top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)
    if backend == "reference":
        none = (None,) * 5
        out = reference_experts(x2, ids, weights, w13 + none, w2 + none, w13_bias, w2_bias, activation, scheme,
                                apply_router_weight_on_input)
        return out.to(x.dtype).reshape(*lead, h)
    if x.device.type != "cpu":
        raise UnsupportedError(f"backend 'kleidiai' runs on the CPU, got {x.device}", where=OP,
                               fix="use backend='reference'")
    for what, kk in zip(PROJECTIONS, (h, i)):
        why = shape_reason(spec, kk)
        if why:
            raise UnsupportedError(f"backend 'kleidiai': {what}: {why}", where=OP, fix="use backend='reference'")
    out = dyn4bit_experts(x2, ids, weights, w13, w2, w13_bias, w2_bias, activation, spec, i,
                          apply_router_weight_on_input)
    return out.to(x.dtype).reshape(*lead, h)


@dyn4bit_moe.register_fake
def _(hidden_states, top_k_index, top_k_weights, *rest, **kwargs):
    return torch.empty_like(hidden_states)


# -- autograd: experts_ref's straight-through gradient ----------------------------------------------

register_straight_through(OP, ("weight", "weight_scale"))


# -- registry --------------------------------------------------------------------------------------

def check(q: KernelQuery) -> str | None:
    """None when the KleidiAI path runs the experts query ``q``, else why not."""
    if q.device != "cpu":
        return f"runs on the CPU, have {q.device}"
    if not available():
        return ("PyTorch's dynamic 4-bit matmul has no KleidiAI kernels on this CPU (Arm only); its fallback is "
                "slower than the reference")
    name = q.activation.split(":")[0]
    if name not in ACTIVATIONS + NON_GATED:
        return f"activation {q.activation!r} is not one of {list(ACTIVATIONS + NON_GATED)}"
    i = q.n // 2 if name in ACTIVATIONS else q.n
    for what, k in zip(PROJECTIONS, (q.k, i)):
        why = shape_reason(q.scheme, k)
        if why:
            return f"{what}: {why}"
    return None


DYN4BIT_MOE = register(Kernel(
    name="dyn4bit_moe", op=OP, backend="kleidiai", priority=20, check=check, computes=scheme_reason,
    kind="experts", quantizes_acts=True, description="W4A8-int experts on the CPU: PyTorch's dynamic 4-bit matmul (KleidiAI on Arm)",
))
