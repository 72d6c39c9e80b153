"""The host memory a ``qcompile.load`` takes at its peak, measured in a fresh Python process.

What is measured: the process's peak resident set (VmHWM) while loading ``big``, minus its resident set
(VmRSS) just before, after a warm-up load of ``tiny`` with the same arguments has brought in the code
paths, libraries and imports a load needs. The resident set counts every page the process holds: its
own memory and the pages of the checkpoint it has mapped and read (transformers reads safetensors
through mmap) alike, so a loader that keeps the file's pages resident beside its copy of the weights
pays for both. VmHWM is this process's own high-water mark, reset before the load through
``/proc/self/clear_refs``: ru_maxrss would also hold the RSS of the process that started it (Linux
carries it over exec), here pytest's. Linux only.

``weights``: the bytes of the loaded model's state (each tensor once, tied ones shared).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import gc, json, sys
import transformers, qcompile
from qcompile.experts import QuantExperts
from qcompile.linear import QuantLinear
transformers.logging.set_verbosity_error()
big, tiny, loads = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024

for kwargs in loads:
    qcompile.load(tiny, **kwargs)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    model = qcompile.load(big, **kwargs)
    peak = status("VmHWM")
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    print(json.dumps({"load": kwargs, "growth": peak - base, "weights": sum(tensors.values()),
                      "quant_linears": len(linears),
                      "quant_experts": sum(isinstance(m, QuantExperts) for m in model.modules()),
                      "largest_linear_bf16": max((m.in_features * m.out_features * 2 for m in linears), default=0)}))
    del model, linears
"""


def load_peaks(big: str | Path, tiny: str | Path, loads: list[dict]) -> list[dict]:
    """For each ``qcompile.load`` keyword set of ``loads``, in one child process: ``{"load", "growth",
    "weights", "quant_linears", "quant_experts", "largest_linear_bf16"}`` (bytes; module docstring)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(big), str(tiny), json.dumps(loads)], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["load"] for r in results] == loads, out.stdout[-2000:]
    return results


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
