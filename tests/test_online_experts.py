"""qcompile.online_experts: the HF layouts to canonical, per-expert FP8 (per-tensor [E], blocks
[E, ceil(N/b), ceil(K/b)]), and saving an online-quantized MoE model as the FP8 checkpoint it is."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import qcompile
from qcompile.errors import UnsupportedError
from qcompile.experts import ExpertsShape, QuantExperts
from qcompile.formats import parse_quant_config
from qcompile.formats.online import online_config
from qcompile.kernels import quant_math
from qcompile.online_experts import OnlineExperts, canonical_bias, canonical_expert, quantize_experts
from qcompile.scheme import parse_scheme_key

IDS = torch.tensor([[1, 17, 42, 99, 7, 250, 3]])


def _lq(scheme: str):
    return parse_quant_config(online_config(scheme)).layer


@pytest.mark.parametrize("transposed, interleaved", [(False, False), (True, False), (True, True)])
def test_canonical_layout(transposed, interleaved):
    """gate rows then up rows, whatever the HF layout (gpt-oss: transposed and interleaved)."""
    e, h, i = 3, 8, 5
    gate, up, down = torch.randn(e, i, h), torch.randn(e, i, h), torch.randn(e, h, i)
    gate_up = torch.stack((gate, up), 2).flatten(1, 2) if interleaved else torch.cat((gate, up), 1)
    shape = ExpertsShape(e, h, i, transposed, interleaved, True, "silu")
    hf_gate_up, hf_down = (gate_up.transpose(1, 2), down.transpose(1, 2)) if transposed else (gate_up, down)
    for x in range(e):
        assert torch.equal(canonical_expert(hf_gate_up, x, shape, "w13"), torch.cat((gate[x], up[x])))
        assert torch.equal(canonical_expert(hf_down, x, shape, "w2"), down[x])
    bias = torch.randn(e, 2 * i)
    hf_bias = torch.stack((bias[:, :i], bias[:, i:]), 2).flatten(1) if interleaved else bias
    assert torch.equal(canonical_bias(hf_bias, shape, "w13"), bias)


@pytest.mark.parametrize("scheme, scale_shape", [("fp8_per_tensor", (3,)), ("fp8_per_block", (3, 2, 3))])
def test_per_expert_scales(scheme, scale_shape):
    """One scale per expert, or per 128 x 128 tile with ragged edge tiles (N=200, K=300)."""
    torch.manual_seed(0)
    w = torch.randn(3, 200, 300, dtype=torch.bfloat16)
    shape = ExpertsShape(3, 300, 100, False, False, False, "silu")
    lq = _lq(scheme)
    codes, scales = quantize_experts(w, shape, "w13", lq, "experts")
    assert codes.shape == w.shape and codes.dtype == torch.float8_e4m3fn and scales.shape == scale_shape
    spec = parse_scheme_key(lq.scheme.key).weight
    for e in range(3):
        back = quant_math.dequantize_weight(codes[e], scales[e], spec, None, None, None, k=300)
        assert ((back - w[e].float()).norm() / w[e].float().norm()).item() < 0.05
        amax = w[e].float().abs().amax() if scheme == "fp8_per_tensor" else w[e, 128:, 256:].float().abs().amax()
        got = scales[e] if scheme == "fp8_per_tensor" else scales[e, 1, 2]
        assert torch.allclose(got, amax / 448)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    def make(arch: str, **extra):
        cfg = AutoConfig.for_model(arch, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=128, vocab_size=256,
                                   num_experts_per_tok=2, max_position_embeddings=256, **extra)
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(arch)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
        return path
    return make


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_block"])
def test_online_moe_saves_and_loads_back(scheme, moe_checkpoint, tmp_path):
    model = qcompile.load(str(moe_checkpoint("qwen3_moe", num_experts=4, moe_intermediate_size=128)), online=scheme)
    assert isinstance(model.model.layers[0].mlp.experts, OnlineExperts)
    model.save_pretrained(tmp_path)
    back = qcompile.load(str(tmp_path))
    experts = back.model.layers[0].mlp.experts
    assert type(experts) is QuantExperts and experts.scheme_key == model.model.layers[0].mlp.experts.scheme_key
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        assert torch.equal(getattr(experts, name), getattr(model.model.layers[0].mlp.experts, name)), name
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, model(IDS).logits)


def test_interleaved_experts_are_not_saved(moe_checkpoint, tmp_path):
    model = qcompile.load(str(moe_checkpoint("gpt_oss", num_local_experts=4)), online="fp8_per_tensor")
    with pytest.raises(UnsupportedError, match="model.layers.0.mlp.experts.*cannot be saved"):
        model.save_pretrained(tmp_path)
