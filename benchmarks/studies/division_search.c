/* The offline check behind rounding.h's v_over_bc2s (docs/strategies.md): for the K divisor
 * significands b in [1, 2) whose float32 reciprocal RN(1/b) is farthest from 1/b (in ulps;
 * where a correction by a rounded reciprocal is most at risk), every dividend significand a
 * in [1, 2) (2^23 of them): is RN(q - RN(q*b - a) * r), q = RN(a * r), r = RN(1/b), the IEEE
 * quotient? The kernels' form, fnmadd(fmsub(q, b, a), r, q); exponents scale out of the
 * quotient.
 *
 *   cc -O2 -mavx512f -mfma benchmarks/studies/division_search.c -o /tmp/division_search -lm
 *   /tmp/division_search 300000 0 2 & /tmp/division_search 300000 1 2   # two cores, ~4 min
 *
 * Arguments: K, this part, the number of parts (divisors d = START + part, + parts, ...
 * below K), START (default 0).
 * Result of 2026-12-05: docs/benchmarks/intel-xeon-2c_2026-12-05_division-search.txt. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
static float f_of(uint32_t u){float f; memcpy(&f,&u,4); return f;}
typedef struct { double err; uint32_t bs; } cand;
static int cmp(const void *x, const void *y){ double a=((cand*)x)->err, b=((cand*)y)->err; return a<b?1:a>b?-1:0; }
int main(int argc, char **argv){
  long k = atol(argv[1]); int part = atoi(argv[2]), parts = atoi(argv[3]);
  long start = argc > 4 ? atol(argv[4]) : 0; /* skip the first START of the K worst */
  cand *c = malloc(sizeof(cand) << 23);
  for (uint32_t s = 0; s < (1u<<23); s++) {
    uint32_t bs = 0x3F800000 | s; float b = f_of(bs); float y = 1.0f / b;
    double exact = 1.0 / (double)b;  /* b has 24 bits: 1/b in double is within 2^-53 rel */
    double ulp = ldexp(1.0, ilogb(exact) - 23);
    c[s].err = fabs((double)y - exact) / ulp; c[s].bs = bs;
  }
  qsort(c, 1u<<23, sizeof(cand), cmp);
  long bad_div = 0, bad_total = 0;
  for (long d = start + part; d < k; d += parts) {
    float b = f_of(c[d].bs), y = 1.0f / b;
    __m512 vb = _mm512_set1_ps(b), vy = _mm512_set1_ps(y);
    long bad = 0; uint32_t first = 0;
    for (uint32_t s = 0; s < (1u << 23); s += 16) {
      __m512 a = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(0x3F800000 | s), _mm512_setr_epi32(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15)));
      __m512 q = _mm512_mul_ps(a, vy);
      __m512 q1 = _mm512_fnmadd_ps(_mm512_fmsub_ps(q, vb, a), vy, q); /* the kernels' form */
      __mmask16 m = _mm512_cmp_ps_mask(q1, _mm512_div_ps(a, vb), _CMP_NEQ_UQ);
      if (m) { if (!bad) first = s + __builtin_ctz(m); bad += __builtin_popcount(m); }
    }
    if (bad) { bad_div++; bad_total += bad; if (bad_div <= 5) printf("b=0x%08x err=%.6f ulp: %ld mismatches, first a=0x%08x\n", c[d].bs, c[d].err, bad, 0x3F800000 | first); }
  }
  printf("part %d: the worst reciprocals %ld to %ld (errors %.6f..%.6f ulp): %ld divisors with mismatches, %ld mismatches\n", part, start, k, c[start].err, c[k-1].err, bad_div, bad_total);
}
