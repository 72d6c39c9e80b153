"""Regenerate ``tests/data/trained/``: a tiny byte-level Llama and a tiny byte-level Qwen3-MoE trained on
CPU, and their copies quantized by the real producers (llm-compressor, nvidia-modelopt, amd-quark). The
tests only read the files.

Run it with the producers in their own environment (not the one qcompile's tests run in)::

    python -m venv /tmp/venv-prod
    /tmp/venv-prod/bin/pip install torch==2.13.0          # the CPU build
    /tmp/venv-prod/bin/pip install "llmcompressor==0.14.*" "nvidia-modelopt==0.47.*" "amd-quark==0.13.*" \\
        "transformers==5.17.*"
    /tmp/venv-prod/bin/python tests/data/make_trained.py             # train the Llama, then every producer
    /tmp/venv-prod/bin/python tests/data/make_trained.py --skip-train modelopt-fp8   # one producer again
    /tmp/venv-prod/bin/python tests/data/make_trained.py --arch qwen3moe   # the MoE model and its copies

Text: the top-level modules of the running interpreter's standard library (Python 3.11), sorted by
name; every 8th file is held out, and ``heldout.txt`` is a 2 KB excerpt of the held-out files. Both
models have 2 layers, head_dim 64, tied embeddings and the vocabulary of
``qcompile.synth.write_tokenizer`` (256 bytes + 3 specials), and train in fp32 on one thread with AdamW
on 16 x 128-token windows (``training.json`` / ``training-moe.json`` record each run):

* ``--arch llama`` (``base-bf16``, outputs ``<producer>``): hidden 256, intermediate 512, heads 4/2;
  400 steps (measured: 18 minutes on a heavily shared 2-core machine).
* ``--arch qwen3moe`` (``base-bf16-moe``, outputs ``<producer>-moe``): hidden 128, heads 2/1, 8 experts,
  top-2 (normalized), moe_intermediate 128 (2.0 M parameters: the copies stay small); 400 steps (measured:
  70 s of training, 3 minutes with the producers) with AUX_LOSS x :func:`balance_loss`, the
  load-balancing loss of each layer, so that every expert is used (``training-moe.json`` records each
  expert's share of the routed tokens). The routers (``mlp.gate``) are left unquantized, and Quark
  quantizes the experts after llm-compressor's ``linearize_moe`` splits them into per-expert Linears.

On its first run Quark compiles its C++ extension (a few minutes). Outputs, all made from the bf16
base and calibrated on 64 windows of 128 training tokens, ``lm_head`` left unquantized:

* ``llmcompressor-fp8-dynamic``, ``-w4a16-gptq``, ``-nvfp4``: ``oneshot`` with FP8_DYNAMIC
  (QuantizationModifier), W4A16 (GPTQModifier, group 128), NVFP4 (QuantizationModifier).
* ``modelopt-fp8``, ``modelopt-nvfp4``, ``modelopt-w4a16-nvfp4``: ``mtq.quantize`` with FP8_DEFAULT_CFG /
  NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG, then ``export_hf_checkpoint``.
* ``quark-w-mxfp4``: the model's template's ``mxfp4_weight_only`` scheme, then ``export_safetensors``.
* ``quark-w8a8-int8`` (MoE only): the template's ``int8`` scheme (per-tensor W8A8, static activations).
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "trained")
HELDOUT_EVERY = 8  # every 8th standard-library file is held out
HELDOUT_BYTES = 2048
SEQ, BATCH, LR, WARMUP = 128, 16, 3e-3, 30
LLAMA_STEPS, MOE_STEPS, AUX_LOSS = 400, 400, 0.05
CALIB_SAMPLES, CALIB_LEN = 64, 128


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=259, tie_word_embeddings=True,
                       max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, initializer_range=0.02)


def qwen3moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, vocab_size=259, tie_word_embeddings=True,
                          max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0, initializer_range=0.02)


@dataclass(frozen=True)
class Arch:
    config: Callable
    steps: int
    suffix: str  # of the base folder, the outputs and training.json
    ignore: tuple[str, ...]  # llm-compressor's names of the layers left unquantized
    quark_template: str
    outputs: tuple[str, ...]  # the PRODUCERS run by default
    moe: bool = False

    @property
    def base(self) -> str:
        return os.path.join(OUT, "base-bf16" + self.suffix)


def stdlib_files() -> tuple[list[str], list[str]]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return [f for f in files if f not in held], held


def tokenizer():
    from transformers import AutoTokenizer

    base = ARCHS["llama"].base
    if not os.path.exists(os.path.join(base, "tokenizer.json")):
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        from qcompile.synth import write_tokenizer

        os.makedirs(base, exist_ok=True)
        write_tokenizer(base)
    return AutoTokenizer.from_pretrained(base)


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


def windows(ids: torch.Tensor) -> torch.Tensor:
    return ids[: len(ids) // SEQ * SEQ].view(-1, SEQ)


def perplexity(model, ids: torch.Tensor) -> float:
    x = windows(ids)
    with torch.no_grad():
        logits = model(x).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return math.exp(loss.item())


def expert_shares(model, ids: torch.Tensor) -> list[list[float]]:
    """Per MoE layer, each expert's share of the routed (token, slot) pairs on ``ids``."""
    with torch.no_grad():
        router_logits = model(windows(ids), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return [[round(c, 4) for c in (torch.bincount(r.topk(k, dim=-1).indices.flatten(), minlength=r.shape[-1])
                                    / (r.shape[0] * k)).tolist()] for r in router_logits]


def balance_loss(router_logits: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    """The load-balancing loss of each MoE layer, averaged (1 when balanced): experts x the sum over experts
    of (share of the routed pairs) x (mean router probability). Per layer: transformers' own loss pools
    the layers, which lets an expert go unused in one layer while it is busy in another."""
    total = 0
    for r in router_logits:
        probs = r.float().softmax(-1)
        share = torch.nn.functional.one_hot(probs.topk(k, dim=-1).indices, r.shape[-1]).float().mean((0, 1))
        total = total + r.shape[-1] * (share * probs.mean(0)).sum()
    return total / len(router_logits)


def fit(model, data: torch.Tensor, steps: int) -> None:
    """``steps`` of AdamW on random SEQ-token windows of ``data`` (warm-up, then cosine to a tenth); an
    MoE model's loss adds AUX_LOSS x :func:`balance_loss`."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    moe = hasattr(model.config, "num_experts_per_tok")
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[s:s + SEQ] for s in starts])
        out = model(x, output_router_logits=True) if moe else model(x)
        loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        aux = balance_loss(out.router_logits, model.config.num_experts_per_tok) if moe else torch.zeros(())
        (loss + AUX_LOSS * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f} balance {aux.item():.3f} ({time.time() - t0:.0f} s)", flush=True)


def train(arch: Arch) -> None:
    """Train the bf16 base model on the training files; write it, heldout.txt and training<suffix>.json."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tok = tokenizer()
    train_files, held = stdlib_files()
    data = encode(tok, train_files)
    excerpt = heldout_excerpt(held)
    with open(os.path.join(OUT, "heldout.txt"), "w", encoding="ascii") as fh:
        fh.write(excerpt)
    model = AutoModelForCausalLM.from_config(arch.config(), dtype=torch.float32)
    t0 = time.time()
    fit(model, data, arch.steps)
    model = model.eval().to(torch.bfloat16)
    model.save_pretrained(arch.base)
    tok.save_pretrained(arch.base)
    eval_ids = torch.tensor(tok.encode(excerpt, add_special_tokens=False))
    seconds = round(time.time() - t0)
    info = {"train_tokens": len(data), "steps": arch.steps, "batch": BATCH, "seq": SEQ, "train_seconds": seconds,
            "heldout_ppl_bf16": perplexity(model, eval_ids), "uniform_ppl": 259}
    if arch.moe:  # on the excerpt, and on the first 256 windows of the held-out files
        info["expert_shares_excerpt"] = expert_shares(model, eval_ids)
        info["expert_shares_heldout_files"] = expert_shares(model, encode(tok, held)[: 256 * SEQ])
    with open(os.path.join(OUT, f"training{arch.suffix}.json"), "w") as fh:
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


def llmcompressor(modifier: str, scheme: str):
    """``oneshot`` with the preset ``scheme`` on every Linear but ``arch.ignore`` (QuantizationModifier for
    "rtn", GPTQModifier for "gptq")."""
    def run(arch: Arch, out: str, calib: list[torch.Tensor]) -> None:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

        cls = {"gptq": GPTQModifier, "rtn": QuantizationModifier}[modifier]
        ds = Dataset.from_dict({"input_ids": [c.tolist() for c in calib],
                                "attention_mask": [[1] * len(c) for c in calib]})
        model = load_base(arch.base)
        oneshot(model=model, dataset=ds, recipe=cls(targets="Linear", scheme=scheme, ignore=list(arch.ignore)),
                max_seq_length=CALIB_LEN, num_calibration_samples=len(calib), shuffle_calibration_samples=False)
        model.save_pretrained(out, save_compressed=True)
    return run


def modelopt(cfg_name: str):
    def run(arch: Arch, out: str, calib: list[torch.Tensor]) -> None:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint

        def forward_loop(m):
            with torch.no_grad():
                for c in calib:
                    m(c[None])

        cfg = copy.deepcopy(getattr(mtq, cfg_name))
        if arch.moe:
            cfg["quant_cfg"].append({"quantizer_name": "*mlp.gate.*", "enable": False})  # the routers
        model = mtq.quantize(load_base(arch.base), cfg, forward_loop)
        export_hf_checkpoint(model, export_dir=out)
    return run


def quark(scheme: str):
    def run(arch: Arch, out: str, calib: list[torch.Tensor]) -> None:
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

        exclude = ["lm_head", "*mlp.gate"] if arch.moe else ["lm_head"]
        quantizer = ModelQuantizer(LLMTemplate.get(arch.quark_template).get_config(scheme=scheme,
                                                                                    exclude_layers=exclude))
        model = load_base(arch.base)
        if arch.moe:  # Quark quantizes nn.Linear modules only: split the fused experts into per-expert Linears
            from llmcompressor.modeling.moe.linearize import linearize_moe

            model = linearize_moe(model)
        model = quantizer.freeze(quantizer.quantize_model(model, [c[None] for c in calib]))
        export_safetensors(model, out)
    return run


PRODUCERS = {
    "llmcompressor-fp8-dynamic": llmcompressor("rtn", "FP8_DYNAMIC"),
    "llmcompressor-w4a16-gptq": llmcompressor("gptq", "W4A16"),
    "llmcompressor-nvfp4": llmcompressor("rtn", "NVFP4"),
    "modelopt-fp8": modelopt("FP8_DEFAULT_CFG"),
    "modelopt-nvfp4": modelopt("NVFP4_DEFAULT_CFG"),
    "modelopt-w4a16-nvfp4": modelopt("W4A16_NVFP4_CFG"),
    "quark-w-mxfp4": quark("mxfp4_weight_only"),
    "quark-w8a8-int8": quark("int8"),
}
LLAMA_OUTPUTS = tuple(p for p in PRODUCERS if p != "quark-w8a8-int8")
ARCHS = {
    "llama": Arch(llama_config, LLAMA_STEPS, "", ("lm_head",), "llama", LLAMA_OUTPUTS),
    "qwen3moe": Arch(qwen3moe_config, MOE_STEPS, "-moe", ("lm_head", "re:.*mlp.gate$"), "qwen3_moe",
                     tuple(PRODUCERS), moe=True),
}


def produce(arch: Arch, names: list[str]) -> None:
    tok = tokenizer()
    calib = calibration(tok)
    for name in names:
        out = os.path.join(OUT, name + arch.suffix)
        shutil.rmtree(out, ignore_errors=True)
        PRODUCERS[name](arch, out, calib)
        tok.save_pretrained(out)
        print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Regenerate tests/data/trained/ (see the module docstring).")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="the model to train and quantize")
    ap.add_argument("--skip-train", action="store_true", help="keep the trained bf16 base and quantize it again")
    ap.add_argument("only", nargs="*", help="producers' outputs to write (default: all of the model's)")
    args = ap.parse_args()
    unknown = sorted(set(args.only) - set(PRODUCERS))
    if unknown:
        ap.error(f"unknown output(s) {unknown}; choose from {sorted(PRODUCERS)}")
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    if not args.skip_train:
        train(ARCHS[args.arch])
    produce(ARCHS[args.arch], args.only or list(ARCHS[args.arch].outputs))
