/* The AdamW step on VL lanes (simd.h: 8 with AVX2, 4 with NEON), one source for every
 * width: the same float32 operations per element as step.h's scalar_element, so the same
 * bits as the scalar build, the AVX-512 one and the foreach path (#40). Included by step.h
 * only, where simd.h found a vector target and AVX-512 is absent.
 *
 * Two layouts, as step_avx512.h's two widths:
 *   pair_block   2 VL elements as even and odd halves (simd.h's pair layout): every
 *                strategy with bf16 weights and states, whose bf16 words split and pack
 *                with a shift and a mask instead of conversions
 *   plain_block  VL elements in order: fp32 and mixed (float32 states)
 * A row's last elements (fewer than a block) take scalar_element: the reference itself.
 *
 * Rounding is bf_round's integer form on every lane: x86's vcvtneps2bf16 needs AVX512-BF16
 * or AVX-NE-CONVERT, which most AVX2 CPUs lack, and reads subnormals as zero
 * (step_avx512.h redoes such blocks); AArch64's BFCVT is optional (FEAT_BF16). Results
 * rounded to bf16 stay widened (their bits in the
 * high halves, the low halves zero): the float value for the next operation is then a
 * reinterpretation, and packing is a shift. */

#ifndef COLLAGE_STEP_VECTOR_H
#define COLLAGE_STEP_VECTOR_H

#include "rounding_vector.h"
#include "simd.h"

/* LEAN: 1 in a lean chunk (see lean_chunk), 0 in the exact code */

/* the step's coefficients as vectors (filled once per row by vector_range) */
typedef struct {
    vf lerp, beta2, omb2, bc2s, rbc2s, eps, neg_step, decay, lr_wd, scale;
    vu sign;   /* 0x80000000 to negate the gradient (maximize), else 0 */
    vi small;  /* all ones: lerp weight < 0.5 (fma(w, g - m, m)), else fma(w - 1, g - m, g) */
    vi decays; /* all ones: decay != 1 */
    /* stochastic: products[l][h] lane j = (l ^ (2 j + h)) * C1 (g_hash_block) */
    vu products[2 * VL][2];
} gcoeffs;

/* One table row in locals (stores through the row's pointers cannot alias the table). */
typedef struct {
    void *w, *g, *m, *v, *vlo, *x;
    int64_t index, key0, key1;
} grow_t;

#include "lean_vector.h"    /* (reads grow_t) */
#include "measure_vector.h" /* (reads gcoeffs) */
#include "land_vector.h"    /* (reads gcoeffs) */

/* ------------------------------------------------------------------------------------ */
/* the step of one vector                                                                 */
/* ------------------------------------------------------------------------------------ */

/* root / bc2s correctly rounded without the divider: rounding.h's v_over_bc2s (the proof
 * and its tests are there), lane by lane */
static inline __attribute__((always_inline)) vf g_over_bc2s(const int LEAN, const gcoeffs *c,
                                                           vf root) {
    vf q = root * c->rbc2s;
    vf corrected = v_fma(-v_fma(q, c->bc2s, -root), c->rbc2s, q);
    if (LEAN) return corrected; /* root finite: see lean_chunk */
    return v_select((vi)(root < __builtin_inff()), corrected, root);
}

/* The AdamW moments from the gradient ``g``: ``m`` and ``v`` updated (step.h's formulas,
 * in its order) */
static inline __attribute__((always_inline)) void g_moments(const int LEAN, const int SCALED,
                                                           const gcoeffs *c, vf g, vf *m,
                                                           vf *v) {
    if (SCALED) g = g / c->scale;
    g = f_bits(u_bits(g) ^ c->sign);
    /* the lerp's base, m or g by a mask that is the same on every lane: a blend, or in
     * LEAN blocks (a lerp weight below 0.5: lean_call) m itself */
    vf base = LEAN ? *m : v_select(c->small, *m, g);
    *m = v_fma(c->lerp, g - *m, base);
    *v = v_fma(g * c->omb2, g, *v * c->beta2);
}

/* The update u from the new m and the square root of the new v (step.h's formula) */
static inline __attribute__((always_inline)) vf g_update_root(const int LEAN, const int BC1,
                                                             const gcoeffs *c, vf m,
                                                             vf root) {
    if (!BC1) root = g_over_bc2s(LEAN, c, root); /* x / 1 == x: see step_avx512.h's v_adam */
    return (m * c->neg_step) / (root + c->eps);
}

/* The AdamW step from the gradient ``g``: ``m`` and ``v`` updated, the update u returned */
static inline __attribute__((always_inline)) vf g_adam(const int LEAN, const int SCALED,
                                                      const int BC1, const gcoeffs *c, vf g,
                                                      vf *m, vf *v) {
    g_moments(LEAN, SCALED, c, g, m, v);
    return g_update_root(LEAN, BC1, c, *m, v_sqrt(*v));
}

/* ------------------------------------------------------------------------------------ */
/* blocks                                                                                 */
/* ------------------------------------------------------------------------------------ */

/* VL elements in order from ``i``: fp32 and mixed (float32 weight or master and states) */
static inline __attribute__((always_inline)) void plain_block(
    const int S, const int G32, const int SCALED, const int MEAS, const gcoeffs *c,
    const grow_t *r, int64_t i, gacc *a) {
    vf g = G32 ? v_load_f32(r->g, i) : v_load_bf(r->g, i);
    vf m = v_load_f32(r->m, i), v = v_load_f32(r->v, i);
    vf u = g_adam(0, SCALED, 0, c, g, &m, &v);
    /* fp32: the weight; mixed: the float32 master (V: the bf16 weight, measured) */
    vf W = v_load_f32(S == S_FP32 ? r->w : r->x, i);
    vf V = S == S_MIXED && MEAS ? v_load_bf(r->w, i) : v_splat(0.0f);
    gout o;
    g_land_weight(0, S, c, u, W, v_splat(0.0f), &o);
    g_land_states(0, S, m, v, &o);
    if (MEAS) {
        vf zero = v_splat(0.0f);
        g_measure(S, c, u, W, V, zero, o.w32, S == S_MIXED ? f_bits(o.w) : zero, zero, a);
    }
    if (S == S_FP32) {
        v_store_f32(r->w, i, o.w32);
    } else {
        v_store_f32(r->x, i, o.w32);
        v_store_bf(r->w, i, o.w);
    }
    v_store_f32(r->m, i, o.m32);
    v_store_f32(r->v, i, o.v32);
}

/* The hashes of the 2 VL elements ``first + 0 ..``, even (``*ze``) and odd (``*zo``).
 * Where ``first`` is a multiple of 2 VL (every block of a row that starts so), the first
 * round's product is a table lookup, exactly (stochastic.h's v_hash2 says why): with B1 =
 * B ^ (B >> 16), B = first ^ key0, and l its low bits below 2 VL, the product of lane j
 * is (B1 - l) * C1 + (l ^ offset_j) * C1 mod 2**32, the second term c->products[l]. */
static inline __attribute__((always_inline)) void g_hash_block(const gcoeffs *c,
                                                               uint32_t first,
                                                               const grow_t *r, vu *ze,
                                                               vu *zo) {
    uint32_t key0 = (uint32_t)r->key0, key1 = (uint32_t)r->key1;
    if ((first & (2 * VL - 1)) != 0) {
        vu index = first + (v_lanes() << 1);
        *ze = g_hash(index, key0, key1);
        *zo = g_hash(index + 1u, key0, key1);
        return;
    }
    uint32_t b = first ^ key0;
    b ^= b >> 16;
    uint32_t l = b & (2 * VL - 1), scaled = (b - l) * MIX32_C1;
    *ze = g_hash_rounds(scaled + c->products[l][0], key1);
    *zo = g_hash_rounds(scaled + c->products[l][1], key1);
}

/* A pair block runs as two passes, and the row loop runs each pass over a chunk of blocks
 * (pair_chunk): pass 1 steps the moments and keeps the update u in float32, pass 2 lands
 * the weights. Why: one block's chain of dependent operations (the loads, the moments, the
 * root and the division, then the landing's two or three roundings) is longer than the
 * out-of-order window of an AVX2 core covers, so one pass per block left the core waiting
 * on the divider's results with the landing's integer work queued behind them (AMD Zen 3:
 * light 1.72 ns per element in one pass, 1.31 in two). Each pass alone is shorter, and its
 * blocks are independent. Each pass is in two stages besides, and pair_chunk runs a
 * block's first stage beside the block before's second (software pipelining): a pass's
 * chain was still longer than the window lets the core look ahead past (llvm-mca -mcpu=
 * znver3: pass 1 27 cycles a block where its pipes ask 16, pass 2 18 where they ask 10),
 * and the stages' chains are about half as long (light 1.23 -> 1.02 ns per element, 65,536
 * elements on one core). The operations and their order per element are unchanged: the
 * same bits. */

/* Pass 1's first stage: the moments of the 2 VL elements from ``i`` (even and odd halves)
 * stepped and stored; the new m and the root of the new v */
typedef struct {
    vpair m, root;
} gmoments;

static inline __attribute__((always_inline)) gmoments pair_moments_stepped(
    const int LEAN, const int S, const int G32, const int SCALED, const gcoeffs *c,
    const grow_t *r, int64_t i) {
    vpair g = G32 ? v_load_pair_f32(r->g, i) : v_load_pair(r->g, i);
    gmoments out;
    out.m = v_load_pair(r->m, i);
    vpair v = v_load_pair(r->v, i);
    if (S == S_PLUS || S == S_SPLIT) {
        vpair lo = v_load_pair(r->vlo, i);
        v.e += lo.e;
        v.o += lo.o;
    }
    g_moments(LEAN, SCALED, c, g.e, &out.m.e, &v.e);
    g_moments(LEAN, SCALED, c, g.o, &out.m.o, &v.o);
    gout e, o;
    g_land_states(LEAN, S, out.m.e, v.e, &e);
    g_land_states(LEAN, S, out.m.o, v.o, &o);
    v_store_words(r->m, i, v_pack(e.m, o.m));
    v_store_words(r->v, i, v_pack(e.v, o.v));
    if (S == S_PLUS || S == S_SPLIT) v_store_words(r->vlo, i, v_pack(e.vlo, o.vlo));
    out.root.e = v_sqrt(v.e);
    out.root.o = v_sqrt(v.o);
    return out;
}

/* Pass 1's second stage: the updates */
static inline __attribute__((always_inline)) vpair pair_update(const int LEAN, const int BC1,
                                                               const gcoeffs *c, gmoments s) {
    vpair u = {g_update_root(LEAN, BC1, c, s.m.e, s.root.e),
               g_update_root(LEAN, BC1, c, s.m.o, s.root.o)};
    return u;
}

/* The weight a half's step reads (float32), and what its lost-update terms read besides:
 * the visible weight and the second part before */
typedef struct {
    vf W, V, X;
} gbefore;

/* ``Wv``, ``Xv``: a half's loaded weight and second part (split: the widened weight word
 * and low bits) */
static inline __attribute__((always_inline)) gbefore g_before(const int S, vf Wv, vf Xv) {
    vf zero = v_splat(0.0f);
    gbefore b = {Wv, zero, zero};
    switch (S) {
    case S_KAHAN: b.X = Xv; break;
    case S_LIGHT:
    case S_PLUS: /* W: hi + lo */
        b.V = Wv;
        b.X = Xv;
        b.W = Wv + Xv;
        break;
    case S_SPLIT:
        b.V = Wv;
        b.W = g_split_decode(u_bits(Wv), u_bits(Xv));
        break;
    default: break;
    }
    return b;
}

static inline __attribute__((always_inline)) void pair_measure(const int S, const gcoeffs *c,
                                                               vf u, gbefore b, const gout *o,
                                                               gacc *a) {
    vf zero = v_splat(0.0f);
    g_measure(S, c, u, b.W, b.V, b.X, S == S_SPLIT ? o->w32 : zero, f_bits(o->w),
              PAIR(S) ? f_bits(o->x) : zero, a);
}

/* Pass 2's first stage: the weights of the 2 VL elements from ``i`` loaded and their
 * landings' inputs with the updates ``u`` (``be``, ``bo``: what the halves read), and
 * stochastic's hashes (integer work beside the float work: 1-1.5 % on Zen 3) */
typedef struct {
    gland e, o;
    vu ze, zo; /* stochastic: the even and odd halves' hashes */
} gland2;

static inline __attribute__((always_inline)) gland2 pair_land_input(
    const int S, const gcoeffs *c, const grow_t *r, int64_t i, vpair u, gbefore *be,
    gbefore *bo) {
    vpair w = v_load_pair(r->w, i), x = {v_splat(0.0f), v_splat(0.0f)};
    if (S != S_BF16 && S != S_STOCHASTIC) x = v_load_pair(r->x, i);
    *be = g_before(S, w.e, x.e);
    *bo = g_before(S, w.o, x.o);
    gland2 in = {g_land_input(S, c, u.e, be->W, be->X), g_land_input(S, c, u.o, bo->W, bo->X),
                 {0}, {0}};
    if (S == S_STOCHASTIC) g_hash_block(c, (uint32_t)(r->index + i), r, &in.ze, &in.zo);
    return in;
}

/* Pass 2's second stage: the landings rounded (``e``, ``o``) and stored */
static inline __attribute__((always_inline)) void pair_land_output(
    const int LEAN, const int S, const grow_t *r, int64_t i, gland2 in, gout *e, gout *o) {
    g_land_round(LEAN, S, in.e, e);
    g_land_round(LEAN, S, in.o, o);
    vu words;
    if (S == S_STOCHASTIC) {
        vpair nw = {e->w32, o->w32};
        words = g_stochastic2(nw, in.ze, in.zo);
        e->w = words << 16;
        o->w = words & 0xFFFF0000u;
    } else {
        words = v_pack(e->w, o->w);
    }
    v_store_words(r->w, i, words);
    if (S != S_BF16 && S != S_STOCHASTIC) v_store_words(r->x, i, v_pack(e->x, o->x));
}

/* 2 VL elements from ``i`` of a strategy with bf16 weights and states (the gradient bf16,
 * or float32 with G32): every stage, one after the other (with MEAS, the lost-update terms
 * added to ``a``) */
static inline __attribute__((always_inline)) void pair_block(
    const int LEAN, const int S, const int G32, const int SCALED, const int BC1,
    const int MEAS, const gcoeffs *c, const grow_t *r, int64_t i, gacc *a) {
    vpair u = pair_update(LEAN, BC1, c, pair_moments_stepped(LEAN, S, G32, SCALED, c, r, i));
    gbefore be, bo;
    gout e, o;
    pair_land_output(LEAN, S, r, i, pair_land_input(S, c, r, i, u, &be, &bo), &e, &o);
    if (MEAS) {
        pair_measure(S, c, u.e, be, &e, a);
        pair_measure(S, c, u.o, bo, &o, a);
    }
}

/* ------------------------------------------------------------------------------------ */
/* a row                                                                                  */
/* ------------------------------------------------------------------------------------ */

/* Every stream asked for COLLAGE_PREFETCH_BYTES ahead (step_avx512.h says why and how far;
 * a prefetch changes no value and never faults) */
#ifndef COLLAGE_PREFETCH_BYTES
#define COLLAGE_PREFETCH_BYTES 1024
#endif

static inline __attribute__((always_inline)) void g_prefetch(const void *p, int64_t i,
                                                             int size) {
    if (COLLAGE_PREFETCH_BYTES > 0)
        __builtin_prefetch((const char *)((uintptr_t)p +
                                          (uintptr_t)(i * size + COLLAGE_PREFETCH_BYTES)),
                           0, 3);
}

static inline __attribute__((always_inline)) void g_row_prefetch(const int S, const int G32,
                                                                 const grow_t *r, int64_t i) {
    const int wide = S == S_FP32 || S == S_MIXED;
    g_prefetch(r->g, i, G32 ? 4 : 2);
    g_prefetch(r->m, i, wide ? 4 : 2);
    g_prefetch(r->v, i, wide ? 4 : 2);
    if (S == S_PLUS || S == S_SPLIT) g_prefetch(r->vlo, i, 2);
    g_prefetch(r->w, i, S == S_FP32 ? 4 : 2);
    if (S == S_MIXED) g_prefetch(r->x, i, 4);
    else if (S != S_FP32 && S != S_BF16 && S != S_STOCHASTIC) g_prefetch(r->x, i, 2);
}

/* The unmeasured pair blocks of [i, end), in chunks of CHUNK blocks: where ``lean``
 * (lean_call) a chunk that passes lean_chunk (its inputs read first, in one loop: the
 * passes then have no branch) is stepped LEAN, and every other chunk by the exact code;
 * each chunk pass by pass (pair_chunk; measured steps take pair_block, one block at a
 * time); returns where the blocks stop */
#define CHUNK 16

/* ``blocks`` (1 to CHUNK) pair blocks from ``i``: pass 1 over them all, the updates kept
 * (CHUNK x 2 vectors: 1 KB with AVX2, in L1), then pass 2; in each pass a block's first
 * stage is issued before the block before's second (see pair_moments_stepped) */
static inline __attribute__((always_inline)) void pair_chunk(
    const int LEAN, const int S, const int G32, const int SCALED, const int BC1,
    const gcoeffs *c, const grow_t *r, int64_t i, int64_t blocks) {
    const int64_t step = 2 * VL;
    vpair u[CHUNK];
    g_row_prefetch(S, G32, r, i);
    gmoments held = pair_moments_stepped(LEAN, S, G32, SCALED, c, r, i);
    for (int64_t k = 1; k < blocks; k++) {
        g_row_prefetch(S, G32, r, i + k * step);
        gmoments next = pair_moments_stepped(LEAN, S, G32, SCALED, c, r, i + k * step);
        u[k - 1] = pair_update(LEAN, BC1, c, held);
        held = next;
    }
    u[blocks - 1] = pair_update(LEAN, BC1, c, held);
    gbefore be, bo; /* (unread: no step here is measured) */
    gout e, o;
    gland2 landing = pair_land_input(S, c, r, i, u[0], &be, &bo);
    for (int64_t k = 1; k < blocks; k++) {
        gland2 next = pair_land_input(S, c, r, i + k * step, u[k], &be, &bo);
        pair_land_output(LEAN, S, r, i + (k - 1) * step, landing, &e, &o);
        landing = next;
    }
    pair_land_output(LEAN, S, r, i + (blocks - 1) * step, landing, &e, &o);
}

static inline __attribute__((always_inline)) int64_t pair_loop(
    const int S, const int G32, const int SCALED, const int BC1, const gcoeffs *c,
    const grow_t *r, int lean, int64_t i, int64_t end) {
    const int64_t step = 2 * VL;
    while (i + step <= end) {
        int64_t blocks = (end - i) / step;
        if (blocks > CHUNK) blocks = CHUNK;
        if (!SCALED && lean && lean_chunk(S, G32, r, i, blocks))
            pair_chunk(1, S, G32, SCALED, BC1, c, r, i, blocks);
        else
            pair_chunk(0, S, G32, SCALED, BC1, c, r, i, blocks);
        i += blocks * step;
    }
    return i;
}

/* one block of either layout at ``i`` (ELEMS elements) */
#define G_PAIRED(S) ((S) != S_FP32 && (S) != S_MIXED)

static inline __attribute__((always_inline)) void g_block(
    const int S, const int G32, const int SCALED, const int BC1, const int MEAS,
    const gcoeffs *c, const grow_t *r, int64_t i, gacc *a) {
    if (G_PAIRED(S)) pair_block(0, S, G32, SCALED, BC1, MEAS, c, r, i, a);
    else plain_block(S, G32, SCALED, MEAS, c, r, i, a);
}

/* [begin, end): whole blocks, then scalar_element for the rest; with MEAS, the lane sums
 * flushed every VL * SUM_BLOCK elements (SUM_BLOCK terms per lane) and the row's sums
 * written to ``out`` */
static inline __attribute__((always_inline)) void g_loop(
    const int S, const int G32, const int SCALED, const int BC1, const int MEAS,
    const gcoeffs *c, const grow_t *r, int flags, const float *h, const int64_t *row,
    int64_t begin, int64_t end, double *out) {
    const int64_t step = G_PAIRED(S) ? 2 * VL : VL;
    int64_t i = begin;
    if (!MEAS && G_PAIRED(S))
        i = pair_loop(S, G32, SCALED, BC1, c, r, lean_call(flags, h), i, end);
    if (!MEAS) {
        for (; i + step <= end; i += step) {
            g_row_prefetch(S, G32, r, i);
            g_block(S, G32, SCALED, BC1, 0, c, r, i, NULL);
        }
        for (; i < end; i++) scalar_element(S, G32, 0, flags, h, row, i, NULL, NULL);
        return;
    }
    totals t = {{0}, 0, 0, 0};
    gacc a;
    g_acc_clear(&a);
    for (; i + VL * SUM_BLOCK <= end; i += VL * SUM_BLOCK) {
#pragma GCC unroll 1
        for (int64_t j = 0; j < VL * SUM_BLOCK; j += step) {
            g_row_prefetch(S, G32, r, i + j);
            g_block(S, G32, SCALED, 0, 1, c, r, i + j, &a);
        }
        g_flush(&a, &t);
    }
    for (; i + step <= end; i += step) g_block(S, G32, SCALED, 0, 1, c, r, i, &a);
    g_flush(&a, &t);
    float acc[A_COUNT] = {0};
    for (; i < end; i++) scalar_element(S, G32, 1, flags, h, row, i, acc, &t);
    for (int f = 0; f < A_COUNT; f++) t.sum[f] += (double)acc[f];
    write_sums(S, &t, end - begin, out);
}

/* The unmeasured loops of the paired strategies, each variant (strategy, gradient width,
 * scaling, bias correction) a function of its own: inlined into one function per entry
 * point, with their lean and exact blocks, they made that function so large that the
 * compiler's time grew fourfold; apart, each compiles on its own. */
#define PAIRED_VARIANT(S, G32, SCALED, BC1)                                                \
    static __attribute__((noinline)) void paired_##S##_##G32##_##SCALED##_##BC1(           \
        const gcoeffs *c, const grow_t *r, int flags, const float *h, const int64_t *row, \
        int64_t begin, int64_t end) {                                                     \
        g_loop(S, G32, SCALED, BC1, 0, c, r, flags, h, row, begin, end, NULL);            \
    }
#define PAIRED_VARIANTS(S)                                                                \
    PAIRED_VARIANT(S, 0, 0, 0)                                                            \
    PAIRED_VARIANT(S, 0, 0, 1)                                                            \
    PAIRED_VARIANT(S, 0, 1, 0)                                                            \
    PAIRED_VARIANT(S, 0, 1, 1)                                                            \
    PAIRED_VARIANT(S, 1, 0, 0)                                                            \
    PAIRED_VARIANT(S, 1, 0, 1)                                                            \
    PAIRED_VARIANT(S, 1, 1, 0)                                                            \
    PAIRED_VARIANT(S, 1, 1, 1)
PAIRED_VARIANTS(S_BF16)
PAIRED_VARIANTS(S_KAHAN)
PAIRED_VARIANTS(S_STOCHASTIC)
PAIRED_VARIANTS(S_LIGHT)
PAIRED_VARIANTS(S_PLUS)
PAIRED_VARIANTS(S_SPLIT)
#undef PAIRED_VARIANTS
#undef PAIRED_VARIANT

/* the variant of S (a constant where inlined) and G32 for the runtime scaling and bias
 * correction */
#define PAIRED_CALL(S, G32)                                                               \
    do {                                                                                  \
        if (scaled && bc1) paired_##S##_##G32##_1_1(c, r, flags, h, row, begin, end);     \
        else if (scaled) paired_##S##_##G32##_1_0(c, r, flags, h, row, begin, end);       \
        else if (bc1) paired_##S##_##G32##_0_1(c, r, flags, h, row, begin, end);          \
        else paired_##S##_##G32##_0_0(c, r, flags, h, row, begin, end);                   \
    } while (0)
#define PAIRED_CASE(S)                                                                    \
    case S:                                                                               \
        if (G32) PAIRED_CALL(S, 1);                                                       \
        else PAIRED_CALL(S, 0);                                                           \
        break;

static inline __attribute__((always_inline)) void paired_loop(
    const int S, const int G32, int scaled, int bc1, const gcoeffs *c, const grow_t *r,
    int flags, const float *h, const int64_t *row, int64_t begin, int64_t end) {
    switch (S) {
        PAIRED_CASE(S_BF16)
        PAIRED_CASE(S_KAHAN)
        PAIRED_CASE(S_STOCHASTIC)
        PAIRED_CASE(S_LIGHT)
        PAIRED_CASE(S_PLUS)
        PAIRED_CASE(S_SPLIT)
    default: break;
    }
}
#undef PAIRED_CASE
#undef PAIRED_CALL

static inline __attribute__((always_inline)) void vector_range(
    const int S, const int G32, const int MEAS, int flags, const float *h,
    const int64_t *row, int64_t begin, int64_t end, double *out) {
    gcoeffs c;
    int small = (flags & F_LERP_SMALL) != 0;
    c.lerp = v_splat(small ? h[H_LERP] : h[H_LERP] - 1.0f);
    c.small = (vi){0} - small;
    c.decays = (vi){0} - ((flags & F_DECAY) != 0);
    c.sign = u_splat((flags & F_MAXIMIZE) ? 0x80000000u : 0u);
    c.beta2 = v_splat(h[H_BETA2]);
    c.omb2 = v_splat(h[H_OMB2]);
    c.bc2s = v_splat(h[H_BC2S]);
    c.rbc2s = v_splat(1.0f / h[H_BC2S]);
    c.eps = v_splat(h[H_EPS]);
    c.neg_step = v_splat(h[H_NEG_STEP]);
    c.decay = v_splat((flags & F_DECAY) ? h[H_DECAY] : 1.0f); /* see g_decayed */
    c.lr_wd = v_splat(h[H_LR_WD]);
    c.scale = v_splat(h[H_SCALE]);
    if (S == S_STOCHASTIC)
        for (uint32_t l = 0; l < 2 * VL; l++)
            for (uint32_t h = 0; h < 2; h++)
                c.products[l][h] = (l ^ ((v_lanes() << 1) + h)) * MIX32_C1;
    grow_t r = {(void *)row[T_W], (void *)row[T_G], (void *)row[T_M], (void *)row[T_V],
                (void *)row[T_VLO], (void *)row[T_X], row[T_INDEX], row[T_KEY0], row[T_KEY1]};
    /* without the division by the bias correction only where it is taken (unmeasured
     * steps of the paired strategies): other instantiations would only add build time */
    if (!MEAS && G_PAIRED(S)) {
        int bc1 = h[H_BC2S] == 1.0f, scaled = (flags & F_SCALED) != 0;
        paired_loop(S, G32, scaled, bc1, &c, &r, flags, h, row, begin, end);
    } else if (flags & F_SCALED) {
        g_loop(S, G32, 1, 0, MEAS, &c, &r, flags, h, row, begin, end, out);
    } else {
        g_loop(S, G32, 0, 0, MEAS, &c, &r, flags, h, row, begin, end, out);
    }
}

#endif /* COLLAGE_STEP_VECTOR_H */
