"""The backend as users meet it: by name without importing qcompile, options, TORCH_LOGS, the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import qcompile
from qcompile.errors import ConfigError, UnsupportedError


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``env`` added; it must exit 0."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env}, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_backend_is_listed_without_importing_qcompile():
    assert "ok" in run_python("import sys, torch; assert 'qcompile' in torch._dynamo.list_backends(); "
                              "assert 'qcompile' not in sys.modules; print('ok')").stdout


def test_compile_by_name_without_importing_qcompile():
    code = ("import torch\n"
            "m = torch.nn.Linear(32, 16)\n"
            "out = torch.compile(m, backend='qcompile', options={'inner': 'eager'})(torch.randn(2, 32))\n"
            "assert out.shape == (2, 16); print('ok')")
    assert "ok" in run_python(code).stdout


def test_torch_logs_shows_rewrites():
    code = ("import torch\n"
            "m = torch.nn.Sequential(torch.nn.Linear(128, 128, dtype=torch.bfloat16))\n"
            "torch.compile(m, backend='qcompile', options={'inner': 'eager', 'online': 'fp8_per_tensor'})"
            "(torch.randn(2, 128, dtype=torch.bfloat16))\n")
    r = run_python(code, TORCH_LOGS="qcompile")
    assert "qcompile: 0 [w=fp8_e4m3/tensor;a=fp8_e4m3/dynamic/tensor] -> qcompile::fp8_linear" in r.stderr


def test_unknown_option_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown qcompile option"):
        qcompile.backend(innr="eager")
    with pytest.raises(ConfigError, match="inner compiler"):
        qcompile.backend(inner="tvm")


def test_kernel_override_that_cannot_run_is_an_error():
    m = torch.nn.Sequential(torch.nn.Linear(128, 128, dtype=torch.bfloat16))
    be = qcompile.backend(inner="eager", online="fp8_per_tensor", kernels="fp8_scaled_mm")
    with pytest.raises(Exception) as e:  # Dynamo wraps backend errors
        torch.compile(m, backend=be)(torch.randn(2, 128, dtype=torch.bfloat16))
    # Dynamo wraps backend errors in BackendCompilerFailed; ours is the cause, message intact
    cause = e.value if isinstance(e.value, UnsupportedError) else e.value.__cause__ or getattr(e.value, "inner_exception", None)
    assert isinstance(cause, UnsupportedError), repr(e.value)
    assert "fp8_scaled_mm" in str(cause) and "cannot run" in str(cause) and "needs a CUDA device" in str(cause)


def test_explain_table_names_module_scheme_op_kernel_and_reason():
    m = torch.nn.Sequential(torch.nn.Linear(128, 128, dtype=torch.bfloat16))
    be = qcompile.backend(inner="eager", online="fp8_per_block")
    torch.compile(m, backend=be)(torch.randn(2, 128, dtype=torch.bfloat16))
    table = be.explain()
    assert [c.strip() for c in table.splitlines()[0].split(" | ")][:4] == ["module", "scheme", "op", "kernel"]
    assert "w=fp8_e4m3/block128x128;a=fp8_e4m3/dynamic/group128" in table
    assert "needs a CUDA device" in table  # why the faster kernel was passed over, on this CPU machine

