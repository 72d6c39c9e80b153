"""Run a test script under the Triton interpreter, in a subprocess: TRITON_INTERPRET is read when triton is
imported, so the process that sets it must import triton (and the kernels) afresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, timeout: int) -> dict:
    """The JSON object ``script`` prints last, run with TRITON_INTERPRET=1 from the repository root; the calling
    test is skipped where triton is not installed."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def error_record(out, want) -> list:
    """What an interpreter script reports per case: [max |out - want|, max |want|, out's shape, out's dtype]."""
    return [(out.double() - want.double()).abs().max().item(), want.abs().max().item(), list(out.shape),
            str(out.dtype)]
