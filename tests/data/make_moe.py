"""Regenerate the tiny MoE checkpoints of ``tests/data/checkpoints/`` listed in ``tests/data/README.md``
(``base-bf16-*-tiny`` and the producers' quantized copies). The tests only read the files.

Run it with the producers in their own environment (as ``make_trained.py`` says)::

    python -m venv --system-site-packages /tmp/venv-prod
    /tmp/venv-prod/bin/pip install "llmcompressor==0.14.*" "nvidia-modelopt==0.47.*" "amd-quark==0.13.*"
    /tmp/venv-prod/bin/python tests/data/make_moe.py              # every output
    /tmp/venv-prod/bin/python tests/data/make_moe.py quark-w8a8-int8-moe   # one again

Random-weight models (no training), calibrated on 16 windows of 64 random token ids; ``lm_head`` and
the routers (``mlp.gate``) are left unquantized. Models: a tiny Qwen3-MoE (hidden 128, 4 experts,
top-2, moe_intermediate 128, 2 layers), a tiny Mixtral (same sizes, ``block_sparse_moe.experts.E.w1 /
w2 / w3``) and a tiny DeepSeek-V3 (hidden 256, moe_intermediate 192, kv_lora_rank 128 + rope 64 = 192
rows of ``kv_a_proj_with_mqa``, q_lora_rank 192, one dense layer, one shared expert): every
dimension of the last that is not a multiple of 128 makes partial 128-blocks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "checkpoints")
VOCAB = 320
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]
CALIB_SAMPLES, CALIB_LEN = 16, 64


def qwen3_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                          num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=64, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=512,
                          norm_topk_prob=True, initializer_range=0.05)


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=512,
                         initializer_range=0.05)


def deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=256, intermediate_size=384, moe_intermediate_size=192, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                            topk_group=1, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64,
                            v_head_dim=64, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=512,
                            initializer_range=0.05)


BASES = {"base-bf16-qwen3moe-tiny": qwen3_config, "base-bf16-mixtral-tiny": mixtral_config,
         "base-bf16-deepseekv3-tiny": deepseek_config}


def write_base(name: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BASES[name](), dtype=torch.bfloat16)
    model.save_pretrained(os.path.join(OUT, name))


def calibration() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (CALIB_LEN,), generator=g) for _ in range(CALIB_SAMPLES)]


def load_base(base: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(OUT, base), dtype=torch.bfloat16)


def llmcompressor(scheme, modifier: str = "rtn", calibrate: bool = True):
    """``oneshot`` with ``scheme`` (a preset name or a QuantizationScheme dict) on every Linear."""
    def run(base: str, out: str) -> None:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

        cls = {"gptq": GPTQModifier, "rtn": QuantizationModifier}[modifier]
        recipe = cls(targets="Linear", scheme=scheme, ignore=IGNORE) if isinstance(scheme, str) else \
            cls(config_groups={"group_0": dict(scheme, targets=["Linear"])}, ignore=IGNORE)
        model = load_base(base)
        kw = {}
        if calibrate:
            from datasets import Dataset

            calib = calibration()
            kw = dict(dataset=Dataset.from_dict({"input_ids": [c.tolist() for c in calib],
                                                 "attention_mask": [[1] * len(c) for c in calib]}),
                      max_seq_length=CALIB_LEN, num_calibration_samples=len(calib), shuffle_calibration_samples=False)
        oneshot(model=model, recipe=recipe, **kw)
        model.save_pretrained(out, save_compressed=True)
    return run


def modelopt(cfg_name: str):
    def run(base: str, out: str) -> None:
        import copy

        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        def forward_loop(m):
            with torch.no_grad():
                for c in calibration():
                    m(c[None])

        cfg = copy.deepcopy(getattr(mtq, cfg_name))
        cfg["quant_cfg"].append({"quantizer_name": "*mlp.gate.*", "enable": False})  # the routers
        model = mtq.quantize(load_base(base), cfg, forward_loop)
        export_hf_checkpoint(model, export_dir=out)
    return run


def quark(scheme, template: str = "qwen3_moe"):
    """``scheme``: a name of the template's, or a function returning a Quark ``QLayerConfig`` (a custom
    global config, for schemes the template does not name)."""
    def run(base: str, out: str) -> None:
        from llmcompressor.modeling.moe.linearize import linearize_moe
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

        # Quark quantizes nn.Linear modules only: the fused experts are split into per-expert Linears first
        # (llm-compressor's linearize_moe), so that they are quantized and exported per expert.
        name = scheme if isinstance(scheme, str) else "int8"
        config = LLMTemplate.get(template).get_config(scheme=name, exclude_layers=["lm_head", "*mlp.gate"])
        if not isinstance(scheme, str):
            config.global_quant_config = scheme()
        quantizer = ModelQuantizer(config)
        model = quantizer.quantize_model(linearize_moe(load_base(base)), [c[None] for c in calibration()])
        model = quantizer.freeze(model)
        export_safetensors(model, out)
    return run


def quark_int8_channel_token():
    """INT8 W8A8 with per-channel weights and dynamic per-token activations (the template's ``int8`` is
    per tensor), both symmetric."""
    from quark.torch.quantization.config.config import Int8PerChannelSpec, QLayerConfig

    return QLayerConfig(weight=Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec(),
                        input_tensors=Int8PerChannelSpec(ch_axis=1, symmetric=True,
                                                         is_dynamic=True).to_quantization_spec())


def _ct_args(type_: str, bits: int, strategy: str, dynamic=False, group=None, block=None, symmetric=True,
             actorder=None):
    return {"num_bits": bits, "type": type_, "strategy": strategy, "dynamic": dynamic, "group_size": group,
            "block_structure": block, "symmetric": symmetric, "actorder": actorder}


FP8_STATIC = {"weights": _ct_args("float", 8, "tensor"), "input_activations": _ct_args("float", 8, "tensor")}
FP8_DYN_TENSOR = {"weights": _ct_args("float", 8, "tensor"),
                  "input_activations": _ct_args("float", 8, "tensor", dynamic=True)}
W4A8_INT = {"weights": _ct_args("int", 4, "group", group=32),
            "input_activations": _ct_args("int", 8, "token", dynamic=True)}

# output -> (base, producer)
PRODUCERS = {
    "llmcompressor-fp8-static-moe": ("base-bf16-qwen3moe-tiny", llmcompressor(FP8_STATIC)),
    "llmcompressor-fp8-dyntensor-moe": ("base-bf16-qwen3moe-tiny", llmcompressor(FP8_DYN_TENSOR, calibrate=False)),
    "llmcompressor-fp8-block-moe": ("base-bf16-qwen3moe-tiny", llmcompressor("FP8_BLOCK", calibrate=False)),
    "llmcompressor-nvfp4a16-moe": ("base-bf16-qwen3moe-tiny", llmcompressor("NVFP4A16", calibrate=False)),
    "llmcompressor-w8a16-moe": ("base-bf16-qwen3moe-tiny", llmcompressor("W8A16", calibrate=False)),

    "llmcompressor-w4a8-moe": ("base-bf16-qwen3moe-tiny", llmcompressor(W4A8_INT, calibrate=False)),
    "modelopt-mxfp8-moe": ("base-bf16-qwen3moe-tiny", modelopt("MXFP8_DEFAULT_CFG")),
    "modelopt-w4a16-nvfp4-moe": ("base-bf16-qwen3moe-tiny", modelopt("W4A16_NVFP4_CFG")),
    "modelopt-w4a16-nvfp4-mixtral": ("base-bf16-mixtral-tiny", modelopt("W4A16_NVFP4_CFG")),
    "quark-w8a8-int8-moe": ("base-bf16-qwen3moe-tiny", quark("int8")),
    "quark-w-mxfp4-a-mxfp4-moe": ("base-bf16-qwen3moe-tiny", quark("mxfp4")),
    "quark-w-mxfp4-a-fp8-moe": ("base-bf16-qwen3moe-tiny", quark("mxfp4_fp8")),
    "quark-w-mxfp6-e3m2-moe": ("base-bf16-qwen3moe-tiny", quark("mxfp6_e3m2")),
    "quark-w-mxfp6-e2m3-moe": ("base-bf16-qwen3moe-tiny", quark("mxfp6_e2m3")),
    "quark-w-mxfp4-a-mxfp6-e2m3-moe": ("base-bf16-qwen3moe-tiny", quark("mxfp4_mxfp6_e2m3")),
    "quark-w8a8-fp8-moe": ("base-bf16-qwen3moe-tiny", quark("fp8")),
    "quark-ptpc-fp8-moe": ("base-bf16-qwen3moe-tiny", quark("ptpc_fp8")),
    "quark-w-int4-a-fp8-moe": ("base-bf16-qwen3moe-tiny", quark("int4_fp8")),
    "quark-w8a8-int8-channel-moe": ("base-bf16-qwen3moe-tiny", quark(quark_int8_channel_token)),
    "llmcompressor-fp8-dynamic-mixtral": ("base-bf16-mixtral-tiny", llmcompressor("FP8_DYNAMIC", calibrate=False)),
    "llmcompressor-w4a16-mixtral": ("base-bf16-mixtral-tiny", llmcompressor("W4A16", calibrate=False)),
    "llmcompressor-fp8-block-deepseekv3": ("base-bf16-deepseekv3-tiny", llmcompressor("FP8_BLOCK", calibrate=False)),
}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Regenerate the tiny MoE checkpoints (see the module docstring).")
    ap.add_argument("only", nargs="*", help="outputs to write (default: all)")
    args = ap.parse_args()
    names = args.only or list(BASES) + list(PRODUCERS)
    unknown = sorted(set(names) - set(PRODUCERS) - set(BASES))
    if unknown:
        ap.error(f"unknown output(s) {unknown}; choose from {sorted(BASES) + sorted(PRODUCERS)}")
    torch.set_num_threads(1)
    for name in names:
        out = os.path.join(OUT, name)
        try:
            if name in BASES:
                write_base(name)
            else:
                base, run = PRODUCERS[name]
                shutil.rmtree(out, ignore_errors=True)
                run(base, out)
            print(f"wrote {out}", flush=True)
        except Exception as e:  # one producer failing does not stop the others
            print(f"FAILED {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
