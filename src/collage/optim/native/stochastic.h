/* The draws and stochastic rounding of the native kernels: the draws' 32-bit hash
 * (lowbias32) and fused.counter_uniform, and bf16 stochastic rounding
 * (rounding._stochastic_round_bf16); on AVX-512 the same on 16 lanes (the hash computing
 * only the bits the rounding reads) and on 32 elements (rounding.h's even and odd vectors).
 * Each scalar helper is the reference its vector form mirrors bit for bit. */

#ifndef COLLAGE_STOCHASTIC_H
#define COLLAGE_STOCHASTIC_H

#include "rounding.h"

/* ------------------------------------------------------------------------------------ */
/* scalar helpers (the portable build, and the reference the vector code mirrors)       */
/* ------------------------------------------------------------------------------------ */

/* lowbias32 (C. Wellons): fused._mix32 on uint32 (wrapping multiplies, logical shifts) */
#define MIX32_C1 0x7FEB352Du
#define MIX32_C2 0x846CA68Bu
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= MIX32_C1;
    x ^= x >> 15;
    x *= MIX32_C2;
    return x ^ (x >> 16);
}

/* fused.counter_uniform for one element: [0, 1) on a 2**-24 grid */
static inline float uniform(uint32_t index, uint32_t key0, uint32_t key1) {
    uint32_t h = mix32(mix32(index ^ key0) ^ key1);
    return (float)((h >> 8) & 0xFFFFFFu) * 0x1p-24f;
}

/* rounding._stochastic_round_bf16, bit for bit */
static inline uint16_t bf_stochastic(float x, float draw) {
    float nearest = bf_load(bf_round(x));
    float error = x - nearest; /* exact (Sterbenz) */
    int finite = finite_bits(u_of(nearest));
    uint32_t bits = finite ? u_of(nearest) : 0u;
    int away = ((error > 0) == (nearest > 0)) || nearest == 0;
    uint32_t step = away ? 0x10000u : 0xFFFF0000u;          /* +-1 bf16 ulp in magnitude */
    uint32_t tiny = error < 0 ? 0x80010000u : 0x00010000u;  /* +-smallest subnormal */
    float neighbour = f_of(nearest == 0 ? tiny : bits + step);
    float spacing = fabsf(neighbour - nearest);
    float probability = fabsf(error) / spacing;
    int take = draw < probability && error != 0 && finite_bits(u_of(spacing)) && finite;
    return (uint16_t)(u_of(take ? neighbour : nearest) >> 16);
}

/* ------------------------------------------------------------------------------------ */
/* AVX-512: the same on 16 lanes, and on 32 elements                                    */
/* ------------------------------------------------------------------------------------ */

#if COLLAGE_AVX512

/* the lane numbers 0 .. 15, and the element offsets of a block of 32 split into its even
 * and odd elements (the 32-wide path's pairs) */
static inline __m512i v_lanes(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline __m512i v_even_offsets(void) { return _mm512_slli_epi32(v_lanes(), 1); }

static inline __m512i v_odd_offsets(void) {
    return _mm512_add_epi32(v_even_offsets(), _mm512_set1_epi32(1));
}

/* The vector hash computes only what bf16 stochastic rounding reads: the top 16 bits of
 * fused.counter_uniform's 32-bit hash h = mix32(mix32(index ^ key0) ^ key1), where
 * mix32(x) is x ^= x >> 16; x *= C1; x ^= x >> 15; x *= C2; x ^= x >> 16. Two of its
 * xor-shifts drop out exactly:
 *   the closing x ^= x >> 16 leaves the top 16 bits alone, so h >> 16 = z >> 16 for z
 *   the second round's product by C2 (what these functions return);
 *   between the rounds, with z1 the first round's product by C2 and K = key1, the second
 *   round opens with w = y ^ (y >> 16), y = z1 ^ (z1 >> 16) ^ K; since logical shifts
 *   distribute over xor and (z1 >> 16) >> 16 = 0, y >> 16 = (z1 >> 16) ^ (K >> 16) and
 *   w = z1 ^ K ^ (K >> 16): one xor with a scalar instead of two xor-shifts and an xor. */

/* mix32 from its product by C1 ``p`` to its product by C2 (before the closing xor-shift) */
static inline __m512i v_mix32_middle(__m512i p) {
    p = _mm512_xor_si512(p, _mm512_srli_epi32(p, 15));
    return _mm512_mullo_epi32(p, _mm512_set1_epi32((int)MIX32_C2));
}

/* z (see above) from the first round's product by C1 ``p`` */
static inline __m512i v_hash_rounds(__m512i p, int64_t key1) {
    uint32_t k = (uint32_t)key1;
    __m512i opening = _mm512_set1_epi32((int)(k ^ (k >> 16))); /* K ^ (K >> 16) */
    __m512i w = _mm512_xor_si512(v_mix32_middle(p), opening);
    return v_mix32_middle(_mm512_mullo_epi32(w, _mm512_set1_epi32((int)MIX32_C1)));
}

/* z of the elements ``first + offsets``: its top 16 bits are those of their hash */
static inline __m512i v_hash_at(int64_t first, __m512i offsets, int64_t key0,
                                int64_t key1) {
    __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)first), offsets);
    __m512i x = _mm512_xor_si512(index, _mm512_set1_epi32((int)(uint32_t)key0));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return v_hash_rounds(_mm512_mullo_epi32(x, _mm512_set1_epi32((int)MIX32_C1)), key1);
}

/* v_hash_at of the 32 elements ``first + 0 .. 31``, even (``*he``) and odd (``*ho``)
 * elements apart. Where ``first`` is a multiple of 32 (every block of a tensor that starts
 * a row), the first round's multiply is a table lookup, exactly: the index is B ^ lane
 * with B = first ^ key0 (the lane sets only bits that first leaves clear), the round's
 * x ^ (x >> 16) is B1 ^ lane with B1 = B ^ (B >> 16) (lane >> 16 = 0), and with
 * B1 = H + l (l its low 5 bits) B1 ^ lane = H + (l ^ lane), so that
 * (B1 ^ lane) * C = H * C + T[l ^ lane] mod 2**32 with T[k] = k * C: one scalar multiply
 * per block and a 32-entry permutation instead of a vector multiply per 16 elements. */
static inline __attribute__((always_inline)) void v_hash2(int64_t first, int64_t key0,
                                                          int64_t key1, __m512i *he,
                                                          __m512i *ho) {
    const __m512i even = v_even_offsets(), odd = v_odd_offsets();
    if (((uint32_t)first & 31u) != 0) {
        *he = v_hash_at(first, even, key0, key1);
        *ho = v_hash_at(first, odd, key0, key1);
        return;
    }
    const __m512i c1 = _mm512_set1_epi32((int)MIX32_C1);
    const __m512i low_table = _mm512_mullo_epi32(v_lanes(), c1);
    const __m512i high_table = _mm512_mullo_epi32(
        _mm512_add_epi32(v_lanes(), _mm512_set1_epi32(16)), c1);
    uint32_t b = (uint32_t)first ^ (uint32_t)key0;
    b ^= b >> 16;
    __m512i scaled = _mm512_set1_epi32((int)((b & ~31u) * MIX32_C1));
    __m512i l = _mm512_set1_epi32((int)(b & 31u));
    *he = v_hash_rounds(_mm512_add_epi32(scaled, _mm512_permutex2var_epi32(
                                                     low_table, _mm512_xor_si512(l, even),
                                                     high_table)), key1);
    *ho = v_hash_rounds(_mm512_add_epi32(scaled, _mm512_permutex2var_epi32(
                                                     low_table, _mm512_xor_si512(l, odd),
                                                     high_table)), key1);
}

/* The 24-bit draw D of fused.counter_uniform (draw = D * 2**-24) of the elements
 * ``first + 0 .. 15``, as the top 16 bits that bf16 stochastic rounding compares:
 * D >> 8 = hash >> 16 (see v_stochastic32) */
static inline __m512i v_draw16(int64_t first, int64_t key0, int64_t key1) {
    return _mm512_srli_epi32(v_hash_at(first, v_lanes(), key0, key1), 16);
}

/* bf_stochastic on 16 lanes, bit for bit, in integer arithmetic: the 16-bit results in
 * the low halves of the int32 lanes. Why it is the same: with t = |x|'s bits >> 16 (x
 * truncated), L = its low 16 bits and d = the draw's top 16 bits, bf_stochastic's
 * ``draw < |error| / spacing`` reads
 *   nearest rounded down (t):   |error| / spacing = L / 2**16, so it steps up to t + 1
 *                               iff D < 256 L iff d < L (256 L is a multiple of 256);
 *   nearest rounded up (t + 1): |error| / spacing = (2**16 - L) / 2**16, so it steps down
 *                               to t iff d < 2**16 - L, i.e. stays at t + 1 iff
 *                               d + L >= 2**16;
 * exact quotients: the error is exact (Sterbenz) and the spacing a power of two. bf16
 * magnitudes that neighbour are neighbouring integers, across binades and subnormals
 * alike, and round to nearest even went up iff L + 0x7FFF + (t & 1) carries into bit 16
 * (bf_round). Infinities: x infinite or rounding to infinity keeps its nearest value, and a
 * step up to infinity is not taken (bf_stochastic's spacing is then infinite); NaN gives
 * 0xFFFF (bf_round). No float operation: nothing to redo for subnormal or NaN lanes. */
static inline __attribute__((always_inline)) __m512i v_stochastic32(__m512 x, __m512i d) {
    /* the decisions as 0/1 lanes of vector arithmetic and one ternary-logic select
     * rather than mask-register logic (2-3 % faster on Zen 4, the same bits) */
    const __m512i one = _mm512_set1_epi32(1);
    __m512i bits = _mm512_castps_si512(x);
    __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i t = _mm512_srli_epi32(mag, 16);
    __m512i low = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
    /* all three below 2**17, so the shifts read the comparisons off exactly */
    __m512i rounded_up = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(low, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(t, one)),
        16);                                                                  /* bf_round */
    __m512i up_from_down = _mm512_srli_epi32(_mm512_sub_epi32(d, low), 31);  /* d < L */
    __m512i up_from_up = _mm512_srli_epi32(_mm512_add_epi32(d, low), 16);    /* d + L >= 2**16 */
    /* rounded_up ? up_from_up : up_from_down, bitwise (0xCA: A ? B : C) */
    __m512i up = _mm512_ternarylogic_epi32(rounded_up, up_from_up, up_from_down, 0xCA);
    __m512i nearest = _mm512_add_epi32(t, rounded_up);
    __m512i out = _mm512_add_epi32(t, up);
    __mmask16 keep = _mm512_cmpge_epu32_mask(_mm512_max_epu32(nearest, out),
                                             _mm512_set1_epi32(0x7F80));
    out = _mm512_mask_mov_epi32(out, keep, nearest);
    out = _mm512_or_si512(out, _mm512_srli_epi32(_mm512_andnot_si512(mag, bits), 16));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0xFFFF));
}

static inline __attribute__((always_inline)) __m256i v_stochastic(__m512 x, __m512i d) {
    return v_narrow(v_stochastic32(x, d));
}

/* v_stochastic32 of 32 elements (even and odd, with ``he``, ``ho`` of v_hash2, whose top
 * 16 bits are the draws'), packed in element order: the same bits, in 16-bit lanes
 * (AVX-512BW), so one instruction decides 32 elements instead of 16 and nothing is
 * narrowed. With the notation of v_stochastic32 (H = x's high half with its sign, t = H's
 * magnitude):
 *   rounded up (bf_round's carry of L + 0x7FFF + (t & 1) into bit 16) is the top bit of
 *   _mm512_avg_epu16(L, 0x7FFE | (H & 1)) = (L + 0x7FFE + (t & 1) + 1) >> 1, which avg
 *   computes in 17 bits; shifted arithmetically, all ones where rounded up;
 *   the result is t + up with up = (rounded up ? d + L >= 2**16 : d < L), and
 *   d + L >= 2**16 iff L > 0xFFFF - d = ~d: so up iff L > (d ^ rounded_up_mask), one
 *   unsigned comparison;
 *   H + up is t + up with x's sign: t + 1 <= 0x7F7F carries nothing into the sign bit.
 * That holds for t < 0x7F7F. Blocks with a lane at t >= 0x7F7F (the largest finite
 * truncation, whose step may reach infinity, and infinities and NaNs) take v_stochastic32,
 * which handles them (they do not occur in training but for diverging weights). */
static inline __attribute__((always_inline)) __m512i v_stochastic2(vpair x, __m512i he,
                                                                   __m512i ho) {
    const __mmask32 odd = (__mmask32)0xAAAAAAAAu;
    __m512i be = _mm512_castps_si512(x.e), bo = _mm512_castps_si512(x.o);
    __m512i high = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(be, 16), bo);
    __m512i low = _mm512_mask_blend_epi16(odd, be, _mm512_slli_epi32(bo, 16));
    __m512i d = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(he, 16), ho);
    /* (H & 1) | 0x7FFE: ternary logic 0xEA is (A & B) | C */
    __m512i bias = _mm512_ternarylogic_epi32(high, _mm512_set1_epi16(1),
                                             _mm512_set1_epi16(0x7FFE), 0xEA);
    __m512i rounded_up = _mm512_srai_epi16(_mm512_avg_epu16(low, bias), 15);
    __mmask32 up = _mm512_cmpgt_epu16_mask(low, _mm512_xor_si512(d, rounded_up));
    __m512i out = _mm512_mask_add_epi16(high, up, high, _mm512_set1_epi16(1));
    __mmask32 special = _mm512_cmpge_epu16_mask(
        _mm512_and_si512(high, _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(0x7F7F));
    if (__builtin_expect(special != 0, 0))
        return v_pack(v_stochastic32(x.e, _mm512_srli_epi32(he, 16)),
                      v_stochastic32(x.o, _mm512_srli_epi32(ho, 16)));
    return out;
}

#endif /* COLLAGE_AVX512 */

#endif /* COLLAGE_STOCHASTIC_H */
