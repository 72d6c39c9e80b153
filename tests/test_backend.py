"""The backend as users meet it: by name without importing qcompile, options, TORCH_LOGS, the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qcompile
from qcompile.errors import ConfigError, UnsupportedError


REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``env`` added, importing this checkout's qcompile (whichever
    copy is installed: the entry point names a module, found on the path); it must exit 0."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": path, **env}, cwd="/")
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


# The interpreter as from a source checkout: importlib.metadata finds no qcompile torch_dynamo_backends entry
WITHOUT_ENTRY_POINT = """\
import importlib.metadata as md
_entry_points = md.entry_points
def entry_points(**selection):
    found = _entry_points(**selection)
    if selection.get("group") != "torch_dynamo_backends":
        return found
    return md.EntryPoints(e for e in found if e.name != "qcompile")
md.entry_points = entry_points
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.exc import InvalidBackend
"""
COMPILE_BY_NAME = ("m = torch.nn.Linear(32, 16)\n"
                   "out = torch.compile(m, backend='qcompile', options={'inner': 'eager'})(torch.randn(2, 32))\n"
                   "assert out.shape == (2, 16)\n")


def test_import_registers_the_backend_without_the_entry_point():
    code = (WITHOUT_ENTRY_POINT +
            "try:\n    lookup_backend('qcompile')\nexcept InvalidBackend:\n    pass\n"
            "else:\n    raise SystemExit('qcompile was a backend before the import')\n"
            "import qcompile\n" + COMPILE_BY_NAME +
            "assert 'qcompile' in torch._dynamo.list_backends(); print('ok')")
    assert "ok" in run_python(code).stdout


def test_import_and_entry_point_register_once():
    """Imported first, then the entry point discovered (list_backends) and used; or the entry point
    loaded first (it imports qcompile), then imported: one registration either way."""
    first_import = ("import torch, qcompile\n"
                    "assert 'qcompile' in torch._dynamo.list_backends()\n" + COMPILE_BY_NAME + "print('ok')")
    first_entry_point = ("import sys, torch\n" + COMPILE_BY_NAME +
                         "assert 'qcompile' in sys.modules\nimport qcompile\n" + COMPILE_BY_NAME + "print('ok')")
    for code in (first_import, first_entry_point):
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


@pytest.mark.parametrize("options, message", [
    ({"fuse": "no"}, "option fuse must be True or False, got 'no'"),
    ({"small_topk": 0}, "option small_topk must be True or False, got 0"),
    ({"inductor_config": {"triton.enable_pdll": True}}, "inductor has no config entry 'triton.enable_pdll'"),
])
def test_bad_option_values_are_clear_errors(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        qcompile.backend(**options)


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


def fake_cuda_input(monkeypatch, capability, env=None):
    """A graph input on a (fake) CUDA device of ``capability``, the PDL switches unset but for ``env``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name in ("QCOMPILE_PDL", "TORCHINDUCTOR_ENABLE_PDL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    from qcompile.kernels import cuda_driver

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(cuda_driver, "device_index", lambda device: 0)
    monkeypatch.setattr(cuda_driver, "device_name", lambda idx: "Fake GPU")  # (the tuning tables' file)
    with FakeTensorMode():
        return torch.empty(2, 8, device="cuda")


@pytest.mark.parametrize("capability, env, given, expected", [
    ((9, 0), {}, {}, True),                                       # Hopper: on
    ((8, 0), {}, {}, None),                                       # Ampere has no griddepcontrol
    ((9, 0), {"QCOMPILE_PDL": "0"}, {}, None),                    # qcompile's switch
    ((9, 0), {"TORCHINDUCTOR_ENABLE_PDL": "0"}, {}, None),        # inductor's own switch decides
    ((9, 0), {}, {"triton.enable_pdl": False}, False),            # the user's inductor_config decides
])
def test_inductor_kernels_use_pdl_on_sm90(monkeypatch, capability, env, given, expected):
    from qcompile.backend import Options, inductor_patches
    x = fake_cuda_input(monkeypatch, capability, env)
    opts = Options.make({"inductor_config": given, "cudagraphs": True})
    patches = inductor_patches(opts, [x, 3])
    assert patches.get("triton.enable_pdl") is expected
    assert patches["triton.cudagraphs"] is True


def test_pdl_on_in_inductors_config_is_left_alone(monkeypatch):
    from qcompile.backend import Options, inductor_patches
    x = fake_cuda_input(monkeypatch, (9, 0))
    assert inductor_patches(Options(), [x]) == {"triton.enable_pdl": True}
    with torch._inductor.config.patch({"triton.enable_pdl": True}):
        assert inductor_patches(Options(), [x]) == {}


def test_every_graph_of_a_process_gets_the_launch_settings(monkeypatch):
    """A compile with config patches (this backend's own: inductor compiles under ``config.patch``) leaves the
    entries marked as set by the caller when it ends; the next graph still gets PDL and combo kernels."""
    from qcompile.backend import Options, inductor_patches
    x = fake_cuda_input(monkeypatch, (9, 0))
    graphs = Options(cudagraphs=True)
    first = inductor_patches(graphs, [x])
    assert first["triton.enable_pdl"] is True and first["combo_kernels"] is True
    with torch._inductor.config.patch({k: v for k, v in first.items() if k != "triton.cudagraphs"}):
        pass
    assert not torch._inductor.config._is_default("combo_kernels")  # the mark a compile leaves
    assert inductor_patches(graphs, [x]) == first


def test_cuda_graphs_get_combo_kernels_unless_the_caller_decides(monkeypatch):
    from qcompile.backend import Options, inductor_patches
    x = fake_cuda_input(monkeypatch, (8, 0))  # any CUDA GPU
    graphs = Options(cudagraphs=True)
    assert inductor_patches(graphs, [x])["combo_kernels"] is True
    assert "combo_kernels" not in inductor_patches(Options(), [x])  # no CUDA graphs: inductor's default
    given = Options.make({"inductor_config": {"combo_kernels": False}, "cudagraphs": True})
    assert inductor_patches(given, [x])["combo_kernels"] is False
    with torch._inductor.config.patch({"combo_kernels": True}):  # on in inductor's config already: left alone
        assert "combo_kernels" not in inductor_patches(graphs, [x])


@pytest.mark.parametrize("given, error, compiles", [
    ({}, AttributeError("a combo kernel's constexpr"), [True, False]),   # the backend's choice: once more without
    ({"inductor_config": {"combo_kernels": True}}, AttributeError("x"), [True]),  # the caller's: inductor's error
    ({}, UnsupportedError("no kernel"), [True]),                         # qcompile's own error stands
])
def test_combo_kernels_the_backend_chose_give_way_where_inductor_fails(monkeypatch, caplog, given, error, compiles):
    import logging

    import torch._inductor.compile_fx as compile_fx
    from qcompile.backend import QCompileBackend

    x = fake_cuda_input(monkeypatch, (9, 0))
    seen = []

    def fake_compile_fx(gm, inputs, config_patches, decompositions):
        seen.append(config_patches.get("combo_kernels"))
        if config_patches.get("combo_kernels"):
            raise error
        return "compiled"

    monkeypatch.setattr(compile_fx, "compile_fx", fake_compile_fx)
    be = QCompileBackend(cudagraphs=True, **given)
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with caplog.at_level(logging.WARNING, logger="qcompile"):
        if len(compiles) == 2:
            assert be._inner(gm, [x]) == "compiled"
            assert "inductor failed with combo kernels on (AttributeError" in caplog.text
            assert [p["combo_kernels"] for p in be.compiled_with] == [False]  # what the graph compiled with
        else:
            with pytest.raises(type(error)):
                be._inner(gm, [x])
            assert be.compiled_with == []
    assert seen == compiles


def test_inductor_patches_leave_cpu_graphs_alone():
    from qcompile.backend import Options, inductor_patches
    assert inductor_patches(Options(), [torch.empty(2, 8)]) == {}
