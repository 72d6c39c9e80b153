"""``qcompile::decode_attention``: one query token's grouped-query attention, split over the keys.

The decode-attention pass (``qcompile/passes/attention.py``) hands this op what it gives SDPA: a group's query
heads as query rows, the key / value heads themselves and a mask shared by all heads,

    q (b, kv_heads, rep, d), k / v (b, kv_heads, S, d), mask (b, 1, 1, S) bool or additive float, or none
    -> softmax(q k^T * scale + mask) v: (b, kv_heads, rep, d)

(any of the batches may be 1 and broadcast). On CUDA a Triton kernel computes it flash-decoding style: the S
keys of each (batch, key / value head) are cut into splits so that the grid fills the GPU at batch 1; each
program streams its split's keys and values once for all ``rep`` query rows (one ``tl.dot`` each), with an
online softmax, and skips a block of 64 keys the mask hides entirely without reading its keys and
values (a static cache's unwritten tail). A second kernel merges the splits' partial results (one launch when
there is one split). Both launch with programmatic dependent launch on sm_90+ (``QCOMPILE_PDL=0`` turns it off).
SDPA as a library call reads every position of the cache, launches once per call and, for a masked call at one
query token, puts few thread blocks to work.

With ``sinks`` (one logit per query head, gpt-oss's attention sinks) the softmax also spans that logit, whose
column is then dropped: ``p = softmax([q k^T * scale + mask, sink])[..., :-1]``, so the probabilities of a row sum
to less than 1. The kernel starts split 0 of each row with the sink as its running maximum and 1 as its sum.

Rows every key of which is masked come out 0, as SDPA's math does. Elsewhere (the CPU, a head dimension over
256, a dtype other than fp16 / bf16 / fp32, no Triton) the op is ``F.scaled_dot_product_attention`` on the
same tensors; that is its reference too (with sinks, the same math written out in fp32). Its gradient is the
reference's (the pass leaves calls that need one to SDPA).

With ``k_scale`` / ``v_scale`` the keys and values are an FP8 KV cache's float8_e4m3fn codes
(``qcompile/kv_cache.py``): the kernel dequantizes each block in registers exactly as the cache's read does,
``dtype(code * scale)``, so the op equals SDPA on that read without the dequantized copy of the cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fp8_quant_triton import HAS_TRITON, interpreting, pdl, use_triton
from .quant_math import dequantize_fp8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_quant_triton import _pdl_start
    from .wo_gemm_triton import _fp8_value

OP = "qcompile::decode_attention"
BLOCK_N = 64  # keys per step of a program
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn


if HAS_TRITON:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b in fp32. IEEE: fp32 operands (fp32 inputs; bf16 ones under the Triton 3.9 interpreter, which
        multiplies bf16 operands as their raw bits) multiplied exactly, not in tf32."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _round(x, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr):
        """fp32 ``x`` rounded to DTYPE, to nearest even. EMU_BF16: the Triton 3.9 interpreter's cast to bf16
        truncates, so there the rounding is made on the bits first (the cast is then exact)."""
        if EMU_BF16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
        return x.to(DTYPE)

    @triton.jit
    def _split_kernel(Q, K, V, MASK, OUT, ACC, ML, KS, VS, SINKS, scale, S, REP, D, KVH, chunk,
                      s_qb, s_qh, s_qr, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd, s_mb, s_ms,
                      s_ob, s_oh, s_or, s_od, s_ksh, s_vsh,
                      MASK_KIND: tl.constexpr, KV_FP8: tl.constexpr, HAS_SINK: tl.constexpr, DIRECT: tl.constexpr,
                      IEEE: tl.constexpr,
                      EMU_BF16: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
        """One (batch, key / value head, split): the split's keys against the group's ``rep`` query rows.
        ``DIRECT``: the only split, write the output; else the unnormalized sum, its row maxima and row sums
        to the workspace for the merge. ``KV_FP8``: K and V are e4m3 bytes, dequantized as the FP8 cache does
        (``dtype(fp8 * scale)``, the head's scale from KS / VS) before the dots: the GPU's own e4m3 conversion
        (``NATIVE_FP8``), or integer decoding under the interpreter. ``HAS_SINK``: split 0 starts each row from its
        head's sink logit (SINKS[h * REP + row]) as the running maximum, with 1 as the running sum."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        b = bh // KVH
        h = bh % KVH
        _pdl_start(PDL)  # q, k, v and the mask come from the kernels before
        rows = tl.arange(0, BLOCK_M)
        dd = tl.arange(0, BLOCK_D)
        nn = tl.arange(0, BLOCK_N)
        rmask = rows < REP
        dmask = dd < D
        q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_qr + dd[None, :] * s_qd,
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        if HAS_SINK:  # -inf (no sink) outside split 0
            m_i = tl.load(SINKS + h * REP + rows, mask=rmask & (rows * 0 + split == 0),
                          other=float("-inf")).to(tl.float32)
            l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, S)
        k_base = K + b * s_kb + h * s_kh
        v_base = V + b * s_vb + h * s_vh
        if KV_FP8:
            k_scale = tl.load(KS + h * s_ksh)
            v_scale = tl.load(VS + h * s_vsh)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + nn
            valid = offs < end
            if MASK_KIND == 1:  # boolean: True attends
                mv = tl.load(MASK + b * s_mb + offs * s_ms, mask=valid, other=0)
                valid = valid & (mv != 0)
            elif MASK_KIND == 2:  # additive float
                mv = tl.load(MASK + b * s_mb + offs * s_ms, mask=valid, other=float("-inf")).to(tl.float32)
                valid = valid & (mv > float("-inf"))
            if tl.max(valid.to(tl.int32), axis=0) > 0:  # a block the mask hides entirely is not read
                kv_mask = valid[:, None] & dmask[None, :]
                k = tl.load(k_base + offs[:, None] * s_ks + dd[None, :] * s_kd, mask=kv_mask, other=0)
                if KV_FP8:
                    k = _round(_fp8_value(k, NATIVE_FP8) * k_scale, Q.dtype.element_ty, EMU_BF16)
                qk = _dot(q, tl.trans(k), IEEE)
                qk = qk * scale
                if MASK_KIND == 2:
                    qk = qk + mv[None, :]
                qk = tl.where(valid[None, :], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(qk - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + offs[:, None] * s_vs + dd[None, :] * s_vd, mask=kv_mask, other=0)
                if KV_FP8:
                    v = _round(_fp8_value(v, NATIVE_FP8) * v_scale, Q.dtype.element_ty, EMU_BF16)
                pv = _dot(_round(p, v.dtype, EMU_BF16), v, IEEE)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        if DIRECT:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(OUT + b * s_ob + h * s_oh + rows[:, None] * s_or + dd[None, :] * s_od,
                     _round(out, OUT.dtype.element_ty, EMU_BF16), mask=rmask[:, None] & dmask[None, :])
        else:
            slot = bh * splits + split
            tl.store(ACC + (slot * BLOCK_M + rows[:, None]) * BLOCK_D + dd[None, :], acc)
            tl.store(ML + (slot * 2) * BLOCK_M + rows, m_i)
            tl.store(ML + (slot * 2 + 1) * BLOCK_M + rows, l_i)

    @triton.jit
    def _merge_kernel(ACC, ML, OUT, REP, D, KVH, SPLITS, s_ob, s_oh, s_or, s_od, EMU_BF16: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
        """One (batch, key / value head, query row): the splits' partial sums, all loaded at once, rescaled to
        their largest row maximum and summed."""
        bh = tl.program_id(0)
        r = tl.program_id(1)
        b = bh // KVH
        h = bh % KVH
        _pdl_start(PDL)
        dd = tl.arange(0, BLOCK_D)
        ss = tl.arange(0, BLOCK_S)
        smask = ss < SPLITS
        slot = bh * SPLITS + ss
        m = tl.load(ML + slot * 2 * BLOCK_M + r, mask=smask, other=float("-inf"))
        l_s = tl.load(ML + (slot * 2 + 1) * BLOCK_M + r, mask=smask, other=0.0)
        acc = tl.load(ACC + (slot[:, None] * BLOCK_M + r) * BLOCK_D + dd[None, :], mask=smask[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        total = tl.sum(w * l_s, axis=0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(OUT + b * s_ob + h * s_oh + r * s_or + dd * s_od, _round(out, OUT.dtype.element_ty, EMU_BF16),
                 mask=dd < D)


def _batch(q, k, v, mask) -> int:
    return max(q.shape[0], k.shape[0], v.shape[0], 1 if mask is None else mask.shape[0])


def _check(q, k, v, mask, k_scale=None, v_scale=None, sinks=None):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{OP}: q, k and v are (batch, kv_heads, rows, head_dim), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1:] != v.shape[1:] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{OP}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not share "
                         "their key / value heads, key positions and head dimension")
    if mask is not None and (mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] not in (1, k.shape[2])):
        raise ValueError(f"{OP}: the mask is shared by all heads and rows, (batch, 1, 1, {k.shape[2]}), got "
                         f"{tuple(mask.shape)}")
    if sinks is not None and (sinks.dim() != 1 or sinks.numel() != q.shape[1] * q.shape[2]
                              or not sinks.dtype.is_floating_point):
        raise ValueError(f"{OP}: sinks are one floating-point logit per query head, ({q.shape[1] * q.shape[2]},), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{OP}: fp8 keys and values take a k_scale and a v_scale, got one of them")
    if k_scale is not None:
        for name, t, sc in (("k", k, k_scale), ("v", v, v_scale)):
            if t.dtype != FP8 or sc.dtype != torch.float32 or sc.numel() not in (1, k.shape[1]) or \
                    sc.dim() != 4 or sc.shape[0] != 1 or sc.shape[2:] != (1, 1):
                raise ValueError(f"{OP}: with scales, {name} is float8_e4m3fn and {name}_scale fp32 (1, "
                                 f"{k.shape[1]} or 1, 1, 1) (the FP8 cache's), got {t.dtype} and {sc.dtype} "
                                 f"{tuple(sc.shape)}")


def triton_reason(q, k, v, mask, fp8_kv: bool = False) -> str | None:
    """Why the Triton kernel does not take this call (then SDPA does), or None."""
    if not use_triton(q):
        return "no Triton for this device"
    kv = FP8 if fp8_kv else q.dtype
    if q.dtype not in DTYPES or k.dtype != kv or v.dtype != kv:
        return f"q in one of {DTYPES}, k and v in {kv}, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[3] > MAX_HEAD_DIM:
        return f"head dimension {q.shape[3]} > {MAX_HEAD_DIM}"
    if mask is not None and mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"a boolean or floating-point mask, got {mask.dtype}"
    return None


def splits_for(programs: int, keys: int, device: torch.device) -> int:
    """Splits per (batch, key / value head): enough programs for four per SM, each with a block of keys at
    least, and at most MAX_SPLITS (the merge loads them all at once), rounded to the nearest power of two: three
    or five splits measured slower than two, four or eight (a cache's unwritten tail leaves the last split with
    little work; docs/benchmarks.md). Above the keys' blocks the caller's chunking caps it."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    n = max(1, min(triton.cdiv(keys, BLOCK_N), triton.cdiv(4 * sms, programs), MAX_SPLITS))
    return min(1 << round(math.log2(n)), MAX_SPLITS)


def _triton(q, k, v, mask, scale: float, splits: int | None = None, k_scale=None, v_scale=None,
            sinks=None) -> torch.Tensor:
    batch = _batch(q, k, v, mask)
    _, kvh, rep, d = q.shape
    s = k.shape[2]
    q, k, v = (t.expand(batch, *t.shape[1:]) for t in (q, k, v))
    fp8 = k_scale is not None
    if fp8:  # bytes: the kernel decodes e4m3 itself
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        scales = (k_scale.reshape(-1), v_scale.reshape(-1))
        s_strides = tuple(int(t.numel() > 1) for t in scales)
    else:
        scales, s_strides = (q, q), (0, 0)
    out = torch.empty(batch, kvh, rep, d, dtype=q.dtype, device=q.device)
    if mask is None:
        kind, mask, m_strides = 0, q, (0, 0)
    else:
        mask = mask.expand(batch, 1, 1, s)
        kind, m_strides = (1 if mask.dtype == torch.bool else 2), (mask.stride(0), mask.stride(3))
        if kind == 1:
            mask = mask.view(torch.uint8)
    block_m, block_d = max(16, triton.next_power_of_2(rep)), max(16, triton.next_power_of_2(d))
    splits = min(splits or splits_for(batch * kvh, s, q.device), MAX_SPLITS)
    chunk = triton.cdiv(triton.cdiv(s, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(s, chunk)
    direct = splits == 1
    acc = out if direct else torch.empty(batch * kvh * splits * block_m * block_d, dtype=torch.float32,
                                         device=q.device)
    ml = out if direct else torch.empty(batch * kvh * splits * 2 * block_m, dtype=torch.float32, device=q.device)
    launch, emu = pdl(q), interpreting() and q.dtype == torch.bfloat16
    _split_kernel[(batch * kvh, splits)](
        q, k, v, mask, out, acc, ml, *scales, q if sinks is None else sinks.contiguous(), scale, s, rep, d, kvh,
        chunk, *q.stride(), *k.stride(), *v.stride(), *m_strides, *out.stride(), *s_strides, MASK_KIND=kind,
        KV_FP8=fp8, HAS_SINK=sinks is not None, DIRECT=direct,
        IEEE=q.dtype == torch.float32 or emu, EMU_BF16=emu, NATIVE_FP8=not interpreting(),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, num_warps=4, **launch)
    if not direct:
        block_s = triton.next_power_of_2(splits)
        _merge_kernel[(batch * kvh, rep)](acc, ml, out, rep, d, kvh, splits, *out.stride(), EMU_BF16=emu,
                                          BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=block_s,
                                          num_warps=4 if block_s * block_d <= 8192 else 8, **launch)
    return out


def reference(q, k, v, mask=None, scale: float | None = None, k_scale=None, v_scale=None, sinks=None) -> torch.Tensor:
    """SDPA on the same tensors (fp8 keys and values dequantized first): what the op computes. With sinks, the same
    math written out in fp32 with the sink column in the softmax, rounded to q's dtype."""
    if k_scale is not None:
        k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    logits = q.float() @ k.float().transpose(-1, -2) * (1.0 / math.sqrt(q.shape[3]) if scale is None else scale)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
    sink = sinks.float().reshape(1, q.shape[1], q.shape[2], 1).expand(*logits.shape[:3], 1)
    p = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    return (p @ v.float()).to(q.dtype)


@torch.library.custom_op(OP, mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     scale: float | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for a group's query rows ``q`` (b, kv_heads, rep, d) against the key /
    value heads ``k``, ``v`` (b, kv_heads, S, d); ``mask`` (b, 1, 1, S) boolean or additive, or None; ``scale``
    None is 1 / sqrt(d). With ``k_scale`` / ``v_scale`` (fp32, (1, kv_heads or 1, 1, 1)), ``k`` and ``v`` are an
    FP8 cache's float8_e4m3fn codes, read as ``q.dtype(code * scale)``. ``sinks`` (kv_heads * rep,): one logit per
    query head (head ``h * rep + r`` is row r of group h) the softmax spans too (module doc). Returns (b, kv_heads,
    rep, d) in q's dtype."""
    _check(q, k, v, mask, k_scale, v_scale, sinks)
    if triton_reason(q, k, v, mask, k_scale is not None) is None:
        return _triton(q, k, v, mask, 1.0 / math.sqrt(q.shape[3]) if scale is None else scale, None, k_scale,
                       v_scale, sinks)
    return reference(q, k, v, mask, scale, k_scale, v_scale, sinks).contiguous()


@decode_attention.register_fake
def _(q, k, v, mask=None, scale=None, k_scale=None, v_scale=None, sinks=None):
    _check(q, k, v, mask, k_scale, v_scale, sinks)
    return q.new_empty(_batch(q, k, v, mask), *q.shape[1:])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], inputs[3] if isinstance(inputs[3], torch.Tensor) else None,
                          inputs[7] if len(inputs) > 7 else None)
    ctx.scale = inputs[4]
    ctx.fp8 = inputs[5] is not None


def _backward(ctx, grad):
    if ctx.fp8:
        raise NotImplementedError(f"{OP}: no gradient through fp8 keys and values (an FP8 cache is for inference)")
    q, k, v, mask, sinks = ctx.saved_tensors
    n = len(ctx.needs_input_grad)  # the inputs passed: sinks among them or not
    needs = tuple(ctx.needs_input_grad[:3]) + (n > 7 and ctx.needs_input_grad[7],)
    with torch.enable_grad():
        q_, k_, v_, s_ = (None if t is None else t.detach().requires_grad_(need)
                          for t, need in zip((q, k, v, sinks), needs))
        out = reference(q_, k_, v_, mask, ctx.scale, sinks=s_)
        wanted = [t for t in (q_, k_, v_, s_) if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    q_g, k_g, v_g, s_g = (next(grads) if need else None for need in needs)
    return (q_g, k_g, v_g, None, None, None, None, s_g)[:n]


decode_attention.register_autograd(_backward, setup_context=_setup)
