"""benchmarks/bench_shapes.py's report: the % of floor cells, the two checks it prints, the summary table (CPU,
on made-up timings; the timings themselves need a GPU)."""

from __future__ import annotations

import pytest

from .bench_util import benchmark


def _row(wbytes: int, us: dict, floor: dict) -> dict:
    return {"weight_bytes": wbytes, "us": us, "floor_us": floor}


def test_report_checks_and_summary():
    bench = benchmark("bench_shapes")
    big, small = 32 << 20, 4 << 20
    results = {
        "6144x4096": {  # a big layer: held to the floor target
            "bf16": _row(big, {1: 20.0, 256: 24.0}, {1: 16.0, 256: 17.0}),
            "int4 g128": _row(big // 4, {1: 5.0, 256: 30.0}, {1: 4.0, 256: 5.0}),
        },
        "8192x1024": {  # a small one: its 25 % at M = 1 is not the lowest counted
            "bf16": _row(small, {1: 8.0, 256: 9.0}, {1: 2.0, 256: 3.0}),
            "int4 g128": _row(small // 4, {1: 4.0, 256: "fails: RuntimeError: x"}, {1: 1.0, 256: 2.0}),
        },
    }
    out = {"gpu": "GPU", "torch": "t", "copy_bandwidth": 3e12, "command": "cmd", "results": results}
    text = bench.report(out, [1, 256], ["bf16", "int4 g128"])
    assert "| 6144x4096 (Llama-3.1-8B) | 5.0 (80 %) | 30.0 (17 %) |" in text
    assert "| 8192x1024 | 4.0 (25 %) | fails |" in text
    # int4's weight is 8 MB on the big layer too: below the 16 MB the target counts, so no lowest cell for it
    assert "- int4 g128: lowest" not in text
    assert "- bf16: lowest % of floor at M <= 16 on weights >= 16 MB: 80 % (6144x4096, M = 1)" in text
    assert "- int4 g128: slower than bf16 in 1 cells: 6144x4096 M=256 30.0 vs 24.0" in text
    assert "| M = 1, % of floor | bf16 % | int4 g128 % |" in text
    assert "| 8192x1024 | 25 % | 25 % |" in text


def test_tune_wo_refuses_token_counts_that_are_not_buckets(capsys):
    """tune_wo.py --moe keys an entry by T's bucket: a T that is not a bucket, or above the last, is refused before
    anything is measured (a T above the last bucket has no key)."""
    tune_wo = benchmark("tune_wo")
    for tokens in (["3"], ["32768"]):
        with pytest.raises(SystemExit):
            tune_wo.main(["--moe", "qwen3-30b-a3b", "--tokens", *tokens])
        assert f"--tokens [{tokens[0]}]: each T must be one of the buckets" in capsys.readouterr().err


def test_tune_wo_moe_writes_each_token_count_as_measured(tmp_path, monkeypatch):
    """tune_wo.py --moe merges each T's entry into the table as soon as it is measured: a run cut at a later T (its
    time limit, a fault) keeps the earlier ones."""
    import json

    import bench_moe

    tune_wo = benchmark("tune_wo")
    monkeypatch.setattr(tune_wo.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tune_wo.torch.cuda, "get_device_name", lambda *a: "Made-up GPU")
    monkeypatch.setattr(tune_wo, "copy_bandwidth", lambda device: 3e12)
    monkeypatch.setattr(bench_moe, "wo_row", lambda fmt: fmt)

    def tune_moe(name, fmt, tokens, bw, reps):
        for t in tokens:
            if t == 256:
                raise RuntimeError("cut")
            yield {f"{name}|{fmt}|t{t}": {"route": "policy", "us": 1.0, "policy_us": 1.0}}

    monkeypatch.setattr(tune_wo, "tune_moe", tune_moe)
    with pytest.raises(RuntimeError, match="cut"):
        tune_wo.main(["--moe", "mixtral", "--moe-formats", "nvfp4", "--tokens", "64", "128", "256",
                      "--out", str(tmp_path)])
    table = json.loads(next(tmp_path.glob("*.json")).read_text())["entries"]
    assert sorted(table) == ["mixtral|nvfp4|t128", "mixtral|nvfp4|t64"]
