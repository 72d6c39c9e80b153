"""qcompile::decode_attention: the op against SDPA (CPU), opcheck, its gradient, the Triton kernels under the
interpreter (subprocess) and compiled for sm_90, and on the GPU against SDPA in fp32 on fresh random data.

Tolerances: fp32 inputs, fp32 everywhere: 2e-6 absolute (|out| <= ~1, summation order only). fp16 / bf16: the
kernel rounds the probabilities to the input dtype for P @ V as flash kernels do; against SDPA's math on the
inputs upcast to fp32, 1 % of the output's largest value (bf16's 8 bits: ~0.4 % per rounding).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from qcompile.kernels import attention as at
from qcompile.kv_cache import dequantize_kv, quantize_kv
from tests.interpreter_util import run_interpreted

gpu = pytest.mark.gpu


def make(b=1, kvh=2, rep=4, s=200, d=64, dtype=torch.float32, mask="bool", qb=None, mb=None, seed=0,
         device="cpu"):
    """q (qb or b, kvh, rep, d), k, v (b, kvh, s, d) and a (mb or b, 1, 1, s) mask: "bool" (keys hidden at random
    and a hidden tail from s * 3 / 4 on, as an unwritten static cache), "float" (additive, the same with -inf),
    "all-hidden", or None."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(qb or b, kvh, rep, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, kvh, s, d, generator=g).to(device, dtype) for _ in range(2))
    keep = torch.rand(mb or b, 1, 1, s, generator=g) > 0.3
    keep[..., 0] = True
    keep[..., s * 3 // 4:] = False
    m = {"bool": keep, "float": torch.randn(keep.shape, generator=g).masked_fill(~keep, float("-inf")),
         "all-hidden": torch.zeros_like(keep), None: None}[mask]
    return q, k, v, None if m is None else m.to(device, dtype if m.dtype.is_floating_point else torch.bool)


def fp8_kv(k, v, per_head=True, seed=1):
    """An FP8 cache's codes and scales of ``k`` and ``v``: (k codes, v codes, k_scale, v_scale), scales fp32
    (1, kv_heads or 1, 1, 1), quantized by the cache's own quantize_kv."""
    heads = k.shape[1] if per_head else 1
    g = torch.Generator().manual_seed(seed)
    scales = [(0.5 + torch.rand(1, heads, 1, 1, generator=g)).to(k.device) * t.float().abs().amax() / 448
              for t in (k, v)]
    return quantize_kv(k, scales[0]), quantize_kv(v, scales[1]), *scales


def oracle(q, k, v, mask, scale=None, k_scale=None, v_scale=None, sinks=None):
    """SDPA's math in fp32 (on the FP8 cache's dequantized read in q's dtype, upcast); with sinks, the softmax over
    the keys and each head's sink logit, the sink's column dropped."""
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    if k_scale is not None:
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
    return at.reference(q.float(), k.float(), v.float(), m, scale, sinks=None if sinks is None else sinks.float())


def sinks_of(q, seed=2):
    """One sink logit per query head of ``q`` (b, kv_heads, rep, d), about the size of the scores."""
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(q.shape[1] * q.shape[2], generator=g)).to(q.device, q.dtype)


def tol(dtype, want):
    return 2e-6 if dtype == torch.float32 else 1e-2 * want.abs().max().item()


# -- the op on the CPU (SDPA) --------------------------------------------------------------------------------

@pytest.mark.parametrize("mask", ["bool", "float", None])
def test_op_is_sdpa_on_the_cpu(mask):
    q, k, v, m = make(mask=mask)
    torch.testing.assert_close(at.decode_attention(q, k, v, m, 0.2), oracle(q, k, v, m, 0.2), atol=2e-6, rtol=0)


@pytest.mark.parametrize("mask", ["bool", "float", "all-hidden", None])
def test_sinks_on_the_cpu(mask):
    """With sinks the op is the softmax over the keys and the head's sink logit, written out by hand here: repeated
    heads, the sink's column appended, then dropped."""
    q, k, v, m = make(mask=mask, s=40)
    s = sinks_of(q)
    b, kvh, rep, d = q.shape
    logits = q.reshape(b, kvh * rep, 1, d) @ k.repeat_interleave(rep, 1).transpose(-1, -2) * 0.2
    if m is not None:
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m
    p = torch.cat([logits, s.reshape(1, -1, 1, 1).expand(b, -1, 1, 1)], -1).softmax(-1)[..., :-1]
    want = (p @ v.repeat_interleave(rep, 1)).reshape(b, kvh, rep, d)
    torch.testing.assert_close(at.decode_attention(q, k, v, m, 0.2, None, None, s), want, atol=2e-6, rtol=0)
    if mask == "all-hidden":  # the sink takes all of each row's weight
        assert torch.equal(want, torch.zeros_like(want))


def test_opcheck():
    from tests.opcheck_util import opcheck

    q, k, v, m = make(s=16, d=8, mask="bool")
    torch.library.opcheck(at.decode_attention, (q, k, v, m, None))
    torch.library.opcheck(at.decode_attention, make(s=16, d=8, mask=None)[:3] + (None, 0.5))
    opcheck(at.decode_attention, (q, *fp8_kv(k, v)[:2], m, None, *fp8_kv(k, v)[2:]))
    torch.library.opcheck(at.decode_attention, (q, k, v, m, None, None, None, sinks_of(q)))


@pytest.mark.parametrize("per_head", [True, False])
def test_fp8_keys_and_values_are_the_caches_dequantized_read(per_head):
    q, k, v, m = make(mask="bool", dtype=torch.bfloat16)
    kq, vq, ks, vs = fp8_kv(k, v, per_head)
    want = at.reference(q, dequantize_kv(kq, ks, q.dtype), dequantize_kv(vq, vs, q.dtype), m)
    assert torch.equal(at.decode_attention(q, kq, vq, m, None, ks, vs), want)


@pytest.mark.parametrize("sinks", [False, True])
def test_gradient_is_sdpas(sinks):
    q, k, v, m = make(s=16, d=8, mask="float")
    s = sinks_of(q) if sinks else None
    ins = [t.clone().requires_grad_(True) for t in (q, k, v) + ((s,) if sinks else ())]
    at.decode_attention(*ins[:3], m, 0.3, None, None, ins[3] if sinks else None).pow(2).sum().backward()
    want = [t.clone().requires_grad_(True) for t in (q, k, v) + ((s,) if sinks else ())]
    at.reference(*want[:3], m, 0.3, sinks=want[3] if sinks else None).pow(2).sum().backward()
    for a, b in zip(ins, want):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("bad,msg", [
    (dict(k=torch.zeros(1, 3, 16, 8)), "do not share"),
    (dict(mask=torch.ones(1, 2, 1, 16, dtype=torch.bool)), "shared by all heads"),
    (dict(q=torch.zeros(2, 4, 8)), "(batch, kv_heads, rows, head_dim)"),
    (dict(k_scale=torch.ones(1, 1, 1, 1)), "take a k_scale and a v_scale"),
    (dict(k_scale=torch.ones(1, 1, 1, 1), v_scale=torch.ones(1, 1, 1, 1)), "k is float8_e4m3fn"),
    (dict(fp8=True, v_scale=torch.ones(1, 3, 1, 1)), "v_scale fp32 (1, 2 or 1, 1, 1)"),
    (dict(sinks=torch.zeros(4)), "one floating-point logit per query head, (8,)"),
])
def test_rejects_bad_shapes(bad, msg):
    q, k, v, m = make(s=16, d=8)
    kq, vq, ks, vs = fp8_kv(k, v)
    fp8 = bad.pop("fp8", False)
    args = {**dict(q=q, k=kq if fp8 else k, v=vq if fp8 else v, mask=m, k_scale=ks if fp8 else None,
                   v_scale=vs if fp8 else None, sinks=None), **bad}
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        at.decode_attention(args["q"], args["k"], args["v"], args["mask"], None, args["k_scale"], args["v_scale"],
                            args["sinks"])


# -- the Triton kernels under the interpreter (subprocess: TRITON_INTERPRET is read at import) ----------------

CASES = {  # name: make() arguments, splits (None: the op's choice)
    "bool-split4": (dict(), 4),
    "bool-one-split": (dict(), 1),
    "float-split3": (dict(mask="float"), 3),
    "no-mask-d80-rep3": (dict(mask=None, d=80, rep=3), 2),
    "all-hidden": (dict(mask="all-hidden"), 2),
    "bf16-batch-broadcast": (dict(b=2, qb=1, mb=1, dtype=torch.bfloat16), 4),
    "fp16-rep8-d128": (dict(rep=8, d=128, s=300, dtype=torch.float16), None),
    "mask-of-batch-2": (dict(b=2, kvh=1, rep=2, s=130), None),
    "most-splits": (dict(kvh=1, rep=2, s=64 * at.MAX_SPLITS + 5, d=16), 10 ** 6),
    "fp8-per-head-bf16": (dict(dtype=torch.bfloat16, fp8="head"), 3),
    "fp8-per-layer-fp32-one-split": (dict(fp8="layer"), 1),
    "sinks-bool-split4": (dict(sinks=True), 4),
    "sinks-float-one-split-bf16": (dict(mask="float", dtype=torch.bfloat16, sinks=True), 1),
    "sinks-all-hidden": (dict(mask="all-hidden", sinks=True), 2),
    "sinks-no-mask-rep3-fp8": (dict(mask=None, rep=3, fp8="head", sinks=True), 3),
}


def case_inputs(kw):
    """(q, k, v, mask, k_scale, v_scale, sinks) of a CASES entry: fp8 = "head" / "layer" for an FP8 cache's codes,
    sinks = True for one sink logit per query head."""
    kw = dict(kw)
    fp8, sinks = kw.pop("fp8", None), kw.pop("sinks", False)
    q, k, v, m = make(**kw)
    s = sinks_of(q) if sinks else None
    if fp8 is None:
        return q, k, v, m, None, None, s
    kq, vq, ks, vs = fp8_kv(k, v, fp8 == "head")
    return q, kq, vq, m, ks, vs, s

INTERPRETER_SCRIPT = textwrap.dedent("""
    import json, os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from qcompile.kernels import attention as at
    from tests.interpreter_util import error_record
    from tests.kernels.test_attention import CASES, case_inputs, oracle
    assert at.triton_reason(torch.empty(1, 1, 1, 8), torch.empty(1, 1, 1, 8), torch.empty(1, 1, 1, 8), None) is None
    res = {}
    for name, (kw, splits) in CASES.items():
        q, k, v, m, ks, vs, s = case_inputs(kw)
        out = at._triton(q, k, v, m, 0.125, splits, ks, vs, s) if splits else at.decode_attention(q, k, v, m, 0.125,
                                                                                                  ks, vs, s)
        res[name] = error_record(out, oracle(q, k, v, m, 0.125, ks, vs, s))
    print(json.dumps(res))
""")


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted(INTERPRETER_SCRIPT, timeout=600)


@pytest.mark.parametrize("name", CASES)
def test_kernels_under_interpreter(interpreter_results, name):
    err, peak, shape, dtype = interpreter_results[name]
    kw = CASES[name][0]
    q, k, v, m, ks, vs, s = case_inputs(kw)
    want = oracle(q, k, v, m, 0.125, ks, vs, s)
    assert shape == list(want.shape) and dtype == str(kw.get("dtype", torch.float32))
    assert err <= tol(kw.get("dtype", torch.float32), want), (name, err, peak)


def test_splits_fill_the_gpu():
    dev = torch.device("cpu")  # 8 "SMs" off a GPU: 32 programs wanted
    assert at.splits_for(programs=8, keys=4096, device=dev) == 4
    assert at.splits_for(programs=1, keys=4096, device=dev) == 32
    assert at.splits_for(programs=1, keys=100, device=dev) == 2  # no split without a block of keys
    assert at.splits_for(programs=256, keys=4096, device=dev) == 1
    assert at.splits_for(programs=12, keys=4096, device=dev) == 4  # three: the nearest power of two
    assert at.splits_for(programs=7, keys=4096, device=dev) == 4  # five
    assert at.splits_for(programs=3, keys=4096, device=dev) == 8  # eleven


@pytest.mark.skipif(not at.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("pdl", [False, True])
def test_kernels_compile_for_sm90(pdl):
    """Both kernels compile for sm_90, with programmatic dependent launch (griddepcontrol) and without, with sinks and
    without."""
    from tests.kernels.test_wo_gemm import _compile_sm90, _ptxas_available

    if not _ptxas_available():
        pytest.skip("triton's NVIDIA backend / ptxas missing")
    ints = ("S", "REP", "D", "KVH", "chunk", "SPLITS") + tuple(
        f"s_{a}{b}" for a, dims in (("q", "bhrd"), ("k", "bhsd"), ("v", "bhsd"), ("m", "bs"), ("o", "bhrd"))
        for b in dims)
    ints += ("s_ksh", "s_vsh")
    for kind, fp8, sink in ((0, False, False), (1, False, False), (2, False, True), (1, True, True)):
        kv = "*u8" if fp8 else "*bf16"
        ptrs = dict(Q="*bf16", K=kv, V=kv, MASK={0: "*bf16", 1: "*u8", 2: "*bf16"}[kind], OUT="*bf16",
                    ACC="*fp32", ML="*fp32", KS="*fp32", VS="*fp32", SINKS="*bf16", scale="fp32")
        for direct in (False, True):
            _compile_sm90(at._split_kernel, ptrs, ints,
                          dict(MASK_KIND=kind, KV_FP8=fp8, HAS_SINK=sink, DIRECT=direct, IEEE=False, EMU_BF16=False,
                               NATIVE_FP8=True, PDL=pdl, BLOCK_M=16, BLOCK_N=at.BLOCK_N, BLOCK_D=128), num_warps=4, launch_pdl=pdl)
    _compile_sm90(at._merge_kernel, dict(ACC="*fp32", ML="*fp32", OUT="*bf16"), ints,
                  dict(EMU_BF16=False, PDL=pdl, BLOCK_M=16, BLOCK_D=128, BLOCK_S=16), num_warps=4, launch_pdl=pdl)


# -- on the GPU -----------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [
    dict(b=1, kvh=8, rep=4, s=2048, d=128),  # Llama-3.1-8B, batch 1
    dict(b=1, kvh=4, rep=8, s=300, d=128),  # Qwen3-30B-A3B
    dict(b=32, kvh=8, rep=4, s=256, d=128, mb=32),  # batch 32: one split
    dict(b=3, kvh=2, rep=6, s=77, d=80, qb=1),  # odd sizes, query batch broadcast
])
@pytest.mark.parametrize("mask", ["bool", "float", None])
def test_gpu_matches_sdpa(dtype, shape, mask):
    q, k, v, m = make(**shape, dtype=dtype, mask=mask, device="cuda")
    assert at.triton_reason(q, k, v, m) is None
    out = at.decode_attention(q, k, v, m, None)
    want = oracle(q, k, v, m)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want, atol=tol(dtype, want), rtol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head", [True, False])
def test_gpu_fp8_cache_matches_its_dequantized_read(dtype, per_head):
    q, k, v, m = make(b=1, kvh=8, rep=4, s=2048, d=128, dtype=dtype, device="cuda")
    kq, vq, ks, vs = fp8_kv(k, v, per_head)
    assert at.triton_reason(q, kq, vq, m, fp8_kv=True) is None
    out = at.decode_attention(q, kq, vq, m, None, ks, vs)
    want = oracle(q, kq, vq, m, None, ks, vs)
    torch.testing.assert_close(out.float(), want, atol=tol(dtype, want), rtol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask", ["bool", "float", "all-hidden"])
def test_gpu_sinks_match_the_reference(dtype, mask):
    """gpt-oss-20B's attention at batch 1 and 4 (64 query heads, 8 key / value heads, head_dim 64) with sinks."""
    for b in (1, 4):
        q, k, v, m = make(b=b, kvh=8, rep=8, s=1000, d=64, dtype=dtype, mask=mask, device="cuda")
        s = sinks_of(q)
        out = at.decode_attention(q, k, v, m, None, None, None, s)
        want = oracle(q, k, v, m, None, sinks=s)
        torch.testing.assert_close(out.float(), want, atol=tol(dtype, want) if want.abs().max() > 0 else 0, rtol=0)


@gpu
def test_gpu_cuda_graph_and_hidden_rows():
    q, k, v, m = make(b=1, kvh=8, rep=4, s=1024, d=128, dtype=torch.bfloat16, device="cuda")
    m[..., 1:] = False  # one key visible: each row is that key's value
    m[0, 0, 0, 0] = True
    out = at.decode_attention(q, k, v, m)
    torch.testing.assert_close(out, v[:, :, :1].expand_as(out), atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = at.decode_attention(q, k, v, m)
    m[..., :] = False  # nothing visible: zeros, as SDPA's math gives
    graph.replay()
    assert torch.equal(captured, torch.zeros_like(captured))
