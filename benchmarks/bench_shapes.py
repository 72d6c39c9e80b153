"""The quantized linear ops on the linear shapes of real models, each format against its weight-read floor and
against bf16 ``F.linear`` (CUDA).

For every (N, K) of ``tune_wo.SHAPES`` (Llama-3.1-8B, Llama-3.1-70B at TP = 8, Qwen2.5-7B, Mistral-Nemo-12B)
and every M: µs per call of

* ``bf16``: ``F.linear`` (cuBLAS), the peer;
* ``fp8 tensor``, ``fp8 channel``, ``fp8 block``: ``qcompile::fp8_linear`` (static per-tensor x; dynamic
  per-token x; dynamic 1x128-group x on 128x128-block weights), activation quantization included;
* ``fp8 tensor gemv``, ``fp8 channel gemv``: the same op with backend ``gemv`` (``qcompile::fp8_gemv`` at M <= 4,
  as ``scaled_mm`` above);
* ``int4 g128``, ``nvfp4``, ``mxfp8``: ``qcompile::wo_linear`` on tiled weights (what a model loaded onto the GPU
  runs: the tuned table of this GPU, else the launch policy).

Median of CUDA-graph replays of ``--calls`` calls, each call reading another copy of the weights (> 200 MB of
copies, so no call finds its weight in L2). Floor = (weight + scale + x + out bytes) / the device-to-device copy
bandwidth measured at the start of the run. Printed: one markdown table per format, cells ``µs (% of floor)``, and
per format the lowest % of floor at M <= 16 over the shapes whose weight is >= 16 MB, and the cells slower than
bf16.

    python benchmarks/bench_shapes.py --json shapes.json
    python benchmarks/bench_shapes.py --shapes 4096x4096 --m 1 16 --formats bf16 "int4 g128"   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wo_linear import FORMATS as WO_FORMATS, copies_for, op_fn, timed, weight_bytes, weight_copies  # noqa: E402
from e2e_models import copy_bandwidth  # noqa: E402
from tune_wo import SHAPES  # noqa: E402

from qcompile.kernels import fp8, quant_math  # noqa: E402,F401 - fp8 registers qcompile::fp8_linear
from qcompile.scheme import Granularity, fp8_scheme  # noqa: E402

FP8 = {"fp8 tensor": ("tensor", "static_tensor"), "fp8 channel": ("channel", "dynamic_token"),
       "fp8 block": ("block", "dynamic_group")}
FP8_GEMV = {"fp8 tensor gemv": FP8["fp8 tensor"], "fp8 channel gemv": FP8["fp8 channel"]}  # backend "gemv"
WO = ("int4 g128", "nvfp4", "mxfp8")
FORMATS = ("bf16", *FP8, *FP8_GEMV, *WO)
MODELS = {"6144x4096": "Llama-3.1-8B", "1280x8192": "Llama-3.1-70B TP=8", "4608x3584": "Qwen2.5-7B",
          "5120x5120": "Mistral-Nemo-12B"}  # the first shape of each model's group in SHAPES
BIG = 16 << 20  # weights from this size on are held to the floor target at M <= 16
SUMMARY = ("bf16", "fp8 tensor", "int4 g128")  # the formats of the summary table (docs/benchmarks.md plots it)


def fp8_weights(gran: Granularity, n: int, k: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Quantized copies of random bf16-range weights (enough for ``copies_for``)."""
    out = []
    for _ in range(copies_for(n * k)):
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        out.append(quant_math.quantize_weight_fp8(w, gran))
        del w
    return out


def bench_format(fmt: str, n: int, k: int, xs: dict, g: torch.Generator, calls: int, replays: int):
    """{M: µs}, and the bytes one call reads besides x and out."""
    if fmt == "bf16":
        ws = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(2 * n * k))]
        return {m: timed([lambda w=w, x=x: F.linear(x, w) for w in ws], calls, replays, m)
                for m, x in xs.items()}, 2 * n * k
    if fmt in FP8 or fmt in FP8_GEMV:
        weight, act = FP8[fmt] if fmt in FP8 else FP8_GEMV[fmt]
        backend = "scaled_mm" if fmt in FP8 else "gemv"
        key = fp8_scheme(weight, act).key
        qs = fp8_weights(Granularity(weight), n, k, g)
        op = torch.ops.qcompile.fp8_linear
        times = {}
        for m, x in xs.items():
            s = (x.abs().amax() / 448.0).float() if act == "static_tensor" else None
            times[m] = timed([lambda q=q, x=x, s=s: op(x, q[0], q[1], s, None, key, backend) for q in qs],
                             calls, replays, m)
        return times, sum(t.numel() * t.element_size() for t in qs[0])
    spec = WO_FORMATS[fmt]
    tiled = replace(spec, tiled=True)
    qs = [dict(q, weight=quant_math.tile_weight(q["weight"], spec)) for q in weight_copies(spec, n, k, g)]
    return {m: timed([op_fn(x, q, tiled, "mma") for q in qs], calls, replays, m) for m, x in xs.items()}, \
        weight_bytes(qs[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="N x K (default: %(default)s)")
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=15, help="graph replays (median)")
    p.add_argument("--json", default=None, help="write the results here (after every shape)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if "bf16" not in args.formats:
        args.formats.insert(0, "bf16")
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth("cuda")
    out = {"gpu": name, "torch": torch.__version__, "copy_bandwidth": bw, "command": " ".join(sys.argv),
           "results": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        n, k = map(int, shape.lower().split("x"))
        xs = {m: torch.randn(m, k, device="cuda", generator=g).bfloat16() for m in args.m}
        row = out["results"][shape] = {}
        for fmt in args.formats:
            times, wbytes = bench_format(fmt, n, k, xs, g, args.calls, args.replays)
            floor = {m: (wbytes + 2 * m * (n + k)) / bw * 1e6 for m in args.m}
            row[fmt] = {"weight_bytes": wbytes, "us": times, "floor_us": floor}
            torch.cuda.empty_cache()
            print(shape, fmt, {m: t for m, t in times.items()}, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    print(report(out, args.m, args.formats))
    return 0


def report(out: dict, ms, formats) -> str:
    """Markdown: one table per format (cells µs and % of floor; bf16's own floor for bf16), then the checks."""
    lines = [f"{out['gpu']}, torch {out['torch']}; copy bandwidth {out['copy_bandwidth'] / 1e9:.0f} GB/s; "
             f"`{out['command']}`", ""]
    checks = []
    for fmt in formats:
        lines += [f"| {fmt}, µs (% of floor) | " + " | ".join(f"M = {m}" for m in ms) + " |",
                  "| --- |" + " --- |" * len(ms)]
        worst, slower = None, []
        for shape, row in out["results"].items():
            r, bf = row[fmt], row["bf16"]
            cells = []
            for m in ms:
                t, f, b = r["us"][m], r["floor_us"][m], bf["us"][m]
                if not isinstance(t, float):
                    cells.append(str(t).split(":")[0])
                    continue
                cells.append(f"{t:.1f} ({100 * f / t:.0f} %)")
                if m <= 16 and r["weight_bytes"] >= BIG and (worst is None or f / t < worst[0]):
                    worst = (f / t, shape, m)
                if fmt != "bf16" and isinstance(b, float) and t > b:
                    slower.append(f"{shape} M={m} {t:.1f} vs {b:.1f}")
            label = f"{shape} ({MODELS[shape]})" if shape in MODELS else shape
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        if worst:
            checks.append(f"- {fmt}: lowest % of floor at M <= 16 on weights >= 16 MB: {100 * worst[0]:.0f} % "
                          f"({worst[1]}, M = {worst[2]})")
        if fmt != "bf16":
            checks.append(f"- {fmt}: slower than bf16 in {len(slower)} cells" + (": " + "; ".join(slower)
                                                                                  if slower else ""))
    cols = [f for f in SUMMARY if f in formats]
    m = ms[0]
    lines += [f"| M = {m}, % of floor | " + " | ".join(f"{f} %" for f in cols) + " |", "| --- |" + " --- |" * len(cols)]
    for shape, row in out["results"].items():
        pct = [row[f]["floor_us"][m] / row[f]["us"][m] * 100 if isinstance(row[f]["us"][m], float) else None
               for f in cols]
        lines.append(f"| {shape} | " + " | ".join("–" if v is None else f"{v:.0f} %" for v in pct) + " |")
    return "\n".join(lines + [""] + checks)


if __name__ == "__main__":
    sys.exit(main())
