"""Online FP8 quantization while loading a bf16 checkpoint keeps its peak resident memory near the
quantized model's size: at most 1.2x the final weights plus one layer's bf16 weight (measured in a
subprocess by tests/load_memory.py: the peak RSS minus the RSS after imports and a warm-up load). On
this 4-layer model (121 MiB of bf16 weights, 61 MiB loaded) the bound is 81 MiB; whole-layer fp32
temporaries and the bf16 pages left mapped (see linear.release_memory) take it past 200 MiB."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qcompile import synth
from qcompile.linear import release_memory
from tests.load_memory import load_peaks, mib


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_memory")
    config = synth.tiny_llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=64)
    return synth.write_bf16(str(root / "big"), config), synth.write_bf16(str(root / "tiny"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_online_load_peak_memory(checkpoints):
    results = load_peaks(*checkpoints, [{"online": "fp8_per_tensor"}, {"online": "fp8_per_block"}])
    for got in results:
        assert got["quant_linears"] == 28
        bound = 1.2 * got["weights"] + got["largest_linear_bf16"]
        assert got["growth"] <= bound, (
            f"peak grew {mib(got['growth'])} while loading {got['load']}, over {mib(bound)} (1.2 x "
            f"{mib(got['weights'])} of weights + one {mib(got['largest_linear_bf16'])} bf16 layer)")


def _rss_of(path: Path) -> int:
    """This process's resident bytes of its mappings of ``path``."""
    rss, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                mine = len(fields) >= 6 and fields[5] == str(path)
            elif mine and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps")
def test_release_memory_drops_mapped_pages_not_contents(tmp_path):
    """The pages of a tensor read through the safetensors mmap leave the RSS, its bytes stay; a tensor in
    ordinary memory is left alone."""
    from safetensors import safe_open

    path = tmp_path / "w.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({"a": torch.randn(1024, 1024, generator=g).bfloat16(), "b": torch.randn(8, 8, generator=g)}, path)
    want = load_file(path)
    with safe_open(path, framework="pt") as f:
        a, b = f.get_tensor("a"), f.get_tensor("b")
        a.sum(), b.sum()  # fault the pages in
        before = _rss_of(path)
        assert before >= 2 * 2**20 or before == 0  # 0: this safetensors copies instead of mapping
        release_memory(a)
        assert _rss_of(path) <= before - (2 * 2**20 - 8192) or before == 0
        assert torch.equal(a, want["a"]) and torch.equal(b, want["b"])
    heap = want["a"].clone()
    release_memory(heap)
    assert torch.equal(heap, want["a"])
