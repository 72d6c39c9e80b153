"""``save_pretrained`` of a qcompile-loaded model writes its checkpoint back in the producer's format:
the same tensors (names, dtypes, shapes, bytes) and the same config, also after a GPU load's tiling and
act-order sort; an online FP8 model is written as the compressed-tensors checkpoint it now is."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from qcompile import synth
from qcompile.errors import UnsupportedError
from qcompile.experts import QuantExperts
from qcompile.linear import QuantLinear, dequantize_model

QUANTIZED_FORMATS = [f for f in synth.FORMATS if f != "bf16"]
PRODUCER_DENSE = ["llmcompressor-fp8-dynamic-dense", "llmcompressor-nvfp4-dense", "llmcompressor-w4a16-gptq-dense",
                  "modelopt-fp8-dense", "modelopt-nvfp4-dense", "quark-w-mxfp4-dense"]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_checkpoint(src: Path, out: Path) -> None:
    """The tensors (names, dtypes, shapes, bytes), config.json's quantization_config and any
    hf_quant_config.json of ``out`` are ``src``'s."""
    want, got = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert _bytes(got[name]) == _bytes(t), name
    config = [json.loads((d / "config.json").read_text()).get("quantization_config") for d in (src, out)]
    assert config[1] == config[0]
    if (src / "hf_quant_config.json").exists():
        assert (out / "hf_quant_config.json").read_bytes() == (src / "hf_quant_config.json").read_bytes()
    else:
        assert not (out / "hf_quant_config.json").exists()


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name, t in sa.items():
        assert sb[name].dtype == t.dtype and _bytes(sb[name]) == _bytes(t), name


def gpu_layout(model) -> int:
    """What a GPU load does where wo_mma runs a layer, here on the CPU for every layer: the layouts wo_mma
    declares (act-order weights sorted by group, then tiled), by QuantLinear.apply_layouts. Returns the layers
    changed."""
    from qcompile.kernels.wo_gemm import WO_MMA

    changed = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            before = m.scheme_key
            m.apply_layouts(lambda scheme: WO_MMA)
            changed += m.scheme_key != before
    return changed


def act_order_checkpoint(src: Path, path: Path, seed: int = 0) -> Path:
    """``src`` (compressed-tensors int4 group-quantized) with actorder "group": every layer gets a random
    weight_g_idx that gives each group its group_size columns (what a GPU load can sort)."""
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights["actorder"] = "group"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith(".weight_shape")]:
        k = int(state[name][1])
        groups = torch.arange(k, dtype=torch.int32) // weights["group_size"]
        state[name.replace("weight_shape", "weight_g_idx")] = groups[torch.randperm(k, generator=g)]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def round_trip(src: Path, out: Path):
    model = qcompile.load(str(src))
    model.save_pretrained(out)
    assert_same_checkpoint(src, out)
    return model


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_synthetic_checkpoint_round_trips(fmt, synth_ckpt, tmp_path):
    src = synth_ckpt(fmt)
    model = round_trip(src, tmp_path / "saved")
    assert_same_weights(model, qcompile.load(str(tmp_path / "saved")))
    # a GPU load's layout (tiled words) is undone on save
    assert gpu_layout(model) > 0
    assert all("/tiled" in m.scheme_key for m in model.modules() if isinstance(m, QuantLinear))
    model.save_pretrained(tmp_path / "tiled")
    assert_same_checkpoint(src, tmp_path / "tiled")


@pytest.mark.parametrize("name", PRODUCER_DENSE)
def test_producer_checkpoint_round_trips(name, testdata, tmp_path):
    round_trip(testdata / name, tmp_path / "saved")


@pytest.mark.parametrize("name", PRODUCER_DENSE)
def test_compiled_model_round_trips(name, testdata, tmp_path):
    """Compiling fuses q/k/v and gate/up into shared storage (the shards view it): saving still writes each
    shard's tensors. The checkpoint is the producer's, but where ModelOpt's per-tensor FP8 shards were
    requantized to their largest scale (as the compiled model runs them): those shards' weights and
    scales are the requantized ones, which load back as the eager model now holds them."""
    src = testdata / name
    model = qcompile.load(str(src))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=qcompile.backend(inner="eager"))(torch.tensor([[1, 17, 42, 99]]))
    model.save_pretrained(tmp_path)
    assert_same_weights(model, qcompile.load(str(tmp_path)))
    if name != "modelopt-fp8-dense":
        assert_same_checkpoint(src, tmp_path)
        return
    want, got = load_file(src / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    changed = {k.rsplit(".", 2)[-2] for k in want if _bytes(got[k]) != _bytes(want[k])}
    assert changed and changed <= {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, changed


def test_act_order_sorted_and_tiled_round_trips(synth_ckpt, tmp_path):
    src = act_order_checkpoint(synth_ckpt("ct-w4a16"), tmp_path / "src")
    model = round_trip(src, tmp_path / "saved")
    x = torch.randint(3, 300, (1, 6))
    want = model(x).logits
    gpu_layout(model)
    keys = {m.scheme_key for m in model.modules() if isinstance(m, QuantLinear)}
    assert keys == {"w=int4/group128/pack=int32/tiled/ksorted;a=none"}, keys
    assert torch.equal(model(x).logits, want)  # the reference op runs the sorted, tiled layout exactly
    model.save_pretrained(tmp_path / "sorted")
    assert_same_checkpoint(src, tmp_path / "sorted")


@pytest.mark.parametrize("layouts,flags", [((), "actorder"), (("ksorted",), "ksorted"), (("tiled",), "actorder"),
                                           (("ksorted", "tiled"), "tiled/ksorted")])
def test_layouts_follow_the_kernel(layouts, flags, synth_ckpt, tmp_path):
    """A layer makes the layouts its kernel declares (Kernel.layouts), none other: an act-order weight is sorted
    only for a kernel that wants ``ksorted`` (else left as it is, tiled or not), then tiled for ``tiled``."""
    import types

    src = act_order_checkpoint(synth_ckpt("ct-w4a16"), tmp_path / "src")
    kernel = types.SimpleNamespace(layouts=layouts)
    model = qcompile.load(str(src))
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m.apply_layouts(lambda scheme: kernel)
    assert {m.scheme_key for m in layers} == {f"w=int4/group128/pack=int32/{flags};a=none"}
    plain = qcompile.load(str(synth_ckpt("ct-w4a16")))
    for m in (m for m in plain.modules() if isinstance(m, QuantLinear)):
        m.apply_layouts(lambda scheme: kernel)
        assert ("/tiled" in m.scheme_key) == ("tiled" in layouts)


def test_trained_modelopt_w4a16_nvfp4_round_trips(tmp_path):
    """ModelOpt W4A16_NVFP4 (no input_scale on disk) of the trained Llama: written back as the producer wrote
    it, eager and after compiling (q/k/v and gate/up fused into shared storage)."""
    from tests.trained_util import TRAINED

    src = TRAINED / "modelopt-w4a16-nvfp4"
    model = round_trip(src, tmp_path / "eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=qcompile.backend(inner="eager"))(torch.tensor([[1, 17, 42, 99]]))
    model.save_pretrained(tmp_path / "compiled")
    assert_same_checkpoint(src, tmp_path / "compiled")


@pytest.mark.parametrize("name", ["llmcompressor-w4a16-gptq-moe", "modelopt-nvfp4-moe", "modelopt-w4a16-nvfp4-moe",
                                  "modelopt-w4a16-nvfp4-mixtral", "quark-w-mxfp4-moe"])
def test_tiled_experts_round_trip(name, testdata, tmp_path):
    """A GPU load tiles weight-only experts for wo_mma's grouped build (QuantExperts._tile, done here on the
    CPU): the reference op runs the tiled layout exactly, and saving writes the producer's tensors."""
    src = testdata / name
    model = qcompile.load(str(src))
    x = torch.randint(3, 300, (1, 6))
    want = model(x).logits
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m._tile() for m in experts)
    assert all("/tiled" in m.scheme_key for m in experts)
    assert torch.equal(model(x).logits, want)
    model.save_pretrained(tmp_path)
    assert_same_checkpoint(src, tmp_path)


def _fp32_reciprocal_not_involutive(n: int, seed: int = 0) -> torch.Tensor:
    """n positive fp32 values x with 1 / (1 / x) != x (in fp32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(64 * n, generator=g) * 1000 + 1
    return x[1.0 / (1.0 / x) != x][:n]


def test_reciprocal_scales_are_written_as_stored(synth_ckpt, tmp_path):
    """compressed-tensors' fp32 global scales are stored reciprocal; 1 / (1 / x) is not x for ~17% of fp32
    x, yet every stored value comes back, and a changed canonical scale is written as its reciprocal."""
    src = tmp_path / "src"
    shutil.copytree(synth_ckpt("ct-nvfp4"), src)
    state = load_file(src / "model.safetensors")
    names = [n for n in state if n.endswith("global_scale")]
    for name, x in zip(names, _fp32_reciprocal_not_involutive(len(names))):
        state[name] = x.reshape(state[name].shape)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    model = round_trip(src, tmp_path / "saved")
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    layer.weight_global_scale.data.mul_(2)
    assert torch.equal(layer.disk_tensors()["weight_global_scale"], (1.0 / layer.weight_global_scale).reshape(1))


def test_bf16_reciprocals_are_exact_in_fp32():
    """Why only fp32 reciprocals need their stored value: every positive finite bf16 x whose fp32
    reciprocal is finite comes back from 1 / (1 / x) computed in fp32."""
    x = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()
    x = x[torch.isfinite(1.0 / x)]
    assert torch.equal((1.0 / (1.0 / x)).bfloat16().float(), x)


@pytest.mark.parametrize("online", ["fp8_per_tensor", "fp8_per_block"])
def test_online_model_saves_as_compressed_tensors(online, synth_ckpt, tmp_path):
    model = qcompile.load(str(synth_ckpt("bf16")), online=online)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "float-quantized")
    assert "lm_head" in config["ignore"] and "model.layers.0.mlp.down_proj" not in config["ignore"]
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    again = qcompile.load(str(tmp_path))
    assert_same_weights(model, again)
    keys = [{m.scheme_key for m in x.modules() if isinstance(m, QuantLinear)} for x in (model, again)]
    assert keys[0] == keys[1] and len(keys[0]) == 1
    ids = torch.randint(3, 300, (1, 6))
    assert torch.equal(model(ids).logits, again(ids).logits)


def test_replaced_layer_refuses_to_save(synth_ckpt, tmp_path):
    model = qcompile.load(str(synth_ckpt("ct-fp8-dynamic")))
    dequantize_model(model)
    with pytest.raises(UnsupportedError, match="replaced after loading"):
        model.save_pretrained(tmp_path)


class _FakeHub:
    """Stands in for the Hub: create_repo / model cards / the upload, recording what would be uploaded."""

    def __init__(self, monkeypatch, model):
        import transformers.modeling_utils as modeling_utils
        import transformers.utils.hub as hub

        self.uploaded: list[str] = []
        repo = type("Repo", (), {"repo_id": "user/model"})()
        api = type("Api", (), {"create_repo": lambda *a, **k: repo})()
        card = type("Card", (), {"save": lambda self, path: Path(path).write_text("card")})()
        for module in (modeling_utils, hub):
            monkeypatch.setattr(module, "hf_api", lambda: api)
            monkeypatch.setattr(module, "create_and_tag_model_card", lambda *a, **k: card)
        monkeypatch.setattr(model, "_upload_modified_files", self.upload, raising=False)

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        for f in os.listdir(working_dir):
            if f not in files_timestamps or os.path.getmtime(os.path.join(working_dir, f)) > files_timestamps[f]:
                self.uploaded.append(f)


def test_push_to_hub_uploads_the_producer_files(synth_ckpt, tmp_path, monkeypatch):
    model = qcompile.load(str(synth_ckpt("modelopt-nvfp4")))
    hub = _FakeHub(monkeypatch, model)
    model.push_to_hub("user/model")
    assert {"model.safetensors", "config.json", "hf_quant_config.json"} <= set(hub.uploaded)
    # save_pretrained(push_to_hub=True) into a folder saved before: the files it rewrites are uploaded
    model.save_pretrained(tmp_path)
    old = time.time() - 100
    for f in os.listdir(tmp_path):
        os.utime(tmp_path / f, (old, old))
    hub.uploaded.clear()
    model.save_pretrained(tmp_path, push_to_hub=True)
    assert {"model.safetensors", "config.json", "hf_quant_config.json"} <= set(hub.uploaded)
    assert_same_checkpoint(synth_ckpt("modelopt-nvfp4"), tmp_path)


def test_modelopt_model_copies_and_pickles(synth_ckpt, tmp_path):
    """The save that writes hf_quant_config.json goes with a deep copy and survives torch.save / load."""
    import copy
    import io

    src = synth_ckpt("modelopt-fp8")
    model = qcompile.load(str(src))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert other.save_pretrained.model is other
        assert other.generate.model is other
        other.save_pretrained(tmp_path)
        assert_same_checkpoint(src, tmp_path)
        shutil.rmtree(tmp_path)


@pytest.mark.parametrize("fmt,kv_cache", [("modelopt-fp8", "fp8"), ("ct-fp8-dynamic", "fp8"),
                                          ("ct-fp8-dynamic", "fp8-head")])
def test_kv_cache_scales_are_saved_back(fmt, kv_cache, tmp_path):
    src = Path(synth.write_checkpoint(str(tmp_path / "src"), fmt, kv_cache=kv_cache))
    model = round_trip(src, tmp_path / "saved")
    reloaded = qcompile.load(str(tmp_path / "saved"))
    attention = [name for name, m in model.named_modules() if "k_scale" in m._buffers]
    assert len(attention) == model.config.num_hidden_layers
    for name in attention:
        a, b = model.get_submodule(name), reloaded.get_submodule(name)
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale), name
