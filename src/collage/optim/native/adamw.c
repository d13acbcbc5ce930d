/* The unmeasured entry points: collage_adamw and collage_adamw_threads, which cuts the
 * rows into spans for OpenMP threads. One instantiation of the step (run_piece, MEAS = 0)
 * serves both. */

#include "native.h"
#include "step.h"

int collage_adamw(int strategy, int flags, int64_t count, const int64_t *table,
                  const float *h) {
    return collage_adamw_threads(strategy, flags, count, table, h, 1);
}

/* A cut inside a row of ``n`` elements, moved up to a multiple of 64 elements (128 bytes
 * or more: two threads never write one cache line); monotonic, so that the pieces of
 * neighbouring spans neither overlap nor leave a gap. */
static int64_t row_cut(int64_t x, int64_t n) {
    int64_t up = (x + 63) & ~(int64_t)63;
    return up < n ? up : n;
}

/* The elements [lo, hi) of the rows laid end to end. Every element's step depends only on
 * its own values and its index in its tensor, so any cut gives the same bits. */
static void run_span(int strategy, int flags, int64_t count, const int64_t *table,
                     const float *h, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int64_t t = 0; t < count && base < hi; t++) {
        const int64_t *row = table + t * T_COLS;
        int64_t n = row[T_N];
        int64_t begin = row_cut(lo > base ? lo - base : 0, n);
        int64_t end = row_cut(hi - base, n);
        if (begin < end) run_piece(0, strategy, flags, h, row, begin, end, NULL);
        base += n;
    }
}

/* collage_adamw on up to ``threads`` threads (contiguous spans of about equal element
 * counts, at least MIN_CHUNK each). Built with OpenMP and loaded into a process whose torch
 * uses GNU OpenMP, the loader binds this library to torch's libgomp (one soname): the
 * threads are torch's own, already awake after the backward pass, instead of a second pool
 * competing with them for the cores. */
int collage_adamw_threads(int strategy, int flags, int64_t count, const int64_t *table,
                          const float *h, int threads) {
    if (strategy < S_FP32 || strategy > S_SPLIT) return -1;
    int64_t total = 0;
    for (int64_t t = 0; t < count; t++) total += table[t * T_COLS + T_N];
#ifdef _OPENMP
    int64_t parts = thread_parts(total, threads, MIN_CHUNK);
    if (parts > 1) {
#pragma omp parallel for num_threads((int)parts) schedule(static, 1)
        for (int64_t p = 0; p < parts; p++)
            run_span(strategy, flags, count, table, h, total * p / parts,
                     total * (p + 1) / parts);
        return 0;
    }
#else
    (void)threads; /* one thread without OpenMP */
#endif
    run_span(strategy, flags, count, table, h, 0, total);
    return 0;
}
