"""Malformed MoE checkpoints: qcompile's own error, naming the expert and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from qcompile.errors import CheckpointError

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
