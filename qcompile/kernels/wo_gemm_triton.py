"""Triton kernels of ``qcompile::wo_linear`` (host code, op and registry: :mod:`wo_gemm`).

``_wo_gemm_kernel``: split-K weight-only GEMM; ``_splitk_reduce_kernel``: sums the fp32 partials;
``_dequant_kernel``: the weight in x.dtype (bit-identical to quant_math); ``_permute_x_kernel``:
x reordered so that the partner slice of each code position is contiguous. Weights are read as
int32 words, code j of word w is element ``k = EPW*w + j``. Measurements: docs/kernels-wo.md.
"""

from __future__ import annotations

from .fp8_quant_triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# element formats the kernel decodes (constexpr FMT)
FMT_INT4, FMT_E2M1, FMT_INT8_OFFSET, FMT_INT8, FMT_FP8 = range(5)
# scale encodings (constexpr SCALE_KIND)
SK_FP32, SK_E4M3, SK_E8M0 = range(3)


def _int4_ptx(bf16: bool) -> str:
    """Marlin's trick: ``(w >> 4i) & 0x000F000F | magic`` puts codes i and i+4 into the mantissas of
    two 16-bit floats equal to magic + code (one lop3 for two elements); one packed fma subtracts
    magic + 8. 1.5 instructions per element instead of shift, and, or, fadd, cvt (4.5)."""
    if bf16:  # 0x4300 = 128.0 (ulp 1); 0xC308 = -136.0
        magic, one, bias, fma = "0x43004300", "0x3F803F80", "0xC308C308", "fma.rn.bf16x2"
    else:  # 0x6400 = 1024.0 (ulp 1); 0xE408 = -1032.0
        magic, one, bias, fma = "0x64006400", "0x3C003C00", "0xE408E408", "fma.rn.f16x2"
    body = "".join((f"shr.u32 t, $8, {4 * i};\n" if i else "mov.b32 t, $8;\n")
                   + f"lop3.b32 t, t, 0x000F000F, m, 0xEA;\n{fma} t, t, o, b;\nmov.b32 {{${i}, ${i + 4}}}, t;\n"
                   for i in range(4))
    return ("{\n.reg .b32 t, m, o, b;\n" + f"mov.b32 m, {magic};\nmov.b32 o, {one};\nmov.b32 b, {bias};\n"
            + body + "}")


def _e2m1_ptx() -> str:
    """e2m1 codes i and i+4 of a word, shifted so that e1 e0 m land on bf16 exponent bits 1..0 and the
    top mantissa bit and the sign on bit 15 (one shift, and, shift, lop3 for two elements); times
    2^126 (bias 127 vs 1; e = 0 comes out as the bf16 subnormal m * 2^-127, exact) and times the
    word's scale (one packed fma each). Products are exact: <= 2 + 4 significant bits, NVFP4's fp8
    or MX's power-of-two scale. bf16 only."""
    body = ""
    for i in range(4):
        sh = 6 - 4 * i
        body += (f"shl.b32 t, $8, {sh};\n" if sh > 0 else f"shr.u32 t, $8, {-sh};\n")
        body += "and.b32 t, t, 0x01C001C0;\n"
        body += (f"shl.b32 u, $8, {12 - 4 * i};\n" if i < 3 else "mov.b32 u, $8;\n")
        body += "lop3.b32 t, u, 0x80008000, t, 0xEA;\nfma.rn.bf16x2 t, t, p, z;\nfma.rn.bf16x2 t, t, sc, z;\n"
        body += f"mov.b32 {{${i}, ${i + 4}}}, t;\n"
    return ("{\n.reg .b32 t, u, sc, p, z;\ncvt.rn.bf16x2.f32 sc, $9, $9;\nmov.b32 p, 0x7E807E80;\n"
            "mov.b32 z, 0x80008000;\n" + body + "}")


if HAS_TRITON:
    _PTX_E2M1_BF16 = tl.constexpr(_e2m1_ptx())
    _PTX_INT4_BF16 = tl.constexpr(_int4_ptx(True))
    _PTX_INT4_FP16 = tl.constexpr(_int4_ptx(False))
    # the codes above as constexpr globals (jit functions read no plain globals)
    _FMT_INT4 = tl.constexpr(FMT_INT4)
    _FMT_E2M1 = tl.constexpr(FMT_E2M1)
    _FMT_INT8_OFFSET = tl.constexpr(FMT_INT8_OFFSET)
    _FMT_INT8 = tl.constexpr(FMT_INT8)
    _FMT_FP8 = tl.constexpr(FMT_FP8)
    _SK_FP32 = tl.constexpr(SK_FP32)
    _SK_E4M3 = tl.constexpr(SK_E4M3)
    _SK_E8M0 = tl.constexpr(SK_E8M0)

    @triton.jit
    def _decode(t, FMT: tl.constexpr):
        """int32 ``t`` with the element's code in its low bits -> fp32 element value (before scales).
        Integer ops and bitcasts only: 2^23 + c built as float bits, or the exponent/mantissa bits
        placed into an fp32 and subnormals fixed with min(2v - threshold, v) (exact)."""
        if FMT == _FMT_INT4:  # offset binary: q = c - 8
            v = ((t & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        elif FMT == _FMT_E2M1:  # s e1 e0 m; |v| = 2^(e-1)(1 + m/2), e = 0: m/2
            mag = (((t & 7) << 22) + 0x3F000000).to(tl.float32, bitcast=True)
            mag = tl.minimum(mag * 2.0 - 1.0, mag)
            v = tl.where((t & 8) != 0, -mag, mag)
        elif FMT == _FMT_INT8_OFFSET:  # q = c - 128
            v = ((t & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        elif FMT == _FMT_INT8:  # two's complement byte: q + 128 = byte ^ 0x80
            v = (((t & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        else:  # fp8 e4m3fn (0x7F/0xFF decode to +-480, not NaN)
            mag = (((t & 0x7F) << 20) + 0x3C000000).to(tl.float32, bitcast=True)
            mag = tl.minimum(mag * 2.0 - 0.015625, mag)
            v = tl.where((t & 0x80) != 0, -mag, mag)
        return v

    @triton.jit
    def _fp8_value(t, NATIVE: tl.constexpr):
        """e4m3 bytes -> fp32 values: the hardware conversion, or :func:`_decode` (the interpreter)."""
        if NATIVE:
            return t.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return _decode(t.to(tl.int32), _FMT_FP8)

    @triton.jit
    def _scale_value(s, SCALE_KIND: tl.constexpr):
        if SCALE_KIND == _SK_FP32:
            r = s.to(tl.float32)
        elif SCALE_KIND == _SK_E4M3:  # passed as uint8
            r = _decode(s.to(tl.int32), _FMT_FP8)
        else:  # e8m0 biased exponent: 2^(e-127); e = 0 is the subnormal 2^-127
            e = s.to(tl.int32)
            r = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)
        return r

    @triton.jit
    def _int4_codes_ptx(words, BF16: tl.constexpr):
        """int32 words [BN, BKW] -> 8 tensors [BN, BKW] of x's 16-bit float type: code j - 8 (sm_80+).
        See _int4_ptx."""
        if BF16:
            q = tl.inline_asm_elementwise(_PTX_INT4_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                                          dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            q = tl.inline_asm_elementwise(_PTX_INT4_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words],
                                          dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        return q

    @triton.jit
    def _e2m1_scaled_ptx(words, scale):
        """int32 words [BN, BKW], fp32 scale per word [BN, BKW] -> 8 bf16 tensors: value j * scale."""
        return tl.inline_asm_elementwise(_PTX_E2M1_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,f", [words, scale],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _x_slices(x_ptr, offs_m, m_ok, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EPW: tl.constexpr,
                  NATURAL: tl.constexpr = False, EVEN_K: tl.constexpr = True):
        """x[m, k0:k0+BLOCK_K] in one contiguous (cp.async-able, so pipelined) load, split in registers
        into EPW tensors [BLOCK_M, BLOCK_K/EPW]: slice j holds x[m, k0 + EPW*i + j], the partner of
        code j of word i (loading the slices directly would take 2-byte loads at a 16-byte stride, which
        cp.async cannot pipeline). Not EVEN_K: columns k >= K are 0 (the partial last K step)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        mask = m_ok[:, None] if EVEN_K else m_ok[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * K + kk[None, :], mask=mask, other=0.0)
        if NATURAL:  # tiled in natural-x order: word i = 16c + 4q + e, element j = 2jh + j0 holds
            # k = KPC c + 4 EPW e + 8 jh + 2q + j0 (quant_math.tile_words): the tile in (i, j) order first
            x = tl.reshape(x, (BLOCK_M, BLOCK_K // (16 * EPW), 4, EPW // 2, 4, 2))
            x = tl.reshape(tl.permute(x, (0, 1, 4, 2, 3, 5)), (BLOCK_M, BLOCK_K))
        return _split_slices(x, BLOCK_M, BLOCK_K // EPW, EPW)

    @triton.jit
    def _split_slices(x, BLOCK_M: tl.constexpr, BKW: tl.constexpr, EPW: tl.constexpr):
        """x [BLOCK_M, BKW * EPW] -> EPW tensors [BLOCK_M, BKW]: slice j holds x[m, EPW*i + j]."""
        if EPW == 8:  # k = 8i + 4*j2 + 2*j1 + j0; split peels j0, then j1, then j2
            e, o = tl.split(tl.reshape(x, (BLOCK_M, BKW, 2, 2, 2)))
            ee, eo = tl.split(e)
            oe, oo = tl.split(o)
            x0, x4 = tl.split(ee)
            x2, x6 = tl.split(eo)
            x1, x5 = tl.split(oe)
            x3, x7 = tl.split(oo)
            res = (x0, x1, x2, x3, x4, x5, x6, x7)
        else:
            e, o = tl.split(tl.reshape(x, (BLOCK_M, BKW, 2, 2)))
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)
            res = (x0, x1, x2, x3)
        return res

    @triton.jit
    def _scale_offsets(rows, offs_i, w0, stride_sn, EPW: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr,
                       GPS: tl.constexpr = 0):
        """Offsets of the scales of the K step at word w0: [BN, 1] when one scale per row covers the
        step; [BN, GPS], one per group, where GPS > 0 (whole groups per step); else [BN, BKW], one per
        word (a group never splits a word: GROUP % EPW == 0)."""
        if PER_ROW:
            off = (rows * stride_sn + (0 if GROUP == 0 else (w0 * EPW) // GROUP))[:, None]
        elif GPS > 0:
            off = rows[:, None] * stride_sn + ((w0 * EPW) // GROUP + tl.arange(0, GPS))[None, :]
        else:
            off = rows[:, None] * stride_sn + (((w0 + offs_i) * EPW) // GROUP)[None, :]
        return off

    @triton.jit
    def _scale_ok(offs_i, w0, K, EPW: tl.constexpr, GROUP: tl.constexpr, GPS: tl.constexpr):
        """[1, GPS] / [1, BKW]: which of _scale_offsets' entries lie inside K (a partial last step)."""
        if GPS > 0:
            ok = ((w0 * EPW) // GROUP + tl.arange(0, GPS)) < K // GROUP
        else:
            ok = (w0 + offs_i) < K // EPW
        return ok[None, :]

    @triton.jit
    def _per_word(v, BLOCK_N: tl.constexpr, BKW: tl.constexpr, GPS: tl.constexpr):
        """Scales (or zero points) of a step per word [BN, BKW]: from one per group [BN, GPS], each
        repeated over its group's words, where GPS > 0."""
        if GPS > 0:
            v = tl.reshape(tl.broadcast_to(v[:, :, None], (BLOCK_N, GPS, BKW // GPS)), (BLOCK_N, BKW))
        return v

    @triton.jit
    def _x_slices_permuted(x_ptr, offs_m, m_ok, k0, K, BKW: tl.constexpr, EPW: tl.constexpr):
        """The slices of _x_slices from x permuted by _permute_x_kernel: slice j is contiguous."""
        p = x_ptr + offs_m[:, None] * K + k0 + tl.arange(0, BKW)[None, :]
        mk = m_ok[:, None]
        x0 = tl.load(p, mask=mk, other=0.0)
        x1 = tl.load(p + BKW, mask=mk, other=0.0)
        x2 = tl.load(p + 2 * BKW, mask=mk, other=0.0)
        x3 = tl.load(p + 3 * BKW, mask=mk, other=0.0)
        if EPW == 8:
            x4 = tl.load(p + 4 * BKW, mask=mk, other=0.0)
            x5 = tl.load(p + 5 * BKW, mask=mk, other=0.0)
            x6 = tl.load(p + 6 * BKW, mask=mk, other=0.0)
            x7 = tl.load(p + 7 * BKW, mask=mk, other=0.0)
            res = (x0, x1, x2, x3, x4, x5, x6, x7)
        else:
            res = (x0, x1, x2, x3)
        return res

    @triton.jit
    def _permute_x_kernel(x_ptr, xp_ptr, K, BLOCK_K: tl.constexpr, EPW: tl.constexpr):
        # grid (M, K / BLOCK_K): within each K step, xp[k0 + j*BKW + i] = x[k0 + EPW*i + j]
        BKW: tl.constexpr = BLOCK_K // EPW
        offs = tl.program_id(0) * K + tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        v = tl.reshape(tl.trans(tl.reshape(tl.load(x_ptr + offs), (BKW, EPW))), (BLOCK_K,))
        tl.store(xp_ptr + offs, v)

    @triton.jit
    def _load_k(ptrs, ok, MASKED: tl.constexpr):
        """tl.load(ptrs), or where MASKED (a partial last K step) only where ``ok``, 0 elsewhere."""
        if MASKED:
            v = tl.load(ptrs, mask=ok, other=0)
        else:
            v = tl.load(ptrs)
        return v

    @triton.jit
    def _mma(a, b, acc, EMULATE_DOT: tl.constexpr):
        """acc + a @ b with a rounded to b's dtype. The Triton 3.9 interpreter multiplies bf16 operands
        as their raw uint16 bits, so there (EMULATE_DOT) the rounded operands go in as fp32."""
        a = a.to(b.dtype)
        if EMULATE_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @triton.jit
    def _word_offsets(rows, widx, stride_wn, TILED: tl.constexpr):
        """[len(rows), len(widx)] offsets of weight words (row, word index): row-major, or in
        wo_mma's tiled order (quant_math.tile_words) where a row's words i..i+15 of a 16-word
        chunk stay contiguous (so loads stay 16 bytes wide)."""
        if TILED:
            row = (rows // 16) * (stride_wn * 16) + ((rows % 16) // 8) * 128 + (rows % 8) * 16
            col = (widx // 16) * 256 + widx % 16
            col = tl.max_contiguous(tl.multiple_of(col, 16), 16)
            return row[:, None] + col[None, :]
        return rows[:, None] * stride_wn + widx[None, :]

    @triton.jit
    def _wo_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, gs_ptr, bias_ptr, out_ptr,
                        M, N, K, stride_wn, stride_sn, k_split_words,
                        FMT: tl.constexpr, EPW: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr,
                        HAS_GS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EMULATE_DOT: tl.constexpr = False, PTX_DECODE: tl.constexpr = False,
                        SCALE_PREFETCH: tl.constexpr = True, X_PERMUTED: tl.constexpr = False,
                        TILED: tl.constexpr = False, NATURAL: tl.constexpr = False, EVEN_K: tl.constexpr = True,
                        GROUPED: tl.constexpr = False, ROUTE: tl.constexpr = False, ids_ptr=None,
                        experts_ptr=None, route_ptr=None, A_DIV=1, stride_we=0, stride_se=0, stride_ge=0,
                        stride_be=0):
        # grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K): the M tiles of one weight tile run
        # side by side (their second reads hit L2). x [M, K] contiguous; out [M, N], or fp32
        # partials [SPLIT_K, M, N] when PARTIAL.
        # GROUPED (MoE experts, weights and their tensors stacked over experts): grid (row blocks of
        # moe_kernels.moe_align, ...); block pid_m is expert experts_ptr[pid_m] (-1: nothing to do) and
        # pairs ids_ptr[pid_m*BLOCK_M ...] (M = the number of pairs marks padding), x row pair // A_DIV.
        # out is fp32 [SPLIT_K, M, N] by pair: bias[expert] added by split 0, times route[pair] (ROUTE).
        # Not EVEN_K (K % BLOCK_K != 0): the last K step is partial, its words, scales, g_idx and x masked
        # (x beyond K is 0: a masked word decodes to a nonzero value); splits hold whole BLOCK_K but the last.
        tl.static_assert(EVEN_K or not (X_PERMUTED or TILED), "x permuted and tiled words need whole K steps")
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if GROUPED:
            expert = tl.load(experts_ptr + pid_m).to(tl.int64)
            if expert < 0:
                return
            out_m = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            m_ok = out_m < M
            offs_m = tl.where(m_ok, out_m // A_DIV, 0)  # the x rows
            w_ptr += expert * stride_we
            s_ptr += expert * stride_se
            if HAS_ZP:
                z_ptr += expert * stride_se
            if ACT_ORDER:
                g_ptr += expert * stride_ge
            if HAS_GS:
                gs_ptr += expert
            if HAS_BIAS:
                bias_ptr += expert * stride_be
        else:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < M
            out_m = offs_m
        BKW: tl.constexpr = BLOCK_K // EPW
        BITS: tl.constexpr = 32 // EPW
        # scale once per K step on the [BLOCK_N, BLOCK_M] dot result when one group spans the step
        POST: tl.constexpr = (not ACT_ORDER) and (GROUP == 0 or GROUP % BLOCK_K == 0)
        FAST_INT4: tl.constexpr = PTX_DECODE and POST and FMT == _FMT_INT4 and not HAS_ZP
        FAST_E2M1: tl.constexpr = (PTX_DECODE and FMT == _FMT_E2M1 and not POST
                                   and x_ptr.dtype.element_ty == tl.bfloat16)
        FAST: tl.constexpr = FAST_INT4 or FAST_E2M1
        # tiled 4-bit words hold element j at nibble j // 2 + 4 (j % 2) (quant_math.tile_words)
        PAIRS: tl.constexpr = TILED and EPW == 8
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_i = tl.arange(0, BKW)
        rows = tl.where(offs_n < N, offs_n, 0)  # clamp, so weight loads stay unmasked 16-byte loads
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T: the weight tile is the MMA's M side
        # iterate over words, not k: the word offset's divisibility (k_split_words % 16 == 0) is what
        # lets Triton emit 16-byte loads
        w_lo = pid_k * k_split_words
        w_hi = tl.minimum(w_lo + k_split_words, K // EPW)
        # Scales (and zero points) are loaded one K step ahead, by hand: Triton pipelines only the
        # weight and x tiles, and a scale load waited for at every step costs a DRAM latency each.
        PER_ROW: tl.constexpr = GROUP == 0 or POST
        # per-word loads masked in a partial step (a row's scale is always there: K % GROUP == 0)
        MASK_S: tl.constexpr = (not EVEN_K) and (not PER_ROW)
        # groups smaller than the step (NVFP4 16, MX 32, small int groups): each group's scale is loaded (and
        # decoded) once per step and repeated over its words in registers; one gathered byte load per word
        # took 1.8-3.4x the time (docs/kernels-moe.md)
        GPS: tl.constexpr = BLOCK_K // GROUP if (not PER_ROW) and (not ACT_ORDER) and BLOCK_K % GROUP == 0 else 0
        KW = K // EPW
        w_last = w_hi - BKW if EVEN_K else w_lo + (w_hi - 1 - w_lo) // BKW * BKW  # the last step's start
        if (not ACT_ORDER) and SCALE_PREFETCH:
            soff = _scale_offsets(rows, offs_i, w_lo, stride_sn, EPW, GROUP, PER_ROW, GPS)
            s_next = _load_k(s_ptr + soff, _scale_ok(offs_i, w_lo, K, EPW, GROUP, GPS), MASK_S)
            if HAS_ZP:
                z_next = _load_k(z_ptr + soff, _scale_ok(offs_i, w_lo, K, EPW, GROUP, GPS), MASK_S)
        for w0 in range(w_lo, w_hi, BKW):
            w_ok = (w0 + offs_i < KW)[None, :]
            words = _load_k(w_ptr + _word_offsets(rows, w0 + offs_i, stride_wn, TILED), w_ok, not EVEN_K)  # [BN, BKW]
            k0 = w0 * EPW
            kk = k0 + offs_i * EPW  # first k of each word
            if (not ACT_ORDER) and SCALE_PREFETCH:
                s = _per_word(_scale_value(s_next, SCALE_KIND), BLOCK_N, BKW, GPS)  # [BN, 1] per row, else [BN, BKW]
                if HAS_ZP:
                    z = _per_word(z_next.to(tl.float32), BLOCK_N, BKW, GPS)
                w_pre = tl.minimum(w0 + BKW, w_last)
                soff = _scale_offsets(rows, offs_i, w_pre, stride_sn, EPW, GROUP, PER_ROW, GPS)
                s_next = _load_k(s_ptr + soff, _scale_ok(offs_i, w_pre, K, EPW, GROUP, GPS), MASK_S)
                if HAS_ZP:
                    z_next = _load_k(z_ptr + soff, _scale_ok(offs_i, w_pre, K, EPW, GROUP, GPS), MASK_S)
            if (not ACT_ORDER) and (not SCALE_PREFETCH):
                soff = _scale_offsets(rows, offs_i, w0, stride_sn, EPW, GROUP, PER_ROW, GPS)
                s_ok = _scale_ok(offs_i, w0, K, EPW, GROUP, GPS)
                s = _per_word(_scale_value(_load_k(s_ptr + soff, s_ok, MASK_S), SCALE_KIND), BLOCK_N, BKW, GPS)
                if HAS_ZP:
                    z = _per_word(_load_k(z_ptr + soff, s_ok, MASK_S).to(tl.float32), BLOCK_N, BKW, GPS)
            if POST:
                part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            if FAST_INT4:  # codes - 8 in x.dtype, scaled after the dot
                q = _int4_codes_ptx(words, x_ptr.dtype.element_ty == tl.bfloat16)
            if FAST_E2M1:  # scaled values in bf16
                q = _e2m1_scaled_ptx(words, tl.broadcast_to(s, (BLOCK_N, BKW)))
            if X_PERMUTED:
                xs = _x_slices_permuted(x_ptr, offs_m, m_ok, k0, K, BKW, EPW)
            else:
                xs = _x_slices(x_ptr, offs_m, m_ok, k0, K, BLOCK_M, BLOCK_K, EPW, NATURAL, EVEN_K)
            for j in tl.static_range(EPW if FAST else 0):
                xt = tl.trans(xs[j])  # element j is nibble j // 2 + 4 (j % 2) of a tiled 4-bit word
                if FAST_INT4:
                    part = tl.dot(q[j + PAIRS * (j // 2 + 4 * (j % 2) - j)], xt, part)
                else:
                    acc = tl.dot(q[j + PAIRS * (j // 2 + 4 * (j % 2) - j)], xt, acc)
            for j in tl.static_range(0 if FAST else EPW):  # portable decode (fp32), any format
                v = _decode(words >> ((j + PAIRS * (j // 2 + 4 * (j % 2) - j)) * BITS), FMT)  # elements k = kk + j
                if ACT_ORDER:  # column k uses group g_idx[k]
                    gsel = rows[:, None] * stride_sn + _load_k(g_ptr + kk + j, kk < K, not EVEN_K)[None, :]
                    s = _scale_value(tl.load(s_ptr + gsel), SCALE_KIND)
                    if HAS_ZP:
                        z = tl.load(z_ptr + gsel).to(tl.float32)
                if HAS_ZP:
                    v = v - z
                xt = tl.trans(xs[j])
                if POST:
                    part = _mma(v, xt, part, EMULATE_DOT)  # [BN, BM]
                else:
                    acc = _mma(v * s, xt, acc, EMULATE_DOT)
            if POST:
                acc += part * s
        res = acc  # [BN, BM]
        n2 = offs_n[:, None]
        m2 = out_m[None, :]
        if HAS_GS:
            res = res * tl.load(gs_ptr).to(tl.float32)
        mask = (n2 < N) & (m2 < M)
        if GROUPED:
            if HAS_BIAS:
                first = (pid_k == 0).to(tl.float32)
                res = res + tl.load(bias_ptr + n2, mask=n2 < N, other=0.0).to(tl.float32) * first
            if ROUTE:
                res = res * tl.load(route_ptr + m2, mask=m2 < M, other=0.0).to(tl.float32)
            tl.store(out_ptr + (pid_k * M + m2).to(tl.int64) * N + n2, res, mask=mask)
        elif PARTIAL:
            tl.store(out_ptr + (pid_k * M + m2).to(tl.int64) * N + n2, res, mask=mask)
        else:
            if HAS_BIAS:
                res = res + tl.load(bias_ptr + n2, mask=n2 < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + m2 * N + n2, res.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N,
                              SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * MN.to(tl.int64) + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, z_ptr, g_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn,
                        FMT: tl.constexpr, EPW: tl.constexpr, SCALE_KIND: tl.constexpr, GROUP: tl.constexpr,
                        HAS_GS: tl.constexpr, HAS_ZP: tl.constexpr, ACT_ORDER: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr = False,
                        NATURAL: tl.constexpr = False, GROUPED: tl.constexpr = False, EVEN_K: tl.constexpr = True,
                        stride_we=0, stride_se=0, stride_ge=0):
        # grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)): out[n, k] = ((q - z) * s) * g, the order of quant_math.
        # GROUPED: grid (..., E), every tensor stacked over experts (out [E, N, K]). Not EVEN_K: the last
        # block is partial, its loads and store masked.
        tl.static_assert(EVEN_K or not TILED, "tiled words need whole K blocks")
        if GROUPED:
            e = tl.program_id(2).to(tl.int64)
            w_ptr += e * stride_we
            s_ptr += e * stride_se
            out_ptr += e * N * K
            if HAS_ZP:
                z_ptr += e * stride_se
            if ACT_ORDER:
                g_ptr += e * stride_ge
            if HAS_GS:
                gs_ptr += e
        BKW: tl.constexpr = BLOCK_K // EPW
        BITS: tl.constexpr = 32 // EPW
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_n < N, offs_n, 0)
        offs_i = tl.arange(0, BKW)
        j = tl.arange(0, EPW)
        sl = j // 2 + 4 * (j % 2) if TILED and EPW == 8 else j  # element j's nibble (see _wo_gemm_kernel)
        widx = tl.program_id(1) * BKW + offs_i
        words = _load_k(w_ptr + _word_offsets(rows, widx, stride_wn, TILED), (widx < K // EPW)[None, :], not EVEN_K)
        v = _decode(words[:, :, None] >> (sl * BITS)[None, None, :], FMT)  # [BN, BKW, EPW]
        if NATURAL:  # word i = 16c + 4q + e, element j = 2jh + j0 is k = KPC c + 4 EPW e + 8 jh + 2q + j0
            v = tl.reshape(v, (BLOCK_N, BLOCK_K // (16 * EPW), 4, 4, EPW // 2, 2))
            v = tl.reshape(tl.permute(v, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BKW, EPW))
        # (v: k in natural order)
        if ACT_ORDER:  # a scale per element, gathered through g_idx
            k = tl.program_id(1) * BLOCK_K + (offs_i * EPW)[:, None] + j[None, :]  # [BKW, EPW]
            sidx = rows[:, None, None] * stride_sn + _load_k(g_ptr + k, k < K, not EVEN_K)[None, :, :]
            s_ok = (k < K)[None, :, :]
        else:  # each scale loaded and decoded once, broadcast over its group (or row)
            GPB: tl.constexpr = 1 if GROUP == 0 or GROUP >= BLOCK_K else BLOCK_K // GROUP  # groups per block
            v = tl.reshape(v, (BLOCK_N, GPB, BLOCK_K // GPB))
            first = 0 if GROUP == 0 else tl.program_id(1) * BLOCK_K // GROUP
            sidx = (rows[:, None] * stride_sn + first + tl.arange(0, GPB)[None, :])[:, :, None]  # [BN, GPB, 1]
            s_ok = ((first + tl.arange(0, GPB)) * GROUP < K)[None, :, None]
        if HAS_ZP:
            v = v - _load_k(z_ptr + sidx, s_ok, not EVEN_K).to(tl.float32)
        v = v * _scale_value(_load_k(s_ptr + sidx, s_ok, not EVEN_K), SCALE_KIND)
        if HAS_GS:
            v = v * tl.load(gs_ptr).to(tl.float32)
        out = tl.reshape(v, (BLOCK_N, BLOCK_K))
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = (offs_n < N)[:, None] if EVEN_K else (offs_n < N)[:, None] & (cols < K)[None, :]
        tl.store(out_ptr + offs_n[:, None] * K + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
