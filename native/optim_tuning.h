/* The optimizer kernel's tuning: compiled constants in production, knobs in the
 * bench-only build. */
#ifndef STELLA_OPTIM_TUNING_H
#define STELLA_OPTIM_TUNING_H

#include "stella_native.h"

/* Tuning measured in docs/optimizer.md: software prefetch distance in coordinates
 * (0 = off), merge tile in coordinates, prefetch kind (0: prefetchw into L1, 1:
 * prefetcht1 into L2), and whether a tile's lines are also prefetched while it is
 * merged. Production builds compile these constants; the bench-only build
 * (-DSTELLA_TUNABLE, native/bench/tuning.c) turns them into process-wide knobs;
 * this header is also the C side of cdefs/bench.h. */
#define STELLA_TUNE_PREFETCH 96
#define STELLA_TUNE_TILE 2048
#define STELLA_TUNE_MODE 1 /* bit 0: prefetch kind; bit 1: early prefetch while merging */

#ifdef STELLA_TUNABLE
extern int stella_tune_prefetch, stella_tune_tile, stella_tune_prefetch_kind, stella_tune_early;
void stella_optim_set_tuning(int32_t prefetch_distance, int32_t tile, int32_t mode);
int64_t stella_probe_random_rmw(float *buf, int64_t numel, const int32_t *idx, int64_t n, int32_t stride,
                                int32_t prefetch_distance);
int64_t stella_probe_layout(float *mem, int64_t numel, int32_t layout, int32_t phase, const int32_t *idx,
                            const float *g, int64_t n, int32_t prefetch_distance);
#define TUNE_PREFETCH stella_tune_prefetch
#define TUNE_TILE stella_tune_tile
#define TUNE_PREFETCH_KIND stella_tune_prefetch_kind
#define TUNE_EARLY stella_tune_early
#else
#define TUNE_PREFETCH STELLA_TUNE_PREFETCH
#define TUNE_TILE STELLA_TUNE_TILE
#define TUNE_PREFETCH_KIND (STELLA_TUNE_MODE & 1)
#define TUNE_EARLY (STELLA_TUNE_MODE >> 1)
#endif

#endif
