"""Online FP8 quantization while loading a bf16 checkpoint keeps its peak resident memory near the
quantized model's size: at most 1.2x the final weights plus one layer's bf16 weight (measured in a
subprocess: the peak RSS minus the RSS after imports and a warm-up load). On this 4-layer model (121 MiB
of bf16 weights, 61 MiB loaded) the bound is 81 MiB; whole-layer fp32 temporaries and the bf16 pages
left mapped (see linear.release_memory) take it past 200 MiB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qcompile import synth
from qcompile.linear import release_memory

REPO = Path(__file__).resolve().parents[1]

# The peak is VmHWM, this process's own high-water mark (reset before each load through clear_refs):
# ru_maxrss also holds the RSS of the process that started it (Linux carries it over exec), here pytest's.
CHILD = r"""
import gc, json, sys
import torch, transformers, qcompile
from qcompile.linear import QuantLinear
transformers.logging.set_verbosity_error()
big, tiny = sys.argv[1:3]

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024

for online in ("fp8_per_tensor", "fp8_per_block"):
    qcompile.load(tiny, online=online)  # the code paths, libraries and imports a load needs, before the baseline
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    model = qcompile.load(big, online=online)
    peak = status("VmHWM")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    print(json.dumps({"online": online, "growth": peak - base, "layers": len(layers),
                      "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
                      "layer_bf16": max(m.in_features * m.out_features * 2 for m in layers)}))
    del model, layers
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_memory")
    config = synth.tiny_llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                     num_attention_heads=16, num_key_value_heads=8, head_dim=64)
    return synth.write_bf16(str(root / "big"), config), synth.write_bf16(str(root / "tiny"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_online_load_peak_memory(checkpoints):
    out = subprocess.run([sys.executable, "-c", CHILD, *checkpoints], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["online"] for r in results] == ["fp8_per_tensor", "fp8_per_block"]
    for got in results:
        assert got["layers"] == 28
        bound = 1.2 * got["weights"] + got["layer_bf16"]
        assert got["growth"] <= bound, (
            f"peak grew {got['growth'] / 2**20:.0f} MiB while loading {got['online']}, over {bound / 2**20:.0f} MiB "
            f"(1.2 x {got['weights'] / 2**20:.0f} MiB of weights + one {got['layer_bf16'] / 2**20:.0f} MiB bf16 layer)")


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
