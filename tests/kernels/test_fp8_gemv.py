"""qcompile::fp8_gemv: the op's reference, its Triton kernel (interpreter on CPU, the GPU), its tuning-table
choices, and fp8_inductor's use of it where a table chose it."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
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
    from tests.interpreter_util import error_record
    from tests.kernels.test_fp8_gemv import CASES, gemv_args, exact
    res = {}
    for name, (m, n, k, xv, wv, bias, dtype, launch) in CASES.items():
        args = gemv_args(m, n, k, xv, wv, bias)
        res[name] = error_record(fp8_gemv._triton(*args, getattr(torch, dtype), launch), exact(*args))
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


# -- the tuning tables' choice ------------------------------------------------------------------------------------

LAUNCH_8 = dict(block_n=8, block_k=1024, num_warps=8, num_stages=3)


@pytest.fixture
def gemv_table(tmp_path, monkeypatch):
    """A user cache (QCOMPILE_TUNE_CACHE) for a GPU named "Test GPU": the GEMV at 48x256 M=1, cuBLASLt at M=2."""
    from qcompile.kernels import cuda_driver, wo_tune

    monkeypatch.setenv("QCOMPILE_TUNE_CACHE", str(tmp_path))
    monkeypatch.setattr(cuda_driver, "device_name", lambda idx: "Test GPU")
    wo_tune.write_table(tmp_path / wo_tune.file_name("Test GPU"), "Test GPU", {
        fp8_gemv.table_key(48, 256, 1): {"route": "gemv", "launch": LAUNCH_8, "us": 5.0},
        fp8_gemv.table_key(48, 256, 2): {"route": "scaled_mm", "us": 6.0},
    })
    fp8_gemv.forget()
    yield
    fp8_gemv.forget()


def test_chosen_reads_the_table(gemv_table):
    assert fp8_gemv._chosen(0, 48, 256, 1) == LAUNCH_8
    assert fp8_gemv._chosen(0, 48, 256, 2) is None  # cuBLASLt won
    assert fp8_gemv._chosen(0, 64, 256, 1) is None  # not measured
    assert fp8_gemv.chosen(48, 256, 1, torch.zeros(1)) is None  # not a GPU tensor


def test_fingerprint_follows_the_table(gemv_table, tmp_path):
    from qcompile.kernels import wo_tune

    with mock.patch.object(fp8_gemv.cuda_driver, "device_index", return_value=0):
        before = fp8_gemv.fingerprint(torch.device("cuda"))
        assert before == fp8_gemv.fingerprint(torch.device("cuda"))
        wo_tune.store("Test GPU", fp8_gemv.table_key(64, 256, 1), wo_tune.Choice("gemv", LAUNCH_8))
        fp8_gemv.forget()
        assert fp8_gemv.fingerprint(torch.device("cuda")) != before


def test_bench_writes_the_winners(tmp_path):
    """The benchmark's table writer: the GEMV with its fastest launch where it beat _scaled_mm, else scaled_mm."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        bench = importlib.import_module("bench_fp8_gemv")
    finally:
        sys.path.pop(0)
    rows = [{"n": 48, "k": 256, "m": 1, "scaled_mm_us": 7.0, "best": "8x1024 w8 s3",
             "launches": {"8x1024 w8 s3": {"us": 6.0}, "16x512 w4 s3": {"us": 6.5}}},
            {"n": 48, "k": 256, "m": 2, "scaled_mm_us": 7.0, "best": "16x512 w4 s3",
             "launches": {"16x512 w4 s3": {"us": 7.5}}}]
    path = tmp_path / "t.json"
    bench.write_table(path, "Test GPU", rows)
    from qcompile.kernels import wo_tune

    table = wo_tune.read_table(path)
    assert table[fp8_gemv.table_key(48, 256, 1)] == wo_tune.Choice("gemv", LAUNCH_8)
    assert table[fp8_gemv.table_key(48, 256, 2)] == wo_tune.Choice("scaled_mm")


def test_shipped_gemv_entries_are_valid():
    """Every GEMV entry shipped names a launch the op takes, its partial sums within ACC_REGISTERS, faster than
    the cuBLASLt time measured beside it."""
    from qcompile.kernels import wo_tune

    for path in sorted(wo_tune.SHIPPED.glob("*.json")):
        raw = json.loads(path.read_text())["entries"]
        for key, entry in raw.items():
            if not key.startswith("fp8_gemv|") or entry["route"] != "gemv":
                continue
            launch = entry["launch"]
            assert set(launch) == set(fp8_gemv.LAUNCH), (path.name, key)
            assert fp8_gemv.acc_registers(launch["block_n"], launch["block_k"], launch["num_warps"]) \
                <= fp8_gemv.ACC_REGISTERS, (path.name, key)
            assert entry["us"] < entry["scaled_mm_us"], (path.name, key)


# -- fp8_inductor's matmul where a table chose the GEMV ----------------------------------------------------------

RECIPES = [("tensor", "static_tensor"), ("channel", "dynamic_token"), ("tensor", "dynamic_tensor")]


@pytest.mark.parametrize("weight,act", RECIPES)
@pytest.mark.parametrize("m", [1, 3])
def test_in_graph_runs_the_gemv_where_chosen(weight, act, m):
    """Where the kernel runs and a table chose it (both mocked here: the op's reference on the CPU),
    fp8_inductor's decomposition calls qcompile::fp8_gemv on the quantized x, and computes what cuBLASLt's path
    does; gemv=False keeps _scaled_mm."""
    from torch.fx.experimental.proxy_tensor import make_fx

    sch = fp8_scheme(weight, act)
    x, q, s, xs, b, _ = make_args(sch, m=m, dtype=torch.float32)
    with mock.patch.object(fp8_gemv, "runs", return_value=True), \
            mock.patch.object(fp8_gemv, "chosen", return_value=LAUNCH_8) as chosen:
        graph = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key))(x).code
        off = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key, gemv=False))(x).code
        got = fp8._decompose(x, q, s, xs, b, sch.key)
    assert chosen.call_args.args[:3] == (q.shape[0], q.shape[1], m)
    assert "qcompile.fp8_gemv" in graph and "_scaled_mm" not in graph
    assert "qcompile.fp8_gemv" not in off and "_scaled_mm" in off
    want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_in_graph_keeps_cublas_where_not_chosen():
    from torch.fx.experimental.proxy_tensor import make_fx

    sch = fp8_scheme("tensor", "static_tensor")
    x, q, s, xs, b, _ = make_args(sch, m=1, dtype=torch.float32)
    with mock.patch.object(fp8_gemv, "runs", return_value=True), mock.patch.object(fp8_gemv, "chosen",
                                                                                    return_value=None):
        graph = make_fx(lambda x: fp8._decompose(x, q, s, xs, b, sch.key))(x).code
    assert "qcompile.fp8_gemv" not in graph and "_scaled_mm" in graph


def test_backend_keys_inductor_caches_on_the_choices(monkeypatch):
    """The option and the tables decide the decomposition from outside the graph: the backend puts both into
    inductor's cache key (a post-grad pass that changes nothing but its uuid), and leaves a user's pass alone."""
    from qcompile.backend import Options, _with_decisions_keyed
    from tests.test_backend import fake_cuda_input

    x = fake_cuda_input(monkeypatch, (9, 0))

    def uuid(options, digest):
        with mock.patch.object(fp8_gemv, "fingerprint", return_value=digest):
            return _with_decisions_keyed({}, options, [x])["post_grad_custom_post_pass"].uuid()

    assert len({uuid(Options(), "a"), uuid(Options(fp8_gemv=False), "a"), uuid(Options(), "b")}) == 3
    assert _with_decisions_keyed({}, Options(), [x])["post_grad_custom_post_pass"](None) is None
    mine = object()
    assert _with_decisions_keyed({"post_grad_custom_post_pass": mine}, Options(), [x])["post_grad_custom_post_pass"] \
        is mine


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
    """Fresh random codes and scales, M = 1..3 (a row per program): within one bf16 rounding of the exact result
    (the fp32 sums differ from float64's by their summation order only), and within the same of _scaled_mm's
    (where its shapes allow: multiples of 16)."""
    for m in (1, 2, 3):
        xq, w, xs, ws, b = gemv_args(m, n, k, x_vec, w_vec, bias, seed=m, device="cuda")
        got = torch.ops.qcompile.fp8_gemv(xq, w, xs, ws, b, torch.bfloat16).double()
        want = exact(xq, w, xs, ws, b)
        assert ((got - want).abs() <= 2.0 ** -8 * want.abs() + 1e-3 * want.abs().max()).all(), m
        if n % 16 or k % 16:
            continue
        sm = torch._scaled_mm(xq, w.t(), torch.ones((), device="cuda"), torch.ones((), device="cuda"),
                              out_dtype=torch.float32).double()
        sm = sm * (xs.double().reshape(-1, 1) if x_vec else xs.double()) * ws.double()
        sm = sm if b is None else sm + b.double()
        assert ((got - sm).abs() <= 2.0 ** -8 * sm.abs() + 1e-3 * sm.abs().max()).all(), m


@pytest.mark.gpu
def test_gpu_compiled_decode_linear_calls_the_gemv(tmp_path, monkeypatch):
    """Under qcompile's inductor at M = 1, with a table entry choosing the GEMV for the shape, the generated code
    calls the op (the quantization fused upstream); not with fp8_gemv=False (a new compile: the option is in
    inductor's cache key), nor for a shape the table has no entry for."""
    from torch._inductor.utils import run_and_get_code

    from qcompile.kernels import wo_tune

    name = torch.cuda.get_device_name()
    monkeypatch.setenv("QCOMPILE_TUNE_CACHE", str(tmp_path))
    wo_tune.write_table(tmp_path / wo_tune.file_name(name), name,
                        {fp8_gemv.table_key(1024, 2048, 1): {"route": "gemv", "launch": LAUNCH_8}})
    fp8_gemv.forget()
    sch = fp8_scheme("tensor", "static_tensor")
    try:
        for n, on, expect in ((1024, True, True), (1024, False, False), (2048, True, False)):
            x, q, s, xs, b, _ = (t.cuda() for t in make_args(sch, m=1, n=n, k=2048))

            def f(x):
                return torch.ops.qcompile.fp8_linear_in_graph(torch.nn.functional.silu(x), q, s, xs, b, sch.key)

            torch._dynamo.reset()
            out, code = run_and_get_code(torch.compile(f, backend=qcompile.backend(fp8_gemv=on), dynamic=False), x)
            assert ("qcompile.fp8_gemv" in "\n".join(code)) == expect, (n, on)
            want = torch.ops.qcompile.fp8_linear(torch.nn.functional.silu(x), q, s, xs, b, sch.key,
                                                 "emulated").float()
            assert ((out.float() - want).norm() / want.norm()).item() < 1.5e-2
    finally:
        fp8_gemv.forget()


@pytest.mark.gpu
@pytest.mark.parametrize("weight,act", RECIPES + [("block", "dynamic_group")])
def test_gpu_op_backend_matches_emulated(weight, act):
    """fp8_linear(backend="gemv"): the GEMV at M <= MAX_M, scaled_mm above it and for block weights; the same
    fp8 codes as the emulated kernel, so only the summation order (and the one bf16 rounding) differs."""
    sch = fp8_scheme(weight, act)
    for m in (1, fp8_gemv.MAX_M + 1):
        x, q, s, xs, b, _ = (None if t is None else t.cuda() for t in make_args(sch, m=m, n=1024, k=2048))
        got = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "gemv").float()
        want = torch.ops.qcompile.fp8_linear(x, q, s, xs, b, sch.key, "emulated").float()
        assert ((got - want).norm() / want.norm()).item() < 1e-2, m


def _launches() -> list[dict]:
    """The default launch and every launch a shipped table names."""
    from qcompile.kernels import wo_tune

    out = [fp8_gemv.LAUNCH]
    for path in sorted(wo_tune.SHIPPED.glob("*.json")):
        for key, entry in json.loads(path.read_text())["entries"].items():
            if key.startswith("fp8_gemv|") and entry["route"] == "gemv" and entry["launch"] not in out:
                out.append(entry["launch"])
    return out


@pytest.mark.skipif(not fp8_gemv.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("launch", _launches(), ids=lambda c: "{block_n}x{block_k}w{num_warps}s{num_stages}".format(**c))
def test_kernel_compiles_for_sm90(launch):
    """The GPU paths the interpreter cannot take (the native e4m3 conversion, PDL) compile for sm_90 at each
    launch the op may take, with the pointers, K and the row strides multiples of 16 (as the launcher specializes
    them for K % 16 == 0): each lane reads the weight 16 bytes at a time, the K loop has no barrier, shuffle or
    shared-memory store (the partial sums stay in registers until after it), and ptxas spills nothing."""
    import re
    import subprocess
    import tempfile

    from tests.kernels.test_wo_gemm import _compile_sm90, _ptxas_available

    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend / ptxas missing")
    from triton.backends.nvidia.compiler import get_ptxas

    assert fp8_gemv.acc_registers(launch["block_n"], launch["block_k"], launch["num_warps"]) <= fp8_gemv.ACC_REGISTERS
    ptrs = dict(X="*u8", W="*u8", XS="*fp32", WS="*fp32", B="*bf16", OUT="*bf16")
    kernel = _compile_sm90(fp8_gemv._gemv_kernel, ptrs, ("N", "K", "stride_xm", "stride_wn", "stride_om"),
                           dict(X_VEC=True, W_VEC=True, HAS_BIAS=True, BLOCK_N=launch["block_n"],
                                BLOCK_K=launch["block_k"], NATIVE=True, PDL=True),
                           divisible=(*ptrs, "K", "stride_xm", "stride_wn"), num_warps=launch["num_warps"],
                           num_stages=launch["num_stages"])
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
