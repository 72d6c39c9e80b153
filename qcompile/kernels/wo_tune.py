"""Launch choices of ``qcompile::wo_linear``'s ``mma`` backend measured per shape on the running GPU.

A choice is keyed by (format, x dtype, N, K, M bucket) and kept per GPU name. The op looks one up in this
order: the on-disk cache (``$XDG_CACHE_HOME/qcompile/tuned/<GPU name>.json``; ``QCOMPILE_TUNE_CACHE`` names
another folder, or ``0`` for none), then the table shipped with the package (``qcompile/kernels/tuned/<GPU
name>.json``), then the hand-written policy (:mod:`wo_policy`). A choice is a route: the policy itself, the
kernel with some of its launch fixed (the keywords of :func:`wo_mma.wo_mma`), the Triton kernel, or
dequantize + F.linear (cuBLAS) where that is faster. The same tables hold ``qcompile::fp8_gemv``'s choices (keys
``fp8_gemv|<N>x<K>|m<M>``, routes ``gemv`` with its launch or ``scaled_mm``: :mod:`fp8_gemv`).

Measuring at first use is off by default: ``QCOMPILE_TUNE=1`` or :func:`tune` turns it on. It never runs while
a CUDA graph is captured, under torch.compile's tracing or on fake tensors (the lookup still does).
``benchmarks/tune_wo.py`` measures a list of shapes and writes the shipped table.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError
from ..scheme import QuantScheme, WeightSpec
from . import cuda_driver, wo_policy

log = logging.getLogger("qcompile")
SHIPPED = Path(__file__).with_name("tuned")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
# T buckets of qcompile::wo_moe's keys: M's, then prefill chunks up to 16384 tokens, where the faster of the grouped
# Triton kernel and dequantize + _grouped_mm depends on the experts' shape
MOE_T_BUCKETS = M_BUCKETS + (2048, 4096, 8192, 16384)
ROUTES = ("policy", "mma", "triton", "dequant", "gemv", "scaled_mm")
# wo_mma keywords tried beside the policy's own launch (those the kernel has no build for, or that come to
# the policy's launch, are dropped per shape)
MMA_VARIANTS = ({"wgmma": True}, {"wgmma": False}, {"ws": True}, {"ws": False}, {"xs": True}, {"xs": False},
                {"rt": 2}, {"kw": 2}, {"kw": 4, "warps": 16}, {"split": 1}, {"max_cluster": 1})


@dataclass(frozen=True)
class Choice:
    """How the op runs one (format, shape, M bucket): ``route`` one of :data:`ROUTES`; ``launch`` the wo_mma
    keywords of route ``mma`` (of ``gemv``: the Triton launch)."""

    route: str
    launch: dict = field(default_factory=dict)  # JSON values (wo_moe: a Triton configuration per GEMM)

    def __hash__(self):
        return hash((self.route, json.dumps(self.launch, sort_keys=True)))

    def to_json(self) -> dict:
        return {"route": self.route, "launch": self.launch} if self.launch else {"route": self.route}

    @classmethod
    def from_json(cls, d: dict) -> Choice | None:
        """The choice an entry holds, or None for one this version does not know (it is skipped)."""
        route, launch = d.get("route"), d.get("launch", {})
        if route not in ROUTES or not isinstance(launch, dict):
            return None
        return cls(route, dict(launch))


# -- keys and files --------------------------------------------------------------------------------

def m_bucket(m: int, buckets: tuple[int, ...] = M_BUCKETS) -> int | None:
    """The smallest of ``buckets`` >= ``m``; None above the last (the policy decides there)."""
    return next((b for b in buckets if m <= b), None)


def key_of(spec: WeightSpec, x_dtype: torch.dtype, n: int, k: int, m: int) -> str | None:
    """``<scheme key>|<x dtype>|<N>x<K>|m<bucket>``; None above the last bucket."""
    b = m_bucket(m)
    return None if b is None else _key(spec, x_dtype, f"{n}x{k}", f"m{b}")


@functools.lru_cache(maxsize=4096)  # asked on every call
def _key(spec: WeightSpec, x_dtype: torch.dtype, shape: str, bucket: str) -> str:
    return f"{QuantScheme(spec).key}|{str(x_dtype).removeprefix('torch.')}|{shape}|{bucket}"


def moe_key(spec: WeightSpec, x_dtype: torch.dtype, e: int, topk: int, n1: int, h: int, i: int, t: int) -> str | None:
    """Key of a ``qcompile::wo_moe`` layer call (E experts, top-k, w13 [n1, h], w2 [h, i], T tokens):
    ``<scheme key>|<x dtype>|moe E<e> k<topk> <n1>x<h> <h>x<i>|t<bucket>`` (:data:`MOE_T_BUCKETS`); None above the
    last bucket."""
    b = m_bucket(t, MOE_T_BUCKETS)
    return None if b is None else _key(spec, x_dtype, f"moe E{e} k{topk} {n1}x{h} {h}x{i}", f"t{b}")


def file_name(gpu_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3.json``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", gpu_name).strip("_") + ".json"


def cache_dir() -> Path | None:
    """The folder of the on-disk cache, or None where ``QCOMPILE_TUNE_CACHE=0`` turns it off."""
    env = os.environ.get("QCOMPILE_TUNE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "false", "no") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qcompile" / "tuned"


def _entries(path: Path) -> dict:
    """The raw entries of the table file at ``path`` (key -> JSON object); {} where it is missing. A file that is
    not such a table raises ConfigError naming it."""
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
        if not isinstance(entries, dict):
            raise TypeError("entries is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"not a qcompile tuning table ({type(e).__name__}: {e})", where=str(path),
                          fix="delete the file, or point QCOMPILE_TUNE_CACHE at another folder") from e
    return entries


def read_table(path: Path) -> dict[str, Choice]:
    """Key -> choice of one table file; {} where it is missing. A file that is not such a table raises
    ConfigError naming it; entries of routes this version does not know are skipped."""
    out = {}
    for key, entry in _entries(path).items():
        choice = Choice.from_json(entry) if isinstance(entry, dict) else None
        if choice is not None:
            out[key] = choice
    return out


def write_table(path: Path, gpu_name: str, entries: dict[str, dict]) -> None:
    """Write ``entries`` (key -> choice JSON, with any figures beside it) as a table of ``gpu_name``;
    atomically (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"gpu": gpu_name, "entries": dict(sorted(entries.items()))}, indent=1) + "\n")
    tmp.replace(path)


def merge_table(path: Path, gpu_name: str, entries: dict[str, dict]) -> None:
    """Add ``entries`` to the table file at ``path`` (created where missing; its other entries kept, those of
    the same keys replaced). A file that is not a table raises ConfigError, as in :func:`read_table`."""
    write_table(path, gpu_name, {**_entries(path), **entries})


_TABLES: dict[tuple[str, str], dict[str, Choice]] = {}  # (where, GPU name) -> table


def table(where: str, gpu_name: str) -> dict[str, Choice]:
    """The table ``where`` ("shipped" or "cache") holds for ``gpu_name``, read once (:func:`clear`)."""
    folder = SHIPPED if where == "shipped" else cache_dir()
    if folder is None:
        return {}
    key = (str(folder), gpu_name)
    if key not in _TABLES:
        _TABLES[key] = read_table(folder / file_name(gpu_name))
    return _TABLES[key]


def lookup(gpu_name: str, key: str | None) -> Choice | None:
    """The choice for ``key``: the on-disk cache's, else the shipped table's, else None (the policy's)."""
    if key is None:
        return None
    return table("cache", gpu_name).get(key) or table("shipped", gpu_name).get(key)


def store(gpu_name: str, key: str, choice: Choice, figures: dict | None = None) -> None:
    """Add ``choice`` for ``key`` to the on-disk cache (nothing where it is off)."""
    folder = cache_dir()
    if folder is None:
        return
    merge_table(folder / file_name(gpu_name), gpu_name, {key: {**choice.to_json(), **(figures or {})}})
    _TABLES.pop((str(folder), gpu_name), None)


def clear() -> None:
    """Forget the tables read so far (they are read again at the next lookup)."""
    _TABLES.clear()


# -- when to measure -------------------------------------------------------------------------------

_ENABLED: bool | None = None


def tune(enabled: bool = True) -> None:
    """Measure the candidate launches of each new (format, shape, M bucket) at its first call and keep the
    fastest in the on-disk cache (``enabled=False``: only look choices up, the default unless
    ``QCOMPILE_TUNE=1``). Calls inside CUDA-graph capture or torch.compile tracing never measure."""
    global _ENABLED
    _ENABLED = enabled


def enabled() -> bool:
    if _ENABLED is not None:
        return _ENABLED
    return os.environ.get("QCOMPILE_TUNE", "0") == "1"


def can_measure(x: torch.Tensor) -> bool:
    """Timing is allowed now: a real CUDA tensor (not a fake one), no torch.compile tracing, no stream
    capture."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(x) or torch.compiler.is_compiling() or not x.is_cuda:
        return False
    return not torch.cuda.is_current_stream_capturing()


# -- measuring -------------------------------------------------------------------------------------

HOST_COVER_CYCLES = 2_000_000  # a GPU spin (about 1 ms) that hides the host's launch work from the events


def timer(fn, reps: int = 20) -> float:
    """Median GPU µs of ``fn`` with the L2 cache flushed before each call (weights come from memory, as in a
    model's forward). A spin kernel before the start event keeps the GPU busy while the host enqueues ``fn``,
    so the events time the kernels alone, as a CUDA-graph replay runs them (without it the op's Python launch
    work, tens of µs, would be timed too)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    flush = torch.empty(2 * max(props.L2_cache_size, 1 << 20), dtype=torch.uint8, device="cuda")
    fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_COVER_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def candidates(spec: WeightSpec, m: int, mma_ok: bool, triton_ok: bool, capability: tuple[int, int],
               decide=None) -> list[Choice]:
    """The routes to measure for ``m`` rows: the policy; the kernel with each of :data:`MMA_VARIANTS` that has
    a build and launches other than the policy (``decide(**keywords)``: the launch, ValueError where there is
    none); the Triton kernel; dequantize + F.linear."""
    out = [Choice("policy")]
    if mma_ok and decide is not None and m <= wo_policy.max_m(spec, capability) and spec.dtype.bits in (4, 8):
        seen = {decide()}
        for launch in MMA_VARIANTS:
            try:
                d = decide(**launch)
            except ValueError:
                continue
            if d not in seen:
                seen.add(d)
                out.append(Choice("mma", dict(launch)))
    if triton_ok:
        out.append(Choice("triton"))
    out.append(Choice("dequant"))
    return out


def _failures() -> tuple:
    """What a candidate that cannot run raises: a launch the GPU refuses, a Triton configuration that does
    not compile or fit."""
    try:
        from triton.errors import TritonError
    except ImportError:
        return RuntimeError, ValueError
    return RuntimeError, ValueError, TritonError


# Per-call timing in a CUDA graph (:func:`measure` with weight copies): calls per graph, and the copies' bytes together
COPY_BYTES = 256 << 20  # well over any L2, so that no call finds its weights there
MAX_COPIES = 16
GRAPH_CALLS = 20


def copies_for(nbytes: int, most: int | None = MAX_COPIES) -> int:
    """Copies of a call's weights (``nbytes`` each) that a graph-timed :func:`measure` cycles through: together
    over :data:`COPY_BYTES`, at least 2, at most ``most`` (the tuner's :data:`MAX_COPIES`: weights under about
    4 MB, whose 16 copies an H100's or H200's L2 holds most of, are timed partly from L2; the benchmarks: None)."""
    n = max(2, -(-COPY_BYTES // max(nbytes, 1)))
    return n if most is None else min(most, n)


# How far (normwise) a candidate's output may lie from the policy's: the routes round in bf16 in different orders
# (up to ~6e-3 apart on random experts); a wrong expert, scale, tile or K range errs by O(1)
MATCH_TOL = 2e-2
# Calls of each candidate on one input before it is timed: their outputs must be bit for bit equal (every route
# reduces its K splits in a fixed order), which a race between a kernel's warps rarely survives
CHECK_CALLS = 3


def output_check(call, reference: Choice = Choice("policy"), calls: int = CHECK_CALLS, tol: float = MATCH_TOL):
    """A :func:`measure` ``check``: ``call(choice)`` returns the op's output on one fixed input. A candidate passes
    when ``calls`` calls give bit-identical outputs within ``tol`` (normwise) of the ``reference`` choice's; otherwise
    the check returns why not (where the reference itself does not run: only whether the calls agree)."""
    try:
        ref = call(reference).float()
    except _failures():
        ref = None

    def check(c: Choice) -> str | None:
        outs = [call(c) for _ in range(calls)]
        if any(not torch.equal(outs[0], o) for o in outs[1:]):
            return f"its outputs differ between {calls} identical calls"
        if ref is None:
            return None
        err = float((outs[0].float() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= tol:  # (NaN too)
            return f"its output is {err:.3g} (normwise) from the {reference.route} route's"
        return None

    return check


def measure(choices: list[Choice], run, reps: int = 20, check=None) -> dict[Choice, float]:
    """µs of each choice; a choice that fails, or that ``check(choice)`` rejects (it returns why: see
    :func:`output_check`; logged as a warning), is left out. ``run(choice)`` runs the op that way: each choice is
    timed one call at a time with L2 flushed (:func:`timer`). ``run`` a list of such callables, each reading other
    weights (a copy of the call's weights, or the MoE call's pairs routed to other experts; :func:`copies_for`): per
    call in a CUDA graph of :data:`GRAPH_CALLS` back-to-back calls cycling through them, as a decode step runs the op
    (each call's start overlapping the previous one's end under programmatic dependent launch, its weights coming
    from memory), the median of ``reps // 2`` (at least 3) replays."""
    from ..bench import graph_time_us

    out = {}
    for c in choices:
        try:
            why = check(c) if check is not None else None
            if why:
                log.warning("qcompile: tuning leaves out %s: %s", json.dumps(c.to_json()), why)
                continue
            if isinstance(run, list):
                it = itertools.cycle(run)
                out[c] = graph_time_us(lambda c=c: next(it)(c), GRAPH_CALLS, max(reps // 2, 3))
            else:
                out[c] = timer(lambda c=c: run(c), reps)
        except _failures():
            torch.cuda.synchronize()
    return out


def best(times: dict[Choice, float]) -> Choice:
    """The fastest choice; the policy where it is within 1 % of that (a measured tie keeps the policy)."""
    fastest = min(times, key=times.get)
    policy = times.get(Choice("policy"))
    if policy is not None and policy <= 1.01 * times[fastest]:
        return Choice("policy")
    return fastest


def on_gpu(x: torch.Tensor) -> bool:
    """Choices apply to calls on a CUDA device."""
    return x.device.type == "cuda"


def gpu_name(x: torch.Tensor) -> str:
    return cuda_driver.device_name(cuda_driver.device_index(x.device))
