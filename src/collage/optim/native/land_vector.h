/* The landing of a step on VL lanes, for step_vector.h (included there after its
 * coefficients' type): the new weight into each strategy's components and the states'
 * outputs, step.h's scalar_element case by case, lane by lane.
 *
 * The weight's landing is two stages, g_land_input (the float32 values the roundings
 * start from) and g_land_round (the roundings and the residuals), so that pair_chunk can
 * compute one block's input while the block before it rounds (step_vector.h says why);
 * g_land_weight is the two in a row. */

#ifndef COLLAGE_LAND_VECTOR_H
#define COLLAGE_LAND_VECTOR_H

#include "rounding_vector.h"
#include "simd.h"

/* W * decay where decay != 1, else W itself. Without decay c->decay is 1.0f, and W * 1 is
 * W bit for bit (no flush to zero: -0, subnormals and infinities are kept) but for a
 * signalling NaN, which it quiets. The strategies that round the result to bf16 (every
 * NaN to 0xFFFF) take the product, one blend fewer; fp32, mixed and split store float32
 * bits, a NaN's payload included, and keep the blend. */
static inline __attribute__((always_inline)) vf g_decayed(const int S, const gcoeffs *c,
                                                         vf W) {
    if (S == S_BF16 || S == S_STOCHASTIC || S == S_LIGHT || S == S_PLUS) return W * c->decay;
    return v_select(c->decays, W * c->decay, W);
}

/* The outputs of one vector: bf16 ones widened, float32 ones as they are */
typedef struct {
    vu w, x, m, v, vlo; /* weight, second weight part, m, v, v's low part */
    vf w32, m32, v32;   /* fp32's weight, mixed's and split's master; fp32/mixed states */
} gout;

/* The float32 values a weight's roundings start from: ``sum`` the new weight (decayed W +
 * u), or for kahan W itself and ``corrected`` the update with its compensation */
typedef struct {
    vf sum, corrected;
} gland;

/* bf_round, or in LEAN blocks (no lane NaN) its integer form alone */
#define G_ROUND(x) (LEAN ? g_round_number(x) : g_round(x))

/* Stage 1 of the landing: W the float32 weight the step reads, X kahan's compensation */
static inline __attribute__((always_inline)) gland g_land_input(const int S, const gcoeffs *c,
                                                                vf u, vf W, vf X) {
    gland in;
    if (S == S_KAHAN) {
        /* (-W) * lr_wd, or +0 without decay (the foreach path adds u to zeros) */
        vf base = f_bits(u_bits(-W * c->lr_wd) & (vu)c->decays);
        in.sum = W;
        in.corrected = (base + u) + X;
    } else {
        in.sum = g_decayed(S, c, W) + u;
        in.corrected = v_splat(0.0f);
    }
    return in;
}

/* Stage 2: the roundings into the strategy's components (stochastic's rounding is
 * pair_land_output's, both halves at once) */
static inline __attribute__((always_inline)) void g_land_round(const int LEAN, const int S,
                                                               gland in, gout *o) {
    switch (S) {
    case S_FP32: o->w32 = in.sum; break;
    case S_MIXED:
        o->w32 = in.sum;
        o->w = g_round(o->w32);
        break;
    case S_BF16: o->w = G_ROUND(in.sum); break;
    case S_STOCHASTIC: o->w32 = in.sum; break;
    case S_KAHAN: {
        vf W = in.sum, corrected = in.corrected;
        o->w = G_ROUND(W + corrected);
        /* what the rounded add failed to land: exact (Sterbenz), +0 where hi is inf/nan */
        vf hf = f_bits(o->w);
        /* not NaN where hf is finite (then W and corrected are finite) */
        o->x = g_round_number(corrected - (hf - W));
        if (!LEAN) o->x &= ~g_special(hf);
        g_normalize_kahan(&o->w, &o->x);
        break;
    }
    case S_LIGHT:
    case S_PLUS: g_residual_pair(LEAN, in.sum, &o->w, &o->x); break;
    case S_SPLIT:
        o->w32 = in.sum;
        g_split_encode(o->w32, &o->w, &o->x);
        break;
    }
}

/* The landing of the new weight: W the float32 weight the step reads; X kahan's
 * compensation, light's and plus's lo */
static inline __attribute__((always_inline)) void g_land_weight(const int LEAN, const int S,
                                                                const gcoeffs *c, vf u, vf W,
                                                                vf X, gout *o) {
    g_land_round(LEAN, S, g_land_input(S, c, u, W, X), o);
}

/* The states' outputs: float32 (fp32, mixed) or rounded to bf16 (plus and split: v a pair) */
static inline __attribute__((always_inline)) void g_land_states(const int LEAN, const int S,
                                                                vf m, vf v, gout *o) {
    if (S == S_FP32 || S == S_MIXED) {
        o->m32 = m;
        o->v32 = v;
    } else {
        o->m = G_ROUND(m);
        if (S == S_PLUS || S == S_SPLIT) g_residual_pair(LEAN, v, &o->v, &o->vlo);
        else o->v = G_ROUND(v);
    }
}

#endif /* COLLAGE_LAND_VECTOR_H */
