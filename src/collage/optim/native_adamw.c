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
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define COLLAGE_AVX512 1
#else
#define COLLAGE_AVX512 0
#endif

#define COLLAGE_ABI 1

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
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
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

/* one element of any strategy (constant S, G32: specialised by inlining) */
static inline __attribute__((always_inline)) void scalar_element(
    const int S, const int G32, int flags, const float *h, const int64_t *row, int64_t i) {
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
    switch (S) {
    case S_FP32: {
        float *w = (float *)row[T_W];
        w[i] = (decay ? w[i] * h[H_DECAY] : w[i]) + u;
        break;
    }
    case S_MIXED: {
        float *master = (float *)row[T_X];
        float W = (decay ? master[i] * h[H_DECAY] : master[i]) + u;
        master[i] = W;
        wb[i] = bf_round(W);
        break;
    }
    case S_BF16: {
        float W = bf_load(wb[i]);
        wb[i] = bf_round((decay ? W * h[H_DECAY] : W) + u);
        break;
    }
    case S_STOCHASTIC: {
        float W = bf_load(wb[i]);
        float draw = uniform((uint32_t)(row[T_INDEX] + i), (uint32_t)row[T_KEY0],
                             (uint32_t)row[T_KEY1]);
        wb[i] = bf_stochastic((decay ? W * h[H_DECAY] : W) + u, draw);
        break;
    }
    case S_KAHAN: {
        float W = bf_load(wb[i]);
        /* decay == 1: the foreach path adds the update to +0 (a -0 update becomes +0) */
        float increment = (decay ? (-W) * h[H_LR_WD] : 0.0f) + u;
        float corrected = increment + bf_load(xb[i]);
        uint16_t hi = bf_round(W + corrected);
        float hf = bf_load(hi);
        wb[i] = hi;
        xb[i] = finite_bits(u_of(hf)) ? bf_round(corrected - (hf - W)) : 0;
        break;
    }
    case S_LIGHT:
    case S_PLUS: {
        float W = bf_load(wb[i]) + bf_load(xb[i]);
        float nw = (decay ? W * h[H_DECAY] : W) + u;
        uint16_t hi = bf_round(nw);
        float hf = bf_load(hi);
        wb[i] = hi;
        xb[i] = finite_bits(u_of(hf)) ? bf_round(nw - hf) : 0;
        break;
    }
    case S_SPLIT: {
        float W = split_decode(wb[i], xb[i]);
        split_encode((decay ? W * h[H_DECAY] : W) + u, &wb[i], &xb[i]);
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
}

static inline __attribute__((always_inline)) void scalar_range(
    const int S, const int G32, int flags, const float *h, const int64_t *row,
    int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) scalar_element(S, G32, flags, h, row, i);
}

/* ------------------------------------------------------------------------------------ */
/* AVX-512: the same operations on 16 lanes                                               */
/* ------------------------------------------------------------------------------------ */

#if COLLAGE_AVX512

typedef struct {
    __m512 lerp, beta2, omb2, bc2s, eps, neg_step, decay, lr_wd, scale;
    __m512i sign;          /* 0x80000000 to negate the gradient (maximize), else 0 */
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

static inline __m512i v_mix32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline __m512 v_uniform(int64_t first, int64_t key0, int64_t key1) {
    __m512i index = _mm512_add_epi32(
        _mm512_set1_epi32((int)(uint32_t)first),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i hsh = v_mix32(_mm512_xor_si512(index, _mm512_set1_epi32((int)(uint32_t)key0)));
    hsh = v_mix32(_mm512_xor_si512(hsh, _mm512_set1_epi32((int)(uint32_t)key1)));
    __m512i top = _mm512_srli_epi32(hsh, 8);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(top), _mm512_set1_ps(0x1p-24f));
}

static inline __attribute__((always_inline)) __m256i v_stochastic(
    __m512 x, __m512 draw, const int exact, __mmask16 *bad) {
    __m512 zero = _mm512_setzero_ps();
    __m512 nearest = v_widen(v_round(x, exact, bad));
    __m512 error = _mm512_sub_ps(x, nearest);
    __mmask16 finite = v_finite(nearest);
    __m512i bits = _mm512_maskz_mov_epi32(finite, _mm512_castps_si512(nearest));
    __mmask16 err_pos = _mm512_cmp_ps_mask(error, zero, _CMP_GT_OQ);
    __mmask16 near_pos = _mm512_cmp_ps_mask(nearest, zero, _CMP_GT_OQ);
    __mmask16 near_zero = _mm512_cmp_ps_mask(nearest, zero, _CMP_EQ_OQ);
    __mmask16 away = (__mmask16)(~(err_pos ^ near_pos) | near_zero);
    __m512i step = _mm512_mask_mov_epi32(_mm512_set1_epi32((int)0xFFFF0000u), away,
                                         _mm512_set1_epi32(0x10000));
    __mmask16 err_neg = _mm512_cmp_ps_mask(error, zero, _CMP_LT_OQ);
    __m512i tiny = _mm512_mask_mov_epi32(_mm512_set1_epi32(0x10000), err_neg,
                                         _mm512_set1_epi32((int)0x80010000u));
    __m512 neighbour = _mm512_castsi512_ps(
        _mm512_mask_mov_epi32(_mm512_add_epi32(bits, step), near_zero, tiny));
    __m512 spacing = _mm512_abs_ps(_mm512_sub_ps(neighbour, nearest));
    /* |error| / spacing, computed exactly as a scaling: adjacent bf16 values differ by a
     * power of two, so dividing by it is x * 2**-getexp(spacing), one rounding (only when
     * the quotient is subnormal), as the division rounds. An infinite spacing (overflow) is
     * masked below. */
    __m512 probability = _mm512_scalef_ps(_mm512_abs_ps(error),
                                          _mm512_sub_ps(zero, _mm512_getexp_ps(spacing)));
    __mmask16 take = _mm512_cmp_ps_mask(draw, probability, _CMP_LT_OQ)
                     & _mm512_cmp_ps_mask(error, zero, _CMP_NEQ_OQ)
                     & v_finite(spacing) & finite;
    __m512 out = _mm512_mask_mov_ps(nearest, take, neighbour);
    return v_narrow(_mm512_srli_epi32(_mm512_castps_si512(out), 16));
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
    __m512 w32, m32, v32;
} vout;

static inline __attribute__((always_inline)) __mmask16 vector_land(
    const int S, const int exact, const vcoeffs *c, vrow r, int64_t i,
    __m512 m, __m512 v, __m512 u, __m512 W, __m512 X, __m512i w16, __m512i x16, vout *o) {
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
                            v_uniform(r.index + i, r.key0, r.key1), exact, &bad);
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
    case S_SPLIT: { /* w16, x16: the bf16 weight and the low bits, zero-extended */
        __m512i half = _mm512_set1_epi32(0x8000);
        /* w - (low > 0x8000): the all-ones mask is -1 */
        __m512i up = _mm512_movm_epi32(_mm512_cmpgt_epu32_mask(x16, half));
        __m512 Wd = _mm512_castsi512_ps(
            _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(w16, up), 16), x16));
        Wd = _mm512_mask_mul_ps(Wd, c->decays, Wd, c->decay);
        __m512i bits = _mm512_castps_si512(_mm512_add_ps(Wd, u));
        __m512i l = _mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF));
        __m512i top = _mm512_sub_epi32(_mm512_srli_epi32(bits, 16),
                                       _mm512_movm_epi32(_mm512_cmpgt_epu32_mask(l, half)));
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

static inline __attribute__((always_inline)) void vector_block(
    const int S, const int G32, const int SCALED, const vcoeffs *c, vrow r, int64_t i,
    __mmask16 k) {
    /* flags as data, no branch: the sign to flip, the lanes (all or none) that decay, the
     * lerp formula chosen by a blend */
    __m512 g = G32 ? v_load_f32(r.g, i, k) : v_load_bf(r.g, i, k);
    if (SCALED) g = _mm512_div_ps(g, c->scale);
    g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c->sign));
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
    /* lerp: fma(w, g - m, m) when w < 0.5, else fma(w - 1, g - m, g) */
    m = _mm512_fmadd_ps(c->lerp, _mm512_sub_ps(g, m), _mm512_mask_blend_ps(c->small, g, m));
    v = _mm512_fmadd_ps(_mm512_mul_ps(g, c->omb2), g, _mm512_mul_ps(v, c->beta2));
    __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c->bc2s), c->eps);
    __m512 u = _mm512_div_ps(_mm512_mul_ps(m, c->neg_step), den);
    void *wp = r.w, *xp = r.x;
    __m512 W = _mm512_setzero_ps(), X = _mm512_setzero_ps();
    __m512i w16 = _mm512_setzero_si512(), x16 = _mm512_setzero_si512();
    switch (S) {
    case S_FP32: W = v_load_f32(wp, i, k); break;
    case S_MIXED: W = v_load_f32(xp, i, k); break;
    case S_BF16:
    case S_STOCHASTIC: W = v_load_bf(wp, i, k); break;
    case S_KAHAN:
        W = v_load_bf(wp, i, k);
        X = v_load_bf(xp, i, k);
        break;
    case S_LIGHT:
    case S_PLUS: W = _mm512_add_ps(v_load_bf(wp, i, k), v_load_bf(xp, i, k)); break;
    case S_SPLIT:
        w16 = _mm512_cvtepu16_epi32(v_load16(wp, i, k));
        x16 = _mm512_cvtepu16_epi32(v_load16(xp, i, k));
        break;
    }
    vout o;
    if (__builtin_expect(vector_land(S, 0, c, r, i, m, v, u, W, X, w16, x16, &o) != 0, 0))
        vector_land(S, 1, c, r, i, m, v, u, W, X, w16, x16, &o);
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

static inline __attribute__((always_inline)) void vector_range(
    const int S, const int G32, int flags, const float *h, const int64_t *row,
    int64_t begin, int64_t end) {
    vcoeffs c;
    int small = (flags & F_LERP_SMALL) != 0;
    c.lerp = _mm512_set1_ps(small ? h[H_LERP] : h[H_LERP] - 1.0f);
    c.small = small ? (__mmask16)0xFFFF : 0;
    c.decays = (flags & F_DECAY) ? (__mmask16)0xFFFF : 0;
    c.sign = _mm512_set1_epi32((flags & F_MAXIMIZE) ? (int)0x80000000u : 0);
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
    int64_t i = begin;
    if (flags & F_SCALED) {
        for (; i + 16 <= end; i += 16) vector_block(S, G32, 1, &c, r, i, (__mmask16)0xFFFF);
        if (i < end)
            vector_block(S, G32, 1, &c, r, i, (__mmask16)((1u << (end - i)) - 1u));
    } else {
        for (; i + 16 <= end; i += 16) vector_block(S, G32, 0, &c, r, i, (__mmask16)0xFFFF);
        if (i < end)
            vector_block(S, G32, 0, &c, r, i, (__mmask16)((1u << (end - i)) - 1u));
    }
}

#define RANGE vector_range
#else
#define RANGE scalar_range
#endif

/* ------------------------------------------------------------------------------------ */
/* entry point                                                                            */
/* ------------------------------------------------------------------------------------ */

#define CASE(S)                                                                           \
    case S:                                                                               \
        if (g32) RANGE(S, 1, flags, h, row, 0, row[T_N]);                                 \
        else RANGE(S, 0, flags, h, row, 0, row[T_N]);                                     \
        break;

/* Step ``count`` tensors (rows of ``table``, T_COLS int64 each) of one strategy with the
 * coefficients ``h`` (H_COUNT floats) and ``flags``. Returns 0, or -1 for an unknown
 * strategy (nothing written). */
int collage_adamw(int strategy, int flags, int64_t count, const int64_t *table,
                  const float *h) {
    if (strategy < S_FP32 || strategy > S_SPLIT) return -1;
    int g32 = (flags & F_GRAD_FP32) != 0;
    for (int64_t t = 0; t < count; t++) {
        const int64_t *row = table + t * T_COLS;
        switch (strategy) {
            CASE(S_FP32)
            CASE(S_MIXED)
            CASE(S_BF16)
            CASE(S_KAHAN)
            CASE(S_STOCHASTIC)
            CASE(S_LIGHT)
            CASE(S_PLUS)
            CASE(S_SPLIT)
        }
    }
    return 0;
}
