"""MoE router benchmark: softmax, top-k and renormalization as transformers' Qwen3-MoE / Mixtral routers write
them, compiled by plain ``torch.compile`` (ATen's top-k) and by qcompile (the top-k pass, fused by inductor); with
``--linear``, the router's linear layer instead (cuBLAS against qcompile's small-linear pass).

    python benchmarks/bench_router.py [--experts 8:2 32:4 128:8 256:8] [--tokens 1 16 256 4096] [--json out.json]
    python benchmarks/bench_router.py --linear 128x2048 256x7168:fp32 [--tokens 1 4 16] [--json out.json]

µs per call, median of CUDA-graph replays of 20 back-to-back calls on bf16 router logits [T, E] (softmax in fp32,
bf16 weights out; the router's linear itself is not timed: it is the same cuBLAS call either way). qcompile's
side also has what its backend adds on sm_90+: PDL for inductor's kernels. Each cell also checks that both
compiled routers return the same weights (to a bf16 ulp) and indices that hold the same probabilities.

``--linear NxK[:fp32]`` times ``F.linear(x, W)`` with x [T, K] and W [N, K] (bf16, or fp32) compiled by plain
``torch.compile`` (inductor calls cuBLAS) and by qcompile, whose small-linear pass writes it as an inductor
reduction where T x W's bytes is within its limit (``qcompile/passes/small_linear.py``; the ``qcompile runs``
column says which ran); the outputs agree within a rounding of x's dtype.

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
    p.add_argument("--linear", nargs="+", default=None, metavar="NxK[:fp32]",
                   help="time the router's linear layer of these weight shapes instead (bf16 unless :fp32)")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="small shapes on the CPU, wall clock: a smoke test")
    args = p.parse_args(argv)
    if args.dry_run:
        device, label = "cpu", "CPU dry run (wall clock; not a measurement)"
    elif torch.cuda.is_available():
        device, label = "cuda", device_label("cuda")
    else:
        sys.exit("bench_router.py times CUDA graphs: run it on a GPU (or --dry-run on the CPU)")
    rows = linear_rows(args, device, label) if args.linear else router_rows(args, device, label)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": label, "rows": rows}, indent=1))
    return 0


def timed(fn, device: str) -> float:
    return graph_time_us(fn, calls=20, replays=50) if device == "cuda" else wall_us(fn)


def linear_rows(args, device: str, label: str) -> list[dict]:
    """``--linear``: the router's F.linear, plain torch.compile against qcompile, per weight shape and T."""
    import torch.nn.functional as F

    rows = []
    print(f"{label}\n\n| N x K, dtype | T | T x weight MiB | torch.compile (cuBLAS), µs | qcompile, µs | speed-up | "
          "qcompile runs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.linear:
        dims, _, kind = shape.partition(":")
        n, k = (int(v) for v in dims.split("x"))
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        for t in args.tokens:
            x = torch.randn(t, k, device=device, dtype=dtype)
            times, outs, graphs = {}, {}, []
            be = qcompile.backend(inner="inductor", on_graph=lambda before, after: graphs.append(after))
            for name, backend in (("torch", "inductor"), ("qcompile", be)):
                torch._dynamo.reset()
                fn = torch.compile(lambda x: F.linear(x, w), backend=backend, fullgraph=True, dynamic=False)
                with torch.no_grad():
                    outs[name] = fn(x)
                    times[name] = timed(lambda: fn(x), device)
            tol = dict(rtol=2 ** -7, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outs["qcompile"], outs["torch"], **tol)
            ran = "reduction" if "linear_by_reduction" in graphs[0] else "F.linear"
            row = {"n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "tokens": t,
                   "torch_us": round(times["torch"], 2), "qcompile_us": round(times["qcompile"], 2),
                   "qcompile_runs": ran}
            rows.append(row)
            mib = t * w.numel() * w.element_size() / 2 ** 20
            print(f"| {n} x {k}, {row['dtype']} | {t} | {mib:.1f} | {row['torch_us']} | {row['qcompile_us']} | "
                  f"{times['torch'] / times['qcompile']:.2f}x | {ran} |", flush=True)
    return rows


def router_rows(args, device: str, label: str) -> list[dict]:
    """The routers' softmax / top-k / renormalization, plain torch.compile against qcompile."""
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
                times[name] = timed(lambda: fn(logits), device)
            (wa, ia), (wb, ib) = outs["torch"], outs["qcompile"]
            torch.testing.assert_close(wb, wa, rtol=8e-3, atol=0)  # the softmax kernels may round 1 ulp apart
            probs = logits.softmax(-1, dtype=torch.float)
            torch.testing.assert_close(probs.gather(-1, ib), probs.gather(-1, ia), rtol=2e-7, atol=0)
            row = {"experts": e, "k": k, "tokens": t, "torch_us": round(times["torch"], 2),
                   "qcompile_us": round(times["qcompile"], 2)}
            rows.append(row)
            print(f"| {e}, {k} | {t} | {row['torch_us']} | {row['qcompile_us']} | "
                  f"{times['torch'] / times['qcompile']:.2f}x |", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
