"""benchmarks/e2e_decode.py on the CPU at tiny shapes: every path (checkpoints written from a model in memory
and loaded by qcompile.load, the own decode loop at two batch sizes, prefill, HF generate with a
CompileConfig, the logits errors, the table and the JSON) runs and reports what it measured; --interleave
alternates the decode rounds of models held together, and running out of memory building them is an error."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

import qcompile
from qcompile.errors import UnsupportedError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e_decode

SMOKE = ["--tiny", "--device", "cpu", "--inner", "eager", "--tokens", "2", "--reps", "1", "--layers", "1"]
# dense: two batch sizes and the prefill; MoE: online and checkpoint FP8, 4-bit experts, HF generate (each path
# once, for time)
CASES = {"llama": ["--formats", "bf16,bf16-qcompile,ct-w4a16", "--batch", "1", "2", "--prefill", "16"],
         "qwen3_moe": ["--formats", "online-fp8", "modelopt-fp8", "ct-w4a16", "--batch", "1", "--prefill", "0",
                       "--hf-generate", "--tokens", "6"],
         "gpt_oss": ["--formats", "bf16", "gptoss-mxfp4", "--batch", "1", "--prefill", "16"]}


@pytest.mark.parametrize("arch", CASES)
def test_e2e_decode_smoke(tmp_path, capsys, arch):
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE + CASES[arch] + ["--arch", arch, "--json", str(out)])
    report = json.loads(out.read_text())
    results, args = report["results"], report["args"]
    assert list(results) == [e2e_decode.model_name(f) for f in args["formats"]]
    if "bf16-qcompile" in results:  # the bf16 checkpoint as transformers loads it: the same weights
        assert results["bf16-qcompile"]["weight_bytes"] == results["bf16"]["weight_bytes"]
    for name, r in results.items():
        assert "error" not in r, r
        for b in args["batch"]:
            d = r[f"decode_b{b}"]
            assert d["tok_s"] > 0 and d["ms_per_step"] > 0 and d["floor_ms_per_step"] > 0, (name, b)
        assert r["weight_bytes"] > 0 and (r["prefill_ms"] > 0 if args["prefill"] else "prefill_ms" not in r)
        if args["hf_generate"]:  # (a call of 6 tokens - a call of 1) / 5; no deferral on CPU
            assert r["hf_generate_b1"]["ms_per_step"] > 0 and not r["hf_generate_b1"]["deferred"]
        if name != "bf16":
            assert r["errors"]["compiled_vs_dequantized_bf16"] < 0.2, name
            assert bool(r["kernels"]["by_op"]) == (name != "bf16-qcompile"), name  # nothing quantized there
    if arch == "qwen3_moe":  # every experts layer reports its kernel (or that it stayed transformers' bf16)
        for fmt in ("modelopt-fp8", "ct-w4a16"):
            assert set(results[f"{fmt} qcompile"]["kernels"]["experts_layers"].values()) == {"reference"}, fmt
        assert list(results["online-fp8 qcompile"]["kernels"]["experts_layers"]) == ["model.layers.0.mlp.experts"]
    if arch == "gpt_oss":  # OpenAI's fused MXFP4 experts, loaded quantized
        assert results["gptoss-mxfp4 qcompile"]["kernels"]["experts_layers"] == {
            "model.layers.0.mlp.experts": "reference"}
    assert "| model | weight MiB |" in capsys.readouterr().out


def test_unknown_format_is_refused(capsys):
    with pytest.raises(SystemExit):
        e2e_decode.parse_args(["--formats", "fp3"])
    assert "unknown format(s) ['fp3']" in capsys.readouterr().err


def test_format_options():
    assert e2e_decode.split_format("ct-w4a16") == ("ct-w4a16", None, {})
    assert e2e_decode.split_format("modelopt-fp8@fp8_scaled_mm~fuse=0+triton.enable_pdl=true") == \
        ("modelopt-fp8", "fp8_scaled_mm", {"fuse": False, "triton.enable_pdl": True})
    assert e2e_decode.backend_options("ct-w4a16~small_topk=0+triton.enable_pdl=1") == \
        {"kernels": None, "inductor_config": {"triton.enable_pdl": True}, "small_topk": False}
    assert e2e_decode.backend_options("modelopt-fp8~inductor.combo_kernels=0") == \
        {"kernels": None, "inductor_config": {"combo_kernels": False}}
    args = e2e_decode.parse_args(["--formats", "bf16,ct-w4a16~small_topk=0+triton.enable_pdl=0", "ct-w4a16@wo_mma~fuse=0"])
    assert args.formats == ["bf16", "ct-w4a16~small_topk=0+triton.enable_pdl=0", "ct-w4a16@wo_mma~fuse=0"]


@pytest.mark.parametrize("fmt, message", [
    ("ct-w4a16~fused=0", "unknown qcompile option(s) ['fused']"),
    ("ct-w4a16~fuse", "option 'fuse': write KEY=VALUE"),
    ("ct-w4a16~inductor.combo_kernel=0", "inductor has no config entry 'combo_kernel'"),
    ("ct-w4a16~small_topk=no", "option small_topk must be True or False, got 'no'"),
    ("ct-w4a16~triton.enable_pdll=0", "inductor has no config entry 'triton.enable_pdll'"),
    ("ct-w4a16~cudagraphs=0", "'cudagraphs' is set by the benchmark"),
    ("bf16~fuse=0", "plain bf16 runs under torch.compile")])
def test_bad_format_options_are_refused(capsys, fmt, message):
    with pytest.raises(SystemExit):
        e2e_decode.parse_args(["--formats", fmt])
    assert message in capsys.readouterr().err


def test_one_checkpoint_two_ways(tmp_path):
    """The same checkpoint with and without the Fuse pass in one run: 4 and 7 quantized matmuls per layer."""
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE + ["--formats", "ct-w4a16", "ct-w4a16~fuse=0", "--batch", "1", "--prefill", "0",
                             "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    counts = {name: sum(sum(k.values()) for k in r["kernels"]["by_op"].values()) for name, r in results.items()}
    assert counts == {"ct-w4a16 qcompile": 4, "ct-w4a16~fuse=0 qcompile": 7}, counts


def test_inductor_patches_of_the_decode_graphs(tmp_path, capsys):
    """Under inductor the results say which config patches each decode graph compiled with (on the GPU: PDL, combo
    kernels, CUDA graphs; here the format's own entry)."""
    out = tmp_path / "out.json"
    args = [a if a != "eager" else "inductor" for a in SMOKE]
    e2e_decode.main(args + ["--formats", "ct-w4a16~inductor.max_fusion_size=32", "--batch", "1", "--prefill", "0",
                            "--no-errors", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert results["ct-w4a16~inductor.max_fusion_size=32 qcompile"]["inductor_patches"] == [{"max_fusion_size": 32}]
    assert "decode graphs compiled with: max_fusion_size=32" in capsys.readouterr().out


def test_interleaved_rounds_rotate(tmp_path, capsys, monkeypatch):
    """--interleave: every decode step is built and warmed before the first timed round; then each round runs,
    at each batch size, every model once in the models' order rotated by the round; each model's figure is the
    median of its --reps rounds, reported with their spread, and the speed-up is the ratio of the medians."""
    calls = []
    run = e2e_decode.em.Decoder.run

    def spy(self, n):
        calls.append((id(self.model), self.tok.shape[0]))
        return run(self, n)

    monkeypatch.setattr(e2e_decode.em.Decoder, "run", spy)
    formats, batches, reps = ["bf16", "modelopt-fp8", "online-fp8"], [1, 2], 4
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE + ["--formats", *formats, "--batch", *map(str, batches), "--reps", str(reps),
                             "--prefill", "0", "--interleave", "--json", str(out)])
    names = [e2e_decode.model_name(f) for f in formats]
    model_of = {i: names[k] for k, i in enumerate(dict.fromkeys(i for i, _ in calls))}
    seen = [(model_of[i], b) for i, b in calls]
    warm = [(name, b) for name in names for b in batches]
    timed = [(name, b) for r in range(reps) for b in batches for name in names[r % 3:] + names[:r % 3]]
    assert seen == warm + timed

    report = json.loads(out.read_text())
    results, text = report["results"], capsys.readouterr().out
    assert report["args"]["interleave"] and "interleaved" in report["note"]
    assert "decode b1 tok/s (ms/step, % floor, vs bf16; spread)" in text
    for name in names:
        for b in batches:
            d = results[name][f"decode_b{b}"]
            assert len(d["rounds_tok_s"]) == reps and d["spread_pct"] >= 0, (name, b, d)
            assert f"spread {d['spread_pct']:.0f} %" in text
        if name != "bf16":
            up = results[name]["decode_b1"]["tok_s"] / results["bf16"]["decode_b1"]["tok_s"]
            assert f"| {name} | " in text and f", {up:.2f}x; spread" in text


def test_decode_figures_median_and_spread():
    """Rounds of 1, 2 and 4 s for 4 steps at batch 2: 8, 4 and 2 tok/s; the median round is 4 tok/s, the spread
    (8 - 2) / 4."""
    d = e2e_decode.em.decode_figures(2, 4, [1.0, 4.0, 2.0])
    assert d["tok_s"] == 4 and d["ms_per_step"] == 500 and d["rounds_tok_s"] == [8, 2, 4]
    assert d["spread_pct"] == pytest.approx(150)


@pytest.mark.parametrize("interleave", [True, False])
def test_out_of_memory_while_building(tmp_path, monkeypatch, interleave):
    """CUDA running out of memory while the models are built together for --interleave stops the run with an
    UnsupportedError naming the model and the fix; one after another, it is that model's result and the run
    goes on."""
    def load(path, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(qcompile, "load", load)
    argv = SMOKE + ["--formats", "ct-w4a16", "modelopt-fp8", "--prefill", "0"] + (["--interleave"] if interleave else [])
    if interleave:
        with pytest.raises(UnsupportedError) as e:
            e2e_decode.main(argv)
        message = str(e.value)
        assert message.startswith("model 'ct-w4a16 qcompile': CUDA ran out of memory"), message
        assert "drop --interleave" in message and "fewer --formats" in message and "Tried to allocate" in message
    else:
        results = e2e_decode.main(argv)
        assert {name: r["error"][:15] for name, r in results.items()} == {
            "ct-w4a16 qcompile": "OutOfMemoryErro", "modelopt-fp8 qcompile": "OutOfMemoryErro"}


def test_no_errors_skips_the_probe(tmp_path, monkeypatch):
    """--no-errors: no logits probe (no second compile, no dequantized copy), and the table leaves its columns out."""
    import e2e_models
    monkeypatch.setattr(e2e_models, "logits_errors", lambda *a, **k: pytest.fail("the probe ran"))
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE + ["--arch", "llama", "--formats", "bf16", "ct-w4a16", "--batch", "1", "--prefill", "0",
                             "--no-errors", "--json", str(out)])
    report = json.loads(out.read_text())
    assert all("errors" not in r and r["decode_b1"]["tok_s"] > 0 for r in report["results"].values())
    table = e2e_decode.table(report["results"], argparse.Namespace(**report["args"]))
    assert "compiled vs eager" not in table and "ct-w4a16 qcompile" in table


def test_prefill_only(tmp_path, capsys):
    """--tokens 0: no decode step is built or timed; each model's prefill is printed when measured and the table has
    the prefill column alone."""
    out = tmp_path / "out.json"
    e2e_decode.main(SMOKE[:-6] + ["--tokens", "0", "--reps", "1", "--layers", "1", "--arch", "llama", "--formats",
                                  "bf16", "ct-w4a16", "--prefill", "16", "--no-errors", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["args"]["batch"] == []
    for r in report["results"].values():
        assert r["prefill_ms"] > 0 and not any(k.startswith("decode_b") for k in r) and "kernels" not in r, r
    # the prefill's own kernels: the one layer's four quantized linears (q/k/v and gate/up fused), the CPU's backend
    kernels = report["results"]["ct-w4a16 qcompile"]["prefill_kernels"]["by_op"]
    assert kernels == {"qcompile::wo_linear": {"wo_dequant": 4}}
    printed = capsys.readouterr().out
    assert "ct-w4a16 qcompile prefill of 16 tokens:" in printed and "decode b" not in printed.split("| model")[-1]
    with pytest.raises(SystemExit):
        e2e_decode.parse_args(["--tokens", "-1"])


def test_profile_prefill_dry_run(capsys):
    """benchmarks/profile_prefill.py --dry-run: both models prefill compiled on the CPU and report their wall time
    and host profile (no GPU time there)."""
    import profile_prefill

    out = profile_prefill.main(["1", "--dry-run"])
    assert set(out) == {"bf16", "fp8"} and all(r["wall_ms"] > 0 and r["gpu_ms"] == 0 for r in out.values())
    printed = capsys.readouterr().out
    assert "fp8 1 layers prefill 32: wall" in printed and "qcompile::experts_ref" in printed
