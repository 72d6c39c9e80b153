"""benchmarks/bench_moe.py and bench_router.py --dry-run: the CPU smoke tests of the GPU benchmarks (tiny shapes,
the reference path of qcompile::fused_moe, inductor's CPU routers, wall-clock timing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_moe", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_moe_dry_run(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "moe.json"
    assert bench.main(["--dry-run", "--markdown", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["row"] for r in rows} == set(bench.PEERS) | set(bench.OURS)
    assert {r["tokens"] for r in rows} == {1, 3} and result["bandwidth_gbps"] > 0
    for r in rows:
        assert r["floor_us"] > 0 and 1 <= r["experts_used"] <= 8
        if r["row"] in bench.OURS or r["row"] == bench.PEERS[0]:
            # (a busy CPU can take the dry run's percentage below its rounding: 0.0)
            assert isinstance(r["us"], float) and r["us"] > 0 and r["pct_floor"] >= 0, r
    table = capsys.readouterr().out
    assert "| ours FP8 128-block |" in table and "dry run" in table


def test_bench_moe_rotated_routings(tmp_path):
    """--rotate cycles several routings through the timed calls: every row still times, and the floor counts
    the mean number of experts the routings touch."""
    bench = _load()
    out = tmp_path / "moe.json"
    assert bench.main(["--dry-run", "--markdown", "--rotate", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    _, used = bench.routings(3, 8, 256, 2, "cpu", 3)
    assert all(isinstance(r["us"], float) for r in rows if r["row"] in bench.OURS)
    assert {r["experts_used"] for r in rows if r["tokens"] == 3} == {used}
    calls = []
    fn = bench.cycled(lambda x, ids, w: lambda: calls.append(int(ids.sum())), bench.routings(3, 8, 256, 2, "cpu", 3)[0])
    for _ in range(6):
        fn()
    assert calls[:3] == calls[3:] and len(set(calls[:3])) > 1  # three different routings, in turn


def test_peers_match_the_reference():
    """The bf16 grouped-GEMM peer computes the same layer as qcompile's reference (bf16 weights, so a
    loose normwise bound: the peer keeps activations unquantized)."""
    import torch

    from qcompile.kernels import moe_triton as mt

    bench = _load()
    layers = bench._layers(4, 128, 128, 2, "cpu")
    chan = layers["ours FP8 channel x token"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    ids = torch.rand(5, 4, generator=g).argsort(1)[:, :2].to(torch.int32)
    w = torch.softmax(torch.randn(5, 2, generator=g), 1)
    peer = bench.bf16_peer(x, ids, w, layers["peer"]["w13t"], layers["peer"]["w2t"]).float()
    ref = mt.fused_moe_reference(**dict(chan, x=x, topk_ids=ids, topk_weights=w)).float()
    assert float((peer - ref).norm() / ref.norm()) < 0.1


def test_bench_moe_weight_only_rows():
    """--weight-only's rows on a tiny shape (the reference path on the CPU): every format, and each forced
    path of qcompile::wo_moe for int4 g128 and NVFP4, time a call; formats whose K the weight-only kernels
    cannot take say so."""
    bench = _load()
    rows = bench.bench_wo_shape("tiny", (4, 128, 128, 2), [1, 3], 3, 10.0, "cpu", lambda msg: None)
    forced = {f"{row}, {path}" for row in list(bench.OURS_WO)[:bench.WO_PATH_FORMATS] for path in bench.WO_PATHS}
    assert {r["row"] for r in rows} == set(bench.OURS_WO) | forced
    for r in rows:
        assert isinstance(r["us"], float) and r["floor_us"] > 0 and 1 <= r["experts_used"] <= 4, r
    tail = bench.bench_wo_shape("tiny", bench.TINY["tiny"], [1], 3, 10.0, "cpu", lambda msg: None)  # I = 192
    int4 = {"ours int4 g128 weight-only"} | {f"ours int4 g128 weight-only, {path}" for path in bench.WO_PATHS}
    assert {r["row"]: r["us"] for r in tail if r["row"] in int4} == \
        dict.fromkeys(int4, "fails: down projection w2: K=192 not a multiple of the group size 128")
    assert {r["row"] for r in tail if isinstance(r["us"], float)} == (set(bench.OURS_WO) | forced) - int4


def bench_router():
    spec = importlib.util.spec_from_file_location("bench_router", BENCH.with_name("bench_router.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_router_dry_run(tmp_path, capsys):
    """benchmarks/bench_router.py --dry-run: both compiled routers run on the CPU and agree (the script checks
    weights and indices), one row per (E:k, T) in the table and the JSON."""
    bench = bench_router()
    out = tmp_path / "router.json"
    assert bench.main(["--dry-run", "--experts", "8:2", "16:4", "--tokens", "1", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["experts"], r["k"], r["tokens"]) for r in result["rows"]] == [(8, 2, 1), (8, 2, 5), (16, 4, 1),
                                                                           (16, 4, 5)]
    assert all(r["torch_us"] > 0 and r["qcompile_us"] > 0 for r in result["rows"])
    assert "dry run" in result["gpu"] and "| 16, 4 | 5 |" in capsys.readouterr().out


def test_bench_router_linear_dry_run(tmp_path, capsys):
    """benchmarks/bench_router.py --linear --dry-run: both compiled linears run on the CPU and agree, one row per
    (shape, T); on the CPU qcompile keeps F.linear (the small-linear pass rewrites CUDA graphs)."""
    bench = bench_router()
    out = tmp_path / "linear.json"
    assert bench.main(["--dry-run", "--linear", "8x64", "16x32:fp32", "--tokens", "1", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["k"], r["dtype"], r["tokens"]) for r in rows] == [
        (8, 64, "bfloat16", 1), (8, 64, "bfloat16", 3), (16, 32, "float32", 1), (16, 32, "float32", 3)]
    assert all(r["torch_us"] > 0 and r["qcompile_us"] > 0 and r["qcompile_runs"] == "F.linear" for r in rows)
    assert "| 16 x 32, float32 | 3 |" in capsys.readouterr().out


def test_bench_moe_pdl_ab_dry_run(tmp_path, capsys):
    """--pdl-ab times its three rows both ways at every T (on the CPU neither launches with PDL: a smoke test)."""
    bench = _load()
    out = tmp_path / "pdl.json"
    assert bench.main(["--dry-run", "--markdown", "--pdl-ab", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["row"], r["tokens"]) for r in rows} == {(row, t) for row in bench.PDL_ROWS for t in (1, 3)}
    int4 = bench.PDL_ROWS[2]  # the tiny shape's I = 192 is not a multiple of int4's group of 128
    assert {r["off_us"] for r in rows if r["row"] == int4} == {"fails: down projection w2: K=192 not a multiple of "
                                                                "the group size 128"}
    assert all(isinstance(r["off_us"], float) and isinstance(r["on_us"], float) for r in rows if r["row"] != int4)
    assert "| with PDL, µs |" in capsys.readouterr().out
    rows = bench.ab("pdl", "tiny", (4, 128, 128, 2), [1], 3, "cpu", lambda msg: None, rounds=1)
    assert [r["row"] for r in rows] == list(bench.PDL_ROWS) and all(isinstance(r["on_us"], float) for r in rows)


def test_bench_moe_fuse_ab_dry_run(tmp_path, capsys, monkeypatch):
    """--fuse-ab times every weight-only row both ways, QCOMPILE_MOE_FUSE=0 set only around the "without" calls."""
    bench = _load()
    seen = []
    make = bench._wo_call
    monkeypatch.setattr(bench, "_wo_call", lambda *a: (lambda *r: (lambda f: lambda: (
        seen.append(bench.os.environ.get("QCOMPILE_MOE_FUSE")), f())[1])(make(*a)(*r))))
    monkeypatch.delenv("QCOMPILE_MOE_FUSE", raising=False)
    out = tmp_path / "fuse.json"
    assert bench.main(["--dry-run", "--markdown", "--fuse-ab", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["row"], r["tokens"]) for r in rows) == sorted((row, t) for row in bench.OURS_WO for t in (1, 3))
    int4 = next(iter(bench.OURS_WO))  # refused at the tiny shape (I = 192)
    assert all(isinstance(r["off_us"], float) and isinstance(r["on_us"], float) for r in rows if r["row"] != int4)
    assert set(seen) == {"0", None} and "QCOMPILE_MOE_FUSE" not in bench.os.environ
    assert "| with the fused activation, µs |" in capsys.readouterr().out
