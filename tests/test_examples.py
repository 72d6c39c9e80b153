"""Each script of examples/ runs on CPU with no argument (the built-in tiny model) and prints what it
promises. Subprocesses, as a user runs them, with this checkout's qcompile first on the path; the
GPU, if any, is hidden. Each compiles the tiny model with inductor one to three times: 1-4 minutes
apiece on 2 cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 900  # per script; each took 1.5-3.5 minutes on 2 cores shared with other jobs

pytestmark = pytest.mark.slow


def run_example(name: str, cwd: Path, *args: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=BUDGET_S)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_examples_are_documented():
    scripts = sorted(p.name for p in (REPO / "examples").glob("*.py"))
    assert scripts == ["benchmark_plot.py", "explain.py", "generate.py", "load_and_compile.py", "online_fp8.py"]
    readme = (REPO / "examples" / "README.md").read_text()
    for name in scripts:
        assert f"python examples/{name}" in readme, name


def test_load_and_compile(tmp_path):
    out = run_example("load_and_compile.py", tmp_path)
    assert "modelopt: 14 quantized layers, e.g. model.layers.0.self_attn.q_proj: w=fp8_e4m3/tensor" in out
    assert "compiled logits (1, 12, 384); relative difference to the eager qcompile.load model" in out
    assert re.search(r"model\.layers\.0\.self_attn\.\{q,k,v\}_proj \| w=fp8_e4m3/tensor;a=fp8_e4m3/static/tensor +\| "
                     r"qcompile::fp8_linear", out)  # q, k and v run as one matmul


def test_online_fp8(tmp_path):
    out = run_example("online_fp8.py", tmp_path)
    assert "at load: (1, 12, 384) logits; 14 FP8 layers" in out
    assert "at compile time: (1, 12, 384) logits" in out
    assert "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128 | qcompile::fp8_linear" in out


def test_generate_runs_the_compiled_forward(tmp_path):
    out = run_example("generate.py", tmp_path)
    assert "torch.compile(model).generate(): 0 graphs compiled: it ran eager" in out
    line = next(x for x in out.splitlines() if x.startswith("model.forward = torch.compile(...): "))
    graphs = int(line.split(": ")[1].split()[0])
    # prefill and decode graphs; 14 layers in 8 matmuls (q/k/v and gate/up fused)
    assert graphs >= 2 and "8 layers lowered, e.g. fp8_emulated" in line
    assert "text (random weights: meaningless): " in out


def test_explain(tmp_path):
    out = run_example("explain.py", tmp_path)
    assert len(re.findall(r"^module +\| scheme", out, re.M)) == 2  # the default and the override
    assert "2 layers on the reference kernel: model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj" in out


def test_benchmark_plot_writes_the_png(tmp_path):
    out = run_example("benchmark_plot.py", tmp_path)
    png = tmp_path / "linear_latency.png"
    assert "wrote linear_latency.png" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [x for x in out.splitlines() if x.startswith("[")]
    assert len(rows) == 6 and all("M=1 " in r and "M=64 " in r for r in rows)  # 3 shapes x (qcompile, bf16)
