"""benchmarks/bench_fp8_gemv.py's sweep and report (CPU, on made-up timings; the timings themselves need a GPU):
the best configuration per cell, the suggested GEMV_MAX_M, the per-M default pick, ``--report`` merging."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_fp8_gemv
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_fp8_gemv


def _cell(today, configs, floor=5.0, op=9.0):
    return {"today": today, "op": op, "floor": floor, "configs": configs}


def _result(shape_cells: dict) -> dict:
    results = {}
    for shape, cells in shape_cells.items():
        row = results[shape] = {"bf16": {"1": 20.0, "16": 21.0}}
        for recipe, by_m in cells.items():
            row[recipe] = {"weight_bytes": 1 << 24, "ms": by_m}
    return {"gpu": "GPU", "torch": "t", "copy_bandwidth": 3e12, "command": "cmd", "results": results}


def test_configs_are_a_modest_sweep():
    bench = _bench()
    for m in bench.MS:
        cfgs = bench.configs(m)
        names = {bench.cfg_name(c) for c in cfgs}
        assert 10 <= len(cfgs) <= 20 and len(names) == len(cfgs)
        assert all(c["block_k"] % 128 == 0 and c["block_n"] <= 128 for c in cfgs)  # group / block scales run
        assert any(c["use_dot"] for c in cfgs) and any(c["split_k"] > 1 for c in cfgs)
        assert len(bench.configs(m, quick=True)) == 3


def test_report_best_limit_and_default(tmp_path, capsys):
    bench = _bench()
    a, b = "bcast n8 k512 w4 s3 x1", "dot n32 k256 w4 s3 x1"
    part1 = _result({"4096x4096": {
        "fp8 tensor": {"1": _cell(10.0, {a: 6.0, b: 7.0}), "16": _cell(11.0, {a: 12.0, b: 9.0})},
        "fp8 channel": {"1": _cell(10.0, {a: 6.0, b: "fails: RuntimeError: x"}), "16": _cell(11.0, {a: 13.0, b: 12.0})},
    }})
    part2 = _result({"1280x8192": {
        "fp8 tensor": {"1": _cell(8.0, {a: 5.0, b: 5.5}), "16": _cell(9.0, {a: 10.0, b: 8.5})},
        "fp8 channel": {"1": _cell(8.0, {a: 4.0, b: 4.4}), "16": _cell(9.0, {a: 8.0, b: 8.8})},
    }})
    files = []
    for i, part in enumerate((part1, part2)):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(part))
    assert bench.main(["--report", *map(str, files)]) == 0
    text = capsys.readouterr().out
    assert f"| 4096x4096 | 1 | fp8 tensor | {a} | 6.0 | 83 % | 10.0 | 50 % | 9.0 | 20.0 |" in text
    assert f"| 4096x4096 | 1 | fp8 channel | {a} | 6.0 | 83 % |" in text  # a failing configuration is skipped
    assert f"| 1280x8192 | 16 | fp8 tensor | {b} | 8.5 |" in text
    # tensor wins at M = 16 on both shapes; channel loses on 4096x4096 at M = 16
    assert "- fp8 tensor: 16" in text and "- fp8 channel: 1" in text
    # M = 1: b failed in one cell, so a; M = 16: a is up to 12/9 = 1.33x the best, b up to 1.1x
    assert f"- M = 1: {a} (worst 1.00x the best)" in text
    assert f"- M = 16: {b} (worst 1.10x the best)" in text
