"""Malformed MoE checkpoints: qcompile's own error, naming the expert and the tensor."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from qcompile.errors import CheckpointError, UnsupportedError

QWEN = "llmcompressor-fp8-static-moe"  # per-tensor FP8, Qwen3-MoE names (gate_proj / up_proj / down_proj)
MIXTRAL = "llmcompressor-fp8-dynamic-mixtral"  # per-channel FP8; llm-compressor names the experts gate/up/down_proj
E0 = "model.layers.0.mlp.experts"
M0 = "model.layers.0.block_sparse_moe.experts"


def broken(testdata, tmp_path, name, edit=None, config=None):
    """A copy of checkpoint ``name`` with its tensors edited by ``edit(state)`` and config.json by ``config``."""
    if not (testdata / name).is_dir():
        pytest.skip(f"{name} is not among the test checkpoints")
    path = tmp_path / name
    shutil.copytree(testdata / name, path)
    if edit:
        state = load_file(path / "model.safetensors")
        edit(state)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    if config:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def drop_expert(state, prefix, e):
    for key in [k for k in state if k.startswith(f"{prefix}.{e}.")]:
        del state[key]


def test_missing_expert(testdata, tmp_path):
    path = broken(testdata, tmp_path, QWEN, lambda s: drop_expert(s, E0, 2))
    with pytest.raises(CheckpointError, match=rf"{E0}\.2\.gate_proj\.weight.*missing"):
        qcompile.load(path)


def test_expert_with_another_shape(testdata, tmp_path):
    def edit(s):
        s[f"{E0}.1.down_proj.weight"] = s[f"{E0}.1.down_proj.weight"][:, :64].contiguous()
    with pytest.raises(CheckpointError, match=rf"{E0}\.1\.down_proj.*weight"):
        qcompile.load(broken(testdata, tmp_path, QWEN, edit))


def mixtral_names(state):
    """Mixtral's own per-expert names (w1 = gate, w3 = up, w2 = down), as its original checkpoints store them."""
    for key in [k for k in state if ".experts." in k]:
        for hf, mixtral in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            if f".{hf}." in key:
                state[key.replace(f".{hf}.", f".{mixtral}.")] = state.pop(key)


def test_mixtral_names_load_as_the_same_experts(testdata, tmp_path):
    renamed = qcompile.load(broken(testdata, tmp_path, MIXTRAL, mixtral_names))
    original = qcompile.load(str(testdata / MIXTRAL))
    got, want = renamed.model.layers[0].mlp.experts, original.model.layers[0].mlp.experts
    assert got.naming == ("w1", "w3", "w2")
    for role in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        assert torch.equal(getattr(got, role).float(), getattr(want, role).float())


def test_gate_and_up_scale_shapes_disagree(testdata, tmp_path):
    def edit(s):
        mixtral_names(s)
        s[f"{M0}.3.w3.weight_scale"] = s[f"{M0}.3.w3.weight_scale"][:64].contiguous()
    with pytest.raises(CheckpointError, match=rf"{M0}\.3\.w3.*weight_scale"):
        qcompile.load(broken(testdata, tmp_path, MIXTRAL, edit))


def test_more_experts_on_disk_than_the_config(testdata, tmp_path):
    path = broken(testdata, tmp_path, QWEN, config=lambda c: c.update(num_experts=3, num_local_experts=3))
    with pytest.raises(CheckpointError, match=rf"stores expert 3 \({E0}\.3\.gate_proj.*3 experts"):
        qcompile.load(path)


def test_fewer_experts_on_disk_than_the_config(testdata, tmp_path):
    path = broken(testdata, tmp_path, QWEN, config=lambda c: c.update(num_experts=5, num_local_experts=5))
    with pytest.raises(CheckpointError, match=rf"{E0}\.4\.gate_proj\.weight.*missing"):
        qcompile.load(path)


# -- Quark schemes vLLM's Quark MoE does not run: refused by qcompile, naming where and the fix ---------

QUARK_INT8, QUARK_FP8 = "quark-w8a8-int8-moe", "quark-w8a8-fp8-moe"


def quark_spec(dtype, qscheme, **kw):
    """A tensor spec as amd-quark 0.13's qwen3_moe template writes it (the fields qcompile reads)."""
    return {"dtype": dtype, "qscheme": qscheme, "is_dynamic": False, "ch_axis": None, "group_size": None,
            "symmetric": True, "scale_format": None, "scale_type": "float", "is_scale_quant": False, **kw}


# template scheme -> (weight, input_tensors), as amd-quark 0.13 exports them
QUARK_REFUSED = {
    "int4_wo_128": (quark_spec("int4", "per_group", ch_axis=-1, group_size=128), None),
    "uint4_wo_128": (quark_spec("uint4", "per_group", ch_axis=-1, group_size=128, symmetric=False), None),
    "nvfp4": ([quark_spec("fp4", "per_group", ch_axis=-1, group_size=16, symmetric=None, scale_format="float32",
                          scale_type="float32"), quark_spec("fp8_e4m3", "per_tensor", scale_type="float32",
                                                           is_scale_quant=True)],
              [quark_spec("fp4", "per_group", ch_axis=-1, group_size=16, symmetric=None, is_dynamic=True,
                          scale_format="float32", scale_type="float32"),
               quark_spec("fp8_e4m3", "per_tensor", scale_type="float32", is_scale_quant=True)]),
}


@pytest.mark.parametrize("scheme", QUARK_REFUSED)
def test_quark_schemes_without_a_moe_method_are_refused(testdata, tmp_path, scheme):
    """As vLLM (no Quark Linear or MoE method takes them): int4 / uint4 weight-only, NVFP4."""
    weight, inputs = QUARK_REFUSED[scheme]
    path = broken(testdata, tmp_path, QUARK_INT8, config=lambda c: c["quantization_config"]["global_quant_config"]
                  .update(weight=weight, input_tensors=inputs))
    key = "weight" if scheme == "nvfp4" else "weight.dtype"
    with pytest.raises(UnsupportedError, match=rf"^quantization_config\.global_quant_config\.{key}: .* Fix: ") as e:
        qcompile.load(path)
    assert ("int4_fp8" in e.value.fix) and ("NVFP4" in e.value.fix) == (scheme == "nvfp4")


def test_quark_experts_with_a_mix_vllm_does_not_run_are_refused(testdata, tmp_path):
    """Per-tensor FP8 weights with dynamic per-token activations: a Linear runs them, vLLM's Quark MoE
    does not (per tensor with per tensor, or per channel with per token)."""
    def config(c):
        experts = copy.deepcopy(c["quantization_config"]["global_quant_config"])
        experts["input_tensors"].update(qscheme="per_channel", ch_axis=1, is_dynamic=True)
        c["quantization_config"]["layer_quant_config"] = {"*.experts.*": experts}
    with pytest.raises(UnsupportedError, match=rf"^{E0}: Quark MoE experts quantized "
                                               r"w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/token .*FP8 experts run"):
        qcompile.load(broken(testdata, tmp_path, QUARK_FP8, config=config))


def test_quark_nonzero_zero_point_of_a_symmetric_scheme(testdata, tmp_path):
    def edit(s):
        s[f"{E0}.1.up_proj.weight_zero_point"] = torch.tensor(3, dtype=torch.int8)
    with pytest.raises(CheckpointError, match=rf"^{E0}\.1\.up_proj: tensor {E0}\.1\.up_proj\.weight_zero_point "
                                              "holds nonzero zero points"):
        qcompile.load(broken(testdata, tmp_path, QUARK_INT8, edit))
