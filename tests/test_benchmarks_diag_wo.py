"""benchmarks/diag_wo.py's --stream copy of the kernel source: it applies to this checkout's wo_mma.cu (a change to
the main loop that drops its anchor fails here, not on the GPU), it exits with its own message where it does not,
and (where nvcc is installed) the copy compiles for sm_90."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace

import pytest

from qcompile.kernels import wo_mma, wo_policy
from qcompile.scheme import parse_scheme_key

from .bench_util import benchmark
from .kernels.test_wo_policy import FakeGpu


def test_stream_source_replaces_the_decode_once():
    diag = benchmark("diag_wo")
    text = wo_mma.SOURCE.read_text()
    out = diag.stream_source(text)
    assert out.count(diag.STREAM_ONLY + diag.STREAM_ANCHOR) == 1
    assert len(out) == len(text) + len(diag.STREAM_ONLY)
    with pytest.raises(SystemExit, match="STREAM_ANCHOR"):
        diag.stream_source(text.replace(diag.STREAM_ANCHOR, ""))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_stream_source_compiles(tmp_path):
    """The stream-only copy of an int4 g128 M = 1 launch (tiled weights, sm_90) compiles."""
    diag = benchmark("diag_wo")
    spec = replace(diag.FORMATS["int4 g128"], tiled=True)
    cfg = wo_policy.choose(FakeGpu((9, 0), 132), wo_policy.Call(spec, 1, 4096, 4096), True, kw=2).cfg
    src = tmp_path / "stream.cu"
    src.write_text(wo_mma.defines(cfg) + diag.stream_source(wo_mma.SOURCE.read_text()))
    run = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-o", str(tmp_path / "s.cubin"), str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_moe_formats_name_the_moe_benchmarks_schemes():
    """--moe runs bench_moe's weight-only layers: the 4-bit and MX format names of --stream-formats / --ab-formats
    each name one row, whose scheme is the dense format's weight; tune_wo's words too; others stop with a message."""
    diag, bm = benchmark("diag_wo"), benchmark("bench_moe")
    for name in ("int4 g128", "nvfp4", "mxfp4", "mxfp8"):
        assert parse_scheme_key(bm.OURS_WO[bm.wo_row(name)]).weight == diag.FORMATS[name], name
    assert bm.wo_row("NVFP4") == bm.wo_row("nvfp4")
    with pytest.raises(SystemExit, match="int8 channel"):
        bm.wo_row("int8 channel")


def test_interleaved_rounds():
    """Every function once per round, in order, rounds after one another."""
    calls = []
    out = benchmark("diag_wo").interleaved({"a": "A", "b": "B"}, 3, lambda f: calls.append(f) or len(calls))
    assert calls == ["A", "B"] * 3 and out == {"a": [1, 3, 5], "b": [2, 4, 6]}


def test_env_variant_sets_and_restores(monkeypatch):
    """--ab NAME=VALUE[,NAME=VALUE]: the variables hold those values inside the block and their old values (or none)
    after it."""
    monkeypatch.setenv("QCOMPILE_DIAG_A", "old")
    monkeypatch.delenv("QCOMPILE_DIAG_B", raising=False)
    ctx = benchmark("diag_wo").env_of("QCOMPILE_DIAG_A=1,QCOMPILE_DIAG_B=x=y")
    with ctx:
        assert os.environ["QCOMPILE_DIAG_A"] == "1" and os.environ["QCOMPILE_DIAG_B"] == "x=y"
    assert os.environ["QCOMPILE_DIAG_A"] == "old" and "QCOMPILE_DIAG_B" not in os.environ
