// qcompile wo_mma: weight-only GEMM for decode-size M, tensor cores fed from registers.
//
//   out[M, N] = x[M, K] @ dequant(W)[N, K]^T  (+ bias), fp32 accumulation; x and out bf16 (fp16 with
//   XF16).
//
// The weight is streamed either in its canonical checkpoint layout (row-major words, element k of
// a row at bits BITS*(k % EPW) of word k / EPW; e2m1 bytes read as the same words) or tiled
// (PACKED: quant_math.tile_words permutes the same words so each warp streams one contiguous run, and
// puts a 4-bit word's nibbles in pair order so that x needs no reordering; where one scale covers a chunk
// (XNAT), the k of a chunk are also permuted so that x is mma's B operand in its natural order):
//
//  * The weight is the MMA's A operand (m16n8k16, rows = output features), x is B (n = 8 tokens,
//    MT tiles). One warp owns 16 rows (RT tiles of 16 with RT > 1: each x fragment it reads from shared
//    memory feeds the MMAs of all RT tiles). Lane (r = lane / 4, q = lane % 4) loads 16 bytes of row r
//    and 16 of row r + 8 per chunk: 4 words, 32 (4-bit) or 16 (8-bit) consecutive k of each row.
//  * Inside one mma step the k order is free as long as A and B agree, so each lane uses the k of
//    its own words: the A fragment is decoded in registers with no shuffles, and x is stored in
//    shared memory already in the matching order (canonical 4-bit words: byte-permuted once per CTA), padded so
//    the 16-byte reads are conflict-free. x for the CTA's K range is loaded once, or (XS, sm_90) streamed
//    through a ring of XSTAGES chunks per K part: one warp of each part refills it (cp.async, or on natural-order
//    tiles TMA boxes of x's rows, read back with ldmatrix), full / empty mbarriers per slot, so the CTA may take
//    any K range (canonical 4-bit words: x reordered as read).
//  * Scales: per row in the epilogue (tensor / channel), per chunk after the MMA in fp32 (groups
//    that cover a whole chunk, e.g. int4 g128), or multiplied into the decoded values before it
//    (smaller groups: NVFP4 16, MX 32; exact for e2m1/e4m3 x fp8/e8m0 scales in bf16).
//  * Split-K over gridDim.y. Up to 8 splits form one thread-block cluster (sm_90): each CTA leaves
//    its fp32 partials in its shared memory and sums a slice of the column's outputs over the
//    cluster (distributed shared memory, rank order: deterministic). More splits: fp32 partials in
//    global memory, the last CTA of a column sums them in split order and resets its counter.
//  * WGMMA (sm_90a, M up to 128): one warpgroup (4 warps, 64 rows) issues wgmma.mma_async m64 x
//    n(8 MT) x k16 per step with the decoded weights as A (registers, the same fragments) and x as B
//    from shared memory (K-major 8 x 16-byte core matrices). x is streamed per chunk: cp.async copies
//    it XSTAGES chunks ahead into a staging ring (no registers held), and one chunk ahead the CTA
//    rewrites it from there into one of two B buffers in the order the decoded fragments need, and
//    each warp decodes the next chunk's weights, while the wgmmas of the current chunk run. The
//    CTA's K range needs no x staging up front, so any split fits. Group scales are multiplied into
//    the decoded weights (no per-chunk fp32 step).
//  * WS (sm_90a, warp-specialized wgmma build, tiled weights): two producer warps fill mbarrier
//    rings with bulk copies (weights: NSTG slots of one chunk per consumer warp, released once the
//    words are loaded, behind a proxy fence; x: XSTAGES slots, loaded by TMA from x itself (XNAT) or
//    rearranged into the B layout once per call by x_prep), and the consumer warpgroups wait only on
//    their own slots: no CTA barrier per chunk.
//  * GROUPED (mma.sync build, x staged): the routed experts of an MoE layer in one launch. gridDim.z runs over the
//    blocks of a token sort (moe_kernels.moe_align: MT * 8 pair slots per block, one expert per block, -1 for an
//    unused block); a CTA offsets the weight, scale, zero-point, global-scale and bias pointers to its block's
//    expert, stages the x rows of its pairs (pair p reads x row p / adiv; padding slots read zeros) and writes
//    fp32 rows of its pairs, times the pair's router weight (fp32 or x's dtype) when `route` is given. A split is
//    reduced in a cluster only. For one token the pairs' expert ids stand in for the sort (`direct`: block z is
//    pair z). With `ready` (the sort was complete when the kernel launched) the block's weights are requested
//    before griddepcontrol.wait, as in the dense build.
//    With WS (blocks of 32 to 128 pair slots): x is the gathered rows of the blocks ([blocks * 8 MT, K], block z's
//    rows from 8 MT z, zero rows for padding slots; loaded by TMA at that row offset, or x_prep's per-block B
//    layout), the sort complete at launch (the gather ran in between), a split reduced in a cluster only.
//    GACT (a gated activation fused into GEMM 1): each CTA takes TPC / 2 16-row tiles of the gate rows and the
//    same tiles of the up rows (row I + n for gate row n, I = N / 2); after the main loop (and the cluster's
//    reduction of a split) it applies the activation to each (gate, up) pair of outputs and writes the
//    activations [pairs, I] in x's dtype.
//  * PDL (sm_90, programmatic dependent launch): the first weight chunks are requested before
//    griddepcontrol.wait, so they overlap the previous kernel's tail; x, the outputs, the partials
//    and the counters are touched only after it. With TRIG the kernel lets the next one launch at
//    its start (griddepcontrol.launch_dependents; x_prep before its own wait), so the next call's
//    CTAs take the SMs that this call's early finishers leave and request their weights there;
//    without it, after the main loop. Warps with nothing to do before the previous kernel has
//    completed block in griddepcontrol.wait rather than spin on an mbarrier.
//
// Compile-time configuration (#defines prepended by wo_mma.py): FMT, SK, SMODE, GROUP, HAS_ZP,
// ZP_T, HAS_GS, HAS_BIAS, MT (8-token tiles), STAGES (chunks in flight per warp), WARPS, PACKED
// (tiled words), CLUSTER (splits in one cluster), PDL, TRIG (early launch_dependents), WGMMA, XSTAGES
// (x chunks in flight, wgmma), MINB (CTAs per SM the registers must allow), WS (the warp-specialized
// build), NSTG (its weight slots), KW (warps per 16-row tile), RT (16-row tiles per warp), XF16 (fp16 x
// and output), XS (x streamed through a ring in the mma.sync build), GROUPED (the MoE experts' launch), GACT
// (GROUPED: the gated activation fused, 1 silu, 2 gelu tanh, 4 swigluoai, 5 gelu), XPAD (GROUPED: x's rows hold
// kx < K columns, K padded to whole chunks; zeros past them).

typedef unsigned int u32;
typedef unsigned short u16;

#define FMT_INT4 0   // int32 words, 8 x (code + 8) nibbles
#define FMT_E2M1 1   // e2m1 nibbles (uint8 pairs viewed as words)
#define FMT_INT8U 2  // int32 words, 4 x (code + 128) bytes
#define FMT_INT8S 3  // int8 bytes (two's complement)
#define FMT_E4M3 4   // fp8 e4m3 bytes
#define SK_FP32 0
#define SK_E4M3 1
#define SK_E8M0 2
#define SMODE_END 0    // one scale per row (tensor / channel): applied in the epilogue
#define SMODE_CHUNK 1  // group >= chunk: applied to each chunk's fp32 product
#define SMODE_PRE 2    // group < chunk: multiplied into the decoded weights

#if WS  // WARPS consumer warps (whole warpgroups) and two producer warps
#define NTHR (WARPS * 32 + 64)
#else
#define NTHR (WARPS * 32)
#endif
// KW warps share one 16-row tile and split the CTA's K range between them (mma.sync build): their
// partial sums meet in shared memory, so fewer splits go through the cluster or global memory.
#ifndef KW
#define KW 1
#endif
// RT: 16-row tiles per warp (mma.sync build). Each x fragment loaded from shared memory feeds the MMAs of
// RT tiles, so the shared-memory loads per weight byte fall RT-fold.
#ifndef RT
#define RT 1
#endif
#define TPC (WARPS / KW * RT)  // 16-row tiles per CTA
#ifndef XF16
#define XF16 0
#endif
#if XF16 && (SK == SK_E8M0 || FMT == FMT_E4M3)
#error "fp16 x: weights other than MX (e8m0 scales exceed fp16)"
#endif
#if KW > 1 && (WGMMA || WS || WARPS % KW)
#error "KW > 1: the mma.sync build, KW dividing WARPS"
#endif
#if RT > 1 && (WGMMA || WS)
#error "RT > 1: the mma.sync build"
#endif
// XS (sm_90): the mma.sync build streams x through a ring of XSTAGES chunks per K part (cp.async or TMA,
// mbarriers) instead of staging the CTA's whole x slice before the first MMA; its shared memory then no
// longer grows with the K range, so a CTA may take all of K at M = 9..16.
#ifndef XS
#define XS 0
#endif
#if XS && (WGMMA || WS)
#error "XS: the mma.sync build"
#endif
#ifndef GROUPED
#define GROUPED 0
#endif
#if GROUPED && (XS || (WGMMA && !WS))
#error "GROUPED: the mma.sync build with x staged, or the warp-specialized build"
#endif
#ifndef GACT
#define GACT 0
#endif
#ifndef XPAD
#define XPAD 0
#endif
#if XPAD && (!GROUPED || WS)
#error "XPAD: the grouped mma.sync build"
#endif
#if GACT && (!GROUPED || WS || (WARPS / KW) % 2)
#error "GACT: the grouped build with an even number of tile groups (half gate, half up tiles)"
#endif
#define BITS ((FMT == FMT_INT4 || FMT == FMT_E2M1) ? 4 : 8)
// NVFP4 (e2m1 codes, e4m3 group scales) with bf16 x: a code decodes to its value times 2^-126 (sign, exponent and
// mantissa bits moved into place) and is not multiplied back; its group scale carries 2^118 and the epilogue the
// remaining 2^8. Exact: powers of two, every decoded weight v * s * 2^-8 a normal bf16 (2^-18 <= |v s| 2^-8 <= 10.5)
// and every scale s * 2^118 below bf16's largest. (fp16 x has too little range for it; e8m0 scales too much.)
#define E2M1_FOLD (FMT == FMT_E2M1 && SK == SK_E4M3 && SMODE == SMODE_PRE && !XF16)
#define FOLD_SCALE (E2M1_FOLD ? 0x1p118f : 1.f)  // into the group scales
#define FOLD_OUT (E2M1_FOLD ? 0x1p8f : 1.f)      // into the epilogue's global scale
#define KPC (BITS == 4 ? 128 : 64)  // k per chunk (per row)
#define KPL (KPC / 4)               // k per lane per chunk
#define UNITS (KPL / 8)             // 16-byte x units per lane per chunk
// x in shared memory: per row, per chunk X_CS bytes, lane q's units at X_SEG(q); row stride = 16 *
// (a number = X_ROW_MOD mod 8). Then the 8 lanes of a quarter warp (rows r, r+1, q = 0..3) read 8
// different 16-byte bank groups: conflict-free 16-byte loads.
#define X_CS (KPC * 2 + (BITS == 4 ? 16 : 0))
#define X_SEG(q) ((q) * KPL * 2 + (BITS == 4 ? ((q) >> 1) * 16 : 0))
#define X_ROW_MOD (BITS == 4 ? 2 : 1)
// XNAT: tiled words in natural-x order (quant_math.tile_words, natural=True; tiles_natural: one scale per chunk).
// Lane q's pair a of a chunk is k = 8a + 2q (+ 0, 1), the k where mma's B fragment of lane q takes x, so x is the
// B operand in its natural order: the warp-specialized build loads it by TMA (no x_prep launch), the lock-step
// wgmma build copies its units as they are, and the streamed mma.sync build (XS) loads x's rows by TMA and reads
// each B fragment pair with ldmatrix. The staged mma.sync build keeps each lane's 16-byte units in shared memory
// (x_unit_off; one 16-byte read per unit, which at M <= 4 is fewer shared-memory wavefronts than ldmatrix's 8
// rows): word q of x's unit 4u + i is word i of lane q's unit u, so its fill scatters words (x_word_off).
#define XNAT (PACKED && (SMODE == SMODE_END || GROUP >= KPC))
__device__ __forceinline__ constexpr int x_row_stride(int chunks) {
  const int u = chunks * X_CS / 16;
  return (u + (X_ROW_MOD - u % 8 + 8) % 8) * 16;
}
// Byte offset of 16-byte unit `wu` (of KPC / 8) in a chunk of one x row: lane wu / UNITS's segment.
__device__ __forceinline__ int x_unit_off(int wu) { return X_SEG(wu / UNITS) + (wu % UNITS) * 16; }
// XNAT: byte offset of word q of x's unit n (= 4u + i) of a chunk row: word i of lane q's unit u.
__device__ __forceinline__ int x_word_off(int n, int q) { return X_SEG(q) + (n >> 2) * 16 + (n & 3) * 4; }

struct __align__(16) U4 { u32 v[4]; };
struct __align__(64) TMap { unsigned long long v[16]; };  // a CUtensorMap, passed by value

#if WGMMA
#if SMODE == SMODE_CHUNK || WARPS % 4 || STAGES % 2
#error "wgmma: whole warpgroups, group scales multiplied into the decoded weights, an even STAGES"
#endif
// x of one chunk as wgmma's B operand: [k16 step][2 core matrices along k][MT token groups][8 tokens]
// [16 B]. Logical k pair (2q, 2q+1) of a step is lane q's decoded pair, so core matrix 4u + e of a
// chunk, row m, is word e of x unit u of lanes q = 0..3 (a 4 x 4 word transpose; see x_transform).
#define XBUF (MT * 8 * KPC * 2)                               // bytes of one B buffer (one chunk)
#define XROW (KPC * 2 + 16)  // staging row stride: 8 consecutive rows start in 8 different bank groups
#define XSTAGE (MT * 8 * XROW)                                // bytes of one staging slot
#define XTASKS (MT * 8 * UNITS)                               // (token, unit) pairs of one chunk
#define XT ((XTASKS + WARPS * 32 - 1) / (WARPS * 32))         // per thread
// Shared-memory descriptor of a K-major, unswizzled B tile: the two core matrices along k are
// MT * 128 bytes apart (leading byte offset), the 8-token groups 128 bytes (stride byte offset).
__device__ __forceinline__ unsigned long long wg_desc(u32 addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((MT * 128) >> 4) << 16) |
         ((unsigned long long)(128 >> 4) << 32);
}
#endif

__device__ __forceinline__ U4 ld_stream(const u32* p) {
  U4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "l"(p));
  return r;
}
__device__ __forceinline__ U4 ld_shared(u32 addr) {
  U4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.v[0]), "=r"(r.v[1]), "=r"(r.v[2]), "=r"(r.v[3]) : "r"(addr));
  return r;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ float ld_cg(const float* p) {  // L2 (coherent across CTAs)
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
template <int LUT>
__device__ __forceinline__ u32 lop3(u32 a, u32 b, u32 c) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
  return d;
}
// The 16-bit type of x, the decoded weights and the output ("h"): bf16, or fp16 with XF16 (e2m1 values
// times fp8 scales and int codes fit fp16, e8m0 scales do not).
#if XF16
#define H2 "f16x2"
#define H1 "f16"
#else
#define H2 "bf16x2"
#define H1 "bf16"
#endif
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {  // h x 2: a * b + c
  u32 d;
  asm("fma.rn." H2 " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 d;
  asm("cvt.rn." H2 ".f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ float h_to_f32(u16 h) {
#if XF16
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return __uint_as_float(((u32)h) << 16);
#endif
}
__device__ __forceinline__ u16 f32_to_h(float f) {
  u16 d;
  asm("cvt.rn." H1 ".f32 %0, %1;" : "=h"(d) : "f"(f));
  return d;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." H1 "." H1 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#if XF16
#define H2_ONE 0x3C003C00u
#define H2_INT4 0x64006400u  // | code: 1024 + code
#define INT4_BIAS 1032.f     // 1024 + the code offset 8
#else
#define H2_ONE 0x3F803F80u
#define H2_INT4 0x43004300u  // | code: 128 + code
#define INT4_BIAS 136.f      // 128 + the code offset 8
#endif
#define H2_NEG0 0x80008000u
#define LUT_AND_OR 0xEA  // (a & b) | c

// Scale value (fp32) of one stored scale element.
__device__ __forceinline__ float scale_f32(const void* s, int i) {
#if SK == SK_FP32
  return ((const float*)s)[i];
#else
  u32 b = ((const unsigned char*)s)[i];
#if SK == SK_E4M3
  return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)) * 0x1p120f;  // exact, subnormals too
#else
  return b ? __uint_as_float(b << 23) : 0x1p-127f;
#endif
#endif
}

// 8 x values in the order the decoded pairs use them. Pair p of a word is nibbles (p, p + 4): for
// canonical 4-bit words elements (p, p + 4), so the unit becomes (x0,x4) (x1,x5) (x2,x6) (x3,x7); tiled
// 4-bit words hold their nibbles in pair order (quant_math.tile_words) and 8-bit pairs are bytes
// (2p, 2p + 1): elements (2p, 2p + 1), x already in order.
#define X_REORDER (BITS == 4 && !PACKED)
__device__ __forceinline__ U4 x_unit_order(const U4 v) {
#if X_REORDER
  return U4{{prmt(v.v[0], v.v[2], 0x5410u), prmt(v.v[0], v.v[2], 0x7632u), prmt(v.v[1], v.v[3], 0x5410u),
             prmt(v.v[1], v.v[3], 0x7632u)}};
#else
  return v;
#endif
}

// Decoded pair p of a word: h x 2 holding nibbles (p, p + 4) for 4-bit (see x_unit_order), bytes
// (2p, 2p + 1) for 8-bit (p = 0..1). `zz` is the pair to add (minus the code offset and zero point),
// `sc` the pre-scale.
template <int P>
__device__ __forceinline__ u32 decode(u32 w, u32 zz, u32 sc, float zf, float sf) {
#if FMT == FMT_INT4
  u32 t = lop3<LUT_AND_OR>(w >> (4 * P), 0x000F000Fu, H2_INT4);  // magic + code, exact
  t = fma2(t, H2_ONE, zz);                                           // code - 8 - z, exact
#if SMODE == SMODE_PRE
  t = fma2(t, sc, H2_NEG0);
#endif
  return t;
#elif FMT == FMT_E2M1
  u32 y = w << (12 - 4 * P);  // nibbles p, p+4 at bits 12..15, 28..31
#if XF16
  u32 t = lop3<LUT_AND_OR>(y, 0x80008000u, (y >> 3) & 0x0E000E00u);  // sign | e,m -> fp16 = v * 2^-14
  t = fma2(t, 0x74007400u, H2_NEG0);                                 // * 2^14: exact
#else
  u32 t = lop3<LUT_AND_OR>(y, 0x80008000u, (y >> 6) & 0x01C001C0u);  // sign | e,m -> bf16 = v * 2^-126
#if !E2M1_FOLD
  t = fma2(t, 0x7E807E80u, H2_NEG0);  // * 2^126: exact
#endif
#endif
  return fma2(t, sc, H2_NEG0);                                       // * scale: exact for fp8/e8m0
#elif FMT == FMT_E4M3
  u32 t = prmt(w, 0u, P ? 0x3424u : 0x1404u);  // bytes (2p, 2p+1) to bits 8..15 / 24..31
  t = lop3<LUT_AND_OR>(t, 0x80008000u, (t >> 4) & 0x07F007F0u);  // bf16 = v * 2^-120
  t = fma2(t, 0x7B807B80u, H2_NEG0);                            // * 2^120: exact
  return fma2(t, sc, H2_NEG0);
#else  // int8: through fp32 (2^23 + byte) - (2^23 + 128 + z)
  float lo = __uint_as_float(prmt(w, 0x4B000000u, P ? 0x7542u : 0x7540u)) - zf;
  float hi = __uint_as_float(prmt(w, 0x4B000000u, P ? 0x7543u : 0x7541u)) - zf;
#if SMODE == SMODE_PRE
  lo *= sf;
  hi *= sf;
#endif
  return pack2(lo, hi);
#endif
}

#if WGMMA || XS
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
#endif
#if WGMMA
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// x[:M, chunk ch] -> staging slot `slot` (natural order, rows XROW apart), asynchronously; one
// commit group per chunk, also when empty, so that the waits count chunks.
__device__ __forceinline__ void x_copy(u32 slot, const u16* __restrict__ x, int M, int K, int ch, bool on) {
  constexpr int UPR = KPC / 8, N = (MT * 8 * UPR + WARPS * 32 - 1) / (WARPS * 32);
#pragma unroll
  for (int i = 0; i < N; i++) {
    const int t = threadIdx.x + i * WARPS * 32, m = t / UPR, uu = t % UPR;
    if (on && m < M) cp_async16(slot + m * XROW + uu * 16, x + (size_t)m * K + (size_t)ch * KPC + uu * 8);
  }
  cp_commit();
}
// Staging slot -> B buffer `buf`, as wgmma's B operand (see XBUF); then visible to the async proxy.
// Task t: token (t % 8) + 8 (t / (8 UNITS)), unit (t / 8) % UNITS: 8 consecutive threads read 8
// rows and write the 8 consecutive 16-byte rows of one core matrix (no bank conflicts). Tokens >= M
// are zeros.
__device__ __forceinline__ void x_transform(u32 slot, u32 buf, int M) {
#pragma unroll
  for (int i = 0; i < XT; i++) {
    const int t = threadIdx.x + i * WARPS * 32;
    const int m = (t & 7) + 8 * (t / (8 * UNITS)), u = (t >> 3) % UNITS;
    if (t < XTASKS) {
      U4 w[4];
#if XNAT  // core matrix 4u + e is x's unit 4u + e: the transpose below undoes this one (registers only)
      U4 n[4];
#pragma unroll
      for (int e = 0; e < 4; e++) n[e] = m < M ? ld_shared(slot + m * XROW + (4 * u + e) * 16) : U4{{0u, 0u, 0u, 0u}};
#pragma unroll
      for (int qq = 0; qq < 4; qq++) w[qq] = U4{{n[0].v[qq], n[1].v[qq], n[2].v[qq], n[3].v[qq]}};
#else
#pragma unroll
      for (int qq = 0; qq < 4; qq++) {
        const U4 v = m < M ? ld_shared(slot + m * XROW + qq * KPL * 2 + u * 16) : U4{{0u, 0u, 0u, 0u}};
        w[qq] = x_unit_order(v);  // pair e is decode<e>'s
      }
#endif
#pragma unroll
      for (int e = 0; e < 4; e++)
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(buf + ((4 * u + e) * MT + (m >> 3)) * 128 +
                                                                      (m & 7) * 16),
                     "r"(w[0].v[e]), "r"(w[1].v[e]), "r"(w[2].v[e]), "r"(w[3].v[e]));
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// wgmma reads its A fragments from registers asynchronously: keep them allocated until it is done.
__device__ __forceinline__ void wg_fence_frags(u32 (&f)[KPC / 16][4]) {
#pragma unroll
  for (int k = 0; k < KPC / 16; k++)
#pragma unroll
    for (int i = 0; i < 4; i++) asm volatile("" : "+r"(f[k][i])::"memory");
}
// The accumulators are written asynchronously by wgmma: pin them around it.
__device__ __forceinline__ void wg_fence_acc(float (&acc)[MT][4]) {
#pragma unroll
  for (int t = 0; t < MT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) asm volatile("" : "+f"(acc[t][i])::"memory");
}
#endif

#if WS || XS
__device__ __forceinline__ void mbar_init(u32 a, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
// Before releasing a ring slot that this thread read with ordinary shared-memory loads to a producer that refills it
// by bulk copy or TMA (the async proxy): orders those reads before the refill's writes. Without it the refill can
// overtake loads still in flight (seen on sm_90 with 16 consumer warps and 227 KB of shared memory per CTA).
__device__ __forceinline__ void reads_before_async_writes() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(a), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void mbar_expect_tx(u32 a, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
#if XNAT
// x[:, k0 : k0 + 64] straight into shared memory: the tensor map (wo_mma.py: _x_tensor_map) boxes 64 k (128 bytes)
// x 8 MT tokens, 128-byte swizzled (16-byte unit j of row m at j ^ (m % 8) within 1024-byte atoms), tokens from M
// on zeros. That is wgmma's K-major 128B-swizzle layout (wg_desc_sw128), and rows that ldmatrix reads without bank
// conflicts (XS). A chunk is KPC / 64 boxes.
#define XBOX (MT * 8 * 128)
__device__ __forceinline__ void tma_load_x(u32 dst, const void* map, int k0, int row0, u32 bar,
                                           unsigned long long pol) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3}], [%4], %5;"
               ::"r"(dst), "l"(map), "r"(k0), "r"(row0), "r"(bar), "l"(pol) : "memory");
}
// Chunk `ch` of x's MT * 8 rows from `row0` into `slot` by lane 0 of the calling warp, counted in bytes on mbarrier
// `full` (lane 0's expect_tx is its one arrival).
__device__ __forceinline__ void tma_fill_x(u32 slot, u32 full, const TMap* map, int ch, unsigned long long pol,
                                           int row0 = 0) {
  if ((threadIdx.x & 31) == 0) {
    mbar_expect_tx(full, MT * 8 * KPC * 2);
#pragma unroll
    for (int b = 0; b < KPC / 64; b++) tma_load_x(slot + b * XBOX, map, ch * KPC + b * 64, row0, full, pol);
  }
}
#endif
#endif
#if XS
// The ring: slot `sl` of K part kp at (kp * XSTAGES + sl) * XSLOT bytes: one chunk of M rows of XRS bytes (padded
// as the staged slice: conflict-free 16-byte reads), or (XNAT) of x's natural rows as TMA writes them (MT * 8 rows,
// 128-byte swizzled boxes, from a 1024-byte aligned base), read with ldmatrix. Its mbarriers (full: the producer
// warp's copies landed; empty: every active tile group of the part has its x in registers) follow the ring and the
// regions that reuse its memory after the main loop (the KW partials, the cluster's partials), so they stay valid
// to the end.
constexpr int XRS = x_row_stride(1);
#if XNAT
#define XSLOT(M) (MT * 8 * KPC * 2)
#define XS_ALIGN 1024  // (slack for aligning the ring's base)
#else
#define XSLOT(M) ((M) * XRS)
#define XS_ALIGN 0
#endif
__device__ __forceinline__ int xs_bar_offset(int M) {
  int o = KW * XSTAGES * XSLOT(M) + XS_ALIGN;
#if KW > 1
  o = max(o, (KW - 1) * TPC * MT * 32 * 16);
#endif
#if CLUSTER > 1
  o = max(o, M * TPC * 16 * 4);
#endif
  return (o + 15) & ~15;
}
#if XNAT  // (the ring is filled by tma_fill_x)
// x units 4u .. 4u + 3 of token tile t of a chunk (slot `slot`), as X[t][u] (see the main loop): matrix i of the
// ldmatrix is unit 4u + i of tokens 8t .. 8t + 7, whose rows lanes 8i .. 8i + 7 address (swizzled, see tma_load_x).
__device__ __forceinline__ U4 x_ldmatrix(u32 slot, int t, int u) {
  const int lane = threadIdx.x & 31, row = lane & 7, unit = 4 * u + (lane >> 3);
  const u32 a = slot + (unit >> 3) * XBOX + (t * 8 + row) * 128 + (((unit & 7) ^ row) << 4);
  U4 v;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.v[0]), "=r"(v.v[1]), "=r"(v.v[2]), "=r"(v.v[3]) : "r"(a));
  return v;
}
#else
// Chunk `ch` of x's M rows into ring slot `slot` by the calling (producer) warp: 16-byte cp.async copies, then
// each lane's arrive on mbarrier `full` (initialized to 32) fires once its copies have landed.
__device__ __forceinline__ void x_fill(u32 slot, u32 full, const u16* __restrict__ x, int M, int K, int ch) {
  constexpr int UPR = KPC / 8;  // 16-byte units per row
  for (int t = threadIdx.x & 31; t < M * UPR; t += 32) {
    const int m = t / UPR, wu = t % UPR;
    cp_async16(slot + m * XRS + x_unit_off(wu), x + (size_t)m * K + (size_t)ch * KPC + wu * 8);
  }
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
}
#endif
#endif

#if WS
// Warp-specialized wgmma build: two producer warps fill two rings in shared memory with bulk copies
// (cp.async.bulk, completion counted in bytes on the slot's `full` mbarrier): NSTG slots of weights,
// each one chunk of every consumer warp's 16 tiled rows (WSTAGE), and XSTAGES slots of x, each one
// chunk already in the B layout (x_prep). Consumer warps wait only on their slots' `full` barriers
// and release them (`empty`, every consumer thread arrives): a weight slot as soon as its words are
// in registers, an x slot once the wgmmas that read it are done. No CTA barrier in the main loop.
#define WSTAGE (WARPS * 1024)  // one chunk of 16 rows (2 x 32 lanes x 16 bytes) per warp
// global -> this CTA's shared memory, `bytes` (a multiple of 16) counted on mbarrier `bar`
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar, unsigned long long pol) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}
#if XNAT
// Descriptor of a K-major, 128-byte-swizzled B tile at `addr` (1024-byte atoms of 8 tokens, 1024 bytes apart; the
// k16 step's 32 bytes within the 128-byte row: the address moves by them, the swizzle follows the address bits).
__device__ __forceinline__ unsigned long long wg_desc_sw128(u32 addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
#endif
#endif

// Group index (scale / zero-point column) of lane q's k in chunk ch.
__device__ __forceinline__ int group_index(int ch, int q) {
#if SMODE == SMODE_END
  return 0;
#else
  return (ch * KPC + q * KPL) / GROUP;
#endif
}

// The zero points and pre-scales (SMODE_PRE) of this lane's rows r (a) and r + 8 (b) in chunk `ch`
// (sra / srb: their scale rows): loaded ahead of the chunk's decode, as their latency is not hidden.
struct ChunkConsts { float za, zb, sa0, sb0, sa1, sb1; };
__device__ __forceinline__ ChunkConsts chunk_consts(int ch, int q, int sra, int srb, const void* __restrict__ s,
                                                    const ZP_T* __restrict__ zp) {
  ChunkConsts c;
  const int gi = group_index(ch, q);
#if HAS_ZP
  c.za = (float)zp[sra + gi];
  c.zb = (float)zp[srb + gi];
#else
  c.za = c.zb = 0.f;
#endif
#if SMODE == SMODE_PRE
  // 4-bit with groups of 16: words 0-1 and 2-3 of the lane take two scales
  const int g2 = (BITS == 4 && GROUP == 16) ? 1 : 0;
  c.sa0 = scale_f32(s, sra + gi);
  c.sb0 = scale_f32(s, srb + gi);
  c.sa1 = g2 ? scale_f32(s, sra + gi + 1) : c.sa0;
  c.sb1 = g2 ? scale_f32(s, srb + gi + 1) : c.sb0;
#else
  c.sa0 = c.sb0 = c.sa1 = c.sb1 = 1.f;
#endif
  return c;
}

// Decodes this lane's words of one chunk (A: row r, B: row r + 8) with its ChunkConsts and hands the
// A fragment of each k16 step, in order, to emit(k16, a0, a1, a2, a3). Chunk and row scales are the
// caller's.
template <class F>
__device__ __forceinline__ void decode_chunk(const U4& A, const U4& B, const ChunkConsts& c, F&& emit) {
  const float za = c.za, zb = c.zb, sa0 = c.sa0, sb0 = c.sb0, sa1 = c.sa1, sb1 = c.sb1;
  // the constant added to the decoded codes, per row
#if FMT == FMT_INT4
  const u32 zza = pack2(-INT4_BIAS - za, -INT4_BIAS - za), zzb = pack2(-INT4_BIAS - zb, -INT4_BIAS - zb);
#else
  const u32 zza = 0, zzb = 0;
#endif
  const float zfa = 8388608.f + 128.f + za, zfb = 8388608.f + 128.f + zb;
#if SMODE == SMODE_PRE
  const u32 pa0 = pack2(sa0 * FOLD_SCALE, sa0 * FOLD_SCALE), pb0 = pack2(sb0 * FOLD_SCALE, sb0 * FOLD_SCALE);
  const u32 pa1 = pack2(sa1 * FOLD_SCALE, sa1 * FOLD_SCALE), pb1 = pack2(sb1 * FOLD_SCALE, sb1 * FOLD_SCALE);
#else
  const u32 pa0 = 0, pb0 = 0, pa1 = 0, pb1 = 0;
#endif
#pragma unroll
  for (int j = 0; j < 4; j++) {
#if FMT == FMT_INT8S
    const u32 wa_ = A.v[j] ^ 0x80808080u, wb_ = B.v[j] ^ 0x80808080u;  // two's complement -> code + 128
#else
    const u32 wa_ = A.v[j], wb_ = B.v[j];
#endif
    const u32 sca = (j < 2) ? pa0 : pa1, scb = (j < 2) ? pb0 : pb1;
    const float sfa = (j < 2) ? sa0 : sa1, sfb = (j < 2) ? sb0 : sb1;
#if BITS == 4
    // word j: 8 k; two steps (h), pairs (2h, 2h+4) and (2h+1, 2h+5)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const u32 a0 = h ? decode<2>(wa_, zza, sca, zfa, sfa) : decode<0>(wa_, zza, sca, zfa, sfa);
      const u32 a1 = h ? decode<2>(wb_, zzb, scb, zfb, sfb) : decode<0>(wb_, zzb, scb, zfb, sfb);
      const u32 a2 = h ? decode<3>(wa_, zza, sca, zfa, sfa) : decode<1>(wa_, zza, sca, zfa, sfa);
      const u32 a3 = h ? decode<3>(wb_, zzb, scb, zfb, sfb) : decode<1>(wb_, zzb, scb, zfb, sfb);
      emit(2 * j + h, a0, a1, a2, a3);
    }
#else
    // word j: 4 k, one step; pairs (0, 1) and (2, 3)
    const u32 a0 = decode<0>(wa_, zza, sca, zfa, sfa), a1 = decode<0>(wb_, zzb, scb, zfb, sfb);
    const u32 a2 = decode<1>(wa_, zza, sca, zfa, sfa), a3 = decode<1>(wb_, zzb, scb, zfb, sfb);
    emit(j, a0, a1, a2, a3);
#endif
  }
}

// Thread-block cluster (sm_90): the split-K CTAs of one column, reduced through distributed shared
// memory.
#if CLUSTER > 1
#define KATTR __cluster_dims__(1, CLUSTER, 1)
#else
#define KATTR
#endif
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ int cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}
__device__ __forceinline__ float4 ld_dsmem4(u32 addr, int rank) {  // `addr` in CTA `rank` of the cluster
  u32 a;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(a) : "memory");
  return v;
}

// Pair p's router weight: fp32, or (rh) of x's 16-bit dtype.
__device__ __forceinline__ float route_w(const void* __restrict__ route, int rh, int p) {
  return rh ? h_to_f32(((const u16*)route)[p]) : ((const float*)route)[p];
}

// The warp's RT tiles of fp32 outputs into the CTA's [M][TPC * 16] rows in shared memory (over x: the caller
// synchronizes once every warp is past it). Rows `tile` * 16 on; an inactive warp writes none.
__device__ __forceinline__ void acc_to_shared(float (&acc)[RT * MT][4], bool active, int tile, int M, float* red) {
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
  if (!active) return;
#pragma unroll
  for (int t = 0; t < RT * MT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const int tok = t % MT * 8 + 2 * q + (i & 1);
      if (tok < M) red[tok * TPC * 16 + (tile + t / MT) * 16 + r + (i >> 1) * 8] = acc[t][i];
    }
}

#if GACT
// The gated activation of one (gate, up) pair of fp32 outputs (the fused MoE's epilogue math).
__device__ __forceinline__ float gated_act(float g, float u, float alpha, float limit) {
#if GACT == 4  // swigluoai: (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)
  g = fminf(g, limit);
  return g / (1.f + __expf(-alpha * g)) * (fminf(fmaxf(u, -limit), limit) + 1.f);
#elif GACT == 1  // silu
  return g / (1.f + __expf(-g)) * u;
#elif GACT == 2  // gelu, tanh approximation: y sigmoid(2 sqrt(2 / pi) (y + 0.044715 y^3))
  return g / (1.f + __expf(-1.5957691216057308f * (g + 0.044715f * g * g * g))) * u;
#else  // gelu (erf)
  return 0.5f * g * (1.f + erff(g * 0.7071067811865476f)) * u;
#endif
}

// GACT's epilogue: the CTA's outputs [M][TPC * 16] (gate tiles, then up tiles) to shared memory, summed over the
// cluster's CTAs in rank order with a split; then 4 activations of one token per thread and step, written in x's
// dtype to the pair's row of out [pairs, N / 2]. Every thread of the CTA calls it.
__device__ __forceinline__ void store_act(float (&acc)[RT * MT][4], bool active, int tile, const float* __restrict__ gs,
                                          const u16* __restrict__ bias, u16* __restrict__ out, int M, int N,
                                          unsigned char* xs, const int* gpair, int pairs, float alpha, float limit) {
  constexpr int NR = TPC * 16, HR = NR / 2;  // output rows of a CTA, gate rows of a CTA
  const int I = N / 2;
  const float g = (HAS_GS ? gs[0] : 1.f) * FOLD_OUT;
  float* red = (float*)xs;  // [M][NR] fp32, over x once every warp is past it
  __syncthreads();
  acc_to_shared(acc, active, tile, M, red);
#if CLUSTER > 1
  cluster_sync();
  const u32 rbase = smem_addr(xs);
  const int total = M * HR / 4, per = (total + CLUSTER - 1) / CLUSTER, j0 = cluster_rank() * per;
#else
  __syncthreads();
  const int total = M * HR / 4, per = total, j0 = 0;
#endif
  const int j1 = min(j0 + per, total);
  for (int j = j0 + threadIdx.x; j < j1; j += NTHR) {
    const int tok = 4 * j / HR, c = 4 * j % HR, n = blockIdx.x * HR + c, pr = gpair[tok];
    if (n >= I || pr >= pairs) continue;
#if CLUSTER > 1
    float vg[4] = {0.f, 0.f, 0.f, 0.f}, vu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int cr = 0; cr < CLUSTER; cr++) {
      const float4 a = ld_dsmem4(rbase + 4 * (tok * NR + c), cr), b = ld_dsmem4(rbase + 4 * (tok * NR + HR + c), cr);
      vg[0] += a.x; vg[1] += a.y; vg[2] += a.z; vg[3] += a.w;
      vu[0] += b.x; vu[1] += b.y; vu[2] += b.z; vu[3] += b.w;
    }
#else
    const float4 a = *(const float4*)(red + tok * NR + c), b = *(const float4*)(red + tok * NR + HR + c);
    float vg[4] = {a.x, a.y, a.z, a.w}, vu[4] = {b.x, b.y, b.z, b.w};
#endif
    u16 o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      float gv = vg[i] * g, uv = vu[i] * g;
#if HAS_BIAS
      gv += h_to_f32(bias[n + i]);
      uv += h_to_f32(bias[I + n + i]);
#endif
      o[i] = f32_to_h(gated_act(gv, uv, alpha, limit));
    }
    *(uint2*)(out + (size_t)pr * I + n) = make_uint2(o[0] | ((u32)o[1] << 16), o[2] | ((u32)o[3] << 16));
  }
#if CLUSTER > 1
  cluster_sync();  // keep this CTA's shared memory until the cluster has read it
#endif
}
#endif

// The epilogue of both kernels: the global scale, the bias and the 16-bit output; with split-K, the
// reduction inside the cluster or through global memory. The warp's RT tiles (acc[j * MT + t] of
// tile j) are the CTA's tiles `tile` .. `tile` + RT - 1, rows n0 .. n0 + 16 RT - 1 of its TPC * 16
// (rows from N on, or an inactive warp: none); every thread of the CTA calls it.
__device__ __forceinline__ void store_out(float (&acc)[RT * MT][4], bool active, int tile, int n0,
                                          const float* __restrict__ gs, const u16* __restrict__ bias,
                                          u16* __restrict__ out, float* __restrict__ part,
                                          int* __restrict__ counters, int M, int N, unsigned char* xs,
                                          const int* gpair, int pairs, const void* __restrict__ route,
                                          int rh) {
  const int lane = threadIdx.x & 31, r = lane >> 2, q = lane & 3;
  const float g = (HAS_GS ? gs[0] : 1.f) * FOLD_OUT;

  if (gridDim.y == 1) {
    if (active) {
#pragma unroll
      for (int t = 0; t < RT * MT; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int tok = t % MT * 8 + 2 * q + (i & 1), n = n0 + t / MT * 16 + r + (i >> 1) * 8;
          if (tok < M && n < N) {
            float v = acc[t][i] * g;
#if HAS_BIAS
            v += h_to_f32(bias[n]);
#endif
#if GROUPED
            const int p = gpair[tok];
            if (p < pairs) ((float*)out)[(size_t)p * N + n] = route ? v * route_w(route, rh, p) : v;
#else
            out[(size_t)tok * N + n] = f32_to_h(v);
#endif
          }
        }
    }
    return;
  }
#if CLUSTER > 1
  // split-K inside one thread-block cluster (the CTAs of this column): partials to shared memory,
  // then CTA `rank` sums its slice of the outputs over the cluster's shared memories in rank order
  // (deterministic), no global memory, no counters.
  constexpr int NR = TPC * 16;    // output rows of a CTA
  __syncthreads();                // (x's shared memory: every warp is past it)
  acc_to_shared(acc, active, tile, M, (float*)xs);
  cluster_sync();
  {  // 4 consecutive outputs of one token per thread and step (NR and N are multiples of 16)
    const u32 rbase = smem_addr(xs);
    const int total = M * NR / 4, per = (total + CLUSTER - 1) / CLUSTER, j0 = cluster_rank() * per;
    const int j1 = min(j0 + per, total);
    for (int j = j0 + threadIdx.x; j < j1; j += NTHR) {
      const int tok = 4 * j / NR, n = blockIdx.x * NR + 4 * j % NR;
      if (n < N) {
        float4 p[CLUSTER];
#pragma unroll
        for (int c = 0; c < CLUSTER; c++) p[c] = ld_dsmem4(rbase + 16 * j, c);
        float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < CLUSTER; c++) {
          v[0] += p[c].x; v[1] += p[c].y; v[2] += p[c].z; v[3] += p[c].w;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
          v[i] *= g;
#if HAS_BIAS
          v[i] += h_to_f32(bias[n + i]);
#endif
        }
#if GROUPED
        const int pr = gpair[tok];
        if (pr < pairs) {
          const float rw = route ? route_w(route, rh, pr) : 1.f;
          *(float4*)((float*)out + (size_t)pr * N + n) = make_float4(v[0] * rw, v[1] * rw, v[2] * rw, v[3] * rw);
        }
#else
        u16 o[4];
#pragma unroll
        for (int i = 0; i < 4; i++) o[i] = f32_to_h(v[i]);
        *(uint2*)(out + (size_t)tok * N + n) = make_uint2(o[0] | ((u32)o[1] << 16), o[2] | ((u32)o[3] << 16));
#endif
      }
    }
  }
  cluster_sync();  // keep this CTA's shared memory until the cluster has read it
#elif GROUPED
  if (threadIdx.x == 0) __trap();  // (a grouped launch reduces its split in a cluster)
#else
  // split-K: partials, then the last CTA of this column reduces in split order
  if (active) {
    float* p = part + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int t = 0; t < RT * MT; t++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int tok = t % MT * 8 + 2 * q + (i & 1), n = n0 + t / MT * 16 + r + (i >> 1) * 8;
        if (tok < M && n < N) p[(size_t)tok * N + n] = acc[t][i];
      }
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(&counters[blockIdx.x], 1);
    is_last = prev == (int)gridDim.y - 1;
    if (is_last) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  if (!is_last || !active) return;
  __threadfence();
  for (int i = lane; i < 16 * RT * M; i += 32) {
    const int tok = i / (16 * RT), n = n0 + i % (16 * RT);
    if (n >= N) continue;
    float v = 0.f;
    for (int sp = 0; sp < (int)gridDim.y; sp++) v += ld_cg(part + ((size_t)sp * M + tok) * N + n);
    v *= g;
#if HAS_BIAS
    v += h_to_f32(bias[n]);
#endif
    out[(size_t)tok * N + n] = f32_to_h(v);
  }
#endif
}

// The grouped builds: the weight, scale, zero-point, global-scale and bias pointers of expert `ex` (per-expert strides
// wse, sse, zse in elements).
#define TO_EXPERT(ex)                                                             \
  do {                                                                            \
    w += (size_t)(ex) * wse;                                                      \
    s = (const unsigned char*)s + (size_t)(ex) * sse * (SK == SK_FP32 ? 4 : 1);   \
    if (HAS_ZP) zp += (size_t)(ex) * zse;                                         \
    if (HAS_GS) gs += (ex);                                                       \
    if (HAS_BIAS) bias += (size_t)(ex) * N;                                       \
  } while (0)

#if MINB > 1
#define LBOUNDS __launch_bounds__(NTHR, MINB)
#else
#define LBOUNDS __launch_bounds__(NTHR)  // (an explicit 1 lets the compiler use more registers)
#endif
// The one launch ABI of both builds (wo_mma.py passes the same arguments to either).
#define WO_MMA_KERNEL                                                                                  \
  extern "C" __global__ void KATTR LBOUNDS wo_mma(                                                    \
      const u16* __restrict__ x, const u32* __restrict__ w, const void* __restrict__ s,               \
      const ZP_T* __restrict__ zp, const float* __restrict__ gs, const u16* __restrict__ bias,        \
      u16* __restrict__ out, float* __restrict__ part, int* __restrict__ counters, int M, int N, int K, \
      int ss, int cps WO_MMA_TAIL)
#if WS && GROUPED  // x's tensor map (XNAT; else unused), the token sort's blocks, router weights, expert strides
#define WO_MMA_TAIL , const __grid_constant__ TMap xmap, const int* __restrict__ sids, const int* __restrict__ bexp, \
    const void* __restrict__ route, int pairs, long long wse, int sse, int zse, int rh, int nexp
#elif (WS || XS) && XNAT  // (the builds that load x by TMA on natural-order tiles: x's tensor map)
#define WO_MMA_TAIL , const __grid_constant__ TMap xmap
#elif GROUPED  // the token sort's blocks, router weights, x rows per pair and the per-expert strides (elements)
#define WO_MMA_TAIL , const int* __restrict__ sids, const int* __restrict__ bexp, const void* __restrict__ route, \
    int pairs, int adiv, long long wse, int sse, int zse, int rh, int direct, int nexp, int ready, \
    float alpha, float limit, int kx
#else
#define WO_MMA_TAIL
#endif
#if !WS
WO_MMA_KERNEL {
  extern __shared__ __align__(16) unsigned char xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, q = lane & 3;
#if GROUPED
  // this CTA's block of the token sort, read after the previous kernel has completed unless `ready`: the sort
  // was complete when this kernel launched (a kernel launched without PDL ran in between), so the block is read
  // and its weights requested before griddepcontrol.wait, x after it. direct (1: int32 ids, 2: int64): block z
  // is pair z alone, bexp the pairs' expert ids (outside [0, nexp): none).
  __shared__ int gpair[MT * 8];
#if PDL && __CUDA_ARCH__ >= 900
  if (!ready) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  int gex;
  if (direct) {
    const long long id = direct == 2 ? ((const long long*)bexp)[blockIdx.z] : (long long)bexp[blockIdx.z];
    gex = id >= 0 && id < nexp ? (int)id : -1;
  } else {
    gex = bexp[blockIdx.z];
  }
  if (gex < 0) return;  // (every CTA of a cluster: one block)
  TO_EXPERT(gex);
  if (threadIdx.x < MT * 8)
    gpair[threadIdx.x] = direct ? (threadIdx.x ? pairs : (int)blockIdx.z) : sids[blockIdx.z * (MT * 8) + threadIdx.x];
  __syncthreads();
#if XPAD  // x's rows hold kx < K columns (the weight's K padded to whole chunks): zeros past them
#define X_ROW(m) (gpair[m] < pairs ? x + (size_t)(gpair[m] / adiv) * kx : (const u16*)0)
#define X_IN(col) ((col) < kx)
#else
#define X_ROW(m) (gpair[m] < pairs ? x + (size_t)(gpair[m] / adiv) * K : (const u16*)0)
#define X_IN(col) true
#endif
#else
  const int* gpair = 0;
  const int pairs = 0;
  const void* route = 0;
  const int rh = 0;
#define X_ROW(m) (x + (size_t)(m) * K)
#define X_IN(col) true
#endif
  const int tile = warp / KW * RT;  // this warp's first tile in the CTA
#if GACT  // tiles 0 .. TPC/2 - 1: gate rows; the others: the same rows of the up half (N / 2 on)
  const bool up = tile >= TPC / 2;
  const int n0 = (up ? N / 2 : 0) + (blockIdx.x * (TPC / 2) + tile - (up ? TPC / 2 : 0)) * 16;
  const int nlim = up ? N : N / 2;
#else
  const int n0 = (blockIdx.x * TPC + tile) * 16;
  const int nlim = N;
#endif
  const bool active = n0 < nlim;  // N % 16 == 0; idle warps still join the barriers
  const int nch = K / KPC;
  const int c0 = blockIdx.y * cps, c1 = min(c0 + cps, nch);
  // this warp's chunks: part kp of KW of the CTA's range (all of it when KW = 1)
  const int kp = warp % KW, cpw = (c1 - c0 + KW - 1) / KW;
  const int w0 = min(c0 + kp * cpw, c1), w1 = min(w0 + cpw, c1);
  const int ks = (c1 - c0) * KPC;          // this CTA's K range
  const int rs = x_row_stride(c1 - c0);    // x row stride in shared memory (bytes)
  const int wpr = K / (32 / BITS);         // words per weight row
  const int rowa = active ? n0 + r : 0;
#if PACKED  // [N/16][K/KPC][2][32 lanes][4 words]: a warp streams one contiguous run
#define CH_STRIDE 256
  const u32* wa = w + (size_t)(active ? n0 / 16 : 0) * nch * 256 + lane * 4;
  const u32* wb = wa + 128;
  const size_t tstride = (size_t)nch * 256;  // words from one tile to the next
#else
#define CH_STRIDE 16
  const u32* wa = w + (size_t)rowa * wpr + q * 4;
  const u32* wb = wa + (size_t)8 * wpr;
  const size_t tstride = (size_t)16 * wpr;
#endif

  // Per-lane scale / zero-point row bases; tile j's offsets from tile 0 (tiles from N on read tile 0's
  // rows, their outputs are dropped).
  const int sra = rowa * ss, srb = (rowa + 8) * ss;
  size_t wo[RT];
  int so[RT];
#pragma unroll
  for (int j = 0; j < RT; j++) {
    const int tj = n0 + 16 * j < nlim ? j : 0;
    wo[j] = tj * tstride;
    so[j] = tj * 16 * ss;
  }

  // wgmma is warpgroup-wide: idle warps run the loop too (on rows 0..15), only their outputs are dropped
  const bool run = WGMMA || active;
  U4 ra[RT][STAGES], rb[RT][STAGES];
#pragma unroll
  for (int i = 0; i < STAGES; i++)
    if (run && w0 + i < w1)
#pragma unroll
      for (int j = 0; j < RT; j++) {
        ra[j][i] = ld_stream(wa + wo[j] + (size_t)(w0 + i) * CH_STRIDE);
        rb[j][i] = ld_stream(wb + wo[j] + (size_t)(w0 + i) * CH_STRIDE);
      }
  // the first chunks' scales and zero points (like the weights, not written by the previous kernel)
#if WGMMA
  ChunkConsts kc[2];  // chunk j's in kc[(j - c0) % 2], loaded a chunk before its decode
  kc[0] = chunk_consts(c0, q, sra, srb, s, zp);
  if (c0 + 1 < c1) kc[1] = chunk_consts(c0 + 1, q, sra, srb, s, zp);
#endif

#if XS
  // this part's ring and barriers; its producer is the part's warp of tile group 0, which (if any is) is active
  const u32 xring = (XS_ALIGN ? (smem_addr(xs) + XS_ALIGN - 1) & ~(u32)(XS_ALIGN - 1) : smem_addr(xs)) +
                    kp * XSTAGES * XSLOT(M);
  const u32 xbars = smem_addr(xs) + xs_bar_offset(M);  // full [KW][XSTAGES], then empty [KW][XSTAGES]
  const u32 xfull = xbars + kp * XSTAGES * 8, xempty = xfull + KW * XSTAGES * 8;
  const bool producer = warp < KW && active;
  const int nsteps = w1 - w0;
  if (threadIdx.x < KW * XSTAGES) {
    const int groups = min(WARPS / KW, (N / 16 - (int)blockIdx.x * TPC + RT - 1) / RT);  // active groups
    mbar_init(xbars + threadIdx.x * 8, XNAT ? 1 : 32);
    mbar_init(xbars + (KW * XSTAGES + threadIdx.x) * 8, max(groups, 1));
  }
#if XNAT
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // (visible to TMA's complete_tx)
#endif
  __syncthreads();
#endif

#if PDL && __CUDA_ARCH__ >= 900
#if TRIG
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  // launched with programmatic stream serialization: the weight loads above may overlap the
  // previous kernel; x and every output buffer are touched only after it has completed
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if WGMMA
  // x: chunks c0 .. c0 + XSTAGES - 1 into the staging ring; chunk c0 into B buffer 0, published by
  // the loop's first barrier
  const u32 xbufs = smem_addr(xs), xstage = xbufs + 2 * XBUF;
#pragma unroll
  for (int i = 0; i < XSTAGES; i++) x_copy(xstage + i * XSTAGE, x, M, K, c0 + i, c0 + i < c1);
  cp_wait<XSTAGES - 1>();
  __syncthreads();
  x_transform(xstage, xbufs, M);
#elif XS
  // the first XSTAGES chunks of this part, x in its natural order (see x_unit_order)
#if XNAT
  unsigned long long pol;  // (x stays in L2 for the other CTAs)
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
#define X_FILL(slot, ch) tma_fill_x(xring + (slot) * XSLOT(M), xfull + 8 * (slot), &xmap, ch, pol)
#else
#define X_FILL(slot, ch) x_fill(xring + (slot) * XSLOT(M), xfull + 8 * (slot), x, M, K, ch)
#endif
  if (producer)
    for (int i = 0; i < XSTAGES && i < nsteps; i++) X_FILL(i, w0 + i);
#if !XNAT
  const u32 xlane = xring + X_SEG(q);
#endif
#else
  // x[:, c0*KPC : c1*KPC] -> shared memory, in the order the MMA reads it (see X_SEG / X_ROW_MOD):
  // lane q's 16-byte units of a chunk are contiguous, 4-bit units of canonical words hold
  // (x0,x4,x1,x5,x2,x6,x3,x7).
  {
    const int upc = KPC / 8;
    const u32 base = smem_addr(xs);
#if XNAT  // word q of x's unit n = 4u + i of a chunk is word i of lane q's unit u (its pair 4u + i)
    for (int i = threadIdx.x; i < M * (ks / 8); i += WARPS * 32) {
      const int m = i / (ks / 8), gu = i - m * (ks / 8), n = gu % upc;
      const u16* xr = X_ROW(m);
      const int col = c0 * KPC + gu * 8;
      const U4 v = xr && X_IN(col) ? *(const U4*)(xr + col) : U4{{0u, 0u, 0u, 0u}};
      const u32 dst = base + m * rs + (gu / upc) * X_CS;
#pragma unroll
      for (int qq = 0; qq < 4; qq++)
        asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst + x_word_off(n, qq)), "r"(v.v[qq]));
    }
#else
    for (int i = threadIdx.x; i < M * (ks / 8); i += WARPS * 32) {
      const int m = i / (ks / 8), gu = i - m * (ks / 8);
      const u16* xr = X_ROW(m);
      const int col = c0 * KPC + gu * 8;
      const U4 v = xr && X_IN(col) ? x_unit_order(*(const U4*)(xr + col)) : U4{{0u, 0u, 0u, 0u}};
      const u32 off = (gu / upc) * X_CS + x_unit_off(gu % upc);
      asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(base + m * rs + off),
                   "r"(v.v[0]), "r"(v.v[1]), "r"(v.v[2]), "r"(v.v[3]));
    }
#endif
  }
  __syncthreads();
  const u32 xlane = smem_addr(xs) + X_SEG(q);
#endif

  float acc[RT * MT][4];  // tile j, token tile t: acc[j * MT + t]
#pragma unroll
  for (int t = 0; t < RT * MT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) acc[t][i] = 0.f;

  // Row constants for tensor / channel scales and zero points.
#if SMODE == SMODE_END
  float s_a[RT], s_b[RT];
#pragma unroll
  for (int j = 0; j < RT; j++) {
    s_a[j] = scale_f32(s, sra + so[j]);
    s_b[j] = scale_f32(s, srb + so[j]);
  }
#endif

#if WGMMA
  // Software pipeline over chunks: the wgmmas of chunk ch run while the CTA rewrites chunk ch + 1's x
  // into the other B buffer and each warp decodes chunk ch + 1's weights into the other fragment set.
  // Two barriers per chunk: B(ch) complete before its wgmmas; every warpgroup's wgmmas of ch - 1 done
  // before their B buffer and fragments are overwritten.
  u32 af[2][KPC / 16][4];
  decode_chunk(ra[0][0], rb[0][0], kc[0], [&](int k16, u32 a0, u32 a1, u32 a2, u32 a3) {
    af[0][k16][0] = a0; af[0][k16][1] = a1; af[0][k16][2] = a2; af[0][k16][3] = a3;
  });
  if (c0 + STAGES < c1) {
    ra[0][0] = ld_stream(wa + (size_t)(c0 + STAGES) * CH_STRIDE);
    rb[0][0] = ld_stream(wb + (size_t)(c0 + STAGES) * CH_STRIDE);
  }
  for (int c = c0; c < c1; c += STAGES) {
#pragma unroll
    for (int st = 0; st < STAGES; st++) {
      const int ch = c + st, p = st & 1;  // (ch - c0) % 2 == st % 2: STAGES is even
      if (ch < c1) {
        __syncthreads();
        {
          const unsigned long long d0 = wg_desc(xbufs + p * XBUF);
          wg_fence_acc(acc);
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
          for (int k16 = 0; k16 < KPC / 16; k16++)
            wgmma_k16(&acc[0][0], af[p][k16][0], af[p][k16][1], af[p][k16][2], af[p][k16][3],
                      d0 + ((k16 * 2 * MT * 128) >> 4));
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        }
        if (ch + 1 < c1) {
          cp_wait<XSTAGES - 2>();
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // this warpgroup's chunk ch - 1
          wg_fence_frags(af[p ^ 1]);
          __syncthreads();
          const int sl = (ch - c0) % XSTAGES, sn = (st + 1) % STAGES;
          x_copy(xstage + sl * XSTAGE, x, M, K, ch + XSTAGES, ch + XSTAGES < c1);
          x_transform(xstage + ((sl + 1) % XSTAGES) * XSTAGE, xbufs + (p ^ 1) * XBUF, M);
          decode_chunk(ra[0][sn], rb[0][sn], kc[p ^ 1], [&](int k16, u32 a0, u32 a1, u32 a2, u32 a3) {
            af[p ^ 1][k16][0] = a0; af[p ^ 1][k16][1] = a1; af[p ^ 1][k16][2] = a2; af[p ^ 1][k16][3] = a3;
          });
          if (ch + 2 < c1) kc[p] = chunk_consts(ch + 2, q, sra, srb, s, zp);
          if (ch + 1 + STAGES < c1) {
            ra[0][sn] = ld_stream(wa + (size_t)(ch + 1 + STAGES) * CH_STRIDE);
            rb[0][sn] = ld_stream(wb + (size_t)(ch + 1 + STAGES) * CH_STRIDE);
          }
        }
      }
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  wg_fence_acc(acc);
  cp_wait<0>();  // (only empty groups can be left)
#else
  if (active) {
    for (int c = w0; c < w1; c += STAGES) {
#pragma unroll
      for (int st = 0; st < STAGES; st++) {
        const int ch = c + st;
        if (ch < w1) {
#if SMODE == SMODE_CHUNK
          float tmp[RT * MT][4];
#pragma unroll
          for (int t = 0; t < RT * MT; t++)
#pragma unroll
            for (int i = 0; i < 4; i++) tmp[t][i] = 0.f;
#define DST tmp
#else
#define DST acc
#endif
          ChunkConsts kc[RT];
#pragma unroll
          for (int j = 0; j < RT; j++) kc[j] = chunk_consts(ch, q, sra + so[j], srb + so[j], s, zp);
          // x units of this chunk, per token tile (zeros for rows >= M), for all RT tiles
          U4 X[MT][UNITS];
#if XS
          const int xi = ch - w0, xsl = xi % XSTAGES;
          mbar_wait(xfull + 8 * xsl, (xi / XSTAGES) & 1);
#endif
#if XS && XNAT
#pragma unroll
          for (int t = 0; t < MT; t++)
#pragma unroll
            for (int u = 0; u < UNITS; u++) X[t][u] = x_ldmatrix(xring + xsl * XSLOT(M), t, u);
#else
#pragma unroll
          for (int t = 0; t < MT; t++) {
            const int tok = t * 8 + r;
#if XS
            const u32 a = xlane + xsl * XSLOT(M) + tok * XRS;
#else
            const u32 a = xlane + tok * rs + (ch - c0) * X_CS;
#endif
#pragma unroll
            for (int u = 0; u < UNITS; u++) {
              if (tok < M) X[t][u] = XS ? x_unit_order(ld_shared(a + u * 16)) : ld_shared(a + u * 16);
              else X[t][u] = U4{{0u, 0u, 0u, 0u}};
            }
          }
#endif
#if XS
          // x of this chunk is in registers: release its slot; the producer refills the previous chunk's
          // slot (released by now unless a tile group lags) with the chunk XSTAGES after it
          reads_before_async_writes();
          __syncwarp();
          if (lane == 0) mbar_arrive(xempty + 8 * xsl);
          if (producer && xi >= 1 && xi - 1 + XSTAGES < nsteps) {
            const int ps = (xi - 1) % XSTAGES;
            mbar_wait(xempty + 8 * ps, ((xi - 1) / XSTAGES) & 1);
            X_FILL(ps, ch - 1 + XSTAGES);
          }
#endif
          // step k16's x: 4-bit, pairs (0,4) (1,5) of unit k16 / 2 or (2,6) (3,7); 8-bit, words 0-1 or 2-3
#pragma unroll
          for (int j = 0; j < RT; j++)
            decode_chunk(ra[j][st], rb[j][st], kc[j], [&](int k16, u32 a0, u32 a1, u32 a2, u32 a3) {
#pragma unroll
              for (int t = 0; t < MT; t++) {
                const U4 xv = X[t][k16 >> 1];
                mma(DST[j * MT + t], a0, a1, a2, a3, xv.v[(k16 & 1) * 2], xv.v[(k16 & 1) * 2 + 1]);
              }
            });
#if SMODE == SMODE_CHUNK
          const int gi = group_index(ch, q);
#pragma unroll
          for (int j = 0; j < RT; j++) {
            const float cs_a = scale_f32(s, sra + so[j] + gi), cs_b = scale_f32(s, srb + so[j] + gi);
#pragma unroll
            for (int t = j * MT; t < (j + 1) * MT; t++) {
              acc[t][0] += tmp[t][0] * cs_a;
              acc[t][1] += tmp[t][1] * cs_a;
              acc[t][2] += tmp[t][2] * cs_b;
              acc[t][3] += tmp[t][3] * cs_b;
            }
          }
#endif
#undef DST
          if (ch + STAGES < w1)  // refill this stage once its words are decoded
#pragma unroll
            for (int j = 0; j < RT; j++) {
              ra[j][st] = ld_stream(wa + wo[j] + (size_t)(ch + STAGES) * CH_STRIDE);
              rb[j][st] = ld_stream(wb + wo[j] + (size_t)(ch + STAGES) * CH_STRIDE);
            }
        }
      }
    }
  }
#endif
#if PDL && !TRIG && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may start launching
#endif
#if KW > 1
  // the KW partial sums of each tile, added in part order by its first warp (over x's shared memory)
  float4* red = (float4*)xs;  // [KW - 1][TPC][MT][32 lanes]
  __syncthreads();
  if (active && kp > 0)
#pragma unroll
    for (int t = 0; t < RT * MT; t++)
      red[(((kp - 1) * TPC + tile) * MT + t) * 32 + lane] =
          make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
  __syncthreads();
  if (active && kp == 0)
    for (int j = 1; j < KW; j++)
#pragma unroll
      for (int t = 0; t < RT * MT; t++) {
        const float4 v = red[(((j - 1) * TPC + tile) * MT + t) * 32 + lane];
        acc[t][0] += v.x; acc[t][1] += v.y; acc[t][2] += v.z; acc[t][3] += v.w;
      }
  const bool owner = active && kp == 0;
#else
  const bool owner = active;
#endif
#if SMODE == SMODE_END
#pragma unroll
  for (int t = 0; t < RT * MT; t++) {
    acc[t][0] *= s_a[t / MT]; acc[t][1] *= s_a[t / MT]; acc[t][2] *= s_b[t / MT]; acc[t][3] *= s_b[t / MT];
  }
#endif
#if GACT
  store_act(acc, owner, tile, gs, bias, out, M, N, xs, gpair, pairs, alpha, limit);
#else
  store_out(acc, owner, tile, n0, gs, bias, out, part, counters, M, N, xs, gpair, pairs, route, rh);
#endif
#undef X_ROW
#undef X_IN
}
#else  // WS
// x [M, K] -> xp: for each chunk, x as the wgmma build's B operand (XBUF bytes, see x_transform),
// tokens M .. 8 MT - 1 zero. Task t: unit t % UNITS, token (t / UNITS) % (8 MT), chunk
// t / (8 MT UNITS): the 4 tasks of a token read 64 consecutive bytes of each of its 4 runs, and for
// each unit the 8 tokens of a core matrix write its 128 consecutive bytes.
// GROUPED: grid y runs over the blocks, block y's M rows from row M y of x, its chunks from chunk (K / KPC) y of xp.
extern "C" __global__ void __launch_bounds__(256) x_prep(const u16* __restrict__ x, u16* __restrict__ xp, int M,
                                                         int K) {
  x += (size_t)blockIdx.y * M * K;
  xp += (size_t)blockIdx.y * K * MT * 8;
#if PDL && __CUDA_ARCH__ >= 900
#if TRIG
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#else
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#endif
  const int t = blockIdx.x * blockDim.x + threadIdx.x, per = MT * 8 * UNITS;
  if (t >= (K / KPC) * per) return;
  const int ch = t / per, u = t % UNITS, m = (t / UNITS) % (MT * 8);
  U4 w[4];
#pragma unroll
  for (int qq = 0; qq < 4; qq++) {
    const U4 v = m < M ? *(const U4*)(x + (size_t)m * K + (size_t)ch * KPC + qq * KPL + u * 8) : U4{{0u, 0u, 0u, 0u}};
    w[qq] = x_unit_order(v);
  }
  unsigned char* dst = (unsigned char*)xp + (size_t)ch * XBUF;
#pragma unroll
  for (int e = 0; e < 4; e++)
    *(U4*)(dst + ((4 * u + e) * MT + (m >> 3)) * 128 + (m & 7) * 16) =
        U4{{w[0].v[e], w[1].v[e], w[2].v[e], w[3].v[e]}};
}

// `x` is x_prep's output. Warps 0 .. WARPS - 1 consume (warp w: rows 16 (blockIdx.x WARPS + w) ..
// + 15, wgmma per warpgroup), warp WARPS copies the weights, warp WARPS + 1 x.
WO_MMA_KERNEL {
  extern __shared__ __align__(128) unsigned char xs[];
  // weights: full[NSTG], empty[NSTG]; x: full[XSTAGES], empty[XSTAGES]
  __shared__ __align__(8) unsigned long long bars[2 * NSTG + 2 * XSTAGES];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = lane >> 2, q = lane & 3;
  const int nch = K / KPC, c0 = blockIdx.y * cps, nc = min(cps, nch - c0);
#if GROUPED
  // block z of the token sort (complete at launch: the gather of x's rows ran in between): its expert's weights,
  // scales, zero points, global scale and bias; its pairs' rows of x from row 8 MT z (x_prep: chunk nch z on)
  __shared__ int gpair[MT * 8];
  const int gex = bexp[blockIdx.z];
  if (gex < 0 || gex >= nexp) return;  // (every CTA of a cluster: one block)
  TO_EXPERT(gex);
  if (threadIdx.x < MT * 8) gpair[threadIdx.x] = sids[blockIdx.z * (MT * 8) + threadIdx.x];
  const int xrow0 = blockIdx.z * (MT * 8);
#else
  const int* gpair = 0;
  const int pairs = 0, rh = 0, xrow0 = 0;
  const void* route = 0;
#endif
  const int ntile = N / 16, tile0 = blockIdx.x * WARPS;
  // (XNAT: the x slots 1024-byte aligned, the swizzle's period)
  const u32 wring = smem_addr(xs), xring = XNAT ? (wring + NSTG * WSTAGE + 1023) & ~1023u : wring + NSTG * WSTAGE;
  const u32 wfull = smem_addr(bars), wempty = wfull + 8 * NSTG, xfull = wempty + 8 * NSTG,
            xempty = xfull + 8 * XSTAGES;
  if (threadIdx.x == 0) {
    for (int i = 0; i < NSTG; i++) {
      mbar_init(wfull + 8 * i, 1);
      mbar_init(wempty + 8 * i, WARPS * 32);
    }
    for (int i = 0; i < XSTAGES; i++) {
      mbar_init(xfull + 8 * i, 1);
      mbar_init(xempty + 8 * i, WARPS * 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#if PDL && TRIG && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  float acc[MT][4];
#pragma unroll
  for (int t = 0; t < MT; t++)
#pragma unroll
    for (int i = 0; i < 4; i++) acc[t][i] = 0.f;
  const int n0 = (tile0 + warp) * 16;
  const bool active = warp < WARPS && n0 < N;

  if (warp == WARPS) {
    // Weights (not written by the previous kernel: no griddepcontrol.wait): lane t < WARPS copies
    // warp t's 1 KB of the chunk (tiled words [N / 16][K / KPC][2][32][4]; past N, the last tile's,
    // so that every slot has the same bytes).
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    const u32* wt = w + (size_t)min(tile0 + lane, ntile - 1) * nch * 256 + (size_t)c0 * 256;
    for (int i = 0; i < nc; i++) {
      const int st = i % NSTG;
#if PDL && __CUDA_ARCH__ >= 900
      if (i == NSTG) asm volatile("griddepcontrol.wait;" ::: "memory");  // ring full: block rather than spin
#endif
      if (i >= NSTG) mbar_wait(wempty + 8 * st, ((i / NSTG) - 1) & 1);
      if (lane == 0) mbar_expect_tx(wfull + 8 * st, WSTAGE);
      __syncwarp();
      if (lane < WARPS) bulk_copy(wring + st * WSTAGE + lane * 1024, wt + (size_t)i * 256, 1024, wfull + 8 * st, pol);
    }
  } else if (warp == WARPS + 1) {
    // x (XNAT: x itself through its tensor map, else x_prep's output; after griddepcontrol.wait), kept in L2
    // for the other CTAs.
#if PDL && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
#if XNAT
    for (int i = 0; i < nc; i++) {  // the whole warp waits, lane 0 copies
      const int st = i % XSTAGES;
      if (i >= XSTAGES) mbar_wait(xempty + 8 * st, ((i / XSTAGES) - 1) & 1);
      tma_fill_x(xring + st * XBUF, xfull + 8 * st, &xmap, c0 + i, pol, xrow0);
      __syncwarp();
    }
#else
    const unsigned char* xc = (const unsigned char*)x + ((size_t)(xrow0 / (MT * 8)) * nch + c0) * XBUF;
    for (int i = 0; i < nc; i++) {  // the whole warp waits, lane 0 copies
      const int st = i % XSTAGES;
      if (i >= XSTAGES) mbar_wait(xempty + 8 * st, ((i / XSTAGES) - 1) & 1);
      if (lane == 0) {
        mbar_expect_tx(xfull + 8 * st, XBUF);
        bulk_copy(xring + st * XBUF, xc + (size_t)i * XBUF, XBUF, xfull + 8 * st, pol);
      }
      __syncwarp();
    }
#endif
  } else {
    // Consumers: chunk i's words from its weight slot (released at once), decoded into fragment set
    // i % 2 while the wgmmas of chunk i - 1 run; after issuing chunk i's wgmmas, wait for chunk
    // i - 1's and release its x slot. Scales and zero points are loaded two chunks ahead.
    const int rowa = active ? n0 + r : 0, sra = rowa * ss, srb = (rowa + 8) * ss;
    ChunkConsts kc[2];
    kc[0] = chunk_consts(c0, q, sra, srb, s, zp);
    if (nc > 1) kc[1] = chunk_consts(c0 + 1, q, sra, srb, s, zp);
    u32 af[2][KPC / 16][4];
    const u32 wlane = wring + warp * 1024 + lane * 16;
#if PDL && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x comes after it: block rather than spin
#endif
    for (int i0 = 0; i0 < nc; i0 += 2) {
#pragma unroll
      for (int p = 0; p < 2; p++) {
        const int i = i0 + p, st = i % NSTG, sx = i % XSTAGES;
        if (i < nc) {
          mbar_wait(wfull + 8 * st, (i / NSTG) & 1);
          const U4 A = ld_shared(wlane + st * WSTAGE), B = ld_shared(wlane + st * WSTAGE + 512);
          reads_before_async_writes();
          mbar_arrive(wempty + 8 * st);
          decode_chunk(A, B, kc[p], [&](int k16, u32 a0, u32 a1, u32 a2, u32 a3) {
            af[p][k16][0] = a0; af[p][k16][1] = a1; af[p][k16][2] = a2; af[p][k16][3] = a3;
          });
          if (i + 2 < nc) kc[p] = chunk_consts(c0 + i + 2, q, sra, srb, s, zp);
          mbar_wait(xfull + 8 * sx, (i / XSTAGES) & 1);
          const unsigned long long d0 = wg_desc(xring + sx * XBUF);
          wg_fence_acc(acc);
          asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
          for (int k16 = 0; k16 < KPC / 16; k16++)
#if XNAT
            wgmma_k16(&acc[0][0], af[p][k16][0], af[p][k16][1], af[p][k16][2], af[p][k16][3],
                      wg_desc_sw128(xring + sx * XBUF + (k16 >> 2) * XBOX + (k16 & 3) * 32));
#else
            wgmma_k16(&acc[0][0], af[p][k16][0], af[p][k16][1], af[p][k16][2], af[p][k16][3],
                      d0 + ((k16 * 2 * MT * 128) >> 4));
#endif
          asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
          asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // chunk i - 1's
          wg_fence_frags(af[p ^ 1]);
          if (i > 0) mbar_arrive(xempty + 8 * ((i - 1) % XSTAGES));
        }
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    wg_fence_acc(acc);
#if SMODE == SMODE_END
    const float s_a = scale_f32(s, sra), s_b = scale_f32(s, srb);
#pragma unroll
    for (int t = 0; t < MT; t++) {
      acc[t][0] *= s_a; acc[t][1] *= s_a; acc[t][2] *= s_b; acc[t][3] *= s_b;
    }
#endif
  }
#if PDL && __CUDA_ARCH__ >= 900
#if !TRIG
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");  // before any output, partial or counter
#endif
  store_out(acc, active, warp, n0, gs, bias, out, part, counters, M, N, xs, gpair, pairs, route, rh);
}
#endif  // WS
