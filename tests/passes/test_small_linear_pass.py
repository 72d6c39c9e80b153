"""The small-linear pass: the reduction equals F.linear (one rounding of fp32 products summed in fp32), the graph
rewrite (expecttest), what it leaves alone, transformers' routers under inductor, and the backend running the pass
under inductor only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import qcompile
from qcompile.passes.small_linear import MAX_M, MAX_ROW_BYTES, linear_by_reduction, rewrite_small_linears
from tests.passes.test_topk_pass import assert_left_alone, body, inductor_router, router
from tests.passes.test_topk_pass import rewritten as rewritten_by

BF16_ULP = 2.0 ** -8


def fp32_reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("dtype, u", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11),
                                      (torch.float32, 2.0 ** -24)])
@pytest.mark.parametrize("shape, n", [((1, 64), 8), ((3, 5, 96), 16), ((16, 256), 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_reduction_is_the_linear_rounded_once(dtype, u, shape, n, bias):
    """Within one rounding to x's dtype (unit roundoff ``u``) plus fp32 summation error of the exact result, the
    bound F.linear (fp32 accumulation) meets as well."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(n, shape[-1], generator=g) / 8).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got, want = linear_by_reduction(x, w, b), F.linear(x, w, b)
    exact = fp32_reference(x, w, b)
    magnitude = fp32_reference(x.abs(), w.abs(), None if b is None else b.abs())
    bound = u * exact.abs() + shape[-1] * 2.0 ** -24 * magnitude
    assert got.dtype == dtype and got.shape == want.shape
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((want.double() - exact).abs() <= bound).all()


# -- the graph rewrite --------------------------------------------------------------------------------------

def rewritten(fn, *args, dynamic=False, devices=("cpu",)):
    """The small-linear pass's :func:`tests.passes.test_topk_pass.rewritten`, without gradients (the pass
    leaves a linear that needs one alone)."""
    with torch.no_grad():
        return rewritten_by(fn, *args, dynamic=dynamic, devices=devices, rewrite=rewrite_small_linears)


def test_router_graph():
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    out, before, after = rewritten(router, x, w)
    assert_expected_inline(body(after), """\
l_x_ = L_x_
l_w_ = L_w_
linear_by_reduction = qcompile_passes_small_linear_linear_by_reduction(l_x_, l_w_);  l_x_ = l_w_ = None
probs = linear_by_reduction.softmax(-1, dtype = torch.float32);  linear_by_reduction = None
topk = torch.topk(probs, 2, dim = -1);  probs = None
top = topk[0]
ids = topk[1];  topk = None
sum_1 = top.sum(-1, keepdim = True)
truediv = top / sum_1;  top = sum_1 = None
return (truediv, ids)""")
    assert "torch._C._nn.linear" in before
    for got, want in zip(out, router(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bias_and_functional_calls_are_rewritten():
    w, b = torch.randn(8, 32), torch.randn(8)
    x = torch.randn(2, 32)
    out, before, after = rewritten(lambda x: F.linear(x, w, b) + torch.nn.functional.linear(x, w), x)
    assert after.count("linear_by_reduction(") == 2 and "_nn.linear" not in after, after
    torch.testing.assert_close(out, F.linear(x, w, b) + F.linear(x, w), rtol=1e-5, atol=1e-5)


_W = torch.randn(8, 64)
_BIG = torch.randn(MAX_ROW_BYTES // (4 * 64) + 1, 64)  # one row of x past MAX_ROW_BYTES
LEFT_ALONE = {
    "too-many-rows": (lambda x: F.linear(x, _W), torch.randn(MAX_M + 1, 64)),
    "too-many-rows-3d": (lambda x: F.linear(x, _W), torch.randn(2, MAX_M // 2 + 1, 64)),
    "too-many-bytes": (lambda x: F.linear(x, _BIG), torch.randn(1, 64)),
}


@pytest.mark.parametrize("case", LEFT_ALONE)
def test_left_alone(case):
    assert_left_alone(*LEFT_ALONE[case], "_nn.linear", rewritten)


def test_rows_times_bytes_decides():
    """M x the weight's bytes at the limit is rewritten, one row more is not."""
    n = MAX_ROW_BYTES // (4 * 64 * 4)  # M = 4 rows of an fp32 [n, 64] weight read exactly MAX_ROW_BYTES
    w = torch.randn(n, 64)
    _, _, at = rewritten(lambda x: F.linear(x, w), torch.randn(4, 64))
    _, _, over = rewritten(lambda x: F.linear(x, w), torch.randn(5, 64))
    assert "linear_by_reduction" in at and "linear_by_reduction" not in over


def test_a_linear_that_needs_a_gradient_is_left_alone():
    w = torch.randn(8, 64, requires_grad=True)
    out, before, after = rewritten_by(lambda x: F.linear(x, w), torch.randn(1, 64), rewrite=rewrite_small_linears)
    out.sum().backward()
    assert w.grad is not None and "_nn.linear" in before and before == after


def test_dynamic_shapes_are_left_alone():
    assert_left_alone(lambda x: F.linear(x, _W), torch.randn(3, 64), "_nn.linear", rewritten, dynamic=True)


def test_cpu_graphs_are_left_alone_by_default():
    """By default the pass rewrites CUDA graphs only (where the reduction was measured faster than cuBLAS)."""
    _, before, after = rewritten(lambda x: F.linear(x, _W), torch.randn(1, 64), devices=("cuda",))
    assert "_nn.linear" in before and after == before


def test_backend_runs_the_pass_under_inductor_only():
    assert any(p is rewrite_small_linears for p in qcompile.backend(inner="inductor").passes())
    assert not any(p is rewrite_small_linears for p in qcompile.backend(inner="inductor", small_linear=False).passes())
    assert not any(p is rewrite_small_linears for p in qcompile.backend(inner="aot_eager").passes())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_transformers_routers_under_inductor(arch):
    """Inductor (its CPU code generation) compiles each rewritten router: logits within one rounding of the
    eager router's (fp32 here: a few ulps), the same experts."""
    def check(code):
        assert code.count("linear_by_reduction(") == 1 and "_nn.linear" not in code, code

    (logits, _, ids), (want_logits, _, want_ids) = inductor_router(arch, rewrite_small_linears, check)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, e, h", [(1, 128, 2048), (4, 8, 4096), (16, 128, 1024)])
def test_gpu_router_logits_match_cublas(dtype, tokens, e, h):
    """Compiled by qcompile under inductor on the GPU: the router's linear is the reduction and its logits are
    cuBLAS's within one rounding (bf16) or fp32 summation-order noise."""
    graphs = []
    be = qcompile.backend(inner="inductor", on_graph=lambda before, after: graphs.append(after))
    torch._dynamo.reset()
    w = torch.randn(e, h, device="cuda", dtype=dtype) / h ** 0.5
    fn = torch.compile(lambda x: F.linear(x, w).softmax(-1, dtype=torch.float), backend=be, fullgraph=True,
                       dynamic=False)
    x = torch.randn(tokens, h, device="cuda", dtype=dtype)
    with torch.no_grad():
        got = fn(x)
        logits = torch.compile(lambda x: F.linear(x, w), backend=be, fullgraph=True, dynamic=False)(x)
    assert all("linear_by_reduction" in g for g in graphs), graphs
    want = F.linear(x, w)
    tol = dict(rtol=2 * BF16_ULP, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want, **tol)
    torch.testing.assert_close(got, want.softmax(-1, dtype=torch.float), atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=0)
