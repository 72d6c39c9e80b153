"""Regenerate ``tests/data/checkpoints/llmcompressor-w4a16-actorder-moe``: the tiny Qwen3-MoE of
``base-bf16-qwen3moe-tiny`` (its weights, bit for bit) quantized by GPTQ with activation ordering
``actorder: "group"`` (each expert stores a ``weight_g_idx``). The tests only read the files.

llm-compressor 0.14.0.1 (the release of ``make_moe.py``) writes no ``weight_g_idx`` (compressed-tensors
0.19 marks ``actorder: group`` deprecated), so this runs with older releases, in transformers 4.x where
the Qwen3-MoE experts are per-expert ``nn.Linear`` modules. Versions used (the old llm-compressor pins torch <= 2.8, so it is installed without
its dependencies, which are then installed by hand)::

    python -m venv /tmp/venv-ao
    /tmp/venv-ao/bin/pip install torch==2.13.0
    /tmp/venv-ao/bin/pip install --no-deps llmcompressor==0.8.1 compressed-tensors==0.12.2
    /tmp/venv-ao/bin/pip install transformers==4.56.2 datasets==4.1.1 accelerate==1.10.1 loguru==0.7.3 \\
        pyyaml "numpy<=2.3.3" requests tqdm nvidia-ml-py "pillow<=11.3.0" "pydantic>=2"
    /tmp/venv-ao/bin/python tests/data/make_actorder_moe.py

Scheme: W4A16, symmetric int4, group size 32 (K = 128 has four groups, so the permutation matters),
``actorder: "group"``; ``lm_head`` and the routers (``mlp.gate``) are left unquantized. Calibration: the
16 windows of 64 random token ids of ``make_moe.py``, routed as the model routes them (no
``calibrate_moe_context``: were every expert to see every token, all experts of a layer would get one
Hessian and so one g_idx). The script checks what it wrote: every expert projection has a ``weight_g_idx``
that is not the identity group order, the experts of a layer have different ones, and the gate and up
projections of one expert share theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_moe import CALIB_LEN, IGNORE, OUT, VOCAB, calibration  # noqa: E402

BASE = os.path.join(OUT, "base-bf16-qwen3moe-tiny")
NAME = "llmcompressor-w4a16-actorder-moe"
GROUP = 32
SCHEME = {"targets": ["Linear"],
          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                      "actorder": "group"}}


def base_model():
    """The base checkpoint's model, rebuilt under transformers 4.x: the base's config.json is written by
    transformers 5 (``num_local_experts``, ``rope_parameters``), which 4.x reads as other keys, so the
    same config is built here under 4.x's names and the weights are loaded from the base's file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    with open(os.path.join(BASE, "config.json")) as f:
        b = json.load(f)
    cfg = Qwen3MoeConfig(hidden_size=b["hidden_size"], intermediate_size=b["intermediate_size"],
                         moe_intermediate_size=b["moe_intermediate_size"], num_experts=b["num_local_experts"],
                         num_experts_per_tok=b["num_experts_per_tok"], num_hidden_layers=b["num_hidden_layers"],
                         num_attention_heads=b["num_attention_heads"], num_key_value_heads=b["num_key_value_heads"],
                         head_dim=b["head_dim"], vocab_size=b["vocab_size"], tie_word_embeddings=True,
                         max_position_embeddings=b["max_position_embeddings"], norm_topk_prob=b["norm_topk_prob"],
                         rope_theta=b["rope_parameters"]["rope_theta"], rms_norm_eps=b["rms_norm_eps"],
                         initializer_range=b["initializer_range"], torch_dtype=torch.bfloat16)
    assert cfg.vocab_size == VOCAB
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(load_file(os.path.join(BASE, "model.safetensors")), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    # a local folder: saving looks there (not on the hub) for a recipe.yaml and python files to copy
    model.name_or_path = model.config.name_or_path = BASE
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def tokenizer():
    """oneshot wants a processor beside a dataset; the calibration windows are token ids already, so a
    word-level tokenizer of the vocabulary's size stands in (it is not saved)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   unk_token="t0", pad_token="t0")


def write(out: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    calib = calibration()
    data = Dataset.from_dict({"input_ids": [c.tolist() for c in calib],
                              "attention_mask": [[1] * len(c) for c in calib]})
    model = base_model()
    oneshot(model=model, recipe=GPTQModifier(config_groups={"group_0": SCHEME}, ignore=IGNORE), dataset=data,
            processor=tokenizer(), max_seq_length=CALIB_LEN, num_calibration_samples=len(calib),
            shuffle_calibration_samples=False, calibrate_moe_context=False)
    model.save_pretrained(out, save_compressed=True)


def check(out: str) -> None:
    """What the module doc says of the written file: every expert projection has a g_idx, not the identity
    group order, each group holding GROUP columns; the experts of a layer have different ones; gate and up
    of an expert share theirs."""
    from safetensors.torch import load_file

    t = load_file(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == "group" and weights["group_size"] == GROUP, weights
    g_idx = {k[:-len(".weight_g_idx")]: v for k, v in t.items() if ".mlp.experts." in k and k.endswith("_g_idx")}
    packed = {k.rsplit(".", 1)[0] for k in t if ".mlp.experts." in k and k.endswith(".weight_packed")}
    assert packed and set(g_idx) == packed, sorted(packed - set(g_idx))
    per_leaf: dict[tuple[str, str], set] = {}  # (layer, projection) -> its experts' distinct g_idx
    for p, g in g_idx.items():
        k = g.numel()
        assert not torch.equal(g, torch.arange(k, dtype=g.dtype) // GROUP), f"{p}: identity group order"
        assert torch.equal(torch.bincount(g.long()), torch.full((k // GROUP,), GROUP)), f"{p}: groups not full"
        layer, rest = p.split(".mlp.experts.")
        per_leaf.setdefault((layer, rest.split(".")[1]), set()).add(tuple(g.tolist()))
    experts = len({p.split(".mlp.experts.")[1].split(".")[0] for p in g_idx})
    assert all(len(s) == experts for s in per_leaf.values()), "experts of a layer share a g_idx"
    gates = [p for p in g_idx if p.endswith(".gate_proj")]
    differ = [p for p in gates if not torch.equal(g_idx[p], g_idx[p.replace(".gate_proj", ".up_proj")])]
    print(f"{len(g_idx)} expert projections, each with its own non-identity g_idx; gate and up differ in "
          f"{len(differ)} of {len(gates)} experts {differ}")
    assert not differ, "gate and up of an expert have different g_idx (qcompile refuses such a checkpoint)"


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = os.path.join(OUT, NAME)
    shutil.rmtree(out, ignore_errors=True)
    write(out)
    check(out)
    print(f"wrote {out}")
