"""Malformed checkpoints: each raises qcompile's own error naming the layer / tensor and the fix."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from qcompile.errors import CheckpointError, ConfigError, UnsupportedError

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
    "block FP8 with dims not divisible by 128": ("ct-fp8-block", None,
                                                 lambda c: c.update(intermediate_size=200), (),
                                                 CheckpointError, "not multiples of the 128x128 block"),
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
    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        qcompile.load(str(tmp_path / "ck"))


def test_at_least_twenty_cases():
    assert len(CASES) + 3 >= 20
