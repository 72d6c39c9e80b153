"""``qcompile::fused_moe``: a fused Mixture-of-Experts layer with FP8 or INT8 expert weights, in Triton.

Math (:func:`fused_moe_reference`, fp32; also the CPU path): for each token ``t`` and each of its
``k`` experts ``e = topk_ids[t, j]``

    h   = act(qdq(x_t) @ deq(w13[e]).T + b13[e]) gated: act(h[:I]) * h[I:] (w13 rows: gate, then up)
    y   = qdq(h) @ deq(w2[e]).T + b2[e]          h held in x.dtype between the GEMMs, as vLLM does
    out_t = sum_j topk_weights[t, j] * y         (with apply_router_weight_on_input the weight
                                                  multiplies x_t before the first GEMM instead:
                                                  x_t * w in fp32, rounded to x.dtype)

``qdq`` quantizes activations as the scheme says (a :class:`~qcompile.scheme.QuantScheme` key):

===================  =========================  ====================================================
weights              scales (fp32, multiply)    activations (x and h alike)
===================  =========================  ====================================================
fp8_e4m3             [E] / [E, N] / 128x128     fp8: static per tensor (a13/a2_scale, 0-d), dynamic
                     blocks [E, ceil(N/128),    per tensor, per token, or per 1x128 group (the last
                     ceil(K/128)]: edge         one partial when K % 128 != 0); scale amax / 448
                     blocks partial             (at least 1/(448*512))
int8 (symmetric)     [E] / [E, N]               int8: static per tensor, or dynamic per token with
                                                scale amax / 127; codes round-half-even, [-128, 127]
===================  =========================  ====================================================

Activations (``ACTIVATIONS``): silu / gelu_tanh gated, their non-gated forms, relu^2, and gpt-oss's
"swigluoai": ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate,
limit)`` (gate rows then up rows, as the loader stores them). Biases b13 [E, N1] and b2 [E, H] are
optional. Expert ids outside ``[0, E)`` (another rank's experts) contribute nothing.

Kernels (:func:`fused_moe`), per layer call, each launched with programmatic dependent launch on sm_90+
(:func:`fp8_quant_triton.pdl`):

1. ``moe_align`` (:mod:`moe_kernels`): pairs grouped per expert in blocks of ``block_m`` rows; or, in
   ``per_pair`` mode (a launch option), none: each program takes one pair and reads its expert's weights
   (in a 16-row tile for the tensor cores, or, with ``block_m`` 1, as one row multiplied on the CUDA
   cores: narrow column tiles, many programs, no MMA padding).
2. Activation quantization: in the GEMM's prologue (``fuse_quant``: static, per-token and group
   scales) or one separate kernel (the only way for dynamic per-tensor scales).
3. GEMM 1 (``_moe_gemm_kernel``): the gate and the up tile of each output column block in one
   program, bias and activation in the epilogue; writes h [T·k, I] in x.dtype (rows by pair), or, with
   a static activation scale and no prologue quantization in GEMM 2, h's codes under that scale (h
   rounded to x.dtype first: the values the separate quantization kernel would write, one launch less).
4. GEMM 2: the same kernel without activation; bias and router weight in the epilogue; writes
   y [split_k, T·k, H] (fp32 partials when split over K, else x.dtype). With ``fold_topk`` (an option)
   one program per token runs its k experts in turn and writes out[t] itself (or per-split rows).
5. ``_moe_sum_kernel``: out[t] = sum over j (then splits) of y[., t·k + j] in a fixed order: no
   atomics, deterministic.

The GEMM computes acc^T = W · A^T when ``swap`` (the weight tile is the MMA's M side: Hopper's
wgmma wants M >= 64, and decode has 1..16 rows) and A · W^T otherwise; FP8 x FP8 and INT8 x INT8
run on the tensor cores (fp32 / int32 accumulation; each K step's fp8 sum is promoted to the fp32
accumulator), one-row programs on the CUDA cores (fp32 / int32 products and sums); per-tensor /
channel / token scales multiply the accumulator once, 128x128-block and 1x128-group scales every K step
(``BLOCK_K`` = 128).
Launch parameters: :class:`MoeConfig` (:mod:`moe_config`: the :func:`tune` cache, the ``TUNED``
table or the default rule). Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..scheme import Granularity, QDtype, QuantScheme
from . import fp8_quant_triton as fq
from . import quant_math
from .fp8_quant_triton import HAS_TRITON, interpreting, pdl, use_triton
from .moe_config import (ACTIVATIONS, OP, GemmConfig, MoeConfig, MoeQuant, get_config, moe_quant,
                         normalize_config, tune)  # noqa: F401 - tune: part of this module's interface
from .experts_ref import SWIGLU_ALPHA, SWIGLU_LIMIT, split_activation
from .registry import Kernel, KernelQuery, cuda_reason, register, unknown_backend
from .moe_kernels import A_CODES, A_DYNAMIC, A_STATIC, G_BLOCK, G_ROW, G_TENSOR, INT8_MIN_SCALE, moe_align

if HAS_TRITON:
    from .moe_kernels import _moe_gemm_kernel, _moe_sum_kernel

BACKENDS = ("reference", "triton")


def _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale, b13, b2,
                  q: MoeQuant, activation: str) -> tuple[int, int, int, int, int]:
    """(T, H, I, E, k) after checking every tensor against the scheme; UnsupportedError naming the
    tensor otherwise."""
    def bad(what, fix=None):
        raise UnsupportedError(what, where=OP, fix=fix)

    if activation not in ACTIVATIONS:
        bad(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        bad(f"x must be a float [T, H] tensor, got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in (torch.int32, torch.int64):
        bad(f"topk_ids must be int32/int64 [T={t}, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or not topk_weights.dtype.is_floating_point:
        bad(f"topk_weights must be float [T={t}, k={k}], got {topk_weights.dtype} {list(topk_weights.shape)}")
    wdt = torch.int8 if q.int8 else torch.float8_e4m3fn
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != wdt or w2.dtype != wdt:
        bad(f"w13 [E, N1, H] and w2 [E, H, I] must be {wdt}, got {w13.dtype} {list(w13.shape)} and "
            f"{w2.dtype} {list(w2.shape)}")
    e, n1, _ = w13.shape
    i = w2.shape[2]
    gated = ACTIVATIONS[activation][1]
    if w13.shape[2] != h or tuple(w2.shape[:2]) != (e, h) or n1 != (2 * i if gated else i):
        bad(f"w13 {list(w13.shape)} and w2 {list(w2.shape)} do not fit x [T, H={h}] with "
            f"{'gated' if gated else 'non-gated'} activation {activation!r} (w13 [E, {'2I' if gated else 'I'}, H], "
            "w2 [E, H, I])")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        bad("w13 and w2 must be contiguous along their last dimension")
    for name, s, n, kk in (("w13_scale", w13_scale, n1, h), ("w2_scale", w2_scale, h, i)):
        want = {G_TENSOR: (e,), G_ROW: (e, n), G_BLOCK: (e, -(-n // 128), -(-kk // 128))}[q.w_gran]
        if tuple(s.shape) != want or s.dtype != torch.float32:
            bad(f"{name} must be fp32 {list(want)} for scheme {q.scheme.key}, got {s.dtype} {list(s.shape)}",
                "normalize scales at load (per tensor [E], per channel [E, N], 128x128 blocks [E, N/128, K/128])")
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if q.a_static and (s is None or s.numel() != 1):
            bad(f"scheme {q.scheme.key} has static activation scales but {name} is "
                f"{'None' if s is None else list(s.shape)}", "pass the per-tensor input scale (0-d fp32)")
    for name, b, want in (("b13", b13, (e, n1)), ("b2", b2, (e, h))):
        if b is not None and (tuple(b.shape) != want or not b.dtype.is_floating_point):
            bad(f"{name} must be a float {list(want)} bias, got {b.dtype} {list(b.shape)}")
    return t, h, i, e, k


# -- the Triton pipeline ---------------------------------------------------------------------------

def _native_fp8(x: torch.Tensor) -> bool:
    return x.is_cuda and not interpreting()


def _act_operand(a: torch.Tensor, q: MoeQuant, static_scale, fuse: bool):
    """A operand of a GEMM from x.dtype rows ``a`` [M, K]: (tensor, scale, A mode, scale strides (row, group)).
    Fused: ``a`` itself, quantized in the GEMM's prologue. Else quantized here by one kernel."""
    if static_scale is not None:
        static_scale = static_scale.reshape(()).float()
    if fuse:
        mode = A_STATIC if q.a_static else A_DYNAMIC
        return a, static_scale if q.a_static else a, mode, 0, 0
    if q.int8:  # static per tensor, or dynamic per token with the MoE's least scale
        if q.a_static:
            codes, scale = fq.quantize_static_tensor(a, static_scale, int8=True)
        else:
            codes, scale = fq.quantize_dynamic_token(a, int8=True, int8_min_scale=INT8_MIN_SCALE)
        return codes, scale, A_CODES, 1, 0
    codes, scale = fq.quantize(a, q.scheme.act, static_scale)
    if q.a_gran == G_TENSOR:
        return codes, scale, A_CODES, 0, 0
    return codes, scale, A_CODES, scale.stride(0), scale.stride(1) if scale.dim() == 2 else 0


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _splits(k: int, g: GemmConfig) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of splits that are not empty)."""
    per_split = -(-k // g.split_k)
    k_split = -(-per_split // g.block_k) * g.block_k
    return k_split, -(-k // k_split)


def _gemm(a, a_scale, a_mode, a_strides, a_div, w, w_scale, bias, out, route, rows, q: MoeQuant, g: GemmConfig,
          n: int, k: int, act: int, gated: bool, per_pair: bool, block_m: int, num_pairs: int, launch: dict,
          fold_topk: int = 0, swiglu: tuple[float, float] = (SWIGLU_ALPHA, SWIGLU_LIMIT),
          out_scale: torch.Tensor | None = None, out_fp16: bool = False):
    """One launch of the grouped GEMM: out[split, pair, :n] for every pair of ``rows`` (sorted_ids,
    block_expert) or, per pair, (None, topk_ids flat); out[split, token, :n] when folding ``fold_topk``
    pairs per token. ``bias`` [E, N] or None (added by the first K split). ``out_scale`` (0-d fp32): ``out``
    receives the codes of the result (in x's dtype first: fp16 when ``out_fp16``) under this static scale.
    ``launch``: the call's :func:`pdl` keywords. Returns the number of K splits."""
    sorted_ids, experts = rows
    k_split, splits = _splits(k, g)
    ws = [w_scale.stride(d) if d < w_scale.dim() else 0 for d in range(3)]
    grid = (experts.numel() // max(1, fold_topk), -(-n // g.block_n), splits)
    _moe_gemm_kernel[grid](
        a, a_scale, w, w_scale, bias if bias is not None else w_scale, out,
        sorted_ids if sorted_ids is not None else experts, experts, route if route is not None else a_scale,
        out_scale if out_scale is not None else a_scale, n, k, num_pairs, w.shape[0], a_div, n if gated else 0, k_split, float(swiglu[0]), float(swiglu[1]),
        a.stride(0), a_strides[0], a_strides[1], w.stride(0), w.stride(1), ws[0], ws[1], ws[2],
        bias.stride(0) if bias is not None else 0, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        W_INT8=q.int8, W_GRAN=q.w_gran, A_GRAN=q.a_gran, A_MODE=a_mode, GATED=gated, ACT=act, HAS_BIAS=bias is not None,
        ROUTE=route is not None, PER_PAIR=per_pair, FOLD_TOPK=fold_topk, SWAP=g.swap, NATIVE_FP8=_native_fp8(a),
        BLOCK_M=block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, OUT_QUANT=out_scale is not None, OUT_FP16=out_fp16,
        num_warps=g.num_warps, num_stages=g.num_stages, **launch)
    return splits


def fused_moe(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale=None, a2_scale=None, *,
              scheme: str, activation: str = "silu", apply_router_weight_on_input: bool = False, b13=None, b2=None,
              swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
              config: MoeConfig | None = None) -> torch.Tensor:
    """The MoE layer of the module doc with the Triton kernels (CUDA, or CPU under the interpreter;
    elsewhere :func:`fused_moe_reference`). ``config``: launch parameters (default: :func:`get_config`)."""
    q = moe_quant(scheme)
    t, h, i, e, k = _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                  b13, b2, q, activation)
    if not use_triton(x):
        return fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                   scheme=scheme, activation=activation, b13=b13, b2=b2, swiglu_alpha=swiglu_alpha,
                                   swiglu_limit=swiglu_limit, apply_router_weight_on_input=apply_router_weight_on_input)
    act, gated = ACTIVATIONS[activation]
    cfg = get_config(q, e, h, i, k, t, gated, x.device) if config is None else normalize_config(config, q, gated)
    p, dev = t * k, x.device
    if t == 0:
        return x.new_empty((0, h))
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    route = topk_weights.reshape(-1).contiguous()
    rows = (None, ids) if cfg.per_pair else moe_align(topk_ids, e, cfg.block_m)
    if apply_router_weight_on_input:  # the weight scales each pair's copy of x, rounded to x.dtype
        a1 = (x.float().unsqueeze(1) * topk_weights.float().unsqueeze(2)).reshape(p, h).to(x.dtype)
        a_div, route2 = 1, None
    else:
        a1, a_div, route2 = x, k, route
    launch = pdl(x)  # the PDL keywords of every launch below
    common = dict(q=q, per_pair=cfg.per_pair, block_m=cfg.block_m, num_pairs=p, launch=launch)
    a, s, mode, strides = _unpack(_act_operand(a1, q, a13_scale, cfg.gemm1.fuse_quant))
    if q.a_static and not cfg.gemm2.fuse_quant:  # GEMM 1 writes h's codes under the static scale itself
        a2 = a2_scale.reshape(()).float()
        hid = torch.empty((p, i), dtype=torch.int8 if q.int8 else torch.float8_e4m3fn, device=dev)
        _gemm(a, s, mode, strides, a_div, w13, w13_scale, b13, hid, None, rows, g=cfg.gemm1, n=i, k=h, act=act,
              gated=gated, swiglu=(swiglu_alpha, swiglu_limit), out_scale=a2, out_fp16=x.dtype == torch.float16,
              **common)
        a, s, mode, strides = hid, a2, A_CODES, (0, 0)
    else:
        # h rows of pairs without a local expert stay zero where a dynamic per-tensor scale reads all rows
        zero = q.a_gran == G_TENSOR and not q.a_static
        hid = (torch.zeros if zero else torch.empty)((p, i), dtype=x.dtype, device=dev)
        _gemm(a, s, mode, strides, a_div, w13, w13_scale, b13, hid, None, rows, g=cfg.gemm1, n=i, k=h, act=act,
              gated=gated, swiglu=(swiglu_alpha, swiglu_limit), **common)
        a, s, mode, strides = _unpack(_act_operand(hid, q, a2_scale, cfg.gemm2.fuse_quant))
    split = _splits(i, cfg.gemm2)[1]
    out = torch.empty((t, h), dtype=x.dtype, device=dev)
    if cfg.fold_topk and split == 1:  # GEMM 2 writes the output itself
        _gemm(a, s, mode, strides, 1, w2, w2_scale, b2, out, route2, (None, ids), g=cfg.gemm2, n=h, k=i, act=0,
              gated=False, fold_topk=k, **common)
        return out
    rows_out = t if cfg.fold_topk else p
    part = torch.empty((split, rows_out, h), dtype=torch.float32 if split > 1 else x.dtype, device=dev)
    _gemm(a, s, mode, strides, 1, w2, w2_scale, b2, part, route2, (None, ids) if cfg.fold_topk else rows,
          g=cfg.gemm2, n=h, k=i, act=0, gated=False, fold_topk=k if cfg.fold_topk else 0, **common)
    block_h = min(_pow2(h), 512)
    _moe_sum_kernel[(t, -(-h // block_h))](part, ids, out, h, e, part.stride(0), TOPK=1 if cfg.fold_topk else k,
                                           SPLIT=split, CHECK_IDS=not cfg.fold_topk, BLOCK_H=block_h, num_warps=4,
                                           **launch)
    return out


def _unpack(operand):
    a, s, mode, srow, sgrp = operand
    return a, s, mode, (srow, sgrp)


# -- the reference ---------------------------------------------------------------------------------

def _qdq(a: torch.Tensor, q: MoeQuant, static_scale) -> torch.Tensor:
    """Quantize-dequantize activation rows a [M, K] (fp32) as the scheme says."""
    if not q.int8:
        pad = -a.shape[1] % 128 if q.a_gran == G_BLOCK else 0  # a partial last group: zeros leave its amax
        return quant_math.qdq_activation(F.pad(a, (0, pad)), q.scheme.act, static_scale)[:, :a.shape[1]]
    if q.a_static:
        s = static_scale.float().reshape(())
    else:
        amax = a.abs().amax(dim=-1, keepdim=True)
        s = (amax / torch.full_like(amax, 127.0)).clamp(min=INT8_MIN_SCALE)
    return torch.round(a / s).clamp(-128, 127) * s


def _dequant(w: torch.Tensor, s: torch.Tensor, q: MoeQuant) -> torch.Tensor:
    """One expert's weight [N, K] in fp32 from its codes and its scale ([] / [N] / [N/128, K/128])."""
    n, k = w.shape
    gran = {G_TENSOR: Granularity.TENSOR, G_ROW: Granularity.CHANNEL, G_BLOCK: Granularity.BLOCK}[q.w_gran]
    return w.float() * quant_math.expand_scale(s, gran, n, k, block=(128, 128))


def _activation_ref(g: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    code, gated = ACTIVATIONS[activation]
    if gated:
        g, up = g.chunk(2, dim=-1)
    if code == 4:  # swigluoai: gate clamped above, up clamped both ways
        g, up = g.clamp(max=limit), up.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (up + 1)
    y = {1: F.silu, 2: lambda v: F.gelu(v, approximate="tanh"), 3: lambda v: F.relu(v).square()}[code](g)
    return y * up if gated else y


def fused_moe_reference(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale=None, a2_scale=None, *,
                        scheme: str, activation: str = "silu", apply_router_weight_on_input: bool = False,
                        b13=None, b2=None, swiglu_alpha: float = SWIGLU_ALPHA,
                        swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The math of the module doc in fp32 on any device (a loop over the experts that have pairs).

    With ``apply_router_weight_on_input`` each pair's row is ``x_t * w`` computed in fp32 and rounded to
    x.dtype before it is quantized, the order of ``experts_ref`` (and of ``x * w`` in x.dtype, as vLLM
    and HF's Llama-4 compute it, whenever the router weights are in x.dtype)."""
    q = moe_quant(scheme)
    t, h, i, e, k = _check_inputs(x, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, a13_scale, a2_scale,
                                  b13, b2, q, activation)
    p, dev = t * k, x.device
    ids = topk_ids.reshape(-1).long()
    route = topk_weights.reshape(-1).float()
    tok = torch.arange(p, device=dev) // k
    if apply_router_weight_on_input:
        a1, a_row = (x.float()[tok] * route[:, None]).to(x.dtype).float(), torch.arange(p, device=dev)
    else:
        a1, a_row = x.float(), tok
    a1 = _qdq(a1, q, a13_scale)
    experts = [(j, (ids == j).nonzero().flatten()) for j in ids[(ids >= 0) & (ids < e)].unique().tolist()]
    hid = torch.zeros((p, i), device=dev)
    def bias(b, j):
        return 0.0 if b is None else b[j].float()

    for j, sel in experts:
        g = a1[a_row[sel]] @ _dequant(w13[j], w13_scale[j], q).t() + bias(b13, j)
        hid[sel] = _activation_ref(g, activation, swiglu_alpha, swiglu_limit)
    hid = _qdq(hid.to(x.dtype).float(), q, a2_scale)  # h is held in x.dtype between the GEMMs
    y = torch.zeros((p, h), device=dev)
    for j, sel in experts:
        y[sel] = hid[sel] @ _dequant(w2[j], w2_scale[j], q).t() + bias(b2, j)
    if not apply_router_weight_on_input:
        y = y * route[:, None]
    return y.view(t, k, h).sum(1).to(x.dtype)


# -- the op ----------------------------------------------------------------------------------------

@torch.library.custom_op(OP, mutates_args=())
def fused_moe_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 w13_weight: torch.Tensor, w13_weight_scale: torch.Tensor, w13_input_scale: torch.Tensor | None,
                 w2_weight: torch.Tensor, w2_weight_scale: torch.Tensor, w2_input_scale: torch.Tensor | None,
                 w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None, activation: str, scheme: str,
                 apply_router_weight_on_input: bool, backend: str) -> torch.Tensor:
    """The experts layer of ``qcompile::experts_ref`` (same argument names, the FP8 / INT8 W8A8 subset).
    ``backend``: "reference" (any device, :func:`fused_moe_reference`) or "triton" (:func:`fused_moe`).
    ``activation``: an :data:`ACTIVATIONS` name; "swigluoai:<alpha>:<limit>" for gpt-oss."""
    if backend not in BACKENDS:
        raise unknown_backend(OP, backend, BACKENDS)
    if backend == "triton" and not use_triton(hidden_states):
        raise UnsupportedError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got "
                               f"{hidden_states.device}", where=OP, fix="use backend='reference'")
    name, alpha, limit = split_activation(activation)
    lead, h = hidden_states.shape[:-1], hidden_states.shape[-1]
    k = top_k_index.shape[-1]
    fn = fused_moe if backend == "triton" else fused_moe_reference
    out = fn(hidden_states.reshape(-1, h), top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k), w13_weight,
             w2_weight, w13_weight_scale, w2_weight_scale, w13_input_scale, w2_input_scale, scheme=scheme,
             activation=name, apply_router_weight_on_input=apply_router_weight_on_input, b13=w13_bias, b2=w2_bias,
             swiglu_alpha=alpha, swiglu_limit=limit)
    return out.reshape(*lead, h)


@fused_moe_op.register_fake
def _(hidden_states, top_k_index, top_k_weights, *rest):
    return torch.empty_like(hidden_states)


def check_triton(q: KernelQuery) -> str | None:
    """None when the Triton fused MoE runs ``q`` (an experts query), else why not."""
    try:
        moe_quant(q.scheme.key)
    except UnsupportedError as e:
        return e.what
    name = q.activation.split(":")[0]
    if name not in ACTIVATIONS:
        return f"activation {q.activation!r} is not one of {sorted(ACTIVATIONS)}"
    if q.device != "cuda":
        return f"needs a CUDA device, have {q.device}"
    return cuda_reason(q, (8, 0) if q.scheme.weight.dtype is QDtype.INT8 else (8, 9))


def _computes(scheme: QuantScheme) -> str | None:
    try:
        moe_quant(scheme.key)
    except UnsupportedError as e:
        return e.what
    return None


MOE_TRITON = register(Kernel(
    name="moe_triton", op=OP, backend="triton", priority=30, check=check_triton, computes=_computes, kind="experts",
    act_dtypes=(torch.bfloat16, torch.float16),
    description="Triton fused MoE: GPU token sort, grouped FP8 / INT8 GEMMs with activation, routing and top-k sum",
))


# -- inputs and tuning -----------------------------------------------------------------------------

def quantize_expert_weights(w: torch.Tensor, q: MoeQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes and scales of fp32 expert weights w [E, N, K] in the scheme's granularity."""
    e, n, k = w.shape
    qmax = 127.0 if q.int8 else quant_math.FP8_MAX
    if q.w_gran == G_BLOCK:
        nb, kb = -(-n // 128), -(-k // 128)
        pad = F.pad(w, (0, kb * 128 - k, 0, nb * 128 - n)).view(e, nb, 128, kb, 128)
        scale = (pad.abs().amax(dim=(2, 4)) / qmax).clamp(min=1e-12)
        full = scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    else:
        amax = w.abs().amax(dim=(1, 2)) if q.w_gran == G_TENSOR else w.abs().amax(dim=2)
        scale = (amax / qmax).clamp(min=1e-12)
        full = scale.view(e, 1, 1) if q.w_gran == G_TENSOR else scale.unsqueeze(2)
    v = (w / full).clamp(-qmax, qmax)
    codes = torch.round(v).to(torch.int8) if q.int8 else v.to(quant_math.FP8)
    return codes, scale.float()


def make_moe_inputs(scheme: str, e: int, h: int, i: int, k: int, t: int, activation: str = "silu",
                    dtype=torch.bfloat16, device="cpu", seed: int = 0, bias: bool | None = None) -> dict:
    """Random keyword arguments of :func:`fused_moe` (tests, benchmarks, :func:`tune`): x with a few
    outlier columns, distinct experts per token, weights ~ N(0, 1/K) quantized to the scheme, static
    scales (when the scheme has them) from x's amax and, for h, from 4 standard deviations of the
    projections (whose std is x's rms): squared for gated and relu^2 activations. ``bias`` (default:
    with "swigluoai", as gpt-oss has): b13 and b2 ~ N(0, 1/4) in ``dtype``, else None."""
    q = moe_quant(scheme)
    gen = torch.Generator(device=device).manual_seed(seed)
    n1 = 2 * i if ACTIVATIONS[activation][1] else i
    x = torch.randn(t, h, generator=gen, device=device) * (1 + 2 * torch.rand(t, 1, generator=gen, device=device))
    x[:, :: max(1, h // 7)] *= 4
    ids = torch.rand(t, e, generator=gen, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.rand(t, k, generator=gen, device=device)
    ws = []
    for n, kk in ((n1, h), (h, i)):
        codes, scales = zip(*(quantize_expert_weights(torch.randn(1, n, kk, generator=gen, device=device) / kk**0.5, q)
                              for _ in range(e)))  # one expert at a time: bounded fp32 temporaries
        ws += [torch.cat(codes), torch.cat(scales)]
    qmax = 127.0 if q.int8 else quant_math.FP8_MAX
    a13 = a2 = None
    if q.a_static and t:
        hmax = 4 * x.pow(2).mean().sqrt()
        hmax = hmax**2 if ACTIVATIONS[activation][1] or activation == "relu2_no_mul" else hmax
        a13, a2 = (x.abs().amax() / qmax).float(), (hmax / qmax).float()
    b13 = b2 = None
    if (activation == "swigluoai") if bias is None else bias:
        b13, b2 = (torch.randn(e, n, generator=gen, device=device).mul(0.5).to(dtype) for n in (n1, h))
    return dict(x=x.to(dtype), topk_ids=ids, topk_weights=weights, w13=ws[0], w2=ws[2], w13_scale=ws[1],
                w2_scale=ws[3], a13_scale=a13, a2_scale=a2, b13=b13, b2=b2, scheme=scheme, activation=activation)
