/* The offline check behind collage.mcf.eft's float32 route for 16-bit components: for every
 * pair (a, b) of bfloat16 values and every pair of float16 values (all 2^32 bit patterns of
 * each: zeros, subnormals, infinities and NaNs included), the sum and the product rounded
 * first to float32 (the hardware's operation) and then to the 16-bit format equal the exact
 * sum and product rounded once (to nearest, ties to even). Subtraction is the sum with -b,
 * whose pattern is among the b's.
 *
 * Why it holds: float32's 24 bits are at least 2p + 2 for p = 8 (bf16) and 11 (fp16), which
 * makes double rounding innocuous for + and x (Figueroa, "When is double rounding
 * innocuous?", 1995) where the exact result is in the normal range, and below it both
 * roundings are exact or land on the same neighbours. This program checks every pair
 * rather than relying on that argument.
 *
 * The reference is independent of floating point: each value as M * 2^E with integers M
 * and E; the exact sum or product in a 64-bit integer (an addend far below the other's last
 * bit is replaced by a smaller one of the same sign, which rounds the same); rounded to
 * nearest even, with the format's subnormals and overflow, by integer shifts. The float32
 * result is rounded to the 16-bit format by the same routine (a conversion rounds to
 * nearest even: torch's, which collage.mcf.formats.round_to already uses).
 *
 *   cc -O2 -fopenmp benchmarks/studies/double_rounding_check.c -o /tmp/double_rounding_check
 *   /tmp/double_rounding_check            # 2 cores: about 4 minutes
 *
 * Result of 2026-12-07: docs/benchmarks/amd-epyc-2c_2026-12-07_double-rounding.txt. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    int exp_bits, man_bits, bias;
} format;

static const format BF16 = {"bfloat16", 8, 7, 127};
static const format FP16 = {"float16", 5, 10, 15};
static const format FP32 = {"float32", 8, 23, 127};

typedef struct {
    int kind;      /* 0 finite, 1 infinite, 2 NaN */
    int negative;
    uint64_t m;    /* the value is m * 2^e */
    int e;
} value;

static value decode(const format *f, uint32_t bits) {
    value v;
    uint32_t man = bits & ((1u << f->man_bits) - 1);
    uint32_t ex = (bits >> f->man_bits) & ((1u << f->exp_bits) - 1);
    v.negative = (bits >> (f->man_bits + f->exp_bits)) & 1;
    v.kind = 0;
    if (ex == (1u << f->exp_bits) - 1) {
        v.kind = man ? 2 : 1;
        v.m = 0; v.e = 0;
    } else if (ex == 0) {
        v.m = man; v.e = 1 - f->bias - f->man_bits;
    } else {
        v.m = man | (1u << f->man_bits); v.e = (int)ex - f->bias - f->man_bits;
    }
    return v;
}

static int top_bit(uint64_t m) { return 63 - __builtin_clzll(m); }

/* (-1)^negative * m * 2^e rounded to nearest even in format f, as its bit pattern; m may be
 * zero (a signed zero) */
static uint32_t round_exact(const format *f, int negative, uint64_t m, int e) {
    uint32_t sign = (uint32_t)negative << (f->man_bits + f->exp_bits);
    uint32_t inf = ((1u << f->exp_bits) - 1) << f->man_bits;
    if (m == 0) return sign;
    int emin_quantum = 1 - f->bias - f->man_bits;  /* the last bit of a subnormal */
    int top = top_bit(m) + e;
    int quantum = top - f->man_bits;               /* the last bit at full precision */
    if (quantum < emin_quantum) quantum = emin_quantum;
    uint64_t kept;
    if (quantum <= e) {
        kept = m << (e - quantum);                 /* exact: no bit below the quantum */
    } else {
        int shift = quantum - e;
        if (shift > 63) {
            kept = 0;                              /* below half the quantum: rounds to 0 */
        } else {
            kept = m >> shift;
            uint64_t rest = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
            if (rest > half || (rest == half && (kept & 1))) kept++;
        }
    }
    /* kept * 2^quantum; normalise a carry out of the significand */
    if (kept >> (f->man_bits + 1)) { kept >>= 1; quantum++; }
    if (kept == 0) return sign;
    if (kept >> f->man_bits) {                      /* normal */
        int biased = quantum + f->man_bits + f->bias;
        if (biased >= (1 << f->exp_bits) - 1) return sign | inf;
        return sign | ((uint32_t)biased << f->man_bits) | (uint32_t)(kept & ((1u << f->man_bits) - 1));
    }
    return sign | (uint32_t)kept;                   /* subnormal: quantum is the smallest */
}

static int is_nan(const format *f, uint32_t bits) {
    return decode(f, bits).kind == 2;
}

static uint32_t nan_of(const format *f) {
    return (((1u << f->exp_bits) - 1) << f->man_bits) | (1u << (f->man_bits - 1));
}

/* the exact a + b rounded once in f */
static uint32_t exact_sum(const format *f, value a, value b) {
    if (a.kind == 2 || b.kind == 2) return nan_of(f);
    if (a.kind == 1 || b.kind == 1) {
        if (a.kind == 1 && b.kind == 1 && a.negative != b.negative) return nan_of(f);
        int negative = a.kind == 1 ? a.negative : b.negative;
        return round_exact(f, negative, 1, 1000);  /* overflows to the signed infinity */
    }
    if (a.m == 0 && b.m == 0)  /* -0 + -0 = -0; any other pair of zeros is +0 */
        return round_exact(f, a.negative && b.negative, 0, 0);
    if (a.m == 0) return round_exact(f, b.negative, b.m, b.e);
    if (b.m == 0) return round_exact(f, a.negative, a.m, a.e);
    /* the larger first; an addend whose top bit is more than man_bits + 3 below the other's
     * is replaced by one of the same sign a bit further below: both are under a quarter of
     * the larger's last bit, so the sum rounds to the larger either way */
    if (top_bit(a.m) + a.e < top_bit(b.m) + b.e) { value t = a; a = b; b = t; }
    int limit = top_bit(a.m) + a.e - (f->man_bits + 4);
    if (top_bit(b.m) + b.e < limit) { b.m = 1; b.e = limit - 1; }
    int e = a.e < b.e ? a.e : b.e;
    uint64_t ma = a.m << (a.e - e), mb = b.m << (b.e - e);  /* < 2^(2 man_bits + 8) */
    if (a.negative == b.negative) return round_exact(f, a.negative, ma + mb, e);
    if (ma == mb) return round_exact(f, 0, 0, 0);   /* x + (-x) = +0 */
    if (ma > mb) return round_exact(f, a.negative, ma - mb, e);
    return round_exact(f, b.negative, mb - ma, e);
}

/* the exact a * b rounded once in f */
static uint32_t exact_product(const format *f, value a, value b) {
    int negative = a.negative != b.negative;
    if (a.kind == 2 || b.kind == 2) return nan_of(f);
    if (a.kind == 1 || b.kind == 1) {
        if ((a.kind == 0 && a.m == 0) || (b.kind == 0 && b.m == 0)) return nan_of(f);
        return round_exact(f, negative, 1, 1000);
    }
    return round_exact(f, negative, a.m * b.m, a.e + b.e);
}

static float f32(uint32_t bits) { float x; memcpy(&x, &bits, 4); return x; }
static uint32_t bits32(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

/* float32 pattern -> format f, rounded to nearest even by the exact routine */
static uint32_t narrow(const format *f, uint32_t bits) {
    value v = decode(&FP32, bits);
    if (v.kind == 2) return nan_of(f);
    if (v.kind == 1) return round_exact(f, v.negative, 1, 1000);
    return round_exact(f, v.negative, v.m, v.e);
}

/* a 16-bit pattern as the float32 it is exactly */
static float widen(const format *f, uint32_t bits) {
    value v = decode(f, bits);
    if (v.kind == 2) return f32(0x7FC00000);
    float x = v.kind == 1 ? f32(0x7F800000) : (float)v.m * __builtin_ldexpf(1.0f, v.e);
    return v.negative ? -x : x;
}

static int same(const format *f, uint32_t x, uint32_t y) {
    return x == y || (is_nan(f, x) && is_nan(f, y));
}

static void check(const format *f) {
    static float wide[1 << 16];
    static value parts[1 << 16];
    for (uint32_t i = 0; i < (1u << 16); i++) { wide[i] = widen(f, i); parts[i] = decode(f, i); }
    /* the widening itself, checked once: every pattern back from float32 unchanged */
    long widen_bad = 0;
    for (uint32_t i = 0; i < (1u << 16); i++) widen_bad += !same(f, narrow(f, bits32(wide[i])), i);
    long sum_bad = 0, product_bad = 0;
    uint32_t first_sum[2] = {0, 0}, first_product[2] = {0, 0};
    #pragma omp parallel for schedule(dynamic, 64) reduction(+:sum_bad, product_bad)
    for (uint32_t i = 0; i < (1u << 16); i++) {
        for (uint32_t j = 0; j < (1u << 16); j++) {
            uint32_t s = narrow(f, bits32(wide[i] + wide[j]));
            uint32_t p = narrow(f, bits32(wide[i] * wide[j]));
            if (!same(f, s, exact_sum(f, parts[i], parts[j]))) {
                if (!sum_bad) { first_sum[0] = i; first_sum[1] = j; }
                sum_bad++;
            }
            if (!same(f, p, exact_product(f, parts[i], parts[j]))) {
                if (!product_bad) { first_product[0] = i; first_product[1] = j; }
                product_bad++;
            }
        }
    }
    printf("%s: 4294967296 pairs; widening mismatches %ld; sum mismatches %ld", f->name,
           widen_bad, sum_bad);
    if (sum_bad) printf(" (e.g. 0x%04x + 0x%04x)", first_sum[0], first_sum[1]);
    printf("; product mismatches %ld", product_bad);
    if (product_bad) printf(" (e.g. 0x%04x * 0x%04x)", first_product[0], first_product[1]);
    printf("\n");
}

/* the reference itself, on cases whose answers are known by hand */
static int self_test(void) {
    int bad = 0;
    value one = decode(&BF16, 0x3F80), tiny = decode(&BF16, 0x0001), max = decode(&BF16, 0x7F7F);
    value half_ulp = decode(&BF16, 0x3B80);  /* 2^-8: half of 1.0's last bit */
    value minus_one = decode(&BF16, 0xBF80), minus_zero = decode(&BF16, 0x8000);
    bad += exact_sum(&BF16, one, one) != 0x4000;                 /* 2 */
    bad += exact_sum(&BF16, one, half_ulp) != 0x3F80;            /* tie to even: 1.0 */
    bad += exact_sum(&BF16, decode(&BF16, 0x3F81), half_ulp) != 0x3F82;  /* tie up to even */
    bad += exact_sum(&BF16, one, tiny) != 0x3F80;                /* far below the last bit */
    bad += exact_sum(&BF16, one, minus_one) != 0x0000;           /* +0 */
    bad += exact_sum(&BF16, minus_zero, minus_zero) != 0x8000;   /* -0 */
    bad += exact_sum(&BF16, max, max) != 0x7F80;                 /* overflow: inf */
    bad += exact_product(&BF16, tiny, decode(&BF16, 0x3F00)) != 0x0000;  /* 2^-134: tie to 0 */
    bad += exact_product(&BF16, tiny, decode(&BF16, 0x3F40)) != 0x0001;  /* 0.75 ulp: up */
    bad += exact_product(&FP16, decode(&FP16, 0x5C00), decode(&FP16, 0x5C00)) != 0x7C00;  /* 65536 */
    bad += narrow(&BF16, 0x3F808000) != 0x3F80;                  /* tie to even */
    bad += narrow(&BF16, 0x3F818000) != 0x3F82;
    bad += narrow(&FP16, bits32(65519.0f)) != 0x7BFF;            /* below the overflow tie */
    bad += narrow(&FP16, bits32(65520.0f)) != 0x7C00;            /* the tie goes to inf */
    return bad;
}

/* The control: the same check through an intermediate format too narrow for the argument
 * (bf16's exponent, man_bits + 1 significant bits < 2p + 2) finds mismatches, so the check
 * can fail. Every pair whose first pattern is a multiple of 7 (a seventh of them). */
static void control(int man_bits) {
    format inter = {"intermediate", 8, man_bits, 127};
    long sum_bad = 0, product_bad = 0;
    #pragma omp parallel for schedule(dynamic, 64) reduction(+:sum_bad, product_bad)
    for (uint32_t i = 0; i < (1u << 16); i += 7) {
        value a = decode(&BF16, i);
        for (uint32_t j = 0; j < (1u << 16); j++) {
            value b = decode(&BF16, j);
            value s = decode(&inter, exact_sum(&inter, a, b));
            value p = decode(&inter, exact_product(&inter, a, b));
            uint32_t s2 = s.kind == 2 ? nan_of(&BF16) : round_exact(&BF16, s.negative,
                                                                   s.kind ? 1 : s.m, s.kind ? 1000 : s.e);
            uint32_t p2 = p.kind == 2 ? nan_of(&BF16) : round_exact(&BF16, p.negative,
                                                                   p.kind ? 1 : p.m, p.kind ? 1000 : p.e);
            sum_bad += !same(&BF16, s2, exact_sum(&BF16, a, b));
            product_bad += !same(&BF16, p2, exact_product(&BF16, a, b));
        }
    }
    printf("control, bfloat16 through %d significant bits: sum mismatches %ld, product "
           "mismatches %ld\n", man_bits + 1, sum_bad, product_bad);
}

int main(void) {
    int bad = self_test();
    printf("reference self-test: %d failures\n", bad);
    if (bad) return 1;
    control(8);   /* 9 bits: p + 1 */
    control(14);  /* 15 bits: 2p - 1 */
    check(&BF16);
    check(&FP16);
    return 0;
}
