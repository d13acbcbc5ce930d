/* Everything but the step: the build's identity (ABI, instruction set, OpenMP), the
 * non-finite check of nonfinite="skip"/"raise", the native plans' draw keys, and test
 * hooks for the kernels' roundings. */

#include "native.h"
#include "rounding.h"
#include "step.h"
#include "stochastic.h"

int collage_native_abi(void) { return COLLAGE_ABI; }
/* the loop the step runs on (native.h's ISA_*) */
int collage_native_isa(void) {
#if COLLAGE_AVX512
    return ISA_AVX512;
#elif COLLAGE_VECTOR
    return COLLAGE_VECTOR_BYTES == 32 ? ISA_VECTOR256 : ISA_VECTOR128;
#else
    return ISA_PORTABLE;
#endif
}
#ifdef _OPENMP
int collage_native_openmp(void) { return 1; } /* collage_adamw_threads uses OpenMP */
#else
int collage_native_openmp(void) { return 0; }
#endif

/* ------------------------------------------------------------------------------------ */
/* test hook: the kernels' bf16 stochastic rounding on its own                            */
/* ------------------------------------------------------------------------------------ */

/* out[j] = bf16 stochastic rounding of x[j] with the draw of element ``first + j``
 * (fused.counter_uniform keyed by key0, key1): with ``pairs``, v_stochastic2 on whole
 * blocks of 32 (the kernels' 32-wide path; g_stochastic2 on blocks of 2 VL in the other
 * vector builds); v_stochastic on whole vectors of 16 (the 16-wide path; g_stochastic on
 * VL); bf_stochastic on the tail (and everywhere in the portable build). For
 * tests. */
int collage_stochastic_round(const float *x, int64_t n, int64_t first, int64_t key0,
                             int64_t key1, uint16_t *out, int pairs) {
    int64_t j = 0;
#if COLLAGE_AVX512
    const __m512i even = v_even_offsets(), odd = v_odd_offsets();
    for (; pairs && j + 32 <= n; j += 32) {
        __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
        vpair v = {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b)};
        __m512i he, ho;
        v_hash2(first + j, key0, key1, &he, &ho);
        _mm512_storeu_si512(out + j, v_stochastic2(v, he, ho));
    }
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(out + j),
                            v_stochastic(_mm512_loadu_ps(x + j), v_draw16(first + j, key0,
                                                                            key1)));
#elif COLLAGE_VECTOR
    for (; pairs && j + 2 * VL <= n; j += 2 * VL) {
        vpair v = v_load_pair_f32(x, j);
        vu index = (uint32_t)(first + j) + (v_lanes() << 1);
        v_store_words(out, j, g_stochastic2(v, g_hash(index, (uint32_t)key0, (uint32_t)key1),
                                            g_hash(index + 1u, (uint32_t)key0,
                                                   (uint32_t)key1)));
    }
    for (; j + VL <= n; j += VL)
        v_store_bf(out, j, g_stochastic(v_load_f32(x, j),
                                        g_draw((uint32_t)(first + j) + v_lanes(),
                                               (uint32_t)key0, (uint32_t)key1)));
#else
    (void)pairs; /* the portable build rounds every element on the scalar path */
#endif
    for (; j < n; j++)
        out[j] = bf_stochastic(x[j], uniform((uint32_t)(first + j), (uint32_t)key0,
                                             (uint32_t)key1));
    return 0;
}

/* out[j] = x[j] / b as the vector kernels divide by the bias correction's root
 * (v_over_bc2s on whole vectors of 16, g_over_bc2s on whole vectors of VL; the probe's
 * last partial vector by the IEEE division); 0, or -1 in the portable build (nothing
 * written). For tests. */
int collage_probe_over_bc2s(const float *x, int64_t n, float b, float *out) {
#if COLLAGE_AVX512
    vcoeffs c;
    c.bc2s = _mm512_set1_ps(b);
    c.rbc2s = _mm512_set1_ps(1.0f / b);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, v_over_bc2s(&c, _mm512_loadu_ps(x + j)));
    for (; j < n; j++) out[j] = x[j] / b;
    return 0;
#elif COLLAGE_VECTOR
    gcoeffs c;
    c.bc2s = v_splat(b);
    c.rbc2s = v_splat(1.0f / b);
    int64_t j = 0;
    for (; j + VL <= n; j += VL) v_store_f32(out, j, g_over_bc2s(0, &c, v_load_f32(x, j)));
    for (; j < n; j++) out[j] = x[j] / b;
    return 0;
#else
    (void)x; (void)n; (void)b; (void)out;
    return -1;
#endif
}

/* hi[j], lo[j]: the canonical pair of x[j] by the residual landing (light and plus's
 * weight, plus's and split's second moment), as the kernels make it: with ``pairs``,
 * v_residual_pair2 on whole blocks of 32 (the 32-wide path); v_residual_pair on whole
 * vectors of 16; each block redone exactly where its fast roundings flag a lane, as the
 * kernels redo theirs; bf_residual_pair on the tail (and everywhere in the portable build).
 * For tests. */
int collage_residual_pairs(const float *x, int64_t n, uint16_t *hi, uint16_t *lo,
                           int pairs) {
    int64_t j = 0;
#if COLLAGE_AVX512
    vcoeffs c;
    c.interleave = v_interleave();
    const __m512i even = v_even_offsets(), odd = v_odd_offsets();
    for (; pairs && j + 32 <= n; j += 32) {
        __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
        vpair v = {_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b)};
        __m512i h, l;
        __mmask16 bad = 0;
        v_residual_pair2(&c, v, 0, &bad, &h, &l);
        if (bad) v_residual_pair2(&c, v, 1, &bad, &h, &l);
        _mm512_storeu_si512(hi + j, h);
        _mm512_storeu_si512(lo + j, l);
    }
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        __m256i h, l;
        __mmask16 bad = 0;
        v_residual_pair(v, 0, &bad, &h, &l);
        if (bad) v_residual_pair(v, 1, &bad, &h, &l);
        _mm256_storeu_si256((__m256i *)(hi + j), h);
        _mm256_storeu_si256((__m256i *)(lo + j), l);
    }
#elif COLLAGE_VECTOR
    for (; pairs && j + 2 * VL <= n; j += 2 * VL) {
        vpair v = v_load_pair_f32(x, j);
        vu he, le, ho, lo_;
        g_residual_pair(0, v.e, &he, &le);
        g_residual_pair(0, v.o, &ho, &lo_);
        v_store_words(hi, j, v_pack(he, ho));
        v_store_words(lo, j, v_pack(le, lo_));
    }
    for (; j + VL <= n; j += VL) {
        vu h, l;
        g_residual_pair(0, v_load_f32(x, j), &h, &l);
        v_store_bf(hi, j, h);
        v_store_bf(lo, j, l);
    }
#else
    (void)pairs; /* the portable build lands every element on the scalar path */
#endif
    for (; j < n; j++) bf_residual_pair(x[j], hi + j, lo + j);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* the stochastic keys of native plans (collage.optim.native.plan)                       */
/* ------------------------------------------------------------------------------------ */

/* The stochastic draws' key words of every row of a plan's table (``count`` rows of
 * T_COLS) at ``step``: fused.stochastic_key in C. ``states[t]``: base._mix's 64-bit state
 * after the seed and row t's parameter position (kept by the plan); the step is mixed in
 * with the same splitmix64 round, the result masked to 63 bits and split into key0 (the
 * low 32 bits minus 2**31) and key1 (the next 31). About 3 us per tensor in Python. */
void collage_stochastic_keys(int64_t count, int64_t *table, const uint64_t *states,
                             int64_t step) {
    for (int64_t t = 0; t < count; t++) {
        uint64_t h = (states[t] ^ (uint64_t)step) * 0xBF58476D1CE4E5B9ull;
        h = (h ^ (h >> 31)) * 0x94D049BB133111EBull;
        h ^= h >> 29;
        h &= 0x7FFFFFFFFFFFFFFFull;
        table[t * T_COLS + T_KEY0] = (int64_t)(h & 0xFFFFFFFFull) - ((int64_t)1 << 31);
        table[t * T_COLS + T_KEY1] = (int64_t)((h >> 32) & 0x7FFFFFFFull);
    }
}

/* ------------------------------------------------------------------------------------ */
/* the non-finite check of nonfinite="skip"/"raise": does any element overflow?          */
/* ------------------------------------------------------------------------------------ */

/* 1 if any of x[begin, end) is inf or nan: the exponent field all ones. With the sign bit
 * cleared, exactly those bit patterns are >= the exponent mask (0x7F80 for bf16,
 * 0x7F800000 for float32: every pattern from there up has all exponent bits set), so the
 * verdict is the largest magnitude pattern against the mask: one AND and one unsigned max
 * per element in the element's own width (vpand, vpmaxuw), where a compare per element
 * widened to 32-bit flags cost about a fifth more of the check at 111M parameters on a
 * 2-vCPU Xeon (#31). Branch-free; the whole span is read (no early exit: the verdict is
 * rare). The span is read as CHECK_STREAMS interleaved parts (part k's element i beside
 * part k+1's): a core reading one stream waits on its prefetcher, several keep more lines
 * in flight (111M bf16 elements on 2 threads of that Xeon: 25 GB/s as one stream, 30 as
 * four); the rest after the parts, one by one. */
#define CHECK_STREAMS 4

int span_nonfinite(const void *x, int wide, int64_t begin, int64_t end) {
    int64_t part = (end - begin) / CHECK_STREAMS;
    if (wide) {
        const uint32_t *u = (const uint32_t *)x + begin;
        uint32_t top = 0;
        for (int64_t i = 0; i < part; i++)
            for (int k = 0; k < CHECK_STREAMS; k++) {
                uint32_t a = u[k * part + i] & 0x7FFFFFFFu;
                top = a > top ? a : top;
            }
        for (int64_t i = CHECK_STREAMS * part; i < end - begin; i++) {
            uint32_t a = u[i] & 0x7FFFFFFFu;
            top = a > top ? a : top;
        }
        return top >= 0x7F800000u;
    }
    const uint16_t *h = (const uint16_t *)x + begin;
    uint16_t top = 0;
    for (int64_t i = 0; i < part; i++)
        for (int k = 0; k < CHECK_STREAMS; k++) {
            uint16_t a = (uint16_t)(h[k * part + i] & 0x7FFFu);
            top = a > top ? a : top;
        }
    for (int64_t i = CHECK_STREAMS * part; i < end - begin; i++) {
        uint16_t a = (uint16_t)(h[i] & 0x7FFFu);
        top = a > top ? a : top;
    }
    return top >= 0x7F80u;
}

/* Elements [lo, hi) of the tensors laid end to end (``table``: pointer, length pairs). */
static int pieces_nonfinite(int wide, int64_t count, const int64_t *table, int64_t lo,
                            int64_t hi) {
    int bad = 0;
    int64_t base = 0;
    for (int64_t t = 0; t < count && base < hi; t++) {
        int64_t n = table[2 * t + 1];
        int64_t begin = lo > base ? lo - base : 0, end = hi - base < n ? hi - base : n;
        if (begin < end) bad |= span_nonfinite((const void *)table[2 * t], wide, begin, end);
        base += n;
    }
    return bad;
}

/* 1 if any element of ``count`` tensors (``table``: data pointer and element count pairs;
 * float32 when ``wide``, else bf16) is inf or nan, else 0; on up to ``threads`` threads. */
int collage_nonfinite(int wide, int64_t count, const int64_t *table, int threads) {
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += table[2 * t + 1];
#ifdef _OPENMP
    int64_t parts = thread_parts(total, threads, CHECK_MIN_CHUNK);
    int bad = 0;
    if (parts > 1) {
#pragma omp parallel for num_threads((int)parts) schedule(static, 1) reduction(| : bad)
        for (int64_t p = 0; p < parts; p++)
            bad |= pieces_nonfinite(wide, count, table, total * p / parts,
                                    total * (p + 1) / parts);
        return bad;
    }
#else
    (void)threads; /* one thread without OpenMP */
#endif
    return pieces_nonfinite(wide, count, table, 0, total);
}
