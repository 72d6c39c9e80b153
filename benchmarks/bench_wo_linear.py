"""Weight-only linear benchmark (CUDA): qcompile::wo_linear per format next to bf16 F.linear, PyTorch's
tinygemm (torch._weight_int4pack_mm) and the memory floor.

µs per call: median of CUDA-graph replays (``--calls`` calls per graph, ``--replays`` replays). Every
call reads another copy of the weights (enough copies for > 200 MB, four times the H100's L2), as a
model's next layer would: the int4 8192x8192 weight (33.5 MB) would otherwise sit in L2.
Floor = (weight + scale + x + out bytes) / ``--tbps``.

    python benchmarks/bench_wo_linear.py --out wo.json                  # the table
    python benchmarks/bench_wo_linear.py --tune --out wo.json           # time launch candidates first
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from dataclasses import replace

import torch

from qcompile.bench import graph_time_us
import torch.nn.functional as F

from qcompile.kernels import wo_gemm as wg
from qcompile.kernels import wo_tune
from qcompile.kernels import quant_math, wo_mma
from qcompile.scheme import (MXFP4_WEIGHT, MXFP8_WEIGHT, NVFP4_WEIGHT, Granularity, Packing, QDtype, QuantScheme,
                             ScaleSpec, WeightSpec, canonical_shape)

FORMATS = {
    "int4 g128": WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=128), Packing.INT32),
    "nvfp4": NVFP4_WEIGHT,
    "mxfp4": MXFP4_WEIGHT,
    "int8 channel": WeightSpec(QDtype.INT8, ScaleSpec(Granularity.CHANNEL), Packing.INT32),
    "mxfp8": MXFP8_WEIGHT,
}




def timed(fns, calls, replays, m):
    """Median µs of the callables in ``fns`` called round-robin (one per weight copy)."""
    it = itertools.cycle(fns)
    if m >= 1024:
        calls, replays = max(2, calls // 5), max(5, replays // 3)
    try:
        return round(graph_time_us(lambda: next(it)(), calls, replays), 1)
    except Exception as e:  # noqa: BLE001 - a peer that does not run is a result
        torch.cuda.synchronize()
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:100]}"


def random_weights(spec: WeightSpec, n: int, k: int, g: torch.Generator) -> dict:
    """Random codes (all values) and sane random scales in the canonical layout (timing needs no
    accuracy; the tests check that). fp8 NaN bytes are avoided."""
    scheme = QuantScheme(spec)
    wshape = canonical_shape("weight", scheme, n, k)
    nbytes = wshape[1] * (4 if spec.packing is Packing.INT32 else 1)
    raw = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, device="cuda", generator=g)
    if spec.dtype is QDtype.FP8_E4M3:
        raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)
    weight = raw.view({Packing.INT32: torch.int32, Packing.UINT8: torch.uint8}.get(
        spec.packing, torch.float8_e4m3fn if spec.dtype is QDtype.FP8_E4M3 else torch.int8))
    sshape = canonical_shape("weight_scale", scheme, n, k)
    u = torch.rand(sshape, device="cuda", generator=g)
    if spec.scale.dtype.value == "fp8_e4m3":
        scale = (u * 64 + 1).to(torch.float8_e4m3fn)
    elif spec.scale.dtype.value == "e8m0":
        scale = (120 + u * 4).to(torch.uint8)
    else:
        scale = (u + 0.5) * 0.01
    gs = torch.tensor(1e-3, device="cuda") if spec.global_scale else None
    return dict(weight=weight, weight_scale=scale, weight_global_scale=gs, weight_zero_point=None,
                weight_g_idx=None)


def weight_bytes(q: dict) -> int:
    return sum(t.numel() * t.element_size() for t in q.values() if t is not None)


def copies_for(nbytes: int) -> int:
    """Weight copies a benchmark cycles through: the tuner's rule (over 256 MB together) with no cap, so that no
    call finds its weights in L2."""
    return wo_tune.copies_for(nbytes, most=None)


def weight_copies(spec: WeightSpec, n: int, k: int, g: torch.Generator) -> list[dict]:
    """Random weight copies of ``spec`` (:func:`random_weights`), enough for :func:`copies_for`."""
    one = random_weights(spec, n, k, g)
    return [one] + [random_weights(spec, n, k, g) for _ in range(copies_for(weight_bytes(one)) - 1)]


def op_fn(x, q, spec, backend):
    key = QuantScheme(spec).key
    op = torch.ops.qcompile.wo_linear
    return lambda: op(x, q["weight"], q["weight_scale"], q["weight_global_scale"], None, None, None, key, backend)


def kernel_fn(x, q, spec, config=None):
    return lambda: wg.wo_gemm(x, q["weight"], q["weight_scale"], q["weight_global_scale"], None, None, None, spec,
                              config)


def bench_shape(args, n, k, g):
    res = {}
    xs = {m: torch.randn(m, k, device="cuda", generator=g).bfloat16() for m in args.m}
    c, r = args.calls, args.replays
    wb = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(2 * n * k))]
    res["bf16 F.linear"] = {m: timed([lambda w=w, x=xs[m]: F.linear(x, w) for w in wb], c, r, m) for m in args.m}
    del wb
    tg = []
    for _ in range(copies_for(n * k // 2)):
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        sz = torch.rand(k // 128, n, 2, device="cuda", generator=g).bfloat16()
        tg.append((torch._convert_weight_to_int4pack(packed, 8), sz))
    res["tinygemm int4 g128 (_weight_int4pack_mm)"] = {
        m: timed([lambda t=t, x=xs[m]: torch._weight_int4pack_mm(x, t[0], 128, t[1]) for t in tg], c, r, m)
        for m in args.m}
    del tg
    floors = {}
    for name, spec in FORMATS.items():
        if name not in args.formats:
            continue
        qs = weight_copies(spec, n, k, g)
        ok = check(xs[16 if 16 in xs else args.m[0]], qs[0], spec)
        res[f"{name} [wo_linear mma]"] = {m: timed([op_fn(xs[m], q, spec, "mma") for q in qs], c, r, m)
                                          for m in args.m}
        tiled = replace(spec, tiled=True)  # what a model loaded onto the GPU runs (weights tiled at load)
        qts = [dict(q, weight=quant_math.tile_weight(q["weight"], spec)) for q in qs]
        res[f"{name} [wo_linear mma, tiled]"] = {m: timed([op_fn(xs[m], q, tiled, "mma") for q in qts], c, r, m)
                                                 for m in args.m}
        res[f"{name} mma tiled check vs dequant (normwise rel)"] = check(xs[16 if 16 in xs else args.m[0]], qts[0],
                                                                          tiled, "mma")
        del qts
        res[f"{name} [wo_linear triton]"] = {m: timed([op_fn(xs[m], q, spec, "triton") for q in qs], c, r, m)
                                             for m in args.m}
        res[f"{name} [kernel, any M]"] = {m: timed([kernel_fn(xs[m], q, spec) for q in qs], c, r, m)
                                          for m in args.m if m >= 64}
        res[f"{name} [dequant + F.linear]"] = {m: timed([op_fn(xs[m], q, spec, "dequant") for q in qs], c, r, m)
                                               for m in args.m}
        res[f"{name} check vs dequant (normwise rel)"] = ok
        res[f"{name} mma check vs dequant (normwise rel)"] = check(xs[16 if 16 in xs else args.m[0]], qs[0], spec,
                                                                    "mma")
        floors[f"floor {name} (µs)"] = {m: round((weight_bytes(qs[0]) + 4 * m * (k + n)) / args.tbps / 1e6, 1)
                                        for m in args.m}
        del qs
    floors["floor bf16 (µs)"] = {m: round((2 * n * k + 4 * m * (k + n)) / args.tbps / 1e6, 1) for m in args.m}
    res.update(floors)
    return res


def check(x, q, spec, backend="triton") -> float:
    """The kernel against the dequant backend on the benchmark's own data (normwise relative)."""
    a = op_fn(x, q, spec, backend)().float()
    b = op_fn(x, q, spec, "dequant")().float()
    return round(((a - b).norm() / b.norm()).item(), 6)


# (family, bucket) -> [(BLOCK_M, BLOCK_N, words per step, warps, stages, waves, scale prefetch, x permuted)]
def _variants(base, flags=((True, False), (False, False), (True, True), (False, True))):
    return [(*base, p, x) for p, x in flags]


CANDIDATES = {
    ("int4", 16): _variants((16, 64, 16, 4, 4, 4)) + _variants((16, 128, 16, 8, 4, 4), ((True, True),))
    + _variants((16, 64, 16, 4, 3, 8), ((True, True),)),
    ("int4", 32): _variants((32, 64, 16, 4, 4, 4), ((True, False), (True, True))),
    ("int4", 64): _variants((64, 128, 16, 8, 3, 1), ((True, False), (True, True))),
    ("int4", 128): _variants((128, 128, 16, 8, 3, 1), ((True, False), (True, True))),
    ("fp4", 16): _variants((16, 64, 16, 4, 4, 4)),
    ("fp4", 64): _variants((64, 128, 16, 8, 3, 2), ((True, False), (False, True))),
    ("8bit", 16): _variants((16, 64, 32, 4, 4, 4)),
    ("8bit", 64): _variants((64, 64, 32, 4, 3, 2), ((True, False), (True, True))),
    ("fp8", 16): _variants((16, 64, 32, 4, 4, 4)),
    ("fp8", 64): _variants((64, 64, 32, 4, 3, 2), ((True, False), (False, True))),
}
FAMILY_FORMAT = {"int4": "int4 g128", "fp4": "nvfp4", "8bit": "int8 channel", "fp8": "mxfp8"}
DEQUANT_CANDIDATES = [dict(BLOCK_N=32, BLOCK_WORDS=16, num_warps=4), dict(BLOCK_N=64, BLOCK_WORDS=16, num_warps=4),
                      dict(BLOCK_N=32, BLOCK_WORDS=32, num_warps=4), dict(BLOCK_N=64, BLOCK_WORDS=32, num_warps=8)]


def tune(args, g):
    """Time every candidate at N=K=8192 (bucket 16 scored at M=1 + M=16), keep the fastest in wg.TUNED."""
    n = k = 8192
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out, weights, xs = {}, {}, {}
    for (fam, bucket), cands in CANDIDATES.items():
        spec = FORMATS[FAMILY_FORMAT[fam]]
        if fam not in weights:
            weights[fam] = weight_copies(spec, n, k, g)
        qs, best = weights[fam], None
        for cand in cands:
            score, cells = 0.0, {}
            for m in ((1, 16) if bucket == 16 else (bucket,)):
                x = xs.setdefault(m, torch.randn(m, k, device="cuda", generator=g).bfloat16())
                bm, bn, words, warps, stages, waves, prefetch, xperm = cand
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=words * wg.layout_of(spec).epw,
                           num_warps=warps, num_stages=stages, SCALE_PREFETCH=prefetch, X_PERMUTED=xperm)
                cfg["SPLIT_K"] = wg.auto_split(m, n, k, cfg, sms, waves)
                try:
                    ref = op_fn(x, qs[0], spec, "dequant")().float()
                    err = ((kernel_fn(x, qs[0], spec, cfg)().float() - ref).norm() / ref.norm()).item()
                    t = timed([kernel_fn(x, q, spec, cfg) for q in qs], args.calls, args.replays, m)
                except Exception as e:  # noqa: BLE001
                    err, t = None, f"fails: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                cells[m] = {"us": t, "split": cfg["SPLIT_K"], "rel_err": err}
                score = score + t if isinstance(t, float) and err is not None and err < 1e-2 else float("inf")
            out[f"{fam} bucket {bucket} {cand}"] = cells
            print(f"{fam} bucket {bucket} (BM, BN, words, warps, stages, waves, prefetch, xperm)={cand}: {cells}",
                  flush=True)
            if best is None or score < best[0]:
                best = (score, cand)
        wg.TUNED[(fam, bucket)] = best[1]
    spec = FORMATS["int4 g128"]
    q = weights["int4"][0]
    best = None
    for cand in DEQUANT_CANDIDATES:
        wg.DEQUANT_CONFIG = cand
        fn = lambda: wg.dequantize_triton(q["weight"], q["weight_scale"], spec, k=k)  # noqa: E731
        t = timed([fn], args.calls, args.replays, 1)
        out[f"dequant {cand}"] = t
        print(f"dequant int4 8192x8192 {cand}: {t} µs", flush=True)
        if isinstance(t, float) and (best is None or t < best[0]):
            best = (t, cand)
    wg.DEQUANT_CONFIG = best[1]
    out["chosen"] = {f"{f} {b}": c for (f, b), c in wg.TUNED.items()} | {"dequant": wg.DEQUANT_CONFIG}
    print("chosen:", out["chosen"], flush=True)
    return out


# Launch variants of wo_mma (tiled weights, as a loaded model runs them); keyword arguments of
# wo_mma.wo_mma. The first reduces split-K through global memory, the others as launch_plan decides
# (a cluster where its rule and the GPU allow one).
MMA_VARIANTS = [dict(packed=True, stages=s, warps=w, warps_per_sm=p, **kw) for s, w, p, kw in [
    (2, 8, 32, dict(max_cluster=1)), (2, 8, 32, {}), (2, 16, 32, {}), (2, 8, 24, {}), (4, 8, 16, {})]]


def mma_sweep(args, g):
    """Launch variants of the CUDA kernel at N=K=8192 (and N=28672) for int4 g128 and NVFP4."""
    out = {}
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        for name in args.sweep_formats:
            spec = FORMATS[name]
            qs = weight_copies(spec, n, k, g)
            for m in args.sweep_m:
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                ref = op_fn(x, qs[0], spec, "dequant")().float()
                for v in json.loads(args.mma_variants) if args.mma_variants else MMA_VARIANTS:
                    def fn(q, v=v, x=x):
                        v = dict(v)
                        w, sp = q["weight"], spec
                        if v.pop("packed"):
                            if "tiled" not in q:  # once per weight copy, not per variant
                                q["tiled"] = quant_math.tile_weight(w, spec)
                            w, sp = q["tiled"], replace(spec, tiled=True)
                        return lambda: wo_mma.wo_mma(x, w, q["weight_scale"], q["weight_global_scale"],
                                                     None, None, sp, **v)
                    try:
                        err = round(((fn(qs[0])().float() - ref).norm() / ref.norm()).item(), 6)
                        t = timed([fn(q) for q in qs], args.calls, args.replays, m)
                    except Exception as e:  # noqa: BLE001
                        err, t = None, f"fails: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                    key = f"{shape} {name} M={m} {v}"
                    key += f" #{sum(o.startswith(key) for o in out) + 1}" if key in out else ""  # repeated rounds
                    out[key] = {"us": t, "rel_err": err}
                    print(key, out[key], flush=True)
            del qs
    return out


def markdown(table: dict, ms) -> str:
    lines = ["| variant | " + " | ".join(f"M={m}" for m in ms) + " |", "| --- |" + " --- |" * len(ms)]
    for name, row in table.items():
        if not isinstance(row, dict):
            lines.append(f"| {name} | {row} |")
            continue
        cells = [row.get(m, "") for m in ms]
        lines.append(f"| {name} | " + " | ".join(str(v).split(":")[0] if isinstance(v, str) else str(v)
                                                for v in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8192x8192", "28672x8192"], help="NxK")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 4096])
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=25)
    p.add_argument("--tbps", type=float, default=3.0)
    p.add_argument("--tune", action="store_true", help="time the launch candidates first and use the fastest")
    p.add_argument("--mma-sweep", action="store_true", help="time launch variants of the CUDA kernel first")
    p.add_argument("--sweep-m", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--mma-variants", default=None,
                   help="JSON list of wo_mma keyword dicts replacing MMA_VARIANTS, e.g. ablations: "
                        "'[{\"packed\": true, \"max_cluster\": 1}]'")
    p.add_argument("--sweep-formats", nargs="+", default=["int4 g128", "nvfp4"])
    p.add_argument("--no-table", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_wo_linear needs a CUDA GPU")
    t0 = time.time()
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "unit": "µs per call (median)",
              "wo_max_m": wg.WO_MAX_M}
    if args.mma_sweep:
        result["mma_sweep"] = mma_sweep(args, g)
        save(result, args.out, t0)
    if args.tune:
        result["tune"] = tune(args, g)
        save(result, args.out, t0)
    for shape in [] if args.no_table else args.shapes:
        n, k = map(int, shape.split("x"))
        table = bench_shape(args, n, k, g)
        result[shape] = {name: {str(m): v for m, v in row.items()} if isinstance(row, dict) else row
                         for name, row in table.items()}
        print(f"\n## N={n}, K={k} ({result['device']}, torch {torch.__version__})\n", flush=True)
        print(markdown(table, args.m), flush=True)
        save(result, args.out, t0)
    return 0


def save(result, path, t0):
    result["seconds"] = round(time.time() - t0, 1)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
