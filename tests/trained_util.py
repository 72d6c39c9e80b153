"""What the tests of the trained models (tests/data/trained, written by tests/data/make_trained.py) share:
the held-out text as token windows, the bf16 model's logits, perplexity, running one quantized copy
eager, compiled and as its dequantized reference, and the bounds (:class:`Case`) those logits are held to."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from qcompile.linear import dequantize_model

TRAINED = Path(__file__).resolve().parent / "data" / "trained"
SEQ = 128  # the training window


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    logits = logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return math.exp(loss.item())


@functools.cache
def heldout_ids() -> torch.Tensor:
    """The held-out excerpt as [rows, SEQ] token ids, through the checkpoints' own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TRAINED / "base-bf16"))
    ids = tok.encode((TRAINED / "heldout.txt").read_text(encoding="ascii"), add_special_tokens=False)
    return torch.tensor(ids[: len(ids) // SEQ * SEQ]).view(-1, SEQ)


@functools.cache
def bf16_model(base: str):
    """The bf16 model ``TRAINED / base``, loaded by transformers."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(TRAINED / base), dtype=torch.bfloat16)


def bf16_heldout_logits(base: str) -> torch.Tensor:
    """The held-out logits of the bf16 model ``TRAINED / base``."""
    with torch.no_grad():
        return bf16_model(base)(heldout_ids()).logits


def eager_compiled_reference(model, backend, fullgraph: bool = False) -> dict[str, torch.Tensor]:
    """Held-out logits of a loaded copy: ``eager``, ``compiled`` (``torch.compile`` with ``backend``, a
    fresh qcompile backend whose explain rows the caller checks) and ``reference`` (the copy with
    its weights dequantized, activations unquantized)."""
    ids = heldout_ids()
    torch._dynamo.reset()
    with torch.no_grad():
        out = {"eager": model(ids).logits,
               "compiled": torch.compile(model, backend=backend, fullgraph=fullgraph)(ids).logits}
        out["reference"] = dequantize_model(copy.deepcopy(model))(ids).logits
    return out


@dataclass(frozen=True)
class Case:
    """One quantized copy of a trained model, and the bounds its held-out logits are held to."""
    scheme: str  # the scheme key of every quantized layer
    activations: bool  # the format quantizes activations too (eager then differs from the reference)
    ppl: float  # bound on |perplexity / bf16 perplexity - 1|, eager and compiled
    vs_bf16: float  # bound on the eager logits' relative error against the bf16 model's
    vs_reference: float  # bound on the eager logits' relative error against the dequantized reference
    # activation-quantizing formats: compiled runs the same reference math as eager (0 measured), except
    # where the Fuse pass runs q/k/v (or gate/up) as one matmul whose shards' per-tensor scales differ:
    # the shards are requantized to the largest
    compiled_vs_eager: float = 1e-3
    weights: float | None = None  # MoE: bound on each expert's dequantized weights vs the bf16 model's
    online: str | None = None  # quantized from the bf16 model at load with this online scheme


def check_perplexity(case: Case, out: dict[str, torch.Tensor], bf16: torch.Tensor) -> None:
    ids = heldout_ids()
    want = perplexity(bf16, ids)
    for mode in ("eager", "compiled"):
        got = perplexity(out[mode], ids)
        assert abs(got / want - 1) < case.ppl, (mode, got, want)


def check_reference(case: Case, out: dict[str, torch.Tensor]) -> None:
    assert rel_err(out["eager"], out["reference"]) < case.vs_reference
    if case.activations:  # the reference leaves activations unquantized: compiled must match eager
        assert rel_err(out["compiled"], out["eager"]) < case.compiled_vs_eager
    else:
        assert rel_err(out["compiled"], out["reference"]) < case.vs_reference
