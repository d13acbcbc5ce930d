/* The AdamW step on 16 lanes (vector_block) and on 32 elements (pair_block: unmeasured
 * steps of the bf16-weight strategies with bf16 gradients), the same float32 operations
 * per element as step.h's scalar_element, and the lane sums of measured steps. Included by
 * step.h only, where the target has AVX-512 (F, BW, VL). */

#ifndef COLLAGE_STEP_AVX512_H
#define COLLAGE_STEP_AVX512_H

#include "rounding.h"
#include "stochastic.h"

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
        v_normalize(&o->w, &o->x, exact, &bad);
        break;
    }
    case S_LIGHT:
    case S_PLUS: { /* W: hi + lo */
        __m512 nw = _mm512_add_ps(_mm512_mask_mul_ps(W, c->decays, W, c->decay), u);
        v_residual_pair(nw, exact, &bad, &o->w, &o->x);
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
        if (S == S_PLUS || S == S_SPLIT) v_residual_pair(v, exact, &bad, &o->v, &o->vlo);
        else o->v = v_round(v, exact, &bad);
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
    if (!BC1) root = v_over_bc2s(c, root); /* the IEEE quotient, no divider */
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
            v_normalize2(c, &o->w, &o->x, exact, &bad);
            break;
        }
#endif
        vpair lost = {_mm512_maskz_sub_ps(v_finite(hf.e), corrected.e,
                                          _mm512_sub_ps(hf.e, W.e)),
                      _mm512_maskz_sub_ps(v_finite(hf.o), corrected.o,
                                          _mm512_sub_ps(hf.o, W.o))};
        o->x = v_round2(c, lost, exact, &bad);
        v_normalize2(c, &o->w, &o->x, exact, &bad);
        break;
    }
    case S_LIGHT:
    case S_PLUS: {
        vpair nw = {v_decayed(c, W.e, u.e), v_decayed(c, W.o, u.o)};
        v_residual_pair2(c, nw, exact, &bad, &o->w, &o->x);
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
        v_residual_pair2(c, v, exact, &bad, &o->v, &o->vlo);
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

/* Why prefetch: a core steps a block about as long as its next lines take to arrive, and
 * without help the two did not overlap (the hardware prefetchers do not run far enough
 * ahead of a loop that computes this much per line): one thread, 16M bf16 elements cost
 * 0.51 ns per element with the data in L2, 0.81 in memory; two threads, ``bf16`` 0.92 ->
 * 0.54 ns per element and core with this prefetch, ``plus`` 1.17 -> 0.98 (#31,
 * docs/benchmarks/intel-xeon-2c_2026-12-05_prefetch.md). Every stream the block reads is
 * asked for COLLAGE_PREFETCH_BYTES ahead; a prefetch changes no value and never faults,
 * past a tensor's end included (the address is computed as an integer: no pointer leaves
 * its array). The distance: 16 cache lines per stream; 512 bytes gave less, 2048 about the
 * same, within 5 % (``benchmarks/studies/prefetch_distance.py``; ``-DCOLLAGE_PREFETCH_BYTES=0``
 * builds the loops without prefetching, for such A/Bs). */
#ifndef COLLAGE_PREFETCH_BYTES
#define COLLAGE_PREFETCH_BYTES 1024
#endif

static inline __attribute__((always_inline)) void v_prefetch(const void *p, int64_t i,
                                                             int size) {
    if (COLLAGE_PREFETCH_BYTES > 0)
        _mm_prefetch((const char *)((uintptr_t)p +
                                    (uintptr_t)(i * size + COLLAGE_PREFETCH_BYTES)),
                     _MM_HINT_T0);
}

/* The row's streams at element ``i``, each by its element size: the gradient, m and v
 * (float32 for fp32 and mixed), v's low part (plus, split), the weight (float32 for fp32)
 * and the second weight tensor (mixed: the float32 master; the pairs' bf16 low part). */
static inline __attribute__((always_inline)) void row_prefetch(const int S, const int G32,
                                                               vrow r, int64_t i) {
    const int wide = S == S_FP32 || S == S_MIXED;
    v_prefetch(r.g, i, G32 ? 4 : 2);
    v_prefetch(r.m, i, wide ? 4 : 2);
    v_prefetch(r.v, i, wide ? 4 : 2);
    if (S == S_PLUS || S == S_SPLIT) v_prefetch(r.vlo, i, 2);
    v_prefetch(r.w, i, S == S_FP32 ? 4 : 2);
    if (S == S_MIXED) v_prefetch(r.x, i, 4);
    else if (S != S_FP32 && S != S_BF16 && S != S_STOCHASTIC) v_prefetch(r.x, i, 2);
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
            for (; i + 32 <= end; i += 32) {
                row_prefetch(S, G32, r, i);
                pair_block(S, SCALED, BC1, 0, c, r, i, NULL, NULL);
            }
        for (; i + 16 <= end; i += 16) {
            row_prefetch(S, G32, r, i);
            vector_block(S, G32, SCALED, 0, c, r, i, full, NULL, NULL);
        }
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
            for (int j = 0; j < 16 * SUM_BLOCK; j += 32) {
                row_prefetch(S, G32, r, i + j);
                pair_block(S, SCALED, 0, 1, c, r, i + j, &a, &t);
            }
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 16 * SUM_BLOCK; j += 16) {
                row_prefetch(S, G32, r, i + j);
                vector_block(S, G32, SCALED, 1, c, r, i + j, full, &a, &t);
            }
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
    c.interleave = v_interleave();
    c.beta2 = _mm512_set1_ps(h[H_BETA2]);
    c.omb2 = _mm512_set1_ps(h[H_OMB2]);
    c.bc2s = _mm512_set1_ps(h[H_BC2S]);
    c.rbc2s = _mm512_set1_ps(1.0f / h[H_BC2S]);
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


#endif /* COLLAGE_STEP_AVX512_H */
