"""Malformed checkpoints: each raises qcompile's own error naming the layer / tensor and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from qcompile.errors import CheckpointError, ConfigError, UnsupportedError
from tests.test_checkpoint_files import FILE_CASES, INDEX, INDEX_CASES, SHARDS, shard_checkpoint, split_header

Q = "model.layers.0.self_attn.q_proj"
G = "model.layers.1.mlp.gate_proj"
NAN, INF = float("nan"), float("inf")


def mutate(src, dst, tensors=None, config=None, remove=()):
    """Copy checkpoint ``src`` to ``dst``; tensors: {name: tensor or callable(old) -> tensor or None}."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    sd = load_file(str(f))
    for name in remove:
        del sd[name]
    for name, fn in (tensors or {}).items():
        new = fn(sd.get(name)) if callable(fn) else fn
        if new is None:
            sd.pop(name, None)
        else:
            sd[name] = new
    save_file(sd, str(f), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def setval(value, index=None):
    def fn(t):
        t = t.clone()
        if index is None:
            t.fill_(value)
        else:
            t.view(-1)[index] = value
        return t
    return fn


def drop_quant(cfg):
    del cfg["quantization_config"]


CASES = {
    # name: (format, tensors, config, remove, error type, text that must appear)
    "missing weight_scale": ("modelopt-fp8", {f"{Q}.weight_scale": None}, None, (), CheckpointError, f"{Q}.weight_scale"),
    "missing input_scale": ("modelopt-fp8", {f"{Q}.input_scale": None}, None, (), CheckpointError, f"{Q}.input_scale"),
    "missing weight": ("modelopt-fp8", {f"{Q}.weight": None}, None, (), CheckpointError, f"{Q}.weight"),
    "weight mis-shaped": ("modelopt-fp8", {f"{Q}.weight": lambda t: t[:, :128].contiguous()}, None, (),
                          CheckpointError, "shape [256, 128]"),
    "channel scale mis-shaped": ("modelopt-fp8-pcpt", {f"{Q}.weight_scale": lambda t: t[:100].contiguous()}, None, (),
                                 CheckpointError, f"{Q}.weight_scale"),
    "block scale mis-shaped": ("ct-fp8-block", {f"{Q}.weight_scale": lambda t: t.repeat(1, 2)}, None, (),
                               CheckpointError, f"{Q}.weight_scale"),
    "asymmetric int4 zero points stored unpacked": (
        "ct-w4a16-asym", {f"{Q}.weight_zero_point": lambda t: torch.zeros(256, 2, dtype=torch.int32)}, None, (),
        CheckpointError, "8 codes per int32 along out_features"),
    "asymmetric int4 zero points stored int8": (
        "ct-w4a16-asym", {f"{Q}.weight_zero_point": lambda t: t.to(torch.int8)}, None, (), CheckpointError,
        f"{Q}.weight_zero_point"),
    "per-tensor scale given per channel": ("modelopt-fp8", {f"{Q}.weight_scale": torch.ones(256)}, None, (),
                                           CheckpointError, "expected []"),
    "weight stored bf16 in a quantized layer": ("modelopt-fp8", {f"{Q}.weight": lambda t: t.to(torch.bfloat16)}, None,
                                                (), CheckpointError, "dtype torch.bfloat16"),
    "weight_scale stored as int": ("modelopt-fp8", {f"{Q}.weight_scale": torch.tensor(1, dtype=torch.int32)}, None,
                                   (), CheckpointError, f"{Q}.weight_scale"),
    "NaN weight_scale": ("modelopt-fp8", {f"{Q}.weight_scale": setval(NAN)}, None, (), CheckpointError, "NaN"),
    "inf input_scale": ("modelopt-fp8", {f"{G}.input_scale": setval(INF)}, None, (), CheckpointError, f"{G}.input_scale"),
    "one NaN fp8 weight code": ("modelopt-fp8", {f"{Q}.weight": setval(NAN, 5)}, None, (), CheckpointError,
                                f"{Q}.weight holds NaN"),
    "zero weight_scale": ("modelopt-fp8", {f"{Q}.weight_scale": setval(0.0)}, None, (), CheckpointError, "zero"),
    "negative input_scale": ("modelopt-fp8", {f"{Q}.input_scale": setval(-1.0)}, None, (), CheckpointError, "negative"),
    "one NaN channel scale": ("ct-fp8-dynamic", {f"{G}.weight_scale": setval(NAN, 7)}, None, (), CheckpointError,
                              f"{G}.weight_scale"),
    "one zero block scale": ("ct-fp8-block", {f"{G}.weight_scale": setval(0.0, 3)}, None, (), CheckpointError, "zero"),
    "NaN bf16 input_scale (compressed-tensors)": ("ct-fp8-static", {f"{Q}.input_scale": setval(NAN)}, None, (),
                                                  CheckpointError, f"{Q}.input_scale"),
    "excluded layer stored quantized": ("modelopt-fp8", None,
                                        lambda c: c["quantization_config"]["ignore"].append(Q), (),
                                        CheckpointError, "leaves this layer unquantized"),
    "block FP8 config dims that disagree with the file": ("ct-fp8-block", None,
                                                          lambda c: c.update(intermediate_size=200), (),
                                                          CheckpointError, "has shape [512, 256], expected [200, 256]"),
    "quantized tensors of an unknown module": ("modelopt-fp8", {"model.layers.0.mlp.extra.weight_scale": torch.tensor(1.0)},
                                               None, (), UnsupportedError, "model.layers.0.mlp.extra"),
    "online asked for a quantized checkpoint": ("modelopt-fp8", None, None, (), ConfigError, "online"),
    "no quantization config and no online": ("modelopt-fp8", None, drop_quant, (), ConfigError,
                                             "no quantization config"),
    "unknown quant_method": ("modelopt-fp8", None,
                             lambda c: c["quantization_config"].update(quant_method="gguf-ish"), (), ConfigError,
                             "quant_method"),
    "unknown quant_algo": ("modelopt-fp8", None,
                           lambda c: c["quantization_config"].update(quant_algo="FP3"), (), ConfigError, "FP3"),
    "ignore is not a list": ("ct-fp8-dynamic", None,
                             lambda c: c["quantization_config"].update(ignore="lm_head"), (), ConfigError, "ignore"),
    "quantization_config is a list": ("modelopt-fp8", None, lambda c: c.update(quantization_config=[{}]), (),
                                      ConfigError, "config.json: quantization_config"),
    "quantization_config is a string": ("ct-fp8-dynamic", None, lambda c: c.update(quantization_config="fp8"), (),
                                        ConfigError, "got a JSON str"),
    "non-string kv_cache_quant_algo beside kv_cache_scheme": (
        "modelopt-fp8", None, lambda c: c["quantization_config"].update(
            kv_cache_scheme={"type": "float", "num_bits": 8}, kv_cache_quant_algo=8), (), ConfigError,
        "quantization_config.kv_cache_quant_algo"),
    "kv_cache_scheme is a string (compressed-tensors)": (
        "ct-fp8-dynamic", None, lambda c: c["quantization_config"].update(kv_cache_scheme="fp8"), (), ConfigError,
        "quantization_config.kv_cache_scheme"),
    "ignore pattern that backtracks exponentially": (
        "ct-fp8-dynamic", None, lambda c: c["quantization_config"]["ignore"].append("re:(.*)*x"), (), ConfigError,
        "'re:(.*)*x' can backtrack"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_checkpoint(case, synth_ckpt, tmp_path):
    fmt, tensors, config, remove, err, text = CASES[case]
    path = mutate(synth_ckpt(fmt), tmp_path / "ck", tensors, config, remove)
    if case == "no quantization config and no online":
        (path / "hf_quant_config.json").unlink()
    kwargs = {"online": "fp8_per_tensor"} if case.startswith("online asked") else {}
    with pytest.raises(err) as e:
        qcompile.load(str(path), **kwargs)
    msg = str(e.value)
    assert text in msg, msg
    assert "Fix:" in msg, msg


def test_missing_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        qcompile.load(str(tmp_path))


def test_config_json_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        qcompile.load(str(tmp_path))


def test_truncated_safetensors_header(synth_ckpt, tmp_path):
    shutil.copytree(synth_ckpt("modelopt-fp8"), tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="header length field says"):
        qcompile.load(str(tmp_path / "ck"))


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_malformed_safetensors_file(case, synth_ckpt, tmp_path):
    """Each file-level corruption of a real checkpoint's model.safetensors, through qcompile.load."""
    corrupt, text = FILE_CASES[case]
    shutil.copytree(synth_ckpt("modelopt-fp8"), tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    f.write_bytes(corrupt(*split_header(f.read_bytes())))
    with pytest.raises(CheckpointError) as e:
        qcompile.load(str(tmp_path / "ck"))
    msg = str(e.value)
    assert str(f) in msg and text in msg and "Fix:" in msg, msg


@pytest.mark.parametrize("plain", [False, True], ids=["qcompile.load", "from_pretrained"])
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_malformed_sharded_checkpoint(case, plain, synth_ckpt, tmp_path):
    """Each broken or hostile shard index / shard set, through qcompile.load and through plain
    from_pretrained (ModelOpt needs no quantization_config there)."""
    from transformers import AutoModelForCausalLM

    corrupt, text = INDEX_CASES[case]
    path = tmp_path / "ck"
    shard_checkpoint(synth_ckpt("modelopt-fp8"), path)
    corrupt(path)
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(str(path)) if plain else qcompile.load(str(path))
    msg = str(e.value)
    assert text in msg and (INDEX in msg or SHARDS[1] in msg) and "Fix:" in msg, msg


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
def test_deeply_nested_config(name, synth_ckpt, tmp_path):
    path = mutate(synth_ckpt("modelopt-fp8"), tmp_path / "ck", config=drop_quant)
    (path / name).write_text('{"quantization": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError) as e:
        qcompile.load(str(path))
    assert name in str(e.value) and "nests too deeply" in str(e.value), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(synth_ckpt):
    with pytest.raises(UnsupportedError, match='cuda.*Fix: pass device="cpu"'):
        qcompile.load(str(synth_ckpt("modelopt-fp8")), device="cuda")


@pytest.mark.parametrize("device", ["banana", "cuda:x", "cpu:-1", 3.5])
def test_invalid_device(device, synth_ckpt):
    with pytest.raises(ConfigError, match=r"invalid device .*Fix: pass \"cpu\""):
        qcompile.load(str(synth_ckpt("modelopt-fp8")), device=device)


@pytest.mark.parametrize("name,package,check", [
    ("llmcompressor-fp8-dynamic-dense", "compressed-tensors", "is_compressed_tensors_available"),
    ("quark-w-mxfp4-dense", "amd-quark", "is_quark_available")])
def test_plain_from_pretrained_without_the_formats_package(name, package, check, testdata):
    """transformers would ask for its own quantizer's package; qcompile reads the format and says how."""
    import transformers.utils
    from transformers import AutoModelForCausalLM

    if getattr(transformers.utils, check)():
        pytest.skip(f"{package} is installed: transformers' own quantizer runs")
    with pytest.raises(ConfigError, match=rf"{package} package.*Fix: pass quantization_config=qcompile.QCompileConfig"):
        AutoModelForCausalLM.from_pretrained(str(testdata / name))


def test_at_least_twenty_cases():
    assert len(CASES) + 3 >= 20
