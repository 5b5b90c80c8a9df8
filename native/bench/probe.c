/* Roofline probe for bench/kernel.py: the cheapest possible random read-modify-write
 * of one float per cache line at sorted positions, software-prefetched. No optimizer
 * can update random coordinates faster than this loop touches their lines. */
#include "../optim_tuning.h"

int64_t stella_probe_random_rmw(float *buf, int64_t numel, const int32_t *idx, int64_t n, int32_t stride,
                                int32_t prefetch_distance) {
    if (!buf || (n > 0 && !idx) || stride < 1 || prefetch_distance < 0) return STELLA_E_ARG;
    for (int64_t j = 0; j < n; j++)
        if (idx[j] < 0 || (int64_t)idx[j] * stride >= numel) return STELLA_E_RANGE;
    const int64_t pd = prefetch_distance;
    for (int64_t j = 0; j < n; j++) {
        if (pd && j + pd < n) __builtin_prefetch(buf + (int64_t)idx[j + pd] * stride, 1, 3);
        float *p = buf + (int64_t)idx[j] * stride;
        *p = *p * 0.5f + 1.0f;
    }
    return n;
}
