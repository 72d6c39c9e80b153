"""Triton kernels of ``qcompile::fused_moe`` (host code, op, configs: :mod:`moe_triton`).

Align (:func:`moe_align`): token sort / align per expert on the GPU, without a host sync.

The ``T·k`` routed pairs ``p = t·k + j`` (token ``t``, its ``j``-th expert ``topk_ids[t, j]``) are
grouped by expert into blocks of ``block_m`` rows, so that each GEMM program multiplies one block by
one expert's weight tile:

* ``sorted_ids`` int32 ``[max_blocks · block_m]``: for expert 0, 1, ... in turn, its pairs in
  increasing ``p``, then the sentinel ``T·k`` up to the next multiple of ``block_m``; every slot
  after the last expert's block holds the sentinel too.
* ``block_expert`` int32 ``[max_blocks]``: the expert of each block, ``-1`` after the last one.

Pairs whose expert id is outside ``[0, E)`` (experts of another rank under expert parallelism) are
left out. Every size depends on ``T``, ``k``, ``E`` and ``block_m`` only (CUDA-graph capturable):
expert ``e`` with ``c_e`` pairs takes ``ceil(c_e / block_m)`` blocks, at most ``(c_e + block_m - 1)
/ block_m``, and at most ``min(E, T·k)`` experts have a pair, hence
``max_blocks = (T·k + min(E, T·k) · (block_m - 1)) // block_m``.

Launches: one program when ``T·k`` pairs fit one chunk (decode); else three kernels over chunks of
pairs: per-chunk counts, one scan (expert offsets, padding, block experts, chunk bases), scatter. A
pair's slot is its expert's start + the pairs of that expert in earlier chunks + its rank within its
chunk (a one-hot ``[chunk, E]`` prefix sum), so the order is deterministic.

``_moe_gemm_kernel``: the grouped GEMM of both expert projections (module doc of :mod:`moe_triton`);
``_moe_sum_kernel``: the top-k sum. Activations quantized outside the GEMM go through
:mod:`fp8_quant_triton`'s kernels (INT8 with :data:`INT8_MIN_SCALE`).
"""

from __future__ import annotations

import torch

from .fp8_quant_triton import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .fp8_quant_triton import _pdl_start
    from .fp8_quant_triton import _quant as _code_bits
    from .fp8_quant_triton import _scale_from_amax as _dense_scale_from_amax

# one-hot tiles [chunk, E] of at most this many int32 elements per program (16 warps: 32 registers a thread)
ONEHOT_ELEMS = 16384
NUM_WARPS = 16


def align_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_blocks, padded slots) for ``num_pairs`` routed pairs over ``num_experts`` experts."""
    max_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    return max_blocks, max_blocks * block_m


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _chunk_experts(ids_ptr, chunk, P, E, CHUNK: tl.constexpr, E_POW2: tl.constexpr):
        """Pairs of one chunk, their expert (-1: none or out of range) and its one-hot [CHUNK, E_POW2]."""
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, -1)
        onehot = (e[:, None] == tl.arange(0, E_POW2)[None, :]).to(tl.int32)
        return offs, e, onehot

    @triton.jit
    def _scatter(onehot, offs, e, base, sorted_ptr):
        """Store each pair at its expert's ``base`` + its rank among the chunk's pairs of that expert."""
        rank = tl.sum((tl.cumsum(onehot, 0) - onehot) * onehot, 1)
        pos = tl.sum(onehot * base[None, :], 1) + rank
        tl.store(sorted_ptr + pos, offs, mask=e >= 0)

    @triton.jit
    def _layout(counts, sorted_ptr, experts_ptr, P, MAX_BLOCKS,
                BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, B_CHUNK: tl.constexpr):
        """From the pairs per expert: write the padding sentinels and every block's expert; return the
        first slot of each expert."""
        nblk = (counts + BLOCK_M - 1) // BLOCK_M
        blk_end = tl.cumsum(nblk, 0)
        start = (blk_end - nblk) * BLOCK_M
        total = tl.sum(nblk, 0)
        j = tl.arange(0, BLOCK_M)
        pad = j[None, :] < (nblk * BLOCK_M - counts)[:, None]  # [E_POW2, BLOCK_M]
        tl.store(sorted_ptr + start[:, None] + counts[:, None] + j[None, :], tl.zeros_like(pad.to(tl.int32)) + P, mask=pad)
        for b0 in range(0, MAX_BLOCKS, B_CHUNK):
            b = b0 + tl.arange(0, B_CHUNK)
            owner = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), 1)  # experts ending at or before b
            tl.store(experts_ptr + b, tl.where(b < total, owner, -1), mask=b < MAX_BLOCKS)
            tail = (b >= total) & (b < MAX_BLOCKS)
            slots = b[:, None] * BLOCK_M + j[None, :]
            tl.store(sorted_ptr + slots, tl.zeros_like(slots) + P, mask=tail[:, None] & (slots >= 0))
        return start

    @triton.jit
    def _align_one_kernel(ids_ptr, sorted_ptr, experts_ptr, P, E, MAX_BLOCKS,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_POW2: tl.constexpr,
                          B_CHUNK: tl.constexpr, PDL: tl.constexpr = False):
        # grid (1,): all pairs in one chunk
        _pdl_start(PDL)
        offs, e, onehot = _chunk_experts(ids_ptr, 0, P, E, CHUNK, E_POW2)
        start = _layout(tl.sum(onehot, 0), sorted_ptr, experts_ptr, P, MAX_BLOCKS, BLOCK_M, E_POW2, B_CHUNK)
        _scatter(onehot, offs, e, start, sorted_ptr)

    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, E_POW2: tl.constexpr,
                            PDL: tl.constexpr = False):
        # grid (chunks,): counts[c, e] = pairs of chunk c routed to expert e
        _pdl_start(PDL)
        c = tl.program_id(0)
        _, _, onehot = _chunk_experts(ids_ptr, c, P, E, CHUNK, E_POW2)
        tl.store(counts_ptr + c * E_POW2 + tl.arange(0, E_POW2), tl.sum(onehot, 0))

    @triton.jit
    def _align_scan_kernel(counts_ptr, base_ptr, sorted_ptr, experts_ptr, P, C, MAX_BLOCKS,
                           BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, C_TILE: tl.constexpr,
                           B_CHUNK: tl.constexpr, PDL: tl.constexpr = False):
        # grid (1,): totals, layout, then base[c, e] = start[e] + pairs of e in chunks before c
        _pdl_start(PDL)
        ex = tl.arange(0, E_POW2)
        totals = tl.zeros([E_POW2], dtype=tl.int32)
        for c0 in range(0, C, C_TILE):
            c = c0 + tl.arange(0, C_TILE)
            tile = tl.load(counts_ptr + c[:, None] * E_POW2 + ex[None, :], mask=(c < C)[:, None], other=0)
            totals += tl.sum(tile, 0)
        running = _layout(totals, sorted_ptr, experts_ptr, P, MAX_BLOCKS, BLOCK_M, E_POW2, B_CHUNK)
        for c0 in range(0, C, C_TILE):
            c = c0 + tl.arange(0, C_TILE)
            tile = tl.load(counts_ptr + c[:, None] * E_POW2 + ex[None, :], mask=(c < C)[:, None], other=0)
            base = tl.cumsum(tile, 0) - tile + running[None, :]
            tl.store(base_ptr + c[:, None] * E_POW2 + ex[None, :], base, mask=(c < C)[:, None])
            running += tl.sum(tile, 0)

    @triton.jit
    def _align_scatter_kernel(ids_ptr, base_ptr, sorted_ptr, P, E, CHUNK: tl.constexpr, E_POW2: tl.constexpr,
                              PDL: tl.constexpr = False):
        # grid (chunks,)
        _pdl_start(PDL)
        c = tl.program_id(0)
        offs, e, onehot = _chunk_experts(ids_ptr, c, P, E, CHUNK, E_POW2)
        _scatter(onehot, offs, e, tl.load(base_ptr + c * E_POW2 + tl.arange(0, E_POW2)), sorted_ptr)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert) of ``topk_ids`` [T, k] (int32 / int64) as the module doc says.
    Triton on CUDA (or CPU under the interpreter), else :func:`moe_align_reference`."""
    if not use_triton(topk_ids):
        return moe_align_reference(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    p = ids.numel()
    max_blocks, slots = align_sizes(p, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if max_blocks == 0:
        return sorted_ids, block_expert
    e_pow2 = _pow2(num_experts)
    launch = pdl(ids)
    chunk = max(16, min(_pow2(p), ONEHOT_ELEMS // e_pow2))
    # blocks laid out per step of _layout's loop: [b_chunk, E_POW2] and [b_chunk, block_m] tiles
    b_chunk = max(16, min(_pow2(max_blocks), ONEHOT_ELEMS // max(e_pow2, 4 * block_m)))
    if p <= chunk:
        _align_one_kernel[(1,)](ids, sorted_ids, block_expert, p, num_experts, max_blocks, BLOCK_M=block_m,
                                CHUNK=chunk, E_POW2=e_pow2, B_CHUNK=b_chunk, num_warps=num_warps, **launch)
        return sorted_ids, block_expert
    chunks = triton.cdiv(p, chunk)
    counts = torch.empty((chunks, e_pow2), dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    _align_count_kernel[(chunks,)](ids, counts, p, num_experts, CHUNK=chunk, E_POW2=e_pow2, num_warps=num_warps,
                                   **launch)
    _align_scan_kernel[(1,)](counts, base, sorted_ids, block_expert, p, chunks, max_blocks, BLOCK_M=block_m,
                             E_POW2=e_pow2, C_TILE=max(1, ONEHOT_ELEMS // e_pow2), B_CHUNK=b_chunk,
                             num_warps=num_warps, **launch)
    _align_scatter_kernel[(chunks,)](ids, base, sorted_ids, p, num_experts, CHUNK=chunk, E_POW2=e_pow2,
                                     num_warps=num_warps, **launch)
    return sorted_ids, block_expert


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layout by a Python loop over experts (host code: the oracle of :func:`moe_align`)."""
    ids = topk_ids.reshape(-1).long().cpu()
    p = ids.numel()
    max_blocks, slots = align_sizes(p, num_experts, block_m)
    sorted_ids = torch.full((slots,), p, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    at = 0
    for e in range(num_experts):
        pairs = (ids == e).nonzero().flatten()
        nblk = -(-pairs.numel() // block_m)
        sorted_ids[at:at + pairs.numel()] = pairs.to(torch.int32)
        block_expert[at // block_m:at // block_m + nblk] = e
        at += nblk * block_m
    return sorted_ids.to(topk_ids.device), block_expert.to(topk_ids.device)


# -- the grouped GEMM, the top-k sum ---------------------------------------------------------------

# scale granularity codes of the GEMM: one scale, one per row (channel / token), per 128-block / group
G_TENSOR, G_ROW, G_BLOCK = range(3)
# how the kernel gets its A operand: quantized codes, or x.dtype quantized in the prologue
A_CODES, A_STATIC, A_DYNAMIC = range(3)
# the least dynamic INT8 activation scale: the smallest normal fp32 (an all-zero row must not divide by zero)
INT8_MIN_SCALE = torch.finfo(torch.float32).tiny

if HAS_TRITON:
    _G_TENSOR = tl.constexpr(G_TENSOR)
    _G_ROW = tl.constexpr(G_ROW)
    _G_BLOCK = tl.constexpr(G_BLOCK)
    _A_CODES = tl.constexpr(A_CODES)
    _INT8_MIN_SCALE = tl.constexpr(INT8_MIN_SCALE)

    @triton.jit
    def _act_fn(y, ACT: tl.constexpr):
        if ACT == 1:  # silu
            r = y / (1.0 + tl.exp(-y))
        elif ACT == 2:  # gelu, tanh approximation: 0.5 y (1 + tanh(u)) = y * sigmoid(2u)
            r = y / (1.0 + tl.exp(-1.5957691216057308 * (y + 0.044715 * y * y * y)))
        elif ACT == 3:  # relu^2
            r = tl.maximum(y, 0.0) * tl.maximum(y, 0.0)
        elif ACT == 5:  # gelu (erf)
            r = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
        else:
            r = y
        return r

    @triton.jit
    def _scale_from_amax(amax, INT8: tl.constexpr):
        """The dense linears' dynamic scale, with the MoE's least INT8 scale."""
        return _dense_scale_from_amax(amax, INT8, _INT8_MIN_SCALE)

    @triton.jit
    def _quantize(x, s, INT8: tl.constexpr, NATIVE_FP8: tl.constexpr):
        """fp32 x / s -> int8 (round half even, saturating) or float8e4nv codes; bit-exact with torch."""
        return _code_bits(x, s, NATIVE_FP8, INT8).to(tl.int8 if INT8 else tl.float8e4nv, bitcast=True)

    @triton.jit
    def _outer(a_s, w_s, A_VEC: tl.constexpr, W_VEC: tl.constexpr, SWAP: tl.constexpr):
        """a_s (per row of A, or one) x w_s (per weight row, or one), laid out like the accumulator."""
        if A_VEC:
            a_s = a_s[None, :] if SWAP else a_s[:, None]
        if W_VEC:
            w_s = w_s[:, None] if SWAP else w_s[None, :]
        return a_s * w_s

    @triton.jit
    def _mma(a, w, acc, SWAP: tl.constexpr, PROMOTE: tl.constexpr):
        """acc + the products of one K step. PROMOTE (fp8): the tensor cores' sum of this step is added
        to the fp32 accumulator (sm_90 otherwise accumulates fp8 products over all of K at reduced
        precision). One A row (``tl.dot`` takes 16 or more) multiplies on the CUDA cores."""
        step_k: tl.constexpr = a.shape[1]
        if a.shape[0] == 1:  # one row (per-pair decode): products on the CUDA cores, exact in int32 / fp32
            if acc.dtype == tl.int32:
                s = tl.sum(w.to(tl.int32) * a.to(tl.int32), 1)
            else:
                s = tl.sum(w.to(tl.float32) * a.to(tl.float32), 1)
            r = acc + (s[:, None] if SWAP else s[None, :])
        elif SWAP:
            if PROMOTE:
                r = tl.dot(w, tl.trans(a), acc, max_num_imprecise_acc=step_k)  # [BN, BM]
            else:
                r = tl.dot(w, tl.trans(a), acc, out_dtype=acc.dtype)
        else:
            if PROMOTE:
                r = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=step_k)  # [BM, BN]
            else:
                r = tl.dot(a, tl.trans(w), acc, out_dtype=acc.dtype)
        return r

    @triton.jit
    def _step(acc, a, w, a_s, w_s, PER_STEP: tl.constexpr, A_VEC: tl.constexpr, W_VEC: tl.constexpr,
              SWAP: tl.constexpr, W_INT8: tl.constexpr):
        if PER_STEP:  # scales change along K: each step's fp32 sum scaled, then added
            acc += _mma(a, w, tl.zeros(acc.shape, dtype=tl.float32), SWAP, False) * _outer(a_s, w_s, A_VEC, W_VEC,
                                                                                          SWAP)
        else:  # int32 sums are exact; fp8 ones promoted every step
            acc = _mma(a, w, acc, SWAP, not W_INT8)
        return acc

    @triton.jit
    def _row_scales(a_ptr, a_off, m_ok, K, INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """Dynamic per-row scales of the A rows: one pass over K for the amax."""
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_off[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), 1))
        return _scale_from_amax(amax, INT8)

    @triton.jit
    def _expert_tile(a_ptr, as_ptr, w_base, s_base, a_row, m_ok, rows, k_lo, k_hi, K, UP,
                     stride_am, stride_asm, stride_asg, stride_wn, stride_sn, stride_sk,
                     W_INT8: tl.constexpr, W_GRAN: tl.constexpr, A_GRAN: tl.constexpr, A_MODE: tl.constexpr,
                     GATED: tl.constexpr, SWAP: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A rows ``a_row`` (valid where m_ok) times one expert's weight rows ``rows`` (and ``rows + UP``
        when GATED) over k in [k_lo, k_hi): the scaled fp32 results [BLOCK_M, BLOCK_N] (gate, up)."""
        a_off = a_row.to(tl.int64) * stride_am
        PER_STEP: tl.constexpr = (W_GRAN == _G_BLOCK) or (A_GRAN == _G_BLOCK)
        A_VEC: tl.constexpr = A_GRAN != _G_TENSOR
        W_VEC: tl.constexpr = W_GRAN != _G_TENSOR
        # scales that hold for the whole K range
        if A_GRAN == _G_TENSOR:
            a_s = tl.load(as_ptr)
        elif A_GRAN == _G_ROW and A_MODE == _A_CODES:
            a_s = tl.load(as_ptr + a_row * stride_asm, mask=m_ok, other=1.0)
        elif A_GRAN == _G_ROW:
            a_s = _row_scales(a_ptr, a_off, m_ok, K, W_INT8, BLOCK_M, BLOCK_K)
        else:
            a_s = tl.zeros([BLOCK_M], dtype=tl.float32)  # per group: set every step
        if W_GRAN == _G_TENSOR:
            ws_g = tl.load(s_base)
            ws_u = ws_g
        elif W_GRAN == _G_ROW:
            ws_g = tl.load(s_base + rows * stride_sn)
            ws_u = tl.load(s_base + (rows + UP) * stride_sn)
        else:
            ws_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            ws_u = ws_g
        ACC_T = tl.int32 if W_INT8 else tl.float32
        if SWAP:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC_T)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_T)
        acc_u = tl.zeros_like(acc_g)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + a_off[:, None] + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if A_GRAN == _G_BLOCK and A_MODE == _A_CODES:
                a_s = tl.load(as_ptr + a_row * stride_asm + (k0 // BLOCK_K) * stride_asg, mask=m_ok, other=1.0)
            if A_MODE != _A_CODES:
                a = a.to(tl.float32)
                if A_GRAN == _G_BLOCK:  # dynamic 1 x BLOCK_K group
                    a_s = _scale_from_amax(tl.max(tl.abs(a), 1), W_INT8)
                a = _quantize(a, a_s[:, None] if A_VEC else a_s, W_INT8, NATIVE_FP8)
            if W_GRAN == _G_BLOCK:
                kb = (k0 // 128) * stride_sk
                ws_g = tl.load(s_base + (rows // 128) * stride_sn + kb)
                if GATED:
                    ws_u = tl.load(s_base + ((rows + UP) // 128) * stride_sn + kb)
            wg = tl.load(w_base + rows[:, None] * stride_wn + kk[None, :], mask=k_ok[None, :], other=0.0)
            acc_g = _step(acc_g, a, wg, a_s, ws_g, PER_STEP, A_VEC, W_VEC, SWAP, W_INT8)
            if GATED:
                wu = tl.load(w_base + (rows + UP)[:, None] * stride_wn + kk[None, :], mask=k_ok[None, :], other=0.0)
                acc_u = _step(acc_u, a, wu, a_s, ws_u, PER_STEP, A_VEC, W_VEC, SWAP, W_INT8)
        if PER_STEP:
            y_g = acc_g
            y_u = acc_u
        else:
            y_g = acc_g.to(tl.float32) * _outer(a_s, ws_g, A_VEC, W_VEC, SWAP)
            y_u = acc_u.to(tl.float32) * _outer(a_s, ws_u, A_VEC, W_VEC, SWAP)
        if SWAP:
            y_g = tl.trans(y_g)
            y_u = tl.trans(y_u)
        return y_g, y_u

    @triton.jit
    def _moe_gemm_kernel(
            a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, ids_ptr, experts_ptr, route_ptr, qs_ptr,
            N, K, P, E, A_DIV, UP, k_split, alpha, limit,
            stride_am, stride_asm, stride_asg, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
            stride_be, stride_os, stride_om,
            W_INT8: tl.constexpr, W_GRAN: tl.constexpr, A_GRAN: tl.constexpr, A_MODE: tl.constexpr,
            GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE: tl.constexpr,
            PER_PAIR: tl.constexpr,
            FOLD_TOPK: tl.constexpr, SWAP: tl.constexpr, NATIVE_FP8: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            OUT_QUANT: tl.constexpr = False, OUT_FP16: tl.constexpr = False, PDL: tl.constexpr = False):
        # grid (row blocks, tokens or pairs, cdiv(N, BLOCK_N), split_k). Rows of a program: the pairs of
        # one expert's block (sorted_ids); the pair pid_m alone (PER_PAIR); or token pid_m's FOLD_TOPK
        # pairs one after the other, summed in order (FOLD_TOPK > 0). A row = pair // A_DIV.
        # out[pid_k, pair (token when folding), n]. The bias b[expert, n] is added by split 0.
        # OUT_QUANT: out holds the codes of y, rounded to x's dtype (fp16 when OUT_FP16, else bf16),
        # quantized with the static scale qs[0]: what the separate quantization kernel would make of it.
        _pdl_start(PDL)
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(2)
        offs_m = tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(n < N, n, 0)  # clamped: weight loads stay unmasked along N
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        first = (pid_k == 0).to(tl.float32)
        if FOLD_TOPK > 0:
            m_ok = offs_m == 0
            y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(FOLD_TOPK):
                pair = pid_m * FOLD_TOPK + j + offs_m * 0
                expert = tl.load(experts_ptr + pid_m * FOLD_TOPK + j).to(tl.int32)
                if (expert >= 0) & (expert < E):
                    y_g, y_u = _expert_tile(
                        a_ptr, as_ptr, w_ptr + expert.to(tl.int64) * stride_we, ws_ptr + expert.to(tl.int64) * stride_se,
                        pair // A_DIV, m_ok, rows, k_lo, k_hi, K, UP, stride_am, stride_asm, stride_asg, stride_wn,
                        stride_sn, stride_sk, W_INT8, W_GRAN, A_GRAN, A_MODE, GATED, SWAP, NATIVE_FP8,
                        BLOCK_M, BLOCK_N, BLOCK_K)
                    y += _epilogue(y_g, y_u, b_ptr + expert.to(tl.int64) * stride_be, rows, UP, first, alpha, limit,
                                   route_ptr, pair, m_ok, ACT, GATED, HAS_BIAS, ROUTE)
            out_row = pid_m + offs_m * 0
        else:
            expert = tl.load(experts_ptr + pid_m).to(tl.int32)
            if (expert < 0) | (expert >= E):
                return
            if PER_PAIR:
                pair = pid_m + offs_m * 0
                m_ok = offs_m == 0
            else:
                pair = tl.load(ids_ptr + pid_m * BLOCK_M + offs_m)
                m_ok = pair < P
            y_g, y_u = _expert_tile(
                a_ptr, as_ptr, w_ptr + expert.to(tl.int64) * stride_we, ws_ptr + expert.to(tl.int64) * stride_se,
                tl.where(m_ok, pair // A_DIV, 0), m_ok, rows, k_lo, k_hi, K, UP, stride_am, stride_asm, stride_asg,
                stride_wn, stride_sn, stride_sk, W_INT8, W_GRAN, A_GRAN, A_MODE, GATED, SWAP, NATIVE_FP8,
                BLOCK_M, BLOCK_N, BLOCK_K)
            y = _epilogue(y_g, y_u, b_ptr + expert.to(tl.int64) * stride_be, rows, UP, first, alpha, limit,
                          route_ptr, pair, m_ok, ACT, GATED, HAS_BIAS, ROUTE)
            out_row = pair
        out = out_ptr + pid_k.to(tl.int64) * stride_os + out_row.to(tl.int64)[:, None] * stride_om + n[None, :]
        if OUT_QUANT:
            y = y.to(tl.float16 if OUT_FP16 else tl.bfloat16).to(tl.float32)
            y = _quantize(y, tl.load(qs_ptr), W_INT8, NATIVE_FP8)
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (n < N)[None, :])

    @triton.jit
    def _epilogue(y_g, y_u, b_base, rows, UP, first, alpha, limit, route_ptr, pair, m_ok,
                  ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE: tl.constexpr):
        """Bias (times ``first``: 1 in the first K split), activation, router weight of fp32 tiles
        [BLOCK_M, BLOCK_N] of the gate (or only) and up projections."""
        if HAS_BIAS:
            y_g += tl.load(b_base + rows).to(tl.float32)[None, :] * first
            if GATED:
                y_u += tl.load(b_base + rows + UP).to(tl.float32)[None, :] * first
        if ACT == 4:  # swigluoai: (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)
            g = tl.minimum(y_g, limit)
            y = g / (1.0 + tl.exp(-alpha * g)) * (tl.minimum(tl.maximum(y_u, -limit), limit) + 1.0)
        else:
            y = _act_fn(y_g, ACT)
            if GATED:
                y = y * y_u
        if ROUTE:
            y = y * tl.load(route_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        return y

    @triton.jit
    def _moe_sum_kernel(part_ptr, ids_ptr, out_ptr, H, E, stride_ps,
                        TOPK: tl.constexpr, SPLIT: tl.constexpr, CHECK_IDS: tl.constexpr, BLOCK_H: tl.constexpr,
                        PDL: tl.constexpr = False):
        # grid (T, cdiv(H, BLOCK_H)): out[t] = sum_j sum_s part[s, t*TOPK + j], fixed order; rows of
        # pairs whose expert id is outside [0, E) are skipped (CHECK_IDS)
        _pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            ok = h < H
            if CHECK_IDS:
                e = tl.load(ids_ptr + t * TOPK + j) + h * 0
                ok = ok & (e >= 0) & (e < E)
            for s in tl.static_range(SPLIT):
                part = part_ptr + s * stride_ps.to(tl.int64) + (t * TOPK + j) * H + h
                acc += tl.load(part, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)
