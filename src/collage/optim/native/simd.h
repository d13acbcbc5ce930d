/* The vector layer of the builds without AVX-512: one source for every vector width.
 *
 * Why: CPUs without AVX-512 (x86-64 with AVX2 and FMA, x86-64-v3; AArch64 with NEON) ran
 * the portable scalar loop at 0.04-0.13x torch's fused AdamW (#40). step_vector.h writes
 * the step once on vectors of VL float32 lanes with the compiler's vector extensions
 * (GCC >= 9 and Clang: element-wise + - * / & | ^ << >> and comparisons, which give
 * all-ones or zero lanes); this header adds what the extensions lack, a fused multiply-add
 * and a square root, each one instruction of the target, and a test for any lane set.
 *
 * Widths:
 *   32 bytes (VL = 8)  x86-64 with AVX2 and FMA (the default there where AVX-512 is absent)
 *   16 bytes (VL = 4)  AArch64 NEON; on x86 with FMA when built with
 *                      -DCOLLAGE_VECTOR_BYTES=16 (build.py's "vec128"), which runs the
 *                      NEON-width code on x86 so that it is tested where no ARM machine is
 *
 * Every operation here is correctly rounded IEEE arithmetic, as the scalar reference's
 * (fmaf and sqrtf are exact-rounded; -ffp-contract=off keeps the compiler from fusing the
 * separate multiplies and adds): the results do not depend on the width. NEON's vfmaq_f32 and
 * vsqrtq_f32 are the IEEE operations (AArch64's FPCR default: round to nearest, no flush to
 * zero, as the process leaves it). */

#ifndef COLLAGE_SIMD_H
#define COLLAGE_SIMD_H

#include "native.h"

#if !COLLAGE_AVX512 && !defined(COLLAGE_SCALAR_ONLY)
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#ifndef COLLAGE_VECTOR_BYTES
#define COLLAGE_VECTOR_BYTES 32
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#undef COLLAGE_VECTOR_BYTES
#define COLLAGE_VECTOR_BYTES 16
#endif
#endif

/* the vector extensions used: element-wise operators and __builtin_convertvector (GCC 9,
 * any Clang); shuffles by __builtin_shufflevector (Clang, GCC 12) or __builtin_shuffle */
#if defined(COLLAGE_VECTOR_BYTES) && (defined(__clang__) || __GNUC__ >= 9)
#define COLLAGE_VECTOR 1
#else
#define COLLAGE_VECTOR 0
#endif

#if COLLAGE_VECTOR

/* float32 lanes per vector */
#define VL (COLLAGE_VECTOR_BYTES / 4)

typedef float vf __attribute__((vector_size(COLLAGE_VECTOR_BYTES)));
typedef uint32_t vu __attribute__((vector_size(COLLAGE_VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(COLLAGE_VECTOR_BYTES)));
/* VL 16-bit words: half a vector */
typedef uint16_t vh __attribute__((vector_size(COLLAGE_VECTOR_BYTES / 2)));
/* 2 VL 16-bit words, unsigned and signed: a whole vector */
typedef uint16_t vw __attribute__((vector_size(COLLAGE_VECTOR_BYTES)));
typedef int16_t vs __attribute__((vector_size(COLLAGE_VECTOR_BYTES)));

/* fma(a, b, c) = a * b + c rounded once; sqrt correctly rounded */
static inline __attribute__((always_inline)) vf v_fma(vf a, vf b, vf c) {
#if defined(__aarch64__)
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return (vf)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#endif
}

static inline __attribute__((always_inline)) vf v_sqrt(vf x) {
#if defined(__aarch64__)
    return (vf)vsqrtq_f32((float32x4_t)x);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vf)_mm256_sqrt_ps((__m256)x);
#else
    return (vf)_mm_sqrt_ps((__m128)x);
#endif
}

/* (a + b + 1) >> 1 on 16-bit lanes, the sum in 17 bits */
static inline __attribute__((always_inline)) vw v_avg16(vw a, vw b) {
#if defined(__aarch64__)
    return (vw)vrhaddq_u16((uint16x8_t)a, (uint16x8_t)b);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vw)_mm256_avg_epu16((__m256i)a, (__m256i)b);
#else
    return (vw)_mm_avg_epu16((__m128i)a, (__m128i)b);
#endif
}

/* the larger of a and b, lane by lane, as unsigned 16-bit and 32-bit integers */
static inline __attribute__((always_inline)) vw v_max16(vw a, vw b) {
#if defined(__aarch64__)
    return (vw)vmaxq_u16((uint16x8_t)a, (uint16x8_t)b);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vw)_mm256_max_epu16((__m256i)a, (__m256i)b);
#else
    return (vw)_mm_max_epu16((__m128i)a, (__m128i)b);
#endif
}

static inline __attribute__((always_inline)) vu v_max32(vu a, vu b) {
#if defined(__aarch64__)
    return (vu)vmaxq_u32((uint32x4_t)a, (uint32x4_t)b);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vu)_mm256_max_epu32((__m256i)a, (__m256i)b);
#else
    return (vu)_mm_max_epu32((__m128i)a, (__m128i)b);
#endif
}

/* 1 if any lane of the comparison result ``m`` (all ones or zero per lane) is set */
static inline __attribute__((always_inline)) int v_any(vi m) {
#if defined(__aarch64__)
    return vmaxvq_u32((uint32x4_t)m) != 0;
#elif COLLAGE_VECTOR_BYTES == 32
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
    return !_mm_testz_si128((__m128i)m, (__m128i)m);
#endif
}

/* 1 if every lane of the comparison result ``m`` is set */
static inline __attribute__((always_inline)) int v_all(vi m) {
#if defined(__aarch64__)
    return vminvq_u32((uint32x4_t)m) != 0;
#elif COLLAGE_VECTOR_BYTES == 32
    return _mm256_testc_si256((__m256i)m, _mm256_set1_epi32(-1));
#else
    return _mm_testc_si128((__m128i)m, _mm_set1_epi32(-1));
#endif
}

/* the lanes of ``m`` set (all ones or zero per lane), counted */
static inline __attribute__((always_inline)) int v_count(vi m) {
    int n = 0;
    for (int j = 0; j < VL; j++) n -= m[j];
    return n;
}

/* x in every lane. As x - 0, not 0 + x: x - (+0) is x for every x, but (+0) + (-0) is +0,
 * which turned a -0.0 coefficient (lr = 0's step size) into +0.0 and flipped the sign of
 * the zero weights it stepped (found by audit, 2026-12-07) */
static inline vf v_splat(float x) { return x - (vf){0}; }
static inline vu u_splat(uint32_t x) { return (vu){0} + x; }
static inline vf f_bits(vu u) { return (vf)u; }
static inline vu u_bits(vf f) { return (vu)f; }

/* a where the lanes of ``m`` are set (all ones), else b: one blend (three logic
 * operations where the compiler does not find it) */
static inline __attribute__((always_inline)) vf v_select(vi m, vf a, vf b) {
#if defined(__aarch64__)
    return (vf)vbslq_f32((uint32x4_t)m, (float32x4_t)a, (float32x4_t)b);
#elif COLLAGE_VECTOR_BYTES == 32
    return (vf)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)m);
#else
    return (vf)_mm_blendv_ps((__m128)b, (__m128)a, (__m128)m);
#endif
}

static inline __attribute__((always_inline)) vu u_select(vi m, vu a, vu b) {
    return u_bits(v_select(m, f_bits(a), f_bits(b)));
}

/* the lane numbers 0 .. VL - 1 */
static inline vu v_lanes(void) {
    vu x;
    for (int j = 0; j < VL; j++) x[j] = (uint32_t)j;
    return x;
}

/* loads and stores of VL elements at element ``i``, unaligned (memcpy of a constant size
 * compiles to one vector move) */
static inline __attribute__((always_inline)) vf v_load_f32(const void *p, int64_t i) {
    vf x;
    memcpy(&x, (const float *)p + i, sizeof x);
    return x;
}

static inline __attribute__((always_inline)) void v_store_f32(void *p, int64_t i, vf x) {
    memcpy((float *)p + i, &x, sizeof x);
}

/* 2 VL bf16 words, whole (the pair layout below) */
static inline __attribute__((always_inline)) vu v_load_words(const void *p, int64_t i) {
    vu x;
    memcpy(&x, (const uint16_t *)p + i, sizeof x);
    return x;
}

static inline __attribute__((always_inline)) void v_store_words(void *p, int64_t i, vu x) {
    memcpy((uint16_t *)p + i, &x, sizeof x);
}

/* VL bf16 values widened to float32 (exact: the bits in the high half) */
static inline __attribute__((always_inline)) vf v_load_bf(const void *p, int64_t i) {
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return f_bits(__builtin_convertvector(h, vu) << 16);
}

/* VL bf16 values stored from their widened bits (the low halves are dropped) */
static inline __attribute__((always_inline)) void v_store_bf(void *p, int64_t i, vu hi) {
    vh h = __builtin_convertvector(hi >> 16, vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* ------------------------------------------------------------------------------------ */
/* the pair layout: 2 VL elements as their even and odd elements                          */
/* ------------------------------------------------------------------------------------ */

/* Why: the element order within a step is free (each element's operations are its own),
 * so 2 VL bf16 words loaded as one vector split into the even elements (x << 16) and the
 * odd ones (x & 0xFFFF0000) with one operation each, where widening VL words takes a
 * conversion per half; and results rounded to bf16 (their bits in the high halves, the low
 * halves zero) pack back with a shift and an or. float32 streams (a float32 gradient) are
 * split and merged with two shuffles. As step_avx512.h's 32-wide path. */
typedef struct {
    vf e, o; /* even and odd elements, float32 */
} vpair;

static inline vpair v_split(vu x) {
    vpair p = {f_bits(x << 16), f_bits(x & 0xFFFF0000u)};
    return p;
}

static inline __attribute__((always_inline)) vpair v_load_pair(const void *p, int64_t i) {
    return v_split(v_load_words(p, i));
}

/* 2 VL words in element order from the widened bits of the even and odd elements (low
 * halves zero) */
static inline vu v_pack(vu e, vu o) { return (e >> 16) | o; }

/* the even and odd lanes of two vectors a, b (a's lanes first): shuffles by constant lane
 * numbers, which the compilers spell differently */
#if defined(__clang__) || __GNUC__ >= 12
#if VL == 8
#define V_EVEN(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define V_ODD(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15)
#else
#define V_EVEN(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6)
#define V_ODD(a, b) __builtin_shufflevector(a, b, 1, 3, 5, 7)
#endif
#else
#define V_EVEN(a, b) __builtin_shuffle(a, b, (v_lanes() << 1))
#define V_ODD(a, b) __builtin_shuffle(a, b, (v_lanes() << 1) + 1u)
#endif

/* 2 VL float32 elements as their even and odd elements */
static inline __attribute__((always_inline)) vpair v_load_pair_f32(const void *p,
                                                                   int64_t i) {
    vf a = v_load_f32(p, i), b = v_load_f32(p, i + VL);
    vpair x = {V_EVEN(a, b), V_ODD(a, b)};
    return x;
}

#endif /* COLLAGE_VECTOR */

#endif /* COLLAGE_SIMD_H */
