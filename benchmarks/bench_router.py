"""MoE router benchmark: softmax, top-k and renormalization as transformers' Qwen3-MoE / Mixtral routers write
them, compiled by plain ``torch.compile`` (ATen's top-k) and by qcompile (the top-k pass, fused by inductor).

    python benchmarks/bench_router.py [--experts 8:2 32:4 128:8 256:8] [--tokens 1 16 256 4096] [--json out.json]

µs per call, median of CUDA-graph replays of 20 back-to-back calls on bf16 router logits [T, E] (softmax in fp32,
bf16 weights out; the router's linear itself is not timed: it is the same cuBLAS call either way). qcompile's
side also has what its backend adds on sm_90+: PDL for inductor's kernels. Each cell also checks that both
compiled routers return the same weights (to a bf16 ulp) and indices that hold the same probabilities.

``--dry-run`` runs small shapes on the CPU with wall-clock timing (inductor's CPU code, where the top-k pass does
not apply): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qcompile  # noqa: E402
from qcompile.bench import device_label, graph_time_us, wall_us  # noqa: E402


def router(logits: torch.Tensor, k: int):
    probs = logits.softmax(-1, dtype=torch.float)
    top, ids = torch.topk(probs, k, dim=-1)
    return (top / top.sum(-1, keepdim=True)).to(logits.dtype), ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", nargs="+", default=["8:2", "32:4", "128:8", "256:8"], help="E:k pairs")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256, 4096])
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="small shapes on the CPU, wall clock: a smoke test")
    args = p.parse_args(argv)
    if args.dry_run:
        device, label = "cpu", "CPU dry run (wall clock; not a measurement)"
    elif torch.cuda.is_available():
        device, label = "cuda", device_label("cuda")
    else:
        sys.exit("bench_router.py times CUDA graphs: run it on a GPU (or --dry-run on the CPU)")
    rows = []
    print(f"{label}\n\n| E, k | T | torch.compile (ATen top-k), µs | qcompile, µs | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for ek in args.experts:
        e, k = (int(v) for v in ek.split(":"))
        for t in args.tokens:
            logits = torch.randn(t, e, device=device, dtype=torch.bfloat16)
            times, outs = {}, {}
            for name, backend in (("torch", "inductor"), ("qcompile", qcompile.backend(inner="inductor"))):
                torch._dynamo.reset()
                fn = torch.compile(lambda x: router(x, k), backend=backend, fullgraph=True, dynamic=False)
                outs[name] = fn(logits)
                times[name] = (graph_time_us(lambda: fn(logits), calls=20, replays=50) if device == "cuda"
                               else wall_us(lambda: fn(logits)))
            (wa, ia), (wb, ib) = outs["torch"], outs["qcompile"]
            torch.testing.assert_close(wb, wa, rtol=8e-3, atol=0)  # the softmax kernels may round 1 ulp apart
            probs = logits.softmax(-1, dtype=torch.float)
            torch.testing.assert_close(probs.gather(-1, ib), probs.gather(-1, ia), rtol=2e-7, atol=0)
            row = {"experts": e, "k": k, "tokens": t, "torch_us": round(times["torch"], 2),
                   "qcompile_us": round(times["qcompile"], 2)}
            rows.append(row)
            print(f"| {e}, {k} | {t} | {row['torch_us']} | {row['qcompile_us']} | "
                  f"{times['torch'] / times['qcompile']:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": label, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
