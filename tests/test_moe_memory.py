"""Loading a quantized MoE checkpoint peaks near its final size: the experts are stacked as each tensor
arrives (QuantExperts.receive), never held twice. Measured in a subprocess by tests/load_memory.py (peak
RSS minus the RSS after imports and a warm-up load; the checkpoint's mapped pages count) on per-tensor
FP8 Qwen3-MoEs of 16 and 64 experts (24 and 96 MiB of fp8 experts), and on a gpt-oss of 64 experts whose
MXFP4 experts are stored fused (one tensor per projection, 51 MiB, taken expert by expert): at most 1.1x
the loaded weights.

transformers' loader threads read the checkpoint's tensors ahead of the modules that take them, so the
file's pages of the experts not yet stacked are resident while the stacks fill: the stacks must take
memory only as they are written, and each tensor's pages leave as it is stacked. A zero-filled stack
(resident at once) took the peak to 1.45x, a bf16 copy of the experts takes it to 3x. What is left is
per-tensor bookkeeping (Python objects, partly transformers'): about 1.01x with 16 experts, 1.08x
with 64 (1189 tensors of at most 256 KiB). Then saved and reloaded equal (QuantExperts.disk_tensors).

The fused gpt-oss load peaks at 1.06x (3 MiB over its 52.5 MiB of weights): reading an expert's rows maps
up to 2 MiB of the file at once (the kernel's page-cache mapping, as for any mapped read), given back as
that expert is stacked; that fixed cost is why the test model is this large (16 experts: 1.14x)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import qcompile
from tests.load_memory import load_peaks, mib

SOURCE = "modelopt-fp8-moe"  # its config and hf_quant_config.json are reused
GPTOSS = "gptoss-mxfp4-tiny"


def write_fp8_moe(src: Path, path: Path, experts: int = 16, hidden: int = 512, inter: int = 512) -> Path:
    """ModelOpt's per-tensor FP8 layout (0-d fp32 scales) for a bigger random Qwen3-MoE of ``src``'s kind."""
    path.mkdir()
    for f in ("config.json", "hf_quant_config.json"):
        shutil.copy(src / f, path / f)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_local_experts=experts)
    (path / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if ".experts." not in name}
    for layer in range(config["num_hidden_layers"]):
        for e in range(experts):
            for leaf, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                shapes[f"model.layers.{layer}.mlp.experts.{e}.{leaf}.weight"] = shape
    state = {}
    for name, shape in shapes.items():
        if name.endswith("_proj.weight"):  # every projection: fp8 codes, 0-d fp32 scales
            codes = rng.integers(0, 256, shape, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] ^= 1  # 0x7f / 0xff are NaN
            state[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            state[name.replace(".weight", ".weight_scale")] = torch.tensor(1e-3)
            state[name.replace(".weight", ".input_scale")] = torch.tensor(0.01)
        else:
            state[name] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def big(testdata, tmp_path_factory):
    return write_fp8_moe(testdata / SOURCE, tmp_path_factory.mktemp("moe_memory") / "big")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("experts", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_quantized_moe_load_peak_memory(experts, big, testdata, tmp_path):
    path = big if experts == 16 else write_fp8_moe(testdata / SOURCE, tmp_path / "big", experts=experts)
    [got] = load_peaks(path, testdata / SOURCE, [{}])
    assert got["quant_experts"] == 2
    assert got["growth"] <= 1.1 * got["weights"], (
        f"peak grew {mib(got['growth'])} while loading, over 1.1 x {mib(got['weights'])} of weights")


def write_gptoss(src: Path, path: Path, experts: int = 16, hidden: int = 512, inter: int = 512) -> Path:
    """gpt-oss's fused MXFP4 layout (``*_blocks`` / ``*_scales`` / ``*_bias`` per projection) for a bigger
    random gpt-oss of ``src``'s kind: random codes, scales 2^-8 .. 2^-3."""
    path.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts)
    (path / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    state = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k, n = p.shape
            state[f"{name}_blocks"] = torch.from_numpy(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8))
            state[f"{name}_scales"] = torch.from_numpy(rng.integers(119, 125, (e, n, k // 32), dtype=np.uint8))
        else:
            state[name] = (torch.randn(p.shape, generator=g) * 0.05).to(torch.bfloat16)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_fused_moe_load_peak_memory(testdata, tmp_path):
    if not (testdata / GPTOSS).is_dir():
        pytest.skip(f"{GPTOSS} is not among the test checkpoints")
    path = write_gptoss(testdata / GPTOSS, tmp_path / "big", experts=64)
    [got] = load_peaks(path, testdata / GPTOSS, [{}])
    assert got["quant_experts"] == 2
    assert got["growth"] <= 1.1 * got["weights"], (
        f"peak grew {mib(got['growth'])} while loading, over 1.1 x {mib(got['weights'])} of weights")


def test_quantized_moe_round_trips(big, tmp_path):
    from qcompile.experts import QuantExperts

    model = qcompile.load(str(big))
    model.save_pretrained(tmp_path / "saved")
    saved, source = set(load_file(tmp_path / "saved" / "model.safetensors")), set(load_file(big / "model.safetensors"))
    assert saved == source, (sorted(saved - source)[:3], sorted(source - saved)[:3])
    again = qcompile.load(str(tmp_path / "saved"))
    layers = [n for n, m in model.named_modules() if isinstance(m, QuantExperts)]
    assert len(layers) == 2
    want, got = model.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key].view(torch.uint8) if want[key].dtype == torch.float8_e4m3fn else want[key],
                           got[key].view(torch.uint8) if got[key].dtype == torch.float8_e4m3fn else got[key]), key
