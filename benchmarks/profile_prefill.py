"""Where a compiled prefill's time goes: a Qwen3-MoE-shaped model (random weights, ``LAYERS`` decoder layers,
default 4) prefilling 2048 tokens at batch 1 into a static cache, bf16 under plain ``torch.compile`` against ModelOpt
FP8 (written by ``qcompile.synth``, loaded by ``qcompile.load``) under qcompile, both without CUDA graphs, as
``e2e_decode.py`` times its prefill. Per model: the median wall time of 5 prefills (after 2, which compile), then
one prefill under ``torch.profiler``: the GPU's total kernel time, the kernels with the most time and the host
operations with the most self time. A wall time well above the GPU time means that the host's launches set the
pace, not the kernels. ``--dry-run``: the 256-wide test shapes, 32 tokens, on the CPU (a smoke test).

    python benchmarks/profile_prefill.py [LAYERS] [--dry-run]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import e2e_models as em
import qcompile
from qcompile import synth


def measure(name: str, model, compile_fn, layers: int, length: int, device: str) -> dict:
    """Print (and return) the model's wall and GPU milliseconds of one compiled prefill, with its profile."""
    run = em.compiled_prefill(model, compile_fn, device, length)
    with torch.no_grad():
        times = [run() for _ in range(7)]
        wall = 1e3 * statistics.median(times[2:])
        print(f"{name} {layers} layers prefill {length}: wall {wall:.2f} ms "
              f"({[round(1e3 * t, 2) for t in times]})", flush=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        prof = profile(activities=activities)
        run(prof)
    events = prof.key_averages()
    gpu = sorted((e for e in events if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in gpu if e.device_type.name == "CUDA")
    print(f"  GPU total {total / 1e3:.2f} ms", flush=True)
    for e in gpu[:14]:
        print(f"   {e.device_time_total / 1e3:8.3f} ms x{e.count:<4} {e.key[:90]}", flush=True)
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"   cpu self {e.self_cpu_time_total / 1e3:8.3f} ms x{e.count:<5} {e.key[:90]}", flush=True)
    return {"wall_ms": wall, "gpu_ms": total / 1e3}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("layers", type=int, nargs="?", default=4, help="decoder layers (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, 32 tokens, on the CPU")
    args = p.parse_args(argv)
    device, length = ("cpu", 32) if args.dry_run else ("cuda", 2048)
    cfg = em.model_config("qwen3_moe", args.dry_run, args.layers)
    bf16 = em.build_bf16(cfg, device)
    with tempfile.TemporaryDirectory() as path:
        synth.write_model(path, bf16, "modelopt-fp8")
        out = {"bf16": measure("bf16", bf16, lambda f: torch.compile(f, dynamic=False), args.layers, length,
                               device)}
        fp8 = qcompile.load(path, device=device).eval()
        out["fp8"] = measure("fp8", fp8, lambda f: torch.compile(f, backend=qcompile.backend(), dynamic=False),
                             args.layers, length, device)
    return out


if __name__ == "__main__":
    main()
