"""The FP8 writers reproduce the producers' bytes from the same bf16 weights (4-bit: test_synth_4bit.py),
MoE experts and routers under each producer's names, and write the same bytes from a model in memory on
any device as through the checkpoint on disk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import qcompile
from qcompile import synth
from qcompile.experts import QuantExperts

MIXTRAL = "base-bf16-mixtral-tiny"


def tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one file or shards), fp8 viewed as bytes."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return out


def assert_same(ours: dict, theirs: dict, skip: str = "\0") -> None:
    assert {k for k in ours if skip not in k} == {k for k in theirs if skip not in k}
    for key, b in theirs.items():
        if skip in key:
            continue
        a = ours[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


@pytest.mark.parametrize("fmt,source,producer", [
    ("modelopt-fp8", "base-bf16-dense", "modelopt-fp8-dense"),
    ("ct-fp8-dynamic", "base-bf16-dense", "llmcompressor-fp8-dynamic-dense"),
    ("modelopt-fp8", "base-bf16-moe", "modelopt-fp8-moe"),
    ("ct-fp8-dynamic", "base-bf16-moe", "llmcompressor-fp8-dynamic-moe"),
    ("ct-nvfp4", "base-bf16-moe", "llmcompressor-nvfp4-moe"),
    ("modelopt-nvfp4", "base-bf16-moe", "modelopt-nvfp4-moe"),
    ("modelopt-w4a16-nvfp4", "base-bf16-qwen3moe-tiny", "modelopt-w4a16-nvfp4-moe"),
    ("quark-mxfp4", "base-bf16-moe", "quark-w-mxfp4-moe"),
    # a Mixtral: ModelOpt writes block_sparse_moe.experts.E.w1 / w3 / w2, llm-compressor gate / up / down_proj
    # under block_sparse_moe; both ignore the routers as block_sparse_moe.gate (weight-only or dynamic
    # activations: nothing calibrated, every tensor comparable)
    ("modelopt-w4a16-nvfp4", MIXTRAL, "modelopt-w4a16-nvfp4-mixtral"),
    ("ct-w4a16", MIXTRAL, "llmcompressor-w4a16-mixtral"),
    ("ct-fp8-dynamic", MIXTRAL, "llmcompressor-fp8-dynamic-mixtral")])
def test_writer_is_byte_identical_to_the_producer(testdata, tmp_path, fmt, source, producer):
    """Same tensors (codes, scales, global scales; MoE: per expert, gate and up sharing a global scale) and
    the same quantization config, routers ignored as the producers list them."""
    synth.write_checkpoint(str(tmp_path), fmt, source=str(testdata / source))
    # input scales (and NVFP4 input global scales) are calibrated on other tokens
    assert_same(tensors(tmp_path), tensors(testdata / producer), skip="input")
    for name in ("config.json", "hf_quant_config.json") if fmt.startswith("modelopt") else ("config.json",):
        ours, theirs = (json.loads((d / name).read_text()) for d in (tmp_path, testdata / producer))
        assert ours.get("quantization_config") == theirs.get("quantization_config")
        assert ours.get("quantization") == theirs.get("quantization"), name


def test_moe_expert_scales_follow_modelopt(tmp_path, testdata):
    """An expert's gate and up share one weight scale; every expert of a layer has the same input scales."""
    synth.write_checkpoint(str(tmp_path), "modelopt-fp8", source=str(testdata / "base-bf16-moe"))
    t = tensors(tmp_path)
    pre = "model.layers.1.mlp.experts"
    assert torch.equal(t[f"{pre}.3.gate_proj.weight_scale"], t[f"{pre}.3.up_proj.weight_scale"])
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert len({t[f"{pre}.{e}.{proj}.input_scale"].item() for e in range(8)}) == 1
    assert t[f"{pre}.0.gate_proj.input_scale"].item() != t[f"{pre}.0.down_proj.input_scale"].item()


def test_mixtral_bf16_is_what_transformers_saves(testdata, tmp_path):
    """bf16 from a Mixtral in memory: the tensors save_pretrained wrote (Mixtral's own names), so that
    transformers loads its experts back."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(testdata / MIXTRAL), dtype=torch.bfloat16)
    synth.write_model(str(tmp_path), model, "bf16")
    assert_same(tensors(tmp_path), tensors(testdata / MIXTRAL))


MIXTRAL_OWN, HF = ("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("fmt,naming", [("modelopt-w4a16-nvfp4", MIXTRAL_OWN), ("modelopt-fp8", MIXTRAL_OWN),
                                        ("modelopt-mixed", MIXTRAL_OWN), ("ct-w4a16", HF), ("ct-fp8-dynamic", HF)])
def test_mixtral_producer_names_load_as_the_in_memory_names(testdata, tmp_path, monkeypatch, fmt, naming):
    """A Mixtral under its producer's names loads into the same QuantExperts (and every other tensor) as
    under transformers' in-memory names (mlp.experts.E.{gate,up,down}_proj, routers mlp.gate)."""
    synth.write_checkpoint(str(tmp_path / "producer"), fmt, source=str(testdata / MIXTRAL))
    monkeypatch.setattr(synth, "MOE_DISK_NAMES", {})
    synth.write_checkpoint(str(tmp_path / "in-memory"), fmt, source=str(testdata / MIXTRAL))
    on_disk = {d: set(tensors(tmp_path / d)) for d in ("producer", "in-memory")}
    assert f"model.layers.1.block_sparse_moe.experts.3.{naming[2]}.weight_scale" in on_disk["producer"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale" in on_disk["in-memory"]
    assert not any(".mlp." in k for k in on_disk["producer"])
    models = {d: qcompile.load(str(tmp_path / d)) for d in on_disk}
    experts = {d: [m for m in model.modules() if isinstance(m, QuantExperts)] for d, model in models.items()}
    assert len(experts["producer"]) == 2 and [m.naming for m in experts["producer"]] == [naming] * 2
    got, want = (dict(models[d].state_dict()) for d in ("producer", "in-memory"))
    assert set(got) == set(want) and any(".experts." in k for k in got)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_moe_disk_names_by_architecture_and_producer():
    """Only Mixtral departs from the in-memory names, and only for the producers whose files show it."""
    layer = "model.layers.0.mlp"
    names = [f"{layer}.experts.2.gate_proj.weight", f"{layer}.experts.2.up_proj.weight_scale",
             f"{layer}.experts.2.down_proj", f"{layer}.gate", "model.layers.0.self_attn.q_proj.weight", "lm_head"]
    rename = synth.moe_disk_names("mixtral", "modelopt-nvfp4")
    block = "model.layers.0.block_sparse_moe"
    assert [rename(n) for n in names] == [f"{block}.experts.2.w1.weight", f"{block}.experts.2.w3.weight_scale",
                                          f"{block}.experts.2.w2", f"{block}.gate", *names[4:]]
    assert synth.moe_disk_names("mixtral", "bf16")(names[0]) == rename(names[0])
    assert [synth.moe_disk_names("mixtral", "ct-nvfp4")(n) for n in names[:4]] == [
        n.replace(".mlp.", ".block_sparse_moe.") for n in names[:3]] + ["model.layers.0.block_sparse_moe.gate"]
    assert synth.moe_disk_names("qwen3_moe", "modelopt-fp8") is None
    assert synth.moe_disk_names("mixtral", "quark-mxfp4") is None


def in_memory_model(device: str, moe: bool = False):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = synth.tiny_llama_config() if not moe else Qwen3MoeConfig(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=384)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()


@pytest.mark.parametrize("fmt", ["modelopt-fp8", "modelopt-fp8-pcpt", "ct-w4a16", "ct-nvfp4", "ct-w8a8-int8"])
def test_in_memory_writer_matches_the_checkpoint_writer(tmp_path, fmt):
    """write_model from a model in memory (sharded) writes the bytes write_checkpoint writes through disk."""
    synth.write_checkpoint(str(tmp_path / "disk"), fmt)
    synth.write_model(str(tmp_path / "mem"), in_memory_model("cpu"), fmt, max_shard_bytes=300_000)
    assert len(list((tmp_path / "mem").glob("model-*-of-*.safetensors"))) > 1
    index = json.loads((tmp_path / "mem" / "model.safetensors.index.json").read_text())
    mem = tensors(tmp_path / "mem")
    assert set(index["weight_map"]) == set(mem)
    # the seeded model of write_checkpoint is the same model: same bytes, same quantization config
    assert_same(mem, tensors(tmp_path / "disk"))
    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("mem", "disk"))
    assert ours["quantization_config"] == theirs["quantization_config"]


def test_moe_writer_refuses_formats_it_does_not_cover(tmp_path):
    with pytest.raises(ValueError, match="MoE writer"):
        synth.write_model(str(tmp_path), in_memory_model("cpu", moe=True), "ct-fp8-block")


def test_writer_refuses_a_directory_of_another_model(tmp_path):
    """A checkpoint written into a directory that holds another model's config.json is refused (its tensors would
    be loaded against the wrong shapes); one of the same model is rewritten, its ModelOpt config and its
    quantization config dropped when the new format has none."""
    synth.write_model(str(tmp_path), in_memory_model("cpu"), "modelopt-fp8")
    assert (tmp_path / "hf_quant_config.json").exists()
    synth.write_model(str(tmp_path), in_memory_model("cpu"), "ct-w4a16")
    assert not (tmp_path / "hf_quant_config.json").exists()
    synth.write_model(str(tmp_path), in_memory_model("cpu"), "bf16")
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(qcompile.errors.ConfigError, match="has no quantization config"):  # loads as bf16 only
        qcompile.load(str(tmp_path))
    other = in_memory_model("cpu")
    other.config.num_hidden_layers += 1
    with pytest.raises(qcompile.errors.ConfigError, match=r"config.json: describes another model: "
                       r"num_hidden_layers 2 \(the model: 3\).* Fix: write the checkpoint into an empty directory"):
        synth.write_model(str(tmp_path), other, "ct-w4a16")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,moe", [("modelopt-fp8", False), ("modelopt-fp8-pcpt", False), ("ct-w4a16", False),
                                     ("ct-nvfp4", False), ("modelopt-nvfp4", False), ("ct-w8a8-int8", False),
                                     ("modelopt-fp8", True), ("ct-w4a16", True), ("ct-nvfp4", True)])
def test_cuda_writer_writes_the_cpu_bytes(tmp_path, fmt, moe):
    """Quantizing on the GPU gives the CPU's bytes (calibration aside: the input scales may differ by the
    GPU's bf16 matmul rounding)."""
    model = in_memory_model("cpu", moe)
    synth.write_model(str(tmp_path / "cpu"), model, fmt)
    synth.write_model(str(tmp_path / "cuda"), model.cuda(), fmt)
    assert_same(tensors(tmp_path / "cuda"), tensors(tmp_path / "cpu"), skip="input")
