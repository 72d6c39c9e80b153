"""The FP8 writers reproduce the producers' bytes from the same bf16 weights (4-bit: test_synth_4bit.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from qcompile import synth


@pytest.mark.parametrize("fmt,producer", [("modelopt-fp8", "modelopt-fp8-dense"),
                                          ("ct-fp8-dynamic", "llmcompressor-fp8-dynamic-dense")])
def test_fp8_writer_is_byte_identical_to_the_producer(testdata, tmp_path, fmt, producer):
    synth.write_checkpoint(str(tmp_path), fmt, source=str(testdata / "base-bf16-dense"))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as ours, \
            safe_open(str(testdata / producer / "model.safetensors"), "pt") as theirs:
        assert set(ours.keys()) - {k for k in ours.keys() if k.endswith("input_scale")} == \
            set(theirs.keys()) - {k for k in theirs.keys() if k.endswith("input_scale")}
        for key in theirs.keys():
            if key.endswith("input_scale"):  # calibrated on other tokens
                continue
            a, b = ours.get_tensor(key), theirs.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), key
