"""Load a quantized checkpoint, compile it with the qcompile backend and run it.

    python examples/load_and_compile.py [CHECKPOINT]

With no CHECKPOINT it writes the built-in tiny Llama (random weights, ModelOpt FP8) to a temporary
directory. Any ModelOpt, compressed-tensors or Quark checkpoint directory works the same way.
"""

import argparse
import json
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM

import qcompile  # registers the "qcompile" backend and ModelOpt's quant_method with transformers
from qcompile import synth


def quant_method(path: str) -> str:
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    return qc["quant_method"] if qc else "modelopt (hf_quant_config.json)"


def main(path: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    method = quant_method(path)
    # 1. transformers' own from_pretrained. ModelOpt checkpoints load plainly once qcompile is imported;
    #    for compressed-tensors and Quark, quantization_config=QCompileConfig() makes qcompile (not
    #    transformers' own quantizer) keep the quantized weights.
    if method.startswith("modelopt"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device,
                                                     quantization_config=qcompile.QCompileConfig())
    name, layer = next(iter(model.qcompile_plan.items()))
    print(f"{method}: {len(model.qcompile_plan)} quantized layers, e.g. {name}: {layer.scheme.key}")

    # 2. the one-liner: qcompile.load does the same for every producer (device= places the weights).
    same = qcompile.load(path, device=device)

    # 3. compile: each quantized layer is lowered to the fastest kernel this machine has.
    compiled = torch.compile(model, backend="qcompile")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = compiled(ids).logits.float()
        eager = same(ids).logits.float()
    rel = ((logits - eager).norm() / eager.norm()).item()
    print(f"compiled logits {tuple(logits.shape)}; relative difference to the eager qcompile.load model {rel:.3f}")
    print(qcompile.explain().splitlines()[2])  # the first layer's row: module | scheme | op | kernel | why


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a quantized checkpoint directory (default: the tiny model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(args.checkpoint or synth.write_checkpoint(tmp, "modelopt-fp8"))
