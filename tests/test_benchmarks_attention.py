"""benchmarks/bench_attention.py --dry-run: the CPU smoke test of the GPU benchmark (tiny shapes, wall clock)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_attention as bench  # noqa: E402


def test_bench_attention_dry_run(tmp_path, capsys):
    out = tmp_path / "attention.json"
    assert bench.main(["--dry-run", "--batch", "1", "2", "--sweep", "1", "2", "--fp8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "dry run" in result["device"] and len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["max_abs_err"] < 1e-2  # bf16 against SDPA's fp32 math
        assert all(isinstance(row[c], float) for c in bench.COLUMNS + bench.FP8_COLUMNS), row
        assert row["fp8_max_abs_err"] < 1e-2
        assert "splits=1" not in row  # no Triton kernel on the CPU outside the interpreter: no sweep
    table = capsys.readouterr().out
    assert "| tiny (4 / 2) | 2 | 40 / 64 |" in table and "decode_attention, fp8 |" in table
