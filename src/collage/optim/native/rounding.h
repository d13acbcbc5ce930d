/* Bit helpers of the native kernels: float <-> bits, torch's bf16 rounding to nearest
 * even, the residual pairs and their normalisation, split_encode / split_decode; on AVX-512
 * the step's coefficients in registers, the same on 16 lanes, loads and stores of 16 lanes
 * (masked tails), and the 32-element forms of the 32-wide path (even and odd elements in
 * two vectors). The draws' hash and stochastic rounding are stochastic.h's. Each scalar
 * helper is the reference its vector form mirrors bit for bit. */

#ifndef COLLAGE_ROUNDING_H
#define COLLAGE_ROUNDING_H

#include "native.h"

/* ------------------------------------------------------------------------------------ */
/* scalar helpers (the portable build, and the reference the vector code mirrors)        */
/* ------------------------------------------------------------------------------------ */

static inline float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t u_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bf_load(uint16_t h) { return f_of((uint32_t)h << 16); }
static inline int finite_bits(uint32_t u) { return (u & 0x7F800000u) != 0x7F800000u; }

/* torch's float -> bf16: nearest, ties to even, on the integer view; NaN -> 0xFFFF */
static inline uint16_t bf_round(float x) {
    uint32_t u = u_of(x);
    if (x != x) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* A pair (hi, lo) in canonical form (strategies.strategy.normalize_pair): hi the nearest
 * (ties to even) of the float32 sum hi + lo, lo the exact rest; lo = +0 where hi is not
 * finite. hi + lo is exact in float32 for the residual landing's pairs (then so is the
 * rest), not for every Kahan pair (docs/strategies.md, at kahan). */
static inline void bf_normalize(uint16_t *hi, uint16_t *lo) {
    float total = bf_load(*hi) + bf_load(*lo);
    uint16_t nearest = bf_round(total);
    float nf = bf_load(nearest);
    *lo = finite_bits(u_of(nf)) ? bf_round(total - nf) : 0;
    *hi = nearest;
}

/* The residual landing of light, plus and of plus's and split's second moment: the
 * canonical pair of x, hi = RN(x) and lo = RN(x - hi) (x - hi is exact: Sterbenz), +0
 * where hi is not finite, then normalised (the reference of v_residual_pair). */
static inline void bf_residual_pair(float x, uint16_t *hi, uint16_t *lo) {
    *hi = bf_round(x);
    float hf = bf_load(*hi);
    *lo = finite_bits(u_of(hf)) ? bf_round(x - hf) : 0;
    bf_normalize(hi, lo);
}

/* rounding.split_decode / split_encode on uint32 (identical to their int32 forms) */
static inline float split_decode(uint16_t weight, uint16_t low) {
    uint32_t up = low > 0x8000u;
    return f_of((((uint32_t)weight - up) << 16) | low);
}

/* (a NaN master's weight is its top half made quiet, never rounded: rounding.split_encode) */
static inline void split_encode(float master, uint16_t *weight, uint16_t *low) {
    uint32_t u = u_of(master), l = u & 0xFFFFu, t = u >> 16;
    *weight = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? t | 0x40u : t + (l > 0x8000u));
    *low = (uint16_t)l;
}

/* ------------------------------------------------------------------------------------ */
/* AVX-512: the same on 16 lanes                                                          */
/* ------------------------------------------------------------------------------------ */

#if COLLAGE_AVX512

/* The step's coefficients in registers (filled once per row by vector_range). Defined
 * here because the 32-wide rounding reads its word permutation ``interleave``. */
typedef struct {
    __m512 lerp, beta2, omb2, bc2s, eps, neg_step, decay, lr_wd, scale;
    __m512 rbc2s;          /* 1 / bc2s rounded to nearest (v_over_bc2s) */
    __m512i sign;          /* 0x80000000 to negate the gradient (maximize), else 0 */
    __m512i interleave;    /* v_round2: words [even 16 | odd 16] -> element order */
    __mmask16 small, decays; /* all lanes or none: lerp weight < 0.5; decay != 1 */
} vcoeffs;

/* root / bc2s correctly rounded, without the divider: the quotient by the reciprocal
 * r = RN(1 / bc2s), q = RN(root * r), corrected once (Markstein): RN(q - RN(q * bc2s - root)
 * * r), both in fused multiply-adds (the residual q * bc2s - root is exact). Written so
 * that a zero keeps its sign (-0: q = -0, the residual +0, -0 - +0 * r = -0; the form
 * q + (root - q * bc2s) * r would give +0), and inf and NaN passed through (the division
 * returns them unchanged; the correction would make inf a NaN). For the other roots this
 * step divides, normal (the square root of a subnormal is not subnormal) over bc2s in
 * (0, 1] (the quotient neither overflows nor underflows), the corrected quotient is the
 * correctly rounded one for every significand of root that tests/optim/test_native_division.py
 * tries: all 2^23, for the divisors with the largest reciprocal errors (the 1,000,000 of
 * them, reciprocal errors 0.44-0.5 ulp, were checked once, offline, with all 2^23
 * dividends each: no difference; benchmarks/studies/division_search.c), the all-ones and 1 + ulp
 * significands and the bias corrections of real runs. AdamW's square root and two divisions bound a step on CPUs
 * whose divider is slow (#31: 0.60 ns per element and core on a Xeon): this is one
 * division fewer, the same bits. */
static inline __attribute__((always_inline)) __m512 v_over_bc2s(const vcoeffs *c,
                                                                __m512 root) {
    __m512 q = _mm512_mul_ps(root, c->rbc2s);
    __m512 corrected = _mm512_fnmadd_ps(_mm512_fmsub_ps(q, c->bc2s, root), c->rbc2s, q);
    /* one compare (measured faster than vfpclassps or two compares): root >= inf or NaN */
    __mmask16 special = _mm512_cmp_ps_mask(root, _mm512_set1_ps(__builtin_inff()),
                                           _CMP_NLT_UQ);
    return _mm512_mask_mov_ps(corrected, special, root);
}

/* vcoeffs.interleave: word j of the result is word (j & 1) * 16 + j / 2 of
 * [even 16 | odd 16] */
static inline __m512i v_interleave(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* Loads and stores of 16 lanes; ``k`` selects the lanes of a tail. A constant full mask
 * (the main loop) compiles to plain unmasked moves. */
#define FULL(k) ((k) == (__mmask16)0xFFFF)

static inline __attribute__((always_inline)) __m256i v_load16(const void *p, int64_t i,
                                                              __mmask16 k) {
    if (FULL(k)) return _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i);
}

static inline __attribute__((always_inline)) __m512 v_load_bf(const void *p, int64_t i,
                                                              __mmask16 k) {
    __m256i x = v_load16(p, i, k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

static inline __attribute__((always_inline)) __m512 v_load_f32(const void *p, int64_t i,
                                                               __mmask16 k) {
    if (FULL(k)) return _mm512_loadu_ps((const float *)p + i);
    return _mm512_maskz_loadu_ps(k, (const float *)p + i);
}

static inline __m512 v_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* bf_round on 16 lanes: the 16-bit results in the low halves of the int32 lanes */
static inline __m512i v_round32(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
}

static inline __m256i v_narrow(__m512i r) { return _mm512_cvtepi32_epi16(r); }

/* 1 where v_round's fast form (exact = 0) is vcvtneps2bf16, which flags its NaN and
 * subnormal lanes in ``bad`` (the caller then redoes the block with exact = 1); 0 where
 * every rounding is the exact integer one and nothing is ever redone. */
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define COLLAGE_FAST_ROUNDING 1
#else
#define COLLAGE_FAST_ROUNDING 0
#endif

/* x rounded to bf16 (16 bits per lane), as bf_round. Without ``exact``, where the target
 * has AVX512-BF16: vcvtneps2bf16, one instruction, which rounds to nearest even but treats
 * subnormal inputs as zero and keeps NaN payloads; the lanes where that can differ (NaN,
 * subnormal) are or-ed into ``bad`` and the caller redoes the block exactly (rare). A
 * normal float32 never rounds to a subnormal bf16: the exponent ranges are the same. */
static inline __attribute__((always_inline)) __m256i v_round(__m512 x, const int exact,
                                                             __mmask16 *bad) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!exact) {
        *bad |= _mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80); /* QNaN, subnormal, SNaN */
        return (__m256i)_mm512_cvtneps_pbh(x);
    }
#else
    (void)exact;
    (void)bad;
#endif
    return v_narrow(v_round32(x));
}

static inline __mmask16 v_finite(__m512 x) {
    __m512i e = _mm512_set1_epi32(0x7F800000);
    return _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
}

static inline __attribute__((always_inline)) void v_store_bf(void *p, int64_t i,
                                                             __mmask16 k, __m256i h) {
    if (FULL(k)) _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
    else _mm256_mask_storeu_epi16((uint16_t *)p + i, k, h);
}

static inline __attribute__((always_inline)) void v_store_f32(void *p, int64_t i,
                                                              __mmask16 k, __m512 x) {
    if (FULL(k)) _mm512_storeu_ps((float *)p + i, x);
    else _mm512_mask_storeu_ps((float *)p + i, k, x);
}

/* the low part of an MCF pair: fl(x - hi) where hi is finite, else +0 */
static inline __attribute__((always_inline)) __m256i v_residual(
    __m512 x, __m512 hi, const int exact, __mmask16 *bad) {
    __m512 r = _mm512_maskz_mov_ps(v_finite(hi), _mm512_sub_ps(x, hi));
    return v_round(r, exact, bad);
}

/* bf_normalize on 16 lanes */
static inline __attribute__((always_inline)) void v_normalize(__m256i *hi, __m256i *lo,
                                                              const int exact,
                                                              __mmask16 *bad) {
    __m512 total = _mm512_add_ps(v_widen(*hi), v_widen(*lo));
    __m256i nearest = v_round(total, exact, bad);
    *lo = v_residual(total, v_widen(nearest), exact, bad);
    *hi = nearest;
}

/* The lanes of (hi, lo) where bf_normalize may change a pair made by the residual
 * landing (hi = RN(x), lo = RN(x - hi)) in a block whose fast roundings flagged nothing: hi
 * odd and lo a nonzero power of two (lo = +-half the gap beside an odd hi: a tie that
 * rounds to hi's even neighbour), or hi = -0 (x = -0: hi + lo = +0). Everywhere else the
 * pair is already canonical: the proof is in docs/strategies.md, "Canonical by
 * construction". Three tests on 16-bit words instead of a sum, two roundings and a
 * difference (#31). */
static inline __mmask16 v_maybe_not_canonical(__m256i hi, __m256i lo) {
    __mmask16 odd = _mm256_test_epi16_mask(hi, _mm256_set1_epi16(1));
    __mmask16 tie = _mm256_mask_testn_epi16_mask(odd, lo, _mm256_set1_epi16(0x7F));
    tie = _mm256_mask_test_epi16_mask(tie, lo, _mm256_set1_epi16(0x7FFF));
    return tie | _mm256_cmpeq_epi16_mask(hi, _mm256_set1_epi16((short)0x8000));
}

/* The canonical pair of x by the residual landing: hi = RN(x), lo = RN(x - hi) (+0 where
 * hi is not finite), normalised where v_maybe_not_canonical says it may not be canonical
 * already (always with ``exact``, and where no fast rounding flags what the proof excludes):
 * bit for bit v_round, v_residual and v_normalize. */
static inline __attribute__((always_inline)) void v_residual_pair(__m512 x, const int exact,
                                                                  __mmask16 *bad,
                                                                  __m256i *hi, __m256i *lo) {
    *hi = v_round(x, exact, bad);
    *lo = v_residual(x, v_widen(*hi), exact, bad);
    if (exact || !COLLAGE_FAST_ROUNDING || v_maybe_not_canonical(*hi, *lo))
        v_normalize(hi, lo, exact, bad);
}

/* split_decode on 16 lanes of zero-extended words: (w - (low > 0x8000)) << 16 | low (the
 * all-ones compare mask is -1) */
static inline __m512 v_split_decode(__m512i w16, __m512i low16) {
    __m512i up = _mm512_movm_epi32(_mm512_cmpgt_epu32_mask(low16, _mm512_set1_epi32(0x8000)));
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(w16, up), 16), low16));
}

/* split_encode on 16 lanes: the weight word and the low bits, each in the low 16 bits of
 * its int32 lane (the weight's upper bits may hold a carry; packing keeps 16 bits) */
static inline void v_split_encode(__m512 master, __m512i *weight, __m512i *low) {
    __m512i bits = _mm512_castps_si512(master);
    __m512i top = _mm512_srli_epi32(bits, 16);
    *low = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
    /* a NaN master: its top half made quiet, never rounded (split_encode) */
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    __m512i up = _mm512_movm_epi32(_mm512_cmpgt_epu32_mask(*low, _mm512_set1_epi32(0x8000)));
    *weight = _mm512_mask_or_epi32(_mm512_sub_epi32(top, up), nan, top, _mm512_set1_epi32(0x40));
}


/* ------------------------------------------------------------------------------------ */
/* 32 elements at a time: even and odd elements in two vectors                            */
/* ------------------------------------------------------------------------------------ */

/* Why: the element order within a step is free (every element's operations are its own),
 * so one 64-byte load of 32 bf16 values is split into its even and odd elements with one
 * operation each instead of a zero-extension and a shift per 16: the even words moved to
 * the high halves of the int32 lanes (x << 16), the odd ones masked in place. Results are
 * packed back in element order by a word blend (or, rounded in one vcvtne2ps2bf16, by a
 * word permutation). The float32 operations of each element are those of vector_block,
 * so the results are bit for bit the same. */
typedef struct {
    __m512 e, o; /* even and odd elements, float32 */
} vpair;

static inline vpair v_split(__m512i x) {
    vpair p = {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
               _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)))};
    return p;
}

static inline __attribute__((always_inline)) vpair v_load_pair(const void *p, int64_t i) {
    return v_split(_mm512_loadu_si512((const uint16_t *)p + i));
}

static inline __attribute__((always_inline)) void v_store_words(void *p, int64_t i,
                                                                __m512i x) {
    _mm512_storeu_si512((uint16_t *)p + i, x);
}

/* 16-bit results in the low halves of the int32 lanes of the even and odd elements, in
 * element order (high halves ignored) */
static inline __m512i v_pack(__m512i e, __m512i o) {
    return _mm512_mask_blend_epi16((__mmask32)0xAAAAAAAAu, e, _mm512_slli_epi32(o, 16));
}

/* v_round of 32 elements, packed in element order */
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
/* 32 elements rounded by one vcvtne2ps2bf16, in element order: torch's rounding except on
 * nan and subnormal lanes (it reads subnormals as zero), which the callers test for */
static inline __attribute__((always_inline)) __m512i v_cvtne2(const vcoeffs *c, vpair x) {
    /* words 0-15: the even elements, 16-31: the odd ones */
    __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(x.o, x.e);
    return _mm512_permutexvar_epi16(c->interleave, halves);
}
#endif

static inline __attribute__((always_inline)) __m512i v_round2(const vcoeffs *c, vpair x,
                                                              const int exact,
                                                              __mmask16 *bad) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (!exact) {
        *bad |= _mm512_fpclass_ps_mask(x.e, 0x01 | 0x20 | 0x80)
                | _mm512_fpclass_ps_mask(x.o, 0x01 | 0x20 | 0x80);
        return v_cvtne2(c, x);
    }
#else
    (void)c;
    (void)exact;
    (void)bad;
#endif
    return v_pack(v_round32(x.e), v_round32(x.o));
}

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define COLLAGE_UNMASKED_LOW_PARTS 1
/* v_round2's fast rounding of 32 low parts computed without their mask "+0 where the high
 * part is not finite". Where that mask acts, the unmasked low part is inf or nan (see
 * v_residual2 and the kahan landing), so infinities join the classes whose blocks are
 * redone exactly, with the mask; elsewhere the mask keeps every lane. Saves two compares
 * and two masks per 32 elements. */
static inline __attribute__((always_inline)) __m512i v_round2_unmasked(const vcoeffs *c,
                                                                       vpair r,
                                                                       __mmask16 *bad) {
    const int classes = 0x01 | 0x08 | 0x10 | 0x20 | 0x80; /* nan, +-inf, subnormal */
    *bad |= _mm512_fpclass_ps_mask(r.e, classes) | _mm512_fpclass_ps_mask(r.o, classes);
    return v_cvtne2(c, r);
}
#else
#define COLLAGE_UNMASKED_LOW_PARTS 0
#endif

/* v_round2 of the high part of a pair whose low part is computed next from the same x
 * (v_residual2, kahan's compensation): on the fast path without v_round2's class test,
 * which the low part's subsumes. Where x is nan, inf or subnormal, hi is nan, inf or +-0
 * (vcvtne2ps2bf16 reads subnormals as zero), so the low part x - hi is nan, nan or x
 * itself, and the block is redone exactly; a normal x never rounds to a subnormal bf16
 * (the exponent ranges are the same). */
static inline __attribute__((always_inline)) __m512i v_round2_high(const vcoeffs *c,
                                                                   vpair x,
                                                                   const int exact,
                                                                   __mmask16 *bad) {
#if COLLAGE_UNMASKED_LOW_PARTS
    if (!exact) return v_cvtne2(c, x);
#endif
    return v_round2(c, x, exact, bad);
}

/* the low parts fl(x - hi) where hi is finite, else +0, of 32 elements, rounded and packed
 * (hi: x rounded to bf16) */
static inline __attribute__((always_inline)) __m512i v_residual2(const vcoeffs *c, vpair x,
                                                                 vpair hi, const int exact,
                                                                 __mmask16 *bad) {
#if COLLAGE_UNMASKED_LOW_PARTS
    /* hi = round(x) is finite wherever x is, but where x rounds to infinity, and there
     * x - hi is infinite; where x is inf or nan, x - hi is nan */
    if (!exact) {
        vpair r = {_mm512_sub_ps(x.e, hi.e), _mm512_sub_ps(x.o, hi.o)};
        return v_round2_unmasked(c, r, bad);
    }
#endif
    vpair r = {_mm512_maskz_sub_ps(v_finite(hi.e), x.e, hi.e),
               _mm512_maskz_sub_ps(v_finite(hi.o), x.o, hi.o)};
    return v_round2(c, r, exact, bad);
}

/* bf_normalize on 32 packed elements; v_round2_high as in a landing: the rest's class test
 * subsumes the sum's */
static inline __attribute__((always_inline)) void v_normalize2(const vcoeffs *c, __m512i *hi,
                                                               __m512i *lo, const int exact,
                                                               __mmask16 *bad) {
    vpair h = v_split(*hi), l = v_split(*lo);
    vpair total = {_mm512_add_ps(h.e, l.e), _mm512_add_ps(h.o, l.o)};
    *hi = v_round2_high(c, total, exact, bad);
    *lo = v_residual2(c, total, v_split(*hi), exact, bad);
}

/* v_maybe_not_canonical of 32 packed pairs */
static inline __mmask32 v_maybe_not_canonical2(__m512i hi, __m512i lo) {
    __mmask32 odd = _mm512_test_epi16_mask(hi, _mm512_set1_epi16(1));
    __mmask32 tie = _mm512_mask_testn_epi16_mask(odd, lo, _mm512_set1_epi16(0x7F));
    tie = _mm512_mask_test_epi16_mask(tie, lo, _mm512_set1_epi16(0x7FFF));
    return tie | _mm512_cmpeq_epi16_mask(hi, _mm512_set1_epi16((short)0x8000));
}

/* v_residual_pair of 32 elements, packed in element order */
static inline __attribute__((always_inline)) void v_residual_pair2(const vcoeffs *c, vpair x,
                                                                   const int exact,
                                                                   __mmask16 *bad,
                                                                   __m512i *hi, __m512i *lo) {
    *hi = v_round2_high(c, x, exact, bad);
    *lo = v_residual2(c, x, v_split(*hi), exact, bad);
    if (exact || !COLLAGE_FAST_ROUNDING || v_maybe_not_canonical2(*hi, *lo))
        v_normalize2(c, hi, lo, exact, bad);
}

#endif /* COLLAGE_AVX512 */

#endif /* COLLAGE_ROUNDING_H */
