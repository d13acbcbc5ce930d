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

/* ------------------------------------------------------------------------------------ */
/* every planned group of a step in one call (collage.optim.native.plan.step_plans)       */
/* ------------------------------------------------------------------------------------ */

/* Why one call: a small model's step is mostly fixed costs (#31). Before, the check
 * (collage_nonfinite), the step counters and each group's kernel (collage_adamw_threads)
 * took a C call each from Python, and two OpenMP regions, of which the check's ran on one
 * thread below CHECK_MIN_CHUNK. Here one region does both: each thread reads for inf and
 * nan the gradients of the elements it is about to step (for a model that fits the caches,
 * they are then in its own when it steps them), and no thread writes before every thread
 * has read (the barrier): a non-finite gradient anywhere leaves everything unwritten. */

static int planned_counters_hold(const int64_t *call) {
    const int64_t *steps = (const int64_t *)call[P_STEPS];
    float expected = (float)call[P_STEP];
    for (int64_t t = 0; t < call[P_COUNTERS]; t++)
        if (*(const float *)steps[t] != expected) return 0;
    return 1;
}

/* 1 if a gradient element among [lo, hi) of the groups' elements laid end to end (group by
 * group, row by row) is inf or nan */
static int planned_nonfinite(int64_t groups, const int64_t *calls, int64_t lo, int64_t hi) {
    int bad = 0;
    int64_t base = 0;
    for (int64_t k = 0; k < groups && base < hi; k++) {
        const int64_t *call = calls + k * P_COLS;
        const int64_t *table = (const int64_t *)call[P_TABLE];
        int wide = (call[P_FLAGS] & F_GRAD_FP32) != 0;
        for (int64_t t = 0; t < call[P_ROWS] && base < hi; t++) {
            const int64_t *row = table + t * T_COLS;
            int64_t n = row[T_N];
            int64_t begin = lo > base ? lo - base : 0, end = hi - base < n ? hi - base : n;
            if (begin < end) bad |= span_nonfinite((const void *)row[T_G], wide, begin, end);
            base += n;
        }
    }
    return bad;
}

/* the step of the elements [lo, hi) of the groups laid end to end (run_span per group: its
 * cuts inside a row are the same in both neighbouring ranges) */
static void planned_span(int64_t groups, const int64_t *calls, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int64_t k = 0; k < groups && base < hi; k++) {
        const int64_t *call = calls + k * P_COLS;
        int64_t n = call[P_ELEMENTS];
        int64_t begin = lo > base ? lo - base : 0, end = hi - base < n ? hi - base : n;
        if (begin < end)
            run_span((int)call[P_STRATEGY], (int)call[P_FLAGS], call[P_ROWS],
                     (const int64_t *)call[P_TABLE], (const float *)call[P_H], begin, end);
        base += n;
    }
}

/* the check, then the step, of [lo, hi) on every thread of a region (``bad``: shared) */
static void planned_region(int64_t groups, const int64_t *calls, int64_t total, int check,
                           int *bad) {
#ifdef _OPENMP
    int64_t team = omp_get_num_threads(), p = omp_get_thread_num();
#else
    int64_t team = 1, p = 0;
#endif
    int64_t lo = total * p / team, hi = total * (p + 1) / team;
    if (check && planned_nonfinite(groups, calls, lo, hi)) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
        *bad = 1;
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
    int stop;
#ifdef _OPENMP
#pragma omp atomic read
#endif
    stop = *bad;
    if (!stop) planned_span(groups, calls, lo, hi);
}

int collage_adamw_planned(int64_t groups, const int64_t *calls, int threads, int check) {
    int64_t total = 0;
    for (int64_t k = 0; k < groups; k++) {
        const int64_t *call = calls + k * P_COLS;
        if (call[P_STRATEGY] < S_FP32 || call[P_STRATEGY] > S_SPLIT) return -1;
        total += call[P_ELEMENTS];
    }
    for (int64_t k = 0; k < groups; k++)
        if (!planned_counters_hold(calls + k * P_COLS)) return 2;
    int bad = 0;
#ifdef _OPENMP
    int64_t parts = thread_parts(total, threads, MIN_CHUNK);
    if (parts > 1) {
#pragma omp parallel num_threads((int)parts)
        planned_region(groups, calls, total, check, &bad);
    } else
#else
    (void)threads;
#endif
    {
        planned_region(groups, calls, total, check, &bad);
    }
    if (bad) return 1;
    for (int64_t k = 0; k < groups; k++) {
        const int64_t *call = calls + k * P_COLS;
        const int64_t *steps = (const int64_t *)call[P_STEPS];
        float next = (float)call[P_STEP] + 1.0f;
        for (int64_t t = 0; t < call[P_COUNTERS]; t++) *(float *)steps[t] = next;
    }
    return 0;
}
