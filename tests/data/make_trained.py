"""Regenerate ``tests/data/trained/``: a tiny byte-level Llama trained on CPU, and its copies quantized
by the real producers (llm-compressor, nvidia-modelopt, amd-quark). The tests only read the files.

Run it with the producers in their own environment (not the one qcompile's tests run in)::

    python -m venv /tmp/venv-prod
    /tmp/venv-prod/bin/pip install torch==2.13.0          # the CPU build
    /tmp/venv-prod/bin/pip install "llmcompressor==0.14.*" "nvidia-modelopt==0.47.*" "amd-quark==0.13.*" \\
        "transformers==5.17.*"
    /tmp/venv-prod/bin/python tests/data/make_trained.py             # train, then every producer
    /tmp/venv-prod/bin/python tests/data/make_trained.py --skip-train modelopt-fp8   # one producer again

Text: the top-level modules of the running interpreter's standard library (Python 3.11), sorted by
name; every 8th file is held out, and ``heldout.txt`` is a 2 KB excerpt of the held-out files. The
model: hidden 256, intermediate 512, 2 layers, heads 4/2, head_dim 64, tied embeddings, vocabulary of
``qcompile.synth.write_tokenizer`` (256 bytes + 3 specials). Training runs 400 steps on one thread
(measured: 18 minutes on a heavily shared 2-core machine); on its first run Quark compiles its C++
extension (a few minutes). Outputs, all made from ``trained/base-bf16`` and calibrated on 64 windows
of 128 training tokens, ``lm_head`` left unquantized:

* ``llmcompressor-fp8-dynamic``, ``-w4a16-gptq``, ``-nvfp4``: ``oneshot`` with FP8_DYNAMIC
  (QuantizationModifier), W4A16 (GPTQModifier, group 128), NVFP4 (QuantizationModifier).
* ``modelopt-fp8``, ``modelopt-nvfp4``: ``mtq.quantize`` with FP8_DEFAULT_CFG / NVFP4_DEFAULT_CFG,
  then ``export_hf_checkpoint``.
* ``quark-w-mxfp4``: the llama template's ``mxfp4_weight_only`` scheme, then ``export_safetensors``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import sysconfig
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "trained")
BASE = os.path.join(OUT, "base-bf16")
HELDOUT_EVERY = 8  # every 8th standard-library file is held out
HELDOUT_BYTES = 2048
SEQ, BATCH, STEPS, LR, WARMUP = 128, 16, 400, 3e-3, 30
CALIB_SAMPLES, CALIB_LEN = 64, 128
IGNORE = ["lm_head"]


def stdlib_files() -> tuple[list[str], list[str]]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return [f for f in files if f not in held], held


def tokenizer():
    from transformers import AutoTokenizer

    if not os.path.exists(os.path.join(BASE, "tokenizer.json")):
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from qcompile.synth import write_tokenizer

        os.makedirs(BASE, exist_ok=True)
        write_tokenizer(BASE)
    return AutoTokenizer.from_pretrained(BASE)


def encode(tok, files: list[str]) -> torch.Tensor:
    ids = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            ids += tok.encode(fh.read(), add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def heldout_excerpt(held: list[str]) -> str:
    """HELDOUT_BYTES of held-out text (ASCII) from a line start in the middle of the largest held-out file."""
    with open(max(held, key=os.path.getsize), encoding="utf-8") as fh:
        text = fh.read()
    start = text.index("\n", len(text) // 2) + 1
    chunk = text[start:start + 2 * HELDOUT_BYTES].encode("ascii", "replace")[:HELDOUT_BYTES]
    return chunk.decode("ascii")


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=259, tie_word_embeddings=True,
                       max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, initializer_range=0.02)


def perplexity(model, ids: torch.Tensor) -> float:
    x = ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)
    with torch.no_grad():
        logits = model(x).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return math.exp(loss.item())


def fit(model, data: torch.Tensor) -> None:
    """STEPS of AdamW on random SEQ-token windows of ``data`` (warm-up, then cosine to a tenth)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / STEPS)))))
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for step in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[s:s + SEQ] for s in starts])
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == STEPS - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)


def train() -> None:
    """Train the bf16 base model on the training files; write it, heldout.txt and training.json."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tok = tokenizer()
    train_files, held = stdlib_files()
    data = encode(tok, train_files)
    excerpt = heldout_excerpt(held)
    with open(os.path.join(OUT, "heldout.txt"), "w", encoding="ascii") as fh:
        fh.write(excerpt)
    model = AutoModelForCausalLM.from_config(model_config(), dtype=torch.float32)
    t0 = time.time()
    fit(model, data)
    model = model.eval().to(torch.bfloat16)
    model.save_pretrained(BASE)
    eval_ids = torch.tensor(tok.encode(excerpt, add_special_tokens=False))
    seconds = round(time.time() - t0)
    info = {"train_tokens": len(data), "steps": STEPS, "batch": BATCH, "seq": SEQ, "train_seconds": seconds,
            "heldout_ppl_bf16": perplexity(model, eval_ids), "uniform_ppl": 259}
    with open(os.path.join(OUT, "training.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    print(info)


def calibration(tok) -> list[torch.Tensor]:
    """CALIB_SAMPLES windows of CALIB_LEN training tokens (the producers' calibration set)."""
    data = encode(tok, stdlib_files()[0])
    g = torch.Generator().manual_seed(1)
    return [data[s:s + CALIB_LEN] for s in torch.randint(0, len(data) - CALIB_LEN, (CALIB_SAMPLES,), generator=g)]


def load_base(base: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)


def llmcompressor(recipe):
    def run(base: str, out: str, calib: list[torch.Tensor]) -> None:
        from datasets import Dataset
        from llmcompressor import oneshot

        ds = Dataset.from_dict({"input_ids": [c.tolist() for c in calib],
                                "attention_mask": [[1] * len(c) for c in calib]})
        model = load_base(base)
        oneshot(model=model, dataset=ds, recipe=recipe(), max_seq_length=CALIB_LEN,
                num_calibration_samples=len(calib), shuffle_calibration_samples=False)
        model.save_pretrained(out, save_compressed=True)
    return run


def modelopt(cfg_name: str):
    def run(base: str, out: str, calib: list[torch.Tensor]) -> None:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        def forward_loop(m):
            with torch.no_grad():
                for c in calib:
                    m(c[None])

        model = mtq.quantize(load_base(base), getattr(mtq, cfg_name), forward_loop)
        export_hf_checkpoint(model, export_dir=out)
    return run


def quark(scheme: str):
    def run(base: str, out: str, calib: list[torch.Tensor]) -> None:
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

        quantizer = ModelQuantizer(LLMTemplate.get("llama").get_config(scheme=scheme, exclude_layers=IGNORE))
        model = quantizer.quantize_model(load_base(base), [c[None] for c in calib])
        model = quantizer.freeze(model)
        export_safetensors(model, out)
    return run


def _ct_recipe(modifier: str, scheme: str):
    def recipe():
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

        cls = {"gptq": GPTQModifier, "rtn": QuantizationModifier}[modifier]
        return cls(targets="Linear", scheme=scheme, ignore=IGNORE)
    return recipe


PRODUCERS = {
    "llmcompressor-fp8-dynamic": llmcompressor(_ct_recipe("rtn", "FP8_DYNAMIC")),
    "llmcompressor-w4a16-gptq": llmcompressor(_ct_recipe("gptq", "W4A16")),
    "llmcompressor-nvfp4": llmcompressor(_ct_recipe("rtn", "NVFP4")),
    "modelopt-fp8": modelopt("FP8_DEFAULT_CFG"),
    "modelopt-nvfp4": modelopt("NVFP4_DEFAULT_CFG"),
    "quark-w-mxfp4": quark("mxfp4_weight_only"),
}


def produce(names: list[str]) -> None:
    tok = tokenizer()
    calib = calibration(tok)
    for name in names:
        out = os.path.join(OUT, name)
        shutil.rmtree(out, ignore_errors=True)
        PRODUCERS[name](BASE, out, calib)
        tok.save_pretrained(out)
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Regenerate tests/data/trained/ (see the module docstring).")
    ap.add_argument("--skip-train", action="store_true", help="keep trained/base-bf16 and quantize it again")
    ap.add_argument("only", nargs="*", help="producers' outputs to write (default: all)")
    args = ap.parse_args()
    unknown = sorted(set(args.only) - set(PRODUCERS))
    if unknown:
        ap.error(f"unknown output(s) {unknown}; choose from {sorted(PRODUCERS)}")
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    if not args.skip_train:
        train()
    produce(args.only or list(PRODUCERS))
