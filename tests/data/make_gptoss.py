"""Write ``tests/data/checkpoints/gptoss-mxfp4-tiny``: a tiny gpt-oss checkpoint in the layout OpenAI
publishes gpt-oss in (``quant_method: "mxfp4"``), which no producer tool writes on a CPU. The tests only
read the files; this script documents how they were made and regenerates them::

    python tests/data/make_gptoss.py

A random-weight ``GptOssForCausalLM`` (transformers' config: hidden 64, intermediate 64, 4 experts, top-2,
2 layers, heads 2/1, head_dim 32, vocab 320) whose experts are quantized to MXFP4 and stored fused per
projection, exactly as transformers' ``integrations/mxfp4.py`` reads them:

* ``model.layers.L.mlp.experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16]: row n of expert e is the
  n-th column of the model's ``gate_up_proj[e]`` ([E, H, 2I], gate and up interleaved along 2I: even
  rows gate, odd rows up); 32 e2m1 codes per 16 bytes, the low nibble the even element;
* ``gate_up_proj_scales`` uint8 [E, 2I, H/32]: the e8m0 exponent of each group of 32 (2^(byte - 127));
* ``gate_up_proj_bias`` bf16 [E, 2I]; ``down_proj_blocks`` [E, H, I/32, 16], ``down_proj_scales``
  [E, H, I/32], ``down_proj_bias`` [E, H] the same way from ``down_proj`` [E, I, H].

Attention, routers, embeddings and ``lm_head`` stay bf16 (``modules_to_not_convert``, as in OpenAI's
config). The quantizer: each group of 32 gets the smallest power of two 2^s with max|w| / 2^s <= 6, each
element the nearest e2m1 value of w / 2^s (ties to the even code).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "checkpoints", "gptoss-mxfp4-tiny")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # code c (c < 8) is +E2M1[c], c + 8 is -E2M1[c]
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def config():
    from transformers import GptOssConfig

    return GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                        vocab_size=320, max_position_embeddings=131072, sliding_window=8, initializer_range=0.05,
                        layer_types=["sliding_attention", "full_attention"])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    x = groups / torch.exp2(exp)
    # nearest e2m1 magnitude; on a tie the even code (its mantissa bit clear), as round-to-nearest-even
    dist = (x.abs().unsqueeze(-1) - E2M1).abs()
    tie_break = torch.arange(8) % 2 * 1e-6
    code = (dist + tie_break).argmin(-1).to(torch.uint8)
    code = code | ((x < 0).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8)


def main() -> None:
    from safetensors.torch import save_file
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(config()).to(torch.bfloat16)
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            # [E, K, N] in the model -> [E, N, K] rows on disk, quantized along K
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        elif name.endswith("_bias") and ".experts." in name:
            state[name] = (torch.randn(t.shape) * 0.05).to(torch.bfloat16)  # the init leaves them zero
        else:
            state[name] = t.contiguous()
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    model.config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT}
    model.config.save_pretrained(OUT)
    save_file(state, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "mxfp4"


if __name__ == "__main__":
    main()
