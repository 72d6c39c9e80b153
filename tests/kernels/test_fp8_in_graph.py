"""fp8_inductor: qcompile::fp8_linear_in_graph computes fp8_linear's tensor / token recipes as aten ops, and
inductor decomposes it, so the activation quantization fuses into the kernel that produces x."""

from __future__ import annotations

import re

import pytest
import torch

import qcompile
from qcompile.kernels import fp8  # noqa: F401  (registers the ops)
from qcompile.kernels.registry import KernelQuery, select
from qcompile.scheme import fp8_scheme
from tests.kernels.test_reference import make_args
from tests.opcheck_util import opcheck

RECIPES = [("tensor", "static_tensor"), ("tensor", "dynamic_tensor"), ("channel", "dynamic_token"),
           ("channel", "static_tensor"), ("tensor", "dynamic_token")]


@pytest.mark.parametrize("weight,act", RECIPES)
@pytest.mark.parametrize("m", [3, 130])  # both sides of the small-M epilogue
def test_matches_emulated(weight, act, m):
    """fp32 x: the same fp8 codes and scales as the emulated kernel; only the GEMM's summation order differs."""
    sch = fp8_scheme(weight, act)
    x, q, s, xs, b, _ = make_args(sch, m=m, dtype=torch.float32)
    got = torch.ops.qcompile.fp8_linear_in_graph(x, q, s, xs, b, sch.key)
    want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight,act", RECIPES[:3])
def test_opcheck(weight, act):
    sch = fp8_scheme(weight, act)
    x, q, s, xs, b, _ = make_args(sch, m=4, n=32, k=64)
    opcheck(torch.ops.qcompile.fp8_linear_in_graph.default, (x, q, s, xs, b, sch.key))


def test_selection_declines_block_recipes():
    q = KernelQuery(fp8_scheme("block", "dynamic_group"), "cuda", (9, 0), 256, 256)
    sel = select(q)
    assert sel.kernel.name != "fp8_inductor"
    with pytest.raises(qcompile.errors.UnsupportedError, match="fp8_inductor.*no block / group recipe"):
        select(q, "fp8_inductor")


def test_inductor_decomposes_the_op():
    """Under inductor the op is gone from the generated code: the activation quantization is fused into the
    RMSNorm kernel (inductor names a fused kernel after the ops it holds)."""
    from torch._inductor.utils import run_and_get_code

    sch = fp8_scheme("channel", "dynamic_token")
    x, q, s, _, b, _ = make_args(sch, m=4, n=32, k=64)
    norm_w = torch.rand(64).to(x.dtype)

    def f(x):
        h = torch.nn.functional.rms_norm(x, (64,), norm_w)
        return torch.ops.qcompile.fp8_linear_in_graph(h, q, s, None, b, sch.key)

    be = qcompile.backend()
    out, code = run_and_get_code(torch.compile(f, backend=be), x)
    text = "\n".join(code)
    assert "ops.qcompile.fp8_linear_in_graph" not in text and "_scaled_mm" in text
    fused = re.findall(r"\b(\w*fp8_linear_in_graph\w*rsqrt\w*|\w*rsqrt\w*fp8_linear_in_graph\w*)\s*=", text)
    assert fused, "the quantization did not fuse into the RMSNorm kernel"
    torch.testing.assert_close(out.float(), f(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("weight,act", RECIPES)
def test_gpu_compiled_matches_emulated(weight, act):
    """Compiled on the GPU (cuBLASLt through inductor, the quantization in inductor's kernels) vs the emulated
    math on the same device: inductor's fused division can round an fp8 code the other way where x / s sits at
    a tie (most codes of a per-tensor scale over 200 rows are small, where e4m3 steps are coarse), the rest is
    summation order. Measured on an H200: at most 1.02e-2 (dynamic per-tensor, M=200)."""
    sch = fp8_scheme(weight, act)
    for m in (1, 16, 200):
        x, q, s, xs, b, _ = (t.cuda() if t is not None else None for t in make_args(sch, m=m, n=1024, k=2048))
        f = torch.compile(lambda x: torch.ops.qcompile.fp8_linear_in_graph(x, q, s, xs, b, sch.key),
                          backend=qcompile.backend(), dynamic=False)
        got = f(x).float()
        want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated").float()
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1.5e-2, (m, rel)
