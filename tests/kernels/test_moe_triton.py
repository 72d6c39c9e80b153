"""qcompile::fused_moe: the reference against an independent fp64 loop, input checks, launch
configurations, the op contract, the Triton kernels under the interpreter (subprocess), GPU checks.

CPU tests run everywhere (about a minute, most of it the interpreter); ``@pytest.mark.gpu`` ones run
the real model shapes on CUDA and are skipped without it.

Tolerance of the kernels against :func:`fused_moe_reference` (``moe_bound``), per output ``out[t, n]``:
both quantize x identically (same scales, bit-exact codes), but h comes out of a differently ordered
fp32 accumulation, so each element of h may be rounded (to x.dtype, then to fp8 / int8) one code step
away from the reference's: ``sum_j |r_j| sum_i step(hq_ji) |W2_j[n, i]|`` (``step``: the fp8 spacing at
that code, or the int8 scale); plus one ulp of x.dtype for the rounding of each expert's y and of the
sum: ``eps (|ref| + sum_j |r_j y_j|)``. That bound is loose (every element off by a step at once), so
the normwise error is also bounded: 2e-3 in fp16 (observed <= 4e-4: the rounding of y); 5e-2 in bf16
under the interpreter, which truncates fp32 -> bf16 (observed <= 2.5e-2; on the GPU 1e-2). A wrong
expert, scale or weighting errs by O(1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qcompile.errors import UnsupportedError
from qcompile.kernels import moe_kernels as mk
from qcompile.kernels import moe_triton as mt
from qcompile.scheme import ActSpec, Granularity, QDtype, QuantScheme, ScaleSpec, WeightSpec, fp8_scheme
from tests.opcheck_util import opcheck

REPO = Path(__file__).resolve().parents[2]


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
           foreign=False, **kw):
    """make_moe_inputs of SCHEMES[name]; ``foreign``: some pairs routed to expert ids outside [0, E)."""
    args = mt.make_moe_inputs(SCHEMES[name], e, h, i, k, t, activation, dtype, device, seed)
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


def independent(args, on_input=False):
    """out [T, H] fp64 by a loop over (token, expert) pairs, and the per-output tolerance moe_bound."""
    q = mt.moe_quant(args["scheme"])
    x, ids, r = args["x"].double(), args["topk_ids"].long(), args["topk_weights"].double()
    t, h = x.shape
    k, e = ids.shape[1], args["w13"].shape[0]
    i = args["w2"].shape[2]
    gated = mt.ACTIVATIONS[args["activation"]][1]
    a1 = (x[:, None, :] * r[:, :, None]).reshape(t * k, h) if on_input else x
    a1, _ = _qdq64(a1, args["scheme"], args["a13_scale"])
    hid = torch.zeros(t * k, i, dtype=torch.float64)
    w2d = {}
    for p in range(t * k):
        ex = int(ids.view(-1)[p])
        if not 0 <= ex < e:
            continue
        g = a1[p if on_input else p // k] @ _deq64(args["w13"][ex], args["w13_scale"][ex], q, *args["w13"].shape[1:]).t()
        act = {"silu": torch.nn.functional.silu, "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"),
               "relu2": lambda v: torch.relu(v) ** 2}[args["activation"].replace("_no_mul", "")]
        hid[p] = act(g[:i]) * g[i:] if gated else act(g)
        w2d[p] = _deq64(args["w2"][ex], args["w2_scale"][ex], q, h, i)
    hq, step = _qdq64(hid.to(args["x"].dtype).double(), args["scheme"], args["a2_scale"])
    out = torch.zeros(t, h, dtype=torch.float64)
    flips = torch.zeros(t, h, dtype=torch.float64)
    partial = torch.zeros(t, h, dtype=torch.float64)
    for p, w in w2d.items():
        rw = 1.0 if on_input else float(r.view(-1)[p])
        y = rw * (hq[p] @ w.t())
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
    args = inputs("fp8_block_group", h=192)
    with pytest.raises(UnsupportedError, match="multiples of the 128-wide"):
        mt.fused_moe_reference(**args)


# -- launch configurations -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp8_tensor_static", "fp8_block_group", "fp8_tensor_dyntensor", "int8_channel_token"])
def test_default_configs_are_valid(name):
    q = mt.moe_quant(SCHEMES[name])
    for e, h, i, k in ((8, 4096, 14336, 2), (128, 2048, 768, 8)):
        for t in (1, 4, 16, 64, 256, 4096):
            for gated in (True, False):
                cfg = mt.normalize_config(mt.default_config(q, e, h, i, k, t), q, gated)
                for g in (cfg.gemm1, cfg.gemm2):
                    assert g.block_n in (16, 32, 64, 128) and g.block_k % 128 == 0 and g.num_warps in (4, 8)
                    assert not q.per_step or g.block_k == 128
                    assert q.a_static or q.a_gran != mt.G_TENSOR or not g.fuse_quant
                    assert g.swap == (cfg.block_m < 64)
                assert not gated or cfg.gemm1.split_k == 1
                assert not cfg.per_pair or cfg.block_m == 16
                if t <= 4:  # decode: prologue quantization (where possible), 16-row tiles
                    assert cfg.block_m == 16
                if t == 4096:
                    assert cfg.block_m >= 64 and not cfg.gemm1.fuse_quant


def test_config_lookup_order(monkeypatch, tmp_path):
    """The on-disk cache of this device, then the TUNED table, then the default rule."""
    q = mt.moe_quant(SCHEMES["fp8_tensor_static"])
    key = mt.config_key(q.kind, 8, 256, 128, 2, 3)
    assert key == "fp8/E8/H256/I128/k2/T4"
    table = mt.MoeConfig(32, False, mt.GemmConfig(128), mt.GemmConfig(32, split_k=2))
    cached = mt.MoeConfig(16, True, mt.GemmConfig(64), mt.GemmConfig(64))
    monkeypatch.setattr(mt, "cache_path", lambda: tmp_path / "fused_moe.json")
    monkeypatch.setattr(mt, "_CACHE", None)
    monkeypatch.setitem(mt.TUNED, key, table.to_dict())
    cpu = torch.device("cpu")
    mt.get_config.cache_clear()
    assert mt.get_config(q, 8, 256, 128, 2, 3, True, cpu) == mt.normalize_config(table, q, True)
    (tmp_path / "fused_moe.json").write_text(json.dumps({"interpreter": {key: cached.to_dict()}}))
    monkeypatch.setattr(mt, "_CACHE", None)
    mt.get_config.cache_clear()
    assert mt.get_config(q, 8, 256, 128, 2, 3, True, cpu) == cached
    monkeypatch.setitem(mt.TUNED, key, None)
    (tmp_path / "fused_moe.json").write_text("{}")
    monkeypatch.setattr(mt, "_CACHE", None)
    mt.get_config.cache_clear()
    assert mt.get_config(q, 8, 256, 128, 2, 3, True, cpu) == mt.normalize_config(
        mt.default_config(q, 8, 256, 128, 2, 3), q, True)
    mt.get_config.cache_clear()


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UnsupportedError, match="CUDA GPU"):
        mt.tune(8, 256, 128, 2, 4, SCHEMES["fp8_tensor_static"])


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
    call = (args["x"], args["topk_ids"], args["topk_weights"], args["w13"], args["w2"], args["w13_scale"],
            args["w2_scale"], args["a13_scale"], args["a2_scale"], args["scheme"], "silu", False, "reference")
    opcheck(torch.ops.qcompile.fused_moe.default, call)
    out = torch.ops.qcompile.fused_moe(*call)
    assert out.shape == args["x"].shape and out.dtype == args["x"].dtype
    assert torch.equal(out, mt.fused_moe_reference(**args))


def test_op_backends():
    args = inputs("fp8_tensor_static", t=2)
    call = [args[n] for n in ("x", "topk_ids", "topk_weights", "w13", "w2", "w13_scale", "w2_scale", "a13_scale",
                              "a2_scale", "scheme", "activation")] + [False]
    with pytest.raises(UnsupportedError, match="unknown fused_moe backend"):
        torch.ops.qcompile.fused_moe(*call, "cutlass")
    if not mk.use_triton(args["x"]):
        with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
            torch.ops.qcompile.fused_moe(*call, "triton")
    for n in ("x", "topk_ids", "topk_weights"):
        args[n] = args[n][:0]
    assert mt.fused_moe(**args).shape == (0, 256)


# -- the Triton kernels under the interpreter (subprocess: TRITON_INTERPRET is read at import) --------

INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json, os, time, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import moe_kernels as mk, moe_triton as mt
    from tests.kernels.test_moe_triton import PIPELINE_CASES, inputs, independent, compare, align_cases
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
    call = inputs("fp8_block_group", t=3)
    args = [call[n] for n in ("x", "topk_ids", "topk_weights", "w13", "w2", "w13_scale", "w2_scale", "a13_scale",
                              "a2_scale", "scheme", "activation")] + [False, "triton"]
    res["op_triton"] = bool(torch.equal(torch.ops.qcompile.fused_moe(*args), mt.fused_moe(**call)))
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
    return mt.MoeConfig(bm, per_pair, mt.GemmConfig(**g1), mt.GemmConfig(**g2), fold)


DECODE = _cfg(16, True, dict(block_n=32), dict(block_n=16, block_k=256), fold=True)  # fused quant, swap
PER_PAIR = _cfg(16, True, dict(block_n=64), dict(block_n=64))
ALIGNED = _cfg(16, False, dict(block_n=64, fuse_quant=False), dict(block_n=32, split_k=2, fuse_quant=False))
WIDE = _cfg(32, False, dict(block_n=32, swap=False), dict(block_n=64, swap=False, block_k=256))
FOLD_SPLIT = _cfg(16, False, dict(block_n=32), dict(block_n=32, split_k=2, fuse_quant=False), fold=True)
PIPELINE_CASES = {}
for _name in SCHEMES:
    PIPELINE_CASES[f"{_name}-decode-t1"] = (_name, DECODE, dict(t=1, k=2, e=8))
    PIPELINE_CASES[f"{_name}-aligned-t5"] = (_name, ALIGNED, dict(t=5, k=2, e=4))
    PIPELINE_CASES[f"{_name}-wide-t17"] = (_name, WIDE, dict(t=17, k=2, e=8, h=128))
PIPELINE_CASES.update({
    "fp8_channel_token-default-t3-k1": ("fp8_channel_token", None, dict(t=3, k=1, e=4)),
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
})


@pytest.fixture(scope="module")
def interpreter_results():
    if not mk.HAS_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
