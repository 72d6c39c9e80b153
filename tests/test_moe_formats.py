"""Every quantized MoE checkpoint format of the producers: loads quantized (QuantExperts), runs the
reference op eagerly, matches the dequantized reference, compiles into one experts op per MoE layer.
Every Quark MoE scheme also: compiled layer by layer, saved back (save_pretrained) bit for bit, and the
experts kernel the registry picks on a CUDA sm_90 device (mocked).

Checkpoints: tests/data/checkpoints (README there says which producer wrote each). Tolerances:

* experts vs the dequantized reference (the module's own math on the dequantized weights, activations
  quantize-dequantized as the scheme says), fp32 inputs: relative error < 1e-5. The same arithmetic in
  another order; a stacking or scale-merge bug gives >= 1 %.
* dequantized weights vs the unquantized model they were made from: each format's rounding error
  (table below); a transposed shard or a reciprocal scale gives >= 100 %.
"""

from __future__ import annotations

import functools
import json
import re
import warnings

import pytest
import torch
from expecttest import assert_expected_inline
from safetensors import safe_open

import qcompile
from qcompile.experts import QuantExperts, is_experts
from qcompile.kernels import quant_math
from qcompile.kernels.experts_ref import gated_activation
from qcompile.linear import QuantLinear
from qcompile.scheme import parse_scheme_key

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64, 128, 5, 300, 11]])
FP8_T = "w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor"
NVFP4 = "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=fp4_e2m1/dynamic/group16:fp8_e4m3/global"
NVFP4_A16 = "w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none"  # NVFP4A16, ModelOpt W4A16_NVFP4
QWEN_TINY, MIXTRAL_TINY = "base-bf16-qwen3moe-tiny", "base-bf16-mixtral-tiny"

# checkpoint -> (the bf16 model it was made from, the experts' scheme, dequantized weights vs it: rel. error)
# Weight rounding on these random weights: fp8 per tensor 3-5 %, 8-bit int 1 %, 4-bit 10-15 %.
CASES = {
    "modelopt-fp8-moe": ("base-bf16-moe", FP8_T, 0.06),
    "modelopt-nvfp4-moe": ("base-bf16-moe", NVFP4, 0.15),
    "llmcompressor-fp8-dynamic-moe": ("base-bf16-moe", "w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token", 0.04),
    "llmcompressor-nvfp4-moe": ("base-bf16-moe", NVFP4, 0.15),
    "llmcompressor-w4a16-gptq-moe": ("base-bf16-moe", "w=int4/group128/pack=int32;a=none", 0.2),
    "quark-w-mxfp4-moe": ("base-bf16-moe", "w=fp4_e2m1/group32:e8m0/pack=uint8;a=none", 0.15),
    "llmcompressor-fp8-static-moe": (QWEN_TINY, FP8_T, 0.06),
    "llmcompressor-fp8-dyntensor-moe": (QWEN_TINY, "w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor", 0.06),
    "llmcompressor-fp8-block-moe": (QWEN_TINY, "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128", 0.05),
    "llmcompressor-nvfp4a16-moe": (QWEN_TINY, NVFP4_A16, 0.15),
    "llmcompressor-w8a16-moe": (QWEN_TINY, "w=int8/group128/pack=int32;a=none", 0.02),
    "llmcompressor-w4a8-moe": (QWEN_TINY, "w=int4/group32;a=int8/dynamic/token", 0.2),
    "quark-w8a8-int8-moe": (QWEN_TINY, "w=int8/tensor;a=int8/static/tensor", 0.02),
    "quark-w-mxfp4-a-mxfp4-moe": (QWEN_TINY, "w=fp4_e2m1/group32:e8m0/pack=uint8;a=fp4_e2m1/dynamic/group32:e8m0", 0.15),
    "quark-w-mxfp4-a-fp8-moe": (QWEN_TINY, "w=fp4_e2m1/group32:e8m0/pack=uint8;a=fp8_e4m3/static/tensor", 0.15),
    "quark-w-mxfp6-e3m2-moe": (QWEN_TINY, "w=fp6_e3m2/group32:e8m0/pack=uint8_fp6;a=fp6_e3m2/dynamic/group32:e8m0",
                               0.1),
    "quark-w-mxfp6-e2m3-moe": (QWEN_TINY, "w=fp6_e2m3/group32:e8m0/pack=uint8_fp6;a=fp6_e2m3/dynamic/group32:e8m0",
                               0.1),
    "quark-w-mxfp4-a-mxfp6-e2m3-moe": (QWEN_TINY, "w=fp4_e2m1/group32:e8m0/pack=uint8;a=fp6_e2m3/dynamic/group32:e8m0",
                                       0.15),
    "quark-w8a8-fp8-moe": (QWEN_TINY, FP8_T, 0.06),
    "quark-ptpc-fp8-moe": (QWEN_TINY, "w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token", 0.04),
    "quark-w8a8-int8-channel-moe": (QWEN_TINY, "w=int8/channel;a=int8/dynamic/token", 0.02),
    "quark-w-int4-a-fp8-moe": (QWEN_TINY, "w=int4/channel/pack=int32/global;a=fp8_e4m3/dynamic/tensor", 0.15),
    "modelopt-mxfp8-moe": (QWEN_TINY, "w=fp8_e4m3/group32:e8m0;a=fp8_e4m3/dynamic/group32:e8m0", 0.06),
    "modelopt-w4a16-nvfp4-moe": (QWEN_TINY, NVFP4_A16, 0.15),
    # ModelOpt writes Mixtral's own names (block_sparse_moe.experts.E.w1 / w3 / w2)
    "modelopt-w4a16-nvfp4-mixtral": (MIXTRAL_TINY, NVFP4_A16, 0.15),
    "llmcompressor-fp8-dynamic-mixtral": (MIXTRAL_TINY, "w=fp8_e4m3/channel;a=fp8_e4m3/dynamic/token", 0.04),
    "llmcompressor-w4a16-mixtral": (MIXTRAL_TINY, "w=int4/group128/pack=int32;a=none", 0.2),
    # GPTQ act-order (actorder "group"): a g_idx per expert projection, gate and up sharing theirs
    "llmcompressor-w4a16-actorder-moe": (QWEN_TINY, "w=int4/group32/pack=int32/actorder;a=none", 0.2),
    # moe_intermediate 192: the 128-row blocks of gate and up end in partial blocks, split in 64-row ones
    "llmcompressor-fp8-block-deepseekv3": (None, "w=fp8_e4m3/block64x128;a=fp8_e4m3/dynamic/group128", None),
}


@functools.lru_cache(maxsize=None)
def _load(path: str):
    return qcompile.load(path)


@functools.lru_cache(maxsize=None)
def _base(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def load(testdata, name):
    if not (testdata / name).is_dir():
        pytest.skip(f"{name} is not among the test checkpoints")
    return _load(str(testdata / name))


def experts_of(model) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routed(experts, tokens: int = 24, seed: int = 0):
    """Random fp32 hidden states, top-k ids covering every expert, and router weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.hidden_dim, generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, 2, generator=g)


def dequantized_reference(experts: QuantExperts, x, ids, weights) -> torch.Tensor:
    """Per token and expert, on the weights of ``experts.dequantized`` (the HF module, fp32):
    qdq(x) @ W13.T -> gated activation -> qdq -> @ W2.T, weighted by the router."""
    hf = experts.dequantized(torch.float32)
    gate_up, down = hf.gate_up_proj, hf.down_proj
    if experts.shape.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if experts.shape.interleaved:
        gate_up = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)
    act = parse_scheme_key(experts.scheme_key).act
    scales = {role: getattr(experts, role, None) for role in
              ("w13_input_scale", "w13_input_global_scale", "w2_input_scale", "w2_input_global_scale")}

    def qdq(v, group):
        if act is None:
            return v
        return quant_math.qdq_activation(v, act, scales[f"{group}_input_scale"], scales[f"{group}_input_global_scale"])

    pairs = [(t, slot, e) for t in range(x.shape[0]) for slot, e in enumerate(ids[t].tolist())]
    xq = qdq(x, "w13")  # a dynamic per-tensor scale spans the batch, as the fused kernels quantize it
    a = torch.cat([gated_activation(xq[t:t + 1] @ gate_up[e].t(), experts.activation) for t, _, e in pairs])
    aq = qdq(a, "w2")
    out = torch.zeros_like(x)
    for i, (t, slot, e) in enumerate(pairs):
        out[t] += weights[t, slot] * (aq[i:i + 1] @ down[e].t())[0]
    return out


@pytest.mark.parametrize("name", CASES)
def test_loads_quantized(testdata, name):
    model = load(testdata, name)
    found = experts_of(model)
    assert len(found) == model.config.num_hidden_layers - getattr(model.config, "first_k_dense_replace", 0)
    assert not any(is_experts(m) for m in model.modules()), "an experts module stayed in bf16"
    for experts in found.values():
        assert experts.scheme_key == CASES[name][1]
        assert experts.w13_weight.dtype in (torch.float8_e4m3fn, torch.uint8, torch.int32, torch.int8)
        assert experts.w13_weight.shape[:2] == (experts.num_experts, 2 * experts.intermediate_dim)
        assert not any(isinstance(m, QuantLinear) for m in experts.modules())


@pytest.mark.parametrize("name", CASES)
def test_experts_match_the_dequantized_reference(testdata, name):
    for experts in experts_of(load(testdata, name)).values():
        x, ids, weights = routed(experts)
        with torch.no_grad():
            got = experts(x, ids, weights)
        assert rel_err(got, dequantized_reference(experts, x, ids, weights)) < 1e-5


@pytest.mark.parametrize("name", CASES)
def test_dequantized_weights_match_the_base_model(testdata, name):
    base_name, _, tol = CASES[name]
    if base_name is None or not (testdata / base_name).is_dir():
        pytest.skip(f"{base_name} is not among the test checkpoints")
    base = dict(_base(str(testdata / base_name)).named_modules())
    for path, experts in experts_of(load(testdata, name)).items():
        hf = experts.dequantized(torch.float32)
        for p in ("gate_up_proj", "down_proj"):
            err = rel_err(getattr(hf, p), getattr(base[path], p))
            assert err < tol, f"{path}.{p}: {err:.3f}"


def test_partial_blocks_dequantize_per_shard(testdata):
    """DeepSeek-V3 shapes: 192-row kv_a_proj_with_mqa and 192-row gate / up shards end in partial
    128-row blocks; each shard's rows keep their own blocks (read back from the file)."""
    path = testdata / "llmcompressor-fp8-block-deepseekv3"
    model = load(testdata, path.name)
    kv = model.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert isinstance(kv, QuantLinear) and kv.out_features == 192 and kv.weight_scale.shape == (2, 2)
    hf = experts_of(model)["model.layers.1.mlp.experts"].dequantized(torch.float32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for e in range(4):
            for leaf, rows in (("gate_proj", slice(0, 192)), ("up_proj", slice(192, 384))):
                prefix = f"model.layers.1.mlp.experts.{e}.{leaf}"
                w, s = f.get_tensor(f"{prefix}.weight").float(), f.get_tensor(f"{prefix}.weight_scale").float()
                want = w * s.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)
                assert torch.equal(hf.gate_up_proj[e, rows], want)


ACT_ORDER = "llmcompressor-w4a16-actorder-moe"  # GPTQ actorder "group", int4 group 32


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int4: int32 [N, K/8], nibble j of word w is element 8w + j, plus 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (((words.unsqueeze(-1) >> shifts) & 0xF) - 8).flatten(-2)


def test_act_order_experts_dequantize_as_the_file_says(testdata):
    """Act-order (``weight_g_idx``): input column k of an expert's projection takes its row's scale of group
    g_idx[k]. The loaded experts dequantize (fp32) exactly to that, decoded here from the file's packed
    words, scales and g_idx without qcompile's code (the rule compressed-tensors' own decompression
    follows). Every g_idx is checked not to be the identity group order k // 32, so a loader that dropped,
    mis-stacked or swapped them between experts or shards fails."""
    model = load(testdata, ACT_ORDER)
    with safe_open(str(testdata / ACT_ORDER / "model.safetensors"), "pt") as f:
        for path, experts in experts_of(model).items():
            hf, i = experts.dequantized(torch.float32), experts.intermediate_dim
            for e in range(experts.num_experts):
                for leaf, got in (("gate_proj", hf.gate_up_proj[e, :i]), ("up_proj", hf.gate_up_proj[e, i:]),
                                  ("down_proj", hf.down_proj[e])):
                    prefix = f"{path}.{e}.{leaf}"
                    g_idx = f.get_tensor(f"{prefix}.weight_g_idx").long()
                    assert not torch.equal(g_idx, torch.arange(g_idx.numel()) // 32), prefix
                    q = unpack_int4(f.get_tensor(f"{prefix}.weight_packed")).float()
                    scale = f.get_tensor(f"{prefix}.weight_scale").float()
                    assert torch.equal(got, q * scale[:, g_idx]), prefix


def test_act_order_experts_opcheck(testdata):
    """experts_ref on the act-order checkpoint's stacked tensors (g_idx [E, K] for w13 and w2): opcheck."""
    from tests.opcheck_util import opcheck

    experts = next(iter(experts_of(load(testdata, ACT_ORDER)).values()))
    x, ids, weights = routed(experts, tokens=6)
    tensors = [getattr(experts, f"{p}_{r}", None) for p in ("w13", "w2") for r in
               ("weight", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_g_idx", "input_scale",
                "input_global_scale")]
    assert tensors[4].shape == tensors[11].shape == (experts.num_experts, 128)
    opcheck(torch.ops.qcompile.experts_ref.default, (x.bfloat16().requires_grad_(), ids, weights.requires_grad_(),
                                                     *tensors, None, None, experts.activation, experts.scheme_key))


def test_act_order_moe_round_trips(testdata, tmp_path):
    """save_pretrained writes the producer's tensors back bit for bit, the g_idx gate and up share included."""
    from tests.test_roundtrip import assert_same_checkpoint

    load(testdata, ACT_ORDER).save_pretrained(tmp_path)
    assert_same_checkpoint(testdata / ACT_ORDER, tmp_path)


def compile_graph(model):
    """(eager logits, compiled logits, the graph after the passes as code): aot_eager, one graph."""
    graphs = []
    torch._dynamo.reset()
    # unfused: each linear keeps its own row and scales (the Fuse pass has its own tests)
    be = qcompile.backend(inner="aot_eager", fuse=False, on_graph=lambda before, after: graphs.append(after))
    with torch.no_grad():
        want = model(IDS).logits
        got = torch.compile(model, backend=be, fullgraph=True)(IDS).logits
    assert len(graphs) == 1
    return want, got, graphs[0]


def op_lines(code: str) -> list[str]:
    """The graph's quantized-op calls as ``op module scheme``, the module's path shortened."""
    out = []
    for line in code.splitlines():
        m = re.search(r"torch\.ops\.qcompile\.(\w+?)(?:\.default)?\(.*?l_(?:self|args_0)_modules_model_modules_layers_"
                      r"modules_(\d+)_modules_(\w+?)_parameters_.*?'(w=[^']*)'", line)
        if m:
            out.append(f"{m.group(1)} layers.{m.group(2)}.{m.group(3).replace('_modules_', '.')} {m.group(4)}")
    return out


def _compiled_ops(testdata, name) -> str:
    model = load(testdata, name)
    want, got, code = compile_graph(model)
    # aot_eager: the experts run the same reference op; a weight-only linear's kernel multiplies in bf16 (~1 %)
    assert rel_err(got, want) < 0.02
    lines = op_lines(code)
    assert sum(line.startswith("experts_ref ") for line in lines) == len(experts_of(model))
    assert not any(".experts." in line for line in lines if not line.startswith("experts_ref"))
    return "\n".join(line for line in lines if line.split()[1].startswith("layers.1."))


def test_modelopt_moe_compiles_to_one_experts_op_per_layer(testdata):
    assert_expected_inline(_compiled_ops(testdata, "modelopt-fp8-moe"), """\
fp8_linear layers.1.self_attn.q_proj w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor
fp8_linear layers.1.self_attn.k_proj w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor
fp8_linear layers.1.self_attn.v_proj w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor
fp8_linear layers.1.self_attn.o_proj w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor
experts_ref layers.1.mlp.experts w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor""")


def test_compressed_tensors_moe_compiles_to_one_experts_op_per_layer(testdata):
    assert_expected_inline(_compiled_ops(testdata, "llmcompressor-w4a16-gptq-moe"), """\
wo_linear layers.1.self_attn.q_proj w=int4/group128/pack=int32;a=none
wo_linear layers.1.self_attn.k_proj w=int4/group128/pack=int32;a=none
wo_linear layers.1.self_attn.v_proj w=int4/group128/pack=int32;a=none
wo_linear layers.1.self_attn.o_proj w=int4/group128/pack=int32;a=none
experts_ref layers.1.mlp.experts w=int4/group128/pack=int32;a=none""")


def test_act_order_moe_compiles_to_one_experts_op_per_layer(testdata):
    assert_expected_inline(_compiled_ops(testdata, ACT_ORDER), """\
wo_linear layers.1.self_attn.q_proj w=int4/group32/pack=int32/actorder;a=none
wo_linear layers.1.self_attn.k_proj w=int4/group32/pack=int32/actorder;a=none
wo_linear layers.1.self_attn.v_proj w=int4/group32/pack=int32/actorder;a=none
wo_linear layers.1.self_attn.o_proj w=int4/group32/pack=int32/actorder;a=none
experts_ref layers.1.mlp.experts w=int4/group32/pack=int32/actorder;a=none""")


def test_quark_moe_compiles_to_one_experts_op_per_layer(testdata):
    assert_expected_inline(_compiled_ops(testdata, "quark-w-mxfp4-moe"), """\
wo_linear layers.1.self_attn.q_proj w=fp4_e2m1/group32:e8m0/pack=uint8;a=none
wo_linear layers.1.self_attn.k_proj w=fp4_e2m1/group32:e8m0/pack=uint8;a=none
wo_linear layers.1.self_attn.v_proj w=fp4_e2m1/group32:e8m0/pack=uint8;a=none
wo_linear layers.1.self_attn.o_proj w=fp4_e2m1/group32:e8m0/pack=uint8;a=none
experts_ref layers.1.mlp.experts w=fp4_e2m1/group32:e8m0/pack=uint8;a=none""")


def test_modelopt_weight_only_moe_compiles_to_one_experts_op_per_layer(testdata):
    """W4A16_NVFP4: the linears lower to the weight-only op (no activation to quantize), not NVFP4's reference."""
    assert_expected_inline(_compiled_ops(testdata, "modelopt-w4a16-nvfp4-moe"), """\
wo_linear layers.1.self_attn.q_proj w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none
wo_linear layers.1.self_attn.k_proj w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none
wo_linear layers.1.self_attn.v_proj w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none
wo_linear layers.1.self_attn.o_proj w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none
experts_ref layers.1.mlp.experts w=fp4_e2m1/group16:fp8_e4m3/pack=uint8/global;a=none""")


@pytest.mark.parametrize("name", ["llmcompressor-fp8-dynamic-mixtral", "modelopt-w4a16-nvfp4-mixtral",
                                  "llmcompressor-fp8-block-deepseekv3"])
def test_other_architectures_compile_to_one_experts_op_per_layer(testdata, name):
    _compiled_ops(testdata, name)


# -- every Quark MoE scheme: compiled, saved, and the kernel an sm_90 GPU would run ----------------

QUARK = [name for name in CASES if name.startswith("quark-")]
# The experts kernel of each on a CUDA sm_90 device: FP8 / INT8 W8A8 -> the Triton fused MoE; OCP-MX fp4 and
# int4_fp8 -> the weight-only MoE (their activation quantization dropped, said in the explain row); MX fp6 weights
# have no GPU kernel.
SM90_KERNELS = {
    "quark-w8a8-int8-moe": ("moe_triton", ""), "quark-w8a8-int8-channel-moe": ("moe_triton", ""),
    "quark-w8a8-fp8-moe": ("moe_triton", ""), "quark-ptpc-fp8-moe": ("moe_triton", ""),
    "quark-w-mxfp4-moe": ("wo_moe", ""), "quark-w-mxfp4-a-mxfp4-moe": ("wo_moe", "weight-only"),
    "quark-w-mxfp4-a-fp8-moe": ("wo_moe", "weight-only"), "quark-w-mxfp4-a-mxfp6-e2m3-moe": ("wo_moe", "weight-only"),
    "quark-w-int4-a-fp8-moe": ("wo_moe", "weight-only"),
    "quark-w-mxfp6-e3m2-moe": ("reference", ""), "quark-w-mxfp6-e2m3-moe": ("reference", ""),
}


@pytest.mark.parametrize("name", QUARK)
def test_compiled_quark_experts_match_the_dequantized_reference(testdata, name):
    """Each MoE layer compiled alone (aot_eager): one experts op, the eager result exactly, so the
    dequantized reference's (tolerance above)."""
    for experts in experts_of(load(testdata, name)).values():
        torch._dynamo.reset()
        be = qcompile.backend(inner="aot_eager")
        x, ids, weights = routed(experts)
        with torch.no_grad():
            got = torch.compile(experts, backend=be, fullgraph=True)(x, ids, weights)
            assert torch.equal(got, experts(x, ids, weights))
        assert [(r.op, r.kernel) for r in be.rows] == [("qcompile::experts_ref", "reference")], be.explain()
        assert rel_err(got, dequantized_reference(experts, x, ids, weights)) < 1e-5


@pytest.mark.parametrize("name", ["quark-w-mxfp4-a-mxfp6-e2m3-moe", "quark-w8a8-fp8-moe", "quark-ptpc-fp8-moe",
                                  "quark-w8a8-int8-channel-moe", "quark-w-int4-a-fp8-moe"])
def test_quark_moe_models_compile_to_one_experts_op_per_layer(testdata, name):
    assert _compiled_ops(testdata, name).splitlines()[-1] == f"experts_ref layers.1.mlp.experts {CASES[name][1]}"


def requantized_on_disk(path) -> tuple[set[str], set[str]]:
    """The gate or up shards of FP8 / INT8 per-tensor experts whose scale is the smaller of the two
    (requantized to the larger at load), read from the checkpoint: (their weight_scale, their weight)."""
    scales, codes = set(), set()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            weight = key[:-len("_scale")]
            if key.endswith(".gate_proj.weight_scale") and f.get_slice(key).get_shape() in ([], [1]) and \
                    f.get_slice(weight).get_dtype() in ("F8_E4M3", "I8"):
                up = key.replace(".gate_proj.", ".up_proj.")
                gate, upv = f.get_tensor(key).float(), f.get_tensor(up).float()
                if not torch.equal(gate, upv):
                    low = key if bool(gate < upv) else up
                    scales.add(low)
                    codes.add(low[:-len("_scale")])
    return scales, codes


@pytest.mark.parametrize("name", QUARK)
def test_quark_moe_round_trips(testdata, name, tmp_path):
    """save_pretrained writes the producer's tensors back bit for bit (names, dtypes, shapes, bytes; zero
    points too) and its config; only the shard of an expert requantized to its partner's larger per-tensor
    scale at load is written requantized (its scale, and its codes unless the ratio of the scales left them
    all unchanged), and the saved checkpoint loads back to the same tensors."""
    from safetensors.torch import load_file

    from tests.test_roundtrip import _bytes, assert_same_weights

    src = testdata / name
    model = load(testdata, name)
    model.save_pretrained(tmp_path)
    want, got = load_file(src / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all((got[k].dtype, got[k].shape) == (t.dtype, t.shape) for k, t in want.items())
    scales, codes = requantized_on_disk(src)
    changed = {k for k, t in want.items() if _bytes(got[k]) != _bytes(t)}
    assert scales <= changed <= scales | codes
    assert bool(scales) == (name in ("quark-w8a8-int8-moe", "quark-w8a8-fp8-moe"))
    config = [json.loads((d / "config.json").read_text())["quantization_config"] for d in (src, tmp_path)]
    assert config[1] == config[0]
    assert_same_weights(model, qcompile.load(str(tmp_path)))


def sm90_rows(experts: QuantExperts, monkeypatch) -> list:
    """Compile one QuantExperts with the Experts pass told the device is a CUDA sm_90 GPU (Triton
    installed): the explain rows. Running then stops at a GPU kernel on CPU tensors, which says so."""
    import dataclasses

    from qcompile.errors import UnsupportedError
    from qcompile.kernels import registry
    from qcompile.passes import experts as pass_module

    monkeypatch.setitem(registry._AVAILABLE, "triton", True)
    query = pass_module.experts_query
    monkeypatch.setattr(pass_module, "experts_query",
                        lambda args: dataclasses.replace(query(args), device="cuda", capability=(9, 0)))
    torch._dynamo.reset()
    be = qcompile.backend(inner="eager")
    x, ids, weights = routed(experts, tokens=3)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the weight-only warning (its explain row is asserted)
            torch.compile(experts, backend=be, dynamic=False)(x.bfloat16(), ids, weights)
    except UnsupportedError as e:
        assert "needs CUDA tensors" in str(e)
    return be.rows


@pytest.mark.parametrize("name", QUARK)
def test_quark_moe_kernel_on_sm90(testdata, name, monkeypatch):
    kernel, reason = SM90_KERNELS[name]
    experts = next(iter(experts_of(load(testdata, name)).values()))
    rows = sm90_rows(experts, monkeypatch)
    assert [r.kernel for r in rows] == [kernel]
    assert reason in rows[0].reason and bool(reason) == bool(rows[0].reason)


@pytest.mark.parametrize("name", ["modelopt-w4a16-nvfp4-moe", "modelopt-w4a16-nvfp4-mixtral"])
def test_modelopt_weight_only_moe_kernel_on_sm90(testdata, name, monkeypatch):
    """ModelOpt W4A16_NVFP4 experts on a CUDA sm_90 device: the weight-only MoE, nothing dropped (no reason)."""
    rows = sm90_rows(next(iter(experts_of(load(testdata, name)).values())), monkeypatch)
    assert [(r.kernel, r.reason) for r in rows] == [("wo_moe", "")]
