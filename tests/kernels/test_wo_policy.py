"""The launch policy of the mma backend of qcompile::wo_linear, locked by a golden file.

``wo_policy_golden.txt.xz`` holds every decision the backend makes for a grid of formats (tiled or not,
bf16 / fp16 x) x real (N, K) x M (:data:`MS`) x GPUs (:data:`GPUS`: sm_90, sm_80, sm_89 of several sizes): the
route (the CUDA kernel, its row blocks, the Triton kernel with its launch configuration, or dequantize +
F.linear) and, for every kernel
launch, each compile-time switch, the grid, block, shared memory, PDL, how x reaches the kernel (as it is,
a tensor map, or the x_prep kernel's buffer), the split-K partials and counters and the integer arguments.
A second part holds launches that callers spell out (``wo_mma(..., split=3, kw=4)``, as the GPU tests and
the benchmarks do), errors included. The device queries are the only impure part of the policy; here they
answer from a fixed model of an SM (:class:`FakeGpu`).

Regenerate (only when a decision is meant to change): ``python -m tests.kernels.test_wo_policy --write``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qcompile.kernels import cuda_driver, wo_gemm, wo_mma, wo_policy
from qcompile.scheme import Packing, QDtype, QuantScheme, canonical_shape

from .test_wo_gemm import SPECS

GOLDEN = Path(__file__).with_name("wo_policy_golden.txt.xz")

SHAPES = ((4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672), (14336, 4096), (4096, 14336), (6144, 4096),
          (1024, 4096), (3584, 18944), (37888, 3584), (5120, 5120), (1280, 8192), (8192, 1024), (7168, 8192),
          (8192, 3584), (18944, 3584), (57344, 8192), (11008, 4096), (4112, 4224), (2048, 2048))
# every M up to 64, then the policy's thresholds and powers of two with their neighbours up to 4096
MS = tuple(sorted(set(range(1, 65)) | {72, 80, 95, 96, 97, 100, 112, 120, 136, 200, 300, 383, 384, 385, 600, 1000}
                  | {p + d for p in (128, 256, 512, 1024, 2048, 4096) for d in (-1, 0, 1)}))
# H100 SXM / PCIe, a 78-SM sm_90 part, A100, L40S, L4
GPUS = (((9, 0), 132), ((9, 0), 114), ((9, 0), 78), ((8, 0), 108), ((8, 9), 142), ((8, 9), 58))
FP16_FORMATS = ("int4_g128", "nvfp4", "int8_channel_packed", "mxfp8")

# launches spelled out by callers: the GPU tests' and the benchmarks' keyword sets
FORCED = [dict(), dict(max_cluster=1), dict(pdl=False), dict(trig=False), dict(trig=True), dict(smem_budget=48 * 1024),
          dict(wgmma=True), dict(wgmma=False), dict(wgmma=True, warps=8), dict(ws=True), dict(ws=False),
          dict(xs=True), dict(xs=False), dict(xs=False, wgmma=False, split=2)]
FORCED += [dict(stages=s, warps=w, split=split, max_cluster=cl) for split in (1, 3, 8)
           for s, w, cl in ((2, 4, 8), (4, 8, 8), (8, 4, 8), (4, 16, 8), (2, 8, 1))]
FORCED += [dict(kw=2), dict(kw=4, split=2), dict(kw=8, warps=16), dict(kw=16, warps=16), dict(kw=4, split=3, max_cluster=1),
           dict(kw=8, warps=8, split=2, max_cluster=1), dict(kw=4, warps=16), dict(rt=2), dict(rt=2, warps=16, split=8),
           dict(rt=2, kw=2, warps=16, split=4), dict(rt=2, split=3, max_cluster=1), dict(rt=2, kw=4, warps=4),
           dict(kw=3)]
FORCED += [dict(xs=True, **v) for v in (
    dict(split=2), dict(kw=4, split=2, xstages=2), dict(kw=8, warps=16, split=1, xstages=2),
    dict(rt=2, kw=4, warps=16, split=2, xstages=3), dict(rt=2, warps=16, split=8), dict(split=3, max_cluster=1),
    dict(rt=2, kw=2, split=3, max_cluster=1), dict(split=1, stages=4), dict(rt=2, kw=8, warps=16, split=1, xstages=3),
    dict(xstages=1))]
FORCED += [dict(ws=True, **v) for v in (
    dict(nstg=4), dict(xstages=2), dict(split=1), dict(split=3), dict(warps=4, warps_per_sm=12, minb=3),
    dict(warps=8, warps_per_sm=8), dict(warps=8, warps_per_sm=16, minb=2), dict(warps=16, warps_per_sm=16),
    dict(warps=8), dict(trig=False), dict(kw=2))]
FORCED += [dict(stages=s, warps=w, warps_per_sm=p, **kw) for s, w, p, kw in (
    (2, 8, 32, dict(max_cluster=1)), (2, 8, 32, {}), (2, 16, 32, {}), (2, 8, 24, {}), (4, 8, 16, {}))]
FORCED_NAMES = ("int4_g128", "int4_g128/tiled", "nvfp4/tiled", "int8_channel_packed/tiled", "mxfp8/tiled",
                "int4_g32/tiled")
FORCED_SHAPES = ((4096, 4096), (4112, 4224))
FORCED_MS = (1, 3, 5, 8, 9, 12, 16, 17, 25, 32, 64, 96, 128, 129)
FORCED_GPUS = (((9, 0), 132), ((8, 0), 132))


def variants():
    """(name, spec, x dtype) of every format: checkpoint order and tiled (act-order: checkpoint only), bf16 x,
    and fp16 x for a few (MX weights refuse it)."""
    for name, spec in SPECS.items():
        for tiled in (False, True) if not spec.act_order else (False,):
            s, label = replace(spec, tiled=tiled), name + ("/tiled" if tiled else "")
            yield label, s, torch.bfloat16
            if name in FP16_FORMATS:
                yield label + "/fp16", s, torch.float16


class FakeGpu:
    """A fixed model of an SM for the occupancy queries: 2048 threads, 64 K registers, 228 KB (sm_90) /
    164 KB (sm_80) / 100 KB (sm_89) of shared memory with 1 KB reserved per CTA, at most 32 CTAs; registers
    per thread as ``__launch_bounds__`` (MINB) allows, else by build and token tiles; SMs in GPCs of about
    16.5 for the clusters, which never span two GPCs."""

    SMEM = {(9, 0): 228 * 1024, (8, 0): 164 * 1024, (8, 9): 100 * 1024}

    def __init__(self, capability: tuple[int, int], sms: int):
        self.capability, self.sms = capability, sms
        self.pdl = wo_policy.pdl_default(capability)
        gpcs = max(1, round(sms / 16.5))
        self.gpcs = [sms // gpcs + (i < sms % gpcs) for i in range(gpcs)]

    def regs(self, cfg) -> int:
        if cfg.minb > 1:
            return min(255, 65536 // (cfg.minb * cfg.threads) // 8 * 8)
        if cfg.wgmma:
            return min(255, 40 + 32 * cfg.mt)
        return min(255, 48 + 12 * cfg.mt * cfg.rt)

    def blocks_per_sm(self, cfg, smem: int) -> int:
        if smem + 1024 > self.SMEM[self.capability]:
            return 0
        per_warp = -(-self.regs(cfg) * 32 // 256) * 256
        by_regs = 65536 // (per_warp * -(-cfg.threads // 32))
        return max(0, min(32, 2048 // cfg.threads, self.SMEM[self.capability] // (smem + 1024), by_regs))

    def max_active_clusters(self, cfg, smem: int) -> int:
        per_sm = self.blocks_per_sm(cfg, smem)
        return sum(g * per_sm // cfg.cluster for g in self.gpcs)


class FakeKernel:
    def __init__(self, cfg, name: str):
        self.cfg, self.name, self._max_shared_mem_bytes = cfg, name, 48 * 1024

    def set_shared_memory_config(self, n: int) -> None:
        self._max_shared_mem_bytes = n


class OnCuda(torch.Tensor):
    """A meta tensor that says it is on CUDA (the backend routes only CUDA tensors to the kernel)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self):
        return True


_CFG_TEXT: dict = {}


def cfg_text(cfg) -> str:
    if cfg not in _CFG_TEXT:
        # (the dense op's launches: the MoE experts' grouped build and its fused activation are never among them)
        _CFG_TEXT[cfg] = ",".join(str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                                  if f.name not in ("grouped", "gact"))
    return _CFG_TEXT[cfg]


def launch_text(name, cfg, grid, block, smem, pdl, args) -> str:
    """One kernel launch: the kernel, its compile-time switches, grid, block, shared memory, PDL, and what its
    arguments say: x as it is / the x_prep buffer, split-K partials and counters, integers, a tensor map."""
    head = f"{name} cfg={cfg_text(cfg)} grid={grid[0]}x{grid[1]}x{grid[2]} block={block[0]} smem={smem} pdl={int(pdl)}"
    if name == "x_prep":
        return f"{head} ints={args[2]},{args[3]}"
    x = "xp" if args[0].dim() == 1 else "x"
    part = "P" if isinstance(args[7], torch.Tensor) and args[7].dim() == 3 else "-"
    ctr = args[8] if isinstance(args[8], str) else "-"
    tail = args[14] if len(args) > 14 else "-"
    return f"{head} x={x} part={part} ctr={ctr} ints={','.join(map(str, args[9:14]))} tail={tail}"


_WEIGHT_DTYPE = {(QDtype.INT4, Packing.INT32): torch.int32, (QDtype.FP4_E2M1, Packing.UINT8): torch.uint8,
                 (QDtype.INT8, Packing.INT32): torch.int32, (QDtype.INT8, Packing.NONE): torch.int8,
                 (QDtype.FP8_E4M3, Packing.NONE): torch.float8_e4m3fn}


def layer(spec, xdtype, n, k):
    """Meta tensors of one layer: weight, scale, global scale, zero point, g_idx, bias (on N divisible by 3)."""
    scheme, meta = QuantScheme(spec), dict(device="meta")
    weight = torch.empty(canonical_shape("weight", scheme, n, k), dtype=_WEIGHT_DTYPE[(spec.dtype, spec.packing)],
                         **meta)
    scale = torch.empty(canonical_shape("weight_scale", scheme, n, k), dtype=wo_gemm._SCALE_DTYPES[spec.scale.dtype],
                        **meta)
    zp = torch.empty(scale.shape, dtype=torch.int32 if spec.dtype.bits == 4 else torch.int8, **meta) \
        if spec.zero_point else None
    gs = torch.empty((), **meta) if spec.global_scale else None
    g_idx = torch.empty(k, dtype=torch.int32, **meta) if spec.act_order else None
    bias = torch.empty(n, dtype=xdtype, **meta) if n % 3 == 0 else None
    return weight, scale, gs, zp, g_idx, bias


class Recorder:
    """Runs the op's mma backend on meta tensors with the GPU (:class:`FakeGpu`) and the launches replaced."""

    def __init__(self, monkeypatch):
        self.log, self.gpu = [], None
        mp = monkeypatch
        mp.delenv("QCOMPILE_PDL", raising=False)
        mp.setattr(wo_mma, "gpu", lambda device: self.gpu)
        mp.setattr(wo_mma, "_kernel", lambda cfg, idx, name="wo_mma": FakeKernel(cfg, name))
        mp.setattr(cuda_driver, "device_index", lambda device: 0)
        mp.setattr(cuda_driver, "counters", lambda device, n: f"counters[{n}]")
        mp.setattr(cuda_driver, "tensor_map_2d", lambda x2, cols, rows: f"tmap[{rows}]")
        mp.setattr(cuda_driver, "launch", lambda kern, *a: self.log.append(launch_text(kern.name, kern.cfg, *a)))
        real = wo_mma.wo_mma
        mp.setattr(wo_mma, "wo_mma", lambda x2, *a, **kw: real(x2.as_subclass(torch.Tensor), *a, **kw))
        mp.setattr(wo_mma, "wo_mma_blocked", lambda x2, *a: self._blocks(a[-1]))
        mp.setattr(wo_gemm, "wo_gemm", lambda x2, *a: self._triton(x2, a[0], a[-1]))
        mp.setattr(wo_gemm, "_dequant", lambda x2, *a: self._route("dequant", x2))

    def _route(self, what, x2):
        self.log.append(what)

    def _triton(self, x2, weight, spec):
        cfg = wo_gemm.pick_config(x2.shape[0], weight.shape[0], x2.shape[1], wo_gemm.layout_of(spec), self.gpu.sms)
        self.log.append("triton " + ",".join(f"{k}={v}" for k, v in sorted(cfg.items())))

    def _blocks(self, blocks):
        top = blocks[0]
        assert blocks[:-1] == [top] * (len(blocks) - 1) and 0 < blocks[-1] <= top, blocks
        self.log.append(f"blocks/{top}")

    def device(self, capability, sms):
        self.gpu = FakeGpu(capability, sms)

    def decide(self, tensors, spec, xdtype, m, k) -> str:
        """What the op's mma backend runs for M rows."""
        weight, scale, gs, zp, g_idx, bias = tensors
        self.log = []
        wo_gemm._mma(torch.empty(m, k, dtype=xdtype, device="meta").as_subclass(OnCuda), weight, scale, gs, zp,
                     g_idx, bias, spec)
        return " ; ".join(self.log)

    def forced(self, tensors, spec, xdtype, m, k, kwargs) -> str:
        """What ``wo_mma(..., **kwargs)`` launches for M rows, or the error it raises."""
        weight, scale, gs, zp, _, bias = tensors
        self.log = []
        try:
            wo_mma.wo_mma(torch.empty(m, k, dtype=xdtype, device="meta"), weight, scale, gs, zp, bias, spec, **kwargs)
        except ValueError as e:
            return f"ValueError: {e}"
        return " ; ".join(self.log)


def _delta(prev: str | None, text: str) -> str:
    """``text`` as the tokens that differ from ``prev`` (a launch of the previous M), or whole."""
    a, b = (prev or "").split(" "), text.split(" ")
    if prev is None or len(a) != len(b) or sum(x != y for x, y in zip(a, b)) * 2 > len(b):
        return text
    return "~" + " ".join(f"{i}={y}" for i, (x, y) in enumerate(zip(a, b)) if x != y)


def encode_series(texts: list[tuple[int, str]]) -> list[str]:
    """(M, text) in M order as lines: runs of one text as ``M1-M2 text``, launches as deltas to the previous."""
    lines, prev, i = [], None, 0
    while i < len(texts):
        j = i
        while j + 1 < len(texts) and texts[j + 1][1] == texts[i][1] and texts[j + 1][0] == texts[j][0] + 1:
            j += 1
        m0, m1, text = texts[i][0], texts[j][0], texts[i][1]
        lines.append(f"{m0}{'-' + str(m1) if m1 > m0 else ''} {_delta(prev, text)}")
        if "cfg=" in text:
            prev = text
        i = j + 1
    return lines


def decode_series(lines: list[str]) -> dict[int, str]:
    out, prev = {}, None
    for line in lines:
        ms, _, text = line.partition(" ")
        if text.startswith("~"):
            toks = prev.split(" ")
            for change in text[1:].split(" "):
                i, _, tok = change.partition("=")
                toks[int(i)] = tok
            text = " ".join(toks)
        if "cfg=" in text:
            prev = text
        m0, _, m1 = ms.partition("-")
        for m in range(int(m0), int(m1 or m0) + 1):
            out[m] = text
    return out


def series(rec: Recorder, gpus=GPUS, shapes=SHAPES, ms=MS, names=None):
    """Yield (header, [(M, text)]) per GPU, format and shape."""
    for cap, sms in gpus:
        rec.device(cap, sms)
        for name, spec, xdtype in variants():
            if names is not None and name not in names:
                continue
            for n, k in shapes:
                tensors = layer(spec, xdtype, n, k)
                yield (f"@ sm_{cap[0]}{cap[1]}/{sms} {name} {n}x{k}",
                       [(m, rec.decide(tensors, spec, xdtype, m, k)) for m in ms])


def forced_series(rec: Recorder):
    for cap, sms in FORCED_GPUS:
        rec.device(cap, sms)
        for name, spec, xdtype in variants():
            if name not in FORCED_NAMES:
                continue
            for n, k in FORCED_SHAPES:
                tensors = layer(spec, xdtype, n, k)
                yield (f"@ forced sm_{cap[0]}{cap[1]}/{sms} {name} {n}x{k}",
                       [f"{m} {json.dumps(kw, sort_keys=True)} => {rec.forced(tensors, spec, xdtype, m, k, kw)}"
                        for m in FORCED_MS for kw in FORCED])


def read_golden() -> dict[str, list[str]]:
    """Header -> its lines."""
    out, head = {}, None
    for line in lzma.decompress(GOLDEN.read_bytes()).decode().splitlines():
        if line.startswith("@ "):
            head = line
            out[head] = []
        else:
            out[head].append(line)
    return out


def write_golden(monkeypatch) -> None:
    rec, lines = Recorder(monkeypatch), []
    for head, texts in series(rec):
        lines += [head, *encode_series(texts)]
    for head, texts in forced_series(rec):
        lines += [head, *texts]
    GOLDEN.write_bytes(lzma.compress(("\n".join(lines) + "\n").encode(), preset=9 | lzma.PRESET_EXTREME))


def _first_difference(head, want: dict[int, str], got: dict[int, str]) -> str:
    for m in sorted(set(want) | set(got)):
        if want.get(m) != got.get(m):
            return f"{head} M={m}:\n  golden: {want.get(m)}\n  now:    {got.get(m)}"
    return ""


@pytest.fixture(scope="module")
def golden():
    return read_golden()


@pytest.mark.slow
@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: f"sm_{g[0][0]}{g[0][1]}-{g[1]}")
def test_decisions_match_golden(gpu, golden, monkeypatch):
    """Every format x shape x M on one GPU: the route and every launch as the golden file has them."""
    rec = Recorder(monkeypatch)
    seen = 0
    for head, texts in series(rec, gpus=(gpu,)):
        assert head in golden, f"{head} missing from the golden file"
        got = dict(texts)
        want = decode_series(golden[head])
        assert want == got, _first_difference(head, want, got)
        seen += 1
    assert seen == len(SHAPES) * len(list(variants()))


def test_forced_launches_match_golden(golden, monkeypatch):
    """Launches that callers spell out (the GPU tests' and benchmarks' keyword sets), and the errors."""
    rec = Recorder(monkeypatch)
    for head, lines in forced_series(rec):
        assert golden[head] == lines, next(f"{head}:\n  golden: {a}\n  now:    {b}"
                                           for a, b in zip(golden[head], lines) if a != b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="write the golden decisions of the wo_mma launch policy")
    p.add_argument("--write", action="store_true", help=f"write {GOLDEN.name}")
    args = p.parse_args(argv)
    if not args.write:
        p.print_help()
        return 1
    mp = pytest.MonkeyPatch()
    try:
        write_golden(mp)
    finally:
        mp.undo()
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.parametrize("name", ["int4_g128", "nvfp4", "mxfp8"])
def test_grouped_launch_fills_the_gpu_in_a_cluster(name):
    """The MoE experts' launch: the mma.sync build, one 8- or 16-slot block per grid z, the split that
    fills the GPU with the active blocks' CTAs, reduced in a cluster (never through global memory), the x
    slice within budget; no split before sm_90; none where x does not fit or a forced split exceeds a cluster."""
    spec = next(s for n, s in SPECS.items() if n == name)
    gpu = FakeGpu((9, 0), 132)
    for n, k, active, bm in ((1536, 2048, 8, 8), (2048, 768, 8, 8), (28672, 4096, 2, 8), (4096, 14336, 2, 16),
                             (1536, 2048, 128, 16)):
        launch = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, bm, n, k), active, True)
        assert launch is not None and launch.cfg.grouped and not (launch.cfg.wgmma or launch.cfg.ws or launch.cfg.xs)
        assert launch.cfg.mt == bm // 8 and not launch.global_split, launch
        assert launch.split == (launch.cfg.cluster if launch.split > 1 else 1) <= wo_policy.MAX_CLUSTER
        assert launch.smem <= wo_policy.SMEM_BUDGET and launch.cps * launch.split >= k // wo_policy.chunk_k(spec)
        ctas = launch.cols * launch.split * active
        assert ctas >= gpu.sms or launch.split * launch.cps < 2 * launch.cfg.stages * launch.split, launch
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 64, 1 << 20), 1, True) is None  # x of K / 8
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 1536, 2048), 8, True, split=16) is None
    forced = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 16, 1536, 2048), 8, True, warps=4, split=2)
    assert (forced.cfg.warps, forced.split, forced.cfg.cluster, forced.cols) == (4, 2, 2, 24)
    # kw warps per tile, rt tiles per group: 8 warps, kw 2, rt 2 own 8 tiles (128 rows) per CTA
    shared = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 2048, 768), 8, True, warps=8, split=2, kw=2, rt=2)
    assert (shared.cfg.kw, shared.cfg.rt, shared.cfg.tiles, shared.cols, shared.split) == (2, 2, 8, 16, 2)
    assert shared.smem >= (8 - 8 // 2) * 2 * 512  # the other warps' partials
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 2048, 768), 8, True, warps=4, kw=8) is None
    sm80 = FakeGpu((8, 0), 108)
    for n, k in ((1536, 2048), (28672, 4096)):
        assert wo_policy.grouped_launch(sm80, wo_policy.Call(spec, 8, n, k), 8, False).split == 1
    assert wo_policy.grouped_launch(sm80, wo_policy.Call(spec, 8, 4096, 14336 * 4), 2, False) is None


@pytest.mark.parametrize("name", ["int4_g128", "nvfp4", "mxfp8"])
def test_grouped_launch_warp_specialized_above_16_slots(name):
    """Blocks of 32 to 128 pair slots: the warp-specialized build (sm_90, tiled experts) with the dense build's CTA,
    a split reduced in a cluster only, its rings within a CTA's shared memory; forced warps and split kept; none
    with shared tiles, two tiles per warp or the fused activation, on other GPUs, or untiled experts. x narrower than
    K needs nothing of it (the rows are gathered and padded first)."""
    spec = replace(SPECS[name], tiled=True)
    gpu = FakeGpu((9, 0), 132)
    for n, k, active, bm in ((28672, 4096, 8, 64), (4096, 14336, 8, 64), (1536, 2048, 128, 32), (5760, 2944, 32, 128),
                             (2048, 768, 64, 32)):
        launch = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, bm, n, k), active, True)
        cfg = launch.cfg
        assert cfg.grouped and cfg.ws and cfg.wgmma and cfg.packed and cfg.mt == bm // 8 and not launch.global_split
        assert launch.split == (cfg.cluster if launch.split > 1 else 1) <= wo_policy.MAX_CLUSTER
        assert launch.cps * launch.split >= k // wo_policy.chunk_k(spec) and launch.smem <= wo_policy.SM90_SMEM_PER_CTA
        assert launch.cols * 16 * cfg.warps >= n and launch.x_input == ("tma" if cfg.xnat else "x_prep")
        padded = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, bm, n, k), active, True, xpad=True)
        assert padded == launch
    forced = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 64, 4096, 14336), 8, True, warps=16, split=4)
    assert (forced.cfg.warps, forced.split, forced.cfg.cluster, forced.cols) == (16, 4, 4, 16)
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 64, 4096, 14336), 8, True, split=16) is None
    for fixed in ({"kw": 2}, {"rt": 2}, {"gact": 1}, {"warps": 6}):
        assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 64, 4096, 4096), 8, True, **fixed) is None, fixed
    assert wo_policy.grouped_launch(FakeGpu((8, 0), 108), wo_policy.Call(spec, 64, 4096, 4096), 8, False) is None
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(SPECS[name], 64, 4096, 4096), 8, True) is None  # not tiled


@pytest.mark.parametrize("name", ["int4_g128", "nvfp4"])
def test_grouped_launch_fused_epilogues(name):
    """The fused gated activation: the same CTAs and split as the plain launch (a CTA's gate tiles and the
    matching up tiles), its outputs through shared memory even without a split; refused where the tile groups are
    odd (4 warps in tiles of 4) or N / 2 is not a multiple of 16."""
    spec = SPECS[name]
    gpu = FakeGpu((9, 0), 132)
    for n, k, active, fixed in ((1536, 2048, 8, {}), (28672, 4096, 2, {}), (1536, 2048, 8, {"split": 1}),
                                (1536, 2048, 8, {"warps": 8, "kw": 2, "rt": 2})):
        plain = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, n, k), active, True, **fixed)
        fused = wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, n, k), active, True, **fixed, gact=1)
        assert fused.cfg == replace(plain.cfg, gact=1) and (fused.cols, fused.split) == (plain.cols, plain.split)
        assert fused.smem >= 8 * fused.cfg.tiles * 16 * 4 and fused.smem >= plain.smem
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 1536, 2048), 8, True, warps=4, kw=4, gact=1) is None
    assert wo_policy.grouped_launch(gpu, wo_policy.Call(spec, 8, 1552, 2048), 8, True, gact=1) is None


@pytest.mark.parametrize("name, n, k, m, streamed", [
    ("int4_g128", 6144, 4096, 8, True), ("int4_g128", 4608, 3584, 4, True), ("int4_g128", 4608, 3584, 3, True),
    ("int4_g128", 5120, 3072, 2, False), ("nvfp4", 4608, 3584, 5, True), ("nvfp4", 4608, 3584, 4, False),
    ("mxfp8", 4608, 3584, 8, True), ("mxfp8", 4608, 3584, 6, False)])
def test_x_streamed_in_place_of_a_global_split(name, n, k, m, streamed, monkeypatch):
    """On sm_90, where neither two tiles per warp nor tile sharing fits and the mma.sync plan would reduce its split
    through global memory, the policy streams x instead (no split) from the format's XS_GLOBAL_MIN_M; below it and on
    other GPUs the split stays."""
    spec = replace(SPECS[name], tiled=True)
    call = wo_policy.Call(spec, m, n, k)
    for cap, sms in (((9, 0), 132), ((8, 0), 108)):
        gpu = FakeGpu(cap, sms)
        monkeypatch.setattr(wo_policy, "XS_GLOBAL_MIN_M", {}, raising=True)
        monkeypatch.setattr(wo_policy, "XS_MIN_M", 99)
        wo_policy._DEFAULTS.clear()
        split = wo_policy.choose(gpu, call, cap[0] == 9)
        monkeypatch.undo()
        wo_policy._DEFAULTS.clear()
        chosen = wo_policy.choose(gpu, call, cap[0] == 9)
        assert split.split > 1 and split.cfg.cluster == 1 and not split.cfg.xs, split
        if cap[0] == 9 and streamed:
            assert chosen.cfg.xs and chosen.split == 1 and chosen.cfg.rt == 2, chosen
        else:
            assert chosen == split
