/* The measured entry point: the unmeasured step's bits plus each row's lost-update sums
 * (step.h's run_piece with MEAS = 1). */

#include "native.h"
#include "step.h"

/* collage_adamw, bit for bit, that also writes each row's lost-update sums: ``sums`` holds
 * ``count`` x M_COUNT doubles (collage.metrics.FIELDS order), overwritten. */
int collage_adamw_measured(int strategy, int flags, int64_t count, const int64_t *table,
                           const float *h, double *sums) {
    if (strategy < S_FP32 || strategy > S_SPLIT) return -1;
    for (int64_t t = 0; t < count; t++) {
        const int64_t *row = table + t * T_COLS;
        run_piece(1, strategy, flags, h, row, 0, row[T_N], sums + t * M_COUNT);
    }
    return 0;
}
