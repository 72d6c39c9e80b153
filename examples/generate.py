"""generate() with a qcompile-compiled model, and the one way it silently runs uncompiled.

    python examples/generate.py [CHECKPOINT] [--prompt TEXT]

With no CHECKPOINT it writes the built-in tiny Llama (random weights, ModelOpt FP8, a byte-level
tokenizer) to a temporary directory: its text means nothing, but the compiled path is the same.

The gotcha: ``compiled = torch.compile(model); compiled.generate(...)`` runs eager. The compiled
module forwards ``.generate`` to the original model, whose ``forward`` is not compiled. Compile
``model.forward`` instead, and give generate a static cache so that every decode step has one shape.
"""

import argparse
import tempfile

import torch
from transformers import AutoTokenizer, CompileConfig

import qcompile
from qcompile import synth


class CountingBackend:
    """The qcompile backend, counting the graphs torch.compile hands it."""

    def __init__(self):
        self.backend = qcompile.backend()
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def main(path: str, prompt: str, random_weights: bool) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(path)
    model = qcompile.load(path, device=device)
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)

    # Wrong: generate() belongs to the original module, so this runs the eager forward.
    counting = CountingBackend()
    torch.compile(model, backend=counting).generate(ids, **greedy)
    print(f"torch.compile(model).generate(): {counting.graphs} graphs compiled: it ran eager")

    # Right: compile the forward that generate() calls; a static cache keeps decode steps one shape.
    counting = CountingBackend()
    model.forward = torch.compile(model.forward, backend=counting)
    out = model.generate(ids, cache_implementation="static", **greedy)
    label = " (random weights: meaningless)" if random_weights else ""
    print(f"model.forward = torch.compile(...): {counting.graphs} graphs compiled (prefill and decode), "
          f"{len(counting.backend.rows)} layers lowered, e.g. {counting.backend.rows[0].kernel}")
    print(f"text{label}: {tok.decode(out[0, ids.shape[1]:])!r}")
    del model.forward  # back to the class's eager forward

    if device == "cuda":
        # transformers' own path: on CUDA, generate() compiles the forward itself when the cache is
        # static and the model's quantizer says it can be compiled (qcompile's does). mode="default":
        # qcompile's CUDA graphs are a backend option (cudagraphs=True), not torch.compile's mode.
        config = CompileConfig(backend="qcompile", mode="default")
        out = model.generate(ids, cache_implementation="static", compile_config=config, **greedy)
        print(f"generate(compile_config=...) on CUDA: {tok.decode(out[0, ids.shape[1]:])!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a quantized checkpoint directory with a tokenizer "
                                                      "(default: the tiny model)")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(args.checkpoint or synth.write_checkpoint(tmp, "modelopt-fp8"), args.prompt, args.checkpoint is None)
