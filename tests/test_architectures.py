"""Any HF decoder: tiny random configs of 22 architectures load with online FP8 at load, compile with no
graph break and match the eager model. One rule decides what is a linear (``qcompile.modules``):
GPT-2's Conv1D projections are quantized, Llama-4's router (an ``nn.Linear`` subclass with a forward of
its own) and every router / gate are not, by either online path. MoE experts are quantized by both
paths too (QuantExperts at load, one experts op per MoE layer at compile time), to the same numbers."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import qcompile
from qcompile.experts import QuantExperts, is_experts
from qcompile.linear import QuantLinear
from qcompile.modules import is_router, linear_shape
from qcompile.passes.fuse_linears import shard_names

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MOE = dict(num_experts_per_tok=2)
ARCHS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "gemma2": {"head_dim": 32},
    "gemma3_text": {"head_dim": 32}, "phi3": {}, "granite": {}, "olmo2": {}, "cohere": {}, "stablelm": {},
    "falcon": {"num_kv_heads": 2, "new_decoder_architecture": True}, "gpt_neox": {},
    "gpt2": {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256}, "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128},
    "qwen2_moe": {**MOE, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256, "num_experts": 4},
    "qwen3_moe": {**MOE, "moe_intermediate_size": 128, "num_experts": 4, "head_dim": 32},
    "mixtral": {**MOE, "num_local_experts": 4}, "olmoe": {**MOE, "num_experts": 4},
    "deepseek_v3": {**MOE, "num_key_value_heads": 4, "moe_intermediate_size": 128, "n_routed_experts": 4, "n_group": 1,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 64, "kv_lora_rank": 64,
                    "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_shared_experts": 1},
    "gpt_oss": {**MOE, "num_local_experts": 4, "head_dim": 32, "sliding_window": 64},
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 256, "head_dim": 32},
}
MOE_ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "llama4_text"]
IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 64]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def make(arch: str):
        cfg = AutoConfig.for_model(arch, **{**SMALL, **ARCHS[arch]})
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(arch)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
        return path
    return make


@pytest.mark.parametrize("arch", list(ARCHS))
def test_online_fp8_at_load_compiles_and_matches(arch, checkpoint):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qcompile.load(str(checkpoint(arch)), online="fp8_per_tensor").eval()
    assert not [w for w in caught if "stay in" in str(w.message)], "a coverage warning fired"
    experts = {name for name, m in model.named_modules() if isinstance(m, QuantExperts)}
    assert bool(experts) == (arch in MOE_ARCHS)
    assert not [name for name, m in model.named_modules() if is_experts(m)], "experts left in bf16"
    names = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)} | experts
    assert names, "nothing was quantized"
    assert not [n for n in names if is_router(n)], "a router was quantized"
    plain = [name for name, m in model.named_modules()
             if linear_shape(m) is not None and not is_router(name, m) and "lm_head" not in name]
    assert not plain, f"linears left unquantized: {plain[:4]}"
    with torch.no_grad():
        want = model(IDS).logits
        torch._dynamo.reset()
        assert torch._dynamo.explain(model)(IDS).graph_break_count == 0
        torch._dynamo.reset()
        be = qcompile.backend(inner="aot_eager", fuse=False)  # fused shards share one per-tensor scale
        got = torch.compile(model, backend=be)(IDS).logits
    assert {r.module for r in be.rows} >= names
    assert torch.equal(got, want)  # aot_eager runs the same reference ops


@pytest.mark.parametrize("arch", ["gpt2"] + MOE_ARCHS)
def test_online_fp8_at_compile_time_quantizes_the_same_layers(arch, checkpoint):
    """The compile-time path quantizes what the load-time path does: Conv1D included, routers and gates
    (Qwen2-MoE's shared_expert_gate too) kept in high precision, each MoE layer's experts as one experts
    op (whatever layout: gpt-oss's interleaved, Llama-4's dense), and computes the same numbers."""
    path = checkpoint(arch)
    loaded = qcompile.load(str(path), online="fp8_per_tensor").eval()
    at_load = {name for name, m in loaded.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    moe_layers = [name for name, m in model.named_modules() if is_experts(m)]
    torch._dynamo.reset()
    be = qcompile.backend(online="fp8_per_tensor", inner="aot_eager", fuse=False)  # shards keep their own scales
    with torch.no_grad():
        want = model(IDS).logits
        got = torch.compile(model, backend=be)(IDS).logits
        assert torch.equal(got, loaded(IDS).logits)  # the same quantized tensors, the same reference ops
    at_compile = {m for r in be.rows if r.kernel != "bf16" for m in shard_names(r.module)}
    assert at_compile == at_load
    assert sorted(r.module for r in be.rows if r.op.endswith("experts_ref")) == moe_layers
    assert all(r.reason.startswith("router") for r in be.rows if is_router(r.module))
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.15  # FP8 W and A, random model
