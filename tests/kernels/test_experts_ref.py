"""qcompile::experts_ref (the MoE oracle): opcheck, against an independent per-token computation, its
gradients, and the gated activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qcompile  # noqa: F401  (registers the ops)
from qcompile.errors import UnsupportedError
from qcompile.kernels import quant_math
from qcompile.kernels.experts_ref import gated_activation
from qcompile.scheme import (MXFP4_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, Granularity, Packing, QDtype, QuantScheme,
                             ScaleSpec, WeightSpec, fp8_scheme, mx_act)
from tests.opcheck_util import opcheck

E, H, I, T, K = 4, 64, 32, 7, 2  # experts, hidden, intermediate, tokens, top-k
INT4_G32 = QuantScheme(WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=32), Packing.INT32))
FP6 = QuantScheme(WeightSpec(QDtype.FP6_E3M2, MXFP4_WEIGHT.scale, Packing.UINT8_FP6), mx_act(QDtype.FP6_E3M2))
SCHEMES = {
    "fp8 channel/token": fp8_scheme("channel", "dynamic_token"),
    "fp8 tensor/static": fp8_scheme("tensor", "static_tensor"),
    "nvfp4 w4a4": QuantScheme(NVFP4_WEIGHT, NVFP4_ACT),
    "int4 g32 weight-only": INT4_G32,
    "mxfp6 e3m2 w+a": FP6,
}


def quantize(w: torch.Tensor, scheme: QuantScheme, g: torch.Generator) -> dict:
    """Canonical tensors of one [N, K] weight under ``scheme`` (random codes where the scheme's writer
    is not at hand: the op's math is checked against the dequantized weight either way)."""
    n, k = w.shape
    spec = scheme.weight
    if spec.dtype is QDtype.FP8_E4M3:
        q, s = quant_math.quantize_weight_fp8(w, spec.scale.granularity)
        return {"weight": q, "weight_scale": s}
    if spec.dtype is QDtype.INT4:
        codes = torch.randint(-8, 8, (n, k), generator=g)
        return {"weight": quant_math.pack_int32(codes, 4), "weight_scale": torch.rand(n, k // 32, generator=g) * 0.02}
    if spec.dtype is QDtype.FP4_E2M1:
        codes = torch.randint(0, 16, (n, k), generator=g)
        scale = (torch.rand(n, k // 16, generator=g) * 2 + 0.5).to(torch.float8_e4m3fn)
        return {"weight": quant_math.pack_e2m1(codes), "weight_scale": scale, "weight_global_scale": torch.tensor(0.01)}
    codes = torch.randint(0, 64, (n, k), generator=g)
    return {"weight": quant_math.pack_fp6(codes), "weight_scale": torch.randint(120, 124, (n, k // 32), generator=g,
                                                                                  dtype=torch.uint8)}


def stacked(scheme: QuantScheme, rows: int, cols: int, g: torch.Generator) -> list:
    """The op's seven tensors of one projection, stacked over E experts (static input scales 0-d)."""
    per = [quantize(torch.randn(rows, cols, generator=g) * 0.1, scheme, g) for _ in range(E)]
    out = [torch.stack([p[r] for p in per]) if r in per[0] else None
           for r in ("weight", "weight_scale", "weight_global_scale")] + [None, None]
    act = scheme.act
    out.append(torch.tensor(0.02) if act is not None and not act.dynamic and not act.global_scale else None)
    out.append(torch.tensor(0.05) if act is not None and act.global_scale else None)
    return out


def make(scheme: QuantScheme, dtype=torch.bfloat16, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype)
    w13, w2 = stacked(scheme, 2 * I, H, g), stacked(scheme, H, I, g)
    biases = [torch.randn(E, 2 * I, generator=g).to(dtype), torch.randn(E, H, generator=g).to(dtype)] if bias \
        else [None, None]
    return x, index, weights, w13, w2, biases


def args_of(case, activation="silu", scheme=""):
    x, index, weights, w13, w2, biases = case
    return (x, index, weights, *w13, *w2, *biases, activation, scheme)


def independent(case, scheme: QuantScheme, activation="silu", on_input=False) -> torch.Tensor:
    """Token by token: dequantized weights, activations quantize-dequantized, fp32 (the intermediate
    rounded to x's dtype, as the op documents)."""
    x, index, weights, w13, w2, (b13, b2) = case

    def linear(v, tensors, e):
        w, s, gs = (None if t is None else t if t.dim() == 0 else t[e] for t in tensors[:3])
        wf = quant_math.dequantize_weight(w, s, scheme.weight, gs, k=v.shape[-1])
        if scheme.act is not None:
            v = quant_math.qdq_activation(v.reshape(1, -1), scheme.act, tensors[5], tensors[6]).reshape(-1)
        return v.float() @ wf.t()

    out = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            e, r = index[t, j].item(), weights[t, j].float()
            xt = (x[t].float() * r).to(x.dtype) if on_input else x[t]
            h = linear(xt, w13, e) + (0 if b13 is None else b13[e].float())
            a = gated_activation(h.reshape(1, -1), activation).reshape(-1).to(x.dtype)
            y = linear(a, w2, e) + (0 if b2 is None else b2[e].float())
            out[t] += y if on_input else r * y
    return out


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_matches_independent_per_token_math(name):
    scheme = SCHEMES[name]
    case = make(scheme, bias=name.startswith("int4"))
    out = torch.ops.qcompile.experts_ref(*args_of(case, scheme=scheme.key))
    want = independent(case, scheme)
    # the op and the loop differ in summation order and in one bf16 rounding of the output
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=2e-3 * want.abs().max().item())


def test_router_weight_on_input_and_sentinels():
    """apply_router_weight_on_input scales x before the experts (Llama-4's routing); expert ids outside
    [0, E) (expert-parallel sentinels) contribute nothing."""
    scheme = INT4_G32
    case = make(scheme, dtype=torch.float32)
    out = torch.ops.qcompile.experts_ref(*args_of(case, scheme=scheme.key), apply_router_weight_on_input=True)
    torch.testing.assert_close(out, independent(case, scheme, on_input=True), rtol=1e-4, atol=1e-5)
    x, index, weights, w13, w2, biases = case
    sentinel = index.clone()
    sentinel[:, 1] = E  # the second choice of every token routes nowhere
    out = torch.ops.qcompile.experts_ref(x, sentinel, weights, *w13, *w2, *biases, "silu", scheme.key)
    only_first = torch.ops.qcompile.experts_ref(x, index[:, :1], weights[:, :1], *w13, *w2, *biases, "silu",
                                                scheme.key)
    torch.testing.assert_close(out, only_first, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["fp8 channel/token", "nvfp4 w4a4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck(name, dtype):
    scheme = SCHEMES[name]
    x, index, weights, w13, w2, biases = make(scheme, dtype=dtype, bias=True)
    args = (x.requires_grad_(), index, weights.requires_grad_(), *w13, *w2, *biases, "silu", scheme.key)
    opcheck(torch.ops.qcompile.experts_ref.default, args)
    opcheck(torch.ops.qcompile.experts_ref.default, (x.reshape(1, T, H),) + args[1:])  # leading dims kept
    opcheck(torch.ops.qcompile.experts_ref.default, args, {"apply_router_weight_on_input": True})


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai:1.702:7.0"])
@pytest.mark.parametrize("on_input", [False, True])
def test_gradients_match_autograd_of_the_dequantized_experts(activation, on_input):
    """Weight-only scheme: the straight-through gradient is the exact gradient of the dequantized MoE,
    which autograd computes independently here (x and the routing weights)."""
    scheme = INT4_G32
    case = make(scheme, dtype=torch.float32, bias=True, seed=2)
    x, index, weights, w13, w2, (b13, b2) = case
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = torch.ops.qcompile.experts_ref(x, index, weights, *w13, *w2, b13, b2, activation, scheme.key,
                                         apply_router_weight_on_input=on_input)
    grad = torch.randn(T, H)
    gx, gw = torch.autograd.grad(out, (x, weights), grad)
    x2, w2r = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    d13 = torch.stack([quant_math.dequantize_weight(w13[0][e], w13[1][e], scheme.weight, k=H) for e in range(E)])
    d2 = torch.stack([quant_math.dequantize_weight(w2[0][e], w2[1][e], scheme.weight, k=I) for e in range(E)])
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(K):
            e = index[t, j]
            xt = x2[t] * w2r[t, j] if on_input else x2[t]
            h = d13[e] @ xt + b13[e]
            y = d2[e] @ gated_activation(h.reshape(1, -1), activation).reshape(-1) + b2[e]
            want = want.index_add(0, torch.tensor([t]), (y if on_input else w2r[t, j] * y).reshape(1, -1))
    ex, ew = torch.autograd.grad(want, (x2, w2r), grad)
    torch.testing.assert_close(gx, ex, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, ew, rtol=1e-4, atol=1e-5)


def test_swigluoai_is_gpt_oss_gate():
    """gpt-oss's _apply_gate on interleaved gate/up columns equals the op's activation on gate-then-up."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 2 * I, generator=g) * 8  # beyond the limit on both sides
    alpha, limit = 1.702, 7.0
    gate, up = h[:, ::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
    want = (up + 1) * gate * torch.sigmoid(gate * alpha)
    ours = gated_activation(torch.cat((h[:, ::2], h[:, 1::2]), -1), f"swigluoai:{alpha}:{limit}")
    torch.testing.assert_close(ours, want)
    silu = gated_activation(h, "silu")
    torch.testing.assert_close(silu, F.silu(h[:, :I]) * h[:, I:])


@pytest.mark.parametrize("name,fn", [("silu_no_mul", F.silu), ("gelu_no_mul", F.gelu),
                                     ("gelu_tanh_no_mul", lambda v: F.gelu(v, approximate="tanh")),
                                     ("relu2_no_mul", lambda v: torch.relu(v) ** 2)])
def test_non_gated_activations(name, fn):
    """act(h) on every column (w13 holds I rows, no up half), and its gradient, against torch's own."""
    h = (torch.randn(5, 2 * I, dtype=torch.float64) * 3).requires_grad_()
    grad = torch.randn(5, 2 * I, dtype=torch.float64)
    torch.testing.assert_close(gated_activation(h.detach(), name), fn(h.detach()))
    torch.testing.assert_close(gated_activation(h.detach(), name, grad), torch.autograd.grad(fn(h), h, grad)[0])


def test_refuses_unknown_activation_and_unrunnable_scheme():
    scheme = INT4_G32
    case = make(scheme)
    with pytest.raises(UnsupportedError, match="unknown experts activation 'relu'"):
        torch.ops.qcompile.experts_ref(*args_of(case, "relu", scheme.key))
    asym = QuantScheme(scheme.weight, fp8_scheme("channel", "dynamic_token").act.__class__(
        QDtype.INT8, True, ScaleSpec(Granularity.TOKEN), symmetric=False))
    with pytest.raises(UnsupportedError, match="asymmetric"):
        torch.ops.qcompile.experts_ref(*args_of(case, "silu", asym.key))
