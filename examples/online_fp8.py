"""Online FP8: run a bf16 checkpoint with FP8 weights, quantized at load or at compile time.

    python examples/online_fp8.py [BF16_CHECKPOINT]

With no checkpoint it writes the built-in tiny Llama (random weights, bf16) to a temporary directory.
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM

import qcompile
from qcompile import synth


def main(path: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # 1. At load: each linear's bf16 weight is quantized to FP8 (one scale per tensor) as it is read,
    #    so the bf16 model is never held in full. lm_head and MoE routers stay bf16 (as in vLLM).
    model = qcompile.load(path, device=device, online="fp8_per_tensor")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    compiled = torch.compile(model, backend="qcompile")
    with torch.no_grad():
        print("at load:", tuple(compiled(ids).logits.shape), "logits;", len(model.qcompile_plan), "FP8 layers")
    print(qcompile.explain().splitlines()[2])

    # 2. At compile time: load the bf16 model as usual; the backend quantizes each linear's weight
    #    (here 128x128 blocks, activations per 1x128 group) when it compiles the graph.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
    backend = qcompile.backend(online="fp8_per_block")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        print("at compile time:", tuple(compiled(ids).logits.shape), "logits")
    print(backend.explain().splitlines()[2])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a bf16/fp16 checkpoint directory (default: the tiny model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(args.checkpoint or synth.write_checkpoint(tmp, "bf16"))
