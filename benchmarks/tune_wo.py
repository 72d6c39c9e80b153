"""Measure the launch choices of qcompile::wo_linear's mma backend for a list of shapes and write the table
that ships with the package (qcompile/kernels/tuned/<GPU name>.json).

For each format x (N, K) x M: every candidate route of wo_tune.candidates on a tiled weight (the layout
the kernel gets after loading), timed per call in a CUDA graph of back-to-back calls on copies of the weight
(wo_tune.measure, as a decode step runs the op); the winner goes into the table. Printed per
row: the policy's and the chosen route's µs and each as % of the weight-read floor (weight bytes over the
copy bandwidth measured at the start of the run).

    python benchmarks/tune_wo.py --formats "int4 g128" nvfp4 --out qcompile/kernels/tuned/
    python benchmarks/tune_wo.py --shapes 4096x4096 --m 1 16 --out /tmp/t  # a quick look

``--moe SHAPE ...`` measures ``qcompile::wo_moe`` instead (the MoE expert shapes of benchmarks/bench_moe.py,
formats of its weight-only rows, ``--tokens`` T buckets): the rule, dequantize + ``_grouped_mm``, and the
grouped kernel's configurations by coordinate descent (``moe_wo.tune_call``); the floor is the stored bytes
of the experts the routing touches.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wo_linear import FORMATS, random_weights, weight_bytes  # noqa: E402
from e2e_models import copy_bandwidth  # noqa: E402

from qcompile.kernels import quant_math, wo_gemm, wo_tune  # noqa: E402

# (N, K) of the linear layers of Llama-3.1-8B, Llama-3.1-70B at TP = 8, Qwen2.5-7B and Mistral-Nemo-12B
SHAPES = ("6144x4096", "4096x4096", "28672x4096", "4096x14336", "1280x8192", "8192x1024", "7168x8192", "8192x3584",
          "4608x3584", "3584x3584", "37888x3584", "3584x18944", "5120x5120", "6144x5120")


def tune_shape(spec, n: int, k: int, ms, g: torch.Generator, bw: float, reps: int) -> dict[str, dict]:
    """Table entries of one format and shape, one per M."""
    tiled = replace(spec, tiled=True)
    q = random_weights(spec, n, k, g)
    w = quant_math.tile_weight(q["weight"], tiled)
    floor = weight_bytes(q) / bw * 1e6
    entries = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        times = wo_gemm.tune_call(x, w, q["weight_scale"], q["weight_global_scale"], None, None, None, tiled,
                                  reps=reps, keep=False)
        choice = wo_tune.best(times)
        policy = times[wo_tune.Choice("policy")]
        entries[wo_tune.key_of(tiled, x.dtype, n, k, m)] = {**choice.to_json(), "us": round(times[choice], 2),
                                                            "policy_us": round(policy, 2)}
        print(f"{n}x{k} M={m:<5} policy {policy:8.1f} µs ({100 * floor / policy:5.1f} % of floor)   "
              f"chosen {times[choice]:8.1f} µs ({100 * floor / times[choice]:5.1f} %)  {choice.to_json()}",
              flush=True)
    return entries


def tune_moe(name: str, fmt: str, tokens, bw: float, reps: int):
    """Table entries of one weight-only format on one MoE expert shape: one ``{key: entry}`` per T, yielded as each
    T is measured."""
    import bench_moe

    from qcompile.kernels import moe_wo

    e, h, i, k = bench_moe.SHAPES[name]
    spec, w13, w2 = bench_moe.wo_layer(moe_wo.parse_scheme_key(bench_moe.OURS_WO[fmt]), e, h, i, "cuda", 0)
    per_expert = moe_wo.expert_bytes(w13, w2)
    for t in tokens:
        x, ids, weights, used = bench_moe.routed_tokens(t, e, h, k, "cuda")
        times = moe_wo.tune_call(x, ids, weights, w13, w2, None, None, "silu", spec, False, i, reps, keep=False)
        choice = wo_tune.best(times)
        policy = times[wo_tune.Choice("policy")]
        floor = used * per_expert / bw * 1e6
        print(f"{name} {fmt} T={t:<5} rule {policy:8.1f} µs ({100 * floor / policy:5.1f} % of floor)   chosen "
              f"{times[choice]:8.1f} µs ({100 * floor / times[choice]:5.1f} %, {len(times)} timed)  "
              f"{json.dumps(choice.to_json())}", flush=True)
        yield {moe_wo._key(x, ids, w13, spec, i): {**choice.to_json(), "us": round(times[choice], 2),
                                                   "policy_us": round(policy, 2)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="N x K (default: %(default)s)")
    p.add_argument("--m", nargs="+", type=int, default=list(wo_tune.M_BUCKETS), help="M of each bucket")
    p.add_argument("--reps", type=int, default=20,
                   help="per candidate: graph replays = reps / 2 (at least 3), their median (wo_tune.measure)")
    p.add_argument("--out", type=Path, default=wo_tune.SHIPPED, help="folder of the tables (default: %(default)s)")
    p.add_argument("--moe", nargs="+", default=None, metavar="SHAPE",
                   help="tune qcompile::wo_moe on these expert shapes of bench_moe.py instead")
    p.add_argument("--moe-formats", nargs="+", default=["int4 g128", "NVFP4"],
                   help="with --moe: the weight-only rows of bench_moe.py, by their format word(s)")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64],
                   help="with --moe: T of each bucket (wo_tune.MOE_T_BUCKETS)")
    args = p.parse_args(argv)
    bad = [m for m in args.m if wo_tune.m_bucket(m) != m]
    if bad:
        p.error(f"--m {bad}: each M must be one of the buckets {wo_tune.M_BUCKETS}")
    bad = [t for t in args.tokens if wo_tune.m_bucket(t, wo_tune.MOE_T_BUCKETS) != t]
    if args.moe and bad:
        p.error(f"--tokens {bad}: each T must be one of the buckets {wo_tune.MOE_T_BUCKETS}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    path = args.out / wo_tune.file_name(name)
    wo_tune.read_table(path)  # a file that is not a table stops the run before it measures anything
    written = 0
    bw = copy_bandwidth("cuda")
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s (the floor: weight bytes at that rate)")
    if args.moe:
        import bench_moe

        rows = {f: bench_moe.wo_row(f) for f in args.moe_formats}
        for shape in args.moe:
            for row in rows.values():
                for entries in tune_moe(shape, row, args.tokens, bw, args.reps):
                    wo_tune.merge_table(path, name, entries)  # after each T: a cut run keeps what it measured
                    written += len(entries)
                torch.cuda.empty_cache()
        print(f"wrote {written} entries to {path}")
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for fmt in args.formats:
        print(f"-- {fmt}")
        for shape in args.shapes:
            n, k = map(int, shape.lower().split("x"))
            entries = tune_shape(FORMATS[fmt], n, k, args.m, g, bw, args.reps)
            torch.cuda.empty_cache()
            wo_tune.merge_table(path, name, entries)  # after each shape: a cut run keeps what it measured
            written += len(entries)
    print(f"wrote {written} entries to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
