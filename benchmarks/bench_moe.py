"""Fused MoE benchmark: qcompile::fused_moe (Triton) against torch grouped-GEMM peers, on one GPU.

For each expert shape and token count T (random routing, seeded, uniform over the experts), times in µs
(median of CUDA-graph replays, each graph holding several back-to-back calls) of one MoE layer
(gate_up GEMM + silu-gated activation + down GEMM + router weighting + top-k sum):

* bf16 ``torch._grouped_mm`` peer: pairs sorted by expert (argsort), x rows gathered, two grouped
  GEMMs, activation, router weight, rows put back in pair order and summed over the top-k.
* fp8 ``torch._scaled_grouped_mm`` peer: the same with per-row (token) fp8 activations and per-channel
  fp8 weights (rowwise scales), x quantized once before the gather.
* ours: FP8 channel x token, FP8 128-block x 1x128 group, FP8 tensor (static), INT8 W8A8 channel x token.
* ours weight-only (``--weight-only``, qcompile::wo_moe): int4 group 128, NVFP4, MXFP4, MXFP8; for int4 also
  each of the op's two paths forced (the grouped kernel; dequantize + ``torch._grouped_mm``). Their floor
  counts the stored bytes (codes and scales) of the experts touched.

Weight floor: the bytes of the distinct experts this routing touches (w13 + w2, in the row's element
size) over the device read bandwidth measured in the same run (:func:`bandwidth_gbps`); "% floor" is
floor / time. Each graph replays its calls back to back on one routing, so experts that fit in L2 are read
from there after the first call; ``--rotate N`` cycles N seeded routings through the calls instead (the floor
then counts the mean number of experts touched).

    python benchmarks/bench_moe.py [--shapes mixtral qwen3-30b-a3b] [--tokens 1 4 16 64 256 4096]
                                   [--tune] [--weight-only] [--rotate N] [--json out.json] [--markdown]

``--pdl-ab`` times instead three rows (FP8 tensor static, FP8 channel x token, int4 g128 weight-only) with
qcompile's Triton kernels (the token sort, the MoE GEMMs, activation and top-k sum) launched without and with
programmatic dependent launch, alternately in one process; ``--fuse-ab`` the weight-only rows with the gated
activation in its own launch and fused into ``wo_mma``'s grouped GEMM 1, alternately. ``--tune`` runs
:func:`qcompile.kernels.moe_config.tune` for every (shape, T, scheme) first (cached on
disk) and prints the tuned entries in the form of the shipped ``TUNED`` table. ``--dry-run`` runs tiny
shapes on the CPU (the reference path, or the Triton interpreter under TRITON_INTERPRET=1) with
wall-clock timing: a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qcompile.kernels import moe_config as mc
from qcompile.kernels import moe_triton as mt
from qcompile.kernels import moe_wo as mw
from qcompile.kernels import quant_math
from qcompile.scheme import (MXFP4_WEIGHT, MXFP8_WEIGHT, NVFP4_WEIGHT, ActSpec, Granularity, Packing, QDtype,
                             QuantScheme, ScaleDtype, ScaleSpec, WeightSpec, fp8_scheme, parse_scheme_key)

SHAPES = {"mixtral": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8),  # E, H, I, top-k
          "gpt-oss-20b": (32, 2880, 2880, 4)}
TINY = {"tiny": (8, 256, 192, 2)}
TOKENS = (1, 4, 16, 64, 256, 4096)
OURS = {
    "ours FP8 channel x token": fp8_scheme("channel", "dynamic_token").key,
    "ours FP8 128-block": fp8_scheme("block", "dynamic_group").key,
    "ours FP8 tensor static": fp8_scheme("tensor", "static_tensor").key,
    "ours INT8 W8A8 channel x token": QuantScheme(
        WeightSpec(QDtype.INT8, ScaleSpec(Granularity.CHANNEL)),
        ActSpec(QDtype.INT8, True, ScaleSpec(Granularity.TOKEN))).key,
}
PEERS = ("bf16 torch._grouped_mm", "fp8 torch._scaled_grouped_mm rowwise")
# --weight-only: qcompile::wo_moe (Triton grouped weight-only GEMMs). The two "int4 g128" variants force its
# paths: the grouped kernel at every T, or every expert dequantized + torch._grouped_mm (the op switches
# above wo_moe.DEQUANT_ROWS rows per active expert); they measure where that switch belongs.
OURS_WO = {
    "ours int4 g128 weight-only": QuantScheme(WeightSpec(QDtype.INT4, ScaleSpec(Granularity.GROUP, group_size=128),
                                                         Packing.INT32)).key,
    "ours NVFP4 weight-only": QuantScheme(NVFP4_WEIGHT).key,
    "ours MXFP4 weight-only": QuantScheme(MXFP4_WEIGHT).key,
    "ours MXFP8 weight-only": QuantScheme(MXFP8_WEIGHT).key,
}
# each path of wo_moe_triton forced (int4 g128 and NVFP4): label suffix -> its keywords (mma "rule": the rule's
# launches of wo_mma's grouped build, in blocks of 16 pair slots where the rule would not take it)
WO_PATHS = {"Triton grouped kernel": dict(dequant_rows=1 << 30, mma=None),
            "wo_mma grouped build": dict(dequant_rows=1 << 30, mma="rule"),
            "dequant + grouped_mm": dict(dequant_rows=0, mma=None)}
WO_PATH_FORMATS = 2  # the first formats of OURS_WO


def wo_row(fmt: str) -> str:
    """The OURS_WO row of a format word (``int4 g128``, ``nvfp4``, ...; any case)."""
    rows = [r for r in OURS_WO if fmt.lower() in r.lower()]
    if len(rows) != 1:
        raise SystemExit(f"{fmt!r}: not one weight-only row of bench_moe.py ({', '.join(OURS_WO)})")
    return rows[0]


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES) + list(TINY),
                   help="expert shapes (default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="token counts (default: %(default)s)")
    p.add_argument("--tune", action="store_true",
                   help="tune our configurations first (cached on disk; slow: dozens of configurations per shape, T and scheme)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--markdown", action="store_true", help="print only the markdown table")
    p.add_argument("--replays", type=int, default=15, help="timed graph replays (median) (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, wall-clock: a smoke test")
    p.add_argument("--rotate", type=int, default=1, metavar="N",
                   help="cycle N routings (seeded) through each graph's back-to-back calls, so that small-T calls do "
                        "not find their experts in L2; the floor counts the mean experts touched (default: 1)")
    p.add_argument("--weight-only", action="store_true",
                   help="add the weight-only rows (OURS_WO, WO_PATHS: qcompile::wo_moe) to each shape")
    p.add_argument("--checkpoint-order", action="store_true",
                   help="with --weight-only: keep the experts in the checkpoint's word order, not tiled as a GPU "
                        "load stores them (the grouped wo_mma build's comparison)")
    p.add_argument("--pdl-ab", action="store_true",
                   help="instead: FP8 tensor / channel and int4 g128 rows with qcompile's Triton kernels launched "
                        "without and with programmatic dependent launch, alternately (medians of 3 rounds)")
    p.add_argument("--fuse-ab", action="store_true",
                   help="instead: the weight-only rows with wo_mma's grouped build running the gated activation as "
                        "a separate launch and fused into GEMM 1, alternately (medians of 3 rounds)")
    return p


# -- timing ----------------------------------------------------------------------------------------

def _calls(t: int) -> int:
    return 20 if t <= 256 else 3  # calls per graph: enough to hide launch gaps, bounded graph memory


def _time(fn, t: int, replays: int, device: str) -> float | str:
    """µs per call (CUDA graphs, or wall clock on the CPU), or "fails: ..." when fn does not run."""
    try:
        if device == "cuda":
            from qcompile.bench import graph_time_us

            return round(graph_time_us(fn, _calls(t), replays), 1)
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return round(statistics.median(times), 1)
    except Exception as exc:  # noqa: BLE001 - a peer that does not run is a result, not a crash
        if device == "cuda":
            torch.cuda.synchronize()
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def bandwidth_gbps(device: str) -> float:
    """Device read bandwidth (GB/s): the larger of a device-to-device copy (read + write bytes) and a
    sum over a large buffer (bytes read), median times. The floor of a layer is its weight bytes over
    this: reads alone run faster than a copy's mixed traffic."""
    n = (1 << 31) if device == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * n / (_time(lambda: dst.copy_(src), 4096, 10, device) * 1e-6) / 1e9
    dst = None  # free it before the next allocation
    words = src.view(torch.float32).zero_()
    read = n / (_time(lambda: words.sum(), 4096, 10, device) * 1e-6) / 1e9
    return max(copy, read)


# -- peers -----------------------------------------------------------------------------------------

def _sorted_pairs(ids: torch.Tensor, e: int):
    """Pairs by expert without a host sync: (order, token of each sorted pair, int32 group ends)."""
    flat = ids.reshape(-1)
    keys, order = flat.sort(stable=True)
    ends = torch.searchsorted(keys, torch.arange(e, device=ids.device, dtype=keys.dtype), right=True)
    return order, order // ids.shape[1], ends.to(torch.int32)


def _finish(y: torch.Tensor, order, weights, t: int, k: int) -> torch.Tensor:
    """Router weight, pairs back in (token, j) order, sum over the top-k (deterministic, no atomics)."""
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1).sum(1)


def bf16_peer(x, ids, weights, w13t, w2t):
    """w13t [E, H, 2I], w2t [E, I, H] bf16 column-major views (w.transpose(1, 2) of [E, N, K])."""
    t, k = ids.shape
    order, tok, ends = _sorted_pairs(ids, w13t.shape[0])
    g = torch._grouped_mm(x[tok], w13t, offs=ends, out_dtype=torch.bfloat16)
    i = g.shape[1] // 2
    h = F.silu(g[:, :i]) * g[:, i:]
    return _finish(torch._grouped_mm(h, w2t, offs=ends, out_dtype=torch.bfloat16), order, weights, t, k)


def _rowwise_fp8(a: torch.Tensor):
    s = (a.float().abs().amax(1) / 448.0).clamp(min=1.0 / (448 * 512))
    return (a.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s


def fp8_peer(x, ids, weights, w13t, s13, w2t, s2):
    """Per-token fp8 activations x per-channel fp8 weights (s13 [E, 2I], s2 [E, H]) by _scaled_grouped_mm."""
    t, k = ids.shape
    order, tok, ends = _sorted_pairs(ids, w13t.shape[0])
    xq, xs = _rowwise_fp8(x)
    g = torch._scaled_grouped_mm(xq[tok], w13t, xs[tok], s13, offs=ends, out_dtype=torch.bfloat16)
    i = g.shape[1] // 2
    hq, hs = _rowwise_fp8(F.silu(g[:, :i]) * g[:, i:])
    y = torch._scaled_grouped_mm(hq, w2t, hs, s2, offs=ends, out_dtype=torch.bfloat16)
    return _finish(y, order, weights, t, k)


# -- one shape -------------------------------------------------------------------------------------

def _layers(e: int, h: int, i: int, k: int, device: str) -> dict:
    """Random weights of every row, made once per shape: {row: make_moe_inputs dict} (ours) and the
    peers' bf16 / fp8 rowwise weights."""
    layers = {name: mt.make_moe_inputs(scheme, e, h, i, k, 1, "silu", torch.bfloat16, device, seed=n)
              for n, (name, scheme) in enumerate(OURS.items())}
    chan = layers["ours FP8 channel x token"]  # per-channel fp8: the fp8 peer's weights as they are
    w13 = (chan["w13"].float() * chan["w13_scale"][:, :, None]).to(torch.bfloat16)  # the bf16 peer: one
    w2 = (chan["w2"].float() * chan["w2_scale"][:, :, None]).to(torch.bfloat16)      # expert at a time below
    layers["peer"] = dict(w13t=w13.transpose(1, 2), w2t=w2.transpose(1, 2), q13t=chan["w13"].transpose(1, 2),
                          s13=chan["w13_scale"], q2t=chan["w2"].transpose(1, 2), s2=chan["w2_scale"])
    return layers


def routed_tokens(t: int, e: int, h: int, k: int, device: str, variant: int = 0):
    """The inputs of T = t (seeded by t and ``variant``): bf16 x [t, h], k distinct experts per token drawn
    uniformly, softmaxed router weights, and how many experts the routing touches."""
    g = torch.Generator(device=device).manual_seed(1000 + t + 100_000 * variant)
    x = torch.randn(t, h, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=g, device=device).argsort(1)[:, :k].to(torch.int32)
    weights = torch.softmax(torch.randn(t, k, generator=g, device=device), 1)
    return x, ids, weights, int(ids.unique().numel())


def routings(t: int, e: int, h: int, k: int, device: str, rotate: int) -> tuple[list[tuple], float]:
    """``rotate`` routings of T = t ((x, ids, weights) each) and the mean number of experts they touch."""
    routes = [routed_tokens(t, e, h, k, device, r) for r in range(rotate)]
    mean = sum(r[3] for r in routes) / rotate
    return [r[:3] for r in routes], int(mean) if mean.is_integer() else round(mean, 1)


def cycled(make, routes: list[tuple]):
    """One call per invocation, cycling through ``routes`` (``make(x, ids, weights)`` -> a call): a graph of
    several calls then reads different experts back to back, not the same ones out of L2."""
    calls = itertools.cycle([make(*r) for r in routes])
    return lambda: next(calls)()


def _fused_call(layer: dict, device: str):
    def make(x, ids, weights):
        args = dict(layer, x=x, topk_ids=ids, topk_weights=weights)
        if args["a13_scale"] is not None:  # static scales: from this x, and h's likely range
            args["a13_scale"] = (x.abs().amax().float() / 448.0)
            args["a2_scale"] = torch.tensor(0.05, device=device)
        return lambda: mt.fused_moe(**args)
    return make


def bench_shape(name: str, shape, tokens, replays: int, bw: float, device: str, log, rotate: int = 1) -> list[dict]:
    e, h, i, k = shape
    layers = _layers(e, h, i, k, device)
    expert_params = 2 * i * h + h * i
    rows = []
    p = layers["peer"]
    for t in tokens:
        routes, used = routings(t, e, h, k, device, rotate)
        fns = {PEERS[0]: (2, cycled(lambda x, ids, w: functools.partial(bf16_peer, x, ids, w, p["w13t"], p["w2t"]),
                                    routes)),
               PEERS[1]: (1, cycled(lambda x, ids, w: functools.partial(fp8_peer, x, ids, w, p["q13t"], p["s13"],
                                                                        p["q2t"], p["s2"]), routes))}
        for row in OURS:
            fns[row] = (1, cycled(_fused_call(layers[row], device), routes))
        for row, (elem_bytes, fn) in fns.items():
            us = _time(fn, t, replays, device)
            floor = used * expert_params * elem_bytes / (bw * 1e9) * 1e6
            rows.append(dict(shape=name, tokens=t, row=row, us=us, experts_used=used, floor_us=round(floor, 1),
                             pct_floor=round(100 * floor / us, 1) if isinstance(us, float) else None))
            log(f"{name} T={t} {row}: {us}{' us' if isinstance(us, float) else ''} (floor {floor:.1f} us, "
                f"{used} experts)")
    return rows


def as_loaded(spec, w13: tuple, w2: tuple, h: int, i: int) -> tuple:
    """(scheme, w13, w2) as a GPU load holds them: every expert tiled for wo_mma's grouped build where it takes
    both projections (moe_wo.tile_for_mma), else as given."""
    tiled = w13[0].is_cuda and mw.tile_for_mma(spec, w13, w2, h, i, torch.bfloat16)
    return tiled or (spec, w13, w2)


def wo_expert_weights(spec: WeightSpec, e: int, n: int, k: int, device: str, seed: int) -> tuple:
    """Random expert weights ~ N(0, 1/k) [E, n, k] rounded to a weight-only format (int4 groups, NVFP4,
    MXFP4, MXFP8) with quant_math's codes and packers, one expert at a time: the five tensors of
    ``experts_ref.ROLES`` (weight, scale, global scale, zero point, g_idx), stacked over experts."""
    g = torch.Generator(device=device).manual_seed(seed)
    group = spec.scale.group_size
    parts = []
    for _ in range(e):
        w = torch.randn(n, k // group, group, generator=g, device=device) / k**0.5
        amax = w.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        gs = None
        if spec.dtype is QDtype.INT4:
            s = amax / 7
            codes = torch.round(w / s).clamp(-8, 7).to(torch.int32).view(n, k)
            parts.append((quant_math.pack_int32(codes, 4), s.view(n, -1), gs))
            continue
        if spec.scale.dtype is ScaleDtype.E8M0:  # OCP MX: power-of-two scales
            exp = (torch.floor(torch.log2(amax)) - quant_math.MX_EMAX[spec.dtype]).clamp(-127, 127)
            s, unit = (exp + 127).to(torch.uint8), torch.exp2(exp)
        else:  # NVFP4: fp8 scale per 16 times an fp32 global scale
            gs = w.abs().amax() / (448.0 * 6.0)
            s = (amax / 6.0 / gs).clamp(max=448.0).to(torch.float8_e4m3fn)
            unit = s.float() * gs
        v = (w / unit).view(n, k)
        codes = (quant_math.pack_e2m1(quant_math.minifloat_codes(v, QDtype.FP4_E2M1).long())
                 if spec.dtype is QDtype.FP4_E2M1 else v.clamp(-448, 448).to(torch.float8_e4m3fn))
        parts.append((codes, s.view(n, -1), gs))
    return tuple(None if parts[0][j] is None else torch.stack([p[j] for p in parts]) for j in range(3)) + (None, None)


def wo_layer(spec, e: int, h: int, i: int, device: str, seed: int, tiled: bool = True) -> tuple:
    """(scheme, w13, w2) of random weight-only experts (:func:`wo_expert_weights`), as a GPU load holds them
    where ``tiled`` (:func:`as_loaded`)."""
    w13, w2 = (wo_expert_weights(spec.weight, e, nn, kk, device, seed + j) for j, (nn, kk) in enumerate(((2 * i, h),
                                                                                                          (h, i))))
    return as_loaded(spec, w13, w2, h, i) if tiled else (spec, w13, w2)


def wo_refusal(spec, h: int, i: int) -> str | None:
    """"fails: ..." where the weight-only kernels do not take K of a projection (whole words and scale groups)."""
    return next((f"fails: {what}: {r}" for what, kk in zip(mw.PROJECTIONS, (h, i))
                 if (r := mw.triton_shape_reason(spec.weight, 0, kk))), None)


def _wo_call(spec, w13: tuple, w2: tuple):
    def make(x, ids, w):  # the op as a model calls it (a measured choice where there is one); CPU: the reference
        return functools.partial(torch.ops.qcompile.wo_moe, x, ids, w, *w13, *w2, None, None, "silu", spec.key,
                                 backend="triton" if mw.use_triton(x) else "reference")
    return make


def bench_wo_shape(name: str, shape, tokens, replays: int, bw: float, device: str, log,
                   rotate: int = 1, tiled: bool = True) -> list[dict]:
    """The weight-only rows of one shape (OURS_WO, WO_PATHS), rows as :func:`bench_shape`'s; floor: the
    stored bytes (codes and scales) of the experts the routing touches. ``tiled``: experts as a GPU load
    stores them (:func:`as_loaded`), else in the checkpoint's order."""
    e, h, i, k = shape
    rows = []
    for n, (row, scheme) in enumerate(OURS_WO.items()):
        spec = parse_scheme_key(scheme)
        forced = {f"{row}, {path}": kw for path, kw in WO_PATHS.items()} if n < WO_PATH_FORMATS else {}
        labels = [row] + list(forced)
        why = wo_refusal(spec, h, i)
        if why:  # K the weight-only kernels do not take (whole words and scale groups)
            rows += [dict(shape=name, tokens=t, row=label, us=why, experts_used=0, floor_us=0.0, pct_floor=None)
                     for t in tokens for label in labels]
            continue
        spec, w13, w2 = wo_layer(spec, e, h, i, device, 10 * n, tiled)
        expert_bytes = mw.expert_bytes(w13, w2)
        paths = {row: None} | forced
        for t in tokens:
            routes, used = routings(t, e, h, k, device, rotate)
            for label, kw in paths.items():
                if kw is not None and mw.use_triton(routes[0][0]):  # one path forced, the rule's configurations
                    def make(x, ids, w, kw=kw):
                        mma = kw["mma"] if kw["mma"] != "rule" else mw.mma_rule(x, ids.numel(), e) or {"block_m": 16}
                        return functools.partial(mw.wo_moe_triton, x, ids, w, w13, w2, None, None, "silu", spec, False,
                                                 dequant_rows=kw["dequant_rows"], mma=mma)
                else:
                    make = _wo_call(spec, w13, w2)
                us = _time(cycled(make, routes), t, replays, device)
                floor = used * expert_bytes / (bw * 1e9) * 1e6
                rows.append(dict(shape=name, tokens=t, row=label, us=us, experts_used=used, floor_us=round(floor, 1),
                                 pct_floor=round(100 * floor / us, 1) if isinstance(us, float) else None))
                log(f"{name} T={t} {label}: {us}{' us' if isinstance(us, float) else ''} (floor {floor:.1f} us)")
        if device == "cuda":
            del w13, w2
            torch.cuda.empty_cache()
    return rows


PDL_ROWS = ("ours FP8 tensor static", "ours FP8 channel x token", "ours int4 g128 weight-only")
AB_WHAT = {"pdl": "PDL", "fuse": "the fused activation"}


def ab(mode: str, name: str, shape, tokens, replays: int, device: str, log, rotate: int = 1,
       rounds: int = 3) -> list[dict]:
    """``--pdl-ab`` (``mode`` "pdl"): :data:`PDL_ROWS` timed with qcompile's Triton kernels launched without PDL and
    with it (``fp8_quant_triton.without_pdl``; ``wo_mma`` keeps PDL in both); ``--fuse-ab`` ("fuse"): the
    weight-only rows with wo_mma's grouped build running the gated activation as a separate launch
    (``QCOMPILE_MOE_FUSE=0``) and fused into GEMM 1. Without and with alternately in ``rounds`` rounds; the medians."""
    from qcompile.kernels.fp8_quant_triton import without_pdl

    e, h, i, k = shape
    makers, rows = {}, []
    if mode == "pdl":
        layers = _layers(e, h, i, k, device)
        makers = {row: _fused_call(layers[row], device) for row in PDL_ROWS[:2]}
    for row in PDL_ROWS[2:] if mode == "pdl" else OURS_WO:
        spec = parse_scheme_key(OURS_WO[row])
        why = wo_refusal(spec, h, i)
        if why:
            rows += [dict(shape=name, tokens=t, row=row, off_us=why, on_us=why, ratio=None) for t in tokens]
        else:
            makers[row] = _wo_call(*wo_layer(spec, e, h, i, device, 0))
    off = without_pdl if mode == "pdl" else functools.partial(mock.patch.dict, os.environ, {"QCOMPILE_MOE_FUSE": "0"})
    for t in tokens:
        routes, _ = routings(t, e, h, k, device, rotate)
        for row, make in makers.items():
            times = {False: [], True: []}
            for _ in range(rounds):
                with off():
                    times[False].append(_time(cycled(make, routes), t, replays, device))
                times[True].append(_time(cycled(make, routes), t, replays, device))
            off_us, on_us = (statistics.median(times[p]) for p in (False, True))
            ratio = round(on_us / off_us, 3) if isinstance(on_us, float) and isinstance(off_us, float) else None
            rows.append(dict(shape=name, tokens=t, row=row, off_us=off_us, on_us=on_us, ratio=ratio))
            log(f"{name} T={t} {row}: without {AB_WHAT[mode]} {off_us} us, with {on_us} us")
    return rows


def tune_all(shapes, tokens, log) -> dict:
    """tune() every (shape, T, scheme) of the run; returns this GPU's cached entries of those keys."""
    keys = []
    for name in shapes:
        e, h, i, k = SHAPES[name]
        for t in tokens:
            for scheme in OURS.values():
                mc.tune(e, h, i, k, t, scheme, log=log)
                keys.append(mc.config_key(mc.moe_quant(scheme).kind, e, h, i, k, t))
    entries = mc.cached_entries(torch.device("cuda"))
    return {key: entries[key] for key in keys if key in entries}


# -- output ----------------------------------------------------------------------------------------

def markdown(rows: list[dict], device_label: str, bw: float) -> str:
    out = [(f"Fused MoE on {device_label} (read bandwidth {bw:.0f} GB/s); µs per layer call, "
            "% of the weight floor of the experts touched"), ""]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sel = [r for r in rows if r["shape"] == shape]
        tokens = list(dict.fromkeys(r["tokens"] for r in sel))
        used = {t: max(r["experts_used"] for r in sel if r["tokens"] == t) for t in tokens}  # a failed row has 0
        e, h, i, k = (SHAPES | TINY)[shape]
        out.append(f"**{shape}** (E={e}, H={h}, I={i}, top-{k}; experts used: "
                   + ", ".join(f"T={t}: {used[t]}" for t in tokens) + ")")
        out.append("")
        out.append("| row | " + " | ".join(f"T={t}" for t in tokens) + " |")
        out.append("|---|" + "---|" * len(tokens))
        for row in dict.fromkeys(r["row"] for r in sel):
            cells = []
            for t in tokens:
                r = next(r for r in sel if r["row"] == row and r["tokens"] == t)
                cells.append(f"{r['us']} ({r['pct_floor']}%)" if r["pct_floor"] is not None else str(r["us"]))
            out.append(f"| {row} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def run(args: argparse.Namespace) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA GPU (or --dry-run for the CPU smoke test)")
    shapes = list(TINY) if args.dry_run else args.shapes
    tokens = [1, 3] if args.dry_run else args.tokens
    log = (lambda *a, **kw: None) if args.markdown else (lambda msg: print(msg, file=sys.stderr))
    label = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run, not a measurement)"
    mode = "pdl" if args.pdl_ab else "fuse" if args.fuse_ab else None
    if mode:
        rows = [r for name in shapes for r in ab(mode, name, (SHAPES | TINY)[name], tokens, args.replays, device, log,
                                                 args.rotate)]
        what = AB_WHAT[mode]
        head = f"| shape | T | row | without {what}, µs | with {what}, µs | with / without |\n" + "| --- " * 6 + "|\n"
        print(f"{label}\n\n{head}" + "\n".join(f"| {r['shape']} | {r['tokens']} | {r['row']} | {r['off_us']} | "
                                                f"{r['on_us']} | {r['ratio']} |" for r in rows))
        if args.json:
            Path(args.json).write_text(json.dumps(dict(device=label, rows=rows), indent=1))
        return dict(device=label, rows=rows)
    tuned = tune_all(shapes, tokens, log) if args.tune and device == "cuda" else {}
    bw = bandwidth_gbps(device)
    rows = []
    for name in shapes:
        rows += bench_shape(name, (SHAPES | TINY)[name], tokens, args.replays, bw, device, log, args.rotate)
        if args.weight_only:
            rows += bench_wo_shape(name, (SHAPES | TINY)[name], tokens, args.replays, bw, device, log, args.rotate,
                                   not args.checkpoint_order)
        if device == "cuda":
            torch.cuda.empty_cache()
    result = dict(device=label, bandwidth_gbps=round(bw, 1), rows=rows, tuned=tuned)
    print(markdown(rows, label, bw))
    if tuned:
        print("\nTuned entries (TUNED table form):\n" + json.dumps(tuned, indent=1, sort_keys=True))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def main(argv=None) -> int:
    run(add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
