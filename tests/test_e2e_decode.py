"""benchmarks/e2e_decode.py on the CPU at tiny shapes: every path (checkpoints written from a model in memory
and loaded by qcompile.load, the own decode loop at two batch sizes, prefill, HF generate with a
CompileConfig, the logits errors, the table and the JSON) runs and reports what it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_decode

SMOKE = ["--tiny", "--device", "cpu", "--inner", "eager", "--tokens", "2", "--reps", "1", "--layers", "1"]
# dense: two batch sizes and the prefill; MoE: online and checkpoint FP8, 4-bit experts, HF generate (each path
# once, for time)
CASES = {"llama": ["--formats", "bf16,ct-w4a16", "--batch", "1", "2", "--prefill", "16"],
         "qwen3_moe": ["--formats", "online-fp8", "modelopt-fp8", "ct-w4a16", "--batch", "1", "--prefill", "0",
                       "--hf-generate"]}


@pytest.mark.parametrize("arch", CASES)
def test_e2e_decode_smoke(tmp_path, capsys, arch):
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE + CASES[arch] + ["--arch", arch, "--json", str(out)])
    report = json.loads(out.read_text())
    results, args = report["results"], report["args"]
    assert list(results) == [f if f == "bf16" else f"{f} qcompile" for f in args["formats"]]
    for name, r in results.items():
        assert "error" not in r, r
        for b in args["batch"]:
            d = r[f"decode_b{b}"]
            assert d["tok_s"] > 0 and d["ms_per_step"] > 0 and d["floor_ms_per_step"] > 0, (name, b)
        assert r["weight_bytes"] > 0 and (r["prefill_ms"] > 0 if args["prefill"] else "prefill_ms" not in r)
        if args["hf_generate"]:  # generate time minus the prefill: CPU noise may even make it negative here
            assert isinstance(r["hf_generate_b1"]["ms_per_step"], float)
        if name != "bf16":
            assert r["errors"]["compiled_vs_dequantized_bf16"] < 0.2, name
            assert r["kernels"]["by_op"], name
    if arch == "qwen3_moe":  # every experts layer reports its kernel (or that it stayed transformers' bf16)
        for fmt in ("modelopt-fp8", "ct-w4a16"):
            assert set(results[f"{fmt} qcompile"]["kernels"]["experts_layers"].values()) == {"reference"}, fmt
        assert list(results["online-fp8 qcompile"]["kernels"]["experts_layers"]) == ["model.layers.0.mlp.experts"]
    assert "| model | weight MiB |" in capsys.readouterr().out


def test_unknown_format_is_refused(capsys):
    with pytest.raises(SystemExit):
        e2e_decode.parse_args(["--formats", "fp3"])
    assert "unknown format(s) ['fp3']" in capsys.readouterr().err
