/* bf16 rounding on simd.h's vectors of VL lanes, for step_vector.h: rounding.h's and
 * stochastic.h's scalar helpers lane by lane (nearest even, the residual pairs and their
 * normalisation, the stochastic draws' hash and rounding, split's words), each the same
 * bits as its scalar reference. Results rounded to bf16 stay widened: their bits in the
 * high halves, the low halves zero. */

#ifndef COLLAGE_ROUNDING_VECTOR_H
#define COLLAGE_ROUNDING_VECTOR_H

#include "rounding.h"
#include "simd.h"
#include "stochastic.h"

/* ------------------------------------------------------------------------------------ */
/* rounding on VL lanes (the scalar helpers, lane by lane)                               */
/* ------------------------------------------------------------------------------------ */

/* all ones where x is inf or nan (the exponent field all ones); callers clear those lanes
 * with ``& ~``, one and-not */
static inline __attribute__((always_inline)) vu g_special(vf x) {
    return (vu)((u_bits(x) & 0x7F800000u) == 0x7F800000u);
}

/* bf_round of a lane that is not NaN, widened: the bf16 bits in the high half, the low
 * half zero (callers say why their lane is not NaN, or mask it after) */
static inline __attribute__((always_inline)) vu g_round_number(vf x) {
    vu u = u_bits(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

/* bf_round, widened; NaN -> 0xFFFF */
static inline __attribute__((always_inline)) vu g_round(vf x) {
    return u_select((vi)(x != x), u_splat(0xFFFF0000u), g_round_number(x));
}

/* the low part fl(x - hi) rounded, +0 where hi is not finite (hi widened). Where hi is
 * finite x is not NaN (RN(NaN) is NaN), so neither is x - hi: the masked rounding is
 * bf_round's wherever it is kept. */
static inline __attribute__((always_inline)) vu g_residual(vf x, vu hi) {
    vf h = f_bits(hi);
    return g_round_number(x - h) & ~g_special(h);
}

/* bf_normalize: hi the nearest of the float32 sum, lo the rest */
static inline __attribute__((always_inline)) void g_normalize(vu *hi, vu *lo) {
    vf total = f_bits(*hi) + f_bits(*lo);
    vu nearest = g_round(total);
    *lo = g_residual(total, nearest);
    *hi = nearest;
}

/* bf_normalize of kahan's pair, where any lane may change it. Kahan's lo may lie below
 * hi's last float32 place (docs/strategies.md, at kahan), so t = fl(hi + lo) may not be
 * hi + lo; where it is, fl(t - hi) == lo, and where moreover RN(t) is hi the
 * normalisation gives back (hi, lo), but +0 for a -0 lo (its rest fl(t - hi) is then
 * +0). Where hi is inf or NaN lo is +0 already; a NaN t fails the second test. Two
 * compares against the normalisation's second rounding and its mask. */
static inline __attribute__((always_inline)) void g_normalize_kahan(vu *hi, vu *lo) {
    vf h = f_bits(*hi), l = f_bits(*lo), t = h + l;
    vi same = (vi)(g_round_number(t) == *hi) & (vi)((t - h) == l);
    if (v_all(same)) *lo = u_bits(l + 0.0f);
    else g_normalize(hi, lo);
}

/* bf_residual_pair: hi = RN(x), lo = RN(x - hi), then normalised, where any lane may
 * change. Which do: for these pairs t = fl(hi + lo) is hi + lo exactly wherever hi is
 * finite (x - hi and lo are multiples of x's float32 ulp, |t| <= 2|x|: docs/strategies.md,
 * "Canonical by construction", step 3; for subnormal x or x - hi, multiples of the bf16
 * subnormal spacing or of x's ulp, far inside float32's precision), so the
 * normalisation's rest RN(t - RN(t)) is t - hi = lo wherever RN(t) is hi -- bit for bit but
 * for a zero's sign: a negative x - hi too small for bf16 rounds to lo = -0, where the rest
 * is +0, so there lo + 0 (+0 for -0, every other lo itself: it is never NaN) is taken;
 * where hi is inf or NaN, lo = +0 and t rounds to hi again. So the pair changes only where
 * RN(t) != hi: one sum and one rounding find it (ten operations against the seventeen of
 * the normalisation, and no class test: subnormals and NaN included). */
static inline __attribute__((always_inline)) void g_residual_pair(const int LEAN, vf x, vu *hi,
                                                                vu *lo) {
    /* LEAN (step_vector.h's lean blocks): x finite and far from overflow, so hi is finite
     * and bf_round and g_residual are their integer forms */
    *hi = LEAN ? g_round_number(x) : g_round(x);
    *lo = LEAN ? g_round_number(x - f_bits(*hi)) : g_residual(x, *hi);
    vf t = f_bits(*hi) + f_bits(*lo);
    /* LEAN (hi finite): t is exact (above), and |lo| is at most half of hi's spacing
     * toward lo (x rounded to hi, and rounding is monotonic), so RN(t) != hi needs t to be
     * a midpoint between bf16 neighbours: its low 16 bits exactly 0x8000 (also where t is
     * subnormal: bf16 and float32 share the exponent). Where no lane is one, RN(t) == hi
     * without the rounding (4 operations against 7; the few vectors with a midpoint, about
     * 1 value in 1,024, take the test below). */
    if (LEAN && !v_any((vi)((u_bits(t) & 0xFFFFu) == 0x8000u))) {
        *lo = u_bits(f_bits(*lo) + 0.0f);
        return;
    }
    /* NaN t only where hi is NaN (0xFFFF0000), which t's integer rounding gives back */
    vu again = g_round_number(t);
    if (v_all((vi)(again == *hi))) *lo = u_bits(f_bits(*lo) + 0.0f);
    else g_normalize(hi, lo);
}

/* the hash's rounds after its first product p = (x ^ (x >> 16)) * C1, x = index ^ key0 */
static inline __attribute__((always_inline)) vu g_hash_rounds(vu p, uint32_t key1) {
    p ^= p >> 15;
    p *= MIX32_C2;
    p ^= key1 ^ (key1 >> 16);
    p *= MIX32_C1;
    p ^= p >> 15;
    return p * MIX32_C2;
}

/* The hash z of the elements ``index`` whose top 16 bits are their draws' (stochastic.h,
 * v_hash_rounds: the xor-shifts that do not reach them dropped, exactly) */
static inline __attribute__((always_inline)) vu g_hash(vu index, uint32_t key0,
                                                     uint32_t key1) {
    vu x = index ^ key0;
    x ^= x >> 16;
    return g_hash_rounds(x * MIX32_C1, key1);
}

/* the draws' top 16 bits (the low 16 of each lane) */
static inline __attribute__((always_inline)) vu g_draw(vu index, uint32_t key0,
                                                     uint32_t key1) {
    return g_hash(index, key0, key1) >> 16;
}

/* bf_stochastic with the draws' top 16 bits ``d``, widened: stochastic.h's v_stochastic32
 * (the proof is there), lane by lane in integer arithmetic */
static inline __attribute__((always_inline)) vu g_stochastic(vf x, vu d) {
    vu bits = u_bits(x);
    vu mag = bits & 0x7FFFFFFFu;
    vu t = mag >> 16, low = bits & 0xFFFFu;
    vu rounded_up = (low + 0x7FFFu + (t & 1u)) >> 16;
    vu up_from_down = (d - low) >> 31;  /* d < L */
    vu up_from_up = (d + low) >> 16;    /* d + L >= 2**16 */
    vu up = u_select((vi)(0u - rounded_up), up_from_up, up_from_down);
    vu nearest = t + rounded_up, out = t + up;
    vi keep = (vi)(nearest >= 0x7F80u) | (vi)(out >= 0x7F80u);
    out = u_select(keep, nearest, out) | ((bits & ~mag) >> 16);
    out = u_select((vi)(mag > 0x7F800000u), u_splat(0xFFFFu), out);
    return out << 16;
}

/* g_stochastic of 2 VL elements (the even and odd halves, with their hashes ``ze`` and
 * ``zo``), packed in element order: stochastic.h's v_stochastic2 (the proof is there) on
 * 16-bit lanes, both halves at once: with H the high halves (sign and t), L the low ones
 * and d the draws, rounded up is the top bit of avg(L, 0x7FFE | (H & 1)), up is L > (d ^
 * rounded up's mask), and the result H + up. Blocks with a lane at or above the largest
 * finite truncation (t >= 0x7F7F: a step may reach infinity; infinities, NaN) take
 * g_stochastic, which handles them. */
static inline __attribute__((always_inline)) vu g_stochastic2(vpair x, vu ze, vu zo) {
    vu be = u_bits(x.e), bo = u_bits(x.o);
    vw high = (vw)((be >> 16) | (bo & 0xFFFF0000u));
    vw low = (vw)((be & 0xFFFFu) | (bo << 16));
    vw d = (vw)((ze >> 16) | (zo & 0xFFFF0000u));
    vw rounded_up = (vw)((vs)v_avg16(low, (high & 1) | 0x7FFE) >> 15);
    vw up = (vw)(low > (d ^ rounded_up)); /* all ones: minus one */
    if (__builtin_expect(v_any((vi)((high & 0x7FFF) >= 0x7F7F)), 0))
        return v_pack(g_stochastic(x.e, ze >> 16), g_stochastic(x.o, zo >> 16));
    return (vu)(high - up);
}

/* split_encode, widened: the weight word (with its carry) and the low bits */
static inline __attribute__((always_inline)) void g_split_encode(vf master, vu *weight,
                                                               vu *low) {
    vu bits = u_bits(master);
    *low = bits << 16;
    /* a NaN master: its top half made quiet, never rounded (split_encode). Both compares
     * signed, of values below 2**31: x86 before AVX-512 has no unsigned one (a compare of
     * unsigned vectors costs an xor more on each side) */
    vu nan = (vu)((vi)(bits & 0x7FFFFFFFu) > 0x7F800000);
    vu up = (vu)((vi)(bits & 0xFFFFu) > 0x8000) & ~nan & 0x10000u;
    *weight = ((bits & 0xFFFF0000u) | (nan & 0x400000u)) + up;
}

/* split_decode of widened words */
static inline __attribute__((always_inline)) vf g_split_decode(vu weight, vu low) {
    return f_bits((weight - ((vu)(low > 0x80000000u) & 0x10000u)) | (low >> 16));
}

#endif /* COLLAGE_ROUNDING_VECTOR_H */
