"""``qcompile::wo_moe``: a layer of routed MoE experts with weight-only quantized weights.

The weight-only formats of ``qcompile::wo_linear`` (int4 / int8 per tensor, channel or group, with zero
points or act-order ``g_idx``; NVFP4, MXFP4, MXFP8; NVFP4 / MX-activation schemes run weight-only on
GPUs without their GEMM, as dense linears do), stacked over experts as a ``QuantExperts`` holds them.
Arguments: those of ``qcompile::experts_ref`` (:mod:`experts_ref`) without the activation scales, plus
``backend``; the math is experts_ref's with the scheme's activation quantization dropped:

    h   = x_t @ dequantize(w13[e]).T + b13[e]            fp32
    a   = act(h)  (gated: act(h[:I]) * h[I:])           rounded to x.dtype
    y_t += r * (a @ dequantize(w2[e]).T + b2[e])         (apply_router_weight_on_input: r scales x_t)

``backend="triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), every size a function of T, k and E
(no host sync: CUDA-graph capturable):

1. ``moe_align`` (:mod:`moe_kernels`): the T·k (token, expert) pairs grouped per expert in blocks of
   BLOCK_M rows; pairs whose expert id is outside [0, E) are left out. On wo_mma's path one token needs no
   sort: each of its pairs is a block of its own.
2. GEMM 1: at decode sizes on CUDA, wo_mma's grouped build (:func:`wo_mma.grouped`: one launch over the
   blocks, weights decoded in registers, the x rows of each block's pairs; experts tiled at load,
   :func:`tile_for_mma`): fp32 h [T·k, N1], or with a gated activation step 3 fused (each CTA multiplies gate
   and up tiles of the same columns and writes the activations). Otherwise ``_wo_gemm_kernel`` in its GROUPED mode
   (:mod:`wo_gemm_triton`; each row block multiplies its expert's weights, decoded in registers, by the x
   rows of its pairs): fp32 h [split, T·k, N1], the bias added by the first K split.
3. ``_act_rows_kernel``: the splits summed and the activation (experts_ref.gated_activation's math) in
   fp32, rounded to x.dtype: one launch.
4. GEMM 2: GEMM 1's kernel on w2, bias and router weight (fp32 or x's dtype, read as it is) in its
   epilogue: fp32 [split, T·k, H]. wo_mma's build requests its weights before it waits for step 3.
5. ``_moe_sum_kernel``: each token's k pairs and the K splits summed in a fixed order (no atomics,
   deterministic), one rounding to x.dtype.

Path and launch (:func:`plan`): a measured choice from wo_tune's tables for the call's format, shape and T
bucket (measured at first use where tuning is on: :func:`tune_call`), else the rule: the grouped wo_mma
build up to :data:`MMA_MAX_ROWS` rows per active expert (:func:`mma_rule`, wo_policy.grouped_launch), the
Triton kernel on the dense kernel's table (``wo_gemm.pick_config``) for the expected rows per active
expert above, K split over the active experts' tiles, dequantize + ``torch._grouped_mm`` above
:data:`DEQUANT_ROWS`. ``backend="reference"`` (any device): the math above by
:func:`experts_ref.reference_experts`.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..scheme import Granularity, QuantScheme, WeightSpec, parse_scheme_key
from .experts_ref import (ACTIVATIONS, NON_GATED, ROLES, check_call, is_gated, reference_experts,
                          register_straight_through, split_activation)
from .fp8_quant_triton import HAS_TRITON, pdl, use_triton
from . import quant_math
from .moe_kernels import moe_align
from .registry import HALF, Kernel, KernelQuery, cuda_reason, register, unknown_backend
from . import wo_tune
from .wo_gemm import (_sm_count, dequantize_triton, fit_config, launch, layout_of, pick_config, splits,
                      triton_shape_reason, validate, wo_reason)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_quant_triton import _pdl_start
    from .moe_kernels import _epilogue, _moe_sum_kernel

    @triton.jit
    def _act_rows_kernel(h_ptr, a_ptr, N1, I, stride_hs, alpha, limit, ACT: tl.constexpr, GATED: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        # grid (pairs, cdiv(I, BLOCK)): a[p] = act(sum_s h[s, p, :I], sum_s h[s, p, I:]) in a's dtype; the K
        # splits summed in order, then the fused MoE's epilogue math (no bias: GEMM 1 added it)
        _pdl_start(PDL)
        p = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < I
        g = tl.zeros([BLOCK], dtype=tl.float32)
        u = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            row = h_ptr + s * stride_hs.to(tl.int64) + p * N1 + c  # (split x pairs x N1 may pass 2**31)
            g += tl.load(row, mask=ok, other=0.0)
            if GATED:
                u += tl.load(row + I, mask=ok, other=0.0)
        y = _epilogue(g, u, h_ptr, c, I, 1.0, alpha, limit, h_ptr, p, ok, ACT, GATED, False, False)
        tl.store(a_ptr + p * I + c, y.to(a_ptr.dtype.element_ty), mask=ok)

OP = "qcompile::wo_moe"
BACKENDS = ("reference", "triton")
# Rows per active expert above which every expert is dequantized once and torch._grouped_mm (cuBLAS-class
# bf16 GEMMs) runs the layer: the dense op's switch (wo_gemm.WO_MAX_M of int4 / int8).
DEQUANT_ROWS = 128
# Rows per active expert up to which the rule takes wo_mma's grouped build on CUDA (two 8-token tiles: where it beats
# the Triton kernel on tiled experts; the figures are in docs/kernels-moe.md). Blocks of 32 to 128 slots (the
# warp-specialized build) run where a measured choice says so.
MMA_MAX_ROWS = 16
PROJECTIONS = ("gate/up projection w13", "down projection w2")
# activation name (without _no_mul) -> the fused MoE kernels' activation code (moe_kernels._act_fn, _epilogue)
ACT_CODES = {"silu": 1, "gelu_tanh": 2, "relu2": 3, "swigluoai": 4, "gelu": 5}


def fuse_activation() -> bool:
    """Whether wo_mma's grouped build may fuse the gated activation into GEMM 1 (``QCOMPILE_MOE_FUSE=0``: a
    separate launch, as on the Triton kernel's path; a measured choice may also say ``"act": False``)."""
    return os.environ.get("QCOMPILE_MOE_FUSE", "1") != "0"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_inputs(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, spec: QuantScheme,
                  scheme: str) -> tuple[int, int, int]:
    """(E, I, k) after checking every tensor (experts_ref.check_call, then the weight-only format's tensors);
    UnsupportedError naming the tensor otherwise."""
    tensors = {"w13": w13, "w2": w2}
    return check_call(x, ids, weights, w13[0], w2[0], b13, b2, activation, OP, lambda p, k, e: validate(
        k, *tensors[p], spec, scheme, where=OP, lead=(e,), prefix=f"{p}_"))


# -- the Triton pipeline ---------------------------------------------------------------------------

def grouped_config(pairs: int, experts: int, n: int, k: int, spec, device) -> dict:
    """Launch configuration of one grouped GEMM: the dense table's entry for the rows each active expert
    gets when the pairs spread evenly, K split over the active experts' tiles (one BLOCK_M per T, k, E)."""
    active = min(experts, pairs)
    rows = -(-pairs // active)
    return pick_config(rows, n, k, layout_of(spec), _sm_count(device), groups=active)


def _grouped_gemm(a, a_div: int, tensors: tuple, bias, route, spec, cfg: dict, align, pairs: int) -> torch.Tensor:
    """fp32 [split, pairs, N]: per routed pair p of expert e (``align``: moe_align's blocks),
    a[p // a_div] @ dequantize(w[e]).T (+ bias[e] in the first split) (x route[p])."""
    weight = tensors[0]
    a = padded(a, spec)
    cfg = fit_config(cfg, a.shape[1], spec)
    out = torch.empty((splits(a.shape[1], cfg)[0], pairs, weight.shape[1]), dtype=torch.float32, device=a.device)
    sorted_ids, block_expert = align
    launch(a, *tensors, bias, spec, cfg, out, pairs, block_expert.numel(), ids_ptr=sorted_ids,
           experts_ptr=block_expert, route_ptr=route, A_DIV=a_div, ROUTE=route is not None)
    return out


def padded(a: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """``a`` [rows, K] with zero columns up to the K a tiled weight is stored with (scheme.canonical_shape), for
    the Triton GEMM, which reads x as wide as the weight; wo_mma's grouped build reads the zeros itself, the
    dequantize path multiplies the dequantized weight's first K columns."""
    kp = spec.stored_k(a.shape[1])
    return a if kp == a.shape[1] else F.pad(a, (0, kp - a.shape[1]))


def dequantizes(x: torch.Tensor, pairs: int, experts: int, rows: int = DEQUANT_ROWS) -> bool:
    """Whether :func:`wo_moe_triton` dequantizes every expert and runs ``torch._grouped_mm`` (bf16 x on
    sm_90 / sm_100, or the CPU under the interpreter): when the pairs, spread evenly, give each active
    expert more than ``rows`` rows. T, k and E decide: no host sync."""
    if x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    return -(-pairs // min(experts, pairs)) > rows


def mma_rule(x: torch.Tensor, pairs: int, experts: int) -> dict | None:
    """The rule's choice of the CUDA grouped GEMMs: wo_mma's grouped build with the policy's launches, in blocks
    of 8 pair slots (``{"block_m": 8}``) where the pairs, spread evenly, give each active expert up to 8 rows, of
    16 up to :data:`MMA_MAX_ROWS`; None (the Triton kernel) above, off CUDA and where ``QCOMPILE_MOE_MMA=0``."""
    if not x.is_cuda or os.environ.get("QCOMPILE_MOE_MMA", "1") == "0":
        return None
    rows = -(-pairs // min(experts, pairs))
    return {"block_m": 8} if rows <= 8 else {"block_m": 16} if rows <= MMA_MAX_ROWS else None


def _mma_launches(x, w13: tuple, w2: tuple, b13, b2, spec, i: int, mma: dict, pairs: int, activation: str = ""):
    """wo_mma's grouped launches of both GEMMs for an ``mma`` choice (``block_m``, and per GEMM optional
    ``warps`` / ``split`` / ``kw`` / ``rt``: :data:`MMA_AXES`; GEMM 1's ``act``), or None where either has none
    (the Triton kernel runs). GEMM 1's launch fuses a gated ``activation`` where it has such a launch, unless the
    choice's ``act`` is False or :func:`fuse_activation` says no."""
    from . import wo_mma

    if not x.is_cuda:
        return None
    e, h = w13[0].shape[0], x.shape[1]
    active, bm = min(e, pairs), mma["block_m"]
    fixed1 = dict(mma.get("gemm1", {}))
    name = split_activation(activation)[0]
    gact = ACT_CODES[name] if fixed1.pop("act", True) and fuse_activation() and name in ACTIVATIONS else 0

    def launch(w, b, k, fixed, **fused):
        return wo_mma.grouped_launch(x.dtype, x.device, w[0], w[2], w[3], b, spec.weight, k, bm, active, **fixed,
                                     **fused)

    k1, k2 = spec.weight.stored_k(h), spec.weight.stored_k(i)
    pad1, pad2 = k1 != h, k2 != i  # (x's rows narrower than the padded K)
    l1 = (gact and launch(w13, b13, k1, fixed1, gact=gact, xpad=pad1)) or launch(w13, b13, k1, fixed1, xpad=pad1)
    l2 = l1 and launch(w2, b2, k2, mma.get("gemm2", {}), xpad=pad2)
    return (l1, l2) if l2 else None


def tile_for_mma(spec: QuantScheme, w13: tuple, w2: tuple, h: int, i: int, x_dtype: torch.dtype):
    """(scheme, w13, w2) with every expert's weight permuted into the order wo_mma's grouped build streams
    (quant_math.tile_weight per expert; scheme ``tiled``), K of each projection padded to whole chunks where it
    is not (quant_math.pad_to_tiles: gpt-oss's 2880), or None where that build does not take both projections
    (wo_mma.mma_reason at the padded K) or the weights are tiled already. ``w13`` / ``w2``: each projection's
    (weight, scale, global scale, zero point, g_idx), returned the same way. The Triton kernels read either
    order."""
    from .wo_mma import mma_reason

    tiled = replace(spec.weight, tiled=True)
    zp, g = w13[3], tiled.scale.group_size if tiled.scale.granularity is Granularity.GROUP else 1
    if spec.weight.tiled or any(k % 8 or k % g or mma_reason(tiled, n, tiled.stored_k(k), x_dtype,
                                                             None if zp is None else zp.dtype)
                                for n, k in ((w13[0].shape[1], h), (h, i))):  # (x read 16 bytes wide, whole groups)
        return None
    out = [QuantScheme(tiled, spec.act)]
    for tensors, k in ((w13, h), (w2, i)):
        w, *rest = quant_math.pad_to_tiles(tuple(tensors), tiled, k)
        e, n = w.shape[:2]
        out.append((quant_math.tile_weight(w.reshape(e * n, -1), tiled).reshape(w.shape), *rest))
    return tuple(out)


def wo_moe_triton(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, spec, on_input: bool,
                  configs: tuple[dict, dict] | None = None, dequant_rows: int = DEQUANT_ROWS, mma: dict | None = None):
    """x [T, H], ids / weights [T, k]; w13 / w2 the five weight tensors of each projection in
    :data:`experts_ref.ROLES` order. The module doc's pipeline; ``configs`` (of GEMM 1, GEMM 2, one
    BLOCK_M) overrides :func:`grouped_config`; ``dequant_rows``: see :func:`dequantizes`; ``mma`` (on CUDA,
    :func:`_mma_launches`): the grouped GEMMs are wo_mma's grouped build, where it has a launch for both
    projections."""
    t, h = x.shape
    k, e = ids.shape[1], w13[0].shape[0]
    pairs = t * k
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out.zero_()
    n1 = w13[0].shape[1]
    i = n1 // 2 if is_gated(activation, OP) else n1
    flat_ids = ids.reshape(-1).contiguous()
    route = weights.reshape(-1).contiguous()
    x = x.contiguous()
    if on_input:  # each pair's copy of x scaled by its weight, rounded to x.dtype (experts_ref's order)
        x, a_div, route = (x.float().repeat_interleave(k, 0) * route.float()[:, None]).to(x.dtype), 1, None
    else:
        a_div = k
    launches = _mma_launches(x, w13, w2, b13, b2, spec, i, mma, pairs, activation) if mma and configs is None \
        else None
    if launches:
        from .wo_mma import grouped

        # one token: each pair is a block of its own (no sort launch; a top-k's experts are distinct), except on
        # the warp-specialized build (blocks above 16 slots), which gathers each block's rows
        align = flat_ids if t == 1 and not launches[0].cfg.ws else moe_align(flat_ids, e, mma["block_m"])
        _, alpha, limit = split_activation(activation)
        a = grouped(launches[0], x, a_div, *w13[:4], b13, spec.weight, align, pairs, None, alpha=alpha, limit=limit)
        if not launches[0].cfg.gact:
            a = activate(a.unsqueeze(0), activation, i, x.dtype)
        # GEMM 2 starts once every program of the kernel before it (the activation, or GEMM 1 with the activation
        # fused) has waited for the kernel before that, back to the sort or the ids: they are complete, and GEMM 2
        # requests its weights before it waits for the activations (ready)
        y = grouped(launches[1], a, 1, *w2[:4], b2, spec.weight, align, pairs, route, ready=True).unsqueeze(0)
    elif configs is None and dequantizes(x, pairs, e, dequant_rows):
        y = _dequantized_experts(x, a_div, flat_ids, route, w13, w2, b13, b2, activation, spec, i)
    else:
        cfg1, cfg2 = configs or (grouped_config(pairs, e, n1, h, spec.weight, x.device),
                                 grouped_config(pairs, e, h, i, spec.weight, x.device))
        align = moe_align(flat_ids, e, cfg1["BLOCK_M"])
        hid = _grouped_gemm(x, a_div, w13, b13, None, spec.weight, cfg1, align, pairs)
        y = _grouped_gemm(activate(hid, activation, i, x.dtype), 1, w2, b2, route, spec.weight, cfg2, align, pairs)
    block_h = min(_pow2(h), 512)
    _moe_sum_kernel[(t, triton.cdiv(h, block_h))](y, flat_ids, out, h, e, y.stride(0), TOPK=k, SPLIT=y.shape[0],
                                                  CHECK_IDS=True, BLOCK_H=block_h, num_warps=4, **pdl(out))
    return out


def activate(hid: torch.Tensor, activation: str, i: int, dtype: torch.dtype) -> torch.Tensor:
    """fp32 h [split, pairs, N1] -> act(h summed over the splits) [pairs, I] in ``dtype``: one launch
    (experts_ref.gated_activation's math in fp32, one rounding)."""
    name, alpha, limit = split_activation(activation)
    gated = not name.endswith("_no_mul")
    split, pairs, n1 = hid.shape
    out = torch.empty((pairs, i), dtype=dtype, device=hid.device)
    block = min(_pow2(i), 1024)
    _act_rows_kernel[(pairs, triton.cdiv(i, block))](hid, out, n1, i, hid.stride(0), alpha, limit,
                                                       ACT=ACT_CODES[name.removesuffix("_no_mul")], GATED=gated,
                                                       SPLIT=split, BLOCK=block, num_warps=4, **pdl(out))
    return out


def _dequantized_experts(x, a_div: int, flat_ids, route, w13: tuple, w2: tuple, b13, b2, activation: str, spec,
                        i: int) -> torch.Tensor:
    """The large-T path: every expert dequantized to bf16 (the Triton dequantize kernel), the pairs
    sorted by expert (no host sync), two ``torch._grouped_mm``; fp32 y [1, T·k, H] by pair, pairs of
    experts outside [0, E) left undefined (the top-k sum skips them)."""
    e, h = w13[0].shape[0], x.shape[1]
    valid = (flat_ids >= 0) & (flat_ids < e)
    expert = torch.where(valid, flat_ids, e)
    order = expert.argsort(stable=True)
    sorted_expert = expert[order]
    ends = torch.searchsorted(sorted_expert, torch.arange(e, device=x.device, dtype=sorted_expert.dtype), right=True)
    ends, sorted_expert = ends.to(torch.int32), sorted_expert.clamp(max=e - 1)

    def gemm(a, tensors, k, bias):
        w = dequantize_triton(*tensors[:2], spec.weight, tensors[2], tensors[3], tensors[4], spec.weight.stored_k(k),
                              torch.bfloat16)[..., :k]  # (a tiled weight's padded K: its first k columns)
        y = torch._grouped_mm(a, w.transpose(1, 2), offs=ends).float()
        return y if bias is None else y + bias[sorted_expert].float()

    hid = gemm(x[order // a_div], w13, h, b13)
    y = gemm(activate(hid.unsqueeze(0), activation, i, x.dtype), w2, i, b2)
    if route is not None:
        y = y * route[order].float()[:, None]
    return torch.empty_like(y).index_copy_(0, order, y).unsqueeze(0)


# -- launch choices measured per shape (wo_tune's on-disk cache and shipped tables) ------------------

TUNE_BLOCK_M = (16, 32, 64)  # shared by both GEMMs: one moe_align
# one GEMM's launch parameters; "words": BLOCK_K in int32 words (x the format's elements per word)
TUNE_AXES = {"BLOCK_N": (32, 64, 128), "words": (16, 32), "SPLIT_K": (1, 2, 4, 8, 16), "num_warps": (4, 8),
             "num_stages": (2, 3, 4), "SCALE_PREFETCH": (True, False), "X_PERMUTED": (True, False)}
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")  # a GEMM's, and optional:
CONFIG_FLAGS = ("SCALE_PREFETCH", "X_PERMUTED")
NO_DEQUANT = 1 << 62  # dequant_rows that keeps every call on the grouped kernel


MMA_BLOCK_M = (8, 16, 32, 64, 128)  # above 16: the warp-specialized build (sm_90, tiled experts)
# one grouped wo_mma GEMM's launch: warps per CTA, K split, warps per 16-row tile, tiles per warp (group), and whether
# the next kernel may launch from the start (wo_policy.grouped_launch's trig)
MMA_AXES = {"warps": (4, 8, 16), "split": (1, 2, 3, 4, 6, 8), "kw": (1, 2, 4), "rt": (1, 2), "trig": (False, True)}
MMA_ACT = (True, False)  # GEMM 1's "act": the gated activation fused into it, or a separate launch


def _mma_choice(launch: dict) -> bool:
    """A readable ``mma`` launch: ``block_m`` of :data:`MMA_BLOCK_M`, optional per-GEMM :data:`MMA_AXES` values
    (and GEMM 1's ``act``, :data:`MMA_ACT`)."""
    gemms = {g: launch.get(g, {}) for g in ("gemm1", "gemm2")}
    axes = {"gemm1": MMA_AXES | {"act": MMA_ACT}, "gemm2": MMA_AXES}
    return (launch.get("block_m") in MMA_BLOCK_M and set(launch) <= {"block_m", "gemm1", "gemm2"}
            and all(isinstance(c, dict) and all(v in axes[g].get(a, ()) and type(v) is type(axes[g][a][0])
                                                for a, v in c.items()) for g, c in gemms.items()))


def _route(choice: wo_tune.Choice | None, rule_mma: dict | None) -> tuple[tuple[dict, dict] | None, int, dict | None]:
    """(configs, dequant_rows, mma) of :func:`wo_moe_triton` for a choice: ``triton`` with its two GEMM
    configurations, ``mma`` (wo_mma's grouped build: ``block_m`` and per-GEMM launch parameters), ``dequant``
    (dequantize + ``_grouped_mm``), else (``policy``, none, or an entry this version cannot read) the rule,
    whose mma is ``rule_mma`` (:func:`mma_rule`)."""
    if choice is not None and choice.route == "mma" and _mma_choice(choice.launch):
        return None, NO_DEQUANT, choice.launch
    if choice is not None and choice.route == "triton":
        cfgs = tuple(choice.launch.get(g) for g in ("gemm1", "gemm2"))
        if all(isinstance(c, dict) and set(CONFIG_KEYS) <= set(c) <= set(CONFIG_KEYS + CONFIG_FLAGS)
               and all(isinstance(v, int) and v >= 0 for v in c.values()) for c in cfgs) \
                and cfgs[0]["BLOCK_M"] == cfgs[1]["BLOCK_M"]:  # one moe_align serves both GEMMs
            return cfgs, NO_DEQUANT, None
    if choice is not None and choice.route == "dequant":
        return None, 0, None
    return None, DEQUANT_ROWS, rule_mma


def _key(x, ids, w13: tuple, spec, i: int) -> str | None:
    return wo_tune.moe_key(spec.weight, x.dtype, w13[0].shape[0], ids.shape[1], w13[0].shape[1], x.shape[1], i,
                           x.shape[0])


def plan(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, spec, on_input: bool,
         i: int) -> tuple[tuple[dict, dict] | None, int, dict | None]:
    """How :func:`wo_moe_triton` runs this call on a GPU (:func:`_route`): the measured choice for its
    (format, shape, T bucket), measured now where tuning is on (:func:`wo_tune.tune`) and none is known, else
    the rule."""
    if not wo_tune.on_gpu(x):
        return None, DEQUANT_ROWS, None
    key = _key(x, ids, w13, spec, i)
    choice = wo_tune.lookup(wo_tune.gpu_name(x), key)
    if choice is None and key is not None and wo_tune.enabled() and wo_tune.can_measure(x):
        choice = wo_tune.best(tune_call(x, ids, weights, w13, w2, b13, b2, activation, spec, on_input, i))
    return _route(choice, mma_rule(x, ids.numel(), w13[0].shape[0]))


def _with(choice: wo_tune.Choice, gemm: str | None, field: str, value) -> wo_tune.Choice:
    """``choice`` with one launch parameter of one GEMM changed, or of both (``gemm`` None); ``block_m`` of an
    ``mma`` choice with ``gemm`` None."""
    launch = {g: dict(c) if isinstance(c, dict) else c for g, c in choice.launch.items()}
    if choice.route == "mma" and gemm is None:
        launch[field] = value
    for g in (gemm,) if gemm else () if choice.route == "mma" else ("gemm1", "gemm2"):
        launch.setdefault(g, {})[field] = value
    return wo_tune.Choice(choice.route, launch)


def expert_bytes(w13: tuple, w2: tuple) -> float:
    """Stored bytes of one expert (both projections' tensors as the op takes them: codes, scales, zero points, g_idx),
    the mean over the stacked experts."""
    return sum(t.numel() * t.element_size() for ws in (w13, w2) for t in ws if t is not None) / w13[0].shape[0]


def relabeled(ids: torch.Tensor, experts: int, count: int) -> list[torch.Tensor]:
    """``ids`` and ``count - 1`` copies of it with the experts renamed, each by its own seeded permutation: every
    expert's pairs stay together, other experts' weights are read. Ids outside [0, ``experts``) stay as they are."""
    g = torch.Generator().manual_seed(0)
    inside = (ids >= 0) & (ids < experts)
    safe = ids.clamp(0, experts - 1).long()
    return [ids] + [torch.where(inside, torch.randperm(experts, generator=g).to(ids.device)[safe].to(ids.dtype), ids)
                    for _ in range(count - 1)]


def tune_call(x, ids, weights, w13: tuple, w2: tuple, b13, b2, activation: str, spec, on_input: bool, i: int,
              reps: int = 20, keep: bool = True) -> dict:
    """µs of this call's candidate launches: the rule, dequantize + ``_grouped_mm``, and by coordinate descent from the
    rule's launches wo_mma's grouped build (where it has a launch: block_m, then each GEMM's :data:`MMA_AXES`, then
    whether GEMM 1 fuses the activation) and the Triton kernel (BLOCK_M of both GEMMs, then each GEMM's
    :data:`TUNE_AXES`), one axis at a time; each per call in a CUDA graph whose calls cycle through routings of the
    call's pairs onto other experts (:func:`relabeled`, as many as :func:`wo_tune.copies_for` the experts' bytes:
    their weights come from memory, as in a decode step), once its output on the call's own routing has passed
    :func:`wo_tune.output_check` (repeatable, and the rule's within its tolerance). With ``keep`` the fastest goes
    into wo_tune's on-disk cache under the call's T bucket."""
    epw = layout_of(spec.weight).epw
    pairs, e, n1, h = ids.numel(), w13[0].shape[0], w13[0].shape[1], x.shape[1]
    rule_mma = mma_rule(x, pairs, e)

    active = int(torch.unique(ids[(ids >= 0) & (ids < e)]).numel())
    run = [lambda c, r=r: wo_moe_triton(x, r, weights, w13, w2, b13, b2, activation, spec, on_input,
                                        *_route(c, rule_mma))
           for r in relabeled(ids, e, wo_tune.copies_for(int(active * expert_bytes(w13, w2))))]

    triton_start = wo_tune.Choice("triton", {"gemm1": grouped_config(pairs, e, n1, h, spec.weight, x.device),
                                             "gemm2": grouped_config(pairs, e, h, i, spec.weight, x.device)})
    mma_start = wo_tune.Choice("mma", {"block_m": 8})
    starts = [triton_start] + ([mma_start] if _mma_launches(x, w13, w2, b13, b2, spec, i, mma_start.launch, pairs)
                               else [])
    check = wo_tune.output_check(run[0])  # (the call's own routing)
    times = wo_tune.measure([wo_tune.Choice("policy"), wo_tune.Choice("dequant")] + starts, run, reps, check)

    def descend(best, axes):  # one axis at a time from ``best``: (axis, gemm or None, values)
        for field, gemm, values in axes:
            cands = [_with(best, gemm, field, v) for v in values]
            times.update(wo_tune.measure([c for c in cands if c not in times], run, reps, check))
            best = min((c for c in times if c in cands + [best]), key=times.get)

    if mma_start in times:
        descend(mma_start, [("block_m", None, MMA_BLOCK_M)] + [(f, g, v) for g in ("gemm1", "gemm2")
                                                                for f, v in MMA_AXES.items()]
                + [("act", "gemm1", MMA_ACT)])
    if triton_start in times:  # (any BLOCK_K runs: a partial last K step is masked)
        descend(triton_start, [("BLOCK_M", None, TUNE_BLOCK_M)] + [
            ("BLOCK_K" if f == "words" else f, g, tuple(v * epw for v in vals) if f == "words" else vals)
            for g in ("gemm1", "gemm2") for f, vals in TUNE_AXES.items()])
    if keep:
        key = _key(x, ids, w13, spec, i)
        choice = wo_tune.best(times)
        if key is not None:
            figures = {"us": round(times[choice], 2), "policy_us": round(times.get(wo_tune.Choice("policy"), 0.0), 2)}
            wo_tune.store(wo_tune.gpu_name(x), key, choice, figures)
    return times


def _weight_only_key(spec: QuantScheme) -> str:
    return QuantScheme(spec.weight).key


# -- the op ----------------------------------------------------------------------------------------

@torch.library.custom_op(OP, mutates_args=())
def wo_moe(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w13_weight_global_scale: torch.Tensor | None,
    w13_weight_zero_point: torch.Tensor | None,
    w13_weight_g_idx: torch.Tensor | None,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    w2_weight_global_scale: torch.Tensor | None,
    w2_weight_zero_point: torch.Tensor | None,
    w2_weight_g_idx: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    activation: str,
    scheme: str,
    apply_router_weight_on_input: bool = False,
    backend: str = "reference",
) -> torch.Tensor:
    """The experts layer of ``qcompile::experts_ref`` for weight-only schemes (module doc).
    ``backend``: "reference" (any device) or "triton" (CUDA, or CPU under the interpreter)."""
    if backend not in BACKENDS:
        raise unknown_backend(OP, backend, BACKENDS)
    spec = parse_scheme_key(scheme)
    x = hidden_states
    w13 = (w13_weight, w13_weight_scale, w13_weight_global_scale, w13_weight_zero_point, w13_weight_g_idx)
    w2 = (w2_weight, w2_weight_scale, w2_weight_global_scale, w2_weight_zero_point, w2_weight_g_idx)
    e, i, k = _check_inputs(x, top_k_index, top_k_weights, w13, w2, w13_bias, w2_bias, activation, spec, scheme)
    lead, h = x.shape[:-1], x.shape[-1]
    x2, ids, weights = x.reshape(-1, h), top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)
    if backend == "reference":
        out = reference_experts(x2, ids, weights, w13 + (None, None), w2 + (None, None), w13_bias, w2_bias,
                                activation, _weight_only_key(spec), apply_router_weight_on_input)
        return out.to(x.dtype).reshape(*lead, h)
    if not use_triton(x):
        raise UnsupportedError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {x.device}",
                               where=OP, fix="use backend='reference'")
    if x.dtype not in HALF:
        raise UnsupportedError(f"backend 'triton' needs bf16 or fp16 hidden_states, got {x.dtype}", where=OP,
                               fix="use backend='reference'")
    for what, n, kk in zip(PROJECTIONS, (w13_weight.shape[1], h), (h, i)):
        why = triton_shape_reason(spec.weight, n, kk)
        if why:
            raise UnsupportedError(f"backend 'triton': {what}: {why}", where=OP, fix="use backend='reference'")
    args = (x2, ids, weights, w13, w2, w13_bias, w2_bias, activation, spec, apply_router_weight_on_input)
    return wo_moe_triton(*args, *plan(*args, i)).reshape(*lead, h)


@wo_moe.register_fake
def _(hidden_states, top_k_index, top_k_weights, *rest, **kwargs):
    return torch.empty_like(hidden_states)


# -- autograd: experts_ref's straight-through gradient, on the weight-only scheme ------------------------

register_straight_through(OP, ROLES[:5], lambda key: _weight_only_key(parse_scheme_key(key)))


# -- registry --------------------------------------------------------------------------------------

def check(q: KernelQuery) -> str | None:
    """None when the Triton kernel runs the experts query ``q``, else why not."""
    name = q.activation.split(":")[0]
    if name not in ACTIVATIONS + NON_GATED:
        return f"activation {q.activation!r} is not one of {list(ACTIVATIONS + NON_GATED)}"
    why = cuda_reason(q, (8, 0))
    if why:
        return why
    i = q.n // 2 if name in ACTIVATIONS else q.n
    for what, n, k in zip(PROJECTIONS, (q.n, q.k), (q.k, i)):
        why = triton_shape_reason(q.scheme.weight, n, k)
        if why:
            return f"{what}: {why}"
    return None


WO_MOE = register(Kernel(
    name="wo_moe", op=OP, backend="triton", priority=28, check=check, requires=("triton",), act_dtypes=HALF,
    computes=wo_reason, kind="experts", layouts=("tiled",),  # the grouped wo_mma build's order (tile_for_mma)
    description="Triton grouped weight-only MoE: GPU token sort, the weight-only GEMM per expert block, top-k sum",
))
