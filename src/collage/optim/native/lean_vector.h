/* The lean blocks' tests, for step_vector.h (#40): which blocks and calls may take the
 * step's lean forms (LEAN: bf_round's integer form, no mask on the residuals, no guard on
 * the root, the lerp's formula compiled in), which give the exact code's bits there. */

#ifndef COLLAGE_LEAN_VECTOR_H
#define COLLAGE_LEAN_VECTOR_H

#include "simd.h"

/* Included by step_vector.h after its grow_t (a row in locals), which the tests read. */

/* Why (#40). On AVX2 the step of the bf16-weight strategies is bound by its arithmetic,
 * and on AMD Zen 3 by the two pipes that run the multiplies, which also run the blends
 * and float compares that keep the step exact for NaN and infinities: bf_round's NaN
 * lane (three per element and more), the guard of an infinite root, the lerp's choice
 * (docs/benchmarks/amd-epyc-2c_2026-12-06_avx2-kernel-experiments.md measures each). A
 * block whose inputs are finite and below 2**63 in magnitude (v's high part also not
 * negative, and v's low part no larger than it), with coefficients checked once per call
 * (lean_call), meets neither: every value of its step is then finite and no rounding
 * overflows (the bounds are in lean_call), so bf_round is its integer form, g_residual
 * needs no mask and the root's guard changes nothing; such a block takes those forms
 * (LEAN), the same bits with fewer operations. The test reads only the loaded words
 * (integer operations on any pipe), so the branch is known long before the arithmetic
 * it chooses; a block that fails it (a NaN, an infinity, a huge value) takes the exact
 * code. */

/* 2**63: the bound on every input's magnitude, as a bf16 word (exponent field 190) and a
 * float32 one */
#define LEAN_WORD 0x5F00u
#define LEAN_F32 0x5F000000u

/* the largest magnitude word of the 2 VL bf16 words at ``i`` of ``p``, lane by lane
 * (16-bit lanes), folded into ``top`` */
static inline __attribute__((always_inline)) vw lean_fold(vw top, const void *p, int64_t i,
                                                          const int SIGNED) {
    vw x = (vw)v_load_words(p, i);
    if (!SIGNED) x &= 0x7FFF; /* (a word with its sign: v's high part must be >= +0) */
    return v_max16(top, x);
}

/* Whether every block of the ``blocks`` pair blocks from ``i`` passes the lean test: the
 * magnitudes folded over the whole chunk and tested once at its end (one test and branch
 * per block instead: plus and split 2-3 % slower on Zen 3, the others within 1 %) */
static inline __attribute__((always_inline)) int lean_chunk(const int S, const int G32,
                                                            const grow_t *r, int64_t i,
                                                            int64_t blocks) {
    /* one running maximum per stream: five folds into one maximum were a chain of five
     * dependent operations per block */
    vw top_g = (vw){0}, top_m = (vw){0}, top_w = (vw){0}, top_v = (vw){0}, top_x = (vw){0};
    vu top32 = (vu){0}; /* float32 gradients' magnitudes */
    vi bad = (vi){0};   /* plus, split: a low part of v larger than its high part */
    for (int64_t k = 0; k < blocks; k++, i += 2 * VL) {
        if (G32) {
            top32 = v_max32(top32, u_bits(v_load_f32(r->g, i)) & 0x7FFFFFFFu);
            top32 = v_max32(top32, u_bits(v_load_f32(r->g, i + VL)) & 0x7FFFFFFFu);
        } else {
            top_g = lean_fold(top_g, r->g, i, 0);
        }
        top_m = lean_fold(top_m, r->m, i, 0);
        top_w = lean_fold(top_w, r->w, i, 0);
        vw vhi = (vw)v_load_words(r->v, i);
        top_v = v_max16(top_v, vhi); /* a negative v_hi (sign bit set) fails the bound */
        if (S == S_KAHAN || S == S_LIGHT || S == S_PLUS) top_x = lean_fold(top_x, r->x, i, 0);
        if (S == S_PLUS || S == S_SPLIT) {
            /* v = hi + lo >= 0 where |lo| <= hi (as integers: the order of magnitudes);
             * then |lo| is below the bound where hi is, and needs no fold of its own */
            vw lo = (vw)v_load_words(r->vlo, i) & 0x7FFF;
            bad |= (vi)(lo > vhi);
        }
    }
    vw top = v_max16(v_max16(v_max16(top_g, top_m), v_max16(top_w, top_v)), top_x);
    bad |= (vi)(top >= LEAN_WORD);
    if (G32) bad |= (vi)(top32 >= LEAN_F32);
    return !v_any(bad);
}

/* Whether this call's coefficients keep every value of a lean block's step finite and
 * its roundings from overflowing, given inputs below 2**63 in magnitude (NaN coefficients
 * fail every comparison). The bounds, for |g|, |m|, |W| < 2**63 (a pair's W < 2**64):
 * |m'| < 2**65 (|lerp| <= 1); 0 <= v' < 2**127 (g g omb2 + v beta2, each factor at most
 * 1, v >= 0 tested per block); root < 2**64 and root / bc2s < 2**94 (bc2s >= 2**-30):
 * finite, so the root's guard is idle; denom >= eps > 0; |u| <= 2**65 |neg_step| / eps
 * <= 2**100; |W decay| <= 2**65 (|decay| <= 2), kahan's |W lr_wd| too; every sum after is
 * below 2**102, far below bf16's largest finite value (about 2**128), so no rounding
 * reaches infinity and every residual x - hi is finite. A scaled gradient (GradScaler)
 * takes the exact code, as does a lerp weight of 0.5 or more (beta1 <= 0.5: rare; one
 * lean form fewer to compile). */
static inline int lean_call(int flags, const float *h) {
    float eps = h[H_EPS], step = fabsf(h[H_NEG_STEP]), lerp = h[H_LERP];
    return !(flags & F_SCALED) && (flags & F_LERP_SMALL) && eps > 0.0f &&
           step <= eps * 0x1p35f &&
           h[H_BETA2] >= 0.0f && h[H_BETA2] <= 1.0f && h[H_OMB2] >= 0.0f &&
           h[H_OMB2] <= 1.0f && lerp >= 0.0f && lerp <= 1.0f && h[H_BC2S] >= 0x1p-30f &&
           h[H_BC2S] <= 1.0f && fabsf(h[H_DECAY]) <= 2.0f && fabsf(h[H_LR_WD]) <= 2.0f;
}

#endif /* COLLAGE_LEAN_VECTOR_H */
