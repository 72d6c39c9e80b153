"""The ``qcompile`` command line: help and version, the format list, ``explain``, ``run``'s accuracy
check (which reference, what a failure says), temporary directories, labels, ``bench`` on CPU.

Runs go through ``main()`` in-process with ``--inner eager`` (Dynamo and qcompile's pass, no code
generation), so each takes seconds."""

from __future__ import annotations

import argparse
import copy
import shutil
import tempfile

import pytest
import torch

import qcompile
import qcompile.kernels.wo_gemm  # noqa: F401  (registers qcompile::wo_linear, the weight-only op)
from qcompile import cli, synth
from qcompile.linear import dequantize_model
from qcompile.passes.linear import ExplainRow

FAST = ["--inner", "eager", "--max-new-tokens", "4"]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.fixture
def leftovers(tmp_path, monkeypatch):
    """tempfile's directory redirected to an empty folder; call it for the qcompile-* entries left there
    (inductor keeps its cache there too)."""
    root = tmp_path / "tmproot"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return lambda: sorted(p.name for p in root.iterdir() if p.name.startswith("qcompile"))


# -- help, version, formats -----------------------------------------------------------------------

def test_every_option_of_every_command_has_help():
    parser = cli.build_parser()
    commands = subparsers(parser)
    assert set(commands) == {"run", "explain", "bench"}
    for name, p in [("qcompile", parser), *commands.items()]:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and len(action.help) > 10, f"{name} {action.option_strings or action.dest}"
        assert p.description, name


def test_top_level_help_reads_like_a_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert out.startswith("usage: qcompile ")
    for text in ("run", "explain", "bench", "examples:", "exit status:", "1  an accuracy check failed"):
        assert text in out
    assert '"""' not in out and "``" not in out  # not a raw docstring


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == (f"qcompile {qcompile.__version__} (torch {torch.__version__}, "
                                               f"transformers {__import__('transformers').__version__})")


def test_format_offers_the_quantized_formats_only(capsys):
    run = subparsers(cli.build_parser())["run"]
    fmt = next(a for a in run._actions if a.dest == "format")
    assert tuple(fmt.choices) == synth.QUANTIZED_FORMATS and "bf16" not in fmt.choices
    assert set(synth.QUANTIZED_FORMATS) == set(synth.FORMATS) - {"bf16"}
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--format", "bf16"])
    assert e.value.code == 2 and "invalid choice: 'bf16'" in capsys.readouterr().err


def test_format_with_a_checkpoint_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["explain", str(tmp_path), "--format", "ct-fp8-block"])
    assert e.value.code == 2 and "a CHECKPOINT brings its own" in capsys.readouterr().err


def test_kernel_option_forms():
    ns = argparse.Namespace
    assert cli._kernels(ns(kernel=None)) is None
    assert cli._kernels(ns(kernel=["reference"])) == "reference"
    assert cli._kernels(ns(kernel=["*.down_proj=reference", "fp8_emulated"])) == {
        "*.down_proj": "reference", "*": "fp8_emulated"}


# -- explain --------------------------------------------------------------------------------------

def test_explain_prints_the_table_without_generating(capsys, leftovers):
    assert cli.main(["explain", "--format", "ct-fp8-block"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("module"))
    assert [c.strip() for c in header.split("|")] == ["module", "scheme", "op", "kernel", "why not faster"]
    assert out.count("qcompile::fp8_linear") == 8  # 2 layers x 4 matmuls: q/k/v and gate/up fused
    assert "14 layers in 8 matmuls: kernels fp8_emulated; 0 run weight-only" in out
    assert "generated" not in out and "tokens/s" not in out
    assert leftovers() == []


def test_explain_with_a_kernel_override(capsys):
    assert cli.main(["explain", "--format", "ct-fp8-block", "--kernel", "*.down_proj=reference"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model.layers.")]
    kernels = {line.split("|")[0].strip(): line.split("|")[3].strip() for line in rows}
    assert kernels["model.layers.1.mlp.down_proj"] == "reference"
    assert kernels["model.layers.1.mlp.{gate,up}_proj"] == "fp8_emulated"  # fused: the override names neither


def test_explain_compiles_with_eager_on_the_cpu(capsys, monkeypatch):
    """The default inner compiler: eager on the CPU (the table is the same under every compiler there); on a GPU
    inductor, which FP8 per-tensor / channel layers need for fp8_inductor."""
    inners, backend = [], qcompile.backend
    monkeypatch.setattr(qcompile, "backend", lambda **options: inners.append(options["inner"]) or backend(**options))
    assert cli.main(["explain", "--format", "modelopt-fp8"]) == 0
    assert inners == ["eager"]
    assert "fp8_inductor: needs a CUDA device, have cpu" in capsys.readouterr().out


def test_a_compilation_that_reaches_no_quantized_layer_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)  # as if Dynamo fell back to eager
    assert cli.main(["explain", "--format", "ct-fp8-block"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("qcompile: error: torch.compile: torch.compile handed none of the model's 14 quantized")


# -- run --------------------------------------------------------------------------------------------

def test_run_builtin_model_labels_random_output_and_cleans_up(capsys, leftovers):
    assert cli.main(["run", "--format", "modelopt-fp8", *FAST]) == 0
    out = capsys.readouterr().out
    assert "the built-in tiny Llama with random weights" in out
    assert "generated 4 tokens (random weights, so the text means nothing):" in out
    assert "decode (qcompile, inner eager): " in out and "tokens/s (batch 1, greedy, static KV cache, 1 tokens" in out
    assert "on CPU" in out  # the device the rate was measured on
    # inner eager runs the eager model's ops, but fused q/k/v and gate/up share one requantized per-tensor scale
    assert "check: compiled vs eager model: " in out and "): ok (" in out
    assert leftovers() == []


def test_run_checkpoint_without_tokenizer_is_not_labelled_random(tmp_path, capsys, leftovers):
    ckpt = tmp_path / "ckpt"
    synth.write_checkpoint(str(ckpt), "ct-w4a16")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).unlink(missing_ok=True)
    assert cli.main(["run", str(ckpt), *FAST, "--compare-bf16"]) == 0
    out = capsys.readouterr().out
    assert "the checkpoint has no tokenizer: using a byte-level stand-in" in out
    assert "generated 4 tokens (greedy):" in out and "random" not in out
    assert "decode (bf16 dequantized weights, torch.compile(backend='eager')): " in out
    assert "qcompile / bf16 decode speed: " in out and "on CPU the quantized ops are emulated" in out
    assert leftovers() == []  # the stand-in tokenizer's directory is gone


def test_run_failure_names_the_check_number_and_threshold(capsys):
    # ct-w4a16 compiles to wo_dequant (bf16 matmul of the dequantized weight), the eager model runs the
    # reference op (fp32): they differ in rounding, by far more than this threshold.
    assert cli.main(["run", "--format", "ct-w4a16", *FAST, "--max-rel-error", "1e-9"]) == cli.EXIT_CHECK_FAILED
    captured = capsys.readouterr()
    assert "check: compiled vs eager model: " in captured.out and "FAILED" in captured.out
    err = captured.err.splitlines()[-1]  # after transformers' progress bars
    assert err.startswith("qcompile: check failed: compiled vs eager model: relative logits error ")
    assert "exceeds 1.000e-09 (--max-rel-error 1e-09)" in err
    assert "so the compiled model should match the eager one; it does not" in err


def test_run_unquantized_checkpoint_is_a_qcompile_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["run", str(tmp_path)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("qcompile: error: ") and "has no quantization config" in err and "Traceback" not in err


def test_run_qcompile_error_exits_2_and_removes_the_tiny_model(capsys, leftovers):
    assert cli.main(["run", "--kernel", "no_such_kernel", *FAST]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("qcompile: error: ") and "'no_such_kernel' names no kernel" in err
    assert "Traceback" not in err
    assert leftovers() == []


# -- the check's reference, with the explain rows a GPU without an FP4 GEMM gives ------------------

@pytest.fixture(scope="module")
def nvfp4_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("nvfp4")
    synth.write_checkpoint(str(path), "modelopt-nvfp4")
    model = qcompile.load(str(path), device="cpu").eval()
    yield model
    shutil.rmtree(path)


def rows_for(model, weight_only: set[str]) -> list[ExplainRow]:
    """Explain rows as the pass writes them: wo_linear (weight-only) or the reference op."""
    rows = []
    for name, lq in model.qcompile_plan.items():
        op, kernel = ("qcompile::wo_linear", "wo_mma") if name in weight_only else ("qcompile::linear_ref",
                                                                                     "reference")
        rows.append(ExplainRow(name, lq.scheme.key, op, kernel))
    return rows


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


IDS = torch.randint(3, 384, (1, 12), generator=torch.Generator().manual_seed(0))


def test_weight_only_layers_are_checked_against_the_dequantized_model(nvfp4_model, capsys):
    weight_only = dequantize_model(copy.deepcopy(nvfp4_model))
    compiled = logits(weight_only, IDS)  # what weight-only kernels compute
    eager = logits(nvfp4_model, IDS)  # W4A4: activations quantized to FP4
    rows = rows_for(nvfp4_model, set(nvfp4_model.qcompile_plan))
    assert cli._activation_modes(rows) == (list(nvfp4_model.qcompile_plan), [])
    failed = cli._check(copy.deepcopy(nvfp4_model), IDS, eager, compiled, rows, max_rel_error=1e-3)
    out = capsys.readouterr().out
    assert failed is None, out
    assert "check: compiled vs weight-only reference: 0.000e+00 <= 1.000e-03 (--max-rel-error 0.001): ok" in out
    vs_eager = float(out.split("compiled vs eager model (the scheme as written)")[1].split()[0])
    assert vs_eager > 0.05  # what the old check compared, and failed on


def test_faithful_layers_are_checked_against_the_eager_model(nvfp4_model, capsys):
    compiled = logits(dequantize_model(copy.deepcopy(nvfp4_model)), IDS)  # weight-only output ...
    eager = logits(nvfp4_model, IDS)
    rows = rows_for(nvfp4_model, set())  # ... where the rows say activations are quantized: wrong
    failed = cli._check(copy.deepcopy(nvfp4_model), IDS, eager, compiled, rows, max_rel_error=1e-3)
    out = capsys.readouterr().out
    # the limit grows to 1.5x the FP4 activation quantization's own effect, which this output equals
    assert failed is None and "1.5x the activation quantization's own effect" in out
    garbage = compiled.flip(-1)
    failed = cli._check(copy.deepcopy(nvfp4_model), IDS, eager, garbage, rows, max_rel_error=1e-3)
    assert failed.startswith("compiled vs eager model: relative logits error ")


def test_mixed_weight_only_layers_get_a_mixed_reference(nvfp4_model, capsys):
    some = {n for n in nvfp4_model.qcompile_plan if ".mlp." in n}
    model = copy.deepcopy(nvfp4_model)
    expected = logits(cli._dequantize(copy.deepcopy(nvfp4_model), sorted(some)), IDS)
    failed = cli._check(model, IDS, logits(nvfp4_model, IDS), expected, rows_for(nvfp4_model, some), 1e-3)
    out = capsys.readouterr().out
    assert failed is None and "check: compiled vs mixed reference: 0.000e+00" in out
    assert f"{len(some)} of 14 quantized layers run weight-only kernels" in out


# -- bench ----------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_without_cuda_says_so(capsys):
    assert cli.main(["bench", "--m", "1"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("qcompile: error: qcompile bench: this machine has no CUDA GPU") and "Traceback" not in err
