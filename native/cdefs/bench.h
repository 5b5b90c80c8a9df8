/* native/bench/ (bench-only build, bench/_native_bench.py, compiled with
 * -DSTELLA_TUNABLE): the kernel's tuning knobs and the roofline probe. */
#define STELLA_TUNE_PREFETCH ...
#define STELLA_TUNE_TILE ...
#define STELLA_TUNE_MODE ...

/* Process-wide: software prefetch distance in coordinates (0 = off), the merge tile
 * in coordinates, and the prefetch kind (bit 0: prefetcht1 into L2 instead of
 * prefetchw into L1; bit 1: also prefetch while merging, one tile ahead); negative
 * values keep the current setting. The defaults are STELLA_TUNE_*. */
void stella_optim_set_tuning(int32_t prefetch_distance, int32_t tile, int32_t mode);
/* Random read-modify-write of buf[idx[j] * stride] (the bench's roofline). */
int64_t stella_probe_random_rmw(float *buf, int64_t numel, const int32_t *idx, int64_t n, int32_t stride,
                                int32_t prefetch_distance);
/* The memory of a server step's apply (phase 0) and selection (phase 1) at idx with R and
 * B beside the optimizer's record (layout 0) or inside it (layout 1), or the records alone
 * (layout 2, phase 0); native/bench/probe.c. */
int64_t stella_probe_layout(float *mem, int64_t numel, int32_t layout, int32_t phase, const int32_t *idx,
                            const float *g, int64_t n, int32_t prefetch_distance);
