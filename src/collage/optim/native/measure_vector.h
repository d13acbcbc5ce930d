/* The lost-update sums of a measured step on VL lanes, for step_vector.h (included there
 * after its coefficients' type; step.h's sum fields, totals and strategy classes come
 * first): each lane's float32 sums of one block, flushed into the row's float64 totals
 * (step_avx512.h's vector_measure and flush, lane by lane). */

#ifndef COLLAGE_MEASURE_VECTOR_H
#define COLLAGE_MEASURE_VECTOR_H

#include "simd.h"

/* ------------------------------------------------------------------------------------ */
/* lost-update sums (measured steps)                                                      */
/* ------------------------------------------------------------------------------------ */

/* A block's float32 sums, one per lane (each lane sums at most SUM_BLOCK terms before the
 * block is flushed into float64), and its counts */
typedef struct {
    vf sum[A_COUNT];
    vi nonzero, stuck, stuck_visible; /* minus the count: compare lanes are -1 */
} gacc;

static inline void g_acc_clear(gacc *a) {
    for (int f = 0; f < A_COUNT; f++) a->sum[f] = v_splat(0.0f);
    a->nonzero = a->stuck = a->stuck_visible = (vi){0};
}

/* The lost-update terms of one vector (step_avx512.h's vector_measure, every lane full):
 * ``W`` the float32 weight the step read, ``V0`` the visible weight before, ``X0`` the
 * pair's second part before; after the step ``W1`` the float32 master (fp32, mixed, split),
 * ``v1`` the visible weight, ``x1`` the pair's second part. */
static inline __attribute__((always_inline)) void g_measure(const int S, const gcoeffs *c,
                                                            vf u, vf W, vf V0, vf X0, vf W1,
                                                            vf v1, vf x1, gacc *a) {
    vf zero = v_splat(0.0f);
    vf d = u - W * c->lr_wd;
    vf e = zero, ev = zero;
    vi stuck;
    if (S == S_FP32 || S == S_MIXED || S == S_SPLIT) e = W1 - W;
    if (S == S_BF16 || S == S_STOCHASTIC) e = v1 - W;
    if (PAIR(S)) {
        vf r0 = S == S_KAHAN ? W : V0; /* see step.h's pair_change */
        vf sum = (v1 - r0) + (x1 - X0);
        e = v_fma(sum, zero, sum); /* inf -> nan, as TwoSum's error term */
        stuck = (vi)(sum == zero);
    } else {
        stuck = (vi)(e == zero);
    }
    if (SEPARATE_VISIBLE(S)) ev = v1 - (S == S_KAHAN ? W : V0);
    vi moving = (vi)(d != zero); /* NaN moves */
    a->sum[A_DOT_ED] = v_fma(e, d, a->sum[A_DOT_ED]);
    a->sum[A_DD] = v_fma(d, d, a->sum[A_DD]);
    a->sum[A_EE] = v_fma(e, e, a->sum[A_EE]);
    a->nonzero += moving;
    a->stuck += moving & stuck;
    if (SEPARATE_VISIBLE(S)) {
        a->sum[A_DOT_EVD] = v_fma(ev, d, a->sum[A_DOT_EVD]);
        a->sum[A_EVEV] = v_fma(ev, ev, a->sum[A_EVEV]);
        a->stuck_visible += moving & (vi)(ev == zero);
    }
    if (PAIR(S)) a->sum[A_CC] = v_fma(x1, x1, a->sum[A_CC]);
}

/* A block's lane sums into the row's float64 totals (each lane widened exactly) */
static inline __attribute__((always_inline)) void g_flush(gacc *a, totals *t) {
    for (int f = 0; f < A_COUNT; f++)
        for (int j = 0; j < VL; j++) t->sum[f] += (double)a->sum[f][j];
    t->nonzero += v_count(a->nonzero);
    t->stuck += v_count(a->stuck);
    t->stuck_visible += v_count(a->stuck_visible);
    g_acc_clear(a);
}

#endif /* COLLAGE_MEASURE_VECTOR_H */
