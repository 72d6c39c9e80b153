"""The one kernel registry.

Each :class:`Kernel` is data: the custom op it lowers to, the backend string that op dispatches on,
a priority, and a ``check`` that answers ``None`` (can run) or a reason (cannot). :func:`select`
applies an explicit override, then priority, and returns every rejected kernel's reason so the
explain table can say why a faster kernel was not used.

Kernels come in op families, their ``kind``: ``"linear"`` (one quantized matmul, reference
``qcompile::linear_ref``) and ``"experts"`` (a layer of routed MoE experts, reference
``qcompile::experts_ref``). :func:`select` considers only the kernels of the query's kind. Kernel ops
share their family's reference-op argument names (``x, weight, weight_scale, ...``; ``hidden_states,
top_k_index, w13_weight, ...``) plus ``scheme: str`` and ``backend: str``; the lowering passes fill
them by name from the op schema, so a new kernel needs no lowering code of its own.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import UnsupportedError
from ..scheme import QuantScheme


KINDS = ("linear", "experts")


def unknown_backend(op: str, backend: str, backends) -> UnsupportedError:
    """The error an op raises when called with a ``backend`` it does not have."""
    return UnsupportedError(f"unknown {op.split('::')[-1]} backend {backend!r}", where=op,
                            fix=f"use one of {backends}")


@dataclass(frozen=True)
class KernelQuery:
    """What a kernel is asked to run. For ``kind="experts"``, ``n`` / ``k`` are the fused gate + up
    projection's [2I, H] (the down projection is [H, I]), with ``num_experts`` (E), ``top_k`` and the
    number of ``tokens`` when the graph knows it (None when dynamic)."""

    scheme: QuantScheme
    device: str  # "cpu" | "cuda" | ...
    capability: tuple[int, int] | None  # CUDA compute capability, None off-CUDA
    n: int  # out_features
    k: int  # in_features
    act_dtype: torch.dtype = torch.bfloat16
    kind: str = "linear"
    num_experts: int = 0
    top_k: int = 0
    tokens: int | None = None
    activation: str = ""  # experts: the gated activation ("silu", "swigluoai:<alpha>:<limit>", ...)
    compiler: str = "inductor"  # the compiler the lowered graph goes to (the backend's inner compiler)


@dataclass(frozen=True)
class Kernel:
    name: str
    op: str  # "qcompile::fp8_linear"
    backend: str  # passed to the op's `backend` argument
    priority: int  # higher wins
    check: Callable[[KernelQuery], str | None]
    description: str = ""
    requires: tuple[str, ...] = field(default=())  # python modules that must import (e.g. "flashinfer")
    act_dtypes: tuple[torch.dtype, ...] | None = None  # activation dtypes the op takes; None: any
    # What the kernel computes: None when it runs ``scheme``'s math, else why not. A kernel that computes
    # something else is not a faster kernel passed over, so the explain table leaves it out.
    computes: Callable[[QuantScheme], str | None] | None = None
    kind: str = "linear"  # the op family (KINDS)
    # The op quantizes activations itself at run time, so it has no activation-scale arguments and is not a
    # weight-only kernel for all that (the passes' weight-only warning reads the op's arguments otherwise).
    quantizes_acts: bool = False
    # Weight layouts the kernel wants made once at a GPU load, applied in this order by the layer modules (which
    # know how, and undo them for saving): "ksorted" (act-order columns sorted by group where g_idx allows),
    # "tiled" (wo_mma's streaming order).
    layouts: tuple[str, ...] = ()

    def reason_not(self, q: KernelQuery) -> str | None:
        why = self.computes(q.scheme) if self.computes else None
        if why:
            return why
        for mod in self.requires:
            if not module_available(mod):
                return f"{mod} is not installed"
        return act_dtype_reason(q, self.act_dtypes) or self.check(q)


_KERNELS: dict[tuple[str, str], Kernel] = {}  # (kind, name) -> kernel: a name is unique within its kind


def register(kernel: Kernel) -> Kernel:
    if kernel.kind not in KINDS:
        raise AssertionError(f"kernel {kernel.name} has unknown kind {kernel.kind!r}")
    if (kernel.kind, kernel.name) in _KERNELS:
        raise AssertionError(f"kernel {kernel.name} ({kernel.kind}) registered twice")
    _KERNELS[kernel.kind, kernel.name] = kernel
    return kernel


def kernels(kind: str | None = None) -> list[Kernel]:
    """The registered kernels of ``kind`` (all kinds: None), best priority first."""
    _load_builtin()
    return sorted((k for k in _KERNELS.values() if kind is None or k.kind == kind), key=lambda k: -k.priority)


_AVAILABLE: dict[str, bool] = {}


def module_available(name: str) -> bool:
    if name not in _AVAILABLE:
        _AVAILABLE[name] = importlib.util.find_spec(name) is not None
    return _AVAILABLE[name]


@dataclass
class Selection:
    kernel: Kernel
    rejected: list[tuple[str, str]]  # (kernel name, reason) of better-priority kernels passed over

    @property
    def reason(self) -> str:
        return "; ".join(f"{n}: {r}" for n, r in self.rejected)


def select(q: KernelQuery, override: str | dict[str, str] | None = None, module: str = "") -> Selection:
    """Pick the kernel for ``q`` among the kernels of its kind. ``override``: a kernel name for every
    layer whose kind has a kernel of that name, or ``{module glob: kernel name}``. An override that
    cannot run is an error, never a silent fallback."""
    candidates = kernels(q.kind)
    forced = _override_for(override, module, q.kind)
    if forced is not None:
        kernel = {k.name: k for k in candidates}.get(forced)
        if kernel is None:
            raise UnsupportedError(f"kernel override {forced!r} names no {q.kind} kernel",
                                   where=module or "options.kernels",
                                   fix=f"use one of {[k.name for k in candidates]} for {q.kind} layers")
        why = kernel.reason_not(q)
        if why:
            raise UnsupportedError(f"kernel override {forced!r} cannot run {q.scheme.key} here: {why}",
                                   where=module or "options.kernels", fix="drop the override or pick another kernel")
        return Selection(kernel, [])
    rejected, unrelated = [], []
    for kernel in candidates:
        if kernel.computes and kernel.computes(q.scheme):
            unrelated.append((kernel.name, kernel.computes(q.scheme)))
            continue
        why = kernel.reason_not(q)
        if why is None:
            return Selection(kernel, rejected)
        rejected.append((kernel.name, why))
    detail = "; ".join(f"{n}: {r}" for n, r in rejected + unrelated)
    raise UnsupportedError(
        f"no {q.kind} kernel runs {q.scheme.key} on {q.device} (N={q.n}, K={q.k}): {detail}",
        where=module or "kernel selection",
        fix="this format is parsed but not runnable yet; see docs/formats.md for what runs today",
    )


def _override_for(override, module: str, kind: str) -> str | None:
    """The kernel name ``override`` forces on ``module``: a plain name applies to every layer of a kind
    that has a kernel of that name (an error when no kind has one); a ``{glob: name}`` entry to the
    modules it matches."""
    if override is None:
        return None
    if isinstance(override, str):
        if any(k.name == override for k in kernels(kind)):
            return override
        if any(k.name == override for k in kernels()):
            return None  # a kernel of another family: leaves this layer alone
        raise UnsupportedError(f"kernel override {override!r} names no kernel", where="options.kernels",
                               fix=f"use one of {sorted({k.name for k in kernels()})}")
    for pattern, name in override.items():
        if fnmatch.fnmatchcase(module, pattern):
            return name
    return None


def cuda_reason(q: KernelQuery, min_capability: tuple[int, int]) -> str | None:
    """The shared device requirements of CUDA kernels: a CUDA device of at least ``min_capability``
    and bf16 / fp16 activations. None when met, else what is missing."""
    if q.device != "cuda":
        return f"needs a CUDA device, have {q.device}"
    if q.capability is None or tuple(q.capability) < min_capability:
        have = "none" if q.capability is None else f"{q.capability[0]}.{q.capability[1]}"
        return f"needs compute capability >= {min_capability[0]}.{min_capability[1]}, have {have}"
    return act_dtype_reason(q, HALF)


HALF = (torch.bfloat16, torch.float16)
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def act_dtype_reason(q: KernelQuery, dtypes: tuple[torch.dtype, ...] | None) -> str | None:
    """None when ``dtypes`` (None: any) has the query's activation dtype, else the reason."""
    if dtypes is None or q.act_dtype in dtypes:
        return None
    return f"needs {'/'.join(_SHORT.get(d, str(d)) for d in dtypes)} activations, have {q.act_dtype}"


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


_LOADED = False


def _load_builtin():
    """Import the kernel modules once; each registers its kernels at import."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from . import reference  # noqa: F401  (registers the reference kernel)
    from . import experts_ref  # noqa: F401  (the experts reference kernel)
    from . import moe_triton  # noqa: F401  (the fused MoE kernel)
    from . import moe_wo  # noqa: F401  (the weight-only MoE kernel)
    from . import moe_cpu4  # noqa: F401  (W4A8-int experts on the CPU)
    from . import fp8  # noqa: F401
    from . import int8  # noqa: F401
    from . import wo_gemm  # noqa: F401
    from . import nvfp4  # noqa: F401
