"""qcompile::fused_moe: the reference against an independent fp64 loop, input checks, launch
configurations, the op contract, the Triton kernels under the interpreter (subprocess), GPU checks.

CPU tests run everywhere (a few minutes, most of it the interpreter); ``@pytest.mark.gpu`` ones run
the real model shapes on CUDA and are skipped without it.

Tolerance of the kernels against :func:`fused_moe_reference` (``moe_bound``), per output ``out[t, n]``:
both quantize x identically (same scales, bit-exact codes), but h comes out of a differently ordered
fp32 accumulation, so each element of h may be rounded (to x.dtype, then to fp8 / int8) one code step
away from the reference's: ``sum_j |r_j| sum_i step(hq_ji) |W2_j[n, i]|`` (``step``: the fp8 spacing at
that code, or the int8 scale); plus one ulp of x.dtype for the rounding of each expert's y and of the
sum: ``eps (|ref| + sum_j |r_j y_j|)``. That bound is loose (every element off by a step at once), so
the normwise error is also bounded: 2e-3 in fp16 (observed <= 4e-4: the rounding of y); 5e-2 in bf16
under the interpreter, which truncates fp32 -> bf16 (observed <= 2.5e-2). A wrong expert, scale, bias or
weighting errs by O(1). The GPU tests compare with the reference on the CPU copy (``check_gpu``).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from qcompile.errors import ConfigError, UnsupportedError
from qcompile.kernels import moe_config as mc
from qcompile.kernels import moe_kernels as mk
from qcompile.kernels import moe_triton as mt
from qcompile.kernels import quant_math
from qcompile.scheme import ActSpec, Granularity, QDtype, QuantScheme, ScaleSpec, WeightSpec, fp8_scheme
from tests.gpu_util import graph_replay
from tests.opcheck_util import opcheck
from tests.interpreter_util import run_interpreted



def int8_scheme(weight: str, act: str) -> str:
    gran = {"tensor": Granularity.TENSOR, "channel": Granularity.CHANNEL}[weight]
    a = ActSpec(QDtype.INT8, act == "dynamic_token",
                ScaleSpec(Granularity.TOKEN if act == "dynamic_token" else Granularity.TENSOR))
    return QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(gran)), a).key


SCHEMES = {  # every weight granularity and activation recipe the kernels run
    "fp8_tensor_static": fp8_scheme("tensor", "static_tensor").key,
    "fp8_tensor_dyntensor": fp8_scheme("tensor", "dynamic_tensor").key,
    "fp8_channel_token": fp8_scheme("channel", "dynamic_token").key,
    "fp8_channel_static": fp8_scheme("channel", "static_tensor").key,
    "fp8_block_group": fp8_scheme("block", "dynamic_group").key,
    "fp8_block_token": fp8_scheme("block", "dynamic_token").key,
    "int8_channel_token": int8_scheme("channel", "dynamic_token"),
    "int8_tensor_static": int8_scheme("tensor", "static_tensor"),
}


def inputs(name, t=5, k=2, e=4, h=256, i=128, activation="silu", dtype=torch.float16, device="cpu", seed=0,
           foreign=False, bias=None, **kw):
    """make_moe_inputs of SCHEMES[name]; ``foreign``: some pairs routed to expert ids outside [0, E)."""
    args = mt.make_moe_inputs(SCHEMES[name], e, h, i, k, t, activation, dtype, device, seed, bias)
    if foreign:
        args["topk_ids"][0, -1] = -1
        args["topk_ids"][-1, 0] = e
    args.update(kw)
    return args


# -- an independent fp64 reference, with what the tolerance needs ---------------------------------

def _fp8_step(code: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at |code| (2^(e-3) for normals, 2^-9 below 2^-6)."""
    e = torch.floor(torch.log2(code.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


def _qdq64(a, scheme, static, group=128):
    """Quantize-dequantize rows of a (fp64) by explicit loops over scale groups: (values, code step)."""
    q = mt.moe_quant(scheme)
    qmax = 127.0 if q.int8 else 448.0
    floor = torch.finfo(torch.float32).tiny if q.int8 else 1.0 / (448 * 512)
    m, k = a.shape
    if q.a_gran == mt.G_BLOCK and k % group:  # a partial last group: padded with zeros, cut after
        v, step = _qdq64(torch.nn.functional.pad(a, (0, -k % group)), scheme, static, group)
        return v[:, :k], step[:, :k]
    if q.a_static:
        s = torch.full_like(a, float(static))
    elif q.a_gran == mt.G_TENSOR:
        s = torch.full_like(a, max(float(a.abs().max()) / qmax, floor))
    elif q.a_gran == mt.G_ROW:
        s = (a.abs().amax(1, keepdim=True) / qmax).clamp(min=floor).expand(m, k)
    else:
        s = (a.view(m, k // group, group).abs().amax(2, keepdim=True) / qmax).clamp(min=floor)
        s = s.expand(m, k // group, group).reshape(m, k)
    s = s.float().double()  # scales are fp32 in the kernels
    if q.int8:  # round half to even, then saturate
        code = torch.round(a / s).clamp(-128, 127)
    else:
        code = (a / s).clamp(-qmax, qmax).float().to(torch.float8_e4m3fn).double()
    step = s if q.int8 else _fp8_step(code) * s
    return code * s, step


def _deq64(w, s, q, n, k):
    if q.w_gran == mt.G_TENSOR:
        return w.double() * s.double()
    if q.w_gran == mt.G_ROW:
        return w.double() * s.double()[:, None]
    return w.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _act64(g, activation, i, gated):
    name = activation.replace("_no_mul", "")
    if name == "swigluoai":  # gpt-oss: alpha 1.702, limit 7
        gate, up = g[:i].clamp(max=7.0), g[i:].clamp(-7.0, 7.0)
        return gate * torch.sigmoid(1.702 * gate) * (up + 1)
    f = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
         "relu2": lambda v: torch.relu(v) ** 2}[name]
    return f(g[:i]) * g[i:] if gated else f(g)


def independent(args, on_input=False):
    """out [T, H] fp64 by a loop over (token, expert) pairs, and the per-output tolerance moe_bound."""
    q = mt.moe_quant(args["scheme"])
    x, ids, r = args["x"].double(), args["topk_ids"].long(), args["topk_weights"].double()
    t, h = x.shape
    k, e = ids.shape[1], args["w13"].shape[0]
    i = args["w2"].shape[2]
    gated = mt.ACTIVATIONS[args["activation"]][1]
    if on_input:  # x_t * w in fp32, rounded to x.dtype
        xr = args["x"].float()[:, None, :] * args["topk_weights"].float()[:, :, None]
        a1 = xr.reshape(t * k, h).to(args["x"].dtype).double()
    else:
        a1 = x
    a1, _ = _qdq64(a1, args["scheme"], args["a13_scale"])
    hid = torch.zeros(t * k, i, dtype=torch.float64)
    w2d = {}
    for p in range(t * k):
        ex = int(ids.view(-1)[p])
        if not 0 <= ex < e:
            continue
        g = a1[p if on_input else p // k] @ _deq64(args["w13"][ex], args["w13_scale"][ex], q, *args["w13"].shape[1:]).t()
        if args.get("b13") is not None:
            g = g + args["b13"][ex].double()
        hid[p] = _act64(g, args["activation"], i, gated)
        w2d[p] = _deq64(args["w2"][ex], args["w2_scale"][ex], q, h, i), ex
    hq, step = _qdq64(hid.to(args["x"].dtype).double(), args["scheme"], args["a2_scale"])
    out = torch.zeros(t, h, dtype=torch.float64)
    flips = torch.zeros(t, h, dtype=torch.float64)
    partial = torch.zeros(t, h, dtype=torch.float64)
    for p, (w, ex) in w2d.items():
        rw = 1.0 if on_input else float(r.view(-1)[p])
        y = rw * (hq[p] @ w.t() + (0.0 if args.get("b2") is None else args["b2"][ex].double()))
        out[p // k] += y
        partial[p // k] += y.abs()
        flips[p // k] += abs(rw) * (step[p] @ w.abs().t())
    eps = torch.finfo(args["x"].dtype).eps
    return out, flips + eps * (out.abs() + partial) + 1e-6 * out.abs().max()


def compare(out, ref, bound) -> dict:
    """Normwise relative error and the worst |out - ref| / bound."""
    err = (out.double() - ref).abs()
    return {"rel": float(err.norm() / ref.norm()), "worst": float((err / bound).max())}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_reference_matches_independent_fp64(name):
    """fused_moe_reference (fp32) against the fp64 pair loop: the same codes, so within the bound, and
    normwise below one ulp of x.dtype (the rounding of out; fp32 accumulation adds ~1e-6)."""
    for seed, kw in enumerate([dict(), dict(activation="gelu_tanh", t=3, k=1), dict(activation="silu_no_mul", e=8),
                               dict(activation="relu2_no_mul", dtype=torch.bfloat16)]):
        args = inputs(name, seed=seed, **kw)
        ref, bound = independent(args)
        got = compare(mt.fused_moe_reference(**args), ref, bound)
        assert got["worst"] <= 1 and got["rel"] < torch.finfo(args["x"].dtype).eps, (kw, got)


def test_reference_router_weight_on_input_and_foreign_experts():
    args = inputs("fp8_channel_token", t=4, k=2, seed=7)
    args["topk_ids"][1, 0] = -1  # expert of another rank: contributes nothing
    args["topk_ids"][2, 1] = 4
    for on_input in (False, True):
        ref, bound = independent(args, on_input)
        got = compare(mt.fused_moe_reference(**args, apply_router_weight_on_input=on_input), ref, bound)
        assert got["worst"] <= 1 and got["rel"] < torch.finfo(torch.float16).eps, (on_input, got)


def test_quantization_is_sane():
    """Against the same MoE with unquantized activations (fp64) the FP8 / INT8 layers keep an SQNR
    above 20 dB: the quantization is applied where it should be, not just consistently."""
    for name in ("fp8_block_group", "int8_channel_token", "fp8_tensor_static"):
        args = inputs(name, t=6, seed=3)
        out = mt.fused_moe_reference(**args).double()
        q = mt.moe_quant(args["scheme"])
        x, ids, r = args["x"].double(), args["topk_ids"].long(), args["topk_weights"].double()
        exact = torch.zeros_like(out)
        for tok in range(x.shape[0]):
            for j in range(ids.shape[1]):
                ex = int(ids[tok, j])
                g = x[tok] @ _deq64(args["w13"][ex], args["w13_scale"][ex], q, 256, 256).t()
                hh = torch.nn.functional.silu(g[:128]) * g[128:]
                exact[tok] += r[tok, j] * (hh @ _deq64(args["w2"][ex], args["w2_scale"][ex], q, 256, 128).t())
        sqnr = 10 * torch.log10(exact.pow(2).sum() / (out - exact).pow(2).sum())
        assert sqnr > 20, (name, float(sqnr))


# -- bad input gets qcompile's errors --------------------------------------------------------------

def test_rejects_schemes_it_cannot_run():
    cases = [(fp8_scheme("channel", None).key, "weight-only"),
             (QuantScheme(WeightSpec(QDtype.INT4, ScaleSpec(Granularity.CHANNEL))).key, "not FP8 or INT8"),
             (QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(Granularity.CHANNEL)),
                          ActSpec(QDtype.INT8, True, ScaleSpec(Granularity.TENSOR))).key, "INT8 runs"),
             (fp8_scheme("block", "dynamic_group", block=64).key, "128x128"),
             (QuantScheme(WeightSpec(QDtype.FP8_E4M3, ScaleSpec(Granularity.CHANNEL)),
                          ActSpec(QDtype.FP8_E4M3, False, ScaleSpec(Granularity.TOKEN))).key, "static per tensor")]
    for scheme, msg in cases:
        with pytest.raises(UnsupportedError, match=msg):
            mt.moe_quant(scheme)


@pytest.mark.parametrize("change,msg", [
    (dict(activation="swiglu"), "activation 'swiglu'"),
    (dict(x=torch.zeros(5, 128, dtype=torch.float16)), "do not fit x"),
    (dict(topk_ids=torch.zeros(5, 2)), "topk_ids must be int32/int64"),
    (dict(topk_weights=torch.zeros(5, 3)), "topk_weights must be float"),
    (dict(w13_scale=torch.ones(4)), r"w13_scale must be fp32 \[4, 256\]"),
    (dict(w2=torch.zeros(4, 256, 128, dtype=torch.int8)), "must be torch.float8_e4m3fn"),
    (dict(activation="silu_no_mul"), "non-gated activation"),
])
def test_rejects_bad_inputs(change, msg):
    args = inputs("fp8_channel_token")
    args.update(change)
    with pytest.raises(UnsupportedError, match=msg):
        mt.fused_moe_reference(**args)


def test_static_scheme_needs_scales():
    args = inputs("fp8_tensor_static", a2_scale=None)
    with pytest.raises(UnsupportedError, match="a2_scale is None"):
        mt.fused_moe_reference(**args)
    args = inputs("fp8_channel_token", b2=torch.zeros(4, 128))
    with pytest.raises(UnsupportedError, match=r"b2 must be a float \[4, 256\] bias"):
        mt.fused_moe_reference(**args)


def test_reference_swigluoai_biases_and_partial_groups():
    """gpt-oss's clamped SwiGLU with biases, and 1x128 activation groups over H, I not multiples of 128
    (a partial last group and partial 128x128 weight blocks), against the fp64 pair loop."""
    for name, kw in (("fp8_block_group", dict(activation="swigluoai", h=192, i=176)),
                     ("int8_channel_token", dict(activation="swigluoai")),
                     ("fp8_tensor_static", dict(activation="silu", bias=True, i=176))):
        args = inputs(name, seed=5, **kw)
        assert (args["b13"] is not None) and (args["b2"] is not None)
        ref, bound = independent(args)
        got = compare(mt.fused_moe_reference(**args), ref, bound)
        assert got["worst"] <= 1 and got["rel"] < torch.finfo(torch.float16).eps, (name, got)
        no_bias = compare(mt.fused_moe_reference(**dict(args, b2=None)), ref, bound)
        assert no_bias["rel"] > 10 * got["rel"] + 1e-3, (name, no_bias)  # the bias is applied


def test_partial_last_group_quantized_by_the_separate_kernel():
    """K = 320 (two 1x128 groups and one of 64): without prologue quantization the GEMM gets the codes and
    the [M, ceil(K/128)] group scales of the separate quantization kernel, as when K is a multiple of 128."""
    q = mt.moe_quant(SCHEMES["fp8_block_group"])
    a = (torch.randn(5, 320, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    codes, scale, mode, strides = mt._unpack(mt._act_operand(a, q, None, fuse=False))
    want_codes, want_scale = quant_math.quantize_activation(a, q.scheme.act)
    assert mode == mk.A_CODES and tuple(scale.shape) == (5, 3) and strides == scale.stride()
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)


# -- launch configurations -------------------------------------------------------------------------

def test_tuned_table_entries_are_valid():
    """Every shipped entry reads back as a MoeConfig that normalize_config leaves as it is for its scheme kind."""
    kinds = {"fp8": "fp8_channel_token", "fp8_block": "fp8_block_group", "int8": "int8_channel_token",
             "fp8_static": "fp8_tensor_static", "int8_static": "int8_tensor_static"}
    for arch, entries in mc.TUNED.items():
        for key, d in entries.items():
            cfg = mc.MoeConfig.from_dict(d)
            q = mc.moe_quant(SCHEMES[kinds[key.split("/")[0]]])
            assert mc.normalize_config(cfg, q, not key.endswith("/nogate")) == cfg, (arch, key)
            assert cfg.to_dict() == d


@pytest.mark.parametrize("name", ["fp8_tensor_static", "fp8_block_group", "fp8_tensor_dyntensor", "int8_channel_token",
                                  "int8_tensor_static"])
def test_default_configs_are_valid(name):
    q = mt.moe_quant(SCHEMES[name])
    for e, h, i, k in ((8, 4096, 14336, 2), (128, 2048, 768, 8)):
        for t in (1, 4, 16, 64, 256, 4096):
            for gated in (True, False):
                cfg = mc.normalize_config(mc.default_config(q, e, h, i, k, t), q, gated)
                if name == "fp8_tensor_static" and t * k <= e:  # a pair per expert: one-row programs
                    assert cfg == mc.MoeConfig(1, True, mc.ROW_GEMM, mc.ROW_GEMM, False)
                    continue
                for g in (cfg.gemm1, cfg.gemm2):
                    assert g.block_n in (16, 32, 64, 128) and g.block_k % 128 == 0 and g.num_warps in (4, 8)
                    assert not q.per_step or g.block_k == 128
                    assert q.a_static or q.a_gran != mt.G_TENSOR or not g.fuse_quant
                    assert g.swap == (cfg.block_m < 64)
                assert not gated or cfg.gemm1.split_k == 1
                assert not cfg.per_pair and not cfg.fold_topk
                assert not cfg.gemm1.fuse_quant and not cfg.gemm2.fuse_quant
                if t <= 4:  # decode: 16-row tiles
                    assert cfg.block_m == 16
                if t == 4096:
                    assert cfg.block_m >= 64


def test_config_lookup_order(monkeypatch, tmp_path):
    """The on-disk cache of this device, then the TUNED table of its architecture, then the default rule."""
    q = mt.moe_quant(SCHEMES["fp8_tensor_static"])
    key = mc.config_key(q.kind, 8, 256, 128, 2, 3)
    assert key == "fp8_static/E8/H256/I128/k2/T4"
    table = mc.MoeConfig(32, False, mc.GemmConfig(128), mc.GemmConfig(32, split_k=2))
    cached = mc.MoeConfig(16, True, mc.GemmConfig(64), mc.GemmConfig(64), True)
    monkeypatch.setenv(mc.CACHE_ENV, str(tmp_path / "fused_moe.json"))
    monkeypatch.setitem(mc.TUNED, "interpreter", {key: table.to_dict()})
    cpu = torch.device("cpu")
    mc.get_config.cache_clear()
    assert mc.get_config(q, 8, 256, 128, 2, 3, True, cpu) == mc.normalize_config(table, q, True)
    assert mc.save_config(cpu, key, cached) == tmp_path / "fused_moe.json"
    assert mc.get_config(q, 8, 256, 128, 2, 3, True, cpu) == cached
    assert json.loads((tmp_path / "fused_moe.json").read_text()) == {"interpreter": {key: cached.to_dict()}}
    monkeypatch.setitem(mc.TUNED, "interpreter", {})
    monkeypatch.setenv(mc.CACHE_ENV, str(tmp_path / "absent.json"))
    mc.get_config.cache_clear()
    assert mc.get_config(q, 8, 256, 128, 2, 3, True, cpu) == mc.normalize_config(
        mc.default_config(q, 8, 256, 128, 2, 3), q, True)
    mc.get_config.cache_clear()


def test_config_cache_path_and_bad_cache(monkeypatch, tmp_path):
    """QCOMPILE_MOE_CONFIGS, else $XDG_CACHE_HOME/qcompile; a damaged cache is a ConfigError naming the file."""
    monkeypatch.delenv(mc.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mc.cache_path() == tmp_path / "xdg" / "qcompile" / "fused_moe.json"
    monkeypatch.setenv(mc.CACHE_ENV, str(tmp_path / "bad.json"))
    for text in ("{not json", json.dumps({"interpreter": {"k": {"block_m": 16}}})):
        (tmp_path / "bad.json").write_text(text)
        mc._CACHE.clear()
        with pytest.raises(ConfigError, match="bad.json.*not valid.*delete the file"):
            mc.cached_entries(torch.device("cpu"))
    mc._CACHE.clear()


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UnsupportedError, match="CUDA GPU"):
        mc.tune(8, 256, 128, 2, 4, SCHEMES["fp8_tensor_static"])


def test_align_sizes_bound_every_routing():
    """max_blocks covers the worst routing: every expert that has a pair wastes block_m - 1 slots."""
    for p, e, bm in ((1, 4, 16), (8, 128, 16), (34, 8, 16), (32768, 128, 64), (5, 8, 128)):
        max_blocks, slots = mk.align_sizes(p, e, bm)
        m = min(e, p)  # one pair on each of m - 1 experts, the rest on one
        assert max_blocks >= m - 1 + -(-(p - m + 1) // bm) and slots == max_blocks * bm
        counts = [p // min(e, p)] * min(e, p)
        counts[0] += p - sum(counts)
        assert sum(-(-c // bm) for c in counts) <= max_blocks


def test_align_reference_layout():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32)  # no pair on expert 1
    sorted_ids, experts = mk.moe_align_reference(ids, 4, 4)  # 4 blocks: (6 + 4 * 3) // 4
    assert sorted_ids.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6, 6, 6, 6, 6]
    assert experts.tolist() == [0, 2, 3, -1]


# -- the op ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_tensor_static", "fp8_block_group", "int8_channel_token"])
def test_opcheck(name):
    args = inputs(name, t=3, k=2)
    call = op_call(args, "reference")
    opcheck(torch.ops.qcompile.fused_moe.default, call)
    out = torch.ops.qcompile.fused_moe(*call)
    assert out.shape == args["x"].shape and out.dtype == args["x"].dtype
    assert torch.equal(out, mt.fused_moe_reference(**args))


def op_call(args: dict, backend: str, on_input: bool = False) -> list:
    """The positional arguments of torch.ops.qcompile.fused_moe for make_moe_inputs' ``args``."""
    activation = args["activation"] + (":1.702:7.0" if args["activation"] == "swigluoai" else "")
    return [args[n] for n in ("x", "topk_ids", "topk_weights", "w13", "w13_scale", "a13_scale", "w2", "w2_scale",
                              "a2_scale", "b13", "b2")] + [activation, args["scheme"], on_input, backend]


def test_opcheck_swigluoai_biases():
    args = inputs("fp8_channel_token", t=3, activation="swigluoai")
    opcheck(torch.ops.qcompile.fused_moe.default, op_call(args, "reference"))
    assert torch.equal(torch.ops.qcompile.fused_moe(*op_call(args, "reference")), mt.fused_moe_reference(**args))


def test_op_backends():
    args = inputs("fp8_tensor_static", t=2)
    with pytest.raises(UnsupportedError, match="unknown fused_moe backend"):
        torch.ops.qcompile.fused_moe(*op_call(args, "cutlass"))
    if not mk.use_triton(args["x"]):
        with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
            torch.ops.qcompile.fused_moe(*op_call(args, "triton"))
    for n in ("x", "topk_ids", "topk_weights"):
        args[n] = args[n][:0]
    assert mt.fused_moe(**args).shape == (0, 256)


# -- the Triton kernels under the interpreter (subprocess: TRITON_INTERPRET is read at import) --------

INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import dataclasses, json, os, time, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import moe_kernels as mk, moe_triton as mt
    from tests.kernels.test_moe_triton import (ALIGNED, PIPELINE_CASES, inputs, independent, compare, align_cases,
                                               op_call)
    assert mk.use_triton(torch.empty(1)), "interpreter not active"
    t0, res = time.time(), {"align": {}, "pipeline": {}}
    for name, (ids, e, bm, elems) in align_cases().items():
        mk.ONEHOT_ELEMS = elems
        got, want = mk.moe_align(ids, e, bm), mk.moe_align_reference(ids, e, bm)
        res["align"][name] = all(torch.equal(a, b) for a, b in zip(got, want))
    mk.ONEHOT_ELEMS = 16384
    for name, (scheme, cfg, kw) in PIPELINE_CASES.items():
        on_input = kw.pop("on_input", False)
        args = inputs(scheme, **kw)
        ref, bound = independent(args, on_input)
        out = mt.fused_moe(**args, apply_router_weight_on_input=on_input, config=cfg)
        res["pipeline"][name] = dict(compare(out, ref, bound), dtype=str(args["x"].dtype))
    call = inputs("fp8_block_group", t=3, activation="swigluoai")
    res["op_triton"] = bool(torch.equal(torch.ops.qcompile.fused_moe(*op_call(call, "triton")), mt.fused_moe(**call)))
    res["static_h_codes"] = {}
    for scheme, dtype in (("fp8_channel_static", torch.float16), ("int8_tensor_static", torch.bfloat16)):
        call = inputs(scheme, t=5, dtype=dtype)
        folded = mt.fused_moe(**call, config=ALIGNED)  # GEMM 1 writes h's codes
        prologue = mt.fused_moe(**call, config=dataclasses.replace(
            ALIGNED, gemm2=dataclasses.replace(ALIGNED.gemm2, fuse_quant=True)))  # GEMM 2 quantizes h
        res["static_h_codes"][f"{scheme}-{dtype}"] = bool(torch.equal(folded, prologue))
    res["seconds"] = time.time() - t0
    print(json.dumps(res))
""")


def align_cases() -> dict:
    """(topk_ids, E, block_m, one-hot elements per program: small values force the chunked path)."""
    g = torch.Generator().manual_seed(11)

    def routed(t, k, e):
        return torch.rand(t, e, generator=g).argsort(1)[:, :k].to(torch.int32)

    holes = routed(17, 2, 8)
    holes[holes % 3 == 1] = -1  # experts 1, 4, 7 have no pair; some pairs have no local expert
    far = routed(9, 2, 8).long()
    far[0, 0] = 8  # out of range: left out
    return {
        "decode-t1-k2-e8": (routed(1, 2, 8), 8, 16, 16384),
        "t17-k2-e8-not-multiple": (routed(17, 2, 8), 8, 16, 16384),
        "all-on-one-expert": (torch.full((13, 1), 3, dtype=torch.int32), 4, 16, 16384),
        "empty-experts-and-foreign-ids": (holes, 8, 16, 16384),
        "int64-out-of-range": (far, 8, 32, 16384),
        "chunked-t40-k8-e128": (routed(40, 8, 128), 128, 16, 16384),
        "chunked-small-chunks-e8": (routed(37, 2, 8), 8, 16, 256),
        "chunked-block64": (routed(50, 4, 16), 16, 64, 256),
    }


def _cfg(bm, per_pair, g1, g2, fold=False):
    return mc.MoeConfig(bm, per_pair, mc.GemmConfig(**g1), mc.GemmConfig(**g2), fold)


DECODE = _cfg(16, True, dict(block_n=32), dict(block_n=16, block_k=256), fold=True)  # fused quant, swap
PER_PAIR = _cfg(16, True, dict(block_n=64), dict(block_n=64))
ALIGNED = _cfg(16, False, dict(block_n=64, fuse_quant=False), dict(block_n=32, split_k=2, fuse_quant=False))
WIDE = _cfg(32, False, dict(block_n=32, swap=False), dict(block_n=64, swap=False, block_k=256))
FOLD_SPLIT = _cfg(16, False, dict(block_n=32), dict(block_n=32, split_k=2, fuse_quant=False), fold=True)
ROW = _cfg(1, True, dict(block_n=16, block_k=256), dict(block_n=32))  # one pair per program: CUDA cores
ROW_FOLD_SPLIT = _cfg(1, True, dict(block_n=8, block_k=128, fuse_quant=False), dict(block_n=16, split_k=2), fold=True)
PREFILL = _cfg(64, False, dict(block_n=64, swap=False, fuse_quant=False, num_warps=8),
               dict(block_n=128, swap=False, fuse_quant=False, num_warps=8))  # the default rule's prefill tiles
PIPELINE_CASES = {}
for _name in SCHEMES:
    PIPELINE_CASES[f"{_name}-decode-t1"] = (_name, DECODE, dict(t=1, k=2, e=8))
    PIPELINE_CASES[f"{_name}-aligned-t5"] = (_name, ALIGNED, dict(t=5, k=2, e=4))
    PIPELINE_CASES[f"{_name}-wide-t17"] = (_name, WIDE, dict(t=17, k=2, e=8, h=128))
    PIPELINE_CASES[f"{_name}-row-t3"] = (_name, ROW, dict(t=3, k=2, e=8))
PIPELINE_CASES.update({
    "fp8_channel_token-default-t3-k1": ("fp8_channel_token", None, dict(t=3, k=1, e=4)),
    "fp8_tensor_static-default-t2-row": ("fp8_tensor_static", None, dict(t=2, k=2, e=8)),  # the rule's one row
    "fp8_channel_token-per-pair-t3": ("fp8_channel_token", PER_PAIR, dict(t=3, k=2, e=8)),
    "fp8_block_group-fold-split": ("fp8_block_group", FOLD_SPLIT, dict(t=4, k=2, e=4)),
    "int8_channel_token-fold-split-foreign": ("int8_channel_token", FOLD_SPLIT, dict(t=4, k=2, e=4, foreign=True)),
    "fp8_tensor_static-per-pair-foreign": ("fp8_tensor_static", PER_PAIR, dict(t=3, k=2, e=4, foreign=True)),
    "fp8_tensor_dyntensor-aligned-foreign": ("fp8_tensor_dyntensor", ALIGNED, dict(t=6, k=2, e=8, foreign=True)),
    "fp8_channel_token-decode-foreign": ("fp8_channel_token", DECODE, dict(t=2, k=2, e=8, foreign=True)),
    "fp8_block_group-default-t9-gelu": ("fp8_block_group", None, dict(t=9, k=2, e=8, activation="gelu_tanh")),
    "fp8_tensor_static-nogate": ("fp8_tensor_static", ALIGNED, dict(t=4, activation="silu_no_mul")),
    "int8_channel_token-relu2": ("int8_channel_token", DECODE, dict(t=2, activation="relu2_no_mul")),
    "fp8_channel_static-on-input": ("fp8_channel_static", ALIGNED, dict(t=3, on_input=True)),
    "fp8_channel_token-on-input-pair": ("fp8_channel_token", DECODE, dict(t=2, on_input=True)),
    "fp8_block_group-bf16": ("fp8_block_group", ALIGNED, dict(t=5, dtype=torch.bfloat16)),
    "int8_tensor_static-bf16": ("int8_tensor_static", DECODE, dict(t=3, dtype=torch.bfloat16)),
    # gpt-oss's swigluoai with biases: aligned (GEMM 2 split over K), folded decode, folded split
    "fp8_channel_token-swigluoai-aligned": ("fp8_channel_token", ALIGNED, dict(t=5, activation="swigluoai")),
    "fp8_block_group-swigluoai-decode": ("fp8_block_group", DECODE, dict(t=2, e=8, activation="swigluoai")),
    "int8_channel_token-swigluoai-fold-split": ("int8_channel_token", FOLD_SPLIT,
                                                dict(t=4, activation="swigluoai", foreign=True)),
    "fp8_tensor_static-swigluoai-wide": ("fp8_tensor_static", WIDE, dict(t=9, h=128, activation="swigluoai")),
    "fp8_block_group-prefill-t40": ("fp8_block_group", PREFILL, dict(t=40, k=2, e=4, h=128)),
    "int8_channel_token-prefill-t40": ("int8_channel_token", PREFILL, dict(t=40, k=2, e=4, h=128, foreign=True)),
    "fp8_block_group-row-fold-split-partial": ("fp8_block_group", ROW_FOLD_SPLIT, dict(t=3, e=8, h=192, i=176)),
    "int8_channel_token-row-swigluoai-foreign": ("int8_channel_token", ROW, dict(t=4, activation="swigluoai",
                                                                                foreign=True)),
    "fp8_channel_token-row-fold-on-input": ("fp8_channel_token", ROW_FOLD_SPLIT, dict(t=2, on_input=True)),
    "fp8_tensor_static-row-nogate": ("fp8_tensor_static", ROW, dict(t=2, activation="silu_no_mul")),
    # H, I not multiples of 128: partial weight blocks and a partial last activation group
    "fp8_block_group-partial-aligned": ("fp8_block_group", ALIGNED, dict(t=5, h=192, i=176)),
    "fp8_block_group-partial-decode": ("fp8_block_group", DECODE, dict(t=2, e=8, h=192, i=176)),
    "fp8_block_token-partial-wide": ("fp8_block_token", WIDE, dict(t=9, h=192, i=176, activation="swigluoai")),
    # K = 320 and 288: two full 128-blocks and a partial one, activations quantized by the separate kernel
    "fp8_block_group-partial-k320-aligned": ("fp8_block_group", ALIGNED, dict(t=5, h=320, i=288)),
    "fp8_block_group-partial-k320-prefill": ("fp8_block_group", PREFILL, dict(t=24, k=2, e=4, h=320, i=288)),
})


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(INTERPRETER_SCRIPT, timeout=600)


@pytest.mark.parametrize("name", list(align_cases()))
def test_align_under_interpreter(interpreter_results, name):
    """moe_align (one program, or count / scan / scatter over chunks) equals the Python layout exactly."""
    assert interpreter_results["align"][name]


@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_fused_moe_under_interpreter(interpreter_results, name):
    """fused_moe against the fp64 pair loop: every output within moe_bound, normwise 2e-3 (fp16) or
    5e-2 (bf16: the interpreter truncates to bf16)."""
    got = interpreter_results["pipeline"][name]
    assert got["worst"] <= 1 and got["rel"] < (5e-2 if got["dtype"] == "torch.bfloat16" else 2e-3), got


def test_op_triton_backend_under_interpreter(interpreter_results):
    assert interpreter_results["op_triton"]


def test_static_h_codes_from_gemm1_under_interpreter(interpreter_results):
    """With a static activation scale, GEMM 1 writes h's codes itself: the output is bit-equal to GEMM 2
    quantizing h (bf16 / fp16) in its prologue, i.e. the same codes as the separate quantization kernel."""
    assert interpreter_results["static_h_codes"] and all(interpreter_results["static_h_codes"].values()), \
        interpreter_results["static_h_codes"]


# -- on the GPU ------------------------------------------------------------------------------------

GPU = "cuda"  # the device of the GPU tests
GPU_TOKENS = (1, 2, 4, 16, 64, 256, 1000)
GPU_SHAPES = {"e16-h1024-i704-k4": (16, 1024, 704, 4),  # I % 128 != 0: partial blocks and last group
              "e8-h2048-i1408-k2": (8, 2048, 1408, 2)}
GPU_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai", "silu_no_mul")


def gpu_inputs(name, t, shape, activation="silu", dtype=torch.bfloat16, seed=0):
    """make_moe_inputs on CUDA; from 64 tokens on, the last (up to) 3 experts get no pair (unused experts)."""
    e, h, i, k = shape
    args = mt.make_moe_inputs(SCHEMES[name], e, h, i, k, t, activation, dtype, GPU, seed)
    if t >= 64:
        g = torch.Generator(device=GPU).manual_seed(seed + 99)
        used = e - min(3, e - k)
        args["topk_ids"] = torch.rand(t, used, generator=g, device=GPU).argsort(1)[:, :k].to(torch.int32)
    return args


def check_gpu(out, args, tag):
    """Against fused_moe_reference of the CPU copy (exact division, as the kernels; fp32): normwise
    below 2e-2 (bf16) / 5e-3 (fp16) over all outputs and 4e-2 / 2e-2 per token (on an H200 the worst
    seen were 1.7e-2 / 2.2e-2 bf16, gelu_tanh T=4, and 3.7e-3 / 1.4e-2 fp16). Expected: the rounding
    of each expert's y and of the sum to x.dtype (~2^-9 / 2^-12 RMS), a few h elements one fp8 / int8
    code away (h comes out of a differently ordered fp32 sum, ~1e-3 normwise), FP8 tensor-core
    accumulation (~1e-4). A wrong expert, scale, bias or weighting errs by O(1) on its token's row."""
    cpu = {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    ref = mt.fused_moe_reference(**cpu).float()
    out = out.float().cpu()
    assert out.shape == ref.shape and bool(torch.isfinite(out).all()), tag
    err = out - ref
    bf16 = args["x"].dtype == torch.bfloat16
    rel = float(err.norm() / ref.norm())
    row_norm = ref.norm(dim=1)
    row = float((err.norm(dim=1) / row_norm.clamp(min=1e-3 * float(row_norm.max()))).max())
    assert rel < (2e-2 if bf16 else 5e-3) and row < (4e-2 if bf16 else 2e-2), (tag, rel, row)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", GPU_ACTIVATIONS)
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_matches_reference(shape, name, activation):
    """Every scheme x activation, decode to prefill token counts, default launch configurations."""
    if shape != "e16-h1024-i704-k4" and activation != "silu":
        pytest.skip("activations are covered on the first shape")
    for seed, t in enumerate(GPU_TOKENS):
        args = gpu_inputs(name, t, GPU_SHAPES[shape], activation, seed=seed)
        check_gpu(mt.fused_moe(**args), args, f"T={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["decode", "per-pair", "aligned", "wide", "fold-split", "row", "row-fold-split"])
def test_gpu_launch_configurations(cfg):
    """The non-default paths on the GPU: per-pair / folded decode (16-row tiles or one row on the CUDA
    cores), split-K, row tiles without swap, fp16, activation weight on input."""
    config = {"decode": DECODE, "per-pair": PER_PAIR, "aligned": ALIGNED, "wide": WIDE, "fold-split": FOLD_SPLIT,
              "row": ROW, "row-fold-split": ROW_FOLD_SPLIT}[cfg]
    for seed, (name, t) in enumerate((("fp8_block_group", 4), ("fp8_channel_token", 16), ("int8_channel_token", 64),
                                      ("fp8_tensor_dyntensor", 5), ("fp8_tensor_static", 2))):
        for dtype in (torch.bfloat16, torch.float16):
            args = gpu_inputs(name, t, GPU_SHAPES["e16-h1024-i704-k4"], "swigluoai", dtype, seed)
            check_gpu(mt.fused_moe(**args, config=config), args, f"{name} T={t} {dtype}")
    args = gpu_inputs("fp8_channel_token", 3, GPU_SHAPES["e16-h1024-i704-k4"], "silu", seed=9)
    out = mt.fused_moe(**args, config=config, apply_router_weight_on_input=True)
    cpu = {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    ref = mt.fused_moe_reference(**cpu, apply_router_weight_on_input=True).float()
    # check_gpu's bf16 bound: on an H200 the folded layouts matched to 1e-4, the others (each pair's y rounded
    # to bf16 before the top-k sum, whose terms partly cancel without the router weight) 0.3-1.2 % over seeds
    assert float((out.float().cpu() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("model,shape", [("mixtral", (8, 4096, 14336, 2)), ("qwen3-30b-a3b", (128, 2048, 768, 8))])
def test_gpu_model_shapes(model, shape):
    """Mixtral- and Qwen3-30B-A3B-shaped experts on the launches a model gets: the shipped sm_90 table's entries at
    decode token counts (per-pair programs), the rule above."""
    for name in ("fp8_channel_token", "fp8_block_group", "fp8_tensor_static", "int8_channel_token"):
        for t in (1, 2, 4, 8, 16, 64):
            args = gpu_inputs(name, t, shape, seed=t)
            check_gpu(mt.fused_moe(**args), args, f"{model} {name} T={t}")
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8_channel_token", "fp8_block_group", "fp8_tensor_static", "fp8_tensor_dyntensor",
                                  "int8_channel_token"])
def test_gpu_cuda_graph_and_determinism(name):
    """The whole op captured in a CUDA graph (no host sync: capture would fail) replays new routing and
    new x correctly; two eager runs are bitwise equal (no atomics, fixed summation order)."""
    shape = GPU_SHAPES["e16-h1024-i704-k4"]
    for t in (1, 4, 256, 1000):
        args, new = gpu_inputs(name, t, shape, seed=1), gpu_inputs(name, t, shape, seed=2)
        new.update({n: args[n] for n in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2")})  # same layer
        call = op_call(args, "triton")
        first = torch.ops.qcompile.fused_moe(*call)
        assert torch.equal(first, torch.ops.qcompile.fused_moe(*call)), f"T={t}: two runs differ"
        captured, _graph = graph_replay(lambda: torch.ops.qcompile.fused_moe(*call), lambda: [
            args[n].copy_(new[n]) for n in ("x", "topk_ids", "topk_weights", "a13_scale", "a2_scale")
            if args[n] is not None])
        assert torch.equal(captured, mt.fused_moe(**new)), f"T={t}: replay with new inputs differs from eager"
        check_gpu(captured, new, f"graph T={t}")



def test_pdl_launch_keywords(monkeypatch):
    """qcompile's Triton kernels launch with PDL on a CUDA tensor of sm_90+ (mocked here), not on sm_80, not with
    QCOMPILE_PDL=0, not inside without_pdl(), never on the CPU."""
    from types import SimpleNamespace

    from qcompile.kernels import cuda_driver
    from qcompile.kernels import fp8_quant_triton as fq

    cuda = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    cap = [(9, 0)]
    monkeypatch.setattr(cuda_driver, "capability", lambda idx: cap[0])  # the per-process query pdl() asks
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QCOMPILE_PDL", raising=False)
    assert fq.pdl(cuda) == {"PDL": True, "launch_pdl": True}
    with fq.without_pdl():
        assert fq.pdl(cuda) == {"PDL": False}
    assert fq.pdl(cuda)["PDL"]
    assert fq.pdl(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("QCOMPILE_PDL", "0")
    assert fq.pdl(cuda) == {"PDL": False}
    monkeypatch.delenv("QCOMPILE_PDL")
    cap[0] = (8, 0)
    assert fq.pdl(cuda) == {"PDL": False}
