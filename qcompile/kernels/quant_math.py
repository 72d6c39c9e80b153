"""Quantization arithmetic in plain PyTorch: the semantics every kernel is checked against.

All functions are device-generic and work in fp32. Shapes: x [M, K], weight [N, K] (row-major, as
``nn.Linear`` stores it), scales in the canonical shapes of :func:`qcompile.scheme.canonical_shape`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..scheme import TILE_K, ActSpec, Granularity, Packing, QDtype, ScaleDtype, WeightSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest dynamic scale: an all-zero row must not divide by zero (vLLM uses 1/(448*512) likewise).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating x / scale -> fp8 e4m3 (``scale`` broadcasts against ``x``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(q · scale)``, multiplied in fp32 (the in-place product casts once) with no fp32 copy."""
    return q.to(dtype).mul_(scale)


def dynamic_fp8_scale(x: torch.Tensor, granularity: Granularity, group_size: int = 0) -> torch.Tensor:
    """Scale for dynamic activation quantization of x [M, K]:
    TENSOR -> [] ; TOKEN -> [M, 1] ; GROUP -> [M, K // group_size]."""
    xf = x.float().abs()
    if granularity is Granularity.TENSOR:
        amax = xf.amax()
    elif granularity is Granularity.TOKEN:
        amax = xf.amax(dim=-1, keepdim=True)
    elif granularity is Granularity.GROUP:
        amax = groups(xf, group_size).amax(dim=-1)
    else:
        raise AssertionError(f"activation granularity {granularity}")
    return fp8_scale_from_amax(amax)


def groups(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [M, K] as fp32 [M, ceil(K/g), g]: 1 x g groups along K, a partial last group padded with zeros
    (which change no group's amax: a K that is not a multiple of g has a last group of K % g elements)."""
    m, k = x.shape
    return torch.nn.functional.pad(x.float(), (0, -k % g)).view(m, -(-k // g), g)


def fp8_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
    # 1 ulp off for about half the scales, which flips ~0.07 % of the fp8 codes vs the kernels.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def expand_scale(scale: torch.Tensor, spec_granularity: Granularity, n: int, k: int,
                 group_size: int = 0, block: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Broadcast a canonical weight scale to [n, k] (or something broadcastable to it)."""
    if spec_granularity is Granularity.TENSOR:
        return scale.reshape(())
    if spec_granularity is Granularity.CHANNEL:
        return scale.reshape(n, 1)
    if spec_granularity is Granularity.GROUP:
        return scale.repeat_interleave(group_size, dim=1)[:, :k]
    if spec_granularity is Granularity.BLOCK:
        bn, bk = block
        return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    raise AssertionError(f"weight granularity {spec_granularity}")


def scale_to_fp32(scale: torch.Tensor, dtype: ScaleDtype) -> torch.Tensor:
    if dtype is ScaleDtype.E8M0:  # uint8 biased exponent
        return torch.exp2(scale.to(torch.int32).float() - 127.0)
    return scale.float()


# e2m1 code -> value (sign bit 3, exponent bits 2..1, mantissa bit 0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_int32(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """compressed-tensors pack-quantized: [N, K*bits/32] int32 -> signed codes int32 [N, K]
    (code j of each word at bits*j, stored with offset 2^(bits-1))."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [N, K/per, per]
    return codes.reshape(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: signed codes [N, K] -> [N, ceil(K*bits/32)] int32; the bits of a
    last partial word past K are 0 (as compressed-tensors' ``pack_to_int32`` leaves them)."""
    per = 32 // bits
    u = codes.to(torch.int64) + (1 << (bits - 1))
    u = torch.nn.functional.pad(u, (0, -codes.shape[1] % per)).reshape(codes.shape[0], -1, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def permute_int4_words(words: torch.Tensor, source: tuple[int, ...]) -> torch.Tensor:
    """int32 words of eight int4 codes: nibble j of the result is nibble ``source[j]`` of ``words`` with its
    top bit flipped (two's complement <-> offset 8). From Quark's words (nibble i holds code order[i]) to
    :func:`unpack_int32`'s with ``source`` the inverse of order; back with ``source`` = order."""
    out = torch.zeros_like(words)
    for j, i in enumerate(source):
        out |= (((words >> (4 * i)) & 0xF) ^ 0x8) << (4 * j)
    return out


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of the code step of :func:`unpack_e2m1`: e2m1 codes [N, K] (0..15) -> [N, K/2] uint8."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte, low nibble = even element: [N, K/2] uint8 -> fp32 values [N, K]."""
    lut = torch.tensor(E2M1_VALUES, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return lut[codes.long()]


# A tiled 4-bit word holds its 8 elements in pair order: nibble j (bits 4j..4j+3) is element
# (j % 4) * 2 + j // 4, so nibbles (p, p + 4) are the natural pair (2p, 2p + 1) that one `& 0x000F000F`
# extracts. x then needs no reordering in the kernel. As bytes of the little-endian word, canonical
# b0..b3 become (lo b0 | lo b1 << 4, lo b2 | lo b3 << 4, hi b0 | hi b1 << 4, hi b2 | hi b3 << 4).
_PAIR_ROWS = 2048  # rows per step of the in-place nibble permutation (bounds its temporaries)


def _permute_nibbles(words: torch.Tensor, source: torch.Tensor, to_pairs: bool) -> torch.Tensor:
    """Canonical 4-bit words <-> pair order (see above) of int32 [N, W] ``words``: in place, unless they are
    still a view of the caller's ``source`` (a permutation that moved nothing), then on a copy."""
    if words.data_ptr() == source.data_ptr():
        words = words.clone()
    b = words.view(torch.uint8).view(words.shape[0], -1, 4)
    for r in range(0, b.shape[0], _PAIR_ROWS):
        part = b[r:r + _PAIR_ROWS]
        lo, hi = part & 0xF, part >> 4
        if to_pairs:
            part[..., 0] = lo[..., 0] | (lo[..., 1] << 4)
            part[..., 1] = lo[..., 2] | (lo[..., 3] << 4)
            part[..., 2] = hi[..., 0] | (hi[..., 1] << 4)
            part[..., 3] = hi[..., 2] | (hi[..., 3] << 4)
        else:
            part[..., 0] = lo[..., 0] | (lo[..., 2] << 4)
            part[..., 1] = hi[..., 0] | (hi[..., 2] << 4)
            part[..., 2] = lo[..., 1] | (lo[..., 3] << 4)
            part[..., 3] = hi[..., 1] | (hi[..., 3] << 4)
    return words


def tiles_natural(spec: WeightSpec) -> bool:
    """Whether :func:`tile_weight` puts ``spec``'s chunks in natural-x order (see :func:`tile_words`): where one
    scale (and zero point) covers each chunk of a row, so that a lane's scattered k need no more scales than
    before; NVFP4, MX and int groups below a chunk keep the lanes' own consecutive k."""
    gran, g = spec.scale.granularity, spec.scale.group_size
    return gran in (Granularity.TENSOR, Granularity.CHANNEL) or (gran is Granularity.GROUP and
                                                                 g >= TILE_K[spec.dtype.bits])


def _pair_view(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [N, W] as their element pairs: bytes (4-bit) or 16-bit units (8-bit), [N, 2W or 4W]."""
    return words.view(torch.uint8 if bits == 4 else torch.int16)


def untile_words(weight: torch.Tensor, bits: int, natural: bool = False) -> torch.Tensor:
    """The canonical words of a weight tiled for wo_mma (:func:`tile_words`), in its dtype."""
    words = weight.contiguous().view(torch.int32)
    n, w = words.shape
    if natural:  # (the nibble order first: it stays within a word)
        if bits == 4:
            words = _permute_nibbles(words, weight, to_pairs=False)
        a = TILE_K[bits] // 8
        words = _pair_view(words, bits).view(n // 16, w // 16, 2, 8, 4, a).permute(0, 2, 3, 1, 5, 4)
        return words.reshape(n, -1).view(torch.int32).view(weight.dtype)
    words = words.view(n // 16, w // 16, 2, 8, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(n, w)
    if bits == 4:
        words = _permute_nibbles(words, weight, to_pairs=False)
    return words.view(weight.dtype)


def tile_words(weight: torch.Tensor, bits: int, natural: bool = False) -> torch.Tensor:
    """Canonical weight [N, K/EPW] words (any 4-byte-per-word view: int32, or uint8 / int8 / fp8 rows of
    4-byte multiples) of ``bits``-bit elements -> wo_mma's streaming order, same shape, dtype and size:
    [N/16 tiles][W/16 chunks][2 row halves][8 rows][4 lanes][4 words], so each warp of the kernel reads
    one contiguous run; 4-bit words with their nibbles in pair order (above). N % 16 == 0 and
    W % 16 == 0. One new tensor; the permutation's temporaries are bounded by ``_PAIR_ROWS`` rows.

    Which k lane q of a chunk (``TILE_K[bits]`` elements from k0) holds, as its 16 bytes' element pairs
    a = 0, 1, ...: by default its own consecutive run, pair a = k0 + TILE_K/4 q + 2a (+ 0, 1); ``natural``:
    k0 + 8a + 2q (+ 0, 1). That is where mma's B fragment of lane q takes x within each k16 step, so
    the kernel then reads x (the B operand) in its natural order, as a TMA box (docs/kernels-wo.md);
    a lane's k then span the whole chunk, so one scale must cover it (:func:`tiles_natural`)."""
    words = weight.contiguous().view(torch.int32)
    n, w = words.shape
    if natural:
        a = TILE_K[bits] // 8
        words = _pair_view(words, bits).view(n // 16, 2, 8, w // 16, a, 4).permute(0, 3, 1, 2, 5, 4)
        words = words.reshape(n, -1).view(torch.int32)
    else:
        words = words.view(n // 16, 2, 8, w // 16, 4, 4).permute(0, 3, 1, 2, 4, 5).reshape(n, w)
    if bits == 4:
        words = _permute_nibbles(words, weight, to_pairs=True)
    return words.view(weight.dtype)


def tile_weight(weight: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """:func:`tile_words` of a stored weight in the order its spec runs in (:func:`tiles_natural`)."""
    return tile_words(weight, spec.dtype.bits, tiles_natural(spec))


def pad_to_tiles(tensors: tuple, spec: WeightSpec, k: int) -> tuple:
    """The canonical (weight, scale, global scale, zero point, g_idx) of a weight with ``k`` input features
    (stacked over experts or not) with K padded to ``spec.stored_k(k)`` for tiling (``spec`` the tiled spec;
    scheme.canonical_shape): zero weight words, group scales 1.0 in their dtype, zero points 0. Tensors that
    need no padding are returned as they are."""
    weight, scale, gs, zp, g_idx = tensors
    kp = spec.stored_k(k)
    if kp == k:
        return tensors

    def pad(t, cols, fill):
        if t is None or t.shape[-1] >= cols:
            return t
        extra = torch.full((*t.shape[:-1], cols - t.shape[-1]), fill, dtype=torch.float32, device=t.device)
        return torch.cat((t, extra.to(t.dtype)), dim=-1)

    weight = pad(weight, spec.packing.storage_cols(kp, spec.dtype.bits), 0)
    if spec.scale.granularity is Granularity.GROUP:
        cols = -(-kp // spec.scale.group_size)
        one = 127 if spec.scale.dtype is ScaleDtype.E8M0 else 1.0
        scale, zp = pad(scale, cols, one), pad(zp, cols, 0)
    return weight, scale, gs, zp, g_idx


def untile_weight(weight: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The canonical words of a weight stored tiled (``spec.tiled``) by :func:`tile_weight`."""
    return untile_words(weight, spec.dtype.bits, tiles_natural(spec))


def sort_act_order(weight: torch.Tensor, g_idx: torch.Tensor, spec: WeightSpec, k: int,
                   rows_per_step: int = 4096) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An act-order int weight with its input columns sorted by group, as Marlin runs GPTQ act-order:
    (stored weight, perm) with stored column j = original column perm[j], so that column j uses group
    j // G and ``x[:, perm] @ stored^T`` is the layer (spec ``k_sorted``, perm passed as its g_idx).
    None when g_idx does not give every group exactly G columns (then the sorted groups would not be
    contiguous). The codes are moved exactly; ``rows_per_step`` bounds the unpacked copy in memory."""
    g = spec.scale.group_size
    if k % g or g_idx.shape != (k,):
        return None
    perm = torch.sort(g_idx.long(), stable=True).indices
    if not torch.equal(g_idx.long()[perm], torch.arange(k, device=g_idx.device) // g):
        return None
    return _take_columns(weight, perm, spec, k, rows_per_step), perm.to(torch.int32)


def unsort_act_order(weight: torch.Tensor, perm: torch.Tensor, spec: WeightSpec, k: int,
                     rows_per_step: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`sort_act_order`: (the weight in its original column order, the original
    g_idx, int32) from the sorted weight and its perm."""
    perm = perm.long()
    ks = torch.arange(k, device=perm.device)
    inverse, g_idx = torch.empty_like(perm), torch.empty_like(perm)
    inverse[perm] = ks
    g_idx[perm] = ks // spec.scale.group_size
    return _take_columns(weight, inverse, spec, k, rows_per_step), g_idx.to(torch.int32)


def _take_columns(weight: torch.Tensor, cols: torch.Tensor, spec: WeightSpec, k: int, rows_per_step: int):
    """A stored weight whose element column j is ``weight``'s column ``cols[j]`` (codes moved exactly)."""
    out = torch.empty_like(weight)
    for r in range(0, weight.shape[0], rows_per_step):
        part = weight[r:r + rows_per_step]
        if spec.packing is Packing.INT32:
            out[r:r + rows_per_step] = pack_int32(unpack_int32(part, spec.dtype.bits, k)[:, cols], spec.dtype.bits)
        else:
            out[r:r + rows_per_step] = part[:, cols]
    return out


def minifloat_values(dtype: QDtype) -> torch.Tensor:
    """The value of every code of an OCP minifloat (fp4 / fp6), fp32 [2^bits]: sign in the top bit, then
    the biased exponent, then the mantissa; exponent 0 is subnormal (no implicit 1)."""
    ebits, man, bias, _ = MINIFLOATS[dtype]
    codes = torch.arange(1 << (1 + ebits + man))
    exp, frac = (codes >> man) & ((1 << ebits) - 1), (codes & ((1 << man) - 1)).float() / (1 << man)
    mag = torch.where(exp == 0, frac * 2.0 ** (1 - bias), (1 + frac) * torch.exp2(exp.float() - bias))
    return torch.where(codes >> (ebits + man) == 1, -mag, mag)


def minifloat_codes(v: torch.Tensor, dtype: QDtype) -> torch.Tensor:
    """fp32 values -> codes (uint8) of the nearest minifloat value (:func:`round_to_minifloat`); the sign
    of a value that rounds to zero is kept (-0 has the sign bit)."""
    ebits, man, bias, _ = MINIFLOATS[dtype]
    a = round_to_minifloat(v, dtype).abs()
    exp = torch.floor(torch.log2(a.clamp(min=2.0 ** -30))) + bias
    sub = exp < 1
    frac = torch.where(sub, a / 2.0 ** (1 - bias), a / torch.exp2(exp - bias) - 1)
    code = torch.where(sub, 0, exp.clamp(min=0)).long() << man | torch.round(frac * (1 << man)).long()
    return (code | (torch.signbit(v).long() << (ebits + man))).to(torch.uint8)


def unpack_fp6(packed: torch.Tensor, dtype: QDtype) -> torch.Tensor:
    """Four 6-bit codes in three bytes, element i of a group at bits 6i..6i+5 of the little-endian 24-bit
    word (Quark's fp6 packing): [N, 3K/4] uint8 -> fp32 values [N, K]."""
    b = packed.reshape(packed.shape[0], -1, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    codes = torch.stack([(word >> (6 * i)) & 0x3F for i in range(4)], dim=-1).reshape(packed.shape[0], -1)
    return minifloat_values(dtype).to(packed.device)[codes.long()]


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of the code step of :func:`unpack_fp6`: 6-bit codes [N, K] (K % 4 == 0) -> [N, 3K/4] uint8."""
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1).reshape(codes.shape[0], -1).to(torch.uint8)


def decode_weight_codes(weight: torch.Tensor, spec: WeightSpec, k: int) -> torch.Tensor:
    """Element values (before scales) of a stored weight, fp32 [N, K]."""
    if spec.tiled:  # (K padded to whole chunks: the codes past k are dropped)
        weight = untile_weight(weight, spec)
    if spec.packing is Packing.INT32:
        return unpack_int32(weight, spec.dtype.bits, k).float()
    if spec.packing is Packing.UINT8 and spec.dtype is QDtype.FP4_E2M1:
        return unpack_e2m1(weight)[:, :k]
    if spec.packing is Packing.UINT8_FP6 and spec.dtype in (QDtype.FP6_E2M3, QDtype.FP6_E3M2):
        return unpack_fp6(weight, spec.dtype)
    if spec.packing is Packing.NONE:
        return weight[:, :k].float()
    raise NotImplementedError(f"reference decoding of {spec.dtype.value} weights packed as {spec.packing.value}")


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, spec: WeightSpec,
                      global_scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
                      g_idx: torch.Tensor | None = None, k: int | None = None) -> torch.Tensor:
    """fp32 [N, K] from a stored weight and its canonical tensors: ``(q - z) * s * global``.
    ``k`` (in_features) is needed only for packed weights whose K is not the stored width."""
    n = weight.shape[0]
    if k is None:
        k = weight.shape[1] * {Packing.NONE: 1, Packing.INT32: 32 // spec.dtype.bits, Packing.UINT8: 2,
                               Packing.UINT8_FP6: 4 / 3}[spec.packing]
        k = int(k)
    if spec.k_sorted:  # stored column j is original column g_idx[j] (sort_act_order)
        stored = dequantize_weight(weight, scale, replace(spec, k_sorted=False), global_scale, zero_point, None, k)
        w = torch.empty_like(stored)
        w[:, g_idx.long()] = stored
        return w
    q = decode_weight_codes(weight, spec, k)
    s = scale_to_fp32(scale, spec.scale.dtype)
    gran = spec.scale.granularity
    if g_idx is not None:  # act-order: column j uses group g_idx[j]
        expand = lambda t: t[:, g_idx.long()]  # noqa: E731
    else:
        expand = lambda t: expand_scale(t, gran, n, k, spec.scale.group_size, spec.scale.block)  # noqa: E731
    if zero_point is not None:
        q = q - expand(zero_point.float())
    w = q * expand(s)
    if global_scale is not None:
        w = w * global_scale.float()
    return w


INT8_MIN, INT8_MAX = -128.0, 127.0


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Saturating round-half-even(x / scale) -> int8, as vLLM's ``scaled_int8_quant``."""
    return torch.round(x.float() / scale).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def quantize_activation(x: torch.Tensor, act: ActSpec, input_scale: torch.Tensor | None = None):
    """FP8- or INT8-quantize x [M, K] as ``act`` says (symmetric). Returns (q fp8 / int8 [M, K], scale
    broadcastable to the per-element scale: [] / [M, 1] / [M, K//g]). A dynamic int8 scale is amax / 127."""
    if act.dtype is QDtype.INT8:
        if act.dynamic:
            amax = x.float().abs().amax() if act.scale.granularity is Granularity.TENSOR else \
                x.float().abs().amax(dim=-1, keepdim=True)
            scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=MIN_SCALE)
        else:
            scale = input_scale.float().reshape(())
        return quantize_int8(x, scale), scale
    if act.dtype is not QDtype.FP8_E4M3:
        raise NotImplementedError(f"reference quantization of {act.dtype.value} activations")
    if act.dynamic:
        scale = dynamic_fp8_scale(x, act.scale.granularity, act.scale.group_size)
    else:
        scale = input_scale.float().reshape(())
    if act.scale.granularity is Granularity.GROUP:
        m, k = x.shape
        q = quantize_fp8(groups(x, act.scale.group_size), scale.unsqueeze(-1)).view(m, -1)[:, :k]
    else:
        q = quantize_fp8(x, scale)
    return q, scale


E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# (exponent bits, mantissa bits, exponent bias, largest magnitude) of the OCP minifloats
MINIFLOATS = {QDtype.FP4_E2M1: (2, 1, 1, 6.0), QDtype.FP6_E2M3: (2, 3, 1, 7.5), QDtype.FP6_E3M2: (3, 2, 3, 28.0),
              QDtype.FP8_E4M3: (4, 3, 7, 448.0)}
# OCP MX: the shared scale is 2^(floor(log2(amax)) - emax), emax = the element type's largest exponent
MX_EMAX = {QDtype.FP4_E2M1: 2, QDtype.FP6_E2M3: 2, QDtype.FP6_E3M2: 4, QDtype.FP8_E4M3: 8}


def round_to_minifloat(v: torch.Tensor, dtype: QDtype) -> torch.Tensor:
    """Round fp32 values to the nearest value of a small float type (subnormals included, ties to
    even, saturating at its largest magnitude), returned as fp32."""
    _, man, bias, top = MINIFLOATS[dtype]
    a = v.abs().clamp(max=top)
    exp = torch.floor(torch.log2(a.clamp(min=2.0 ** -30))).clamp(min=1 - bias)  # subnormals share emin
    step = torch.exp2(exp - man)
    return (torch.round(a / step) * step).clamp(max=top) * v.sign()


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    return round_to_minifloat(v, QDtype.FP4_E2M1)


def qdq_mx_activation(x: torch.Tensor, dtype: QDtype, group: int = 32) -> torch.Tensor:
    """OCP MX activation quantize-dequantize: per ``group`` elements a power-of-two (e8m0) scale,
    elements of ``dtype``. fp32 [M, K]."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - MX_EMAX[dtype]
    scale = torch.exp2(exp.clamp(-127, 127))
    return (round_to_minifloat(xg / scale, dtype) * scale).view(m, k)


def qdq_nvfp4_activation(x: torch.Tensor, global_scale: torch.Tensor, group: int = 16) -> torch.Tensor:
    """NVFP4 activation quantize-dequantize (W4A4 emulation): per 16 elements an fp8-e4m3 scale of
    amax/6 in units of the (static, multiplying) global scale, e2m1 codes. fp32 [M, K]."""
    m, k = x.shape
    g = global_scale.float().reshape(())
    xg = x.float().view(m, k // group, group)
    s = (xg.abs().amax(-1, keepdim=True) / 6.0 / g).clamp(max=FP8_MAX).to(FP8).float()
    denom = torch.where(s > 0, s * g, torch.ones_like(s))
    q = round_to_e2m1(xg / denom)
    return (q * s * g).view(m, k)


def qdq_activation(x: torch.Tensor, act: ActSpec, input_scale=None, input_global_scale=None) -> torch.Tensor:
    """The activations a kernel of scheme ``act`` effectively multiplies, fp32 [M, K]."""
    if act.dtype is QDtype.FP4_E2M1 and act.global_scale:
        return qdq_nvfp4_activation(x, input_global_scale, act.scale.group_size)
    if act.scale.dtype is ScaleDtype.E8M0:
        return qdq_mx_activation(x, act.dtype, act.scale.group_size)
    q, s = quantize_activation(x, act, input_scale)
    return dequantize_activation(q, s, act)


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, act: ActSpec) -> torch.Tensor:
    if act.scale.granularity is Granularity.GROUP:
        m, k = q.shape
        return (groups(q, act.scale.group_size) * scale.unsqueeze(-1)).view(m, -1)[:, :k]
    return q.float() * scale


def requantize_to_max_scale(weights: list[torch.Tensor], scales: list[torch.Tensor]):
    """Several FP8 (or INT8) shards with per-tensor scales that run as one matmul (fused qkv / gate_up,
    or the experts' gate and up): dequantize each and requantize with the largest scale, as the
    reference does. Returns (codes [sum N_i, K] in the shards' dtype, fp32 scalar scale)."""
    max_scale = torch.stack([s.float().reshape(()) for s in scales]).max()
    quantize = quantize_int8 if weights[0].dtype == torch.int8 else quantize_fp8
    parts = [quantize(w.float() * s.float().reshape(()), max_scale) for w, s in zip(weights, scales)]
    return torch.cat(parts, dim=0), max_scale


def quantize_weight_fp8(weight: torch.Tensor, granularity: Granularity, block: int = 128,
                        step_elems: int = 1 << 20):
    """Online FP8 weight quantization of a bf16/fp16 [N, K] weight. TENSOR -> scale []; CHANNEL ->
    [N]; BLOCK -> [N/block, K/block] (N and K must divide; the caller checks and names the layer).
    The amax is taken in the weight's own dtype (exact) and the codes are made a few rows (a row of
    blocks) at a time in one fp32 buffer of about ``step_elems`` elements (4 MiB), not in whole-layer
    fp32 copies; bit-identical to quantizing the whole weight at once."""
    n, k = weight.shape
    if granularity is Granularity.TENSOR:
        lo, hi = torch.aminmax(weight)
        scale = fp8_scale_from_amax(torch.maximum(hi, -lo).float())
    elif granularity is Granularity.CHANNEL:
        scale = fp8_scale_from_amax(torch.maximum(weight.amax(dim=1), -weight.amin(dim=1)).float())
    elif granularity is Granularity.BLOCK:
        tiles = weight.view(n // block, block, k // block, block)
        scale = fp8_scale_from_amax(torch.maximum(tiles.amax(dim=(1, 3)), -tiles.amin(dim=(1, 3))).float())
    else:
        raise AssertionError(f"online weight granularity {granularity}")
    if granularity is Granularity.BLOCK:  # one row of blocks, as many blocks across as fit
        rows, cols = block, block * max(1, min(k // block, step_elems // block**2))
    else:
        rows, cols = max(1, step_elems // k), k
    q = torch.empty((n, k), dtype=FP8, device=weight.device)
    buf = torch.empty(min(rows, n) * min(cols, k), dtype=torch.float32, device=weight.device)
    for r in range(0, n, rows):
        for c in range(0, k, cols):
            src = weight[r:r + rows, c:c + cols]
            part = buf[:src.numel()].view(src.shape).copy_(src)
            if granularity is Granularity.BLOCK:
                row_scale = scale[r // block, c // block:(c + cols) // block]
                part.view(block, -1, block).div_(row_scale[None, :, None])
            else:
                part.div_(scale[r:r + rows, None] if granularity is Granularity.CHANNEL else scale)
            q[r:r + rows, c:c + cols].copy_(part.clamp_(-FP8_MAX, FP8_MAX))
    return q, scale


def reference_linear(x2: torch.Tensor, spec, weight: torch.Tensor, weight_scale, weight_global_scale=None,
                     weight_zero_point=None, weight_g_idx=None, input_scale=None, input_global_scale=None,
                     bias=None) -> torch.Tensor:
    """The quantized linear's math in fp32: ``qdq(x2) @ dequantize(weight).T + bias`` for x2 [M, K] and
    a QuantScheme ``spec``. Returns fp32 [M, N]; callers cast. Shared by the reference ops and the
    kernels' emulated backends, so there is one definition of what every kernel must compute."""
    k = x2.shape[-1]
    w = dequantize_weight(weight, weight_scale, spec.weight, weight_global_scale, weight_zero_point, weight_g_idx,
                          k=k)
    xf = qdq_activation(x2, spec.act, input_scale, input_global_scale) if spec.act is not None else x2.float()
    out = xf @ w.t()
    return out + bias.float() if bias is not None else out
