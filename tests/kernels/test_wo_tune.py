"""Measured launch choices of qcompile::wo_linear's mma backend (qcompile/kernels/wo_tune.py)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qcompile
from qcompile.errors import ConfigError
from qcompile.kernels import quant_math, wo_gemm, wo_tune
from qcompile.kernels.wo_tune import Choice

from .test_wo_gemm import SPECS, _gpu_case, op_args
from .test_wo_policy import OnCuda

GPU = "NVIDIA H100 80GB HBM3"
SPEC = replace(SPECS["int4_g128"], tiled=True)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty on-disk cache folder and an empty shipped folder; (cache, shipped)."""
    cache, shipped = tmp_path / "cache", tmp_path / "shipped"
    monkeypatch.setenv("QCOMPILE_TUNE_CACHE", str(cache))
    monkeypatch.setattr(wo_tune, "SHIPPED", shipped)
    wo_tune.clear()
    yield cache, shipped
    wo_tune.clear()


def test_keys_and_buckets():
    assert [wo_tune.m_bucket(m) for m in (1, 2, 3, 4, 5, 9, 17, 100, 129, 300, 1024, 1025)] == \
        [1, 2, 4, 4, 8, 16, 32, 128, 256, 1024, 1024, None]
    key = wo_tune.key_of(SPEC, torch.bfloat16, 4096, 14336, 3)
    assert key.endswith("|bfloat16|4096x14336|m4") and key != wo_tune.key_of(SPECS["int4_g128"], torch.bfloat16,
                                                                               4096, 14336, 3)
    assert wo_tune.key_of(SPEC, torch.float16, 4096, 4096, 2000) is None
    # MoE calls: T buckets go on to 16384 tokens (prefill chunks)
    moe = [wo_tune.moe_key(SPEC, torch.bfloat16, 128, 8, 1536, 2048, 768, t) for t in (3, 1025, 4096, 16384, 16385)]
    assert [k and k.rsplit("|", 1)[1] for k in moe] == ["t4", "t2048", "t4096", "t16384", None]
    assert moe[0].endswith("|bfloat16|moe E128 k8 1536x2048 2048x768|t4")
    assert wo_tune.file_name(GPU) == "NVIDIA_H100_80GB_HBM3.json"


def test_lookup_order(tables):
    """On-disk cache, then the shipped table, then None (the policy's)."""
    cache, shipped = tables
    k1, k2, k3 = (wo_tune.key_of(SPEC, torch.bfloat16, 4096, 4096, m) for m in (1, 16, 64))
    wo_tune.write_table(shipped / wo_tune.file_name(GPU), GPU, {k1: {"route": "triton"}, k2: {"route": "dequant"}})
    wo_tune.write_table(cache / wo_tune.file_name(GPU), GPU, {k1: {"route": "mma", "launch": {"kw": 2}}})
    assert wo_tune.lookup(GPU, k1) == Choice("mma", {"kw": 2})
    assert wo_tune.lookup(GPU, k2) == Choice("dequant")
    assert wo_tune.lookup(GPU, k3) is None
    assert wo_tune.lookup("NVIDIA A100-SXM4-80GB", k1) is None  # tables are per GPU name
    assert wo_tune.lookup(GPU, None) is None


def test_cache_off(tables, monkeypatch):
    cache, _ = tables
    monkeypatch.setenv("QCOMPILE_TUNE_CACHE", "0")
    wo_tune.store(GPU, "k", Choice("dequant"))
    assert wo_tune.cache_dir() is None and not cache.exists() and wo_tune.lookup(GPU, "k") is None
    monkeypatch.delenv("QCOMPILE_TUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert wo_tune.cache_dir() == cache / "qcompile" / "tuned"


def test_cache_file_round_trip(tables):
    """store() adds to the cache file (figures beside the choice), lookup() reads it back after the tables are
    forgotten; unknown routes are skipped; a file that is not a table names itself in a ConfigError."""
    cache, _ = tables
    a, b = (wo_tune.key_of(SPEC, torch.bfloat16, 6144, 4096, m) for m in (8, 32))
    wo_tune.store(GPU, a, Choice("mma", {"split": 1}), {"us": 12.5, "policy_us": 14.0})
    wo_tune.store(GPU, b, Choice("policy"))
    path = cache / wo_tune.file_name(GPU)
    raw = json.loads(path.read_text())
    assert raw["gpu"] == GPU and raw["entries"][a] == {"route": "mma", "launch": {"split": 1}, "us": 12.5,
                                                       "policy_us": 14.0}
    wo_tune.clear()
    assert wo_tune.lookup(GPU, a) == Choice("mma", {"split": 1}) and wo_tune.lookup(GPU, b) == Choice("policy")
    raw["entries"]["x"] = {"route": "tensorrt"}
    path.write_text(json.dumps(raw))
    assert set(wo_tune.read_table(path)) == {a, b}
    path.write_text("[1, 2")
    wo_tune.clear()
    with pytest.raises(ConfigError, match="not a qcompile tuning table") as e:
        wo_tune.lookup(GPU, a)
    assert str(path) in str(e.value)


def test_merge_table_keeps_other_entries(tmp_path):
    """merge_table adds to a table file: other entries (and unknown routes) kept, the same keys replaced; a file
    that is not a table is refused before anything is written."""
    path = tmp_path / "t.json"
    wo_tune.merge_table(path, GPU, {"a": {"route": "policy"}, "b": {"route": "tensorrt"}})
    wo_tune.merge_table(path, GPU, {"a": {"route": "dequant", "us": 3.0}, "c": {"route": "triton"}})
    raw = json.loads(path.read_text())
    assert raw["gpu"] == GPU and raw["entries"] == {"a": {"route": "dequant", "us": 3.0}, "b": {"route": "tensorrt"},
                                                   "c": {"route": "triton"}}
    path.write_text("[1, 2")
    with pytest.raises(ConfigError, match="not a qcompile tuning table"):
        wo_tune.merge_table(path, GPU, {"d": {"route": "policy"}})
    assert path.read_text() == "[1, 2"


def _on_cuda(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta").as_subclass(OnCuda)


def test_no_measuring_under_capture_compile_or_fake(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    x = _on_cuda(4, 64)
    assert wo_tune.can_measure(x)
    with FakeTensorMode():
        fake = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
    assert not wo_tune.can_measure(fake)
    assert not wo_tune.can_measure(torch.empty(4, 64))  # CPU
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not wo_tune.can_measure(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not wo_tune.can_measure(x)


def test_tune_switch(monkeypatch):
    monkeypatch.delenv("QCOMPILE_TUNE", raising=False)
    monkeypatch.setattr(wo_tune, "_ENABLED", None)
    assert not wo_tune.enabled()
    monkeypatch.setenv("QCOMPILE_TUNE", "1")
    assert wo_tune.enabled()
    qcompile.tune(False)
    assert not wo_tune.enabled()
    qcompile.tune()
    assert wo_tune.enabled()


def test_candidates():
    """The policy first; kernel variants that have a build and launch differently; Triton; dequant."""
    launches = {(): "A", (("wgmma", True),): "B", (("ws", True),): "A", (("kw", 2),): "C"}

    def decide(**kw):
        key = tuple(sorted(kw.items()))
        if key not in launches:
            raise ValueError("no such build")
        return launches[key]

    got = wo_tune.candidates(SPEC, 16, True, True, (9, 0), decide)
    assert got == [Choice("policy"), Choice("mma", {"wgmma": True}), Choice("mma", {"kw": 2}), Choice("triton"),
                   Choice("dequant")]
    assert wo_tune.candidates(SPEC, 300, True, False, (9, 0), decide) == [Choice("policy"), Choice("dequant")]


def test_graph_timed_measure_cycles_the_weight_copies(monkeypatch):
    """A list of runs (one per weight copy) is timed per call in a CUDA graph whose calls go through the copies in
    turn; a single run with the L2-flushed timer; a choice that fails is left out. Copies: enough for 256 MB, 2..16."""
    import qcompile.bench as bench

    calls = []

    def graph_time_us(fn, calls_per_graph, replays):
        for _ in range(calls_per_graph):
            fn()
        return 10.0

    def run(c, i):
        calls.append((c.route, i))
        if c.route == "triton":
            raise ValueError("no such build")

    monkeypatch.setattr(bench, "graph_time_us", graph_time_us)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runs = [lambda c, i=i: run(c, i) for i in range(3)]
    times = wo_tune.measure([Choice("policy"), Choice("triton"), Choice("dequant")], runs)
    assert times == {Choice("policy"): 10.0, Choice("dequant"): 10.0}
    assert [i for r, i in calls if r == "policy"] == [0, 1, 2] * 6 + [0, 1]
    monkeypatch.setattr(wo_tune, "timer", lambda fn, reps=20: 5.0)
    assert wo_tune.measure([Choice("policy")], lambda c: None) == {Choice("policy"): 5.0}
    assert [wo_tune.copies_for(b) for b in (1 << 30, 128 << 20, 100 << 20, 1 << 20, 0)] == [2, 2, 3, 16, 16]


def test_measure_leaves_out_what_the_output_check_rejects(monkeypatch, caplog):
    """A candidate whose output changes between identical calls (a race), or lies beyond MATCH_TOL from the
    policy's (a wrong tile or scale), is left out with a warning before it is timed; one within the tolerance (the
    routes round differently) is timed. A policy that does not run leaves only the repeatability check."""
    base = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    outs = {"policy": lambda: base, "triton": lambda: base * (1 + 1e-3),
            "dequant": lambda: base + 0.1 * torch.randn(64, 32),  # a different output each call
            "mma": lambda: base * 1.1}
    calls = []

    def call(c):
        calls.append(c.route)
        return outs[c.route]().bfloat16()

    monkeypatch.setattr(wo_tune, "timer", lambda fn, reps=20: 1.0)
    check = wo_tune.output_check(call)
    with caplog.at_level("WARNING", logger="qcompile"):
        times = wo_tune.measure([Choice(r) for r in outs], lambda c: None, check=check)
    assert times == {Choice("policy"): 1.0, Choice("triton"): 1.0}
    assert calls.count("policy") == 1 + wo_tune.CHECK_CALLS  # the reference once, then its own calls
    assert "differ between 3 identical calls" in caplog.text and '"route": "dequant"' in caplog.text
    assert re.search(r"is 0\.(099|1)\d* \(normwise\) from the policy route's", caplog.text)
    assert '"route": "mma"' in caplog.text

    def fails(c):
        if c.route == "policy":
            raise RuntimeError("no launch")
        return call(c)

    check = wo_tune.output_check(fails)
    assert check(Choice("mma")) is None and check(Choice("dequant")) is not None


def test_weight_copies_clone_the_weight_tensors():
    """Tuning's copies of a call: their own weight, scale and zero point; x, global scale, g_idx and bias shared."""
    w, s, z = torch.zeros(64, 8, dtype=torch.int32), torch.ones(64, 1), torch.zeros(64, 1, dtype=torch.int8)
    x, gs = torch.zeros(1, 64), torch.ones(())
    args = (x, w, s, gs, z, None, None, SPEC)
    copies = wo_gemm.weight_copies(args)
    assert copies[0] is args and len(copies) == wo_tune.copies_for(w.nbytes + s.nbytes + z.nbytes) == 16
    for c in copies[1:]:
        assert c[0] is x and c[3] is gs and c[7] is SPEC
        assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in ((c[1], w), (c[2], s), (c[4], z)))


def test_tuned_entry_changes_the_route(tables, monkeypatch):
    """With a mocked timer the fastest route wins (the policy on a tie within 1 %), is kept in the cache, and
    the op's mma backend then runs the call that way."""
    us = {Choice("policy"): 20.0, Choice("mma", {"kw": 2}): 19.9, Choice("triton"): 30.0, Choice("dequant"): 15.0}
    monkeypatch.setattr(wo_tune, "timer", lambda fn, reps=20: fn())
    times = wo_tune.measure(list(us), lambda c: us[c])
    assert times == us and wo_tune.best(times) == Choice("dequant")
    del us[Choice("dequant")]
    assert wo_tune.best(us) == Choice("policy")

    ran = []
    monkeypatch.setattr(wo_gemm, "_dequant", lambda *a: ran.append("dequant"))
    monkeypatch.setattr(wo_gemm, "_mma_policy", lambda *a: ran.append("policy"))
    monkeypatch.setattr(wo_gemm, "tune_call", lambda *a: ran.append("measured") or {Choice("dequant"): 1.0})
    monkeypatch.setattr(wo_tune, "on_gpu", lambda x: True)
    monkeypatch.setattr(wo_tune, "gpu_name", lambda x: GPU)
    x, w = _on_cuda(8, 4096), torch.empty(4096, 512, dtype=torch.int32, device="meta")
    args = (w, None, None, None, None, None, SPEC)
    monkeypatch.setattr(wo_tune, "_ENABLED", False)
    wo_gemm._mma(x, *args)
    wo_tune.store(GPU, wo_tune.key_of(SPEC, torch.bfloat16, 4096, 4096, 8), Choice("dequant"))
    wo_gemm._mma(x, *args)
    wo_gemm._mma(_on_cuda(3, 4096), *args)  # M = 3: another bucket
    monkeypatch.setattr(wo_tune, "_ENABLED", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    wo_gemm._mma(_on_cuda(3, 4096), *args)  # measured: the winner runs
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    wo_gemm._mma(_on_cuda(2, 4096), *args)  # captured: not measured
    assert ran == ["policy", "dequant", "policy", "measured", "dequant", "policy"]


# -- GPU -------------------------------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["int4_g128", "nvfp4", "int8_channel_packed", "mxfp8"])
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128, 256])
def test_gpu_every_candidate_matches_reference(name, m):
    """Every route the tuner may pick for a tiled weight computes what dequantize + F.linear does (bf16
    rounding of the fp32 sums: relative error < 1e-2)."""
    n, k = 4096, 4096
    case = _gpu_case(name, m, n, k, torch.bfloat16, seed=m)
    spec = wo_gemm.parse_scheme_key(case["scheme"]).weight
    tiled = replace(spec, tiled=True)
    w = quant_math.tile_weight(case["weight"], tiled)
    args = (case["x"], w, case["weight_scale"], case["weight_global_scale"], case["weight_zero_point"], None,
            case["bias"], tiled)
    ref = wo_gemm._dequant(*args).float()
    cands = wo_tune.candidates(tiled, m, True, True, torch.cuda.get_device_capability(),
                               lambda **kw: wo_gemm.wo_mma.decide(case["x"], w, args[3], args[4], args[6], tiled, **kw))
    assert Choice("policy") in cands and Choice("dequant") in cands
    for c in cands:
        out = wo_gemm.run_choice(c, *args).float()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name} M={m} {c}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_op_tunes_at_first_use(tables, monkeypatch):
    """With tuning on, the first call of a shape measures the candidates and keeps the winner in the cache;
    the op's result matches the reference before and after; under capture nothing is measured."""
    cache, _ = tables
    case = _gpu_case("int4_g128", 16, 4096, 4096, torch.bfloat16, seed=5)
    want = torch.ops.qcompile.wo_linear(*op_args(case, "dequant"))
    qcompile.tune(True)
    try:
        got = torch.ops.qcompile.wo_linear(*op_args(case, "mma"))
    finally:
        qcompile.tune(False)
    name = wo_tune.gpu_name(case["x"])
    entries = json.loads((cache / wo_tune.file_name(name)).read_text())["entries"]
    assert len(entries) == 1 and next(iter(entries)).endswith("|bfloat16|4096x4096|m16")
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    measured = []
    monkeypatch.setattr(wo_gemm, "tune_call", lambda *a: measured.append(a[0].shape[0]) or {Choice("policy"): 1.0})
    small = _gpu_case("int4_g128", 2, 4096, 4096, torch.bfloat16, seed=6)
    torch.ops.qcompile.wo_linear(*op_args(small, "mma"))  # (compiled outside the capture)
    qcompile.tune(True)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qcompile.wo_linear(*op_args(small, "mma"))
        torch.ops.qcompile.wo_linear(*op_args(_gpu_case("int4_g128", 4, 4096, 4096, torch.bfloat16, seed=7), "mma"))
    finally:
        qcompile.tune(False)
    assert measured == [4]


def test_shipped_tables_parse_fully():
    """Every table shipped in the package is readable and every entry names a route its op runs (the FP8
    GEMV's entries: the GEMV or cuBLASLt)."""
    for path in sorted(wo_tune.SHIPPED.glob("*.json")):
        raw = json.loads(path.read_text())["entries"]
        table = wo_tune.read_table(path)
        assert raw and len(table) == len(raw), path.name  # no entry skipped as unknown
        gemv = {c.route for k, c in table.items() if k.startswith("fp8_gemv|")}
        assert {c.route for k, c in table.items() if not k.startswith("fp8_gemv|")} <= {"policy", "mma", "triton",
                                                                                         "dequant"}
        assert gemv <= {"gemv", "scaled_mm"}
