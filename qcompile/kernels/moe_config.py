"""What the fused MoE kernels run (:class:`MoeQuant` of a scheme) and how (:class:`MoeConfig`).

Launch parameters come from, in order: the on-disk cache that :func:`tune` writes (:func:`cache_path`,
per GPU name), the shipped ``TUNED`` table (per compute capability, e.g. ``sm_90``; entries are
:func:`tune`'s output, see :func:`cached_entries`), and the :func:`default_config` rule.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError, UnsupportedError
from ..scheme import Granularity, QDtype, QuantScheme, ScaleDtype, parse_scheme_key
from .moe_kernels import G_BLOCK, G_ROW, G_TENSOR

OP = "qcompile::fused_moe"
# the on-disk cache of tuned configurations, instead of the user's cache folder
CACHE_ENV = "QCOMPILE_MOE_CONFIGS"
# name -> (kernel code, gated). "swigluoai": gpt-oss's clamped SwiGLU (gate rows, then up rows)
ACTIVATIONS = {"silu": (1, True), "gelu_tanh": (2, True), "swigluoai": (4, True), "silu_no_mul": (1, False),
               "gelu_tanh_no_mul": (2, False), "relu2_no_mul": (3, False)}


# -- schemes -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoeQuant:
    """What the kernels need of a scheme: element type, weight / activation scale granularity."""

    scheme: QuantScheme
    int8: bool
    w_gran: int  # G_TENSOR / G_ROW (channel) / G_BLOCK (128x128)
    a_gran: int  # G_TENSOR / G_ROW (token) / G_BLOCK (1x128 group)
    a_static: bool

    @property
    def per_step(self) -> bool:
        """Scales change along K (block weights or group activations): BLOCK_K must be 128."""
        return G_BLOCK in (self.w_gran, self.a_gran)

    @property
    def kind(self) -> str:
        """The launch tables' name of the scheme: element type, per-step scales, static activation scales
        (a program that quantizes dynamic activations itself first reads their amax: other launches win)."""
        base = "int8" if self.int8 else "fp8_block" if self.per_step else "fp8"
        return base + ("_static" if self.a_static else "")


@functools.lru_cache(maxsize=256)
def moe_quant(scheme: str) -> MoeQuant:
    """The :class:`MoeQuant` of a scheme key, or UnsupportedError naming what the kernels lack (kept per key:
    every layer call asks)."""
    spec = parse_scheme_key(scheme)
    w, a = spec.weight, spec.act
    fix = "use an FP8 W8A8 (fp8_e4m3 weights and activations) or INT8 W8A8 scheme"
    if w.dtype not in (QDtype.FP8_E4M3, QDtype.INT8) or a is None or a.dtype is not w.dtype:
        what = "weight-only" if a is None else f"{a.dtype.value} activations"
        raise UnsupportedError(f"scheme {scheme} ({w.dtype.value} weights, {what}) is not FP8 or INT8 W8A8",
                               where=OP, fix=fix)
    if (w.packing.value != "none" or w.zero_point or w.act_order or w.global_scale or w.tiled
            or w.scale.dtype is not ScaleDtype.FP32 or a.scale.dtype is not ScaleDtype.FP32
            or not a.symmetric or a.global_scale):
        raise UnsupportedError(f"scheme {scheme}: packed / zero-point / act-order / globally scaled weights or "
                               "non-fp32 scales are not run by the fused MoE kernels", where=OP, fix=fix)
    wg = {Granularity.TENSOR: G_TENSOR, Granularity.CHANNEL: G_ROW, Granularity.BLOCK: G_BLOCK}.get(w.scale.granularity)
    ag = {Granularity.TENSOR: G_TENSOR, Granularity.TOKEN: G_ROW, Granularity.GROUP: G_BLOCK}.get(a.scale.granularity)
    if wg is None or (wg == G_BLOCK and w.scale.block != (128, 128)):
        raise UnsupportedError(f"scheme {scheme}: weight scales {w.scale.key()} (tensor, channel or 128x128 blocks "
                               "expected)", where=OP)
    if ag is None or (ag == G_BLOCK and a.scale.group_size != 128) or (not a.dynamic and ag != G_TENSOR):
        raise UnsupportedError(f"scheme {scheme}: activation scales {a.key()} (static per tensor, or dynamic per "
                               "tensor, token or 1x128 group expected)", where=OP)
    int8 = w.dtype is QDtype.INT8
    if int8 and (wg == G_BLOCK or ag == G_BLOCK or (a.dynamic and ag == G_TENSOR)):
        raise UnsupportedError(f"scheme {scheme}: INT8 runs per-tensor / per-channel weights with static per-tensor "
                               "or dynamic per-token activations", where=OP)
    return MoeQuant(spec, int8, wg, ag, not a.dynamic)


# -- launch parameters -----------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1  # K split over programs (fp32 partials summed by the final reduction; GEMM 2 only)
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = True  # acc^T = W A^T: the weight tile is the MMA's M side
    fuse_quant: bool = True  # quantize A in the prologue instead of a separate kernel


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16
    per_pair: bool = False  # GEMM 1 (and 2): one program per (token, expert) pair, no alignment (decode)
    gemm1: GemmConfig = GemmConfig()
    gemm2: GemmConfig = GemmConfig()
    # GEMM 2: one program per token runs its k experts in turn and sums them (no top-k sum kernel)
    fold_topk: bool = False

    def to_dict(self) -> dict:
        return {"block_m": self.block_m, "per_pair": self.per_pair, "gemm1": vars(self.gemm1).copy(),
                "gemm2": vars(self.gemm2).copy(), "fold_topk": self.fold_topk}

    @staticmethod
    def from_dict(d: dict) -> MoeConfig:
        return MoeConfig(d["block_m"], d["per_pair"], GemmConfig(**d["gemm1"]), GemmConfig(**d["gemm2"]),
                         d.get("fold_topk", False))


_G = GemmConfig
# Winners of :func:`tune` on an H100 (their times against the rule's: docs/kernels-moe.md, "Launch configurations").
_SM90 = {
    "fp8/E128/H2048/I768/k8/T1":
        MoeConfig(1, True, _G(16, 1024, 1, 4, 2, True, True), _G(16, 256, 1, 4, 2, True, True), False),
    "fp8/E128/H2048/I768/k8/T2":
        MoeConfig(1, True, _G(32, 512, 1, 4, 1, True, True), _G(16, 512, 1, 4, 4, True, True), False),
    "fp8/E128/H2048/I768/k8/T4":
        MoeConfig(16, True, _G(64, 256, 1, 4, 2, True, False), _G(64, 128, 1, 4, 4, True, False), False),
    "fp8/E128/H2048/I768/k8/T8":
        MoeConfig(1, True, _G(32, 512, 1, 4, 2, False, False), _G(32, 256, 1, 4, 5, True, True), False),
    "fp8/E128/H2048/I768/k8/T16":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(128, 128, 1, 4, 4, True, False), False),
    "fp8_block/E128/H2048/I768/k8/T1":
        MoeConfig(16, True, _G(64, 128, 1, 4, 5, True, False), _G(64, 128, 1, 4, 4, False, False), False),
    "fp8_block/E128/H2048/I768/k8/T2":
        MoeConfig(1, True, _G(16, 128, 1, 4, 3, True, False), _G(32, 128, 1, 4, 5, True, True), False),
    "fp8_block/E128/H2048/I768/k8/T4":
        MoeConfig(1, True, _G(64, 128, 1, 4, 5, True, True), _G(128, 128, 1, 4, 1, True, True), False),
    "fp8_block/E128/H2048/I768/k8/T8":
        MoeConfig(16, True, _G(64, 128, 1, 4, 5, True, False), _G(64, 128, 1, 4, 1, True, False), False),
    "fp8_block/E128/H2048/I768/k8/T16":
        MoeConfig(16, True, _G(64, 128, 1, 4, 5, True, False), _G(64, 128, 1, 4, 3, True, False), False),
    "fp8_static/E128/H2048/I768/k8/T1":
        MoeConfig(1, True, _G(8, 1024, 1, 4, 1, False, True), _G(16, 256, 1, 8, 4, True, False), False),
    "fp8_static/E128/H2048/I768/k8/T2":
        MoeConfig(1, True, _G(16, 512, 1, 4, 5, False, True), _G(16, 256, 1, 2, 1, True, False), False),
    "fp8_static/E128/H2048/I768/k8/T4":
        MoeConfig(1, True, _G(16, 512, 1, 4, 5, True, True), _G(32, 256, 1, 4, 3, True, False), False),
    "fp8_static/E128/H2048/I768/k8/T8":
        MoeConfig(1, True, _G(16, 512, 1, 4, 2, False, True), _G(32, 256, 1, 4, 4, False, False), False),
    "fp8_static/E128/H2048/I768/k8/T16":
        MoeConfig(1, True, _G(16, 512, 1, 4, 2, False, True), _G(32, 256, 1, 4, 5, True, False), False),
    "int8/E128/H2048/I768/k8/T1":
        MoeConfig(1, True, _G(8, 512, 1, 4, 2, True, True), _G(32, 256, 1, 8, 4, True, True), False),
    "int8/E128/H2048/I768/k8/T2":
        MoeConfig(1, True, _G(16, 512, 1, 4, 2, False, True), _G(128, 256, 1, 8, 4, False, True), False),
    "int8/E128/H2048/I768/k8/T4":
        MoeConfig(1, True, _G(16, 512, 1, 4, 2, False, False), _G(64, 256, 1, 4, 2, True, True), False),
    "int8/E128/H2048/I768/k8/T8":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(128, 128, 1, 4, 4, True, False), False),
    "int8/E128/H2048/I768/k8/T16":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(64, 128, 1, 4, 3, True, False), False),
    "fp8/E8/H4096/I14336/k2/T1":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(64, 256, 2, 4, 4, True, False), False),
    "fp8/E8/H4096/I14336/k2/T4":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(64, 256, 1, 4, 4, True, False), False),
    "fp8_static/E8/H4096/I14336/k2/T1":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(64, 256, 2, 4, 4, True, False), False),
    "fp8_static/E8/H4096/I14336/k2/T4":
        MoeConfig(16, True, _G(64, 256, 1, 4, 3, True, False), _G(64, 256, 1, 4, 4, True, False), False),
}
# {arch: {config_key: MoeConfig.to_dict()}}, looked up after the on-disk cache
TUNED: dict[str, dict[str, dict]] = {"sm_90": {key: cfg.to_dict() for key, cfg in _SM90.items()}}


def config_key(kind: str, e: int, h: int, i: int, k: int, t: int, gated: bool = True) -> str:
    """The table key: scheme kind (:attr:`MoeQuant.kind`), shape, top-k, tokens rounded up to a power of 2."""
    return f"{kind}/E{e}/H{h}/I{i}/k{k}/T{1 << max(0, (t - 1).bit_length())}" + ("" if gated else "/nogate")


# one-row per-pair programs: the rule's launch where every pair has an expert of its own, and tuning's start
ROW_GEMM = GemmConfig(16, 512, 1, 4, 2, True, True)


def default_config(q: MoeQuant, e: int, h: int, i: int, k: int, t: int, num_sms: int = 132) -> MoeConfig:
    """The rule without measurements. FP8 with a static activation scale, when the pairs spread evenly
    would give every pair an expert of its own (T·k <= E): one program per pair and column tile of 16 on
    the CUDA cores (:data:`ROW_GEMM`; on an H100 it beat the aligned tiles by 3–20 % at T = 1 and 4 on four
    expert shapes no table covers, and lost at 1.5 and more rows per expert: docs/kernels-moe.md). Else
    :func:`aligned_config`."""
    if q.a_static and not q.int8 and not q.per_step and t * k <= e:
        return MoeConfig(1, True, ROW_GEMM, ROW_GEMM, False)
    return aligned_config(q, e, h, i, k, t, num_sms)


def aligned_config(q: MoeQuant, e: int, h: int, i: int, k: int, t: int, num_sms: int = 132) -> MoeConfig:
    """Pairs aligned per expert in 16- to 128-row tiles, activations quantized once by a separate kernel
    (measured faster than quantizing in every program's prologue on tensor-core tiles). Per-pair decode
    programs, which tuning picked in every decode cell it ran on an H100, come from the tables. With 16 / 32
    rows (decode) the weights are the MMA's M side, GEMM 1 takes narrower column tiles and GEMM 2 a split
    over K when that leaves SMs idle. Per-step (128-block) scales in 64-row tiles take GEMM 1 tiles of 128
    columns (the fastest tiles of a grid timed on an H100: docs/benchmarks.md)."""
    p = t * k
    rows = p / max(1, min(e, p))  # rows per active expert
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 96 else 128
    small = bm <= 32
    blocks = min(e, p) * math.ceil(rows / bm)
    # (sm_90 with ptxas: 8 warps keep 64-128 row tiles below 255 registers, block scales included)
    warps, stages = (4, 4) if small else (8, 3)
    bn1 = 64 if not small or blocks * math.ceil(i / 64) >= num_sms else 32
    if q.per_step and bm == 64:
        bn1 = 128
    g1 = GemmConfig(bn1, 128, 1, warps, stages, small, False)
    bn2 = 64 if small else 128
    split = 1
    while small and blocks * math.ceil(h / bn2) * split < 2 * num_sms and i // (2 * split) >= 512:
        split *= 2
    g2 = GemmConfig(bn2, 128, split, warps, stages, small, False)
    return MoeConfig(bm, False, g1, g2, False)


def normalize_config(cfg: MoeConfig, q: MoeQuant, gated: bool) -> MoeConfig:
    """``cfg`` made valid for the scheme: 128-wide K steps under per-step scales, no split of a gated
    GEMM 1, 16-row tiles per pair (or one row: products on the CUDA cores), separate quantization for
    dynamic per-tensor scales."""
    fuse_ok = q.a_static or q.a_gran != G_TENSOR

    def fix(g: GemmConfig, split_ok: bool) -> GemmConfig:
        return GemmConfig(g.block_n, 128 if q.per_step else g.block_k, g.split_k if split_ok else 1, g.num_warps,
                          g.num_stages, g.swap, g.fuse_quant and fuse_ok)

    block_m = (1 if cfg.block_m == 1 else 16) if cfg.per_pair else cfg.block_m
    return MoeConfig(block_m, cfg.per_pair, fix(cfg.gemm1, not gated), fix(cfg.gemm2, True), cfg.fold_topk)


_CACHE: dict[Path, dict] = {}


def cache_path() -> Path:
    """Where :func:`tune` keeps its winners, {GPU name: {config_key: config}}: ``$QCOMPILE_MOE_CONFIGS``,
    else ``$XDG_CACHE_HOME/qcompile/fused_moe.json`` (``~/.cache`` without XDG_CACHE_HOME)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qcompile" / "fused_moe.json"


def device_name(device: torch.device) -> str:
    """The cache's key of a device: the GPU's name, or "interpreter" off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"


def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _read_cache(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read the tuned configurations: {exc}", where=str(path),
                          fix=f"make it readable, or point {CACHE_ENV} elsewhere") from None
    try:
        data = json.loads(text)
        for entries in data.values():
            for d in entries.values():
                MoeConfig.from_dict(d)
    except (ValueError, AttributeError, TypeError, KeyError) as exc:
        raise ConfigError(f"the tuned configurations are not valid ({type(exc).__name__}: {exc})", where=str(path),
                          fix="delete the file (fused_moe.tune() writes it again)") from None
    return data


def cached_entries(device: torch.device) -> dict[str, dict]:
    """This device's tuned configurations on disk, {config_key: MoeConfig.to_dict()}: the form of a
    ``TUNED[arch]`` table entry."""
    path = cache_path()
    if path not in _CACHE:
        _CACHE[path] = _read_cache(path)
    return _CACHE[path].get(device_name(device), {})


def save_config(device: torch.device, key: str, cfg: MoeConfig) -> Path:
    """Add ``key -> cfg`` for this device to the on-disk cache (other entries kept)."""
    path = cache_path()
    data = _read_cache(path)
    data.setdefault(device_name(device), {})[key] = cfg.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # readers never see half a file
    _CACHE[path] = data
    get_config.cache_clear()
    return path


@functools.lru_cache(maxsize=1024)
def get_config(q: MoeQuant, e: int, h: int, i: int, k: int, t: int, gated: bool, device: torch.device) -> MoeConfig:
    """The tuned config of this device (on-disk cache), else the ``TUNED`` table, else :func:`default_config`."""
    key = config_key(q.kind, e, h, i, k, t, gated)
    found = cached_entries(device).get(key) or TUNED.get(_arch(device), {}).get(key)
    if found is not None:
        cfg = MoeConfig.from_dict(found)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        cfg = default_config(q, e, h, i, k, t, sms)
    return normalize_config(cfg, q, gated)


# (block_m, per_pair) row layouts tuning starts from; block_m 1: one pair per program on the CUDA cores
TUNE_LAYOUTS = ((1, True), (16, True), (16, False), (32, False), (64, False), (128, False))
TUNE_AXES = {"block_n": (8, 16, 32, 64, 128), "block_k": (128, 256, 512, 1024), "num_stages": (1, 2, 3, 4, 5),
             "num_warps": (2, 4, 8), "swap": (True, False), "fuse_quant": (True, False), "split_k": (1, 2, 4, 8)}


def tune(e: int, h: int, i: int, k: int, t: int, scheme: str, activation: str = "silu", dtype=torch.bfloat16,
         save: bool = True, calls: int = 20, replays: int = 10, routings: int = 8, log=print) -> MoeConfig:
    """Time :func:`fused_moe` configurations on this GPU with CUDA graphs: :func:`get_config` and each row
    layout of :data:`TUNE_LAYOUTS`, then the top-k fold and each GEMM's parameters one at a time
    (coordinate descent) from the fastest of :func:`get_config` and the tensor-core layouts, and from the
    one-row layout; the fastest is returned and (``save``) written to :func:`cache_path` for this GPU.
    ``t`` stands for the tokens its power of 2 covers. The calls cycle through ``routings`` seeded routings,
    so that the experts are read from memory as a model's layers read them, not from L2."""
    if not torch.cuda.is_available():
        raise UnsupportedError("tune times the kernels on a CUDA GPU and this machine has none", where="fused_moe tune",
                               fix="run it on the GPU that will run the model")
    from ..bench import graph_time_us
    from .moe_triton import fused_moe, make_moe_inputs

    q = moe_quant(scheme)
    gated = ACTIVATIONS[activation][1]
    args = make_moe_inputs(scheme, e, h, i, k, t, activation, dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    routed = [args["topk_ids"]] + [torch.rand(t, e, generator=gen, device="cuda").argsort(1)[:, :k].to(torch.int32)
                                   for _ in range(routings - 1)]
    timed: dict[MoeConfig, float] = {}

    def time_of(cfg: MoeConfig) -> float:
        cfg = normalize_config(cfg, q, gated)
        if cfg not in timed:
            cycle = itertools.cycle([dict(args, topk_ids=ids) for ids in routed])
            try:
                timed[cfg] = graph_time_us(lambda: fused_moe(**next(cycle), config=cfg), calls, replays)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is skipped
                torch.cuda.synchronize()
                timed[cfg] = math.inf
                log(f"  skipped {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return timed[cfg]

    def descend(best: MoeConfig) -> MoeConfig:
        best = min((best, replace(best, fold_topk=not best.fold_topk)), key=time_of)
        for gemm in ("gemm1", "gemm2"):
            for field, values in TUNE_AXES.items():
                for v in values:
                    best = min((best, replace(best, **{gemm: replace(getattr(best, gemm), **{field: v})})),
                               key=time_of)
        return best

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = aligned_config(q, e, h, i, k, t, sms)
    layouts = [MoeConfig(bm, per_pair, ROW_GEMM if bm == 1 else replace(d.gemm1, swap=bm < 64),
                         ROW_GEMM if bm == 1 else replace(d.gemm2, swap=bm < 64), False)
               for bm, per_pair in TUNE_LAYOUTS]
    mma = min([get_config(q, e, h, i, k, t, gated, torch.device("cuda"))] + layouts[1:], key=time_of)
    best = normalize_config(min(descend(mma), descend(layouts[0]), key=time_of), q, gated)
    log(f"fused_moe {config_key(q.kind, e, h, i, k, t, gated)}: {timed[best]:.1f} us with {best} "
        f"({len(timed)} configurations timed)")
    if save:
        log(f"saved to {save_config(torch.device('cuda'), config_key(q.kind, e, h, i, k, t, gated), best)}")
    return best
