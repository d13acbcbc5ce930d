/* The native step's outputs on hard inputs, as one digest per strategy and flag set: builds
 * of different backends (and of different architectures) must print the same lines.
 *
 * tests/optim/test_native_cross.py compiles this file with the library's units for AArch64
 * (NEON, and the scalar loop) where a cross compiler and qemu-user exist, runs both under
 * qemu, and compares them with the x86 build's lines: the NEON code is then run, not only
 * compiled, and its bits checked against the scalar reference, which the Python suites check
 * against the foreach path on x86.
 *
 * Inputs: float32 values of every hard class (zeros of both signs, subnormals, infinities,
 * NaN, bf16 ties, the largest finite values, ordinary values at several scales) from a
 * fixed xorshift stream; bf16 components rounded from them with the kernels' own rounding.
 * Sizes cross every vector width and tail. Each strategy runs with five flag sets (both
 * lerp formulas, decay or none, maximize, a GradScaler scale, float32 gradients) and a
 * bias correction of 1 (the division-free loop); the measured entry point runs too, its
 * outputs and its exact counts digested (its float sums depend on the lanes: not printed). */

#include <stdio.h>
#include <stdlib.h>

#include "native.h"
#include "rounding.h"

static uint64_t state = 0x9E3779B97F4A7C15ull;

static uint32_t next32(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 16);
}

/* a float32 of one of the hard classes, or an ordinary value of magnitude about ``scale`` */
static float hard(float scale) {
    uint32_t pick = next32() % 16, bits = next32();
    switch (pick) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return f_of(bits & 0x807FFFFFu);                  /* subnormal */
    case 3: return f_of((bits & 0x80000000u) | 0x7F800000u);  /* infinity */
    case 4: return f_of(bits | 0x7FC00000u);                  /* NaN */
    case 5: return f_of((bits & 0xFFFF0000u) | 0x8000u);      /* a bf16 tie */
    case 6: return f_of((bits & 0x80000000u) | 0x7F7FFFFFu);  /* the largest */
    case 7: return f_of(bits);                                /* any bits */
    default: {
        float x = (float)((int32_t)bits) * 0x1p-31f;          /* [-1, 1) */
        return x * scale;
    }
    }
}

#define SIZES 7
static const int64_t sizes[SIZES] = {1, 3, 8, 17, 33, 1000, 4099};

/* FNV-1a of the outputs' bytes (``exact``), and of the outputs with every NaN made one
 * pattern (``numbers``): NaN payloads and the default NaN are the architecture's (x86's
 * inf - inf is 0xFFC00000, AArch64's 0x7FC00000), so only builds of one architecture
 * agree on them; every other bit must agree across architectures too. */
static uint64_t exact, numbers;

static void absorb(uint64_t *d, const void *p, int64_t bytes) {
    const unsigned char *c = (const unsigned char *)p;
    for (int64_t i = 0; i < bytes; i++) *d = (*d ^ c[i]) * 0x100000001B3ull;
}

/* one buffer of ``n`` elements of ``size`` bytes; with ``split`` (split's weight and low
 * words, whose pair is a float32 master) the words of a NaN master are its payload, and
 * both are left out of ``numbers`` */
static void absorb_buffer(const void *p, int64_t n, int size, const uint16_t *split[2]) {
    absorb(&exact, p, n * size);
    for (int64_t i = 0; i < n; i++) {
        if (size == 4) {
            uint32_t u;
            memcpy(&u, (const char *)p + 4 * i, 4);
            if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = 0x7FC00000u;
            absorb(&numbers, &u, 4);
        } else {
            uint16_t w = ((const uint16_t *)p)[i];
            if (split != NULL) {
                float master = split_decode(split[0][i], split[1][i]);
                if (master != master) w = 0;
            } else if ((w & 0x7FFFu) > 0x7F80u) {
                w = 0x7FC0u;
            }
            absorb(&numbers, &w, 2);
        }
    }
}

typedef struct {
    void *buf[6];       /* w, g, m, v, vlo, x */
    int64_t bytes[6];
    int64_t row[T_COLS];
} tensor;

static int wide_state(int s) { return s == S_FP32 || s == S_MIXED; }

static void fill_bf(uint16_t *p, int64_t n, float scale, int positive) {
    for (int64_t i = 0; i < n; i++) {
        float x = hard(scale);
        p[i] = bf_round(positive ? fabsf(x) : x);
    }
}

static void fill_f32(float *p, int64_t n, float scale, int positive) {
    for (int64_t i = 0; i < n; i++) {
        float x = hard(scale);
        p[i] = positive ? fabsf(x) : x;
    }
}

static void make(tensor *t, int s, int g32, int64_t n) {
    int64_t w4 = s == S_FP32 ? 4 : 2, st = wide_state(s) ? 4 : 2, x4 = s == S_MIXED ? 4 : 2;
    int64_t sz[6] = {w4, g32 ? 4 : 2, st, st, 2, x4};
    for (int k = 0; k < 6; k++) {
        t->bytes[k] = n * sz[k];
        t->buf[k] = calloc((size_t)n, (size_t)sz[k]);
    }
    if (s == S_FP32) fill_f32(t->buf[0], n, 1.0f, 0);
    else fill_bf(t->buf[0], n, 1.0f, 0);
    if (g32) fill_f32(t->buf[1], n, 1e-3f, 0);
    else fill_bf(t->buf[1], n, 1e-3f, 0);
    if (wide_state(s)) {
        fill_f32(t->buf[2], n, 1e-3f, 0);
        fill_f32(t->buf[3], n, 1e-6f, 1);
    } else {
        fill_bf(t->buf[2], n, 1e-3f, 0);
        fill_bf(t->buf[3], n, 1e-6f, 1);
    }
    fill_bf(t->buf[4], n, 1e-9f, 1);
    if (s == S_MIXED) fill_f32(t->buf[5], n, 1.0f, 0);
    else fill_bf(t->buf[5], n, 1e-3f, 0);
    if (s == S_SPLIT) /* the weight and its low bits: any words */
        for (int64_t i = 0; i < n; i++) ((uint16_t *)t->buf[5])[i] = (uint16_t)next32();
    t->row[T_N] = n;
    t->row[T_W] = (int64_t)(intptr_t)t->buf[0];
    t->row[T_G] = (int64_t)(intptr_t)t->buf[1];
    t->row[T_M] = (int64_t)(intptr_t)t->buf[2];
    t->row[T_V] = (int64_t)(intptr_t)t->buf[3];
    t->row[T_VLO] = (int64_t)(intptr_t)t->buf[4];
    t->row[T_X] = (int64_t)(intptr_t)t->buf[5];
    t->row[T_INDEX] = 32 * (int64_t)(next32() % 4) + (int64_t)(next32() % 2) * 7;
    t->row[T_KEY0] = (int64_t)(int32_t)next32();
    t->row[T_KEY1] = (int64_t)(next32() & 0x7FFFFFFFu);
}

int main(void) {
    static const char *names[] = {"fp32", "mixed", "bf16", "kahan", "stochastic", "light",
                                  "plus", "split"};
    const int flag_sets[5] = {F_LERP_SMALL | F_DECAY, F_DECAY | F_SCALED,
                              F_MAXIMIZE | F_LERP_SMALL, F_GRAD_FP32 | F_DECAY, 0};
    for (int s = S_FP32; s <= S_SPLIT; s++)
        for (int f = 0; f < 5; f++) {
            int flags = flag_sets[f];
            float h[H_COUNT];
            h[H_LERP] = 0.1f;
            h[H_BETA2] = 0.99f;
            h[H_OMB2] = 0.01f;
            h[H_BC2S] = f == 4 ? 1.0f : 0.14106736f; /* sqrt(1 - 0.99**2) */
            h[H_EPS] = 1e-8f;
            h[H_NEG_STEP] = -0.05263158f;
            h[H_DECAY] = 0.999f;
            h[H_LR_WD] = 1e-3f;
            h[H_SCALE] = 4.0f;
            for (int measured = 0; measured < 2; measured++) {
                tensor t[SIZES];
                int64_t table[SIZES * T_COLS];
                for (int k = 0; k < SIZES; k++) {
                    make(&t[k], s, (flags & F_GRAD_FP32) != 0, sizes[k]);
                    memcpy(table + k * T_COLS, t[k].row, sizeof t[k].row);
                }
                double sums[SIZES * M_COUNT];
                int status = measured ? collage_adamw_measured(s, flags, SIZES, table, h, sums)
                                      : collage_adamw(s, flags, SIZES, table, h);
                exact = numbers = 0xCBF29CE484222325ull;
                for (int k = 0; k < SIZES; k++) {
                    const uint16_t *pair[2] = {t[k].buf[0], t[k].buf[5]};
                    for (int b = 0; b < 6; b++) {
                        int size = (int)(t[k].bytes[b] / sizes[k]);
                        int words = s == S_SPLIT && (b == 0 || b == 5);
                        absorb_buffer(t[k].buf[b], sizes[k], size, words ? pair : NULL);
                    }
                    /* the exact counts; split's visible weight is a NaN master's top bits,
                     * a payload, which its counts compare: across architectures only
                     * where no master is NaN, so not in ``numbers`` */
                    if (measured) {
                        const int counts[] = {M_N_NONZERO, M_N_STUCK, M_N_STUCK_V, M_N_COMP,
                                              M_N_ELEMENTS};
                        for (int c = 0; c < 5; c++) {
                            int64_t v = (int64_t)sums[k * M_COUNT + counts[c]];
                            absorb(&exact, &v, sizeof v);
                            if (s != S_SPLIT) absorb(&numbers, &v, sizeof v);
                        }
                    }
                    for (int b = 0; b < 6; b++) free(t[k].buf[b]);
                }
                printf("%s flags=%d measured=%d status=%d exact=%016llx numbers=%016llx\n",
                       names[s], flags, measured, status, (unsigned long long)exact,
                       (unsigned long long)numbers);
            }
        }
    return 0;
}
