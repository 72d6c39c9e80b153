"""qcompile::fp8_gemv: the op's reference, its Triton kernel (interpreter on CPU, the GPU), and fp8_inductor's use of
it at M <= MAX_M."""

from __future__ import annotations

import os
import textwrap
from unittest import mock

import pytest
import torch

import qcompile
from qcompile.errors import UnsupportedError
from qcompile.kernels import fp8, fp8_gemv
from qcompile.scheme import fp8_scheme
from tests.interpreter_util import run_interpreted
from tests.kernels.test_reference import make_args
from tests.opcheck_util import opcheck

FP8 = torch.float8_e4m3fn


def gemv_args(m, n, k, x_vec, w_vec, bias, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    xq = (torch.randn(m, k, generator=g) * 3).to(FP8)
    w = (torch.randn(n, k, generator=g) * 3).to(FP8)
    xs = torch.rand(m if x_vec else (), generator=g) * 0.1 + 0.01
    ws = torch.rand(n if w_vec else (), generator=g) * 0.1 + 0.01
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return tuple(None if t is None else t.to(device) for t in (xq, w, xs, ws, b))


def exact(xq, w, xs, ws, b):
    """The math in float64: the products of e4m3 values and their sums are exact there."""
    acc = xq.double() @ w.double().t()
    acc = acc * (xs.double().reshape(-1, 1) if xs.dim() else xs.double()) * ws.double()
    return acc if b is None else acc + b.double()


def test_reference_is_the_exact_math_rounded_once():
    xq, w, xs, ws, b = gemv_args(3, 40, 200, True, True, True)
    got = fp8_gemv.reference(xq, w, xs, ws, b, torch.float32).double()
    want = exact(xq, w, xs, ws, b)
    assert ((got - want).abs() <= 1e-5 * want.abs().max()).all()


@pytest.mark.parametrize("x_vec,w_vec,bias", [(False, False, False), (True, True, True), (False, True, True)])
def test_opcheck(x_vec, w_vec, bias):
    opcheck(torch.ops.qcompile.fp8_gemv.default, (*gemv_args(2, 32, 64, x_vec, w_vec, bias), torch.bfloat16))


@pytest.mark.parametrize("bad,match", [
    (dict(xq=torch.zeros(2, 64)), "xq must be float8_e4m3fn"),
    (dict(w=torch.zeros(32, 48, dtype=FP8)), r"weight must be float8_e4m3fn \[N, K=64\]"),
    (dict(xs=torch.ones(3)), r"x_scale must be fp32 \[\] or \[M=2\]"),
    (dict(ws=torch.ones(32, dtype=torch.float16)), r"weight_scale must be fp32 \[\] or \[N=32\]"),
    (dict(b=torch.zeros(31)), r"bias must be \[N=32\]"),
])
def test_bad_inputs_name_the_tensor(bad, match):
    args = dict(zip(("xq", "w", "xs", "ws", "b"), gemv_args(2, 32, 64, False, False, True)))
    args.update(bad)
    with pytest.raises(UnsupportedError, match=match):
        torch.ops.qcompile.fp8_gemv(*args.values(), torch.bfloat16)


# -- the kernel under the interpreter (subprocess: TRITON_INTERPRET is read at import) --------------------------

CASES = {  # name: (m, n, k, x_vec, w_vec, bias, out dtype, launch)
    "m1-tensor": (1, 48, 256, False, False, False, "float32", None),
    "m2-channel-token-bias": (2, 40, 200, True, True, True, "float32", None),
    "m3-ragged-steps": (3, 37, 150, False, True, True, "float32", dict(block_n=8, block_k=64)),
    "m4-bf16": (4, 64, 128, True, False, False, "bfloat16", dict(block_n=32, block_k=32)),
    "m1-fp16-bias": (1, 24, 96, False, True, True, "float16", dict(block_n=16, block_k=64)),
}

INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import fp8_gemv
    from tests.kernels.test_fp8_gemv import CASES, gemv_args, exact
    res = {}
    for name, (m, n, k, xv, wv, bias, dtype, launch) in CASES.items():
        args = gemv_args(m, n, k, xv, wv, bias)
        out = fp8_gemv._triton(*args, getattr(torch, dtype), launch)
        want = exact(*args)
        res[name] = [(out.double() - want).abs().max().item(), want.abs().max().item(), list(out.shape),
                     str(out.dtype)]
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(INTERPRETER_SCRIPT, timeout=600)


@pytest.mark.parametrize("name", CASES)
def test_kernel_under_interpreter(interpreter_results, name):
    """fp32 out: the exact sum to fp32 rounding (summation order). bf16 / fp16 out: one unit in the last place of
    the largest value (the interpreter truncates where the GPU rounds)."""
    m, n, k, *_, dtype, _ = CASES[name]
    err, scale, shape, got_dtype = interpreter_results[name]
    assert shape == [m, n] and got_dtype == f"torch.{dtype}"
    ulp = {"float32": 1e-6, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}[dtype]
    assert err <= ulp * scale, (err, scale)


# -- fp8_inductor's matmul at M <= MAX_M ------------------------------------------------------------------------

RECIPES = [("tensor", "static_tensor"), ("channel", "dynamic_token"), ("tensor", "dynamic_tensor")]


@pytest.mark.parametrize("weight,act", RECIPES)
@pytest.mark.parametrize("m", [1, fp8_gemv.MAX_M])
def test_in_graph_small_m_runs_the_gemv(weight, act, m):
    """Where the kernel runs (mocked here: the op's reference on the CPU), fp8_inductor's decomposition calls
    qcompile::fp8_gemv on the quantized x, and computes what cuBLASLt's path does; gemv=False keeps
    _scaled_mm."""
    from torch.fx.experimental.proxy_tensor import make_fx

    sch = fp8_scheme(weight, act)
    x, q, s, xs, b, _ = make_args(sch, m=m, dtype=torch.float32)
    with mock.patch.object(fp8_gemv, "runs", return_value=True):
        graph = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key))(x).code
        off = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key, gemv=False))(x).code
        got = fp8._decompose(x, q, s, xs, b, sch.key)
    assert "qcompile.fp8_gemv" in graph and "_scaled_mm" not in graph
    assert "qcompile.fp8_gemv" not in off and "_scaled_mm" in off
    want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_in_graph_above_max_m_keeps_cublas():
    from torch.fx.experimental.proxy_tensor import make_fx

    sch = fp8_scheme("tensor", "static_tensor")
    x, q, s, xs, b, _ = make_args(sch, m=fp8_gemv.MAX_M + 1, dtype=torch.float32)
    with mock.patch.object(fp8_gemv, "runs", return_value=True):
        graph = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key))(x).code
    assert "qcompile.fp8_gemv" not in graph and "_scaled_mm" in graph


def test_backend_option_selects_the_decomposition():
    be_on, be_off = qcompile.backend(), qcompile.backend(fp8_gemv=False)
    assert be_on.options.fp8_gemv and not be_off.options.fp8_gemv
    op = torch.ops.qcompile.fp8_linear_in_graph.default
    assert fp8.decompositions(True)[op] is fp8._decompose
    assert fp8.decompositions(False)[op].keywords == {"gemv": False}


def test_op_backend_needs_cuda():
    sch = fp8_scheme("tensor", "static_tensor")
    x, q, s, xs, b, _ = make_args(sch, m=1)
    with pytest.raises(UnsupportedError, match="backend 'gemv' needs CUDA tensors"):
        torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "gemv")


# -- the GPU ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (1000, 1040), (4096, 14336)])
@pytest.mark.parametrize("x_vec,w_vec,bias", [(False, False, False), (True, True, True)])
def test_gpu_matches_exact_math(n, k, x_vec, w_vec, bias):
    """Fresh random codes and scales, M = 1..4: within one bf16 rounding of the exact result (the fp32 sums differ
    from float64's by their summation order only), and within the same of _scaled_mm's."""
    for m in range(1, fp8_gemv.MAX_M + 1):
        xq, w, xs, ws, b = gemv_args(m, n, k, x_vec, w_vec, bias, seed=m, device="cuda")
        got = torch.ops.qcompile.fp8_gemv(xq, w, xs, ws, b, torch.bfloat16).double()
        want = exact(xq, w, xs, ws, b)
        assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-3 * want.abs().max()).all(), m
        sm = torch._scaled_mm(xq, w.t(), torch.ones((), device="cuda"), torch.ones((), device="cuda"),
                              out_dtype=torch.float32).double()
        sm = sm * (xs.double().reshape(-1, 1) if x_vec else xs.double()) * ws.double()
        sm = sm if b is None else sm + b.double()
        assert ((got - sm).abs() <= 2.0 ** -8 * sm.abs() + 1e-3 * sm.abs().max()).all(), m


@pytest.mark.gpu
def test_gpu_compiled_decode_linear_calls_the_gemv():
    """Under qcompile's inductor at M = 1 the generated code calls the op (the quantization fused upstream), and
    not with fp8_gemv=False."""
    from torch._inductor.utils import run_and_get_code

    sch = fp8_scheme("tensor", "static_tensor")
    x, q, s, xs, b, _ = (t.cuda() for t in make_args(sch, m=1, n=1024, k=2048))

    def f(x):
        return torch.ops.qcompile.fp8_linear_in_graph(torch.nn.functional.silu(x), q, s, xs, b, sch.key)

    out, code = run_and_get_code(torch.compile(f, backend=qcompile.backend(), dynamic=False), x)
    assert "qcompile.fp8_gemv" in "\n".join(code)
    torch._dynamo.reset()
    _, code_off = run_and_get_code(torch.compile(f, backend=qcompile.backend(fp8_gemv=False), dynamic=False), x)
    assert "qcompile.fp8_gemv" not in "\n".join(code_off)
    want = torch.ops.qcompile.fp8_linear(torch.nn.functional.silu(x), q, s, xs, b, sch.key, "emulated").float()
    assert ((out.float() - want).norm() / want.norm()).item() < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("weight,act", RECIPES + [("block", "dynamic_group")])
def test_gpu_op_backend_matches_emulated(weight, act):
    """fp8_linear(backend="gemv"): the GEMV at M <= MAX_M, scaled_mm above it and for block weights; the same
    fp8 codes as the emulated kernel, so only the summation order (and the one bf16 rounding) differs."""
    sch = fp8_scheme(weight, act)
    for m in (1, 3, fp8_gemv.MAX_M + 1):
        x, q, s, xs, b, _ = (t.cuda() for t in make_args(sch, m=m, n=1024, k=2048))
        got = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "gemv").float()
        want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated").float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, m


@pytest.mark.skipif(not fp8_gemv.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("m", [1, 2, 4])
def test_kernel_compiles_for_sm90(m):
    """The GPU paths the interpreter cannot take (the native e4m3 conversion, PDL) compile for sm_90 with the op's
    launch at M rows, and with the pointers, K and the row strides multiples of 16 (as the launcher specializes
    them for K % 16 == 0): each lane reads the weight 16 bytes at a time, the K loop has no barrier, shuffle or
    shared-memory store (the partial sums stay in registers until after it), and ptxas spills nothing."""
    import re
    import subprocess
    import tempfile

    from tests.kernels.test_wo_gemm import _compile_sm90, _ptxas_available

    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend / ptxas missing")
    from triton.backends.nvidia.compiler import get_ptxas

    cfg = fp8_gemv.launch_for(m)
    m_pad = 1 << (m - 1).bit_length()
    assert fp8_gemv.acc_registers(cfg["block_n"], m_pad, cfg["block_k"], cfg["num_warps"]) <= fp8_gemv.ACC_REGISTERS
    ptrs = dict(X="*u8", W="*u8", XS="*fp32", WS="*fp32", B="*bf16", OUT="*bf16")
    kernel = _compile_sm90(fp8_gemv._gemv_kernel, ptrs, ("M", "N", "K", "stride_xm", "stride_wn", "stride_om"),
                           dict(X_VEC=m > 1, W_VEC=True, HAS_BIAS=True, M_PAD=m_pad, BLOCK_N=cfg["block_n"],
                                BLOCK_K=cfg["block_k"], NATIVE=True, PDL=True),
                           divisible=(*ptrs, "K", "stride_xm", "stride_wn"), num_warps=cfg["num_warps"],
                           num_stages=cfg["num_stages"])
    ptx = kernel.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "ld.global.b8" not in ptx
    lines = ptx.splitlines()
    head = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    back = max(i for i, line in enumerate(lines) if re.search(r"bra\s+\$L__BB0_\d+;", line))
    loop = "\n".join(lines[head:back + 1])
    assert not re.search(r"bar\.sync|shfl|st\.shared", loop)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in info, info
