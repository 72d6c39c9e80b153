"""Time a checkpoint's quantized linear layers under qcompile against the same weights in bf16 under
plain torch.compile, over a few token counts, and save the plot.

    python examples/benchmark_plot.py [CHECKPOINT] [--out linear_latency.png] [--m 1 16 128]

With no CHECKPOINT it writes the built-in tiny Llama (random weights, ModelOpt FP8) to a temporary
directory. On a CPU the quantized ops are emulated: the plot then shows how the example works, not
how fast qcompile is on a GPU. Needs matplotlib: pip install "qcompile[plot]".
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time

import torch

import qcompile
from qcompile import synth
from qcompile.bench import device_label, graph_time_us
from qcompile.linear import dequantize_model


def median_us(fn, x, reps: int) -> float:
    """Median µs per call. On a GPU, calls replayed from a CUDA graph (20 per graph), so that the
    kernels are timed, not Python's launch overhead; on a CPU, wall-clock calls."""
    with torch.no_grad():
        for _ in range(3):  # compile and warm up
            fn(x)
        if x.is_cuda:
            return graph_time_us(lambda: fn(x), calls=20, replays=reps)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def layer_shapes(model, limit: int) -> dict:
    """{(out_features, in_features): the first quantized layer of that shape}, at most ``limit``."""
    shapes = {}
    for name in model.qcompile_plan:
        layer = model.get_submodule(name)
        shapes.setdefault((layer.out_features, layer.in_features), layer)
    return dict(list(shapes.items())[:limit])


def main(path: str, out: str, ms: list[int], reps: int, max_shapes: int) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit('benchmark_plot.py needs matplotlib: pip install "qcompile[plot]" (or: pip install matplotlib)')
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = qcompile.load(path, device=device)
    shapes = layer_shapes(model, max_shapes)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.5), squeeze=False)
    for ax, ((n, k), layer) in zip(axes[0], shapes.items()):
        bf16 = dequantize_model(torch.nn.Sequential(copy.deepcopy(layer)))  # the same weights in bf16
        variants = {"qcompile": torch.compile(layer, backend="qcompile"), "bf16 torch.compile": torch.compile(bf16)}
        for label, fn in variants.items():
            us = [median_us(fn, torch.randn(m, k, device=device, dtype=torch.bfloat16), reps) for m in ms]
            print(f"[{n}, {k}] {label:>18}: " + ", ".join(f"M={m} {t:.1f} us" for m, t in zip(ms, us)))
            ax.plot(ms, us, marker="o", label=label)
        ax.set(title=f"{layer.scheme_key.split(';')[0]}\nN={n} K={k}", xlabel="tokens (M)", ylabel="µs per call",
               xscale="log", yscale="log")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=8)
    fig.suptitle(f"linear layer latency, median of {reps}: {device_label(device)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="a quantized checkpoint directory (default: the tiny model)")
    parser.add_argument("--out", default="linear_latency.png", help="the PNG to write (default: %(default)s)")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 128, 1024] if cuda else [1, 16, 64],
                        help="token counts (rows of x) to time")
    parser.add_argument("--reps", type=int, default=50 if cuda else 10, help="timed calls per point (median)")
    parser.add_argument("--max-shapes", type=int, default=3, help="distinct layer shapes to time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        main(args.checkpoint or synth.write_checkpoint(tmp, "modelopt-fp8"), args.out, args.m, args.reps,
             args.max_shapes)
