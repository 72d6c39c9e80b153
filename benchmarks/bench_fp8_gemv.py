"""``qcompile::fp8_gemv``'s launch candidates on the linear shapes of real models, against ``torch._scaled_mm``
(TensorWise, what ``fp8_inductor`` calls), bf16 ``F.linear`` and the weight-read floor (CUDA).

Per (N, K) of ``--shapes`` and M of ``--m``: µs per call of each launch (BLOCK_N x BLOCK_K x warps x stages whose
partial sums fit ``fp8_gemv.ACC_REGISTERS``) on
the same fp8 codes as x (quantized already: the in-graph path quantizes x in the kernel that produces it), each
call reading another copy of the weight (past L2), medians of CUDA-graph replays; the best launch, its % of the
floor, and its error against float64 math.

``--table FILE`` adds each (N, K, M)'s winner to a tuning table (``qcompile/kernels/tuned/<GPU>.json`` is the one
shipped; ``$XDG_CACHE_HOME/qcompile/tuned/<GPU>.json`` the user's cache): route ``gemv`` with the fastest launch
where it beat ``torch._scaled_mm`` by more than :data:`MARGIN`, else ``scaled_mm``. ``fp8_inductor`` calls the GEMV only on shapes with a
``gemv`` entry. ``--from-json`` writes the table from an earlier run's results instead of measuring.

    python benchmarks/bench_fp8_gemv.py --m 1 --json gemv.json --table qcompile/kernels/tuned/NVIDIA_H200.json
    python benchmarks/bench_fp8_gemv.py --shapes 1280x8192 5120x5120 --block-n 16 --block-k 512 --warps 4   # one launch
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wo_linear import copies_for, timed  # noqa: E402
from e2e_models import copy_bandwidth  # noqa: E402
from tune_wo import SHAPES  # noqa: E402

from qcompile.kernels import fp8_gemv, wo_tune  # noqa: E402


def exact(xq, w, xs, ws):
    return (xq.double() @ w.double().t()) * xs.double() * ws.double()


def bench_shape(n: int, k: int, ms, launches, bw: float, calls: int, replays: int, g: torch.Generator) -> list[dict]:
    fp8 = torch.float8_e4m3fn
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.05).to(fp8) for _ in range(copies_for(n * k))]
    wb = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(2 * n * k))]
    xs, w_scale = torch.tensor(0.02, device="cuda"), torch.tensor(0.01, device="cuda")
    rows = []
    for m in ms:
        xq = (torch.randn(m, k, device="cuda", generator=g) * 4).to(fp8)
        xb = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        want = exact(xq, ws[0], xs, w_scale)
        row = {"n": n, "k": k, "m": m, "floor_us": n * k / bw * 1e6,
               "scaled_mm_us": timed([lambda w=w: torch._scaled_mm(xq, w.t(), xs, w_scale, out_dtype=torch.bfloat16)
                                      for w in ws], calls, replays, m),
               "bf16_us": timed([lambda w=w: F.linear(xb, w) for w in wb], calls, replays, m), "launches": {}}
        for bn, bk, warps, stages in launches:
            if fp8_gemv.acc_registers(bn, bk, warps) > fp8_gemv.ACC_REGISTERS:
                continue  # its partial sums spill
            launch = dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            got = fp8_gemv._triton(xq, ws[0], xs, w_scale, None, torch.bfloat16, launch).double()
            err = ((got - want).norm() / want.norm()).item()
            us = timed([lambda w=w: fp8_gemv._triton(xq, w, xs, w_scale, None, torch.bfloat16, launch) for w in ws],
                       calls, replays, m)
            row["launches"][f"{bn}x{bk} w{warps} s{stages}"] = {"us": us, "err": err}
        ok = {name: r["us"] for name, r in row["launches"].items() if isinstance(r["us"], float)}
        best = min(ok, key=ok.get) if ok else None
        row["best"] = best
        sm = row["scaled_mm_us"]
        print(f"{n}x{k} M={m}: floor {row['floor_us']:.1f} µs; scaled_mm {sm} ; bf16 {row['bf16_us']}; "
              + (f"gemv best {ok[best]:.1f} ({100 * row['floor_us'] / ok[best]:.0f} % of floor) {best}, "
                 f"error {row['launches'][best]['err']:.1e}" if best else "no gemv launch ran"), flush=True)
        rows.append(row)
    return rows


MARGIN = 0.03  # the GEMV takes a shape only where it beat _scaled_mm by more than this (one run's noise)


def launch_of(name: str) -> dict:
    """``"8x512 w8 s3"`` -> the op's launch keywords."""
    bn, bk, warps, stages = map(int, re.fullmatch(r"(\d+)x(\d+) w(\d+) s(\d+)", name).groups())
    return dict(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def write_table(path: Path, gpu: str, rows: list[dict]) -> None:
    """Each row's winner into the table at ``path`` (other entries kept)."""
    entries = {}
    for r in rows:
        us = r["launches"][r["best"]]["us"] if r.get("best") else None
        won = us is not None and us < (1 - MARGIN) * r["scaled_mm_us"]
        entry = {"route": "gemv", "launch": launch_of(r["best"])} if won else {"route": "scaled_mm"}
        entries[fp8_gemv.table_key(r["n"], r["k"], r["m"])] = {**entry, "us": us if won else r["scaled_mm_us"],
                                                              "gemv_us": us, "scaled_mm_us": r["scaled_mm_us"]}
    wo_tune.merge_table(path, gpu, entries)
    print(f"wrote {len(rows)} entries to {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="N x K (default: %(default)s)")
    p.add_argument("--m", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--block-n", nargs="+", type=int, default=[8, 16, 32])
    p.add_argument("--block-k", nargs="+", type=int, default=[256, 512, 1024])
    p.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    p.add_argument("--stages", nargs="+", type=int, default=[3])
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=10, help="graph replays (median)")
    p.add_argument("--json", default=None)
    p.add_argument("--table", type=Path, default=None, help="add the winners to this tuning table")
    p.add_argument("--from-json", type=Path, default=None, help="an earlier run's --json: write --table from its rows "
                   "of --m, measuring nothing")
    args = p.parse_args(argv)
    if args.from_json:
        if not args.table:
            p.error("--from-json needs --table")
        old = json.loads(args.from_json.read_text())
        write_table(args.table, old["gpu"], [r for r in old["results"] if r["m"] in args.m])
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    bw = copy_bandwidth("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth": bw,
           "command": " ".join(sys.argv), "results": []}
    print(f"{out['gpu']}; copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    launches = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages))
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        n, k = map(int, shape.lower().split("x"))
        out["results"] += bench_shape(n, k, args.m, launches, bw, args.calls, args.replays, g)
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    if args.table:
        write_table(args.table, out["gpu"], out["results"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
