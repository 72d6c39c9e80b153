"""Diagnostics for qcompile::wo_linear on an sm_90 GPU (docs/kernels-wo.md), one section per flag:

    python benchmarks/diag_wo.py --blocks          # M above 128 as row blocks vs dequant + F.linear vs bf16
    python benchmarks/diag_wo.py --op-vs-direct    # M = 16: the op against a direct wo_mma call, weight data
    python benchmarks/diag_wo.py --ws-sweep        # M = 64: warp-specialized launch variants, x_prep's cost
    python benchmarks/diag_wo.py --ab OLD.cu ...   # each OLD.cu's default launch (git show HEAD~:...) vs this one
    python benchmarks/diag_wo.py --stream          # M = 1, 4, 16: each launch vs the same launch streaming only
    python benchmarks/diag_wo.py --moe qwen3-30b-a3b mixtral --stream   # --stream / --ab on the MoE op, T tokens
                                                                        # (--stream: also its experts from L2)
    python benchmarks/diag_wo.py --moe qwen3-30b-a3b --ab QCOMPILE_MOE_FUSE=0   # an environment knob A/B

µs per call as in bench_wo_linear (CUDA-graph replays, rotating weight copies), every cell twice (rounds
interleaved) where the flag says so; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_wo_linear import FORMATS, copies_for, op_fn, timed, weight_bytes, weight_copies  # noqa: E402
from e2e_models import copy_bandwidth  # noqa: E402

from qcompile.kernels import cuda_driver, moe_wo, quant_math, wo_mma, wo_policy  # noqa: E402
from qcompile.scheme import parse_scheme_key  # noqa: E402


def tiled_copies(spec, n, k, g, normal=False):
    """Weight copies (>= 200 MB together) tiled as a GPU load tiles them, with the tiled spec. ``normal``:
    int4 codes drawn around the middle (a quantized normal weight) instead of uniform random bytes."""
    qs = weight_copies(spec, n, k, g)
    for q in qs:
        if normal:
            codes = (torch.randn(n, k, device="cuda", generator=g) * 2.5 + 8).round().clamp(0, 15).to(torch.int32)
            codes = codes.view(n, k // 8, 8) << (4 * torch.arange(8, device="cuda", dtype=torch.int32))
            q["weight"] = codes.sum(-1, dtype=torch.int32)
        q["weight"] = quant_math.tile_weight(q["weight"], spec)
    return qs, replace(spec, tiled=True)


def rel(a, b):
    a, b = a.float(), b.float()
    return round(((a - b).norm() / b.norm()).item(), 6)


def with_bf16(shape, ms, g, res):
    """(N, K, x per M) of ``shape`` ("NxK"), after timing bf16 F.linear at each M into ``res``."""
    n, k = map(int, shape.split("x"))
    xs = {m: torch.randn(m, k, device="cuda", generator=g).bfloat16() for m in ms}
    wb = [torch.randn(n, k, device="cuda", generator=g).bfloat16() for _ in range(copies_for(2 * n * k))]
    res[f"{shape} bf16"] = {m: timed([lambda w=w, x=xs[m]: F.linear(x, w) for w in wb], 20, 25, m) for m in ms}
    print(shape, "bf16", res[f"{shape} bf16"], flush=True)
    return n, k, xs


def blocks(args, g, res):
    wo_policy.BLOCKED_MAX_M = dict.fromkeys(wo_policy.BLOCKED_MAX_M, 1 << 20)  # every M as blocks, for the crossover
    for shape in args.shapes:
        n, k, xs = with_bf16(shape, args.m, g, res)
        for name in args.formats if shape == args.shapes[0] else args.formats[:2]:
            qs, sp = tiled_copies(FORMATS[name], n, k, g)
            x = xs[256] if 256 in xs else xs[args.m[0]]
            res[f"{shape} {name} blocks vs dequant"] = rel(op_fn(x, qs[0], sp, "mma")(),
                                                           op_fn(x, qs[0], sp, "dequant")())
            for be in ("mma", "dequant"):
                res[f"{shape} {name} {be}"] = {m: timed([op_fn(xs[m], q, sp, be) for q in qs], 20, 25, m)
                                               for m in args.m}
                print(shape, name, be, res[f"{shape} {name} {be}"], flush=True)
            print(shape, name, "blocks vs dequant", res[f"{shape} {name} blocks vs dequant"], flush=True)
            del qs


def op_vs_direct(args, g, res):
    n = k = 8192
    spec = FORMATS["int4 g128"]
    for normal in (False, True):
        qs, sp = tiled_copies(spec, n, k, g, normal)
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            direct = [lambda q=q: wo_mma.wo_mma(x, q["weight"], q["weight_scale"], None, None, None, sp) for q in qs]
            op = [op_fn(x, q, sp, "mma") for q in qs]
            assert torch.equal(direct[0](), op[0]())
            for r in range(2):
                for what, fns in (("op", op), ("direct", direct), ("direct 4 copies", direct[:4])):
                    key = f"M={m} {'normal' if normal else 'uniform'} codes, {what}"
                    res.setdefault(key, []).append(timed(fns, 20, 25, m))
            for key in [k_ for k_ in res if k_.startswith(f"M={m} {'normal' if normal else 'uniform'}")]:
                print(key, res[key], flush=True)
        del qs


WS_VARIANTS = [dict(), dict(ws=True)] + [dict(ws=True, **v) for v in (
    dict(nstg=4), dict(nstg=12), dict(nstg=16), dict(xstages=2), dict(xstages=3), dict(xstages=6),
    dict(split=1), dict(split=3), dict(split=4),
    dict(warps=4, warps_per_sm=12, minb=3), dict(warps=8, warps_per_sm=8), dict(warps=8, warps_per_sm=16, minb=2),
    dict(warps=16, warps_per_sm=16), dict(trig=False))]


class source_of:
    """Compile and launch wo_mma from ``path`` inside the block (its own kernel and plan caches), e.g. a
    another version's wo_mma.cu for an A/B in one process; the launch code is this checkout's."""

    def __init__(self, path):
        self.path, self.caches = path, ({}, {}, {})

    def __enter__(self):
        self.saved = wo_mma.SOURCE, wo_mma._KERNELS, wo_policy._PLANS, wo_policy._DEFAULTS
        wo_mma.SOURCE = Path(self.path)
        wo_mma._KERNELS, wo_policy._PLANS, wo_policy._DEFAULTS = self.caches

    def __exit__(self, *exc):
        wo_mma.SOURCE, wo_mma._KERNELS, wo_policy._PLANS, wo_policy._DEFAULTS = self.saved


class env_of:
    """Environment variables ``NAME=VALUE[,NAME=VALUE...]`` set inside the block (a knob the op reads per call,
    e.g. ``QCOMPILE_MOE_FUSE=0``), restored after it."""

    def __init__(self, spec: str):
        self.pairs = dict(kv.split("=", 1) for kv in spec.split(","))

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.pairs}
        os.environ.update(self.pairs)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interleaved(fns: dict, rounds: int, time) -> dict:
    """{name: µs of ``fns[name]`` in each of ``rounds`` rounds}, every function once per round (``time(fn)``)."""
    out = {o: [] for o in fns}
    for _ in range(rounds):
        for o, f in fns.items():
            out[o].append(time(f))
    return out


def under(ctx, fn):
    """``fn`` run inside ``ctx`` (a :class:`source_of` or :class:`env_of`) at each call."""
    def call():
        with ctx:
            return fn()
    return call


# --moe: the weight-only MoE op (bench_moe's layers, routings and call) in place of wo_linear


def moe_calls(shapes, formats, tokens, bw: float):
    """Per MoE shape (bench_moe.SHAPES), format and T: (key, the op's call cycling 10 routings (each call reads other
    experts), the call of the first routing, T, the floor in µs: the experts the routings touch at ``bw`` bytes/s)."""
    import bench_moe as bm

    for shape in shapes:
        e, h, i, k = bm.SHAPES[shape]
        for name in formats:
            spec, w13, w2 = bm.wo_layer(parse_scheme_key(bm.OURS_WO[bm.wo_row(name)]), e, h, i, "cuda", 0)
            for t in tokens:
                routes, used = bm.routings(t, e, h, k, "cuda", 10)
                make = bm._wo_call(spec, w13, w2)
                floor = round(used * moe_wo.expert_bytes(w13, w2) / bw * 1e6, 2)
                yield f"{shape} {name} T={t}", bm.cycled(make, routes), make(*routes[0]), t, floor
            del w13, w2
            torch.cuda.empty_cache()


def moe_timed(fn, t: int) -> float:
    import bench_moe as bm

    return bm._time(fn, t, 25, "cuda")


def ab(args, g, res):
    """The default launch (through the op's mma backend) with this checkout's wo_mma.cu and with each of
    ``args.ab`` (another wo_mma.cu, or ``NAME=VALUE`` environment settings: :class:`env_of`), rounds interleaved;
    bf16 F.linear beside them (dense shapes); the outputs compared bit for bit."""
    others = {a if "=" in a else Path(a).stem: env_of(a) if "=" in a else source_of(a) for a in args.ab}
    if args.moe:
        for key, fn, first, t, floor in moe_calls(args.moe, args.ab_formats, args.ab_m, copy_bandwidth("cuda")):
            fns = {"new": fn, **{o: under(ctx, fn) for o, ctx in others.items()}}
            want = first()
            same = all(torch.equal(want, under(ctx, first)()) for ctx in others.values())
            rounds = interleaved(fns, args.rounds, lambda f: moe_timed(f, t))
            res[key] = dict(rounds, same_bits=same, floor_us=floor)
            print(key, res[key], flush=True)
        return
    for shape in args.shapes:
        n, k, xs = with_bf16(shape, args.ab_m, g, res)
        for name in args.ab_formats:
            qs, sp = tiled_copies(FORMATS[name], n, k, g)
            for m in args.ab_m:
                fns = {"new": [op_fn(xs[m], q, sp, "mma") for q in qs]}
                fns.update({o: [under(ctx, f) for f in fns["new"]] for o, ctx in others.items()})
                key = f"{shape} {name} M={m}"
                want = fns["new"][0]()
                same = all(torch.equal(want, f[0]()) for f in fns.values())
                err = rel(want, op_fn(xs[m], qs[0], sp, "dequant")())
                rounds = interleaved(fns, args.rounds, lambda f: timed(f, 20, 25, m))
                res[key] = dict(rounds, same_bits=same, rel=err)
                print(key, res[key], flush=True)
            del qs


# --stream: the mma.sync build's decode and MMAs of one chunk (wo_mma.cu's main loop), and what a copy of the source
# runs before them instead: the chunk's loaded words XOR-folded into one accumulator, the rest skipped. Everything
# else (grid, prologue, loads, split-K reduction, epilogue) is the kernel's own.
STREAM_ANCHOR = """#pragma unroll
          for (int j = 0; j < RT; j++)
            decode_chunk(ra[j][st], rb[j][st], kc[j], [&](int k16, u32 a0, u32 a1, u32 a2, u32 a3) {"""
STREAM_ONLY = """#pragma unroll
          for (int j = 0; j < RT; j++) {
            const u32 f = ra[j][st].v[0] ^ ra[j][st].v[1] ^ ra[j][st].v[2] ^ ra[j][st].v[3] ^ rb[j][st].v[0] ^
                          rb[j][st].v[1] ^ rb[j][st].v[2] ^ rb[j][st].v[3];
            acc[j * MT][0] += __uint_as_float(f & 0x3FFFFFFFu);
          }
          if (false)
"""
# launches --stream times by default: the op's (its tuning table's, else the policy's) and wo_mma's mma.sync
# refinements; the lock-step and warp-specialized wgmma builds have no stream-only copy (their times are the kernel's)
STREAM_VARIANTS = [dict(), dict(xs=True), dict(kw=2), dict(stages=4), dict(stages=8)]


def stream_source(text: str) -> str:
    """``text`` (wo_mma.cu) with the mma.sync build's decode and MMAs replaced by :data:`STREAM_ONLY`: the kernel
    with its weight stream alone. Exits naming the anchor where the source no longer has it once."""
    if text.count(STREAM_ANCHOR) != 1:
        raise SystemExit("diag_wo --stream: wo_mma.cu's mma.sync main loop no longer holds STREAM_ANCHOR once; "
                         "update STREAM_ANCHOR / STREAM_ONLY in benchmarks/diag_wo.py to the new loop")
    return text.replace(STREAM_ANCHOR, STREAM_ONLY + STREAM_ANCHOR)


def stream(args, g, res):
    """Per shape, format and M of ``args.stream_m``: the op's mma launch (first column, ``{}``) and wo_mma with each
    of ``args.stream_variants``, with this checkout's kernel and with its weight stream alone (:func:`stream_source`),
    rounds interleaved, next to the weight-read floor at the copy bandwidth measured here. The difference is the
    time the decode and MMAs add to the stream on that launch. With ``--moe``: the op's launches, and the op on one
    routing repeated ("l2": its experts read from L2, not memory), the share of the time the weight reads take."""
    path = Path(tempfile.mkdtemp()) / "wo_mma_stream.cu"
    path.write_text(stream_source(wo_mma.SOURCE.read_text()))
    only = source_of(path)
    bw = copy_bandwidth("cuda")
    res["copy_GBps"] = round(bw / 1e9)
    variants = json.loads(args.stream_variants) if args.stream_variants else STREAM_VARIANTS
    if args.moe:  # the op's launches only
        for key, fn, first, t, floor in moe_calls(args.moe, args.stream_formats, args.stream_m, bw):
            rounds = interleaved({"kernel": fn, "stream": under(only, fn), "l2": first}, args.rounds,
                                 lambda f: moe_timed(f, t))
            res[key] = dict(rounds, floor_us=floor)
            print(key, res[key], flush=True)
        return
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        for name in args.stream_formats:
            qs, sp = tiled_copies(FORMATS[name], n, k, g)
            floor = round(weight_bytes(qs[0]) / bw * 1e6, 2)
            for m in args.stream_m:
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                for v in variants:
                    key = f"{shape} {name} M={m} {json.dumps(v, sort_keys=True)}"
                    if v:
                        real = [lambda q=q, v=v: wo_mma.wo_mma(x, q["weight"], q["weight_scale"],
                                                               q["weight_global_scale"], None, None, sp, **v)
                                for q in qs]
                    else:
                        real = [op_fn(x, q, sp, "mma") for q in qs]
                    fns = {"kernel": real, "stream": [under(only, f) for f in real]}
                    rounds = interleaved(fns, args.rounds, lambda f: timed(f, 20, 25, m))
                    res[key] = dict(rounds, floor_us=floor)
                    print(key, res[key], flush=True)
            del qs


def ws_sweep(args, g, res):
    real_launch = cuda_driver.launch
    variants = json.loads(args.ws_variants) if args.ws_variants else WS_VARIANTS + [dict(ws=True, skip_x_prep=True)]
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        for name in args.ws_formats:
            qs, sp = tiled_copies(FORMATS[name], n, k, g)
            for m in args.ws_m:
                x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
                ref = op_fn(x, qs[0], sp, "dequant")()
                for v in variants:
                    v = dict(v)
                    skip = v.pop("skip_x_prep", False)
                    fns = [lambda q=q: wo_mma.wo_mma(x, q["weight"], q["weight_scale"], q["weight_global_scale"],
                                                     None, None, sp, **v) for q in qs]
                    key = f"{shape} {name} M={m} {v}{' x_prep skipped' if skip else ''}"
                    try:
                        err = rel(fns[0](), ref)
                        if skip:  # timing only: x_prep's output buffer is left as the first call wrote it
                            def launch(kern, grid, block, smem, *a):  # x_prep: 256 threads, no shared memory
                                if block != (256, 1, 1) or smem:
                                    real_launch(kern, grid, block, smem, *a)
                            cuda_driver.launch = launch
                        res[key] = {"us": [timed(fns, 20, 25, m) for _ in range(2)], "rel": err}
                    except Exception as e:  # noqa: BLE001
                        res[key] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                    finally:
                        cuda_driver.launch = real_launch
                    print(key, res[key], flush=True)
            del qs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", action="store_true")
    p.add_argument("--op-vs-direct", action="store_true")
    p.add_argument("--ws-sweep", action="store_true")
    p.add_argument("--ab", nargs="+", default=None, metavar="OLD.cu",
                   help="wo_mma.cu files, or NAME=VALUE[,NAME=VALUE] environment settings, to time against this "
                        "checkout's defaults")
    p.add_argument("--ab-m", type=int, nargs="+", default=[12, 16, 32, 64, 96, 128])
    p.add_argument("--ab-formats", nargs="+", default=["int4 g128", "nvfp4"])
    p.add_argument("--stream", action="store_true")
    p.add_argument("--stream-m", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--stream-formats", nargs="+", default=["int4 g128", "nvfp4"])
    p.add_argument("--stream-variants", default=None,
                   help="JSON list of wo_mma keyword dicts ({} the op's launch; default STREAM_VARIANTS)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", nargs="+", default=["8192x8192", "28672x8192"])
    p.add_argument("--m", type=int, nargs="+", default=[128, 136, 192, 256, 384, 512, 768, 1024])
    p.add_argument("--ws-m", type=int, nargs="+", default=[64])
    p.add_argument("--ws-formats", nargs="+", default=["int4 g128", "nvfp4"])
    p.add_argument("--ws-variants", default=None, help="JSON list of wo_mma keyword dicts (default WS_VARIANTS)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--moe", nargs="+", default=None, metavar="SHAPE",
                   help="--stream / --ab on the weight-only MoE op of these bench_moe shapes, T = --stream-m / --ab-m")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    res, t0 = {"device": torch.cuda.get_device_name()}, time.time()
    for flag, fn in ((args.blocks, blocks), (args.op_vs_direct, op_vs_direct), (args.ws_sweep, ws_sweep),
                     (args.ab, ab), (args.stream, stream)):
        if flag:
            fn(args, g, res)
            res["seconds"] = round(time.time() - t0, 1)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
