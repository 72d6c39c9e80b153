"""qcompile::fp8_linear: op contract, emulated math, Triton activation quant, kernel selection, GPU backends.

CPU tests run everywhere (< 60 s). ``@pytest.mark.gpu`` tests compare every recipe x backend with
the emulated backend on fresh random data and are skipped without CUDA.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from qcompile.errors import UnsupportedError
from qcompile.kernels import fp8, quant_math, registry
from qcompile.kernels import fp8_quant_triton as fq
from qcompile.kernels.registry import KernelQuery
from qcompile.scheme import NVFP4_ACT, NVFP4_WEIGHT, Granularity, QuantScheme, fp8_scheme
from tests.interpreter_util import run_interpreted

WEIGHTS = ("tensor", "channel", "block")
ACTS = ("static_tensor", "dynamic_tensor", "dynamic_token", "dynamic_group")
RECIPES = [(w, a) for w in WEIGHTS for a in ACTS]
HAS_CUDA = torch.cuda.is_available()


def _op(*args):
    return torch.ops.qcompile.fp8_linear(*args)


def make_case(weight: str, act: str, m_shape, n: int, k: int, dtype=torch.bfloat16, bias=False,
              device="cpu", seed=0):
    """Fresh random x (with a few outliers), an FP8 weight quantized as the scheme says, its scales."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    scheme = fp8_scheme(weight, act)
    x = torch.randn(*m_shape, k, generator=g) * (1 + 4 * torch.rand(*m_shape, 1, generator=g))
    x.view(-1, k)[:, :: max(1, k // 7)] *= 8  # outliers: per-token / per-group scales differ
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) / k**0.5
    gran = {"tensor": Granularity.TENSOR, "channel": Granularity.CHANNEL, "block": Granularity.BLOCK}[weight]
    wq, ws = quant_math.quantize_weight_fp8(w, gran)
    input_scale = (x.abs().amax() / 448.0 * 0.8).float() if act == "static_tensor" else None  # some clipping
    b = torch.randn(n, generator=g) if bias else None
    to = lambda t, dt=None: None if t is None else t.to(device=device, dtype=dt or t.dtype)  # noqa: E731
    return dict(x=to(x, dtype), weight=to(wq), weight_scale=to(ws), input_scale=to(input_scale),
                bias=to(b, dtype), scheme=scheme.key, w_ref=to(w))


def op_args(case, backend):
    return (case["x"], case["weight"], case["weight_scale"], case["input_scale"], case["bias"], case["scheme"],
            backend)


# -- the op contract (CPU) -----------------------------------------------------------------------

OPCHECK_VARIANTS = [  # (dtype, bias, x shape): every recipe runs all four
    (torch.bfloat16, False, (5,)),
    (torch.bfloat16, True, (2, 3)),
    (torch.float16, True, (4,)),
    (torch.float16, False, (1, 3)),
]


# opcheck's test_schema runs SchemaCheckMode, whose mutation check calls torch.allclose on every
# input, and allclose has no CPU kernel for float8_e4m3fn; the schema (no mutation, no aliasing) is
# checked by hand below instead.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _snapshot(args):
    return [a.clone().view(torch.uint8) if isinstance(a, torch.Tensor) and a.dtype == quant_math.FP8
            else a.clone() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("weight,act", RECIPES)
def test_opcheck(weight, act):
    for i, (dtype, bias, m_shape) in enumerate(OPCHECK_VARIANTS):
        case = make_case(weight, act, m_shape, 256, 256, dtype, bias, seed=i)
        args = op_args(case, "emulated")
        torch.library.opcheck(torch.ops.qcompile.fp8_linear.default, args, test_utils=OPCHECK_UTILS)
        before = _snapshot(args)
        out = _op(*args)
        assert out.shape == (*m_shape, 256) and out.dtype == dtype
        for a, b in zip(_snapshot(args), before):  # no input mutated, output aliases none
            assert a is None or (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)
        assert all(out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
                   for a in args if isinstance(a, torch.Tensor))


def _independent_reference(case) -> torch.Tensor:
    """float64: quantize x with quant_math, dequantize both operands by explicit broadcasting."""
    spec = fp8.parse_scheme_key(case["scheme"])
    k = case["x"].shape[-1]
    x2 = case["x"].reshape(-1, k)
    q, s = quant_math.quantize_activation(x2, spec.act, case["input_scale"])
    if spec.act.scale.granularity is Granularity.GROUP:
        xs = s.double().repeat_interleave(spec.act.scale.group_size, dim=1)
    else:
        xs = s.double()
    wscale = case["weight_scale"].double()
    n = case["weight"].shape[0]
    if spec.weight.scale.granularity is Granularity.BLOCK:
        ws = wscale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    elif spec.weight.scale.granularity is Granularity.CHANNEL:
        ws = wscale[:, None]
    else:
        ws = wscale
    out = (q.double() * xs) @ (case["weight"].double() * ws).t()
    if case["bias"] is not None:
        out = out + case["bias"].double()
    return out.reshape(*case["x"].shape[:-1], n)


@pytest.mark.parametrize("weight,act", RECIPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_matches_independent_fp64(weight, act, dtype):
    """The emulated backend is the dequantized product in fp32. Against the same product in fp64 it
    may differ by fp32 accumulation (~1e-6 relative here) plus its one rounding to the output dtype:
    so |out - ref| <= 1 ulp of the output dtype (rtol 2^-8 bf16 / 2^-11 fp16) + 1e-5 * max|ref|."""
    for seed in range(3):
        case = make_case(weight, act, (3, 5), 384, 512, dtype, bias=seed == 1, seed=100 + seed)
        out = _op(*op_args(case, "emulated")).double()
        ref = _independent_reference(case)
        rtol = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
        tol = rtol * ref.abs() + 1e-5 * ref.abs().max()
        assert ((out - ref).abs() <= tol).all(), (out - ref).abs().max()
        # and the quantization is sane: close to the unquantized bf16 linear (SQNR > 20 dB)
        exact = case["x"].double() @ case["w_ref"].double().t()
        if case["bias"] is not None:
            exact = exact + case["bias"].double()
        sqnr = 10 * torch.log10(exact.pow(2).sum() / (out - exact).pow(2).sum())
        assert sqnr > 20, f"SQNR {sqnr:.1f} dB"


def test_op_rejects_what_it_cannot_run():
    case = make_case("tensor", "dynamic_token", (2,), 64, 64)
    args = list(op_args(case, "emulated"))
    for bad_scheme, msg in [
        (fp8_scheme("channel", None).key, "weight-only"),
        (QuantScheme(NVFP4_WEIGHT, NVFP4_ACT).key, "not FP8 W8A8"),
    ]:
        with pytest.raises(UnsupportedError, match=msg):
            _op(*args[:5], bad_scheme, "emulated")
    with pytest.raises(UnsupportedError, match="unknown fp8_linear backend"):
        _op(*args[:6], "cutlass")
    with pytest.raises(UnsupportedError, match="needs CUDA tensors"):
        _op(*args[:6], "scaled_mm")
    with pytest.raises(UnsupportedError, match="weight_scale has shape"):
        _op(args[0], args[1], torch.ones(3), *args[3:])
    static = make_case("tensor", "static_tensor", (2,), 64, 64)
    with pytest.raises(UnsupportedError, match="input_scale is None"):
        _op(static["x"], static["weight"], static["weight_scale"], None, None, static["scheme"], "emulated")


def test_empty_batch():
    case = make_case("channel", "dynamic_token", (0,), 64, 128)
    assert _op(*op_args(case, "emulated")).shape == (0, 64)


SCALED_MM_RECIPES = [r for r in RECIPES if r[0] == "block" or r[1] != "dynamic_group"]


def _fake_block_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
    """F.scaled_mm's 1x128 x 128x128 contract (sm_90 only), in fp32, checking the scale layouts."""
    assert (recipe_a, recipe_b) == (torch.nn.functional.ScalingType.BlockWise1x128,
                                    torch.nn.functional.ScalingType.BlockWise128x128)
    (m, k), n = a.shape, b.shape[1]
    assert b.stride() == (1, k), "mat_b must be column-major"
    assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    kp = -(-k // 512) * 4  # torch 2.11: K/128 rounded up to a multiple of 4
    assert scale_b.shape == (kp, n // 128) and scale_b.stride() == (1, kp), (scale_b.shape, scale_b.stride())
    sa = scale_a.repeat_interleave(128, 1)
    sb = scale_b[: k // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return ((a.float() * sa) @ (b.float() * sb)).to(output_dtype)


@pytest.mark.parametrize("weight,act", SCALED_MM_RECIPES)
def test_scaled_mm_dispatch_on_cpu(weight, act, monkeypatch):
    """The scaled_mm backend's recipe logic (scale layouts, RowWise vs TensorWise+epilogue, block row
    padding, bias) on CPU: torch._scaled_mm has a CPU kernel for TensorWise / RowWise, the block
    recipe is faked with its documented layout contract. Same codes and scales as emulated, so
    agreement to one bf16 ulp (rtol 2^-7: both round fp32 values that differ by accumulation
    order, and may land on either side of a rounding boundary) + 1e-5 * max|emu|."""
    monkeypatch.setattr(fp8, "_require_cuda", lambda *a: None)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _fake_block_scaled_mm)
    for threshold in (0, 1 << 30):  # always RowWise / always TensorWise + epilogue
        monkeypatch.setattr(fp8, "ROWWISE_MIN_M", threshold)
        for i, (m, k) in enumerate(((1, 512), (7, 384), (80, 640), (100, 512))):
            case = make_case(weight, act, (m,), 256, k, torch.bfloat16, bias=i != 1, seed=i)
            emu = _op(*op_args(case, "emulated")).float()
            try:
                out = _op(*op_args(case, "scaled_mm")).float()
            except (RuntimeError, NotImplementedError) as e:  # a CPU build without fp8 _scaled_mm
                pytest.skip(f"torch._scaled_mm on CPU: {e}")
            assert out.shape == (m, 256)
            assert ((out - emu).abs() <= 2.0**-7 * emu.abs() + 1e-5 * emu.abs().max()).all()
    if act == "dynamic_group":
        return
    with pytest.raises(UnsupportedError, match="no recipe"):
        case = make_case("channel", "dynamic_group", (2,), 256, 512)
        _op(*op_args(case, "scaled_mm"))


def test_torch_fallback_layouts_match_triton_contract():
    """Without Triton (CPU, no interpreter) the quant functions return the same values and layouts."""
    if fq.use_triton(torch.empty(1)):
        pytest.skip("TRITON_INTERPRET is set in this process")
    x = torch.randn(3, 256).bfloat16()
    q, s = fq.quantize_dynamic_group(x, 128, rows=8)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    qr, sr = quant_math.quantize_activation(x, fp8_scheme("block", "dynamic_group").act)
    assert torch.equal(q[:3].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:3], sr)
    assert torch.equal(q[3:].float(), torch.zeros(5, 256))
    q, s = fq.quantize_dynamic_token(x)
    assert s.shape == (3, 1)
    x = torch.randn(3, 320).bfloat16()  # a partial last group of 64 columns
    q, s = fq.quantize_dynamic_group(x, 128, rows=4)
    qr, sr = quant_math.quantize_activation(x, fp8_scheme("block", "dynamic_group").act)
    assert q.shape == (4, 320) and s.shape == (4, 3) and s.stride() == (1, 4)
    assert torch.equal(q[:3].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:3], sr)


# -- Triton activation quant under the interpreter (subprocess: TRITON_INTERPRET is read at import) --

INTERPRETER_SCRIPT = textwrap.dedent(r"""
    import json, os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from qcompile.kernels import fp8_quant_triton as fq, quant_math as qm
    from qcompile.scheme import Granularity, fp8_scheme
    assert fq.HAS_TRITON and fq.use_triton(torch.empty(1)), "interpreter not active"
    torch.manual_seed(0)
    same = lambda a, b: torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    res = {}
    for dt in (torch.bfloat16, torch.float16):
        for m, k in ((1, 128), (5, 384), (3, 2176), (2, 320)):  # 320: a partial last 1x128 group
            x = (torch.randn(m, k) * torch.rand(m, 1) * 10)
            x[0, :4] = torch.tensor([0.0, -0.0, 3e-4, -1e-6])
            x = x.to(dt)
            tag = f"{dt}-{m}x{k}"
            q, s = fq.quantize_dynamic_token(x)
            sr = qm.dynamic_fp8_scale(x, Granularity.TOKEN)
            res[f"token-{tag}"] = same(q, qm.quantize_fp8(x, sr)) and torch.equal(s, sr)
            q, s = fq.quantize_dynamic_tensor(x)
            sr = qm.dynamic_fp8_scale(x, Granularity.TENSOR)
            res[f"tensor-{tag}"] = same(q, qm.quantize_fp8(x, sr)) and torch.equal(s, sr)
            st = torch.tensor(0.0123)
            q, s = fq.quantize_static_tensor(x, st, rows=m + 3)
            res[f"static-{tag}"] = same(q[:m], qm.quantize_fp8(x, st)) and bool((q[m:].float() == 0).all())
            q, s = fq.quantize_dynamic_group(x, 128, rows=m + 3)
            qr, sr = qm.quantize_activation(x, fp8_scheme("block", "dynamic_group").act)
            res[f"group-{tag}"] = (same(q[:m], qr) and torch.equal(s[:m], sr) and s.stride() == (1, m + 3)
                                   and bool((q[m:].float() == 0).all()))
            acc = torch.randn(m, 200) * 100
            rs, cs, b = torch.rand(m, 1), torch.rand(200), torch.randn(200).to(dt)
            out = fq.scale_epilogue(acc, rs, cs, b, dt).float()
            ref = (acc * rs * cs + b.float())
            ulp = torch.finfo(dt).eps * ref.abs().clamp(min=torch.finfo(dt).tiny)  # interpreter truncates to bf16
            res[f"epilogue-{tag}"] = bool(((out - ref).abs() <= ulp).all())
    # every e4m3 code, the midpoints between neighbours (ties to even) and values just around them
    codes = torch.arange(256, dtype=torch.uint8).view(qm.FP8).float()
    v = codes[~codes.isnan()].sort().values
    mid = (v[1:] + v[:-1]) / 2
    allv = torch.cat([v, mid, mid.nextafter(mid + 1), mid.nextafter(mid - 1), torch.rand(60) * 0.02])
    allv = allv[: allv.numel() // 16 * 16].reshape(1, -1).contiguous()
    q, _ = fq.quantize_static_tensor(allv, torch.tensor(1.0))
    res["every-e4m3-code-and-tie"] = same(q, qm.quantize_fp8(allv, torch.tensor(1.0)))
    print(json.dumps(res))
""")


@pytest.mark.skipif(not fq.HAS_TRITON, reason="triton is not installed")
def test_triton_quant_kernels_under_interpreter():
    """Each Triton kernel (interpreter, bit-level e4m3 encode) vs the torch reference: scales and fp8
    bytes equal exactly; the epilogue to 1 ulp (the interpreter truncates fp32 -> bf16)."""
    res = run_interpreted(INTERPRETER_SCRIPT, timeout=300)
    failed = [name for name, ok in res.items() if not ok]
    assert not failed, failed


# -- kernel selection ----------------------------------------------------------------------------

def _query(weight, act, capability, n=4096, k=4096, compiler="inductor"):
    return KernelQuery(fp8_scheme(weight, act), "cpu" if capability is None else "cuda", capability, n, k,
                       compiler=compiler)


def _fast(weight, act, compiler):
    """The CUDA kernel of a recipe: the in-graph ops under inductor for tensor / channel weights with tensor /
    token activations, else scaled_mm."""
    in_graph = compiler == "inductor" and weight != "block" and act != "dynamic_group"
    return "fp8_inductor" if in_graph else "fp8_scaled_mm"


EXPECTED_SELECTION = {
    # capability: {(weight, act): kernel}; anything not listed -> _fast(weight, act, compiler)
    (9, 0): {("tensor", "dynamic_group"): "fp8_emulated", ("channel", "dynamic_group"): "fp8_emulated"},
    (10, 0): {("tensor", "dynamic_group"): "fp8_emulated", ("channel", "dynamic_group"): "fp8_emulated",
              **{("block", a): "fp8_emulated" for a in ACTS}},
    (8, 0): {r: "fp8_emulated" for r in RECIPES},
    None: {r: "fp8_emulated" for r in RECIPES},
}


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (8, 0), None], ids=str)
def test_selection_by_capability(capability, compiler, monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "flashinfer", False)
    for weight, act in RECIPES:
        sel = registry.select(_query(weight, act, capability, compiler=compiler))
        want = EXPECTED_SELECTION[capability].get((weight, act), _fast(weight, act, compiler))
        assert sel.kernel.name == want, (weight, act, sel.kernel.name, sel.reason)
        reasons = dict(sel.rejected)
        if want == "fp8_scaled_mm" and weight != "block":
            assert reasons["fp8_inductor"] == ('needs inductor as the inner compiler (its graph ops fuse there: '
                                               'backend(inner="inductor")), have aot_eager')
        if want == "fp8_emulated":
            assert reasons["fp8_flashinfer"] == "flashinfer is not installed"
            why = reasons["fp8_scaled_mm"]
            if capability is None:
                assert why == "needs a CUDA device, have cpu"
                if weight != "block" and act != "dynamic_group":  # the device is the reason, whatever the compiler
                    assert reasons["fp8_inductor"] == why
            elif capability == (8, 0):
                assert why == "needs compute capability >= 8.9, have 8.0"
            elif weight == "block":
                assert why.startswith("needs compute capability 9.x for block FP8") and why.endswith("have 10.0")
            else:
                assert why.startswith("needs block weights for 1x128-group activations")


def test_selection_reasons_and_flashinfer(monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "flashinfer", True)
    k_fi = registry.kernels()
    names = [k.name for k in k_fi]
    assert names.index("fp8_inductor") < names.index("fp8_scaled_mm") < names.index("fp8_flashinfer") \
        < names.index("fp8_emulated") < names.index("reference")
    # flashinfer importable: still below scaled_mm, but runs per-tensor when forced
    q = _query("tensor", "static_tensor", (9, 0))
    assert registry.select(q).kernel.name == "fp8_inductor"
    assert registry.select(_query("tensor", "static_tensor", (9, 0), compiler="eager")).kernel.name == "fp8_scaled_mm"
    assert registry.select(q, override="fp8_flashinfer").kernel.name == "fp8_flashinfer"
    with pytest.raises(UnsupportedError, match="needs per-tensor weight and activation scales"):
        registry.select(_query("channel", "dynamic_token", (9, 0)), override="fp8_flashinfer")
    assert fp8.check_flashinfer(_query("tensor", "dynamic_tensor", (8, 0))) == \
        "needs compute capability >= 8.9, have 8.0"
    # shape limits and non-FP8 schemes
    assert fp8.check_scaled_mm(_query("tensor", "dynamic_token", (9, 0), n=100)) == "N=100 not a multiple of 16"
    assert fp8.check_scaled_mm(_query("block", "dynamic_group", (9, 0), n=4096 + 16)) == \
        "N=4112, K=4096 not multiples of 128 (block scales)"
    nvfp4 = KernelQuery(QuantScheme(NVFP4_WEIGHT, NVFP4_ACT), "cuda", (10, 0), 4096, 4096)
    for check in (fp8.check_scaled_mm, fp8.check_flashinfer, fp8.check_emulated):
        assert check(nvfp4).startswith(f"scheme {nvfp4.scheme.key} is not FP8 W8A8")
    weight_only = _query("channel", None, (9, 0))
    assert fp8.check_emulated(weight_only).endswith("activations are not quantized (weight-only)")
    assert registry.select(weight_only).kernel.name == "reference"
    fp8_89 = registry.select(_query("channel", "dynamic_token", (8, 9)))
    assert fp8_89.kernel.name == "fp8_inductor"


# -- GPU: every recipe x backend vs emulated -----------------------------------------------------

GPU_MS = (1, 7, 16, 128, 300)
GPU_NK = ((256, 512), (8192, 8192), (256, 384))  # K=384: 3 k-blocks, the padded block scale_b
_WEIGHT_CACHE: dict = {}


def _gpu_case(weight, act, m, n, k, dtype, bias, seed):
    """Like make_case, on CUDA; the (expensive at 8192^2) weight is quantized once per granularity."""
    key = (weight, n, k)
    if key not in _WEIGHT_CACHE:
        g = torch.Generator(device="cuda").manual_seed(1234 + n)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        gran = {"tensor": Granularity.TENSOR, "channel": Granularity.CHANNEL, "block": Granularity.BLOCK}[weight]
        _WEIGHT_CACHE[key] = quant_math.quantize_weight_fp8(w * torch.rand(n, 1, device="cuda", generator=g), gran)
    wq, ws = _WEIGHT_CACHE[key]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * (1 + 4 * torch.rand(m, 1, device="cuda", generator=g))
    x[:, :: max(1, k // 7)] *= 8
    input_scale = (x.abs().amax() / 448.0 * 0.8).float() if act == "static_tensor" else None
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return dict(x=x.to(dtype), weight=wq, weight_scale=ws, input_scale=input_scale, bias=b,
                scheme=fp8_scheme(weight, act).key)


def _reference_on_gpu(case) -> torch.Tensor:
    """The emulated math, with the activation quantized on the CPU. The kernels divide exactly (div_rn);
    so does quant_math (``amax`` divided by a tensor: a Python scalar divisor becomes a multiply by its
    reciprocal on CUDA, 1 ulp off for about half the scales, flipping ~0.07% of the fp8 codes of bf16
    data). Quantizing on the CPU keeps the reference independent of torch's CUDA kernels."""
    spec = fp8.parse_scheme_key(case["scheme"])
    x = case["x"]
    in_s = None if case["input_scale"] is None else case["input_scale"].cpu()
    q, s = quant_math.quantize_activation(x.cpu(), spec.act, in_s)
    xf = quant_math.dequantize_activation(q, s, spec.act).to(x.device)
    out = xf @ quant_math.dequantize_weight(case["weight"], case["weight_scale"], spec.weight).t()
    if case["bias"] is not None:
        out = out + case["bias"].float()
    return out.to(x.dtype)


def _backend_reason(backend, weight, act, n, k, dtype):
    kernel = {"scaled_mm": fp8.FP8_SCALED_MM, "flashinfer": fp8.FP8_FLASHINFER}[backend]
    q = KernelQuery(fp8_scheme(weight, act), "cuda", torch.cuda.get_device_capability(), n, k, dtype)
    return kernel.reason_not(q)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k", GPU_NK, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", ["scaled_mm", "flashinfer"])
@pytest.mark.parametrize("weight,act", RECIPES)
def test_gpu_backend_matches_emulated(weight, act, backend, n, k):
    """Against the emulated math (activation quantized on the CPU, see _reference_on_gpu). Both
    sides multiply the same fp8 codes and scales (activation quant is bit-exact, tested below), so
    they differ only in fp32 accumulation order / per-block scaling inside the GEMM and in
    the final rounding: per output, |out - emu| <= 1 ulp of the output dtype (rtol 2^-7 bf16, 2^-10
    fp16: both round, possibly to either side of a boundary) + 1e-3 * max|emu| (outputs near zero
    keep the absolute accumulation error of K = 8192 products; Hopper's FP8 tensor cores accumulate
    with ~14-bit mantissas between promotions, ~1e-4 of the output scale; a wrong scale or layout
    errs by O(1)); and normwise ||out - emu|| / ||emu|| < 4e-3 (bf16) / 1e-3 (fp16)."""
    for dtype in (torch.bfloat16, torch.float16):
        why = _backend_reason(backend, weight, act, n, k, dtype)
        if why:
            pytest.skip(why)
        for i, m in enumerate(GPU_MS):
            case = _gpu_case(weight, act, m, n, k, dtype, bias=i % 2 == 1, seed=i)
            out = _op(*op_args(case, backend)).float()
            emu = _reference_on_gpu(case).float()
            assert out.shape == (m, n) and bool(torch.isfinite(out).all())
            emu_op = _op(*op_args(case, "emulated")).float()  # the op on CUDA: a few codes differ
            assert ((emu_op - emu).norm() / emu.norm()).item() < 2e-2
            rtol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
            tol = rtol * emu.abs() + 1e-3 * emu.abs().max()
            if backend == "flashinfer" and case["bias"] is not None:  # bmm_fp8 rounds before the bias add
                tol = tol + rtol * (emu - case["bias"].float()).abs()
            worst = ((out - emu).abs() - tol).max().item()
            assert worst <= 0, f"{backend} {weight}x{act} M={m} {dtype}: exceeds tolerance by {worst:.3g}"
            rel = ((out - emu).norm() / emu.norm()).item()
            assert rel < (4e-3 if dtype == torch.bfloat16 else 1e-3), rel


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("native", [True, False], ids=["native-cvt", "bit-encode"])
def test_gpu_triton_quant_bit_exact(native):
    """Triton on the GPU vs quant_math on the CPU copy (IEEE division; see _reference_on_gpu)."""
    torch.manual_seed(0)
    same = lambda a, b: torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))  # noqa: E731
    eq = lambda a, b: torch.equal(a.cpu(), b)  # noqa: E731
    bad = []
    for dt in (torch.bfloat16, torch.float16):
        for m, k in ((1, 8192), (7, 384), (300, 4096), (64, 28672)):
            x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 30).to(dt)
            xc = x.cpu()
            tag = f"{dt} {m}x{k}"
            q, s = fq.quantize_dynamic_token(x, native=native)
            sr = quant_math.dynamic_fp8_scale(xc, Granularity.TOKEN)
            if not (same(q, quant_math.quantize_fp8(xc, sr)) and eq(s, sr)):
                bad.append(f"token {tag}")
            q, s = fq.quantize_dynamic_tensor(x, native=native)
            sr = quant_math.dynamic_fp8_scale(xc, Granularity.TENSOR)
            if not (same(q, quant_math.quantize_fp8(xc, sr)) and eq(s, sr)):
                bad.append(f"tensor {tag}")
            st = torch.tensor(0.02)
            q, _ = fq.quantize_static_tensor(x, st.cuda(), rows=m + 1, native=native)
            if not (same(q[:m], quant_math.quantize_fp8(xc, st)) and bool((q[m:].float() == 0).all())):
                bad.append(f"static {tag}")
            q, s = fq.quantize_dynamic_group(x, 128, rows=m + 1, native=native)
            qr, sr = quant_math.quantize_activation(xc, fp8_scheme("block", "dynamic_group").act)
            if not (same(q[:m], qr) and eq(s[:m], sr) and s.stride() == (1, m + 1)):
                bad.append(f"group {tag}")
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_and_compile():
    """The scaled_mm paths capture into a CUDA graph and trace under torch.compile (fullgraph)."""
    for weight, act, m in (("channel", "dynamic_token", 1), ("channel", "dynamic_token", 256),
                           ("block", "dynamic_group", 1), ("tensor", "dynamic_tensor", 16)):
        case = _gpu_case(weight, act, m, 256, 512, torch.bfloat16, bias=True, seed=7)
        args = op_args(case, "scaled_mm")
        eager = _op(*args)
        _op(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _op(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        compiled = torch.compile(lambda *a: _op(*a), fullgraph=True)(*args)
        assert torch.equal(compiled, eager)
