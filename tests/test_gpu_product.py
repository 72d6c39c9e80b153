"""On a CUDA GPU, the paths around the kernels: gradients through the GPU kernels (tiled wo_mma weights,
FP8 scaled_mm), compile-time online FP8 under inductor with CUDA graphs, inductor's kernels with programmatic
dependent launch chained to ours (bit-identical to PDL off), save_pretrained after a GPU
load (tiled weights written back untiled), HF generate compiling with qcompile (its stop check deferred), and
the FP8 KV cache in generate's compiled decode."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig, StaticCache

import qcompile
from qcompile import synth
from qcompile.kv_cache import FP8Cache, cache_kwargs, cache_nbytes
from qcompile.linear import QuantLinear, dequantize_model
from tests.test_roundtrip import assert_same_checkpoint

pytestmark = pytest.mark.gpu
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 300, 11]])


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def input_grad(model, forward):
    """d(mean(logits²))/d(inputs_embeds) of ``forward`` (the model or its compiled form)."""
    x = model.get_input_embeddings()(IDS.cuda()).detach().requires_grad_()
    forward(inputs_embeds=x).logits.float().pow(2).mean().backward()
    return x.grad


@pytest.mark.parametrize("fmt,kernel,tol", [("ct-w4a16", "wo_mma", 0.03), ("modelopt-nvfp4", "wo_mma", 0.03),
                                            ("modelopt-fp8", "fp8_inductor", 0.15),
                                            ("ct-fp8-block", "fp8_scaled_mm", 0.15)])
def test_gradients_flow_through_the_gpu_kernels(fmt, kernel, tol, synth_ckpt):
    """Straight-through: the activation gradient of the compiled model (GPU kernels, tiled weights)
    against autograd through the dequantized bf16 model. Weight-only kernels differ by rounding
    only; FP8 kernels also quantize the forward's activations, which moves the gradient more."""
    if kernel == "fp8_scaled_mm" and "block" in fmt and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 block GEMM is sm_90 only")
    model = qcompile.load(str(synth_ckpt(fmt)), device="cuda")
    torch._dynamo.reset()
    be = qcompile.backend()
    got = input_grad(model, torch.compile(model, backend=be))
    assert kernel in {r.kernel for r in be.rows}, be.explain()
    ref_model = dequantize_model(copy.deepcopy(model))
    want = input_grad(ref_model, ref_model)
    assert torch.isfinite(got).all()
    assert rel(got, want) < tol


@pytest.mark.parametrize("online", ["fp8_per_tensor", "fp8_per_block"])
def test_online_fp8_at_compile_time_with_cuda_graphs(online, testdata):
    model = AutoModelForCausalLM.from_pretrained(str(testdata / "base-bf16-dense"), dtype=torch.bfloat16).cuda()
    model.eval()
    ids = IDS.cuda()
    with torch.no_grad():
        ref = model(ids).logits.clone()
        torch._dynamo.reset()
        be = qcompile.backend(online=online, cudagraphs=True)
        compiled = torch.compile(model, backend=be)
        first = compiled(ids).logits.clone()
        again = compiled(ids).logits.clone()  # a graph replay
    want = "fp8_scaled_mm" if online == "fp8_per_block" else "fp8_inductor"
    assert {r.kernel for r in be.rows if r.scheme != "bf16"} == {want}, be.explain()
    assert torch.equal(first, again)
    assert rel(first, ref) < 0.15  # FP8 weights and activations vs bf16, as in test_gpu_e2e


@pytest.mark.parametrize("knob, marker", [("triton.enable_pdl", "gdc_wait"), ("combo_kernels", "num_xblocks_")])
@pytest.mark.parametrize("fmt", ["ct-w4a16", "modelopt-fp8", "llmcompressor-w4a16-gptq-moe", "modelopt-fp8-moe"])
def test_launch_settings_give_the_same_bits(fmt, knob, marker, synth_ckpt, testdata):
    """With PDL a kernel may start before the previous one ends and waits only before its first dependent read:
    a wait placed wrongly reads a half-written buffer. Combo kernels launch independent kernels as one: a
    dependency missed runs a reader beside its writer. The compiled model (wo_mma / cuBLAS / wo_moe between
    inductor's kernels, the MoE routers' fused top-k, CUDA graphs replayed on other inputs) gives the same bits
    with PDL on and off (inductor's deterministic mode: the same reduction configs in both compiles), and with
    combo kernels on and off within one rounding of the logits (a reduction inside a combo kernel may take
    another block size than alone)."""
    from torch._inductor.utils import run_and_get_code

    if knob == "triton.enable_pdl" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    path = testdata / fmt if fmt.endswith("-moe") else synth_ckpt(fmt)
    model = qcompile.load(str(path), device="cuda")
    outs = {}
    same_configs = {"deterministic": True} if hasattr(torch._inductor.config, "deterministic") else {}
    for on in (False, True):
        torch._dynamo.reset()
        rewritten = []
        be = qcompile.backend(cudagraphs=True, inductor_config={knob: on, **same_configs},
                              on_graph=lambda before, after: rewritten.append("topk_by_selection" in after))
        compiled = torch.compile(model, backend=be)
        with torch.no_grad():
            first, code = run_and_get_code(lambda: compiled(IDS.cuda()).logits.clone())
            outs[on] = [first] + [compiled(IDS.cuda().roll(i, -1)).logits.clone() for i in range(1, 4)]
        assert any(marker in c for c in code) == on
        assert rewritten and all(rewritten) == fmt.endswith("-moe")  # the routers' top-k fused
    for without, with_ in zip(outs[False], outs[True]):
        if knob == "combo_kernels":
            torch.testing.assert_close(with_, without, rtol=0, atol=2 ** -7 * without.abs().max().item())
        else:
            assert torch.equal(without, with_)


def test_every_graph_of_a_process_gets_the_launch_settings(synth_ckpt):
    """The backend's defaults (PDL for inductor's kernels, combo kernels under CUDA graphs) reach every graph
    compiled in a process, not only the first: each compile leaves inductor's config entries it patched marked
    as set by the caller."""
    from torch._inductor.utils import run_and_get_code

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    model = qcompile.load(str(synth_ckpt("ct-w4a16")), device="cuda")
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=qcompile.backend(cudagraphs=True))
        with torch.no_grad():
            _, code = run_and_get_code(lambda: compiled(IDS.cuda()).logits.clone())
        assert any("gdc_wait" in c for c in code) and any("num_xblocks_" in c for c in code)


@pytest.mark.parametrize("fmt", ["ct-w4a16", "ct-w8a16", "modelopt-nvfp4", "quark-mxfp4"])
def test_save_after_a_gpu_load_writes_the_source(fmt, synth_ckpt, tmp_path):
    src = synth_ckpt(fmt)
    model = qcompile.load(str(src), device="cuda")
    assert any("tiled" in m.scheme_key for m in model.modules() if isinstance(m, QuantLinear))
    model.save_pretrained(tmp_path / "saved")
    assert_same_checkpoint(src, tmp_path / "saved")


def test_generate_compiles_with_qcompile(synth_ckpt):
    """HF's own path: generate() compiles the forward with the backend its compile_config names when the
    cache is static (the quantizer reports itself compileable); greedy tokens match the eager model's."""
    model = qcompile.load(str(synth_ckpt("ct-w4a16")), device="cuda")
    ids = IDS.cuda()
    greedy = dict(max_new_tokens=12, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, disable_compile=True, **greedy)
    torch._dynamo.reset()
    out = model.generate(ids, compile_config=CompileConfig(backend="qcompile", mode="default"), **greedy)
    assert "wo_mma" in qcompile.explain(), qcompile.explain()
    assert out.shape == eager.shape
    assert (out == eager).float().mean() > 0.9  # bf16 rounding may flip a late argmax on a random model


@pytest.mark.parametrize("returned", [False, True])
def test_generate_defers_its_stop_check_with_the_same_tokens(synth_ckpt, returned):
    """On CUDA a loaded model's generate() reads its stop flag one step late (qcompile.generation): the same
    tokens as the synchronous loop, stopping at max_new_tokens and at an end-of-sequence token mid-way (the
    extra step undone), with the cache handed back (deferred only where the cache can be cropped) or not."""
    from transformers.generation import utils as generation_utils

    model = qcompile.load(str(synth_ckpt("ct-w4a16")), device="cuda")
    ids = IDS.cuda()
    config = CompileConfig(backend="qcompile", mode="default")
    greedy = dict(max_new_tokens=12, do_sample=False, cache_implementation="static", compile_config=config,
                  return_dict_in_generate=returned)
    torch._dynamo.reset()
    plain = type(model).generate(model, ids, **greedy)
    plain = plain.sequences if returned else plain
    eos = int(plain[0, ids.shape[1] + 5])  # a token the model emits mid-way
    check = generation_utils.DeferredStopCheck
    with mock.patch.object(check, "__init__", autospec=True, side_effect=check.__init__) as made:
        for kw in ({}, {"eos_token_id": eos, "pad_token_id": eos}):
            want = type(model).generate(model, ids, **greedy, **kw)
            got = model.generate(ids, **greedy, **kw)
            if returned:
                want, got = want.sequences, got.sequences
            assert torch.equal(got, want), (kw, got, want)
    # a returned cache must be croppable to undo the extra step: StaticCache is in transformers 5.24, not in 5.17
    croppable = StaticCache(config=model.config, max_cache_len=8).is_croppable
    assert made.call_count == (2 if croppable or not returned else 0)
    assert got.shape[1] <= ids.shape[1] + 6


def test_fp8_kv_cache_in_compiled_generate(tmp_path):
    path = synth.write_checkpoint(str(tmp_path / "m"), "ct-w4a16", kv_cache="fp8")
    model = qcompile.load(path, device="cuda")
    ids = IDS.cuda()
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True,
              compile_config=CompileConfig(backend="qcompile", mode="default"))
    torch._dynamo.reset()
    fp8 = FP8Cache(model, max_cache_len=64)
    got = model.generate(ids, **kw, **cache_kwargs(model, fp8))
    bf16 = StaticCache(config=model.config, max_cache_len=64)
    want = model.generate(ids, **kw, **cache_kwargs(model, bf16))
    assert fp8.layers[0].keys.dtype == torch.float8_e4m3fn
    assert 2 * cache_nbytes(fp8) == cache_nbytes(bf16)
    assert rel(got.logits[0], want.logits[0]) < 0.08  # the FP8 cache's rounding of K and V


def test_compiled_fp8_cache_update_writes_in_place():
    """Under inductor the FP8 cache's update writes the new token's bytes into the cache: the generated code
    allocates no buffer of a layer cache's shape (a copy of the whole cache out and back every step), and the
    step's logits match the eager step's."""
    from torch._inductor.utils import run_and_get_code

    model = AutoModelForCausalLM.from_config(synth.tiny_llama_config(num_hidden_layers=1), dtype=torch.bfloat16)
    model = model.cuda().eval()
    caches = [FP8Cache(model, max_cache_len=4096, scales="dynamic") for _ in range(2)]
    kws = [cache_kwargs(model, c) for c in caches]
    ids = IDS.cuda()
    with torch.no_grad():
        for kw in kws:
            model(input_ids=ids, use_cache=True, **kw)
        torch._dynamo.reset()
        step = torch.compile(lambda tok, kw: model(input_ids=tok, use_cache=True, **kw).logits,
                             backend=qcompile.backend(), fullgraph=True, dynamic=False)
        got, code = run_and_get_code(step, ids[:, -1:], kws[0])
        want = model(input_ids=ids[:, -1:], use_cache=True, **kws[1]).logits
    shape = tuple(caches[0].layers[0].keys.shape)
    assert shape[2] == 4096 and f"empty_strided_cuda({shape}" not in "\n".join(code), "a copy of the cache"
    keys = [c.layers[0].keys.float() for c in caches]
    assert torch.equal(keys[0][:, :, :12], keys[1][:, :, :12]) and keys[0][:, :, 12].abs().sum() > 0
    assert rel(keys[0][:, :, 12], keys[1][:, :, 12]) < 0.1  # the new token's key, written by the compiled step
    assert rel(got, want) < 0.02
