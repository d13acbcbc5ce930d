/* How fast a core moves the native step's streams when it computes nothing (#31,
 * docs/benchmarks/intel-xeon-2c_2026-12-05_prefetch.md): four 16-bit streams read and three
 * written back (bf16's weight, gradient, m, v), and the same with float32 elements (torch's
 * fused AdamW's), one integer or float add per element, split between THREADS OpenMP
 * threads; PF > 0 adds a software prefetch PF elements ahead. Prints the median of 30
 * passes in ns per element and core, and GB/s.
 *
 *     gcc -O2 -march=native -fopenmp benchmarks/studies/stream_probe.c -o stream
 *     ./stream ELEMENTS THREADS PF
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* bf16-like: read w,g,m,v (uint16), write w,m,v; trivial op: add 1 (int) */
static void k16(uint16_t *w, const uint16_t *g, uint16_t *m, uint16_t *v, int64_t lo, int64_t hi, int pf) {
    for (int64_t i = lo; i < hi; i += 32) {
        if (pf) { _mm_prefetch((const char*)(w+i+pf), _MM_HINT_T0); _mm_prefetch((const char*)(g+i+pf), _MM_HINT_T0);
                  _mm_prefetch((const char*)(m+i+pf), _MM_HINT_T0); _mm_prefetch((const char*)(v+i+pf), _MM_HINT_T0);}
        __m512i a = _mm512_loadu_si512(w+i), b = _mm512_loadu_si512(g+i), c = _mm512_loadu_si512(m+i), d = _mm512_loadu_si512(v+i);
        _mm512_storeu_si512(w+i, _mm512_add_epi16(a, b));
        _mm512_storeu_si512(m+i, _mm512_add_epi16(c, b));
        _mm512_storeu_si512(v+i, _mm512_add_epi16(d, b));
    }
}
static void k32(float *w, const float *g, float *m, float *v, int64_t lo, int64_t hi, int pf) {
    for (int64_t i = lo; i < hi; i += 16) {
        if (pf) { _mm_prefetch((const char*)(w+i+pf), _MM_HINT_T0); _mm_prefetch((const char*)(g+i+pf), _MM_HINT_T0);
                  _mm_prefetch((const char*)(m+i+pf), _MM_HINT_T0); _mm_prefetch((const char*)(v+i+pf), _MM_HINT_T0);}
        __m512 a = _mm512_loadu_ps(w+i), b = _mm512_loadu_ps(g+i), c = _mm512_loadu_ps(m+i), d = _mm512_loadu_ps(v+i);
        _mm512_storeu_ps(w+i, _mm512_add_ps(a, b));
        _mm512_storeu_ps(m+i, _mm512_add_ps(c, b));
        _mm512_storeu_ps(v+i, _mm512_add_ps(d, b));
    }
}
int main(int argc, char **argv) {
    int64_t n = atoll(argv[1]); int threads = atoi(argv[2]); int pf = atoi(argv[3]); int reps = 30;
    uint16_t *w16 = aligned_alloc(64, n*2), *g16 = aligned_alloc(64, n*2), *m16 = aligned_alloc(64, n*2), *v16 = aligned_alloc(64, n*2);
    float *w = aligned_alloc(64, n*4), *g = aligned_alloc(64, n*4), *m = aligned_alloc(64, n*4), *v = aligned_alloc(64, n*4);
    memset(w16,0,n*2);memset(g16,0,n*2);memset(m16,0,n*2);memset(v16,0,n*2);memset(w,0,n*4);memset(g,0,n*4);memset(m,0,n*4);memset(v,0,n*4);
    for (int kind = 0; kind < 2; kind++) {
        double best = 1e9, ts[64];
        for (int r = 0; r < reps; r++) {
            double t = now();
#pragma omp parallel num_threads(threads)
            { int id = omp_get_thread_num(); int64_t lo = n*id/threads/64*64, hi = id==threads-1? n : n*(id+1)/threads/64*64;
              if (kind == 0) k16(w16,g16,m16,v16,lo,hi,pf); else k32(w,g,m,v,lo,hi,pf); }
            ts[r] = now() - t;
        }
        /* median */
        for (int i=0;i<reps;i++) for(int j=i+1;j<reps;j++) if(ts[j]<ts[i]){double x=ts[i];ts[i]=ts[j];ts[j]=x;}
        double med = ts[reps/2]; int bytes = kind==0? 14: 28;
        printf("%s n=%lld thr=%d pf=%d: %.3f ns/elem/core, %.1f GB/s total\n", kind==0?"16-bit 7 streams":"fp32 7 streams", (long long)n, threads, pf, med*1e9*threads/n, bytes*n/med/1e9);
    }
    return 0;
}
