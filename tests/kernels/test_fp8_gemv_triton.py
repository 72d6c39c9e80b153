"""fp8_gemv_triton: the one-launch small-M FP8 W8A8 kernel against quant_math.reference_linear, under the
Triton interpreter (CPU) and on the GPU; its route inside ``qcompile::fp8_linear`` (backend scaled_mm).

Tolerances. The kernel multiplies the same e4m3 codes and scales as the reference (products of two codes are
exact in fp32), so it differs only in fp32 summation order and the final rounding: with fp32 output,
normwise ``||out - ref|| / ||ref|| <= 1e-5``; in bf16 / fp16, per element ``|out - ref| <= 1 ulp of the output
dtype at |ref| + 1e-5 max|ref|`` (both round fp32 sums that differ by summation order, possibly to either
side of a boundary; the interpreter truncates instead of rounding; the absolute term covers outputs near 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qcompile.errors import UnsupportedError
from qcompile.kernels import fp8, quant_math
from qcompile.kernels import fp8_gemv_triton as fg
from qcompile.kernels import fp8_quant_triton as fq
from qcompile.scheme import Granularity, fp8_scheme

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
WEIGHTS = ("tensor", "channel", "block")
ACTS = ("static_tensor", "dynamic_tensor", "dynamic_token")
RECIPES = [(w, a) for w in WEIGHTS for a in ACTS] + [("block", "dynamic_group")]
CONFIGS = (  # launch parameters the interpreter checks run (None: default_config)
    {},
    dict(use_dot=False, block_n=8, block_k=128),
    dict(use_dot=True, block_n=16, block_k=128, num_warps=2),
    dict(use_dot=False, block_n=4, block_k=256, split_k=2),
    dict(use_dot=True, block_n=32, block_k=256, split_k=3),
)
NORM_RTOL = 1e-5


def make_case(weight: str, act: str, m: int, n: int, k: int, dtype=torch.bfloat16, bias=False, seed=0,
              device="cpu") -> dict:
    """Fresh random x (outliers every k/7 columns, rows of different magnitude), a weight quantized as the
    scheme says (block weights padded to whole 128-row / 128-column blocks for the quantizer, then cut to
    [n, k]: partial edge blocks), its scales, a static scale that clips a little."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) * (1 + 4 * torch.rand(m, 1, generator=g, device=device))
    x[:, :: max(1, k // 7)] *= 8
    gran = Granularity(weight)
    if gran is Granularity.BLOCK:
        wn, wk = -(-n // 128) * 128, -(-k // 128) * 128
    else:
        wn, wk = n, k
    w = torch.randn(wn, wk, generator=g, device=device) * torch.rand(wn, 1, generator=g, device=device) / k**0.5
    wq, ws = quant_math.quantize_weight_fp8(w, gran)
    input_scale = (x.abs().amax() / 448.0 * 0.8).float() if act == "static_tensor" else None
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return dict(x=x.to(dtype), weight=wq[:n, :k].contiguous(), weight_scale=ws, input_scale=input_scale, bias=b,
                spec=fp8_scheme(weight, act))


def reference(case) -> torch.Tensor:
    """quant_math.reference_linear in fp32 (before the output cast)."""
    return quant_math.reference_linear(case["x"], case["spec"], case["weight"], case["weight_scale"],
                                       input_scale=case["input_scale"], bias=case["bias"])


def gemv(case, out_dtype=None, **cfg) -> torch.Tensor:
    return fg.fp8_gemv(case["x"], case["weight"], case["weight_scale"], case["input_scale"], case["bias"],
                       case["spec"], out_dtype, **cfg)


def mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when ``out`` is within the module's tolerance of the fp32 ``ref``, else what is wrong."""
    out = out.float()
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return f"shape {tuple(out.shape)} vs {tuple(ref.shape)} or not finite"
    rel = ((out - ref).norm() / ref.norm()).item()
    return None if rel <= NORM_RTOL else f"normwise {rel:.3g}"


def ulp_excess(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over elements of |out - ref| - (1 ulp of out's dtype at |ref| + 1e-5 max|ref|): <= 0 passes."""
    eps = torch.finfo(out.dtype).eps
    return ((out.float() - ref).abs() - (eps * ref.abs() + NORM_RTOL * ref.abs().max())).max().item()


def check(case, cfg: dict, ref: torch.Tensor | None = None) -> str | None:
    """fp32 output normwise, and the output dtype per element, against the reference."""
    ref = reference(case) if ref is None else ref
    why = mismatch(gemv(case, torch.float32, **cfg), ref)
    if why:
        return "fp32 out: " + why
    excess = ulp_excess(gemv(case, **cfg), ref)
    return None if excess <= 0 else f"{case['x'].dtype} out: exceeds one ulp by {excess:.3g}"


# -- under the interpreter (subprocess: TRITON_INTERPRET is read at import) ------------------------

def interpreter_checks() -> dict[str, str]:
    """Run in a TRITON_INTERPRET=1 process: {case: "ok" or what failed}."""
    assert fq.interpreting() and fq.use_triton(torch.empty(1)), "interpreter not active"
    res = {}
    ms = (1, 2, 3, 5, 16)
    for i, (weight, act) in enumerate(RECIPES):
        for j, m in enumerate(ms):
            cfg = CONFIGS[(i + j) % len(CONFIGS)]
            group = act == "dynamic_group"
            n = (72, 136, 40)[(i + j) % 3]  # not multiples of BLOCK_N (or of 128: a partial block row)
            k = 256 if group else (272, 144, 384)[(i + 2 * j) % 3]  # K % 128 != 0: a partial last block
            dtype = torch.bfloat16 if (i + j) % 2 else torch.float16
            case = make_case(weight, act, m, n, k, dtype, bias=j % 2 == 0, seed=1000 * i + j)
            why = check(case, cfg)
            res[f"{weight}x{act} M={m} N={n} K={k} {dtype} {cfg}"] = why or "ok"
    res.update(code_checks())
    res.update(op_route_checks())
    return res


def code_checks() -> dict[str, str]:
    """An identity weight (unit scales) makes y = q_x * s_x exactly: equal to quant_math's dequantized
    activation bit for bit, so a code or a scale one ulp off fails."""
    res = {}
    k = 256
    for act, weight in (("static_tensor", "tensor"), ("dynamic_tensor", "channel"), ("dynamic_token", "tensor"),
                        ("dynamic_group", "block")):
        case = make_case(weight, act, 3, k, k, torch.bfloat16, seed=7)
        case["weight"] = torch.eye(k).to(quant_math.FP8)
        case["weight_scale"] = torch.ones_like(case["weight_scale"])
        q, s = quant_math.quantize_activation(case["x"], case["spec"].act, case["input_scale"])
        want = quant_math.dequantize_activation(q, s, case["spec"].act)
        for dot in (False, True):
            out = gemv(case, torch.float32, use_dot=dot, block_n=16, block_k=128)
            res[f"codes {act} dot={dot}"] = "ok" if torch.equal(out, want) else \
                f"{int((out != want).sum())} of {want.numel()} values differ"
    return res


def op_route_checks() -> dict[str, str]:
    """torch.ops.qcompile.fp8_linear backend scaled_mm sends M <= GEMV_MAX_M to the kernel (CUDA is faked:
    the interpreter runs CPU tensors); GEMV_MAX_M = 0 turns the route off."""
    calls = []
    real_gemv, real_require, keep = fg.fp8_gemv, fp8._require_cuda, fp8.GEMV_MAX_M
    fg.fp8_gemv = lambda *a, **kw: calls.append(a[0].shape[0]) or real_gemv(*a, **kw)
    fp8._require_cuda = lambda *a: None
    res = {}
    try:
        for weight, act, lead in (("channel", "dynamic_token", (2,)), ("block", "dynamic_group", (1, 3))):
            case = make_case(weight, act, 1, 128, 256, torch.bfloat16, bias=True, seed=3)
            x = torch.randn(*lead, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
            args = (x, case["weight"], case["weight_scale"], case["input_scale"], case["bias"], case["spec"].key)
            emu = torch.ops.qcompile.fp8_linear(*args, "emulated").float()
            tol = 2.0**-7 * emu.abs() + NORM_RTOL * emu.abs().max()
            for limit in (16, 0):  # 0: the TensorWise GEMM + epilogue (CPU _scaled_mm; the block GEMM has none)
                if limit == 0 and weight == "block":
                    continue
                fp8.GEMV_MAX_M = limit
                out = torch.ops.qcompile.fp8_linear(*args, "scaled_mm").float()
                ok = out.shape == (*lead, 128) and bool(((out - emu).abs() <= tol).all()) and \
                    len(calls) == (1 if limit else 0)
                res[f"op route {weight}x{act} {lead} GEMV_MAX_M={limit}"] = \
                    "ok" if ok else f"calls {calls}, max diff {(out - emu).abs().max()}"
                calls.clear()
    finally:
        fg.fp8_gemv, fp8._require_cuda, fp8.GEMV_MAX_M = real_gemv, real_require, keep
    return res


@pytest.mark.skipif(not fq.HAS_TRITON, reason="triton is not installed")
def test_under_interpreter():
    """Every recipe x M in {1, 2, 3, 5, 16} x launch configurations (dot / broadcast, split-K), bf16 and fp16,
    bias or not, N and K not multiples of the blocks; the in-kernel codes; the op's route."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script = "import json; from tests.kernels.test_fp8_gemv_triton import interpreter_checks as c; print(json.dumps(c()))"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: why for name, why in res.items() if why != "ok"}
    assert len(res) == len(RECIPES) * 5 + 8 + 3 and not failed, failed


def test_launch_limits():
    """What the kernel cannot run is refused with qcompile's error before any launch (the op routes it elsewhere)."""
    case = make_case("block", "dynamic_group", 17, 128, 256)
    with pytest.raises(UnsupportedError, match="M=17 rows, more than 16"):
        gemv(case)
    case = make_case("block", "dynamic_group", 2, 128, 256)
    with pytest.raises(UnsupportedError, match="BLOCK_K a multiple of 128"):
        gemv(case, block_k=64)
    with pytest.raises(UnsupportedError, match="BLOCK_N >= 16 with tl.dot"):
        gemv(case, block_n=8, use_dot=True)


def test_default_config_rule():
    spec = fp8_scheme("tensor", "static_tensor")
    assert fg.default_config(1, 1280, 8192, spec, 132) == dict(block_n=8, block_k=512, num_warps=4, num_stages=3,
                                                                 split_k=1, use_dot=False)
    assert fg.default_config(4, 4096, 4096, spec, 132)["block_k"] == 128
    assert fg.default_config(16, 4096, 4096, spec, 132)["use_dot"]
    assert fg.reason(fp8_scheme("block", "dynamic_group")) is None


# -- GPU -------------------------------------------------------------------------------------------

GPU_SHAPES = ((4096, 4096), (1280, 8192))
GPU_CONFIGS = ({}, dict(use_dot=True, block_n=32, block_k=256), dict(use_dot=False, block_n=8, block_k=128),
               dict(use_dot=False, block_n=4, block_k=128, split_k=4))


def gpu_reference(case) -> torch.Tensor:
    """reference_linear's math on the GPU tensors with the activation quantized on the CPU: quant_math divides
    exactly there, as the kernel does (on CUDA torch may multiply by a reciprocal; see test_fp8.py)."""
    spec, x = case["spec"], case["x"]
    in_s = None if case["input_scale"] is None else case["input_scale"].cpu()
    q, s = quant_math.quantize_activation(x.cpu(), spec.act, in_s)
    xf = quant_math.dequantize_activation(q, s, spec.act).to(x.device)
    out = xf @ quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec.weight).t()
    return out + case["bias"].float() if case["bias"] is not None else out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("weight,act", RECIPES)
def test_gpu_matches_reference(weight, act):
    """Real shapes at M = 1, 4, 16, each with the default launch and a few others (native fp8 converts and
    dots), against :func:`gpu_reference`; the module's tolerances."""
    bad = []
    for n, k in GPU_SHAPES:
        for i, m in enumerate((1, 4, 16)):
            case = make_case(weight, act, m, n, k, torch.bfloat16, bias=i == 1, seed=i, device="cuda")
            ref = gpu_reference(case)
            for cfg in GPU_CONFIGS:
                why = check(case, cfg, ref)
                if why:
                    bad.append(f"{n}x{k} M={m} {cfg}: {why}")
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("weight,act", RECIPES)
def test_gpu_op_in_cuda_graph(weight, act):
    """torch.ops.qcompile.fp8_linear (scaled_mm; M <= GEMV_MAX_M runs the kernel) captured in a CUDA graph
    and replayed on new x: equal to the eager call on that x, which is within the tolerances of
    :func:`gpu_reference`."""
    from tests.gpu_util import graph_replay

    assert fp8.GEMV_MAX_M > 0
    for m in sorted({1, min(4, fp8.GEMV_MAX_M), min(16, fp8.GEMV_MAX_M)}):
        case = make_case(weight, act, m, 4096, 4096, torch.bfloat16, bias=True, seed=m, device="cuda")
        x = case["x"].clone()
        args = (x, case["weight"], case["weight_scale"], case["input_scale"], case["bias"], case["spec"].key,
                "scaled_mm")
        new_x = make_case(weight, act, m, 4096, 4096, torch.bfloat16, seed=m + 100, device="cuda")["x"]
        replayed, graph = graph_replay(lambda: torch.ops.qcompile.fp8_linear(*args), lambda: x.copy_(new_x))
        eager = torch.ops.qcompile.fp8_linear(*args)
        assert torch.equal(replayed, eager)
        case["x"] = x
        assert ulp_excess(eager, gpu_reference(case)) <= 0
