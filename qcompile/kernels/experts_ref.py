"""``qcompile::experts_ref``: the reference for a layer of routed MoE experts.

What a loaded model's ``QuantExperts.forward`` calls (so the uncompiled model is correct on any
device), what the Experts pass finds and lowers, and the oracle MoE kernels are tested against.

Arguments: ``hidden_states`` [T, H] (any leading dims), ``top_k_index`` [T, k] (expert ids; ids outside
[0, E) route nowhere, as expert-parallel sentinels), ``top_k_weights`` [T, k]; the canonical tensors of
the fused gate + up projection ``w13_*`` (weight codes [E, 2I, K'], gate rows then up rows) and of the
down projection ``w2_*`` ([E, H, I']), one per role of :data:`qcompile.linear.OP_ROLES` and stacked over
experts (scales [E] / [E, N] / [E, N, K/g] / [E, N/bn, K/bk], act-order ``g_idx`` [E, K]; the static
activation scales are 0-d, shared by all experts); the biases ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H]
or None; ``activation`` (:func:`gated_activation`) and ``scheme`` (the experts' QuantScheme key). Its
math, in fp32, for every token t and each of its k (expert e, weight r):

    h   = qdq(x_t) @ dequantize(w13[e]).T + b13[e]          (qdq when the scheme quantizes activations;
                                                          a dynamic per-tensor scale spans the batch)
    a   = act(h[:I]) * h[I:]   (rounded to the activation dtype, as every fused kernel keeps it;
                                non-gated activations: act(h), w13 [E, I, K'])
    y_t += r * (qdq(a) @ dequantize(w2[e]).T + b2[e])

or with ``apply_router_weight_on_input`` the weight r scales x_t instead of y. Each projection is
:func:`quant_math.reference_linear`, the dense reference's own math.

Autograd (:func:`reference_experts_grad`): the gradient reaches ``hidden_states`` and ``top_k_weights``
through the dequantized weights, straight through each activation quantization (as the linear ops'
formula); the quantized tensors and the biases are frozen.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import UnsupportedError
from ..scheme import Granularity, QDtype, parse_scheme_key
from . import quant_math
from .reference import reference_supports
from .registry import Kernel, KernelQuery, register

OP = "qcompile::experts_ref"
# The op's tensor arguments of one projection (prefixed w13_ / w2_), in order (linear.OP_ROLES).
ROLES = ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx", "input_scale",
         "input_global_scale")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
NON_GATED = ("silu_no_mul", "gelu_no_mul", "gelu_tanh_no_mul", "relu2_no_mul")  # act(h): w13 holds I rows
_SQRT_2_PI = 0.7978845608028654  # sqrt(2 / pi)


def _act_parts(name: str, params, gate: torch.Tensor, up: torch.Tensor):
    """(act(gate) * up, d/d gate, d/d up) of a gated activation, elementwise."""
    if name == "silu":
        s = torch.sigmoid(gate)
        return gate * s * up, s * (1 + gate * (1 - s)) * up, gate * s
    if name == "gelu":
        cdf = 0.5 * (1 + torch.erf(gate * 0.7071067811865476))
        pdf = torch.exp(-0.5 * gate * gate) * 0.3989422804014327
        return gate * cdf * up, (cdf + gate * pdf) * up, gate * cdf
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_PI * (gate + 0.044715 * gate ** 3))
        d = 0.5 * (1 + t) + 0.5 * gate * (1 - t * t) * _SQRT_2_PI * (1 + 3 * 0.044715 * gate * gate)
        return 0.5 * gate * (1 + t) * up, d * up, 0.5 * gate * (1 + t)
    if name == "swigluoai":
        alpha, limit = (float(p) for p in params)
        g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        s = torch.sigmoid(g * alpha)
        d_gate = (u + 1) * (s + alpha * g * s * (1 - s)) * (gate <= limit)
        return (u + 1) * g * s, d_gate, g * s * ((up >= -limit) & (up <= limit))
    raise UnsupportedError(f"unknown experts activation {name!r}", where=OP,
                           fix=f"one of {list(ACTIVATIONS)} (swigluoai:<alpha>:<limit>)")


def _plain_parts(name: str, h: torch.Tensor):
    """(act(h), its derivative) of a non-gated activation, elementwise."""
    if name == "relu2":
        r = torch.relu(h)
        return r * r, 2 * r
    value, d_gate, _ = _act_parts(name, (), h, torch.ones_like(h))
    return value, d_gate


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's swigluoai constants


def split_activation(activation: str) -> tuple[str, float, float]:
    """``"swigluoai:1.702:7.0"`` (the experts op's spelling) -> ("swigluoai", alpha, limit); without
    parameters gpt-oss's constants."""
    name, *params = activation.split(":")
    alpha, limit = (float(p) for p in params) if params else (SWIGLU_ALPHA, SWIGLU_LIMIT)
    return name, alpha, limit


def gated_activation(h: torch.Tensor, activation: str, grad: torch.Tensor | None = None) -> torch.Tensor:
    """[M, 2I] gate columns then up columns -> [M, I]; with ``grad`` ([M, I], of the result) the gradient
    of h instead. ``silu`` / ``gelu`` / ``gelu_tanh``: act(gate) * up; ``swigluoai:<alpha>:<limit>``
    (gpt-oss): gate clamped above at limit, up to [-limit, limit], ``(up + 1) * gate * sigmoid(alpha *
    gate)``. The :data:`NON_GATED` ones (``silu_no_mul``, ..., ``relu2_no_mul``: relu(h)^2) take [M, I]."""
    name, *params = activation.split(":")
    if name in NON_GATED:
        value, d = _plain_parts(name.removesuffix("_no_mul"), h)
        return value if grad is None else grad * d
    gate, up = h.chunk(2, dim=-1)
    value, d_gate, d_up = _act_parts(name, params, gate, up)
    return value if grad is None else torch.cat((grad * d_gate, grad * d_up), dim=-1)


def expert_slice(tensors: tuple, e: int) -> tuple:
    """Expert ``e``'s slice of each stacked tensor; 0-d ones (static activation scales) are shared."""
    return tuple(None if t is None else t if t.dim() == 0 else t[e] for t in tensors)


def _routes(top_k_index: torch.Tensor, num_experts: int):
    """(expert, its token rows, their top-k slots) for each expert that any token routes to."""
    for e in torch.unique(top_k_index).tolist():
        if 0 <= e < num_experts:
            rows, slot = torch.where(top_k_index == e)
            yield e, rows, slot


def _batch_scale(spec, batch: torch.Tensor, tensors: tuple) -> tuple:
    """Dynamic per-tensor activation scales are taken over the whole batch a projection sees (every
    token for w13, every routed (token, expert) row for w2), as the fused kernels quantize it: (the
    scheme with that scale made static, ``tensors`` with it as input_scale). Other schemes as they are."""
    act = spec.act
    if act is None or not act.dynamic or act.scale.granularity is not Granularity.TENSOR or \
            act.dtype not in (QDtype.FP8_E4M3, QDtype.INT8):
        return spec, tensors
    _, scale = quant_math.quantize_activation(batch, act)
    return replace(spec, act=replace(act, dynamic=False)), (*tensors[:5], scale, *tensors[6:])


def _hidden(x, top_k_index, top_k_weights, w13, w13_bias, activation, spec, on_input):
    """The first half for every expert any token routes to: [(e, rows, slot, r, h, a)] and the w2
    scheme (with its batch scale, :func:`_batch_scale`)."""
    routes = list(_routes(top_k_index, w13[0].shape[0]))
    parts = []
    for e, rows, slot in routes:
        r = top_k_weights[rows, slot].float().unsqueeze(-1)
        parts.append((e, rows, slot, r, (x[rows].float() * r).to(x.dtype) if on_input else x[rows]))
    spec13, w13 = _batch_scale(spec, torch.cat([p[4] for p in parts]) if on_input and parts else x, w13)
    out = []
    for e, rows, slot, r, xe in parts:
        h = quant_math.reference_linear(xe, spec13, *expert_slice(w13, e), None if w13_bias is None else w13_bias[e])
        out.append((e, rows, slot, r, h, gated_activation(h, activation).to(x.dtype)))
    return out, spec13


def reference_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13: tuple,
                      w2: tuple, w13_bias, w2_bias, activation: str, scheme: str, on_input: bool = False
                      ) -> torch.Tensor:
    """The module docstring's math for x [T, H]: fp32 [T, H]. ``w13`` / ``w2``: the stacked tensors in
    :data:`ROLES` order."""
    spec = parse_scheme_key(scheme)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    parts, _ = _hidden(x, top_k_index, top_k_weights, w13, w13_bias, activation, spec, on_input)
    if not parts:
        return out
    spec2, w2 = _batch_scale(spec, torch.cat([p[5] for p in parts]), w2)
    for e, rows, slot, r, h, a in parts:
        y = quant_math.reference_linear(a, spec2, *expert_slice(w2, e), None if w2_bias is None else w2_bias[e])
        out.index_add_(0, rows, y if on_input else y * r)
    return out


def reference_experts_grad(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, w13: tuple, w2: tuple, w13_bias, w2_bias, activation: str,
                           scheme: str, on_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`reference_experts`'s sum against ``grad`` [T, H] for x and top_k_weights (fp32),
    every activation quantization (and the intermediate's rounding) passed straight through."""
    spec = parse_scheme_key(scheme)
    gx, gr = torch.zeros(x.shape, dtype=torch.float32, device=x.device), torch.zeros_like(top_k_weights, dtype=torch.float32)
    parts, _ = _hidden(x, top_k_index, top_k_weights, w13, w13_bias, activation, spec, on_input)
    if not parts:
        return gx, gr
    spec2, w2 = _batch_scale(spec, torch.cat([p[5] for p in parts]), w2)
    for e, rows, slot, r, h, a in parts:
        t13, t2 = expert_slice(w13, e), expert_slice(w2, e)
        d13 = quant_math.dequantize_weight(t13[0], t13[1], spec.weight, t13[2], t13[3], t13[4], k=x.shape[-1])
        d2 = quant_math.dequantize_weight(t2[0], t2[1], spec.weight, t2[2], t2[3], t2[4], k=a.shape[-1])
        g = grad[rows].float()
        if on_input:
            g_xe = gated_activation(h, activation, g @ d2) @ d13
            gx.index_add_(0, rows, g_xe * r)
            gr[rows, slot] = (g_xe * x[rows].float()).sum(-1)
            continue
        y = quant_math.reference_linear(a, spec2, *t2, None if w2_bias is None else w2_bias[e])
        gr[rows, slot] = (g * y).sum(-1)
        gx.index_add_(0, rows, gated_activation(h, activation, (g * r) @ d2) @ d13)
    return gx, gr


def is_gated(activation: str, where: str = OP) -> bool:
    """Whether ``activation`` is gated (w13 holds gate rows then up rows); UnsupportedError for an unknown one."""
    name = activation.split(":")[0]
    if name not in ACTIVATIONS + NON_GATED:
        raise UnsupportedError(f"unknown experts activation {activation!r}", where=where,
                               fix=f"one of {list(ACTIVATIONS + NON_GATED)} (swigluoai:<alpha>:<limit>)")
    return name in ACTIVATIONS


def check_call(x, ids, weights, w13_weight, w2_weight, b13, b2, activation: str, where: str,
               check_projection=None) -> tuple[int, int, int]:
    """(E, I, k) of an experts kernel op's call after checking what every kernel of the family needs (x, the
    routing, the stacked weights' leading dimensions, the biases) and, by ``check_projection(prefix, K, E)``
    ("w13" with K = H, then "w2" with K = I), the kernel's format; UnsupportedError naming the tensor otherwise."""
    h = x.shape[-1]
    if not x.dtype.is_floating_point:
        raise UnsupportedError(f"hidden_states must be floating point, got {x.dtype}", where=where)
    if ids.dtype not in (torch.int32, torch.int64) or ids.shape[:-1] != x.shape[:-1] or ids.dim() == 0:
        raise UnsupportedError(f"top_k_index must be int32/int64 [{', '.join(map(str, x.shape[:-1]))}, k], got "
                               f"{ids.dtype} {list(ids.shape)}", where=where)
    if weights.shape != ids.shape or not weights.dtype.is_floating_point:
        raise UnsupportedError(f"top_k_weights must be float {list(ids.shape)}, got {weights.dtype} "
                               f"{list(weights.shape)}", where=where)
    if w13_weight.dim() != 3 or w2_weight.dim() != 3:
        raise UnsupportedError(f"w13_weight and w2_weight must be stacked over experts [E, N, K'], got "
                               f"{list(w13_weight.shape)} and {list(w2_weight.shape)}", where=where)
    e, n1 = w13_weight.shape[:2]
    gated = is_gated(activation, where)
    if n1 % 2 and gated:
        raise UnsupportedError(f"w13_weight has {n1} rows: a gated activation ({activation}) needs gate rows "
                               "then up rows, 2I in all", where=where)
    i = n1 // 2 if gated else n1
    if check_projection:
        check_projection("w13", h, e)
    if w2_weight.shape[:2] != (e, h):
        raise UnsupportedError(f"w2_weight must be [E={e}, H={h}, ...], got {list(w2_weight.shape)}", where=where)
    if check_projection:
        check_projection("w2", i, e)
    for name, b, n in (("w13_bias", b13, n1), ("w2_bias", b2, h)):
        if b is not None and (tuple(b.shape) != (e, n) or not b.dtype.is_floating_point):
            raise UnsupportedError(f"{name} must be a float [{e}, {n}] bias, got {b.dtype} {list(b.shape)}",
                                   where=where)
    return e, i, ids.shape[-1]


def _check(scheme: str, activation: str) -> None:
    why = reference_supports(parse_scheme_key(scheme))
    if why:
        raise UnsupportedError(why, where=OP)
    if activation.split(":")[0] not in ACTIVATIONS + NON_GATED:
        raise UnsupportedError(f"unknown experts activation {activation!r}", where=OP,
                               fix=f"one of {list(ACTIVATIONS + NON_GATED)}")


def _projections(args: dict) -> tuple[tuple, tuple]:
    """The w13 and w2 tensors of an op call's arguments (by name), each in ROLES order."""
    return tuple(tuple(args[f"{p}_{role}"] for role in ROLES) for p in ("w13", "w2"))


@torch.library.custom_op(OP, mutates_args=())
def experts_ref(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor | None,
    w13_weight_global_scale: torch.Tensor | None,
    w13_weight_zero_point: torch.Tensor | None,
    w13_weight_g_idx: torch.Tensor | None,
    w13_input_scale: torch.Tensor | None,
    w13_input_global_scale: torch.Tensor | None,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor | None,
    w2_weight_global_scale: torch.Tensor | None,
    w2_weight_zero_point: torch.Tensor | None,
    w2_weight_g_idx: torch.Tensor | None,
    w2_input_scale: torch.Tensor | None,
    w2_input_global_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    scheme: str,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    _check(scheme, activation)
    lead, h = hidden_states.shape[:-1], hidden_states.shape[-1]
    w13, w2 = _projections(locals())
    k = top_k_index.shape[-1]
    out = reference_experts(hidden_states.reshape(-1, h), top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k), w13,
                            w2, w13_bias, w2_bias, activation, scheme, apply_router_weight_on_input)
    return out.to(hidden_states.dtype).reshape(*lead, h)


@experts_ref.register_fake
def _(hidden_states, top_k_index, top_k_weights, *rest, **kwargs):
    return torch.empty_like(hidden_states)


def _check_kernel(q: KernelQuery) -> str | None:
    return reference_supports(q.scheme)


REFERENCE = register(Kernel(
    name="reference", op=OP, backend="", priority=0, check=_check_kernel, computes=reference_supports,
    kind="experts", description="per expert: dequantize + fp32 matmuls (any device); the oracle",
))


# -- autograd: straight through the quantization -------------------------------------------------

@torch.library.custom_op("qcompile::experts_ref_backward", mutates_args=())
def experts_backward(
    grad: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor | None,
    w13_weight_global_scale: torch.Tensor | None,
    w13_weight_zero_point: torch.Tensor | None,
    w13_weight_g_idx: torch.Tensor | None,
    w13_input_scale: torch.Tensor | None,
    w13_input_global_scale: torch.Tensor | None,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor | None,
    w2_weight_global_scale: torch.Tensor | None,
    w2_weight_zero_point: torch.Tensor | None,
    w2_weight_g_idx: torch.Tensor | None,
    w2_input_scale: torch.Tensor | None,
    w2_input_global_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    scheme: str,
    apply_router_weight_on_input: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of hidden_states, grad of top_k_weights) of :func:`experts_ref` (:func:`reference_experts_grad`).
    An op, so that a compiled backward calls it as it is."""
    h, k = hidden_states.shape[-1], top_k_index.shape[-1]
    w13, w2 = _projections(locals())
    gx, gr = reference_experts_grad(grad.reshape(-1, h), hidden_states.reshape(-1, h), top_k_index.reshape(-1, k),
                                    top_k_weights.reshape(-1, k), w13, w2, w13_bias, w2_bias, activation, scheme,
                                    apply_router_weight_on_input)
    return gx.to(hidden_states.dtype).reshape(hidden_states.shape), gr.to(top_k_weights.dtype).reshape(
        top_k_weights.shape)


@experts_backward.register_fake
def _(grad, hidden_states, top_k_index, top_k_weights, *rest):
    return torch.empty_like(hidden_states), torch.empty_like(top_k_weights)


def register_straight_through(op: str, roles: tuple[str, ...] = ROLES, scheme_of=None) -> None:
    """Give an experts-family op experts_ref's straight-through gradient (for hidden_states and top_k_weights).
    The op's arguments: hidden_states, top_k_index, top_k_weights, w13_<role> and w2_<role> for ``roles`` (of
    :data:`ROLES`, in order), w13_bias, w2_bias, activation, scheme, then optionally
    apply_router_weight_on_input and more. ``scheme_of``: the scheme key the gradient uses for the op's."""
    n = 3 + 2 * len(roles) + 2
    namespace, name = op.split("::")
    n_args = len(getattr(getattr(torch.ops, namespace), name).default._schema.arguments)

    def full(tensors) -> tuple:
        return tuple(tensors[roles.index(r)] if r in roles else None for r in ROLES)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:n])
        activation, scheme, *rest = inputs[n:]
        ctx.activation, ctx.on_input = activation, bool(rest[0]) if rest else False
        ctx.scheme = scheme_of(scheme) if scheme_of else scheme

    def backward(ctx, grad):
        grads = [None] * n_args
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            x, ids, weights, *t, b13, b2 = ctx.saved_tensors
            gx, gr = torch.ops.qcompile.experts_ref_backward(grad, x, ids, weights, *full(t[:len(roles)]),
                                                             *full(t[len(roles):]), b13, b2, ctx.activation,
                                                             ctx.scheme, ctx.on_input)
            grads[0] = gx if ctx.needs_input_grad[0] else None
            grads[2] = gr if ctx.needs_input_grad[2] else None
        return tuple(grads)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


register_straight_through(OP)
