/* collage native CPU kernels: AdamW under a precision strategy, in float32 registers.
 *
 * Built on first use by collage/optim/native/build.py (cc -O3 -march=native
 * -ffp-contract=off -shared -fPIC, every .c file below in one call; no torch headers) and
 * called through ctypes with raw data pointers.
 *
 * The files, by concern:
 *   native.h       this header: build switches, the ABI, the layout of the table and of the
 *                  coefficients, the thread split, the exported functions
 *   rounding.h     bit helpers: bf16 rounding to nearest even, residual pairs, split
 *                  encode/decode, 16- and 32-lane loads and stores (scalar, AVX-512)
 *   stochastic.h   the draws' hash and bf16 stochastic rounding (scalar, AVX-512)
 *   step.h         the per-element AdamW step and its lost-update sums, shared by the
 *                  measured and unmeasured kernels (portable build; run_piece dispatches)
 *   step_avx512.h  the same step on 16 and 32 lanes
 *   simd.h         the vector layer of the other vector builds (AVX2 and FMA; NEON): the
 *                  compilers' vector extensions, one fma, square root and lane test each
 *   rounding_vector.h  rounding.h's helpers on simd.h's vectors
 *   step_vector.h  the same step on simd.h's vectors, one source for every width
 *   lean_vector.h  which of its blocks may take the lean forms (no NaN guards: #40)
 *   adamw.c        the unmeasured entry points, threaded (collage_adamw, _threads, and
 *                  _planned: a step of every planned group with the non-finite check)
 *   measured.c     the measured entry point (collage_adamw_measured)
 *   support.c      the rest: the build's identity, the non-finite check, the draw keys
 *                  of native plans, rounding test hooks
 *
 * Why headers of static inline functions: the step is specialised by inlining (constant
 * strategy, gradient dtype, measured or not), so every file that instantiates it must see
 * its code. Each entry point is one translation unit's instantiation, as it was when
 * everything lived in one file.
 *
 * Three builds of the same arithmetic: AVX-512 (F, BW, VL) intrinsics when the compiler
 * targets them; else simd.h's vectors where the target has them (x86-64 with AVX2 and FMA:
 * 8 lanes; AArch64: NEON's 4; x86 at 4 lanes with -DCOLLAGE_VECTOR_BYTES=16, for tests);
 * else a portable scalar loop (any C99 compiler; fmaf from libm).
 * Threads: collage_adamw_threads cuts the rows into spans run by OpenMP where the build has
 * it (-fopenmp; torch's runtime once loaded).
 */

#ifndef COLLAGE_NATIVE_H
#define COLLAGE_NATIVE_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define COLLAGE_AVX512 1
#else
#define COLLAGE_AVX512 0
#endif

#define COLLAGE_ABI 8

/* what collage_native_isa returns: the loop the step runs on (build.py's ISA names) */
enum { ISA_PORTABLE = 0, ISA_AVX512 = 1, ISA_VECTOR256 = 2, ISA_VECTOR128 = 3 };

/* strategies, in collage.optim.native.STRATEGY_CODES order */
enum { S_FP32, S_MIXED, S_BF16, S_KAHAN, S_STOCHASTIC, S_LIGHT, S_PLUS, S_SPLIT };

/* flags */
enum {
    F_LERP_SMALL = 1, /* lerp weight (1 - beta1) < 0.5 */
    F_DECAY = 2,      /* decay != 1: multiply (kahan: add -W * lr_wd) */
    F_SCALED = 4,     /* divide the gradient by the GradScaler scale */
    F_MAXIMIZE = 8,   /* negate the gradient */
    F_GRAD_FP32 = 16  /* gradients are float32 (else bf16) */
};

/* hyperparameters, float32 (rounded from float64 on the host, as torch rounds a Python
 * number it multiplies a float32 tensor by) */
enum { H_LERP, H_BETA2, H_OMB2, H_BC2S, H_EPS, H_NEG_STEP, H_DECAY, H_LR_WD, H_SCALE, H_COUNT };

/* the lost-update sums of one table row, collage.metrics.FIELDS order, float64 each */
enum {
    M_DOT_ED, M_DD, M_EE, M_N_NONZERO, M_N_STUCK, M_DOT_EVD, M_EVEV, M_N_STUCK_V, M_CC,
    M_N_COMP, M_N_ELEMENTS, M_COUNT
};

/* elements per float32 partial sum (collage.metrics.stats.BLOCK) */
#define SUM_BLOCK 256

/* one row of the tensor table, int64 each */
enum {
    T_N,      /* elements */
    T_W,      /* weight: float32 (fp32) or bf16 bits */
    T_G,      /* gradient: float32 or bf16 */
    T_M,      /* exp_avg: float32 (fp32, mixed) or bf16 */
    T_V,      /* exp_avg_sq: idem */
    T_VLO,    /* exp_avg_sq_lo: bf16 (plus, split) */
    T_X,      /* master (float32), compensation, weight_lo (bf16), weight_low_bits (int16) */
    T_INDEX,  /* stochastic: index of the first element in the whole tensor */
    T_KEY0,   /* stochastic: the two int32 key words of fused.stochastic_seeds */
    T_KEY1,
    T_COLS
};

/* one group of collage_adamw_planned, int64 each */
enum {
    P_STRATEGY, /* the group's strategy (S_*) */
    P_FLAGS,    /* its flags (F_*; F_GRAD_FP32 also sets the check's width) */
    P_ROWS,     /* its table's rows */
    P_ELEMENTS, /* their elements: the sum of the rows' T_N */
    P_TABLE,    /* the table: P_ROWS rows of T_COLS */
    P_H,        /* its coefficients: H_COUNT floats */
    P_COUNTERS, /* how many step counters */
    P_STEPS,    /* their addresses: P_COUNTERS int64 */
    P_STEP,     /* the value every counter must hold (below 2**24: exact in float32) */
    P_COLS
};

/* ------------------------------------------------------------------------------------ */
/* threads: OpenMP, the runtime torch itself uses                                        */
/* ------------------------------------------------------------------------------------ */

/* elements per thread at least (below it a parallel region costs more than it saves) */
#define MIN_CHUNK 65536

/* The non-finite check's elements per thread: the same work per thread as the step's
 * MIN_CHUNK (the check reads 2 or 4 bytes per element and compares, about a quarter of a
 * step's time per element: 0.13 against 0.5 ns on one Xeon core), so that a small model's
 * check is not an OpenMP region of 30 us of reading that waits for a second thread (#31). */
#define CHECK_MIN_CHUNK (4 * MIN_CHUNK)

#ifdef _OPENMP
/* How many threads share ``total`` elements: at most ``threads``, each with at least
 * ``chunk`` elements, at least one. */
static inline int64_t thread_parts(int64_t total, int threads, int64_t chunk) {
    int64_t parts = threads < 1 ? 1 : threads;
    int64_t most = total / chunk > 0 ? total / chunk : 1;
    return parts < most ? parts : most;
}
#endif

/* ------------------------------------------------------------------------------------ */
/* the exported functions (ctypes signatures: build.py's _open)                           */
/* ------------------------------------------------------------------------------------ */

/* support.c: the build's identity */
int collage_native_abi(void);
int collage_native_isa(void);
int collage_native_openmp(void);

/* adamw.c: step ``count`` tensors (rows of ``table``, T_COLS int64 each) of one strategy
 * with the coefficients ``h`` (H_COUNT floats) and ``flags``; on up to ``threads`` threads.
 * Return 0, or -1 for an unknown strategy (nothing written). */
int collage_adamw(int strategy, int flags, int64_t count, const int64_t *table,
                  const float *h);
int collage_adamw_threads(int strategy, int flags, int64_t count, const int64_t *table,
                          const float *h, int threads);
/* adamw.c: every group of a step that a native plan steps (``groups`` rows of P_COLS in
 * ``calls``), in one OpenMP region: with ``check``, first every gradient of every group
 * read for inf and nan. Returns 0 (stepped, every counter advanced), 1 (a gradient is not
 * finite), 2 (a step counter does not hold its group's P_STEP) or -1 (an unknown strategy);
 * on 1, 2 and -1 nothing was written. */
int collage_adamw_planned(int64_t groups, const int64_t *calls, int threads, int check);

/* measured.c: collage_adamw that also writes each row's lost-update sums */
int collage_adamw_measured(int strategy, int flags, int64_t count, const int64_t *table,
                           const float *h, double *sums);

/* support.c, for adamw.c (not exported): 1 if any of the elements [begin, end) at ``x``
 * (float32 when ``wide``, else bf16) is inf or nan */
__attribute__((visibility("hidden"))) int span_nonfinite(const void *x, int wide,
                                                         int64_t begin, int64_t end);

/* support.c: the non-finite check, the plans' stochastic keys, test hooks */
int collage_nonfinite(int wide, int64_t count, const int64_t *table, int threads);
void collage_stochastic_keys(int64_t count, int64_t *table, const uint64_t *states,
                             int64_t step);
int collage_stochastic_round(const float *x, int64_t n, int64_t first, int64_t key0,
                             int64_t key1, uint16_t *out, int pairs);
int collage_probe_over_bc2s(const float *x, int64_t n, float b, float *out);
int collage_residual_pairs(const float *x, int64_t n, uint16_t *hi, uint16_t *lo,
                           int pairs);

#endif /* COLLAGE_NATIVE_H */
