/* The per-element AdamW step, shared by the measured and unmeasured kernels (adamw.c,
 * measured.c): the portable build's scalar loop, the lost-update sums, and run_piece, which
 * runs a row's elements on this build's loop (step_avx512.h where the target has it).
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
 * AVX512-BF16 instruction (vcvtneps2bf16) flushes subnormal inputs to zero and keeps NaN
 * payloads, so it rounds only on the fast path, and a block with such a lane is redone
 * with integer rounding (rounding.h: v_round, v_round2).
 *
 * The AVX-512 build steps bf16-weight strategies 32 elements per iteration where it can
 * (pair_block: unmeasured steps, bf16 gradients) and 16 otherwise (vector_block); the
 * per-element operations are the same.
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

#ifndef COLLAGE_STEP_H
#define COLLAGE_STEP_H

#include "rounding.h"
#include "simd.h"
#include "stochastic.h"

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
        uint16_t lo = finite_bits(u_of(hf)) ? bf_round(corrected - (hf - W)) : 0;
        bf_normalize(&hi, &lo);
        wb[i] = hi;
        xb[i] = lo;
        r1 = v1 = bf_load(hi);
        x1 = bf_load(lo);
        break;
    }
    case S_LIGHT:
    case S_PLUS: {
        r0 = v0 = bf_load(wb[i]);
        x0 = bf_load(xb[i]);
        W = r0 + x0;
        uint16_t hi, lo;
        bf_residual_pair((decay ? W * h[H_DECAY] : W) + u, &hi, &lo);
        wb[i] = hi;
        xb[i] = lo;
        r1 = v1 = bf_load(hi);
        x1 = bf_load(lo);
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
        uint16_t vh = bf_round(v), vl;
        if (S == S_PLUS || S == S_SPLIT) {
            bf_residual_pair(v, &vh, &vl);
            ((uint16_t *)row[T_VLO])[i] = vl;
        }
        ((uint16_t *)row[T_V])[i] = vh;
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

#if COLLAGE_AVX512
#include "step_avx512.h"
#define RANGE vector_range
#elif COLLAGE_VECTOR
#include "step_vector.h"
#define RANGE vector_range
#else
#define RANGE scalar_range
#endif

/* ------------------------------------------------------------------------------------ */
/* a row's elements on this build's loop                                                  */
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

#endif /* COLLAGE_STEP_H */
