/* Bench-only (-DSTELLA_TUNABLE): the kernel's tuning constants as process-wide knobs,
 * so that bench/kernel.py can sweep them and tests can prove they never change
 * results. Production builds compile the constants of optim_internal.h instead. */
#include "../optim_internal.h"

#ifndef STELLA_TUNABLE
#error "native/bench/ is compiled only into the bench build (-DSTELLA_TUNABLE)"
#endif

int stella_tune_prefetch = STELLA_TUNE_PREFETCH;
int stella_tune_tile = STELLA_TUNE_TILE;
int stella_tune_prefetch_kind = STELLA_TUNE_MODE & 1;
int stella_tune_early = STELLA_TUNE_MODE >> 1;

void stella_optim_set_tuning(int32_t prefetch_distance, int32_t tile, int32_t mode) {
    if (prefetch_distance >= 0) stella_tune_prefetch = prefetch_distance > 1024 ? 1024 : prefetch_distance;
    if (tile > 0) stella_tune_tile = tile > TILE_MAX ? TILE_MAX : (tile < 16 ? 16 : tile);
    if (mode >= 0 && mode <= 3) {
        stella_tune_prefetch_kind = mode & 1;
        stella_tune_early = mode >> 1;
    }
}
