"""The explain report: which kernel runs each quantized layer, and why no faster one; a kernel override.

    python examples/explain.py [CHECKPOINT]

With no CHECKPOINT it writes the built-in tiny Llama (random weights, ModelOpt FP8) to a temporary
directory. `qcompile explain CHECKPOINT` prints the same table from the command line, and
TORCH_LOGS=qcompile logs each decision while compiling.
"""

import argparse
import tempfile

import torch

import qcompile
from qcompile import synth


def main(path: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = qcompile.load(path, device=device)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)

    # The default: each layer gets the fastest kernel that runs its scheme on this machine.
    with torch.no_grad():
        torch.compile(model, backend="qcompile")(ids)
    print("qcompile.explain(), the most recent compilation in this process:")
    print(qcompile.explain())

    # An override: a kernel per module glob (or one name for every layer), on a backend instance
    # whose .explain() covers what it compiled. "reference" is the faithful op every scheme has.
    backend = qcompile.backend(kernels={"*.down_proj": "reference"})
    with torch.no_grad():
        torch.compile(model, backend=backend)(ids)
    print('\nqcompile.backend(kernels={"*.down_proj": "reference"}).explain():')
    print(backend.explain())
    forced = [row.module for row in backend.rows if row.kernel == "reference"]
    print(f"\n{len(forced)} layers on the reference kernel: {', '.join(forced)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a quantized checkpoint directory (default: the tiny model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(args.checkpoint or synth.write_checkpoint(tmp, "modelopt-fp8"))
