"""Autograd of the quantized-linear ops: straight through to x, frozen weights.

Every qcompile op that takes activations has one formula (``reference.register_straight_through``):
``grad_x = grad_out @ dequantize(weight)``, the bias's gradient where it requires grad, none for the
quantized weight and its scales. Checked op by op (opcheck with x and bias requiring grad, gradients
against the dequantized weight in fp32), then on a model: compiled inference with and without
``no_grad``, and a LoRA-style adapter trained over the frozen quantized model.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import qcompile
from qcompile.kernels import quant_math, reference
from qcompile.linear import QuantLinear
from qcompile.scheme import parse_scheme_key
from tests.kernels import test_fp8, test_nvfp4, test_reference, test_wo_gemm
from tests.opcheck_util import opcheck

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])
HALF_ONLY = {"wo_linear"}  # ops that take bf16 / fp16 activations only


def _ref_fp8(name):
    x, q, s, xs, b, _ = test_reference.make_args(test_reference.SCHEMES[name], m=6)
    return "linear_ref", (x, q, s, None, None, None, xs, None, b, test_reference.SCHEMES[name].key)


def _ref_wo(name):
    c = test_wo_gemm.make_case(name, 64, 256, (2, 3), bias=True)
    return "linear_ref", (c["x"], c["weight"], c["weight_scale"], c["weight_global_scale"], c["weight_zero_point"],
                          c["weight_g_idx"], None, None, c["bias"], c["scheme"])


def _ref_nvfp4():
    x, w, s, gw, gx, b = test_nvfp4.make_args(m=4)
    return "linear_ref", (x, w, s, gw, None, None, None, gx, b, test_nvfp4.SCHEME.key)


def _fp8(weight, act):
    return "fp8_linear", test_fp8.op_args(test_fp8.make_case(weight, act, (2, 3), 256, 256, bias=True), "emulated")


def _wo(name, act_order_sorted=False):
    c = test_wo_gemm.make_case(name, 64, 256, (2, 3), bias=True)
    return "wo_linear", test_wo_gemm.op_args(test_wo_gemm.sorted_case(c) if act_order_sorted else c, "dequant")


def _nvfp4():
    x, w, s, gw, gx, b = test_nvfp4.make_args(m=4)
    return "nvfp4_linear", (x, w, s, gw, gx, b, test_nvfp4.SCHEME.key, "emulated")


CASES = {
    "ref-fp8-tensor-static": lambda: _ref_fp8("tensor/static"),
    "ref-fp8-block-group": lambda: _ref_fp8("block/group"),
    "ref-int4-g128-zp": lambda: _ref_wo("int4_g128_zp"),
    "ref-nvfp4-w4a4": _ref_nvfp4,
    "fp8-tensor-dynamic": lambda: _fp8("tensor", "dynamic_tensor"),
    "fp8-channel-token": lambda: _fp8("channel", "dynamic_token"),
    "fp8-block-group": lambda: _fp8("block", "dynamic_group"),
    "wo-int4-g32-actorder": lambda: _wo("int4_g32_actorder"),
    "wo-int4-g32-actorder-sorted": lambda: _wo("int4_g32_actorder", act_order_sorted=True),
    "wo-nvfp4": lambda: _wo("nvfp4"),
    "wo-mxfp4": lambda: _wo("mxfp4"),
    "wo-int8-tensor-zp": lambda: _wo("int8_tensor_zp"),
    "wo-mxfp8": lambda: _wo("mxfp8"),
    "nvfp4": _nvfp4,
}


def _op(name):
    return getattr(torch.ops.qcompile, name).default


def _case(key, fp32=False):
    """(op, args, names) of CASES[key], x and bias requiring grad; with ``fp32``, x and bias in fp32 where
    the op takes it, else in bf16."""
    name, args = CASES[key]()
    op = _op(name)
    names = [a.name for a in op._schema.arguments]
    args = list(args)
    dtype = (torch.bfloat16 if name in HALF_ONLY else torch.float32) if fp32 else None
    for role in ("x", "bias"):
        t = args[names.index(role)]
        args[names.index(role)] = t.detach().to(dtype or t.dtype).requires_grad_(True)
    return op, args, names


def _dequantized(args, names) -> torch.Tensor:
    get = dict(zip(names, args)).get
    spec = parse_scheme_key(get("scheme")).weight
    return quant_math.dequantize_weight(get("weight"), get("weight_scale"), spec, get("weight_global_scale"),
                                        get("weight_zero_point"), get("weight_g_idx"), k=get("x").shape[-1])


@pytest.mark.parametrize("key", sorted(CASES))
def test_opcheck_with_grad(key):
    """opcheck with x and bias requiring grad: the autograd registration, and fake / AOT dispatch (which
    also compares the AOT-traced backward with eager's)."""
    op, args, _ = _case(key)
    opcheck(op, args)


@pytest.mark.parametrize("key", sorted(CASES))
def test_grad_is_the_dequantized_linears(key):
    """grad_x = grad @ W_dequant and grad_bias = grad summed over rows, against autograd of F.linear
    with the dequantized weight in fp32: x in fp32 where the op takes it (same math, 1e-5), else bf16
    (the gradient rounded to bf16 once, 1 %)."""
    op, args, names = _case(key, fp32=True)
    x, bias = args[names.index("x")], args[names.index("bias")]
    out = op(*args)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    gx, gb = torch.autograd.grad(out, (x, bias), grad)
    xr, br = x.detach().float().requires_grad_(True), bias.detach().float().requires_grad_(True)
    want_x, want_b = torch.autograd.grad(F.linear(xr, _dequantized(args, names), br), (xr, br), grad.float())
    assert gx.dtype == x.dtype and gb.dtype == bias.dtype
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    for got, want in ((gx, want_x), (gb, want_b)):
        assert ((got.float() - want).norm() / want.norm()).item() < tol


@pytest.mark.filterwarnings("ignore:Input #. requires gradient and is not a double")
def test_weight_only_gradcheck_in_fp32():
    """torch.autograd.gradcheck of a weight-only op in fp32 (linear in x, so central differences are the
    derivative up to fp32 rounding, ~1e-5 here): the formula is the op's derivative, not only its own
    idea of it. Element by element on a 16x128 layer (a 1 % error in the formula fails)."""
    c = test_wo_gemm.make_case("int4_g128_zp", 16, 128, (2,), bias=True)
    op = _op("linear_ref")

    def f(x, bias):
        return op(x, c["weight"], c["weight_scale"], None, c["weight_zero_point"], None, None, None, bias, c["scheme"])
    x, bias = (c[r].detach().float().requires_grad_(True) for r in ("x", "bias"))
    assert torch.autograd.gradcheck(f, (x, bias), eps=1e-2, atol=1e-4, rtol=1e-3)


def test_quantized_weight_and_scales_get_no_gradient():
    """Scales that require grad (a user's nn.Parameter left trainable) get none: they are frozen."""
    op, args, names = _case("fp8-channel-token", fp32=True)
    scale = args[names.index("weight_scale")].requires_grad_(True)
    gx, gs = torch.autograd.grad(op(*args).sum(), (args[names.index("x")], scale), allow_unused=True)
    assert gx is not None and gs is None


def _straight_through_calls(fn) -> list[str]:
    """The functions of the straight-through formula (reference.register_straight_through) that ``fn()`` calls."""
    calls = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename == reference.__file__ and code.co_name in ("setup_context", "backward"):
            calls.append(code.co_name)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_backward_is_recorded_only_when_needed():
    """Under no_grad, or with nothing requiring grad, the op runs as if it had no formula: no autograd
    node, and the formula's setup_context is never called (nothing saved); with x requiring grad it is
    called once, and the node is the generated one."""
    op, args, names = _case("fp8-tensor-dynamic", fp32=True)
    frozen = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        assert _straight_through_calls(lambda: op(*args)) == [] and op(*args).grad_fn is None
    assert _straight_through_calls(lambda: op(*frozen)) == [] and op(*frozen).grad_fn is None
    assert _straight_through_calls(lambda: op(*args)) == ["setup_context"]
    assert "GeneratedBackwardFor_qcompile_fp8_linear" in type(op(*args).grad_fn).__name__


@pytest.mark.parametrize("name", ["int4_g32_actorder", "nvfp4", "mxfp4", "int8_tensor_zp", "mxfp8"])
def test_dequantize_weight_op(name):
    c = test_wo_gemm.make_case(name, 64, 256)
    args = (c["weight"], c["weight_scale"], c["weight_global_scale"], c["weight_zero_point"], c["weight_g_idx"],
            256, c["scheme"])
    opcheck(torch.ops.qcompile.dequantize_weight.default, args)
    assert torch.equal(torch.ops.qcompile.dequantize_weight(*args), test_wo_gemm.dequantized(c))


# -- on a model ----------------------------------------------------------------------------------

# compiled vs eager logits: aot_eager's weight-only kernel multiplies in bf16 (~1 %); inductor also keeps
# fp32 intermediates where eager rounds (docs/design.md, Numerics)
TOLERANCE = {"aot_eager": 0.02, "inductor": 0.1}


@pytest.mark.parametrize("inner", sorted(TOLERANCE))
def test_compiled_inference_with_and_without_no_grad(one_layer, inner):
    """The loaded model's unquantized parameters (embedding, norms) require grad, so outside no_grad
    AOTAutograd traces the backward of every quantized linear too."""
    model = qcompile.load(one_layer("ct-w4a16"))
    assert any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        want = model(IDS).logits.float()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=qcompile.backend(inner=inner))
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out = compiled(IDS).logits
        assert out.requires_grad == grad
        rel = ((out.detach().float() - want).norm() / want.norm()).item()
        assert rel < TOLERANCE[inner], (grad, rel)


class LoRA(torch.nn.Module):
    """``base(x) + up(down(x))``: a rank-``r`` adapter beside a frozen layer (``up`` starts at zero)."""

    def __init__(self, base: torch.nn.Module, dtype: torch.dtype, r: int = 4):
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, r, bias=False, dtype=dtype)
        self.up = torch.nn.Linear(r, base.out_features, bias=False, dtype=dtype)
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("fmt,inner", [("modelopt-fp8", None), ("ct-w4a16", None), ("modelopt-fp8", "aot_eager"),
                                       ("ct-w4a16", "inductor")])
def test_lora_adapter_trains_over_frozen_quantized_model(one_layer, fmt, inner):
    """Adapters on q_proj and v_proj of a frozen quantized model: their gradient comes back through
    the quantized o_proj and MLP (straight through the FP8 activation quantization of modelopt-fp8),
    the loss of a fixed batch falls, the quantized tensors get no gradient. Eager and compiled."""
    torch.manual_seed(0)
    model = qcompile.load(one_layer(fmt)).requires_grad_(False)
    attn = model.model.layers[0].self_attn
    attn.q_proj, attn.v_proj = LoRA(attn.q_proj, model.dtype), LoRA(attn.v_proj, model.dtype)
    adapters = [p for m in (attn.q_proj, attn.v_proj) for p in (m.down.weight, m.up.weight)]
    opt = torch.optim.Adam(adapters, lr=1e-2)
    forward = model
    if inner is not None:
        torch._dynamo.reset()
        forward = torch.compile(model, backend=qcompile.backend(inner=inner))
    losses = []
    for _ in range(6):
        loss = forward(IDS, labels=IDS).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)
    frozen = [p for m in model.modules() if isinstance(m, QuantLinear) for p in m.parameters()]
    assert len(frozen) >= 14 and all(p.grad is None for p in frozen)
    assert losses[-1] < losses[0] - 0.05, losses
