/* collage native CPU kernels: one AdamW step under a precision strategy, float32 registers.
 *
 * Built on first use by collage/optim/native.py (cc -O3 -march=native -ffp-contract=off
 * -shared -fPIC; no torch headers) and called through ctypes with raw data pointers.
 *
 * Contract: for every element, the same float32 operations in the same order as the
 * foreach path (rules.AdamW.fast, kernels._land, kernels._store_states), each correctly
 * rounded, so that the results are bit for bit those of the foreach path (the stochastic
 * strategy: those of the inductor fused path, whose in-kernel draws are reproduced here):
 *
 *   g  = float(grad); g = g / scale (GradScaler); g = -g (maximize)
 *   m  = fma(w, g - m, m)                 torch's vectorised lerp_, weight w < 0.5
 *      = fma(w - 1, g - m, g)             ... weight >= 0.5
 *   v  = fma(g * (1 - beta2), g, v * beta2)   mul_ then addcmul_ (an fma on CPU)
 *   u  = (m * -step_size) / (sqrt(v) / sqrt(bc2) + eps)
 *   W' = W * decay + u                    two roundings, as W.mul(decay) then add
 *
 * and the landing of W' into the strategy's components (see each case below).
 * -ffp-contract=off keeps the compiler from fusing a multiply and an add that torch
 * rounds separately; every fma here is explicit.
 *
 * bf16 rounding is torch's: round to nearest even on the integer view, NaN -> 0xFFFF
 * (ATen's vectorised float->bf16 conversion), subnormals rounded, not flushed. The
 * AVX512-BF16 instruction (vcvtneps2bf16) is not used: it flushes subnormal inputs and
 * outputs to zero and quietens NaNs differently.
 *
 * Two builds of the same arithmetic: AVX-512 (F, BW, VL) intrinsics when the compiler
 * targets them, and a portable scalar loop otherwise (any C99 compiler; fmaf from libm).
 * The AVX-512 build steps bf16-weight strategies 32 elements per iteration where it can
 * (pair_block: unmeasured steps, bf16 gradients) and 16 otherwise (vector_block); the
 * per-element operations are the same. Threads: collage_adamw_threads cuts the rows into
 * spans run by OpenMP where the build has it (-fopenmp; torch's runtime once loaded).
 *
 * Measured steps (collage_adamw_measured) run the same per-element (per-vector) step code
 * and, from the values already in registers, reduce the 11 lost-update sums of
 * collage.metrics.FIELDS per table row with the semantics of optim/tracked.py's CPU kernel:
 *
 *   d  = u - W * lr_wd                    the intended update, float32 (kernels.fast_step
 *                                         with intended_dtype=float32); W the weight read
 *   e  = change of the represented value  one component a: fl(a' - a), zero iff a' == a;
 *                                         a pair (hi, lo): see pair_change (TwoSum's value
 *                                         where the differences are exact)
 *   ev = change of the visible weight     fl(w' - w), w the bf16 (fp32) weight
 *
 * Sums of products accumulate in float32 (one fma per term), each partial sum over at most
 * SUM_BLOCK = 256 elements (AVX-512: one per vector lane, every 16th element), then in
 * float64; counts are exact integers.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define COLLAGE_AVX512 1
#else
#define COLLAGE_AVX512 0
#endif

#define COLLAGE_ABI 5

/* strategies, in collage.optim.native.STRATEGY_CODES order */
enum { S_FP32, S_MIXED, S_BF16, S_KAHAN, S_STOCHASTIC, S_LIGHT, S_PLUS, S_SPLIT };

/* flags */
enum {
    F_LERP_SMALL = 1, /* lerp weight (1 - beta1) < 0.5 */
    F_DECAY = 2,      /* decay != 1: multiply (kahan: add -W * lr_wd) */
    F_SCALED = 4,     /* divide the gradient by the GradScaler scale */
    F_MAXIMIZE = 8,   /* negate the gradient */
    F_GRAD_FP32 = 16  /* gradients are float32 (else bf16) */
};

/* hyperparameters, float32 (rounded from float64 on the host, as torch rounds a Python
 * number it multiplies a float32 tensor by) */
enum { H_LERP, H_BETA2, H_OMB2, H_BC2S, H_EPS, H_NEG_STEP, H_DECAY, H_LR_WD, H_SCALE, H_COUNT };

/* the lost-update sums of one table row, collage.metrics.FIELDS order, float64 each */
enum {
    M_DOT_ED, M_DD, M_EE, M_N_NONZERO, M_N_STUCK, M_DOT_EVD, M_EVEV, M_N_STUCK_V, M_CC,
    M_N_COMP, M_N_ELEMENTS, M_COUNT
};

/* elements per float32 partial sum (collage.metrics.stats.BLOCK) */
#define SUM_BLOCK 256

/* one row of the tensor table, int64 each */
enum {
    T_N,      /* elements */
    T_W,      /* weight: float32 (fp32) or bf16 bits */
    T_G,      /* gradient: float32 or bf16 */
    T_M,      /* exp_avg: float32 (fp32, mixed) or bf16 */
    T_V,      /* exp_avg_sq: idem */
    T_VLO,    /* exp_avg_sq_lo: bf16 (plus, split) */
    T_X,      /* master (float32), compensation, weight_lo (bf16), weight_low_bits (int16) */
    T_INDEX,  /* stochastic: index of the first element in the whole tensor */
    T_KEY0,   /* stochastic: the two int32 key words of fused.stochastic_seeds */
    T_KEY1,
    T_COLS
};

int collage_native_abi(void) { return COLLAGE_ABI; }
int collage_native_isa(void) { return COLLAGE_AVX512; } /* 1: AVX-512, 0: portable */
#ifdef _OPENMP
int collage_native_openmp(void) { return 1; } /* collage_adamw_threads uses OpenMP */
#else
int collage_native_openmp(void) { return 0; }
#endif

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

/* rounding.split_decode / split_encode on uint32 (identical to their int32 forms) */
static inline float split_decode(uint16_t weight, uint16_t low) {
    uint32_t up = low > 0x8000u;
    return f_of((((uint32_t)weight - up) << 16) | low);
}

static inline void split_encode(float master, uint16_t *weight, uint16_t *low) {
    uint32_t u = u_of(master), l = u & 0xFFFFu;
    *weight = (uint16_t)((u >> 16) + (l > 0x8000u));
    *low = (uint16_t)l;
}

/* ------------------------------------------------------------------------------------ */
/* lost-update sums (measured steps)                                                      */
/* ------------------------------------------------------------------------------------ */

/* strategies whose visible weight is not their represented value; those whose represented
 * value is a pair (weight, weight_lo or compensation), the second part also counted as
 * the compensation */
#define SEPARATE_VISIBLE(S) ((S) == S_MIXED || (S) == S_SPLIT || PAIR(S))
#define PAIR(S) ((S) == S_KAHAN || (S) == S_LIGHT || (S) == S_PLUS)

/* the float sums a block accumulates */
enum { A_DOT_ED, A_DD, A_EE, A_DOT_EVD, A_EVEV, A_CC, A_COUNT };

/* a row's totals: float64 sums of the blocks' float32 sums, exact counts */
typedef struct {
    double sum[A_COUNT];
    int64_t nonzero, stuck, stuck_visible;
} totals;

/* Write a row's totals as the FIELDS vector. Where the visible weight is the represented
 * value its fields are copies (update_sums_blocked with visible_change None). */
static void write_sums(int S, const totals *t, int64_t n, double *out) {
    int separate = SEPARATE_VISIBLE(S), pair = PAIR(S);
    out[M_DOT_ED] = t->sum[A_DOT_ED];
    out[M_DD] = t->sum[A_DD];
    out[M_EE] = t->sum[A_EE];
    out[M_N_NONZERO] = (double)t->nonzero;
    out[M_N_STUCK] = (double)t->stuck;
    out[M_DOT_EVD] = separate ? t->sum[A_DOT_EVD] : t->sum[A_DOT_ED];
    out[M_EVEV] = separate ? t->sum[A_EVEV] : t->sum[A_EE];
    out[M_N_STUCK_V] = (double)(separate ? t->stuck_visible : t->stuck);
    out[M_CC] = pair ? t->sum[A_CC] : 0.0;
    out[M_N_COMP] = pair ? (double)n : 0.0;
    out[M_N_ELEMENTS] = (double)n;
}

/* The change e of a pair's value hi + lo (kahan: weight + compensation; light, plus:
 * weight + weight_lo) from (hi, lo) to (hi1, lo1), and whether it is exactly zero:
 *
 *   s = fl(fl(hi1 - hi) + fl(lo1 - lo)),   e = fma(s, 0, s),   stuck = (s == 0)
 *
 * Where both differences are exact -- the components' exponents within 15 of each other
 * (8-bit significands: the difference fits 24 bits) or one of them zero, the normal case --
 * this is metrics.component_change's TwoSum value (its error terms are then +0), up to the
 * sign of a zero, and s == 0 iff hi1 + lo1 == hi + lo (with gradual underflow a sum of two
 * floats is zero only when they cancel exactly).
 *
 * A rounded difference cannot cancel, for the normalised pairs the optimizer keeps: hi + lo
 * lies in hi's rounding interval (round to nearest leaves lo within half the gap to hi's
 * neighbour on lo's side; kahan's compensation is that residual up to one float32
 * rounding). Say hi < hi1. Rounding intervals do not overlap, so hi1 + lo1 >= hi + lo. If
 * hi1 - hi is inexact, hi and hi1 are 16 binades apart and |lo1 - lo| <= 2**-7 |hi1 - hi|.
 * If lo1 - lo is inexact, one of lo, lo1 is 2**16 times the other and a negative
 * difference comes from lo > 0 (at most half the gap above hi) or lo1 < 0 (at most half
 * the gap below hi1), both at most (hi1 - hi) / 2. Either way s != 0 and e is within three
 * float32 roundings of the exact change: the counts are exact, the sums within their
 * bound. A pair edited by hand outside the optimizer can break the normalisation. The fma
 * turns an infinite s into nan, as TwoSum's error term does. Four vector operations
 * instead of TwoSum's seventeen, which made light and kahan's measured step 1.7-1.9x. */
static inline void pair_change(float hi1, float lo1, float hi, float lo, float *e,
                               int *stuck) {
    float s = (hi1 - hi) + (lo1 - lo);
    *e = s + s * 0.0f; /* the fma below, in two exact steps (no libm call) */
    *stuck = s == 0.0f;
}

/* ------------------------------------------------------------------------------------ */
/* the portable build: one element at a time                                            */
/* ------------------------------------------------------------------------------------ */

/* One element of any strategy (constant S, G32, MEAS: specialised by inlining). With MEAS,
 * the element's terms are added to the block's float32 sums ``acc`` and counts ``t``. */
static inline __attribute__((always_inline)) void scalar_element(
    const int S, const int G32, const int MEAS, int flags, const float *h, const int64_t *row,
    int64_t i, float *acc, totals *t) {
    float g = G32 ? ((const float *)row[T_G])[i] : bf_load(((const uint16_t *)row[T_G])[i]);
    if (flags & F_SCALED) g = g / h[H_SCALE];
    if (flags & F_MAXIMIZE) g = -g;
    float m, v;
    if (S == S_FP32 || S == S_MIXED) {
        m = ((float *)row[T_M])[i];
        v = ((float *)row[T_V])[i];
    } else {
        m = bf_load(((uint16_t *)row[T_M])[i]);
        v = bf_load(((uint16_t *)row[T_V])[i]);
        if (S == S_PLUS || S == S_SPLIT) v = v + bf_load(((uint16_t *)row[T_VLO])[i]);
    }
    m = (flags & F_LERP_SMALL) ? fmaf(h[H_LERP], g - m, m)
                               : fmaf(h[H_LERP] - 1.0f, g - m, g);
    v = fmaf(g * h[H_OMB2], g, v * h[H_BETA2]);
    float u = (m * h[H_NEG_STEP]) / (sqrtf(v) / h[H_BC2S] + h[H_EPS]);
    int decay = flags & F_DECAY;
    uint16_t *wb = (uint16_t *)row[T_W], *xb = (uint16_t *)row[T_X];
    /* for the sums: W the float32 weight the step reads; the represented value (or pair)
     * and the visible weight before (r0, x0, v0) and after (r1, x1, v1) */
    float W = 0.0f, r0 = 0.0f, x0 = 0.0f, v0 = 0.0f, r1 = 0.0f, x1 = 0.0f, v1 = 0.0f;
    switch (S) {
    case S_FP32: {
        float *w = (float *)row[T_W];
        W = r0 = w[i];
        w[i] = r1 = (decay ? W * h[H_DECAY] : W) + u;
        break;
    }
    case S_MIXED: {
        float *master = (float *)row[T_X];
        W = r0 = master[i];
        if (MEAS) v0 = bf_load(wb[i]);
        float nw = (decay ? W * h[H_DECAY] : W) + u;
        master[i] = r1 = nw;
        wb[i] = bf_round(nw);
        v1 = bf_load(wb[i]);
        break;
    }
    case S_BF16: {
        W = r0 = bf_load(wb[i]);
        wb[i] = bf_round((decay ? W * h[H_DECAY] : W) + u);
        r1 = bf_load(wb[i]);
        break;
    }
    case S_STOCHASTIC: {
        W = r0 = bf_load(wb[i]);
        float draw = uniform((uint32_t)(row[T_INDEX] + i), (uint32_t)row[T_KEY0],
                             (uint32_t)row[T_KEY1]);
        wb[i] = bf_stochastic((decay ? W * h[H_DECAY] : W) + u, draw);
        r1 = bf_load(wb[i]);
        break;
    }
    case S_KAHAN: {
        W = r0 = v0 = bf_load(wb[i]);
        x0 = bf_load(xb[i]);
        /* decay == 1: the foreach path adds the update to +0 (a -0 update becomes +0) */
        float increment = (decay ? (-W) * h[H_LR_WD] : 0.0f) + u;
        float corrected = increment + x0;
        uint16_t hi = bf_round(W + corrected);
        float hf = bf_load(hi);
        wb[i] = hi;
        xb[i] = finite_bits(u_of(hf)) ? bf_round(corrected - (hf - W)) : 0;
        r1 = v1 = hf;
        x1 = bf_load(xb[i]);
        break;
    }
    case S_LIGHT:
    case S_PLUS: {
        r0 = v0 = bf_load(wb[i]);
        x0 = bf_load(xb[i]);
        W = r0 + x0;
        float nw = (decay ? W * h[H_DECAY] : W) + u;
        uint16_t hi = bf_round(nw);
        float hf = bf_load(hi);
        wb[i] = hi;
        xb[i] = finite_bits(u_of(hf)) ? bf_round(nw - hf) : 0;
        r1 = v1 = hf;
        x1 = bf_load(xb[i]);
        break;
    }
    case S_SPLIT: {
        if (MEAS) v0 = bf_load(wb[i]);
        W = r0 = split_decode(wb[i], xb[i]);
        r1 = (decay ? W * h[H_DECAY] : W) + u;
        split_encode(r1, &wb[i], &xb[i]);
        v1 = bf_load(wb[i]);
        break;
    }
    }
    if (S == S_FP32 || S == S_MIXED) {
        ((float *)row[T_M])[i] = m;
        ((float *)row[T_V])[i] = v;
    } else {
        ((uint16_t *)row[T_M])[i] = bf_round(m);
        uint16_t vh = bf_round(v);
        ((uint16_t *)row[T_V])[i] = vh;
        if (S == S_PLUS || S == S_SPLIT) {
            float vf = bf_load(vh);
            ((uint16_t *)row[T_VLO])[i] = finite_bits(u_of(vf)) ? bf_round(v - vf) : 0;
        }
    }
    if (MEAS) {
        float d = u - W * h[H_LR_WD];
        float e;
        int stuck;
        if (PAIR(S)) {
            pair_change(r1, x1, r0, x0, &e, &stuck);
        } else {
            e = r1 - r0;
            stuck = e == 0.0f;
        }
        int moving = !(d == 0.0f); /* NaN counts as moving, as torch's != */
        acc[A_DOT_ED] += e * d;
        acc[A_DD] += d * d;
        acc[A_EE] += e * e;
        t->nonzero += moving;
        t->stuck += moving && stuck;
        if (SEPARATE_VISIBLE(S)) {
            float ev = v1 - v0;
            acc[A_DOT_EVD] += ev * d;
            acc[A_EVEV] += ev * ev;
            t->stuck_visible += moving && ev == 0.0f;
        }
        if (PAIR(S)) acc[A_CC] += x1 * x1;
    }
}

static inline __attribute__((always_inline)) void scalar_range(
    const int S, const int G32, const int MEAS, int flags, const float *h,
    const int64_t *row, int64_t begin, int64_t end, double *out) {
    if (!MEAS) {
        for (int64_t i = begin; i < end; i++)
            scalar_element(S, G32, 0, flags, h, row, i, NULL, NULL);
        return;
    }
    totals t = {{0}, 0, 0, 0};
    for (int64_t b = begin; b < end; b += SUM_BLOCK) {
        float acc[A_COUNT] = {0};
        int64_t stop = end - b < SUM_BLOCK ? end : b + SUM_BLOCK;
        for (int64_t i = b; i < stop; i++) scalar_element(S, G32, 1, flags, h, row, i, acc, &t);
        for (int f = 0; f < A_COUNT; f++) t.sum[f] += (double)acc[f];
    }
    write_sums(S, &t, end - begin, out);
}

/* ------------------------------------------------------------------------------------ */
/* AVX-512: the same operations on 16 lanes                                               */
/* ------------------------------------------------------------------------------------ */

#if COLLAGE_AVX512

typedef struct {
    __m512 lerp, beta2, omb2, bc2s, eps, neg_step, decay, lr_wd, scale;
    __m512i sign;          /* 0x80000000 to negate the gradient (maximize), else 0 */
    __m512i interleave;    /* v_round2: words [even 16 | odd 16] -> element order */
    __mmask16 small, decays; /* all lanes or none: lerp weight < 0.5; decay != 1 */
} vcoeffs;

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
    *low = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
    __m512i up = _mm512_movm_epi32(_mm512_cmpgt_epu32_mask(*low, _mm512_set1_epi32(0x8000)));
    *weight = _mm512_sub_epi32(_mm512_srli_epi32(bits, 16), up);
}

/* One table row in locals: intrinsic stores may alias anything, so pointers read from the
 * table inside the loop would be reloaded after every store. */
typedef struct {
    void *w, *g, *m, *v, *vlo, *x;
    int64_t index, key0, key1;
} vrow;

/* The landing and the state stores of one block, in registers: the 16-bit outputs
 * (weight, extra, m, v, v_lo) and the float32 ones (fp32/mixed). Returns the lanes
 * whose fast rounding must be redone (never with ``exact``). */
typedef struct {
    __m256i w, x, m, v, vlo;
    __m512 w32, m32, v32; /* w32: the new weight (fp32), master (mixed, split) */
} vout;

static inline __attribute__((always_inline)) __mmask16 vector_land(
    const int S, const int exact, const vcoeffs *c, vrow r, int64_t i,
    __m512 m, __m512 v, __m512 u, __m512 W, __m512 X, vout *o) {
    __mmask16 bad = 0;
    switch (S) {
    case S_FP32:
        o->w32 = _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
        break;
    case S_MIXED: /* W: the float32 master */
        o->w32 = _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
        o->w = v_round(o->w32, exact, &bad);
        break;
    case S_BF16:
        o->w = v_round(_mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u),
                       exact, &bad);
        break;
    case S_STOCHASTIC:
        o->w = v_stochastic(_mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u),
                            v_draw16(r.index + i, r.key0, r.key1));
        break;
    case S_KAHAN: { /* X: the compensation */
        /* (-W) * lr_wd, or +0 without decay (the foreach path adds u to zeros) */
        __m512 base = _mm512_maskz_mul_ps(c->decays, _mm512_sub_ps(_mm512_setzero_ps(), W),
                                          c->lr_wd);
        __m512 corrected = _mm512_add_ps(_mm512_add_ps(base, u), X);
        o->w = v_round(_mm512_add_ps(W, corrected), exact, &bad);
        __m512 hf = v_widen(o->w);
        /* what the rounded add failed to land: exact (Sterbenz), +0 where hi is inf/nan */
        __m512 lost = _mm512_sub_ps(corrected, _mm512_sub_ps(hf, W));
        o->x = v_round(_mm512_maskz_mov_ps(v_finite(hf), lost), exact, &bad);
        break;
    }
    case S_LIGHT:
    case S_PLUS: { /* W: hi + lo */
        __m512 nw = _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
        o->w = v_round(nw, exact, &bad);
        o->x = v_residual(nw, v_widen(o->w), exact, &bad);
        break;
    }
    case S_SPLIT: { /* W: the decoded float32 master */
        __m512i top, l;
        o->w32 = _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
        v_split_encode(o->w32, &top, &l);
        o->w = v_narrow(top); /* vpmovdw truncates: the low 16 bits */
        o->x = v_narrow(l);
        break;
    }
    }
    if (S == S_FP32 || S == S_MIXED) {
        o->m32 = m;
        o->v32 = v;
    } else {
        o->m = v_round(m, exact, &bad);
        o->v = v_round(v, exact, &bad);
        if (S == S_PLUS || S == S_SPLIT) o->vlo = v_residual(v, v_widen(o->v), exact, &bad);
    }
    return bad;
}

/* A block's float32 sums, one per lane: each lane sums SUM_BLOCK terms (of every 16th
 * element) before it is flushed into float64. */
typedef struct {
    __m512 sum[A_COUNT];
} vacc;

/* The lost-update terms of one vector (see the header): ``W`` the float32 weight the step
 * read, ``V0`` the visible weight before (separate-visible strategies), ``X0`` the pair's
 * second part before; after the step: ``W1`` the float32 master (fp32, mixed, split),
 * ``v1`` the visible weight (all but fp32), ``x1`` the pair's second part. Lanes outside
 * ``k`` count nothing. */
static inline __attribute__((always_inline)) void vector_measure(
    const int S, const vcoeffs *c, __mmask16 k, __m512 u, __m512 W, __m512 V0, __m512 X0,
    __m512 W1, __m512 v1, __m512 x1, vacc *a, totals *t) {
    __m512 zero = _mm512_setzero_ps();
    __m512 d = _mm512_sub_ps(u, _mm512_mul_ps(W, c->lr_wd));
    __m512 e = zero, ev = zero;
    __mmask16 stuck;
    if (S == S_FP32 || S == S_MIXED || S == S_SPLIT) e = _mm512_sub_ps(W1, W);
    if (S == S_BF16 || S == S_STOCHASTIC) e = _mm512_sub_ps(v1, W);
    if (PAIR(S)) {
        /* r0: the pair's first part before (kahan reads it as W). See pair_change. */
        __m512 r0 = S == S_KAHAN ? W : V0;
        __m512 sum = _mm512_add_ps(_mm512_sub_ps(v1, r0), _mm512_sub_ps(x1, X0));
        e = _mm512_fmadd_ps(sum, zero, sum); /* inf -> nan, as TwoSum's error term */
        stuck = _mm512_cmp_ps_mask(sum, zero, _CMP_EQ_OQ);
    } else {
        stuck = _mm512_cmp_ps_mask(e, zero, _CMP_EQ_OQ);
    }
    if (SEPARATE_VISIBLE(S)) ev = _mm512_sub_ps(v1, S == S_KAHAN ? W : V0);
    __mmask16 moving = _mm512_cmp_ps_mask(d, zero, _CMP_NEQ_UQ); /* NaN moves */
    if (!FULL(k)) { /* a tail: the other lanes hold the step of zeros (NaN if eps == 0) */
        moving &= k;
        d = _mm512_maskz_mov_ps(k, d);
        e = _mm512_maskz_mov_ps(k, e);
        ev = _mm512_maskz_mov_ps(k, ev);
        x1 = _mm512_maskz_mov_ps(k, x1);
    }
    a->sum[A_DOT_ED] = _mm512_fmadd_ps(e, d, a->sum[A_DOT_ED]);
    a->sum[A_DD] = _mm512_fmadd_ps(d, d, a->sum[A_DD]);
    a->sum[A_EE] = _mm512_fmadd_ps(e, e, a->sum[A_EE]);
    t->nonzero += __builtin_popcount((unsigned)moving);
    t->stuck += __builtin_popcount((unsigned)(moving & stuck));
    if (SEPARATE_VISIBLE(S)) {
        a->sum[A_DOT_EVD] = _mm512_fmadd_ps(ev, d, a->sum[A_DOT_EVD]);
        a->sum[A_EVEV] = _mm512_fmadd_ps(ev, ev, a->sum[A_EVEV]);
        __mmask16 still = _mm512_cmp_ps_mask(ev, zero, _CMP_EQ_OQ);
        t->stuck_visible += __builtin_popcount((unsigned)(moving & still));
    }
    if (PAIR(S)) a->sum[A_CC] = _mm512_fmadd_ps(x1, x1, a->sum[A_CC]);
}

/* A block's lane sums into the row's float64 totals (both halves widened exactly). */
static inline __attribute__((always_inline)) void vector_flush(const int S, vacc *a,
                                                               totals *t) {
    for (int f = 0; f < A_COUNT; f++) {
        if (f == A_CC && !PAIR(S)) continue;
        if ((f == A_DOT_EVD || f == A_EVEV) && !SEPARATE_VISIBLE(S)) continue;
        __m512 x = a->sum[f];
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
        __m512d hi = _mm512_cvtps_pd(
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
        t->sum[f] += _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
        a->sum[f] = _mm512_setzero_ps();
    }
}

/* The AdamW step of 16 lanes from the gradient ``g``: ``m`` and ``v`` updated in place,
 * the update u returned (the header's formulas, in its order). */
static inline __attribute__((always_inline)) __m512 v_adam(const int SCALED, const int BC1,
                                                           const vcoeffs *c, __m512 g,
                                                           __m512 *m, __m512 *v) {
    if (SCALED) g = _mm512_div_ps(g, c->scale);
    /* flags as data, no branch: the sign to flip, the lerp formula chosen by a blend */
    g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c->sign));
    /* lerp: fma(w, g - m, m) when w < 0.5, else fma(w - 1, g - m, g) */
    *m = _mm512_fmadd_ps(c->lerp, _mm512_sub_ps(g, *m), _mm512_mask_blend_ps(c->small, g, *m));
    *v = _mm512_fmadd_ps(_mm512_mul_ps(g, c->omb2), g, _mm512_mul_ps(*v, c->beta2));
    /* BC1: the bias correction's square root is 1.0f (late in training: beta2**step below
     * 2**-24, e.g. after 324 steps at beta2 = 0.95, 16,627 at 0.999), and x / 1 == x for
     * every float x, NaN included: one division fewer, the same bits */
    __m512 root = _mm512_sqrt_ps(*v);
    if (!BC1) root = _mm512_div_ps(root, c->bc2s);
    __m512 den = _mm512_add_ps(root, c->eps);
    return _mm512_div_ps(_mm512_mul_ps(*m, c->neg_step), den);
}

/* One vector of 16 elements (``k``: the lanes of a tail): the step, and with MEAS its
 * lost-update terms (the step's stores are the same either way). */
static inline __attribute__((always_inline)) void vector_block(
    const int S, const int G32, const int SCALED, const int MEAS, const vcoeffs *c, vrow r,
    int64_t i, __mmask16 k, vacc *a, totals *t) {
    __m512 g = G32 ? v_load_f32(r.g, i, k) : v_load_bf(r.g, i, k);
    __m512 m, v;
    if (S == S_FP32 || S == S_MIXED) {
        m = v_load_f32(r.m, i, k);
        v = v_load_f32(r.v, i, k);
    } else {
        m = v_load_bf(r.m, i, k);
        v = v_load_bf(r.v, i, k);
        if (S == S_PLUS || S == S_SPLIT)
            v = _mm512_add_ps(v, v_load_bf(r.vlo, i, k));
    }
    __m512 u = v_adam(SCALED, 0, c, g, &m, &v);
    void *wp = r.w, *xp = r.x;
    /* W: the float32 weight the step reads; X: kahan's compensation, an MCF pair's lo;
     * V: the visible bf16 weight (light, plus; mixed and split when measured) */
    __m512 W = _mm512_setzero_ps(), X = _mm512_setzero_ps(), V = _mm512_setzero_ps();
    switch (S) {
    case S_FP32: W = v_load_f32(wp, i, k); break;
    case S_MIXED:
        W = v_load_f32(xp, i, k);
        if (MEAS) V = v_load_bf(wp, i, k);
        break;
    case S_BF16:
    case S_STOCHASTIC: W = v_load_bf(wp, i, k); break;
    case S_KAHAN:
        W = v_load_bf(wp, i, k);
        X = v_load_bf(xp, i, k);
        break;
    case S_LIGHT:
    case S_PLUS:
        V = v_load_bf(wp, i, k);
        X = v_load_bf(xp, i, k);
        W = _mm512_add_ps(V, X);
        break;
    case S_SPLIT: { /* the bf16 weight and the low bits, zero-extended */
        __m512i w16 = _mm512_cvtepu16_epi32(v_load16(wp, i, k));
        __m512i x16 = _mm512_cvtepu16_epi32(v_load16(xp, i, k));
        W = v_split_decode(w16, x16);
        if (MEAS) V = _mm512_castsi512_ps(_mm512_slli_epi32(w16, 16));
        break;
    }
    }
    vout o;
    if (__builtin_expect(vector_land(S, 0, c, r, i, m, v, u, W, X, &o) != 0, 0))
        vector_land(S, 1, c, r, i, m, v, u, W, X, &o);
    if (MEAS) {
        __m512 zero = _mm512_setzero_ps();
        vector_measure(S, c, k, u, W, V, X,
                       (S == S_FP32 || S == S_MIXED || S == S_SPLIT) ? o.w32 : zero,
                       S != S_FP32 ? v_widen(o.w) : zero, PAIR(S) ? v_widen(o.x) : zero, a,
                       t);
    }
    switch (S) {
    case S_FP32: v_store_f32(wp, i, k, o.w32); break;
    case S_MIXED:
        v_store_f32(xp, i, k, o.w32);
        v_store_bf(wp, i, k, o.w);
        break;
    case S_BF16:
    case S_STOCHASTIC: v_store_bf(wp, i, k, o.w); break;
    default:
        v_store_bf(wp, i, k, o.w);
        v_store_bf(xp, i, k, o.x);
    }
    if (S == S_FP32 || S == S_MIXED) {
        v_store_f32(r.m, i, k, o.m32);
        v_store_f32(r.v, i, k, o.v32);
    } else {
        v_store_bf(r.m, i, k, o.m);
        v_store_bf(r.v, i, k, o.v);
        if (S == S_PLUS || S == S_SPLIT) v_store_bf(r.vlo, i, k, o.vlo);
    }
}

/* ------------------------------------------------------------------------------------ */
/* 32 elements at a time (unmeasured steps of the bf16-weight strategies, bf16 gradients) */
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

static inline __m512 v_decayed(const vcoeffs *c, __m512 W, __m512 u) {
    return _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
}

typedef struct {
    __m512i w, x, m, v, vlo; /* packed 16-bit outputs */
    vpair w32;               /* split: the new float32 master (measured steps) */
} vout2;

/* vector_land for 32 elements: the same operations per element */
static inline __attribute__((always_inline)) __mmask16 pair_land(
    const int S, const int exact, const vcoeffs *c, vrow r, int64_t i, vpair m, vpair v,
    vpair u, vpair W, vpair X, vout2 *o) {
    __mmask16 bad = 0;
    switch (S) {
    case S_BF16: {
        vpair nw = {v_decayed(c, W.e, u.e), v_decayed(c, W.o, u.o)};
        o->w = v_round2(c, nw, exact, &bad);
        break;
    }
    case S_STOCHASTIC: {
        __m512i he, ho;
        v_hash2(r.index + i, r.key0, r.key1, &he, &ho);
        vpair nw = {v_decayed(c, W.e, u.e), v_decayed(c, W.o, u.o)};
        o->w = v_stochastic2(nw, he, ho);
        break;
    }
    case S_KAHAN: { /* X: the compensation; see vector_land */
        __m512 zero = _mm512_setzero_ps();
        __m512 be = _mm512_maskz_mul_ps(c->decays, _mm512_sub_ps(zero, W.e), c->lr_wd);
        __m512 bo = _mm512_maskz_mul_ps(c->decays, _mm512_sub_ps(zero, W.o), c->lr_wd);
        vpair corrected = {_mm512_add_ps(_mm512_add_ps(be, u.e), X.e),
                           _mm512_add_ps(_mm512_add_ps(bo, u.o), X.o)};
        vpair sum = {_mm512_add_ps(W.e, corrected.e), _mm512_add_ps(W.o, corrected.o)};
        /* the compensation's test subsumes the weight's: where the sum is subnormal, hf
         * is +-0 and corrected - (hf - W) is the sum again, subnormal */
        o->w = v_round2_high(c, sum, exact, &bad);
        vpair hf = v_split(o->w);
#if COLLAGE_UNMASKED_LOW_PARTS
        /* where hf is inf or nan, so is the difference (corrected - inf or nan), and the
         * block is redone exactly; elsewhere the mask keeps every lane */
        if (!exact) {
            vpair lost = {_mm512_sub_ps(corrected.e, _mm512_sub_ps(hf.e, W.e)),
                          _mm512_sub_ps(corrected.o, _mm512_sub_ps(hf.o, W.o))};
            o->x = v_round2_unmasked(c, lost, &bad);
            break;
        }
#endif
        vpair lost = {_mm512_maskz_sub_ps(v_finite(hf.e), corrected.e,
                                          _mm512_sub_ps(hf.e, W.e)),
                      _mm512_maskz_sub_ps(v_finite(hf.o), corrected.o,
                                          _mm512_sub_ps(hf.o, W.o))};
        o->x = v_round2(c, lost, exact, &bad);
        break;
    }
    case S_LIGHT:
    case S_PLUS: {
        vpair nw = {v_decayed(c, W.e, u.e), v_decayed(c, W.o, u.o)};
        o->w = v_round2_high(c, nw, exact, &bad);
        o->x = v_residual2(c, nw, v_split(o->w), exact, &bad);
        break;
    }
    case S_SPLIT: { /* split_encode of each half */
        __m512i te, to, le, lo;
        o->w32.e = v_decayed(c, W.e, u.e);
        o->w32.o = v_decayed(c, W.o, u.o);
        v_split_encode(o->w32.e, &te, &le);
        v_split_encode(o->w32.o, &to, &lo);
        o->w = v_pack(te, to);
        o->x = v_pack(le, lo);
        break;
    }
    }
    o->m = v_round2(c, m, exact, &bad);
    if (S == S_PLUS || S == S_SPLIT) {
        o->v = v_round2_high(c, v, exact, &bad);
        o->vlo = v_residual2(c, v, v_split(o->v), exact, &bad);
    } else {
        o->v = v_round2(c, v, exact, &bad);
    }
    return bad;
}

/* vector_block for 32 elements of a bf16-weight strategy with bf16 gradients; with MEAS
 * the lost-update terms of the even and the odd elements go into the lane sums ``a`` (each
 * lane then sums two elements per 32: a block of 16 * SUM_BLOCK elements still gives every
 * lane SUM_BLOCK terms). */
static inline __attribute__((always_inline)) void pair_block(const int S, const int SCALED,
                                                             const int BC1, const int MEAS,
                                                             const vcoeffs *c, vrow r,
                                                             int64_t i, vacc *a, totals *t) {
    vpair g = v_load_pair(r.g, i), m = v_load_pair(r.m, i), v = v_load_pair(r.v, i);
    if (S == S_PLUS || S == S_SPLIT) {
        vpair lo = v_load_pair(r.vlo, i);
        v.e = _mm512_add_ps(v.e, lo.e);
        v.o = _mm512_add_ps(v.o, lo.o);
    }
    vpair u = {v_adam(SCALED, BC1, c, g.e, &m.e, &v.e),
               v_adam(SCALED, BC1, c, g.o, &m.o, &v.o)};
    vpair W, X = {_mm512_setzero_ps(), _mm512_setzero_ps()}, V = X;
    switch (S) {
    case S_BF16:
    case S_STOCHASTIC: W = v_load_pair(r.w, i); break;
    case S_KAHAN:
        W = v_load_pair(r.w, i);
        X = v_load_pair(r.x, i);
        break;
    case S_LIGHT:
    case S_PLUS: {
        V = v_load_pair(r.w, i);
        X = v_load_pair(r.x, i);
        W.e = _mm512_add_ps(V.e, X.e);
        W.o = _mm512_add_ps(V.o, X.o);
        break;
    }
    default: { /* S_SPLIT: split_decode of the even and odd words */
        __m512i low = _mm512_set1_epi32(0xFFFF);
        __m512i wp = _mm512_loadu_si512((const uint16_t *)r.w + i);
        __m512i xp = _mm512_loadu_si512((const uint16_t *)r.x + i);
        W.e = v_split_decode(_mm512_and_si512(wp, low), _mm512_and_si512(xp, low));
        W.o = v_split_decode(_mm512_srli_epi32(wp, 16), _mm512_srli_epi32(xp, 16));
        if (MEAS) V = v_split(wp);
        break;
    }
    }
    vout2 o;
    if (__builtin_expect(pair_land(S, 0, c, r, i, m, v, u, W, X, &o) != 0, 0))
        pair_land(S, 1, c, r, i, m, v, u, W, X, &o);
    if (MEAS) {
        const __mmask16 full = (__mmask16)0xFFFF;
        __m512 zero = _mm512_setzero_ps();
        vpair v1 = v_split(o.w), x1 = {zero, zero}, w1 = {zero, zero};
        if (PAIR(S)) x1 = v_split(o.x);
        if (S == S_SPLIT) w1 = o.w32;
        vector_measure(S, c, full, u.e, W.e, V.e, X.e, w1.e, v1.e, x1.e, a, t);
        vector_measure(S, c, full, u.o, W.o, V.o, X.o, w1.o, v1.o, x1.o, a, t);
    }
    v_store_words(r.w, i, o.w);
    if (S != S_BF16 && S != S_STOCHASTIC) v_store_words(r.x, i, o.x);
    v_store_words(r.m, i, o.m);
    v_store_words(r.v, i, o.v);
    if (S == S_PLUS || S == S_SPLIT) v_store_words(r.vlo, i, o.vlo);
}

/* The vectors of [begin, end) in order; with MEAS, blocks of 16 * SUM_BLOCK elements
 * (SUM_BLOCK terms per lane) flushed to float64, the row's sums written to ``out``. */
static inline __attribute__((always_inline)) void vector_loop(
    const int S, const int G32, const int SCALED, const int MEAS, const int BC1,
    const vcoeffs *c, vrow r, int64_t begin, int64_t end, double *out) {
    const __mmask16 full = (__mmask16)0xFFFF;
    int64_t i = begin;
    if (!MEAS) {
        if (!G32 && S != S_FP32 && S != S_MIXED)
            for (; i + 32 <= end; i += 32) pair_block(S, SCALED, BC1, 0, c, r, i, NULL, NULL);
        for (; i + 16 <= end; i += 16) vector_block(S, G32, SCALED, 0, c, r, i, full, NULL, NULL);
        if (i < end)
            vector_block(S, G32, SCALED, 0, c, r, i, (__mmask16)((1u << (end - i)) - 1u),
                         NULL, NULL);
        return;
    }
    totals t = {{0}, 0, 0, 0};
    vacc a;
    for (int f = 0; f < A_COUNT; f++) a.sum[f] = _mm512_setzero_ps();
    const int pairs = !G32 && S != S_FP32 && S != S_MIXED; /* the 32-wide path */
    for (; i + 16 * SUM_BLOCK <= end; i += 16 * SUM_BLOCK) {
        if (pairs) {
#pragma GCC unroll 1
            for (int j = 0; j < 16 * SUM_BLOCK; j += 32)
                pair_block(S, SCALED, 0, 1, c, r, i + j, &a, &t);
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 16 * SUM_BLOCK; j += 16)
                vector_block(S, G32, SCALED, 1, c, r, i + j, full, &a, &t);
        }
        vector_flush(S, &a, &t);
    }
    for (; i + 16 <= end; i += 16) vector_block(S, G32, SCALED, 1, c, r, i, full, &a, &t);
    if (i < end)
        vector_block(S, G32, SCALED, 1, c, r, i, (__mmask16)((1u << (end - i)) - 1u), &a, &t);
    vector_flush(S, &a, &t);
    write_sums(S, &t, end - begin, out);
}

static inline __attribute__((always_inline)) void vector_range(
    const int S, const int G32, const int MEAS, int flags, const float *h,
    const int64_t *row, int64_t begin, int64_t end, double *out) {
    vcoeffs c;
    int small = (flags & F_LERP_SMALL) != 0;
    c.lerp = _mm512_set1_ps(small ? h[H_LERP] : h[H_LERP] - 1.0f);
    c.small = small ? (__mmask16)0xFFFF : 0;
    c.decays = (flags & F_DECAY) ? (__mmask16)0xFFFF : 0;
    c.sign = _mm512_set1_epi32((flags & F_MAXIMIZE) ? (int)0x80000000u : 0);
    /* word j of the result: word (j & 1) * 16 + j / 2 of [even 16 | odd 16] */
    c.interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                    24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                    16, 0);
    c.beta2 = _mm512_set1_ps(h[H_BETA2]);
    c.omb2 = _mm512_set1_ps(h[H_OMB2]);
    c.bc2s = _mm512_set1_ps(h[H_BC2S]);
    c.eps = _mm512_set1_ps(h[H_EPS]);
    c.neg_step = _mm512_set1_ps(h[H_NEG_STEP]);
    c.decay = _mm512_set1_ps(h[H_DECAY]);
    c.lr_wd = _mm512_set1_ps(h[H_LR_WD]);
    c.scale = _mm512_set1_ps(h[H_SCALE]);
    vrow r = {(void *)row[T_W], (void *)row[T_G], (void *)row[T_M], (void *)row[T_V],
              (void *)row[T_VLO], (void *)row[T_X], row[T_INDEX], row[T_KEY0], row[T_KEY1]};
    /* a loop without the division by the bias correction only where it is taken (the
     * 32-wide unmeasured path): every other instantiation would only add build time */
    if (!MEAS && !G32 && S != S_FP32 && S != S_MIXED && h[H_BC2S] == 1.0f) {
        if (flags & F_SCALED) vector_loop(S, G32, 1, MEAS, 1, &c, r, begin, end, out);
        else vector_loop(S, G32, 0, MEAS, 1, &c, r, begin, end, out);
    } else if (flags & F_SCALED) {
        vector_loop(S, G32, 1, MEAS, 0, &c, r, begin, end, out);
    } else {
        vector_loop(S, G32, 0, MEAS, 0, &c, r, begin, end, out);
    }
}

#define RANGE vector_range
#else
#define RANGE scalar_range
#endif

/* ------------------------------------------------------------------------------------ */
/* entry point                                                                            */
/* ------------------------------------------------------------------------------------ */

/* Elements [begin, end) of one row, any strategy; with MEAS its lost-update sums to
 * ``out`` (the measured and unmeasured loops are separate instantiations of the same
 * per-element code). */
static inline __attribute__((always_inline)) void run_piece(
    const int MEAS, int strategy, int flags, const float *h, const int64_t *row,
    int64_t begin, int64_t end, double *out) {
    int g32 = (flags & F_GRAD_FP32) != 0;
#define PIECE(S)                                                                          \
    case S:                                                                               \
        if (g32) RANGE(S, 1, MEAS, flags, h, row, begin, end, out);                       \
        else RANGE(S, 0, MEAS, flags, h, row, begin, end, out);                           \
        break;
    switch (strategy) {
        PIECE(S_FP32)
        PIECE(S_MIXED)
        PIECE(S_BF16)
        PIECE(S_KAHAN)
        PIECE(S_STOCHASTIC)
        PIECE(S_LIGHT)
        PIECE(S_PLUS)
        PIECE(S_SPLIT)
    }
#undef PIECE
}

/* Step ``count`` tensors (rows of ``table``, T_COLS int64 each) of one strategy with the
 * coefficients ``h`` (H_COUNT floats) and ``flags``. Returns 0, or -1 for an unknown
 * strategy (nothing written). */
int collage_adamw_threads(int strategy, int flags, int64_t count, const int64_t *table,
                          const float *h, int threads);

int collage_adamw(int strategy, int flags, int64_t count, const int64_t *table,
                  const float *h) {
    return collage_adamw_threads(strategy, flags, count, table, h, 1);
}

/* collage_adamw, bit for bit, that also writes each row's lost-update sums: ``sums`` holds
 * ``count`` x M_COUNT doubles (collage.metrics.FIELDS order), overwritten. */
int collage_adamw_measured(int strategy, int flags, int64_t count, const int64_t *table,
                           const float *h, double *sums) {
    if (strategy < S_FP32 || strategy > S_SPLIT) return -1;
    for (int64_t t = 0; t < count; t++) {
        const int64_t *row = table + t * T_COLS;
        run_piece(1, strategy, flags, h, row, 0, row[T_N], sums + t * M_COUNT);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* threads: OpenMP, the runtime torch itself uses                                        */
/* ------------------------------------------------------------------------------------ */

/* elements per thread at least (below it a parallel region costs more than it saves) */
#define MIN_CHUNK 65536

#ifdef _OPENMP
/* How many threads share ``total`` elements: at most ``threads``, each with at least
 * MIN_CHUNK elements, at least one. */
static int64_t thread_parts(int64_t total, int threads) {
    int64_t parts = threads < 1 ? 1 : threads;
    int64_t most = total / MIN_CHUNK > 0 ? total / MIN_CHUNK : 1;
    return parts < most ? parts : most;
}
#endif

/* A cut inside a row of ``n`` elements, moved up to a multiple of 64 elements (128 bytes
 * or more: two threads never write one cache line); monotonic, so that the pieces of
 * neighbouring spans neither overlap nor leave a gap. */
static int64_t row_cut(int64_t x, int64_t n) {
    int64_t up = (x + 63) & ~(int64_t)63;
    return up < n ? up : n;
}

/* The elements [lo, hi) of the rows laid end to end. Every element's step depends only on
 * its own values and its index in its tensor, so any cut gives the same bits. */
static void run_span(int strategy, int flags, int64_t count, const int64_t *table,
                     const float *h, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int64_t t = 0; t < count && base < hi; t++) {
        const int64_t *row = table + t * T_COLS;
        int64_t n = row[T_N];
        int64_t begin = row_cut(lo > base ? lo - base : 0, n);
        int64_t end = row_cut(hi - base, n);
        if (begin < end) run_piece(0, strategy, flags, h, row, begin, end, NULL);
        base += n;
    }
}

/* collage_adamw on up to ``threads`` threads (contiguous spans of about equal element
 * counts, at least MIN_CHUNK each). Built with OpenMP and loaded into a process whose torch
 * uses GNU OpenMP, the loader binds this library to torch's libgomp (one soname): the
 * threads are torch's own, already awake after the backward pass, instead of a second pool
 * competing with them for the cores. */
int collage_adamw_threads(int strategy, int flags, int64_t count, const int64_t *table,
                          const float *h, int threads) {
    if (strategy < S_FP32 || strategy > S_SPLIT) return -1;
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += table[t * T_COLS + T_N];
#ifdef _OPENMP
    int64_t parts = thread_parts(total, threads);
    if (parts > 1) {
#pragma omp parallel for num_threads((int)parts) schedule(static, 1)
        for (int64_t p = 0; p < parts; p++)
            run_span(strategy, flags, count, table, h, total * p / parts,
                     total * (p + 1) / parts);
        return 0;
    }
#else
    (void)threads; /* one thread without OpenMP */
#endif
    run_span(strategy, flags, count, table, h, 0, total);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* test hook: the kernels' bf16 stochastic rounding on its own                            */
/* ------------------------------------------------------------------------------------ */

/* out[j] = bf16 stochastic rounding of x[j] with the draw of element ``first + j``
 * (fused.counter_uniform keyed by key0, key1): with ``pairs``, v_stochastic2 on whole
 * blocks of 32 (the kernels' 32-wide path); v_stochastic on whole vectors of 16 (the
 * 16-wide path); bf_stochastic on the tail (and everywhere in the portable build). For
 * tests. */
int collage_stochastic_round(const float *x, int64_t n, int64_t first, int64_t key0,
                             int64_t key1, uint16_t *out, int pairs) {
    int64_t j = 0;
#if COLLAGE_AVX512
    const __m512i even = v_even_offsets(), odd = v_odd_offsets();
    for (; pairs && j + 32 <= n; j += 32) {
        __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
        vpair v = {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b)};
        __m512i he, ho;
        v_hash2(first + j, key0, key1, &he, &ho);
        _mm512_storeu_si512(out + j, v_stochastic2(v, he, ho));
    }
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(out + j),
                            v_stochastic(_mm512_loadu_ps(x + j), v_draw16(first + j, key0,
                                                                            key1)));
#else
    (void)pairs; /* the portable build rounds every element on the scalar path */
#endif
    for (; j < n; j++)
        out[j] = bf_stochastic(x[j], uniform((uint32_t)(first + j), (uint32_t)key0,
                                             (uint32_t)key1));
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* step counters (collage.optim.native_plan)                                              */
/* ------------------------------------------------------------------------------------ */

/* The optimizer's per-parameter step counters, float32 scalars at the addresses
 * ``steps[0 .. count)``: if every one holds ``expected``, each becomes ``expected + 1``
 * and 0 is returned; otherwise nothing is written and 1 is returned (someone changed a
 * counter: the caller takes its general path). float32 counts exactly up to 2**24, as
 * torch's own counters do. One pass in C instead of a torch op per counter. */
int collage_advance_steps(int64_t count, const int64_t *steps, float expected) {
    for (int64_t t = 0; t < count; t++)
        if (*(const float *)steps[t] != expected) return 1;
    for (int64_t t = 0; t < count; t++) *(float *)steps[t] = expected + 1.0f;
    return 0;
}

/* The stochastic draws' key words of every row of a plan's table (``count`` rows of
 * T_COLS) at ``step``: fused.stochastic_key in C. ``states[t]``: base._mix's 64-bit state
 * after the seed and row t's parameter position (kept by the plan); the step is mixed in
 * with the same splitmix64 round, the result masked to 63 bits and split into key0 (the
 * low 32 bits minus 2**31) and key1 (the next 31). About 3 us per tensor in Python. */
void collage_stochastic_keys(int64_t count, int64_t *table, const uint64_t *states,
                             int64_t step) {
    for (int64_t t = 0; t < count; t++) {
        uint64_t h = (states[t] ^ (uint64_t)step) * 0xBF58476D1CE4E5B9ull;
        h = (h ^ (h >> 31)) * 0x94D049BB133111EBull;
        h ^= h >> 29;
        h &= 0x7FFFFFFFFFFFFFFFull;
        table[t * T_COLS + T_KEY0] = (int64_t)(h & 0xFFFFFFFFull) - ((int64_t)1 << 31);
        table[t * T_COLS + T_KEY1] = (int64_t)((h >> 32) & 0x7FFFFFFFull);
    }
}

/* ------------------------------------------------------------------------------------ */
/* the non-finite check of nonfinite="skip"/"raise": does any element overflow?          */
/* ------------------------------------------------------------------------------------ */

/* 1 if any of x[begin, end) is inf or nan: the exponent field all ones. Branch-free, so the
 * compiler vectorises it; the whole span is read (no early exit: the verdict is rare). */
static int span_nonfinite(const void *x, int wide, int64_t begin, int64_t end) {
    unsigned bad = 0;
    if (wide) {
        const uint32_t *u = (const uint32_t *)x;
        for (int64_t i = begin; i < end; i++) bad |= (u[i] & 0x7F800000u) == 0x7F800000u;
    } else {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t i = begin; i < end; i++) bad |= (h[i] & 0x7F80u) == 0x7F80u;
    }
    return bad != 0;
}

/* Elements [lo, hi) of the tensors laid end to end (``table``: pointer, length pairs). */
static int pieces_nonfinite(int wide, int64_t count, const int64_t *table, int64_t lo,
                            int64_t hi) {
    int bad = 0;
    int64_t base = 0;
    for (int64_t t = 0; t < count && base < hi; t++) {
        int64_t n = table[2 * t + 1];
        int64_t begin = lo > base ? lo - base : 0, end = hi - base < n ? hi - base : n;
        if (begin < end) bad |= span_nonfinite((const void *)table[2 * t], wide, begin, end);
        base += n;
    }
    return bad;
}

/* 1 if any element of ``count`` tensors (``table``: data pointer and element count pairs;
 * float32 when ``wide``, else bf16) is inf or nan, else 0; on up to ``threads`` threads. */
int collage_nonfinite(int wide, int64_t count, const int64_t *table, int threads) {
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += table[2 * t + 1];
#ifdef _OPENMP
    int64_t parts = thread_parts(total, threads);
    int bad = 0;
    if (parts > 1) {
#pragma omp parallel for num_threads((int)parts) schedule(static, 1) reduction(| : bad)
        for (int64_t p = 0; p < parts; p++)
            bad |= pieces_nonfinite(wide, count, table, total * p / parts,
                                    total * (p + 1) / parts);
        return bad;
    }
#else
    (void)threads; /* one thread without OpenMP */
#endif
    return pieces_nonfinite(wide, count, table, 0, total);
}
