/* The AVX-512 divider's throughput on this CPU, one core: AdamW's per-element arithmetic
 * that cannot be anything but IEEE division and square root (torch's fused AdamW and every
 * collage path compute sqrt(v) / bias_correction2_sqrt + eps and (m * -step_size) / denom,
 * correctly rounded, for the same bits), on L1-resident data so that memory plays no part.
 * Issue #31: on a CPU where these bound the step, no landing makes it faster.
 *
 *   cc -O2 -mavx512f benchmarks/studies/divider_probe.c -o /tmp/divider_probe && /tmp/divider_probe
 *
 * Prints ns per element (16 per vector) for: AdamW's sqrt and two divisions (with the
 * multiply and add between them), sqrt and one division (late training, where the bias
 * correction is 1 and the native kernels skip its division), a square root alone, a
 * division alone. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    enum { N = 4096, REPEATS = 20000 };
    static float a[N], b[N];
    for (int i = 0; i < N; i++) {
        a[i] = 1.0f + i * 1e-3f;
        b[i] = 2.0f + i * 1e-4f;
    }
    const char *names[] = {"sqrt, 2 divisions (AdamW)", "sqrt, 1 division (late training)",
                           "sqrt alone", "division alone"};
    __m512 c = _mm512_set1_ps(0.7f), e = _mm512_set1_ps(1e-8f);
    for (int mode = 0; mode < 4; mode++) {
        double start = now();
        __m512 sum = _mm512_setzero_ps();
        for (long r = 0; r < REPEATS; r++) {
            for (int i = 0; i < N; i += 16) {
                __m512 x = _mm512_loadu_ps(a + i), y = _mm512_loadu_ps(b + i), q;
                if (mode == 0)
                    q = _mm512_div_ps(_mm512_mul_ps(x, c),
                                      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(y), c), e));
                else if (mode == 1)
                    q = _mm512_div_ps(_mm512_mul_ps(x, c), _mm512_add_ps(_mm512_sqrt_ps(y), e));
                else if (mode == 2)
                    q = _mm512_sqrt_ps(y);
                else
                    q = _mm512_div_ps(x, y);
                sum = _mm512_add_ps(sum, q);
            }
        }
        double seconds = now() - start;
        float lanes[16];
        _mm512_storeu_ps(lanes, sum); /* the result is used: nothing is optimised away */
        printf("%-34s %.3f ns/element (%g)\n", names[mode],
               seconds / ((double)REPEATS * N) * 1e9, lanes[0]);
    }
    return 0;
}
