"""The one-launch FP8 gemv kernel (``qcompile/kernels/fp8_gemv_triton.py``) against today's small-M path of
``qcompile::fp8_linear`` on the linear shapes of real models (CUDA).

For every (N, K) of ``tune_wo.SHAPES``, M in 1, 2, 4, 8, 16 and the three recipes of ``bench_shapes.py``
(fp8 tensor: static per-tensor x; fp8 channel: dynamic per-token x; fp8 block: 128x128 blocks, dynamic 1x128
groups), µs per call of

* ``today``: the op (backend scaled_mm) with ``GEMV_MAX_M = 0``: the activation-quant kernel + cuBLAS(Lt);
* ``op``: the op as it is now (M <= GEMV_MAX_M: the kernel with its default launch);
* every launch configuration of the sweep (:func:`configs`: ~14 per M, broadcast and ``tl.dot`` inner
  products, split-K, warps, stages);
* ``bf16``: ``F.linear``; the floor: (weight + scales + x + out bytes) / the measured copy bandwidth.

Median of CUDA-graph replays; every call reads another weight copy (``copies_for``: no L2 reuse), as in
bench_shapes. Printed: per shape x M x recipe the best configuration, its µs and % of floor, today's µs; a
suggested ``GEMV_MAX_M`` per recipe (the largest M up to which the best configuration beats today's path on
every shape); per M the configuration with the smallest worst-case slowdown against each cell's best (a
default). A device command is limited in time: run the shapes in parts and merge the JSON files with
``--report``.

    python benchmarks/bench_fp8_gemv.py --quick                                  # smoke: 2 shapes, M 1 and 16
    python benchmarks/bench_fp8_gemv.py --shapes 6144x4096 4096x4096 --json a.json
    python benchmarks/bench_fp8_gemv.py --report a.json b.json                   # merged tables, no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shapes import FP8, fp8_weights  # noqa: E402
from bench_wo_linear import copies_for, timed  # noqa: E402
from tune_wo import SHAPES, copy_bandwidth  # noqa: E402

from qcompile.kernels import fp8  # noqa: E402
from qcompile.kernels import fp8_gemv_triton as fg  # noqa: E402
from qcompile.scheme import Granularity, fp8_scheme  # noqa: E402

MS = (1, 2, 4, 8, 16)
QUICK_SHAPES = ("4096x4096", "1280x8192")


def cfg_name(cfg: dict) -> str:
    """'dot n32 k256 w4 s3 x1': inner product, BLOCK_N, BLOCK_K, warps, stages, split."""
    return (f"{'dot' if cfg['use_dot'] else 'bcast'} n{cfg['block_n']} k{cfg['block_k']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']} x{cfg['split_k']}")


def _cfg(dot, bn, bk, warps=4, stages=3, split=1) -> dict:
    return dict(use_dot=dot, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, split_k=split)


def configs(m: int, quick: bool = False) -> list[dict]:
    """The sweep at M rows. The broadcast product keeps BLOCK_N x pow2(M) x BLOCK_K fp32 partial products
    in registers, so its BLOCK_K shrinks as M grows; BLOCK_K >= 128 (group / block scales need it)."""
    if quick:
        return [_cfg(False, 8, 512 if m <= 2 else 128), _cfg(True, 32, 256), _cfg(True, 16, 256, split=2)]
    bk = 512 if m <= 2 else 256 if m <= 4 else 128
    out = [_cfg(False, bn, k) for bn in (4, 8, 16) for k in sorted({bk, max(128, bk // 2)})]
    out += [_cfg(False, 8, bk, warps=8), _cfg(False, 8, bk, split=2), _cfg(False, 8, bk, stages=4)]
    out += [_cfg(True, bn, k) for bn, k in ((16, 256), (32, 256), (64, 128), (32, 512))]
    out += [_cfg(True, 64, 256, warps=8), _cfg(True, 32, 256, split=2), _cfg(True, 32, 256, stages=4)]
    return out


def bench_recipe(recipe: str, n: int, k: int, ms, g: torch.Generator, calls: int, replays: int,
                 quick: bool) -> dict:
    """{M: {"today": µs, "op": µs, "configs": {name: µs}, "check_rel": normwise best vs today}}."""
    weight, act = FP8[recipe]
    spec = fp8_scheme(weight, act)
    qs = fp8_weights(Granularity(weight), n, k, g)
    op = torch.ops.qcompile.fp8_linear
    res = {}
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        s = (x.abs().amax() / 448.0).float() if act == "static_tensor" else None
        cell = res[m] = {}
        keep = fp8.GEMV_MAX_M
        try:
            fp8.GEMV_MAX_M = 0
            cell["today"] = timed([lambda q=q: op(x, q[0], q[1], s, None, spec.key, "scaled_mm") for q in qs],
                                  calls, replays, m)
            today_out = op(x, qs[0][0], qs[0][1], s, None, spec.key, "scaled_mm").float()
        finally:
            fp8.GEMV_MAX_M = keep
        cell["op"] = timed([lambda q=q: op(x, q[0], q[1], s, None, spec.key, "scaled_mm") for q in qs],
                           calls, replays, m)
        cell["configs"] = {}
        for cfg in configs(m, quick):
            cell["configs"][cfg_name(cfg)] = timed(
                [lambda q=q, cfg=cfg: fg.fp8_gemv(x, q[0], q[1], s, None, spec, **cfg) for q in qs], calls, replays, m)
        best = best_config(cell)
        if best:
            cfg = next(c for c in configs(m, quick) if cfg_name(c) == best[0])
            out = fg.fp8_gemv(x, qs[0][0], qs[0][1], s, None, spec, **cfg).float()
            cell["check_rel"] = ((out - today_out).norm() / today_out.norm()).item()
        print(f"{n}x{k} {recipe} M={m}: today {cell['today']}, op {cell['op']}, best {best}", flush=True)
    cell_bytes = sum(t.numel() * t.element_size() for t in qs[0])
    del qs
    return {"weight_bytes": cell_bytes, "ms": res}


def best_config(cell: dict) -> tuple[str, float] | None:
    timed_ok = {name: us for name, us in cell["configs"].items() if isinstance(us, float)}
    return min(timed_ok.items(), key=lambda kv: kv[1]) if timed_ok else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=None, help="N x K (default: tune_wo.SHAPES)")
    p.add_argument("--m", nargs="+", type=int, default=None, help=f"rows (default: {MS})")
    p.add_argument("--recipes", nargs="+", default=list(FP8), choices=list(FP8))
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=15, help="graph replays (median)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_SHAPES}, M 1 and 16, 3 configurations")
    p.add_argument("--json", default=None, help="write the results here (after every shape)")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON", help="print the merged report of these files")
    args = p.parse_args(argv)
    if args.report:
        print(report(merge([json.loads(Path(f).read_text()) for f in args.report])))
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    shapes = args.shapes or list(QUICK_SHAPES if args.quick else SHAPES)
    ms = args.m or ([1, 16] if args.quick else list(MS))
    bw = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bw,
           "gemv_max_m": fp8.GEMV_MAX_M, "command": " ".join(sys.argv), "results": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes:
        n, k = map(int, shape.lower().split("x"))
        ws = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(2 * n * k))]
        row = out["results"][shape] = {}
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            row.setdefault("bf16", {})[m] = timed([lambda w=w, x=x: F.linear(x, w) for w in ws], args.calls,
                                                  args.replays, m)
        del ws
        for recipe in args.recipes:
            r = row[recipe] = bench_recipe(recipe, n, k, ms, g, args.calls, args.replays, args.quick)
            for m in ms:
                r["ms"][m]["floor"] = (r["weight_bytes"] + 2 * m * (n + k)) / bw * 1e6
            torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    print(report(out))
    return 0


def merge(parts: list[dict]) -> dict:
    """One result of several runs' JSON (the shapes of later files replace earlier ones)."""
    out = dict(parts[0], results={})
    for part in parts:
        out["results"].update(part["results"])
    return out


def _cells(out: dict):
    """(shape, recipe, M, cell) of every measured cell (M as an int: JSON keys are strings)."""
    for shape, row in out["results"].items():
        for recipe, r in row.items():
            if recipe == "bf16":
                continue
            for m, cell in r["ms"].items():
                yield shape, recipe, int(m), cell


def _us(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v).split(":")[0]


def report(out: dict) -> str:
    lines = [f"{out['gpu']}, torch {out['torch']}; copy bandwidth {out['copy_bandwidth'] / 1e9:.0f} GB/s; "
             f"`{out['command']}`", "",
             "| shape | M | recipe | best configuration | µs | % of floor | today µs | % of floor | op now µs "
             "| bf16 µs |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    wins: dict[str, dict[int, bool]] = {}
    for shape, recipe, m, cell in _cells(out):
        best = best_config(cell)
        bf16 = out["results"][shape]["bf16"]
        bf = bf16.get(m, bf16.get(str(m)))
        today, floor = cell["today"], cell["floor"]
        pct = lambda t: f"{100 * floor / t:.0f} %" if isinstance(t, float) else "–"  # noqa: E731
        name, us = best if best else ("fails", None)
        lines.append(f"| {shape} | {m} | {recipe} | {name} | {_us(us)} | {pct(us)} | {_us(today)} | {pct(today)} "
                     f"| {_us(cell['op'])} | {_us(bf)} |")
        won = us is not None and (not isinstance(today, float) or us < today)
        w = wins.setdefault(recipe, {})
        w[m] = w.get(m, True) and won
    lines += ["", "Suggested GEMV_MAX_M (the largest M up to which the kernel's best configuration beats today's "
              "path on every shape):"]
    for recipe, w in wins.items():
        limit = 0
        for m in sorted(w):
            if not w[m]:
                break
            limit = m
        lines.append(f"- {recipe}: {limit}")
    lines += ["", "Per M, the configuration with the smallest worst-case slowdown against each cell's best "
              "(a default rule):"]
    for m, (name, worst) in robust_configs(out).items():
        lines.append(f"- M = {m}: {name} (worst {worst:.2f}x the best)")
    return "\n".join(lines)


def robust_configs(out: dict) -> dict[int, tuple[str, float]]:
    """{M: (configuration, its largest us / best-us ratio over the shapes and recipes)} among the
    configurations that ran in every cell of that M."""
    ratios: dict[int, dict[str, float]] = {}
    for _, _, m, cell in _cells(out):
        best = best_config(cell)
        r = ratios.setdefault(m, {})
        for name, us in cell["configs"].items():
            ok = best is not None and isinstance(us, float)
            r[name] = max(r.get(name, 0.0), us / best[1] if ok else float("inf"))
    picks = {}
    for m in sorted(ratios):
        name, worst = min(ratios[m].items(), key=lambda kv: kv[1])
        if worst != float("inf"):
            picks[m] = (name, worst)
    return picks


if __name__ == "__main__":
    sys.exit(main())
