"""qcompile::wo_moe: the op contract against experts_ref, its gradient, input checks, kernel selection
(capability mocked), the Triton pipeline under the interpreter (subprocess), sm_90 compiles, GPU checks.

Expert weights are fresh random matrices quantized per expert by test_wo_gemm's round-to-nearest
quantizers and stacked as QuantExperts holds them. The oracle is experts_ref's fp32 math
(:func:`reference_experts`) on the weight-only scheme.

Tolerance of the Triton pipeline under the interpreter (``compare``), per output ``|out - ref| <= u
(|ref| + rms(ref))`` and normwise: bf16 u = 2^-5, 2e-2; fp16 u = 2^-9, 1e-3. The interpreter truncates
fp32 -> bf16 / fp16 (weights scaled before the dot, the activation, the output), a bias of the same sign
for every product: int4 groups below 128 (scaled before the dot) measured 1.3e-2 normwise in bf16
(per output 0.66 u), every other bf16 case about 3.5e-3, fp16 2e-4. The error: each weight scaled before
the dot rounded to x.dtype, each element of the activation rounded where the reference rounds a slightly
different h, one rounding of the output, two GEMMs in a row. A wrong expert, scale, zero point, bias or
weight errs by O(1) on its token's row.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
from expecttest import assert_expected_inline

import qcompile
from qcompile.errors import UnsupportedError
from qcompile.kernels import moe_wo as mw
from qcompile.kernels import registry
from qcompile.kernels.experts_ref import reference_experts
from qcompile.kernels.registry import KernelQuery
from qcompile.kernels.wo_mma import mma_reason
from qcompile.kernels import quant_math, wo_policy
from qcompile.scheme import (MXFP4_WEIGHT, MXFP8_WEIGHT, NVFP4_ACT, NVFP4_WEIGHT, Granularity, Packing, QDtype,
                             QuantScheme, ScaleDtype, canonical_shape, fp8_scheme, mx_act)
from tests.kernels.test_wo_gemm import SPECS, _int, rtn_quantize
from tests.gpu_util import graph_replay
from tests.opcheck_util import opcheck
from tests.interpreter_util import run_interpreted


FORMATS = {  # every weight-only format a MoE producer writes, and the variants the kernel decodes
    "int4_g128": SPECS["int4_g128"],  # compressed-tensors W4A16 (llm-compressor GPTQ)
    "int4_g32": SPECS["int4_g32"],
    "int4_channel": SPECS["int4_channel"],
    "int4_g128_zp": SPECS["int4_g128_zp"],  # asymmetric
    "int4_channel_zp": _int(QDtype.INT4, Granularity.CHANNEL, zero_point=True),
    "int4_g32_actorder": SPECS["int4_g32_actorder"],  # a g_idx per expert
    "int8_g128": _int(QDtype.INT8, Granularity.GROUP, 128),  # W8A16 (pack-quantized int32)
    "int8_channel": _int(QDtype.INT8, Granularity.CHANNEL, packing=Packing.NONE),
    "int8_tensor_zp": SPECS["int8_tensor_zp"],
    "nvfp4": NVFP4_WEIGHT,  # NVFP4A16, ModelOpt NVFP4 / W4A16_NVFP4, NVFP4 W4A4 run weight-only
    "mxfp4": MXFP4_WEIGHT,  # Quark w_mxfp4
    "mxfp8": MXFP8_WEIGHT,  # ModelOpt MXFP8
}
W_ROLES = ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx")
TENSORS = ("hidden_states", "top_k_index", "top_k_weights", *(f"w13_{r}" for r in W_ROLES),
           *(f"w2_{r}" for r in W_ROLES), "w13_bias", "w2_bias")


def _stacked(spec, e: int, n: int, k: int, g: torch.Generator, seed: int) -> dict:
    """One projection's tensors for E experts, each RTN-quantized from its own random [n, k] weight."""
    per = []
    for j in range(e):
        w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g)) / k**0.5
        w[:, :: max(1, k // 5)] *= 4  # a few large columns: groups differ
        per.append(rtn_quantize(spec, w, seed * 101 + j))
    return {r: None if per[0][r] is None else torch.stack([p[r] for p in per]) for r in W_ROLES}


def make_moe(fmt: str, t=3, k=2, e=4, h=128, i=128, activation="silu", dtype=torch.bfloat16, bias=False, seed=0,
             foreign=False, scheme=None) -> dict:
    """The op's arguments by name (``scheme``: another key for the same weights, e.g. W4A4)."""
    g = torch.Generator().manual_seed(seed)
    spec = FORMATS[fmt]
    n1 = i if activation.endswith("_no_mul") else 2 * i
    args = {f"w13_{r}": v for r, v in _stacked(spec, e, n1, h, g, seed).items()}
    args.update({f"w2_{r}": v for r, v in _stacked(spec, e, h, i, g, seed + 1).items()})
    ids = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    if foreign:  # pairs of another rank's experts: contribute nothing
        ids[0, -1] = -1
        ids[-1, 0] = e
    args.update(hidden_states=(torch.randn(t, h, generator=g) * (1 + torch.rand(t, 1, generator=g))).to(dtype),
                top_k_index=ids, top_k_weights=torch.rand(t, k, generator=g),
                w13_bias=(torch.randn(e, n1, generator=g) * 0.5).to(dtype) if bias else None,
                w2_bias=(torch.randn(e, h, generator=g) * 0.5).to(dtype) if bias else None,
                activation=activation, scheme=scheme or QuantScheme(spec).key)
    return args


def checkpoint_moe(path: Path, t: int = 6, seed: int = 0) -> dict:
    """The op's arguments for the first experts layer of a producer checkpoint as QuantExperts holds it, and
    ``t`` random bf16 tokens routed top-2."""
    from qcompile.experts import QuantExperts

    experts = next(m for m in qcompile.load(str(path)).modules() if isinstance(m, QuantExperts))
    g = torch.Generator().manual_seed(seed)
    args = {f"{p}_{r}": getattr(experts, f"{p}_{r}", None) for p in ("w13", "w2") for r in W_ROLES}
    args.update(hidden_states=torch.randn(t, experts.hidden_dim, generator=g).bfloat16(),
                top_k_index=torch.rand(t, experts.num_experts, generator=g).argsort(1)[:, :2],
                top_k_weights=torch.rand(t, 2, generator=g), w13_bias=None, w2_bias=None,
                activation=experts.activation, scheme=experts.scheme_key)
    return args


def op_call(args: dict, backend: str, on_input: bool = False) -> list:
    return [args[n] for n in TENSORS] + [args["activation"], args["scheme"], on_input, backend]


def reference(args: dict, on_input: bool = False) -> torch.Tensor:
    """experts_ref's fp32 math on the weight-only scheme."""
    key = QuantScheme(mw.parse_scheme_key(args["scheme"]).weight).key
    w = [tuple(args[f"{p}_{r}"] for r in W_ROLES) + (None, None) for p in ("w13", "w2")]
    return reference_experts(args["hidden_states"], args["top_k_index"], args["top_k_weights"], *w, args["w13_bias"],
                             args["w2_bias"], args["activation"], key, on_input)


UNIT = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-9}  # the interpreter's per-output bound (module doc)
NORMWISE = {torch.bfloat16: 2e-2, torch.float16: 1e-3}


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Worst |out - ref| / (UNIT (|ref| + rms(ref))) and the normwise relative error over NORMWISE: both
    at most 1 within the bound."""
    ref, err = ref.double(), (out.double() - ref.double()).abs()
    rms = ref.pow(2).mean().sqrt()
    return {"worst": float((err / (UNIT[out.dtype] * (ref.abs() + rms))).max()),
            "rel": float(err.norm() / ref.norm()) / NORMWISE[out.dtype]}


# -- the op contract (CPU, reference backend) ---------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4_g32_actorder", "nvfp4", "mxfp8", "int8_tensor_zp"])
def test_reference_backend_is_experts_ref(fmt):
    """The reference backend is experts_ref's math with the scheme's activation quantization dropped (as a
    weight-only kernel computes it): bit for bit, with leading dims kept; and for NVFP4 W4A4 the same as
    NVFP4A16."""
    args = make_moe(fmt, t=6, bias=True, seed=1)
    x = args["hidden_states"]
    for on_input in (False, True):
        out = torch.ops.qcompile.wo_moe(*op_call(args, "reference", on_input))
        assert out.dtype == x.dtype and torch.equal(out, reference(args, on_input).to(x.dtype))
    lead = dict(args, hidden_states=x.reshape(2, 3, -1), top_k_index=args["top_k_index"].reshape(2, 3, -1),
                top_k_weights=args["top_k_weights"].reshape(2, 3, -1))
    assert torch.equal(torch.ops.qcompile.wo_moe(*op_call(lead, "reference")).reshape(6, -1),
                       torch.ops.qcompile.wo_moe(*op_call(args, "reference")))
    if fmt == "nvfp4":
        w4a4 = dict(args, scheme=QuantScheme(NVFP4_WEIGHT, NVFP4_ACT).key)
        assert torch.equal(torch.ops.qcompile.wo_moe(*op_call(w4a4, "reference")),
                           torch.ops.qcompile.wo_moe(*op_call(args, "reference")))


@pytest.mark.parametrize("fmt,activation", [("int4_g128_zp", "silu"), ("nvfp4", "swigluoai:1.702:7.0"),
                                            ("mxfp8", "gelu_tanh"), ("int4_g32_actorder", "relu2_no_mul")])
def test_opcheck(fmt, activation):
    args = make_moe(fmt, t=3, bias=True, activation=activation)
    args["hidden_states"].requires_grad_()
    args["top_k_weights"].requires_grad_()
    opcheck(torch.ops.qcompile.wo_moe.default, op_call(args, "reference"))
    opcheck(torch.ops.qcompile.wo_moe.default, op_call(args, "reference", on_input=True))


@pytest.mark.parametrize("activation", ["silu", "swigluoai:1.702:7.0", "gelu_no_mul"])
@pytest.mark.parametrize("on_input", [False, True])
def test_gradient_is_experts_refs(activation, on_input):
    """x and the routing weights get experts_ref's straight-through gradient of the weight-only scheme."""
    args = make_moe("int4_g32", t=5, bias=True, activation=activation, dtype=torch.float32, seed=2)
    x, r = args["hidden_states"].requires_grad_(), args["top_k_weights"].requires_grad_()
    grad = torch.randn(5, 128)
    got = torch.autograd.grad(torch.ops.qcompile.wo_moe(*op_call(args, "reference", on_input)), (x, r), grad)
    w = [args[n] for n in TENSORS[3:13]]
    want = torch.ops.qcompile.experts_ref(x, args["top_k_index"], r, *w[:5], None, None, *w[5:], None, None,
                                          args["w13_bias"], args["w2_bias"], activation, args["scheme"],
                                          apply_router_weight_on_input=on_input)
    for a, b in zip(got, torch.autograd.grad(want, (x, r), grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change,msg", [
    (dict(activation="relu"), "unknown experts activation 'relu'"),
    (dict(activation="silu_no_mul"), r"w2_weight must be torch.int32 \[4, 128, 32\] for K=256, got .* \[4, 128, 16\]"),
    (dict(w2_weight_scale=torch.ones(4, 128, 3)), r"w2_weight_scale must be torch.float32 \[4, 128, 1\]"),
    (dict(w13_weight_global_scale=torch.ones(4)), "has no w13_weight_global_scale"),
    (dict(w13_bias=torch.zeros(4, 128)), r"w13_bias must be a float \[4, 256\] bias"),
    (dict(top_k_weights=torch.zeros(3, 3)), r"top_k_weights must be float \[3, 2\]"),
    (dict(top_k_index=torch.zeros(3, 2)), "top_k_index must be int32/int64"),
    (dict(hidden_states=torch.zeros(3, 64, dtype=torch.bfloat16)),
     r"w13_weight must be torch.int32 \[4, 256, 8\] for K=64"),
    (dict(scheme=fp8_scheme("channel", "dynamic_token").key), "fp8 weights need e8m0 scales per 32"),
])
def test_rejects_bad_inputs(change, msg):
    args = make_moe("int4_g128", t=3)
    args.update(change)
    with pytest.raises(UnsupportedError, match=msg):
        torch.ops.qcompile.wo_moe(*op_call(args, "reference"))


def test_triton_backend_refusals():
    args = make_moe("int4_g128", t=3)
    with pytest.raises(UnsupportedError, match="unknown wo_moe backend 'cutlass'"):
        torch.ops.qcompile.wo_moe(*op_call(args, "cutlass"))
    if not mw.use_triton(args["hidden_states"]):
        with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
            torch.ops.qcompile.wo_moe(*op_call(args, "triton"))
    assert mw.check(_query("int4_g128", (9, 0), n=2 * 192, k=256)) == \
        "down projection w2: K=192 not a multiple of the group size 128"
    for fmt in ("mxfp4", "nvfp4", "mxfp8"):  # gpt-oss-20b's experts: H = I = 2880 = 22.5 x 128
        assert mw.check(_query(fmt, (9, 0), n=2 * 2880, k=2880)) is None, fmt


# -- kernel selection, capability mocked ------------------------------------------------------------

def _query(fmt, capability, n=2 * 768, k=2048, act_dtype=torch.bfloat16, activation="silu", scheme=None):
    return KernelQuery(scheme or QuantScheme(FORMATS[fmt]), "cpu" if capability is None else "cuda", capability, n, k,
                       act_dtype, kind="experts", num_experts=128, top_k=8, activation=activation)


def test_selection_by_capability(monkeypatch):
    """Every weight-only format (and the W4A4 / MX-activation schemes, weight-only) runs wo_moe on CUDA
    sm_80+; FP8 / INT8 W8A8 keep moe_triton; elsewhere the reference, with the reason."""
    monkeypatch.setitem(registry._AVAILABLE, "triton", True)
    for fmt in FORMATS:
        for cap in ((9, 0), (8, 0), (10, 0)):
            assert registry.select(_query(fmt, cap)).kernel.name == "wo_moe", (fmt, cap)
        sel = registry.select(_query(fmt, (7, 5)))
        assert sel.kernel.name == "reference" and dict(sel.rejected)["wo_moe"] == \
            "needs compute capability >= 8.0, have 7.5"
        sel = registry.select(_query(fmt, None))
        assert dict(sel.rejected)["wo_moe"] == "needs a CUDA device, have cpu"
    for scheme in (QuantScheme(NVFP4_WEIGHT, NVFP4_ACT), QuantScheme(MXFP4_WEIGHT, mx_act(QDtype.FP4_E2M1)),
                   QuantScheme(MXFP8_WEIGHT, mx_act(QDtype.FP8_E4M3))):
        assert registry.select(_query("", (9, 0), scheme=scheme)).kernel.name == "wo_moe"
    fp8 = fp8_scheme("channel", "dynamic_token")
    assert registry.select(_query("", (9, 0), scheme=fp8)).kernel.name == "moe_triton"
    sel = registry.select(_query("int4_g128", (9, 0), act_dtype=torch.float32))
    assert dict(sel.rejected)["wo_moe"] == "needs bf16/fp16 activations, have torch.float32"
    sel = registry.select(_query("int4_g128", (9, 0), k=2000))
    assert dict(sel.rejected)["wo_moe"] == "gate/up projection w13: K=2000 not a multiple of the group size 128"
    sel = registry.select(_query("int4_g128", (9, 0), activation="swiglu"))
    assert dict(sel.rejected)["wo_moe"].startswith("activation 'swiglu' is not one of")
    assert registry.select(_query("int4_g128", (9, 0), n=768, activation="relu2_no_mul")).kernel.name == "wo_moe"
    monkeypatch.setitem(registry._AVAILABLE, "triton", False)
    assert dict(registry.select(_query("int4_g128", (9, 0))).rejected)["wo_moe"] == "triton is not installed"


def _compile_experts(path: Path, monkeypatch):
    """Compile the first QuantExperts of a producer checkpoint with the Experts pass told the device is an
    sm_90 GPU: (graph before, graph after, backend, warnings). The run itself stops at the kernel (CPU
    tensors), which says so."""
    from qcompile.experts import QuantExperts
    from qcompile.passes import experts as pass_module

    query = pass_module.experts_query
    monkeypatch.setattr(pass_module, "experts_query",
                        lambda args: dataclasses.replace(query(args), device="cuda", capability=(9, 0)))
    experts = next(m for m in qcompile.load(str(path)).modules() if isinstance(m, QuantExperts))
    graphs = []
    torch._dynamo.reset()
    be = qcompile.backend(inner="eager", on_graph=lambda before, after: graphs.append((before, after)))
    x = torch.randn(3, experts.hidden_dim).bfloat16()
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.rand(3, 2)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(UnsupportedError, match="needs CUDA tensors"):
        warnings.simplefilter("always")
        torch.compile(experts, backend=be, dynamic=False)(x, ids, w)
    return graphs[0][0], graphs[0][1], be, [str(c.message) for c in caught]


def _op_lines(code: str) -> str:
    """The qcompile op call of a graph, arguments shortened: `op(name=value, ...)`."""
    line = next(ln.strip().split(";  ")[0] for ln in code.splitlines() if "torch.ops.qcompile" in ln)
    return re.sub(r"\bl_(self_parameters_)?", "", line)


def test_compiled_weight_only_moe_selects_wo_moe(testdata, monkeypatch):
    """A compressed-tensors W4A16 MoE layer compiled for an sm_90 GPU: experts_ref becomes wo_moe, its
    arguments by name, backend "triton"."""
    before, after, be, _ = _compile_experts(testdata / "llmcompressor-w4a16-gptq-moe", monkeypatch)
    assert_expected_inline(_op_lines(before), """\
experts_ref = torch.ops.qcompile.experts_ref(hidden_states_, top_k_index_, top_k_weights_, w13_weight_, w13_weight_scale_, None, None, None, None, None, w2_weight_, w2_weight_scale_, None, None, None, None, None, None, None, 'silu', 'w=int4/group128/pack=int32;a=none')""")  # noqa: E501
    assert_expected_inline(_op_lines(after), """\
wo_moe_default = torch.ops.qcompile.wo_moe.default(hidden_states = hidden_states_, top_k_index = top_k_index_, top_k_weights = top_k_weights_, w13_weight = w13_weight_, w13_weight_scale = w13_weight_scale_, w13_weight_global_scale = None, w13_weight_zero_point = None, w13_weight_g_idx = None, w2_weight = w2_weight_, w2_weight_scale = w2_weight_scale_, w2_weight_global_scale = None, w2_weight_zero_point = None, w2_weight_g_idx = None, w13_bias = None, w2_bias = None, activation = 'silu', scheme = 'w=int4/group128/pack=int32;a=none', backend = 'triton')""")  # noqa: E501
    assert [(r.op, r.kernel, r.reason) for r in be.rows] == [("qcompile::wo_moe", "wo_moe", "")]


def test_compiled_act_order_moe_selects_wo_moe(testdata, monkeypatch):
    """llm-compressor's GPTQ act-order experts compiled for an sm_90 GPU: wo_moe, each projection's g_idx [E, K]
    passed by name."""
    _, after, be, _ = _compile_experts(testdata / "llmcompressor-w4a16-actorder-moe", monkeypatch)
    call = _op_lines(after)
    assert "w13_weight_g_idx = w13_weight_g_idx_" in call and "w2_weight_g_idx = w2_weight_g_idx_" in call, call
    assert "scheme = 'w=int4/group32/pack=int32/actorder;a=none'" in call, call
    assert [(r.op, r.kernel, r.reason) for r in be.rows] == [("qcompile::wo_moe", "wo_moe", "")]


def test_compiled_w4a4_moe_runs_weight_only_and_says_so(testdata, monkeypatch):
    """ModelOpt NVFP4 (W4A4) experts on sm_90: wo_moe, weight-only; the explain row and a warning say so."""
    from qcompile.passes import linear

    monkeypatch.setattr(linear, "_WARNED", set())
    _, after, be, caught = _compile_experts(testdata / "modelopt-nvfp4-moe", monkeypatch)
    assert "torch.ops.qcompile.wo_moe.default(" in after
    assert [(r.kernel, r.reason) for r in be.rows] == [("wo_moe", "activations not quantized (weight-only kernel)")]
    assert any("runs weight-only on sm_90 (wo_moe)" in c for c in caught), caught


# -- measured launch choices (wo_tune's tables) -------------------------------------------------------

GPU_NAME = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def on_gpu_tables(tmp_path, monkeypatch):
    """plan() as on a GPU named GPU_NAME, with an empty on-disk cache and shipped table folder."""
    from qcompile.kernels import wo_tune

    monkeypatch.setenv("QCOMPILE_TUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(wo_tune, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setattr(wo_tune, "on_gpu", lambda x: True)
    monkeypatch.setattr(wo_tune, "gpu_name", lambda x: GPU_NAME)
    wo_tune.clear()
    yield wo_tune
    wo_tune.clear()


def _plan_args(fmt="int4_g128", t=3):
    a = make_moe(fmt, t=t)
    spec = mw.parse_scheme_key(a["scheme"])
    w13, w2 = (tuple(a[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
    return (a["hidden_states"], a["top_k_index"], a["top_k_weights"], w13, w2, None, None, "silu", spec, False, 128)


def test_plan_reads_measured_choices(on_gpu_tables):
    """A table entry decides the call's launch: the grouped kernel with its two configurations, wo_mma's
    grouped build with its block size, the dequantize path, or the rule (policy, an unreadable entry, no
    entry, tuning off; on the CPU the rule never takes wo_mma)."""
    wo_tune = on_gpu_tables
    args = _plan_args()
    key = mw._key(args[0], args[1], args[3], args[8], 128)
    assert key.endswith("|bfloat16|moe E4 k2 256x128 128x128|t4"), key
    cfg = _cfg(32, 64, 16, 2)
    rule = (None, mw.DEQUANT_ROWS, None)
    mma = {"block_m": 16, "gemm2": {"warps": 4, "split": 8}}
    for entry, want in (({"route": "triton", "launch": {"gemm1": cfg, "gemm2": cfg}}, ((cfg, cfg), mw.NO_DEQUANT, None)),
                        ({"route": "mma", "launch": mma}, (None, mw.NO_DEQUANT, mma)),
                        ({"route": "mma", "launch": {"block_m": 12}}, rule),
                        ({"route": "mma", "launch": {"block_m": 8, "gemm1": {"split": 5}}}, rule),
                        ({"route": "dequant"}, (None, 0, None)), ({"route": "policy"}, rule),
                        ({"route": "triton", "launch": {"gemm1": {"BLOCK_M": 16}}}, rule),
                        ({"route": "triton", "launch": {"gemm1": cfg, "gemm2": _cfg(16, 64, 16, 2)}}, rule)):
        wo_tune.write_table(wo_tune.SHIPPED / wo_tune.file_name(GPU_NAME), GPU_NAME, {key: entry})
        wo_tune.clear()
        assert mw.plan(*args) == want, entry
    assert mw.plan(*_plan_args(t=9)) == rule  # another T bucket: no entry, tuning off


def test_tune_call_descends_and_stores(on_gpu_tables, monkeypatch):
    """The coordinate descent starts at the rule's configurations, keeps the fastest candidate of each
    axis (here: a made-up cost that prefers BLOCK_M 32, GEMM 1 split 4 and GEMM 2 BLOCK_N 32), and stores
    the winner under the call's T bucket; plan() then runs it without measuring."""
    wo_tune = on_gpu_tables
    timed = []

    def cost(c):
        if c.route != "triton":
            return 50.0
        g1, g2 = c.launch["gemm1"], c.launch["gemm2"]
        return (10.0 + (g1["BLOCK_M"] != 32) + (g1["SPLIT_K"] != 4) + (g2["BLOCK_N"] != 32)
                + 0.01 * g1["num_stages"])

    def fake_measure(choices, run, reps=20, check=None):  # (graph-timed: one run per routing of the call's pairs)
        assert isinstance(run, list) and 2 <= len(run) <= wo_tune.MAX_COPIES and callable(check)
        timed.extend(choices)
        return {c: cost(c) for c in choices}

    monkeypatch.setattr(wo_tune, "measure", fake_measure)
    monkeypatch.setattr(wo_tune, "can_measure", lambda x: True)
    wo_tune.tune(True)
    try:
        args = _plan_args()
        (g1, g2), rows, mma = mw.plan(*args)
    finally:
        wo_tune.tune(False)
    assert rows == mw.NO_DEQUANT and mma is None and g1["BLOCK_M"] == g2["BLOCK_M"] == 32
    assert g1["SPLIT_K"] == 4 and g2["BLOCK_N"] == 32 and g1["num_stages"] == 2
    assert len(timed) == len(set(timed)) > 20  # every candidate timed once
    n = len(timed)
    assert mw.plan(*args) == ((g1, g2), mw.NO_DEQUANT, None) and len(timed) == n  # from the cache now
    stored = json.loads((wo_tune.cache_dir() / wo_tune.file_name(GPU_NAME)).read_text())["entries"]
    assert list(stored) == [mw._key(args[0], args[1], args[3], args[8], 128)]


def test_relabeled_routings_keep_each_experts_pairs():
    """Tuning's routings of a call: the call's ids first, then the same pairs with the experts renamed by a seeded
    permutation each (every expert's pairs together, as many per expert), ids outside [0, E) left alone."""
    ids = torch.tensor([[3, 1], [3, 9], [-1, 0]], dtype=torch.int64)
    out = mw.relabeled(ids, 8, 5)
    assert len(out) == 5 and out[0] is ids
    assert torch.equal(out[1], mw.relabeled(ids, 8, 2)[1])  # seeded
    assert any(not torch.equal(o, ids) for o in out[1:])
    for o in out[1:]:
        assert o.dtype == ids.dtype and o[1, 1] == 9 and o[2, 0] == -1
        inside = (ids >= 0) & (ids < 8)
        assert o[0, 0] == o[1, 0] and len({o[0, 0].item(), o[0, 1].item(), o[2, 1].item()}) == 3
        assert ((o >= 0) & (o < 8)).eq(inside).all()


def test_mma_rule_by_rows_per_active_expert(monkeypatch):
    """The grouped wo_mma build in 8-slot blocks up to 8 rows per active expert, 16-slot blocks up to 16, the
    Triton kernel above; never off CUDA or with QCOMPILE_MOE_MMA=0."""
    cuda = types.SimpleNamespace(is_cuda=True)
    assert [mw.mma_rule(cuda, pairs, 8) for pairs in (2, 64, 65, 128, 129)] == \
        [{"block_m": 8}, {"block_m": 8}, {"block_m": 16}, {"block_m": 16}, None]
    assert mw.mma_rule(cuda, 8 * 256, 128) == {"block_m": 16} and mw.mma_rule(cuda, 8 * 257, 128) is None
    assert mw.mma_rule(types.SimpleNamespace(is_cuda=False), 2, 8) is None
    monkeypatch.setenv("QCOMPILE_MOE_MMA", "0")
    assert mw.mma_rule(cuda, 2, 8) is None


def test_tune_call_descends_the_grouped_mma_launches(on_gpu_tables, monkeypatch):
    """Where wo_mma's grouped build has a launch, the descent also starts from its rule ({"block_m": 8}) and
    walks block_m, then each GEMM's warps and split, then whether GEMM 1 fuses the activation; the fastest (here a
    made-up cost preferring block_m 16, GEMM 1 split 2 without the activation, GEMM 2 warps 16) is stored and plan()
    returns it as the call's mma launch."""
    wo_tune = on_gpu_tables

    def cost(c):
        if c.route != "mma":
            return 50.0
        g1, g2 = c.launch.get("gemm1", {}), c.launch.get("gemm2", {})
        return 10.0 + (c.launch["block_m"] != 16) + (g1.get("split") != 2) + (g2.get("warps") != 16) + \
            (g1.get("act") is not False)

    monkeypatch.setattr(wo_tune, "measure", lambda choices, run, reps=20, check=None: {c: cost(c) for c in choices})
    monkeypatch.setattr(wo_tune, "can_measure", lambda x: True)
    monkeypatch.setattr(mw, "_mma_launches", lambda *a: ("gemm 1", "gemm 2"))
    wo_tune.tune(True)
    try:
        args = _plan_args()
        configs, rows, mma = mw.plan(*args)
    finally:
        wo_tune.tune(False)
    assert configs is None and rows == mw.NO_DEQUANT
    # (ties keep the current)
    assert mma == {"block_m": 16, "gemm1": {"split": 2, "act": False}, "gemm2": {"warps": 16}}, mma
    assert mw._mma_choice(mma) and not mw._mma_choice({"block_m": 8, "gemm1": {"kw": True}})


def test_gathered_rows_of_the_sorted_blocks():
    """The grouped warp-specialized build's x: row j is the row of the pair in slot j (pair // a_div), zero where the
    slot holds no pair, zero columns up to a padded K; the result's bits are the source rows'."""
    from qcompile.kernels.wo_mma import gathered_rows

    a = torch.randn(5, 24, dtype=torch.bfloat16)
    sorted_ids = torch.tensor([3, 0, 10, 10, 9, 1, 10, 10], dtype=torch.int32)  # pairs = 10: 10 pads a block
    got = gathered_rows(a, 2, sorted_ids, 10, 32)
    assert got.shape == (8, 32) and got.dtype == a.dtype
    for j, p in enumerate(sorted_ids.tolist()):
        want = a[p // 2] if p < 10 else torch.zeros(24, dtype=a.dtype)
        assert torch.equal(got[j, :24], want) and not got[j, 24:].any(), j
    assert torch.equal(gathered_rows(a, 1, torch.tensor([4, 2], dtype=torch.int32), 5, 24), a[[4, 2]])


# -- the Triton kernels under the interpreter (subprocess: TRITON_INTERPRET is read at import) --------

def _cfg(bm, bn, words, split, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=words * 8, SPLIT_K=split, num_warps=4, num_stages=2, **kw)


SPLIT2 = (_cfg(16, 64, 16, 2), _cfg(16, 32, 16, 2, X_PERMUTED=True, SCALE_PREFETCH=False))  # 4-bit words
PREFETCH = (_cfg(16, 32, 16, 1, SCALE_PREFETCH=True),) * 2  # one split: the scales prefetched step after step
TAIL = dict(h=192, i=160)  # K of both GEMMs not a multiple of BLOCK_K (128): a partial last K step
CASES = {}  # name -> (format, make_moe keywords, wo_moe_triton keywords)
for _n, _f in enumerate(FORMATS):
    CASES[f"{_f}-decode-t{1 + _n % 4}"] = (_f, dict(t=1 + _n % 4, seed=_n), {})
    CASES[f"{_f}-t40"] = (_f, dict(t=40, seed=_n, e=4 + 4 * (_n % 2)), {})
CASES.update({
    "int4_g128-foreign": ("int4_g128", dict(t=5, foreign=True), {}),
    "int8_g128-foreign-t40": ("int8_g128", dict(t=40, foreign=True, k=1), {}),
    "mxfp4-swigluoai-bias": ("mxfp4", dict(t=6, activation="swigluoai:1.702:7.0", bias=True), {}),
    "int4_g32_actorder-bias-split": ("int4_g32_actorder", dict(t=5, bias=True), dict(configs=SPLIT2)),
    "int4_g128_zp-gelu-bias-split": ("int4_g128_zp", dict(t=4, bias=True, activation="gelu"), dict(configs=SPLIT2)),
    "nvfp4-non-gated-silu": ("nvfp4", dict(t=4, activation="silu_no_mul", bias=True), {}),
    "int8_channel-relu2": ("int8_channel", dict(t=3, activation="relu2_no_mul"), {}),
    "int4_g128-on-input": ("int4_g128", dict(t=4, on_input=True, foreign=True), {}),
    "mxfp8-on-input-bias": ("mxfp8", dict(t=3, on_input=True, bias=True), {}),
    "int4_channel-fp16": ("int4_channel", dict(t=5, dtype=torch.float16, bias=True), {}),
    "int4_g32_actorder-fp16": ("int4_g32_actorder", dict(t=5, dtype=torch.float16, bias=True), {}),
    "nvfp4-fp16-t40": ("nvfp4", dict(t=40, dtype=torch.float16), {}),
    "nvfp4-w4a4-scheme": ("nvfp4", dict(t=3, scheme=QuantScheme(NVFP4_WEIGHT, NVFP4_ACT).key), {}),
    "nvfp4-dequant-grouped-mm": ("nvfp4", dict(t=6, bias=True, foreign=True), dict(dequant_rows=0)),
    "int4_g32_actorder-dequant-on-input": ("int4_g32_actorder", dict(t=4, on_input=True), dict(dequant_rows=0)),
    "mxfp4-tail": ("mxfp4", dict(t=5, bias=True, **TAIL), {}),
    "mxfp4-tail-swigluoai-split": ("mxfp4", dict(t=3, activation="swigluoai:1.702:7.0", **TAIL), dict(configs=SPLIT2)),
    "nvfp4-tail-split": ("nvfp4", dict(t=4, bias=True, foreign=True, **TAIL), dict(configs=SPLIT2)),
    "mxfp8-tail-split": ("mxfp8", dict(t=4, **TAIL), dict(configs=SPLIT2)),
    "int4_g32_actorder-tail-split": ("int4_g32_actorder", dict(t=3, **TAIL), dict(configs=SPLIT2)),
    "int4_g32-tail-h320-prefetch": ("int4_g32", dict(t=4, h=320, i=160, bias=True), dict(configs=PREFETCH)),
    "mxfp4-tail-h320-prefetch": ("mxfp4", dict(t=4, h=320, i=160), dict(configs=PREFETCH)),
    "nvfp4-tail-dequant-grouped-mm": ("nvfp4", dict(t=6, **TAIL), dict(dequant_rows=0)),
})

PADDED = ("mxfp4", "nvfp4", "int4_g32")  # formats tiled with K padded to whole chunks (interpreter and GPU tests)

INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json, os, time, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import moe_wo as mw, quant_math as qm, wo_gemm as wg
    from tests.kernels.test_moe_wo import (CASES, PADDED, W_ROLES, TENSORS, checkpoint_moe, make_moe, op_call,
                                           reference, compare)
    assert mw.use_triton(torch.empty(1)), "interpreter not active"
    t0, res = time.time(), {"cases": {}}
    for name, (fmt, kw, extra) in CASES.items():
        kw = dict(kw)
        on_input = kw.pop("on_input", False)
        args = make_moe(fmt, **kw)
        spec = mw.parse_scheme_key(args["scheme"])
        w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
        out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2,
                               args["w13_bias"], args["w2_bias"], args["activation"], spec, on_input, **extra)
        res["cases"][name] = dict(compare(out, reference(args, on_input)), finite=bool(out.isfinite().all()))
    # the op's triton backend, leading dims kept
    args = make_moe("int4_g128", t=4, bias=True)
    lead = dict(args, **{n: args[n].view(2, 2, -1) for n in ("hidden_states", "top_k_index", "top_k_weights")})
    out = torch.ops.qcompile.wo_moe(*op_call(lead, "triton"))
    res["op_triton"] = dict(compare(out.view(4, -1), reference(args)), shape=list(out.shape))
    args = make_moe("mxfp4", t=4, h=192, i=160)  # K not a multiple of BLOCK_K: the op's checks let it through
    res["op_triton_tail"] = compare(torch.ops.qcompile.wo_moe(*op_call(args, "triton")), reference(args))
    # experts tiled as a GPU load stores them, K not whole chunks (padded to 256): the Triton GEMMs read x and the
    # activations padded with zeros, the dequantize path the dequantized weights' first K columns
    for fmt in PADDED:
        args = make_moe(fmt, t=4, h=192, i=160, bias=True)
        spec = mw.parse_scheme_key(args["scheme"])
        w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
        scheme, w13, w2 = mw.tile_for_mma(spec, w13, w2, 192, 160, torch.bfloat16)
        for route, extra in (("triton", {}), ("dequant", dict(dequant_rows=0))):
            out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2,
                                   args["w13_bias"], args["w2_bias"], args["activation"], scheme, False, **extra)
            res[f"padded-{fmt}-{route}"] = dict(compare(out, reference(args)), finite=bool(out.isfinite().all()),
                                                k=[w13[0].shape[-1], w2[0].shape[-1]], scheme=scheme.key)
    # the stacked dequantize kernel is quant_math per expert, bit for bit
    for fmt, i in (("int4_g32_actorder", 128), ("nvfp4", 128), ("int8_tensor_zp", 128), ("mxfp8", 128),
                   ("mxfp4", 160), ("nvfp4", 160), ("int4_g32_actorder", 160)):  # 160: a partial last block
        args = make_moe(fmt, e=3, i=i)
        t = [args[f"w2_{r}"] for r in W_ROLES]
        spec = mw.parse_scheme_key(args["scheme"]).weight
        got = wg.dequantize_triton(t[0], t[1], spec, t[2], t[3], t[4], i, torch.float32)
        want = torch.stack([qm.dequantize_weight(*(None if v is None else v[e] for v in t[:2]), spec,
                            *(None if v is None else v[e] for v in t[2:]), k=i) for e in range(3)])
        res[f"dequant-stacked-{fmt}" + ("" if i == 128 else f"-k{i}")] = bool(torch.equal(got, want))
    # a producer's act-order experts (GPTQ, a g_idx per expert and projection), as loaded
    from tests.conftest import TESTDATA
    path = TESTDATA / "llmcompressor-w4a16-actorder-moe"
    if path.is_dir():
        args = checkpoint_moe(path)
        spec = mw.parse_scheme_key(args["scheme"])
        w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
        out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2, None, None,
                               args["activation"], spec, False)
        res["producer-actorder"] = dict(compare(out, reference(args)), act_order=spec.weight.act_order,
                                        finite=bool(out.isfinite().all()))
    res["seconds"] = time.time() - t0
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(INTERPRETER_SCRIPT, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_wo_moe_under_interpreter(interpreter_results, name):
    """The Triton pipeline against experts_ref's math, within ``compare``'s bound (module doc)."""
    got = interpreter_results["cases"][name]
    assert got["finite"] and got["worst"] <= 1 and got["rel"] <= 1, got


def test_op_triton_backend_under_interpreter(interpreter_results):
    got = interpreter_results["op_triton"]
    assert got["shape"] == [2, 2, 128] and got["worst"] <= 1 and got["rel"] <= 1, got
    got = interpreter_results["op_triton_tail"]  # H = 192, I = 160
    assert got["worst"] <= 1 and got["rel"] <= 1, got


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "int4_g32_zp"])
def test_tiling_pads_k_to_whole_chunks(fmt, monkeypatch):
    """gpt-oss's K = 2880 (22.5 chunks of 128) tiled as a GPU load stores it: every tensor in the tiled scheme's
    canonical shape (K = 2944), the pad's words zero, its group scales 1.0 and zero points 0, and the tiled
    experts decode to the checkpoint's values exactly (quant_math.dequantize_weight, the reference's decode)."""
    monkeypatch.setitem(FORMATS, "int4_g32_zp", _int(QDtype.INT4, Granularity.GROUP, 32, zero_point=True))
    spec = FORMATS[fmt]
    h = i = 2880
    args = make_moe(fmt, t=1, e=2, h=h, i=i)
    w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
    scheme, t13, t2 = mw.tile_for_mma(QuantScheme(spec), w13, w2, h, i, torch.bfloat16)
    assert scheme.weight.tiled and scheme.weight.stored_k(2880) == 2944
    for before, after, (n, k) in ((w13, t13, (2 * i, h)), (w2, t2, (h, i))):
        for role, a in zip(W_ROLES, after):
            if a is not None and role != "weight_global_scale":
                assert tuple(a.shape[1:]) == canonical_shape(role, scheme, n, k), (role, a.shape)
        groups = -(-2880 // spec.scale.group_size)
        one = 127 if spec.scale.dtype is ScaleDtype.E8M0 else 1.0
        assert bool((after[1][..., groups:].float() == one).all())
        if after[3] is not None:
            assert bool((after[3][..., groups:] == 0).all())
        untiled = quant_math.untile_weight(after[0].reshape(2 * n, -1), scheme.weight).reshape(after[0].shape)
        cols = canonical_shape("weight", QuantScheme(spec), n, k)[-1]
        assert bool((untiled[..., cols:].view(torch.uint8) == 0).all())
        for e in range(2):
            got = quant_math.dequantize_weight(*(None if v is None else v[e] for v in after[:2]), scheme.weight,
                                               *(None if v is None else v[e] for v in after[2:]), k=k)
            want = quant_math.dequantize_weight(*(None if v is None else v[e] for v in before[:2]), spec,
                                                *(None if v is None else v[e] for v in before[2:]), k=k)
            assert got.shape == (n, k) and torch.equal(got, want)


@pytest.mark.parametrize("route", ["triton", "dequant"])
@pytest.mark.parametrize("fmt", PADDED)
def test_padded_tiled_experts_under_interpreter(interpreter_results, fmt, route):
    """Experts tiled with K (H = 192, I = 160) padded to whole chunks of 128 (moe_wo.tile_for_mma), through the
    Triton GEMMs and the dequantize path: experts_ref's math on the unpadded experts, within ``compare``'s bound."""
    got = interpreter_results[f"padded-{fmt}-{route}"]
    want_k = [256 // 8 if fmt == "int4_g32" else 256 // 2] * 2  # int32 words / e2m1 bytes of K = 256
    assert got["k"] == want_k and got["scheme"].endswith("/tiled;a=none"), got
    assert got["finite"] and got["worst"] <= 1 and got["rel"] <= 1, got


def test_producer_act_order_experts_under_interpreter(interpreter_results):
    """llm-compressor's GPTQ act-order experts (tests/data: llmcompressor-w4a16-actorder-moe) through the Triton
    pipeline against experts_ref's math, within ``compare``'s bound."""
    got = interpreter_results.get("producer-actorder")
    if got is None:
        pytest.skip("llmcompressor-w4a16-actorder-moe is not among the test checkpoints")
    assert got["act_order"] and got["finite"] and got["worst"] <= 1 and got["rel"] <= 1, got


@pytest.mark.parametrize("fmt", ["int4_g32_actorder", "nvfp4", "int8_tensor_zp", "mxfp8", "mxfp4-k160", "nvfp4-k160",
                                 "int4_g32_actorder-k160"])
def test_stacked_dequantize_under_interpreter(interpreter_results, fmt):
    """dequantize_triton of weights stacked over experts equals quant_math per expert, bit for bit (K = 160:
    a partial last block)."""
    assert interpreter_results[f"dequant-stacked-{fmt}"]


# -- sm_90 compiles without a GPU (the PTX decode paths the interpreter cannot take) ------------------

def _ptxas_available() -> bool:
    from tests.kernels.test_wo_gemm import _ptxas_available as available

    return available()


@pytest.mark.skipif(not mw.HAS_TRITON or not _ptxas_available(), reason="triton's NVIDIA backend / ptxas missing")
@pytest.mark.parametrize("fmt,rows,k", [("int4_g128", 1, 2048), ("nvfp4", 2, 2048), ("int4_g32_actorder", 40, 2048),
                                        ("mxfp8", 8, 2048), ("mxfp4", 2, 2880), ("int4_channel_zp", 8, 2880)])
def test_grouped_kernels_compile_for_sm90(fmt, rows, k):
    """The grouped GEMM with the configuration the op picks (PTX decode on: int4 lop3, e2m1) and the
    stacked dequantize kernel compile for sm_90; at K = 2880 (gpt-oss-20b, 22.5 x 128) with the partial
    last K step masked."""
    from qcompile.kernels import wo_gemm as wg
    from qcompile.kernels import wo_gemm_triton as wt
    from tests.kernels.test_wo_gemm import _compile_sm90

    spec = FORMATS[fmt]
    lay = wg.layout_of(spec)
    cfg = wg.fit_config(mw.grouped_config(rows * 128, 128, 1536, k, spec, torch.device("cpu")), k, spec)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("SPLIT_K")
    sk = "*fp32" if lay.scale_kind == wg.SK_FP32 else "*u8"
    gs = "*fp32" if spec.global_scale else None
    g = "*i32" if spec.act_order else None
    zp = "*fp32" if spec.zero_point else None
    ptrs = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr=sk, z_ptr=zp, g_ptr=g, gs_ptr=gs, bias_ptr="*bf16",
                out_ptr="*fp32", ids_ptr="*i32", experts_ptr="*i32", route_ptr="*fp32")
    ints = ("M", "N", "K", "stride_wn", "stride_sn", "k_split_words", "A_DIV", "stride_we", "stride_se", "stride_ge",
            "stride_be")
    common = dict(FMT=lay.fmt, EPW=lay.epw, SCALE_KIND=lay.scale_kind, GROUP=lay.group, HAS_GS=gs is not None,
                  HAS_ZP=zp is not None, ACT_ORDER=g is not None, TILED=False, NATURAL=False, GROUPED=True)
    _compile_sm90(wt._wo_gemm_kernel, ptrs, ints,
                  dict(common, HAS_BIAS=True, PARTIAL=False, PTX_DECODE=True, ROUTE=True,
                       EVEN_K=k % cfg["BLOCK_K"] == 0, **cfg), num_warps=warps, num_stages=stages)
    _compile_sm90(wt._dequant_kernel, dict(w_ptr="*i32", s_ptr=sk, z_ptr=zp, g_ptr=g, gs_ptr=gs, out_ptr="*bf16"),
                  ("N", "K", "stride_wn", "stride_sn", "stride_we", "stride_se", "stride_ge"),
                  dict(common, BLOCK_N=32, BLOCK_K=32 * lay.epw, EVEN_K=k % (32 * lay.epw) == 0))


@pytest.mark.skipif(not mw.HAS_TRITON or not _ptxas_available(), reason="triton's NVIDIA backend / ptxas missing")
@pytest.mark.parametrize("act", ["silu", "gelu", "swigluoai", "relu2_no_mul"])
def test_activation_kernel_compiles_for_sm90(act):
    """The activation kernel between the two GEMMs compiles for sm_90 (gelu's erf from libdevice)."""
    from tests.kernels.test_wo_gemm import _compile_sm90

    name = act.removesuffix("_no_mul")
    _compile_sm90(mw._act_rows_kernel, dict(h_ptr="*fp32", a_ptr="*bf16", alpha="fp32", limit="fp32"),
                  ("N1", "I", "stride_hs"), dict(ACT=mw.ACT_CODES[name], GATED=name == act, SPLIT=2, BLOCK=1024),
                  num_warps=4)


# -- on the GPU ------------------------------------------------------------------------------------

GPU_TOKENS = (1, 4, 16, 64, 256)
GPU_SHAPES = {"e8-h2048-i1408-k2": (8, 2048, 1408, 2), "e32-h1024-i768-k4": (32, 1024, 768, 4),
              "e8-h2880-i2880-k4": (8, 2880, 2880, 4)}  # gpt-oss-20b's experts: K = 22.5 x 128
GPU_FORMATS = ["int4_g128", "int4_g32", "int4_g128_zp", "int4_g32_actorder", "int8_g128", "int8_channel", "nvfp4",
               "mxfp4", "mxfp8"]
# every format at every shape whose K (H and I) it takes: int4 / int8 g128 not at 2880 (22.5 groups)
GPU_CASES = [(fmt, shape) for shape, (_, h, i, _) in GPU_SHAPES.items() for fmt in GPU_FORMATS
             if not any(mw.triton_shape_reason(FORMATS[fmt], 0, kk) for kk in (h, i))]


def gpu_moe(fmt, t, shape, activation="silu", dtype=torch.bfloat16, seed=0, bias=False) -> dict:
    """make_moe's tensors for ``shape`` on the GPU (quantized on the GPU's copy of the weights: fast)."""
    e, h, i, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = FORMATS[fmt]
    n1 = i if activation.endswith("_no_mul") else 2 * i
    args = {}
    for p, (n, kk) in (("w13", (n1, h)), ("w2", (h, i))):
        per = [rtn_quantize(spec, torch.randn(n, kk, device="cuda", generator=g) / kk**0.5, seed + j) for j in range(e)]
        args.update({f"{p}_{r}": None if per[0][r] is None else torch.stack([q[r] for q in per]) for r in W_ROLES})
    ids = torch.rand(t, e, generator=g, device="cuda").argsort(1)[:, :k]
    args.update(hidden_states=torch.randn(t, h, generator=g, device="cuda").to(dtype), top_k_index=ids,
                top_k_weights=torch.rand(t, k, generator=g, device="cuda").softmax(-1),
                w13_bias=torch.randn(e, n1, generator=g, device="cuda").to(dtype) * 0.5 if bias else None,
                w2_bias=torch.randn(e, h, generator=g, device="cuda").to(dtype) * 0.5 if bias else None,
                activation=activation, scheme=QuantScheme(spec).key)
    return args


def check_gpu(out: torch.Tensor, args: dict, tag: str, on_input: bool = False) -> None:
    """Against experts_ref's fp32 math on the same GPU: normwise below 1e-2 and per token below 3e-2 (bf16;
    fp16 5e-3 / 1.5e-2). Expected: bf16 rounding of weights scaled before the dot (2^-9 relative), of the
    activation (an element one ulp off where h differs) and of the output, ~3e-3 normwise; a wrong expert,
    scale or weight errs by O(1) on its token's row."""
    ref = reference(args, on_input).float()
    out = out.float()
    assert out.shape == ref.shape and bool(out.isfinite().all()), tag
    err = out - ref
    rel = float(err.norm() / ref.norm())
    rows = ref.norm(dim=1).clamp(min=1e-3 * float(ref.norm(dim=1).max()))
    row = float((err.norm(dim=1) / rows).max())
    bf16 = args["hidden_states"].dtype == torch.bfloat16
    assert rel < (1e-2 if bf16 else 5e-3) and row < (3e-2 if bf16 else 1.5e-2), (tag, rel, row)


def projections(args: dict, scheme: QuantScheme) -> tuple[tuple, tuple]:
    """(w13, w2): each projection's tensors of ``args`` in :data:`W_ROLES` order, the weights tiled per expert
    where ``scheme``'s weight is, by the load's own transform (moe_wo.tile_for_mma)."""
    w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
    if scheme.weight.tiled:
        x = args["hidden_states"]
        n1 = w13[0].shape[1]
        i = n1 // 2 if mw.is_gated(args["activation"]) else n1
        tiled = mw.tile_for_mma(QuantScheme(dataclasses.replace(scheme.weight, tiled=False), scheme.act), w13, w2,
                                x.shape[-1], i, x.dtype)
        assert tiled is not None and tiled[0].key == scheme.key, scheme.key
        w13, w2 = tiled[1:]
    return w13, w2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,shape", GPU_CASES)
def test_gpu_matches_reference(fmt, shape):
    """Decode to prefill token counts, default launch configurations, against experts_ref on the GPU."""
    for seed, t in enumerate(GPU_TOKENS):
        args = gpu_moe(fmt, t, GPU_SHAPES[shape], seed=seed, bias=seed % 2 == 1)
        check_gpu(torch.ops.qcompile.wo_moe(*op_call(args, "triton")), args, f"T={t}")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_g128", "nvfp4", "mxfp4"])
def test_gpu_activations_routing_and_dequant_path(fmt):
    """swigluoai with biases, a non-gated activation, fp16, router weight on input, foreign expert ids,
    and the dequantize + torch._grouped_mm path (forced, and by T: 256 rows per expert)."""
    shape = GPU_SHAPES["e8-h2048-i1408-k2"]
    for tag, kw, on_input, extra in (("swigluoai", dict(activation="swigluoai:1.702:7.0", bias=True), False, {}),
                                     ("non-gated", dict(activation="silu_no_mul"), False, {}),
                                     ("fp16", dict(dtype=torch.float16, bias=True), False, {}),
                                     ("on-input", {}, True, {}),
                                     ("dequant", dict(bias=True), False, dict(dequant_rows=0))):
        for t in (3, 64):
            args = gpu_moe(fmt, t, shape, **kw)
            args["top_k_index"][0, 0], args["top_k_index"][-1, -1] = -1, 8  # another rank's experts
            w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
            out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2,
                                   args["w13_bias"], args["w2_bias"], args["activation"],
                                   mw.parse_scheme_key(args["scheme"]), on_input, **extra)
            check_gpu(out, args, f"{tag} T={t}", on_input)
    args = gpu_moe(fmt, 1024, shape)
    assert mw.dequantizes(args["hidden_states"], 2048, 8) == (torch.cuda.get_device_capability()[0] in (9, 10))
    check_gpu(torch.ops.qcompile.wo_moe(*op_call(args, "triton")), args, "T=1024")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_g128", "nvfp4", "int4_g32_actorder"])
def test_gpu_cuda_graph_and_determinism(fmt):
    """The op captured in a CUDA graph (a host sync would fail the capture) replays new x and routing
    correctly; two eager runs are bitwise equal (no atomics, fixed summation order)."""
    shape = GPU_SHAPES["e32-h1024-i768-k4"]
    for t in (1, 16, 256, 2048):  # 2048: 256 rows per expert, the dequantize + grouped_mm path
        args, new = gpu_moe(fmt, t, shape, seed=1, bias=True), gpu_moe(fmt, t, shape, seed=2)
        call = op_call(args, "triton")
        first = torch.ops.qcompile.wo_moe(*call)
        assert torch.equal(first, torch.ops.qcompile.wo_moe(*call)), f"T={t}: two runs differ"
        captured, _graph = graph_replay(lambda: torch.ops.qcompile.wo_moe(*call), lambda: [
            args[n].copy_(new[n]) for n in ("hidden_states", "top_k_index", "top_k_weights")])
        assert torch.equal(captured, torch.ops.qcompile.wo_moe(*call)), f"T={t}: replay differs from eager"
        check_gpu(captured, args, f"graph T={t}")


MMA_SYNC_BLOCK_M = [bm for bm in mw.MMA_BLOCK_M if bm <= wo_policy.GROUPED_MMA_MAX_M]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [f for f in GPU_FORMATS if not FORMATS[f].act_order])
def test_gpu_grouped_mma_matches_reference(fmt):
    """wo_mma's grouped mma.sync build in blocks of 8 and 16 pair slots, on checkpoint-order and tiled experts (as a GPU
    load stores them), against experts_ref: decode token counts, more pairs of one expert than a block holds
    (T = 40), biases, fp16 x, swigluoai, the router weight on the input, router weights in x's dtype, int32 ids and
    another rank's expert ids (one token: its pairs' blocks come from the ids themselves, no sort). Both
    projections have a launch at these shapes, gpt-oss's K = 2880 (22.5 chunks of 128) in the checkpoint's order
    for 8-bit weights with groups dividing it, tiled with K padded to 2944 for every format whose groups divide
    it."""
    mx = FORMATS[fmt].scale.dtype.name == "E8M0"
    cases = [(1, {}, False), (5, dict(bias=True), False), (40, dict(activation="swigluoai:1.702:7.0", bias=True),
             False), (7, {}, True)] + ([] if mx else [(16, dict(dtype=torch.float16, bias=True), False)]) + \
        [(1, dict(bias=True), False)]
    spec = FORMATS[fmt]
    for name, shape in GPU_SHAPES.items():
        layouts = [tiled for tiled in (False, True) if not any(  # (K in whole groups: int4 g128 not at 2880)
            mw.triton_shape_reason(spec, 0, kk) or mma_reason(w := dataclasses.replace(spec, tiled=tiled), 0,
                                                              w.stored_k(kk)) for kk in shape[1:3])]
        if not layouts:
            continue
        for seed, (t, kw, on_input) in enumerate(cases):
            args = gpu_moe(fmt, t, shape, seed=seed, **kw)
            args["top_k_index"][0, 0] = -1  # another rank's experts (one valid pair left at T = 1, k = 2)
            if args["top_k_index"].numel() > 2:
                args["top_k_index"][-1, -1] = shape[0]
            if seed % 2 == 0:  # router weights as the model's router leaves them (x's dtype), read as they are
                args["top_k_weights"] = args["top_k_weights"].to(args["hidden_states"].dtype)
            if seed in (0, 2):
                args["top_k_index"] = args["top_k_index"].int()
            x, ids = args["hidden_states"], args["top_k_index"]
            b = (args["w13_bias"], args["w2_bias"])
            for bm, tiled in itertools.product(MMA_SYNC_BLOCK_M, layouts):
                s = QuantScheme(dataclasses.replace(spec, tiled=tiled))
                w13, w2 = projections(args, s)
                mma = {"block_m": bm}
                assert mw._mma_launches(x, w13, w2, *b, s, shape[2], mma, ids.numel()), (name, bm)
                out = mw.wo_moe_triton(x, ids, args["top_k_weights"], w13, w2, *b, args["activation"], s,
                                       on_input, mma=mma)
                check_gpu(out, args, f"{name} block_m={bm} tiled={tiled} T={t} {kw}", on_input)
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [f for f in GPU_FORMATS if not FORMATS[f].act_order])
def test_gpu_grouped_ws_matches_reference(fmt):
    """wo_mma's grouped warp-specialized build (sm_90, tiled experts) in blocks of 32, 64 and 128 pair slots
    against experts_ref: several blocks of one expert (T = 300, top-2 of 8: ~75 rows each) and few rows (T = 20),
    biases, fp16 x, swigluoai, the router weight on the input, router weights in x's dtype, int32 ids, another
    rank's expert ids, gpt-oss's K = 2880 padded to 2944; GEMM launches with a split in a cluster, 4 / 8 / 16
    consumer warps (16 at 64 slots) and the next kernel launched from the start; one case replayed in a CUDA graph
    on new inputs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized build is sm_90's")
    mx = FORMATS[fmt].scale.dtype.name == "E8M0"
    cases = [(300, {}, False), (20, dict(bias=True), False), (300, dict(activation="swigluoai:1.702:7.0", bias=True),
             False), (33, {}, True)] + ([] if mx else [(64, dict(dtype=torch.float16, bias=True), False)])
    launches = ({}, {"gemm1": {"split": 2}, "gemm2": {"split": 4, "trig": True}},
                {"gemm1": {"warps": 4}, "gemm2": {"warps": 8}}, {"gemm1": {"warps": 16, "trig": True}})
    s = QuantScheme(dataclasses.replace(FORMATS[fmt], tiled=True))
    for name, shape in GPU_SHAPES.items():
        if any(mw.triton_shape_reason(FORMATS[fmt], 0, kk) or mma_reason(s.weight, 0, s.weight.stored_k(kk))
               for kk in shape[1:3]):
            continue
        for seed, (t, kw, on_input) in enumerate(cases):
            args = gpu_moe(fmt, t, shape, seed=seed, **kw)
            args["top_k_index"][0, 0], args["top_k_index"][-1, -1] = -1, shape[0]  # another rank's experts
            if seed % 2 == 0:
                args["top_k_weights"] = args["top_k_weights"].to(args["hidden_states"].dtype)
                args["top_k_index"] = args["top_k_index"].int()
            x, ids, b = args["hidden_states"], args["top_k_index"], (args["w13_bias"], args["w2_bias"])
            w13, w2 = projections(args, s)
            for bm, extra in zip((32, 64, 128, 64), launches):
                mma = {"block_m": bm, **extra}
                got = mw._mma_launches(x, w13, w2, *b, s, shape[2], mma, ids.numel(), args["activation"])
                assert mw._mma_choice(mma) and got and all(l.cfg.ws and l.cfg.mt == bm // 8 for l in got), mma
                out = mw.wo_moe_triton(x, ids, args["top_k_weights"], w13, w2, *b, args["activation"], s, on_input,
                                       mma=mma)
                check_gpu(out, args, f"{name} T={t} {kw} {mma}", on_input)
    args, new = gpu_moe(fmt, 300, GPU_SHAPES["e8-h2048-i1408-k2"], seed=7), gpu_moe(fmt, 300, GPU_SHAPES[
        "e8-h2048-i1408-k2"], seed=8)
    w13, w2 = projections(args, s)

    def call():
        return mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2, None,
                                None, "silu", s, False, mma={"block_m": 64})
    first = call()
    assert torch.equal(first, call()), "two runs differ"
    captured, _graph = graph_replay(call, lambda: [args[n].copy_(new[n]) for n in ("hidden_states", "top_k_index",
                                                                                   "top_k_weights")])
    assert torch.equal(captured, call()), "replay differs from eager"
    check_gpu(captured, args, "graph")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_padded_experts_every_route(fmt):
    """gpt-oss's K = 2880 in 4-bit, tiled with K padded to 2944 as a GPU load stores it, through each route of the
    op: wo_mma's grouped build, the Triton GEMMs (x and the activations padded with zeros) and the dequantize path
    (the dequantized weights' first K columns), against experts_ref on the unpadded experts."""
    shape = GPU_SHAPES["e8-h2880-i2880-k4"]
    s = QuantScheme(dataclasses.replace(FORMATS[fmt], tiled=True))
    for t, route in ((4, dict(mma={"block_m": 8})), (64, {}), (512, dict(dequant_rows=0))):
        args = gpu_moe(fmt, t, shape, seed=t, bias=True)
        w13, w2 = projections(args, s)
        assert w13[0].shape[-1] * 2 == 2944 and w2[0].shape[-1] * 2 == 2944, (w13[0].shape, w2[0].shape)
        out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2,
                               args["w13_bias"], args["w2_bias"], args["activation"], s, False, **route)
        check_gpu(out, args, f"{fmt} T={t} {route}")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_g128", "nvfp4"])
def test_gpu_grouped_mma_shared_tiles_match_reference(fmt):
    """The grouped build with the tuner's kw (warps per 16-row tile), rt (tiles per warp) and trig (the next kernel
    launched from the start) axes, as tuned entries may fix them per GEMM, against experts_ref: one token (no sort)
    and five."""
    shape = GPU_SHAPES["e32-h1024-i768-k4"]
    spec = FORMATS[fmt]
    s = QuantScheme(dataclasses.replace(spec, tiled=True))
    for t in (1, 5):
        args = gpu_moe(fmt, t, shape, seed=t, bias=True)
        w13, w2 = projections(args, s)
        b = (args["w13_bias"], args["w2_bias"])
        for g1, g2 in (({"kw": 2}, {"rt": 2}), ({"warps": 8, "kw": 2, "rt": 2}, {"warps": 8, "kw": 4, "split": 1}),
                       ({"warps": 16, "kw": 4, "rt": 2, "split": 1}, {"warps": 4, "rt": 2, "split": 2}),
                       ({"trig": True}, {"trig": True, "split": 2})):
            mma = {"block_m": 8, "gemm1": g1, "gemm2": g2}
            assert mw._mma_choice(mma) and mw._mma_launches(args["hidden_states"], w13, w2, *b, s, shape[2], mma,
                                                             args["top_k_index"].numel()), mma
            out = mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2, *b,
                                   args["activation"], s, False, mma=mma)
            check_gpu(out, args, f"T={t} {mma}")
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_g128", "nvfp4"])
def test_gpu_fused_activation_matches_separate_launch(fmt, monkeypatch):
    """wo_mma's grouped build with the gated activation fused into GEMM 1 (each gated activation; GEMM 1 with and
    without a split in a cluster, and with warps sharing tiles; one token and five, a foreign expert id among the
    pairs): the launch is the fused one, and the output matches experts_ref and the same launches with the
    activation in a separate kernel (QCOMPILE_MOE_FUSE=0, or the choice's "act": False) within bf16 rounding."""
    shape = GPU_SHAPES["e32-h1024-i768-k4"]
    s = QuantScheme(dataclasses.replace(FORMATS[fmt], tiled=True))
    acts = ("silu", "gelu_tanh", "gelu", "swigluoai:1.702:7.0")
    for seed, (t, act, g1) in enumerate(itertools.product((1, 5), acts, ({"split": 1}, {"split": 2},
                                                                         {"warps": 8, "kw": 2, "rt": 2}))):
        args = gpu_moe(fmt, t, shape, activation=act, seed=seed, bias=seed % 2 == 0)
        args["top_k_index"][0, 1] = -1  # another rank's expert
        x, ids, b = args["hidden_states"], args["top_k_index"], (args["w13_bias"], args["w2_bias"])
        w13, w2 = projections(args, s)
        outs = {}
        for fuse, choice in (("1", {}), ("0", {}), ("1", {"act": False})):
            monkeypatch.setenv("QCOMPILE_MOE_FUSE", fuse)
            mma = {"block_m": 8, "gemm1": g1 | choice}
            l1, _ = mw._mma_launches(x, w13, w2, *b, s, shape[2], mma, ids.numel(), act)
            fused = fuse == "1" and not choice
            assert l1.cfg.gact == (mw.ACT_CODES[act.split(":")[0]] if fused else 0)
            assert l1.split == g1.get("split", l1.split)
            outs[fused] = mw.wo_moe_triton(x, ids, args["top_k_weights"], w13, w2, *b, act, s, False, mma=mma)
        tag = f"T={t} {act} {g1}"
        check_gpu(outs[True], args, tag)
        err = float((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm())
        assert err < 4e-3, (tag, err)
    torch.cuda.empty_cache()


GPU_CHECKPOINTS = ["llmcompressor-w4a16-gptq-moe", "llmcompressor-w4a16-actorder-moe", "llmcompressor-w4a16-mixtral",
                   "llmcompressor-w8a16-moe", "llmcompressor-nvfp4a16-moe", "llmcompressor-nvfp4-moe",
                   "modelopt-nvfp4-moe", "modelopt-mxfp8-moe", "modelopt-w4a16-nvfp4-moe",
                   "modelopt-w4a16-nvfp4-mixtral", "quark-w-mxfp4-moe", "quark-w-mxfp4-a-mxfp6-e2m3-moe",
                   "quark-w-int4-a-fp8-moe"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CHECKPOINTS)
def test_gpu_producer_checkpoints_compile_to_wo_moe(testdata, name):
    """A producer's weight-only MoE layer compiled on the GPU runs wo_moe and matches the eager layer
    (experts_ref with the scheme's activation quantization dropped), T = 1..300."""
    from qcompile.experts import QuantExperts

    torch._dynamo.reset()
    model = qcompile.load(str(testdata / name), device="cuda")
    experts = next(m for m in model.modules() if isinstance(m, QuantExperts))
    be = qcompile.backend()
    compiled = torch.compile(experts, backend=be, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    key = QuantScheme(mw.parse_scheme_key(experts.scheme_key).weight).key
    for t in (1, 3, 16, 300):
        x = torch.randn(t, experts.hidden_dim, device="cuda", generator=g).bfloat16()
        w, ids = torch.topk(torch.randn(t, experts.num_experts, device="cuda", generator=g).softmax(-1), 2, dim=-1)
        tensors = [getattr(experts, f"{p}_{r}", None) for p in ("w13", "w2") for r in W_ROLES]
        with torch.no_grad():
            want = torch.ops.qcompile.wo_moe(x, ids, w, *tensors, None, None, experts.activation, key)
            got = compiled(x, ids, w)
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2, (name, t)
    assert {(r.kernel, r.op) for r in be.rows} == {("wo_moe", "qcompile::wo_moe")}, be.explain()


MOE_ENTRY = re.compile(r"^(?P<scheme>[^|]+)\|bfloat16\|moe E(?P<e>\d+) k(?P<k>\d+) (?P<n1>\d+)x(?P<h>\d+) "
                       r"\d+x(?P<i>\d+)\|t(?P<t>\d+)$")


def test_shipped_moe_entries_are_run_as_measured():
    """Every shipped weight-only MoE entry is one the op runs as written (``_route`` takes its route and launch, not
    the rule it falls back to for a launch this version cannot read)."""
    from qcompile.kernels import wo_tune

    rule = {"block_m": 8}
    seen = 0
    for path in sorted(wo_tune.SHIPPED.glob("*.json")):
        for key, choice in wo_tune.read_table(path).items():
            if not MOE_ENTRY.match(key) or choice.route == "policy":
                continue
            seen += 1
            configs, dequant_rows, mma = mw._route(choice, rule)
            where = f"{path.name}: {key}"
            if choice.route == "mma":
                assert mma is choice.launch and dequant_rows == mw.NO_DEQUANT, where
            elif choice.route == "triton":
                assert configs is not None and mma is None, where
                assert configs[0]["BLOCK_M"] in mw.TUNE_BLOCK_M + (128,), where
            else:
                assert choice.route == "dequant" and dequant_rows == 0, where
    assert seen


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4_g128", "nvfp4", "mxfp4", "mxfp8"])
def test_gpu_shipped_entries_match_reference(fmt):
    """Every shipped table entry of this GPU for ``fmt``'s experts (the launches a model of that shape runs) on
    random experts of the entry's shape at its T, against experts_ref, and bit for bit the same in a second and third
    call (wo_tune.output_check's test: a race between a kernel's warps rarely survives it)."""
    from qcompile.kernels import wo_tune

    tiled = QuantScheme(dataclasses.replace(FORMATS[fmt], tiled=True))
    table = wo_tune.table("shipped", torch.cuda.get_device_name())
    entries = [(m, c) for key, c in table.items() if (m := MOE_ENTRY.match(key)) and m["scheme"] == tiled.key]
    if not entries:
        pytest.skip(f"no shipped {fmt} MoE entries for {torch.cuda.get_device_name()}")
    for m, choice in entries:
        e, h, i, k, t = (int(m[f]) for f in ("e", "h", "i", "k", "t"))
        args = gpu_moe(fmt, t, (e, h, i, k), seed=t)
        w13, w2 = projections(args, tiled)
        route = mw._route(choice, mw.mma_rule(args["hidden_states"], t * k, e))
        outs = [mw.wo_moe_triton(args["hidden_states"], args["top_k_index"], args["top_k_weights"], w13, w2, None,
                                 None, "silu", tiled, False, *route) for _ in range(3)]
        check_gpu(outs[0], args, f"{m.group(0)} {choice}")
        assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{m.group(0)} {choice}: outputs differ between calls"
        del args, w13, w2, outs
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_weight_ring_slots_refilled_after_their_reads():
    """The warp-specialized build's weight ring at its largest: Mixtral's down projection (K = 14336, 112 chunks) in
    blocks of 128 slots, 16 consumer warps, 227 KB of shared memory per CTA. A slot refilled before a warp's loads
    of it completed gives that warp the next ring pass's words for one chunk (a different output nearly every call);
    the launch must give 8 bit-identical outputs, equal to the 8-warp launch's (same chunk order per row)."""
    from qcompile.kernels import wo_mma
    from qcompile.kernels.moe_kernels import moe_align

    tiled = QuantScheme(dataclasses.replace(FORMATS["int4_g128"], tiled=True))
    args = gpu_moe("int4_g128", 256, (8, 4096, 14336, 2), seed=256)
    w13, w2 = projections(args, tiled)
    x, ids = args["hidden_states"], args["top_k_index"]
    pairs = ids.numel()
    align = moe_align(ids.reshape(-1).contiguous(), 8, 128)
    a = (torch.randn(pairs, 14336, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda") / 2
         ).to(torch.bfloat16)
    route = args["top_k_weights"].reshape(-1).contiguous()

    def gemm2(warps, calls):
        launch = mw._mma_launches(x, w13, w2, None, None, tiled, 14336, {"block_m": 128, "gemm2": {"warps": warps}},
                                  pairs, "silu")[1]
        assert launch.cfg.ws and launch.cfg.warps == warps, launch
        return launch, [wo_mma.grouped(launch, a, 1, *w2[:4], None, tiled.weight, align, pairs, route, ready=True)
                        for _ in range(calls)]

    expected = gemm2(8, 1)[1][0]
    launch, outs = gemm2(16, 8)
    assert launch.smem > 220 * 1024, launch  # (the case this test is for)
    differ = [int((o != expected).any(1).sum()) for o in outs]
    assert differ == [0] * 8, f"rows differing from the 8-warp launch, per call: {differ}"


@pytest.mark.gpu
def test_gpu_split_partials_past_int32_offsets():
    """Split-K partials of more than 2**31 elements: GEMM 1's fp32 [16, 8192 pairs, 28672] (Mixtral's gate/up
    projection at 8192 routed pairs, 15 GB) summed by the activation kernel, and the top-k sum over partials
    [3, pairs, H] whose split stride is 2**30, each split read at an int64 offset (wrapped int32 offsets
    fault or read another split)."""
    e, h, i = 2, 4096, 14336
    args = gpu_moe("int4_g128", 8192, (e, h, i, 1))
    w13, w2 = (tuple(args[f"{p}_{r}"] for r in W_ROLES) for p in ("w13", "w2"))
    spec = mw.parse_scheme_key(args["scheme"])
    x = args["hidden_states"]
    cfgs = tuple(dict(mw.grouped_config(8192, e, n, kk, spec.weight, x.device), BLOCK_M=64, BLOCK_K=128, SPLIT_K=sk)
                 for n, kk, sk in ((2 * i, h, 16), (h, i, 1)))
    out = mw.wo_moe_triton(x, args["top_k_index"], args["top_k_weights"], w13, w2, None, None, "silu", spec, False,
                           configs=cfgs)
    check_gpu(out, args, "GEMM 1 in 16 splits")
    del out, args, w13, w2
    torch.cuda.empty_cache()
    t, k, hh = 2**17, 2, 4096
    part = torch.randn(3, t * k, hh, device="cuda")
    ids = torch.zeros(t, k, dtype=torch.int32, device="cuda")
    summed = torch.empty(t, hh, device="cuda")
    mw._moe_sum_kernel[(t, hh // 512)](part, ids, summed, hh, 1, part.stride(0), TOPK=k, SPLIT=3, CHECK_IDS=True,
                                       BLOCK_H=512, num_warps=4)
    assert part.stride(0) * 2 >= 2**31
    expect = torch.zeros(t, hh, device="cuda")
    for j in range(k):  # the kernel's order: each pair's splits in turn, in fp32
        for s in range(3):
            expect += part[s, j::k]
    torch.testing.assert_close(summed, expect, rtol=1e-6, atol=1e-6)
