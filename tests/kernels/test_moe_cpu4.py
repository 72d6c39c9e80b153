"""qcompile::dyn4bit_moe: W4A8-int experts through PyTorch's dynamic 4-bit matmul on the CPU.

On x86 PyTorch runs these ops on its fallback (KleidiAI's kernels are Arm-only), which quantizes each row of x to
int8 asymmetrically, as KleidiAI's ``qai8dx`` kernels do. The oracle here emulates exactly that on the
dequantized weights (group scales rounded to bf16, as the packing stores them), so the kernel's packing, nibble
order, routing, activation, bias and router weighting are checked to fp32 rounding (normwise < 1e-5; a wrong
nibble or expert errs by O(1)). Against experts_ref (symmetric int8 activations) the two quantizations differ
by ~1 % per projection on these random weights: checked below 6 % normwise. Selection by the CPU's KleidiAI
kernels is tested with their availability mocked.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch

import qcompile
from qcompile.kernels import moe_cpu4, quant_math
from qcompile.kernels.experts_ref import gated_activation
from qcompile.kernels.registry import KernelQuery, select
from qcompile.scheme import ActSpec, Granularity, Packing, QDtype, QuantScheme, ScaleSpec
from tests.kernels.test_moe_wo import FORMATS, make_moe

INT8_TOKEN = ActSpec(QDtype.INT8, True, ScaleSpec(Granularity.TOKEN))
ARGS = ("hidden_states", "top_k_index", "top_k_weights", "w13_weight", "w13_weight_scale", "w2_weight",
        "w2_weight_scale", "w13_bias", "w2_bias")


def w4a8(fmt: str, unpacked: bool = False) -> QuantScheme:
    spec = FORMATS[fmt]
    return QuantScheme(dataclasses.replace(spec, packing=Packing.NONE) if unpacked else spec, INT8_TOKEN)


def moe(fmt: str, unpacked: bool = False, **kw) -> dict:
    """make_moe's W4A8 tensors; ``unpacked``: int8 codes (compressed-tensors int-quantized) for int32 words."""
    args = make_moe(fmt, scheme=w4a8(fmt).key, **kw)
    if unpacked:
        for p in ("w13", "w2"):
            w = args[f"{p}_weight"]
            args[f"{p}_weight"] = quant_math.unpack_int32(w.reshape(-1, w.shape[-1]), 4, w.shape[-1] * 8).reshape(
                *w.shape[:2], -1).to(torch.int8)
        args["scheme"] = w4a8(fmt, True).key
    args["top_k_index"][0, 0] = -1  # another rank's expert
    return args


def call(args: dict, backend: str, on_input: bool = False) -> torch.Tensor:
    return torch.ops.qcompile.dyn4bit_moe(*(args[n] for n in ARGS), args["activation"], args["scheme"], on_input,
                                          backend)


def asym_int8(x: torch.Tensor) -> torch.Tensor:
    """x quantize-dequantized to int8 per row, asymmetric (the range [min(x, 0), max(x, 0)] in 255 steps)."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=torch.finfo(torch.float32).tiny)
    zp = (-128 - lo / scale).round()
    return ((x / scale + zp).round().clamp(-128, 127) - zp) * scale


def emulated(args: dict, on_input: bool = False) -> torch.Tensor:
    """The kernel's math on dequantized weights: asymmetric int8 rows, bf16 group scales, fp32 products."""
    spec = moe_cpu4.parse_scheme_key(args["scheme"])
    x, ids, rw = args["hidden_states"], args["top_k_index"], args["top_k_weights"]

    def weight(p: str, e: int, k: int) -> torch.Tensor:
        s = args[f"{p}_weight_scale"][e]
        s = s.to(torch.bfloat16).float() if spec.weight.scale.granularity is Granularity.GROUP and \
            spec.weight.scale.group_size < k else s.float()
        return quant_math.dequantize_weight(args[f"{p}_weight"][e], s, spec.weight, k=k)

    h = x.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if not 0 <= e < args["w13_weight"].shape[0]:
                continue
            r = rw[t, j].float()
            xe = (x[t].float() * r).to(x.dtype).float() if on_input else x[t].float()
            hid = asym_int8(xe[None]) @ weight("w13", e, h).T
            if args["w13_bias"] is not None:
                hid = hid + args["w13_bias"][e].float()
            a = gated_activation(hid, args["activation"]).to(x.dtype).float()
            y = asym_int8(a) @ weight("w2", e, a.shape[-1]).T
            if args["w2_bias"] is not None:
                y = y + args["w2_bias"][e].float()
            out[t] += y[0] if on_input else r * y[0]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


CASES = [("int4_g32", False, "silu", False, False, torch.float32), ("int4_g32", True, "silu", True, False,
                                                                      torch.bfloat16),
         ("int4_g128", False, "swigluoai:1.702:7.0", True, True, torch.float32),
         ("int4_channel", True, "gelu_tanh", False, True, torch.bfloat16)]


@pytest.mark.parametrize("fmt,unpacked,activation,bias,on_input,dtype", CASES)
def test_kernel_matches_its_emulation_and_the_reference(fmt, unpacked, activation, bias, on_input, dtype):
    args = moe(fmt, unpacked, t=6, k=2, e=4, h=256, i=128, activation=activation, bias=bias, dtype=dtype)
    got = call(args, "kleidiai", on_input)
    assert got.dtype == dtype and got.shape == args["hidden_states"].shape
    emu = emulated(args, on_input)
    assert rel(got, emu) < (1e-5 if dtype == torch.float32 else 4e-3), rel(got, emu)  # bf16: one output rounding
    ref = call(args, "reference", on_input)
    assert 1e-4 < rel(got, ref) < 0.06, rel(got, ref)  # symmetric against asymmetric int8 rows


def test_reference_backend_is_experts_ref():
    args = moe("int4_g32", t=3, h=128, i=64)
    ref = torch.ops.qcompile.experts_ref(
        args["hidden_states"], args["top_k_index"], args["top_k_weights"], args["w13_weight"],
        args["w13_weight_scale"], None, None, None, None, None, args["w2_weight"], args["w2_weight_scale"], None, None,
        None, None, None, None, None, "silu", args["scheme"])
    assert torch.equal(call(args, "reference"), ref)


def test_packed_once_per_weight():
    args = moe("int4_g32", t=3, h=128, i=64)
    call(args, "kleidiai")
    w = args["w13_weight"]
    first = moe_cpu4.packed(w, args["w13_weight_scale"], None, moe_cpu4.parse_scheme_key(args["scheme"]), 128)
    assert moe_cpu4.packed(w, args["w13_weight_scale"], None, moe_cpu4.parse_scheme_key(args["scheme"]), 128) is first
    w.add_(0)  # an in-place change: packed again
    assert moe_cpu4.packed(w, args["w13_weight_scale"], None, moe_cpu4.parse_scheme_key(args["scheme"]), 128) \
        is not first
    key = id(w)
    del w, args
    assert key not in moe_cpu4._PACKED  # dropped with the weight


@pytest.mark.parametrize("backend", ["reference", "kleidiai"])
def test_opcheck(backend):
    from tests.opcheck_util import opcheck

    args = moe("int4_g32", t=3, h=128, i=64)
    opcheck(torch.ops.qcompile.dyn4bit_moe.default,
            (*(args[n] for n in ARGS), "silu", args["scheme"], False, backend))


def test_gradient_is_straight_through():
    args = moe("int4_g32", t=3, h=128, i=64, dtype=torch.float32)
    x = args["hidden_states"].clone().requires_grad_()
    w = args["top_k_weights"].clone().requires_grad_()
    args.update(hidden_states=x, top_k_weights=w)
    call(args, "kleidiai").square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    call(args, "reference").square().sum().backward()
    assert rel(gx, x.grad) < 0.1 and rel(gw, w.grad) < 0.1  # the same backward on (slightly) different outputs


@pytest.mark.parametrize("change,msg", [
    (dict(backend="cuda"), "unknown dyn4bit_moe backend"),
    (dict(scheme=QuantScheme(FORMATS["int4_g32"]).key), "int8 activations quantized per token"),
    (dict(scheme=QuantScheme(FORMATS["int4_g128_zp"], INT8_TOKEN).key), "symmetric int4"),
    (dict(w2_weight_scale=None), "down projection w2: expected int8 or int32 weights"),
])
def test_rejects_bad_inputs(change, msg):
    args = moe("int4_g32", t=3, h=128, i=64)
    backend = change.pop("backend", "kleidiai")
    args.update(change)
    with pytest.raises(qcompile.UnsupportedError, match=msg):
        call(args, backend)


def test_group_the_packing_does_not_take():
    args = moe("int4_g32", t=3, h=128, i=64)
    spec = dataclasses.replace(FORMATS["int4_g32"], scale=ScaleSpec(Granularity.GROUP, group_size=16))
    args["scheme"] = QuantScheme(spec, INT8_TOKEN).key
    args["w13_weight_scale"] = args["w13_weight_scale"].repeat_interleave(2, -1)
    args["w2_weight_scale"] = args["w2_weight_scale"].repeat_interleave(2, -1)
    with pytest.raises(qcompile.UnsupportedError, match="groups of a multiple of 32 dividing K"):
        call(args, "kleidiai")
    assert call(args, "reference").isfinite().all()


def query(fmt="int4_g32", device="cpu", k=2048, n=1536, activation="silu", scheme=None) -> KernelQuery:
    return KernelQuery(scheme or w4a8(fmt), device, None, n, k, torch.bfloat16, kind="experts", num_experts=8,
                       top_k=2, activation=activation)


def test_selected_only_where_kleidiai_runs(monkeypatch):
    """Picked on a CPU with KleidiAI (mocked here); elsewhere the reference, with the reason in the explain row;
    never for other schemes (they are not W4A8-int: left out of the table)."""
    monkeypatch.setattr(moe_cpu4, "available", lambda: False)
    sel = select(query())
    assert sel.kernel.name == "reference" and "no KleidiAI kernels" in dict(sel.rejected)["dyn4bit_moe"]
    monkeypatch.setattr(moe_cpu4, "available", lambda: True)
    assert select(query()).kernel.name == "dyn4bit_moe"
    assert select(query("int4_channel", k=2880, n=5760)).kernel.name == "dyn4bit_moe"
    assert select(query(device="cuda")).kernel.name != "dyn4bit_moe"
    assert "dyn4bit_moe" not in dict(select(query(scheme=QuantScheme(FORMATS["int4_g32"]))).rejected)
    g16 = QuantScheme(dataclasses.replace(FORMATS["int4_g32"], scale=ScaleSpec(Granularity.GROUP, group_size=16)),
                      INT8_TOKEN)
    assert "multiple of 32" in dict(select(query(scheme=g16)).rejected)["dyn4bit_moe"]


@functools.lru_cache(maxsize=None)
def _w4a8_model(path: str):
    return qcompile.load(path)


def test_producer_checkpoint_compiles_to_dyn4bit(testdata, monkeypatch):
    """llm-compressor's W4A8-int MoE checkpoint (int8 codes, groups of 32): compiled on a CPU with KleidiAI
    (mocked; the fallback computes), each MoE layer runs dyn4bit_moe, and the logits stay within the activation
    quantizations' difference of the eager model (experts_ref, symmetric int8 rows)."""
    path = testdata / "llmcompressor-w4a8-moe"
    if not path.is_dir():
        pytest.skip("llmcompressor-w4a8-moe is not among the test checkpoints")
    monkeypatch.setattr(moe_cpu4, "available", lambda: True)
    model = _w4a8_model(str(path))
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 300, 11]])
    be = qcompile.backend(inner="aot_eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs weight-only")  # it quantizes activations itself
        eager = model(ids).logits.float()
        torch._dynamo.reset()
        got = torch.compile(model, backend=be)(ids).logits.float()
    experts = {(r.op, r.kernel, r.reason) for r in be.rows if r.op != "qcompile::linear_ref"}
    assert experts == {("qcompile::dyn4bit_moe", "dyn4bit_moe", "")}, be.explain()
    assert 1e-4 < rel(got, eager) < 0.05, rel(got, eager)
