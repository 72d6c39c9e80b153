"""qcompile::int8_linear (INT8 W8A8) against the reference op, on CPU, under the Triton interpreter and on
the GPU. The int32 products are exact, so the op equals the reference up to fp32 rounding of the scales."""

from __future__ import annotations


import pytest
import torch

import qcompile  # noqa: F401  (registers the ops)
from qcompile.errors import UnsupportedError
from qcompile.kernels import fp8_quant_triton as fq
from qcompile.kernels import int8  # noqa: F401  (registers the op)
from qcompile.kernels import quant_math
from qcompile.kernels.registry import KernelQuery, select
from qcompile.scheme import ActSpec, Granularity, QDtype, QuantScheme, ScaleSpec, WeightSpec
from tests.opcheck_util import opcheck
from tests.interpreter_util import run_interpreted

ACTS = ("static_tensor", "dynamic_tensor", "dynamic_token")


def scheme(weight: str, act: str) -> QuantScheme:
    wg = Granularity.TENSOR if weight == "tensor" else Granularity.CHANNEL
    ag = Granularity.TOKEN if act == "dynamic_token" else Granularity.TENSOR
    return QuantScheme(WeightSpec(QDtype.INT8, ScaleSpec(wg)), ActSpec(QDtype.INT8, act != "static_tensor", ScaleSpec(ag)))


def case(weight, act, m=5, n=64, k=96, dtype=torch.bfloat16, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    s = w.abs().amax(1) / 127 if weight == "channel" else (w.abs().amax() / 127).reshape(())
    q = quant_math.quantize_int8(w, s if weight == "tensor" else s[:, None])
    x = (torch.randn(m, k, generator=g) * 2).to(dtype)
    xs = (x.float().abs().amax() / 100).reshape(()) if act == "static_tensor" else None  # some saturate
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    args = [x, q, s.float(), xs, b]
    return [a.to(device) if a is not None else None for a in args]


def reference(args, sch):
    x, q, s, xs, b = args
    return torch.ops.qcompile.linear_ref(x, q, s, None, None, None, xs, None, b, sch.key)


@pytest.mark.parametrize("weight", ["tensor", "channel"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference_on_cpu(weight, act, dtype):
    sch = scheme(weight, act)
    args = case(weight, act, dtype=dtype, seed=hash((weight, act)) % 1000)
    out = torch.ops.qcompile.int8_linear(*args, sch.key, "int_mm")
    want = reference(args, sch)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)  # bf16: one rounding of the output


@pytest.mark.parametrize("act", ACTS)
def test_opcheck(act):
    args = case("channel", act, m=3, n=16, k=32)
    opcheck(torch.ops.qcompile.int8_linear.default, (*args, scheme("channel", act).key, "int_mm"))


def test_rejects_what_it_cannot_run():
    args = case("channel", "static_tensor")
    with pytest.raises(UnsupportedError, match="input_scale"):
        torch.ops.qcompile.int8_linear(args[0], args[1], args[2], None, None, scheme("channel", "static_tensor").key,
                                       "int_mm")
    with pytest.raises(UnsupportedError, match="not INT8 W8A8"):
        torch.ops.qcompile.int8_linear(*args, "w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor", "int_mm")


def test_selection():
    q = KernelQuery(scheme("channel", "dynamic_token"), "cuda", (9, 0), 4096, 4096)
    assert select(q).kernel.name == "int8_int_mm"
    assert select(KernelQuery(q.scheme, "cpu", None, 4096, 4096)).kernel.name == "int8_int_mm"
    odd = select(KernelQuery(q.scheme, "cuda", (9, 0), 4100, 4096))
    assert odd.kernel.name != "int8_int_mm" and "not a multiple of 8" in odd.reason
    asym = QuantScheme(q.scheme.weight, ActSpec(QDtype.INT8, True, ScaleSpec(Granularity.TOKEN), symmetric=False))
    with pytest.raises(UnsupportedError, match="int8_int_mm: .*asymmetric activations"):
        select(KernelQuery(asym, "cpu", None, 64, 64))


INTERPRETER_SCRIPT = r"""
import json, torch
from qcompile.kernels import fp8_quant_triton as fq, quant_math as qm
g = torch.Generator().manual_seed(0)
x = torch.randn(7, 300, generator=g) * 3
x[0, :4] = torch.tensor([0.5, 1.5, -2.5, 2.5]) * (x[0].abs().amax() / 127)  # ties round to even
res = {}
q, s = fq.quantize_dynamic_token(x, int8=True)
want_s = (x.abs().amax(-1, keepdim=True) / torch.full((7, 1), 127.0)).clamp(min=fq.MIN_SCALE)
res["token"] = bool(torch.equal(s, want_s) and torch.equal(q, qm.quantize_int8(x, want_s)))
q, s = fq.quantize_dynamic_tensor(x, int8=True)
want_s = (x.abs().amax() / torch.tensor(127.0)).clamp(min=fq.MIN_SCALE)
res["tensor"] = bool(torch.equal(s, want_s) and torch.equal(q, qm.quantize_int8(x, want_s)))
q, s = fq.quantize_static_tensor(x, torch.tensor(0.01), rows=9, int8=True)
res["static"] = bool(torch.equal(q[:7], qm.quantize_int8(x, torch.tensor(0.01))) and not q[7:].any())
acc = torch.randint(-2**20, 2**20, (5, 33), generator=g, dtype=torch.int32)
r, c = torch.rand(5, generator=g), torch.rand(33, generator=g)
out = fq.scale_epilogue(acc, r, c, None, torch.float32)
res["epilogue-int32"] = bool(torch.allclose(out, acc.float() * r[:, None] * c, rtol=1e-6))
print(json.dumps(res))
"""


@pytest.mark.skipif(not fq.HAS_TRITON, reason="triton is not installed")
def test_int8_quant_kernels_under_interpreter():
    """The INT8 recipes of the Triton activation-quant kernels equal the torch reference bit for bit."""
    res = run_interpreted(INTERPRETER_SCRIPT, timeout=300)
    assert all(res.values()), res


@pytest.mark.gpu
@pytest.mark.parametrize("weight", ["tensor", "channel"])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_matches_reference(weight, act):
    """cuBLASLt int8 on the GPU vs the reference on the CPU copy: the codes and int32 sums are exact, so
    only the bf16 output rounding differs (and a code at a rounding tie, from the GPU's fp32 division)."""
    sch = scheme(weight, act)
    for i, (m, n, k) in enumerate([(1, 256, 512), (5, 4096, 4096), (17, 1024, 4096), (64, 14336, 4096),
                                   (300, 4096, 14336), (2048, 1280, 8192)]):
        args = case(weight, act, m, n, k, bias=i % 2 == 0, seed=i, device="cuda")
        out = torch.ops.qcompile.int8_linear(*args, sch.key, "int_mm").float().cpu()
        want = reference([a.cpu() if a is not None else None for a in args], sch).float()
        rel = ((out - want).norm() / want.norm()).item()
        assert rel < 4e-3, (m, n, k, rel)


@pytest.mark.gpu
def test_gpu_cuda_graph():
    sch = scheme("channel", "dynamic_token")
    args = case("channel", "dynamic_token", 4, 1024, 2048, device="cuda")
    op = lambda: torch.ops.qcompile.int8_linear(*args, sch.key, "int_mm")  # noqa: E731
    want = op()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op()
    graph.replay()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
